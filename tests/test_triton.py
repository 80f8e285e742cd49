"""backend="triton": its kernels through Triton's interpreter, and how the backend is chosen and refused.

The kernels' own tests are in :mod:`tests.triton_cases`, run here in a
subprocess with ``TRITON_INTERPRET=1``: the variable must be set before
Triton is imported (it decides, at decoration, whether a kernel is compiled
or interpreted), and must not reach the other tests of this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from chunked_entropy import (
    ChunkedEntropyConfig,
    Chunking,
    _kernels,
    linear_log_probs_and_entropy,
    log_probs_and_entropy,
)

ROOT = Path(__file__).resolve().parents[1]
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


needs_triton = pytest.mark.skipif(not _triton_importable(),
                                  reason="Triton is not installed (the test extra installs it: pip install triton)")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    e.update(env)
    return subprocess.run([sys.executable, *code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)


_PROBE = """
import numpy, triton, triton.language as tl, torch

@triton.jit
def walk(x_ptr, n):
    for i in range(0, n, 1):
        tl.store(x_ptr + i, i)

try:
    walk[(1,)](torch.zeros(3), 3)
except Exception as e:
    print("broken:", triton.__version__, numpy.__version__, e)
"""


def _interpreter_cannot_loop() -> str:
    """Why this Triton's interpreter cannot run a ``range()`` over an int argument with this numpy, or "".

    Triton 3.6's interpreter (CUDA torch 2.11's) turns the bound into an int with ``int()`` of a one-element
    numpy array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars");
    later interpreters squeeze the array first. Every kernel here walks its row in such a loop."""
    r = _python(["-c", _PROBE], TRITON_INTERPRET="1")
    return r.stdout.strip() if "broken:" in r.stdout else ""


@needs_triton
def test_kernels_through_the_interpreter():
    r = _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/triton_cases.py"], TRITON_INTERPRET="1")
    if r.returncode and "only 0-dimensional arrays can be converted" in r.stdout:
        why = _interpreter_cannot_loop()
        if why:  # the interpreter, not a kernel: its own loops fail the same way
            pytest.skip(f"Triton's interpreter cannot loop over an int argument with this numpy ({why}); "
                        f"install numpy<2.3 (or a newer Triton) to run the kernels through it")
    assert r.returncode == 0, f"tests/triton_cases.py under TRITON_INTERPRET=1:\n{r.stdout[-8000:]}\n{r.stderr[-4000:]}"
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="this process interprets Triton kernels")
def test_on_the_cpu_without_the_interpreter_a_clear_error_before_any_work():
    z = torch.randn(4, 9, requires_grad=True)
    with pytest.raises(ValueError, match=r"backend='triton' runs on a CPU tensor only through Triton's interpreter"):
        log_probs_and_entropy(z, torch.tensor([0, 1, 2, 3]), chunking=Chunking(backend="triton"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        linear_log_probs_and_entropy(torch.randn(4, 3), torch.randn(9, 3), torch.tensor([0, 1, 2, 3]),
                                     chunking=Chunking(backend="triton"))
    assert z.grad is None


def test_auto_is_eager_on_the_cpu_and_the_default():
    assert _kernels.choose_kernels("auto", torch.device("cpu")) is _kernels.EAGER
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 17, generator=g).requires_grad_()
    labels = torch.randint(0, 17, (3, 5), generator=g)
    outs = []
    for chunking in (4, Chunking(4, backend="eager")):
        z.grad = None
        lp, ent = log_probs_and_entropy(z, labels, chunking=chunking)
        (lp.sum() + 0.3 * ent.sum()).backward()
        outs.append((lp, ent, z.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ChunkedEntropyConfig().backend == "auto" and ChunkedEntropyConfig(backend="triton").backend == "triton"


def test_an_unknown_backend_lists_triton():
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'eager', 'compile', 'triton', got 'fast'"):
        log_probs_and_entropy(torch.randn(2, 5), torch.tensor([0, 1]), chunking=Chunking(backend="fast"))
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'eager', 'compile', 'triton', got 'cuda'"):
        ChunkedEntropyConfig(backend="cuda")


def test_auto_on_a_fast_device_tries_triton_then_compiled_then_eager(monkeypatch):
    """The order of ``"auto"``'s choice, each failure one warning, the choice made once per device type (the CPU
    stands in for CUDA here; each kernel is made to fail, since neither may run on this machine)."""
    monkeypatch.setattr(_kernels, "_auto", {})
    monkeypatch.setattr(_kernels, "AUTO_FAST", ("cpu",))
    monkeypatch.setattr(_kernels.TRITON, "compiled_for", lambda device: True)

    def broken(name):
        def fail(*args, **kwargs):
            raise RuntimeError(f"no {name} here")
        return fail

    monkeypatch.setattr(_kernels.TRITON, "stats", broken("Triton"))
    monkeypatch.setattr(_kernels.COMPILED, "stats", broken("compiler"))
    z, labels = torch.randn(4, 7), torch.tensor([0, 1, 2, 6])
    with pytest.warns(RuntimeWarning) as record:
        a = log_probs_and_entropy(z, labels)
    assert [str(w.message).split(" kernels")[0] for w in record] == [
        "chunked_entropy: backend='auto' could not run its Triton",
        "chunked_entropy: backend='auto' could not run its compiled",
    ]
    assert str(record[0].message).endswith("(RuntimeError: no Triton here); trying the compiled kernels")
    assert str(record[1].message).endswith("(RuntimeError: no compiler here); trying the eager kernels")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = log_probs_and_entropy(z, labels)
    eager = log_probs_and_entropy(z, labels, chunking=Chunking(backend="eager"))
    torch.testing.assert_close(a.log_probs, eager.log_probs)
    torch.testing.assert_close(b.entropy, a.entropy)


def test_auto_never_chooses_kernels_that_compute_wrongly(monkeypatch):
    """A kernel that runs but computes wrongly on the device (a miscompilation, say) is held to the eager
    kernels on a test block and skipped with one warning, never chosen silently."""
    monkeypatch.setattr(_kernels, "_auto", {})
    monkeypatch.setattr(_kernels, "AUTO_FAST", ("cpu",))
    monkeypatch.setattr(_kernels.TRITON, "compiled_for", lambda device: False)
    right = _kernels.COMPILED.grad

    def off_by_a_little(z, out, *args):
        return right(z, out, *args).mul_(1.01)

    monkeypatch.setattr(_kernels.COMPILED, "grad", off_by_a_little)
    z, labels = torch.randn(4, 7), torch.tensor([0, 1, 2, 6])
    with pytest.warns(RuntimeWarning, match=r"could not run its compiled kernels on cpu \(ArithmeticError: its "
                                           r"results differ from the eager kernels' on a float32 test block\); "
                                           r"trying the eager kernels"):
        log_probs_and_entropy(z, labels)
    assert _kernels._auto["cpu"] is _kernels.EAGER


def test_auto_never_chooses_kernels_that_write_half_precision_wrongly(monkeypatch):
    """Right in float32, wrong where they read and write bf16 (most GPU runs' logits and gradients: the kernels'
    own bf16 rounding, say): the bf16 test block finds it, and the kernels are skipped."""
    monkeypatch.setattr(_kernels, "_auto", {})
    monkeypatch.setattr(_kernels, "AUTO_FAST", ("cpu",))
    monkeypatch.setattr(_kernels.TRITON, "compiled_for", lambda device: False)
    right = _kernels.COMPILED.grad

    def bf16_off(z, out, *args):
        g = right(z, out, *args)
        if out.dtype == torch.bfloat16:  # about two bf16 ulps off
            g.mul_(1 - 2 ** -6)
        return g

    monkeypatch.setattr(_kernels.COMPILED, "grad", bf16_off)
    z, labels = torch.randn(4, 7), torch.tensor([0, 1, 2, 6])
    with pytest.warns(RuntimeWarning, match=r"differ from the eager kernels' on a bfloat16 test block\); trying "
                                           r"the eager kernels"):
        log_probs_and_entropy(z, labels)
    assert _kernels._auto["cpu"] is _kernels.EAGER
    monkeypatch.setattr(_kernels, "_auto", {})
    monkeypatch.setattr(_kernels.COMPILED, "grad", right)  # the kernels themselves pass both blocks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log_probs_and_entropy(z, labels)
    assert _kernels._auto["cpu"] is _kernels.COMPILED


def test_without_triton_the_library_works_and_refuses_backend_triton():
    # sys.modules["triton"] = None makes "import triton" raise ImportError: the library as on a machine without it
    code = """
