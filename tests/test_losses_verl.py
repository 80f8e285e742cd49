"""chunked_entropy.losses and the fused losses against verl 0.9.1's installed ``core_algos``.

verl's ``agg_loss`` (every mode, ``loss_scale_factor``, and the global
normalizers ``dp_size``, ``batch_num_tokens``, ``global_batch_size``), its
``compute_policy_loss_vanilla`` and its ``kl_penalty`` are the references,
imported from the installed package. The fused losses are compared with the
composition of verl's functions on float64 log-probs; and over gloo with 2
data-parallel ranks, each holding half the batch, the ranks' averaged
gradients (what DDP forms) equal the single-process gradient of the whole
batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import PolicyLoss, linear_policy_loss, losses, policy_loss_from_logits
from chunked_entropy.losses import Aggregation
from tests.helpers import reference, require, run_distributed

require("verl")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import verl
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

assert verl.__version__ == "0.9.1", verl.__version__

MODES = losses.AGG_MODES
assert set(MODES) == {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"}


def _data(seed, shape=(5, 7), dtype=torch.float64, weights=False):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(shape, generator=g, dtype=dtype)
    mask = torch.rand(shape, generator=g) < 0.6
    mask[0, 0] = True
    mask[-1] = False  # a fully masked sequence
    if weights:  # non-negative weights, as a float mask
        mask = mask.to(dtype) * torch.rand(shape, generator=g, dtype=dtype) * 2
    return loss, mask


NORMALIZERS = [
    pytest.param({}, id="local"),
    pytest.param(dict(loss_scale_factor=11.0), id="scale"),
    pytest.param(dict(dp_size=2, batch_num_tokens=37, global_batch_size=9), id="dp2"),
    pytest.param(dict(dp_size=4, batch_num_tokens=torch.tensor(61.0), global_batch_size=torch.tensor(13),
                      loss_scale_factor=5), id="dp4-tensors"),
]


@pytest.mark.parametrize("norm", NORMALIZERS)
@pytest.mark.parametrize("weights", [False, True], ids=["bool", "weights"])
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_is_verls(mode, weights, norm):
    loss, mask = _data(1, weights=weights)
    ours_in = loss.clone().requires_grad_()
    theirs_in = loss.clone().requires_grad_()
    ours = losses.agg_loss(ours_in, mask, mode, **norm)
    theirs = core_algos.agg_loss(theirs_in, mask, mode, **norm)
    # verl's seq-mean-token-mean adds 1e-8 to each token count: within 1e-8 of ours (exact for bool masks)
    tol = dict(rtol=1e-7, atol=0) if weights and mode == "seq-mean-token-mean" else dict(rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), **tol)
    up = torch.tensor(0.7, dtype=torch.float64)  # a non-unit upstream gradient
    (ours * up).backward()
    (theirs * up).backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **tol)


@pytest.mark.parametrize("mode", MODES)
def test_agg_weights_give_verls_loss(mode):
    loss, mask = _data(2)
    kw = dict(dp_size=3, batch_num_tokens=40, global_batch_size=12)
    w = losses.agg_weights(mask, mode, dtype=torch.float64, **kw)
    torch.testing.assert_close((w * loss).sum(), core_algos.agg_loss(loss, mask, mode, **kw), rtol=1e-14, atol=1e-15)


def test_empty_selection_is_zero_where_verl_divides_by_zero():
    """The one documented difference: nothing selected gives 0 here (with zero gradients)."""
    loss, _ = _data(3)
    none = torch.zeros_like(loss, dtype=torch.bool)
    assert torch.isnan(core_algos.agg_loss(loss, none, "token-mean"))  # verl 0.9.1: 0 / 0
    for mode in MODES:
        x = loss.clone().requires_grad_()
        out = losses.agg_loss(x, none, mode)
        out.backward()
        assert out.item() == 0 and (x.grad == 0).all(), mode


def test_global_counts_are_required_with_data_parallelism_as_in_verl():
    loss, mask = _data(4)
    for mode, missing in (("token-mean", "batch_num_tokens"), ("seq-mean-token-mean", "global_batch_size")):
        with pytest.raises(ValueError, match=missing):
            core_algos.agg_loss(loss, mask, mode, dp_size=2)
        with pytest.raises(ValueError, match=missing):
            losses.agg_loss(loss, mask, mode, dp_size=2)


def _verl_config(low, high, c, mode, norm):
    cfg = ActorConfig(strategy="megatron", clip_ratio=low, clip_ratio_low=low, clip_ratio_high=high,
                      clip_ratio_c=3.0 if c is None else c, loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1,
                      rollout_n=1)
    cfg.global_batch_info.update(norm)
    return cfg


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low,high,c", [(0.2, 0.28, 3.0), (0.1, 0.5, 1.5)])
def test_policy_loss_is_verls_vanilla(mode, low, high, c):
    g = torch.Generator().manual_seed(5)
    shape = (6, 9)
    lp = (torch.randn(shape, generator=g, dtype=torch.float64) * 0.6 - 2).requires_grad_()
    old = lp.detach() + torch.randn(shape, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) < 0.7
    mask[-1] = False
    norm = dict(dp_size=2, batch_num_tokens=int(mask.sum()) * 2, global_batch_size=10)
    options = {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c}
    loss = PolicyLoss(options=options, aggregation=mode).for_batch(**norm)
    ours, metrics = losses.policy_loss(lp, old, adv, mask, loss)
    lp2 = lp.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, their_metrics = core_algos.compute_policy_loss_vanilla(
            old, lp2, adv, mask, loss_agg_mode=mode, config=_verl_config(low, high, c, mode, norm)
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-12, atol=1e-14)
    for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        # verl forms its fractions in float32
        assert metrics[f"actor/{k}"].item() == pytest.approx(their_metrics[f"actor/{k}"], rel=1e-6, abs=1e-7), k


@pytest.mark.parametrize("kind", [k + plus for k in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
                                  for plus in ("", "+")])
def test_kl_penalty_is_verls(kind):
    """Values and both gradients, "+" (straight-through) kinds included, against verl's own ``kl_penalty``."""
    g = torch.Generator().manual_seed(6)
    lp = torch.randn(4, 8, generator=g, dtype=torch.float64) * 3
    ref = torch.randn(4, 8, generator=g, dtype=torch.float64) * 3
    lp[0, :2] = torch.tensor([40.0, -40.0])  # beyond verl's clamps
    gout = torch.randn(4, 8, generator=g, dtype=torch.float64)
    outs = []
    for fn in (losses.kl_penalty, core_algos.kl_penalty):
        a, b = lp.clone().requires_grad_(), ref.clone().requires_grad_()
        value = fn(a, b, kind)
        (value * gout).sum().backward()
        outs.append((value.detach(), a.grad, b.grad))
    for ours, theirs in zip(*outs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(losses.kl_penalty_grad(lp, ref, kind) * gout, outs[1][1], rtol=1e-14, atol=1e-14)


def _composed_with_verl(logits64, labels, old, adv, mask, ref, mode, norm, entropy_coeff, kl_coef):
    """The fused loss's definition, with verl's own functions on float64 log-probs and entropy."""
    lp, ent = reference(logits64, labels)
    cfg = _verl_config(0.2, 0.28, 3.0, mode, norm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pg, _ = core_algos.compute_policy_loss_vanilla(old, lp, adv, mask, loss_agg_mode=mode, config=cfg)
    bonus = core_algos.agg_loss(ent, mask, mode, **norm)
    kl = core_algos.agg_loss(core_algos.kl_penalty(lp, ref, "low_var_kl"), mask, mode, **norm)
    return pg - entropy_coeff * bonus + kl_coef * kl


def _loss_inputs(seed, b=4, t=6, h=8, v=40):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, v, (b, t), generator=g)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 2
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 2
    mask = torch.rand(b, t, generator=g) < 0.75
    mask[-1, :] = False
    mask[0, 0] = True
    return hidden, weight, labels, old, adv, ref, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["head", "logits"])
