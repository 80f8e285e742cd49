"""Loss aggregation: verl 0.9.1's ``agg_loss`` modes and the global-batch normalizers.

Every mode is linear in the per-token losses with weights that depend only on
the mask and the global counts (:meth:`Aggregation.weights`), which is what
lets the fused policy loss form its gradient per token.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .._checks import ByValue, check_real, checked_call, float_bits, is_int, plain_str, require
from ..parallel import fingerprint_floats
from ._common import as_mask, check_mask, check_tensor, masked_sum, safe_div

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Loss-aggregation modes of :func:`agg_loss` (verl's ``actor.loss_agg_mode`` values)."""


def check_mode(name: str, mode) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, AGG_MODES))}; got {mode!r}")


def _count(name: str, value):
    """A global count (``batch_num_tokens``, ``global_batch_size``): None, a number > 0, or a 1-element tensor."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a number > 0 or a 1-element real tensor, got {tuple(value.shape)} "
                             f"{value.dtype}")
        return value.detach().reshape(())  # its value is checked where it is used (require_count)
    return check_real(name, value, low=0.0, low_open=True)


def require_count(name: str, value) -> None:
    """A tensor count's value must be finite and > 0: a value check of the call that uses it (on an
    accelerator part of its one host sync; outside any call, checked at once)."""
    if not isinstance(value, torch.Tensor):
        return
    ok = (value > 0) & torch.isfinite(value) if value.is_floating_point() else value > 0

    def found():  # read only once the check failed
        return f"{name} must be a finite number > 0, got {value.item()!r}"

    found.summary = f"{name} must be a finite number > 0"
    require(ok, found)


@dataclass(frozen=True, eq=False)
class Aggregation(ByValue):
    """How a per-token loss becomes one number: verl 0.9.1's ``agg_loss`` arguments, checked.

    Attributes:
        mode: one of :data:`AGG_MODES`.
        loss_scale_factor: the divisor of ``"seq-mean-token-sum-norm"`` (> 0);
            None means the response length ``T``.
        dp_size: the data-parallel size. Each rank's loss is multiplied by
            it, so that the *average* of the ranks' gradients (what DDP and
            FSDP form) is the gradient of the loss over the global batch.
        batch_num_tokens: the number of valid tokens in the global batch
            (``"token-mean"``; required when ``dp_size > 1``), a number or a
            1-element tensor (not synchronized to the host: a tensor's value
            is checked by the call that uses it, with its other checks).
        global_batch_size: the number of non-empty sequences in the global
            batch (the ``"seq-mean-*"`` modes; required when ``dp_size > 1``).
    """

    mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    dp_size: int = 1
    batch_num_tokens: Union[None, float, torch.Tensor] = None
    global_batch_size: Union[None, float, torch.Tensor] = None

    def _key(self) -> tuple:
        # a count given as a tensor: by the data it views (kept as a 0-d view of the caller's tensor; its value
        # is read at use, never here: no host sync)
        count = lambda v: (  # noqa: E731
            ("data", v.data_ptr(), v.dtype, v.device) if isinstance(v, torch.Tensor) else v)
        return (self.mode, self.loss_scale_factor, self.dp_size, count(self.batch_num_tokens),
                count(self.global_batch_size))

    def __post_init__(self):
        object.__setattr__(self, "mode", plain_str(self.mode))
        check_mode("loss_agg_mode", self.mode)
        if self.loss_scale_factor is not None:
            object.__setattr__(self, "loss_scale_factor", check_real("loss_scale_factor", self.loss_scale_factor,
                                                                     low=0.0, low_open=True))
        if not (is_int(self.dp_size) and self.dp_size >= 1):
            raise ValueError(f"dp_size must be an int >= 1, got {self.dp_size!r}")
        object.__setattr__(self, "dp_size", int(self.dp_size))
        object.__setattr__(self, "batch_num_tokens", _count("batch_num_tokens", self.batch_num_tokens))
        object.__setattr__(self, "global_batch_size", _count("global_batch_size", self.global_batch_size))
        if self.dp_size > 1:
            if self.mode == "token-mean" and self.batch_num_tokens is None:
                raise ValueError("batch_num_tokens (the valid tokens of the global batch) is required with "
                                 "loss_agg_mode='token-mean' and dp_size > 1")
            if self.mode.startswith("seq-mean") and self.global_batch_size is None:
                raise ValueError("global_batch_size (the non-empty sequences of the global batch) is required with "
                                 f"loss_agg_mode={self.mode!r} and dp_size > 1")

    def weights(self, loss_mask, dtype=torch.float32) -> torch.Tensor:
        """Per-token weights ``W`` with ``agg_loss(L) == sum(W * L)`` (every mode is linear in the losses).
        ``loss_mask``: a tensor, or a :class:`~chunked_entropy.losses._common.Mask` (its cast and count shared).

        The counts given as tensors are value-checked here, as part of the checks of the call that uses them
        (built once per step, e.g. in a :class:`~chunked_entropy.PolicyLoss`, they cost no host sync then)."""
        self.check_counts()
        mask = as_mask(loss_mask)  # a Mask shares its weights and their count with its other users
        m, loss_mask = mask.weights(dtype), mask.mask
        dp = self.dp_size
        if self.mode == "token-mean":
            if self.batch_num_tokens is None:  # (m * 1 is m: not formed)
                return (m if dp == 1 else m * dp) / mask.total(dtype)
            n = self.batch_num_tokens
            return safe_div(m * dp, n.to(dtype) if isinstance(n, torch.Tensor) else n)
        if self.mode == "token-sum":
            return m * dp
        n = m.sum(dim=-1, keepdim=True)  # tokens per sequence
        has_tokens = (n > 0).to(dtype)  # fully masked sequences do not count
        per_seq = safe_div(has_tokens, n) if self.mode == "seq-mean-token-mean" else has_tokens
        g = has_tokens.sum() if self.global_batch_size is None else self.global_batch_size
        w = safe_div(m * per_seq * dp, g.to(dtype) if isinstance(g, torch.Tensor) else g)
        if self.mode == "seq-mean-token-sum-norm":
            scale = loss_mask.shape[-1] if self.loss_scale_factor is None else self.loss_scale_factor
            w = w / scale if scale else w  # T == 0: no tokens, no weights
        return w

    def check_counts(self) -> None:
        """Value-check the counts given as tensors (finite, > 0) as part of the open call's checks (outside
        any call: at once), the first time only."""
        if not getattr(self, "_counts_checked", False):
            require_count("batch_num_tokens", self.batch_num_tokens)
            require_count("global_batch_size", self.global_batch_size)
            object.__setattr__(self, "_counts_checked", True)

    def with_mode(self, mode: str) -> "Aggregation":
        """The same normalizers under another mode (an objective that imposes its own, as SAPO does)."""
        return Aggregation(mode, self.loss_scale_factor, self.dp_size, self.batch_num_tokens, self.global_batch_size)

    def keywords(self) -> dict:
        """The keyword arguments of :func:`agg_loss` (and :func:`policy_loss`) that make this aggregation."""
        return dict(loss_agg_mode=self.mode, loss_scale_factor=self.loss_scale_factor, dp_size=self.dp_size,
                    batch_num_tokens=self.batch_num_tokens, global_batch_size=self.global_batch_size)

    def fingerprint(self) -> tuple:
        """What ranks of a tensor-parallel group must agree on: the options, the counts' values."""
        def count(v):
            if isinstance(v, torch.Tensor):
                return fingerprint_floats(v)
            return (-1, -1) if v is None else (float_bits(v), 0)
        return (zlib.crc32(repr((self.mode, self.loss_scale_factor, self.dp_size)).encode()),
                *count(self.batch_num_tokens), *count(self.global_batch_size))


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    loss_scale_factor: Optional[float] = None,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
) -> torch.Tensor:
    r"""Aggregate a per-token loss matrix into a scalar, as verl 0.9.1's ``agg_loss``.

    With ``m`` the mask, ``L`` the loss, ``i`` the sequence and ``t`` the token,
    ``T`` the response length (``loss_mask.shape[-1]``), ``n_i = sum_t m_it``,
    ``D = dp_size``, ``N`` the valid tokens (``batch_num_tokens``, default
    ``sum_it m_it``) and ``S`` the non-empty sequences (``global_batch_size``,
    default the number of ``i`` with ``n_i > 0``):

    - ``"token-mean"``: ``D * sum_it m_it L_it / N`` (every valid token weighs
      the same; DAPO).
    - ``"token-sum"``: ``D * sum_it m_it L_it``.
    - ``"seq-mean-token-sum"``: ``D * sum_i (sum_t m_it L_it) / S``.
    - ``"seq-mean-token-mean"``: ``D * sum_{i: n_i > 0} (sum_t m_it L_it / n_i) / S``
      (every sequence weighs the same; original GRPO).
    - ``"seq-mean-token-sum-norm"``: ``D * sum_i (sum_t m_it L_it) / S / loss_scale_factor``,
      ``loss_scale_factor`` defaulting to ``T`` (Dr. GRPO's constant normalizer;
      pass a fixed value, e.g. the maximum response length, to keep it
      constant across batches).

    With ``dp_size > 1`` pass the global counts (as verl does): each rank's
    loss is then ``D`` times its share of the global loss, so the *average*
    of the ranks' gradients (DDP, FSDP) is the gradient of the loss over the
    global batch. Fully masked sequences are excluded from the sequence
    means. An empty selection gives 0 with zero gradients, where verl 0.9.1's
    ``"token-mean"`` divides 0 by 0 (NaN) and its ``"seq-mean-token-mean"``
    adds 1e-8 to each count (below float32 resolution for counts >= 1; the
    values agree).

    Args:
        loss_mat: ``[..., T]`` per-token losses; all leading dims are sequences
            (typically ``[batch, response_length]``).
        loss_mask: ``[..., T]``, the shape of ``loss_mat``: bool, or 0/1 (a
            finite weight >= 0 is multiplied in and counted as its value).
        mode: one of :data:`AGG_MODES`.
        loss_scale_factor: the divisor of ``"seq-mean-token-sum-norm"`` (> 0);
            ``None`` means ``loss_mask.shape[-1]``. Ignored by the other modes.
        dp_size: the data-parallel size (an int >= 1).
        batch_num_tokens: the valid tokens of the global batch (``"token-mean"``),
            a number or a 1-element tensor; required when ``dp_size > 1``.
        global_batch_size: the non-empty sequences of the global batch (the
            ``"seq-mean-*"`` modes); required when ``dp_size > 1``.

    Returns:
        A 0-dim tensor in ``loss_mat``'s dtype, differentiable w.r.t. ``loss_mat``.

    Raises:
        ValueError: unknown ``mode``, ``loss_mask`` of another shape or with a
            negative weight, a bad count or ``loss_scale_factor``, or a
            missing global count with ``dp_size > 1``.
        TypeError: a non-tensor or non-floating ``loss_mat``.
    """
    agg = _checked("loss_mat", loss_mat, loss_mask, mode, loss_scale_factor, dp_size, batch_num_tokens,
                   global_batch_size)
    return aggregate(loss_mat, loss_mask, agg)


