"""Divergences between a student's and a teacher's next-token distributions; neither model's logits formed.

Layer: ops, beside :mod:`chunked_entropy.linear` and :mod:`chunked_entropy.policy`:

- :func:`linear_divergence`: per-token forward KL, reverse KL or generalized JSD
  from both models' hidden states and (vocab-parallel) output weights, with the
  student's log-probs at labels and entropy from the same pass; gradients into
  the student only.
- :func:`linear_divergence_loss`: the weighted sum (or mean) of it, the
  student's gradients formed inside the forward walk (four projection-sized
  matmuls per step: two projections, two gradient matmuls).
- :func:`divergence_from_logits`: the same from logits the caller holds.

The walks are :mod:`chunked_entropy._loop`'s two-head walks, a second projection per
block: the statistics walk (:func:`~chunked_entropy._loop.pair_row_stats`), the
loss walk that forms the student's gradient in forward
(:func:`~chunked_entropy._loop.pair_loss_grad_blocks`) and the gradient walk
(:func:`~chunked_entropy._loop.pair_grad_blocks`); the math is
:mod:`chunked_entropy._divergence` (one class per divergence). Under a process
group the forward makes three collectives per chunk (one MAX all-reduce and one
all-gather of both heads' statistics, one SUM all-reduce of the divergence's
sums; a KL over vocabulary blocks folds its value into the statistics and makes
two); backward none per chunk.

The chunking's ``backend`` chooses the kernels (``Plan.compiled``, as for the
fused head), and the student layer's ``gradient_accumulation_fusion`` adds the
student's weight gradient into ``main_grad`` (the linear Functions' trailing
argument, :func:`~chunked_entropy._logit_blocks.main_grad_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Union

import torch

from ._autograd import once_differentiable
from ._call import (
    agree_objects,
    apply_or_forward,
    group_of,
    loss_grads,
    plan_for,
    refused_together,
    save_loss_grads,
    zeros_connected,
)
from ._checks import check_device, check_flag, check_float, float_bits, is_finite_real, value_repr
from ._divergence import PairRows
from ._dtensor import dtensor_hidden_op, dtensor_logits_op
from ._inputs import (
    Rows,
    Tokens,
    check_ignore_index,
    check_transform_scale,
    compute_dtype,
    dtype_code,
    prepare_tokens,
    token_shape,
)
from ._logit_blocks import (
    full_hidden,
    grad_vocab_block,
    linear_filler,
    linear_grads,
    logits_source,
    main_grad_of,
    main_grad_result,
    reduce_hidden_grad,
    three_pass_plan,
)
from ._loop import Plan, new_pair_rows, new_row_stats, pair_grad_blocks, pair_loss_grad_blocks, pair_row_stats
from ._migrate import accepts_01_keywords
from ._rows import kept_rows, parse_kept, put_rows, select_logit_rows, select_rows, take_rows
from ._stats import RowStats, Transform, Want
from .options import Chunking, Divergence, OutputLayer, as_chunking, as_divergence, as_layer, check_layer_width
from .parallel import agreed_call, all_gather_dim0, fingerprint_floats, group_rank_size, live_group, weak_group

__all__ = [
    "DivergenceLoss",
    "DivergenceOutputs",
    "divergence_from_logits",
    "linear_divergence",
    "linear_divergence_loss",
]


#: The default chunk of the two-head walks: a quarter of the fused head's (four blocks are live).
PAIR_CHUNK = 256


class DivergenceOutputs(NamedTuple):
    """Per-token outputs, each in the tokens' leading shape: ``divergence`` (0 on masked rows),
    ``log_probs`` (the student's at ``labels``; None without labels) and ``entropy`` (the student's, at the
    divergence's temperature; None unless ``compute_entropy``)."""

    divergence: torch.Tensor
    log_probs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


class DivergenceLoss(NamedTuple):
    """The loss form's result: the scalar ``loss`` (differentiable w.r.t. the student) and, detached, the
    per-token ``divergence`` and (``compute_entropy``) ``entropy`` it was made of, for logging."""

    loss: torch.Tensor
    divergence: torch.Tensor
    entropy: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class _Teacher:
    """The teacher's side of a call: detached tensors and its transform (no gradient ever flows here)."""

    source: object  # the filled rows: hidden states (full sequence) or logits
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    transform: Transform
    float32_logits: bool = False  # the teacher's own resolution of logits_dtype (a half-precision teacher's)




def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds no NaN or inf, as a 0-d bool tensor (no host sync), from one min-max reduction:
    no temporary of ``t``'s size (``torch.isfinite(t).all()`` makes three, one of them float). NaN
    propagates through both extremes, and an infinity is one of them."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _loss_weights(call, tok: Tokens, valid, *, reduction, normalizer, weights, cdt, device) -> torch.Tensor:
    """The loss form's per-token weights ``w_i`` (see :func:`linear_divergence_loss`), its arguments checked
    inside the call's agreement: each rank records ``reduction``, the normalizer's value and the weights'
    presence and digest, so that a bad or different value on one rank is refused on every rank."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    w = valid.to(cdt)
    if weights is not None:
        check_float("weights", weights)
        if weights.shape != tok.shape:
            raise ValueError(f"weights must have the tokens' shape {tuple(tok.shape)}, got {tuple(weights.shape)}")
        check_device("weights", weights, device, "student_hidden")
        w = w * weights.detach().reshape(-1).to(dtype=cdt)
    if normalizer is None:
        norm = (0, 0, 0)
        if reduction == "mean":
            w = w / valid.sum().clamp(min=1).to(cdt)
    elif isinstance(normalizer, torch.Tensor):
        if normalizer.dtype == torch.bool or normalizer.is_complex():
            raise TypeError(f"normalizer must be a number > 0 or a real 0-d tensor, got {normalizer.dtype}")
        if normalizer.dim() != 0:
            raise ValueError(f"normalizer must be a number > 0 or a 0-d tensor (one value for every token), "
                             f"got a tensor of shape {tuple(normalizer.shape)}")
        if normalizer.device != device and normalizer.device.type != "cpu":  # a CPU scalar is read from anywhere
            check_device("normalizer", normalizer, device, "student_hidden")
        nz = normalizer.detach().to(device=device, dtype=cdt)
        call.require(torch.isfinite(nz) & (nz > 0), "normalizer must be a number > 0 or a 0-d tensor holding one, "
                     "got a tensor holding 0, a negative value, NaN or inf")
        w = w / nz
        norm = (2, *fingerprint_floats(nz)) if call.world > 1 else (2, 0, 0)
    elif is_finite_real(normalizer) and normalizer > 0:
        w = w / float(normalizer)
        norm = (1, float_bits(normalizer), 0)
    else:
        raise ValueError(f"normalizer must be a number > 0 or a 0-d tensor, got {value_repr(normalizer)}")
    call.agree("reduction (0 mean, 1 sum)", ("mean", "sum").index(reduction))
    call.agree("normalizer (kind 0 None, 1 a number, 2 a tensor; its value)", norm)
    call.agree("weights is not None", weights is not None)
    if call.world > 1:  # agreed whether given or not: a rank without weights is named, not a "different call"
        call.agree("weights (their values)", fingerprint_floats(weights))
    return w


def _one_group(student: OutputLayer, teacher: OutputLayer) -> tuple:
    """Both heads' vocabularies are sharded over one group, with one sequence-parallel layout."""
    if student.process_group is not teacher.process_group:
        raise ValueError("student_layer.process_group and teacher_layer.process_group must be the same group (both "
                         "vocabularies are sharded the same way over it)")
    if student.sequence_parallel != teacher.sequence_parallel:
        raise ValueError(f"student_layer.sequence_parallel ({student.sequence_parallel}) and "
                         f"teacher_layer.sequence_parallel ({teacher.sequence_parallel}) must agree: both hidden "
                         "states arrive split the same way")
    return student.process_group, student.sequence_parallel


def _check_same_tokens(student, teacher, what: str) -> None:
    """The two models' inputs must describe the same tokens and the same vocabulary shard."""
    if teacher.shape[:-1] != student.shape[:-1]:
        raise ValueError(
            f"teacher_{what} must have the leading shape of student_{what}, {tuple(student.shape[:-1])} "
            f"(the same tokens), got {tuple(teacher.shape[:-1])}"
        )
    check_device(f"teacher_{what}", teacher, student.device, f"student_{what}")


def _prepare(call, lead, labels, *, v_local, label_mask, ignore_index, temperature, tf_s, tf_t, device, cdt,
             teacher_values, teacher_name):
    """Tokens (the student's labels and temperatures, checked as the other ops check them), the rows the
    divergence counts, and the teacher's checks; every rank records what it must agree on."""
    no_labels = labels is None
    if no_labels:  # every row unlabelled: ignore_index checked first, as prepare_tokens checks it
        labels = torch.full(tuple(lead), check_ignore_index(ignore_index), dtype=torch.int64, device=device)
    tok = prepare_tokens(labels, lead, v_local, call=call, label_mask=label_mask, ignore_index=ignore_index,
                         temperature=temperature, device=device, dtype=cdt, transform=tf_s)
    if no_labels:
        valid = (torch.ones(tok.n, dtype=torch.bool, device=device) if label_mask is None
                 else label_mask.reshape(-1).to(device=device, dtype=torch.bool))
    else:
        valid = tok.valid
    check_transform_scale(tf_t, tok.inv_t, cdt, call)
    call.require(_all_finite(teacher_values),
                 f"{teacher_name} must be finite (no NaN or inf): a teacher's NaN would poison every divergence")
    call.agree("teacher_softcap", float_bits(tf_t.softcap))
    call.agree("teacher_logit_scale", float_bits(tf_t.logit_scale))
    if call.world > 1:
        call.agree("label_mask (the rows the divergence counts)", fingerprint_floats(valid.to(torch.float32)))
    return tok, valid, no_labels


def _pair_results(tok: Tokens, stats: RowStats, pair: PairRows, valid, want: Want):
    div = torch.where(valid, pair.div, 0.0)
    lp = torch.where(tok.valid, stats.log_probs(), 0.0)
    ent = stats.entropy() if want.entropy else torch.zeros_like(div)
    return div, lp, ent


def _walk(tok, teacher_fill, spec, fill, *, width, plan: Plan, teacher: _Teacher, dtype, device) -> tuple:
    """The statistics walk, :func:`~chunked_entropy._loop.pair_row_stats`: ``(stats, pair)``."""
    return pair_row_stats(tok, teacher.transform, spec, fill, teacher_fill, plan, width=width, dtype=dtype,
                          device=device)


def _teacher_fill(teacher: _Teacher, plan: Plan):
    return linear_filler(Rows(teacher.source), teacher.weight, teacher.bias, teacher.float32_logits)


def _saved_rows(stats: RowStats, pair: PairRows) -> tuple:
    return (stats.m, stats.ls, stats.ws, pair.m_t, pair.ls_t, pair.div, pair.aux)


def _rows_from_saved(t) -> tuple:
    m, ls, ws, m_t, ls_t, div, aux = t
    return RowStats(m, ls, ws, None, None), PairRows(m_t, ls_t, div, aux)


class _LinearDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher: _Teacher, tok: Tokens, plan: Plan, spec, valid, main_grad=None):
        h_full = full_hidden(hidden, plan)
        cdt = compute_dtype(weight.dtype)
        stats, pair = _walk(tok, _teacher_fill(teacher, plan), spec,
                            linear_filler(Rows(h_full), weight, bias, plan.float32_logits),
                            width=weight.shape[0], plan=plan, teacher=teacher, dtype=cdt, device=weight.device)
        # Saved: references to the student's hidden (this rank's slice under sequence parallelism), weight
        # and bias, the teacher's (detached; its full hidden states under sequence parallelism), and five to
        # seven float32 per token.
        ctx.save_for_backward(hidden, weight, bias, valid, *_saved_rows(stats, pair))
        ctx.teacher, ctx.tok, ctx.spec = teacher, tok, spec
        ctx.plan, ctx.group = replace(plan, group=None), weak_group(plan.group)
        ctx.main_grad = main_grad
        ctx.weight_param = weight if main_grad is not None else None
        ctx.set_materialize_grads(False)
        return _pair_results(tok, stats, pair, valid, plan.want)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_div, g_lp, g_h):
        hidden, weight, bias, valid, *saved = ctx.saved_tensors
        stats, pair = _rows_from_saved(saved)
        tok, plan = ctx.tok, replace(ctx.plan, group=live_group(ctx.group))
        need = ctx.needs_input_grad[:3]
        if g_div is None and g_lp is None and g_h is None:
            return (None,) * 9
        if g_div is not None:
            g_div = torch.where(valid, g_div.reshape(-1), 0.0)
        if not plan.want.entropy:
            g_h = None
        h_full = full_hidden(hidden, plan)
        rows = Rows(h_full)
        cdt = stats.ls.dtype
        vocab_block = grad_vocab_block(tok.n, weight, plan, need[1])
        blocks = pair_grad_blocks(
            tok, ctx.teacher.transform, ctx.spec, linear_filler(rows, weight, bias, plan.float32_logits),
            _teacher_fill(ctx.teacher, plan), plan, width=weight.shape[0], block=vocab_block,
            vocab_outer=vocab_block is not None, stats=stats, pair=pair, grads=(g_div, g_lp, g_h), dtype=cdt,
            device=weight.device,
        )
        main_grad = ctx.main_grad if need[1] else None
        grad_h, gw, gb = linear_grads(blocks, rows, weight, n=tok.n, hidden_dtype=hidden.dtype,
                                      chunk_size=plan.chunk_size, need=need, float32=plan.float32_logits,
                                      vocab_block=vocab_block, main_grad=main_grad)
        grad_hidden = None if grad_h is None else reduce_hidden_grad(grad_h, h_full.shape, plan)
        if main_grad is not None:
            gw = main_grad_result(ctx.weight_param, main_grad)
        return (grad_hidden, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None)


