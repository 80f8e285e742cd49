"""verl 0.9.1's MTP heads (``model.mtp.enable_train``), each MTP loss from the fused head, in both megatron-core modes.

Driven through verl's real ``MegatronEngineWithLMHead.forward_step`` (MTP
training on, verl's own ``patch_engine_mtp``; ``use_fused_kernels`` off and on) on a tiny GPTModel
with one or two MTP layers (packed ``thd``, unequal lengths), TP 1 and 2 over
gloo, tied and untied. The reference is verl's own MTP path on the same
weights: the MTP loss verl logs (megatron-core's tracker), the main head's
outputs and every parameter's gradient. What cannot run on a CPU is replaced
in one helper (:mod:`tests.verl_engine`).

Hook mode (megatron-core >= 0.18, which needs Python >= 3.12 here): the same
model as a GPTModel subclass with megatron-core 0.19's ``forward``/``_postprocess``
contract, and verl's ``mtp_patch`` as it imports under 0.19 (its
``_process_mtp_loss`` is :func:`tests.verl_engine.process_mtp_loss_019`, written
after megatron-core's): the reference is verl's own postprocess calling it
(also the logged acceptance counts); ``mtp_detach_heads`` on and off.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import require, run_distributed

require("megatron.core", "verl")

from chunked_entropy.integrations import verl as ce_verl  # noqa: E402
from tests import verl_engine as ve  # noqa: E402

LENGTHS = [9, 5, 13]


def _run(world, tied, mtp_layers, ups, fused=False):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from verl.utils.megatron_utils import patch_engine_mtp

    model = ve.gpt_model(world, tied=tied, seed=7, mtp_layers=mtp_layers)
    eng = ve.engine(model, fused=fused, mtp_train=True)
    assert eng.engine_config.use_fused_kernels == fused
    eng.model_config.mtp.detach_encoder = False
    patch_engine_mtp([model], eng.model_config)  # what verl's initialize() does under MTP
    MTPLossLoggingHelper.tracker["values"].zero_()
    data = ve.batch(LENGTHS, seed=3, temperatures=[0.9, 1.2, 1.0], flags=dict(calculate_entropy=True))
    out = ve.forward(eng, model, data)
    ((out["log_probs"].values() * ups[0]).sum() + (out["entropy"].values() * ups[1]).sum()).backward()
    logged = MTPLossLoggingHelper.tracker["values"][:mtp_layers].clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.values().detach() for k, v in out.items()}, logged, grads


def _compare(rank, world):
    from megatron.core import parallel_state

    from chunked_entropy.integrations.verl import mtp

    parallel_state.initialize_model_parallel(world)
    g = torch.Generator().manual_seed(1)
    ups = (torch.randn(sum(LENGTHS), generator=g), torch.randn(sum(LENGTHS), generator=g))
    try:
        with ve.cpu_only_replacements():
            # each of (tied, untied) x (unfused, fused route) once over TP 1 and 2 (the suite's time)
            cases = ((False, 1, False), (True, 2, True)) if world == 1 else ((True, 2, False), (False, 1, True))
            for tied, layers, fused in cases:
                what = f"rank {rank} tp {world} tied={tied} mtp_layers={layers} fused route={fused}"
                theirs, logged_theirs, g_theirs = _run(world, tied, layers, ups)
                ce_verl.install()
                calls = []
                own = mtp.mtp_losses
                mtp.mtp_losses = lambda *a, calls=calls, own=own, **k: (
                    calls.append(1) or own(*a, **{**k, "chunk_size": 4}))
                try:
                    ours, logged_ours, g_ours = _run(world, tied, layers, ups, fused=fused)
                finally:
                    mtp.mtp_losses = own
                    ce_verl.uninstall()
                assert calls == [1], what
                assert torch.all(logged_theirs > 0), what
                torch.testing.assert_close(logged_ours, logged_theirs, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, w=what: f"{w} logged MTP loss: {m}")
                for k in theirs:
                    torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-5,
                                               msg=lambda m, k=k, w=what: f"{w} {k}: {m}")
                assert g_ours.keys() == g_theirs.keys(), what
                assert any(n.startswith("mtp.") for n in g_theirs), what
                for n in g_theirs:
                    torch.testing.assert_close(g_ours[n], g_theirs[n], rtol=1e-4, atol=1e-6,
                                               msg=lambda m, n=n, w=what: f"{w} grad {n}: {m}")
    finally:
        parallel_state.destroy_model_parallel()


def _run_hook(world, tied, mtp_layers, detach_heads, ups, fused=False):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from verl.utils.megatron_utils import patch_engine_mtp

    model = ve.with_output_processor_hook(ve.gpt_model(world, tied=tied, seed=7, mtp_layers=mtp_layers))
    model.config.mtp_detach_heads = detach_heads  # megatron-core 0.19's option (absent from 0.16.1's config)
    eng = ve.engine(model, fused=fused, mtp_train=True)
    assert eng.engine_config.use_fused_kernels == fused  # with the plugin, the fused route stays on under MTP
    eng.model_config.mtp.detach_encoder = False
    patch_engine_mtp([model], eng.model_config)
    tracker = MTPLossLoggingHelper.tracker
    for key in ("loss_values", "correct_values", "total_values"):
        tracker.pop(key, None)
    data = ve.batch(LENGTHS, seed=3, temperatures=[0.9, 1.2, 1.0], flags=dict(calculate_entropy=True))
    out = ve.forward(eng, model, data)
    ((out["log_probs"].values() * ups[0]).sum() + (out["entropy"].values() * ups[1]).sum()).backward()
    logged = torch.stack([tracker[k][:mtp_layers] for k in ("loss_values", "correct_values", "total_values")])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.values().detach() for k, v in out.items()}, logged, grads


def _compare_hook(rank, world):
    from megatron.core import parallel_state

    from chunked_entropy.integrations.verl import mtp

    parallel_state.initialize_model_parallel(world)
    g = torch.Generator().manual_seed(1)
    ups = (torch.randn(sum(LENGTHS), generator=g), torch.randn(sum(LENGTHS), generator=g))
    try:
        with ve.cpu_only_replacements(), ve.megatron_019_mtp():
            from verl.models.mcore import mtp_patch

            real = mtp_patch._process_mtp_loss  # a process_mtp_loss of another contract: install refuses, nothing done
            mtp_patch._process_mtp_loss = lambda hidden_states, labels, loss_mask, output_layer, logits_fn: None
            try:
                with pytest.raises(RuntimeError, match="process_mtp_loss has the parameters"):
                    ce_verl.install()
                assert not ce_verl.installed()
            finally:
                mtp_patch._process_mtp_loss = real
            # (tied, mtp layers, mtp_detach_heads, fused route): tied and untied, both routes, at TP 1 and 2
            cases = ((False, 1, False, False), (True, 2, True, True)) if world == 1 else \
                ((True, 2, False, False), (False, 1, False, True))
            for tied, layers, detach, fused in cases:
                what = f"rank {rank} tp {world} tied={tied} mtp_layers={layers} detach={detach} fused route={fused}"
                theirs, logged_theirs, g_theirs = _run_hook(world, tied, layers, detach, ups)
                ce_verl.install()
                calls = []
                own = mtp.process_mtp_loss
                mtp.process_mtp_loss = lambda *a, calls=calls, own=own, **k: (
                    calls.append(1) or own(*a, **{**k, "chunk_size": 4}))
                try:
                    ours, logged_ours, g_ours = _run_hook(world, tied, layers, detach, ups, fused=fused)
                finally:
                    mtp.process_mtp_loss = own
                    ce_verl.uninstall()
                assert calls == [1], what
                assert torch.all(logged_theirs[0] > 0) and torch.all(logged_theirs[2] > 0), what
                torch.testing.assert_close(logged_ours, logged_theirs, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, w=what: f"{w} logged MTP loss, correct, total: {m}")
                for k in theirs:
                    torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-5,
                                               msg=lambda m, k=k, w=what: f"{w} {k}: {m}")
                assert g_ours.keys() == g_theirs.keys(), what
                assert any(n.startswith("mtp.") for n in g_theirs), what
                for n in g_theirs:
                    torch.testing.assert_close(g_ours[n], g_theirs[n], rtol=1e-4, atol=1e-6,
                                               msg=lambda m, n=n, w=what: f"{w} grad {n}: {m}")
    finally:
        parallel_state.destroy_model_parallel()


def _compare_both(rank, world):
    _compare(rank, world)
    _compare_hook(rank, world)


@pytest.mark.parametrize("world", [1, 2])
def test_mtp_losses_and_gradients_equal_verls_own_mtp_path_in_legacy_and_hook_mode_on_both_routes(world):
    """verl turns the fused route off under MTP; with the plugin it stays on and serves both the main head and the
    MTP losses. Legacy mode: megatron-core 0.16.1, verl's own MTP loop. Hook mode (>= 0.18, a GPTModel subclass
    with 0.19's contract): verl's postprocess calls megatron-core's process_mtp_loss; with the plugin its losses,
    logged metrics (loss, acceptance counts) and every gradient come from the fused head, and the fused route's
    output_processor is called after them. One process group for both modes (the suite's time)."""
    run_distributed(_compare_both, world, timeout_s=180)
