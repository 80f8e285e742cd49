"""Every policy loss verl 0.9.1 registers, against verl's installed function of the same name.

For each of the twelve names of ``POLICY_LOSS_REGISTRY``: the loss, every
metric verl returns (same keys), and the gradient into the log-probs, for
every aggregation mode and verl's global-batch normalizers, with and without
``rollout_is_weights``, in float64 and float32. The data have an empty row,
advantages of both signs and ratios far outside the clip range. The rollout
correction helper against ``compute_rollout_correction_and_rejection_mask``
(IS levels and thresholds, batch normalization, every rejection criterion).
The written-down per-token gradients of the token-local objectives against
autograd of their losses. Bad options raise naming the option.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from chunked_entropy import PolicyLoss, losses
from chunked_entropy.losses import PolicyOptions
from tests.helpers import require

require("verl")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import verl
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    from verl.workers.config import ActorConfig, PolicyLossConfig

assert verl.__version__ == "0.9.1", verl.__version__
assert set(core_algos.POLICY_LOSS_REGISTRY) == set(losses.LOSS_MODES), sorted(core_algos.POLICY_LOSS_REGISTRY)

TOKEN_LOCAL = ("vanilla", "dppo_tv", "dppo_kl", "sapo", "gpg", "dro", "cispo")
OPTIONS = dict(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.5, tau_pos=1.3, tau_neg=2.0,
               clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=3.0, kl_cov_ratio=0.1, ppo_kl_coef=0.4, dro_beta=0.3)


def _data(seed, dtype=torch.float64, shape=(6, 9)):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(shape, generator=g, dtype=torch.float64) * 0.8 - 1.5).clamp(max=-1e-3)
    old = (lp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.6).clamp(max=-1e-3)
    old[0, :3] = lp[0, :3] - 3.0  # ratios far above the clip range
    old[1, :3] = lp[1, :3] + 3.0  # and far below
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) < 0.75
    mask[2] = False  # an empty row
    w = torch.rand(shape, generator=g, dtype=torch.float64) * 1.5 + 0.2
    return [t.to(dtype) for t in (lp, old, adv)] + [mask, w.to(dtype)]


def _verl_config(mode, agg, norm, **over):
    o = dict(OPTIONS, **over)
    corr = {k: o.pop(k) for k in list(o) if k.startswith("rollout_") or k == "loss_type"}
    pl = PolicyLossConfig(loss_mode=mode, clip_cov_ratio=o["clip_cov_ratio"], clip_cov_lb=o["clip_cov_lb"],
                          clip_cov_ub=o["clip_cov_ub"], kl_cov_ratio=o["kl_cov_ratio"], ppo_kl_coef=o["ppo_kl_coef"],
                          dro_beta=o["dro_beta"], rollout_correction=RolloutCorrectionConfig(**corr))
    cfg = ActorConfig(strategy="megatron", clip_ratio=o["clip_ratio"], clip_ratio_low=o["clip_ratio_low"],
                      clip_ratio_high=o["clip_ratio_high"], clip_ratio_c=o["clip_ratio_c"], tau_pos=o["tau_pos"],
                      tau_neg=o["tau_neg"], loss_agg_mode=agg, policy_loss=pl, ppo_micro_batch_size_per_gpu=1,
                      rollout_n=1)
    cfg.global_batch_info.update(norm)
    return cfg


def _run_both(mode, agg, norm, dtype, with_weights, seed=0, **over):
    lp, old, adv, mask, w = _data(seed, dtype)
    weights = w if with_weights else None
    cfg = _verl_config(mode, agg, norm, **over)
    x = lp.clone().requires_grad_()
    torch.manual_seed(123)  # clip_cov draws its tokens from torch's global generator, in verl and here alike
    theirs, t_metrics = core_algos.get_policy_loss_fn(mode)(old, x, adv, mask, agg, cfg, rollout_is_weights=weights)
    theirs.backward()
    y = lp.clone().requires_grad_()
    torch.manual_seed(123)
    loss = PolicyLoss(mode, options=PolicyOptions.from_actor_config(cfg), aggregation=losses.Aggregation(agg, **norm))
    ours, o_metrics = losses.policy_loss(y, old, adv, mask, loss, rollout_is_weights=weights)
    ours.backward()
    return (theirs, t_metrics, x.grad), (ours, o_metrics, y.grad)


def _close(ours, theirs, dtype):
    tol = dict(rtol=1e-6, atol=1e-8) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs,
                               dtype=torch.float64), **tol)


NORMS = [{}, dict(dp_size=2, batch_num_tokens=70, global_batch_size=11, loss_scale_factor=13)]


@pytest.mark.parametrize("mode", losses.LOSS_MODES)
@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_every_registered_loss_is_verls(mode, agg):
    for norm in NORMS:
        for dtype in (torch.float64, torch.float32):
            for with_weights in (False, True):
                (theirs, t_m, t_g), (ours, o_m, o_g) = _run_both(mode, agg, norm, dtype, with_weights)
                _close(ours.detach(), theirs.detach(), dtype)
                assert set(o_m) == set(t_m), (mode, sorted(set(o_m) ^ set(t_m)))
                for k in t_m:
                    _close(o_m[k], t_m[k], dtype)
                if t_g is None:
                    assert o_g is None or not o_g.any()
                else:
                    _close(o_g, t_g, dtype)
                assert ours.dtype == theirs.dtype == dtype


@pytest.mark.parametrize("corr", [
    dict(loss_type="ppo_clip", rollout_is="sequence"),
    dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5),
    dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold="0.5_3.0", rollout_is_batch_normalize=True),
    dict(loss_type="ppo_clip", rollout_is="token", rollout_rs="token_k1,seq_mean_k3",
         rollout_rs_threshold="0.6_1.8,2.0"),
    dict(loss_type="reinforce", rollout_is=None, rollout_rs="seq_max_k2", rollout_rs_threshold=0.8),
])
def test_bypass_mode_with_rollout_correction_is_verls(corr):
    for agg in ("token-mean", "seq-mean-token-sum"):
        (theirs, t_m, t_g), (ours, o_m, o_g) = _run_both("bypass_mode", agg, {}, torch.float64, False, seed=4, **corr)
        _close(ours.detach(), theirs.detach(), torch.float64)
        assert set(o_m) == set(t_m), sorted(set(o_m) ^ set(t_m))
        for k in t_m:
            _close(o_m[k], t_m[k], torch.float64)
        _close(o_g, t_g, torch.float64)


RS = ["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2",
      "seq_mean_k3", "seq_max_k2", "seq_max_k3"]


@pytest.mark.parametrize("settings", [
    dict(rollout_is="token"), dict(rollout_is="sequence"), dict(rollout_is="token", rollout_is_threshold="0.7_1.6"),
    dict(rollout_is="token", rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_batch_normalize=True),
    *[dict(rollout_rs=rs, rollout_rs_threshold="0.5_2.0" if rs.endswith("k1") else 0.4) for rs in RS],
    dict(rollout_is="token", rollout_rs="token_k2,seq_sum_k1,seq_max_k3", rollout_rs_threshold="0.3,0.2_4.0,1.0"),
])
def test_rollout_correction_is_verls(settings):
    lp, old, _, mask, _ = _data(7)
    mask = mask.clone()
    mask[2, 0] = True  # verl's rejection metrics divide by every row's count
    theirs_w, theirs_mask, theirs_m = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        lp, old, mask, **settings)
    ours_w, ours_mask, ours_m = losses.rollout_correction(lp, old, mask, **settings)
    if theirs_w is None:
        assert ours_w is None
    else:
        _close(ours_w, theirs_w.batch["rollout_is_weights"], torch.float64)
    assert torch.equal(ours_mask, theirs_mask)
    assert set(ours_m) == set(theirs_m), sorted(set(ours_m) ^ set(theirs_m))
    for k, v in theirs_m.items():
        _close(ours_m[k], v, torch.float64)


@pytest.mark.parametrize("mode", TOKEN_LOCAL)
def test_written_down_gradients_are_autograds(mode):
    """What the fused loss forms per token in its forward pass: the derivative of each token's loss."""
    lp, old, adv, mask, _ = _data(3)
    x = lp.clone().requires_grad_()
    loss, _ = losses.policy_loss(x, old, adv, mask, PolicyLoss(mode, OPTIONS, aggregation="token-sum"))
    loss.backward()
    grad = losses.policy_loss_grad(lp, old, adv, mask, loss_mode=mode, **OPTIONS)
    # the aggregation's weights: 1 per token for "token-sum"; SAPO imposes its "seq-mean-token-mean"
    w = losses.agg_weights(mask, "seq-mean-token-mean" if mode == "sapo" else "token-sum", dtype=lp.dtype)
    torch.testing.assert_close(grad * w, x.grad, rtol=1e-12, atol=1e-12)