import sys
sys.modules["triton"] = None
import torch
from chunked_entropy import Chunking, log_probs_and_entropy, _kernels
z, labels = torch.randn(3, 11), torch.tensor([0, 5, 10])
lp, ent = log_probs_and_entropy(z, labels)
ref = torch.log_softmax(z, dim=-1).gather(1, labels[:, None]).squeeze(1)
torch.testing.assert_close(lp, ref)
assert _kernels.choose_kernels("auto", torch.device("cpu")) is _kernels.EAGER
try:
    log_probs_and_entropy(z, labels, chunking=Chunking(backend="triton"))
except RuntimeError as e:
    print("refused:", e)
"""
    r = _python(["-c", code])
    assert r.returncode == 0, r.stderr[-4000:]
    assert "refused: backend='triton' needs Triton, which cannot be imported here" in r.stdout, r.stdout
    assert "pip install triton" in r.stdout


def _compile_for_sm90(kernel, types: dict, consts: dict, warps: int = 8):
    """Triton's compiler, run ahead of time for an H100/H200 (sm_90) on this machine, no GPU needed: it checks
    what the interpreter does not (types in the loops, constexpr branches, lowering to PTX and a cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: "constexpr" if name in consts else types[name] for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "enable_fp_fusion": True})


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="this process interprets Triton kernels")
@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_the_kernels_compile_for_a_gpu(half):
    """The richest variant of each kernel (a half-precision block, the soft-cap, a per-row multiplier, every
    statistic and gradient term, the statistics merged into the running ones of earlier vocabulary blocks)
    through the whole compiler, down to a cubin, at the widest tile and warps the launches use; and the second
    stage of a split row, merging too."""
    from chunked_entropy import _triton

    if _triton.INTERPRETED:
        pytest.skip("Triton was imported with TRITON_INTERPRET set in this process")
    f32 = "*fp32"
    stats_tile, stats_warps = _triton._stats_config(1 << 20, 2)
    grad_tile, grad_warps = _triton._grad_config(1 << 20, 2)
    stats = _compile_for_sm90(
        _triton._stats_kernel,
        dict(z_ptr=f"*{half}", stride_zr="i64", stride_zc="i32", width="i32", span="i32", cap_ptr=f32, k_ptr=f32,
             stride_k="i32", target_ptr="*i64", v0="i32", m_ptr=f32, ones_ptr=f32, rest_ptr=f32, w_ptr=f32,
             q_ptr=f32, zl_ptr=f32, n="i32", span_class="i32"),
        dict(HAS_CAP=True, HAS_K=True, WANT_W=True, WANT_Q=True, MERGE=True, TILE=stats_tile,
             COMPUTE=_triton.tl.float32, NEG_FLOOR=_triton._NEG_FLOOR), stats_warps)
    merge = _compile_for_sm90(
        _triton._merge_parts_kernel,
        dict(pm_ptr=f32, pones_ptr=f32, prest_ptr=f32, pw_ptr=f32, pq_ptr=f32, pzl_ptr=f32, parts="i32", n="i32",
             k_ptr=f32, stride_k="i32", m_ptr=f32, ones_ptr=f32, rest_ptr=f32, w_ptr=f32, q_ptr=f32, zl_ptr=f32),
        dict(HAS_K=True, WANT_W=True, WANT_Q=True, MERGE=True, PARTS=_triton.MAX_PARTS, COMPUTE=_triton.tl.float32,
             NEG_FLOOR=_triton._NEG_FLOOR), 1)
    grad = _compile_for_sm90(
        _triton._grad_kernel,
        dict(z_ptr=f"*{half}", stride_zr="i64", stride_zc="i32", out_ptr=f"*{half}", stride_or="i64",
             stride_oc="i32", width="i32", span="i32", cap_ptr=f32, k_ptr=f32, stride_k="i32", m_ptr=f32,
             ls_ptr=f32, ws_ptr=f32, s2_ptr=f32, target_ptr="*i64", v0="i32", c_ptr=f32, b_ptr=f32, a_ptr=f32,
             span_class="i32"),
        dict(HAS_CAP=True, HAS_K=True, HAS_C=True, HAS_B=True, HAS_A=True, OUT_BF16=half == "bf16", TILE=grad_tile,
             COMPUTE=_triton.tl.float32, NEG_FLOOR=_triton._NEG_FLOOR), grad_warps)
    for k in (stats, merge, grad):
        assert k.asm["cubin"] and "ld.global" in k.asm["ptx"]
    for k in (stats, merge):
        # every maximum propagates NaN as eager's (maximumf); maxnumf, tl.max's own, would skip it on the GPU
        assert "arith.maxnumf" not in k.asm["ttir"] and "arith.maximumf" in k.asm["ttir"]
    assert "__nv_tanhf" in stats.asm["ttir"]  # libdevice's tanh, not the interpreter's formula
    # the lanes' statistics stay in registers: no spill to local memory at the widest tile (read from the
    # cubin by the cuobjdump Triton ships)
    usage = _resource_usage(stats)
    if usage is not None:
        assert " LOCAL:0 " in usage, usage


