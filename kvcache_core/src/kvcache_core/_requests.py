"""The manager's request lifecycle, a service over request states: opening a request (its
prefix hit in the pool and the tiers), copy-on-write for rewrites, truncation, fork,
release, swapping; and the memory-pressure gauge.

:class:`Requests` is one part of a :class:`~kvcache_core.PagedKvCacheManager`, which
resolves handles, holds the lock around every call and checks that it is open. Every
operation validates its arguments before it changes anything.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from kvcache_core.contract.config import AllocationRequest, CacheConfig, check_count
from kvcache_core.contract.protocols import KvStorage, SlotArray
from kvcache_core.contract.states import STATE_RECORD_GROUP
from kvcache_core.contract.stats import CacheGcStats, CacheManagerStats, MemoryPressure
from kvcache_core.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTypeError,
    NotSwappedOutError,
    StateRollbackError,
    SwappedOutError,
    UnknownRequestError,
    UnsupportedConfigError,
)
from kvcache_core.offload.events import AllBlocksCleared, EventHub, OperationLock
from kvcache_core.offload.state_records import unpack_states
from kvcache_core.offload.tier_stack import TierChain
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.figures import manager_stats
from kvcache_core.paging.planner import AllocationPlan
from kvcache_core.paging.request_state import RequestState
from kvcache_core.paging.sequences import SequenceBlocks

__all__ = ["PressureGauge", "Requests", "storage_config"]

ArrayT = TypeVar("ArrayT")


def storage_config(storage: KvStorage[Any], config: object) -> CacheConfig:
    """A manager's config: ``config`` checked against the storage's, or the storage's.

    Raises:
        InvalidTypeError: ``config`` is not a ``CacheConfig`` (nor ``None``).
        InvalidConfigError: ``config`` is not the one ``storage`` was built from.
        UnsupportedConfigError: a config with ``value_head_dim`` over a storage whose value
            pool is not that wide (one written before values could differ from keys), or of
            layers of their own geometry over a storage that holds one shape for all.
    """
    _check_value_width(storage)
    if config is None:
        return storage.config
    if not isinstance(config, CacheConfig):
        raise InvalidTypeError(f"config must be a CacheConfig or None, got {type(config).__name__}")
    if config.storage_config() != storage.config:
        raise InvalidConfigError(
            f"config {config!r} is not the config of the storage ({storage.config!r}): build the storage "
            "from config.storage_config()"
        )
    return config


def _check_value_width(storage: KvStorage[Any]) -> None:
    """Refuse a storage whose config has ``value_head_dim`` but whose value pool is not
    ``value_block_shape()`` (a storage that does not know the field holds ``head_dim``)."""
    built = storage.config
    if built.mixed_geometry:
        _check_layer_shapes(storage)
    if built.value_head_dim is None:
        return
    try:
        shape, _ = storage.array_info(storage.value_cache(0))
    except TypeError:
        return  # not a native array: its own checks decide
    if tuple(shape) != built.value_block_shape():
        raise UnsupportedConfigError(
            f"the storage {type(storage).__name__} holds values of shape {tuple(shape)}, not "
            f"{built.value_block_shape()} (value_head_dim {built.value_head_dim} beside head_dim {built.head_dim}): "
            "it does not serve the 'value_head_dim' capability"
        )


def _check_layer_shapes(storage: KvStorage[Any]) -> None:
    """Refuse a storage of mixed geometry (``LayerSpec(num_heads=..., head_dim=...)``) whose
    layers are not each of their own shape (a storage that builds one shape for all)."""
    built = storage.config
    for layer in range(built.num_layers):
        try:
            shapes = [tuple(storage.array_info(cache(layer))[0]) for cache in (storage.key_cache, storage.value_cache)]
        except TypeError:
            return  # not a native array: its own checks decide
        expected = [built.layer_block_shape(layer), built.layer_block_shape(layer, "values")]
        if shapes != expected:
            raise UnsupportedConfigError(
                f"the storage {type(storage).__name__} holds layer {layer} as {shapes[0]} keys and {shapes[1]} values, "
                f"not {expected[0]} and {expected[1]} ({built.layer_geometry(layer)}): it does not serve the "
                "'layer_geometry' capability (create_manager builds one storage per geometry)"
            )


class PressureGauge:
    """The memory pressure level (blocks in use over the pool) and its listener; on a change
    the callback runs when the operation ends (after its change is complete, as cache events
    do)."""

    def __init__(self, config: CacheConfig, pool: BlockPool, events: EventHub) -> None:
        self._config = config
        self._pool = pool
        self._events = events
        self.level = MemoryPressure.LOW
        self.callback: Callable[[MemoryPressure], object] | None = None

    def update(self) -> None:
        """Recompute the level; on a change, defer the callback to the operation's end."""
        config = self._config
        level = MemoryPressure.from_usage(
            self._pool.allocator.used_block_count() / config.num_blocks,
            config.medium_pressure_threshold,
            config.high_pressure_threshold,
            config.critical_pressure_threshold,
        )
        if level == self.level:
            return
        self.level = level
        callback = self.callback
        if callback is not None:
            self._events.defer(lambda: _notify_pressure(callback, level))


