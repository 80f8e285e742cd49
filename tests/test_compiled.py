"""The compiled kernels (backend="compile"): the same results as the eager reference, no recompiles.

Every case runs both backends on the same inputs with random upstream
gradients on every output, and checks them against each other (float32
rounding) and against float64. Compiling is done once per kernel variant per
process (seconds each on CPU), so the cases share variants where they can.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from chunked_entropy import (
    ChunkedVocabParallelHead,
    Chunking,
    OutputLayer,
    PolicyLoss,
    _kernels,
    linear_log_probs_and_entropy,
    linear_policy_loss,
    log_probs_and_entropy,
    policy_loss_from_logits,
)
from tests.helpers import reference, run_distributed

V = 61  # all vocabulary widths here stay on one side of inductor's 4097-column reduction switch


def _run(fn, leaves, ups):
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    outs = [o for o in (out.log_probs, out.entropy, out.sum_pi_squared) if o is not None]
    sum((o.float() * u).sum() for o, u in zip(outs, ups[: len(outs)], strict=True)).backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves]


def _both(fn, leaves, ups, tol):
    eager = _run(lambda *x: fn(*x, backend="eager"), leaves, ups)
    compiled = _run(lambda *x: fn(*x, backend="compile"), leaves, ups)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b.float(), a.float(), **tol)
    return compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [{}, {"softcap": 4.0, "logit_scale": 0.5, "compute_sum_pi_squared": True}],
                         ids=["plain", "softcap_pi2"])
def test_logits_path_matches_eager_and_float64(dtype, extra):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(3, 11, V, generator=g) * 4).to(dtype)
    labels = torch.randint(0, V, (3, 11), generator=g)
    labels[0, 0] = -100
    t = torch.rand(3, 11, generator=g) + 0.4
    ups = [torch.randn(3, 11, generator=g) for _ in range(3)]
    layer = OutputLayer(softcap=extra.get("softcap"), logit_scale=extra.get("logit_scale"))
    fn = lambda x, backend: log_probs_and_entropy(  # noqa: E731
        x, labels, temperature=t, layer=layer, chunking=Chunking(8, backend=backend),
        compute_sum_pi_squared=extra.get("compute_sum_pi_squared", False))
    tol = dict(rtol=1e-5, atol=1e-6)
    outs = _both(fn, [z], ups, tol)
    ref = reference(z.double(), labels, temperature=t.double(), sum_pi_squared=True,
                    **{k: v for k, v in extra.items() if k != "compute_sum_pi_squared"})
    for o, r in zip(outs[:-1], ref[: len(outs) - 1], strict=True):
        torch.testing.assert_close(o.double(), r, rtol=1e-5, atol=1e-5)


def test_padded_columns_at_a_tiny_temperature_pass_no_nan():
    """``g_h / t`` above 3.4e8: ``b * (ws - y)`` overflows at a -inf column's floored offset; ``p = 0`` times
    it is 0, not NaN (float32 logits without a cap: the plain case's kernels, compiled once)."""
    g = torch.Generator().manual_seed(13)
    z = torch.randn(5, V, generator=g) * 3
    z[:, -5:] = float("-inf")
    labels = torch.randint(0, V - 5, (5,), generator=g)
    t = torch.tensor([1e-9, 1e-8, 1.0, 3e-9, 0.5])
    ups = [torch.randn(5, generator=g) * 10 for _ in range(2)]
    fn = lambda x, backend: log_probs_and_entropy(x, labels, temperature=t,  # noqa: E731
                                                  chunking=Chunking(4, backend=backend))
    grad = _both(fn, [z], ups, dict(rtol=1e-5, atol=1e-6))[-1]
    assert torch.isfinite(grad).all() and (grad[:, -5:] == 0).all()


@pytest.mark.parametrize("vocab_chunk_size", [None, 16])
def test_fused_head_matches_eager(vocab_chunk_size):
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(2, 13, 8, generator=g), torch.randn(V, 8, generator=g), torch.randn(V, generator=g)]
    labels = torch.randint(0, V, (2, 13), generator=g)
    ups = [torch.randn(2, 13, generator=g) for _ in range(2)]
    fn = lambda h, w, b, backend: linear_log_probs_and_entropy(  # noqa: E731
        h, OutputLayer(w, b), labels, chunking=Chunking(5, vocab_chunk_size, backend), temperature=0.8)
    _both(fn, leaves, ups, dict(rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("path,mode,chunk", [("head", "vanilla", 4), ("logits", "vanilla", 4), ("head", "gspo", 9),
                                             ("logits", "gspo", 9)])
def test_fused_policy_loss_matches_eager(path, mode, chunk):
    """A token-local mode, and a row-local one whose rows (T = 9) fit the chunk: both from one fill per chunk."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 9, 8, generator=g), torch.randn(V, 8, generator=g)
    labels = torch.randint(0, V, (2, 9), generator=g)
    old, adv = torch.full((2, 9), -4.0), torch.randn(2, 9, generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.2
    results = []
    for backend in ("eager", "compile"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if path == "head":
            loss, _ = linear_policy_loss(h, w, labels, old, adv, mask,
                                         loss=PolicyLoss(mode, {"clip_ratio_c": 3.0}, entropy_coeff=0.01),
                                         chunking=Chunking(chunk, backend=backend))
        else:
            loss, _ = policy_loss_from_logits(h @ w.T, labels, old, adv, mask,
                                              loss=PolicyLoss(mode, {"clip_ratio_c": 3.0}, entropy_coeff=0.01),
                                              chunking=Chunking(chunk, backend=backend))
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_no_recompiles_across_chunks_tokens_temperatures_and_blocks():
    g = torch.Generator().manual_seed(3)

    def logits_call(n, chunk, t):
        z = torch.randn(n, V, generator=g).requires_grad_()
        lp, ent = log_probs_and_entropy(z, torch.randint(0, V, (n,), generator=g),
                                        chunking=Chunking(chunk, backend="compile"), temperature=t)
        (lp.sum() + ent.sum()).backward()

    def head_call(n, chunk, block):
        h, w = torch.randn(n, 8, generator=g).requires_grad_(), torch.randn(V, 8, generator=g).requires_grad_()
        lp, ent = linear_log_probs_and_entropy(h, w, torch.randint(0, V, (n,), generator=g),
                                               chunking=Chunking(chunk, vocab_chunk_size=block, backend="compile"))
        (lp.sum() + ent.sum()).backward()

    logits_call(8, 8, 1.0)  # compiles (or finds) the variants once; tokens == chunk_size: no "duck" guard
    head_call(8, 8, 16)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n, chunk, t in ((37, 8, 0.7), (5, 16, torch.rand(5) + 0.5), (64, 13, 1.3), (1, 4, 0.9)):
            logits_call(n, chunk, t)  # other token counts, chunk sizes, partial chunks, temperatures
        for n, chunk, block in ((33, 7, 16), (9, 9, 23), (40, 11, None)):
            head_call(n, chunk, block)  # other vocabulary blocks and widths


def test_no_grad_and_a_users_compiled_model():
    g = torch.Generator().manual_seed(4)
    head = ChunkedVocabParallelHead(torch.randn(V, 8, generator=g), Chunking(6, backend="compile"))
    labels = torch.randint(0, V, (2, 7), generator=g)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 8)

        def forward(self, x):
            return head(torch.tanh(self.body(x)), labels)

    model = Model()
    x = torch.randn(2, 7, 8, generator=g)
    with torch.no_grad():
        expected = model(x)
    compiled = torch.compile(model, backend="eager")  # dynamo traces the user's model around our calls
    lp, ent = compiled(x)
    torch.testing.assert_close(lp, expected.log_probs)
    torch.testing.assert_close(ent, expected.entropy)
    (lp.sum() + ent.sum()).backward()
    assert model.body.weight.grad is not None and torch.isfinite(model.body.weight.grad).all()


def test_auto_falls_back_to_eager_once_with_one_warning(monkeypatch):
    monkeypatch.setattr(_kernels, "_auto", {})
    monkeypatch.setattr(_kernels, "AUTO_FAST", ("cpu",))  # "auto" tries its fast kernels on CUDA only: here too

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_kernels.COMPILED, "stats", broken)
    z = torch.randn(4, V)
    labels = torch.randint(0, V, (4,))
    with pytest.warns(RuntimeWarning, match="could not run its compiled kernels") as record:
        a = log_probs_and_entropy(z, labels, chunking=Chunking(backend="auto"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        b = log_probs_and_entropy(z, labels, chunking=Chunking(backend="auto"))
    assert len(record) == 1
    torch.testing.assert_close(a.log_probs, log_probs_and_entropy(z, labels).log_probs)
    torch.testing.assert_close(b.entropy, a.entropy)
    with pytest.raises(ValueError, match="backend"):
        log_probs_and_entropy(z, labels, chunking=Chunking(backend="fast"))


def _tp(rank, world):
    """The collectives stay outside the compiled kernels: TP 2 with both paths compiled."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(5)
    full = torch.randn(6, 2 * 30, generator=g) * 3
    labels = torch.randint(0, 60, (6,), generator=g)
    shard = full[:, rank * 30:(rank + 1) * 30].clone().requires_grad_()
    lp, ent = log_probs_and_entropy(shard, labels, layer=OutputLayer(process_group=group),
                                    chunking=Chunking(4, backend="compile"))
    (lp.sum() + 0.5 * ent.sum()).backward()
    x = full.double().requires_grad_()
    lp_r, ent_r = reference(x, labels)
    (lp_r.sum() + 0.5 * ent_r.sum()).backward()
    torch.testing.assert_close(lp.double(), lp_r.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shard.grad.double(), x.grad[:, rank * 30:(rank + 1) * 30], rtol=1e-5, atol=1e-6)


def test_tensor_parallel_compiled():
    run_distributed(_tp, 2)
