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

from ._autograd import connected, hand_over, once_differentiable
from ._call import agree_objects, group_of, loss_grads, plan_for, refused_together, save_loss_grads, settings
from ._checks import check_float, require
from ._dtensor import dtensor_hidden_op, dtensor_logits_op
from ._inputs import Rows, Tokens, check_linear_args, compute_dtype, dtype_code, prepare_tokens, token_shape
from ._logit_blocks import (
    full_hidden,
    grad_rows_for,
    grad_vocab_block,
    linear_filler,
    linear_grads,
    linear_row_stats,
    linear_settings,
    logits_row_stats,
    logits_source,
    main_grad_of,
    reduce_hidden_grad,
    three_pass_plan,
    token_major,
    token_major_grad,
)
from ._loop import Plan, loss_grad_blocks, new_row_stats
from ._migrate import accepts_01_keywords
from ._rows import check_full_shape, parse_kept, select_logit_rows, select_rows, take_keep, take_rows
from ._stats import RowStats, Want
from .losses import Aggregation, kl_penalty, kl_penalty_grad, rollout_correction
from .losses._common import check_mask, check_same_shape
from .losses.aggregation import aggregate
from .losses.registry import check_weights, evaluate, objective
from .losses.token import selected
from .options import Chunking, OutputLayer, PolicyLoss, as_loss, check_layer_width
from .parallel import agreed_call, fingerprint, fingerprint_floats

__all__ = ["linear_policy_loss", "policy_loss_from_logits"]


