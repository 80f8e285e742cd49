"""What the adapters share: checks of the tensors other frameworks hand over.

Adapters sit apart from the core and import it as users do; this module is
theirs alone.
"""

from __future__ import annotations

import torch


def check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor (..., num_classes), got {type(logits).__name__}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be (..., num_classes) with num_classes >= 1, got shape {tuple(logits.shape)}")


def check_ids(name: str, ids, logits) -> None:
    """``ids`` must be an id tensor shaped like ``logits`` without its last dim (named in the error)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64 ids, got {type(ids).__name__}")
    if ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"{name} must have the shape of logits without its last dim, {tuple(logits.shape[:-1])}, "
            f"got {tuple(ids.shape)}"
        )


def check_id_range(name: str, ids: torch.Tensor, num_classes: int) -> None:
    """Every id in ``[0, num_classes)``, as a gather over the classes requires (named in the error).

    Checked at once on the CPU; on an accelerator with an asynchronous
    device-side assertion (no host sync).
    """
    bad = (ids < 0) | (ids >= num_classes)
    if ids.device.type != "cpu":
        torch._assert_async(~bad.any(), f"{name} must hold class ids in [0, {num_classes})")
    elif bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0, 0])
        raise ValueError(
            f"{name} must hold class ids in [0, {num_classes}); found {int(ids.reshape(-1)[i])} at flat position {i}"
        )
