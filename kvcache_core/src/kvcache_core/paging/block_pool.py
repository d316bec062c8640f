"""The block pool: every record the manager keeps per block of the pool.

One :class:`BlockPool` per manager holds the allocator (free list, reference counts,
cached blocks), the prefix cache's registrations, which slots hold written K/V (prefix
caching), which slots were handed out (a write anywhere else is refused), the blocks a
swap-out released and the ownership epoch that stale page tables and steps are checked
against. Its operations take, release, evict and copy blocks; each returns or records
what it changed, and none of them knows about requests beyond the block lists it is given.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.protocols import KvStorage
from kvcache_core.errors import OutOfBlocksError
from kvcache_core.paging.allocator import BlockAllocator, Placement
from kvcache_core.paging.prefix import PrefixCache, PrefixEntry
from kvcache_core.paging.request_state import RequestState, SwapRecord, next_generation
from kvcache_core.paging.state_slots import StateSlots

__all__ = ["BlockPool", "EvictionSink", "blocks_for"]


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that ``tokens`` positions fill (ceil division)."""
    return -(-tokens // block_size)


class EvictionSink(Protocol):
    """What takes copies of the cached blocks the pool is about to evict (the offload tier
    stack implements it; the manager wires it to the pool)."""

    def before_evict(self, pool: BlockPool, count: int) -> None:
        """Called with the ``count`` least recently used cached blocks of ``pool``
        (``pool.allocator.cached_blocks()[:count]``) still in place, before they leave."""
        ...


class BlockPool:
    """The pool's per-block records and the operations that change them (manager internals).

    Attributes:
        allocator: free list, reference counts and cached blocks.
        prefix: the prefix cache's hash map (``None`` without prefix caching).
        written: ``[pool_layers, slots]`` which slots hold written K/V (prefix caching only).
        group_of: ``[blocks]`` the KV-cache group each block was last taken for (what its
            storage layers hold); -1 for a block never taken.
        issued: ``[slots]`` positions handed out by extend, a prefix hit, a copy or swap_in.
        registered: ``[blocks]`` blocks the prefix cache serves (immutable).
        swapped_blocks: blocks a swap-out released (and nobody took since) -> its request.
        epoch: bumped on every change of a request's blocks or plan; a page table or step
            checked in the current epoch needs no new check.
        immutable_epoch: bumped whenever a block may have become immutable (registered in
            the prefix cache, or shared by a fork); slots found writable in the current
            epoch are still writable (see :meth:`retain`).
        states: the state pool's slots (recurrent-state layers; empty without them).
    """

    def __init__(self, config: CacheConfig, storage: KvStorage[Any], placement: Placement) -> None:
        self.config = config
        self.storage = storage
        self.allocator = BlockAllocator(config.num_blocks, placement)
        self.states = StateSlots(config, storage)
        slots = config.num_blocks * config.block_size
        self.prefix: PrefixCache | None = PrefixCache(config.model_id) if config.enable_prefix_caching else None
        self.written: npt.NDArray[np.bool_] | None = (
            np.zeros((config.pool_layers, slots), dtype=np.bool_) if config.enable_prefix_caching else None
        )
        self.group_of = np.full(config.num_blocks, -1, dtype=np.int16)
        layers = config.storage_layers
        # Per group, its storage layers' rows of ``written`` where pages hold several geometries.
        self._group_rows: tuple[list[int], ...] = (
            tuple(list(layers.group_rows(group)) for group in config.kv_groups) if layers.shares_pages else ()
        )
        self.issued = np.zeros(slots, dtype=np.bool_)
        self.registered = np.zeros(config.num_blocks, dtype=np.bool_)
        self.swapped_blocks: dict[int, str] = {}
        self.epoch = 0
        self.immutable_epoch = 0
        self.eviction_count = 0
        self.allocation_failures = 0
        self.copy_on_write_count = 0
        # Takes copies of cached blocks before they are evicted (offload tiers demote them).
        self.eviction_sink: EvictionSink | None = None

    # -- counts and messages -----------------------------------------------------------

    def available(self) -> int:
        """Blocks a request could take now: free ones and evictable cached ones."""
        return self.allocator.free_block_count() + self.allocator.cached_block_count()

    def free_note(self) -> str:
        free, cached = self.allocator.free_block_count(), self.allocator.cached_block_count()
        note = f"{free} of {self.config.num_blocks} are free"
        return f"{note} and {cached} cached blocks evictable" if cached else note

    def shortage(self, message: str) -> OutOfBlocksError:
        """Count an allocation failure; the error to raise, ending with the free blocks."""
        self.allocation_failures += 1
        return OutOfBlocksError(f"{message}, {self.free_note()}")

    # -- taking and releasing ----------------------------------------------------------

    def take(self, count: int, after: int | None, expected: int | None, failure: str, group: int = 0) -> list[int]:
        """Blocks from the allocator for KV-cache group ``group``, evicting cached blocks
        (oldest first) when the free ones do not suffice; their slots start unissued and
        unwritten."""
        free = self.allocator.free_block_count()
        if count > free:
            if count > self.available():
                raise self.shortage(f"{failure}: {count} blocks needed")
            self.evict(count - free)
        blocks = self.allocator.allocate(count, after=after, expected=expected)
        if blocks:
            self.group_of[blocks] = group
            block_slots = self.block_slots(np.asarray(blocks, dtype=np.int64))
            self.issued[block_slots] = False
            if self.written is not None:
                self.written[:, block_slots] = False
            if self.swapped_blocks:
                for block in blocks:
                    self.swapped_blocks.pop(block, None)
        return blocks

    def evict(self, count: int) -> None:
        """Evict the ``count`` least recently used cached blocks to the free list."""
        if not count:
            return
        assert self.prefix is not None, "cached blocks without a prefix cache"
        if self.eviction_sink is not None:
            self.eviction_sink.before_evict(self, count)  # the tiers take copies of the blocks about to leave
        for block in self.allocator.evict(count):
            self.unregister(block)
        self.eviction_count += count

    def keep_cached(self, block: int) -> bool:
        return self.prefix is not None and self.prefix.is_registered(block)

    def release(self, blocks: list[int], tail: int | None) -> list[int]:
        """Drop one reference on each of ``blocks`` (in that order); those reaching zero
        stay cached if registered, else become free. Returns the blocks that reached zero."""
        return self.allocator.release(blocks, tail, self.keep_cached)

    def release_table(self, blocks: list[int]) -> list[int]:
        """Drop a request's reference on its whole table; later blocks go first, so within
        a request the tail is evicted first. Returns those that reached zero."""
        tail = blocks[-1] if blocks and self.allocator.ref_count(blocks[-1]) == 1 else None
        return self.release(blocks[::-1], tail)

    def sole_holder(self, block: int | None) -> int | None:
        """``block`` if exactly one request holds it (a placement hint), else ``None``."""
        return block if block is not None and self.allocator.ref_count(block) == 1 else None

    def copies_of(
        self,
        sources: list[int],
        hints: list[int | None],
        follows: list[bool],
        what: str,
        groups: list[int] | None = None,
    ) -> list[int]:
        """Transactional copy: take one block per source, copy all in one
        ``storage.copy_blocks`` call. Whatever the storage raises (``KeyboardInterrupt``
        included), the copies go back to the free list and nothing changed.

        ``hints[i]`` is the block copy ``i`` should follow (placement), replaced by the
        previous copy where ``follows[i]`` (consecutive logical blocks).
        """
        copies: list[int] = []
        try:
            for index, source in enumerate(sources):
                hint = copies[-1] if copies and follows[index] else hints[index]
                group = 0 if groups is None else groups[index]
                (copy,) = self.take(1, self.sole_holder(hint), None, f"cannot copy block {source} of {what}", group)
                copies.append(copy)
            self.storage.copy_blocks(np.asarray(sources, dtype=np.int64), np.asarray(copies, dtype=np.int64))
        except BaseException:
            if copies:
                self.allocator.release(copies[::-1], copies[-1])
            raise
        return copies

    def carry_slots(self, source: int, copy: int, own: int) -> None:
        """The records of the first ``own`` slots of ``source`` now describe ``copy``."""
        block_size = self.config.block_size
        source_slots = slice(source * block_size, source * block_size + own)
        copy_slots = slice(copy * block_size, copy * block_size + own)
        if self.written is not None:
            self.written[:, copy_slots] = self.written[:, source_slots]
        self.issued[copy_slots] = self.issued[source_slots]

    def forget_from(self, block: int, offset: int) -> None:
        """Slots ``offset ..`` of ``block`` are handed out anew later: not issued, not written."""
        block_size = self.config.block_size
        cut = slice(block * block_size + offset, (block + 1) * block_size)
        self.issued[cut] = False
        if self.written is not None:
            self.written[:, cut] = False

    def block_slots(self, blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Every slot of ``blocks``, block by block: ``[len(blocks) * block_size]``."""
        block_size = self.config.block_size
        slots: npt.NDArray[np.int64] = (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)
        return slots

    # -- prefix-cache registrations and writes -----------------------------------------

    def register(self, block: int, entry: PrefixEntry) -> None:
        """``block`` holds ``entry``'s tokens: it becomes immutable (writes are refused)."""
        assert self.prefix is not None
        self.prefix.register(block, entry)
        self.registered[block] = True
        self.immutable_epoch += 1

    def retain(self, block: int) -> None:
        """One more reference on the in-use ``block`` (a fork or a prefix hit maps it): a
        shared block is immutable, so slots checked writable before are checked again."""
        self.immutable_epoch += 1
        self.allocator.retain(block)

    def unregister(self, block: int) -> None:
        assert self.prefix is not None
        self.prefix.unregister(block)
        self.registered[block] = False

    def pick_block(self, entry: PrefixEntry, group: int = 0) -> int | None:
        """A block of ``entry`` in KV-cache group ``group`` to map: one already in use if
        any (keeps the cache whole); ``None`` if the group holds none."""
        found = None
        for block in entry.blocks:
            if self.group_of[block] == group:
                if self.allocator.ref_count(block):
                    return block
                if found is None:
                    found = block
        return found

    def fully_written(self, block: int) -> bool:
        """Whether every slot of ``block`` was written in every storage layer of the group
        holding it (groups whose layers differ in geometry write storage layers of their own)."""
        assert self.written is not None
        block_size = self.config.block_size
        rows = self._group_rows[int(self.group_of[block])] if self._group_rows else slice(None)
        return bool(self.written[rows, block * block_size : (block + 1) * block_size].all())

    # -- ownership generations ---------------------------------------------------------

    def new_generation(self, state: RequestState[Any]) -> None:
        """The request's blocks changed owner: page tables and steps taken before are stale."""
        state.generation = next_generation()
        self.epoch += 1

    def replanned(self, state: RequestState[Any]) -> None:
        """The request's length or sharing changed: steps planned before are stale."""
        state.plan += 1
        self.epoch += 1

    def forget_swapped(self, request_id: str, record: SwapRecord) -> None:
        for block in record.released_blocks:
            if self.swapped_blocks.get(block) == request_id:
                del self.swapped_blocks[block]
