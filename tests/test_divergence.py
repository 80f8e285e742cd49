"""Divergences between a student's and a teacher's distributions: values and gradients against float64
references written from the definitions, from logits and from hidden states, TP 2 and SP over gloo,
the loss form, half precision, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import (
    Chunking,
    Divergence,
    OutputLayer,
    divergence_from_logits,
    linear_divergence,
    linear_divergence_loss,
)
from tests.helpers import run_distributed

KINDS = [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.3)]


def transformed(z, *, temperature=1.0, softcap=None, logit_scale=None):
    """``softcap * tanh(logit_scale * z / softcap) / t`` in the logits' dtype (float64 here)."""
    if isinstance(temperature, torch.Tensor):
        temperature = torch.broadcast_to(temperature.to(z.dtype), z.shape[:-1]).unsqueeze(-1)
    z = z if logit_scale is None else z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def reference(zs, zt, kind, beta=None, *, temperature=1.0, student=None, teacher=None):
    """The per-token divergence from its definition, float64, differentiable w.r.t. ``zs``.

    forward KL = sum p_t log(p_t / p_s); reverse KL = sum p_s log(p_s / p_t); JSD(beta) =
    beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = (1 - beta) p_s + beta p_t (TRL's generalized JSD).
    """
    lps = torch.log_softmax(transformed(zs, temperature=temperature, **(student or {})), -1)
    lpt = torch.log_softmax(transformed(zt, temperature=temperature, **(teacher or {})), -1)
    ps, pt = lps.exp(), lpt.exp()
    if kind == "forward_kl":
        return (pt * (lpt - lps)).sum(-1)
    if kind == "reverse_kl":
        return (ps * (lps - lpt)).sum(-1)
    log_m = torch.logaddexp(lps + math.log(1 - beta), lpt + math.log(beta))  # log m, also where m underflows
    return beta * (pt * (lpt - log_m)).sum(-1) + (1 - beta) * (ps * (lps - log_m)).sum(-1)


def student_reference(zs, labels, *, temperature=1.0, student=None, valid=None):
    """The student's log-prob at ``labels`` (0 where not valid) and entropy, float64."""
    lps = torch.log_softmax(transformed(zs, temperature=temperature, **(student or {})), -1)
    lp = lps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lp, 0.0), -(lps.exp() * lps).sum(-1)


def _close(actual, expected, what, tol=1e-9):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


CASES = {
    "plain": dict(),
    "student offset": dict(offset_s=3e3),
    "teacher offset": dict(offset_t=-5e3),
    "tiny temperature": dict(temperature=0.02),
    "per-token temperature": dict(temperature="per-token"),
    "soft-cap on the student": dict(student=dict(softcap=4.0, logit_scale=1.3)),
    "soft-cap on the teacher": dict(teacher=dict(softcap=3.0), temperature=0.7),
    "masked rows": dict(masked=True),
}


