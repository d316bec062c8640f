"""Offload tiers behind the pool: cached blocks the pool evicts are demoted to the next
tier instead of dropped, and a prompt that hits a demoted block promotes it back.

::

    from kvcache_core.tiers import DiskTier, HostTier

    manager = create_manager("torch", config, tiers=[HostTier(2 << 30), DiskTier("/var/cache/kv", 64 << 30)])

* **Demotion.** When the pool evicts a cached block whose hash no other pool block holds,
  its K/V go to the first tier (one ``blocks_to_host`` call per eviction). Each tier is
  bounded (``max_bytes``) and least-recently-used: what it lets go moves to the next tier,
  and from the last one it is dropped.
* **Promotion.** ``allocate`` maps the prompt's blocks the pool holds; the next full blocks
  found in a tier are written into the request's blocks with one ``blocks_from_host`` call
  and registered in the prefix cache as if computed (they leave the tier: tiers are
  exclusive). ``handle.num_cached_tokens()`` counts them.
* **Figures and events.** ``manager.tier_stats()`` gives each tier's blocks, bytes, hits,
  demotions and evictions; promoted blocks also count as prefix-cache hits in
  ``manager.stats()``; events carry the tier's name as their ``medium``.
* **Cost.** Demotion and promotion run inside the manager's call (under its lock): a disk
  tier's writes and reads are paid by the ``allocate`` or ``extend`` that evicts or hits.

A tier is any object with the :class:`OffloadTier` members; a distribution registers one
under the entry-point group ``kvcache_core.tiers`` (the entry point's name is the tier's
kind, the object it loads a factory taking ``max_bytes`` and keyword options), and
:func:`create_tier` builds built-in and registered tiers by kind. :class:`HostTier` keeps
blocks in host memory; :class:`DiskTier` keeps one file per block in the portable format
of :mod:`kvcache_core.persist` (checksummed; written to a temporary name, then renamed).

A block a tier cannot give back (a disk file corrupted, removed or unreadable) is a miss:
the tier drops it with a :class:`RuntimeWarning` naming the error, and the request computes
those tokens. A block a tier cannot take (a disk write failing) is dropped the same way, and
so are the blocks of an eviction whose ``blocks_to_host`` raises an ``Exception``: the
operation that evicted goes on as without tiers. (An interrupt that is not an ``Exception``,
``KeyboardInterrupt``, raised by that copy propagates from inside the evicting operation,
which may then hold blocks it took before: a limit of demotion inside the manager's calls.
A promotion's copy is transactional: whatever it raises, the request's blocks go back.)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from kvcache_core.errors import (
    CacheFileError,
    InvalidArgumentError,
    InvalidTypeError,
    KvCacheError,
    TierError,
    UnsupportedConfigError,
)
from kvcache_core.events import BlockStored, EventHub
from kvcache_core.persist import BlockRecord, read_blocks, write_blocks
from kvcache_core.pool_access import PoolAccess
from kvcache_core.prefix import hash_block

if TYPE_CHECKING:
    from kvcache_core.config import CacheConfig
    from kvcache_core.handle import RequestState

__all__ = [
    "TIER_ENTRY_POINT_GROUP",
    "DiskTier",
    "HostTier",
    "OffloadTier",
    "TierChain",
    "TierStats",
    "create_tier",
]

#: The entry-point group third-party tiers register under.
TIER_ENTRY_POINT_GROUP = "kvcache_core.tiers"


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's figures (``manager.tier_stats()``).

    Attributes:
        name: the tier's name (the ``medium`` of its events).
        blocks: blocks it holds.
        used_bytes, max_bytes: bytes it holds and may hold.
        hits: blocks promoted from it into the pool.
        demotions: blocks it took (from the pool or the tier before it).
        evictions: blocks it let go to make room (to the next tier, or dropped).
        failures: blocks it could not take or give back (dropped, with a warning).
    """

    name: str
    blocks: int
    used_bytes: int
    max_bytes: int
    hits: int
    demotions: int
    evictions: int
    failures: int


