"""verl 0.9, Megatron engine: the MTP heads' losses through the library's fused head.

With ``actor_rollout_ref.model.mtp.enable`` and ``enable_train``, verl patches
every ``GPTModel``'s ``_postprocess`` with ``mtp_patch._megatron_gptmodel_postprocess``.
On megatron-core 0.16.1 (no ``process_mtp_loss``) its loop projects each MTP
layer's hidden states through the output layer (its weight detached): bf16
``[T, V/tp]`` logits per layer, and megatron-core's cross entropy keeps a
float32 ``[T, V/tp]`` softmax per layer for backward.

:func:`chunked_entropy.integrations.verl.install` replaces that function with
:func:`gptmodel_postprocess`: the MTP block runs as verl runs it; each MTP
layer's loss (hard cross entropy against the rolled labels, verl's rolled
loss mask, verl's scale, ``calculate_per_token_loss`` as verl treats it,
logged in megatron-core's MTP tracker) is ``-log_probs`` from the library's
fused head on the *detached* output weight (and bias), so no ``[T, V/tp]``
tensor exists; the main hidden states then go to verl's own function for the
logits. Sequence parallelism: the head gathers the sharded hidden states and
reduce-scatters their gradient itself.

On megatron-core >= 0.18 verl's function hands the MTP losses to
megatron-core's ``process_mtp_loss`` (looked up as ``mtp_patch._process_mtp_loss``,
which exists only there); the replacement computes them with
:func:`process_mtp_loss` instead: megatron-core's contract (0.18 and 0.19:
the output weight detached only under ``config.mtp_detach_heads``, labels
rolled from ``input_ids`` when none are given, the acceptance counts of 0.19's
tracker from the head's top-1 ids), with verl's own CP group and MTP loss
scaling (``_resolve_cp_group``, ``_get_mtp_loss_config``). The main head is then
megatron-core's ``output_processor`` when one is passed (verl's fused route in
hook mode, which stays on under MTP with the plugin) or verl's own function for
the logits. Install checks ``process_mtp_loss``'s parameters where verl looks it
up (all or nothing). MuP logit scaling (``config.use_mup``) is left to verl and
megatron-core, with one logged warning; a model without MTP layers too.

Tested with verl 0.9.1 and megatron-core 0.16.1; megatron-core 0.19's
``process_mtp_loss`` and ``output_processor`` through a test-side GPTModel
subclass (megatron-core >= 0.18 needs Python >= 3.12 there).
"""

from __future__ import annotations

import logging
from inspect import signature

import torch

from ...options import Chunking
from .._common import MegatronHeads, Target, check_parameters

__all__ = ["MTP_CHUNK_SIZE", "TARGETS", "gptmodel_postprocess", "mtp_hidden_states", "mtp_losses", "process_mtp_loss"]

logger = logging.getLogger("chunked_entropy.integrations")

MTP_MODULE = "verl.models.mcore.mtp_patch"
_ATTR = "_megatron_gptmodel_postprocess"
#: Tokens per chunk of the MTP heads (verl's model-level postprocess has no engine config to read).
MTP_CHUNK_SIZE = 2048
_VERLS = {}
#: The MTP heads, one per output layer, built on first use (:class:`.._common.MegatronHeads`).
_HEADS = MegatronHeads()
_WARNED = set()


