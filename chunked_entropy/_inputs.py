"""The per-token inputs of a call, checked and prepared before any chunk is touched.

Layer: the per-token preparation (below the walk and the ops). :class:`Tokens` holds a call's
flattened per-token inputs (labels, mask, temperatures, the logit transform, sampling replay's kept
sets, distillation's ids) and turns upstream gradients into the walk's per-row factors
(:meth:`Tokens.scaled`, the one place an upstream gradient meets ``kz``); :func:`prepare_tokens`
checks and builds it; :func:`token_shape` is the leading shape of the tokens a head's hidden states
stand for (sequence parallelism's gathered sequence included) and :func:`check_linear_args` the fused
head's hidden states and labels against it; :class:`Rows` reads a chunk's rows without a copy. A bad
argument raises (naming it) and leaves nothing half-done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ._checks import FLOAT_DTYPES, check_device, check_strided, float_bits, is_finite_real, is_int, is_real, value_repr
from ._keep import Kept, parse_keep
from ._stats import Coefficients, RowStats, Transform, Want
from ._token_ids import At, parse_at
from .parallel import CallCheck, fingerprint, fingerprint_floats


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (for gradcheck); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Tokens:
    """Per-token inputs, flattened to [N] and checked, and the call's logit transform.

    ``valid``: the label counts (mask true and not ``ignore_index``).
    ``target``: the label's column in this rank's shard, or -1 (masked or on
    another shard). ``inv_t``: None (t == 1), a float, or a [N, 1] column.
    """

    shape: torch.Size
    valid: torch.Tensor
    target: torch.Tensor
    inv_t: Union[None, float, torch.Tensor]
    transform: Transform = Transform()
    keep: Optional[Kept] = None  # sampling replay: the kept sets (see chunked_entropy._keep)
    at: Optional[At] = None  # distillation: log-probs at K ids per token, the row's top-k (chunked_entropy._token_ids)

    @property
    def n(self) -> int:
        return self.valid.numel()

    def inv_t_rows(self, a: int, b: int):
        return self.inv_t[a:b] if isinstance(self.inv_t, torch.Tensor) else self.inv_t

    def k_rows(self, a: int, b: int):
        """The multiplier ``x = k * u`` of rows ``[a, b)`` (see :class:`~chunked_entropy._stats.Transform`)."""
        return self.transform.k(self.inv_t_rows(a, b))

    def at_outputs(self, r: RowStats):
        """``(log_probs_at, top_k_ids, top_k_log_probs)`` after the forward loop (Nones without them)."""
        if self.at is None:
            return None, None, None
        return self.at.outputs(r.m, r.ls, self.k_rows(0, self.n), self.transform)

    def outputs(self, r: RowStats, want: Want):
        """Flat ``(log_probs, entropy, sum_pi_squared)`` from RowStats (None where not wanted).

        The log-prob is 0 where the label is masked.
        """
        log_probs = torch.where(self.valid, r.log_probs(), 0.0)
        if self.keep is not None and self.keep.label_out is not None:  # the row's own filter: a label outside
            log_probs = log_probs.masked_fill(self.keep.label_out, -math.inf)
        of_kept = self.keep is not None and self.keep.of_kept
        return (
            log_probs,
            r.entropy(of_kept) if want.entropy else None,
            r.sum_pi_squared(of_kept) if want.sum_pi_squared else None,
        )

    def scaled(self, g: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
        """``g * kz``: an upstream gradient of rows ``[a, b)`` (``[b - a]``, or ``[b - a, K]`` per id) times
        ``dx/dz`` up to the cap's derivative (``kz = logit_scale / t``,
        :meth:`~chunked_entropy._stats.Transform.kz`); ``g`` itself where ``kz`` is 1, None for None. The one
        place an upstream gradient meets the logit transform; a new ``[b - a]`` (or ``[b - a, K]``) tensor."""
        kz = self.transform.kz(self.inv_t_rows(a, b))
        if g is None or kz is None:
            return g
        return g * (kz.squeeze(1) if isinstance(kz, torch.Tensor) and g.dim() == 1 else kz)

    def coefficients(self, a: int, b: int, g_lp, g_h, g_q) -> Coefficients:
        """Per-row gradient factors for rows ``[a, b)`` from their upstream gradients (``[b - a]`` each, or None)."""
        c = self.scaled(g_lp, a, b)
        c = None if c is None else torch.where(self.valid[a:b], c, 0.0)
        a2 = self.scaled(g_q, a, b)
        return Coefficients(c, self.scaled(g_h, a, b), None if a2 is None else 2 * a2)


def chunks(n: int, size: int):
    """``(start, stop)`` of consecutive chunks of ``size`` over ``range(n)``."""
    for a in range(0, n, size):
        yield a, min(a + size, n)


class Rows:
    """Rows ``[a, b)`` of the flattened leading dims of ``t`` ([..., D]), without copying ``t``.

    A view when the leading dims flatten as a view; otherwise (e.g. ``logits[:, :-1]``)
    the chunk's rows are gathered by index, one chunk at a time.
    """

    def __init__(self, t: torch.Tensor):
        self.t = t
        self._last = (None, None)  # the last gathered chunk, asked for again per vocabulary block
        try:
            self.flat = t.view(-1, t.shape[-1])
        except RuntimeError:
            self.flat = None

    def __call__(self, a: int, b: int) -> torch.Tensor:
        if self.flat is not None:
            return self.flat[a:b]
        if self._last[0] != (a, b):
            idx = torch.unravel_index(torch.arange(a, b, device=self.t.device), self.t.shape[:-1])
            self._last = ((a, b), self.t[idx])
        return self._last[1]


def prepare_tokens(
    labels,
    lead_shape: torch.Size,
    v_local: int,
    *,
    call: CallCheck,
    label_mask,
    ignore_index: int,
    temperature,
    device: torch.device,
    dtype: torch.dtype,
    labels_name: str = "labels",
    transform: Optional[Transform] = None,
    keep=None,
    entropy_of: str = "full",
    log_probs_at=None,
    top_k=None,
    logits: Optional[torch.Tensor] = None,
    mask_only: bool = False,
    teacher_transform: Optional[Transform] = None,
) -> Tokens:
    """Check labels, mask and temperature against ``lead_shape``; build :class:`Tokens`.

    Runs inside the op's :func:`~chunked_entropy.parallel.agreed_call`
    (``call``): device-side conditions (labels in range, temperatures valid)
    are recorded there, and so is what every rank of a process group must
    agree on: the shard width, the token count, the compute dtype, the
    transform and fingerprints of the labels (after the mask) and of the
    temperatures. ``keep`` and ``entropy_of`` are sampling replay's (see
    :func:`chunked_entropy._keep.parse_keep`); ``log_probs_at`` and ``top_k``
    distillation's (see :func:`chunked_entropy._token_ids.parse_at`). ``logits``:
    the op's raw logits where it has them, read by ``keep`` as the row's own
    filter. ``mask_only``: no label id means "no label" (``ignore_index`` is not
    read): ``label_mask`` alone says which labels count, each range-checked (the
    policy losses, whose ``loss_mask`` does). ``teacher_transform``: a divergence's second head, whose factors
    the one temperature scales too (checked here with the student's: the temperature enters once).
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{labels_name} must be a torch.Tensor of int64 ids, got {type(labels).__name__}")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{labels_name} must hold integer vocabulary ids (int64), got {labels.dtype}")
    check_strided(labels_name, labels)
    if labels.shape != lead_shape:
        raise ValueError(
            f"{labels_name} must have the leading shape of the input, {tuple(lead_shape)}, "
            f"got {tuple(labels.shape)}"
        )
    check_device(labels_name, labels, device)
    check_ignore_index(ignore_index)
    transform = Transform() if transform is None else transform
    v_global = v_local * call.world
    flat = labels.reshape(-1).to(torch.int64)

    valid = torch.ones_like(flat, dtype=torch.bool) if mask_only else flat != int(ignore_index)
    if label_mask is not None:
        if not isinstance(label_mask, torch.Tensor):
            raise TypeError(f"label_mask must be a bool tensor or None, got {type(label_mask).__name__}")
        check_strided("label_mask", label_mask)
        if label_mask.is_floating_point() or label_mask.is_complex():
            raise TypeError(
                f"label_mask must be a bool (or 0/1 integer) tensor, got {label_mask.dtype}; "
                "a float mask is a weight, apply it to the outputs instead"
            )
        if label_mask.shape != lead_shape:
            raise ValueError(
                f"label_mask must have the labels' shape {tuple(lead_shape)}, got {tuple(label_mask.shape)}"
            )
        check_device("label_mask", label_mask, device)
        valid &= label_mask.reshape(-1).to(dtype=torch.bool)

    bad = valid & ((flat < 0) | (flat >= v_global))
    expected = (f"{labels_name} must be vocabulary ids in [0, {v_global}) where the mask keeps them" if mask_only
                else f"{labels_name} must be vocabulary ids in [0, {v_global}) or ignore_index={ignore_index}")

    def where_bad():  # read only once the check failed: the first bad label
        i = int(bad.nonzero()[0, 0])
        return f"{expected}; found {int(flat[i])} at flat position {i}"

    where_bad.summary = expected  # what a group's all-gather reports
    call.require(~bad.any(), where_bad)
    local = flat - call.rank * v_local
    target = torch.where(valid & (local >= 0) & (local < v_local), local, -1)
    inv_t = prepare_temperature(temperature, lead_shape, device, dtype, call)
    for tf in (transform, teacher_transform):
        if tf is not None:
            check_transform_scale(tf, inv_t, dtype, call)
    call.agree("the vocabulary shard width (V_local)", v_local)
    call.agree(f"the token count ({labels_name}.numel())", flat.numel())
    call.agree("the compute dtype (bits: 32 for float32, 64 for float64)", torch.finfo(dtype).bits)
    if call.world > 1:
        call.agree(f"{labels_name} (with label_mask and ignore_index applied)",
                   fingerprint(torch.where(valid, flat, -1)))
        call.agree("temperature", _fingerprint_scale(inv_t),
                   shown=None if isinstance(inv_t, torch.Tensor) else repr(temperature))
    call.agree("softcap", float_bits(transform.softcap), shown=repr(transform.softcap))
    call.agree("logit_scale", float_bits(transform.logit_scale), shown=repr(transform.logit_scale))
    k_rows = lambda a, b: transform.k(inv_t[a:b] if isinstance(inv_t, torch.Tensor) else inv_t)  # noqa: E731
    kept = parse_keep(keep, lead_shape=lead_shape, v_local=v_local, labels=flat, valid=valid, entropy_of=entropy_of,
                      device=device, call=call, rows=None if logits is None else Rows(logits),
                      scale=(transform, k_rows, dtype))
    at = parse_at(log_probs_at, top_k, lead_shape=lead_shape, v_local=v_local, device=device, call=call, keep=keep,
                  capped=transform.softcap is not None)
    return Tokens(lead_shape, valid, target, inv_t, transform, kept, at)


