"""The invariant mode's geometry: global vocabulary tiles, their statistics, and the one fixed merge tree.

Layer: the math's arrangement (beside :mod:`chunked_entropy._stats`, below the loop). With
``Chunking(invariant=True)`` the vocabulary is cut into global tiles of ``T`` columns (``Chunking.tile``):
tile ``t`` holds ids ``[t * T, (t + 1) * T)``, the last one ending on ``V``. Every rank's shard is a whole
number of tiles (:func:`tiles_for` refuses a shard that is not), so a tile is the same columns at every
tensor-parallel size, and:

- **A tile's statistics do not depend on the layout.** They are :func:`chunked_entropy._stats.block_stats`
  of the tile alone (the block seen as ``[rows * tiles, T]``: one row of that view is one row's tile), and
  torch's CPU reductions and elementwise ops along a row of at most 32768 elements give bits that depend on
  that row's values only (not on the rows beside it, their count, or where the row sits).
- **The merge order does not depend on the layout.** The tiles' statistics are merged
  (:func:`~chunked_entropy._stats.merge_stats`: an online softmax, exact up to its roundings) in one binary
  tree over the global tiles ``[0, K)``: a range of more than one tile splits at ``lo + ceil(len / 2)``. With
  a group of ``2**b`` ranks each rank's shard is a subtree (its range halves evenly ``b`` times), so each
  rank merges its own subtree, the ranks' roots are all-gathered
  (:func:`~chunked_entropy.parallel.all_gather_stack`: one all-gather a chunk in place of the default
  mode's two all-reduces) and every rank merges them through the tree's top in the same order. At TP 1 the
  same tree is merged on one rank. The statistics of a row are then bitwise the same at every TP size,
  chunk size and batch, and so is everything formed from them elementwise: the log-probs, the entropy,
  ``sum_pi_squared``, ``log_probs_at`` / ``top_k`` and the logits' gradient.
- **The fused head's sums follow the same tree.** The hidden states' gradient sums over the vocabulary: each
  tile's share is one fixed-shape matmul (:data:`ROWS` rows by ``T`` columns), the tiles' shares summed in
  the tree (a rank's subtree locally, the ranks' roots gathered and summed through the top);
  the weight's and the bias's gradients sum over the tokens in row tiles of :data:`ROWS` rows, in row order,
  so they do not depend on the chunk size (the chunks are whole row tiles).

What a chunk holds beyond the default mode: the tree's stack of partial statistics (a few ``[rows]`` vectors
per level, ``log2 K`` levels), and the per-tile vectors of one block (``6 * rows * tiles`` floats).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import _stats
from .parallel import all_gather_stack

#: The row tile of the fused head's fixed-shape matmuls in the invariant mode: every block of logits and of
#: their gradient is formed as matmuls of ``ROWS`` hidden rows (the last tile padded with zeros) by one tile
#: of ``T`` weight rows, so that a logit's bits depend on its own row and column alone; the chunks of the
#: fused head are a multiple of it.
ROWS = 128


@functools.lru_cache(maxsize=64)
def tree_nodes(k: int) -> frozenset:
    """The merge tree over tiles ``[0, k)``: the set of its inner nodes ``(lo, mid, hi)``; a range of more than one
    tile splits at ``mid = lo + ceil((hi - lo) / 2)``."""
    nodes, todo = set(), [(0, k)]
    while todo:
        lo, hi = todo.pop()
        if hi - lo > 1:
            mid = lo + (hi - lo + 1) // 2
            nodes.add((lo, mid, hi))
            todo += [(lo, mid), (mid, hi)]
    return frozenset(nodes)


def is_subtree(k: int, lo: int, hi: int) -> bool:
    """Whether tiles ``[lo, hi)`` are one subtree of the merge tree over ``[0, k)``."""
    return (lo, hi) == (0, k) or hi - lo == 1 or any(n[0] == lo and n[2] == hi for n in tree_nodes(k))


class TreeSum:
    """The merge tree evaluated as its leaves arrive in order: :meth:`push` a leaf (or a subtree's root) of
    range ``[lo, hi)``; two adjacent completed ranges that are siblings in the tree are combined at once
    (``combine(left, right)``), so at most one partial value per level is held."""

    def __init__(self, k: int, combine: Callable):
        self.k, self.combine, self.stack = k, combine, []

    def push(self, lo: int, hi: int, value) -> None:
        nodes = tree_nodes(self.k)
        while self.stack:
            plo, phi, left = self.stack[-1]
            if phi != lo or (plo, lo, hi) not in nodes:
                break
            self.stack.pop()
            lo, value = plo, self.combine(left, value)
        self.stack.append((lo, hi, value))

    def result(self, lo: int, hi: int):
        """The root of the subtree ``[lo, hi)`` whose leaves were all pushed."""
        if len(self.stack) != 1 or self.stack[0][:2] != (lo, hi):
            raise AssertionError(f"the merge tree holds {[s[:2] for s in self.stack]}, not the subtree {(lo, hi)}")
        return self.stack[0][2]


@dataclass(frozen=True)
class Tiles:
    """The tiles of one rank's vocabulary shard (``V_local`` columns, rank ``rank`` of ``world``)."""

    width: int
    v_local: int
    rank: int
    world: int

    @property
    def rows(self) -> int:
        """The fused head's row tile (:data:`ROWS`): its chunks are whole row tiles."""
        return ROWS

    @property
    def local(self) -> int:
        """Tiles on this rank (the last one partial where ``V_local`` is not a multiple: one rank only)."""
        return -(-self.v_local // self.width)

    @property
    def total(self) -> int:
        return self.local * self.world

    @property
    def first(self) -> int:
        """The global index of this rank's first tile."""
        return self.rank * self.local

    def block(self, v0: int, v1: int) -> int:
        """The global index of the first tile of shard columns ``[v0, v1)`` (``v0`` on a tile boundary)."""
        return self.first + v0 // self.width

    def stats_tree(self, k) -> TreeSum:
        """A chunk's merge tree of statistics (``k``: the rows' multiplier)."""
        return TreeSum(self.total, lambda a, b: _stats.merge_stats(a, b, k))

    def sum_tree(self) -> TreeSum:
        """A merge tree of plain sums (the fused head's hidden gradient)."""
        return TreeSum(self.total, lambda a, b: a.add_(b))


def tiles_for(tile: int, v_local: int, rank: int, world: int) -> Tiles:
    """The tiles of this rank's shard; refuses (ValueError naming ``Chunking.tile``, the rank, the shard's width and
    ``T``) a layout the invariant mode cannot merge in its fixed order."""
    if world > 1 and v_local % tile:
        raise ValueError(
            f"Chunking(invariant=True) needs every rank's vocabulary shard to be a whole number of tiles: rank {rank} "
            f"of {world} holds V_local={v_local} columns, not a multiple of Chunking.tile={tile}. Pad the vocabulary "
            f"to a multiple of tile x TP (Megatron's make_vocab_size_divisible_by), or set Chunking(tile=...) to a "
            "divisor of V_local that every layout you compare shares (e.g. V / 8 for TP 1, 2, 4 and 8)"
        )
    if world & (world - 1):
        raise ValueError(
            f"Chunking(invariant=True) needs a process_group of 1, 2, 4, 8, ... ranks (a power of two: each rank's "
            f"tiles are then one subtree of the fixed merge tree), got {world} ranks (this is rank {rank})"
        )
    return Tiles(tile, v_local, rank, world)


def _view_rows(t: torch.Tensor, n: int, k: int, width: int) -> torch.Tensor:
    """``t`` (``[n, k * width]``) as ``[n * k, width]``: a view where its strides allow, else a copy."""
    try:
        return t.view(n * k, width)
    except RuntimeError:
        return t.reshape(n * k, width)


def push_block_stats(tree: TreeSum, tiles: Tiles, x: torch.Tensor, tf, k, target: torch.Tensor, v0: int,
                     scratch: Optional[torch.Tensor], *, want_w: bool, want_q: bool,
                     src: Optional[torch.Tensor] = None, compiled=None, dtype=None) -> None:
    """Push the statistics of each tile of the ``[n, width]`` block ``x`` (shard columns ``[v0, v0 + width)``,
    ``v0`` on a tile boundary) into ``tree``, in order. ``x``, ``scratch`` and ``src`` as for
    :func:`chunked_entropy._stats.block_stats` (``x`` consumed), here of the block seen as ``[n * tiles, T]``
    (a partial last tile, the shard's tail at TP 1, on its own). ``compiled``: the compiled kernels' ``stats``
    (:mod:`chunked_entropy._kernels`) of that view of the raw block (``src``, else ``x``; read only), in
    ``dtype``. Allocates the per-tile vectors (``6 * n * tiles`` floats) and the tiled per-row inputs
    (``n * tiles`` labels and multipliers)."""
    n, width = x.shape
    t = tiles.width
    full, tail = divmod(width, t)
    first = tiles.block(v0, v0 + width)
    parts = [(0, full, t)] if full else []
    if tail:
        parts.append((full * t, 1, tail))
    for c0, count, w in parts:
        cols = slice(c0, c0 + count * w)
        starts = torch.arange(count, device=target.device) * w + (v0 + c0)
        tgt = (target.unsqueeze(1) - starts.unsqueeze(0) + v0).reshape(-1)  # v0 + each row's column in its tile
        kk = k.repeat_interleave(count, dim=0) if isinstance(k, torch.Tensor) else k
        if compiled is not None:
            raw = x if src is None else src
            st = compiled.stats(_view_rows(raw[:, cols], n, count, w), tf, kk, tgt, v0, want_w, want_q, dtype)
        else:
            st = _stats.block_stats(
                _view_rows(x[:, cols], n, count, w), tf, kk, tgt, v0,
                None if scratch is None else _view_rows(scratch[:, cols], n, count, w), want_w=want_w, want_q=want_q,
                src=None if src is None else _view_rows(src[:, cols], n, count, w),
            )
        per_tile = [None if f is None else f.view(n, count).t() for f in st]  # [count, n] each
        for j in range(count):
            g = first + c0 // t + j
            tree.push(g, g + 1, _stats.BlockStats(*(None if f is None else f[j] for f in per_tile)))


def merged_stats(tree: TreeSum, tiles: Tiles, group, k) -> _stats.BlockStats:
    """A chunk's statistics over the whole vocabulary, the same bits on every rank and at every TP size: this
    rank's subtree (all its tiles pushed into ``tree``), and under a group the ranks' subtrees all-gathered
    (:func:`~chunked_entropy.parallel.all_gather_stack`) and merged through the tree's top, in rank order."""
    lo, hi = tiles.first, tiles.first + tiles.local
    root = tree.result(lo, hi)
    if tiles.world == 1:
        return root
    top = tiles.stats_tree(k)
    for r, st in enumerate(all_gather_stack(root, group)):
        top.push(r * tiles.local, (r + 1) * tiles.local, st)
    return top.result(0, tiles.total)


def summed(t: torch.Tensor, tiles: Tiles, group, rows: int) -> torch.Tensor:
    """``t`` (this rank's ``[n, ...]`` float32 subtree root of a sum over the tiles, e.g. the hidden states'
    gradient) summed over ``group``'s ranks through the tree's top: the same bits on every rank and as TP 1's
    tree. In slices of ``rows`` rows (the gather holds ``world`` of them); written over ``t``."""
    if tiles.world == 1:
        return t
    for a in range(0, t.shape[0], rows):
        part = t[a:a + rows]
        top = tiles.sum_tree()
        for r, piece in enumerate(all_gather_stack(part, group)):
            top.push(r * tiles.local, (r + 1) * tiles.local, piece)
        part.copy_(top.result(0, tiles.total))
    return t
