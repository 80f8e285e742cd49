"""slime's hidden-state route against its logits route, through slime's own loss and log-prob functions.

A tiny megatron-core ``GPTModel`` on the CPU (tests/verl_engine.py's
CPU-only replacements: core attention and RoPE), slime's packed ``thd``
micro-batch built as slime's ``get_batch`` builds it (its module allocates on
CUDA, so the few lines are reproduced here), and the model called as slime's
``train_one_step`` / ``forward_only`` call it (``labels=None``,
``loss_mask=full_loss_masks``). What comes back goes into slime's real
``loss_function`` (the policy loss: PPO clip, entropy bonus, KL loss) and
slime's ``get_log_probs_and_entropy`` name in its loss module (as
``forward_only`` calls it), with the plugin installed on the logits route and
on the hidden-state route: log-probs, entropy, the loss, every metric slime
logs and every parameter's gradient agree. TP 1 and 2 (with sequence
parallelism) over gloo, with and without top-p replay. Needs slime's source
(``CHUNKED_ENTROPY_SLIME_SRC``, at the commit tests/test_integrations_slime.py
names); skips without it. The same for megatron-core 0.16.1's ``MambaModel`` (attention and MLP
layers only, tests/verl_engine.py), whose post-processing is inline in its ``forward``, and for
0.19's ``HybridModel`` (its forward reproduced from the upstream source, lines cited there).

Context parallelism (CP 2 over gloo, zigzag and ``--allgather-cp``) on the hidden-state route, against the run
without CP, in CI; the hidden states are given (the decoder's CP attention is Transformer Engine's, CUDA only).

Combined-1F1B: megatron-core's ``PostProcessNode`` calls the same ``_postprocess``; the route falls back
to the logits there. Tested in CI through megatron-core's own schedule plan (``build_schedule_plan``,
``TransformerModelChunkSchedulePlan.run``), with only CUDA events, streams and NVTX replaced.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import pytest
import torch

from chunked_entropy.integrations import _hidden_route
from chunked_entropy.integrations import slime as ce_slime
from tests.helpers import require, run_distributed
from tests.test_integrations_slime import SLIME_COMMIT, SLIME_SRC

require("megatron.core", "verl")

needs_slime = pytest.mark.skipif(
    not SLIME_SRC,
    reason=f"set CHUNKED_ENTROPY_SLIME_SRC to a checkout of https://github.com/THUDM/slime at commit {SLIME_COMMIT}",
)

LENGTHS = ((9, 4), (7, 3), (11, 6))  # (total, response) per sample


def _args(**kw):
    base = dict(
        loss_type="policy_loss", calculate_per_token_loss=False, recompute_loss_function=False, allgather_cp=False,
        use_rollout_logprobs=False, use_opsm=False, advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28,
        eps_clip_c=None, get_mismatch_metrics=False, use_tis=False, custom_pg_loss_reducer_function_path=None,
        entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl", use_unbiased_kl=False,
        rollout_temperature=0.8, log_probs_chunk_size=4, rollout_top_p=1.0, use_rollout_entropy=True,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def _batch(tp, v, topp, seed=0):
    """slime's micro-batch after ``get_batch`` (cp 1): packed tokens padded to the TP size, aligned loss masks."""
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, v, (t,), generator=g) for t, _ in LENGTHS]
    loss_masks = [(torch.rand(r, generator=g) > 0.2).int() for _, r in LENGTHS]
    cu = [0]
    for t in tokens:
        cu.append(cu[-1] + t.numel())
    flat = torch.cat(tokens)
    pad = (tp - flat.numel() % tp) % tp
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
        cu.append(cu[-1] + pad)
    cu = torch.tensor(cu, dtype=torch.int)
    full = torch.cat([torch.nn.functional.pad(m, (t - r - 1, 1))
                      for m, (t, r) in zip(loss_masks, LENGTHS, strict=True)])
    longest = int((cu[1:] - cu[:-1]).max())
    batch = {
        "tokens": flat.unsqueeze(0), "unconcat_tokens": tokens,
        "packed_seq_params": PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                             max_seqlen_kv=longest, qkv_format="thd"),
        "total_lengths": [t for t, _ in LENGTHS], "response_lengths": [r for _, r in LENGTHS],
        "loss_masks": loss_masks, "full_loss_masks": torch.nn.functional.pad(full, (0, pad)).unsqueeze(0),
        "advantages": [torch.randn(r, generator=g) for _, r in LENGTHS],
        "log_probs": [-torch.rand(r, generator=g) * 3 for _, r in LENGTHS],
        "ref_log_probs": [-torch.rand(r, generator=g) * 3 for _, r in LENGTHS],
        "rollout_mask_sums": None,
    }
    if topp:
        ids, offsets = [], []
        for _, r in LENGTHS:
            counts = torch.randint(0, 6, (r - 1,), generator=g)  # one response row left without a recorded set
            offsets.append([0] + torch.cumsum(counts, 0).tolist())
            ids.append(torch.randint(0, v, (int(counts.sum()),), generator=g).tolist())
        batch["rollout_top_p_token_ids"], batch["rollout_top_p_token_offsets"] = ids, offsets
    return batch


