"""KL estimators from sampled-token log-probs (verl's ``kl_penalty``), and their per-token gradient."""

from __future__ import annotations

import torch

from ._common import check_same_shape, check_tensor

_BASE = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}
# A trailing "+" (verl's straight-through form, e.g. "k3+"): the named estimate's value, k2's gradient.
_KL_ALIASES = {**_BASE, **{f"{name}+": f"{kind}+" if kind != "k2" else "k2" for name, kind in _BASE.items()}}
KL_KINDS = tuple(_KL_ALIASES)
"""Accepted ``kind`` values of :func:`kl_penalty` (verl's ``kl_loss_type`` / ``kl_penalty`` names, each also with
verl's straight-through ``"+"``)."""

# verl clamps the log-ratio before exp() and the k3 estimate after, for stability.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _check_kl(log_probs, ref_log_probs, kind) -> str:
    check_tensor("log_probs", log_probs)
    check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs)
    if not isinstance(kind, str) or kind not in _KL_ALIASES:
        why = " (verl leaves \"full\" unimplemented too)" if kind == "full" else ""
        raise ValueError(f"kind must be one of {', '.join(map(repr, KL_KINDS))}; got {kind!r}{why}")
    return _KL_ALIASES[kind]


def _estimate(d: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    neg = torch.clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log(pi_ref / pi)
    return torch.clamp(torch.exp(neg) - neg - 1.0, -K3_CLAMP, K3_CLAMP)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    r"""Per-token estimate of ``KL(pi || pi_ref)`` from sampled-token log-probs (verl's ``kl_penalty``).

    With ``d = log_probs - ref_log_probs`` (J. Schulman, "Approximating KL
    divergence", 2020):

    - ``"k1"`` (alias ``"kl"``): ``d``;
    - ``"abs"``: ``|d|``;
    - ``"k2"`` (alias ``"mse"``): ``d**2 / 2``;
    - ``"k3"`` (alias ``"low_var_kl"``): ``exp(-d) + d - 1``, unbiased and
      non-negative; as verl, ``-d`` is clamped to ``[-20, 20]`` before the
      exp and the result to ``[-10, 10]``;
    - any of these with a trailing ``"+"`` (``"k3+"``, ``"low_var_kl+"``, ...,
      verl's straight-through form): that estimate's value with k2's
      gradient ``d``, unclamped (the gradient of the KL itself in
      expectation); ``"k2+"`` / ``"mse+"`` are ``"k2"``.

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
    if kind.endswith("+"):
        k2 = 0.5 * d.square()
        return k2 - k2.detach() + _estimate(d.detach(), kind[:-1])
    return _estimate(d, kind)


def kl_penalty_grad(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """``d kl_penalty(log_probs, ref_log_probs, kind) / d log_probs``, per token, written down.

    Matches autograd of :func:`kl_penalty` exactly, clamps included (a
    clamped value passes no gradient; ``abs`` has gradient 0 at 0).

    Raises:
        ValueError: as :func:`kl_penalty`.
    """
    kind = _check_kl(log_probs, ref_log_probs, kind)
    d = log_probs - ref_log_probs
    if kind == "k2" or kind.endswith("+"):
        return d
    if kind == "k1":
        return torch.ones_like(d)
    if kind == "abs":
        return torch.sign(d)
    inside = (d >= -LOG_RATIO_CLAMP) & (d <= LOG_RATIO_CLAMP)
    neg = torch.clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    e = torch.exp(neg)
    value = e - neg - 1.0
    kept = (value >= -K3_CLAMP) & (value <= K3_CLAMP)
    return torch.where(inside & kept, 1.0 - e, 0.0)  # d/dd of e^{-d} + d - 1
