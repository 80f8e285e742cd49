"""The call: from an op's public signature to its prepared call, in one preparation.

Layer: the call (below the ops, above the loop, the blocks and the per-token preparation). What it holds:

- :func:`op`, the one decorator of every public op: 0.1's keywords (:mod:`chunked_entropy._migrate`), the
  DTensor front (:mod:`chunked_entropy._dtensor`) and ``rows=`` (:func:`with_rows`: one wrapper for every op,
  its kind of ``"kept"`` rows given by the op's :class:`RowsOf`);
- :func:`prepare`, which turns an op's arguments into a :class:`Prepared` call: the option objects, the tokens'
  leading shape, the :class:`~chunked_entropy._loop.Plan`, the per-token inputs
  (:func:`~chunked_entropy._inputs.prepare_tokens`), the gradient targets and ``main_grad``, the teacher's side
  and the loss weights of a divergence, the policy loss's :class:`~chunked_entropy.losses._objective.Objective`.
  Everything is checked inside one :func:`~chunked_entropy.parallel.agreed_call`: every rank records what it
  must agree on (the objects' fingerprints, :func:`agree_objects`; the per-call tensors' metadata) and the one
  exchange at its end refuses on every rank together;
- the run's helpers: zero tokens give :func:`zeros_connected`, a call without gradients the Function's forward
  bare (:func:`apply_or_forward`); a fused loss's Function keeps the gradients its forward formed with
  :func:`save_loss_grads` and hands them back with :func:`loss_grads` (the one ``main_grad`` branch of a
  loss's backward).

The ops import what they need of the layers below from here (the names in ``__all__``), so that an op module
reads its own walk and this one preparation.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from ._autograd import connected, hand_over, once_differentiable
from ._checks import check_device, check_flag, check_float, float_bits, is_finite_real, value_repr
from ._dtensor import dtensor_hidden_op, dtensor_logits_op
from ._inputs import (
    Rows,
    Tokens,
    check_ignore_index,
    check_linear_args,
    compute_dtype,
    dtype_code,
    prepare_tokens,
    token_shape,
)
from ._logit_blocks import full_hidden, linear_settings, main_grad_of, main_grad_result, three_pass_plan
from ._loop import Plan
from ._migrate import accepts_01_keywords
from ._rows import (
    check_full_shape,
    kept_rows,
    parse_kept,
    put_rows,
    select_logit_rows,
    select_rows,
    take_keep,
    take_rows,
)
from ._stats import RowStats, Transform, Want
from .config import walk_plan
from .losses._objective import Objective
from .losses.aggregation import Aggregation
from .options import (
    Chunking,
    Divergence,
    OutputLayer,
    PolicyLoss,
    as_chunking,
    as_divergence,
    as_layer,
    as_loss,
    check_layer_width,
)
from .parallel import (
    agreed_call,
    fingerprint_floats,
    group_rank_size,
    live_group,
    refused_together,
    weak_group,
)

__all__ = [
    "Chunking", "Divergence", "OutputLayer", "PolicyLoss", "Prepared", "RowStats", "Rows",
    "RowsOf", "Teacher", "Tokens", "Want", "agree_objects", "apply_or_forward", "compute_dtype", "connected",
    "Objective", "dtensor_hidden_op", "dtensor_logits_op", "main_grad_result", "one_group",
    "group_of", "hand_over", "loss_grads", "once_differentiable", "op", "plan_for", "prepare", "refused_together",
    "save_loss_grads", "weak_group", "live_group", "with_rows", "zeros_connected",
]


def plan_for(layer: OutputLayer, chunking: Chunking, *, lead, want: Want, device, buffers: Optional[int] = None,
             kernels: bool = True, pair=None, width: Optional[int] = None) -> Plan:
    """How an op walks ``lead``'s tokens and the layer's vocabulary shard: :func:`chunked_entropy.config.walk_plan`
    (the one place the sizes are decided) with the layer's weight, bias, ``logits_dtype``, group and sequence
    parallelism. ``width``: an op over given logits of that many columns (the layer holds no weight then).
    ``buffers``: the float32 buffers ``chunk_size="auto"`` is sized for (by default one, two with a scratch
    output); ``kernels=False``: the eager kernels; ``pair``: a divergence's math, whose kernels are probed too
    (:func:`~chunked_entropy._kernels.choose_kernels`). ``Chunking.invariant``: the plan walks the shard's tiles."""
    common = dict(tokens=math.prod(lead), want=want, device=device, group=layer.process_group, buffers=buffers,
                  kernels=kernels, pair=pair)
    if width is not None:
        return walk_plan(chunking, width=width, dtype=None, over_logits=True, **common)
    w = layer.weight
    return walk_plan(chunking, width=w.shape[0], dtype=w.dtype, sequence_parallel=layer.sequence_parallel,
                     float32_logits=layer.float32_logits, bias=layer.bias is not None, weight_grad=w.requires_grad,
                     **common)


