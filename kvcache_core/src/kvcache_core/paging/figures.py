"""The figures of a whole pool: what ``PagedKvCacheManager.stats`` reports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvcache_core.contract.config import SCALE_BYTES
from kvcache_core.contract.stats import CacheManagerStats, MemoryPressure
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.request_state import RequestState

__all__ = ["manager_stats"]


def manager_stats(
    pool: BlockPool,
    chains: PrefixChains,
    requests: Mapping[str, RequestState[Any]],
    pressure: MemoryPressure,
    allocation_count: int,
) -> CacheManagerStats:
    """The figures of a manager's pool; tokens and blocks count every KV-cache group."""
    config = pool.config
    used = pool.allocator.used_block_count()
    tokens = sum(table.held_tokens() for state in requests.values() for table in state.tables)
    capacity = used * config.block_size
    swapped = [state.swap for state in requests.values() if state.swap is not None]
    states = pool.states
    state_bytes = config.states.bytes_per_slot
    return CacheManagerStats(
        total_memory_bytes=config.num_blocks * config.bytes_per_block + states.memory_bytes,
        used_memory_bytes=used * config.bytes_per_block + len(states.taken) * state_bytes,
        active_caches=len(requests),
        total_blocks=config.num_blocks,
        free_blocks=pool.allocator.free_block_count(),
        used_blocks=used,
        tokens_stored=tokens,
        utilization=tokens / capacity if capacity else 0.0,
        cache_hit_rate=chains.hits / chains.queries if chains.queries else 0.0,
        eviction_count=pool.eviction_count,
        allocation_count=allocation_count,
        allocation_failures=pool.allocation_failures + pool.states.failures,
        pressure=pressure,
        cached_blocks=pool.allocator.cached_block_count(),
        prefix_cache_queries=chains.queries,
        prefix_cache_hits=chains.hits,
        hash_collisions=chains.collisions,
        copy_on_write_count=pool.copy_on_write_count,
        swapped_out_requests=len(swapped),
        swapped_out_blocks=sum(record.num_blocks for record in swapped),
        swapped_out_memory_bytes=sum(record.memory_bytes for record in swapped)
        + sum(state_bytes for state in requests.values() if state.state_host is not None),
        state_slots=states.num_slots,
        used_state_slots=len(states.taken),
        state_memory_bytes=states.memory_bytes,
        checkpoint_state_slots=len(states.checkpoints),
        group_bytes_per_token=(config.bytes_per_block // config.block_size,) * config.num_groups,
        group_layer_bytes_per_token=tuple(
            config.storage_layers.layer_bytes_per_token(
                group, config.dtype_size, SCALE_BYTES if config.quantized else 0
            )
            for group in config.kv_groups
        ),
        group_used_blocks=tuple(
            len({block for state in requests.values() for block in state.tables[group].physical_blocks})
            for group in range(config.num_groups)
        ),
    )
