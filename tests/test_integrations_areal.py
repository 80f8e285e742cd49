"""AReaL 1.0.4, installed: the plugin against AReaL's own functions and inside its FSDP engine's log-prob methods.

AReaL's own ``gather_logprobs`` / ``gather_logprobs_entropy`` and the real
``FSDPEngine`` (its process groups built by its own ``create_process_group``
over gloo, a tiny Qwen2 config on disk) run with and without
:func:`chunked_entropy.integrations.areal.install`, at TP 1 and 2: values and
gradients (random upstream gradients) equal within float32 rounding, and
both against a float64 reference.

One setting is changed, in :func:`_eager_compile`: AReaL wraps its TP 1
per-chunk function in ``torch.compile``, whose inductor build takes about
20 s per process on a CPU; dynamo is disabled there so the same Python
function runs eagerly (the math is AReaL's, unchanged).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import warnings

import pytest
import torch

from chunked_entropy.integrations import areal as ce_areal
from tests.helpers import reference, require, run_distributed


@contextlib.contextmanager
def areal_imports():
    """Import AReaL modules without losing this process's logging.

    AReaL's ``areal.utils.logging.getLogger`` (run at the import of most of
    its modules) replaces ``logging.Logger.root`` and ``Logger.manager`` and
    reconfigures the root logger: every logger made before (this library's,
    pytest's) would be cut off from ``logging.getLogger`` for the rest of the
    suite. The state is put back after the imports; AReaL's code is unchanged.
    """
    root, manager = logging.Logger.root, logging.Logger.manager
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.Logger.root, logging.Logger.manager = root, manager
        logging.root.handlers[:], logging.root.level = handlers, level


with areal_imports():
    require("areal.utils.functional", "areal.engine.fsdp_engine", "areal.models.tree_attn.functional")
    import areal.engine.fsdp_engine as areal_fsdp
    import areal.models.tree_attn.functional as areal_tree
    import areal.utils.functional as areal_functional
    import areal.utils.functional.vocab_parallel as areal_vp

assert importlib.metadata.version("areal") == ce_areal.AREAL_VERSION
OWN = {"gather_logprobs": areal_vp.gather_logprobs, "gather_logprobs_entropy": areal_vp.gather_logprobs_entropy}
V_LOCAL = 24


def _eager_compile():
    """AReaL's TP 1 path is ``torch.compile``d: run it eagerly (inductor's CPU build costs ~20 s a process)."""
    torch._dynamo.config.disable = True


@pytest.fixture
def eager_compile():
    """:func:`_eager_compile` for one test of this process, then dynamo as it was (other tests compile)."""
    before = torch._dynamo.config.disable
    _eager_compile()
    yield
    torch._dynamo.config.disable = before


def _data(seed, t, v, temperature):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, v, (t,), generator=g)
    ups = torch.randn(2, t, generator=g, dtype=torch.float64)
    return logits, labels, ups


def _ref(logits, labels, ups, temperature, with_entropy):
    x = logits.clone().requires_grad_()
    lp, h = reference(x, labels, temperature=temperature)
    ((lp * ups[0]).sum() + ((h * ups[1]).sum() if with_entropy else 0)).backward()
    return lp.detach(), h.detach(), x.grad


def _run(fn, shard, labels, ups, with_entropy, **kw):
    """``fn`` on a float32 copy of ``shard``: its outputs and the gradient of a random upstream loss."""
    x = shard.float().requires_grad_()
    before = x.detach().clone()
    out = fn(x, labels, **kw)
    lp, h = out if with_entropy else (out, None)
    assert lp.dtype == torch.float32 and lp.shape == labels.shape
    loss = (lp.double() * ups[0]).sum() + ((h.double() * ups[1]).sum() if with_entropy else 0)
    loss.backward()
    assert torch.equal(x.detach(), before)
    return lp.detach().double(), (h.detach().double() if with_entropy else None), x.grad.double()


def _compare(got, want, tol):
    for a, b in zip(got, want, strict=True):
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, **tol)


F32 = dict(rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------ TP 1: AReaL's functions, in this process


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", ["gather_logprobs", "gather_logprobs_entropy"])
def test_tp1_matches_areals_own_function_and_float64(name, temperature, eager_compile):
    logits, labels, ups = _data(0, 11, 37, temperature)
    with_entropy = name.endswith("entropy")
    ours = _run(getattr(ce_areal, name), logits, labels, ups, with_entropy, temperature=temperature, chunk_size=4)
    theirs = _run(OWN[name], logits, labels, ups, with_entropy, temperature=temperature, chunk_size=4)
    lp, h, grad = _ref(logits, labels, ups, temperature, with_entropy)
    _compare(ours, (lp, h if with_entropy else None, grad), F32)
    _compare(ours, theirs, F32)


def test_entropy_has_its_gradient():
    logits, labels, ups = _data(1, 5, 16, 1.0)
    x = logits.float().requires_grad_()
    _, h = ce_areal.gather_logprobs_entropy(x, labels)
    assert h.requires_grad
    (h * ups[1].float()).sum().backward()
    want = _ref(logits, labels, torch.stack([torch.zeros(5, dtype=torch.float64), ups[1]]), 1.0, True)[2]
    torch.testing.assert_close(x.grad.double(), want, **F32)


def test_bad_labels_are_named():
    with pytest.raises(ValueError, match="labels must have the shape"):
        ce_areal.gather_logprobs(torch.randn(4, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="labels must hold integer ids"):
        ce_areal.gather_logprobs_entropy(torch.randn(4, 8), torch.zeros(4))
    # an id outside [0, V), -100 included: AReaL's gather fails at TP 1 (and reads one as no label under TP)
    for bad in (8, -1, -100):
        labels = torch.tensor([0, 7, bad, 3])
        for fn in (ce_areal.gather_logprobs, ce_areal.gather_logprobs_entropy):
            with pytest.raises(ValueError, match=rf"labels must hold class ids in \[0, 8\); found {bad} at flat pos"):
                fn(torch.randn(4, 8), labels)
    # AReaL's own chunk_size argument is named (the core would name its chunking)
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match=rf"^chunk_size must be an int >= 1, got {bad!r}"):
            ce_areal.gather_logprobs(torch.randn(4, 8), torch.zeros(4, dtype=torch.int64), 1.0, None, bad)


def test_tree_attention_module_runs_the_plugin_after_install(eager_compile):
    """The tree-attention path's own helper, unchanged code, served by the plugin once installed."""
    logits, labels, ups = _data(2, 9, 21, 0.8)
    ids = torch.cat([labels[:1], labels])  # input_ids: label of row i is ids[i + 1]

    def node(x, lab, temperature):
        return areal_tree._compute_internal_node_logprobs_entropy(x, ids, 0, 9, temperature=temperature,
                                                                   chunk_size=4)
    theirs = _run(node, logits, labels, ups, True, temperature=0.8)
    ce_areal.install()
    try:
        assert areal_tree.gather_logprobs_entropy is ce_areal.gather_logprobs_entropy
        ours = _run(node, logits, labels, ups, True, temperature=0.8)
    finally:
        ce_areal.uninstall()
    _compare(ours, theirs, F32)
    _compare(ours, _ref(logits, labels, ups, 0.8, True), F32)


