"""Precision that follows the answer, logit transforms, sum_pi_squared, and infinities.

Every check is against float64 (``tests.helpers.reference``), values and
gradients, with random upstream gradients on every output; both paths (given
logits and the fused head) and vocabulary blocks run the same cases.
"""

from __future__ import annotations

import math

import pytest
import torch

from chunked_entropy import Chunking, OutputLayer, linear_log_probs_and_entropy, log_probs_and_entropy
from tests.helpers import reference


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _confident(n=300, v=800, seed=0, offset=0.0, t=1.0):
    """``randn * 2`` logits with one logit +25 per row (entropies 1e-6..1e-5), scaled by ``t``, plus ``offset``."""
    g = _gen(seed)
    z = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    z[torch.arange(n), torch.randint(0, v, (n,), generator=g)] += 25
    return (z * t + offset).float(), torch.randint(0, v, (n,), generator=g)


def _rel_err(x, ref):
    return ((x.double() - ref).abs() / ref.abs()).median().item()


@pytest.mark.parametrize("t", [1.0, 0.05])
@pytest.mark.parametrize("offset", [0.0, 30.0, 1e3, 1e4])
def test_confident_rows_entropy_no_worse_than_float32_torch(offset, t):
    z, labels = _confident(offset=offset, t=t)
    lp_ref, h_ref = reference(z.double(), labels, temperature=t)
    lp, h = log_probs_and_entropy(z, labels, temperature=t, chunking=77)
    logp = torch.log_softmax(z / t, -1)  # plain float32 torch, the bar to clear
    h_torch = -(logp.exp() * logp).sum(-1)
    assert (h > 0).all(), "a confident row's entropy was returned as 0"
    assert _rel_err(h, h_ref) <= _rel_err(h_torch, h_ref)
    assert _rel_err(h, h_ref) < 1e-6  # float32 rounding of the entropy itself
    # the log-prob's error follows its own size, not the offset
    err = (lp.double() - lp_ref).abs() / (1 + lp_ref.abs())
    assert err.max() < 4e-7


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e4])
def test_log_prob_and_gradient_error_do_not_depend_on_the_offset(offset):
    g = _gen(3)
    z = (torch.randn(40, 300, generator=g, dtype=torch.float64) * 2 + offset).float()
    labels = torch.randint(0, 300, (40,), generator=g)
    g_lp, g_h = torch.randn(40, generator=g), torch.randn(40, generator=g)
    x = z.clone().requires_grad_()
    lp, h = log_probs_and_entropy(x, labels, temperature=0.7, chunking=16)
    ((lp * g_lp).sum() + (h * g_h).sum()).backward()
    xr = z.double().requires_grad_()
    lp_r, h_r = reference(xr, labels, temperature=0.7)
    ((lp_r * g_lp.double()).sum() + (h_r * g_h.double()).sum()).backward()
    # the same tolerance at every offset: the inputs are exact, only our arithmetic rounds
    torch.testing.assert_close(lp.double(), lp_r.detach(), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(h.double(), h_r.detach(), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)


def test_fused_head_confident_rows_at_a_large_bias():
    """The head path: a bias of 1e4 is a logit offset; outputs and all gradients stay exact.

    At 1e4 float32 logits are themselves rounded (to 1e-3), so the float64
    reference starts from the float32 logits torch computes, and chains the
    float64 logit gradient through the matmul.
    """
    g = _gen(5)
    hidden = torch.randn(64, 16, generator=g)
    weight = torch.randn(200, 16, generator=g) * 3
    bias = torch.full((200,), 1e4) + torch.randn(200, generator=g)
    labels = torch.randint(0, 200, (64,), generator=g)
    g_lp, g_h = torch.randn(64, generator=g), torch.randn(64, generator=g)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    lp, h = linear_log_probs_and_entropy(leaves[0], OutputLayer(leaves[1], leaves[2]), labels,
                                         chunking=Chunking(24, vocab_chunk_size=64), temperature=0.5)
    ((lp * g_lp).sum() + (h * g_h).sum()).backward()
    z = (hidden @ weight.T + bias).double().requires_grad_()
    lp_r, h_r = reference(z, labels, temperature=0.5)
    ((lp_r * g_lp.double()).sum() + (h_r * g_h.double()).sum()).backward()
    gz = z.grad
    refs = (gz @ weight.double(), gz.T @ hidden.double(), gz.sum(0))
    torch.testing.assert_close(lp.double(), lp_r.detach(), rtol=1e-5, atol=1e-5)
    assert _rel_err(h[h_r > 1e-7], h_r.detach()[h_r > 1e-7]) < 1e-4
    for ours, ref in zip(leaves, refs, strict=True):
        torch.testing.assert_close(ours.grad.double(), ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- transforms

TRANSFORMS = [
    dict(softcap=30.0),  # Gemma 2
    dict(softcap=5.0, logit_scale=0.25),  # a cap that bites, after a scale
    dict(logit_scale=0.0625),  # Cohere
    dict(logit_scale=1 / 8.0),  # Granite, logits_scaling = 8
]


def _run_logits(z, labels, ups, **kw):
    x = z.clone().requires_grad_()
    out = log_probs_and_entropy(x, labels, **kw)
    outs = (out.log_probs, out.entropy, out.sum_pi_squared)
    sum(((o * u).sum() for o, u in zip(outs, ups, strict=True) if o is not None), torch.zeros(())).backward()
    return outs, x.grad


def _run_ref(z, labels, ups, **kw):
    x = z.double().requires_grad_()
    outs = reference(x, labels, sum_pi_squared=True, **kw)
    sum((o * u.double()).sum() for o, u in zip(outs, ups, strict=True)).backward()
    return [o.detach() for o in outs], x.grad


@pytest.mark.parametrize("tf", TRANSFORMS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("temperature", [1.0, "per_token"])
def test_transforms_values_and_gradients_logits_path(tf, temperature):
    g = _gen(7)
    z = torch.randn(5, 9, 70, generator=g) * 20  # large enough that the cap bites
    labels = torch.randint(0, 70, (5, 9), generator=g)
    t = torch.rand(5, 9, generator=g) + 0.3 if temperature == "per_token" else temperature
    ups = [torch.randn(5, 9, generator=g) for _ in range(3)]
    (lp, h, s2), grad = _run_logits(z, labels, ups, layer=OutputLayer(**tf), chunking=8, temperature=t,
                                    compute_sum_pi_squared=True)
    (lp_r, h_r, s2_r), grad_r = _run_ref(z, labels, ups, temperature=t, **tf)
    for ours, ref in ((lp, lp_r), (h, h_r), (s2, s2_r)):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), grad_r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tf", TRANSFORMS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("vocab_chunk_size", [None, 17])
def test_transforms_values_and_gradients_fused_head(tf, vocab_chunk_size):
    g = _gen(8)
    hidden = torch.randn(2, 11, 12, generator=g)
    weight = torch.randn(60, 12, generator=g) * 4
    bias = torch.randn(60, generator=g)
    labels = torch.randint(0, 60, (2, 11), generator=g)
    t = torch.rand(2, 1, generator=g) + 0.5
    ups = [torch.randn(2, 11, generator=g) for _ in range(3)]
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    out = linear_log_probs_and_entropy(leaves[0], OutputLayer(leaves[1], leaves[2], **tf), labels,
                                       chunking=Chunking(5, vocab_chunk_size=vocab_chunk_size), temperature=t,
                                       compute_sum_pi_squared=True)
    outs = (out.log_probs, out.entropy, out.sum_pi_squared)
    sum((o * u).sum() for o, u in zip(outs, ups, strict=True)).backward()
    refs = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    outs_r = reference(refs[0] @ refs[1].T + refs[2], labels, temperature=t, sum_pi_squared=True, **tf)
    sum((o * u.double()).sum() for o, u in zip(outs_r, ups, strict=True)).backward()
    for ours, ref in zip(outs, outs_r, strict=True):
        torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for ours, ref in zip(leaves, refs, strict=True):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-4, atol=1e-4)


def test_softcap_gradcheck_float64():
    g = _gen(9)
    z = (torch.randn(3, 4, 13, generator=g, dtype=torch.float64) * 10).requires_grad_()
    labels = torch.randint(0, 13, (3, 4), generator=g)

    def f(x):
        out = log_probs_and_entropy(x, labels, layer=OutputLayer(softcap=7.0, logit_scale=0.5), chunking=5,
                                    temperature=0.8, compute_sum_pi_squared=True)
        return out.log_probs, out.entropy, out.sum_pi_squared

    assert torch.autograd.gradcheck(f, (z,))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, "30", True])
