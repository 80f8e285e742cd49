"""Process groups and collectives: every communication of the library lives here.

Also the process groups an autograd graph holds weakly (:func:`weak_group`, :func:`live_group`).

Vocabulary parallelism follows Megatron: with a group of size ``P``, rank ``r``
holds global vocabulary ids ``[r * V_local, (r + 1) * V_local)``. Sequence
parallelism follows Megatron too: the hidden states are split along dim 0.

Forward statistics need exactly two all-reduces per chunk (a MAX of the row
maxima, then one SUM of the stacked rescaled sums); backward of the logits
path needs none.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ._checks import Requirements, check_summary, collecting
from ._stats import BlockStats, rescale, rescale_cross

# torch 2.13 renamed the single-tensor collectives (the old names warn on every call).


def _all_gather_single(out, t, group):
    """``torch.distributed``'s one-tensor all-gather (looked up at each call: a wrapper around the group's
    collectives, e.g. a test's count, sees it)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t, group=group)


def _reduce_scatter_single(out, t, op, group):
    """``torch.distributed``'s one-tensor reduce-scatter, looked up at each call."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, t, op=op, group=group)


def group_rank_size(group) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group``; ``(0, 1)`` for None.

    Raises a clear error when the group cannot be used by this process:
    torch.distributed is not initialized, ``group`` is not a process group,
    or this process is not one of its members.
    """
    if group is None:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "process_group was given but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first, or pass process_group=None"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() returns on the ranks it leaves out
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of process_group "
            "(torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here); pass the "
            "tensor-parallel group this rank belongs to"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of process_group (its global ranks: "
            f"{dist.get_process_group_ranks(group)}); pass the tensor-parallel group this rank belongs to"
        )
    return rank, dist.get_world_size(group)


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


def _active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def reduce_stats(st: BlockStats, group, k, kept: Optional[BlockStats] = None, count=None):
    """Merge per-shard statistics over ``group``: one MAX, then one SUM all-reduce.

    ``k`` is the rows' multiplier ``x = k * u`` (see :mod:`chunked_entropy._stats`).
    With sampling replay, ``kept`` (the statistics of the rows' kept sets, see
    :mod:`chunked_entropy._keep`) and ``count`` (their recorded ids) travel in
    the same two collectives. Returns ``(st, kept, count)``.
    """
    if not _active(group):
        return st, kept, count
    m = st.m if kept is None else torch.stack([st.m, kept.m])
    m = m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    st = rescale(st, m if kept is None else m[0], k)
    parts = [st.ones, st.rest, st.zl] + [t for t in (st.w, st.q) if t is not None]
    if kept is not None:
        kept = rescale(kept, m[1], k)
        parts += [kept.ones, kept.rest, kept.w, kept.q, kept.zl, count]
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    it = iter(packed[3:])
    w = None if st.w is None else next(it)
    q = None if st.q is None else next(it)
    out = BlockStats(m if kept is None else m[0], packed[0], packed[1], w, q, packed[2])
    if kept is not None:
        kept = BlockStats(m[1], next(it), next(it), next(it), next(it), next(it))
        count = next(it)
    return out, kept, count


