"""The moves between a manager's pool and its offload tiers (:mod:`kvcache_core.offload.tiers`):
demotion of evicted cached blocks, promotion of blocks that continue a prompt's cached
prefix, and the tiers' figures. Manager internals: the manager holds one
:class:`TierChain` and calls it under its lock.

With KV-cache groups (:mod:`kvcache_core.contract.groups`) the unit that moves is one group's
block of one hash, a :class:`~kvcache_core.offload.prefix_file.BlockRecord` filed under its
:attr:`~kvcache_core.offload.prefix_file.BlockRecord.key`. Demotion takes a hash's block of a group
when the pool evicts the last block of that hash in that group (so the pool may still
hold the hash in another group). Promotion follows the rule of a prefix hit
(``SequenceBlocks._servable``): ``n`` blocks promote only if every full group has a block
of each, every sliding group of those its window sees from the first uncached token, and
some group holds each (so the hash chain goes on); a group's block is its record in a
tier, or its block of that hash still in the pool (mapped as a hit maps it). ``n`` shrinks
until that holds. The events count hashes per medium: a hash is in a tier while any of
its group records is.

Every call of a tier goes through :class:`~kvcache_core.offload.guarded_tiers.GuardedTiers`: a
tier that fails or gives back garbage is a miss where a miss is safe (promotion, demotion,
the records of a save), counted and warned; an interrupt propagates once the operation gave
back every block it took.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.groups import first_visible_block
from kvcache_core.errors import TierError
from kvcache_core.offload import host_form
from kvcache_core.offload.events import EventHub
from kvcache_core.offload.guarded_tiers import GuardedTiers, overflow_items
from kvcache_core.offload.prefix_file import BlockRecord, block_checksum, record_key
from kvcache_core.offload.tiers import OffloadTier, TierStats
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.prefix import PrefixEntry, hash_block

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig
    from kvcache_core.paging.chains import PrefixChains
    from kvcache_core.paging.request_state import RequestState

__all__ = ["TierChain"]


class TierChain:
    """A manager's tiers, first to last, and the moves between them and the pool.

    Args:
        tiers: the tiers, fastest first (may be empty: then every call does nothing).
        config: the pool's configuration (tiers need prefix caching; KV-cache groups and a
            sliding window are served, see the module docstring).
        events: the manager's event hub.

    Raises:
        InvalidTypeError, UnsupportedConfigError, TierError: as
            :class:`~kvcache_core.offload.guarded_tiers.GuardedTiers`, which binds the tiers (no
            tier stays bound).
    """

    def __init__(self, tiers: Iterable[OffloadTier], config: CacheConfig, events: EventHub) -> None:
        self._guard = GuardedTiers(tiers, config, events)
        self._events = events
        self._config = config
        self._windows = [group.window for group in config.kv_groups]

    def __bool__(self) -> bool:
        return bool(self._guard.tiers)

    @property
    def tiers(self) -> Sequence[OffloadTier]:
        """The tiers, first to last."""
        return tuple(self._guard.tiers)

    def stats(self) -> list[TierStats]:
        """Each tier's figures, first to last; its blocks are records (one per hash and
        KV-cache group, each one pool block's K/V).

        Raises:
            TierError: a tier fails to give its figures.
        """
        return self._guard.stats()

    def close(self) -> None:
        """Empty every tier and release their bindings (the manager closes), whatever a
        tier raises."""
        self._guard.close()

    # -- pool -> tiers ------------------------------------------------------------------

    def before_evict(self, pool: BlockPool, count: int) -> None:
        """The pool's eviction sink (:class:`~kvcache_core.paging.block_pool.EvictionSink`):
        :meth:`demote`."""
        self.demote(pool, count)

    def demote(self, pool: BlockPool, count: int) -> None:
        """Copy the ``count`` cached blocks the pool is about to evict (least recently used
        first) into the first tier, where the last block of their hash in their KV-cache
        group leaves the pool with them: one record per hash and group. The one storage
        call comes first: if it raises, nothing has changed. A tier that fails drops the
        blocks it was given (a miss later); an interrupt propagates before the pool evicts
        anything."""
        if not self._guard.tiers or not count:
            return
        prefix = pool.prefix
        assert prefix is not None
        group_of = pool.group_of
        victims = pool.allocator.cached_blocks()[:count]
        leaving = set(victims)
        picked: list[tuple[PrefixEntry, int, int]] = []  # entry, block, group
        seen: set[tuple[bytes, int]] = set()
        for block in victims:
            entry = prefix.entry_of(block)
            group = int(group_of[block])
            if entry is None or (entry.block_hash, group) in seen:
                continue
            if any(other not in leaving and group_of[other] == group for other in entry.blocks):
                continue  # another pool block of this group keeps the hash
            seen.add((entry.block_hash, group))
            picked.append((entry, block, group))
        if not picked:
            return
        try:
            keys, values = pool.storage.blocks_to_host(np.asarray([block for _, block, _ in picked], dtype=np.int64))
        except Exception as exc:  # the eviction goes on as without tiers: the blocks are dropped
            self._guard.counts[self._guard.names[0]][3] += len(picked)
            warnings.warn(
                f"demoting {len(picked)} evicted blocks failed, they are dropped: {exc!r}", RuntimeWarning, stacklevel=5
            )
            return
        self._guard.host_dtype = np.dtype(keys.dtype)
        records = [
            BlockRecord.of_entry(entry, keys[:, index], values[:, index], group)
            for index, (entry, _, group) in enumerate(picked)
        ]
        self._push(0, records)
        if len(self._guard.checksums) > 1024:
            self._guard.prune_checksums()

    def _push(self, level: int, records: list[BlockRecord]) -> None:
        """Store ``records`` in tier ``level``; what it lets go moves on, past the last dropped."""
        while records and level < len(self._guard.tiers):
            records = self._put_all(level, records)
            level += 1
        # Past the last tier: dropped (each tier reported its own removal).

    def _put_all(self, level: int, records: list[BlockRecord]) -> list[BlockRecord]:
        """Put ``records`` into tier ``level``; return the records it let go (checked)."""
        tier = self._guard.tiers[level]
        name = self._guard.names[level]
        counts = self._guard.counts[name]
        let_go: list[BlockRecord] = []
        for record in records:
            key = record.key
            for other in range(len(self._guard.tiers)):  # one copy in the tiers: a newer one replaces it
                if other != level and self._guard.contains(other, key):
                    self._guard.discard(other, key)
            held = self._guard.holds(level, record.block_hash)
            checksum = None if self._guard.trusted[level] else block_checksum(record.keys, record.values)
            try:
                overflow = overflow_items(tier.put(record))
            except Exception as exc:
                self._guard.failed(level, "take a block", exc, dropped=1)
                self._guard.report(level, record, held)  # it may have dropped its older copy
                continue
            except BaseException:
                self._guard.report(level, record, held)
                raise
            if checksum is not None:
                self._guard.checksums[key] = checksum
            counts[1] += self._guard.contains(level, key)
            counts[2] += len(overflow)
            self._guard.report(level, record, held)
            others: dict[bytes, None] = {}  # hashes let go, each held before the put
            for item in overflow:
                item_key = item if isinstance(item, bytes) else getattr(item, "key", b"")
                item_hash = _hash_of(item_key if isinstance(item_key, bytes) else b"")
                if item_hash != record.block_hash:
                    others[item_hash] = None
                if isinstance(item, bytes):
                    continue
                problem = self._guard.problem(level, item, item.key if isinstance(item, BlockRecord) else b"")
                if problem is None and isinstance(item, BlockRecord):
                    let_go.append(item)
                else:
                    self._guard.failed(level, "let a block go intact", TierError(str(problem)), dropped=1)
            self._events.removed([other for other in others if not self._guard.holds(level, other)], name)
        return let_go

    # -- tiers -> pool ------------------------------------------------------------------

    def promote(self, pool: BlockPool, chains: PrefixChains, state: RequestState[Any]) -> int:
        """Bring the tiers' blocks that continue a new request's cached prefix into its
        blocks, in every KV-cache group (one ``blocks_from_host`` call), register them and
        start the request after them; called by ``allocate`` before it commits. A group
        whose block of a hash is still in the pool maps that block, as a prefix hit does.
        A tier that fails, or gives back a record that fails the checks, is a miss there
        (counted, with a warning); so is a failing ``blocks_from_host``.

        Returns:
            The logical blocks promoted.

        Raises:
            BaseException: what a tier or the storage raised that is not an ``Exception``
                (``KeyboardInterrupt``): every block the request holds is given back first
                (the caller drops the request).
        """
        if not self._guard.tiers:
            return 0
        try:
            return self._promote(pool, chains, state)
        except BaseException:
            for table in state.tables:
                pool.release_table(list(table.physical_blocks))
            state.tables = state.empty_tables()
            raise

    def _promote(self, pool: BlockPool, chains: PrefixChains, state: RequestState[Any]) -> int:
        start = len(state.chain)
        if start * self._config.block_size != state.table.sequence_length:
            return 0
        hashes, pooled = self._continuation(pool, state, start)
        have = [
            [
                pooled[group][index] is not None or self._guard.anywhere(record_key(block_hash, group))
                for index, block_hash in enumerate(hashes)
            ]
            for group in range(len(self._windows))
        ]
        parents: list[bytes | None] = [state.chain[-1].block_hash if state.chain else None, *hashes[:-1]]
        found: dict[tuple[int, int], tuple[int, BlockRecord]] = {}  # (group, index) -> (tier level, record)
        while True:
            count = self._servable(pool, state, start, have, pooled)
            if not count:
                return 0
            missing = False
            for group, index in self._needed(start, count):
                if pooled[group][index] is not None or (group, index) in found:
                    continue
                hit = self._find(record_key(hashes[index], group), parents[index])
                tokens = self._tokens(state, start + index)
                if hit is None or hit[1].token_ids != tokens or hit[1].salt != state.salt:
                    have[group][index] = False  # unreadable, or another prefix's: shorten
                    missing = True
                else:
                    found[(group, index)] = hit
            if not missing:
                break
        records = [
            (group, index, found[(group, index)])
            for group, index in self._needed(start, count)
            if pooled[group][index] is None
        ]
        return self._write(pool, chains, state, start, count, self._layout(state, start, count, pooled), records)

    def _tokens(self, state: RequestState[Any], logical: int) -> tuple[int, ...]:
        block_size = self._config.block_size
        return tuple(state.token_ids[logical * block_size : (logical + 1) * block_size])

    def _continuation(
        self, pool: BlockPool, state: RequestState[Any], start: int
    ) -> tuple[list[bytes], list[list[int | None]]]:
        """The hashes of the prompt's full blocks from ``start`` on, while the pool or a tier
        holds a block of each (in any group), and per group the pool block of each hash
        (``None`` where the group has none); the last prompt token is always left to compute."""
        prefix = pool.prefix
        assert prefix is not None
        groups = range(len(self._windows))
        parent_hash = prefix.parent_hash(state.chain[-1] if state.chain else None)
        hashes: list[bytes] = []
        pooled: list[list[int | None]] = [[] for _ in groups]
        for logical in range(start, (len(state.token_ids) - 1) // self._config.block_size):
            tokens = self._tokens(state, logical)
            block_hash = hash_block(parent_hash, tokens, state.salt)
            entry = prefix.get(block_hash)
            if entry is not None and (
                entry.token_ids != tokens or entry.salt != state.salt or prefix.parent_hash(entry.parent) != parent_hash
            ):
                entry = None  # a collision: other tokens under this hash
            if entry is None and not any(self._guard.anywhere(record_key(block_hash, group)) for group in groups):
                break
            hashes.append(block_hash)
            for group in groups:
                pooled[group].append(None if entry is None else pool.pick_block(entry, group))
            parent_hash = block_hash
        return hashes, pooled

    def _first_held(self, group: int, end: int) -> int:
        """The first logical block ``group`` holds once ``end`` blocks are cached: 0 for a
        full group, the first its window sees from the first uncached token for a sliding
        one."""
        return min(
            end, first_visible_block(self._windows[group], end * self._config.block_size, self._config.block_size)
        )

    def _needed(self, start: int, count: int) -> list[tuple[int, int]]:
        """``(group, index)`` of every block that promoting ``count`` blocks from logical
        ``start`` maps, group by group in logical order (``index`` counts from ``start``)."""
        return [
            (group, index)
            for group in range(len(self._windows))
            for index in range(max(0, self._first_held(group, start + count) - start), count)
        ]

    def _layout(
        self, state: RequestState[Any], start: int, count: int, pooled: list[list[int | None]]
    ) -> list[list[int | None]]:
        """Per group, after promoting ``count`` blocks from logical ``start``: each block it
        holds from ``max(start, first held)`` on, the pool block mapped there or ``None``
        for a new one (promoted from a tier, or reserved past the run)."""
        layout: list[list[int | None]] = []
        for group, table in enumerate(state.tables):
            end = max(start + count, table.first_logical + table.num_blocks())
            first = max(start, self._first_held(group, start + count))
            layout.append(
                [pooled[group][logical - start] if logical < start + count else None for logical in range(first, end)]
            )
        return layout

    def _servable(
        self,
        pool: BlockPool,
        state: RequestState[Any],
        start: int,
        have: list[list[bool]],
        pooled: list[list[int | None]],
    ) -> int:
        """The most blocks from logical ``start`` that every group can be served: a full
        group has a block or record of every one, a sliding group of those its window
        sees, some group holds each, and the pool has the blocks to take for them."""
        count = len(have[0]) if have else 0
        for group, window in enumerate(self._windows):
            if window is None:
                count = min(count, next((index for index, known in enumerate(have[group]) if not known), count))
        allocator = pool.allocator
        spare = allocator.free_block_count() + allocator.cached_block_count()
        while count:
            firsts = [self._first_held(group, start + count) for group in range(len(self._windows))]
            if min(firsts) <= start and all(have[group][index] for group, index in self._needed(start, count)):
                layout = self._layout(state, start, count, pooled)
                reserved = [table.first_logical + table.num_blocks() - start for table in state.tables]
                extra = sum(max(0, row.count(None) - held) for row, held in zip(layout, reserved, strict=True))
                revived = sum(1 for row in layout for block in row if block is not None and allocator.is_cached(block))
                if extra + revived <= spare:
                    return count
            count -= 1
        return 0

    def _write(
        self,
        pool: BlockPool,
        chains: PrefixChains,
        state: RequestState[Any],
        start: int,
        count: int,
        layout: list[list[int | None]],
        records: list[tuple[int, int, tuple[int, BlockRecord]]],
    ) -> int:
        """Map ``layout``'s pool blocks, write ``records`` (``(group, index, (tier level,
        record))``) into new blocks with one storage call, take the records out of the
        tiers, then commit: every group's table holds what its window sees, the promoted
        blocks registered. No tier is called once the commit starts."""
        allocator = pool.allocator
        block_size = self._config.block_size
        firsts = [self._first_held(group, start + count) for group in range(len(self._windows))]
        mapped = [block for row in layout for block in row if block is not None]
        held: list[int] = []  # the pool blocks mapped, held before anything is taken
        extra: list[list[int]] = []  # per group: the blocks taken for the promotion
        fresh: list[list[int]] = []  # per group: the new blocks, reserved ones first
        try:
            for block in mapped:
                if allocator.is_cached(block):
                    allocator.revive(block)
                else:
                    allocator.retain(block)
                held.append(block)
            for group, table in enumerate(state.tables):
                reserved = list(table.physical_blocks[start - table.first_logical :])
                last = table.physical_blocks[-1] if table.num_blocks() else None
                missing = layout[group].count(None) - len(reserved)
                taken: list[int] = []
                if missing > 0:  # taking them may evict (and demote) other cached blocks
                    taken = pool.take(
                        missing,
                        last if last is not None and allocator.ref_count(last) == 1 else None,
                        None,
                        f"cannot promote blocks for request {state.request_id!r}",
                        group,
                    )
                extra.append(taken)
                fresh.append(reserved + taken)
            blocks: list[list[int]] = []  # per group: its blocks from max(start, first held) on
            for group, row in enumerate(layout):
                supply = iter(fresh[group])
                blocks.append([next(supply) if block is None else block for block in row])
            targets = [blocks[group][start + index - max(start, firsts[group])] for group, index, _ in records]
            if records:
                pool.storage.blocks_from_host(
                    np.asarray(targets, dtype=np.int64),
                    np.stack([record.keys for _, _, (_, record) in records], axis=1),
                    np.stack([record.values for _, _, (_, record) in records], axis=1),
                )
            for group, _, (_, record) in records:  # tiers are exclusive: the records leave them
                key = record_key(record.block_hash, group)
                for level in range(len(self._guard.tiers)):  # where it is now (the demotions above may have moved it)
                    if self._guard.contains(level, key):
                        self._guard.discard(level, key)
        except Exception as exc:  # the request is served without them
            pool.release_table(held)
            _give_back(pool, extra)
            warnings.warn(
                f"promoting {len(records)} blocks from the tiers failed: {exc!r}", RuntimeWarning, stacklevel=5
            )
            return 0
        except BaseException:
            pool.release_table(held)
            _give_back(pool, extra)
            raise
        for block in mapped:
            pool.swapped_blocks.pop(block, None)
        end = (start + count) * block_size
        for group, table in enumerate(state.tables):
            hits = list(table.physical_blocks[: start - table.first_logical])  # the pool's hits, mapped by open
            passed = max(0, min(firsts[group], start) - table.first_logical)  # those the window no longer sees
            state.tables[group] = BlockTable(
                block_size, hits[passed:] + blocks[group], end, first_logical=firsts[group]
            )
            slots = state.tables[group].slots(max(start, firsts[group]) * block_size, end)
            pool.issued[slots] = True
            if pool.written is not None:
                pool.written[:, slots] = True
            unused = hits[:passed] + fresh[group][layout[group].count(None) :]
            if unused:
                pool.release_table(unused)
        state.cached_tokens += count * block_size
        chains.advance(state)
        for _, _, (level, _) in records:
            self._guard.counts[self._guard.names[level]][0] += 1
        return count

    def _find(self, key: bytes, parent: bytes | bool | None = True) -> tuple[int, BlockRecord] | None:
        """The first tier holding ``key`` (its level) and its record, checked
        (:meth:`_problem`; with the expected ``parent`` hash when given). A record a tier
        cannot give back, or gives back malformed, is dropped from it, counted, with a
        warning: a miss."""
        for level, tier in enumerate(self._guard.tiers):
            if not self._guard.contains(level, key):
                continue
            try:
                record = tier.peek(key)
                if record is None:
                    return None
                problem = self._guard.problem(level, record, key, parent)
                if problem is not None:
                    raise TierError(problem)
                # a tier's record is read from outside: host form, sane scales
                host_form.check_host_block(self._config, "the record's keys", record.keys)
                host_form.check_host_block(self._config, "the record's values", record.values)
            except Exception as exc:
                self._guard.failed(level, "give back a block (it is dropped)", exc, dropped=1)
                self._guard.discard(level, key)
                return None
            assert isinstance(record, BlockRecord)
            return level, record
        return None

    def store(self, records: list[BlockRecord]) -> int:
        """Put ``records`` into the first tier (what it lets go moves on, as a demotion's
        would); return how many the tiers hold afterwards."""
        if not self._guard.tiers or not records:
            return 0
        if self._guard.host_dtype is None:
            self._guard.host_dtype = np.dtype(records[0].keys.dtype)
        self._push(0, records)
        return sum(1 for record in records if self._guard.anywhere(record.key))

    def records(self) -> list[BlockRecord]:
        """Every record the tiers hold, of every KV-cache group (for ``save_prefix_cache``),
        checked; one a tier cannot give back is left out (and dropped, with a warning), and
        so are the records of a tier that cannot list them."""
        found: list[BlockRecord] = []
        for level in range(len(self._guard.tiers)):
            for key in self._guard.keys(level):
                hit = self._find(key)
                if hit is not None:
                    found.append(hit[1])
        return found


def _hash_of(key: bytes) -> bytes:
    """The block hash a tier's key starts with (:func:`~kvcache_core.offload.prefix_file.record_key`);
    read leniently: a key a tier mangled must not break an eviction."""
    return key[:32]


def _give_back(pool: BlockPool, taken: list[list[int]]) -> None:
    """Return blocks taken for a promotion that did not happen to the free list."""
    for blocks in taken:
        if blocks:
            pool.allocator.release(blocks[::-1], blocks[-1])
