"""The chunk loop, shared by every op: the walks over tokens and vocabulary blocks, and the :class:`Plan` they follow.

Its users: the logits path (:mod:`chunked_entropy.logits`), the fused head
(:mod:`chunked_entropy.linear`), the fused policy loss (:mod:`chunked_entropy.policy`, from logits or
hidden states), and the divergences (:mod:`chunked_entropy.divergence`, one head or two), with sampling
replay's kept sets and distillation's ids riding along. The walks: the statistics (:func:`row_stats`, one
walk in either order of chunks and blocks, :func:`_order`), the gradient (:func:`grad_blocks`, the same
orders), the fused loss's gradient formed in forward (:func:`loss_grad_blocks`); a divergence's teacher is
their second head (``teacher=``, a :class:`TeacherHead`), walked beside the student's blocks.
The :class:`Plan` (chunk, vocabulary blocks, kernels) is sized by :func:`chunked_entropy.config.walk_plan`.

Every walk takes the tokens in chunks of ``chunk_size`` rows and the vocabulary
shard in blocks of ``block`` columns; the only difference is where a block's
raw logits come from, which the caller passes as ``fill(x, a, b, v0, v1)``:
write the logits of rows ``[a, b)`` and shard columns ``[v0, v1)`` into ``x``
(a buffer of ours). The math on each block is :mod:`chunked_entropy._stats`.

``plan.kernels`` is a kernels object of :mod:`chunked_entropy._kernels` (the
eager, the compiled or the Triton kernels); the walks ask it, never which one
it is, where a block is read (``view``, ``read``), what it computes there
(``block_stats``, ``block_grad``, ``held_grad``) and which buffers it needs
(``in_place``: the eager kernels write a block's offsets over our buffer and
need an ``exp`` scratch). The compiled and Triton kernels only read a block:
the logits path then passes ``view(a, b, v0, v1)``, its own rows, and nothing
is copied. The eager kernels read those rows too where they have the compute
dtype and there is no soft-cap (:func:`chunked_entropy._kernels._read_eager`):
their first op over a block reads the caller's rows and writes our buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from . import _divergence, _keep, _stats, _tiles, _token_ids
from ._inputs import Tokens, chunks
from ._kernels import EAGER, Kernels
from .parallel import all_reduce_sum_, group_rank_size, reduce_stats, reduce_stats_pair

Fill = Callable[[torch.Tensor, int, int, int, int], object]
View = Optional[Callable[[int, int, int, int], torch.Tensor]]


@dataclass(frozen=True)
class Plan:
    """How an op over hidden states walks the tokens and the vocabulary shard."""

    chunk_size: int
    vocab_chunk_size: int  # == V_local when the vocabulary is not blocked
    group: object
    sequence_parallel: bool
    want: _stats.Want = _stats.Want()  # the outputs beyond the log-probs
    kernels: Kernels = EAGER  # the per-block kernels; see _kernels.choose_kernels
    float32_logits: bool = False  # half-precision weights: each block's matmul in float32 (logits_dtype=float32)
    # With compiled or Triton kernels: the dtype of the block buffers the fill's matmul writes and the kernels read
    # (the weight's half precision: no widening copy); None: the compute dtype. See :func:`block_dtype`.
    block_dtype: Optional[torch.dtype] = None
    # The backward's vocabulary block where it walks blocks outermost (half-precision weights whose gradient is
    # wanted), or None: chunks outermost. Sized with the rest by chunked_entropy.config.walk_plan.
    grad_vocab_chunk_size: Optional[int] = None
    # The invariant mode (Chunking(invariant=True)): the shard's global tiles, whose statistics merge in one fixed
    # tree (chunked_entropy._tiles) in place of the blocks' running merge and the group's all-reduces. None: off.
    tiles: Optional[_tiles.Tiles] = None


def shard_tiles(chunking, v_local: int, group) -> Optional[_tiles.Tiles]:
    """The invariant mode's tiles of this rank's shard (``chunking.invariant``; :func:`chunked_entropy._tiles.tiles_for`
    refuses, by name, a shard that is not a whole number of tiles and a group whose size is not a power of two),
    or None where the mode is off."""
    if not chunking.invariant:
        return None
    rank, world = group_rank_size(group)
    return _tiles.tiles_for(chunking.tile, v_local, rank, world)


def block_dtype(plan: Plan, dtype, *, sparse: bool = False):
    """The dtype of a walk's block buffers: ``plan.block_dtype`` where its compiled kernels read the blocks
    (they widen each element as they read it, and write a gradient in its buffer's dtype, rounded once) and no
    sparse term is added to a gradient after the kernel wrote it (``sparse``: sampling replay's kept sets,
    distillation's ids; those are added in ``dtype`` before the one rounding); else ``dtype``."""
    if plan.block_dtype is None or sparse:
        return dtype
    return plan.block_dtype


class Buffers:
    """Reusable flat storage for ``[rows, cols]`` blocks: the working buffer, the ``exp``
    scratch and (backward with softcap) the cap's derivative.

    Allocated once per forward or backward (``chunk_size * block`` elements
    each) and reused for every block.
    """

    def __init__(self, rows: int, cols: int, dtype, device, *, work: bool, scratch: bool, aux: bool = False):
        # allocated in their [rows, cols] shape (an allocation log sees what each is: chunked_entropy.testing)
        new = lambda on: torch.empty(rows, cols, dtype=dtype, device=device).view(-1) if on else None  # noqa: E731
        self.bufs = (new(work), new(scratch), new(aux))

    def get(self, rows: int, cols: int):
        k = rows * cols
        return tuple(None if t is None else t[:k].view(rows, cols) for t in self.bufs)


def new_row_stats(n: int, want: _stats.Want, dtype, device, kept=None) -> _stats.RowStats:
    """Full-length :class:`~chunked_entropy._stats.RowStats` for the chunk loop to fill."""
    new = lambda on=True: torch.empty(n, dtype=dtype, device=device) if on else None  # noqa: E731
    r = _stats.RowStats(new(), new(), new(want.entropy), new(want.sum_pi_squared), new())
    if kept is None:
        return r
    of = kept.of_kept
    ks = _stats.RowStats(new(), new(), new(want.entropy and of), new(want.sum_pi_squared and of), new())
    return r.with_kept(ks, torch.empty(n, dtype=torch.bool, device=device))


def _store(out: _stats.RowStats, r: _stats.RowStats, a: int, b: int) -> None:
    for dst, src in zip(out[:5], r[:5], strict=True):
        if dst is not None:
            dst[a:b] = src
    if out.kept is not None:
        _store(out.kept, r.kept, a, b)
        out.truncated[a:b] = r.truncated


def _rows_of_chunk(st, kst, count, group, k, kept) -> tuple:
    """A chunk's statistics merged over ``group`` (kept sets included): ``(RowStats, the merged BlockStats)``."""
    st, kst, count = reduce_stats(st, group, k, kst, count)
    return _with_kept(_stats.RowStats.from_block(st, k), kst, count, k, kept), st


def _with_kept(rows: _stats.RowStats, kst, count, k, kept) -> _stats.RowStats:
    """``rows`` with the kept sets' merged statistics (``kst``, ``count``; ``rows`` itself without replay)."""
    if kst is None:
        return rows
    kr = _stats.RowStats.from_block(kst, k)  # the label's u as the kept entries' (_keep.block_stats)
    if not kept.of_kept:
        kr = kr._replace(ws=None, s2=None)
    return rows.with_kept(kr, count > 0)


def _block_at(at, at_ids, target, a, b, v0, z, tf):
    """Distillation's entries in a block and, with a soft-cap, their raw logits (read before the block is
    overwritten); Nones without distillation. Static shapes: no host sync."""
    if at_ids is None:
        return None, None
    entries = at.block_entries(at_ids[a:b], target, v0, z.shape[1])
    if tf.softcap is None:
        return entries, None
    wide = lambda t: t if t.dtype in (torch.float32, torch.float64) else t.float()  # noqa: E731
    return entries, (wide(z.gather(1, entries[0])), wide(z.gather(1, entries[2].unsqueeze(1)).squeeze(1)))


def _block_kept(kept, entries, z, v0, tf, k, dtype):
    """The kept entries of a block (gathered before the block is overwritten), or None without replay."""
    return None if kept is None else _keep.gather(z, entries, v0, tf, dtype)


def _order(n: int, chunk_size: int, width: int, block: int, vocab_outer: bool) -> Iterator[tuple]:
    """``(a, b, v0, v1)``: every chunk of rows ``[a, b)`` and vocabulary block ``[v0, v1)`` in a walk's order,
    chunks outermost (each chunk's blocks in order) or, ``vocab_outer``, blocks outermost (each block's chunks
    in order). Either way a chunk's first block has ``v0 == 0`` and its last ``v1 == width``."""
    if vocab_outer:
        for v0, v1 in chunks(width, block):
            for a, b in chunks(n, chunk_size):
                yield a, b, v0, v1
        return
    for a, b in chunks(n, chunk_size):
        for v0, v1 in chunks(width, block):
            yield a, b, v0, v1


class _ChunkStats:
    """What the statistics walk holds for one chunk of rows ``[a, b)`` while it walks its blocks: the rows'
    multipliers and labels, replay's kept entries, the invariant mode's merge tree, the statistics merged
    over the blocks so far (and the kept sets' with their counts), distillation's candidates; with a second
    head, its multipliers, statistics, a KL's cross sum and its last block."""

    __slots__ = ("k", "target", "entries", "tree", "st", "kst", "count", "cand", "kt", "stt", "cross", "xt")

    def __init__(self, tok: Tokens, a: int, b: int, chunk_size: int, tiles, teacher=None):
        self.k, self.target = tok.k_rows(a, b), tok.target[a:b]
        self.entries = None if tok.keep is None else tok.keep.chunk(a, b, tok.n, chunk_size)
        self.tree = None if tiles is None else tiles.stats_tree(self.k)
        self.st = self.kst = self.count = self.cand = None
        # a divergence's second head (:class:`_TeacherWalk`): its multiplier, statistics, a KL's cross sum, its block
        self.kt = None if teacher is None else teacher.k_t(a, b)
        self.stt = self.cross = self.xt = None


def row_stats(tok: Tokens, fill: Fill, plan: Plan, *, width: int, dtype, device, view: View = None,
              teacher: Optional["TeacherHead"] = None, into: Optional[tuple] = None):
    """Forward: the per-token statistics of every row, merged over the plan's blocks and over its group.

    With sampling replay (``tok.keep``) also those of each row's kept set. One walk over every (chunk,
    block) (:func:`_order`), in one of two orders:

    - chunks outermost: each chunk's statistics merged over its blocks (:func:`~chunked_entropy._stats.merge_stats`)
      and, at its last block, over the group (with replay's kept sets; distillation's ids and top-k read on the
      way), stored in full-length results (:func:`new_row_stats`). In the invariant mode (``plan.tiles``) each
      block's tiles' statistics go into the chunk's fixed merge tree and the chunk's rows are merged over the
      group through its top (:mod:`chunked_entropy._tiles`).
    - blocks outermost, where the kernels merge a block into running statistics (``kernels.blocks_outer``: the
      compiled and Triton ones) and neither replay, distillation, the invariant mode nor a second head rides
      along: every row's statistics in one ``[6, n]`` tensor (rows ``m, ones, rest, w, q, zl``), each block's
      written into its chunk's columns by the kernel itself (``out=``), the first block's as they are and every
      later block's merged into the running ones (``merge=``: the same arithmetic in the same order of blocks;
      the Triton kernel merges inside its launch); then merged over the group once for every row and finished.
      One launch a (chunk, block) of the Triton kernels, nothing else a block. Allocates the ``[6, n]``
      statistics (the results' ``m`` is its first row).

    ``teacher``: a divergence's second head (:class:`TeacherHead`), walked beside the student's blocks, chunks
    outermost: its block filled beside each of the student's, both heads' statistics merged over the group
    together at a chunk's last block (one MAX all-reduce, one all-gather), then the divergence's sums (one SUM
    all-reduce; see :class:`_TeacherWalk`). Returns ``(stats, pair)`` then (the
    :class:`~chunked_entropy._divergence.PairRows` of every row), written into ``into`` (``(stats, pair)``
    from :func:`new_row_stats`, :func:`new_pair_rows`) when given.
    """
    block, chunk_size, group, want, kernels = (plan.vocab_chunk_size, plan.chunk_size, plan.group, plan.want,
                                                plan.kernels)
    n, kept, at, tiles, tf = tok.n, tok.keep, tok.at, plan.tiles, tok.transform
    if teacher is not None:  # the student's blocks filled into our buffer, where the divergence's steps read them
        view = None
    view = kernels.view(view, tf)
    bufs = Buffers(min(chunk_size, n), block, dtype if teacher is not None else block_dtype(plan, dtype), device,
                   work=kernels.in_place or view is None,
                   scratch=kernels.in_place and (want.scratch or teacher is not None))
    const = {}  # the kernels' constants (kernel_k, kernel_cap): filled once a walk
    second = None if teacher is None else teacher.walk(tok, width=width, block=block, chunk_size=chunk_size,
                                                       dtype=dtype, device=device, kernels=kernels, const=const)
    outer = kernels.blocks_outer and kept is None and at is None and tiles is None and second is None
    running = torch.empty(6, n, dtype=dtype, device=device) if outer else None  # m, ones, rest, w, q, zl
    if into is not None:
        out, pair = into
    else:
        out = None if outer else new_row_stats(n, want, dtype, device, kept)
        pair = None if second is None else new_pair_rows(n, teacher.spec, dtype, device)
    if at is not None:
        at.start(n, dtype, device)
    walking = {}  # the chunks open: their first row -> _ChunkStats
    for a, b, v0, v1 in _order(n, chunk_size, width, block, outer):
        c = walking.get(a)
        if c is None:
            c = walking[a] = _ChunkStats(tok, a, b, chunk_size, tiles, second)
        x, scratch, _ = bufs.get(b - a, v1 - v0)
        z, _ = kernels.read(fill, view, x, None, a, b, v0, v1)
        g = _block_kept(kept, c.entries, z, v0, tf, c.k, dtype)
        if at is not None:  # distillation's ids and top-k, read before the block is overwritten
            c.cand = at.block(z, a, b, v0, c.cand)
        if c.tree is not None:  # the invariant mode: the block's tiles into the chunk's tree
            blk, src, fast = kernels.tile_block(z, x)
            _tiles.push_block_stats(c.tree, tiles, blk, tf, c.k, c.target, v0, scratch, want_w=want.entropy,
                                    want_q=want.sum_pi_squared, src=src, compiled=fast, dtype=dtype)
        else:
            blk = kernels.block_stats(z, x, scratch, None, tf, c.k, c.target, v0, want.entropy, want.sum_pi_squared,
                                      dtype, const, out=None if running is None else running[:, a:b],
                                      merge=running is not None and v0 > 0)
            prev, c.st = c.st, (blk if running is not None else _stats.merge_stats(c.st, blk, c.k))
            if second is not None:  # the teacher's block beside it
                second.block_stats(c, a, b, v0, v1, x, scratch, blk, prev)
            if g is not None:
                kb, kc = _keep.block_stats(g, c.entries, b - a, c.k, dtype)
                c.kst = _stats.merge_stats(c.kst, kb, c.k)
                c.count = kc if c.count is None else c.count + kc
            blk = prev = g = None  # merged: freed before the next block's
        if v1 < width or running is not None:
            continue
        del walking[a]  # the chunk's last block: its rows merged over the group
        if c.tree is not None:
            _store(out, _stats.RowStats.from_block(_tiles.merged_stats(c.tree, tiles, group, c.k), c.k), a, b)
        elif second is not None:
            _store_pair(out, pair, *second.close(c, a, b, group, _refill(fill, bufs, a, b), x, None,
                                                 keep_parts=False)[:2], a, b)
        else:
            _store(out, _rows_of_chunk(c.st, c.kst, c.count, group, c.k, kept)[0], a, b)
        if at is not None:
            at.chunk_done(a, b, c.cand)
    if running is not None:  # every row's, merged over the group at once
        on = (True, True, True, want.entropy, want.sum_pi_squared, True)
        st = _stats.BlockStats(*(t if o else None for t, o in zip(running.unbind(0), on, strict=True)))
        merged, _, _ = reduce_stats(st, group, tok.k_rows(0, n))
        return _stats.RowStats.from_block(merged, tok.k_rows(0, n))
    if at is not None:
        at.finish(group)
    return out if second is None else (out, pair)


def _refill(fill: Fill, bufs: Buffers, a: int, b: int):
    """``refill(v0, v1)``: the student's raw block of rows ``[a, b)``, columns ``[v0, v1)``, filled again into
    the walk's buffer (a divergence's second pass over a chunk's blocks)."""
    def refill(v0: int, v1: int) -> torch.Tensor:
        x, _, _ = bufs.get(b - a, v1 - v0)
        fill(x, a, b, v0, v1)
        return x
    return refill


def grad_blocks(
    tok: Tokens, fill: Fill, plan: Plan, *, width: int, stats: _stats.RowStats, grads, dtype, device,
    into: Optional[Callable[[int, int], torch.Tensor]] = None, view: View = None,
    at_grads: Optional[torch.Tensor] = None, block: Optional[int] = None, vocab_outer: bool = False,
    grad_rows: Optional[Callable[[int, int, int, int], torch.Tensor]] = None,
    teacher: Optional["TeacherHead"] = None, pair: Optional["_divergence.PairRows"] = None,
    div_grads: Optional[torch.Tensor] = None,
) -> Iterator[tuple]:
    """Backward: yield ``(a, b, v0, v1, g)``, the gradient w.r.t. each block's raw logits.

    ``g`` lives in a reused buffer, valid until the next step. ``into(a, b)``
    optionally supplies the buffer to compute in (the logits path passes the
    rows of the gradient itself, saving a buffer; the compiled and Triton kernels write
    it in its own dtype). ``grads`` are the upstream gradients of
    ``(log_probs, entropy, sum_pi_squared)`` (None: that output has none, and
    costs nothing). With sampling replay the kept sets' sparse term is added
    to each block (see :mod:`chunked_entropy._keep`). ``at_grads``: the
    upstream gradients ``[N, K + k]`` of distillation's log-probs at
    ``tok.at``'s ids, their sparse term added to each block (see
    :mod:`chunked_entropy._token_ids`). ``vocab_outer``: the vocabulary blocks are
    walked outermost, each block's chunks in order (the fused head's
    half-precision weight gradient, one matmul per block:
    :func:`chunked_entropy._logit_blocks.linear_grads`); the per-token coefficients
    are still formed once per chunk (a few vectors of the chunk, kept over the blocks).

    ``grad_rows(a, b, v0, v1)`` (with ``vocab_outer``): the rows of the ``[n, block]`` buffer, in the plan's
    ``block_dtype``, that the weight gradient's matmul reads
    (:class:`chunked_entropy._logit_blocks.GradRows`). Where the blocks are read in that dtype
    (:func:`block_dtype`) each block is filled there for all ``n`` tokens at once (one step a block) and the
    compiled kernels overwrite it with its gradient: no buffer of ours. Else chunks of ``chunk_size`` rows
    through our buffer in ``dtype``.

    ``teacher``: a divergence's second head (:class:`TeacherHead`): each block's gradient is the divergence's
    (``div_grads``, ``[N]``: its upstream gradient; None: no term) plus the student's terms, the teacher's
    block filled beside the student's (``pair``: the rows' :class:`~chunked_entropy._divergence.PairRows`).
    No collective.
    """
    block = plan.vocab_chunk_size if block is None else block  # a backward's own block (vocab_outer)
    chunk_size, kernels = plan.chunk_size, plan.kernels
    n, kept, at = tok.n, tok.keep, tok.at
    at_ids = None if at_grads is None else at.all_ids()
    g_lp, g_h, g_q = (None if g is None else g.reshape(-1).to(dtype) for g in grads)
    softcap = tok.transform.softcap is not None
    view = kernels.view(view, tok.transform)
    if teacher is not None:  # the student's blocks filled into our buffer, where the divergence's steps read them
        view = None
    bdt = block_dtype(plan, dtype, sparse=kept is not None or at_ids is not None or teacher is not None)
    if bdt == dtype or not vocab_outer:
        grad_rows = None
    if grad_rows is not None:  # each block filled into its gradient rows, all tokens at once: no buffer of ours
        chunk_size = n
    bufs = Buffers(
        min(chunk_size, n), block, bdt, device,
        work=grad_rows is None and (into is None or (view is None and not kernels.in_place)),
        scratch=(g_h is not None or g_q is not None or teacher is not None) and kernels.in_place,
        aux=softcap and kernels.in_place,
    )

    const = {}  # kernel_k's constants
    second = None if teacher is None else teacher.walk(tok, width=width, block=block, chunk_size=chunk_size,
                                                       dtype=dtype, device=device, kernels=kernels, const=const,
                                                       teacher_scratch=False)
    g_div = None if div_grads is None else div_grads.reshape(-1).to(dtype)

    def pair_rows(a, b):
        """The divergence's rows and its upstream gradient times ``kz`` (zeros without one), or Nones."""
        if second is None:
            return None, None
        up = torch.zeros(b - a, dtype=dtype, device=device) if g_div is None else g_div[a:b]
        return pair.rows(a, b), tok.scaled(up, a, b)
    # without replay or distillation the coefficients are per-row arithmetic: formed once for every row
    co_all = None if kept is not None or at_ids is not None else tok.coefficients(0, n, g_lp, g_h, g_q)

    def chunk(a, b):
        """What the gradient of rows ``[a, b)`` reads: ``_refilled_grad``'s keywords."""
        here, scale = pair_rows(a, b)
        if co_all is not None:
            co = _stats.Coefficients(*(None if t is None else t[a:b] for t in co_all))
            return dict(rows=stats.rows(a, b), co=co, entries=None, co_k=None, at=None, here=here, scale=scale)
        co = tok.coefficients(a, b, *(None if g is None else g[a:b] for g in (g_lp, g_h, g_q)))
        rows = stats.rows(a, b)
        entries = co_k = sparse = None
        if kept is not None:
            entries = kept.chunk(a, b, n, chunk_size)
            co, co_k = _keep.split(co, rows.truncated, kept.of_kept)
        if at_ids is not None:  # the dense part of the ids' gradient rides on the log-prob's coefficient
            coef = tok.scaled(at_grads[a:b], a, b)
            total = coef.sum(dim=1)
            co = co._replace(c=total if co.c is None else co.c + total)
            sparse = (at_ids, coef, total)
        return dict(rows=rows, co=co, entries=entries, co_k=co_k, at=sparse, here=here, scale=scale)

    def block_grad(a, b, v0, v1, parts):
        if grad_rows is not None:  # filled, then overwritten by its gradient, where the weight's matmul reads it
            x = grad_rows(a, b, v0, v1)
            fill(x, a, b, v0, v1)
            return kernels.block_grad(x, x, None, None, tok.transform, tok.k_rows(a, b), parts["rows"],
                                       tok.target[a:b], v0, parts["co"], dtype, const)
        return _refilled_grad(tok, fill, view, bufs, a, b, v0, v1, parts["rows"], parts["co"], dtype,
                              kernels=kernels, into=into, entries=parts["entries"], co_k=parts["co_k"],
                              at=parts["at"], const=const, second=second, here=parts["here"], scale=parts["scale"])

    yield from _gradient_walk(n, width, block, chunk_size, vocab_outer, chunk, block_grad)


def _gradient_walk(n: int, width: int, block: int, chunk_size: int, vocab_outer: bool, chunk, block_grad):
    """Yield ``(a, b, v0, v1, block_grad(a, b, v0, v1, chunk(a, b)))`` over every chunk of rows and vocabulary
    block in :func:`_order`'s order: chunks outermost, or vocabulary blocks outermost; either way ``chunk(a,
    b)``, what a chunk's gradients read (a few vectors a chunk), is formed once per chunk, at its first block,
    and kept until its last."""
    walking = {}
    for a, b, v0, v1 in _order(n, chunk_size, width, block, vocab_outer):
        if v0 == 0:
            walking[a] = chunk(a, b)
        yield a, b, v0, v1, block_grad(a, b, v0, v1, walking[a])
        if v1 == width:
            del walking[a]


def _refilled_grad(tok: Tokens, fill: Fill, view: View, bufs: Buffers, a, b, v0, v1, rows, co, dtype, *,
                   kernels: Kernels, into, entries=None, co_k=None, at=None, const=None, second=None, here=None,
                   scale=None) -> torch.Tensor:
    """The gradient w.r.t. the raw logits of rows ``[a, b)``, columns ``[v0, v1)``, the block filled again,
    from the rows' finished statistics and coefficients; with replay's and distillation's sparse terms
    (``at``: ``(ids, coefficients, their sums)``). ``const``: the walk's kernel constants
    (:func:`chunked_entropy._kernels.kernel_k`, :func:`~chunked_entropy._kernels.kernel_cap`). ``second``: a
    divergence's second head (:class:`_TeacherWalk`), its block filled beside this one, the divergence's term
    (``here``: the rows' PairRows, ``scale``: its upstream gradient times ``kz``) in the gradient."""
    kept, k, target = tok.keep, tok.k_rows(a, b), tok.target[a:b]
    at_ids = None if at is None else at[0]
    x, scratch, aux = bufs.get(b - a, v1 - v0)
    z, out = kernels.read(fill, view, x, into, a, b, v0, v1)
    gk = _block_kept(kept, entries, z, v0, tok.transform, k, dtype)
    ea, ra = _block_at(tok.at, at_ids, target, a, b, v0, z, tok.transform)
    const = {} if const is None else const
    if second is None:
        g = kernels.block_grad(z, out, scratch, aux, tok.transform, k, rows, target, v0, co, dtype, const)
    else:
        g = second.grad(out, scratch, aux, a, b, v0, v1, k, rows, here, scale, co)
    if gk is not None:
        _keep.add_grad_(g, gk, entries, rows.kept, rows.truncated, co_k, tok.transform, k)
    if ea is not None:
        _token_ids.add_grad_(g, ra, ea, at[1], at[2], tok.transform)
    return g


#: ``token_grads(a, b, log_probs)``: the upstream gradients of ``(log_probs, entropy)`` of rows ``[a, b)``.
TokenGrads = Callable[[int, int, torch.Tensor], tuple]


def _grouping(n: int, span: Optional[int], chunk_size: int) -> tuple:
    """``(chunk, group)``: the chunk size to walk, and the tokens of a group, a run of whole spans (rows, or
    the whole batch) whose statistics its gradients read. A span longer than a chunk is walked in chunks
    that divide it (at least half ``chunk_size``), or else the whole batch is one group."""
    if span is None:
        return chunk_size, n
    if span <= chunk_size:
        chunk = chunk_size - chunk_size % span
        return chunk, chunk
    divisor = max(d for i in range(1, math.isqrt(span) + 1) if span % i == 0 for d in (i, span // i)
                  if d <= chunk_size)
    return (divisor, span) if 2 * divisor >= chunk_size else (chunk_size, n)


def loss_grad_blocks(
    tok: Tokens, fill: Fill, plan: Plan, *, width: int, token_grads: TokenGrads, stats: _stats.RowStats, dtype,
    device, into: Optional[Callable[[int, int], torch.Tensor]] = None, view: View = None,
    span: Optional[int] = 1, grad_block: Optional[int] = None,
    grad_rows: Optional[Callable[[int, int, int, int], torch.Tensor]] = None,
    teacher: Optional["TeacherHead"] = None, pair: Optional["_divergence.PairRows"] = None,
) -> Iterator[tuple]:
    """Forward of a loss whose per-token upstream gradients follow from the tokens' outputs.

    Yields ``(a, b, v0, v1, g)`` as :func:`grad_blocks` does (in any order of
    the chunks), and fills ``stats`` (full-length
    :class:`~chunked_entropy._stats.RowStats` arrays, from
    :func:`new_row_stats`) on the way. ``token_grads(a, b, log_probs)`` gives
    the upstream gradients of ``(log_probs, entropy)`` for tokens ``[a, b)``
    from their log-probs (over the kept sets with replay).

    ``span``: a token's gradients read the outputs of the ``span`` tokens of
    its own aligned group (1: its own, a token-local loss; ``T``: its
    sequence's, rows of ``[B, T]``; None: every token's, a batch-level loss).
    The chunks are walked in groups of whole spans (:func:`_grouping`): a
    group's chunks forward (statistics; the last chunk's block is kept), then
    ``token_grads`` once for the group, then the gradients: the last chunk's
    from its kept block, the others' with their logits filled again, in
    reverse. A group that fits one chunk (a token-local loss, or rows no
    longer than a chunk: ``chunk_size`` is rounded down to a multiple of
    ``span``) fills each chunk once, so a fused head does three matmul passes
    instead of four; a group of ``g`` chunks fills ``2g - 1``. With
    vocabulary blocks (``block < width``) a row's statistics are complete only
    after its last block: a statistics pass runs first and the gradient pass
    refills each block, with ``token_grads`` asked once, for every row. ``grad_block``: the same two passes,
    the gradient pass
    walking vocabulary blocks of that width outermost (``vocab_outer`` of
    :func:`grad_blocks`: a half-precision weight's gradient, one matmul per
    block; ``grad_rows`` as there).

    ``teacher``: a divergence's second head (:class:`TeacherHead`): a loss of the rows' divergences (and the
    student's outputs), ``token_grads`` then giving a third upstream gradient, the divergence's (``[g1 - g0]``,
    or None), and ``pair`` (from :func:`new_pair_rows`) filled beside ``stats``. With one vocabulary block each
    chunk's blocks are filled once (statistics, the divergence's sums and the gradient from the blocks held);
    with vocabulary blocks, the statistics walk (:func:`row_stats`) and the gradient walk. Three collectives a
    chunk under a group.
    """
    block, chunk_size, group, want, kernels = (plan.vocab_chunk_size, plan.chunk_size, plan.group, plan.want,
                                                plan.kernels)
    n, kept = tok.n, tok.keep
    log_probs = (lambda a, b: None) if teacher is not None else (lambda a, b: stats.rows(a, b).log_probs())  # noqa: E731
    if block < width or grad_block is not None:
        if teacher is not None:
            row_stats(tok, fill, plan, width=width, dtype=dtype, device=device, view=view, teacher=teacher,
                      into=(stats, pair))
        else:
            _store(stats, row_stats(tok, fill, plan, width=width, dtype=dtype, device=device, view=view), 0, n)
        # every row's statistics are final: the upstream gradients of all rows at once (per-token arithmetic,
        # the same values as chunk by chunk; one set of launches a call, not one a chunk). None: no term
        ups = token_grads(0, n, log_probs(0, n))
        yield from grad_blocks(tok, fill, plan, width=width, block=grad_block, stats=stats, grads=(*ups[:2], None),
                               dtype=dtype, device=device, into=into, view=view, vocab_outer=grad_block is not None,
                               grad_rows=grad_rows, teacher=teacher, pair=pair,
                               div_grads=ups[2] if teacher is not None else None)
        return
    chunk_size, group_size = _grouping(n, span, chunk_size)
    softcap = tok.transform.softcap is not None
    if teacher is not None:  # the student's blocks filled into our buffer, where the divergence's steps read them
        view = None
    view = kernels.view(view, tok.transform)
    bufs = Buffers(min(chunk_size, n), width, dtype, device,
                   work=into is None or (view is None and not kernels.in_place), scratch=kernels.in_place,
                   aux=softcap and kernels.in_place)

    const = {}  # the kernels' constants (kernel_k, kernel_cap): filled once a walk
    second = None if teacher is None else teacher.walk(tok, width=width, block=width, chunk_size=chunk_size,
                                                       dtype=dtype, device=device, kernels=kernels, const=const)

    def coefficients(a, b, g0, ups, rows):
        co = tok.coefficients(a, b, *(None if u is None else u[a - g0:b - g0] for u in ups[:2]), None)
        return (co, None) if kept is None else _keep.split(co, rows.truncated, kept.of_kept)

    def div_scale(a, b, g0, ups):
        """The divergence's upstream gradient of rows ``[a, b)`` times ``kz`` (zeros without one), or None."""
        if second is None:
            return None
        up = torch.zeros(b - a, dtype=dtype, device=device) if ups[2] is None else ups[2][a - g0:b - g0]
        return tok.scaled(up, a, b)

    for g0, g1 in chunks(n, group_size):
        for a, b in chunks(g1 - g0, chunk_size):  # statistics, chunk by chunk; the last chunk's block is kept
            a, b = g0 + a, g0 + b
            k, target = tok.k_rows(a, b), tok.target[a:b]
            entries = None if kept is None else kept.chunk(a, b, n, chunk_size)
            x, scratch, aux = bufs.get(b - a, width)
            z, out = kernels.read(fill, view, x, into, a, b, 0, width)  # statistics, then the gradient, from it
            gk = _block_kept(kept, entries, z, 0, tok.transform, k, dtype)
            local = kernels.block_stats(z, out, scratch, aux, tok.transform, k, target, 0, want.entropy,
                                         want.sum_pi_squared, dtype, const)
            kb, kc = (None, None) if gk is None else _keep.block_stats(gk, entries, b - a, k, dtype)
            if second is not None:  # the teacher's block beside it; both heads merged, the divergence's sums
                c = _ChunkStats(tok, a, b, chunk_size, None, second)
                c.st, c.kst, c.count = local, kb, kc
                second.block_stats(c, a, b, 0, width, out, scratch, local, None)
                rows, here, parts = second.close(c, a, b, group, None, out, aux, keep_parts=True)
                _store_pair(stats, pair, rows, here, a, b)
            else:
                rows, merged = _rows_of_chunk(local, kb, kc, group, k, kept)
                _store(stats, rows, a, b)
        ups = token_grads(g0, g1, log_probs(g0, g1))
        co, co_k = coefficients(a, b, g0, ups, rows)  # the last chunk, from its kept block
        if second is not None:  # from both blocks held (and what the divergence's sums kept)
            g = second.grad(out, None, aux, a, b, 0, width, k, rows, here, div_scale(a, b, g0, ups), co,
                            held_t=c.xt, parts=parts)
            c = parts = here = local = None  # freed before the next chunk's
        else:
            g = kernels.held_grad(z, out, scratch, aux, local, merged, tok.transform, k, rows, target, 0, co, dtype,
                                  const)
        if gk is not None:
            _keep.add_grad_(g, gk, entries, rows.kept, rows.truncated, co_k, tok.transform, k)
        yield a, b, 0, width, g
        for a, b in reversed(list(chunks(g1 - g0, chunk_size))[:-1]):  # the others, filled again
            a, b = g0 + a, g0 + b
            rows = stats.rows(a, b)
            co, co_k = coefficients(a, b, g0, ups, rows)
            entries = None if kept is None else kept.chunk(a, b, n, chunk_size)
            yield a, b, 0, width, _refilled_grad(tok, fill, view, bufs, a, b, 0, width, rows, co, dtype,
                                                 kernels=kernels, into=into, entries=entries, co_k=co_k,
                                                 const=const, second=second,
                                                 here=None if second is None else pair.rows(a, b),
                                                 scale=div_scale(a, b, g0, ups))


# ----------------------------------------------------------------------------- two heads: a divergence
#
# A second head is a mode of the walks above: the student's block (``fill``, the rows' Tokens ``tok`` with its
# transform) walked as every op's, the teacher's (``TeacherHead``: its fill, transform ``tf_t``, the same
# temperature) filled beside it. Each model's statistics are the ones above; the divergence's per-row sums are
# the math of chunked_entropy._divergence, through the kernels objects' pair steps.


#: A KL's value folded online over vocabulary blocks in the statistics' pass (each block filled once in the
#: per-token form's forward, twice in the loss form's) instead of a second pass that fills each block again for
#: the divergence's sums. False: the second pass (the A/B switch of the measurement and of the tests).
FOLD_KL = True


@dataclass(frozen=True)
class TeacherHead:
    """A divergence's second head, the teacher's, as the walks take it (``teacher=`` of :func:`row_stats`,
    :func:`loss_grad_blocks`, :func:`grad_blocks`): its fill (``fill(x, a, b, v0, v1)``, as the student's), its
    logit transform and the divergence (its :class:`~chunked_entropy._divergence.DivergenceMath` in
    ``spec.math``). Each walk makes its own :class:`_TeacherWalk` (:meth:`walk`): the teacher's buffers and the
    per-chunk steps."""

    transform: _stats.Transform
    spec: object
    fill: Fill

    def walk(self, tok: Tokens, *, width: int, block: int, chunk_size: int, dtype, device, kernels: Kernels,
             const: dict, teacher_scratch: bool = True) -> "_TeacherWalk":
        return _TeacherWalk(self, tok, width=width, block=block, chunk_size=chunk_size, dtype=dtype, device=device,
                            kernels=kernels, const=const, teacher_scratch=teacher_scratch)


class _TeacherWalk:
    """The teacher's side of one walk: its buffers and the divergence's per-chunk steps, beside the student's
    blocks the walk reads as any op's (replay's kept sets and distillation's ids included).

    Per block of the statistics' pass (:meth:`block_stats`): the teacher's block filled, its statistics merged
    over the chunk's blocks and, a KL over vocabulary blocks (``fold``), its cross sum folded online. At a
    chunk's last block (:meth:`close`): both heads merged over the group (one MAX all-reduce, one all-gather:
    :func:`~chunked_entropy.parallel.reduce_stats_pair`), then the divergence's sums (one SUM all-reduce; a KL
    folded online needs none): from the blocks still held when the vocabulary is one block, else each block of
    both heads filled again. The gradient (:meth:`grad`): from the blocks held, or the teacher's filled again
    beside the student's. The per-block math is the kernels object's (``block_stats``, ``pair_ready``,
    ``pair_held``, ``pair_cross``, ``pair_terms``, ``pair_grad``), asked, never which kernels they are.

    Buffers: the teacher's ``[chunk_size, block]`` block in the compute dtype and, where the kernels work in
    place (``kernels.in_place``: the eager ones) and ``teacher_scratch``, its ``exp`` scratch (the student's
    buffers are the walk's).
    """

    def __init__(self, head: TeacherHead, tok: Tokens, *, width: int, block: int, chunk_size: int, dtype, device,
                 kernels: Kernels, const: dict, teacher_scratch: bool = True):
        self.tok, self.tf_t, self.spec, self.fill_t = tok, head.transform, head.spec, head.fill
        self.math = head.spec.math
        self.width, self.block, self.dtype, self.kernels, self.const = width, block, dtype, kernels, const
        rows = min(chunk_size, tok.n)
        self.bufs_t = Buffers(rows, block, dtype, device, work=True, scratch=kernels.in_place and teacher_scratch)
        self.rows, self.device, self.no_label = rows, device, None  # the teacher's "no label", made on first use
        self.fold = FOLD_KL and block < width and self.math.weighs is not None
        self.teacher_weighs = self.math.weighs == "t"

    def k_t(self, a: int, b: int):
        """The teacher's per-row multiplier of rows ``[a, b)``."""
        return self.tf_t.k(self.tok.inv_t_rows(a, b))

    def fill(self, a, b, v0, v1) -> tuple:
        """The teacher's raw block of rows ``[a, b)``, columns ``[v0, v1)``: ``(x_t, scratch_t)``."""
        xt, scratch_t, _ = self.bufs_t.get(b - a, v1 - v0)
        self.fill_t(xt, a, b, v0, v1)
        return xt, scratch_t

    def _cross_to(self, c, st, stt, m, m_t, k, kt):
        """A KL's cross sum relative to the maxima ``m``, ``m_t`` (:func:`~chunked_entropy._stats.rescale_cross`)."""
        if self.teacher_weighs:
            return _stats.rescale_cross(c, stt, st, m_t, m, kt, k)
        return _stats.rescale_cross(c, st, stt, m, m_t, k, kt)

    def block_stats(self, c: _ChunkStats, a, b, v0, v1, x, scratch, local, prev) -> None:
        """The teacher's block beside the student's ``x`` (as its ``block_stats`` left it; ``local``: its
        statistics, ``prev``: the chunk's before them, ``c.st``: after): its statistics merged into ``c.stt``,
        a KL's cross sum folded into ``c.cross``; the block kept in ``c.xt``."""
        k, kt = c.k, c.kt
        if self.no_label is None:  # a statistics' pass (a gradient walk needs none)
            self.no_label = torch.full((self.rows,), -1, dtype=torch.int64, device=self.device)
        xt, scratch_t = self.fill(a, b, v0, v1)
        local_t = self.kernels.block_stats(xt, xt, scratch_t, None, self.tf_t, kt, self.no_label[: b - a], v0, False,
                                           False, self.dtype, self.const)
        prev_t, c.stt, c.xt = c.stt, _stats.merge_stats(c.stt, local_t, kt), xt
        if self.fold:
            cross = self.kernels.pair_cross(x, xt, self.tok.transform, k, local.m, self.tf_t, kt, local_t.m,
                                            self.dtype, self.const, scratch, scratch_t, self.teacher_weighs)
            c.cross = cross if prev is None else (self._cross_to(c.cross, prev, prev_t, c.st.m, c.stt.m, k, kt)
                                                  + self._cross_to(cross, local, local_t, c.st.m, c.stt.m, k, kt))

    def close(self, c: _ChunkStats, a: int, b: int, group, refill, x, aux, keep_parts: bool) -> tuple:
        """A chunk's last block walked: ``(rows, here, parts)``, the student's RowStats and the chunk's PairRows
        over the whole vocabulary and ``group`` (three collectives; two for a KL folded online), and what the
        divergence's sums kept for the gradient (``keep_parts``, one block: the eager kernels'). ``x``, ``aux``:
        the student's last block and its cap derivative (held with one vocabulary block); ``refill(v0, v1)``:
        the student's block filled again (vocabulary blocks)."""
        k, kt = c.k, c.kt
        # the cross sum (a KL folded online) and the kept sets' statistics ride in the statistics' gather
        merged, merged_t, *rest = reduce_stats_pair(c.st, c.stt, group, k, kt,
                                                    cross=(c.cross, self.teacher_weighs) if self.fold else None,
                                                    kept=c.kst, count=c.count)
        cross = rest.pop(0) if self.fold else None
        kst, count = rest if c.kst is not None else (None, None)
        rows = _with_kept(_stats.RowStats.from_block(merged, k), kst, count, k, self.tok.keep)
        ls_t = _stats.RowStats.from_block(merged_t, kt).ls
        if cross is not None:  # a KL folded online: no pass, no collective
            s_s, s_t = merged.ones + merged.rest, merged_t.ones + merged_t.rest
            div = (self.math.folded(cross, s_t, ls_t, rows.ls) if self.teacher_weighs
                   else self.math.folded(cross, s_s, rows.ls, ls_t))
            return rows, _divergence.PairRows(merged_t.m, ls_t, div, div if self.spec.needs_aux else None), None
        kernels, tf, tf_t, dtype, const = self.kernels, self.tok.transform, self.tf_t, self.dtype, self.const
        m, m_t = merged.m, merged_t.m
        parts = None
        if self.block >= self.width:  # the blocks are held: relative to the merged maxima
            kernels.pair_held(x, c.xt, c.st, c.stt, merged, merged_t, k, kt)
            div, aux_sum, parts = kernels.pair_terms(self.spec, x, c.xt, tf, k, m, rows.ls, tf_t, kt, m_t, ls_t, dtype,
                                                     const)
            parts = parts if keep_parts else None
        else:
            div = aux_sum = None
            for v0, v1 in chunks(self.width, self.block):
                y = refill(v0, v1)
                yt, _ = self.fill(a, b, v0, v1)
                kernels.pair_ready(y, yt, None, tf, k, m, tf_t, kt, m_t, cap_out=False)
                d, ka, _ = kernels.pair_terms(self.spec, y, yt, tf, k, m, rows.ls, tf_t, kt, m_t, ls_t, dtype, const)
                div = d if div is None else div + d
                aux_sum = ka if aux_sum is None else aux_sum + ka
        if not self.spec.needs_aux:
            aux_sum = None
        sums = all_reduce_sum_(torch.stack([div] if aux_sum is None else [div, aux_sum]), group)
        div, aux_sum = sums[0], (sums[1] if aux_sum is not None else (sums[0] if self.spec.needs_aux else None))
        return rows, _divergence.PairRows(merged_t.m, ls_t, div, aux_sum), parts

    def grad(self, x, scratch, cap, a, b, v0, v1, k, rows, here, scale, co, held_t=None, parts=None):
        """The gradient w.r.t. the student's raw logits of one block, written over the student's ``x`` (raw,
        just filled; or, ``held_t`` the teacher's block, both as the statistics and sums left them): ``scale *
        dD/dx_s`` (``scale``: ``[b - a]``, the upstream gradient times ``kz``) plus the student's log-prob /
        entropy terms of ``co``. ``cap``: the student's cap derivative buffer; ``parts``: what the divergence's
        sums of this block kept."""
        tf, tf_t, kt = self.tok.transform, self.tf_t, self.k_t(a, b)
        if held_t is None:
            xt, _ = self.fill(a, b, v0, v1)
            self.kernels.pair_ready(x, xt, cap, tf, k, rows.m, tf_t, kt, here.m_t, cap_out=True)
        else:
            xt = held_t
        return self.kernels.pair_grad(self.spec, x, xt, tf, k, rows, self.tok.target[a:b], v0, co, tf_t, kt, here,
                                      scale, self.dtype, self.const, scratch, cap, parts)


def _store_pair(stats: _stats.RowStats, pair: "_divergence.PairRows", rows, here, a: int, b: int) -> None:
    _store(stats, rows, a, b)
    for dst, src in zip(pair, here, strict=True):
        if dst is not None:
            dst[a:b] = src


def saved_pair_rows(stats: _stats.RowStats, pair: "_divergence.PairRows") -> tuple:
    """The rows a divergence's Function saves for its backward: the student's statistics (its kept sets' with
    replay: :meth:`~chunked_entropy._stats.RowStats.saved`) and the pair's."""
    return stats.saved() + tuple(pair)


def pair_rows_from_saved(t) -> tuple:
    """:func:`saved_pair_rows`'s tensors back as ``(RowStats, PairRows)``."""
    return _stats.RowStats.from_saved(t[:9]), _divergence.PairRows(*t[9:])


def new_pair_rows(n: int, spec, dtype, device) -> "_divergence.PairRows":
    """Full-length :class:`~chunked_entropy._divergence.PairRows` for the walks with a second head to fill."""
    new = lambda: torch.empty(n, dtype=dtype, device=device)  # noqa: E731
    return _divergence.PairRows(new(), new(), new(), new() if spec.needs_aux else None)
