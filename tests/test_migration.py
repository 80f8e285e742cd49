"""0.1's flat keywords still work in 0.2.x: each op and the head, called with every old keyword, warns and equals
the call in the new form (values and gradients, bit for bit: the same computation).

This is the one test module that calls the ops the old way. The 0.1 keyword lists below are copied from the
0.1.0 signatures (commit 6d7bb7a), not derived from the code under test; a keyword of them that no case
here passes fails :func:`test_every_old_keyword_is_covered`.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import chunked_entropy as ce
from chunked_entropy import Chunking, Divergence, OutputLayer, PolicyLoss
from chunked_entropy.losses import Aggregation, PolicyOptions

from .helpers import run_distributed

#: Every keyword of 0.1.0's public signatures that 0.2 moved into an object (``**fields``: the policy options).
OLD = {
    "log_probs_and_entropy": {"chunk_size", "process_group", "softcap", "logit_scale", "backend"},
    "linear_log_probs_and_entropy": {"weight", "bias", "chunk_size", "process_group", "sequence_parallel",
                                     "vocab_chunk_size", "gradient_accumulation_fusion", "softcap", "logit_scale",
                                     "backend", "logits_dtype"},
    "linear_policy_loss": {"weight", "bias", "kl_coef", "kl_kind", "entropy_coeff", "loss_mode", "options",
                           "loss_agg_mode", "loss_scale_factor", "dp_size", "batch_num_tokens", "global_batch_size",
                           "chunk_size", "vocab_chunk_size", "process_group", "sequence_parallel", "softcap",
                           "logit_scale", "gradient_accumulation_fusion", "backend", "entropy_of", "logits_dtype",
                           "**fields"},
    "policy_loss_from_logits": {"kl_coef", "kl_kind", "entropy_coeff", "loss_mode", "options", "loss_agg_mode",
                                "loss_scale_factor", "dp_size", "batch_num_tokens", "global_batch_size", "chunk_size",
                                "process_group", "softcap", "logit_scale", "backend", "entropy_of", "**fields"},
    "linear_divergence": {"student_weight", "teacher_weight", "beta", "student_bias", "teacher_bias",
                          "student_softcap", "student_logit_scale", "teacher_softcap", "teacher_logit_scale",
                          "chunk_size", "vocab_chunk_size", "process_group", "sequence_parallel", "logits_dtype"},
    "linear_divergence_loss": {"student_weight", "teacher_weight", "beta", "student_bias", "teacher_bias",
                               "student_softcap", "student_logit_scale", "teacher_softcap", "teacher_logit_scale",
                               "chunk_size", "vocab_chunk_size", "process_group", "sequence_parallel",
                               "logits_dtype"},
    "divergence_from_logits": {"beta", "student_softcap", "student_logit_scale", "teacher_softcap",
                               "teacher_logit_scale", "chunk_size", "process_group"},
    "ChunkedVocabParallelHead": {"weight", "bias", "chunk_size", "process_group", "sequence_parallel",
                                 "vocab_chunk_size", "gradient_accumulation_fusion", "softcap", "logit_scale",
                                 "backend", "logits_dtype"},
}
COVERED = {k: set() for k in OLD}

B, T, H, V = 2, 5, 8, 24


def _old(op: str, fn, *args, **kw):
    """``fn(*args, **kw)`` in 0.1's form: it must warn, naming 0.3.0 and the new form."""
    fields = set(kw) & set(PolicyOptions.__dataclass_fields__)
    COVERED[op] |= {k for k in kw if k in OLD[op]} | ({"**fields"} if fields else set())
    with pytest.warns(DeprecationWarning, match=r"0\.1's and go in 0\.3\.0; pass .*=(OutputLayer|Chunking|"
                                                r"PolicyLoss|Divergence)\("):
        return fn(*args, **kw)


