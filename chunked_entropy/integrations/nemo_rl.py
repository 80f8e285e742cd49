"""NeMo-RL: the loss path's log-probs, top-k distillation log-probs and entropy, chunked, without the float32 upcast.

NeMo-RL (NVIDIA-NeMo/RL) computes the policy's log-probs in its loss path
(``nemo_rl/algorithms/loss/utils.py``: ``prepare_loss_input``,
``prepare_packed_loss_input``) through ``nemo_rl/distributed/model_utils.py``.
Every route there (Megatron TP with context parallelism, DTensor TP, packed
sequences) ends in one of a few autograd Functions; around them NeMo-RL

- casts the whole logits to float32 first unless a ``logprob_chunk_size`` is
  set and the group is Megatron's (``get_next_token_logprobs_from_logits``,
  ``prepare_packed_loss_input``): at TP 1 with the default
  ``logprob_chunk_size: null`` a full ``[B, S, V]`` float32 copy (NeMo-RL
  #4115), and its unchunked ``DistributedLogprob`` then saves the float32
  softmax ``[B, S, V/tp]`` for backward (#4222: two such tensors of 9.94 GiB
  at 20k tokens x 131k vocabulary);
- its chunked Functions (``ChunkedDistributedLogprob``,
  ``ChunkedDistributedGatherLogprob``, ``ChunkedDistributedEntropy``) save the
  logits and recompute, but allocate a float32 ``[B, S, V/tp]`` gradient
  buffer in backward on top of autograd's.

:func:`install` replaces, where NeMo-RL looks them up:

- ``DistributedLogprob`` and ``ChunkedDistributedLogprob`` (the unfiltered
  next-token log-probs of every route, and the unfiltered ones for the KL
  under top-k/top-p) with :class:`DistributedLogprob` /
  :class:`ChunkedDistributedLogprob`, computed by
  :func:`~chunked_entropy.log_probs_and_entropy`;
- ``DistributedLogprobWithSampling`` and ``ChunkedDistributedLogprobWithSampling``
  (the top-k/top-p *filtered* log-probs of every route) with
  :class:`DistributedLogprobWithSampling` /
  :class:`ChunkedDistributedLogprobWithSampling`, computed by
  :func:`~chunked_entropy.log_probs_and_entropy` with ``keep={"top_k", "top_p"}``
  (the row's own filter, NeMo-RL's definition: a sampled token outside the
  kept set gets ``-inf``, as NeMo-RL's gives it) instead of NeMo-RL's
  all-to-all of the logits to full rows and its saved float32 softmax;
- ``ChunkedDistributedGatherLogprob`` (the top-k distillation log-probs) with
  :class:`ChunkedDistributedGatherLogprob` (``log_probs_at=``);
- ``ChunkedDistributedEntropy`` (the distillation's ``H_all = sum p log p``,
  with its gradient) with :class:`ChunkedDistributedEntropy`;
- ``from_parallel_hidden_states_to_logprobs`` (the linear-CE fusion route)
  with :func:`from_parallel_hidden_states_to_logprobs`, the library's fused
  head;
- ``get_next_token_logprobs_from_logits``, ``prepare_packed_loss_input`` and
  ``get_distillation_topk_logprobs_from_logits`` with versions that skip the
  float32 upcast of the whole logits on every route, filtered or not (the
  layout code, CP sharding and packing stay NeMo-RL's own).

Context parallelism on the hidden-state route stays refused, as NeMo-RL
refuses it.

Turn it on from the launch script, one line (each Ray worker then runs
:func:`install` when it starts; see :func:`ray_runtime_env_hook`)::

    export RAY_RUNTIME_ENV_HOOK=chunked_entropy.integrations.nemo_rl.ray_runtime_env_hook

or call ``install()`` in a process that runs NeMo-RL's loss.

Each replaced function's signature (each Function's ``forward``) is checked
against NeMo-RL's at commit 7ea279ab (2026-08-22) first; on a mismatch
:func:`install` raises and leaves NeMo-RL untouched.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

from ..logits import log_probs_and_entropy
from ..options import OutputLayer
from ._common import Adapter, Patch, Target, check_parameters, sharded_over

__all__ = [
    "DEFAULT_CHUNK_SIZE", "NEMO_RL_COMMIT", "ChunkedDistributedEntropy", "ChunkedDistributedGatherLogprob",
    "ChunkedDistributedLogprob", "ChunkedDistributedLogprobWithSampling", "DistributedLogprob",
    "DistributedLogprobWithSampling", "from_parallel_hidden_states_to_logprobs",
    "get_distillation_topk_logprobs_from_logits",
    "get_next_token_logprobs_from_logits", "install",
    "installed", "prepare_packed_loss_input", "ray_runtime_env_hook", "uninstall",
]

#: The NeMo-RL commit the replacements were written for (their signatures are checked at install).
NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
#: Tokens per chunk where NeMo-RL passes no ``logprob_chunk_size`` (its unchunked routes).
DEFAULT_CHUNK_SIZE = 1024

_MU = "nemo_rl.distributed.model_utils"
_LOSS_UTILS = "nemo_rl.algorithms.loss.utils"


def _mu():
    return sys.modules[_MU]


def _group(group):
    """A group of one rank is no vocabulary sharding."""
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _check_shard(where, logits, vocab_start_index, vocab_end_index, group):
    """NeMo-RL's shard bounds must be the library's: rank ``r`` holds ``[r*V_local, (r+1)*V_local)``."""
    v_local = logits.shape[-1]
    rank = dist.get_rank(group) if group is not None else 0
    if (int(vocab_start_index), int(vocab_end_index)) != (rank * v_local, (rank + 1) * v_local):
        raise ValueError(
            f"{where}: vocab_start_index/vocab_end_index ({vocab_start_index}, {vocab_end_index}) on rank {rank} are "
            f"not this rank's contiguous shard ({rank * v_local}, {(rank + 1) * v_local}) of V_local = {v_local}"
        )


def _log_probs(logits, target, vocab_start_index, vocab_end_index, group, chunk_size, inference_only, where):
    _check_shard(where, logits, vocab_start_index, vocab_end_index, _group(group))
    with torch.no_grad() if inference_only else torch.enable_grad():
        return log_probs_and_entropy(logits, target.long(), layer=sharded_over(_group(group)), chunking=chunk_size,
                                     compute_entropy=False).log_probs


class DistributedLogprob:
    """NeMo-RL's ``DistributedLogprob.apply(logits, target, vocab_start_index, vocab_end_index, group,
    inference_only=False)``, chunked in :data:`DEFAULT_CHUNK_SIZE` tokens.

    Memory:
        Saved for backward: a reference to the logits and two float32 per
        token (NeMo-RL's saves the float32 softmax ``[B, S, V/tp]``). Forward
        allocates one float32 ``[chunk, V/tp]`` buffer; backward the logits'
        gradient and at most one such buffer. The logits are never written.
    """

    @staticmethod
    def apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        return _log_probs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group,
                          DEFAULT_CHUNK_SIZE, inference_only, "DistributedLogprob")


class ChunkedDistributedLogprob:
    """NeMo-RL's ``ChunkedDistributedLogprob.apply(logits, target, vocab_start_index, vocab_end_index,
    chunk_size, tp_group, inference_only=False)``.

    Memory:
        As :class:`DistributedLogprob`, with ``chunk_size`` tokens per chunk
        (NeMo-RL's own allocates a float32 ``[B, S, V/tp]`` gradient buffer in
        backward besides autograd's).
    """

    @staticmethod
    def apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group,
              inference_only=False):
        return _log_probs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
                          int(chunk_size), inference_only, "ChunkedDistributedLogprob")


def _filtered(logits, target, group, top_k, top_p, chunk_size, inference_only):
    """NeMo-RL's top-k/top-p filtered log-probs: the library's row's own filter (``keep={"top_k", "top_p"}``)."""
    keep = {"top_k": None if top_k is None else int(top_k), "top_p": 1.0 if top_p is None else float(top_p)}
    with torch.no_grad() if inference_only else torch.enable_grad():
        return log_probs_and_entropy(logits, target.long(), layer=sharded_over(_group(group)), chunking=chunk_size,
                                     compute_entropy=False, keep=keep).log_probs


class DistributedLogprobWithSampling:
    """NeMo-RL's ``DistributedLogprobWithSampling.apply(logits, target, tp_group, top_k, top_p,
    inference_only=False)``: the log-probs ``[B, S]`` of the (shifted) global ``target`` under the softmax
    restricted to each row's top-k / top-p of the logits themselves; ``-inf`` where the target is outside,
    with NeMo-RL's gradient (``-p^K`` on the kept ids there). Chunked in :data:`DEFAULT_CHUNK_SIZE` tokens.

    Memory:
        Saved for backward: a reference to the logits, two float32 per token
        and the kept ids (18 bytes each); the filter sorts ``2**24 / V`` full
        rows at a time (under TP each rank all-gathers those rows' shards).
        NeMo-RL's all-to-alls the logits to full rows, casts them to float32
        and saves the float32 softmax and the bool keep mask of its
        ``[B*S/tp, V]`` rows.
    """

    @staticmethod
    def apply(vocab_parallel_logits, target, tp_group, top_k, top_p, inference_only=False):
        return _filtered(vocab_parallel_logits, target, tp_group, top_k, top_p, DEFAULT_CHUNK_SIZE, inference_only)


class ChunkedDistributedLogprobWithSampling:
    """NeMo-RL's ``ChunkedDistributedLogprobWithSampling.apply(logits, target, tp_group, top_k, top_p,
    chunk_size, inference_only=False)``: :class:`DistributedLogprobWithSampling` in ``chunk_size`` tokens.

    NeMo-RL's requires ``B * chunk_size`` (and ``B * S``) divisible by the TP
    size; this one does not.

    Memory:
        As :class:`DistributedLogprobWithSampling`.
    """

    @staticmethod
    def apply(vocab_parallel_logits, target, tp_group, top_k, top_p, chunk_size, inference_only=False):
        return _filtered(vocab_parallel_logits, target, tp_group, top_k, top_p, int(chunk_size), inference_only)


class ChunkedDistributedGatherLogprob:
    """NeMo-RL's ``ChunkedDistributedGatherLogprob.apply(logits, global_indices, vocab_start_index,
    vocab_end_index, chunk_size, tp_group, inference_only=False)``: ``[B, S, K]`` log-probs at global ids.

    Memory:
        Saved for backward: a reference to the logits and the ids, and a few
        float32 per token. Per chunk one float32 ``[chunk, V/tp]`` buffer.
    """

    @staticmethod
    def apply(vocab_parallel_logits, global_indices, vocab_start_index, vocab_end_index, chunk_size, tp_group,
              inference_only=False):
        group = _group(tp_group)
        _check_shard("ChunkedDistributedGatherLogprob", vocab_parallel_logits, vocab_start_index, vocab_end_index,
                     group)
        with torch.no_grad() if inference_only else torch.enable_grad():
            out = log_probs_and_entropy(vocab_parallel_logits, None, layer=sharded_over(group),
                                        chunking=int(chunk_size), compute_entropy=False,
                                        log_probs_at=global_indices.long())
        return out.log_probs_at.contiguous()


class ChunkedDistributedEntropy:
    """NeMo-RL's ``ChunkedDistributedEntropy.apply(logits, chunk_size, tp_group, inference_only=False)``:
    ``H_all = sum_v p_v log p_v`` (the *negative* entropy, NeMo-RL's sign), ``[B, S]``, with its gradient.

    Memory:
        Saved for backward: a reference to the logits and three float32 per
        token. Per chunk two float32 ``[chunk, V/tp]`` buffers (NeMo-RL's own
        allocates a float32 ``[B, S, V/tp]`` gradient buffer in backward).
    """

    @staticmethod
    def apply(vocab_parallel_logits, chunk_size, tp_group, inference_only=False):
        no_label = torch.full(vocab_parallel_logits.shape[:-1], -100, dtype=torch.int64,
                              device=vocab_parallel_logits.device)
        with torch.no_grad() if inference_only else torch.enable_grad():
            out = log_probs_and_entropy(vocab_parallel_logits, no_label, layer=sharded_over(_group(tp_group)),
                                        chunking=int(chunk_size))
        return out.entropy.neg().contiguous()


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    seq_index: Optional[torch.Tensor] = None,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group=None,
    context_parallel_group=None,
    sampling_params=None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """NeMo-RL's ``get_next_token_logprobs_from_logits`` without the float32 upcast of the whole logits.

    The same arguments and result (``[B, S - 1]`` float32 log-probs of the
    next tokens; with top-k/top-p in ``sampling_params``, NeMo-RL's filtered
    ones, ``-inf`` at a token outside its row's kept set):

    - Megatron (``vocab_parallel_group`` given): NeMo-RL's own
      ``from_parallel_logits_to_logprobs`` (its CP sharding and gather) with
      the logits as they are and ``chunk_size`` defaulting to
      :data:`DEFAULT_CHUNK_SIZE`, so the replaced chunked Function serves;
    - DTensor: NeMo-RL's own ``get_logprobs_from_vocab_parallel_logits`` on the
      DTensor as it is (the replaced Function serves);
    - a plain tensor (TP 1 FSDP2): :func:`~chunked_entropy.log_probs_and_entropy`
      on ``logits[:, :-1]`` and ``input_ids[:, 1:]`` (with ``keep={"top_k",
      "top_p"}`` where filtered).

    On the first two the replaced Functions serve, filtered or not.

    Memory:
        Saved for backward a reference to the logits and two float32 per
        token (filtered: and the kept ids, 18 bytes each); per chunk one
        float32 ``[chunk, V/tp]`` buffer.
    """
    mu = _mu()
    filtered = mu.need_top_k_or_top_p_filtering(sampling_params)
    chunk = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
    if vocab_parallel_group is not None:
        if vocab_parallel_rank is None:
            raise ValueError("vocab_parallel_rank must be given with vocab_parallel_group")
        v_local = next_token_logits.shape[-1]
        logprobs = mu.from_parallel_logits_to_logprobs(
            next_token_logits, input_ids, vocab_start_index=vocab_parallel_rank * v_local,
            vocab_end_index=(vocab_parallel_rank + 1) * v_local, tp_group=vocab_parallel_group,
            inference_only=False, cp_group=context_parallel_group, sampling_params=sampling_params,
            chunk_size=chunk,
        )
        return logprobs[:, : input_ids.shape[1] - 1]
    if isinstance(next_token_logits, torch.distributed.tensor.DTensor):
        return mu.get_logprobs_from_vocab_parallel_logits(next_token_logits, input_ids, seq_index=seq_index,
                                                          sampling_params=sampling_params)
    labels = input_ids[:, 1:].to(device=next_token_logits.device, dtype=torch.int64)
    if filtered:
        return _filtered(next_token_logits[:, :-1], labels, None, sampling_params.top_k, sampling_params.top_p, chunk,
                         False)
    return log_probs_and_entropy(next_token_logits[:, :-1], labels, chunking=chunk, compute_entropy=False).log_probs


def _distill_chunk(entropy: bool) -> int:
    """Tokens per chunk of the distillation route: with ``H_all`` the walk holds two float32 ``[chunk, V/tp]``
    buffers, so half :data:`DEFAULT_CHUNK_SIZE`, within the policy route's one buffer of it."""
    return DEFAULT_CHUNK_SIZE // 2 if entropy else DEFAULT_CHUNK_SIZE


def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group=None,
    context_parallel_group=None,
):
    """NeMo-RL's ``get_distillation_topk_logprobs_from_logits`` without the float32 copy of the student's logits.

    The same arguments and results (the student's and the teacher's top-k
    log-probs ``[B, S - 1, K]`` and ``H_all = sum p log p`` ``[B, S - 1]`` or
    None), on the same routes: Megatron TP (``vocab_parallel_group``) with
    NeMo-RL's CP padding, sharding and all-gather, DTensor (its own mesh's
    TP and CP groups), and a plain tensor. ``zero_outside_topk``: the
    log-probs at the teacher's ids over the whole vocabulary and ``H_all``,
    both from one call of the library (NeMo-RL calls two Functions on its
    float32 copy): their gradient is formed in float32 and rounded once to
    the logits' dtype, as NeMo-RL's upcast rounds it once.
    Otherwise: the student's logits gathered at the teacher's ids (NeMo-RL's
    ``gather_logits_at_global_indices``, exact in any dtype), then a float32
    log-softmax over the ``K`` of them.

    Memory:
        Saved for backward: a reference to the logits, a few float32 per
        token and the ``[B, S, K]`` results; per chunk one float32
        ``[1024, V/tp]`` buffer, or with ``H_all`` two of ``[512, V/tp]``
        (the same bytes). No ``[B, S, V/tp]`` float32 tensor, and one
        gradient of the logits.
    """
    from torch.distributed.tensor import DTensor

    mu = _mu()
    if teacher_topk_indices.shape[-1] <= 0:
        raise ValueError(f"topk must be positive, got {teacher_topk_indices.shape[-1]}. topk=0 is not supported as "
                         "it would result in empty tensor operations.")
    indices = teacher_topk_indices.to(student_logits.device)
    cp_group = context_parallel_group
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if vocab_parallel_group is not None:  # Megatron
        if vocab_parallel_rank is None:
            raise ValueError("vocab_parallel_rank must be given with vocab_parallel_group")
        logits, group, tp_rank = student_logits, vocab_parallel_group, vocab_parallel_rank
    elif isinstance(student_logits, DTensor):  # FSDP2 / DTensor: the groups of the logits' own mesh
        mesh = student_logits.device_mesh
        group = mesh.get_group("tp")
        logits, tp_rank = student_logits.to_local(), group.rank()
        if mesh.mesh_dim_names is not None and "cp" in mesh.mesh_dim_names:
            cp_group = mesh.get_group("cp")
            cp_size = cp_group.size()
        else:
            cp_group, cp_size = None, 1
    else:
        logits, group, tp_rank = student_logits, None, 0
    v_local = int(logits.shape[-1])
    start, end = tp_rank * v_local, (tp_rank + 1) * v_local
    h_all = None
    if zero_outside_topk and group is not None:
        local, pad = indices, 0
        if cp_size > 1:  # NeMo-RL's CP layout of the ids
            pad = logits.shape[1] * cp_size - local.shape[1]
            if pad > 0:
                local = torch.nn.functional.pad(local, (0, 0, 0, pad), value=0)
            local = mu._get_tokens_on_this_cp_rank(local, dist.get_rank(cp_group), cp_size, seq_dim=1)
        chunk = max(1, min(int(logits.shape[1]), _distill_chunk(calculate_entropy)))
        # one call for both (NeMo-RL's two Functions, after its float32 upcast): one gradient, formed in float32
        # and rounded once to the logits' dtype, not two half-precision pieces summed by autograd
        _check_shard("get_distillation_topk_logprobs_from_logits", logits, start, end, _group(group))
        out = log_probs_and_entropy(logits, None, layer=sharded_over(_group(group)), chunking=chunk,
                                    log_probs_at=local.long(), compute_entropy=calculate_entropy)
        topk = out.log_probs_at.contiguous()
        h_all = out.entropy.neg() if calculate_entropy else None
        if cp_size > 1:
            topk = mu.allgather_cp_sharded_tensor(topk, cp_group, seq_dim=1)
            if calculate_entropy:
                h_all = mu.allgather_cp_sharded_tensor(h_all, cp_group, seq_dim=1)
            if pad > 0:
                topk = topk[:, :-pad, :]
                h_all = h_all[:, :-pad] if calculate_entropy else None
    elif zero_outside_topk:
        out = log_probs_and_entropy(logits, None, chunking=_distill_chunk(calculate_entropy),
                                    log_probs_at=indices.long(), compute_entropy=calculate_entropy)
        topk = out.log_probs_at
        h_all = out.entropy.neg() if calculate_entropy else None
    else:
        if group is not None or cp_size > 1:
            gathered = mu.gather_logits_at_global_indices(logits, indices, tp_group=group, cp_group=cp_group,
                                                          vocab_start_index=start, vocab_end_index=end)
        else:
            gathered = logits.gather(-1, indices)
        topk = torch.log_softmax(gathered.float(), dim=-1)
    teacher = torch.log_softmax(teacher_topk_logits.to(topk.device, dtype=topk.dtype), dim=-1)
    return topk[:, :-1, :], teacher[:, :-1, :], (h_all[:, :-1] if calculate_entropy else None)


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: bool,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group,
    inference_only: bool = False,
    cp_group=None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """NeMo-RL's linear-CE fusion route, ``from_parallel_hidden_states_to_logprobs``, by the library's fused head.

    The same arguments and result: the hidden states ``[S/tp, B, H]`` (this
    rank's sequence-parallel slice under TP), the output layer's vocabulary
    shard ``[V/tp, H]``, the unshifted ``target`` ``[B, S]``; the next-token
    log-probs ``[B, S - 1]`` float32. Computed by
    :func:`~chunked_entropy.linear_log_probs_and_entropy` with
    ``sequence_parallel`` under TP; the weight's gradient goes through
    autograd, as NeMo-RL's does. Context parallelism is refused, as NeMo-RL
    refuses it on this route.

    Memory:
        Saved for backward: references to the hidden states and the weight,
        and two float32 per token (NeMo-RL's saves a clone of the hidden
        slice). No ``[tokens, V/tp]`` tensor: per chunk one or two float32
        ``[chunk, V/tp]`` buffers and the half-precision matmul output.
    """
    from ..linear import linear_log_probs_and_entropy

    if cp_group is not None and dist.get_world_size(cp_group) != 1:
        raise ValueError("Context parallelism is not supported for linear CE fusion loss (NeMo-RL's rule)")
    group = _group(tp_group)
    rank = dist.get_rank(group) if group is not None else 0
    v_local = output_weight_layer.shape[0]
    if (int(vocab_start_index), int(vocab_end_index)) != (rank * v_local, (rank + 1) * v_local):
        raise ValueError(f"from_parallel_hidden_states_to_logprobs: vocab_start_index/vocab_end_index "
                         f"({vocab_start_index}, {vocab_end_index}) on rank {rank} are not this rank's contiguous "
                         f"shard of V_local = {v_local}")
    labels = target.roll(shifts=-1, dims=-1).transpose(0, 1).long()  # [S, B], the hidden states' order
    with torch.no_grad() if inference_only else torch.enable_grad():
        layer = OutputLayer(output_weight_layer, process_group=group, sequence_parallel=group is not None,
                            gradient_accumulation_fusion=False)
        out = linear_log_probs_and_entropy(
            tensor_parallel_hidden_states, layer, labels,
            chunking=DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size), compute_entropy=False,
        )
    return out.log_probs.transpose(0, 1).contiguous()[:, :-1]


