"""No host synchronisation per chunk: the ops that make the host wait for an accelerator, counted per call.

On a GPU, reading a device value on the host (``.item()``, ``bool(t)``,
``.tolist()``), ``nonzero``, boolean-mask indexing, ``masked_select``,
``repeat_interleave`` without an output size and ``unique`` stall the host
until the device catches up. Each path may do a few per call (its checks, the
kept sets' layout, a scalar upstream gradient); none may do one per chunk or
per vocabulary block. Counted here on the CPU, at the dispatcher, where the
same ops run: the count with 1, 2 and 8 chunks (and vocabulary blocks) must be
the same, and small.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chunked_entropy import (
    ChunkedVocabParallelHead,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    losses,
    policy_loss_from_logits,
)

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose, aten.nonzero,
           aten.masked_select, aten.repeat_interleave, aten.unique_consecutive, aten._unique2, aten.unique_dim}


class _HostSyncs(TorchDispatchMode):
    """Counts the dispatched ops that wait for the device (boolean-mask indexing among them)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket
        if op is aten.index and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.ops["index by a bool mask"] += 1
        elif op in SYNCING:
            self.ops[str(op)] += 1
        return func(*args, **(kwargs or {}))


B, T, H, V = 4, 16, 8, 64
N = B * T


def _data():
    g = torch.Generator().manual_seed(0)
    d = dict(hidden=torch.randn(B, T, H, generator=g), weight=torch.randn(V, H, generator=g),
             labels=torch.randint(0, V, (B, T), generator=g), old=torch.randn(B, T, generator=g) - 4,
             adv=torch.randn(B, T, generator=g), mask=torch.rand(B, T, generator=g) > 0.2,
             temperature=torch.rand(B, T, generator=g) + 0.5, teacher=torch.randint(0, V, (B, T, 5), generator=g))
    d["keep"] = (torch.randint(0, V, (N * 3,), generator=g), torch.arange(0, N * 3 + 1, 3))
    return d


def _outputs_step(d, chunk, *, head, **kw):
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    if head:
        out = linear_log_probs_and_entropy(h, w, d["labels"], chunk_size=chunk, **kw)
    else:
        out = log_probs_and_entropy(h @ w.t(), d["labels"], chunk_size=chunk, **kw)
    total = sum(t.sum() for t in (out.log_probs, out.entropy, out.log_probs_at, out.top_k_log_probs)
                if t is not None)
    total.backward()


def _loss_step(d, chunk, *, head, mode, **kw):
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    args = (d["labels"], d["old"], d["adv"], d["mask"])
    common = dict(chunk_size=chunk, loss_mode=mode, entropy_coeff=0.01, dro_beta=0.2 if mode == "dro" else None, **kw)
    if head:
        loss, _ = linear_policy_loss(h, w, *args, **common)
    else:
        loss, _ = policy_loss_from_logits(h @ w.t(), *args, **common)
    (loss * 0.5).backward()


def _module_step(d, chunk):
    head = ChunkedVocabParallelHead(d["weight"].clone().requires_grad_(), chunk_size=chunk)
    out = head(d["hidden"].clone().requires_grad_(), d["labels"])
    (out.log_probs.sum() + out.entropy.sum()).backward()


CASES = {
    "logits": lambda d, c: _outputs_step(d, c, head=False),
    "logits, temperatures, softcap": lambda d, c: _outputs_step(d, c, head=False, temperature=d["temperature"],
                                                                softcap=5.0),
    "logits, keep": lambda d, c: _outputs_step(d, c, head=False, keep=d["keep"]),
    "logits, log_probs_at, top_k": lambda d, c: _outputs_step(d, c, head=False, log_probs_at=d["teacher"], top_k=4),
    "head": lambda d, c: _outputs_step(d, c, head=True),
    "head, vocabulary blocks": lambda d, c: _outputs_step(d, c, head=True, vocab_chunk_size=max(c // 2, 1)),
    "head, keep": lambda d, c: _outputs_step(d, c, head=True, keep=d["keep"]),
    "head, log_probs_at, top_k": lambda d, c: _outputs_step(d, c, head=True, log_probs_at=d["teacher"], top_k=4),
    "the module": _module_step,
    **{f"fused loss, {m}": partial(_loss_step, head=True, mode=m) for m in losses.LOSS_MODES},
    "fused loss from logits, gspo": lambda d, c: _loss_step(d, c, head=False, mode="gspo"),
    "fused loss, keep": lambda d, c: _loss_step(d, c, head=True, mode="vanilla", keep=d["keep"]),
    "fused loss, rollout log-probs": lambda d, c: _loss_step(d, c, head=True, mode="vanilla",
                                                             rollout_log_probs=d["old"] - 0.1, rollout_is="token"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_syncs_do_not_grow_with_the_chunks(case):
    d = _data()
    counts = {}
    for chunk in (N, N // 2, N // 8):  # 1, 2 and 8 chunks; with T = 16 rows fit the first two, not the last
        with _HostSyncs() as s:
            CASES[case](d, chunk)
        counts[chunk] = s.ops
    assert counts[N] == counts[N // 2] == counts[N // 8], counts
    assert sum(counts[N].values()) <= 8, counts[N]
