"""Sampling replay: the rollout's kept sets (top-k / top-p), without a ``[tokens, V]`` mask.

Layer: per-token inputs (with :mod:`chunked_entropy._inputs`). A
rollout sampled with top-k and/or top-p draws each token from the softmax
renormalized over a *kept set*; replaying it, the trainer's log-prob of the
token is taken over the same set:

    log_prob = y_label - log sum_{j in K'} exp(y_j)        K' = K ∪ {label}

The label always counts as kept (the result is finite even where float
rounding on the trainer's side would have excluded it); a row whose recorded
set is empty is not truncated (prompt tokens, rows sampled without
truncation); a repeated id counts once. The entropy and ``sum_j p_j**2`` stay
of the whole row unless ``entropy_of="kept"``.

**The row's own filter.** ``keep={"top_k": k, "top_p": p}`` builds the
kept sets from the trainer's own logits instead (vLLM's sampler filter as
NeMo-RL replays it, ``apply_top_k_top_p``): on the transformed logits ``x``
(temperature included) the ``k`` largest (ties at the ``k``-th kept), then,
over the softmax of those, the smallest set of the largest whose cumulative
probability (summed in ascending order) exceeds ``1 - p``, the largest always
kept. Here the label is *not* added: a label outside its row's set gets log-prob
``-inf`` and no term of its own in the gradient (``-p^K_j`` on the kept ids
only). The sets are computed once per call, ``FILTER_ROWS`` full rows at a
time (under a process group each rank all-gathers those rows' shards), so a
transient ``[rows, V]`` sort instead of a ``[tokens, V]`` mask.

**Representation.** Once per call the kept sets become *entries*, pairs
``(row, id)`` sorted by row: the recorded ids and one entry per valid label,
with repeats marked dead rather than removed (so that no size depends on the
data beyond one host read of the chunk boundaries). Each rank keeps the
columns of its vocabulary shard. A dense mask's row that holds the whole
vocabulary (on every shard) is read as not truncated and adds no entries.
Memory: two int64 and two flags (18 bytes) per entry, held through the call;
while they are built, a peak of about 46 bytes per kept id for a CSR pair
(about 64 for a dense mask, whose list of True positions comes first),
measured by ``benchmarks/keep_memory.py``.

**Statistics.** In each block of the chunk loop the entries that fall in it
are gathered from the raw logits (before the block is overwritten) and
reduced per row to the same :class:`~chunked_entropy._stats.BlockStats` as the
whole row, relative to the kept set's own maximum, plus the count of recorded
ids; they merge over blocks and ranks exactly like the whole row's (and in
the same two collectives). A row is truncated where the count is not 0.

**Gradient.** With ``p^K_j = exp(y_j - m_K - log s_K)`` on the kept set:

    d log_prob / dx_j = [j == label] - p^K_j          (j in K', else 0)

so on truncated rows the log-prob's term of the dense per-block gradient is
dropped (its coefficient set to 0) and :func:`add_grad_` adds this sparse term
at the entries; likewise the entropy's and ``sum p**2``'s with
``entropy_of="kept"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from ._checks import check_device, float_bits, is_finite_real, value_repr
from ._stats import ENTROPY_OF, NEG_FLOOR, BlockStats, Coefficients, RowStats, Transform
from .parallel import all_reduce_min_flags, fingerprint

#: What the ranks of a group agree on: the form of ``keep`` (they exchange statistics of it).
FORMS = {None: 0, "csr": 1, "dense": 2, "filter": 3}
#: The keys of ``keep`` as the row's own filter.
FILTER_KEYS = ("top_k", "top_p")
#: Elements of one transient ``[rows, V]`` block of the row's own filter (about 26 bytes each at the peak).
FILTER_ELEMENTS = 1 << 24


@dataclass(eq=False)
class Kept:
    """A call's kept sets, as entries sorted by row (see the module doc).

    ``row``: the entry's row; ``col``: its column in this rank's shard, or -1
    (on another shard, a repeat, or no label); ``counted``: a recorded id, the
    first of its repeats, on this shard; ``is_label``: the row's label. The
    entries are filled in once the call's checks passed and it is agreed (a
    dense mask's need a collective under a group; a bad id, offset or label
    would index out of range before), before the chunk loop reads them.
    """

    entropy_of: str
    form: str
    row: Optional[torch.Tensor] = None
    col: Optional[torch.Tensor] = None
    counted: Optional[torch.Tensor] = None
    is_label: Optional[torch.Tensor] = None
    #: the row's own filter: bool ``[n]``, a valid label outside its row's kept set (log-prob ``-inf``)
    label_out: Optional[torch.Tensor] = None
    _bounds: dict = field(default_factory=dict)

    def fill(self, row, col, counted, is_label, label_out=None) -> "Kept":
        self.row, self.col, self.counted, self.is_label = row, col, counted, is_label
        self.label_out = label_out
        return self

    @property
    def of_kept(self) -> bool:
        return self.entropy_of == "kept"

    def bounds(self, n: int, chunk_size: int) -> list:
        """The first entry of each chunk's rows (one host read per call and chunk size)."""
        if chunk_size not in self._bounds:
            starts = torch.arange(0, n + chunk_size, chunk_size, device=self.row.device).clamp_(max=n)
            self._bounds[chunk_size] = torch.searchsorted(self.row, starts).tolist()
        return self._bounds[chunk_size]

    def chunk(self, a: int, b: int, n: int, chunk_size: int) -> "Entries":
        """The entries of rows ``[a, b)`` (``a`` a chunk boundary), rows made relative to ``a``."""
        i = a // chunk_size
        lo, hi = self.bounds(n, chunk_size)[i:i + 2]
        return Entries(self.row[lo:hi] - a, self.col[lo:hi], self.counted[lo:hi], self.is_label[lo:hi])


