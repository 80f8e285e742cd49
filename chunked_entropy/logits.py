"""Chunked log-probs and entropy from given logits (possibly a vocabulary shard)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from ._autograd import once_differentiable

from . import _stats
from ._inputs import Rows, Tokens, check_chunk, check_float, chunks, compute_dtype, prepare_tokens
from .parallel import reduce_stats


class LogProbsEntropy(NamedTuple):
    """Per-token outputs; unpacks as ``log_probs, entropy``.

    ``entropy`` is None when it was not computed (``compute_entropy=False``).
    """

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]


def _forward_stats(logits, tok: Tokens, chunk_size, group, compute_entropy):
    """Per-token :class:`~chunked_entropy._stats.RowStats` of all rows, chunk by chunk.

    Allocates per chunk one [chunk, V_local] buffer in the compute dtype (two
    when the entropy is computed), reused across chunks.
    """
    n, v = tok.n, logits.shape[-1]
    cdt = compute_dtype(logits.dtype)
    rows = Rows(logits)
    c = min(chunk_size, n)
    buf = torch.empty(c, v, dtype=cdt, device=logits.device)
    scratch = torch.empty_like(buf) if compute_entropy else None
    lse = torch.empty(n, dtype=cdt, device=logits.device)
    zl = torch.empty_like(lse)
    mu = torch.empty_like(lse) if compute_entropy else None
    for a, b in chunks(n, chunk_size):
        x = buf[: b - a]
        x.copy_(rows(a, b))
        st = _stats.block_stats(
            x, tok.inv_t_rows(a, b), tok.target[a:b], 0, None if scratch is None else scratch[: b - a]
        )
        r = _stats.RowStats.from_block(reduce_stats(st, group))
        lse[a:b], zl[a:b] = r.lse, r.zl
        if mu is not None:
            mu[a:b] = r.mu
    return _stats.RowStats(lse, mu, zl)


class _LogitsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tok: Tokens, chunk_size: int, group, compute_entropy: bool):
        r = _forward_stats(logits, tok, chunk_size, group, compute_entropy)
        log_probs, entropy = tok.outputs(r, compute_entropy)
        # Saved: the input reference (no copy) and lse / mu per token.
        saved = [logits, r.lse] + ([r.mu] if compute_entropy else [])
        ctx.save_for_backward(*saved)
        ctx.tok, ctx.chunk_size = tok, chunk_size
        ctx.set_materialize_grads(False)
        return (log_probs, entropy) if compute_entropy else log_probs

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_h=None):
        logits, lse, *rest = ctx.saved_tensors
        mu = rest[0] if rest else None
        if g_lp is None and g_h is None:
            return None, None, None, None, None
        tok = ctx.tok
        n, v = tok.n, logits.shape[-1]
        cdt = lse.dtype
        g_lp = None if g_lp is None else g_lp.reshape(-1).to(cdt)
        g_h = None if g_h is None else g_h.reshape(-1).to(cdt)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(n, v)
        rows = Rows(logits)
        c = min(ctx.chunk_size, n)
        # float32 logits: the gradient's own rows are the working buffer.
        buf = None if logits.dtype == cdt else torch.empty(c, v, dtype=cdt, device=logits.device)
        scratch = None if g_h is None else torch.empty(c, v, dtype=cdt, device=logits.device)
        for a, b in chunks(n, ctx.chunk_size):
            x = gflat[a:b] if buf is None else buf[: b - a]
            x.copy_(rows(a, b))
            cc, bb = tok.coefficients(a, b, g_lp, g_h)
            _stats.block_grad(
                x, tok.inv_t_rows(a, b), lse[a:b], None if mu is None else mu[a:b],
                tok.target[a:b], 0, cc, bb, None if scratch is None else scratch[: b - a],
            )
            if buf is not None:
                gflat[a:b].copy_(x)
        return grad, None, None, None, None


def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    temperature=1.0,
    process_group=None,
    compute_entropy: bool = True,
    label_mask: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
) -> LogProbsEntropy:
    """Per-token log-prob of ``labels`` and entropy of ``softmax(logits / temperature)``.

    Walks the tokens in chunks of ``chunk_size``; each chunk is copied into a
    float32 buffer, reduced to a few per-token statistics (all-reduced over
    ``process_group`` when the vocabulary is sharded), and dropped. Backward
    recomputes each chunk's softmax from the saved statistics.

    Args:
        logits: ``[..., V_local]`` float32/bfloat16/float16 (float64 for
            gradcheck), any strides. Never written: no in-place op, no
            version-counter bump; it may feed other ops and other calls.
        labels: ``[...]`` int64 *global* vocabulary ids.
        chunk_size: tokens per chunk (>= 1). Memory per chunk is
            ``chunk_size * V_local * 4`` bytes per buffer.
        temperature: a float > 0 or a tensor broadcastable to ``labels``'
            shape (per-sample temperatures), applied in float32 inside the
            chunk loop. It receives no gradient.
        process_group: the tensor-parallel group over which the vocabulary is
            sharded (rank ``r`` holds ids ``[r*V_local, (r+1)*V_local)``), or
            None for a whole local vocabulary. Forward makes two all-reduces
            per chunk; backward makes none.
        compute_entropy: when False, ``entropy`` is None and no entropy
            statistic is computed (one buffer per chunk instead of two).
        label_mask: optional bool ``[...]``; where False (or where
            ``labels == ignore_index``) the log-prob is 0 and passes no
            gradient. Masked labels are not range-checked. The entropy is
            defined for every token.
        ignore_index: label id meaning "no label".

    Returns:
        :class:`LogProbsEntropy` of tensors shaped like ``labels``, float32
        (float64 for float64 logits), identical on every rank of the group.

    Memory:
        Saved for backward: a reference to ``logits`` and one (log-probs
        only) or two float32 per token; nothing under ``torch.no_grad()``.
        Forward allocates one or two ``[chunk_size, V_local]`` float32
        buffers; backward allocates the gradient (the logits' dtype and
        shape) plus at most two such buffers (one less for float32 logits:
        the gradient's rows are the working buffer). An output that receives
        no gradient costs no backward work.

    Example:
        >>> logits = torch.randn(2, 5, 11, requires_grad=True)
        >>> labels = torch.randint(0, 11, (2, 5))
        >>> log_probs, entropy = log_probs_and_entropy(logits, labels, chunk_size=4)
        >>> (log_probs.sum() + 0.01 * entropy.sum()).backward()
    """
    check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V_local] with V_local >= 1, got shape {tuple(logits.shape)}")
    check_chunk("chunk_size", chunk_size)
    tok = prepare_tokens(
        labels, logits.shape[:-1], logits.shape[-1], process_group=process_group,
        label_mask=label_mask, ignore_index=ignore_index, temperature=temperature,
        device=logits.device, dtype=compute_dtype(logits.dtype),
    )
    shape = labels.shape
    if tok.n == 0:
        empty = torch.zeros(shape, dtype=compute_dtype(logits.dtype), device=logits.device)
        entropy = empty.clone() if compute_entropy else None
        if logits.requires_grad and torch.is_grad_enabled():
            empty = empty + logits.sum() * 0  # keep the graph connected
            entropy = None if entropy is None else entropy + logits.sum() * 0
        return LogProbsEntropy(empty, entropy)
    if torch.is_grad_enabled() and logits.requires_grad:
        out = _LogitsFunction.apply(logits, tok, chunk_size, process_group, compute_entropy)
        log_probs, entropy = out if compute_entropy else (out, None)
    else:
        r = _forward_stats(logits, tok, chunk_size, process_group, compute_entropy)
        log_probs, entropy = tok.outputs(r, compute_entropy)
    return LogProbsEntropy(
        log_probs.view(shape), None if entropy is None else entropy.view(shape)
    )