class _LinearDivergenceLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher: _Teacher, tok: Tokens, plan: Plan, spec, weights, main_grad=None,
                three_pass: Optional[Plan] = None):
        need = ctx.needs_input_grad[:3]
        h_full = full_hidden(hidden, plan)
        rows = Rows(h_full)
        cdt = compute_dtype(weight.dtype)
        dev = weight.device
        fill, teacher_fill = linear_filler(rows, weight, bias, plan.float32_logits), _teacher_fill(teacher, plan)
        # half-precision weights: the statistics walk, then the gradients over vocabulary blocks outermost (as
        # the backward of linear_divergence walks them); else, or where the walk with a float32 weight-gradient
        # accumulator fits the budget (three_pass, see three_pass_plan), the loss walk, the gradients formed in it
        if three_pass is not None:
            plan, vocab_block = three_pass, None
        else:
            vocab_block = grad_vocab_block(tok.n, weight, plan, need[1])
        width, tf_t = weight.shape[0], teacher.transform
        if any(need) and vocab_block is None:
            stats, pair = new_row_stats(tok.n, plan.want, cdt, dev), new_pair_rows(tok.n, spec, cdt, dev)
            blocks = pair_loss_grad_blocks(tok, tf_t, spec, fill, teacher_fill, plan, width=width, weights=weights,
                                           stats=stats, pair=pair, dtype=cdt, device=dev)
        else:
            stats, pair = _walk(tok, teacher_fill, spec, fill, width=width, plan=plan, teacher=teacher, dtype=cdt,
                                device=dev)
            blocks = () if vocab_block is None else pair_grad_blocks(
                tok, tf_t, spec, fill, teacher_fill, plan, width=width, block=vocab_block, stats=stats, pair=pair,
                grads=(weights, None, None), dtype=cdt, device=dev, vocab_outer=True)
        # With main_grad (Megatron's float32 accumulator), or summed chunk by chunk (three_pass), the weight
        # gradient is kept in float32 until the upstream gradient scales it in backward, rounded once there;
        # else in the weight's dtype.
        f32_weight_grad = main_grad is not None or three_pass is not None
        grad_h, gw, gb = linear_grads(blocks, rows, weight, n=tok.n, hidden_dtype=hidden.dtype,
                                      chunk_size=plan.chunk_size, need=need, float32=plan.float32_logits,
                                      vocab_block=vocab_block, weight_grad_dtype=cdt if f32_weight_grad else None)
        if grad_h is not None:
            grad_h = reduce_hidden_grad(grad_h, h_full.shape, plan)
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


