"""Chunked log-probs and entropy from given logits (possibly a vocabulary shard).

Layer: ops. :func:`log_probs_and_entropy` over an autograd Function that
walks the rows of the caller's logits with the chunk loop.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union

import torch

from ._call import Chunking, OutputLayer, RowsOf, RowStats, Tokens, dtensor_logits_op, once_differentiable, op, prepare
from ._logit_blocks import logits_row_stats, logits_source
from ._loop import Plan, grad_blocks
from ._outputs import LogProbsEntropy, empty_outputs, pack_outputs, run_outputs, split_grads, without_labels


class _LogitsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tok: Tokens, plan: Plan):
        r = logits_row_stats(logits, tok, plan)
        # Saved: the input reference (no copy) and two to four float32 per token (twice that and a
        # flag with kept sets, whose entries the Tokens hold; distillation's ids and top-k the Tokens hold too).
        ctx.save_for_backward(logits, *r.saved())
        ctx.tok, ctx.plan = tok, replace(plan, group=None)
        want = plan.want
        ctx.set_materialize_grads(False)
        at_outs = tok.at_outputs(r)
        if at_outs[1] is not None:
            ctx.mark_non_differentiable(at_outs[1])
        return pack_outputs(tok.outputs(r, want), want, at_outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        logits, *saved = ctx.saved_tensors
        stats = RowStats.from_saved(saved)
        grads, at_grads = split_grads(grads, ctx.plan.want, ctx.tok, stats.ls)
        if all(g is None for g in grads) and at_grads is None:
            return None, None, None
        n, v = ctx.tok.n, logits.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(n, v)
        fill, view = logits_source(logits)
        # The gradient's own rows are the working buffer when they hold the compute dtype, and for the
        # compiled and Triton kernels (they write the gradient in its own dtype) unless a sparse term (kept sets,
        # log_probs_at / top_k) is still to be added: then the block is formed in the compute dtype and
        # rounded once, as eager does (added to half-precision rows, the two cancelling terms would each
        # be rounded).
        cdt = stats.ls.dtype
        sparse = at_grads is not None or ctx.tok.keep is not None
        direct = logits.dtype == cdt or (not ctx.plan.kernels.in_place and not sparse)
        blocks = grad_blocks(
            ctx.tok, fill, ctx.plan, width=v, stats=stats, grads=grads, dtype=cdt, device=logits.device,
            into=(lambda a, b: gflat[a:b]) if direct else None, view=view, at_grads=at_grads,
        )
        for a, b, _, _, g in blocks:
            if not direct:
                gflat[a:b].copy_(g)
        return grad, None, None


@op("log_probs_and_entropy", front=dtensor_logits_op(), rows=RowsOf("logits", ("labels", "label_mask"), logits=True))
def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    layer: Optional[OutputLayer] = None,
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
    """Per-token log-prob of ``labels`` and entropy of ``softmax(transform(logits) / temperature)``.

    Walks the tokens in chunks of ``chunk_size``; each chunk's offsets to its
    row maxima are read into a float32 buffer (half-precision chunks, and any
    with a soft-cap, are copied into it first), reduced to a few per-token
    statistics (all-reduced over ``process_group`` when the vocabulary is
    sharded), and dropped. Backward
    recomputes each chunk's softmax from the saved statistics. Every result
    is formed from offsets to the row maximum, so it is accurate to float32
    rounding of itself (a confident token's entropy of 1e-6 too) at any logit
    offset or temperature.

    Args:
        logits: ``[..., V_local]`` float32/bfloat16/float16 (float64 for
            gradcheck), any strides. Never written: no in-place op, no
            version-counter bump; it may feed other ops and other calls. Or
            a DTensor ``[..., V]`` placed ``Shard(-1)`` on the TP mesh dim:
            the group comes from its mesh, the outputs are DTensors
            replicated over that dim, the gradient keeps the logits'
            placements (:mod:`chunked_entropy._dtensor`).
        labels: ``[...]`` int64 *global* vocabulary ids, or None when only
            ``log_probs_at`` / ``top_k`` are wanted (``log_probs`` is then None).
        layer: the :class:`~chunked_entropy.OutputLayer` that made the
            logits, or None. Read here: its ``process_group``, the
            tensor-parallel group over which the vocabulary is sharded (rank
            ``r`` holds ids ``[r*V_local, (r+1)*V_local)``; forward makes two
            all-reduces per chunk, backward none), and its logit transform:
            the softmax is over ``softcap * tanh(logit_scale * logits /
            softcap) / temperature`` (Gemma's ``final_logit_softcapping``,
            Cohere's ``logit_scale``; each optional). Its other fields say how
            the logits were formed, which they already are (a weight, if
            given, must have ``V_local`` rows).
        chunking: a :class:`~chunked_entropy.Chunking`, or an int: the chunk
            size (tokens per chunk; default 1024, ``"auto"`` sized to its
            budget). Memory per chunk is ``chunk_size * V_local * 4`` bytes
            per buffer. Its ``backend`` chooses the kernels of each block:
            ``"auto"`` (Triton on CUDA when importable, else compiled, each
            tried once per process on float32 and bf16 test blocks (several
            tiles a row, soft-cap, per-row temperatures, ``sum_pi_squared``;
            one read of the device) and skipped with one warning where it
            fails or differs from eager;
            eager on the CPU), ``"eager"`` (the reference: in-place
            PyTorch ops per block), ``"compile"`` (each block's statistics and
            gradient as one ``torch.compile``d pass reading the logits
            directly) or ``"triton"`` (the same two passes as Triton kernels;
            on a CPU tensor only under ``TRITON_INTERPRET=1``). The compiled
            and Triton kernels allocate no ``[chunk_size, V]`` buffer on this
            path. See :mod:`chunked_entropy._kernels`.
        temperature: a float > 0 or a tensor broadcastable to ``labels``'
            shape (per-sample temperatures), applied in float32 inside the
            chunk loop. It receives no gradient.
        compute_entropy: when False, ``entropy`` is None and no entropy
            statistic is computed (one buffer per chunk instead of two).
        label_mask: optional bool ``[...]``; where False (or where
            ``labels == ignore_index``) the log-prob is 0 and passes no
            gradient. Masked labels are not range-checked. The entropy is
            defined for every token.
        ignore_index: label id meaning "no label".
        compute_sum_pi_squared: also return ``sum_j p_j**2`` per token (as
            ``.sum_pi_squared``, with its gradient), from the same pass.
        keep: sampling replay: the rollout's kept set of each token (top-k /
            top-p), or None. The log-prob is then taken over the softmax
            restricted to the row's kept set; the label always counts as
            kept, a repeated id once, and a row with an empty set is not
            truncated. Either a ``(token_ids, offsets)`` pair of 1-D integer
            tensors in vLLM's CSR layout (row ``i``, in the order of the
            flattened labels, keeps the *global* ids
            ``token_ids[offsets[i]:offsets[i+1]]``; ``offsets`` has
            ``n_tokens + 1`` entries, from 0 to ``len(token_ids)``), any
            object with ``.token_ids`` and ``.offsets`` (vLLM's
            ``SamplingMask``; lists too), or a bool ``[..., V_local]`` mask of
            this rank's shard in the labels' leading shape. Under a process
            group every rank passes the same CSR pair (or its own shard of a
            dense mask). Or a dict ``{"top_k": k, "top_p": p}`` (either key
            alone too): the kept sets are the row's own top-k then top-p of
            the transformed logits, as NeMo-RL's ``apply_top_k_top_p`` makes
            them (``top_k`` None or <= 0, ``top_p`` 1.0: off); then a label
            outside its set is *not* kept: its log-prob is ``-inf`` and its
            gradient ``-p^K`` on the kept ids. See the "Sampling replay"
            section of the concepts.
        entropy_of: ``"full"`` (default): the entropy and ``sum_pi_squared``
            are of the whole row, as without ``keep``; ``"kept"``: of the
            kept distribution where the row is truncated (gradients follow).
        log_probs_at: on-policy distillation: an int64 ``[..., K]`` tensor of
            *global* ids in the labels' leading shape (a teacher's top-k).
            ``out.log_probs_at`` is then float32 ``[..., K]``, the log-prob of
            each id over the full vocabulary, with its gradient; repeated ids
            each get their own value and gradient. Read in the same chunk
            loop: nothing of size ``[tokens, V]``. Not with ``keep``.
        top_k: the row's own top-k under the same distribution, merged over
            the shard's rows and the ranks: ``out.top_k_ids`` (int64 global
            ids ``[..., k]``, descending) and ``out.top_k_log_probs`` (float32,
            differentiable like ``log_probs_at``). Not with ``keep``.

    Returns:
        :class:`LogProbsEntropy` of tensors shaped like ``labels``, float32
        (float64 for float64 logits), identical on every rank of the group.
        Infinities follow ``torch.log_softmax``: a label on a ``-inf`` logit
        has log-prob ``-inf``; a row of ``-inf`` gives NaN.

    Raises:
        ValueError / TypeError: a bad argument, named, before any work. Under
            a process group, also when the ranks' calls differ (shard width,
            token count, labels, temperatures, options): raised on every
            rank, naming what differs and each rank's value. This check costs
            one all-gather of 128 int64 per call (what the ranks agree on
            travels as one fingerprint).

    Memory:
        Saved for backward: a reference to ``logits`` and two (log-probs
        only) to four float32 per token; nothing under ``torch.no_grad()``.
        Forward allocates one or two ``[chunk_size, V_local]`` float32
        buffers; backward allocates the gradient (the logits' dtype and
        shape) plus at most two such buffers, three with ``softcap`` (one
        less for float32 logits: the gradient's rows are the working
        buffer). An output that receives no gradient costs no backward work.
        With the compiled or Triton kernels (``backend="compile"``,
        ``"triton"``, and ``"auto"`` on CUDA) no buffer is allocated: forward reads the
        logits in place, backward writes straight into the gradient (with
        ``keep``, ``log_probs_at`` or ``top_k`` on bf16/fp16 logits, into one
        float32 ``[chunk_size, V_local]`` buffer instead, so that the sparse
        term is added before the gradient is rounded once, as eager does). With
        ``keep``: the kept sets as entries (two int64 and two flags per kept id and
        per token, held until backward; about 46 bytes per kept id at the
        peak while they are built, 64 from a dense mask) and two to four more
        float32 per token; nothing of size ``[tokens, V]`` (a dense mask is
        read once, and its rows that hold the whole vocabulary cost nothing).
        The row's own filter also sorts ``2**24 / V`` full rows at a time
        once per call (about 26 bytes per element; under a process group
        each rank all-gathers those rows' shards).
        In the invariant mode (``Chunking(invariant=True)``, eager kernels;
        the compiled ones read the block in place as above):
        the same buffers, plus per chunk the tiles' statistics of the block
        (``6 * chunk_size * V_local / tile`` floats) and the merge tree's
        partial statistics; under a group one all-gather a chunk of 5 (6
        with ``sum_pi_squared``) floats per token from every rank, in place
        of the two all-reduces; with ``top_k``, an int64 key per element of
        the block for the ties (docs/exact-tp.md).

    Example:
        >>> logits = torch.randn(2, 5, 11, requires_grad=True)
        >>> labels = torch.randint(0, 11, (2, 5))
        >>> log_probs, entropy = log_probs_and_entropy(logits, labels, chunking=4)
        >>> (log_probs.sum() + 0.01 * entropy.sum()).backward()

    ``rows`` (an int64 index into the flattened logit rows, repeats allowed)
    reads only those rows, as :func:`~chunked_entropy.linear_log_probs_and_entropy`
    does with its hidden rows: per-token inputs and outputs per selected row,
    the logits' gradient summed over repeats and zero on the other rows; one
    ``[M, V_local]`` gather of the selected logit rows.
    """
    p = prepare(logits, layer, labels, chunking=chunking, logits=True, temperature=temperature, label_mask=label_mask,
                ignore_index=ignore_index, compute_entropy=compute_entropy,
                compute_sum_pi_squared=compute_sum_pi_squared, keep=keep, entropy_of=entropy_of,
                log_probs_at=log_probs_at, top_k=top_k)
    tok, want = p.tok, p.want
    if tok.n == 0:
        return without_labels(empty_outputs(tok.shape, want, p.cdt, logits.device, [logits], tok.at), p.no_labels)
    return without_labels(run_outputs(
        lambda: _LogitsFunction.apply(logits, tok, p.plan),
        lambda: logits_row_stats(logits, tok, p.plan),
        tok, want, tok.shape, p.grads,
    ), p.no_labels)
