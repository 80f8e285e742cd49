"""verl 0.9.1, installed: our replacement of the Megatron engine's logits processor against verl's own.

The reference is verl's own ``MegatronEngineWithLMHead._lm_head_logits_processor``
(taken from the installed package before the patch), run on the same inputs
in real megatron-core tensor-parallel groups over gloo (TP 1 and 2), with the
packed ``thd`` layout ([1, T, V/tp], per-token temperature 0 at packing
padding) and the padded ``bshd`` layout ([B, S, V/tp]), float32 and bfloat16.
The plugin is loaded the ways verl loads third-party code:
``VERL_USE_EXTERNAL_MODULES`` and ``external_lib``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from chunked_entropy import ChunkedEntropyConfig
from chunked_entropy.integrations import verl as ce_verl
from tests.helpers import reference, require, run_distributed

require("megatron.core", "verl")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import verl  # noqa: F401
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron import transformer_impl

VERL_METHOD = transformer_impl.MegatronEngineWithLMHead.__dict__["_lm_head_logits_processor"]


def _engine(chunk_size):
    """verl's engine class without its (GPU) initialisation: the processor reads only engine_config."""
    engine = object.__new__(transformer_impl.MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(entropy_from_logits_chunk_size=chunk_size)
    return engine


def _inputs(fmt, dtype, v, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (1, 23) if fmt == "thd" else (3, 8)
    logits = (torch.randn(*shape, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    label = torch.randint(0, v, shape, generator=g)
    temperature = torch.rand(shape, generator=g) * 0.8 + 0.5
    pad = torch.zeros(shape, dtype=torch.bool)
    pad[..., -2:] = True  # packing / padding rows: verl sets temperature 0 there
    temperature[pad] = 0.0
    ups = {k: torch.randn(shape, generator=g).masked_fill(pad, 0.0) for k in ("log_probs", "entropy", "sum_pi_squared")}
    return logits, label, temperature, pad, ups


def _run(method, engine, shard, label, temperature, ups, **flags):
    """Call a processor the way verl's forward does; backprop random upstream gradients on every output."""
    leaf = shard.clone().requires_grad_()
    logits = leaf * 1  # the model's output is not a leaf (verl divides it in place)
    before = logits.detach().clone()
    t_before = temperature.clone()
    out = method(
        engine, logits, label, temperature, distillation_use_topk=False, distillation_only=False,
        logits_processor_func=None, batch=None, data_format="thd", **flags,
    )
    sum((out[k].float() * ups[k]).sum() for k in out).backward()
    return out, leaf.grad, before, logits.detach(), t_before, temperature


def _compare(rank, world, fmt, dtype):
    from megatron.core import parallel_state

    v_local = 13
    logits, label, temperature, pad, ups = _inputs(fmt, dtype, v_local * world, seed=7)
    shard = logits[..., rank * v_local : (rank + 1) * v_local]
    engine = _engine(chunk_size=5)
    flags = dict(calculate_entropy=True, calculate_sum_pi_squared=True)
    # verl's sum_pi_squared all-reduces inside autograd (torch warns: no autograd kernel), so its
    # gradient is wrong for TP > 1: against verl, that output gets no upstream gradient; against
    # float64 (below), it does.
    no_q = dict(ups, sum_pi_squared=torch.zeros_like(ups["sum_pi_squared"]))
    theirs, g_theirs, *_ = _run(VERL_METHOD, engine, shard, label, temperature.clone(), no_q, **flags)
    ours, g_ours, before, after, t_before, t_after = _run(
        ce_verl.lm_head_logits_processor, engine, shard, label, temperature, no_q, **flags
    )
    assert torch.equal(before, after), "the logits were written"
    assert torch.equal(t_before, t_after), "the temperature tensor was written"
    assert set(ours) == set(theirs) == {"log_probs", "entropy", "sum_pi_squared"}
    # bf16: verl divides the bf16 logits by the temperature in bf16 and computes in bf16, so it is
    # off by up to ~2**-8 of the scaled logits (0.05 nats here); we compute in float32 (checked below).
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.1, atol=0.1)
    keep = ~pad  # padding rows (t = 1e-8) are dropped by verl's postprocess
    for k in ours:
        assert ours[k].shape == label.shape, k
        torch.testing.assert_close(ours[k].float()[keep], theirs[k].float()[keep], **tol,
                                   msg=lambda m, k=k: f"{k}: {m}")
        assert torch.isfinite(ours[k]).all(), k
    torch.testing.assert_close(g_ours.float(), g_theirs.float(), **tol)

    # against float64 on the whole vocabulary, every output with an upstream gradient
    _, g_all, *_ = _run(ce_verl.lm_head_logits_processor, engine, shard, label, temperature, ups, **flags)
    t64 = torch.where(temperature > 0, temperature, 1e-8).double()
    full = logits.double().requires_grad_()
    lp, h, q = reference(full, label, temperature=t64, sum_pi_squared=True)
    sum((o * ups[k].double()).sum() for k, o in (("log_probs", lp), ("entropy", h), ("sum_pi_squared", q))).backward()
    for k, ref in (("log_probs", lp), ("entropy", h), ("sum_pi_squared", q)):
        ref = ref.detach()
        torch.testing.assert_close(ours[k].double()[keep], ref[keep], rtol=1e-5, atol=1e-5)
        if dtype == torch.bfloat16:  # where verl's arithmetic is the bf16 one, ours is the closer
            err = lambda o, k=k, ref=ref: (o[k].double()[keep] - ref[keep]).abs().sum()  # noqa: E731
            assert err(ours) < err(theirs), k
    g_ref = full.grad[..., rank * v_local : (rank + 1) * v_local]
    gtol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(g_all.double(), g_ref, **gtol)
    assert parallel_state.get_tensor_model_parallel_world_size() == world


def _worker(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(world)
    try:
        for fmt in ("thd", "bshd"):
            for dtype in (torch.float32, torch.bfloat16):
                _compare(rank, world, fmt, dtype)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2])
def test_matches_verls_own_processor_in_real_tp_groups(world):
    run_distributed(_worker, world)


def _distillation(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(world)
    engine = _engine(chunk_size=4)
    logits, label, temperature, pad, _ = _inputs("thd", torch.float32, 17, seed=3)
    calls = []

    def distill(*, student_logits, data, data_format):
        calls.append(student_logits.clone())  # verl overwrites them afterwards (its in-place cross entropy)
        return {"distillation_loss": student_logits.sum(-1) * 0}

    common = dict(calculate_sum_pi_squared=False, logits_processor_func=distill, batch=None, data_format="thd")
    out = ce_verl.lm_head_logits_processor(
        engine, logits, label, temperature, calculate_entropy=False, distillation_use_topk=True,
        distillation_only=False, **common,
    )
    theirs = VERL_METHOD(
        engine, logits.clone(), label, temperature.clone(), calculate_entropy=False, distillation_use_topk=True,
        distillation_only=False, **common,
    )
    assert set(out) == set(theirs) == {"log_probs", "distillation_loss"}
    # verl's distillation loss gets the temperature-scaled logits; so does it from us
    torch.testing.assert_close(calls[0], calls[1])
    torch.testing.assert_close(out["log_probs"][~pad], theirs["log_probs"][~pad], rtol=1e-5, atol=1e-5)
    only = ce_verl.lm_head_logits_processor(
        engine, logits, label, temperature, calculate_entropy=False, distillation_use_topk=True,
        distillation_only=True, **common,
    )
    assert set(only) == {"distillation_loss"}
    parallel_state.destroy_model_parallel()


def test_entropy_off_distillation_keys_and_log_probs_only():
    run_distributed(_distillation, 1)


def test_a_nan_or_infinite_temperature_is_refused_not_hidden():
    """verl's padding temperatures (<= 0) read as 1e-8; a NaN used to read as 1e-8 too (log-probs of -1e8)."""
    logits, label, temperature, _, _ = _inputs("thd", torch.float32, 13, seed=3)
    for bad in (float("nan"), float("inf")):
        t = temperature.clone()
        t[0, 4] = bad
        with pytest.raises(ValueError, match="temperature"):
            ce_verl.lm_head_logits_processor(
                _engine(8), logits, label, t, calculate_entropy=True, calculate_sum_pi_squared=False,
                distillation_use_topk=False, distillation_only=False, logits_processor_func=None, batch=None,
                data_format="thd",
            )


def test_install_uninstall_and_a_failed_patch_leaves_verl_as_it_was(monkeypatch):
    cls = transformer_impl.MegatronEngineWithLMHead
    try:
        ce_verl.install()
        assert ce_verl.installed() and cls._lm_head_logits_processor is ce_verl.lm_head_logits_processor
        ce_verl.install()  # idempotent
        ce_verl.uninstall()
        assert not ce_verl.installed() and cls.__dict__["_lm_head_logits_processor"] is VERL_METHOD

        def other_contract(self, logits, label, label_mask):
            return {}

        monkeypatch.setattr(cls, "_lm_head_logits_processor", other_contract)
        with pytest.raises(RuntimeError, match="Nothing was patched"):
            ce_verl.install()
        assert cls._lm_head_logits_processor is other_contract and not ce_verl.installed()
    finally:
        ce_verl.uninstall()


def test_config_from_verls_own_actor_config_follows_verls_entropy_rule():
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    cfgdir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.actor.entropy_from_logits_chunk_size=1024"]
    with initialize_config_dir(config_dir=cfgdir, version_base=None):
        cfg = compose(config_name="ppo_megatron_trainer",
                      overrides=overrides + ["actor_rollout_ref.actor.entropy_coeff=0.01"])
        off = compose(config_name="ppo_megatron_trainer", overrides=overrides)
    actor = cfg.actor_rollout_ref.actor
    assert actor.calculate_entropy is False and actor.entropy_coeff == 0.01  # verl's YAML as shipped
    for section in (actor, omega_conf_to_dataclass(actor)):  # the DictConfig and verl's McoreActorConfig
        c = ChunkedEntropyConfig.from_actor_config(section)
        assert c.compute_entropy is True and c.chunk_size == 1024
    off_cfg = ChunkedEntropyConfig.from_actor_config(omega_conf_to_dataclass(off.actor_rollout_ref.actor))
    assert off_cfg.compute_entropy is False


_PLUGIN_CHECK = r"""
import sys, warnings
warnings.simplefilter("ignore")
import verl
{load}
assert "verl.workers.engine.megatron.transformer_impl" not in sys.modules, "the plugin imported verl's engine"
from verl.workers.engine.megatron import transformer_impl as t
from chunked_entropy.integrations import verl as ce
assert t.MegatronEngineWithLMHead._lm_head_logits_processor is ce.lm_head_logits_processor
print("PATCHED")
"""


@pytest.mark.parametrize("how", ["VERL_USE_EXTERNAL_MODULES", "external_lib"])
def test_plugin_is_loaded_by_verls_own_hooks(how):
    env = dict(os.environ)
    if how == "VERL_USE_EXTERNAL_MODULES":
        env["VERL_USE_EXTERNAL_MODULES"] = "chunked_entropy.integrations.verl_plugin"
        load = ""
    else:  # what HFModelConfig does with actor_rollout_ref.model.external_lib
        load = ("from verl.utils.import_utils import import_external_libs\n"
                "import_external_libs('chunked_entropy.integrations.verl_plugin')")
    code = _PLUGIN_CHECK.format(load=load)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "PATCHED" in p.stdout, p.stderr[-3000:]
    assert "chunked_entropy: verl's MegatronEngineWithLMHead._lm_head_logits_processor now" in p.stderr


def _tripwire(*args, **kwargs):
    raise AssertionError("verl's own distillation function was called")


def _topk_distillation(rank, world):
    """verl's Megatron top-k distillation through the plugin: the keys come from the chunked pass that makes
    log_probs (no call of verl's distillation function), equal to verl's own route on the same inputs."""
    import functools

    from megatron.core import parallel_state
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine
    from verl.trainer.distillation import distillation_ppo_loss
    from verl.workers.config import ActorConfig
    from verl.workers.config.distillation import DistillationConfig, DistillationLossConfig

    parallel_state.initialize_model_parallel(world)
    engine = _engine(chunk_size=4)
    v_local, k = 11, 5
    v = v_local * world
    g = torch.Generator().manual_seed(21)
    keys = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")
    try:
        for fmt, clamp, t_one in (("thd", None, False), ("thd", -4.0, True), ("bshd", -4.0, False),
                                  ("bshd", None, True)):
            lengths = [5, 8, 3]
            t_lp = [torch.log_softmax(torch.randn(n, v, generator=g) * 2, -1).topk(k, -1) for n in lengths]
            ids = torch.nested.nested_tensor([t.indices for t in t_lp], layout=torch.jagged)
            lps = torch.nested.nested_tensor([t.values for t in t_lp], layout=torch.jagged)
            split = preprocess_thd_engine if fmt == "thd" else preprocess_bshd_engine  # verl's own layouts
            packed, *_ = split(lps, pre_process=True)
            shape = packed.shape[:2]
            logits = torch.randn(*shape, v, generator=g) * 3
            label = torch.randint(0, v, shape, generator=g)
            temperature = torch.ones(shape) if t_one else torch.rand(shape, generator=g) * 0.6 + 0.7
            shard = logits[..., rank * v_local:(rank + 1) * v_local]
            cfg = ActorConfig(strategy="megatron", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
            dcfg = DistillationConfig(distillation_loss=DistillationLossConfig(
                loss_mode="forward_kl_topk", log_prob_min_clamp=clamp, use_policy_gradient=False))
            fn = functools.partial(distillation_ppo_loss, config=cfg, distillation_config=dcfg)
            batch = {"teacher_ids": ids, "teacher_logprobs": lps}
            outs, grads = [], []
            import verl.trainer.distillation.megatron.losses as megatron_losses

            verls_own = megatron_losses.compute_forward_kl_topk
            for method in (VERL_METHOD, ce_verl.lm_head_logits_processor):
                if method is not VERL_METHOD:  # a tripwire: the plugin must not run verl's [T, V/tp] route
                    megatron_losses.compute_forward_kl_topk = _tripwire
                leaf = shard.clone().requires_grad_()
                out = method(engine, leaf * 1, label, temperature.clone(), calculate_sum_pi_squared=False,
                             calculate_entropy=True, distillation_use_topk=True, distillation_only=False,
                             logits_processor_func=fn, batch=batch, data_format=fmt)
                up = torch.randn(shape, generator=torch.Generator().manual_seed(5))
                (out["distillation_losses"] * up).sum().add(out["log_probs"].sum()).add(
                    out["entropy"].sum()).backward()
                outs.append(out)
                grads.append(leaf.grad)
            megatron_losses.compute_forward_kl_topk = verls_own
            theirs, ours = outs
            assert set(ours) == set(theirs) == {"log_probs", "entropy", *keys}
            real = packed.abs().sum(-1) > 0  # the teacher's padding rows (verl aligns every sample to TP)
            for key in keys:
                torch.testing.assert_close(ours[key][real].double(), theirs[key][real].double(), rtol=1e-4,
                                           atol=1e-5, msg=lambda m, key=key, f=fmt, c=clamp: f"{f} {c} {key}: {m}")
            torch.testing.assert_close(grads[1][real], grads[0][real], rtol=1e-4, atol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2])
def test_topk_distillation_keys_come_from_the_chunked_pass_and_equal_verls_route(world):
    run_distributed(_topk_distillation, world, timeout_s=120)


@pytest.mark.parametrize("chunk", [None, "abc", 0, True])
def test_a_bad_chunk_size_in_verls_engine_config_is_named(chunk):
    logits, label, temperature, _, _ = _inputs("thd", torch.float32, 13, seed=3)
    engine = _engine(8)
    object.__setattr__(engine.engine_config, "entropy_from_logits_chunk_size", chunk)  # as a config file may hold
    with pytest.raises(ValueError, match="engine_config.entropy_from_logits_chunk_size must be an int >= 1"):
        ce_verl.lm_head_logits_processor(
            engine, logits, label, temperature, calculate_entropy=True, calculate_sum_pi_squared=False,
            distillation_use_topk=False, distillation_only=False, logits_processor_func=None, batch=None,
            data_format="thd",
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_outside_the_engine_matches_verls_fused_linear_for_ppo(dtype):
    """verl's ``FusedLinearForPPO`` (torch backend) called directly: the drop-in's values and gradients (random
    upstream gradients on both outputs) no worse than verl's own against float64."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    from chunked_entropy.integrations.verl import fsdp as ce_fsdp

    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 5, 16, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(37, 16, generator=g, dtype=torch.float64) * 2).to(dtype)
    ids = torch.randint(0, 37, (2, 5), generator=g, dtype=torch.int32)
    ups = torch.randn(2, 2, 5, generator=g, dtype=torch.float64)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp = torch.log_softmax(h64 @ w64.t() / 0.7, -1)
    want = (lp.gather(-1, ids.long()[..., None])[..., 0], -(lp.exp() * lp).sum(-1))
    (want[0] * ups[0] + want[1] * ups[1]).sum().backward()
    module = FusedLinearForPPO(chunk_size=3)
    errs = []
    ours = lambda h, w: ce_fsdp.fused_linear_for_ppo_forward(module, h, w, ids, 0.7)  # noqa: E731
    for fn in (ours, lambda h, w: module(h, w, ids, 0.7)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        outs = fn(h, w)
        (outs[0].double() * ups[0] + outs[1].double() * ups[1]).sum().backward()
        errs.append([(a.detach().double() - b).abs().max().item()
                     for a, b in zip((*outs, h.grad, w.grad), (*want, h64.grad, w64.grad), strict=True)])
    slack = 1e-5 if dtype == torch.float32 else 0.0
    for ours, theirs in zip(*errs, strict=True):
        assert ours <= max(theirs, 1e-5) + slack, errs


@pytest.mark.parametrize("bad", [37, -1, -100])
def test_fused_forward_names_an_id_outside_the_vocabulary_as_verl_does(bad):
    """verl's gather raises on any id outside [0, V) (its Triton kernel would read one as no label): the drop-ins
    raise a ValueError naming the argument as verl names it, -100 included (not a log-prob of 0)."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    from chunked_entropy.integrations.verl import fsdp as ce_fsdp

    hidden, weight = torch.randn(2, 5, 16), torch.randn(37, 16)
    ids = torch.randint(0, 37, (2, 5))
    ids[1, 3] = bad
    module = FusedLinearForPPO(chunk_size=3)
    with pytest.raises((RuntimeError, IndexError)):
        module(hidden, weight, ids, 1.0)
    with pytest.raises(ValueError, match=rf"input_ids must hold class ids in \[0, 37\); found {bad}"):
        ce_fsdp.fused_linear_for_ppo_forward(module, hidden, weight, ids, 1.0)
