"""Argument checks shared by every subpackage (pure Python, no pdjax imports): each returns
the value (an int as a Python int) or raises naming the argument, the value and what was
expected, before any compute.

A value of the wrong type raises :class:`ArgumentTypeError`, which is both a TypeError and a
ValueError (so ``except ValueError`` around a call keeps catching every bad argument); a
value out of range raises ValueError. Bools are never numbers here."""

from __future__ import annotations

import math
import numbers


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (e.g. a float or a bool where an integer is due)."""


def check_int(name: str, value, minimum: int | None = 1, maximum: int | None = None) -> int:
    """``value`` as an int if it is an integer (numpy integers too, not a bool) within
    ``minimum..maximum`` (either bound None: open)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be {_int_range(minimum, maximum)}, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {_int_range(minimum, maximum)}, got {value!r}")
    return int(value)


def _int_range(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer in {minimum}..{maximum}"
    if minimum is not None:
        return f"an integer >= {minimum}"
    return "an integer" if maximum is None else f"an integer <= {maximum}"


def check_number(name: str, value) -> float:
    """``value`` if it is a finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a real number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def check_nonnegative(name: str, value) -> float:
    """``value`` if it is a finite real >= 0."""
    check_number(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def check_positive(name: str, value) -> float:
    """``value`` if it is a finite real > 0."""
    check_number(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def check_fraction(name: str, value, *, open_low: bool = True) -> float:
    """``value`` if it lies in (0, 1] (or [0, 1] with ``open_low=False``)."""
    check_number(name, value)
    if value > 1 or value < 0 or (open_low and value == 0):
        interval = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return value
