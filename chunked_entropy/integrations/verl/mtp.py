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

megatron-core >= 0.18 (``process_mtp_loss``) and a model without MTP layers
are left to verl's own function (the first with one logged warning).

Tested with verl 0.9.1 and megatron-core 0.16.1.
"""

from __future__ import annotations

import logging
from inspect import signature

import torch

from ...head import ChunkedVocabParallelHead
from .._common import Target, check_parameters

__all__ = ["MTP_CHUNK_SIZE", "TARGETS", "gptmodel_postprocess", "mtp_hidden_states", "mtp_losses"]

logger = logging.getLogger("chunked_entropy.integrations")

MTP_MODULE = "verl.models.mcore.mtp_patch"
_ATTR = "_megatron_gptmodel_postprocess"
#: Tokens per chunk of the MTP heads (verl's model-level postprocess has no engine config to read).
MTP_CHUNK_SIZE = 2048
_VERLS = {}
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
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
        roll_tensor,
    )

    cfg = model.config
    n = cfg.mtp_num_layers
    parts = torch.chunk(hidden_states, 1 + n, dim=0)
    hidden_states = parts[0]
    layer = model.output_layer
    weight = (output_weight if output_weight is not None else layer.weight).detach()  # verl detaches the head
    bias = None if getattr(layer, "skip_bias_add", False) or getattr(layer, "bias", None) is None \
        else layer.bias.detach()
    head = ChunkedVocabParallelHead(weight, bias, chunk_size=chunk_size or MTP_CHUNK_SIZE,
                                    process_group=layer.tp_group, sequence_parallel=layer.sequence_parallel,
                                    gradient_accumulation_fusion=False)
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
        if cfg.calculate_per_token_loss:  # verl re-normalises by the rolled token count
            attached = scale * loss * (original_num_tokens / torch.clamp(num_tokens, min=1))
        else:
            attached = scale * loss / num_tokens.clamp(min=1)
        hidden_states = MTPLossAutoScaler.apply(hidden_states, attached)
    return hidden_states


def mtp_hidden_states(model, hidden_states, *, input_ids, position_ids, labels, loss_mask, rotary_pos_emb,
                      rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess, attention_mask=None, padding_mask=None,
                      inference_params=None, packed_seq_params=None, sequence_len_offset=None,
                      extra_block_kwargs=None, mhc_multistream=None, chunk_size=None):
    """At the last pipeline stage: the MTP block (as verl runs it) and every MTP layer's loss (:func:`mtp_losses`);
    returns the main hidden states, the losses attached. Shared by the unfused route's postprocess and the fused
    route's forward."""
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if mtp_in_postprocess:  # the MTP block, as verl runs it
        kw = dict(extra_block_kwargs or {})
        if "padding_mask" in signature(model.mtp.forward).parameters:
            kw["padding_mask"] = padding_mask
        if mhc_multistream is not None:
            kw["mhc_multistream"] = mhc_multistream
        hidden_states = model.mtp(
            input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
            attention_mask=attention_mask, inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset, embedding=model.embedding, **kw,
        )
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
        if "process_mtp_loss" not in _WARNED:
            _WARNED.add("process_mtp_loss")
            logger.warning("chunked_entropy: megatron-core's process_mtp_loss (>= 0.18) computes the MTP losses "
                           "here: left to verl and megatron-core")
        return own(self, hidden_states, input_ids, position_ids, labels, *rope, **rest)
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


def _recording(check):
    def checked(original):
        check(original)
        _VERLS[_ATTR] = original

    return checked


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