def _new(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new form never warns
        return fn(*args, **kw)


def _leaves(seed=0, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    return h, w, b


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return [t for x in out if x is not None for t in _tensors(x)]


def _same(run_old, run_new, leaves_of):
    """Both forms from fresh copies of the same leaves: every output and every leaf's gradient equal."""
    outs, grads = [], []
    for run in (run_old, run_new):
        leaves = leaves_of()
        out = run(*leaves)
        ts = [t for t in _tensors(out) if t.is_floating_point()]
        torch.manual_seed(1)
        sum((t * torch.randn_like(t)).sum() for t in ts if t.requires_grad).backward()
        outs.append(ts)
        grads.append([None if x is None or not isinstance(x, torch.Tensor) else x.grad for x in leaves])
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(*grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_log_probs_and_entropy():
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))

    def leaves():
        return (torch.randn(B, T, V, generator=torch.Generator().manual_seed(3)).mul(4).requires_grad_(),)

    _same(lambda x: _old("log_probs_and_entropy", ce.log_probs_and_entropy, x, labels, chunk_size=3, softcap=5.0,
                         logit_scale=0.7, backend="eager"),
          lambda x: _new(ce.log_probs_and_entropy, x, labels, chunking=Chunking(3, backend="eager"),
                         layer=OutputLayer(softcap=5.0, logit_scale=0.7)), leaves)


@pytest.mark.parametrize("keyword_weight", [False, True])
def test_linear_log_probs_and_entropy(keyword_weight):
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    old_kw = dict(bias=None, chunk_size=4, vocab_chunk_size=10, softcap=6.0, logit_scale=1.3, backend="eager",
                  gradient_accumulation_fusion=False, logits_dtype=torch.float32)

    def old(h, w, b):
        kw = {**old_kw, "bias": b}
        if keyword_weight:
            return _old("linear_log_probs_and_entropy", ce.linear_log_probs_and_entropy, h, labels=labels, weight=w,
                        **kw)
        return _old("linear_log_probs_and_entropy", ce.linear_log_probs_and_entropy, h, w, labels, **kw)

    def new(h, w, b):
        layer = OutputLayer(w, b, softcap=6.0, logit_scale=1.3, gradient_accumulation_fusion=False,
                            logits_dtype=torch.float32)
        return _new(ce.linear_log_probs_and_entropy, h, layer, labels,
                    chunking=Chunking(4, vocab_chunk_size=10, backend="eager"))

    _same(old, new, _leaves)


def _policy_inputs():
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, V, (B, T), generator=g)
    old_lp = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    ref = -torch.rand(B, T, generator=g) * 3
    return labels, old_lp, adv, mask, ref


def test_linear_policy_loss_every_loss_keyword():
    labels, old_lp, adv, mask, ref = _policy_inputs()
    opts = PolicyOptions(clip_ratio_c=4.0)

    def old(h, w, b):
        return _old("linear_policy_loss", ce.linear_policy_loss, h, w, labels, old_lp, adv, mask, bias=b,
                    ref_log_probs=ref, kl_coef=0.05, kl_kind="k2", entropy_coeff=0.01, loss_mode="vanilla",
                    options=opts, clip_ratio=0.25, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=7.0,
                    dp_size=2, batch_num_tokens=20, global_batch_size=4, chunk_size=3, vocab_chunk_size=16,
                    softcap=9.0, logit_scale=0.8, gradient_accumulation_fusion=False, backend="eager",
                    entropy_of="full", logits_dtype=torch.float32)

    def new(h, w, b):
        loss = PolicyLoss("vanilla", opts.replace(clip_ratio=0.25), entropy_coeff=0.01, kl_coef=0.05, kl_kind="k2",
                          aggregation=Aggregation("seq-mean-token-sum-norm", 7.0, 2, 20, 4), entropy_of="full")
        layer = OutputLayer(w, b, softcap=9.0, logit_scale=0.8, gradient_accumulation_fusion=False,
                            logits_dtype=torch.float32)
        return _new(ce.linear_policy_loss, h, layer, labels, old_lp, adv, mask, loss=loss, ref_log_probs=ref,
                    chunking=Chunking(3, 16, "eager"))

    _same(old, new, _leaves)


def test_linear_policy_loss_weight_keyword_and_fields_alone():
    labels, old_lp, adv, mask, _ = _policy_inputs()
    _same(lambda h, w: _old("linear_policy_loss", ce.linear_policy_loss, h, weight=w, labels=labels,
                               old_log_probs=old_lp, advantages=adv, loss_mask=mask, loss_mode="gspo",
                               clip_ratio=0.1, clip_ratio_high=0.3),
          lambda h, w: _new(ce.linear_policy_loss, h, w, labels, old_lp, adv, mask,
                               loss=PolicyLoss("gspo", {"clip_ratio": 0.1, "clip_ratio_high": 0.3})),
          lambda: _leaves(bias=False)[:2])


