"""Sampling replay (``keep=``): log-probs over the rollout's kept sets, against float64.

The reference is written from the definition: ``log_softmax`` of the
transformed, tempered logits with every entry outside the row's kept set at
``-inf``, where the kept set is the recorded ids plus the label (a repeat
counts once) and a row with an empty recorded set keeps the whole vocabulary.
Values and every gradient, with random upstream gradients on every output,
in every path (logits, fused head, the Module, both fused losses), both
backends, and over gloo with 2 and 3 ranks (sequence parallelism for the head).
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

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
from tests.helpers import run_distributed

V = 37


# ------------------------------------------------------------ kept sets and the float64 reference


def _sets(z, labels, seed, kinds=("topk", "topp", "no_max", "empty", "repeats", "no_label")):
    """Kept sets of several kinds, cycling over the rows (global ids)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    zf = z.reshape(-1, z.shape[-1]).double()
    for i, row in enumerate(zf):
        kind = kinds[i % len(kinds)]
        order = torch.argsort(row, descending=True)
        if kind == "topk":  # the k largest
            ids = order[: int(torch.randint(1, 6, (), generator=g))].tolist()
        elif kind == "topp":  # the smallest prefix of the sorted distribution with mass >= p
            p = torch.softmax(row, -1)[order].cumsum(0)
            cut = int((p < float(torch.rand((), generator=g)) * 0.8 + 0.1).sum()) + 1
            ids = order[:cut].tolist()
        elif kind == "no_max":  # arbitrary ids that exclude the row's maximum
            ids = [j for j in torch.randperm(len(row), generator=g)[:6].tolist() if j != int(order[0])]
        elif kind == "empty":  # not truncated
            ids = []
        elif kind == "repeats":
            ids = order[:3].tolist() * 2 + [int(order[5])]
        else:  # the label is not recorded (it still counts as kept)
            ids = [j for j in order[:4].tolist() if j != int(labels.reshape(-1)[i])]
        out.append(ids)
    return out


def _csr(sets, device="cpu"):
    ids = torch.tensor([j for s in sets for j in s], dtype=torch.int64, device=device)
    offsets = torch.tensor([0, *itertools.accumulate(len(s) for s in sets)], dtype=torch.int64, device=device)
    return ids, offsets


def _kept_mask(sets, labels, v, valid):
    """The full-vocabulary kept mask of the definition: recorded ids and the label; empty: everything."""
    flat = labels.reshape(-1)
    m = torch.zeros(len(sets), v, dtype=torch.bool)
    for i, s in enumerate(sets):
        if not s:
            m[i] = True
            continue
        m[i, s] = True
        if valid.reshape(-1)[i]:
            m[i, flat[i]] = True
    return m


def _transform(z, softcap, logit_scale, t):
    x = z if logit_scale is None else z * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x / t


