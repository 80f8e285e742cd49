"""verl 0.9.1's Megatron engine on a tiny megatron-core GPTModel, on the CPU, driven through its own ``forward_step``.

Shared by the tests of the verl plugin's Megatron routes (the fused route, the
MTP heads). Everything is verl's and megatron-core's installed code, except
what cannot run on a CPU, replaced here and only here (:func:`cpu_only_replacements`):

- megatron-core's local ``DotProductAttention`` allocates its score buffer on
  ``torch.cuda.current_device()`` and refuses packed (``thd``) sequences: a
  packing-aware SDPA core attention (causal within each packed sequence) takes
  its place through the layer spec;
- ``RotaryEmbedding.get_emb`` moves its frequencies to ``torch.cuda.current_device()``
  on first use: the CPU copy is kept;
- verl's ``forward_step`` moves the micro-batch to ``get_device_id()``, which
  verl's platform layer has no CPU answer for: ``"cpu"``;
- megatron-core 0.16.1's MTP loss tracker allocates its buffer on
  ``torch.cuda.current_device()``: on the CPU;
- megatron-core's tensor-parallel ``_gather_along_last_dim`` (the MTP layer's
  embedding concat at TP > 1) allocates its output on
  ``torch.cuda.current_device()``: the same gather on the input's device.

:func:`combined_1f1b_on_cpu` lets megatron-core's combined-1F1B schedule plan run on
the CPU (its CUDA events, streams, NVTX ranges and stream records as no-ops).

:func:`with_output_processor_hook` gives 0.16.1's model the ``output_processor``
hook of megatron-core >= 0.18 (which needs Python >= 3.12 to install), with
0.19.2's contract, through a subclass.

verl's Triton ``linear_cross_entropy`` is *not* replaced: it is what the
plugin takes over (the fused route's reference is verl's unfused route on the
same weights, where the logits are computed by megatron-core's output layer).
"""

from __future__ import annotations

import contextlib
import types
import warnings

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import verl  # noqa: F401
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron import transformer_impl

V, HID, HEADS = 48, 16, 2


