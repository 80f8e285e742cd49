"""The math, once: logit transforms, per-block statistics, their merge, per-block gradients.

Every path of the library (given logits, the fused head, with or without a
sharded vocabulary, with or without vocabulary blocks) reduces a row of
logits ``z`` to a few numbers and rebuilds the row's gradient from them.

**The logits the softmax is taken over** are

    x = softcap * tanh(logit_scale * z / softcap) / t      (with softcap)
    x = logit_scale * z / t                                (without)

Both are ``x = k * u`` for ``u = tanh(logit_scale * z / softcap)`` (or
``u = z``) and a per-row multiplier ``k = softcap / t`` (or ``logit_scale / t``);
``u`` is increasing in ``z``. See :class:`Transform`.

**Offsets, never absolute values.** Results are computed from the offsets
``y = k * (u - m) <= 0`` to the row maximum ``m = max_j u_j``, so their
accuracy follows the answer, not the size of the largest logit:

=========  ===============================================  =======================
symbol     definition                                       used for
=========  ===============================================  =======================
``m``      ``max_j u_j`` (in ``u`` units, not scaled)       the shift; merged by MAX
``ones``   ``e_j`` summed over the entries with ``e_j == 1``  ``s = ones + rest``
``rest``   ``sum_j e_j`` over every other entry              ``log s = log1p(s - 1)``
``w``      ``sum_j e_j * y_j`` (``<= 0``)                   ``w / s = mu - max x``
``q``      ``sum_j e_j ** 2``                               ``sum_pi_squared = q / s**2``
``zl``     ``u_y`` (the label's ``u``; 0 off this block)    ``y_label = k * (zl - m)``
=========  ===============================================  =======================

with ``e_j = exp(y_j)``. The row maximum contributes exactly 1 to ``s``;
keeping it apart (``ones``) lets ``s - 1`` be formed without cancellation, so

    log_prob = y_label - log1p(rest + ones - 1)
    entropy  = log1p(rest + ones - 1) - w / s        (two terms >= 0: no cancellation)
    sum_pi_squared = q / s**2

are accurate to float32 rounding *of themselves*, also for confident rows
(entropy 1e-6) and at any logit offset or small temperature.

Blocks of a row (vocabulary blocks, tensor-parallel shards) each produce
statistics relative to their own maximum; :func:`rescale` re-expresses them
relative to a larger one and :func:`merge_stats` adds two blocks exactly (an
online softmax); :mod:`chunked_entropy.parallel` merges the shards with one MAX
and one SUM all-reduce.

**Gradients**, with upstream ``g_lp``, ``g_h``, ``g_q`` per row (log-prob,
entropy, sum_pi_squared) and ``p = exp(y - log s)``:

    d log_prob / dx_j = [j == y] - p_j
    d entropy  / dx_j = p_j * (w / s - y_j)              (= p_j * (mu - x_j))
    d sum p^2  / dx_j = 2 p_j * (p_j - sum_pi_squared)

and ``dx_j / dz_j = kz * (1 - u_j**2)`` with softcap (``kz * 1`` without),
``kz = logit_scale / t``, so with ``c = g_lp * kz``, ``b = g_h * kz``,
``a = 2 * g_q * kz``:

    dL/dz_j = (p_j * (b * (w/s - y_j) - c + a * (p_j - sum_pi_squared)) + c * [j == y]) * (1 - u_j**2)

**Infinities** follow ``torch.log_softmax``: ``-inf`` entries (padded
vocabulary) have probability 0 and pass no gradient; a label on one has
log-prob ``-inf``; a row with no finite entry gives NaN. Offsets below
:data:`NEG_FLOOR` are clamped to it in our own buffer (``exp`` of either is
exactly 0), so that ``0 * y`` is 0 rather than NaN.

All functions work in place on buffers the caller owns (never on user
tensors) and allocate only per-row vectors, except where noted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from ._checks import check_positive

#: What an entropy is taken over: the full distribution, or sampling replay's kept set (``entropy_of``).
ENTROPY_OF = ("full", "kept")

#: Offsets are clamped from below to this value: finite, so that ``0 * y`` is 0,
#: and so far below 0 that ``exp(y)`` is exactly 0 in float32 and float64.
NEG_FLOOR = -1e30

Scale = Union[None, float, torch.Tensor]  # a per-row factor: None (1), a float, or a [n, 1] column


def _times(f: Scale, c: float) -> Scale:
    """``f * c`` for a per-row factor (None stands for 1)."""
    if c == 1:
        return f
    return c if f is None else f * c


@dataclass(frozen=True)
class Transform:
    """The model's logit transform: ``x = softcap * tanh(logit_scale * z / softcap) / t``.

    ``softcap`` (Gemma 2/3's ``final_logit_softcapping``) and ``logit_scale``
    (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``) are each
    optional; the temperature ``t`` is applied last, after the cap, as
    samplers do. Both are floats > 0 or None.
    """

    softcap: Optional[float] = None
    logit_scale: Optional[float] = None

    def __post_init__(self):
        object.__setattr__(self, "softcap", check_positive("softcap", self.softcap))
        object.__setattr__(self, "logit_scale", check_positive("logit_scale", self.logit_scale))

    def to_u_(self, z: torch.Tensor) -> torch.Tensor:
        """``z <- u`` in place: ``tanh(logit_scale * z / softcap)``, or ``z`` itself without softcap."""
        if self.softcap is not None:
            z.mul_((self.logit_scale or 1.0) / self.softcap).tanh_()
        return z

    def k(self, inv_t: Scale) -> Scale:
        """``x = k * u``: ``softcap / t`` or ``logit_scale / t``."""
        return _times(inv_t, self.softcap if self.softcap is not None else (self.logit_scale or 1.0))

    def kz(self, inv_t: Scale) -> Scale:
        """``dx/dz`` up to the ``1 - u**2`` of the cap: ``logit_scale / t``."""
        return _times(inv_t, self.logit_scale or 1.0)


class Want(NamedTuple):
    """Which outputs beyond the log-probs a call computes (each costs work and memory)."""

    entropy: bool = True
    sum_pi_squared: bool = False

    @property
    def scratch(self) -> bool:
        """Whether forward needs the ``exp`` scratch buffer."""
        return self.entropy or self.sum_pi_squared


class BlockStats(NamedTuple):
    """Per-row statistics of one block of a row, relative to the block's max ``m`` (see the module doc).

    ``w`` and ``q`` are None when not asked for.
    """

    m: torch.Tensor
    ones: torch.Tensor
    rest: torch.Tensor
    w: Optional[torch.Tensor]
    q: Optional[torch.Tensor]
    zl: torch.Tensor


def _label_in_block(target: torch.Tensor, v0: int, width: int):
    """Column of each row's label inside ``[v0, v0 + width)`` and whether it is there."""
    local = target - v0
    inside = (local >= 0) & (local < width)
    return local.clamp_(0, width - 1).unsqueeze(1), inside


def _flat(f: Scale) -> Scale:
    """A per-row factor as an ``[n]`` vector (or the float / None it is)."""
    return f.squeeze(1) if isinstance(f, torch.Tensor) else f


def offsets_(u: torch.Tensor, m: torch.Tensor, k: Scale, src: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``u <- max(k * (u - m), NEG_FLOOR)`` in place (``m`` of -inf shifts by 0: the row stays -inf).

    ``src``: the raw block itself (read only, any float dtype), ``u`` then only the buffer written: ``u <-
    max(k * (src - m), NEG_FLOOR)``, the difference formed in ``u``'s dtype (exactly what copying ``src`` into
    ``u`` first gives, one pass over the block fewer)."""
    shift = torch.where(m == -math.inf, 0.0, m).unsqueeze(1)
    if src is None:
        u.sub_(shift)
    else:
        torch.sub(src, shift, out=u)  # a [n, 1] column of u's dtype: the difference is formed in u's dtype
    if k is not None:
        u.mul_(k)
    return u.clamp_(min=NEG_FLOOR)


def block_stats(
    x: torch.Tensor,
    tf: Transform,
    k: Scale,
    target: torch.Tensor,
    v0: int,
    scratch: Optional[torch.Tensor],
    *,
    want_w: bool,
    want_q: bool,
    aux: Optional[torch.Tensor] = None,
    src: Optional[torch.Tensor] = None,
) -> BlockStats:
    """Statistics of one ``[n, Vb]`` block of raw logits.

    Args:
        x: ``[n, Vb]`` raw logits in a buffer owned by the caller. With a
            ``scratch`` buffer and without ``want_q`` it is left holding the
            offsets ``y`` (the fused loss turns them into the gradient
            without recomputing them); otherwise it is consumed.
        tf: the logit transform; ``k`` its per-row multiplier (``tf.k(1/t)``).
        target: ``[n]`` int64 label column in this shard's coordinates, or -1
            (masked, or on another shard).
        v0: the block's first column in this shard.
        scratch: a buffer like ``x`` for ``exp``; needed for ``w`` or ``q``
            (None: log-probs only, one buffer).
        want_w, want_q: compute ``w`` (entropy) and ``q`` (sum_pi_squared).
        aux: with a softcap, a buffer like ``x`` to receive the cap's
            derivative ``1 - u**2`` (for a gradient formed from these offsets).
        src: the raw logits themselves (the caller's rows, read only, any
            float dtype; no softcap), ``x`` then only the buffer they are read
            into: the maximum is taken over ``src`` and the offsets are formed
            from it straight into ``x`` (the results are those of ``x`` filled
            with ``src`` first, one pass over the block fewer).
    """
    if src is None:
        tf.to_u_(x)
        if aux is not None and tf.softcap is not None:
            torch.mul(x, x, out=aux).neg_().add_(1.0)
    elif tf.softcap is not None:
        raise AssertionError("block_stats reads src only without a softcap")
    z = x if src is None else src
    col, inside = _label_in_block(target, v0, z.shape[1])
    zl = torch.where(inside, z.gather(1, col).squeeze(1).to(x.dtype), 0.0)
    m, arg = z.max(dim=1)
    m = m.to(x.dtype)  # src's dtype: exact in x's
    y = offsets_(x, m, k, src)
    if scratch is None:
        e = y.exp_()
        ones = e.gather(1, arg.unsqueeze(1))
        rest = e.scatter_(1, arg.unsqueeze(1), 0.0).sum(dim=1)
        return BlockStats(m, ones.squeeze(1), rest, None, None, zl)
    e = torch.exp(y, out=scratch)
    ones = e.gather(1, arg.unsqueeze(1))  # 1, or 0 for a row of -inf
    rest = e.scatter_(1, arg.unsqueeze(1), 0.0).sum(dim=1)  # y == 0 there: w is unaffected
    w = None
    if want_w:
        # w = sum_j e_j y_j as a product, then torch's (pairwise) sum: a dot product (bmm) accumulates
        # 150k terms with 50x the error on CPU. The product goes into e unless q still needs e; then
        # into y (the fused loss, which keeps y for its gradient, never asks for q).
        w = torch.mul(e, y, out=y if want_q else e).sum(dim=1)
    q = e.scatter_(1, arg.unsqueeze(1), ones).square_().sum(dim=1) if want_q else None
    return BlockStats(m, ones.squeeze(1), rest, w, q, zl)


def _shift(m_from: torch.Tensor, m_to: torch.Tensor, k: Scale) -> torch.Tensor:
    """``k * (m_from - m_to)`` clamped at :data:`NEG_FLOOR`: how far a block's offsets move to a larger maximum."""
    # <= 0. A block with no finite entry (m_from = -inf: padding, or no kept id of the row in it) moves by
    # -inf: it adds nothing, also next to another such block (m_from - m_to would be NaN there)
    d = torch.where(m_from == -math.inf, -math.inf, m_from - m_to)
    if k is not None:
        d = d * _flat(k)
    return d.clamp(min=NEG_FLOOR)


def shift_offsets_(y: torch.Tensor, m_from: torch.Tensor, m_to: torch.Tensor, k: Scale) -> torch.Tensor:
    """Offsets to ``m_from`` made offsets to the larger ``m_to``, in place."""
    return y.add_(_shift(m_from, m_to, k).unsqueeze(1)).clamp_(min=NEG_FLOOR)


def rescale(st: BlockStats, m_new: torch.Tensor, k: Scale) -> BlockStats:
    """Express block statistics relative to a larger maximum ``m_new`` (exact).

    A block whose factor ``exp(d)`` is exactly 1 keeps ``ones`` apart; any
    other block moves all of its sum into ``rest``.
    """
    d = _shift(st.m, m_new, k)
    a = torch.exp(d)
    keep = a == 1
    s = st.ones + st.rest
    ones = torch.where(keep, st.ones, 0.0)
    rest = torch.where(keep, st.rest, s * a)
    w = None if st.w is None else st.w * a + s * a * d
    q = None if st.q is None else st.q * (a * a)
    return BlockStats(m_new, ones, rest, w, q, st.zl)


def rescale_cross(c: torch.Tensor, st_a: BlockStats, st_b: BlockStats, m_a: torch.Tensor, m_b: torch.Tensor,
                  k_a: Scale, k_b: Scale) -> torch.Tensor:
    """Two heads' cross sum ``c = sum_j exp(y_a,j) (y_a,j - y_b,j)`` of the same rows and columns (offsets to
    ``st_a.m``, ``st_b.m``) expressed relative to the larger maxima ``m_a``, ``m_b``: ``exp(d_a) (c + (d_a -
    d_b) s_a)`` with the offsets' shifts ``d`` (as :func:`rescale` moves ``w``) and head ``a``'s sum ``s_a``.
    A KL's value folds over vocabulary blocks and shards through it (:mod:`chunked_entropy._divergence`)."""
    d_a, d_b = _shift(st_a.m, m_a, k_a), _shift(st_b.m, m_b, k_b)
    return torch.exp(d_a) * (c + (d_a - d_b) * (st_a.ones + st_a.rest))


def merge_stats(a: Optional[BlockStats], b: BlockStats, k: Scale) -> BlockStats:
    """Combine the statistics of two disjoint blocks of the same rows."""
    if a is None:
        return b
    m = torch.maximum(a.m, b.m)
    a, b = rescale(a, m, k), rescale(b, m, k)
    add = lambda u, v: None if u is None else u + v  # noqa: E731
    return BlockStats(m, a.ones + b.ones, a.rest + b.rest, add(a.w, b.w), add(a.q, b.q), a.zl + b.zl)


class RowStats(NamedTuple):
    """What a row needs for its outputs and backward.

    ``m`` the row max of ``u``; ``ls = log s``; ``ws = w / s`` (None without
    entropy); ``s2`` the sum of squared probabilities (None unless asked);
    ``yl`` the label's offset ``k * (u_y - m)``.
    """

    m: torch.Tensor
    ls: torch.Tensor
    ws: Optional[torch.Tensor]
    s2: Optional[torch.Tensor]
    yl: torch.Tensor
    #: Sampling replay: the same statistics over each row's kept set, relative to the kept set's own
    #: maximum, and which rows are truncated to it (the others use the whole row). None without one.
    kept: Optional["RowStats"] = None
    truncated: Optional[torch.Tensor] = None

    @staticmethod
    def from_block(st: BlockStats, k: Scale) -> "RowStats":
        s_minus_1 = st.rest + (st.ones - 1)  # ones - 1 is an exact integer
        ls = torch.log1p(s_minus_1)
        s = st.ones + st.rest
        ws = None if st.w is None else st.w / s
        s2 = None if st.q is None else st.q / (s * s)
        yl = st.zl - st.m
        if k is not None:
            yl = yl * _flat(k)
        return RowStats(st.m, ls, ws, s2, yl)

    def with_kept(self, kept: "RowStats", truncated: torch.Tensor) -> "RowStats":
        return self._replace(kept=kept, truncated=truncated)

    def saved(self) -> tuple:
        """What backward needs, for ``save_for_backward`` (the label offsets are not: c carries the label)."""
        k = self.kept
        tail = (None,) * 5 if k is None else (k.m, k.ls, k.ws, k.s2, self.truncated)
        return (self.m, self.ls, self.ws, self.s2) + tail

    @staticmethod
    def from_saved(t) -> "RowStats":
        m, ls, ws, s2, km, kls, kws, ks2, truncated = t
        r = RowStats(m, ls, ws, s2, None)
        return r if km is None else r.with_kept(RowStats(km, kls, kws, ks2, None), truncated)

    def rows(self, a: int, b: int) -> "RowStats":
        """The statistics of rows ``[a, b)``."""
        cut = lambda t: None if t is None else t[a:b]  # noqa: E731
        kept = None if self.kept is None else self.kept.rows(a, b)
        return RowStats(*(cut(t) for t in self[:5]), kept, cut(self.truncated))

    def _of(self, full: torch.Tensor, kept: Optional[torch.Tensor]) -> torch.Tensor:
        return full if kept is None else torch.where(self.truncated, kept, full)

    def log_probs(self) -> torch.Tensor:
        """``y_label - log s``: over the kept set where the row is truncated to it."""
        return self._of(self.yl - self.ls, None if self.kept is None else self.kept.yl - self.kept.ls)

    def entropy(self, of_kept: bool = False) -> torch.Tensor:
        """``log s - w / s``: of the whole row, or (``of_kept``) of the kept set where there is one."""
        kept = self.kept if of_kept else None
        return self._of(self.ls - self.ws, None if kept is None else kept.ls - kept.ws)

    def sum_pi_squared(self, of_kept: bool = False) -> torch.Tensor:
        kept = self.kept if of_kept else None
        return self._of(self.s2, None if kept is None else kept.s2)


class Coefficients(NamedTuple):
    """Per-row factors of the gradient (``[n]``; None: that output has no gradient, no work)."""

    c: Optional[torch.Tensor]  # g_lp * kz, 0 where the label is masked
    b: Optional[torch.Tensor]  # g_h * kz
    a: Optional[torch.Tensor]  # 2 * g_q * kz


def block_grad(
    x: torch.Tensor,
    tf: Transform,
    k: Scale,
    row: RowStats,
    target: torch.Tensor,
    v0: int,
    co: Coefficients,
    scratch: Optional[torch.Tensor],
    aux: Optional[torch.Tensor],
    src: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradient of ``sum(g_lp * log_prob + g_h * entropy + g_q * sum_pi_squared)`` w.r.t. a block's raw logits.

    Overwrites ``x`` (raw logits of the block, caller-owned) with the
    gradient and returns it. ``row`` holds the rows' statistics; ``scratch``
    (like ``x``) is needed when ``co.b`` or ``co.a`` is given, ``aux`` (like
    ``x``) when ``tf.softcap`` is set. ``src``: as in :func:`block_stats`
    (the raw logits read from the caller's rows, ``x`` only written).
    """
    if src is not None:
        if tf.softcap is not None:
            raise AssertionError("block_grad reads src only without a softcap")
        return grad_from_offsets_(offsets_(x, row.m, k, src), tf, row, target, v0, co, scratch, aux)
    tf.to_u_(x)
    if tf.softcap is not None:  # 1 - u**2, the cap's derivative
        torch.mul(x, x, out=aux).neg_().add_(1.0)
    return grad_from_offsets_(offsets_(x, row.m, k), tf, row, target, v0, co, scratch, aux)


def grad_from_offsets_(
    y: torch.Tensor,
    tf: Transform,
    row: RowStats,
    target: torch.Tensor,
    v0: int,
    co: Coefficients,
    scratch: Optional[torch.Tensor],
    aux: Optional[torch.Tensor],
) -> torch.Tensor:
    """:func:`block_grad` from the offsets ``y`` to the row maximum ``row.m`` (overwritten with the gradient).

    ``aux`` holds the cap's derivative ``1 - u**2`` when ``tf.softcap`` is set.
    """
    c = None if co.c is None else co.c.unsqueeze(1)
    if co.b is None and co.a is None:
        # dL/dy = -c * p (+ c at the label)
        torch.sub(y, row.ls.unsqueeze(1), out=y).exp_().mul_(-c)
    else:
        p = torch.sub(y, row.ls.unsqueeze(1), out=scratch).exp_()
        const = 0.0 if c is None else -c
        if co.b is not None:  # b * (w/s - y): 0 * finite where p == 0
            # finite: at a floored offset (-1e30: a -inf logit) b * 1e30 overflows for |b| > 3.4e8 (a temperature
            # of 1e-8), and 0 * inf would be NaN; clamped, p == 0 makes it 0 as it is in exact arithmetic
            big = torch.finfo(y.dtype).max
            torch.sub(row.ws.unsqueeze(1), y, out=y).mul_(co.b.unsqueeze(1)).clamp_(-big, big)
        else:
            y.zero_()
        if co.a is not None:
            const = const - (co.a * row.s2).unsqueeze(1)
            y.addcmul_(p, co.a.unsqueeze(1))
        if not isinstance(const, float):
            y.add_(const)
        y.mul_(p)
    if c is not None:
        col, inside = _label_in_block(target, v0, y.shape[1])
        y.scatter_add_(1, col, torch.where(inside, co.c, 0.0).unsqueeze(1))
    if tf.softcap is not None:
        y.mul_(aux)
    return y


# ----------------------------------------------------------------------------- the compiled backend's form
#
# The same statistics and gradient, written without writing to any input and
# without scatter/gather, so that torch.compile fuses each into one pass over
# the block: it reads the raw logits (any dtype) and writes only per-row
# vectors, or the gradient block into ``out``. The row maximum's exact 1 is
# kept apart as above, counted as the entries with offset 0 (ties included:
# ``ones + rest`` is the same sum either way). ``k`` is always an ``[n, 1]``
# column here (a float would be a compile-time constant: one compilation per
# temperature).


def transformed(z: torch.Tensor, cap_factor, dtype) -> torch.Tensor:
    """``u``: ``tanh(z * logit_scale / softcap)`` with ``cap_factor`` (a 0-d tensor) that factor, else ``z``."""
    u = z.to(dtype)
    return torch.tanh(u * cap_factor) if cap_factor is not None else u


def offsets_of(u: torch.Tensor, m: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """:func:`offsets_` as a new tensor: ``max(k * (u - m), NEG_FLOOR)``, ``m`` of -inf shifting by 0."""
    shift = torch.where(m == -math.inf, 0.0, m).unsqueeze(1)
    return ((u - shift) * k).clamp(min=NEG_FLOOR)


def stats_of_block(z, cap_factor, k, target, v0: int, dtype) -> BlockStats:
    """:func:`block_stats` of the raw block ``z`` (read only), for ``torch.compile``; ``w`` and ``q`` always.

    The transform comes as tensors, not constants (a new value would be a new
    kernel): ``cap_factor = logit_scale / softcap`` (None without a cap), and
    the rest of it is in the per-row ``k`` (see :class:`Transform`).
    """
    u = transformed(z, cap_factor, dtype)
    m = u.amax(dim=1)
    y = offsets_of(u, m, k)
    e = torch.exp(y)
    top = y == 0
    col = torch.arange(u.shape[1], device=u.device).unsqueeze(0)
    zl = torch.where(col == (target - v0).unsqueeze(1), u, 0.0).sum(dim=1)
    return BlockStats(
        m, top.sum(dim=1).to(dtype), torch.where(top, 0.0, e).sum(dim=1), (e * y).sum(dim=1), (e * e).sum(dim=1), zl
    )


def grad_of_block(z, out, cap_factor, k, m, ls, ws, s2, target, v0: int, c, b, a, dtype) -> None:
    """:func:`block_grad` of the raw block ``z`` (read only) written into ``out``, for ``torch.compile``.

    Every per-row input is a tensor (zeros for an absent term): one kernel
    serves every combination of outputs with a gradient.
    """
    u = transformed(z, cap_factor, dtype)
    y = offsets_of(u, m, k)
    p = torch.exp(y - ls.unsqueeze(1))
    inner = b.unsqueeze(1) * (ws.unsqueeze(1) - y) - c.unsqueeze(1) + a.unsqueeze(1) * (p - s2.unsqueeze(1))
    col = torch.arange(u.shape[1], device=u.device).unsqueeze(0)
    # p == 0: 0, also where b * (w/s - y) overflowed at a floored offset (see grad_from_offsets_)
    g = torch.where(p == 0, 0.0, p * inner) + torch.where(col == (target - v0).unsqueeze(1), c.unsqueeze(1), 0.0)
    if cap_factor is not None:
        g = g * (1.0 - u * u)
    out.copy_(g)


def grad_of_block_(x, cap_factor, k, m, ls, ws, s2, target, v0: int, c, b, a, dtype) -> None:
    """:func:`grad_of_block` with the block overwritten by its gradient (one input: no aliased pair)."""
    grad_of_block(x, x, cap_factor, k, m, ls, ws, s2, target, v0, c, b, a, dtype)
