"""NeMo-RL: the plugin's Functions against a float64 reference (in CI), and against NeMo-RL's own loss path.

NeMo-RL needs Python >= 3.13 and is not installed by CI. These tests import
its plain-torch loss modules (``nemo_rl/distributed/model_utils.py``,
``nemo_rl/algorithms/loss/``) from a source checkout named by
``CHUNKED_ENTROPY_NEMO_RL_SRC`` (checked at commit 7ea279ab) and run NeMo-RL's
own ``prepare_loss_input`` / ``prepare_packed_loss_input`` with its
``ClippedPGLossFn`` and ``DistillationLossFn``, with and without
:func:`chunked_entropy.integrations.nemo_rl.install`, over gloo process
groups (TP 1 and 2, CP 2): loss values, every metric, and the logits'
gradient equal within float32 rounding. Without the variable they skip,
saying what to set. The contract tests at the top run in CI: the plugin's
replacements of NeMo-RL's autograd Functions, called as NeMo-RL calls them,
against a float64 reference at TP 1 and 2 over gloo.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import pytest
import torch

from chunked_entropy.integrations import nemo_rl as ce_nemo_rl
from tests.helpers import run_distributed

NEMO_RL_SRC = os.environ.get("CHUNKED_ENTROPY_NEMO_RL_SRC")

needs_nemo_rl = pytest.mark.skipif(
    not NEMO_RL_SRC,
    reason="set CHUNKED_ENTROPY_NEMO_RL_SRC to a checkout of https://github.com/NVIDIA-NeMo/RL at commit "
           f"{ce_nemo_rl.NEMO_RL_COMMIT[:8]} (NeMo-RL needs Python >= 3.13 and does not install here; its loss "
           "modules import from the source with pydantic and transformers)",
)


B, S, V_LOCAL = 3, 12, 24  # S a multiple of 2 * CP, as NeMo-RL pads it for context parallelism


def _contract_worker(rank, world):
    import torch.distributed as dist

    from tests.helpers import reference

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    v = V_LOCAL * world
    logits = torch.randn(2, 7, v, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, v, (2, 7), generator=g)
    ids = torch.randint(0, v, (2, 7, 3), generator=g)
    up = torch.randn(2, 7, generator=g, dtype=torch.float64)
    up_k = torch.randn(2, 7, 3, generator=g, dtype=torch.float64)
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    start, end = rank * V_LOCAL, (rank + 1) * V_LOCAL
    calls = {
        "DistributedLogprob": lambda x: ce_nemo_rl.DistributedLogprob.apply(x, target, start, end, group),
        "ChunkedDistributedLogprob": lambda x: ce_nemo_rl.ChunkedDistributedLogprob.apply(x, target, start, end, 3,
                                                                                         group),
        "ChunkedDistributedGatherLogprob": lambda x: ce_nemo_rl.ChunkedDistributedGatherLogprob.apply(
            x, ids, start, end, 3, group),
        "ChunkedDistributedEntropy": lambda x: ce_nemo_rl.ChunkedDistributedEntropy.apply(x, 3, group),
    }
    for name, call in calls.items():
        full = logits.clone().requires_grad_()
        lp_all = torch.log_softmax(full, -1)
        if name == "ChunkedDistributedGatherLogprob":
            want, u = lp_all.gather(-1, ids), up_k
        elif name == "ChunkedDistributedEntropy":
            want, u = -reference(full, target)[1], up  # NeMo-RL's H_all = sum p log p
        else:
            want, u = reference(full, target)[0], up
        (want * u).sum().backward()
        x = logits[..., cols].clone().requires_grad_()
        before = x.detach().clone()
        got = call(x)
        (got * u).sum().backward()
        torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-10, msg=name)
        torch.testing.assert_close(x.grad, full.grad[..., cols], rtol=1e-9, atol=1e-10, msg=name)
        assert torch.equal(x.detach(), before)
    # the top-k/top-p filtered Functions: NeMo-RL's definition (-inf at a target outside its row's kept set)
    from tests.test_replay import own_reference

    filtered = {
        "DistributedLogprobWithSampling": lambda x, k, p: ce_nemo_rl.DistributedLogprobWithSampling.apply(
            x, target, group, k, p),
        "ChunkedDistributedLogprobWithSampling": lambda x, k, p: ce_nemo_rl.ChunkedDistributedLogprobWithSampling
        .apply(x, target, group, k, p, 3),
    }
    for (name, call), (top_k, top_p) in zip(filtered.items(), ((5, 1.0), (None, 0.8)), strict=True):
        for k_, p_ in ((top_k, top_p), (7, 0.9)):
            full = logits.clone().requires_grad_()
            want, grad_of, _, inside = own_reference(full, target, k_, None if p_ == 1.0 else p_)
            assert inside.any() and not inside.all()
            (grad_of * up).sum().backward()
            x = logits[..., cols].clone().requires_grad_()
            got = call(x, k_, p_)
            torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-10, msg=name)
            torch.autograd.backward(got, up)  # NeMo-RL's gradient at the -inf tokens too: -p^K on the kept ids
            torch.testing.assert_close(x.grad, full.grad[..., cols], rtol=1e-9, atol=1e-10, msg=name)
    x = logits[..., cols].clone().requires_grad_()
    assert not ce_nemo_rl.DistributedLogprobWithSampling.apply(x, target, group, 3, 0.5, True).requires_grad
    assert not ce_nemo_rl.DistributedLogprob.apply(x, target, start, end, group, True).requires_grad  # inference
    assert not ce_nemo_rl.ChunkedDistributedEntropy.apply(x, 3, group, True).requires_grad
    # NeMo-RL's shard bounds must be the contiguous shard of this rank
    with pytest.raises(ValueError, match=f"rank {rank}"):
        ce_nemo_rl.DistributedLogprob.apply(logits[..., cols], target, start + 1, end + 1, group)


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
def test_contract_functions_against_float64(world):
    run_distributed(_contract_worker, world, timeout_s=60)


def _import_nemo_rl():
    """NeMo-RL's loss modules from the checkout: ``(model_utils, loss_utils, loss_functions, sampling_utils)``.

    Two of NeMo-RL's package modules on the import path of the loss code
    cannot be imported here, and are registered as stand-ins *before* the
    real modules load (NeMo-RL's loss code itself is unchanged):

    - ``nemo_rl.models.policy`` (the package's ``__init__``) asserts
      transformers < 5.12 and the suite has 5.24; the loss path only needs its
      ``TokenizerConfig`` (a TypedDict used in tokenizer annotations);
    - ``nemo_rl.utils.logger`` imports mlflow, wandb and tensorboard; the
      loss path only names its ``Logger`` in annotations.
    """
    if NEMO_RL_SRC not in sys.path:
        sys.path.insert(0, NEMO_RL_SRC)
    import nemo_rl.models  # noqa: F401 - the parents of the stand-ins below
    import nemo_rl.utils  # noqa: F401

    if "nemo_rl.models.policy" not in sys.modules:
        policy = types.ModuleType("nemo_rl.models.policy")
        policy.__path__ = [os.path.join(NEMO_RL_SRC, "nemo_rl", "models", "policy")]
        policy.TokenizerConfig = dict
        sys.modules["nemo_rl.models.policy"] = policy
    if "nemo_rl.utils.logger" not in sys.modules:
        logger = types.ModuleType("nemo_rl.utils.logger")
        logger.Logger = type("Logger", (), {})
        sys.modules["nemo_rl.utils.logger"] = logger
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import nemo_rl.algorithms.logits_sampling_utils as sampling
        import nemo_rl.algorithms.loss.loss_functions as loss_functions
        import nemo_rl.algorithms.loss.utils as loss_utils
        import nemo_rl.distributed.model_utils as model_utils
    return model_utils, loss_utils, loss_functions, sampling




def _batch(world_v, seed=0, k=4):
    """A micro-batch as NeMo-RL's policy worker hands it to the loss (``[B, S]`` tensors), with the logits."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, world_v, (B, S), generator=g)
    lengths = torch.tensor([S, S - 3, S - 1])
    token_mask = (torch.arange(S)[None] < lengths[:, None]).float()
    token_mask[:, :2] = 0  # the prompt
    data = BatchedDataDict({
        "input_ids": input_ids, "input_lengths": lengths, "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]) + 0 * lengths,
        "advantages": torch.randn(B, S, generator=g),
        "prev_logprobs": -torch.rand(B, S, generator=g) * 3,
        "generation_logprobs": -torch.rand(B, S, generator=g) * 3,
        "reference_policy_logprobs": -torch.rand(B, S, generator=g) * 3,
        "teacher_topk_logits": torch.randn(B, S, k, generator=g) * 2,
        "teacher_topk_indices": torch.stack([torch.randperm(world_v, generator=g)[:k] for _ in range(B * S)])
        .view(B, S, k),
    })
    logits = torch.randn(B, S, world_v, generator=g) * 3
    return data, logits


def _losses(loss_functions):
    pg = loss_functions.ClippedPGLossFn(loss_functions.ClippedPGLossConfig(reference_policy_kl_penalty=0.05))
    distill = loss_functions.DistillationLossFn(loss_functions.DistillationLossConfig(kl_type="mixed",
                                                                                     zero_outside_topk=True))
    topk_only = loss_functions.DistillationLossFn(loss_functions.DistillationLossConfig(kl_type="reverse",
                                                                                       zero_outside_topk=False))
    return {"clipped_pg": pg, "distillation": distill, "distillation_topk_only": topk_only}


def _step(prepare, loss_fn, shard, data, valid, backward=True, **kw):
    x = shard.clone().requires_grad_()
    loss_input, data = prepare(x, data.copy(), loss_fn, **kw)  # a copy: NeMo-RL adds keys to the batch
    loss, metrics = loss_fn(data=data, global_valid_seqs=valid[0], global_valid_toks=valid[1], **loss_input)
    if backward:
        loss.backward()
    return loss.detach(), metrics, x.grad if backward else None


def _same(ours, theirs):
    (l_o, m_o, g_o), (l_t, m_t, g_t) = ours, theirs
    torch.testing.assert_close(l_o, l_t, rtol=1e-5, atol=1e-6)
    assert set(m_o) == set(m_t)
    for key in m_t:
        torch.testing.assert_close(torch.as_tensor(m_o[key]).double(), torch.as_tensor(m_t[key]).double(),
                                   rtol=1e-5, atol=1e-6, msg=key)
    if g_t is not None:
        torch.testing.assert_close(g_o, g_t, rtol=1e-5, atol=1e-7)


def _groups(rank, world, tp, cp):
    """TP groups of consecutive ranks, CP groups across them: rank r is TP rank r % tp, CP rank r // tp."""
    import torch.distributed as dist

    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(world // tp)]
    cp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    tp_rank, cp_rank = rank % tp, rank // tp
    return tp_rank, cp_rank, tp_groups[cp_rank], (cp_groups[tp_rank] if cp > 1 else None)


def _with_and_without(fn, *args, **kw):
    """``fn(*args, **kw)`` with NeMo-RL's own code, then with the plugin installed."""
    theirs = fn(*args, **kw)
    ce_nemo_rl.install()
    try:
        ours = fn(*args, **kw)
    finally:
        ce_nemo_rl.uninstall()
    return ours, theirs


def _pack(model_utils, logits, lengths, cp, cp_rank, multiple):
    """NeMo-RL's packed layout of ``[B, S, V]`` logits: each sequence padded to ``multiple`` tokens, CP-sharded
    by NeMo-RL's own helper, concatenated: ``[1, T_packed // cp, V]`` and the two cu_seqlens."""
    padded = [(int(n) + multiple - 1) // multiple * multiple for n in lengths]
    rows = []
    for i, (n, p) in enumerate(zip(lengths, padded, strict=True)):
        seq = torch.zeros(p, logits.shape[-1], dtype=logits.dtype)
        seq[:min(int(n), logits.shape[1])] = logits[i, :int(n)]
        rows.append(model_utils._get_tokens_on_this_cp_rank(seq, cp_rank, cp, seq_dim=0))
    cu = torch.tensor([0, *torch.as_tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return torch.cat(rows).unsqueeze(0), cu, cu_padded


def _parity_worker(rank, world, tp, cp):
    model_utils, loss_utils, loss_functions, sampling = _import_nemo_rl()
    tp_rank, cp_rank, tp_group, cp_group = _groups(rank, world, tp, cp)
    data, logits = _batch(V_LOCAL * tp, seed=3)
    shard = logits[..., tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL]
    local = model_utils._get_tokens_on_this_cp_rank(shard, cp_rank, cp, seq_dim=1) if cp > 1 else shard
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    valid = (data["sample_mask"].sum(), mask.sum())
    # Under CP, NeMo-RL's AllGatherCPTensor.backward pins host memory and calls .cuda(): it cannot run on a CPU,
    # so CP compares values and metrics (the gradients are compared at TP 1 and 2)
    backward = cp == 1
    losses = _losses(loss_functions)
    groups = dict(vocab_parallel_rank=tp_rank, vocab_parallel_group=tp_group, context_parallel_group=cp_group)
    filters = [sampling.TrainingSamplingParams(top_p=0.9), sampling.TrainingSamplingParams(top_k=6),
               sampling.TrainingSamplingParams(top_k=10, top_p=0.95)]
    cases = [("clipped_pg", dict(chunk_size=None)), ("clipped_pg", dict(chunk_size=4))]
    cases += [("clipped_pg", dict(chunk_size=c, sampling_params=f)) for f in filters for c in (None, 4)]
    cases += [("distillation", {}), ("distillation_topk_only", {})]
    for name, kw in cases:  # the unpacked route: prepare_loss_input
        ours, theirs = _with_and_without(_step, loss_utils.prepare_loss_input, losses[name], local, data,
                                         valid, backward, **groups, **kw)
        _same(ours, theirs)
    # the packed route: prepare_packed_loss_input (Megatron's sequence packing; it needs a TP group)
    def packed_input(*args, **kw):  # looked up at each call: the plugin replaces it in NeMo-RL's module
        return loss_utils.prepare_packed_loss_input(*args, **kw)

    packed, cu, cu_padded = _pack(model_utils, shard, data["input_lengths"], cp, cp_rank, multiple=2 * cp)
    for kw in (dict(chunk_size=None), dict(chunk_size=4), *(dict(chunk_size=c, sampling_params=f)
                                                           for f in filters for c in (None, 4))):
        ours, theirs = _with_and_without(_step, packed_input, losses["clipped_pg"], packed,
                                         data, valid, backward, cu_seqlens_q=cu,
                                         cu_seqlens_q_padded=cu_padded, **groups, **kw)
        _same(ours, theirs)
    # NeMo-RL's filtered Functions themselves, called as its routes call them: values (-inf included) and the
    # gradient for a random upstream, -inf tokens included (NeMo-RL's loss masks them; the Function does not)
    if cp == 1:
        target = data["input_ids"].roll(-1, dims=-1)
        up = torch.randn(B, S, generator=torch.Generator().manual_seed(9))
        for f in filters:
            for name, extra in (("DistributedLogprobWithSampling", ()),
                                ("ChunkedDistributedLogprobWithSampling", (4,))):
                def run(name=name, extra=extra, f=f):
                    x = shard.clone().requires_grad_()
                    lp = getattr(model_utils, name).apply(x, target, tp_group, f.top_k, f.top_p, *extra)
                    torch.autograd.backward(lp, up)
                    return lp.detach(), x.grad
                (lp_o, g_o), (lp_t, g_t) = _with_and_without(run)
                assert torch.isinf(lp_t).any() and torch.isfinite(lp_t).any()
                torch.testing.assert_close(lp_o, lp_t, rtol=1e-5, atol=1e-6, msg=name)
                torch.testing.assert_close(g_o, g_t, rtol=1e-5, atol=1e-7, msg=name)


def _dtensor_worker(rank, world):
    """FSDP2 / DTensor TP: the logits a DTensor sharded on the vocabulary, NeMo-RL's DTensor route."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    _, loss_utils, loss_functions, sampling = _import_nemo_rl()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    data, logits = _batch(V_LOCAL * world, seed=5)
    shard = logits[..., rank * V_LOCAL:(rank + 1) * V_LOCAL]
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    valid = (data["sample_mask"].sum(), mask.sum())
    losses = _losses(loss_functions)

    def prepare(x, data, loss_fn, **kw):
        return loss_utils.prepare_loss_input(DTensor.from_local(x, mesh, [Shard(2)]), data, loss_fn, **kw)

    for name in losses:
        ours, theirs = _with_and_without(_step, prepare, losses[name], shard, data, valid)
        _same(ours, theirs)
    for f in (sampling.TrainingSamplingParams(top_p=0.9), sampling.TrainingSamplingParams(top_k=6, top_p=0.95)):
        ours, theirs = _with_and_without(_step, prepare, losses["clipped_pg"], shard, data, valid, sampling_params=f)
        _same(ours, theirs)


@needs_nemo_rl
def test_parity_dtensor_route_tp2():
    run_distributed(_dtensor_worker, 2, timeout_s=120)


@needs_nemo_rl
@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "cp2"])
def test_parity_prepare_loss_input_and_losses(tp, cp):
    run_distributed(_parity_worker, tp * cp, tp, cp, timeout_s=120)


def _plain_worker(rank, world):
    """TP 1 FSDP2 without a DTensor: a plain ``[B, S, V]`` tensor and no group. NeMo-RL's own plain route moves
    the ids with ``.cuda()`` and cannot run on a CPU; the plugin's result is compared with NeMo-RL's route over a
    group of one rank (the same log-probs, by NeMo-RL's own code) and with the float64 reference."""
    import torch.distributed as dist

    from tests.helpers import reference

    model_utils, loss_utils, loss_functions, sampling = _import_nemo_rl()
    one = dist.new_group([rank])
    data, logits = _batch(V_LOCAL, seed=7)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    valid = (data["sample_mask"].sum(), mask.sum())
    losses = _losses(loss_functions)
    filters = {"top_p": sampling.TrainingSamplingParams(top_p=0.9),
               "top_k_top_p": sampling.TrainingSamplingParams(top_k=6, top_p=0.95)}
    cases = {**{name: (fn, None) for name, fn in losses.items()},
             **{f"clipped_pg_{k}": (losses["clipped_pg"], f) for k, f in filters.items()}}
    theirs = {name: _step(loss_utils.prepare_loss_input, fn, logits, data, valid, vocab_parallel_rank=0,
                          vocab_parallel_group=one, sampling_params=f) for name, (fn, f) in cases.items()}
    ce_nemo_rl.install()
    try:
        ours = {name: _step(loss_utils.prepare_loss_input, fn, logits, data, valid, sampling_params=f)
                for name, (fn, f) in cases.items()}
        x = logits.double().requires_grad_()
        lp = model_utils.get_next_token_logprobs_from_logits(data["input_ids"], x)
    finally:
        ce_nemo_rl.uninstall()
    for name in cases:
        _same(ours[name], theirs[name])
    want, _ = reference(x.detach()[:, :-1].clone(), data["input_ids"][:, 1:])
    torch.testing.assert_close(lp, want, rtol=1e-9, atol=1e-10)


@needs_nemo_rl
def test_parity_plain_tensor_route_tp1():
    run_distributed(_plain_worker, 1, timeout_s=120)


@needs_nemo_rl
def test_install_patches_nemo_rl_and_a_mismatch_leaves_it_as_it_was(monkeypatch):
    model_utils, loss_utils, _, _ = _import_nemo_rl()
    import nemo_rl.algorithms.loss as loss_package

    own = {(m, n): getattr(sys.modules[m], n) for m, n in ce_nemo_rl.TARGETS if m in sys.modules}
    assert len(own) >= 11  # every target but the Megatron train module (it imports megatron-bridge)
    try:
        ce_nemo_rl.install()
        ce_nemo_rl.install()  # idempotent
        for m, n in own:
            assert getattr(sys.modules[m], n) is getattr(ce_nemo_rl, n), (m, n)
    finally:
        ce_nemo_rl.uninstall()
    for (m, n), f in own.items():
        assert getattr(sys.modules[m], n) is f, (m, n)

    def other_contract(logits, data, loss_fn, cu_seqlens_q, cu_seqlens_q_padded, vocab_parallel_rank=None):
        return None

    monkeypatch.setattr(loss_package, "prepare_packed_loss_input", other_contract)
    with pytest.raises(RuntimeError, match="Nothing was patched"):
        ce_nemo_rl.install()
    assert not ce_nemo_rl.installed()
    assert model_utils.DistributedLogprob is own[("nemo_rl.distributed.model_utils", "DistributedLogprob")]
    assert loss_utils.get_next_token_logprobs_from_logits is own[(ce_nemo_rl._LOSS_UTILS,
                                                                  "get_next_token_logprobs_from_logits")]


def _hidden_worker(rank, world):
    """The linear-CE fusion route: NeMo-RL's from_parallel_hidden_states_to_logprobs, TP 1 or 2 (the hidden
    states sequence-parallel), with and without the plugin: log-probs and the gradients of the hidden states and
    the weight."""
    import torch.distributed as dist

    model_utils, _, _, _ = _import_nemo_rl()
    g = torch.Generator().manual_seed(11)
    s, b, h = 8, 2, 16
    hidden = torch.randn(s, b, h, generator=g)
    weight = torch.randn(V_LOCAL * world, h, generator=g) / 4
    target = torch.randint(0, V_LOCAL * world, (b, s), generator=g)
    up = torch.randn(b, s - 1, generator=g)
    rows = slice(rank * s // world, (rank + 1) * s // world)
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)

    def run():
        x = hidden[rows].clone().requires_grad_()
        w = weight[cols].clone().requires_grad_()
        lp = model_utils.from_parallel_hidden_states_to_logprobs(x, w, False, target, rank * V_LOCAL,
                                                                (rank + 1) * V_LOCAL, dist.group.WORLD,
                                                                chunk_size=3)
        (lp * up).sum().backward()
        return lp.detach(), x.grad, w.grad

    ours, theirs = _with_and_without(run)
    for a, t in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, t, rtol=1e-5, atol=1e-5)


@needs_nemo_rl
@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
def test_parity_hidden_state_route(world):
    run_distributed(_hidden_worker, world, timeout_s=120)


def test_ray_runtime_env_hook_adds_the_setup_hook_and_keeps_the_rest():
    """The launch-script switch: Ray's RAY_RUNTIME_ENV_HOOK gets the job's runtime_env (NeMo-RL's init_ray passes
    its env_vars) and must return it with every worker's setup hook pointing at install()."""
    env = {"env_vars": {"A": "1"}}
    out = ce_nemo_rl.ray_runtime_env_hook(env)
    assert out == {"env_vars": {"A": "1"},
                   "worker_process_setup_hook": "chunked_entropy.integrations.nemo_rl.install"}
    assert env == {"env_vars": {"A": "1"}}  # the caller's dict is not written
    assert ce_nemo_rl.ray_runtime_env_hook(None) == {
        "worker_process_setup_hook": "chunked_entropy.integrations.nemo_rl.install"}
    assert ce_nemo_rl.ray_runtime_env_hook(out) == out  # idempotent
    with pytest.raises(ValueError, match="already has worker_process_setup_hook='mine.setup'"):
        ce_nemo_rl.ray_runtime_env_hook({"worker_process_setup_hook": "mine.setup"})


def _mixed_half_worker(rank, world):
    """``DistillationLossFn(kl_type="mixed", zero_outside_topk=True)`` on bf16/fp16 logits: the logits' gradient
    within one rounding of NeMo-RL's own float32 result on the same values, as NeMo-RL's (it upcasts once and
    rounds once). The plugin summed two half-precision pieces, the top-k log-probs' and the entropy's: 2.2-2.75x
    NeMo-RL's error, up to 256 half-ulps."""
    _, loss_utils, loss_functions, _ = _import_nemo_rl()
    tp_rank, _, tp_group, _ = _groups(rank, world, world, 1)
    data, logits = _batch(V_LOCAL * world, seed=11, k=6)
    shard = logits[..., tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL]
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    valid = (data["sample_mask"].sum(), mask.sum())
    loss_fn = _losses(loss_functions)["distillation"]
    groups = dict(vocab_parallel_rank=tp_rank, vocab_parallel_group=tp_group, context_parallel_group=None)
    for dtype, bits in ((torch.bfloat16, 8), (torch.float16, 11)):
        x = shard.to(dtype)
        _, _, g_ref = _step(loss_utils.prepare_loss_input, loss_fn, x.float(), data, valid, **groups)
        ours, theirs = _with_and_without(_step, loss_utils.prepare_loss_input, loss_fn, x, data, valid, **groups)
        g_ref = g_ref.double()
        # half an ulp of the reference in the half-precision dtype, subnormals included (its float32 error is far
        # below)
        half_ulp = torch.exp2(torch.floor(torch.log2(g_ref.abs().clamp_min(torch.finfo(dtype).smallest_normal)))
                              - bits)
        errs = {}
        for name, (_, _, g) in (("ours", ours), ("theirs", theirs)):
            assert g.dtype == dtype
            errs[name] = (g.double() - g_ref).abs()
        assert (errs["theirs"] <= half_ulp * 1.001 + 1e-12).all()  # NeMo-RL: one rounding
        assert (errs["ours"] <= half_ulp * 1.001 + 1e-12).all(), (errs["ours"] / half_ulp).max()
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


@needs_nemo_rl
@pytest.mark.parametrize("world", [1, 2])
def test_mixed_distillation_in_half_precision_rounds_its_gradient_once(world):
    run_distributed(_mixed_half_worker, world, timeout_s=180)
