"""verl 0.9: the Megatron engine's log-probs, entropy and sum_pi_squared, without the clone.

verl 0.9's Megatron engine computes the per-token outputs of the actor in
``MegatronEngineWithLMHead._lm_head_logits_processor`` (in
``verl/workers/engine/megatron/transformer_impl.py``). That method divides the
logits by the temperature *in place*, then, for the entropy, *clones* the full
``[tokens, V/tp]`` logits, because Megatron's vocab-parallel cross entropy
overwrites its input and the entropy needs the original values in backward.

:func:`install` replaces that method with :func:`lm_head_logits_processor`:
the same signature and outputs (``log_probs``, ``entropy``,
``sum_pi_squared``, and verl's distillation keys), computed by
:func:`~chunked_entropy.log_probs_and_entropy` in one chunked pass that never
writes the logits or the temperature tensor and saves only a few floats per
token. The chunk size is verl's own ``entropy_from_logits_chunk_size``.

Nothing in verl is edited. Load the patch in every worker with verl's own
hooks: ``VERL_USE_EXTERNAL_MODULES=chunked_entropy.integrations.verl_plugin``
(imported by ``import verl``) or
``actor_rollout_ref.model.external_lib=chunked_entropy.integrations.verl_plugin``.
:func:`install` patches at once if verl's engine module is already imported,
else when it is (a post-import hook): importing the plugin is cheap and
imports neither verl's engine nor megatron-core.

Tested with verl 0.9.1 and megatron-core 0.16.1.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..logits import log_probs_and_entropy
from ..losses import topk_forward_kl, topk_overlap
from ..parallel import default_tp_group
from ._common import Patch, Target, check_parameters

__all__ = ["TARGET_MODULE", "install", "installed", "lm_head_logits_processor", "uninstall"]

#: The verl module whose ``MegatronEngineWithLMHead`` is patched.
TARGET_MODULE = "verl.workers.engine.megatron.transformer_impl"
_CLASS = "MegatronEngineWithLMHead"
_METHOD = "_lm_head_logits_processor"
# verl 0.9's signature, checked before patching: another one means another contract.
_EXPECTED = (
    "self", "logits", "label", "temperature", "calculate_sum_pi_squared", "calculate_entropy",
    "distillation_use_topk", "distillation_only", "logits_processor_func", "batch", "data_format",
)
#: verl replaces non-positive (packing-padding) temperatures by this value.
PADDING_TEMPERATURE = 1e-8


def lm_head_logits_processor(
    self,
    logits: torch.Tensor,
    label: torch.Tensor,
    temperature: torch.Tensor,
    *,
    calculate_sum_pi_squared: bool,
    calculate_entropy: bool,
    distillation_use_topk: bool,
    distillation_only: bool,
    logits_processor_func: Callable,
    batch,
    data_format: str,
) -> dict:
    """verl's ``MegatronEngineWithLMHead._lm_head_logits_processor``, chunked and clone-free.

    Args:
        self: the verl engine (its ``engine_config.entropy_from_logits_chunk_size``
            is the chunk size).
        logits: ``[1, T, V/tp]`` (packed ``thd``) or ``[B, S, V/tp]`` (``bshd``),
            this rank's vocabulary shard, any float dtype. Never written.
        label: global token ids, the logits' shape without the last dim.
        temperature: per token, the label's shape (verl passes float32; 0 at
            packing-padding rows). Never written: non-positive values are
            read as verl's ``1e-8``, as verl does. NaN and inf raise a
            ValueError (``log_probs_and_entropy``'s rule): verl's own method
            fails on NaN, and gives a uniform distribution for inf.
        calculate_sum_pi_squared: also return ``sum_pi_squared``.
        calculate_entropy: also return ``entropy``.
        distillation_use_topk: also return verl's distillation keys: for verl's
            Megatron top-k distillation (``logits_processor_func`` is
            ``partial(distillation_ppo_loss, config=<megatron>, distillation_config=...)``)
            computed here, in the same chunked pass (see
            :mod:`chunked_entropy.losses.distill`); for any other function, by
            calling it.
        distillation_only: return no ``log_probs``.
        logits_processor_func: verl's distillation function.
        batch: verl's micro-batch, passed on to ``logits_processor_func``.
        data_format: ``"thd"`` or ``"bshd"``, passed on likewise.

    Returns:
        verl's dict: ``log_probs`` (unless ``distillation_only``), ``entropy``
        and ``sum_pi_squared`` when asked, plus what ``logits_processor_func``
        returns under ``distillation_use_topk``. float32, with exact
        gradients, equal on every tensor-parallel rank.

    Memory:
        Saved for backward: a reference to the logits (the model keeps them
        anyway) and two to four float32 per token; verl's own method keeps a
        clone of the logits and two more ``[T, V/tp]`` tensors. Forward
        allocates one or two float32 ``[chunk, V/tp]`` buffers. Under verl's
        Megatron top-k distillation, ``[T, K]`` float32 for the teacher's ids
        and ``[T, K]`` float32 and int64 for the student's top-k; verl's own
        route keeps a float32 ``[T, V/tp]`` softmax for backward. Only for
        another distillation function, with a temperature other than 1, is a
        temperature-scaled copy of the logits made (it expects
        ``logits / temperature``).
    """
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    # verl's padding rows (t <= 0) read as verl's 1e-8; a NaN stays NaN, so it is refused (as verl fails on it),
    # and so is inf (verl's own arithmetic would give a uniform distribution there)
    t = torch.where(temperature <= 0, torch.full_like(temperature, PADDING_TEMPERATURE), temperature)
    ret = {}
    want_lp = not distillation_only
    teacher = _teacher_topk(logits_processor_func, batch, data_format) if distillation_use_topk else None
    if want_lp or calculate_entropy or calculate_sum_pi_squared or teacher is not None:
        ids = None if teacher is None else teacher[1]
        out = log_probs_and_entropy(
            logits,
            None if teacher is not None and not want_lp else label,
            chunk_size=int(self.engine_config.entropy_from_logits_chunk_size),
            temperature=t,
            process_group=default_tp_group(),
            compute_entropy=bool(calculate_entropy),
            compute_sum_pi_squared=bool(calculate_sum_pi_squared),
            log_probs_at=ids,
            top_k=None if ids is None else ids.shape[-1],
        )
        if calculate_sum_pi_squared:
            ret["sum_pi_squared"] = out.sum_pi_squared
        if calculate_entropy:
            ret["entropy"] = out.entropy
        if teacher is not None:
            ret.update(_distillation_keys(out, *teacher))
    if distillation_use_topk and teacher is None:  # another distillation contract: verl's own function
        # verl hands its distillation loss the temperature-scaled logits.
        student = logits if bool((t == 1).all()) else logits / t.unsqueeze(-1).to(logits.dtype)
        ret.update(logits_processor_func(student_logits=student, data=batch, data_format=data_format))
    if want_lp:
        ret["log_probs"] = out.log_probs
    return ret


def _teacher_topk(logits_processor_func, batch, data_format):
    """``(clamp, teacher ids, teacher log-probs)``, split like the student's rows, when ``logits_processor_func``
    is verl 0.9's Megatron top-k distillation (``partial(distillation_ppo_loss, config=..., distillation_config=...)``
    with ``config.strategy == "megatron"``); else None (then verl's own function runs)."""
    import functools

    try:
        from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine
        from verl.trainer.distillation import distillation_ppo_loss
    except ImportError:
        return None
    if not (isinstance(logits_processor_func, functools.partial)
            and logits_processor_func.func is distillation_ppo_loss):
        return None
    kw = logits_processor_func.keywords
    config, dcfg = kw.get("config"), kw.get("distillation_config")
    if getattr(config, "strategy", None) != "megatron" or dcfg is None or batch is None:
        return None
    try:
        teacher_lp, teacher_ids = batch["teacher_logprobs"], batch["teacher_ids"]
    except KeyError:
        return None
    split = preprocess_thd_engine if data_format == "thd" else preprocess_bshd_engine
    teacher_lp, *_ = split(teacher_lp, pre_process=True)  # verl's own CP split of the teacher's tensors
    teacher_ids, *_ = split(teacher_ids, pre_process=True)
    return dcfg.distillation_loss.log_prob_min_clamp, teacher_ids.to(torch.int64), teacher_lp


def _distillation_keys(out, clamp, teacher_ids, teacher_lp) -> dict:
    """verl's Megatron top-k distillation keys from the student's log-probs at the teacher's ids and its own
    top-k: the forward KL with both sides clamped, the masses after the clamp (as verl's Megatron route
    reports them), and the overlap diagnostics."""
    student = out.log_probs_at
    if clamp is not None:
        student, teacher_lp = student.clamp_min(clamp), teacher_lp.clamp_min(clamp)
    kl = topk_forward_kl(student, teacher_lp)
    count, advantage = topk_overlap(teacher_ids, out.top_k_ids, kl.per_id)
    return {"distillation_losses": kl.kl, "student_mass": kl.student_mass.detach(),
            "teacher_mass": kl.teacher_mass.detach(), "overlap_count": count, "overlap_token_advantage": advantage}


def _method_of(module):
    """The engine class, whose method is replaced (None when this verl has none)."""
    return getattr(module, _CLASS, None)


_PATCH = Patch(
    "verl",
    [Target(TARGET_MODULE, _METHOD, lm_head_logits_processor,
            check_parameters(f"{_CLASS}.{_METHOD}", _EXPECTED, "verl (written for verl 0.9)"), holder=_method_of)],
    f"verl's {_CLASS}.{_METHOD} now computes log-probs, entropy and sum_pi_squared chunked, without div_ or "
    "clone (chunk size: entropy_from_logits_chunk_size)",
)


def install() -> None:
    """Make verl's Megatron engine compute log-probs and entropy with this library (once; idempotent).

    Patches ``MegatronEngineWithLMHead._lm_head_logits_processor`` now when
    verl's engine module is imported, otherwise as soon as it is. Raises
    RuntimeError, leaving verl as it was, when verl's method does not have
    verl 0.9's signature.
    """
    _PATCH.install()


def uninstall() -> None:
    """Restore verl's own method (and drop a pending post-import hook)."""
    _PATCH.uninstall()


def installed() -> bool:
    """Whether verl's method is currently replaced."""
    return _PATCH.installed()
