"""Where the chunk loop's blocks of logits come from, and where their gradients go.

Layer: the walk, shared by the ops above it: the logits path
(:mod:`chunked_entropy.logits`) and the fused loss from logits read the
caller's logits rows (:func:`logits_source`); the fused head (:mod:`chunked_entropy.linear`), the
fused loss from hidden states and the divergences compute each block as ``hidden @ weight.T + bias``
(:func:`linear_filler`) and turn its logit gradient into gradients of the hidden states, the weight
and the bias (:func:`head_grads`, the gradient walk the fused head's, the fused loss's and the divergences' share, over
:func:`linear_grads`, the half-precision matmuls of :func:`_half_mm` / :func:`_split_mm`, the
gradient buffer :class:`GradRows`, the fused loss's three-pass walk :func:`three_pass_plan`). Both hand the
chunk loop (:mod:`chunked_entropy._loop`) a ``fill(x, a, b, v0, v1)``. Beside them, what the fused ops do
with the hidden states and the weight around the walk: the sequence-parallel gather and the gradient's
reduction (:func:`full_hidden`, :func:`reduce_hidden_grad`, :func:`token_major`), Megatron's ``main_grad``
(:func:`main_grad_of`, :func:`main_grad_result`), and, for now, the fused head's cross-rank agreement
(:func:`linear_settings`). The arguments' checks live with the :class:`~chunked_entropy.OutputLayer` and in
:mod:`chunked_entropy._inputs`, the sizes in :mod:`chunked_entropy.config`, the groups' weak references in
:mod:`chunked_entropy.parallel`.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

import torch
from einops import rearrange

from . import _tiles
from ._inputs import Rows, Tokens, compute_dtype, dtype_code
from ._loop import Plan, row_stats
from ._tiles import ROWS, Tiles
from .config import GRAD_BUFFER_BYTES, three_pass_bytes
from .parallel import all_gather_dim0, all_reduce_sum_, reduce_scatter_dim0

# ----------------------------------------------------------------------------- given logits


def logits_source(logits: torch.Tensor):
    """``fill`` (copy a chunk of rows into our buffer) and ``view`` (the rows themselves, for the compiled and
    Triton kernels)."""
    rows = Rows(logits)
    return (lambda x, a, b, v0, v1: x.copy_(rows(a, b))), (lambda a, b, v0, v1: rows(a, b))


def logits_row_stats(logits, tok: Tokens, plan: Plan):
    """Per-token :class:`~chunked_entropy._stats.RowStats` of given logits, one chunk of rows at a time."""
    fill, view = logits_source(logits)
    return row_stats(tok, fill, plan, width=logits.shape[-1], dtype=compute_dtype(logits.dtype),
                     device=logits.device, view=view)


# ----------------------------------------------------------------------------- hidden @ weight.T + bias


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
    then widened; a bias of their dtype is added before that one rounding,
    ``round(h @ w.T + bias)``, as ``F.linear`` does (an ``addmm``; a
    ``[rows, cols]`` half-precision temporary, as without a bias). With
    ``float32`` it is accumulated and kept in float32, the bias added in
    float32 (:func:`half_mm_native`: ``torch.mm(..., out_dtype=torch.float32)``
    on CUDA with torch >= 2.8; elsewhere the block's rows are cast to float32
    first, a ``[rows + cols, H]`` float32 temporary).
    """
    fused = bias is not None and bias.dtype == h.dtype == w.dtype  # F.linear's addmm: the bias before rounding
    if h.dtype == out.dtype:
        if fused:
            return torch.addmm(bias, h, w.t(), out=out)
        torch.mm(h, w.t(), out=out)
    elif not float32:  # half-precision matmul, as the model's own layer would do, then float32
        if fused:
            return out.copy_(torch.addmm(bias, h, w.t()))
        out.copy_(torch.mm(h, w.t()))
    elif half_mm_native(h.device):
        torch.mm(h, w.t(), out_dtype=out.dtype, out=out)
    else:
        torch.mm(h.to(out.dtype), w.t().to(out.dtype), out=out)
    if bias is not None:
        out.add_(bias)
    return out


def linear_filler(rows: Rows, weight, bias, float32: bool = False, tiles: Optional[Tiles] = None):
    """``fill`` for the chunk loop: a block of logits computed from hidden rows and weight rows (``tiles``: the
    invariant mode's fixed-shape matmuls, :func:`_tiled_filler`)."""
    if tiles is not None:
        return _tiled_filler(rows, weight, bias, float32, tiles)

    def fill(x, a, b, v0, v1):
        _logits_block(rows(a, b), weight[v0:v1], None if bias is None else bias[v0:v1], x, float32)

    return fill


def _row_tile(rows: Rows, r0: int, r1: int, pad: dict) -> torch.Tensor:
    """Hidden rows ``[r0, r1)`` as a ``[ROWS, H]`` tile: the rows themselves, or (fewer than ``ROWS``) copied into
    a zero-padded tile of ours (kept in ``pad``: one a call)."""
    h = rows(r0, r1)
    if r1 - r0 == ROWS:
        return h
    tile = pad.get("h")
    if tile is None:
        tile = pad["h"] = torch.zeros(ROWS, h.shape[1], dtype=h.dtype, device=h.device)
    tile[r1 - r0:].zero_()
    tile[: r1 - r0].copy_(h)
    return tile