def mtp_losses(model, hidden_states, labels, loss_mask, *, output_weight, packed_seq_params, chunk_size=None):
    """Each MTP layer's loss, attached to the main hidden states as verl does; returns those hidden states.

    Args:
        model: the megatron-core ``GPTModel`` (its ``config``, ``output_layer``,
            ``cp_group``, ``training``).
        hidden_states: the MTP block's output, ``[(1 + n) * S, B, H]`` (each
            part ``[S/tp, B, H]`` under sequence parallelism).
        labels: ``[B, S]`` the (rolled) labels verl passes.
        loss_mask: ``[B, S]`` or None (all ones).
        output_weight: the tied embedding weight, or None (the layer's own).
        packed_seq_params: megatron-core's packing, for ``roll_tensor``.
        chunk_size: tokens per chunk (default :data:`MTP_CHUNK_SIZE`).

    Memory:
        Per MTP layer, what :func:`~chunked_entropy.linear_log_probs_and_entropy`
        keeps: two float32 per token, one or two ``[chunk, V/tp]`` buffers;
        no ``[S, V/tp]`` logits or softmax.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossLoggingHelper,
        roll_tensor,
    )

    cfg = model.config
    n = cfg.mtp_num_layers
    parts = torch.chunk(hidden_states, 1 + n, dim=0)
    hidden_states = parts[0]
    # verl detaches the head: no gradient reaches the weight or the bias
    head = _HEADS.head(model.output_layer, weight=output_weight, chunking=Chunking(chunk_size or MTP_CHUNK_SIZE),
                       detach=True)
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    cp_group = getattr(model, "cp_group", None)
    original_num_tokens = loss_mask.sum()
    scale = cfg.mtp_loss_scaling_factor / n
    for i in range(n):
        mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp_group,
                                    packed_seq_params=packed_seq_params)
        loss_mask, num_tokens = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group,
                                            packed_seq_params=packed_seq_params)
        out = head(parts[i + 1], mtp_labels.transpose(0, 1), compute_entropy=False)
        loss = loss_mask * -out.log_probs.transpose(0, 1)  # megatron-core's hard cross entropy, [B, S]
        if model.training:
            logged = loss.sum() / num_tokens if num_tokens > 0 else loss.new_tensor(0.0)
            MTPLossLoggingHelper.save_loss_to_tracker(
                logged, i, n, avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        hidden_states = _attach(hidden_states, loss, scale, num_tokens, original_num_tokens,
                                cfg.calculate_per_token_loss)
    return hidden_states


def _attach(hidden_states, loss, scale, num_tokens, original_num_tokens, per_token: bool):
    """An MTP layer's ``[B, S]`` losses attached to the main hidden states' backward (megatron-core's
    ``MTPLossAutoScaler``), normalised as megatron-core and verl do: per token, re-normalised by the rolled
    count (verl), else by the rolled count."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    if per_token:
        attached = scale * loss * (original_num_tokens / torch.clamp(num_tokens, min=1))
    else:
        attached = scale * loss / num_tokens.clamp(min=1)
    return MTPLossAutoScaler.apply(hidden_states, attached)


def mtp_hidden_states(model, hidden_states, *, input_ids, position_ids, labels, loss_mask, rotary_pos_emb,
                      rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess, attention_mask=None, padding_mask=None,
                      inference_params=None, packed_seq_params=None, sequence_len_offset=None,
                      extra_block_kwargs=None, mhc_multistream=None, chunk_size=None):
    """At the last pipeline stage: the MTP block (as verl runs it) and every MTP layer's loss (:func:`mtp_losses`);
    returns the main hidden states, the losses attached. Shared by the unfused route's postprocess and the fused
    route's forward."""
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if mtp_in_postprocess:
        hidden_states = _mtp_block(
            model, hidden_states, input_ids=input_ids, position_ids=position_ids, rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin, attention_mask=attention_mask,
            padding_mask=padding_mask, inference_params=inference_params, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset, extra_block_kwargs=extra_block_kwargs,
            mhc_multistream=mhc_multistream)
    return mtp_losses(model, hidden_states, labels, loss_mask, output_weight=output_weight,
                      packed_seq_params=packed_seq_params, chunk_size=chunk_size)


