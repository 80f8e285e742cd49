"""Only the rows that are read: ``rows=`` on the hidden-state (and logits) entry points.

Layer: per-token inputs (beside :mod:`chunked_entropy._inputs`; imports only
``parallel``, the plain checks and ``_autograd``): what every op does with ``rows`` before its own
preparation.

- ``rows`` an integer tensor (any shape ``L``, usually ``[M]``): an index into
  the flattened token rows of ``hidden`` (under sequence parallelism, of the
  gathered sequence, row ``s * B + b``). Repeats are allowed, in any order.
  The op then runs on the selected rows as if they were its input: one
  ``[*L, H]`` gather of the hidden rows (:func:`select_rows`), per-row inputs
  and outputs of leading shape ``L``. The hidden gradient is accumulated over
  repeats (``index_add_``); a row never selected gets exactly zero. A 2-D
  ``rows`` ``[B, T]`` lays selected rows out as sequences, which is how the
  sequence-level objectives and aggregations of the policy loss see them
  (tree packing: one row per (rollout, position), a shared prefix's rows
  repeated in each rollout).
- ``rows="kept"`` (or ``("kept", count)``): the rows whose label is kept
  (``label_mask`` and ``ignore_index``); inputs and outputs keep their full
  shape, the outputs zero on the skipped rows (:func:`kept_rows`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ._autograd import once_differentiable
from ._checks import check_device, check_strided, is_int
from .parallel import agreed_call, all_gather_dim0, fingerprint, group_rank_size, refused_together

__all__ = ["KEPT", "check_full_shape", "check_per_row", "kept_rows", "parse_kept", "put_rows", "select_logit_rows",
           "select_rows", "take_keep", "take_rows"]

KEPT = "kept"


def _check_index(rows, n_rows: int, device: torch.device, call) -> torch.Tensor:
    """``rows`` checked (an integer tensor on ``device``, every entry in ``[0, n_rows)``); its flat int64 copy."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be an int64 tensor of row indices, 'kept' or ('kept', count), got "
                        f"{type(rows).__name__}")
    if rows.dtype == torch.bool:
        raise TypeError("rows must be an int64 index of row positions, got a bool tensor; for a mask pass "
                        "rows=mask.nonzero().squeeze(1) (or rows='kept' with the mask as label_mask)")
    if rows.dtype.is_floating_point or rows.dtype.is_complex:
        raise TypeError(f"rows must be an int64 index of row positions, got {rows.dtype}")
    check_strided("rows", rows)
    check_device("rows", rows, device)
    flat = rows.reshape(-1).to(torch.int64)
    if flat.numel():
        bad = (flat < 0) | (flat >= n_rows)
        expected = f"rows must index the {n_rows} token rows of the input: every entry in [0, {n_rows})"

        def where_bad():  # on the CPU only: the first bad entry, at no cost when there is none
            i = int(bad.nonzero()[0, 0])
            return f"{expected}; found {int(flat[i])} at position {i}"

        call.require(~bad.any(), where_bad if device.type == "cpu" else expected)
    call.agree("rows (its number of dimensions)", rows.dim())
    call.agree("rows (its shape)", tuple(int(s) for s in rows.shape) if rows.dim() else 0)
    if call.world > 1:
        call.agree("rows (a digest of its entries)", fingerprint(flat))
    return flat


def check_per_row(rows: torch.Tensor, tails=(), **named) -> None:
    """Each named per-row input (None skipped) must have ``rows``' shape (those named in ``tails``: as its
    leading shape, one more dimension after it)."""
    lead = tuple(rows.shape)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            continue
        tail = name in tails
        if tuple(t.shape[: len(lead)]) != lead or t.dim() != len(lead) + tail:
            raise ValueError(f"with rows=, {name} is given per selected row: its shape must be rows' shape {lead}"
                             + (" and one more dimension" if tail else "") + f", got {tuple(t.shape)}")


