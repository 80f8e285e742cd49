"""RL loss utilities: loss aggregation, the PPO clipped objective, KL penalties, entropy bonus.

Drop-in equivalents of verl's ``agg_loss``, ``compute_policy_loss`` and
``kl_penalty`` (``verl/trainer/ppo/core_algos.py``), with the same mode names
and formulas, for the per-token ``log_probs`` and ``entropy`` that
:func:`~chunked_entropy.log_probs_and_entropy` and
:class:`~chunked_entropy.ChunkedVocabParallelHead` return. All of them are
plain differentiable tensor expressions over ``[batch, response_length]``
tensors: nothing is saved for backward beyond what autograd keeps for these
few element-wise ops, and no ``[tokens, vocab]`` tensor is involved.

Masking: ``loss_mask`` is a bool (or 0/1, or non-negative weight) tensor of
the loss's shape. Masked positions are *selected away* (``torch.where``), not
multiplied by 0, so a NaN or inf there (padding) never reaches the loss value,
and the aggregation passes a zero gradient to every masked position. Every
mean guards its count: an all-masked batch gives a loss of 0 (with zero
gradient) instead of NaN.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ._checks import check_real, check_strided, is_int, is_real
from .parallel import fingerprint_floats

__all__ = [
    "AGG_MODES", "KL_KINDS", "Aggregation", "agg_loss", "agg_weights", "entropy_bonus", "kl_penalty",
    "kl_penalty_grad", "masked_mean", "policy_loss", "policy_loss_grad",
]

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Loss-aggregation modes of :func:`agg_loss` (verl's ``actor.loss_agg_mode`` values)."""

_KL_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
KL_KINDS = tuple(_KL_ALIASES)
"""Accepted ``kind`` values of :func:`kl_penalty` (verl's ``kl_loss_type`` / ``kl_penalty`` names)."""

# verl clamps the log-ratio before exp() and the k3 estimate after, for stability.
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


# ---------------------------------------------------------------- checks


def check_tensor(name: str, t, *, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_same_shape(ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        check_tensor(name, t)
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} must have the shape of {ref_name}, {tuple(ref.shape)}, got {tuple(t.shape)}"
            )


def check_mode(name: str, mode) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, AGG_MODES))}; got {mode!r}")


def check_mask(loss_mask, loss_mat: torch.Tensor, of: str = "loss_mat") -> None:
    """``loss_mask``: bool, or real weights >= 0 (finite), shaped like ``loss_mat``.

    The weights' sign is checked on the CPU at once; on an accelerator with an
    asynchronous device-side assertion (no host sync).
    """
    check_tensor("loss_mask", loss_mask, floating=False)
    if loss_mask.dtype.is_complex:
        raise TypeError(f"loss_mask must be a bool or real tensor, got {loss_mask.dtype}")
    if loss_mask.shape != loss_mat.shape:
        raise ValueError(
            f"loss_mask must have the shape of {of}, {tuple(loss_mat.shape)}, "
            f"got {tuple(loss_mask.shape)}"
        )
    if loss_mat.dim() < 1:
        raise ValueError(f"{of} must be at least 1-D ([..., response_length]), got a scalar")
    if loss_mask.dtype != torch.bool:
        ok = ((loss_mask >= 0) & torch.isfinite(loss_mask) if loss_mask.is_floating_point() else loss_mask >= 0).all()
        message = "loss_mask must be bool or hold finite weights >= 0"
        if loss_mask.device.type == "cpu":
            if not bool(ok):
                raise ValueError(f"{message}; got a minimum of {loss_mask.min().item()!r}")
        else:
            torch._assert_async(ok, message)


def check_clip_ratio_c(value) -> Optional[float]:
    """The dual-clip bound: a number > 1, or None (no dual clip)."""
    if value is not None and not (is_real(value) and value > 1 and value < float("inf")):
        raise ValueError(f"clip_ratio_c must be a finite number > 1 (the dual-clip bound) or None, got {value!r}")
    return None if value is None else float(value)


# ---------------------------------------------------------------- aggregation


