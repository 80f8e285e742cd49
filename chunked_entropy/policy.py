"""Fused policy loss: the RL loss of the output layer, its gradients formed in the chunk loop.

The loss is ``pg - entropy_coeff * agg(entropy) + kl_coef * agg(kl_penalty)``,
``pg`` one of verl 0.9.1's twelve policy objectives
(:mod:`chunked_entropy.losses.registry`). Every aggregation mode weighs the
tokens by the mask alone (:func:`~chunked_entropy.losses.agg_weights`), so:

- a **token-local** objective (vanilla, dppo_tv, dppo_kl, sapo, gpg, dro,
  cispo) gives each token's upstream gradient as soon as its chunk's
  statistics are known, and the chunk's logit gradient is formed at once from
  the same buffer (:func:`chunked_entropy._loop.loss_grad_blocks`): the fused
  head does three matmul passes (logits, ``g @ W``, ``g.T @ h``) instead of
  four, and the logits twin reads the logits once;
- a **row-local** objective (gspo, geo_mean, bypass_mode without rejection or
  batch normalization: a token's gradient reads its own sequence's
  log-probs) is formed the same way when whole rows of ``[B, T]`` fit a
  chunk (the chunks then hold whole rows): its upstream gradients come from
  the objective's autograd over the ``[B, T]`` log-probs as soon as the
  chunk's rows have theirs. Three passes;
- a row-local one whose rows are longer than a chunk walks each row's chunks
  forward (statistics, the last chunk's logits kept), then forms the row's
  gradients in reverse, the other chunks' logits computed again: a row in
  ``g`` chunks costs ``3 + (g - 1) / g`` passes;
- a **batch-level** objective (clip_cov, kl_cov, bypass_mode otherwise) needs
  every token's log-prob first: the whole batch is one such run, four passes
  (the unfused route's count, less the last chunk's), in the fused loss's
  memory.

``loss.backward()`` only scales the stored gradients by the scalar upstream gradient.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._call import (
    Chunking,
    Objective,
    OutputLayer,
    PolicyLoss,
    RowsOf,
    Tokens,
    compute_dtype,
    connected,
    dtensor_hidden_op,
    dtensor_logits_op,
    hand_over,
    loss_grads,
    once_differentiable,
    op,
    prepare,
    save_loss_grads,
)
from ._logit_blocks import full_hidden, head_grads, linear_row_stats, logits_row_stats, logits_source, token_major
from ._loop import Plan, loss_grad_blocks, new_row_stats

__all__ = ["linear_policy_loss", "policy_loss_from_logits"]

#: What ``rows=`` reads of the policy losses: the per-token inputs, given per selected row.
_PER_ROW = ("labels", "old_log_probs", "advantages", "loss_mask", "ref_log_probs", "rollout_is_weights",
            "rollout_log_probs")


def _results(tok: Tokens, stats, want):
    """The per-token log-probs and entropy the objective's value reads."""
    lp, ent, _ = tok.outputs(stats, want)
    return lp, ent


class _HeadLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tok: Tokens, plan: Plan, objective: Objective, main_grad,
                three_pass: Optional[Plan] = None):
        need = ctx.needs_input_grad[:3]
        cdt = compute_dtype(weight.dtype)
        stats = new_row_stats(tok.n, plan.want, cdt, weight.device, tok.keep)

        def walk(fill, plan, vocab_block, grad_rows):
            return loss_grad_blocks(tok, fill, plan, width=weight.shape[0], token_grads=objective.token_grads,
                                    span=objective.span, grad_block=vocab_block, stats=stats, dtype=cdt,
                                    device=weight.device, grad_rows=grad_rows)

        # three_pass (the plan of the three-GEMM-pass walk, see three_pass_plan): the whole shard a chunk, the
        # weight gradient summed chunk by chunk in float32; else four passes, half-precision weights' gradient
        # over vocabulary blocks outermost. With main_grad (Megatron's float32 accumulator), or summed chunk by
        # chunk (three passes), the weight gradient is kept in float32 until the upstream gradient scales it in
        # backward, rounded once there; else in the weight's dtype.
        f32_weight_grad = main_grad is not None or three_pass is not None
        grad_h, gw, gb = head_grads(walk, hidden, weight, bias, tok.n, plan, need, three_pass=three_pass,
                                    weight_grad_dtype=cdt if f32_weight_grad else None, token_major_rows=True)
        loss = objective.finish(*_results(tok, stats, plan.want))
        save_loss_grads(ctx, grad_h, gw, gb, weight, bias, main_grad)  # the gradients; no reference to the inputs
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return *loss_grads(ctx, g), None, None, None, None, None


@op("linear_policy_loss", front=dtensor_hidden_op(scalar=True), rows=RowsOf("hidden", _PER_ROW, kept="sequences",
                                                                            rows_2d=True), policy_fields=True)