def token_shape(hidden: torch.Tensor, world: int, sequence_parallel: bool, *, batch_first: bool = False,
                name: str = "hidden") -> torch.Size:
    """The leading shape of the tokens ``hidden`` (``[..., H]``) stands for.

    Without sequence parallelism, ``hidden.shape[:-1]``. With it, ``hidden`` is this rank's ``[S/P, ..., H]``
    slice of a ``world``-way group and the tokens are the gathered sequence: ``(S, ...)``; ``batch_first``
    (the policy loss's per-token tensors, ``[B, T]`` beside Megatron's ``[T/P, B, H]``): ``(B, T)``.
    """
    if not sequence_parallel:
        return hidden.shape[:-1]
    if batch_first:
        if hidden.dim() != 3:
            raise ValueError(f"with sequence_parallel=True, {name} must be [T/P, B, H], got {tuple(hidden.shape)}")
        return torch.Size((hidden.shape[1], hidden.shape[0] * world))
    if hidden.dim() < 2:
        raise ValueError(f"with sequence_parallel=True, {name} must be [S/P, ..., H], got {tuple(hidden.shape)}")
    return torch.Size((hidden.shape[0] * world,) + tuple(hidden.shape[1:-1]))


def check_linear_args(hidden, layer, labels, world: int, sequence_parallel: bool):
    """Check the fused head's hidden states against its ``layer`` (an
    :class:`~chunked_entropy.OutputLayer`, whose own rules were checked when it was built:
    :meth:`~chunked_entropy.OutputLayer.check_hidden`) and the labels' type; returns the labels' expected
    leading shape (:func:`token_shape`).

    ``world`` is the size of the tensor-parallel group (the sequence-parallel
    slice of ``hidden`` is ``1 / world`` of the sequence).
    """
    layer.check_hidden(hidden)
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor of int64 ids, got {type(labels).__name__}")
    lead = token_shape(hidden, world, sequence_parallel)
    if sequence_parallel:
        if labels.shape != lead:
            raise ValueError(
                f"with sequence_parallel=True, hidden is this rank's slice [S/P, ..., H] = "
                f"{tuple(hidden.shape)} of a {world}-way group, so labels must have shape "
                f"{tuple(lead)} (the full sequence), got {tuple(labels.shape)}"
            )
    return lead


