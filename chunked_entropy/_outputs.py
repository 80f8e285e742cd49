"""The per-token result type and the plumbing between an autograd Function and its caller.

Floor 1: used by every op (:mod:`chunked_entropy.logits`,
:mod:`chunked_entropy.linear`); imports only torch and the math.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._stats import Want


class _Pair(NamedTuple):
    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]


class LogProbsEntropy(_Pair):
    """Per-token outputs; unpacks as ``log_probs, entropy``.

    ``entropy`` is None when it was not computed (``compute_entropy=False``).
    ``sum_pi_squared`` (an attribute, not unpacked) is ``sum_j p_j**2`` per
    token when ``compute_sum_pi_squared=True`` was asked, else None.
    """

    def __new__(cls, log_probs, entropy, sum_pi_squared=None):
        self = super().__new__(cls, log_probs, entropy)
        self.sum_pi_squared = sum_pi_squared
        return self

    def __repr__(self):
        extra = "" if self.sum_pi_squared is None else f", sum_pi_squared={self.sum_pi_squared!r}"
        return f"LogProbsEntropy(log_probs={self.log_probs!r}, entropy={self.entropy!r}{extra})"


def pack_outputs(outs, want: Want):
    """The tensors an autograd Function returns: the log-probs and each wanted output."""
    return tuple(t for t, on in zip(outs, (True, *want), strict=True) if on)


def unpack_grads(grads, want: Want):
    """Upstream gradients in ``(log_probs, entropy, sum_pi_squared)`` order, None where not computed."""
    it = iter(grads)
    return tuple(next(it) if on else None for on in (True, *want))


def run_outputs(apply, forward, tok, want: Want, shape, grads: bool) -> LogProbsEntropy:
    """Call the autograd Function (``apply``) or, without gradients, the bare forward; shape the outputs."""
    if grads:
        outs = apply()
        outs = unpack_grads(outs if isinstance(outs, tuple) else (outs,), want)
    else:
        outs = tok.outputs(forward(), want)
    return LogProbsEntropy(*(None if t is None else t.view(shape) for t in outs))


def empty_outputs(shape, want: Want, dtype, device, inputs) -> LogProbsEntropy:
    """Outputs for zero tokens, connected to ``inputs`` (zero gradients) when grad is enabled."""
    outs = []
    for on in (True, *want):
        t = torch.zeros(shape, dtype=dtype, device=device) if on else None
        if t is not None and torch.is_grad_enabled():
            for x in inputs:
                if x is not None and x.requires_grad:
                    t = t + x.sum() * 0
        outs.append(t)
    return LogProbsEntropy(*outs)
