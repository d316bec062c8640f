"""The manager internals that :mod:`kvcache_core.offload.prefix_file` and :mod:`kvcache_core.offload.tiers`
move blocks through, named in one place.

Those modules put blocks into the pool and take them out as the manager's own methods do
(under its lock): the allocator, the storage, the prefix map, the per-slot records, taking
and releasing blocks, registering a block and advancing a request's hash chain. This
adapter is the only code that knows where the manager keeps them; its names follow the
manager's pool records (``take``, ``release_table``, ``keep_cached``, ``register``,
``issued``, ``written``, ``swapped_blocks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig
    from kvcache_core.contract.protocols import KvStorage
    from kvcache_core.handle import RequestState
    from kvcache_core.offload.tier_stack import TierChain
    from kvcache_core.paging.allocator import BlockAllocator
    from kvcache_core.paging.block_pool import BlockPool
    from kvcache_core.paging.chains import PrefixChains
    from kvcache_core.paging.prefix import PrefixCache, PrefixEntry

__all__ = ["PoolAccess"]


class PoolAccess:
    """A manager's pool records and operations, for code inside ``kvcache_core`` that moves
    cached blocks. Use it with the manager's lock held.

    Attributes:
        config: the pool's configuration.
        prefix: the prefix cache's hash map (``None`` without prefix caching).
        allocator: free list, reference counts and cached blocks.
        storage: the backend storage.
        issued: ``[slots]`` positions handed out (a write elsewhere is refused).
        written: ``[layers, slots]`` slots holding written K/V (prefix caching only).
        swapped_blocks: blocks a swap-out released (and nobody took since) -> its request.
        group_of: ``[blocks]`` the KV-cache group of each block (what a saved or
            demoted record of it holds).
        tiers: the manager's offload tiers.
    """

    def __init__(self, pool: BlockPool, chains: PrefixChains, tiers: TierChain) -> None:
        self._pool = pool
        self._chains = chains
        self.config: CacheConfig = pool.config
        self.prefix: PrefixCache | None = pool.prefix
        self.allocator: BlockAllocator = pool.allocator
        self.storage: KvStorage[Any] = pool.storage
        self.issued: npt.NDArray[np.bool_] = pool.issued
        self.written: npt.NDArray[np.bool_] | None = pool.written
        self.swapped_blocks: dict[int, str] = pool.swapped_blocks
        self.group_of: npt.NDArray[np.int16] = pool.group_of
        self.tiers: TierChain = tiers

    def take(self, count: int, after: int | None, expected: int | None, failure: str, group: int = 0) -> list[int]:
        """Blocks from the allocator for KV-cache group ``group``, evicting (and demoting)
        cached ones when the free ones do not suffice; their slots start unissued and
        unwritten."""
        return self._pool.take(count, after, expected, failure, group)

    def release_table(self, blocks: list[int]) -> list[int]:
        """Drop a request's reference on its whole table (registered blocks stay cached)."""
        return self._pool.release_table(blocks)

    def keep_cached(self, block: int) -> bool:
        """Whether ``block`` stays cached when its last reference goes."""
        return self._pool.keep_cached(block)

    def pick_block(self, entry: PrefixEntry, group: int) -> int | None:
        """A block of ``entry`` in KV-cache group ``group`` to map (one in use if any), or
        ``None`` if the group holds none."""
        return self._pool.pick_block(entry, group)

    def register(self, block: int, entry: PrefixEntry) -> None:
        """Record that ``block`` holds ``entry``'s tokens (it becomes immutable)."""
        self._pool.register(block, entry)

    def advance_chain(self, state: RequestState[Any]) -> None:
        """Hash and register the request's next blocks while they are cacheable."""
        self._chains.advance(state)
