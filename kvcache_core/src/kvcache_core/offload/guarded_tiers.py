"""A manager's offload tiers as its tier chain (:mod:`kvcache_core.offload.tier_stack`) calls them:
every call guarded, every record checked, each tier bound to one live manager.

A tier is code the manager does not control (a third party's, a disk that fails), so every
call of one goes through :class:`GuardedTiers`: what it raises (any ``Exception``) or gives
back malformed is counted in :attr:`TierStats.errors <kvcache_core.offload.tiers.TierStats.errors>`
with a warning, and the chain treats it as a miss where a miss is safe (a promotion, a
demotion) and as a :class:`~kvcache_core.errors.TierError` where it is not (binding,
figures); an interrupt (``KeyboardInterrupt``) propagates to the chain, which gives back
every block it took. A record a tier gives back goes into the pool only after
:meth:`GuardedTiers.problem` found nothing wrong with it. A tier binds to one manager at a
time: from the manager's construction to its ``close()`` (or its end).
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from kvcache_core.errors import InvalidTypeError, TierError, UnsupportedConfigError
from kvcache_core.offload import host_form
from kvcache_core.offload.events import BlockStored, EventHub
from kvcache_core.offload.prefix_file import BlockRecord, block_checksum, record_key
from kvcache_core.offload.redis_tier import RedisTier
from kvcache_core.offload.state_records import is_state_key, state_problem
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier, TierStats
from kvcache_core.paging.prefix import hash_block, namespace_root

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig

__all__ = ["GuardedTiers", "overflow_items"]

_T = TypeVar("_T")

#: The tiers bound to a live manager, by ``id`` (the tier is kept so its id stays its own).
_BOUND: dict[int, OffloadTier] = {}
_BOUND_LOCK = threading.Lock()


def _claim(tiers: list[OffloadTier]) -> bool:
    """Bind every one of ``tiers`` if none is bound; whether they were."""
    with _BOUND_LOCK:
        if any(id(tier) in _BOUND for tier in tiers):
            return False
        for tier in tiers:
            _BOUND[id(tier)] = tier
        return True


def _unbind(ids: tuple[int, ...]) -> None:
    """Release the bindings of one manager's tiers (its ``close()``, or its end)."""
    with _BOUND_LOCK:
        for tier_id in ids:
            _BOUND.pop(tier_id, None)