@runtime_checkable
class OffloadTier(Protocol):
    """What a tier offers the manager: a bounded, least-recently-used store of blocks by hash."""

    @property
    def name(self) -> str:
        """The tier's name, unique among a manager's tiers (the ``medium`` of its events)."""
        ...

    @property
    def max_bytes(self) -> int:
        """Bytes it may hold."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes it holds."""
        ...

    def bind(self, config: CacheConfig) -> None:
        """Called once by the manager before any other call.

        Raises:
            TierError: the tier cannot hold one block of ``config`` (too small, a directory it
                cannot write).
        """
        ...

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        """Store ``record`` as the most recently used; return what it let go to make room,
        least recently used first: records to pass to the next tier (``record`` itself if
        it cannot fit at all), or bare hashes of blocks it dropped (unreadable).

        Raises:
            KvCacheError: the block cannot be stored (the manager drops it, with a warning).
        """
        ...

    def peek(self, block_hash: bytes) -> BlockRecord | None:
        """The block stored under ``block_hash`` (it stays), or ``None``.

        Raises:
            KvCacheError: it is stored but cannot be read back intact (the manager drops it).
        """
        ...

    def discard(self, block_hash: bytes) -> None:
        """Forget ``block_hash`` (no error if absent)."""
        ...

    def hashes(self) -> list[bytes]:
        """The hashes it holds, least recently used first."""
        ...

    def __contains__(self, block_hash: object) -> bool: ...

    def clear(self) -> None:
        """Forget everything."""
        ...


def _check_max_bytes(max_bytes: object) -> int:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise InvalidArgumentError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
    return max_bytes


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or name == "pool":
        raise InvalidArgumentError(f"a tier's name must be a non-empty str other than 'pool', got {name!r}")
    return name


