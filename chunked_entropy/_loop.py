"""The chunk loop, shared by the logits path and the fused head.

Both paths walk the tokens in chunks of ``chunk_size`` rows and the vocabulary
shard in blocks of ``block`` columns; the only difference is where a block's
raw logits come from, which the caller passes as ``fill(x, a, b, v0, v1)``:
write the logits of rows ``[a, b)`` and shard columns ``[v0, v1)`` into ``x``
(a buffer of ours). The math on each block is :mod:`chunked_entropy._stats`.

With ``compiled`` set to a kernels object of :mod:`chunked_entropy._kernels`
(the compiled or the Triton kernels: its ``stats`` and ``grad``; None for the
eager ones), the blocks go through those kernels, which only read a block: the
logits path then passes ``view(a, b, v0, v1)``, its own rows, and nothing is
copied.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional

import torch

from . import _at, _divergence, _keep, _stats
from ._inputs import Tokens, chunks
from ._kernels import Kernels
from .parallel import all_reduce_sum_, reduce_stats, reduce_stats_pair

Fill = Callable[[torch.Tensor, int, int, int, int], object]
View = Optional[Callable[[int, int, int, int], torch.Tensor]]


def _read(fill: Fill, view: View, x, a: int, b: int, v0: int, v1: int) -> torch.Tensor:
    """The block to read: the caller's own view when it has one, else ``x`` filled."""
    if view is not None:
        return view(a, b, v0, v1)
    fill(x, a, b, v0, v1)
    return x


class Buffers:
    """Reusable flat storage for ``[rows, cols]`` blocks: the working buffer, the ``exp``
    scratch and (backward with softcap) the cap's derivative.

    Allocated once per forward or backward (``chunk_size * block`` elements
    each) and reused for every block.
    """

    def __init__(self, rows: int, cols: int, dtype, device, *, work: bool, scratch: bool, aux: bool = False):
        size = rows * cols
        new = lambda on: torch.empty(size, dtype=dtype, device=device) if on else None  # noqa: E731
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
    kr = _stats.RowStats.from_block(kst._replace(zl=st.zl), k)  # the label's u is the whole row's
    if not kept.of_kept:
        kr = kr._replace(ws=None, s2=None)
    return rows.with_kept(kr, count > 0), st


def _block_at(at, at_ids, target, a, b, v0, z, tf):
    """Distillation's entries in a block and, with a soft-cap, their raw logits (read before the block is
    overwritten); Nones without distillation. Static shapes: no host sync."""
    if at_ids is None:
        return None, None
    ent = at.block_entries(at_ids[a:b], target, v0, z.shape[1])
    if tf.softcap is None:
        return ent, None
    wide = lambda t: t if t.dtype in (torch.float32, torch.float64) else t.float()  # noqa: E731
    return ent, (wide(z.gather(1, ent[0])), wide(z.gather(1, ent[2].unsqueeze(1)).squeeze(1)))


def _block_kept(kept, ent, z, v0, tf, k, dtype):
    """The kept entries of a block (gathered before the block is overwritten), or None without replay."""
    return None if kept is None else _keep.gather(z, ent, v0, tf, dtype)