def reduce_stats_pair(st: BlockStats, st_t: BlockStats, group, k, k_t, cross=None, kept: Optional[BlockStats] = None,
                      count=None):
    """Merge two heads' per-shard statistics of the same rows (a divergence's student and teacher) over
    ``group`` with the same arithmetic: one MAX all-reduce of both maxima, then one all-gather of both
    rescaled sums, added in rank order on every rank. Returns ``(st, st_t)``.

    An all-reduce's order of addition may depend on where an element sits and on the tensor's size
    (gloo's ring over three ranks adds each segment starting from another rank), so two heads with
    equal logits would get log-sum-exps an ulp apart, and a teacher equal to the student a divergence
    of 1e-7. Here an element's sum depends on its values only. Two collectives per chunk for both
    heads (four as two :func:`reduce_stats`); the gather moves ``world`` times the sums' few floats per row.

    ``cross``: ``(c, teacher_weighs)``, a KL's cross sum folded online (see
    :func:`~chunked_entropy._stats.rescale_cross`; head ``a`` the teacher when ``teacher_weighs``, else the
    student), rescaled to the merged maxima and summed in the same gather. Returns ``(st, st_t)``, or
    ``(st, st_t, c)`` with ``cross``.

    ``kept``, ``count``: the statistics of the student's kept sets (sampling replay, see
    :mod:`chunked_entropy._keep`) and their recorded ids, merged in the same two collectives (as
    :func:`reduce_stats` merges them); then ``(kept, count)`` is appended to what is returned.
    """
    if not _active(group):
        out = (st, st_t) if cross is None else (st, st_t, cross[0])
        return out if kept is None else out + (kept, count)
    m = torch.stack([st.m, st_t.m] if kept is None else [st.m, st_t.m, kept.m])
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    c = None
    if cross is not None:
        c, teacher_weighs = cross
        c = (rescale_cross(c, st_t, st, m[1], m[0], k_t, k) if teacher_weighs
             else rescale_cross(c, st, st_t, m[0], m[1], k, k_t))
    st, st_t = rescale(st, m[0], k), rescale(st_t, m[1], k_t)
    extra = [t for t in (st.w, st.q, st_t.w, st_t.q, c) if t is not None]
    if kept is not None:
        kept = rescale(kept, m[2], k)
        extra += [kept.ones, kept.rest, kept.w, kept.q, kept.zl, count]
    packed = torch.stack([st.ones, st.rest, st.zl, st_t.ones, st_t.rest, st_t.zl] + extra)
    world = dist.get_world_size(group)
    every = packed.new_empty((world * packed.shape[0],) + tuple(packed.shape[1:]))
    _all_gather_single(every, packed, group=group)
    every = every.view((world,) + tuple(packed.shape))
    total = every[0].clone()
    for r in range(1, world):  # rank order, the same for every element
        total.add_(every[r])
    it = iter(total[6:])
    pick = lambda t: None if t is None else next(it)  # noqa: E731
    w, q, w_t, q_t = pick(st.w), pick(st.q), pick(st_t.w), pick(st_t.q)
    out = (BlockStats(m[0], total[0], total[1], w, q, total[2]),
           BlockStats(m[1], total[3], total[4], w_t, q_t, total[5]))
    out = out if c is None else out + (pick(c),)
    if kept is None:
        return out
    kept = BlockStats(m[2], next(it), next(it), next(it), next(it), next(it))
    return out + (kept, next(it))


#: Length of the vector every rank sends in the one all-gather of a call's check. Fixed, so that a rank
#: whose arguments were refused early still sends as many numbers as its peers: never a size mismatch.
CHECK_SLOTS = 128


