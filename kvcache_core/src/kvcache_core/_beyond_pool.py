"""What a manager offers beyond its pool: its listeners (cache events, memory pressure), the
portable prefix-cache file and offload tiers (the logic lives in :mod:`kvcache_core.offload.events`,
:mod:`kvcache_core.offload.prefix_file` and :mod:`kvcache_core.offload.tiers`).

:class:`BeyondPool` is a base of :class:`~kvcache_core.PagedKvCacheManager` (not used
alone); every method takes the manager's lock.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from kvcache_core._data_path import DataPath
from kvcache_core.contract.stats import MemoryPressure
from kvcache_core.errors import InvalidTypeError
from kvcache_core.offload import prefix_file as persist
from kvcache_core.offload.events import EventCallback, EventHub
from kvcache_core.offload.tier_stack import TierChain
from kvcache_core.offload.tiers import TierStats
from kvcache_core.paging.block_pool import BlockPool

__all__ = ["BeyondPool"]

ArrayT = TypeVar("ArrayT")


class BeyondPool(DataPath[ArrayT]):
    """Listeners, save/load and tiers of a paged manager."""

    _events: EventHub
    _tiers: TierChain
    _pool: BlockPool

    # -- listeners, save/load, offload tiers (logic in events.py, persist.py, tiers.py) -------

    def subscribe(self, callback: EventCallback) -> None:
        """Call ``callback(event)`` on every :class:`~kvcache_core.offload.events.BlockStored`,
        :class:`~kvcache_core.offload.events.BlockRemoved` and
        :class:`~kvcache_core.offload.events.AllBlocksCleared` from now on (see :mod:`kvcache_core.offload.events`).

        Callbacks run when the operation that made the change ends, after its change is
        complete, with the manager's lock held. An ``Exception`` a callback raises becomes a
        ``RuntimeWarning``; any other ``BaseException`` (``KeyboardInterrupt``) propagates
        from that operation once every event reached every subscriber.

        Raises:
            ManagerClosedError: the manager is closed.
            InvalidTypeError: ``callback`` is not callable.
            InvalidArgumentError: ``callback`` is already subscribed.
        """
        with self._lock:
            self._check_open()
            self._events.subscribe(callback)

    def unsubscribe(self, callback: EventCallback) -> None:
        """Stop calling ``callback``.

        Raises:
            ManagerClosedError: the manager is closed.
            InvalidArgumentError: ``callback`` is not subscribed.
        """
        with self._lock:
            self._check_open()
            self._events.unsubscribe(callback)

    def set_pressure_callback(self, callback: Callable[[MemoryPressure], object] | None) -> None:
        """Call ``callback(level)`` on each change of :class:`MemoryPressure` level.

        The callback runs on the thread that caused the change when the operation that
        caused it ends (after its change is complete), with the manager's lock held (it may
        call the manager). An ``Exception`` it raises becomes a warning: the operation that
        changed the level has already succeeded; any other ``BaseException``
        (``KeyboardInterrupt``) propagates from that operation. ``None`` removes it.

        Raises:
            ManagerClosedError: the manager is closed.
            InvalidTypeError: ``callback`` is neither callable nor ``None``.
        """
        with self._lock:
            self._check_open()
            if callback is not None and not callable(callback):
                raise InvalidTypeError(f"callback must be callable or None, got {callback!r}")
            self._pressure_callback = callback

    @property
    def pressure(self) -> MemoryPressure:
        """The current memory pressure level: blocks in use (referenced) over the pool.
        Cached blocks count as reclaimable, not as used: allocation evicts them."""
        return self._pressure

    def save_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Write every cached prefix block to ``path`` in the portable format of
        :mod:`kvcache_core.offload.prefix_file` (safetensors data, JSON header, checksums; no pickle).

        Returns:
            The blocks written.

        Raises:
            UnsupportedConfigError: no prefix caching. CacheFileError: the file cannot be
                written (no partial file is left).
        """
        with self._lock:
            self._check_open()
            return persist.save_prefix_cache(self._pool, self._tiers, path)

    def load_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Map the blocks of a file :meth:`save_prefix_cache` wrote (by any backend, in any
        layout) into the prefix cache as cached blocks; those already cached are skipped.

        Returns:
            The blocks loaded.

        Raises:
            CorruptCacheFileError, IncompatibleCacheFileError, CacheFileError,
                OutOfBlocksError, UnsupportedConfigError (no prefix caching): nothing is
                loaded.
        """
        with self._lock:
            self._check_open()
            return persist.load_prefix_cache(self._pool, self._tiers, path)

    def tier_stats(self) -> list[TierStats]:
        """Each offload tier's figures (blocks, bytes, hits, demotions, evictions), first
        to last, in records (one per hash and KV-cache group); empty without tiers (see
        :mod:`kvcache_core.offload.tiers`)."""
        with self._lock:
            return self._tiers.stats()