def gptmodel_postprocess(
    self,
    hidden_states,
    input_ids,
    position_ids,
    labels,
    rotary_pos_emb,
    rotary_pos_cos,
    rotary_pos_sin,
    mtp_in_postprocess=None,
    loss_mask=None,
    decoder_input=None,
    attention_mask=None,
    padding_mask=None,
    inference_params=None,
    packed_seq_params=None,
    sequence_len_offset=None,
    runtime_gather_output=None,
    extra_block_kwargs=None,
    inference_context=None,
    output_processor=None,
    output_processor_context=None,
    is_spec_decode=None,
    mhc_multistream=None,
):
    """verl's ``mtp_patch._megatron_gptmodel_postprocess``, each MTP layer's loss from the library's fused head.

    Same signature and result (the main head's ``[B, S, V/tp]`` logits,
    computed by verl's own function) as verl's; see :func:`mtp_losses`.
    """
    from verl.models.mcore import mtp_patch

    own = _VERLS[_ATTR]
    rest = dict(mtp_in_postprocess=mtp_in_postprocess, loss_mask=loss_mask, decoder_input=decoder_input,
                attention_mask=attention_mask, padding_mask=padding_mask, inference_params=inference_params,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                runtime_gather_output=runtime_gather_output, extra_block_kwargs=extra_block_kwargs,
                inference_context=inference_context, output_processor=output_processor,
                output_processor_context=output_processor_context, is_spec_decode=is_spec_decode,
                mhc_multistream=mhc_multistream)
    rope = (rotary_pos_emb, rotary_pos_cos, rotary_pos_sin)
    if not (self.config.mtp_num_layers and labels is not None):
        return own(self, hidden_states, input_ids, position_ids, labels, *rope, **rest)
    if getattr(mtp_patch, "_HAS_PROCESS_MTP_LOSS", False):
        return _postprocess_with_process_mtp_loss(self, own, hidden_states, input_ids, position_ids, labels, rope,
                                                  rest)
    if not self.post_process:
        return own(self, hidden_states, input_ids, position_ids, labels, *rope, **rest)
    hidden_states = mtp_hidden_states(
        self, hidden_states, input_ids=input_ids, position_ids=position_ids, labels=labels, loss_mask=loss_mask,
        rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
        mtp_in_postprocess=mtp_in_postprocess, attention_mask=attention_mask, padding_mask=padding_mask,
        inference_params=inference_params, packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset, extra_block_kwargs=extra_block_kwargs, mhc_multistream=mhc_multistream,
    )
    # the main head: verl's own function, its MTP part already done (no labels: logits only)
    rest["mtp_in_postprocess"] = False
    return own(self, hidden_states, input_ids, position_ids, None, *rope, **rest)


def process_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                     is_training, compute_language_model_loss, config, cp_group=None, tp_group=None,
                     packed_seq_params=None, scale_logits_fn=None, input_ids=None, *, chunk_size=None):
    """megatron-core's ``process_mtp_loss`` (0.18 and 0.19), each MTP layer's logits never materialized.

    Same arguments and result as megatron-core's (the main hidden states, each
    MTP layer's scaled loss attached by ``MTPLossAutoScaler``): the hidden
    states split into ``1 + config.mtp_num_layers`` parts; without ``labels``,
    the labels are ``input_ids`` rolled left (0.19), or nothing is computed;
    the output weight detached under ``config.mtp_detach_heads`` (0.19; the
    bias never); per layer, labels and loss mask rolled (``roll_tensor``, CP
    and packing aware), the hard cross entropy as ``-log_probs`` of the fused
    head (``compute_language_model_loss`` is not called: it needs the logits),
    logged when training (0.19's ``save_metrics_to_tracker`` with the acceptance
    counts, the top-1 id from the head compared with the label on the loss
    mask; 0.18's ``save_loss_to_tracker``), scaled by
    ``mtp_loss_scaling_factor / mtp_num_layers`` and normalised as megatron-core
    does (``calculate_per_token_loss`` too). ``runtime_gather_output`` and
    ``tp_group`` change nothing here (the head reads the output layer's
    group). ``scale_logits_fn`` (MuP) is refused: the caller leaves that case
    to megatron-core.

    Memory:
        Per MTP layer, what :func:`~chunked_entropy.linear_log_probs_and_entropy`
        keeps: two float32 per token (and the top-1 id when logging 0.19's
        acceptance), one or two ``[chunk, V/tp]`` buffers; no ``[S, V/tp]``
        logits or softmax.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossLoggingHelper,
        roll_tensor,
    )

    if scale_logits_fn is not None:
        raise NotImplementedError("process_mtp_loss: scale_logits_fn (MuP logit scaling) is not served by "
                                  "chunked_entropy; leave it to megatron-core")
    n = config.mtp_num_layers
    parts = torch.chunk(hidden_states, 1 + n, dim=0)
    hidden_states = parts[0]
    roll = dict(shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    derived = labels is None
    if derived:
        if input_ids is None:
            return hidden_states
        labels, _ = roll_tensor(input_ids, **roll)
    head = _HEADS.head(output_layer, weight=output_weight, chunking=Chunking(chunk_size or MTP_CHUNK_SIZE),
                       detach=bool(getattr(config, "mtp_detach_heads", False)))
    metrics = getattr(MTPLossLoggingHelper, "save_metrics_to_tracker", None)  # megatron-core 0.19
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived:  # the last rolled-in label is made up: masked, as megatron-core does
        loss_mask, _ = roll_tensor(loss_mask, **roll)
    original_num_tokens = loss_mask.sum()
    scale = config.mtp_loss_scaling_factor / n
    for i in range(n):
        mtp_labels, _ = roll_tensor(mtp_labels, **roll)
        loss_mask, num_tokens = roll_tensor(loss_mask, **roll)
        accept = is_training and metrics is not None
        out = head(parts[i + 1], mtp_labels.transpose(0, 1), compute_entropy=False, top_k=1 if accept else None)
        loss = loss_mask * -out.log_probs.transpose(0, 1)  # megatron-core's hard cross entropy, [B, S]
        if is_training:
            logged = loss.sum() * (num_tokens > 0).to(loss.dtype) / num_tokens.clamp(min=1)
            avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            if accept:
                with torch.no_grad():
                    valid = loss_mask.bool()
                    preds = out.top_k_ids[..., 0].transpose(0, 1)
                    correct = ((preds == mtp_labels) & valid).sum().float()
                    metrics(logged, correct, valid.sum().float(), i, n, avg_group=avg_group)
            else:
                MTPLossLoggingHelper.save_loss_to_tracker(logged, i, n, avg_group=avg_group)
        hidden_states = _attach(hidden_states, loss, scale, num_tokens, original_num_tokens,
                                config.calculate_per_token_loss)
    return hidden_states


def _mtp_block(model, hidden_states, *, input_ids, position_ids, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
               attention_mask, padding_mask, inference_params, packed_seq_params, sequence_len_offset,
               extra_block_kwargs, mhc_multistream):
    """The MTP block, as verl runs it: the main hidden states and every MTP layer's, concatenated."""
    kw = dict(extra_block_kwargs or {})
    if "padding_mask" in signature(model.mtp.forward).parameters:
        kw["padding_mask"] = padding_mask
    if mhc_multistream is not None:
        kw["mhc_multistream"] = mhc_multistream
    return model.mtp(
        input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
        attention_mask=attention_mask, inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset, embedding=model.embedding, **kw,
    )


