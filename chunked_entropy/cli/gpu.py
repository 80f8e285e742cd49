"""``chunked-entropy bench --device cuda --preset gpu``: every method side by side in one process, floors included.

One run measures, at the fused head's shape (N tokens, H hidden, V
vocabulary; default N=8192, H=4096, V=151936, bfloat16: TRL #7244's) and
the logits path's (default N=16384, V=152064):

- the floors: the head's matmuls timed alone with ``torch.mm`` in the input
  dtype (``h @ W.T``, ``g @ W``, ``g.T @ h``): three GEMMs for a loss that
  forms its gradients in forward, four for a head that recomputes the logits
  in backward; and a device copy's bandwidth, which sets the logits path's
  floors (three passes over the logits forward + backward, one read forward);
- plain torch (logits in the input dtype, float32 softmax);
- this library's head with and without entropy, its fused loss
  (``linear_policy_loss``, vanilla with an entropy bonus) and its logits path,
  forward + backward and the forward alone under ``torch.no_grad()``, each a
  call that sets nothing (the default backend), or once per ``--backends``
  entry;
- verl 0.9.1's Triton ``verl.utils.kernel.linear_cross_entropy`` (log-probs
  and entropy), Liger's fused linear cross entropy with ``reduction="none"``
  (log-probs) and ``"sum"`` (the loss, gradients in forward) and Apple's Cut
  Cross-Entropy (log-probs), each when it can run here, and otherwise a line
  saying why not.

Time: the median of ``--repeats`` steps (CUDA events) after two warm-up steps
(the first compiles). Working memory: the peak of ``torch.cuda.max_memory_allocated``
during one step over what was allocated before it (the inputs), less the
inputs' gradients. On the CPU (``--device cpu``, a check of the code path at a
small shape) times are the wall clock and no memory is reported.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

HEAD_SHAPE = dict(tokens=8192, hidden=4096, vocab=151936)
LOGITS_SHAPE = dict(tokens=16384, vocab=152064)
GiB = 2**30


@dataclass
class Row:
    section: str  # "floor", "head" or "logits"
    method: str
    ms: Optional[float] = None
    ms_min: Optional[float] = None
    ms_max: Optional[float] = None
    working_bytes: Optional[int] = None
    note: str = ""


class Timer:
    """Medians of steps on ``device``: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: torch.device, repeats: int, warmup: int = 2):
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object]) -> tuple:
        """``(median, min, max)`` milliseconds of ``fn()``."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        ts = []
        for _ in range(self.repeats):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts), min(ts), max(ts)

    def working(self, fn: Callable[[], object], grad_bytes: int) -> Optional[int]:
        """Peak bytes of one ``fn()`` over what was allocated before it, less ``grad_bytes`` (None on the CPU)."""
        if not self.cuda:
            return None
        self.sync()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        self.sync()
        return max(torch.cuda.max_memory_allocated(self.device) - base - grad_bytes, 0)


# ----------------------------------------------------------------------------- the peers


def load_peers(device: torch.device) -> tuple:
    """``(peers, why_not)``: the importable peers' entry points, and a line for each one that cannot run."""
    peers, why = {}, {}
    if device.type != "cuda":
        for name in ("verl", "liger", "cce"):
            why[name] = "runs on CUDA only (Triton kernels); not measured on the CPU"
        return peers, why
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        peers["verl"] = linear_cross_entropy
    except Exception as e:  # noqa: BLE001 - any import failure is reported, the others still run
        why["verl"] = f"verl.utils.kernel.linear_cross_entropy not importable: {type(e).__name__}: {e}"[:300]
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        peers["liger"] = LigerFusedLinearCrossEntropyFunction
    except Exception as e:  # noqa: BLE001
        why["liger"] = f"liger_kernel not importable: {type(e).__name__}: {e}"[:300]
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        peers["cce"] = cce
    except Exception as e:  # noqa: BLE001
        why["cce"] = f"cut_cross_entropy (Apple's CCE) not importable: {type(e).__name__}: {e}"[:300]
    return peers, why


