"""verl 0.9.1's FSDP engine, every route, through the plugin: against verl's own code in verl's real engine.

verl's ``FSDPEngineWithLMHead`` is built with ``initialize()`` (FSDP2 over gloo,
float32) from a tiny random-weight Qwen2 saved locally, tied and untied
lm_head, and driven through its own ``forward_step`` / ``train_batch`` with
micro-batches that verl's own ``left_right_2_no_padding`` lays out. The
reference is verl's own unfused route (the plugin uninstalled) on the same
model and batch. The two shims that let verl's engine run on a CPU are in
``tests/verl_fsdp_env.py``, each with its reason. Each test runs in spawned
gloo processes (verl's engine sets process-wide state).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings

import pytest
import torch

from tests.helpers import require, run_distributed

require("verl", "transformers", "tensordict")

KEYS = ("log_probs", "entropy", "sum_pi_squared")
DISTILL = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")
TOL = dict(rtol=2e-4, atol=2e-5)  # float32 rounding of a tiny model's forward and backward, two summation orders


def _plugin(on: bool):
    from chunked_entropy.integrations import verl as ce_verl

    (ce_verl.install if on else ce_verl.uninstall)()
    return ce_verl


def _upstream(model_output, seed):
    """Random upstream gradients on every differentiable output (fixed by key and length); none on the log-prob
    of a sequence's last token, whose label is the next sequence's first (verl's losses never read it)."""
    total = 0
    for i, k in enumerate(sorted(model_output)):
        if k not in KEYS + ("distillation_losses",):
            continue
        v = model_output[k].values()
        up = torch.randn(v.shape, generator=torch.Generator().manual_seed(seed + i))
        if k == "log_probs":
            up[model_output[k].offsets()[1:] - 1] = 0
        total = total + (v * up).sum()
    return total


def _run(engine, td, loss_function=None, seed=0):
    """verl's forward_step and backward: (outputs' values, every parameter's full gradient, loss)."""
    if loss_function is None:
        def loss_function(model_output, data, dp_group):  # noqa: ARG001 - verl's loss signature
            return _upstream(model_output, seed), {}
    from tests import verl_fsdp_env as env

    env.activate(engine)
    engine.optimizer_zero_grad()
    loss, out = engine.forward_step(td, loss_function=loss_function, forward_only=False)
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    engine.optimizer_zero_grad()
    values = {k: v.values().clone() for k, v in out["model_output"].items()}
    return values, grads, out["loss"]


def _close(ours, theirs, what, keep=None):
    vo, go, lo = ours
    vt, gt, lt = theirs
    assert set(vo) == set(vt), (what, set(vo), set(vt))
    for k in vt:
        a, b = vo[k], vt[k]
        if keep is not None and k == "log_probs":
            a, b = a[keep], b[keep]
        torch.testing.assert_close(a.double(), b.double(), **TOL, msg=lambda m, k=k: f"{what}: {k}: {m}")
    assert set(go) == set(gt) and go, what
    for n in gt:  # a parameter's gradient sums over every token: its rounding scales with its largest entry
        torch.testing.assert_close(go[n], gt[n], rtol=TOL["rtol"], atol=1e-4 * float(gt[n].abs().max()),
                                   msg=lambda m, n=n: f"{what}: grad of {n}: {m}")
    torch.testing.assert_close(lo, lt, **TOL)


@contextlib.contextmanager
def _all_rows():
    """The fused route projects every row (``CHUNKED_ENTROPY_VERL_ROWS=0``): for comparisons of every row's value
    and of random upstream gradients on every row, against verl's own unfused route."""
    from chunked_entropy.integrations.verl.megatron_fused import ROWS_ENV

    saved = os.environ.get(ROWS_ENV)
    os.environ[ROWS_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ROWS_ENV)
        else:
            os.environ[ROWS_ENV] = saved


def _rows_on_off(engine, td, what):
    """The fused route with the rows verl reads (the default) against every row: verl's own losses (policy loss,
    entropy bonus, top-k distillation), every value verl reads (the response positions) and every parameter's
    gradient equal; the rows not read are zero (not projected)."""
    from verl.workers.utils.padding import no_padding_2_padding

    from chunked_entropy.integrations.verl.megatron_fused import read_rows
    from tests import verl_fsdp_env as env

    with _all_rows():
        (v_all, g_all, l_all) = _run(engine, td(), env.losses())
    v_on, g_on, l_on = _run(engine, td(), env.losses())
    data = td()
    ids = data["input_ids"]
    read = read_rows(data, ids).values()
    assert 0 < int(read.sum()) < read.numel(), what
    assert set(v_on) == set(v_all), what
    for k in v_all:
        if v_all[k].shape[:1] != read.shape:
            continue
        on, off = (no_padding_2_padding(torch.nested.nested_tensor_from_jagged(v[k], offsets=ids.offsets()), data)
                   for v in (v_on, v_all))
        torch.testing.assert_close(on, off, **TOL, msg=lambda m, k=k: f"{what}: {k}: {m}")
    assert (v_on["log_probs"][~read] == 0).all() and (v_all["log_probs"][~read] != 0).all(), what
    assert set(g_on) == set(g_all) and g_all, what
    for n in g_all:
        torch.testing.assert_close(g_on[n], g_all[n], rtol=TOL["rtol"], atol=1e-4 * float(g_all[n].abs().max()),
                                   msg=lambda m, n=n: f"{what}: grad of {n}: {m}")
    torch.testing.assert_close(l_on, l_all, **TOL)


def _not_last(td):
    """Every token but each sequence's last (whose label verl's fused padded route takes from its own row)."""
    lengths = td["input_ids"].offsets().diff()
    keep = torch.ones(int(lengths.sum()), dtype=torch.bool)
    keep[td["input_ids"].offsets()[1:] - 1] = False
    return keep


# ----------------------------------------------------------------------------- every route vs verl's unfused


def _routes(rank, world, tie):
    from tests import verl_fsdp_env as env

    path = env.tiny_model_dir(tie=tie) if rank == 0 else None
    path = _shared(path)
    seed = 11 + rank  # each data-parallel rank its own data
    ce_verl = _plugin(False)
    unfused = env.build_engine(path)
    ref = {}
    for rm in (True, False):
        td = functools.partial(env.ppo_batch, seed, remove_padding=rm, sum_pi_squared=True, distill=False)
        ref[rm] = _run(unfused, td())
        ref[rm, "distill"] = _run(unfused, env.ppo_batch(seed, remove_padding=rm), env.losses())
        assert set(ref[rm][0]) == set(KEYS) and set(ref[rm, "distill"][0]) == {"log_probs", "entropy", *DISTILL}
        ref[rm, "t1"] = _run(unfused, td(temperature=1.0))
    ce_verl.install()
    for rm in (True, False):
        td = functools.partial(env.ppo_batch, seed, remove_padding=rm, sum_pi_squared=True, distill=False)
        _close(_run(unfused, td()), ref[rm], f"unfused rm={rm}")
        _close(_run(unfused, env.ppo_batch(seed, remove_padding=rm), env.losses()), ref[rm, "distill"],
               f"unfused distill rm={rm}")
        _close(_run(unfused, td(temperature=1.0)), ref[rm, "t1"], f"unfused t=1 rm={rm}")
    fused = env.build_engine(path, fused=True)
    for rm in (True, False):
        td = functools.partial(env.ppo_batch, seed, remove_padding=rm, fused=True, sum_pi_squared=True, distill=False)
        keep = None if rm else _not_last(td())
        with _all_rows():
            _close(_run(fused, td()), ref[rm], f"fused rm={rm}", keep)
            _close(_run(fused, td(temperature=1.0)), ref[rm, "t1"], f"fused t=1 rm={rm}", keep)
            _close(_run(fused, env.ppo_batch(seed, remove_padding=rm, fused=True), env.losses()),
                   ref[rm, "distill"], f"fused distill rm={rm}", keep)
        _rows_on_off(fused, functools.partial(env.ppo_batch, seed, remove_padding=rm, fused=True, sum_pi_squared=True),
                     f"fused rows rm={rm}")
    if world == 1:  # distillation only (verl's keys, no log-probs), against verl's own unfused route
        only = functools.partial(env.ppo_batch, seed, distillation_only=True)
        ce_verl.uninstall()
        theirs = _run(unfused, only(), env.losses(task_rewards=False))
        assert "log_probs" not in theirs[0] and "distillation_losses" in theirs[0]
        ce_verl.install()
        _close(_run(unfused, only(), env.losses(task_rewards=False)), theirs, "unfused distillation only")
        with _all_rows():
            _close(_run(fused, only(fused=True), env.losses(task_rewards=False)), theirs, "fused distillation only")
    if tie and world == 1:  # verl's Liger and Triton backends: served by the plugin (verl's own need CUDA)
        for backend in ("liger", "triton"):
            engine = env.build_engine(path, fused=True, backend=backend)
            with _all_rows():
                _close(_run(engine, env.ppo_batch(seed, fused=True), env.losses()), ref[True, "distill"], backend)
        _triton_elsewhere()
    if not tie:  # verl's own fused route cannot read an FSDP2-sharded untied lm_head
        ce_verl.uninstall()
        with pytest.raises(Exception, match="DTensor"):
            _run(fused, env.ppo_batch(seed, fused=True, temperature=1.0, distill=False))


def _bf16(rank, world):
    """verl's default mixed precision (bf16 parameters under autocast): the plugin's unfused and fused routes
    (float32 outputs) are no farther from the float32 engine's outputs than verl's own bf16 route is."""
    from tests import verl_fsdp_env as env

    path = _shared(env.tiny_model_dir(tie=True) if rank == 0 else None)
    ce_verl = _plugin(False)
    exact = _run(env.build_engine(path), env.ppo_batch(6), env.losses())[0]
    half = env.build_engine(path, dtype="bf16")
    assert half._autocast_dtype == torch.bfloat16
    theirs = _run(half, env.ppo_batch(6), env.losses())[0]
    ce_verl.install()
    fused = env.build_engine(path, fused=True, dtype="bf16")
    with _all_rows():
        fused_all = _run(fused, env.ppo_batch(6, fused=True), env.losses())[0]
    for name, ours in (("unfused", _run(half, env.ppo_batch(6), env.losses())[0]), ("fused", fused_all)):
        assert set(ours) == set(theirs), name
        for k in ("log_probs", "entropy", "distillation_losses", "student_mass"):
            assert ours[k].dtype == torch.float32, (name, k, ours[k].dtype)
            err = lambda o, k=k: float((o[k].double() - exact[k].double()).abs().sum())  # noqa: E731
            assert err(ours) <= 1.05 * err(theirs) + 1e-6, (name, k, err(ours), err(theirs))


def _ulysses(rank, world):
    """Ulysses sequence parallelism over both ranks (sp 2, one data-parallel group): the plugin's unfused and
    fused routes against verl's own unfused route, each rank holding half the packed sequence (verl's own split
    of the labels, temperatures and the teacher's top-k; sdpa attends within each half on a CPU, the same for
    every route)."""
    from tests import verl_fsdp_env as env

    path = _shared(env.tiny_model_dir(tie=False) if rank == 0 else None)
    ce_verl = _plugin(False)
    unfused = env.build_engine(path, sp=world)
    assert unfused.use_ulysses_sp
    ref = _run(unfused, env.ppo_batch(4, sum_pi_squared=True, distill=False))
    ref_d = _run(unfused, env.ppo_batch(4), env.losses())
    ce_verl.install()
    _close(_run(unfused, env.ppo_batch(4, sum_pi_squared=True, distill=False)), ref, "ulysses unfused")
    _close(_run(unfused, env.ppo_batch(4), env.losses()), ref_d, "ulysses unfused distill")
    fused = env.build_engine(path, fused=True, sp=world)
    with _all_rows():
        _close(_run(fused, env.ppo_batch(4, fused=True, sum_pi_squared=True, distill=False)), ref, "ulysses fused")
        _close(_run(fused, env.ppo_batch(4, fused=True), env.losses()), ref_d, "ulysses fused distill")
    _rows_on_off(fused, functools.partial(env.ppo_batch, 4, fused=True, sum_pi_squared=True), "ulysses fused rows")


def _triton_elsewhere():
    """Outside verl's FSDP engine (verl's Megatron fused forward imports the same function) verl's own Triton
    kernel runs: on a CPU it fails as it does without the plugin."""
    from verl.utils.kernel import linear_cross_entropy as module

    h, w, y = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8), torch.randint(0, 16, (4,))
    errors = []
    for on in (False, True):
        _plugin(on)
        with pytest.raises(Exception) as e:
            module.linear_cross_entropy(h, w, y, 1.0, "none")
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1], errors