def _run(loss_mod, model, args, batch):
    """One training micro-batch and one log-prob forward, as slime's model.py runs them."""
    model.zero_grad(set_to_none=True)
    kw = dict(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
              packed_seq_params=batch["packed_seq_params"])
    if not _is_mamba(model):  # megatron-core 0.16.1's MambaModel.forward takes no loss_mask
        kw["loss_mask"] = batch["full_loss_masks"]
    out = model(**kw)
    loss, normalizer, log = loss_mod.loss_function(args, batch, 1, len(LENGTHS), out)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.eval()
        out = model(**kw)
        extra = loss_mod.get_rollout_top_p_logprob_kwargs(args, batch)
        _, res = loss_mod.get_log_probs_and_entropy(
            out, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
            response_lengths=batch["response_lengths"], with_entropy=args.use_rollout_entropy, **extra)
        model.train()
    return out, loss.detach(), log, grads, res


def _is_mamba(model):
    return type(model).__name__ == "MambaModel"


def _plain_loss(model, args, batch):
    """Without slime's source: the plugin's function as slime's loss calls it, a weighted sum, backward."""
    model.zero_grad(set_to_none=True)
    kw = dict(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
              packed_seq_params=batch["packed_seq_params"], loss_mask=batch["full_loss_masks"])
    out = model(**kw)
    extra = {k[len("rollout_"):]: batch[k] for k in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets")
             if k in batch}
    _, res = ce_slime.get_log_probs_and_entropy(
        out, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=True, **extra)
    loss = sum((lp * a).sum() + (h * 0.3 * a.flip(0)).sum()
               for lp, h, a in zip(res["log_probs"], res["entropy"], batch["advantages"], strict=True))
    loss = loss + 0 * out.sum()  # slime's keep-alive term, on either route
    loss.backward()
    return out, res, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _ci_worker(rank, world):
    from megatron.core import parallel_state

    from tests import verl_engine

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        with verl_engine.cpu_only_replacements(), verl_engine.sequence_parallel_on_cpu():
            model = verl_engine.gpt_model(world, tied=False, seed=3, sequence_parallel=True)
            args = _args()
            batch = _batch(world, verl_engine.V, True, seed=9)
            results = {}
            for route in ("logits", "hidden"):
                ce_slime.install(args, route=route)
                try:
                    assert ce_slime.route() == route
                    results[route] = _plain_loss(model, args, batch)
                finally:
                    ce_slime.uninstall()
            (out_l, res_l, g_l), (out_h, res_h, g_h) = results["logits"], results["hidden"]
            assert isinstance(out_h, _hidden_route.HiddenStates) and isinstance(out_l, torch.Tensor)
            for key in ("log_probs", "entropy"):
                for a, b in zip(res_h[key], res_l[key], strict=True):
                    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
            for name in g_l:
                torch.testing.assert_close(g_h[name], g_l[name], rtol=1e-4, atol=1e-6, msg=name)
            # multi-token prediction: megatron-core's own post-processing, with one logged warning
            mtp = verl_engine.gpt_model(world, tied=False, seed=3, mtp_layers=1)
            why = _hidden_route.why_not(mtp, None, None, None, None)
            assert why is not None and why[1] and "multi-token prediction" in why[0]
            assert _hidden_route.why_not(model, None, None, None, None) is None
            assert _hidden_route.why_not(model, batch["tokens"], None, None, None)[1] is False  # labels: quiet
    finally:
        parallel_state.destroy_model_parallel()


