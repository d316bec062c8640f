"""What the benchmark scripts share (imported from the scripts' own folder): the recommended
environment, the tolerance of fp32 paged against dense attention, the cache geometry,
request lengths and staggered batches, and how figures are printed."""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheHandle, PagedKvCacheManager
from kvcache_core.paging.allocator import Placement

__all__ = [
    "ATOL",
    "RECOMMENDED_ENV",
    "RTOL",
    "Geometry",
    "draw_lengths",
    "grow_staggered",
    "int_list",
    "mib",
    "print_environment",
    "ratio",
    "relative_spread",
]

#: glibc keeps large buffers instead of returning them to the OS after every step, which
#: otherwise dominates the time of the caches that reallocate (dense, DynamicCache).
RECOMMENDED_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}

#: fp32 outputs of paged (per-run products, online softmax) and dense attention differ in the
#: last bits only: ``allclose(paged, dense, rtol=RTOL, atol=ATOL)``.
RTOL = 1e-4
ATOL = 1e-5


def print_environment() -> None:
    """Print the recommended environment and whether this process has it."""
    missing = [key for key, value in RECOMMENDED_ENV.items() if os.environ.get(key) != value]
    recommended = " ".join(f"{key}={value}" for key, value in RECOMMENDED_ENV.items())
    print(f"recommended environment: {recommended} ({'set' if not missing else 'NOT set: ' + ', '.join(missing)})")


@dataclass(frozen=True)
class Geometry:
    """The model whose cache is benchmarked, and our pool's layout and block placement."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"
    kv_layout: str = "NHD"
    placement: Placement = "contiguous"

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_query_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        """The score scale, ``1 / sqrt(head_dim)``."""
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block of one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        """One line: heads, dims, dtype, blocks, layout, placement."""
        return (
            f"{self.num_layers} layers, {self.num_query_heads} query heads, {self.num_kv_heads} KV heads, "
            f"head_dim {self.head_dim}, {self.dtype}, block_size {self.block_size}, pool layout {self.kv_layout}, "
            f"placement {self.placement}"
        )

    def config(self, num_blocks: int, *, num_layers: int | None = None, **fields: Any) -> CacheConfig:
        """A ``CacheConfig`` of this geometry with ``num_blocks`` blocks (and ``num_layers``
        layers instead of this geometry's, when given)."""
        return CacheConfig(
            num_layers=self.num_layers if num_layers is None else num_layers,
            num_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_blocks=num_blocks,
            block_size=self.block_size,
            dtype=self.dtype,
            kv_layout=self.kv_layout,
            **fields,
        )


def draw_lengths(seed: int, count: int, min_length: int, max_length: int) -> list[int]:
    """``count`` request lengths, uniform in ``[min_length, max_length]``, the same for a seed."""
    draw = random.Random(seed)
    return [draw.randint(min_length, max_length) for _ in range(count)]


def grow_staggered(
    manager: PagedKvCacheManager[Any], lengths: Sequence[int]
) -> tuple[list[PagedKvCacheHandle[Any]], list[npt.NDArray[np.int64]]]:
    """Requests ``request-<r>`` grown side by side, one token per step each, as a serving
    engine places them: request ``r`` arrives at step ``max(lengths) - lengths[r]``, so at
    the end every one holds its length and is still decoding. Returns the handles and each
    request's slots, in token order (nothing is written)."""
    longest = max(lengths)
    handles: list[PagedKvCacheHandle[Any] | None] = [None] * len(lengths)
    slot_parts: list[list[npt.NDArray[np.int64]]] = [[] for _ in lengths]
    for step in range(longest):
        for request, length in enumerate(lengths):
            if step < longest - length:
                continue
            handle = handles[request]
            if handle is None:
                handle = manager.allocate(AllocationRequest(f"request-{request}"))
                handles[request] = handle
            slot_parts[request].append(manager.extend(handle, 1))
    ready = [handle for handle in handles if handle is not None]
    return ready, [np.concatenate(parts) for parts in slot_parts]


def int_list(text: str, minimum: int = 1) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]`` (an argparse type; each value >= ``minimum``)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def ratio(numerator: float, denominator: float) -> str:
    """``numerator / denominator`` as printed in the tables: ``"1.27x"``."""
    return f"{numerator / denominator:.2f}x"


def relative_spread(samples: Sequence[float]) -> float:
    """Interquartile range over median (0 with fewer than two samples)."""
    if len(samples) < 2:
        return 0.0
    low, _, high = statistics.quantiles(samples, n=4)
    return (high - low) / statistics.median(samples)


def mib(num_bytes: float) -> str:
    """``1_572_864`` -> ``"1.5 MiB"``."""
    return f"{num_bytes / 2**20:,.1f} MiB"
