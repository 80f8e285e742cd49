"""Vocab-parallel log_probs_and_entropy over real gloo process groups (2 and 4 processes).

Every rank builds the same full-vocabulary logits, keeps its Megatron shard
(global ids ``[r*V_local, (r+1)*V_local)``), and checks its outputs against the
float64 full-vocabulary reference and its gradient against the reference
gradient's slice. Outputs must be bitwise identical on every rank; forward
makes at most two collectives per chunk and backward none. Each spawn costs
seconds, so one spawned function runs all cases for a world size.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import OutputLayer, log_probs_and_entropy
from tests.helpers import reference, run_distributed

VAL = dict(rtol=1e-5, atol=1e-5)
GRAD = dict(rtol=1e-5, atol=1e-6)
BF16_GRAD = dict(rtol=2**-8, atol=1e-6)  # one rounding to bf16 (see test_logits.py)


class _Counting:
    """Counts calls to torch.distributed collectives; in backward, any call is an error."""

    NAMES = (
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
        "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce",
    )

    def __init__(self):
        self.calls = 0
        self.forbid = False
        self.real = {k: getattr(dist, k) for k in self.NAMES if hasattr(dist, k)}  # all_gather_single: torch >= 2.12

    def __enter__(self):
        for k, f in self.real.items():
            setattr(dist, k, self._wrap(k, f))
        return self

    def _wrap(self, name, f):
        def g(*a, **kw):
            if self.forbid:
                raise AssertionError(f"backward called torch.distributed.{name}")
            self.calls += 1
            return f(*a, **kw)

        return g

    def __exit__(self, *exc):
        for k, f in self.real.items():
            setattr(dist, k, f)


def _labels_on_every_shard_and_edge(shape, v_local, world, pad, g):
    """Random ids in [0, V_global - pad), with r*V_local and r*V_local - 1 for every r placed in."""
    v_global = v_local * world
    labels = torch.randint(0, v_global - pad, shape, generator=g).reshape(-1)
    edges = [0, v_global - pad - 1]
    for r in range(1, world):
        edges += [r * v_local - 1, r * v_local]
    edges += [r * v_local + v_local // 2 for r in range(world)]  # inside every shard
    edges = [e for e in edges if e < v_global - pad]
    assert labels.numel() >= len(edges)
    labels[: len(edges)] = torch.tensor(edges)
    return labels.reshape(shape)


def _check_case(rank, world, group, case, g):
    shape, v_local = case["shape"], case["v_local"]
    dtype = case.get("dtype", torch.float32)
    pad = case.get("pad", 0)
    v_global = v_local * world
    full = (torch.randn(*shape, v_global, generator=g, dtype=torch.float64) * 3).to(dtype)
    if pad:
        full[..., v_global - pad :] = float("-inf")
    labels = _labels_on_every_shard_and_edge(shape, v_local, world, pad, g)
    mask = None
    if case.get("mask"):
        mask = torch.rand(shape, generator=g) > 0.3
        labels.view(-1)[-1] = -100
    temperature = case.get("temperature", 1.0)
    if temperature == "per_sample":
        temperature = torch.rand(shape[0], *[1] * (len(shape) - 1), generator=g) + 0.5
    g_lp = torch.randn(shape, generator=g, dtype=torch.float64)
    g_h = torch.randn(shape, generator=g, dtype=torch.float64)
    g_q = torch.randn(shape, generator=g, dtype=torch.float64)
    tf = case.get("tf", {})
    pi2 = case.get("pi2", False)
    use = case.get("use", ("lp", "h") + (("q",) if pi2 else ()))
    compute_entropy = case.get("compute_entropy", True)
    chunk = case["chunk"]

    # our shard, possibly through a non-contiguous view of a wider buffer
    shard = full[..., rank * v_local : (rank + 1) * v_local]
    if case.get("strided"):
        wide = torch.cat([shard, torch.zeros_like(shard[..., :3])], dim=-1)
        leaf = wide.clone().requires_grad_(True)
        logits = leaf[..., :v_local]
    else:
        leaf = shard.clone().requires_grad_(True)
        logits = leaf
    version = leaf._version

    with _Counting() as counter:
        out = log_probs_and_entropy(logits, labels, layer=OutputLayer(process_group=group, **tf), chunking=chunk,
                                    temperature=temperature, compute_entropy=compute_entropy, label_mask=mask,
                                    compute_sum_pi_squared=pi2)
        n = math.prod(shape)
        # two per chunk, and one small all-gather per call: every rank makes the same call
        assert counter.calls <= 2 * math.ceil(n / chunk) + 1, (counter.calls, n, chunk)
        loss = 0
        if "lp" in use:
            loss = loss + (out.log_probs * g_lp.float()).sum()
        if "h" in use:
            loss = loss + (out.entropy * g_h.float()).sum()
        if "q" in use:
            loss = loss + (out.sum_pi_squared * g_q.float()).sum()
        counter.forbid = True  # backward needs no communication
        loss.backward()
    assert leaf._version == version

    # float64 reference on the full vocabulary
    xr = full.double().requires_grad_(True)
    t64 = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    lp_ref, h_ref, q_ref = reference(xr, labels, temperature=t64, label_mask=mask, sum_pi_squared=True, **tf)
    ref_loss = 0
    if "q" in use:
        ref_loss = ref_loss + (q_ref * g_q).sum()
    if "lp" in use:
        ref_loss = ref_loss + (lp_ref * g_lp).sum()
    if "h" in use:
        ref_loss = ref_loss + (h_ref * g_h).sum()
    ref_loss.backward()

    torch.testing.assert_close(out.log_probs.double(), lp_ref.detach(), **VAL)
    if compute_entropy:
        torch.testing.assert_close(out.entropy.double(), h_ref.detach(), **VAL)
    else:
        assert out.entropy is None
    if pi2:
        torch.testing.assert_close(out.sum_pi_squared.double(), q_ref.detach(), **VAL)
    grad = leaf.grad[..., :v_local]
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    if leaf.grad.shape[-1] > v_local:
        assert (leaf.grad[..., v_local:] == 0).all()
    ref_slice = xr.grad[..., rank * v_local : (rank + 1) * v_local]
    torch.testing.assert_close(grad.double(), ref_slice, **(GRAD if dtype == torch.float32 else BF16_GRAD))

    # outputs bitwise identical on every rank of the group
    for o in [out.log_probs] + ([out.entropy] if compute_entropy else []):
        gathered = [torch.empty_like(o) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, o.contiguous(), group=group)
        for other in gathered:
            assert torch.equal(other, gathered[0])


CASES = [
    dict(shape=(3, 5), v_local=7, chunk=3),
    dict(shape=(13,), v_local=5, chunk=1),
    dict(shape=(3, 4), v_local=6, chunk=100, temperature=0.7),
    dict(shape=(3, 4), v_local=6, chunk=5, temperature="per_sample", mask=True),
    dict(shape=(2, 6), v_local=8, chunk=4, pad=3),  # Megatron's -inf padded tail
    dict(shape=(2, 6), v_local=8, chunk=4, pad=8 + 2),  # the last shard is all padding
    dict(shape=(3, 5), v_local=7, chunk=3, compute_entropy=False, use=("lp",)),
    dict(shape=(3, 5), v_local=7, chunk=3, use=("h",)),
    dict(shape=(3, 5), v_local=7, chunk=3, use=("lp",), mask=True),
    dict(shape=(3, 5), v_local=9, chunk=4, dtype=torch.bfloat16, temperature=1.3),
    dict(shape=(3, 4), v_local=6, chunk=5, strided=True),
    dict(shape=(3, 5), v_local=7, chunk=3, pi2=True, temperature="per_sample"),
    dict(shape=(3, 5), v_local=7, chunk=4, pi2=True, tf=dict(softcap=2.0, logit_scale=0.7), temperature=0.8),
    dict(shape=(2, 6), v_local=8, chunk=4, pad=3, tf=dict(logit_scale=0.125)),
]


def _all_cases(rank, world, group, seed, cases=CASES):
    for i, case in enumerate(cases):
        if case.get("pad", 0) >= case["v_local"] * world:
            continue
        g = torch.Generator().manual_seed(seed * 1000 + i)  # the same data on every rank of a group
        try:
            _check_case(rank, world, group, case, g)
        except Exception as e:
            raise AssertionError(f"case {i} {case}: {e}") from e


def _worker(rank, world):
    # the whole world as one tensor-parallel group
    _all_cases(rank, world, dist.group.WORLD, seed=1)
    if world == 4:
        # Megatron-style subgroups: the shard index is the rank *in the group*.
        # Contiguous [0,1],[2,3] and strided [0,2],[1,3] groups, different data per group.
        for layout in ([[0, 1], [2, 3]], [[0, 2], [1, 3]]):
            groups = [dist.new_group(ranks) for ranks in layout]
            mine = next(i for i, ranks in enumerate(layout) if rank in ranks)
            grp = groups[mine]
            _all_cases(dist.get_rank(grp), 2, grp, seed=10 + mine, cases=CASES[2:5])


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_full_vocabulary(world):
    run_distributed(_worker, world)
