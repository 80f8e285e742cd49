"""The fused losses under every ``loss_mode``: equal to "fused head, then ``losses.policy_loss``".

For each of verl's twelve names, in float64: the loss, every metric and the
gradients of hidden, weight and bias (the logits' for the twin from logits)
against the composition of :func:`~chunked_entropy.linear_log_probs_and_entropy`
and :mod:`chunked_entropy.losses` (itself tested against verl's installed
functions in ``test_losses_registry.py``), with the entropy bonus, a KL term,
rollout IS weights, vocabulary blocks, sampling replay's ``keep=`` and an
upstream gradient other than 1. The row-local modes (gspo, geo_mean) with
chunks that hold whole rows (the logits computed once, counted) and chunks
that do not. Then the rollout log-probs route, and TP 2 over gloo for a
token-local, a row-local (both chunkings) and a batch-level mode, and the
row-local path under sequence parallelism.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

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

aten = torch.ops.aten

B, T, H, V = 3, 6, 5, 17
OPTS = dict(clip_ratio_low=0.15, clip_ratio_high=0.28, dro_beta=0.2, clip_cov_ratio=0.3, clip_cov_lb=-5.0,
            clip_cov_ub=5.0, kl_cov_ratio=0.2, rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=2.0)


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    d = dict(hidden=torch.randn(B, T, H, generator=g, dtype=torch.float64),
             weight=torch.randn(V, H, generator=g, dtype=torch.float64),
             bias=torch.randn(V, generator=g, dtype=torch.float64),
             labels=torch.randint(0, V, (B, T), generator=g),
             adv=torch.randn(B, T, generator=g, dtype=torch.float64),
             ref=-torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 1,
             w=torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5,
             mask=torch.rand(B, T, generator=g) < 0.8)
    lp, _ = linear_log_probs_and_entropy(d["hidden"], OutputLayer(d["weight"], d["bias"]), d["labels"])
    d["old"] = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.7  # ratios inside and outside the clip
    d["mask"][1] = False  # an empty sequence
    return d


def _terms(d, kl):
    return dict(entropy_coeff=0.03, kl_coef=0.1 if kl else 0.0, kl_kind="low_var_kl", ref_log_probs=d["ref"] if kl
                else None)


def _composition(d, mode, *, path, agg, weights, kl, keep=None, up=1.7, temperature=0.8, opts=OPTS):
    leaves = {k: d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    if path == "logits":
        z = leaves["hidden"] @ leaves["weight"].t() + leaves["bias"]
        lp, ent = log_probs_and_entropy(z, d["labels"], keep=keep, temperature=temperature)
    else:
        lp, ent = linear_log_probs_and_entropy(leaves["hidden"], OutputLayer(leaves["weight"], leaves["bias"]),
                                               d["labels"], keep=keep, temperature=temperature)
    torch.manual_seed(11)
    pg, metrics = losses.policy_loss(lp, d["old"], d["adv"], d["mask"], PolicyLoss(mode, opts, aggregation=agg),
                                     rollout_is_weights=d["w"] if weights else None)
    ent_loss = losses.entropy_bonus(ent, d["mask"], agg)
    loss = pg - 0.03 * ent_loss
    metrics = dict(metrics, **{"actor/pg_loss": pg.detach(), "actor/entropy_loss": ent_loss.detach()})
    if kl:
        kl_loss = losses.agg_loss(losses.kl_penalty(lp, d["ref"], "low_var_kl"), d["mask"], agg)
        loss = loss + 0.1 * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    (loss * up).backward()
    return loss.detach(), metrics, {k: t.grad for k, t in leaves.items()}


def _fused(d, mode, *, path, agg, weights, kl, keep=None, up=1.7, temperature=0.8, chunk_size=4, opts=OPTS,
           vocab_chunk_size=None):
    leaves = {k: d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    terms = _terms(d, kl)
    ref_log_probs = terms.pop("ref_log_probs")
    common = dict(loss=policy_loss_of(loss_mode=mode, loss_agg_mode=agg, **terms, **opts),
                  rollout_is_weights=d["w"] if weights else None, keep=keep, temperature=temperature,
                  chunking=Chunking(chunk_size, vocab_chunk_size), ref_log_probs=ref_log_probs)
    torch.manual_seed(11)
    if path == "logits":
        z = leaves["hidden"] @ leaves["weight"].t() + leaves["bias"]
        loss, metrics = policy_loss_from_logits(z, d["labels"], d["old"], d["adv"], d["mask"], **common)
    else:
        loss, metrics = linear_policy_loss(leaves["hidden"], OutputLayer(leaves["weight"], leaves["bias"]), d["labels"],
                                           d["old"], d["adv"], d["mask"], **common)
    (loss * up).backward()
    return loss.detach(), metrics, {k: t.grad for k, t in leaves.items()}


def _same(fused, composed):
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = fused, composed
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    assert set(metrics) == set(ref_metrics), sorted(set(metrics) ^ set(ref_metrics))
    for k, v in ref_metrics.items():
        assert not metrics[k].requires_grad
        torch.testing.assert_close(metrics[k].double(), v.double(), rtol=1e-10, atol=1e-12, msg=k)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)


@pytest.mark.parametrize("mode", losses.LOSS_MODES)
@pytest.mark.parametrize("path,kw", [("head", {}), ("head", {"vocab_chunk_size": 6}), ("logits", {})],
                         ids=["head", "head_vocab_blocks", "logits"])
def test_every_mode_equals_the_composition(mode, path, kw):
    d = _data(1)
    for agg, weights, kl in (("token-mean", True, True), ("seq-mean-token-mean", False, False),
                             ("seq-mean-token-sum-norm", True, False)):
        _same(_fused(d, mode, path=path, agg=agg, weights=weights, kl=kl, **kw),
              _composition(d, mode, path="logits" if path == "logits" else "head", agg=agg, weights=weights, kl=kl))


@pytest.mark.parametrize("mode", ["cispo", "gspo", "clip_cov", "bypass_mode"])
def test_modes_with_sampling_replay_and_the_module(mode):
    d = _data(2)
    ids = torch.tensor([0, 3, 5, 7, 1, 2, 9, 11, 4])
    offsets = torch.tensor([0, 2, 2, 4] + [4] * (B * T - 5) + [7, 9])
    _same(_fused(d, mode, path="head", agg="token-mean", weights=True, kl=False, keep=(ids, offsets)),
          _composition(d, mode, path="head", agg="token-mean", weights=True, kl=False, keep=(ids, offsets)))
    head = ChunkedVocabParallelHead(OutputLayer(d["weight"].clone().requires_grad_(), d["bias"].clone()), 4)
    h = d["hidden"].clone().requires_grad_()
    torch.manual_seed(11)
    loss, _ = head.policy_loss(h, d["labels"], d["old"], d["adv"], d["mask"], loss=PolicyLoss(mode, OPTS))
    h2 = d["hidden"].clone().requires_grad_()
    lp, _ = linear_log_probs_and_entropy(h2, OutputLayer(d["weight"], d["bias"]), d["labels"])
    torch.manual_seed(11)
    ref, _ = losses.policy_loss(lp, d["old"], d["adv"], d["mask"], PolicyLoss(mode, OPTS))
    loss.backward()
    ref.backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-9, atol=1e-11)


class _LogitRows(TorchDispatchMode):
    """Counts the rows of ``[rows, V]`` logits that matmuls compute: the fused head's matmul passes of logits."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (aten.mm, aten.addmm) and out.dim() == 2 and out.shape[1] == V:
            self.rows += out.shape[0]
        return out


