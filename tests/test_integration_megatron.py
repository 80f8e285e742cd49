"""A tiny megatron-core ``GPTModel`` end to end with the fused head, TP=2 on CPU/gloo.

Real megatron-core 0.16.1. One piece of the model does not run on CPU and is
swapped through the layer spec (the way Megatron's specs are meant to be
customised): the local spec's ``DotProductAttention`` allocates its score
buffer with ``parallel_state.get_global_memory_buffer()`` on
``torch.cuda.current_device()``. :class:`_CPUCoreAttention` keeps its
constructor and computes the same causal softmax attention with PyTorch's SDPA.

The reference is the same model, unpatched: its vocab-parallel logits (all
gathered, float64) give log-probs and entropy, and Megatron's own loss path
(``labels=`` -> ``vocab_parallel_cross_entropy``) gives the log-probs too.
Every parameter's gradient must match.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from chunked_entropy import LogProbsEntropy  # noqa: E402
from chunked_entropy.integrations.megatron import (  # noqa: E402
    FusedLogProbsOptions,
    disable_fused_log_probs,
    enable_fused_log_probs,
    fused_log_probs_options,
)
from tests.helpers import reference, run_distributed  # noqa: E402

B, S, V, HID = 2, 8, 32, 16
VALUES = dict(rtol=1e-5, atol=1e-5)
# Gradients of the transformer's parameters come through attention, MLP and
# layer norms in float32 on both sides; the paths differ only in the head
# (float32 per-chunk vs full-logit float64 reference), ~1e-6 relative, which
# the layers below carry with some growth.
GRADS = dict(rtol=1e-4, atol=1e-5)


def _core_attention_cls():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class _CPUCoreAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)  # [s, b, heads*d]

    return _CPUCoreAttention


def _model(tied: bool, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1, hidden_size=HID, num_attention_heads=2, tensor_model_parallel_size=2,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = _core_attention_cls()
    torch.manual_seed(seed)
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=S, share_embeddings_and_output_weights=tied)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, 0], labels[1, 0] = 0, V - 1  # ids on both shards
    pos = torch.arange(S).expand(B, S)
    g_lp = torch.randn(B, S, generator=g, dtype=torch.float64)
    g_h = torch.randn(B, S, generator=g, dtype=torch.float64)
    return ids, pos, labels, g_lp, g_h


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _reference(model, ids, pos, labels, g_lp, g_h, rank, *, temperature=1.0, label_mask=None, entropy=True):
    """float64 outputs from the unpatched model's gathered logits; backward into the model."""
    logits = model(ids, pos, None)  # [B, S, V/2], this rank's shard
    parts = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(parts, logits.detach().contiguous())
    full = torch.cat(parts, dim=-1).double().requires_grad_()
    lp, ent = reference(full, labels, temperature=temperature, label_mask=label_mask)
    ((lp * g_lp).sum() + ((ent * g_h).sum() if entropy else 0)).backward()
    vl = V // 2
    logits.backward(full.grad[..., rank * vl:(rank + 1) * vl].float())
    return lp.detach(), ent.detach(), _grads(model)


def _compare(out, lp, ent, grads, model, what, *, entropy=True):
    assert isinstance(out, LogProbsEntropy) and out.log_probs.shape == (B, S), what
    torch.testing.assert_close(out.log_probs.double(), lp, **VALUES, msg=lambda m: f"{what} log_probs: {m}")
    if entropy:
        torch.testing.assert_close(out.entropy.double(), ent, **VALUES, msg=lambda m: f"{what} entropy: {m}")
    else:
        assert out.entropy is None
    got = _grads(model)
    assert got.keys() == grads.keys(), what
    for name in grads:
        torch.testing.assert_close(got[name], grads[name], **GRADS, msg=lambda m, name=name: f"{what} grad {name}: {m}")


