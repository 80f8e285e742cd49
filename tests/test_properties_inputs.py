"""What frameworks hand over, on every path: the inputs a fuzz pass found refused or mishandled.

- **Loss masks** as frameworks give them (bool; int64, verl's ``response_mask``
  is the attention mask's dtype; float 0/1; float weights) through every
  ``loss_mode`` of both fused losses and the Module's ``policy_loss``: equal to
  plain float64 PyTorch log-probs and entropy composed with
  :func:`chunked_entropy.losses.policy_loss` (tested against verl's installed
  functions in ``test_losses_registry.py``), loss, metrics and gradients; and
  under TP 2 over gloo.
- **Half-precision heads** (fp16, bf16), with and without vocabulary blocks,
  including a loss scale on weights with a common offset (each block's partial
  ``g @ W`` then overflows fp16): every gradient finite and within 3x of plain
  half-precision autograd's error against float64.
- **top_k** from 1 to V, with and without vocabulary blocks: the ids and
  log-probs in descending order, equal to ``torch.topk`` of float64 log-probs.
- **Another device** for every tensor argument (the ``meta`` device stands in
  for a second accelerator on this CPU): a ValueError naming the argument,
  before any work, the caller's tensors untouched.
- **An IcePop window that zeroes every IS weight**: verl 0.9.1's function raises
  ZeroDivisionError; here a defined value.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from chunked_entropy import (
    ChunkedVocabParallelHead,
    Chunking,
    OutputLayer,
    PolicyLoss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    losses,
    policy_loss_from_logits,
)
from tests.helpers import run_distributed

B, T, H, V = 3, 5, 6, 13
OPTS = dict(clip_ratio_low=0.15, clip_ratio_high=0.28, dro_beta=0.2, clip_cov_ratio=0.3, clip_cov_lb=-5.0,
            clip_cov_ub=5.0, kl_cov_ratio=0.2, rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=2.0)
MASK_KINDS = ("bool", "int64", "float01", "weights")


def _mask(kind: str, g: torch.Generator) -> torch.Tensor:
    keep = torch.rand(B, T, generator=g) < 0.75
    keep[0, 0] = True  # at least one token (bypass_mode needs one)
    keep[1] = False  # an empty sequence
    if kind == "bool":
        return keep
    if kind == "int64":
        return keep.to(torch.int64)
    if kind == "float01":
        return keep.to(torch.float32)
    return torch.where(keep, torch.rand(B, T, generator=g) * 2 + 0.25, torch.zeros(()))  # float weights


def _data(seed: int, kind: str):
    g = torch.Generator().manual_seed(seed)
    d = dict(hidden=torch.randn(B, T, H, generator=g, dtype=torch.float64),
             weight=torch.randn(V, H, generator=g, dtype=torch.float64),
             bias=torch.randn(V, generator=g, dtype=torch.float64),
             labels=torch.randint(0, V, (B, T), generator=g),
             adv=torch.randn(B, T, generator=g, dtype=torch.float64),
             ref=-torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 1,
             mask=_mask(kind, g))
    with torch.no_grad():
        z = d["hidden"] @ d["weight"].t() + d["bias"]
        lp = torch.log_softmax(z / 0.8, -1).gather(-1, d["labels"].unsqueeze(-1)).squeeze(-1)
    d["old"] = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.7  # inside and outside the clip
    return d


def _plain_composition(d, mode, up):
    """float64 PyTorch log-probs and entropy, then the losses package: loss, metrics and leaf gradients."""
    leaves = {k: d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    z = (leaves["hidden"] @ leaves["weight"].t() + leaves["bias"]) / 0.8
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, d["labels"].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    torch.manual_seed(11)
    pg, metrics = losses.policy_loss(lp, d["old"], d["adv"], d["mask"], PolicyLoss(mode, OPTS))
    ent_loss = losses.entropy_bonus(ent, d["mask"], "token-mean")
    kl = losses.agg_loss(losses.kl_penalty(lp, d["ref"], "low_var_kl"), d["mask"], "token-mean")
    loss = pg - 0.03 * ent_loss + 0.1 * kl
    metrics = dict(metrics, **{"actor/pg_loss": pg.detach(), "actor/entropy_loss": ent_loss.detach(),
                               "kl_loss": kl.detach()})
    (loss * up).backward()
    return loss.detach(), metrics, {k: t.grad for k, t in leaves.items()}


def _fused(d, mode, path, up):
    leaves = {k: d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    kw = dict(loss=PolicyLoss(mode, OPTS, entropy_coeff=0.03, kl_coef=0.1), temperature=0.8, ref_log_probs=d["ref"])
    args = (d["labels"], d["old"], d["adv"], d["mask"])
    torch.manual_seed(11)
    if path == "logits":
        z = leaves["hidden"] @ leaves["weight"].t() + leaves["bias"]
        loss, metrics = policy_loss_from_logits(z, *args, chunking=4, **kw)
    elif path == "head":
        loss, metrics = linear_policy_loss(leaves["hidden"], OutputLayer(leaves["weight"], leaves["bias"]), *args,
                                           chunking=Chunking(4, vocab_chunk_size=5), **kw)
    else:  # the Module users wrap
        head = ChunkedVocabParallelHead(OutputLayer(leaves["weight"], leaves["bias"]), T)
        loss, metrics = head.policy_loss(leaves["hidden"], *args, **kw)
    (loss * up).backward()
    return loss.detach(), metrics, {k: t.grad for k, t in leaves.items()}


@pytest.mark.parametrize("mode", losses.LOSS_MODES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("path", ["head", "logits", "module"])
def test_every_mask_dtype_through_every_mode_and_path(mode, kind, path):
    d = _data(3, kind)
    before = {k: v.clone() for k, v in d.items()}
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = _fused(d, mode, path, 1.3), _plain_composition(
        d, mode, 1.3)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    assert set(metrics) == set(ref_metrics), sorted(set(metrics) ^ set(ref_metrics))
    for k, v in ref_metrics.items():
        torch.testing.assert_close(metrics[k].double(), v.double(), rtol=1e-10, atol=1e-12, msg=k)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)
    for k, v in before.items():  # nothing written into the caller's tensors (the mask included)
        assert torch.equal(d[k], v) and d[k].dtype == v.dtype, k


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_policy_loss_grad_takes_every_mask_dtype(kind):
    d = _data(5, kind)
    lp = torch.log_softmax(d["hidden"] @ d["weight"].t(), -1)[..., 0].detach()
    w = d["mask"].to(torch.float64)
    for mode in losses.TOKEN_LOCAL_MODES:
        written = losses.policy_loss_grad(lp, d["old"], d["adv"], d["mask"], loss_mode=mode, **OPTS)
        if mode == "sapo":  # aggregated per sequence whatever the mode: no token-sum to differentiate
            as_bool = losses.policy_loss_grad(lp, d["old"], d["adv"], d["mask"] != 0, loss_mode=mode, **OPTS)
            torch.testing.assert_close(written, as_bool, rtol=0, atol=0)
            continue
        x = lp.clone().requires_grad_()
        loss, _ = losses.policy_loss(x, d["old"], d["adv"], d["mask"], PolicyLoss(mode, OPTS, aggregation="token-sum"))
        loss.backward()  # the token-sum weighs each token's loss by the mask: autograd gives mask * derivative
        torch.testing.assert_close(written * w, x.grad, rtol=1e-10, atol=1e-12, msg=mode)
        assert torch.equal(written[w == 0], torch.zeros_like(written[w == 0])), mode


def _tp_int_mask(rank, world):
    import torch.distributed as dist

    d = _data(7, "int64")
    v_local = V // world + 1
    pad = v_local * world - V  # the vocabulary padded to a multiple of the group, as Megatron pads it
    weight = torch.cat([d["weight"], torch.zeros(pad, H, dtype=torch.float64)])
    bias = torch.cat([d["bias"], torch.full((pad,), -1e30, dtype=torch.float64)])
    full = dict(d, weight=weight, bias=bias)
    ref_loss, ref_metrics, ref_grads = _plain_composition(d, "vanilla", 1.0)
    shard = dict(full, weight=weight[rank * v_local:(rank + 1) * v_local].clone(),
                 bias=bias[rank * v_local:(rank + 1) * v_local].clone())
    leaves = {k: shard[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    loss, metrics = linear_policy_loss(leaves["hidden"],
                                       OutputLayer(leaves["weight"], leaves["bias"], process_group=dist.group.WORLD),
                                       d["labels"], d["old"], d["adv"], d["mask"],
                                       loss=PolicyLoss(options=OPTS, entropy_coeff=0.03, kl_coef=0.1), chunking=4,
                                       temperature=0.8, ref_log_probs=d["ref"])
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaves["hidden"].grad, ref_grads["hidden"], rtol=1e-9, atol=1e-11)
    rows = slice(rank * v_local, min((rank + 1) * v_local, V))
    n = rows.stop - rows.start
    torch.testing.assert_close(leaves["weight"].grad[:n], ref_grads["weight"][rows], rtol=1e-9, atol=1e-11)


def test_integer_mask_under_tensor_parallelism():
    run_distributed(_tp_int_mask, 2)


# ----------------------------------------------------------------------------- half-precision heads


def _half_case(dtype, offset, scale, seed=0):
    """Hidden states and weight rows with a common ``offset`` (shared by every vocabulary row), labels, and
    upstream gradients ``scale`` times random (a loss scale)."""
    g = torch.Generator().manual_seed(seed)
    n, h, v = 24, 32, 96
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.1 + offset).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    ups = [(torch.rand(n, generator=g) + 0.5) * scale for _ in range(2)]
    return hidden, weight, labels, ups


def _grads_of(fn, hidden, weight, labels, ups, dtype):
    h, w = (t.detach().to(dtype).clone().requires_grad_() for t in (hidden, weight))  # fresh leaves each call
    lp, ent = fn(h, w, labels)
    ((lp.double() * ups[0]).sum() + (ent.double() * ups[1]).sum()).backward()
    return h.grad.double(), w.grad.double()


def _plain(h, w, labels):
    """Plain autograd as a half-precision model computes it: the matmul in the weights' dtype, the softmax in
    float32."""
    logp = torch.log_softmax((h @ w.t()).float(), -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab_chunk_size", [None, 17, 32])
@pytest.mark.parametrize("offset,scale", [(0.0, 1.0), (8.0, 1e4)], ids=["plain", "loss_scale_offset"])
def test_half_precision_heads_train_as_plain_autograd(dtype, vocab_chunk_size, offset, scale):
    hidden, weight, labels, ups = _half_case(dtype, offset, scale)

    def ours(h, w, y):
        return linear_log_probs_and_entropy(h, w, y, chunking=Chunking(8, vocab_chunk_size=vocab_chunk_size))

    exact = _grads_of(_plain, hidden.double(), weight.double(), labels, ups, torch.float64)
    theirs = _grads_of(_plain, hidden, weight, labels, ups, dtype)
    mine = _grads_of(ours, hidden, weight, labels, ups, dtype)
    for name, e, t, m in zip(("hidden", "weight"), exact, theirs, mine, strict=True):
        assert torch.isfinite(t).all(), f"plain {dtype} autograd itself overflowed: not a fair case"
        assert torch.isfinite(m).all(), f"{name}'s gradient is not finite"
        err_plain, err_ours = (t - e).abs().max().item(), (m - e).abs().max().item()
        assert err_ours <= 3 * err_plain + 1e-6 * e.abs().max().item(), (name, err_ours, err_plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab_chunk_size", [None, 17])
@pytest.mark.parametrize("offset,scale", [(0.0, 1.0), (8.0, 1e4)], ids=["plain", "loss_scale_offset"])
def test_half_precision_fused_loss_trains_as_plain_autograd(dtype, vocab_chunk_size, offset, scale):
    # the fused policy loss forms its gradients in forward (half precision: a statistics pass, then vocabulary
    # blocks outermost, the weight gradient stored in the weight's dtype) and scales them by the upstream
    # gradient (a loss scale) in backward
    hidden, weight, labels, ups = _half_case(dtype, offset, scale)
    g = torch.Generator().manual_seed(5)
    old = _plain(hidden.double(), weight.double(), labels)[0].float() + 0.05 * torch.randn(labels.shape, generator=g)
    adv, mask = torch.randn(labels.shape, generator=g), torch.rand(labels.shape, generator=g) > 0.2

    def plain_loss(h, w):
        lp, ent = _plain(h, w, labels)
        pg, _ = losses.policy_loss(lp, old.to(lp.dtype), adv.to(lp.dtype), mask)
        return pg - 0.01 * (ent * mask).sum() / mask.sum()

    def fused_loss(h, w):
        return linear_policy_loss(h, w, labels, old, adv, mask, loss=PolicyLoss(entropy_coeff=0.01),
                                  chunking=Chunking(8, vocab_chunk_size=vocab_chunk_size))[0]

    def grads(fn, dt):
        h, w = (t.detach().to(dt).clone().requires_grad_() for t in (hidden, weight))
        (fn(h, w) * scale).backward()
        return h.grad.double(), w.grad.double()

    exact, theirs, mine = grads(plain_loss, torch.float64), grads(plain_loss, dtype), grads(fused_loss, dtype)
    for name, e, t, m in zip(("hidden", "weight"), exact, theirs, mine, strict=True):
        assert torch.isfinite(t).all(), f"plain {dtype} autograd itself overflowed: not a fair case"
        assert torch.isfinite(m).all(), f"{name}'s gradient is not finite"
        err_plain, err_ours = (t - e).abs().max().item(), (m - e).abs().max().item()
        assert err_ours <= 3 * err_plain + 1e-6 * e.abs().max().item(), (name, err_ours, err_plain)


# ----------------------------------------------------------------------------- top_k order


@pytest.mark.parametrize("vocab_chunk_size", [None, 1, 4, 5, V])
def test_top_k_from_one_to_the_vocabulary_is_sorted(vocab_chunk_size):
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(7, H, generator=g), torch.randn(V, H, generator=g)
    ref = torch.log_softmax((hidden.double() @ weight.double().t()), -1)
    head = ChunkedVocabParallelHead(weight, Chunking(3, vocab_chunk_size=vocab_chunk_size))
    for k in range(1, V + 1):
        want = ref.topk(k, dim=-1)
        for out in (linear_log_probs_and_entropy(hidden, weight, None, top_k=k,
                                                 chunking=Chunking(3, vocab_chunk_size=vocab_chunk_size)),
                    head(hidden, None, top_k=k)):
            vals = out.top_k_log_probs
            assert (vals[:, 1:] <= vals[:, :-1]).all(), (k, vals)
            assert torch.equal(out.top_k_ids, want.indices), k
            torch.testing.assert_close(vals.double(), want.values, rtol=1e-5, atol=1e-5)
        out = log_probs_and_entropy(hidden @ weight.t(), None, top_k=k, chunking=3)
        assert torch.equal(out.top_k_ids, want.indices), k


# ----------------------------------------------------------------------------- another device


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _device_cases():
    """``(entry point, its arguments as a dict, the tensor arguments to move one at a time)``."""
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g), torch.randn(V)
    labels = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g)
    old, adv, ref = torch.full((B, T), -3.0), torch.randn(B, T, generator=g), torch.full((B, T), -2.5)
    mask = torch.ones(B, T, dtype=torch.int64)
    temperature = torch.full((B, T), 0.9)
    keep = torch.rand(B, T, V, generator=g) < 0.5
    at = torch.randint(0, V, (B, T, 2), generator=g)
    policy = dict(labels=labels, old_log_probs=old, advantages=adv, loss_mask=mask, ref_log_probs=ref,
                  loss=PolicyLoss(kl_coef=0.1), rollout_is_weights=torch.ones(B, T), temperature=temperature, keep=keep)
    cases = [
        (log_probs_and_entropy, dict(logits=logits, labels=labels, temperature=temperature, label_mask=mask.bool(),
                                     keep=keep)),
        (log_probs_and_entropy, dict(logits=logits, labels=labels, log_probs_at=at)),
        (linear_log_probs_and_entropy, dict(hidden=hidden, weight=weight, labels=labels, bias=bias,
                                            temperature=temperature, label_mask=mask.bool(), keep=keep)),
        (linear_log_probs_and_entropy, dict(hidden=hidden, weight=weight, labels=labels, log_probs_at=at)),
        (linear_policy_loss, dict(hidden=hidden, weight=weight, bias=bias, **policy)),
        (linear_policy_loss, dict(hidden=hidden, weight=weight, **dict(policy, rollout_is_weights=None),
                                  rollout_log_probs=old - 0.1)),
        (policy_loss_from_logits, dict(logits=logits, **policy)),
        (policy_loss_from_logits, dict(logits=logits, **dict(policy, rollout_is_weights=None),
                                       rollout_log_probs=old - 0.1)),
        (losses.policy_loss, dict(log_probs=old - 0.2, old_log_probs=old, advantages=adv, loss_mask=mask,
                                  rollout_is_weights=torch.ones(B, T))),
        (losses.policy_loss_grad, dict(log_probs=old - 0.2, old_log_probs=old, advantages=adv, loss_mask=mask)),
        (losses.rollout_correction, dict(log_probs=old - 0.2, rollout_log_probs=old, response_mask=mask,
                                         rollout_is="token")),
    ]
    first = {log_probs_and_entropy: "logits", linear_log_probs_and_entropy: "hidden", linear_policy_loss: "hidden",
             policy_loss_from_logits: "logits", losses.policy_loss: "log_probs", losses.policy_loss_grad: "log_probs",
             losses.rollout_correction: "log_probs"}
    for fn, kw in cases:
        for name, value in kw.items():
            if isinstance(value, torch.Tensor) and name != first[fn]:
                yield pytest.param(fn, kw, name, id=f"{fn.__name__}-{name}")


@pytest.mark.parametrize("fn,kw,name", list(_device_cases()))
def test_another_device_is_named_before_any_work(fn, kw, name):
    kw = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() and
              k in ("hidden", "weight", "bias", "logits", "log_probs") else v) for k, v in kw.items()}
    before = {k: v.detach().clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    moved = dict(kw, **{name: _meta(kw[name])})
    with pytest.raises(ValueError, match=name) as info:
        if "weight" in moved:  # the output layer's tensors travel in the OutputLayer, built in the call
            moved["layer"] = OutputLayer(moved.pop("weight"), moved.pop("bias", None))
        fn(**moved)
    assert "meta" in str(info.value)
    for k, v in before.items():
        if k != name:
            assert torch.equal(kw[k].detach(), v) and kw[k].grad is None, k


def test_the_module_names_another_device():
    head = ChunkedVocabParallelHead(torch.randn(V, H), 4)
    hidden, labels = torch.randn(B, T, H), torch.randint(0, V, (B, T))
    for kw, name in ((dict(temperature=_meta(torch.ones(B, T))), "temperature"),
                     (dict(label_mask=_meta(torch.ones(B, T, dtype=torch.bool))), "label_mask"),
                     (dict(log_probs_at=_meta(torch.zeros(B, T, 2, dtype=torch.int64))), "log_probs_at")):
        with pytest.raises(ValueError, match=name):
            head(hidden, labels, **kw)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        head.policy_loss(hidden, labels, torch.zeros(B, T), torch.ones(B, T), torch.ones(B, T, dtype=torch.bool),
                         rollout_is_weights=_meta(torch.ones(B, T)))


# ----------------------------------------------------------------------------- IcePop zeroing every weight


def test_an_icepop_window_that_zeroes_every_weight():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from verl.trainer.ppo import rollout_corr_helper
    g = torch.Generator().manual_seed(4)
    rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) - 1
    lp = rollout + 3.0  # every ratio e^3 = 20, outside the window [0.5, 2]
    mask = torch.ones(B, T, dtype=torch.int64)
    settings = dict(rollout_is="token", rollout_is_threshold="0.5_2.0")
    with pytest.raises(ZeroDivisionError):  # verl 0.9.1's own function (this page documents its failure)
        rollout_corr_helper.compute_rollout_correction_and_rejection_mask(lp, rollout, mask, **settings)
    w, out_mask, metrics = losses.rollout_correction(lp, rollout, mask, **settings)
    assert torch.equal(w, torch.zeros_like(w)) and torch.equal(out_mask.bool(), mask.bool())
    assert metrics["rollout_corr/rollout_is_eff_sample_size"].item() == 0.0
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values()), metrics
    # through the fused loss: the policy term is 0 with a zero gradient; the entropy bonus still trains
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    loss, m = linear_policy_loss(hidden, weight, labels, lp, torch.randn(B, T, generator=g, dtype=torch.float64),
                                 mask, rollout_log_probs=rollout, loss=PolicyLoss(options=settings))
    loss.backward()
    assert m["actor/pg_loss"].item() == 0.0 and torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_an_upstream_gradient_meets_the_transform_once():
    """``Tokens.scaled``, the one place an upstream gradient is multiplied by ``kz = logit_scale / t`` (the
    per-row coefficients, distillation's per-id gradients, a divergence's per-row scale): per row for a
    ``[rows]`` gradient, broadcast over the ids of a ``[rows, K]`` one, per-row temperatures included, against
    float64; the gradient itself where ``kz`` is 1, None for None."""
    from chunked_entropy._inputs import Tokens
    from chunked_entropy._stats import Transform

    n, k = 6, 3
    t = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3, 0.9], dtype=torch.float64)
    g, g_ids = torch.randn(n, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64)
    valid, target = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    tok = Tokens(torch.Size((n,)), valid, target, (1 / t)[:, None], Transform(softcap=30.0, logit_scale=0.25))
    torch.testing.assert_close(tok.scaled(g[1:4], 1, 4), g[1:4] * 0.25 / t[1:4], rtol=1e-15, atol=0)
    torch.testing.assert_close(tok.scaled(g_ids[2:5], 2, 5), g_ids[2:5] * (0.25 / t[2:5])[:, None], rtol=1e-15,
                               atol=0)
    assert tok.scaled(None, 0, n) is None
    co = tok.coefficients(0, n, g, g, g)
    torch.testing.assert_close(co.c, g * 0.25 / t, rtol=1e-15, atol=0)
    torch.testing.assert_close(co.a, 2 * g * 0.25 / t, rtol=1e-15, atol=0)
    plain = Tokens(torch.Size((n,)), valid, target, None)
    assert plain.scaled(g, 0, n) is g
    torch.testing.assert_close(Tokens(torch.Size((n,)), valid, target, 2.0).scaled(g_ids, 0, n), 2.0 * g_ids,
                               rtol=0, atol=0)
