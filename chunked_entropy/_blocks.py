"""Where the chunk loop's blocks of logits come from, and where their gradients go.

Floor 3, shared by the ops above it: the logits path
(:mod:`chunked_entropy.logits`) and the fused loss from logits read the
caller's logits rows; the fused head (:mod:`chunked_entropy.linear`) and the
fused loss from hidden states compute each block as ``hidden @ weight.T + bias``
and turn its logit gradient into gradients of the hidden states, the weight
and the bias (:func:`linear_grads`). Both hand the chunk loop
(:mod:`chunked_entropy._loop`) a ``fill(x, a, b, v0, v1)``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from einops import rearrange

from ._checks import check_chunk, check_device, check_float
from ._inputs import Rows, Tokens, compute_dtype, dtype_code
from ._loop import row_stats
from ._stats import Want
from .parallel import all_gather_dim0, all_reduce_sum_, reduce_scatter_dim0

# ----------------------------------------------------------------------------- given logits


def logits_source(logits: torch.Tensor):
    """``fill`` (copy a chunk of rows into our buffer) and ``view`` (the rows themselves, for the compiled kernels)."""
    rows = Rows(logits)
    return (lambda x, a, b, v0, v1: x.copy_(rows(a, b))), (lambda a, b, v0, v1: rows(a, b))


def logits_row_stats(logits, tok: Tokens, chunk_size: int, group, want: Want, compiled: bool = False):
    """Per-token :class:`~chunked_entropy._stats.RowStats` of given logits, one chunk of rows at a time."""
    fill, view = logits_source(logits)
    v = logits.shape[-1]
    return row_stats(
        tok, fill, width=v, block=v, chunk_size=chunk_size, group=group, want=want,
        dtype=compute_dtype(logits.dtype), device=logits.device, compiled=compiled, view=view,
    )


# ----------------------------------------------------------------------------- hidden @ weight.T + bias


@dataclass(frozen=True)
class Plan:
    """How an op over hidden states walks the tokens and the vocabulary shard."""

    chunk_size: int
    vocab_chunk_size: int  # == V_local when the vocabulary is not blocked
    group: object
    sequence_parallel: bool
    want: Want
    compiled: bool = False
    float32_logits: bool = False  # half-precision weights: each block's matmul in float32 (logits_dtype=float32)


def check_logits_dtype(logits_dtype, weight: torch.Tensor, name: str = "weight") -> bool:
    """``logits_dtype``: None (the weight's dtype, as the model's own layer), the weight's dtype, or
    ``torch.float32``. Returns whether half-precision blocks are computed in float32 instead."""
    if logits_dtype is None or logits_dtype == weight.dtype:
        return False
    if logits_dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):
        return True
    raise ValueError(
        f"logits_dtype must be None ({name}'s dtype, {weight.dtype}), {weight.dtype} or torch.float32, "
        f"got {logits_dtype!r}"
    )


def check_head(hidden, weight, bias, prefix: str = "", logits_dtype=None) -> bool:
    """One head's hidden states ``[..., H]``, weight ``[V_local, H]`` and bias ``[V_local]`` (or None): float, of one
    dtype and device; each named with ``prefix`` (``"student_"``, ``"teacher_"`` for a divergence's two heads).

    Returns this head's own resolution of ``logits_dtype`` (:func:`check_logits_dtype` of its weight): whether
    its blocks are computed in float32. Each head of a call resolves it for itself, so that a float32 student
    beside a bf16 teacher still gets the teacher's logits in float32 with ``logits_dtype=torch.float32``."""
    h, w, b = f"{prefix}hidden", f"{prefix}weight", f"{prefix}bias"
    check_float(h, hidden)
    check_float(w, weight, dim=2)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{h} must be [..., H] with H == {w}.shape[1] == {weight.shape[1]}, "
                         f"got shape {tuple(hidden.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{h} ({hidden.dtype}) and {w} ({weight.dtype}) must have the same dtype")
    check_device(h, hidden, weight.device, w)
    if bias is not None:
        check_float(b, bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{b} must have shape ({weight.shape[0]},) (V_local), got {tuple(bias.shape)}")
        check_device(b, bias, weight.device, w)
    return check_logits_dtype(logits_dtype, weight, w)


def check_linear_args(hidden, weight, bias, labels, world: int, sequence_parallel: bool, vocab_chunk_size):
    """Check the fused head's tensors; returns the labels' expected leading shape.

    ``world`` is the size of the tensor-parallel group (the sequence-parallel
    slice of ``hidden`` is ``1 / world`` of the sequence).
    """
    check_head(hidden, weight, bias)
    check_chunk("vocab_chunk_size", vocab_chunk_size, optional=True)
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor of int64 ids, got {type(labels).__name__}")
    lead = hidden.shape[:-1]
    if sequence_parallel:
        if hidden.dim() < 2:
            raise ValueError("with sequence_parallel=True, hidden must be [S/P, ..., H]")
        lead = torch.Size((hidden.shape[0] * world,) + tuple(hidden.shape[1:-1]))
        if labels.shape != lead:
            raise ValueError(
                f"with sequence_parallel=True, hidden is this rank's slice [S/P, ..., H] = "
                f"{tuple(hidden.shape)} of a {world}-way group, so labels must have shape "
                f"{tuple(lead)} (the full sequence), got {tuple(labels.shape)}"
            )
    return lead


def linear_settings(hidden, weight, bias, plan: Plan, grads: bool) -> dict:
    """What every rank of the group must agree on in an op over hidden states (beyond the per-token inputs).

    The hidden size and the dtype too: ranks that differ there would otherwise
    meet in a collective with tensors of different sizes. And whether the
    hidden states need a gradient: only the ranks where they do all-reduce it
    (in backward for the head, in forward for the fused loss), so ranks that
    differ there would meet no peer in that collective.
    """
    need_h = bool(grads and hidden.requires_grad)
    return {
        "chunk_size": plan.chunk_size, "vocab_chunk_size": plan.vocab_chunk_size,
        "compute_entropy": plan.want.entropy, "compute_sum_pi_squared": plan.want.sum_pi_squared,
        "sequence_parallel": plan.sequence_parallel, "hidden.shape[0] (sequence-parallel slice)": hidden.shape[0],
        "the hidden size H (weight.shape[1])": weight.shape[1],
        "weight.dtype (0 float32, 1 bfloat16, 2 float16, 3 float64)": dtype_code(weight.dtype),
        "whether gradients are computed": grads, "bias is not None": bias is not None,
        "hidden.requires_grad (under grad mode)": need_h, "logits_dtype (1: float32 blocks)": plan.float32_logits,
    }


def full_hidden(hidden: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The hidden states of the whole sequence: all-gathered along dim 0 under sequence parallelism."""
    return all_gather_dim0(hidden, plan.group) if plan.sequence_parallel else hidden


def _logits_block(h, w, bias, out, float32: bool = False):
    """``out <- h @ w.T + bias`` in ``out``'s dtype; ``out`` is ours, ``h``/``w``/``bias`` are read only.

    Half-precision ``h`` and ``w``: by default the matmul's output is rounded
    to their dtype, as the model's own layer (and a vLLM rollout) computes it,
    then widened; with ``float32`` it is accumulated and kept in float32 (CUDA:
    ``torch.mm(..., out_dtype=torch.float32)``; elsewhere the block's rows are
    cast to float32 first, a ``[rows + cols, H]`` float32 temporary).
    """
    if h.dtype == out.dtype:
        torch.mm(h, w.t(), out=out)
    elif not float32:  # half-precision matmul, as the model's own layer would do, then float32
        out.copy_(torch.mm(h, w.t()))
    elif h.device.type == "cuda":
        torch.mm(h, w.t(), out_dtype=out.dtype, out=out)
    else:
        torch.mm(h.to(out.dtype), w.t().to(out.dtype), out=out)
    if bias is not None:
        out.add_(bias)
    return out


def linear_filler(rows: Rows, weight, bias, float32: bool = False):
    """``fill`` for the chunk loop: a block of logits computed from hidden rows and weight rows."""

    def fill(x, a, b, v0, v1):
        _logits_block(rows(a, b), weight[v0:v1], None if bias is None else bias[v0:v1], x, float32)

    return fill


def linear_row_stats(h_full, weight, bias, tok: Tokens, plan: Plan):
    """Per-token :class:`~chunked_entropy._stats.RowStats` of ``h_full @ weight.T + bias``, never formed whole."""
    return row_stats(
        tok, linear_filler(Rows(h_full), weight, bias, plan.float32_logits), width=weight.shape[0],
        block=plan.vocab_chunk_size,
        chunk_size=plan.chunk_size, group=plan.group, want=plan.want,
        dtype=compute_dtype(weight.dtype), device=weight.device, compiled=plan.compiled,
    )


def linear_grads(blocks, rows: Rows, weight, *, n: int, hidden_dtype, chunk_size: int, need, gw=None,
                 float32: bool = False):
    """Turn the logit-gradient blocks of the chunk loop into gradients of hidden, weight and bias.

    ``blocks`` yields ``(a, b, v0, v1, g)`` with ``g = dL/dlogits`` of rows
    ``[a, b)`` and columns ``[v0, v1)``; ``need`` says which of
    ``(hidden, weight, bias)`` want a gradient. Returns ``(grad_h [n, H]`` in
    ``hidden_dtype``, the float32 weight-gradient accumulator ``[V, H]`` (or
    ``gw`` itself, accumulated into), the float32 bias gradient ``[V])``, each
    None where not needed. Two matmuls per block: ``g @ W`` and ``g.T @ h``;
    with half-precision weights ``g @ W`` is a half-precision matmul (``g``
    rounded to the weight's dtype, as half-precision autograd rounds it),
    unless ``float32`` (``logits_dtype=torch.float32``): then the block's
    weight rows are cast to float32 for it. With vocabulary blocks, each
    block's partial ``g @ W`` is accumulated in float32 (a half-precision one
    overflows where the blocks' sum would not: a loss scale times a common
    offset of the weight rows); the hidden states' gradient is rounded to
    their dtype once, after the last block. On a CPU that costs a float32 copy
    of the block's weight rows (``[vocab_chunk_size, H]``); on CUDA none.
    """
    need_h, need_w, need_b = need
    v, hdim = weight.shape
    dev = weight.device
    cdt = compute_dtype(weight.dtype)
    grad_h = torch.empty(n, hdim, dtype=hidden_dtype, device=dev) if need_h else None
    gh = torch.empty(min(chunk_size, n), hdim, dtype=cdt, device=dev) if need_h else None
    if need_w and gw is None:
        gw = torch.zeros(v, hdim, dtype=cdt, device=dev)
    gb = torch.zeros(v, dtype=cdt, device=dev) if need_b else None
    h32 = gh_c = None
    for a, b, v0, v1, g in blocks:  # g: [rows, block] dL/dlogits in the compute dtype
        if v0 == 0:  # a new chunk of rows
            h = rows(a, b)
            h32 = (h if h.dtype == cdt else h.to(cdt)) if need_w else None
            gh_c = gh[: b - a].zero_() if need_h else None
        w = weight[v0:v1]
        if need_h:
            if w.dtype == cdt:
                gh_c.addmm_(g, w)
            elif float32:
                gh_c.addmm_(g, w.to(cdt))
            elif v1 - v0 < v:  # one block's partial sum: accumulated in float32, where it cannot overflow
                gh_c.add_(_half_mm(g.to(w.dtype), w, cdt))
            else:
                gh_c.add_(torch.mm(g.to(w.dtype), w))
        if need_w:
            gw[v0:v1].addmm_(g.t(), h32)
        if need_b:
            gb[v0:v1].add_(g.sum(dim=0))
        if need_h and v1 == v:  # the chunk's last block
            grad_h[a:b].copy_(gh_c)
    return grad_h, (gw if need_w else None), gb


def _half_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` of half-precision operands, with a ``out_dtype`` (float32) result: the product a
    half-precision matmul forms before it rounds its output (on CUDA without casting the operands)."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=out_dtype)
    return torch.mm(a.to(out_dtype), b.to(out_dtype))


def reduce_hidden_grad(grad_h: torch.Tensor, full_shape, plan: Plan) -> torch.Tensor:
    """hidden is replicated over the group: its gradient is the sum of every shard's (reduce-scattered under SP)."""
    grad_h = grad_h.view(full_shape)
    if plan.sequence_parallel:
        return reduce_scatter_dim0(grad_h, plan.group)
    return all_reduce_sum_(grad_h, plan.group)


def token_major(h_full: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Hidden states in the per-token tensors' ``[B, T]`` order (Megatron's ``[T, B, H]`` under SP); a view."""
    return rearrange(h_full, "t b h -> b t h") if plan.sequence_parallel else h_full


def token_major_grad(grad_h: torch.Tensor, full_shape, plan: Plan) -> torch.Tensor:
    """A ``[B*T, H]`` gradient in :func:`token_major` order, back in the hidden states' own layout."""
    if not plan.sequence_parallel:
        return grad_h
    return rearrange(grad_h, "(b t) h -> t b h", t=full_shape[0]).contiguous()


def weak_group(group):
    """A weak reference to a process group (or None), for an autograd graph to hold.

    A graph still alive at interpreter exit must not keep a destroyed group
    alive into shutdown (gloo then aborts the process); torch.distributed
    itself holds every live group.
    """
    return None if group is None else weakref.ref(group)


def live_group(ref):
    """The group behind :func:`weak_group`'s reference; a clear error if it was destroyed."""
    if ref is None:
        return None
    group = ref()
    if group is None:
        raise RuntimeError(
            "the process group of this call was destroyed before its backward; "
            "run backward before torch.distributed.destroy_process_group()"
        )
    return group


def main_grad_of(weight, gradient_accumulation_fusion: Optional[bool]):
    """The tensor the weight gradient accumulates into (Megatron's ``main_grad``), or None; checked now.

    ``gradient_accumulation_fusion=None`` means "when ``weight`` has ``main_grad``".
    """
    if gradient_accumulation_fusion is None:
        gradient_accumulation_fusion = hasattr(weight, "main_grad")
    if not isinstance(gradient_accumulation_fusion, bool):
        raise TypeError(f"gradient_accumulation_fusion must be a bool or None, got {gradient_accumulation_fusion!r}")
    if not (gradient_accumulation_fusion and weight.requires_grad):
        return None
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape:
        raise ValueError(
            f"gradient_accumulation_fusion=True needs weight.main_grad with the weight's shape {tuple(weight.shape)}"
        )
    if not main_grad.is_floating_point():
        raise TypeError(f"weight.main_grad must be a float tensor, got {main_grad.dtype}")
    return main_grad


def main_grad_result(weight, main_grad):
    """What Megatron's linear layers return for the weight once ``main_grad`` holds the gradient."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(main_grad.shape, dtype=weight.dtype, device=weight.device)
