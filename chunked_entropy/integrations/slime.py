"""slime: the Megatron trainer's log-probs and entropy without a divided copy, a saved softmax or a dense mask.

slime (THUDM/slime) computes every training and old/ref log-prob and entropy
from the packed ``[1, T, V/tp]`` logits in
``slime.backends.megatron_utils.loss.get_log_probs_and_entropy``, which

- divides the logits by the rollout temperature out of place (a second
  ``[T, V/tp]`` float32 tensor, saved for backward);
- builds a dense boolean ``[T, V/tp]`` keep mask with Python loops for top-p
  replay, then ``masked_fill``s a float32 copy of the logits;
- calls ``calculate_log_probs_and_entropy``, whose autograd Function saves a
  float32 softmax per chunk (``--log-probs-chunk-size`` bounds only the
  temporaries).

:func:`install` replaces that function, wherever slime looks it up (the loss
module's own calls, and the names the actor and the log-prob server import),
with :func:`get_log_probs_and_entropy`: the same arguments and results,
computed by :func:`~chunked_entropy.log_probs_and_entropy` in one chunked
pass. The temperature goes in as ``temperature=``; the top-p sets as
``keep=``, a CSR pair built from slime's own ``rollout_top_p_token_ids`` /
``rollout_top_p_token_offsets`` (never a dense mask); nothing of size
``[T, V/tp]`` is copied or saved (a reference to the logits, which the model
keeps anyway, and a few floats per token). The lower
``calculate_log_probs_and_entropy`` alone would not do: the divided copy and
the dense mask are made above it.

Use it with slime's own hook, no source edit::

    --custom-megatron-init-path chunked_entropy.integrations.slime.install

What it reproduces of slime (checked against slime's code at commit
624b824a, 2026-08-21):

- the packed layout: response token ``j`` of a sample of total length ``L``
  and response length ``R`` is predicted by logits row ``seq_start + L - R - 1 + j``;
- context parallelism: zigzag halves (each sample padded to ``2 * cp`` chunks)
  and ``--allgather-cp`` (a contiguous split of the concatenated sequence,
  then slime's redistribution into the zigzag layout through a differentiable
  all-reduce over the CP group);
- top-p replay: row ``j`` keeps ``ids[offsets[j]:offsets[j+1]]`` and the
  sampled token; rows without a recorded set (prompt tokens, response rows
  beyond ``len(offsets) - 1``) keep the whole vocabulary. An empty recorded
  set keeps only the sampled token, as slime's mask does (its log-prob is 0);
  the library's own ``keep=`` reads an empty set as "not truncated", so the
  plugin adds the sampled token to every recorded set;
- the entropy carries a gradient exactly when ``with_entropy`` and
  ``args.entropy_coef != 0`` (slime's rule);
- the chunk size is ``--log-probs-chunk-size``; slime's ``-1`` ("no
  chunking") maps to :data:`DEFAULT_CHUNK_SIZE`: this library never needs the
  whole tensor at once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..logits import log_probs_and_entropy
from ..options import Chunking
from ..parallel import agreed_call, all_reduce_with_grad
from . import _hidden_route
from ._common import Patch, Target, check_parameters, sharded_over
from ._hidden_route import HiddenStates

__all__ = ["DEFAULT_CHUNK_SIZE", "ROUTES", "TARGETS", "HiddenStates", "get_log_probs_and_entropy", "install",
           "installed", "route", "uninstall"]

#: The chunk size used for slime's ``--log-probs-chunk-size -1``.
DEFAULT_CHUNK_SIZE = 512

#: The routes :func:`install` takes (``route=``, or the environment variable ``CHUNKED_ENTROPY_SLIME_ROUTE``).
ROUTES = _hidden_route.ROUTES
_ROUTE_ENV = "CHUNKED_ENTROPY_SLIME_ROUTE"

_LOSS = "slime.backends.megatron_utils.loss"
#: Where slime looks ``get_log_probs_and_entropy`` up: its own module, and the modules that import it by name.
TARGETS = (_LOSS, "slime.backends.megatron_utils.actor", "slime.backends.megatron_utils.server.logprob_utils")
_EXPECTED = ("logits", "args", "unconcat_tokens", "total_lengths", "response_lengths", "with_entropy",
             "non_loss_data", "top_p_token_ids", "top_p_token_offsets")


# ----------------------------------------------------------------------------- slime's layout


def _mpu():
    from megatron.core import parallel_state

    return parallel_state


def _zigzag(total_length: int, response_length: int, cp_rank: int, cp_size: int):
    """slime's ``get_logits_and_tokens_offset_with_cp``: the chunk size, the two chunks and their logits."""
    prompt = total_length - response_length
    chunk = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    chunks = ((cp_rank * chunk, (cp_rank + 1) * chunk),
              ((2 * cp_size - cp_rank - 1) * chunk, (2 * cp_size - cp_rank) * chunk))
    logits = []
    for c0, c1 in chunks:
        lo, hi = max(c0, prompt - 1), min(c1, total_length - 1)
        logits.append((lo, hi) if lo < hi else None)  # None: an empty half
    return chunk, chunks, logits