def _linear_call(student_hidden, student: OutputLayer, teacher_hidden, teacher: OutputLayer, *,
                 divergence: Divergence, chunking: Chunking, labels, temperature, label_mask, ignore_index,
                 compute_entropy, loss: Optional[dict] = None):
    """Check everything (every rank agreeing) and prepare: ``(tok, plan, spec, teacher, valid, no_labels, grads,
    w)``. ``loss``: the loss form's ``reduction``, ``normalizer`` and ``weights`` (``w``, its per-token weights,
    is None without)."""
    with refused_together(student.process_group):
        process_group, sequence_parallel = _one_group(student, teacher)
    student_weight, student_bias, teacher_weight, teacher_bias = student.weight, student.bias, teacher.weight, \
        teacher.bias
    with agreed_call(process_group) as call:
        compute_entropy = check_flag("compute_entropy", compute_entropy)
        float32 = student.check_hidden(student_hidden, "student_hidden")
        float32_t = teacher.check_hidden(teacher_hidden, "teacher_hidden")
        _check_same_tokens(student_hidden, teacher_hidden, "hidden")
        if teacher_weight.shape[0] != student_weight.shape[0]:
            raise ValueError(
                f"teacher_weight has {teacher_weight.shape[0]} vocabulary rows but student_weight has "
                f"{student_weight.shape[0]}: the divergence needs one vocabulary, sharded the same way "
                "(rank r holds ids [r*V_local, (r+1)*V_local) of both heads)"
            )
        if teacher_weight.device != student_weight.device:
            raise ValueError(f"teacher_weight is on {teacher_weight.device} but student_weight is on "
                             f"{student_weight.device}")
        lead = token_shape(student_hidden, call.world, sequence_parallel, name="student_hidden")
        v_local = student_weight.shape[0]
        cdt = compute_dtype(student_weight.dtype)
        tf_s, tf_t = student.transform, teacher.transform
        tok, valid, no_labels = _prepare(
            call, lead, labels, v_local=v_local, label_mask=label_mask, ignore_index=ignore_index,
            temperature=temperature, tf_s=tf_s, tf_t=tf_t, device=student_hidden.device, cdt=cdt,
            teacher_values=teacher_hidden, teacher_name="teacher_hidden",
        )
        for name, t in (("teacher_layer.weight", teacher_weight), ("teacher_layer.bias", teacher_bias)):
            if t is not None:  # as teacher_hidden: a teacher's NaN would poison every divergence
                call.require(_all_finite(t), f"{name} must be finite (no NaN or inf): a teacher's NaN would poison "
                             "every divergence")
        plan = plan_for(student, chunking, lead=lead, want=Want(compute_entropy, False), device=student_hidden.device,
                        buffers=4, pair=divergence.math)
        main_grad = main_grad_of(student_weight, student.gradient_accumulation_fusion)
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (student_hidden, student_weight, student_bias))
        call.agree_all({
            "chunk_size": plan.chunk_size, "vocab_chunk_size": plan.vocab_chunk_size,
            "compute_entropy": compute_entropy,
            "sequence_parallel": sequence_parallel,
            "student_hidden.shape[0] (sequence-parallel slice)": student_hidden.shape[0],
            "the student's hidden size (student_weight.shape[1])": student_weight.shape[1],
            "the teacher's hidden size (teacher_weight.shape[1])": teacher_weight.shape[1],
            "student_weight.dtype (0 float32, 1 bfloat16, 2 float16, 3 float64)": dtype_code(student_weight.dtype),
            "teacher_weight.dtype (0 float32, 1 bfloat16, 2 float16, 3 float64)": dtype_code(teacher_weight.dtype),
            "student_bias is not None": student_bias is not None, "teacher_bias is not None": teacher_bias is not None,
            "whether gradients are computed": grads, "logits_dtype (1: float32 blocks)": float32,
            "the teacher's logits_dtype (1: float32 blocks)": float32_t,
            "student_hidden.requires_grad (under grad mode)": bool(grads and student_hidden.requires_grad),
            "the loss form": loss is not None,
        })
        agree_objects(call, student_layer=student, teacher_layer=teacher, chunking=chunking, divergence=divergence)
        w = None if loss is None else _loss_weights(call, tok, valid, cdt=cdt, device=student_hidden.device, **loss)
    teacher = _Teacher(full_hidden(teacher_hidden.detach(), plan), teacher_weight.detach(),
                       None if teacher_bias is None else teacher_bias.detach(), tf_t, float32_t)
    return tok, plan, divergence, teacher, valid, no_labels, grads, w, main_grad


