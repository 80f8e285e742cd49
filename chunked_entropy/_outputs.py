"""The per-token result type and the plumbing between an autograd Function and its caller.

Layer: results (below the ops): used by the ops with per-token results (:mod:`chunked_entropy.logits`,
:mod:`chunked_entropy.linear`), the head and the DTensor front; imports only torch and the math.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._autograd import connected
from ._stats import Want


class _Pair(NamedTuple):
    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]


class LogProbsEntropy(_Pair):
    """Per-token outputs; unpacks as ``log_probs, entropy``.

    ``entropy`` is None when it was not computed (``compute_entropy=False``);
    ``log_probs`` is None without labels. Attributes, not unpacked:
    ``sum_pi_squared`` is ``sum_j p_j**2`` per token when
    ``compute_sum_pi_squared=True`` was asked; ``log_probs_at`` (``[..., K]``)
    the log-probs at the ids of ``log_probs_at=``; ``top_k_ids`` and
    ``top_k_log_probs`` (``[..., k]``) the row's own top-k with ``top_k=k``.
    Each is None when not asked.
    """

    def __new__(cls, log_probs, entropy, sum_pi_squared=None, log_probs_at=None, top_k_ids=None,
                top_k_log_probs=None):
        self = super().__new__(cls, log_probs, entropy)
        self.sum_pi_squared = sum_pi_squared
        self.log_probs_at = log_probs_at
        self.top_k_ids = top_k_ids
        self.top_k_log_probs = top_k_log_probs
        return self

    def __repr__(self):
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("sum_pi_squared", "log_probs_at", "top_k_ids",
                                                                 "top_k_log_probs") if getattr(self, k) is not None)
        return f"LogProbsEntropy(log_probs={self.log_probs!r}, entropy={self.entropy!r}{extra})"


def pack_outputs(outs, want: Want, at_outs=(None, None, None)):
    """The tensors an autograd Function returns: the log-probs, each wanted output, then distillation's
    ``(log_probs_at, top_k_ids, top_k_log_probs)`` where asked."""
    return tuple(t for t, on in zip(outs, (True, *want), strict=True) if on) + tuple(t for t in at_outs
                                                                                     if t is not None)


def unpack_grads(grads, want: Want):
    """Upstream gradients in ``(log_probs, entropy, sum_pi_squared)`` order, None where not computed."""
    it = iter(grads)
    return tuple(next(it) if on else None for on in (True, *want))


def split_grads(grads, want: Want, tok, like: torch.Tensor):
    """An autograd Function's upstream gradients: ``(log_probs, entropy, sum_pi_squared)`` as
    :func:`unpack_grads`, and distillation's ``[N, K + k]`` ones (None without any)."""
    n_base = 1 + sum(want)
    base = unpack_grads(grads[:n_base], want)
    at = tok.at
    if at is None:
        return base, None
    extra = list(grads[n_base:])
    g_at = extra.pop(0) if at.ids is not None else None
    g_top = extra[1] if at.top_k else None  # extra[0]: the top-k ids, no gradient
    return base, at.upstream(g_at, g_top, at.k_ids, at.top_k, like.unsqueeze(1))


def without_labels(out: LogProbsEntropy, no_labels: bool) -> LogProbsEntropy:
    """``out`` with ``log_probs`` None when the call had no labels (distillation only)."""
    if not no_labels:
        return out
    return LogProbsEntropy(None, out.entropy, out.sum_pi_squared, out.log_probs_at, out.top_k_ids,
                           out.top_k_log_probs)


def run_outputs(apply, forward, tok, want: Want, shape, grads: bool) -> LogProbsEntropy:
    """Call the autograd Function (``apply``) or, without gradients, the bare forward; shape the outputs."""
    at = tok.at
    if grads:
        outs = apply()
        outs = outs if isinstance(outs, tuple) else (outs,)
        n_base = 1 + sum(want)
        base, extra = outs[:n_base], list(outs[n_base:])
        outs = unpack_grads(base, want)
        at_outs = [extra.pop(0) if at is not None and at.ids is not None else None]
        at_outs += [extra.pop(0), extra.pop(0)] if at is not None and at.top_k else [None, None]
    else:
        r = forward()
        outs, at_outs = tok.outputs(r, want), tok.at_outputs(r)
    view = lambda t, tail: None if t is None else t.view(tuple(shape) + tail)  # noqa: E731
    k_ids = 0 if at is None else at.k_ids
    top = 0 if at is None else at.top_k
    return LogProbsEntropy(*(view(t, ()) for t in outs), view(at_outs[0], (k_ids,)), view(at_outs[1], (top,)),
                           view(at_outs[2], (top,)))


def empty_outputs(shape, want: Want, dtype, device, inputs, at=None) -> LogProbsEntropy:
    """Outputs for zero tokens, connected to ``inputs`` (zero gradients) when grad is enabled."""
    def new(on, tail=(), kind=dtype):
        t = torch.zeros(tuple(shape) + tail, dtype=kind, device=device) if on else None
        if t is not None and kind.is_floating_point:
            t = connected(t, *inputs)
        return t

    outs = [new(on) for on in (True, *want)]
    k_ids, top = (0, 0) if at is None else (at.k_ids, at.top_k)
    return LogProbsEntropy(*outs, new(bool(k_ids), (k_ids,)), new(bool(top), (top,), torch.int64),
                           new(bool(top), (top,)))