def test_hidden_route_matches_logits_route_tp2_sequence_parallel_without_slime():
    """In CI (no slime source): the plugin's function on both routes, a GPTModel at TP 2 with SP, top-p sets."""
    run_distributed(_ci_worker, 2, timeout_s=180)



def _schedule_step(model, args, batch):
    """One training micro-batch through megatron-core's combined-1F1B schedule plan, as its scheduler runs it.

    The plan is built by slime's ``forward_step`` call (``return_schedule_plan=True``: slime's model.py,
    ``model.build_schedule_plan(input_ids=..., position_ids=None, attention_mask=None, labels=None,
    packed_seq_params=..., loss_mask=full_loss_masks)``); megatron-core's ``combined_forward_backward_step``
    (pipeline_parallel/combined_1f1b.py) runs its forward (``TransformerModelChunkSchedulePlan.run(plan, None)``:
    pre-process, layers, then ``PostProcessNode``, which calls ``_postprocess``), the loss in a ``ScheduleNode``,
    and the backward from that node's input gradient (``run(None, plan, b_grad=...)``).
    """
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan
    from megatron.core.pipeline_parallel.utils import ScheduleNode

    model.zero_grad(set_to_none=True)
    plan = model.build_schedule_plan(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                                     packed_seq_params=batch["packed_seq_params"], loss_mask=batch["full_loss_masks"])
    plan.record_current_stream()
    out = TransformerModelChunkSchedulePlan.run(plan, None)
    results = {}

    def loss_func(output):
        extra = {k[len("rollout_"):]: batch[k] for k in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets")
                 if k in batch}
        _, res = ce_slime.get_log_probs_and_entropy(
            output, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
            response_lengths=batch["response_lengths"], with_entropy=True, **extra)
        results.update(output=output.detach().clone(), **res)
        return sum((lp * a).sum() + (h * 0.3 * a.flip(0)).sum()
                   for lp, h, a in zip(res["log_probs"], res["entropy"], batch["advantages"], strict=True))

    loss_node = ScheduleNode(loss_func, torch.cuda.current_stream(), plan.event, name="loss_func")
    loss_node.forward(out).backward()
    TransformerModelChunkSchedulePlan.run(None, plan, b_grad=loss_node.get_grad())
    results["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return results


def _combined_1f1b_worker(rank, world):
    from megatron.core import parallel_state

    from tests import verl_engine

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("chunked_entropy.integrations")
    logger.addHandler(handler)
    reason = "combined-1F1B's PostProcessNode (its schedule nodes pass tensors only)"
    _hidden_route._warned.discard(reason)
    try:
        with verl_engine.cpu_only_replacements(), verl_engine.sequence_parallel_on_cpu(), \
                verl_engine.combined_1f1b_on_cpu():
            model = verl_engine.gpt_model(world, tied=False, seed=3, sequence_parallel=True)
            args = _args()
            batch = _batch(world, verl_engine.V, True, seed=9)
            ce_slime.install(args, route="logits")
            try:
                logits_route = _schedule_step(model, args, batch)
            finally:
                ce_slime.uninstall()
            assert not any("combined-1F1B" in r.getMessage() for r in records)
            ce_slime.install(args, route="hidden")
            try:
                assert ce_slime.route() == "hidden"
                hidden_route = [_schedule_step(model, args, batch) for _ in range(2)]  # two micro-batches
                # outside the schedule node the same model still hands on the hidden states
                out = model(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                            packed_seq_params=batch["packed_seq_params"], loss_mask=batch["full_loss_masks"])
                assert isinstance(out, _hidden_route.HiddenStates), type(out)
            finally:
                ce_slime.uninstall()
        warned = [r.getMessage() for r in records if r.levelno == logging.WARNING and "falls back" in r.getMessage()]
        assert len(warned) == 1 and "combined-1F1B" in warned[0] and "PostProcessNode" in warned[0], warned
        for got in hidden_route:
            # the logits route taken: megatron-core's [B, S, V/tp] float32 logits, the same as on the logits route
            assert isinstance(got["output"], torch.Tensor) and got["output"].shape[-1] == verl_engine.V // world
            exact = dict(rtol=0, atol=0)
            torch.testing.assert_close(got["output"], logits_route["output"], **exact)
            for key in ("log_probs", "entropy"):
                for a, b in zip(got[key], logits_route[key], strict=True):
                    torch.testing.assert_close(a, b, **exact)
            assert got["grads"].keys() == logits_route["grads"].keys()
            assert "output_layer.weight" in got["grads"] and "embedding.word_embeddings.weight" in got["grads"]
            for name, g in logits_route["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, **exact, msg=name)
    finally:
        logger.removeHandler(handler)
        parallel_state.destroy_model_parallel()


def test_combined_1f1b_post_process_node_takes_the_logits_route_with_one_warning():
    """megatron-core's combined-1F1B ``PostProcessNode`` calls the same ``_postprocess`` as ``GPTModel.forward``;
    its schedule nodes pass tensors only, so the route falls back there (detected from the caller's frame), with
    one logged warning naming why, and the values and gradients are the logits route's. TP 2 with SP, through
    megatron-core's own schedule plan (tests/verl_engine.py's ``combined_1f1b_on_cpu``: CUDA events, streams and
    NVTX only)."""
    run_distributed(_combined_1f1b_worker, 2, timeout_s=180)

def _worker(rank, world, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

        from tests import verl_engine
    if SLIME_SRC not in sys.path:  # appended: Miles has a package named tests too; this project's comes first
        sys.path.append(SLIME_SRC)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import slime.backends.megatron_utils.loss as loss_mod
    for tp in (world, 1):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            with verl_engine.cpu_only_replacements(), verl_engine.sequence_parallel_on_cpu():
                build = {"gpt": verl_engine.gpt_model, "mamba": verl_engine.mamba_model,
                         "hybrid019": verl_engine.hybrid_model_019}[kind]
                model = build(tp, tied=(tp == 1), seed=1, sequence_parallel=tp > 1)
                for topp in (False, True):
                    args = _args(rollout_top_p=0.9 if topp else 1.0)
                    batch = _batch(tp, verl_engine.V, topp, seed=7)
                    results = {}
                    for route in ("logits", "hidden"):
                        ce_slime.install(args, route=route)
                        try:
                            results[route] = _run(loss_mod, model, args, batch)
                        finally:
                            ce_slime.uninstall()
                    _compare(results["logits"], results["hidden"], topp)
        finally:
            parallel_state.destroy_model_parallel()
            verl_engine.drop_hybrid_019()


def _compare(logits_route, hidden_route, topp):
    out_l, loss_l, log_l, grads_l, res_l = logits_route
    out_h, loss_h, log_h, grads_h, res_h = hidden_route
    assert isinstance(out_l, torch.Tensor) and isinstance(out_h, _hidden_route.HiddenStates), (type(out_l), out_h)
    assert out_h.hidden.shape[-1] != out_l.shape[-1]  # no [T, V/tp] tensor came out of the model
    tol = dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(loss_h, loss_l, **tol)
    # slime's logged metrics: {"keys": [names], "values": [count, metric, ...]}
    assert log_h["keys"] == log_l["keys"] and {"pg_loss", "entropy_loss", "kl_loss", "ppo_kl"} <= set(log_l["keys"])
    torch.testing.assert_close(log_h["values"], log_l["values"], **tol)
    assert grads_h.keys() == grads_l.keys()
    for name in grads_l:
        torch.testing.assert_close(grads_h[name], grads_l[name], rtol=1e-4, atol=1e-6, msg=f"grad of {name}")
    assert set(res_h) == set(res_l) == {"log_probs", "entropy"}
    for key in res_l:
        for a, b in zip(res_h[key], res_l[key], strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, **tol)
    # the entropy bonus moved the parameters: its gradient flows on the hidden-state route as well
    assert any(g.abs().max() > 0 for g in grads_h.values())


@needs_slime
@pytest.mark.parametrize("kind", ["gpt", "mamba", "hybrid019"])
def test_hidden_route_matches_logits_route_through_slimes_loss_tp1_tp2(kind):
    """GPTModel; megatron-core 0.16.1's MambaModel (attention and MLP layers); 0.19's HybridModel, reproduced
    (tests/verl_engine.py, with the upstream lines cited)."""
    run_distributed(_worker, 2, kind, timeout_s=300)


def test_route_argument_is_checked():
    with pytest.raises(ValueError, match="route must be one of"):
        ce_slime.install(route="both")
    assert not ce_slime.installed()


def test_custom_loss_gets_the_logits_route_with_one_warning(caplog):
    _hidden_route._warned.discard("--loss-type custom_loss (a custom loss may read the logits itself)")
    try:
        with caplog.at_level(logging.WARNING, logger="chunked_entropy.integrations"):
            ce_slime.install(argparse.Namespace(loss_type="custom_loss"))
            ce_slime.install(argparse.Namespace(loss_type="custom_loss"))
        assert ce_slime.route() == "logits"
        assert sum("custom_loss" in r.getMessage() for r in caplog.records) == 1
    finally:
        ce_slime.uninstall()
    assert ce_slime.route() is None


# ----------------------------------------------------------------------------- context parallelism


def cp_run(model, hidden_full, totals, resps, ups, mode, coef, call):
    """``call(states, allgather)`` (the plugin's function on the hidden-state route, as the framework calls it)
    with this rank's rows of ``hidden_full`` in slime's and Miles's CP layouts (zigzag halves, or
    ``--allgather-cp``'s contiguous split), the loss the framework would form from its outputs (this rank's part,
    ``ups`` in the same layout), backward. Returns the outputs and the gradients of the full hidden states and of
    every parameter, summed over the CP group (as megatron's DDP reduces them over DP x CP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from tests.packed import local_logits, zigzag_of

    cp, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    model.zero_grad(set_to_none=True)
    full = hidden_full.clone().requires_grad_()
    local = local_logits(list(full.split(totals)), totals, cp, cp_rank, mode)  # [T_local, H], differentiable
    res = call(_hidden_route.HiddenStates(local.unsqueeze(1), model), mode == "allgather")
    loss = 0
    for s, (up_lp, up_h) in enumerate(ups):
        loss = loss + (res["log_probs"][s] * zigzag_of(up_lp, totals[s], resps[s], cp, cp_rank).float()).sum()
        if coef:
            loss = loss + (res["entropy"][s] * zigzag_of(up_h, totals[s], resps[s], cp, cp_rank).float()).sum()
    loss.backward()
    grads = {"hidden": full.grad, **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
    if cp > 1:
        for g in grads.values():
            dist.all_reduce(g, group=mpu.get_context_parallel_group())
    return {k: [t.detach() for t in v] for k, v in res.items()}, grads


def cp_compare(results, totals, resps, cp, cp_rank, tied):
    """Each CP mode's outputs against this rank's part of the run without CP; the summed gradients against its."""
    from tests.packed import zigzag_of

    ref, ref_grads = results["cp1"]
    for mode in ("zigzag", "allgather"):
        got, grads = results[mode]
        assert set(got) == set(ref) == {"log_probs", "entropy"}
        for key in got:
            for s, (a, b) in enumerate(zip(got[key], ref[key], strict=True)):
                want = zigzag_of(b, totals[s], resps[s], cp, cp_rank)  # this rank's part, in slime's/Miles's layout
                assert a.shape == want.shape, (mode, key, s, a.shape, want.shape)
                torch.testing.assert_close(a, want, rtol=2e-5, atol=2e-6)
        assert grads.keys() == ref_grads.keys()
        assert tied or "output_layer.weight" in grads
        assert grads["hidden"].abs().max() > 0
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"{mode}: grad of {name}")
        # the rows no response token reads (prompts, each sample's last row) get exactly zero
        read = torch.zeros(sum(totals), dtype=torch.bool)
        start = 0
        for total, resp in zip(totals, resps, strict=True):
            read[start + total - resp - 1:start + total - 1] = True
            start += total
        assert (grads["hidden"][~read] == 0).all()


def cp_runs(world, tied, hidden_full, totals, resps, ups, coef, call, setup=lambda: None):
    """The run without CP (each rank alone) and the CP runs (zigzag, ``--allgather-cp``) over ``world`` ranks,
    on megatron-core's real CP groups; compared by :func:`cp_compare`."""
    from megatron.core import parallel_state

    from tests import verl_engine

    results = {}
    for cp, modes in ((1, ("cp1",)), (world, ("zigzag", "allgather"))):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
        try:
            setup()
            assert parallel_state.get_context_parallel_world_size() == cp
            cp_rank = parallel_state.get_context_parallel_rank()
            with verl_engine.cpu_only_replacements():
                model = verl_engine.gpt_model(1, tied=tied, seed=3)
                for mode in modes:
                    results[mode] = cp_run(model, hidden_full, totals, resps, ups, mode, coef, call)
        finally:
            parallel_state.destroy_model_parallel()
    cp_compare(results, totals, resps, world, cp_rank, tied)


def _cp_worker(rank, world):
    for tied in (False, True):
        _cp_worker_at(world, tied)


def _cp_worker_at(world, tied):
    from tests import verl_engine
    from tests.packed import samples

    tokens, totals, resps, ids, offsets, _, ups = samples(seed=21, v=verl_engine.V)
    hidden_full = torch.randn(sum(totals), verl_engine.HID, generator=torch.Generator().manual_seed(5))
    ce_slime.install(_args(), route="hidden")
    try:
        for topp, coef in ((True, 0.01), (False, 0.0)):
            def call(states, allgather, coef=coef, topp=topp):
                args = _args(rollout_temperature=0.7, log_probs_chunk_size=4, entropy_coef=coef,
                             allgather_cp=allgather)
                kw = dict(top_p_token_ids=ids, top_p_token_offsets=offsets) if topp else {}
                _, res = ce_slime.get_log_probs_and_entropy(
                    states, args=args, unconcat_tokens=tokens, total_lengths=totals, response_lengths=resps,
                    with_entropy=True, **kw)
                assert res["entropy"][0].requires_grad == (coef != 0)
                return res

            cp_runs(world, tied, hidden_full, totals, resps, ups, coef, call)
    finally:
        ce_slime.uninstall()


def test_hidden_route_context_parallel_2_matches_no_cp():
    """Context parallelism 2 over gloo (megatron-core's real CP groups), zigzag and ``--allgather-cp``, with and
    without top-p replay, the entropy's gradient on and off: on each CP rank the hidden-state route gets this rank's
    rows of the decoder output, laid out as slime shards them; its per-sample log-probs and entropy equal this rank's
    part of the run without CP, and the gradients of the hidden states and of the output weight (tied: the
    embedding), summed over the CP group as megatron's DDP sums them, equal the run without CP's; rows no response
    token reads get exactly zero.

    The decoder's own CP attention is Transformer Engine's (CUDA only), so the hidden states are given: the same
    ``[T, H]`` on both runs, this rank's rows taken with ``tests/packed.py``'s layout (differentiable)."""
    run_distributed(_cp_worker, 2, timeout_s=180)