def _problem(seed, n=(3, 7), v=29, *, offset_s=0.0, offset_t=0.0, temperature=1.0, masked=False, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(*n, v, generator=g, dtype=torch.float64) * scale + offset_s
    zt = torch.randn(*n, v, generator=g, dtype=torch.float64) * scale + offset_t
    zt[0, 0] = zs[0, 0] - offset_s + offset_t  # one row where teacher == student up to a constant shift
    labels = torch.randint(0, v, n, generator=g)
    mask = None
    if masked:
        mask = torch.rand(*n, generator=g) > 0.3
        labels[0, 1] = -100
    if temperature == "per-token":
        temperature = torch.rand(*n, generator=g, dtype=torch.float64) * 1.5 + 0.05
    ups = [torch.randn(*n, generator=g, dtype=torch.float64) for _ in range(3)]
    return zs, zt, labels, mask, temperature, ups


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind,beta", KINDS)
def test_from_logits_matches_float64_definitions(kind, beta, case):
    spec = dict(CASES[case])
    student, teacher = spec.pop("student", None), spec.pop("teacher", None)
    seed = 10 * [k for k, _ in KINDS].index(kind) + list(CASES).index(case)  # fixed: hash() varies per process
    zs, zt, labels, mask, t, (g_d, g_lp, g_h) = _problem(seed, **spec)
    valid = labels != -100 if mask is None else (labels != -100) & mask
    rows = valid  # with labels, a row labelled ignore_index counts no divergence either
    zs_ref = zs.clone().requires_grad_()
    d_ref = torch.where(rows, reference(zs_ref, zt, kind, beta, temperature=t, student=student, teacher=teacher), 0.0)
    lp_ref, h_ref = student_reference(zs_ref, labels, temperature=t, student=student, valid=valid)
    (g_ref,) = torch.autograd.grad((d_ref * g_d + lp_ref * g_lp + h_ref * g_h).sum(), zs_ref)

    x = zs.clone().requires_grad_()
    zs_before, zt_before = zs.clone(), zt.clone()
    kw = dict(student_layer=OutputLayer(**(student or {})), teacher_layer=OutputLayer(**(teacher or {})))
    out = divergence_from_logits(x, zt, labels=labels, divergence=Divergence(kind, beta=beta), chunking=5,
                                 label_mask=mask, temperature=t, compute_entropy=True, **kw)
    (g,) = torch.autograd.grad((out.divergence * g_d + out.log_probs * g_lp + out.entropy * g_h).sum(), x)
    _close(out.divergence, d_ref, "divergence")
    _close(out.log_probs, lp_ref, "log_probs")
    _close(out.entropy, h_ref, "entropy")
    _close(g, g_ref, "grad student_logits")
    assert torch.equal(zs, zs_before) and torch.equal(zt, zt_before)  # caller tensors untouched
    if student is None and teacher is None:  # row [0, 0]: the teacher is the student shifted by a constant
        assert out.divergence[0, 0].abs().item() < 1e-12


@pytest.mark.parametrize("kind,beta", KINDS)
def test_teacher_equal_to_student_gives_zero_and_no_gradient(kind, beta):
    h = torch.randn(11, 8)
    w = torch.randn(40, 8) * 4
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_divergence(hs, ws, h, w, temperature=0.3, divergence=Divergence(kind, beta=beta), chunking=4)
    gh, gw = torch.autograd.grad((out.divergence * torch.randn(11)).sum(), (hs, ws))
    assert out.divergence.abs().max().item() < 1e-6
    assert gh.abs().max().item() < 1e-6 and gw.abs().max().item() < 1e-6
    zs = (h @ w.t()).requires_grad_()
    d = divergence_from_logits(zs, zs.detach().clone(), divergence=Divergence(kind, beta=beta)).divergence
    assert d.abs().max().item() < 1e-6


def _linear_problem(seed, *, n=(2, 9), hs=12, ht=20, v=37, dtype=torch.float64, teacher_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    new = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    t = dict(hs=new(*n, hs), ws=new(v, hs) / hs**0.5 * 3, bs=new(v) * 0.5,
             ht=new(*n, ht), wt=new(v, ht) / ht**0.5 * 3 * teacher_scale, bt=new(v) * 0.5)
    return {k: x.to(dtype) for k, x in t.items()}, g


@pytest.mark.parametrize("kind,beta", KINDS)
@pytest.mark.parametrize("vocab_chunk_size", [None, 10])
def test_linear_matches_float64_definitions(kind, beta, vocab_chunk_size):
    p, g = _linear_problem(7 + (vocab_chunk_size or 0))
    n = p["hs"].shape[:-1]
    labels = torch.randint(0, 37, n, generator=g)
    labels[1, 2] = -100
    mask = torch.rand(*n, generator=g) > 0.2
    t = torch.rand(*n, generator=g, dtype=torch.float64) + 0.3
    tfs = dict(softcap=6.0)
    tft = dict(logit_scale=0.8)
    ups = [torch.randn(*n, generator=g, dtype=torch.float64) for _ in range(3)]
    leaves = [p[k].clone().requires_grad_() for k in ("hs", "ws", "bs")]
    zs = leaves[0] @ leaves[1].t() + leaves[2]
    zt = p["ht"] @ p["wt"].t() + p["bt"]
    valid = (labels != -100) & mask
    d_ref = torch.where(valid, reference(zs, zt, kind, beta, temperature=t, student=tfs, teacher=tft), 0.0)
    lp_ref, h_ref = student_reference(zs, labels, temperature=t, student=tfs, valid=valid)
    grads_ref = torch.autograd.grad((d_ref * ups[0] + lp_ref * ups[1] + h_ref * ups[2]).sum(), leaves)

    ours = [p[k].clone().requires_grad_() for k in ("hs", "ws", "bs")]
    teacher = [p[k].clone().requires_grad_() for k in ("ht", "wt", "bt")]  # must get no gradient
    out = linear_divergence(ours[0], OutputLayer(ours[1], ours[2], softcap=6.0), teacher[0],
                            OutputLayer(teacher[1], teacher[2], logit_scale=0.8),
                            divergence=Divergence(kind, beta=beta),
                            chunking=Chunking(5, vocab_chunk_size=vocab_chunk_size), labels=labels, label_mask=mask,
                            temperature=t, compute_entropy=True)
    (out.divergence * ups[0] + out.log_probs * ups[1] + out.entropy * ups[2]).sum().backward()
    _close(out.divergence, d_ref, "divergence")
    _close(out.log_probs, lp_ref, "log_probs")
    _close(out.entropy, h_ref, "entropy")
    for name, a, b in zip(("student_hidden", "student_weight", "student_bias"), ours, grads_ref, strict=True):
        _close(a.grad, b, f"grad {name}")
    assert all(x.grad is None for x in teacher)


@pytest.mark.parametrize("kind,beta", KINDS)
@pytest.mark.parametrize("vocab_chunk_size", [None, 16])
def test_loss_form_matches_the_per_token_form(kind, beta, vocab_chunk_size):
    p, g = _linear_problem(11)
    n = p["hs"].shape[:-1]
    mask = torch.rand(*n, generator=g) > 0.3
    w = torch.rand(*n, generator=g, dtype=torch.float64)
    kw = dict(divergence=Divergence(kind, beta), temperature=0.6, chunking=Chunking(4, vocab_chunk_size),
              label_mask=mask)
    teacher = OutputLayer(p["wt"], p["bt"], softcap=7.0)
    for reduction, normalizer, weights in [("mean", None, None), ("sum", None, w), ("mean", 13.0, None)]:
        a = [p[k].clone().requires_grad_() for k in ("hs", "ws", "bs")]
        b = [p[k].clone().requires_grad_() for k in ("hs", "ws", "bs")]
        out = linear_divergence(a[0], OutputLayer(a[1], a[2], softcap=5.0), p["ht"], teacher, **kw)
        d = out.divergence * (1 if weights is None else weights)
        expected = d.sum() / (normalizer or (mask.sum() if reduction == "mean" else 1))
        expected.backward()
        res = linear_divergence_loss(b[0], OutputLayer(b[1], b[2], softcap=5.0), p["ht"], teacher,
                                     reduction=reduction, normalizer=normalizer, weights=weights, compute_entropy=True,
                                     **kw)
        (res.loss * 2.5).backward()
        _close(res.loss, expected, f"loss {reduction} {normalizer}")
        _close(res.divergence, out.divergence, "per-token divergence")
        assert not res.divergence.requires_grad
        for x, y, name in zip(b, a, ("hidden", "weight", "bias"), strict=True):
            _close(x.grad, 2.5 * y.grad, f"grad {name}")


@pytest.mark.parametrize("kind,beta", KINDS)
def test_float32_and_bf16_no_worse_than_plain_torch(kind, beta):
    p, g = _linear_problem(5, n=(64,), hs=32, ht=48, v=300, teacher_scale=2.0)
    up = torch.randn(64, generator=g, dtype=torch.float64)
    leaves = [p[k].clone().requires_grad_() for k in ("hs", "ws")]
    d_ref = reference(leaves[0] @ leaves[1].t(), p["ht"] @ p["wt"].t(), kind, beta, temperature=0.5)
    grads_ref = torch.autograd.grad((d_ref * up).sum(), leaves)
    for dtype, slack in [(torch.float32, 2.0), (torch.bfloat16, 1.5)]:
        errs = {}
        for who in ("plain", "ours", "ours from logits", "ours, loss form"):
            hs, ws = (p[k].to(dtype).requires_grad_() for k in ("hs", "ws"))
            ht, wt = p["ht"].to(dtype), p["wt"].to(dtype)
            if who == "plain":  # plain autograd in the inputs' dtype, float32 softmax for half precision
                cast = (lambda z: z.float()) if dtype != torch.float32 else (lambda z: z)  # noqa: E731
                d = reference(cast(hs @ ws.t()), cast(ht @ wt.t()), kind, beta, temperature=0.5)
            elif who == "ours":
                d = linear_divergence(hs, ws, ht, wt, temperature=0.5, divergence=Divergence(kind, beta=beta),
                                      chunking=16).divergence
            elif who == "ours from logits":  # the logits twin on the half-precision logits plain autograd forms
                d = divergence_from_logits(hs @ ws.t(), ht @ wt.t(), temperature=0.5,
                                           divergence=Divergence(kind, beta=beta), chunking=16).divergence
            else:  # the loss form: the gradient formed in forward (half precision: vocabulary blocks outermost)
                res = linear_divergence_loss(hs, ws, ht, wt, temperature=0.5, divergence=Divergence(kind, beta=beta),
                                             chunking=16, weights=up.float(), reduction="sum")
                d = res.divergence
                errs[who] = [(a.double() - b).abs().max().item() for a, b in
                             zip((d, *torch.autograd.grad(res.loss, (hs, ws))), (d_ref, *grads_ref), strict=True)]
                continue
            gh, gw = torch.autograd.grad((d * up.to(d.dtype)).sum(), (hs, ws))
            errs[who] = [(a.double() - b).abs().max().item()
                         for a, b in zip((d, gh, gw), (d_ref, *grads_ref), strict=True)]
        for i, what in enumerate(("divergence", "grad hidden", "grad weight")):
            for who in ("ours", "ours from logits", "ours, loss form"):
                assert errs[who][i] <= slack * errs["plain"][i] + 1e-6, (dtype, who, what, errs)


# ----------------------------------------------------------------------------- tensor parallelism, gloo


def _tp_case(rank, group, *, kind, beta, sequence_parallel, vocab_chunk_size, seed, loss=False):
    world = dist.get_world_size(group)
    r = dist.get_rank(group)
    seq, batch, hs, ht, v = 6, 2, 10, 14, 24
    g = torch.Generator().manual_seed(seed)
    new = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    h_s, w_s, b_s = new(seq, batch, hs), new(v, hs) * 0.8, new(v) * 0.3
    h_t, w_t = new(seq, batch, ht), new(v, ht) * 0.8
    labels = torch.randint(0, v, (seq, batch), generator=g)
    mask = torch.rand(seq, batch, generator=g) > 0.2
    t = torch.rand(1, batch, generator=g, dtype=torch.float64) + 0.4
    ups = [new(seq, batch) for _ in range(3)]
    # reference on the full problem
    leaves = [x.clone().requires_grad_() for x in (h_s, w_s, b_s)]
    zs = leaves[0] @ leaves[1].t() + leaves[2]
    zt = h_t @ w_t.t()
    d_ref = torch.where(mask, reference(zs, zt, kind, beta, temperature=t, student=dict(softcap=5.0)), 0.0)
    lp_ref, h_ref = student_reference(zs, labels, temperature=t, student=dict(softcap=5.0), valid=mask)
    if loss:
        total = (d_ref * mask).sum() / mask.sum()
    else:
        total = (d_ref * ups[0] + lp_ref * ups[1] + h_ref * ups[2]).sum()
    grads_ref = torch.autograd.grad(total, leaves)
    # this rank's shard (and slice)
    vl, sl = v // world, seq // world
    rows = slice(r * vl, (r + 1) * vl)
    cut = (lambda x: x[r * sl:(r + 1) * sl]) if sequence_parallel else (lambda x: x)
    mine = [cut(h_s).clone().requires_grad_(), w_s[rows].clone().requires_grad_(), b_s[rows].clone().requires_grad_()]
    kw = dict(divergence=Divergence(kind, beta), temperature=t, label_mask=mask,
              chunking=Chunking(5, vocab_chunk_size))
    tp = dict(process_group=group, sequence_parallel=sequence_parallel)
    student = OutputLayer(mine[1], mine[2], softcap=5.0, **tp)
    teacher = OutputLayer(w_t[rows], **tp)
    what = f"rank {r} {kind} sp={sequence_parallel} vcs={vocab_chunk_size} loss={loss}"
    if loss:
        res = linear_divergence_loss(mine[0], student, cut(h_t), teacher, **kw)
        res.loss.backward()
        _close(res.loss, total, f"{what}: loss")
    else:
        out = linear_divergence(mine[0], student, cut(h_t), teacher, labels=labels, compute_entropy=True, **kw)
        (out.divergence * ups[0] + out.log_probs * ups[1] + out.entropy * ups[2]).sum().backward()
        _close(out.divergence, d_ref, f"{what}: divergence")
        _close(out.log_probs, lp_ref, f"{what}: log_probs")
        _close(out.entropy, h_ref, f"{what}: entropy")
    _close(mine[0].grad, cut(grads_ref[0]), f"{what}: grad hidden")
    _close(mine[1].grad, grads_ref[1][rows], f"{what}: grad weight")
    _close(mine[2].grad, grads_ref[2][rows], f"{what}: grad bias")
    # the logits twin over the same shards
    x = zs.detach()[..., rows].clone().requires_grad_()
    out = divergence_from_logits(x, zt[..., rows], labels=labels, divergence=Divergence(kind, beta=beta),
                                 student_layer=OutputLayer(softcap=5.0, process_group=group),
                                 teacher_layer=OutputLayer(process_group=group), chunking=4, label_mask=mask,
                                 temperature=t, compute_entropy=True)
    _close(out.divergence, d_ref, f"{what}: divergence from logits")
    if not loss:
        zs_ref = zs.detach().clone().requires_grad_()
        d2 = torch.where(mask, reference(zs_ref, zt, kind, beta, temperature=t, student=dict(softcap=5.0)), 0.0)
        (gz,) = torch.autograd.grad((d2 * ups[0]).sum(), zs_ref)
        (gx,) = torch.autograd.grad((out.divergence * ups[0]).sum(), x)
        _close(gx, gz[..., rows], f"{what}: grad student_logits")


def _tp2(rank, world):
    group = dist.group.WORLD
    for i, (kind, beta) in enumerate(KINDS):
        _tp_case(rank, group, kind=kind, beta=beta, sequence_parallel=False, vocab_chunk_size=None, seed=10 + i)
        _tp_case(rank, group, kind=kind, beta=beta, sequence_parallel=True, vocab_chunk_size=5, seed=20 + i)
        _tp_case(rank, group, kind=kind, beta=beta, sequence_parallel=True, vocab_chunk_size=None, seed=30 + i,
                 loss=True)
    # bad input under TP: weights sharded differently are refused on every rank, naming the rank
    w = torch.randn(5 + rank, 4)
    with pytest.raises(ValueError, match="differs across"):
        linear_divergence(torch.randn(3, 4), OutputLayer(w, process_group=group), torch.randn(3, 4),
                          OutputLayer(w.clone(), process_group=group))
    # the new options are agreed too: a beta or a teacher soft-cap that differs is named
    hs, ws, ht, wt = torch.randn(3, 4), torch.randn(6, 4), torch.randn(3, 5), torch.randn(6, 5)
    student, teacher = OutputLayer(ws, process_group=group), OutputLayer(wt, process_group=group)
    with pytest.raises(ValueError, match="beta differs across"):
        linear_divergence(hs, student, ht, teacher, divergence=Divergence("jsd", 0.2 + 0.1 * rank))
    with pytest.raises(ValueError, match="teacher_softcap differs across"):
        linear_divergence(hs, student, ht, teacher.replace(softcap=10.0 + rank))
    # a NaN teacher on one rank: every rank raises, naming it
    ht = torch.randn(3, 4)
    if rank == 1:
        ht[1, 2] = math.nan
    with pytest.raises(ValueError, match="teacher_hidden must be finite.*rank 1"):
        linear_divergence(torch.randn(3, 4), OutputLayer(torch.randn(6, 4), process_group=group), ht,
                          OutputLayer(torch.randn(6, 4), process_group=group))
    # and the group still works
    out = linear_divergence(torch.ones(3, 4), OutputLayer(torch.ones(6, 4), process_group=group), torch.ones(3, 4),
                            OutputLayer(torch.ones(6, 4), process_group=group))
    assert out.divergence.abs().max() == 0


def test_tensor_parallel_2_and_sequence_parallel():
    run_distributed(_tp2, 2)


def _tp3(rank, world):
    group = dist.group.WORLD
    _tp_case(rank, group, kind="jsd", beta=0.7, sequence_parallel=True, vocab_chunk_size=3, seed=40)
    _tp_case(rank, group, kind="reverse_kl", beta=None, sequence_parallel=False, vocab_chunk_size=None, seed=41,
             loss=True)


def test_tensor_parallel_3():
    run_distributed(_tp3, 3)


# ----------------------------------------------------------------------------- bad input


def _args():
    return torch.randn(4, 6), torch.randn(10, 6), torch.randn(4, 8), torch.randn(10, 8)


@pytest.mark.parametrize("change,match", [
    (lambda a: (a[0], a[1], a[2], torch.randn(11, 8)), "teacher_weight has 11 vocabulary rows"),
    (lambda a: (a[0], a[1], torch.randn(5, 8), a[3]), "teacher_hidden must have the leading shape"),
    (lambda a: (a[0], a[1], torch.randn(4, 7), a[3]), "teacher_hidden must be"),
    (lambda a: (a[0].double(), a[1], a[2], a[3]), "student_hidden .* and student_weight"),
])
def test_bad_tensors_are_named(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        linear_divergence(*change(_args()))


@pytest.mark.parametrize("call,match", [
    (lambda a: linear_divergence(*a, divergence=Divergence("jsd", 0.0)), r"beta must be in \(0.0, 1.0\)"),
    (lambda a: linear_divergence(*a, divergence=Divergence("jsd", 1.0)), r"beta must be in \(0.0, 1.0\)"),
    (lambda a: linear_divergence(*a, divergence="jsd"), "needs beta"),
    (lambda a: linear_divergence(*a, divergence=Divergence("forward_kl", 0.5)), "takes none"),
    (lambda a: linear_divergence(*a, divergence="kl"), "divergence must be one of"),
    (lambda a: linear_divergence(*a, temperature=0.0), "temperature must be finite and > 0"),
    (lambda a: linear_divergence(*a, temperature=torch.tensor([1.0, -1.0, 1.0, 1.0])),
     "temperature must be finite and > 0"),
    (lambda a: linear_divergence(*a[:3], OutputLayer(a[3], softcap=-1.0)), "OutputLayer.softcap must be"),
    (lambda a: linear_divergence(*a, chunking=0), "chunk_size must be"),
])
def test_bad_options_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(_args())


def test_nan_teacher_is_refused_before_any_work_and_nothing_is_written():
    hs, ws, ht, wt = _args()
    ht[2, 3] = math.nan
    hs.requires_grad_()
    before = [t.clone() for t in (hs, ws, ht, wt)]
    with pytest.raises(ValueError, match="teacher_hidden must be finite"):
        linear_divergence(hs, ws, ht, wt)
    zt = torch.randn(4, 10)
    zt[0, 0] = math.nan
    with pytest.raises(ValueError, match="teacher_logits must be finite"):
        divergence_from_logits(torch.randn(4, 10), zt)
    with pytest.raises(ValueError, match="teacher_logits has 9 vocabulary columns"):
        divergence_from_logits(torch.randn(4, 10), torch.randn(4, 9))
    for a, b in zip((hs, ws, ht, wt), before, strict=True):
        assert torch.equal(a.detach().nan_to_num(), b.nan_to_num())
    assert hs.grad is None


# ----------------------------------------------------------------------------- no host sync per chunk


@pytest.mark.parametrize("form", ["per token", "loss", "logits"])
@pytest.mark.parametrize("kind,beta", KINDS)
def test_host_syncs_do_not_grow_with_the_chunks(form, kind, beta):
    from tests.test_host_syncs import _HostSyncs  # the dispatcher-level counter of the other ops' test

    g = torch.Generator().manual_seed(3)
    n, h, v = 64, 8, 40
    hs, ws, ht, wt = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randn(n, 12, generator=g), \
        torch.randn(v, 12, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    t = torch.rand(n, generator=g) + 0.5
    counts = {}
    for chunk, vcs in ((n, None), (n // 2, None), (n // 8, v // 3)):
        a, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        kw = dict(divergence=Divergence(kind, beta), label_mask=mask, temperature=t)
        with _HostSyncs() as s:
            if form == "per token":
                out = linear_divergence(a, OutputLayer(w, softcap=5.0), ht, wt, chunking=Chunking(chunk, vcs),
                                        compute_entropy=True, **kw)
                (out.divergence.sum() + out.entropy.sum()).backward()
            elif form == "loss":
                linear_divergence_loss(a, OutputLayer(w, softcap=5.0), ht, wt, chunking=Chunking(chunk, vcs),
                                       **kw).loss.backward()
            else:
                divergence_from_logits(a @ w.t(), ht @ wt.t(), student_layer=OutputLayer(softcap=5.0), chunking=chunk,
                                       **kw).divergence.sum().backward()
        counts[chunk] = s.ops
    assert counts[n] == counts[n // 2] == counts[n // 8], counts
    assert sum(counts[n].values()) <= 8, counts[n]


# ----------------------------------------------------------------------------- arguments named (issue 33)


def test_zero_dimensional_logits_are_named():
    for s, t, name in ((torch.tensor(1.0), torch.randn(3), "student_logits"),
                       (torch.randn(3), torch.tensor(1.0), "teacher_logits"),
                       (torch.randn(2, 0), torch.randn(2, 0), "student_logits")):
        with pytest.raises(ValueError, match=f"{name} must be \\[..., V_local\\]"):
            divergence_from_logits(s, t)


def test_an_infinite_teacher_is_refused_from_one_min_max_reduction():
    for bad in (math.inf, -math.inf, math.nan):
        zt = torch.randn(4, 10).to(torch.bfloat16)[:, ::2]  # half precision, strided: no copy is made either
        zt[3, 4] = bad
        with pytest.raises(ValueError, match="teacher_logits must be finite"):
            divergence_from_logits(torch.randn(4, 5), zt.float())
        with pytest.raises(ValueError, match="teacher_hidden must be finite"):
            linear_divergence(torch.randn(4, 5), torch.randn(7, 5), zt, torch.randn(7, 5).to(torch.bfloat16))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(normalizer=torch.ones(4)), ValueError, r"normalizer must be a number > 0 or a 0-d tensor .* shape \(4,\)"),
    (dict(normalizer=torch.empty((), device="meta")), ValueError, "normalizer is on meta"),
    (dict(normalizer=torch.tensor(True)), TypeError, "normalizer must be"),
    (dict(normalizer=-1.0), ValueError, "normalizer must be a number > 0"),
    (dict(weights=torch.empty(4, device="meta")), ValueError, "weights is on meta"),
    (dict(weights=torch.ones(5)), ValueError, r"weights must have the tokens' shape \(4,\)"),
    (dict(weights=torch.ones(4, dtype=torch.int64)), TypeError, "weights must be float"),
    (dict(reduction="avg"), ValueError, "reduction must be 'mean' or 'sum'"),
])
def test_the_loss_forms_own_arguments_are_named(kw, exc, match):
    hs = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(exc, match=match):
        linear_divergence_loss(hs, torch.randn(10, 6), torch.randn(4, 8), torch.randn(10, 8), **kw)
    assert hs.grad is None


def test_a_cpu_normalizer_is_a_scalar_from_anywhere():
    hs, ws, ht, wt = _args()
    a = linear_divergence_loss(hs, ws, ht, wt, normalizer=torch.tensor(3, dtype=torch.int64)).loss
    b = linear_divergence_loss(hs, ws, ht, wt, reduction="sum").loss / 3
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- the reliability pass (0.2.0)


@pytest.mark.parametrize("ignore_index,exc", [("x", TypeError), (None, TypeError), (2**70, ValueError)])
def test_a_bad_ignore_index_is_named_without_labels_too(ignore_index, exc):
    hs, ws, ht, wt = _args()
    with pytest.raises(exc, match="ignore_index must"):
        linear_divergence(hs, ws, ht, wt, ignore_index=ignore_index)
    with pytest.raises(exc, match="ignore_index must"):
        divergence_from_logits(hs @ ws.t(), ht @ wt.t(), ignore_index=ignore_index)
    with pytest.raises(exc, match="ignore_index must"):
        linear_divergence(hs, ws, ht, wt, labels=torch.zeros(4, dtype=torch.long), rows="kept",
                          ignore_index=ignore_index)


@pytest.mark.parametrize("value", [0.0, -2.0, math.nan, math.inf])
def test_a_tensor_normalizer_must_hold_a_finite_value_above_zero(value):
    hs = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(ValueError, match="normalizer must be a number > 0 or a 0-d tensor holding one"):
        linear_divergence_loss(hs, torch.randn(10, 6), torch.randn(4, 8), torch.randn(10, 8),
                               normalizer=torch.tensor(value))
    assert hs.grad is None


@pytest.mark.parametrize("where", ["weight", "bias"])
def test_a_non_finite_teacher_weight_or_bias_is_refused(where):
    hs, ws, ht, wt = _args()
    bt = torch.randn(10)
    (wt if where == "weight" else bt)[3, ...] = math.nan
    before = [t.clone() for t in (hs, ws, ht, wt, bt)]
    hs.requires_grad_()
    for op in (linear_divergence, linear_divergence_loss):
        with pytest.raises(ValueError, match=f"teacher_layer.{where} must be finite"):
            op(hs, ws, ht, OutputLayer(wt, bt))
    for a, b in zip((hs, ws, ht, wt, bt), before, strict=True):
        assert torch.equal(a.detach().nan_to_num(), b.nan_to_num())
    assert hs.grad is None


def test_a_weight_without_rows_is_named():
    with pytest.raises(ValueError, match=r"OutputLayer.weight must have at least one row .* \(0, 6\)"):
        OutputLayer(torch.randn(0, 6))
    with pytest.raises(ValueError, match="student_layer.weight must have at least one row"):
        linear_divergence(torch.randn(4, 6), torch.randn(0, 6), torch.randn(4, 8), torch.randn(0, 8))


def test_divergence_objects_name_a_bad_kind_and_replace_like_the_others():
    for kind in (["jsd"], None, 3):
        with pytest.raises(ValueError, match="divergence must be one of"):
            Divergence(kind)
    d = Divergence("jsd", 0.25)
    assert d.replace(beta=0.5) == Divergence("jsd", 0.5) and d.beta == 0.25
    assert d.replace(kind="forward_kl", beta=None).kind == "forward_kl"
    with pytest.raises(ValueError, match=r"beta must be in \(0.0, 1.0\)"):
        d.replace(beta=1.0)


def test_a_new_divergence_is_one_class():
    """Defining a :class:`DivergenceMath` subclass registers its kind: :class:`Divergence`, its errors and the
    ops take it by name, with no list to extend. Here half the forward KL (no online fold: ``weighs`` None),
    values and gradients against float64 autograd of its definition, through both ops and vocabulary blocks."""
    from chunked_entropy import _divergence

    class HalfForwardKL(_divergence.DivergenceMath):
        kind = "half_forward_kl_test"
        needs_aux = False

        def entries(self, lp_s, lp_t):
            return _divergence.p_times(lp_t, lp_t - lp_s) * 0.5

        def terms(self, lp_s, lp_t):
            d = lp_s.neg_().add_(lp_t)
            p_t = lp_t.exp_()
            return d.mul_(p_t).sum(dim=1).mul_(0.5), None, (p_t,)

        def grad_from_parts(self, parts, lp_s, aux):
            return lp_s().exp_().sub_(parts[0]).mul_(0.5)

        def grad(self, lp_s, lp_t, aux):
            return lp_s.exp_().sub_(lp_t.exp_()).mul_(0.5)

    try:
        assert "'half_forward_kl_test'" in _divergence.kind_names()
        with pytest.raises(ValueError, match="takes none"):
            Divergence("half_forward_kl_test", 0.5)
        with pytest.raises(ValueError, match="registered twice"):
            type("Again", (_divergence.DivergenceMath,), {"kind": "half_forward_kl_test"})
        g = torch.Generator().manual_seed(11)
        hs, ht = torch.randn(7, 6, generator=g), torch.randn(7, 5, generator=g)
        ws, wt = torch.randn(13, 6, generator=g) * 3, torch.randn(13, 5, generator=g) * 3
        up = torch.randn(7, generator=g)
        lp_t = torch.log_softmax((ht @ wt.t()).double(), -1)
        hs64 = hs.double().requires_grad_()
        lp_s = torch.log_softmax(hs64 @ ws.double().t(), -1)
        ref = 0.5 * (lp_t.exp() * (lp_t - lp_s)).sum(-1)
        (ref_g,) = torch.autograd.grad((ref * up.double()).sum(), hs64)
        for vocab in (None, 4):
            h = hs.clone().requires_grad_()
            d = linear_divergence(h, ws, ht, wt, divergence="half_forward_kl_test",
                                  chunking=Chunking(3, vocab_chunk_size=vocab, backend="eager")).divergence
            (d * up).sum().backward()
            torch.testing.assert_close(d.double(), ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(h.grad.double(), ref_g, rtol=1e-4, atol=1e-5)
            z = (hs @ ws.t()).requires_grad_()
            d = divergence_from_logits(z, ht @ wt.t(), divergence=Divergence("half_forward_kl_test"),
                                       chunking=Chunking(3, backend="eager")).divergence
            torch.testing.assert_close(d.double(), ref, rtol=1e-5, atol=1e-6)
    finally:
        _divergence.KINDS.pop("half_forward_kl_test", None)


def test_divergence_spec_is_the_divergence_itself_deprecated():
    d = Divergence("jsd", 0.3)
    with pytest.warns(DeprecationWarning, match="Divergence.spec is deprecated"):
        assert d.spec is d
    assert d.math is Divergence.from_trl_beta(0.3).math and d.needs_aux


@pytest.mark.parametrize("kw", [dict(width=0), dict(width=-3), dict(width=2.5), dict(width=8, buffers=0)])
def test_chunking_resolve_names_a_bad_width(kw):
    for chunking in (Chunking("auto"), Chunking(64)):
        with pytest.raises(ValueError, match=f"Chunking.resolve: {'buffers' if 'buffers' in kw else 'width'} must"):
            chunking.resolve(**kw)


def test_a_numpy_int_is_a_chunk_size_as_chunking_takes_it():
    import numpy as np

    hs, ws, ht, wt = _args()
    want = linear_divergence(hs, ws, ht, wt, chunking=Chunking(3)).divergence
    for n in (np.int64(3), np.int32(3)):
        assert Chunking(n) == Chunking(3)
        assert torch.equal(linear_divergence(hs, ws, ht, wt, chunking=n).divergence, want)
        assert torch.equal(divergence_from_logits(hs @ ws.t(), ht @ wt.t(), chunking=n).divergence,
                           divergence_from_logits(hs @ ws.t(), ht @ wt.t(), chunking=3).divergence)
    with pytest.raises(ValueError, match="Chunking.chunk_size must be an int >= 1"):
        linear_divergence(hs, ws, ht, wt, chunking=np.int64(0))


def test_a_temperature_on_the_meta_device_is_named_by_its_device():
    hs, ws, ht, wt = _args()
    for t in (torch.tensor(0.5, device="meta"), torch.full((4,), 0.5, device="meta")):
        with pytest.raises(ValueError, match="temperature is on meta"):
            linear_divergence(hs, ws, ht, wt, temperature=t)
        with pytest.raises(ValueError, match="temperature is on meta"):
            divergence_from_logits(hs @ ws.t(), ht @ wt.t(), temperature=t)


def _tp_refusals(rank, world):
    """Arguments refused on one rank only: every rank raises the same error naming it and the rank, no hang."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
    student = OutputLayer(torch.randn(5, 4, generator=g), process_group=group)
    teacher = OutputLayer(torch.randn(5, 3, generator=g), process_group=group)
    one = rank == 1
    cases = [
        # a value the cross-rank check cannot hold in int64: refused in the exchange, not raised before it
        ("chunk_size must fit in int64", lambda: linear_divergence(hs, student, ht, teacher,
                                                                   chunking=2**70 if one else 4)),
        ("weights is not None differs", lambda: linear_divergence_loss(hs, student, ht, teacher,
                                                                          weights=torch.ones(6) if one else None)),
        ("ignore_index must be an int", lambda: linear_divergence(hs, student, ht, teacher,
                                                                  ignore_index="x" if one else -100)),
        # rows="kept": its checks come before the teacher's gather, and are shared too
        ("label_mask must have the tokens' leading shape", lambda: linear_divergence(
            hs, student.replace(sequence_parallel=True), ht, teacher.replace(sequence_parallel=True), rows="kept",
            label_mask=torch.ones(12 - one, dtype=torch.bool))),
    ]
    for what, call in cases:
        with pytest.raises((ValueError, TypeError), match=what) as e:
            call()
        assert "rank 1" in str(e.value) and f"this is rank {rank}" in str(e.value), str(e.value)
    out = linear_divergence(hs, student, ht, teacher)  # the group still works
    assert torch.isfinite(out.divergence).all()


def test_tensor_parallel_refusals_on_one_rank_reach_every_rank():
    run_distributed(_tp_refusals, 2, timeout_s=30)


@pytest.mark.parametrize("kind,beta", [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.5)])  # TRL's beta 0.5
def test_confident_rows_and_a_close_teacher_no_worse_than_plain_float32(kind, beta):
    """A confident student (one logit +16), a teacher within noise 0.5 of it, temperature 0.5: the divergence is
    second order in their difference. The JSD's log-ratios were a rounded ``log(1 - beta)`` minus a softplus, so
    at the confident entry (``lp`` near 0) they lost what plain float32 keeps: the value had 660x its relative
    error (now from log1p/expm1 where ``|delta| <= 1``). "Plain" is the divergence as TRL writes it:
    log-softmaxes, the mixture by logsumexp, sums of ``p * log-ratio``."""
    g = torch.Generator().manual_seed(2)
    n, v = 16, 512
    zs = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    zs[torch.arange(n), torch.randint(0, v, (n,), generator=g)] += 16.0
    zt = (zs + torch.randn(n, v, generator=g, dtype=torch.float64) * 0.5).float()
    zs = zs.float()
    up = torch.randn(n, generator=g, dtype=torch.float64)
    errs = {who: _confident_case(who, kind, beta, zs, zt, up) for who in ("float64", "plain", "ours")}
    want = errs.pop("float64")
    rel = {who: [((a - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True)]
           for who, got in errs.items()}
    assert rel["ours"][0] <= 3.0 * rel["plain"][0] + 1e-9, rel
    # the gradient: plain's CPU sums accumulate in double; ours are float32 sums, as on a GPU
    assert rel["ours"][1] <= 30.0 * rel["plain"][1] + 1e-6, rel


def _confident_case(who, kind, beta, zs, zt, up):
    """One divergence and its gradient: ``"ours"``, or plain autograd in float32 or float64."""
    x = (zs.double() if who == "float64" else zs).clone().requires_grad_()
    t = zt.double() if who == "float64" else zt
    if who == "ours":
        d = divergence_from_logits(x, t, divergence=Divergence(kind, beta=beta), temperature=0.5,
                                   chunking=8).divergence
    else:
        ls, lt = torch.log_softmax(x / 0.5, -1), torch.log_softmax(t / 0.5, -1)
        if kind == "forward_kl":
            d = (lt.exp() * (lt - ls)).sum(-1)
        elif kind == "reverse_kl":
            d = (ls.exp() * (ls - lt)).sum(-1)
        else:
            lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), dim=0)
            d = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    (grad,) = torch.autograd.grad((d * up.to(d.dtype)).sum(), x)
    return d.detach().double(), grad.double()


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("budget", [1 << 30, 1], ids=["accumulator", "vocabulary_outer"])
def test_a_scaled_half_precision_loss_form_rounds_its_gradient_once(retain, budget):
    """As the fused policy loss: ``(loss / 3).backward()`` scales the stored bf16 gradients in float32, once.
    Where the float32 weight-gradient accumulator fits the budget the weight's stored gradient is that float32
    sum (``main_grad`` receives it), rounded once after the scaling."""
    p, _ = _linear_problem(3, n=(12,), hs=16, ht=8, v=40)
    grads = {}
    for c in (1.0, 1.0 / 3.0, "main_grad"):
        hs, ws = (p[k].to(torch.bfloat16).requires_grad_() for k in ("hs", "ws"))
        if c == "main_grad":
            ws.main_grad = torch.zeros(ws.shape)
        res = linear_divergence_loss(hs, ws, p["ht"].to(torch.bfloat16), p["wt"].to(torch.bfloat16),
                                     divergence=Divergence("jsd", beta=0.5),
                                     chunking=Chunking(4, max_working_bytes=budget))
        (res.loss * (1.0 if c == "main_grad" else c)).backward(retain_graph=retain)
        grads[c] = [hs.grad, ws.grad if c != "main_grad" else ws.main_grad]
    if budget == 1 << 30:
        grads[1.0][1] = grads["main_grad"][1]
    upstream = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    for one, third in zip(grads[1.0], grads[1.0 / 3.0], strict=True):
        torch.testing.assert_close(third, (one.float() * upstream).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.7, "tensor"])
def test_a_temperature_enters_the_per_token_inputs_once(temperature):
    """Issue 46 item 5: each head carries its own transform, and the one temperature is checked against both in
    one entry into ``_inputs`` (the student's and the teacher's soft-cap and logit scale): before, it entered
    again for the teacher (``check_transform_scale`` called from the divergence's own preparation)."""
    import sys

    import chunked_entropy._inputs as inputs

    p, g = _linear_problem(5)
    n = p["hs"].shape[:-1]
    t = torch.rand(*n, generator=g, dtype=torch.float64) + 0.5 if temperature == "tensor" else temperature
    student = OutputLayer(p["ws"], p["bs"], softcap=6.0)
    teacher = OutputLayer(p["wt"], p["bt"], logit_scale=0.8)
    entries = []

    def trace(frame, event, arg):  # calls into _inputs from outside it that take the temperature (or 1/t)
        if event == "call" and frame.f_code.co_filename == inputs.__file__:
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            params = frame.f_code.co_varnames[:frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
            if caller != inputs.__file__ and {"temperature", "inv_t"} & set(params):
                entries.append(frame.f_code.co_name)

    sys.setprofile(trace)
    try:
        out = linear_divergence(p["hs"], student, p["ht"], teacher, temperature=t)
    finally:
        sys.setprofile(None)
    assert entries == ["prepare_tokens"]
    # and the teacher's transform is still checked against it: a teacher logit scale that 1/t overflows
    with pytest.raises(ValueError, match="logit_scale / temperature"):
        linear_divergence(p["hs"], student, p["ht"], OutputLayer(p["wt"], p["bt"], logit_scale=1e308), temperature=0.5)
    assert torch.isfinite(out.divergence).all()
