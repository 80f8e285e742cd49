"""Argument checks of plain values: numbers, flags, sizes and tensor dtypes.

Layer: basics (imports only torch). Every check names the argument and says what
was expected. Numbers are anything ``numbers.Real`` (Python, numpy, ...)
except bools, and come back as Python floats or ints. The value checks
computed on a device (labels in range, temperatures finite, ...) are
collected per call and read together (:func:`checked_call`,
:func:`require`, :func:`checks_mode`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import os
import struct
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def float_bits(x: Optional[float]) -> int:
    """A float's exact bit pattern as an int (None: -1): equal settings on two ranks give equal ints, for the
    cross-rank agreement (:meth:`~chunked_entropy.parallel.CallCheck.agree`). ``-0.0`` is ``0.0`` here (equal
    floats, the same setting: ``+ 0.0`` turns the one into the other)."""
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x) + 0.0))[0]


def is_real(value) -> bool:
    """A real number that is not a bool (numpy's ``bool_`` is not ``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def plain_str(value):
    """A ``str`` subclass (``numpy.str_``, an enum's str) as the plain ``str`` of the same text; anything else as it
    is. Option objects keep their names plain: equal settings then have equal fingerprints on every rank."""
    return str.__str__(value) if isinstance(value, str) and type(value) is not str else value


class ByValue:
    """Equality and hashing of a frozen option object by its settings, as a dataclass's: ``_key()`` gives them
    (numbers and names by value, tensors and process groups by identity: the same settings over the same
    weight are equal, the same settings over another weight are not)."""

    __slots__ = ()

    def _key(self) -> tuple:  # pragma: no cover - each option class defines it
        raise NotImplementedError

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash((type(self).__name__, self._key()))


def same(obj) -> tuple:
    """An object in a :meth:`ByValue._key` by identity (a tensor, a process group; None as None): its id, which
    the option object holding it keeps valid."""
    return ("is", None if obj is None else id(obj))


def is_finite_real(value) -> bool:
    """A real number (:func:`is_real`) that is finite as a float: NaN, the infinities and an int too large for a
    float (``10**400``, where ``math.isfinite`` itself raises ``OverflowError``) are not."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_real(name: str, value, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False,
               high_open: bool = False) -> float:
    """A finite number in ``[low, high]`` (ends open where asked), as a float."""
    if not is_finite_real(value):
        raise ValueError(f"{name} must be a finite number, got {value_repr(value)}")
    value = float(value)
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value!r}")
    return value


def check_positive(name: str, value, *, optional: bool = True) -> Optional[float]:
    """A finite float > 0 (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not is_finite_real(value) or value <= 0:
        extra = " or None" if optional else ""
        raise ValueError(f"{name} must be a finite float > 0{extra}, got {value_repr(value)}")
    return float(value)


def value_repr(value) -> str:
    """``repr(value)``, an int of more than 30 digits shortened (``10**400`` would fill the message)."""
    text = repr(value)
    if is_int(value) and len(text) > 30:
        return f"an int of {len(text.lstrip('-'))} digits ({text[:8]}...)"
    return text


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True/False), got {value!r}")
    return value


def check_chunk(name: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_strided(name: str, t: torch.Tensor) -> None:
    """A dense (strided) tensor: sparse and other layouts are refused by name, before any work."""
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}; call .to_dense() first")


def check_device(name: str, t: torch.Tensor, device: torch.device, of: str = "the input") -> None:
    """``t`` lives on ``device`` (that of ``of``): named here, before torch's own error from inside the work."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected {device}, where {of} is (move it there first)")


def check_float(name: str, t, *, dim: Optional[int] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_strided(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


# ----------------------------------------------------------------------------- value checks on the device

#: The environment variable that chooses how the value checks computed on a device are resolved.
CHECKS_ENV = "CHUNKED_ENTROPY_CHECKS"
CHECK_MODES = ("sync", "async")


def logits_in_float32(logits_dtype, weight_dtype: torch.dtype, name: str = "logits_dtype",
                      weight: str = "weight") -> bool:
    """The ``logits_dtype`` rule, the one place it is written: None or the weight's dtype keep the blocks in
    the weight's dtype (False); ``torch.float32`` beside a bf16/fp16 weight computes them in float32 (True);
    anything else is an error naming ``name`` and the ``weight``."""
    if logits_dtype is None or logits_dtype == weight_dtype:
        return False
    if logits_dtype == torch.float32 and weight_dtype in (torch.bfloat16, torch.float16):
        return True
    raise ValueError(f"{name} must be None ({weight}'s dtype, {weight_dtype}), {weight_dtype} or torch.float32, "
                     f"got {logits_dtype!r}")


def checks_mode() -> str:
    """How a call resolves its value checks (labels in range, temperatures finite, ...), read per call from
    :data:`CHECKS_ENV`:

    - ``"sync"`` (the default): every value check of a call is folded into one boolean tensor and read on
      the host once, at the end of the call's checks and before any work that indexes with the checked
      values: one host sync per call (none per chunk). A bad value raises the same ``ValueError`` as on
      the CPU, naming the argument, and a CUDA context stays usable.
    - ``"async"``: each check is an asynchronous device-side assertion (``torch._assert_async``): no host
      sync at all. The consequence: on a GPU a bad value is reported by a device-side assert at some later
      CUDA call, and **the CUDA context is lost** (every later CUDA call of the process fails, a checkpoint
      cannot be saved); on the CPU it raises ``RuntimeError`` at once. Under a process group of several
      ranks the call's all-gather (one host sync) is made in both modes.
    """
    mode = os.environ.get(CHECKS_ENV, "").strip().lower() or "sync"
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECKS_ENV} must be 'sync' (the default: one host sync per call, a ValueError on bad "
                         f"input) or 'async' (no host sync, a device-side assert on bad input), got {mode!r}")
    return mode


class Requirements:
    """The value checks of one call, computed on the device and resolved together (see :func:`checks_mode`).

    :meth:`require` records a condition (a 0-d bool tensor) and what to say when it fails; :meth:`resolve`
    reads them all with one host sync (per device; the CPU's cost nothing) and raises ``ValueError`` with
    the first failed one's message. In ``"async"`` mode a condition on a device becomes
    ``torch._assert_async`` instead (and one on the CPU too, raising ``RuntimeError`` at once).
    """

    def __init__(self):
        self.pending = []  # (ok, message)
        self.mode = checks_mode()

    def require(self, ok: torch.Tensor, message) -> None:
        """``ok`` (a 0-d bool tensor) must hold; ``message`` (a str, or a callable giving one) says what failed."""
        if self.mode == "async":
            torch._assert_async(ok.reshape(()), check_summary(message))
            return
        self.pending.append((ok.reshape(()), message))

    def failed(self):
        """The messages of the failed checks, in the order they were recorded (the call's one host sync)."""
        if not self.pending:
            return []
        by_device = {}
        for i, (ok, _) in enumerate(self.pending):
            by_device.setdefault(ok.device, []).append(i)
        bad = []
        for idx in by_device.values():
            if len(idx) == 1:  # one check: read as it is (no stack, no all: one launch, the read)
                oks = self.pending[idx[0]][0].to(torch.bool).reshape(1)
                if bool(oks[0]):  # the host sync (free on the CPU)
                    continue
            else:
                oks = torch.stack([self.pending[i][0].to(torch.bool) for i in idx])
                if bool(oks.all()):  # the host sync (free on the CPU)
                    continue
            bad += [i for i, v in zip(idx, oks.tolist(), strict=True) if not v]  # only on failure: a second read
        return [self.pending[i][1] for i in sorted(bad)]

    def resolve(self) -> None:
        """Raise ``ValueError`` (the first failed check's message) when any check failed."""
        failed = self.failed()
        self.pending = []
        if failed:
            message = failed[0]
            raise ValueError(message() if callable(message) else message)


def check_summary(message) -> str:
    """A check's message without reading the device: a str itself, or a callable's ``summary`` attribute."""
    if isinstance(message, str):
        return message
    return getattr(message, "summary", None) or "an argument failed a device-side check"


_OPEN: contextvars.ContextVar = contextvars.ContextVar("chunked_entropy_open_checks", default=None)


@contextlib.contextmanager
def collecting(checks):
    """Within the block, :func:`require` records into ``checks`` (an object with ``require(ok, message)``)."""
    token = _OPEN.set(checks)
    try:
        yield checks
    finally:
        _OPEN.reset(token)


@contextlib.contextmanager
def checked_call():
    """The value checks of a call: :func:`require` inside the block joins the call that is open already
    (an op calling another, or the op's :func:`~chunked_entropy.parallel.agreed_call`) or, outside any,
    is resolved when the block ends, with one host sync. Put only checks (and work that indexes nothing
    with the checked values) inside the block."""
    if _OPEN.get() is not None:
        yield _OPEN.get()
        return
    reqs = Requirements()
    with collecting(reqs):
        yield reqs
    reqs.resolve()


def require(ok: torch.Tensor, message) -> None:
    """Record the condition ``ok`` (a 0-d bool tensor on any device) in the open call's checks; outside any
    call it is resolved at once (one host sync, or a device-side assertion in ``"async"`` mode)."""
    checks = _OPEN.get()
    if checks is not None:
        checks.require(ok, message)
        return
    with checked_call() as reqs:
        reqs.require(ok, message)
