"""``rows=``: only the rows that are read, on every hidden-state entry point.

An index (repeats, any order) against the same op on the rows gathered by
hand (itself tested against float64 elsewhere) and against a float64
reference written here from the definition: values, and the gradients of
hidden, weight and bias under random upstream gradients, the hidden gradient
summed over repeats and exactly 0 on rows never selected. ``rows="kept"``
against the call on all rows (outputs equal on kept rows, zero elsewhere; the
gradients equal with the skipped rows' upstream gradients zero), over a
cross-product of the options, the twelve objectives and the three
divergences. The policy loss with ``[B, T]`` rows (sequence-level objectives).
Bad input. TP 2 with sequence parallelism over gloo (rows of the gathered
sequence, ranks that differ refused on every rank); at TP 2 and 3 under
sequence parallelism, rows refused on one rank only refused on every rank. Tree packing: a tree of
rollouts packed once against each root-to-leaf rollout on its own. bf16 with
rows repeated many times against float64, no worse than plain bf16 autograd. At TP 2 over gloo, every op
that takes ``rows=`` makes one agreement exchange with rows, as without, and the same collectives; the
selected rows, filled once the call is agreed, are read by no op before (NaN until then: the same bits).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import (
    ChunkedVocabParallelHead,
    Chunking,
    Divergence,
    OutputLayer,
    PolicyLoss,
    linear_divergence,
    linear_divergence_loss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    losses,
)
from tests.helpers import reference, run_distributed

F64 = torch.float64
B, T, H, V = 3, 7, 6, 40


def _data(seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return dict(h=torch.randn(B, T, H, generator=g, dtype=dtype), w=torch.randn(V, H, generator=g, dtype=dtype),
                b=torch.randn(V, generator=g, dtype=dtype) * 0.3, labels=torch.randint(0, V, (B, T), generator=g),
                g=torch.Generator().manual_seed(seed + 1))


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


def _grads(outs, ups, leaves):
    total = sum((o.double() * u).sum() for o, u in zip(outs, ups, strict=True) if o is not None)
    return torch.autograd.grad(total, leaves)


ROWS = torch.tensor([20, 3, 3, 0, 11, 3, 17, 20])  # repeats, any order; rows 1, 2, 4.. never selected


def test_head_index_against_float64_reference():
    d = _data()
    h, w, b = _leaves(d["h"], d["w"], d["b"])
    lab = torch.randint(0, V, (ROWS.numel(),), generator=d["g"])
    lab[4] = -100
    temp = torch.rand(ROWS.numel(), generator=d["g"], dtype=F64) + 0.5
    out = linear_log_probs_and_entropy(h, OutputLayer(w, b, softcap=4.0, logit_scale=0.9), lab, chunking=3, rows=ROWS,
                                       temperature=temp, compute_sum_pi_squared=True)
    ups = [torch.randn(ROWS.numel(), generator=d["g"], dtype=F64) for _ in range(3)]
    got = _grads([out.log_probs, out.entropy, out.sum_pi_squared], ups, [h, w, b])
    h2, w2, b2 = _leaves(d["h"], d["w"], d["b"])
    z = h2.reshape(-1, H)[ROWS] @ w2.t() + b2
    ref = reference(z, lab, temperature=temp, softcap=4.0, logit_scale=0.9, sum_pi_squared=True)
    *want, gz = _grads(ref, ups, [h2, w2, b2, z])
    for a, e in zip((out.log_probs, out.entropy, out.sum_pi_squared), ref, strict=True):
        torch.testing.assert_close(a, e)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)
    unselected = torch.ones(B * T, dtype=torch.bool)
    unselected[ROWS] = False
    assert (got[0].reshape(-1, H)[unselected] == 0).all()  # exactly zero, not merely small
    # the repeated row's gradient is the sum over its three uses
    per_use = gz @ w2.detach()  # each selected row's own gradient
    torch.testing.assert_close(got[0].reshape(-1, H)[3], per_use[[1, 2, 5]].sum(0))


@pytest.mark.parametrize("case", [
    dict(vocab_chunk_size=16, top_k=3),
    dict(backend="compile", log_probs_at=True),
    dict(keep="dense", main_grad=True),
    dict(keep="csr", entropy_of="kept", vocab_chunk_size=16),
])
def test_head_kept_equals_all_rows(case):
    """rows="kept" (and ("kept", count)) against the same call on all rows, options on."""
    case = dict(case)
    d = _data(seed=3)
    g = d["g"]
    mask = torch.rand(B, T, generator=g) < 0.5
    labels = d["labels"].clone()
    labels[0, 0] = -100
    kw = dict(temperature=torch.rand(B, T, generator=g, dtype=F64) + 0.5, label_mask=mask,
              compute_sum_pi_squared=True)
    kw.update({k: case[k] for k in ("top_k", "entropy_of") if k in case})
    kw["chunking"] = Chunking(4, case.get("vocab_chunk_size"), case.get("backend", "auto"))
    if case.get("log_probs_at"):
        kw["log_probs_at"] = torch.randint(0, V, (B, T, 2), generator=g)
    if case.get("keep") == "dense":
        kw["keep"] = torch.rand(B, T, V, generator=g) < 0.7
    elif case.get("keep") == "csr":
        lengths = torch.randint(1, 5, (B * T,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        kw["keep"] = (torch.randint(0, V, (int(offsets[-1]),), generator=g), offsets)
        kw["keep"][0][offsets[:-1]] = labels.reshape(-1).clamp(min=0)  # the label is in its kept set
    valid = mask & (labels != -100)
    outs, grads = [], []
    variants = (None, "kept", ("kept", int(valid.sum())))
    for rows in variants[::2] if case.get("backend") else variants:  # each compiled shape costs a compile
        h, w = _leaves(d["h"], d["w"])
        if case.get("main_grad"):
            w.main_grad = torch.zeros(V, H, dtype=F64)
        out = linear_log_probs_and_entropy(h, OutputLayer(w, softcap=6.0), labels, rows=rows, **kw)
        tensors = [out.log_probs, out.entropy, out.sum_pi_squared, out.log_probs_at, out.top_k_log_probs]
        ups = [None if t is None else torch.randn(t.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
               * (valid if t.dim() == 2 else valid[..., None]) for t in tensors]
        fused = case.get("main_grad")  # the weight gradient goes to main_grad (Megatron's fusion)
        gh, *gw = _grads([t for t in tensors if t is not None], [u for u in ups if u is not None],
                         [h] if fused else [h, w])
        gw = w.main_grad if fused else gw[0]
        on = lambda t: None if t is None else t * (valid if t.dim() == 2 else valid[..., None])  # noqa: E731
        outs.append([on(t) for t in tensors] + [None if out.top_k_ids is None else out.top_k_ids[valid]])
        grads.append((gh, gw))
        if rows is not None:  # zero on the skipped rows, exactly
            assert all(t is None or (t[~valid] == 0).all() for t in tensors)
    for other, og in zip(outs[1:], grads[1:], strict=True):
        for a, e in zip(other, outs[0], strict=True):
            if e is not None:
                torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
        for a, e in zip(og, grads[0], strict=True):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_module_forward_takes_rows():
    d = _data(seed=4)
    head = ChunkedVocabParallelHead(OutputLayer(d["w"], d["b"]), 4)
    lab = d["labels"].reshape(-1)[ROWS]
    out = head(d["h"], lab, rows=ROWS)
    lp, ent = head(d["h"].reshape(-1, H)[ROWS], lab)
    torch.testing.assert_close(out.log_probs, lp, rtol=0, atol=0)
    torch.testing.assert_close(out.entropy, ent, rtol=0, atol=0)


OPTS = dict(clip_ratio_low=0.15, clip_ratio_high=0.28, dro_beta=0.2, clip_cov_ratio=0.3, clip_cov_lb=-5.0,
            clip_cov_ub=5.0, kl_cov_ratio=0.2)
AGGS = losses.AGG_MODES


@pytest.mark.parametrize("i, mode", list(enumerate(losses.LOSS_MODES)))
def test_policy_loss_kept_equals_all_rows(i, mode):
    """Every objective (and, across them, every aggregation, rollout correction, KL, the entropy bonus)."""
    d = _data(seed=10 + i)
    g = d["g"]
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.5
    adv, ref = torch.randn(B, T, generator=g, dtype=F64), old + 0.1 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0, -1], mask[1] = True, False  # an empty sequence
    options = dict(OPTS)
    kw = dict(ref_log_probs=ref, temperature=0.9, chunking=4)
    if i % 3 == 0:
        kw.update(rollout_log_probs=old + 0.2 * torch.randn(B, T, generator=g, dtype=F64))
        options.update(rollout_is="token", rollout_rs="seq_mean_k1" if i % 2 else "token_k2",
                       rollout_rs_threshold=2.0)
    elif i % 3 == 1:
        kw["rollout_is_weights"] = torch.rand(B, T, generator=g, dtype=F64) + 0.5
    kw["loss"] = PolicyLoss(mode, options, entropy_coeff=0.03, kl_coef=0.1, aggregation=AGGS[i % len(AGGS)])
    results = []
    for rows in (None, "kept" if i % 2 else ("kept", T)):
        h, w = _leaves(d["h"], d["w"])
        torch.manual_seed(7)  # clip_cov / kl_cov draw
        loss, metrics = linear_policy_loss(h, w, d["labels"], old, adv, mask, rows=rows, **kw)
        results.append((loss, metrics, torch.autograd.grad(loss * 1.3, [h, w])))
    for loss, metrics, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        assert metrics.keys() == results[0][1].keys()
        for k in metrics:
            torch.testing.assert_close(metrics[k], results[0][1][k], msg=k)
        for a, e in zip(grads, results[0][2], strict=True):
            torch.testing.assert_close(a, e)
        assert (grads[0][~mask] == 0).all()


def test_policy_loss_index_is_the_unpacked_layout():
    """[B, T] rows of a packed sequence: every aggregation and a sequence-level objective equal the rollouts
    laid out unpacked, in float64 from the composition head -> losses.policy_loss."""
    d = _data(seed=30)
    g = d["g"]
    rows = torch.tensor([[0, 1, 2, 3], [0, 1, 9, 10], [14, 15, 16, 16]])  # a shared prefix; a repeat
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    lab = torch.randint(0, V, rows.shape, generator=g)
    old = -torch.rand(rows.shape, generator=g, dtype=F64) * 2 - 1
    adv = torch.randn(rows.shape, generator=g, dtype=F64)
    for mode, agg in (("gspo", "seq-mean-token-mean"), ("geo_mean", "seq-mean-token-sum"),
                      ("vanilla", "seq-mean-token-sum-norm"), ("clip_cov", "token-mean")):
        h, w = _leaves(d["h"], d["w"])
        torch.manual_seed(3)
        loss, _ = linear_policy_loss(h, w, lab, old, adv, mask, rows=rows,
                                     loss=PolicyLoss(mode, OPTS, entropy_coeff=0.02, aggregation=agg), chunking=2)
        got = torch.autograd.grad(loss, [h, w])
        h2, w2 = _leaves(d["h"], d["w"])
        lp, ent = reference(h2.reshape(-1, H)[rows] @ w2.t(), lab)
        torch.manual_seed(3)
        pg, _ = losses.policy_loss(lp, old, adv, mask, PolicyLoss(mode, OPTS, aggregation=agg))
        want_loss = pg - 0.02 * losses.entropy_bonus(ent, mask, agg)
        torch.testing.assert_close(loss.double(), want_loss)
        for a, e in zip(got, torch.autograd.grad(want_loss, [h2, w2]), strict=True):
            torch.testing.assert_close(a, e)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_divergences_kept_and_index(divergence):
    d = _data(seed=40)
    g = d["g"]
    ht, wt = torch.randn(B, T, 5, generator=g, dtype=F64), torch.randn(V, 5, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < 0.5
    beta = 0.3 if divergence == "jsd" else None
    kw = dict(divergence=Divergence(divergence, beta), chunking=Chunking(4, 16 if divergence == "jsd" else None),
              compute_entropy=True, temperature=torch.rand(B, T, generator=g, dtype=F64) + 0.5)
    ups = [torch.randn(B, T, generator=g, dtype=F64) * mask for _ in range(3)]
    res = []
    for rows in (None, "kept"):
        h, w, b = _leaves(d["h"], d["w"], d["b"])
        student = OutputLayer(w, b, softcap=5.0)
        o = linear_divergence(h, student, ht, wt, labels=d["labels"], label_mask=mask, rows=rows, **kw)
        loss = linear_divergence_loss(h, student, ht, wt, label_mask=mask, weights=ups[0].abs(), rows=rows, **kw)
        res.append(([t * mask for t in o], _grads(list(o), ups, [h, w, b]), loss.loss,
                    torch.autograd.grad(loss.loss, [h, w, b])))
        if rows is not None:
            assert all((t[~mask] == 0).all() for t in o)
    for a, e in zip(res[1], res[0], strict=True):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, e)
        else:
            for x, y in zip(a, e, strict=True):
                torch.testing.assert_close(x, y)
    # an index: the teacher's rows given per selected row
    h, w = _leaves(d["h"], d["w"])
    o = linear_divergence(h, w, ht.reshape(-1, 5)[ROWS], wt, rows=ROWS,
                          divergence=Divergence(divergence, beta=beta), chunking=3)
    h2, w2 = _leaves(d["h"], d["w"])
    e = linear_divergence(h2.reshape(-1, H)[ROWS], w2, ht.reshape(-1, 5)[ROWS], wt,
                          divergence=Divergence(divergence, beta=beta), chunking=3)
    torch.testing.assert_close(o.divergence, e.divergence, rtol=0, atol=0)
    up = torch.randn(ROWS.numel(), generator=g, dtype=F64)
    for a, x in zip(torch.autograd.grad((o.divergence * up).sum(), [h, w]),
                    torch.autograd.grad((e.divergence * up).sum(), [h2, w2]), strict=True):
        torch.testing.assert_close(a, x, rtol=0, atol=0)


def test_bad_rows_named_before_any_work():
    d = _data(seed=50)
    h, w = d["h"].clone().requires_grad_(), d["w"]
    lab = d["labels"].reshape(-1)[:2]
    before = h.detach().clone()
    cases = [
        (torch.tensor([0, B * T]), ValueError, "rows must index the 21 token rows"),
        (torch.tensor([-1, 0]), ValueError, "found -1"),
        (torch.tensor([0.0, 1.0]), TypeError, "rows must be an int64 index"),
        (torch.tensor([True, False]), TypeError, "bool"),
        (torch.tensor([0, 1], device="meta"), ValueError, "rows is on meta"),
        (torch.tensor([0, 1, 2]), ValueError, "with rows=, labels is given per selected row"),
        ("all", ValueError, "rows must be an int64 index tensor, 'kept'"),
        (("kept", -1), ValueError, "('kept', count)"),
    ]
    for rows, kind, text in cases:
        with pytest.raises(kind, match=text.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            linear_log_probs_and_entropy(h, w, lab, rows=rows)
    with pytest.raises(ValueError, match="labels keep"):
        linear_log_probs_and_entropy(h, w, d["labels"], rows=("kept", 3))
    with pytest.raises(ValueError, match="with rows='kept', labels must cover every token row"):
        linear_log_probs_and_entropy(h, w, d["labels"][:, :-1], rows="kept")
    with pytest.raises(ValueError, match="with rows='kept', labels must cover every token row"):
        short = torch.zeros(B, T - 1, dtype=F64)
        linear_policy_loss(h, w, d["labels"][:, :-1], short, short, short > -1, rows="kept")
    with pytest.raises(ValueError, match=r"rows of the policy loss must be \[B, T\]"):
        linear_policy_loss(h, w, lab, lab.double(), lab.double(), lab > 0, rows=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="with rows=, old_log_probs is given per selected row"):
        r = torch.tensor([[0, 1]])
        linear_policy_loss(h, w, lab[None], torch.zeros(1, 3, dtype=F64), torch.zeros(1, 2, dtype=F64),
                           torch.ones(1, 2, dtype=torch.bool), rows=r)
    assert torch.equal(h.detach(), before) and h.grad is None


# ---------------------------------------------------------------- TP 2 + SP over gloo


def _tp_sp(rank, world):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    s, b, v = 6, 2, 16
    h_full = torch.randn(s, b, H, generator=g, dtype=F64)
    w_full = torch.randn(v, H, generator=g, dtype=F64)
    rows = torch.tensor([11, 0, 0, 7, 3])  # rows of the gathered [S, B]: s * B + b
    lab = torch.randint(0, v, (rows.numel(),), generator=g)
    up = torch.randn(rows.numel(), generator=g, dtype=F64)
    h64, w64 = _leaves(h_full, w_full)
    lp_ref, ent_ref = reference(h64.reshape(-1, H)[rows] @ w64.t(), lab)
    ((lp_ref + ent_ref) * up).sum().backward()
    sl, vl = s // world, v // world
    h = h_full[rank * sl:(rank + 1) * sl].clone().requires_grad_()
    w = w_full[rank * vl:(rank + 1) * vl].clone().requires_grad_()
    out = linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group, sequence_parallel=True), lab, rows=rows,
                                       chunking=2)
    ((out.log_probs + out.entropy) * up).sum().backward()
    torch.testing.assert_close(out.log_probs, lp_ref)
    torch.testing.assert_close(out.entropy, ent_ref)
    torch.testing.assert_close(h.grad, h64.grad[rank * sl:(rank + 1) * sl])
    torch.testing.assert_close(w.grad, w64.grad[rank * vl:(rank + 1) * vl])
    # "kept" under SP: the labels of the full gathered sequence
    labels = torch.randint(0, v, (s, b), generator=g)
    mask = torch.rand(s, b, generator=g) < 0.5
    kept = linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group, sequence_parallel=True), labels,
                                        label_mask=mask, rows="kept")
    full = linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group, sequence_parallel=True), labels,
                                        label_mask=mask)
    torch.testing.assert_close(kept.entropy, full.entropy * mask)
    torch.testing.assert_close(kept.log_probs, full.log_probs)
    # ranks that differ: refused on every rank, naming rows
    with pytest.raises(ValueError, match="rows"):
        linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group, sequence_parallel=True), lab,
                                     rows=rows if rank == 0 else rows.flip(0))
    with pytest.raises(ValueError, match="rows"):
        linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group, sequence_parallel=True), lab,
                                     rows=rows if rank == 0 else rows + 100)
    # the group still works
    out = linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group, sequence_parallel=True), lab, rows=rows)
    torch.testing.assert_close(out.log_probs, lp_ref)
    # the policy loss: [B', T'] rows of the gathered [S, B] sequence, a sequence-level objective
    rows2 = torch.tensor([[0, 2, 4, 6], [1, 3, 3, 11]])
    lab2 = torch.randint(0, v, rows2.shape, generator=g)
    old, adv = -torch.rand(rows2.shape, generator=g, dtype=F64) - 1, torch.randn(rows2.shape, generator=g, dtype=F64)
    mask2 = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    h.grad = w.grad = None
    loss, _ = linear_policy_loss(h, OutputLayer(w, process_group=group, sequence_parallel=True), lab2, old, adv, mask2,
                                 rows=rows2, loss=PolicyLoss("gspo", aggregation="seq-mean-token-mean"), chunking=4)
    loss.backward()
    h64, w64 = _leaves(h_full, w_full)
    lp, _ = reference(h64.reshape(-1, H)[rows2] @ w64.t(), lab2)
    want = losses.policy_loss(lp, old, adv, mask2, PolicyLoss("gspo", aggregation="seq-mean-token-mean"))[0]
    want.backward()
    torch.testing.assert_close(loss.double(), want)
    torch.testing.assert_close(h.grad, h64.grad[rank * sl:(rank + 1) * sl])
    torch.testing.assert_close(w.grad, w64.grad[rank * vl:(rank + 1) * vl])


def test_tensor_and_sequence_parallel_2():
    run_distributed(_tp_sp, 2, timeout_s=60)


def _refused_on_one_rank_sp(rank, world):
    """Issue 45 item 1 under sequence parallelism: rank 1's rows refused before the op's agreement (reading
    ``rows``, building the kept rows) reach every rank, each naming rank 1, and the next call works."""
    import re
    import time

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    s, b, v = 6, 2, 16
    h_full, w_full = torch.randn(s, b, H, generator=g, dtype=F64), torch.randn(v, H, generator=g, dtype=F64)
    labels = torch.randint(0, v, (s, b), generator=g)
    sl, vl = s // world, v // world
    h, w = h_full[rank * sl:(rank + 1) * sl], w_full[rank * vl:(rank + 1) * vl]
    sp, plain = OutputLayer(w, process_group=group, sequence_parallel=True), OutputLayer(w, process_group=group)
    lab2 = labels.t().contiguous()  # the policy loss's [B, T] of the gathered sequence
    f2, m2 = torch.zeros(b, s, dtype=F64), torch.ones(b, s)
    idx = torch.tensor([3, 0, 0, 2])  # rows every rank holds, with and without sequence parallelism
    lin = lambda layer=sp, lab=labels, **kw: linear_log_probs_and_entropy(h, layer, lab, **kw)  # noqa: E731
    pol = lambda mask=m2, **kw: linear_policy_loss(h, sp, lab2, f2, f2, mask, **kw)  # noqa: E731
    cases = [  # (what, rank 1's call, the others' call)
        ("rows='kep'", lambda: lin(rows="kep"), lambda: lin(rows="kept")),
        ("('kept', n) above the rows", lambda: lin(rows=("kept", 10**3)), lambda: lin(rows="kept")),
        ("'kept' without labels", lambda: lin(lab=None, rows="kept", log_probs_at=labels[..., None]),
         lambda: lin(rows="kept", log_probs_at=labels[..., None])),
        ("'kept' with labels of another shape", lambda: lin(lab=labels[:-1], rows="kept"),
         lambda: lin(rows="kept")),
        ("1-D rows of the policy loss", lambda: pol(rows=idx), lambda: pol(rows=idx.view(2, 2))),
        ("('kept', T + 1) of the policy loss", lambda: pol(rows=("kept", s + 1)), lambda: pol(rows=("kept", s))),
        ("'kept' with a 1-D loss_mask", lambda: pol(mask=m2.reshape(-1), rows="kept"), lambda: pol(rows="kept")),
        ("the same index with sequence_parallel on this rank only",  # it alone would gather the sequence
         lambda: lin(lab=labels.reshape(-1)[idx], rows=idx), lambda: lin(layer=plain, lab=labels.reshape(-1)[idx],
                                                                          rows=idx)),
    ]
    want = lin(rows="kept").log_probs
    for what, mine, theirs in cases:
        t0 = time.monotonic()
        with pytest.raises((ValueError, TypeError)) as e:
            (mine if rank == 1 else theirs)()
        took = time.monotonic() - t0
        every = [None] * world
        dist.all_gather_object(every, re.sub(r"this is rank \d", "", str(e.value)))
        assert len(set(every)) == 1 and "rank 1" in every[0], (what, every)
        assert took < 10, (what, took)
        torch.testing.assert_close(lin(rows="kept").log_probs, want, rtol=0, atol=0)  # the group still works


@pytest.mark.parametrize("world", [2, 3])
def test_rows_refused_on_one_rank_under_sequence_parallelism_reach_every_rank(world):
    run_distributed(_refused_on_one_rank_sp, world, timeout_s=20, deadline_s=180)


# ---------------------------------------------------------------- tree packing


def test_tree_packed_rollouts_equal_each_rollout_on_its_own():
    """A prompt P (3 tokens), two branches A (2) and B (3), A splitting into A1 (2) and A2 (1): packed once as
    P A A1 A2 B (11 rows). Each root-to-leaf rollout is the sequence of its nodes; the row that scores a
    rollout's position t is the packed position of its t-th token (a shared node's rows repeat across the
    rollouts through it). Against each rollout computed on its own in float64: log-probs, entropy, the fused
    loss in every aggregation mode, a divergence, and the hidden gradient summed over the branches."""
    g = torch.Generator().manual_seed(60)
    nodes = {"P": (0, 3), "A": (3, 5), "A1": (5, 7), "A2": (7, 8), "B": (8, 11)}
    paths = [["P", "A", "A1"], ["P", "A", "A2"], ["P", "B"]]
    n_packed, t_max = 11, 7
    packed = torch.randn(n_packed, H, generator=g, dtype=F64)  # the model's hidden states of the packed tree
    w = torch.randn(V, H, generator=g, dtype=F64)
    ht_packed, wt = torch.randn(n_packed, 4, generator=g, dtype=F64), torch.randn(V, 4, generator=g, dtype=F64)
    # the layout: one row per (rollout, position), padded (masked) to the longest rollout
    rows = torch.zeros(len(paths), t_max, dtype=torch.int64)
    mask = torch.zeros(len(paths), t_max, dtype=torch.bool)
    for i, path in enumerate(paths):
        pos = torch.cat([torch.arange(*nodes[n]) for n in path])
        rows[i, :pos.numel()] = pos
        mask[i, 3:pos.numel()] = True  # the response: every token after the prompt
    labels = torch.randint(0, V, rows.shape, generator=g)
    old = -torch.rand(rows.shape, generator=g, dtype=F64) * 2 - 1
    adv = torch.randn(rows.shape, generator=g, dtype=F64)

    lengths = [sum(nodes[n][1] - nodes[n][0] for n in p) for p in paths]
    # per token: log-probs and entropy of the packed call against each rollout's own
    h = packed.clone().requires_grad_()
    out = linear_log_probs_and_entropy(h, w, labels, rows=rows, label_mask=mask, chunking=4)
    up = torch.randn(rows.shape, generator=g, dtype=F64) * mask
    (((out.log_probs + out.entropy) * up).sum()).backward()
    hr = packed.clone().requires_grad_()
    grad_sum = torch.zeros_like(packed)
    for i, n in enumerate(lengths):
        # rollout i's own hidden states, [n, H] (what its unpacked forward computes: tree attention gives each
        # token the same states as the rollout alone)
        own = hr[rows[i, :n]].detach().clone().requires_grad_()
        lp, ent = reference(own @ w.t(), labels[i, :n], label_mask=mask[i, :n])
        torch.testing.assert_close(out.log_probs[i, :n], lp)
        torch.testing.assert_close(out.entropy[i, :n] * mask[i, :n], ent * mask[i, :n])
        ((lp + ent) * up[i, :n]).sum().backward()
        grad_sum.index_add_(0, rows[i, :n], own.grad)  # the shared rows: the sum over the branches
    torch.testing.assert_close(h.grad, grad_sum)
    # the fused loss, every aggregation mode: the packed call against the composition over the rollouts
    for agg in losses.AGG_MODES:
        h = packed.clone().requires_grad_()
        loss, _ = linear_policy_loss(h, w, labels, old, adv, mask, rows=rows,
                                     loss=PolicyLoss("gspo", entropy_coeff=0.01, aggregation=agg), chunking=4)
        loss.backward()
        h2 = packed.clone().requires_grad_()
        lp, ent = reference(h2[rows] @ w.t(), labels, label_mask=mask)
        ref_loss = (losses.policy_loss(lp, old, adv, mask, PolicyLoss("gspo", aggregation=agg))[0]
                    - 0.01 * losses.entropy_bonus(ent, mask, agg))
        ref_loss.backward()
        torch.testing.assert_close(loss.double(), ref_loss)
        torch.testing.assert_close(h.grad, h2.grad)
    # a divergence: the teacher's rows of the same tree, per selected row
    h = packed.clone().requires_grad_()
    d = linear_divergence(h, w, ht_packed[rows], wt, label_mask=mask, rows=rows, divergence="reverse_kl")
    (d.divergence * up).sum().backward()
    h2 = packed.clone().requires_grad_()
    ls = torch.log_softmax(h2[rows] @ w.t(), -1)
    lt = torch.log_softmax(ht_packed[rows] @ wt.t(), -1)
    ref_div = (ls.exp() * (ls - lt)).sum(-1) * mask
    (ref_div * up).sum().backward()
    torch.testing.assert_close(d.divergence, ref_div)
    torch.testing.assert_close(h.grad, h2.grad)


def test_logits_twins_take_the_same_index():
    """log_probs_and_entropy, policy_loss_from_logits and divergence_from_logits over logit rows: equal to the
    call on the rows gathered by hand, the logits' gradient summed over repeats and zero elsewhere."""
    from chunked_entropy import divergence_from_logits, log_probs_and_entropy, policy_loss_from_logits

    g = torch.Generator().manual_seed(70)
    z = torch.randn(B, T, V, generator=g, dtype=F64)
    zt = torch.randn(ROWS.numel(), V, generator=g, dtype=F64)
    lab = torch.randint(0, V, (ROWS.numel(),), generator=g)
    up = torch.randn(ROWS.numel(), generator=g, dtype=F64)
    rows2 = ROWS.view(2, 4)
    old, adv = -torch.rand(2, 4, generator=g, dtype=F64) - 1, torch.randn(2, 4, generator=g, dtype=F64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    calls = [
        lambda x, r: (lambda o: (o.log_probs + o.entropy) * up)(log_probs_and_entropy(x, lab, rows=r, chunking=3)),
        lambda x, r: policy_loss_from_logits(x, lab.view(2, 4), old, adv, mask, rows=None if r is None else rows2,
                                             loss=PolicyLoss("gspo", aggregation="seq-mean-token-mean"))[0],
        lambda x, r: divergence_from_logits(x, zt, rows=r, divergence=Divergence("jsd", beta=0.4)).divergence * up,
    ]
    for call in calls:
        x = z.clone().requires_grad_()
        got = call(x, ROWS)
        (gx,) = torch.autograd.grad(got.sum(), x)
        x2 = z.clone().requires_grad_()
        sel = x2.reshape(-1, V)[ROWS]
        want = call(sel.view(2, 4, V) if got.dim() == 0 else sel, None)
        (gx2,) = torch.autograd.grad(want.sum(), x2)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(gx, gx2)
        assert (gx.reshape(-1, V)[[1, 2, 4]] == 0).all()
    with pytest.raises(ValueError, match="rows='kept' is for the ops over hidden states"):
        log_probs_and_entropy(z, torch.zeros(B, T, dtype=torch.int64), rows="kept")


def test_no_row_selected():
    """An empty index and "kept" with nothing kept: zero outputs of the right shape, connected, zero gradients."""
    d = _data(seed=80)
    h = d["h"].clone().requires_grad_()
    none = torch.zeros(0, dtype=torch.int64)
    out = linear_log_probs_and_entropy(h, d["w"], none, rows=none)
    assert out.log_probs.shape == (0,) and out.entropy.shape == (0,)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert (h.grad == 0).all()
    ignored = torch.full((B, T), -100)
    for rows in ("kept", ("kept", 0)):
        out = linear_log_probs_and_entropy(h, d["w"], ignored, rows=rows)
        assert out.entropy.shape == (B, T) and (out.entropy == 0).all()
    mask = torch.zeros(B, T, dtype=torch.bool)
    zeros = torch.zeros(B, T, dtype=F64)
    loss, _ = linear_policy_loss(h, d["w"], d["labels"], zeros, zeros, mask, rows="kept")
    assert loss == 0 and torch.autograd.grad(loss, h)[0].eq(0).all()


def test_bf16_index_with_repeats_against_float64_no_worse_than_plain_bf16_autograd():
    """bf16 hidden states and weight, an index whose rows repeat many times (one row 64 times): log-probs,
    entropy and the hidden/weight/bias gradients against float64 from the same (rounded) bf16 inputs, each no
    worse than plain bf16 autograd of the same selection (``h[rows] @ w.T + b`` in bf16, then float32
    statistics), and within bf16 rounding of float64. A repeated row's gradient is its uses' sum; a row never
    selected gets exactly 0."""
    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(90)
    n, hid, vocab = 24, 64, 512
    h0 = torch.randn(n, hid, generator=g).to(bf16)
    w0 = (torch.randn(vocab, hid, generator=g) * 0.2).to(bf16)
    b0 = (torch.randn(vocab, generator=g) * 0.3).to(bf16)
    rows = torch.cat([torch.full((64,), 5), torch.full((16,), 2), torch.randint(0, n, (40,), generator=g)])
    rows = rows[torch.randperm(rows.numel(), generator=g)]
    assert (torch.bincount(rows, minlength=n) == 0).any()  # some rows never selected
    lab = torch.randint(0, vocab, (rows.numel(),), generator=g)
    temp = torch.rand(rows.numel(), generator=g) + 0.5
    ups = [torch.randn(rows.numel(), generator=g, dtype=F64) for _ in range(2)]

    h, w, b = _leaves(h0.double(), w0.double(), b0.double())
    ref = reference(h[rows] @ w.t() + b, lab, temperature=temp.double())
    want = _grads(ref, ups, [h, w, b])

    h, w, b = _leaves(h0, w0, b0)
    out = linear_log_probs_and_entropy(h, OutputLayer(w, b), lab, rows=rows, temperature=temp, chunking=16)
    ours = [out.log_probs, out.entropy, *_grads([out.log_probs, out.entropy], ups, [h, w, b])]
    assert out.log_probs.dtype == torch.float32 and ours[2].dtype == bf16

    h, w, b = _leaves(h0, w0, b0)
    logp = torch.log_softmax((h[rows] @ w.t() + b).float() / temp[:, None], dim=-1)
    plain_lp, plain_ent = logp.gather(-1, lab[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    plain = [plain_lp, plain_ent, *_grads([plain_lp, plain_ent], ups, [h, w, b])]

    def err(a, e):
        return float((a.detach().double() - e.detach()).abs().max() / e.detach().abs().max())

    for name, a, p, e in zip(("log_probs", "entropy", "hidden grad", "weight grad", "bias grad"), ours, plain,
                             [*ref, *want], strict=True):
        assert err(a, e) <= 1.25 * err(p, e) and err(a, e) < 2e-2, (name, err(a, e), err(p, e))
    selected = torch.bincount(rows, minlength=n) > 0
    assert (ours[2][~selected] == 0).all()
    for row in (5, 2):  # the rows used 64+ and 16+ times
        assert err(ours[2][row], want[0][row]) <= 1.25 * err(plain[2][row], want[0][row]) + 1e-3, row


# ---------------------------------------------------------------- one exchange with rows= (TP 2 over gloo)


class _Collectives:
    """Counts, while active, the call's agreement exchanges (:meth:`~chunked_entropy.parallel.CallCheck.exchange`,
    our own code, wrapped) and every collective the group makes (``torch.distributed``'s all-reduce and
    all-gathers, wrapped: each still runs)."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather", "all_gather_single", "all_gather_object")

    def __enter__(self):
        from chunked_entropy.parallel import CallCheck

        self.exchanges, self.calls, self.saved = 0, [], {}
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self.saved[(dist, name)] = fn
                setattr(dist, name, lambda *a, _fn=fn, _name=name, **kw: (self.calls.append(_name), _fn(*a, **kw))[1])
        exchange = CallCheck.exchange
        self.saved[(CallCheck, "exchange")] = exchange

        def counted(call, error):
            self.exchanges += 1
            return exchange(call, error)

        CallCheck.exchange = counted
        return self

    def __exit__(self, *exc):
        for (owner, name), fn in self.saved.items():
            setattr(owner, name, fn)


def _one_exchange(rank, world):
    """Every op that takes ``rows=``, under TP 2 (with sequence parallelism where the op has it): the call with
    rows makes one agreement exchange, as the same call without rows does, and the same collectives (one chunk
    either way, so the chunk loop's collectives are the same; under sequence parallelism the rows' all-gather
    stands where the op's own gather of the slices stood). Each call's values are checked on the way against
    the op on the rows selected by hand (itself tested against float64 above)."""
    from collections import Counter

    from chunked_entropy import divergence_from_logits, log_probs_and_entropy, policy_loss_from_logits

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(7)
    s, b, v, ht = 6, 2, 16, 5
    h_full, w_full = torch.randn(s, b, H, generator=g, dtype=F64), torch.randn(v, H, generator=g, dtype=F64)
    t_full, wt_full = torch.randn(s, b, ht, generator=g, dtype=F64), torch.randn(v, ht, generator=g, dtype=F64)
    labels = torch.randint(0, v, (s, b), generator=g)
    mask = torch.rand(s, b, generator=g) < 0.6
    sl, vl = s // world, v // world
    h, hs_t = h_full[rank * sl:(rank + 1) * sl], t_full[rank * sl:(rank + 1) * sl]
    w, wt = w_full[rank * vl:(rank + 1) * vl], wt_full[rank * vl:(rank + 1) * vl]
    plain, sp = OutputLayer(w, process_group=group), OutputLayer(w, process_group=group, sequence_parallel=True)
    t_plain = OutputLayer(wt, process_group=group)
    t_sp = OutputLayer(wt, process_group=group, sequence_parallel=True)
    idx = torch.tensor([11, 0, 0, 7, 3, 5, 2, 9])  # rows of the gathered [S, B]: s * B + b
    flat_h, flat_t, lab = h_full.reshape(-1, H), t_full.reshape(-1, ht), labels.reshape(-1)
    kept = mask.reshape(-1).nonzero().squeeze(1)
    n_kept = kept.numel()
    z, zt = flat_h @ w.t(), flat_t @ wt.t()  # this rank's logits of every row
    idx2 = idx.view(2, 4)
    old, adv = -torch.rand(2, 4, generator=g, dtype=F64) - 1, torch.randn(2, 4, generator=g, dtype=F64)
    m2 = torch.ones(2, 4, dtype=torch.bool)
    one = Chunking(64)  # one chunk, with rows and without
    head = ChunkedVocabParallelHead(sp, chunking=one)
    lin = linear_log_probs_and_entropy
    cases = [  # (what, the call with rows, the same call without rows, its output's first tensor to compare)
        ("linear, index, sequence parallel", lambda: lin(h, sp, lab[idx], rows=idx, chunking=one),
         lambda: lin(h, sp, labels, chunking=one)),
        ("linear, 'kept', sequence parallel", lambda: lin(h, sp, labels, label_mask=mask, rows="kept", chunking=one),
         lambda: lin(h, sp, labels, label_mask=mask, chunking=one)),
        ("linear, ('kept', n)", lambda: lin(flat_h, plain, lab, label_mask=mask.reshape(-1),
                                            rows=("kept", n_kept), chunking=one),
         lambda: lin(flat_h, plain, lab, label_mask=mask.reshape(-1), chunking=one)),
        ("the head, index, sequence parallel", lambda: head(h, lab[idx], rows=idx), lambda: head(h, labels)),
        ("policy loss, [B, T] index, sequence parallel",
         lambda: linear_policy_loss(h, sp, lab[idx2], old, adv, m2, rows=idx2, chunking=one),
         lambda: linear_policy_loss(h, sp, labels.t(), old.new_zeros(b, s), adv.new_zeros(b, s),
                                    torch.ones(b, s, dtype=torch.bool), chunking=one)),
        ("policy loss, 'kept'",
         lambda: linear_policy_loss(h_full, plain, labels, old.new_zeros(s, b), adv.new_ones(s, b), mask,
                                    rows="kept", chunking=one),
         lambda: linear_policy_loss(h_full, plain, labels, old.new_zeros(s, b), adv.new_ones(s, b), mask,
                                    chunking=one)),
        ("divergence, index", lambda: linear_divergence(flat_h, plain, flat_t[idx], t_plain, labels=lab[idx],
                                                       rows=idx, chunking=one),
         lambda: linear_divergence(flat_h, plain, flat_t, t_plain, labels=lab, chunking=one)),
        ("divergence, 'kept', sequence parallel",
         lambda: linear_divergence(h, sp, hs_t, t_sp, labels=labels, label_mask=mask, rows="kept", chunking=one),
         lambda: linear_divergence(h, sp, hs_t, t_sp, labels=labels, label_mask=mask, chunking=one)),
        ("divergence loss, ('kept', n), sequence parallel",
         lambda: linear_divergence_loss(h, sp, hs_t, t_sp, label_mask=mask, rows=("kept", n_kept), chunking=one),
         lambda: linear_divergence_loss(h, sp, hs_t, t_sp, label_mask=mask, chunking=one)),
        ("logits, index", lambda: log_probs_and_entropy(z, lab[idx], layer=OutputLayer(process_group=group),
                                                        rows=idx, chunking=one),
         lambda: log_probs_and_entropy(z, lab, layer=OutputLayer(process_group=group), chunking=one)),
        ("policy loss from logits, [B, T] index",
         lambda: policy_loss_from_logits(z, lab[idx2], old, adv, m2, layer=OutputLayer(process_group=group),
                                         rows=idx2, chunking=one),
         lambda: policy_loss_from_logits(z.view(3, 4, vl), lab.view(3, 4), old.new_zeros(3, 4),
                                         adv.new_zeros(3, 4), torch.ones(3, 4, dtype=torch.bool),
                                         layer=OutputLayer(process_group=group), chunking=one)),
        ("divergence from logits, index",
         lambda: divergence_from_logits(z, zt[idx], labels=lab[idx], student_layer=OutputLayer(process_group=group),
                                        teacher_layer=OutputLayer(process_group=group), rows=idx, chunking=one),
         lambda: divergence_from_logits(z, zt, labels=lab, student_layer=OutputLayer(process_group=group),
                                        teacher_layer=OutputLayer(process_group=group), chunking=one)),
    ]
    for what, with_rows, without in cases:
        with _Collectives() as mine:
            out = with_rows()
        with _Collectives() as theirs:
            full = without()
        assert mine.exchanges == 1 == theirs.exchanges, (what, mine.exchanges, theirs.exchanges)
        assert Counter(mine.calls) == Counter(theirs.calls), (what, mine.calls, theirs.calls)
        assert torch.isfinite(out[0]).all() and torch.isfinite(full[0]).all(), what
    # the values on the way: the rows' outputs are the selected rows' outputs of the call on every row
    got = lin(h, sp, lab[idx], rows=idx, chunking=one)
    want = lin(h, sp, labels, chunking=one)
    torch.testing.assert_close(got.log_probs, want.log_probs.reshape(-1)[idx], rtol=0, atol=1e-12)
    got = linear_divergence(h, sp, hs_t, t_sp, labels=labels, label_mask=mask, rows="kept", chunking=one)
    want = linear_divergence(h, sp, hs_t, t_sp, labels=labels, label_mask=mask, chunking=one)
    torch.testing.assert_close(got.divergence, want.divergence * mask, rtol=0, atol=1e-12)
    # a rank's bad rows: refused on every rank in that one exchange (or, read on this rank alone, in the one it
    # joins), naming rows and the rank; no work begun (no all-reduce of the chunk loop)
    for bad in (idx + 100, idx.float(), idx.flip(0)):
        with _Collectives() as count, pytest.raises((ValueError, TypeError)) as e:
            lin(h, sp, lab[idx], rows=bad if rank == 1 else idx, chunking=one)
        assert "rows" in str(e.value) and "rank 1" in str(e.value) and f"this is rank {rank}" in str(e.value), e
        assert count.exchanges == 1 and "all_reduce" not in count.calls, (count.calls, str(e.value))
    # a teacher's NaN in a selected row of rank 0's slice: refused on every rank, naming it
    bad_t = hs_t.clone()
    if rank == 0:
        bad_t[1, 1, 0] = float("nan")  # row s * B + b = 3 of the gathered sequence
    keep = torch.zeros(s, b, dtype=torch.bool)
    keep.view(-1)[3] = True
    with pytest.raises(ValueError, match=r"teacher_hidden must be finite .*rank 0"):
        linear_divergence(h, sp, bad_t, t_sp, labels=labels, label_mask=keep, rows="kept")
    keep.view(-1)[3], keep.view(-1)[4] = False, True  # the NaN's row not selected: no refusal
    assert torch.isfinite(linear_divergence(h, sp, bad_t, t_sp, labels=labels, label_mask=keep,
                                            rows="kept").divergence).all()


def test_rows_make_one_exchange_under_tp2():
    run_distributed(_one_exchange, 2, timeout_s=30, deadline_s=240)


def test_the_selected_rows_are_read_only_once_filled(monkeypatch):
    """The selected rows exist before the call is agreed and are filled after it (:class:`Selection`): nothing
    may read them before. With the unfilled rows NaN (a wrapper around our own ``_SelectRows.forward``), every
    op that takes ``rows=`` still gives the bits of the same op on the rows selected by hand, the logits op's
    own-filter ``keep`` (which reads the rows in the call's deferred work) included."""
    from chunked_entropy import _rows, divergence_from_logits, log_probs_and_entropy, policy_loss_from_logits

    d = _data(seed=95)
    h, w, lab = d["h"], d["w"], d["labels"]
    ht, wt = torch.randn(B, T, 4, generator=d["g"], dtype=F64), torch.randn(V, 4, generator=d["g"], dtype=F64)
    mask = torch.rand(B, T, generator=d["g"]) < 0.5
    kept = mask.reshape(-1).nonzero().squeeze(1)
    hr, tr, lr, z = h.reshape(-1, H), ht.reshape(-1, 4), lab.reshape(-1), (h @ w.t()).reshape(-1, V)
    zt = tr @ wt.t()
    r2 = ROWS.view(2, 4)
    f2 = torch.zeros(2, 4, dtype=F64)
    at_kept = lambda t: t.reshape(-1)[kept] if t.dim() else t  # noqa: E731
    same = lambda t: t  # noqa: E731
    cases = [  # (the call with rows, the same op on the rows selected by hand, what of the first to compare)
        (lambda: linear_log_probs_and_entropy(h, w, lr[ROWS], rows=ROWS, chunking=3),
         lambda: linear_log_probs_and_entropy(hr[ROWS], w, lr[ROWS], chunking=3), same),
        (lambda: linear_log_probs_and_entropy(h, w, lab, label_mask=mask, rows="kept", chunking=3),
         lambda: linear_log_probs_and_entropy(hr[kept], w, lr[kept], chunking=3), at_kept),
        (lambda: linear_policy_loss(h, w, lr[r2], f2 - 1, f2 + 1, f2 == 0, rows=r2, chunking=3),
         lambda: linear_policy_loss(hr[r2], w, lr[r2], f2 - 1, f2 + 1, f2 == 0, chunking=3), same),
        (lambda: linear_divergence(h, w, ht, wt, labels=lab, label_mask=mask, rows="kept", chunking=3),
         lambda: linear_divergence(hr[kept], w, tr[kept], wt, labels=lr[kept], chunking=3), at_kept),
        (lambda: linear_divergence_loss(h, w, tr[ROWS], wt, rows=ROWS, chunking=3),
         lambda: linear_divergence_loss(hr[ROWS], w, tr[ROWS], wt, chunking=3), same),
        (lambda: log_probs_and_entropy(z, lr[ROWS], rows=ROWS, keep={"top_k": 5}, chunking=3),
         lambda: log_probs_and_entropy(z[ROWS], lr[ROWS], keep={"top_k": 5}, chunking=3), same),
        (lambda: policy_loss_from_logits(z, lr[r2], f2 - 1, f2 + 1, f2 == 0, rows=r2, chunking=3),
         lambda: policy_loss_from_logits(z[r2], lr[r2], f2 - 1, f2 + 1, f2 == 0, chunking=3), same),
        (lambda: divergence_from_logits(z, zt[ROWS], labels=lr[ROWS], rows=ROWS, chunking=3),
         lambda: divergence_from_logits(z[ROWS], zt[ROWS], labels=lr[ROWS], chunking=3), same),
    ]
    forward = _rows._SelectRows.forward

    def unfilled_nan(ctx, *args):
        return forward(ctx, *args).fill_(float("nan"))

    monkeypatch.setattr(_rows._SelectRows, "forward", staticmethod(unfilled_nan))
    for i, (with_rows, by_hand, pick) in enumerate(cases):
        got, want = with_rows(), by_hand()
        for a, b in zip(got, want, strict=True):
            if isinstance(a, torch.Tensor) and a.numel():
                torch.testing.assert_close(pick(a), b, rtol=0, atol=0, msg=lambda m, i=i: f"case {i}: {m}")