def _shared(path):
    """Rank 0's model folder, on every rank."""
    import torch.distributed as dist

    box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------- a vocabulary-sharded DTensor


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """The widest last dim of any plain tensor an op makes with ``rows`` or more rows (a DTensor's own shape is
    its global one, whatever each rank holds: not counted)."""

    def __init__(self, rows):
        super().__init__()
        self.rows, self.widest = rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and not t.is_nested and t.dim() >= 2 \
                    and t.shape[:-1].numel() >= self.rows:
                self.widest = max(self.widest, t.shape[-1])
        return out


def _sharded(rank, world):
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests import verl_fsdp_env as env

    path = _shared(env.tiny_model_dir(tie=False) if rank == 0 else None)
    ce_verl = _plugin(False)
    engine = env.build_engine(path, chunk=5)
    vocab, hidden = 96, 16
    torch.manual_seed(3)  # the same head and hidden states on both ranks (tensor parallelism)
    full = torch.nn.Linear(hidden, vocab, bias=False)
    full.weight.data.mul_(4)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    head.weight.data.copy_(full.weight.data)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    for rm in (True, False):
        results = {}
        for name, plugged, layer in (("verl", False, full), ("ours", True, head), ("verl-sharded", False, head)):
            (ce_verl.install if plugged else ce_verl.uninstall)()
            td = env.ppo_batch(5, remove_padding=rm, sum_pi_squared=True)
            model_inputs, output_args = engine.prepare_model_inputs(td)
            n = model_inputs["input_ids"].numel()
            h = torch.randn(*model_inputs["input_ids"].shape, hidden, generator=torch.Generator().manual_seed(9),
                            requires_grad=True)
            layer.weight.grad = None
            shapes = _Shapes(n)
            with shapes:
                logits = layer(h)
                assert name == "verl" or type(logits).__name__ == "DTensor"
                out = engine.prepare_model_outputs(SimpleNamespace(logits=logits), output_args, td, env.losses())
                _upstream(out, 1).backward()
            wg = layer.weight.grad
            wg = wg.full_tensor() if hasattr(wg, "full_tensor") else wg
            results[name] = ({k: v.values().detach() for k, v in out.items()}, h.grad, wg, shapes.widest)
        ours, theirs = results["ours"], results["verl"]
        assert set(ours[0]) == set(theirs[0]) == {*KEYS, *DISTILL}
        for k in theirs[0]:
            torch.testing.assert_close(ours[0][k].double(), theirs[0][k].double(), **TOL, msg=k)
        torch.testing.assert_close(ours[1], theirs[1], **TOL)
        torch.testing.assert_close(ours[2], theirs[2], **TOL)
        # no op of ours makes a tensor over the full vocabulary; verl's own gathers it on every rank
        assert ours[3] <= vocab // world, ours[3]
        assert results["verl-sharded"][3] == vocab