def _no_keep_if_invariant(chunking: Chunking, keep) -> None:
    """``keep`` (sampling replay) is refused in the invariant mode: its kept sets' statistics merge over the ranks
    in the default mode's all-reduces, not in the tiles' fixed order."""
    if chunking.invariant and keep is not None:
        raise ValueError("keep= (sampling replay) is not available with Chunking(invariant=True): the kept sets' "
                         "statistics are not merged in the invariant mode's fixed order; pass keep=None or "
                         "Chunking(invariant=False)")


def group_of(layer):
    """The tensor-parallel group an op's ``layer`` argument names (None for a bare weight or None)."""
    return layer.process_group if isinstance(layer, OutputLayer) else None


def agree_objects(call, **objects) -> None:
    """Every rank of the call's group must pass equal option objects: each agreed on whole, every field of its
    ``fingerprint()``, an error naming the argument and the field (``teacher_layer.softcap``) and showing the
    ranks' values (of an object field such as ``loss.options``, the entries that differ)."""
    if call.world == 1:  # nothing to agree with: no fingerprint computed
        return
    for name, obj in objects.items():
        for field, value in obj.fingerprint().items():
            attr = field.split(" ")[0]  # "weight (shape, dtype)" is the field weight's fingerprint
            call.agree(f"{name}.{field}", value, shown=_readable(getattr(obj, attr)) if hasattr(obj, attr) else None)


def _readable(value):
    """A field's value as the cross-rank error shows it: a str, or a dict of them for an object of fields."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}" if value.numel() != 1 else repr(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _readable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value)
    return None  # a process group: its fingerprint (the size) is shown


def zeros_connected(shape, dtype, device, grads: bool, *inputs) -> torch.Tensor:
    """The result of zero tokens: zeros of ``shape``, connected to ``inputs`` (zero gradients) when ``grads``."""
    z = torch.zeros(tuple(shape), dtype=dtype, device=device)
    return connected(z, *inputs) if grads else z


class _NoCtx:
    """A stand-in for autograd's ctx when no gradient is needed: forward runs bare, nothing is kept."""

    needs_input_grad = (False,) * 16

    def save_for_backward(self, *args):
        pass

    def set_materialize_grads(self, value):
        pass

    def mark_non_differentiable(self, *args):
        pass


def apply_or_forward(function, *args, grads: bool):
    """``function.apply(*args)``, or without gradients its forward on a stand-in ctx: nothing saved, no graph."""
    if grads:
        return function.apply(*args)
    return function.forward(_NoCtx(), *args)


def save_loss_grads(ctx, grad_h, gw, gb, weight, bias, main_grad) -> None:
    """A fused loss's forward keeps the gradients it formed, for :func:`loss_grads`. Saved: the tensors
    themselves (the hidden states' and the weight's in their dtypes, or the weight's in float32 with
    ``main_grad``, the float32 bias gradient), allocated in forward instead of in backward; the inputs' dtypes,
    ``main_grad`` and, with it, the weight (for :func:`~chunked_entropy._logit_blocks.main_grad_result`); no
    reference to the inputs otherwise."""
    ctx.save_for_backward(grad_h, gw, gb)
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
    ctx.main_grad = main_grad
    ctx.weight_param = weight if main_grad is not None else None


def loss_grads(ctx, g: torch.Tensor) -> tuple:
    """``(grad_hidden, grad_weight, grad_bias)`` of a fused loss's backward: what :func:`save_loss_grads` kept,
    times the scalar upstream ``g`` (:func:`~chunked_entropy._autograd.hand_over`: the saved tensors handed
    over, no copy unless the graph is kept), each in its input's dtype. With ``main_grad`` the weight's is added
    into it (in ``main_grad``'s dtype) and the weight's result is Megatron's
    (:func:`~chunked_entropy._logit_blocks.main_grad_result`)."""
    grad_h, gw, gb = ctx.saved_tensors
    grad_w = None
    if gw is not None:
        if ctx.main_grad is None:
            grad_w = hand_over(gw, g).to(ctx.dtypes[0])
        else:
            ctx.main_grad.add_(hand_over(gw, g).to(ctx.main_grad.dtype))
            grad_w = main_grad_result(ctx.weight_param, ctx.main_grad)
    return hand_over(grad_h, g), grad_w, None if gb is None else hand_over(gb, g).to(ctx.dtypes[1])


# ----------------------------------------------------------------------------- the one decorator, rows=


@dataclasses.dataclass(frozen=True)
class RowsOf:
    """What ``rows=`` reads of an op: its source (the hidden states or logits it selects rows of), its layers,
    its per-row inputs (``tails``: those with one more dimension, a teacher's rows or the ids of a row) and its
    kind of ``"kept"``: ``"tokens"`` (the labelled rows, the outputs back in the full shape), ``"pair"`` (the
    same from a divergence's two heads), ``"sequences"`` (each sequence's kept rows first: the policy loss's
    ``[B, T]`` layout) or None (ops from logits: an index only)."""

    source: str
    per_row: tuple
    tails: tuple = ("log_probs_at", "keep")
    layers: tuple = ("layer",)
    kept: Optional[str] = "tokens"
    logits: bool = False
    default: Optional[Chunking] = None  # the op's default chunking
    rows_2d: bool = False  # the policy losses lay the selected rows out as sequences: [B, T]