def check_ignore_index(ignore_index) -> int:
    """``ignore_index``: an int that fits in int64 (the labels' dtype), as an int."""
    if not is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int (the label id meaning 'no label'), got {ignore_index!r}")
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (the labels' dtype), got {value_repr(ignore_index)}")
    return int(ignore_index)


def dtype_code(dtype: torch.dtype) -> int:
    """A float dtype as a small int, for :meth:`~chunked_entropy.parallel.CallCheck.agree`."""
    return FLOAT_DTYPES.index(dtype) if dtype in FLOAT_DTYPES else -1




def _fingerprint_scale(inv_t):
    if isinstance(inv_t, torch.Tensor):
        return fingerprint_floats(inv_t)
    return float_bits(1.0 if inv_t is None else inv_t), 0


def prepare_temperature(temperature, lead_shape, device, dtype, call: CallCheck):
    """``1 / temperature`` as None (exactly 1), a float, or a [N, 1] column in ``dtype``."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(f"temperature must be a float or a float tensor, got {temperature.dtype}")
        check_strided("temperature", temperature)
        # a 0-dim tensor is a scalar, taken from any device that holds a value (as torch's own ops do)
        if temperature.dim() > 0 or temperature.is_meta:
            check_device("temperature", temperature, device)
        try:
            t = torch.broadcast_to(temperature.detach().to(device), lead_shape)
        except RuntimeError:
            raise ValueError(
                f"temperature of shape {tuple(temperature.shape)} does not broadcast to the "
                f"labels' shape {tuple(lead_shape)}"
            ) from None
        # A new tensor of N values: the caller's is never written.
        inv_t = t.reshape(-1, 1).to(dtype).reciprocal()
        # t > 0 and 1/t finite: rejects t <= 0, inf, nan, and t so small that 1/t overflows.
        ok = (inv_t > 0) & torch.isfinite(inv_t) & torch.isfinite(t.reshape(-1, 1))
        call.require(ok.all(), f"temperature must be finite and > 0 (with 1/temperature finite in {dtype}) everywhere")
        return inv_t
    if not is_real(temperature):
        raise TypeError(f"temperature must be a float > 0 or a tensor, got {type(temperature).__name__}")
    if not (is_finite_real(temperature) and temperature > 0 and 1.0 / temperature < torch.finfo(dtype).max):
        raise ValueError(
            f"temperature must be finite and > 0 (with 1/temperature finite in {dtype}), got "
            f"{value_repr(temperature)}"
        )
    return None if temperature == 1 else 1.0 / float(temperature)


def check_transform_scale(tf: Transform, inv_t, dtype, call: CallCheck) -> None:
    """The transform's factors must be finite in ``dtype``: ``softcap / t``, ``logit_scale / t`` and
    ``logit_scale / softcap`` can overflow although each value is fine on its own."""
    big = torch.finfo(dtype).max
    named = [("softcap / temperature", tf.softcap), ("logit_scale / temperature", tf.logit_scale)]
    if tf.softcap is not None and not (tf.logit_scale or 1.0) / tf.softcap < big:  # the cap's inner factor
        what = "1 / softcap" if tf.logit_scale is None else "logit_scale / softcap"
        raise ValueError(
            f"{what} = {tf.logit_scale or 1.0} / {tf.softcap} overflows {dtype}; "
            + ("use a larger softcap" if tf.logit_scale is None else "use a smaller logit_scale or a larger softcap")
        )
    for name, factor in named:
        if factor is None:
            continue
        if isinstance(inv_t, torch.Tensor):
            call.require(torch.isfinite(inv_t * factor).all(), f"{name} overflows {dtype} for some rows; use a "
                         "larger temperature or a smaller factor")
        elif not factor * (1.0 if inv_t is None else inv_t) < big:
            raise ValueError(f"{name} = {factor} * {1.0 if inv_t is None else inv_t} (1/temperature) overflows "
                             f"{dtype}; use a larger temperature or a smaller factor")
