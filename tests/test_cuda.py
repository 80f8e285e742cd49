"""On the GPU, where users train: every public op on CUDA in bfloat16, float16 and float32.

Skipped, with the reason, where no CUDA device is present. Covered per op,
dtype and backend (every entry of ``chunked_entropy._kernels.BACKENDS``):

- values and gradients against float64 of the same rounded inputs, with
  random upstream gradients on every output, within a small multiple of
  plain autograd's own error in the input dtype (the model's layer: logits
  in the input dtype, softmax in float32);
- bitwise determinism (two calls, every output and gradient equal);
- the host-sync rule: one synchronisation per call, forward and backward
  (the call's value checks), and none with ``CHUNKED_ENTROPY_CHECKS=async``
  under ``torch.cuda.set_sync_debug_mode("error")``;
- no matmul of a half-precision call has two float32 operands (float32 x
  float32 runs on the CUDA cores, not the tensor cores);
- bad input raises the CPU's ``ValueError`` and leaves the CUDA context
  usable (each case in a fresh process: a device-side assert would poison
  the rest of the session).

``CHUNKED_ENTROPY_TEST_DEVICE=cpu`` runs the device-independent tests on the
CPU instead (a check of this module itself; the sync and context tests stay
CUDA-only). Written for torch >= 2.11.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import chunked_entropy as ce
from chunked_entropy import Chunking, losses
from chunked_entropy._checks import CHECKS_ENV
from chunked_entropy._kernels import BACKENDS

_FORCED = os.environ.get("CHUNKED_ENTROPY_TEST_DEVICE")
DEVICE = torch.device(_FORCED or "cuda")
HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not HAS_CUDA,
                                reason="no CUDA device: the GPU tests run where torch.cuda.is_available()")
cuda_only = pytest.mark.skipif(not HAS_CUDA or DEVICE.type != "cuda",
                               reason="needs a CUDA device (sync debug mode, a CUDA context)")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
B, T, H, V = 2, 48, 64, 1000  # V not a multiple of the chunk widths; T * B = 96 tokens, chunks of 32
CHUNK = 32
TEMPERATURE = 0.9


# ----------------------------------------------------------------------------- inputs


def _inputs(seed: int = 0) -> dict:
    """float64 masters on the device: each call rounds them to its dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(DEVICE)

    d = dict(hidden=r(B, T, H), weight=r(V, H, scale=2.5 / math.sqrt(H)), t_hidden=r(B, T, H),
             t_weight=r(V, H, scale=2.5 / math.sqrt(H)), old=r(B, T, scale=0.1) - 3.0, adv=r(B, T),
             logits=r(B, T, V, scale=3.0), lp=r(B, T, scale=0.3) - 3.0)
    d["labels"] = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    d["mask"] = (torch.rand(B, T, generator=g) > 0.2).to(DEVICE)
    d["teacher_ids"] = torch.randint(0, V, (B, T, 3), generator=g).to(DEVICE)
    for name in ("g_lp", "g_ent", "g_div", "g_at"):
        d[name] = r(B, T, 3) if name == "g_at" else r(B, T)
    d["g_loss"] = r(())
    return d