@pytest.mark.parametrize("name", ["softcap", "logit_scale"])
def test_transform_arguments_are_checked(name, bad):
    with pytest.raises(ValueError, match=name):
        log_probs_and_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), layer=OutputLayer(**{name: bad}))


# --------------------------------------------------------------- sum_pi_squared


def test_sum_pi_squared_only_and_unpacking_unchanged():
    g = _gen(11)
    z = torch.randn(6, 40, generator=g) * 3
    labels = torch.randint(0, 40, (6,), generator=g)
    out = log_probs_and_entropy(z, labels, compute_sum_pi_squared=True, compute_entropy=False)
    log_probs, entropy = out  # still a pair
    assert entropy is None and out.sum_pi_squared is not None
    p = torch.softmax(z.double(), -1)
    torch.testing.assert_close(out.sum_pi_squared.double(), (p * p).sum(-1), rtol=1e-6, atol=1e-7)
    assert log_probs_and_entropy(z, labels).sum_pi_squared is None
    # a gradient that reaches only sum_pi_squared
    x = z.clone().requires_grad_()
    log_probs_and_entropy(x, labels, compute_sum_pi_squared=True).sum_pi_squared.sum().backward()
    xr = z.double().requires_grad_()
    p = torch.softmax(xr, -1)
    (p * p).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------- infinities


