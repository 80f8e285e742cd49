"""Divergences between a student's and a teacher's next-token distributions; neither model's logits formed.

Layer: ops, beside :mod:`chunked_entropy.linear` and :mod:`chunked_entropy.policy`:

- :func:`linear_divergence`: per-token forward KL, reverse KL or generalized JSD
  from both models' hidden states and (vocab-parallel) output weights, with the
  student's log-probs at labels (over sampling replay's kept sets with ``keep``),
  entropy and distillation outputs (``log_probs_at``, ``top_k``) from the same
  pass; gradients into the student only.
- :func:`linear_divergence_loss`: the weighted sum (or mean) of it, the
  student's gradients formed inside the forward walk (four projection-sized
  matmuls per step: two projections, two gradient matmuls).
- :func:`divergence_from_logits`: the same from logits the caller holds.

The walks are :mod:`chunked_entropy._loop`'s, every op's, with the teacher as their
second head (:class:`~chunked_entropy._loop.TeacherHead`: a second projection per
block): the statistics walk (:func:`~chunked_entropy._loop.row_stats`), the loss
walk that forms the student's gradient in forward
(:func:`~chunked_entropy._loop.loss_grad_blocks`) and the gradient walk
(:func:`~chunked_entropy._loop.grad_blocks`); the math is
:mod:`chunked_entropy._divergence` (one class per divergence). Under a process
group the forward makes three collectives per chunk (one MAX all-reduce and one
all-gather of both heads' statistics, one SUM all-reduce of the divergence's
sums; a KL over vocabulary blocks folds its value into the statistics and makes
two); backward none per chunk.

The chunking's ``backend`` chooses the kernels (``Plan.kernels``, as for the
fused head), and the student layer's ``gradient_accumulation_fusion`` adds the
student's weight gradient into ``main_grad`` (the linear Functions' trailing
argument, :func:`~chunked_entropy._logit_blocks.main_grad_of`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional, Union

import torch

from ._call import (
    Chunking,
    Divergence,
    OutputLayer,
    Rows,
    RowsOf,
    RowStats,
    Teacher,
    Tokens,
    apply_or_forward,
    compute_dtype,
    dtensor_hidden_op,
    dtensor_logits_op,
    live_group,
    loss_grads,
    main_grad_result,
    once_differentiable,
    op,
    prepare,
    save_loss_grads,
    weak_group,
    zeros_connected,
)
from ._logit_blocks import full_hidden, head_grads, linear_filler, logits_source
from ._loop import (
    Plan,
    TeacherHead,
    grad_blocks,
    loss_grad_blocks,
    new_pair_rows,
    new_row_stats,
    pair_rows_from_saved,
    row_stats,
    saved_pair_rows,
)

__all__ = [
    "DivergenceLoss",
    "DivergenceOutputs",
    "divergence_from_logits",
    "linear_divergence",
    "linear_divergence_loss",
]


#: The default chunk of the two-head walks: a quarter of the fused head's (four blocks are live).
PAIR_CHUNK = 256

_PAIRS = (("student_hidden", "student_layer"), ("teacher_hidden", "teacher_layer"))
_LAYERS = ("student_layer", "teacher_layer")
#: What ``rows=`` reads of the divergences over hidden states: the student's rows, the teacher's at them.
_ROWS = RowsOf("student_hidden", ("labels", "label_mask", "weights"), tails=("teacher_hidden", "log_probs_at", "keep"),
               layers=_LAYERS, kept="pair", default=Chunking(PAIR_CHUNK))


class _DivergenceTriple(NamedTuple):
    divergence: torch.Tensor
    log_probs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


class DivergenceOutputs(_DivergenceTriple):
    """Per-token outputs, each in the tokens' leading shape; unpacks as ``divergence, log_probs, entropy``:
    ``divergence`` (0 on masked rows), ``log_probs`` (the student's at ``labels``, over the kept sets with
    ``keep``; None without labels) and ``entropy`` (the student's, at the divergence's temperature, of the
    whole row; None unless ``compute_entropy``). Attributes, not unpacked (as
    :class:`~chunked_entropy.LogProbsEntropy`'s): the student's ``log_probs_at`` (``[..., K]``, at the ids of
    ``log_probs_at=``), ``top_k_ids`` and ``top_k_log_probs`` (``[..., k]``, its own top-k with ``top_k=k``),
    each None when not asked."""

    #: The attributes beyond the three fields (carried by ``rows=`` and the DTensor front).
    _extra = ("log_probs_at", "top_k_ids", "top_k_log_probs")

    def __new__(cls, divergence, log_probs=None, entropy=None, log_probs_at=None, top_k_ids=None,
                top_k_log_probs=None):
        self = super().__new__(cls, divergence, log_probs, entropy)
        self.log_probs_at = log_probs_at
        self.top_k_ids = top_k_ids
        self.top_k_log_probs = top_k_log_probs
        return self

    @classmethod
    def _make(cls, iterable):
        return cls(*iterable)

    def __repr__(self):
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in self._extra if getattr(self, k) is not None)
        return (f"DivergenceOutputs(divergence={self.divergence!r}, log_probs={self.log_probs!r}, "
                f"entropy={self.entropy!r}{extra})")


class DivergenceLoss(NamedTuple):
    """The loss form's result: the scalar ``loss`` (differentiable w.r.t. the student) and, detached, the
    per-token ``divergence`` and (``compute_entropy``) ``entropy`` it was made of, for logging."""

    loss: torch.Tensor
    divergence: torch.Tensor
    entropy: Optional[torch.Tensor] = None


def _pair_results(ctx, tok: Tokens, stats: RowStats, pair, valid, want):
    """The Function's outputs: ``(divergence, log_probs, entropy)`` (zeros for an entropy not asked), then
    the student's distillation outputs where asked (:meth:`~chunked_entropy._inputs.Tokens.at_outputs`)."""
    div = torch.where(valid, pair.div, 0.0)
    lp, ent, _ = tok.outputs(stats, want)
    at_outs = tok.at_outputs(stats)
    if at_outs[1] is not None:
        ctx.mark_non_differentiable(at_outs[1])
    return (div, lp, ent if want.entropy else torch.zeros_like(div)) + tuple(t for t in at_outs if t is not None)


def _split_grads(grads, tok: Tokens, stats: RowStats) -> tuple:
    """A Function's upstream gradients: ``(g_div, g_lp, g_h)`` and distillation's ``[N, K + k]`` (or None: no
    distillation output, or none with a gradient), as the one-head ops split theirs."""
    g_div, g_lp, g_h, *extra = grads
    at = tok.at
    if at is None:
        return g_div, g_lp, g_h, None
    g_at = extra.pop(0) if at.ids is not None else None
    return g_div, g_lp, g_h, at.upstream(g_at, extra[1] if at.top_k else None, at.k_ids, at.top_k,
                                         stats.ls.unsqueeze(1))


def _outputs(p, outs) -> DivergenceOutputs:
    """The op's result from the Function's outputs (each in the tokens' leading shape)."""
    shape, at = tuple(p.tok.shape), p.tok.at
    div, lp, ent, *extra = outs
    tail = [None, None, None]
    if at is not None:
        tail[0] = extra.pop(0).view(shape + (at.k_ids,)) if at.ids is not None else None
        if at.top_k:
            tail[1:] = [t.view(shape + (at.top_k,)) for t in extra[:2]]
    return DivergenceOutputs(div.view(shape), None if p.no_labels else lp.view(shape),
                             ent.view(shape) if p.want.entropy else None, *tail)


def _empty(p, shape, device, inputs) -> DivergenceOutputs:
    """Zero tokens: zeros connected to ``inputs``, in the outputs' shapes."""
    z = zeros_connected(shape, p.cdt, device, p.grads, *inputs)
    at = p.tok.at
    k_ids, top = (0, 0) if at is None else (at.k_ids if at.ids is not None else 0, at.top_k or 0)
    new = lambda tail, kind=p.cdt: torch.zeros(shape + tail, dtype=kind, device=device)  # noqa: E731
    return DivergenceOutputs(z, None if p.no_labels else z, z if p.want.entropy else None,
                             zeros_connected(shape + (k_ids,), p.cdt, device, p.grads, *inputs) if k_ids else None,
                             new((top,), torch.int64) if top else None,
                             zeros_connected(shape + (top,), p.cdt, device, p.grads, *inputs) if top else None)


def _walk(tok, teacher_fill, spec, fill, *, width, plan: Plan, teacher: Teacher, dtype, device) -> tuple:
    """The statistics walk with the teacher as its second head (:func:`~chunked_entropy._loop.row_stats`):
    ``(stats, pair)``."""
    return row_stats(tok, fill, plan, width=width, dtype=dtype, device=device,
                     teacher=TeacherHead(teacher.transform, spec, teacher_fill))


def _teacher_fill(teacher: Teacher, plan: Plan):
    return linear_filler(Rows(teacher.source), teacher.weight, teacher.bias, teacher.float32_logits)


class _LinearDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher: Teacher, tok: Tokens, plan: Plan, spec, valid, main_grad=None):
        h_full = full_hidden(hidden, plan)
        cdt = compute_dtype(weight.dtype)
        stats, pair = _walk(tok, _teacher_fill(teacher, plan), spec,
                            linear_filler(Rows(h_full), weight, bias, plan.float32_logits),
                            width=weight.shape[0], plan=plan, teacher=teacher, dtype=cdt, device=weight.device)
        # Saved: references to the student's hidden (this rank's slice under sequence parallelism), weight
        # and bias, the teacher's (detached; its full hidden states under sequence parallelism), and five to
        # seven float32 per token.
        ctx.save_for_backward(hidden, weight, bias, valid, *saved_pair_rows(stats, pair))
        ctx.teacher, ctx.tok, ctx.spec = teacher, tok, spec
        ctx.plan, ctx.group = replace(plan, group=None), weak_group(plan.group)
        ctx.main_grad = main_grad
        ctx.weight_param = weight if main_grad is not None else None
        ctx.set_materialize_grads(False)
        return _pair_results(ctx, tok, stats, pair, valid, plan.want)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        hidden, weight, bias, valid, *saved = ctx.saved_tensors
        stats, pair = pair_rows_from_saved(saved)
        tok, plan = ctx.tok, replace(ctx.plan, group=live_group(ctx.group))
        need = ctx.needs_input_grad[:3]
        g_div, g_lp, g_h, at_grads = _split_grads(grads, tok, stats)
        if g_div is None and g_lp is None and g_h is None and at_grads is None:
            return (None,) * 9
        if g_div is not None:
            g_div = torch.where(valid, g_div.reshape(-1), 0.0)
        if not plan.want.entropy:
            g_h = None
        head = TeacherHead(ctx.teacher.transform, ctx.spec, _teacher_fill(ctx.teacher, plan))

        def walk(fill, plan, vocab_block, grad_rows):
            return grad_blocks(tok, fill, plan, width=weight.shape[0], block=vocab_block,
                               vocab_outer=vocab_block is not None, stats=stats, grads=(g_lp, g_h, None),
                               dtype=stats.ls.dtype, device=weight.device, pair=pair, div_grads=g_div,
                               at_grads=at_grads, teacher=head, grad_rows=grad_rows)

        main_grad = ctx.main_grad if need[1] else None
        grad_hidden, gw, gb = head_grads(walk, hidden, weight, bias, tok.n, plan, need, main_grad=main_grad,
                                         direct_rows=False)
        if main_grad is not None:
            gw = main_grad_result(ctx.weight_param, main_grad)
        return (grad_hidden, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None)