# ----------------------------------------------------------------------------- real training steps


def _same_steps(ours, theirs, name):
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert set(a) == set(b), (name, step, set(a) ^ set(b))
        for k in b:
            torch.testing.assert_close(torch.tensor(a[k], dtype=torch.float64), torch.tensor(b[k], dtype=torch.float64),
                                       rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=k, step=step: f"{name} step {step} {k}: {m}")


def _number(v):
    """A metric as numbers: verl's Metric objects (one value per micro-batch), lists of them, or plain values."""
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _number(item)]
    values = getattr(v, "values", None)
    if isinstance(values, list):
        return [float(x) for x in values]
    return [float(v)]


def _steps(env, path, fused, plugged, **batch):
    """Three train_batch steps of a fresh engine: each step's metrics (as numbers) and loss."""
    _plugin(plugged)
    engine = env.build_engine(path, fused=fused)
    env.activate(engine)
    steps = []
    loss_function = env.losses() if batch.get("distill", True) else env.ppo_losses()
    for step in range(3):
        out = engine.train_batch(env.ppo_batch(20 + step, fused=fused, train=True, **batch), loss_function)
        steps.append({k: _number(v) for k, v in out["metrics"].items()})
        steps[-1]["loss"] = out["loss"]
    return steps


def _train(rank, world):
    from tests import verl_fsdp_env as env

    # verl's own fused route (tied head, scalar temperature, no distillation: all it can serve), with and without
    # the plugin
    tied = _shared(env.tiny_model_dir(tie=True) if rank == 0 else None)
    fused_own = _steps(env, tied, True, False, temperature=1.0, distill=False)
    fused_ours = _steps(env, tied, True, True, temperature=1.0, distill=False)
    _same_steps(fused_ours, fused_own, "fused, tied, no distillation")
    assert "actor/entropy_loss" in fused_own[0] and "grad_norm" in fused_own[0], sorted(fused_own[0])

    path = _shared(env.tiny_model_dir(tie=False) if rank == 0 else None)
    history = {}
    for name, fused, plugged in (("verl", False, False), ("unfused", False, True), ("fused", True, True)):
        _plugin(plugged)
        engine = env.build_engine(path, fused=fused)
        steps = []
        for step in range(3):
            td = env.ppo_batch(20 + step, fused=fused, train=True)
            out = engine.train_batch(td, loss_function=env.losses())
            steps.append({k: _number(v) for k, v in out["metrics"].items()})
            steps[-1]["loss"] = out["loss"]
        history[name] = steps
    for name in ("unfused", "fused"):
        _same_steps(history[name], history["verl"], name)
    for k in ("grad_norm", "distillation/loss", "actor/pg_loss", "actor/entropy_loss", "distillation/student_mass"):
        assert k in history["verl"][0], (k, sorted(history["verl"][0]))
    assert history["verl"][0]["loss"] != history["verl"][2]["loss"]  # the steps train