class _SelectRows(torch.autograd.Function):
    """``hidden``'s rows at ``flat`` (after the sequence-parallel gather); backward: ``index_add_`` of the
    rows' gradients into zeros (each repeat adds; an unselected row stays exactly 0), this rank's slice
    under sequence parallelism (the op on the selected rows already summed their gradient over the group)."""

    @staticmethod
    def forward(ctx, hidden, flat, lead, group):
        full = all_gather_dim0(hidden, group) if group is not None else hidden
        idx = torch.unravel_index(flat, full.shape[:-1])
        out = full[idx]  # the one [M, H] gather
        ctx.save_for_backward(flat)
        ctx.full_shape, ctx.local_rows = full.shape, hidden.shape[0]
        ctx.rank = group_rank_size(group)[0] if group is not None else 0
        return out.view(*lead, hidden.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (flat,) = ctx.saved_tensors
        shape = ctx.full_shape
        grad = torch.zeros((math.prod(shape[:-1]), shape[-1]), dtype=g.dtype, device=g.device)
        grad.index_add_(0, flat, g.reshape(-1, shape[-1]))
        grad = grad.view(shape)
        if ctx.local_rows != shape[0]:  # sequence parallelism: this rank's slice
            grad = grad.narrow(0, ctx.rank * ctx.local_rows, ctx.local_rows).contiguous()
        return grad, None, None, None


def select_rows(rows, hidden: torch.Tensor, *, process_group=None, sequence_parallel: bool = False,
                name: str = "hidden", tails=("log_probs_at", "keep"), require=None, layer_name: str = "layer",
                **per_row) -> torch.Tensor:
    """``hidden``'s rows at ``rows`` (``[*rows.shape, H]``), checked; the op then runs on them without
    sequence parallelism.

    Checks (before any work, naming ``rows``; under a process group every rank
    agrees on ``rows``' shape and a digest of its entries, and on
    ``sequence_parallel`` (the gather below), named as ``layer_name``'s field,
    and refuses together): an integer tensor on ``hidden``'s device, every entry in range,
    every per-row input in ``per_row`` (``name=tensor``) of shape
    ``rows.shape`` (those named in ``tails``: ``[*rows.shape, K]``), and
    ``require`` (``(ok, message)`` from :func:`kept_rows`, or None) holds.
    Memory: one ``[M, H]`` gather (plus the ``[S, B, H]`` gather under
    sequence parallelism); backward a ``[tokens, H]`` gradient, zero but on
    the selected rows.
    """
    with agreed_call(process_group) as call:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            raise ValueError(f"with rows=, {name} must be a [..., H] tensor of token rows, got "
                             f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
        lead = hidden.shape[:-1]
        n_rows = lead.numel() * (call.world if sequence_parallel else 1)
        # The layout decides the collectives below (the gather of the sequence-parallel slices): agreed here.
        sp = bool(sequence_parallel)
        call.agree(f"{layer_name}.sequence_parallel", int(sp), shown=repr(sp))
        flat = _check_index(rows, n_rows, hidden.device, call)
        if rows.dim() == 0:
            raise ValueError("rows must have at least one dimension ([M] row indices), got a 0-d tensor")
        check_per_row(rows, tails, **per_row)
        if require is not None:
            call.require(*require)
    group = process_group if sequence_parallel and call.world > 1 else None
    return _SelectRows.apply(hidden, flat, tuple(rows.shape), group)


def select_logit_rows(rows, logits, process_group, *, name: str = "logits", **per_row) -> torch.Tensor:
    """:func:`select_rows` for the ops from logits: an index only (their logits exist already; ``"kept"``
    is for the ops over hidden states)."""
    if isinstance(rows, (str, tuple)):
        with refused_together(process_group):
            raise ValueError(f"rows={rows!r} is for the ops over hidden states; from {name} pass an int64 index of "
                             "the rows to read (e.g. the kept rows' positions)")
    return select_rows(rows, logits, process_group=process_group, name=name, **per_row)


# ---------------------------------------------------------------- rows="kept"


def parse_kept(rows) -> Optional[tuple]:
    """``("kept", count or None)`` for the ``rows="kept"`` forms, None for anything else."""
    if isinstance(rows, str):
        if rows != KEPT:
            raise ValueError(f"rows must be an int64 index tensor, 'kept' or ('kept', count), got {rows!r}")
        return KEPT, None
    if isinstance(rows, tuple):
        if len(rows) != 2 or rows[0] != KEPT or not is_int(rows[1]) or rows[1] < 0:
            raise ValueError(f"rows as a tuple must be ('kept', count) with count an int >= 0 (the number of kept "
                             f"rows), got {rows!r}")
        return KEPT, int(rows[1])
    return None


def kept_rows(valid: torch.Tensor, count: Optional[int]):
    """``(positions, requirement)``: the flat positions where ``valid`` holds, in order, and None or an
    ``(ok, message)`` for :func:`select_rows` to check (a given count must be the true one). One host sync
    for the count, none when ``count`` is given."""
    flat = valid.reshape(-1)
    if count is None:
        return flat.nonzero().squeeze(1), None  # the one host sync
    if count > flat.numel():
        raise ValueError(f"rows=('kept', {count}): the count exceeds the {flat.numel()} token rows")
    ok = flat.sum() == count
    message = f"rows=('kept', {count}): the labels keep another number of rows than the count"
    return torch.nonzero_static(flat, size=count).squeeze(1), (ok, message)


def check_full_shape(name: str, t: torch.Tensor, hidden, group, sequence_parallel: bool, batch_first: bool = False):
    """With ``rows="kept"`` ``t`` (the labels or the mask) covers every token row of ``hidden`` (the gathered
    sequence under sequence parallelism; ``batch_first``: the policy loss's ``[B, T]`` over ``[T/P, B, H]``)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return  # the op's own check names it
    lead = list(hidden.shape[:-1])
    if sequence_parallel:
        lead[0] *= group_rank_size(group)[1]
        if batch_first and len(lead) == 2:
            lead = lead[::-1]
    if list(t.shape) != lead:
        raise ValueError(f"with rows='kept', {name} must cover every token row of the input: shape {tuple(lead)}, got "
                         f"{tuple(t.shape)}")


def take_rows(t, lead: torch.Size, idx: torch.Tensor):
    """A per-token input of leading shape ``lead`` (broadcast to it when smaller), at the flat rows ``idx``;
    None, scalars and 0-d tensors pass through."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    k = len(lead)
    tail = tuple(t.shape[k:]) if t.dim() > k else ()
    try:
        t = torch.broadcast_to(t, tuple(lead) + tail)
    except RuntimeError:
        return t  # the op's own check names the argument and the shape
    return t.reshape((-1,) + tail)[idx]


def put_rows(t: Optional[torch.Tensor], lead: torch.Size, idx: torch.Tensor) -> Optional[torch.Tensor]:
    """The per-row output ``t`` ``[M, ...]`` back at its rows of a zero ``[*lead, ...]`` (differentiable)."""
    if t is None:
        return None
    tail = tuple(t.shape[1:])
    out = torch.zeros((lead.numel(),) + tail, dtype=t.dtype, device=t.device)
    return out.index_copy(0, idx, t).view(tuple(lead) + tail)


def take_keep(keep, lead: torch.Size, idx: torch.Tensor):
    """Sampling replay's kept sets at the flat rows ``idx``: a dense ``[..., V_local]`` mask by rows; a
    ``(token_ids, offsets)`` pair (or an object with ``.token_ids``, ``.offsets``) re-packed for the
    selected rows (one host sync for the selected ids' count). Anything else passes to the op's check."""
    if keep is None or isinstance(keep, torch.Tensor):
        return take_rows(keep, lead, idx)
    ids, offsets = (keep.token_ids, keep.offsets) if hasattr(keep, "token_ids") else (
        keep if isinstance(keep, (tuple, list)) and len(keep) == 2 else (None, None))
    if not (isinstance(ids, torch.Tensor) and isinstance(offsets, torch.Tensor) and offsets.dim() == 1
            and offsets.numel() == lead.numel() + 1 and ids.dim() == 1):
        return keep
    offsets = offsets.to(torch.int64)
    if bool((offsets.diff() < 0).any()) or int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
        raise ValueError(f"keep's offsets must start at 0, never decrease, and end at len(token_ids) = {ids.numel()}")
    starts, lengths = offsets[:-1][idx], (offsets[1:] - offsets[:-1])[idx]
    new_offsets = torch.cat([offsets.new_zeros(1), lengths.cumsum(0)])
    total = int(new_offsets[-1])  # the one host sync
    pos = (torch.arange(total, device=ids.device)
           + torch.repeat_interleave(starts - new_offsets[:-1], lengths, output_size=total))
    return ids[pos], new_offsets