class _Objective:
    """Per-token data of the loss, its per-token upstream gradients, and its value from the outputs."""

    def __init__(self, opts: PolicyLoss, labels, old_log_probs, advantages, loss_mask, ref_log_probs,
                 rollout_is_weights, rollout_log_probs, generator, dtype):
        self.opts = opts
        self.objective = objective(opts.mode, opts.options)
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor of int64 ids, got {type(labels).__name__}")
        self.shape = labels.shape
        for name, t in (("old_log_probs", old_log_probs), ("advantages", advantages)):
            check_float(name, t)
        check_same_shape("labels", labels, old_log_probs=old_log_probs, advantages=advantages)
        check_mask(loss_mask, old_log_probs, "labels")
        if opts.kl_coef != 0 and ref_log_probs is None:
            raise ValueError("kl_coef != 0 needs ref_log_probs")
        if ref_log_probs is not None:
            check_same_shape("labels", labels, ref_log_probs=ref_log_probs)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        weights = check_weights(rollout_is_weights, old_log_probs, "old_log_probs")
        if rollout_log_probs is not None:  # verl's rollout correction, from the old and the rollout log-probs
            if weights is not None:
                raise ValueError("pass rollout_is_weights or rollout_log_probs (to compute them), not both")
            check_same_shape("labels", labels, rollout_log_probs=rollout_log_probs)
            o = opts.options
            weights, loss_mask, _ = rollout_correction(
                old_log_probs, rollout_log_probs, loss_mask, rollout_is=o.rollout_is,
                rollout_is_threshold=o.rollout_is_threshold, rollout_is_batch_normalize=o.rollout_is_batch_normalize,
                rollout_rs=o.rollout_rs, rollout_rs_threshold=o.rollout_rs_threshold)
        if self.objective.name == "bypass_mode":  # a value check of the call: part of its one host sync
            require((loss_mask != 0).any(), "loss_mode='bypass_mode' needs at least one valid token in loss_mask "
                    "(its rollout correction, as verl's, has nothing to measure otherwise)")
        self.generator = generator
        self.mask = loss_mask
        self.keep = loss_mask != 0
        flat = lambda t: None if t is None else t.detach().reshape(-1).to(dtype)  # noqa: E731
        old, adv, ref, w = selected(self.keep.reshape(-1), flat(old_log_probs), flat(advantages), flat(ref_log_probs),
                                    flat(weights))
        self.old, self.adv, self.ref, self.is_w = old, adv, ref, w
        self.rollout = flat(rollout_log_probs)  # what the weights were computed from: agreed on by name
        self.mask_flat = loss_mask.reshape(-1)
        agg = opts.aggregation
        pg_agg = agg if self.objective.agg_mode is None else agg.with_mode(self.objective.agg_mode)
        self.weights = opts.aggregation.weights(loss_mask, dtype).reshape(-1)  # the entropy's and the KL's
        self.pg_weights = pg_agg.weights(loss_mask, dtype).reshape(-1)
        self.inputs = (old_log_probs, advantages, ref_log_probs)
        self.pg = None  # (pg loss, metrics) of a sequence-level objective, from its one evaluation
        self.result = None  # (loss, metrics), set by the forward

    @property
    def span(self):
        """How many consecutive tokens a token's gradient reads (see ``loss_grad_blocks``): 1, a row's, or all."""
        if self.objective.token_local:
            return 1
        return self.shape[-1] if self.objective.reads_only_its_row(self.opts.options) else None

    def settings(self, call) -> dict:
        """What every rank of a process group must agree on (see ``prepare_tokens``): the loss whole (each
        field named, see :func:`~chunked_entropy._call.agree_objects`), then the per-token inputs; nothing
        without a group."""
        if call.world == 1:
            return {}
        agree_objects(call, loss=self.opts)
        out = {
            "old_log_probs": fingerprint_floats(self.old),
            "advantages": fingerprint_floats(self.adv),
            "ref_log_probs": fingerprint_floats(self.ref),
            "loss_mask": fingerprint_floats(self.mask_flat),
            "rollout_log_probs": fingerprint_floats(self.rollout),
            "rollout_is_weights": fingerprint_floats(self.is_w),
        }
        if self.opts.mode == "clip_cov":  # its random draw must be the same on every rank
            state = (self.generator.get_state() if self.generator is not None else torch.random.get_rng_state())
            out["the random generator's state (clip_cov draws its tokens from it)"] = fingerprint(state)
        return out

    def _pg_grad(self, a: int, b: int, lp: torch.Tensor) -> torch.Tensor:
        """The policy objective's upstream gradient of tokens ``[a, b)``: a token-local one's, from its derivative;
        any other's from autograd of the objective over the ``[B, T]`` log-probs. A row-local objective may be
        asked for whole rows: the other rows then hold the old log-probs, which no gradient of these rows reads."""
        if self.objective.token_local:
            keep = self.keep.reshape(-1)[a:b]
            lp_k, = selected(keep, lp)
            g = self.objective.token_grad(lp_k, self.old[a:b], self.adv[a:b], self.mask_flat[a:b], self.opts.options)
            if self.is_w is not None:
                g = g * self.is_w[a:b]
            return g * self.pg_weights[a:b]
        whole = (a, b) == (0, self.old.numel())
        x = self.old.clone()
        x[a:b] = lp.detach()
        x = x.view(self.shape).requires_grad_()
        with torch.enable_grad():
            lp_k, = selected(self.keep, x)
            loss, metrics = evaluate(self.objective, lp_k, self.old.view(self.shape), self.adv.view(self.shape),
                                     self.mask, self.opts.options, self.opts.aggregation,
                                     None if self.is_w is None else self.is_w.view(self.shape), self.generator)
            (g,) = torch.autograd.grad(loss, x, allow_unused=True)
        if whole:  # the value and metrics too; a row-local objective asked by chunks is evaluated once more at the end
            self.pg = (loss.detach(), metrics)
        return torch.zeros_like(lp) if g is None else g.reshape(-1)[a:b]

    def token_grads(self, a: int, b: int, lp: torch.Tensor):
        """Upstream gradients of ``(log_probs, entropy)`` for rows ``[a, b)`` from their log-probs (None: no
        entropy term). A sequence-level objective is asked once, for every row."""
        o, w = self.opts, self.weights[a:b]
        g = self._pg_grad(a, b, lp)
        if o.kl_coef != 0:
            g = g + o.kl_coef * kl_penalty_grad(lp, self.ref[a:b], o.kl_kind) * w
        keep = self.keep.reshape(-1)[a:b]
        g_lp = torch.where(keep, g, 0.0)
        g_h = None if o.entropy_coeff == 0 else -o.entropy_coeff * w
        return g_lp, g_h

    def finish(self, tok: Tokens, stats: RowStats) -> torch.Tensor:
        """Record ``(loss, metrics)`` from the chunk loop's statistics; return the loss."""
        self.result = self.value(*_token_results(tok, stats))
        return self.result[0]

    def value(self, log_probs: torch.Tensor, entropy: torch.Tensor):
        """``(loss, metrics)`` from the outputs, by the composition itself (no gradient), with verl's metric
        names: the objective's, ``"actor/pg_loss"``, ``"actor/entropy_loss"`` and, with a reference, ``"kl_loss"``."""
        o, agg = self.opts, self.opts.aggregation
        lp, ent = log_probs.view(self.shape), entropy.view(self.shape)
        if self.pg is None:
            lp_k, = selected(self.keep, lp)
            pg, metrics = evaluate(self.objective, lp_k, self.old.view(self.shape).to(lp.dtype),
                                   self.adv.view(self.shape).to(lp.dtype), self.mask, o.options, agg,
                                   None if self.is_w is None else self.is_w.view(self.shape).to(lp.dtype),
                                   self.generator)
        else:
            pg, metrics = self.pg
        entropy_loss = aggregate(ent, self.mask, agg)
        loss = pg - o.entropy_coeff * entropy_loss
        metrics = dict(metrics, **{"actor/pg_loss": pg.detach(), "actor/entropy_loss": entropy_loss.detach()})
        if self.ref is not None:
            kl = aggregate(kl_penalty(lp, self.ref.view(self.shape).to(lp.dtype), o.kl_kind), self.mask, agg)
            loss = loss + o.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
        return loss.detach(), metrics


