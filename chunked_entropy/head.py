"""Fused head: log-probs and entropy from hidden states; the logits never exist whole.

The lm_head matmul is folded into the chunk loop: forward computes one chunk
(and, optionally, one vocabulary block) of logits at a time, reduces it to the
per-token statistics of :mod:`chunked_entropy._stats`, and drops it; backward
recomputes the chunk and turns its logit gradient straight into gradients for
the hidden states, the weight and the bias.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Optional

import torch
from ._autograd import once_differentiable
from torch import nn

from ._inputs import Rows, Tokens, check_chunk, check_float, compute_dtype, prepare_tokens
from ._loop import grad_blocks, row_stats
from ._kernels import check_backend, use_compiled
from ._stats import RowStats, Transform, Want
from .logits import LogProbsEntropy, check_flag, empty_outputs, pack_outputs, run_outputs, unpack_grads
from .parallel import all_gather_dim0, all_reduce_sum_, group_rank_size, reduce_scatter_dim0


@dataclass(frozen=True)
class _Plan:
    chunk_size: int
    vocab_chunk_size: int  # == V_local when the vocabulary is not blocked
    group: object
    sequence_parallel: bool
    want: Want
    compiled: bool = False


def _logits_block(h, w, bias, out):
    """``out <- h @ w.T + bias`` in ``out``'s dtype; ``out`` is ours, ``h``/``w``/``bias`` are read only."""
    if h.dtype == out.dtype:
        torch.mm(h, w.t(), out=out)
    else:  # half-precision matmul, as the model's own layer would do, then float32
        out.copy_(torch.mm(h, w.t()))
    if bias is not None:
        out.add_(bias)
    return out


def _filler(rows: Rows, weight, bias):
    """``fill`` for the chunk loop: a block of logits computed from hidden rows and weight rows."""

    def fill(x, a, b, v0, v1):
        _logits_block(rows(a, b), weight[v0:v1], None if bias is None else bias[v0:v1], x)

    return fill


def _forward_stats(h_full, weight, bias, tok: Tokens, plan: _Plan):
    return row_stats(
        tok, _filler(Rows(h_full), weight, bias), width=weight.shape[0], block=plan.vocab_chunk_size,
        chunk_size=plan.chunk_size, group=plan.group, want=plan.want,
        dtype=compute_dtype(weight.dtype), device=weight.device, compiled=plan.compiled,
    )