def _tiled_filler(rows: Rows, weight, bias, float32: bool, tiles: Tiles):
    """The invariant mode's ``fill``: each ``[ROWS, T]`` piece of a block (a row tile of the chunk, zero-padded,
    by one vocabulary tile) is its own matmul of that fixed shape (:func:`_logits_block`) into a tile buffer of
    ours, then copied into the block, so that a logit's bits depend on its own hidden row and weight row only,
    not on the rows or the shard beside it (on the CPU BLAS a product's order of summation follows the shapes
    of the call). ``(chunk / ROWS) x (block / T)`` matmuls a block; beyond the block, a ``[ROWS, T]`` buffer and
    a ``[ROWS, H]`` padded row tile."""
    t = tiles.width
    pad, out = {}, {}

    def fill(x, a, b, v0, v1):
        for r0 in range(a, b, ROWS):
            r1 = min(r0 + ROWS, b)
            h = _row_tile(rows, r0, r1, pad)
            for c0 in range(v0, v1, t):
                c1 = min(c0 + t, v1)
                o = out.get(c1 - c0)
                if o is None:
                    o = out[c1 - c0] = torch.empty(ROWS, c1 - c0, dtype=x.dtype, device=x.device)
                _logits_block(h, weight[c0:c1], None if bias is None else bias[c0:c1], o, float32)
                x[r0 - a:r1 - a, c0 - v0:c1 - v0].copy_(o[: r1 - r0])

    return fill


def linear_row_stats(h_full, weight, bias, tok: Tokens, plan: Plan):
    """Per-token :class:`~chunked_entropy._stats.RowStats` of ``h_full @ weight.T + bias``, never formed whole."""
    return row_stats(tok, linear_filler(Rows(h_full), weight, bias, plan.float32_logits, plan.tiles), plan,
                     width=weight.shape[0], dtype=compute_dtype(weight.dtype), device=weight.device)


def grad_vocab_block(n: int, weight: torch.Tensor, plan: Plan, need_w: bool) -> Optional[int]:
    """The vocabulary block of a gradient walk that takes vocabulary blocks outermost, or None (chunks outermost):
    ``plan.grad_vocab_chunk_size`` (sized with the rest of the plan by :func:`chunked_entropy.config.walk_plan`)
    where the weight's gradient is wanted (``need_w``). ``n`` and ``weight`` are the plan's (kept for the callers).

    Half-precision weights only, and only when their gradient is wanted: each
    block's weight gradient is then one matmul over all ``n`` tokens, in the
    weight's dtype (float32 accumulation inside the matmul, as half-precision
    autograd forms it), and no float32 ``[V_local, H]`` accumulator exists. The
    block is as wide as a ``[n, block]`` gradient buffer of 64 MiB allows (a
    multiple of 128 columns; :func:`chunked_entropy.config.grad_vocab_block_for`:
    4096 columns at 8192 bf16 tokens), and no wider than the forward's
    ``vocab_chunk_size``. Float32 weights accumulate straight into their
    float32 gradient, chunk by chunk: no buffer at all.
    """
    return plan.grad_vocab_chunk_size if need_w and plan.tiles is None else None


class GradRows:
    """The ``[n, vocab_block]`` gradient buffer of a walk over vocabulary blocks outermost, in the weight's
    dtype, allocated in its ``[n, vocab_block]`` shape; ``self(a, b, v0, v1)``: the rows ``[a, b)`` of block
    ``[v0, v1)``'s ``[n, v1 - v0]`` view, where the compiled kernels write the gradient (``grad_rows`` of
    :func:`chunked_entropy._loop.grad_blocks`) and the block's weight-gradient matmul reads it."""

    def __init__(self, n: int, vocab_block: int, dtype, device):
        self.n = n
        self.flat = torch.empty(n, vocab_block, dtype=dtype, device=device).view(-1)

    def block(self, v0: int, v1: int) -> torch.Tensor:
        return self.flat[: self.n * (v1 - v0)].view(self.n, v1 - v0)

    def __call__(self, a: int, b: int, v0: int, v1: int) -> torch.Tensor:
        return self.block(v0, v1)[a:b]


def grad_rows_for(n: int, weight: torch.Tensor, plan: Plan, vocab_block: Optional[int]) -> Optional[GradRows]:
    """The :class:`GradRows` a backward over vocabulary blocks of ``vocab_block`` columns writes its gradient
    into directly, or None: where the plan's blocks are read in the weight's dtype (``plan.block_dtype``)."""
    if vocab_block is None or plan.block_dtype is None:
        return None
    return GradRows(n, min(vocab_block, weight.shape[0]), weight.dtype, weight.device)