def _torch_lp(z, labels):
    return torch.log_softmax(z.double(), -1).gather(-1, labels[..., None]).squeeze(-1)


def test_row_of_neg_inf_is_nan_like_torch():
    z = torch.tensor([[-math.inf, -math.inf], [0.5, -1.0]])
    labels = torch.tensor([0, 1])
    x = z.clone().requires_grad_()
    lp, h = log_probs_and_entropy(x, labels)
    assert torch.isnan(lp[0]) and torch.isnan(h[0])  # torch.log_softmax gives NaN too
    assert torch.isnan(_torch_lp(z, labels)[0])
    torch.testing.assert_close(lp[1].double(), _torch_lp(z, labels)[1])
    (lp[1] + h[1]).backward()
    assert torch.isfinite(x.grad[1]).all()


@pytest.mark.parametrize("path", ["logits", "head"])
def test_label_on_a_neg_inf_entry_has_log_prob_neg_inf(path):
    z = torch.tensor([[0.0, -math.inf, 1.0], [2.0, 0.0, -math.inf]])
    labels = torch.tensor([1, 0])
    if path == "logits":
        lp, h = log_probs_and_entropy(z, labels)
    else:  # the -inf comes from the bias, as vocabulary padding does
        lp, h = linear_log_probs_and_entropy(torch.eye(3)[:2],
                                             OutputLayer(torch.eye(3), torch.tensor([0.0, -math.inf, 0.0])), labels)
    assert lp[0] == -math.inf
    assert torch.isfinite(lp[1]) and torch.isfinite(h).all()


def test_logits_below_the_floor_are_not_changed():
    z = torch.tensor([[-1e31, -2e31], [-3e35, -1e35]])
    labels = torch.tensor([1, 0])
    lp, h = log_probs_and_entropy(z, labels)
    torch.testing.assert_close(lp.double(), _torch_lp(z, labels))
    assert lp[0].item() == pytest.approx(-1e31, rel=1e-6) and h.eq(0).all()


