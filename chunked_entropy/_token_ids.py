"""Log-probs at K given ids per token, and the row's own top-k (on-policy distillation), in the chunk loop.

Layer: per-token inputs (with :mod:`chunked_entropy._inputs`). With
``x = k * u`` the transformed, tempered logits of a row (see
:mod:`chunked_entropy._stats`), its maximum offset ``m`` and ``log s``:

    log_prob_at[j] = k (u_j - m) - log s

so forward only has to *read* each requested id's raw logit, in whichever
block (and rank) holds it, before the block is overwritten; no ``[T, V]``
tensor is formed. With a soft-cap, ``u_j`` is formed here (``tanh``, eager)
while the kernels formed ``m`` from their own ``tanh`` (compiled and Triton
ones differ from eager's by an ulp now and then, which ``k = softcap / t``
magnifies: 1.8e-3 nats at ``t = 1e-3``, a confident token's log-prob above
0); so ``m`` is taken here too, as ``u`` of the row's largest raw logit (the
top-k's first, or a running maximum of the blocks), formed the same way as
``u_j``: the row's own top token gets ``-log s <= 0`` exactly, as with eager.

The top-k is that of the raw logits (the transform is increasing), merged
over blocks and, once per call, over ranks; its log-probs are then
log-probs at its ids.

**Gradient.** With upstream ``g_k`` at the ids ``j_k`` of a row,

    dL/dx = sum_k g_k e_{j_k} - p * sum_k g_k

The dense part is the log-prob's (``-p c``) with ``c`` grown by
``sum_k g_k``; the label's one-hot that the log-prob's coefficient also
carries is taken back, and the ids' one-hots are added, at those entries
only (times ``dx/dz``, the cap's derivative included).

Memory: per call, ``[N, K]`` float32 raw logits and, with ``top_k=k``,
``[N, k]`` float32 and int64; per block a ``topk`` of the block. With a
soft-cap and no ``top_k``: an ``[N]`` float32 row maximum, per block an
``amax`` of the block (one more read of it). Every shape is static
(gathers and scatters with masked values, clamped columns): no host sync
per chunk; under a process group one all-reduce and two all-gathers per
call, after the loop (with a soft-cap and no ``top_k``, one more
all-reduce: the row maximum's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ._checks import check_device, is_int
from ._stats import Transform
from .parallel import all_gather_dim0, all_reduce_max_, all_reduce_sum_, fingerprint


@dataclass(eq=False)
class At:
    """A call's requested ids (``ids``: ``[N, K]`` global, or None) and top-k size (0: none), and what the
    forward loop gathers for them."""

    ids: Optional[torch.Tensor]
    top_k: int
    rank: int
    v_local: int
    raw: Optional[torch.Tensor] = None  # [N, K] the ids' raw logits (after the loop: from every rank)
    top_raw: Optional[torch.Tensor] = None  # [N, k] the row's top-k raw logits, descending
    top_ids: Optional[torch.Tensor] = None  # [N, k] their global ids
    capped: bool = False  # a soft-cap: the log-probs are relative to u of the row's largest raw logit (see above)
    row_max: Optional[torch.Tensor] = None  # [N] the row's largest raw logit (capped, without top_k)
    # The invariant mode: the top-k's ties broken by the lower global id (:func:`_top_by_key`), so that the ids
    # do not depend on the blocks, the chunk or the ranks (torch's topk picks among equal values as it goes)
    tie_break: bool = False

    @property
    def k_ids(self) -> int:
        return 0 if self.ids is None else self.ids.shape[1]

    # ------------------------------------------------------------------ forward

    def start(self, n: int, dtype, device) -> None:
        if self.ids is not None:
            self.raw = torch.zeros(n, self.k_ids, dtype=dtype, device=device)
        if self.top_k:
            self.top_raw = torch.empty(n, self.top_k, dtype=dtype, device=device)
            self.top_ids = torch.empty(n, self.top_k, dtype=torch.int64, device=device)
        elif self.capped:
            self.row_max = torch.full((n,), -math.inf, dtype=dtype, device=device)

    def block(self, z: torch.Tensor, a: int, b: int, v0: int, cand):
        """Read a block of raw logits (rows ``[a, b)``, shard columns from ``v0``) before it is overwritten;
        returns the chunk's running top-k candidates ``(values, global ids)``."""
        width = z.shape[1]
        if self.ids is not None:
            local = self.ids[a:b] - (self.rank * self.v_local + v0)
            inside = (local >= 0) & (local < width)
            got = z.gather(1, local.clamp(0, width - 1)).to(self.raw.dtype)
            self.raw[a:b] = torch.where(inside, got, self.raw[a:b])
        if self.row_max is not None:  # NaN propagates, as into the kernels' m
            self.row_max[a:b] = torch.maximum(self.row_max[a:b], z.amax(dim=1).to(self.row_max.dtype))
        if not self.top_k:
            return None
        first = self.rank * self.v_local + v0
        if self.tie_break:
            ids = torch.arange(first, first + width, device=z.device).expand(z.shape[0], width)
            vals, idx = _top_by_key(z.to(self.top_raw.dtype), ids, self.top_k)
        else:
            vals, idx = z.topk(min(self.top_k, width), dim=1)
            vals, idx = vals.to(self.top_raw.dtype), idx + first
        if cand is not None:  # merged with the earlier blocks' candidates, in descending order again
            vals, idx = torch.cat([cand[0], vals], dim=1), torch.cat([cand[1], idx], dim=1)
            if self.tie_break:
                return _top_by_key(vals, idx, self.top_k)
            vals, pick = vals.topk(min(self.top_k, vals.shape[1]), dim=1)
            idx = idx.gather(1, pick)
        return vals, idx

    def chunk_done(self, a: int, b: int, cand) -> None:
        if self.top_k:
            vals, idx = cand
            if vals.shape[1] < self.top_k:  # a shard narrower than k: pad, merged away over the ranks
                pad = self.top_k - vals.shape[1]
                vals = torch.cat([vals, vals.new_full((b - a, pad), -math.inf)], dim=1)
                idx = torch.cat([idx, idx.new_full((b - a, pad), -1)], dim=1)
            self.top_raw[a:b], self.top_ids[a:b] = vals, idx

    def finish(self, group) -> None:
        """Merge over the ranks of ``group``: each id's logit lives on one rank; the top-k of every rank."""
        if group is None or dist.get_world_size(group) == 1:
            return
        if self.raw is not None:
            all_reduce_sum_(self.raw, group)
        if self.row_max is not None:
            all_reduce_max_(self.row_max, group)
        if self.top_k:
            world = dist.get_world_size(group)
            vals = all_gather_dim0(self.top_raw.unsqueeze(0).contiguous(), group)  # [world, N, k]
            idx = all_gather_dim0(self.top_ids.unsqueeze(0).contiguous(), group)
            vals, idx = vals.permute(1, 0, 2).reshape(-1, world * self.top_k), idx.permute(1, 0, 2).reshape(
                -1, world * self.top_k)
            if self.tie_break:
                self.top_raw, self.top_ids = _top_by_key(vals, idx, self.top_k)
                return
            self.top_raw, pick = vals.topk(self.top_k, dim=1)
            self.top_ids = idx.gather(1, pick)

    def outputs(self, m, ls, k, tf: Transform):
        """``(log_probs_at, top_k_ids, top_k_log_probs)`` (None where not asked) from the rows' statistics
        (with a soft-cap, ``m`` formed again here from the row's largest raw logit: see the module doc)."""
        m = m.unsqueeze(1)
        if tf.softcap is not None:
            top = self.top_raw[:, :1] if self.top_k else self.row_max.unsqueeze(1)
            m = tf.to_u_(top.clone())

        def lp(raw):
            u = tf.to_u_(raw.clone())
            kk = 1.0 if k is None else k
            return kk * (u - m) - ls.unsqueeze(1)

        return (None if self.raw is None else lp(self.raw), self.top_ids,
                None if not self.top_k else lp(self.top_raw))

    # ------------------------------------------------------------------ backward

    def all_ids(self) -> torch.Tensor:
        """The ids of every differentiable output: the requested ids, then the top-k's."""
        parts = [t for t in (self.ids, self.top_ids) if t is not None]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @staticmethod
    def upstream(g_at, g_top, ids_k: int, top_k: int, like: torch.Tensor):
        """The upstream gradients of ``all_ids``' log-probs, ``[N, K + k]`` (None without any)."""
        if g_at is None and g_top is None:
            return None
        n = like.shape[0]
        parts = []
        if ids_k:
            parts.append(torch.zeros(n, ids_k, dtype=like.dtype, device=like.device) if g_at is None
                         else g_at.reshape(n, ids_k).to(like.dtype))
        if top_k:
            parts.append(torch.zeros(n, top_k, dtype=like.dtype, device=like.device) if g_top is None
                         else g_top.reshape(n, top_k).to(like.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def block_entries(self, ids, target, v0: int, width: int):
        """Where the ids of rows ``[a, a + len(ids))`` and their labels fall in this block, with static shapes
        (no host sync): ``(cols, inside, label_cols, label_inside)``, the columns clamped into the block."""
        local = ids - (self.rank * self.v_local + v0)
        return (local.clamp(0, width - 1), (local >= 0) & (local < width), (target - v0).clamp(0, width - 1),
                (target >= v0) & (target < v0 + width))


def _top_by_key(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple:
    """The top ``k`` of ``vals`` (``[n, c]``) by value, equal values by the lower id (``ids``, ``[n, c]`` global):
    ``(values, ids)``, descending. One int64 key an entry, unique, so that the choice does not depend on the
    entries' order (the invariant mode: ``At.tie_break``): the float32 value's bits made order-preserving in
    the high half, ``2**31 - 1 - id`` in the low half. Float64 values (gradcheck): torch's topk, ties as it
    picks them. Allocates the keys (8 bytes an entry) and a float32 copy of half-precision ``vals``."""
    k = min(k, vals.shape[1])
    if vals.dtype != torch.float32:
        picked, pick = vals.topk(k, dim=1)
        return picked, ids.gather(1, pick)
    bits = vals.contiguous().view(torch.int32)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    _, pick = (order * 2**32 + (2**31 - 1 - ids)).topk(k, dim=1)
    return vals.gather(1, pick), ids.gather(1, pick)


def add_grad_(grad: torch.Tensor, raw, entries, coef: torch.Tensor, total: torch.Tensor, tf: Transform) -> None:
    """Add the ids' one-hots and take back the label's extra one (see the module doc) into a block's gradient.

    ``coef``: ``[rows, K + k]`` upstream gradients of the chunk; ``total`` their row sums (both times
    ``kz``, the rows' ``dx/dz`` factor); ``raw``: the block's raw logits at the ids and at the labels, read
    before the block was overwritten (the cap's derivative). Entries outside the block add 0.
    """
    cols, inside, label_cols, label_inside = entries
    zero = torch.zeros((), dtype=coef.dtype, device=coef.device)
    val = torch.where(inside, coef, zero)
    back = torch.where(label_inside, -total, zero)
    if tf.softcap is not None:
        u, ul = (tf.to_u_(r.clone()) for r in raw)
        val, back = val * (1.0 - u * u), back * (1.0 - ul * ul)
    grad.scatter_add_(1, cols, val.to(grad.dtype))
    grad.scatter_add_(1, label_cols.unsqueeze(1), back.unsqueeze(1).to(grad.dtype))


def parse_at(log_probs_at, top_k, *, lead_shape, v_local: int, device, call, keep, capped: bool = False
             ) -> Optional[At]:
    """``log_probs_at`` (an int64 ``[..., K]`` tensor of global ids in the labels' leading shape, or None) and
    ``top_k`` (an int >= 1, or None), checked; None when neither is asked. ``capped``: the call's transform
    has a soft-cap."""
    if log_probs_at is None and top_k is None:
        call.agree("log_probs_at's K, top_k", (0, 0))
        return None
    if keep is not None:
        raise ValueError("keep= (sampling replay) and log_probs_at / top_k do not combine: the distillation "
                         "outputs are over the whole vocabulary; make a separate call with keep")
    v_global = v_local * call.world
    ids = None
    if log_probs_at is not None:
        if not isinstance(log_probs_at, torch.Tensor):
            raise TypeError(f"log_probs_at must be an int64 tensor of global ids [..., K], got "
                            f"{type(log_probs_at).__name__}")
        if log_probs_at.dtype.is_floating_point or log_probs_at.dtype.is_complex or log_probs_at.dtype == torch.bool:
            raise TypeError(f"log_probs_at must hold integer vocabulary ids (int64), got {log_probs_at.dtype}")
        want = tuple(lead_shape)
        if log_probs_at.dim() != len(want) + 1 or tuple(log_probs_at.shape[:-1]) != want:
            raise ValueError(f"log_probs_at must be [..., K] with the labels' leading shape {want}, got "
                             f"{tuple(log_probs_at.shape)}")
        if log_probs_at.shape[-1] < 1:
            raise ValueError("log_probs_at must have K >= 1 ids per token, got K = 0")
        check_device("log_probs_at", log_probs_at, device)
        ids = log_probs_at.reshape(-1, log_probs_at.shape[-1]).to(torch.int64)
        call.require(((ids >= 0) & (ids < v_global)).all(), f"log_probs_at must hold vocabulary ids in [0, {v_global})")
        if call.world > 1:
            call.agree("log_probs_at (the ids)", fingerprint(ids))
    if top_k is not None and not (is_int(top_k) and 1 <= top_k <= v_global):
        raise ValueError(f"top_k must be an int in [1, {v_global}] (the vocabulary size), got {top_k!r}")
    call.agree("log_probs_at's K, top_k", (0 if ids is None else ids.shape[1], int(top_k or 0)))
    return At(ids, int(top_k or 0), call.rank, v_local, capped=bool(capped))
