"""``integrations._common.MegatronHeads``: one fused head per megatron-core output layer, built once.

A real megatron-core (0.16.1) ``ColumnParallelLinear`` on the CPU in a one-rank gloo run: the head is
reused while the weight is the same tensor over the same storage and the chunking is equal; another
chunking, or a weight whose storage moved (an offload's ``param.data = ...``), builds a new one, which
computes from the weight's current values (checked against float64 with random upstream gradients);
``detach`` gives no gradient to the weight or bias; a freed layer frees its head.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("megatron.core")

from chunked_entropy import Chunking  # noqa: E402
from tests.helpers import reference, run_distributed  # noqa: E402

S, B, H, V = 5, 2, 8, 12
TOL = dict(rtol=1e-5, atol=1e-6)


def _check(head, layer, seed, *, weight_grad: bool):
    """The head's log-probs, entropy and gradients against float64 from the layer's current weight and bias."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g)
    labels = torch.randint(0, V, (S, B), generator=g)
    g_lp, g_h = torch.randn(S, B, generator=g), torch.randn(S, B, generator=g)
    w = layer.weight.detach().double().requires_grad_()
    b = layer.bias.detach().double().requires_grad_()
    x = hidden.double().requires_grad_()
    lp_ref, ent_ref = reference(x @ w.t() + b, labels)
    ((lp_ref * g_lp.double()).sum() + (ent_ref * g_h.double()).sum()).backward()

    layer.weight.grad = layer.bias.grad = None
    h = hidden.clone().requires_grad_()
    out = head(h, labels)
    ((out.log_probs * g_lp).sum() + (out.entropy * g_h).sum()).backward()
    torch.testing.assert_close(out.log_probs.double(), lp_ref.detach(), **TOL)
    torch.testing.assert_close(out.entropy.double(), ent_ref.detach(), **TOL)
    torch.testing.assert_close(h.grad.double(), x.grad, **TOL)
    if weight_grad:
        torch.testing.assert_close(layer.weight.grad.double(), w.grad, **TOL)
        torch.testing.assert_close(layer.bias.grad.double(), b.grad, **TOL)
    else:
        assert layer.weight.grad is None and layer.bias.grad is None


def _heads(rank, world):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from chunked_entropy.integrations._common import MegatronHeads

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        cfg = ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True)
        torch.manual_seed(0)
        layer = ColumnParallelLinear(H, V, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                     gather_output=False)
        with torch.no_grad():
            layer.bias.normal_(generator=torch.Generator().manual_seed(1))
        heads = MegatronHeads()

        head = heads.head(layer, chunking=Chunking(4))
        assert head.weight is layer.weight and head.bias is layer.bias and head.chunking == Chunking(4)
        assert heads.head(layer, chunking=Chunking(4)) is head  # equal settings, same weight: the same head
        _check(head, layer, 2, weight_grad=True)
        other = heads.head(layer, chunking=Chunking(3, vocab_chunk_size=5))
        assert other is not head and other.chunking == Chunking(3, vocab_chunk_size=5)

        frozen = heads.head(layer, chunking=Chunking(4), detach=True)
        assert frozen is not head and frozen.weight is not layer.weight
        assert frozen.layer.gradient_accumulation_fusion is False
        _check(frozen, layer, 3, weight_grad=False)
        assert heads.head(layer, chunking=Chunking(4), detach=True) is frozen

        # an offload moves the storage (new values here): a detached head over the old storage would read
        # stale values; a new one is built over the new storage
        with torch.no_grad():
            layer.weight.data = layer.weight.data * 1.5 + 0.1
        moved = heads.head(layer, chunking=Chunking(4), detach=True)
        assert moved is not frozen and moved.weight.data_ptr() == layer.weight.data_ptr()
        _check(moved, layer, 4, weight_grad=False)
        live = heads.head(layer, chunking=Chunking(4))
        assert live is not head and live.weight is layer.weight
        _check(live, layer, 5, weight_grad=True)

        del layer, head, other, frozen, moved, live
        gc.collect()
        assert len(heads._held) == 0  # held weakly: a freed layer frees its head
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_heads_are_built_once_per_output_layer_and_rebuilt_when_the_weight_moves():
    run_distributed(_heads, 1)