def op(name: str, *, front: Callable, rows: RowsOf, **migrate) -> Callable:
    """The decorator of a public op: 0.1's keywords accepted (:func:`~chunked_entropy._migrate.accepts_01_keywords`,
    ``migrate`` its options), then the DTensor ``front``, then ``rows=`` (:func:`with_rows`)."""
    def wrap(fn):
        return accepts_01_keywords(name, **migrate)(front(with_rows(fn, rows)))
    return wrap


def _objects(a: dict, spec: RowsOf) -> list:
    """The op's option objects built as the op builds them (a refusal names the argument): its layers."""
    layers = [as_layer(a[n], n, logits=spec.logits) for n in spec.layers]
    if "divergence" in a:
        as_divergence(a["divergence"])
    as_chunking(a["chunking"], default=spec.default, invariant_ok="loss" not in a and "divergence" not in a)
    if "loss" in a:
        as_loss(a["loss"])
    if len(layers) == 2:
        one_group(*layers)
    return layers


def with_rows(fn: Callable, spec: RowsOf) -> Callable:
    """``fn`` with ``rows=``: None calls it as it is; an index selects the source's rows and calls ``fn`` on them;
    ``"kept"`` derives the index from the op's own inputs (``spec.kept``), takes every per-token input at it and
    puts the per-token outputs back in the full shape (the policy loss keeps its ``[B, T]`` layout instead).

    One exchange, as without ``rows``: what this rank alone checks (the objects, ``rows`` itself, the
    ``"kept"`` rows, the per-row inputs' shapes) is refused together
    (:func:`~chunked_entropy.parallel.refused_together`); the rest (the entries in range, the ranks' ``rows``
    and layout, a given count) rides in the op's own agreed call, which :func:`prepare` opens
    (:meth:`~chunked_entropy._rows.Selection.agree`), and the selected rows (one gather,
    :func:`~chunked_entropy._rows.select_rows`; under sequence parallelism an all-gather first) are filled when
    every rank has passed it, before the op reads them."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kw):
        if kw.get("rows") is None:
            return fn(*args, **kw)
        bound = sig.bind(*args, **kw)
        bound.apply_defaults()
        a = dict(bound.arguments)
        rows = a.pop("rows")
        with refused_together(group_of(a[spec.layers[0]])):  # met by the peers' exchange in prepare
            layers, lead, sel = _select(a, rows, spec)
        for n, layer in zip(spec.layers, layers, strict=True):
            if not spec.logits:  # the selected rows are whole (a layer over logits keeps its own, agreed as it is)
                a[n] = layer.replace(sequence_parallel=False)
        token = _SELECTION.set(sel)
        try:
            out = fn(**a, rows=None)
        finally:
            _SELECTION.reset(token)
        if not sel.agreed:  # the op never prepared its call: its rows were never filled
            raise RuntimeError(f"chunked_entropy: {fn.__name__} returned without its preparation (a bug)")
        return out if lead is None else _put_back(out, lambda t: put_rows(t, lead, sel.flat))

    return call


#: The selection of a call with ``rows=``, for its :func:`prepare` to agree on (:func:`with_rows`).
_SELECTION: contextvars.ContextVar = contextvars.ContextVar("chunked_entropy_rows", default=None)


def _select(a: dict, rows, spec: RowsOf) -> tuple:
    """``(layers, lead, selection)`` of a call with ``rows``, on this rank alone (no collective): the layers,
    the full leading shape to put ``"kept"`` rows back in (None for an index), and the
    :class:`~chunked_entropy._rows.Selection`; ``a``'s source and per-row inputs replaced by the selected ones."""
    layers = _objects(a, spec)
    if spec.rows_2d and isinstance(rows, torch.Tensor) and rows.dim() != 2:
        raise ValueError(f"rows of the policy loss must be [B, T] (the selected rows laid out as sequences), "
                         f"got shape {tuple(rows.shape)}")
    group, sp = layers[0].process_group, layers[0].sequence_parallel
    per_row = lambda: {k: a[k] for k in spec.per_row + spec.tails if k in a}  # noqa: E731 - after "kept" took them
    name = dict(name=spec.source) if spec.source != "hidden" else {}
    if spec.logits:  # the logits exist: an index of them only
        a[spec.source], sel = select_logit_rows(rows, a[spec.source], group, **name, tails=spec.tails, **per_row())
        return layers, None, sel
    kept = parse_kept(rows)
    lead = idx = require = teacher = None
    if kept is None:
        idx = rows
    elif spec.kept == "tokens":
        lead, idx, require = _kept_tokens(a, spec.source, group, sp, kept[1])
    elif spec.kept == "pair":
        lead, idx, require, teacher = _kept_pair(a, group, sp, kept[1])
    else:
        idx, require = _kept_sequences(a, group, sp, kept[1])
    rows_in = per_row()
    if teacher is not None:  # the teacher's rows are selected with the student's, once the call is agreed
        rows_in.pop("teacher_hidden")
    a[spec.source], sel = select_rows(idx, a[spec.source], process_group=group, sequence_parallel=sp,
                                      require=require, tails=spec.tails, layer_name=spec.layers[0], **name, **rows_in)
    if teacher is not None:
        a["teacher_hidden"] = sel.also("teacher_hidden", teacher)
    return layers, lead, sel