class CallCheck:
    """The checks of one call that every rank of its process group must pass, and agree on.

    Made by :func:`agreed_call`. Inside the ``with`` block the call checks its
    arguments (raising on a bad one, as it would without a group) and records

    - :meth:`require`: a condition computed on the device (e.g. "every label
      is in range"), resolved with the call's other conditions when its
      checks end: one host sync per call (see
      :func:`~chunked_entropy._checks.checks_mode`); under a group, one
      computed on an accelerator joins the all-gather instead;
    - :meth:`agree`: a value every rank must have the same (sizes, options,
      fingerprints of the per-token inputs).
    """

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.requirements = []  # (ok: 0-d bool tensor, message): on an accelerator, under a group of several ranks
        self.local = Requirements()  # the others: resolved on this rank when the checks end
        self.fields = {}  # name -> int, 0-d int64 tensor, or a tuple of those
        self.shown = {}  # name -> a plain value (or a dict of them) to show when the ranks differ there
        self.deferred = []  # work to run once every rank passed: collectives of its own may follow

    def then(self, fn) -> None:
        """Run ``fn()`` when the call is agreed: after the exchange on every rank (at the block's end
        without a group). The place for preparation that needs a collective of its own, which a rank
        refused earlier would never reach."""
        self.deferred.append(fn)

    def require(self, ok: torch.Tensor, message) -> None:
        """``ok`` (a 0-d bool tensor) must hold; ``message`` (a str, or a callable giving one) says what failed.

        Nothing is read on the host here: the call's conditions are resolved together when its checks end
        (see :func:`agreed_call`), so the work between them must not index with a checked value."""
        if self.world == 1 or ok.device.type == "cpu":
            self.local.require(ok, message)
        else:
            self.requirements.append((ok, check_summary(message)))

    def agree(self, name: str, value, shown=None) -> None:
        """Every rank must pass the same ``value`` (an int, a 0-d int64 tensor, or a tuple of them).

        ``shown``: what the error shows of each rank where they differ (a str, or a dict of str of which only
        the differing entries are shown), instead of ``value`` (a fingerprint, a float's bits). Read only on
        failure, with a second collective. A name is agreed once per call: the op's preparation and what joins it
        (a ``rows=`` selection) record into one call, and a second value under a name would leave the first
        unchecked (a bug: raised, on every rank alike)."""
        if self.world > 1:
            if name in self.fields:
                raise RuntimeError(f"chunked_entropy: {name!r} is agreed twice in one call (a bug: the first value "
                                   "would go unchecked; give each field its own name)")
            self.fields[name] = value
            if shown is not None:
                self.shown[name] = shown

    def agree_all(self, fields: dict) -> None:
        """:meth:`agree` on each ``name: value`` of ``fields``."""
        for name, value in fields.items():
            self.agree(name, value)

    # ------------------------------------------------------------------ the exchange

    def _structure(self) -> int:
        """A hash of what is checked: ranks that made different calls (different entry points) differ here."""
        names = [f"{k}:{len(v) if isinstance(v, tuple) else 1}" for k, v in self.fields.items()]
        return zlib.crc32(repr((names, [m for _, m in self.requirements])).encode()) & 0x7FFFFFFF

    def _int64_values(self):
        """``(values, error)``: every agreed value as a 0-d int64 tensor, or the error naming the field whose
        value does not fit (an int of 2**63 or more): this rank's refusal, shared in the exchange instead of
        raised before it (its peers would wait in the all-gather)."""
        out = []
        for name, v in self.fields.items():
            for x in (v if isinstance(v, tuple) else (v,)):
                try:
                    out.append(torch.as_tensor(x, dtype=torch.int64))
                except (OverflowError, RuntimeError, TypeError, ValueError) as e:
                    return [], ValueError(f"{name} must fit in int64 to be compared across the ranks, got {x!r} ({e})")
        return out, None

    def exchange(self, error: Optional[BaseException]) -> None:
        """The one all-gather of the call; raises the same error on every rank when any rank failed.

        Each rank sends its refusal flag, the structure of its checks, its conditions' outcomes and one
        fingerprint of every agreed value (:func:`fingerprint_values`: the option objects' fields and the
        per-call tensors' metadata folded together, two int64 whatever their number). Only where the
        fingerprints differ does a second all-gather bring the values themselves, to name the first that
        differs and each rank's value."""
        device = collective_device(self.group)
        vec = torch.zeros(CHECK_SLOTS, dtype=torch.int64, device=device)
        values = []
        if error is None:
            values, error = self._int64_values()
        used = 2 + len(self.requirements) + 2 * bool(values)
        if error is None and used > CHECK_SLOTS:  # the same on every rank that made the same call
            error = RuntimeError(f"chunked_entropy: {used} checks exceed CHECK_SLOTS={CHECK_SLOTS} (a bug)")
        if error is not None:
            vec[0] = 1
        else:
            vec[1] = self._structure()
            parts = []
            if self.requirements:  # stacked where they were computed, then moved once
                parts.append((~torch.stack([ok.to(torch.bool) for ok, _ in self.requirements])).to(
                    device=device, dtype=torch.int64))
            if values:
                values = torch.stack([v.to(device).reshape(()) for v in values])
                parts.append(torch.stack(fingerprint_values(values)))
            if parts:
                vec[2:used] = torch.cat(parts)
        every = vec.new_empty(self.world * CHECK_SLOTS)
        _all_gather_single(every, vec, group=self.group)
        rows = every.view(self.world, CHECK_SLOTS).tolist()  # the call's one host sync
        refused = [r for r in range(self.world) if rows[r][0] == 1]
        if refused:
            self._raise_refused(refused, error)
        if len({row[1] for row in rows}) > 1:
            self._raise_different_calls()
        for i, (_, message) in enumerate(self.requirements):
            bad = [r for r in range(self.world) if rows[r][2 + i]]
            if bad:
                raise ValueError(
                    f"{message} (failed on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of the "
                    f"{self.world} ranks of process_group; this is rank {self.rank})"
                )
        at = 2 + len(self.requirements)
        if self.fields and len({tuple(row[at:at + 2]) for row in rows}) > 1:
            self._raise_differing(values)

    def _raise_differing(self, values: torch.Tensor):
        """The agreed values' fingerprints differ: gather the values (a second collective, only on failure)
        and name the first field that differs, with each rank's value."""
        every = values.new_empty(self.world * values.numel())
        _all_gather_single(every, values, group=self.group)
        rows = every.view(self.world, values.numel()).tolist()
        at = 0
        for name, v in self.fields.items():
            width = len(v) if isinstance(v, tuple) else 1
            seen = [tuple(row[at:at + width]) for row in rows]
            at += width
            if len(set(seen)) > 1:
                show = self._shown(name) or ", ".join(f"rank {r}: {x[0] if width == 1 else x}"
                                                      for r, x in enumerate(seen))
                raise ValueError(
                    f"{name} differs across the {self.world} ranks of process_group ({show}; this is rank "
                    f"{self.rank}). Every rank of the tensor-parallel group must make the same call: the same "
                    "tokens, labels, temperatures and options, and vocabulary shards of the same size"
                )

    def _shown(self, name: str) -> Optional[str]:
        """The ranks' readable values of the differing field ``name`` (a second collective, only on failure:
        every rank of a call that agreed on its structure finds the same field differing), or None when a
        rank has none."""
        every = [None] * self.world
        dist.all_gather_object(every, self.shown.get(name), group=self.group)
        if any(v is None for v in every):
            return None
        if all(isinstance(v, dict) for v in every):
            keys = list(dict.fromkeys(k for v in every for k in v))
            differ = [k for k in keys if len({v.get(k) for v in every}) > 1]
            return "; ".join(f"{k}: " + ", ".join(f"rank {r}: {v.get(k)}" for r, v in enumerate(every))
                             for k in differ) or None
        return ", ".join(f"rank {r}: {v}" for r, v in enumerate(every))

    def _checked(self) -> list:
        """What this rank checks, by name: each agreed field and each condition's message."""
        return list(self.fields) + [f"the check '{m}'" for _, m in self.requirements]

    def _raise_different_calls(self):
        """The ranks checked different things (an argument given on some ranks only, or another op): share
        what each checked (a second collective, only on failure) and name, per rank, the first check that not
        every rank makes."""
        every = [None] * self.world
        dist.all_gather_object(every, self._checked(), group=self.group)
        common = set.intersection(*(set(checked) for checked in every))
        listed = lambda rs: f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"  # noqa: E731
        said = []
        for r in range(self.world):
            n = next((n for n in every[r] if n not in common), None)
            if n is not None:
                lacking = [q for q in range(self.world) if n not in every[q]]
                said.append(f"rank {r} checks {n}, which {listed(lacking)} {'do' if len(lacking) > 1 else 'does'} not")
        where = ("; ".join(said) + " (an argument given on some ranks only?)" if said
                 else "the same checks, of other widths or in another order")
        raise ValueError(
            f"the {self.world} ranks of process_group made different calls: {where}; this is rank {self.rank}. "
            "Every rank of the tensor-parallel group must call the same function with the same arguments and options"
        )

    def _raise_refused(self, refused, error):
        """Share the refused ranks' messages (a second collective, only on failure) and raise them everywhere."""
        mine = None if error is None else (type(error).__name__, str(error))
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        kinds = {every[r][0] for r in refused}
        cls = {"TypeError": TypeError}.get(kinds.pop(), ValueError) if len(kinds) == 1 else ValueError
        said = "; ".join(f"rank {r}: {every[r][1]}" for r in refused)
        which = f"rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))}"
        err = cls(
            f"{said} (the call was refused on {which} of the {self.world} ranks of process_group, so every rank "
            f"raises this error; this is rank {self.rank})"
        )
        if error is not None:
            raise err from error
        raise err