def _masked_sum(values: torch.Tensor, weights: torch.Tensor, dim=None) -> torch.Tensor:
    """``sum(values * weights)`` with masked (weight 0) positions selected away, not multiplied."""
    picked = torch.where(weights != 0, values * weights, torch.zeros((), dtype=values.dtype, device=values.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def _safe_div(num: torch.Tensor, den) -> torch.Tensor:
    """``num / den``, with 0 where ``den == 0`` (then ``num`` is 0 too: nothing was selected)."""
    if not isinstance(den, torch.Tensor):
        return num / den if den else torch.zeros_like(num)
    return num / torch.where(den != 0, den, torch.ones_like(den))


def masked_mean(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the mask (weights multiply); 0 for an empty mask."""
    w = loss_mask.to(values.dtype)
    return _safe_div(_masked_sum(values, w), w.sum())


def _count(name: str, value):
    """A global count (``batch_num_tokens``, ``global_batch_size``): None, a number > 0, or a 1-element tensor."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a number > 0 or a 1-element real tensor, got {tuple(value.shape)} "
                             f"{value.dtype}")
        value = value.detach().reshape(())
        ok = (value > 0) & torch.isfinite(value) if value.is_floating_point() else value > 0
        if value.device.type == "cpu":
            if not bool(ok):
                raise ValueError(f"{name} must be a finite number > 0, got {value.item()!r}")
        else:  # no host sync: an asynchronous device-side assertion
            torch._assert_async(ok, f"{name} must be a finite number > 0")
        return value
    return check_real(name, value, low=0.0, low_open=True)


@dataclass(frozen=True, eq=False)
class Aggregation:
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
            1-element tensor (not synchronized to the host).
        global_batch_size: the number of non-empty sequences in the global
            batch (the ``"seq-mean-*"`` modes; required when ``dp_size > 1``).
    """

    mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    dp_size: int = 1
    batch_num_tokens: Union[None, float, torch.Tensor] = None
    global_batch_size: Union[None, float, torch.Tensor] = None

    def __post_init__(self):
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

    def weights(self, loss_mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Per-token weights ``W`` with ``agg_loss(L) == sum(W * L)`` (every mode is linear in the losses)."""
        m = loss_mask.to(dtype)
        dp = self.dp_size
        if self.mode == "token-mean":
            n = m.sum() if self.batch_num_tokens is None else self.batch_num_tokens
            return _safe_div(m * dp, n.to(dtype) if isinstance(n, torch.Tensor) else n)
        if self.mode == "token-sum":
            return m * dp
        n = m.sum(dim=-1, keepdim=True)  # tokens per sequence
        has_tokens = (n > 0).to(dtype)  # fully masked sequences do not count
        per_seq = _safe_div(has_tokens, n) if self.mode == "seq-mean-token-mean" else has_tokens
        g = has_tokens.sum() if self.global_batch_size is None else self.global_batch_size
        w = _safe_div(m * per_seq * dp, g.to(dtype) if isinstance(g, torch.Tensor) else g)
        if self.mode == "seq-mean-token-sum-norm":
            scale = loss_mask.shape[-1] if self.loss_scale_factor is None else self.loss_scale_factor
            w = w / scale if scale else w  # T == 0: no tokens, no weights
        return w

    def keywords(self) -> dict:
        """The keyword arguments of :func:`agg_loss` (and :func:`policy_loss`) that make this aggregation."""
        return dict(loss_agg_mode=self.mode, loss_scale_factor=self.loss_scale_factor, dp_size=self.dp_size,
                    batch_num_tokens=self.batch_num_tokens, global_batch_size=self.global_batch_size)

    def fingerprint(self) -> tuple:
        """What ranks of a tensor-parallel group must agree on: the options, the counts' values."""
        def count(v):
            if isinstance(v, torch.Tensor):
                return fingerprint_floats(v)
            return (-1, -1) if v is None else (struct.unpack("<q", struct.pack("<d", v))[0], 0)
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
    check_tensor("loss_mat", loss_mat)
    check_mask(loss_mask, loss_mat)
    agg = Aggregation(mode, loss_scale_factor, dp_size, batch_num_tokens, global_batch_size)
    return aggregate(loss_mat, loss_mask, agg)


def aggregate(loss_mat: torch.Tensor, loss_mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """:func:`agg_loss` with checked arguments: ``sum(W * L)``, in at least float32, returned in ``L``'s dtype.

    Sums and token counts are formed in at least float32 (a float16 count
    overflows at 65504 tokens).
    """
    acc = torch.promote_types(loss_mat.dtype, torch.float32)
    return _masked_sum(loss_mat.to(acc), agg.weights(loss_mask, acc)).to(loss_mat.dtype)


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
    check_tensor("loss_mask", loss_mask, floating=False)
    check_mask(loss_mask, loss_mask)
    return Aggregation(mode, loss_scale_factor, dp_size, batch_num_tokens, global_batch_size).weights(loss_mask, dtype)


# ---------------------------------------------------------------- policy loss


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: Optional[float] = None,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
):
    r"""PPO clipped surrogate loss, with optional dual clip (verl's ``compute_policy_loss``).

    Per token, with ``r = exp(clamp(log_probs - old_log_probs, -20, 20))`` and
    advantage ``A``:

    - ``l1 = -A * r``, ``l2 = -A * clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)``,
      ``l = max(l1, l2)`` (the clipped objective, negated);
    - dual clip (``clip_ratio_c = c`` given): where ``A < 0``,
      ``l = min(l, -A * c)``, bounding the loss of a very large ratio
      (Ye et al., 2020, arXiv:1912.09729).

    The loss is ``agg_loss(l, loss_mask, loss_agg_mode)``. Gradients flow into
    every input that requires them (usually only ``log_probs``; detach
    ``old_log_probs`` and ``advantages`` as rollout data).

    Args:
        log_probs: ``[B, T]`` log-probs of the sampled tokens under the current
            policy (e.g. from :func:`~chunked_entropy.log_probs_and_entropy`).
        old_log_probs: ``[B, T]`` the same under the rollout (old) policy.
        advantages: ``[B, T]`` per-token advantages (broadcast a per-sequence
            advantage with ``adv[:, None].expand_as(log_probs)``).
        loss_mask: ``[B, T]`` bool (or 0/1) response mask.
        clip_ratio_low: ``eps_low`` in ``[0, 1]``.
        clip_ratio_high: ``eps_high >= 0`` (DAPO's clip-higher uses e.g. 0.28).
        clip_ratio_c: dual-clip constant ``c > 1``, or ``None`` for no dual clip
            (verl's default is 3.0).
        loss_agg_mode: one of :data:`AGG_MODES`.
        loss_scale_factor: the divisor of ``"seq-mean-token-sum-norm"`` (see :func:`agg_loss`).
        dp_size: as in :func:`agg_loss`.
        batch_num_tokens: as in :func:`agg_loss`.
        global_batch_size: as in :func:`agg_loss`.

    Returns:
        ``(loss, metrics)``: a 0-dim loss, and a dict of detached 0-dim float
        tensors, all token means over the mask whatever the aggregation mode:
        ``"pg_clipfrac"`` (share of tokens where the clipped term is taken,
        ``l2 > l1``), ``"pg_clipfrac_lower"`` (share where the dual clip binds;
        0 without it) and ``"ppo_kl"`` (``mean(old_log_probs - log_probs)``, the
        k1 estimate of ``KL(old || new)``, from the clamped log-ratio).

    Raises:
        ValueError: shape mismatch (naming the argument), an unknown
            ``loss_agg_mode``, clip ratios out of range, ``clip_ratio_c <= 1``.
    """
    check_tensor("log_probs", log_probs)
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages)
    check_mask(loss_mask, log_probs, "log_probs")
    low = check_real("clip_ratio_low", clip_ratio_low, low=0.0, high=1.0)
    high = check_real("clip_ratio_high", clip_ratio_high, low=0.0)
    clip_ratio_c = check_clip_ratio_c(clip_ratio_c)
    agg = Aggregation(loss_agg_mode, loss_scale_factor, dp_size, batch_num_tokens, global_batch_size)

    # Masked positions are selected away *before* any arithmetic: a NaN there (an
    # advantage or log-prob of padding) would otherwise turn into 0 * NaN in backward.
    keep = loss_mask != 0
    log_probs, old_log_probs, advantages = (
        torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))
        for t in (log_probs, old_log_probs, advantages)
    )
    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped = torch.maximum(l1, l2)
    if clip_ratio_c is None:
        losses = clipped
        lower = torch.zeros_like(clipped, dtype=torch.bool)
    else:
        l3 = -advantages * float(clip_ratio_c)
        negative = advantages < 0
        losses = torch.where(negative, torch.minimum(clipped, l3), clipped)
        lower = negative & (clipped > l3)
    loss = aggregate(losses, loss_mask, agg)

    with torch.no_grad():
        dtype = torch.promote_types(log_ratio.dtype, torch.float32)
        metrics = {
            "pg_clipfrac": masked_mean((l2 > l1).to(dtype), loss_mask),
            "pg_clipfrac_lower": masked_mean(lower.to(dtype), loss_mask),
            "ppo_kl": masked_mean(-log_ratio.to(dtype), loss_mask),
        }
    return loss, metrics


