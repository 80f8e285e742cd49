"""Properties over every entry point: precision per model, identities, zero tokens, memory, compiled kernels.

- each model's dtype (float32, bf16, fp16) crossed with ``logits_dtype``: the divergence of both heads
  against float64 of the logits each model's own layer makes (its weight's dtype, or float32 when
  asked); a bf16 teacher beside a float32 student gets float32 logits with ``logits_dtype=float32``;
- a teacher equal to the student: exactly 0 and an exactly zero gradient for every divergence, a grid of
  ``beta``, every entry point, and at tensor-parallel size 3;
- zero tokens in every dtype and weight scale: an exact 0, finite zero gradients (fp16 weights whose sum
  overflows included);
- the forward's peak memory of each op over given logits: its chunk buffers, plus one ``[T, V]``
  gradient where the forward forms it (nothing of ``[T, V]`` else: the teacher's NaN check included);
- the compiled kernels against eager in half precision, for every option: held to eager's error.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import (
    Chunking,
    Divergence,
    OutputLayer,
    PolicyLoss,
    divergence_from_logits,
    linear_divergence,
    linear_divergence_loss,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    policy_loss_from_logits,
)
from chunked_entropy.testing import GpuLog
from tests.helpers import run_distributed

HALF = (torch.bfloat16, torch.float16)
KINDS = [("forward_kl", None), ("reverse_kl", None)] + [("jsd", b) for b in (0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99)]


def _divergence64(zs, zt, kind, beta):
    """The per-token divergence from its definition, float64."""
    lps, lpt = torch.log_softmax(zs.double(), -1), torch.log_softmax(zt.double(), -1)
    ps, pt = lps.exp(), lpt.exp()
    if kind == "forward_kl":
        return (pt * (lpt - lps)).sum(-1)
    if kind == "reverse_kl":
        return (ps * (lps - lpt)).sum(-1)
    log_m = torch.logaddexp(lps + math.log1p(-beta), lpt + math.log(beta))
    return beta * (pt * (lpt - log_m)).sum(-1) + (1 - beta) * (ps * (lps - log_m)).sum(-1)


def _own_layer(h, w, float32_logits: bool):
    """The logits a model's own layer makes, as float64: in its dtype (rounded there), or in float32."""
    if float32_logits or h.dtype == torch.float32:
        return h.double() @ w.double().t()  # float32 blocks: within float32 rounding of the exact product
    return (h @ w.t()).double()


# ----------------------------------------------------------------------------- each model's logits dtype


def _heads(s_dtype, t_dtype, seed=0):
    """A student and a teacher whose logits sit near 300 (where bf16 rounds to 2, fp16 to 0.25)."""
    g = torch.Generator().manual_seed(seed)
    n, hs, ht, v = 12, 8, 10, 33
    h_s, w_s = torch.randn(n, hs, generator=g), torch.randn(v, hs, generator=g) * 0.5
    h_t, w_t = torch.randn(n, ht, generator=g), torch.randn(v, ht, generator=g) * 0.5
    h_s[:, 0], h_t[:, 0] = 20.0, 30.0
    w_s[:, 0], w_t[:, 0] = 10.0 + torch.rand(v, generator=g) * 0.3, 10.0 + torch.rand(v, generator=g) * 0.3
    return h_s.to(s_dtype), w_s.to(s_dtype), h_t.to(t_dtype), w_t.to(t_dtype)