class _LinearDivergenceLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher: Teacher, tok: Tokens, plan: Plan, spec, weights, main_grad=None,
                three_pass: Optional[Plan] = None):
        need = ctx.needs_input_grad[:3]
        cdt = compute_dtype(weight.dtype)
        dev = weight.device
        width, head = weight.shape[0], TeacherHead(teacher.transform, spec, _teacher_fill(teacher, plan))
        found = {}

        def walk(fill, plan, vocab_block, grad_rows):
            # half-precision weights: the statistics walk (now), then the gradients over vocabulary blocks
            # outermost (as the backward of linear_divergence walks them); else, or where the walk with a float32
            # weight-gradient accumulator fits the budget (three_pass, see three_pass_plan), the loss walk, the
            # gradients formed in it
            if any(need) and vocab_block is None:
                stats = found["stats"] = new_row_stats(tok.n, plan.want, cdt, dev)
                pair = found["pair"] = new_pair_rows(tok.n, spec, cdt, dev)
                return loss_grad_blocks(tok, fill, plan, width=width, stats=stats, dtype=cdt, device=dev,
                                        teacher=head, pair=pair,
                                        token_grads=lambda a, b, _: (None, None, weights[a:b]))
            stats, pair = _walk(tok, head.fill, spec, fill, width=width, plan=plan, teacher=teacher, dtype=cdt,
                                device=dev)
            found.update(stats=stats, pair=pair)
            return () if vocab_block is None else grad_blocks(
                tok, fill, plan, width=width, block=vocab_block, stats=stats, grads=(None, None, None), dtype=cdt,
                device=dev, vocab_outer=True, teacher=head, pair=pair, div_grads=weights, grad_rows=grad_rows)

        # With main_grad (Megatron's float32 accumulator), or summed chunk by chunk (three_pass), the weight
        # gradient is kept in float32 until the upstream gradient scales it in backward, rounded once there;
        # else in the weight's dtype.
        f32_weight_grad = main_grad is not None or three_pass is not None
        grad_h, gw, gb = head_grads(walk, hidden, weight, bias, tok.n, plan, need, three_pass=three_pass,
                                    weight_grad_dtype=cdt if f32_weight_grad else None, direct_rows=False)
        stats, pair = found["stats"], found["pair"]
        save_loss_grads(ctx, grad_h, gw, gb, weight, bias, main_grad)  # the gradients; no reference to the inputs
        ent = stats.entropy() if plan.want.entropy else torch.zeros_like(pair.div)
        ctx.mark_non_differentiable(pair.div, ent)
        return (torch.where(weights != 0, pair.div, 0.0) * weights).sum(), pair.div, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g, _d, _e):
        if g is None:
            return (None,) * 10
        return *loss_grads(ctx, g), None, None, None, None, None, None, None


