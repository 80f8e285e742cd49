"""Token-local policy objectives: each token's loss depends on its own log-prob only.

verl 0.9.1's ``vanilla`` (PPO with dual clip), ``dppo_tv``, ``dppo_kl``,
``sapo``, ``gpg``, ``dro`` and ``cispo``. Each is a pair of functions over
``[B, T]`` tensors whose masked positions are already selected away
(:func:`selected`): ``<name>(lp, old, adv, keep, o)`` gives the per-token loss
(differentiable in ``lp``, verl's formula) and verl's metrics, and
``<name>_grad(lp, old, adv, keep, o)`` its derivative in ``lp``, written down
(``keep``: the mask as bool; :meth:`~chunked_entropy.losses.registry.Objective.token_grad`
prepares it from any loss mask a framework hands over),
so that the fused loss can form each token's gradient in the forward chunk
loop. :mod:`chunked_entropy.losses.registry` applies the rollout IS weights
and the aggregation, and checks the arguments.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._common import metric_mean, metric_zero
from .kl import LOG_RATIO_CLAMP


def selected(keep: torch.Tensor, *ts):
    """``ts`` with masked positions replaced by 0 *before* any arithmetic: a NaN there (padding) would
    otherwise turn into ``0 * NaN`` in backward."""
    return tuple(None if t is None else torch.where(keep, t, 0.0) for t in ts)


def _log_ratio(lp, old):
    """``(d, clamped d, ratio)``: verl clamps the log-ratio to [-20, 20] before ``exp``."""
    d = lp - old
    dc = torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return d, dc, torch.exp(dc)


def _d_ratio(d, dc, ratio):
    """``d ratio / d lp`` (0 where the log-ratio is clamped, as autograd gives): ``dc == d`` exactly where
    ``-20 <= d <= 20`` (both bounds exact in every float dtype; false for NaN, as the comparisons)."""
    return torch.where(dc == d, ratio, 0.0)


# ----------------------------------------------------------------------------- vanilla: PPO with dual clip


def vanilla(lp, old, adv, keep, o):
    r"""verl's ``vanilla``: ``l = max(-A r, -A clip(r, 1 - lo, 1 + hi))``, and where ``A < 0`` at most
    ``-A c`` (dual clip, ``c = clip_ratio_c``; Ye et al. 2020), ``r = exp(clamp(lp - old, -20, 20))``."""
    _, dc, ratio = _log_ratio(lp, old)
    minus_adv = -adv
    l1 = minus_adv * ratio
    l2 = minus_adv * torch.clamp(ratio, 1.0 - o.low, 1.0 + o.high)
    clipped = torch.maximum(l1, l2)
    if o.clip_ratio_c is None:
        losses, lower = clipped, torch.zeros(clipped.shape, dtype=torch.bool, device=clipped.device)
    else:
        l3 = minus_adv * o.clip_ratio_c
        negative = adv < 0
        losses = torch.where(negative, torch.minimum(clipped, l3), clipped)
        lower = negative & (clipped > l3)
    return losses, {"actor/pg_clipfrac": metric_mean(l2 > l1, keep, lp), "actor/ppo_kl": metric_mean(-dc, keep, lp),
                    "actor/pg_clipfrac_lower": metric_mean(lower, keep, lp)}


def vanilla_grad(lp, old, adv, keep, o):
    """The derivative of :func:`vanilla` (see :func:`clipped_objective_grad`)."""
    return clipped_objective_grad(lp, old, adv, keep, o.low, o.high, o.clip_ratio_c)


# ----------------------------------------------------------------------------- DPPO (binary TV and binary KL)


def _dppo_valid(lp, old, adv, o, kind: str):
    """Where DPPO's trust region holds (no gradient through it): binary TV or KL between the token's
    probabilities, one side per sign of the advantage."""
    p, p_old = torch.exp(lp), torch.exp(old)
    if kind == "tv":
        pos, neg = (p - p_old) <= o.high, (p - p_old) >= -o.low
    else:
        bkl = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        pos, neg = (bkl <= o.high) | (p <= p_old), (bkl <= o.low) | (p >= p_old)
    return torch.where(adv > 0, pos, neg).detach()


def _dppo(lp, old, adv, keep, o, kind):
    """``l = -A sg(min(r, c)) lp sg(valid)`` (Qi et al. 2026, arXiv:2602.04879): truncated IS on the log-prob."""
    _, dc, ratio = _log_ratio(lp, old)
    c = math.inf if o.clip_ratio_c is None else o.clip_ratio_c
    truncated = torch.clamp(ratio, max=c).detach()
    valid = _dppo_valid(lp, old, adv, o, kind)
    losses = -adv * truncated * lp * valid.to(lp.dtype)
    return losses, {"actor/pg_clipfrac": metric_mean(~valid, keep, lp), "actor/ppo_kl": metric_mean(-dc, keep, lp),
                    "actor/pg_clipfrac_lower": metric_mean((ratio > c) & valid, keep, lp)}


def _dppo_grad(lp, old, adv, keep, o, kind):
    _, _, ratio = _log_ratio(lp, old)
    c = math.inf if o.clip_ratio_c is None else o.clip_ratio_c
    valid = _dppo_valid(lp, old, adv, o, kind)
    return torch.where(valid, -adv * torch.clamp(ratio, max=c), 0.0)


def dppo_tv(lp, old, adv, keep, o):
    """verl's ``dppo_tv``: DPPO with the binary total-variation trust region."""
    return _dppo(lp, old, adv, keep, o, "tv")


def dppo_tv_grad(lp, old, adv, keep, o):
    return _dppo_grad(lp, old, adv, keep, o, "tv")


