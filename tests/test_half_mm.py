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

import chunked_entropy._logit_blocks as blocks
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