class Entries(NamedTuple):
    """A chunk's entries (see :class:`Kept`), rows relative to the chunk."""

    row: torch.Tensor
    col: torch.Tensor
    counted: torch.Tensor
    is_label: torch.Tensor


# ----------------------------------------------------------------------------- parsing


def _as_ids(name: str, value, device) -> torch.Tensor:
    if isinstance(value, (list, tuple)):
        value = torch.as_tensor(value, dtype=torch.int64, device=device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    check_device(name, value, device)
    return value.to(torch.int64)


def _parse_filter(keep: dict, v_global: int) -> tuple:
    """``(top_k, top_p)`` of ``keep`` as the row's own filter, checked; ``top_k`` None or ``<= 0`` and ``top_p``
    1.0 disable each (NeMo-RL's and vLLM's convention); a ``top_k`` of ``V`` or more keeps every id."""
    extra = sorted(set(keep) - set(FILTER_KEYS), key=str)
    if extra or not keep:
        raise ValueError("keep as the row's own filter takes the keys 'top_k' and/or 'top_p', got "
                         f"{sorted(keep, key=str)}")
    top_k, top_p = keep.get("top_k"), keep.get("top_p", 1.0)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise TypeError(f"keep's top_k must be an int or None, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not is_finite_real(top_p) \
            or not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"keep's top_p must be a float in (0, 1], got {value_repr(top_p)}")
    top_k = None if top_k is None or top_k <= 0 or top_k >= v_global else int(top_k)
    return top_k, (None if float(top_p) == 1.0 else float(top_p))


@torch.no_grad()
def filter_mask(x: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """The kept ids of full rows ``x`` ``[rows, V]`` (transformed logits) as a bool mask: vLLM's top-k then
    top-p, in NeMo-RL's arithmetic (``apply_top_k_top_p``), which the module doc states. ``x`` is not written."""
    if top_p is None:  # top-k only: no sort of the row
        return x >= x.topk(top_k, dim=-1).values[:, -1:]
    s, idx = x.sort(dim=-1)  # ascending
    by_k = None
    if top_k is not None:
        by_k = s >= s[:, s.shape[1] - top_k].unsqueeze(1)
        s.masked_fill_(~by_k, -math.inf)
    keep = s.softmax(dim=-1).cumsum_(dim=-1) > 1 - top_p
    keep[:, -1] = True
    if by_k is not None:
        keep &= by_k
    return torch.empty_like(keep).scatter_(1, idx, keep)


def _filter_keys(rows, top_k, top_p, n: int, v_local: int, scale, call) -> torch.Tensor:
    """Keys (see :func:`_record_keys_`) of the row's own filter's kept ids, plus room for the labels.

    ``rows(a, b)`` reads rows ``[a, b)`` of the raw logits; ``scale`` is
    ``(transform, k_rows, dtype)`` with ``k_rows(a, b)`` the multiplier ``x = k * u``
    and ``dtype`` the compute dtype. Under a group each rank gathers the same
    full rows and gets the same keys.
    """
    tf, k_rows, dtype = scale
    v_global = v_local * call.world
    step = max(1, min(n, FILTER_ELEMENTS // v_global))
    pieces = []
    for a in range(0, n, step):
        b = min(a + step, n)
        x = tf.to_u_(rows(a, b).to(dtype, copy=True))
        if call.world > 1:
            parts = [torch.empty_like(x) for _ in range(call.world)]
            torch.distributed.all_gather(parts, x.contiguous(), group=call.group)
            x = torch.cat(parts, dim=1)
            del parts
        k = k_rows(a, b)
        if k is not None:
            x.mul_(k)
        nz = filter_mask(x, top_k, top_p).nonzero()
        del x
        key = torch.empty(nz.shape[0], dtype=torch.int64, device=nz.device)
        torch.mul(nz[:, 0] + a, v_global + 1, out=key)
        pieces.append(key.add_(nz[:, 1]).add_(1))
        del nz
    pieces.append(torch.empty(n, dtype=torch.int64, device=rows.t.device))
    return torch.cat(pieces)


def parse_keep(keep, *, lead_shape, v_local: int, labels: torch.Tensor, valid: torch.Tensor, entropy_of,
               device, call, rows=None, scale=None) -> Optional[Kept]:
    """``keep`` (a ``(token_ids, offsets)`` pair, an object with ``.token_ids`` and ``.offsets``, a bool
    ``[..., V_local]`` mask, or a ``{"top_k", "top_p"}`` dict: the row's own filter) as :class:`Kept`,
    checked; None when ``keep`` is None (or a filter that keeps every id).

    ``labels`` and ``valid`` are the flat global labels and whether each
    counts. ``rows`` (a :class:`~chunked_entropy._inputs.Rows` of the raw
    logits) and ``scale`` (``(transform, k_rows, dtype)``) serve the row's own
    filter; None where the op has no logits (the fused linear head). Runs
    inside the op's :func:`~chunked_entropy.parallel.agreed_call`.
    """
    if entropy_of not in ENTROPY_OF:
        raise ValueError(f"entropy_of must be 'full' or 'kept', got {entropy_of!r}")
    n = labels.numel()
    if isinstance(keep, dict):
        top_k, top_p = _parse_filter(keep, v_local * call.world)
        if rows is None:
            raise TypeError("keep as the row's own filter ({'top_k', 'top_p'}) needs the logits: only "
                            "log_probs_and_entropy takes it; here pass the kept sets themselves")
        if top_k is None and top_p is None:
            keep = None  # keeps every id: the whole row
        else:
            call.agree("keep (0: none, 1: token_ids/offsets, 2: a dense mask, 3: the row's own filter)",
                       FORMS["filter"])
            call.agree("keep's top_k (-1: none)", -1 if top_k is None else top_k)
            call.agree("keep's top_p (bits)", -1 if top_p is None else float_bits(top_p))
            call.agree("entropy_of (0: full, 1: kept)", ENTROPY_OF.index(entropy_of))
            kept = Kept(entropy_of, "filter")

            def filter_entries():  # once every rank passed its checks: under a group, all-gathers of rows' shards
                key = _filter_keys(rows, top_k, top_p, n, v_local, scale, call)
                kept.fill(*_entries(key, labels, valid, v_local, v_local * call.world, call.rank, label_kept=False))

            call.then(filter_entries)
            return kept
    if keep is None:
        if entropy_of != "full":
            raise ValueError("entropy_of='kept' needs keep= (the kept sets)")
        call.agree("keep (0: none, 1: token_ids/offsets, 2: a dense mask, 3: the row's own filter)", 0)
        return None
    v_global = v_local * call.world
    if isinstance(keep, torch.Tensor):
        if keep.dtype != torch.bool:
            raise TypeError(f"keep as a dense mask must be a bool tensor, got {keep.dtype}")
        want = tuple(lead_shape) + (v_local,)
        if tuple(keep.shape) != want:
            raise ValueError(
                f"keep as a dense mask must be [..., V_local] = {want} (the labels' shape and this rank's "
                f"vocabulary shard), got {tuple(keep.shape)}"
            )
        check_device("keep", keep, device)
        mask = keep.reshape(n, v_local)
        whole_here = mask.all(dim=1)  # rows that keep this whole shard: one read of the mask
        kept = Kept(entropy_of, "dense")
        call.agree("keep (0: none, 1: token_ids/offsets, 2: a dense mask, 3: the row's own filter)", FORMS["dense"])
        call.agree("entropy_of (0: full, 1: kept)", ENTROPY_OF.index(entropy_of))

        def dense_entries():  # once every rank passed its checks: under a group, one all-reduce of [n] flags
            # A row whose mask holds the whole vocabulary (on every shard) is not truncated: no entries, so that
            # the cost follows the kept ids of truncated rows, not the mask's True count (slime leaves rows
            # without a recorded nucleus all True).
            truncated = ~all_reduce_min_flags(whole_here, call.group)
            rows = truncated.nonzero().squeeze(1)  # one host sync
            # the mask's ids (another sync); where some rows are whole, first a copy of the others' mask rows
            nz = (mask if rows.numel() == n else mask.index_select(0, rows)).nonzero()
            key = _new_keys(nz.shape[0], n, device)
            _record_keys_(key, rows[nz[:, 0]], nz[:, 1], v_global, call.rank * v_local)
            del rows, nz
            kept.fill(*_entries(key, labels, valid, v_local, v_global, call.rank))

        call.then(dense_entries)
        return kept
    if isinstance(keep, (tuple, list)) and len(keep) == 2:
        token_ids, offsets = keep
    elif hasattr(keep, "token_ids") and hasattr(keep, "offsets"):
        token_ids, offsets = keep.token_ids, keep.offsets
    else:
        raise TypeError(
            "keep must be a (token_ids, offsets) pair, an object with .token_ids and .offsets (vLLM's "
            f"SamplingMask), or a bool [..., V_local] tensor; got {type(keep).__name__}"
        )
    ids = _as_ids("keep's token_ids", token_ids, device)
    offsets = _as_ids("keep's offsets", offsets, device)
    if offsets.numel() != n + 1:
        raise ValueError(
            f"keep's offsets must have n_tokens + 1 = {n + 1} entries (the tokens in the order of the "
            f"flattened labels), got {offsets.numel()}"
        )
    counts = offsets.diff()
    call.require((offsets[0] == 0) & (offsets[-1] == ids.numel()) & (counts >= 0).all(),
                 f"keep's offsets must start at 0, never decrease, and end at len(token_ids) = {ids.numel()}")
    call.require(((ids >= 0) & (ids < v_global)).all(),
                 f"keep's token_ids must be vocabulary ids in [0, {v_global})")
    if call.world > 1:
        call.agree("keep's token_ids", fingerprint(ids))
        call.agree("keep's offsets", fingerprint(offsets))
    call.agree("keep (0: none, 1: token_ids/offsets, 2: a dense mask, 3: the row's own filter)", FORMS["csr"])
    call.agree("entropy_of (0: full, 1: kept)", ENTROPY_OF.index(entropy_of))
    kept = Kept(entropy_of, "csr")

    def csr_entries():  # once the checks passed: ids, offsets and labels index here (a bad one would assert)
        key = _new_keys(ids.numel(), n, device)
        row = torch.repeat_interleave(torch.arange(n, device=device), counts, output_size=ids.numel())
        _record_keys_(key, row, ids, v_global, 0)
        del row
        kept.fill(*_entries(key, labels, valid, v_local, v_global, call.rank))

    call.then(csr_entries)
    return kept


def _new_keys(recorded: int, n: int, device) -> torch.Tensor:
    """Room for one sort key per recorded id and per token (its label)."""
    return torch.empty(recorded + n, dtype=torch.int64, device=device)


def _record_keys_(key: torch.Tensor, row: torch.Tensor, ids: torch.Tensor, v_global: int, shift: int) -> None:
    """Write the recorded ids' keys ``row * (V + 1) + id + 1`` (``id = ids + shift``) into ``key``'s first slots."""
    head = key[: row.numel()]
    torch.mul(row, v_global + 1, out=head)
    head.add_(ids).add_(shift + 1)




def _entries(key, labels, valid, v_local, v_global, rank, label_kept=True) -> tuple:
    """Recorded ids plus one entry per valid label, sorted by row; repeats marked dead (static sizes).

    ``key`` holds ``row * (V + 1) + id + 1`` of the recorded ids in its first
    slots (:func:`_record_keys_`) and room for the labels after them; it is
    consumed. Each key is doubled, plus 1 for a label, so that one sort of
    int64 orders the entries by row, then id, a recorded id before the same
    id added as the label (the survivor of a repeat is counted); row and id
    are read back from the sorted keys, with no gathers by the sort's order.
    Peak: about 40 bytes per entry while sorting; kept: two int64 and two
    flags (18 bytes) per entry. Returns the fields of :class:`Kept`:
    ``(row, col, counted, is_label)``; with ``label_kept=False`` (the row's
    own filter) a label is not added to its row's set, and a fifth field,
    ``label_out``, flags the valid labels outside it.
    """
    n = labels.numel()
    base = v_global + 1
    tail = key[key.numel() - n:]
    torch.mul(torch.arange(n, device=key.device), base, out=tail)
    tail.add_(torch.where(valid, labels, -1) + 1)
    key.mul_(2)
    tail.add_(1)
    key = torch.sort(key)[0]  # the unsorted keys and the sort's indices are freed here
    recorded = (key & 1) == 0
    key.bitwise_right_shift_(1)  # row * (V + 1) + id + 1
    first = torch.ones_like(recorded)
    first[1:] = key[1:] != key[:-1]
    ids = torch.remainder(key, base).sub_(1)  # -1: a row without a label
    row = key.div_(base, rounding_mode="floor")
    is_label = (ids == labels[row]) & valid[row]  # on the survivor of its repeats only, with ``live`` below
    local = ids.sub_(rank * v_local)
    live = first & (local >= 0) & (local < v_local)
    if not label_kept:  # the labels' own entries are dead; whether each label is in its set, on every rank
        live &= recorded
        inside = torch.zeros(n, dtype=torch.bool, device=key.device)
        inside[row[first & recorded & is_label]] = True
        col = torch.where(live, local, -1)
        return row, col, live, live & is_label, valid & ~inside
    col = torch.where(live, local, -1)
    return row, col, live & recorded, live & is_label


# ----------------------------------------------------------------------------- per block


class Gathered(NamedTuple):
    """The chunk's entries that fall in one block, with their ``u`` (transformed logits)."""

    inside: torch.Tensor  # bool per entry
    row: torch.Tensor  # the entry's row in the chunk
    col: torch.Tensor  # its column in the block (clamped where not inside)
    u: torch.Tensor  # transformed logit (-inf where not inside)


def gather(z: torch.Tensor, entries: Entries, v0: int, tf: Transform, dtype) -> Gathered:
    """Read the entries of a block of raw logits ``z`` (rows of the chunk, columns ``[v0, v0 + width)``).

    Must run before the block is overwritten; reads ``z`` only.
    """
    width = z.shape[1]
    inside = (entries.col >= v0) & (entries.col < v0 + width)
    col = (entries.col - v0).clamp_(0, width - 1)
    u = tf.to_u_(z[entries.row, col].to(dtype))  # advanced indexing: a new tensor of the entries, any strides
    return Gathered(inside, entries.row, col, torch.where(inside, u, -math.inf))


def _per_row(k, rows: torch.Tensor):
    """The multiplier ``k`` (None, a float, or an ``[n, 1]`` column) at each entry's row."""
    return k[rows, 0] if isinstance(k, torch.Tensor) else (1.0 if k is None else k)


def block_stats(g: Gathered, entries: Entries, n_rows: int, k, dtype) -> tuple:
    """``(BlockStats, count)`` of the kept entries of one block; ``zl`` the label's ``u`` where its entry is in
    the block (0 elsewhere), formed as the other entries' are (:func:`gather`), not taken from the kernels' own
    ``tanh`` (an ulp apart now and then, which ``k`` magnifies: a kept label's log-prob came out above 0)."""
    device = g.u.device
    zeros = lambda: torch.zeros(n_rows, dtype=dtype, device=device)  # noqa: E731
    m = torch.full((n_rows,), -math.inf, dtype=dtype, device=device).scatter_reduce_(0, g.row, g.u, "amax")
    mr = m[g.row]
    finite = g.inside & (mr > -math.inf)  # where the row's kept entries here are all -inf, -inf - (-inf) is NaN
    y = torch.where(finite, (g.u - torch.where(finite, mr, 0.0)) * _per_row(k, g.row), NEG_FLOOR).clamp_(min=NEG_FLOOR)
    e = torch.exp(y)
    top = g.inside & (y == 0)
    ones = zeros().index_add_(0, g.row, top.to(dtype))
    rest = zeros().index_add_(0, g.row, torch.where(top, 0.0, e))
    w = zeros().index_add_(0, g.row, e * y)
    q = zeros().index_add_(0, g.row, e * e)
    count = zeros().index_add_(0, g.row, (g.inside & entries.counted).to(dtype))
    zl = zeros().index_add_(0, g.row, torch.where(g.inside & entries.is_label, g.u, 0.0))
    return BlockStats(m, ones, rest, w, q, zl), count


def split(co: Coefficients, truncated: torch.Tensor, of_kept: bool) -> tuple:
    """``(dense, sparse)`` coefficients: the log-prob's (and, ``of_kept``, the entropy's and ``sum p**2``'s)
    move to the sparse term on truncated rows."""
    def part(t, moves):
        if t is None or not moves:
            return t, None
        return torch.where(truncated, 0.0, t), torch.where(truncated, t, 0.0)

    (c, c_k), (b, b_k), (a, a_k) = part(co.c, True), part(co.b, of_kept), part(co.a, of_kept)
    return Coefficients(c, b, a), Coefficients(c_k, b_k, a_k)


def add_grad_(grad: torch.Tensor, g: Gathered, entries: Entries, kept: RowStats, truncated: torch.Tensor,
              co: Coefficients, tf: Transform, k) -> torch.Tensor:
    """Add the kept sets' term of the gradient w.r.t. a block's raw logits into ``grad`` (see the module doc).

    ``kept`` and ``truncated`` are the chunk's rows; ``co`` the sparse
    coefficients of :func:`split` (0 on rows that are not truncated).
    """
    if co.c is None and co.b is None and co.a is None:
        return grad
    r = g.row
    # only truncated rows have kept statistics (the others' maximum is -inf: their arithmetic would be NaN)
    on = g.inside & truncated[r] & (g.u > -math.inf)
    zero = torch.zeros((), dtype=g.u.dtype, device=g.u.device)
    pick = lambda t: torch.where(on, t[r], zero)  # noqa: E731
    y = torch.where(on, (g.u - pick(kept.m)) * _per_row(k, r), zero)
    p = torch.where(on, torch.exp(y - pick(kept.ls)), zero)
    inner = torch.zeros_like(p)
    if co.c is not None:
        inner -= co.c[r]
    if co.b is not None:
        inner += co.b[r] * (pick(kept.ws) - y)
    if co.a is not None:
        inner += co.a[r] * (p - pick(kept.s2))
    val = p * inner
    if co.c is not None:
        val = val + torch.where(entries.is_label & g.inside & truncated[r], co.c[r], zero)
    if tf.softcap is not None:  # the cap's derivative 1 - u**2 at each entry
        val = val * (1.0 - torch.where(on, g.u, zero) ** 2)
    grad.index_put_((r, g.col), torch.where(g.inside, val, zero).to(grad.dtype), accumulate=True)
    return grad