@op("linear_divergence", front=dtensor_hidden_op(pairs=_PAIRS), rows=_ROWS, chunking=Chunking(PAIR_CHUNK))
def linear_divergence(
    student_hidden: torch.Tensor,
    student_layer: Union[OutputLayer, torch.Tensor],
    teacher_hidden: torch.Tensor,
    teacher_layer: Union[OutputLayer, torch.Tensor],
    *,
    divergence: Union[Divergence, str, None] = None,
    chunking: Union[Chunking, int, None] = None,
    labels: Optional[torch.Tensor] = None,
    temperature=1.0,
    label_mask: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    compute_entropy: bool = False,
    keep=None,
    log_probs_at: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    rows=None,
) -> DivergenceOutputs:
    """Per-token divergence between the student's and the teacher's next-token distributions.

    ``p_s = softmax(transform_s(student_hidden @ W_s.T + b_s) / temperature)`` (``W_s``, ``b_s`` the
    student layer's weight and bias) and ``p_t`` likewise from the teacher's,
    ``transform(z) = softcap * tanh(logit_scale * z / softcap)`` (each part optional, per model).
    Neither model's logits exist beyond one ``[chunk_size, vocab_chunk_size]`` block at a time.

    Args:
        student_hidden: ``[..., H_s]`` (``[S/P, B, H_s]``, this rank's slice, with sequence parallelism).
        student_layer: the student's :class:`~chunked_entropy.OutputLayer` (or its bare ``[V_local, H_s]``
            weight): this rank's vocabulary shard, its bias, logit transform (soft-cap, logit scale) and
            ``logits_dtype`` (resolved for each model on its own: None keeps each model's logits in its
            weight's dtype; ``torch.float32`` gives a bf16/fp16 model float32 blocks). Its
            ``process_group`` (both weights sharded by rows over it; both hidden states replicated; the
            student's gradient summed over it) and ``sequence_parallel`` (both hidden states arrive split
            along dim 0, as the fused head's) must be the teacher layer's.
        teacher_hidden: ``[..., H_t]`` with the student's leading shape (the teacher's width may differ).
        teacher_layer: the teacher's :class:`~chunked_entropy.OutputLayer` (or weight), ``[V_local, H_t]``:
            the same vocabulary shard as the student's (rank ``r`` holds ids ``[r * V_local, (r + 1) *
            V_local)`` of both heads).
        divergence: a :class:`~chunked_entropy.Divergence` or its kind's name: ``"forward_kl"`` (the
            default), KL(teacher || student) (mode-covering, what SFT on the teacher's distribution
            minimizes); ``"reverse_kl"``, KL(student || teacher) (mode-seeking, on-policy distillation's
            usual choice); ``Divergence("jsd", beta)``, TRL's generalized JSD
            ``beta * KL(t || m) + (1 - beta) * KL(s || m)`` with ``m = (1 - beta) p_s + beta p_t``,
            ``beta`` in (0, 1) (TRL's ``beta`` 0 and 1 are the KLs: :meth:`Divergence.from_trl_beta`).
        chunking: a :class:`~chunked_entropy.Chunking` or an int (the chunk size; the default, 256, is a
            quarter of the fused head's: four blocks are live). Its ``vocab_chunk_size`` also blocks the
            vocabulary: the per-chunk buffers become ``chunk_size * vocab_chunk_size``; a KL's forward
            fills each block once (its value folded online with the log-sum-exps), the JSD's twice
            (statistics, then its sums, which need both models' final log-sum-exps). Its ``backend``
            chooses the kernels, as for :func:`~chunked_entropy.linear_log_probs_and_entropy`.
        labels: optional ``[...]`` int64 *global* ids (the full sequence under sequence parallelism): the
            student's log-probs at them come out of the same pass (``log_probs``).
        temperature: a float > 0 or a tensor broadcasting to the tokens, applied to both models after
            their transforms.
        label_mask: ``[...]`` bool; False rows (and, with ``labels``, rows labelled ``ignore_index``) have
            divergence 0 and no gradient. They are still projected (the walk has static shapes: no host
            sync) unless ``rows="kept"`` (or an index) leaves them out.
        compute_entropy: also the student's entropy at ``temperature`` (with its gradient).
        keep: sampling replay's kept sets of the student, as in
            :func:`~chunked_entropy.linear_log_probs_and_entropy`: ``log_probs`` is then over each row's kept set
            (the entropy stays the whole row's; the divergence is over the whole vocabulary). Not with
            ``log_probs_at`` or ``top_k``.
        log_probs_at: the student's log-probs at these ids (``[..., K]`` global ids in the tokens' leading
            shape), as in :func:`~chunked_entropy.linear_log_probs_and_entropy`: read from the student's blocks
            as the walk forms them (no pass of their own), differentiable (``log_probs_at``).
        top_k: the student's own top-k (``top_k_ids``, ``top_k_log_probs``), as there.
        rows: project only these rows, as in :func:`~chunked_entropy.linear_log_probs_and_entropy`: an
            int64 index into the student's flattened token rows (the gathered sequence under sequence
            parallelism), ``labels``, ``label_mask`` and ``teacher_hidden`` then given per selected row
            (``[*rows.shape]``, ``[*rows.shape, H_t]``); or ``"kept"`` / ``("kept", count)``: the rows of
            ``label_mask`` and ``labels`` (not ``ignore_index``), inputs and outputs in their full shape,
            outputs 0 elsewhere.

    Returns:
        :class:`DivergenceOutputs`, identical on every rank of ``process_group``. ``divergence`` and the
        optional outputs (but ``top_k_ids``) have gradients w.r.t. ``student_hidden``, ``student_weight`` and
        ``student_bias``.
        The teacher's tensors are detached: they never receive a gradient.

    Raises:
        ValueError: before any work, naming the argument (and, under a group, the rank): vocabularies
            that differ, hidden states of other leading shapes, a ``jsd`` ``beta`` outside (0, 1), a
            non-positive temperature, NaN or inf in ``teacher_hidden`` or the teacher layer's weight or bias,
            ranks that disagree.
        TypeError: tensors of the wrong kind or dtype, named.

    Memory:
        Saved for backward: references to the student's and the teacher's tensors (the teacher's hidden
        states gathered whole under sequence parallelism) and five to seven float32 per token. Forward and
        backward each hold four float32 ``[chunk_size, vocab_chunk_size]`` buffers (a fifth in backward with
        a student soft-cap; two in all with the compiled kernels) plus the divergence's block temporaries
        (two for the KLs, five for the JSD; see :mod:`chunked_entropy._divergence`). Backward allocates the
        student's gradients (or adds the weight's into ``main_grad``). No ``[tokens, V]`` tensor of either
        model exists. Inputs are never written. Under a process group, forward makes three collectives per
        chunk (two for a KL with ``vocab_chunk_size``), backward none per chunk. ``keep`` adds its kept sets'
        statistics (six float32 per token, saved for backward with their truncation flags) to the same
        collectives; ``log_probs_at`` and ``top_k`` keep the raw logits at their ids (``K + k`` per token, as
        :func:`~chunked_entropy.linear_log_probs_and_entropy`'s) and merge the top-k over the group once a call.
    """
    p = prepare(student_hidden, student_layer, labels, chunking=chunking, default=Chunking(PAIR_CHUNK),
                temperature=temperature, label_mask=label_mask, ignore_index=ignore_index,
                compute_entropy=compute_entropy, teacher=teacher_hidden, teacher_layer=teacher_layer,
                divergence=divergence, keep=keep, log_probs_at=log_probs_at, top_k=top_k)
    weight, bias, shape = p.layer.weight, p.layer.bias, tuple(p.tok.shape)
    if p.tok.n == 0:
        return _empty(p, shape, student_hidden.device, (student_hidden, weight, bias))
    return _outputs(p, apply_or_forward(_LinearDivergenceFunction, student_hidden, weight, bias, p.teacher, p.tok,
                                        p.plan, p.divergence, p.valid, p.main_grad, grads=p.grads))


