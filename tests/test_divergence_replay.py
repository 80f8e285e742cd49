"""A divergence's student with sampling replay's kept sets (``keep``) and distillation's outputs
(``log_probs_at``, ``top_k``): the teacher is a second head of the one-head walks, so its student's rows go
through the same code as the fused head's. Against the float64 definitions, values and gradients (random upstream
gradients on every output; a large logit offset, confident rows, small temperatures, soft-caps on both heads),
eager and compiled, over hidden states and over logits, one vocabulary block and several; under TP 2 over gloo
with the collectives of a chunk counted (three, as without them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import Chunking, Divergence, OutputLayer, divergence_from_logits, linear_divergence
from tests.helpers import run_distributed
from tests.test_divergence import reference as divergence_reference
from tests.test_divergence import transformed
from tests.test_divergence_walk import _Counted
from tests.test_replay import _csr
from tests.test_replay import reference as replay_reference

V = 28
KINDS = [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.3)]
SOFTCAP_S, SOFTCAP_T = 6.0, 9.0


def _problem(seed: int, n: int = 14, softcap=SOFTCAP_S):
    """A student with a soft-cap, or (``softcap`` None) every logit offset by 400 (a soft-cap would flatten it)."""
    g = torch.Generator().manual_seed(seed)
    new = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    hs, ht = new(n, 8), new(n, 7)
    ws, wt, bs = new(V, 8) * 0.8, new(V, 7) * 0.8, new(V) * 0.2
    if softcap is None:
        hs[:, 0], ws[:, 0] = 1.0, 400.0  # every student logit offset by 400: a large offset
    ws[5] += 3.0  # a confident column
    labels = torch.randint(0, V, (n,), generator=g)
    labels[3] = -100
    mask = torch.rand(n, generator=g) > 0.15
    t = torch.rand(n, generator=g, dtype=torch.float64) * 0.6 + 0.05  # small temperatures among them
    sets = [sorted(set(torch.randint(0, V, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()))
            for _ in range(n)]
    ids = torch.randint(0, V, (n, 3), generator=g)
    ups = [new(n) for _ in range(3)] + [new(n, 3), new(n, 2)]
    return dict(hs=hs, ht=ht, ws=ws, wt=wt, bs=bs, labels=labels, mask=mask, t=t, sets=sets, ids=ids, ups=ups,
                softcap=softcap)


def _reference(p, kind, beta, extra, rows=slice(None)):
    """The float64 definitions: ``[divergence, log_probs, entropy, (log_probs_at, top_k_log_probs)]``, the
    top-k ids, and the gradients w.r.t. the student's hidden states, weight (``rows`` of it) and bias."""
    hs, ws, bs = (p[k].clone().requires_grad_() for k in ("hs", "ws", "bs"))
    zs, zt = hs @ ws.t() + bs, p["ht"] @ p["wt"].t()
    valid = p["mask"] & (p["labels"] != -100)
    d = divergence_reference(zs, zt, kind, beta, temperature=p["t"], student=dict(softcap=p["softcap"]),
                             teacher=dict(softcap=SOFTCAP_T))
    d = torch.where(valid, d, 0.0)
    sets = p["sets"] if extra.get("keep") else [[] for _ in p["sets"]]  # no sets: the whole row
    lp, ent, _ = replay_reference(zs, p["labels"], sets, temperature=p["t"], softcap=p["softcap"],
                                  label_mask=p["mask"])
    values, top_ids = [d, lp, ent], None
    if extra.get("at"):
        lps = torch.log_softmax(transformed(zs, temperature=p["t"], softcap=p["softcap"]), -1)
        top = lps.topk(2, dim=-1)
        values += [lps.gather(1, p["ids"]), top.values]
        top_ids = top.indices
    total = sum((v * u).sum() for v, u in zip(values, p["ups"], strict=False))
    g_h, g_w, g_b = torch.autograd.grad(total, (hs, ws, bs))
    return [v.detach() for v in values], top_ids, [g_h, g_w[rows], g_b[rows]]


def _ours(p, kind, beta, extra, *, form, backend, vcs, group=None, rows=slice(None)):
    """The op's outputs (as :func:`_reference` orders them), top-k ids and gradients (the shard's rows)."""
    hs, ws, bs = p["hs"].clone().requires_grad_(), p["ws"][rows].clone().requires_grad_(), \
        p["bs"][rows].clone().requires_grad_()
    kw = dict(divergence=Divergence(kind, beta), chunking=Chunking(p.get("chunk", 4), vcs, backend=backend),
              labels=p["labels"], temperature=p["t"], label_mask=p["mask"], compute_entropy=True)
    if extra.get("keep"):
        kw.update(keep=_csr(p["sets"]))
    if extra.get("at"):
        kw.update(log_probs_at=p["ids"], top_k=2)
    if form == "head":
        out = linear_divergence(hs, OutputLayer(ws, bs, softcap=p["softcap"], process_group=group), p["ht"],
                                OutputLayer(p["wt"][rows], softcap=SOFTCAP_T, process_group=group), **kw)
        leaves = (hs, ws, bs)
    else:
        zs = (hs @ ws.t() + bs).detach().requires_grad_()
        out = divergence_from_logits(zs, p["ht"] @ p["wt"][rows].t(),
                                     student_layer=OutputLayer(softcap=p["softcap"], process_group=group),
                                     teacher_layer=OutputLayer(softcap=SOFTCAP_T, process_group=group), **kw)
        leaves = (zs,)
    values = [out.divergence, out.log_probs, out.entropy]
    if extra.get("at"):
        values += [out.log_probs_at, out.top_k_log_probs]
    else:
        assert out.log_probs_at is None and out.top_k_ids is None and out.top_k_log_probs is None
    total = sum((v * u).sum() for v, u in zip(values, p["ups"], strict=False))
    grads = torch.autograd.grad(total, leaves)
    if form == "logits":  # the logits' gradient through the projection, as the reference's
        grads = torch.autograd.grad((hs @ ws.t() + bs), (hs, ws, bs), grads[0])
    return [v.detach() for v in values], out.top_k_ids, list(grads)