# ----------------------------------------------------------------------------- the methods


def _backend_kw(backend: Optional[str]) -> tuple:
    """``(keyword arguments, name suffix)`` of one of the library's backends (None: the call that sets nothing)."""
    from chunked_entropy import Chunking

    return ({}, "") if backend is None else ({"chunking": Chunking(backend=backend)}, f", backend={backend!r}")


def head_methods(peers: dict, backends=(None,)) -> dict:
    """name -> ``f(h, w, y, g_lp, g_ent)``: a scalar whose backward is the step's (random upstream gradients).
    The library's methods once per entry of ``backends`` (None: the default backend)."""
    import chunked_entropy as ce

    def plain(h, w, y, g1, g2):
        lpa = torch.log_softmax((h @ w.t()).float(), -1)
        lp = lpa.gather(-1, y[:, None])[:, 0]
        ent = -(lpa.exp() * lpa).sum(-1)
        return (g1 * lp).sum() + (g2 * ent).sum()

    def head(kw, h, w, y, g1, g2):
        r = ce.linear_log_probs_and_entropy(h, w, y, **kw)
        return (g1 * r.log_probs).sum() + (g2 * r.entropy).sum()

    def head_lp(kw, h, w, y, g1, g2):
        return (g1 * ce.linear_log_probs_and_entropy(h, w, y, compute_entropy=False, **kw).log_probs).sum()

    bonus = ce.PolicyLoss(entropy_coeff=0.01)

    def fused_loss(kw, h, w, y, g1, g2):
        n = y.shape[0]
        old = torch.full((1, n), -3.0, device=h.device)
        mask = torch.ones(1, n, device=h.device)
        loss, _ = ce.linear_policy_loss(h[None], w, y[None], old, g1[None], mask, loss=bonus, **kw)
        return loss

    m = {"plain torch (logits in the input dtype, float32 softmax)": plain}
    for be in backends:
        kw, suffix = _backend_kw(be)
        m[f"chunked_entropy head, log-probs + entropy{suffix}"] = partial(head, kw)
        m[f"chunked_entropy head, log-probs only{suffix}"] = partial(head_lp, kw)
        m[f"chunked_entropy linear_policy_loss (vanilla + entropy bonus, gradients in forward){suffix}"] = partial(
            fused_loss, kw)
    if "verl" in peers:
        verl = peers["verl"]

        def verl_step(h, w, y, g1, g2):
            lp, ent = verl(h, w, y, 1.0, "none")
            return (g1 * lp).sum() + (g2 * ent).sum()

        m["verl 0.9.1 Triton linear_cross_entropy (log-probs + entropy)"] = verl_step
    if "liger" in peers:
        flce = peers["liger"]

        def liger_none(h, w, y, g1, g2):
            return (g1 * -flce.apply(h, w, y, None, None, -100, 0.0, 0.0, "none")[0]).sum()

        def liger_sum(h, w, y, g1, g2):
            return flce.apply(h, w, y, None, None, -100, 0.0, 0.0, "sum")[0]

        m["Liger FLCE reduction='none' (log-probs only)"] = liger_none
        m["Liger FLCE reduction='sum' (loss only, gradients in forward)"] = liger_sum
    if "cce" in peers:
        cce = peers["cce"]

        def cce_none(h, w, y, g1, g2):
            return (g1 * -cce(h, w, y, reduction="none")).sum()

        m["Apple CCE reduction='none' (log-probs only)"] = cce_none
    return m


