"""Miles: the plugin against Miles's contract (here, in CI) and against Miles's own code (from its source).

Miles is not on the package index, so CI cannot install it. The contract tests
run the plugin's ``calculate_log_probs_and_entropy`` as Miles calls it (one
response's rows of this rank's vocabulary shard, Miles's arguments and result
shapes) with real megatron-core ``parallel_state`` groups over gloo (TP 1 and
2), against float64: temperature, chunk sizes (``-1`` too), ``entropy_requires_grad``,
empty responses. The slicing (packed and padded layouts, context parallelism,
``--allgather-cp``) stays Miles's own ``get_responses``; the parity tests run
it, importing Miles's real modules from a source checkout named by
``CHUNKED_ENTROPY_MILES_SRC`` (checked at commit 31f1ca96), and compare the
plugin with Miles's own functions, values and gradients; without it they skip,
saying what to set.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import pytest
import torch

from chunked_entropy.integrations import miles as ce_miles
from tests.helpers import require, run_distributed
from tests.packed import V_LOCAL, local_logits, reference, samples, zigzag_of

require("megatron.core")

MILES_SRC = os.environ.get("CHUNKED_ENTROPY_MILES_SRC")
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"


def _contract(rank, world):
    for tp in (2, 1):  # two ranks: TP 2, then TP 1 (each rank its own group of one)
        _contract_at(rank, tp)


def _contract_at(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    rank = parallel_state.get_tensor_model_parallel_rank()
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        g = torch.Generator().manual_seed(5)
        v = V_LOCAL * world
        z = torch.randn(9, v, generator=g, dtype=torch.float64) * 2
        tokens = torch.randint(0, v, (9,), generator=g)
        ups = torch.randn(9, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
        shard = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
        for chunk_size, temperature, requires_grad, dtype in ((-1, 1.0, True, torch.float64),
                                                              (4, 0.7, False, torch.float32)):
            x = z[:, shard].to(dtype).requires_grad_()
            snapshot = x.detach().clone()
            lp, ent = ce_miles.calculate_log_probs_and_entropy(
                x, tokens, group, with_entropy=True, entropy_requires_grad=requires_grad, chunk_size=chunk_size,
                temperature=temperature,
            )
            assert lp.shape == (9, 1) and ent.shape == (9,)  # Miles's shapes: get_responses squeezes lp
            assert ent.requires_grad == requires_grad and torch.equal(x.detach(), snapshot)
            zr = z.clone().requires_grad_()
            logp = torch.log_softmax(zr / temperature, -1)
            lp_ref = logp.gather(1, tokens[:, None])
            ent_ref = -(logp.exp() * logp).sum(-1)
            tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(lp.double(), lp_ref.detach(), **tol)
            torch.testing.assert_close(ent.double(), ent_ref.detach(), **tol)
            loss = (lp.double().squeeze(-1) * ups[0]).sum() + ((ent.double() * ups[1]).sum() if requires_grad else 0)
            want = (lp_ref.squeeze(-1) * ups[0]).sum() + ((ent_ref * ups[1]).sum() if requires_grad else 0)
            loss.backward()
            want.backward()
            torch.testing.assert_close(x.grad.double(), zr.grad[:, shard], **tol)
        lp, ent = ce_miles.calculate_log_probs_and_entropy(z[:0, shard], tokens[:0], group, with_entropy=True)
        assert lp.shape == (0,) and ent.shape == (0,)  # as Miles returns an empty response
        lp, ent = ce_miles.calculate_log_probs_and_entropy(z[:, shard], tokens, group, with_entropy=False)
        assert ent is None
    finally:
        parallel_state.destroy_model_parallel()


def test_contract_of_calculate_log_probs_and_entropy():
    """TP 2 and TP 1: one spawn of two ranks."""
    run_distributed(_contract, 2, timeout_s=180)


# ------------------------------------------------------------ parity with Miles's own code


needs_miles = pytest.mark.skipif(
    not MILES_SRC,
    reason="set CHUNKED_ENTROPY_MILES_SRC to a checkout of https://github.com/radixark/miles at commit "
           f"{MILES_COMMIT} (its loss modules import with megatron-core 0.16.1)",
)


def _import_miles():
    if MILES_SRC not in sys.path:  # appended: Miles has a package named tests too; this project's comes first
        sys.path.append(MILES_SRC)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import miles.backends.training_utils.loss as loss
        import miles.backends.training_utils.loss_hub.logit_processors as processors
        import miles.backends.training_utils.loss_hub.losses as losses
        import miles.backends.training_utils.loss_hub.math_utils as math_utils
    return math_utils, processors, losses, loss


def _miles_parallel_state():
    """Miles's ParallelState from megatron-core's groups, as its Megatron backend builds it."""
    from megatron.core import parallel_state as mpu
    from miles.backends.training_utils.parallel import ParallelState, set_parallel_state
    from miles.utils.ft_utils.process_group_utils import GroupInfo

    def info(rank, size, group):
        return GroupInfo(rank=rank, size=size, group=group)

    dp = info(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(), mpu.get_data_parallel_group())
    set_parallel_state(ParallelState(
        intra_dp=dp, intra_dp_cp=info(mpu.get_data_parallel_rank(with_context_parallel=True),
                                      mpu.get_data_parallel_world_size(with_context_parallel=True),
                                      mpu.get_data_parallel_group(with_context_parallel=True)),
        cp=info(mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size(),
                mpu.get_context_parallel_group()),
        tp=info(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                mpu.get_tensor_model_parallel_group()),
        pp=info(mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size(),
                mpu.get_pipeline_model_parallel_group()),
        ep=info(0, 1, None), etp=info(0, 1, None), indep_dp=info(0, 1, None),
    ))


def _parity_worker(rank, world, tp, cp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
    _, processors, _, _ = _import_miles()
    theirs = processors.__dict__["get_log_probs_and_entropy"]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        _miles_parallel_state()
        for mode in (["cp1"] if cp == 1 else ["zigzag", "allgather"]):
            _parity(theirs, tp, cp, mode)
    finally:
        parallel_state.destroy_model_parallel()


def _parity(theirs_fn, tp, cp, mode):
    from megatron.core import parallel_state as mpu

    tp_rank, cp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank()
    tokens, totals, resps, ids, offsets, logits, ups = samples(seed=13, v=V_LOCAL * tp)
    for temperature, requires_grad in ((0.7, True), (1.0, False)):
        args = argparse.Namespace(rollout_temperature=temperature, log_probs_chunk_size=4,
                                  allgather_cp=(mode == "allgather"), qkv_format="thd", true_on_policy_mode=False)
        local = local_logits(logits, totals, cp, cp_rank, mode)[:, tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL]
        results = []
        for fn in (theirs_fn, ce_miles.get_log_probs_and_entropy):
            x = local.float().unsqueeze(0).requires_grad_()
            res = fn(x, args=args, unconcat_tokens=tokens, total_lengths=totals, response_lengths=resps,
                     with_entropy=True, entropy_requires_grad=requires_grad)
            loss = sum((lp.double() * zigzag_of(u[0], t, r, cp, cp_rank)).sum()
                       for lp, u, t, r in zip(res["log_probs"], ups, totals, resps, strict=True))
            if requires_grad:
                loss = loss + sum((h.double() * zigzag_of(u[1], t, r, cp, cp_rank)).sum()
                                  for h, u, t, r in zip(res["entropy"], ups, totals, resps, strict=True))
            loss.backward()
            results.append((res, x.grad))
        (theirs, g_theirs), (ours, g_ours) = results
        full = torch.cat(logits).requires_grad_()
        want = reference(tokens, totals, resps, ids, offsets, list(full.split(totals)), temperature, with_topp=False)
        for key, idx in (("log_probs", 0), ("entropy", 1)):
            for s, (a, b) in enumerate(zip(ours[key], theirs[key], strict=True)):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-5)
                ref = zigzag_of(want[s][idx], totals[s], resps[s], cp, cp_rank)
                torch.testing.assert_close(a.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        # the gradient against float64 (every rank's tokens, each once) ...
        ref_loss = sum((lp * u[0]).sum() + ((h * u[1]).sum() if requires_grad else 0)
                       for (lp, h), u in zip(want, ups, strict=True))
        ref_loss.backward()
        g_ref = local_logits(list(full.grad.split(totals)), totals, cp, cp_rank, mode)
        torch.testing.assert_close(g_ours[0].double(), g_ref[:, tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL],
                                   rtol=1e-5, atol=1e-6)
        # ... and Miles's own within the error of megatron-core 0.16.1's fused vocab-parallel cross entropy,
        # whose gradient is off by up to ~3e-3 of its size on CPU (its unfused twin is exact; see the Miles page)
        assert (g_ours - g_theirs).abs().max() <= 5e-3 * g_ours.abs().max()


@needs_miles
@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "cp2"])
def test_parity_with_miles_own_functions(tp, cp):
    run_distributed(_parity_worker, tp * cp, tp, cp, timeout_s=300)


@needs_miles
def test_install_patches_every_place_miles_looks_the_functions_up(monkeypatch):
    math_utils, processors, losses, loss = _import_miles()
    own_calc = math_utils.__dict__["calculate_log_probs_and_entropy"]
    own_get = processors.__dict__["get_log_probs_and_entropy"]
    try:
        ce_miles.install(argparse.Namespace())
        for module in (math_utils, processors):
            assert module.calculate_log_probs_and_entropy is ce_miles.calculate_log_probs_and_entropy
        for module in (processors, losses, loss):
            assert module.get_log_probs_and_entropy is ce_miles.get_log_probs_and_entropy
        # true_on_policy mode runs Miles's own code, bit for bit
        g = torch.Generator().manual_seed(3)
        x, t = torch.randn(5, 11, generator=g), torch.randint(0, 11, (5,), generator=g)
        ours = ce_miles.calculate_log_probs_and_entropy(x, t, None, with_entropy=True, true_on_policy=True)
        theirs = own_calc(x, t, None, with_entropy=True, true_on_policy=True)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        ce_miles.uninstall()
        assert math_utils.calculate_log_probs_and_entropy is own_calc and losses.get_log_probs_and_entropy is own_get

        def other_contract(logits, tokens, group):
            return None

        monkeypatch.setattr(processors, "calculate_log_probs_and_entropy", other_contract)
        with pytest.raises(RuntimeError, match="Nothing was patched"):
            ce_miles.install()
        assert math_utils.calculate_log_probs_and_entropy is own_calc and not ce_miles.installed()
    finally:
        ce_miles.uninstall()
