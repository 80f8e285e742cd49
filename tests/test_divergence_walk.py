"""The two-head (divergence) walk: its compiled kernels and its main_grad fusion against the eager walk and the
float64 definitions, and its collectives per chunk under TP 2 (real gloo groups, counted).

The compiled kernels are the chunking's ``backend="compile"``, the fusion the student layer's
``gradient_accumulation_fusion``; ``divergence_from_logits``' compiled run patches its Function's plan (the
hook its backend sets), so that the same call runs both ways.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import Chunking, Divergence, OutputLayer, _kernels, linear_divergence, linear_divergence_loss
from chunked_entropy import divergence as dv
from tests.helpers import run_distributed
from tests.test_divergence import reference, student_reference

V = 37


def _linear(form, hs, ws, bs, ht, wt, *, kind, beta, compiled=None, main_grad=None, **kw):
    """``linear_divergence`` (``form="head"``: its ``(divergence, log_probs, entropy)``) or its loss form (``(loss,
    divergence, entropy)``), eager or compiled (``compiled`` given), the student's weight gradient added into
    ``main_grad`` when given (gradient-accumulation fusion)."""
    student = OutputLayer(ws, bs, softcap=kw.get("student_softcap"),
                          gradient_accumulation_fusion=main_grad is not None)
    teacher = OutputLayer(wt, softcap=kw.get("teacher_softcap"))
    common = dict(divergence=Divergence(kind, beta), temperature=kw.get("temperature", 1.0),
                  label_mask=kw.get("label_mask"),
                  chunking=Chunking(kw.get("chunk_size", 4), kw.get("vocab_chunk_size"),
                                    "eager" if compiled is None else "compile"))
    if form == "head":
        out = linear_divergence(hs, student, ht, teacher, labels=kw["labels"], compute_entropy=True, **common)
        return out.divergence, out.log_probs, out.entropy
    out = linear_divergence_loss(hs, student, ht, teacher, reduction="sum", weights=kw.get("weights"), **common)
    return out.loss, out.divergence, out.entropy


def _problem(seed, n=(2, 7)):
    g = torch.Generator().manual_seed(seed)
    new = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(hs=new(*n, 8), ws=new(V, 8) * 0.7, bs=new(V) * 0.2, ht=new(*n, 10), wt=new(V, 10) * 0.7,
                labels=torch.randint(0, V, n, generator=g), mask=torch.rand(*n, generator=g) > 0.2,
                t=torch.rand(n[0], 1, generator=g) + 0.5, ups=[new(*n) for _ in range(3)], weights=new(*n).abs())


def _run(form, p, kind, beta, *, compiled=None, fuse=False, vocab_chunk_size=None):
    """Values and the student's gradients (hidden, weight or the main_grad added to, bias) of one call."""
    leaves = [p[k].clone().requires_grad_() for k in ("hs", "ws", "bs")]
    main_grad = None
    if fuse:
        main_grad = torch.full(p["ws"].shape, 0.25)  # Megatron's float32 accumulator, holding a previous step's
        leaves[1].main_grad = main_grad
    kw = dict(kind=kind, beta=beta, compiled=compiled, main_grad=main_grad, temperature=p["t"], student_softcap=6.0,
              teacher_softcap=9.0, label_mask=p["mask"], labels=p["labels"], weights=p["weights"],
              vocab_chunk_size=vocab_chunk_size)
    out = _linear(form, leaves[0], leaves[1], leaves[2], p["ht"], p["wt"], **kw)
    shape = p["labels"].shape  # the Functions' per-token outputs are flat
    if form == "head":
        values = [o.view(shape) for o in out]
        sum((o * u).sum() for o, u in zip(values, p["ups"], strict=True)).backward()
    else:
        values = [out[0], torch.where(p["mask"], out[1].view(shape), 0.0)]
        (out[0] * 1.5).backward()
    gw = leaves[1].grad if main_grad is None else main_grad - 0.25
    if fuse:
        assert leaves[1].grad is None  # the gradient went into main_grad, and only there
    return [v.detach() for v in values] + [leaves[0].grad, gw, leaves[2].grad]