def linear_policy_loss(
    hidden: torch.Tensor,
    layer: Union[OutputLayer, torch.Tensor],
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss: Optional[PolicyLoss] = None,
    chunking: Union[Chunking, int, None] = None,
    temperature=1.0,
    ref_log_probs: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    keep=None,
    rows=None,
):
    """The RL policy loss of the output layer, fused: ``(loss, metrics)`` from hidden states.

    Equals, in value and in the gradients of ``hidden``, ``weight`` and
    ``bias``, the composition ::

        lp, ent = linear_log_probs_and_entropy(hidden, layer, labels, ...)
        pg, m = losses.policy_loss(lp, old_log_probs, advantages, loss_mask, loss.replace(entropy_coeff=0, kl_coef=0))
        loss = (pg - loss.entropy_coeff * losses.entropy_bonus(ent, loss_mask, agg_mode)
                + loss.kl_coef * losses.agg_loss(losses.kl_penalty(lp, ref_log_probs, loss.kl_kind), loss_mask,
                                                 agg_mode))

    but forms the gradients in the chunk loop. A token-local ``loss.mode``
    (vanilla, dppo_tv, dppo_kl, sapo, gpg, dro, cispo) forms them in the
    forward pass: three matmul passes instead of four where the walk fits
    ``chunking.max_working_bytes`` (see Memory; with ``vocab_chunk_size`` a
    row's statistics are complete only after its last block, and the logits
    are computed twice as in the fused head). A row-local one (gspo, geo_mean, bypass_mode without
    rejection or batch normalization) does the same when whole rows fit a
    chunk (``chunk_size >= T``); with longer rows each row's chunks are walked
    forward for their statistics and back for the gradients, all but the last
    computed twice. A batch-level one (clip_cov, kl_cov, bypass_mode
    otherwise) reads every token's log-prob first: four passes. Every mode's
    upstream gradients come from the objective over the ``[B, T]`` log-probs,
    in the same memory.

    Args:
        hidden: ``[B, T, H]``; with ``layer.sequence_parallel``, Megatron's
            ``[T/P, B, H]`` slice of this rank (the per-token tensors stay ``[B, T]``).
        layer: the :class:`~chunked_entropy.OutputLayer` (or its bare
            ``[V_local, H]`` weight), as in
            :func:`~chunked_entropy.linear_log_probs_and_entropy`: this rank's
            vocabulary shard, bias, logit transform, tensor-parallel group,
            sequence parallelism, ``logits_dtype`` and
            ``gradient_accumulation_fusion``.
        labels: ``[B, T]`` int64 global ids, range-checked wherever ``loss_mask`` is non-zero (no id
            means "no label" here, ``-100`` neither: ``loss_mask`` alone says which tokens count).
        old_log_probs: ``[B, T]`` log-probs under the rollout policy (no gradient).
        advantages: ``[B, T]`` advantages (no gradient).
        loss_mask: ``[B, T]`` bool (or 0/1, or non-negative weights).
        loss: the :class:`~chunked_entropy.PolicyLoss` (None: verl's vanilla
            PPO defaults): the objective (``mode``, one of
            :data:`~chunked_entropy.losses.LOSS_MODES`, verl's names) and its
            ``options`` (``clip_ratio``, ...), ``entropy_coeff``, ``kl_coef``
            and ``kl_kind``, the ``aggregation`` (verl's ``agg_loss``
            arguments; with data parallelism the global batch's counts, so
            that the average of the ranks' gradients, what DDP forms, is the
            gradient of the loss over the global batch), and ``entropy_of``:
            the entropy bonus's entropy under sampling replay, ``"full"`` (the
            whole distribution) or ``"kept"``.
        chunking: a :class:`~chunked_entropy.Chunking` or an int (the chunk
            size), as in :func:`~chunked_entropy.linear_log_probs_and_entropy`
            (vocabulary blocks cost the fourth matmul pass); its
            ``max_working_bytes`` chooses between three and four passes.
        temperature: as in :func:`~chunked_entropy.linear_log_probs_and_entropy`.
        ref_log_probs: ``[B, T]`` reference log-probs (needed when ``loss.kl_coef != 0``).
        rollout_is_weights: ``[B, T]`` rollout-correction weights, as in
            :func:`~chunked_entropy.losses.policy_loss`.
        rollout_log_probs: ``[B, T]`` the rollout engine's log-probs, instead of
            ``rollout_is_weights``: the weights and the rejection mask then come
            from :func:`~chunked_entropy.losses.rollout_correction` of
            ``old_log_probs`` against them, with the options' ``rollout_is*``
            and ``rollout_rs*`` settings (as verl's trainer computes them).
        generator: ``clip_cov``'s random draw, as in :func:`~chunked_entropy.losses.policy_loss`
            (under a process group every rank must hold the same state; the ranks agree on it).
        keep: sampling replay's kept sets, as in
            :func:`~chunked_entropy.linear_log_probs_and_entropy` (rows in the
            order of the flattened ``[B, T]`` labels): the ratio, the KL and the
            metrics use the log-probs over each token's kept set.
        rows: project only these rows (docs/concepts.md, "Rows"). A ``[B, T]``
            int64 index into the flattened token rows of ``hidden`` (``[B,
            T, H]``: row ``b * T + t``; under sequence parallelism the gathered
            ``[T, B]`` sequence, row ``t * B + b``), repeats allowed: the
            selected rows laid out as ``B`` sequences of ``T`` (the sequence
            each row belongs to, for the sequence-level objectives and
            aggregations), every per-token input given in that ``[B, T]``
            layout. The hidden gradient is summed over repeats, zero on rows
            never selected. ``"kept"``: only the rows where ``loss_mask`` is
            non-zero, each sequence's kept rows moved to its front and padded
            (masked) to the longest one's count; the loss and metrics equal the
            call without ``rows`` (``seq-mean-token-sum-norm`` keeps dividing
            by the full ``T``). One host sync for that count;
            ``("kept", count)`` passes it (>= every sequence's kept count).
            Every rank of ``process_group`` must pass the same rows.

    Returns:
        ``(loss, metrics)``: a 0-dim float32 loss; ``metrics`` holds detached
        0-dim tensors under verl's names: the objective's (as
        :func:`~chunked_entropy.losses.policy_loss` returns them, e.g.
        ``"actor/pg_clipfrac"``, ``"actor/ppo_kl"``), ``"actor/pg_loss"``,
        ``"actor/entropy_loss"`` (the aggregated entropy) and, with a
        reference, ``"kl_loss"``.

    Memory:
        Saved between forward and backward: the gradients of ``hidden``
        (``[B, T, H]``, its dtype), ``weight`` (``[V_local, H]`` in its dtype;
        float32 with ``main_grad`` and in the three-pass walk) and ``bias``,
        allocated in forward instead of backward; nothing else (no reference
        to the inputs, no per-token statistics). Two walks, chosen by
        ``chunking.max_working_bytes`` (default 1 GiB):

        - **three GEMM passes** (logits, ``g @ W``, ``g.T @ h``) where the
          walk fits the budget
          (:func:`~chunked_entropy.config.three_pass_bytes`): each chunk's
          logits formed once over the whole shard, two float32
          ``[chunk_size, V_local]`` buffers (one with the compiled or Triton
          kernels, three with ``softcap``) plus, for bf16/fp16 weights, one
          of their dtype, and a float32 ``[V_local, H]`` accumulator of a
          bf16/fp16 weight's gradient (none with ``main_grad``, none for
          float32 weights: their gradient itself), summed chunk by chunk
          and rounded once into the weight's dtype after the upstream
          gradient scales it;
        - **four** otherwise, or with ``vocab_chunk_size`` below
          ``V_local``: per chunk two float32 ``[chunk_size, block]``
          buffers (``vocab_chunk_size`` columns, by default the whole shard
          while such a buffer is at most 128 MiB), a statistics pass first;
          bf16/fp16 weights then take the gradient pass over vocabulary
          blocks outermost, as the fused head's backward does (each block's
          weight gradient one half-precision matmul over all tokens; a
          ``[tokens, block]`` buffer of at most 64 MiB and a float32
          ``[tokens, H]`` accumulator; no float32 ``[V_local, H]`` tensor).

        Nothing of size ``[tokens, V]`` ever exists. Under ``torch.no_grad()`` only the loss
        and metrics are computed (one matmul pass, no gradient buffers).
        ``loss.backward()`` scales the stored gradients by its upstream
        gradient (any scalar: e.g. ``1 / grad_accum_steps``; half-precision
        gradients in float32 rows of at most 64 MiB, rounded once) and hands
        them over, scaled in place; under ``retain_graph=True`` it returns scaled
        copies instead, so that a later backward is exact whatever the caller
        did with the first results. A second backward without
        ``retain_graph`` raises as autograd does; with ``main_grad`` the
        weight gradient is added there in backward. With ``rows``, the
        per-token costs are those of the selected rows, plus one ``[B*T, H]``
        gather of them (the rows' own ``B, T``) and the hidden gradient's
        ``[tokens, H]``.
    """
    p = prepare(hidden, layer, labels, chunking=chunking, temperature=temperature, keep=keep, loss=loss,
                policy=dict(old_log_probs=old_log_probs, advantages=advantages, loss_mask=loss_mask,
                            ref_log_probs=ref_log_probs, rollout_is_weights=rollout_is_weights,
                            rollout_log_probs=rollout_log_probs, generator=generator))
    tok, plan, weight, bias, objective = p.tok, p.plan, p.layer.weight, p.layer.bias, p.objective
    if tok.n == 0 or not p.grads:
        if tok.n == 0:
            lp = ent = torch.zeros(0, dtype=p.cdt, device=hidden.device)
        else:
            h_full = full_hidden(hidden, plan)
            lp, ent = _results(tok, linear_row_stats(token_major(h_full, plan), weight, bias, tok, plan), plan.want)
        loss, metrics = objective.value(lp, ent)
        if p.grads:  # zero tokens: a zero loss still connected to the inputs
            loss = connected(loss, hidden, weight, bias)
        return loss, metrics
    loss = _HeadLossFunction.apply(hidden, weight, bias, tok, plan, objective, p.main_grad,
                                   p.three_pass(weight))
    return loss, objective.result[1]