def _kept_tokens(a: dict, source: str, group, sequence_parallel: bool, count):
    """``rows="kept"`` of an op over hidden states: ``(lead, idx, require)``, the labelled rows (``label_mask``,
    ``ignore_index``) and the per-token inputs of ``a`` taken at them (in place)."""
    labels, label_mask = a["labels"], a["label_mask"]
    if not isinstance(labels, torch.Tensor):
        raise TypeError("rows='kept' selects the rows by their labels: pass labels (an int64 tensor)")
    check_full_shape("labels", labels, a[source], group, sequence_parallel)
    if isinstance(label_mask, torch.Tensor) and label_mask.shape != labels.shape:
        raise ValueError(f"label_mask must have the labels' shape {tuple(labels.shape)}, got "
                         f"{tuple(label_mask.shape)}")
    valid = labels != check_ignore_index(a["ignore_index"])
    if isinstance(label_mask, torch.Tensor) and label_mask.device == labels.device:
        valid = valid & label_mask.to(torch.bool)
    lead = labels.shape
    idx, require = kept_rows(valid, count)
    for k in ("labels", "label_mask", "log_probs_at", "temperature"):
        a[k] = take_rows(a[k], lead, idx)
    a["keep"] = take_keep(a["keep"], lead, idx)
    return lead, idx, require


def _kept_pair(a: dict, group, sp: bool, count):
    """``rows="kept"`` of a divergence over hidden states: ``(lead, idx, require, teacher)``, the rows of
    ``label_mask`` and ``labels``; every per-token input of ``a`` taken at them (in place), the teacher's hidden
    rows too without sequence parallelism (``teacher`` None); under it, ``teacher`` is the teacher's slice, whose
    rows the selection gathers with the student's once the call is agreed."""
    s, t = a["student_hidden"], a["teacher_hidden"]
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
    idx, require = kept_rows(valid, count)
    teacher = None
    if world > 1:
        teacher = t
    else:
        a["teacher_hidden"] = take_rows(t, lead, idx)
    for k in ("labels", "label_mask", "weights", "temperature", "log_probs_at"):
        if a.get(k) is not None:
            a[k] = take_rows(a[k], lead, idx)
    if a.get("keep") is not None:
        a["keep"] = take_keep(a["keep"], lead, idx)
    return lead, idx, require, teacher


def _kept_sequences(a: dict, group, sequence_parallel: bool, count):
    """``rows="kept"`` of the policy loss: ``(rows, require)``, each sequence's kept rows (``loss_mask``) first,
    padded (masked) to the longest count, every per-token input of ``a`` laid out so (in place), and the full
    ``T`` the ``seq-mean-token-sum-norm`` divisor (unless the caller set ``loss_scale_factor``)."""
    labels, loss_mask = a["labels"], a["loss_mask"]
    if not isinstance(loss_mask, torch.Tensor) or not isinstance(labels, torch.Tensor) or loss_mask.dim() != 2 \
            or loss_mask.shape != labels.shape:
        raise ValueError("rows='kept' selects the rows by loss_mask: labels and loss_mask must be [B, T] tensors "
                         "of one shape")
    check_full_shape("labels", labels, a["hidden"], group, sequence_parallel, batch_first=True)
    per_token = ("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights", "rollout_log_probs")
    for name in per_token:
        x = a[name]
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
    a["loss_mask"] = lm.masked_fill(pad, False if lm.dtype == torch.bool else 0)
    temperature, keep = a["temperature"], a["keep"]
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        a["temperature"] = take_rows(temperature, labels.shape, tok).view(b, width)
    keep = take_keep(keep, labels.shape, tok)
    if isinstance(keep, torch.Tensor) and keep.dim() == 2:
        keep = keep.view(b, width, keep.shape[-1])
    a["keep"] = keep
    loss = as_loss(a["loss"])
    agg = loss.aggregation
    if agg.loss_scale_factor is None:
        loss = loss.replace(aggregation=Aggregation(agg.mode, t, agg.dp_size, agg.batch_num_tokens,
                                                    agg.global_batch_size))
    a["loss"] = loss
    for name in ("labels",) + per_token:
        a[name] = at(a[name])
    return rows, require


#: The fields of :class:`~chunked_entropy.LogProbsEntropy`, whose iteration gives the first two only.
_LPE = ("log_probs", "entropy", "sum_pi_squared", "log_probs_at", "top_k_ids", "top_k_log_probs")


def _put_back(out, per):
    """An op's per-row outputs at their rows of the full shape (a 0-d loss as it is)."""
    if all(hasattr(out, f) for f in _LPE):  # a LogProbsEntropy
        return type(out)(*(per(getattr(out, f)) for f in _LPE))
    extra = [getattr(out, f) for f in getattr(out, "_extra", ())]  # attributes beyond the tuple (DivergenceOutputs')
    return type(out)(*(per(x) if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in (*out, *extra)))