class GuardedTiers:
    """A manager's tiers, first to last, each call of them guarded and counted.

    Attributes:
        tiers: the tiers, first to last. names: their names (read once, when bound).
        counts: per name, ``[hits, demotions, evictions, failures, errors]``.
        trusted: per tier, whether it is a built-in one (its records are not checksummed).
        checksums: key -> checksum of the record an untrusted tier was given.
        host_dtype: the dtype of the pool's host copies, once seen.

    Args:
        tiers: the tiers, fastest first.
        config: the pool's configuration.
        events: the manager's event hub.

    Raises:
        InvalidTypeError: ``tiers`` is not a sequence, or holds an object that is not an
            :class:`OffloadTier`.
        UnsupportedConfigError: tiers without prefix caching.
        TierError: two tiers of one name, a tier bound to another live manager, or one
            whose members, ``name`` or ``bind`` fail (a tier that cannot hold a block of
            ``config``); then no tier stays bound.
    """

    def __init__(self, tiers: Iterable[OffloadTier], config: CacheConfig, events: EventHub) -> None:
        if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Iterable) or isinstance(tiers, OffloadTier):
            raise InvalidTypeError(
                f"tiers must be a list of OffloadTier objects (HostTier, DiskTier, ...), got {tiers!r}"
            )
        self.tiers = list(tiers)
        self._events = events
        self._config = config
        self._groups = config.num_groups
        self.names: list[str] = []
        self._unbind: Callable[[], object] = lambda: None
        self._closed_limits: list[int] | None = None  # each tier's max_bytes, once closed
        for tier in self.tiers:
            if not _is_tier(tier):
                raise InvalidTypeError(f"tiers must be OffloadTier objects (HostTier, DiskTier, ...), got {tier!r}")
        if not self.tiers:
            return
        if not config.enable_prefix_caching:
            raise UnsupportedConfigError("offload tiers need CacheConfig(enable_prefix_caching=True)")
        self.names = [_name_of(tier) for tier in self.tiers]
        if len(set(self.names)) != len(self.names):
            raise TierError(f"tier names must be unique, got {self.names}")
        # Built-in tiers keep private copies (host) or check their own checksums (disk, and
        # redis, whose records another process may have written); the records another tier
        # gives back are checked against the checksum taken when it was given them.
        self.trusted = [type(tier) in (HostTier, DiskTier, RedisTier) for tier in self.tiers]
        self.checksums: dict[bytes, str] = {}  # key -> checksum of what an untrusted tier was given
        self.host_dtype: np.dtype[Any] | None = None  # learnt from the pool's own host copies
        self._record_shape = host_form.host_record_shape(config)
        self._value_record_shape = host_form.host_record_shape(config, "values")
        self._root = namespace_root(config.model_id)
        self.counts = {name: [0, 0, 0, 0, 0] for name in self.names}  # hits, demotions, evictions, failures, errors
        self._bind(config)

    def _bind(self, config: CacheConfig) -> None:
        """Bind every tier to this manager, each at most to one live manager at a time."""
        ids = tuple(id(tier) for tier in self.tiers)
        if not _claim(self.tiers):
            gc.collect()  # a manager dropped without close() frees its tiers once collected
            if not _claim(self.tiers):
                taken = next(name for tier, name in zip(self.tiers, self.names, strict=True) if id(tier) in _BOUND)
                raise TierError(
                    f"tier {taken!r} is bound to another manager: give each manager its own tier object "
                    "(closing that manager releases it)"
                )
        self._unbind = weakref.finalize(self, _unbind, ids)
        try:
            for tier, name in zip(self.tiers, self.names, strict=True):
                try:
                    tier.bind(config)
                except TierError:
                    raise
                except Exception as exc:
                    raise TierError(f"tier {name!r} cannot be bound to this pool: {exc!r}") from exc
        except BaseException:
            self._unbind()
            raise

    def stats(self) -> list[TierStats]:
        """Each tier's figures, first to last; its blocks are records (one per hash and
        KV-cache group, each one pool block's K/V).

        Raises:
            TierError: a tier fails to give its figures (``hashes``, ``used_bytes``,
                ``max_bytes``).
        """
        if self._closed_limits is not None:  # the tiers may serve another manager now
            return [
                TierStats(name, 0, 0, limit, *self.counts[name])
                for name, limit in zip(self.names, self._closed_limits, strict=True)
            ]
        figures: list[TierStats] = []
        for tier, name in zip(self.tiers, self.names, strict=True):
            try:
                blocks, used, limit = len(tier.hashes()), int(tier.used_bytes), int(tier.max_bytes)
            except Exception as exc:
                self.counts[name][4] += 1
                raise TierError(f"tier {name!r} failed to give its figures: {exc!r}") from exc
            figures.append(TierStats(name, blocks, used, limit, *self.counts[name]))
        return figures

    def failed(self, level: int, what: str, exc: BaseException, *, dropped: int = 0) -> None:
        """Count and report a tier call that raised or gave back something malformed."""
        counts = self.counts[self.names[level]]
        counts[3] += dropped
        counts[4] += 1
        warnings.warn(f"tier {self.names[level]!r} failed to {what}: {exc!r}", RuntimeWarning, stacklevel=4)

    def guarded(self, level: int, what: str, call: Callable[[], _T], failed: _T) -> _T:
        """``call()``, or ``failed`` (counted, with a warning) when it raises an ``Exception``."""
        try:
            return call()
        except Exception as exc:
            self.failed(level, what, exc)
            return failed

    def contains(self, level: int, key: bytes) -> bool:
        """Whether tier ``level`` holds ``key`` (no when it cannot say)."""
        tier = self.tiers[level]
        return self.guarded(level, "say whether it holds a block", lambda: bool(key in tier), False)

    def holds(self, level: int, block_hash: bytes) -> bool:
        """Whether tier ``level`` holds a record of ``block_hash`` in any KV-cache group."""
        return any(self.contains(level, record_key(block_hash, group)) for group in range(self._groups))

    def anywhere(self, key: bytes) -> bool:
        """Whether some tier holds ``key``."""
        return any(self.contains(level, key) for level in range(len(self.tiers)))

    def keys(self, level: int) -> list[bytes]:
        """The keys tier ``level`` lists (none when it cannot list them)."""
        tier = self.tiers[level]
        try:
            keys = list(tier.hashes())
            for key in keys:
                if not isinstance(key, bytes):
                    raise TierError(f"it listed {key!r}, not a bytes key")
        except Exception as exc:
            self.failed(level, "list its blocks", exc)
            return []
        return keys

    def discard(self, level: int, key: bytes) -> None:
        """Drop ``key`` (held) from tier ``level``; the hash leaves its medium with its last
        record. A failing ``discard`` is counted: the tier may keep a copy, which is checked
        like any record before it is used."""
        tier = self.tiers[level]
        self.guarded(level, "discard a block", lambda: tier.discard(key), None)
        self.checksums.pop(key, None)
        block_hash = _hash_of(key)
        if not is_state_key(key) and not self.holds(level, block_hash):  # a checkpoint is in no medium
            self._events.removed((block_hash,), self.names[level])

    def problem(self, level: int, record: object, key: bytes, parent: bytes | bool | None = True) -> str | None:
        """What is wrong with ``record``, given back by tier ``level`` for ``key``, or
        ``None`` when it may go into the pool: a :class:`BlockRecord` filed under ``key``,
        host arrays of one block's shape and the pool's host dtype (a state checkpoint's:
        one state slot's bytes, :func:`~kvcache_core.offload.state_records.state_problem`), a hash that its parent,
        salt and token ids give (and the expected ``parent`` when one is given), and the
        checksum of what the tier was given."""
        if not isinstance(record, BlockRecord):
            return f"it gave back {type(record).__name__}, not a BlockRecord"
        if record.key != key:
            return (
                f"asked for key {key.hex()[:16]}... ({len(key)} bytes), it gave back the record of KV-cache "
                f"group {record.group} of {record.block_hash.hex()[:16]}... (does it file records under "
                "BlockRecord.key?)"
            )
        keys, values = record.keys, record.values
        if not isinstance(keys, np.ndarray) or not isinstance(values, np.ndarray):
            return f"its K/V are {type(keys).__name__} and {type(values).__name__}, not NumPy arrays"
        if record.is_checkpoint:  # a state checkpoint: the bytes of one state slot
            problem = state_problem(self._config, keys, values)
            return problem if problem is not None else self._chain_problem(level, record, key, parent)
        if keys.shape != self._record_shape or values.shape != self._value_record_shape:
            return (
                f"its K/V have shapes {keys.shape} and {values.shape}, a block's are {self._record_shape} and "
                f"{self._value_record_shape}"
            )
        expected = self.host_dtype or keys.dtype
        if keys.dtype != expected or values.dtype != expected:
            return f"its K/V are {keys.dtype} and {values.dtype}, the pool's host copies are {expected}"
        return self._chain_problem(level, record, key, parent)

    def _chain_problem(self, level: int, record: BlockRecord, key: bytes, parent: bytes | bool | None) -> str | None:
        """What is wrong with ``record``'s place in a hash chain and its checksum (``None``: nothing)."""
        if parent is not True and record.parent_hash != parent:
            return "its parent hash is not the prompt's previous block"
        try:
            tokens_ok = len(record.token_ids) == self._config.block_size
            rehashed = hash_block(
                self._root if record.parent_hash is None else record.parent_hash, record.token_ids, record.salt
            )
        except Exception as exc:
            return f"its parent hash, salt or token ids are malformed ({exc!r})"
        if not tokens_ok or rehashed != record.block_hash:
            return "its hash does not match its parent hash, salt and token ids"
        checksum = None if self.trusted[level] else self.checksums.get(key)
        if checksum is not None and block_checksum(record.keys, record.values) != checksum:
            return "its K/V do not match the checksum of the block it was given"
        return None

    def report(self, level: int, record: BlockRecord, held: bool) -> None:
        """The event for ``record``'s hash in tier ``level`` after a put, given whether the
        tier held the hash before (none for a state checkpoint: it is in no medium, and
        a hash is there only while one of its blocks is)."""
        if record.is_checkpoint:
            return
        now = self.holds(level, record.block_hash)
        if now and not held and self._events.admits(record.block_hash, self.names[level]):
            self._events.emit(
                BlockStored(
                    (record.block_hash,),
                    record.parent_hash,
                    record.token_ids,
                    self._config.block_size,
                    medium=self.names[level],
                )
            )
        elif held and not now:
            self._events.removed((record.block_hash,), self.names[level])

    def prune_checksums(self) -> None:
        """Forget the checksums of records no untrusted tier holds any more (one that drops
        records without saying so would make them grow)."""
        held: set[bytes] = set()
        for level in range(len(self.tiers)):
            if not self.trusted[level]:
                held.update(self.keys(level))
        if len(self.checksums) > 2 * len(held) + 512:
            self.checksums = {key: checksum for key, checksum in self.checksums.items() if key in held}

    def close(self) -> None:
        """Empty every tier and release the bindings (the manager closes): each tier is
        cleared even if another fails (counted, with a warning); the bindings are released
        whatever a tier raises. From then on :meth:`stats` gives the counts without asking
        the tiers (another manager may hold them): no blocks, no bytes."""
        limits = [0] * len(self.tiers)
        try:
            for level, tier in enumerate(self.tiers):
                limits[level] = self.guarded(level, "give its size", _size_of(tier), 0)
                self.guarded(level, "clear", tier.clear, None)
        finally:
            self._closed_limits = limits
            self._unbind()