def prepare_packed_loss_input(
    logits: torch.Tensor,
    data,
    loss_fn,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group=None,
    context_parallel_group=None,
    sampling_params=None,
    chunk_size: Optional[int] = None,
):
    """NeMo-RL's ``prepare_packed_loss_input``, with ``chunk_size`` defaulting to :data:`DEFAULT_CHUNK_SIZE`.

    Unfiltered, NeMo-RL's own function runs; without a chunk size it would
    cast the packed logits to float32 first. With one it passes them as they
    are to the chunked Function, which the plugin replaced. Filtered
    (top-k/top-p), NeMo-RL's own casts them whatever the chunk size; here its
    steps run instead without the cast (its ``_pack_input_ids``,
    ``from_parallel_logits_to_logprobs_packed_sequences`` with the chunk size,
    so the replaced ``ChunkedDistributedLogprobWithSampling`` serves, its
    ``mask_out_neg_inf_logprobs``, and the unfiltered log-probs for the
    reference KL).
    """
    own = _PATCH.original("prepare_packed_loss_input")
    chunk = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    lu = sys.modules[_LOSS_UTILS]
    if (_mu().need_top_k_or_top_p_filtering(sampling_params) and loss_fn.input_type == lu.LossInputType.LOGPROB
            and vocab_parallel_group is not None and vocab_parallel_rank is not None):
        return _packed_filtered(lu, logits, data, loss_fn, cu_seqlens_q, cu_seqlens_q_padded, vocab_parallel_rank,
                                vocab_parallel_group, context_parallel_group, sampling_params, chunk)
    return own(logits, data, loss_fn, cu_seqlens_q, cu_seqlens_q_padded, vocab_parallel_rank,
               vocab_parallel_group, context_parallel_group, sampling_params, chunk)