# ----------------------------------------------------------------------------- the preparation


class Teacher(NamedTuple):
    """A divergence's teacher side: detached tensors and its transform (no gradient ever flows here)."""

    source: Any  # the filled rows: hidden states (full sequence) or logits
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    transform: Transform
    float32_logits: bool = False  # the teacher's own resolution of logits_dtype (a half-precision teacher's)


@dataclasses.dataclass
class Prepared:
    """An op's prepared call, agreed on by every rank: what its Function and its chunk loop read."""

    layer: OutputLayer
    chunking: Chunking
    plan: Plan
    tok: Tokens
    grads: bool  # whether gradients are computed (grad mode and an input that requires one)
    cdt: torch.dtype  # the compute dtype
    no_labels: bool = False  # distillation or a divergence without labels: log_probs is None
    main_grad: Optional[torch.Tensor] = None  # Megatron's float32 accumulator of the weight gradient
    objective: Optional[Objective] = None  # the policy loss's
    divergence: Optional[Divergence] = None
    teacher: Optional[Teacher] = None
    valid: Optional[torch.Tensor] = None  # the rows a divergence counts
    weights: Optional[torch.Tensor] = None  # a divergence loss's per-token weights

    @property
    def want(self) -> Want:
        return self.plan.want

    def three_pass(self, weight: torch.Tensor, teacher: int = 0) -> Optional[Plan]:
        """The plan of a fused loss's three-GEMM-pass walk, or None (see
        :func:`~chunked_entropy._logit_blocks.three_pass_plan`)."""
        c = self.chunking
        return three_pass_plan(self.tok.n, weight, self.plan, budget=c.max_working_bytes,
                               vocab_chunk_size=c.vocab_chunk_size, need_w=weight.requires_grad,
                               main_grad=self.main_grad is not None, softcap=self.tok.transform.softcap is not None,
                               teacher=teacher)


_DTYPE_FIELD = "(0 float32, 1 bfloat16, 2 float16, 3 float64)"


def prepare(source: torch.Tensor, layer, labels=None, *, chunking=None, logits: bool = False, temperature=1.0,
            label_mask=None, ignore_index: int = -100, compute_entropy=True, compute_sum_pi_squared=False, keep=None,
            entropy_of: str = "full", log_probs_at=None, top_k=None, default: Optional[Chunking] = None,
            loss=None, policy: Optional[dict] = None, teacher=None, teacher_layer=None, divergence=None,
            loss_weights: Optional[dict] = None) -> Prepared:
    """An op's arguments as its :class:`Prepared` call, checked and agreed on by every rank in one exchange.

    ``source``: the hidden states ``[..., H]`` of ``layer`` (``logits=False``) or the logits ``[..., V_local]``;
    ``labels`` and the per-token arguments as the ops take them. A policy loss passes its ``loss`` and its
    per-token inputs in ``policy`` (``old_log_probs``, ``advantages``, ``loss_mask``, ``ref_log_probs``,
    ``rollout_is_weights``, ``rollout_log_probs``, ``generator``); a divergence its ``teacher`` (the teacher's
    hidden states or logits), ``teacher_layer``, ``divergence`` and, for its loss form, ``loss_weights``
    (``reduction``, ``normalizer``, ``weights``). The option objects are built first (a refusal on one rank
    raised on every rank), then every check and the agreement run inside one
    :func:`~chunked_entropy.parallel.agreed_call`. A call with ``rows=`` (:func:`with_rows`) adds its
    :class:`~chunked_entropy._rows.Selection`'s checks to that call, first, and its selected rows (the op's
    ``source``, a teacher's ``"kept"`` rows) are filled when the call is agreed, before any of them is read."""
    name = "student_layer" if teacher is not None else "layer"
    with refused_together(group_of(layer)):
        layer = as_layer(layer, name, logits=logits)
        if teacher is not None:
            teacher_layer = as_layer(teacher_layer, "teacher_layer", logits=logits)
            divergence = as_divergence(divergence)
        chunking = as_chunking(chunking, default=default, invariant_ok=teacher is None and policy is None)
        loss = None if policy is None else as_loss(loss)
        if teacher is not None:
            one_group(layer, teacher_layer)
    args = dict(labels=labels, temperature=temperature, label_mask=label_mask, ignore_index=ignore_index,
                keep=keep, entropy_of=entropy_of, log_probs_at=log_probs_at, top_k=top_k)
    sel = _SELECTION.get()  # a call with rows=: its rows' checks ride in this call's exchange
    if sel is not None:
        _SELECTION.set(None)  # taken: the op's preparation is the one that agrees on its rows
    with agreed_call(layer.process_group) as call:  # every rank validates; a refused call raises on all of them
        if sel is not None:
            sel.agree(call)  # first: the selected rows are filled when the call is agreed, before the op reads them
        if teacher is not None:
            p = _pair(call, source, layer, chunking, teacher, teacher_layer, divergence, logits, compute_entropy,
                      loss_weights, teacher_checked=sel is not None and sel.holds(teacher), **args)
        else:
            flags = None if policy is not None else (compute_entropy, compute_sum_pi_squared)
            p = (_from_logits if logits else _from_hidden)(call, source, layer, chunking, flags, loss, policy, **args)
    if p.teacher is not None and not logits:
        p.teacher = p.teacher._replace(source=full_hidden(p.teacher.source, p.plan))
    return p