class _LogitsLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tok: Tokens, plan: Plan, objective: Objective):
        n, v = tok.n, logits.shape[-1]
        cdt = compute_dtype(logits.dtype)
        fill, view = logits_source(logits)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(n, v)
        # the gradient's own rows are the working buffer, unless kept sets' sparse term is added to a
        # half-precision block: then it is formed in the compute dtype and rounded once (see logits.py)
        direct = logits.dtype == cdt or (not plan.kernels.in_place and tok.keep is None)
        stats = new_row_stats(n, plan.want, cdt, logits.device, tok.keep)
        blocks = loss_grad_blocks(
            tok, fill, plan, width=v, token_grads=objective.token_grads, span=objective.span, stats=stats,
            dtype=cdt, device=logits.device, into=(lambda a, b: gflat[a:b]) if direct else None, view=view,
        )
        for a, b, _, _, g in blocks:
            if not direct:
                gflat[a:b].copy_(g)
        loss = objective.finish(*_results(tok, stats, plan.want))
        # Saved: the logits' gradient (allocated here instead of in backward); no reference to the logits.
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return hand_over(grad, g), None, None, None


@op("policy_loss_from_logits", front=dtensor_logits_op(scalar=True),
    rows=RowsOf("logits", _PER_ROW, logits=True, rows_2d=True), policy_fields=True)