class Requests(Generic[ArrayT]):
    """The live requests of a manager and their lifecycle (manager internals, under its lock).

    Args:
        owner: the manager (each request state names it).
        config, storage, lock: the manager's.
        live: the live requests by id (shared with the chains and the argument checks).
        pool, chains, sequences, tiers, pressure: the manager's parts.
    """

    def __init__(
        self,
        owner: object,
        config: CacheConfig,
        storage: KvStorage[ArrayT],
        lock: OperationLock,
        live: dict[str, RequestState[ArrayT]],
        pool: BlockPool,
        chains: PrefixChains,
        sequences: SequenceBlocks,
        tiers: TierChain,
        pressure: PressureGauge,
    ) -> None:
        self._owner = owner
        self._config = config
        self._storage = storage
        self._lock = lock
        self.live = live
        self._pool = pool
        self._chains = chains
        self._sequences = sequences
        self._tiers = tiers
        self._pressure = pressure
        self.allocation_count = 0

    # -- opening -------------------------------------------------------------------------

    def allocate(self, request: object) -> RequestState[ArrayT]:
        """Open ``request``: map its prefix hit, reserve its blocks (see ``manager.allocate``).

        Raises:
            InvalidTypeError, DuplicateRequestError, OutOfBlocksError.
        """
        if not isinstance(request, AllocationRequest):
            raise InvalidTypeError(f"allocate takes an AllocationRequest, got {type(request).__name__}")
        if request.request_id in self.live:
            raise DuplicateRequestError(f"request {request.request_id!r} is already allocated")
        plan = self._sequences.plan_allocation(request)
        if plan.new_blocks > self._pool.available() - plan.revived:
            cached = f" beyond {plan.hits} cached ones" if plan.hits else ""
            raise self._pool.shortage(
                f"cannot allocate request {request.request_id!r}: {request.initial_tokens} initial tokens "
                f"need {plan.new_blocks} blocks{cached}"
            )
        states = self._pool.states
        if states.enabled and not states.available():
            raise states.shortage(f"cannot allocate request {request.request_id!r}")
        if self._tiers:  # the tier blocks continuing the pool's hit
            plan = self._sequences.planner.extend(plan, request, self._tiers)
        state = self.new_state(request.request_id, request.max_sequence_length, request.priority)
        promotion = plan.promotion
        what = f"cannot allocate request {request.request_id!r}"
        pooled = self._pooled_checkpoint(plan)  # where a hit of the pool alone starts from
        if states.enabled:  # from zeros, or from the checkpoint ending its prefix hit (pool or tier)
            if promotion is not None and promotion.checkpoint is not None:
                host = unpack_states(self._config, promotion.checkpoint.record.keys)
                kept = _kept(pooled) if states.available() > 1 else ()
                state.state_slot = states.take_from_host(host, what, kept)
            else:
                last = promotion.checkpoint_hash if promotion is not None else None
                source = states.checkpoint_of(last) if last is not None else pooled
                kept = _kept(pooled) if states.available() > 1 else ()
                state.state_slot = states.take(what) if source is None else states.take_copy(source, what, kept)
        try:
            opened = self._sequences.open(state, request, plan, self._tiers)
            promoted = promotion is not None and opened.hits == plan.hits + promotion.length
            if states.enabled and promotion is not None and not promoted:  # given up: the pool's hit alone
                if pooled is not None and (pooled == state.state_slot or pooled not in states.checkpoints.values()):
                    raise states.shortage(f"{what} (its promotion failed, and its pool hit's checkpoint is gone)")
                states.refill(state.state_slot, pooled)
        except BaseException:
            if state.tables and any(table.physical_blocks for table in state.tables):
                self._sequences.release(state)
            states.give(state.state_slot)
            raise
        if promoted and promotion is not None and promotion.checkpoint_hash is not None:
            # Its block is the pool's now, so is the checkpoint: it leaves the tiers once filed.
            checkpoint = promotion.checkpoint
            if checkpoint is not None and self._file_promoted(state, checkpoint.block_hash):
                self._tiers.take_out([(checkpoint.block_hash, STATE_RECORD_GROUP)])
            else:  # the promoted blocks' chain ends at a checkpoint (in the pool or a tier)
                states.announce(promotion.checkpoint_hash)
        if self._chains.enabled:
            self._chains.queries += plan.queries
            self._chains.hits += opened.hits
            self._chains.collisions += plan.collisions
        self._tiers.count_hits(opened.tier_hits)
        self.live[request.request_id] = state
        self.allocation_count += 1
        self._pressure.update()
        return state

    def _file_promoted(self, state: RequestState[ArrayT], block_hash: bytes) -> bool:
        """File a copy of a new request's states as the checkpoint of ``block_hash`` it was
        promoted from; whether it was. A storage that fails leaves it in the tiers (with a
        warning); an interrupt gives the request's blocks and slot back first."""
        states = self._pool.states
        try:
            return states.save_checkpoint(state.state_slot, block_hash)
        except Exception as exc:  # the request is served; the checkpoint stays where it was
            warnings.warn(
                f"filing a promoted state checkpoint failed, it stays in the tiers: {exc!r}",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        except BaseException:
            self._sequences.release(state)
            states.give(state.state_slot)
            state.state_slot = -1
            raise

    def _pooled_checkpoint(self, plan: AllocationPlan) -> int | None:
        """The slot of the checkpoint ending the pool's hit of ``plan`` (``None``: zeros)."""
        if not plan.entries or not self._pool.states.enabled:
            return None
        return self._pool.states.checkpoints.get(plan.entries[-1].block_hash)

    def can_allocate(self, request: object) -> bool:
        """Whether :meth:`allocate` would succeed now."""
        if not isinstance(request, AllocationRequest) or request.request_id in self.live:
            return False
        if self._pool.states.enabled and not self._pool.states.available():
            return False
        plan = self._sequences.plan_allocation(request)
        return plan.new_blocks <= self._pool.available() - plan.revived

    def new_state(self, request_id: str, max_sequence_length: int | None, priority: int) -> RequestState[ArrayT]:
        """A new request's state (not yet live)."""
        return RequestState(
            request_id=request_id,
            owner=self._owner,
            storage=self._storage,
            lock=self._lock,
            max_sequence_length=max_sequence_length,
            priority=priority,
            config=self._config,
        )

    def unknown(self, request_id: object) -> UnknownRequestError:
        """The error for a request id no live request has."""
        return UnknownRequestError(
            f"unknown request {request_id!r}: it was never allocated or is already "
            f"deallocated ({len(self.live)} requests are live)"
        )

    def live_state(self, request_id: object) -> RequestState[ArrayT]:
        """The live request ``request_id``'s state.

        Raises:
            UnknownRequestError: no live request has this id.
        """
        state = self.live.get(request_id) if isinstance(request_id, str) else None
        if state is None:
            raise self.unknown(request_id)
        return state

    # -- changing a resident request -----------------------------------------------------

    def writable_slots(self, state: RequestState[ArrayT], start: object, stop: object) -> SlotArray:
        """Slots of positions ``start .. stop - 1``, shared blocks copied first (see
        ``manager.writable_slots``).

        Raises:
            InvalidArgumentError, OutOfBlocksError.
        """
        table = state.table
        low = self._sequences.held_from(state)
        try:
            first, last = check_count(start, "start"), check_count(stop, "stop")
        except InvalidArgumentError:
            first = last = -1
        if not low <= first <= last <= table.sequence_length:
            raise InvalidArgumentError(
                f"positions [{start!r}, {stop!r}) are outside the held positions [{low}, "
                f"{table.sequence_length}) of request {state.request_id!r}"
            )
        copies = [self._sequences.shared_blocks(group, first, last) for group in state.tables]
        count = sum(len(group) for group in copies)
        if count > self._pool.available():
            raise self._pool.shortage(f"cannot copy {count} shared blocks of request {state.request_id!r}")
        self._sequences.copy_on_write(state, copies)
        self._chains.unregister_rewritten(state, first, last)
        if count:
            self._pressure.update()
        state.touch()
        if len(state.tables) == 1:
            return table.slots(first, last)
        return np.stack([group.slots(first, last) for group in state.tables])

    def truncate(self, state: RequestState[ArrayT], num_tokens: object) -> None:
        """Shorten the request to ``num_tokens`` (see ``manager.truncate``).

        Raises:
            InvalidArgumentError; StateRollbackError: a shorter length with state layers.
        """
        table = state.table
        states = self._pool.states
        restore = -1  # the checkpoint slot the states go back to (-2: zeros)
        if states.enabled and num_tokens != table.sequence_length:
            restore = self._checkpoint_at(state, num_tokens)
        low, windowed = self._sequences.shortest(state)
        try:
            length = check_count(num_tokens, "num_tokens")
        except InvalidArgumentError:
            length = -1
        if not low <= length <= table.sequence_length:
            raise InvalidArgumentError(
                f"num_tokens {num_tokens!r} is outside [{low}, {table.sequence_length}] for request "
                f"{state.request_id!r} (shorter, its last token's window would reach released blocks)"
                if windowed
                else f"num_tokens {num_tokens!r} is outside the held positions [{low}, {table.sequence_length}] "
                f"of request {state.request_id!r}"
            )
        if restore != -1:
            assert states.storage is not None
            slots = np.array([state.state_slot], dtype=np.int64)
            if restore == -2:
                states.storage.zero(slots)
            else:
                states.storage.copy(np.array([restore], dtype=np.int64), slots)
        self._sequences.truncate(state, length)
        state.touch()
        self._pressure.update()

    def _checkpoint_at(self, state: RequestState[ArrayT], num_tokens: object) -> int:
        """The state slot a request with state layers goes back to when truncated to
        ``num_tokens``: ``-2`` (zeros) for 0, else the checkpoint of its block ending there.

        Raises:
            StateRollbackError: no checkpoint at ``num_tokens``.
        """
        if num_tokens == 0:
            return -2
        blocks, rest = divmod(num_tokens, self._config.block_size) if isinstance(num_tokens, int) else (0, 1)
        slot = None
        if not rest and 0 < blocks <= len(state.chain):
            slot = self._pool.states.checkpoint_of(state.chain[blocks - 1].block_hash)
        if slot is None:
            raise StateRollbackError(
                f"cannot truncate request {state.request_id!r} from {state.table.sequence_length} to {num_tokens!r} "
                "tokens: its recurrent-state layers overwrite their states at every token, and no checkpoint "
                "(step.checkpoint_states) holds them at that length; valid: its length, 0, or a checkpoint's"
            )
        return slot

    def fork(self, parent: RequestState[ArrayT], new_request_id: str) -> RequestState[ArrayT]:
        """A new request sharing the parent's blocks (see ``manager.fork``).

        Raises:
            DuplicateRequestError; OutOfStateSlotsError: no free state slot for the child.
        """
        if new_request_id in self.live:
            raise DuplicateRequestError(f"cannot fork into {new_request_id!r}: it is already allocated")
        child = self.new_state(new_request_id, parent.max_sequence_length, parent.priority)
        states = self._pool.states
        if states.enabled:  # the child continues from the parent's states
            child.state_slot = states.take_copy(parent.state_slot, f"cannot fork {parent.request_id!r}")
        try:
            self._sequences.fork(parent, child)
        except BaseException:
            states.give(child.state_slot)
            raise
        self.live[new_request_id] = child
        parent.touch()
        return child

    # -- releasing and swapping ----------------------------------------------------------

    def stats(self, chains: PrefixChains, level: MemoryPressure) -> CacheManagerStats:
        """The pool's figures (``manager.stats``)."""
        return manager_stats(self._pool, chains, self.live, level, self.allocation_count)

    def gc(self) -> CacheGcStats:
        """Evict every cached block to the free list (see ``manager.gc``)."""
        started = time.perf_counter()
        count = self._pool.allocator.cached_block_count()
        self._pool.evict(count)
        return CacheGcStats(
            memory_freed=count * self._config.bytes_per_block,
            caches_freed=0,
            blocks_freed=count,
            gc_time_ms=(time.perf_counter() - started) * 1e3,
        )

    def deallocate(self, request_id: object) -> None:
        """Release the request's blocks (see ``manager.deallocate``).

        Raises:
            UnknownRequestError.
        """
        state = self.live.pop(request_id, None) if isinstance(request_id, str) else None
        if state is None:
            raise self.unknown(request_id)
        self._sequences.release(state)
        self._pool.states.give(state.state_slot)
        state.state_slot, state.state_host = -1, None
        self._pressure.update()

    def swap_out(self, request_id: object) -> None:
        """Move the request's blocks to host memory (see ``manager.swap_out``).

        Raises:
            UnknownRequestError, SwappedOutError.
        """
        state = self.live_state(request_id)
        if state.swap is not None:
            raise SwappedOutError(f"request {request_id!r} is already swapped out; swap_in brings it back")
        states = self._pool.states
        host = states.to_host(state.state_slot) if states.enabled else None
        self._sequences.swap_out(state)
        states.give(state.state_slot)
        state.state_slot, state.state_host = -1, host
        state.touch()
        self._pressure.update()

    def close(self, events: EventHub) -> None:
        """The manager closes: every request becomes invalid, page tables and steps taken
        before are refused, the tiers are emptied and ``events`` told; the storage's
        optional ``close()`` runs whatever the tiers raise."""
        self._pool.epoch += 1
        for state in self.live.values():
            state.valid = False
        try:
            self._tiers.close()
            events.emit(AllBlocksCleared())
        finally:
            release = getattr(self._storage, "close", None)
            if callable(release):
                release()

    def swap_in(self, request_id: object) -> None:
        """Bring the request's blocks back (see ``manager.swap_in``).

        Raises:
            UnknownRequestError, NotSwappedOutError, OutOfBlocksError.
        """
        state = self.live_state(request_id)
        record = state.swap
        if record is None:
            raise NotSwappedOutError(
                f"request {request_id!r} is resident, not swapped out: swap_in needs a swapped-out request"
            )
        if record.num_blocks > self._pool.available():
            raise self._pool.shortage(f"cannot swap in request {request_id!r}: it needs {record.num_blocks} blocks")
        states = self._pool.states
        slot = -1
        if state.state_host is not None:  # its states come back bit-identical
            slot = states.take_from_host(state.state_host, f"cannot swap in request {request_id!r}")
        try:
            self._sequences.swap_in(state, record)
        except BaseException:
            states.give(slot)
            raise
        state.state_slot, state.state_host = slot, None
        state.touch()
        self._pressure.update()


def _notify_pressure(callback: Callable[[MemoryPressure], object], level: MemoryPressure) -> None:
    try:
        callback(level)
    except Exception as exc:  # the operation succeeded; do not report it as failed
        warnings.warn(
            f"memory pressure callback {callback!r} raised {exc!r} on level {level.name}", RuntimeWarning, stacklevel=2
        )


def _kept(slot: int | None) -> tuple[int, ...]:
    """The checkpoint slot a new request's state slot is not taken from (a promotion given
    up falls back to it)."""
    return () if slot is None else (slot,)
