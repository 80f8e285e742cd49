"""``integrations.megatron`` on megatron-core 0.16.1's ``MambaModel`` and 0.19's ``HybridModel`` (reproduced).

A ``MambaModel`` of one attention and one MLP layer (tests/verl_engine.py:
local layer specs in place of Transformer Engine's, no Mamba mixer, both need
CUDA), TP 2 over gloo, tied and untied. The reference is the same model,
unpatched: its vocab-parallel logits, all gathered, in float64; every
parameter's gradient must match. Megatron's own loss path (``labels=``) gives
the log-probs too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chunked_entropy import LogProbsEntropy
from chunked_entropy.integrations.megatron import (
    disable_fused_log_probs,
    enable_fused_log_probs,
    fused_log_probs_options,
)
from tests.helpers import reference, require, run_distributed

require("megatron.core", "verl")

B, S = 2, 9


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _check(rank, tied, kind="mamba"):
    from tests import verl_engine

    v = verl_engine.V
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, v, (B, S), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(S).expand(B, S)
    g_lp, g_h = torch.randn(B, S, generator=g, dtype=torch.float64), torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = torch.rand(B, S, generator=g) > 0.3
    build = verl_engine.mamba_model if kind == "mamba" else verl_engine.hybrid_model_019
    model = build(2, tied=tied, seed=4)
    assert type(model).__name__ == {"mamba": "MambaModel", "hybrid019": "HybridModel"}[kind]
    assert not hasattr(model, "_postprocess")

    logits = model(ids, pos, None)  # [B, S, V/2]
    parts = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(parts, logits.detach().contiguous())
    full = torch.cat(parts, dim=-1).double().requires_grad_()
    lp, ent = reference(full, labels, temperature=0.7, label_mask=mask)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    vl = v // 2
    logits.backward(full.grad[..., rank * vl:(rank + 1) * vl].float())
    grads = _grads(model)
    own_loss = model(ids, pos, None, labels=labels).detach()  # megatron-core's own cross entropy
    model.zero_grad(set_to_none=True)

    head = enable_fused_log_probs(model, chunk_size=4, temperature=0.7)
    assert (head.weight is model.shared_embedding_or_output_weight()) if tied else \
        (head.weight is model.output_layer.weight)
    with fused_log_probs_options(model, label_mask=mask):
        out = model(ids, pos, None, labels=labels)
    assert isinstance(out, LogProbsEntropy) and out.log_probs.shape == (B, S)
    torch.testing.assert_close(out.log_probs.double(), lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ent.detach(), rtol=1e-5, atol=1e-5)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    got = _grads(model)
    assert got.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(got[name], grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # without labels the logits, as before; the instance is left as it was after each call
    assert model(ids, pos, None).shape == (B, S, vl)
    assert "forward" not in model.output_layer.__dict__ and "compute_language_model_loss" not in model.__dict__
    out = enable_fused_log_probs(model, chunk_size=4) and model(ids, pos, None, labels=labels)
    torch.testing.assert_close(out.log_probs, -own_loss, rtol=1e-5, atol=1e-5)
    assert disable_fused_log_probs(model) and "forward" not in model.__dict__


def _verl_leaves_it_to_verl():
    """verl's fused route serves GPTModel's post-processing: a MambaModel gets verl's own route, named."""
    from chunked_entropy.integrations.verl import megatron_fused
    from tests import verl_engine

    why = megatron_fused._unserved(verl_engine.mamba_model(2, tied=False), None)
    assert why is not None and "MambaModel post-processes inline" in why, why


def _worker(rank, world):
    from megatron.core import parallel_state

    from tests import verl_engine

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        with verl_engine.cpu_only_replacements():
            _check(rank, tied=False)
            _check(rank, tied=True)
            _check(rank, tied=False, kind="hybrid019")  # 0.19's HybridModel forward, reproduced
            _verl_leaves_it_to_verl()
    finally:
        parallel_state.destroy_model_parallel()
        verl_engine.drop_hybrid_019()


def test_mamba_model_tp2_tied_and_untied_and_verls_fused_route_leaves_it_to_verl():
    run_distributed(_worker, 2, timeout_s=180)