# ----------------------------------------------------------------------------- fallback and bad input


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _fallback(rank, world):
    from tests import verl_fsdp_env as env

    path = env.tiny_model_dir(tie=True)
    _plugin(True)
    engine = env.build_engine(path)
    records = _Records()
    logging.getLogger("chunked_entropy.integrations").addHandler(records)
    verls = env.losses()

    def other(**kw):  # a distillation function that is not verl's partial: verl's own code serves it
        return verls(**kw)

    for _ in range(2):
        _run(engine, env.ppo_batch(3), other)
    assert len([m for m in records.messages if "verl's own FSDP output layer" in m]) == 1, records.messages
    assert "distillation_ppo_loss" in records.messages[-1]
    for bad, what in ((float("nan"), "finite"), (-0.5, "> 0"), (float("inf"), "finite"), (0.0, "> 0")):
        with pytest.raises(ValueError, match=r'micro_batch\["temperature"\] must be'):
            _run(engine, env.ppo_batch(3, temperature=bad, distill=False))
        with pytest.raises(ValueError, match=f"sample 2 has .*{'nan' if bad != bad else ''}"):
            _run(engine, env.ppo_batch(3, temperature=(0.7, 1.0, bad, 1.0), distill=False))
        assert what


# ----------------------------------------------------------------------------- the tests: a few processes, many checks


