"""log_probs_and_entropy from given logits: values and gradients against the float64 reference.

Every check draws random upstream gradients for both outputs, so a wrong
coefficient on either term (or a term dropped) changes the gradient.
"""

from __future__ import annotations

import pytest
import torch

import chunked_entropy
from chunked_entropy import Chunking, LogProbsEntropy, log_probs_and_entropy
from tests.helpers import reference

# float32: the library computes in float32 from the exact input values, so
# outputs and gradients agree with float64 to a few float32 ulps of the
# quantities summed over the vocabulary (V <= 64 here).
VAL = dict(rtol=1e-5, atol=1e-5)
GRAD = dict(rtol=1e-5, atol=1e-6)
# compiled against eager kernels: the same float32 math in another order
COMPILED = dict(rtol=2e-6, atol=2e-6)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _logits(shape, seed=0, dtype=torch.float32, scale=3.0):
    return (torch.randn(shape, generator=_gen(seed), dtype=torch.float64) * scale).to(dtype)


def _labels(shape, v, seed=1, high=None):
    return torch.randint(0, high or v, shape, generator=_gen(seed))


def _upstream(shape, seed=2):
    g = _gen(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def _ours(base, view, labels, g_lp, g_h, **kw):
    """Run our function on ``view(leaf)``; return outputs and the leaf's gradient."""
    leaf = base.detach().clone().requires_grad_(True)
    out = log_probs_and_entropy(view(leaf), labels, **kw)
    loss = 0
    if g_lp is not None:
        loss = loss + (out.log_probs * g_lp.to(out.log_probs.dtype)).sum()
    if g_h is not None:
        loss = loss + (out.entropy * g_h.to(out.entropy.dtype)).sum()
    loss.backward()
    return out, leaf.grad


def _ref(base, view, labels, g_lp, g_h, temperature=1.0, **kw):
    leaf = base.detach().to(torch.float64).requires_grad_(True)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(torch.float64)
    lp, h = reference(view(leaf), labels, temperature=temperature, **kw)
    loss = 0
    if g_lp is not None:
        loss = loss + (lp * g_lp).sum()
    if g_h is not None:
        loss = loss + (h * g_h).sum()
    loss.backward()
    return lp.detach(), h.detach(), leaf.grad


def check(base, labels, *, view=lambda t: t, val=VAL, grad=GRAD, use=("lp", "h"), seed=2, chunk_size=None, **kw):
    """Compare values and gradients of ``view(base)`` with the float64 reference."""
    g_lp, g_h = _upstream(labels.shape, seed)
    g_lp = g_lp if "lp" in use else None
    g_h = g_h if "h" in use else None
    size = {} if chunk_size is None else dict(chunk_size=chunk_size)
    kw_call = dict(kw, chunking=Chunking(**size, backend="compile"))
    out, gx = _ours(base, view, labels, g_lp, g_h, chunking=Chunking(**size), **kw)
    kw.pop("compute_entropy", None)
    lp, h, gref = _ref(base, view, labels, g_lp, g_h, **kw)
    assert isinstance(out, LogProbsEntropy)
    assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == labels.shape
    torch.testing.assert_close(out.log_probs.double(), lp, **val)
    if out.entropy is not None:
        assert out.entropy.dtype == torch.float32 and out.entropy.shape == labels.shape
        torch.testing.assert_close(out.entropy.double(), h, **val)
    assert gx.dtype == base.dtype and gx.shape == base.shape
    assert torch.isfinite(gx).all()
    torch.testing.assert_close(gx.double(), gref, **grad)
    # the compiled kernels: float32 rounding of the eager results, and the same float64 tolerances
    out_c, gx_c = _ours(base, view, labels, g_lp, g_h, **kw_call)
    pairs = ((out_c.log_probs, out.log_probs, lp), (out_c.entropy, out.entropy, h), (gx_c, gx, gref))
    for ours_c, ours_e, ref in pairs:
        if ours_e is None:
            assert ours_c is None
            continue
        tol = COMPILED if ours_e.dtype == torch.float32 else grad
        torch.testing.assert_close(ours_c.double(), ours_e.double(), **tol)
        torch.testing.assert_close(ours_c.double(), ref, **(grad if ours_c is gx_c else val))
    return out, gx


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    "shape,chunk",
    [
        ((23, 17), 7),  # chunk does not divide N
        ((23, 17), 1),  # one token per chunk
        ((23, 17), 1000),  # chunk larger than N
        ((23, 17), 23),  # exactly one chunk
        ((3, 5, 19), 4),  # 3-D leading dims, chunks cross the batch boundary
        ((2, 3, 4, 11), 5),  # 4-D
        ((1, 64), 3),  # one token
        ((9, 1), 4),  # a one-word vocabulary: log-prob 0, entropy 0
    ],
)
def test_values_and_gradients_odd_shapes(shape, chunk):
    x = _logits(shape)
    check(x, _labels(shape[:-1], shape[-1]), chunk_size=chunk)


