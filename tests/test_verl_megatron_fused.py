"""verl 0.9.1's fused-kernel route (``use_fused_kernels=True``) served by the library's fused head.

Driven through verl's real ``MegatronEngineWithLMHead.forward_step`` on a tiny
megatron-core 0.16.1 ``GPTModel`` (RoPE, packed ``thd`` sequences of unequal
lengths, one temperature per sequence), at TP 1 and 2 over gloo, tied and
untied output layer. The reference is the same engine's *unfused* route
without the plugin, on the same weights (verl's own logits processor on
megatron-core's logits): log-probs, entropy, Σp², verl's top-k distillation
keys, and every parameter's gradient under random upstream gradients. What
cannot run on a CPU is replaced in one helper (:mod:`tests.verl_engine`).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers import require, run_distributed

require("megatron.core", "verl")

from chunked_entropy.integrations import verl as ce_verl  # noqa: E402
from tests import verl_engine as ve  # noqa: E402

LENGTHS = [7, 12, 4]
TEMPERATURES = [0.7, 1.0, 1.6]
# Values: the two routes differ only in the head (megatron-core's float32 logits + verl's vocab-parallel
# functions vs. the library's chunked float32 statistics): float32 rounding.
VALUES = dict(rtol=1e-5, atol=1e-5)
GRADS = dict(rtol=1e-4, atol=1e-6)


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _run(eng, model, data, ups, logits_processor_func=None, grad_keys=("log_probs", "entropy")):
    """verl's forward_step, then backward with the given upstream gradients (one per output, [T] values)."""
    out = ve.forward(eng, model, data, logits_processor_func)
    loss = sum((out[k].values() * ups[k]).sum() for k in grad_keys if k in out)
    loss.backward()
    return {k: v.detach() for k, v in out.items()}, _grads(model)