def _checked(name: str, values, loss_mask, mode, loss_scale_factor, dp_size, batch_num_tokens, global_batch_size,
             *, floating: bool = True, of: Optional[str] = None) -> Aggregation:
    """The checks :func:`agg_loss`, :func:`agg_weights` and :func:`entropy_bonus` share, as one checked call (the
    value checks: one host sync on an accelerator): ``values`` (called ``name``; a floating tensor unless not
    ``floating``), ``loss_mask`` against it (``of``: its name in the mask's errors, default ``name``), the mode and
    the counts. Returns the :class:`Aggregation`."""
    with checked_call():
        check_tensor(name, values, floating=floating)
        check_mask(loss_mask, values, name if of is None else of)
        agg = Aggregation(mode, loss_scale_factor, dp_size, batch_num_tokens, global_batch_size)
        agg.check_counts()
    return agg


def aggregate(loss_mat: torch.Tensor, loss_mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """:func:`agg_loss` with checked arguments: ``sum(W * L)``, in at least float32, returned in ``L``'s dtype.

    Sums and token counts are formed in at least float32 (a float16 count
    overflows at 65504 tokens).
    """
    acc = torch.promote_types(loss_mat.dtype, torch.float32)
    w, nonzero = as_mask(loss_mask).aggregation(agg, acc)  # a Mask's: formed once for every aggregate of it
    return masked_sum(loss_mat.to(acc), w, nonzero=nonzero).to(loss_mat.dtype)


def agg_weights(
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    loss_scale_factor: Optional[float] = None,
    *,
    dtype=torch.float32,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
) -> torch.Tensor:
    """The per-token weights of :func:`agg_loss`: ``agg_loss(L, loss_mask, mode, ...) == sum(W * L)``.

    Every aggregation mode is linear in the losses with weights that depend
    only on the mask and the global counts (see :func:`agg_loss` for each),
    which is what lets the fused policy loss form its gradient per token.
    Masked tokens weigh 0.

    Args:
        loss_mask: ``[..., T]`` bool (or finite weights >= 0).
        mode: one of :data:`AGG_MODES`.
        loss_scale_factor: as in :func:`agg_loss`.
        dtype: of the weights (at least float32 is advised: counts).
        dp_size: as in :func:`agg_loss`.
        batch_num_tokens: as in :func:`agg_loss`.
        global_batch_size: as in :func:`agg_loss`.

    Returns:
        ``[..., T]`` weights.

    Raises:
        ValueError / TypeError: as :func:`agg_loss`.
    """
    agg = _checked("loss_mask", loss_mask, loss_mask, mode, loss_scale_factor, dp_size, batch_num_tokens,
                   global_batch_size, floating=False, of="loss_mat")
    return agg.weights(loss_mask, dtype)


def entropy_bonus(
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    loss_scale_factor: Optional[float] = None,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
) -> torch.Tensor:
    """The aggregated entropy, ``agg_loss(entropy, loss_mask, mode, ...)``, to subtract from the loss.

    verl's actor loss is ``pg_loss - entropy_coeff * entropy_bonus(...) + kl_coef * kl_loss``.

    Args:
        entropy: ``[B, T]`` per-token entropy with its gradient (e.g. from
            :func:`~chunked_entropy.log_probs_and_entropy`).
        loss_mask: ``[B, T]`` bool (or 0/1) response mask.
        mode: one of :data:`AGG_MODES`.
        loss_scale_factor: the divisor of ``"seq-mean-token-sum-norm"`` (see :func:`agg_loss`).
        dp_size: as in :func:`agg_loss`.
        batch_num_tokens: as in :func:`agg_loss`.
        global_batch_size: as in :func:`agg_loss`.

    Returns:
        A 0-dim tensor, differentiable w.r.t. ``entropy``.

    Raises:
        ValueError: as :func:`agg_loss`.
    """
    agg = _checked("entropy", entropy, loss_mask, mode, loss_scale_factor, dp_size, batch_num_tokens,
                   global_batch_size)
    return aggregate(entropy, loss_mask, agg)
