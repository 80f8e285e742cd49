"""The fused policy loss over hidden states in three GEMM passes where its accumulator fits, else four.

Three passes (logits, ``g @ W``, ``g.T @ h``): each chunk's logits formed once over the whole shard, its
gradient from the same block, a half-precision weight's gradient summed chunk by chunk into a float32
``[V_local, H]`` accumulator and rounded once. Four: a statistics pass first, then the gradient pass (the
weight gradient one matmul per vocabulary block). ``Chunking.max_working_bytes`` chooses.

Asserted: which walk a call takes, by the GEMM work it dispatches (the sum of ``m * k * n`` over its matmuls
in units of ``tokens * V * H``, read from a ``TorchDispatchMode``); the three-pass walk's values and every
gradient against float64 and no worse than plain half-precision autograd; the same loss, hidden and bias
gradients as the four-pass walk bit for bit, and its weight gradient within one unit in the last place (each
rounds the float32 sum once); one rounding under a scaled loss; ``main_grad``; every verl objective; TP 2
over gloo; the working memory the plan states.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import chunked_entropy._logit_blocks as blocks
import chunked_entropy.config as config
from chunked_entropy import ChunkedEntropyConfig, Chunking, OutputLayer, PolicyLoss, linear_policy_loss, losses
from chunked_entropy.testing import GpuLog
from tests.helpers import run_distributed

aten = torch.ops.aten
_MATMULS = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.addmm_: (1, 2)}
BIG, SMALL = 1 << 30, 1  # a budget every walk fits, one no accumulator fits


class _GemmWork(TorchDispatchMode):
    """The matmuls' work, ``sum(m * k * n)``; serves ``mm.dtype`` (the CUDA branch's half-precision operands into
    a float32 result) as a GPU computes it, from float32 copies."""

    def __init__(self):
        super().__init__()
        self.work = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = _MATMULS.get(func.overloadpacket)
        if at is not None:
            a, b = args[at[0]], args[at[1]]
            self.work += a.shape[0] * a.shape[1] * b.shape[1]
        if func is aten.mm.dtype:
            a, b = args[0], args[1]
            assert a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype
            return torch.mm(a.float(), b.float())
        return func(*args, **kwargs)


def _data(dtype, *, b=4, t=12, h=64, v=300, seed=0, offset=0.0, scale=1.0):
    """Half-precision-representable inputs (``dtype``), their float64 copies for the references."""
    g = torch.Generator().manual_seed(seed)
    d = dict(hidden=torch.randn(b, t, h, generator=g).to(dtype),
             weight=(torch.randn(v, h, generator=g) * scale / h**0.5).to(dtype),
             bias=(torch.randn(v, generator=g) * 0.5 + offset).to(dtype),
             labels=torch.randint(0, v, (b, t), generator=g),
             adv=torch.randn(b, t, generator=g), ref=-torch.rand(b, t, generator=g) * 3 - 1,
             mask=torch.rand(b, t, generator=g) < 0.8)
    d["old"] = -torch.rand(b, t, generator=g) * 3 - 1
    d["up"] = float(torch.rand((), generator=g)) + 0.5
    return d


def _loss_of(d, leaves, budget, *, chunk=8, loss=None, vocab_chunk_size=None, temperature=1.0, main_grad=None,
             layer=None):
    weight = leaves["weight"]
    if main_grad is not None:
        weight.main_grad = main_grad
    layer = OutputLayer(weight, leaves.get("bias"), **(layer or {}))
    return linear_policy_loss(leaves["hidden"], layer, d["labels"], d["old"], d["adv"], d["mask"],
                              loss=loss or PolicyLoss(entropy_coeff=0.01, kl_coef=0.1), ref_log_probs=d["ref"],
                              temperature=temperature,
                              chunking=Chunking(chunk, vocab_chunk_size, max_working_bytes=budget))[0]


def _run(d, budget, dtype=None, up=None, bias=True, **kw):
    """``(loss, grads of hidden, weight, bias, GEMM passes)`` of one fused call, its loss times ``up``."""
    names = ("hidden", "weight", "bias") if bias else ("hidden", "weight")
    leaves = {k: d[k].to(dtype or d[k].dtype).clone().requires_grad_() for k in names}
    n, (v, h) = d["labels"].numel(), leaves["weight"].shape
    with _GemmWork() as work:
        loss = _loss_of(d, leaves, budget, **kw)
        (loss * (d["up"] if up is None else up)).backward()
    passes = work.work / (n * v * h)
    return (loss.detach(), *(leaves[k].grad for k in names), passes)


def _plain(d, dtype, temperature=1.0):
    """Plain autograd of the fused ops' definition: the model's own layer in ``dtype`` (``F.linear``: the bias
    added before its output's one rounding), the softmax and the loss in float32 (float64 for float64);
    ``(loss, grads)``."""
    leaves = {k: d[k].to(dtype).clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    wide = torch.promote_types(dtype, torch.float32)
    z = torch.nn.functional.linear(leaves["hidden"], leaves["weight"], leaves["bias"]).to(wide)
    logp = torch.log_softmax(z / temperature, -1)
    lp = logp.gather(-1, d["labels"].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    cast = lambda t: t.to(lp.dtype)  # noqa: E731
    pg, _ = losses.policy_loss(lp, cast(d["old"]), cast(d["adv"]), d["mask"])
    kl = losses.agg_loss(losses.kl_penalty(lp, cast(d["ref"]), "low_var_kl"), d["mask"], "token-mean")
    loss = pg - 0.01 * losses.entropy_bonus(ent, d["mask"], "token-mean") + 0.1 * kl
    (loss * d["up"]).backward()
    return loss.detach(), [leaves[k].grad for k in ("hidden", "weight", "bias")]


# ----------------------------------------------------------------------------- which walk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_three_passes_where_the_accumulator_fits_else_four(dtype):
    # v=300, H=64, 8-row chunks, eager, a CPU: the float32 accumulator is 300 * 64 * 4 = 76800 bytes, the
    # chunk's buffers about 30 kB; 50000 bytes hold the buffers but not the accumulator
    d = _data(dtype)
    assert _run(d, BIG)[-1] == 3.0
    assert _run(d, 50_000)[-1] == 4.0
    assert _run(d, 76_800)[-1] == 4.0  # the accumulator alone
    assert _run(d, 120_000)[-1] == 3.0
    # blocks the caller asked for: four, whatever the budget
    assert _run(d, BIG, vocab_chunk_size=128)[-1] == 4.0
    # no weight gradient, main_grad (the call keeps a float32 gradient anyway), float32 weights: no accumulator
    leaves = {"hidden": d["hidden"].clone().requires_grad_(), "weight": d["weight"].clone()}
    with _GemmWork() as work:
        _loss_of(d, leaves, 50_000).backward()
    assert work.work == 2 * d["labels"].numel() * 300 * 64  # logits and g @ W, one pass each
    mg = torch.zeros(300, 64)
    assert _run(d, 50_000, main_grad=mg)[-1] == 3.0
    assert _run(d, 50_000, dtype=torch.float32)[-1] == 3.0


def test_the_forward_default_vocabulary_block_gives_way_to_three_passes(monkeypatch):
    # a float32 [chunk, V] buffer over CHUNK_BUFFER_BYTES blocks the vocabulary by default (a statistics pass
    # then); where the whole shard a chunk fits the budget, the fused loss takes it and three passes
    monkeypatch.setattr(config, "CHUNK_BUFFER_BYTES", 8 * 128 * 4)
    d = _data(torch.bfloat16)
    three, four = _run(d, BIG), _run(d, 50_000)
    assert (three[-1], four[-1]) == (3.0, 4.0)
    for a, b in zip(three[:4], four[:4], strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3)
    for dt in (torch.float32, torch.float64):  # float32 weights: the same, the gradient itself the accumulator
        assert _run(d, BIG, dtype=dt)[-1] == 3.0 and _run(d, SMALL, dtype=dt)[-1] == 4.0


# ----------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["plain", "offset", "confident", "cold"])
def test_three_pass_values_and_gradients_against_float64(dtype, case):
    """Every output (loss; hidden, weight and bias gradients, a random upstream gradient) against float64: no
    worse than plain half-precision autograd (3x its error, as the head's own test holds)."""
    kw = dict(offset=dict(offset=300.0 if dtype == torch.bfloat16 else 30.0), confident=dict(scale=12.0),
              cold={}, plain={})[case]
    temperature = 0.25 if case == "cold" else 1.0
    d = _data(dtype, seed=3, **kw)
    loss, *grads, passes = _run(d, BIG, temperature=temperature)
    assert passes == 3.0
    exact_loss, exact = _plain(d, torch.float64, temperature)
    plain_loss, plain = _plain(d, dtype, temperature)
    assert abs(loss.double() - exact_loss) <= 3 * abs(plain_loss.double() - exact_loss) + 1e-6 * abs(exact_loss)
    for name, m, e, p in zip(("hidden", "weight", "bias"), grads, exact, plain, strict=True):
        assert m.dtype == dtype and torch.isfinite(m).all(), name
        assert torch.isfinite(p).all(), f"plain {dtype} autograd itself overflowed: not a fair case"
        err, err_plain = (m.double() - e).abs().max().item(), (p.double() - e).abs().max().item()
        assert err <= 3 * err_plain + 1e-6 * e.abs().max().item(), (name, err, err_plain)


def test_float32_three_pass_against_float64():
    d = _data(torch.float32, seed=4)
    loss, *grads, passes = _run(d, BIG)
    assert passes == 3.0
    exact_loss, exact = _plain(d, torch.float64)
    torch.testing.assert_close(loss.double(), exact_loss, rtol=1e-5, atol=1e-6)
    for m, e in zip(grads, exact, strict=True):
        torch.testing.assert_close(m.double(), e, rtol=1e-4, atol=1e-6)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most units in the last place of ``a``'s dtype between ``a`` and ``b`` (same dtype)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    ia, ib = a.view(bits).long(), b.view(bits).long()
    ia = torch.where(ia < 0, -(ia & (2 ** (8 * a.element_size() - 1) - 1)), ia)  # sign-magnitude to a line
    ib = torch.where(ib < 0, -(ib & (2 ** (8 * b.element_size() - 1) - 1)), ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layer", [{}, {"softcap": 20.0, "logits_dtype": torch.float32}], ids=["plain", "capped"])
def test_three_and_four_passes_agree(dtype, layer):
    """The same math: the loss, the hidden and the bias gradients bit for bit; the weight gradient (one float32
    sum over 12 chunks against one matmul over every token, each rounded once) within one unit in the last
    place. A walk that rounded each chunk's share (a half-precision matmul per chunk) drifts by several. Also
    with a soft-cap, float32 logits (``logits_dtype``) and a temperature."""
    d = _data(dtype, b=8, t=12, seed=6)  # 96 tokens, 12 chunks
    kw = dict(layer=layer, temperature=0.7) if layer else {}
    three, four = _run(d, BIG, up=1.0, **kw), _run(d, SMALL, up=1.0, **kw)
    assert (three[-1], four[-1]) == (3.0, 4.0)
    for name, a, b in zip(("loss", "hidden", "bias"), (three[0], three[1], three[3]), (four[0], four[1], four[3]),
                          strict=True):
        assert torch.equal(a, b), name
    assert three[2].dtype == dtype and _ulps(three[2], four[2]) <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weight_gradient_is_rounded_once(dtype):
    """Under a scaled loss (``1/3``: gradient accumulation) the weight gradient of the three-pass walk is its
    float32 sum times the scale, rounded once (main_grad receives that float32 sum unrounded)."""
    d = _data(dtype, seed=7)
    mg = torch.zeros(300, 64)
    _run(d, BIG, up=1.0, main_grad=mg)
    third = _run(d, BIG, up=1.0 / 3.0)
    assert third[-1] == 3.0
    upstream = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    assert torch.equal(third[2], (mg * upstream).to(dtype))


def test_main_grad_takes_the_float32_sum():
    """With main_grad the three-pass walk needs no accumulator of its own: the float32 sum is added there (a
    budget that holds no accumulator still takes three passes), the weight gradient without it is that sum
    rounded once."""
    d = _data(torch.bfloat16, seed=8)
    zero, start = torch.zeros(300, 64), torch.full((300, 64), 0.25)
    with_mg = _run(d, 50_000, up=1.0, main_grad=zero)
    _run(d, 50_000, up=1.0, main_grad=start)
    plain = _run(d, BIG, up=1.0)
    assert with_mg[-1] == plain[-1] == 3.0
    assert torch.equal(zero.to(torch.bfloat16), plain[2])
    assert torch.equal(start, torch.full((300, 64), 0.25) + zero)  # added into
    assert torch.equal(with_mg[1], plain[1]) and torch.equal(with_mg[0], plain[0])


@pytest.mark.parametrize("mode", losses.LOSS_MODES)
def test_every_objective_takes_the_walk(mode):
    """verl's twelve objectives: token-local, row-local (rows of 12 in 8-row chunks: walked in groups) and
    batch-level ones through the three-pass walk's chunk order; the same results as the four-pass walk."""
    opts = dict(clip_ratio_low=0.15, clip_ratio_high=0.28, dro_beta=0.2, clip_cov_ratio=0.3, clip_cov_lb=-5.0,
                clip_cov_ub=5.0, kl_cov_ratio=0.2)
    d = _data(torch.bfloat16, seed=9)
    loss = PolicyLoss(mode, opts, entropy_coeff=0.02)
    torch.manual_seed(0)
    three = _run(d, BIG, up=1.0, loss=loss)
    torch.manual_seed(0)
    four = _run(d, SMALL, up=1.0, loss=loss)
    # token-local: one chunk a group; row-local: rows of 12 in chunks of 6, two a group; batch-level: the
    # whole batch one group of 6 chunks: a group of g chunks fills 2g - 1 (3 + (g - 1) / g passes)
    g = 1 if mode in losses.TOKEN_LOCAL_MODES else (2 if losses.row_local(mode, **opts) else 6)
    assert four[-1] == 4.0 and three[-1] == 3 + (g - 1) / g, three[-1]
    assert torch.equal(three[0], four[0])
    for a, b in zip(three[1:4], four[1:4], strict=True):
        assert _ulps(a, b) <= 1


# ----------------------------------------------------------------------------- tensor parallel


def _tp(rank, world):
    d = _data(torch.bfloat16, seed=10, v=2 * 150)
    v_local = 150
    shard = dict(d, weight=d["weight"][rank * v_local:(rank + 1) * v_local],
                 bias=d["bias"][rank * v_local:(rank + 1) * v_local])
    results = {}
    t = d["labels"].shape[1] // world
    for sp in (False, True):  # sequence parallel: hidden is this rank's [T/P, B, H] slice
        hidden = d["hidden"].transpose(0, 1)[rank * t:(rank + 1) * t].contiguous() if sp else d["hidden"]
        for name, budget in (("three", BIG), ("four", SMALL)):
            leaves = {"hidden": hidden.clone().requires_grad_(),
                      **{k: shard[k].clone().requires_grad_() for k in ("weight", "bias")}}
            with _GemmWork() as work:
                layer = OutputLayer(leaves["weight"], leaves["bias"], process_group=dist.group.WORLD,
                                    sequence_parallel=sp)
                loss = linear_policy_loss(leaves["hidden"], layer, d["labels"], d["old"], d["adv"], d["mask"],
                                          loss=PolicyLoss(entropy_coeff=0.01, kl_coef=0.1), ref_log_probs=d["ref"],
                                          chunking=Chunking(8, max_working_bytes=budget))[0]
                (loss * d["up"]).backward()
            results[name, sp] = (loss.detach(), leaves["hidden"].grad, leaves["weight"].grad, leaves["bias"].grad,
                                 work.work / (d["labels"].numel() * v_local * 64))
        three, four = results["three", sp], results["four", sp]
        assert (three[-1], four[-1]) == (3.0, 4.0)
        assert torch.equal(three[0], four[0]) and torch.equal(three[1], four[1]) and torch.equal(three[3], four[3])
        assert _ulps(three[2], four[2]) <= 1
    sp_three = results["three", True]
    three = results["three", False]
    assert torch.equal(sp_three[1], three[1].transpose(0, 1)[rank * t:(rank + 1) * t])
    assert torch.equal(sp_three[0], three[0]) and torch.equal(sp_three[2], three[2])
    exact_loss, exact = _plain(d, torch.float64)
    _, plain = _plain(d, torch.bfloat16)
    rows = slice(rank * v_local, (rank + 1) * v_local)
    torch.testing.assert_close(three[0].double(), exact_loss, rtol=2e-2, atol=1e-3)
    # the hidden gradient: each rank's share rounded to bf16, then summed over the group in bf16, as a
    # tensor-parallel model's own backward forms it (both walks alike): up to three roundings of 2**-9
    for name, m, e, p in zip(("hidden", "weight", "bias"), three[1:4], exact, plain, strict=True):
        e, p = (e[rows], p[rows]) if name != "hidden" else (e, p)
        err, err_plain = (m.double() - e).abs().max().item(), (p.double() - e).abs().max().item()
        slack = (3 * 2**-9 if name == "hidden" else 1e-6) * e.abs().max().item()
        assert err <= 3 * err_plain + slack, (rank, name, err, err_plain)


def test_tensor_parallel_two_ranks():
    run_distributed(_tp, 2)


# ----------------------------------------------------------------------------- the setting and the plan


def test_the_budget_is_a_setting_of_chunking():
    with pytest.warns(DeprecationWarning, match="ChunkedEntropyConfig is deprecated"):  # and has the field until 0.3.0
        assert Chunking().max_working_bytes == 1 << 30 == ChunkedEntropyConfig().max_working_bytes
    assert Chunking(512).max_working_bytes == 1 << 30  # old calls keep working
    assert Chunking().fingerprint()["max_working_bytes"] == 1 << 30  # the ranks of a group agree on it
    for bad in (0, -1, 1.5, "1GiB", None):
        with pytest.raises(ValueError, match=r"Chunking\.max_working_bytes must be an int >= 1"):
            Chunking(max_working_bytes=bad)
    cfg = {"chunked_entropy": {"chunk_size": 256, "max_working_bytes": 2**28}}
    assert Chunking.from_config(cfg).max_working_bytes == 2**28


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_plan_states_the_working_memory_the_walk_allocates(dtype):
    """The forward (where the fused loss forms every gradient) on the CPU, eager: what it allocates beyond its
    gradients (the hidden states' and the bias's; the weight's float32 accumulator counts, the weight's
    gradient in its dtype comes in backward) within 5% of the plan's figure for the three-pass walk."""
    b, t, h, v, chunk = 2, 32, 64, 2048, 16
    d = _data(dtype, b=b, t=t, h=h, v=v, seed=11)
    leaves = {k: d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    with GpuLog() as log:
        _loss_of(d, leaves, BIG, chunk=chunk)
    n = b * t
    grads = n * h * d["hidden"].element_size() + v * 4 + (0 if dtype != torch.float32 else v * h * 4)
    per_token = n * 256  # a few float32 and int64 vectors a token (statistics, ids, masks, the loss's inputs)
    measured = log.peak_bytes() - grads
    planned = config.three_pass_bytes(chunk, v, h, d["weight"].element_size(), accumulator=dtype != torch.float32,
                                      buffers=2, native=False)
    # 5%: a chunk's rounded gradient kept alive into the next chunk's (an extra [chunk, V] half block) is over
    assert abs(measured - planned) <= 0.05 * planned + per_token, (measured, planned)


def test_plan_shows_both_walks(capsys):
    from chunked_entropy.cli import main

    assert main(["plan", "--tokens", "8192", "--vocab", "151936", "--hidden", "4096", "--dtype", "bfloat16",
                 "--tp", "8", "--chunk-sizes", "1024"]) == 0
    out = capsys.readouterr().out
    assert "fused loss, chunk 1024, 3 GEMM passes" in out and "fused loss, chunk 1024, 4 GEMM passes" in out
    assert "linear_policy_loss at chunk 1024 takes 3 GEMM passes" in out
    assert "a float32 weight-gradient accumulator of 296.8 MiB, fits max_working_bytes=1.00 GiB" in out  # 0.29 GiB
    assert main(["plan", "--tokens", "8192", "--vocab", "151936", "--hidden", "4096", "--dtype", "bfloat16",
                 "--chunk-sizes", "1024"]) == 0
    assert "linear_policy_loss at chunk 1024 takes 4 GEMM passes" in capsys.readouterr().out  # 2.3 GiB at TP 1
    assert main(["plan", "--tokens", "8192", "--vocab", "151936", "--hidden", "4096", "--dtype", "bfloat16",
                 "--tp", "8", "--chunk-sizes", "1024", "--max-working-bytes", "256MiB"]) == 0
    assert "linear_policy_loss at chunk 1024 takes 4 GEMM passes" in capsys.readouterr().out


def test_the_plan_takes_the_walk_a_call_takes(monkeypatch):
    """The plan's rule is the call's: for shapes either side of the budget, its passes are those the call
    dispatches (a CPU, eager: two float32 chunk buffers)."""
    from chunked_entropy.cli.plan import Shape, loss_walk

    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")):
        d = _data(dtype)  # 48 tokens, V 300, H 64, chunks of 8
        shape = Shape(48, 300, 64, dtype=name, bias=True, device="cpu")
        for budget in (20_000, 50_000, 76_800, 110_000, BIG):
            assert loss_walk(shape, 8, budget) == _run(d, budget)[-1], (name, budget)
    monkeypatch.setattr(config, "CHUNK_BUFFER_BYTES", 8 * 128 * 4)  # float32: blocked by default now
    d = _data(torch.float32)
    shape = Shape(48, 300, 64, dtype="float32", bias=True, device="cpu")
    for budget in (20_000, BIG):
        assert loss_walk(shape, 8, budget) == _run(d, budget)[-1], budget


def test_cuda_branch_weight_gradient_in_bounded_slices(monkeypatch):
    """On CUDA a chunk's weight-gradient share is a half-precision matmul into float32 (``out_dtype``) in row
    slices of at most GRAD_BUFFER_BYTES, added into the accumulator: the same sums as the CPU branch, bit for
    bit, and no float32 temporary of the accumulator's size."""
    d = _data(torch.bfloat16, seed=12)
    monkeypatch.setattr(blocks, "GRAD_BUFFER_BYTES", 64 * 4 * 100)  # slices of 100 rows of H = 64
    cpu = _run(d, BIG)
    monkeypatch.setattr(blocks, "half_mm_native", lambda device: True)
    shapes = []

    class Log(_GemmWork):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten.mm.dtype:
                shapes.append(tuple(args[0].shape))
            return super().__torch_dispatch__(func, types, args, kwargs)

    leaves = {k: d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    with Log():
        (_loss_of(d, leaves, BIG) * d["up"]).backward()
    wgrad = [s for s in shapes if s[1] == 8]  # [rows, chunk] slices of g.T
    assert wgrad and max(s[0] for s in wgrad) == 100, shapes
    for a, b in zip(cpu[1:4], (leaves["hidden"].grad, leaves["weight"].grad, leaves["bias"].grad), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- the divergence's loss form


def _divergence_run(d, budget, kind, up=1.0):
    from chunked_entropy import Divergence, linear_divergence_loss

    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    n, (v, hd) = d["labels"].numel(), w.shape
    div = Divergence("jsd", 0.4) if kind == "jsd" else Divergence(kind)
    with _GemmWork() as work:
        out = linear_divergence_loss(h, w, d["teacher_hidden"], d["teacher_weight"], divergence=div,
                                     chunking=Chunking(8, max_working_bytes=budget))
        (out.loss * up).backward()
    return out.loss.detach(), h.grad, w.grad, work.work / (n * v * hd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
def test_divergence_loss_takes_the_walk_where_its_accumulator_fits(dtype, kind):
    """linear_divergence_loss with a half-precision student: its loss walk (the student's and the teacher's
    projections, ``g @ W``, ``g.T @ h``: four) where the float32 accumulator fits, else the statistics walk
    and the gradient walk (six); the same loss bit for bit, the gradients within one unit in the last place,
    and against float64 no worse than plain half-precision autograd."""
    d = _data(dtype, seed=13)
    g = torch.Generator().manual_seed(14)
    d["teacher_hidden"] = torch.randn(d["hidden"].shape, generator=g).to(dtype)
    d["teacher_weight"] = (torch.randn(d["weight"].shape, generator=g) / 8).to(dtype)
    four, six = _divergence_run(d, BIG, kind), _divergence_run(d, SMALL, kind)
    assert (four[-1], six[-1]) == (4.0, 6.0)
    # the budget check counts both heads' buffers and the divergence's temporaries (3 for a KL, 6 for the JSD;
    # test_the_divergence_walk_stays_within_what_its_budget_counts measures them)
    counted = config.three_pass_bytes(8, 300, 64, 2, accumulator=True, buffers=4 + (3 if kind == "reverse_kl" else 6),
                                      native=False)
    assert _divergence_run(d, counted, kind)[-1] == 4.0 and _divergence_run(d, counted - 1, kind)[-1] == 6.0
    # the loss bit for bit; the gradients to the rounding of their largest entry: the held blocks' logit
    # gradient reuses the terms of the divergence's sums (grad_from_parts), the refilled ones' forms them again,
    # so a logit gradient may differ by an ulp before it is rounded for the matmuls
    assert torch.equal(four[0], six[0])
    for a, b in zip(four[1:3], six[1:3], strict=True):
        assert (a.double() - b.double()).abs().max() <= 2**-10 * b.double().abs().max()
    if kind != "reverse_kl":
        return

    def plain(dt):  # mean over tokens of KL(student || teacher), the logits rounded as the layers round them
        h, w = d["hidden"].to(dt).clone().requires_grad_(), d["weight"].to(dt).clone().requires_grad_()
        wide = torch.promote_types(dt, torch.float32)
        ls = torch.log_softmax((h @ w.t()).to(wide), -1)
        lt = torch.log_softmax((d["teacher_hidden"].to(dt) @ d["teacher_weight"].to(dt).t()).to(wide), -1)
        (ls.exp() * (ls - lt)).sum(-1).mean().backward()
        return h.grad.double(), w.grad.double()

    exact, theirs = plain(torch.float64), plain(dtype)
    for name, m, e, t in zip(("hidden", "weight"), four[1:3], exact, theirs, strict=True):
        err, err_plain = (m.double() - e).abs().max().item(), (t - e).abs().max().item()
        assert err <= 3 * err_plain + 1e-6 * e.abs().max().item(), (name, err, err_plain)


@pytest.mark.parametrize("branch", ["float32", "float32_logits", "cpu", "cpu_half_gradient", "cuda"])
def test_a_chunks_weight_share_is_summed_in_float32(branch, monkeypatch):
    """``_acc_weight_mm_``, each branch: ``acc += gq.T @ h`` with the products of half-precision values summed
    in float32 (never a half-precision result): the float64 sum to float32 rounding, where a bf16 result
    would be off by up to 2**-9."""
    g = torch.Generator().manual_seed(15)
    rows, v, hd = 8, 300, 64
    g32 = torch.randn(rows, v, generator=g)
    h = torch.randn(rows, hd, generator=g).to(torch.bfloat16)
    acc0 = torch.randn(v, hd, generator=g)
    gq = g32 if branch.startswith("float32") else g32.to(torch.bfloat16)
    if branch == "float32":
        h = h.float()
    grad = gq if branch == "cpu_half_gradient" else g32.clone()
    if branch == "cuda":
        monkeypatch.setattr(blocks, "half_mm_native", lambda device: True)
        monkeypatch.setattr(blocks, "GRAD_BUFFER_BYTES", 4 * hd * 128)  # slices of 128 rows
    acc = acc0.clone()
    with _GemmWork():
        blocks._acc_weight_mm_(acc, grad, gq, h)
    want = acc0.double() + gq.double().t() @ h.double()
    torch.testing.assert_close(acc.double(), want, rtol=1e-6, atol=1e-5)
    if branch == "cpu":  # the walk's own float32 buffer holds the rounded gradient now: no new one
        assert torch.equal(grad, gq.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
def test_the_divergence_walk_stays_within_what_its_budget_counts(dtype, kind):
    """linear_divergence_loss's walk with the accumulator, forward measured on the CPU (eager): what it
    allocates beyond its gradients is at most the bytes its budget check counts (the student's and the
    teacher's buffers and the divergence's temporaries: 3 for a KL, 6 for the JSD), and not far below."""
    from chunked_entropy import Divergence, linear_divergence_loss

    n, h, v, chunk = 64, 64, 2048, 16
    g = torch.Generator().manual_seed(16)
    hs, ht = (torch.randn(n, h, generator=g).to(dtype) for _ in range(2))
    ws, wt = ((torch.randn(v, h, generator=g) / 8).to(dtype) for _ in range(2))
    hs.requires_grad_()
    ws.requires_grad_()
    with GpuLog() as log:
        linear_divergence_loss(hs, ws, ht, wt, divergence=Divergence("jsd", 0.4) if kind == "jsd" else kind,
                               chunking=Chunking(chunk))
    grads = n * h * hs.element_size() + (v * h * 4 if dtype == torch.float32 else 0)
    measured = log.peak_bytes() - grads
    counted = config.three_pass_bytes(chunk, v, h, ws.element_size(), accumulator=dtype != torch.float32,
                                      buffers=4 + (3 if kind == "reverse_kl" else 6), native=False)
    assert 0.8 * counted <= measured <= counted + n * 256, (measured, counted)
