"""Which torch kernels the half-precision matmuls use, and what runs where torch lacks them.

``torch.mm(a, b, out_dtype=torch.float32)`` (half-precision operands, a float32
result) came with torch 2.8, for CUDA only, while the library admits
``torch>=2.4``. :func:`chunked_entropy._logit_blocks.half_mm_native` asks the
dispatcher whether the installed torch has that kernel for the device; where it
has not (a CPU; CUDA under torch 2.4-2.7), the library multiplies float32 copies
of the operands. The CPU stands in for a CUDA device below (it has no such kernel
in any torch, as CUDA has none before 2.8).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import chunked_entropy._logit_blocks as blocks
from chunked_entropy import (
    Chunking,
    OutputLayer,
    PolicyLoss,
    linear_divergence,
    linear_divergence_loss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
)
from tests.test_half_operands import OPS, _data, _MatmulLog

HALF = (torch.bfloat16, torch.float16)


def _mm_out_dtype_runs(device: str) -> bool:
    a = torch.ones(2, 3, dtype=torch.bfloat16, device=device)
    try:
        torch.mm(a, a.t(), out_dtype=torch.float32)
        torch.mm(a, a.t(), out_dtype=torch.float32, out=torch.empty(2, 2, device=device))
    except (NotImplementedError, TypeError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("device, key", [("cpu", "CPU"), ("meta", "Meta")])
def test_the_feature_test_agrees_with_torch(device, key):
    # the gate reads the dispatcher: True exactly where torch.mm(..., out_dtype=...) runs (meta: torch >= 2.8;
    # the CPU: never), and an unknown key is no kernel, not an error
    assert blocks.mm_out_dtype_kernel(key) is _mm_out_dtype_runs(device)
    assert blocks.mm_out_dtype_kernel("NoSuchDispatchKey") is False
    assert not blocks.half_mm_native(torch.device("cpu"))


def test_cuda_takes_out_dtype_only_where_torch_has_its_kernel(monkeypatch):
    # this CPU build registers no CUDA kernels: a CUDA device under it (as under torch 2.4-2.7) gets the fallback
    assert blocks.half_mm_native(torch.device("cuda")) is blocks.mm_out_dtype_kernel("CUDA")
    monkeypatch.setattr(blocks, "mm_out_dtype_kernel", lambda key: key == "CUDA")
    assert blocks.half_mm_native(torch.device("cuda")) and not blocks.half_mm_native(torch.device("cpu"))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("vocab_chunk_size", [None, 64])
def test_without_the_kernel_the_fallback_runs_and_computes_the_same(op, dtype, vocab_chunk_size, monkeypatch):
    """The CPU registered as a half-matmul device, as CUDA is, under a torch without its ``mm.dtype`` kernel (as
    torch 2.4-2.7 on CUDA): every bf16/fp16 op runs forward and backward on float32 copies, never calls the
    missing overload (which raised there), and equals, bit for bit, the half-operand branch served as CUDA's."""
    kw = {} if vocab_chunk_size is None else dict(vocab_chunk_size=vocab_chunk_size)
    results = []
    for native in (False, True):
        monkeypatch.setattr(blocks, "HALF_MM_DEVICES", {"cpu": "CPU"})
        if native:  # the half-operand branch, its kernel served by the log's stand-in
            monkeypatch.setattr(blocks, "mm_out_dtype_kernel", lambda key: True)
        hidden, weight, labels, up = _data(dtype)
        hidden.requires_grad_()
        weight.requires_grad_()
        mode = _MatmulLog()
        with mode:
            OPS[op](hidden, weight, labels, up, **kw).backward()
        dtype_overloads = [f for f, _ in mode.log if ".dtype" in f]
        assert bool(dtype_overloads) is native, mode.log
        results.append((hidden.grad, weight.grad))
    for got, want in zip(*results, strict=True):
        assert got.dtype == dtype and torch.equal(got, want)


# ----------------------------------------------------------------------------- logits_dtype=torch.float32


def _f32_head(hidden, weight, labels, up, bias=None):
    out = linear_log_probs_and_entropy(hidden, OutputLayer(weight, bias, logits_dtype=torch.float32), labels,
                                       chunking=Chunking(8, 64))
    return (out.log_probs * up[0]).sum() + (out.entropy * up[1]).sum()


def _f32_loss(hidden, weight, labels, up):
    old = torch.full(labels.shape, -5.0)
    loss, _ = linear_policy_loss(hidden, OutputLayer(weight, logits_dtype=torch.float32), labels, old, up[0],
                                 torch.ones(labels.shape, dtype=torch.bool), loss=PolicyLoss(entropy_coeff=0.01),
                                 chunking=Chunking(8))
    return loss


def _f32_divergence(hidden, weight, labels, up):
    teacher = OutputLayer((weight.float() * 1.1).to(weight.dtype), logits_dtype=torch.float32)
    out = linear_divergence(hidden, OutputLayer(weight, logits_dtype=torch.float32), hidden.detach(), teacher,
                            chunking=Chunking(8, 64))
    return (out.divergence * up[0]).sum()


def _f32_divergence_loss(hidden, weight, labels, up):
    teacher = OutputLayer((weight.float() * 1.1).to(weight.dtype), logits_dtype=torch.float32)
    return linear_divergence_loss(hidden, OutputLayer(weight, logits_dtype=torch.float32), hidden.detach(), teacher,
                                  chunking=Chunking(8)).loss * 3.0


F32_OPS = {"head": _f32_head, "loss": _f32_loss, "divergence": _f32_divergence,
           "divergence_loss": _f32_divergence_loss}


