"""The paged cache manager: policy in core, over any backend's :class:`KvStorage`.

Data path, top to bottom::

    allocate(request) -> handle             blocks reserved for initial_tokens
    extend(handle, n) -> slots [n]          the sequence grows; new blocks when needed
    write(layer, slots, keys, values)       one scatter per layer, batched across requests
    paged_attention(layer, q, page_table)   reads the pool in place

Every public method takes the manager's lock, validates everything first and only then
changes state, so a call that raises leaves every table and count as it was.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeGuard, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache_core.allocator import BlockAllocator, Placement
from kvcache_core.attention import validate_query_indptr
from kvcache_core.config import AllocationRequest, CacheConfig
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    DuplicateRequestError,
    ForeignHandleError,
    InvalidArgumentError,
    InvalidTypeError,
    KvCacheError,
    OutOfBlocksError,
    SequenceTooLongError,
    ShapeMismatchError,
    SlotError,
    UnknownRequestError,
    UnsupportedConfigError,
)
from kvcache_core.handle import PagedKvCacheHandle, RequestState
from kvcache_core.page_table import PageTable
from kvcache_core.protocols import KvCacheHandle, KvStorage, SlotArray, SlotsLike
from kvcache_core.stats import CacheGcStats, CacheManagerStats, MemoryPressure

__all__ = ["InvariantError", "PagedKvCacheManager"]

ArrayT = TypeVar("ArrayT")


class InvariantError(KvCacheError, AssertionError):
    """:meth:`PagedKvCacheManager.check_invariants` found the pool's records inconsistent."""