def reference(z64, labels, sets, *, temperature=1.0, softcap=None, logit_scale=None, entropy_of="full",
              label_mask=None, ignore_index=-100):
    """float64 ``(log_probs, entropy, sum_pi_squared)`` of the definition; differentiable in ``z64``."""
    lead = labels.shape
    valid = labels != ignore_index if label_mask is None else (labels != ignore_index) & label_mask
    t = temperature
    if isinstance(t, torch.Tensor):
        t = torch.broadcast_to(t.double(), lead).unsqueeze(-1)
    x = _transform(z64, softcap, logit_scale, t).reshape(-1, z64.shape[-1])
    mask = _kept_mask(sets, labels, z64.shape[-1], valid)
    logp_k = torch.log_softmax(x.masked_fill(~mask, -math.inf), -1)
    flat = torch.where(valid.reshape(-1), labels.reshape(-1), 0)
    lp = torch.where(valid.reshape(-1), logp_k.gather(1, flat[:, None]).squeeze(1), 0.0)
    logp = logp_k if entropy_of == "kept" else torch.log_softmax(x, -1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return lp.reshape(lead), ent.reshape(lead), (p * p).sum(-1).reshape(lead)


def _case(lead=(3, 7), v=V, seed=0, offset=0.0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*lead, v, generator=g, dtype=torch.float64) * scale + offset
    labels = torch.randint(0, v, lead, generator=g)
    ups = [torch.randn(lead, generator=g, dtype=torch.float64) for _ in range(3)]
    return z, labels, ups


def _loss(outs, ups):
    return sum((o.double() * u).sum() for o, u in zip(outs, ups, strict=True) if o is not None)


def _check(ours, refs, ups, leaves, ref_leaves, tol):
    for o, r in zip(ours, refs, strict=True):
        if o is not None:
            torch.testing.assert_close(o.double(), r.detach(), **tol)
    _loss(ours, ups).backward()
    _loss([r if o is not None else None for o, r in zip(ours, refs, strict=True)], ups).backward()
    for leaf, ref in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(leaf.grad.double(), ref.grad, **tol)


# ------------------------------------------------------------ the logits path


CASES = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(offset=1e4), id="offset_1e4"),
    pytest.param(dict(temperature=0.05), id="t_0.05"),
    pytest.param(dict(temperature="per_token", softcap=5.0, logit_scale=0.7), id="softcap_per_token_t"),
    pytest.param(dict(entropy_of="kept"), id="entropy_of_kept"),
    pytest.param(dict(entropy_of="kept", temperature=0.3, softcap=3.0, mask=True), id="kept_softcap_masked"),
]


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logits_path_matches_float64(opts, backend, dtype):
    z, labels, ups = _case(seed=1, offset=opts.get("offset", 0.0))
    t = opts.get("temperature", 1.0)
    if t == "per_token":
        t = torch.rand(labels.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.3
    mask = None
    if opts.get("mask"):
        mask = torch.ones(labels.shape, dtype=torch.bool)
        mask[0, ::3] = False
    sets = _sets(z, labels, seed=3)
    kw = dict(temperature=t, softcap=opts.get("softcap"), logit_scale=opts.get("logit_scale"),
              entropy_of=opts.get("entropy_of", "full"))
    x = z.to(dtype).requires_grad_()
    layer = OutputLayer(softcap=kw["softcap"], logit_scale=kw["logit_scale"])
    out = log_probs_and_entropy(x, labels, keep=_csr(sets), layer=layer, chunking=Chunking(4, backend=backend),
                                compute_sum_pi_squared=True, label_mask=mask, entropy_of=kw["entropy_of"],
                                temperature=t.to(dtype) if isinstance(t, torch.Tensor) else t)
    zr = z.to(dtype).double().requires_grad_()
    refs = reference(zr, labels, sets, label_mask=mask, **kw)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    _check([out.log_probs, out.entropy, out.sum_pi_squared], refs, ups, [x], [zr], tol)


def test_a_row_keeps_its_label_counts_a_repeat_once_and_an_empty_set_is_not_truncated():
    z = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 4, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 2])
    sets = [[3], [3, 3, 3], [], [2]]  # the label not recorded; a repeat; empty; the label alone
    lp, _ = log_probs_and_entropy(z, labels, keep=_csr(sets))
    e = torch.exp(torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64))
    want = [math.log(e[0] / (e[0] + e[3])), math.log(e[0] / (e[0] + e[3])), math.log(e[1] / e.sum()), 0.0]
    torch.testing.assert_close(lp, torch.tensor(want, dtype=torch.float64))


