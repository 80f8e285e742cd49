"""The chunk loop, shared by every op: the walks over tokens and vocabulary blocks, and the :class:`Plan` they follow.

Its users: the logits path (:mod:`chunked_entropy.logits`), the fused head
(:mod:`chunked_entropy.linear`), the fused policy loss (:mod:`chunked_entropy.policy`, from logits or
hidden states), and the divergences (:mod:`chunked_entropy.divergence`, one head or two), with sampling
replay's kept sets and distillation's ids riding along. The walks: the statistics (:func:`row_stats`, one
walk in either order of chunks and blocks, :func:`_order`), the gradient (:func:`grad_blocks`, the same
orders), the fused loss's gradient formed in forward (:func:`loss_grad_blocks`), and a divergence's two heads
(:func:`pair_row_stats`, :func:`pair_loss_grad_blocks`, :func:`pair_grad_blocks`).
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
    rows = _stats.RowStats.from_block(st, k)
    if kst is None:
        return rows, st
    kr = _stats.RowStats.from_block(kst, k)  # the label's u as the kept entries' (_keep.block_stats)
    if not kept.of_kept:
        kr = kr._replace(ws=None, s2=None)
    return rows.with_kept(kr, count > 0), st


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
    over the blocks so far (and the kept sets' with their counts), distillation's candidates."""

    __slots__ = ("k", "target", "entries", "tree", "st", "kst", "count", "cand")

    def __init__(self, tok: Tokens, a: int, b: int, chunk_size: int, tiles):
        self.k, self.target = tok.k_rows(a, b), tok.target[a:b]
        self.entries = None if tok.keep is None else tok.keep.chunk(a, b, tok.n, chunk_size)
        self.tree = None if tiles is None else tiles.stats_tree(self.k)
        self.st = self.kst = self.count = self.cand = None


def row_stats(tok: Tokens, fill: Fill, plan: Plan, *, width: int, dtype, device, view: View = None) -> _stats.RowStats:
    """Forward: the per-token statistics of every row, merged over the plan's blocks and over its group.

    With sampling replay (``tok.keep``) also those of each row's kept set. One walk over every (chunk,
    block) (:func:`_order`), in one of two orders:

    - chunks outermost: each chunk's statistics merged over its blocks (:func:`~chunked_entropy._stats.merge_stats`)
      and, at its last block, over the group (with replay's kept sets; distillation's ids and top-k read on the
      way), stored in full-length results (:func:`new_row_stats`). In the invariant mode (``plan.tiles``) each
      block's tiles' statistics go into the chunk's fixed merge tree and the chunk's rows are merged over the
      group through its top (:mod:`chunked_entropy._tiles`).
    - blocks outermost, where the kernels merge a block into running statistics (``kernels.blocks_outer``: the
      compiled and Triton ones) and neither replay, distillation nor the invariant mode rides along: every
      row's statistics in one ``[6, n]`` tensor (rows ``m, ones, rest, w, q, zl``), each block's written into
      its chunk's columns by the kernel itself (``out=``), the first block's as they are and every later
      block's merged into the running ones (``merge=``: the same arithmetic in the same order of blocks; the
      Triton kernel merges inside its launch); then merged over the group once for every row and finished.
      One launch a (chunk, block) of the Triton kernels, nothing else a block. Allocates the ``[6, n]``
      statistics (the results' ``m`` is its first row).
    """
    block, chunk_size, group, want, kernels = (plan.vocab_chunk_size, plan.chunk_size, plan.group, plan.want,
                                                plan.kernels)
    n, kept, at, tiles, tf = tok.n, tok.keep, tok.at, plan.tiles, tok.transform
    view = kernels.view(view, tf)
    bufs = Buffers(min(chunk_size, n), block, block_dtype(plan, dtype), device,
                   work=kernels.in_place or view is None, scratch=want.scratch and kernels.in_place)
    outer = kernels.blocks_outer and kept is None and at is None and tiles is None
    running = torch.empty(6, n, dtype=dtype, device=device) if outer else None  # m, ones, rest, w, q, zl
    out = None if outer else new_row_stats(n, want, dtype, device, kept)
    if at is not None:
        at.start(n, dtype, device)
    const = {}  # the kernels' constants (kernel_k, kernel_cap): filled once a walk
    walking = {}  # the chunks open: their first row -> _ChunkStats
    for a, b, v0, v1 in _order(n, chunk_size, width, block, outer):
        c = walking.get(a)
        if c is None:
            c = walking[a] = _ChunkStats(tok, a, b, chunk_size, tiles)
        x, scratch, _ = bufs.get(b - a, v1 - v0)
        z, _ = kernels.read(fill, view, x, None, a, b, v0, v1)
        g = _block_kept(kept, c.entries, z, v0, tf, c.k, dtype)
        if at is not None:  # distillation's ids and top-k, read before the block is overwritten
            c.cand = at.block(z, a, b, v0, c.cand)
        if c.tree is not None:  # the invariant mode: the block's tiles into the chunk's tree
            fast = None if kernels.in_place else kernels
            _tiles.push_block_stats(c.tree, tiles, x if fast is None else z, tf, c.k, c.target, v0, scratch,
                                    want_w=want.entropy, want_q=want.sum_pi_squared,
                                    src=None if fast is not None or z is x else z, compiled=fast, dtype=dtype)
        else:
            blk = kernels.block_stats(z, x, scratch, None, tf, c.k, c.target, v0, want.entropy, want.sum_pi_squared,
                                      dtype, const, out=None if running is None else running[:, a:b],
                                      merge=running is not None and v0 > 0)
            c.st = blk if running is not None else _stats.merge_stats(c.st, blk, c.k)
            if g is not None:
                kb, kc = _keep.block_stats(g, c.entries, b - a, c.k, dtype)
                c.kst = _stats.merge_stats(c.kst, kb, c.k)
                c.count = kc if c.count is None else c.count + kc
        if v1 < width or running is not None:
            continue
        del walking[a]  # the chunk's last block: its rows merged over the group
        if c.tree is not None:
            _store(out, _stats.RowStats.from_block(_tiles.merged_stats(c.tree, tiles, group, c.k), c.k), a, b)
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
    return out