def test_fused_losses_are_the_composition_of_verls_functions(mode, path):
    hidden, weight, labels, old, adv, ref, mask = _loss_inputs(7)
    norm = dict(dp_size=2, batch_num_tokens=int(mask.sum()) + 5, global_batch_size=7, loss_scale_factor=9.0)
    options = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    aggregation = Aggregation(mode, norm["loss_scale_factor"], norm["dp_size"], norm["batch_num_tokens"],
                              norm["global_batch_size"])
    policy = PolicyLoss(options=options, entropy_coeff=0.03, kl_coef=0.2, aggregation=aggregation)
    kw = dict(loss=policy, ref_log_probs=ref, chunking=5)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    if path == "head":
        loss, _ = linear_policy_loss(h, w, labels, old, adv, mask, **kw)
    else:
        loss, _ = policy_loss_from_logits(h @ w.t(), labels, old, adv, mask, **kw)
    loss.backward()
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    verl_norm = {k: norm[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size")}
    verl_norm["loss_scale_factor"] = norm["loss_scale_factor"]
    want = _composed_with_verl(h64 @ w64.t(), labels, old, adv, mask, ref, mode, verl_norm, 0.03, 0.2)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, h64.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, w64.grad, rtol=1e-9, atol=1e-12)


def _dp_worker(rank, world):
    for mode in MODES:
        _dp_mode(rank, world, mode)


def _dp_mode(rank, world, mode):
    hidden, weight, labels, old, adv, ref, mask = _loss_inputs(11, b=6)
    policy = PolicyLoss(options={"clip_ratio_c": 3.0}, entropy_coeff=0.05, kl_coef=0.1, aggregation=mode)
    kw = dict(loss=policy, ref_log_probs=ref, chunking=4)
    # the single-process loss of the whole batch
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    full, _ = linear_policy_loss(h, w, labels, old, adv, mask, **kw)
    full.backward()
    # this rank's half, with verl's global normalizers
    rows = slice(rank * 3, rank * 3 + 3)
    non_empty = int((mask.sum(-1) > 0).sum())
    norm = dict(dp_size=world, batch_num_tokens=int(mask.sum()), global_batch_size=non_empty)
    for path in ("head", "logits"):
        hr, wr = hidden[rows].clone().requires_grad_(), weight.clone().requires_grad_()
        args = (labels[rows], old[rows], adv[rows], mask[rows])
        rkw = dict(kw, ref_log_probs=ref[rows], loss=policy.for_batch(**norm))
        if path == "head":
            part, _ = linear_policy_loss(hr, wr, *args, **rkw)
        else:
            part, _ = policy_loss_from_logits(hr @ wr.t(), *args, **rkw)
        part.backward()
        # the hidden states are this rank's rows: its loss is `world` times its share of the whole loss
        grad_h = [torch.empty_like(hr.grad) for _ in range(world)]
        dist.all_gather(grad_h, hr.grad)
        torch.testing.assert_close(torch.cat(grad_h) / world, h.grad, rtol=1e-9, atol=1e-12)
        # the weight is replicated: DDP averages the ranks' gradients (and we average the losses)
        value = part.detach().clone()
        for t in (value, wr.grad):
            dist.all_reduce(t)
            t /= world
        torch.testing.assert_close(value, full.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(wr.grad, w.grad, rtol=1e-9, atol=1e-12)


def test_two_data_parallel_ranks_average_to_the_whole_batch():
    """Every mode, both fused losses: one spawn of two gloo ranks."""
    run_distributed(_dp_worker, 2, timeout_s=120)
