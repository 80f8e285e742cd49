"""OpenRLHF: drop-ins for ``openrlhf.models.utils.log_probs_from_logits`` and ``compute_entropy``.

Same signatures and values as OpenRLHF's, with these differences:

- the logits are never written: OpenRLHF's ``log_probs_from_logits`` divides
  them by the temperature *in place* (so a later use of the same logits sees
  tempered values); this one applies the temperature inside its chunks
  (OpenRLHF 0.11.2's ``Actor.forward`` scales its own float32 copy of the
  logits before calling either helper, and passes ``temperature=1.0``);
- memory: tokens are walked in chunks, and backward keeps only a reference to
  the logits and two or three float32 per token;
- precision: float32 inside and out (float64 for float64 logits), whatever the
  logits' dtype; the entropy has its exact gradient.

Patch the actor by rebinding the names ``openrlhf.models.actor`` imported:
``openrlhf.models.actor.log_probs_from_logits = log_probs_from_logits`` (see
the OpenRLHF integration page of the docs). Tested with OpenRLHF 0.11.2.
"""

from __future__ import annotations

import torch

from ..logits import log_probs_and_entropy
from ._common import check_chunk_size, check_id_range, check_ids, check_logits

__all__ = ["compute_entropy", "log_probs_from_logits"]


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature=1.0, *, chunk_size: int = 1024
) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``, chunked.

    Args:
        logits: ``(..., vocab)``, any float dtype; never written.
        labels: ``(...)`` int64 token ids in ``[0, vocab)`` (any other id,
            ``-100`` included, is a ValueError naming ``labels``, where
            OpenRLHF's gather raises).
        temperature: a float > 0, or a tensor broadcastable to ``labels``.
        chunk_size: tokens per chunk (not in OpenRLHF's signature; keyword only).

    Returns:
        ``(...)`` float32 log-probabilities (float64 for float64 logits).

    Memory:
        Saved for backward: a reference to ``logits`` and two float32 per
        token. Forward allocates one float32 ``[chunk_size, vocab]`` buffer;
        backward allocates the gradient and at most one such buffer.
    """
    check_logits(logits)
    check_ids("labels", labels, logits)
    check_chunk_size(chunk_size)
    # as OpenRLHF's gather: every label a vocabulary id (the core would read -100 as ignored, a log-prob of 0)
    check_id_range("labels", labels, logits.shape[-1])
    return log_probs_and_entropy(
        logits, labels, chunking=chunk_size, temperature=temperature, compute_entropy=False
    ).log_probs


def compute_entropy(logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of ``softmax(logits, -1)`` for each position, chunked, with its exact gradient.

    Args:
        logits: ``(..., vocab)``, any float dtype; never written.
        chunk_size: tokens per chunk (not in OpenRLHF's signature; keyword only).

    Returns:
        ``logits.shape[:-1]`` float32 entropies (float64 for float64 logits).

    Memory:
        Saved for backward: a reference to ``logits`` and three float32 per
        token. Forward allocates two float32 ``[chunk_size, vocab]`` buffers;
        backward allocates the gradient and at most two such buffers.
    """
    check_logits(logits)
    check_chunk_size(chunk_size)
    no_label = torch.full(logits.shape[:-1], -100, dtype=torch.int64, device=logits.device)
    return log_probs_and_entropy(logits, no_label, chunking=chunk_size).entropy
