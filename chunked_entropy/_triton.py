"""The per-block math as Triton kernels (``backend="triton"``): rows walked in tiles, few long rows split.

The same statistics and gradient as :func:`chunked_entropy._stats.stats_of_block`
and :func:`~chunked_entropy._stats.grad_of_block` (see :mod:`chunked_entropy._stats`
for the math), with the same contracts as the compiled backend
(:class:`chunked_entropy._kernels._Compiled`): both kernels only read the raw
block ``z`` (any float dtype, any strides: bf16/fp16 logits are read directly,
never copied to float32) and compute in the compute dtype (float32, or float64
for float64 blocks).

- **Statistics** (:func:`stats`): each program reads its row (or its part of
  the row) once, tile by tile. Each of the tile's lanes keeps running
  statistics ``(m, ones, rest, w, q)`` of the columns it has read, relative
  to its own maximum, updated column by column with one ``exp`` and no
  reduction across lanes (:func:`_lane_step`); the lanes are merged once, at
  the end (:func:`_merge_lanes`), as :func:`~chunked_entropy._stats.merge_stats`
  merges vocabulary blocks (an online softmax). A row's statistics are the
  same sums as the eager reference's, reassociated. Writes six per-row values,
  into the caller's ``[6, n]`` rows (``out``); with ``merge``, the running
  statistics of the previous vocabulary blocks there are read and merged
  with the block's first (:func:`_merge_running`: ``merge_stats`` op for op),
  so a walk over vocabulary blocks launches no merge of its own.
- **Split rows.** Where the rows are too few to fill the device (fewer than
  twice its multiprocessors) and long (each part at least
  :data:`MIN_SPLIT_TILES` tiles), a row is split across programs
  (:func:`_parts`): each writes its part's statistics, and a second launch
  merges the parts as the lanes are (:func:`_merge_parts_kernel`).
- **Gradient** (:func:`grad`): each program reads its row (or part) once more
  and writes the gradient into ``out`` in ``out``'s dtype (the logits' own
  gradient, bf16 for bf16 logits: computed in float32, rounded once), which
  may be the block itself (the fused head's buffer, overwritten).
- **Tiles and warps** by the logits' dtype and the part's width: 8 KiB of
  logits a statistics tile (4096 bf16 columns, 2048 float32) at 8 columns a
  thread, 16 KiB a gradient tile at 16; on a GPU chosen by ``triton.autotune``
  among a few configurations, once per shape class (the part's power-of-2
  width, the dtypes and the variant); :data:`AUTOTUNE`.

Memory: no buffer beyond the outputs (six ``[n]`` vectors, or the caller's
``out``; the gradient block is the caller's ``out``), and for split rows
``6 * parts`` floats a row (at most :data:`MAX_PARTS` parts). Offsets are int64, so a block may exceed 2**31
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
def _lane_step(m, ones, rest, w, q, u, k, WANT_W: tl.constexpr, WANT_Q: tl.constexpr, NEG_FLOOR: tl.constexpr):
    """One column more in each lane's running statistics ``(m, ones, rest, w, q)`` (vectors, one entry a lane,
    relative to the lane's own maximum ``m``): the column ``u`` (-inf where masked) merged as
    :func:`chunked_entropy._stats.merge_stats` merges a block of one column, in one ``exp``: of the two
    sides, the one with the larger maximum is scaled by 1 (0 where that maximum is -inf) and the other by
    ``exp(k * (lo - hi))``. No reduction across lanes."""
    hi = _max_nan(m, u)
    lo = tl.minimum(m, u)
    d = _shift(lo, hi, k, NEG_FLOOR)
    f_small = tl.exp(d)
    f_big = tl.where(hi == -float("inf"), 0.0, 1.0)
    d_big = tl.where(hi == -float("inf"), NEG_FLOOR, 0.0)
    new = u > m  # the column is the lane's new maximum: the lane's sums are the ones scaled
    f_a = tl.where(new, f_small, f_big)
    d_a = tl.where(new, d, d_big)
    f_b = tl.where(new, f_big, f_small)
    d_b = tl.where(new, d_big, d)
    one = tl.where(u == -float("inf"), 0.0, 1.0)  # the column's own statistics: ones = s = q = 1, rest = w = 0
    s_a = ones + rest
    ones_new = tl.where(f_a == 1.0, ones, 0.0) + tl.where(f_b == 1.0, one, 0.0)
    rest = tl.where(f_a == 1.0, rest, s_a * f_a) + tl.where(f_b == 1.0, 0.0, one * f_b)
    if WANT_W:
        w = w * f_a + s_a * f_a * d_a + one * f_b * d_b
    if WANT_Q:
        q = q * (f_a * f_a) + one * (f_b * f_b)
    return hi, ones_new, rest, w, q


@triton.jit
def _merge_lanes(m, ones, rest, w, q, k, WANT_W: tl.constexpr, WANT_Q: tl.constexpr, NEG_FLOOR: tl.constexpr):
    """The lanes' statistics (vectors, each relative to its own maximum) merged into the row's, relative to the
    largest maximum: each lane rescaled once (one ``exp`` a lane) and summed, the merge of
    :func:`chunked_entropy._stats.merge_stats` over every lane at once. Returns five scalars."""
    mr = tl.reduce(m, 0, _max_nan)  # NaN where a lane has one, as the eager kernels' row max
    d = _shift(m, mr, k, NEG_FLOOR)
    f = tl.exp(d)
    s = ones + rest
    ones_r = tl.sum(tl.where(f == 1.0, ones, 0.0), axis=0)
    rest_r = tl.sum(tl.where(f == 1.0, rest, s * f), axis=0)
    w_r = 0.0
    q_r = 0.0
    if WANT_W:
        w_r = tl.sum(w * f + s * f * d, axis=0)
    if WANT_Q:
        q_r = tl.sum(q * (f * f), axis=0)
    return mr, ones_r, rest_r, w_r, q_r


@triton.jit
def _rescale_to(m, ones, rest, w, q, m_new, k, WANT_W: tl.constexpr, WANT_Q: tl.constexpr,
                NEG_FLOOR: tl.constexpr):
    """One side's statistics relative to the larger maximum ``m_new``: :func:`chunked_entropy._stats.rescale`,
    op for op (a factor of exactly 1 keeps ``ones`` apart; any other moves the whole sum into ``rest``)."""
    d = _shift(m, m_new, k, NEG_FLOOR)
    f = tl.exp(d)
    keep = f == 1.0
    s = ones + rest
    ones = tl.where(keep, ones, 0.0)
    rest = tl.where(keep, rest, s * f)
    if WANT_W:
        w = w * f + s * f * d
    if WANT_Q:
        q = q * (f * f)
    return ones, rest, w, q


@triton.jit
def _merge_running(m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, zl_ptr, at, mb, ones_b, rest_b, w_b, q_b, zl_b, k,
                   WANT_W: tl.constexpr, WANT_Q: tl.constexpr, COMPUTE: tl.constexpr, NEG_FLOOR: tl.constexpr):
    """The running statistics of the previous vocabulary blocks (read at ``at``) merged with this block's
    (``mb``, ...): :func:`chunked_entropy._stats.merge_stats` of the two, op for op, in its order (the
    running side first). Returns the merged six values."""
    ma = tl.load(m_ptr + at).to(COMPUTE)
    ones_a = tl.load(ones_ptr + at).to(COMPUTE)
    rest_a = tl.load(rest_ptr + at).to(COMPUTE)
    zl_a = tl.load(zl_ptr + at).to(COMPUTE)
    w_a = 0.0
    q_a = 0.0
    if WANT_W:
        w_a = tl.load(w_ptr + at).to(COMPUTE)
    if WANT_Q:
        q_a = tl.load(q_ptr + at).to(COMPUTE)
    m = _max_nan(ma, mb)
    ones_a, rest_a, w_a, q_a = _rescale_to(ma, ones_a, rest_a, w_a, q_a, m, k, WANT_W, WANT_Q, NEG_FLOOR)
    ones_b, rest_b, w_b, q_b = _rescale_to(mb, ones_b, rest_b, w_b, q_b, m, k, WANT_W, WANT_Q, NEG_FLOOR)
    return m, ones_a + ones_b, rest_a + rest_b, w_a + w_b, q_a + q_b, zl_a + zl_b


@triton.jit
def _store_stats(m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, at, m, ones, rest, w, q, WANT_W: tl.constexpr,
                 WANT_Q: tl.constexpr):
    """Statistics written at ``at`` (``w`` and ``q`` only where wanted; the label's ``u`` is the caller's): what
    both statistics kernels write, the counterpart of :func:`_merge_running`'s loads."""
    tl.store(m_ptr + at, m)
    tl.store(ones_ptr + at, ones)
    tl.store(rest_ptr + at, rest)
    if WANT_W:
        tl.store(w_ptr + at, w)
    if WANT_Q:
        tl.store(q_ptr + at, q)


