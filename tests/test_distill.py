"""Distillation outputs: ``log_probs_at=ids`` and ``top_k=k`` on every entry point, against float64.

Values and every gradient (random upstream gradients on every output) of the
logits path, the fused head and the Module, both backends, against
``log_softmax`` of the float64 transformed logits gathered at the same ids:
large logit offsets, small temperatures (per token too), soft-cap and logit
scale, ids that include or exclude the row maximum, repeated ids, K = 1 and K
larger than a vocabulary block, labels or none (``labels=None``), masks.
Under tensor parallelism (2 and 3 ranks over gloo) a row's ids live on only
some ranks; the fused head with sequence parallelism. Bad input is named
before any work, nothing of ``[tokens, V]`` is allocated, and caller tensors
are never written.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import (
    ChunkedVocabParallelHead,
    Chunking,
    OutputLayer,
    linear_log_probs_and_entropy,
    log_probs_and_entropy,
)
from tests.helpers import run_distributed


def _transform(z, softcap, logit_scale, t):
    x = z if logit_scale is None else z * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x / t


def _reference(z64, labels, ids, k, *, temperature=1.0, softcap=None, logit_scale=None, label_mask=None):
    """float64 ``(log_probs, entropy, log_probs_at, top_k_ids, top_k_log_probs)`` of the definition."""
    t = temperature
    if isinstance(t, torch.Tensor):
        t = torch.broadcast_to(t.double(), z64.shape[:-1]).unsqueeze(-1)
    logp = torch.log_softmax(_transform(z64, softcap, logit_scale, t), -1)
    out = [None, -(logp.exp() * logp).sum(-1), None, None, None]
    if labels is not None:
        valid = labels != -100 if label_mask is None else (labels != -100) & label_mask
        lp = logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
        out[0] = torch.where(valid, lp, 0.0)
    if ids is not None:
        out[2] = logp.gather(-1, ids)
    if k:
        top = logp.detach().topk(k, dim=-1).indices
        out[3], out[4] = top, logp.gather(-1, top)
    return out


def _loss(outs, ups):
    return sum((o.double() * u).sum() for o, u in zip(outs, ups, strict=True)
               if o is not None and o.is_floating_point())


def _case(lead=(3, 5), v=29, K=4, seed=0, offset=0.0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*lead, v, generator=g, dtype=torch.float64) * scale + offset
    labels = torch.randint(0, v, lead, generator=g)
    ids = torch.randint(0, v, (*lead, K), generator=g)
    flat = ids.view(-1, K)
    flat[0] = z.view(-1, v)[0].argmax()  # a row whose ids are all the maximum (repeated)
    if K > 1:
        flat[1, 1] = flat[1, 0]  # a repeat
    return z, labels, ids, g


def _ups(lead, K, k, g):
    return [torch.randn(lead, generator=g, dtype=torch.float64), torch.randn(lead, generator=g, dtype=torch.float64),
            torch.randn(*lead, K, generator=g, dtype=torch.float64), None,
            torch.randn(*lead, k, generator=g, dtype=torch.float64) if k else None]


def _check(out, ref, ups, leaves, ref_leaves, tol):
    ours = [out.log_probs, out.entropy, out.log_probs_at, out.top_k_ids, out.top_k_log_probs]
    for o, r in zip(ours, ref, strict=True):
        assert (o is None) == (r is None)
        if o is not None and o.is_floating_point():
            torch.testing.assert_close(o.double(), r.detach(), **tol)
    if ref[3] is not None:
        assert torch.equal(ours[3], ref[3])
    _loss(ours, ups).backward()
    _loss(ref, ups).backward()
    for leaf, r in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(leaf.grad.double(), r.grad, **tol)


OPTS = [
    dict(),
    dict(temperature=0.05, offset=1e4),
    dict(softcap=7.0, temperature=0.8),
    dict(logit_scale=0.5, temperature="per_token"),
    dict(label_mask=True, offset=-300.0),
]


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("opts", OPTS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("K,k,labels_too", [(4, 5, True), (1, 0, True), (40, 3, False)], ids=["K4k5", "K1", "K40"])
def test_logits_path_matches_float64(backend, opts, K, k, labels_too):
    o = dict(opts)
    z, labels, ids, g = _case(K=K, offset=o.pop("offset", 0.0))
    t = o.pop("temperature", 1.0)
    if t == "per_token":
        t = torch.rand(labels.shape, generator=g, dtype=torch.float64) + 0.3
    mask = (torch.rand(labels.shape, generator=g) < 0.7) if o.pop("label_mask", False) else None
    x = z.clone().requires_grad_()
    snap = ids.clone()
    out = log_probs_and_entropy(x, labels if labels_too else None, log_probs_at=ids, top_k=k or None,
                                layer=OutputLayer(**o), chunking=Chunking(4, backend=backend), temperature=t,
                                label_mask=mask)
    assert torch.equal(ids, snap) and torch.equal(x.detach(), z)
    zr = z.clone().requires_grad_()
    ref = _reference(zr, labels if labels_too else None, ids, k, temperature=t, label_mask=mask, **o)
    _check(out, ref, _ups(labels.shape, K, k, g), [x], [zr], dict(rtol=1e-9, atol=1e-9))


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("vocab_chunk_size", [None, 5])
def test_fused_head_and_module_match_float64(backend, vocab_chunk_size):
    g = torch.Generator().manual_seed(3)
    lead, h, v, K, k = (2, 6), 4, 23, 9, 6  # K and k larger than a vocabulary block
    hidden = torch.randn(*lead, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, lead, generator=g)
    ids = torch.randint(0, v, (*lead, K), generator=g)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    out = linear_log_probs_and_entropy(leaves[0], OutputLayer(leaves[1], leaves[2], softcap=9.0), labels,
                                       chunking=Chunking(5, vocab_chunk_size=vocab_chunk_size, backend=backend),
                                       log_probs_at=ids, top_k=k)
    refs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = _reference(refs[0] @ refs[1].t() + refs[2], labels, ids, k, softcap=9.0)
    _check(out, ref, _ups(lead, K, k, g), leaves, refs, dict(rtol=1e-9, atol=1e-9))
    head = ChunkedVocabParallelHead(OutputLayer(weight, bias, softcap=9.0),
                                    Chunking(5, vocab_chunk_size=vocab_chunk_size, backend=backend))
    got = head(hidden, None, log_probs_at=ids, top_k=k)
    assert got.log_probs is None
    torch.testing.assert_close(got.log_probs_at, ref[2].detach(), rtol=1e-9, atol=1e-9)
    assert torch.equal(got.top_k_ids, ref[3])


def test_no_grad_zero_tokens_and_nothing_of_tokens_by_vocab():
    from tests.test_logits import _Allocations

    z, labels, ids, _ = _case(lead=(40,), v=301, K=8)
    z32 = z.float()
    with torch.no_grad():
        out = log_probs_and_entropy(z32, labels, log_probs_at=ids, top_k=5, chunking=8)
    assert out.log_probs_at.grad_fn is None and out.top_k_ids.dtype == torch.int64
    x = z32.clone().requires_grad_()
    with _Allocations() as fwd:
        out = log_probs_and_entropy(x, labels, log_probs_at=ids, top_k=5, chunking=8)
    assert max(fwd.sizes) <= 8 * 301 < 40 * 301
    empty = log_probs_and_entropy(torch.zeros(0, 7, requires_grad=True), torch.zeros(0, dtype=torch.long),
                                  log_probs_at=torch.zeros(0, 3, dtype=torch.long), top_k=2)
    assert empty.log_probs_at.shape == (0, 3) and empty.top_k_ids.shape == (0, 2)


def test_bad_input_is_named_before_any_work():
    z, labels, ids, _ = _case()
    x = z.clone().requires_grad_()
    keep = (torch.tensor([1, 2]), torch.tensor([0] + [2] * 15))
    for kw, exc, name in (
        (dict(log_probs_at=ids + 29), ValueError, r"log_probs_at must hold vocabulary ids in \[0, 29\)"),
        (dict(log_probs_at=ids[:2]), ValueError, "log_probs_at must be"),
        (dict(log_probs_at=ids.float()), TypeError, "log_probs_at must hold integer"),
        (dict(log_probs_at=ids[..., :0]), ValueError, "K >= 1"),
        (dict(log_probs_at=ids.tolist()), TypeError, "log_probs_at must be an int64 tensor"),
        (dict(top_k=30), ValueError, "top_k must be an int in"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=2.0), ValueError, "top_k"),
        (dict(log_probs_at=ids, keep=keep), ValueError, "keep="),
    ):
        with pytest.raises(exc, match=name):
            log_probs_and_entropy(x, labels, **kw)
    with pytest.raises(TypeError, match="labels"):  # no labels and nothing else asked
        log_probs_and_entropy(x, None)
    assert x.grad is None


def _tp_worker(rank, world):
    group = dist.group.WORLD
    v_local = 7
    v = v_local * world
    z, labels, ids, g = _case(lead=(4, 3), v=v, K=5, seed=10 + world)
    ids.view(-1, 5)[2] = torch.tensor([0, 1, 2, 3, 4])  # this row's ids all on rank 0's shard
    shard = slice(rank * v_local, (rank + 1) * v_local)
    for backend in ("eager",):
        x = z[..., shard].clone().requires_grad_()
        out = log_probs_and_entropy(x, labels, log_probs_at=ids, top_k=6, layer=OutputLayer(process_group=group),
                                    chunking=Chunking(5, backend=backend), temperature=0.6)
        zr = z.clone().requires_grad_()
        ref = _reference(zr, labels, ids, 6, temperature=0.6)
        ups = _ups(labels.shape, 5, 6, g)
        ours = [out.log_probs, out.entropy, out.log_probs_at, out.top_k_ids, out.top_k_log_probs]
        for o, r in zip(ours, ref, strict=True):
            if o.is_floating_point():
                torch.testing.assert_close(o, r.detach(), rtol=1e-9, atol=1e-9)
        assert torch.equal(out.top_k_ids, ref[3])
        _loss(ours, ups).backward()
        _loss(ref, ups).backward()
        torch.testing.assert_close(x.grad, zr.grad[..., shard], rtol=1e-9, atol=1e-9)
    # a soft-cap without top_k: the ids' log-probs are taken from the row's largest logit over every rank's shard
    x = z[..., shard].clone().requires_grad_()
    out = log_probs_and_entropy(x, labels, log_probs_at=ids, layer=OutputLayer(process_group=group, softcap=4.0),
                                chunking=Chunking(5), temperature=0.6)
    zr = z.clone().requires_grad_()
    ref = _reference(zr, labels, ids, 0, temperature=0.6, softcap=4.0)
    torch.testing.assert_close(out.log_probs_at, ref[2].detach(), rtol=1e-9, atol=1e-9)
    up = torch.randn(ids.shape, generator=g, dtype=torch.float64)
    (out.log_probs_at * up).sum().backward()
    (ref[2] * up).sum().backward()
    torch.testing.assert_close(x.grad, zr.grad[..., shard], rtol=1e-9, atol=1e-9)
    # the fused head under sequence parallelism: hidden [S/P, B, H], ids over the full [S, B]
    s_len, b, hdim = 2 * world, 3, 4
    hidden = torch.randn(s_len, b, hdim, generator=g, dtype=torch.float64)
    weight = torch.randn(v, hdim, generator=g, dtype=torch.float64)
    hids = torch.randint(0, v, (s_len, b, 3), generator=g)
    rows = slice(rank * 2, rank * 2 + 2)
    h = hidden[rows].clone().requires_grad_()
    w = weight[shard].clone().requires_grad_()
    out = linear_log_probs_and_entropy(h, OutputLayer(w, process_group=group, sequence_parallel=True), None,
                                       log_probs_at=hids, top_k=4, chunking=Chunking(4, vocab_chunk_size=3))
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _reference(hr @ wr.t(), None, hids, 4)
    torch.testing.assert_close(out.log_probs_at, ref[2].detach(), rtol=1e-9, atol=1e-9)
    assert torch.equal(out.top_k_ids, ref[3])
    up1 = torch.randn(s_len, b, 3, generator=g, dtype=torch.float64)
    up2 = torch.randn(s_len, b, 4, generator=g, dtype=torch.float64)
    ((out.log_probs_at * up1).sum() + (out.top_k_log_probs * up2).sum()).backward()
    ((ref[2] * up1).sum() + (ref[4] * up2).sum()).backward()
    torch.testing.assert_close(h.grad, hr.grad[rows], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(w.grad, wr.grad[shard], rtol=1e-9, atol=1e-9)
    # ranks that pass different ids are named
    other = ids.clone()
    other.view(-1)[0] = (other.view(-1)[0] + rank) % v
    with pytest.raises(ValueError, match="log_probs_at .the ids. differs across"):
        log_probs_and_entropy(z[..., shard], labels, log_probs_at=other, layer=OutputLayer(process_group=group))
    with pytest.raises(ValueError, match="top_k"):
        log_probs_and_entropy(z[..., shard], labels, top_k=2 + rank, layer=OutputLayer(process_group=group))


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_and_sequence_parallel(world):
    run_distributed(_tp_worker, world, timeout_s=120)


def _confident_rows(n=8192, v=16, seed=3):
    """Rows with one confident token (the argmax, by 0 to 60 over a spread of 3) and a soft-cap's worth of range:
    ``u = tanh(z / 30)`` lands on many float32 values, where compiled ``tanh`` and eager's differ by an ulp at about
    one in a thousand (Inductor's CPU ``tanh``); ``k = softcap / t = 3e4`` makes an ulp of ``u`` 1.8e-3 nats."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * 3
    z[torch.arange(n), torch.randint(0, v, (n,), generator=g)] += torch.rand(n, generator=g) * 60
    top = z.argmax(1)
    ids = torch.stack([top, torch.randint(0, v, (n,), generator=g), top], 1)
    return z, top, ids


@pytest.mark.parametrize("path", ["logits", "head"])
@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("top_k", [None, 2])
def test_a_confident_tokens_log_prob_is_never_above_0(path, backend, top_k):
    """A soft-cap and t = 1e-3: the log-probs at ids and the top-k's are <= 0 on every backend, and within eager's
    error of float64 (the row's own top token: -log s, as eager gives). The kernels' row maximum came from their
    own tanh while the ids' u came from eager's: +1.8e-3 with the compiled kernels."""
    z, top, ids = _confident_rows()
    kw = dict(temperature=1e-3, log_probs_at=ids, top_k=top_k)
    if path == "logits":
        run = lambda be: log_probs_and_entropy(z, top, layer=OutputLayer(softcap=30.0),  # noqa: E731
                                               chunking=Chunking(1024, backend=be), **kw)
    else:  # the fused head: hidden states z through an identity weight (the logits are z, exactly)
        layer = OutputLayer(torch.eye(z.shape[1]), softcap=30.0)
        run = lambda be: linear_log_probs_and_entropy(z, layer, top, chunking=Chunking(1024, backend=be),  # noqa: E731
                                                      **kw)
    out, eager = run(backend), run("eager")
    ref = _reference(z.double(), top, ids, top_k or 0, temperature=1e-3, softcap=30.0)
    pairs = [(out.log_probs_at, eager.log_probs_at, ref[2])]
    if top_k:
        assert torch.equal(out.top_k_ids[:, 0], top)
        pairs.append((out.top_k_log_probs, eager.top_k_log_probs, ref[4]))
    for got, e, r in pairs:
        assert got.max() <= 0, got.max()
        err, err_eager = (got.double() - r).abs(), (e.double() - r).abs()
        assert (err <= err_eager + 1e-6).all(), (err - err_eager).max()
    torch.testing.assert_close(out.log_probs_at[:, 0], out.log_probs, rtol=0, atol=1e-6)  # the label is the top
