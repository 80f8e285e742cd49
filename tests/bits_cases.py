"""Digests of the outputs and gradients of a set of calls: the bits the GPU data-path work must not change.

``TRITON_INTERPRET=1 python tests/bits_cases.py > tests/data/gpu_path_bits.json`` on the tree before that
work wrote the file :mod:`tests.test_gpu_path` holds every later tree to: first on 22568fa, then (after the
other branches' intended changes, the fused loss's three-pass walk) on a5a367a, integ's tree just before
``wip-gpudata`` was merged, with this file copied in (it imports nothing of that work). Each case: one op
(the fused head, the fused loss, the logits path), a dtype, a backend (eager, compile; triton through the
interpreter) and a branch ("cpu", or "cuda": the CUDA branch's half-precision matmuls into float32, served
on the CPU as a CUDA kernel forms them), with random upstream gradients on every output; its digest is the
SHA-256 of every output's and gradient's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import chunked_entropy as ce
import chunked_entropy._autograd as _autograd
import chunked_entropy._logit_blocks as blocks

aten = torch.ops.aten
N, H, V, CHUNK, VCHUNK = 40, 24, 700, 16, 256


class _HalfMM(TorchDispatchMode):
    """``mm.dtype(_out)``, which CPU torch lacks, as a CUDA kernel forms it (float32 sum of exact products)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.mm.dtype, aten.mm.dtype_out):
            res = torch.mm(args[0].float(), args[1].float())
            if func is aten.mm.dtype_out:
                return kwargs["out"].copy_(res)
            return res.to(args[2] if len(args) > 2 else kwargs["out_dtype"])
        return func(*args, **kwargs)


def _data(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 2.5 / H ** 0.5).to(dtype)
    w[5] += 40.0  # a confident column: large logit offsets
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = -100
    ups = torch.randn(3, N, generator=g, dtype=torch.float64)
    return h, w, labels, ups


def _run(op, dtype, backend, vchunk, seed=0):
    h, w, labels, ups = _data(dtype, seed)
    chunking = ce.Chunking(CHUNK, vchunk, backend=backend)
    h.requires_grad_()
    w.requires_grad_()
    if op == "head":
        out = ce.linear_log_probs_and_entropy(h, w, labels, chunking=chunking, temperature=0.7)
        outs = [out.log_probs, out.entropy]
        total = (out.log_probs * ups[0]).sum() + (out.entropy * ups[1]).sum()
        leaves = [h, w]
    elif op == "loss":
        old, adv = (ups[0] * 0.3 - 3.0).to(dtype)[None], ups[1].to(dtype)[None]
        mask = (ups[2] > -1.0)[None]
        loss, _ = ce.linear_policy_loss(h[None], w, labels.clamp_min(0)[None], old, adv, mask,
                                        loss=ce.PolicyLoss(entropy_coeff=0.01), chunking=chunking, temperature=0.7)
        outs, total, leaves = [loss], loss * ups[2, 0], [h, w]
    else:
        z = (h @ w.t()).detach().requires_grad_()
        out = ce.log_probs_and_entropy(z, labels, chunking=chunking, temperature=0.7)
        outs = [out.log_probs, out.entropy]
        total = (out.log_probs * ups[0]).sum() + (out.entropy * ups[1]).sum()
        leaves = [z]
    grads = torch.autograd.grad(total, leaves)
    d = hashlib.sha256()
    for t in [*outs, *grads]:
        d.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return d.hexdigest()


#: torch.compile refuses to trace under a dispatch mode: the compiled kernels run on the CPU branch only. The
#: Triton kernels run through Triton's interpreter, where ``TRITON_INTERPRET=1`` (a subprocess of the test).
BACKENDS = ("eager", "compile") + (("triton",) if os.environ.get("TRITON_INTERPRET") == "1" else ())
CASES = [(op, str(dtype).split(".")[-1], backend, branch, vchunk)
         for op in ("head", "loss", "logits")
         for dtype in (torch.bfloat16, torch.float32)
         for backend in BACKENDS
         for branch in (("cpu", "cuda") if op != "logits" and dtype != torch.float32 and backend != "compile"
                        else ("cpu",))
         for vchunk in ((None, VCHUNK) if op != "logits" else (None,))]


def digest(op, dtype, backend, branch, vchunk) -> str:
    dt = getattr(torch, dtype)
    if branch == "cpu":
        return _run(op, dt, backend, vchunk)
    native, casts = blocks.half_mm_native, getattr(_autograd, "casts_in_kernel", None)
    blocks.half_mm_native = lambda device: True
    if casts is not None:  # the fused loss's hand-over in one pass, as on CUDA (later trees)
        _autograd.casts_in_kernel = lambda device: True
    try:
        with _HalfMM():
            return _run(op, dt, backend, vchunk)
    finally:
        blocks.half_mm_native = native
        if casts is not None:
            _autograd.casts_in_kernel = casts


def key(case) -> str:
    return "/".join(str(x) for x in case)


if __name__ == "__main__":
    json.dump({key(c): digest(*c) for c in CASES}, sys.stdout, indent=1)
    print()
