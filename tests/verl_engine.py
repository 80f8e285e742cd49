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


def gpt_model(tp: int, *, tied: bool, seed: int = 0, mtp_layers: int = 0):
    """A one-layer megatron-core GPTModel with RoPE, its weights the same at every TP size (CPU initialisation)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if mtp_layers:
        extra = dict(mtp_num_layers=mtp_layers, mtp_loss_scaling_factor=0.3)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HID, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, **extra,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = core_attention_cls()
    kw = {}
    if mtp_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        kw["mtp_block_spec"] = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    torch.manual_seed(seed)
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=64, share_embeddings_and_output_weights=tied,
                    position_embedding_type="rope", **kw)


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
    ``output_processor_context`` and, after the decoder, returns ``output_processor(**kw)`` (0.19.2's contract:
    keyword arguments ``hidden_states`` (sequence-sharded under SP), ``output_layer``, ``output_weight`` (the tied
    embedding or None), ``labels``, ``context``, ``config``, and the forward's inputs). 0.18 needs Python >= 3.12;
    this is 0.16.1's model with that hook added by a subclass (its own forward runs everything else)."""
    from megatron.core.models.gpt import GPTModel

    class HookedGPTModel(GPTModel):
        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                    runtime_gather_output=None, *, inference_params=None, loss_mask=None, padding_mask=None,
                    output_processor=None, output_processor_context=None):
            kw = dict(decoder_input=decoder_input, labels=labels, inference_context=inference_context,
                      packed_seq_params=packed_seq_params, extra_block_kwargs=extra_block_kwargs,
                      runtime_gather_output=runtime_gather_output, inference_params=inference_params,
                      loss_mask=loss_mask, padding_mask=padding_mask)
            if output_processor is None or not self.post_process:
                return super().forward(input_ids, position_ids, attention_mask, **kw)

            def postprocess(hidden_states, input_ids, position_ids, labels, *args, decoder_input=None,
                            attention_mask=None, **rest):
                weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
                return output_processor(
                    hidden_states=hidden_states, output_layer=self.output_layer, output_weight=weight, labels=labels,
                    context=output_processor_context, config=self.config, input_ids=input_ids,
                    position_ids=position_ids, attention_mask=attention_mask, decoder_input=decoder_input,
                )

            self._postprocess = postprocess
            try:
                return super().forward(input_ids, position_ids, attention_mask, **kw)
            finally:
                del self._postprocess

    model.__class__ = HookedGPTModel
    return model