def core_attention_cls():
    """megatron-core's DotProductAttention with its constructor, computing with SDPA (replaced: CUDA buffer)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedSDPACoreAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:  # [s, b, heads, d]
                q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
            # thd: [t, heads, d], causal within each packed (padded) sequence
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            t = query.shape[0]
            pos = torch.arange(t)
            seq = torch.bucketize(pos, cu[1:].to(torch.int64).cpu(), right=True)
            mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
            q, k, v = (x.permute(1, 0, 2) for x in (query, key, value))  # [heads, t, d]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return out.permute(1, 0, 2).reshape(t, -1)  # [t, heads*d]

    return PackedSDPACoreAttention


@contextlib.contextmanager
def cpu_only_replacements():
    """What cannot run on a CPU, replaced for the duration (see the module docstring); each says why."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import multi_token_prediction as mtp

    saved = []

    def swap(holder, name, value):
        saved.append((holder, name, holder.__dict__[name]))
        setattr(holder, name, value)

    def get_emb(self, max_seq_len, offset=0):
        # megatron-core's get_emb first moves inv_freq to torch.cuda.current_device(); the rest is its own code
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    swap(RotaryEmbedding, "get_emb", get_emb)
    # verl's platform layer has no CPU device id; forward_step moves the batch to get_device_id()
    swap(transformer_impl, "get_device_id", lambda: "cpu")
    # megatron-core's tensor-parallel gather along the last dim (its MTP layer's embedding concat at TP > 1)
    # allocates its output on torch.cuda.current_device(): the same gather, allocated on the input's device
    from megatron.core.tensor_parallel import mappings

    def gather_along_last_dim(input_, group):
        world = group.size()
        if world == 1:
            return input_
        out = torch.empty((input_.shape[0] * world, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        mappings.dist_all_gather_func(out, input_.contiguous(), group=group)
        return torch.cat(out.chunk(world, dim=0), dim=-1).contiguous()

    swap(mappings, "_gather_along_last_dim", gather_along_last_dim)
    # megatron-core 0.16.1's MTP loss tracker allocates its buffer on torch.cuda.current_device() the first time
    tracker = mtp.MTPLossLoggingHelper.tracker
    had = tracker.get("values")
    tracker["values"] = torch.zeros(8)
    try:
        yield
    finally:
        for holder, name, value in reversed(saved):
            setattr(holder, name, value)
        if had is None:
            tracker.pop("values", None)


@contextlib.contextmanager
def combined_1f1b_on_cpu():
    """megatron-core's combined-1F1B schedule plan on the CPU (replaced: CUDA events, streams and NVTX ranges).

    ``TransformerModelChunkSchedulePlan`` and its ``ScheduleNode``s order their
    work with a ``torch.cuda.Event`` (a dummy class that refuses to be built in
    a CPU build of torch), record and wait on ``torch.cuda.current_stream()``
    (no CUDA device) and mark ranges with ``torch.cuda.nvtx`` (absent from a
    CPU build); the backward tells the CUDA caching allocator which stream
    uses a gradient (``Tensor.record_stream``, which refuses a CPU tensor). On
    one CPU stream nothing needs ordering: the event records and waits
    nothing, the current stream is ``None`` (``torch.cuda.stream(None)`` is
    torch's own no-op case), the ranges and the stream records are no-ops.
    The plan, its nodes and every computation they run are megatron-core's.
    """
    class Event:  # one CPU stream: nothing to order
        def record(self, stream=None):
            pass

        def wait(self, stream=None):
            pass

    saved = [(torch.cuda, "Event", torch.cuda.Event), (torch.cuda, "current_stream", torch.cuda.current_stream),
             (torch.cuda.nvtx, "range_push", torch.cuda.nvtx.range_push),
             (torch.cuda.nvtx, "range_pop", torch.cuda.nvtx.range_pop)]
    torch.cuda.Event = Event
    torch.cuda.current_stream = lambda device=None: None
    torch.cuda.nvtx.range_push = lambda msg: None
    torch.cuda.nvtx.range_pop = lambda: None
    torch.Tensor.record_stream = lambda self, stream: None  # a CUDA allocator hint; nothing to record on the CPU
    try:
        yield
    finally:
        del torch.Tensor.record_stream  # torch's own, inherited from the C tensor base class, again
        for holder, name, value in saved:
            setattr(holder, name, value)


def gpt_model(tp: int, *, tied: bool, seed: int = 0, mtp_layers: int = 0, sequence_parallel: bool = False,
              config_class=None, config_fields=None):
    """A one-layer megatron-core GPTModel with RoPE, its weights the same at every TP size (CPU initialisation).

    ``config_class`` (a ``TransformerConfig`` subclass) and ``config_fields`` build another config."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(config_fields or {})
    if mtp_layers:
        extra.update(mtp_num_layers=mtp_layers, mtp_loss_scaling_factor=0.3)
    cfg = (config_class or TransformerConfig)(
        num_layers=1, hidden_size=HID, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sequence_parallel,
        **extra,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = core_attention_cls()
    kw = {}
    if mtp_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        kw["mtp_block_spec"] = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    torch.manual_seed(seed)
    with _sequence_parallel_torch_norm() if sequence_parallel else contextlib.nullcontext():
        return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=64, share_embeddings_and_output_weights=tied,
                        position_embedding_type="rope", **kw)


@contextlib.contextmanager
def _sequence_parallel_torch_norm():
    """megatron-core's torch norm (the local spec's) with ``sequence_parallel`` on (replaced: CUDA-only norms).

    ``WrappedTorchNorm`` refuses sequence parallelism because Megatron's
    sequence-parallel models use Transformer Engine's or Apex's norms, which
    need CUDA. The norm itself is per token; its weight gradient is this
    rank's part of the sequence (Megatron's ``finalize_model_grads`` sums it
    over the group), the same on every route compared. The same torch norm is
    built, from a copy of the config without the flag.
    """
    import copy

    from megatron.core.transformer import torch_norm

    own = torch_norm.WrappedTorchNorm.__dict__["__new__"]

    def new(cls, config, *args, **kwargs):
        config = copy.copy(config)
        config.sequence_parallel = False
        return own.__func__(cls, config, *args, **kwargs)

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)
    try:
        yield
    finally:
        torch_norm.WrappedTorchNorm.__new__ = own


def engine(model, *, fused: bool, chunk_size: int = 5, mtp_train: bool = False):
    """verl's MegatronEngineWithLMHead around ``model``, without its (GPU) initialisation; the fused route is
    switched on by verl's own ``_maybe_enable_fused_kernels``."""
    eng = object.__new__(transformer_impl.MegatronEngineWithLMHead)
    eng.engine_config = McoreEngineConfig(use_fused_kernels=fused, use_remove_padding=True,
                                          entropy_from_logits_chunk_size=chunk_size)
    eng.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        mtp=types.SimpleNamespace(enable=mtp_train, enable_train=mtp_train),
    )
    eng.enable_routing_replay = False
    eng.tf_config = model.config
    eng.module = [model]
    eng.is_value_model = False
    eng._maybe_enable_fused_kernels()
    return eng