def _ups(seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    return {k: torch.randn(n, generator=g) for k in ("log_probs", "entropy", "distillation_losses")}


def _compare(ours, theirs, g_ours, g_theirs, what):
    assert set(ours) == set(theirs), (what, set(ours), set(theirs))
    for k in theirs:
        assert ours[k].is_nested and torch.equal(ours[k].offsets(), theirs[k].offsets()), (what, k)
        torch.testing.assert_close(ours[k].values().double(), theirs[k].values().double(), **VALUES,
                                   msg=lambda m, k=k: f"{what} {k}: {m}")
    assert g_ours.keys() == g_theirs.keys(), what
    for n in g_theirs:
        torch.testing.assert_close(g_ours[n], g_theirs[n], **GRADS, msg=lambda m, n=n: f"{what} grad {n}: {m}")


def _fused_vs_unfused(rank, world, tied):
    from chunked_entropy.integrations.verl import megatron_fused

    flags = dict(calculate_entropy=True, calculate_sum_pi_squared=True)
    ups = _ups(3)
    try:
        with ve.cpu_only_replacements():
            assert not ce_verl.installed()
            model = ve.gpt_model(world, tied=tied, seed=11)
            data = ve.batch(LENGTHS, seed=5, temperatures=TEMPERATURES, flags=flags)
            theirs, g_theirs = _run(ve.engine(model, fused=False), model, data, ups)
            assert set(theirs) == {"log_probs", "entropy", "sum_pi_squared"}

            ce_verl.install()
            model = ve.gpt_model(world, tied=tied, seed=11)  # the same weights
            eng = ve.engine(model, fused=True, chunk_size=5)
            assert eng.engine_config.use_fused_kernels
            assert model.forward.__func__ is megatron_fused.fused_gpt_forward  # bound by verl's patch_fused_forward
            data = ve.batch(LENGTHS, seed=5, temperatures=TEMPERATURES, flags=flags)
            ours, g_ours = _run(eng, model, data, ups)
            _compare(ours, theirs, g_ours, g_theirs, f"rank {rank} tp {world} tied={tied}")
            # the caller's micro-batch still says what it asked for
            from verl.utils import tensordict_utils as tu

            assert tu.get_non_tensor_data(data, "calculate_sum_pi_squared", None) is True

            # entropy off, Σp² off: log-probs only, the same values
            data = ve.batch(LENGTHS, seed=5, temperatures=TEMPERATURES, flags={})
            only, _ = _run(eng, model, data, ups)
            assert set(only) == {"log_probs"}
            torch.testing.assert_close(only["log_probs"].values(), theirs["log_probs"].values(), **VALUES)
    finally:
        ce_verl.uninstall()


def _distillation(rank, world):
    """verl's Megatron top-k distillation on the fused route: the keys verl's unfused route returns."""
    from verl.trainer.distillation import distillation_ppo_loss
    from verl.workers.config import ActorConfig
    from verl.workers.config.distillation import DistillationConfig, DistillationLossConfig

    g = torch.Generator().manual_seed(8)
    k = 4
    teacher = [torch.log_softmax(torch.randn(n, ve.V, generator=g) * 2, -1).topk(k, -1) for n in LENGTHS]
    extra = {"teacher_ids": torch.nested.nested_tensor([t.indices for t in teacher], layout=torch.jagged),
             "teacher_logprobs": torch.nested.nested_tensor([t.values for t in teacher], layout=torch.jagged)}
    cfg = ActorConfig(strategy="megatron", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    dcfg = DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode="forward_kl_topk", log_prob_min_clamp=-6.0, use_policy_gradient=False))
    fn = functools.partial(distillation_ppo_loss, config=cfg, distillation_config=dcfg)
    flags = dict(calculate_entropy=True, distillation_use_topk=True)
    ups = _ups(4)
    keys = ("log_probs", "entropy", "distillation_losses")
    try:
        with ve.cpu_only_replacements():
            model = ve.gpt_model(world, tied=False, seed=2)
            data = ve.batch(LENGTHS, seed=6, temperatures=[1.0] * 3, flags=flags, extra=extra)
            theirs, g_theirs = _run(ve.engine(model, fused=False), model, data, ups, fn, keys)
            ce_verl.install()
            model = ve.gpt_model(world, tied=False, seed=2)
            data = ve.batch(LENGTHS, seed=6, temperatures=[1.0] * 3, flags=flags, extra=extra)
            ours, g_ours = _run(ve.engine(model, fused=True, chunk_size=4), model, data, ups, fn, keys)
            assert {"distillation_losses", "student_mass", "teacher_mass", "overlap_count",
                    "overlap_token_advantage"} <= set(theirs)
            _compare(ours, theirs, g_ours, g_theirs, f"rank {rank} tp {world} distillation")
            # distillation_only: no log_probs, the distillation keys alone
            flags = dict(distillation_use_topk=True, distillation_only=True)
            data = ve.batch(LENGTHS, seed=6, temperatures=[1.0] * 3, flags=flags, extra=extra)
            only, _ = _run(ve.engine(model, fused=True, chunk_size=4), model, data, ups, fn, keys)
            assert "log_probs" not in only and "entropy" not in only
            for k in ("distillation_losses", "student_mass", "teacher_mass"):
                torch.testing.assert_close(only[k].values(), theirs[k].values(), **VALUES)
    finally:
        ce_verl.uninstall()


def _hook_mode(rank, world, tied):
    """megatron-core >= 0.18: verl passes its output processor through the model's forward; ours serves it."""
    from chunked_entropy.integrations.verl import megatron_fused

    flags = dict(calculate_entropy=True, calculate_sum_pi_squared=True)
    ups = _ups(9)
    try:
        with ve.cpu_only_replacements():
            model = ve.with_output_processor_hook(ve.gpt_model(world, tied=tied, seed=4))
            data = ve.batch(LENGTHS, seed=2, temperatures=TEMPERATURES, flags=flags)
            theirs, g_theirs = _run(ve.engine(model, fused=False), model, data, ups)
            ce_verl.install()
            model = ve.with_output_processor_hook(ve.gpt_model(world, tied=tied, seed=4))
            eng = ve.engine(model, fused=True, chunk_size=6)
            assert model._verl_fused_forward_mode == "hook" and "forward" not in model.__dict__
            seen = []
            own = megatron_fused.fused_output_processor
            megatron_fused.fused_output_processor = lambda **kw: seen.append(kw["context"]) or own(**kw)
            try:
                data = ve.batch(LENGTHS, seed=2, temperatures=TEMPERATURES, flags=flags)
                ours, g_ours = _run(eng, model, data, ups)
            finally:
                megatron_fused.fused_output_processor = own
            assert len(seen) == 1 and isinstance(seen[0], megatron_fused.FusedRequest)
            _compare(ours, theirs, g_ours, g_theirs, f"rank {rank} tp {world} tied={tied} hook mode")
    finally:
        ce_verl.uninstall()


