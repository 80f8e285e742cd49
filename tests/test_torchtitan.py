"""torchtitan 0.3.0: a model from its own registry, tensor parallel 2 on the CPU over gloo, trained one step
with a loss made of the library's log-probs, an entropy bonus and a KL penalty; every gradient equal to TP 1.

The model is the registry's Llama 3 ``debugmodel`` (``torchtitan.models.llama3.model_registry``), cut to two
layers, its sharding declared by torchtitan's own ``set_llama3_sharding_config`` (sequence parallelism on, what
``Llama3Model.Config.update_from_config`` does; that method imports the trainer, which needs tensorboard) and
applied by its own ``Module.parallelize`` under the ``partial_dtensor`` backend: the logits come out as
DTensors placed ``Shard(2)`` on the TP mesh, the ``lm_head`` weight ``Shard(0)``. The TP 1 reference is the
same model (a deep copy, before ``parallelize``) on each rank.

What cannot run on a CPU is replaced here, and only here:

- ``torchtitan.tools.utils.device_type`` falls back to ``"cuda"`` when no accelerator is found (its
  ``get_device_info``), and ``ParallelDims.build_mesh`` builds its mesh on it: set to ``"cpu"``;
- the registry's attention is FlexAttention, which has no backward on a CPU (torch: "FlexAttention does not
  support backward on CPU"): each layer's ``inner_attention`` config is torchtitan's own
  ``ScaledDotProductAttention`` (causal; one document per row, so no document mask is lost).

torchtitan's default ``spmd_types`` backend hands plain local ``[B, S, V/tp]`` logits over: those take
``layer=OutputLayer(process_group=<the TP mesh's group>)``, the plain tensor-parallel path tested elsewhere.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import run_distributed

try:
    import torchtitan  # noqa: F401
    from torchtitan.models.llama3 import model_registry  # noqa: F401
except ImportError as e:  # pragma: no cover - the CI installs it (README)
    pytest.skip(f"torchtitan is not importable ({type(e).__name__}: {e}); the README's first command installs it "
                "(the frameworks extra: spmd_types==0.2.3, tyro; then pip install --no-deps torchtitan==0.3.0: its "
                "own requirements add tensorboard and wandb, which its model registry does not import)",
                allow_module_level=True)

B, S = 2, 12
T = 0.8
ENTROPY_COEF, KL_COEF = 0.01, 0.05


def _on_cpu():
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type = parallel_dims.device_type = "cpu"


def _models(world, backend):
    """The registry's debug model, two layers, SDPA attention: TP 1 (plain) and TP ``world`` (parallelized)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    _on_cpu()
    set_spmd_backend(backend)
    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    par = ParallelismConfig(tensor_parallel_degree=world, spmd_backend=backend, enable_sequence_parallel=True)
    set_llama3_sharding_config(cfg, enable_sp=True)
    torch.manual_seed(0)
    plain = cfg.build()
    plain.init_states()
    parallel = copy.deepcopy(plain)
    dims = ParallelDims.from_config(par, world)
    dims.build_mesh()
    parallel.parallelize(dims)
    return plain, parallel, dims, cfg.vocab_size


def _batch(v):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, v, (B, S + 1), generator=g)
    adv = torch.randn(B, S, generator=g)
    ref = torch.randn(B, S, v, generator=g) * 2  # a frozen reference policy's logits
    return tokens[:, :-1], tokens[:, 1:], adv, ref


def _loss(out_lp, out_h, kl, adv):
    return -(out_lp * adv).mean() - ENTROPY_COEF * out_h.mean() + KL_COEF * kl.mean()


def _plain_step(model, tokens, labels, adv, ref):
    from chunked_entropy import divergence_from_logits, log_probs_and_entropy

    logits = model(tokens)
    out = log_probs_and_entropy(logits, labels, temperature=T)
    kl = divergence_from_logits(logits, ref, divergence="reverse_kl", temperature=T).divergence
    loss = _loss(out.log_probs, out.entropy, kl, adv)
    loss.backward()
    return loss.detach(), out, {n: p.grad for n, p in model.named_parameters()}


def _dtensor_worker(rank, world):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from chunked_entropy import divergence_from_logits, linear_log_probs_and_entropy, log_probs_and_entropy

    plain, model, _, v = _models(world, "partial_dtensor")
    tokens, labels, adv, ref = _batch(v)
    loss1, out1, grads1 = _plain_step(plain, tokens, labels, adv, ref)

    logits = model(tokens)
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    mesh = logits.device_mesh
    out = log_probs_and_entropy(logits, labels, temperature=T)
    kl = divergence_from_logits(logits, distribute_tensor(ref, mesh, [Shard(2)]), divergence="reverse_kl",
                                temperature=T).divergence
    loss = _loss(out.log_probs.to_local(), out.entropy.to_local(), kl.to_local(), adv)
    loss.backward()
    torch.testing.assert_close(loss.detach(), loss1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.log_probs.full_tensor(), out1.log_probs.detach(), rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == grads1.keys()
    assert model.lm_head.weight.grad.placements == model.lm_head.weight.placements == (Shard(0),)
    for name, g in grads.items():
        g = g.full_tensor() if isinstance(g, DTensor) else g
        torch.testing.assert_close(g, grads1[name], rtol=2e-4, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")

    # one optimizer step on both: the next losses agree too
    for m in (plain, model):
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    loss1b, _, _ = _plain_step(plain, tokens, labels, adv, ref)
    logits = model(tokens)
    out = log_probs_and_entropy(logits, labels, temperature=T)
    kl = divergence_from_logits(logits, distribute_tensor(ref, mesh, [Shard(2)]), divergence="reverse_kl",
                                temperature=T).divergence
    torch.testing.assert_close(_loss(out.log_probs.to_local(), out.entropy.to_local(), kl.to_local(), adv).detach(),
                               loss1b, rtol=1e-4, atol=1e-6)

    # the fused head on torchtitan's own lm_head weight (a column-parallel DTensor): no logits at all
    plain.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    plain._skip_lm_head = model._skip_lm_head = True
    h1 = plain(tokens)
    f1 = linear_log_probs_and_entropy(h1, plain.lm_head.weight, labels, temperature=T)
    (-(f1.log_probs * adv).mean() - ENTROPY_COEF * f1.entropy.mean()).backward()
    h = model(tokens)
    f = linear_log_probs_and_entropy(h, model.lm_head.weight, labels, temperature=T)
    lp, ent = (t.to_local() if isinstance(t, DTensor) else t for t in (f.log_probs, f.entropy))
    (-(lp * adv).mean() - ENTROPY_COEF * ent.mean()).backward()
    torch.testing.assert_close(lp.detach(), f1.log_probs.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(g, dict(plain.named_parameters())[name].grad, rtol=2e-4, atol=2e-6,
                                   msg=lambda m, n=name: f"fused head, {n}: {m}")


def test_torchtitan_llama3_tp2_training_step_equals_tp1_partial_dtensor():
    run_distributed(_dtensor_worker, 2, timeout_s=300)