@triton.jit
def _stats_kernel(
    z_ptr, stride_zr, stride_zc, width, span, cap_ptr, k_ptr, stride_k, target_ptr, v0,
    m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, zl_ptr, n, span_class,
    HAS_CAP: tl.constexpr, HAS_K: tl.constexpr, WANT_W: tl.constexpr, WANT_Q: tl.constexpr, MERGE: tl.constexpr,
    TILE: tl.constexpr, COMPUTE: tl.constexpr, NEG_FLOOR: tl.constexpr,
):
    """Program ``(row, part)``: the statistics of columns ``[part * span, (part + 1) * span)`` of the row, written
    at ``part * n + row`` (the row's own, when the row is one part; else the second stage merges the parts).
    Each of the ``TILE`` lanes keeps running statistics over its columns (:func:`_lane_step`, no reduction
    inside the loop); they are merged once, at the end (:func:`_merge_lanes`). ``MERGE`` (one part a row
    only): the outputs hold the running statistics of the row's previous vocabulary blocks, which the program
    reads and merges with its own (:func:`_merge_running`) before it writes them over. ``span_class`` only keys
    the autotuner's choice of ``TILE`` and warps."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    lo = part * span
    hi = tl.minimum(lo + span, width)
    z_row = z_ptr + row * stride_zr
    k = 1.0  # no per-row multiplier (HAS_K off): x * 1.0, the bits of a loaded 1.0
    if HAS_K:
        k = tl.load(k_ptr + row * stride_k).to(COMPUTE)
    cap = 0.0
    if HAS_CAP:
        cap = tl.load(cap_ptr).to(COMPUTE)
    m = tl.full((TILE,), -float("inf"), COMPUTE)
    ones = tl.zeros((TILE,), COMPUTE)
    rest = tl.zeros((TILE,), COMPUTE)
    w = tl.zeros((TILE,), COMPUTE)
    q = tl.zeros((TILE,), COMPUTE)
    cols0 = tl.arange(0, TILE).to(tl.int64)
    for start in range(lo, hi, TILE):
        cols = start + cols0
        inside = cols < hi
        u = _u(tl.load(z_row + cols * stride_zc, mask=inside, other=0.0), cap, HAS_CAP, COMPUTE)
        u = tl.where(inside, u, -float("inf"))
        m, ones, rest, w, q = _lane_step(m, ones, rest, w, q, u, k, WANT_W, WANT_Q, NEG_FLOOR)
    mr, ones_r, rest_r, w_r, q_r = _merge_lanes(m, ones, rest, w, q, k, WANT_W, WANT_Q, NEG_FLOOR)
    # the label's u, where the label is in this block (0 elsewhere, and for -1): written by the part holding
    # it, or by the first part where the block does not hold it
    col = tl.load(target_ptr + row) - v0
    has = (col >= 0) & (col < width)
    zl = _u(tl.load(z_row + tl.where(has, col, 0) * stride_zc), cap, HAS_CAP, COMPUTE)
    zl = tl.where(has, zl, 0.0)
    if MERGE:
        mr, ones_r, rest_r, w_r, q_r, zl = _merge_running(m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, zl_ptr, row, mr,
                                                          ones_r, rest_r, w_r, q_r, zl, k, WANT_W, WANT_Q, COMPUTE,
                                                          NEG_FLOOR)
    _store_stats(m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, part * n + row, mr, ones_r, rest_r, w_r, q_r, WANT_W, WANT_Q)
    if (has & (col >= lo) & (col < hi)) | ((has == 0) & (part == 0)):
        tl.store(zl_ptr + row, zl)


@triton.jit
def _merge_parts_kernel(
    pm_ptr, pones_ptr, prest_ptr, pw_ptr, pq_ptr, pzl_ptr, parts, n, k_ptr, stride_k,
    m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, zl_ptr,
    HAS_K: tl.constexpr, WANT_W: tl.constexpr, WANT_Q: tl.constexpr, MERGE: tl.constexpr, PARTS: tl.constexpr,
    COMPUTE: tl.constexpr, NEG_FLOOR: tl.constexpr,
):
    """The second stage of a row split across programs: its ``parts`` partial statistics (at ``part * n +
    row``) merged into the row's, as lanes are (:func:`_merge_lanes`), with the label's ``u`` the parts wrote
    at ``pzl_ptr + row``; ``MERGE``: then merged with the running statistics of the row's previous vocabulary
    blocks (:func:`_merge_running`), as the one-part statistics kernel merges them."""
    row = tl.program_id(0).to(tl.int64)
    k = 1.0  # no per-row multiplier (HAS_K off): x * 1.0, the bits of a loaded 1.0
    if HAS_K:
        k = tl.load(k_ptr + row * stride_k).to(COMPUTE)
    idx = tl.arange(0, PARTS).to(tl.int64)
    inside = idx < parts
    at = idx * n + row
    m = tl.load(pm_ptr + at, mask=inside, other=-float("inf")).to(COMPUTE)
    ones = tl.load(pones_ptr + at, mask=inside, other=0.0).to(COMPUTE)
    rest = tl.load(prest_ptr + at, mask=inside, other=0.0).to(COMPUTE)
    w = tl.zeros((PARTS,), COMPUTE)
    q = tl.zeros((PARTS,), COMPUTE)
    if WANT_W:
        w = tl.load(pw_ptr + at, mask=inside, other=0.0).to(COMPUTE)
    if WANT_Q:
        q = tl.load(pq_ptr + at, mask=inside, other=0.0).to(COMPUTE)
    mr, ones_r, rest_r, w_r, q_r = _merge_lanes(m, ones, rest, w, q, k, WANT_W, WANT_Q, NEG_FLOOR)
    zl = tl.load(pzl_ptr + row).to(COMPUTE)
    if MERGE:
        mr, ones_r, rest_r, w_r, q_r, zl = _merge_running(m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, zl_ptr, row, mr,
                                                          ones_r, rest_r, w_r, q_r, zl, k, WANT_W, WANT_Q, COMPUTE,
                                                          NEG_FLOOR)
    _store_stats(m_ptr, ones_ptr, rest_ptr, w_ptr, q_ptr, row, mr, ones_r, rest_r, w_r, q_r, WANT_W, WANT_Q)
    tl.store(zl_ptr + row, zl)


@triton.jit
def _grad_kernel(
    z_ptr, stride_zr, stride_zc, out_ptr, stride_or, stride_oc, width, span, cap_ptr, k_ptr, stride_k,
    m_ptr, ls_ptr, ws_ptr, s2_ptr, target_ptr, v0, c_ptr, b_ptr, a_ptr, span_class,
    HAS_CAP: tl.constexpr, HAS_K: tl.constexpr, HAS_C: tl.constexpr, HAS_B: tl.constexpr, HAS_A: tl.constexpr,
    OUT_BF16: tl.constexpr,
    TILE: tl.constexpr, COMPUTE: tl.constexpr, NEG_FLOOR: tl.constexpr,
):
    """Program ``(row, part)``: the gradient of columns ``[part * span, (part + 1) * span)`` of the row."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    lo = part * span
    hi = tl.minimum(lo + span, width)
    z_row = z_ptr + row * stride_zr
    out_row = out_ptr + row * stride_or
    k = 1.0  # no per-row multiplier (HAS_K off): x * 1.0, the bits of a loaded 1.0
    if HAS_K:
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
    for start in range(lo, hi, TILE):
        cols = start + cols0
        inside = cols < hi
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


