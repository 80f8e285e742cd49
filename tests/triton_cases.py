"""The Triton kernels (backend="triton") through Triton's interpreter, on small shapes.

Not collected by the suite itself (the name does not start with ``test_``):
:mod:`tests.test_triton` runs this file with pytest in a subprocess whose
environment has ``TRITON_INTERPRET=1``, which must be set before Triton is
imported, and must not reach the other tests (Inductor's own Triton code
would turn interpreted too).

Each kernel is checked against the eager kernels on the same block (float32
reassociation) and against float64 written from the definitions; the ops
against :func:`tests.helpers.reference` (float64, plain autograd), with
random upstream gradients on every output. The columns are walked in tiles
of 16 (``_triton.MAX_TILE``), so a row of 37 columns takes three tiles, the
last one partial.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from chunked_entropy import (
    _kernels,
    _stats,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    policy_loss_from_logits,
)
from tests.helpers import reference

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by tests/test_triton.py
    pytest.skip("run by tests/test_triton.py with TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402 - after the interpreter check
import triton.language as tl  # noqa: E402

from chunked_entropy import Chunking, OutputLayer, PolicyLoss, _triton  # noqa: E402

W = 37  # columns of a block: three tiles of 16
HALF = (torch.bfloat16, torch.float16)
TRANSFORMS = {"plain": _stats.Transform(), "capped": _stats.Transform(softcap=3.0, logit_scale=0.7),
              "scaled": _stats.Transform(logit_scale=1.3)}


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(_triton, "MAX_TILE", 16)


def _split_rows(monkeypatch, on: bool = True):
    """Few long rows as the kernels see them on a large device: every row split across programs (each part at
    least one tile), merged by the second stage; ``on=False``: one program a row."""
    monkeypatch.setattr(_triton, "MIN_SPLIT_TILES", 1)
    monkeypatch.setattr(_triton, "PROGRAMS", 64 if on else 1)


def test_the_kernels_are_interpreted():
    assert _triton.INTERPRETED
    assert _kernels.choose_kernels("triton", torch.device("cpu")) is _kernels.TRITON
    assert _kernels.choose_kernels("auto", torch.device("cpu")) is _kernels.EAGER  # auto never picks the interpreter


def _block(dtype, n=6, seed=0):
    """A raw ``[n, W]`` block (scaled so the softmax is far from uniform) with a ``-inf`` entry and a row
    maximum tied twice; labels in this block's coordinates ``v0 = 3``: inside, on its first and last column,
    before it, after it, and -1 (none)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, W, generator=g, dtype=torch.float64) * 3
    z[1, 5] = -math.inf
    z[2, 7] = z[2, 30] = z[2].max() + 1
    target = torch.tensor([3 + 10, 3, 3 + W - 1, 1, 3 + W + 2, -1])[:n]
    return z.to(dtype), target, 3


def _k(tf, per_row, n, cdt):
    """``(k, kz, 1/t)``: per-row inverse temperatures (an ``[n, 1]`` column) or one float."""
    inv_t = torch.linspace(0.6, 1.7, n, dtype=cdt).unsqueeze(1) if per_row else 0.8
    return tf.k(inv_t), tf.kz(inv_t), inv_t


def _u64(z, tf):
    u = z.double()
    return u if tf.softcap is None else torch.tanh(u * ((tf.logit_scale or 1.0) / tf.softcap))


def _col(k, n):
    return k.double() if isinstance(k, torch.Tensor) else torch.full((n, 1), k, dtype=torch.float64)


def _definition(z, tf, k, target, v0):
    """float64 RowStats of a block that is a whole row, from the definitions: ``m, log s, w / s, sum p^2, yl``."""
    n = z.shape[0]
    u = _u64(z, tf)
    m = u.amax(dim=1, keepdim=True)
    y = _col(k, n) * (u - m)
    lse = torch.logsumexp(y, dim=1)
    p = torch.exp(y - lse.unsqueeze(1))
    ws = (p * torch.where(p > 0, y, 0.0)).sum(dim=1)
    local = target - v0
    inside = (local >= 0) & (local < W)
    # the label's offset; off the block its u counts as 0 (another block adds its own): yl = k * (0 - m)
    yl = torch.where(inside, y.gather(1, local.clamp(0, W - 1).unsqueeze(1)).squeeze(1), -_col(k, n)[:, 0] * m[:, 0])
    return m.squeeze(1), lse, ws, (p * p).sum(dim=1), yl


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}
# every dtype and transform with per-row temperatures; one float temperature (a stride-0 column) per compute dtype
STATS_CASES = [(d, tf, True) for d in DTYPES for tf in TRANSFORMS] + [("f32", "capped", False),
                                                                      ("f64", "capped", False)]


@pytest.mark.parametrize("dtype,tf,per_row", STATS_CASES,
                         ids=[f"{d}-{tf}-{'t_rows' if r else 't_float'}" for d, tf, r in STATS_CASES])