def _float64(form, p, kind, beta):
    """The same from the definitions (tests/test_divergence.py's references), float64."""
    hs, ws, bs = (p[k].double().requires_grad_() for k in ("hs", "ws", "bs"))
    zs, zt = hs @ ws.t() + bs, p["ht"].double() @ p["wt"].double().t()
    t = p["t"].double()
    d = torch.where(p["mask"], reference(zs, zt, kind, beta, temperature=t, student=dict(softcap=6.0),
                                         teacher=dict(softcap=9.0)), 0.0)
    if form == "head":
        lp, ent = student_reference(zs, p["labels"], temperature=t, student=dict(softcap=6.0), valid=p["mask"])
        values = [d, lp, ent]
        total = sum((o * u.double()).sum() for o, u in zip(values, p["ups"], strict=True))
    else:
        values = [(d * p["weights"].double()).sum(), d]
        total = values[0] * 1.5
    return [v.detach() for v in values] + list(torch.autograd.grad(total, (hs, ws, bs)))


def _close(got, want, what, tol):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=lambda m, i=i: f"{what} #{i}: {m}")


KINDS = [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.3)]


@pytest.mark.parametrize("kind,beta", KINDS)
def test_compiled_and_main_grad_match_the_eager_walk_and_float64(kind, beta):
    """``backend="compile"`` (the compiled kernels on every block: statistics, the divergence's sums, the
    gradient) and main_grad fusion, per-token form and loss form, one vocabulary block and several: equal to
    the eager walk within float32 rounding, and to the float64 definitions."""
    p = _problem(1)
    for form in ("head", "loss"):
        want = _float64(form, p, kind, beta)
        for vcs in (None, 16):
            eager = _run(form, p, kind, beta, vocab_chunk_size=vcs)
            _close(eager, want, f"eager {form} vcs={vcs}", 2e-5)
            compiled = _run(form, p, kind, beta, compiled=_kernels.COMPILED, fuse=True, vocab_chunk_size=vcs)
            _close(compiled, eager, f"compiled+main_grad {form} vcs={vcs}", 1e-5)


def test_compiled_one_row_and_teacher_equal_to_student():
    """A chunk of one row (the kernels' doubled row), and a teacher equal to the student: 0, exactly."""
    p = _problem(2, n=(1, 1))
    _close(_run("head", p, "jsd", 0.3, compiled=_kernels.COMPILED), _run("head", p, "jsd", 0.3), "one row", 1e-5)
    q = _problem(3)
    w = q["ws"]
    out = _linear("head", q["hs"], w, None, q["hs"], w, kind="reverse_kl", beta=None, compiled=_kernels.COMPILED,
                  labels=q["labels"])
    assert out[0].abs().max() == 0


def test_compiled_from_logits_matches_eager(monkeypatch):
    """``divergence_from_logits`` with the compiled kernels (its Function given ``Plan.kernels``, the hook the
    op passes): the same values and logit gradients as the eager walk."""
    from chunked_entropy import divergence_from_logits

    g = torch.Generator().manual_seed(5)
    zs, zt = torch.randn(3, 5, V, generator=g) * 3, torch.randn(3, 5, V, generator=g) * 3
    labels = torch.randint(0, V, (3, 5), generator=g)
    ups = [torch.randn(3, 5, generator=g) for _ in range(3)]
    apply = dv._LogitsDivergenceFunction.apply
    results, ran = [], []
    grad_ = _kernels.PAIR.grad_
    monkeypatch.setattr(_kernels.PAIR, "grad_", lambda *a: ran.append(1) or grad_(*a))  # counted, still run
    for compiled in (_kernels.EAGER, _kernels.COMPILED):
        monkeypatch.setattr(dv._LogitsDivergenceFunction, "apply",
                            lambda x, teacher, tok, plan, *rest, c=compiled: apply(x, teacher, tok,
                                                                                  replace(plan, kernels=c), *rest))
        x = zs.clone().requires_grad_()
        out = divergence_from_logits(x, zt, divergence=Divergence("jsd", 0.4), labels=labels, temperature=0.8,
                                     student_layer=OutputLayer(softcap=7.0), compute_entropy=True,
                                     chunking=Chunking(4, backend="eager"))
        sum((o * u).sum() for o, u in zip(out, ups, strict=True)).backward()
        results.append([o.detach() for o in out] + [x.grad])
    assert ran, "the compiled gradient kernel never ran"
    _close(results[1], results[0], "from logits, compiled vs eager", 1e-5)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
