"""The option objects as values: equal settings compare equal and hash alike, and a name given as a
``numpy.str_`` is kept as the plain ``str`` (issue 45 item 9).

Before: ``PolicyLoss() != PolicyLoss()`` and ``OutputLayer`` likewise (compared by identity), and
``Chunking(backend=numpy.str_("eager"))`` kept the ``numpy.str_``, whose fingerprint (what the ranks of a
group compare) differed from the plain ``str``'s, so ranks mixing the two were refused as disagreeing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from chunked_entropy import (
    ChunkedEntropyConfig,
    Chunking,
    Divergence,
    OutputLayer,
    PolicyLoss,
    linear_log_probs_and_entropy,
)
from chunked_entropy.losses import Aggregation, PolicyOptions


def _variants():
    """Groups of objects: equal within a group (built separately, by other routes), different across groups."""
    return [
        # -0.0 == 0.0: the same setting, whose fingerprint (float bits) must agree too, or two ranks holding
        # equal objects were refused as differing
        [PolicyLoss(), PolicyLoss(), PolicyLoss("vanilla", {}, aggregation="token-mean"),
         PolicyLoss(entropy_coeff=-0.0, kl_coef=-0.0)],
        [PolicyLoss("gspo"), PolicyLoss(mode="gspo", options=PolicyOptions())],
        [PolicyLoss(entropy_coeff=0.01), PolicyLoss(entropy_coeff=np.float64(0.01))],
        [PolicyLoss(options={"clip_ratio_high": 0.28}), PolicyLoss(options=PolicyOptions(clip_ratio_high=0.28))],
        [PolicyLoss(aggregation=Aggregation("token-mean", None, 2, 100)),
         PolicyLoss().for_batch(dp_size=2, batch_num_tokens=100)],
        [PolicyLoss(aggregation=Aggregation("token-mean", None, 2, 101))],
        [PolicyLoss(kl_coef=0.1, kl_kind="k3"), PolicyLoss(kl_coef=0.1, kl_kind="k3")],
        [PolicyOptions(), PolicyOptions(clip_ratio=0.2)],
        [PolicyOptions(clip_ratio_c=2.5)],
        [Aggregation(), Aggregation("token-mean")],
        [Aggregation("seq-mean-token-sum-norm", 4.0), Aggregation("seq-mean-token-sum-norm", 4)],
        [Divergence(), Divergence("forward_kl")],
        [Divergence("jsd", 0.5), Divergence.from_trl_beta(0.5)],
        [Chunking(), Chunking(1024, None, "auto")],
        [Chunking(8, backend="eager"), Chunking(8).replace(backend="eager")],
    ]


def test_equal_settings_compare_equal_and_hash_alike():
    groups = _variants()
    for group in groups:
        for a, b in itertools.product(group, group):
            assert a == b and hash(a) == hash(b), (a, b)
            assert a.fingerprint() == b.fingerprint()
    for g1, g2 in itertools.combinations(groups, 2):
        for a, b in itertools.product(g1, g2):
            assert a != b, (a, b)
    # usable as keys: one entry per group
    assert len({x for group in groups for x in group}) == len(groups)


def test_a_replace_of_every_policy_field_is_another_value():
    base = PolicyLoss("vanilla", {"clip_ratio_high": 0.3}, entropy_coeff=0.01, kl_coef=0.1)
    changed = [base.replace(mode="gspo"), base.replace(entropy_coeff=0.02), base.replace(kl_coef=0.2),
               base.replace(kl_kind="k1"), base.replace(entropy_of="kept"), base.replace(aggregation="token-sum"),
               base.replace(options={"clip_ratio_high": 0.31})]
    assert base == base.replace()
    for other in changed:
        assert other != base and other.fingerprint() != base.fingerprint()


def test_layers_compare_their_settings_and_their_tensors_by_identity():
    w, b = torch.randn(6, 4), torch.randn(6)
    layer = OutputLayer(w, b, softcap=30.0)
    assert layer == OutputLayer(w, b, softcap=30) == layer.replace() and hash(layer) == hash(OutputLayer(w, b, 30.0))
    assert OutputLayer() == OutputLayer() and hash(OutputLayer()) == hash(OutputLayer())
    for other in (OutputLayer(w.clone(), b, softcap=30.0),  # another weight with the same values
                  OutputLayer(w, None, softcap=30.0), OutputLayer(w, b), OutputLayer(w, b, 30.0, 2.0),
                  OutputLayer(w, b, 30.0, gradient_accumulation_fusion=False)):
        assert other != layer
    assert layer != "layer" and layer != PolicyLoss()


def test_a_tensor_count_compares_by_identity():
    n = torch.tensor(100.0)
    assert Aggregation("token-mean", None, 2, n) == Aggregation("token-mean", None, 2, n)
    assert Aggregation("token-mean", None, 2, n) != Aggregation("token-mean", None, 2, n.clone())


@pytest.mark.parametrize("make, field", [
    (lambda s: Chunking(backend=s("eager")), "backend"),
    (lambda s: Chunking(s("auto")), "chunk_size"),
    (lambda s: PolicyLoss(mode=s("gspo")), "mode"),
    (lambda s: PolicyLoss(kl_kind=s("k3")), "kl_kind"),
    (lambda s: PolicyLoss(entropy_of=s("kept")), "entropy_of"),
    (lambda s: Divergence(s("jsd"), 0.5), "kind"),
    (lambda s: Aggregation(s("token-sum")), "mode"),
    (lambda s: PolicyOptions(loss_type=s("reinforce")), "loss_type"),
    (lambda s: PolicyOptions(rollout_is=s("token")), "rollout_is"),
    (lambda s: PolicyOptions(rollout_is_threshold=s("0.5_2.0")), "rollout_is_threshold"),
    (lambda s: PolicyOptions(rollout_rs=s("token_k1"), rollout_rs_threshold=s("0.5_2.0")), "rollout_rs"),
    (lambda s: ChunkedEntropyConfig(backend=s("eager")), "backend"),
])
def test_a_numpy_str_is_kept_as_the_plain_str(make, field):
    theirs, plain = make(np.str_), make(str)
    assert type(getattr(theirs, field)) is str
    assert theirs == plain and hash(theirs) == hash(plain)
    if hasattr(plain, "fingerprint"):  # what the ranks of a group compare: a rank mixing the two agrees
        assert theirs.fingerprint() == plain.fingerprint()


def test_a_policy_loss_built_from_numpy_names_agrees_with_the_plain_one():
    """The case of the issue: the same loss on two ranks, one built from numpy strings (a config read with numpy),
    has the same fingerprint, so the ranks' agreement passes."""
    theirs = PolicyLoss(np.str_("gspo"), {"loss_type": np.str_("reinforce")}, kl_kind=np.str_("k3"),
                        aggregation=np.str_("seq-mean-token-mean"))
    plain = PolicyLoss("gspo", {"loss_type": "reinforce"}, kl_kind="k3", aggregation="seq-mean-token-mean")
    assert theirs.fingerprint() == plain.fingerprint() and theirs == plain


