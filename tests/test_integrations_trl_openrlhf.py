"""TRL and OpenRLHF drop-ins: values and gradients against float64 and against the upstream functions.

The upstream functions are re-implemented here from their source
(``trl/trainer/utils.py``: ``selective_log_softmax``, ``entropy_from_logits``;
``openrlhf/models/utils.py``: ``log_probs_from_logits``, ``compute_entropy``)
so that the drop-ins are checked against what they replace, not only against
our own reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunked_entropy.integrations import openrlhf, trl
from tests.helpers import reference

RTOL, ATOL = 1e-5, 1e-6  # float32 computation against float64


# --- the upstream functions, as written upstream (semantics, not memory behaviour) -------------


def upstream_trl_selective_log_softmax(logits, index):
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return selected - lse
    rows = []
    for row_logits, row_labels in zip(logits, index):
        row_logps = F.log_softmax(row_logits, dim=-1)
        rows.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def upstream_trl_entropy_from_logits(logits, chunk_size=128):
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for chunk in flat.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        out.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(out, dim=0).reshape(logits.shape[:-1])


def upstream_openrlhf_log_probs_from_logits(logits, labels, temperature=1.0):
    if temperature != 1.0:
        logits.div_(temperature)  # upstream writes its input
    selected = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits.reshape(-1, logits.shape[-1]), dim=-1).view(labels.shape)
    return selected - lse


def upstream_openrlhf_compute_entropy(logits):
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


# --- helpers ------------------------------------------------------------------------------------


def make(shape, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, v, generator=g, dtype=torch.float64) * scale
    index = torch.randint(0, v, shape, generator=g)
    return logits, index


def check_grad(ours, x32, ref64, x64, seed):
    """Random upstream gradient on the output; our gradient against float64 autograd."""
    up = torch.randn(ref64.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (ours.double() * up).sum().backward()
    (ref64 * up).sum().backward()
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=RTOL * 10, atol=ATOL * 10)


SHAPES = [(3, 11), (2, 3, 5), (7,)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_trl_selective_log_softmax(shape):
    logits64, index = make(shape, 29, seed=1)
    x = logits64.float().requires_grad_(True)
    out = trl.selective_log_softmax(x, index, chunk_size=4)
    assert out.shape == index.shape and out.dtype == torch.float32
    x64 = logits64.clone().requires_grad_(True)
    ref = reference(x64, index)[0]
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    # Same values as TRL's own (float32 in, float32 out there too).
    torch.testing.assert_close(out, upstream_trl_selective_log_softmax(x.detach(), index), rtol=RTOL, atol=ATOL)
    check_grad(out, x, ref, x64, seed=2)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("chunk_size", [1, 4, 128])
def test_trl_entropy_from_logits(shape, chunk_size):
    logits64, _ = make(shape, 23, seed=3)
    x = logits64.float().requires_grad_(True)
    out = trl.entropy_from_logits(x, chunk_size=chunk_size)
    assert out.shape == x.shape[:-1] and out.dtype == torch.float32
    x64 = logits64.clone().requires_grad_(True)
    ref = reference(x64, torch.zeros(shape, dtype=torch.int64))[1]
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out, upstream_trl_entropy_from_logits(x.detach(), chunk_size), rtol=RTOL, atol=ATOL)
    # The entropy's gradient, p * (mu - z) per logit, against float64 autograd.
    check_grad(out, x, ref, x64, seed=4)


def test_trl_as_grpo_uses_them():
    # TRL's GRPO: logits[:, :-1] (a non-contiguous view) divided by the temperature, then both helpers.
    logits64, ids = make((2, 8), 31, seed=5)
    x = logits64.float().requires_grad_(True)
    scaled = x[:, :-1] / 0.9
    logps = trl.selective_log_softmax(scaled, ids[:, 1:])
    ent = trl.entropy_from_logits(scaled)
    x64 = logits64.clone().requires_grad_(True)
    ref_lp, ref_ent = reference(x64[:, :-1] / 0.9, ids[:, 1:])
    torch.testing.assert_close(logps.double(), ref_lp, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=RTOL, atol=ATOL)
    g = torch.Generator().manual_seed(6)
    u1, u2 = (torch.randn(ref_lp.shape, generator=g, dtype=torch.float64) for _ in range(2))
    ((logps.double() * u1).sum() + (ent.double() * u2).sum()).backward()
    ((ref_lp * u1).sum() + (ref_ent * u2).sum()).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=RTOL * 10, atol=ATOL * 10)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_openrlhf_log_probs_from_logits(temperature):
    logits64, labels = make((2, 6), 19, seed=7)
    x = logits64.float().requires_grad_(True)
    before = x.detach().clone()
    version = x._version
    out = openrlhf.log_probs_from_logits(x, labels, temperature, chunk_size=5)
    assert x._version == version and torch.equal(x.detach(), before)  # never written (upstream divides in place)
    x64 = logits64.clone().requires_grad_(True)
    ref = reference(x64, labels, temperature=temperature)[0]
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    upstream = upstream_openrlhf_log_probs_from_logits(x.detach().clone(), labels, temperature)
    torch.testing.assert_close(out, upstream, rtol=RTOL, atol=ATOL)
    check_grad(out, x, ref, x64, seed=8)


def test_openrlhf_per_token_temperature():
    logits64, labels = make((2, 6), 19, seed=9)
    t = torch.rand(2, 6, dtype=torch.float64) + 0.5
    x = logits64.float().requires_grad_(True)
    out = openrlhf.log_probs_from_logits(x, labels, t.float())
    x64 = logits64.clone().requires_grad_(True)
    ref = reference(x64, labels, temperature=t)[0]
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    check_grad(out, x, ref, x64, seed=10)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_openrlhf_compute_entropy(shape):
    logits64, _ = make(shape, 17, seed=11)
    x = logits64.float().requires_grad_(True)
    out = openrlhf.compute_entropy(x, chunk_size=3)
    x64 = logits64.clone().requires_grad_(True)
    ref = reference(x64, torch.zeros(shape, dtype=torch.int64))[1]
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out, upstream_openrlhf_compute_entropy(x.detach()), rtol=RTOL, atol=ATOL)
    check_grad(out, x, ref, x64, seed=12)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, i: trl.selective_log_softmax(x, i),
        lambda x, i: trl.entropy_from_logits(x),
        lambda x, i: openrlhf.log_probs_from_logits(x, i, 0.8),
        lambda x, i: openrlhf.compute_entropy(x),
    ],
    ids=["trl.selective_log_softmax", "trl.entropy_from_logits", "openrlhf.log_probs_from_logits",
         "openrlhf.compute_entropy"],
)
def test_bf16_in_float32_out(fn):
    # Half-precision logits: computed and returned in float32 (upstream returns bf16), the gradient in bf16.
    logits64, index = make((3, 4), 37, seed=13)
    x = logits64.bfloat16().requires_grad_(True)
    out = fn(x, index)
    assert out.dtype == torch.float32
    exact = x.detach().double().requires_grad_(True)  # float64 of the same bf16 values
    ref = fn(exact, index)  # float64 in: float64 math, checked against `reference` in the tests above
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    up = torch.randn(out.shape, dtype=torch.float64)
    (out.double() * up).sum().backward()
    (ref * up).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), exact.grad, rtol=2**-8, atol=1e-3)  # bf16 rounding of the grad


def test_saved_for_backward_is_per_token():
    # The drop-ins add no full-size tensor to the graph: besides the logits themselves, only per-token vectors.
    logits64, index = make((4, 6), 101, seed=14)
    x = logits64.float().requires_grad_(True)
    n = index.numel()
    for fn in (
        lambda: trl.selective_log_softmax(x, index),
        lambda: trl.entropy_from_logits(x, chunk_size=5),
        lambda: openrlhf.log_probs_from_logits(x, index, 0.7),
        lambda: openrlhf.compute_entropy(x),
    ):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn()
        assert saved, "nothing saved: the graph is not connected"
        big = [tuple(t.shape) for t in saved if t.data_ptr() != x.data_ptr() and t.numel() > n]
        assert not big, big


def test_bad_inputs_name_the_argument():
    x, i = make((2, 3), 7, seed=15)
    for call in (
        lambda: trl.selective_log_softmax(x.tolist(), i),
        lambda: trl.entropy_from_logits(x.numpy()),
        lambda: openrlhf.log_probs_from_logits("x", i),
        lambda: openrlhf.compute_entropy(None),
    ):
        with pytest.raises(TypeError, match="^logits must be a torch.Tensor"):
            call()
    with pytest.raises(TypeError, match="^index must be"):
        trl.selective_log_softmax(x, i.tolist())
    with pytest.raises(ValueError, match="^index must have the shape"):
        trl.selective_log_softmax(x, i[:, :2])
    with pytest.raises(ValueError, match="^labels must have the shape"):
        openrlhf.log_probs_from_logits(x, i[None])
    with pytest.raises(TypeError, match="^labels must be"):
        openrlhf.log_probs_from_logits(x, 3)
    with pytest.raises(ValueError, match="^chunk_size must be an int >= 1"):
        trl.entropy_from_logits(x, chunk_size=0)
    with pytest.raises(ValueError, match="^chunk_size must be an int >= 1"):
        trl.selective_log_softmax(x, i, chunk_size=1.5)
    with pytest.raises(ValueError, match="^chunk_size must be an int >= 1"):
        openrlhf.compute_entropy(x, chunk_size=-1)
    with pytest.raises(ValueError, match="temperature"):
        openrlhf.log_probs_from_logits(x, i, 0.0)
    with pytest.raises(ValueError, match="vocabulary ids"):
        trl.selective_log_softmax(x, i + 7)
    with pytest.raises(ValueError, match="num_classes >= 1"):
        trl.entropy_from_logits(torch.zeros(3, 0))


def test_huggingface_page_example_runs(tmp_path, monkeypatch, capsys):
    # The plain-PyTorch example of docs/integrations/huggingface.md, as a reader would paste it
    # (```py blocks need transformers/TRL and are not run; ```python blocks must run).
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "integrations" / "huggingface.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], str(page), "exec"), {"__name__": "__main__"})
    assert re.match(r"loss -?\d+\.\d+, mean entropy \d+\.\d+", capsys.readouterr().out)


def test_trl_ignore_label_gives_zero_and_no_gradient():
    logits64, index = make((2, 5), 13, seed=16)
    index[0, 1] = index[1, 4] = -100
    x = logits64.float().requires_grad_(True)
    out = trl.selective_log_softmax(x, index)
    assert out[0, 1] == 0 and out[1, 4] == 0
    x64 = logits64.clone().requires_grad_(True)
    ref = reference(x64, index)[0]  # ignore_index=-100: 0, no gradient
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    check_grad(out, x, ref, x64, seed=17)
    assert torch.all(x.grad[0, 1] == 0) and torch.all(x.grad[1, 4] == 0)