def _packed_filtered(lu, logits, data, loss_fn, cu_seqlens_q, cu_seqlens_q_padded, tp_rank, tp_group, cp_group,
                     sampling_params, chunk):
    """NeMo-RL's filtered ``prepare_packed_loss_input`` (at 7ea279ab), its own steps, without its float32 cast."""
    mu = _mu()
    input_ids = data["input_ids"]
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    targets = lu._pack_input_ids(input_ids, cu_seqlens_q, cu_seqlens_q_padded, cp_rank=cp_rank, cp_size=cp_size,
                                 roll_shift=-1)
    v_local = logits.shape[-1]

    def log_probs(params):
        return mu.from_parallel_logits_to_logprobs_packed_sequences(
            logits, targets, cu_seqlens_q_padded, input_ids.shape[1], vocab_start_index=tp_rank * v_local,
            vocab_end_index=(tp_rank + 1) * v_local, group=tp_group, inference_only=False, cp_group=cp_group,
            sampling_params=params, chunk_size=chunk, target_is_pre_rolled=True)

    mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
    logprobs = lu.mask_out_neg_inf_logprobs(log_probs(sampling_params), mask[:, 1:], "curr_logprobs")
    if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
        data["curr_logprobs_unfiltered"] = log_probs(None)
    return {"next_token_logprobs": logprobs}, data


