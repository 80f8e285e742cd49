"""verl's fused routes project only the rows verl reads (issue 35, item 4), through verl 0.9.1's real engine.

An RL micro-batch as verl's trainer makes it (left-padded prompts, right-padded
responses with tool tokens masked out, through verl's own
``left_right_2_no_padding``) is run through verl's real
``MegatronEngineWithLMHead.forward_step`` on the fused route served by the
plugin, with the rows on (the default) and off (``CHUNKED_ENTROPY_VERL_ROWS=0``),
at TP 1 and 2 over gloo, legacy and hook mode. Every value verl reads (the
response positions, sliced by verl's ``no_padding_2_padding``), verl's
``ppo_loss`` (loss and metrics, through the engine's own post-processing) and
every parameter's gradient are equal. What cannot run on a CPU is replaced in
one helper (:mod:`tests.verl_engine`).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import require, run_distributed

require("megatron.core", "verl")

from chunked_entropy.integrations import verl as ce_verl  # noqa: E402
from tests import verl_engine as ve  # noqa: E402

PROMPTS = [3, 5, 2]
RESPONSES = [4, 6, 2]
KEYS = ("log_probs", "entropy", "sum_pi_squared")
# the same rows, gathered first: float32 rounding at most (a different chunking of the rows)
VALUES = dict(rtol=1e-6, atol=1e-6)
GRADS = dict(rtol=1e-5, atol=1e-7)


def rl_batch(seed: int, flags: dict):
    """verl's RL micro-batch for the engine: padded rollouts through verl's own ``left_right_2_no_padding``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    b, p, r = len(PROMPTS), max(PROMPTS), max(RESPONSES)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(b, p + r, dtype=torch.long)
    attention = torch.zeros(b, p + r, dtype=torch.long)
    response_mask = torch.zeros(b, r, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        attention[i, p - pl:p + rl] = 1
        ids[i] = torch.randint(1, ve.V, (p + r,), generator=g) * attention[i]
        response_mask[i, :rl] = (torch.rand(rl, generator=g) > 0.3).long()  # tool tokens: 0
        response_mask[i, 0] = 1
    tensors = {
        "input_ids": ids, "attention_mask": attention, "response_mask": response_mask,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "prompts": ids[:, :p], "responses": ids[:, p:],
        "temperature": torch.tensor([0.7, 1.0, 1.6]),
        "old_log_probs": -torch.rand(b, r, generator=g) * 3, "advantages": torch.randn(b, r, generator=g),
    }
    meta = dict(flags, dp_size=1, batch_num_tokens=int(response_mask.sum()), global_batch_size=b, num_micro_batch=1)
    return left_right_2_no_padding(tu.get_tensordict(tensors, non_tensor_dict=meta))


def _step(eng, model, data, ups):
    """verl's forward_step and its post-processing with verl's ppo_loss, then backward (the loss plus random
    upstream gradients on the read values): the read values, loss, metrics and every parameter's gradient."""
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    cfg = ActorConfig(strategy="megatron", ppo_micro_batch_size_per_gpu=1, rollout_n=1, entropy_coeff=0.01)
    output, post = eng.forward_step(iter([data]), model, None, eng.postprocess_micro_batch_func)
    read = {k: no_padding_2_padding(output[k], data) for k in KEYS if k in output}
    loss, result = post(output, forward_only=False,
                        loss_function=lambda **kw: ppo_loss(cfg, **kw))
    total = loss + sum((read[k] * ups[k]).sum() for k in ("log_probs", "entropy") if k in read)
    total.backward()
    metrics = {k: [float(x) for x in v.values] if hasattr(v, "values") else [float(v)]
               for k, v in result["metrics"].items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in read.items()}, output, float(loss), metrics, grads


def _rows_vs_all(rank, world, hook, mtp=False):
    import os

    from chunked_entropy.integrations.verl import megatron_fused

    flags = dict(calculate_entropy=True, calculate_sum_pi_squared=True)
    g = torch.Generator().manual_seed(7)
    ups = {k: torch.randn(len(PROMPTS), max(RESPONSES), generator=g) for k in ("log_probs", "entropy")}
    runs = {}
    try:
        for on in (False, True):  # the spawned rank's own environment
            os.environ[megatron_fused.ROWS_ENV] = "1" if on else "0"
            model = ve.gpt_model(world, tied=hook, seed=13, mtp_layers=int(mtp))
            if hook:
                model = ve.with_output_processor_hook(model)
            eng = ve.engine(model, fused=True, chunk_size=4, mtp_train=mtp)
            if mtp:  # what verl's initialize() does under MTP; the MTP loss verl logs is compared too
                from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
                from verl.utils.megatron_utils import patch_engine_mtp

                eng.model_config.mtp.detach_encoder = False
                if hook:
                    model.config.mtp_detach_heads = False  # megatron-core 0.19's option
                patch_engine_mtp([model], eng.model_config)
                tracker = MTPLossLoggingHelper.tracker
                if hook:
                    for key in ("loss_values", "correct_values", "total_values"):
                        tracker.pop(key, None)
                else:
                    tracker["values"].zero_()
            runs[on] = _step(eng, model, rl_batch(3, flags), ups)
            if mtp:
                logged = (torch.stack([tracker[k][:1] for k in ("loss_values", "correct_values", "total_values")])
                          if hook else tracker["values"][:1].clone())
                assert logged.abs().sum() > 0
                runs[on][3]["mtp logged"] = logged.reshape(-1).tolist()
    finally:
        os.environ.pop(megatron_fused.ROWS_ENV, None)
    (r_all, o_all, l_all, m_all, g_all), (r_on, o_on, l_on, m_on, g_on) = runs[False], runs[True]
    what = f"rank {rank} tp {world} hook={hook} mtp={mtp}"
    assert set(r_on) == set(r_all) == set(KEYS), what
    for k in KEYS:
        torch.testing.assert_close(r_on[k], r_all[k], **VALUES, msg=lambda m, k=k: f"{what} {k}: {m}")
    assert l_on == pytest.approx(l_all, rel=1e-6, abs=1e-7), what
    assert m_on.keys() == m_all.keys() and "actor/pg_loss" in m_on, what
    for k in m_all:
        assert m_on[k] == pytest.approx(m_all[k], rel=1e-6, abs=1e-7) and m_all[k], (what, k)
    assert g_on.keys() == g_all.keys() and g_all, what
    for n in g_all:
        torch.testing.assert_close(g_on[n], g_all[n], **GRADS, msg=lambda m, n=n: f"{what} grad {n}: {m}")
    # the rows were skipped indeed: zero on every row verl does not read (a prompt row, the last row), not so
    # with the rows off
    unread = ~megatron_fused.read_rows(rl_batch(3, flags), rl_batch(3, flags)["input_ids"]).values()
    assert unread.sum() >= len(PROMPTS) and (o_on["log_probs"].values()[unread] == 0).all(), what
    assert (o_all["log_probs"].values()[unread] != 0).all(), what


def _engine(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(world)
    try:
        with ve.cpu_only_replacements():
            ce_verl.install()
            for hook in (False, True):
                _rows_vs_all(rank, world, hook)
            _rows_vs_all(rank, world, False, mtp=True)
            ce_verl.uninstall()
            with ve.megatron_019_mtp():  # hook mode under MTP: megatron-core 0.19's contract (tests.verl_engine)
                ce_verl.install()
                _rows_vs_all(rank, world, True, mtp=True)
    finally:
        ce_verl.uninstall()
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world", [1, 2])
def test_megatron_fused_route_projects_only_the_rows_verl_reads(world):
    """Legacy (untied) and hook mode (tied), each also with an MTP layer in training: rows on equals rows off in
    every read value, verl's ppo_loss and its metrics, the logged MTP loss, and every parameter's gradient; the
    unread rows are not projected."""
    run_distributed(_engine, world, timeout_s=120)


def test_read_rows_are_the_positions_verls_no_padding_2_padding_slices():
    """The rows are exactly those verl's own slicing reads (checked with verl's function on an index tensor)."""
    from verl.workers.utils.padding import no_padding_2_padding

    from chunked_entropy.integrations.verl.megatron_fused import read_rows

    data = rl_batch(1, {})
    ids = data["input_ids"]
    n = ids.values().numel()
    index = torch.nested.nested_tensor_from_jagged(torch.arange(1, n + 1), offsets=ids.offsets())
    sliced = no_padding_2_padding(index, data)
    expected = torch.zeros(n, dtype=torch.bool)
    expected[sliced[sliced > 0] - 1] = True
    mask = read_rows(data, ids)
    assert torch.equal(mask.offsets(), ids.offsets()) and torch.equal(mask.values(), expected)
    assert int(expected.sum()) == sum(RESPONSES)
    # an SFT micro-batch (no prompts / responses): every row
    sft = ve.batch([5, 3], seed=0, temperatures=[1.0, 1.0], flags={})
    assert read_rows(sft, sft["input_ids"]) is None


def test_rows_switch(monkeypatch):
    from chunked_entropy.integrations.verl import megatron_fused

    monkeypatch.delenv(megatron_fused.ROWS_ENV, raising=False)
    assert megatron_fused.rows_enabled()
    monkeypatch.setenv(megatron_fused.ROWS_ENV, "0")
    assert not megatron_fused.rows_enabled()
    monkeypatch.setenv(megatron_fused.ROWS_ENV, "maybe")
    with pytest.raises(ValueError, match="CHUNKED_ENTROPY_VERL_ROWS"):
        megatron_fused.rows_enabled()


def _train(rank, world):
    for hook in (False, True):
        _train_mode(rank, world, hook)


def _train_mode(rank, world, hook):
    """verl's ``train_batch`` (three micro-batches, two steps) with the rows on and off: the same losses,
    metrics, grad norms, outputs and updated weights."""
    import contextlib
    import io
    import os

    from megatron.core import parallel_state
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from chunked_entropy.integrations.verl import megatron_fused

    cfg = ActorConfig(strategy="megatron", ppo_micro_batch_size_per_gpu=1, rollout_n=1, entropy_coeff=0.01)
    flags = dict(calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
    parallel_state.initialize_model_parallel(world)
    runs = {}
    try:
        with ve.cpu_only_replacements(), ve.megatron_training_on_cpu():
            ce_verl.install()
            for on in (False, True):
                os.environ[megatron_fused.ROWS_ENV] = "1" if on else "0"
                model = ve.gpt_model(world, tied=hook, seed=13)
                if hook:
                    model = ve.with_output_processor_hook(model)
                with contextlib.redirect_stdout(io.StringIO()):  # verl prints its optimizer config
                    eng = ve.trained_engine(model, fused=True, chunk_size=4)
                src = eng.is_mp_src_rank_with_outputs()  # verl returns losses and metrics on this rank only
                steps = []
                for seed in (3, 4):
                    out = eng.train_batch(rl_batch(seed, flags), lambda **kw: ppo_loss(cfg, **kw))
                    if not src:
                        steps.append(([0.0] * 3, {}, {}, {n: p.detach().clone() for n, p in model.named_parameters()}))
                        continue
                    metrics = {k: list(getattr(v, "values", [v])) for k, v in out["metrics"].items()}
                    # the values verl reads: the response positions (its own no_padding_2_padding)
                    outputs = {k: no_padding_2_padding(v, rl_batch(seed, flags)).detach().clone()
                               for k, v in out["model_output"].items() if k in KEYS}
                    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
                    steps.append((list(out["loss"]), metrics, outputs, weights))
                runs[on] = steps
            start = {n: p.detach() for n, p in ve.gpt_model(world, tied=hook, seed=13).named_parameters()}
    finally:
        os.environ.pop(megatron_fused.ROWS_ENV, None)
        ce_verl.uninstall()
        parallel_state.destroy_model_parallel()
    what = f"rank {rank} tp {world} hook={hook}"
    for step, (off, on) in enumerate(zip(runs[False], runs[True], strict=True)):
        (l_off, m_off, o_off, w_off), (l_on, m_on, o_on, w_on) = off, on
        assert len(l_off) == 3 and l_on == pytest.approx(l_off, rel=1e-6, abs=1e-7), (what, step)
        assert m_on.keys() == m_off.keys() and (not src or {"grad_norm", "actor/pg_loss"} <= set(m_on)), what
        for k in m_off:
            assert m_on[k] == pytest.approx(m_off[k], rel=1e-6, abs=1e-7), (what, step, k)
        assert not src or m_off["grad_norm"][0] > 0, what
        assert o_on.keys() == o_off.keys() and (not src or {"log_probs", "entropy"} <= set(o_on)), what
        for k in o_off:
            torch.testing.assert_close(o_on[k], o_off[k], **VALUES,
                                       msg=lambda m, k=k, s=step: f"{what} step {s} {k}: {m}")
        assert w_on.keys() == w_off.keys(), what
        for n in w_off:
            # Adam divides each entry's gradient by its running RMS: an entry whose true gradient is 0 (the
            # attention's key bias: softmax ignores a shift) carries float32 rounding noise, which Adam scales up
            # to a step of up to lr; 1e-5 is 0.1% of lr (the weights move by about lr = 1e-2 a step)
            torch.testing.assert_close(w_on[n], w_off[n], rtol=1e-6, atol=1e-5,
                                       msg=lambda m, n=n, s=step: f"{what} step {s} weight {n}: {m}")
    # the optimizer stepped: the output layer moved (by about the learning rate), the same way on both
    name = "output_layer.weight" if not hook else "embedding.word_embeddings.weight"
    moved = (runs[True][0][3][name] - start[name]).abs().max()
    assert 1e-3 < moved < 0.1, (what, float(moved))


def test_megatron_train_batch_rows_on_equals_rows_off():
    """verl's real ``MegatronEngineWithLMHead.train_batch`` (megatron-core's DDP, its no-pipelining schedule over
    three micro-batches, verl's Megatron optimizer: Adam with its grad norm) on the fused route, legacy (untied)
    and hook mode (tied), TP 2 over gloo, two steps: with the rows on and off the per-micro-batch losses,
    every metric, the grad norm, the outputs verl keeps and every updated weight agree within float32 rounding.
    Only CUDA allocations are moved to the CPU (tests/verl_engine.py, ``megatron_training_on_cpu``; gradient
    clipping asserts CUDA tensors, so ``clip_grad=0``)."""
    run_distributed(_train, 2, timeout_s=180)
