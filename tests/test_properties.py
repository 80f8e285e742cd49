"""Property tests (hypothesis): invariances the chunked computation must keep.

- the chunk size does not change values or gradients;
- adding a per-row constant to the logits changes nothing (softmax is shift-invariant);
- splitting the vocabulary into any number of shards (or blocks) and merging their
  statistics the way :func:`chunked_entropy.parallel.reduce_stats` does (one MAX, rescale,
  one SUM) gives the full-vocabulary values, and the per-shard gradients concatenate to
  the full gradient. Real multi-process runs are in ``test_logits_parallel.py``.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunked_entropy import Chunking, _stats, linear_log_probs_and_entropy, log_probs_and_entropy
from tests.helpers import reference

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)

# float32 computation compared with float32 computation of the same rows: reductions
# over <= 48 columns, a few ulps of the O(1..10) quantities involved.
SAME = dict(rtol=1e-5, atol=1e-5)
SAME_GRAD = dict(rtol=1e-5, atol=1e-6)


def _case(seed, n, v, pad=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * scale
    if pad:
        x[:, v - pad :] = float("-inf")
    labels = torch.randint(0, v - pad, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return x, labels, g_lp, g_h


def _run(x, labels, g_lp, g_h, **kw):
    leaf = x.clone().requires_grad_(True)
    lp, h = log_probs_and_entropy(leaf, labels, **kw)
    ((lp * g_lp).sum() + (h * g_h).sum()).backward()
    return lp.detach(), h.detach(), leaf.grad


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 24),
    v=st.integers(1, 40),
    c1=st.integers(1, 30),
    c2=st.integers(1, 30),
    temperature=st.sampled_from([1.0, 0.7, 1.9]),
)
def test_chunk_size_does_not_matter(seed, n, v, c1, c2, temperature):
    x, labels, g_lp, g_h = _case(seed, n, v)
    a = _run(x, labels, g_lp, g_h, chunking=c1, temperature=temperature)
    b = _run(x, labels, g_lp, g_h, chunking=c2, temperature=temperature)
    for u, w, tol in zip(a, b, (SAME, SAME, SAME_GRAD), strict=True):
        torch.testing.assert_close(u, w, **tol)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 16),
    v=st.integers(2, 40),
    shift=st.lists(st.integers(-64, 64), min_size=16, max_size=16),
    per_row_t=st.booleans(),
)
def test_adding_a_constant_to_a_row_changes_nothing(seed, n, v, shift, per_row_t):
    x, labels, g_lp, g_h = _case(seed, n, v)
    # Logits on a 2**-10 grid and integer shifts: x + c is exact in float32, so any
    # difference comes from the computation, not from rounding the shifted input.
    x = torch.round(x * 1024) / 1024
    c = torch.tensor(shift[:n], dtype=torch.float32).unsqueeze(1)
    t = (torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.5) if per_row_t else 0.8
    a = _run(x, labels, g_lp, g_h, chunking=5, temperature=t)
    b = _run(x + c, labels, g_lp, g_h, chunking=5, temperature=t)
    # lse and mu now sit near |c|/t <= 128 where a float32 ulp is 7.6e-6: allow a few.
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=4e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=4e-5)
    torch.testing.assert_close(a[2], b[2], rtol=1e-4, atol=2e-5)


def _split(v, cuts):
    """Block boundaries of ``range(v)`` from a list of cut points."""
    edges = sorted({0, v, *(k % (v + 1) for k in cuts)})
    return list(zip(edges[:-1], edges[1:], strict=True))


def _sharded(x, labels, inv_t, blocks, compute_entropy):
    """Per-shard statistics, merged as parallel.reduce_stats merges ranks: MAX, rescale, SUM."""
    stats = []
    for v0, v1 in blocks:
        local = labels - v0
        target = torch.where((local >= 0) & (local < v1 - v0), local, -1)
        xb = x[:, v0:v1].clone()
        scratch = torch.empty_like(xb) if compute_entropy else None
        stats.append(
            _stats.block_stats(xb, _stats.Transform(), inv_t, target, 0, scratch, want_w=compute_entropy, want_q=False)
        )
    m = torch.stack([s.m for s in stats]).amax(0)
    stats = [_stats.rescale(s, m, inv_t) for s in stats]
    merged = _stats.BlockStats(
        m,
        sum(s.ones for s in stats),
        sum(s.rest for s in stats),
        sum(s.w for s in stats) if compute_entropy else None,
        None,
        sum(s.zl for s in stats),
    )
    return _stats.RowStats.from_block(merged, inv_t)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 12),
    v=st.integers(2, 48),
    cuts=st.lists(st.integers(0, 48), max_size=6),
    pad=st.integers(0, 12),
    temperature=st.sampled_from([1.0, 0.6]),
)
def test_vocab_shards_merge_to_the_full_vocabulary(seed, n, v, cuts, pad, temperature):
    pad = min(pad, v - 1)  # the last shards may be entirely padding
    x, labels, g_lp, g_h = _case(seed, n, v, pad=pad)
    blocks = _split(v, cuts)
    inv_t = None if temperature == 1.0 else 1.0 / temperature

    # values: merged shard statistics == one block == float64 reference
    r = _sharded(x, labels, inv_t, blocks, True)
    whole = _sharded(x, labels, inv_t, [(0, v)], True)
    xr = x.double().requires_grad_(True)
    lp_ref, h_ref = reference(xr, labels, temperature=temperature)
    for rr in (r, whole):
        torch.testing.assert_close(rr.log_probs().double(), lp_ref.detach(), **SAME)
        torch.testing.assert_close(rr.entropy().double(), h_ref.detach(), **SAME)
    # log-prob-only statistics merge to the same lse
    r_lp = _sharded(x, labels, inv_t, blocks, False)
    torch.testing.assert_close(r_lp.ls, r.ls, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r_lp.m, r.m, rtol=0, atol=0)

    # gradients: each shard's block_grad from the merged statistics, concatenated
    ((lp_ref * g_lp.double()).sum() + (h_ref * g_h.double()).sum()).backward()
    co = _stats.Coefficients(g_lp * (inv_t or 1.0), g_h * (inv_t or 1.0), None)
    parts = []
    for v0, v1 in blocks:
        local = labels - v0
        target = torch.where((local >= 0) & (local < v1 - v0), local, -1)
        xb = x[:, v0:v1].clone()
        parts.append(
            _stats.block_grad(xb, _stats.Transform(), inv_t, r, target, 0, co, torch.empty_like(xb), None)
        )
    grad = torch.cat(parts, dim=1)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), xr.grad, **SAME_GRAD)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 10),
    v=st.integers(2, 40),
    vb=st.integers(1, 40),
)
def test_fused_head_vocab_blocks_do_not_matter(seed, n, v, vb):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 8, generator=g)
    weight = torch.randn(v, 8, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def run(vocab_chunk_size):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = linear_log_probs_and_entropy(h, w, labels, chunking=Chunking(3, vocab_chunk_size=vocab_chunk_size),
                                               temperature=0.9)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    a, b = run(None), run(vb)
    for u, w_ in zip(a, b, strict=True):
        torch.testing.assert_close(u, w_, rtol=1e-5, atol=2e-5)
    # and the blocked head equals the logits path on the materialised logits
    lp, ent = log_probs_and_entropy(hidden @ weight.t(), labels, temperature=0.9)
    torch.testing.assert_close(b[0], lp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(b[1], ent, rtol=1e-5, atol=2e-5)


VIEWS = {
    "drop_last_token": lambda t: t[:, :-1],
    "transpose": lambda t: t.transpose(0, 1),
    "step": lambda t: t[:, ::2],
    "vocab_slice": lambda t: t[..., 1:],
}


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 4),
    s=st.integers(2, 7),
    v=st.integers(2, 20),
    chunk=st.integers(1, 9),
    view=st.sampled_from(sorted(VIEWS)),
    masked=st.booleans(),
)
def test_strides_do_not_matter(seed, b, s, v, chunk, view, masked):
    """A strided view gives bitwise the results of its contiguous copy: the same values
    reach the same float32 chunk buffers, whichever way the rows are fetched."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(b, s, v + 1, generator=g) * 3
    lead = VIEWS[view](base).shape
    labels = torch.randint(0, lead[-1], lead[:-1], generator=g)
    mask = (torch.rand(lead[:-1], generator=g) > 0.5) if masked else None
    g_lp, g_h = torch.randn(lead[:-1], generator=g), torch.randn(lead[:-1], generator=g)

    def run(make):
        leaf = base.clone().requires_grad_(True)
        x = make(leaf)
        lp, h = log_probs_and_entropy(x, labels, chunking=chunk, label_mask=mask, temperature=0.8)
        (grad,) = torch.autograd.grad((lp * g_lp).sum() + (h * g_h).sum(), leaf)
        return lp, h, grad

    strided = run(VIEWS[view])
    copied = run(lambda t: VIEWS[view](t).contiguous())
    for a, c in zip(strided, copied, strict=True):
        assert torch.equal(a, c)
