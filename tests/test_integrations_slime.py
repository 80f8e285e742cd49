"""slime: the plugin against slime's contract (here, in CI) and against slime's own code (from its source).

slime is not on the package index, so CI cannot install it. The contract
tests run the plugin's ``get_log_probs_and_entropy`` as slime calls it, with
real megatron-core ``parallel_state`` groups over gloo (TP 1 and 2; context
parallelism 2, zigzag and ``--allgather-cp``), on slime's packed layout, a
rollout temperature and top-p sets, against a float64 reference written from
the layout slime documents. The parity tests import slime's real modules from
a source checkout named by ``CHUNKED_ENTROPY_SLIME_SRC`` (checked at commit
624b824a) and compare the plugin with slime's own function; without it they
skip, saying what to set.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import pytest
import torch

from chunked_entropy.integrations import slime as ce_slime
from tests.helpers import require, run_distributed
from tests.packed import V_LOCAL, local_logits, reference, samples, zigzag_of

require("megatron.core")

SLIME_SRC = os.environ.get("CHUNKED_ENTROPY_SLIME_SRC")
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


def _check(rank, world, tp, cp, mode, temperature, with_topp, entropy_coef, dtype):
    from megatron.core import parallel_state as mpu

    tp_rank, cp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank()
    v = V_LOCAL * tp
    tokens, totals, resps, ids, offsets, logits, ups = samples(seed=3 + world, v=v)
    args = argparse.Namespace(rollout_temperature=temperature, log_probs_chunk_size=4, entropy_coef=entropy_coef,
                              allgather_cp=(mode == "allgather"))
    local = local_logits(logits, totals, cp, cp_rank, mode)[:, tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL]
    x = local.to(dtype).unsqueeze(0).requires_grad_()
    snapshot = x.detach().clone()
    kw = dict(top_p_token_ids=ids, top_p_token_offsets=offsets) if with_topp else {}
    empty, res = ce_slime.get_log_probs_and_entropy(
        x, args=args, unconcat_tokens=tokens, total_lengths=totals, response_lengths=resps, with_entropy=True, **kw
    )
    assert empty.numel() == 0 and set(res) == {"log_probs", "entropy"}
    assert torch.equal(x.detach(), snapshot)  # never written
    # the reference, laid out the way slime returns it on this rank
    full = [(torch.cat(logits)).requires_grad_()]
    per_sample = list(full[0].split(totals))
    ref = reference(tokens, totals, resps, ids, offsets, per_sample, temperature, with_topp)
    ours_loss = 0
    ref_loss = 0
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    for s, ((lp, ent), (up_lp, up_h)) in enumerate(zip(ref, ups, strict=True)):
        # this rank's part in the zigzag layout (--allgather-cp too, after slime's redistribution)
        want = [zigzag_of(t, totals[s], resps[s], cp, cp_rank) for t in (lp, ent, up_lp, up_h)]
        got_lp, got_h = res["log_probs"][s], res["entropy"][s]
        assert got_lp.shape == want[0].shape, (s, got_lp.shape, want[0].shape)
        torch.testing.assert_close(got_lp.double(), want[0].detach(), **tol)
        torch.testing.assert_close(got_h.double(), want[1].detach(), **tol)
        assert got_h.requires_grad == (entropy_coef != 0)
        ours_loss = ours_loss + (got_lp.double() * want[2]).sum()
        if entropy_coef != 0:
            ours_loss = ours_loss + (got_h.double() * want[3]).sum()
        # every rank's tokens together, each once: the reference loss is the sum over all of them
        ref_loss = ref_loss + (lp * up_lp).sum() + ((ent * up_h).sum() if entropy_coef != 0 else 0)
    ours_loss.backward()
    ref_loss.backward()
    want_grad = local_logits(list(full[0].grad.split(totals)), totals, cp, cp_rank, mode)
    torch.testing.assert_close(x.grad[0].double(), want_grad[:, tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL],
                               **tol)


def _worker(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

    # two ranks: TP 2; CP 2; then TP 1 (each rank its own group of one)
    for tp, cp in ((2, 1), (1, 2), (1, 1)):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        try:
            for mode in (["cp1"] if cp == 1 else ["zigzag", "allgather"]):
                _check(rank, world, tp, cp, mode, temperature=0.7, with_topp=True, entropy_coef=0.01,
                       dtype=torch.float64)
                _check(rank, world, tp, cp, mode, temperature=1.0, with_topp=False, entropy_coef=0.0,
                       dtype=torch.float32)
        finally:
            parallel_state.destroy_model_parallel()


def test_contract_packed_layout_temperature_cp_and_top_p():
    """TP 1 and 2, CP 2 (zigzag and --allgather-cp), with and without top-p sets: one spawn of two ranks."""
    run_distributed(_worker, 2, timeout_s=180)


def test_chunk_size_minus_one_is_the_documented_default():
    assert ce_slime._chunk_size(argparse.Namespace(log_probs_chunk_size=-1)) == ce_slime.DEFAULT_CHUNK_SIZE
    assert ce_slime._chunk_size(argparse.Namespace(log_probs_chunk_size=256)) == 256


# ------------------------------------------------------------ parity with slime's own code


needs_slime = pytest.mark.skipif(
    not SLIME_SRC,
    reason="set CHUNKED_ENTROPY_SLIME_SRC to a checkout of https://github.com/THUDM/slime at commit "
           f"{SLIME_COMMIT} (its loss module imports with megatron-core 0.16.1 and httpx)",
)


def _import_slime_loss():
    if SLIME_SRC not in sys.path:  # appended: Miles has a package named tests too; this project's comes first
        sys.path.append(SLIME_SRC)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import slime.backends.megatron_utils.loss as loss
    return loss


def _parity_worker(rank, world, tp, cp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
    loss = _import_slime_loss()
    theirs_fn = loss.__dict__["get_log_probs_and_entropy"]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        for mode in (["cp1"] if cp == 1 else ["zigzag", "allgather"]):
            _parity(theirs_fn, tp, cp, mode)
    finally:
        parallel_state.destroy_model_parallel()


def _parity(theirs_fn, tp, cp, mode):
    from megatron.core import parallel_state as mpu

    tp_rank, cp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank()
    v = V_LOCAL * tp
    tokens, totals, resps, ids, offsets, logits, ups = samples(seed=11, v=v)
    for temperature, topp, coef in ((0.7, True, 0.01), (1.0, False, 0.0)):
        args = argparse.Namespace(rollout_temperature=temperature, log_probs_chunk_size=4, entropy_coef=coef,
                                  allgather_cp=(mode == "allgather"))
        local = local_logits(logits, totals, cp, cp_rank, mode)[:, tp_rank * V_LOCAL:(tp_rank + 1) * V_LOCAL]
        kw = dict(top_p_token_ids=ids, top_p_token_offsets=offsets) if topp else {}
        results = []
        for fn in (theirs_fn, ce_slime.get_log_probs_and_entropy):
            x = local.float().unsqueeze(0).requires_grad_()
            _, res = fn(x, args=args, unconcat_tokens=tokens, total_lengths=totals, response_lengths=resps,
                        with_entropy=True, **kw)
            loss = sum((lp.double() * u[0][:lp.numel()]).sum() for lp, u in zip(res["log_probs"], ups, strict=True))
            if coef:
                loss = loss + sum((h.double() * u[1][:h.numel()]).sum() for h, u in zip(res["entropy"], ups,
                                                                                        strict=True))
            loss.backward()
            results.append((res, x.grad))
        (theirs, g_theirs), (ours, g_ours) = results
        for key in ("log_probs", "entropy"):
            for a, b in zip(ours[key], theirs[key], strict=True):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-6)


@needs_slime
@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "cp2"])
def test_parity_with_slimes_own_function(tp, cp):
    run_distributed(_parity_worker, tp * cp, tp, cp, timeout_s=300)


@needs_slime
def test_install_patches_slime_and_a_mismatch_leaves_it_as_it_was(monkeypatch):
    loss = _import_slime_loss()
    own = loss.__dict__["get_log_probs_and_entropy"]
    try:
        ce_slime.install(argparse.Namespace())
        assert loss.get_log_probs_and_entropy is ce_slime.get_log_probs_and_entropy
        ce_slime.install()  # idempotent
        ce_slime.uninstall()
        assert loss.get_log_probs_and_entropy is own

        def other_contract(logits, *, args, tokens):
            return None

        monkeypatch.setattr(loss, "get_log_probs_and_entropy", other_contract)
        with pytest.raises(RuntimeError, match="Nothing was patched"):
            ce_slime.install()
        assert loss.get_log_probs_and_entropy is other_contract and not ce_slime.installed()
    finally:
        ce_slime.uninstall()