def _token_results(tok: Tokens, stats: RowStats):
    lp, ent, _ = tok.outputs(stats, Want())
    return lp, ent


class _HeadLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tok: Tokens, plan: Plan, objective: _Objective, main_grad,
                three_pass: Optional[Plan] = None):
        need = ctx.needs_input_grad[:3]
        cdt = compute_dtype(weight.dtype)
        h_full = full_hidden(hidden, plan)
        rows = Rows(token_major(h_full, plan))
        n = tok.n
        stats = new_row_stats(n, Want(), cdt, weight.device, tok.keep)
        # three_pass (the plan of the three-GEMM-pass walk, see three_pass_plan): the whole shard a chunk, the
        # weight gradient summed chunk by chunk in float32; else four passes, half-precision weights' gradient
        # over vocabulary blocks outermost
        if three_pass is not None:
            plan, vocab_block = three_pass, None
        else:
            vocab_block = grad_vocab_block(n, weight, plan, need[1])
        gr = grad_rows_for(n, weight, plan, vocab_block)
        blocks = loss_grad_blocks(
            tok, linear_filler(rows, weight, bias, plan.float32_logits), plan, width=weight.shape[0],
            token_grads=objective.token_grads, span=objective.span, grad_block=vocab_block, stats=stats, dtype=cdt,
            device=weight.device, grad_rows=gr,
        )
        # With main_grad (Megatron's float32 accumulator), or summed chunk by chunk (three passes), the weight
        # gradient is kept in float32 until the upstream gradient scales it in backward, rounded once there;
        # else in the weight's dtype.
        f32_weight_grad = main_grad is not None or three_pass is not None
        grad_h, gw, gb = linear_grads(blocks, rows, weight, n=n, hidden_dtype=hidden.dtype,
                                      chunk_size=plan.chunk_size, need=need, float32=plan.float32_logits,
                                      vocab_block=vocab_block, weight_grad_dtype=cdt if f32_weight_grad else None,
                                      grad_rows=gr)
        if grad_h is not None:
            grad_h = reduce_hidden_grad(token_major_grad(grad_h, h_full.shape, plan), h_full.shape, plan)
        loss = objective.finish(tok, stats)
        save_loss_grads(ctx, grad_h, gw, gb, weight, bias, main_grad)  # the gradients; no reference to the inputs
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return *loss_grads(ctx, g), None, None, None, None, None