def row_stats(
    tok: Tokens, fill: Fill, *, width: int, block: int, chunk_size: int, group,
    want: _stats.Want, dtype, device, compiled: Kernels = None, view: View = None,
) -> _stats.RowStats:
    """Forward: the per-token statistics of every row, merged over blocks and over ``group``.

    With sampling replay (``tok.keep``) also those of each row's kept set.
    """
    n, kept = tok.n, tok.keep
    view = view if compiled else None
    bufs = Buffers(min(chunk_size, n), block, dtype, device, work=view is None,
                   scratch=want.scratch and not compiled)
    out = new_row_stats(n, want, dtype, device, kept)
    at = tok.at
    if at is not None:
        at.start(n, dtype, device)
    for a, b in chunks(n, chunk_size):
        k, target = tok.k_rows(a, b), tok.target[a:b]
        ent = None if kept is None else kept.chunk(a, b, n, chunk_size)
        st = kst = count = cand = None
        for v0, v1 in chunks(width, block):
            x, scratch, _ = bufs.get(b - a, v1 - v0)
            z = _read(fill, view, x, a, b, v0, v1)
            g = _block_kept(kept, ent, z, v0, tok.transform, k, dtype)
            if at is not None:  # distillation's ids and top-k, read before the block is overwritten
                cand = at.block(z, a, b, v0, cand)
            if compiled:
                blk = compiled.stats(z, tok.transform, k, target, v0, want.entropy, want.sum_pi_squared, dtype)
            else:
                blk = _stats.block_stats(
                    z, tok.transform, k, target, v0, scratch, want_w=want.entropy, want_q=want.sum_pi_squared
                )
            st = _stats.merge_stats(st, blk, k)
            if g is not None:
                kb, kc = _keep.block_stats(g, ent, b - a, k, dtype)
                kst = _stats.merge_stats(kst, kb, k)
                count = kc if count is None else count + kc
        _store(out, _rows_of_chunk(st, kst, count, group, k, kept)[0], a, b)
        if at is not None:
            at.chunk_done(a, b, cand)
    if at is not None:
        at.finish(group)
    return out


def grad_blocks(
    tok: Tokens, fill: Fill, *, width: int, block: int, chunk_size: int,
    stats: _stats.RowStats, grads, dtype, device,
    into: Optional[Callable[[int, int], torch.Tensor]] = None, compiled: Kernels = None, view: View = None,
    at_grads: Optional[torch.Tensor] = None, vocab_outer: bool = False,
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
    :mod:`chunked_entropy._at`). ``vocab_outer``: the vocabulary blocks are
    walked outermost, each block's chunks in order (the fused head's
    half-precision weight gradient, one matmul per block:
    :func:`chunked_entropy._blocks.linear_grads`); the per-token coefficients
    are then formed once per block and chunk (a few vectors of the chunk).
    """
    n, kept, at = tok.n, tok.keep, tok.at
    at_ids = None if at_grads is None else at.all_ids()
    g_lp, g_h, g_q = (None if g is None else g.reshape(-1).to(dtype) for g in grads)
    softcap = tok.transform.softcap is not None
    view = view if compiled else None
    bufs = Buffers(
        min(chunk_size, n), block, dtype, device, work=into is None or (compiled and view is None),
        scratch=(g_h is not None or g_q is not None) and not compiled, aux=softcap and not compiled,
    )

    def chunk(a, b):
        """What the gradient of rows ``[a, b)`` reads: ``_refilled_grad``'s keywords."""
        co = tok.coefficients(a, b, *(None if g is None else g[a:b] for g in (g_lp, g_h, g_q)))
        rows = stats.rows(a, b)
        ent = co_k = sparse = None
        if kept is not None:
            ent = kept.chunk(a, b, n, chunk_size)
            co, co_k = _keep.split(co, rows.truncated, kept.of_kept)
        if at_ids is not None:  # the dense part of the ids' gradient rides on the log-prob's coefficient
            kz = tok.transform.kz(tok.inv_t_rows(a, b))
            coef = at_grads[a:b] if kz is None else at_grads[a:b] * kz
            total = coef.sum(dim=1)
            co = co._replace(c=total if co.c is None else co.c + total)
            sparse = (at_ids, coef, total)
        return dict(rows=rows, co=co, ent=ent, co_k=co_k, at=sparse)

    def block_grad(a, b, v0, v1, parts):
        return _refilled_grad(tok, fill, view, bufs, a, b, v0, v1, parts["rows"], parts["co"], dtype,
                              compiled=compiled, into=into, ent=parts["ent"], co_k=parts["co_k"], at=parts["at"])

    yield from _gradient_walk(n, width, block, chunk_size, vocab_outer, chunk, block_grad)