def _size_of(tier: OffloadTier) -> Callable[[], int]:
    """A call reading ``tier``'s ``max_bytes``."""
    return lambda: int(tier.max_bytes)


def _is_tier(tier: object) -> bool:
    """Whether ``tier`` has the members of an :class:`OffloadTier`.

    Raises:
        TierError: reading them fails (the check reads its properties).
    """
    try:
        return isinstance(tier, OffloadTier)
    except Exception as exc:
        raise TierError(f"the tier {type(tier).__name__} fails when its members are read: {exc!r}") from exc


def _name_of(tier: OffloadTier) -> str:
    """A tier's name, read once when it is bound.

    Raises:
        TierError: it fails, or is not a non-empty str other than ``"pool"``.
    """
    try:
        name = tier.name
    except Exception as exc:
        raise TierError(f"the tier {tier!r} fails to give its name: {exc!r}") from exc
    if not isinstance(name, str) or not name or name == "pool":
        raise TierError(f"a tier's name must be a non-empty str other than 'pool', got {name!r} from {tier!r}")
    return name


def overflow_items(overflow: object) -> list[BlockRecord | bytes]:
    """What ``put`` says it let go, as a list.

    Raises:
        TierError: not a list of records and keys.
    """
    if not isinstance(overflow, list):
        raise TierError(f"put gave back {overflow!r}, not a list of the records and keys it let go")
    items: list[BlockRecord | bytes] = []
    for item in cast("list[object]", overflow):
        if not isinstance(item, (BlockRecord, bytes)):
            raise TierError(f"put let go {item!r}, neither a BlockRecord nor a key")
        items.append(item)
    return items


def _hash_of(key: bytes) -> bytes:
    """The block hash a tier's key starts with (:func:`~kvcache_core.offload.prefix_file.record_key`);
    read leniently: a key a tier mangled must not break an eviction."""
    return key[:32]