# ---------------------------------------------------------------- KL and entropy


def _check_kl(log_probs, ref_log_probs, kind) -> str:
    check_tensor("log_probs", log_probs)
    check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs)
    if not isinstance(kind, str) or kind not in _KL_ALIASES:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KL_KINDS))}; got {kind!r}")
    return _KL_ALIASES[kind]


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    r"""Per-token estimate of ``KL(pi || pi_ref)`` from sampled-token log-probs (verl's ``kl_penalty``).

    With ``d = log_probs - ref_log_probs`` (J. Schulman, "Approximating KL
    divergence", 2020):

    - ``"k1"`` (alias ``"kl"``): ``d``;
    - ``"abs"``: ``|d|``;
    - ``"k2"`` (alias ``"mse"``): ``d**2 / 2``;
    - ``"k3"`` (alias ``"low_var_kl"``): ``exp(-d) + d - 1``, unbiased and
      non-negative; as verl, ``-d`` is clamped to ``[-20, 20]`` before the
      exp and the result to ``[-10, 10]``.

    Aggregate the result with :func:`agg_loss` (verl's ``use_kl_loss``) or
    subtract it from the rewards.

    Args:
        log_probs: ``[...]`` log-probs of the sampled tokens under the policy.
        ref_log_probs: ``[...]`` the same under the reference policy.
        kind: one of :data:`KL_KINDS`.

    Returns:
        ``[...]`` per-token penalties, differentiable w.r.t. both inputs.

    Raises:
        ValueError: unknown ``kind``, or ``ref_log_probs`` of another shape.
    """
    kind = _check_kl(log_probs, ref_log_probs, kind)
    d = log_probs - ref_log_probs
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    neg = torch.clamp(-d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log(pi_ref / pi)
    return torch.clamp(torch.exp(neg) - neg - 1.0, -_K3_CLAMP, _K3_CLAMP)


def kl_penalty_grad(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """``d kl_penalty(log_probs, ref_log_probs, kind) / d log_probs``, per token, written down.

    Matches autograd of :func:`kl_penalty` exactly, clamps included (a
    clamped value passes no gradient; ``abs`` has gradient 0 at 0).

    Raises:
        ValueError: as :func:`kl_penalty`.
    """
    kind = _check_kl(log_probs, ref_log_probs, kind)
    d = log_probs - ref_log_probs
    if kind == "k1":
        return torch.ones_like(d)
    if kind == "abs":
        return torch.sign(d)
    if kind == "k2":
        return d
    inside = (d >= -_LOG_RATIO_CLAMP) & (d <= _LOG_RATIO_CLAMP)
    neg = torch.clamp(-d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    e = torch.exp(neg)
    value = e - neg - 1.0
    kept = (value >= -_K3_CLAMP) & (value <= _K3_CLAMP)
    return torch.where(inside & kept, 1.0 - e, torch.zeros_like(e))  # d/dd of e^{-d} + d - 1


def policy_loss_grad(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
) -> torch.Tensor:
    """``d l / d log_probs`` of :func:`policy_loss`'s per-token loss ``l``, before aggregation, written down.

    With ``r = exp(clamp(log_probs - old_log_probs, -20, 20))``:
    ``dl1 = -A r`` (0 where the log-ratio is clamped), ``dl2 = dl1`` where
    ``1 - eps_low <= r <= 1 + eps_high`` and 0 outside; ``max(l1, l2)`` passes
    the derivative of the larger term (half of each on a tie, as autograd
    does), and the dual clip ``min(., -A c)`` (where ``A < 0``) passes it
    where the clipped loss is the smaller (half on a tie). Masked tokens get
    0. Multiply by :func:`agg_weights` for the gradient of the loss.

    Raises:
        ValueError / TypeError: as :func:`policy_loss` (shapes, clip ratios).
    """
    check_tensor("log_probs", log_probs)
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages)
    check_mask(loss_mask, log_probs, "log_probs")
    return clipped_objective_grad(
        log_probs, old_log_probs, advantages, loss_mask != 0,
        check_real("clip_ratio_low", clip_ratio_low, low=0.0, high=1.0),
        check_real("clip_ratio_high", clip_ratio_high, low=0.0), check_clip_ratio_c(clip_ratio_c),
    )


def clipped_objective_grad(log_probs, old_log_probs, advantages, keep, clip_ratio_low: float,
                           clip_ratio_high: float, clip_ratio_c: Optional[float]) -> torch.Tensor:
    """:func:`policy_loss_grad` of checked arguments (``keep``: the mask as bool), for callers that checked."""
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    lp, old, adv = (torch.where(keep, t, zero) for t in (log_probs, old_log_probs, advantages))
    d = lp - old
    ratio = torch.exp(torch.clamp(d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    d_ratio = torch.where((d >= -_LOG_RATIO_CLAMP) & (d <= _LOG_RATIO_CLAMP), ratio, zero)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    dl1 = -adv * d_ratio
    dl2 = torch.where((ratio >= 1.0 - clip_ratio_low) & (ratio <= 1.0 + clip_ratio_high), dl1, zero)
    clipped = torch.maximum(l1, l2)
    grad = torch.where(l1 > l2, dl1, torch.where(l1 < l2, dl2, 0.5 * (dl1 + dl2)))
    if clip_ratio_c is not None:
        l3 = -adv * float(clip_ratio_c)
        dual = torch.where(clipped < l3, grad, torch.where(clipped > l3, zero, 0.5 * grad))
        grad = torch.where(adv < 0, dual, grad)
    return torch.where(keep, grad, zero)


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
    check_tensor("entropy", entropy)
    check_mask(loss_mask, entropy, "entropy")
    return aggregate(entropy, loss_mask, Aggregation(mode, loss_scale_factor, dp_size, batch_num_tokens,
                                                     global_batch_size))
