"""The fused head against a float64 reference: values and gradients, memory structure, errors.

The reference computes the logits in float64 from float64 copies of hidden,
weight and bias, then log-softmax / gather / entropy (``tests.helpers.reference``);
autograd gives the reference gradients. Every check draws random upstream
gradients for both outputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from chunked_entropy import (
    ChunkedVocabParallelHead,
    Chunking,
    LogProbsEntropy,
    OutputLayer,
    linear_log_probs_and_entropy,
)
from tests.helpers import reference

F32 = dict(rtol=1e-5, atol=1e-5)


def _make(lead=(3, 5), h=16, v=50, *, bias=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, lead, generator=g)
    return hidden, weight, b, labels


def _upstream(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def _reference(hidden, weight, bias, labels, *, compute_entropy=True, seed=1, **kw):
    """float64 values and gradients (hidden, weight, bias) for random upstream gradients.

    For bf16/fp16 inputs the logits take the values of the model's own
    half-precision layer, ``F.linear`` (the bias added before its one
    rounding; the fused head computes the same per chunk), then everything is
    float64.
    """
    h, w, b = (
        None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in (hidden, weight, bias)
    )
    logits = h @ w.t() + (0 if b is None else b)
    if hidden.dtype in (torch.bfloat16, torch.float16):
        # the values of the model's own half-precision layer, with the exact float64 gradient path
        model = F.linear(hidden.detach(), weight.detach(), None if bias is None else bias.detach())
        logits = logits + (model.double() - logits).detach()
    lp, ent = reference(logits, labels, **kw)
    g_lp, g_h = _upstream(lp.shape, seed)
    loss = (lp * g_lp).sum() + ((ent * g_h).sum() if compute_entropy else 0)
    loss.backward()
    grads = (h.grad, w.grad, None if b is None else b.grad)
    return lp, ent, grads, (g_lp, g_h)


def _run(fn, hidden, weight, bias, labels, upstream, *, compute_entropy=True):
    out = fn()
    assert isinstance(out, LogProbsEntropy)
    g_lp, g_h = upstream
    loss = (out.log_probs * g_lp.to(out.log_probs.dtype)).sum()
    if compute_entropy:
        loss = loss + (out.entropy * g_h.to(out.entropy.dtype)).sum()
    loss.backward()
    return out, (hidden.grad, weight.grad, None if bias is None else bias.grad)


def _close(actual, expected, **tol):
    torch.testing.assert_close(actual.double(), expected, **tol)


def _check(hidden, weight, bias, labels, *, tol=F32, call_kw=None, ref_kw=None, compute_entropy=True):
    call_kw = dict(call_kw or {})  # the Chunking's fields
    ref_kw = dict(ref_kw or {})
    lp_ref, ent_ref, grads_ref, upstream = _reference(
        hidden, weight, bias, labels, compute_entropy=compute_entropy, **ref_kw
    )
    out, grads = _run(
        lambda: linear_log_probs_and_entropy(hidden, OutputLayer(weight, bias), labels, chunking=Chunking(**call_kw),
                                             compute_entropy=compute_entropy, **ref_kw),
        hidden, weight, bias, labels, upstream, compute_entropy=compute_entropy,
    )
    assert out.log_probs.shape == labels.shape
    _close(out.log_probs, lp_ref, **tol)
    if compute_entropy:
        _close(out.entropy, ent_ref, **tol)
    else:
        assert out.entropy is None
    for name, got, want in zip(("hidden", "weight", "bias"), grads, grads_ref, strict=True):
        if want is None:
            assert got is None
            continue
        assert got.dtype == (hidden if name == "hidden" else weight).dtype, name
        _close(got, want, **tol)
    # the compiled kernels, on the same inputs: the same tolerances against float64
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    out_c, grads_c = _run(
        lambda: linear_log_probs_and_entropy(hidden, OutputLayer(weight, bias), labels,
                                             chunking=Chunking(**call_kw, backend="compile"),
                                             compute_entropy=compute_entropy, **ref_kw),
        hidden, weight, bias, labels, upstream, compute_entropy=compute_entropy,
    )
    _close(out_c.log_probs, lp_ref, **tol)
    if compute_entropy:
        _close(out_c.entropy, ent_ref, **tol)
    for got, want in zip(grads_c, grads_ref, strict=True):
        if want is not None:
            _close(got, want, **tol)
    return out


# --------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    "chunk_size,vocab_chunk_size",
    [(1, None), (4, None), (14, None), (15, None), (16, 7), (1024, 1), (6, 50), (5, 49), (3, 64)],
)
def test_matches_float64(bias, chunk_size, vocab_chunk_size):
    # 15 tokens: chunk sizes 1, 14 (one-row tail), 15 (exact), 16 and 1024 (larger than N);
    # vocabulary blocks 7 and 49 that do not divide V=50, 1 column, exactly V, larger than V.
    hidden, weight, b, labels = _make(bias=bias)
    _check(hidden, weight, b, labels, call_kw=dict(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("vocab_chunk_size", [None, 16])
def test_temperature_scalar_and_per_sample(bias, vocab_chunk_size):
    hidden, weight, b, labels = _make(bias=bias, seed=2)
    kw = dict(chunk_size=4, vocab_chunk_size=vocab_chunk_size)
    _check(hidden, weight, b, labels, call_kw=kw, ref_kw=dict(temperature=0.7))
    for t in (hidden, weight, b):
        if t is not None:
            t.grad = None
    per_sample = torch.tensor([[0.5], [1.0], [2.3]], dtype=torch.float32)  # [B, 1] -> [B, T]
    before = per_sample.clone()
    _check(hidden, weight, b, labels, call_kw=kw, ref_kw=dict(temperature=per_sample))
    assert torch.equal(per_sample, before)


def test_masks_and_ignore_index():
    hidden, weight, b, labels = _make(seed=3)
    labels[0, 1] = -100
    labels[2, 4] = -100
    label_mask = torch.ones_like(labels, dtype=torch.bool)
    label_mask[1, :3] = False
    out = _check(
        hidden, weight, b, labels, call_kw=dict(chunk_size=4, vocab_chunk_size=9),
        ref_kw=dict(label_mask=label_mask),
    )
    masked = (labels == -100) | ~label_mask
    assert torch.all(out.log_probs[masked] == 0)
    assert torch.all(out.entropy[masked] > 0)  # the entropy is defined for every token


def test_masked_label_out_of_range_is_not_checked():
    hidden, weight, b, labels = _make(seed=4)
    labels[0, 0] = 10_000
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[0, 0] = False
    _check(hidden, weight, b, labels, call_kw=dict(chunk_size=4), ref_kw=dict(label_mask=mask))


@pytest.mark.parametrize("vocab_chunk_size", [None, 8])
def test_compute_entropy_false(vocab_chunk_size):
    hidden, weight, b, labels = _make(seed=5)
    _check(
        hidden, weight, b, labels, compute_entropy=False,
        call_kw=dict(chunk_size=4, vocab_chunk_size=vocab_chunk_size),
        ref_kw=dict(temperature=1.3),
    )


def test_only_entropy_receives_gradient():
    # The log-probs get no gradient at all (g_lp is None in backward): the
    # entropy's gradient alone must be exact.
    hidden, weight, b, labels = _make(seed=6)
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, b))
    _, ent = reference(h64 @ w64.t() + b64, labels, temperature=0.8)
    g = torch.randn(ent.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    (ent * g).sum().backward()
    out = linear_log_probs_and_entropy(hidden, OutputLayer(weight, b), labels, chunking=4, temperature=0.8)
    (out.entropy * g.float()).sum().backward()
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad), (b.grad, b64.grad)):
        _close(got, want, **F32)


def test_megatron_layout_and_non_contiguous_hidden():
    # hidden [S, B, H] as Megatron's decoder emits it, seen through a transpose
    # and a slice: neither view can be flattened without a copy.
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4, 7, 16, generator=g)  # [B, S+1, H]
    hidden_leaf = base.clone().requires_grad_()
    hidden = hidden_leaf[:, :-1].transpose(0, 1)  # [S, B, H], non-contiguous
    assert not hidden.is_contiguous()
    weight = (torch.randn(40, 16, generator=g) / 4).requires_grad_()
    labels = torch.randint(0, 40, (6, 4), generator=g)
    lp_ref, ent_ref, (gh_ref, gw_ref, _), (g_lp, g_h) = _reference(hidden, weight, None, labels)
    out = linear_log_probs_and_entropy(hidden, weight, labels, chunking=Chunking(5, vocab_chunk_size=11))
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _close(out.log_probs, lp_ref, **F32)
    _close(out.entropy, ent_ref, **F32)
    _close(hidden_leaf.grad[:, :-1].transpose(0, 1), gh_ref, **F32)
    assert torch.all(hidden_leaf.grad[:, -1] == 0)
    _close(weight.grad, gw_ref, **F32)


def test_no_grad_and_inputs_untouched():
    hidden, weight, b, labels = _make(seed=8)
    snapshot = [t.detach().clone() for t in (hidden, weight, b)]
    versions = [t._version for t in (hidden, weight, b)]
    lp_ref, ent_ref, _, _ = _reference(hidden, weight, b, labels)
    with torch.no_grad():
        out = linear_log_probs_and_entropy(hidden, OutputLayer(weight, b), labels,
                                           chunking=Chunking(4, vocab_chunk_size=13))
    assert not out.log_probs.requires_grad
    _close(out.log_probs, lp_ref, **F32)
    _close(out.entropy, ent_ref, **F32)
    out = linear_log_probs_and_entropy(hidden, OutputLayer(weight, b), labels, chunking=4)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    for t, s, ver in zip((hidden, weight, b), snapshot, versions, strict=True):
        assert torch.equal(t.detach(), s)
        assert t._version == ver


def test_zero_tokens():
    hidden, weight, b, _ = _make(lead=(0, 4), seed=22)
    out = linear_log_probs_and_entropy(hidden, OutputLayer(weight, b), torch.zeros(0, 4, dtype=torch.long))
    assert out.log_probs.shape == out.entropy.shape == (0, 4)
    (out.log_probs.sum() + out.entropy.sum()).backward()  # the graph stays connected
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and hidden.grad.shape == hidden.shape


def test_frozen_weight_only_hidden_gradient():
    hidden, weight, b, labels = _make(seed=10)
    weight.requires_grad_(False)
    b.requires_grad_(False)
    _check(hidden, weight, b, labels, call_kw=dict(chunk_size=4))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("vocab_chunk_size", [None, 24])
def test_bfloat16(bias, vocab_chunk_size):
    # Reference: the bf16 matmul's logits (what the model's own bf16 layer
    # produces, and what the fused head computes per chunk: the same K-reduction
    # per row), then float64. From equal bf16 logits on, everything is float32,
    # so the values are held to float32 tolerances. The gradients are float32
    # inside but meet bf16 operands (the logit gradient is rounded to bf16 for
    # the grad_hidden matmul) and are returned in bf16 (8 mantissa bits: 2**-8 =
    # 4e-3 relative per element): rtol=1e-2 with an absolute floor of 1% of the
    # gradient's largest entry (cancellation makes small entries relatively worse).
    hidden, weight, b, labels = _make(lead=(4, 8), h=32, v=64, bias=bias, dtype=torch.bfloat16, seed=11)
    lp_ref, ent_ref, grads_ref, (g_lp, g_h) = _reference(hidden, weight, b, labels, temperature=0.9, seed=12)
    out = linear_log_probs_and_entropy(hidden, OutputLayer(weight, b), labels,
                                       chunking=Chunking(5, vocab_chunk_size=vocab_chunk_size), temperature=0.9)
    assert out.log_probs.dtype == torch.float32
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _close(out.log_probs, lp_ref, **F32)
    _close(out.entropy, ent_ref, **F32)
    for got, want in zip((hidden.grad, weight.grad, None if b is None else b.grad), grads_ref, strict=True):
        if want is None:
            continue
        assert got.dtype == torch.bfloat16
        _close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_float64_gradcheck():
    hidden, weight, b, labels = _make(lead=(2, 3), h=5, v=9, dtype=torch.float64, seed=13)
    t = torch.tensor([[0.8], [1.7]], dtype=torch.float64)
    for vcs in (None, 4):
        fn = lambda h, w, bb, vcs=vcs: tuple(  # noqa: E731
            linear_log_probs_and_entropy(h, OutputLayer(w, bb), labels, chunking=Chunking(4, vocab_chunk_size=vcs),
                                         temperature=t)
        )
        assert torch.autograd.gradcheck(fn, (hidden, weight, b))


# --------------------------------------------------------------------------- the module


def test_head_module_matches_function_and_per_call_options():
    hidden, weight, b, labels = _make(seed=14)
    w, bb = nn.Parameter(weight.detach().clone()), nn.Parameter(b.detach().clone())
    head = ChunkedVocabParallelHead(OutputLayer(w, bb), Chunking(4, vocab_chunk_size=16))
    assert {id(p) for p in head.parameters()} == {id(w), id(bb)}
    mask = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    lp_ref, ent_ref, (gh, gw, gb), (g_lp, g_h) = _reference(hidden, w, bb, labels, temperature=1.4, label_mask=mask)
    out = head(hidden, labels, temperature=1.4, label_mask=mask)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _close(out.log_probs, lp_ref, **F32)
    _close(out.entropy, ent_ref, **F32)
    _close(hidden.grad, gh, **F32)
    _close(w.grad, gw, **F32)
    _close(bb.grad, gb, **F32)
    out = head(hidden.detach(), labels, compute_entropy=False)
    assert out.entropy is None
    assert "V_local=50" in repr(head)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_from_linear_shares_parameters(bias):
    torch.manual_seed(15)
    lin = nn.Linear(16, 50, bias=bias)
    head = ChunkedVocabParallelHead.from_linear(lin, chunking=3)
    assert head.weight is lin.weight
    assert head.bias is lin.bias
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 7))
    lp_ref, ent_ref, (gh, gw, gb), (g_lp, g_h) = _reference(hidden, lin.weight, lin.bias, labels)
    out = head(hidden, labels)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _close(out.log_probs, lp_ref, **F32)
    _close(out.entropy, ent_ref, **F32)
    _close(hidden.grad, gh, **F32)
    _close(lin.weight.grad, gw, **F32)  # the gradient lands on the Linear's own parameters
    if bias:
        _close(lin.bias.grad, gb, **F32)
    with torch.no_grad():  # a change to the Linear is seen by the head: shared, not copied
        lin.weight.mul_(2)
    lp2 = head(hidden.detach(), labels).log_probs
    assert not torch.allclose(lp2, out.log_probs.detach())
    with pytest.raises(TypeError, match="linear"):
        ChunkedVocabParallelHead.from_linear(nn.Conv1d(2, 2, 1))


def test_tied_embedding_gradients_add_up():
    # One weight used twice: as the input embedding and as the head.
    torch.manual_seed(16)
    v, h = 40, 12
    emb = nn.Embedding(v, h)
    mix = nn.Linear(h, h)
    ids = torch.randint(0, v, (3, 6))
    labels = torch.randint(0, v, (3, 6))
    head = ChunkedVocabParallelHead(emb.weight, Chunking(5, vocab_chunk_size=16))
    assert head.weight is emb.weight

    e64 = emb.weight.detach().double().requires_grad_()
    m_w, m_b = mix.weight.detach().double(), mix.bias.detach().double()
    hid64 = torch.tanh(e64[ids] @ m_w.t() + m_b)
    lp_ref, ent_ref = reference(hid64 @ e64.t(), labels)
    g_lp, g_h = _upstream(labels.shape, seed=17)
    ((lp_ref * g_lp).sum() + (ent_ref * g_h).sum()).backward()

    out = head(torch.tanh(mix(emb(ids))), labels)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    _close(out.log_probs, lp_ref, **F32)
    _close(emb.weight.grad, e64.grad, **F32)  # embedding use + head use, summed by autograd


# --------------------------------------------------------------------------- main_grad (gradient-accumulation fusion)


def _main_grad_weight(dtype, *, flag=None, zero_out=None, seed=18):
    hidden, weight, b, labels = _make(dtype=dtype, seed=seed, bias=False)
    w = nn.Parameter(weight.detach().clone())
    w.main_grad = torch.randn(w.shape, dtype=torch.float32, generator=torch.Generator().manual_seed(seed))
    if flag is not None:
        w.grad_added_to_main_grad = flag
    if zero_out is not None:
        w.zero_out_wgrad = zero_out
    return hidden, w, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_main_grad_accumulates_over_micro_batches(dtype):
    hidden, w, labels = _main_grad_weight(dtype, flag=False)
    start = w.main_grad.clone()
    main_grad_obj = w.main_grad
    expected = start.double()
    plain = start.double()  # plain autograd in the input dtype, its weight gradient added in float32
    for step in range(2):  # two micro-batches accumulate into the same buffer
        h = (hidden.detach() * (1 + step)).requires_grad_()
        _, _, (_, gw_ref, _), (g_lp, g_h) = _reference(h, w, None, labels)
        expected = expected + gw_ref
        out = linear_log_probs_and_entropy(h, w, labels, chunking=4)
        ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
        assert w.grad_added_to_main_grad is True
        w.grad_added_to_main_grad = False  # Megatron's DDP resets the flag after each reduction
        w_plain = w.detach().clone().requires_grad_()
        logp = torch.log_softmax((h.detach() @ w_plain.t()).float(), dim=-1)
        lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        ((lp * g_lp.float()).sum() + (ent * g_h.float()).sum()).backward()
        plain = plain + w_plain.grad.double()
    assert w.main_grad is main_grad_obj and w.main_grad.dtype == torch.float32
    if dtype == torch.float32:
        _close(w.main_grad, expected, **F32)
    else:  # bf16: the logit gradient rounded to bf16 as Megatron's own layer rounds it, summed in float32
        err, err_plain = ((w.main_grad.double() - expected).abs().max().item(),
                          (plain - expected).abs().max().item())
        assert err <= 2 * err_plain, (err, err_plain)
    # as in Megatron's linear layers without zero_out_wgrad: a dummy (uninitialised) grad
    assert w.grad is not None and w.grad.shape == w.shape and w.grad.dtype == dtype


def test_main_grad_in_bfloat16():
    # Megatron also accumulates into bf16/fp16 main_grad buffers: the sum over
    # the chunks stays float32 and is added once, so the result is the exact
    # sum rounded once to bf16 (plus the bf16 rounding of the addition).
    hidden, w, labels = _main_grad_weight(torch.bfloat16, flag=False)
    w.main_grad = w.main_grad.to(torch.bfloat16)
    start = w.main_grad.clone()
    _, _, (_, gw_ref, _), (g_lp, g_h) = _reference(hidden, w, None, labels)
    out = linear_log_probs_and_entropy(hidden, w, labels, chunking=4)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    assert w.main_grad.dtype == torch.bfloat16 and w.grad_added_to_main_grad is True
    expected = start.double() + gw_ref
    _close(w.main_grad, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_main_grad_zero_out_wgrad_and_without_flag():
    hidden, w, labels = _main_grad_weight(torch.float32, flag=False, zero_out=True)
    out = linear_log_probs_and_entropy(hidden, w, labels, chunking=4)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))  # zero_out_wgrad: a zero dummy gradient
    assert w.grad_added_to_main_grad is True

    hidden, w, labels = _main_grad_weight(torch.float32)  # no grad_added_to_main_grad attribute
    start = w.main_grad.clone()
    _, _, (_, gw_ref, _), (g_lp, g_h) = _reference(hidden, w, None, labels)
    out = linear_log_probs_and_entropy(hidden, w, labels, chunking=4)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    assert w.grad is None  # Megatron returns None for the weight: main_grad holds it
    _close(w.main_grad, start.double() + gw_ref, **F32)


def test_main_grad_fusion_off_and_errors():
    hidden, w, labels = _main_grad_weight(torch.float32, flag=False)
    start = w.main_grad.clone()
    _, _, (_, gw_ref, _), (g_lp, g_h) = _reference(hidden, w, None, labels)
    out = linear_log_probs_and_entropy(hidden, OutputLayer(w, gradient_accumulation_fusion=False), labels, chunking=4)
    ((out.log_probs * g_lp.float()).sum() + (out.entropy * g_h.float()).sum()).backward()
    assert torch.equal(w.main_grad, start)
    _close(w.grad, gw_ref, **F32)

    plain = nn.Parameter(torch.randn(50, 16))
    with pytest.raises(ValueError, match="main_grad"):
        linear_log_probs_and_entropy(hidden, OutputLayer(plain, gradient_accumulation_fusion=True), labels)


# --------------------------------------------------------------------------- memory structure


def _saved_tensors(fn):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_saved_for_backward_is_references_and_per_token(bias):
    hidden, weight, b, labels = _make(lead=(4, 16), h=8, v=96, bias=bias, seed=19)
    n = labels.numel()
    out, saved = _saved_tensors(
        lambda: linear_log_probs_and_entropy(hidden, OutputLayer(weight, b), labels, chunking=8)
    )
    inputs = [t for t in (hidden, weight, b) if t is not None]
    assert saved, "the head saved nothing: the hook saw no save_for_backward"
    for t in saved:
        if any(_same_storage(t, x) for x in inputs):
            continue  # a reference to an input, not a copy
        assert t.numel() <= n, f"saved a {tuple(t.shape)} tensor; only O(tokens) may be saved"
    is_ref = [any(_same_storage(t, x) for x in inputs) for t in saved]
    assert sum(is_ref) == len(inputs)
    per_token = [t for t, r in zip(saved, is_ref, strict=True) if not r]
    # the row max, log s and w / s: three float32 per token
    assert len(per_token) == 3 and sum(t.numel() for t in per_token) == 3 * n


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op produces (factories, views, results)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _fwd_bwd(fn, upstream):
    out = fn()
    loss = (out.log_probs * upstream[0].float()).sum() + (out.entropy * upstream[1].float()).sum()
    loss.backward()


@pytest.mark.parametrize("vocab_chunk_size", [None, 24])
def test_no_tokens_by_vocab_tensor_is_ever_allocated(vocab_chunk_size):
    n_tok, h, v, chunk = 64, 8, 96, 8  # N*V = 6144 >> N*H = 512, V*H = 768, chunk*V = 768
    hidden, weight, b, labels = _make(lead=(4, 16), h=h, v=v, seed=20)
    upstream = _upstream(labels.shape)
    bound = max(n_tok * h, v * h, chunk * (vocab_chunk_size or v))

    mode = _LargestAllocation()
    with mode:
        _fwd_bwd(
            lambda: linear_log_probs_and_entropy(hidden, OutputLayer(weight, b), labels,
                                                 chunking=Chunking(chunk, vocab_chunk_size=vocab_chunk_size)),
            upstream,
        )
    assert {"addmm", "addmm_"} <= mode.ops  # the blocks (biased: addmm, as F.linear) and the backward
    assert hidden.grad is not None and weight.grad is not None
    assert mode.largest <= bound < n_tok * v

    # The detector does fire on the unfused computation (plain matmul, then log_softmax).
    control = _LargestAllocation()
    with control:
        def plain():
            logp = torch.log_softmax(hidden @ weight.t() + b, dim=-1)
            lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            return LogProbsEntropy(lp, -(logp.exp() * logp).sum(-1))

        _fwd_bwd(plain, upstream)
    assert control.largest >= n_tok * v


# --------------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument():
    hidden, weight, b, labels = _make(seed=21)
    call = linear_log_probs_and_entropy
    with pytest.raises(ValueError, match="hidden"):
        call(hidden[..., :-1], weight, labels)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        call(hidden, weight[0], labels)
    with pytest.raises(TypeError, match="weight"):
        call(hidden, weight.detach().numpy(), labels)
    with pytest.raises(ValueError, match="bias"):
        call(hidden, OutputLayer(weight, b[:-1]), labels)
    with pytest.raises(ValueError, match="bias"):
        call(hidden, OutputLayer(weight, b.detach().unsqueeze(0)), labels)
    with pytest.raises(TypeError, match="hidden"):
        call(hidden.detach().double(), weight, labels)
    with pytest.raises(ValueError, match="labels"):
        call(hidden, weight, labels[:, :-1])
    bad = labels.clone()
    bad[1, 2] = 50
    with pytest.raises(ValueError, match=r"labels must be vocabulary ids in \[0, 50\)"):
        call(hidden, weight, bad)
    bad[1, 2] = -3
    with pytest.raises(ValueError, match="labels"):
        call(hidden, weight, bad)
    with pytest.raises(TypeError, match="labels"):
        call(hidden, weight, labels.float())
    with pytest.raises(ValueError, match="chunk_size"):
        call(hidden, weight, labels, chunking=0)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        call(hidden, weight, labels, chunking=Chunking(vocab_chunk_size=0))
    with pytest.raises(ValueError, match="temperature"):
        call(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="label_mask"):
        call(hidden, weight, labels, label_mask=torch.ones(3, dtype=torch.bool))
    # sequence parallelism: hidden [S/P, B, H] must match labels for the full [S, B]
    with pytest.raises(ValueError, match="sequence_parallel"):
        call(hidden, OutputLayer(weight, sequence_parallel=True), labels[:2])
    with pytest.raises(ValueError, match="sequence_parallel"):
        call(hidden[0, 0], OutputLayer(weight, sequence_parallel=True), labels[0, 0])
    # the module checks at construction
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ChunkedVocabParallelHead(weight[0])
    with pytest.raises(ValueError, match="bias"):
        ChunkedVocabParallelHead(OutputLayer(weight, b[:3]))
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedVocabParallelHead(weight, -1)
    # nothing was computed, nothing was written
    assert hidden.grad is None and weight.grad is None


def test_integer_main_grad_is_refused_before_any_work():
    hidden, weight, _, labels = _make(lead=(3,), h=4, v=9, bias=False, seed=3)
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.int32)
    with pytest.raises(TypeError, match="main_grad"):
        linear_log_probs_and_entropy(hidden, OutputLayer(weight, gradient_accumulation_fusion=True), labels)


@pytest.mark.parametrize("name,value", [("compute_entropy", "no"), ("sequence_parallel", 1)])
def test_flags_must_be_bools(name, value):
    hidden, weight, _, labels = _make(lead=(3,), h=4, v=9, bias=False, seed=3)
    with pytest.raises(TypeError, match=name):
        if name == "sequence_parallel":  # a field of the output layer
            linear_log_probs_and_entropy(hidden, OutputLayer(weight, **{name: value}), labels)
        else:
            linear_log_probs_and_entropy(hidden, weight, labels, **{name: value})


# ------------------------------------------------------------ bf16 heads: logits_dtype=torch.float32


def _bf16_case(n=48, h=64, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.9).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.9).bfloat16()  # logits of about 12 in size
    labels = torch.randint(0, v, (n,), generator=g)
    ups = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2)]
    return hidden, weight, labels, ups


def _errors(lp, ent, gh, gw, ref):
    r_lp, r_ent, r_gh, r_gw = ref
    return [float((a.double() - b).abs().max()) for a, b in ((lp, r_lp), (ent, r_ent), (gh, r_gh), (gw, r_gw))]


@pytest.mark.parametrize("backend", ["eager", "compile"])
@pytest.mark.parametrize("logit_scale,temperature", [(None, 1.0), (2.0, 0.7)])
def test_bf16_head_with_float32_logits_is_as_exact_as_plain_float32_torch(logit_scale, temperature, backend):
    """The same bf16 hidden states and weight: float64 of them is the reference; plain float32 PyTorch
    (widen, matmul, log_softmax; its gradients rounded to the parameters' bf16) is the bar. The default
    rounds each block's logits to bf16, as the model's own layer does, and is off by far more."""
    hidden, weight, labels, ups = _bf16_case()
    scale = 1.0 if logit_scale is None else logit_scale

    def run(dt, logits_dtype=None, vocab_chunk_size=None, **kw):
        h, w = hidden.to(dt).clone().requires_grad_(), weight.to(dt).clone().requires_grad_()
        if kw.pop("plain", False):
            logp = torch.log_softmax(h @ w.t() * scale / temperature, -1)
            lp = logp.gather(1, labels[:, None]).squeeze(1)
            ent = -(logp.exp() * logp).sum(-1)
        else:
            layer = OutputLayer(w, logit_scale=logit_scale, logits_dtype=logits_dtype)
            lp, ent = linear_log_probs_and_entropy(h, layer, labels, chunking=Chunking(16, vocab_chunk_size, backend),
                                                   temperature=temperature)
        ((lp.double() * ups[0]).sum() + (ent.double() * ups[1]).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    ref = [t.double() for t in run(torch.float64, plain=True)]
    lp, ent, gh, gw = run(torch.float32, plain=True)
    # a gradient comes back in its parameter's dtype: the bar for bf16 ones is plain float32's, rounded to bf16
    plain = _errors(lp, ent, gh.bfloat16(), gw.bfloat16(), ref)
    exact = _errors(*run(torch.bfloat16, logits_dtype=torch.float32), ref)
    blocked = _errors(*run(torch.bfloat16, logits_dtype=torch.float32, vocab_chunk_size=64), ref)
    rounded = _errors(*run(torch.bfloat16), ref)
    for name, ours, bar in zip(("log_probs", "entropy", "grad hidden", "grad weight"), exact, plain, strict=True):
        assert ours <= 2 * bar + 1e-6, (name, ours, bar)
    for ours, bar in zip(blocked, plain, strict=True):
        assert ours <= 2 * bar + 1e-6
    assert rounded[0] > 20 * exact[0]  # the default: the bf16 logits' rounding, as the model's layer rounds


def test_fused_loss_and_module_take_logits_dtype():
    hidden, weight, labels, _ = _bf16_case(n=24, v=120, seed=1)
    old, adv = torch.full((1, 24), -5.0), torch.randn(1, 24, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, 24, dtype=torch.bool)
    head = ChunkedVocabParallelHead(OutputLayer(weight, logits_dtype=torch.float32), 8)
    assert "logits_dtype=torch.float32" in repr(head)
    lp, _ = head(hidden, labels)
    want = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(1, labels[:, None]).squeeze(1)
    assert float((lp.double() - want).abs().max()) < 1e-4
    h = hidden[None].clone().requires_grad_()
    loss, _ = head.policy_loss(h, labels[None], old, adv, mask)
    loss.backward()
    h2 = hidden[None].clone().requires_grad_()
    lp2, _ = head(h2, labels[None])
    from chunked_entropy import losses
    ref, _ = losses.policy_loss(lp2, old, adv, mask)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.float(), h2.grad.float(), rtol=1e-2, atol=1e-3)  # both bf16 gradients
    for bad in (torch.float16, torch.float64, "float32"):
        with pytest.raises(ValueError, match="logits_dtype must be None"):
            linear_log_probs_and_entropy(hidden, OutputLayer(weight, logits_dtype=bad), labels)
    with pytest.raises(ValueError, match="logits_dtype"):
        ChunkedVocabParallelHead(OutputLayer(weight.float(), logits_dtype=torch.bfloat16))


def test_policy_loss_with_chunking_none_uses_the_heads_chunking():
    """``head.policy_loss(..., chunking=None)`` ran with the default chunking instead of the head's (found by the
    reliability pass). A head whose chunking asks for Triton's kernels on a CPU tensor (refused without Triton's
    interpreter) shows which one a call used."""
    hidden, weight, labels, _ = _bf16_case(n=12, v=40, seed=3)
    old, adv, mask = torch.full((1, 12), -3.0), torch.ones(1, 12), torch.ones(1, 12, dtype=torch.bool)
    head = ChunkedVocabParallelHead(weight, Chunking(4, backend="triton"))
    for kw in ({}, {"chunking": None}):
        with pytest.raises((ValueError, RuntimeError), match="triton"):
            head.policy_loss(hidden[None], labels[None], old, adv, mask, **kw)
    loss, _ = head.policy_loss(hidden[None], labels[None], old, adv, mask, chunking=Chunking(4))  # an override
    assert torch.isfinite(loss)
