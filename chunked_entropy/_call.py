"""The preparation every op shares, between its public signature and its autograd Function.

Layer: the call (below the ops, above the loop and the per-token preparation). An op turns its arguments into
the objects of :mod:`chunked_entropy.options` (:func:`settings`), checks and prepares them inside one
:func:`~chunked_entropy.parallel.agreed_call` (the tokens' leading shape,
:func:`~chunked_entropy._inputs.token_shape`; the :class:`~chunked_entropy._loop.Plan`, :func:`plan_for`;
the per-token inputs, :func:`~chunked_entropy._inputs.prepare_tokens`), has the ranks agree on every object
whole (:func:`agree_objects`), and then runs: zero tokens give :func:`zeros_connected`, a call without
gradients the Function's forward bare (:func:`apply_or_forward`). A fused loss's Function keeps the gradients
its forward formed with :func:`save_loss_grads` and hands them back with :func:`loss_grads` (the one
``main_grad`` branch of a loss's backward).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ._autograd import connected, hand_over
from ._logit_blocks import main_grad_result
from ._loop import Plan
from ._stats import Want
from .config import walk_plan
from .options import Chunking, OutputLayer, as_chunking, as_layer
from .parallel import refused_together

__all__ = [
    "agree_objects", "apply_or_forward", "group_of", "plan_for", "refused_together", "settings", "zeros_connected",
]


def settings(layer, chunking, *, logits: bool = False, default: Optional[Chunking] = None,
             name: str = "layer") -> tuple[OutputLayer, Chunking]:
    """An op's ``layer`` and ``chunking`` arguments as objects (bare tensors and ints accepted)."""
    return as_layer(layer, name, logits=logits), as_chunking(chunking, default=default)


def plan_for(layer: OutputLayer, chunking: Chunking, *, lead, want: Want, device, buffers: Optional[int] = None,
             compiled: bool = True, pair=None, width: Optional[int] = None) -> Plan:
    """How an op walks ``lead``'s tokens and the layer's vocabulary shard: :func:`chunked_entropy.config.walk_plan`
    (the one place the sizes are decided) with the layer's weight, bias, ``logits_dtype``, group and sequence
    parallelism. ``width``: an op over given logits of that many columns (the layer holds no weight then).
    ``buffers``: the float32 buffers ``chunk_size="auto"`` is sized for (by default one, two with a scratch
    output); ``compiled=False``: the eager kernels; ``pair``: a divergence's math, whose kernels are probed too
    (:func:`~chunked_entropy._kernels.use_compiled`)."""
    common = dict(tokens=math.prod(lead), want=want, device=device, group=layer.process_group, buffers=buffers,
                  kernels=compiled, pair=pair)
    if width is not None:
        return walk_plan(chunking, width=width, dtype=None, over_logits=True, **common)
    w = layer.weight
    return walk_plan(chunking, width=w.shape[0], dtype=w.dtype, sequence_parallel=layer.sequence_parallel,
                     float32_logits=layer.float32_logits, bias=layer.bias is not None, weight_grad=w.requires_grad,
                     **common)


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
