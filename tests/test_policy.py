"""The fused policy loss against the composition it replaces, in float64.

Reference: ``linear_log_probs_and_entropy`` (resp. ``log_probs_and_entropy``)
on float64 inputs, then ``losses.policy_loss``, ``losses.entropy_bonus`` and
``losses.agg_loss(losses.kl_penalty(...))``, differentiated by autograd. The
fused loss runs in float32 (and in float64 for an exactness check), with a
random scalar upstream gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

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
from tests.helpers import policy_loss_of, run_distributed

B, T, H, V = 3, 9, 8, 37


def _data(seed=0, dtype=torch.float32, ties=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[1] = False  # a sequence with no tokens
    mask[2, :3] = True
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 1
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 1
    labels[1, 0] = 10**6  # masked: never range-checked
    adv[0, ~mask[0]] = float("nan")  # padding: must not reach any gradient
    if ties:  # the first PPO iteration: old == current, ratio exactly 1
        lp, _ = linear_log_probs_and_entropy(hidden, OutputLayer(weight, bias), labels.clamp(max=V - 1))
        old = lp.detach()
    up = float(torch.rand((), generator=g)) + 0.5
    return dict(hidden=hidden, weight=weight, bias=bias, labels=labels, mask=mask, old=old, adv=adv, ref=ref, up=up)


def _composition(d, *, path, temperature, opts, softcap=None):
    """The float64 reference: outputs, then the loss utilities; autograd for the gradients."""
    leaves = {k: d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    labels = d["labels"].clamp(max=V - 1)
    if path == "head":
        lp, ent = linear_log_probs_and_entropy(leaves["hidden"],
                                               OutputLayer(leaves["weight"], leaves["bias"], softcap=softcap), labels,
                                               temperature=temperature)
    else:
        logits = leaves["hidden"] @ leaves["weight"].T + leaves["bias"]
        lp, ent = log_probs_and_entropy(logits, labels, temperature=temperature, layer=OutputLayer(softcap=softcap))
    mode = opts.get("loss_agg_mode", "token-mean")
    lsf = opts.get("loss_scale_factor")
    options = {k: v for k, v in opts.items() if k.startswith("clip")}
    pg, metrics = losses.policy_loss(lp, d["old"], d["adv"], d["mask"],
                                     PolicyLoss(options=options, aggregation=losses.Aggregation(mode, lsf)))
    loss = pg - opts.get("entropy_coeff", 0.0) * losses.entropy_bonus(ent, d["mask"], mode, loss_scale_factor=lsf)
    if opts.get("kl_coef"):
        kl = losses.agg_loss(losses.kl_penalty(lp, d["ref"], opts["kl_kind"]), d["mask"], mode, loss_scale_factor=lsf)
        loss = loss + opts["kl_coef"] * kl
        metrics["kl_loss"] = kl
    (loss * d["up"]).backward()
    metrics["actor/entropy_loss"] = losses.entropy_bonus(ent.detach(), d["mask"], mode, loss_scale_factor=lsf)
    return loss.detach(), metrics, {k: t.grad for k, t in leaves.items()}


def _fused(d, *, path, temperature, opts, dtype, softcap=None, chunking=None):
    leaves = {k: d[k].to(dtype).clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    common = dict(ref_log_probs=d["ref"] if opts.get("kl_coef") else None, temperature=temperature,
                  loss=policy_loss_of(**opts), chunking=chunking)
    if path == "head":
        layer = OutputLayer(leaves["weight"], leaves["bias"], softcap=softcap)
        loss, metrics = linear_policy_loss(leaves["hidden"], layer, d["labels"], d["old"], d["adv"], d["mask"],
                                           **common)
    else:
        logits = leaves["hidden"] @ leaves["weight"].T + leaves["bias"]
        loss, metrics = policy_loss_from_logits(logits, d["labels"], d["old"], d["adv"], d["mask"],
                                                layer=OutputLayer(softcap=softcap), **common)
    (loss * d["up"]).backward()
    return loss.detach(), metrics, {k: t.grad for k, t in leaves.items()}


CASES = [
    dict(loss_agg_mode="token-mean"),
    dict(loss_agg_mode="token-mean", entropy_coeff=0.01, kl_coef=0.1, kl_kind="low_var_kl", clip_ratio_c=3.0),
    dict(loss_agg_mode="seq-mean-token-sum", entropy_coeff=0.02, kl_coef=0.05, kl_kind="low_var_kl+"),
    dict(loss_agg_mode="seq-mean-token-mean", kl_coef=0.2, kl_kind="k2", clip_ratio_high=0.28),
    dict(loss_agg_mode="seq-mean-token-sum-norm", entropy_coeff=0.01, kl_coef=0.1, kl_kind="abs",
         clip_ratio_c=2.0, loss_scale_factor=16.0),
]


@pytest.mark.parametrize("opts", CASES, ids=lambda o: o["loss_agg_mode"] + ("+" if len(o) > 1 else ""))
@pytest.mark.parametrize("path,kw", [("head", {}), ("head", {"vocab_chunk_size": 7}), ("logits", {})],
                         ids=["head", "head_vocab_blocks", "logits"])
@pytest.mark.parametrize("temperature", [1.0, "per_sample"])
def test_matches_the_composition_float32(opts, path, kw, temperature):
    d = _data(seed=len(opts))
    t = torch.tensor([[0.7], [1.0], [1.3]], dtype=torch.float64) if temperature == "per_sample" else temperature
    ref_loss, ref_metrics, ref_grads = _composition(d, path=path, temperature=t, opts=opts)
    loss, metrics, grads = _fused(d, path=path, temperature=t, opts=opts, dtype=torch.float32,
                                  chunking=Chunking(5, **kw))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy_loss") + (
            ("kl_loss",) if opts.get("kl_coef") else ()):
        assert not metrics[k].requires_grad
        torch.testing.assert_close(metrics[k].double(), ref_metrics[k].detach().double(), rtol=1e-5, atol=1e-5)
    for k, ref in ref_grads.items():
        torch.testing.assert_close(grads[k].double(), ref, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        assert torch.isfinite(grads[k]).all()


@pytest.mark.parametrize("path", ["head", "logits"])
@pytest.mark.parametrize("ties", [False, True])
def test_float64_equals_the_composition_to_rounding(path, ties):
    """In float64 the two computations differ only by rounding: ties (ratio 1) and clamps included."""
    d = _data(seed=7, ties=ties)
    opts = CASES[1]
    ref_loss, _, ref_grads = _composition(d, path=path, temperature=0.8, opts=opts, softcap=3.0)
    loss, _, grads = _fused(d, path=path, temperature=0.8, opts=opts, dtype=torch.float64, softcap=3.0, chunking=4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for k, ref in ref_grads.items():
        torch.testing.assert_close(grads[k], ref, rtol=1e-8, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")


def test_head_method_is_the_function():
    d = _data(seed=3)
    head = ChunkedVocabParallelHead(OutputLayer(d["weight"].float(), d["bias"].float(), softcap=20.0), 4)
    a, _ = head.policy_loss(d["hidden"].float(), d["labels"], d["old"], d["adv"], d["mask"],
                            loss=PolicyLoss(entropy_coeff=0.01))
    b, _ = linear_policy_loss(d["hidden"].float(), OutputLayer(d["weight"].float(), d["bias"].float(), softcap=20.0),
                              d["labels"], d["old"], d["adv"], d["mask"], loss=PolicyLoss(entropy_coeff=0.01),
                              chunking=4)
    assert torch.equal(a, b)


def test_backward_semantics_like_autograd(monkeypatch):
    d = _data(seed=4)
    hidden = d["hidden"].float().requires_grad_()
    weight = d["weight"].float().requires_grad_()
    loss, _ = linear_policy_loss(hidden, weight, d["labels"], d["old"], d["adv"], d["mask"],
                                 loss=PolicyLoss(entropy_coeff=0.01))
    (loss / 4).backward()  # gradient accumulation over 4 micro-batches
    g1 = hidden.grad.clone()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    loss2, _ = linear_policy_loss(hidden, weight, d["labels"], d["old"], d["adv"], d["mask"],
                                  loss=PolicyLoss(entropy_coeff=0.01))
    loss2.backward(retain_graph=True)
    torch.testing.assert_close(hidden.grad, g1 * 5)  # 1/4 + 1
    loss2.backward()
    torch.testing.assert_close(hidden.grad, g1 * 9)

    # under no_grad: loss and metrics only, no gradient pass at all
    import chunked_entropy.policy as policy

    called = []
    monkeypatch.setattr(policy, "loss_grad_blocks", lambda *a, **k: called.append(1))
    with torch.no_grad():
        nograd, metrics = linear_policy_loss(hidden, weight, d["labels"], d["old"], d["adv"], d["mask"],
                                             loss=PolicyLoss(entropy_coeff=0.01))
    assert called == [] and not nograd.requires_grad
    torch.testing.assert_close(nograd, loss.detach())


def test_main_grad_accumulates_scaled():
    d = _data(seed=5)
    weight = d["weight"].float().requires_grad_()
    weight.main_grad = torch.zeros_like(weight)
    plain = d["weight"].float().requires_grad_()
    for w in (weight, plain):
        loss, _ = linear_policy_loss(d["hidden"].float(), w, d["labels"], d["old"], d["adv"], d["mask"])
        (loss * 0.5).backward()
    torch.testing.assert_close(weight.main_grad, plain.grad)


def test_bad_input_names_the_argument():
    d = _data()
    args = (d["hidden"].float(), d["weight"].float(), d["labels"], d["old"], d["adv"], d["mask"])
    with pytest.raises(ValueError, match="kl_coef != 0 needs ref_log_probs"):
        linear_policy_loss(*args, loss=PolicyLoss(kl_coef=0.1))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        linear_policy_loss(*args, loss=PolicyLoss(aggregation="mean"))
    with pytest.raises(ValueError, match="advantages"):
        linear_policy_loss(*args[:4], d["adv"][:, :3], d["mask"])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        linear_policy_loss(*args, loss=PolicyLoss(options={"clip_ratio_c": 0.5}))
    with pytest.raises(ValueError, match="kl_kind"):
        policy_loss_from_logits(torch.zeros(B, T, V), *args[2:], loss=PolicyLoss(kl_kind="k4"))



def test_label_minus_100_where_loss_mask_counts_is_refused():
    """-100 is no "no label" id for the policy losses: the loss_mask alone says which tokens count, so a -100
    label on a counted token is an out-of-range id (it gave a log-prob of 0 there, silently); where the
    mask is 0 any label passes."""
    d = _data()
    labels = d["labels"].clone()
    labels[2, 0] = -100  # mask[2, :3] is True
    masked = d["labels"].clone()
    masked[1, 0] = -100  # sequence 1 is fully masked
    args = (d["old"], d["adv"], d["mask"])
    h, w = d["hidden"].float(), d["weight"].float()
    for call in (lambda lab: linear_policy_loss(h, w, lab, *args),
                 lambda lab: policy_loss_from_logits(h @ w.T, lab, *args)):
        with pytest.raises(ValueError, match=r"labels must be vocabulary ids in \[0, 37\).*found -100"):
            call(labels)
        torch.testing.assert_close(call(masked)[0], call(d["labels"])[0], rtol=0, atol=0)

def _parallel(rank, world):
    """TP (and SP for the head): every rank holds a vocabulary shard; the loss and gradients are the full one's."""
    group = dist.group.WORLD
    d = _data(seed=11)
    g = torch.Generator().manual_seed(12)  # the same data on every rank
    d["weight"] = torch.cat([d["weight"], torch.randn(1, H, generator=g, dtype=torch.float64)])  # V = 38
    d["bias"] = torch.cat([d["bias"], torch.zeros(1, dtype=torch.float64)])
    for k in ("hidden", "labels", "mask", "old", "adv", "ref"):  # T = 8: slices of equal length under SP
        d[k] = d[k][:, :8]
    T = 8
    vl = d["weight"].shape[0] // world
    opts = CASES[1]
    ref_loss, _, ref = _composition_full(d, opts)
    for sp in (False, True):
        hidden_full = d["hidden"].float()
        hidden = (hidden_full.transpose(0, 1)[rank * T // world: (rank + 1) * T // world] if sp else hidden_full)
        hidden = hidden.clone().requires_grad_()
        weight = d["weight"][rank * vl:(rank + 1) * vl].float().requires_grad_()
        bias = d["bias"][rank * vl:(rank + 1) * vl].float().requires_grad_()
        loss, _ = linear_policy_loss(hidden, OutputLayer(weight, bias, process_group=group, sequence_parallel=sp),
                                     d["labels"], d["old"], d["adv"], d["mask"], chunking=4, ref_log_probs=d["ref"],
                                     temperature=0.9, loss=policy_loss_of(**opts))
        (loss * d["up"]).backward()
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
        g_hidden = ref["hidden"].transpose(0, 1)[rank * T // world: (rank + 1) * T // world] if sp else ref["hidden"]
        torch.testing.assert_close(hidden.grad.double(), g_hidden, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(weight.grad.double(), ref["weight"][rank * vl:(rank + 1) * vl], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(bias.grad.double(), ref["bias"][rank * vl:(rank + 1) * vl], rtol=1e-4, atol=1e-6)
    # the logits twin on a vocabulary shard
    logits = (d["hidden"] @ d["weight"].T + d["bias"])[..., rank * vl:(rank + 1) * vl].float().requires_grad_()
    loss, _ = policy_loss_from_logits(logits, d["labels"], d["old"], d["adv"], d["mask"], ref_log_probs=d["ref"],
                                      layer=OutputLayer(process_group=group), chunking=4, temperature=0.9,
                                      loss=policy_loss_of(**opts))
    (loss * d["up"]).backward()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    g_logits = ref["logits"][..., rank * vl:(rank + 1) * vl]
    torch.testing.assert_close(logits.grad.double(), g_logits, rtol=1e-4, atol=1e-6)


def _composition_full(d, opts):
    leaves = {k: d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    logits = leaves["hidden"] @ leaves["weight"].T + leaves["bias"]
    logits.retain_grad()
    lp, ent = log_probs_and_entropy(logits, d["labels"].clamp(max=V - 1), temperature=0.9)
    mode = opts["loss_agg_mode"]
    pg, _ = losses.policy_loss(lp, d["old"], d["adv"], d["mask"],
                               PolicyLoss(options={"clip_ratio_c": opts["clip_ratio_c"]}, aggregation=mode))
    loss = (pg - opts["entropy_coeff"] * losses.entropy_bonus(ent, d["mask"], mode)
            + opts["kl_coef"] * losses.agg_loss(losses.kl_penalty(lp, d["ref"], opts["kl_kind"]), d["mask"], mode))
    (loss * d["up"]).backward()
    return loss.detach(), None, {**{k: t.grad for k, t in leaves.items()}, "logits": logits.grad}


def test_tensor_and_sequence_parallel():
    run_distributed(_parallel, 2)


@pytest.mark.parametrize("path", ["head", "logits"])
def test_gradients_handed_out_are_the_callers_own(path):
    """An in-place edit of a result of autograd.grad(retain_graph=True) must not change a second backward."""
    d = _data(seed=8)
    hidden, weight = d["hidden"].float().requires_grad_(), d["weight"].float()
    if path == "head":
        loss, _ = linear_policy_loss(hidden, weight, d["labels"], d["old"], d["adv"], d["mask"],
                                     loss=PolicyLoss(entropy_coeff=0.01))
    else:  # the gradient of the logits themselves is the one the loss stores
        hidden = (d["hidden"].float() @ weight.t()).requires_grad_()
        loss, _ = policy_loss_from_logits(hidden, d["labels"], d["old"], d["adv"], d["mask"],
                                          loss=PolicyLoss(entropy_coeff=0.01))
    first = torch.autograd.grad(loss, hidden, retain_graph=True)[0]  # upstream 1: the stored tensor, if shared
    want = first.clone()
    first.mul_(0).add_(7)  # the caller owns it
    second = torch.autograd.grad(loss * 0.5, hidden, retain_graph=True)[0]
    torch.testing.assert_close(second, want * 0.5)
    second.zero_()
    third = torch.autograd.grad(loss, hidden)[0]  # the last backward: the stored gradient itself
    torch.testing.assert_close(third, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("budget", [1 << 30, 1], ids=["three_passes", "four_passes"])
def test_a_scaled_half_precision_loss_rounds_its_gradient_once(dtype, retain, budget):
    """The fused loss stores its half-precision gradients in forward; ``(loss / 3).backward()`` scaled them by
    the upstream gradient rounded to half precision first, a bias of up to 2**-9 on every entry alike. Scaling
    a loss by ``c`` now scales its gradients by ``c`` in float32 with one rounding (with the graph kept, too).
    The three-pass walk (``Chunking.max_working_bytes`` holds its float32 accumulator) stores the weight's
    gradient as that float32 sum, rounded once after the scaling: ``main_grad`` receives the sum itself."""
    g = torch.Generator().manual_seed(0)
    b, t, h, v = 2, 5, 16, 64
    hidden = torch.randn(b, t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    old, adv = torch.randn(b, t, generator=g) * 0.1 - 3.0, torch.randn(b, t, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    grads = {}
    for c in (1.0, 1.0 / 3.0, "main_grad"):
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        if c == "main_grad":
            leaves[1].main_grad = torch.zeros(v, h)
        loss, _ = linear_policy_loss(*leaves, labels, old, adv, mask, chunking=Chunking(max_working_bytes=budget))
        (loss * (1.0 if c == "main_grad" else c)).backward(retain_graph=retain)
        grads[c] = [x.grad for x in leaves] if c != "main_grad" else [None, leaves[1].main_grad]
    if budget == 1 << 30:  # the weight's: the float32 sum, scaled, rounded once
        grads[1.0][1] = grads["main_grad"][1]
    for one, third in zip(grads[1.0], grads[1.0 / 3.0], strict=True):
        assert third.dtype == dtype
        upstream = torch.tensor(1.0 / 3.0, dtype=torch.float32)  # what (loss * c).backward() hands over
        torch.testing.assert_close(third, (one.float() * upstream).to(dtype), rtol=0, atol=0)