NO_REJECTION = dict(OPTS, rollout_rs=None, rollout_is="sequence")  # bypass_mode reads only its own rows then
# Rows of logits the head computes for B * T = 18 tokens, by hand: every chunk once, and once more every chunk
# of a group (the rows whose statistics the gradients read) but its last. Token-local: one chunk a group.
# Row-local: rows of 6 fit chunks of 6 and 12 (13 rounded down); chunks of 4 become 3, two to a row (18 + 9).
# Batch-level: one group of chunks 4,4,4,4,2 (18 + 16), 6,6,6 (18 + 12), 13,5 (18 + 13).
LOGIT_ROWS = {"token": {4: 18, 6: 18, 13: 18}, "row": {4: 27, 6: 18, 13: 18}, "batch": {4: 34, 6: 30, 13: 31}}


@pytest.mark.parametrize("mode", ["gspo", "geo_mean", "cispo", "kl_cov", "bypass_mode", "bypass_mode/sequence IS"])
@pytest.mark.parametrize("chunk_size", [4, 6, 13])
def test_row_local_modes_fill_the_logits_once_when_rows_fit_a_chunk(mode, chunk_size):
    """gspo, geo_mean, and bypass_mode without rejection, read only their own sequence's log-probs: with rows
    of T = 6 tokens and chunks of 6 or 13 (rounded down to 12), each chunk holds whole rows and the head
    computes the logits once (three matmul passes, as a token-local mode); with chunks of 4 (made 3) each
    row's first chunk is computed twice. A batch-level mode (kl_cov, bypass_mode with a rejection criterion)
    computes every chunk twice but the last. Equal to the composition in every case, with replay's kept
    sets too."""
    mode, opts = ("bypass_mode", NO_REJECTION) if mode == "bypass_mode/sequence IS" else (mode, OPTS)
    d = _data(7)
    ids = torch.tensor([0, 3, 5, 7, 1, 2, 9, 11, 4])
    offsets = torch.tensor([0, 2, 2, 4] + [4] * (B * T - 5) + [7, 9])
    for path in ("head", "logits"):
        for keep in (None, (ids, offsets)):
            with _LogitRows() as counted:
                fused = _fused(d, mode, path=path, agg="seq-mean-token-mean", weights=True, kl=True, keep=keep,
                               chunk_size=chunk_size, opts=opts)
            _same(fused, _composition(d, mode, path="logits" if path == "logits" else "head",
                                      agg="seq-mean-token-mean", weights=True, kl=True, keep=keep, opts=opts))
            if path == "head":
                kind = "token" if mode == "cispo" else "row" if mode in ("gspo", "geo_mean") or opts is NO_REJECTION \
                    else "batch"
                assert counted.rows == LOGIT_ROWS[kind][chunk_size], (kind, counted.rows)


