"""Checks and masked arithmetic shared by the loss modules.

Layer: loss utilities, their base (imports only torch and the library's plain checks).
Masked positions are *selected away* (``torch.where``), not multiplied by 0,
so a NaN or inf there (padding) never reaches a value, and every mean guards
its count: an empty mask gives 0 instead of NaN.
"""

from __future__ import annotations

import torch

from .._checks import check_device, check_strided, require


def check_tensor(name: str, t, *, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_same_shape(ref_name: str, ref: torch.Tensor, **others) -> None:
    """Each of ``others`` a float tensor of ``ref``'s shape, on its device (each named in the error)."""
    for name, t in others.items():
        check_tensor(name, t)
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} must have the shape of {ref_name}, {tuple(ref.shape)}, got {tuple(t.shape)}"
            )
        check_device(name, t, ref.device, ref_name)


def check_mask(loss_mask, loss_mat: torch.Tensor, of: str = "loss_mat", name: str = "loss_mask") -> None:
    """``loss_mask`` (called ``name``): bool, or real weights >= 0 (finite), shaped like ``loss_mat``, on its device.

    The weights' sign is a value check of the call (:func:`~chunked_entropy._checks.require`): on an
    accelerator it joins the call's one host sync.
    """
    check_tensor(name, loss_mask, floating=False)
    if loss_mask.dtype.is_complex:
        raise TypeError(f"{name} must be a bool or real tensor, got {loss_mask.dtype}")
    if loss_mask.shape != loss_mat.shape:
        raise ValueError(
            f"{name} must have the shape of {of}, {tuple(loss_mat.shape)}, "
            f"got {tuple(loss_mask.shape)}"
        )
    if loss_mat.dim() < 1:
        raise ValueError(f"{of} must be at least 1-D ([..., response_length]), got a scalar")
    check_device(name, loss_mask, loss_mat.device, of)
    if loss_mask.dtype != torch.bool:
        ok = ((loss_mask >= 0) & torch.isfinite(loss_mask) if loss_mask.is_floating_point() else loss_mask >= 0).all()
        message = f"{name} must be bool or hold finite weights >= 0"

        def found():  # read only once the check failed
            return f"{message}; got a minimum of {loss_mask.min().item()!r}"

        found.summary = message
        require(ok, found)


def masked_sum(values: torch.Tensor, weights: torch.Tensor, dim=None) -> torch.Tensor:
    """``sum(values * weights)`` with masked (weight 0) positions selected away, not multiplied."""
    picked = torch.where(weights != 0, values * weights, torch.zeros((), dtype=values.dtype, device=values.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def safe_div(num: torch.Tensor, den) -> torch.Tensor:
    """``num / den``, with 0 where ``den == 0`` (then ``num`` is 0 too: nothing was selected)."""
    if not isinstance(den, torch.Tensor):
        return num / den if den else torch.zeros_like(num)
    return num / torch.where(den != 0, den, torch.ones_like(den))


def masked_mean(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the mask (weights multiply); 0 for an empty mask."""
    w = loss_mask.to(values.dtype)
    return safe_div(masked_sum(values, w), w.sum())


def metric_mean(values: torch.Tensor, keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A metric: the token mean of ``values`` (flags too) over the mask, detached, in ``like``'s dtype or at
    least float32 (no host sync)."""
    return masked_mean(values.detach().to(torch.promote_types(like.dtype, torch.float32)), keep)


def metric_zero(like: torch.Tensor) -> torch.Tensor:
    """A metric that an objective reports as 0 (verl's keys, kept for compatibility)."""
    return torch.zeros((), dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)