def _resource_usage(kernel):
    """``cuobjdump -res-usage`` of a compiled kernel's cubin (registers, local memory), or None without the tool."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, timeout=60)
    lines = [line.strip() for line in out.stdout.splitlines() if "REG:" in line]
    return f" {lines[0]} " if lines else None


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="this process interprets Triton kernels")
def test_tiles_and_warps_by_dtype_and_width_and_split_rows():
    """The launch configuration: 8 KiB of logits a statistics tile (4096 bf16 columns, 2048 float32, 1024
    float64) at 8 columns a thread, twice that for the gradient; a narrow block its own width; a row split
    across programs only where rows are too few to fill the device and each part still reads several tiles;
    the autotuner's configurations pruned to the part's width class."""
    from chunked_entropy import _triton

    assert _triton._stats_config(151936, 2) == (4096, 16)
    assert _triton._stats_config(151936, 4) == (2048, 8)
    assert _triton._stats_config(151936, 8) == (1024, 4)
    assert _triton._stats_config(300, 2) == (512, 2)
    assert _triton._grad_config(151936, 2) == (8192, 16) and _triton._grad_config(151936, 4) == (4096, 8)
    cpu = torch.device("cpu")
    programs = _triton._device_programs(cpu)
    assert _triton._parts(programs, 1 << 20, 4096, cpu) == 1  # enough rows
    assert _triton._parts(1, 4096 * 3, 4096, cpu) == 1  # too short to split
    assert _triton._parts(1, 1 << 20, 4096, cpu) == programs  # one long row: the device filled
    assert _triton._parts(2, 4096 * 8, 4096, cpu) == 2  # each part at least MIN_SPLIT_TILES tiles
    assert _triton._parts(1, 1 << 30, 4096, cpu) <= _triton.MAX_PARTS
    for kind in ("stats", "grad"):
        configs = _triton._autotune_configs(kind)
        assert 4 <= len(configs) <= 8
        small = _triton._prune(configs, {"span_class": 512})
        assert [c.kwargs["TILE"] for c in small] == [1024] * len(small)
        wide = _triton._prune(configs, {"span_class": 1 << 17})
        assert len(wide) == len(configs)


def _auto_on_the_cpu(monkeypatch):
    """``backend="auto"`` as on a fast device, with the compiled kernels (the CPU stands in for CUDA)."""
    monkeypatch.setattr(_kernels, "_auto", {})
    monkeypatch.setattr(_kernels, "_auto_pair", {}, raising=False)
    monkeypatch.setattr(_kernels, "AUTO_FAST", ("cpu",))
    monkeypatch.setattr(_kernels.TRITON, "compiled_for", lambda device: False)


def _eager_pair_kernels(monkeypatch, wrong: str = "", kind: str = ""):
    """The divergence kernels as their own functions run eagerly (no compile: these tests are about the probe),
    ``wrong``: that one of them off by 1% (for the divergence ``kind`` only, where it takes the kind's math)."""
    from chunked_entropy import _divergence

    def off(fn):
        def call(*args):
            out = fn(*args)
            if wrong != "cross" and args[0].kind != kind:
                return out
            if isinstance(out, tuple):
                return tuple(t * 1.01 for t in out)
            if out is None:  # grad_of_blocks_ writes over its second argument
                args[1].mul_(1.01)
            return None if out is None else out * 1.01
        return call

    fns = {"terms": _divergence.terms_of_blocks, "grad": _divergence.grad_of_blocks_,
           "cross": _divergence.cross_of_blocks}
    fns = tuple(off(f) if name == wrong else f for name, f in fns.items())
    monkeypatch.setattr(_kernels.PAIR, "fns", lambda: fns)


def _faulty_stats(fault):
    right = _kernels.COMPILED.stats

    def stats(z, tf, k, target, v0, want_w, want_q, dtype):
        st = right(z, tf, k, target, v0, want_w, want_q, dtype)
        if fault == "sum_pi_squared" and st.q is not None:
            return st._replace(q=st.q * 1.01)
        if fault == "several tiles" and z.shape[1] > 8192:  # a merge of tiles gone wrong
            return st._replace(rest=st.rest * 1.01)
        if fault == "per-row temperature" and isinstance(k, torch.Tensor):
            return st._replace(rest=st.rest * 1.01)
        return st

    return stats


@pytest.mark.parametrize("fault", ["sum_pi_squared", "several tiles", "per-row temperature", "softcap"])
def test_auto_probes_what_runs(fault, monkeypatch):
    """Kernels wrong only with ``sum_pi_squared``, only on rows of several tiles, only with a per-row temperature
    or only with a soft-cap (the cases of real calls a one-tile probe never ran) are found and skipped."""
    _auto_on_the_cpu(monkeypatch)
    if fault == "softcap":
        right = _kernels.COMPILED.grad

        def grad(z, out, tf, *args):
            g = right(z, out, tf, *args)
            return g.mul_(1.01) if tf.softcap is not None else g

        monkeypatch.setattr(_kernels.COMPILED, "grad", grad)
    else:
        monkeypatch.setattr(_kernels.COMPILED, "stats", _faulty_stats(fault))
    with pytest.warns(RuntimeWarning, match=r"could not run its compiled kernels on cpu \(ArithmeticError: its "
                                           r"results differ from the eager kernels' on a float32 test block\)"):
        assert _kernels.choose_kernels("auto", torch.device("cpu")) is _kernels.EAGER


def test_auto_probe_reads_the_device_once(monkeypatch):
    """The probe's verdict is one read of the device, in the first call only (beside the call's own value check);
    a divergence's kernels are probed at its first call, again with one read."""
    from chunked_entropy import Divergence, _stats, divergence_from_logits
    from tests.test_host_syncs import _HostSyncs

    _auto_on_the_cpu(monkeypatch)
    _eager_pair_kernels(monkeypatch)
    # the compiled kernels' functions run as they are: dynamo compiles no frame under a dispatch mode
    monkeypatch.setattr(_kernels.COMPILED, "fns",
                        lambda: (_stats.stats_of_block, _stats.grad_of_block, _stats.grad_of_block_))
    g = torch.Generator().manual_seed(0)
    z, zt, labels = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g), torch.randint(0, 40, (6,))
    counts = []
    for _ in range(2):
        with _HostSyncs() as syncs:
            log_probs_and_entropy(z, labels)
        counts.append(sum(syncs.ops.values()))
    for kind in ("reverse_kl", "reverse_kl", Divergence("jsd", 0.5)):
        with _HostSyncs() as syncs:
            divergence_from_logits(z, zt, labels=labels, divergence=kind)
        counts.append(sum(syncs.ops.values()))
    assert counts == [2, 1, 2, 1, 2], counts
    assert _kernels._auto["cpu"] is _kernels.COMPILED


