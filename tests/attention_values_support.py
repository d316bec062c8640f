"""Support for the attention-value tests of every array backend: the scalars no backend
represents and the non-finite sinks each backend's paged attention refuses by name, and
the largest int32 windows, which attend like ``None``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from kvcache_core.contract.scalars import INT32_MAX

#: The windows at the int32 limit (no backend represents more), each attending like ``None``.
LARGEST_INT32_WINDOWS: tuple[dict[str, int], ...] = (
    {"window": INT32_MAX},
    {"sliding_window": INT32_MAX},
    {"chunk": INT32_MAX},
)


def refused_values(array: Callable[[list[float]], Any]) -> list[Any]:
    """``pytest.param(arguments, message)`` for each refused value; ``array`` makes the
    backend's sinks (4 query heads) from a list."""
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("window-past-int32", {"window": 2**31}, f"window must be None or an int >= 1, got {2**31}; valid: 1 to {INT32_MAX}"),
        ("sliding-window-past-int32", {"sliding_window": 2**31}, f"sliding_window must be None or an int >= 1, got {2**31}; valid: 1 to"),
        ("sliding-window-2-to-the-70", {"sliding_window": 2**70}, f"sliding_window must be None or an int >= 1, got {2**70}; valid: 1 to"),
        ("chunk-past-int32", {"chunk": 2**31}, f"chunk must be None or an int >= 1, got {2**31}; valid: 1 to {INT32_MAX}"),
        ("chunk-2-to-the-70", {"chunk": 2**70}, f"chunk must be None or an int >= 1, got {2**70}; valid: 1 to {INT32_MAX}"),
        ("softcap-past-float32", {"softcap": 1e39}, "softcap must be None or a finite number > 0, got 1e+39; valid:"),
        ("softcap-below-float32", {"softcap": 1e-46}, "softcap must be None or a finite number > 0, got 1e-46; valid:"),
        ("scale-past-float32", {"scale": 1e39}, "scale must be a finite number > 0, got 1e+39; valid:"),
        ("scale-below-float32", {"scale": 1e-46}, "scale must be a finite number > 0, got 1e-46; valid:"),
        ("sinks-nan", {"sinks": array([0.0, math.nan, 0.0, 0.0])}, "sinks[1] = nan: sinks must be finite"),
        ("sinks-nan-last", {"sinks": array([0.0, 0.0, 0.0, math.nan])}, "sinks[3] = nan: sinks must be finite"),
        ("sinks-inf", {"sinks": array([math.inf, 0.0, 0.0, 0.0])}, "sinks[0] = inf: sinks must be finite"),
        ("sinks-minus-inf", {"sinks": array([0.0, -math.inf, 0.0, 0.0])}, "sinks[1] = -inf: sinks must be finite"),
    ]  # fmt: skip
    return [pytest.param(arguments, message, id=name) for name, arguments, message in cases]