@accepts_01_keywords("linear_divergence", chunking=Chunking(PAIR_CHUNK))
@dtensor_hidden_op(pairs=(("student_hidden", "student_layer"), ("teacher_hidden", "teacher_layer")))
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
        rows: project only these rows, as in :func:`~chunked_entropy.linear_log_probs_and_entropy`: an
            int64 index into the student's flattened token rows (the gathered sequence under sequence
            parallelism), ``labels``, ``label_mask`` and ``teacher_hidden`` then given per selected row
            (``[*rows.shape]``, ``[*rows.shape, H_t]``); or ``"kept"`` / ``("kept", count)``: the rows of
            ``label_mask`` and ``labels`` (not ``ignore_index``), inputs and outputs in their full shape,
            outputs 0 elsewhere.

    Returns:
        :class:`DivergenceOutputs`, identical on every rank of ``process_group``. ``divergence`` and the
        optional outputs have gradients w.r.t. ``student_hidden``, ``student_weight`` and ``student_bias``.
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
        chunk (two for a KL with ``vocab_chunk_size``), backward none per chunk.
    """
    with refused_together(group_of(student_layer)):
        student_layer = as_layer(student_layer, "student_layer")
        teacher_layer = as_layer(teacher_layer, "teacher_layer")
        divergence, chunking = as_divergence(divergence), as_chunking(chunking, default=Chunking(PAIR_CHUNK))
    if rows is not None:
        return _rows_call(linear_divergence, dict(locals()))
    student_weight, student_bias = student_layer.weight, student_layer.bias
    tok, plan, spec, teacher, valid, no_labels, grads, _, main_grad = _linear_call(
        student_hidden, student_layer, teacher_hidden, teacher_layer, divergence=divergence, chunking=chunking,
        labels=labels, temperature=temperature, label_mask=label_mask, ignore_index=ignore_index,
        compute_entropy=compute_entropy,
    )
    if tok.n == 0:
        z = zeros_connected(tok.shape, compute_dtype(student_weight.dtype), student_hidden.device, grads,
                            student_hidden, student_weight, student_bias)
        return DivergenceOutputs(z, None if no_labels else z, z if compute_entropy else None)
    div, lp, ent = apply_or_forward(_LinearDivergenceFunction, student_hidden, student_weight, student_bias, teacher,
                                    tok, plan, spec, valid, main_grad, grads=grads)
    shape = tuple(tok.shape)
    return DivergenceOutputs(div.view(shape), None if no_labels else lp.view(shape),
                             ent.view(shape) if compute_entropy else None)


def _rows_call(op, a: dict):
    """``op`` (:func:`linear_divergence` or its loss form) with ``a["rows"]``: an index selects the student's
    rows (:func:`~chunked_entropy._rows.select_rows`); ``"kept"`` derives the index from the mask and the
    labels, takes every per-token input (the teacher's hidden rows too) at it, and puts the per-token outputs
    back in the full shape."""
    rows = a.pop("rows")
    group, sp = a["student_layer"].process_group, a["student_layer"].sequence_parallel
    per_token = [k for k in ("labels", "label_mask", "weights") if a.get(k) is not None]
    with refused_together(group):
        kept = parse_kept(rows)
    if kept is None:
        a["student_hidden"] = select_rows(
            rows, a["student_hidden"], process_group=group, sequence_parallel=sp, name="student_hidden",
            layer_name="student_layer", tails=("teacher_hidden",), teacher_hidden=a["teacher_hidden"],
            **{k: a[k] for k in per_token})
        _not_sequence_parallel(a)
        return op(**a)
    s, t = a["student_hidden"], a["teacher_hidden"]
    with agreed_call(group):  # a rank's refusal here reaches every rank before the gather below
        if not isinstance(s, torch.Tensor) or not isinstance(t, torch.Tensor) or s.dim() < 2 or t.dim() < 2:
            raise ValueError("rows='kept': student_hidden and teacher_hidden must be [..., H] tensors")
        world = group_rank_size(group)[1] if sp else 1
        lead = token_shape(s, world, sp, name="student_hidden")
        valid = torch.ones(lead, dtype=torch.bool, device=s.device)
        for name in ("labels", "label_mask"):
            x = a.get(name)
            if isinstance(x, torch.Tensor):
                if x.shape != lead or x.device != s.device:
                    raise ValueError(f"{name} must have the tokens' leading shape {tuple(lead)} on {s.device}, got "
                                     f"{tuple(x.shape)} on {x.device}")
                valid &= (x != check_ignore_index(a["ignore_index"])) if name == "labels" else x.to(torch.bool)
        idx, require = kept_rows(valid, kept[1])
    if world > 1:
        t = all_gather_dim0(t.detach(), group)
    with refused_together(group):  # met by the peers' next agreed call (select_rows')
        a["teacher_hidden"] = take_rows(t, lead, idx)
        for k in per_token + ["temperature"]:
            a[k] = take_rows(a[k], lead, idx)
    a["student_hidden"] = select_rows(
        idx, s, process_group=group, sequence_parallel=sp, name="student_hidden", layer_name="student_layer",
        tails=("teacher_hidden",), require=require, teacher_hidden=a["teacher_hidden"], **{k: a[k] for k in per_token})
    _not_sequence_parallel(a)
    out = op(**a)
    per = lambda x: put_rows(x, lead, idx)  # noqa: E731
    if isinstance(out, DivergenceLoss):
        return DivergenceLoss(out.loss, per(out.divergence), per(out.entropy))
    return DivergenceOutputs(per(out.divergence), per(out.log_probs), per(out.entropy))


def _not_sequence_parallel(a: dict) -> None:
    """The selected rows are gathered: the call on them is not sequence-parallel."""
    for k in ("student_layer", "teacher_layer"):
        a[k] = a[k].replace(sequence_parallel=False)


@accepts_01_keywords("linear_divergence_loss", chunking=Chunking(PAIR_CHUNK))
@dtensor_hidden_op(pairs=(("student_hidden", "student_layer"), ("teacher_hidden", "teacher_layer")), scalar=True)
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
    with refused_together(group_of(student_layer)):
        student_layer = as_layer(student_layer, "student_layer")
        teacher_layer = as_layer(teacher_layer, "teacher_layer")
        divergence, chunking = as_divergence(divergence), as_chunking(chunking, default=Chunking(PAIR_CHUNK))
    if rows is not None:
        return _rows_call(linear_divergence_loss, dict(locals()))
    student_weight, student_bias = student_layer.weight, student_layer.bias
    tok, plan, spec, teacher, valid, _, grads, w, main_grad = _linear_call(
        student_hidden, student_layer, teacher_hidden, teacher_layer, divergence=divergence, chunking=chunking,
        labels=None, temperature=temperature, label_mask=label_mask, ignore_index=-100,
        compute_entropy=compute_entropy, loss=dict(reduction=reduction, normalizer=normalizer, weights=weights),
    )
    cdt = compute_dtype(student_weight.dtype)
    shape = tuple(tok.shape)
    if tok.n == 0:
        z = zeros_connected((), cdt, student_hidden.device, grads, student_hidden, student_weight, student_bias)
        e = torch.zeros(shape, dtype=cdt, device=student_hidden.device)
        return DivergenceLoss(z, e, e if compute_entropy else None)
    three_pass = None if not grads else three_pass_plan(
        tok.n, student_weight, plan, budget=chunking.max_working_bytes, vocab_chunk_size=chunking.vocab_chunk_size,
        need_w=student_weight.requires_grad, main_grad=main_grad is not None,
        softcap=tok.transform.softcap is not None, teacher=3 if spec.math.weighs is not None else 6)
    loss, div, ent = apply_or_forward(_LinearDivergenceLossFunction, student_hidden, student_weight, student_bias,
                                      teacher, tok, plan, spec, w, main_grad, three_pass, grads=grads)
    div = torch.where(valid, div, 0.0).view(shape)  # masked rows: 0, whatever their states held
    return DivergenceLoss(loss, div, torch.where(valid, ent, 0.0).view(shape) if compute_entropy else None)


# ----------------------------------------------------------------------------- from logits


class _LogitsDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher: _Teacher, tok: Tokens, plan: Plan, spec, valid):
        v = logits.shape[-1]
        cdt = compute_dtype(logits.dtype)
        fill, _ = logits_source(logits)
        stats, pair = _walk(tok, logits_source(teacher.source)[0], spec, fill, width=v, plan=plan,
                            teacher=teacher, dtype=cdt, device=logits.device)
        # Saved: the student's logits and the teacher's (references, detached) and five to seven float32 per token.
        ctx.save_for_backward(logits, valid, *_saved_rows(stats, pair))
        ctx.teacher, ctx.tok, ctx.spec = teacher, tok, spec
        ctx.plan = replace(plan, group=None)
        ctx.set_materialize_grads(False)
        return _pair_results(tok, stats, pair, valid, plan.want)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_div, g_lp, g_h):
        logits, valid, *saved = ctx.saved_tensors
        stats, pair = _rows_from_saved(saved)
        if g_div is None and g_lp is None and g_h is None:
            return (None,) * 6
        if g_div is not None:
            g_div = torch.where(valid, g_div.reshape(-1), 0.0)
        plan, tok = ctx.plan, ctx.tok
        if not plan.want.entropy:
            g_h = None
        v = logits.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(tok.n, v)
        blocks = pair_grad_blocks(tok, ctx.teacher.transform, ctx.spec, logits_source(logits)[0],
                                  logits_source(ctx.teacher.source)[0], plan, width=v, stats=stats, pair=pair,
                                  grads=(g_div, g_lp, g_h), dtype=stats.ls.dtype, device=logits.device)
        for a, b, v0, v1, g in blocks:
            gflat[a:b, v0:v1].copy_(g)
        return grad, None, None, None, None, None


@accepts_01_keywords("divergence_from_logits")
@dtensor_logits_op(logits=("student_logits", "teacher_logits"), layers=("student_layer", "teacher_layer"))
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
    rows=None,
) -> DivergenceOutputs:
    """:func:`linear_divergence` from logits the caller holds: ``[..., V_local]`` each, the same shard.

    Neither log-softmax is formed: each chunk of rows is copied into float32 buffers (four of
    ``[chunk_size, V_local]``, plus the divergence's temporaries) and reduced to per-token statistics;
    backward fills them again and writes the gradient w.r.t. ``student_logits`` (its shape and dtype;
    the teacher's logits get none). Arguments as :func:`linear_divergence` (``chunking`` defaults to 1024
    rows); ``student_layer`` and ``teacher_layer`` are the :class:`~chunked_entropy.OutputLayer` that made
    each model's logits, or None: their logit transforms and (one) ``process_group`` are read, as in
    :func:`~chunked_entropy.log_probs_and_entropy`; ``rows`` an int64 index into
    the student's flattened logit rows (the teacher's logits, the labels and the mask then given per
    selected row), one ``[M, V_local]`` gather of them.
    """
    with refused_together(group_of(student_layer)):
        student_layer = as_layer(student_layer, "student_layer", logits=True)
        teacher_layer = as_layer(teacher_layer, "teacher_layer", logits=True)
        divergence, chunking = as_divergence(divergence), as_chunking(chunking)
        process_group, _ = _one_group(student_layer, teacher_layer)
    if rows is not None:
        student_logits = select_logit_rows(rows, student_logits, process_group, name="student_logits",
                                           tails=("teacher_logits",), teacher_logits=teacher_logits, labels=labels,
                                           label_mask=label_mask)
    with agreed_call(process_group) as call:
        compute_entropy = check_flag("compute_entropy", compute_entropy)
        check_float("student_logits", student_logits)
        check_float("teacher_logits", teacher_logits)
        for name, t in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
            if t.dim() < 1 or t.shape[-1] < 1:
                raise ValueError(f"{name} must be [..., V_local] with V_local >= 1, got shape {tuple(t.shape)}")
        if teacher_logits.shape[-1] != student_logits.shape[-1]:
            raise ValueError(
                f"teacher_logits has {teacher_logits.shape[-1]} vocabulary columns but student_logits has "
                f"{student_logits.shape[-1]}: the divergence needs one vocabulary, sharded the same way"
            )
        _check_same_tokens(student_logits, teacher_logits, "logits")
        lead = student_logits.shape[:-1]
        v_local = student_logits.shape[-1]
        check_layer_width(student_layer, v_local, "student_layer")
        check_layer_width(teacher_layer, v_local, "teacher_layer")
        cdt = compute_dtype(student_logits.dtype)
        tf_s, tf_t = student_layer.transform, teacher_layer.transform
        tok, valid, no_labels = _prepare(
            call, lead, labels, v_local=v_local, label_mask=label_mask, ignore_index=ignore_index,
            temperature=temperature, tf_s=tf_s, tf_t=tf_t, device=student_logits.device, cdt=cdt,
            teacher_values=teacher_logits, teacher_name="teacher_logits",
        )
        grads = torch.is_grad_enabled() and student_logits.requires_grad
        call.agree_all({"compute_entropy": compute_entropy, "whether gradients are computed": grads})
        agree_objects(call, student_layer=student_layer, teacher_layer=teacher_layer, chunking=chunking,
                      divergence=divergence)
    plan = plan_for(student_layer, chunking, lead=lead, want=Want(compute_entropy, False),
                    device=student_logits.device, buffers=4, pair=divergence.math, width=v_local)
    teacher = _Teacher(teacher_logits.detach(), None, None, tf_t)
    shape = tuple(lead)
    if tok.n == 0:
        z = zeros_connected(shape, cdt, student_logits.device, grads, student_logits)
        return DivergenceOutputs(z, None if no_labels else z, z if compute_entropy else None)
    div, lp, ent = apply_or_forward(_LogitsDivergenceFunction, student_logits, teacher, tok, plan, divergence, valid,
                                    grads=grads)
    return DivergenceOutputs(div.view(shape), None if no_labels else lp.view(shape),
                             ent.view(shape) if compute_entropy else None)
