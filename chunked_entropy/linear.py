"""Fused head: log-probs and entropy from hidden states; the logits never exist whole.

Layer: ops. :func:`linear_log_probs_and_entropy`. The lm_head matmul is
folded into the chunk loop: forward computes one chunk (and, optionally, one
vocabulary block) of logits at a time, reduces it to the per-token statistics
of :mod:`chunked_entropy._stats`, and drops it; backward recomputes the chunk
and turns its logit gradient straight into gradients for the hidden states,
the weight and the bias (:func:`chunked_entropy._logit_blocks.head_grads`).
:class:`~chunked_entropy.ChunkedVocabParallelHead` is the ``nn.Module`` over it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union

import torch

from ._call import (
    Chunking,
    OutputLayer,
    RowsOf,
    RowStats,
    Tokens,
    dtensor_hidden_op,
    live_group,
    main_grad_result,
    once_differentiable,
    op,
    prepare,
    weak_group,
)
from ._logit_blocks import full_hidden, head_grads, linear_row_stats
from ._loop import Plan, grad_blocks
from ._outputs import LogProbsEntropy, empty_outputs, pack_outputs, run_outputs, split_grads, without_labels

__all__ = ["linear_log_probs_and_entropy"]


class _HeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tok: Tokens, plan: Plan, main_grad):
        h_full = full_hidden(hidden, plan)
        r = linear_row_stats(h_full, weight, bias, tok, plan)
        # Saved: references to hidden (this rank's slice under sequence
        # parallelism; re-gathered in backward), weight, bias, and two to four
        # float32 per token.
        ctx.save_for_backward(hidden, weight, bias, *r.saved())
        ctx.tok, ctx.plan, ctx.group = tok, replace(plan, group=None), weak_group(plan.group)
        ctx.main_grad = main_grad
        ctx.weight_param = weight if main_grad is not None else None
        ctx.set_materialize_grads(False)
        at_outs = tok.at_outputs(r)
        if at_outs[1] is not None:
            ctx.mark_non_differentiable(at_outs[1])
        return pack_outputs(tok.outputs(r, plan.want), plan.want, at_outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        hidden, weight, bias, *saved = ctx.saved_tensors
        stats = RowStats.from_saved(saved)
        tok, plan = ctx.tok, replace(ctx.plan, group=live_group(ctx.group))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads, at_grads = split_grads(grads, plan.want, tok, stats.ls)
        if all(g is None for g in grads) and at_grads is None:
            return (None,) * 6
        main_grad = ctx.main_grad if need_w else None

        def walk(fill, plan, vocab_block, grad_rows):
            return grad_blocks(tok, fill, plan, width=weight.shape[0], block=vocab_block,
                               vocab_outer=vocab_block is not None, stats=stats, grads=grads, dtype=stats.ls.dtype,
                               device=weight.device, at_grads=at_grads, grad_rows=grad_rows)

        grad_hidden, grad_weight, gb = head_grads(walk, hidden, weight, bias, tok.n, plan, (need_h, need_w, need_b),
                                                  main_grad=main_grad)
        if main_grad is not None:
            grad_weight = main_grad_result(ctx.weight_param, ctx.main_grad)
        grad_bias = gb.to(bias.dtype) if need_b else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


@op("linear_log_probs_and_entropy", front=dtensor_hidden_op(), rows=RowsOf("hidden", ("labels", "label_mask")))
def linear_log_probs_and_entropy(
    hidden: torch.Tensor,
    layer: Union[OutputLayer, torch.Tensor],
    labels: torch.Tensor,
    *,
    chunking: Union[Chunking, int, None] = None,
    temperature=1.0,
    label_mask: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    compute_entropy: bool = True,
    compute_sum_pi_squared: bool = False,
    keep=None,
    entropy_of: str = "full",
    log_probs_at: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    rows=None,
) -> LogProbsEntropy:
    """Log-probs and entropy of ``softmax((hidden @ weight.T + bias) / temperature)``, fused.

    Same outputs and semantics as
    :func:`~chunked_entropy.log_probs_and_entropy` applied to the logits
    ``hidden @ weight.T + bias``, without ever allocating them.

    Args:
        hidden: ``[..., H]`` hidden states (``[S/P, B, H]``, this rank's
            slice, with ``layer.sequence_parallel``), the weight's dtype. With
            a DTensor weight, also a DTensor (then the outputs are DTensors).
        layer: the :class:`~chunked_entropy.OutputLayer` (or its bare
            ``[V_local, H]`` weight; or a column-parallel DTensor weight
            ``[V, H]`` placed ``Shard(0)`` on the TP mesh dim, whose mesh gives
            the group: :mod:`chunked_entropy._dtensor`): this rank's vocabulary shard (Megatron's
            output layer, a tied embedding, or an ``nn.Linear`` lm_head), its
            bias and logit transform. Under its ``process_group`` the weight is
            sharded by rows and ``hidden`` replicated, so the hidden gradient
            is summed over the group (as ColumnParallelLinear does); with
            ``sequence_parallel``, ``hidden`` arrives split along dim 0:
            forward all-gathers it, outputs cover the full sequence on every
            rank, backward reduce-scatters its gradient to the slice. With
            ``gradient_accumulation_fusion`` (None: when the weight has
            ``main_grad``) the weight gradient is added to ``weight.main_grad``
            in float32, as Megatron's linear layers do. ``logits_dtype``: the
            dtype each block's matmul produces, for bf16/fp16 weights. None
            (the default): their own dtype, rounded as the model's own output
            layer rounds it (and as a vLLM rollout does, which widens the bf16
            logits to float32 only for sampling), then widened for the float32
            statistics. ``torch.float32``: the matmul's float32 sums are
            kept (``F.linear`` of the upcast operands), and the backward's
            matmuls take the float32 logit gradient: as exact as plain float32
            PyTorch on the same bf16 inputs. On half-precision operands where
            torch has that kernel (CUDA, torch >= 2.8: ``out_dtype``; the
            gradient split into three half-precision pieces), else on float32
            copies (see docs/concepts.md).
        labels: ``[...]`` int64 *global* vocabulary ids; with sequence
            parallelism, for the full gathered sequence. None when only
            ``log_probs_at`` / ``top_k`` are wanted (``log_probs`` is then None).
        chunking: a :class:`~chunked_entropy.Chunking` or an int (the chunk
            size), as in :func:`~chunked_entropy.log_probs_and_entropy`. Its
            ``vocab_chunk_size`` also blocks the vocabulary (merging statistics
            with an online softmax), so that the per-chunk buffers are
            ``chunk_size * vocab_chunk_size`` instead of ``chunk_size *
            V_local``; None: the whole shard while a float32 ``[chunk_size,
            V_local]`` buffer is at most 128 MiB, else the widest multiple of
            128 columns that is (a 152k vocabulary at chunk 1024: blocks of
            32768). Its ``backend``: the matmuls stay cuBLAS/BLAS calls, the
            compiled and Triton kernels fuse the work on each block of their
            output.
        temperature: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        label_mask: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        ignore_index: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        compute_entropy: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        compute_sum_pi_squared: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        keep: sampling replay's kept sets, as in
            :func:`~chunked_entropy.log_probs_and_entropy`, over the tokens in
            the order of the flattened ``labels`` (with sequence parallelism:
            the full ``[S, B]`` labels, so row ``s * B + b``).
        entropy_of: as in :func:`~chunked_entropy.log_probs_and_entropy`.
        log_probs_at: distillation's ids, ``[..., K]`` in the labels' leading
            shape, as in :func:`~chunked_entropy.log_probs_and_entropy`; read
            from each block as it is computed: no extra matmul pass.
        top_k: the row's own top-k, as in :func:`~chunked_entropy.log_probs_and_entropy`.
        rows: project only these rows (docs/concepts.md, "Rows"). An int64
            index ``[M]`` (any shape ``L``) into the flattened token rows of
            ``hidden`` (under sequence parallelism: of the gathered ``[S, B]``
            sequence, row ``s * B + b``), repeats allowed: ``labels`` and
            every per-token input are then given per selected row (leading
            shape ``L``), and so are the outputs; the hidden gradient is summed
            over repeats, zero on rows never selected. ``"kept"``: the rows
            whose label is kept (``label_mask``, ``ignore_index``), inputs and
            outputs in their full shape, outputs zero on the other rows (one
            host sync for the count; ``("kept", count)`` passes it: none).
            Every rank of ``process_group`` must pass the same rows.

    Raises:
        ValueError / TypeError: as :func:`~chunked_entropy.log_probs_and_entropy`;
            under a process group the ranks must also agree on the
            sequence-parallel slice length, ``vocab_chunk_size``, whether a
            bias is given and whether gradients are computed.

    Memory:
        Saved for backward: references to ``hidden``, ``weight`` and ``bias``
        and two to four float32 per token. No ``[tokens, V_local]`` tensor is
        ever allocated. Forward holds two float32 ``[chunk_size,
        vocab_chunk_size]`` buffers (128 MiB each at most by default; plus the
        half-precision matmul output of a block when the weight is bf16/fp16,
        or with ``logits_dtype=torch.float32`` off CUDA the block's float32
        hidden and weight rows); with the compiled or Triton kernels
        (``backend="auto"`` on CUDA), one, in the weight's dtype for a
        bf16/fp16 weight without bias (the matmul writes it, the kernels read
        it; in backward they write the gradient straight into the buffer the
        weight gradient's matmul reads). Backward allocates the gradients themselves
        (``grad_hidden`` ``[tokens, H]`` and the weight's in their dtypes, a
        float32 ``[V_local]`` bias gradient) and, beyond them:

        - float32 weights: the same chunk buffers (a third with ``softcap``)
          and a float32 ``[chunk_size, H]`` accumulator of the chunk's
          hidden-state gradient; the weight gradient is accumulated in place.
        - bf16/fp16 weights: the vocabulary is walked in blocks outermost, each
          block's weight gradient one matmul over all tokens with
          half-precision operands (float32 accumulation inside it), from a
          ``[tokens, block]`` gradient buffer of at most 64 MiB in the weight's
          dtype (the block no wider than the forward's); plus a float32
          ``[tokens, H]`` hidden-state accumulator, to which each block's
          ``g @ W`` is added inside its matmul (a torch without that
          ``addmm`` kernel, before 2.8, forms the block's float32 partial
          product first: one ``[tokens, H]`` float32 more). The compiled and
          Triton kernels fill each block
          for all tokens straight into that buffer and overwrite it with its
          gradient; the eager ones go through ``[chunk_size, block]`` chunk
          buffers. No float32 ``[V_local, H]`` tensor. At 8192 tokens,
          H = 4096, V = 151936, bf16, chunk 1024, on CUDA: 64 MiB in forward,
          192 MiB in backward, measured from the allocations of a call down
          the CUDA branch (``chunked-entropy bench --traffic``, as
          ``chunked-entropy plan`` states it).
        - ``main_grad`` (Megatron's gradient-accumulation fusion): the weight
          gradient is added there, in float32, block by block.

        Sequence parallelism gathers the hidden states once in forward and
        once in backward (``[S, B, H]``). ``keep`` adds what it adds to
        :func:`~chunked_entropy.log_probs_and_entropy`. With ``rows``, every
        per-token cost above is per selected row (``M`` instead of tokens),
        plus one ``[M, H]`` gather of the hidden rows, kept for backward
        (under sequence parallelism the ``[S, B, H]`` gather is made once,
        outside the chunk loop), and a ``[tokens, H]`` hidden gradient.

        In the invariant mode (``Chunking(invariant=True)``, eager or compiled kernels;
        docs/exact-tp.md): chunks of a multiple of 128 rows and blocks of a
        multiple of the tile; each block's logits from ``[128, tile]``
        matmuls through a buffer of that size (and a zero-padded ``[128, H]``
        row tile); forward as above plus the tiles' statistics of a block.
        Backward walks chunks outermost for every dtype: a float32 ``[tokens,
        H]`` hidden gradient (all-gathered from every rank in slices of 64
        MiB, in place of its all-reduce), at most ``log2(tiles) + 1``
        float32 ``[chunk_size, H]`` partial sums of it, a ``[128, tile]``
        gradient tile, and for half-precision weights a float32 ``[V_local,
        H]`` weight-gradient accumulator (rounded once).
    """
    p = prepare(hidden, layer, labels, chunking=chunking, temperature=temperature, label_mask=label_mask,
                ignore_index=ignore_index, compute_entropy=compute_entropy,
                compute_sum_pi_squared=compute_sum_pi_squared, keep=keep, entropy_of=entropy_of,
                log_probs_at=log_probs_at, top_k=top_k)
    tok, plan, weight, bias = p.tok, p.plan, p.layer.weight, p.layer.bias
    if tok.n == 0:
        return without_labels(empty_outputs(tok.shape, p.want, p.cdt, hidden.device, [hidden, weight, bias], tok.at),
                              p.no_labels)
    return without_labels(run_outputs(
        lambda: _HeadFunction.apply(hidden, weight, bias, tok, plan, p.main_grad),
        lambda: linear_row_stats(full_hidden(hidden, plan), weight, bias, tok, plan),
        tok, p.want, tok.shape, p.grads,
    ), p.no_labels)