class HostTier:
    """Blocks in host memory (NumPy arrays), least recently used first out.

    Args:
        max_bytes: the K/V bytes it may hold (>= one block's, checked when bound).
        name: its name (``"host"``).

    Raises:
        InvalidArgumentError: ``max_bytes`` below 1, or a bad name.
    """

    def __init__(self, max_bytes: int, *, name: str = "host") -> None:
        self._max_bytes = _check_max_bytes(max_bytes)
        self._name = _check_name(name)
        self._blocks: OrderedDict[bytes, BlockRecord] = OrderedDict()
        self._used_bytes = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def bind(self, config: CacheConfig) -> None:
        if config.bytes_per_block > self._max_bytes:
            raise TierError(
                f"tier {self._name!r} holds {self._max_bytes} bytes, less than one block of {config.bytes_per_block}"
            )

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        if record.nbytes > self._max_bytes:
            return [record]
        self.discard(record.block_hash)
        # Own copies: the pool's host views must not pin (or alias) anything.
        stored = BlockRecord(
            record.block_hash,
            record.parent_hash,
            record.salt,
            record.token_ids,
            record.keys.copy(),
            record.values.copy(),
        )
        self._blocks[record.block_hash] = stored
        self._used_bytes += stored.nbytes
        let_go: list[BlockRecord | bytes] = []
        while self._used_bytes > self._max_bytes:
            _, oldest = self._blocks.popitem(last=False)
            self._used_bytes -= oldest.nbytes
            let_go.append(oldest)
        return let_go

    def peek(self, block_hash: bytes) -> BlockRecord | None:
        record = self._blocks.get(block_hash)
        if record is not None:
            self._blocks.move_to_end(block_hash)
        return record

    def discard(self, block_hash: bytes) -> None:
        record = self._blocks.pop(block_hash, None)
        if record is not None:
            self._used_bytes -= record.nbytes

    def hashes(self) -> list[bytes]:
        return list(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def clear(self) -> None:
        self._blocks.clear()
        self._used_bytes = 0


class DiskTier:
    """Blocks in files of a directory, one per block in the portable format of
    :mod:`kvcache_core.persist` (checksummed, no pickle), least recently used first out.

    Files are written to a temporary name and renamed when complete; the tier's own files
    are removed when it lets them go or is cleared. Give each manager its own directory:
    files an earlier run left there are neither served nor counted (to carry a prefix cache
    across a restart, use ``save_prefix_cache`` / ``load_prefix_cache``).

    Args:
        directory: where the files go (created if missing).
        max_bytes: the file bytes it may hold.
        name: its name (``"disk"``).

    Raises:
        InvalidArgumentError: ``max_bytes`` below 1, or a bad name.
        InvalidTypeError: ``directory`` is not a ``str`` or ``os.PathLike``.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, *, name: str = "disk") -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise InvalidTypeError(f"directory must be a str or os.PathLike, got {directory!r}")
        self._directory = Path(directory)
        self._max_bytes = _check_max_bytes(max_bytes)
        self._name = _check_name(name)
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes
        self._used_bytes = 0
        self._config: CacheConfig | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def directory(self) -> Path:
        """Where its files are."""
        return self._directory

    def path_of(self, block_hash: bytes) -> Path:
        """The file of ``block_hash``."""
        return self._directory / f"{block_hash.hex()}.safetensors"

    def bind(self, config: CacheConfig) -> None:
        if config.bytes_per_block > self._max_bytes:
            raise TierError(
                f"tier {self._name!r} holds {self._max_bytes} bytes, less than one block of {config.bytes_per_block}"
            )
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self._directory):
                pass
        except OSError as exc:
            raise TierError(f"tier {self._name!r} cannot write into {str(self._directory)!r}: {exc}") from exc
        self._config = config

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        assert self._config is not None, "bind the tier first"
        self.discard(record.block_hash)
        size = write_blocks(self.path_of(record.block_hash), self._config, [record])
        if size > self._max_bytes:
            self.path_of(record.block_hash).unlink()
            return [record]
        self._files[record.block_hash] = size
        self._used_bytes += size
        let_go: list[BlockRecord | bytes] = []
        while self._used_bytes > self._max_bytes:
            oldest = next(iter(self._files))
            try:
                let_go.append(self._read(oldest))
            except KvCacheError:
                let_go.append(oldest)  # unreadable: dropped rather than passed on
            self.discard(oldest)
        return let_go

    def peek(self, block_hash: bytes) -> BlockRecord | None:
        if block_hash not in self._files:
            return None
        self._files.move_to_end(block_hash)
        return self._read(block_hash)

    def discard(self, block_hash: bytes) -> None:
        size = self._files.pop(block_hash, None)
        if size is not None:
            self._used_bytes -= size
            with contextlib.suppress(FileNotFoundError):
                self.path_of(block_hash).unlink()

    def hashes(self) -> list[bytes]:
        return list(self._files)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._files

    def clear(self) -> None:
        for block_hash in list(self._files):
            self.discard(block_hash)

    def _read(self, block_hash: bytes) -> BlockRecord:
        assert self._config is not None, "bind the tier first"
        records = read_blocks(self.path_of(block_hash), self._config, chained=False)
        if len(records) != 1 or records[0].block_hash != block_hash:
            raise CacheFileError(f"{str(self.path_of(block_hash))!r} does not hold block {block_hash.hex()[:16]}...")
        return records[0]


def create_tier(kind: str, max_bytes: int, **options: Any) -> OffloadTier:
    """A tier by kind: ``"host"`` (:class:`HostTier`), ``"disk"`` (:class:`DiskTier`, give
    ``directory=``), or the name of an entry point of :data:`TIER_ENTRY_POINT_GROUP`.

    Raises:
        InvalidArgumentError: an unknown kind (the message lists the known ones).
        TierError: a registered factory that fails to load or returns no tier.
    """
    if kind == "host":
        return HostTier(max_bytes, **options)
    if kind == "disk":
        return DiskTier(max_bytes=max_bytes, **options)
    registered = {point.name: point for point in entry_points(group=TIER_ENTRY_POINT_GROUP)}
    point = registered.get(kind)
    if point is None:
        known = ", ".join(["host", "disk", *sorted(registered)])
        raise InvalidArgumentError(f"unknown tier kind {kind!r}; known: {known}")
    try:
        factory: Callable[..., object] = point.load()
        tier = factory(max_bytes, **options)
    except Exception as exc:
        raise TierError(f"the tier {kind!r} registered by {point.value!r} failed to load: {exc!r}") from exc
    if not isinstance(tier, OffloadTier):
        raise TierError(f"the tier {kind!r} registered by {point.value!r} returned {tier!r}, not an OffloadTier")
    return tier


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
        if config.sliding_window is not None:
            raise UnsupportedConfigError(
                f"offload tiers do not serve a sliding window (sliding_window={config.sliding_window})"
            )
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
            records.append(
                BlockRecord(
                    entry.block_hash,
                    None if entry.parent is None else entry.parent.block_hash,
                    entry.salt,
                    entry.token_ids,
                    keys[:, index],
                    values[:, index],
                )
            )
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
