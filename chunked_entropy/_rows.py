"""Only the rows that are read: ``rows=`` on the hidden-state (and logits) entry points.

Layer: per-token inputs (beside :mod:`chunked_entropy._inputs`; imports only
``parallel``, the plain checks and ``_autograd``): what every op does with ``rows`` before its own
preparation, and the :class:`Selection` that rides in it: what this rank alone checks of ``rows`` is
checked here, the rest (entries in range, the ranks' ``rows`` and layout) joins the op's own agreed call,
one exchange for both, and the selected rows are filled once it passes.

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
import zlib
from typing import Optional

import torch

from ._autograd import once_differentiable
from ._checks import check_device, check_strided, is_int
from .parallel import all_gather_dim0, fingerprint, group_rank_size

__all__ = ["KEPT", "Selection", "check_full_shape", "check_per_row", "kept_rows", "parse_kept", "put_rows",
           "select_logit_rows", "select_rows", "take_keep", "take_rows"]

KEPT = "kept"


def _check_index(rows, device: torch.device) -> torch.Tensor:
    """``rows``' own checks on this rank (an integer tensor of at least one dimension on ``device``); its flat
    int64 copy. Its entries are checked in the op's agreed call (:meth:`Selection.agree`)."""
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
    if rows.dim() == 0:
        raise ValueError("rows must have at least one dimension ([M] row indices), got a 0-d tensor")
    return rows.reshape(-1).to(torch.int64)


def _shape_field(shape) -> tuple:
    """A shape as one agreed value whatever its length (its CRC; the ranks' shapes shown where they differ),
    so that shapes of another length are named as the differing argument, not as "different calls"."""
    shape = tuple(int(s) for s in shape)
    return zlib.crc32(repr(shape).encode()) & 0x7FFFFFFF, repr(shape)


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
    """The selected rows ``[*lead, H]`` of ``hidden``, allocated here and filled by :meth:`Selection.fill` once
    every rank agreed on the call (the sequence-parallel gather is a collective, and the index is checked in
    that agreement). Backward: ``index_add_`` of the rows' gradients into zeros (each repeat adds; an
    unselected row stays exactly 0), this rank's slice under sequence parallelism (the op on the selected rows
    already summed their gradient over the group)."""

    @staticmethod
    def forward(ctx, hidden, flat, lead, world, rank):
        ctx.save_for_backward(flat)
        ctx.full_shape = (hidden.shape[0] * world,) + tuple(hidden.shape[1:])
        ctx.local_rows, ctx.rank = hidden.shape[0], rank
        return hidden.new_empty(tuple(lead) + (hidden.shape[-1],))

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
        return grad, None, None, None, None


