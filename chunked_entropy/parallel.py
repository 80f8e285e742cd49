"""Process groups and collectives: every communication of the library lives here.

Vocabulary parallelism follows Megatron: with a group of size ``P``, rank ``r``
holds global vocabulary ids ``[r * V_local, (r + 1) * V_local)``. Sequence
parallelism follows Megatron too: the hidden states are split along dim 0.

Forward statistics need exactly two all-reduces per chunk (a MAX of the row
maxima, then one SUM of the stacked rescaled sums); backward of the logits
path needs none.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._stats import BlockStats, rescale

# torch 2.13 renamed the single-tensor collectives (the old names warn on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_rank_size(group) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group``; ``(0, 1)`` for None."""
    if group is None:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "process_group was given but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first, or pass process_group=None"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def reduce_stats(st: BlockStats, group, k) -> BlockStats:
    """Merge per-shard statistics over ``group``: one MAX, then one SUM all-reduce.

    ``k`` is the rows' multiplier ``x = k * u`` (see :mod:`chunked_entropy._stats`).
    """
    if not _active(group):
        return st
    m = st.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    st = rescale(st, m, k)
    parts = [st.ones, st.rest, st.zl] + [t for t in (st.w, st.q) if t is not None]
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    it = iter(packed[3:])
    w = None if st.w is None else next(it)
    q = None if st.q is None else next(it)
    return BlockStats(m, packed[0], packed[1], w, q, packed[2])


def check_same_on_every_rank(group, fields: dict, device) -> None:
    """Raise the same ValueError on every rank of ``group`` where ``fields`` differ across ranks.

    ``fields`` maps a description to an int or a 0-d int64 tensor (settings,
    sizes, fingerprints of the per-token inputs, computed on the device).
    Costs one all-gather of ``len(fields)`` int64 and, on an accelerator, one
    host sync; without a group it does nothing.
    """
    if not _active(group):
        return
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names = list(fields)
    local = torch.stack([torch.as_tensor(fields[n], dtype=torch.int64, device=device).reshape(()) for n in names])
    every = local.new_empty(world * len(names))
    _all_gather_single(every, local, group=group)
    every = every.view(world, len(names)).tolist()
    for i, name in enumerate(names):
        values = [row[i] for row in every]
        if len(set(values)) > 1:
            seen = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(
                f"{name} differs across the {world} ranks of process_group ({seen}; this is rank {rank}). "
                "Every rank of the tensor-parallel group must make the same call: the same tokens, "
                "labels, temperatures and options, and vocabulary shards of the same size"
            )


def all_reduce_sum_(t: torch.Tensor, group) -> torch.Tensor:
    """In-place SUM over ``group`` (a no-op without one)."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0 (sequence-parallel gather)."""
    if not _active(group):
        return t
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = t.new_empty((world * t.shape[0],) + tuple(t.shape[1:]))
    _all_gather_single(out, t, group=group)
    return out


def reduce_scatter_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """Sum ``t`` over ``group`` and keep this rank's slice of dim 0."""
    if not _active(group):
        return t
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // world,) + tuple(t.shape[1:]))
    if dist.get_backend(group) == dist.Backend.GLOO:
        # gloo has no reduce_scatter: sum everywhere, keep our slice.
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return out.copy_(t.narrow(0, rank * out.shape[0], out.shape[0]))
    _reduce_scatter_single(out, t, op=dist.ReduceOp.SUM, group=group)
    return out


def default_tp_group() -> Optional[object]:
    """Megatron's tensor-parallel group when megatron-core is initialized, else None."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()