class _Layout:
    """Where each sample's response rows sit in this rank's ``[T]`` logits rows, in slime's output order.

    ``pieces[i]`` lists ``(row, j, length)``: local rows ``row .. row+length``
    hold the logits of response tokens ``j .. j+length`` of sample ``i``.
    """

    def __init__(self, args, t_local: int, total_lengths, response_lengths):
        mpu = _mpu()
        cp_size = mpu.get_context_parallel_world_size()
        cp_rank = mpu.get_context_parallel_rank() if cp_size > 1 else 0
        self.allgather = bool(getattr(args, "allgather_cp", False)) and cp_size > 1
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.pieces = []
        seq_start = 0  # the sample's first position in the concatenated sequence (cp1, allgather)
        base = 0  # its first local row (zigzag)
        for total, resp in zip(total_lengths, response_lengths, strict=True):
            total, resp = int(total), int(resp)
            first = total - resp - 1  # the (sample) position of the logits of response token 0
            if cp_size == 1:
                self.pieces.append([(seq_start + first, 0, resp)])
            elif self.allgather:
                lo = max(seq_start + first, cp_rank * t_local)
                hi = min(seq_start + total - 1, (cp_rank + 1) * t_local)
                self.pieces.append([(lo - cp_rank * t_local, lo - seq_start - first, hi - lo)] if hi > lo else [])
            else:
                chunk, chunks, logits = _zigzag(total, resp, cp_rank, cp_size)
                self.pieces.append([(base + h * chunk + lo - chunks[h][0], lo - first, hi - lo)
                                    for h, span in enumerate(logits) if span is not None for lo, hi in (span,)])
                base += 2 * chunk
            seq_start += total

    def labels(self, unconcat_tokens, total_lengths, response_lengths, t_local: int, device):
        """The sampled token of every response row; -100 (ignored) elsewhere."""
        labels = torch.full((t_local,), -100, dtype=torch.int64, device=device)
        for pieces, tokens, total, resp in zip(self.pieces, unconcat_tokens, total_lengths, response_lengths,
                                               strict=True):
            prompt = int(total) - int(resp)
            for row, j, length in pieces:
                labels[row:row + length] = tokens[prompt + j:prompt + j + length].to(device=device, dtype=torch.int64)
        return labels

    def kept_sets(self, ids_per_sample, offsets_per_sample, labels, t_local: int, device):
        """slime's top-p sets as a CSR pair over the local rows, each recorded set with the sampled token."""
        rows, ids = [], []
        for pieces, s_ids, s_off in zip(self.pieces, ids_per_sample, offsets_per_sample, strict=True):
            # slime's lists (or CPU int32 tensors): sliced on the host, the kept ids moved once per sample
            s_off = torch.as_tensor(s_off, dtype=torch.int64).cpu()
            s_ids = torch.as_tensor(s_ids, dtype=torch.int64).to(device)
            recorded = max(s_off.numel() - 1, 0)
            for row, j, length in pieces:
                stop = min(j + length, recorded)  # rows past the recorded ones keep the whole vocabulary
                if stop <= j:
                    continue
                counts = (s_off[j + 1:stop + 1] - s_off[j:stop]).to(device)
                local = torch.arange(stop - j, device=device)
                rows += [row + torch.repeat_interleave(local, counts), row + local]
                ids += [s_ids[int(s_off[j]):int(s_off[stop])], labels[row:row + stop - j]]
        if not rows:
            return None
        rows, ids = torch.cat(rows), torch.cat(ids)
        order = torch.argsort(rows, stable=True)
        counts = torch.bincount(rows, minlength=t_local)
        return ids[order], torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    def per_sample(self, values: torch.Tensor) -> list:
        """The response values of each sample, from the local rows (slime's ``_extract_per_sample``)."""
        return [torch.cat([values[row:row + length] for row, _, length in pieces]) if pieces else values[:0]
                for pieces in self.pieces]

    def redistribute(self, local: list, total_lengths, response_lengths) -> list:
        """``--allgather-cp``: every sample's full response over the CP group, then this rank's zigzag halves."""
        mpu = _mpu()
        full = []
        for values, pieces, resp in zip(local, self.pieces, response_lengths, strict=True):
            j = pieces[0][1] if pieces else 0
            full.append(F.pad(values, (j, int(resp) - j - values.numel())))
        summed = all_reduce_with_grad(torch.cat(full), mpu.get_context_parallel_group())
        out = []
        for resp_values, total, resp in zip(summed.split([int(r) for r in response_lengths]), total_lengths,
                                            response_lengths, strict=True):
            _, _, logits = _zigzag(int(total), int(resp), self.cp_rank, self.cp_size)
            first = int(total) - int(resp) - 1
            halves = [resp_values[lo - first:hi - first] for span in logits if span is not None for lo, hi in (span,)]
            out.append(torch.cat(halves) if halves else resp_values[:0])
        return out