def batch(lengths, *, seed: int, temperatures, flags: dict, extra: dict | None = None):
    """verl's micro-batch for the Megatron engine: nested (jagged) input ids and loss mask, one temperature a
    sequence, verl's flags as non-tensor data."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    ids[0][0], ids[-1][-1] = 0, V - 1  # both vocabulary shards
    mask = [(torch.arange(n) >= n // 3).to(torch.int64) for n in lengths]
    tensors = {
        "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
        "loss_mask": torch.nested.nested_tensor(mask, layout=torch.jagged),
        "temperature": torch.as_tensor(temperatures, dtype=torch.float32),
        **(extra or {}),
    }
    return tu.get_tensordict(tensors, non_tensor_dict=dict(flags))


def forward(eng, model, data, logits_processor_func=None):
    """verl's own ``forward_step`` on one micro-batch: its output dict (nested tensors, one row a sequence)."""
    output, _ = eng.forward_step(iter([data]), model, logits_processor_func, eng.postprocess_micro_batch_func)
    return output


def with_output_processor_hook(model):
    """``model`` as a GPTModel of megatron-core >= 0.18: ``forward`` takes ``output_processor`` and
    ``output_processor_context`` and hands them to ``self._postprocess`` (an instance attribute when verl's MTP
    patch bound its own), whose class version, when a processor is given, runs the MTP block, then
    ``process_mtp_loss`` (0.19's, :func:`process_mtp_loss_019`) and returns ``output_processor(**kw)`` (0.19's
    keywords: ``hidden_states`` (sequence-sharded under SP), ``output_layer``, ``output_weight`` (the tied
    embedding or None), ``labels``, ``loss_mask``, ``context``, ``config`` and the forward's inputs).
    Written after megatron-core core_r0.19.0 at f8837c04ef (version 0.19.1; no core_v0.19.2 tag in the mirror
    read), megatron/core/models/gpt/gpt_model.py, ``GPTModel.forward`` (lines 519-618) and ``_postprocess``
    (lines 620-737). 0.18 needs Python >= 3.12: this is 0.16.1's model with that contract added by a subclass;
    without a processor, 0.16.1's own ``_postprocess`` runs."""
    from megatron.core.models.gpt import GPTModel

    class HookedGPTModel(GPTModel):
        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                    runtime_gather_output=None, *, inference_params=None, loss_mask=None, padding_mask=None,
                    output_processor=None, output_processor_context=None):
            # 0.19's forward: 0.16.1's preprocess and decoder (the same calls), then the postprocess with the hook
            pre = self._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                                   inference_context=inference_context, packed_seq_params=packed_seq_params,
                                   padding_mask=padding_mask)
            decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = pre[:6]
            hidden_states = self.decoder(
                hidden_states=decoder_input, attention_mask=attention_mask, inference_context=inference_context,
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=pre[6] if len(pre) == 7 else None, packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset, padding_mask=padding_mask, **(extra_block_kwargs or {}))
            return self._postprocess(
                hidden_states=hidden_states, input_ids=input_ids, position_ids=position_ids, labels=labels,
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                mtp_in_postprocess=self.mtp_process, loss_mask=loss_mask, decoder_input=decoder_input,
                attention_mask=attention_mask, padding_mask=padding_mask, inference_params=inference_params,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                runtime_gather_output=runtime_gather_output, extra_block_kwargs=extra_block_kwargs,
                inference_context=inference_context, output_processor=output_processor,
                output_processor_context=output_processor_context)

        def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                         rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, decoder_input=None,
                         attention_mask=None, padding_mask=None, inference_params=None, packed_seq_params=None,
                         sequence_len_offset=None, runtime_gather_output=None, extra_block_kwargs=None,
                         inference_context=None, output_processor=None, output_processor_context=None):
            if output_processor is None:  # 0.16.1's own (no padding_mask there)
                return super()._postprocess(
                    hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                    mtp_in_postprocess=mtp_in_postprocess, loss_mask=loss_mask, decoder_input=decoder_input,
                    attention_mask=attention_mask, inference_params=inference_params,
                    packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                    runtime_gather_output=runtime_gather_output, extra_block_kwargs=extra_block_kwargs,
                    inference_context=inference_context)
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            if mtp_in_postprocess:  # 0.16.1's MTP block has no padding_mask parameter
                hidden_states = self.mtp(
                    input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                    attention_mask=attention_mask, inference_params=None, rotary_pos_emb=rotary_pos_emb,
                    rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                    packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                    embedding=self.embedding, **(extra_block_kwargs or {}))
            if not self.post_process:
                return hidden_states
            if self.config.mtp_num_layers:
                hidden_states = process_mtp_loss_019(
                    hidden_states=hidden_states, labels=labels, loss_mask=loss_mask, output_layer=self.output_layer,
                    output_weight=weight, runtime_gather_output=runtime_gather_output, is_training=self.training,
                    compute_language_model_loss=self.compute_language_model_loss, config=self.config,
                    cp_group=self.pg_collection.cp, tp_group=self.tp_group, packed_seq_params=packed_seq_params,
                    scale_logits_fn=None, input_ids=input_ids)
            return output_processor(
                hidden_states=hidden_states, output_layer=self.output_layer, output_weight=weight, labels=labels,
                loss_mask=loss_mask, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                decoder_input=decoder_input, inference_context=inference_context, packed_seq_params=packed_seq_params,
                runtime_gather_output=runtime_gather_output, context=output_processor_context,
                compute_language_model_loss=self.compute_language_model_loss, scale_logits=None, config=self.config)

    model.__class__ = HookedGPTModel
    return model