def _gradient_walk(n: int, width: int, block: int, chunk_size: int, vocab_outer: bool, chunk, block_grad):
    """Yield ``(a, b, v0, v1, block_grad(a, b, v0, v1, chunk(a, b)))`` over every chunk of rows and vocabulary
    block: chunks outermost (``chunk(a, b)``, what a chunk's gradients read, formed once per chunk), or
    vocabulary blocks outermost (formed once per block and chunk)."""
    if vocab_outer:
        for v0, v1 in chunks(width, block):
            for a, b in chunks(n, chunk_size):
                yield a, b, v0, v1, block_grad(a, b, v0, v1, chunk(a, b))
        return
    for a, b in chunks(n, chunk_size):
        parts = chunk(a, b)
        for v0, v1 in chunks(width, block):
            yield a, b, v0, v1, block_grad(a, b, v0, v1, parts)


def _refilled_grad(tok: Tokens, fill: Fill, view: View, bufs: Buffers, a, b, v0, v1, rows, co, dtype, *,
                   compiled: Kernels, into, ent=None, co_k=None, at=None) -> torch.Tensor:
    """The gradient w.r.t. the raw logits of rows ``[a, b)``, columns ``[v0, v1)``, the block filled again,
    from the rows' finished statistics and coefficients; with replay's and distillation's sparse terms
    (``at``: ``(ids, coefficients, their sums)``)."""
    kept, k, target = tok.keep, tok.k_rows(a, b), tok.target[a:b]
    at_ids = None if at is None else at[0]
    x, scratch, aux = bufs.get(b - a, v1 - v0)
    if compiled:
        z = _read(fill, view, x, a, b, v0, v1)
        gk = _block_kept(kept, ent, z, v0, tok.transform, k, dtype)
        ea, ra = _block_at(tok.at, at_ids, target, a, b, v0, z, tok.transform)
        out = x if into is None else into(a, b)
        g = compiled.grad(z, out, tok.transform, k, rows, target, v0, co, dtype)
    else:
        if into is not None:
            x = into(a, b)
        fill(x, a, b, v0, v1)
        gk = _block_kept(kept, ent, x, v0, tok.transform, k, dtype)
        ea, ra = _block_at(tok.at, at_ids, target, a, b, v0, x, tok.transform)
        g = _stats.block_grad(x, tok.transform, k, rows, target, v0, co, scratch, aux)
    if gk is not None:
        _keep.add_grad_(g, gk, ent, rows.kept, rows.truncated, co_k, tok.transform, k)
    if ea is not None:
        _at.add_grad_(g, ra, ea, at[1], at[2], tok.transform)
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
    tok: Tokens, fill: Fill, *, width: int, block: int, chunk_size: int, group, want: _stats.Want,
    token_grads: TokenGrads, stats: _stats.RowStats, dtype, device,
    into: Optional[Callable[[int, int], torch.Tensor]] = None, compiled: Kernels = None, view: View = None,
    span: Optional[int] = 1, grad_block: Optional[int] = None,
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
    refills each block. ``grad_block``: the same two passes, the gradient pass
    walking vocabulary blocks of that width outermost (``vocab_outer`` of
    :func:`grad_blocks`: a half-precision weight's gradient, one matmul per
    block).
    """
    n, kept = tok.n, tok.keep
    if block < width or grad_block is not None:
        full = row_stats(tok, fill, width=width, block=block, chunk_size=chunk_size, group=group,
                         want=want, dtype=dtype, device=device, compiled=compiled, view=view)
        _store(stats, full, 0, n)
        if span == 1:
            parts = [token_grads(a, b, stats.rows(a, b).log_probs()) for a, b in chunks(n, chunk_size)]
        else:
            parts = [token_grads(0, n, stats.rows(0, n).log_probs())]
        # None: that output has no term
        ups = [None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True)]
        yield from grad_blocks(tok, fill, width=width, block=block if grad_block is None else grad_block,
                               chunk_size=chunk_size, stats=stats, grads=(ups[0], ups[1], None), dtype=dtype,
                               device=device, into=into, compiled=compiled, view=view,
                               vocab_outer=grad_block is not None)
        return
    chunk_size, group_size = _grouping(n, span, chunk_size)
    softcap = tok.transform.softcap is not None
    view = view if compiled else None
    bufs = Buffers(min(chunk_size, n), width, dtype, device, work=into is None or (compiled and view is None),
                   scratch=not compiled, aux=softcap and not compiled)

    def coefficients(a, b, g0, ups, rows):
        co = tok.coefficients(a, b, *(None if u is None else u[a - g0:b - g0] for u in ups), None)
        return (co, None) if kept is None else _keep.split(co, rows.truncated, kept.of_kept)

    for g0, g1 in chunks(n, group_size):
        for a, b in chunks(g1 - g0, chunk_size):  # statistics, chunk by chunk; the last chunk's block is kept
            a, b = g0 + a, g0 + b
            k, target = tok.k_rows(a, b), tok.target[a:b]
            ent = None if kept is None else kept.chunk(a, b, n, chunk_size)
            x, scratch, aux = bufs.get(b - a, width)
            if compiled:  # the kernels only read the block: statistics, then the gradient, from the same one
                z = _read(fill, view, x, a, b, 0, width)
                gk = _block_kept(kept, ent, z, 0, tok.transform, k, dtype)
                local = compiled.stats(z, tok.transform, k, target, 0, want.entropy, want.sum_pi_squared, dtype)
            else:
                if into is not None:
                    x = into(a, b)
                fill(x, a, b, 0, width)
                gk = _block_kept(kept, ent, x, 0, tok.transform, k, dtype)
                local = _stats.block_stats(x, tok.transform, k, target, 0, scratch, want_w=want.entropy,
                                           want_q=want.sum_pi_squared, aux=aux)
            kb, kc = (None, None) if gk is None else _keep.block_stats(gk, ent, b - a, k, dtype)
            rows, merged = _rows_of_chunk(local, kb, kc, group, k, kept)
            _store(stats, rows, a, b)
        ups = token_grads(g0, g1, stats.rows(g0, g1).log_probs())
        co, co_k = coefficients(a, b, g0, ups, rows)  # the last chunk, from its kept block
        if compiled:
            out = x if into is None else into(a, b)
            g = compiled.grad(z, out, tok.transform, k, rows, target, 0, co, dtype)
        else:
            y = _stats.shift_offsets_(x, local.m, merged.m, k) if merged is not local else x
            g = _stats.grad_from_offsets_(y, tok.transform, rows, target, 0, co, scratch, aux)
        if gk is not None:
            _keep.add_grad_(g, gk, ent, rows.kept, rows.truncated, co_k, tok.transform, k)
        yield a, b, 0, width, g
        for a, b in reversed(list(chunks(g1 - g0, chunk_size))[:-1]):  # the others, filled again
            a, b = g0 + a, g0 + b
            rows = stats.rows(a, b)
            co, co_k = coefficients(a, b, g0, ups, rows)
            ent = None if kept is None else kept.chunk(a, b, n, chunk_size)
            yield a, b, 0, width, _refilled_grad(tok, fill, view, bufs, a, b, 0, width, rows, co, dtype,
                                                 compiled=compiled, into=into, ent=ent, co_k=co_k)


# ----------------------------------------------------------------------------- two heads: a divergence
#
# The same walk with a second projection per block: the student's block (``fill``, the rows' Tokens ``tok``
# with its transform) and the teacher's (``fill_t``, transform ``tf_t``, the same temperature). Each model's
# statistics are the ones above; the divergence's per-row sums are the math of chunked_entropy._divergence.


def _pair_block(tok: Tokens, tf_t, fill, fill_t, bufs, bufs_t, a, b, v0, v1, *, m=None, aux=False):
    """Both blocks of rows ``[a, b)``, columns ``[v0, v1)``: as filled (``m`` None: for their statistics), or
    as offsets to the rows' maxima ``m = (m_s, m_t)``. Returns ``(x_s, x_t, scratch_s, scratch_t, aux_s)``."""
    x, scratch, cap = bufs.get(b - a, v1 - v0)
    xt, scratch_t, _ = bufs_t.get(b - a, v1 - v0)
    fill(x, a, b, v0, v1)
    fill_t(xt, a, b, v0, v1)
    if m is not None:
        inv_t = tok.inv_t_rows(a, b)
        tok.transform.to_u_(x)
        if aux and tok.transform.softcap is not None:
            torch.mul(x, x, out=cap).neg_().add_(1.0)
        _stats.offsets_(x, m[0], tok.k_rows(a, b))
        _stats.offsets_(tf_t.to_u_(xt), m[1], tf_t.k(inv_t))
    return x, xt, scratch, scratch_t, cap


