"""Read-only views of a paged manager's internals, for the conformance kit and tests.

The manager's public face does not expose its block records; a test that must look at them
(reference counts, the free list, the prefix cache's entries, a request's host copy) reads
them here, the one place that knows where the manager keeps them. Read only: changing what
these return bypasses the manager's ownership records.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.handle import PagedKvCacheHandle, handle_state
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.paging.allocator import BlockAllocator
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.prefix import PrefixCache
from kvcache_core.paging.request_state import RequestState

__all__ = [
    "allocator",
    "block_pool",
    "cached_blocks",
    "free_blocks",
    "pool_hashes",
    "prefix_cache",
    "ref_counts",
    "request_blocks",
    "request_state",
]


def block_pool(manager: PagedKvCacheManager[Any]) -> BlockPool:
    """The manager's per-block records (allocator, prefix registrations, slot records)."""
    return manager._pool  # pyright: ignore[reportPrivateUsage]


def allocator(manager: PagedKvCacheManager[Any]) -> BlockAllocator:
    """The manager's block allocator: free list, reference counts, cached blocks."""
    return block_pool(manager).allocator


def prefix_cache(manager: PagedKvCacheManager[Any]) -> PrefixCache | None:
    """The manager's prefix-cache hash map (``None`` without prefix caching)."""
    return block_pool(manager).prefix


def pool_hashes(manager: PagedKvCacheManager[Any]) -> frozenset[bytes]:
    """The block hashes the manager's prefix cache holds (none without prefix caching)."""
    prefix = prefix_cache(manager)
    return frozenset() if prefix is None else frozenset(entry.block_hash for entry in prefix.entries())


def ref_counts(manager: PagedKvCacheManager[Any], blocks: list[int]) -> list[int]:
    """The reference count of each of ``blocks``."""
    counts = allocator(manager)
    return [counts.ref_count(block) for block in blocks]


def cached_blocks(manager: PagedKvCacheManager[Any]) -> list[int]:
    """The cached (evictable) blocks, least recently used first."""
    return list(allocator(manager).cached_blocks())


def free_blocks(manager: PagedKvCacheManager[Any]) -> npt.NDArray[np.int64]:
    """The blocks nobody holds (free or cached), ascending."""
    return np.flatnonzero(~allocator(manager).in_use_mask()).astype(np.int64)


def request_state(handle: PagedKvCacheHandle[Any]) -> RequestState[Any]:
    """What the manager knows of the handle's request (shared by every handle to it)."""
    return handle_state(handle)


def request_blocks(handle: PagedKvCacheHandle[Any]) -> list[list[int]]:
    """The pool blocks the request holds, per KV-cache group, in logical order."""
    return [list(table.physical_blocks) for table in handle.block_tables()]