def _gather_rows(full: torch.Tensor, flat: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (``[M, H]``, ours) <- ``full``'s token rows at ``flat``: written in place, no temporary where
    ``full`` views as ``[tokens, H]``."""
    try:
        rows = full.view(-1, full.shape[-1])
    except RuntimeError:  # a strided view (a transposed [B, S, H]): index it without copying it whole
        out.copy_(full[torch.unravel_index(flat, full.shape[:-1])])
        return
    torch.index_select(rows, 0, flat, out=out)


class Selection:
    """``rows=`` of one call, checked on this rank by :func:`select_rows`; what is left joins the op's own
    agreed call (:meth:`agree`, one exchange for the rows and the op), and the selected rows are filled once
    every rank passed it (:meth:`fill`): a rank's bad ``rows`` is refused on every rank together before any
    collective of the selection (the sequence-parallel gathers) is made."""

    def __init__(self, rows, flat, source, out, *, name: str, layer_name: str, sequence_parallel: bool, group,
                 world: int, require=None):
        self.rows, self.flat, self.name, self.layer_name = rows, flat, name, layer_name
        self.sequence_parallel, self.group, self.world, self.require = sequence_parallel, group, world, require
        self.n_rows = source.shape[:-1].numel() * (world if sequence_parallel else 1)
        self.lead = tuple(source.shape[:-1])
        self.fills = [(source, out)]  # (this rank's tensor, its selected rows): the source first
        self.finite = None  # (name, tensor): a teacher whose selected rows must be finite
        self.agreed = False

    def also(self, name: str, source: torch.Tensor) -> torch.Tensor:
        """A second tensor of the same token rows (a divergence's teacher hidden states), selected at the same
        rows when the call is agreed, without gradient (the teacher's): its selected rows, to fill. Its rows
        must be finite (checked on each rank's own rows, in the agreement): ``name`` names it."""
        if source.dim() < 2 or tuple(source.shape[:-1]) != self.lead:
            raise ValueError(f"{name} must have the leading shape of {self.name}, {self.lead} (the same tokens), got "
                             f"{tuple(source.shape)}")
        out = source.new_empty(tuple(self.rows.shape) + (source.shape[-1],))
        self.fills.append((source.detach(), out))
        self.finite = (name, source)
        return out

    def holds(self, t) -> bool:
        """Whether ``t`` is one of the selected rows this call fills once agreed (not to be read before)."""
        return any(t is out for _, out in self.fills)

    def agree(self, call) -> None:
        """Record the rows' checks in the op's agreed ``call`` (before its own): the layout, the source's token
        rows, every entry in range, ``rows``' shape and digest, a ``("kept", count)``'s count, a selected
        teacher row's finiteness; the rows are filled when the call is agreed (:meth:`CallCheck.then`,
        before the op's own deferred work, which may read them)."""
        sp, flat = self.sequence_parallel, self.flat
        # The layout decides the collectives of the fill (the gather of the sequence-parallel slices).
        call.agree(f"{self.layer_name}.sequence_parallel (with rows=: the rows gathered from the ranks' slices)",
                   int(sp), shown=repr(sp))  # a name of its own: the op agrees on its layer, without it, too
        crc, shown = _shape_field(self.lead)
        call.agree(f"{self.name}'s token rows (its leading shape; under sequence parallelism, this rank's slice)",
                   crc, shown=shown)
        if flat.numel():
            n_rows, device = self.n_rows, flat.device
            bad = (flat < 0) | (flat >= n_rows)
            expected = f"rows must index the {n_rows} token rows of the input: every entry in [0, {n_rows})"

            def where_bad():  # on the CPU only: the first bad entry, at no cost when there is none
                i = int(bad.nonzero()[0, 0])
                return f"{expected}; found {int(flat[i])} at position {i}"

            call.require(~bad.any(), where_bad if device.type == "cpu" else expected)
        call.agree("rows (its number of dimensions)", self.rows.dim())
        crc, shown = _shape_field(self.rows.shape)
        call.agree("rows (its shape)", crc, shown=shown)
        if call.world > 1:
            call.agree("rows (a digest of its entries)", fingerprint(flat))
        if self.require is not None:
            call.require(*self.require)
        if self.finite is not None:
            name, t = self.finite
            call.require(_selected_rows_finite(t, flat, call.rank if sp else 0),
                         f"{name} must be finite (no NaN or inf): a teacher's NaN would poison every divergence")
        call.then(self.fill)
        self.agreed = True

    def fill(self) -> None:
        """The selected rows, once the call is agreed: each tensor's rows gathered over the group under sequence
        parallelism (one all-gather each, in the same order on every rank), then indexed into its selected
        rows (one ``[M, H]`` copy, written in place)."""
        gather = self.sequence_parallel and self.world > 1
        with torch.no_grad():
            for source, out in self.fills:
                full = all_gather_dim0(source.detach(), self.group) if gather else source.detach()
                _gather_rows(full, self.flat, out.detach().view(-1, out.shape[-1]))


def _selected_rows_finite(t: torch.Tensor, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """Whether this rank's rows of ``t`` that ``flat`` selects (rows ``[rank * n, (rank + 1) * n)`` of the
    gathered sequence, ``n`` this rank's) hold no NaN or inf: a 0-d bool tensor, no host sync. One per-row
    min-max reduction (two ``[n]`` vectors), no temporary of ``t``'s size."""
    n = t.shape[:-1].numel()
    if n == 0 or flat.numel() == 0 or t.shape[-1] == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t.detach().reshape(n, t.shape[-1]), dim=-1)
    ok = torch.isfinite(lo) & torch.isfinite(hi)
    pos = flat.to(t.device) - rank * n
    mine = (pos >= 0) & (pos < n)
    return ~(mine & ~ok[pos.clamp(0, n - 1)]).any()


def select_rows(rows, hidden: torch.Tensor, *, process_group=None, sequence_parallel: bool = False,
                name: str = "hidden", tails=("log_probs_at", "keep"), require=None, layer_name: str = "layer",
                **per_row) -> tuple:
    """``(selected, selection)``: ``hidden``'s rows at ``rows`` (``[*rows.shape, H]``, filled once the call is
    agreed) and the :class:`Selection` whose :meth:`~Selection.agree` the op's agreed call records; the op then
    runs on them without sequence parallelism.

    Checks here, on this rank (naming ``rows``; a caller under a process group wraps them in
    :func:`~chunked_entropy.parallel.refused_together`): ``hidden`` a ``[..., H]`` tensor, ``rows`` an integer
    tensor of at least one dimension on ``hidden``'s device, every per-row input in ``per_row``
    (``name=tensor``) of shape ``rows.shape`` (those named in ``tails``: ``[*rows.shape, K]``). In the op's
    agreed call (:meth:`Selection.agree`): every entry in range, ``require`` (``(ok, message)`` from
    :func:`kept_rows`, or None), and under a process group every rank's ``rows`` shape and digest, its
    ``sequence_parallel`` (the gather, named as ``layer_name``'s field) and its token rows.
    Memory: one ``[M, H]`` tensor of the selected rows (plus the ``[S, B, H]`` gather under sequence
    parallelism, once the call is agreed); backward a ``[tokens, H]`` gradient, zero but on the selected rows.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        raise ValueError(f"with rows=, {name} must be a [..., H] tensor of token rows, got "
                         f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
    rank, world = group_rank_size(process_group)
    flat = _check_index(rows, hidden.device)
    check_per_row(rows, tails, **per_row)
    sp = bool(sequence_parallel)
    out = _SelectRows.apply(hidden, flat, tuple(rows.shape), world if sp else 1, rank if sp else 0)
    return out, Selection(rows, flat, hidden, out, name=name, layer_name=layer_name, sequence_parallel=sp,
                          group=process_group, world=world, require=require)


def select_logit_rows(rows, logits, process_group, *, name: str = "logits", **per_row) -> tuple:
    """:func:`select_rows` for the ops from logits: an index only (their logits exist already; ``"kept"``
    is for the ops over hidden states)."""
    if isinstance(rows, (str, tuple)):
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