def _fallback(rank, world):
    """A model whose forward verl patched before the plugin was installed: verl's own route, one warning naming
    the reason, and verl's own refusals where verl's route cannot serve (never a silently collapsed temperature)."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("chunked_entropy.integrations")
    log.addHandler(handler)
    try:
        with ve.cpu_only_replacements():
            model = ve.gpt_model(world, tied=False, seed=1)
            eng = ve.engine(model, fused=True)  # verl's own _fused_GPTModel_forward bound
            ce_verl.install()
            for flags, match in ((dict(calculate_entropy=True), "uniform temperature"),
                                 (dict(calculate_sum_pi_squared=True), "sum_pi_squared"),
                                 (dict(distillation_use_topk=True), "distillation_use_topk")):
                data = ve.batch(LENGTHS, seed=5, temperatures=TEMPERATURES, flags=flags)
                with pytest.raises(NotImplementedError, match=match):
                    ve.forward(eng, model, data)
    finally:
        ce_verl.uninstall()
        log.removeHandler(handler)
    reasons = [r.getMessage() for r in records if "left to verl" in r.getMessage()]
    assert len(reasons) == 1 and "patch_fused_forward ran before" in reasons[0], reasons


def _bf16(rank, world):
    """A bf16 model behind megatron-core's Float16Module, as verl builds it: the fused route's values equal the
    unfused route's (the same bf16 logits, float32 statistics), its gradients within bf16 rounding."""
    import dataclasses

    from megatron.core.transformer.module import Float16Module

    flags = dict(calculate_entropy=True)
    ups = _ups(12)
    runs = []
    try:
        with ve.cpu_only_replacements():
            for fused in (False, True):
                if fused:
                    ce_verl.install()
                inner = ve.gpt_model(world, tied=False, seed=3)
                model = Float16Module(dataclasses.replace(inner.config, bf16=True), inner)
                eng = ve.engine(inner, fused=fused)
                eng.module = [model]
                eng._maybe_enable_fused_kernels()
                data = ve.batch(LENGTHS, seed=1, temperatures=TEMPERATURES, flags=flags)
                out, grads = _run(eng, model, data, ups)
                runs.append((out, {n: g.float() for n, g in grads.items()}))
    finally:
        ce_verl.uninstall()
    (theirs, g_theirs), (ours, g_ours) = runs
    assert next(inner.parameters()).dtype == torch.bfloat16
    for k in theirs:
        torch.testing.assert_close(ours[k].values(), theirs[k].values(), **VALUES, msg=lambda m, k=k: f"bf16 {k}: {m}")
    assert g_ours.keys() == g_theirs.keys()
    for n, g in g_theirs.items():  # bf16 gradients: the two routes round differently, by up to a bf16 ulp or two
        torch.testing.assert_close(g_ours[n], g, rtol=0, atol=2**-7 * float(g.abs().max()),
                                   msg=lambda m, n=n: f"bf16 grad {n}: {m}")


def _engine_routes(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(world)
    try:
        for tied in (False, True):
            _fused_vs_unfused(rank, world, tied)
            _hook_mode(rank, world, tied)
        _distillation(rank, world)
        _bf16(rank, world)
        if world == 1:
            _fallback(rank, world)
        if world > 1:
            _sequence_parallel(rank, world)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2])
def test_fused_route_equals_verls_unfused_route_tied_untied_hook_distillation_sp(world):
    """Legacy and hook mode, tied and untied: per-token temperatures, entropy, Σp² (verl refuses both on its fused
    route), distillation keys, every gradient; at TP 2 also the processor under sequence parallelism."""
    run_distributed(_engine_routes, world, timeout_s=120)