def test_options_from_a_verl_actor_config_and_bad_options():
    cfg = _verl_config("sapo", "token-mean", {}, loss_type="reinforce", rollout_is="token", rollout_rs="token_k3",
                       rollout_rs_threshold=0.1)
    o = PolicyOptions.from_actor_config(cfg)
    assert (o.low, o.high, o.clip_ratio_c, o.tau_pos, o.tau_neg, o.dro_beta) == (0.15, 0.28, 2.5, 1.3, 2.0, 0.3)
    assert (o.loss_type, o.rollout_is, o.rollout_rs, o.rollout_rs_threshold) == ("reinforce", "token", "token_k3", 0.1)
    assert PolicyOptions.from_actor_config({"clip_ratio": 0.3}).high == 0.3  # a dict, verl's defaults elsewhere
    assert PolicyOptions().rollout_is == RolloutCorrectionConfig().rollout_is  # verl's defaults
    assert PolicyOptions().ppo_kl_coef == PolicyLossConfig().ppo_kl_coef
    lp, old, adv, mask, w = _data(0)
    bad = [
        (dict(mode="ppo"), {}, ValueError, "loss_mode must be one of"),
        (dict(mode="dro"), {}, ValueError, "dro_beta"),
        (dict(options={"tau_pos": -1.0}), {}, ValueError, "tau_pos"),
        (dict(options={"clip_ratio_c": 1.0}), {}, ValueError, "clip_ratio_c"),
        (dict(options={"clip_ratio_low": 1.5}), {}, ValueError, "clip_ratio_low"),
        (dict(options={"kl_cov_ratio": 0.0}), {}, ValueError, "kl_cov_ratio"),
        (dict(options={"rollout_is": "tokens"}), {}, ValueError, "rollout_is"),
        (dict(options={"loss_type": "ppo"}), {}, ValueError, "loss_type"),
        (dict(options={"clip_ratio_hgih": 0.2}), {}, TypeError, "clip_ratio_hgih"),
        ({}, dict(rollout_is_weights=w[:, :3]), ValueError, "rollout_is_weights"),
        ({}, dict(rollout_is_weights=w.long()), TypeError, "rollout_is_weights"),
        ({}, dict(generator=3), TypeError, "generator"),
    ]
    for fields, kw, exc, name in bad:
        with pytest.raises(exc, match=name):
            losses.policy_loss(lp.requires_grad_(), old, adv, mask, PolicyLoss(**fields), **kw)
    with pytest.raises(ValueError, match="not token-local"):
        losses.policy_loss_grad(lp, old, adv, mask, loss_mode="gspo")
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        losses.rollout_correction(lp, old, mask, rollout_rs="token_k2")
    with pytest.raises(ValueError, match="unknown criterion"):
        losses.rollout_correction(lp, old, mask, rollout_rs="token_k4", rollout_rs_threshold=1.0)
    with pytest.raises(ValueError, match="at least one valid token"):
        losses.rollout_correction(lp, old, torch.zeros_like(mask), rollout_is="token")