@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["own", "float32"])
@pytest.mark.parametrize("t_dtype", [torch.float32, *HALF], ids=["t32", "tbf16", "tf16"])
@pytest.mark.parametrize("s_dtype", [torch.float32, *HALF], ids=["s32", "sbf16", "sf16"])
def test_each_model_gets_the_logits_dtype_it_asked_for(s_dtype, t_dtype, logits_dtype):
    h_s, w_s, h_t, w_t = _heads(s_dtype, t_dtype)
    f32 = logits_dtype is not None
    zs, zt = _own_layer(h_s, w_s, f32), _own_layer(h_t, w_t, f32)
    for kind, beta in (("forward_kl", None), ("reverse_kl", None), ("jsd", 0.3)):
        want = _divergence64(zs, zt, kind, beta)
        kw = dict(divergence=Divergence(kind, beta), chunking=5)
        student, teacher = OutputLayer(w_s, logits_dtype=logits_dtype), OutputLayer(w_t, logits_dtype=logits_dtype)
        got = linear_divergence(h_s, student, h_t, teacher, **kw).divergence
        loss = linear_divergence_loss(h_s, student, h_t, teacher, reduction="sum", **kw).loss
        # float32 statistics of logits near 300: a few ulps of 300 (3e-5) per token
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-4, msg=kind)
        torch.testing.assert_close(loss.double(), want.sum(), rtol=1e-4, atol=2e-3, msg=kind)
        if f32 and t_dtype in HALF:  # the case discriminates: the teacher rounded to its dtype is far off
            rounded = _divergence64(zs, _own_layer(h_t, w_t, False), kind, beta)
            assert (rounded - want).abs().max().item() > 20 * 2e-4, kind