def test_policy_loss_from_logits():
    labels, old_lp, adv, mask, ref = _policy_inputs()

    def leaves():
        return (torch.randn(B, T, V, generator=torch.Generator().manual_seed(3)).mul(3).requires_grad_(),)

    _same(lambda x: _old("policy_loss_from_logits", ce.policy_loss_from_logits, x, labels, old_lp, adv, mask,
                         ref_log_probs=ref, kl_coef=0.1, kl_kind="low_var_kl", entropy_coeff=0.02, loss_mode="cispo",
                         options=PolicyOptions(), clip_ratio_high=0.5, loss_agg_mode="token-sum",
                         loss_scale_factor=None, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                         chunk_size=4, softcap=7.0, logit_scale=0.9, backend="eager", entropy_of="full"),
          lambda x: _new(ce.policy_loss_from_logits, x, labels, old_lp, adv, mask, ref_log_probs=ref,
                         loss=PolicyLoss("cispo", {"clip_ratio_high": 0.5}, entropy_coeff=0.02, kl_coef=0.1,
                                         aggregation="token-sum"),
                         layer=OutputLayer(softcap=7.0, logit_scale=0.9), chunking=Chunking(4, backend="eager")),
          leaves)


def _pair_leaves():
    hs, ws, bs = _leaves(seed=7)
    g = torch.Generator().manual_seed(8)
    ht = torch.randn(B, T, H + 2, generator=g)
    wt = torch.randn(V, H + 2, generator=g) * 0.5
    bt = torch.randn(V, generator=g) * 0.1
    return hs, ws, bs, ht, wt, bt


_PAIR_OLD = dict(student_softcap=8.0, student_logit_scale=1.1, teacher_softcap=6.0, teacher_logit_scale=0.9,
                 chunk_size=3, vocab_chunk_size=10, logits_dtype=torch.float32)


def _pair_new(ws, bs, wt, bt):
    return (OutputLayer(ws, bs, softcap=8.0, logit_scale=1.1, logits_dtype=torch.float32),
            OutputLayer(wt, bt, softcap=6.0, logit_scale=0.9, logits_dtype=torch.float32), Chunking(3, 10))


@pytest.mark.parametrize("op", ["linear_divergence", "linear_divergence_loss"])
def test_linear_divergences(op):
    fn = getattr(ce, op)
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    extra = {} if op == "linear_divergence_loss" else {"labels": labels}

    def old(hs, ws, bs, ht, wt, bt):
        return _old(op, fn, hs, teacher_hidden=ht, student_weight=ws, teacher_weight=wt, divergence="jsd", beta=0.3,
                    student_bias=bs, teacher_bias=bt, **_PAIR_OLD, **extra)

    def new(hs, ws, bs, ht, wt, bt):
        s, t, c = _pair_new(ws, bs, wt, bt)
        return _new(fn, hs, s, ht, t, divergence=Divergence("jsd", 0.3), chunking=c, **extra)

    _same(old, new, _pair_leaves)


def test_divergence_from_logits():
    def leaves():
        g = torch.Generator().manual_seed(9)
        return torch.randn(B, T, V, generator=g).requires_grad_(), torch.randn(B, T, V, generator=g)

    _same(lambda s, t: _old("divergence_from_logits", ce.divergence_from_logits, s, t, divergence="jsd", beta=0.6,
                            student_softcap=5.0, student_logit_scale=1.2, teacher_softcap=4.0,
                            teacher_logit_scale=0.8, chunk_size=3),
          lambda s, t: _new(ce.divergence_from_logits, s, t, divergence=Divergence.from_trl_beta(0.6),
                            student_layer=OutputLayer(softcap=5.0, logit_scale=1.2),
                            teacher_layer=OutputLayer(softcap=4.0, logit_scale=0.8), chunking=3),
          leaves)