def test_clip_cov_takes_a_generator():
    lp, old, adv, mask, _ = _data(5)
    runs = [losses.policy_loss(lp, old, adv, mask, PolicyLoss("clip_cov", OPTIONS),
                               generator=torch.Generator().manual_seed(s))[1]["actor/pg_clipfrac"]
            for s in (1, 1, 2, 3, 4)]
    assert runs[0] == runs[1] and runs[0] > 0  # the same generator state cuts the same tokens



def _verl_grad(mode, agg, lp, old, adv, mask, w, **over):
    x = lp.clone().requires_grad_()
    torch.manual_seed(123)
    loss, _ = core_algos.get_policy_loss_fn(mode)(old, x, adv, mask, agg, _verl_config(mode, agg, {}, **over),
                                                  rollout_is_weights=w)
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(lp) if g is None else g


BYPASS = [dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=1.5),  # row-local
          dict(loss_type="ppo_clip", rollout_is="token"),  # row-local
          dict(loss_type="reinforce", rollout_is="sequence", rollout_is_batch_normalize=True),  # the batch's mean
          dict(rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")]  # rejection: every row's count


@pytest.mark.parametrize("mode,over", [(m, {}) for m in losses.LOSS_MODES if m != "bypass_mode"]
                         + [("bypass_mode", o) for o in BYPASS])
def test_row_local_is_what_verls_gradient_reads(mode, over):
    """An objective that reads only its own row (token-local, or ``row_local``: the fused loss then forms
    its gradients a chunk of whole rows at a time): in verl's own function, a row's gradient is unchanged
    when every other row's log-probs change. The others (clip_cov, kl_cov; bypass_mode with a rejection
    criterion or batch normalization) read other rows."""
    lp, old, adv, mask, w = _data(4)
    for agg in ("token-mean", "seq-mean-token-mean"):
        row_local = losses.row_local(mode, PolicyOptions.from_actor_config(_verl_config(mode, agg, {}, **over)))
        base = _verl_grad(mode, agg, lp, old, adv, mask, w, **over)
        moved = lp.clone()
        moved[1:] = (moved[1:] + torch.linspace(-2.5, 2.5, moved[1:].numel(), dtype=lp.dtype).view_as(
            moved[1:])).clamp(max=-1e-3)  # every row but the first
        g = _verl_grad(mode, agg, moved, old, adv, mask, w, **over)
        reads_only_its_row = torch.equal(g[0], base[0])
        if row_local:
            assert reads_only_its_row, (mode, agg)
        elif agg == "token-mean":
            assert not reads_only_its_row, (mode, agg)


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+", "k1+", "abs+", "mse+"])
def test_verls_straight_through_kl_types_are_read_from_its_actor_config(kind):
    import dataclasses

    from chunked_entropy import PolicyLoss

    base = _verl_config("vanilla", "token-mean", {})
    cfg = dataclasses.replace(base, use_kl_loss=True, kl_loss_type=kind, kl_loss_coef=0.1)
    loss = PolicyLoss.from_actor_config(cfg)
    assert (loss.kl_kind, loss.kl_coef) == (kind, 0.1)
    full = dataclasses.replace(cfg, kl_loss_type="full")  # verl's own kl_penalty raises NotImplementedError for it
    with pytest.raises(ValueError, match="kl_kind.*'full'"):
        PolicyLoss.from_actor_config(full)


@pytest.mark.parametrize("key", ["policy_loss.loss_mode", "loss_agg_mode", "entropy_coeff", "kl_loss_coef",
                                 "kl_loss_type", "use_kl_loss", "loss_scale_factor", "clip_ratio_high",
                                 "policy_loss", "policy_loss.clip_cov_ratio", "policy_loss.rollout_correction",
                                 "policy_loss.rollout_correction.rollout_is"])
def test_policy_loss_from_an_actor_config_refuses_a_mandatory_value_never_set(key):
    """Issue 45 item 6: an OmegaConf ``???`` was read as absent (vanilla, token-mean, 0.0), or raised OmegaConf's own
    MissingMandatoryValue for clip_ratio_high; like Chunking.from_config, a ValueError names the key."""
    from omegaconf import OmegaConf

    from chunked_entropy import Chunking, PolicyLoss

    cfg = {"policy_loss": {"loss_mode": "gspo", "clip_cov_ratio": 0.001, "rollout_correction": {"rollout_is": None}},
           "loss_agg_mode": "token-mean", "entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.1,
           "kl_loss_type": "low_var_kl", "loss_scale_factor": None, "clip_ratio_high": 0.28}
    assert PolicyLoss.from_actor_config(OmegaConf.create(cfg)).mode == "gspo"
    node = cfg
    *path, last = key.split(".")
    for k in path:
        node = node[k]
    node[last] = "???"
    with pytest.raises(ValueError, match=rf"^{key} is \?\?\? \(a mandatory value"):
        PolicyLoss.from_actor_config(OmegaConf.create(cfg))
    with pytest.raises(ValueError, match=r"is \?\?\?"):  # as the chunking of the same section refuses one
        Chunking.from_config(OmegaConf.create({"entropy_from_logits_chunk_size": "???"}))


@pytest.mark.parametrize("config, name", [
    (5, "config"), ("gspo", "config"), ([("loss_mode", "gspo")], "config"), ({"policy_loss": "gspo"}, "policy_loss"),
    ({"policy_loss": {"rollout_correction": 1}}, "policy_loss.rollout_correction"),
])
def test_policy_loss_from_a_config_that_is_not_a_mapping_is_a_type_error(config, name):
    """Issue 45 item 6: ``5``, ``"gspo"`` or ``policy_loss: "gspo"`` gave vanilla PPO with verl's defaults."""
    from chunked_entropy import PolicyLoss

    with pytest.raises(TypeError, match=rf"^{name} must be a mapping of settings"):
        PolicyLoss.from_actor_config(config)
    with pytest.raises(TypeError, match=rf"^{name} must be a mapping of settings"):
        PolicyOptions.from_actor_config(config)


def test_policy_loss_takes_the_ops_policy_loss_and_names_what_it_cannot_take():
    """``losses.policy_loss`` takes a ``PolicyLoss`` (None: its defaults, no warning); a loss with an entropy
    bonus or a KL penalty is refused naming the field (it is the objective alone), as is an object of another
    type (a loss beside the flat keywords: test_the_deprecated_flat_keywords_are_the_same_call_and_warn)."""
    lp, old, adv, mask, _ = _data(0, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        default, _ = losses.policy_loss(lp, old, adv, mask)
        assert torch.equal(default, losses.policy_loss(lp, old, adv, mask, PolicyLoss())[0])
    for field in ("entropy_coeff", "kl_coef"):
        with pytest.raises(ValueError, match=rf"losses.policy_loss is the policy objective alone: loss.{field} must"):
            losses.policy_loss(lp, old, adv, mask, PolicyLoss(**{field: 0.1}))
    with pytest.raises(TypeError, match="loss must be a chunked_entropy.PolicyLoss or None, got str"):
        losses.policy_loss(lp, old, adv, mask, "vanilla")


@pytest.mark.parametrize("mode", losses.LOSS_MODES)
def test_the_deprecated_flat_keywords_are_the_same_call_and_warn(mode):
    """The suite's one call of ``losses.policy_loss``'s flat keywords (0.2.0 deprecates them, 0.3.0 removes
    them): in every mode and aggregation, with and without the global batch's counts and rollout weights, the
    same loss, metrics and gradient bit for bit as the ``PolicyLoss`` call, with a ``DeprecationWarning`` naming
    the new form; an option by its verl name is one of them; a ``loss`` beside them is refused."""
    lp, old, adv, mask, w = _data(1, torch.float64)
    corr = dict(loss_type="ppo_clip", rollout_is="token") if mode == "bypass_mode" else {}
    options = PolicyOptions(**OPTIONS, **corr)
    for agg in losses.AGG_MODES:
        for norm in NORMS:
            for weights in (None, w):
                y, z = lp.clone().requires_grad_(), lp.clone().requires_grad_()
                torch.manual_seed(123)  # clip_cov draws its tokens from torch's global generator
                loss = PolicyLoss(mode, options, aggregation=losses.Aggregation(agg, **norm))
                ours, o_metrics = losses.policy_loss(y, old, adv, mask, loss, rollout_is_weights=weights)
                torch.manual_seed(123)
                with pytest.warns(DeprecationWarning, match=r"losses.policy_loss: the keyword\(s\) .*loss_mode.* "
                                  r"are the flat form and go in 0.3.0; pass loss=PolicyLoss\("):
                    flat, f_metrics = losses.policy_loss(z, old, adv, mask, loss_mode=mode, options=options,
                                                         loss_agg_mode=agg, rollout_is_weights=weights, **norm)
                ours.backward()
                flat.backward()
                assert torch.equal(flat, ours) and set(f_metrics) == set(o_metrics), (agg, norm)
                for k in o_metrics:
                    assert torch.equal(torch.as_tensor(f_metrics[k]), torch.as_tensor(o_metrics[k])), (agg, norm, k)
                assert (z.grad is None and y.grad is None) or torch.equal(z.grad, y.grad), (agg, norm)
    torch.manual_seed(123)
    with pytest.warns(DeprecationWarning, match=r"losses.policy_loss: the keyword\(s\) .*clip_ratio_c.* are the flat"):
        by_name, _ = losses.policy_loss(lp, old, adv, mask, loss_mode=mode, clip_ratio_c=3.0, **OPTIONS_BUT_C, **corr)
    torch.manual_seed(123)
    assert torch.equal(by_name, losses.policy_loss(lp, old, adv, mask, PolicyLoss(
        mode, dict(OPTIONS_BUT_C, clip_ratio_c=3.0, **corr)))[0])
    with pytest.raises(TypeError, match=r"loss= and the flat keyword\(s\) clip_ratio_c both given"):
        losses.policy_loss(lp, old, adv, mask, PolicyLoss(), clip_ratio_c=3.0)


OPTIONS_BUT_C = {k: v for k, v in OPTIONS.items() if k != "clip_ratio_c"}