@op("linear_divergence_loss", front=dtensor_hidden_op(pairs=_PAIRS, scalar=True), rows=_ROWS,
    chunking=Chunking(PAIR_CHUNK))
def linear_divergence_loss(
    student_hidden: torch.Tensor,
    student_layer: Union[OutputLayer, torch.Tensor],
    teacher_hidden: torch.Tensor,
    teacher_layer: Union[OutputLayer, torch.Tensor],
    *,
    divergence: Union[Divergence, str, None] = None,
    chunking: Union[Chunking, int, None] = None,
    temperature=1.0,
    reduction: str = "mean",
    normalizer=None,
    weights: Optional[torch.Tensor] = None,
    label_mask: Optional[torch.Tensor] = None,
    compute_entropy: bool = False,
    rows=None,
) -> DivergenceLoss:
    """The divergence as a trainer's loss, its gradients formed in forward: ``sum_i w_i * D_i``.

    ``w_i`` is ``label_mask_i`` (times ``weights_i`` when given: a float tensor of the tokens' shape, on
    the student's device), divided by the number of counted rows (``reduction="mean"``, at least 1), by
    ``normalizer`` (a number > 0 or a 0-d tensor holding one, e.g. TRL's ``num_items_in_batch``, on the
    student's device or the CPU), or by nothing (``reduction="sum"``). Arguments otherwise as
    :func:`linear_divergence` (no labels: the loss form is the divergence alone). Under a process group
    ``reduction``, the normalizer's value and the weights (shape and values) are part of the call's
    cross-rank check: a bad or a different value on one rank raises on every rank, before any
    collective of the walk. With zero tokens the loss is an exact 0, still connected to the student's
    tensors (a zero gradient), in every dtype. ``rows="kept"`` takes the rows of ``label_mask``, and
    ``weights`` is a per-token input, given per selected row with an index.

    Forward walks each chunk once with the vocabulary in one block: two projections, the statistics,
    the divergence's sums, then the student's logit gradient from the blocks still held and its two
    gradient matmuls (``g @ W_s`` and ``g.T @ h_s``): four projection-sized matmuls per step, where a
    per-token form and its backward take six. With ``vocab_chunk_size`` each block is filled twice for a KL
    (its value folds online in the statistics' pass), three times for the JSD. A bf16/fp16 student weight
    takes this walk where it fits ``chunking.max_working_bytes`` with a float32 ``[V_local, H]`` accumulator
    of its gradient (summed chunk by chunk, rounded once after backward scales it; none with ``main_grad``);
    otherwise the statistics walk, then the gradients over vocabulary blocks outermost: six matmuls, no
    float32 ``[V_local, H]`` tensor. Under a process group, three
    collectives per chunk (two for a KL with ``vocab_chunk_size``). Backward only scales the stored
    gradients by the loss's upstream gradient (half-precision ones in float32 rows of at most 64 MiB, rounded
    once).

    Memory:
        Holds the student's gradients (``[tokens, H_s]`` in the hidden states' dtype, ``[V_local, H_s]`` in
        the weight's, float32 with ``main_grad`` or the accumulator's walk, and a float32 ``[V_local]``) from
        forward to backward
        instead of references to the inputs, plus what
        :func:`linear_divergence` holds per chunk (a fifth buffer with a student soft-cap).
    """
    p = prepare(student_hidden, student_layer, chunking=chunking, default=Chunking(PAIR_CHUNK), temperature=temperature,
                label_mask=label_mask, compute_entropy=compute_entropy, teacher=teacher_hidden,
                teacher_layer=teacher_layer, divergence=divergence,
                loss_weights=dict(reduction=reduction, normalizer=normalizer, weights=weights))
    weight, bias, shape = p.layer.weight, p.layer.bias, tuple(p.tok.shape)
    if p.tok.n == 0:
        z = zeros_connected((), p.cdt, student_hidden.device, p.grads, student_hidden, weight, bias)
        e = torch.zeros(shape, dtype=p.cdt, device=student_hidden.device)
        return DivergenceLoss(z, e, e if p.want.entropy else None)
    three_pass = p.three_pass(weight, teacher=3 if p.divergence.math.weighs is not None else 6) if p.grads else None
    loss, div, ent = apply_or_forward(_LinearDivergenceLossFunction, student_hidden, weight, bias, p.teacher, p.tok,
                                      p.plan, p.divergence, p.weights, p.main_grad, three_pass, grads=p.grads)
    div = torch.where(p.valid, div, 0.0).view(shape)  # masked rows: 0, whatever their states held
    return DivergenceLoss(loss, div, torch.where(p.valid, ent, 0.0).view(shape) if p.want.entropy else None)


