"""Argument validation: every error names the argument and what is allowed."""

from __future__ import annotations

import math
from typing import Any


def check_choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """Raise ``ValueError`` naming the argument and the allowed values when ``value`` is not one."""
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= ``minimum`` (or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be an integer >= {minimum}{none}; got {value!r}")


def check_float(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a number in ``[low, high]`` (``(low, high]`` if open)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"`{name}` must be a number in {bracket}{low}, {high}]; got {value!r}")