def test_a_kl_folded_online_equals_the_second_pass(kind, monkeypatch):
    """With vocabulary blocks a KL's value folds over the blocks in the statistics' pass (each block filled once
    in forward): the same values and gradients as the pass that fills each block again (float32 rounding), and
    a teacher equal to the student still gives exactly 0."""
    from chunked_entropy import _loop

    p = _problem(4, n=(3, 6))
    calls, fills = [], {}
    fill = _loop._TeacherWalk.fill  # the teacher's block, filled beside each of the student's
    monkeypatch.setattr(_loop._TeacherWalk, "fill", lambda self, *a: calls.append(a) or fill(self, *a))  # counted
    for fold in (True, False):
        monkeypatch.setattr(_loop, "FOLD_KL", fold)
        calls.clear()
        got = {form: _run(form, p, kind, None, vocab_chunk_size=8) for form in ("head", "loss")}
        fills[fold] = len(calls)
        if fold:
            folded = got
    monkeypatch.setattr(_loop._TeacherWalk, "fill", fill)
    for form in ("head", "loss"):
        _close(folded[form], got[form], f"folded vs second pass, {form}", 1e-5)
    blocks = 5 * 5  # 18 rows in 5 chunks of 4, 37 columns in 5 blocks of 8
    # forward of the per-token form: once instead of twice; backward: once; the loss form: twice instead of three
    assert fills[True] == blocks * (1 + 1 + 2) and fills[False] == blocks * (2 + 1 + 3), fills
    monkeypatch.setattr(_loop, "FOLD_KL", True)
    w = p["ws"]
    for compiled in (None, _kernels.COMPILED):
        out = _linear("head", p["hs"], w, None, p["hs"], w, kind=kind, beta=None, compiled=compiled,
                      labels=p["labels"], vocab_chunk_size=8, temperature=p["t"])
        assert out[0].abs().max() == 0


# ----------------------------------------------------------------------------- collectives per chunk under TP 2


class _Counted:
    """Counts the group's collectives while it is active: ``torch.distributed.all_reduce`` and the all-gathers
    (``all_gather_into_tensor``, ``all_gather``), each still run (a wrapper, not a stand-in)."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather", "all_gather_single")

    def __enter__(self):
        self.calls, self.saved = [], {}
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapped(*args, _fn=fn, _name=name, **kw):
                self.calls.append(_name)
                return _fn(*args, **kw)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _counts(form, kind, beta, chunk_size, vocab_chunk_size, rank, world):
    """(forward, backward) collectives of one call on 12 tokens, checked against float64 on the way."""
    g = torch.Generator().manual_seed(50)
    new = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    n, v = 12, 24
    h_s, w_s, h_t, w_t = new(n, 6), new(v, 6), new(n, 7), new(v, 7)
    labels = torch.randint(0, v, (n,), generator=g)
    ups = [new(n) for _ in range(3)]
    leaves = [h_s.clone().requires_grad_(), w_s.clone().requires_grad_()]
    zs, zt = leaves[0] @ leaves[1].t(), h_t @ w_t.t()
    d_ref = reference(zs, zt, kind, beta)
    lp_ref, ent_ref = student_reference(zs, labels, valid=torch.ones(n, dtype=torch.bool))
    rows = slice(rank * v // world, (rank + 1) * v // world)
    mine = [h_s.clone().requires_grad_(), w_s[rows].clone().requires_grad_()]
    group = dist.group.WORLD
    kw = dict(divergence=Divergence(kind, beta), chunking=Chunking(chunk_size, vocab_chunk_size))
    student, teacher = OutputLayer(mine[1], process_group=group), OutputLayer(w_t[rows], process_group=group)
    with _Counted() as fwd:
        if form == "head":
            out = linear_divergence(mine[0], student, h_t, teacher, labels=labels, compute_entropy=True, **kw)
            total = (out.divergence * ups[0] + out.log_probs * ups[1] + out.entropy * ups[2]).sum()
        else:
            out = linear_divergence_loss(mine[0], student, h_t, teacher, reduction="sum", **kw)
            total = out.loss
    with _Counted() as bwd:
        total.backward()
    if form == "head":
        ref = (d_ref * ups[0] + lp_ref * ups[1] + ent_ref * ups[2]).sum()
        for a, b in ((out.divergence, d_ref), (out.log_probs, lp_ref), (out.entropy, ent_ref)):
            torch.testing.assert_close(a, b.detach(), rtol=1e-9, atol=1e-9)
    else:
        ref = d_ref.sum()
        torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-9, atol=1e-9)
    g_h, g_w = torch.autograd.grad(ref, leaves)
    torch.testing.assert_close(mine[0].grad, g_h, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(mine[1].grad, g_w[rows], rtol=1e-9, atol=1e-9)
    return fwd.calls, bwd.calls


def _tp2_counts(rank, world):
    for form in ("head", "loss"):
        for kind, beta in KINDS:
            for vcs in (None, 5):
                f3, b3 = _counts(form, kind, beta, 4, vcs, rank, world)  # 3 chunks
                f6, b6 = _counts(form, kind, beta, 2, vcs, rank, world)  # 6 chunks
                what = f"{form} {kind} vocab_chunk_size={vcs}"
                # per chunk: one MAX all-reduce and one all-gather of both heads' statistics, one SUM all-reduce
                # of the divergence's sums (none for a KL over vocabulary blocks: its value folds online and
                # rides in the gather); the rest (the call's agreement, the hidden gradient's all-reduce) once
                # per call
                folded = vcs is not None and kind != "jsd"
                reduces = 1 if folded else 2
                assert len(f6) - len(f3) == 3 * (reduces + 1), f"{what}: forward {f3} vs {f6}"
                assert f6.count("all_reduce") - f3.count("all_reduce") == 3 * reduces, what
                assert len(b6) == len(b3), f"{what}: backward has no per-chunk collective ({b3} vs {b6})"


def test_three_collectives_per_chunk_under_tp2():
    run_distributed(_tp2_counts, 2)


def test_compiled_padded_student_at_a_tiny_temperature_passes_no_nan():
    """The student's entropy term ``b * (ws - y)`` overflows at a -inf column's floored offset where ``g_h / t``
    exceeds 3.4e8 (t = 1e-9); ``p = 0`` times it is 0 in the compiled gradient too (it was NaN), as eager's."""
    from chunked_entropy import divergence_from_logits

    g = torch.Generator().manual_seed(6)
    zs, zt = torch.randn(4, V, generator=g), torch.randn(4, V, generator=g)
    zs[:, -3:] = float("-inf")
    zt[:, -3:] = -1e4
    labels = torch.randint(0, V - 3, (4,), generator=g)
    ups = torch.randn(3, 4, generator=g) * 10
    results = []
    for backend in ("eager", "compile"):
        x = zs.clone().requires_grad_()
        out = divergence_from_logits(x, zt, divergence="reverse_kl", labels=labels, temperature=1e-9,
                                     compute_entropy=True, chunking=Chunking(2, backend=backend))
        sum((o * u).sum() for o, u in zip(out, ups, strict=True)).backward()
        results.append([o.detach() for o in out] + [x.grad])
    assert torch.isfinite(results[1][-1]).all() and (results[1][-1][:, -3:] == 0).all()
    _close(results[1], results[0], "padded, t = 1e-9: compiled vs eager", 1e-5)


