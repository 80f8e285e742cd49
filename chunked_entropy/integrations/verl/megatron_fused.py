"""verl 0.9, Megatron engine: the fused-kernel route (``use_fused_kernels=True``) through the library's fused head.

With ``actor_rollout_ref.model.use_fused_kernels=True`` (and ``thd`` packing),
verl's ``MegatronEngineWithLMHead.forward_step`` hands the decoder's hidden
states to verl's Triton ``linear_cross_entropy``: through megatron-core's
``output_processor`` hook (megatron-core >= 0.18: ``fused_output_processor``)
or by replacing the model's forward (0.16.1 and 0.17: ``patch_fused_forward``
binds ``_fused_GPTModel_forward``). That route collapses the per-token
temperature to one float and raises when it varies, raises for
``calculate_sum_pi_squared``, never returns the top-k distillation keys, and
runs on CUDA only.

:func:`chunked_entropy.integrations.verl.install` replaces, in verl (nothing is
edited; every signature is checked first, all or nothing):

- ``MegatronEngineWithLMHead.forward_step`` by :func:`forward_step`: on the
  fused route it reads what verl's fused route drops (the per-sequence
  temperatures, ``calculate_sum_pi_squared``, the distillation flags and the
  teacher's tensors), then runs verl's own ``forward_step`` (so routing replay,
  dynamic CP and the rest stay verl's); on the unfused route it is verl's own;
- ``_resolve_fused_temperature`` by :func:`resolve_fused_temperature`: no
  longer raises for a per-token temperature when the plugin serves the call;
- ``MegatronEngine._maybe_enable_fused_kernels`` by
  :func:`maybe_enable_fused_kernels`: under MTP training the fused route stays
  on, the MTP layers' losses served too (legacy mode: by its forward,
  :func:`chunked_entropy.integrations.verl.mtp.mtp_hidden_states`; hook mode:
  by the plugin's MTP postprocess, :func:`chunked_entropy.integrations.verl.mtp.process_mtp_loss`);
- ``registry.fused_forward_model_engine`` by :func:`fused_forward_model_engine`:
  verl's packing (``preprocess_thd_engine``, labels rolled, CP-split), the
  per-token temperature packed the same way (not rolled, as on verl's unfused
  route), the model called with a :class:`FusedRequest`, and every output
  unpacked with verl's ``postprocess_thd_engine``;
- ``_fused_GPTModel_forward`` (legacy mode) by :func:`fused_gpt_forward`:
  megatron-core's own ``GPTModel.forward``, its postprocess serving the request
  with the library's fused head;
- ``fused_output_processor`` (hook mode) by :func:`fused_output_processor`.

The head (:meth:`ChunkedVocabParallelHead.from_megatron`) receives the
sequence-sharded hidden states and does its own all-gather and
reduce-scatter under sequence parallelism (verl's gather is not done as well:
the hidden states' gradient is not doubled), reads the tensor-parallel group
and ``gradient_accumulation_fusion`` from the output layer, and takes the tied
embedding weight megatron-core passes (``output_weight``). No ``[T, V/tp]``
tensor exists, forward or backward. Context parallelism: each rank serves its
own tokens, as verl's fused route does; verl's post-processing gathers.

Only the rows verl reads are projected (:func:`read_rows`: each RL sequence's
response positions; every row of an SFT micro-batch), unless
``CHUNKED_ENTROPY_VERL_ROWS=0`` (:data:`ROWS_ENV`).

Only the rows verl reads are projected (:func:`read_rows`: each RL sequence's
response positions; every row of an SFT micro-batch), unless
``CHUNKED_ENTROPY_VERL_ROWS=0`` (:data:`ROWS_ENV`).

A model whose output layer megatron-core computes in MXFP8 (``fp8_output_proj``,
megatron-core >= 0.19) is refused on the fused route, with a ValueError saying
to set ``use_fused_kernels=False``: the fused head (and verl's own fused
kernel) would compute that layer in bf16 from its weight.

What it cannot serve (a vision model, a model whose forward is not ours, a
megatron-core GPTModel without ``output_layer``, a ``MambaModel`` /
``HybridModel``, whose post-processing is inline) goes to verl's own route, with
one logged warning naming the reason (verl's own route then raises where it
raises).

Tested with verl 0.9.1 and megatron-core 0.16.1 (legacy mode, with and without
MTP); hook mode (with and without MTP) with a GPTModel subclass exposing
megatron-core 0.19's ``output_processor`` and ``process_mtp_loss`` contracts.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ...options import Chunking
from .._common import MegatronHeads, Target, check_parameters, engine_chunk_size, refuse_fp8_output_layer
from ._distill import distillation_keys, teacher_topk
from .megatron import PADDING_TEMPERATURE

__all__ = [
    "FusedRequest", "ROWS_ENV", "TARGETS", "forward_step", "fused_forward_model_engine", "fused_gpt_forward",
    "fused_output_processor", "fused_outputs", "maybe_enable_fused_kernels", "read_rows", "resolve_fused_temperature",
    "rows_enabled",
]

logger = logging.getLogger("chunked_entropy.integrations")

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
FUSED_MODULE = "verl.models.mcore.model_forward_fused"
REGISTRY_MODULE = "verl.models.mcore.registry"
_CLASS = "MegatronEngineWithLMHead"
#: verl's default ``entropy_from_logits_chunk_size``: the chunk size when verl's own code calls the fused forward.
DEFAULT_CHUNK_SIZE = 2048

_VERLS = {}  # attribute -> verl's own function, recorded when its signature is checked
#: The fused heads, one per output layer, built on first use and reused while the weight and chunk size hold.
_HEADS = MegatronHeads()
#: Set to ``0`` to project every row on the fused route (by default only the rows verl reads: see :func:`read_rows`).
ROWS_ENV = "CHUNKED_ENTROPY_VERL_ROWS"
_BATCH = contextvars.ContextVar("chunked_entropy_verl_fused_batch", default=None)
_WARNED = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("chunked_entropy: verl's fused route is left to verl here: %s", reason)


@dataclass(frozen=True)
class FusedRequest:
    """What the fused head computes for one micro-batch, in the model's packed token order.

    ``temperature``: a float, or the per-token ``[1, T]`` tensor packed (and
    CP-split) like the labels; values <= 0 (packing padding) read as verl's
    ``1e-8``. ``teacher``: ``(clamp, ids, log-probs)``, the teacher's top-k
    ``[1, T, K]`` for verl's Megatron top-k distillation, or None. ``rows``:
    the ``[1, T]`` mask of the rows verl reads (:func:`read_rows`, packed like
    the temperature): only those are projected (``rows="kept"``), the others'
    outputs are zero; None projects every row. ``mtp``:
    also the MTP layers' losses (MTP training on), attached to the hidden
    states as verl attaches them (:func:`chunked_entropy.integrations.verl.mtp.mtp_hidden_states`).
    """

    temperature: Union[float, torch.Tensor] = 1.0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    log_probs: bool = True
    entropy: bool = True
    sum_pi_squared: bool = False
    teacher: Optional[tuple] = None
    mtp: bool = False
    rows: Optional[torch.Tensor] = None  # [1, T] bool, packed like the labels: the rows verl reads (None: all)

    def output_keys(self) -> tuple:
        keys = (["log_probs"] if self.log_probs else []) + (["entropy"] if self.entropy else [])
        keys += ["sum_pi_squared"] if self.sum_pi_squared else []
        if self.teacher is not None:
            keys += ["distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"]
        return tuple(keys)


def fused_outputs(hidden_states, output_layer, output_weight, labels, request: FusedRequest) -> dict:
    """The request's outputs from megatron-core's decoder output, through the library's fused head.

    Args:
        hidden_states: ``[S, 1, H]`` (``[S/tp, 1, H]`` under sequence
            parallelism: the head gathers it and reduce-scatters its gradient).
        output_layer: the model's ``ColumnParallelLinear`` (its TP group,
            ``sequence_parallel``, bias and ``gradient_accumulation_fusion``).
        output_weight: the tied embedding weight, or None (the layer's own).
        labels: ``[1, S]`` global token ids (verl's rolled labels).
        request: what to compute.

    Returns:
        ``{key: [1, S] tensor}`` for :meth:`FusedRequest.output_keys`, float32.

    With ``request.rows`` only the rows verl reads are projected
    (``rows="kept"``: one host sync for their count); the outputs keep their
    ``[1, S]`` shape, zero on the other rows.

    Memory:
        That of :func:`~chunked_entropy.linear_log_probs_and_entropy`: two to
        four float32 per token saved, one or two ``[chunk, V/tp]`` buffers per
        chunk, never ``[S, V/tp]``; with the teacher's top-k, ``[S, K]``
        float32 and int64 for the student's top-k.
    """
    head = _HEADS.head(output_layer, weight=output_weight, chunking=Chunking(request.chunk_size))
    t = request.temperature
    if isinstance(t, torch.Tensor):  # verl's padding rows (t <= 0) read as 1e-8, as verl does
        t = torch.where(t <= 0, torch.full_like(t, PADDING_TEMPERATURE), t).transpose(0, 1)
    else:
        t = max(float(t), PADDING_TEMPERATURE)
    teacher = request.teacher
    ids = None if teacher is None else teacher[1].transpose(0, 1)
    with_labels = request.log_probs or teacher is None
    only = request.rows is not None and with_labels
    out = head(
        hidden_states, labels.transpose(0, 1) if with_labels else None, temperature=t,
        compute_entropy=request.entropy, compute_sum_pi_squared=request.sum_pi_squared, log_probs_at=ids,
        top_k=None if ids is None else ids.shape[-1], label_mask=request.rows.transpose(0, 1) if only else None,
        rows="kept" if only else None,
    )
    ret = {}
    if request.log_probs:
        ret["log_probs"] = out.log_probs.transpose(0, 1)
    if request.entropy:
        ret["entropy"] = out.entropy.transpose(0, 1)
    if request.sum_pi_squared:
        ret["sum_pi_squared"] = out.sum_pi_squared.transpose(0, 1)
    if teacher is not None:
        student = _Student(out.log_probs_at.transpose(0, 1), out.top_k_ids.transpose(0, 1))
        ret.update(distillation_keys(student, teacher[0], teacher[1], teacher[2]))
    return ret


@dataclass(frozen=True)
class _Student:
    log_probs_at: torch.Tensor
    top_k_ids: torch.Tensor


def _ppo_output(hidden_states, outputs: dict):
    """verl's ``CausalLMOutputForPPO`` carrying ``outputs`` (log_probs and entropy as attributes, all as keys)."""
    from verl.utils.model import CausalLMOutputForPPO

    result = CausalLMOutputForPPO(loss=None, logits=None, past_key_values=None, hidden_states=hidden_states,
                                  attentions=None)
    for key, value in outputs.items():
        result[key] = value
    return result


def _as_request(context) -> FusedRequest:
    """Ours as is; verl's own context (or a bare float) carries one temperature, and verl's outputs."""
    if isinstance(context, FusedRequest):
        return context
    return FusedRequest(temperature=float(getattr(context, "temperature", context)))


def fused_output_processor(*, hidden_states, output_layer, output_weight, labels, context, config, **_ignored):
    """verl's ``fused_output_processor`` (megatron-core >= 0.18's ``output_processor`` hook), fused by the library.

    ``context`` is a :class:`FusedRequest` (from :func:`fused_forward_model_engine`)
    or verl's ``FusedOutputProcessorContext`` (one temperature; log-probs and
    entropy, verl's contract). The head does the sequence-parallel gather
    itself, so ``config.sequence_parallel`` needs nothing here.
    """
    request = _as_request(context)
    return _ppo_output(hidden_states, fused_outputs(hidden_states, output_layer, output_weight, labels, request))


def fused_gpt_forward(
    model,
    input_ids,
    position_ids,
    attention_mask,
    decoder_input=None,
    labels=None,
    inference_context=None,
    packed_seq_params=None,
    extra_block_kwargs=None,
    runtime_gather_output=None,
    *,
    inference_params=None,
    loss_mask=None,
    temperature=1.0,
    padding_mask=None,
    **kwargs,
):
    """verl's ``_fused_GPTModel_forward`` (megatron-core < 0.18, bound by ``patch_fused_forward``), fused.

    Runs megatron-core's own ``GPTModel.forward`` (embedding, RoPE, decoder,
    exactly as the model's forward does), its postprocess replaced for this
    call by the fused head. ``temperature`` is a :class:`FusedRequest` (from
    :func:`fused_forward_model_engine`) or verl's float (log-probs and
    entropy, verl's contract). Without ``post_process`` (a pipeline stage
    before the last) the hidden states are returned, as verl does.
    """
    request = _as_request(temperature)
    own_forward = model.__dict__.get("forward_backup") or type(model).forward.__get__(model)

    def postprocess(hidden_states, input_ids, position_ids, labels, rotary_pos_emb=None, rotary_pos_cos=None,
                    rotary_pos_sin=None, mtp_in_postprocess=None, loss_mask=None, **kw):
        if not model.post_process:
            return hidden_states
        if request.mtp and model.config.mtp_num_layers:  # MTP training: the MTP block and losses first
            from . import mtp

            keep = ("attention_mask", "padding_mask", "inference_params", "packed_seq_params", "sequence_len_offset",
                    "extra_block_kwargs")
            hidden_states = mtp.mtp_hidden_states(
                model, hidden_states, input_ids=input_ids, position_ids=position_ids, labels=labels,
                loss_mask=loss_mask, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin, mtp_in_postprocess=mtp_in_postprocess, chunk_size=request.chunk_size,
                **{k: kw[k] for k in keep if k in kw})
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        return _ppo_output(hidden_states, fused_outputs(hidden_states, model.output_layer, weight, labels, request))

    had = "_postprocess" in model.__dict__
    saved = model.__dict__.get("_postprocess")
    model._postprocess = postprocess
    try:
        call = dict(decoder_input=decoder_input, labels=labels, inference_context=inference_context,
                    packed_seq_params=packed_seq_params, extra_block_kwargs=extra_block_kwargs,
                    runtime_gather_output=runtime_gather_output, inference_params=inference_params,
                    loss_mask=loss_mask, **kwargs)
        if padding_mask is not None:
            call["padding_mask"] = padding_mask
        return own_forward(input_ids, position_ids, attention_mask, **call)
    finally:
        if had:
            model._postprocess = saved
        else:
            del model._postprocess


@dataclass(frozen=True)
class _Batch:
    """What ``forward_step`` read from verl's micro-batch, for the fused forward it calls."""

    batch: object
    temperature: torch.Tensor  # [B], one per sequence
    chunk_size: int
    entropy: bool
    sum_pi_squared: bool
    log_probs: bool
    distillation: bool
    logits_processor_func: object
    mtp: bool = False  # MTP training (model.mtp.enable and enable_train)
    mtp_factor: Optional[float] = None  # verl's MTP loss normalization factor (calculate_per_token_loss)


def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
    """verl's ``MegatronEngineWithLMHead.forward_step``; on the fused route, served by the library's fused head.

    On the fused route (``engine_config.use_fused_kernels``) the micro-batch's
    per-sequence temperatures, ``calculate_sum_pi_squared``, the distillation
    flags and ``logits_processor_func`` are read here and handed to
    :func:`fused_forward_model_engine`, then verl's own ``forward_step`` runs
    (with ``calculate_sum_pi_squared`` hidden from its refusal, on a shallow
    copy of the micro-batch; the post-processing gets it back). Otherwise,
    verl's own ``forward_step``.
    """
    own = _VERLS["forward_step"]
    if not bool(getattr(self.engine_config, "use_fused_kernels", False)):
        return own(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
    from verl.utils import tensordict_utils as tu

    batch = next(batch_iter)
    rest = itertools.chain([batch], batch_iter)
    flags = {k: bool(tu.get_non_tensor_data(batch, key=k, default=False)) for k in (
        "calculate_entropy", "calculate_sum_pi_squared", "distillation_use_topk", "distillation_only")}
    temperature = batch["temperature"] if "temperature" in batch.keys() else None
    why = None
    if temperature is None:
        why = "the micro-batch has no 'temperature'"
    elif not isinstance(temperature, torch.Tensor):
        temperature = torch.as_tensor(temperature, dtype=torch.float32)
    if why is None and temperature.dim() == 0:
        temperature = temperature.expand(batch["input_ids"].shape[0])
    if why is not None:
        _warn_once(why)
        return own(self, rest, model, logits_processor_func, postprocess_micro_batch_func)
    if not torch.isfinite(temperature).all():
        raise ValueError("temperature must contain finite values (the micro-batch's 'temperature')")
    request = _Batch(
        batch=batch, temperature=temperature, chunk_size=engine_chunk_size(self.engine_config),
        entropy=flags["calculate_entropy"], sum_pi_squared=flags["calculate_sum_pi_squared"],
        log_probs=not flags["distillation_only"], distillation=flags["distillation_use_topk"],
        logits_processor_func=logits_processor_func, **_mtp_of(self, batch),
    )
    view = batch
    if flags["calculate_sum_pi_squared"]:  # verl's forward_step refuses it on the fused route: served here
        view = batch.copy()
        tu.assign_non_tensor_data(view, "calculate_sum_pi_squared", False)
    token = _BATCH.set(request)
    try:
        output, post = own(self, itertools.chain([view], batch_iter), model, logits_processor_func,
                           postprocess_micro_batch_func)
    finally:
        _BATCH.reset(token)
    if view is not batch and isinstance(post, functools.partial) and "data" in post.keywords:
        data = post.keywords["data"]
        if data is view:  # the device move returned the view itself: hand verl the caller's micro-batch
            post = functools.partial(post.func, *post.args, **{**post.keywords, "data": batch})
        else:  # verl's own device-moved copy of our view: give it the flag back
            tu.assign_non_tensor_data(data, "calculate_sum_pi_squared", True)
    return output, post


def _mtp_of(engine, batch) -> dict:
    """MTP training on this engine, and verl's MTP loss normalization factor, as verl's forward_step reads them."""
    from verl.utils import tensordict_utils as tu

    mtp_cfg = getattr(engine.model_config, "mtp", None)
    on = bool(getattr(mtp_cfg, "enable", False) and getattr(mtp_cfg, "enable_train", False))
    factor = None
    if on and getattr(engine.tf_config, "calculate_per_token_loss", False):
        total = tu.get_non_tensor_data(batch, key="batch_num_tokens", default=0)
        routed = tu.get_non_tensor_data(batch, key="routed_num_tokens", default=0)
        if total > 0:
            factor = routed / total
    return {"mtp": on, "mtp_factor": factor}


def maybe_enable_fused_kernels(self):
    """verl's ``MegatronEngine._maybe_enable_fused_kernels``; under MTP the fused route stays on.

    verl turns the fused route off when ``model.mtp.enable`` is set. With the
    plugin the MTP layers' losses are served beside the fused head: by the
    fused forward (megatron-core < 0.18, where the forward is replaced) or by
    the plugin's MTP postprocess, which computes them with
    :func:`chunked_entropy.integrations.verl.mtp.process_mtp_loss` and then
    calls megatron-core's ``output_processor`` hook (>= 0.18; verl's own
    postprocess would drop the hook). Elsewhere (MuP logit scaling in hook
    mode, a value model, no remove-padding): verl's own decision.
    """
    own = _VERLS["_maybe_enable_fused_kernels"]
    cfg = self.engine_config
    mtp_on = bool(getattr(getattr(self.model_config, "mtp", None), "enable", False))
    if not (cfg.use_fused_kernels and cfg.use_remove_padding and mtp_on and not self.is_value_model):
        return own(self)
    from verl.models.mcore import model_forward_fused as verl_fused

    models = [verl_fused._get_patching_model(m) or m for m in self.module]
    if any(verl_fused._supports_output_processor_hook(m) and getattr(m.config, "use_mup", False) for m in models):
        return own(self)  # hook mode with MuP: the MTP losses are left to megatron-core, and so is this decision
    for model in self.module:
        verl_fused.patch_fused_forward(model)


def resolve_fused_temperature(temperature):
    """verl's ``_resolve_fused_temperature``; when the plugin serves the call, no refusal of per-token values.

    The per-token temperature travels to the fused head separately (see
    :func:`forward_step`); the float returned here is then unused.
    """
    if _BATCH.get() is not None:
        return 1.0
    return _VERLS["_resolve_fused_temperature"](temperature)


def fused_forward_model_engine(vision_model: bool = False):
    """verl's ``fused_forward_model_engine`` factory: the library's fused forward for language models.

    A vision model's forward (verl's ``build_vlm_attn_mask_thd`` packing) is
    left to verl, with one warning.
    """
    own = _VERLS["fused_forward_model_engine"](vision_model)
    if vision_model:
        def vision(*args, **kwargs):
            _warn_once("a vision-language model (verl packs its inputs itself)")
            return own(*args, **kwargs)

        return vision

    @functools.wraps(own)
    def fused_forward(model, input_ids, labels, multi_modal_inputs, temperature, calculate_entropy, pad_token_id,
                      cp_layout="zigzag", local_cp_size=None, router_padding_mask=None, pad_to_length_bucket=None):
        args = dict(model=model, input_ids=input_ids, labels=labels, multi_modal_inputs=multi_modal_inputs,
                    temperature=temperature, calculate_entropy=calculate_entropy, pad_token_id=pad_token_id,
                    cp_layout=cp_layout, local_cp_size=local_cp_size, router_padding_mask=router_padding_mask,
                    pad_to_length_bucket=pad_to_length_bucket)
        _refuse_fp8(model)
        why = _unserved(model, multi_modal_inputs)
        request = _BATCH.get()
        if why is None:
            return _serve(request, **args)
        _warn_once(why)
        if request is not None:  # verl's own route, with verl's own refusals (never a silently dropped value)
            refused = ((request.sum_pi_squared, "calculate_sum_pi_squared=True"),
                       (request.distillation, "distillation_use_topk=True (verl's fused route drops the keys)"))
            for asked, what in refused:
                if asked:
                    raise NotImplementedError(f"{what} on verl's fused route, which chunked_entropy cannot serve "
                                              f"here ({why}): set use_fused_kernels=False")
            args["temperature"] = _VERLS["_resolve_fused_temperature"](request.temperature)
        return own(**args)

    return fused_forward


def _refuse_fp8(model) -> None:
    """megatron-core >= 0.19's MXFP8 output layer (``fp8_output_proj``) on the fused route: a ValueError.

    Neither the plugin's fused head nor verl's own Triton ``linear_cross_entropy`` computes that layer as the
    model does (both multiply its weight in bf16); verl's unfused route reads the model's MXFP8 logits.
    """
    from verl.utils.megatron_utils import unwrap_model

    inner = unwrap_model(model)
    gpt = getattr(inner, "language_model", inner)
    refuse_fp8_output_layer(getattr(gpt, "config", None), getattr(gpt, "output_layer", None), advice=(
        "Set actor_rollout_ref.model.use_fused_kernels=False: verl's unfused route reads the model's MXFP8 logits "
        "(the plugin serves it chunked); verl's own fused route would compute the bf16 head as well."))


def _unserved(model, multi_modal_inputs):
    """Why the library cannot serve this fused forward (None when it can)."""
    from verl.models.mcore import model_forward_fused as verl_fused
    from verl.utils.megatron_utils import unwrap_model

    if multi_modal_inputs:
        return "multi-modal inputs"
    inner = unwrap_model(model)
    gpt = getattr(inner, "language_model", inner)
    if getattr(gpt, "output_layer", None) is None:
        return f"{type(gpt).__name__} has no output_layer"
    if not hasattr(gpt, "_postprocess"):
        return (f"{type(gpt).__name__} post-processes inline in its forward (megatron-core's MambaModel / "
                "HybridModel); the fused route serves GPTModel's _postprocess and output_processor")
    if verl_fused._use_output_processor_hook(model):
        return None
    bound = gpt.__dict__.get("forward")
    if getattr(bound, "__func__", None) is not fused_gpt_forward:
        return ("the model's forward is not the plugin's (verl's patch_fused_forward ran before "
                "chunked_entropy.integrations.verl.install())")
    return None


def _serve(request: Optional[_Batch], *, model, input_ids, labels, multi_modal_inputs, temperature, calculate_entropy,
           pad_token_id, cp_layout, local_cp_size, router_padding_mask, pad_to_length_bucket):
    """The fused forward, as verl's (packing, CP split, unpacking), with the library's head and every output."""
    from verl.models.mcore import model_forward_fused as verl_fused
    from verl.models.mcore.util import postprocess_thd_engine, preprocess_thd_engine
    from verl.utils import torch_functional as verl_F
    from verl.utils.megatron_utils import unwrap_model

    inner = unwrap_model(model)
    config = inner.config
    min_rows = config.csa_window_size if getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid" \
        else None
    pack = dict(use_fp8_padding=config.fp8 in ("e4m3", "hybrid"), min_local_rows=min_rows,
                pad_to_length_bucket=pad_to_length_bucket, cp_layout=cp_layout, local_cp_size=local_cp_size)
    mtp = request is not None and request.mtp and bool(getattr(config, "mtp_num_layers", None))
    ids_packed, packed_seq_params, position_ids = preprocess_thd_engine(
        input_ids, pre_process=inner.pre_process or (inner.post_process and mtp), **pack)
    labels_packed, _, _ = preprocess_thd_engine(labels, pre_process=True, need_roll=True, **pack)
    if request is None:  # called from outside forward_step: verl's own contract (one temperature)
        fused = FusedRequest(temperature=float(temperature), entropy=bool(calculate_entropy))
    else:
        t = verl_F.expand_as_nested(request.temperature.to(device=input_ids.device, dtype=torch.float32), input_ids)
        t_packed, _, _ = preprocess_thd_engine(t, pre_process=True, **pack)  # not rolled: verl's unfused rule
        teacher = None
        if request.distillation:
            teacher = teacher_topk(request.logits_processor_func, _on(request.batch, input_ids.device), "thd")
            if teacher is None:
                raise NotImplementedError(
                    "distillation_use_topk on verl's fused route: chunked_entropy serves verl's Megatron top-k "
                    "distillation (distillation_ppo_loss with a megatron actor config and the teacher's "
                    "'teacher_ids'/'teacher_logprobs'); this logits_processor_func needs the logits: set "
                    "use_fused_kernels=False")
        rows = read_rows(request.batch, input_ids) if rows_enabled() else None
        if rows is not None:  # a row mask, not rolled: row i is the hidden state of token i
            rows = preprocess_thd_engine(rows, pre_process=True, **pack)[0].contiguous()
        fused = FusedRequest(temperature=t_packed, chunk_size=request.chunk_size, log_probs=request.log_probs,
                             entropy=request.entropy, sum_pi_squared=request.sum_pi_squared, teacher=teacher,
                             mtp=mtp and inner.post_process, rows=rows)
    kwargs = dict(input_ids=ids_packed.contiguous(), attention_mask=None, position_ids=None,
                  packed_seq_params=packed_seq_params, labels=labels_packed.contiguous())
    if fused.mtp:  # what verl's unfused route hands the model for MTP: position ids and the rolled loss mask
        kwargs.update(_mtp_inputs(request, input_ids, pack), position_ids=position_ids)
        if request.mtp_factor is not None:
            packed_seq_params._verl_mtp_loss_normalization_factor = request.mtp_factor
    if router_padding_mask is not None:
        kwargs["padding_mask"] = router_padding_mask
    if verl_fused._use_output_processor_hook(model):
        out = model(**kwargs, output_processor=fused_output_processor, output_processor_context=fused)
    else:
        out = model(temperature=fused, **kwargs)
    if not inner.post_process:
        return out
    unpack = functools.partial(postprocess_thd_engine, packed_seq_params=packed_seq_params, input_ids=input_ids,
                               batch_size=input_ids.shape[0], post_process=True, cp_layout=cp_layout,
                               local_cp_size=local_cp_size)
    result = {}
    for key in fused.output_keys():
        value = out[key]
        result[key] = unpack(value.unsqueeze(0) if value.dim() == 1 else value)
    return result


def rows_enabled() -> bool:
    """Whether the fused routes project only the rows verl reads (``CHUNKED_ENTROPY_VERL_ROWS``, default on)."""
    value = os.environ.get(ROWS_ENV, "1").strip().lower()
    if value in ("1", "true", "on", "yes", ""):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ROWS_ENV} must be 1 or 0 (on or off), got {value!r}")


def read_rows(batch, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The rows of verl's micro-batch that verl reads from the fused route's per-token outputs, or None (all).

    Every verl 0.9.1 consumer of the log-probs, entropy, Σp² and distillation
    keys of an RL micro-batch (``ppo_loss``, the distillation losses, the
    trainer's ``compute_log_prob`` / ``compute_ref_log_prob`` through
    ``no_padding_2_padding``, the v1 trainer's ``response_from_nested``) reads
    the **response positions** of each sequence: in the nested layout the rows
    ``[L - R - 1, L - 1)`` of a sequence of ``L`` tokens with ``R`` response
    tokens (the row before each response token), whatever the response mask
    says (it masks later). No consumer reads a prompt row. ``R`` is taken as
    verl's ``no_padding_2_padding`` takes it: from the nested ``responses``,
    else from ``attention_mask[:, prompt_len:]``. A micro-batch without
    ``prompts`` and ``responses`` (SFT: ``sft_loss`` reads the rolled
    ``loss_mask`` over the whole sequence) gets None: every row is projected.

    Returns:
        A nested ``[B, j]`` bool tensor with ``input_ids``' offsets, or None.
    """
    keys = batch.keys() if batch is not None else ()
    if "prompts" not in keys or "responses" not in keys or not input_ids.is_nested:
        return None
    prompts, responses = batch["prompts"], batch["responses"]
    if prompts.is_nested and responses.is_nested:
        response_lens = responses.offsets().diff()
    elif "attention_mask" in keys and not batch["attention_mask"].is_nested and not prompts.is_nested:
        response_lens = batch["attention_mask"][:, prompts.shape[1]:].sum(dim=1)
    else:
        return None
    offsets = input_ids.offsets()
    lengths = offsets.diff()
    device = offsets.device
    response_lens = response_lens.to(device=device, dtype=lengths.dtype)
    if response_lens.shape != lengths.shape:
        return None
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    pos = torch.arange(input_ids.values().shape[0], device=device) - offsets[:-1][seq]  # no host sync
    length = lengths[seq]
    mask = (pos >= length - response_lens[seq] - 1) & (pos < length - 1)
    return torch.nested.nested_tensor_from_jagged(mask, offsets=offsets)


def _mtp_inputs(request: _Batch, input_ids, pack: dict) -> dict:
    """verl's MTP loss mask (prompt zeros, then the response mask; rolled), packed like the labels."""
    from verl.models.mcore.model_forward import _build_mtp_loss_mask_nested
    from verl.models.mcore.util import preprocess_thd_engine

    batch = request.batch
    loss_mask = batch["loss_mask"].to(input_ids.device).to(bool)
    attention_mask = batch["attention_mask"] if "attention_mask" in batch.keys() else None
    response_attention = None
    if attention_mask is not None and not loss_mask.is_nested:
        response_attention = attention_mask[:, -loss_mask.shape[-1]:]
    lengths = input_ids.offsets().diff().tolist()
    mask = _build_mtp_loss_mask_nested(loss_mask, lengths, response_attention)
    mask_packed = preprocess_thd_engine(mask, pre_process=True, need_roll=True, **pack)[0]
    return {"loss_mask": mask_packed.contiguous()}


def _on(batch, device):
    """The teacher's tensors of verl's micro-batch on the model's device (the rest is not read)."""
    if batch is None:
        return None
    keys = [k for k in ("teacher_ids", "teacher_logprobs") if k in batch.keys()]
    return {k: batch[k].to(device) for k in keys}


def _recording(attr: str, check):
    """A ``Target.check`` that also keeps verl's own function (the replacements call it where they defer)."""

    def checked(original):
        check(original)
        _VERLS[attr] = original

    return checked


def _engine_class(module):
    return getattr(module, _CLASS, None)


_FORWARD_STEP = ("self", "batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func")
_GPT_FORWARD = ("model", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels",
                "inference_context", "packed_seq_params", "extra_block_kwargs", "runtime_gather_output",
                "inference_params", "loss_mask", "temperature", "padding_mask", "kwargs")
_PROCESSOR = ("hidden_states", "output_layer", "output_weight", "labels", "context", "config", "_ignored")
_VERL = "verl (written for verl 0.9)"

#: What this route replaces in verl, checked before anything is patched.
TARGETS = (
    Target(ENGINE_MODULE, "forward_step", forward_step,
           _recording("forward_step", check_parameters(f"{_CLASS}.forward_step", _FORWARD_STEP, _VERL)),
           holder=_engine_class),
    Target(ENGINE_MODULE, "_maybe_enable_fused_kernels", maybe_enable_fused_kernels,
           _recording("_maybe_enable_fused_kernels",
                      check_parameters("MegatronEngine._maybe_enable_fused_kernels", ("self",), _VERL)),
           holder=lambda module: getattr(module, "MegatronEngine", None)),
    Target(ENGINE_MODULE, "_resolve_fused_temperature", resolve_fused_temperature,
           _recording("_resolve_fused_temperature",
                      check_parameters("_resolve_fused_temperature", ("temperature",), _VERL))),
    Target(REGISTRY_MODULE, "fused_forward_model_engine", fused_forward_model_engine,
           _recording("fused_forward_model_engine",
                      check_parameters("registry.fused_forward_model_engine", ("vision_model",), _VERL))),
    Target(FUSED_MODULE, "_fused_GPTModel_forward", fused_gpt_forward,
           check_parameters("model_forward_fused._fused_GPTModel_forward", _GPT_FORWARD, _VERL)),
    Target(FUSED_MODULE, "fused_output_processor", fused_output_processor,
           check_parameters("model_forward_fused.fused_output_processor", _PROCESSOR, _VERL)),
)