# ----------------------------------------------------------------------------- megatron-core 0.19's process_mtp_loss
# Written after megatron-core core_r0.19.0 at f8837c04ef (0.19.1), megatron/core/transformer/multi_token_prediction.py:
# process_mtp_loss (lines 760-894), _compute_mtp_acceptance_counts and _vocab_parallel_argmax (lines 484-553),
# MTPLossLoggingHelper.save_metrics_to_tracker (lines 348-385). Built on 0.16.1's roll_tensor, MTPLossAutoScaler,
# output layer and compute_language_model_loss (the same in 0.19); the tracker's buffers are allocated on the loss's
# device (0.19 allocates them on torch.cuda.current_device()).


def _vocab_parallel_argmax(logits, group):
    size = torch.distributed.get_world_size(group)
    vals, ids = logits.max(dim=-1)
    all_vals = [torch.empty_like(vals) for _ in range(size)]
    all_ids = [torch.empty_like(ids) for _ in range(size)]
    torch.distributed.all_gather(all_vals, vals, group=group)
    torch.distributed.all_gather(all_ids, ids, group=group)
    rank = torch.stack(all_vals).argmax(dim=0)
    return rank * logits.shape[-1] + torch.stack(all_ids).gather(0, rank.unsqueeze(0)).squeeze(0)


def _acceptance_counts(logits, labels, loss_mask, output_layer, runtime_gather_output, tp_group):
    with torch.no_grad():
        sharded = (not runtime_gather_output) if runtime_gather_output is not None \
            else not getattr(output_layer, "gather_output", False)
        if tp_group is not None and tp_group.size() > 1 and sharded:
            preds = _vocab_parallel_argmax(logits, tp_group)
        else:
            preds = logits.argmax(dim=-1)
        valid = loss_mask.transpose(0, 1).bool()
        return ((preds == labels.transpose(0, 1)) & valid).sum().float(), valid.sum().float()


