"""Distillation divergences over K ids per token (a teacher's top-k), on ``[..., K]`` log-prob tensors.

The student's log-probs at the teacher's ids come from any source (e.g.
``log_softmax(logits).gather(-1, ids)``); these functions never see a
``[T, V]`` tensor, and their backward hands a ``[..., K]`` gradient to
whatever produced them.

- :func:`topk_forward_kl`: verl 0.9.1's forward KL over the teacher's top-k
  (``verl/trainer/distillation``), both sides optionally clamped from below;
- :func:`sparse_divergence`: TRL 1.16's generalized JSD on a sparse support
  (forward KL, reverse KL, or in between), with TRL's tail bucket;
- :func:`topk_overlap`: verl's teacher/student top-k overlap diagnostics.

The divergences' per-entry terms are :mod:`chunked_entropy._divergence`'s (one
implementation of the KLs and the JSD, shared with the fused ops); TRL's
``beta`` reaches them through :func:`~chunked_entropy._divergence.trl_kind`, as it reaches
:meth:`chunked_entropy.Divergence.from_trl_beta`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .._checks import check_real
from .._divergence import DivergenceMath, ForwardKL, math_of, trl_kind
from ._common import check_same_shape, check_tensor

_FORWARD_KL = ForwardKL()


class TopKForwardKL(NamedTuple):
    """Per token: ``kl`` (the loss), ``student_mass`` and ``teacher_mass`` (the top-k's total probability
    on each side, before any clamp); ``per_id`` is each id's term ``p_t (log p_t - log q_s)``."""

    kl: torch.Tensor
    student_mass: torch.Tensor
    teacher_mass: torch.Tensor
    per_id: torch.Tensor


def _check_log_prob_pair(student_log_probs, teacher_log_probs):
    check_tensor("student_log_probs", student_log_probs)
    check_same_shape("student_log_probs", student_log_probs, teacher_log_probs=teacher_log_probs)
    if student_log_probs.dim() < 1 or student_log_probs.shape[-1] < 1:
        raise ValueError(f"student_log_probs must be [..., K] with K >= 1, got {tuple(student_log_probs.shape)}")
    t = teacher_log_probs.detach()
    if t.device.type == "cpu" and bool(torch.isnan(t).any()):
        raise ValueError("teacher_log_probs hold NaN")


def topk_forward_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, *,
                    log_prob_min_clamp: Optional[float] = None) -> TopKForwardKL:
    r"""verl 0.9.1's forward KL over the teacher's top-k: ``sum_k p_t (log p_t - log q_s)`` per token.

    With ``log_prob_min_clamp`` both sides are clamped from below first (a
    clamped student entry passes no gradient), as verl's
    ``distillation_loss.log_prob_min_clamp``; the masses are taken before it.

    Args:
        student_log_probs: ``[..., K]`` the student's log-probs at the teacher's ids (with gradient).
        teacher_log_probs: ``[..., K]`` the teacher's top-k log-probs (no gradient flows into them).
        log_prob_min_clamp: a lower bound for both sides, or None.

    Returns:
        :class:`TopKForwardKL` of ``[...]`` tensors (``per_id``: ``[..., K]``), in float32 or wider.
    """
    _check_log_prob_pair(student_log_probs, teacher_log_probs)
    if log_prob_min_clamp is not None:
        log_prob_min_clamp = check_real("log_prob_min_clamp", log_prob_min_clamp)
    dt = torch.promote_types(student_log_probs.dtype, torch.float32)
    q, p = student_log_probs.to(dt), teacher_log_probs.detach().to(dt)
    student_mass, teacher_mass = q.exp().sum(dim=-1), p.exp().sum(dim=-1)
    if log_prob_min_clamp is not None:
        q, p = q.clamp_min(log_prob_min_clamp), p.clamp_min(log_prob_min_clamp)
    per_id = _FORWARD_KL.entries(q, p)  # p_t (log p_t - log q_s), 0 where p_t = 0
    return TopKForwardKL(per_id.sum(dim=-1), student_mass, teacher_mass, per_id)


def _terms(math_: DivergenceMath, s: torch.Tensor, t: torch.Tensor, support: Optional[torch.Tensor]):
    """The divergence's per-entry terms (:meth:`~chunked_entropy._divergence.DivergenceMath.entries`), 0 off
    ``support``: the entries there are replaced by 0 on both sides first (finite: no NaN in the gradient)."""
    if support is None:
        return math_.entries(s, t)
    zero = torch.zeros_like(s)
    terms = math_.entries(torch.where(support, s, zero), torch.where(support, t, zero))
    return torch.where(support, terms, zero)


