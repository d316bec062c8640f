"""Read-only figures reported by handles and managers, and the memory pressure levels."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["CacheGcStats", "CacheHandleStats", "CacheManagerStats", "MemoryPressure"]


class MemoryPressure(enum.IntEnum):
    """How full the pool is, against the thresholds of :class:`~kvcache_core.CacheConfig`.

    Ordered: ``LOW < MEDIUM < HIGH < CRITICAL``.
    """

    LOW = 0
    MEDIUM = 1
    HIGH = 2
    CRITICAL = 3

    @classmethod
    def from_usage(cls, used_fraction: float, medium: float, high: float, critical: float) -> MemoryPressure:
        """The level for a fraction of the pool in use (``0.0`` to ``1.0``)."""
        if used_fraction >= critical:
            return cls.CRITICAL
        if used_fraction >= high:
            return cls.HIGH
        if used_fraction >= medium:
            return cls.MEDIUM
        return cls.LOW


@dataclass(frozen=True, slots=True)
class CacheHandleStats:
    """Figures of one request's cache.

    Attributes:
        memory_bytes: bytes its blocks take in the pool (all layers, K and V, pool dtype).
        blocks_allocated: blocks in its table.
        tokens_stored: tokens in its sequence.
        utilization: ``tokens_stored / (blocks_allocated * block_size)``; 0 with no blocks.
        last_access: ``time.monotonic()`` of the last allocate, extend, write or read.
    """

    memory_bytes: int
    blocks_allocated: int
    tokens_stored: int
    utilization: float
    last_access: float


@dataclass(frozen=True, slots=True)
class CacheManagerStats:
    """Figures of a whole pool.

    Attributes:
        total_memory_bytes: bytes of the whole pool.
        used_memory_bytes: bytes of the blocks in use.
        active_caches: live requests.
        total_blocks, free_blocks, used_blocks: ``free_blocks + used_blocks == total_blocks``.
        tokens_stored: tokens held by all live requests.
        utilization: ``tokens_stored / (used_blocks * block_size)``; 0 with no blocks used.
        cache_hit_rate: prefix-cache hits over lookups (0 while prefix caching is off).
        eviction_count: cached blocks evicted so far.
        allocation_count: successful ``allocate`` calls.
        allocation_failures: ``allocate`` or ``extend`` calls refused for lack of blocks.
        pressure: the current :class:`MemoryPressure` level.
    """

    total_memory_bytes: int
    used_memory_bytes: int
    active_caches: int
    total_blocks: int
    free_blocks: int
    used_blocks: int
    tokens_stored: int
    utilization: float
    cache_hit_rate: float
    eviction_count: int
    allocation_count: int
    allocation_failures: int
    pressure: MemoryPressure


@dataclass(frozen=True, slots=True)
class CacheGcStats:
    """What one ``gc()`` reclaimed.

    Attributes:
        memory_freed: bytes returned to the free pool.
        caches_freed: requests whose caches were released.
        blocks_freed: blocks returned to the free pool.
        gc_time_ms: wall time the collection took.
    """

    memory_freed: int
    caches_freed: int
    blocks_freed: int
    gc_time_ms: float