def save_metrics_to_tracker(loss, correct, total, layer_number, num_layers, reduce_group=None, avg_group=None):
    """megatron-core 0.19's ``MTPLossLoggingHelper.save_metrics_to_tracker`` (0.16.1 has ``save_loss_to_tracker``)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if layer_number is None:
        return
    tracker = MTPLossLoggingHelper.tracker
    for key in ("loss_values", "correct_values", "total_values"):
        if key not in tracker:
            tracker[key] = torch.zeros(num_layers, device=loss.device)
    tracker["loss_values"][layer_number] += loss.detach()
    tracker["correct_values"][layer_number] += correct.detach()
    tracker["total_values"][layer_number] += total.detach()
    tracker["reduce_group"], tracker["avg_group"] = reduce_group, avg_group


def process_mtp_loss_019(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                         is_training, compute_language_model_loss, config, cp_group=None, tp_group=None,
                         packed_seq_params=None, scale_logits_fn=None, input_ids=None):
    """megatron-core 0.19's ``process_mtp_loss`` (the reference the plugin's ``process_mtp_loss`` is tested against)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor

    n = config.mtp_num_layers
    parts = torch.chunk(hidden_states, 1 + n, dim=0)
    hidden_states = parts[0]
    roll = dict(shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    derived = labels is None
    if derived:
        if input_ids is None:
            return hidden_states
        labels, _ = roll_tensor(input_ids, **roll)
    if getattr(config, "mtp_detach_heads", False):
        output_weight = (output_weight if output_weight is not None else output_layer.weight).detach()
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived:
        loss_mask, _ = roll_tensor(loss_mask, **roll)
    original_num_tokens = loss_mask.sum()
    for i in range(n):
        logits, _ = output_layer(parts[i + 1], weight=output_weight, runtime_gather_output=runtime_gather_output)
        if scale_logits_fn is not None:
            logits = scale_logits_fn(logits)
        mtp_labels, _ = roll_tensor(mtp_labels, **roll)
        loss_mask, num_tokens = roll_tensor(loss_mask, **roll)
        loss = loss_mask * compute_language_model_loss(mtp_labels, logits)
        if is_training:
            logged = torch.sum(loss) * (num_tokens > 0).to(loss.dtype) / num_tokens.clamp(min=1)
            correct, total = _acceptance_counts(logits, mtp_labels, loss_mask, output_layer, runtime_gather_output,
                                                tp_group)
            save_metrics_to_tracker(logged, correct, total, i, n,
                                    avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        scale = config.mtp_loss_scaling_factor / n
        if config.calculate_per_token_loss:
            attached = scale * loss * (original_num_tokens / torch.clamp(num_tokens, min=1))
        else:
            attached = scale * loss / num_tokens.clamp(min=1)
        hidden_states = MTPLossAutoScaler.apply(hidden_states, attached)
    return hidden_states


@contextlib.contextmanager
def megatron_019_mtp():
    """What verl's ``mtp_patch`` finds at import under megatron-core 0.19 (``_HAS_PROCESS_MTP_LOSS``,
    ``_process_mtp_loss`` and its parameters), and 0.19's tracker method, for the duration."""
    from inspect import signature

    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from verl.models.mcore import mtp_patch

    saved = {k: mtp_patch.__dict__.get(k) for k in ("_HAS_PROCESS_MTP_LOSS", "_process_mtp_loss",
                                                      "_PROCESS_MTP_LOSS_PARAMS")}
    mtp_patch._HAS_PROCESS_MTP_LOSS = True
    mtp_patch._process_mtp_loss = process_mtp_loss_019
    mtp_patch._PROCESS_MTP_LOSS_PARAMS = set(signature(process_mtp_loss_019).parameters)
    MTPLossLoggingHelper.save_metrics_to_tracker = staticmethod(save_metrics_to_tracker)
    try:
        yield
    finally:
        del MTPLossLoggingHelper.save_metrics_to_tracker
        for key in ("loss_values", "correct_values", "total_values"):
            MTPLossLoggingHelper.tracker.pop(key, None)
        for k, v in saved.items():
            if v is None:
                mtp_patch.__dict__.pop(k, None)
            else:
                setattr(mtp_patch, k, v)


@contextlib.contextmanager
def sequence_parallel_on_cpu():
    """megatron-core's sequence-parallel collectives on the CPU (replaced: their buffers' device).

    Its sequence-parallel gathers and reduce-scatters (``tensor_parallel.mappings``,
    the column-parallel linear's gather, the global memory buffer) allocate
    their outputs on ``torch.cuda.current_device()``; here that answers
    ``"cpu"``. The collectives themselves are megatron-core's, over gloo.
    The sequence-parallel embedding forks the CUDA RNG tracker (for its
    dropout, 0 here): there is no CUDA RNG, so the fork is a no-op.
    """
    from megatron.core.tensor_parallel import random as tp_random

    own = torch.cuda.current_device
    tracker = tp_random.get_cuda_rng_tracker()
    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device = own
        del tracker.fork


class _CudaAllocationsOnCpu(torch.overrides.TorchFunctionMode):
    """Tensor factories called with ``device="cuda"`` allocate on the CPU instead (nothing else is touched)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_training_on_cpu():
    """verl's Megatron ``train_batch`` on the CPU: megatron-core's DDP, schedule and optimizer (replaced: where
    they allocate).

    megatron-core 0.16.1 and verl 0.9.1 allocate a few tensors on a hard-coded
    CUDA device, which a CPU build of torch refuses; here they are made on the
    CPU, and nothing else changes:

    - ``DistributedDataParallel``'s grad buffer (``param_and_grad_buffer.py``,
      ``device=torch.cuda.current_device()``): ``torch.cuda.current_device()``
      answers ``"cpu"``;
    - ``device="cuda"`` scalars: the token count of ``forward_backward_no_pipelining``
      (``schedules.py``), the optimizer's ``found_inf`` / grad-norm scalars
      (``optimizer/__init__.py``, ``optimizer.py``) and the grad-norm
      reduction's (``utils.py``): a torch function mode turns ``device="cuda"``
      into ``"cpu"`` in factory calls.

    Gradient clipping is not reachable on a CPU: megatron-core's
    ``clip_grad_by_total_norm_fp32`` asserts ``param.grad.type() ==
    'torch.cuda.FloatTensor'``; callers set ``clip_grad=0`` (the grad norm is
    still computed and returned).
    """
    own = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with _CudaAllocationsOnCpu():
            yield
    finally:
        torch.cuda.current_device = own


def trained_engine(model, *, fused: bool, chunk_size: int = 5, lr: float = 1e-2):
    """:func:`engine` with what verl's ``initialize()`` adds for training: the model wrapped in megatron-core's
    ``DistributedDataParallel`` (no distributed optimizer, verl's ``use_distributed_optimizer=False``), verl's
    own ``get_megatron_optimizer`` (Adam, no gradient clipping: see :func:`megatron_training_on_cpu`) and
    ``register_megatron_training_hooks``. Call under :func:`megatron_training_on_cpu`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from verl.utils.megatron.optimizer import get_megatron_optimizer, init_megatron_optim_config
    from verl.utils.megatron_utils import register_megatron_training_hooks
    from verl.workers.config.optimizer import McoreOptimizerConfig

    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False))
    eng = engine(model, fused=fused, chunk_size=chunk_size)
    eng.module = [ddp]
    cfg = init_megatron_optim_config(McoreOptimizerConfig(lr=lr, clip_grad=0.0, weight_decay=0.01),
                                     use_distributed_optimizer=False, fp16=False, bf16=False)
    eng.optimizer = get_megatron_optimizer(model=[ddp], config=cfg)
    register_megatron_training_hooks([ddp], eng.optimizer)
    return eng


