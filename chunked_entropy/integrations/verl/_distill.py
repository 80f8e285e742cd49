"""verl's top-k distillation keys, shared by the verl routes.

verl 0.9's top-k distillation hands its loss the student's logits and the
teacher's ``[.., K]`` ids and log-probs (``batch["teacher_ids"]``,
``batch["teacher_logprobs"]``). These helpers recognise that contract and
form verl's keys from the student's log-probs at the teacher's ids and its
own top-k, which this library computes in the same chunked pass as the
log-probs (see :mod:`chunked_entropy.losses.distill`).
"""

from __future__ import annotations

import torch

from ...losses import topk_forward_kl, topk_overlap

__all__ = ["distillation_keys", "teacher_topk"]


#: verl's ``config.strategy`` values whose top-k distillation is each engine's (verl's compute_topk_loss).
_STRATEGIES = {"megatron": ("megatron",), "fsdp": ("fsdp", "fsdp2", "veomni")}


def teacher_topk(logits_processor_func, batch, data_format, *, strategy: str = "megatron"):
    """``(clamp, teacher ids, teacher log-probs)``, split like the student's rows, when ``logits_processor_func``
    is verl 0.9's top-k distillation of that engine (``partial(distillation_ppo_loss, config=...,
    distillation_config=...)`` with ``config.strategy`` the engine's); else None (then verl's own function runs).

    ``strategy="megatron"``: split by verl's Megatron CP preprocessing (``data_format`` ``"thd"`` / ``"bshd"``).
    ``strategy="fsdp"``: verl's FSDP split, ``[1, T/sp, K]`` (the packed values, sliced for Ulysses as verl
    slices them).
    """
    import functools

    try:
        from verl.trainer.distillation import distillation_ppo_loss
    except ImportError:
        return None
    if not (isinstance(logits_processor_func, functools.partial)
            and logits_processor_func.func is distillation_ppo_loss):
        return None
    kw = logits_processor_func.keywords
    config, dcfg = kw.get("config"), kw.get("distillation_config")
    if getattr(config, "strategy", None) not in _STRATEGIES[strategy] or dcfg is None or batch is None:
        return None
    try:
        teacher_lp, teacher_ids = batch["teacher_logprobs"], batch["teacher_ids"]
    except KeyError:
        return None
    if strategy == "fsdp":
        if not (teacher_lp.is_nested and teacher_ids.is_nested):
            return None
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

        teacher_lp, teacher_ids = teacher_lp.values().unsqueeze(0), teacher_ids.values().unsqueeze(0)
        if get_ulysses_sequence_parallel_world_size() > 1:  # verl's own Ulysses split of the teacher's tensors
            teacher_lp, teacher_ids = slice_input_tensor(teacher_lp, dim=1), slice_input_tensor(teacher_ids, dim=1)
        return dcfg.distillation_loss.log_prob_min_clamp, teacher_ids.to(torch.int64), teacher_lp
    try:
        from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine
    except ImportError:
        return None
    split = preprocess_thd_engine if data_format == "thd" else preprocess_bshd_engine
    teacher_lp, *_ = split(teacher_lp, pre_process=True)  # verl's own CP split of the teacher's tensors
    teacher_ids, *_ = split(teacher_ids, pre_process=True)
    return dcfg.distillation_loss.log_prob_min_clamp, teacher_ids.to(torch.int64), teacher_lp


def distillation_keys(out, clamp, teacher_ids, teacher_lp, *, masses_before_clamp: bool = False) -> dict:
    """verl's top-k distillation keys from the student's log-probs at the teacher's ids and its own top-k: the
    forward KL with both sides clamped, the masses after the clamp (as verl's Megatron route reports them; with
    ``masses_before_clamp``, before it, as verl's FSDP route does), and the overlap diagnostics (detached: verl
    reads them, and the masses, as metrics only)."""
    student = out.log_probs_at
    if masses_before_clamp:
        kl = topk_forward_kl(student, teacher_lp, log_prob_min_clamp=clamp)
    else:
        if clamp is not None:
            student, teacher_lp = student.clamp_min(clamp), teacher_lp.clamp_min(clamp)
        kl = topk_forward_kl(student, teacher_lp)
    count, advantage = topk_overlap(teacher_ids, out.top_k_ids, kl.per_id)
    return {"distillation_losses": kl.kl, "student_mass": kl.student_mass.detach(),
            "teacher_mass": kl.teacher_mass.detach(), "overlap_count": count, "overlap_token_advantage": advantage}
