"""``ChunkedVocabParallelHead.from_megatron`` against megatron-core's own output layer.

Real megatron-core (0.16.1) on CPU with gloo, in a
``parallel_state.initialize_model_parallel(2)`` run. Megatron's side: its
``ColumnParallelLinear`` (``use_cpu_initialization=True``,
``gather_output=False``) followed by ``vocab_parallel_cross_entropy`` on a
clone of the logits; the entropy reference comes from the logits all-gathered
over the TP group, in float64, and its gradient is fed back into Megatron's
logits shard. Both paths get the same random upstream gradients; values and
the gradients of the hidden states, the weight (or the tied embedding) and
the bias must agree, and agree with a float64 reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from chunked_entropy import ChunkedVocabParallelHead, Chunking  # noqa: E402
from tests.helpers import reference, run_distributed  # noqa: E402

F32 = dict(rtol=1e-5, atol=1e-5)
S, B, H, V = 6, 2, 8, 20  # V_local = 10 on each of 2 ranks


def _close(actual, expected, what):
    torch.testing.assert_close(actual.double(), expected.double(), **F32, msg=lambda m: f"{what}: {m}")


def _megatron_path(logits, labels, group, rank, g_lp, g_h, temperature=1.0):
    """Megatron's log-probs (CE on a clone) and a float64 entropy from the gathered logits; runs backward."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    lp = -vocab_parallel_cross_entropy(logits.clone() / temperature, labels)
    world = dist.get_world_size(group)
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    full = torch.cat(parts, dim=-1).double().requires_grad_()
    lp_ref, ent_ref = reference(full, labels, temperature=temperature)
    (ent_ref * g_h).sum().backward()
    v_local = logits.shape[-1]
    g_logits = full.grad[..., rank * v_local:(rank + 1) * v_local]
    torch.autograd.backward([lp, logits], [g_lp.float(), g_logits.float()])
    return lp.detach(), lp_ref.detach(), ent_ref.detach()


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g)
    labels = torch.randint(0, V, (S, B), generator=g)
    labels[0, 0], labels[1, 1] = 0, V - 1  # ids on both shards
    return hidden, labels, torch.randn(S, B, generator=g, dtype=torch.float64), torch.randn(
        S, B, generator=g, dtype=torch.float64
    )


def _output_layer_matches(rank, group, cfg):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(1)
    layer = ColumnParallelLinear(
        H, V, config=cfg, init_method=torch.nn.init.normal_, bias=True, gather_output=False
    )
    with torch.no_grad():
        layer.bias.normal_(generator=torch.Generator().manual_seed(2 + rank))
    head = ChunkedVocabParallelHead.from_megatron(layer, chunking=Chunking(4, vocab_chunk_size=3))
    assert head.weight is layer.weight and head.bias is layer.bias
    assert head.process_group is layer.tp_group and head.sequence_parallel is False
    hidden, labels, g_lp, g_h = _inputs(3)

    for temperature in (1.0, 0.6):
        x_meg = hidden.clone().requires_grad_()
        logits, out_bias = layer(x_meg)
        assert out_bias is None and logits.shape == (S, B, V // 2)
        lp_meg, lp_ref, ent_ref = _megatron_path(logits, labels, group, rank, g_lp, g_h, temperature)
        grads_meg = (x_meg.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
        layer.zero_grad()

        x = hidden.clone().requires_grad_()
        out = head(x, labels, temperature=temperature)
        ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
        what = f"rank {rank} t={temperature}"
        _close(out.log_probs, lp_meg, what + " log_probs vs Megatron")
        _close(out.log_probs, lp_ref, what + " log_probs vs float64")
        _close(out.entropy, ent_ref, what + " entropy vs float64")
        ours = (x.grad, layer.weight.grad, layer.bias.grad)
        for name, got, want in zip(("hidden", "weight", "bias"), ours, grads_meg, strict=True):
            _close(got, want, f"{what} grad_{name}")
        layer.zero_grad()

    # skip_bias_add: Megatron returns the bias for the caller to add, so the head leaves it out.
    layer.skip_bias_add = True
    assert ChunkedVocabParallelHead.from_megatron(layer).bias is None
    layer.skip_bias_add = False


def _tied_embedding_matches(rank, group, cfg):
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

    torch.manual_seed(4)
    emb = VocabParallelEmbedding(V, H, init_method=torch.nn.init.normal_, config=cfg)
    layer = ColumnParallelLinear(
        H, V, config=cfg, init_method=torch.nn.init.normal_, bias=False, gather_output=False,
        skip_weight_param_allocation=True,
    )
    with pytest.raises(ValueError, match="weight="):
        ChunkedVocabParallelHead.from_megatron(layer)
    head = ChunkedVocabParallelHead.from_megatron(layer, weight=emb.weight, chunking=5)
    assert head.weight is emb.weight and head.bias is None
    _, labels, g_lp, g_h = _inputs(5)
    ids = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(6))

    hidden = torch.tanh(emb(ids))  # one use of the shared weight ...
    logits, _ = layer(hidden, weight=emb.weight)  # ... and the second one
    lp_meg, _, ent_ref = _megatron_path(logits, labels, group, rank, g_lp, g_h)
    grad_meg = emb.weight.grad.clone()
    emb.weight.grad = None

    out = head(torch.tanh(emb(ids)), labels)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _close(out.log_probs, lp_meg, f"rank {rank} tied log_probs")
    _close(out.entropy, ent_ref, f"rank {rank} tied entropy")
    _close(emb.weight.grad, grad_meg, f"rank {rank} tied grad (embedding + head)")


def _main_grad_and_groups(rank, group, cfg):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(7)
    layer = ColumnParallelLinear(H, V, config=cfg, init_method=torch.nn.init.normal_, bias=False, gather_output=False)
    hidden, labels, g_lp, g_h = _inputs(8)

    # The reference gradient of this rank's weight shard, from Megatron's own layer.
    logits, _ = layer(hidden.clone().requires_grad_())
    _megatron_path(logits, labels, group, rank, g_lp, g_h)
    grad_ref = layer.weight.grad.clone()
    layer.weight.grad = None

    # gradient_accumulation_fusion needs apex's CUDA kernels in Megatron's layer (it refuses to
    # build without them), so the flag is set on a CPU-built layer: the head reads it and
    # accumulates into main_grad as Megatron's linear layers do.
    layer.gradient_accumulation_fusion = True
    layer.weight.main_grad = torch.ones_like(layer.weight)
    layer.weight.grad_added_to_main_grad = False
    head = ChunkedVocabParallelHead.from_megatron(layer, chunking=4)
    for _ in range(2):
        out = head(hidden.clone().requires_grad_(), labels)
        ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _close(layer.weight.main_grad, 1 + 2 * grad_ref, f"rank {rank} main_grad")
    assert layer.weight.grad_added_to_main_grad is True

    # An explicit group wins over the layer's.
    assert ChunkedVocabParallelHead.from_megatron(layer, process_group=None).process_group is None
    tp_group = parallel_state.get_tensor_model_parallel_group()
    assert ChunkedVocabParallelHead.from_megatron(layer).process_group is tp_group

    with pytest.raises(TypeError, match="ColumnParallelLinear"):
        ChunkedVocabParallelHead.from_megatron(torch.nn.Linear(H, V))


def _all(rank, world):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        cfg = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
        _output_layer_matches(rank, group, cfg)
        _tied_embedding_matches(rank, group, cfg)
        _main_grad_and_groups(rank, group, cfg)
    finally:
        parallel_state.destroy_model_parallel()


def test_from_megatron_matches_megatron_output_layer_tp2():
    run_distributed(_all, 2)
