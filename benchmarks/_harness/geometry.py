"""The cache a benchmark measures: its geometry, the requests' lengths, requests grown side
by side as a serving engine places them, and one decode step through the manager."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheHandle, PagedKvCacheManager
from kvcache_core.paging.allocator import Placement

__all__ = ["Geometry", "StepInputs", "draw_lengths", "grow_staggered", "mib", "paged_decode_step"]

Array = TypeVar("Array")


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

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens of one request."""
        return math.ceil(tokens / self.block_size)

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


@dataclass(frozen=True)
class StepInputs(Generic[Array]):
    """What the model hands the cache in one decode step, per layer: new keys and values
    ``[batch, kv_heads, head_dim]``, queries ``[batch, query_heads, head_dim]``."""

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    queries: tuple[Array, ...]


def paged_decode_step(
    manager: PagedKvCacheManager[Array], handles: Sequence[PagedKvCacheHandle[Array]], inputs: StepInputs[Array]
) -> list[Array]:
    """One decode step through the manager's step, as a model runs it (``PagedCache`` makes the
    same calls): planned once (every request grows by one token), then per layer one
    ``step.write_and_attend`` of the batch's K/V and queries (each layer's window, if any, from
    the pool's layer specs). ``[batch, q_heads, D]`` per layer."""
    step = manager.begin_step(handles, 1)
    return [
        step.write_and_attend(layer, inputs.keys[layer], inputs.values[layer], inputs.queries[layer])
        for layer in range(manager.config.num_layers)
    ]


def mib(num_bytes: float) -> str:
    """``1_572_864`` -> ``"1.5 MiB"``."""
    return f"{num_bytes / 2**20:,.1f} MiB"