def _want(flags) -> Optional[Want]:
    """The outputs asked for (``flags``: ``compute_entropy``, ``compute_sum_pi_squared``), None for a loss."""
    if flags is None:
        return None
    return Want(check_flag("compute_entropy", flags[0]), check_flag("compute_sum_pi_squared", flags[1]))


def _from_logits(call, logits, layer, chunking, flags, loss, policy, *, labels, **args) -> Prepared:
    """The checks and the preparation of an op over the caller's logits (``flags`` None: the policy loss's)."""
    check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V_local] with V_local >= 1, got shape {tuple(logits.shape)}")
    v_local = logits.shape[-1]
    check_layer_width(layer, v_local)
    want = _want(flags)
    cdt = compute_dtype(logits.dtype)
    objective = None if policy is None else Objective(loss, labels, dtype=cdt, **policy)
    _no_keep_if_invariant(chunking, args["keep"])
    plan = plan_for(layer, chunking, lead=logits.shape[:-1], want=Want() if want is None else want,
                    device=logits.device, width=v_local)
    grads = torch.is_grad_enabled() and logits.requires_grad
    labels, no_labels = _labels(labels, logits.shape[:-1], args, logits.device, objective)
    tok = _tokens(call, labels, logits.shape[:-1], v_local, layer, cdt, logits.device, objective, args, logits=logits)
    if plan.tiles is not None and tok.at is not None:  # the invariant mode: top-k ties by the lower id
        tok.at.tie_break = True
    agree_objects(call, layer=layer, chunking=chunking)
    fields = {} if want is None else {"compute_entropy": want.entropy, "compute_sum_pi_squared": want.sum_pi_squared}
    call.agree_all({**fields, "logits.requires_grad": grads, f"logits.dtype {_DTYPE_FIELD}": dtype_code(logits.dtype)})
    _agree_loss(call, loss, objective)
    return Prepared(layer, chunking, plan, tok, grads, cdt, no_labels, objective=objective)


def _from_hidden(call, hidden, layer, chunking, flags, loss, policy, *, labels, **args) -> Prepared:
    """The checks and the preparation of an op over hidden states (``flags`` None: the policy loss's)."""
    weight, bias, sp = layer.weight, layer.bias, layer.sequence_parallel
    if policy is None:
        no_labels = labels is None and (args["log_probs_at"] is not None or args["top_k"] is not None)
        lead = check_linear_args(hidden, layer, _lead_labels(hidden, labels, no_labels, call.world, sp),
                                 call.world, sp)
        want = _want(flags)
    else:
        want = None
        check_linear_args(hidden, layer, labels, 1, False)
        lead = token_shape(hidden, call.world, sp, batch_first=True)
        if labels.shape != lead:
            raise ValueError(
                f"labels must have shape {tuple(lead)} ([B, T]"
                + (", the full sequence: hidden is this rank's [T/P, B, H] slice)" if sp else ")")
                + f", got {tuple(labels.shape)}"
            )
    v_local = weight.shape[0]
    cdt = compute_dtype(weight.dtype)
    objective = None if policy is None else Objective(loss, labels, dtype=cdt, **policy)
    main_grad = main_grad_of(weight, layer.gradient_accumulation_fusion)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    _no_keep_if_invariant(chunking, args["keep"])
    plan = plan_for(layer, chunking, lead=lead, want=Want() if want is None else want, device=hidden.device,
                    buffers=2 if want is None else None)
    labels, no_labels = _labels(labels, lead, args, hidden.device, objective)
    tok = _tokens(call, labels, lead, v_local, layer, cdt, hidden.device, objective, args)
    if plan.tiles is not None and tok.at is not None:  # the invariant mode: top-k ties by the lower id
        tok.at.tie_break = True
    call.agree_all(linear_settings(hidden, weight, bias, plan, grads))
    agree_objects(call, layer=layer, chunking=chunking)
    _agree_loss(call, loss, objective)
    return Prepared(layer, chunking, plan, tok, grads, cdt, no_labels, main_grad, objective)


def _labels(labels, lead, args: dict, device, objective):
    """``(labels, no_labels)``: without labels (distillation only), every label "no label"."""
    if objective is None and labels is None and (args["log_probs_at"] is not None or args["top_k"] is not None):
        return torch.full(tuple(lead), args["ignore_index"], dtype=torch.int64, device=device), True
    return labels, False