# ----------------------------------------------------------------------------- install


def _forward_check(where: str, expected: tuple):
    """A ``Target.check`` for an autograd Function: its ``forward``'s parameters are ``expected``."""
    check = check_parameters(f"{where}.forward", ("ctx", *expected), f"NeMo-RL (written at {NEMO_RL_COMMIT[:8]})")
    return lambda original: check(original.forward)


_FUNCTIONS = (
    (DistributedLogprob, ("vocab_parallel_logits", "target", "vocab_start_index", "vocab_end_index", "group",
                          "inference_only")),
    (ChunkedDistributedLogprob, ("vocab_parallel_logits", "target", "vocab_start_index", "vocab_end_index",
                                 "chunk_size", "tp_group", "inference_only")),
    (ChunkedDistributedGatherLogprob, ("vocab_parallel_logits", "global_indices", "vocab_start_index",
                                       "vocab_end_index", "chunk_size", "tp_group", "inference_only")),
    (ChunkedDistributedEntropy, ("vocab_parallel_logits", "chunk_size", "tp_group", "inference_only")),
    (DistributedLogprobWithSampling, ("vocab_parallel_logits", "target", "tp_group", "top_k", "top_p",
                                      "inference_only")),
    (ChunkedDistributedLogprobWithSampling, ("vocab_parallel_logits", "target", "tp_group", "top_k", "top_p",
                                             "chunk_size", "inference_only")),
)
_NEXT = ("input_ids", "next_token_logits", "seq_index", "vocab_parallel_rank", "vocab_parallel_group",
         "context_parallel_group", "sampling_params", "chunk_size")
