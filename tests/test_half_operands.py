"""Every matmul of a half-precision call takes half-precision operands (tensor cores on a GPU).

On CUDA the library multiplies bf16/fp16 operands into a float32 result with
``torch.mm(..., out_dtype=torch.float32)``; a CPU has no such kernel, so the
library there multiplies float32 copies (the same exact sum of products). To
check the CUDA branch on this machine, the tests below switch it on
(``_logit_blocks.half_mm_native``) and serve the ``mm.dtype`` / ``mm.dtype_out``
overloads that CPU torch lacks from a ``TorchDispatchMode``, which logs the
dtypes of the operands of every matmul dispatched. ``tests/test_cuda.py``
runs the same log on a GPU without the stand-in.

Asserted: no matmul of a half-precision call has two float32 operands (nor
with ``logits_dtype=torch.float32``: :mod:`tests.test_half_mm`), and the
results equal, bit for bit, those of the CPU branch.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import chunked_entropy._logit_blocks as blocks
import chunked_entropy.config as config
from chunked_entropy import (
    Chunking,
    OutputLayer,
    PolicyLoss,
    linear_divergence,
    linear_divergence_loss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
)

aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.linear, aten.addmv, aten.mv, aten.dot}


class _MatmulLog(TorchDispatchMode):
    """Logs ``(op, dtypes of the matrix operands)``; serves ``mm.dtype(_out)`` as a CUDA kernel would compute it
    (float32 accumulation of the half-precision products, written in ``out_dtype``)."""

    def __init__(self):
        super().__init__()
        self.log, self.shapes = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket
        if op in MATMULS:
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1]
            operands = mats[-2:] if op in (aten.addmm, aten.baddbmm) else mats[:2]
            self.log.append((str(func), tuple(t.dtype for t in operands)))
            self.shapes.append(tuple(tuple(t.shape) for t in operands))
        if func in (aten.mm.dtype, aten.mm.dtype_out):
            a, b, out_dtype = args[0], args[1], args[2] if len(args) > 2 else kwargs["out_dtype"]
            assert a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype, (a.dtype, b.dtype)
            res = torch.mm(a.to(torch.float32), b.to(torch.float32)).to(out_dtype)
            if func is aten.mm.dtype_out:
                return kwargs["out"].copy_(res)
            return res
        return func(*args, **kwargs)

    def float32_pairs(self):
        return [entry for entry in self.log if entry[1] and all(d == torch.float32 for d in entry[1])]


def _data(dtype, seed=0, n=24, h=16, v=300):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    up = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden, weight, labels, up


def _head(hidden, weight, labels, up, vocab_chunk_size=None, logits_dtype=None):
    out = linear_log_probs_and_entropy(hidden, OutputLayer(weight, logits_dtype=logits_dtype), labels,
                                       chunking=Chunking(8, vocab_chunk_size))
    return (out.log_probs * up[0]).sum() + (out.entropy * up[1]).sum()


def _loss(hidden, weight, labels, up, vocab_chunk_size=None):
    old = torch.full(labels.shape, -5.0)
    loss, _ = linear_policy_loss(hidden, weight, labels, old, up[0], torch.ones(labels.shape, dtype=torch.bool),
                                 loss=PolicyLoss(entropy_coeff=0.01), chunking=Chunking(8, vocab_chunk_size))
    return loss


def _divergence(hidden, weight, labels, up, vocab_chunk_size=None):
    teacher_w = (weight.float() * 1.1).to(weight.dtype)
    out = linear_divergence(hidden, weight, hidden.detach(), teacher_w, chunking=Chunking(8, vocab_chunk_size))
    return (out.divergence * up[0]).sum()


def _divergence_loss(hidden, weight, labels, up, vocab_chunk_size=None):
    teacher_w = (weight.float() * 1.1).to(weight.dtype)
    return linear_divergence_loss(hidden, weight, hidden.detach(), teacher_w,
                                  chunking=Chunking(8, vocab_chunk_size)).loss * 3.0


OPS = {"head": _head, "loss": _loss, "divergence": _divergence, "divergence_loss": _divergence_loss}


def _grads(op, dtype, native: bool, monkeypatch, **kw):
    hidden, weight, labels, up = _data(dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    monkeypatch.setattr(blocks, "half_mm_native", lambda device: native)
    mode = _MatmulLog()
    with mode:
        OPS[op](hidden, weight, labels, up, **kw).backward()
    return mode, (hidden.grad, weight.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("vocab_chunk_size", [None, 64])
def test_no_float32_matmul_in_a_half_precision_call(op, dtype, vocab_chunk_size, monkeypatch):
    kw = {} if vocab_chunk_size is None else dict(vocab_chunk_size=vocab_chunk_size)
    mode, grads = _grads(op, dtype, True, monkeypatch, **kw)
    assert mode.log, "no matmul was dispatched"
    assert not mode.float32_pairs(), mode.float32_pairs()
    assert all(d in (torch.bfloat16, torch.float16) for _, ds in mode.log for d in ds), mode.log
    # the CPU branch (float32 copies of the half-precision operands) forms the same sums
    _, cpu_grads = _grads(op, dtype, False, monkeypatch, **kw)
    for got, want in zip(grads, cpu_grads, strict=True):
        assert got.dtype == dtype and torch.equal(got, want)


def test_float32_logits_multiply_float32_copies_without_the_kernel(monkeypatch):
    # with the half-operand kernel, logits_dtype=torch.float32 takes half operands too (tests/test_half_mm.py)
    mode, _ = _grads("head", torch.bfloat16, False, monkeypatch, logits_dtype=torch.float32)
    assert mode.float32_pairs(), "logits_dtype=torch.float32 without the kernel: float32 matmuls"


def test_weight_gradient_is_one_matmul_per_vocabulary_block(monkeypatch):
    # half-precision weights: each block's weight gradient is one matmul over every token ([tokens, block].T @
    # [tokens, H]), not one per chunk summed into a float32 [V, H] accumulator
    monkeypatch.setattr(config, "GRAD_BUFFER_BYTES", 24 * 128 * 2)  # blocks of 128 columns for 24 bf16 tokens
    mode, _ = _grads("head", torch.bfloat16, True, monkeypatch)
    n, h = 24, 16
    wgrads = [shapes for shapes in mode.shapes if shapes[1] == (n, h)]
    assert wgrads == [((128, n), (n, h)), ((128, n), (n, h)), ((44, n), (n, h))], wgrads


def test_unblocked_vocabulary_is_blocked_to_the_chunk_buffer_budget(monkeypatch):
    # vocab_chunk_size not given: a float32 [chunk, V] buffer over CHUNK_BUFFER_BYTES blocks the vocabulary in
    # multiples of 128 columns, with the same results as asking for those blocks
    hidden, weight, labels, up = _data(torch.float32, v=600)
    monkeypatch.setattr(config, "CHUNK_BUFFER_BYTES", 8 * 256 * 4)  # 8-row chunks: blocks of 256 columns
    def block(vocab_chunk_size, width):  # the forward's block of 8-row chunks over 24 tokens, as a call sizes it
        return config.walk_plan(Chunking(8, vocab_chunk_size), tokens=24, width=width, dtype=torch.float32,
                                device=torch.device("cpu"), kernels=False).vocab_chunk_size

    assert block(None, 600) == 256
    assert block(None, 200) == 200 and block(50, 600) == 50
    results = []
    for kw in ({}, dict(vocab_chunk_size=256)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        mode = _MatmulLog()
        with mode:
            _head(h, w, labels, up, **kw).backward()
        widths = {shapes[1][1] for shapes in mode.shapes if shapes[0] == (8, 16)}  # h_chunk @ W_block.T
        results.append((widths, h.grad, w.grad))
    assert results[0][0] == {256, 88}, results[0][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1:], results[1][1:], strict=True))