# ----------------------------------------------------------------------------- from logits


class _LogitsDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher: Teacher, tok: Tokens, plan: Plan, spec, valid):
        v = logits.shape[-1]
        cdt = compute_dtype(logits.dtype)
        fill, _ = logits_source(logits)
        stats, pair = _walk(tok, logits_source(teacher.source)[0], spec, fill, width=v, plan=plan,
                            teacher=teacher, dtype=cdt, device=logits.device)
        # Saved: the student's logits and the teacher's (references, detached) and five to seven float32 per token.
        ctx.save_for_backward(logits, valid, *saved_pair_rows(stats, pair))
        ctx.teacher, ctx.tok, ctx.spec = teacher, tok, spec
        ctx.plan = replace(plan, group=None)
        ctx.set_materialize_grads(False)
        return _pair_results(ctx, tok, stats, pair, valid, plan.want)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        logits, valid, *saved = ctx.saved_tensors
        stats, pair = pair_rows_from_saved(saved)
        g_div, g_lp, g_h, at_grads = _split_grads(grads, ctx.tok, stats)
        if g_div is None and g_lp is None and g_h is None and at_grads is None:
            return (None,) * 6
        if g_div is not None:
            g_div = torch.where(valid, g_div.reshape(-1), 0.0)
        plan, tok = ctx.plan, ctx.tok
        if not plan.want.entropy:
            g_h = None
        v = logits.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(tok.n, v)
        blocks = grad_blocks(tok, logits_source(logits)[0], plan, width=v, stats=stats, grads=(g_lp, g_h, None),
                             dtype=stats.ls.dtype, device=logits.device, pair=pair, div_grads=g_div, at_grads=at_grads,
                             teacher=TeacherHead(ctx.teacher.transform, ctx.spec, logits_source(ctx.teacher.source)[0]))
        for a, b, v0, v1, g in blocks:
            gflat[a:b, v0:v1].copy_(g)
        return grad, None, None, None, None, None