def test_the_logits_dtype_rule_is_written_once_and_the_layer_reads_it():
    """``_checks.logits_in_float32`` is the rule (None or the weight's dtype: the weight's dtype; float32 beside
    a half-precision weight: float32 blocks; anything else refused naming the field and the weight), and an
    ``OutputLayer``'s check and its ``float32_logits`` are it."""
    from chunked_entropy._checks import logits_in_float32

    for half in (torch.bfloat16, torch.float16):
        assert logits_in_float32(torch.float32, half) and not logits_in_float32(None, half)
        assert not logits_in_float32(half, half)
        assert OutputLayer(torch.randn(4, 3, dtype=half), logits_dtype=torch.float32).float32_logits
        assert not OutputLayer(torch.randn(4, 3, dtype=half)).float32_logits
    assert not logits_in_float32(torch.float32, torch.float32)
    for dt, w in ((torch.float16, torch.bfloat16), (torch.float32, torch.float64), (torch.bfloat16, torch.float32)):
        with pytest.raises(ValueError, match=rf"^x.logits_dtype must be None \(x.weight's dtype, {w}\), {w} or "
                                             rf"torch.float32, got {dt}$"):
            logits_in_float32(dt, w, "x.logits_dtype", "x.weight")
    with pytest.raises(ValueError, match=r"OutputLayer.logits_dtype must be None \(OutputLayer.weight's dtype, "
                                         r"torch.bfloat16\), torch.bfloat16 or torch.float32, got torch.float16"):
        OutputLayer(torch.randn(4, 3, dtype=torch.bfloat16), logits_dtype=torch.float16)


def test_the_layer_is_prepared_for_a_call_by_its_hidden_states_alone():
    """The layer's own rules (weight, bias, ``logits_dtype``) are checked once, when it is built;
    ``OutputLayer.check_hidden`` adds only what the hidden states must match, naming the head's arguments
    (``student_hidden`` beside ``student_weight``), and returns the layer's ``float32_logits``. The ops over
    hidden states refuse through it, before any work."""
    w = torch.randn(5, 3, dtype=torch.bfloat16)
    layer = OutputLayer(w, torch.zeros(5, dtype=torch.bfloat16), logits_dtype=torch.float32)
    assert layer.check_hidden(torch.randn(2, 4, 3, dtype=torch.bfloat16)) is True
    assert OutputLayer(w).check_hidden(torch.randn(3, dtype=torch.bfloat16), "student_hidden") is False
    with pytest.raises(ValueError, match=r"^student_hidden must be \[\.\.\., H\] with H == student_weight.shape\[1\] "
                                         r"== 3, got shape \(2, 4\)$"):
        layer.check_hidden(torch.randn(2, 4, dtype=torch.bfloat16), "student_hidden")
    with pytest.raises(TypeError, match=r"^teacher_hidden \(torch.float32\) and teacher_weight \(torch.bfloat16\) "
                                        r"must have the same dtype$"):
        layer.check_hidden(torch.randn(2, 3), "teacher_hidden")
    with pytest.raises(TypeError, match=r"^hidden must be a torch.Tensor, got list$"):
        layer.check_hidden([1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match=r"^weight must be a torch.Tensor, got NoneType$"):
        OutputLayer().check_hidden(torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"^hidden must be \[\.\.\., H\] with H == weight.shape\[1\] == 3"):
        linear_log_probs_and_entropy(torch.randn(4, 2), torch.randn(5, 3), torch.zeros(4, dtype=torch.long))