class _HeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tok: Tokens, plan: _Plan, main_grad):
        h_full = all_gather_dim0(hidden, plan.group) if plan.sequence_parallel else hidden
        r = _forward_stats(h_full, weight, bias, tok, plan)
        # Saved: references to hidden (this rank's slice under sequence
        # parallelism; re-gathered in backward), weight, bias, and two to four
        # float32 per token.
        ctx.save_for_backward(hidden, weight, bias, r.m, r.ls, r.ws, r.s2)
        # The graph keeps only a weak reference to the process group: a graph still alive
        # at interpreter exit must not keep a destroyed group alive into shutdown (gloo
        # then aborts the process). torch.distributed itself holds every live group.
        ctx.tok, ctx.plan = tok, replace(plan, group=None)
        ctx.group = None if plan.group is None else weakref.ref(plan.group)
        ctx.main_grad = main_grad
        ctx.weight_param = weight if main_grad is not None else None
        ctx.set_materialize_grads(False)
        return pack_outputs(tok.outputs(r, plan.want), plan.want)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        hidden, weight, bias, m, ls, ws, s2 = ctx.saved_tensors
        tok, plan = ctx.tok, replace(ctx.plan, group=_live_group(ctx.group))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = unpack_grads(grads, plan.want)
        if all(g is None for g in grads):
            return (None,) * 6
        cdt = ls.dtype
        h_full = all_gather_dim0(hidden, plan.group) if plan.sequence_parallel else hidden
        n, v = tok.n, weight.shape[0]
        rows = Rows(h_full)
        dev = weight.device
        # main_grad in the compute dtype is accumulated into directly; a half-precision
        # main_grad (Megatron allows bf16/fp16 ones) gets one float32 sum, added at the end.
        into_main = need_w and ctx.main_grad is not None and ctx.main_grad.dtype == cdt
        blocks = grad_blocks(
            tok, _filler(rows, weight, bias), width=v, block=plan.vocab_chunk_size,
            chunk_size=plan.chunk_size, stats=RowStats(m, ls, ws, s2, None), grads=grads, dtype=cdt, device=dev,
            compiled=plan.compiled,
        )
        grad_h, gw, gb = linear_grads(
            blocks, rows, weight, n=n, hidden_dtype=hidden.dtype, chunk_size=plan.chunk_size,
            need=(need_h, need_w, need_b), gw=ctx.main_grad if into_main else None,
        )
        grad_hidden = None if grad_h is None else reduce_hidden_grad(grad_h, h_full.shape, plan)
        grad_weight = None
        if need_w:
            if ctx.main_grad is None:
                grad_weight = gw.to(weight.dtype)
            else:
                if not into_main:
                    ctx.main_grad.add_(gw)
                grad_weight = _main_grad_result(ctx)
        grad_bias = gb.to(bias.dtype) if need_b else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def linear_grads(blocks, rows: Rows, weight, *, n: int, hidden_dtype, chunk_size: int, need, gw=None):
    """Turn the logit-gradient blocks of the chunk loop into gradients of hidden, weight and bias.

    ``blocks`` yields ``(a, b, v0, v1, g)`` with ``g = dL/dlogits`` of rows
    ``[a, b)`` and columns ``[v0, v1)``; ``need`` says which of
    ``(hidden, weight, bias)`` want a gradient. Returns ``(grad_h [n, H]`` in
    ``hidden_dtype``, the float32 weight-gradient accumulator ``[V, H]`` (or
    ``gw`` itself, accumulated into), the float32 bias gradient ``[V])``, each
    None where not needed. Two matmuls per block: ``g @ W`` and ``g.T @ h``.
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
    for a, b, v0, v1, g in blocks:  # g: [rows, block] dL/dlogits in the compute dtype
        if v0 == 0:  # a new chunk of rows
            h = rows(a, b)
            h32 = (h if h.dtype == cdt else h.to(cdt)) if need_w else None
            gh_c = gh[: b - a].zero_() if need_h else None
        w = weight[v0:v1]
        if need_h:
            if w.dtype == cdt:
                gh_c.addmm_(g, w)
            else:
                gh_c.add_(torch.mm(g.to(w.dtype), w))
        if need_w:
            gw[v0:v1].addmm_(g.t(), h32)
        if need_b:
            gb[v0:v1].add_(g.sum(dim=0))
        if need_h and v1 == v:  # the chunk's last block
            grad_h[a:b].copy_(gh_c)
    return grad_h, (gw if need_w else None), gb


def reduce_hidden_grad(grad_h: torch.Tensor, full_shape, plan: "_Plan") -> torch.Tensor:
    """hidden is replicated over the group: its gradient is the sum of every shard's (reduce-scattered under SP)."""
    grad_h = grad_h.view(full_shape)
    if plan.sequence_parallel:
        return reduce_scatter_dim0(grad_h, plan.group)
    return all_reduce_sum_(grad_h, plan.group)


def _live_group(ref):
    if ref is None:
        return None
    group = ref()
    if group is None:
        raise RuntimeError(
            "the process group of linear_log_probs_and_entropy was destroyed before its backward; "
            "run backward before torch.distributed.destroy_process_group()"
        )
    return group


def main_grad_of(weight, gradient_accumulation_fusion: Optional[bool]):
    """The tensor the weight gradient accumulates into (Megatron's ``main_grad``), or None; checked now.

    ``gradient_accumulation_fusion=None`` means "when ``weight`` has ``main_grad``".
    """
    if gradient_accumulation_fusion is None:
        gradient_accumulation_fusion = hasattr(weight, "main_grad")
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


def _main_grad_result(ctx):
    """What Megatron's linear layers return for the weight once ``main_grad`` holds the gradient."""
    weight = ctx.weight_param
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(ctx.main_grad.shape, dtype=weight.dtype, device=weight.device)


