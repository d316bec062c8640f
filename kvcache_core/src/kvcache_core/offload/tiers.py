"""Offload tiers behind the pool: cached blocks the pool evicts are demoted to the next
tier instead of dropped, and a prompt that hits a demoted block promotes it back.

::

    from kvcache_core.offload.tiers import DiskTier, HostTier

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
* **KV-cache groups** (hybrid models, :mod:`kvcache_core.contract.groups`, and a pool with a
  ``sliding_window``). A pool block holds one group's layers, so a tier holds one
  :class:`~kvcache_core.offload.prefix_file.BlockRecord` per hash and group, filed under
  :attr:`BlockRecord.key <kvcache_core.offload.prefix_file.BlockRecord.key>` (the bare hash in group 0,
  the hash and the group in the others). When the pool evicts the last block of a hash in
  one group, that block is demoted (the pool evicts least recently used first, so one
  group's blocks of a prompt often leave before another's); a group that held no block of
  a hash (a sliding window passed it before it was hashed) has no record of it. A prompt
  promotes the next ``n`` blocks only if every group is served, by the rule of a prefix
  hit: a full (or chunked) group needs a block of every one of them, a sliding group only
  of those its window sees from the first uncached token (it maps no others; their records
  stay in the tiers); a group's block is its record in a tier or, if the pool still holds
  that hash in that group, the pool's block. Every promoted block must be held by some
  group (its hash chains on), so a pool whose every group slides promotes no further than
  its window reaches back. ``n`` is shortened until all of that holds; the records come
  back in one ``blocks_from_host`` call. A hash is in a
  tier's medium while at least one of its records is there (``BlockStored`` when the
  first enters, ``BlockRemoved`` when the last leaves); a tier's figures count records
  (each one pool block's K/V).
* **State checkpoints** (a pool with recurrent-state layers, :mod:`kvcache_core.contract.states`).
  When the pool demotes a block whose hash has a state checkpoint, the checkpoint goes
  with it: a record of the reserved group
  :data:`~kvcache_core.contract.states.STATE_RECORD_GROUP` holding the slot's bytes
  (:mod:`kvcache_core.offload.state_records`), which a tier files and lets go like any
  record. A prompt promotes blocks only up to the last one whose checkpoint the pool or a
  tier holds: that checkpoint is written into the new request's state slot (and becomes
  the pool's again), so a hit never goes past the last checkpoint it can start from.
  Checkpoint records count in a tier's ``blocks``, ``used_bytes`` and ``demotions``, not in
  its ``hits``, and are in no event's medium.
* **Cost.** Demotion and promotion run inside the manager's call (under its lock): a disk
  tier's writes and reads are paid by the ``allocate`` or ``extend`` that evicts or hits.

A tier is any object with the :class:`OffloadTier` members; a distribution registers one
under the entry-point group ``kvcache_core.tiers`` (the entry point's name is the tier's
kind, the object it loads a factory taking ``max_bytes`` and keyword options), and
:func:`create_tier` builds built-in and registered tiers by kind. :class:`HostTier` keeps
blocks in host memory; :class:`DiskTier` keeps one file per block in the portable format
of :mod:`kvcache_core.offload.prefix_file` (checksummed; written to a temporary name, then renamed).

Whatever a tier does, the manager's pool stays whole: every call of a tier is guarded
(:mod:`kvcache_core.offload.guarded_tiers`). A block a tier cannot give back (a disk file corrupted,
removed, unreadable, or any exception of a third party's tier) or gives back malformed (a
record of another shape, dtype, hash or checksum than it was given) is a miss: the tier drops
it with a :class:`RuntimeWarning` naming the error, ``TierStats.errors`` counts the call, and
the request computes those tokens. A block a tier cannot take (a disk write failing) is
dropped the same way, and so are the blocks of an eviction whose ``blocks_to_host`` raises an
``Exception``: the operation that evicted goes on as without tiers. An interrupt
(``KeyboardInterrupt``) raised inside a tier or a transfer propagates once the operation
gave back every block it took. A tier binds to one manager at a time (a second is a
:class:`~kvcache_core.errors.TierError`); the manager's ``close()`` clears it and releases
it, whatever it raises, so a new manager may use it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvcache_core.contract.scalars import check_count
from kvcache_core.contract.states import STATE_RECORD_GROUP
from kvcache_core.errors import (
    CacheFileError,
    InvalidArgumentError,
    InvalidTypeError,
    TierError,
)
from kvcache_core.offload.prefix_file import BlockRecord, read_blocks, split_key, write_blocks
from kvcache_core.offload.safe_files import file_path, remove_file

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig

__all__ = [
    "TIER_ENTRY_POINT_GROUP",
    "DiskTier",
    "HostTier",
    "OffloadTier",
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
        blocks: blocks it holds: records, one per hash and KV-cache group (each one pool
            block's K/V), so a hash of a pool with two groups may count twice; a state
            checkpoint's record counts as one.
        used_bytes, max_bytes: bytes it holds and may hold.
        hits: blocks (records) promoted from it into the pool.
        demotions: blocks (records) it took (from the pool or the tier before it).
        evictions: blocks it let go to make room (to the next tier, or dropped).
        failures: blocks it could not take or give back (dropped, with a warning).
        errors: its calls that raised or gave back something malformed (each with a
            warning; a failed ``put`` or ``peek`` also counts in ``failures``).
    """

    name: str
    blocks: int
    used_bytes: int
    max_bytes: int
    hits: int
    demotions: int
    evictions: int
    failures: int
    errors: int = 0