def _tokens(call, labels, lead, v_local, layer, cdt, device, objective, args, logits=None) -> Tokens:
    """The per-token inputs (:func:`~chunked_entropy._inputs.prepare_tokens`); a policy loss's mask is its
    ``loss_mask`` alone, its ``entropy_of`` its loss's."""
    if objective is not None:
        return prepare_tokens(labels, lead, v_local, call=call, label_mask=objective.keep, ignore_index=-100,
                              mask_only=True, temperature=args["temperature"], device=device, dtype=cdt,
                              transform=layer.transform, keep=args["keep"], entropy_of=objective.opts.entropy_of)
    return prepare_tokens(labels, lead, v_local, call=call, label_mask=args["label_mask"],
                          ignore_index=args["ignore_index"], temperature=args["temperature"], device=device,
                          dtype=cdt, transform=layer.transform, keep=args["keep"], entropy_of=args["entropy_of"],
                          log_probs_at=args["log_probs_at"], top_k=args["top_k"], logits=logits)


def _agree_loss(call, loss, objective) -> None:
    """A policy loss's object and per-token inputs, agreed after the call's own (nothing without a group)."""
    if objective is not None and call.world > 1:
        agree_objects(call, loss=loss)
        call.agree_all(objective.settings(call))


def _lead_labels(hidden, labels, no_labels: bool, world: int, sequence_parallel: bool):
    """The labels to check the shapes with: without labels (distillation only), a stand-in of the right shape."""
    if not no_labels or not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        return labels
    lead = tuple(hidden.shape[:-1])
    if sequence_parallel and hidden.dim() >= 2:
        lead = (hidden.shape[0] * world,) + lead[1:]
    return torch.empty(lead, dtype=torch.int64, device=hidden.device)


# ----------------------------------------------------------------------------- a divergence's two heads


def one_group(student: OutputLayer, teacher: OutputLayer) -> tuple:
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


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds no NaN or inf, as a 0-d bool tensor (no host sync), from one min-max reduction:
    no temporary of ``t``'s size (``torch.isfinite(t).all()`` makes three, one of them float). NaN
    propagates through both extremes, and an infinity is one of them."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _pair(call, student, layer, chunking, teacher, teacher_layer, divergence, logits: bool, compute_entropy,
          loss_weights, *, labels, temperature, label_mask, ignore_index, keep=None, entropy_of="full",
          log_probs_at=None, top_k=None, teacher_checked: bool = False) -> Prepared:
    """The checks and the preparation of a divergence between two heads (over logits or hidden states); the
    student's sampling replay (``keep``, ``entropy_of``) and distillation outputs (``log_probs_at``, ``top_k``)
    as the one-head ops take them. ``teacher_checked``: the teacher's rows are a ``rows=`` selection, filled once
    the call is agreed, whose finiteness the selection checks on each rank's own rows
    (:meth:`~chunked_entropy._rows.Selection.agree`)."""
    compute_entropy = check_flag("compute_entropy", compute_entropy)
    what = "logits" if logits else "hidden"
    if logits:
        float32 = float32_t = False
        check_float("student_logits", student)
        check_float("teacher_logits", teacher)
        for name, t in (("student_logits", student), ("teacher_logits", teacher)):
            if t.dim() < 1 or t.shape[-1] < 1:
                raise ValueError(f"{name} must be [..., V_local] with V_local >= 1, got shape {tuple(t.shape)}")
        if teacher.shape[-1] != student.shape[-1]:
            raise ValueError(
                f"teacher_logits has {teacher.shape[-1]} vocabulary columns but student_logits has "
                f"{student.shape[-1]}: the divergence needs one vocabulary, sharded the same way"
            )
        _check_same_tokens(student, teacher, what)
        lead, v_local = student.shape[:-1], student.shape[-1]
        check_layer_width(layer, v_local, "student_layer")
        check_layer_width(teacher_layer, v_local, "teacher_layer")
        cdt = compute_dtype(student.dtype)
    else:
        float32, float32_t = _check_heads(student, layer, teacher, teacher_layer)
        lead = token_shape(student, call.world, layer.sequence_parallel, name="student_hidden")
        v_local = layer.weight.shape[0]
        cdt = compute_dtype(layer.weight.dtype)
    no_labels = labels is None
    if no_labels:  # every row unlabelled: ignore_index checked first, as prepare_tokens checks it
        labels = torch.full(tuple(lead), check_ignore_index(ignore_index), dtype=torch.int64, device=student.device)
    tok = prepare_tokens(labels, lead, v_local, call=call, label_mask=label_mask, ignore_index=ignore_index,
                         temperature=temperature, device=student.device, dtype=cdt, transform=layer.transform,
                         teacher_transform=teacher_layer.transform, keep=keep, entropy_of=entropy_of,
                         log_probs_at=log_probs_at, top_k=top_k, logits=student if logits else None)
    if no_labels:
        valid = (torch.ones(tok.n, dtype=torch.bool, device=student.device) if label_mask is None
                 else label_mask.reshape(-1).to(device=student.device, dtype=torch.bool))
    else:
        valid = tok.valid
    tf_t = teacher_layer.transform
    if not teacher_checked:
        call.require(_all_finite(teacher), f"teacher_{what} must be finite (no NaN or inf): a teacher's NaN would "
                     "poison every divergence")
    call.agree("teacher_softcap", float_bits(tf_t.softcap))
    call.agree("teacher_logit_scale", float_bits(tf_t.logit_scale))
    if call.world > 1:
        call.agree("label_mask (the rows the divergence counts)", fingerprint_floats(valid.to(torch.float32)))
    want = Want(compute_entropy, False)
    main_grad = None
    if logits:
        grads = torch.is_grad_enabled() and student.requires_grad
        call.agree_all({"compute_entropy": compute_entropy, "whether gradients are computed": grads})
        plan = plan_for(layer, chunking, lead=lead, want=want, device=student.device, buffers=4,
                        pair=divergence.math, width=v_local)
        side = Teacher(teacher.detach(), None, None, tf_t)
    else:
        for name, t in (("teacher_layer.weight", teacher_layer.weight), ("teacher_layer.bias", teacher_layer.bias)):
            if t is not None:  # as teacher_hidden: a teacher's NaN would poison every divergence
                call.require(_all_finite(t), f"{name} must be finite (no NaN or inf): a teacher's NaN would poison "
                             "every divergence")
        plan = plan_for(layer, chunking, lead=lead, want=want, device=student.device, buffers=4, pair=divergence.math)
        main_grad = main_grad_of(layer.weight, layer.gradient_accumulation_fusion)
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (student, layer.weight, layer.bias))
        call.agree_all(_pair_settings(student, layer, teacher_layer, plan, grads, float32, float32_t, compute_entropy,
                                      loss_weights is not None))
        side = Teacher(teacher.detach(), teacher_layer.weight.detach(),
                       None if teacher_layer.bias is None else teacher_layer.bias.detach(), tf_t, float32_t)
    agree_objects(call, student_layer=layer, teacher_layer=teacher_layer, chunking=chunking, divergence=divergence)
    w = None if loss_weights is None else _loss_weights(call, tok, valid, cdt=cdt, device=student.device,
                                                        **loss_weights)
    return Prepared(layer, chunking, plan, tok, grads, cdt, no_labels, main_grad, divergence=divergence, teacher=side,
                    valid=valid, weights=w)


