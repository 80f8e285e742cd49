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

Tested with TRL 1.16.0 and Transformers 5.24.0.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from .._checks import check_chunk
from ..linear import linear_log_probs_and_entropy
from ..logits import log_probs_and_entropy
from ._common import check_id_dtype, check_id_range, check_ids, check_logits

__all__ = [
    "FusedHeadKernel",
    "entropy_from_logits",
    "patch_trainer",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "unpatch_trainer",
]


def _check_index(index, logits, *, allow_k: bool) -> bool:
    """Whether ``index`` is ``(..., K)`` (True) or ``(...)`` (False); a clear error otherwise."""
    if not (allow_k and isinstance(index, torch.Tensor) and index.dim() == logits.dim()):
        check_ids("index", index, logits)
        return False
    check_id_dtype("index", index)
    lead = logits.shape[:-1]
    if index.shape[:-1] == lead and index.shape[-1] >= 1:
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


def _check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")


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
            e.g. top-K).
        temperature: a float > 0 the logits are divided by (inside the
            chunk loop: no scaled copy is made).
        row_mask: like ``index``; where 0 the result is 0 with no gradient.
        chunk_size: tokens per chunk (not in TRL's signature; keyword only).

    Returns:
        float32 log-probabilities shaped like ``index`` (float64 for float64 logits).

    Memory:
        One chunked pass over the logits whatever ``K``: saved for backward
        are a reference to ``logits`` and two float32 per position (plus,
        for ``K > 1``, the ``K`` gathered logits). Forward allocates one
        float32 ``[chunk_size, num_classes]`` buffer.
    """
    check_logits(logits)
    has_k = _check_index(index, logits, allow_k=True)
    keep = _check_row_mask(row_mask, index)
    _check_temperature(temperature)
    check_id_range("index", index, logits.shape[-1])  # as TRL's gather: every id, masked rows too
    # With K ids per row, every log-prob is read off the row's largest logit, whose own log-prob is finite
    # whatever the others hold (a masked -inf or finfo.min id among the K would make an anchor of NaN or 0):
    # log p_k = log p_max + (z_k - z_max) / t, one pass over the vocabulary for all K ids.
    anchor = logits.argmax(dim=-1) if has_k else index
    lp = log_probs_and_entropy(
        logits, anchor, chunk_size=chunk_size, temperature=temperature, compute_entropy=False
    ).log_probs
    if has_k:
        z = logits.gather(-1, index).to(lp.dtype)
        z_max = logits.gather(-1, anchor.unsqueeze(-1)).to(lp.dtype)
        lp = lp.unsqueeze(-1) + (z - z_max) / temperature
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
    return log_probs_and_entropy(logits, no_label, chunk_size=chunk_size).entropy


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
        temperature: a float > 0 the logits are divided by.
        row_mask: like ``index``; where 0 both outputs are 0 with no gradient.
        chunk_size: tokens per chunk (keyword only).

    Returns:
        ``(log_probs, entropy)``, float32, shaped like ``index``.
    """
    check_logits(logits)
    _check_index(index, logits, allow_k=False)
    keep = _check_row_mask(row_mask, index)
    _check_temperature(temperature)
    if not isinstance(entropy_requires_grad, bool):
        raise TypeError(f"entropy_requires_grad must be a bool, got {entropy_requires_grad!r}")
    check_id_range("index", index, logits.shape[-1])
    lp, ent = log_probs_and_entropy(logits, index, chunk_size=chunk_size, temperature=temperature)
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
            out = linear_log_probs_and_entropy(
                hidden.to(dtype), weight.to(dtype), targets, bias=None if bias is None else bias.to(dtype),
                chunk_size=self.chunk_size, vocab_chunk_size=chunk_size, temperature=float(temperature),
                softcap=final_logit_softcapping, logit_scale=None if logit_scale == 1.0 else logit_scale,
                compute_entropy="entropy" in outputs, compute_sum_pi_squared="log_sum_sq_probs" in outputs,
            )
        log_sum_sq = None if out.sum_pi_squared is None else out.sum_pi_squared.detach().log()
        return out.log_probs, out.entropy, log_sum_sq, None, None


@contextlib.contextmanager
def _kernel_swapped(kernel):
    import trl.trainer.utils as trl_utils

    previous = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = kernel
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = previous


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
    existing = trainer.__dict__.get("_get_per_token_logps_and_entropies")
    if existing is not None and hasattr(existing, "chunked_entropy_kernel"):
        return existing.chunked_entropy_kernel
    kernel = FusedHeadKernel(chunk_size)
    original = trainer._get_per_token_logps_and_entropies

    @functools.wraps(original)
    def per_token_logps_and_entropies(*args, **kwargs):
        with _kernel_swapped(kernel):
            return original(*args, **kwargs)

    per_token_logps_and_entropies.chunked_entropy_kernel = kernel
    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    return kernel


def unpatch_trainer(trainer) -> None:
    """Undo :func:`patch_trainer` (a no-op on an unpatched trainer)."""
    existing = trainer.__dict__.get("_get_per_token_logps_and_entropies")
    if existing is not None and hasattr(existing, "chunked_entropy_kernel"):
        del trainer.__dict__["_get_per_token_logps_and_entropies"]
