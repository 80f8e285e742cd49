"""TRL 1.16: drop-ins for ``trl.trainer.utils``'s helpers, and the fused head inside TRL's trainers.

**Drop-ins** with TRL 1.16's signatures and semantics:
:func:`selective_log_softmax` (``temperature``, ``row_mask``, an index of
shape ``(...)`` or ``(..., K)``), :func:`entropy_from_logits` and
:func:`selective_log_softmax_and_entropy`. They read the logits in chunks,
never write them, save only a few floats per token, return float32 (TRL
returns the logits' dtype), and give the entropy its exact gradient.

**Trainers.** TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` compute their
per-token log-probs and entropies in ``_get_per_token_logps_and_entropies``,
through the fused LM head TRL adds to the model (``add_fused_lm_head``),
whose per-token math is TRL's ``ChunkedLogProbFunction``.
:func:`patch_trainer` makes that method run the math of
:func:`~chunked_entropy.linear_log_probs_and_entropy` instead, for that
trainer only: TRL keeps doing everything around it (the backbone, the batch
split by ``batch_size``, the MoE ``aux_loss`` of ``compute_aux_loss``, the
``cast_lm_head_to_fp32`` cast, masking), and returns its usual
``(logps, entropies, aux_loss)``. The entropy has its exact gradient, so
``entropy_coef`` (TRL's entropy bonus) trains through it.

**Distillation.** TRL 1.16's ``DistillationTrainer`` computes its loss in
``trl.trainer.distillation_trainer._chunked_divergence_loss`` (over
``ChunkedDivergenceFunction``, both models' hidden states and LM heads).
:func:`patch_distillation_trainer` makes that call run
:func:`chunked_divergence_loss` instead, for that trainer only: the loss of
:func:`~chunked_entropy.linear_divergence_loss` (gradients formed in forward:
four projection-sized matmuls per step instead of six), with TRL's ``beta``
(:meth:`~chunked_entropy.Divergence.from_trl_beta`), transforms, temperature and reduction.

Tested with TRL 1.16.0 and Transformers 5.24.0.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Optional

import torch

from .._checks import check_chunk, is_finite_real, value_repr
from ..divergence import linear_divergence_loss
from ..linear import linear_log_probs_and_entropy
from ..logits import log_probs_and_entropy
from ..options import Chunking, Divergence, OutputLayer
from ._common import MethodPatch, check_chunk_size, check_id_dtype, check_id_range, check_ids, check_logits

__all__ = [
    "FusedHeadKernel",
    "chunked_divergence_loss",
    "divergence_keywords",
    "entropy_from_logits",
    "patch_distillation_trainer",
    "patch_trainer",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "unpatch_distillation_trainer",
    "unpatch_trainer",
]


def _check_index(index, logits, *, allow_k: bool) -> bool:
    """Whether ``index`` is ``(..., K)`` (True) or ``(...)`` (False); a clear error otherwise."""
    if not (allow_k and isinstance(index, torch.Tensor) and index.dim() == logits.dim()):
        check_ids("index", index, logits)
        return False
    check_id_dtype("index", index)
    lead = logits.shape[:-1]
    if index.shape[:-1] == lead:
        return True
    raise ValueError(
        f"index must have shape {tuple(lead)} or {tuple(lead)} + (K,) (the logits' without num_classes), "
        f"got {tuple(index.shape)}"
    )


def _check_row_mask(row_mask, index) -> Optional[torch.Tensor]:
    if row_mask is None:
        return None
    if not isinstance(row_mask, torch.Tensor) or row_mask.shape != index.shape:
        shape = tuple(row_mask.shape) if isinstance(row_mask, torch.Tensor) else type(row_mask).__name__
        raise ValueError(f"row_mask must be a tensor shaped like index {tuple(index.shape)}, got {shape}")
    return row_mask != 0


def _temperature(temperature) -> float:
    """TRL's ``temperature`` as a float: any real number (``numpy.float32`` included) or a one-element tensor, as
    TRL's ``logits / temperature`` takes them (a tensor is read on the host, as TRL's ``temperature <= 0`` reads
    it); > 0, else a clear error (the core's check names a float32-overflowing one)."""
    if isinstance(temperature, torch.Tensor) and temperature.numel() == 1 and temperature.dtype != torch.bool \
            and not temperature.dtype.is_complex:
        value = float(temperature)
    elif isinstance(temperature, numbers.Real) and not isinstance(temperature, bool):
        if not is_finite_real(temperature) and temperature > 0:  # an int too large for a float: named here
            raise ValueError(f"temperature must be a finite float > 0, got {value_repr(temperature)}")
        value = float(temperature)
    else:
        got = (f"a tensor of shape {tuple(temperature.shape)} and dtype {temperature.dtype}"
               if isinstance(temperature, torch.Tensor) else type(temperature).__name__)
        raise TypeError(f"temperature must be a float > 0 (or a one-element tensor), got {got}")
    if not value > 0:  # NaN included
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    return value


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    *,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """``log_softmax(logits / temperature, -1)`` gathered at ``index``, chunked (TRL's signature).

    Args:
        logits: ``(..., num_classes)``, any float dtype; never written.
        index: ``(...)`` or ``(..., K)`` int64 class ids (``K`` per position,
            e.g. top-K; ``K = 0`` gives an empty result).
        temperature: a float > 0 (or a one-element tensor) the logits are
            divided by (inside the chunk loop: no scaled copy is made).
        row_mask: like ``index``; where 0 the result is 0 with no gradient.
        chunk_size: tokens per chunk (not in TRL's signature; keyword only).

    Returns:
        float32 log-probabilities shaped like ``index`` (float64 for float64 logits).

    Memory:
        One chunked pass over the logits whatever ``K``: saved for backward
        are a reference to ``logits`` and a few float32 per position (with
        ``(..., K)`` ids, also the ids). Forward allocates one float32
        ``[chunk_size, num_classes]`` buffer; the ``K`` ids' gradient is
        added to each chunk's in float32 before the logits' dtype is
        rounded to once.
    """
    check_logits(logits)
    has_k = _check_index(index, logits, allow_k=True)
    keep = _check_row_mask(row_mask, index)
    temperature = _temperature(temperature)
    check_chunk_size(chunk_size)
    check_id_range("index", index, logits.shape[-1])  # as TRL's gather: every id, masked rows too
    if has_k and index.shape[-1] == 0:  # no id per row: an empty result, still a function of the logits
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return logits.gather(-1, index.long()).to(dtype)
    if has_k:  # the core's K log-probs per row, one pass; each logit's gradient formed in float32, rounded once
        lp = log_probs_and_entropy(logits, None, chunking=chunk_size, temperature=temperature,
                                   compute_entropy=False, log_probs_at=index.long()).log_probs_at
    else:
        lp = log_probs_and_entropy(logits, index, chunking=chunk_size, temperature=temperature,
                                   compute_entropy=False).log_probs
    return lp if keep is None else torch.where(keep, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits, -1)`` for each row, chunked (TRL's signature).

    Args:
        logits: ``(..., num_classes)``, any float dtype; never written.
        chunk_size: rows of the flattened logits per chunk (TRL's meaning).

    Returns:
        ``logits.shape[:-1]`` float32 entropies (float64 for float64 logits),
        with the exact gradient.

    Memory:
        Saved for backward: a reference to ``logits`` and three float32 per
        row. Forward allocates two float32 ``[chunk_size, num_classes]``
        buffers; backward allocates the gradient and at most two such buffers.
    """
    check_logits(logits)
    check_chunk("chunk_size", chunk_size)
    # No label: every row's label is ignore_index, so only the entropy is computed.
    no_label = torch.full(logits.shape[:-1], -100, dtype=torch.int64, device=logits.device)
    return log_probs_and_entropy(logits, no_label, chunking=chunk_size).entropy


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    entropy_requires_grad: bool = True,
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    *,
    chunk_size: int = 1024,
):
    """Log-probs at ``index`` and entropy, in one chunked pass (TRL's signature).

    Args:
        logits: ``(..., num_classes)``, any float dtype; never written.
        index: ``(...)`` int64 class ids.
        entropy_requires_grad: whether the entropy carries a gradient.
        temperature: a float > 0 (or a one-element tensor) the logits are divided by.
        row_mask: like ``index``; where 0 both outputs are 0 with no gradient.
        chunk_size: tokens per chunk (keyword only).

    Returns:
        ``(log_probs, entropy)``, float32, shaped like ``index``.
    """
    check_logits(logits)
    _check_index(index, logits, allow_k=False)
    keep = _check_row_mask(row_mask, index)
    temperature = _temperature(temperature)
    check_chunk_size(chunk_size)
    if not isinstance(entropy_requires_grad, bool):
        raise TypeError(f"entropy_requires_grad must be a bool, got {entropy_requires_grad!r}")
    check_id_range("index", index, logits.shape[-1])
    lp, ent = log_probs_and_entropy(logits, index, chunking=chunk_size, temperature=temperature)
    if not entropy_requires_grad:
        ent = ent.detach()
    if keep is not None:
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        lp, ent = torch.where(keep, lp, zero), torch.where(keep, ent, zero)
    return lp, ent


# ----------------------------------------------------------------------------- trainers

#: The per-token fields of TRL's fused LM head that this library computes.
SUPPORTED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs")


class FusedHeadKernel:
    """Stands in for TRL's ``ChunkedLogProbFunction`` (same ``apply`` arguments and results).

    ``apply(hidden, weight, bias, targets, temperature, chunk_size,
    final_logit_softcapping, logit_scale, outputs)`` returns
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` for
    ``hidden [N, H]`` and ``targets [N]``, computed by
    :func:`~chunked_entropy.linear_log_probs_and_entropy`: TRL's
    ``chunk_size`` (a vocabulary tile) becomes ``vocab_chunk_size``, and this
    object's ``chunk_size`` is the number of tokens per chunk. The matmul runs
    in the autocast dtype when autocast is on (as TRL's does), else in the
    hidden states' dtype (the weight is cast to it, e.g. under
    ``cast_lm_head_to_fp32``: a float32 copy of the weight for the call).
    ``mean_logits`` and ``is_top1`` (DPO's metrics) are not computed; asking
    for them raises NotImplementedError. ``calls`` counts the calls.
    """

    def __init__(self, chunk_size: int = 1024):
        check_chunk("chunk_size", chunk_size)
        self.chunk_size = chunk_size
        self.calls = 0
        self._chunkings = {}  # TRL's vocabulary tile -> the Chunking, built once per tile

    def _chunking(self, vocab_chunk_size) -> Chunking:
        chunking = self._chunkings.get(vocab_chunk_size)
        if chunking is None:
            chunking = self._chunkings[vocab_chunk_size] = Chunking(self.chunk_size, vocab_chunk_size)
        return chunking

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0, outputs=("log_probs",)):
        missing = [name for name in outputs if name not in SUPPORTED_OUTPUTS]
        if missing:
            raise NotImplementedError(
                f"chunked_entropy's head computes {SUPPORTED_OUTPUTS}; TRL asked also for {tuple(missing)}"
            )
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        self.calls += 1
        with torch.autocast(device, enabled=False):
            # TRL hands the head's weight per call (cast, or gathered by FSDP): the layer is built per call
            layer = OutputLayer(weight.to(dtype), None if bias is None else bias.to(dtype),
                                softcap=final_logit_softcapping,
                                logit_scale=None if logit_scale == 1.0 else logit_scale)
            out = linear_log_probs_and_entropy(
                hidden.to(dtype), layer, targets, chunking=self._chunking(chunk_size), temperature=float(temperature),
                compute_entropy="entropy" in outputs, compute_sum_pi_squared="log_sum_sq_probs" in outputs,
            )
        log_sum_sq = None if out.sum_pi_squared is None else out.sum_pi_squared.detach().log()
        return out.log_probs, out.entropy, log_sum_sq, None, None


#: GRPO / RLOO: while ``_get_per_token_logps_and_entropies`` runs, TRL's fused head's kernel is ours.
_PER_TOKEN = MethodPatch("_get_per_token_logps_and_entropies", "trl.trainer.utils", "_ChunkedLogProbFunction")
#: Distillation: while ``_compute_loss`` runs, TRL's chunked divergence loss is ours.
_DISTILL = MethodPatch("_compute_loss", "trl.trainer.distillation_trainer", "_chunked_divergence_loss")


def patch_trainer(trainer, *, chunk_size: int = 1024) -> FusedHeadKernel:
    """Make a TRL ``GRPOTrainer`` / ``RLOOTrainer`` compute per-token log-probs and entropy with this library.

    Wraps the trainer's ``_get_per_token_logps_and_entropies`` so that, while
    it runs, TRL's fused LM head uses :class:`FusedHeadKernel` (policy and
    reference model alike). Everything else is TRL's own code; the method
    still returns ``(logps, entropies, aux_loss)`` and honours
    ``batch_size``, ``compute_entropy``, ``compute_aux_loss`` and
    ``cast_lm_head_to_fp32``. Idempotent; :func:`unpatch_trainer` undoes it.

    Args:
        trainer: a TRL 1.16 ``GRPOTrainer`` or ``RLOOTrainer`` (built: TRL
            adds its fused head to the model in ``__init__``).
        chunk_size: tokens per chunk of the head.

    Returns:
        The kernel (its ``calls`` counts how often TRL used it).

    Raises:
        TypeError: the trainer has no ``_get_per_token_logps_and_entropies``
            (DPO, KTO and SFT compute their outputs elsewhere, and DPO's
            metrics need ``mean_logits`` / ``is_top1``, which this head does
            not compute). Nothing is patched.
        RuntimeError: this TRL has no ``trl.trainer.utils._ChunkedLogProbFunction``
            (not TRL 1.16's fused head). Nothing is patched.
    """
    if not callable(getattr(type(trainer), "_get_per_token_logps_and_entropies", None)):
        raise TypeError(
            f"patch_trainer needs a TRL trainer with _get_per_token_logps_and_entropies (GRPOTrainer, "
            f"RLOOTrainer), got {type(trainer).__name__}"
        )
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "_ChunkedLogProbFunction"):
        raise RuntimeError(
            "this TRL has no trl.trainer.utils._ChunkedLogProbFunction (TRL 1.16's fused LM head); "
            "nothing was patched"
        )
    return _PER_TOKEN.patch(trainer, lambda: FusedHeadKernel(chunk_size))


def unpatch_trainer(trainer) -> None:
    """Undo :func:`patch_trainer` (a no-op on an unpatched trainer)."""
    _PER_TOKEN.unpatch(trainer)


# ----------------------------------------------------------------------------- DistillationTrainer


def divergence_keywords(beta, *, temperature=1.0, student_logit_scale=1.0, teacher_logit_scale=1.0,
                        student_softcap=None, teacher_softcap=None) -> dict:
    """TRL's divergence settings as 0.1's flat keywords of :func:`~chunked_entropy.linear_divergence`.

    TRL's ``beta``: 0 the forward KL(teacher || student), 1 the reverse KL(student || teacher), in between
    the generalized JSD with the mixture ``(1 - beta) p_s + beta p_t`` (the mapping is
    :meth:`~chunked_entropy.Divergence.from_trl_beta`'s). A logit scale of 1.0 is no scale. Kept for 0.1's
    callers (the keywords go in 0.3.0): 0.2's form is ``divergence=Divergence.from_trl_beta(beta)`` and an
    :class:`~chunked_entropy.OutputLayer` per model, as :func:`chunked_divergence_loss` builds them.
    Deprecated since 0.2.0: every call warns (``DeprecationWarning``); removed in 0.3.0 with 0.1's keywords.
    """
    warnings.warn(
        "divergence_keywords returns 0.1's keywords of linear_divergence, which are 0.1's and go in 0.3.0: pass "
        "divergence=Divergence.from_trl_beta(beta), temperature=, and student_layer=/teacher_layer="
        "OutputLayer(weight, bias, softcap=..., logit_scale=...) (see CHANGELOG.md)",
        DeprecationWarning, stacklevel=2)
    divergence = Divergence.from_trl_beta(beta)
    return dict(divergence=divergence.kind, beta=divergence.beta, temperature=float(temperature),
                student_logit_scale=_scale(student_logit_scale), teacher_logit_scale=_scale(teacher_logit_scale),
                student_softcap=student_softcap, teacher_softcap=teacher_softcap)


def _scale(logit_scale):
    """TRL's logit scale as an :class:`~chunked_entropy.OutputLayer`'s: 1.0 (TRL's default) is none."""
    return None if logit_scale is None or logit_scale == 1.0 else logit_scale


def _whole(weight, bias, dtype):
    """A head's weight and bias as plain tensors in ``dtype`` (an FSDP2 DTensor gathered once, as TRL does)."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                            teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                            student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
                            teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                            teacher_final_logit_softcapping=None, temperature=1.0, *, chunk_size: int = 256):
    """TRL 1.16's ``_chunked_divergence_loss`` (same arguments and results) on
    :func:`~chunked_entropy.linear_divergence_loss`.

    Returns ``(loss, entropy_sum, n_valid)``: the divergence summed over the rows where
    ``completion_mask`` is nonzero (only those rows are projected), divided by ``num_items_in_batch``
    (or, when None, by the count of those rows, at least 1); the student's entropy (at ``temperature``,
    detached) summed over them; the count. Each model's matmul runs in the autocast dtype when autocast
    is on (as TRL's does), else in its hidden states' dtype; half precision is projected to float32
    logits, as TRL projects.
    """
    divergence = Divergence.from_trl_beta(beta)  # a bad beta is named before any work
    device = student_hidden_states.device.type
    autocast = torch.is_autocast_enabled(device)
    s_dtype = torch.get_autocast_dtype(device) if autocast else student_hidden_states.dtype
    t_dtype = torch.get_autocast_dtype(device) if autocast else teacher_hidden_states.dtype
    ws, bs = _whole(student_lm_head_weight, student_lm_head_bias, s_dtype)
    wt, bt = _whole(teacher_lm_head_weight, teacher_lm_head_bias, t_dtype)
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    # Only the completion rows are projected (as TRL's Triton path does): one boolean index of each model's
    # hidden states, whose backward scatters the student's gradient back
    hs = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])[valid].to(s_dtype)
    ht = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])[valid].to(t_dtype)
    if num_items_in_batch is None:
        num_items_in_batch = n_valid.clamp(min=1)
    # a half-precision model is projected to float32 logits, as TRL projects (a float32 one is already)
    f32 = lambda dtype: torch.float32 if dtype in (torch.bfloat16, torch.float16) else None  # noqa: E731
    student = OutputLayer(ws, bs, softcap=student_final_logit_softcapping, logit_scale=_scale(student_logit_scale),
                          logits_dtype=f32(s_dtype))
    teacher = OutputLayer(wt, bt, softcap=teacher_final_logit_softcapping, logit_scale=_scale(teacher_logit_scale),
                          logits_dtype=f32(t_dtype))
    with torch.autocast(device, enabled=False):
        res = linear_divergence_loss(
            hs, student, ht, teacher, divergence=divergence, chunking=chunk_size, temperature=float(temperature),
            compute_entropy=True, reduction="sum", normalizer=num_items_in_batch,
        )
    return res.loss, res.entropy.sum(), n_valid


def patch_distillation_trainer(trainer, *, chunk_size: int = 256):
    """Make a TRL 1.16 ``DistillationTrainer`` compute its loss with :func:`chunked_divergence_loss`.

    Wraps the trainer's ``_compute_loss`` so that, while it runs, TRL's ``_chunked_divergence_loss`` is this
    library's (for this trainer only). Everything else is TRL's: the backbones, the completion and tool
    masks, the reduction by ``num_items_in_batch``, the entropy metric. Idempotent;
    :func:`unpatch_distillation_trainer` undoes it. Returns the loss function in use (its ``calls``
    counts the calls).

    Raises:
        TypeError: the trainer is not a ``DistillationTrainer`` (no ``_compute_loss``). Nothing is patched.
        RuntimeError: this TRL has no ``trl.trainer.distillation_trainer._chunked_divergence_loss``.
    """
    check_chunk("chunk_size", chunk_size)
    if not callable(getattr(type(trainer), "_compute_loss", None)) or not hasattr(trainer, "teacher_model"):
        raise TypeError(f"patch_distillation_trainer needs TRL's DistillationTrainer, got {type(trainer).__name__}")
    import trl.trainer.distillation_trainer as trl_distill

    if not hasattr(trl_distill, "_chunked_divergence_loss"):
        raise RuntimeError("this TRL has no trl.trainer.distillation_trainer._chunked_divergence_loss (TRL 1.16's "
                           "chunked loss); nothing was patched")
    def make():
        def loss(*args, **kwargs):
            loss.calls += 1
            return chunked_divergence_loss(*args, **kwargs, chunk_size=chunk_size)

        loss.calls = 0
        return loss

    return _DISTILL.patch(trainer, make)


def unpatch_distillation_trainer(trainer) -> None:
    """Undo :func:`patch_distillation_trainer` (a no-op on an unpatched trainer)."""
    _DISTILL.unpatch(trainer)