@accepts_01_keywords("linear_policy_loss", policy_fields=True)
@dtensor_hidden_op(scalar=True)
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
    with refused_together(group_of(layer)):
        (layer, chunking), opts = settings(layer, chunking), as_loss(loss)
        kept = parse_kept(rows)
        _check_rows_2d(rows)
    weight, bias, process_group, sequence_parallel = layer.weight, layer.bias, layer.process_group, \
        layer.sequence_parallel
    if kept is not None:
        return _kept_loss(hidden, layer, labels, old_log_probs, advantages, loss_mask, kept[1], dict(
            loss=opts, chunking=chunking, ref_log_probs=ref_log_probs, rollout_is_weights=rollout_is_weights,
            rollout_log_probs=rollout_log_probs, generator=generator, temperature=temperature, keep=keep))
    if rows is not None:
        hidden = select_rows(rows, hidden, process_group=process_group, sequence_parallel=sequence_parallel,
                             labels=labels, old_log_probs=old_log_probs, advantages=advantages, loss_mask=loss_mask,
                             ref_log_probs=ref_log_probs, rollout_is_weights=rollout_is_weights,
                             rollout_log_probs=rollout_log_probs, keep=keep if isinstance(keep, torch.Tensor) else None)
        sequence_parallel = False
        layer = layer.replace(sequence_parallel=False)
    with agreed_call(process_group) as call:  # every rank validates; a refused call raises on all of them
        check_linear_args(hidden, layer, labels, 1, False)
        lead = token_shape(hidden, call.world, sequence_parallel, batch_first=True)
        if labels.shape != lead:
            raise ValueError(
                f"labels must have shape {tuple(lead)} ([B, T]"
                + (", the full sequence: hidden is this rank's [T/P, B, H] slice)" if sequence_parallel else ")")
                + f", got {tuple(labels.shape)}"
            )
        v_local = weight.shape[0]
        cdt = compute_dtype(weight.dtype)
        objective = _Objective(opts, labels, old_log_probs, advantages, loss_mask, ref_log_probs, rollout_is_weights,
                               rollout_log_probs, generator, cdt)
        grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        plan = plan_for(layer, chunking, lead=lead, want=Want(), device=hidden.device, buffers=2)
        main_grad = main_grad_of(weight, layer.gradient_accumulation_fusion)
        tok = prepare_tokens(
            labels, lead, v_local, call=call, label_mask=objective.keep, ignore_index=-100, mask_only=True,
            temperature=temperature, device=hidden.device, dtype=cdt, transform=layer.transform,
            keep=keep, entropy_of=opts.entropy_of,
        )
        call.agree_all(linear_settings(hidden, weight, bias, plan, grads))
        agree_objects(call, layer=layer, chunking=chunking)
        call.agree_all(objective.settings(call))
    if tok.n == 0 or not grads:
        if tok.n == 0:
            zero = torch.zeros(0, dtype=cdt, device=hidden.device)
            lp = ent = zero
        else:
            h_full = full_hidden(hidden, plan)
            lp, ent = _token_results(tok, linear_row_stats(token_major(h_full, plan), weight, bias, tok, plan))
        loss, metrics = objective.value(lp, ent)
        if grads:  # zero tokens: a zero loss still connected to the inputs
            loss = connected(loss, hidden, weight, bias)
        return loss, metrics
    three_pass = three_pass_plan(tok.n, weight, plan, budget=chunking.max_working_bytes,
                                 vocab_chunk_size=chunking.vocab_chunk_size, need_w=weight.requires_grad,
                                 main_grad=main_grad is not None, softcap=tok.transform.softcap is not None)
    loss = _HeadLossFunction.apply(hidden, weight, bias, tok, plan, objective, main_grad, three_pass)
    return loss, objective.result[1]


def _check_rows_2d(rows) -> None:
    """An index ``rows`` of the policy losses lays the selected rows out as sequences: ``[B, T]``."""
    if isinstance(rows, torch.Tensor) and rows.dim() != 2:
        raise ValueError(f"rows of the policy loss must be [B, T] (the selected rows laid out as sequences), "
                         f"got shape {tuple(rows.shape)}")