# ------------------------------------------------------------ install / uninstall


def _imported_targets():
    import sys

    return [sys.modules[m] for m in ce_areal.TARGETS if m in sys.modules]


def test_install_patches_every_imported_module_and_uninstall_restores():
    modules = _imported_targets()
    assert {areal_vp, areal_functional, areal_fsdp, areal_tree} <= set(modules)
    try:
        ce_areal.install()
        ce_areal.install()  # idempotent
        assert ce_areal.installed()
        for m in modules:
            assert m.gather_logprobs is ce_areal.gather_logprobs, m.__name__
            assert m.gather_logprobs_entropy is ce_areal.gather_logprobs_entropy, m.__name__
        # a module imported after install is patched as it loads (the Archon engine imports on a CPU; the
        # Megatron engine needs mbridge, which is not installed here)
        with areal_imports():
            import areal.experimental.engine.archon_engine as archon
        modules.append(archon)
        assert archon.gather_logprobs_entropy is ce_areal.gather_logprobs_entropy
    finally:
        ce_areal.uninstall()
    assert not ce_areal.installed()
    for m in modules:
        assert m.gather_logprobs is OWN["gather_logprobs"], m.__name__
        assert m.gather_logprobs_entropy is OWN["gather_logprobs_entropy"], m.__name__


