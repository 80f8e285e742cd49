"""Objectives that read sequence or batch statistics of the current log-probs first.

verl 0.9.1's ``gspo`` (the sequence's mean log-ratio), ``geo_mean`` (GMPO: a
geometric mean over the sequence), ``clip_cov`` and ``kl_cov`` (covariances
over the whole batch). Each is one function ``<name>(lp, old, adv, keep, o,
agg, weights, generator) -> (loss, metrics)`` over ``[B, T]`` tensors whose
masked positions are selected away, differentiable in ``lp`` and equal to
verl's. A token's gradient depends on other tokens' log-probs: the fused loss
takes each token's upstream gradient from these functions' autograd over the
``[B, T]`` log-probs (no logits involved). gspo and geo_mean read only the
token's own sequence (row-local: the fused loss asks them as soon as a chunk
of whole rows has its log-probs); clip_cov and kl_cov read the whole batch
(asked once every chunk has its statistics).
"""

from __future__ import annotations

import torch

from ._common import masked_mean, metric_mean, metric_zero
from .aggregation import aggregate


def _weighted(losses, weights):
    return losses if weights is None else losses * weights


def gspo(lp, old, adv, keep, o, agg, weights, generator=None):
    """verl's ``gspo`` (Zheng et al. 2025, arXiv:2507.18071): the ratio is the sequence's, ``s_i = exp(mean_t
    (lp - old))``, applied per token as ``sg(s_i) * exp(lp - sg(lp))`` (log clamped at 10), then PPO's clip."""
    d = lp - old
    n = keep.sum(dim=-1).clamp(min=1)
    d_seq = (d * keep).sum(dim=-1) / n
    log_s = torch.clamp(lp - lp.detach() + d_seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    l1 = -adv * s
    l2 = -adv * torch.clamp(s, 1 - o.low, 1 + o.high)
    loss = aggregate(_weighted(torch.maximum(l1, l2), weights), keep, agg)
    return loss, {"actor/pg_clipfrac": metric_mean(l2 > l1, keep, lp), "actor/ppo_kl": metric_mean(-d, keep, lp),
                  "actor/pg_clipfrac_lower": metric_zero(lp)}


def geo_mean(lp, old, adv, keep, o, agg, weights, generator=None):
    """verl's ``geo_mean`` (GMPO, Zhao et al. 2025, arXiv:2507.20673): per sequence, ``-mean_t(A) * exp(mean_t
    of the token log-ratios clipped to [-lo, hi] on the advantage's side)``, averaged over the batch's
    sequences (verl ignores ``loss_agg_mode`` here). IS weights enter as their geometric mean per sequence."""
    d = lp - old
    sgn = torch.sign(adv)
    dc = torch.clamp(d, -o.low, o.high)
    d_min = sgn * torch.minimum(sgn * d, sgn * dc)
    n = keep.sum(dim=-1)
    ratio = torch.exp((d_min * keep).sum(dim=-1) / (n + 1e-8))
    a = (adv * keep).sum(dim=-1) / (n + 1e-8)
    losses = -a * ratio
    if weights is not None:
        losses = losses * torch.exp((torch.log(weights + 1e-10) * keep).sum(dim=-1) / (n + 1e-8))
    clipped = d != dc
    return losses.mean(), {"actor/pg_clipfrac": metric_mean(clipped & (adv > 0), keep, lp),
                           "actor/ppo_kl": metric_mean(-d, keep, lp),
                           "actor/pg_clipfrac_lower": metric_mean(clipped & (adv < 0), keep, lp)}


def clip_cov(lp, old, adv, keep, o, agg, weights, generator=None):
    """verl's ``clip_cov`` (Cui et al. 2025, arXiv:2505.22617): PPO's clip, and the gradient of a random
    ``clip_cov_ratio`` share of the tokens whose covariance ``(A - mean A)(lp - mean lp)`` lies in
    ``(clip_cov_lb, clip_cov_ub)`` (and that PPO did not clip) is cut. The tokens are drawn with
    ``torch.randperm`` from ``generator`` (default: torch's global generator, as verl draws them)."""
    d = lp - old
    ratio = torch.exp(d)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - o.low, 1 + o.high)
    valid = keep != 0
    clipped = (l2 > l1) & valid
    with torch.no_grad():
        cov = (adv - masked_mean(adv, keep)) * (lp - masked_mean(lp, keep))
        cov = cov.masked_fill(~valid | clipped, -torch.inf)
        n_clip = max(int(o.clip_cov_ratio * float(keep.sum())), 1)
        candidates = torch.nonzero((cov < o.clip_cov_ub) & (cov > o.clip_cov_lb) & valid)
        if len(candidates) > 0:
            perm = torch.randperm(len(candidates), generator=generator)
            candidates = candidates[perm[: min(n_clip, len(candidates))].to(candidates.device)]
        corr = torch.ones_like(adv)
        corr[candidates[:, 0], candidates[:, 1]] = 0
    loss = aggregate(_weighted(torch.maximum(l1, l2) * corr, weights), keep, agg)
    return loss, {"actor/pg_clipfrac": metric_mean(corr == 0, keep, lp), "actor/ppo_kl": metric_mean(-d, keep, lp)}


def kl_cov(lp, old, adv, keep, o, agg, weights, generator=None):
    """verl's ``kl_cov`` (Cui et al. 2025): ``l = -A r``, plus ``ppo_kl_coef * |lp - old|`` on the
    ``kl_cov_ratio`` share of the valid tokens with the largest covariance ``(A - mean A)(lp - mean lp)``."""
    d = lp - old
    ratio = torch.exp(d)
    losses = -adv * ratio
    with torch.no_grad():
        flat = keep.reshape(-1) != 0
        valid = torch.nonzero(flat, as_tuple=True)[0]
        a, p = adv.reshape(-1)[valid], lp.reshape(-1)[valid]
        chosen = torch.zeros_like(flat)
        if len(a) > 0:
            cov = (a - a.mean()) * (p - p.mean())
            top = torch.topk(cov, max(1, int(len(cov) * o.kl_cov_ratio)), largest=True).indices
            chosen[valid[top]] = True
        chosen = chosen.view(keep.shape)
    losses = torch.where(chosen, losses + o.ppo_kl_coef * d.abs(), losses)
    loss = aggregate(_weighted(losses, weights), keep, agg)
    return loss, {"actor/ppo_kl": metric_mean(d.abs(), keep, lp)}