def _untied(rank):
    from megatron.core import parallel_state

    model = _model(tied=False, seed=0)
    ids, pos, labels, g_lp, g_h = _batch(1)
    keys = set(model.state_dict().keys())
    n_params = len(list(model.parameters()))

    lp, ent, grads = _reference(model, ids, pos, labels, g_lp, g_h, rank)
    meg_loss = model(ids, pos, None, labels=labels).detach()  # Megatron's own CE path
    model.zero_grad(set_to_none=True)

    head = enable_fused_log_probs(model, chunk_size=3, vocab_chunk_size=5)
    assert head.weight is model.output_layer.weight
    assert head.process_group is parallel_state.get_tensor_model_parallel_group()
    assert set(model.state_dict().keys()) == keys and len(list(model.parameters())) == n_params
    out = model(ids, pos, None, labels=labels)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _compare(out, lp, ent, grads, model, f"rank {rank} untied")
    torch.testing.assert_close(out.log_probs, -meg_loss, **VALUES)

    # Without labels the model still returns its logits.
    assert model(ids, pos, None).shape == (B, S, V // 2)

    # Per-call options: a per-sample temperature and a label mask, in a with block ...
    temperature = torch.tensor([0.7, 1.6])
    mask = torch.rand(B, S, generator=torch.Generator().manual_seed(2)) > 0.3
    disable_fused_log_probs(model)
    lp, ent, grads = _reference(model, ids, pos, labels, g_lp, g_h, rank,
                                temperature=temperature.view(B, 1), label_mask=mask)
    enable_fused_log_probs(model, chunk_size=4)
    with fused_log_probs_options(model, temperature=temperature, label_mask=mask):
        out = model(ids, pos, None, labels=labels)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _compare(out, lp, ent, grads, model, f"rank {rank} per-sample temperature + mask")

    # ... and compute_entropy=False from a duck-typed config, with the mask as Megatron's loss_mask.
    disable_fused_log_probs(model)
    lp, ent, grads = _reference(model, ids, pos, labels, g_lp, g_h, rank, temperature=0.8, label_mask=mask,
                                entropy=False)
    cfg = types.SimpleNamespace(chunk_size=5, vocab_chunk_size=None, temperature=0.8, compute_entropy=False)
    enable_fused_log_probs(model, cfg)
    out = model(ids, pos, None, labels=labels, loss_mask=mask.float())
    (out.log_probs * g_lp.float()).sum().backward()
    _compare(out, lp, ent, grads, model, f"rank {rank} config, loss_mask", entropy=False)
    assert torch.all(out.log_probs[~mask] == 0)
    return model, ids, pos, labels


def _patching(rank, model, ids, pos, labels):
    from megatron.core import parallel_state

    # Re-enabling replaces the head; disabling restores the model exactly.
    head = enable_fused_log_probs(model, chunk_size=2, process_group=parallel_state.get_tensor_model_parallel_group())
    assert head.chunk_size == 2
    assert disable_fused_log_probs(model) is True
    assert "_postprocess" not in model.__dict__ and "_chunked_entropy_fused" not in model.__dict__
    assert disable_fused_log_probs(model) is False
    loss = model(ids, pos, None, labels=labels)
    assert isinstance(loss, torch.Tensor) and loss.shape == (B, S)  # Megatron's own loss again

    # A failed enable leaves the model as it was.
    before = dict(model.__dict__)
    for bad, err, match in (
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(compute_entropy="yes"), ValueError, "compute_entropy"),
        (dict(chunk=3), TypeError, "chunk"),
    ):
        with pytest.raises(err, match=match):
            enable_fused_log_probs(model, **bad)
        assert model.__dict__ == before
    with pytest.raises(TypeError, match="GPTModel"):
        enable_fused_log_probs(torch.nn.Linear(2, 2))
    model.post_process = False
    with pytest.raises(ValueError, match="post_process"):
        enable_fused_log_probs(model)
    model.post_process = True
    assert model.__dict__.keys() == before.keys()
    with pytest.raises(ValueError, match="enable_fused_log_probs"):
        with fused_log_probs_options(model, temperature=2.0):
            pass

    # Without a group on the output layer, parallel_state's TP group is taken.
    layer_group, model.output_layer.tp_group = model.output_layer.tp_group, None
    try:
        head = enable_fused_log_probs(model)
    finally:
        model.output_layer.tp_group = layer_group
    assert head.process_group is parallel_state.get_tensor_model_parallel_group()

    # Nested option blocks: the innermost wins, and the outer one is back after it.
    t_out, t_in = torch.tensor([0.5, 2.0]), torch.tensor([1.5, 0.9])
    with fused_log_probs_options(model, temperature=t_out, compute_entropy=False):
        with fused_log_probs_options(model, temperature=t_in):
            inner = model(ids, pos, None, labels=labels)
        outer = model(ids, pos, None, labels=labels)
    plain = model(ids, pos, None, labels=labels)
    assert inner.entropy is None and outer.entropy is None and plain.entropy is not None
    disable_fused_log_probs(model)
    logits = model(ids, pos, None).detach()
    parts = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(parts, logits.contiguous())
    full = torch.cat(parts, dim=-1).double()
    for got, t in ((inner, t_in), (outer, t_out), (plain, 1.0)):
        want = reference(full, labels, temperature=t.view(B, 1) if torch.is_tensor(t) else t)[0]
        torch.testing.assert_close(got.log_probs.detach().double(), want, **VALUES)

    # Bad input at call time names the argument.
    enable_fused_log_probs(model)
    with pytest.raises(ValueError, match="labels"):
        model(ids, pos, None, labels=labels.t().contiguous())
    with pytest.raises(ValueError, match="labels must be vocabulary ids"):
        model(ids, pos, None, labels=labels + V)
    with pytest.raises(ValueError, match="temperature"):
        with fused_log_probs_options(model, temperature=torch.ones(3)):
            model(ids, pos, None, labels=labels)
    with pytest.raises(ValueError, match="label_mask"):
        with fused_log_probs_options(model, label_mask=torch.ones(B, 1, dtype=torch.bool)):
            model(ids, pos, None, labels=labels)
    # An option refused on one rank only (a per-sample temperature of the wrong length): every rank raises
    # the same error at once, instead of rank 0 waiting in the head's all-gather (30 min under gloo).
    with pytest.raises(ValueError, match=r"temperature must be per sample .* refused on rank 1 of the 2 ranks"):
        with fused_log_probs_options(model, temperature=torch.ones(3 if rank == 1 else B)):
            model(ids, pos, None, labels=labels)
    ok = model(ids, pos, None, labels=labels)  # the group is still usable
    torch.testing.assert_close(ok.log_probs.detach(), plain.log_probs.detach(), **VALUES)
    disable_fused_log_probs(model)