_DISTILL = ("student_logits", "teacher_topk_logits", "teacher_topk_indices", "zero_outside_topk", "calculate_entropy",
            "vocab_parallel_rank", "vocab_parallel_group", "context_parallel_group")
_HIDDEN = ("tensor_parallel_hidden_states", "output_weight_layer", "runtime_gather_output", "target",
           "vocab_start_index", "vocab_end_index", "tp_group", "inference_only", "cp_group", "chunk_size")
_PACKED = ("logits", "data", "loss_fn", "cu_seqlens_q", "cu_seqlens_q_padded", "vocab_parallel_rank",
           "vocab_parallel_group", "context_parallel_group", "sampling_params", "chunk_size")
_WRITTEN = f"NeMo-RL (written at {NEMO_RL_COMMIT[:8]})"

#: Every (module, name) the plugin replaces.
TARGETS = (
    *((_MU, cls.__name__) for cls, _ in _FUNCTIONS),
    (_MU, "get_next_token_logprobs_from_logits"),
    (_LOSS_UTILS, "get_next_token_logprobs_from_logits"),
    (_MU, "get_distillation_topk_logprobs_from_logits"),
    (_MU, "from_parallel_hidden_states_to_logprobs"),
    (_LOSS_UTILS, "get_distillation_topk_logprobs_from_logits"),
    (_LOSS_UTILS, "prepare_packed_loss_input"),
    ("nemo_rl.algorithms.loss", "prepare_packed_loss_input"),
    ("nemo_rl.models.megatron.train", "prepare_packed_loss_input"),
)