def test_csr_pair_sampling_mask_lists_and_the_dense_mask_agree():
    z, labels, _ = _case(seed=4)
    sets = _sets(z, labels, seed=5)
    ids, offsets = _csr(sets)
    want = log_probs_and_entropy(z, labels, keep=(ids, offsets), compute_sum_pi_squared=True, entropy_of="kept")
    dense = torch.zeros(*labels.shape, V, dtype=torch.bool)
    for i, s in enumerate(sets):
        dense.view(-1, V)[i, s] = True
    for keep in (SimpleNamespace(token_ids=ids, offsets=offsets),  # vLLM's SamplingMask carries these two
                 SimpleNamespace(token_ids=ids.tolist(), offsets=offsets.tolist()),
                 (ids.int(), offsets.int()), dense):
        got = log_probs_and_entropy(z, labels, keep=keep, compute_sum_pi_squared=True, entropy_of="kept")
        for a, b in ((got.log_probs, want.log_probs), (got.entropy, want.entropy),
                     (got.sum_pi_squared, want.sum_pi_squared)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_no_grad_and_the_callers_tensors():
    z, labels, _ = _case(seed=6)
    ids, offsets = _csr(_sets(z, labels, seed=7))
    snap = [t.clone() for t in (z, labels, ids, offsets)]
    x = z.clone().requires_grad_()
    with_grad = log_probs_and_entropy(x, labels, keep=(ids, offsets))
    with torch.no_grad():
        without = log_probs_and_entropy(x, labels, keep=(ids, offsets))
    assert without.log_probs.grad_fn is None
    torch.testing.assert_close(without.log_probs, with_grad.log_probs.detach())
    for before, after in zip(snap, (x.detach(), labels, ids, offsets), strict=True):
        assert torch.equal(before, after)


def test_only_chunk_sized_buffers_and_the_entries_are_allocated():
    """Nothing of [tokens, V]: forward allocates chunk-sized buffers and O(kept ids) entries."""
    from tests.test_logits import _Allocations

    n, v, chunk = 64, 301, 8
    z, labels, _ = _case(lead=(n,), v=v, seed=8)
    ids, offsets = _csr(_sets(z, labels, seed=9))
    x = z.float().requires_grad_()
    with _Allocations() as fwd:
        lp, h = log_probs_and_entropy(x, labels, keep=(ids, offsets), chunking=chunk)
    assert max(fwd.sizes) <= max(chunk * v, 4 * (ids.numel() + n)) < n * v


def test_a_dense_mask_row_that_holds_the_whole_vocabulary_is_not_truncated_and_costs_no_entries():
    """slime's mask builder leaves rows without a recorded nucleus all True: such a row means "the whole
    vocabulary", is read as not truncated, and adds no entries (it used to add one per True element)."""
    from tests.test_logits import _Allocations

    n, v, chunk = 48, 301, 8
    z, labels, ups = _case(lead=(n,), v=v, seed=40)
    sets = _sets(z, labels, seed=41)
    dense = torch.zeros(n, v, dtype=torch.bool)
    for i, s in enumerate(sets):
        dense[i, s] = True
    whole = torch.arange(n) % 3 == 0  # every third row: all True (its set becomes "not truncated")
    dense[whole] = True
    sets = [[] if w else s for s, w in zip(sets, whole.tolist(), strict=True)]
    x = z.clone().requires_grad_()
    out = log_probs_and_entropy(x, labels, keep=dense, chunking=chunk, compute_sum_pi_squared=True, entropy_of="kept")
    zr = z.clone().requires_grad_()
    refs = reference(zr, labels, sets, entropy_of="kept")
    _check([out.log_probs, out.entropy, out.sum_pi_squared], refs, ups, [x], [zr], dict(rtol=1e-10, atol=1e-10))
    # an all-True mask costs what no keep costs: nothing of the mask's size is allocated
    z32, every = z.float(), torch.ones(n, v, dtype=torch.bool)
    with _Allocations() as fwd, torch.no_grad():
        got = log_probs_and_entropy(z32, labels, keep=every, chunking=chunk)
    assert max(fwd.sizes) <= chunk * v < n * v
    plain = log_probs_and_entropy(z32, labels, chunking=chunk)
    assert torch.equal(got.log_probs, plain.log_probs) and torch.equal(got.entropy, plain.entropy)


# ------------------------------------------------------------ the fused head and the Module


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("vocab_chunk_size", [None, 10])
@pytest.mark.parametrize("entropy_of", ["full", "kept"])
def test_fused_head_and_module_match_float64(vocab_chunk_size, entropy_of, backend):
    g = torch.Generator().manual_seed(10)
    hidden = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 6, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64) + 100.0
    labels = torch.randint(0, V, (3, 5), generator=g)
    ups = [torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    z = hidden @ weight.t() + bias
    sets = _sets(z, labels, seed=11)
    kw = dict(keep=_csr(sets), temperature=0.6, entropy_of=entropy_of, compute_sum_pi_squared=True)
    for module in (False, True):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        if module:
            head = ChunkedVocabParallelHead(OutputLayer(leaves[1], leaves[2], softcap=30.0),
                                            Chunking(4, vocab_chunk_size=vocab_chunk_size, backend=backend))
            out = head(leaves[0], labels, **kw)
        else:
            out = linear_log_probs_and_entropy(leaves[0], OutputLayer(leaves[1], leaves[2], softcap=30.0), labels,
                                               chunking=Chunking(4, vocab_chunk_size=vocab_chunk_size, backend=backend),
                                               **kw)
        refs_in = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        zr = refs_in[0] @ refs_in[1].t() + refs_in[2]
        refs = reference(zr, labels, sets, temperature=0.6, softcap=30.0, entropy_of=entropy_of)
        _check([out.log_probs, out.entropy, out.sum_pi_squared], refs, ups, leaves, refs_in,
               dict(rtol=1e-9, atol=1e-10))


# ------------------------------------------------------------ the fused losses


@pytest.mark.parametrize("path,vocab_chunk_size", [("head", None), ("head", 9), ("logits", None)])
@pytest.mark.parametrize("entropy_of", ["full", "kept"])
def test_fused_losses_use_the_kept_log_probs(path, entropy_of, vocab_chunk_size):
    g = torch.Generator().manual_seed(12)
    b, t = 3, 6
    hidden = torch.randn(b, t, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 5, generator=g, dtype=torch.float64) * 1.5
    labels = torch.randint(0, V, (b, t), generator=g)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.5
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    ref_lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.5
    mask = torch.rand(b, t, generator=g) < 0.8
    sets = _sets(hidden @ weight.t(), labels, seed=13)
    policy = PolicyLoss(options={"clip_ratio_c": 3.0}, entropy_coeff=0.05, kl_coef=0.1, entropy_of=entropy_of,
                        aggregation="seq-mean-token-mean")
    kw = dict(loss=policy, ref_log_probs=ref_lp, temperature=0.8, keep=_csr(sets))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if path == "head":
        loss, metrics = linear_policy_loss(h, w, labels, old, adv, mask, chunking=Chunking(4, vocab_chunk_size),
                                           **kw)
    else:
        loss, metrics = policy_loss_from_logits(h @ w.t(), labels, old, adv, mask, chunking=4, **kw)
    loss.backward()
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent, _ = reference(h64 @ w64.t(), labels, sets, temperature=0.8, entropy_of=entropy_of)
    pg, want_metrics = losses.policy_loss(lp, old, adv, mask, PolicyLoss(options={"clip_ratio_c": 3.0},
                                                                           aggregation="seq-mean-token-mean"))
    want = (pg - 0.05 * losses.agg_loss(ent, mask, "seq-mean-token-mean")
            + 0.1 * losses.agg_loss(losses.kl_penalty(lp, ref_lp), mask, "seq-mean-token-mean"))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, h64.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w.grad, w64.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(metrics["actor/ppo_kl"], want_metrics["actor/ppo_kl"], rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------ the row's own filter (NeMo-RL's top-k / top-p)


def _own_filter(x, top_k, top_p):
    """The definition, row by row in float64, in descending order: the ids at or above the ``top_k``-th largest;
    of those, each whose softmax mass strictly above it (over the top-k ones) is below ``top_p``."""
    keep = torch.zeros(x.shape, dtype=torch.bool)
    for i, row in enumerate(x):
        order = row.argsort(descending=True).tolist()
        cut = row[order[top_k - 1]] if top_k else -math.inf
        ids = [j for j in order if row[j] >= cut]
        p = torch.softmax(row[ids], 0).tolist()
        above = 0.0
        for j, pj in zip(ids, p, strict=True):
            if top_p is None or above < top_p:
                keep[i, j] = True
            above += pj
    return keep


def own_reference(z64, labels, top_k, top_p, *, temperature=1.0, softcap=None, label_mask=None, entropy_of="full"):
    """float64 ``(log_probs, entropy)`` of NeMo-RL's filtered log-probs, and the value whose gradient NeMo-RL
    takes (``log_softmax`` over the kept set; a label outside it: ``-inf``, gradient ``-p^K`` on the kept ids)."""
    t = temperature
    if isinstance(t, torch.Tensor):
        t = t.double().unsqueeze(-1)
    x = _transform(z64, softcap, None, t).reshape(-1, z64.shape[-1])
    mask = _own_filter(x.detach(), top_k, top_p)
    logp_k = torch.log_softmax(x.masked_fill(~mask, -math.inf), -1)
    flat = labels.reshape(-1)
    valid = torch.ones_like(flat, dtype=torch.bool) if label_mask is None else label_mask.reshape(-1)
    inside = mask.gather(1, flat[:, None]).squeeze(1)
    lse = torch.logsumexp(x.masked_fill(~mask, -math.inf), -1)
    grad_of = torch.where(valid, torch.where(inside, x.gather(1, flat[:, None]).squeeze(1), 0.0) - lse, 0.0)
    lp = torch.where(valid & ~inside, -math.inf, grad_of)
    logp = logp_k if entropy_of == "kept" else torch.log_softmax(x, -1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    lead = labels.shape
    return lp.reshape(lead), grad_of.reshape(lead), ent.reshape(lead), inside.reshape(lead)


OWN = [
    pytest.param(dict(top_k=5), id="top_k"),
    pytest.param(dict(top_p=0.8, temperature=0.7), id="top_p"),
    pytest.param(dict(top_k=9, top_p=0.9, temperature="per_token", softcap=4.0, mask=True), id="both_softcap"),
    pytest.param(dict(top_p=0.6, entropy_of="kept", offset=1e4), id="top_p_entropy_of_kept_offset"),
]


@pytest.mark.parametrize("opts", OWN)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_rows_own_filter_matches_float64(opts, dtype):
    z, labels, ups = _case(seed=40, offset=opts.get("offset", 0.0))
    labels.view(-1)[::2] = z.reshape(-1, V).argmax(-1)[::2]  # half the labels at the row's top: inside its set
    t = opts.get("temperature", 1.0)
    if t == "per_token":
        t = torch.rand(labels.shape, generator=torch.Generator().manual_seed(41), dtype=torch.float64) + 0.3
    mask = None
    if opts.get("mask"):
        mask = torch.ones(labels.shape, dtype=torch.bool)
        mask[0, ::3] = False
    keep = {k: opts[k] for k in ("top_k", "top_p") if k in opts}
    entropy_of = opts.get("entropy_of", "full")
    x = z.to(dtype).requires_grad_()
    before = x.detach().clone()
    out = log_probs_and_entropy(x, labels, keep=keep, layer=OutputLayer(softcap=opts.get("softcap")), chunking=4,
                                label_mask=mask, temperature=t.to(dtype) if isinstance(t, torch.Tensor) else t,
                                entropy_of=entropy_of)
    zr = z.to(dtype).double().requires_grad_()
    lp, grad_of, ent, inside = own_reference(zr, labels, opts.get("top_k"), opts.get("top_p"), temperature=t,
                                             softcap=opts.get("softcap"), label_mask=mask, entropy_of=entropy_of)
    valid = torch.ones_like(inside) if mask is None else mask
    assert (valid & inside).any() and (valid & ~inside).any()  # both kinds of label occur
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out.log_probs.double(), lp.detach(), **tol)  # -inf where the label is outside
    torch.testing.assert_close(out.entropy.double(), ent.detach(), **tol)
    ((out.log_probs.double() * ups[0]).sum() + (out.entropy.double() * ups[1]).sum()).backward()
    ((grad_of * ups[0]).sum() + (ent * ups[1]).sum()).backward()
    torch.testing.assert_close(x.grad.double(), zr.grad, **tol)
    assert torch.equal(x.detach(), before)


def test_the_rows_own_filter_keeping_everything_is_the_whole_row():
    z, labels, _ = _case(seed=42)
    whole = log_probs_and_entropy(z, labels).log_probs
    for keep in ({"top_k": -1}, {"top_k": None, "top_p": 1.0}, {"top_k": V}, {"top_k": 0, "top_p": 1}):
        torch.testing.assert_close(log_probs_and_entropy(z, labels, keep=keep).log_probs, whole, rtol=0, atol=0)


# ------------------------------------------------------------ bad input


def test_bad_kept_sets_are_named_before_any_work():
    z, labels, _ = _case(lead=(4,), seed=14)
    n = labels.numel()
    ok_ids, ok_off = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1, 3, 3])
    bad = [
        ((ok_ids, torch.tensor([0, 2, 1, 3, 3])), ValueError, "offsets must start at 0, never decrease"),
        ((ok_ids, torch.tensor([0, 1, 3, 3])), ValueError, f"n_tokens \\+ 1 = {n + 1}"),
        ((ok_ids, torch.tensor([1, 1, 2, 3, 3])), ValueError, "start at 0"),
        ((ok_ids, torch.tensor([0, 1, 1, 2, 2])), ValueError, "end at len\\(token_ids\\)"),
        ((torch.tensor([1, V, 3]), ok_off), ValueError, f"token_ids must be vocabulary ids in \\[0, {V}\\)"),
        ((torch.tensor([1, -1, 3]), ok_off), ValueError, "token_ids must be vocabulary ids"),
        ((ok_ids.float(), ok_off), TypeError, "token_ids must hold integers"),
        ((ok_ids, ok_off.view(1, -1)), ValueError, "offsets must be 1-D"),
        ((ok_ids.to("meta"), ok_off), ValueError, "token_ids is on meta"),
        (torch.ones(4, V + 1, dtype=torch.bool), ValueError, r"dense mask must be \[..., V_local\]"),
        (torch.ones(4, V), TypeError, "bool tensor"),
        ("top-p", TypeError, "keep must be a \\(token_ids, offsets\\) pair"),
        ({"top_p": 0.0}, ValueError, "keep's top_p must be a float in \\(0, 1\\]"),
        ({"top_p": 1.5}, ValueError, "keep's top_p must be a float in \\(0, 1\\]"),
        ({"top_k": 2.0}, TypeError, "keep's top_k must be an int or None"),
        ({"top_k": True}, TypeError, "keep's top_k must be an int or None"),
        ({"top_n": 3}, ValueError, "keys 'top_k' and/or 'top_p', got \\['top_n'\\]"),
        ({}, ValueError, "keys 'top_k' and/or 'top_p'"),
    ]
    x = z.clone().requires_grad_()
    for keep, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            log_probs_and_entropy(x, labels, keep=keep)
    with pytest.raises(ValueError, match="entropy_of"):
        log_probs_and_entropy(x, labels, keep=(ok_ids, ok_off), entropy_of="kept_set")
    with pytest.raises(ValueError, match="entropy_of='kept' needs keep"):
        log_probs_and_entropy(x, labels, entropy_of="kept")
    with pytest.raises(TypeError, match="row's own filter .* needs the logits"):
        linear_log_probs_and_entropy(x, torch.randn(V, V, dtype=x.dtype), labels, keep={"top_p": 0.5})
    with pytest.raises(TypeError, match="row's own filter .* needs the logits"):  # the fused policy loss
        policy_loss_from_logits(x, labels, torch.zeros(4), torch.ones(4), torch.ones(4), keep={"top_k": 2})
    assert x.grad is None


