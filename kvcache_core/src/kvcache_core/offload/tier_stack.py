"""The moves between a manager's pool and its offload tiers (:mod:`kvcache_core.offload.tiers`):
demotion of evicted cached blocks, the tiers' side of a prefix hit, and the tiers' figures.
Manager internals: the manager holds one :class:`TierChain` and calls it under its lock.

With KV-cache groups (:mod:`kvcache_core.contract.groups`) the unit that moves is one group's
block of one hash, a :class:`~kvcache_core.offload.prefix_file.BlockRecord` filed under its
:attr:`~kvcache_core.offload.prefix_file.BlockRecord.key`. Demotion takes a hash's block of a group
when the pool evicts the last block of that hash in that group (so the pool may still
hold the hash in another group). Promotion is planned with the pool's hit by
:class:`~kvcache_core.paging.planner.PrefixPlanner` (which blocks come from which tier):
:class:`TierChain` is its :class:`~kvcache_core.paging.planner.TierLookup`, saying which tier
holds a record, giving records back checked and taking out those that went into the pool.
The events count hashes per medium: a hash is in a tier while any of its group records is.

Every call of a tier goes through :class:`~kvcache_core.offload.guarded_tiers.GuardedTiers`: a
tier that fails or gives back garbage is a miss where a miss is safe (promotion, demotion,
the records of a save), counted and warned; an interrupt propagates once the operation gave
back every block it took.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from kvcache_core.contract.states import STATE_RECORD_GROUP
from kvcache_core.errors import TierError
from kvcache_core.offload import host_form
from kvcache_core.offload.events import EventHub
from kvcache_core.offload.guarded_tiers import GuardedTiers, overflow_items
from kvcache_core.offload.prefix_file import BlockRecord, block_checksum, record_key
from kvcache_core.offload.state_records import is_state_key, pack_states
from kvcache_core.offload.tiers import OffloadTier, TierStats
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.prefix import PrefixEntry

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig

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
        tiers = tuple(tiers)
        if tiers:  # a tier holds host copies of blocks, of one geometry
            config.refuse_host_copies("an offload tier")
        self._guard = GuardedTiers(tiers, config, events)
        self._events = events
        self._config = config
        self._windows = [group.window for group in config.kv_groups]
        # The tiers that look a prompt's blocks up at once (a remote tier: one round trip).
        self._ahead = [
            (level, prefetch)
            for level, tier in enumerate(self._guard.tiers)
            if (prefetch := _prefetch_of(tier)) is not None
        ]

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
        group leaves the pool with them: one record per hash and group, and one for the
        state checkpoint filed under such a hash (it leaves the pool: its slot is freed).
        The storage calls come first: if one raises, nothing has changed. A tier that fails drops the
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
        states = pool.states
        # A state checkpoint filed under a leaving hash goes with its block (its slot is freed).
        moving = [
            (entry, states.checkpoints[entry.block_hash])
            for entry in dict.fromkeys(entry for entry, _, _ in picked)
            if entry.block_hash in states.checkpoints
        ]
        try:
            keys, values = pool.storage.blocks_to_host(np.asarray([block for _, block, _ in picked], dtype=np.int64))
            packed = [pack_states(self._config, states.to_host(slot)) for _, slot in moving]
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
        for (entry, _), checkpoint in zip(moving, packed, strict=True):
            records.append(BlockRecord.of_checkpoint(entry, checkpoint))
            states.drop_checkpoint(entry.block_hash)
        self._push(0, records)
        if len(self._guard.checksums) > 1024:
            self._guard.prune_checksums()

    def demote_checkpoint(self, pool: BlockPool, block_hash: bytes, slot: int) -> None:
        """The pool evicts the state checkpoint of ``block_hash`` (in ``slot``) for a
        request that needs a slot: a copy goes to the first tier while its block is
        cached. A storage that fails drops it (counted, with a warning)."""
        prefix = pool.prefix
        entry = prefix.get(block_hash) if prefix is not None else None
        if not self._guard.tiers or entry is None:
            return
        try:
            packed = pack_states(self._config, pool.states.to_host(slot))
        except Exception as exc:
            self._guard.counts[self._guard.names[0]][3] += 1
            warnings.warn(
                f"demoting an evicted state checkpoint failed, it is dropped: {exc!r}", RuntimeWarning, stacklevel=5
            )
            return
        self._push(0, [BlockRecord.of_checkpoint(entry, packed)])

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
                item_key = item_key if isinstance(item_key, bytes) else b""
                item_hash = _hash_of(item_key)
                if item_hash != record.block_hash and not is_state_key(item_key):
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

    def holds(self, block_hash: bytes, group: int) -> int | None:
        """The level of the first tier holding ``group``'s record of ``block_hash``
        (:class:`~kvcache_core.paging.planner.TierLookup`), ``None`` if none does (or a tier
        cannot say: counted, with a warning)."""
        key = record_key(block_hash, group)
        return next((level for level in range(len(self._guard.tiers)) if self._guard.contains(level, key)), None)

    def fetch(self, block_hash: bytes, group: int, parent: bytes | None) -> tuple[int, BlockRecord] | None:
        """The first tier holding ``group``'s record of ``block_hash`` and the record,
        checked with the expected ``parent`` hash (:meth:`_find`); ``None`` where none gives
        it back intact: a miss."""
        return self._find(record_key(block_hash, group), parent)

    @property
    def looks_ahead(self) -> bool:
        """Whether a tier wants a prompt's hashes before it is asked about them."""
        return bool(self._ahead)

    def prefetch(self, block_hashes: Sequence[bytes], salt: bytes | None) -> None:
        """Tell each tier that looks ahead (it has ``prefetch(keys, salt)``) the keys of
        ``block_hashes`` in every KV-cache group, in the prompt's order (block by block), and
        the salt hashed into them (and, with state layers, their checkpoints' keys); one that fails is a miss (counted, with a warning)."""
        groups = [*range(len(self._windows)), *([STATE_RECORD_GROUP] if self._config.states.arrays else [])]
        keys = [record_key(block_hash, group) for block_hash in block_hashes for group in groups]
        for level, prefetch in self._ahead:
            self._guard.guarded(level, "look blocks up", partial(prefetch, keys, salt), None)

    def take_out(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """The records ``(block hash, group)`` went into the pool: tiers are exclusive, each
        leaves the tier that holds it now (a demotion since it was fetched may have moved it)."""
        for block_hash, group in blocks:
            key = record_key(block_hash, group)
            for level in range(len(self._guard.tiers)):
                if self._guard.contains(level, key):
                    self._guard.discard(level, key)

    def count_hits(self, levels: Iterable[int]) -> None:
        """Count one hit in tier ``level`` for each record promoted from it."""
        for level in levels:
            self._guard.counts[self._guard.names[level]][0] += 1

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
                if not record.is_checkpoint:
                    host_form.check_host_block(self._config, "the record's keys", record.keys)
                    host_form.check_host_block(self._config, "the record's values", record.values, "values")
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
        block = next((record for record in records if not record.is_checkpoint), None)
        if self._guard.host_dtype is None and block is not None:
            self._guard.host_dtype = np.dtype(block.keys.dtype)
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


def _prefetch_of(tier: OffloadTier) -> Callable[[list[bytes], bytes | None], object] | None:
    """``tier``'s ``prefetch(keys, salt)``, if it has one (read leniently: a tier whose
    attributes fail is simply asked block by block)."""
    try:
        prefetch = getattr(tier, "prefetch", None)
    except Exception:
        return None
    return prefetch if callable(prefetch) else None