def _leaf(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.detach().to(dtype).clone().requires_grad_()


# ----------------------------------------------------------------------------- the plain references
# Written out in torch (not from the library): ``lp``/``ent`` of ``softmax(z / T)`` with ``z`` computed in the
# input dtype (plain autograd: the model's layer), then float32 (float64 for the reference).


def _softmax_stats(z, labels, up):
    lpa = torch.log_softmax(z.to(up) / TEMPERATURE, -1)
    lp = lpa.gather(-1, labels[..., None])[..., 0]
    ent = -(lpa.exp() * lpa).sum(-1)
    return lpa, lp, ent


def _vanilla_loss(lp, ent, old, adv, mask, entropy_coeff=0.01, clip=0.2, clip_c=3.0):
    """verl's vanilla PPO objective, token-mean, minus the entropy bonus (written out here)."""
    m = mask.to(lp.dtype)
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    clipped = torch.maximum(l1, l2)
    per = torch.where(adv < 0, torch.minimum(clipped, -adv * clip_c), clipped)
    n = m.sum()
    return (torch.where(mask, per, 0.0) * m).sum() / n - entropy_coeff * (torch.where(mask, ent, 0.0) * m).sum() / n


def _forward_kl(zs, zt, up):
    ls, lt = torch.log_softmax(zs.to(up) / TEMPERATURE, -1), torch.log_softmax(zt.to(up) / TEMPERATURE, -1)
    return (lt.exp() * (lt - ls)).sum(-1), ls


# ----------------------------------------------------------------------------- the ops
# Each case: fn(d, dtype, backend, up) -> (outputs, leaves, upstream). ``up`` None: the library's call in
# ``dtype``; else the plain reference computed with softmax in ``up`` (float32 or float64) from inputs
# rounded to ``dtype``.


def _outputs_case(d, dtype, backend, up, *, head, module=False, at=False):
    w, h = _leaf(d["weight"], dtype), _leaf(d["hidden"], dtype)
    if up == torch.float64:  # the reference: the rounded inputs, in float64
        w, h = _leaf(w, torch.float64), _leaf(h, torch.float64)
    leaves = [h, w]
    if up is None:
        kw = dict(temperature=TEMPERATURE, chunking=Chunking(CHUNK, backend=backend))
        if at:
            kw["log_probs_at"] = d["teacher_ids"]
        if module:
            out = ce.ChunkedVocabParallelHead(w, kw.pop("chunking"))(h, d["labels"], **kw)
        elif head:
            out = ce.linear_log_probs_and_entropy(h, w, d["labels"], **kw)
        else:
            z = h @ w.t()
            out = ce.log_probs_and_entropy(z, d["labels"], **kw)
        outs = [out.log_probs, out.entropy] + ([out.log_probs_at] if at else [])
    else:
        z = h @ w.t()  # in the input dtype (float64 for the reference)
        lpa, lp, ent = _softmax_stats(z, d["labels"], up)
        outs = [lp, ent] + ([lpa.gather(-1, d["teacher_ids"])] if at else [])
    ups = [d["g_lp"], d["g_ent"]] + ([d["g_at"]] if at else [])
    return outs, leaves, ups


def _loss_case(d, dtype, backend, up, *, head):
    h, w = _leaf(d["hidden"], dtype), _leaf(d["weight"], dtype)
    if up == torch.float64:
        h, w = _leaf(h, torch.float64), _leaf(w, torch.float64)
    old, adv = d["old"].to(dtype if up is None else up), d["adv"].to(dtype if up is None else up)
    if up is None:
        fn = ce.linear_policy_loss if head else partial(_from_logits, ce.policy_loss_from_logits)
        loss, _ = fn(h, w, d["labels"], old, adv, d["mask"], loss=ce.PolicyLoss(entropy_coeff=0.01),
                     temperature=TEMPERATURE, chunking=Chunking(CHUNK, backend=backend))
    else:
        _, lp, ent = _softmax_stats(h @ w.t(), d["labels"], up)
        loss = _vanilla_loss(lp, ent, old, adv, d["mask"])
    return [loss], [h, w], [d["g_loss"]]


def _from_logits(op, h, w, *args, **kw):
    return op(h @ w.t(), *args, **kw)


def _divergence_case(d, dtype, backend, up, *, form):
    h, w = _leaf(d["hidden"], dtype), _leaf(d["weight"], dtype)
    th, tw = d["t_hidden"].to(dtype), d["t_weight"].to(dtype)
    if up == torch.float64:
        h, w, th, tw = _leaf(h, torch.float64), _leaf(w, torch.float64), th.double(), tw.double()
    if up is None:
        if form == "loss":
            r = ce.linear_divergence_loss(h, w, th, tw, temperature=TEMPERATURE, chunking=CHUNK, label_mask=d["mask"])
            return [r.loss], [h, w], [d["g_loss"]]
        if form == "logits":
            r = ce.divergence_from_logits(h @ w.t(), th @ tw.t(), labels=d["labels"], temperature=TEMPERATURE,
                                          chunking=CHUNK)
        else:
            r = ce.linear_divergence(h, w, th, tw, labels=d["labels"], temperature=TEMPERATURE, chunking=CHUNK)
        return [r.divergence, r.log_probs], [h, w], [d["g_div"], d["g_lp"]]
    div, ls = _forward_kl(h @ w.t(), th @ tw.t(), up)
    if form == "loss":
        m = d["mask"].to(up)
        return [(torch.where(d["mask"], div, 0.0) * m).sum() / m.sum()], [h, w], [d["g_loss"]]
    lp = ls.gather(-1, d["labels"][..., None])[..., 0]
    return [div, lp], [h, w], [d["g_div"], d["g_lp"]]


def _policy_loss_case(d, dtype, backend, up):
    lp = _leaf(d["lp"], dtype)
    if up == torch.float64:
        lp = _leaf(lp, torch.float64)
    cdt = torch.float64 if up == torch.float64 else dtype  # plain autograd: the loss in the input dtype
    if up is None:
        loss, _ = losses.policy_loss(lp, d["old"].to(cdt), d["adv"].to(cdt), d["mask"])
    else:
        loss = _vanilla_loss(lp, torch.zeros_like(lp), d["old"].to(cdt), d["adv"].to(cdt), d["mask"],
                             entropy_coeff=0.0)
    return [loss], [lp], [d["g_loss"]]


#: op name -> (case function, whether it takes ``backend=``)
OPS = {
    "log_probs_and_entropy": (partial(_outputs_case, head=False), True),
    "log_probs_and_entropy, log_probs_at": (partial(_outputs_case, head=False, at=True), True),
    "linear_log_probs_and_entropy": (partial(_outputs_case, head=True), True),
    "linear_log_probs_and_entropy, log_probs_at": (partial(_outputs_case, head=True, at=True), True),
    "ChunkedVocabParallelHead": (partial(_outputs_case, head=True, module=True), True),
    "linear_policy_loss": (partial(_loss_case, head=True), True),
    "policy_loss_from_logits": (partial(_loss_case, head=False), True),
    "linear_divergence": (partial(_divergence_case, form="head"), False),
    "linear_divergence_loss": (partial(_divergence_case, form="loss"), False),
    "divergence_from_logits": (partial(_divergence_case, form="logits"), False),
    "losses.policy_loss": (_policy_loss_case, False),
}
# Triton runs on a CPU tensor only through its interpreter (tests/test_triton.py): not a backend of the CPU runs.
_RUN_BACKENDS = tuple(be for be in BACKENDS if DEVICE.type == "cuda" or be != "triton")
RUNS = [(op, be) for op, (_, takes) in OPS.items() for be in (_RUN_BACKENDS if takes else ("-",))]


def _run(op, d, dtype, backend, up=None):
    """Outputs and the leaves' gradients of one call, random upstream gradients on every output."""
    fn, _ = OPS[op]
    outs, leaves, ups = fn(d, dtype, backend, up)
    total = sum((o.to(torch.float64) * u).sum() for o, u in zip(outs, ups, strict=True))
    grads = torch.autograd.grad(total, leaves)
    return [o.detach() for o in outs] + list(grads)


def _rel(a, ref):
    a, ref = a.detach().to(torch.float64), ref.detach().to(torch.float64)
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op, backend", RUNS, ids=[f"{op}-{be}" for op, be in RUNS])
def test_against_float64_within_plain_autograds_error(op, backend, dtype):
    d = _inputs()
    ref = _run(op, d, dtype, backend, up=torch.float64)
    plain = _run(op, d, dtype, backend, up=torch.float32)
    ours = _run(op, d, dtype, backend)
    assert len(ours) == len(ref) == len(plain)
    eps = torch.finfo(torch.float32).eps
    for i, (o, p, r) in enumerate(zip(ours, plain, ref, strict=True)):
        assert o.shape == r.shape, (i, o.shape, r.shape)
        assert torch.isfinite(o).all(), i
        err, err_plain = _rel(o, r), _rel(p, r)
        assert err <= 2.0 * err_plain + 64 * eps, (op, backend, dtype, i, err, err_plain)


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("op, backend", RUNS, ids=[f"{op}-{be}" for op, be in RUNS])
def test_bitwise_deterministic(op, backend, dtype):
    d = _inputs(1)
    first, second = _run(op, d, dtype, backend), _run(op, d, dtype, backend)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert torch.equal(a, b), (op, backend, dtype, i)


# ----------------------------------------------------------------------------- host syncs


def _step(op, d, backend):
    _run(op, d, torch.bfloat16, backend)


@cuda_only
@pytest.mark.parametrize("op, backend", RUNS, ids=[f"{op}-{be}" for op, be in RUNS])
def test_one_host_sync_per_call(op, backend, monkeypatch):
    monkeypatch.setenv(CHECKS_ENV, "sync")
    d = _inputs(2)
    _step(op, d, backend)  # warm: compilation, the backend's first-call probe
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(op, d, backend)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in seen if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, syncs  # the call's value checks, read once (none where it has none: a bool mask)


@cuda_only
@pytest.mark.parametrize("op, backend", RUNS, ids=[f"{op}-{be}" for op, be in RUNS])
def test_no_host_sync_with_async_checks(op, backend, monkeypatch):
    monkeypatch.setenv(CHECKS_ENV, "async")
    d = _inputs(3)
    _step(op, d, backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(op, d, backend)  # raises RuntimeError at the first synchronizing CUDA call
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- matmul operands

_MATMULS = {"mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "linear": (0, 1), "addmm": (1, 2), "addmm_": (1, 2),
            "baddbmm": (1, 2), "baddbmm_": (1, 2), "addbmm": (1, 2), "addbmm_": (1, 2)}


class _Matmuls(TorchDispatchMode):
    """Each matmul's operand dtypes (every overload: ``aten.mm.dtype``, ``aten.addmm.dtype``, ``out=`` ...)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        at = _MATMULS.get(func.overloadpacket.__name__)
        if at is not None:
            a, b = args[at[0]], args[at[1]]
            self.seen.append((str(func), a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("op", [op for op in OPS if op != "losses.policy_loss"])
def test_no_matmul_of_a_half_precision_call_has_two_float32_operands(op, dtype):
    """The rule of tensor cores: a float32 sum is accumulated in float32 inside the GEMM
    (``out_dtype=torch.float32``), never by upcasting both operands. Eager: dispatch modes see the matmuls."""
    if DEVICE.type != "cuda":
        pytest.skip("a CPU has no half-precision matmul into float32: it multiplies float32 copies by design; "
                    "tests/test_half_operands.py checks the CUDA branch on the CPU")
    d = _inputs(4)
    with _Matmuls() as log:
        _run(op, d, dtype, "eager" if OPS[op][1] else "-")
    assert log.seen, "no matmul seen"
    both = [s for s in log.seen if s[1] == s[2] == torch.float32]
    assert both == [], both


# ----------------------------------------------------------------------------- bad input, each in a fresh process

_BAD = {
    "label out of range": ("ce.log_probs_and_entropy(z, labels.fill_(V + 3))", "labels must be vocabulary ids"),
    "negative label": ("ce.log_probs_and_entropy(z, labels.fill_(-5))", "labels must be vocabulary ids"),
    "fused head, label out of range": ("ce.linear_log_probs_and_entropy(h, w, labels.fill_(5 * V))",
                                       "labels must be vocabulary ids"),
    "log_probs_at id out of range": ("ce.log_probs_and_entropy(z, labels, log_probs_at=torch.full((N, 3), V, "
                                     "device=dev))", "log_probs_at must hold vocabulary ids"),
    "NaN temperature": ("ce.log_probs_and_entropy(z, labels, temperature=torch.full((N,), float('nan'), "
                        "device=dev))", "temperature must be finite"),
    "keep id out of range": ("ce.log_probs_and_entropy(z, labels, keep=(torch.full((2 * N,), V + 1, device=dev), "
                             "torch.arange(0, 2 * N + 1, 2, device=dev)))", "keep's token_ids must be vocabulary ids"),
    "fused loss, label out of range": ("ce.linear_policy_loss(h[None], w, labels.fill_(V)[None], old, adv, mask)",
                                       "labels must be vocabulary ids"),
    "fused loss, negative mask weight": ("ce.linear_policy_loss(h[None], w, labels[None], old, adv, -mask)",
                                         "loss_mask must be bool or hold finite weights >= 0"),
    "policy_loss, negative mask weight": ("losses.policy_loss(old, old, adv, -mask)",
                                          "loss_mask must be bool or hold finite weights >= 0"),
    "divergence, NaN teacher": ("ce.linear_divergence(h, w, h * float('nan'), w)", "teacher_hidden must be finite"),
}

_SNIPPET = """
import torch, chunked_entropy as ce
from chunked_entropy import losses
dev, N, H, V = "cuda", 64, 32, 1000
z = torch.randn(N, V, device=dev, requires_grad=True)
h, w = torch.randn(N, H, device=dev, requires_grad=True), torch.randn(V, H, device=dev, requires_grad=True)
labels = torch.randint(0, V, (N,), device=dev)
old, adv, mask = torch.randn(1, N, device=dev) - 3, torch.randn(1, N, device=dev), torch.ones(1, N, device=dev)
try:
    {call}
    print("RESULT no error")
except Exception as e:
    print("RESULT", type(e).__name__, str(e).replace(chr(10), " "))
x = torch.ones(1000, device=dev) * 2
torch.cuda.synchronize()
print("ALIVE", float(x.sum()) == 2000.0)
"""


@cuda_only
@pytest.mark.parametrize("case", sorted(_BAD))
def test_bad_input_raises_and_leaves_the_context_alive(case):
    call, match = _BAD[case]
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop(CHECKS_ENV, None)
    r = subprocess.run([sys.executable, "-c", _SNIPPET.format(call=call)], capture_output=True, text=True,
                       timeout=300, env=env)
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in r.stdout.splitlines() if " " in ln}
    assert lines.get("RESULT", "").startswith("ValueError") and match in lines["RESULT"], (r.stdout, r.stderr[-2000:])
    assert lines.get("ALIVE") == "True", (r.stdout, r.stderr[-2000:])