_PATCH = Patch(
    "NeMo-RL",
    [*(Target(_MU, cls.__name__, cls, _forward_check(f"{_MU}.{cls.__name__}", params)) for cls, params in _FUNCTIONS),
     *(Target(m, "get_next_token_logprobs_from_logits", get_next_token_logprobs_from_logits,
              check_parameters(f"{m}.get_next_token_logprobs_from_logits", _NEXT, _WRITTEN))
       for m in (_MU, _LOSS_UTILS)),
     *(Target(m, "get_distillation_topk_logprobs_from_logits", get_distillation_topk_logprobs_from_logits,
              check_parameters(f"{m}.get_distillation_topk_logprobs_from_logits", _DISTILL, _WRITTEN))
       for m in (_MU, _LOSS_UTILS)),
     Target(_MU, "from_parallel_hidden_states_to_logprobs", from_parallel_hidden_states_to_logprobs,
            check_parameters(f"{_MU}.from_parallel_hidden_states_to_logprobs", _HIDDEN, _WRITTEN)),
     *(Target(m, "prepare_packed_loss_input", prepare_packed_loss_input,
              check_parameters(f"{m}.prepare_packed_loss_input", _PACKED, _WRITTEN))
       for m in (_LOSS_UTILS, "nemo_rl.algorithms.loss", "nemo_rl.models.megatron.train"))],
    "NeMo-RL's log-probs, top-k distillation log-probs and entropy now run chunked: no float32 copy of the "
    "logits, no saved softmax, top-k/top-p filtered log-probs included",
)


