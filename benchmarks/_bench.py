"""Small helpers the benchmark scripts share (imported from the scripts' own folder)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

__all__ = ["int_list", "mib", "relative_spread"]


def int_list(text: str) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]`` (an argparse type)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def relative_spread(samples: Sequence[float]) -> float:
    """Interquartile range over median (0 with fewer than two samples)."""
    if len(samples) < 2:
        return 0.0
    low, _, high = statistics.quantiles(samples, n=4)
    return (high - low) / statistics.median(samples)


def mib(num_bytes: float) -> str:
    """``1_572_864`` -> ``"1.5 MiB"``."""
    return f"{num_bytes / 2**20:,.1f} MiB"
