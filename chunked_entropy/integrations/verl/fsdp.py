"""verl 0.9, FSDP engine: every route of the output layer (unfused and fused) through this library.

verl 0.9's ``FSDPEngineWithLMHead`` (``verl/workers/engine/fsdp/transformer_impl.py``)
turns the model's output into log-probs, entropy, ``sum_pi_squared`` and the
top-k distillation keys in ``prepare_model_outputs``:

- **unfused** (the default): from the model's ``[T, V]`` logits (padding
  removed, ``[1, T/sp, V]``) or ``[B, S, V]`` (padding kept), with an
  out-of-place ``logits / temperature`` copy, a full softmax saved for the
  entropy, two log-sum-exps of ``2 * logits`` for ``sum_pi_squared``, a
  ``log_softmax`` and ``topk`` of ``[T, V]`` for distillation, a second
  ``[T, V]`` copy (``torch.cat``) with padding kept, and the full vocabulary
  gathered on every rank (``full_tensor()``) from a vocabulary-sharded DTensor;
- **fused** (``use_fused_kernels=True``): the model's forward (verl's
  ``forward_with_torch_backend`` / ``forward_with_triton_backend`` of every
  model family) calls ``FusedLinearForPPO`` (torch or Liger) or the Triton
  ``linear_cross_entropy`` with the lm_head weight. verl asserts the per-sample
  temperature out, refuses ``sum_pi_squared``, produces no distillation keys,
  and fails on an untied lm_head under FSDP2 (the weight is still sharded).

With :func:`chunked_entropy.integrations.verl.install` (nothing in verl is
edited), these :data:`TARGETS` are replaced:

- ``FSDPEngineWithLMHead.prepare_model_outputs`` → :func:`prepare_model_outputs`:
  the unfused route from the logits with
  :func:`~chunked_entropy.log_probs_and_entropy` (one chunked pass, the logits
  never written nor copied; a vocabulary-sharded DTensor's local shard with
  its process group); the fused route's outputs assembled, with
  ``sum_pi_squared`` and the distillation keys from the same fused pass.
- ``FSDPEngineWithLMHead.prepare_model_inputs`` → :func:`prepare_model_inputs`:
  verl's own, plus a clear error for a bad temperature; on the fused route it
  lets the per-sample temperature through (per token, as verl expands and
  splits it) and tells the fused kernel what this micro-batch needs, and which
  rows verl reads (only those are projected: each RL sequence's response
  positions, unless ``CHUNKED_ENTROPY_VERL_ROWS=0``).
- ``FusedLinearForPPO.forward`` (torch and Liger backends) and
  ``linear_cross_entropy`` (Triton; served for the FSDP engine only, verl's
  Megatron fused forward keeps its own) → :func:`fused_linear_for_ppo_forward`,
  :func:`linear_cross_entropy`: :func:`~chunked_entropy.linear_log_probs_and_entropy`
  on any device; an FSDP2-sharded untied lm_head is gathered by FSDP2 itself
  (the head runs as that module's forward, so FSDP2 unshards it, and
  reduce-scatters its gradient, as for its own forward).

What the plugin cannot serve runs verl's own code, with one logged warning
naming the reason.

Tested with verl 0.9.1, torch 2.13 (FSDP2 over gloo, world sizes 1 and 2) and
transformers 5.24 (Qwen2).
"""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..._checks import is_finite_real, require, value_repr
from ..._dtensor import is_dtensor, vocab_shard
from ...linear import linear_log_probs_and_entropy
from ...logits import log_probs_and_entropy
from ...options import OutputLayer
from .._common import Target, check_id_range, check_parameters, engine_chunk_size, sharded_over
from ._distill import distillation_keys, teacher_topk

__all__ = [
    "FUSED_MODULE", "TARGET_MODULE", "TARGETS", "TRITON_MODULE", "forward_step", "fused_linear_for_ppo_forward",
    "linear_cross_entropy", "prepare_model_inputs", "prepare_model_outputs",
]

logger = logging.getLogger("chunked_entropy.integrations")