# ----------------------------------------------------------------------------- launch configuration

#: The widest column tile a program reads at once (a power of 2); tests lower it to walk several tiles.
MAX_TILE = 8192
#: Columns a thread handles per tile of the statistics' kernel (the lanes' running statistics live in
#: registers: 8 keep them there), and the widest tile by the logits' bytes: 8 KiB of bf16, float32 or float64.
_STATS_THREAD_COLUMNS = 8
_STATS_TILE = {2: 4096, 4: 2048, 8: 1024}
#: Columns a thread writes per tile of the gradient's kernel (no state: wider tiles, fewer loop trips).
_GRAD_THREAD_COLUMNS = 16
#: A row is split across programs only where each part still reads this many tiles (the second stage and
#: the parts' partial statistics cost a launch and ``5 * parts`` floats a row).
MIN_SPLIT_TILES = 4
#: At most this many parts a row (the second stage merges them as one vector).
MAX_PARTS = 64
#: Programs to keep the device busy (None: twice its streaming multiprocessors, read on first use; 8 on a CPU,
#: the interpreter's).
PROGRAMS = None
_programs = {}


def _device_programs(device: torch.device) -> int:
    if PROGRAMS is not None:
        return PROGRAMS
    key = (device.type, device.index)
    if key not in _programs:
        count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        _programs[key] = 2 * count
    return _programs[key]