def test_stats_match_eager_and_float64(dtype, tf, per_row):
    dtype, tf = DTYPES[dtype], TRANSFORMS[tf]
    z, target, v0 = _block(dtype)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    k, _, _ = _k(tf, per_row, z.shape[0], cdt)
    got = _triton.stats(z, tf, k, target, v0, True, True, cdt)
    assert all(t.dtype == cdt and t.shape == (6,) for t in got)
    eager = _stats.block_stats(z.to(cdt, copy=True), tf, k, target, v0, torch.empty(z.shape, dtype=cdt), want_w=True,
                               want_q=True)
    mine, ref = _stats.RowStats.from_block(got, k), _stats.RowStats.from_block(eager, k)
    tight = dict(rtol=1e-12, atol=1e-12) if cdt == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    for a, b in zip(mine[:5], ref[:5], strict=True):
        torch.testing.assert_close(a, b, **tight)
    exact = dict(rtol=1e-13, atol=1e-13) if cdt == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(mine[:5], _definition(z, tf, k, target, v0), strict=True):
        torch.testing.assert_close(a.double(), b, **exact)
    # without w and q: None, the rest unchanged
    lean = _triton.stats(z, tf, k, target, v0, False, False, cdt)
    assert lean.w is None and lean.q is None
    for a, b in zip((lean.m, lean.ones, lean.rest, lean.zl), (got.m, got.ones, got.rest, got.zl), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_stats_of_blocks_merge_into_the_rows():
    """Two blocks of the same rows (v0 = 0 and 20), each through the kernel, merged as vocabulary blocks are."""
    z, _, _ = _block(torch.float32)
    target = torch.tensor([2, 25, 36, 19, 20, -1])
    tf, k = TRANSFORMS["capped"], 1.7
    whole = _stats.RowStats.from_block(_triton.stats(z, tf, k, target, 0, True, True, torch.float32), k)
    parts = [_triton.stats(z[:, a:b], tf, k, target, a, True, True, torch.float32) for a, b in ((0, 20), (20, W))]
    merged = _stats.RowStats.from_block(_stats.merge_stats(*parts[:1], parts[1], k), k)
    for a, b in zip(merged[:5], whole[:5], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("split", [False, True], ids=["rows", "split"])
@pytest.mark.parametrize("dtype,tf", [("f32", "capped"), ("bf16", "plain"), ("f64", "capped")])
def test_stats_merge_into_running_statistics_inside_the_launch(dtype, tf, split, monkeypatch):
    """``out=`` and ``merge=``: a row's vocabulary blocks through the kernel into one ``[6, n]`` tensor, the first
    written, each later one merged into what it holds inside the launch (``split``: by the second stage of rows
    split across programs). Against ``merge_stats`` of the blocks' own statistics (the same ops; the kernel's
    ``exp`` may be an ulp from torch's) and against float64 from the definitions over the whole row: a row
    whose later block holds the maximum, one whose first block is all ``-inf`` (padding), an offset of 1e4, a
    confident row, labels in each block and none; per-row temperatures. Without ``w`` and ``q`` their rows of
    ``out`` are never written."""
    if split:
        _split_rows(monkeypatch)
    dtype, tf = DTYPES[dtype], TRANSFORMS[tf]
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(31)
    n, width = 6, 3 * W
    z = torch.randn(n, width, generator=g, dtype=torch.float64) * 3
    z[0, 2 * W + 5] += 30.0  # the maximum in the last block
    z[1, :W] = -math.inf  # padding: the first block adds nothing
    z[2] += 1e4
    z[3, 4] += 40.0  # confident, in the first block
    z = z.to(dtype)
    target = torch.tensor([2 * W + 5, 3, W + 7, 4, -1, 2 * W + 36])
    k = torch.linspace(0.6, 1.9, n, dtype=cdt).unsqueeze(1)
    blocks = [(v0, v0 + W) for v0 in range(0, width, W)]
    out = torch.full((6, n), math.nan, dtype=cdt)
    for v0, v1 in blocks:
        got = _triton.stats(z[:, v0:v1], tf, k, target, v0, True, True, cdt, out=out, merge=v0 > 0)
        assert all(t.data_ptr() == r.data_ptr() for t, r in zip(got, out.unbind(0), strict=True))
    want = None
    for v0, v1 in blocks:
        want = _stats.merge_stats(want, _triton.stats(z[:, v0:v1], tf, k, target, v0, True, True, cdt), k)
    close = dict(rtol=1e-12, atol=1e-12) if cdt == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    for a, b in zip(out.unbind(0), want, strict=True):
        torch.testing.assert_close(a, b, **close)
    mine = _stats.RowStats.from_block(_stats.BlockStats(*out.unbind(0)), k)
    u = z.double() * (tf.logit_scale or 1.0)
    if tf.softcap is not None:
        u = torch.tanh(u / tf.softcap)
    y = k.double() * (u - u.amax(dim=1, keepdim=True))
    lse = torch.logsumexp(y, dim=1)
    p = torch.exp(y - lse.unsqueeze(1))
    ws = (p * torch.where(p > 0, y, 0.0)).sum(dim=1)
    yl = torch.where(target >= 0, y.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1),
                     -k.double()[:, 0] * u.amax(dim=1))
    exact = dict(rtol=1e-12, atol=1e-12) if cdt == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip((mine.ls, mine.ws, mine.s2, mine.yl), (lse, ws, (p * p).sum(dim=1), yl), strict=True):
        torch.testing.assert_close(a.double(), b, **exact)
    lean = torch.full((6, n), 7.0, dtype=cdt)
    for v0, v1 in blocks:
        _triton.stats(z[:, v0:v1], tf, k, target, v0, False, False, cdt, out=lean, merge=v0 > 0)
    assert (lean[3:5] == 7.0).all()
    for i in (0, 1, 2, 5):
        torch.testing.assert_close(lean[i], out[i], rtol=0, atol=0)


def _grad64(z, tf, inv_t, target, v0, g):
    """float64 ``d/dz sum(g_lp * log_prob + g_h * entropy + g_q * sum p^2)`` of rows that are this block, by
    autograd from the definitions; a label off the block (another shard's column) contributes ``-lse``, -1 none."""
    z = z.double().requires_grad_()
    x = z * (tf.logit_scale or 1.0)
    if tf.softcap is not None:
        x = tf.softcap * torch.tanh(x / tf.softcap)
    x = x * _col(inv_t, z.shape[0])
    logp = torch.log_softmax(x, dim=1)
    p = logp.exp()
    local = target - v0
    inside = (local >= 0) & (local < W)
    at_label = x.gather(1, local.clamp(0, W - 1).unsqueeze(1)).squeeze(1)
    lp = torch.where(inside, at_label, 0.0) - torch.logsumexp(x, dim=1)
    lp = torch.where(target >= 0, lp, 0.0)
    ent = -(p * torch.where(p > 0, logp, 0.0)).sum(dim=1)
    total = 0.0
    for gi, out in zip(g, (lp, ent, (p * p).sum(dim=1)), strict=True):
        if gi is not None:
            total = total + (gi.double() * out).sum()
    total.backward()
    return z.grad


COEFFICIENTS = {"lp": (True, False, False), "lp_h": (True, True, False), "all": (True, True, True),
                "h_only": (False, True, False), "q_only": (False, False, True)}


# every dtype and transform with all terms; the log-prob alone in float32 and bf16; the other combinations
# of terms in float32 with the cap (their code does not depend on the dtype or the transform)
GRAD_CASES = ([(d, tf, "all") for d in DTYPES for tf in TRANSFORMS]
              + [(d, tf, "lp") for d in ("f32", "bf16") for tf in TRANSFORMS]
              + [("f32", "capped", terms) for terms in ("lp_h", "h_only", "q_only")])


@pytest.mark.parametrize("dtype,tf,terms", GRAD_CASES, ids=["-".join(c) for c in GRAD_CASES])
def test_grad_matches_eager_and_float64(dtype, tf, terms):
    dtype, tf = DTYPES[dtype], TRANSFORMS[tf]
    z, target, v0 = _block(dtype)
    z[1, 5] = 0.0  # a -inf logit's gradient is 0 (eager) and NaN in float64 autograd
    n = z.shape[0]
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    k, kz, inv_t = _k(tf, True, n, cdt)
    kz = kz.squeeze(1)
    gen = torch.Generator().manual_seed(7)
    g = [torch.randn(n, generator=gen, dtype=cdt) if on else None for on in COEFFICIENTS[terms]]
    rows = _stats.RowStats.from_block(_triton.stats(z, tf, k, target, v0, True, True, cdt), k)
    c = None if g[0] is None else torch.where(target >= 0, g[0] * kz, 0.0)
    co = _stats.Coefficients(c, None if g[1] is None else g[1] * kz, None if g[2] is None else 2 * g[2] * kz)
    out = torch.full(z.shape, math.nan, dtype=dtype)
    assert _triton.grad(z, out, tf, k, rows, target, v0, co, cdt) is out
    need = lambda on: torch.empty(z.shape, dtype=cdt) if on else None  # noqa: E731
    eager = _stats.block_grad(z.to(cdt, copy=True), tf, k, rows, target, v0, co, need(True),
                              need(tf.softcap is not None))
    ref = _grad64(z, tf, inv_t, target, v0, g)
    if dtype in HALF:  # written in the block's dtype, rounded once from float32
        rnd = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        torch.testing.assert_close(out.double(), eager.double(), rtol=rnd, atol=1e-6)
        torch.testing.assert_close(out.double(), ref, rtol=rnd, atol=1e-5)
    else:
        torch.testing.assert_close(out, eager, **(dict(rtol=1e-12, atol=1e-14) if cdt == torch.float64
                                                  else dict(rtol=1e-5, atol=1e-7)))
        torch.testing.assert_close(out.double(), ref, **(dict(rtol=1e-12, atol=1e-13) if cdt == torch.float64
                                                         else dict(rtol=1e-5, atol=1e-6)))


def test_grad_in_place_and_strided():
    """``out`` may be the block itself (the fused head's buffer) or a strided view; ``z`` a strided view."""
    z, target, v0 = _block(torch.float32)
    tf, k = TRANSFORMS["capped"], 0.9
    rows = _stats.RowStats.from_block(_triton.stats(z, tf, k, target, v0, True, True, torch.float32), k)
    g = torch.Generator().manual_seed(3)
    co = _stats.Coefficients(*(torch.randn(6, generator=g) for _ in range(3)))
    expected = _triton.grad(z, torch.empty_like(z), tf, k, rows, target, v0, co, torch.float32)
    buf = z.clone()
    assert _triton.grad(buf, buf, tf, k, rows, target, v0, co, torch.float32) is buf
    torch.testing.assert_close(buf, expected, rtol=0, atol=0)
    wide = torch.zeros(6, 2 * W)
    wide[:, ::2] = z  # column stride 2
    out = torch.zeros(W, 6).t()  # column stride 6
    st = _triton.stats(wide[:, ::2], tf, k, target, v0, True, True, torch.float32)
    for a, b in zip(_stats.RowStats.from_block(st, k)[:5], rows[:5], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _triton.grad(wide[:, ::2], out, tf, k, rows, target, v0, co, torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------- the ops, end to end


def _run(fn, leaves, ups):
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    outs = [o for o in (out.log_probs, out.entropy, out.sum_pi_squared) if o is not None]
    sum((o.double() * u).sum() for o, u in zip(outs, ups, strict=False)).backward()
    return outs, [t.grad for t in leaves]


def _check(got, ref, dtype, tol):
    if dtype in HALF:
        rnd = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        torch.testing.assert_close(got.double(), ref, rtol=rnd, atol=tol)
    else:
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("split", [False, True], ids=["rows", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("extra", [{}, {"softcap": 4.0, "logit_scale": 0.5}], ids=["plain", "softcap"])
def test_logits_path_matches_float64(dtype, extra, split, monkeypatch):
    if split:
        _split_rows(monkeypatch)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 5, W + 3, generator=g) * 4
    z = base[..., :W].to(dtype)  # rows of a wider tensor (any strides)
    labels = torch.randint(0, W, (2, 5), generator=g)
    labels[0, 0] = -100
    t = torch.rand(2, 5, generator=g) + 0.4
    ups = [torch.randn(2, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    fn = lambda x: log_probs_and_entropy(x, labels, temperature=t, chunking=Chunking(4, backend="triton"),  # noqa: E731
                                         layer=OutputLayer(**extra), compute_sum_pi_squared=True)
    outs, (grad,) = _run(fn, [z], ups)
    assert grad.dtype == dtype
    z64 = z.double().requires_grad_()
    ref = reference(z64, labels, temperature=t.double(), sum_pi_squared=True, **extra)
    sum((r * u).sum() for r, u in zip(ref, ups, strict=True)).backward()
    for o, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(o.double(), r.detach(), rtol=1e-5, atol=1e-5)
    _check(grad, z64.grad, dtype, 1e-5)
    eager = lambda x: log_probs_and_entropy(x, labels, temperature=t, chunking=Chunking(4, backend="eager"),  # noqa: E731
                                            layer=OutputLayer(**extra), compute_sum_pi_squared=True)
    eager_outs, _ = _run(eager, [z], ups)
    for a, b in zip(outs, eager_outs, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_chunk_size", [None, 16], ids=["whole", "blocks"])
def test_fused_head_matches_float64_and_eager(dtype, vocab_chunk_size):
    """Vocabulary blocks of 16 (labels in every block: v0 offsets), a bias, per-token temperatures, a soft-cap.
    float32 against float64; bf16 (whose logits the head rounds as the model's layer does) against eager."""
    g = torch.Generator().manual_seed(1)
    h, w, b = torch.randn(2, 7, 8, generator=g), torch.randn(W, 8, generator=g) / 2, torch.randn(W, generator=g)
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    labels = torch.randint(0, W, (2, 7), generator=g)
    labels[1, 3] = -100
    t = torch.rand(2, 7, generator=g) + 0.5
    ups = [torch.randn(2, 7, generator=g, dtype=torch.float64) for _ in range(2)]
    fn = lambda h_, w_, b_: linear_log_probs_and_entropy(  # noqa: E731
        h_, OutputLayer(w_, b_, softcap=6.0), labels, chunking=Chunking(5, vocab_chunk_size, "triton"), temperature=t)
    outs, grads = _run(fn, [h, w, b], ups)
    if dtype in HALF:
        eager = lambda h_, w_, b_: linear_log_probs_and_entropy(  # noqa: E731
            h_, OutputLayer(w_, b_, softcap=6.0), labels, chunking=Chunking(5, vocab_chunk_size, "eager"),
            temperature=t)
        eager_outs, eager_grads = _run(eager, [h, w, b], ups)
        for a, e in zip(outs, eager_outs, strict=True):
            torch.testing.assert_close(a, e, rtol=2e-6, atol=2e-6)
        for a, e in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(a.double(), e.double(), rtol=2.0 ** -8, atol=1e-6)
        return
    leaves = [x.double().requires_grad_() for x in (h, w, b)]
    ref = reference(leaves[0] @ leaves[1].T + leaves[2], labels, temperature=t.double(), softcap=6.0)
    sum((r * u).sum() for r, u in zip(ref, ups, strict=True)).backward()
    for o, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(o.double(), r.detach(), rtol=1e-5, atol=1e-5)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got.double(), leaf.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["head", "logits"])
def test_fused_policy_loss_matches_eager(path):
    """The loss form: statistics then the gradient from the same block (the head's buffer overwritten)."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 9, 8, generator=g), torch.randn(W, 8, generator=g)
    labels = torch.randint(0, W, (2, 9), generator=g)
    old, adv = torch.full((2, 9), -4.0), torch.randn(2, 9, generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.2
    results = []
    for backend in ("eager", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if path == "head":
            loss, _ = linear_policy_loss(h, OutputLayer(w, softcap=5.0), labels, old, adv, mask,
                                         loss=PolicyLoss(options={"clip_ratio_c": 3.0}, entropy_coeff=0.01),
                                         chunking=Chunking(4, backend=backend))
        else:
            loss, _ = policy_loss_from_logits(h @ w.T, labels, old, adv, mask, layer=OutputLayer(softcap=5.0),
                                              loss=PolicyLoss(options={"clip_ratio_c": 3.0}, entropy_coeff=0.01),
                                              chunking=Chunking(4, backend=backend))
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra", ["keep", "log_probs_at"])
def test_replay_and_distillation_ride_on_the_kernels(extra):
    """Sampling replay's kept sets and distillation's ids are read from the block the kernels read: the same
    results as eager, values and gradients, on the logits path and the fused head (vocabulary blocks)."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(2, 6, 8, generator=g), torch.randn(W, 8, generator=g) / 2
    labels = torch.randint(0, W, (2, 6), generator=g)
    kw = ({"keep": torch.rand(2, 6, W, generator=g) > 0.5} if extra == "keep"
          else {"log_probs_at": torch.randint(0, W, (2, 6, 3), generator=g), "top_k": 2})
    ups = [torch.randn(2, 6, generator=g, dtype=torch.float64) for _ in range(2)]
    up_at = torch.randn(2, 6, 3, generator=g)
    for path in ("logits", "head"):
        results = []
        for backend in ("eager", "triton"):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            if path == "logits":
                out = log_probs_and_entropy(hh @ ww.T, labels, chunking=Chunking(4, backend=backend), temperature=0.7,
                                            **kw)
            else:
                out = linear_log_probs_and_entropy(hh, ww, labels,
                                                   chunking=Chunking(4, vocab_chunk_size=16, backend=backend),
                                                   temperature=0.7, **kw)
            loss = sum((o.double() * u).sum() for o, u in zip((out.log_probs, out.entropy), ups, strict=True))
            if extra == "log_probs_at":
                loss = loss + (out.log_probs_at * up_at).sum()
            loss.backward()
            vals = [out.log_probs, out.entropy] + ([out.log_probs_at, out.top_k_log_probs] if extra != "keep" else [])
            results.append(vals + [hh.grad, ww.grad])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- edges: NaN, infinities, rounding


@triton.jit
def _bf16_of_bits(x_ptr, out_ptr, n, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(x_ptr + i, mask=i < n).to(tl.float32, bitcast=True)
    tl.store(out_ptr + i, _triton._to_bf16(x), mask=i < n)


def test_the_bf16_rounding_keeps_every_nan_a_nan():
    """The gradient's rounding to bf16 by bits: ties to even, inf kept, and a NaN a NaN of its sign whatever
    its payload. The GPU's NaN is 0x7FFFFFFF, which rounding its bits carried into -0.0 (the interpreter's
    numpy NaN, 0x7FC00000, did not show it); a NaN with only low payload bits became inf."""
    bits = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FC00000, 0x7F800000, 0xFF800000, 0x3F800000,
            0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0x00000001, 0x80000000]
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32)  # two's complement: the same 32 bits
    out = torch.empty(len(bits), dtype=torch.bfloat16)
    _bf16_of_bits[(1,)](x, out, len(bits), B=16)
    f = x.view(torch.float32)
    nan = torch.isnan(f)
    assert nan[:4].all() and torch.isnan(out[nan]).all()
    assert torch.equal(torch.signbit(out[nan]), torch.signbit(f[nan]))
    torch.testing.assert_close(out[~nan], f[~nan].to(torch.bfloat16), rtol=0, atol=0)  # torch rounds to even


def test_a_nan_in_a_tile_makes_the_row_max_nan_as_eager():
    """``tl.max`` and ``tl.maximum`` skip a NaN (compiled and interpreted); eager's row maximum is NaN. Rows
    with a NaN in the last tile, in the first, a +inf, a row of -inf, a confident row at an offset of 1e4."""
    z, target, v0 = _block(torch.float32)
    z[0, 35] = math.nan
    z[1, 0] = math.nan
    z[2, 20] = math.inf
    z[3] = -math.inf
    z[4] += 1e4
    z[4, 9] += 40
    tf, k = TRANSFORMS["plain"], 1.3
    got = _triton.stats(z, tf, k, target, v0, True, True, torch.float32)
    eager = _stats.block_stats(z.clone(), tf, k, target, v0, torch.empty_like(z), want_w=True, want_q=True)
    torch.testing.assert_close(got.m, eager.m, rtol=0, atol=0, equal_nan=True)
    mine, ref = _stats.RowStats.from_block(got, k), _stats.RowStats.from_block(eager, k)
    for a, b in zip(mine[:5], ref[:5], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, equal_nan=True)


def test_the_interpreted_tanh_is_within_an_ulp():
    """With a soft-cap ``u = tanh(...)`` is the row maximum ``m`` and the label's ``zl``: each within an ulp
    of torch's tanh (the interpreter's formula in float32 was 5 ulps off, 1e-3 in ``y`` at ``k = 3e4``)."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(64, W, generator=g) * 3
    target = torch.randint(0, W, (64,), generator=g)
    tf = TRANSFORMS["capped"]
    got = _triton.stats(z, tf, 3e4, target, 0, False, False, torch.float32)
    u = torch.tanh(z * ((tf.logit_scale or 1.0) / tf.softcap))
    for a, b in ((got.m, u.amax(dim=1)), (got.zl, u.gather(1, target[:, None]).squeeze(1))):
        ulp = torch.nextafter(b.abs(), torch.tensor(2.0)) - b.abs()
        assert ((a - b).abs() <= ulp).all(), (a - b).abs().max()


@pytest.mark.parametrize("split", [False, True], ids=["rows", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_rows_match_eager(dtype, split, monkeypatch):
    """End to end, values and gradients (random upstream ones) equal to eager's where eager's are NaN or
    infinite too: a padded vocabulary (-inf columns), a row of -inf, a label on -inf, NaN and +inf logits,
    an offset of 1e4, a confident row, a tie; per-row temperatures, one tiny, as a stride-0 column. ``split``:
    each row across programs, its statistics merged by the second stage (a NaN, an inf in one part only)."""
    if split:
        _split_rows(monkeypatch)
    g = torch.Generator().manual_seed(12)
    z = torch.randn(9, W, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, W - 4, (9,), generator=g)
    z[:, -4:] = -math.inf
    z[1] = -math.inf
    z[2, labels[2]] = -math.inf
    z[3, 17] = math.nan
    z[4, 30] = math.inf
    z[5] += 1e4
    z[6, labels[6]] += 40
    z[7] = 2.0
    labels[8] = -100
    z = z.to(dtype)
    t = torch.tensor([0.7, 1.0, 1.3, 0.9, 1e-3, 0.5, 0.8, 1.1, 2.0]).unsqueeze(1).expand(9, 2)[:, 0]
    ups = [torch.randn(9, generator=g, dtype=torch.float64) for _ in range(3)]
    results = []
    for backend in ("eager", "triton"):
        fn = lambda x: log_probs_and_entropy(x, labels, temperature=t, chunking=Chunking(4, backend=backend),  # noqa: E731,B023
                                             compute_sum_pi_squared=True)
        results.append(_run(fn, [z], ups))
    (eager_outs, (eager_grad,)), (outs, (grad,)) = results
    for a, b in zip(outs, eager_outs, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, equal_nan=True)
    assert torch.isnan(grad[[1, 3, 4]]).all() and torch.isfinite(grad[[0, 2, 5, 6, 7, 8]]).all()
    torch.testing.assert_close(grad.double(), eager_grad.double(), equal_nan=True,
                               **(dict(rtol=2.0 ** -8, atol=1e-6) if dtype in HALF else dict(rtol=1e-5, atol=1e-6)))


def test_padded_columns_at_a_tiny_temperature_pass_no_nan():
    """``g_h / t`` above 3.4e8 (t = 1e-9): the entropy term ``b * (ws - y)`` overflows at a -inf column's
    floored offset, and ``p = 0`` times it was NaN; it is 0, as eager's and float64's."""
    g = torch.Generator().manual_seed(13)
    z = torch.randn(5, W, generator=g) * 3
    z[:, -5:] = -math.inf
    labels = torch.randint(0, W - 5, (5,), generator=g)
    t = torch.tensor([1e-9, 1e-8, 1.0, 3e-9, 0.5])
    ups = [torch.randn(5, generator=g, dtype=torch.float64) * 10 for _ in range(2)]
    results = []
    for backend in ("eager", "triton"):
        fn = lambda x: log_probs_and_entropy(x, labels, temperature=t, chunking=Chunking(4, backend=backend))  # noqa: E731,B023
        results.append(_run(fn, [z], ups))
    (eager_outs, (eager_grad,)), (outs, (grad,)) = results
    assert torch.isfinite(grad).all() and (grad[:, -5:] == 0).all()
    for a, b in zip(outs + [grad], eager_outs + [eager_grad], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the launch: lanes, split rows


@pytest.mark.parametrize("dtype,tf", [("f32", "plain"), ("f32", "capped"), ("bf16", "capped"), ("f64", "plain")])
def test_split_rows_match_one_program_a_row(dtype, tf, monkeypatch):
    """A row split across programs (partial statistics merged by the second stage) against one program a row and
    against eager, on rows of 120 columns (7 parts of 18: a tile of 16 and a partial one each) with a NaN in one
    part, a +inf, a row of -inf, an offset of 1e4, a confident row, a tie at the maximum in two parts; labels
    in several parts, before the block and none. The label's ``u`` is written once, by the part holding it."""
    dtype, tf = DTYPES[dtype], TRANSFORMS[tf]
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(21)
    width, v0 = 120, 5
    z = torch.randn(7, width, generator=g, dtype=torch.float64) * 3
    z[0, 100] = math.nan
    z[1, 40] = math.inf
    z[2] = -math.inf
    z[3] += 1e4
    z[4, 77] += 40
    z[5, 3] = z[5, 110] = z[5].max() + 1
    z = z.to(dtype)
    target = torch.tensor([v0 + 119, v0 + 100, v0 + 7, v0, 2, -1, v0 + 31])
    k = torch.linspace(0.5, 2.0, 7, dtype=cdt).unsqueeze(1)
    results = []
    for on in (False, True):
        _split_rows(monkeypatch, on)
        assert _triton._parts(7, width, 16, z.device) == (7 if on else 1)
        st = _triton.stats(z, tf, k, target, v0, True, True, cdt)
        rows = _stats.RowStats.from_block(st, k)
        co = _stats.Coefficients(*(torch.randn(7, generator=g, dtype=cdt) for _ in range(3)))
        grad = _triton.grad(z, torch.full(z.shape, math.nan, dtype=dtype), tf, k, rows, target, v0, co, cdt)
        results.append((st, rows, grad))
    (st1, rows1, _), (st2, rows2, _) = results
    torch.testing.assert_close(st2.zl, st1.zl, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(st2.m, st1.m, rtol=0, atol=0, equal_nan=True)
    eager = _stats.RowStats.from_block(
        _stats.block_stats(z.to(cdt, copy=True), tf, k, target, v0, torch.empty(z.shape, dtype=cdt), want_w=True,
                           want_q=True), k)
    tight = dict(rtol=1e-12, atol=1e-12) if cdt == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    for a, b, e in zip(rows2[:5], rows1[:5], eager[:5], strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, **tight)
        torch.testing.assert_close(a, e, equal_nan=True, **tight)
    # the gradient of each column is its own: the same bits from the same statistics, however the row is split
    _split_rows(monkeypatch, True)
    co = _stats.Coefficients(*(torch.randn(7, generator=g, dtype=cdt) for _ in range(3)))
    one = _triton.grad(z, torch.empty_like(z), tf, k, rows1, target, v0, co, cdt)
    _split_rows(monkeypatch, False)
    assert torch.equal(one.isnan(), _triton.grad(z, torch.empty_like(z), tf, k, rows1, target, v0, co, cdt).isnan())
    torch.testing.assert_close(one, _triton.grad(z, torch.empty_like(z), tf, k, rows1, target, v0, co, cdt),
                               rtol=0, atol=0, equal_nan=True)


def test_lanes_hold_many_columns():
    """Rows of 1000 columns in tiles of 16: each lane's running statistics over 63 columns, rescaled as its
    maximum rises (columns sorted ascending: every column a new maximum; descending: none after the first),
    against float64 from the definitions."""
    g = torch.Generator().manual_seed(22)
    base = torch.randn(3, 1000, generator=g, dtype=torch.float64) * 4
    z = torch.cat([base.sort(dim=1).values, base.sort(dim=1, descending=True).values, base])
    width = z.shape[1]
    target = torch.tensor([0, 999, 500] * 3)
    k = torch.full((9, 1), 1.3)
    got = _stats.RowStats.from_block(_triton.stats(z.float(), TRANSFORMS["plain"], k, target, 0, True, True,
                                                   torch.float32), k)
    u = z
    y = 1.3 * (u - u.amax(dim=1, keepdim=True))
    lse = torch.logsumexp(y, dim=1)
    p = torch.exp(y - lse.unsqueeze(1))
    ws = (p * y).sum(dim=1)
    yl = y.gather(1, target.unsqueeze(1)).squeeze(1)
    for a, b in zip((got.ls, got.ws, got.s2, got.yl), (lse, ws, (p * p).sum(dim=1), yl), strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    assert width == 1000


def test_auto_probe_passes_the_kernels(monkeypatch):
    """``backend="auto"``'s probe (several tiles a row, soft-cap, per-row temperatures, ``sum_pi_squared``; its
    few long rows split across programs) holds these kernels, at their own tiles, to eager's: they pass, with
    no warning."""
    import warnings

    monkeypatch.setattr(_triton, "MAX_TILE", 8192)
    monkeypatch.setattr(_triton, "PROGRAMS", 264)  # an H100's 132 multiprocessors, twice
    for elem in (2, 4):  # bf16 and float32 blocks: each probe row split across programs
        assert _triton._parts(4, _kernels.PROBE_WIDTH, _triton._stats_config(_kernels.PROBE_WIDTH, elem)[0],
                              torch.device("cpu")) > 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="chunked_entropy")  # not numpy's, of the interpreter's inf - inf
        assert _kernels._probe(_kernels.TRITON, "Triton", torch.device("cpu"), "the compiled kernels")


def test_autotuned_launches_match_and_restore_an_overwritten_block(monkeypatch):
    """The GPU's launch path, ``triton.autotune`` over the configurations (timed here by the clock around the
    interpreter's runs, as Triton's timer needs a GPU): the same statistics as the fixed configuration, and the
    gradient written over its own block restored between the timed runs (else each run would differentiate
    the previous one's output)."""
    import time

    def bench(kernel_call, quantiles):
        start = time.perf_counter()
        kernel_call()
        t = time.perf_counter() - start
        return [t, t, t]

    monkeypatch.setattr(_triton, "MAX_TILE", 8192)
    g = torch.Generator().manual_seed(23)
    z = torch.randn(6, 3000, generator=g) * 3
    target = torch.tensor([0, 2999, 1500, -1, 7, 2000])
    tf, k = TRANSFORMS["capped"], torch.linspace(0.5, 2.0, 6).unsqueeze(1)
    co = _stats.Coefficients(*(torch.randn(6, generator=g) for _ in range(3)))
    results = []
    for tuned in (False, True):
        monkeypatch.setattr(_triton, "AUTOTUNE", tuned)
        monkeypatch.setattr(_triton, "_tuned", {})
        monkeypatch.setattr(_triton, "_BENCH", bench)
        st = _triton.stats(z, tf, k, target, 0, True, True, torch.float32)
        rows = _stats.RowStats.from_block(st, k)
        buf = z.clone()
        _triton.grad(buf, buf, tf, k, rows, target, 0, co, torch.float32)
        results.append((rows, buf))
    assert set(_triton._tuned) == {"stats", "grad"}
    assert len(_triton._tuned["stats"].cache) == 1 and len(_triton._tuned["grad"].cache) == 1
    (rows_fixed, g_fixed), (rows_tuned, g_tuned) = results
    for a, b in zip(rows_tuned[:5], rows_fixed[:5], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(g_tuned, g_fixed, rtol=1e-5, atol=1e-7)
@triton.jit
def _capped_u(z_ptr, cap_ptr, out_ptr, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    z = tl.load(z_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, _triton._u(z, tl.load(cap_ptr), True, tl.float32), mask=i < n)


@pytest.mark.parametrize("top_k", [None, 2])
def test_a_confident_tokens_log_prob_is_never_above_0(top_k):
    """Rows whose largest logit is where the kernels' tanh and torch's differ by an ulp (a soft-cap of 30 at
    t = 1e-3: 1.8e-3 nats): the log-probs at the row's top id and the top-k's are eager's, <= 0 (the kernels'
    row maximum with the ids' eager u gave +1.8e-3)."""
    g = torch.Generator().manual_seed(0)
    cand = torch.rand(1 << 15, generator=g) * 60 + 10
    cap = torch.tensor([1 / 30.0])
    u = torch.empty_like(cand)
    _capped_u[(cand.numel() // 1024,)](cand, cap, u, cand.numel(), B=1024)
    differ = cand[u != torch.tanh(cand * (1 / 30.0))][:16]
    assert differ.numel() >= 4  # the kernels' tanh is not torch's everywhere: the case this test is about
    n, v = differ.numel(), 16
    z = torch.randn(n, v, generator=g) * 3
    top = torch.randint(0, v, (n,), generator=g)
    z[torch.arange(n), top] = differ
    ids = torch.stack([top, (top + 1) % v], 1)
    kw = dict(layer=OutputLayer(softcap=30.0), temperature=1e-3, log_probs_at=ids, top_k=top_k)
    out, eager = (log_probs_and_entropy(z, top, chunking=Chunking(8, backend=be), **kw) for be in ("triton", "eager"))
    for got, ref in [(out.log_probs_at, eager.log_probs_at)] + (
            [(out.top_k_log_probs, eager.top_k_log_probs)] if top_k else []):
        assert got.max() <= 0, got.max()
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