def dppo_kl(lp, old, adv, keep, o):
    """verl's ``dppo_kl``: DPPO with the binary KL trust region."""
    return _dppo(lp, old, adv, keep, o, "kl")


def dppo_kl_grad(lp, old, adv, keep, o):
    return _dppo_grad(lp, old, adv, keep, o, "kl")


# ----------------------------------------------------------------------------- SAPO, GPG, DRO, CISPO


def _sapo_gate(lp, old, adv, o):
    _, dc, ratio = _log_ratio(lp, old)
    tau = torch.where(adv > 0, torch.as_tensor(o.tau_pos, dtype=adv.dtype, device=adv.device),
                      torch.as_tensor(o.tau_neg, dtype=adv.dtype, device=adv.device))
    return dc, ratio, tau, torch.sigmoid(tau * (ratio - 1.0))


def sapo(lp, old, adv, keep, o):
    """verl's ``sapo`` (Gao et al. 2025, arXiv:2511.20347): ``l = -A sigmoid(tau (r - 1)) 4 / tau``, a smooth gate
    instead of the clip, ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``; aggregated per sequence
    (``"seq-mean-token-mean"``, whatever ``loss_agg_mode`` says, as verl does)."""
    dc, _, tau, s = _sapo_gate(lp, old, adv, o)
    zero = metric_zero(lp)
    return -(s * (4.0 / tau)) * adv, {"actor/pg_clipfrac": zero, "actor/ppo_kl": metric_mean(-dc, keep, lp),
                                      "actor/pg_clipfrac_lower": zero}


def sapo_grad(lp, old, adv, keep, o):
    d = lp - old
    dc, ratio, _, s = _sapo_gate(lp, old, adv, o)
    return -adv * 4.0 * s * (1.0 - s) * _d_ratio(d, dc, ratio)  # d/dlp of sigmoid(tau (r - 1)) * 4 / tau


def gpg(lp, old, adv, keep, o):
    """verl's ``gpg`` (Chu et al. 2025): plain policy gradient, ``l = -A lp``; no metrics."""
    return -lp * adv, {}


def gpg_grad(lp, old, adv, keep, o):
    return -adv


def dro(lp, old, adv, keep, o):
    """verl's ``dro``: ``l = -(A lp - beta (lp - old)**2 / 2)``, ``beta = dro_beta``."""
    d = lp - old
    return -(lp * adv - 0.5 * o.dro_beta * d.square()), {"actor/ppo_kl": metric_mean(-d, keep, lp)}


def dro_grad(lp, old, adv, keep, o):
    return -adv + o.dro_beta * (lp - old)


def cispo(lp, old, adv, keep, o):
    """verl's ``cispo`` (MiniMax 2025, arXiv:2506.13585): ``l = -sg(clip(r, 1 - lo, 1 + hi)) A lp``: the ratio is
    clipped as a weight and never blocks a token's gradient."""
    _, dc, ratio = _log_ratio(lp, old)
    clipped = torch.clamp(ratio, 1.0 - o.low, 1.0 + o.high)
    return -clipped.detach() * adv * lp, {"actor/pg_clipfrac": metric_mean(ratio != clipped, keep, lp),
                                           "actor/ppo_kl": metric_mean(-dc, keep, lp),
                                           "actor/pg_clipfrac_lower": metric_zero(lp)}


def cispo_grad(lp, old, adv, keep, o):
    _, _, ratio = _log_ratio(lp, old)
    return -torch.clamp(ratio, 1.0 - o.low, 1.0 + o.high) * adv


def reinforce(lp, old, adv, keep, o):
    """The policy gradient of verl's ``bypass_mode`` with ``loss_type="reinforce"``: ``l = -A lp`` (the IS
    weights multiply it), ``ppo_kl`` against the rollout log-probs ``old``."""
    return -adv * lp, {"actor/ppo_kl": metric_mean(-(lp - old), keep, lp)}


def reinforce_grad(lp, old, adv, keep, o):
    return -adv


def clipped_objective_grad(log_probs, old_log_probs, advantages, keep, clip_ratio_low: float,
                           clip_ratio_high: float, clip_ratio_c: Optional[float]) -> torch.Tensor:
    """``d l / d lp`` of :func:`vanilla`'s per-token loss, written down (``keep``: the mask as bool).

    With ``r = exp(clamp(lp - old, -20, 20))``: ``dl1 = -A r`` (0 where the
    log-ratio is clamped), ``dl2 = dl1`` where ``1 - lo <= r <= 1 + hi`` and 0
    outside; ``max(l1, l2)`` passes the derivative of the larger term (half of
    each on a tie, as autograd does), and the dual clip ``min(., -A c)`` (where
    ``A < 0``) passes it where the clipped loss is the smaller (half on a tie).
    Masked tokens get 0. Each token's value reads only its own inputs, so masked ones need not be selected
    first: whatever they hold, the last selection puts 0 there.
    """
    d, dc, ratio = _log_ratio(log_probs, old_log_probs)
    minus_adv = -advantages
    l1 = minus_adv * ratio
    l2 = minus_adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    dl1 = minus_adv * _d_ratio(d, dc, ratio)
    dl2 = torch.where((ratio >= 1.0 - clip_ratio_low) & (ratio <= 1.0 + clip_ratio_high), dl1, 0.0)
    clipped = torch.maximum(l1, l2)
    grad = torch.where(l1 > l2, dl1, torch.where(l1 < l2, dl2, 0.5 * (dl1 + dl2)))
    if clip_ratio_c is not None:
        l3 = minus_adv * float(clip_ratio_c)
        dual = torch.where(clipped < l3, grad, torch.where(clipped > l3, 0.0, 0.5 * grad))
        grad = torch.where(advantages < 0, dual, grad)
    return torch.where(keep, grad, 0.0)