# ----------------------------------------------------------------------------- the replacement


def _chunk_size(args) -> int:
    """``--log-probs-chunk-size``; -1 or None: :data:`DEFAULT_CHUNK_SIZE` (slime's arguments are read per call)."""
    size = getattr(args, "log_probs_chunk_size", -1)
    return DEFAULT_CHUNK_SIZE if size is None or int(size) <= 0 else int(size)


def _chunking(args) -> Chunking:
    return Chunking(_chunk_size(args))


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args,
    unconcat_tokens: list,
    total_lengths: list,
    response_lengths: list,
    with_entropy: bool = False,
    non_loss_data: bool = True,
    top_p_token_ids: Optional[list] = None,
    top_p_token_offsets: Optional[list] = None,
):
    """slime's ``get_log_probs_and_entropy``, chunked: no divided copy, no saved softmax, no dense mask.

    Args:
        logits: ``[1, T, V/tp]``, this rank's vocabulary shard of the packed
            sequence (``T`` local rows under context parallelism); float32 as
            slime passes it (bf16 works too). Never written. Or, on the
            hidden-state route, the :class:`HiddenStates` the patched
            post-processing returned: only the response rows are projected.
        args: slime's arguments: ``rollout_temperature``,
            ``log_probs_chunk_size``, ``entropy_coef``, ``allgather_cp``.
        unconcat_tokens: each sample's tokens (prompt and response).
        total_lengths: each sample's prompt + response length.
        response_lengths: each sample's response length.
        with_entropy: also return the entropy (with a gradient when
            ``args.entropy_coef != 0``).
        non_loss_data: slime's flag (must be True, as slime asserts).
        top_p_token_ids: per sample, the rollout's top-p kept ids of its
            response tokens (a flat list or tensor), or None.
        top_p_token_offsets: per sample, their offsets (``R + 1`` entries).

    Returns:
        slime's ``(torch.empty(0), {"log_probs": [...], "entropy": [...]})``:
        per-sample float32 ``[R_i]`` tensors (under context parallelism this
        rank's part, in slime's layout); ``"entropy"`` only with
        ``with_entropy``.

    Memory:
        Hidden-state route: no ``[T, V/tp]`` tensor. The ``M`` response rows
        (of this rank's ``T``) are gathered once (``[M, H]``, kept for
        backward; under sequence parallelism from the gathered ``[T, H]``),
        two to four float32 per row are saved, the fused head's chunk buffers
        are allocated in forward and backward (two float32 ``[chunk, V/tp]``
        at most 128 MiB each by default) and backward allocates ``[T, H]`` and
        the weight's gradient.

        Logits route: saved for backward: a reference to ``logits`` and two to four
        float32 per local row, and the kept sets' entries (18 bytes per kept
        id; about 46 at the peak while they are built). Forward allocates one or two float32 ``[chunk, V/tp]``
        buffers; backward the logits' gradient.
    """
    assert non_loss_data
    if isinstance(logits, HiddenStates):
        return _from_hidden(logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                            top_p_token_ids, top_p_token_offsets)
    tp_group = _mpu().get_tensor_model_parallel_group()
    # The adapter's own checks join an agreed call: a rank refused here raises with its peers instead of
    # leaving them in the library's collectives (one more small all-gather per call under TP).
    with agreed_call(tp_group):
        if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.size(0) == 1):
            raise ValueError(f"logits must be slime's packed [1, T, V/tp], got {getattr(logits, 'shape', logits)}")
        rows = logits.squeeze(0)  # a view whose backward is a view too (indexing, logits[0], would copy the grad)
        t_local, device = rows.shape[0], rows.device
        layout = _Layout(args, t_local, total_lengths, response_lengths)
        labels = layout.labels(unconcat_tokens, total_lengths, response_lengths, t_local, device)
        keep = None
        if top_p_token_ids is not None and top_p_token_offsets is not None:
            keep = layout.kept_sets(top_p_token_ids, top_p_token_offsets, labels, t_local, device)
        temperature = float(getattr(args, "rollout_temperature", 1.0))
    out = log_probs_and_entropy(
        rows, labels, layer=sharded_over(tp_group), chunking=_chunking(args), temperature=temperature,
        compute_entropy=bool(with_entropy), keep=keep,
    )
    res = {"log_probs": layout.per_sample(out.log_probs)}
    if with_entropy:
        entropy = out.entropy
        if getattr(args, "entropy_coef", 0.0) == 0:  # slime's rule: a metric only, no backward work
            entropy = entropy.detach()
        res["entropy"] = layout.per_sample(entropy)
    if layout.allgather:
        res = {k: layout.redistribute(v, total_lengths, response_lengths) for k, v in res.items()}
    return torch.empty((0,), device=device), res