#: The verl module whose ``FSDPEngineWithLMHead`` is patched.
TARGET_MODULE = "verl.workers.engine.fsdp.transformer_impl"
#: verl's fused-kernel modules: ``FusedLinearForPPO`` (torch, Liger) and the Triton ``linear_cross_entropy``.
FUSED_MODULE = "verl.utils.experimental.torch_functional"
TRITON_MODULE = "verl.utils.kernel.linear_cross_entropy"
_CLASS = "FSDPEngineWithLMHead"
_FUSED_CLASS = "FusedLinearForPPO"
_WHERE = "verl (written for verl 0.9)"

_ORIGINAL = {}  # verl's own functions, recorded when their signatures are checked (for the fallback)
_WARNED = set()
_LOCAL = threading.local()  # the fused request of the micro-batch in flight, per thread


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("chunked_entropy: verl's own FSDP output layer runs here: %s", reason)


def _flag(micro_batch, key: str, default):
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def _check_temperature(temperature) -> None:
    """verl's ``micro_batch["temperature"]``: finite and > 0 (a float, or one per sample), before any work."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(f'micro_batch["temperature"] must be a float or a float tensor, got {temperature.dtype}')
        bad = ~(torch.isfinite(temperature) & (temperature > 0))

        def found():  # read only once the check failed
            i = int(bad.reshape(-1).nonzero()[0, 0])
            return (f'micro_batch["temperature"] must be finite and > 0 for every sample; sample {i} has '
                    f"{float(temperature.reshape(-1)[i])!r}")

        found.summary = 'micro_batch["temperature"] must be finite and > 0 for every sample'
        require(~bad.any(), found)  # one read on an accelerator (a ValueError, never a device-side assert)
    elif not isinstance(temperature, (int, float)) or not is_finite_real(temperature) or temperature <= 0:
        raise ValueError(f'micro_batch["temperature"] must be a finite float > 0 (or one per sample), got '
                         f"{value_repr(temperature)}")


# ----------------------------------------------------------------------------- what a fused micro-batch needs


@dataclass
class _Request:
    """What the fused kernel computes for the micro-batch in flight, and what it hands back."""

    engine: object
    entropy: bool
    sum_pi_squared: bool
    teacher: Optional[tuple]  # (clamp, ids [*, K] in the hidden states' layout, log-probs likewise)
    rows: Optional[torch.Tensor] = None  # the rows verl reads, a bool mask in the hidden states' layout (None: all)
    served: bool = False
    extra: dict = field(default_factory=dict)


def _ours(engine) -> bool:
    """Whether this engine's outputs are assembled by :func:`prepare_model_outputs` (not a value head's)."""
    return getattr(type(engine).prepare_model_outputs, "__code__", None) is prepare_model_outputs.__code__


def prepare_model_inputs(self, micro_batch):
    """verl's ``FSDPEngineWithLMHead.prepare_model_inputs``, with the fused route's per-sample temperature.

    Checks ``micro_batch["temperature"]`` first (finite and > 0; a clear
    error instead of verl's silent ``clamp(min=1e-8)``). On the unfused route
    it is verl's own. On the fused route the inputs are prepared as verl
    prepares the unfused route's (the per-sample temperature expanded to the
    tokens and split for Ulysses as verl splits it), then given the fused
    forward's arguments as verl gives them (``temperature``, here per token,
    ``return_dict``, and the globally rolled ``shift_labels``); what the
    micro-batch asks for (entropy, ``sum_pi_squared``, verl's top-k
    distillation) is left for the fused kernel, which this module replaces.
    """
    original = _ORIGINAL["prepare_model_inputs"]
    temperature = micro_batch["temperature"]
    _check_temperature(temperature)
    _LOCAL.request = None
    if not (_flag(micro_batch, "use_fused_kernels", False) and _ours(self)):
        return original(self, micro_batch)
    remove_padding = _flag(micro_batch, "use_remove_padding", True)
    if not isinstance(temperature, torch.Tensor):
        model_inputs, output_args = original(self, micro_batch)
    else:  # verl's fused route asserts this out; its unfused preparation expands and splits it per token
        from verl.utils import tensordict_utils as tu

        unfused = micro_batch.copy()
        tu.assign_non_tensor(unfused, use_fused_kernels=False)
        model_inputs, output_args = original(self, unfused)
        t = output_args["temperature_rmpad"].unsqueeze(0) if remove_padding else output_args["temperature"][:, None]
        model_inputs.update(temperature=t, return_dict=True)
        if remove_padding:
            model_inputs["shift_labels"] = output_args["input_ids_rmpad_rolled"].unsqueeze(0)
    teacher = None
    if _flag(micro_batch, "distillation_use_topk", False):
        teacher = _teacher(getattr(_LOCAL, "loss_function", None), micro_batch, remove_padding)
    _LOCAL.request = _Request(self, bool(_flag(micro_batch, "calculate_entropy", False)),
                              bool(_flag(micro_batch, "calculate_sum_pi_squared", False)), teacher,
                              _read_rows(self, micro_batch, remove_padding))
    return model_inputs, output_args


def _read_rows(engine, micro_batch, remove_padding: bool) -> Optional[torch.Tensor]:
    """The rows verl reads (:func:`~chunked_entropy.integrations.verl.megatron_fused.read_rows`: each RL
    sequence's response positions) in the fused kernel's hidden-state layout, or None (every row: an SFT
    micro-batch, a vision model under Ulysses, or ``CHUNKED_ENTROPY_VERL_ROWS=0``).

    Packed (``use_remove_padding``): ``[1, T]``, padded and split as verl pads and splits the packed tokens
    (its bucket padding, then Ulysses' pad-and-slice), the pads unread. Padded: ``[B, S]``.
    """
    from verl.workers.engine.fsdp import transformer_impl as verl_impl

    from .megatron_fused import read_rows, rows_enabled

    if not rows_enabled():
        return None
    mask = read_rows(micro_batch, micro_batch["input_ids"])
    if mask is None:
        return None
    values = mask.values()
    if not remove_padding:
        padded = _padded_mask(micro_batch)
        return torch.zeros(padded.shape, dtype=torch.bool, device=values.device).masked_scatter_(padded, values)
    packed = values.unsqueeze(0)
    static_pad = engine._get_packed_pad_size(packed.size(-1))
    if static_pad:
        packed, _ = verl_impl.pad_packed_inputs(packed, None, static_pad)
    if getattr(engine, "use_ulysses_sp", False):
        module = getattr(engine.module, "module", engine.module)
        if hasattr(getattr(module, "config", None), "vision_config"):
            return None  # verl slices a vision model's inputs after the embedding
        packed, _, _ = verl_impl.ulysses_pad_and_slice_inputs(
            packed, position_ids_rmpad=None, sp_size=engine.ulysses_sequence_parallel_size)
    return packed


def _teacher(loss_function, micro_batch, remove_padding: bool):
    """verl's top-k teacher (clamp, ids, log-probs) in the hidden states' layout, or None (not verl's loss)."""
    found = teacher_topk(loss_function, micro_batch, "thd", strategy="fsdp")
    if found is None:
        return None
    clamp, ids, lp = found  # [1, T(/sp), K]: split as verl splits them for Ulysses
    if not remove_padding:
        mask = _padded_mask(micro_batch)
        ids = ids.new_zeros(*mask.shape, ids.shape[-1]).masked_scatter_(mask[..., None], ids[0])
        lp = lp.new_zeros(*mask.shape, lp.shape[-1]).masked_scatter_(mask[..., None], lp[0])
    return clamp, ids, lp


def _padded_mask(micro_batch) -> torch.Tensor:
    """``[B, S]``: where the padded layout holds a token (verl pads each row to the longest)."""
    lengths = micro_batch["input_ids"].offsets().diff()
    width = int(lengths.max())
    return torch.arange(width, device=lengths.device) < lengths[:, None]


def forward_step(self, micro_batch, loss_function, forward_only):
    """verl's ``FSDPEngineWithLMHead.forward_step``, unchanged, with verl's loss function made known to
    :func:`prepare_model_inputs` (the fused kernel forms verl's top-k distillation keys from it)."""
    _LOCAL.loss_function = loss_function
    try:
        return _ORIGINAL["forward_step"](self, micro_batch, loss_function, forward_only)
    finally:
        _LOCAL.loss_function = None
        _LOCAL.request = None


# ----------------------------------------------------------------------------- the outputs


def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
    """verl's ``FSDPEngineWithLMHead.prepare_model_outputs``, from this library.

    Args and returns as verl's: the model's ``output`` (``.logits``, or the
    fused forward's ``.log_probs`` / ``.entropy``), ``output_args`` from
    ``prepare_model_inputs``, the micro-batch and verl's loss function; a dict
    of nested (jagged) per-token tensors: ``log_probs`` (unless
    ``distillation_only``), ``entropy``, ``sum_pi_squared`` and verl's top-k
    distillation keys as asked, float32, with exact gradients.

    Unfused route: one :func:`~chunked_entropy.log_probs_and_entropy` pass
    over the logits as the model returns them (``[1, T/sp, V]`` packed, or
    ``[B, S, V]`` with padding kept: the padding rows are masked, not cut
    out), the per-token temperature inside the loop, the chunk size verl's
    ``entropy_from_logits_chunk_size``. A vocabulary-sharded DTensor gives
    its local shard and its mesh's process group: outputs identical on every
    rank, no rank holds the full vocabulary.

    Fused route: the fused kernel (:func:`fused_linear_for_ppo_forward`)
    already computed everything; assembled here as verl assembles its outputs.

    Memory (unfused): saved for backward, a reference to the logits (the
    model keeps them) and two to four float32 per token; forward allocates one
    or two float32 ``[chunk, V_local]`` buffers; with top-k distillation,
    ``[T, K]`` float32 and int64. verl's own: a temperature-scaled copy of
    the logits, a float32 softmax of ``[T, V]`` for the entropy, a
    ``log_softmax`` of ``[T, V]`` for distillation, with padding kept a
    second ``[T, V]`` copy, and, sharded, the full vocabulary.
    """
    original = _ORIGINAL["prepare_model_outputs"]
    fused = _flag(micro_batch, "use_fused_kernels", False)
    if fused:
        request, _LOCAL.request = getattr(_LOCAL, "request", None), None
        if request is None or request.engine is not self or not request.served:
            if isinstance(micro_batch["temperature"], torch.Tensor):
                raise RuntimeError("chunked_entropy: verl's fused route with a per-sample temperature was not "
                                   "served by chunked_entropy's fused kernel (the model's forward did not call "
                                   "verl's FusedLinearForPPO or linear_cross_entropy); verl's own cannot serve it")
            _warn_once("the fused forward of this model did not go through verl's fused kernels")
            return original(self, output, output_args, micro_batch, logits_processor_func)
        # the extra outputs left the model's forward by a side door: their gradient must pass through the model's
        # own outputs, where FSDP2 hooks its pre-backward (it gathers the parameters the fused head reads again)
        outs = {k: _Through.apply(v, output.log_probs) for k, v in request.extra.items()}
        if not _flag(micro_batch, "distillation_only", False):
            outs["log_probs"] = output.log_probs
        if request.entropy:
            outs["entropy"] = output.entropy
        return _assemble(self, outs, output_args, micro_batch)
    reason = _unfused_reason(self, output, micro_batch, logits_processor_func)
    if reason is not None:
        _warn_once(reason)
        return original(self, output, output_args, micro_batch, logits_processor_func)
    return _assemble(self, _unfused(self, output, output_args, micro_batch, logits_processor_func), output_args,
                     micro_batch)


class _Through(torch.autograd.Function):
    """``x`` unchanged, whose backward also hands ``anchor`` a zero gradient (so the hooks on ``anchor`` run
    before the backward of what made ``x``)."""

    @staticmethod
    def forward(ctx, x, anchor):
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.anchor
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _unfused_reason(engine, output, micro_batch, logits_processor_func) -> Optional[str]:
    """Why the unfused route cannot be served here (then verl's own runs), or None."""
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    if _flag(micro_batch, "pad_mode", DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
        return "a pad_mode other than no_padding (verl supports none either)"
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        return "the model's output has no logits tensor"
    why = _shard_reason(logits)
    if why is not None:
        return why
    if _flag(micro_batch, "distillation_use_topk", False) and teacher_topk(
            logits_processor_func, micro_batch, "thd", strategy="fsdp") is None:
        return "top-k distillation with a loss function other than verl 0.9's distillation_ppo_loss"
    return None


def _shard_reason(logits) -> Optional[str]:
    """Why the logits cannot be read in place (then verl's own route runs), or None: the core's DTensor reading
    (:func:`chunked_entropy._dtensor.vocab_shard`), on a 1-D mesh (verl's packed rows are the whole batch)."""
    if not is_dtensor(logits):
        return None
    if logits.device_mesh.ndim != 1:
        return f"logits as a DTensor on a {logits.device_mesh.ndim}-D mesh"
    try:
        vocab_shard(logits)
    except ValueError as e:
        return str(e)
    return None


def _local(logits):
    """``(tensor, process group)``: a DTensor's local vocabulary shard and its mesh's group (None for a replica),
    else the logits and None."""
    if not is_dtensor(logits):
        return logits, None
    return logits.to_local(), vocab_shard(logits).group


def _unfused(engine, output, output_args, micro_batch, logits_processor_func) -> dict:
    """The per-token outputs in the model's layout (``[T/sp]`` packed, ``[B, S]`` padded)."""
    want_lp = not _flag(micro_batch, "distillation_only", False)
    entropy = bool(_flag(micro_batch, "calculate_entropy", False))
    spp = bool(_flag(micro_batch, "calculate_sum_pi_squared", False))
    teacher = None
    remove_padding = _flag(micro_batch, "use_remove_padding", True)
    if _flag(micro_batch, "distillation_use_topk", False):
        teacher = _teacher(logits_processor_func, micro_batch, remove_padding)
    logits, group = _local(output.logits)
    unit = output_args.get("temperature_is_one", False)
    if remove_padding:
        logits = logits.squeeze(0)
        labels, mask = output_args["input_ids_rmpad_rolled"], None
        t = 1.0 if unit else output_args["temperature_rmpad"]
        if teacher is not None:
            teacher = (teacher[0], teacher[1].squeeze(0), teacher[2].squeeze(0))
    else:  # [B, S, V]: the padding rows are masked, never cut out (verl's torch.cat copies the rest)
        mask = _padded_mask(micro_batch)
        labels = output_args["input_ids_rmpad_rolled"].new_zeros(mask.shape).masked_scatter_(
            mask, output_args["input_ids_rmpad_rolled"])
        t = 1.0 if unit else output_args["temperature"].to(torch.float32)[:, None]
    ids = None if teacher is None else teacher[1]
    out = log_probs_and_entropy(
        logits, labels if want_lp else None, label_mask=mask if want_lp else None,
        layer=sharded_over(group), chunking=engine_chunk_size(engine.engine_config), temperature=t,
        compute_entropy=entropy, compute_sum_pi_squared=spp, log_probs_at=ids,
        top_k=None if ids is None else ids.shape[-1],
    )
    return _collect(out, want_lp, entropy, spp, teacher)


def _collect(out, want_lp: bool, entropy: bool, spp: bool, teacher) -> dict:
    outs = {}
    if want_lp:
        outs["log_probs"] = out.log_probs
    if entropy:
        outs["entropy"] = out.entropy
    if spp:
        outs["sum_pi_squared"] = out.sum_pi_squared
    if teacher is not None:
        outs.update(distillation_keys(out, *teacher, masses_before_clamp=True))
    return outs


def _assemble(engine, outs: dict, output_args, micro_batch) -> dict:
    """verl's nested outputs from per-token tensors in the model's layout, as verl forms them."""
    cu_seqlens = micro_batch["input_ids"].offsets()
    if _flag(micro_batch, "use_remove_padding", True):
        pad = output_args["pad_size"]

        def pack(v):
            return engine._gather_and_unpad_packed(v.reshape(-1), pad)
    else:
        mask = _padded_mask(micro_batch)

        def pack(v):
            return v[mask]
    return {k: torch.nested.nested_tensor_from_jagged(pack(v), cu_seqlens) for k, v in outs.items()
            if v is not None}


# ----------------------------------------------------------------------------- the fused kernels


def fused_linear_for_ppo_forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
    """verl's ``FusedLinearForPPO.forward`` (torch and Liger backends): ``(log_probs, entropy)``, fused.

    :func:`~chunked_entropy.linear_log_probs_and_entropy` over the lm_head
    ``vocab_weights`` in chunks of ``self.chunk_size`` tokens, on any device;
    ``temperature`` a float or (through :func:`prepare_model_inputs`) a
    per-token tensor. In verl's engine it also computes what the micro-batch
    asks for (``sum_pi_squared``, the top-k distillation keys) in the same
    pass, and runs an FSDP2-sharded lm_head as that module's own forward, so
    FSDP2 gathers its weight (and reduce-scatters its gradient) as it does for
    its forward. The logits never exist: per chunk, one or two float32
    ``[chunk, V]`` buffers.
    """
    return _fused(hidden_states, vocab_weights, input_ids, temperature, int(self.chunk_size), None, "input_ids",
                  lambda: _ORIGINAL["FusedLinearForPPO.forward"](self, hidden_states, vocab_weights, input_ids,
                                                                 temperature))


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """verl's Triton ``linear_cross_entropy``, from this library, on any device, inside verl's FSDP engine.

    As :func:`fused_linear_for_ppo_forward`, with the engine's
    ``entropy_from_logits_chunk_size`` as the chunk. Served only for a
    micro-batch of verl's FSDP engine (``reduction="none"``, no
    ``dist_process_group``); every other caller gets verl's own kernel. verl's
    Megatron fused forward imports this same function, and expects from it a
    per-rank partial hidden-state gradient that Megatron's sequence-parallel
    gather reduces afterwards: this module's would be summed already.
    """
    request = getattr(_LOCAL, "request", None)

    def verls():
        return _ORIGINAL["linear_cross_entropy"](hidden, weight, labels, temperature, reduction, dist_process_group)

    if request is None or reduction != "none" or dist_process_group is not None:
        return verls()
    chunk = int(request.engine.engine_config.entropy_from_logits_chunk_size)
    return _fused(hidden, weight, labels, temperature, chunk, None, "labels", verls)


def _fused(hidden, weight, labels, temperature, chunk: int, group, name: str, verls):
    from torch.distributed.tensor import DTensor

    request = getattr(_LOCAL, "request", None)
    head = None
    if isinstance(weight, DTensor):
        head = _owner(request, weight)
        if head is None:
            if isinstance(temperature, torch.Tensor):
                raise RuntimeError("chunked_entropy: the fused lm_head weight is a DTensor that no FSDP2 module of "
                                   "verl's engine holds; verl's own fused kernel cannot take a per-sample "
                                   "temperature")
            _warn_once("a fused lm_head weight sharded as a DTensor outside an FSDP2 module of verl's engine")
            return verls()
    entropy = True if request is None else request.entropy
    spp = False if request is None else request.sum_pi_squared
    teacher = None if request is None else request.teacher
    labels = labels.to(torch.int64)
    # Every id a vocabulary id, as verl's gather requires (its Triton kernel reads a bad id as no label): named as
    # verl names it; the core alone would read -100 as an ignored label, a log-prob of 0
    check_id_range(name, labels, weight.shape[0])
    rows = None if request is None else request.rows
    if rows is not None and tuple(rows.shape) != tuple(labels.shape):
        raise RuntimeError(f"chunked_entropy: the rows verl reads ({tuple(rows.shape)}) do not match the fused "
                           f"kernel's labels ({tuple(labels.shape)}); set CHUNKED_ENTROPY_VERL_ROWS=0")

    def compute(h, w):
        ids = None if teacher is None else teacher[1]
        out = linear_log_probs_and_entropy(
            h, OutputLayer(w, process_group=group), labels, chunking=chunk, temperature=temperature,
            compute_entropy=entropy, compute_sum_pi_squared=spp, log_probs_at=ids,
            top_k=None if ids is None else ids.shape[-1],
            label_mask=None if rows is None else rows.to(labels.device), rows=None if rows is None else "kept",
        )
        extra = _collect(out, False, False, spp, teacher)
        names = sorted(extra)
        lp = out.log_probs
        ent = out.entropy if entropy else torch.zeros_like(lp)
        return (lp, ent, *(extra[k] for k in names)), names

    if head is None:
        result, names = compute(hidden, weight)
    else:  # FSDP2 unshards a module's parameters around its own forward: run the fused head as that forward
        names_box = []

        def forward(h):
            res, nm = compute(h, head.weight)
            names_box.append(nm)
            return res

        saved = head.__dict__.get("forward")
        head.forward = forward
        try:
            result = head(hidden)
        finally:
            if saved is None:
                del head.forward
            else:
                head.forward = saved
        names = names_box[0]
    lp, ent, *rest = result
    if request is not None:
        request.served = True
        request.extra = dict(zip(names, rest, strict=True))
    return lp, ent


def _owner(request, weight):
    """The FSDP2 module of verl's engine whose ``weight`` this is (the untied lm_head), or None."""
    if request is None:
        return None
    module = getattr(request.engine, "module", None)
    if module is None:
        return None
    for sub in module.modules():
        if getattr(sub, "weight", None) is weight and hasattr(sub, "unshard"):
            return sub
    return None


# ----------------------------------------------------------------------------- what is replaced


def _recording(name: str, check):
    """A ``Target.check`` that also records verl's own function (this module's fallback)."""

    def run(original) -> None:
        check(original)
        _ORIGINAL.setdefault(name, original)

    return run


def _check_triton(original) -> None:
    fn = getattr(getattr(original, "__self__", None), "forward", None)
    params = tuple(inspect.signature(fn).parameters) if fn is not None else ()
    expected = ("ctx", "hidden", "weight", "labels", "temperature", "reduction", "dist_process_group")
    if params != expected:
        raise RuntimeError(f"verl's linear_cross_entropy has the parameters {params}; chunked_entropy's verl "
                           f"integration was written for {expected}. Nothing was patched.")


def _engine_class(module):
    return getattr(module, _CLASS, None)


def _fused_class(module):
    return getattr(module, _FUSED_CLASS, None)


_STEP = ("self", "micro_batch", "loss_function", "forward_only")
_INPUTS = ("self", "micro_batch")
_OUTPUTS = ("self", "output", "output_args", "micro_batch", "logits_processor_func")
_KERNEL = ("self", "hidden_states", "vocab_weights", "input_ids", "temperature")

#: What this route replaces in verl, checked before anything is patched.
TARGETS = (
    Target(TARGET_MODULE, "forward_step", forward_step,
           _recording("forward_step", check_parameters(f"{_CLASS}.forward_step", _STEP, _WHERE)), holder=_engine_class),
    Target(TARGET_MODULE, "prepare_model_inputs", prepare_model_inputs,
           _recording("prepare_model_inputs", check_parameters(f"{_CLASS}.prepare_model_inputs", _INPUTS, _WHERE)),
           holder=_engine_class),
    Target(TARGET_MODULE, "prepare_model_outputs", prepare_model_outputs,
           _recording("prepare_model_outputs",
                      check_parameters(f"{_CLASS}.prepare_model_outputs", _OUTPUTS, _WHERE)),
           holder=_engine_class),
    Target(FUSED_MODULE, "forward", fused_linear_for_ppo_forward,
           _recording("FusedLinearForPPO.forward", check_parameters(f"{_FUSED_CLASS}.forward", _KERNEL, _WHERE)),
           holder=_fused_class),
    Target(TRITON_MODULE, "linear_cross_entropy", linear_cross_entropy,
           _recording("linear_cross_entropy", _check_triton)),
)