def test_a_float32_student_beside_a_bf16_teacher_through_the_trl_adapter():
    """TRL projects both models to float32: so does the adapter, for a bf16 teacher beside a float32 student."""
    from chunked_entropy.integrations.trl import chunked_divergence_loss

    h_s, w_s, h_t, w_t = _heads(torch.float32, torch.bfloat16)
    mask = torch.ones(1, h_s.shape[0], dtype=torch.int64)
    want = _divergence64(_own_layer(h_s, w_s, True), _own_layer(h_t, w_t, True), "forward_kl", None).mean()
    loss, _, _ = chunked_divergence_loss(h_s.unsqueeze(0), h_t.unsqueeze(0), w_s, w_t, mask, beta=0.0)
    torch.testing.assert_close(loss.double(), want, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("logits_dtype", [None, torch.float32], ids=["own", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["f32", "bf16", "f16"])
def test_one_head_ops_get_the_logits_dtype_they_asked_for(dtype, logits_dtype):
    h, w, _, _ = _heads(dtype, dtype)
    labels = torch.arange(h.shape[0]) % w.shape[0]
    z = _own_layer(h, w, logits_dtype is not None)
    lp64 = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    out = linear_log_probs_and_entropy(h, OutputLayer(w, logits_dtype=logits_dtype), labels, chunking=5)
    torch.testing.assert_close(out.log_probs.double(), lp64, rtol=1e-4, atol=2e-4)
    loss, _ = linear_policy_loss(h.unsqueeze(0), OutputLayer(w, logits_dtype=logits_dtype), labels.unsqueeze(0),
                                 lp64.float().unsqueeze(0), torch.ones(1, h.shape[0]), torch.ones(1, h.shape[0]),
                                 loss=PolicyLoss(aggregation="token-sum"), chunking=5)
    assert abs(loss.item() + h.shape[0]) < 1e-3  # ratio 1 everywhere: -sum(advantage * 1)


# ----------------------------------------------------------------------------- teacher == student


def _same_model_calls(h, w, t, *, labels=None, group=None, sp=None, kinds=KINDS):
    """Every entry point with the teacher equal to the student: ``(name, divergence, loss, grads)``."""
    out = []
    for kind, beta in kinds:
        kw = dict(divergence=Divergence(kind, beta), temperature=t)
        tf = dict(softcap=sp, process_group=group)
        hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
        ht, wt = h.clone().requires_grad_(), w.clone().requires_grad_()  # a teacher that requires grad
        r = linear_divergence(hs, OutputLayer(ws, **tf), ht, OutputLayer(wt, **tf), labels=labels,
                              chunking=Chunking(4, vocab_chunk_size=7), **kw)
        grads = torch.autograd.grad((r.divergence * torch.linspace(-1, 2, r.divergence.numel()).view_as(
            r.divergence)).sum(), (hs, ws))
        out.append((f"linear_divergence {kind} {beta}", r.divergence, None, grads))
        hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
        r = linear_divergence_loss(hs, OutputLayer(ws, **tf), ht, OutputLayer(wt, **tf), chunking=4,
                                   compute_entropy=True, **kw)
        grads = torch.autograd.grad(r.loss, (hs, ws))
        out.append((f"linear_divergence_loss {kind} {beta}", r.divergence, r.loss, grads))
        z = (h.float() @ w.float().t()).to(h.dtype).requires_grad_()
        r = divergence_from_logits(z, z.detach().clone(), labels=labels, student_layer=OutputLayer(**tf),
                                   teacher_layer=OutputLayer(**tf), chunking=4, **kw)
        grads = torch.autograd.grad((r.divergence * 1.5).sum(), (z,))
        out.append((f"divergence_from_logits {kind} {beta}", r.divergence, None, grads))
    return out


def _assert_exact_zero(results):
    for name, div, loss, grads in results:
        assert torch.equal(div, torch.zeros_like(div)), (name, div.abs().max().item())
        assert loss is None or loss.item() == 0.0, (name, loss.item())
        for g in grads:
            assert torch.equal(g, torch.zeros_like(g)), (name, g.abs().max().item())


@pytest.mark.parametrize("dtype,softcap", [(torch.float32, None), (torch.bfloat16, 20.0)], ids=["f32", "bf16-softcap"])
def test_a_teacher_equal_to_the_student_gives_exactly_zero_everywhere(dtype, softcap):
    g = torch.Generator().manual_seed(3)
    h, w = (torch.randn(2, 5, 6, generator=g) * 2).to(dtype), (torch.randn(19, 6, generator=g) * 2).to(dtype)
    t = torch.rand(2, 5, generator=g) + 0.3
    _assert_exact_zero(_same_model_calls(h, w, t, labels=torch.randint(0, 19, (2, 5), generator=g), sp=softcap))


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_the_jsd_keeps_float32_accuracy_at_every_beta(scale):
    """The identity's exactness costs no accuracy elsewhere: relative to float64 within a few float32 ulps,
    also where beta or 1 - beta is 1e-3 (a log1p(beta * expm1(d)) form loses 50x there)."""
    g = torch.Generator().manual_seed(8)
    zs, zt = torch.randn(64, 500, generator=g) * scale, torch.randn(64, 500, generator=g) * scale
    for kind, beta in KINDS + [("jsd", 1e-3), ("jsd", 1 - 1e-3)]:
        d = divergence_from_logits(zs, zt, divergence=Divergence(kind, beta=beta)).divergence.double()
        want = _divergence64(zs, zt, kind, beta)
        assert ((d - want).abs() / want.abs()).max().item() < 1e-6, (kind, beta)


def _same_model_tp(rank, world):
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(2, 5, 6, generator=g) * 2, torch.randn(7 * world, 6, generator=g) * 2
    t = torch.rand(2, 5, generator=g) + 0.3
    shard = w[rank * 7:(rank + 1) * 7].clone()
    _assert_exact_zero(_same_model_calls(h, shard, t, labels=torch.randint(0, 7 * world, (2, 5), generator=g),
                                         group=dist.group.WORLD, kinds=KINDS[:3] + KINDS[-2:]))


def test_a_teacher_equal_to_the_student_gives_exactly_zero_at_tensor_parallel_size_3():
    """Three ranks: an all-reduce's order of addition may differ between two tensors; the heads' sums must not."""
    run_distributed(_same_model_tp, 3, timeout_s=60)


# ----------------------------------------------------------------------------- zero tokens


def _zero_token_calls(dtype, scale):
    """Every entry point with zero tokens (and the TRL adapter with an all-zero completion mask)."""
    from chunked_entropy.integrations.trl import chunked_divergence_loss

    h = torch.zeros(1, 0, 4, dtype=dtype)
    w = torch.full((300, 4), scale, dtype=dtype)
    labels = torch.zeros(1, 0, dtype=torch.int64)
    z = torch.zeros(1, 0, 300, dtype=dtype)
    e = torch.zeros(1, 0)
    leaves = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    yield "log_probs_and_entropy", leaves(z), lambda x: log_probs_and_entropy(x, labels, chunking=4).log_probs
    yield "linear_log_probs_and_entropy", leaves(h, w), lambda a, b: linear_log_probs_and_entropy(a, b, labels,
                                                                                                  chunking=4).log_probs
    yield "policy_loss_from_logits", leaves(z), lambda x: policy_loss_from_logits(x, labels, e, e, e)[0]
    yield "linear_policy_loss", leaves(h, w, w[:, 0]), lambda a, b, c: linear_policy_loss(a, OutputLayer(b, c), labels,
                                                                                          e, e, e)[0]
    yield "linear_divergence", leaves(h, w), lambda a, b: linear_divergence(a, b, h, w).divergence
    yield "linear_divergence_loss", leaves(h, w, w[:, 0]), lambda a, b, c: linear_divergence_loss(
        a, OutputLayer(b, c), h, w, weights=torch.ones(1, 0), normalizer=torch.tensor(3.0)).loss
    yield "divergence_from_logits", leaves(z), lambda x: divergence_from_logits(x, z).divergence
    # TRL's micro-batch whose completion mask is all zero: TRL's own path returns 0
    hidden = torch.ones(1, 3, 4, dtype=dtype)
    yield "trl chunked_divergence_loss", leaves(hidden, w), lambda a, b: chunked_divergence_loss(
        a, hidden, b, w, torch.zeros(1, 3, dtype=torch.int64), beta=0.5)[0]


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1.0), (torch.float32, 1e36), (torch.bfloat16, 1.0),
                                         (torch.bfloat16, 1e36), (torch.float16, 1.0), (torch.float16, 60.0)])