def _tied(rank):
    from chunked_entropy import ChunkedEntropyConfig

    model = _model(tied=True, seed=3)
    assert model.output_layer.weight is None
    ids, pos, labels, g_lp, g_h = _batch(4)
    lp, ent, grads = _reference(model, ids, pos, labels, g_lp, g_h, rank, temperature=1.2)
    cfg = ChunkedEntropyConfig(chunk_size="auto", max_chunk_bytes=2 * 4 * 4 * (V // 2), temperature=1.2)
    head = enable_fused_log_probs(model, cfg)
    assert head.weight is model.embedding.word_embeddings.weight
    assert head.chunk_size == 4  # resolved from the budget: 2 buffers x 4 bytes x 4 rows x V_local
    out = model(ids, pos, None, labels=labels)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _compare(out, lp, ent, grads, model, f"rank {rank} tied")
    # Without the entropy, one buffer per chunk: the same budget holds twice the rows.
    assert enable_fused_log_probs(model, cfg, compute_entropy=False).chunk_size == 8
    disable_fused_log_probs(model)


def _hook_contract(rank):
    """megatron-core >= 0.18 passes an ``output_processor`` through ``GPTModel.forward``.

    0.16.1 has no such hook, so a subclass adds it to the real model with the
    documented contract (forward takes ``output_processor`` and
    ``output_processor_context``; ``_postprocess`` calls the processor with
    keyword arguments after the decoder and returns its result). This checks
    that the helper takes the hook path (no ``_postprocess`` override) and
    reads per-call options from the context.
    """
    from megatron.core.models.gpt import GPTModel

    class HookedGPT(GPTModel):
        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *,
                    loss_mask=None, output_processor=None, output_processor_context=None):
            if output_processor is None:
                return super().forward(input_ids, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
            hidden = self.decoder(hidden_states=self.embedding(input_ids=input_ids, position_ids=position_ids),
                                  attention_mask=attention_mask)
            return output_processor(
                hidden_states=hidden, output_layer=self.output_layer, output_weight=None, labels=labels,
                context=output_processor_context, config=self.config, loss_mask=loss_mask, input_ids=input_ids,
            )

    model = _model(tied=False, seed=5)
    model.__class__ = HookedGPT
    ids, pos, labels, g_lp, g_h = _batch(6)
    lp, ent, grads = _reference(model, ids, pos, labels, g_lp, g_h, rank, temperature=0.9)
    enable_fused_log_probs(model, chunk_size=3)
    assert "_postprocess" not in model.__dict__ and "forward" in model.__dict__
    out = model(ids, pos, None, labels=labels, output_processor_context=FusedLogProbsOptions(temperature=0.9))
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _compare(out, lp, ent, grads, model, f"rank {rank} output_processor hook")
    assert disable_fused_log_probs(model) and "forward" not in model.__dict__


def _float16_module(rank):
    """Megatron's ``Float16Module`` (bf16) is looked through; it hands the outputs back as a plain tuple."""
    import dataclasses

    from megatron.core.transformer.module import Float16Module

    inner = _model(tied=False, seed=7)
    wrapped = Float16Module(dataclasses.replace(inner.config, bf16=True), inner)
    assert inner.output_layer.weight.dtype == torch.bfloat16
    ids, pos, labels, g_lp, g_h = _batch(8)
    logits = wrapped(ids, pos, None).detach()  # the bf16 output layer's logits, as float32
    parts = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(parts, logits.contiguous())
    lp, ent = reference(torch.cat(parts, dim=-1).double(), labels)

    head = enable_fused_log_probs(wrapped, chunk_size=3)
    assert head.weight is inner.output_layer.weight and "_postprocess" in inner.__dict__
    out = wrapped(ids, pos, None, labels=labels)
    assert type(out) is tuple  # float16_to_fp32 rebuilds tuples
    log_probs, entropy = out
    # The head computes the same bf16 matmul per chunk, then float32: float32 agreement.
    torch.testing.assert_close(log_probs.double(), lp, **VALUES)
    torch.testing.assert_close(entropy.double(), ent, **VALUES)
    ((log_probs * g_lp.float()).sum() + (entropy * g_h.float()).sum()).backward()
    assert inner.output_layer.weight.grad.dtype == torch.bfloat16
    assert disable_fused_log_probs(wrapped) and "_postprocess" not in inner.__dict__


def _all(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        _patching(rank, *_untied(rank))
        _tied(rank)
        _hook_contract(rank)
        _float16_module(rank)
    finally:
        parallel_state.destroy_model_parallel()


def test_gpt_model_end_to_end_tp2():
    run_distributed(_all, 2, timeout_s=120)  # bounded collectives: a rank left waiting fails the test, not CI