def _run_f32(op, dtype, native, monkeypatch, scale=1.0):
    monkeypatch.setattr(blocks, "HALF_MM_DEVICES", {"cpu": "CPU"})  # the CPU as CUDA: the stand-in serves mm.dtype
    monkeypatch.setattr(blocks, "mm_out_dtype_kernel", lambda key: native)
    hidden, weight, labels, up = _data(dtype)
    hidden = (hidden.float() * scale).to(dtype).requires_grad_()
    weight.requires_grad_()
    mode = _MatmulLog()
    with mode:
        F32_OPS[op](hidden, weight, labels, up).backward()
    return mode, hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", sorted(F32_OPS))
def test_float32_logits_take_half_operands_where_the_kernel_is(op, dtype, monkeypatch):
    """``logits_dtype=torch.float32`` on bf16/fp16 weights: with the half-operand kernel (CUDA, torch >= 2.8)
    every matmul of every op over hidden states, forward and backward, takes half-precision operands (the float32
    logit gradient split into three half-precision pieces), and the results are the float32 ones (the kernel-less
    branch multiplies float32 copies) within float32 summation error; without it, float32 copies."""
    mode, gh, gw = _run_f32(op, dtype, True, monkeypatch)
    assert mode.log, "no matmul was dispatched"
    assert all(d in HALF for _, ds in mode.log for d in ds), [e for e in mode.log if torch.float32 in e[1]]
    cpu_mode, cpu_gh, cpu_gw = _run_f32(op, dtype, False, monkeypatch)
    assert cpu_mode.float32_pairs(), "without the kernel, float32 copies"
    for got, want in ((gh, cpu_gh), (gw, cpu_gw)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)  # one rounding to dtype


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["logits~4", "logits~120"])
def test_float32_logits_are_float32_linear_of_the_upcast_operands(dtype, scale, monkeypatch):
    """Against ``F.linear`` of the upcast operands: the log-probs and entropy from the half-operand branch (and
    the kernel-less one) no worse than plain float32 PyTorch's on the same upcast operands, relative to float64;
    the gradients within one rounding to the weight's dtype of float64's. Large logits included (where bf16
    logits are off by 0.05 in the log-prob)."""
    g = torch.Generator().manual_seed(5)
    n, h, v = 24, 64, 300
    hidden = (torch.randn(n, h, generator=g) * scale / 8).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    bias = (torch.randn(v, generator=g)).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    up = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    def plain(dt):
        hh, ww, bb = (t.to(dt).requires_grad_() for t in (hidden, weight, bias))
        logits = F.linear(hh, ww, bb)
        lp = torch.log_softmax(logits, dim=-1)
        out = (lp.gather(1, labels[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1))
        ((out[0].double() * up[0]).sum() + (out[1].double() * up[1]).sum()).backward()
        return [o.double() for o in out] + [hh.grad.double(), ww.grad.double(), bb.grad.double()]

    ref, f32 = plain(torch.float64), plain(torch.float32)
    for native in (True, False):
        monkeypatch.setattr(blocks, "HALF_MM_DEVICES", {"cpu": "CPU"})
        monkeypatch.setattr(blocks, "mm_out_dtype_kernel", lambda key, native=native: native)
        hh, ww, bb = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        with _MatmulLog() as mode:
            out = linear_log_probs_and_entropy(hh, OutputLayer(ww, bb, logits_dtype=torch.float32), labels,
                                               chunking=Chunking(8, 64))
            ((out.log_probs.double() * up[0]).sum() + (out.entropy.double() * up[1]).sum()).backward()
        assert all(d in HALF for _, ds in mode.log for d in ds) is native
        for got, want, base in zip((out.log_probs, out.entropy), ref[:2], f32[:2], strict=True):
            err, base_err = (got.double() - want).abs().max(), (base - want).abs().max()
            assert err <= 2 * base_err + 1e-6, (native, float(err), float(base_err))
        for got, want in zip((hh.grad, ww.grad, bb.grad), ref[2:], strict=True):
            assert got.dtype == dtype
            # the float32 gradient rounded once to the parameter's dtype (float32 summation error far below it)
            rnd = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
            torch.testing.assert_close(got.double(), want, rtol=2 * rnd, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", HALF)
def test_the_split_matmul_is_the_float32_matmul(dtype, monkeypatch):
    """:func:`_split_mm` (through the stand-in kernel) against the float32 matmul of the widened operands, on
    rows whose entries span 60 binades (fp16's exponent range is 30) and rows of zeros; either operand float32."""
    g = torch.Generator().manual_seed(9)
    a = torch.randn(16, 40, generator=g) * torch.logspace(-30, 30, 16, base=2.0).unsqueeze(1)
    a[3] = 0.0
    a[5, ::3] *= 1e-20
    b = torch.randn(40, 24, generator=g).to(dtype)
    monkeypatch.setattr(blocks, "mm_out_dtype_kernel", lambda key: True)
    with _MatmulLog() as mode:
        got = blocks._split_mm(a, b, torch.float32)
        got_t = blocks._split_mm(b.t(), a.t(), torch.float32)
    assert [ds for _, ds in mode.log] == [(dtype, dtype)] * 6
    want = a.double() @ b.double()
    bound = 40 * 2.0 ** -24 * (a.double().abs() @ b.double().abs())  # float32 summation error
    assert ((got.double() - want).abs() <= bound).all()
    assert ((got_t.t().double() - want).abs() <= bound).all()
    assert torch.equal(got[3], torch.zeros(24))
