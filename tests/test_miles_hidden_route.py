"""Miles's hidden-state route against its logits route, through Miles's own ``get_log_probs_and_entropy`` name.

The tiny CPU ``GPTModel`` of tests/test_slime_hidden_route.py, called as
Miles's Megatron actor calls it (``labels=None``, ``loss_mask=``), in Miles's
packed ``thd`` layout (TP 1, and TP 2 with sequence parallelism) and its
padded ``bshd`` layout (TP 1, ``max_seq_lens``); what comes back goes to the
``get_log_probs_and_entropy`` Miles's loss module looks up, with the plugin
installed on the logits route and on the hidden-state route: log-probs,
entropy (with and without its gradient) and every parameter's gradient of a
weighted sum agree. The same on megatron-core 0.16.1's ``MambaModel``
(attention and MLP layers only, tests/verl_engine.py; its post-processing is
inline in its ``forward``) and on the reproduction of 0.19's ``HybridModel``
there (upstream lines cited). Needs Miles's source
(``CHUNKED_ENTROPY_MILES_SRC``); skips without it.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import pytest
import torch

from chunked_entropy.integrations import _hidden_route
from chunked_entropy.integrations import miles as ce_miles
from tests.helpers import require, run_distributed
from tests.test_integrations_miles import MILES_COMMIT, MILES_SRC, _miles_parallel_state
from tests.test_slime_hidden_route import LENGTHS, _batch

require("megatron.core", "verl")

needs_miles = pytest.mark.skipif(
    not MILES_SRC,
    reason=f"set CHUNKED_ENTROPY_MILES_SRC to a checkout of https://github.com/radixark/miles at commit {MILES_COMMIT}",
)


def _bshd(v, seed=0):
    """Miles's padded layout: [B, S] tokens, each sample left-aligned in a row of ``max(total)``."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, v, (t,), generator=g) for t, _ in LENGTHS]
    s = max(t for t, _ in LENGTHS)
    padded = torch.stack([torch.nn.functional.pad(t, (0, s - t.numel())) for t in tokens])
    return tokens, padded, [s] * len(LENGTHS)


def _run(loss_mod, model, args, kw, tokens, max_seq_lens, ups):
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    res = loss_mod.get_log_probs_and_entropy(
        out, args=args, unconcat_tokens=tokens, total_lengths=[t for t, _ in LENGTHS],
        response_lengths=[r for _, r in LENGTHS], with_entropy=True, entropy_requires_grad=args.entropy_coef != 0,
        max_seq_lens=max_seq_lens)
    loss = sum((lp * u[0]).sum() for lp, u in zip(res["log_probs"], ups, strict=True))
    if args.entropy_coef != 0:
        loss = loss + sum((h * u[1]).sum() for h, u in zip(res["entropy"], ups, strict=True))
    loss.backward()
    return out, res, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

        from tests import verl_engine
    if MILES_SRC not in sys.path:  # appended: Miles has a package named tests too; this project's comes first
        sys.path.append(MILES_SRC)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import miles.backends.training_utils.loss as loss_mod
    g = torch.Generator().manual_seed(5)
    ups = [(torch.randn(r, generator=g), torch.randn(r, generator=g)) for _, r in LENGTHS]
    for tp, fmt in ((world, "thd"), (1, "thd"), (1, "bshd")):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            _miles_parallel_state()
            with verl_engine.cpu_only_replacements(), verl_engine.sequence_parallel_on_cpu():
                build = {"gpt": verl_engine.gpt_model, "mamba": verl_engine.mamba_model,
                         "hybrid019": verl_engine.hybrid_model_019}[kind]
                model = build(tp, tied=(fmt == "bshd"), seed=2, sequence_parallel=tp > 1)
                for coef in (0.01, 0.0):
                    args = argparse.Namespace(rollout_temperature=0.8, log_probs_chunk_size=4, allgather_cp=False,
                                              qkv_format=fmt, true_on_policy_mode=False, entropy_coef=coef)
                    if fmt == "thd":
                        batch = _batch(tp, verl_engine.V, False, seed=4)
                        tokens, max_seq_lens = batch["unconcat_tokens"], None
                        kw = dict(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                                  packed_seq_params=batch["packed_seq_params"], loss_mask=batch["full_loss_masks"])
                    else:
                        tokens, padded, max_seq_lens = _bshd(verl_engine.V, seed=4)
                        pos = torch.arange(padded.shape[1]).expand_as(padded)
                        kw = dict(input_ids=padded, position_ids=pos, attention_mask=None, labels=None)
                    if kind == "mamba":  # megatron-core 0.16.1's MambaModel.forward takes no loss_mask (0.19's does)
                        kw.pop("loss_mask", None)
                    results = {}
                    for route in ("logits", "hidden"):
                        ce_miles.install(args, route=route)
                        try:
                            results[route] = _run(loss_mod, model, args, kw, tokens, max_seq_lens, ups)
                        finally:
                            ce_miles.uninstall()
                    (out_l, res_l, g_l), (out_h, res_h, g_h) = results["logits"], results["hidden"]
                    assert isinstance(out_l, torch.Tensor) and isinstance(out_h, _hidden_route.HiddenStates)
                    for key in ("log_probs", "entropy"):
                        for a, b in zip(res_h[key], res_l[key], strict=True):
                            assert a.shape == b.shape
                            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
                        assert res_h["entropy"][0].requires_grad == (coef != 0)
                    for name in g_l:
                        torch.testing.assert_close(g_h[name], g_l[name], rtol=1e-4, atol=1e-6, msg=name)
        finally:
            parallel_state.destroy_model_parallel()
            verl_engine.drop_hybrid_019()


