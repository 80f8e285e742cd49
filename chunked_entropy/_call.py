"""The preparation every op shares, between its public signature and its autograd Function.

Layer: the call (below the ops, above the loop and the per-token preparation). An op turns its arguments into
the objects of :mod:`chunked_entropy.options` (:func:`settings`), checks and prepares them inside one
:func:`~chunked_entropy.parallel.agreed_call` (the tokens' leading shape,
:func:`~chunked_entropy._logit_blocks.token_shape`; the :class:`~chunked_entropy._loop.Plan`, :func:`plan_for`;
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
from ._kernels import use_compiled
from ._logit_blocks import main_grad_result, resolve_vocab_chunk
from ._loop import Plan
from ._stats import Want
from ._tiles import ROWS, Tiles, tiles_for
from .options import Chunking, OutputLayer, as_chunking, as_layer
from .parallel import group_rank_size, refused_together

__all__ = [
    "agree_objects", "apply_or_forward", "group_of", "invariant_backend", "invariant_tiles", "plan_for",
    "refused_together", "settings", "zeros_connected",
]


def settings(layer, chunking, *, logits: bool = False, default: Optional[Chunking] = None,
             name: str = "layer", invariant: bool = False) -> tuple[OutputLayer, Chunking]:
    """An op's ``layer`` and ``chunking`` arguments as objects (bare tensors and ints accepted); ``invariant``:
    the op has the invariant mode (``Chunking.invariant``; refused by the others)."""
    return as_layer(layer, name, logits=logits), as_chunking(chunking, default=default, invariant_ok=invariant)


def invariant_tiles(chunking: Chunking, v_local: int, group, keep=None) -> Optional[Tiles]:
    """The invariant mode's tiles of this rank's shard (:mod:`chunked_entropy._tiles`), or None where
    ``chunking.invariant`` is off. Refuses, by name, a shard that is not a whole number of tiles, a group
    whose size is not a power of two, and ``keep`` (sampling replay's kept sets merge over the ranks in the
    default mode's all-reduces)."""
    if not chunking.invariant:
        return None
    if keep is not None:
        raise ValueError("keep= (sampling replay) is not available with Chunking(invariant=True): the kept sets' "
                         "statistics are not merged in the invariant mode's fixed order; pass keep=None or "
                         "Chunking(invariant=False)")
    rank, world = group_rank_size(group)
    return tiles_for(chunking.tile, v_local, rank, world)


def plan_for(layer: OutputLayer, chunking: Chunking, *, lead, want: Want, device, buffers: Optional[int] = None,
             compiled: bool = True, pair=None, keep=None) -> Plan:
    """How an op over hidden states walks ``lead``'s tokens and the layer's vocabulary shard.

    The chunk size is ``chunking``'s (``"auto"`` resolved for ``buffers`` float32 buffers of the vocabulary
    block; by default one, two with a scratch output); the vocabulary block its ``vocab_chunk_size``, or the
    default of :func:`~chunked_entropy.config.vocab_block_for`; the kernels its ``backend`` (``compiled=False``:
    the eager ones, for a walk without compiled kernels; ``pair``: a divergence's math, whose kernels are
    probed too: :func:`~chunked_entropy._kernels.use_compiled`). ``Chunking.invariant``: the eager kernels (the
    compiled ones with ``backend="compile"``: :func:`invariant_backend`), the
    shard's tiles (:func:`invariant_tiles`, ``keep`` refused), chunks of a multiple of
    :data:`chunked_entropy._tiles.ROWS` rows (rounded up from a smaller one, down from a larger one) and
    vocabulary blocks of a multiple of the tile (at least one tile)."""
    v_local = layer.weight.shape[0]
    buffers = 1 + want.scratch if buffers is None else buffers
    chunk_size = chunking.resolve(min(chunking.vocab_chunk_size or v_local, v_local), buffers=buffers)
    tiles = invariant_tiles(chunking, v_local, layer.process_group, keep)
    if tiles is not None:
        return _invariant_plan(layer, chunking, chunk_size, tiles, lead, want)
    kernels = use_compiled(chunking.backend, device, pair=pair) if compiled else None
    # compiled kernels read a half-precision block as the matmul wrote it (no float32 copy first) and write its
    # gradient in that dtype; a bias is added in float32 to the rounded product, so its blocks stay float32
    half = layer.weight.dtype in (torch.bfloat16, torch.float16) and not layer.float32_logits
    direct = kernels is not None and half and layer.bias is None
    return Plan(
        chunk_size=chunk_size,
        vocab_chunk_size=resolve_vocab_chunk(chunking.vocab_chunk_size, chunk_size, math.prod(lead), v_local),
        group=layer.process_group,
        sequence_parallel=layer.sequence_parallel,
        want=want,
        compiled=kernels,
        float32_logits=layer.float32_logits,
        block_dtype=layer.weight.dtype if direct else None,
    )


def _invariant_plan(layer: OutputLayer, chunking: Chunking, chunk_size: int, tiles: Tiles, lead, want: Want) -> Plan:
    """:func:`plan_for` in the invariant mode: whole row tiles a chunk, whole tiles a vocabulary block."""
    v_local, t = layer.weight.shape[0], tiles.width
    chunk_size = max(ROWS, chunk_size - chunk_size % ROWS)
    block = resolve_vocab_chunk(chunking.vocab_chunk_size, chunk_size, math.prod(lead), v_local)
    block = v_local if block >= v_local else max(t, block - block % t)
    return Plan(chunk_size=chunk_size, vocab_chunk_size=block, group=layer.process_group,
                sequence_parallel=layer.sequence_parallel, want=want,
                compiled=use_compiled(invariant_backend(chunking), layer.weight.device),
                float32_logits=layer.float32_logits, tiles=tiles)


def invariant_backend(chunking: Chunking) -> str:
    """The kernels of the invariant mode: the compiled ones where ``chunking.backend`` asks for them, else eager
    (``"auto"`` included, on every device: the Triton kernels cannot honour the mode)."""
    return "compile" if chunking.backend == "compile" else "eager"


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
