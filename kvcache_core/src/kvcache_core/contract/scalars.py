"""Scalar arguments: one check per kind of number, each normalized to a plain Python type.

Every count, position, window, threshold and scale a caller hands kvcache (configuration
fields and per-call arguments) goes through one of these. NumPy integers and floats come
back as ``int`` and ``float``, so they compare, hash and serialize (JSON headers, event
payloads) like Python's own; a bool is refused where a number is meant. The ranges are
what every backend represents: positions, lengths, windows and chunks fit int32 (page
tables and kernels index with it), and positive scales are normal float32 numbers (what
pools and kernels compute in: beyond them a value overflows to infinity or vanishes to 0).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Final, TypeAlias, cast

import numpy as np

from kvcache_core.errors import InvalidArgumentError, KvCacheError

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "INT32_MAX",
    "IntLike",
    "RealLike",
    "as_integer",
    "check_count",
    "check_flag",
    "check_optional_count",
    "check_positive_float32",
    "check_real",
    "shown",
]

#: An integer argument: Python's or NumPy's (stored as ``int``).
IntLike: TypeAlias = "int | np.integer[Any]"

#: A real argument: Python's or NumPy's (stored as ``float``).
RealLike: TypeAlias = "float | np.floating[Any] | np.integer[Any]"

#: The largest int32: the most positions a page table, a window or a chunk spans.
INT32_MAX: Final = 2**31 - 1

#: The largest finite float32.
FLOAT32_MAX: Final = float(np.finfo(np.float32).max)

#: The smallest normal float32 > 0: below it float32 loses precision, then rounds to 0.
FLOAT32_TINY: Final = float(np.finfo(np.float32).tiny)


def _is_bool(value: object) -> bool:
    return isinstance(value, (bool, np.bool_))


def as_integer(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer, Python's or NumPy's (a bool is not);
    ``None`` otherwise."""
    if type(value) is int:  # the common case, without the ABC checks
        return value
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def shown(value: object) -> str:
    """``repr(value)`` for a message, at most about 80 characters (a huge int's digits,
    which Python may refuse to print at all, are cut)."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"an int of {cast('int', value).bit_length()} bits"
    return text if len(text) <= 80 else f"{text[:60]}...{text[-15:]} ({len(text)} characters)"


def _count_message(value: object, name: str, minimum: int, maximum: int | None, *, optional: bool) -> str:
    text = f"{name} must be {'None or ' if optional else ''}an int >= {minimum}, got {shown(value)}"
    return text if maximum is None else f"{text}; valid: {minimum} to {maximum}"


def check_count(
    value: object,
    name: str,
    minimum: int = 0,
    maximum: int | None = None,
    *,
    error: type[KvCacheError] = InvalidArgumentError,
) -> int:
    """``value`` as an ``int``, if it is an integer (Python or NumPy, not a bool) in
    ``[minimum, maximum]`` (no upper bound for ``maximum=None``).

    Raises:
        InvalidArgumentError: anything else (or ``error``); the message names ``name``,
            the value and the valid range.
    """
    number = as_integer(value)
    if number is None or number < minimum or (maximum is not None and number > maximum):
        raise error(_count_message(value, name, minimum, maximum, optional=False))
    return number


def check_optional_count(
    value: object,
    name: str,
    minimum: int = 1,
    maximum: int | None = INT32_MAX,
    *,
    error: type[KvCacheError] = InvalidArgumentError,
) -> int | None:
    """``None``, or ``value`` as an ``int`` in ``[minimum, maximum]`` (see :func:`check_count`).

    Raises:
        InvalidArgumentError: anything else (or ``error``); the message names ``name``,
            the value and the valid range.
    """
    if value is None:
        return None
    number = as_integer(value)
    if number is None or number < minimum or (maximum is not None and number > maximum):
        raise error(_count_message(value, name, minimum, maximum, optional=True))
    return number


def check_real(value: object, name: str, *, error: type[KvCacheError] = InvalidArgumentError) -> float:
    """``value`` as a ``float``, if it is a real number (Python or NumPy, not a bool) within
    the float range; NaN and infinities pass (the caller bounds the range).

    Raises:
        InvalidArgumentError: anything else (or ``error``), naming ``name``.
    """
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be a real number, got {shown(value)}")
    try:
        return float(value)
    except OverflowError as exc:  # an int past the float range
        raise error(f"{name} = {shown(value)} is beyond the float range") from exc


def check_positive_float32(
    value: object,
    name: str,
    maximum: float = FLOAT32_MAX,
    *,
    optional: bool = False,
    error: type[KvCacheError] = InvalidArgumentError,
) -> float:
    """``value`` as a ``float``, if it is a finite real number (Python or NumPy, not a bool)
    in ``[FLOAT32_TINY, maximum]``: a positive scale float32 holds as a normal number.

    Args:
        optional: the message says ``None`` is valid too (the caller handles ``None``).

    Raises:
        InvalidArgumentError: anything else (or ``error``); the message names ``name``,
            the value and the valid range.
    """
    if type(value) is float and math.isfinite(value) and FLOAT32_TINY <= value <= maximum:
        return value  # the common case, without building the message

    def message() -> str:
        return (
            f"{name} must be {'None or ' if optional else ''}a finite number > 0, got {shown(value)}; "
            f"valid: {FLOAT32_TINY!r} to {maximum!r} (a normal float32)"
        )

    try:
        number = check_real(value, name, error=error)
    except KvCacheError as exc:
        raise error(message()) from exc
    if not (math.isfinite(number) and FLOAT32_TINY <= number <= maximum):
        raise error(message())
    return number


def check_flag(value: object, name: str, *, error: type[KvCacheError] = InvalidArgumentError) -> bool:
    """``value`` as a ``bool``, if it is one (Python's or NumPy's).

    Raises:
        InvalidArgumentError: anything else (or ``error``), naming ``name``.
    """
    if not _is_bool(value):
        raise error(f"{name} must be a bool, got {shown(value)}")
    return bool(value)