def _check_heads(student, layer: OutputLayer, teacher, teacher_layer: OutputLayer) -> tuple:
    """Both heads' tensors (the same tokens, one vocabulary shard, one device); each head's ``logits_dtype``
    resolution (True: float32 blocks)."""
    sw, tw = layer.weight, teacher_layer.weight
    float32 = layer.check_hidden(student, "student_hidden")
    float32_t = teacher_layer.check_hidden(teacher, "teacher_hidden")
    _check_same_tokens(student, teacher, "hidden")
    if tw.shape[0] != sw.shape[0]:
        raise ValueError(
            f"teacher_weight has {tw.shape[0]} vocabulary rows but student_weight has {sw.shape[0]}: the "
            "divergence needs one vocabulary, sharded the same way (rank r holds ids [r*V_local, (r+1)*V_local) "
            "of both heads)"
        )
    if tw.device != sw.device:
        raise ValueError(f"teacher_weight is on {tw.device} but student_weight is on {sw.device}")
    return float32, float32_t


def _pair_settings(student, layer: OutputLayer, teacher_layer: OutputLayer, plan: Plan, grads: bool, float32: bool,
                   float32_t: bool, compute_entropy: bool, loss_form: bool) -> dict:
    """What every rank must agree on in a divergence over hidden states (beyond the per-token inputs)."""
    sw, tw = layer.weight, teacher_layer.weight
    return {
        "chunk_size": plan.chunk_size, "vocab_chunk_size": plan.vocab_chunk_size,
        "compute_entropy": compute_entropy,
        "sequence_parallel": layer.sequence_parallel,
        "student_hidden.shape[0] (sequence-parallel slice)": student.shape[0],
        "the student's hidden size (student_weight.shape[1])": sw.shape[1],
        "the teacher's hidden size (teacher_weight.shape[1])": tw.shape[1],
        f"student_weight.dtype {_DTYPE_FIELD}": dtype_code(sw.dtype),
        f"teacher_weight.dtype {_DTYPE_FIELD}": dtype_code(tw.dtype),
        "student_bias is not None": layer.bias is not None, "teacher_bias is not None": teacher_layer.bias is not None,
        "whether gradients are computed": grads, "logits_dtype (1: float32 blocks)": float32,
        "the teacher's logits_dtype (1: float32 blocks)": float32_t,
        "student_hidden.requires_grad (under grad mode)": bool(grads and student.requires_grad),
        "the loss form": loss_form,
    }


def _loss_weights(call, tok: Tokens, valid, *, reduction, normalizer, weights, cdt, device) -> torch.Tensor:
    """The loss form's per-token weights ``w_i`` (see :func:`~chunked_entropy.linear_divergence_loss`), its
    arguments checked inside the call's agreement: each rank records ``reduction``, the normalizer's value and
    the weights' presence and digest, so that a bad or different value on one rank is refused on every rank."""
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
