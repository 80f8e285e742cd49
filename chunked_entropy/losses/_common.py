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


class Mask:
    """A loss mask with what its users share, each formed once: which tokens count (``keep``, the mask itself
    when it is bool), its weights in a dtype with their count, and an aggregation's per-token weights.

    Every aggregation and masked mean of one objective's value reads the same mask: built once (by the
    fused loss's :class:`~chunked_entropy.losses._objective.Objective`, or by :func:`as_mask` for a bare
    tensor), it spares each of them the cast, the count and its guard. Holds a few ``[..., T]`` tensors;
    the results are those of the tensor form, bit for bit (the same operations, done once).
    """

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self._cache = {}

    @property
    def keep(self) -> torch.Tensor:
        """Which tokens count: ``mask != 0`` (the mask itself when it is bool)."""
        return self._get("keep", lambda: self.mask if self.mask.dtype == torch.bool else self.mask != 0)

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def weights(self, dtype) -> torch.Tensor:
        """The mask's weights in ``dtype`` (``mask.to(dtype)``)."""
        return self._get(("w", dtype), lambda: self.mask.to(dtype))

    def total(self, dtype) -> torch.Tensor:
        """Their sum, guarded: 1 where it is 0 (see :func:`safe_div`)."""
        return self._get(("n", dtype), lambda: guarded(self.weights(dtype).sum()))

    def nonzero(self, dtype) -> torch.Tensor:
        """Where the weights in ``dtype`` are not 0 (``keep``, unless a weight rounds to 0 in ``dtype``)."""
        return self._get(("nz", dtype), lambda: self.keep if self.mask.dtype == torch.bool
                         else self.weights(dtype) != 0)

    def aggregation(self, agg, dtype):
        """``(W, W != 0)``: ``agg``'s per-token weights (:meth:`~chunked_entropy.losses.Aggregation.weights`)
        in ``dtype``, once per aggregation's settings and dtype."""
        def make():
            w = agg.weights(self, dtype)
            return w, w != 0
        return self._get(("agg", agg, dtype), make)


def as_mask(mask) -> Mask:
    """``mask`` as a :class:`Mask` (itself when it is one)."""
    return mask if isinstance(mask, Mask) else Mask(mask)


def guarded(den: torch.Tensor) -> torch.Tensor:
    """``den`` with 1 where it is 0: a denominator whose numerator is 0 there (nothing was selected)."""
    return torch.where(den != 0, den, 1)


def masked_sum(values: torch.Tensor, weights: torch.Tensor, dim=None, nonzero=None, ones: bool = False
               ) -> torch.Tensor:
    """``sum(values * weights)`` with masked (weight 0) positions selected away, not multiplied. ``nonzero``:
    ``weights != 0`` if already at hand; ``ones``: every weight is 0 or 1 (a bool mask's), so that the
    product is ``values`` itself (``x * 1 == x`` exactly) and is not formed."""
    nonzero = weights != 0 if nonzero is None else nonzero
    picked = torch.where(nonzero, values if ones else values * weights, 0.0)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def safe_div(num: torch.Tensor, den) -> torch.Tensor:
    """``num / den``, with 0 where ``den == 0`` (then ``num`` is 0 too: nothing was selected)."""
    if not isinstance(den, torch.Tensor):
        return num / den if den else torch.zeros_like(num)
    return num / guarded(den)


def masked_mean(values: torch.Tensor, loss_mask) -> torch.Tensor:
    """The mean of ``values`` over the mask (weights multiply); 0 for an empty mask. ``loss_mask``: a tensor,
    or a :class:`Mask` whose weights and count are shared with its other means."""
    m = as_mask(loss_mask)
    dt = values.dtype
    return masked_sum(values, m.weights(dt), nonzero=m.nonzero(dt), ones=m.mask.dtype == torch.bool) / m.total(dt)


def metric_mean(values: torch.Tensor, keep, like: torch.Tensor) -> torch.Tensor:
    """A metric: the token mean of ``values`` (flags too) over the mask (a tensor or a :class:`Mask`),
    detached, in ``like``'s dtype or at least float32 (no host sync)."""
    return masked_mean(values.detach().to(torch.promote_types(like.dtype, torch.float32)), keep)


def metric_zero(like: torch.Tensor) -> torch.Tensor:
    """A metric that an objective reports as 0 (verl's keys, kept for compatibility)."""
    return torch.zeros((), dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)