def three_pass_plan(n: int, weight: torch.Tensor, plan: Plan, *, budget: int, vocab_chunk_size: Optional[int],
                    need_w: bool, main_grad: bool, softcap: bool, teacher: int = 0) -> Optional[Plan]:
    """The plan of the fused loss's three-GEMM-pass walk, or None where it takes four passes.

    Three passes (:func:`chunked_entropy._loop.loss_grad_blocks` over the whole shard, one block a chunk:
    logits, ``g @ W``, ``g.T @ h``; :func:`linear_grads` chunks outermost) where the walk's working memory,
    :func:`chunked_entropy.config.three_pass_bytes`, fits ``budget`` (``Chunking.max_working_bytes``): a
    float32 ``[V_local, H]`` accumulator of a half-precision weight's gradient (the weight's own float32
    gradient otherwise, or with ``main_grad``), the ``[chunk, V_local]`` buffers and the chunk's
    temporaries. The walk holds the whole shard a chunk, so the forward's default vocabulary block
    (:data:`~chunked_entropy.config.CHUNK_BUFFER_BYTES`) gives way to it; ``vocab_chunk_size`` below
    ``V_local`` (blocks the caller asked for) takes four. Float32 weights (or no weight gradient) whose
    shard is one block already take three passes, which then hold nothing the four-pass walk does not.
    Decided from shapes, dtypes and the agreed settings alone: every rank of a group takes the same walk.
    ``teacher``: the loss form of a divergence (:func:`chunked_entropy.linear_divergence_loss`), whose walk
    holds a teacher's block (and, eager, its scratch) beside the student's, and this many more float32
    ``[chunk, V_local]`` temporaries of the divergence's terms (measured on the CPU, eager: about 3 for a KL, 6
    for the JSD): four passes there are the student's and the teacher's projections and the two gradient
    matmuls, against six.
    """
    v, hdim = weight.shape
    if vocab_chunk_size is not None and vocab_chunk_size < v:
        return None
    half = weight.dtype in (torch.bfloat16, torch.float16)
    accumulator = need_w and half and not main_grad
    if plan.vocab_chunk_size >= v and not accumulator:
        return plan
    # the student's block (eager: and its exp scratch, and a soft-cap's derivative); a teacher's block and scratch
    eager = plan.kernels.in_place
    buffers = (2 + softcap if eager else 1) + (0 if not teacher else (2 if eager else 1) + teacher)
    need = three_pass_bytes(max(1, min(plan.chunk_size, n)), v, hdim, weight.element_size(),
                            accumulator=accumulator, buffers=buffers, native=half_mm_native(weight.device),
                            float32_logits=plan.float32_logits and half)
    if need > budget:
        return None
    return plan if plan.vocab_chunk_size >= v else replace(plan, vocab_chunk_size=v)


def linear_grads(blocks, rows: Rows, weight, *, n: int, hidden_dtype, chunk_size: int, need, main_grad=None,
                 float32: bool = False, vocab_block: Optional[int] = None, weight_grad_dtype=None,
                 grad_rows: Optional[GradRows] = None, tiles: Optional[Tiles] = None, group=None):
    """Turn the logit-gradient blocks of the chunk loop into gradients of hidden, weight and bias.

    ``blocks`` yields ``(a, b, v0, v1, g)`` with ``g = dL/dlogits`` of rows
    ``[a, b)`` and columns ``[v0, v1)``: chunks outermost (each chunk's
    vocabulary blocks in order), or with ``vocab_block`` (see
    :func:`grad_vocab_block`) vocabulary blocks of that width outermost (each
    block's chunks in order). ``need`` says which of ``(hidden, weight,
    bias)`` want a gradient. Returns ``(grad_h [n, H]`` in ``hidden_dtype``,
    the weight gradient in the weight's dtype or ``weight_grad_dtype`` (None
    when it went into ``main_grad``, Megatron's float32 accumulator, added
    to), the float32 bias
    gradient ``[V])``, each None where not needed.

    Every matmul of half-precision weights takes half-precision operands, as
    half-precision autograd does: ``g`` is rounded to the weight's dtype, and
    each product is accumulated in float32 inside the matmul (CUDA with torch
    >= 2.8: ``out_dtype=torch.float32``; a CPU, or an older torch, which has no
    such kernel (:func:`half_mm_native`), forms the same exact products from
    float32 copies of the operands). With
    ``float32`` (``logits_dtype=torch.float32``) ``g`` stays float32 and the
    weight rows are widened: the backward of a float32 matmul, as documented.

    Memory, beyond the gradients themselves: chunks outermost (float32
    weights), a ``[chunk_size, H]`` accumulator of the chunk's hidden-state
    gradient, and the weight gradient accumulated in place (half-precision
    weights are walked so by the fused loss's three-pass walk,
    :func:`three_pass_plan`, with a float32 ``weight_grad_dtype``: the
    float32 ``[V, H]`` gradient is the accumulator, each chunk's share added
    by :func:`_acc_weight_mm_`, never rounded on the way);
    vocabulary blocks outermost (half-precision weights), a float32
    ``[n, H]`` hidden-state accumulator and one ``[n, vocab_block]`` gradient
    buffer in the weight's dtype (64 MiB at most), no ``[V, H]``
    float32 tensor. ``grad_rows``: that buffer, given (the walk's compiled
    kernels write the gradient straight into it: no copy).

    ``tiles`` (the invariant mode; chunks outermost, whole row tiles a chunk): :func:`_grads_tiled`, the hidden
    states' gradient summed over ``group`` there.
    """
    if tiles is not None:
        return _grads_tiled(blocks, rows, weight, n, hidden_dtype, need, main_grad, float32, tiles, group)
    need_h, need_w, need_b = need
    v, hdim = weight.shape
    dev = weight.device
    cdt = compute_dtype(weight.dtype)
    gb = torch.zeros(v, dtype=cdt, device=dev) if need_b else None
    gw = None
    if need_w and main_grad is None:
        gw = (torch.zeros if vocab_block is None else torch.empty)(v, hdim, dtype=weight_grad_dtype or weight.dtype,
                                                                   device=dev)
    if vocab_block is not None:
        return _grads_vocab_outer(blocks, rows, weight, n, hidden_dtype, need, main_grad, float32, vocab_block,
                                  gw, gb, grad_rows)
    acc_w = gw if main_grad is None else main_grad
    if need_w and acc_w.dtype != cdt:  # chunks outermost with half-precision weights (not the fused ops' order)
        acc_w = torch.zeros(v, hdim, dtype=cdt, device=dev)
    grad_h = torch.empty(n, hdim, dtype=hidden_dtype, device=dev) if need_h else None
    gh = torch.empty(min(chunk_size, n), hdim, dtype=cdt, device=dev) if need_h else None
    h = gh_c = None
    for a, b, v0, v1, g in blocks:  # g: [rows, block] dL/dlogits in the compute dtype
        if v0 == 0:  # a new chunk of rows
            h = rows(a, b) if need_w else None
            gh_c = gh[: b - a].zero_() if need_h else None
        w = weight[v0:v1]
        gq = g if (w.dtype == cdt or float32) else g.to(w.dtype)  # rounded as half-precision autograd rounds it
        if need_h:
            _acc_mm_(gh_c, gq, w, whole=v1 - v0 == v)
        if need_b:
            gb[v0:v1].add_(g.sum(dim=0))
        if need_w:
            _acc_weight_mm_(acc_w[v0:v1], g, gq, h)
        if need_h and v1 == v:  # the chunk's last block
            grad_h[a:b].copy_(gh_c)
        gq = None  # freed before the walk makes the next block's (two [rows, block] half blocks otherwise)
    if need_w and acc_w is not gw and acc_w is not main_grad:
        (gw if main_grad is None else main_grad).add_(acc_w)
    return grad_h, gw, gb