def _with_tail(log_probs, support):
    """TRL's tail bucket: a (K+1)-th entry ``log(1 - sum_k exp(log_probs))`` (the sum held below 1)."""
    total = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(total))], dim=-1), torch.cat(
        [support, torch.ones_like(support[..., :1])], dim=-1)


def sparse_divergence(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, *, beta: float = 0.0,
                      tail: bool = False, support_mask: Optional[torch.Tensor] = None,
                      renormalize: bool = False) -> torch.Tensor:
    r"""TRL 1.16's generalized JSD on a sparse support, summed over the K ids: ``[...]`` per token.

    ``beta = 0``: forward KL ``KL(teacher || student)``; ``beta = 1``: reverse
    KL ``KL(student || teacher)``; in between, with the mixture
    ``m = (1 - beta) q_s + beta p_t``: ``beta KL(p_t || m) + (1 - beta) KL(q_s || m)``.
    Entries off ``support_mask`` contribute 0.

    Args:
        student_log_probs: ``[..., K]`` the student's log-probs at the support's ids (with gradient).
        teacher_log_probs: ``[..., K]`` the teacher's.
        beta: in ``[0, 1]``.
        tail: append TRL's tail bucket ``log(1 - sum exp)`` to both sides first (so that a top-1
            support still has a non-trivial divergence).
        support_mask: ``[..., K]`` bool, or None (every entry counts).
        renormalize: renormalize both sides over the support first (what TRL's sparse forward-KL path
            does without the tail); not with ``tail``.

    Returns:
        ``[...]`` divergences, differentiable in ``student_log_probs``.
    """
    _check_log_prob_pair(student_log_probs, teacher_log_probs)
    beta = check_real("beta", beta, low=0.0, high=1.0)
    if not isinstance(tail, bool) or not isinstance(renormalize, bool):
        raise TypeError(f"tail and renormalize must be bools, got {tail!r} and {renormalize!r}")
    if tail and renormalize:
        raise ValueError("renormalize and tail exclude each other: the tail bucket completes the distribution")
    s, t = student_log_probs, teacher_log_probs.detach()
    if support_mask is not None:
        if not isinstance(support_mask, torch.Tensor) or support_mask.dtype != torch.bool or \
                support_mask.shape != s.shape:
            raise ValueError(f"support_mask must be a bool tensor of shape {tuple(s.shape)}")
        neg = torch.full((), -math.inf, dtype=s.dtype, device=s.device)
        s, t = torch.where(support_mask, s, neg), torch.where(support_mask, t, neg)
    if tail:
        s, support = _with_tail(s, support_mask if support_mask is not None else torch.ones_like(s, dtype=torch.bool))
        t, _ = _with_tail(t, support)
        support_mask = support
    elif renormalize:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    terms = _terms(math_of(*trl_kind(beta)), s, t, support_mask)
    return terms.sum(dim=-1)


def topk_overlap(teacher_ids: torch.Tensor, student_top_k_ids: torch.Tensor, per_id_kl: torch.Tensor):
    """verl's overlap diagnostics: ``(overlap_count, overlap_token_advantage)`` per token.

    ``overlap_count``: how many of the teacher's ids are among the student's
    top-k; ``overlap_token_advantage``: the mean of ``-per_id_kl`` over those
    ids (0 where none overlap). ``per_id_kl`` is :class:`TopKForwardKL`'s
    ``per_id``.
    """
    for name, t in (("teacher_ids", teacher_ids), ("student_top_k_ids", student_top_k_ids)):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor of ids")
    if teacher_ids.shape[:-1] != student_top_k_ids.shape[:-1] or per_id_kl.shape != teacher_ids.shape:
        raise ValueError(f"teacher_ids {tuple(teacher_ids.shape)}, student_top_k_ids "
                         f"{tuple(student_top_k_ids.shape)} and per_id_kl {tuple(per_id_kl.shape)} must share their "
                         "leading shape, and per_id_kl the teacher's K")
    overlap = (teacher_ids.unsqueeze(-1) == student_top_k_ids.unsqueeze(-2)).any(dim=-1)
    count = overlap.sum(dim=-1)
    total = (-per_id_kl.detach() * overlap).sum(dim=-1)
    return count, torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))