@needs_miles
@pytest.mark.parametrize("kind", ["gpt", "mamba", "hybrid019"])
def test_hidden_route_matches_logits_route_thd_bshd_tp1_tp2(kind):
    """GPTModel; megatron-core 0.16.1's MambaModel (attention and MLP layers); 0.19's HybridModel, reproduced
    (tests/verl_engine.py, with the upstream lines cited)."""
    run_distributed(_worker, 2, kind, timeout_s=300)


def test_true_on_policy_mode_gets_the_logits_route():
    try:
        ce_miles.install(argparse.Namespace(true_on_policy_mode=True))
        assert ce_miles.route() == "logits"
    finally:
        ce_miles.uninstall()
    assert ce_miles.route() is None


@pytest.mark.parametrize("args, reason", [
    (dict(loss_type="custom_loss"), "--loss-type custom_loss (a custom loss may read the logits itself)"),
    (dict(loss_type="custom_loss", true_on_policy_mode=True), "Miles's true_on_policy mode"),
])
def test_custom_loss_gets_the_logits_route_after_miles_own_fallback(args, reason, caplog):
    """The custom-loss fallback the trainers share (_hidden_route's RoutedAdapter) holds for Miles too, after
    Miles's own: with both set the warning names true_on_policy mode."""
    import logging

    _hidden_route._warned.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="chunked_entropy.integrations"):
            ce_miles.install(argparse.Namespace(**args))
        assert ce_miles.route() == "logits"
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 1 and reason in messages[0], messages
    finally:
        ce_miles.uninstall()
    assert ce_miles.route() is None


def _cp_worker(rank, world):
    from tests import verl_engine
    from tests.packed import samples
    from tests.test_integrations_miles import _import_miles
    from tests.test_slime_hidden_route import cp_runs

    _, processors, _, loss_mod = _import_miles()
    tokens, totals, resps, _, _, _, ups = samples(seed=23, v=verl_engine.V)
    hidden_full = torch.randn(sum(totals), verl_engine.HID, generator=torch.Generator().manual_seed(6))
    ce_miles.install(argparse.Namespace(), route="hidden")
    try:
        assert loss_mod.get_log_probs_and_entropy is ce_miles.get_log_probs_and_entropy
        for coef in (0.01, 0.0):
            def call(states, allgather, coef=coef):
                args = argparse.Namespace(rollout_temperature=0.7, log_probs_chunk_size=4, allgather_cp=allgather,
                                          qkv_format="thd", true_on_policy_mode=False, entropy_coef=coef)
                res = loss_mod.get_log_probs_and_entropy(
                    states, args=args, unconcat_tokens=tokens, total_lengths=totals, response_lengths=resps,
                    with_entropy=True, entropy_requires_grad=coef != 0, max_seq_lens=None)
                # (Miles's allgather_cp_redistribute all-reduces a cat that may hold its own requires_grad zeros)
                assert allgather or res["entropy"][0].requires_grad == (coef != 0)
                return res

            cp_runs(world, False, hidden_full, totals, resps, ups, coef, call, setup=_miles_parallel_state)
    finally:
        ce_miles.uninstall()


@needs_miles
def test_hidden_route_context_parallel_2_matches_no_cp():
    """Context parallelism 2 over gloo, Miles's packed ``thd`` layout, zigzag and ``--allgather-cp`` (Miles's own
    ``get_responses`` and ``allgather_cp_redistribute``), the entropy's gradient on and off: each CP rank's
    per-sample outputs equal its part of the run without CP; the gradients of the hidden states and of every
    parameter, summed over the CP group, equal the run without CP's. The hidden states are given, as in
    tests/test_slime_hidden_route.py's CP test (the decoder's CP attention is Transformer Engine's, CUDA only)."""
    run_distributed(_cp_worker, 2, timeout_s=180)