@pytest.mark.parametrize("form", ["positional bias", "keywords"])
def test_head(form):
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    kw = dict(chunk_size=4, vocab_chunk_size=12, softcap=7.0, logit_scale=1.2, backend="eager",
              gradient_accumulation_fusion=False, logits_dtype=torch.float32)

    def old(h, w, b):
        if form == "positional bias":
            head = _old("ChunkedVocabParallelHead", ce.ChunkedVocabParallelHead, w, b, **kw)
        else:
            head = _old("ChunkedVocabParallelHead", ce.ChunkedVocabParallelHead, weight=w, bias=b, **kw)
        assert (head.chunk_size, head.softcap, head.logit_scale) == (4, 7.0, 1.2)  # 0.1's attributes still read
        return head(h, labels)

    def new(h, w, b):
        layer = OutputLayer(w, b, softcap=7.0, logit_scale=1.2, gradient_accumulation_fusion=False,
                            logits_dtype=torch.float32)
        return _new(ce.ChunkedVocabParallelHead(layer, Chunking(4, 12, "eager")), h, labels)

    _same(old, new, _leaves)
    old_sig = {"weight", "bias"} | set(kw)
    assert not old_sig & set(inspect.signature(ce.ChunkedVocabParallelHead).parameters)


def test_head_policy_loss_old_settings():
    labels, old_lp, adv, mask, _ = _policy_inputs()

    def old(h, w, b):
        head = _new(ce.ChunkedVocabParallelHead, OutputLayer(w, b))
        with pytest.warns(DeprecationWarning, match=r"0\.1's and go in 0\.3\.0"):
            return head.policy_loss(h, labels, old_lp, adv, mask, chunk_size=3, softcap=4.0, loss_mode="gpg")

    def new(h, w, b):
        head = ce.ChunkedVocabParallelHead(OutputLayer(w, b, softcap=4.0), 3)
        return _new(head.policy_loss, h, labels, old_lp, adv, mask, loss=PolicyLoss("gpg"))

    _same(old, new, _leaves)


