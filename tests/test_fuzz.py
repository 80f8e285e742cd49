"""Property-based fuzzing of the public entry points against float64 (hypothesis).

Each example draws shapes, a dtype, offsets and scales of the logits, masks
and ignored labels, a scalar or per-token temperature, a soft-cap and a logit
scale, chunk and vocabulary-block sizes, the backend, which outputs are asked
for, and random upstream gradients; the library's values and gradients must
match the float64 reference (``tests.helpers.reference``) built from the same
inputs. The fused losses draw every aggregation mode, clip settings, KL and
entropy terms and the global normalizers, against their composition from
``chunked_entropy.losses`` on float64 outputs.

``derandomize=True`` makes the examples the same on every run (CI is
reproducible); the example counts keep the file to well under a minute.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunked_entropy import (
    Chunking,
    OutputLayer,
    PolicyLoss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    losses,
    policy_loss_from_logits,
)
from chunked_entropy.losses import Aggregation
from tests.helpers import reference

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@st.composite
def token_cases(draw):
    """Everything but the logits themselves: shapes, per-token inputs, transform, options."""
    lead = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    v = draw(st.integers(1, 90))
    c = dict(
        lead=tuple(lead), v=v, seed=draw(st.integers(0, 2**31 - 1)),
        dtype=draw(st.sampled_from(list(DTYPES))),
        scale=draw(st.sampled_from([0.1, 1.0, 4.0, 12.0])),
        offset=draw(st.sampled_from([0.0, -30.0, 500.0, 1e4])),
        t_kind=draw(st.sampled_from(["one", "scalar", "per_token"])),
        t=draw(st.floats(0.05, 3.0)),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 50.0))),
        logit_scale=draw(st.one_of(st.none(), st.floats(0.1, 3.0))),
        chunk=draw(st.integers(1, 40)),
        vocab_chunk=draw(st.one_of(st.none(), st.integers(1, v))),
        mask=draw(st.sampled_from(["none", "random", "all_off"])),
        ignored=draw(st.booleans()),
        entropy=draw(st.booleans()),
        sum_pi_squared=draw(st.booleans()),
        backend=draw(st.sampled_from(["eager", "eager", "compile"])),
    )
    return c


def _tokens(c, g):
    labels = torch.randint(0, c["v"], c["lead"], generator=g)
    if c["ignored"]:
        labels.view(-1)[:: 3] = -100
    mask = None
    if c["mask"] == "random":
        mask = torch.rand(c["lead"], generator=g) < 0.7
    elif c["mask"] == "all_off":
        mask = torch.zeros(c["lead"], dtype=torch.bool)
    if c["t_kind"] == "one":
        t = 1.0
    elif c["t_kind"] == "scalar":
        t = c["t"]
    else:
        t = torch.rand(c["lead"], generator=g) * 2 + 0.05
    return labels, mask, t


def _tol(ref: torch.Tensor, dtype) -> dict:
    """Error relative to the answer's own size: float32 arithmetic (float64 for float64 inputs), and a
    gradient returned in the input's dtype (bf16: its rounding, 2**-8)."""
    big = 1.0 + ref.abs().max().item() if ref.numel() else 1.0
    eps = {torch.float64: 1e-12, torch.bfloat16: 2**-8}.get(dtype, 3e-6)
    return dict(rtol=eps * 10, atol=eps * 10 * big)


def _check_outputs(out, ref, ups, leaves, refs, dtype):
    ours = [out.log_probs, out.entropy, out.sum_pi_squared]
    loss = sum((o.double() * u).sum() for o, u in zip(ours, ups, strict=True) if o is not None)
    want = sum((r * u).sum() for o, r, u in zip(ours, ref, ups, strict=True) if o is not None)
    values_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # outputs are float32
    for o, r in zip(ours, ref, strict=True):
        if o is not None:
            torch.testing.assert_close(o.double(), r.detach(), **_tol(r, values_dtype))
    if not any(t.requires_grad for t in leaves):
        return
    loss.backward()
    want.backward()
    for leaf, r in zip(leaves, refs, strict=True):
        torch.testing.assert_close(leaf.grad.double(), r.grad, **_tol(r.grad, dtype))


