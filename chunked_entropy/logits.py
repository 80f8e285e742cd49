"""Chunked log-probs and entropy from given logits (possibly a vocabulary shard)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from ._autograd import once_differentiable

from ._inputs import Rows, Tokens, check_chunk, check_float, compute_dtype, prepare_tokens
from ._loop import grad_blocks, row_stats


class LogProbsEntropy(NamedTuple):
    """Per-token outputs; unpacks as ``log_probs, entropy``.

    ``entropy`` is None when it was not computed (``compute_entropy=False``).
    """

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]


def _forward_stats(logits, tok: Tokens, chunk_size, group, compute_entropy):
    """Per-token :class:`~chunked_entropy._stats.RowStats`: each chunk of rows is copied into our buffer."""
    rows = Rows(logits)
    v = logits.shape[-1]
    return row_stats(
        tok, lambda x, a, b, v0, v1: x.copy_(rows(a, b)), width=v, block=v, chunk_size=chunk_size,
        group=group, compute_entropy=compute_entropy, dtype=compute_dtype(logits.dtype), device=logits.device,
    )


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
        if g_lp is None and g_h is None:
            return None, None, None, None, None
        n, v = ctx.tok.n, logits.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(n, v)
        rows = Rows(logits)
        # Logits already in the compute dtype: the gradient's own rows are the working buffer.
        direct = logits.dtype == lse.dtype
        blocks = grad_blocks(
            ctx.tok, lambda x, a, b, v0, v1: x.copy_(rows(a, b)), width=v, block=v,
            chunk_size=ctx.chunk_size, lse=lse, mu=rest[0] if rest else None, g_lp=g_lp, g_h=g_h,
            dtype=lse.dtype, device=logits.device, into=(lambda a, b: gflat[a:b]) if direct else None,
        )
        for a, b, _, _, g in blocks:
            if not direct:
                gflat[a:b].copy_(g)
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