# ------------------------------------------------------------ tensor and sequence parallelism


def _tp_worker(rank, world):
    group = dist.group.WORLD
    v_local = 11
    v = v_local * world
    z, labels, ups = _case(lead=(4, 5), v=v, seed=20 + world)
    sets = _sets(z, labels, seed=21)
    sets[3] = [1, 2, 4]  # every kept id in rank 0's shard: the other ranks hold none of this row's
    labels.view(-1)[3] = v - 1  # and its label on the last rank
    shard = slice(rank * v_local, (rank + 1) * v_local)
    ids, offsets = _csr(sets)
    # eager kernels (each spawned process would compile its own; test_compiled covers them under TP)
    for backend, entropy_of in (("eager", "full"), ("eager", "kept")):
        # the logits path: a CSR pair (every rank the same) and this rank's shard of the dense mask
        dense = torch.zeros(*labels.shape, v, dtype=torch.bool)
        for i, s in enumerate(sets):
            dense.view(-1, v)[i, s] = True
        for keep in ((ids, offsets), dense[..., shard]):
            x = z[..., shard].clone().requires_grad_()
            out = log_probs_and_entropy(x, labels, keep=keep, layer=OutputLayer(process_group=group),
                                        chunking=Chunking(3, backend=backend), temperature=0.7, entropy_of=entropy_of,
                                        compute_sum_pi_squared=True)
            zr = z.clone().requires_grad_()
            refs = reference(zr, labels, sets, temperature=0.7, entropy_of=entropy_of)
            ours = [out.log_probs, out.entropy, out.sum_pi_squared]
            for o, r in zip(ours, refs, strict=True):
                torch.testing.assert_close(o, r.detach(), rtol=1e-10, atol=1e-10)
            _loss(ours, ups).backward()
            _loss(refs, ups).backward()
            torch.testing.assert_close(x.grad, zr.grad[..., shard], rtol=1e-10, atol=1e-10)
    # dense masks with whole rows: row 0 all True on every shard (not truncated), row 1 all True on rank 0's
    # shard only (truncated: rank 0 keeps its whole shard, the others one id each)
    dense = torch.zeros(*labels.shape, v, dtype=torch.bool)
    for i, s in enumerate(sets):
        dense.view(-1, v)[i, s] = True
    flat = dense.view(-1, v)
    flat[0] = True
    flat[1] = False
    flat[1, :v_local] = True
    flat[1, v_local::v_local] = True
    wsets = [[] if i == 0 else flat[i].nonzero().squeeze(1).tolist() if i == 1 else s for i, s in enumerate(sets)]
    x = z[..., shard].clone().requires_grad_()
    out = log_probs_and_entropy(x, labels, keep=dense[..., shard].clone(), layer=OutputLayer(process_group=group),
                                chunking=3)
    zr = z.clone().requires_grad_()
    lp, ent, _ = reference(zr, labels, wsets)
    torch.testing.assert_close(out.log_probs, lp.detach(), rtol=1e-10, atol=1e-10)
    ((out.log_probs * ups[0]).sum() + (out.entropy * ups[1]).sum()).backward()
    ((lp * ups[0]).sum() + (ent * ups[1]).sum()).backward()
    torch.testing.assert_close(x.grad, zr.grad[..., shard], rtol=1e-10, atol=1e-10)
    # the fused head under sequence parallelism: hidden [S/P, B, H], labels and kept sets over the full [S, B]
    g = torch.Generator().manual_seed(30)
    s_len, b, hdim = 2 * world, 3, 4
    hidden = torch.randn(s_len, b, hdim, generator=g, dtype=torch.float64)
    weight = torch.randn(v, hdim, generator=g, dtype=torch.float64)
    lab = torch.randint(0, v, (s_len, b), generator=g)
    hsets = _sets(hidden @ weight.t(), lab, seed=31)  # rows in the order of the flattened [S, B] labels
    rows = slice(rank * 2, rank * 2 + 2)
    h = hidden[rows].clone().requires_grad_()
    w = weight[shard].clone().requires_grad_()
    out = linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group, sequence_parallel=True), lab,
                                       keep=_csr(hsets), chunking=Chunking(4, vocab_chunk_size=5))
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent, _ = reference(hr @ wr.t(), lab, hsets)
    torch.testing.assert_close(out.log_probs, lp.detach(), rtol=1e-10, atol=1e-10)
    up = torch.randn(s_len, b, generator=g, dtype=torch.float64)
    (out.log_probs * up).sum().backward()
    (lp * up).sum().backward()
    torch.testing.assert_close(h.grad, hr.grad[rows], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(w.grad, wr.grad[shard], rtol=1e-9, atol=1e-10)
    # the row's own filter: each rank gathers the rows' shards, the same kept sets on every rank
    for keep in ({"top_k": 4}, {"top_k": 7, "top_p": 0.7}):
        lab = labels.clone()
        lab.view(-1)[::2] = z.reshape(-1, v).argmax(-1)[::2]
        x = z[..., shard].clone().requires_grad_()
        out = log_probs_and_entropy(x, lab, keep=keep, layer=OutputLayer(process_group=group), chunking=3,
                                    temperature=0.7)
        zr = z.clone().requires_grad_()
        lp, grad_of, ent, _ = own_reference(zr, lab, keep.get("top_k"), keep.get("top_p"), temperature=0.7)
        torch.testing.assert_close(out.log_probs, lp.detach(), rtol=1e-10, atol=1e-10)
        ((out.log_probs * ups[0]).sum() + (out.entropy * ups[1]).sum()).backward()
        ((grad_of * ups[0]).sum() + (ent * ups[1]).sum()).backward()
        torch.testing.assert_close(x.grad, zr.grad[..., shard], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="keep's top_p .bits. differs across"):
        log_probs_and_entropy(z[..., shard], labels, keep={"top_p": 0.5 + 0.1 * rank},
                              layer=OutputLayer(process_group=group))
    # ranks that pass different kept sets get the same clear error
    other = ids.clone()
    other[0] = (other[0] + rank) % v
    with pytest.raises(ValueError, match="keep's token_ids differs across"):
        log_probs_and_entropy(z[..., shard], labels, keep=(other, offsets), layer=OutputLayer(process_group=group))


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_and_sequence_parallel(world):
    run_distributed(_tp_worker, world, timeout_s=120)


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("form", ["own_filter", "csr"])
def test_a_confident_labels_kept_log_prob_is_never_above_0(backend, form):
    """A soft-cap of 30 at t = 1e-3 (``k = 3e4``: an ulp of ``u`` is 1.8e-3 nats) on rows with a confident label:
    the kept set's log-prob is <= 0 and eager's, on every backend. The label's ``u`` came from the kernels' tanh
    and the kept set's maximum from eager's, an ulp apart at about one value in a thousand: +1.8e-3 compiled."""
    g = torch.Generator().manual_seed(3)
    n, v = 8192, 16
    z = torch.randn(n, v, generator=g) * 3
    z[torch.arange(n), torch.randint(0, v, (n,), generator=g)] += torch.rand(n, generator=g) * 60
    labels = z.argmax(1)
    if form == "own_filter":
        keep = {"top_k": 4}
    else:  # the label and three others
        others = torch.randint(0, v, (n, 3), generator=g)
        keep = (torch.cat([labels[:, None], others], 1).reshape(-1), torch.arange(0, 4 * n + 1, 4))
    out, eager = (log_probs_and_entropy(z, labels, keep=keep, layer=OutputLayer(softcap=30.0), temperature=1e-3,
                                        chunking=Chunking(1024, backend=be)) for be in (backend, "eager"))
    assert out.log_probs.max() <= 0, out.log_probs.max()
    torch.testing.assert_close(out.log_probs, eager.log_probs, rtol=0, atol=1e-6)