@FUZZ
@given(c=token_cases())
def test_logits_path(c):
    g = torch.Generator().manual_seed(c["seed"])
    dtype = DTYPES[c["dtype"]]
    labels, mask, t = _tokens(c, g)
    z = (torch.randn(*c["lead"], c["v"], generator=g, dtype=torch.float64) * c["scale"] + c["offset"]).to(dtype)
    x = z.clone().requires_grad_()
    out = log_probs_and_entropy(x, labels, layer=OutputLayer(softcap=c["softcap"], logit_scale=c["logit_scale"]),
                                chunking=Chunking(c["chunk"], backend=c["backend"]), temperature=t, label_mask=mask,
                                compute_entropy=c["entropy"], compute_sum_pi_squared=c["sum_pi_squared"])
    xr = z.double().requires_grad_()
    t64 = t.double() if isinstance(t, torch.Tensor) else t
    ref = reference(xr, labels, temperature=t64, label_mask=mask, softcap=c["softcap"],
                    logit_scale=c["logit_scale"], sum_pi_squared=True)
    ups = [torch.randn(c["lead"], generator=g, dtype=torch.float64) for _ in range(3)]
    assert z.equal(x.detach())  # never written
    _check_outputs(out, ref, ups, [x], [xr], dtype)


@FUZZ
@given(c=token_cases(), h=st.integers(1, 12), bias=st.booleans())
def test_fused_head(c, h, bias):
    g = torch.Generator().manual_seed(c["seed"])
    dtype = DTYPES[c["dtype"]]
    labels, mask, t = _tokens(c, g)
    hidden = torch.randn(*c["lead"], h, generator=g, dtype=torch.float64)
    weight = torch.randn(c["v"], h, generator=g, dtype=torch.float64) * c["scale"] / math.sqrt(h)
    b = torch.randn(c["v"], generator=g, dtype=torch.float64) + c["offset"] if bias else None
    leaves = [x.to(dtype).requires_grad_() for x in (hidden, weight, *([b] if bias else []))]
    layer = OutputLayer(leaves[1], leaves[2] if bias else None, softcap=c["softcap"], logit_scale=c["logit_scale"])
    out = linear_log_probs_and_entropy(leaves[0], layer, labels,
                                       chunking=Chunking(c["chunk"], c["vocab_chunk"], c["backend"]),
                                       temperature=t, label_mask=mask, compute_entropy=c["entropy"],
                                       compute_sum_pi_squared=c["sum_pi_squared"])
    refs = [x.detach().double().requires_grad_() for x in leaves]
    z = refs[0] @ refs[1].t() + (refs[2] if bias else 0)
    t64 = t.double() if isinstance(t, torch.Tensor) else t
    ref = reference(z, labels, temperature=t64, label_mask=mask, softcap=c["softcap"],
                    logit_scale=c["logit_scale"], sum_pi_squared=True)
    ups = [torch.randn(c["lead"], generator=g, dtype=torch.float64) for _ in range(3)]
    if dtype == torch.float64:
        _check_outputs(out, ref, ups, leaves, refs, dtype)
    else:  # the logits themselves are rounded to float32 (or formed in bf16) before our exact arithmetic
        tol = dict(rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=2e-2 if dtype == torch.bfloat16 else 1e-4)
        torch.testing.assert_close(out.log_probs.double(), ref[0].detach(),
                                   **{k: v * (1 + ref[0].abs().max().item()) for k, v in tol.items()})


@FUZZ
@given(
    c=token_cases(),
    mode=st.sampled_from(losses.AGG_MODES),
    clip=st.sampled_from([(0.2, 0.2, None), (0.2, 0.28, 3.0), (0.1, 0.5, 1.5)]),
    entropy_coeff=st.sampled_from([0.0, 0.01, -0.3]),
    kl=st.sampled_from([(0.0, "low_var_kl"), (0.1, "k1"), (0.2, "k2"), (0.05, "abs"), (0.1, "k3+")]),
    dp=st.sampled_from([1, 2]),
    path=st.sampled_from(["head", "logits"]),
)
def test_fused_loss(c, mode, clip, entropy_coeff, kl, dp, path):
    g = torch.Generator().manual_seed(c["seed"])
    b, t_len = c["lead"][0], (c["lead"][1] if len(c["lead"]) > 1 else 3)
    labels = torch.randint(0, c["v"], (b, t_len), generator=g)
    old = -torch.rand(b, t_len, generator=g, dtype=torch.float64) * 3 - 1
    adv = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    ref_lp = -torch.rand(b, t_len, generator=g, dtype=torch.float64) * 3 - 1
    mask = torch.rand(b, t_len, generator=g) < 0.7
    norm = dict(dp_size=dp, batch_num_tokens=int(mask.sum()) + 3, global_batch_size=b + 1) if dp > 1 else {}
    temperature = c["t"] if c["t_kind"] != "one" else 1.0
    hidden = torch.randn(b, t_len, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(c["v"], 6, generator=g, dtype=torch.float64) * c["scale"] / 2.5
    options = dict(clip_ratio_low=clip[0], clip_ratio_high=clip[1], clip_ratio_c=clip[2])
    policy = PolicyLoss(options=options, entropy_coeff=entropy_coeff, kl_coef=kl[0], kl_kind=kl[1],
                        aggregation=Aggregation(mode)).for_batch(**norm)
    kw = dict(loss=policy, ref_log_probs=ref_lp, temperature=temperature)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if path == "head":
        loss, _ = linear_policy_loss(h, OutputLayer(w, softcap=c["softcap"]), labels, old, adv, mask,
                                     chunking=Chunking(c["chunk"], c["vocab_chunk"], c["backend"]), **kw)
    else:
        loss, _ = policy_loss_from_logits(h @ w.t(), labels, old, adv, mask, layer=OutputLayer(softcap=c["softcap"]),
                                          chunking=Chunking(c["chunk"], backend=c["backend"]), **kw)
    loss.backward()
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = reference(h64 @ w64.t(), labels, temperature=temperature, softcap=c["softcap"])
    pg, _ = losses.policy_loss(lp, old, adv, mask, PolicyLoss(options=options, aggregation=mode).for_batch(**norm))
    agg = dict(mode=mode, **norm)
    want = pg - entropy_coeff * losses.agg_loss(ent, mask, **agg)
    want = want + kl[0] * losses.agg_loss(losses.kl_penalty(lp, ref_lp, kl[1]), mask, **agg)
    if want.requires_grad:
        want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-9, atol=1e-10)
    for ours, theirs in ((h.grad, h64.grad), (w.grad, w64.grad)):
        if theirs is None:  # nothing selected: no gradient at all on the composition's side
            assert ours is None or (ours == 0).all()
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-8, atol=1e-10)