def _kept_loss(hidden, layer: OutputLayer, labels, old_log_probs, advantages, loss_mask, count, kw):
    """``rows="kept"`` of :func:`linear_policy_loss`: each sequence's kept rows first, padded (masked) to the
    longest count; the call on them with the full ``T`` as the ``seq-mean-token-sum-norm`` divisor. A
    refusal of the labels, the mask, the count or the kept sets reaches every rank of the group."""
    group = layer.process_group
    with refused_together(group):
        args = _kept_rows_of(hidden, layer, labels, old_log_probs, advantages, loss_mask, count, kw)
    hidden, labels, old_log_probs, advantages, lm, temperature, keep, require, rows = args
    hidden = select_rows(rows, hidden, process_group=group, sequence_parallel=layer.sequence_parallel,
                         require=require, labels=labels, old_log_probs=old_log_probs, advantages=advantages,
                         loss_mask=lm, keep=keep if isinstance(keep, torch.Tensor) else None,
                         **{k: kw[k] for k in ("ref_log_probs", "rollout_is_weights", "rollout_log_probs")})
    return linear_policy_loss(hidden, layer.replace(sequence_parallel=False), labels, old_log_probs, advantages, lm,
                              temperature=temperature, keep=keep, **kw)


def _kept_rows_of(hidden, layer: OutputLayer, labels, old_log_probs, advantages, loss_mask, count, kw):
    """The checks and the per-row inputs of :func:`_kept_loss` (``kw`` updated in place)."""
    if not isinstance(loss_mask, torch.Tensor) or not isinstance(labels, torch.Tensor) or loss_mask.dim() != 2 \
            or loss_mask.shape != labels.shape:
        raise ValueError("rows='kept' selects the rows by loss_mask: labels and loss_mask must be [B, T] tensors "
                         "of one shape")
    group, sequence_parallel = layer.process_group, layer.sequence_parallel
    check_full_shape("labels", labels, hidden, group, sequence_parallel, batch_first=True)
    per_token = dict(old_log_probs=old_log_probs, advantages=advantages,
                     **{k: kw[k] for k in ("ref_log_probs", "rollout_is_weights", "rollout_log_probs")})
    for name, x in per_token.items():
        if isinstance(x, torch.Tensor) and x.shape != labels.shape:
            raise ValueError(f"with rows='kept', {name} must have the labels' shape {tuple(labels.shape)}, got "
                             f"{tuple(x.shape)}")
    b, t = labels.shape
    kept = loss_mask != 0
    n = kept.sum(1)
    width = int(n.max()) if count is None and b else (count or 0)  # the one host sync (none with a count)
    require = None
    if count is not None:
        if count > t:
            raise ValueError(f"rows=('kept', {count}): the count exceeds the sequence length {t}")
        require = ((n <= count).all(), f"rows=('kept', {count}): a sequence keeps more rows than the count")
    pos = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices[:, :width]  # kept positions first
    pad = torch.arange(width, device=pos.device) >= n[:, None]
    seq = torch.arange(b, device=pos.device)[:, None]
    rows = pos * b + seq if sequence_parallel else seq * t + pos
    tok = (seq * t + pos).reshape(-1)  # the selected rows in the [B, T] order of the per-token inputs
    at = lambda x: None if x is None else x.gather(1, pos)  # noqa: E731
    lm = at(loss_mask)
    lm = lm.masked_fill(pad, False if lm.dtype == torch.bool else 0)
    temperature, keep = kw.pop("temperature"), kw.pop("keep")
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temperature = take_rows(temperature, labels.shape, tok).view(b, width)
    keep = take_keep(keep, labels.shape, tok)
    if isinstance(keep, torch.Tensor) and keep.dim() == 2:
        keep = keep.view(b, width, keep.shape[-1])
    agg = kw["loss"].aggregation
    if agg.loss_scale_factor is None:
        kw["loss"] = kw["loss"].replace(aggregation=Aggregation(agg.mode, t, agg.dp_size, agg.batch_num_tokens,
                                                                agg.global_batch_size))
    for name in ("ref_log_probs", "rollout_is_weights", "rollout_log_probs"):
        kw[name] = at(kw[name])
    labels, old_log_probs, advantages = at(labels), at(old_log_probs), at(advantages)
    return hidden, labels, old_log_probs, advantages, lm, temperature, keep, require, rows


