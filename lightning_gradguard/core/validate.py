"""Argument validation: every error names the argument and what is allowed.

A value of the wrong type raises ``TypeError`` (a string where a number is wanted); a value of the right
type outside what is allowed raises ``ValueError`` (a negative count, a non-finite bound, an unknown
choice). NumPy scalars are accepted wherever Python ones are (``np.int64(5)`` is an int, ``np.float32``
a float), and every checker returns the value as a plain Python object, so what a callback stores (and
puts in its ``state_key`` and checkpoints) never holds a NumPy type.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from typing import Any


def _type_name(value: Any) -> str:
    return type(value).__name__


def _is_bool(value: Any) -> bool:
    # numpy.bool_ (named "bool" in NumPy 2) is not a subclass of bool
    return isinstance(value, bool) or (
        type(value).__module__ == "numpy" and _type_name(value) in ("bool", "bool_")
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a ``bool``; ``TypeError`` unless it is ``True`` or ``False``."""
    if not _is_bool(value):
        raise TypeError(f"`{name}` must be True or False; got {value!r} ({_type_name(value)})")
    return bool(value)


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> Any:
    """``value`` if it is one of ``allowed``; ``TypeError`` for a wrong type, else ``ValueError``."""
    choices = ", ".join(map(repr, allowed))
    if all(isinstance(a, str) for a in allowed) and not isinstance(value, str):
        raise TypeError(f"`{name}` must be one of {choices}; got {value!r} ({_type_name(value)})")
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {choices}; got {value!r}")
    return value


def check_int(
    name: str, value: Any, minimum: int, allow_none: bool = False, maximum: int | None = None
) -> Any:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (or ``None`` when allowed)."""
    if value is None and allow_none:
        return None
    none = " or None" if allow_none else ""
    upper = f" and <= {maximum}" if maximum is not None else ""
    if not _is_int(value):
        raise TypeError(
            f"`{name}` must be an integer >= {minimum}{upper}{none}; got {value!r} ({_type_name(value)})"
        )
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"`{name}` must be an integer >= {minimum}{upper}{none}; got {value!r}")
    return int(value)


def check_float(
    name: str,
    value: Any,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> Any:
    """``value`` as a finite ``float`` in the interval from ``low`` to ``high`` (or ``None`` when allowed).

    ``low_open`` / ``high_open`` exclude the bound itself. NaN and infinities are refused whatever the
    bounds: an infinite learning rate or threshold is never meant.
    """
    if value is None and allow_none:
        return None
    left = "(" if low_open else "["
    right = ")" if high_open or high == math.inf else "]"
    none = " or None" if allow_none else ""
    allowed = f"a finite number in {left}{low:g}, {high:g}{right}{none}"
    if not _is_real(value):
        raise TypeError(f"`{name}` must be {allowed}; got {value!r} ({_type_name(value)})")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"`{name}` must be {allowed}; got {value!r}")
    below = x <= low if low_open else x < low
    above = x >= high if high_open else x > high
    if below or above:
        raise ValueError(f"`{name}` must be {allowed}; got {value!r}")
    return x


def check_str_list(name: str, value: Any, allow_none: bool = True) -> Any:
    """``value`` as a ``list[str]`` (a list or tuple of strings), or ``None`` when allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"`{name}` must be a list of strings; got {value!r} ({_type_name(value)})")
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise TypeError(f"`{name}` must be a list of strings; got {bad[0]!r} ({_type_name(bad[0])}) in it")
    return list(value)


def check_int_list(name: str, value: Any, minimum: int) -> list[int]:
    """``value`` as a ``list[int]`` (each ``>= minimum``)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"`{name}` must be a list of integers >= {minimum}; got {value!r} ({_type_name(value)})"
        )
    return [check_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value)]


def check_path(name: str, value: Any, allow_none: bool = True) -> Any:
    """``value`` as a ``str`` path (a ``str`` or ``os.PathLike``), or ``None`` when allowed."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{name}` must be a path (str or os.PathLike) or None; got {value!r}")
    return os.fspath(value)