class _Asking:
    """A kernels object the walks have never seen: ``inner``'s answers, each ``pair_*`` call counted."""

    def __init__(self, inner):
        self.inner, self.asked = inner, {}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not name.startswith("pair_"):
            return attr

        def call(*args, **kwargs):
            self.asked[name] = self.asked.get(name, 0) + 1
            return attr(*args, **kwargs)
        return call


@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_the_pair_walk_asks_its_kernels_object_never_which_it_is(backend, monkeypatch):
    """Every per-block step of the two-head walk goes through the kernels object (``pair_ready`` / ``pair_held``
    where a block is read for the divergence, ``pair_cross`` for a KL folded over vocabulary blocks,
    ``pair_terms`` for the sums, ``pair_grad`` for the gradient): an object the walk cannot recognize (it
    checks no identity or backend) still runs every step, with bitwise the results of the object it wraps."""
    import chunked_entropy.config as config

    p = _problem(4)
    choose = config.choose_kernels
    cases = [("head", "jsd", 0.3, 16), ("head", "reverse_kl", None, 16), ("loss", "jsd", 0.3, None),
             ("loss", "forward_kl", None, 16)]
    asked = {}
    for form, kind, beta, vcs in cases:
        results = []
        for wrap in (False, True):
            made = []

            def chosen(*args, wrap=wrap, made=made, **kwargs):
                k = choose(*args, **kwargs)
                if wrap:
                    made.append(_Asking(k))
                    return made[-1]
                return k
            monkeypatch.setattr(config, "choose_kernels", chosen)
            results.append(_run(form, p, kind, beta, compiled=_kernels.COMPILED if backend == "compile" else None,
                                vocab_chunk_size=vcs))
            for m in made:
                for name, count in m.asked.items():
                    asked[name] = asked.get(name, 0) + count
        for got, want in zip(results[1], results[0], strict=True):
            assert torch.equal(got, want), (form, kind, vcs)
    assert set(asked) == {"pair_ready", "pair_held", "pair_cross", "pair_terms", "pair_grad"}, asked