def _tp_worker(rank, world):
    """Under a TP group of 2 with sequence parallelism: process_group and sequence_parallel, old and new."""
    group = torch.distributed.new_group([0, 1])
    torch.manual_seed(0)
    h_full = torch.randn(2 * T, B, H)
    w_full, labels = torch.randn(2 * V, H) * 0.5, torch.randint(0, 2 * V, (2 * T, B))
    rows = slice(rank * T, (rank + 1) * T)
    vocab = slice(rank * V, (rank + 1) * V)
    results = []
    for form in ("old", "new"):
        h = h_full[rows].clone().requires_grad_()
        w = w_full[vocab].clone().requires_grad_()
        if form == "old":
            with pytest.warns(DeprecationWarning):
                out = ce.linear_log_probs_and_entropy(h, w, labels, process_group=group, sequence_parallel=True,
                                                      chunk_size=4)
            with pytest.warns(DeprecationWarning):
                logit_out = ce.log_probs_and_entropy((h_full @ w_full[vocab].T), labels, process_group=group)
            with pytest.warns(DeprecationWarning):
                div = ce.linear_divergence(h, w, h.detach() * 0.5, w.detach(), process_group=group,
                                           sequence_parallel=True).divergence
            with pytest.warns(DeprecationWarning):
                pl, _ = ce.policy_loss_from_logits((h_full @ w_full[vocab].T).transpose(0, 1), labels.T,
                                                   -torch.ones(B, 2 * T), torch.ones(B, 2 * T),
                                                   torch.ones(B, 2 * T, dtype=torch.bool), process_group=group)
        else:
            layer = OutputLayer(w, process_group=group, sequence_parallel=True)
            out = ce.linear_log_probs_and_entropy(h, layer, labels, chunking=4)
            logit_out = ce.log_probs_and_entropy((h_full @ w_full[vocab].T), labels,
                                                 layer=OutputLayer(process_group=group))
            div = ce.linear_divergence(h, layer, h.detach() * 0.5,
                                       OutputLayer(w.detach(), process_group=group, sequence_parallel=True)).divergence
            pl, _ = ce.policy_loss_from_logits((h_full @ w_full[vocab].T).transpose(0, 1), labels.T,
                                               -torch.ones(B, 2 * T), torch.ones(B, 2 * T),
                                               torch.ones(B, 2 * T, dtype=torch.bool),
                                               layer=OutputLayer(process_group=group))
        (out.log_probs.sum() + out.entropy.sum() + div.sum()).backward()
        results.append((out.log_probs, out.entropy, logit_out.log_probs, div, pl, h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_process_group_and_sequence_parallel_keywords():
    run_distributed(_tp_worker, 2)
    for op in ("linear_log_probs_and_entropy", "log_probs_and_entropy", "linear_divergence",
               "policy_loss_from_logits"):
        COVERED[op] |= {"process_group"}
    COVERED["linear_log_probs_and_entropy"] |= {"sequence_parallel"}
    COVERED["linear_divergence"] |= {"sequence_parallel"}


def test_remaining_group_keywords_map_to_the_layer():
    """The group keywords of the other ops and the head, without a group (None, False: their defaults):
    they still warn and land in the layer."""
    h, w, b = _leaves()
    labels, old_lp, adv, mask, _ = _policy_inputs()
    _old("linear_policy_loss", ce.linear_policy_loss, h, w, labels, old_lp, adv, mask, process_group=None,
         sequence_parallel=False)
    hs, ws, bs, ht, wt, bt = _pair_leaves()
    _old("linear_divergence_loss", ce.linear_divergence_loss, hs, ws, ht, wt, process_group=None,
         sequence_parallel=False)
    _old("divergence_from_logits", ce.divergence_from_logits, torch.randn(3, V), torch.randn(3, V),
         process_group=None)
    head = _old("ChunkedVocabParallelHead", ce.ChunkedVocabParallelHead, w, process_group=None,
                sequence_parallel=False)
    assert head.layer.process_group is None and head.layer.sequence_parallel is False


def test_mixing_an_old_keyword_with_its_object_is_an_error():
    h, w, _ = _leaves()
    labels = torch.zeros(B, T, dtype=torch.long)
    with pytest.raises(TypeError, match=r"both chunking= and 0\.1's keyword\(s\) \['chunk_size'\]"):
        ce.linear_log_probs_and_entropy(h, w, labels, chunking=Chunking(4), chunk_size=8)
    with pytest.raises(TypeError, match=r"both layer= and 0\.1's keyword\(s\) \['softcap'\]"):
        ce.linear_log_probs_and_entropy(h, OutputLayer(w), labels, softcap=3.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'clip_ratoi'"):
        ce.linear_policy_loss(h, w, labels, labels.float(), labels.float(), labels > 0, clip_ratoi=0.2)


def _both_forms_calls():
    """``(what, call, keywords)``: each op and the head with a 0.2 argument given (an object, or a bare value)
    and a 0.1 keyword that sets the same field beside it; ``keywords`` the old ones the error must name."""
    h, w, b = _leaves()
    w2 = w.detach() * 2
    labels = torch.zeros(B, T, dtype=torch.long)
    f, m = labels.float(), labels > -1
    logits = torch.randn(B, T, V)
    hs, ws, bs, ht, wt, bt = _pair_leaves()
    pair = (hs, ws, ht, wt)
    calls = []
    for chunking in (8, "auto", Chunking(8)):  # 0.1 had no chunking: any given beside chunk_size is a mix
        c = dict(chunking=chunking, chunk_size=4)
        calls += [
            (f"log_probs_and_entropy chunking={chunking!r}", lambda c=c: ce.log_probs_and_entropy(logits, labels, **c)),
            (f"linear_log_probs_and_entropy chunking={chunking!r}",
             lambda c=c: ce.linear_log_probs_and_entropy(h, w, labels, **c)),
            (f"linear_policy_loss chunking={chunking!r}",
             lambda c=c: ce.linear_policy_loss(h, w, labels, f, f, m, **c)),
            (f"policy_loss_from_logits chunking={chunking!r}",
             lambda c=c: ce.policy_loss_from_logits(logits, labels, f, f, m, **c)),
            (f"linear_divergence chunking={chunking!r}", lambda c=c: ce.linear_divergence(*pair, **c)),
            (f"linear_divergence_loss chunking={chunking!r}", lambda c=c: ce.linear_divergence_loss(*pair, **c)),
            (f"divergence_from_logits chunking={chunking!r}",
             lambda c=c: ce.divergence_from_logits(logits, logits, **c)),
            (f"ChunkedVocabParallelHead chunking={chunking!r}", lambda c=c: ce.ChunkedVocabParallelHead(w, **c)),
        ]
    calls += [
        ("linear_log_probs_and_entropy weight=", lambda: ce.linear_log_probs_and_entropy(h, w, labels, weight=w2)),
        ("linear_log_probs_and_entropy layer=w, weight=",
         lambda: ce.linear_log_probs_and_entropy(h, layer=w, labels=labels, weight=w2)),
        ("linear_policy_loss weight=", lambda: ce.linear_policy_loss(h, w, labels, f, f, m, weight=w2)),
        ("linear_divergence student_weight=", lambda: ce.linear_divergence(*pair, student_weight=ws * 2)),
        ("linear_divergence_loss teacher_weight=", lambda: ce.linear_divergence_loss(*pair, teacher_weight=wt * 2)),
        ("ChunkedVocabParallelHead weight=", lambda: ce.ChunkedVocabParallelHead(w, weight=w2)),
        ("linear_divergence divergence object and beta=",
         lambda: ce.linear_divergence(*pair, divergence=Divergence("jsd", 0.5), beta=0.3)),
    ]
    return calls


def test_a_0_1_keyword_beside_the_argument_it_moved_into_is_a_type_error_in_every_op():
    """Issue 45 item 4: ``chunking=8, chunk_size=4`` walked 4-row chunks and ``(h, w, y, weight=w2)`` projected with
    ``w2``: the old keyword silently won. Each is a TypeError naming both, before any work."""
    for what, call in _both_forms_calls():
        with pytest.raises(TypeError, match=r"got both \w+= and 0\.1's keyword\(s\)"):
            call()
        assert what  # the case's name shows in the traceback


def test_0_1_keywords_beside_a_bare_value_0_1_took_there_still_work():
    """0.1 took the weight positionally and the divergence's name by keyword: beside them its other keywords are
    that 0.1 call, not a mix."""
    h, w, b = _leaves()
    labels = torch.zeros(B, T, dtype=torch.long)
    hs, ws, bs, ht, wt, bt = _pair_leaves()
    out = _old("linear_log_probs_and_entropy", ce.linear_log_probs_and_entropy, h, w, labels, softcap=3.0, bias=b)
    new = ce.linear_log_probs_and_entropy(h, OutputLayer(w, b, softcap=3.0), labels)
    torch.testing.assert_close(out.log_probs, new.log_probs, rtol=0, atol=0)
    out = _old("linear_divergence", ce.linear_divergence, hs, ws, ht, wt, divergence="jsd", beta=0.3)
    new = ce.linear_divergence(hs, ws, ht, wt, divergence=Divergence("jsd", 0.3))
    torch.testing.assert_close(out.divergence, new.divergence, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["linear_divergence", "linear_divergence_loss"])
def test_vocab_chunk_size_alone_keeps_the_divergences_256_rows(op, monkeypatch):
    """Issue 45 item 5: 0.1's ``linear_divergence(..., vocab_chunk_size=vc)`` walked 256-row chunks (its default);
    moved into ``Chunking(vocab_chunk_size=vc)`` it walked Chunking's 1024, 4x the buffers the caller sized."""
    import chunked_entropy._call as prepared  # the one preparation plans every op

    walked = []
    real = prepared.plan_for

    def plan_for(*args, **kw):  # the op's own planning, recorded
        plan = real(*args, **kw)
        walked.append((plan.chunk_size, plan.vocab_chunk_size))
        return plan

    monkeypatch.setattr(prepared, "plan_for", plan_for)
    hs, ws, bs, ht, wt, bt = _pair_leaves()
    fn = getattr(ce, op)
    old = _old(op, fn, hs, teacher_hidden=ht, student_weight=ws, teacher_weight=wt, vocab_chunk_size=8)
    new = _new(fn, hs, ws, ht, wt, chunking=Chunking(256, 8))
    assert walked == [(256, 8), (256, 8)]
    for a, b in zip(_tensors(old), _tensors(new), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    walked.clear()
    _old(op, fn, hs, teacher_hidden=ht, student_weight=ws, teacher_weight=wt, vocab_chunk_size=8, chunk_size=3)
    assert walked == [(3, 8)]


def test_signatures_show_the_new_form():
    for op in OLD:
        params = inspect.signature(getattr(ce, op)).parameters
        stale = (OLD[op] - {"**fields"}) & set(params)
        assert not stale, f"{op} still lists {stale}"
        assert len(params) <= 15 + (op == "ChunkedVocabParallelHead"), op
    slots = sum(1 for op in OLD if op != "ChunkedVocabParallelHead"
                for p in inspect.signature(getattr(ce, op)).parameters.values()
                if p.kind == p.KEYWORD_ONLY and p.name != "rows")
    assert slots <= 75


def test_every_old_keyword_is_covered():
    """Run last in this module (pytest keeps the file's order): every 0.1 keyword went through a case above."""
    missing = {op: OLD[op] - COVERED[op] for op in OLD if OLD[op] - COVERED[op]}
    assert not missing, missing