def _postprocess_with_process_mtp_loss(model, own, hidden_states, input_ids, position_ids, labels, rope, rest):
    """megatron-core >= 0.18: verl's function with :func:`process_mtp_loss` for megatron-core's, then the main head
    (the ``output_processor`` when one is passed, as megatron-core's own postprocess does; else verl's logits)."""
    from verl.models.mcore import mtp_patch

    processor = rest["output_processor"]
    mup = bool(getattr(model.config, "use_mup", False)) and hasattr(model, "_scale_logits")
    if mup:
        if processor is not None:  # verl's own function would drop the hook (logits instead of its output)
            raise NotImplementedError("verl's fused route (output_processor) under MTP with MuP logit scaling "
                                      "(config.use_mup): set use_fused_kernels=False")
        if "use_mup" not in _WARNED:
            _WARNED.add("use_mup")
            logger.warning("chunked_entropy: MuP logit scaling (config.use_mup) in the MTP losses: left to verl "
                           "and megatron-core's process_mtp_loss")
        return own(model, hidden_states, input_ids, position_ids, labels, *rope, **rest)
    psp = rest["packed_seq_params"]
    if rest["mtp_in_postprocess"]:
        keys = ("attention_mask", "padding_mask", "inference_params", "packed_seq_params", "sequence_len_offset",
                "extra_block_kwargs", "mhc_multistream")
        hidden_states = _mtp_block(model, hidden_states, input_ids=input_ids, position_ids=position_ids,
                                   rotary_pos_emb=rope[0], rotary_pos_cos=rope[1], rotary_pos_sin=rope[2],
                                   **{k: rest[k] for k in keys})
    if not model.post_process:
        return hidden_states
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    pg = getattr(model, "pg_collection", None)
    hidden_states = process_mtp_loss(
        hidden_states=hidden_states, labels=labels, loss_mask=rest["loss_mask"], output_layer=model.output_layer,
        output_weight=output_weight, runtime_gather_output=rest["runtime_gather_output"],
        is_training=model.training, compute_language_model_loss=model.compute_language_model_loss,
        config=mtp_patch._get_mtp_loss_config(model.config, psp),  # verl's scaling (routed-token factor)
        cp_group=mtp_patch._resolve_cp_group(model, psp),  # verl's (dynamic CP)
        tp_group=getattr(model, "tp_group", None) or (pg.tp if pg is not None else None),
        packed_seq_params=psp, input_ids=input_ids,
        chunk_size=getattr(rest["output_processor_context"], "chunk_size", None),
    )
    if processor is not None:  # megatron-core >= 0.18's hook (verl's fused route): its contract, 0.19's keywords
        return processor(
            hidden_states=hidden_states, output_layer=model.output_layer, output_weight=output_weight,
            labels=labels, loss_mask=rest["loss_mask"], input_ids=input_ids, position_ids=position_ids,
            attention_mask=rest["attention_mask"], decoder_input=rest["decoder_input"],
            inference_context=rest["inference_context"], packed_seq_params=psp,
            runtime_gather_output=rest["runtime_gather_output"], context=rest["output_processor_context"],
            compute_language_model_loss=model.compute_language_model_loss,
            scale_logits=getattr(model, "_scale_logits", None), config=model.config,
        )
    # the main head's logits: verl's own function, its MTP part done (no labels)
    return own(model, hidden_states, input_ids, position_ids, None, *rope, **{**rest, "mtp_in_postprocess": False})


