"""Argument checks of plain values: numbers, flags, sizes and tensor dtypes.

Floor 0: imports only torch. Every check names the argument and says what
was expected. Numbers are anything ``numbers.Real`` (Python, numpy, ...)
except bools, and come back as Python floats or ints.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def is_real(value) -> bool:
    """A real number that is not a bool (numpy's ``bool_`` is not ``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_real(name: str, value, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False,
               high_open: bool = False) -> float:
    """A finite number in ``[low, high]`` (ends open where asked), as a float."""
    if not is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value!r}")
    return value


def check_positive(name: str, value, *, optional: bool = True) -> Optional[float]:
    """A finite float > 0 (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not is_real(value) or not math.isfinite(value) or value <= 0:
        extra = " or None" if optional else ""
        raise ValueError(f"{name} must be a finite float > 0{extra}, got {value!r}")
    return float(value)


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