def _head_inputs(n, h, v, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hid = torch.randn(n, h, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * (2.5 / math.sqrt(h))).to(device=device, dtype=dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g).to(device)
    g1 = torch.randn(n, generator=g).to(device)
    g2 = (torch.randn(n, generator=g) * 0.01).to(device)
    return hid, w, y, g1, g2


def floors(timer: Timer, n, h, v, dtype, device, logits_elems: int) -> list:
    """The head's GEMMs alone (``torch.mm``, the input dtype) and a device copy's bandwidth."""
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(v, h, generator=g).to(device=device, dtype=dtype)
    z = torch.randn(n, v, generator=g).to(device=device, dtype=dtype)
    fw = timer.time(lambda: torch.mm(x, w.t()))[0]
    dx = timer.time(lambda: torch.mm(z, w))[0]
    dw = timer.time(lambda: torch.mm(z.t(), x))[0]
    size = dtype.itemsize
    copy_elems = min(logits_elems, GiB // size) if device.type == "cuda" else min(logits_elems, 1 << 24)
    a = torch.empty(copy_elems, device=device, dtype=dtype).normal_()
    b = torch.empty_like(a)
    ms = timer.time(lambda: b.copy_(a))[0]
    bw = 2 * copy_elems * size / (ms / 1e3)  # bytes per second: one read and one write
    passes = logits_elems * size / bw * 1e3
    return [
        Row("floor", "h @ W.T (forward logits)", fw),
        Row("floor", "g @ W (grad hidden)", dx),
        Row("floor", "g.T @ h (grad weight)", dw),
        Row("floor", "3 GEMMs: floor of a loss with gradients in forward", fw + dx + dw),
        Row("floor", "4 GEMMs: floor of a head that recomputes in backward", 2 * fw + dx + dw),
        Row("floor", f"device copy of {copy_elems * size / GiB:.2f} GiB: {bw / 1e9:.0f} GB/s", ms),
        Row("floor", "logits path floor, forward + backward: 3 passes over the logits", 3 * passes),
        Row("floor", "logits path floor, forward alone: 1 read of the logits", passes),
    ]


def _measure(timer: Timer, section: str, name: str, step, leaves, grads: bool = True) -> Row:
    """Time and working memory of ``step`` (``grads``: it leaves gradients on ``leaves``, not counted)."""
    grad_bytes = sum(t.numel() * t.element_size() for t in leaves if t.requires_grad) if grads else 0

    def clear():
        for t in leaves:
            t.grad = None

    def run():
        clear()
        step()

    try:
        ms, lo, hi = timer.time(run)
        work = timer.working(run, grad_bytes)
        return Row(section, name, ms, lo, hi, work)
    except Exception as e:  # noqa: BLE001 - one method's failure is reported, the others still run
        return Row(section, name, note=f"failed: {type(e).__name__}: {e}"[:300])
    finally:
        clear()
        if timer.cuda:
            torch.cuda.empty_cache()


def head_rows(timer: Timer, peers, n, h, v, dtype, device, backends=(None,)) -> list:
    hid, w, y, g1, g2 = _head_inputs(n, h, v, dtype, device)
    rows = []
    for name, f in head_methods(peers, backends).items():
        rows.append(_measure(timer, "head", name, lambda f=f: f(hid, w, y, g1, g2).backward(), (hid, w)))
    return rows


def logits_rows(timer: Timer, n, v, dtype, device, backends=(None,)) -> list:
    import chunked_entropy as ce

    g = torch.Generator(device="cpu").manual_seed(2)
    z = (torch.randn(n, v, generator=g) * 2.5).to(device=device, dtype=dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g).to(device)
    g1 = torch.randn(n, generator=g).to(device)
    g2 = (torch.randn(n, generator=g) * 0.01).to(device)

    def plain():
        lpa = torch.log_softmax(z.float(), -1)
        lp = lpa.gather(-1, y[:, None])[:, 0]
        return (g1 * lp).sum() + (g2 * -(lpa.exp() * lpa).sum(-1)).sum()

    def ours(kw):
        r = ce.log_probs_and_entropy(z, y, **kw)
        return (g1 * r.log_probs).sum() + (g2 * r.entropy).sum()

    def no_grad(f):
        def step():
            with torch.no_grad():
                f()
        return step

    rows = [_measure(timer, "logits", "plain torch (float32 upcast), forward + backward",
                     lambda: plain().backward(), (z,))]
    for be in backends:
        kw, suffix = _backend_kw(be)
        rows.append(_measure(timer, "logits", f"chunked_entropy log_probs_and_entropy, forward + backward{suffix}",
                             lambda kw=kw: ours(kw).backward(), (z,)))
    rows.append(_measure(timer, "logits", "plain torch, forward alone under no_grad", no_grad(plain), (z,),
                         grads=False))
    for be in backends:
        kw, suffix = _backend_kw(be)
        rows.append(_measure(timer, "logits", f"chunked_entropy log_probs_and_entropy, forward alone under "
                             f"no_grad{suffix}", no_grad(partial(ours, kw)), (z,), grads=False))
    return rows


# ----------------------------------------------------------------------------- the run


def settings(args) -> dict:
    """The shapes: the preset's, or ``--tokens``/``--hidden``/``--vocab`` (their first values) for both paths."""
    pick = lambda name, default: (getattr(args, name) or [default])[0]  # noqa: E731
    return dict(
        head=(pick("tokens", HEAD_SHAPE["tokens"]), pick("hidden", HEAD_SHAPE["hidden"]),
              pick("vocab", HEAD_SHAPE["vocab"])),
        logits=(pick("tokens", LOGITS_SHAPE["tokens"]), pick("vocab", LOGITS_SHAPE["vocab"])),
        dtype=getattr(torch, args.dtype or "bfloat16"),
        repeats=args.repeats or 5,
        backends=tuple(args.backends) if args.backends else (None,),
    )


def table(rows: list, why_not: dict) -> str:
    lines = ["| section | method | time (median) | min-max | working memory |", "|---|---|---:|---:|---:|"]
    for r in rows:
        if r.ms is None:
            lines.append(f"| {r.section} | {r.method} | {r.note} | - | - |")
            continue
        spread = f"{r.ms_min:.2f}-{r.ms_max:.2f}" if r.ms_min is not None else "-"
        mem = "-" if r.working_bytes is None else f"{r.working_bytes / GiB:.3f} GiB"
        lines.append(f"| {r.section} | {r.method} | {r.ms:.2f} ms | {spread} | {mem} |")
    out = "\n".join(lines)
    if why_not:
        out += "\n\nNot measured:\n" + "\n".join(f"- {name}: {why}" for name, why in sorted(why_not.items()))
    return out


def run(args) -> int:
    s = settings(args)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timer = Timer(device, s["repeats"])
    n, h, v = s["head"]
    ln, lv = s["logits"]
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"GPU benchmark on {card}: head N={n} H={h} V={v}, logits N={ln} V={lv}, {s['dtype']}, "
          f"medians of {s['repeats']} after 2 warm-up steps, one process", file=sys.stderr)
    peers, why_not = load_peers(device)
    rows = floors(timer, n, h, v, s["dtype"], device, ln * lv)
    rows += head_rows(timer, peers, n, h, v, s["dtype"], device, s["backends"])
    rows += logits_rows(timer, ln, lv, s["dtype"], device, s["backends"])
    meta = {"command": "chunked-entropy " + " ".join(getattr(args, "argv", [])), "card": card,
            "torch": torch.__version__, "cuda": torch.version.cuda, "head": [n, h, v], "logits": [ln, lv],
            "dtype": str(s["dtype"]), "repeats": s["repeats"],
            "checks": os.environ.get("CHUNKED_ENTROPY_CHECKS", "sync")}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu-results.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [r.__dict__ for r in rows], "not_measured": why_not}, f, indent=1)
    print(table(rows, why_not))
    print()
    print("working memory: the step's peak (torch.cuda.max_memory_allocated) over the inputs, less their "
          "gradients; floors: the head's matmuls alone (torch.mm, the input dtype) and a device copy.")
    print(f"Wrote {path}.")
    return 0