@runtime_checkable
class OffloadTier(Protocol):
    """What a tier offers the manager: a bounded, least-recently-used store of blocks by key.

    A block's key is :attr:`BlockRecord.key <kvcache_core.offload.prefix_file.BlockRecord.key>`: its
    hash for a pool without KV-cache groups (and for group 0 of one with groups), the hash
    and the group for the other groups (a state checkpoint's: the hash and the reserved
    group ``0xFFFF``). A tier files each record under its ``key`` and treats keys as
    opaque bytes. (A tier written before groups existed, filing records
    under ``block_hash``, serves pools without groups unchanged; behind a pool with groups
    the manager never maps a record it gives back under another key: it drops it as
    unreadable.)
    """

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
        """Called once by the manager before any other call (the manager refuses a tier
        another live manager holds, so a tier is bound to one manager at a time; after that
        manager's ``close()`` it may be bound again, cleared).

        Raises:
            TierError: the tier cannot hold one block of ``config`` (too small, a directory it
                cannot write).
        """
        ...

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        """Store ``record`` under ``record.key`` as the most recently used (replacing what
        that key held); return what it let go to make room, least recently used first:
        records to pass to the next tier (``record`` itself if it cannot fit at all), or
        bare keys of blocks it dropped (unreadable).

        Raises:
            Exception: the block cannot be stored (the manager drops it, with a warning).
        """
        ...

    def peek(self, key: bytes, /) -> BlockRecord | None:
        """The block stored under ``key`` (it stays), or ``None``.

        Raises:
            Exception: it is stored but cannot be read back intact (the manager drops it).
            The manager also checks what it gives back (key, shape, dtype, hash, and the
            checksum of what it was given) and drops a record that fails.
        """
        ...

    def discard(self, key: bytes, /) -> None:
        """Forget ``key`` (no error if absent)."""
        ...

    def hashes(self) -> list[bytes]:
        """The keys it holds, least recently used first (the hashes, without groups)."""
        ...

    def __contains__(self, key: object, /) -> bool:
        """Whether it holds a block under ``key``."""
        ...

    def clear(self) -> None:
        """Forget everything."""
        ...


def _check_max_bytes(max_bytes: object) -> int:
    return check_count(max_bytes, "max_bytes", 1)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or name == "pool":
        raise InvalidArgumentError(f"a tier's name must be a non-empty str other than 'pool', got {name!r}")
    return name


class _BoundedTier:
    """What the built-in tiers share: a name, a byte budget and the bytes held."""

    def __init__(self, max_bytes: object, name: object) -> None:
        self._max_bytes = _check_max_bytes(max_bytes)
        self._name = _check_name(name)
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


class HostTier(_BoundedTier):
    """Blocks in host memory (NumPy arrays) by :attr:`BlockRecord.key
    <kvcache_core.offload.prefix_file.BlockRecord.key>`, least recently used first out.

    Args:
        max_bytes: the K/V bytes it may hold (>= one block's, checked when bound).
        name: its name (``"host"``).

    Raises:
        InvalidArgumentError: ``max_bytes`` below 1, or a bad name.
    """

    def __init__(self, max_bytes: int, *, name: str = "host") -> None:
        super().__init__(max_bytes, name)
        self._blocks: OrderedDict[bytes, BlockRecord] = OrderedDict()

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        if record.nbytes > self._max_bytes:
            return [record]
        self.discard(record.key)
        # Own copies: the pool's host views must not pin (or alias) anything.
        stored = dataclasses.replace(record, keys=record.keys.copy(), values=record.values.copy())
        self._blocks[record.key] = stored
        self._used_bytes += stored.nbytes
        let_go: list[BlockRecord | bytes] = []
        while self._used_bytes > self._max_bytes:
            _, oldest = self._blocks.popitem(last=False)
            self._used_bytes -= oldest.nbytes
            let_go.append(oldest)
        return let_go

    def peek(self, key: bytes, /) -> BlockRecord | None:
        record = self._blocks.get(key)
        if record is not None:
            self._blocks.move_to_end(key)
        return record

    def discard(self, key: bytes, /) -> None:
        record = self._blocks.pop(key, None)
        if record is not None:
            self._used_bytes -= record.nbytes

    def hashes(self) -> list[bytes]:
        return list(self._blocks)

    def __contains__(self, key: object, /) -> bool:
        return key in self._blocks

    def clear(self) -> None:
        self._blocks.clear()
        self._used_bytes = 0