@contextlib.contextmanager
def agreed_call(group):
    """Check a call's arguments under ``group`` so that every rank either proceeds or raises the same error.

    Yields a :class:`CallCheck`. Without a group (or with one rank) it runs
    the checks, and at the block's end resolves the conditions recorded with
    :meth:`CallCheck.require` (or :func:`chunked_entropy._checks.require`)
    together: one host sync on an accelerator, none in ``"async"`` mode
    (see :func:`~chunked_entropy._checks.checks_mode`), before the work
    deferred with :meth:`CallCheck.then`. With several ranks, leaving the
    block makes one all-gather of :data:`CHECK_SLOTS` int64 (and one host sync): a rank
    whose checks raised still joins it, flagged, so its peers never wait in
    a later collective; then every rank raises the same error, naming the
    rank(s) and what failed, and the group stays usable. Errors that make
    the group itself unusable (not initialized, this process not a member)
    are raised at once: there is no collective to join. Work deferred with
    :meth:`CallCheck.then` runs last, on every rank.
    """
    rank, world = group_rank_size(group)
    call = CallCheck(group, rank, world)
    with collecting(call):  # the value checks of anything called inside (the losses' mask check) join this call's
        if world == 1:
            yield call
            call.local.resolve()  # the call's one host sync (none in "async" mode, none on the CPU)
        else:
            try:
                yield call
                call.local.resolve()  # this rank's conditions on the CPU: a failure is this rank's refusal
            except Exception as e:  # noqa: BLE001 - any failure of a rank's checks is shared with its peers
                if raised_together(e):  # an exchange inside (a nested call's) raised it on every rank already
                    raise
                _exchange(call, e)
                raise  # exchange raised already; kept for readers
            _exchange(call, None)
    for fn in call.deferred:
        fn()


