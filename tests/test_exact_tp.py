"""The bug classes of vocabulary-parallel log-probs, each pinned (docs/exact-tp.md), over gloo at TP 2 and 4.

- **A target logit all-reduced without masking**: each rank gathers "the label's logit" from its own shard
  with an index clamped (or wrapped) into its shard, and the ranks SUM them: the result is a sum of TP logits,
  only one of them the label's. Pinned by labels on every shard and at every shard edge, log-probs and their
  gradient against float64; the test also shows that the unmasked sum is wrong on this data (so the data tell).
- **``log(TP)`` added to a loss**: the normalizer formed as a mean over the ranks of their shard's sums (or a
  log-sum-exp of per-rank log-sum-exps divided by TP) puts ``log(TP)`` into every log-prob and the entropy.
  Pinned by uniform rows (log-prob ``-log V`` and entropy ``log V`` exactly, not ``log V_local`` or ``+ log TP``)
  and by the normalisation itself: the log-probs of all ``V`` ids log-sum-exp to 0.
- The gradients of an entropy and a KL under DTensor's ``loss_parallel()``: tests/test_dtensor.py.

The same on the fused head (the weight sharded by rows), and what the ranks agree on: every output bitwise
equal on every rank of the group; at TP 2 bitwise independent of the chunk size and of the rows beside it (a
row alone gives the bits it gives in the batch); at TP 4 equal within float32 rounding only (the collective's
summation order follows its algorithm, which gloo and NCCL pick by message size).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import OutputLayer, linear_log_probs_and_entropy, log_probs_and_entropy
from tests.helpers import run_distributed

V_LOCAL, H = 6, 8
T = 0.7


def _data(world, seed=0):
    v = V_LOCAL * world
    g = torch.Generator().manual_seed(seed)
    edges = sorted({e for r in range(world) for e in (r * V_LOCAL, r * V_LOCAL + V_LOCAL - 1, r * V_LOCAL + 2)})
    n = len(edges) + 3
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    x[0] = 0.0  # uniform
    x[1] += 1e4  # a large offset
    x[2, v - 1] += 50.0  # confident, on the last shard
    labels = torch.tensor([0, v - 1, v - 1] + edges)
    return x.float().double(), labels  # the float32 inputs, exactly, in float64


def _ref(x64, labels, t):
    lsm = torch.log_softmax(x64 / t, -1)
    return lsm.gather(-1, labels[:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def _unmasked_target_sum(shard, labels, rank, group):
    """The bug: each rank's clamped gather, summed over the ranks without masking the labels off its shard."""
    local = (labels - rank * V_LOCAL).clamp(0, V_LOCAL - 1)
    z = shard.gather(-1, local[:, None]).squeeze(-1).clone()
    dist.all_reduce(z, group=group)
    return z


def _worker(rank, world):
    group = dist.group.WORLD
    x64, labels = _data(world)
    v = x64.shape[-1]
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    g = torch.Generator().manual_seed(3)
    g_lp, g_h = torch.randn(len(labels), generator=g, dtype=torch.float64), torch.randn(len(labels), generator=g,
                                                                                         dtype=torch.float64)
    xr = x64.clone().requires_grad_()
    lp_ref, h_ref = _ref(xr, labels, T)
    ((lp_ref * g_lp).sum() + (h_ref * g_h).sum()).backward()

    shard = x64[:, cols].float().clone().requires_grad_()
    layer = OutputLayer(process_group=group)
    out = log_probs_and_entropy(shard, labels, layer=layer, temperature=T, chunking=4)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    torch.testing.assert_close(out.log_probs.double(), lp_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), h_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shard.grad.double(), xr.grad[:, cols], rtol=1e-5, atol=1e-6)

    # the data tell an unmasked target sum: off by far more than float32 rounding on the edge labels
    z_bad = _unmasked_target_sum(x64[:, cols].float() / T, labels, rank, group).double()
    lse = torch.logsumexp(x64 / T, -1)
    assert ((z_bad - lse) - lp_ref.detach()).abs().max() > 1.0

    # log(TP): uniform rows give exactly -log V and log V; every id's log-prob normalises to 0
    torch.testing.assert_close(out.log_probs[0].double(), torch.tensor(-math.log(v), dtype=torch.float64),
                               rtol=0, atol=2e-6)
    torch.testing.assert_close(out.entropy[0].double(), torch.tensor(math.log(v), dtype=torch.float64),
                               rtol=0, atol=2e-6)
    assert abs(math.log(world)) > 0.6  # the offset the bug adds is far outside the tolerance above
    every_id = torch.arange(v).expand(len(labels), v)
    at = log_probs_and_entropy(x64[:, cols].float(), None, layer=layer, temperature=T, log_probs_at=every_id)
    torch.testing.assert_close(torch.logsumexp(at.log_probs_at.double(), -1), torch.zeros(len(labels),
                               dtype=torch.float64), rtol=0, atol=2e-6)

    # the fused head: the weight sharded by rows
    w64 = (torch.randn(v, H, generator=g, dtype=torch.float64) / 2).float().double()
    h64 = (torch.randn(len(labels), H, generator=g, dtype=torch.float64) * 2).float().double()
    wr, hr = w64.clone().requires_grad_(), h64.clone().requires_grad_()
    lp_ref, h_ref = _ref(hr @ wr.T, labels, T)
    ((lp_ref * g_lp).sum() + (h_ref * g_h).sum()).backward()
    w = w64[cols].float().clone().requires_grad_()
    h = h64.float().clone().requires_grad_()
    f = linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group), labels, temperature=T, chunking=3)
    ((f.log_probs * g_lp.float()).sum() + (f.entropy * g_h.float()).sum()).backward()
    torch.testing.assert_close(f.log_probs.double(), lp_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f.entropy.double(), h_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), wr.grad[cols], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=1e-5, atol=1e-6)

    # what the ranks agree on: the same bits on every rank of the group
    for o in (out.log_probs, out.entropy, f.log_probs, f.entropy):
        gathered = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(gathered, o.detach().contiguous(), group=group)
        assert all(torch.equal(a, gathered[0]) for a in gathered)
    # the chunk size and the rows beside a row: the same bits at TP 2, where the cross-rank sum has two operands
    # (a + b == b + a exactly); at TP 4 the collective's own order (gloo and NCCL choose their algorithm by the
    # message size, hence by the chunk's row count) can move the last bit: equal within float32 rounding only
    same = torch.equal if world == 2 else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-7))
    local = x64[:, cols].float()
    for chunk in (1, 2, 5, 1000):
        o = log_probs_and_entropy(local, labels, layer=layer, temperature=T, chunking=chunk)
        assert same(o.log_probs, out.log_probs.detach()) and same(o.entropy, out.entropy.detach()), chunk
    for i in range(len(labels)):
        o = log_probs_and_entropy(local[i:i + 1], labels[i:i + 1], layer=layer, temperature=T)
        assert same(o.log_probs[0], out.log_probs[i].detach()) and same(o.entropy[0], out.entropy[i].detach()), i


@pytest.mark.parametrize("world", [2, 4])
def test_no_unmasked_target_no_log_tp_exact_and_agreed_bits(world):
    run_distributed(_worker, world, timeout_s=120)