def _is_paged_handle(value: object) -> TypeGuard[PagedKvCacheHandle[Any]]:
    return isinstance(value, PagedKvCacheHandle)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class PagedKvCacheManager(Generic[ArrayT]):
    """Allocates request caches in one paged pool and runs the write/read path.

    Satisfies :class:`~kvcache_core.KvCacheManager` structurally. Thread-safe: every
    public method holds one re-entrant lock.

    Args:
        storage: the backend's pool; its ``config`` is the manager's.
        backend: the backend's name, for messages and ``kvcache backends``.
        placement: ``"contiguous"`` (default: requests keep their blocks in long runs) or
            ``"fifo"`` (least recently freed block first, for comparison).

    Raises:
        UnsupportedConfigError: the config asks for a policy this manager does not have yet.
    """

    def __init__(
        self, storage: KvStorage[ArrayT], *, backend: str = "custom", placement: Placement = "contiguous"
    ) -> None:
        config = storage.config
        if config.enable_prefix_caching:
            raise UnsupportedConfigError(
                "enable_prefix_caching=True is not supported yet: prefix caching is not built; "
                "use enable_prefix_caching=False"
            )
        if config.sliding_window is not None:
            raise UnsupportedConfigError(
                f"sliding_window={config.sliding_window} is not supported yet: the sliding-window "
                "policy is not built; use sliding_window=None"
            )
        self._storage = storage
        self._config = config
        self._backend = backend
        self._allocator = BlockAllocator(config.num_blocks, placement)
        self._lock = threading.RLock()
        self._requests: dict[str, RequestState[ArrayT]] = {}
        self._pressure = MemoryPressure.LOW
        self._pressure_callback: Callable[[MemoryPressure], object] | None = None
        self._allocation_count = 0
        self._allocation_failures = 0
        # Blocks become free only on release; a page table checked since the last release
        # still names only blocks in use, so per-layer attention calls skip the check.
        self._release_generation = 0
        self._checked_page_table: tuple[PageTable, int] | None = None

    # -- introspection -----------------------------------------------------------------

    @property
    def config(self) -> CacheConfig:
        """The pool's configuration."""
        return self._config

    @property
    def storage(self) -> KvStorage[ArrayT]:
        """The backend storage."""
        return self._storage

    @property
    def backend(self) -> str:
        """The backend's name."""
        return self._backend

    @property
    def allocator(self) -> BlockAllocator:
        """The block allocator (read it; the manager alone should change it)."""
        return self._allocator

    # -- lifecycle -----------------------------------------------------------------------

    def allocate(self, request: AllocationRequest) -> PagedKvCacheHandle[ArrayT]:
        """Create a request's cache and reserve blocks for its ``initial_tokens``.

        The sequence starts empty (``num_tokens() == 0``); :meth:`extend` grows it and
        hands out slots, using the reserved blocks first.

        Raises:
            InvalidTypeError: ``request`` is not an :class:`AllocationRequest`.
            DuplicateRequestError: a live request has this id.
            OutOfBlocksError: fewer free blocks than ``initial_tokens`` needs.
        """
        if not isinstance(request, AllocationRequest):
            raise InvalidTypeError(f"allocate takes an AllocationRequest, got {type(request).__name__}")
        block_size = self._config.block_size
        with self._lock:
            if request.request_id in self._requests:
                raise DuplicateRequestError(f"request {request.request_id!r} is already allocated")
            count = _blocks_for(request.initial_tokens, block_size)
            expected = (
                None if request.max_sequence_length is None else _blocks_for(request.max_sequence_length, block_size)
            )
            blocks = self._take_blocks(
                count,
                None,
                expected,
                f"cannot allocate request {request.request_id!r}: {request.initial_tokens} initial tokens "
                f"need {count} blocks",
            )
            state = RequestState(
                request_id=request.request_id,
                owner=self,
                storage=self._storage,
                lock=self._lock,
                max_sequence_length=request.max_sequence_length,
                priority=request.priority,
            )
            state.table.add_blocks(blocks)
            self._requests[request.request_id] = state
            self._allocation_count += 1
            self._update_pressure()
            return PagedKvCacheHandle(state)

    def can_allocate(self, request: AllocationRequest) -> bool:
        """Whether :meth:`allocate` would succeed now (id free, blocks enough)."""
        if not isinstance(request, AllocationRequest):
            return False
        with self._lock:
            return (
                request.request_id not in self._requests
                and _blocks_for(request.initial_tokens, self._config.block_size) <= self._allocator.free_block_count()
            )

    def extend(self, handle: KvCacheHandle[ArrayT], additional_tokens: int) -> SlotArray:
        """Grow the request by ``additional_tokens`` and return their slots.

        Returns:
            ``[additional_tokens]`` int64 slots, ``block * block_size + offset``, for the
            token positions ``num_tokens() .. num_tokens() + additional_tokens - 1``.

        Raises:
            InvalidArgumentError: ``additional_tokens`` is not an int >= 0.
            SequenceTooLongError: the request would pass its ``max_sequence_length``.
            OutOfBlocksError: fewer free blocks than the growth needs.
            InvalidHandleError: the request was deallocated.
            ForeignHandleError: the handle belongs to another manager.
        """
        if isinstance(additional_tokens, bool) or not isinstance(additional_tokens, int) or additional_tokens < 0:
            raise InvalidArgumentError(f"additional_tokens must be an int >= 0, got {additional_tokens!r}")
        with self._lock:
            state = self._state_of(handle)
            table = state.table
            old_length = table.sequence_length
            new_length = old_length + additional_tokens
            if state.max_sequence_length is not None and new_length > state.max_sequence_length:
                raise SequenceTooLongError(
                    f"request {state.request_id!r} would grow to {new_length} tokens, past its "
                    f"max_sequence_length of {state.max_sequence_length}"
                )
            block_size = self._config.block_size
            missing = _blocks_for(new_length, block_size) - table.num_blocks()
            if missing > 0:
                blocks_now = table.num_blocks()
                expected = (
                    None
                    if state.max_sequence_length is None
                    else _blocks_for(state.max_sequence_length, block_size) - blocks_now
                )
                last = table.physical_blocks[-1] if blocks_now else None
                new_blocks = self._take_blocks(
                    missing,
                    last,
                    expected,
                    f"cannot extend request {state.request_id!r} by {additional_tokens} tokens: "
                    f"{missing} more blocks needed",
                )
                table.add_blocks(new_blocks)
            slots = table.slots(old_length, new_length)
            table.extend_sequence(additional_tokens)
            state.touch()
            self._update_pressure()
            return slots

    def deallocate(self, request_id: str) -> None:
        """Release the request's blocks; every handle to it becomes invalid.

        Raises:
            UnknownRequestError: no live request has this id (never allocated, or already
                deallocated).
        """
        with self._lock:
            state = self._requests.pop(request_id, None) if isinstance(request_id, str) else None
            if state is None:
                raise UnknownRequestError(
                    f"unknown request {request_id!r}: it was never allocated or is already "
                    f"deallocated ({len(self._requests)} requests are live)"
                )
            blocks = list(state.table.physical_blocks)
            self._allocator.release(blocks, tail=blocks[-1] if blocks else None)
            self._release_generation += 1
            state.valid = False
            state.table = type(state.table)(self._config.block_size)
            self._update_pressure()

    def get_handle(self, request_id: str) -> PagedKvCacheHandle[ArrayT] | None:
        """A handle of the live request ``request_id``, or ``None``."""
        with self._lock:
            state = self._requests.get(request_id) if isinstance(request_id, str) else None
            return None if state is None else PagedKvCacheHandle(state)

    def list_handles(self) -> list[tuple[str, PagedKvCacheHandle[ArrayT]]]:
        """``(request_id, handle)`` of every live request, in allocation order."""
        with self._lock:
            return [(rid, PagedKvCacheHandle(state)) for rid, state in self._requests.items()]

    # -- data path ---------------------------------------------------------------------

    def write(self, layer: int, slots: SlotsLike, keys: ArrayT, values: ArrayT) -> None:
        """Scatter one layer's new K/V into the pool, for any mix of requests.

        Args:
            layer: ``0 <= layer < num_layers``.
            slots: ``[n]`` distinct slots from :meth:`extend` (concatenate several
                requests' slots to write them in one call).
            keys, values: ``[n, num_heads, head_dim]`` native arrays of the pool's dtype.

        Raises:
            LayerIndexError, SlotError (outside the pool, in a free block, or repeated),
            ShapeMismatchError, DTypeMismatchError, ArrayTypeError.
        """
        with self._lock:
            layer = self._config.check_layer(layer)
            slot_array = self._check_slots(slots)
            count = int(slot_array.shape[0])
            expected = (count, self._config.num_heads, self._config.head_dim)
            self._check_array("keys", keys, expected)
            self._check_array("values", values, expected)
            if count:
                self._storage.write(layer, slot_array, keys, values)

    def gather(self, handle: KvCacheHandle[ArrayT], layer: int) -> tuple[ArrayT, ArrayT]:
        """The request's keys and values as contiguous ``[num_tokens, num_heads, head_dim]``
        copies, in token order.

        Raises:
            LayerIndexError, InvalidHandleError, ForeignHandleError.
        """
        with self._lock:
            state = self._state_of(handle)
            layer = self._config.check_layer(layer)
            table = state.table
            used = _blocks_for(table.sequence_length, self._config.block_size)
            blocks = np.asarray(table.physical_blocks[:used], dtype=np.int64)
            state.touch()
            return self._storage.gather(layer, blocks, table.sequence_length)

    def page_table(self, handles: Sequence[KvCacheHandle[ArrayT]]) -> PageTable:
        """The page table of a batch, in the order of ``handles``.

        Raises:
            InvalidHandleError, ForeignHandleError: for any handle of the batch.
        """
        with self._lock:
            states = [self._state_of(handle) for handle in handles]
            table = PageTable.from_block_tables(
                [state.table for state in states], [state.request_id for state in states], self._config.block_size
            )
            self._checked_page_table = (table, self._release_generation)
            return table

    def paged_attention(
        self,
        layer: int,
        query: ArrayT,
        page_table: PageTable,
        *,
        qo_indptr: npt.ArrayLike | None = None,
        scale: float | None = None,
        causal: bool = True,
    ) -> ArrayT:
        """Attention of packed queries over the cached K/V of a batch, read in place.

        Args:
            layer: the layer whose pool to read.
            query: ``[total_q, num_query_heads, head_dim]``, requests packed in the page
                table's order; ``num_query_heads`` a multiple of ``num_heads``.
            page_table: from :meth:`page_table`, taken after the step's writes.
            qo_indptr: ``[B + 1]`` query offsets (prefill, chunked prefill, mixed
                batches); ``None`` for decode, one query per request.
            scale: score scale, ``1 / sqrt(head_dim)`` by default.
            causal: each request's queries are its last tokens and see keys up to their
                own position; ``False`` lets every query see the whole sequence.

        Returns:
            ``[total_q, num_query_heads, head_dim]`` of the query's dtype.

        Raises:
            LayerIndexError, ShapeMismatchError, DTypeMismatchError, ArrayTypeError,
            InvalidArgumentError (bad ``qo_indptr`` or ``scale``), SlotError (the page
            table names blocks outside the pool or not in use).
        """
        with self._lock:
            layer = self._config.check_layer(layer)
            shape, dtype = self._array_info("query", query)
            heads, dim = self._config.num_heads, self._config.head_dim
            if len(shape) != 3 or shape[2] != dim or shape[1] < heads or shape[1] % heads:
                raise ShapeMismatchError(
                    f"query must be [tokens, k * {heads}, {dim}] (k >= 1 query heads per KV head), got {shape}"
                )
            if dtype != self._config.dtype:
                raise DTypeMismatchError(f"query has dtype {dtype}, the pool holds {self._config.dtype}")
            if not isinstance(page_table, PageTable):
                raise InvalidTypeError(f"page_table must be a PageTable, got {type(page_table).__name__}")
            if page_table.block_size != self._config.block_size:
                raise InvalidArgumentError(
                    f"page table block_size {page_table.block_size} != pool block_size {self._config.block_size}"
                )
            if self._checked_page_table != (page_table, self._release_generation):
                self._check_blocks_in_use(page_table.kv_indices.astype(np.int64), "page table")
                self._checked_page_table = (page_table, self._release_generation)
            indptr = validate_query_indptr(qo_indptr, page_table, shape[0])
            if scale is None:
                scale = 1.0 / math.sqrt(dim)
            elif (
                isinstance(scale, bool)
                or not isinstance(scale, numbers.Real)
                or not (math.isfinite(scale) and scale > 0)
            ):
                raise InvalidArgumentError(f"scale must be a finite number > 0, got {scale!r}")
            if not isinstance(causal, bool):
                raise InvalidTypeError(f"causal must be a bool, got {causal!r}")
            return self._storage.paged_attention(layer, query, page_table, indptr, float(scale), causal)

    # -- figures -----------------------------------------------------------------------

    def stats(self) -> CacheManagerStats:
        """Figures of the whole pool."""
        with self._lock:
            used = self._allocator.used_block_count()
            tokens = sum(state.table.sequence_length for state in self._requests.values())
            capacity = used * self._config.block_size
            return CacheManagerStats(
                total_memory_bytes=self._config.num_blocks * self._config.bytes_per_block,
                used_memory_bytes=used * self._config.bytes_per_block,
                active_caches=len(self._requests),
                total_blocks=self._config.num_blocks,
                free_blocks=self._allocator.free_block_count(),
                used_blocks=used,
                tokens_stored=tokens,
                utilization=tokens / capacity if capacity else 0.0,
                cache_hit_rate=0.0,  # no prefix cache: no lookups, no hits
                eviction_count=0,  # no cached blocks to evict
                allocation_count=self._allocation_count,
                allocation_failures=self._allocation_failures,
                pressure=self._pressure,
            )

    def gc(self) -> CacheGcStats:
        """Reclaim what is reclaimable.

        Every block is either owned by a live request or free, so without prefix caching
        there is nothing to reclaim: the figures are zeros and the time the check took.
        """
        started = time.perf_counter()
        with self._lock:
            self.check_invariants()
        return CacheGcStats(
            memory_freed=0, caches_freed=0, blocks_freed=0, gc_time_ms=(time.perf_counter() - started) * 1e3
        )

    def set_pressure_callback(self, callback: Callable[[MemoryPressure], object] | None) -> None:
        """Call ``callback(level)`` on each change of :class:`MemoryPressure` level.

        The callback runs on the thread that caused the change, with the manager's lock
        held (it may call the manager). An exception it raises becomes a warning: the
        operation that changed the level has already succeeded. ``None`` removes it.

        Raises:
            InvalidTypeError: ``callback`` is neither callable nor ``None``.
        """
        if callback is not None and not callable(callback):
            raise InvalidTypeError(f"callback must be callable or None, got {callback!r}")
        with self._lock:
            self._pressure_callback = callback

    @property
    def pressure(self) -> MemoryPressure:
        """The current memory pressure level."""
        return self._pressure

    def check_invariants(self) -> None:
        """Verify the pool's records: every block free or owned, none owned twice, none
        leaked, reference counts equal to owners, free + used == total.

        Raises:
            InvariantError: naming the first inconsistency found.
        """
        with self._lock:
            allocator = self._allocator
            owners = np.zeros(self._config.num_blocks, dtype=np.int64)
            for state in self._requests.values():
                table = state.table
                blocks = table.physical_blocks
                if len(set(blocks)) != len(blocks):
                    raise InvariantError(f"request {state.request_id!r} lists a block twice: {blocks}")
                if table.sequence_length > table.capacity():
                    raise InvariantError(f"request {state.request_id!r} holds more tokens than its blocks")
                np.add.at(owners, np.asarray(blocks, dtype=np.int64), 1)
            counts = np.asarray([allocator.ref_count(b) for b in range(self._config.num_blocks)])
            wrong = np.flatnonzero(owners != counts)
            if wrong.size:
                b = int(wrong[0])
                raise InvariantError(f"block {b} has reference count {int(counts[b])} but {int(owners[b])} owners")
            if np.any(owners > 1):
                raise InvariantError(f"block {int(np.argmax(owners > 1))} is owned twice")
            free, used = allocator.free_block_count(), allocator.used_block_count()
            if free + used != self._config.num_blocks or used != int(np.count_nonzero(owners)):
                raise InvariantError(
                    f"free {free} + used {used} != total {self._config.num_blocks}, "
                    f"or {int(np.count_nonzero(owners))} blocks are owned"
                )
            if not np.array_equal(allocator.in_use_mask(), owners > 0):
                raise InvariantError("the in-use mask disagrees with the owners")
            if allocator.placement == "contiguous":
                extent_blocks = sum(end - start for start, end in allocator.free_extents())
                if extent_blocks != free:
                    raise InvariantError(f"free extents cover {extent_blocks} blocks, {free} are free")

    # -- internals ---------------------------------------------------------------------

    def _state_of(self, handle: object) -> RequestState[ArrayT]:
        as_any = getattr(handle, "as_any", None)  # downcast, as the seed crate does
        concrete: object = as_any() if callable(as_any) else None
        if not _is_paged_handle(concrete):
            raise ForeignHandleError(f"expected a handle from this manager, got {type(handle).__name__}")
        state: RequestState[Any] = concrete.request_state
        if state.owner is not self:
            raise ForeignHandleError(f"the handle of request {state.request_id!r} belongs to another manager")
        state.check_valid()
        return state

    def _take_blocks(self, count: int, after: int | None, expected: int | None, failure: str) -> list[int]:
        """Blocks from the allocator; on a shortage, count the failure and say why."""
        try:
            return self._allocator.allocate(count, after=after, expected=expected)
        except OutOfBlocksError as exc:
            self._allocation_failures += 1
            raise OutOfBlocksError(
                f"{failure}, {self._allocator.free_block_count()} of {self._config.num_blocks} are free"
            ) from exc

    def _check_slots(self, slots: SlotsLike) -> SlotArray:
        array = np.asarray(slots)
        if array.ndim != 1:
            raise ShapeMismatchError(f"slots must be 1-D, got shape {array.shape}")
        if array.size and array.dtype.kind not in "iu":
            raise InvalidTypeError(f"slots must be integers, got dtype {array.dtype}")
        total = self._config.num_blocks * self._config.block_size
        if array.size:
            low, high = int(array.min()), int(array.max())  # before any cast: uint64 stays exact
            if low < 0 or high >= total:
                bad = low if low < 0 else high
                raise SlotError(f"slot {bad} is outside the pool: valid slots are 0 to {total - 1}")
        array = array.astype(np.int64, copy=False)
        if array.size:
            self._check_blocks_in_use(array // self._config.block_size, "slot")
            if np.unique(array).size != array.size:
                values, counts = np.unique(array, return_counts=True)
                raise SlotError(f"slot {int(values[counts > 1][0])} appears more than once in one write")
        return array

    def _check_blocks_in_use(self, blocks: npt.NDArray[np.int64], what: str) -> None:
        if not blocks.size:
            return
        low, high = int(blocks.min()), int(blocks.max())
        if low < 0 or high >= self._config.num_blocks:
            raise SlotError(
                f"{what} names block {low if low < 0 else high}: valid blocks are 0 to {self._config.num_blocks - 1}"
            )
        in_use = self._allocator.in_use_mask()[blocks]
        if not in_use.all():
            block = int(blocks[np.argmin(in_use)])
            raise SlotError(f"{what} points into block {block}, which no live request owns")

    def _array_info(self, name: str, array: object) -> tuple[tuple[int, ...], str]:
        try:
            shape, dtype = self._storage.array_info(array)
        except TypeError as exc:
            raise ArrayTypeError(f"{name}: {exc}") from exc
        return tuple(shape), dtype

    def _check_array(self, name: str, array: object, expected: tuple[int, ...]) -> None:
        shape, dtype = self._array_info(name, array)
        if shape != expected:
            raise ShapeMismatchError(f"{name} must have shape {expected} ([n, num_heads, head_dim]), got {shape}")
        if dtype != self._config.dtype:
            raise DTypeMismatchError(f"{name} has dtype {dtype}, the pool holds {self._config.dtype}")

    def _update_pressure(self) -> None:
        config = self._config
        level = MemoryPressure.from_usage(
            self._allocator.used_block_count() / config.num_blocks,
            config.medium_pressure_threshold,
            config.high_pressure_threshold,
            config.critical_pressure_threshold,
        )
        if level == self._pressure:
            return
        self._pressure = level
        callback = self._pressure_callback
        if callback is None:
            return
        try:
            callback(level)
        except Exception as exc:  # the operation succeeded; do not report it as failed
            warnings.warn(
                f"memory pressure callback {callback!r} raised {exc!r} on level {level.name}",
                RuntimeWarning,
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return (
            f"PagedKvCacheManager(backend={self._backend!r}, requests={len(self._requests)}, "
            f"used_blocks={self._allocator.used_block_count()}/{self._config.num_blocks})"
        )
