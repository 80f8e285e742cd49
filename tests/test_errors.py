"""Bad input to log_probs_and_entropy: a ValueError/TypeError naming the argument, before any work.

"Before any work" is checked directly: no chunk statistic is computed, nothing
the caller passed is written (bitwise and version counter), and no graph is built.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import chunked_entropy
from chunked_entropy import Chunking, OutputLayer, PolicyLoss, log_probs_and_entropy
from chunked_entropy.losses import Aggregation

N, V = 6, 10


def _good():
    g = torch.Generator().manual_seed(0)
    return dict(
        logits=torch.randn(2, 3, V, generator=g).requires_grad_(True),
        labels=torch.randint(0, V, (2, 3), generator=g),
    )


BAD = [
    # (description, overrides, expected exception, argument named in the message)
    ("logits a list", dict(logits=[[0.0] * V]), TypeError, "logits"),
    ("logits int", dict(logits=torch.zeros(2, 3, V, dtype=torch.int64)), TypeError, "logits"),
    ("logits bool", dict(logits=torch.zeros(2, 3, V, dtype=torch.bool)), TypeError, "logits"),
    ("logits complex", dict(logits=torch.zeros(2, 3, V, dtype=torch.complex64)), TypeError, "logits"),
    ("logits 0-d", dict(logits=torch.tensor(1.0), labels=torch.tensor(0)), ValueError, "logits"),
    ("logits empty vocab", dict(logits=torch.zeros(2, 3, 0)), ValueError, "logits"),
    ("labels None", dict(labels=None), TypeError, "labels"),
    ("labels a list", dict(labels=[[1, 2, 3], [4, 5, 6]]), TypeError, "labels"),
    ("labels float", dict(labels=torch.zeros(2, 3)), TypeError, "labels"),
    ("labels bool", dict(labels=torch.zeros(2, 3, dtype=torch.bool)), TypeError, "labels"),
    ("labels shape", dict(labels=torch.zeros(3, 2, dtype=torch.long)), ValueError, "labels"),
    ("labels flat", dict(labels=torch.zeros(6, dtype=torch.long)), ValueError, "labels"),
    ("labels extra dim", dict(labels=torch.zeros(2, 3, 1, dtype=torch.long)), ValueError, "labels"),
    ("labels == V", dict(labels=torch.tensor([[0, 1, 2], [3, 4, V]])), ValueError, "labels"),
    ("labels -1", dict(labels=torch.tensor([[0, -1, 2], [3, 4, 5]])), ValueError, "labels"),
    ("labels huge", dict(labels=torch.tensor([[0, 1, 2], [3, 4, 2**40]])), ValueError, "labels"),
    ("labels meta device", dict(labels=torch.zeros(2, 3, dtype=torch.long, device="meta")), ValueError, "labels"),
    ("chunk_size 0", dict(chunk_size=0), ValueError, "chunk_size"),
    ("chunk_size -3", dict(chunk_size=-3), ValueError, "chunk_size"),
    ("chunk_size float", dict(chunk_size=2.5), (ValueError, TypeError), "chunk_size"),
    ("chunk_size bool", dict(chunk_size=True), (ValueError, TypeError), "chunk_size"),
    ("chunk_size None", dict(chunk_size=None), (ValueError, TypeError), "chunk_size"),
    ("chunk_size str", dict(chunk_size="4"), (ValueError, TypeError), "chunk_size"),
    ("temperature 0", dict(temperature=0.0), ValueError, "temperature"),
    ("temperature negative", dict(temperature=-1.0), ValueError, "temperature"),
    ("temperature nan", dict(temperature=math.nan), ValueError, "temperature"),
    ("temperature inf", dict(temperature=math.inf), ValueError, "temperature"),
    ("temperature str", dict(temperature="hot"), TypeError, "temperature"),
    ("temperature None", dict(temperature=None), TypeError, "temperature"),
    ("temperature bool", dict(temperature=True), TypeError, "temperature"),
    ("temperature int tensor", dict(temperature=torch.tensor(2)), TypeError, "temperature"),
    ("temperature tensor 0", dict(temperature=torch.tensor([[1.0], [0.0]])), ValueError, "temperature"),
    ("temperature tensor neg", dict(temperature=torch.full((2, 3), -0.5)), ValueError, "temperature"),
    ("temperature tensor nan", dict(temperature=torch.tensor([1.0, math.nan, 1.0])), ValueError, "temperature"),
    ("temperature tensor inf", dict(temperature=torch.tensor(math.inf)), ValueError, "temperature"),
    ("temperature tiny", dict(temperature=1e-39), ValueError, "temperature"),  # 1/t overflows float32
    ("temperature tensor tiny", dict(temperature=torch.tensor([1.0, 1e-39, 1.0])), ValueError, "temperature"),
    ("temperature shape", dict(temperature=torch.ones(2)), ValueError, "temperature"),
    ("temperature too many dims", dict(temperature=torch.ones(4, 2, 3)), ValueError, "temperature"),
    ("label_mask list", dict(label_mask=[[True] * 3] * 2), TypeError, "label_mask"),
    ("label_mask shape", dict(label_mask=torch.ones(3, 2, dtype=torch.bool)), ValueError, "label_mask"),
    ("process_group without init", dict(process_group=object()), ValueError, "process_group"),
    ("label_mask float", dict(label_mask=torch.ones(2, 3)), TypeError, "label_mask"),
    ("compute_entropy str", dict(compute_entropy="no"), TypeError, "compute_entropy"),
    ("compute_entropy int", dict(compute_entropy=0), TypeError, "compute_entropy"),
    ("compute_sum_pi_squared str", dict(compute_sum_pi_squared="yes"), TypeError, "compute_sum_pi_squared"),
    ("softcap 0", dict(softcap=0.0), ValueError, "softcap"),
    ("logit_scale negative", dict(logit_scale=-2.0), ValueError, "logit_scale"),
    ("softcap numpy bool", dict(softcap=np.bool_(True)), ValueError, "softcap"),
    ("ignore_index None", dict(ignore_index=None), TypeError, "ignore_index"),
    ("ignore_index True", dict(ignore_index=True), TypeError, "ignore_index"),  # would ignore label 1
    ("ignore_index float", dict(ignore_index=-100.0), TypeError, "ignore_index"),
    # each value passes its own check; their ratio overflows float32 (gave NaN, or an internal error compiled)
    ("softcap / temperature overflows", dict(softcap=1e30, temperature=1e-10), ValueError, "softcap / temperature"),
    ("logit_scale / temperature overflows", dict(logit_scale=1e30, temperature=1e-10), ValueError,
     "logit_scale / temperature"),
    ("softcap / per-row temperature overflows", dict(softcap=1e30, temperature=torch.full((2, 3), 1e-10)),
     ValueError, "softcap / temperature"),
    ("logit_scale / softcap overflows", dict(logit_scale=1e30, softcap=1e-10), ValueError, "logit_scale / softcap"),
    ("1 / softcap overflows", dict(softcap=1e-40), ValueError, "1 / softcap"),  # gave NaN log-probs
    ("ignore_index beyond int64", dict(ignore_index=2**70), ValueError, "ignore_index"),  # an OverflowError
    ("logits sparse", dict(logits=torch.zeros(2, 3, V).to_sparse()), TypeError, "logits must be a dense"),
    ("labels sparse", dict(labels=torch.zeros(2, 3, dtype=torch.long).to_sparse()), TypeError,
     "labels must be a dense"),
    ("label_mask sparse", dict(label_mask=torch.ones(2, 3, dtype=torch.bool).to_sparse()), TypeError,
     "label_mask must be a dense"),
    ("temperature sparse", dict(temperature=torch.ones(2, 3).to_sparse()), TypeError, "temperature must be a dense"),
]


@pytest.mark.parametrize("desc,over,exc,name", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_naming_the_argument_before_any_work(desc, over, exc, name, monkeypatch):
    if "process_group" in over:
        assert not torch.distributed.is_initialized()  # tests spawn their groups in subprocesses
    args = {**_good(), **over}
    logits, labels = args.pop("logits"), args.pop("labels")
    # the settings travel in the option objects, built (and checked) in the call
    layer = {k: args.pop(k) for k in ("softcap", "logit_scale", "process_group") if k in args}
    chunking = {k: args.pop(k) for k in ("chunk_size",) if k in args}
    tensors = [t for t in [logits, labels, *args.values()]
               if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.layout == torch.strided]
    snaps = [(t, t.detach().clone(), t._version) for t in tensors]

    work = []
    real = chunked_entropy._stats.block_stats
    monkeypatch.setattr(chunked_entropy._stats, "block_stats", lambda *a, **k: work.append(1) or real(*a, **k))

    with pytest.raises(exc, match=name) as info:
        log_probs_and_entropy(logits, labels, layer=OutputLayer(**layer), chunking=Chunking(**chunking), **args)
    assert len(str(info.value)) > len(name) + 10  # says what was expected, not just the name
    assert work == []  # no chunk was touched
    for t, snap, version in snaps:
        assert t._version == version
        assert torch.equal(t.detach(), snap) or (t.is_floating_point() and torch.equal(t.isnan(), snap.isnan()))
    if isinstance(logits, torch.Tensor) and logits.requires_grad:
        assert logits.grad is None


def test_out_of_range_message_is_specific():
    x = torch.randn(4, V)
    with pytest.raises(ValueError, match=rf"\[0, {V}\)") as info:
        log_probs_and_entropy(x, torch.tensor([1, 2, V + 5, 3]))
    assert str(V + 5) in str(info.value)  # the offending id is reported


def test_ignore_index_and_masked_labels_are_not_range_checked():
    # the boundary of the checks above: these are valid and must not raise
    x = torch.randn(4, V)
    lp, _ = log_probs_and_entropy(x, torch.tensor([1, -100, 3, 4]))
    assert lp[1] == 0
    lp, _ = log_probs_and_entropy(
        x, torch.tensor([1, 10**6, -7, 4]), label_mask=torch.tensor([True, False, False, True])
    )
    assert (lp[1:3] == 0).all()
    lp, _ = log_probs_and_entropy(x, torch.tensor([1, 5, 3, 4]), ignore_index=5)
    assert lp[1] == 0
    # a valid int32 label tensor and an int temperature are accepted
    log_probs_and_entropy(x, torch.tensor([1, 2, 3, 4], dtype=torch.int32), temperature=2)


@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_an_overflowing_transform_is_refused_by_both_backends(backend):
    x = torch.randn(4, V)
    labels = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="overflows"):
        log_probs_and_entropy(x, labels, layer=OutputLayer(softcap=1e30), chunking=Chunking(backend=backend),
                              temperature=1e-10)
    # the largest ratio that fits is computed, and finite
    lp, h = log_probs_and_entropy(x, labels, layer=OutputLayer(softcap=1e30), chunking=Chunking(backend=backend),
                                  temperature=1e-7)
    assert torch.isfinite(lp).all() and torch.isfinite(h).all()


def test_numpy_scalars_are_numbers_everywhere():
    """np.float32 and np.float64 are accepted alike, and give the results of the Python floats."""
    from chunked_entropy import ChunkedVocabParallelHead, linear_policy_loss

    g = torch.Generator().manual_seed(9)
    x, labels = torch.randn(4, V, generator=g), torch.tensor([1, 2, 3, 4])
    want = log_probs_and_entropy(x, labels, layer=OutputLayer(softcap=3.0, logit_scale=0.5), temperature=0.7)
    for cast in (np.float32, np.float64):
        got = log_probs_and_entropy(x, labels, layer=OutputLayer(softcap=cast(3.0), logit_scale=cast(0.5)),
                                    temperature=cast(0.7))
        torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-6, atol=1e-7)
    hidden, weight = torch.randn(2, 3, 5, generator=g), torch.randn(V, 5, generator=g)
    old, adv, mask = torch.randn(2, 3, generator=g) - 2, torch.randn(2, 3, generator=g), torch.ones(2, 3, dtype=bool)
    loss_ref, _ = linear_policy_loss(hidden, weight, torch.ones(2, 3, dtype=torch.long), old, adv, mask,
                                     loss=PolicyLoss(options={"clip_ratio_c": 3.0}, entropy_coeff=0.01))
    for cast in (np.float32, np.float64):
        loss, _ = linear_policy_loss(hidden, weight, torch.ones(2, 3, dtype=torch.long), old, adv, mask,
                                     loss=PolicyLoss(options={"clip_ratio_c": cast(3.0)}, entropy_coeff=cast(0.01)))
        torch.testing.assert_close(loss, loss_ref)
        head = ChunkedVocabParallelHead(OutputLayer(weight, softcap=cast(30.0), logit_scale=cast(0.5)))
        assert head.softcap == 30.0 and head.logit_scale == 0.5


def test_head_flags_are_bools_as_in_the_functions():
    from chunked_entropy import ChunkedVocabParallelHead

    weight = torch.randn(V, 4)
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="sequence_parallel"):
            ChunkedVocabParallelHead(OutputLayer(weight, sequence_parallel=bad))


def test_the_losses_name_list_labels_and_a_non_finite_count():
    """Found by the fuzz pass: list labels gave an AttributeError from inside, and a tensor count of inf was
    accepted (a loss of 0), though the float inf is refused."""
    from chunked_entropy import losses, policy_loss_from_logits

    z, lab = torch.randn(2, 3, V), torch.randint(0, V, (2, 3))
    old, adv, mask = torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="labels must be a torch.Tensor of int64 ids, got list"):
        policy_loss_from_logits(z, lab.tolist(), old, adv, mask)
    for count in (torch.tensor(math.inf), torch.tensor(math.nan), torch.tensor(-2.0), math.inf):
        with pytest.raises(ValueError, match="batch_num_tokens must be a finite number"):
            losses.agg_loss(torch.randn(2, 3), mask, batch_num_tokens=count)
        with pytest.raises(ValueError, match="batch_num_tokens must be a finite number"):
            policy_loss_from_logits(z, lab, old, adv, mask,
                                    loss=PolicyLoss(aggregation=Aggregation(batch_num_tokens=count)))
    with pytest.raises(ValueError, match="global_batch_size must be a finite number > 0"):
        losses.agg_loss(torch.randn(2, 3), mask, "seq-mean-token-mean", global_batch_size=torch.tensor(math.inf))


def test_a_weight_without_vocabulary_rows_is_named():
    """Found by the reliability pass: a ``[0, H]`` weight (every label ignored) gave "range() arg 3 must not be
    zero" from inside the chunk walk; the ops over hidden states now refuse it by name, as the logits ops
    refuse ``V_local = 0`` logits."""
    from chunked_entropy import ChunkedVocabParallelHead, linear_log_probs_and_entropy, linear_policy_loss

    hidden, weight = torch.randn(2, 3, 4), torch.randn(0, 4)
    ignored, zeros, mask = torch.full((2, 3), -100), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    match = r"weight must .*V_local >= 1"  # named by OutputLayer, which every op over hidden states builds
    for call in (lambda: linear_log_probs_and_entropy(hidden, weight, ignored),
                 lambda: linear_log_probs_and_entropy(hidden, OutputLayer(weight), ignored, chunking=Chunking(2, 4)),
                 lambda: ChunkedVocabParallelHead(weight)(hidden, ignored),
                 lambda: linear_policy_loss(hidden, weight, ignored, zeros, zeros, ~mask)):
        with pytest.raises(ValueError, match=match):
            call()


HUGE = 10**400  # an int no float holds: math.isfinite and float() raise OverflowError on it


def _huge_cases():
    """``(field, call)``: each number a caller sets, given as an int too large for a float."""
    import dataclasses

    import chunked_entropy as ce
    from chunked_entropy import ChunkedEntropyConfig, Divergence
    from chunked_entropy.losses import PolicyOptions

    g = torch.Generator().manual_seed(3)
    h, w, y = torch.randn(2, 3, 4, generator=g), torch.randn(V, 4, generator=g), torch.randint(0, V, (2, 3))
    x, f, m = torch.randn(2, 3, V, generator=g), torch.zeros(2, 3), torch.ones(2, 3)
    cases = [
        ("softcap", lambda: OutputLayer(w, softcap=HUGE)),
        ("logit_scale", lambda: OutputLayer(w, logit_scale=HUGE)),
        ("beta", lambda: Divergence("jsd", HUGE)),
        ("beta", lambda: Divergence.from_trl_beta(HUGE)),
        ("entropy_coeff", lambda: PolicyLoss(entropy_coeff=HUGE)),
        ("kl_coef", lambda: PolicyLoss(kl_coef=HUGE)),
        ("loss_scale_factor", lambda: Aggregation("token-mean", HUGE)),
        ("batch_num_tokens", lambda: Aggregation("token-mean", None, 1, HUGE)),
        ("temperature", lambda: log_probs_and_entropy(x, y, temperature=HUGE)),
        ("temperature", lambda: ce.linear_log_probs_and_entropy(h, w, y, temperature=HUGE)),
        ("temperature", lambda: ce.linear_policy_loss(h, w, y, f, f, m, temperature=HUGE)),
        ("temperature", lambda: ce.policy_loss_from_logits(x, y, f, f, m, temperature=HUGE)),
        ("temperature", lambda: ce.linear_divergence(h, w, h, w, temperature=HUGE)),
        ("temperature", lambda: ce.linear_divergence_loss(h, w, h, w, temperature=HUGE)),
        ("temperature", lambda: ce.divergence_from_logits(x, x, temperature=HUGE)),
        ("temperature", lambda: ChunkedEntropyConfig(temperature=HUGE)),
        ("normalizer", lambda: ce.linear_divergence_loss(h, w, h, w, normalizer=HUGE)),
        ("ignore_index", lambda: log_probs_and_entropy(x, y, ignore_index=HUGE)),
        ("top_p", lambda: log_probs_and_entropy(x, y, keep={"top_p": HUGE})),
        ("entropy_coeff", lambda: ChunkedEntropyConfig.from_actor_config({"entropy_coeff": HUGE})),
    ]
    for field in dataclasses.fields(PolicyOptions):
        if field.name not in ("loss_type", "rollout_is", "rollout_is_batch_normalize", "rollout_rs",
                              "rollout_is_threshold", "rollout_rs_threshold"):  # the thresholds: read at use
            cases.append((field.name, lambda k=field.name: PolicyOptions(**{k: HUGE})))
            cases.append((field.name, lambda k=field.name: PolicyLoss(options={k: HUGE})))
    from chunked_entropy.integrations import trl

    cases.append(("temperature", lambda: trl.selective_log_softmax(x, y, temperature=HUGE)))
    cases.append(("rollout_is_threshold", lambda: ce.policy_loss_from_logits(
        x, y, f, f, m, rollout_log_probs=f, loss=PolicyLoss(options={"rollout_is_threshold": HUGE}))))
    return cases


def test_an_int_too_large_for_a_float_is_named_as_every_other_bad_value():
    """Issue 45 item 7: ``10**400`` gave ``OverflowError: int too large to convert to float``, naming nothing."""
    cases = _huge_cases()
    assert len(cases) >= 40
    for field, call in cases:
        with pytest.raises(ValueError, match=rf"{field}\b.*(an int of 401 digits|{HUGE % 10**6})"):
            call()