class _LogitsLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tok: Tokens, plan: Plan, objective: _Objective):
        n, v = tok.n, logits.shape[-1]
        cdt = compute_dtype(logits.dtype)
        fill, view = logits_source(logits)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(n, v)
        # the gradient's own rows are the working buffer, unless kept sets' sparse term is added to a
        # half-precision block: then it is formed in the compute dtype and rounded once (see logits.py)
        direct = logits.dtype == cdt or (plan.compiled and tok.keep is None)
        stats = new_row_stats(n, Want(), cdt, logits.device, tok.keep)
        blocks = loss_grad_blocks(
            tok, fill, plan, width=v, token_grads=objective.token_grads, span=objective.span, stats=stats,
            dtype=cdt, device=logits.device, into=(lambda a, b: gflat[a:b]) if direct else None, view=view,
        )
        for a, b, _, _, g in blocks:
            if not direct:
                gflat[a:b].copy_(g)
        loss = objective.finish(tok, stats)
        # Saved: the logits' gradient (allocated here instead of in backward); no reference to the logits.
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return hand_over(grad, g), None, None, None


@accepts_01_keywords("policy_loss_from_logits", policy_fields=True)
@dtensor_logits_op(scalar=True)
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
    with refused_together(group_of(layer)):
        (layer, chunking), opts = settings(layer, chunking, logits=True), as_loss(loss)
        _check_rows_2d(rows)
    process_group = layer.process_group
    if rows is not None:
        logits = select_logit_rows(rows, logits, process_group, labels=labels, old_log_probs=old_log_probs,
                                   advantages=advantages, loss_mask=loss_mask, ref_log_probs=ref_log_probs,
                                   rollout_is_weights=rollout_is_weights, rollout_log_probs=rollout_log_probs,
                                   keep=keep if isinstance(keep, torch.Tensor) else None)
    with agreed_call(process_group) as call:  # every rank validates; a refused call raises on all of them
        check_float("logits", logits)
        if logits.dim() < 1 or logits.shape[-1] < 1:
            raise ValueError(f"logits must be [..., V_local] with V_local >= 1, got shape {tuple(logits.shape)}")
        check_layer_width(layer, logits.shape[-1])
        cdt = compute_dtype(logits.dtype)
        objective = _Objective(opts, labels, old_log_probs, advantages, loss_mask, ref_log_probs, rollout_is_weights,
                               rollout_log_probs, generator, cdt)
        plan = plan_for(layer, chunking, lead=logits.shape[:-1], want=Want(), device=logits.device,
                        width=logits.shape[-1])
        grads = torch.is_grad_enabled() and logits.requires_grad
        tok = prepare_tokens(
            labels, logits.shape[:-1], logits.shape[-1], call=call, label_mask=objective.keep, ignore_index=-100,
            mask_only=True, temperature=temperature, device=logits.device, dtype=cdt, transform=layer.transform,
            keep=keep, entropy_of=opts.entropy_of,
        )
        agree_objects(call, layer=layer, chunking=chunking)
        call.agree_all({"logits.requires_grad": grads,
                        "logits.dtype (0 float32, 1 bfloat16, 2 float16, 3 float64)": dtype_code(logits.dtype)})
        call.agree_all(objective.settings(call))
    if tok.n == 0 or not grads:
        lp = ent = torch.zeros(0, dtype=cdt, device=logits.device)
        if tok.n:
            lp, ent = _token_results(tok, logits_row_stats(logits, tok, plan))
        loss, metrics = objective.value(lp, ent)
        return (connected(loss, logits) if grads else loss), metrics
    loss = _LogitsLossFunction.apply(logits, tok, plan, objective)
    return loss, objective.result[1]