_ADAPTER = Adapter(_PATCH)


def install() -> None:
    """Replace NeMo-RL's log-prob Functions and the upcasting helpers wherever it looks them up (idempotent).

    Checks every target already imported, then replaces them all, and the
    rest as soon as NeMo-RL imports them. On a mismatch it raises
    RuntimeError and leaves NeMo-RL as it was.
    """
    _ADAPTER.install()


def uninstall() -> None:
    """Restore NeMo-RL's own functions everywhere (and drop a pending hook)."""
    _ADAPTER.uninstall()


def installed() -> bool:
    """Whether any of the framework's functions is currently replaced."""
    return _ADAPTER.installed()


def ray_runtime_env_hook(runtime_env):
    """Ray's ``RAY_RUNTIME_ENV_HOOK``: every Ray worker of the job runs :func:`install` when it starts.

    NeMo-RL starts Ray itself (``init_ray``) and runs its policy in Ray
    workers, which a launch script does not reach. With::

        export RAY_RUNTIME_ENV_HOOK=chunked_entropy.integrations.nemo_rl.ray_runtime_env_hook

    in the launch script, ``ray.init`` passes the job's runtime environment
    here, and this adds ``worker_process_setup_hook`` pointing at
    :func:`install` (a setup hook the job already has is refused rather than
    replaced). NeMo-RL turns off Ray's ``uv run`` propagation, which would
    otherwise bypass this hook. The workers' Python environments must have
    ``chunked_entropy`` installed.
    """
    env = dict(runtime_env or {})
    ours = f"{__name__}.install"
    have = env.get("worker_process_setup_hook")
    if have not in (None, ours):
        raise ValueError(f"the job's runtime_env already has worker_process_setup_hook={have!r}; call "
                         f"{ours}() from that hook instead")
    env["worker_process_setup_hook"] = ours
    return env