def test_zero_dim_labels_single_token():
    x = _logits((13,))
    check(x, torch.tensor(4), chunk_size=3)


def test_default_chunk_size_and_large_logits():
    # |logits| ~ 100: exp overflows float32 (at 88.7) unless the row max is shifted out
    # first. The statistics lse and mu are float32 numbers near 100, where one ulp is
    # 7.6e-6, so values and gradients carry that absolute error (plain float32 torch too).
    x = _logits((6, 40), scale=1.0) + 100.0
    tol = dict(val=dict(rtol=1e-5, atol=2e-5), grad=dict(rtol=1e-5, atol=1e-5))
    check(x, _labels((6,), 40), **tol)
    check(-x, _labels((6,), 40), **tol)


# ----------------------------------------------------------------------------- strides


@pytest.mark.parametrize(
    "make_base,view",
    [
        # Megatron's logits[:, :-1]: leading dims no longer flatten as a view
        (lambda: _logits((3, 8, 21)), lambda t: t[:, :-1]),
        # [S, B, V] -> [B, S, V] transpose
        (lambda: _logits((7, 3, 21)), lambda t: t.transpose(0, 1)),
        # vocabulary not contiguous: [V, N] transposed
        (lambda: _logits((21, 10)), lambda t: t.t()),
        # vocabulary slice of a wider buffer (row stride > V)
        (lambda: _logits((10, 30)), lambda t: t[:, 4:25]),
        # every other token, 3-D
        (lambda: _logits((2, 12, 21)), lambda t: t[:, ::2]),
        # stride-0 rows: one row broadcast to 9 tokens
        (lambda: _logits((1, 21)), lambda t: t.expand(9, 21)),
    ],
    ids=["slice_last_token", "transpose_leading", "vocab_strided", "vocab_slice", "step2", "expand"],
)
def test_non_contiguous_logits(make_base, view):
    base = make_base()
    lead = view(base).shape[:-1]
    check(base, _labels(lead, view(base).shape[-1]), view=view, chunk_size=4)


# ----------------------------------------------------------------------------- temperature


@pytest.mark.parametrize(
    "temperature",
    [
        0.7,
        2,  # an int is a valid temperature
        torch.tensor(1.3),  # 0-d tensor
        torch.tensor([[0.5], [2.0], [1.0]]),  # per sample [B, 1]
        "per_token",  # [B, T], every token its own temperature
    ],
    ids=["float", "int", "0d", "per_sample", "per_token"],
)
def test_temperature(temperature):
    shape = (3, 5, 19)
    if isinstance(temperature, str):
        temperature = torch.rand(shape[:-1], generator=_gen(5)) * 2 + 0.25
    check(_logits(shape), _labels(shape[:-1], shape[-1]), chunk_size=4, temperature=temperature)


def test_temperature_flat_per_row():
    x = _logits((11, 17))
    t = torch.rand(11, generator=_gen(9)) + 0.5
    check(x, _labels((11,), 17), chunk_size=3, temperature=t)


# ----------------------------------------------------------------------------- padded vocabulary