def _divergence_grad_block(tok: Tokens, spec, y, yt, rows, pair, scale, a, b, v0, cap, co=None, scratch=None,
                           parts=None):
    """The gradient w.r.t. the student's raw logits of one block, from both offsets blocks (``y`` is
    overwritten with it): ``scale * dD/dx_s`` (``scale``: ``[b - a]``, the upstream gradient times ``kz``)
    plus, with ``co``, the student's log-prob / entropy terms. ``parts``: what the divergence's sums of this
    block kept (then ``yt`` is not read)."""
    if parts is not None:
        gd = _divergence.grad_from_parts(parts, y, rows.ls, pair.aux, spec)
    else:
        gd = _divergence.divergence_grad(y, yt, rows.ls, pair.ls_t, pair.aux, spec)
    gd.mul_(scale.unsqueeze(1))
    if co is not None and (co.c is not None or co.b is not None):
        _stats.grad_from_offsets_(y, _stats.Transform(), rows, tok.target[a:b], v0, co, scratch, None)
        y.add_(gd)
    else:
        y.copy_(gd)
    if tok.transform.softcap is not None:
        y.mul_(cap)
    return y


def pair_row_stats(
    tok: Tokens, tf_t, spec, fill: Fill, fill_t: Fill, *, width: int, block: int, chunk_size: int, group,
    want_entropy: bool, dtype, device, out: _stats.RowStats, pair: "_divergence.PairRows",
    weights: Optional[torch.Tensor] = None,
) -> Iterator[tuple]:
    """Forward of a divergence between two heads: fill ``out`` (the student's RowStats) and ``pair``.

    A generator: it yields nothing unless ``weights`` (``[N]``, the upstream gradient of each row's
    divergence, known before the walk: a loss that is a weighted sum) is given; then it yields
    ``(a, b, v0, v1, g)`` as :func:`grad_blocks` does, the student's logit gradient formed in this walk.
    Per chunk: both blocks of each vocabulary block (two projections), each model's statistics merged over
    blocks and ``group`` (both models' together, with the same arithmetic: one MAX all-reduce and one
    all-gather, :func:`~chunked_entropy.parallel.reduce_stats_pair`); then the divergence's sums (one SUM all-reduce):
    from the blocks still held when the vocabulary is one block, else from each block filled again.
    """
    n = tok.n
    single = block >= width
    cap_aux = weights is not None and tok.transform.softcap is not None
    bufs = Buffers(min(chunk_size, n), block, dtype, device, work=True, scratch=True, aux=cap_aux)
    bufs_t = Buffers(min(chunk_size, n), block, dtype, device, work=True, scratch=True)
    no_label = torch.full((min(chunk_size, n),), -1, dtype=torch.int64, device=device)
    for a, b in chunks(n, chunk_size):
        k, kt, target = tok.k_rows(a, b), tf_t.k(tok.inv_t_rows(a, b)), tok.target[a:b]
        st = stt = None
        for v0, v1 in chunks(width, block):
            x, xt, scratch, scratch_t, cap = _pair_block(tok, tf_t, fill, fill_t, bufs, bufs_t, a, b, v0, v1)
            local = _stats.block_stats(x, tok.transform, k, target, v0, scratch, want_w=want_entropy, want_q=False,
                                       aux=cap if cap_aux and single else None)
            local_t = _stats.block_stats(xt, tf_t, kt, no_label[: b - a], v0, scratch_t, want_w=False, want_q=False)
            st, stt = _stats.merge_stats(st, local, k), _stats.merge_stats(stt, local_t, kt)
        merged, merged_t = reduce_stats_pair(st, stt, group, k, kt)  # the same arithmetic for both heads
        rows = _stats.RowStats.from_block(merged, k)
        ls_t = _stats.RowStats.from_block(merged_t, kt).ls
        if single:  # the blocks are held: their offsets to the merged maxima
            if merged is not st:
                _stats.shift_offsets_(x, st.m, merged.m, k)
                _stats.shift_offsets_(xt, stt.m, merged_t.m, kt)
            div, aux, parts = _divergence.divergence_terms(x, xt, rows.ls, ls_t, spec)
            if weights is None:
                parts = None
        else:
            div = aux = None
            for v0, v1 in chunks(width, block):
                x, xt, *_ = _pair_block(tok, tf_t, fill, fill_t, bufs, bufs_t, a, b, v0, v1,
                                        m=(merged.m, merged_t.m))
                d, ka, _ = _divergence.divergence_terms(x, xt, rows.ls, ls_t, spec)
                div = d if div is None else div + d
                aux = ka if aux is None else aux + ka
        sums = all_reduce_sum_(torch.stack([div] if aux is None else [div, aux]), group)
        div, aux = sums[0], (sums[1] if aux is not None else (sums[0] if spec.needs_aux else None))
        _store(out, rows, a, b)
        here = _divergence.PairRows(merged_t.m, ls_t, div, aux)
        for dst, src in zip(pair, here, strict=True):
            if dst is not None:
                dst[a:b] = src
        if weights is None:
            continue
        scale = _scaled(weights[a:b], tok, a, b)
        if single:
            yield a, b, 0, width, _divergence_grad_block(tok, spec, x, xt, rows, here, scale, a, b, 0, cap,
                                                         parts=parts)
            parts = None
        else:
            for v0, v1 in chunks(width, block):
                x, xt, _, _, cap = _pair_block(tok, tf_t, fill, fill_t, bufs, bufs_t, a, b, v0, v1,
                                               m=(merged.m, merged_t.m), aux=True)
                yield a, b, v0, v1, _divergence_grad_block(tok, spec, x, xt, rows, here, scale, a, b, v0, cap)