def head_grads(walk, hidden, weight, bias, n: int, plan: Plan, need, *, main_grad=None,
               three_pass: Optional[Plan] = None, weight_grad_dtype=None, token_major_rows: bool = False,
               direct_rows: bool = True):
    """The fused head's gradient walk: the hidden states' gradient (reduced over the group, as
    :func:`reduce_hidden_grad` says), the weight's and the bias's, from the logit gradients that ``walk``
    forms; what the fused head's backward, the fused loss's forward and the divergence's backward and loss
    forward share.

    ``walk(fill, plan, vocab_block, grad_rows)`` is the chunk loop's gradient walk
    (:func:`chunked_entropy._loop.grad_blocks` or :func:`~chunked_entropy._loop.loss_grad_blocks`) over the
    blocks ``fill`` computes, yielding ``(a, b, v0, v1, g)``; this function picks the walk's order: vocabulary
    blocks outermost where :func:`grad_vocab_block` says so (with the :class:`GradRows` buffer of
    :func:`grad_rows_for` the kernels write into), else chunks outermost, or the fused loss's three-pass plan
    (``three_pass``, :func:`three_pass_plan`: the whole shard a chunk). ``n``: the walk's token rows.
    ``need``: which of ``(hidden, weight, bias)`` want a gradient; ``main_grad`` and ``weight_grad_dtype`` as
    in :func:`linear_grads`. ``token_major_rows``: the walk's rows are the hidden states in the per-token
    tensors' order (:func:`token_major`; the fused loss's ``[B, T]`` under sequence parallelism), the
    gradient put back in the hidden states' layout before it is reduced. ``direct_rows=False``: the walk never
    writes a gradient into a :class:`GradRows` buffer (a divergence's: its blocks stay in the compute dtype,
    beside the teacher's), so none is allocated before the walk; :func:`linear_grads` allocates its own when
    it starts (after a statistics pass the walk runs when it is called).

    Returns ``(grad_hidden, grad_weight, grad_bias)`` as :func:`linear_grads` does (the hidden gradient in
    ``hidden``'s shape: this rank's slice under sequence parallelism). Memory: the gathered hidden states
    under sequence parallelism (``[S, B, H]``) and what :func:`linear_grads` and the walk allocate.
    """
    h_full = full_hidden(hidden, plan)
    rows = Rows(token_major(h_full, plan) if token_major_rows else h_full)
    if three_pass is not None:
        plan, vocab_block = three_pass, None
    else:
        vocab_block = grad_vocab_block(n, weight, plan, need[1])
    gr = grad_rows_for(n, weight, plan, vocab_block) if direct_rows else None
    blocks = walk(linear_filler(rows, weight, bias, plan.float32_logits, plan.tiles), plan, vocab_block, gr)
    grad_h, gw, gb = linear_grads(blocks, rows, weight, n=n, hidden_dtype=hidden.dtype, chunk_size=plan.chunk_size,
                                  need=need, main_grad=main_grad, float32=plan.float32_logits,
                                  vocab_block=vocab_block, weight_grad_dtype=weight_grad_dtype, grad_rows=gr,
                                  tiles=plan.tiles, group=plan.group)
    if grad_h is not None:
        if token_major_rows:
            grad_h = token_major_grad(grad_h, h_full.shape, plan)
        grad_h = reduce_hidden_grad(grad_h, h_full.shape, plan)
    return grad_h, gw, gb