_TOGETHER = "_chunked_entropy_raised_together"


def raised_together(error: BaseException) -> bool:
    """Whether ``error`` came out of a call's exchange: every rank of its group raised it at the same point, so
    none waits for this rank and it must not be shared again."""
    return getattr(error, _TOGETHER, False)


def _exchange(call: CallCheck, error: Optional[BaseException]) -> None:
    """``call.exchange(error)``, its error marked as raised on every rank (:func:`raised_together`)."""
    try:
        call.exchange(error)
    except Exception as e:  # noqa: BLE001 - whatever the exchange raises, it raised on every rank
        setattr(e, _TOGETHER, True)
        raise


@contextlib.contextmanager
def refused_together(group):
    """Share a refusal raised outside an op's :func:`agreed_call` with every rank of ``group``.

    Wraps the preparation of a call up to its next agreed call (building its option objects, reading
    ``rows``): an exception raised inside is this rank's refusal, and the rank joins one agreed call
    carrying it, which its peers meet in their own next one, so that every rank raises the same error, none
    waits in a collective for a rank that left, and the group stays usable. An error that an agreed call
    inside already raised on every rank (:func:`raised_together`) passes as it is. Nothing inside may make
    a collective other than an agreed call's exchange. Without a group (or with one rank) errors pass as
    they are."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any failure before the agreement is a refusal to share
        if raised_together(e):
            raise
        with agreed_call(group):
            raise


_P = 2_147_483_629  # a prime below 2**31: products of two residues fit in int64
_A, _B = 1_103_515_245, 1_664_525  # position mixing constants below 2**31


def fingerprint(ints: torch.Tensor):
    """Two int64 fingerprints (0-d tensors on the input's device: no host sync) of a flat integer tensor.

    Each element ``v`` at position ``i`` becomes ``x = (v * a_i + b_i) mod P``
    with per-position multipliers; the fingerprints are ``sum(x)`` and
    ``sum(x**2 mod P)``. A single changed element always changes the first
    (``a_i`` is invertible mod ``P``); several changes that cancel in the
    linear sum still change the quadratic one unless they also cancel there,
    which for differences that are not constructed against this hash has a
    chance of about ``1 / P`` (2**-31) per call. Values may be any int64
    whose residue mod ``P`` identifies them (ids, float32 bit patterns).
    """
    ints = ints.reshape(-1).to(torch.int64)
    i = torch.arange(ints.numel(), device=ints.device) % _P
    a = (i * _A + 1) % _P + 1
    b = (i * _B + 7) % _P
    x = (torch.remainder(ints, _P) * a + b) % _P
    return x.sum(), (x * x % _P).sum()


def fingerprint_values(values: torch.Tensor):
    """:func:`fingerprint` of int64 ``values`` (a call's agreed fields), each cut into three pieces below ``P``
    (21, 21 and 22 bits) so that one changed value always changes the fingerprint."""
    v = values.reshape(-1).to(torch.int64)
    pieces = torch.stack([v & 0x1FFFFF, (v >> 21) & 0x1FFFFF, (v >> 42) & 0x3FFFFF], dim=1)
    return fingerprint(pieces)


def fingerprint_floats(t: Optional[torch.Tensor]):
    """:func:`fingerprint` of a float tensor's float32 values (bit patterns); ``(-1, -1)`` for None."""
    if t is None:
        return -1, -1
    return fingerprint(t.detach().reshape(-1).to(torch.float32).view(torch.int32))


def collective_device(group) -> torch.device:
    """The device of the tensors ``group``'s collectives take: the CPU for gloo, else the current accelerator."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.accelerator.is_available():
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def all_reduce_min_flags(flags: torch.Tensor, group) -> torch.Tensor:
    """Per element, whether ``flags`` (bool) holds on every rank of ``group``; a new tensor on ``flags``' device."""
    if not _active(group):
        return flags.clone()
    t = flags.to(device=collective_device(group), dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.to(device=flags.device, dtype=torch.bool)


def all_reduce_sum_(t: torch.Tensor, group) -> torch.Tensor:
    """In-place SUM over ``group`` (a no-op without one)."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max_(t: torch.Tensor, group) -> torch.Tensor:
    """In-place MAX over ``group`` (a no-op without one)."""
    if _active(group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_reduce_with_grad(t: torch.Tensor, group) -> torch.Tensor:
    """SUM over ``group``, differentiable (the gradient is all-reduced too); ``t`` itself is not written."""
    if not _active(group):
        return t
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def all_gather_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0 (sequence-parallel gather)."""
    if not _active(group):
        return t
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = t.new_empty((world * t.shape[0],) + tuple(t.shape[1:]))
    _all_gather_single(out, t, group=group)
    return out


def reduce_scatter_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """Sum ``t`` over ``group`` and keep this rank's slice of dim 0."""
    if not _active(group):
        return t
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // world,) + tuple(t.shape[1:]))
    if dist.get_backend(group) == dist.Backend.GLOO:
        # gloo has no reduce_scatter: sum everywhere, keep our slice.
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return out.copy_(t.narrow(0, rank * out.shape[0], out.shape[0]))
    _reduce_scatter_single(out, t, op=dist.ReduceOp.SUM, group=group)
    return out


def default_tp_group() -> Optional[object]:
    """Megatron's tensor-parallel group when megatron-core is initialized, else None."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def all_gather_stack(value, group) -> list:
    """Every rank's ``value`` (a tensor, or a :class:`~chunked_entropy._stats.BlockStats` of same-shaped
    vectors, its None fields None on every rank), in rank order: one all-gather (the invariant mode's merge,
    :mod:`chunked_entropy._tiles`, in place of :func:`reduce_stats`' two all-reduces). Receives ``world`` times
    ``value``'s elements."""
    world = dist.get_world_size(group)
    if isinstance(value, torch.Tensor):
        t = value.contiguous()
        out = t.new_empty((world,) + tuple(t.shape))
        _all_gather_single(out.view(-1), t.view(-1), group)
        return list(out.unbind(0))
    present = [f for f in value if f is not None]
    every = all_gather_stack(torch.stack(present), group)
    out = []
    for packed in every:
        it = iter(packed.unbind(0))
        out.append(BlockStats(*(None if f is None else next(it) for f in value)))
    return out