def grad_blocks(
    tok: Tokens, fill: Fill, plan: Plan, *, width: int, stats: _stats.RowStats, grads, dtype, device,
    into: Optional[Callable[[int, int], torch.Tensor]] = None, view: View = None,
    at_grads: Optional[torch.Tensor] = None, block: Optional[int] = None, vocab_outer: bool = False,
    grad_rows: Optional[Callable[[int, int, int, int], torch.Tensor]] = None,
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
    """
    block = plan.vocab_chunk_size if block is None else block  # a backward's own block (vocab_outer)
    chunk_size, kernels = plan.chunk_size, plan.kernels
    n, kept, at = tok.n, tok.keep, tok.at
    at_ids = None if at_grads is None else at.all_ids()
    g_lp, g_h, g_q = (None if g is None else g.reshape(-1).to(dtype) for g in grads)
    softcap = tok.transform.softcap is not None
    view = kernels.view(view, tok.transform)
    bdt = block_dtype(plan, dtype, sparse=kept is not None or at_ids is not None)
    if bdt == dtype or not vocab_outer:
        grad_rows = None
    if grad_rows is not None:  # each block filled into its gradient rows, all tokens at once: no buffer of ours
        chunk_size = n
    bufs = Buffers(
        min(chunk_size, n), block, bdt, device,
        work=grad_rows is None and (into is None or (view is None and not kernels.in_place)),
        scratch=(g_h is not None or g_q is not None) and kernels.in_place, aux=softcap and kernels.in_place,
    )

    const = {}  # kernel_k's constants
    # without replay or distillation the coefficients are per-row arithmetic: formed once for every row
    co_all = None if kept is not None or at_ids is not None else tok.coefficients(0, n, g_lp, g_h, g_q)

    def chunk(a, b):
        """What the gradient of rows ``[a, b)`` reads: ``_refilled_grad``'s keywords."""
        if co_all is not None:
            co = _stats.Coefficients(*(None if t is None else t[a:b] for t in co_all))
            return dict(rows=stats.rows(a, b), co=co, entries=None, co_k=None, at=None)
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
        return dict(rows=rows, co=co, entries=entries, co_k=co_k, at=sparse)

    def block_grad(a, b, v0, v1, parts):
        if grad_rows is not None:  # filled, then overwritten by its gradient, where the weight's matmul reads it
            x = grad_rows(a, b, v0, v1)
            fill(x, a, b, v0, v1)
            return kernels.block_grad(x, x, None, None, tok.transform, tok.k_rows(a, b), parts["rows"],
                                       tok.target[a:b], v0, parts["co"], dtype, const)
        return _refilled_grad(tok, fill, view, bufs, a, b, v0, v1, parts["rows"], parts["co"], dtype,
                              kernels=kernels, into=into, entries=parts["entries"], co_k=parts["co_k"],
                              at=parts["at"], const=const)

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
                   kernels: Kernels, into, entries=None, co_k=None, at=None, const=None) -> torch.Tensor:
    """The gradient w.r.t. the raw logits of rows ``[a, b)``, columns ``[v0, v1)``, the block filled again,
    from the rows' finished statistics and coefficients; with replay's and distillation's sparse terms
    (``at``: ``(ids, coefficients, their sums)``). ``const``: the walk's :func:`kernel_k` and
    :func:`kernel_cap` constants."""
    kept, k, target = tok.keep, tok.k_rows(a, b), tok.target[a:b]
    at_ids = None if at is None else at[0]
    x, scratch, aux = bufs.get(b - a, v1 - v0)
    z, out = kernels.read(fill, view, x, into, a, b, v0, v1)
    gk = _block_kept(kept, entries, z, v0, tok.transform, k, dtype)
    ea, ra = _block_at(tok.at, at_ids, target, a, b, v0, z, tok.transform)
    const = {} if const is None else const
    g = kernels.block_grad(z, out, scratch, aux, tok.transform, k, rows, target, v0, co, dtype, const)
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
    """
    block, chunk_size, group, want, kernels = (plan.vocab_chunk_size, plan.chunk_size, plan.group, plan.want,
                                                plan.kernels)
    n, kept = tok.n, tok.keep
    if block < width or grad_block is not None:
        full = row_stats(tok, fill, plan, width=width, dtype=dtype, device=device, view=view)
        _store(stats, full, 0, n)
        # every row's statistics are final: the upstream gradients of all rows at once (per-token arithmetic,
        # the same values as chunk by chunk; one set of launches a call, not one a chunk). None: no term
        g_lp, g_h = token_grads(0, n, stats.rows(0, n).log_probs())
        yield from grad_blocks(tok, fill, plan, width=width, block=grad_block, stats=stats, grads=(g_lp, g_h, None),
                               dtype=dtype, device=device, into=into, view=view, vocab_outer=grad_block is not None,
                               grad_rows=grad_rows)
        return
    chunk_size, group_size = _grouping(n, span, chunk_size)
    softcap = tok.transform.softcap is not None
    view = kernels.view(view, tok.transform)
    bufs = Buffers(min(chunk_size, n), width, dtype, device,
                   work=into is None or (view is None and not kernels.in_place), scratch=kernels.in_place,
                   aux=softcap and kernels.in_place)

    const = {}  # the kernels' constants (kernel_k, kernel_cap): filled once a walk

    def coefficients(a, b, g0, ups, rows):
        co = tok.coefficients(a, b, *(None if u is None else u[a - g0:b - g0] for u in ups), None)
        return (co, None) if kept is None else _keep.split(co, rows.truncated, kept.of_kept)

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
            rows, merged = _rows_of_chunk(local, kb, kc, group, k, kept)
            _store(stats, rows, a, b)
        ups = token_grads(g0, g1, stats.rows(g0, g1).log_probs())
        co, co_k = coefficients(a, b, g0, ups, rows)  # the last chunk, from its kept block
        g = kernels.held_grad(z, out, scratch, aux, local, merged, tok.transform, k, rows, target, 0, co, dtype, const)
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
                                                 const=const)


# ----------------------------------------------------------------------------- two heads: a divergence
#
# The same walk with a second projection per block: the student's block (``fill``, the rows' Tokens ``tok``
# with its transform) and the teacher's (``fill_t``, transform ``tf_t``, the same temperature). Each model's
# statistics are the ones above; the divergence's per-row sums are the math of chunked_entropy._divergence.


#: A KL's value folded online over vocabulary blocks in the statistics' pass (each block filled once in the
#: per-token form's forward, twice in the loss form's) instead of a second pass that fills each block again for
#: the divergence's sums. False: the second pass (the A/B switch of the measurement and of the tests).
FOLD_KL = True


class _PairWalk:
    """What the statistics walk, the loss walk and the gradient walk of a divergence share: the two heads'
    fills, transforms and buffers, and the per-chunk steps.

    Beside the one-head walks, not folded into them: a divergence's chunk needs a second pass over its
    blocks once the chunk's statistics are merged over blocks and ranks (the JSD's sums read both rows'
    final log-sum-exps), a second projection per block, a teacher's statistics riding in the student's
    collectives, and a gradient that reads two blocks. The one-head walks have none of these; threading
    them through ``row_stats`` / ``grad_blocks`` / ``loss_grad_blocks`` (the tuned paths of the fused head
    and loss, with replay's and distillation's sparse terms) would put a branch per block and a second
    buffer set into each. The pieces are shared instead: :class:`Buffers`, ``chunks``,
    :func:`_gradient_walk`, the statistics' math and merge (:mod:`chunked_entropy._stats`),
    :func:`~chunked_entropy.parallel.reduce_stats_pair` and the kernels objects: each block's statistics
    (``block_stats``) and the divergence's per-block steps (``pair_ready``, ``pair_held``, ``pair_cross``,
    ``pair_terms``, ``pair_grad``: :mod:`chunked_entropy._kernels`), asked, never which kernels they are.

    Buffers: each head's ``[chunk_size, block]`` block in the compute dtype; where the kernels work in place
    (``kernels.in_place``: the eager ones, offsets written over the blocks) also each head's ``exp`` scratch
    and, for a gradient with a student soft-cap, the cap's derivative; the compiled and Triton kernels read
    the raw blocks and form the transform, the offsets and the log-probs on the fly (the gradient kernel
    overwrites the student's block).
    """

    def __init__(self, tok: Tokens, tf_t, spec, fill: Fill, fill_t: Fill, *, width: int, block: int,
                 chunk_size: int, dtype, device, kernels: Kernels, grad: bool, teacher_scratch: bool = True):
        self.tok, self.tf_t, self.spec, self.math = tok, tf_t, spec, spec.math
        self.fill, self.fill_t, self.width, self.block = fill, fill_t, width, block
        self.chunk_size, self.dtype, self.device, self.kernels = chunk_size, dtype, device, kernels
        rows = min(chunk_size, tok.n)
        eager = kernels.in_place
        self.bufs = Buffers(rows, block, dtype, device, work=True, scratch=eager,
                            aux=eager and grad and tok.transform.softcap is not None)
        self.bufs_t = Buffers(rows, block, dtype, device, work=True, scratch=eager and teacher_scratch)
        self.no_label = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.fold = FOLD_KL and block < width and self.math.weighs is not None
        self.const = {}  # the kernels' constants (kernel_k, kernel_cap)
        self.teacher_weighs = self.math.weighs == "t"

    def k(self, a: int, b: int):
        """Both heads' per-row multipliers of rows ``[a, b)``."""
        return self.tok.k_rows(a, b), self.tf_t.k(self.tok.inv_t_rows(a, b))

    def raw(self, a, b, v0, v1):
        """Both raw blocks of rows ``[a, b)``, columns ``[v0, v1)``: ``(x_s, x_t, scratch_s, scratch_t, aux_s)``."""
        x, scratch, cap = self.bufs.get(b - a, v1 - v0)
        xt, scratch_t, _ = self.bufs_t.get(b - a, v1 - v0)
        self.fill(x, a, b, v0, v1)
        self.fill_t(xt, a, b, v0, v1)
        return x, xt, scratch, scratch_t, cap

    def _cross_to(self, c, st, stt, m, m_t, k, kt):
        """A KL's cross sum relative to the maxima ``m``, ``m_t`` (:func:`~chunked_entropy._stats.rescale_cross`)."""
        if self.teacher_weighs:
            return _stats.rescale_cross(c, stt, st, m_t, m, kt, k)
        return _stats.rescale_cross(c, st, stt, m, m_t, k, kt)

    def chunk_stats(self, a: int, b: int, group, want_entropy: bool, cap_single: bool = False):
        """Both heads' statistics of rows ``[a, b)``, merged over blocks and ``group`` (one MAX all-reduce, one
        all-gather for both: :func:`~chunked_entropy.parallel.reduce_stats_pair`). Returns ``(rows, ls_t,
        merged, merged_t, held, cross)``: the student's RowStats, the teacher's log-sum-exps, both merged
        BlockStats, the last blocks ``(x_s, x_t, st_s, st_t, aux_s)`` with each head's local statistics (eager:
        as offsets to their local maxima, the cap's derivative in ``aux_s`` with ``cap_single``; compiled: raw),
        and (a KL folded online, ``self.fold``) its cross sum over the whole vocabulary, else None."""
        tok, kernels = self.tok, self.kernels
        k, kt = self.k(a, b)
        target, no_label = tok.target[a:b], self.no_label[: b - a]
        st = stt = cross = None
        for v0, v1 in chunks(self.width, self.block):
            x, xt, scratch, scratch_t, cap = self.raw(a, b, v0, v1)
            # the kernels' constants filled once a walk (kernel_k, kernel_cap); the eager ones' offsets in x, xt
            local = kernels.block_stats(x, x, scratch, cap if cap_single else None, tok.transform, k, target, v0,
                                        want_entropy, False, self.dtype, self.const)
            local_t = kernels.block_stats(xt, xt, scratch_t, None, self.tf_t, kt, no_label, v0, False, False,
                                          self.dtype, self.const)
            prev, prev_t = st, stt
            st, stt = _stats.merge_stats(st, local, k), _stats.merge_stats(stt, local_t, kt)
            if self.fold:
                c = kernels.pair_cross(x, xt, tok.transform, k, local.m, self.tf_t, kt, local_t.m, self.dtype,
                                       self.const, scratch, scratch_t, self.teacher_weighs)
                cross = c if prev is None else (self._cross_to(cross, prev, prev_t, st.m, stt.m, k, kt)
                                                + self._cross_to(c, local, local_t, st.m, stt.m, k, kt))
        if self.fold:  # the cross sum rides in the statistics' gather
            merged, merged_t, cross = reduce_stats_pair(st, stt, group, k, kt, cross=(cross, self.teacher_weighs))
        else:  # the same arithmetic for both heads
            merged, merged_t = reduce_stats_pair(st, stt, group, k, kt)
        rows = _stats.RowStats.from_block(merged, k)
        ls_t = _stats.RowStats.from_block(merged_t, kt).ls
        return rows, ls_t, merged, merged_t, (x, xt, st, stt, cap), cross

    def chunk_sums(self, a: int, b: int, group, rows, ls_t, merged, merged_t, held, cross, keep_parts: bool):
        """The divergence's per-row sums of rows ``[a, b)`` over the whole vocabulary and ``group`` (one SUM
        all-reduce): ``(PairRows of the chunk, parts)``. A KL folded online: from its ``cross`` sum (no pass, no
        collective); else from the blocks still ``held`` when the vocabulary is one block, or from each block
        filled again; ``parts`` (one block, ``keep_parts``): what the kernels' ``pair_grad`` may read instead of
        the blocks (the eager kernels' :meth:`~chunked_entropy._divergence.DivergenceMath.grad_from_parts`)."""
        kernels, tf, tf_t, dtype, const = self.kernels, self.tok.transform, self.tf_t, self.dtype, self.const
        if cross is not None:
            s_s, s_t = merged.ones + merged.rest, merged_t.ones + merged_t.rest
            div = (self.math.folded(cross, s_t, ls_t, rows.ls) if self.teacher_weighs
                   else self.math.folded(cross, s_s, rows.ls, ls_t))
            return _divergence.PairRows(merged_t.m, ls_t, div, div if self.spec.needs_aux else None), None
        k, kt = self.k(a, b)
        m, m_t = merged.m, merged_t.m
        parts = None
        if self.block >= self.width:  # the blocks are held: relative to the merged maxima
            x, xt, st, stt, _ = held
            kernels.pair_held(x, xt, st, stt, merged, merged_t, k, kt)
            div, aux, parts = kernels.pair_terms(self.spec, x, xt, tf, k, m, rows.ls, tf_t, kt, m_t, ls_t, dtype,
                                                 const)
            parts = parts if keep_parts else None
        else:
            div = aux = None
            for v0, v1 in chunks(self.width, self.block):
                x, xt, _, _, _ = self.raw(a, b, v0, v1)
                kernels.pair_ready(x, xt, None, tf, k, m, tf_t, kt, m_t, cap_out=False)
                d, ka, _ = kernels.pair_terms(self.spec, x, xt, tf, k, m, rows.ls, tf_t, kt, m_t, ls_t, dtype, const)
                div = d if div is None else div + d
                aux = ka if aux is None else aux + ka
        if not self.spec.needs_aux:
            aux = None
        sums = all_reduce_sum_(torch.stack([div] if aux is None else [div, aux]), group)
        div, aux = sums[0], (sums[1] if aux is not None else (sums[0] if self.spec.needs_aux else None))
        return _divergence.PairRows(merged_t.m, ls_t, div, aux), parts

    def block_grad(self, a, b, v0, v1, rows, here, scale, co=None, held=None, parts=None):
        """The gradient w.r.t. the student's raw logits of one block (in the student's buffer): ``scale *
        dD/dx_s`` (``scale``: ``[b - a]``, the upstream gradient times ``kz``) plus, with ``co``, the
        student's log-prob / entropy terms. ``held``: the chunk's blocks, still held (one vocabulary block),
        else both are filled again; ``parts``: what the divergence's sums of this block kept."""
        tok, tf, tf_t = self.tok, self.tok.transform, self.tf_t
        k, kt = self.k(a, b)
        if held is not None:
            x, xt, cap = held[0], held[1], held[4]
            scratch = None
        else:
            x, xt, scratch, _, cap = self.raw(a, b, v0, v1)
            self.kernels.pair_ready(x, xt, cap, tf, k, rows.m, tf_t, kt, here.m_t, cap_out=True)
        return self.kernels.pair_grad(self.spec, x, xt, tf, k, rows, tok.target[a:b], v0, co, tf_t, kt, here, scale,
                                      self.dtype, self.const, scratch, cap, parts)


def _store_pair(stats: _stats.RowStats, pair: "_divergence.PairRows", rows, here, a: int, b: int) -> None:
    _store(stats, rows, a, b)
    for dst, src in zip(pair, here, strict=True):
        if dst is not None:
            dst[a:b] = src


def saved_pair_rows(stats: _stats.RowStats, pair: "_divergence.PairRows") -> tuple:
    """The rows a divergence's Function saves for its backward: the student's statistics and the pair's."""
    return (stats.m, stats.ls, stats.ws, pair.m_t, pair.ls_t, pair.div, pair.aux)


def pair_rows_from_saved(t) -> tuple:
    """:func:`saved_pair_rows`'s tensors back as ``(RowStats, PairRows)``."""
    m, ls, ws, m_t, ls_t, div, aux = t
    return _stats.RowStats(m, ls, ws, None, None), _divergence.PairRows(m_t, ls_t, div, aux)


def new_pair_rows(n: int, spec, dtype, device) -> "_divergence.PairRows":
    """Full-length :class:`~chunked_entropy._divergence.PairRows` for the pair walks to fill."""
    new = lambda: torch.empty(n, dtype=dtype, device=device)  # noqa: E731
    return _divergence.PairRows(new(), new(), new(), new() if spec.needs_aux else None)


def pair_row_stats(tok: Tokens, tf_t, spec, fill: Fill, fill_t: Fill, plan: Plan, *, width: int, dtype,
                   device) -> tuple:
    """Forward of a divergence between two heads: ``(stats, pair)``, the student's
    :class:`~chunked_entropy._stats.RowStats` and the :class:`~chunked_entropy._divergence.PairRows` of every row.

    Per chunk: both blocks of each vocabulary block (two projections), each model's statistics merged over
    blocks and ``group`` (both models' together: one MAX all-reduce and one all-gather,
    :func:`~chunked_entropy.parallel.reduce_stats_pair`); then the divergence's sums (one SUM all-reduce):
    from the blocks still held when the vocabulary is one block, else from each block filled again. Three
    collectives per chunk under a group. ``plan.kernels``: the kernels the blocks go through (see :class:`_PairWalk`).
    """
    block, chunk_size, group, want_entropy, kernels = (plan.vocab_chunk_size, plan.chunk_size, plan.group,
                                                       plan.want.entropy, plan.kernels)
    walk = _PairWalk(tok, tf_t, spec, fill, fill_t, width=width, block=block, chunk_size=chunk_size, dtype=dtype,
                     device=device, kernels=kernels, grad=False)
    stats = new_row_stats(tok.n, _stats.Want(want_entropy, False), dtype, device)
    pair = new_pair_rows(tok.n, spec, dtype, device)
    for a, b in chunks(tok.n, chunk_size):
        rows, ls_t, merged, merged_t, held, cross = walk.chunk_stats(a, b, group, want_entropy)
        here, _ = walk.chunk_sums(a, b, group, rows, ls_t, merged, merged_t, held, cross, keep_parts=False)
        _store_pair(stats, pair, rows, here, a, b)
    return stats, pair


def pair_loss_grad_blocks(
    tok: Tokens, tf_t, spec, fill: Fill, fill_t: Fill, plan: Plan, *, width: int, weights: torch.Tensor,
    stats: _stats.RowStats, pair: "_divergence.PairRows", dtype, device,
) -> Iterator[tuple]:
    """Forward of a loss that is a weighted sum of the rows' divergences, ``sum_i weights_i D_i`` (the
    weights, ``[N]``, known before the walk): :func:`pair_row_stats`'s walk that also yields ``(a, b, v0, v1,
    g)`` as :func:`grad_blocks` does, the student's logit gradient formed in the same walk, and fills
    ``stats`` and ``pair`` (from :func:`new_row_stats`, :func:`new_pair_rows`) on the way.

    One vocabulary block: each chunk's blocks are filled once (statistics, sums and gradient from the blocks
    held); with vocabulary blocks, three times (statistics, sums, gradient). Three collectives per chunk.
    """
    block, chunk_size, group, want_entropy, kernels = (plan.vocab_chunk_size, plan.chunk_size, plan.group,
                                                       plan.want.entropy, plan.kernels)
    walk = _PairWalk(tok, tf_t, spec, fill, fill_t, width=width, block=block, chunk_size=chunk_size, dtype=dtype,
                     device=device, kernels=kernels, grad=True)
    single = block >= width
    for a, b in chunks(tok.n, chunk_size):
        rows, ls_t, merged, merged_t, held, cross = walk.chunk_stats(
            a, b, group, want_entropy, cap_single=single and tok.transform.softcap is not None)
        here, parts = walk.chunk_sums(a, b, group, rows, ls_t, merged, merged_t, held, cross, keep_parts=single)
        _store_pair(stats, pair, rows, here, a, b)
        scale = tok.scaled(weights[a:b], a, b)
        if single:
            yield a, b, 0, width, walk.block_grad(a, b, 0, width, rows, here, scale, held=held, parts=parts)
            parts = held = None
        else:
            for v0, v1 in chunks(width, block):
                yield a, b, v0, v1, walk.block_grad(a, b, v0, v1, rows, here, scale)


def pair_grad_blocks(
    tok: Tokens, tf_t, spec, fill: Fill, fill_t: Fill, plan: Plan, *, width: int, stats: _stats.RowStats,
    pair: "_divergence.PairRows", grads, dtype, device, block: Optional[int] = None, vocab_outer: bool = False,
) -> Iterator[tuple]:
    """Backward of :func:`pair_row_stats`: yield ``(a, b, v0, v1, g)``, the gradient w.r.t. the student's raw
    logits of each block, both blocks filled again (two projections). ``grads``: the upstream gradients of
    ``(divergence, log_probs, entropy)`` (None: no term). ``vocab_outer``: vocabulary blocks outermost, as in
    :func:`grad_blocks`. No collective."""
    block = plan.vocab_chunk_size if block is None else block
    chunk_size, kernels = plan.chunk_size, plan.kernels
    n = tok.n
    g_div, g_lp, g_h = (None if g is None else g.reshape(-1).to(dtype) for g in grads)
    walk = _PairWalk(tok, tf_t, spec, fill, fill_t, width=width, block=block, chunk_size=chunk_size, dtype=dtype,
                     device=device, kernels=kernels, grad=True, teacher_scratch=False)

    def chunk(a, b):
        rows, here = stats.rows(a, b), pair.rows(a, b)
        co = tok.coefficients(a, b, None if g_lp is None else g_lp[a:b], None if g_h is None else g_h[a:b], None)
        scale = tok.scaled(torch.zeros(b - a, dtype=dtype, device=device) if g_div is None else g_div[a:b], a, b)
        return rows, here, co, scale

    def block_grad(a, b, v0, v1, parts):
        rows, here, co, scale = parts
        return walk.block_grad(a, b, v0, v1, rows, here, scale, co=co)

    yield from _gradient_walk(n, width, block, chunk_size, vocab_outer, chunk, block_grad)