#: The rows of the hidden states' gradient summed over the group at a time in the invariant mode (the
#: all-gather receives ``world`` times as many): 64 MiB of float32 at ``world * H`` columns.
TILED_SUM_BYTES = 64 * 2**20


def _grads_tiled(blocks, rows: Rows, weight, n, hidden_dtype, need, main_grad, float32, tiles: Tiles, group):
    """:func:`linear_grads` in the invariant mode: every product a fixed-shape matmul of one ``[ROWS, T]`` tile of
    the logit gradient (copied into a buffer of ours, the last row tile zero-padded), so that no sum depends on
    the chunk size, the rows beside a row or the TP size:

    - the hidden states' gradient: each vocabulary tile's ``[rows, H]`` share (``g_tile @ W_tile``) pushed into
      the fixed merge tree (:class:`~chunked_entropy._tiles.TreeSum`); the chunk's rows get this rank's
      subtree, summed over ``group`` through the tree's top after the walk
      (:func:`~chunked_entropy._tiles.summed`), in float32, rounded once to ``hidden_dtype``;
    - the weight's: ``g_tile.T @ h_tile`` added in row-tile order into a float32 ``[V_local, H]`` accumulator
      (``main_grad`` itself where it is float32), rounded once to the weight's dtype;
    - the bias's: each tile's column sums, added in row-tile order.

    Half-precision operands: the gradient rounded to the weight's dtype (float32 with ``float32``) and each
    product formed in float32 (:func:`_half_mm`). Memory beyond the gradients: the float32 ``[n, H]`` hidden
    gradient, a float32 ``[V_local, H]`` accumulator (half-precision weights), the tree's partial sums of a
    chunk (at most ``log2`` of the tiles plus one ``[chunk, H]`` float32), a ``[ROWS, T]`` and a ``[ROWS, H]``
    tile, and the gather of :data:`TILED_SUM_BYTES`' rows."""
    need_h, need_w, need_b = need
    v, hdim = weight.shape
    dev = weight.device
    cdt = compute_dtype(weight.dtype)
    gdt = cdt if float32 else weight.dtype  # what the matmuls take, as the default mode rounds it
    t = tiles.width
    gb = torch.zeros(v, dtype=cdt, device=dev) if need_b else None
    acc_w = None
    if need_w:
        direct = main_grad is not None and main_grad.dtype == cdt
        acc_w = main_grad if direct else torch.zeros(v, hdim, dtype=cdt, device=dev)
    grad_h = torch.empty(n, hdim, dtype=cdt, device=dev) if need_h else None
    pad, bufs, tree = {}, {}, None
    lo, hi = tiles.first, tiles.first + tiles.local
    # Off CUDA a half-precision product is formed from float32 copies (_half_mm): the weight tile widened once a
    # chunk and tile, the chunk's hidden rows once a chunk (a zero-padded float32 [chunk, H]), not once a row tile
    widen = weight.dtype != cdt and not half_mm_native(dev)
    h_wide = None
    for a, b, v0, v1, g in blocks:
        if v0 == 0:
            tree = tiles.sum_tree() if need_h else None
            padded = -(-(b - a) // ROWS) * ROWS
            if widen and need_w:
                h_wide = torch.zeros(padded, hdim, dtype=cdt, device=dev)
                h_wide[: b - a].copy_(rows(a, b))
        for c0 in range(v0, v1, t):
            c1 = min(c0 + t, v1)
            w_t = weight[c0:c1].to(cdt) if widen and need_h else weight[c0:c1]
            leaf = torch.empty(padded, hdim, dtype=cdt, device=dev) if need_h else None
            gt = bufs.get(c1 - c0)
            if gt is None:
                gt = bufs[c1 - c0] = torch.empty(ROWS, c1 - c0, dtype=cdt, device=dev)
            for r0 in range(a, b, ROWS):
                r1 = min(r0 + ROWS, b)
                gt[r1 - r0:].zero_()
                gt[: r1 - r0].copy_(g[r0 - a:r1 - a, c0 - v0:c1 - v0])
                gq = gt if gdt == cdt else gt.to(gdt)
                if widen or gq.dtype == weight.dtype == cdt:  # float32 operands (widened: the values _half_mm takes)
                    gq = gq.to(cdt)
                    if need_h:  # into the leaf's rows, an addmm into the accumulator: no temporary
                        torch.mm(gq, w_t, out=leaf[r0 - a:r0 - a + ROWS])
                    if need_w:
                        h_t = h_wide[r0 - a:r0 - a + ROWS] if widen else _row_tile(rows, r0, r1, pad)
                        acc_w[c0:c1].addmm_(gq.t(), h_t)
                else:
                    if need_h:
                        leaf[r0 - a:r0 - a + ROWS] = _half_mm(gq, w_t, cdt)
                    if need_w:
                        acc_w[c0:c1].add_(_half_mm(gq.t(), _row_tile(rows, r0, r1, pad), cdt))
                if need_b:
                    gb[c0:c1].add_(gt.sum(dim=0))
            if need_h:
                first = tiles.block(c0, c1)
                tree.push(first, first + 1, leaf)
        if need_h and v1 == v:  # the chunk's last block: this rank's subtree of its rows
            grad_h[a:b] = tree.result(lo, hi)[: b - a]
            tree = None
    if need_h:
        rows_at_once = max(1, TILED_SUM_BYTES // (4 * hdim * tiles.world))
        grad_h = _tiles.summed(grad_h, tiles, group, rows_at_once)
        grad_h = grad_h if hidden_dtype == cdt else grad_h.to(hidden_dtype)
    gw = None
    if need_w:
        if main_grad is not None:
            if acc_w is not main_grad:
                main_grad.add_(acc_w)
        else:
            gw = acc_w if weight.dtype == cdt else acc_w.to(weight.dtype)
    return grad_h, gw, gb


def _grads_vocab_outer(blocks, rows: Rows, weight, n, hidden_dtype, need, main_grad, float32, vocab_block, gw, gb,
                       grad_rows: Optional[GradRows] = None):
    """:func:`linear_grads` over vocabulary blocks outermost: each block's weight gradient is one matmul over
    all tokens, from the block's ``[n, vocab_block]`` gradient gathered chunk by chunk."""
    need_h, need_w, need_b = need
    v, hdim = weight.shape
    dev = weight.device
    cdt = compute_dtype(weight.dtype)
    gdt = cdt if float32 else weight.dtype
    gh = torch.zeros(n, hdim, dtype=cdt, device=dev) if need_h else None
    if grad_rows is None and need_w:
        grad_rows = GradRows(n, min(vocab_block, v), gdt, dev)
    h_all = rows(0, n) if need_w else None
    # Off CUDA a half-precision product is formed from float32 copies (_half_mm): the block's weight rows are
    # widened once per block, not once per chunk ([block, H] float32, on such devices only).
    widen = need_h and not half_mm_native(dev) and weight.dtype != cdt
    w = None
    for a, b, v0, v1, g in blocks:
        if a == 0:
            w = weight[v0:v1].to(cdt) if widen else weight[v0:v1]
        gq = g if gdt == cdt else g.to(gdt)
        if widen:  # _half_mm's float32 copies, the weight rows' made once per block
            gh[a:b].add_(torch.mm(gq.to(cdt), w))
        elif need_h:
            _acc_mm_(gh[a:b], gq, w, whole=False)
        if need_b:
            gb[v0:v1].add_(g.sum(dim=0))
        if not need_w:
            continue
        gblk = grad_rows.block(v0, v1)
        if gq.data_ptr() != gblk[a:b].data_ptr():  # not written there by the kernels
            gblk[a:b].copy_(gq)
        if b == n:  # the block's last chunk: its weight gradient over every token, in one matmul
            if main_grad is not None:
                if float32 or not _addmm_into_(main_grad[v0:v1], gblk.t(), h_all):
                    main_grad[v0:v1].add_(_half_mm(gblk.t(), h_all, cdt, float32))
            elif gw.dtype == gdt and h_all.dtype == gdt:
                torch.mm(gblk.t(), h_all, out=gw[v0:v1])
            else:
                gw[v0:v1].copy_(_half_mm(gblk.t(), h_all, cdt, float32))
    grad_h = None if gh is None else (gh if hidden_dtype == cdt else gh.to(hidden_dtype))
    return grad_h, gw, gb


def _acc_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, whole: bool = True) -> None:
    """``acc += a @ b``, ``acc`` float32 (or float64). Operands of ``acc``'s dtype: an ``addmm_``. Half-precision
    operands: their product, accumulated in float32 inside the matmul and added to ``acc`` there where the
    device has that kernel (:func:`_addmm_into_`: one GEMM, no ``[rows, H]`` float32 temporary, no ``add_``),
    else formed by :func:`_half_mm` and added; ``whole``: this is the
    entire sum (one vocabulary block), rounded to the operands' dtype first as half-precision autograd rounds its
    ``g @ W`` (a partial sum over blocks is kept in float32, where it cannot overflow). Mixed (``float32``
    logits: a float32 ``a``, half ``b``): the float32 product, on half-precision operands where the device has
    that kernel (:func:`_split_mm`), else with ``b`` widened."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.dtype != b.dtype and half_mm_native(a.device):
        acc.add_(_split_mm(a, b, acc.dtype))
    elif a.dtype != b.dtype:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    elif whole:
        acc.add_(torch.mm(a, b))
    elif not _addmm_into_(acc, a, b):
        acc.add_(_half_mm(a, b, acc.dtype))


def _acc_weight_mm_(acc: torch.Tensor, g: torch.Tensor, gq: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += gq.T @ h``: a chunk's share of the weight gradient, summed into a float32 ``acc`` (chunks
    outermost: the fused loss's three-pass walk), never rounded on the way. ``g`` is the chunk's float32
    logit gradient (a buffer of the walk's, read by nothing after this), ``gq`` it as the matmuls take it
    (rounded to the weight's dtype, or ``g`` itself).

    Half-precision operands: each product is exact in float32, summed in float32 inside the matmul. On CUDA
    added to ``acc`` inside the matmul where torch has that kernel (:func:`_addmm_into_`: no temporary), else
    ``out_dtype=torch.float32`` in row slices of ``acc`` (a float32 temporary of at most
    :data:`~chunked_entropy.config.GRAD_BUFFER_BYTES`, never one of ``acc``'s size); a CPU has no such
    kernel, and multiplies float32 copies: ``gq``'s values written back into ``g`` (no new buffer; a
    ``[rows, block]`` float32 copy where ``g`` has the weight's dtype itself) and the chunk's rows ``h``
    widened (``[rows, H]``). A float32 ``gq`` beside half-precision rows
    (``logits_dtype=torch.float32``): the rows widened."""
    if gq.dtype == acc.dtype and h.dtype == acc.dtype:
        acc.addmm_(gq.t(), h)
    elif gq.dtype != h.dtype:
        acc.addmm_(gq.t(), h.to(acc.dtype))
    elif _addmm_into_(acc, gq.t(), h):
        pass
    elif half_mm_native(acc.device):
        step = max(1, GRAD_BUFFER_BYTES // (4 * max(1, h.shape[1])))
        for r in range(0, acc.shape[0], step):
            acc[r:r + step].add_(torch.mm(gq[:, r:r + step].t(), h, out_dtype=acc.dtype))
    elif g.dtype == acc.dtype:
        g.copy_(gq)
        acc.addmm_(g.t(), h.to(acc.dtype))
    else:  # the walk's gradient in the weight's dtype already: a float32 copy
        acc.addmm_(gq.t().to(acc.dtype), h.to(acc.dtype))


def _half_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, widen: bool = False) -> torch.Tensor:
    """``a @ b`` of half-precision operands, with a ``out_dtype`` (float32) result: the product a
    half-precision matmul forms before it rounds its output. On CUDA (torch >= 2.8: :func:`half_mm_native`) the
    operands stay half precision (``out_dtype``: tensor cores); a CPU, or an older torch, has no such kernel,
    and multiplies float32 copies (each product of two half-precision numbers is exact in float32, so the sum
    is the same). One float32 operand and one half-precision (``logits_dtype=torch.float32``: the float32
    logit gradient against hidden states or weight rows; ``widen`` says so): the float32 matmul's values, on
    half-precision operands where the device has that kernel (:func:`_split_mm`), else from a float32 copy of
    the half-precision one."""
    if a.dtype == out_dtype and b.dtype == out_dtype:
        return torch.mm(a, b)
    native = half_mm_native(a.device)
    if a.dtype != b.dtype:
        return _split_mm(a, b, out_dtype) if native else torch.mm(a.to(out_dtype), b.to(out_dtype))
    if native:
        return torch.mm(a, b, out_dtype=out_dtype)
    return torch.mm(a.to(out_dtype), b.to(out_dtype))


def _addmm_into_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``acc += a @ b`` in one GEMM, the half-precision products of ``a`` and ``b`` summed in float32 and added
    to the float32 ``acc`` inside the matmul (``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``), where
    the device has that kernel (:func:`half_addmm_native`); returns whether it did. Where it returns False
    nothing was done: the caller forms ``a @ b`` (:func:`_half_mm`) and adds it, the same float32 sum added to
    ``acc`` once (a float32 ``[rows, cols]`` temporary and an ``add_`` more)."""
    if not (a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16) and acc.dtype == torch.float32
            and half_addmm_native(acc.device)):
        return False
    torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return True


#: The power of 2 :func:`_split_mm` scales each row's largest entry to (below float16's largest, 65504).
SPLIT_TOP = 14


def _split_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` for one float32 operand and one half-precision one, on half-precision operands with a float32
    result (``torch.mm(..., out_dtype=...)``: tensor cores): the float32 operand is split into three pieces of
    the other's dtype, ``x = x1 + x2 + x3`` (each the rounding of what the previous ones left: 3 x 8 bits of
    bf16 cover float32's 24, 3 x 11 of fp16 more), and the three products summed in float32. Each product of
    two half-precision numbers is exact in float32, so this is the float32 matmul of the two operands (the
    half-precision one widened) up to the order of the sums and one rounding of the split operand's entries:
    within float32 summation error, on the tensor cores (three half-precision GEMMs against a float32 GEMM:
    about 5x faster on an H100). Each row of the split operand (the result's rows) is first scaled by a power
    of 2 that brings its largest entry to ``2**SPLIT_TOP`` (exact; undone on the result), so that fp16's narrow
    exponent range holds every piece.

    Allocates, beyond the ``[m, n]`` float32 result: a float32 and a half-precision copy of the split operand,
    and one ``[m, n]`` float32 product at a time."""
    if b.dtype == out_dtype:  # a half, b float32: (b.T @ a.T).T, b.T's rows the result's columns
        return _split_mm(b.t(), a.t(), out_dtype).t()
    if out_dtype != torch.float32:
        raise AssertionError(f"_split_mm makes float32 results, not {out_dtype}")
    half = b.dtype
    exponent = torch.frexp(a.abs().amax(dim=1, keepdim=True)).exponent
    # 2**shift built from its bits (exact on every device, as exp2 of an integer need not be): a normal float32
    shift = (SPLIT_TOP - exponent).clamp_(-126, 127).to(torch.int32)
    scale = ((shift + 127) << 23).view(torch.float32)
    rest = a * scale
    out = None
    for i in range(3):
        piece = rest.to(half)
        part = torch.mm(piece, b, out_dtype=out_dtype)
        out = part if out is None else out.add_(part)
        if i < 2:
            rest.sub_(piece)  # exact: the piece is the rest's leading bits
    return out.div_(scale)


#: Device types whose half-precision matmuls may write a float32 result (``torch.mm(..., out_dtype=...)``), where
#: the installed torch has that kernel (:func:`mm_out_dtype_kernel`). A CPU is not one: torch has no CPU kernel.
HALF_MM_DEVICES = {"cuda": "CUDA"}


@functools.lru_cache(maxsize=None)
def mm_out_dtype_kernel(dispatch_key: str) -> bool:
    """Whether the installed torch has ``torch.mm(a, b, out_dtype=...)`` for ``dispatch_key`` (``"CUDA"``): both
    overloads the library calls, ``aten::mm.dtype`` and ``aten::mm.dtype_out``, exist and have a kernel there.

    A feature test, not a version test: the overloads came with torch 2.8 (CUDA only), and a torch
    without them (2.4-2.7, which ``torch>=2.4`` admits) or without their kernel on the device gets False, and
    with it the fallback of :func:`half_mm_native`. Asked once per key (cached)."""
    packet = torch.ops.aten.mm
    if not {"dtype", "dtype_out"} <= set(packet.overloads()):
        return False
    has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has is None:
        return False
    try:
        return all(has(f"aten::mm.{overload}", dispatch_key) for overload in ("dtype", "dtype_out"))
    except RuntimeError:  # a dispatch key this torch does not know
        return False


def half_mm_native(device: torch.device) -> bool:
    """Whether this device multiplies half-precision operands into a float32 result (``torch.mm(...,
    out_dtype=torch.float32)``): CUDA with torch >= 2.8 does (:func:`mm_out_dtype_kernel`); a CPU does not,
    nor CUDA under an older torch. Where it does not, the library multiplies float32 copies of the operands
    instead: the same values (each product of two half-precision numbers is exact in float32, and the sums
    are float32 sums either way; TF32, where allowed, holds bf16 and fp16 values exactly too), at the float32
    matmul's speed and with the copies' memory."""
    key = HALF_MM_DEVICES.get(device.type)
    return key is not None and mm_out_dtype_kernel(key)


@functools.lru_cache(maxsize=None)
def addmm_out_dtype_kernel(dispatch_key: str) -> bool:
    """Whether the installed torch has ``torch.addmm(acc, a, b, out_dtype=..., out=acc)`` for ``dispatch_key``:
    the overload ``aten::addmm.dtype_out`` exists and has a kernel there (torch >= 2.8, CUDA). A feature test,
    as :func:`mm_out_dtype_kernel`; asked once per key (cached)."""
    if "dtype_out" not in set(torch.ops.aten.addmm.overloads()):
        return False
    has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has is None:
        return False
    try:
        return bool(has("aten::addmm.dtype_out", dispatch_key))
    except RuntimeError:  # a dispatch key this torch does not know
        return False


_float32_acc = {}  # device type -> whether its addmm.dtype_out takes a float32 acc beside half operands


def half_addmm_native(device: torch.device) -> bool:
    """Whether this device adds half-precision products into a float32 accumulator inside one GEMM
    (``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``): where :func:`half_mm_native` holds, torch
    has the ``addmm.dtype_out`` kernel (:func:`addmm_out_dtype_kernel`), and that kernel takes a float32 ``acc``
    beside half-precision operands (some versions ask ``acc`` to have the operands' dtype: tried once per device
    type on ``1 x 1`` tensors, a refusal raised on the host before any work). Elsewhere (a CPU; CUDA under
    torch 2.4-2.7, or a refusing kernel) the library forms the float32 product and adds it: the same sum."""
    key = HALF_MM_DEVICES.get(device.type)
    if key is None or not half_mm_native(device) or not addmm_out_dtype_kernel(key):
        return False
    if device.type not in _float32_acc:
        try:
            acc = torch.zeros(1, 1, dtype=torch.float32, device=device)
            one = torch.zeros(1, 1, dtype=torch.bfloat16, device=device)
            torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
            _float32_acc[device.type] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _float32_acc[device.type] = False
    return _float32_acc[device.type]


def reduce_hidden_grad(grad_h: torch.Tensor, full_shape, plan: Plan) -> torch.Tensor:
    """hidden is replicated over the group: its gradient is the sum of every shard's (reduce-scattered under SP).
    In the invariant mode (``plan.tiles``) :func:`_grads_tiled` summed it already: this rank's slice under SP."""
    grad_h = grad_h.view(full_shape)
    if plan.tiles is not None:
        if plan.sequence_parallel and plan.tiles.world > 1:
            part = full_shape[0] // plan.tiles.world
            return grad_h.narrow(0, plan.tiles.rank * part, part).contiguous()
        return grad_h
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