def _recording(check):
    def checked(original):
        check(original)
        _check_process_mtp_loss(original)
        _VERLS[_ATTR] = original

    return checked


#: megatron-core's ``process_mtp_loss`` parameters served by :func:`process_mtp_loss`: 0.18, 0.19.
_PROCESS_MTP_LOSS = (
    ("hidden_states", "labels", "loss_mask", "output_layer", "output_weight", "runtime_gather_output",
     "is_training", "compute_language_model_loss", "config", "cp_group", "packed_seq_params", "scale_logits_fn"),
    ("hidden_states", "labels", "loss_mask", "output_layer", "output_weight", "runtime_gather_output",
     "is_training", "compute_language_model_loss", "config", "cp_group", "tp_group", "packed_seq_params",
     "scale_logits_fn", "input_ids"),
)


def _check_process_mtp_loss(original) -> None:
    """megatron-core >= 0.18: the ``process_mtp_loss`` verl's function looks up (``mtp_patch._process_mtp_loss``)
    and verl's helpers around it have the contract :func:`process_mtp_loss` was written for."""
    names = getattr(original, "__globals__", {})
    if not names.get("_HAS_PROCESS_MTP_LOSS", False):
        return
    params = tuple(signature(names["_process_mtp_loss"]).parameters)
    if params not in _PROCESS_MTP_LOSS:
        raise RuntimeError(f"megatron-core's process_mtp_loss has the parameters {params}; chunked_entropy's verl "
                           f"integration was written for megatron-core 0.18 or 0.19's. Nothing was patched.")
    for helper in ("_resolve_cp_group", "_get_mtp_loss_config"):
        if not callable(names.get(helper)):
            raise RuntimeError(f"verl's mtp_patch has no {helper}; chunked_entropy's verl integration was written "
                               f"for verl 0.9. Nothing was patched.")


_POSTPROCESS = (
    "self", "hidden_states", "input_ids", "position_ids", "labels", "rotary_pos_emb", "rotary_pos_cos",
    "rotary_pos_sin", "mtp_in_postprocess", "loss_mask", "decoder_input", "attention_mask", "padding_mask",
    "inference_params", "packed_seq_params", "sequence_len_offset", "runtime_gather_output", "extra_block_kwargs",
    "inference_context", "output_processor", "output_processor_context", "is_spec_decode", "mhc_multistream",
)

#: What this route replaces in verl, checked before anything is patched.
TARGETS = (
    Target(MTP_MODULE, _ATTR, gptmodel_postprocess,
           _recording(check_parameters(f"mtp_patch.{_ATTR}", _POSTPROCESS, "verl (written for verl 0.9)"))),
)