EXTRAS = {"keep": dict(keep=True), "ids and top-k": dict(at=True)}


@pytest.mark.parametrize("extra", sorted(EXTRAS))
@pytest.mark.parametrize("kind,beta", KINDS)
@pytest.mark.parametrize("softcap", [SOFTCAP_S, None])
def test_replay_and_distillation_outputs_beside_the_divergence_match_float64(kind, beta, extra, softcap):
    p = _problem(1, softcap=softcap)
    want, want_ids, want_grads = _reference(p, kind, beta, EXTRAS[extra])
    for form in ("head", "logits"):
        for backend in ("eager", "compile"):
            for vcs in (None, 8):
                got, ids, grads = _ours(p, kind, beta, EXTRAS[extra], form=form, backend=backend, vcs=vcs)
                what = f"{extra}, {form}, {backend}, vocab_chunk_size={vcs}, softcap={softcap}"
                for i, (a, b) in enumerate(zip(got + grads, want + want_grads, strict=True)):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, i=i, w=what: f"{w} #{i}: {m}")
                if want_ids is not None:
                    assert torch.equal(ids, want_ids), what


def test_replay_and_ids_need_no_pass_of_their_own():
    """Replay's kept sets and distillation's ids ride on the student's blocks: the teacher's block is filled as
    often as without them (each block once in forward, once in backward, one vocabulary block)."""
    from chunked_entropy import _loop

    p = _problem(2)
    counts = {}
    fill = _loop._TeacherWalk.fill
    for name, extra in (("none", {}), *EXTRAS.items()):
        calls = []
        _loop._TeacherWalk.fill = lambda self, *a, calls=calls: calls.append(a) or fill(self, *a)
        try:
            _ours(p, "jsd", 0.3, extra, form="head", backend="eager", vcs=None)
        finally:
            _loop._TeacherWalk.fill = fill
        counts[name] = len(calls)
    assert set(counts.values()) == {2 * 4}, counts  # 14 rows in 4 chunks of 4, forward and backward


def _tp2(rank, world):
    group = dist.group.WORLD
    rows = slice(rank * V // world, (rank + 1) * V // world)
    p = _problem(3, n=12)
    for kind, beta in KINDS:
        for extra in EXTRAS.values():
            want, want_ids, want_grads = _reference(p, kind, beta, extra, rows=rows)
            for vcs in (None, 5):
                calls = {}
                for chunk in (4, 2):  # 3 chunks, 6 chunks
                    with _Counted() as fwd:
                        got, ids, grads = _ours(dict(p, chunk=chunk), kind, beta, extra, form="head",
                                                backend="eager", vcs=vcs, group=group, rows=rows)
                    calls[chunk] = fwd.calls
                what = f"rank {rank} {kind} {extra} vocab_chunk_size={vcs}"
                for i, (a, b) in enumerate(zip(got + grads, want + want_grads, strict=True)):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, i=i, w=what: f"{w} #{i}: {m}")
                if want_ids is not None:
                    assert torch.equal(ids, want_ids), what
                # per chunk, as without replay or ids: one MAX all-reduce and one all-gather of both heads'
                # statistics (the kept sets' riding in both), one SUM all-reduce of the divergence's sums (none
                # for a KL folded over vocabulary blocks); the rest (the call's agreement, the top-k's merge) once
                reduces = 1 if vcs is not None and kind != "jsd" else 2
                f3, f6 = calls[4], calls[2]
                assert len(f6) - len(f3) == 3 * (reduces + 1), f"{what}: {f3} vs {f6}"
                assert f6.count("all_reduce") - f3.count("all_reduce") == 3 * reduces, what


def test_replay_and_distillation_beside_the_divergence_under_tp2():
    run_distributed(_tp2, 2)


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_rows_kept_takes_the_ids_and_kept_sets_at_the_rows(extra):
    """``rows="kept"`` projects only the labelled rows, ``log_probs_at`` and ``keep`` given in the tokens' full
    shape as the fused head takes them: the outputs of those rows are the full call's."""
    p = _problem(4)
    kw = dict(labels=p["labels"], label_mask=p["mask"], temperature=p["t"], compute_entropy=True, chunking=4)
    if EXTRAS[extra].get("keep"):
        kw.update(keep=_csr(p["sets"]))
    else:
        kw.update(log_probs_at=p["ids"], top_k=2)
    layers = OutputLayer(p["ws"], p["bs"], softcap=p["softcap"]), OutputLayer(p["wt"], softcap=SOFTCAP_T)
    full = linear_divergence(p["hs"], layers[0], p["ht"], layers[1], **kw)
    kept = linear_divergence(p["hs"], layers[0], p["ht"], layers[1], rows="kept", **kw)
    valid = p["mask"] & (p["labels"] != -100)
    for f in ("divergence", "log_probs", "entropy", "log_probs_at", "top_k_ids", "top_k_log_probs"):
        a, b = getattr(full, f), getattr(kept, f)
        assert (a is None) == (b is None), f
        if a is not None:
            torch.testing.assert_close(a[valid], b[valid], rtol=1e-12, atol=1e-12, msg=f)