# ------------------------------------------------------------ dense kept masks with whole rows (reliability round 4)


@FUZZ
@given(
    n=st.integers(1, 30), v=st.integers(2, 60), seed=st.integers(0, 2**31 - 1), chunk=st.integers(1, 16),
    kinds=st.lists(st.sampled_from(["whole", "empty", "one", "some", "all_but_one"]), min_size=1, max_size=5),
    entropy_of=st.sampled_from(["full", "kept"]), path=st.sampled_from(["logits", "head"]),
    offset=st.sampled_from([0.0, 300.0]), t=st.sampled_from([1.0, 0.3]),
)
def test_dense_kept_masks_with_whole_rows(n, v, seed, chunk, kinds, entropy_of, path, offset, t):
    """A row of the mask that holds the whole vocabulary means "not truncated" (an empty kept set); the
    other rows are their True ids and the label. Values and gradients against float64 of the definition."""
    from tests.test_replay import reference as replay_reference

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g, dtype=torch.float64) * 3 + offset
    labels = torch.randint(0, v, (n,), generator=g)
    mask = torch.zeros(n, v, dtype=torch.bool)
    sets = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "whole":
            mask[i] = True
        elif kind == "one":
            mask[i, int(torch.randint(0, v, (), generator=g))] = True
        elif kind == "some":
            mask[i] = torch.rand(v, generator=g) < 0.3
        elif kind == "all_but_one":
            mask[i] = True
            mask[i, int(torch.randint(0, v, (), generator=g))] = False
        sets.append([] if kind == "whole" else mask[i].nonzero().squeeze(1).tolist())
    ups = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2)]
    snapshot = mask.clone()
    if path == "logits":
        x = z.clone().requires_grad_()
        out = log_probs_and_entropy(x, labels, keep=mask, chunking=chunk, temperature=t, entropy_of=entropy_of)
        leaves, zr = [x], z.clone().requires_grad_()
        ref_leaves, logits64 = [zr], zr
    else:  # the head: logits z = hidden @ weight.T with hidden = I (each row picks its own logits)
        eye = torch.eye(n, dtype=torch.float64)
        h, w = eye.clone().requires_grad_(), z.t().contiguous().clone().requires_grad_()
        out = linear_log_probs_and_entropy(h, w, labels, keep=mask,
                                           chunking=Chunking(chunk, vocab_chunk_size=max(1, v // 3)), temperature=t,
                                           entropy_of=entropy_of)
        leaves = [h, w]
        hr, wr = eye.clone().requires_grad_(), z.t().contiguous().clone().requires_grad_()
        ref_leaves, logits64 = [hr, wr], hr @ wr.t()
    lp, ent, _ = replay_reference(logits64, labels, sets, temperature=t, entropy_of=entropy_of)
    torch.testing.assert_close(out.log_probs, lp.detach(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.entropy, ent.detach(), rtol=1e-9, atol=1e-9)
    ((out.log_probs * ups[0]).sum() + (out.entropy * ups[1]).sum()).backward()
    ((lp * ups[0]).sum() + (ent * ups[1]).sum()).backward()
    for ours, theirs in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-8, atol=1e-9)
    assert torch.equal(mask, snapshot)  # never written
