"""TRL: drop-ins for ``trl.trainer.utils.selective_log_softmax`` and ``entropy_from_logits``.

Same signatures and values as TRL's; the differences are the point:

- memory: both walk the tokens in chunks and save for backward only a
  reference to the logits and one or two float32 per token, where TRL's
  autograd graph keeps a ``log_softmax`` (or softmax) of every row;
- precision: computed in float32 whatever the logits' dtype, and returned in
  float32 (float64 for float64 logits), where TRL returns the logits' dtype;
- the entropy has its exact gradient, ``p * (mu - z)`` per logit, computed in
  backward from the saved statistics (use it as an entropy bonus directly).

Patch a trainer by rebinding the names its module imported, e.g.
``trl.trainer.grpo_trainer.selective_log_softmax = selective_log_softmax``
(see the TRL integration page of the docs).
"""

from __future__ import annotations

import torch

from .._inputs import check_chunk
from ..logits import log_probs_and_entropy

__all__ = ["entropy_from_logits", "selective_log_softmax"]


def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor (..., num_classes), got {type(logits).__name__}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be (..., num_classes) with num_classes >= 1, got shape {tuple(logits.shape)}")


def _check_ids(name: str, ids, logits) -> None:
    """``ids`` must be an id tensor shaped like ``logits`` without its last dim (named in the error)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64 ids, got {type(ids).__name__}")
    if ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"{name} must have the shape of logits without its last dim, {tuple(logits.shape[:-1])}, "
            f"got {tuple(ids.shape)}"
        )


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, index[..., None])[..., 0]``, chunked.

    Args:
        logits: ``(..., num_classes)``, any float dtype; never written.
        index: ``(...)`` int64 class ids in ``[0, num_classes)``; ``-100``
            (Hugging Face's ignore label) gives 0 with no gradient, where TRL
            would fail to index. Other ids out of range raise a ValueError.
        chunk_size: tokens per chunk (not in TRL's signature; keyword only).

    Returns:
        ``(...)`` float32 log-probabilities (float64 for float64 logits).

    Memory:
        Saved for backward: a reference to ``logits`` and one float32 per
        token. Forward allocates one float32 ``[chunk_size, num_classes]``
        buffer; backward allocates the gradient and at most one such buffer.
    """
    _check_logits(logits)
    _check_ids("index", index, logits)
    return log_probs_and_entropy(logits, index, chunk_size=chunk_size, compute_entropy=False).log_probs


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits, -1)`` for each row, chunked.

    Args:
        logits: ``(..., num_classes)``, any float dtype; never written.
        chunk_size: rows of the flattened logits per chunk (TRL's meaning).

    Returns:
        ``logits.shape[:-1]`` float32 entropies (float64 for float64 logits),
        with the exact gradient.

    Memory:
        Saved for backward: a reference to ``logits`` and two float32 per
        row. Forward allocates two float32 ``[chunk_size, num_classes]``
        buffers; backward allocates the gradient and at most two such buffers.
    """
    _check_logits(logits)
    check_chunk("chunk_size", chunk_size)
    # No label: every row's label is ignore_index, so only the entropy is computed.
    no_label = torch.full(logits.shape[:-1], -100, dtype=torch.int64, device=logits.device)
    return log_probs_and_entropy(logits, no_label, chunk_size=chunk_size).entropy
