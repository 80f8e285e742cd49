"""The math, once: per-block statistics, their merge, and per-block gradients.

Every path of the library (given logits, the fused head, with or without a
sharded vocabulary, with or without vocabulary blocks) reduces a row of
temperature-scaled logits ``x = z / t`` to four numbers and rebuilds the
row's gradient from them:

=========  ==========================================  =======================
symbol     definition                                   used for
=========  ==========================================  =======================
``m``      ``max_j x_j``                                stability shift
``s``      ``sum_j exp(x_j - m)``                       ``lse = m + log s``
``w``      ``sum_j exp(x_j - m) * (x_j - m)``           ``mu = m + w / s``
``zl``     ``x_y`` (the label's scaled logit)           ``log p_y = zl - lse``
=========  ==========================================  =======================

``mu = sum_j p_j x_j`` is the softmax-weighted mean logit, and the outputs are

    log_prob = x_y - lse            entropy = lse - mu = log s - w / s

Blocks of a row (vocabulary blocks, tensor-parallel shards) each produce
``(m, s, w, zl)`` relative to their own maximum; :func:`merge_stats` combines
two blocks exactly (an online softmax), and :mod:`chunked_entropy.parallel`
combines the shards with one MAX and one SUM all-reduce.

Gradients, with upstream ``g_lp`` (log-prob) and ``g_h`` (entropy) per row and
``p = exp(x - lse)``:

    d log_prob / dx_j = [j == y] - p_j
    d entropy  / dx_j = p_j * (mu - x_j)

so, with respect to the raw logits ``z = t * x``,

    dL/dz_j = p_j * (b * (mu - x_j) - c) + c * [j == y],   b = g_h / t,  c = g_lp / t.

Padded vocabulary entries (``-inf``) are clamped to :data:`NEG_FLOOR` in our
own buffer, so ``p_j = 0`` there and ``0 * inf`` never arises; any logit below
the floor has probability exactly 0 in float32/float64 anyway.

All functions here work in place on a buffer the caller owns (never on user
tensors) and allocate only per-row vectors, except where noted.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

#: Logits are clamped from below to this value: finite, so that ``0 * x`` is 0,
#: and far enough below any real logit that ``exp(x - max)`` is exactly 0.
NEG_FLOOR = -1e30

Scale = Union[None, float, torch.Tensor]  # 1/t: None (t == 1), a float, or a [n, 1] column


class BlockStats(NamedTuple):
    """Per-row statistics of one block of a row, relative to the block's max ``m``.

    ``w`` is None when entropy is not computed. ``zl`` is the label's scaled
    logit where the label lies in this block, else 0.
    """

    m: torch.Tensor
    s: torch.Tensor
    w: Optional[torch.Tensor]
    zl: torch.Tensor


def scale_(x: torch.Tensor, inv_t: Scale) -> torch.Tensor:
    """``x <- max(x / t, NEG_FLOOR)`` in place."""
    if inv_t is not None:
        x.mul_(inv_t)
    return x.clamp_(min=NEG_FLOOR)


def _label_in_block(target: torch.Tensor, v0: int, width: int):
    """Column of each row's label inside ``[v0, v0 + width)`` and whether it is there."""
    local = target - v0
    inside = (local >= 0) & (local < width)
    return local.clamp_(0, width - 1).unsqueeze(1), inside


def block_stats(
    x: torch.Tensor,
    inv_t: Scale,
    target: torch.Tensor,
    v0: int,
    scratch: Optional[torch.Tensor],
) -> BlockStats:
    """Statistics of one [n, Vb] block of raw logits; ``x`` is consumed.

    Args:
        x: [n, Vb] raw logits in a buffer owned by the caller (overwritten).
        inv_t: 1 / temperature: None, a float, or a [n, 1] column.
        target: [n] int64 label column in this shard's coordinates, or -1
            (masked, or on another shard).
        v0: the block's first column in this shard.
        scratch: a buffer like ``x`` for ``exp``; None skips the entropy
            statistic ``w`` (log-probs only, one buffer).
    """
    scale_(x, inv_t)
    col, inside = _label_in_block(target, v0, x.shape[1])
    zl = torch.where(inside, x.gather(1, col).squeeze(1), 0.0)
    m = x.amax(dim=1)
    x.sub_(m.unsqueeze(1))  # x - m <= 0
    if scratch is None:
        return BlockStats(m, x.exp_().sum(dim=1), None, zl)
    e = torch.exp(x, out=scratch)
    s = e.sum(dim=1)
    w = x.mul_(e).sum(dim=1)
    return BlockStats(m, s, w, zl)


def rescale(st: BlockStats, m_new: torch.Tensor) -> BlockStats:
    """Express block statistics relative to a larger maximum ``m_new`` (exact)."""
    d = st.m - m_new  # <= 0, finite
    a = torch.exp(d)
    s = st.s * a
    w = None if st.w is None else st.w * a + s * d
    return BlockStats(m_new, s, w, st.zl)


def merge_stats(a: Optional[BlockStats], b: BlockStats) -> BlockStats:
    """Combine the statistics of two disjoint blocks of the same rows."""
    if a is None:
        return b
    m = torch.maximum(a.m, b.m)
    a, b = rescale(a, m), rescale(b, m)
    w = None if a.w is None else a.w + b.w
    return BlockStats(m, a.s + b.s, w, a.zl + b.zl)


class RowStats(NamedTuple):
    """What a row needs for outputs and backward: ``lse``, ``mu`` (or None), ``zl``."""

    lse: torch.Tensor
    mu: Optional[torch.Tensor]
    zl: torch.Tensor

    @staticmethod
    def from_block(st: BlockStats) -> "RowStats":
        lse = st.m + torch.log(st.s)
        mu = None if st.w is None else st.m + st.w / st.s
        return RowStats(lse, mu, st.zl)


def block_grad(
    x: torch.Tensor,
    inv_t: Scale,
    lse: torch.Tensor,
    mu: Optional[torch.Tensor],
    target: torch.Tensor,
    v0: int,
    c: Optional[torch.Tensor],
    b: Optional[torch.Tensor],
    scratch: Optional[torch.Tensor],
) -> torch.Tensor:
    """Gradient of ``sum(g_lp * log_prob + g_h * entropy)`` w.r.t. a block's raw logits.

    Overwrites ``x`` (raw logits of the block, caller-owned) with the
    gradient and returns it. ``c = g_lp / t`` and ``b = g_h / t`` are [n]
    (None skips that term: no work for an output without a gradient);
    ``scratch`` (like ``x``) is needed only when ``b`` is given.
    """
    scale_(x, inv_t)
    if b is None:
        # dL/dz = -c * p + c * onehot
        torch.sub(x, lse.unsqueeze(1), out=x).exp_().mul_(-c.unsqueeze(1))
    else:
        p = torch.sub(x, lse.unsqueeze(1), out=scratch).exp_()
        # p * (mu - x) first: it is 0 where p is 0, so no overflow meets a 0
        torch.sub(mu.unsqueeze(1), x, out=x).mul_(p).mul_(b.unsqueeze(1))
        if c is not None:
            x.addcmul_(p, c.unsqueeze(1), value=-1.0)
    if c is not None:
        col, inside = _label_in_block(target, v0, x.shape[1])
        x.scatter_add_(1, col, torch.where(inside, c, 0.0).unsqueeze(1))
    return x