class DiskTier(_BoundedTier):
    """Blocks in files of a directory, one per block (per hash and KV-cache group: see
    :meth:`path_of`) in the portable format of :mod:`kvcache_core.offload.prefix_file` (checksummed,
    no pickle, the record's group in the header), least recently used first out.

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
        checked = file_path(directory, what="a disk tier's directory")
        super().__init__(max_bytes, name)
        self._directory = Path(checked)
        self._files: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes
        self._config: CacheConfig | None = None

    @property
    def directory(self) -> Path:
        """Where its files are."""
        return self._directory

    def path_of(self, key: bytes) -> Path:
        """The file of the block of ``key``: ``<hash hex>.safetensors`` in KV-cache group 0,
        ``<hash hex>.g<group>.safetensors`` in the others (the file's header also names
        the group), ``<hash hex>.state.safetensors`` for a state checkpoint."""
        block_hash, group = split_key(key)
        suffix = ".state" if group == STATE_RECORD_GROUP else f".g{group}" if group else ""
        return self._directory / f"{block_hash.hex()}{suffix}.safetensors"

    def bind(self, config: CacheConfig) -> None:
        super().bind(config)
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self._directory):
                pass
        except OSError as exc:
            raise TierError(f"tier {self._name!r} cannot write into {str(self._directory)!r}: {exc}") from exc
        self._config = config

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        assert self._config is not None, "bind the tier first"
        key = record.key
        self.discard(key)
        size = write_blocks(self.path_of(key), self._config, [record])
        if size > self._max_bytes:
            self._remove(key)
            return [record]
        self._files[key] = size
        self._used_bytes += size
        let_go: list[BlockRecord | bytes] = []
        while self._used_bytes > self._max_bytes:
            oldest = next(iter(self._files))
            try:
                let_go.append(self._read(oldest))
            except Exception:  # unreadable, however it fails: dropped rather than passed on
                let_go.append(oldest)
            self.discard(oldest)
        return let_go

    def peek(self, key: bytes, /) -> BlockRecord | None:
        if key not in self._files:
            return None
        self._files.move_to_end(key)
        return self._read(key)

    def discard(self, key: bytes, /) -> None:
        size = self._files.pop(key, None)
        if size is not None:
            self._used_bytes -= size
            self._remove(key)

    def _remove(self, key: bytes) -> None:
        """Remove the file of ``key``; one that cannot be removed (a read-only directory)
        is left behind with a warning: it is forgotten all the same, and never served."""
        try:
            remove_file(str(self.path_of(key)), what=f"the block file of tier {self._name!r}")
        except CacheFileError as exc:
            warnings.warn(f"{exc} (it is left behind)", RuntimeWarning, stacklevel=3)

    def hashes(self) -> list[bytes]:
        return list(self._files)

    def __contains__(self, key: object, /) -> bool:
        return key in self._files

    def clear(self) -> None:
        for key in list(self._files):
            self.discard(key)

    def _read(self, key: bytes) -> BlockRecord:
        assert self._config is not None, "bind the tier first"
        records = read_blocks(self.path_of(key), self._config, chained=False, size=self._files.get(key))
        if len(records) != 1 or records[0].key != key:
            block_hash, group = split_key(key)
            raise CacheFileError(
                f"{str(self.path_of(key))!r} does not hold block {block_hash.hex()[:16]}... of KV-cache group {group}"
            )
        return records[0]


#: The keyword options of the built-in kinds: accepted, and required among them.
_BUILT_IN_OPTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "host": (("name",), ()),
    "disk": (("directory", "name"), ("directory",)),
}


def create_tier(kind: str, max_bytes: int, **options: Any) -> OffloadTier:
    """A tier by kind: ``"host"`` (:class:`HostTier`), ``"disk"`` (:class:`DiskTier`, give
    ``directory=``), or the name of an entry point of :data:`TIER_ENTRY_POINT_GROUP`.

    Raises:
        InvalidArgumentError: an unknown kind (the message lists the known ones).
        InvalidTypeError: an option the built-in kind does not take, or ``"disk"`` without
            ``directory`` (the message lists the options it takes).
        TierError: a registered factory that fails to load or returns no tier.
    """
    if not isinstance(kind, str):
        raise InvalidTypeError(f"a tier kind is a str (host, disk or a registered one), got {kind!r}")
    if kind in _BUILT_IN_OPTIONS:
        accepted, required = _BUILT_IN_OPTIONS[kind]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise InvalidTypeError(
                f"create_tier({kind!r}) takes the options {', '.join(accepted)}; got {', '.join(map(repr, unknown))}"
            )
        absent = [option for option in required if option not in options]
        if absent:
            raise InvalidTypeError(f"create_tier({kind!r}) needs {', '.join(f'{name}=...' for name in absent)}")
        if kind == "host":
            return HostTier(max_bytes, **options)
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
