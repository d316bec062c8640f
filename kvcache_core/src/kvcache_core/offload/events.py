"""Cache events: what a KV-aware router needs to know about which blocks a server holds.

``manager.subscribe(callback)`` calls ``callback(event)`` for every change of the set of
block hashes each medium holds, with the fields vLLM's KV events carry:

* :class:`BlockStored` — a hash became cached in ``medium`` (the pool, ``"pool"``, or an
  offload tier, by its name): ``block_hashes``, ``parent_block_hash`` (``None`` for a
  prompt's first block), ``token_ids``, ``block_size``, ``lora_id``, ``medium``;
* :class:`BlockRemoved` — hashes left ``medium`` (evicted, demoted, overwritten);
* :class:`AllBlocksCleared` — every medium is empty (the manager was closed).

A hash is reported once per medium however many pool blocks hold its tokens: stored when
its first block registers, removed when its last one goes. So :class:`CachedBlockIndex`,
fed every event, holds exactly the hashes each medium holds.

Callbacks run after the change is complete: an operation of the manager queues its events
and they are delivered, in order, when it ends (:class:`OperationLock`), on the thread that
made the change and with the manager's lock still held (a callback may call the manager;
the events of such a call are delivered after the current ones). An :class:`Exception` a
callback raises becomes a :class:`RuntimeWarning` (the operation already succeeded); any
other :class:`BaseException` (``KeyboardInterrupt``, ``SystemExit``) is re-raised once
every queued event reached every callback, so neither the manager's records nor another
subscriber's view is left half-updated.
:mod:`kvcache_core.offload.publisher` sends the events over ZMQ, encoded as vLLM does.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, cast

from kvcache_core.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from kvcache_core.paging.prefix import PrefixCache, PrefixEntry

__all__ = [
    "POOL_MEDIUM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "CachedBlockIndex",
    "EventCallback",
    "EventHub",
    "OperationLock",
]

#: The medium of blocks in the manager's own pool.
POOL_MEDIUM = "pool"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Hashes that became cached in ``medium`` (vLLM's ``BlockStored``).

    Attributes:
        block_hashes: 32-byte SHA-256 hashes, in chain order.
        parent_block_hash: the hash of the block before the first, ``None`` for a prompt's
            first block.
        token_ids: the token ids of the blocks, ``len(block_hashes) * block_size`` of them.
        block_size: tokens per block.
        lora_id: the LoRA adapter (always ``None``: kvcache has none).
        medium: ``"pool"`` or the name of an offload tier.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str = POOL_MEDIUM


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Hashes that ``medium`` no longer holds (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[bytes, ...]
    medium: str = POOL_MEDIUM


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every medium of the manager is empty (vLLM's ``AllBlocksCleared``)."""


#: One cache event.
CacheEvent: TypeAlias = "BlockStored | BlockRemoved | AllBlocksCleared"

#: What ``manager.subscribe`` takes.
EventCallback: TypeAlias = "Callable[[CacheEvent], object]"


