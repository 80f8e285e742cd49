"""The per-block math as Triton kernels (``backend="triton"``): one program per row, the row walked in tiles.

The same statistics and gradient as :func:`chunked_entropy._stats.stats_of_block`
and :func:`~chunked_entropy._stats.grad_of_block` (see :mod:`chunked_entropy._stats`
for the math), with the same contracts as the compiled backend
(:class:`chunked_entropy._kernels._Compiled`): both kernels only read the raw
block ``z`` (any float dtype, any strides: bf16/fp16 logits are read directly,
never copied to float32) and compute in the compute dtype (float32, or float64
for float64 blocks).

- **Statistics** (:func:`stats`): each program reads its row once, tile by
  tile; each tile's ``(m, ones, rest, w, q)`` relative to the tile's own
  maximum is merged into the row's running ones exactly as
  :func:`~chunked_entropy._stats.merge_stats` merges two vocabulary blocks (an
  online softmax), so a row's statistics are the same sums as the eager
  reference's, reassociated. Writes six per-row values.
- **Gradient** (:func:`grad`): each program reads its row once more and
  writes the gradient row into ``out`` in ``out``'s dtype (the logits' own
  gradient, bf16 for bf16 logits: computed in float32, rounded once), which
  may be the block itself (the fused head's buffer, overwritten).

Memory: no buffer beyond the outputs (six ``[n]`` vectors; the gradient block
is the caller's ``out``). Offsets are int64, so a block may exceed 2**31
elements.

This module imports Triton and is imported only on first use of the backend
(:data:`chunked_entropy._kernels.TRITON`). Its kernels are decorated when it
is imported: with ``TRITON_INTERPRET=1`` in the environment by then, they run
through Triton's interpreter (numpy, on CPU tensors: slow, for tests), and
:data:`INTERPRETED` is True. The one function the interpreter lacks is
``tanh`` (libdevice): interpreted kernels form it from ``exp`` and ``log``
(:func:`_tanh_interpreted`), compiled ones call libdevice's, as Inductor does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import _stats


def _interpreting() -> bool:
    """Whether ``triton.jit`` makes interpreted functions now: Triton's own switch (``triton.knobs``), or
    its environment variable in Triton versions without ``knobs``."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


#: Whether these kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` when this module was imported).
INTERPRETED = _interpreting()

#: The widest column tile a program reads at once (a power of 2); tests lower it to walk several tiles.
MAX_TILE = 4096

_NEG_FLOOR = _stats.NEG_FLOOR
_COMPUTE = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def _tanh_interpreted(x):
    """``tanh`` from accurate ``exp``/``log`` (the interpreter's numpy): ``-expm1(-2|x|) / (2 + expm1(-2|x|))``
    with the sign of ``x``, ``expm1(v) = (e - 1) * v / log(e)`` for ``e = exp(v)`` (Kahan: the rounding of
    ``e`` cancels between the two factors), and ``x`` itself where ``e == 1``. Formed in float64 (free in
    numpy) and rounded once to ``x``'s dtype: float32 ``u`` within an ulp, as torch's (the formula alone
    in float32 is off by up to 5 ulps, which a small temperature's ``k`` of 1e4 makes 1e-3 in ``y``)."""
    out_dtype = x.dtype
    x = x.to(tl.float64)
    v = -2.0 * tl.abs(x)
    e = tl.exp(v)
    tiny = e == 1.0  # |x| below half an ulp of 1: tanh(x) = x
    flat = e == 0.0  # tanh(x) = +-1 (x = +-inf too)
    em1 = (e - 1.0) * v / tl.log(tl.where(tiny | flat, 0.5, e))
    em1 = tl.where(flat, -1.0, em1)
    t = tl.where(tiny, tl.abs(x), -em1 / (2.0 + em1))
    return tl.where(x < 0, -t, t).to(out_dtype)


if INTERPRETED:
    _tanh = _tanh_interpreted
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _tanh(x):
        return libdevice.tanh(x)


