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


def reduce_stats(st: BlockStats, group) -> BlockStats:
    """Merge per-shard statistics over ``group``: one MAX, then one SUM all-reduce."""
    if not _active(group):
        return st
    m = st.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    st = rescale(st, m)
    parts = [st.s, st.zl] if st.w is None else [st.s, st.zl, st.w]
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    w = None if st.w is None else packed[2]
    return BlockStats(m, packed[0], w, packed[1])


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
    dist.all_gather_into_tensor(out, t, group=group)
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
    dist.reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM, group=group)
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