def _from_hidden(states: HiddenStates, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                 top_p_token_ids, top_p_token_offsets):
    """The hidden-state route: the response rows only, through the fused head on the model's output layer."""
    head = states.head(_chunking(args))
    hidden = states.hidden
    with agreed_call(head.layer.process_group) as call:
        if hidden.dim() != 3 or hidden.shape[1] != 1:
            raise ValueError(f"slime's packed hidden states must be [T, 1, H], got {tuple(hidden.shape)}")
        t_local = hidden.shape[0] * (call.world if head.layer.sequence_parallel else 1)
        device = hidden.device
        layout = _Layout(args, t_local, total_lengths, response_lengths)
        labels = layout.labels(unconcat_tokens, total_lengths, response_lengths, t_local, device)
        keep = None
        if top_p_token_ids is not None and top_p_token_offsets is not None:
            keep = layout.kept_sets(top_p_token_ids, top_p_token_offsets, labels, t_local, device)
        count = sum(length for pieces in layout.pieces for _, _, length in pieces)  # known on the host: no sync
        temperature = float(getattr(args, "rollout_temperature", 1.0))
    out = head(hidden, labels.unsqueeze(1), temperature=temperature, compute_entropy=bool(with_entropy), keep=keep,
               rows=("kept", count))
    res = {"log_probs": layout.per_sample(out.log_probs.squeeze(1))}
    if with_entropy:
        entropy = out.entropy.squeeze(1)
        if getattr(args, "entropy_coef", 0.0) == 0:
            entropy = entropy.detach()
        res["entropy"] = layout.per_sample(entropy)
    if layout.allgather:
        res = {k: layout.redistribute(v, total_lengths, response_lengths) for k, v in res.items()}
    return torch.empty((0,), device=device), res


_HIDDEN = _hidden_route.postprocess_patch("slime")


_PATCH = Patch(
    "slime",
    [Target(m, "get_log_probs_and_entropy", get_log_probs_and_entropy,
            check_parameters(f"{m}.get_log_probs_and_entropy", _EXPECTED, "slime (written at commit 624b824a)"))
     for m in TARGETS],
    "slime's get_log_probs_and_entropy now runs chunked: the temperature inside the chunks, top-p sets as kept "
    "ids, no [T, V/tp] copy or saved softmax (chunk size: --log-probs-chunk-size)",
)


_ADAPTER = _hidden_route.RoutedAdapter(_PATCH, _HIDDEN, route_env=_ROUTE_ENV, framework="slime")


def install(args=None, *, route: Optional[str] = None) -> None:
    """slime's ``--custom-megatron-init-path`` hook: serve slime's log-probs and entropy (idempotent).

    Replaces ``get_log_probs_and_entropy`` wherever slime looks it up and, on
    the hidden-state route (the default), megatron-core's
    ``GPTModel._postprocess``, so that the actor's forwards hand on the
    hidden states instead of the logits. ``route`` (else the environment
    variable ``CHUNKED_ENTROPY_SLIME_ROUTE``, else ``"hidden"``) is one of
    :data:`ROUTES`; ``"logits"`` keeps megatron-core's logits and chunks
    them. A custom loss (``--loss-type custom_loss``) may read the logits
    itself: it gets the logits route, with one logged warning. On the
    hidden-state route, ``--fp8-output-proj`` (megatron-core >= 0.19's MXFP8
    output layer) is a ValueError saying to take the logits route (the fused
    head would compute that layer in bf16).

    Checks the signature of every target already imported, then replaces
    them all, and the rest as soon as they are imported. On a mismatch it
    raises RuntimeError and leaves slime as it was. ``args`` (slime's
    arguments, passed by the hook) are read per call, except ``loss_type`` and
    ``fp8_output_proj``.
    """
    _ADAPTER.install(args, route=route)


def uninstall() -> None:
    """Restore slime's own function and megatron-core's post-processing (and drop pending hooks)."""
    _ADAPTER.uninstall()


def installed() -> bool:
    """Whether any of the framework's functions is currently replaced."""
    return _ADAPTER.installed()


def route() -> Optional[str]:
    """The route installed: ``"hidden"``, ``"logits"``, or None."""
    return _ADAPTER.route()