def _warps(tile: int, columns_per_thread: int) -> int:
    return max(1, min(16, tile // (32 * columns_per_thread)))


def _stats_config(width: int, elem: int) -> tuple:
    """``(TILE, warps)`` of the statistics' kernel for a part of ``width`` columns of ``elem``-byte logits: the
    part's own width, at most 8 KiB of logits a tile (:data:`_STATS_TILE`) and :data:`MAX_TILE`; 8 columns a
    thread."""
    tile = min(triton.next_power_of_2(max(width, 1)), _STATS_TILE.get(elem, 2048), MAX_TILE)
    return tile, _warps(tile, _STATS_THREAD_COLUMNS)


def _grad_config(width: int, elem: int) -> tuple:
    """``(TILE, warps)`` of the gradient's kernel: the part's own width, at most 16 KiB of logits a tile and
    :data:`MAX_TILE`; 16 columns a thread, up to 16 warps."""
    tile = min(triton.next_power_of_2(max(width, 1)), 2 * _STATS_TILE.get(elem, 2048), MAX_TILE)
    return tile, _warps(tile, _GRAD_THREAD_COLUMNS)


def _parts(n: int, width: int, tile: int, device: torch.device) -> int:
    """How many programs share a row: 1, unless the rows are too few to fill the device and each part would
    still read :data:`MIN_SPLIT_TILES` tiles; then enough parts to fill it (at most :data:`MAX_PARTS`)."""
    programs = _device_programs(device)
    if n >= programs:
        return 1
    by_width = width // (tile * MIN_SPLIT_TILES)
    return max(1, min(MAX_PARTS, -(-programs // max(n, 1)), by_width))


def _span_class(span: int) -> int:
    """The autotuner's shape class of a part of ``span`` columns: its power of 2 (at most 2**20)."""
    return min(triton.next_power_of_2(max(span, 1)), 1 << 20)


def _autotune_configs(kind: str):
    tiles = (1024, 2048, 4096, 8192) if kind == "grad" else (1024, 2048, 4096)
    per_thread = _GRAD_THREAD_COLUMNS if kind == "grad" else _STATS_THREAD_COLUMNS
    configs = []
    for tile in tiles:
        for warps in sorted({_warps(tile, per_thread), max(1, _warps(tile, per_thread) // 2)}):
            configs.append(triton.Config({"TILE": tile}, num_warps=warps))
    return configs


def _prune(configs, named_args, **kwargs):
    """Configurations whose tile fits the part (the smallest one always stays)."""
    span = named_args["span_class"]
    fit = [c for c in configs if c.kwargs["TILE"] <= span]
    return fit or [min(configs, key=lambda c: c.kwargs["TILE"])]


#: Whether launches pick their tile and warps with ``triton.autotune`` (compiled kernels on a GPU: once per
#: shape class, the part's width class, and per dtype and variant; the benchmark synchronizes the host those
#: few times) or from :func:`_stats_config` / :func:`_grad_config` (the interpreter, which cannot time a
#: kernel, or ``CHUNKED_ENTROPY_TRITON_AUTOTUNE=0``: the same configuration in every process, so the same
#: bits run to run). Either way the sums are the float32 reassociation of the eager kernels'.
AUTOTUNE = not INTERPRETED and os.environ.get("CHUNKED_ENTROPY_TRITON_AUTOTUNE", "1") != "0"
_tuned = {}
#: The autotuner's timer (None: Triton's own, which needs a GPU); tests time the interpreter's runs instead.
_BENCH = None


def _launcher(kernel, kind: str):
    """``kernel`` as autotuned (:data:`AUTOTUNE`), built once; each restores its outputs between the timed runs
    (the gradient may overwrite its own input; the statistics may merge into theirs)."""
    if kind not in _tuned:
        variant = (["HAS_CAP", "HAS_K", "WANT_W", "WANT_Q", "MERGE"] if kind == "stats"
                   else ["HAS_CAP", "HAS_K", "HAS_C", "HAS_B", "HAS_A"])
        kw = dict(configs=_autotune_configs(kind), key=["span_class", *variant],  # and the tensors' dtypes
                  prune_configs_by={"early_config_prune": _prune})
        if kind == "grad":
            kw["restore_value"] = ["out_ptr"]
        else:  # a merging launch reads its outputs: each timed run starts from the running statistics
            kw["restore_value"] = ["m_ptr", "ones_ptr", "rest_ptr", "w_ptr", "q_ptr", "zl_ptr"]
        if _BENCH is not None:
            kw["do_bench"] = _BENCH
        _tuned[kind] = triton.autotune(**kw)(kernel)
    return _tuned[kind]


def _launch(kernel, kind: str, grid, args: tuple, consts: dict, config: tuple):
    if AUTOTUNE:
        _launcher(kernel, kind)[grid](*args, **consts, enable_fp_fusion=True)
    else:
        tile, warps = config
        kernel[grid](*args, **consts, TILE=tile, num_warps=warps, enable_fp_fusion=True)


def _per_row(t, n: int, dtype, device):
    """A per-row factor (None: 1, a float, an ``[n]`` or ``[n, 1]`` tensor) as ``(tensor, row stride)``:
    None is no tensor at all (the kernels' ``HAS_K`` off: no launch); a float a one-element tensor read with
    stride 0 (a fill on the device, no host copy; the chunk loop passes its walk's own, filled once:
    :func:`chunked_entropy._kernels.kernel_k`)."""
    if t is None:
        return None, 0
    if isinstance(t, torch.Tensor):
        t = t.reshape(n) if t.dim() > 1 else t
        return t, t.stride(0)
    return torch.full((1,), float(t), dtype=dtype, device=device), 0


def _cap(tf: _stats.Transform, dtype, device, cap=None):
    """``logit_scale / softcap`` as a one-element tensor (None without a cap): ``cap`` where the caller holds it
    (the chunk loop fills it once a walk: :func:`chunked_entropy._kernels.kernel_cap`), else filled here."""
    if tf.softcap is None:
        return None
    if cap is not None:
        return cap.reshape(1)
    return torch.full((1,), (tf.logit_scale or 1.0) / tf.softcap, dtype=dtype, device=device)


def _vec(t):
    """A per-row ``[n]`` input, contiguous (an expanded upstream gradient has stride 0)."""
    return t.detach().contiguous()


def stats(z, tf: _stats.Transform, k, target, v0: int, want_w: bool, want_q: bool, dtype, out=None,
          merge: bool = False, cap=None) -> _stats.BlockStats:
    """:func:`chunked_entropy._stats.stats_of_block` of the raw ``[n, width]`` block ``z`` (read only), with
    ``w`` and ``q`` None unless wanted, written into ``out`` (a ``[6, n]`` tensor of the compute dtype: rows
    ``m, ones, rest, w, q, zl``, each row contiguous; a column slice of the walk's running statistics) or,
    None, into six ``[n]`` vectors allocated here. ``merge``: ``out`` holds the running statistics of the
    rows' previous vocabulary blocks, and each program merges its block's into them
    (:func:`chunked_entropy._stats.merge_stats`, op for op, inside the kernel: no launch of its own) before it
    writes the result over them. ``cap``: the soft-cap's one-element factor, filled by the caller once (else
    here); ``k`` None: no multiplier, no tensor. Where a row is split across programs (few long rows:
    :func:`_parts`), also ``6 * parts`` floats a row of partial statistics, merged (and merged into ``out``)
    by a second launch."""
    n, width = z.shape
    if out is None:
        out = torch.empty((6, n), dtype=dtype, device=z.device)
    m, ones, rest, w, q, zl = out.unbind(0)
    if not n:
        return _stats.BlockStats(m, ones, rest, w if want_w else None, q if want_q else None, zl)
    z = z.detach()
    kt, sk = _per_row(k, n, dtype, z.device)
    cap = _cap(tf, dtype, z.device, cap)
    target = _vec(target)
    kp = target if kt is None else kt  # an absent input's pointer (HAS_K, HAS_CAP off): never read
    config = _stats_config(width, z.element_size())
    parts = _parts(n, width, config[0], z.device)
    span = -(-width // parts)
    if parts > 1:
        config = _stats_config(span, z.element_size())
    part = torch.empty((6, parts * n), dtype=dtype, device=z.device) if parts > 1 else None
    dst = (m, ones, rest, w, q, zl) if part is None else part.unbind(0)
    flags = dict(HAS_K=kt is not None, WANT_W=bool(want_w), WANT_Q=bool(want_q), COMPUTE=_COMPUTE[dtype],
                 NEG_FLOOR=_NEG_FLOOR)
    _launch(_stats_kernel, "stats", (n, parts),
            (z, z.stride(0), z.stride(1), width, span, kp if cap is None else cap, kp, sk, target, v0,
             *dst, n, _span_class(span)),
            dict(HAS_CAP=cap is not None, MERGE=bool(merge) and part is None, **flags), config)
    if part is not None:
        _merge_parts_kernel[(n,)](*part.unbind(0), parts, n, kp, sk, m, ones, rest, w, q, zl,
                                  MERGE=bool(merge), PARTS=triton.next_power_of_2(parts), num_warps=1, **flags)
    return _stats.BlockStats(m, ones, rest, w if want_w else None, q if want_q else None, zl)


def grad(z, out, tf: _stats.Transform, k, row: _stats.RowStats, target, v0: int, co: _stats.Coefficients, dtype,
         cap=None):
    """:func:`chunked_entropy._stats.grad_of_block` of the raw ``[n, width]`` block ``z`` (read only) written
    into ``out`` (``[n, width]``, any float dtype, any strides; it may be ``z`` itself) and returned.
    ``row`` holds the rows' statistics (``ws`` needed with ``co.b``, ``s2`` with ``co.a``); an absent
    coefficient costs nothing. Few long rows are split across programs as the statistics' are (no second
    stage: each column's gradient is its own). ``cap`` and ``k`` as :func:`stats` takes them. Allocates nothing
    beyond a contiguous copy of a strided per-row input."""
    n, width = z.shape
    if not n:
        return out
    kt, sk = _per_row(k, n, dtype, z.device)
    cap = _cap(tf, dtype, z.device, cap)
    c, b, a = co
    dummy = row.ls  # pointer arguments of absent terms (never read)
    vec = lambda t: dummy if t is None else _vec(t)  # noqa: E731
    config = _grad_config(width, z.element_size())
    parts = _parts(n, width, config[0], z.device)
    span = -(-width // parts)
    if parts > 1:
        config = _grad_config(span, z.element_size())
    _launch(_grad_kernel, "grad", (n, parts),
            (z.detach(), z.stride(0), z.stride(1), out, out.stride(0), out.stride(1), width, span,
             dummy if cap is None else cap, dummy if kt is None else kt, sk,
             _vec(row.m), _vec(row.ls), vec(row.ws if b is not None else None),
             vec(row.s2 if a is not None else None), _vec(target), v0, vec(c), vec(b), vec(a), _span_class(span)),
            dict(HAS_CAP=cap is not None, HAS_K=kt is not None, HAS_C=c is not None, HAS_B=b is not None,
                 HAS_A=a is not None, OUT_BF16=out.dtype == torch.bfloat16 and dtype == torch.float32,
                 COMPUTE=_COMPUTE[dtype], NEG_FLOOR=_NEG_FLOOR),
            config)
    return out