@op("divergence_from_logits", front=dtensor_logits_op(logits=("student_logits", "teacher_logits"), layers=_LAYERS),
    rows=RowsOf("student_logits", ("labels", "label_mask"), tails=("teacher_logits", "log_probs_at", "keep"),
                layers=_LAYERS, logits=True))
def divergence_from_logits(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    divergence: Union[Divergence, str, None] = None,
    chunking: Union[Chunking, int, None] = None,
    student_layer: Optional[OutputLayer] = None,
    teacher_layer: Optional[OutputLayer] = None,
    labels: Optional[torch.Tensor] = None,
    temperature=1.0,
    label_mask: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    compute_entropy: bool = False,
    keep=None,
    log_probs_at: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    rows=None,
) -> DivergenceOutputs:
    """:func:`linear_divergence` from logits the caller holds: ``[..., V_local]`` each, the same shard.

    Neither log-softmax is formed: each chunk of rows is copied into float32 buffers (four of
    ``[chunk_size, V_local]``, plus the divergence's temporaries) and reduced to per-token statistics;
    backward fills them again and writes the gradient w.r.t. ``student_logits`` (its shape and dtype;
    the teacher's logits get none). Arguments as :func:`linear_divergence` (``chunking`` defaults to 1024
    rows); ``student_layer`` and ``teacher_layer`` are the :class:`~chunked_entropy.OutputLayer` that made
    each model's logits, or None: their logit transforms and (one) ``process_group`` are read, as in
    :func:`~chunked_entropy.log_probs_and_entropy`; ``keep`` (read with the student's logits as its row's own
    filter too), ``log_probs_at`` and ``top_k`` as there; ``rows`` an int64 index into
    the student's flattened logit rows (the teacher's logits, the labels, the mask and the per-row ids then
    given per selected row), one ``[M, V_local]`` gather of them.
    """
    p = prepare(student_logits, student_layer, labels, chunking=chunking, logits=True, temperature=temperature,
                label_mask=label_mask, ignore_index=ignore_index, compute_entropy=compute_entropy,
                teacher=teacher_logits, teacher_layer=teacher_layer, divergence=divergence, keep=keep,
                log_probs_at=log_probs_at, top_k=top_k)
    shape = tuple(p.tok.shape)
    if p.tok.n == 0:
        return _empty(p, shape, student_logits.device, (student_logits,))
    return _outputs(p, apply_or_forward(_LogitsDivergenceFunction, student_logits, p.teacher, p.tok, p.plan,
                                        p.divergence, p.valid, grads=p.grads))