def policy_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    layer: Optional[OutputLayer] = None,
    loss: Optional[PolicyLoss] = None,
    chunking: Union[Chunking, int, None] = None,
    temperature=1.0,
    ref_log_probs: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    keep=None,
    rows=None,
):
    """The RL policy loss from given logits: :func:`linear_policy_loss`'s twin, one read of the logits.

    Equals the same composition with ``lp, ent`` from
    :func:`~chunked_entropy.log_probs_and_entropy` (values and the logits'
    gradient). Arguments as in :func:`linear_policy_loss`; ``logits`` are
    ``[B, T, V_local]`` (never written), and ``layer`` is the
    :class:`~chunked_entropy.OutputLayer` that made them, or None, as in
    :func:`~chunked_entropy.log_probs_and_entropy` (its group and logit
    transform are read).

    Returns:
        ``(loss, metrics)`` as :func:`linear_policy_loss`.

    Memory:
        Saved between forward and backward: the logits' gradient (their shape
        and dtype), allocated in forward instead of backward; no reference to
        the logits. Per chunk, at most two float32 ``[chunk_size, V_local]``
        buffers (one fewer for float32 logits, three with ``softcap``).
        ``loss.backward()`` hands the stored gradient over (scaled in place by
        its upstream gradient; a half-precision one in float32 rows of at most
        64 MiB, rounded once); under ``retain_graph=True`` it returns a
        scaled copy instead (one more gradient-sized tensor), so that the
        caller may modify what it gets and a later backward is still exact.
        With ``rows`` (a ``[B, T]`` index into the flattened logit rows, as in
        :func:`linear_policy_loss`), one ``[B*T, V_local]`` gather of them.
    """
    p = prepare(logits, layer, labels, chunking=chunking, logits=True, temperature=temperature, keep=keep, loss=loss,
                policy=dict(old_log_probs=old_log_probs, advantages=advantages, loss_mask=loss_mask,
                            ref_log_probs=ref_log_probs, rollout_is_weights=rollout_is_weights,
                            rollout_log_probs=rollout_log_probs, generator=generator))
    tok, plan, objective = p.tok, p.plan, p.objective
    if tok.n == 0 or not p.grads:
        lp = ent = torch.zeros(0, dtype=p.cdt, device=logits.device)
        if tok.n:
            lp, ent = _results(tok, logits_row_stats(logits, tok, plan), plan.want)
        loss, metrics = objective.value(lp, ent)
        return (connected(loss, logits) if p.grads else loss), metrics
    loss = _LogitsLossFunction.apply(logits, tok, plan, objective)
    return loss, objective.result[1]
