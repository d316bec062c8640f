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
        memory_bytes: bytes its blocks take in the pool (all layers, K and V, pool dtype);
            a block shared with other requests counts in full for each.
        blocks_allocated: blocks held in its table, in every KV-cache group's table (0
            while swapped out).
        tokens_stored: tokens of its sequence held in the pool: ``num_tokens()`` less the
            positions a sliding window released, summed over its KV-cache groups (each
            group holds its own copy of a position: its layers') (0 while swapped out).
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
        active_caches: live requests (swapped-out ones included).
        total_blocks, free_blocks, used_blocks, cached_blocks:
            ``free_blocks + used_blocks + cached_blocks == total_blocks``. Used blocks have a
            reference; cached blocks have none but keep a prefix for later hits and are
            evicted (least recently used first) when free blocks run out.
        tokens_stored: tokens held in the pool by all live requests (a shared block's
            tokens count once per request sharing it; a position once per KV-cache group
            holding it).
        utilization: ``tokens_stored / (used_blocks * block_size)``; 0 with no blocks used.
            Above 1 when requests share blocks.
        cache_hit_rate: ``prefix_cache_hits / prefix_cache_queries``; 0 before any query.
        eviction_count: cached blocks evicted so far (to make room, or by ``gc()``).
        allocation_count: successful ``allocate`` calls.
        allocation_failures: ``allocate``, ``extend``, ``fork`` or ``swap_in`` calls refused
            for lack of blocks.
        pressure: the current :class:`MemoryPressure` level.
        prefix_cache_queries: full prompt blocks looked up in the prefix cache (at most
            ``(len(prompt) - 1) // block_size`` per request: the last prompt token is always
            computed).
        prefix_cache_hits: of those, blocks found cached and mapped.
        hash_collisions: lookups or insertions that met the same hash with other tokens
            (treated as misses).
        copy_on_write_count: shared blocks copied because one sharer was about to write.
        swapped_out_requests: requests whose blocks are in host memory.
        swapped_out_blocks: blocks held in host memory for them.
        swapped_out_memory_bytes: host bytes those blocks take (and their recurrent states).
        state_slots: slots of the state pool (recurrent-state layers; 0 without them).
        used_state_slots: of those, held by live resident requests.
        state_memory_bytes: bytes of the state pool (``state_slots`` times the state bytes
            of one request), included in ``total_memory_bytes``; the held slots' bytes are
            included in ``used_memory_bytes``.
        checkpoint_state_slots: free state slots holding checkpoints (evictable).
        group_bytes_per_token: per KV-cache group, the bytes one token takes in the pool
            (``bytes_per_block / block_size``: a block serves any group, so a group whose
            layers are narrower than the widest is padded to it).
        group_layer_bytes_per_token: per KV-cache group, the bytes one token of its layers'
            K/V takes at their own geometry (at most ``group_bytes_per_token``; the
            difference is padding).
        group_used_blocks: per KV-cache group, the blocks its live requests' tables hold (a
            block shared by requests counts once); their bytes are ``group_used_blocks[g] *
            block_size * group_bytes_per_token[g]``.
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
    cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    hash_collisions: int = 0
    copy_on_write_count: int = 0
    swapped_out_requests: int = 0
    swapped_out_blocks: int = 0
    swapped_out_memory_bytes: int = 0
    state_slots: int = 0
    used_state_slots: int = 0
    state_memory_bytes: int = 0
    checkpoint_state_slots: int = 0
    group_bytes_per_token: tuple[int, ...] = ()
    group_layer_bytes_per_token: tuple[int, ...] = ()
    group_used_blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CacheGcStats:
    """What one ``gc()`` reclaimed.

    Attributes:
        memory_freed: bytes returned to the free pool.
        caches_freed: requests whose caches were released (``gc()`` never ends a live
            request: 0).
        blocks_freed: blocks returned to the free pool (the cached blocks it evicted).
        gc_time_ms: wall time the collection took.
    """

    memory_freed: int
    caches_freed: int
    blocks_freed: int
    gc_time_ms: float