@pytest.mark.parametrize("wrong", ["terms", "grad", "cross"])
def test_auto_never_runs_divergence_kernels_that_compute_wrongly(wrong, monkeypatch):
    """A divergence's own kernels wrong on this device: found by its probe at its first call; that divergence
    runs the eager kernels (the same results as backend="eager"), the others and the one-head ops keep theirs."""
    from chunked_entropy import Divergence, divergence_from_logits

    _auto_on_the_cpu(monkeypatch)
    _eager_pair_kernels(monkeypatch, wrong, kind="jsd")
    g = torch.Generator().manual_seed(0)
    z, zt, labels = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g), torch.randint(0, 40, (6,))
    assert _kernels.choose_kernels("auto", torch.device("cpu")) is _kernels.COMPILED
    kind = Divergence("jsd", 0.5) if wrong != "cross" else "forward_kl"  # the cross sum: a KL's only
    with pytest.warns(RuntimeWarning, match=r"could not run its (JSD|ForwardKL) divergence kernels on cpu "
                                           r"\(ArithmeticError: .* float32 divergence test block\); trying the "
                                           r"eager kernels for it"):
        got = divergence_from_logits(z, zt, labels=labels, divergence=kind)
    want = divergence_from_logits(z, zt, labels=labels, divergence=kind, chunking=Chunking(backend="eager"))
    assert torch.equal(got.divergence, want.divergence)
    assert _kernels.choose_kernels("auto", torch.device("cpu"), pair=_pair_math(kind)) is _kernels.EAGER
    other = "reverse_kl" if wrong != "cross" else Divergence("jsd", 0.5)  # right kernels, or no cross sum
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _kernels.choose_kernels("auto", torch.device("cpu"), pair=_pair_math(other)) is _kernels.COMPILED


def _pair_math(kind):
    from chunked_entropy import Divergence

    return (kind if isinstance(kind, Divergence) else Divergence(kind)).math


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="this process interprets Triton kernels")
def test_autotune_is_on_for_compiled_kernels_and_can_be_pinned():
    """Compiled kernels pick their tile and warps with ``triton.autotune`` unless
    ``CHUNKED_ENTROPY_TRITON_AUTOTUNE=0`` pins the fixed configuration; the interpreter, which cannot time a
    kernel, always takes the fixed one."""
    code = "from chunked_entropy import _triton; print('autotune', _triton.AUTOTUNE)"
    for env, want in (({}, True), ({"CHUNKED_ENTROPY_TRITON_AUTOTUNE": "0"}, False),
                      ({"TRITON_INTERPRET": "1"}, False)):
        r = _python(["-c", code], **env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"autotune {want}" in r.stdout, (env, r.stdout)