#: Launches and working bytes (unscaled) of a divergence's forward and backward (40 tokens in chunks of 8, eager)
#: measured on the tree before the teacher became a second head of the one-head walks (integ 6519904): the walks
#: must not launch more nor hold more.
DIVERGENCE_LAUNCHES = {
    ("head", "jsd", None): (955, 17632),
    ("head", "jsd", 16): (4405, 7104),
    ("head", "forward_kl", None): (665, 12064),
    ("loss", "forward_kl", None): (475, 14320),
    ("loss", "forward_kl", 16): (2885, 6264),
    ("loss", "jsd", 16): (3910, 8208),
    ("logits", "reverse_kl", None): (543, 11720),
}


@pytest.mark.parametrize("form,kind,vcs", sorted(DIVERGENCE_LAUNCHES, key=str))
def test_a_divergences_launches_and_working_memory_do_not_grow(form, kind, vcs):
    from chunked_entropy.testing import cuda_branch

    g = torch.Generator().manual_seed(0)
    hs = torch.randn(40, 12, generator=g).requires_grad_()
    ws = (torch.randn(52, 12, generator=g) * 0.5).requires_grad_()
    ht, wt = torch.randn(40, 10, generator=g), torch.randn(52, 10, generator=g) * 0.5
    t = torch.rand(40, generator=g) + 0.5
    kw = dict(divergence=Divergence(kind, 0.3 if kind == "jsd" else None), chunking=Chunking(8, vcs, backend="eager"),
              temperature=t)
    with cuda_branch() as log:
        if form == "head":
            out = linear_divergence(hs, OutputLayer(ws, softcap=6.0), ht, OutputLayer(wt), compute_entropy=True,
                                    labels=torch.randint(0, 52, (40,), generator=g), **kw)
            (out.divergence.sum() + out.log_probs.sum() + out.entropy.sum()).backward()
        elif form == "loss":
            linear_divergence_loss(hs, OutputLayer(ws, softcap=6.0), ht, OutputLayer(wt), **kw).loss.backward()
        else:
            from chunked_entropy import divergence_from_logits

            zs = (hs @ ws.t()).detach().requires_grad_()
            out = divergence_from_logits(zs, ht @ wt.t(), student_layer=OutputLayer(softcap=6.0), **kw)
            out.divergence.sum().backward()
    launches, working = DIVERGENCE_LAUNCHES[form, kind, vcs]
    assert log.launches <= launches and log.working_bytes(scaled=False) <= working, \
        (log.launches, log.working_bytes(scaled=False))


def test_the_divergence_loss_allocates_its_gradient_buffer_after_its_statistics_pass(monkeypatch):
    """Issue 46 item 5: the divergence loss's forward walks the fused head's gradient walk (``head_grads``), but
    a teacher's walk never writes into a ``GradRows`` buffer, so with half-precision blocks read as the matmul
    rounds them (compiled kernels, bf16, no bias) the ``[n, block]`` buffer is still allocated after the
    statistics pass, as before, not held through it; and the loss still matches plain autograd's."""
    from chunked_entropy import _logit_blocks

    events = []

    class Recorded(_logit_blocks.GradRows):
        def __init__(self, *args, **kwargs):
            events.append("gradient buffer")
            super().__init__(*args, **kwargs)

    walk = dv.row_stats

    def recorded_walk(*args, **kwargs):
        out = walk(*args, **kwargs)
        events.append("statistics pass")
        return out

    monkeypatch.setattr(_logit_blocks, "GradRows", Recorded)
    monkeypatch.setattr(dv, "row_stats", recorded_walk)
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(24, 12, generator=g).to(torch.bfloat16).requires_grad_()
    ws = (torch.randn(52, 12, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    ht, wt = torch.randn(24, 10, generator=g).to(torch.bfloat16), (torch.randn(52, 10, generator=g) * 0.5).to(
        torch.bfloat16)
    loss = linear_divergence_loss(hs, ws, ht, wt, chunking=Chunking(8, 16, backend="compile")).loss
    loss.backward()
    assert events == ["statistics pass", "gradient buffer"], events
    # the value against float64 autograd: within bf16's rounding of the logits
    lp_s = torch.log_softmax(hs.double() @ ws.double().t(), -1)
    lp_t = torch.log_softmax(ht.double() @ wt.double().t(), -1)
    want = (lp_t.exp() * (lp_t - lp_s)).sum(-1).mean()
    assert abs(loss.double().item() - want.item()) <= 2e-2 * max(1.0, abs(want.item()))