@pytest.mark.parametrize("temperature", [1.0, 0.5, "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neg_inf_padded_columns(temperature, dtype):
    n, v, pad = 10, 24, 5
    x = _logits((n, v)).to(dtype)
    x[:, v - pad :] = float("-inf")  # Megatron pads the vocabulary
    x[3, 2] = float("-inf")  # and a stray -inf inside the real vocabulary
    labels = _labels((n,), v, high=v - pad)
    labels[3] = 1
    if temperature == "tensor":
        temperature = torch.rand(n, generator=_gen(4)) + 0.5
    tol = GRAD if dtype == torch.float32 else BF16_GRAD
    out, gx = check(x, labels, chunk_size=3, temperature=temperature, grad=tol)
    assert torch.isfinite(out.log_probs).all() and torch.isfinite(out.entropy).all()
    assert (gx[:, v - pad :] == 0).all()
    assert gx[3, 2] == 0


@pytest.mark.parametrize("temperature", [1e-9, "tensor"])
def test_neg_inf_padded_columns_at_a_tiny_temperature(temperature):
    """The entropy's gradient at a padded column is 0 also where ``g_h / t`` exceeds 3.4e8: there
    ``b * (w/s - y)`` at the floored offset (-1e30) overflowed to inf, and ``p = 0`` times it was NaN."""
    n, v, pad = 6, 24, 5
    x = _logits((n, v)) * 3
    x[:, v - pad :] = float("-inf")
    labels = _labels((n,), v, high=v - pad)
    if temperature == "tensor":
        temperature = torch.tensor([1e-9, 1e-8, 3e-8, 1.0, 0.5, 1e-9])
    up = torch.randn(2, n, generator=_gen(5), dtype=torch.float64) * 10
    x64 = x.double().requires_grad_()
    t64 = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    ref = reference(x64, labels, temperature=t64)
    (ref[0] * up[0] + ref[1] * up[1]).sum().backward()
    xx = x.clone().requires_grad_()
    out = log_probs_and_entropy(xx, labels, temperature=temperature, chunking=Chunking(4, backend="eager"))
    (out.log_probs * up[0] + out.entropy * up[1]).sum().backward()
    assert torch.isfinite(xx.grad).all() and (xx.grad[:, v - pad :] == 0).all()
    torch.testing.assert_close(xx.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- low precision

# Half-precision inputs are exact in float32 and float64, and the library computes
# in float32, so values keep float32 tolerances. The gradient is rounded once to the
# input dtype: at most half an ulp, i.e. 2**-9 (bf16) / 2**-12 (fp16) relative, plus
# the subnormal spacing for tiny entries (fp16: 6e-8).
BF16_GRAD = dict(rtol=2**-8, atol=1e-6)
FP16_GRAD = dict(rtol=2**-11, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, BF16_GRAD), (torch.float16, FP16_GRAD)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_half_precision(dtype, tol, temperature):
    shape = (2, 9, 33)
    x = _logits(shape, dtype=dtype)
    _, gx = check(x, _labels(shape[:-1], 33), chunk_size=5, temperature=temperature, grad=tol)
    assert gx.dtype == dtype


def test_half_precision_non_contiguous():
    base = _logits((3, 8, 21), dtype=torch.bfloat16)
    check(base, _labels((3, 7), 21), view=lambda t: t[:, :-1], chunk_size=4, grad=BF16_GRAD)


# ----------------------------------------------------------------------------- masking


@pytest.mark.parametrize("chunk", [3, 100])
def test_label_mask_and_ignore_index(chunk):
    shape = (4, 6, 15)
    x = _logits(shape)
    labels = _labels(shape[:-1], 15)
    labels[0, :3] = -100  # ignored
    labels[2, 5] = -100
    mask = torch.rand(shape[:-1], generator=_gen(7)) > 0.4
    mask[1, 2] = False
    labels[1, 2] = 10**6  # masked labels are not range-checked
    out, gx = check(x, labels, chunk_size=chunk, label_mask=mask)
    off = (labels == -100) | ~mask
    assert (out.log_probs[off] == 0).all()
    assert (out.entropy[off] > 0).all()  # entropy stays defined where the label is masked
    # Only the log-prob term: no gradient at all at masked tokens.
    _, g_only_lp = check(x, labels, chunk_size=chunk, label_mask=mask, use=("lp",))
    assert (g_only_lp[off] == 0).all()
    assert (g_only_lp[~off] != 0).any()


def test_custom_ignore_index():
    x = _logits((8, 12))
    labels = _labels((8,), 12)
    labels[[1, 5]] = 7
    out, _ = check(x, labels, chunk_size=3, ignore_index=7)
    assert (out.log_probs[labels == 7] == 0).all()
    # with a custom ignore_index, -100 is an ordinary (out-of-range) id again
    with pytest.raises(ValueError, match="labels"):
        log_probs_and_entropy(x, torch.full((8,), -100), ignore_index=7)


def test_integer_mask_is_a_mask():
    x = _logits((6, 12))
    labels = _labels((6,), 12)
    mask = torch.tensor([1, 0, 1, 1, 0, 1])
    ours = log_probs_and_entropy(x, labels, label_mask=mask, chunking=4)
    check(x, labels, chunk_size=4, label_mask=mask.bool())
    assert (ours.log_probs[mask == 0] == 0).all()
    torch.testing.assert_close(
        ours.log_probs, log_probs_and_entropy(x, labels, label_mask=mask.bool(), chunking=4).log_probs, rtol=0, atol=0
    )


# ----------------------------------------------------------------------------- which outputs


def test_compute_entropy_false():
    x = _logits((2, 7, 20))
    labels = _labels((2, 7), 20)
    out, _ = check(x, labels, chunk_size=3, compute_entropy=False, use=("lp",))
    assert out.entropy is None
    lp, ent = out  # unpacks as a pair
    assert ent is None
    full = log_probs_and_entropy(x, labels, chunking=3)
    torch.testing.assert_close(lp, full.log_probs, rtol=0, atol=0)


@pytest.mark.parametrize("use", [("lp",), ("h",)])
def test_only_one_output_in_the_loss(use, monkeypatch):
    x = _logits((3, 5, 19))
    labels = _labels((3, 5), 19)
    calls = []
    real = chunked_entropy._stats.block_grad

    def spy(x, tf, k, row, target, v0, co, scratch, aux, **kw):
        calls.append((co.c is None, co.b is None))
        return real(x, tf, k, row, target, v0, co, scratch, aux, **kw)

    monkeypatch.setattr(chunked_entropy._stats, "block_grad", spy)
    check(x, labels, chunk_size=4, use=use)
    # backward skips the unused output's work: its coefficient is never formed
    expect = (False, True) if use == ("lp",) else (True, False)
    assert calls and all(c == expect for c in calls)


@pytest.mark.parametrize("dtype,softcap", [(torch.float32, None), (torch.float32, 30.0), (torch.bfloat16, None)])
def test_eager_reads_float32_logits_rows_without_copying_them_first(dtype, softcap):
    """The eager kernels' first op over a block of float32 logits (the max, then the offsets) reads the
    caller's rows and writes the buffer: no copy of the logits, forward or backward. With a soft-cap (its tanh
    is taken in the buffer) and for bf16 rows (a copy and a float32 op are faster on a CPU than one op mixing
    dtypes) each block is copied first: the same log sees those copies."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from chunked_entropy import OutputLayer

    x = _logits((4, 6, 37), dtype=dtype).requires_grad_(True)
    base = x.untyped_storage().data_ptr()
    copies = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default and args[1].untyped_storage().data_ptr() == base:
                copies.append(tuple(args[1].shape))
            return func(*args, **(kwargs or {}))

    layer = OutputLayer(softcap=softcap)
    labels = _labels((4, 6), 37)
    with Log():
        lp, ent = log_probs_and_entropy(x, labels, layer=layer, chunking=Chunking(10, backend="eager"))
        (lp.sum() + ent.sum()).backward()
    g_eager = x.grad
    x.grad = None
    ref = log_probs_and_entropy(x, labels, layer=layer, chunking=Chunking(10, backend="compile"))
    (ref[0].sum() + ref[1].sum()).backward()
    torch.testing.assert_close(g_eager.float(), x.grad.float(), rtol=1e-2, atol=1e-5)
    if dtype == torch.float32 and softcap is None:
        assert copies == []
    else:  # every chunk, forward and backward (10 + 10 + 4 rows, twice)
        assert copies == [(10, 37), (10, 37), (4, 37)] * 2


def test_no_gradient_reaches_unused_outputs():
    x = _logits((5, 9)).requires_grad_(True)
    out = log_probs_and_entropy(x, _labels((5,), 9), chunking=2)
    (out.entropy * 0).sum().backward()
    assert (x.grad == 0).all()


# ----------------------------------------------------------------------------- the seed scenario


def test_seed_scenario_shared_logits_one_backward():
    """One float32 logits tensor feeds a log-prob-only call, an entropy-only call and
    an ordinary op that saves it (``pow``); one backward gives the exact summed gradient."""
    shape = (2, 6, 25)
    base = _logits(shape)
    labels = _labels(shape[:-1], 25)
    mask = torch.rand(shape[:-1], generator=_gen(3)) > 0.3
    g_lp, g_h = _upstream(shape[:-1])
    w = torch.randn(shape, generator=_gen(8), dtype=torch.float64)

    def loss_of(x, lp, h):
        other = (x.pow(2) * w.to(x.dtype)).sum() * 1e-2  # saves x itself for backward
        return (lp * g_lp.to(lp.dtype)).sum() + (h * g_h.to(h.dtype)).sum() + other

    x = base.clone().requires_grad_(True)
    v0 = x._version
    lp = log_probs_and_entropy(x, labels, chunking=4, compute_entropy=False, label_mask=mask, temperature=0.8).log_probs
    h = log_probs_and_entropy(x, labels, chunking=5, temperature=0.8).entropy
    loss_of(x, lp, h).backward()
    assert x._version == v0

    xr = base.double().requires_grad_(True)
    lpr, _ = reference(xr, labels, label_mask=mask, temperature=0.8)
    _, hr = reference(xr, labels, temperature=0.8)
    loss_of(xr, lpr, hr).backward()
    torch.testing.assert_close(lp.double(), lpr.detach(), **VAL)
    torch.testing.assert_close(h.double(), hr.detach(), **VAL)
    torch.testing.assert_close(x.grad.double(), xr.grad, **GRAD)


def test_seed_scenario_in_place_user_op_after_our_call_is_detected():
    # We save the logits reference; if the *caller* later writes into them,
    # autograd must refuse (not silently use the new values).
    x = _logits((4, 9)).requires_grad_(True)
    y = x * 1.0
    lp, h = log_probs_and_entropy(y, _labels((4,), 9), chunking=2)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):
        (lp.sum() + h.sum()).backward()


# ----------------------------------------------------------------------------- never write the input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_bitwise_unchanged_and_version_unchanged(dtype):
    shape = (3, 7, 18)
    x = _logits(shape, dtype=dtype)
    x[..., -2:] = float("-inf")
    x.requires_grad_(True)
    labels = _labels(shape[:-1], 18, high=16)
    labels[0, 0] = -100
    mask = torch.rand(shape[:-1], generator=_gen(6)) > 0.2
    temp = torch.rand(shape[:-1], generator=_gen(7), dtype=torch.float32) + 0.5  # float32: same as compute dtype
    snap = [t.detach().clone() for t in (x, labels, mask, temp)]
    vers = [t._version for t in (x, labels, mask, temp)]
    lp, h = log_probs_and_entropy(x, labels, chunking=4, temperature=temp, label_mask=mask)
    g_lp, g_h = _upstream(shape[:-1])
    (lp * g_lp.float()).sum().backward(retain_graph=True)
    (h * g_h.float()).sum().backward()
    with torch.no_grad():
        log_probs_and_entropy(x, labels, chunking=4, temperature=temp, label_mask=mask)
    for t, s, v in zip((x, labels, mask, temp), snap, vers, strict=True):
        assert t._version == v
        assert torch.equal(t.detach(), s)  # bitwise (equal -inf counts as equal)
    # and the same with a per-row temperature that broadcasts (a view of the caller's tensor)
    temp2 = temp[:, :1].clone()
    snap2, ver2 = temp2.clone(), temp2._version
    lp, h = log_probs_and_entropy(x, labels, chunking=4, temperature=temp2)
    (lp.sum() + h.sum()).backward()
    assert temp2._version == ver2 and torch.equal(temp2, snap2)
    assert x._version == vers[0] and torch.equal(x.detach(), snap[0])


# ----------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("compute_entropy", [True, False])
def test_gradcheck_float64(compute_entropy):
    g = _gen(11)
    base = torch.randn(2, 5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 6, (2, 4), generator=g)
    labels[1, 1] = -100
    mask = torch.tensor([[True, True, False, True], [True, True, True, True]])
    temp = torch.rand(2, 1, dtype=torch.float64, generator=g) + 0.5

    def fn(b):
        out = log_probs_and_entropy(b[:, :-1, :6], labels, chunking=3, temperature=temp, label_mask=mask,
                                    compute_entropy=compute_entropy)
        return tuple(o for o in out if o is not None)

    assert torch.autograd.gradcheck(fn, (base,), eps=1e-6, atol=1e-8, rtol=1e-6)
    out = fn(base)
    assert all(o.dtype == torch.float64 for o in out)


# ----------------------------------------------------------------------------- no grad


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_no_grad_same_values_nothing_saved(ctx):
    x = _logits((3, 5, 19)).requires_grad_(True)
    labels = _labels((3, 5), 19)
    temp = torch.rand(3, 1, generator=_gen(1)) + 0.5
    ref = log_probs_and_entropy(x, labels, chunking=4, temperature=temp)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with ctx():
            out = log_probs_and_entropy(x, labels, chunking=4, temperature=temp)
    assert packed == []
    assert out.log_probs.grad_fn is None and out.entropy.grad_fn is None
    assert not out.log_probs.requires_grad and not out.entropy.requires_grad
    torch.testing.assert_close(out.log_probs, ref.log_probs, rtol=0, atol=0)
    torch.testing.assert_close(out.entropy, ref.entropy, rtol=0, atol=0)


def test_logits_without_requires_grad_build_no_graph():
    x = _logits((4, 9))
    out = log_probs_and_entropy(x, _labels((4,), 9), chunking=2)
    assert out.log_probs.grad_fn is None and not out.entropy.requires_grad


# ----------------------------------------------------------------------------- saved for backward


@pytest.mark.parametrize(
    "dtype,view,compute_entropy",
    [
        (torch.float32, lambda t: t, True),
        (torch.float32, lambda t: t, False),
        (torch.bfloat16, lambda t: t, True),
        (torch.float32, lambda t: t[:, :-1], True),
        (torch.float32, lambda t: t.transpose(0, 1), True),
    ],
    ids=["f32", "f32_logprob_only", "bf16", "slice", "transpose"],
)
def test_saved_for_backward_is_logits_reference_plus_per_token_stats(dtype, view, compute_entropy):
    base = _logits((4, 9, 33), dtype=dtype).requires_grad_(True)
    logits = view(base)
    n = logits[..., 0].numel()
    labels = _labels(logits.shape[:-1], 33)
    temp = torch.rand(logits.shape[:-1], generator=_gen(3)) + 0.5
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = log_probs_and_entropy(logits, labels, chunking=5, temperature=temp, compute_entropy=compute_entropy)
    big = [t for t in packed if t.numel() > 3 * n]
    small = [t for t in packed if t.numel() <= 3 * n]
    # the logits themselves, by reference: same storage, same strides, same dtype, no copy
    assert len(big) == 1
    (saved,) = big
    assert saved.dtype == dtype and saved.shape == logits.shape and saved.stride() == logits.stride()
    assert saved.data_ptr() == logits.data_ptr()
    # and O(tokens) statistics: the row max, log s and (with entropy) w / s, float32 per token
    assert sum(t.numel() for t in small) == (3 if compute_entropy else 2) * n
    assert all(t.dtype == torch.float32 for t in small)
    # backward still works from what was saved
    loss = out.log_probs.sum() + (0 if out.entropy is None else out.entropy.sum())
    loss.backward()
    assert base.grad is not None and torch.isfinite(base.grad).all()


# ----------------------------------------------------------------------------- empty


@pytest.mark.parametrize("shape", [(0, 7), (2, 0, 7), (0,) * 2 + (3,)])
@pytest.mark.parametrize("compute_entropy", [True, False])
def test_empty_inputs_give_empty_outputs(shape, compute_entropy):
    x = torch.randn(shape, requires_grad=True)
    labels = torch.zeros(shape[:-1], dtype=torch.long)
    out = log_probs_and_entropy(x, labels, chunking=4, compute_entropy=compute_entropy)
    assert out.log_probs.shape == labels.shape and out.log_probs.dtype == torch.float32
    if compute_entropy:
        assert out.entropy.shape == labels.shape
        loss = out.log_probs.sum() + out.entropy.sum()
    else:
        assert out.entropy is None
        loss = out.log_probs.sum()
    loss.backward()
    assert x.grad.shape == x.shape
    with torch.no_grad():
        out = log_probs_and_entropy(x, labels, compute_entropy=compute_entropy)
    assert out.log_probs.shape == labels.shape


# ----------------------------------------------------------------------------- higher order


def test_create_graph_first_order_exact_second_order_refused():
    """create_graph=True still gives the exact first-order gradient, but differentiating
    it again must raise: our backward is not differentiable, and a silently missing
    second-order term (e.g. in a gradient penalty) would be wrong."""
    x = _logits((4, 7), dtype=torch.float64).requires_grad_(True)
    labels = _labels((4,), 7)
    lp, h = log_probs_and_entropy(x, labels, chunking=3)
    loss = lp.sum() + h.sum() + x.pow(3).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    xr = x.detach().clone().requires_grad_(True)
    lpr, hr = reference(xr, labels)
    (gr,) = torch.autograd.grad(lpr.sum() + hr.sum() + xr.pow(3).sum(), xr)
    torch.testing.assert_close(g.detach(), gr, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="differentiate twice|once_differentiable"):
        torch.autograd.grad(g.pow(2).sum(), x)


def test_finfo_min_masked_columns_like_hf():
    # HF-style masking fills with finfo(dtype).min instead of -inf: still finite, p == 0 there
    x = _logits((6, 16))
    x[:, 12:] = torch.finfo(torch.float32).min
    labels = _labels((6,), 16, high=12)
    out, gx = check(x, labels, chunk_size=4, temperature=0.5)
    assert (gx[:, 12:] == 0).all()


# ----------------------------------------------------------------------------- allocations


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of every tensor an aten op newly allocates
    (outputs that share storage with an input, i.e. views and in-place results, are skipped)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
        flat_out, _ = torch.utils._pytree.tree_flatten(out)
        for t in flat_out:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize(
    "dtype,view",
    [(torch.float32, lambda t: t), (torch.bfloat16, lambda t: t), (torch.float32, lambda t: t[:, :-1])],
    ids=["f32", "bf16", "non_viewable"],
)
def test_only_chunk_sized_buffers_are_allocated(dtype, view):
    """Cast per chunk, never the whole tensor: forward allocates nothing of [tokens, V]
    size; backward allocates exactly one such tensor, the gradient."""
    chunk, v = 6, 33
    base = _logits((4, 11, v), dtype=dtype).requires_grad_(True)
    logits = view(base)
    n = logits[..., 0].numel()
    labels = _labels(logits.shape[:-1], v)
    g_lp, g_h = _upstream(labels.shape)
    with _Allocations() as fwd:
        lp, h = log_probs_and_entropy(logits, labels, chunking=chunk, temperature=0.9)
    assert max(fwd.sizes) <= chunk * v < n * v
    loss = (lp * g_lp.float()).sum() + (h * g_h.float()).sum()
    grad_out = torch.autograd.grad(loss, [lp, h], retain_graph=True)  # upstream grads, outside the probe
    with _Allocations() as bwd:
        (g,) = torch.autograd.grad([lp, h], [logits], grad_out)
    big = [s for s in bwd.sizes if s > chunk * v]
    assert big == [n * v]  # the gradient itself, nothing else
    assert g.dtype == dtype
