"""The chunk loop, shared by the logits path and the fused head.

Both paths walk the tokens in chunks of ``chunk_size`` rows and the vocabulary
shard in blocks of ``block`` columns; the only difference is where a block's
raw logits come from, which the caller passes as ``fill(x, a, b, v0, v1)``:
write the logits of rows ``[a, b)`` and shard columns ``[v0, v1)`` into ``x``
(a buffer of ours). The math on each block is :mod:`chunked_entropy._stats`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from ._inputs import Tokens, chunks
from . import _stats
from .parallel import reduce_stats

Fill = Callable[[torch.Tensor, int, int, int, int], object]


class Buffers:
    """Reusable flat storage for ``[rows, cols]`` blocks: the working buffer and the ``exp`` scratch.

    Allocated once per forward or backward (``chunk_size * block`` elements
    each) and reused for every block.
    """

    def __init__(self, rows: int, cols: int, dtype, device, *, work: bool, scratch: bool):
        size = rows * cols
        self.work = torch.empty(size, dtype=dtype, device=device) if work else None
        self.scratch = torch.empty(size, dtype=dtype, device=device) if scratch else None

    def get(self, rows: int, cols: int):
        k = rows * cols
        view = lambda t: None if t is None else t[:k].view(rows, cols)  # noqa: E731
        return view(self.work), view(self.scratch)


def row_stats(
    tok: Tokens, fill: Fill, *, width: int, block: int, chunk_size: int, group,
    compute_entropy: bool, dtype, device,
) -> _stats.RowStats:
    """Forward: the per-token statistics of every row, merged over blocks and over ``group``."""
    n = tok.n
    bufs = Buffers(min(chunk_size, n), block, dtype, device, work=True, scratch=compute_entropy)
    lse = torch.empty(n, dtype=dtype, device=device)
    zl = torch.empty_like(lse)
    mu = torch.empty_like(lse) if compute_entropy else None
    for a, b in chunks(n, chunk_size):
        inv_t, target = tok.inv_t_rows(a, b), tok.target[a:b]
        st = None
        for v0, v1 in chunks(width, block):
            x, scratch = bufs.get(b - a, v1 - v0)
            fill(x, a, b, v0, v1)
            st = _stats.merge_stats(st, _stats.block_stats(x, inv_t, target, v0, scratch))
        r = _stats.RowStats.from_block(reduce_stats(st, group))
        lse[a:b], zl[a:b] = r.lse, r.zl
        if mu is not None:
            mu[a:b] = r.mu
    return _stats.RowStats(lse, mu, zl)


def grad_blocks(
    tok: Tokens, fill: Fill, *, width: int, block: int, chunk_size: int,
    lse: torch.Tensor, mu: Optional[torch.Tensor], g_lp, g_h, dtype, device,
    into: Optional[Callable[[int, int], torch.Tensor]] = None,
) -> Iterator[tuple]:
    """Backward: yield ``(a, b, v0, v1, g)``, the gradient w.r.t. each block's raw logits.

    ``g`` lives in a reused buffer, valid until the next step. ``into(a, b)``
    optionally supplies the buffer to compute in (the logits path passes the
    rows of the gradient itself, saving a buffer). ``g_lp``/``g_h`` are the
    upstream gradients (None: that output has none, and costs nothing).
    """
    n = tok.n
    g_lp = None if g_lp is None else g_lp.reshape(-1).to(dtype)
    g_h = None if g_h is None else g_h.reshape(-1).to(dtype)
    bufs = Buffers(min(chunk_size, n), block, dtype, device, work=into is None, scratch=g_h is not None)
    for a, b in chunks(n, chunk_size):
        cc, bb = tok.coefficients(a, b, g_lp, g_h)
        inv_t, target = tok.inv_t_rows(a, b), tok.target[a:b]
        lse_c, mu_c = lse[a:b], None if mu is None else mu[a:b]
        for v0, v1 in chunks(width, block):
            x, scratch = bufs.get(b - a, v1 - v0)
            if into is not None:
                x = into(a, b)
            fill(x, a, b, v0, v1)
            yield a, b, v0, v1, _stats.block_grad(x, inv_t, lse_c, mu_c, target, v0, cc, bb, scratch)
