"""A half-precision head with a bias: the logits are the model's own layer's, ``round(h @ W.T + b)`` (``F.linear``).

The library formed ``round(h @ W.T) + b`` in float32: with a bias, log-probs
off from the model's own layer (and a vLLM rollout) by up to 0.155 nats in
bf16 and 0.013 in fp16 here. Every op over hidden states fills its blocks
through one function (``_logit_blocks._logits_block``), on every backend, TP
or not: each op is held to the same op on ``F.linear``'s logits, within
float32 rounding, in bf16 and fp16, at TP 1 and 2 (gloo).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from chunked_entropy import (
    Chunking,
    Divergence,
    OutputLayer,
    PolicyLoss,
    divergence_from_logits,
    linear_divergence,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    policy_loss_from_logits,
)
from tests.helpers import run_distributed

N, H, V = 96, 32, 192
TOL = dict(rtol=1e-5, atol=1e-5)  # float32 rounding of the same logits; the old rounding was off by 1e-2 to 1e-1


def _head(dtype, seed=0, n=N, v=V):
    """Hidden states, weight and a bias large beside the matmul's ulp (biased heads: GPT-2's, Qwen's value heads)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype)
    w = (torch.randn(v, H, generator=g) * (4 / H**0.5)).to(dtype)
    b = (torch.randn(v, generator=g) * 8).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    return h, w, b, labels


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_log_probs_and_entropy_round_as_f_linear(dtype, backend):
    h, w, b, labels = _head(dtype)
    chunking = Chunking(32, vocab_chunk_size=64, backend=backend)
    out = linear_log_probs_and_entropy(h, OutputLayer(w, b), labels, chunking=chunking, temperature=0.7)
    ref = log_probs_and_entropy(F.linear(h, w, b), labels, chunking=chunking, temperature=0.7)
    torch.testing.assert_close(out.log_probs, ref.log_probs, **TOL)
    torch.testing.assert_close(out.entropy, ref.entropy, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_policy_loss_and_divergence_round_as_f_linear(dtype):
    h, w, b, labels = _head(dtype)
    g = torch.Generator().manual_seed(1)
    old, adv = -torch.rand(N, generator=g) * 3, torch.randn(N, generator=g)
    mask = torch.rand(N, generator=g) > 0.2
    loss = PolicyLoss(entropy_coeff=0.01)
    got = linear_policy_loss(h, OutputLayer(w, b), labels, old, adv, mask, loss=loss, chunking=32)
    want = policy_loss_from_logits(F.linear(h, w, b), labels, old, adv, mask, loss=loss, chunking=32)
    torch.testing.assert_close(got, want, **TOL)
    ht, wt, bt, _ = _head(dtype, seed=2)
    for kind in ("forward_kl", "reverse_kl", Divergence("jsd", 0.3)):
        got = linear_divergence(h, OutputLayer(w, b), ht, OutputLayer(wt, bt), divergence=kind, chunking=32)
        want = divergence_from_logits(F.linear(h, w, b), F.linear(ht, wt, bt), divergence=kind, chunking=32)
        torch.testing.assert_close(got, want, **TOL)


def _tp_worker(rank, world):
    group = dist.group.WORLD
    v_local = V // world
    shard = slice(rank * v_local, (rank + 1) * v_local)
    for dtype in (torch.bfloat16, torch.float16):
        h, w, b, labels = _head(dtype, seed=3)
        out = linear_log_probs_and_entropy(h, OutputLayer(w[shard], b[shard], process_group=group), labels,
                                           chunking=Chunking(32, vocab_chunk_size=48))
        ref = log_probs_and_entropy(F.linear(h, w, b), labels, chunking=32)  # the whole layer, on one rank
        torch.testing.assert_close(out.log_probs, ref.log_probs, **TOL)
        torch.testing.assert_close(out.entropy, ref.entropy, **TOL)


def test_tensor_parallel_rounds_as_f_linear():
    run_distributed(_tp_worker, 2, timeout_s=120)
