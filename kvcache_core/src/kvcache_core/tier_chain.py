"""The moves between a manager's pool and its offload tiers (:mod:`kvcache_core.tiers`):
demotion of evicted cached blocks, promotion of blocks that continue a prompt's cached
prefix, and the tiers' figures. Manager internals: the manager holds one
:class:`TierChain` and calls it under its lock.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcache_core.errors import InvalidTypeError, KvCacheError, TierError, UnsupportedConfigError
from kvcache_core.events import BlockStored, EventHub
from kvcache_core.persist import BlockRecord
from kvcache_core.pool_access import PoolAccess
from kvcache_core.prefix import hash_block
from kvcache_core.tiers import OffloadTier, TierStats

if TYPE_CHECKING:
    from kvcache_core.config import CacheConfig
    from kvcache_core.handle import RequestState

__all__ = ["TierChain"]


class TierChain:
    """A manager's tiers, first to last, and the moves between them and the pool.

    Args:
        tiers: the tiers, fastest first (may be empty: then every call does nothing).
        config: the pool's configuration (tiers need prefix caching and no sliding window).
        events: the manager's event hub.

    Raises:
        InvalidTypeError: a tier that is not an :class:`OffloadTier`.
        UnsupportedConfigError: tiers without prefix caching, or with a sliding window.
        TierError: two tiers of one name, or a tier that cannot hold a block of ``config``.
    """

    def __init__(self, tiers: Iterable[OffloadTier], config: CacheConfig, events: EventHub) -> None:
        self._tiers = list(tiers)
        self._events = events
        self._config = config
        for tier in self._tiers:
            if not isinstance(tier, OffloadTier):
                raise InvalidTypeError(f"tiers must be OffloadTier objects (HostTier, DiskTier, ...), got {tier!r}")
        if not self._tiers:
            return
        if not config.enable_prefix_caching:
            raise UnsupportedConfigError("offload tiers need CacheConfig(enable_prefix_caching=True)")
        windows = sorted({group.window for group in config.kv_groups if group.window is not None})
        if windows:
            raise UnsupportedConfigError(f"offload tiers do not serve a sliding window (sliding_window {windows[0]})")
        names = [tier.name for tier in self._tiers]
        if len(set(names)) != len(names):
            raise TierError(f"tier names must be unique, got {names}")
        for tier in self._tiers:
            tier.bind(config)
        self._counts = {tier.name: [0, 0, 0, 0] for tier in self._tiers}  # hits, demotions, evictions, failures

    def __bool__(self) -> bool:
        return bool(self._tiers)

    @property
    def tiers(self) -> Sequence[OffloadTier]:
        """The tiers, first to last."""
        return tuple(self._tiers)

    def stats(self) -> list[TierStats]:
        """Each tier's figures, first to last."""
        return [
            TierStats(tier.name, len(tier.hashes()), tier.used_bytes, tier.max_bytes, *self._counts[tier.name])
            for tier in self._tiers
        ]

    # -- pool -> tiers ------------------------------------------------------------------

    def demote(self, pool: PoolAccess, count: int) -> None:
        """Copy the ``count`` cached blocks the pool is about to evict (least recently used
        first) into the first tier, where their hash leaves the pool with them. The one
        storage call comes first: if it raises, nothing has changed."""
        if not self._tiers or not count:
            return
        prefix = pool.prefix
        assert prefix is not None
        victims = pool.allocator.cached_blocks()[:count]
        leaving = set(victims)
        picked: list[int] = []
        seen: set[bytes] = set()
        for block in victims:
            entry = prefix.entry_of(block)
            if entry is None or entry.block_hash in seen or not leaving.issuperset(entry.blocks):
                continue  # another pool block keeps this hash
            seen.add(entry.block_hash)
            picked.append(block)
        if not picked:
            return
        try:
            keys, values = pool.storage.blocks_to_host(np.asarray(picked, dtype=np.int64))
        except Exception as exc:  # the eviction goes on as without tiers: the blocks are dropped
            self._counts[self._tiers[0].name][3] += len(picked)
            warnings.warn(
                f"demoting {len(picked)} evicted blocks failed, they are dropped: {exc!r}", RuntimeWarning, stacklevel=5
            )
            return
        records: list[BlockRecord] = []
        for index, block in enumerate(picked):
            entry = prefix.entry_of(block)
            assert entry is not None
            records.append(BlockRecord.of_entry(entry, keys[:, index], values[:, index]))
        self._push(0, records)

    def _push(self, level: int, records: list[BlockRecord]) -> None:
        """Store ``records`` in tier ``level``; what it lets go moves on, past the last dropped."""
        if not records:
            return
        if level == len(self._tiers):
            return  # past the last tier: dropped (each tier reported its own removal)
        tier = self._tiers[level]
        counts = self._counts[tier.name]
        let_go: list[BlockRecord] = []
        for record in records:
            for other in self._tiers:  # one copy in the tiers: a newer one replaces it
                if other is not tier and record.block_hash in other:
                    other.discard(record.block_hash)
                    self._events.removed((record.block_hash,), other.name)
            known = record.block_hash in tier
            try:
                overflow = tier.put(record)
            except KvCacheError as exc:
                counts[3] += 1
                if known and record.block_hash not in tier:  # it dropped its older copy
                    self._events.removed((record.block_hash,), tier.name)
                warnings.warn(f"tier {tier.name!r} could not take a block: {exc}", RuntimeWarning, stacklevel=4)
                continue
            counts[1] += record.block_hash in tier
            if record.block_hash in tier and not known:
                self._events.emit(
                    BlockStored(
                        (record.block_hash,),
                        record.parent_hash,
                        record.token_ids,
                        self._config.block_size,
                        medium=tier.name,
                    )
                )
            counts[2] += len(overflow)
            gone: list[bytes] = []
            for item in overflow:
                item_hash = item if isinstance(item, bytes) else item.block_hash
                if (item_hash != record.block_hash or known) and item_hash not in tier:
                    gone.append(item_hash)  # it was in the tier and is not now
                if not isinstance(item, bytes):
                    let_go.append(item)
            self._events.removed(gone, tier.name)
        self._push(level + 1, let_go)

    # -- tiers -> pool ------------------------------------------------------------------

    def promote(self, pool: PoolAccess, state: RequestState[Any]) -> int:
        """Bring the tiers' blocks that continue a new request's cached prefix into its
        blocks (one ``blocks_from_host`` call), register them and start the request after
        them; called by ``allocate`` before it commits.

        Returns:
            The blocks promoted.

        Raises:
            BaseException: what the storage raised that is not an ``Exception``
                (``KeyboardInterrupt``): every block the request took is given back first.
        """
        if not self._tiers:
            return 0
        prefix = pool.prefix
        assert prefix is not None
        table = state.table
        block_size = self._config.block_size
        tokens = state.token_ids
        start = len(state.chain)
        if table.first_logical or start * block_size != table.sequence_length:
            return 0
        found: list[tuple[OffloadTier, BlockRecord]] = []
        parent_hash = prefix.parent_hash(state.chain[-1] if state.chain else None)
        for logical in range(start, (len(tokens) - 1) // block_size):
            block_tokens = tuple(tokens[logical * block_size : (logical + 1) * block_size])
            block_hash = hash_block(parent_hash, block_tokens, state.salt)
            hit = self._find(block_hash)
            if hit is None or hit[1].token_ids != block_tokens or hit[1].salt != state.salt:
                break
            found.append(hit)
            parent_hash = block_hash
        if not found:
            return 0
        allocator = pool.allocator
        reserved = table.num_blocks() - start
        spare = allocator.free_block_count() + allocator.cached_block_count()
        found = found[: reserved + spare]
        extra: list[int] = []
        try:
            if len(found) > reserved:  # taking them may evict (and demote) other cached blocks
                last = table.physical_blocks[-1] if table.num_blocks() else None
                extra = pool.take(
                    len(found) - reserved,
                    last if last is not None and allocator.ref_count(last) == 1 else None,
                    None,
                    f"cannot promote blocks for request {state.request_id!r}",
                )
            targets = [table.physical_block(start + index) for index in range(min(reserved, len(found)))] + extra
            pool.storage.blocks_from_host(
                np.asarray(targets, dtype=np.int64),
                np.stack([record.keys for _, record in found], axis=1),
                np.stack([record.values for _, record in found], axis=1),
            )
        except Exception as exc:  # the request is served without them
            if extra:
                allocator.release(extra[::-1], extra[-1])
            warnings.warn(f"promoting {len(found)} blocks from the tiers failed: {exc!r}", RuntimeWarning, stacklevel=4)
            return 0
        except BaseException:
            if extra:
                allocator.release(extra[::-1], extra[-1])
            pool.release_table(list(table.physical_blocks))
            raise
        if extra:
            table.add_blocks(extra)
        promoted = len(found) * block_size
        slots = table.slots(table.sequence_length, table.sequence_length + promoted)
        pool.issued[slots] = True
        if pool.written is not None:
            pool.written[:, slots] = True
        table.extend_sequence(promoted)
        state.cached_tokens += promoted
        pool.advance_chain(state)
        for tier, record in found:
            self._counts[tier.name][0] += 1
            for holder in self._tiers:  # where it is now (the demotions above may have moved it)
                if record.block_hash in holder:
                    holder.discard(record.block_hash)
                    self._events.removed((record.block_hash,), holder.name)
        return len(found)

    def _find(self, block_hash: bytes) -> tuple[OffloadTier, BlockRecord] | None:
        for tier in self._tiers:
            if block_hash not in tier:
                continue
            try:
                record = tier.peek(block_hash)
            except KvCacheError as exc:
                self._counts[tier.name][3] += 1
                tier.discard(block_hash)
                self._events.removed((block_hash,), tier.name)
                warnings.warn(
                    f"tier {tier.name!r} dropped a block it cannot give back: {exc}", RuntimeWarning, stacklevel=5
                )
                return None
            return None if record is None else (tier, record)
        return None

    def store(self, records: list[BlockRecord]) -> int:
        """Put ``records`` into the first tier (what it lets go moves on, as a demotion's
        would); return how many the tiers hold afterwards."""
        if not self._tiers or not records:
            return 0
        self._push(0, records)
        return sum(1 for record in records if any(record.block_hash in tier for tier in self._tiers))

    def records(self) -> list[BlockRecord]:
        """Every block the tiers hold (for ``save_prefix_cache``); one a tier cannot give
        back is left out (and dropped, with a warning)."""
        found: list[BlockRecord] = []
        for tier in self._tiers:
            for block_hash in tier.hashes():
                hit = self._find(block_hash)
                if hit is not None:
                    found.append(hit[1])
        return found

    def clear(self) -> None:
        """Empty every tier (the manager closes)."""
        for tier in self._tiers:
            tier.clear()