def test_rollout_log_probs_give_the_weights_and_the_rejection_mask():
    d = _data(3)
    g = torch.Generator().manual_seed(4)
    rollout = d["old"] + torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5
    corr = dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")
    w, mask, _ = losses.rollout_correction(d["old"], rollout, d["mask"], **corr)
    assert (mask != d["mask"]).any()  # some tokens rejected
    h = d["hidden"].clone().requires_grad_()
    loss, _ = linear_policy_loss(h, OutputLayer(d["weight"], d["bias"]), d["labels"], d["old"], d["adv"], d["mask"],
                                 loss=PolicyLoss("vanilla", corr, entropy_coeff=0.02), rollout_log_probs=rollout)
    h2 = d["hidden"].clone().requires_grad_()
    lp, ent = linear_log_probs_and_entropy(h2, OutputLayer(d["weight"], d["bias"]), d["labels"])
    pg, _ = losses.policy_loss(lp, d["old"], d["adv"], mask, rollout_is_weights=w)
    ref = pg - 0.02 * losses.entropy_bonus(ent, mask)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="not both"):
        linear_policy_loss(h, d["weight"], d["labels"], d["old"], d["adv"], d["mask"], rollout_log_probs=rollout,
                           rollout_is_weights=w)


def test_bad_options_are_named_before_any_work():
    d = _data(5)
    h = d["hidden"].clone().requires_grad_()
    args = (h, d["weight"], d["labels"], d["old"], d["adv"], d["mask"])
    # each call's keywords, built in the call (the PolicyLoss checks its fields on construction)
    for kw, exc, name in ((lambda: dict(loss=PolicyLoss("grpo")), ValueError, "loss_mode"),
                          (lambda: dict(loss=PolicyLoss("dro")), ValueError, "dro_beta"),
                          (lambda: dict(loss=PolicyLoss(options={"tau_pos": -1.0})), ValueError, "tau_pos"),
                          (lambda: dict(rollout_is_weights=d["w"][:2]), ValueError, "rollout_is_weights"),
                          (lambda: dict(loss=PolicyLoss(options={"clip_ratoi": 0.3})), TypeError, "clip_ratoi")):
        with pytest.raises(exc, match=name):
            linear_policy_loss(*args, **kw())
        with pytest.raises(exc, match=name):
            policy_loss_from_logits(h @ d["weight"].t(), *args[2:], **kw())
    with pytest.raises(ValueError, match="bypass_mode' needs at least one valid token"):
        linear_policy_loss(*args[:5], torch.zeros_like(d["mask"]), loss=PolicyLoss("bypass_mode"))
    assert h.grad is None