def _scaled(g: torch.Tensor, tok: Tokens, a: int, b: int) -> torch.Tensor:
    """``g * kz`` for rows ``[a, b)``: an upstream gradient times ``dx/dz`` up to the cap's derivative."""
    kz = tok.transform.kz(tok.inv_t_rows(a, b))
    if kz is None:
        return g
    return g * (kz.squeeze(1) if isinstance(kz, torch.Tensor) else kz)


def pair_grad_blocks(
    tok: Tokens, tf_t, spec, fill: Fill, fill_t: Fill, *, width: int, block: int, chunk_size: int,
    stats: _stats.RowStats, pair: "_divergence.PairRows", grads, dtype, device, vocab_outer: bool = False,
) -> Iterator[tuple]:
    """Backward of :func:`pair_row_stats`: yield ``(a, b, v0, v1, g)``, the gradient w.r.t. the student's raw
    logits of each block, both blocks filled again (two projections). ``grads``: the upstream gradients of
    ``(divergence, log_probs, entropy)`` (None: no term). ``vocab_outer``: vocabulary blocks outermost, as in
    :func:`grad_blocks`."""
    n = tok.n
    g_div, g_lp, g_h = (None if g is None else g.reshape(-1).to(dtype) for g in grads)
    bufs = Buffers(min(chunk_size, n), block, dtype, device, work=True, scratch=True,
                   aux=tok.transform.softcap is not None)
    bufs_t = Buffers(min(chunk_size, n), block, dtype, device, work=True, scratch=False)

    def chunk(a, b):
        rows, here = stats.rows(a, b), pair.rows(a, b)
        co = tok.coefficients(a, b, None if g_lp is None else g_lp[a:b], None if g_h is None else g_h[a:b], None)
        scale = _scaled(torch.zeros(b - a, dtype=dtype, device=device) if g_div is None else g_div[a:b], tok, a, b)
        return rows, here, co, scale

    def block_grad(a, b, v0, v1, parts):
        rows, here, co, scale = parts
        x, xt, scratch, _, cap = _pair_block(tok, tf_t, fill, fill_t, bufs, bufs_t, a, b, v0, v1,
                                             m=(rows.m, here.m_t), aux=True)
        return _divergence_grad_block(tok, spec, x, xt, rows, here, scale, a, b, v0, cap, co=co, scratch=scratch)

    yield from _gradient_walk(n, width, block, chunk_size, vocab_outer, chunk, block_grad)