class EventHub:
    """The manager's subscribers, the prefix cache's listener that turns a hash entering or
    leaving the pool into an event, and the queue of notifications an operation delivers
    when it ends.

    Not thread-safe by itself: the manager calls it with its lock held.

    Args:
        block_size: tokens per block, carried by every :class:`BlockStored`.
    """

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._callbacks: list[EventCallback] = []
        # Notifications waiting for the current operation to end.
        self.pending: deque[Callable[[], None]] = deque()
        self._delivering = False
        # Operations in progress on the holding thread (the depth of the manager's lock):
        # while positive, notifications wait for the outermost one to end.
        self.depth = 0
        # A pool with state layers publishes a hash only once a checkpoint was filed at it
        # or past it (:meth:`gate_on_checkpoints`): None otherwise.
        self._prefix: PrefixCache | None = None
        self._released: set[bytes] = set()  # hashes a checkpoint at or past them released
        self._published: dict[str, set[bytes]] = {}  # medium -> the hashes published there

    @property
    def active(self) -> bool:
        """Whether anyone listens (events are built only then)."""
        return bool(self._callbacks)

    def subscribe(self, callback: EventCallback) -> None:
        """Add ``callback``; it receives every later event.

        Raises:
            InvalidTypeError: ``callback`` is not callable.
            InvalidArgumentError: ``callback`` is already subscribed.
        """
        if not callable(callback):
            raise InvalidTypeError(f"subscribe takes a callable, got {callback!r}")
        if any(existing == callback for existing in self._callbacks):
            raise InvalidArgumentError(f"{callback!r} is already subscribed")
        self._callbacks.append(callback)

    def unsubscribe(self, callback: EventCallback) -> None:
        """Remove ``callback``.

        Raises:
            InvalidArgumentError: ``callback`` is not subscribed (the message counts those that are).
        """
        for index, existing in enumerate(self._callbacks):
            if existing == callback:
                del self._callbacks[index]
                return
        raise InvalidArgumentError(f"{callback!r} is not subscribed ({len(self._callbacks)} callbacks are subscribed)")

    def defer(self, notification: Callable[[], None]) -> None:
        """Run ``notification`` when the current operation ends (now, outside one)."""
        self.pending.append(notification)
        if not self.depth:
            self.deliver()

    def emit(self, event: CacheEvent) -> None:
        """Hand ``event`` to every subscriber, in the order they subscribed, when the
        current operation ends."""
        if isinstance(event, AllBlocksCleared):
            self._released.clear()
            self._published.clear()
        if self._callbacks:
            self.defer(lambda: self._hand_out(event))

    def deliver(self) -> None:
        """Run every queued notification, in order, those queued meanwhile included.

        Raises:
            BaseException: the first non-:class:`Exception` a notification raised
                (``KeyboardInterrupt``...), once the queue is empty.
        """
        if self._delivering:
            return  # a callback's own call to the manager: the running delivery takes its events
        self._delivering = True
        interrupt: BaseException | None = None
        try:
            while self.pending:
                notification = self.pending.popleft()
                try:
                    notification()
                except BaseException as exc:  # every other event still reaches every subscriber
                    interrupt = interrupt or exc
        finally:
            self._delivering = False
        if interrupt is not None:
            raise interrupt

    def _hand_out(self, event: CacheEvent) -> None:
        interrupt: BaseException | None = None
        for callback in list(self._callbacks):
            try:
                callback(event)
            except Exception as exc:  # the change is made; a broken subscriber must not undo it
                warnings.warn(
                    f"cache event callback {callback!r} raised {exc!r} on {event!r}", RuntimeWarning, stacklevel=2
                )
            except BaseException as exc:  # the other subscribers still get the event
                interrupt = interrupt or exc
        if interrupt is not None:
            raise interrupt

    # -- pools with state layers --------------------------------------------------------

    def gate_on_checkpoints(self, prefix: PrefixCache) -> None:
        """Publish a hash of ``prefix`` (the pool of a config with state layers) in any medium
        only once a state checkpoint was filed at it or at a later block of its chain: no
        prefix hit goes past the last checkpoint, so a router must not count a block
        before one exists (a hash is then published where it is held, parents first, and
        a :class:`BlockRemoved` names only hashes that were published)."""
        self._prefix = prefix

    def checkpoint_filed(self, block_hash: bytes) -> None:
        """A state checkpoint was filed under ``block_hash``: its chain is released, and the
        hashes of it the pool holds are published there (parents first)."""
        if self._prefix is None:
            return
        chain: list[PrefixEntry] = []
        node = self._prefix.get(block_hash)
        while node is not None and node.block_hash not in self._released:
            chain.append(node)
            node = node.parent
        self._released.update(entry.block_hash for entry in chain)
        self.stored([entry for entry in reversed(chain) if entry.alive], POOL_MEDIUM)

    def admits(self, block_hash: bytes, medium: str) -> bool:
        """Whether a hash entering ``medium`` is published (always, but in a pool with state
        layers before a checkpoint released it)."""
        if self._prefix is None:
            return True
        if block_hash not in self._released:
            return False
        self._published.setdefault(medium, set()).add(block_hash)
        return True

    def _withdrawn(self, block_hashes: Iterable[bytes], medium: str) -> tuple[bytes, ...]:
        """Of ``block_hashes`` leaving ``medium``, those that were published there (a hash
        published nowhere any more is forgotten)."""
        if self._prefix is None:
            return tuple(block_hashes)
        published = self._published.get(medium, set())
        gone = tuple(block_hash for block_hash in block_hashes if block_hash in published)
        published.difference_update(gone)
        for block_hash in gone:
            if not any(block_hash in held for held in self._published.values()):
                self._released.discard(block_hash)
        return gone

    # -------------------------------------------------------------------------------------

    def stored(self, entries: Iterable[PrefixEntry], medium: str) -> None:
        """Report ``entries`` (a chain, parents first, or unrelated ones) stored in ``medium``:
        one :class:`BlockStored` per run of entries that chain one to the next."""
        if self._prefix is not None:
            entries = [entry for entry in entries if self.admits(entry.block_hash, medium)]
        if not self._callbacks:
            return
        run: list[PrefixEntry] = []
        for entry in entries:
            if run and entry.parent is not run[-1]:
                self._stored_run(run, medium)
                run = []
            run.append(entry)
        if run:
            self._stored_run(run, medium)

    def removed(self, block_hashes: Iterable[bytes], medium: str) -> None:
        """Report ``block_hashes`` gone from ``medium`` (one :class:`BlockRemoved`)."""
        hashes = self._withdrawn(block_hashes, medium)
        if not self._callbacks:
            return
        if hashes:
            self.emit(BlockRemoved(hashes, medium))

    # The prefix cache's listener (kvcache_core.paging.prefix.PrefixListener): the pool's medium.

    def entry_stored(self, entry: PrefixEntry) -> None:
        self.stored((entry,), POOL_MEDIUM)

    def entry_removed(self, entry: PrefixEntry) -> None:
        self.removed((entry.block_hash,), POOL_MEDIUM)

    def _stored_run(self, run: list[PrefixEntry], medium: str) -> None:
        first = run[0].parent
        self.emit(
            BlockStored(
                block_hashes=tuple(entry.block_hash for entry in run),
                parent_block_hash=None if first is None else first.block_hash,
                token_ids=tuple(token for entry in run for token in entry.token_ids),
                block_size=self._block_size,
                medium=medium,
            )
        )