def test_zero_tokens_give_an_exact_zero_and_zero_gradients(dtype, scale):
    if scale != 1.0:  # the adversarial case: the weight's own sum overflows (x.sum() * 0 would be NaN)
        assert torch.isinf(torch.full((300, 4), scale, dtype=dtype).sum())
    for name, leaves, fn in _zero_token_calls(dtype, scale):
        out = fn(*leaves)
        assert torch.equal(out.detach(), torch.zeros_like(out)), (name, out)
        out.sum().backward()
        for x in leaves:
            assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x)), name


# ----------------------------------------------------------------------------- peak memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_forward_of_each_op_over_logits_holds_chunk_buffers_and_at_most_one_gradient(dtype):
    n, v, chunk = 256, 1024, 16
    g = torch.Generator().manual_seed(5)
    s, t = (torch.randn(n, v, generator=g) * 3).to(dtype), (torch.randn(n, v, generator=g) * 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    e = torch.zeros(1, n)
    block, row = chunk * v * 4, 256  # a float32 [chunk, V] block; per token: a few float32 and ids
    ops = {
        "log_probs_and_entropy": (lambda x: log_probs_and_entropy(x, labels, chunking=chunk,
                                                                  compute_sum_pi_squared=True), False),
        "divergence_from_logits": (lambda x: divergence_from_logits(x, t, labels=labels,
                                                                    divergence=Divergence("jsd", beta=0.3),
                                                                    chunking=chunk, compute_entropy=True), False),
        "policy_loss_from_logits": (lambda x: policy_loss_from_logits(x.unsqueeze(0), labels.unsqueeze(0), e, e, e + 1,
                                                                      chunking=chunk), True),
    }
    for name, (fn, grad_in_forward) in ops.items():
        x = s.clone().requires_grad_()
        with GpuLog() as log:
            fn(x)
        bound = 9 * block + n * row + (n * v * x.element_size() if grad_in_forward else 0)
        assert log.peak_bytes() <= bound, (name, log.peak_bytes() / (n * v * 4), bound / (n * v * 4))


# ----------------------------------------------------------------------------- compiled against eager


def _compiled_case(seed):
    g = torch.Generator().manual_seed(seed)
    n, v = 12, 257
    z = torch.randn(n, v, generator=g) * 3
    labels = torch.randint(0, v, (n,), generator=g)
    ids = torch.randint(0, v, (n, 3), generator=g)
    keep = torch.rand(n, v, generator=g) < 0.3
    ups = [torch.randn(n, generator=g) for _ in range(3)] + [torch.randn(n, 3, generator=g)]
    return z, labels, ids, keep, ups, torch.rand(n, generator=g) + 0.5


OPTIONS = {
    "log_probs_at": lambda c: dict(log_probs_at=c[2]),
    "top_k": lambda c: dict(top_k=3),
    "keep": lambda c: dict(keep=c[3], entropy_of="kept"),
    "softcap_temperature": lambda c: dict(layer=OutputLayer(softcap=4.0, logit_scale=1.3), temperature=c[5],
                                          compute_sum_pi_squared=True),
}


def _grad_of(z, labels, ups, backend, dtype, **kw):
    x = z.detach().to(dtype).clone().requires_grad_()
    out = log_probs_and_entropy(x, labels, chunking=Chunking(5, backend=backend), **kw)
    terms = [(out.log_probs * ups[0]).sum(), (out.entropy * ups[1]).sum()]
    if out.sum_pi_squared is not None:
        terms.append((out.sum_pi_squared * ups[2]).sum())
    for extra in (out.log_probs_at, out.top_k_log_probs):
        if extra is not None:
            terms.append((extra * ups[3]).sum())
    sum(terms).backward()
    return x.grad.double()


def test_the_compiled_kernels_are_as_exact_as_eager_in_half_precision():
    """bf16 (fp16 takes the same code path: compiling its kernels too would cost seconds more)."""
    dtype = torch.bfloat16
    z, labels, ids, keep, ups, t = c = _compiled_case(6)
    z = z.to(dtype).double()  # the half-precision values, exactly
    for name, opt in OPTIONS.items():
        exact = _grad_of(z, labels, ups, "eager", torch.float64, **opt(c))
        eager = _grad_of(z, labels, ups, "eager", dtype, **opt(c))
        compiled = _grad_of(z, labels, ups, "compile", dtype, **opt(c))
        err_eager, err_compiled = ((g - exact).abs().max().item() for g in (eager, compiled))
        assert err_compiled <= err_eager * 1.01 + 1e-7, (name, err_compiled, err_eager)
    # the fused loss over logits, with kept sets (its gradient formed in forward)
    old, adv = -torch.rand(1, z.shape[0], generator=torch.Generator().manual_seed(7)) - 1, ups[0].unsqueeze(0)

    def loss_grad(backend, kind):
        x = z.detach().to(kind).clone().requires_grad_()
        loss, _ = policy_loss_from_logits(x.unsqueeze(0), labels.unsqueeze(0), old, adv, torch.ones(1, z.shape[0]),
                                          keep=keep.unsqueeze(0), loss=PolicyLoss(entropy_coeff=0.1),
                                          chunking=Chunking(5, backend=backend))
        loss.backward()
        return x.grad.double()

    exact = loss_grad("eager", torch.float64)
    err_eager, err_compiled = ((loss_grad(b, dtype) - exact).abs().max().item() for b in ("eager", "compile"))
    assert err_compiled <= err_eager * 1.01 + 1e-7, ("policy_loss_from_logits keep", err_compiled, err_eager)
