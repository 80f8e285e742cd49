"""What the autograd Functions share: ``once_differentiable`` that also guards the saved inputs, a result
connected to inputs it does not depend on (:func:`connected`), and gradients handed over without a copy
(:func:`hand_over`, :data:`HAND_OVER_BYTES`).

``torch.autograd.function.once_differentiable`` makes double backward raise only
when the *upstream gradients* require grad. Our gradients also depend on the saved
inputs (logits, hidden states, weight), so with ``create_graph=True`` and plain
upstream gradients (``loss.backward(create_graph=True)``, a gradient penalty) torch's
version returns a gradient that silently acts as a constant: the second-order term
of this function would be dropped without a word. This one raises on any
differentiation of a gradient computed under ``create_graph=True``; first-order
results stay exact.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch._C import _functions

_MESSAGE = (
    b"chunked_entropy: the backward of log_probs_and_entropy / linear_log_probs_and_entropy "
    b"is not differentiable (trying to differentiate twice a function marked once_differentiable)"
)


def once_differentiable(backward):
    """Run ``backward`` without grad; under ``create_graph=True`` make its outputs un-differentiable.

    The outputs are routed through an error node whose inputs include the saved
    tensors that require grad, so any later differentiation that reaches them
    (``.backward()`` or ``torch.autograd.grad(..., inputs)``) raises.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        create_graph = torch.is_grad_enabled()
        saved = [t for t in ctx.saved_tensors if t is not None and t.requires_grad] if create_graph else []
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not create_graph:
            return outputs
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        wrapped = _functions.DelayedError(_MESSAGE, len(outs) + len(saved))(*outs, *saved)
        wrapped = wrapped[: len(outs)]
        return wrapped if isinstance(outputs, tuple) else wrapped[0]

    return wrapper


def graph_is_kept() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph`` / ``create_graph``).

    A backward that hands over a tensor it saved (the fused loss's stored
    gradients) may do so only when the graph is freed after it: otherwise a
    later backward through the same graph would return the same tensor,
    possibly modified in place by its new owner. torch exposes this only
    privately; when it is missing, say "kept" (then the caller copies).
    """
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def connected(result: torch.Tensor, *inputs) -> torch.Tensor:
    """``result`` joined to the graph of each input that requires grad (under grad mode), which then
    receives a zero gradient: the result of a call with zero tokens, still part of the caller's graph.

    Each input adds the sum of an empty view of itself (an exact 0, no copy), never ``x.sum() * 0``:
    a half-precision sum overflows to inf (an fp16 weight of 60s over 300 x 4 entries), and ``inf * 0``
    is NaN.
    """
    if not torch.is_grad_enabled():
        return result
    for x in inputs:
        if x is not None and x.requires_grad:
            result = result + x.unsqueeze(-1)[..., :0].sum().to(result.dtype)
    return result


#: The float32 rows :func:`hand_over` scales a half-precision gradient through at a time (off CUDA).
HAND_OVER_BYTES = 64 * 2**20


def casts_in_kernel(device: torch.device) -> bool:
    """Whether an elementwise op over operands of mixed dtypes widens and narrows each element inside its one
    kernel on ``device`` (CUDA's dynamic casting), rather than through full-size copies in the common dtype
    (a CPU). :func:`chunked_entropy.testing.cuda_branch` says yes on the CPU."""
    return device.type == "cuda"


def hand_over(t: Optional[torch.Tensor], g: torch.Tensor) -> Optional[torch.Tensor]:
    """A gradient stored in forward (the fused losses') times the scalar upstream gradient ``g``, as a tensor
    the caller owns.

    When the graph is freed after this backward, the stored tensor itself is handed over (scaled in place,
    with no host sync: also when ``g`` is 1, where asking would be one). When it is kept (``retain_graph``,
    ``create_graph``), a scaled copy is returned, so that the caller may modify it and a later backward still
    finds the original.

    A half-precision gradient is scaled in float32 and rounded once, as plain half-precision autograd rounds a
    gradient that a loss scale of ``g`` reached in float32 (``g`` rounded to half precision first would bias
    every entry alike, up to 2**-9 for ``g = 1/3``). On CUDA in one pass, in place where handed over
    (:func:`casts_in_kernel`: each element widened, multiplied in float32 and rounded once inside the kernel:
    2 bytes read and 2 written an element); elsewhere through float32 rows of at most ``HAND_OVER_BYTES``
    (a CPU would otherwise copy the whole tensor to float32 and back).
    """
    if t is None:
        return None
    out = torch.empty_like(t) if graph_is_kept() else t
    if t.dtype not in (torch.float16, torch.bfloat16):
        return torch.mul(t, g.to(t.dtype), out=out)
    g = g.to(torch.float32)
    if casts_in_kernel(t.device):  # a one-element float32 tensor of one dimension: the product in float32
        return torch.mul(t, g.reshape(1), out=out)
    if t.dim() == 0 or not (t.is_contiguous() and out.is_contiguous()):
        return out.copy_(t.float().mul_(g))
    flat, dest = t.reshape(t.shape[0], -1), out.reshape(out.shape[0], -1)
    rows = max(1, HAND_OVER_BYTES // max(1, 4 * flat.shape[1]))
    for i in range(0, flat.shape[0], rows):
        dest[i:i + rows].copy_(flat[i:i + rows].float().mul_(g))
    return out