def _parts(rank, world, parts):
    """Several checks in one spawned process (importing verl and building its engine is most of a check's time)."""
    for name, args in parts:
        globals()[name](rank, world, *args)


def test_tied_head_every_route_and_fallback():
    """Tied lm_head, world size 1. Every route through the plugin (unfused with padding removed and kept, fused
    with verl's torch backend) against verl's own unfused route: log-probs, entropy, sum_pi_squared, every
    distillation key and every parameter's gradient, per-sample temperatures and the scalar 1. What the plugin
    cannot serve (a distillation function other than verl's) runs verl's own code with one warning naming why;
    NaN, infinite, zero or negative temperatures raise a clear ValueError before any work. Under verl's default
    mixed precision (bf16), the plugin's outputs are float32 and no farther from the float32 engine's than verl's
    own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_distributed(_parts, 1, (("_fallback", ()), ("_routes", (True,)), ("_bf16", ())), timeout_s=300)


def test_untied_head_every_route_and_three_train_steps():
    """Untied lm_head, world size 1: every route as above (verl's own fused route fails on the FSDP2-sharded
    head, ours runs); then three train_batch steps (verl's policy loss, entropy bonus and top-k distillation,
    AdamW, grad clipping) from the same weights: unfused and fused with the plugin give verl's own unfused
    route's losses, metrics and grad norms to float32 rounding; and verl's own fused route (tied head, scalar
    temperature, no distillation) gives the same three steps with and without the plugin."""
    run_distributed(_parts, 1, (("_routes", (False,)), ("_train", ())), timeout_s=300)


def test_two_ranks_every_route_and_vocab_sharded_dtensor():
    """World size 2 (FSDP2 shards every parameter over 2 gloo ranks, each rank its own data), untied head: every
    route as above. Then logits from a ColwiseParallel lm_head (a DTensor sharded over the vocabulary) through
    the engine's real prepare_model_outputs: the library reads the local shard with the mesh's process group;
    outputs and gradients equal verl's on the unsharded logits, and no tensor over the full vocabulary is made
    (verl's own gathers it on every rank with full_tensor()). Then Ulysses sequence parallelism over both ranks:
    unfused and fused with the plugin against verl's own unfused route."""
    run_distributed(_parts, 2, (("_routes", (False,)), ("_sharded", ()), ("_ulysses", ())), timeout_s=300)


def test_bench_preset_runs_verls_routes_and_the_plugins(capsys, tmp_path):
    """``chunked-entropy bench --preset verl-fsdp`` at a tiny shape, one route of verl's own and one of the plugin's
    (each case a process of its own; the plugin installed through VERL_USE_EXTERNAL_MODULES as users install it,
    and each case checks that verl's routes are the plugin's exactly where they should be); with --topk, verl's
    top-k distillation on the unfused route."""
    import csv

    from chunked_entropy.cli import main

    code = main(["bench", "--preset", "verl-fsdp", "--tokens", "64", "--vocab", "512", "--hidden", "16",
                 "--chunk-sizes", "32", "--topk", "8", "--methods", "fsdpplugin,verlfused", "--tp", "1",
                 "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0, err
    rows = {r["method"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert {r["status"] for r in rows.values()} == {"ok"}, rows
    assert {m: (int(r["topk"]), int(r["tp"])) for m, r in rows.items()} == dict(fsdpplugin=(8, 1), verlfused=(0, 1))


def test_bench_preset_runs_the_vocab_sharded_dtensor_case_on_two_ranks(capsys, tmp_path):
    """``chunked-entropy bench --preset verl-fsdp --tp 2`` at a tiny shape: verl's unfused route on the logits as a
    vocabulary-sharded DTensor over 2 gloo ranks, verl's own (``full_tensor()``) and the plugin's (each case checks
    that its route is the one it names, and that the plugin did not hand the DTensor to verl's own), with top-k
    distillation on; each rank's peak is reported. A --tp that does not divide the vocabulary is refused first."""
    import csv
    import json

    from chunked_entropy.cli import main

    args = ["bench", "--preset", "verl-fsdp", "--tokens", "64", "--vocab", "512", "--hidden", "16", "--chunk-sizes",
            "32", "--topk", "8", "--methods", "verlfsdp,fsdpplugin", "--no-progress", "--out", str(tmp_path)]
    assert main(args[:-2] + ["--tp", "3", "--out", str(tmp_path / "no")]) == 2
    assert "--tp" in capsys.readouterr().err
    assert not (tmp_path / "no" / "results.csv").exists()
    code = main(args + ["--tp", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = {r["method"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert set(rows) == {"verlfsdp", "fsdpplugin"}, rows
    assert {r["status"] for r in rows.values()} == {"ok"}, rows
    assert {(int(r["tp"]), int(r["topk"])) for r in rows.values()} == {(2, 8)}
    for r in json.load(open(tmp_path / "results.json"))["results"]:
        assert len(r["peak_bytes_ranks"]) == 2 and max(r["peak_bytes_ranks"]) == r["peak_bytes"], r
        assert "vocabulary-sharded DTensor over 2 ranks" in r["label"]
    assert captured.out.count("(ranks ") == 2