def _check_head_args(hidden, weight, bias, labels, group, sequence_parallel, vocab_chunk_size):
    check_float("hidden", hidden)
    check_float("weight", weight, dim=2)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [..., H] with H == weight.shape[1] == {weight.shape[1]}, "
            f"got shape {tuple(hidden.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None:
        check_float("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) (V_local), got {tuple(bias.shape)}")
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")
    check_chunk("vocab_chunk_size", vocab_chunk_size, optional=True)
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor of int64 ids, got {type(labels).__name__}")
    lead = hidden.shape[:-1]
    if sequence_parallel:
        _, world = group_rank_size(group)
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


def linear_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    temperature=1.0,
    process_group=None,
    sequence_parallel: bool = False,
    compute_entropy: bool = True,
    label_mask: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    vocab_chunk_size: Optional[int] = None,
    gradient_accumulation_fusion: Optional[bool] = None,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
    compute_sum_pi_squared: bool = False,
    backend: str = "eager",
) -> LogProbsEntropy:
    """Log-probs and entropy of ``softmax((hidden @ weight.T + bias) / temperature)``, fused.

    Same outputs and semantics as
    :func:`~chunked_entropy.log_probs_and_entropy` applied to the logits
    ``hidden @ weight.T + bias``, without ever allocating them.

    Args:
        hidden: ``[..., H]`` hidden states (``[S/P, B, H]``, this rank's
            slice, with ``sequence_parallel=True``), same dtype as ``weight``.
        weight: ``[V_local, H]``, this rank's vocabulary shard (Megatron's
            output layer, a tied embedding, or an ``nn.Linear`` lm_head).
        labels: ``[...]`` int64 *global* vocabulary ids; with sequence
            parallelism, for the full gathered sequence.
        bias: ``[V_local]`` or None.
        chunk_size: tokens per chunk.
        temperature: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        label_mask: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        ignore_index: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        compute_entropy: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        process_group: the tensor-parallel group over which ``weight`` is
            sharded by rows, or None. ``hidden`` is replicated over it, so its
            gradient is summed over the group (as ColumnParallelLinear does).
        sequence_parallel: ``hidden`` arrives split along dim 0; forward
            all-gathers it, outputs cover the full sequence on every rank,
            backward reduce-scatters its gradient to the slice.
        vocab_chunk_size: also block the vocabulary (merging statistics with
            an online softmax), so that the per-chunk buffers are
            ``chunk_size * vocab_chunk_size`` instead of ``chunk_size * V_local``.
        gradient_accumulation_fusion: accumulate the weight gradient into
            ``weight.main_grad`` (float32), as Megatron's linear layers do with
            that option; None means "when ``weight`` has ``main_grad``".
        softcap: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        logit_scale: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        compute_sum_pi_squared: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        backend: as in :func:`~chunked_entropy.log_probs_and_entropy`; the
            matmuls stay cuBLAS/BLAS calls, the compiled kernels fuse the
            work on each block of their output.

    Raises:
        ValueError / TypeError: as :func:`~chunked_entropy.log_probs_and_entropy`;
            under a process group the ranks must also agree on the
            sequence-parallel slice length, ``vocab_chunk_size``, whether a
            bias is given and whether gradients are computed.

    Memory:
        Saved for backward: references to ``hidden``, ``weight`` and ``bias``
        and two to four float32 per token. No ``[tokens, V_local]`` tensor is
        ever allocated: forward and backward each hold one or two float32
        ``[chunk_size, vocab_chunk_size]`` buffers (a third in backward with
        ``softcap``; plus the half-precision matmul output when the weight is
        bf16/fp16). Backward also allocates
        the gradients: ``grad_hidden`` ``[tokens, H]``, a float32 ``[V_local, H]``
        weight-gradient accumulator (none with ``main_grad``) and a float32
        ``[V_local]`` bias accumulator. Sequence parallelism gathers the
        hidden states once in forward and once in backward (``[S, B, H]``).
    """
    lead = _check_head_args(hidden, weight, bias, labels, process_group, sequence_parallel, vocab_chunk_size)
    check_chunk("chunk_size", chunk_size)
    want = Want(check_flag("compute_entropy", compute_entropy), check_flag("compute_sum_pi_squared", compute_sum_pi_squared))
    sequence_parallel = check_flag("sequence_parallel", sequence_parallel)
    v_local = weight.shape[0]
    cdt = compute_dtype(weight.dtype)
    main_grad = main_grad_of(weight, gradient_accumulation_fusion)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    plan = _Plan(
        chunk_size=chunk_size,
        vocab_chunk_size=min(vocab_chunk_size or v_local, v_local),
        group=process_group,
        sequence_parallel=sequence_parallel,
        want=want,
        compiled=use_compiled(check_backend(backend), hidden.device),
    )
    tok = prepare_tokens(
        labels, lead, v_local, process_group=process_group, label_mask=label_mask,
        ignore_index=ignore_index, temperature=temperature, device=hidden.device, dtype=cdt,
        transform=Transform(softcap, logit_scale),
        settings={
            "chunk_size": chunk_size, "vocab_chunk_size": plan.vocab_chunk_size,
            "compute_entropy": want.entropy, "compute_sum_pi_squared": want.sum_pi_squared,
            "sequence_parallel": sequence_parallel, "hidden.shape[0] (sequence-parallel slice)": hidden.shape[0],
            "whether gradients are computed": grads, "bias is not None": bias is not None,
        },
    )
    if tok.n == 0:
        return empty_outputs(labels.shape, want, cdt, hidden.device, [hidden, weight, bias])

    def forward():
        h_full = all_gather_dim0(hidden, process_group) if sequence_parallel else hidden
        return _forward_stats(h_full, weight, bias, tok, plan)

    return run_outputs(
        lambda: _HeadFunction.apply(hidden, weight, bias, tok, plan, main_grad), forward, tok, want, labels.shape, grads,
    )


