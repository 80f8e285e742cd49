"""verl 0.9, Megatron engine: the unfused route's log-probs, entropy and sum_pi_squared, without the clone.

verl 0.9's Megatron engine computes the per-token outputs of the actor in
``MegatronEngineWithLMHead._lm_head_logits_processor`` (in
``verl/workers/engine/megatron/transformer_impl.py``). That method divides the
logits by the temperature *in place*, then, for the entropy, *clones* the full
``[tokens, V/tp]`` logits, because Megatron's vocab-parallel cross entropy
overwrites its input and the entropy needs the original values in backward.

:func:`chunked_entropy.integrations.verl.install` replaces that method with
:func:`lm_head_logits_processor`:
the same signature and outputs (``log_probs``, ``entropy``,
``sum_pi_squared``, and verl's distillation keys), computed by
:func:`~chunked_entropy.log_probs_and_entropy` in one chunked pass that never
writes the logits or the temperature tensor and saves only a few floats per
token. The chunk size is verl's own ``entropy_from_logits_chunk_size``.

Nothing in verl is edited: :func:`chunked_entropy.integrations.verl.install`
patches every route's :data:`TARGETS` at once.

Tested with verl 0.9.1 and megatron-core 0.16.1.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...logits import log_probs_and_entropy
from ...parallel import default_tp_group
from .._common import Target, check_parameters, engine_chunk_size, sharded_over
from ._distill import distillation_keys, teacher_topk

__all__ = ["TARGET_MODULE", "TARGETS", "lm_head_logits_processor"]

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
    teacher = teacher_topk(logits_processor_func, batch, data_format) if distillation_use_topk else None
    if want_lp or calculate_entropy or calculate_sum_pi_squared or teacher is not None:
        ids = None if teacher is None else teacher[1]
        out = log_probs_and_entropy(
            logits,
            None if teacher is not None and not want_lp else label,
            layer=sharded_over(default_tp_group()),
            chunking=engine_chunk_size(self.engine_config),
            temperature=t,
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
            ret.update(distillation_keys(out, *teacher))
    if distillation_use_topk and teacher is None:  # another distillation contract: verl's own function
        # verl hands its distillation loss the temperature-scaled logits.
        student = logits if bool((t == 1).all()) else logits / t.unsqueeze(-1).to(logits.dtype)
        ret.update(logits_processor_func(student_logits=student, data=batch, data_format=data_format))
    if want_lp:
        ret["log_probs"] = out.log_probs
    return ret


def _engine_class(module):
    """The engine class, whose method is replaced (None when this verl has none)."""
    return getattr(module, _CLASS, None)


#: What this route replaces in verl, checked before anything is patched.
TARGETS = (
    Target(TARGET_MODULE, _METHOD, lm_head_logits_processor,
           check_parameters(f"{_CLASS}.{_METHOD}", _EXPECTED, "verl (written for verl 0.9)"), holder=_engine_class),
)