@pytest.mark.parametrize("dtype,t", [(torch.float32, 0.5), (torch.bfloat16, 0.9)])
def test_temperature_that_overflows_z_over_t_gives_the_finite_answer(dtype, t):
    big = torch.finfo(dtype).max
    z = torch.tensor([[big, big * 0.5, 0.0], [1.0, 2.0, 3.0]], dtype=dtype)
    labels = torch.tensor([0, 2])
    x = z.clone().requires_grad_()
    lp, h = log_probs_and_entropy(x, labels, temperature=t)
    assert torch.isfinite(lp).all() and torch.isfinite(h).all()
    ref_lp, ref_h = reference(z.double(), labels, temperature=t)
    torch.testing.assert_close(lp.double(), ref_lp)
    torch.testing.assert_close(h.double(), ref_h, atol=1e-6, rtol=1e-6)
    (lp.sum() + h.sum()).backward()
    assert torch.isfinite(x.grad).all()


# ------------------------------------------------------------ real vocabularies


def _torch_float32_entropy(z):
    logp = torch.log_softmax(z, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("v,n", [(152064, 48), (262144, 24)])
@pytest.mark.parametrize("offset", [0.0, 1e3, 3e4])
def test_entropy_at_real_vocabularies_no_worse_than_float32_torch(v, n, offset, backend):
    """The softmax-weighted offset sum over 150k-260k terms: accumulated as precisely as torch's own sum."""
    g = _gen(int(offset) + v)
    z = (torch.randn(n, v, generator=g, dtype=torch.float64) * 2 + offset).float()
    labels = torch.randint(0, v, (n,), generator=g)
    lp_ref, h_ref = reference(z.double(), labels)
    x = z.clone().requires_grad_()
    lp, h = log_probs_and_entropy(x, labels, chunking=Chunking(16, backend=backend))
    assert _rel_err(h, h_ref) <= _rel_err(_torch_float32_entropy(z), h_ref)
    if backend == "eager":  # torch's pairwise sum: the float32 rounding of the entropy itself
        assert _rel_err(h, h_ref) < 2e-7
    torch.testing.assert_close(lp.double(), lp_ref, rtol=2e-7, atol=2e-6)
    # the gradient (per element: no long accumulation) against float64, on a slice of rows
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    ((lp * g_lp).sum() + (h * g_h).sum()).backward()
    xr = z[:4].double().requires_grad_()
    lr, hr = reference(xr, labels[:4])
    ((lr * g_lp[:4].double()).sum() + (hr * g_h[:4].double()).sum()).backward()
    xt = z[:4].clone().requires_grad_()  # plain float32 torch, the bar to clear
    logp = torch.log_softmax(xt, -1)
    lt, ht = logp.gather(-1, labels[:4, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ((lt * g_lp[:4]).sum() + (ht * g_h[:4]).sum()).backward()
    err = lambda grad: (grad.double() - xr.grad).abs().max().item()  # noqa: E731
    assert err(x.grad[:4]) <= max(err(xt.grad), 1e-9)


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_fused_head_entropy_at_a_152k_vocabulary(offset, backend):
    g = _gen(7)
    n, hdim, v = 40, 16, 152064
    hidden = torch.randn(n, hdim, generator=g)
    weight = torch.randn(v, hdim, generator=g) * 0.5
    bias = torch.full((v,), offset) + torch.randn(v, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    z = torch.addmm(bias, hidden, weight.t())  # the float32 logits torch computes; the reference starts there
    lp_ref, h_ref = reference(z.double(), labels)
    lp, h = linear_log_probs_and_entropy(hidden, OutputLayer(weight, bias), labels,
                                         chunking=Chunking(16, backend=backend))
    assert _rel_err(h, h_ref) <= _rel_err(_torch_float32_entropy(z), h_ref)
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-6, atol=2e-5)