def mamba_model(tp: int, *, tied: bool, seed: int = 0, sequence_parallel: bool = False):
    """megatron-core 0.16.1's MambaModel of one attention and one MLP layer (pattern ``"*-"``), no Mamba mixer.

    Replaced here, each because it needs CUDA: megatron-core's ``mamba_stack_spec``
    builds its attention and MLP layers from Transformer Engine modules, so the
    stack spec below uses the local layers of ``get_gpt_layer_local_spec``
    (torch norm, column/row-parallel linears, the SDPA core attention of
    :func:`core_attention_cls`); ``MambaStack``'s final norm is Transformer
    Engine's ``TENorm``, built here as the local torch norm for the duration.
    The Mamba mixer (CUDA kernels) is not used.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.mamba import MambaModel
    from megatron.core.ssm import mamba_block
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    cfg = TransformerConfig(
        num_layers=2, hidden_size=HID, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sequence_parallel,
    )
    local = get_gpt_layer_local_spec().submodules
    local.self_attention.submodules.core_attention = core_attention_cls()
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=local.input_layernorm, self_attention=local.self_attention,
        self_attn_bda=local.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda))
    spec = ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(attention_layer=attention, mlp_layer=mlp))
    own_norm = mamba_block.TENorm
    mamba_block.TENorm = WrappedTorchNorm
    torch.manual_seed(seed)
    try:
        with _sequence_parallel_torch_norm() if sequence_parallel else contextlib.nullcontext():
            return MambaModel(cfg, spec, vocab_size=V, max_sequence_length=64, hybrid_override_pattern="*-",
                              share_embeddings_and_output_weights=tied, position_embedding_type="rope")
    finally:
        mamba_block.TENorm = own_norm


def hybrid_model_019(tp: int, *, tied: bool, seed: int = 0, sequence_parallel: bool = False):
    """megatron-core 0.19's ``HybridModel``, reproduced on 0.16.1's ``MambaModel`` (0.19 needs Python >= 3.12).

    Installed as ``megatron.core.models.hybrid.hybrid_model.HybridModel``
    (``sys.modules``, removed by :func:`drop_hybrid_019`), the module the
    plugins patch on 0.19. Its ``forward`` has 0.19's signature
    (``loss_mask=`` included) and 0.19's post-processing, written from
    Megatron-LM ``core_v0.19.0`` (5be96267), ``megatron/core/models/hybrid/hybrid_model.py``:

    - lines 415-429: the signature;
    - lines 551-552: ``if not self.post_process: return hidden_states``;
    - lines 554-589 (MTP, spec decoding): not reproduced (no MTP here);
    - lines 590-611 (inference, last-token logits): not reproduced (training only);
    - lines 613-616: ``logits, _ = self.output_layer(hidden_states, weight=output_weight,
      runtime_gather_output=runtime_gather_output)``; ``logits = self._scale_logits(logits)``;
    - lines 627-633: ``labels is None``: ``logits.transpose(0, 1).contiguous()``, else
      ``self.compute_language_model_loss(labels, logits)``;

    and ``LanguageModule._scale_logits`` (``language_module.py`` lines 320-334:
    the logits unchanged without ``config.use_mup``). The embedding, RoPE and
    decoder are 0.16.1's ``MambaModel``'s (its ``forward``, lines 207-259).
    """
    import sys
    import types

    from megatron.core.models.mamba import MambaModel

    class HybridModel(MambaModel):
        def _scale_logits(self, logits):
            if not getattr(self.config, "use_mup", False):  # 0.16.1's TransformerConfig has no use_mup
                return logits
            raise NotImplementedError("MuP scaling is not reproduced")

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, runtime_gather_output=None, *, inference_params=None, loss_mask=None,
                    packed_seq_params=None, padding_mask=None):
            # 0.16.1's MambaModel.forward, lines 207-259: embedding, RoPE, decoder (training)
            if decoder_input is None and self.pre_process:
                decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
            rotary_pos_emb = None
            if self.position_embedding_type == "rope":
                rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(
                    inference_context, self.decoder, decoder_input, self.config, packed_seq_params)
                rotary_pos_emb = self.rotary_pos_emb(
                    rotary_seq_len, packed_seq=packed_seq_params is not None and packed_seq_params.qkv_format == "thd")
            hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                         inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                                         packed_seq_params=packed_seq_params, padding_mask=padding_mask)
            # 0.19's post-processing (hybrid_model.py lines 551-633, see above)
            if not self.post_process:
                return hidden_states
            output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
                else None
            logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                          runtime_gather_output=runtime_gather_output)
            logits = self._scale_logits(logits)
            if labels is None:
                return logits.transpose(0, 1).contiguous()
            return self.compute_language_model_loss(labels, logits)

    name = "megatron.core.models.hybrid.hybrid_model"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__doc__ = "test-side reproduction of megatron-core 0.19's HybridModel (tests/verl_engine.py)"
        sys.modules[name] = module
    HybridModel.__module__ = name
    module.HybridModel = HybridModel
    model = mamba_model(tp, tied=tied, seed=seed, sequence_parallel=sequence_parallel)
    model.__class__ = HybridModel  # the same modules and weights, 0.19's forward
    return model


def drop_hybrid_019():
    import sys

    sys.modules.pop("megatron.core.models.hybrid.hybrid_model", None)