def _tp_worker(rank, world):
    group = dist.group.WORLD
    d = _data(6)
    v_local = V // world + 1
    pad = v_local * world - V  # vocabulary padding: columns that never win, as Megatron pads
    weight = torch.cat([d["weight"], torch.zeros(pad, H, dtype=torch.float64)])
    bias = torch.cat([d["bias"], torch.full((pad,), -1e4, dtype=torch.float64)])
    shard = slice(rank * v_local, (rank + 1) * v_local)
    # gspo with chunks of 4 (a statistics pass) and of 12 (whole rows: the logits once)
    for mode, chunk_size in (("sapo", 4), ("gspo", 4), ("gspo", 12), ("kl_cov", 4)):
        h = d["hidden"].clone().requires_grad_()
        w = weight[shard].clone().requires_grad_()
        loss, metrics = linear_policy_loss(h, OutputLayer(w, bias[shard], process_group=group), d["labels"], d["old"],
                                           d["adv"], d["mask"], loss=PolicyLoss(mode, OPTS, entropy_coeff=0.03),
                                           chunking=chunk_size, rollout_is_weights=d["w"])
        (loss * 1.7).backward()
        h2, w2 = d["hidden"].clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = linear_log_probs_and_entropy(h2, OutputLayer(w2, bias), d["labels"])
        pg, ref_metrics = losses.policy_loss(lp, d["old"], d["adv"], d["mask"], PolicyLoss(mode, OPTS),
                                             rollout_is_weights=d["w"])
        ref = pg - 0.03 * losses.entropy_bonus(ent, d["mask"])
        (ref * 1.7).backward()
        torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
        for k, v in ref_metrics.items():
            torch.testing.assert_close(metrics[k].double(), v.double(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(h.grad, h2.grad, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(w.grad, w2.grad[shard], rtol=1e-9, atol=1e-11)
    # sequence parallelism: hidden is this rank's [T/P, B, H] slice; gspo's rows (T = 6) fit a chunk of 6
    rows = slice(rank * T // world, (rank + 1) * T // world)
    h = d["hidden"].transpose(0, 1)[rows].clone().requires_grad_()
    w = weight[shard].clone().requires_grad_()
    loss, _ = linear_policy_loss(h, OutputLayer(w, bias[shard], process_group=group, sequence_parallel=True),
                                 d["labels"], d["old"], d["adv"], d["mask"],
                                 loss=PolicyLoss("gspo", OPTS, entropy_coeff=0.03), chunking=6)
    (loss * 1.7).backward()
    h2, w2 = d["hidden"].clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_log_probs_and_entropy(h2, OutputLayer(w2, bias), d["labels"])
    pg, _ = losses.policy_loss(lp, d["old"], d["adv"], d["mask"], PolicyLoss("gspo", OPTS))
    ((pg - 0.03 * losses.entropy_bonus(ent, d["mask"])) * 1.7).backward()
    torch.testing.assert_close(h.grad, h2.grad.transpose(0, 1)[rows], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(w.grad, w2.grad[shard], rtol=1e-9, atol=1e-11)
    # clip_cov draws its tokens at random: ranks whose generators differ are named
    torch.manual_seed(rank)
    with pytest.raises(ValueError, match="random generator's state"):
        linear_policy_loss(d["hidden"], OutputLayer(weight[shard], process_group=group), d["labels"], d["old"],
                           d["adv"], d["mask"], loss=PolicyLoss("clip_cov"))


def test_tensor_parallel():
    run_distributed(_tp_worker, 2, timeout_s=120)


def test_grouping_of_chunks_by_hand():
    from chunked_entropy._loop import _grouping

    # (tokens, span, chunk_size) -> (chunk walked, tokens of a group)
    assert _grouping(18, 1, 4) == (4, 4)  # token-local: every chunk its own group
    assert _grouping(18, 6, 13) == (12, 12)  # two rows to a chunk
    assert _grouping(18, 6, 4) == (3, 6)  # a row in two chunks of 3
    assert _grouping(3000, 1500, 512) == (500, 1500)
    assert _grouping(4096, 1024, 512) == (512, 1024)
    assert _grouping(21, 7, 4) == (4, 21)  # 7 has no divisor of at least 2: the batch is one group
    assert _grouping(18, None, 4) == (4, 18)


@pytest.mark.parametrize("mode", ["gspo", "geo_mean"])
@pytest.mark.parametrize("t,chunk_size", [(7, 4), (8, 3), (8, 8)])
def test_rows_longer_than_a_chunk(mode, t, chunk_size):
    """Rows of 7 tokens in chunks of 4 (no divisor: one group of the batch), of 8 in chunks of 3 (made 2:
    four to a row) and of 8 in 8, against the composition in float64, with the entropy bonus."""
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(2, t, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (2, t), generator=g)
    adv = torch.randn(2, t, generator=g, dtype=torch.float64)
    mask = torch.rand(2, t, generator=g) < 0.8
    with torch.no_grad():
        lp, _ = linear_log_probs_and_entropy(hidden, weight, labels)
    old = lp + torch.randn(2, t, generator=g, dtype=torch.float64) * 0.5
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = linear_policy_loss(h, w, labels, old, adv, mask, loss=PolicyLoss(mode, OPTS, entropy_coeff=0.03),
                                       chunking=chunk_size)
    (loss * 1.3).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_log_probs_and_entropy(h2, w2, labels)
    pg, ref_metrics = losses.policy_loss(lp, old, adv, mask, PolicyLoss(mode, OPTS))
    ref = pg - 0.03 * losses.entropy_bonus(ent, mask)
    (ref * 1.3).backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
    for k, v in ref_metrics.items():
        torch.testing.assert_close(metrics[k].double(), v.double(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-9, atol=1e-11)