def test_a_signature_mismatch_raises_and_patches_nothing(monkeypatch):
    def other_contract(logits, labels, temperature=1.0, tp_group=None):  # no chunk_size
        return logits

    monkeypatch.setattr(areal_fsdp, "gather_logprobs_entropy", other_contract)
    with pytest.raises(RuntimeError, match="Nothing was patched"):
        ce_areal.install()
    assert not ce_areal.installed()
    assert areal_fsdp.gather_logprobs_entropy is other_contract
    for m in _imported_targets():
        assert m.gather_logprobs is OWN["gather_logprobs"], m.__name__


# ------------------------------------------------------------ the FSDP engine's methods, TP 1 and 2 over gloo


def _engine(path, tp, temperature):
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.cli_args import TrainEngineConfig

    engine = areal_fsdp.FSDPEngine(TrainEngineConfig(experiment_name="ce", trial_name="areal", path=path,
                                                     temperature=temperature))
    engine.create_process_group(ParallelStrategy(tensor_parallel_size=tp, data_parallel_size=2 // tp))
    assert engine.parallel_helper.tp_size == tp
    return engine


def _engine_call(method, inputs, logits, labels):
    """The engine's method as ``_run`` calls a function: the engine reads its labels from ``inputs``."""
    return method(logits, inputs)


def _engine_worker(rank, world, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import areal.engine.fsdp_engine  # noqa: F401 - imported before install, as in a trainer
    _eager_compile()
    temperature = 0.7
    for tp in (2, 1):
        engine = _engine(path, tp, temperature)
        v = V_LOCAL * tp
        logits, labels, ups = _data(7, 13, v, temperature)
        cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL) if tp == 2 else slice(None)  # this rank's shard
        shard = logits[:, cols]
        inputs = {"input_ids": torch.roll(labels, 1).unsqueeze(0)}  # the engine rolls them back into the labels
        for method, with_entropy in (("_compute_logprobs_entropy", True), ("_compute_logprobs", False)):
            call = functools.partial(_engine_call, getattr(engine, method), inputs)

            theirs = _run(call, shard, labels, ups, with_entropy)
            ce_areal.install()
            try:
                assert areal_fsdp.gather_logprobs_entropy is ce_areal.gather_logprobs_entropy
                assert areal_fsdp.gather_logprobs is ce_areal.gather_logprobs
                ours = _run(call, shard, labels, ups, with_entropy)
            finally:
                ce_areal.uninstall()
            lp, h, grad = _ref(logits, labels, ups, temperature, with_entropy)
            _compare(ours, (lp, h if with_entropy else None, grad[:, cols]), F32)
            _compare(ours, theirs, F32)
        # AReaL's own functions with its tp_group (the engine's), against the plugin's
        for name in OWN:
            with_entropy = name.endswith("entropy")
            kw = dict(temperature=temperature, tp_group=engine.parallel_helper.tp_group if tp == 2 else None,
                      chunk_size=5)
            _compare(_run(getattr(ce_areal, name), shard, labels, ups, with_entropy, **kw),
                     _run(OWN[name], shard, labels, ups, with_entropy, **kw), F32)


def test_fsdp_engine_log_prob_methods_with_and_without_the_plugin_tp1_and_tp2(tmp_path):
    config = {"model_type": "qwen2", "vocab_size": 2 * V_LOCAL, "hidden_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    run_distributed(_engine_worker, 2, str(tmp_path), timeout_s=120)