@triton.jit
def _to_bf16(x):
    """float32 ``x`` rounded to the nearest bfloat16, ties to even (by its bits: the interpreter's own cast
    truncates, so the rounding is written out, the same on every backend; inf stays inf). A NaN is made a
    quiet NaN of its sign without rounding: rounding its bits would carry a NaN with low payload bits into
    inf, and the GPU's own NaN, ``0x7FFFFFFF``, across the sign into ``-0.0``."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    bits = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _u(z, cap, HAS_CAP: tl.constexpr, COMPUTE: tl.constexpr):
    """``u``: ``tanh(z * logit_scale / softcap)`` with a cap (``cap`` is that factor), else ``z``; in ``COMPUTE``."""
    u = z.to(COMPUTE)
    if HAS_CAP:
        u = _tanh(u * cap)
    return u


@triton.jit
def _max_nan(a, b):
    """``max(a, b)``, NaN if either is (``torch.max``'s rule). Triton's own ``tl.max`` and ``tl.maximum``
    ignore a NaN (``maxnum`` compiled, ``nanmax`` in the interpreter): every maximum here says which it is."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _shift(m_from, m_to, k, NEG_FLOOR: tl.constexpr):
    """``k * (m_from - m_to)`` clamped at NEG_FLOOR, and -inf-safe (:func:`chunked_entropy._stats._shift`);
    NaN stays NaN, as ``clamp`` keeps it."""
    d = tl.where(m_from == -float("inf"), -float("inf"), m_from - m_to) * k
    return _max_nan(d, NEG_FLOOR)


@triton.jit
def _stats_kernel(
    z_ptr, stride_zr, stride_zc, width, cap_ptr, k_ptr, stride_k, target_ptr, v0,
    m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, zl_ptr,
    HAS_CAP: tl.constexpr, WANT_W: tl.constexpr, WANT_Q: tl.constexpr,
    TILE: tl.constexpr, COMPUTE: tl.constexpr, NEG_FLOOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_zr
    k = tl.load(k_ptr + row * stride_k).to(COMPUTE)
    cap = 0.0
    if HAS_CAP:
        cap = tl.load(cap_ptr).to(COMPUTE)
    neg_inf = -float("inf")
    m = tl.full((), neg_inf, COMPUTE)
    ones = tl.zeros((), COMPUTE)
    rest = tl.zeros((), COMPUTE)
    w = tl.zeros((), COMPUTE)
    q = tl.zeros((), COMPUTE)
    cols0 = tl.arange(0, TILE).to(tl.int64)
    for start in range(0, width, TILE):
        cols = start + cols0
        inside = cols < width
        u = _u(tl.load(z_row + cols * stride_zc, mask=inside, other=0.0), cap, HAS_CAP, COMPUTE)
        u = tl.where(inside, u, neg_inf)
        # the tile's statistics relative to its own maximum mt (a tile of -inf shifts by 0: offsets NEG_FLOOR)
        mt = tl.reduce(u, 0, _max_nan)  # NaN where the tile has one, as the eager kernels' row max
        y = _max_nan((u - tl.where(mt == neg_inf, 0.0, mt)) * k, NEG_FLOOR)
        e = tl.exp(y)
        top = y == 0.0
        t_ones = tl.sum(top.to(COMPUTE), axis=0)
        t_rest = tl.sum(tl.where(top, 0.0, e), axis=0)
        # merged into the running statistics: both re-expressed relative to the larger maximum (_stats.rescale)
        m_new = _max_nan(m, mt)
        d_a = _shift(m, m_new, k, NEG_FLOOR)
        d_b = _shift(mt, m_new, k, NEG_FLOOR)
        f_a = tl.exp(d_a)
        f_b = tl.exp(d_b)
        s_a = ones + rest
        s_b = t_ones + t_rest
        ones_new = tl.where(f_a == 1.0, ones, 0.0) + tl.where(f_b == 1.0, t_ones, 0.0)
        rest = tl.where(f_a == 1.0, rest, s_a * f_a) + tl.where(f_b == 1.0, t_rest, s_b * f_b)
        ones = ones_new
        if WANT_W:
            w = w * f_a + s_a * f_a * d_a + tl.sum(e * y, axis=0) * f_b + s_b * f_b * d_b
        if WANT_Q:
            q = q * (f_a * f_a) + tl.sum(e * e, axis=0) * (f_b * f_b)
        m = m_new
    # the label's u, where the label is in this block (0 elsewhere, and for -1)
    col = tl.load(target_ptr + row) - v0
    has = (col >= 0) & (col < width)
    zl = _u(tl.load(z_row + tl.where(has, col, 0) * stride_zc), cap, HAS_CAP, COMPUTE)
    tl.store(m_ptr + row, m)
    tl.store(ones_ptr + row, ones)
    tl.store(rest_ptr + row, rest)
    tl.store(zl_ptr + row, tl.where(has, zl, 0.0))
    if WANT_W:
        tl.store(w_ptr + row, w)
    if WANT_Q:
        tl.store(q_ptr + row, q)


@triton.jit
def _grad_kernel(
    z_ptr, stride_zr, stride_zc, out_ptr, stride_or, stride_oc, width, cap_ptr, k_ptr, stride_k,
    m_ptr, ls_ptr, ws_ptr, s2_ptr, target_ptr, v0, c_ptr, b_ptr, a_ptr,
    HAS_CAP: tl.constexpr, HAS_C: tl.constexpr, HAS_B: tl.constexpr, HAS_A: tl.constexpr, OUT_BF16: tl.constexpr,
    TILE: tl.constexpr, COMPUTE: tl.constexpr, NEG_FLOOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_zr
    out_row = out_ptr + row * stride_or
    k = tl.load(k_ptr + row * stride_k).to(COMPUTE)
    m = tl.load(m_ptr + row).to(COMPUTE)
    shift = tl.where(m == -float("inf"), 0.0, m)
    ls = tl.load(ls_ptr + row).to(COMPUTE)
    cap = 0.0
    c = 0.0
    b = 0.0
    ws = 0.0
    a = 0.0
    s2 = 0.0
    if HAS_CAP:
        cap = tl.load(cap_ptr).to(COMPUTE)
    if HAS_C:
        c = tl.load(c_ptr + row).to(COMPUTE)
    if HAS_B:
        b = tl.load(b_ptr + row).to(COMPUTE)
        ws = tl.load(ws_ptr + row).to(COMPUTE)
    if HAS_A:
        a = tl.load(a_ptr + row).to(COMPUTE)
        s2 = tl.load(s2_ptr + row).to(COMPUTE)
    label = tl.load(target_ptr + row) - v0  # -1 - v0 < 0 for no label: no column matches
    cols0 = tl.arange(0, TILE).to(tl.int64)
    for start in range(0, width, TILE):
        cols = start + cols0
        inside = cols < width
        u = _u(tl.load(z_row + cols * stride_zc, mask=inside, other=0.0), cap, HAS_CAP, COMPUTE)
        y = _max_nan((u - shift) * k, NEG_FLOOR)
        p = tl.exp(y - ls)
        inner = tl.zeros_like(p) - c
        if HAS_B:
            inner += b * (ws - y)  # 0 * finite where p == 0
        if HAS_A:
            inner += a * (p - s2)
        g = p * inner
        if HAS_B:  # 0 where p == 0: b * (ws - y) overflows at a floored offset for |b| > 3.4e8, and 0 * inf is NaN
            g = tl.where(p == 0.0, 0.0, g)
        if HAS_C:
            g += tl.where(cols == label, c, 0.0)
        if HAS_CAP:
            g = g * (1.0 - u * u)
        if OUT_BF16:
            g = _to_bf16(g)
        tl.store(out_row + cols * stride_oc, g.to(out_ptr.dtype.element_ty), mask=inside)


def _tile(width: int) -> tuple:
    """The column tile and warps for a row of ``width`` columns. (Both launches also state
    ``enable_fp_fusion=True``, Triton's default until 3.9, which warns that 3.10 changes it.)"""
    tile = min(triton.next_power_of_2(max(width, 1)), MAX_TILE)
    return tile, (8 if tile >= 2048 else 4)


def _per_row(t, n: int, dtype, device):
    """A per-row factor (None: 1, a float, an ``[n]`` or ``[n, 1]`` tensor) as ``(tensor, row stride)``:
    a float is a one-element tensor read with stride 0 (a fill on the device, no host copy)."""
    if isinstance(t, torch.Tensor):
        t = t.reshape(n) if t.dim() > 1 else t
        return t, t.stride(0)
    return torch.full((1,), 1.0 if t is None else float(t), dtype=dtype, device=device), 0


def _cap(tf: _stats.Transform, dtype, device):
    """``logit_scale / softcap`` as a one-element tensor (None without a cap)."""
    if tf.softcap is None:
        return None
    return torch.full((1,), (tf.logit_scale or 1.0) / tf.softcap, dtype=dtype, device=device)


def _vec(t):
    """A per-row ``[n]`` input, contiguous (an expanded upstream gradient has stride 0)."""
    return t.detach().contiguous()


def stats(z, tf: _stats.Transform, k, target, v0: int, want_w: bool, want_q: bool, dtype) -> _stats.BlockStats:
    """:func:`chunked_entropy._stats.stats_of_block` of the raw ``[n, width]`` block ``z`` (read only), with
    ``w`` and ``q`` None unless wanted. Allocates the six ``[n]`` results."""
    n, width = z.shape
    out = torch.empty((6, n), dtype=dtype, device=z.device)
    m, ones, rest, w, q, zl = out.unbind(0)
    if n:
        z = z.detach()
        kt, sk = _per_row(k, n, dtype, z.device)
        cap = _cap(tf, dtype, z.device)
        tile, warps = _tile(width)
        _stats_kernel[(n,)](
            z, z.stride(0), z.stride(1), width, kt if cap is None else cap, kt, sk, _vec(target), v0,
            m, ones, rest, w, q, zl,
            HAS_CAP=cap is not None, WANT_W=bool(want_w), WANT_Q=bool(want_q),
            TILE=tile, COMPUTE=_COMPUTE[dtype], NEG_FLOOR=_NEG_FLOOR, num_warps=warps, enable_fp_fusion=True,
        )
    return _stats.BlockStats(m, ones, rest, w if want_w else None, q if want_q else None, zl)


def grad(z, out, tf: _stats.Transform, k, row: _stats.RowStats, target, v0: int, co: _stats.Coefficients, dtype):
    """:func:`chunked_entropy._stats.grad_of_block` of the raw ``[n, width]`` block ``z`` (read only) written
    into ``out`` (``[n, width]``, any float dtype, any strides; it may be ``z`` itself) and returned.
    ``row`` holds the rows' statistics (``ws`` needed with ``co.b``, ``s2`` with ``co.a``); an absent
    coefficient costs nothing. Allocates nothing beyond a contiguous copy of a strided per-row input."""
    n, width = z.shape
    if not n:
        return out
    kt, sk = _per_row(k, n, dtype, z.device)
    cap = _cap(tf, dtype, z.device)
    c, b, a = co
    dummy = row.ls  # pointer arguments of absent terms (never read)
    vec = lambda t: dummy if t is None else _vec(t)  # noqa: E731
    tile, warps = _tile(width)
    _grad_kernel[(n,)](
        z.detach(), z.stride(0), z.stride(1), out, out.stride(0), out.stride(1), width,
        kt if cap is None else cap, kt, sk,
        _vec(row.m), _vec(row.ls), vec(row.ws if b is not None else None), vec(row.s2 if a is not None else None),
        _vec(target), v0, vec(c), vec(b), vec(a),
        HAS_CAP=cap is not None, HAS_C=c is not None, HAS_B=b is not None, HAS_A=a is not None,
        OUT_BF16=out.dtype == torch.bfloat16 and dtype == torch.float32,
        TILE=tile, COMPUTE=_COMPUTE[dtype], NEG_FLOOR=_NEG_FLOOR, num_warps=warps, enable_fp_fusion=True,
    )
    return out