def _holds(lock: threading.RLock) -> int:
    """How many times the calling thread holds ``lock`` (0 if it does not own it)."""
    count = getattr(lock, "_recursion_count", None)  # CPython's RLock, C and pure Python
    if count is not None:
        return cast("int", count())
    # An RLock without the count (an older or another Python): the thread owns it at least once.
    return 1 if cast("bool", getattr(lock, "_is_owned")()) else 0  # noqa: B009


class OperationLock:
    """The manager's re-entrant lock, which marks its operations: when the outermost
    holder releases it, the notifications the operation queued on ``hub`` (cache events,
    memory-pressure changes) are delivered first, with the lock still held. So a listener
    always sees the state after the change is complete, whatever it raises.

    Args:
        hub: the manager's event hub.
    """

    __slots__ = ("_hub", "_lock")

    def __init__(self, hub: EventHub) -> None:
        self._lock = threading.RLock()
        self._hub = hub

    def __enter__(self) -> OperationLock:
        # Entering is all or nothing: ``with`` calls ``__exit__`` only once ``__enter__``
        # returned, so an exception raised in between (a signal handler's
        # ``KeyboardInterrupt``, which the interpreter may raise right after ``acquire``
        # returns) must give back the hold this call took, or the lock stays held forever.
        # The try costs nothing until something is raised.
        lock, hub = self._lock, self._hub
        try:
            lock.acquire()
            hub.depth += 1
        except BaseException:
            # The owner's holds exceed the operations it began only when this call's
            # acquire took effect: an interrupted wait took nothing, and the holds of an
            # outer operation on this thread stay.
            if _holds(lock) > hub.depth:
                lock.release()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        hub = self._hub
        try:
            if hub.depth == 1 and hub.pending:
                hub.deliver()
        finally:
            hub.depth -= 1
            self._lock.release()


class CachedBlockIndex:
    """What a router keeps: the hashes each medium holds, rebuilt from events alone.

    Call it (or :meth:`apply`) with every event, in order; it can be passed to
    ``manager.subscribe`` directly.
    """

    def __init__(self) -> None:
        self._hashes: dict[str, set[bytes]] = {}
        self.parents: dict[bytes, bytes | None] = {}
        self.tokens: dict[bytes, tuple[int, ...]] = {}

    def __call__(self, event: CacheEvent) -> None:
        self.apply(event)

    def apply(self, event: CacheEvent) -> None:
        """Fold one event in."""
        if isinstance(event, BlockStored):
            held = self._hashes.setdefault(event.medium, set())
            parent = event.parent_block_hash
            for index, block_hash in enumerate(event.block_hashes):
                held.add(block_hash)
                self.parents[block_hash] = parent
                self.tokens[block_hash] = event.token_ids[index * event.block_size : (index + 1) * event.block_size]
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            self._hashes.get(event.medium, set()).difference_update(event.block_hashes)
        else:
            self._hashes.clear()

    def hashes(self, medium: str = POOL_MEDIUM) -> frozenset[bytes]:
        """The hashes ``medium`` holds."""
        return frozenset(self._hashes.get(medium, ()))

    def holds(self, block_hash: bytes, medium: str = POOL_MEDIUM) -> bool:
        """Whether ``medium`` holds ``block_hash``."""
        return block_hash in self._hashes.get(medium, ())

    def media(self) -> list[str]:
        """The media holding at least one hash."""
        return sorted(name for name, held in self._hashes.items() if held)