class ChunkedVocabParallelHead(nn.Module):
    """An output layer that returns log-probs and entropy instead of logits.

    Wraps the weight (and bias) of an lm_head, a Megatron ``ColumnParallelLinear``
    output layer or a tied embedding; ``forward(hidden, labels)`` calls
    :func:`linear_log_probs_and_entropy`. The parameters are shared, not
    copied: training the head trains the original layer. ``softcap`` and
    ``logit_scale`` are the model's logit transform (see
    :func:`~chunked_entropy.log_probs_and_entropy`), fixed per head, and
    ``backend`` chooses the eager or compiled per-block kernels.

    Example:
        >>> lm_head = torch.nn.Linear(16, 50, bias=False)
        >>> head = ChunkedVocabParallelHead.from_linear(lm_head, chunk_size=256)
        >>> hidden = torch.randn(2, 7, 16, requires_grad=True)
        >>> labels = torch.randint(0, 50, (2, 7))
        >>> log_probs, entropy = head(hidden, labels)
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        chunk_size: int = 1024,
        process_group=None,
        sequence_parallel: bool = False,
        vocab_chunk_size: Optional[int] = None,
        gradient_accumulation_fusion: Optional[bool] = None,
        softcap: Optional[float] = None,
        logit_scale: Optional[float] = None,
        backend: str = "eager",
    ):
        super().__init__()
        check_float("weight", weight, dim=2)
        if bias is not None:
            check_float("bias", bias)
            if bias.shape != (weight.shape[0],):
                raise ValueError(f"bias must have shape ({weight.shape[0]},) (V_local), got {tuple(bias.shape)}")
        check_chunk("chunk_size", chunk_size)
        check_chunk("vocab_chunk_size", vocab_chunk_size, optional=True)
        group_rank_size(process_group)  # a clear error now if the group is unusable
        tf = Transform(softcap, logit_scale)  # checked now
        self.softcap, self.logit_scale = tf.softcap, tf.logit_scale
        self.backend = check_backend(backend)
        self.weight = weight
        self.bias = bias
        self.chunk_size = chunk_size
        self.process_group = process_group
        self.sequence_parallel = bool(sequence_parallel)
        self.vocab_chunk_size = vocab_chunk_size
        self.gradient_accumulation_fusion = gradient_accumulation_fusion

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature=1.0,
        compute_entropy: bool = True,
        label_mask: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        compute_sum_pi_squared: bool = False,
    ) -> LogProbsEntropy:
        """:func:`linear_log_probs_and_entropy` with this head's weight, bias and settings."""
        return linear_log_probs_and_entropy(
            hidden, self.weight, labels, bias=self.bias, chunk_size=self.chunk_size,
            temperature=temperature, process_group=self.process_group,
            sequence_parallel=self.sequence_parallel, compute_entropy=compute_entropy,
            label_mask=label_mask, ignore_index=ignore_index,
            vocab_chunk_size=self.vocab_chunk_size,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            softcap=self.softcap, logit_scale=self.logit_scale,
            compute_sum_pi_squared=compute_sum_pi_squared, backend=self.backend,
        )

    def policy_loss(self, hidden: torch.Tensor, labels: torch.Tensor, old_log_probs, advantages, loss_mask, **kw):
        """:func:`~chunked_entropy.linear_policy_loss` with this head's weight, bias and settings: ``(loss, metrics)``.

        Keywords are those of :func:`~chunked_entropy.linear_policy_loss`
        (the loss options, ``temperature``, ``ref_log_probs``).
        """
        from .policy import linear_policy_loss

        for key, value in (("bias", self.bias), ("chunk_size", self.chunk_size), ("process_group", self.process_group),
                           ("sequence_parallel", self.sequence_parallel), ("vocab_chunk_size", self.vocab_chunk_size),
                           ("gradient_accumulation_fusion", self.gradient_accumulation_fusion),
                           ("softcap", self.softcap), ("logit_scale", self.logit_scale), ("backend", self.backend)):
            kw.setdefault(key, value)
        return linear_policy_loss(hidden, self.weight, labels, old_log_probs, advantages, loss_mask, **kw)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "ChunkedVocabParallelHead":
        """Wrap a ``torch.nn.Linear`` lm_head (e.g. a Hugging Face model's); its parameters are shared."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        return cls(linear.weight, linear.bias, **kw)

    @classmethod
    def from_hf_model(cls, model, *, verify: bool = True, **kw) -> "ChunkedVocabParallelHead":
        """Wrap a Hugging Face causal LM's output layer, with the logit transform its config names.

        See :func:`chunked_entropy.integrations.huggingface.head_from_model`:
        Gemma 2/3's ``final_logit_softcapping``, Cohere's ``logit_scale`` and
        Granite's ``logits_scaling`` are read from the config, and the head is
        checked against a two-token forward of the model (``verify``), so an
        unknown transform raises instead of giving other log-probs.
        """
        from .integrations.huggingface import head_from_model

        return head_from_model(model, verify=verify, **kw)

    @classmethod
    def from_megatron(cls, output_layer, *, weight: Optional[torch.Tensor] = None, **kw) -> "ChunkedVocabParallelHead":
        """Wrap a megatron-core ``ColumnParallelLinear`` output layer.

        Takes its weight (or ``weight=``, the tied embedding weight, required
        when the layer was built with ``skip_weight_param_allocation``), its
        bias (unless ``skip_bias_add``), its tensor-parallel group,
        ``sequence_parallel`` and ``gradient_accumulation_fusion``. Keyword
        arguments override these, and pass ``chunk_size`` etc.
        """
        for attr in ("tp_group", "sequence_parallel"):
            if not hasattr(output_layer, attr):
                raise TypeError(
                    f"output_layer must be a megatron-core ColumnParallelLinear (missing .{attr}), "
                    f"got {type(output_layer).__name__}"
                )
        if weight is None:
            weight = output_layer.weight
            if weight is None:
                raise ValueError(
                    "output_layer has no weight (skip_weight_param_allocation, tied embeddings): pass "
                    "weight=model.shared_embedding_or_output_weight()"
                )
        bias = None if getattr(output_layer, "skip_bias_add", False) else getattr(output_layer, "bias", None)
        kw.setdefault("process_group", output_layer.tp_group)
        kw.setdefault("sequence_parallel", output_layer.sequence_parallel)
        if getattr(output_layer, "gradient_accumulation_fusion", False):
            kw.setdefault("gradient_accumulation_fusion", True)
        else:
            kw.setdefault("gradient_accumulation_fusion", False)
        return cls(weight, bias, **kw)

    def extra_repr(self) -> str:
        v, h = self.weight.shape
        return (
            f"V_local={v}, H={h}, bias={self.bias is not None}, chunk_size={self.chunk_size}, "
            f"vocab_chunk_size={self.vocab_chunk_size}, sequence_parallel={self.sequence_parallel}"
            + (f", softcap={self.softcap}" if self.softcap is not None else "")
            + (f", logit_scale={self.logit_scale}" if self.logit_scale is not None else "")
        )
