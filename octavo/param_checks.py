"""Checks of user-given option values shared by the params classes (SamplingParams,
BeamSearchParams): each returns the value normalized or raises ValueError naming the field
and its allowed range."""

from __future__ import annotations

import math
import numbers


def check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def as_int(
    name: str, value: object, allowed: str, lo: int | None = None, hi: int | None = None
) -> int:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    check(ok, name, allowed, value)
    result = int(value)  # type: ignore[arg-type]
    check((lo is None or result >= lo) and (hi is None or result <= hi), name, allowed, value)
    return result


def as_float(
    name: str, value: object, allowed: str, lo: float | None = None, hi: float | None = None
) -> float:
    result = to_float(value)
    check(math.isfinite(result), name, allowed, value)
    check((lo is None or result >= lo) and (hi is None or result <= hi), name, allowed, value)
    return result


def to_float(value: object) -> float:
    """float(value) for a real number (an int too large for a float: +-inf), else NaN."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def as_list(name: str, value: object, allowed: str, allow_str: bool = True) -> list:
    if value is None:
        return []
    if isinstance(value, str) and allow_str:
        return [value]
    check(isinstance(value, (list, tuple)), name, allowed, value)
    return list(value)  # type: ignore[arg-type]
