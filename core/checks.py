"""Type, range and finiteness checks for values that enter from users (options, config files).

Each check returns the value as a plain Python ``int``/``float``/``bool`` or raises
``error`` (default :class:`InvalidInputError`) with a message that names the value, says
what it must be and shows what was given.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import InvalidInputError, OnnxGenrtError


def _range_text(minimum: float | None, maximum: float | None, open_min: bool) -> str:
    low = "" if minimum is None else (f"> {minimum}" if open_min else f">= {minimum}")
    high = "" if maximum is None else f"<= {maximum}"
    return " and ".join(p for p in (low, high) if p)


def check_int(
    value: Any,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    integral_floats: bool = False,
    error: type[OnnxGenrtError] = InvalidInputError,
) -> int:
    """``value`` as an int within ``[minimum, maximum]``. Booleans are refused; floats only
    when ``integral_floats`` (JSON writes 1e9 as a float) and their value is a whole number."""
    wanted = "an integer" + (
        f" {_range_text(minimum, maximum, False)}" if minimum is not None or maximum else ""
    )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")
    if not isinstance(value, numbers.Integral):
        number = float(value)
        if not (integral_floats and math.isfinite(number) and number.is_integer()):
            raise error(f"{name} must be {wanted}, got {value!r}")
        value = int(number)
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise error(f"{name} must be {wanted}, got {value}")
    return value


def check_float(
    value: Any,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    open_min: bool = False,
    error: type[OnnxGenrtError] = InvalidInputError,
) -> float:
    """``value`` as a finite float within the range (``open_min``: strictly above minimum)."""
    bounds = _range_text(minimum, maximum, open_min)
    wanted = "a finite number" + (f" {bounds}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number):
        raise error(f"{name} must be {wanted}, got {number}")
    too_low = minimum is not None and (number <= minimum if open_min else number < minimum)
    if too_low or (maximum is not None and number > maximum):
        raise error(f"{name} must be {wanted}, got {number}")
    return number


def check_bool(value: Any, name: str, *, error: type[OnnxGenrtError] = InvalidInputError) -> bool:
    """``value`` as a bool; only ``True``/``False`` (and numpy bools) are accepted."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise error(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