def _sequence_parallel(rank, world):
    """The fused processor with sequence-sharded hidden states (config.sequence_parallel, TP 2) equals the
    unsharded call: values, the hidden states' gradient (a doubled one would show here) and the weight's."""
    import types

    from chunked_entropy.integrations.verl import megatron_fused

    if world > 1:  # sequence parallelism shards over TP
        # megatron-core's local spec refuses sequence_parallel in its torch LayerNorm (and its SP mappings allocate
        # on CUDA): the output layer alone, told it is sequence-parallel as megatron-core's config sets it
        layer = ve.gpt_model(world, tied=False, seed=3).output_layer
        g = torch.Generator().manual_seed(1)
        s = 10
        hidden = torch.randn(s, 1, ve.HID, generator=g) * 3
        labels = torch.randint(0, ve.V, (1, s), generator=g)
        t = torch.rand(1, s, generator=g) + 0.5
        t[0, -1] = 0.0  # verl's packing padding
        ups = {k: torch.randn(1, s, generator=g) for k in ("log_probs", "entropy", "sum_pi_squared")}
        request = megatron_fused.FusedRequest(temperature=t, chunk_size=3, sum_pi_squared=True)
        runs = []
        for sp in (True, False):
            layer.sequence_parallel = sp
            leaf = hidden.clone().requires_grad_()
            h = leaf.chunk(world, dim=0)[rank] if sp else leaf
            out = megatron_fused.fused_output_processor(
                hidden_states=h, output_layer=layer, output_weight=None, labels=labels, context=request,
                config=types.SimpleNamespace(sequence_parallel=sp))
            sum((out[k] * ups[k]).sum() for k in ups).backward()
            runs.append(({k: out[k].detach() for k in ups}, leaf.grad, layer.weight.grad.clone()))
            layer.weight.grad = None
        (sp_out, sp_gh, sp_gw), (full_out, full_gh, full_gw) = runs
        for k in ups:
            assert sp_out[k].shape == (1, s)
            torch.testing.assert_close(sp_out[k], full_out[k], rtol=1e-6, atol=1e-6)
        rows = slice(rank * s // world, (rank + 1) * s // world)
        assert torch.count_nonzero(sp_gh[:rows.start]) + torch.count_nonzero(sp_gh[rows.stop:]) == 0
        torch.testing.assert_close(sp_gh[rows], full_gh[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sp_gw, full_gw, rtol=1e-5, atol=1e-6)


def test_install_checks_every_signature_all_or_nothing_and_leaves_the_value_model_to_verl(monkeypatch):
    from verl.models.mcore import model_forward_fused, mtp_patch, registry
    from verl.workers.engine.megatron import transformer_impl as ti

    engine = ti.MegatronEngineWithLMHead
    places = [(engine, "forward_step"), (engine, "_lm_head_logits_processor"), (ti, "_resolve_fused_temperature"),
              (ti.MegatronEngine, "_maybe_enable_fused_kernels"),
              (registry, "fused_forward_model_engine"), (model_forward_fused, "_fused_GPTModel_forward"),
              (model_forward_fused, "fused_output_processor"), (mtp_patch, "_megatron_gptmodel_postprocess")]
    verls = {(h, a): h.__dict__[a] for h, a in places}
    value_step = ti.MegatronEngineWithValueHead.__dict__["forward_step"]
    try:
        ce_verl.install()
        assert all(h.__dict__[a] is not verls[h, a] for h, a in places)
        assert ti.MegatronEngineWithValueHead.__dict__["forward_step"] is value_step  # the value model: verl's
        ce_verl.uninstall()
        assert all(h.__dict__[a] is verls[h, a] for h, a in places)

        def other(*args, unknown=None):
            return None

        for holder, attr in places:
            with monkeypatch.context() as m:
                m.setattr(holder, attr, other)
                with pytest.raises(RuntimeError, match="Nothing was patched"):
                    ce_verl.install()
                assert not ce_verl.installed()
                assert all(h.__dict__[a] is verls[h, a] for h, a in places if (h, a) != (holder, attr)), attr
    finally:
        ce_verl.uninstall()


_HOOKED = r"""
import sys, warnings
warnings.simplefilter("ignore")
import verl  # reads VERL_USE_EXTERNAL_MODULES: the plugin installs before verl's engine is imported
assert "verl.models.mcore.registry" not in sys.modules, "the plugin imported verl's model code"
from verl.workers.engine.megatron import transformer_impl as t
from verl.models.mcore import model_forward_fused as f, mtp_patch as m, registry as r
from chunked_entropy.integrations.verl import megatron_fused as ce, mtp
assert t.MegatronEngineWithLMHead.forward_step is ce.forward_step
assert t.MegatronEngine._maybe_enable_fused_kernels is ce.maybe_enable_fused_kernels
assert t._resolve_fused_temperature is ce.resolve_fused_temperature
assert r.fused_forward_model_engine is ce.fused_forward_model_engine
assert f._fused_GPTModel_forward is ce.fused_gpt_forward and f.fused_output_processor is ce.fused_output_processor
assert m._megatron_gptmodel_postprocess is mtp.gptmodel_postprocess
print("PATCHED")
"""


def test_every_route_is_patched_through_verls_external_modules_hook():
    import os
    import subprocess
    import sys

    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="chunked_entropy.integrations.verl_plugin")
    p = subprocess.run([sys.executable, "-c", _HOOKED], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "PATCHED" in p.stdout, p.stderr[-3000:]
