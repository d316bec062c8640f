"""The paged cache manager: policy in core, over any backend's :class:`KvStorage`.

Data path, top to bottom::

    allocate(request) -> handle             blocks reserved for initial_tokens (prefix hits mapped)
    extend(handle, n) -> slots [n]          the sequence grows; new blocks when needed
    write(layer, slots, keys, values)       one scatter per layer, batched across requests
    paged_attention(layer, q, page_table)   reads the pool in place

Policies, the same for every backend (they move bytes only through ``KvStorage``):

* **prefix caching** (``CacheConfig(enable_prefix_caching=True)``): a full block whose K/V
  are written is hashed (chained with its prefix, see :mod:`kvcache_core.prefix`);
  ``allocate`` maps the cached full blocks of ``AllocationRequest.prompt_token_ids`` and
  starts the sequence after them. Blocks nobody references stay cached until evicted,
  least recently used first; blocks without a hash are always reused first.
* **fork with copy-on-write**: :meth:`PagedKvCacheManager.fork` shares blocks; the first
  slot handed out in a shared block (``extend``, ``writable_slots``) copies that block.
* **swapping**: ``swap_out`` copies a request's blocks to host memory and releases them;
  ``swap_in`` brings them back, bit-identical, into any free blocks.
* **sliding window** (``CacheConfig(sliding_window=W)``): blocks wholly older than the
  window of the next token are released as a request grows; attention masks the rest.

Every public method takes the manager's lock, validates everything first and only then
changes state, so a call that raises leaves every table and count as it was.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeGuard, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.allocator import BlockAllocator, Placement
from kvcache_core.attention import check_scale, validate_query_indptr
from kvcache_core.block_table import BlockTable
from kvcache_core.config import AllocationRequest, CacheConfig, check_count, check_token_ids
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    DuplicateRequestError,
    ForeignHandleError,
    InvalidArgumentError,
    InvalidTypeError,
    InvariantError,
    ManagerClosedError,
    NotSwappedOutError,
    OutOfBlocksError,
    SequenceTooLongError,
    ShapeMismatchError,
    SharedBlockWriteError,
    SlotError,
    StalePageTableError,
    StaleStepError,
    SwappedOutError,
    UnknownRequestError,
)
from kvcache_core.handle import PagedKvCacheHandle, RequestState, SwapRecord, next_generation
from kvcache_core.page_table import PageTable
from kvcache_core.prefix import PrefixCache, PrefixEntry, same_prefix
from kvcache_core.protocols import KvCacheHandle, KvStorage, SlotArray, SlotsLike
from kvcache_core.stats import CacheGcStats, CacheManagerStats, MemoryPressure
from kvcache_core.step import Step, StepHooks

__all__ = ["InvariantError", "PagedKvCacheManager"]

ArrayT = TypeVar("ArrayT")
_ManagerT = TypeVar("_ManagerT", bound="PagedKvCacheManager[Any]")


def _is_paged_handle(value: object) -> TypeGuard[PagedKvCacheHandle[Any]]:
    return isinstance(value, PagedKvCacheHandle)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _AllocationPlan(NamedTuple):
    """What ``allocate`` would do, worked out without changing anything."""

    hits: list[tuple[PrefixEntry, int]]  # per cached logical block: its entry and the block to map
    queries: int  # full prompt blocks looked up
    collisions: int
    released: int  # leading hit blocks a sliding window leaves unmapped
    new_blocks: int  # blocks to take from the pool
    revived: int  # mapped hit blocks that are cached now (not free, not in use)


class _GrowthPlan(NamedTuple):
    """What growing a request by ``tokens`` tokens takes, worked out without changing anything."""

    tokens: int
    new_ids: tuple[int, ...]  # token ids not known before
    released: int  # leading blocks the sliding window releases
    freed: int  # of those, blocks nobody else holds (they return to the pool)
    copies: list[int]  # shared logical blocks the new positions fall in (copy-on-write)
    missing: int  # new blocks to take

    @property
    def needed(self) -> int:
        return self.missing + len(self.copies)


class PagedKvCacheManager(Generic[ArrayT]):
    """Allocates request caches in one paged pool, runs the write/read path and the cache
    policies (prefix caching, fork with copy-on-write, eviction, swapping, sliding window).

    Satisfies :class:`~kvcache_core.KvCacheManager` structurally. Thread-safe: every
    public method holds one re-entrant lock.

    Prefix caching, the rule for when a block becomes cacheable: a block is hashed and
    findable by later requests once (1) it is full (``extend`` handed out all its
    positions), (2) the token ids of all its positions are known (from
    ``AllocationRequest.prompt_token_ids`` or ``extend(..., token_ids=...)``), (3) every one
    of its slots has been written through :meth:`write` in every layer, and (4) the block
    before it is hashed. The manager tracks the writes itself; the caller marks nothing.

    Args:
        storage: the backend's pool; its ``config`` is the manager's.
        backend: the backend's name, for messages and ``kvcache backends``.
        placement: ``"contiguous"`` (default: requests keep their blocks in long runs) or
            ``"fifo"`` (least recently freed block first, for comparison).
    """

    def __init__(
        self, storage: KvStorage[ArrayT], *, backend: str = "custom", placement: Placement = "contiguous"
    ) -> None:
        config = storage.config
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
        # Every change of a request's generation bumps the epoch; a page table checked in
        # this epoch still names only its requests' own blocks, so per-layer attention
        # calls skip the check. Tables this manager issued cannot be edited (read-only).
        self._ownership_epoch = 0
        self._checked_page_table: tuple[PageTable, int] | None = None
        self._issued_tables: weakref.WeakSet[PageTable] = weakref.WeakSet()
        # Slots whose positions extend (or a prefix hit, copy or swap_in) handed out: a
        # write anywhere else in a block is refused (it would count as written too early).
        self._issued = np.zeros(config.num_blocks * config.block_size, dtype=np.bool_)
        # Prefix caching: the hash map, which slots hold written K/V ([layers, slots]), and
        # the blocks whose writes some request's hash chain waits for.
        self._prefix: PrefixCache | None = PrefixCache() if config.enable_prefix_caching else None
        self._written: npt.NDArray[np.bool_] | None = (
            np.zeros((config.num_layers, config.num_blocks * config.block_size), dtype=np.bool_)
            if config.enable_prefix_caching
            else None
        )
        # Blocks registered in the prefix cache: immutable, so a plain write there is refused.
        self._registered = np.zeros(config.num_blocks, dtype=np.bool_)
        self._awaiting: dict[int, set[str]] = {}
        self._awaiting_mask = np.zeros(config.num_blocks, dtype=np.bool_)
        # Blocks a swap_out released (and nobody took since) -> the request, for the error
        # a stale slot of a swapped-out request gets.
        self._swapped_blocks: dict[int, str] = {}
        self._eviction_count = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._hash_collisions = 0
        self._copy_on_write_count = 0

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

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache's hash map (``None`` without prefix caching); read it only."""
        return self._prefix

    # -- lifecycle -----------------------------------------------------------------------

    def allocate(self, request: AllocationRequest) -> PagedKvCacheHandle[ArrayT]:
        """Create a request's cache and reserve blocks for its ``initial_tokens``.

        Without a prefix hit the sequence starts empty (``num_tokens() == 0``). With prefix
        caching, every cached full block of ``request.prompt_token_ids`` is mapped (shared,
        not copied), at most ``(len(prompt) - 1) // block_size`` of them so that the last
        prompt token is always computed; the sequence then starts at the cached tokens
        (``handle.num_tokens() == handle.num_cached_tokens()``) and :meth:`extend` hands
        out slots for the rest. Reserved blocks cover ``max(initial_tokens, cached)``
        positions; cached blocks nobody uses are evicted (oldest first) when free blocks
        do not suffice.

        Raises:
            InvalidTypeError: ``request`` is not an :class:`AllocationRequest`.
            DuplicateRequestError: a live request has this id.
            OutOfBlocksError: fewer free and evictable blocks than ``initial_tokens`` needs.
        """
        if not isinstance(request, AllocationRequest):
            raise InvalidTypeError(f"allocate takes an AllocationRequest, got {type(request).__name__}")
        block_size = self._config.block_size
        with self._lock:
            self._check_open()
            if request.request_id in self._requests:
                raise DuplicateRequestError(f"request {request.request_id!r} is already allocated")
            plan = self._plan_allocation(request)
            available = self._allocator.free_block_count() + self._allocator.cached_block_count() - plan.revived
            if plan.new_blocks > available:
                self._allocation_failures += 1
                raise OutOfBlocksError(
                    f"cannot allocate request {request.request_id!r}: {request.initial_tokens} initial tokens "
                    f"need {plan.new_blocks} blocks{self._cached_note(len(plan.hits))}, {self._free_note()}"
                )
            state = RequestState(
                request_id=request.request_id,
                owner=self,
                storage=self._storage,
                lock=self._lock,
                max_sequence_length=request.max_sequence_length,
                priority=request.priority,
            )
            mapped: list[int] = []
            for _, block in plan.hits[plan.released :]:
                if self._allocator.is_cached(block):
                    self._allocator.revive(block)
                    self._swapped_blocks.pop(block, None)
                else:
                    self._allocator.retain(block)
                mapped.append(block)
            logical_now = len(plan.hits)
            new_blocks = self._take_blocks(
                plan.new_blocks,
                mapped[-1] if mapped and self._allocator.ref_count(mapped[-1]) == 1 else None,
                self._expected_blocks(request.max_sequence_length, logical_now),
                f"cannot allocate request {request.request_id!r}",
            )
            cached_tokens = len(plan.hits) * block_size
            state.table = BlockTable(block_size, mapped + new_blocks, cached_tokens, first_logical=plan.released)
            state.cached_tokens = cached_tokens
            if mapped:
                self._issued[state.table.slots(plan.released * block_size, cached_tokens)] = True
            if self._prefix is not None:
                state.token_ids = list(request.prompt_token_ids or ())
                state.salt = request.salt_bytes()
                state.chain = [entry for entry, _ in plan.hits]
                self._prefix_queries += plan.queries
                self._prefix_hits += len(plan.hits)
                self._hash_collisions += plan.collisions
            self._requests[request.request_id] = state
            self._allocation_count += 1
            self._update_pressure()
            return PagedKvCacheHandle(state)

    def can_allocate(self, request: AllocationRequest) -> bool:
        """Whether :meth:`allocate` would succeed now (id free, free and evictable blocks
        enough, prefix hits taken into account)."""
        if not isinstance(request, AllocationRequest):
            return False
        with self._lock:
            if request.request_id in self._requests:
                return False
            plan = self._plan_allocation(request)
            available = self._allocator.free_block_count() + self._allocator.cached_block_count() - plan.revived
            return plan.new_blocks <= available

    def extend(
        self, handle: KvCacheHandle[ArrayT], additional_tokens: int, *, token_ids: Sequence[int] | None = None
    ) -> SlotArray:
        """Grow the request by ``additional_tokens`` and return their slots.

        Slots always point at blocks this request alone holds: a shared block (after
        :meth:`fork` or a prefix hit) that the new positions fall in is copied first
        (copy-on-write, one ``storage.copy_blocks`` per shared block). With a sliding
        window ``W``, blocks wholly older than the window of the first new token are
        released first: the request keeps the blocks of positions
        ``num_tokens() - W + 1`` onwards, so one growing a token per step never holds more
        than ``ceil(W / block_size) + 1`` blocks (beyond what ``initial_tokens`` reserved
        ahead). Queries attending after this call should be the new tokens': an earlier
        token's window may reach into released blocks.

        Args:
            handle: the request.
            additional_tokens: tokens to add (>= 0).
            token_ids: the new tokens' ids (``[additional_tokens]``), so that their blocks
                can be cached (prefix caching). Positions the prompt already covers must
                repeat the prompt's ids. Ids may be given only while every earlier
                position's id is known; without prefix caching they are checked and
                ignored.

        Returns:
            ``[additional_tokens]`` int64 slots, ``block * block_size + offset``, for the
            token positions ``num_tokens() .. num_tokens() + additional_tokens - 1``.

        Raises:
            InvalidArgumentError: ``additional_tokens`` is not an int >= 0, or bad
                ``token_ids`` (type, length, range, disagreeing with the prompt, or after
                positions whose ids were never given).
            SequenceTooLongError: the request would pass its ``max_sequence_length``.
            OutOfBlocksError: fewer free and evictable blocks than the growth needs.
            InvalidHandleError: the request was deallocated; SwappedOutError: it is
                swapped out.
            ForeignHandleError: the handle belongs to another manager.
        """
        additional_tokens = check_count(additional_tokens, "additional_tokens")
        ids = None if token_ids is None else check_token_ids(token_ids, "token_ids")
        if ids is not None and len(ids) != additional_tokens:
            raise InvalidArgumentError(
                f"token_ids holds {len(ids)} ids for additional_tokens={additional_tokens}; give one id per new token"
            )
        with self._lock:
            state = self._state_of(handle)
            plan = self._plan_growth(state, additional_tokens, ids)
            if plan.needed > self._allocator.free_block_count() + self._allocator.cached_block_count() + plan.freed:
                self._allocation_failures += 1
                copied = f" ({len(plan.copies)} to copy shared blocks)" if plan.copies else ""
                raise OutOfBlocksError(
                    f"cannot extend request {state.request_id!r} by {additional_tokens} tokens: "
                    f"{plan.needed} more blocks needed{copied}, {self._free_note()}"
                )
            slots = self._grow(state, plan)
            self._update_pressure()
            return slots

    def writable_slots(self, handle: KvCacheHandle[ArrayT], start: int, stop: int) -> SlotArray:
        """Slots of the request's positions ``start .. stop - 1``, safe to write into: any
        shared block among them is copied first (copy-on-write), so that rewriting tokens
        of a forked or prefix-shared request changes no other request.

        A block registered in the prefix cache is immutable: one the request holds alone
        leaves the prefix cache (its hash is unregistered) before any slot is handed out,
        and a shared one is copied (the copy is not registered). The request's own hash
        chain stops before the first of its hashed blocks in the range, so it never
        registers K/V a rewrite may have changed.

        Raises:
            InvalidArgumentError: not ``first_held <= start <= stop <= num_tokens()``
                (``first_held`` is 0 unless a sliding window released leading blocks).
            OutOfBlocksError: fewer free and evictable blocks than the copies need.
            InvalidHandleError, SwappedOutError, ForeignHandleError: as :meth:`extend`.
        """
        with self._lock:
            state = self._state_of(handle)
            table = state.table
            low = table.first_logical * self._config.block_size
            try:
                first, last = check_count(start, "start"), check_count(stop, "stop")
            except InvalidArgumentError:
                first = last = -1
            if not low <= first <= last <= table.sequence_length:
                raise InvalidArgumentError(
                    f"positions [{start!r}, {stop!r}) are outside the held positions [{low}, "
                    f"{table.sequence_length}) of request {state.request_id!r}"
                )
            copies = self._shared_blocks(table, first, last)
            if len(copies) > self._allocator.free_block_count() + self._allocator.cached_block_count():
                self._allocation_failures += 1
                raise OutOfBlocksError(
                    f"cannot copy {len(copies)} shared blocks of request {state.request_id!r}, {self._free_note()}"
                )
            self._copy_on_write(state, copies)
            self._unregister_rewritten(state, first, last)
            if copies:
                self._update_pressure()
            state.touch()
            return table.slots(first, last)

    def truncate(self, handle: KvCacheHandle[ArrayT], num_tokens: int) -> None:
        """Shorten the request to its first ``num_tokens`` tokens (speculative-decoding
        rollback, transformers' ``crop``).

        Blocks wholly past the new end are released at once (reserved ones too): a block
        holding a cached prefix stays cached, a shared one stays with its other holders.
        The block the new end falls in keeps its first tokens; if it was registered in
        the prefix cache and the request holds it alone it leaves the cache (the request
        will write new tokens into it), and if it is shared the next ``extend`` copies it.
        The request's hash chain and token ids are cut to the new length. Page tables and
        steps taken before are refused afterwards.

        Raises:
            InvalidArgumentError: ``num_tokens`` past ``num_tokens()``, or so short that
                the window of its last token would reach blocks a sliding window released
                (at least ``first_held + W - 1`` once any was released).
            InvalidHandleError, SwappedOutError, ForeignHandleError: as :meth:`extend`.
        """
        with self._lock:
            state = self._state_of(handle)
            table = state.table
            low = table.first_logical * self._config.block_size
            window = self._config.sliding_window
            if window is not None and table.first_logical:
                low += window - 1  # the last token's window must not reach a released block
            try:
                length = check_count(num_tokens, "num_tokens")
            except InvalidArgumentError:
                length = -1
            if not low <= length <= table.sequence_length:
                raise InvalidArgumentError(
                    f"num_tokens {num_tokens!r} is outside [{low}, {table.sequence_length}] for request "
                    f"{state.request_id!r} (shorter, its last token's window would reach released blocks)"
                    if window is not None and table.first_logical
                    else f"num_tokens {num_tokens!r} is outside the held positions [{low}, {table.sequence_length}] "
                    f"of request {state.request_id!r}"
                )
            self._truncate_state(state, length)
            state.touch()
            self._update_pressure()

    def fork(self, handle: KvCacheHandle[ArrayT], new_request_id: str) -> PagedKvCacheHandle[ArrayT]:
        """A new request that shares every block holding the request's tokens.

        Nothing is copied now: each shared block's reference count rises by one, and the
        first slot handed out in a shared block (by :meth:`extend` or
        :meth:`writable_slots`, for either request) copies that block alone. The two
        requests then diverge without seeing each other's writes. The parent's reserved
        empty blocks stay the parent's. Write the K/V of slots already handed out before
        forking: a :meth:`write` into a shared block is refused.

        Returns:
            The new request's handle (same length, ``max_sequence_length`` and priority).

        Raises:
            InvalidArgumentError: ``new_request_id`` is not a non-empty str.
            DuplicateRequestError: a live request has ``new_request_id``.
            InvalidHandleError, SwappedOutError, ForeignHandleError: bad parent handle.
        """
        if not isinstance(new_request_id, str) or not new_request_id:
            raise InvalidArgumentError(f"new_request_id must be a non-empty str, got {new_request_id!r}")
        with self._lock:
            parent = self._state_of(handle)
            if new_request_id in self._requests:
                raise DuplicateRequestError(f"cannot fork into {new_request_id!r}: it is already allocated")
            table = parent.table
            shared = table.physical_blocks[: _blocks_for(table.held_tokens(), self._config.block_size)]
            for block in shared:
                self._allocator.retain(block)
            child = RequestState(
                request_id=new_request_id,
                owner=self,
                storage=self._storage,
                lock=self._lock,
                max_sequence_length=parent.max_sequence_length,
                priority=parent.priority,
            )
            child.table = BlockTable(
                self._config.block_size, shared, table.sequence_length, first_logical=table.first_logical
            )
            child.token_ids = list(parent.token_ids)
            child.salt = parent.salt
            child.chain = list(parent.chain)
            child.chain_open = parent.chain_open
            if parent.awaiting_block is not None and parent.awaiting_block in shared:
                self._set_awaiting(child, parent.awaiting_block)
            self._requests[new_request_id] = child
            self._replanned(parent)  # its blocks are shared now: a step planned before is stale
            parent.touch()
            return PagedKvCacheHandle(child)

    def deallocate(self, request_id: str) -> None:
        """Release the request's blocks; every handle to it becomes invalid.

        Blocks shared with other requests stay theirs; blocks holding a cached prefix stay
        cached (evictable) when their last reference goes; the rest become free. A
        swapped-out request's host copy is dropped.

        Raises:
            UnknownRequestError: no live request has this id (never allocated, or already
                deallocated).
        """
        with self._lock:
            self._check_open()
            state = self._requests.pop(request_id, None) if isinstance(request_id, str) else None
            if state is None:
                raise UnknownRequestError(
                    f"unknown request {request_id!r}: it was never allocated or is already "
                    f"deallocated ({len(self._requests)} requests are live)"
                )
            if state.swap is None:
                self._set_awaiting(state, None)
                self._release_blocks(list(state.table.physical_blocks))
            else:
                self._forget_swapped_blocks(state.request_id, state.swap)
            state.valid = False
            state.swap = None
            self._new_generation(state)
            state.chain = []
            state.table = type(state.table)(self._config.block_size)
            self._update_pressure()

    def swap_out(self, request_id: str) -> None:
        """Move a request's blocks to host memory and release them to the pool.

        The blocks holding its tokens are copied with ``storage.blocks_to_host``; then the
        request drops its reference on every block it held: a block shared with another
        request (fork, prefix hit) stays with that request, a block holding a cached
        prefix stays cached, the rest become free. Its handles stay valid
        (``is_valid()``) and report ``is_swapped_out()``; data access raises
        :class:`~kvcache_core.errors.SwappedOutError` until :meth:`swap_in`.

        Raises:
            UnknownRequestError: no live request has this id.
            SwappedOutError: the request is already swapped out.
        """
        with self._lock:
            state = self._live_state(request_id)
            if state.swap is not None:
                raise SwappedOutError(f"request {request_id!r} is already swapped out; swap_in brings it back")
            table = state.table
            block_size = self._config.block_size
            kept = table.physical_blocks[: _blocks_for(table.held_tokens(), block_size)]
            kept_array = np.asarray(kept, dtype=np.int64)
            keys, values = self._storage.blocks_to_host(kept_array)
            written = None
            if self._written is not None:
                written = self._written[:, self._block_slots(kept_array)].copy()
            self._set_awaiting(state, None)
            unreferenced = self._release_blocks(list(table.physical_blocks))
            for block in unreferenced:
                self._swapped_blocks[block] = state.request_id
            state.swap = SwapRecord(
                keys=keys,
                values=values,
                sequence_length=table.sequence_length,
                first_logical=table.first_logical,
                written=written,
                released_blocks=tuple(unreferenced),
            )
            state.table = BlockTable(block_size)
            self._new_generation(state)
            state.touch()
            self._update_pressure()

    def swap_in(self, request_id: str) -> None:
        """Bring a swapped-out request's blocks back from host memory, bit-identical, into
        any free (or evicted) blocks; its handles give access to data again.

        Atomic: when the blocks do not fit, nothing changes.

        Raises:
            UnknownRequestError: no live request has this id.
            NotSwappedOutError: the request is resident.
            OutOfBlocksError: fewer free and evictable blocks than it needs.
        """
        with self._lock:
            state = self._live_state(request_id)
            record = state.swap
            if record is None:
                raise NotSwappedOutError(
                    f"request {request_id!r} is resident, not swapped out: swap_in needs a swapped-out request"
                )
            count = record.num_blocks
            if count > self._allocator.free_block_count() + self._allocator.cached_block_count():
                self._allocation_failures += 1
                raise OutOfBlocksError(
                    f"cannot swap in request {request_id!r}: it needs {count} blocks, {self._free_note()}"
                )
            blocks = self._take_blocks(
                count,
                None,
                self._expected_blocks(state.max_sequence_length, record.first_logical),
                f"cannot swap in request {request_id!r}",
            )
            block_array = np.asarray(blocks, dtype=np.int64)
            try:
                self._storage.blocks_from_host(block_array, record.keys, record.values)
            except BaseException:  # nothing is committed yet: give the blocks back
                if blocks:
                    self._allocator.release(blocks[::-1], blocks[-1])
                raise
            if self._written is not None and record.written is not None:
                self._written[:, self._block_slots(block_array)] = record.written
            self._forget_swapped_blocks(state.request_id, record)
            state.table = BlockTable(
                self._config.block_size, blocks, record.sequence_length, first_logical=record.first_logical
            )
            held_from = record.first_logical * self._config.block_size
            self._issued[state.table.slots(held_from, max(held_from, record.sequence_length))] = True
            state.swap = None
            self._new_generation(state)
            self._rechain(state)
            self._advance_chain(state)
            state.touch()
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

    def begin_step(
        self,
        handles: Sequence[KvCacheHandle[ArrayT]],
        new_tokens: Sequence[int] | int,
        *,
        token_ids: Sequence[Sequence[int] | None] | None = None,
    ) -> Step[ArrayT]:
        """Plan one forward pass: grow every request of the batch, once, with every check.

        Each request grows by its count of new tokens exactly as :meth:`extend` does
        (copy-on-write of shared blocks, sliding-window release, reserved blocks); the
        step then holds the new tokens' slots, the batch's page table after the growth
        and the query offsets. Its per-layer :meth:`Step.write` and
        :meth:`Step.attention` check only the layer's arrays.

        Args:
            handles: the batch's requests, each once.
            new_tokens: tokens each request adds (``[B]``), or one count for all; 0 is
                allowed (a request that only attends).
            token_ids: for prefix caching, each request's new token ids (or ``None``),
                as :meth:`extend` takes them.

        Returns:
            The step. It is refused (:class:`~kvcache_core.errors.StaleStepError`) once
            one of its requests is released, swapped out, truncated, forked, extended or
            planned into another step.

        Raises:
            InvalidTypeError: ``handles`` is not a sequence of handles.
            InvalidArgumentError: a request listed twice, counts that are not one int
                >= 0 per request, or bad ``token_ids``.
            SequenceTooLongError: a request would pass its ``max_sequence_length``.
            OutOfBlocksError: the batch's growth needs more free and evictable blocks
                than there are (checked for the whole batch before anything changes).
            InvalidHandleError, SwappedOutError, ForeignHandleError: a bad handle.
        """
        if isinstance(handles, (str, bytes)) or not isinstance(handles, Sequence):
            raise InvalidTypeError(f"begin_step takes a sequence of handles, got {type(handles).__name__}")
        batch = len(handles)
        counts = self._step_counts(new_tokens, batch)
        ids = self._step_token_ids(token_ids, counts)
        with self._lock:
            states = [self._state_of(handle) for handle in handles]
            request_ids = tuple(state.request_id for state in states)
            if len(set(request_ids)) != batch:
                twice = next(rid for rid in request_ids if request_ids.count(rid) > 1)
                raise InvalidArgumentError(f"request {twice!r} is listed twice in one step")
            plans = [
                self._plan_growth(state, count, request_ids_of)
                for state, count, request_ids_of in zip(states, counts, ids, strict=True)
            ]
            needed = sum(plan.needed for plan in plans)
            if needed > self._allocator.free_block_count() + self._allocator.cached_block_count() + sum(
                plan.freed for plan in plans
            ):
                self._allocation_failures += 1
                raise OutOfBlocksError(
                    f"cannot plan a step of {batch} requests adding {sum(counts)} tokens: {needed} more blocks "
                    f"needed, {self._free_note()}"
                )
            lengths = [state.table.sequence_length for state in states]
            grown: list[SlotArray] = []
            try:
                for state, plan in zip(states, plans, strict=True):
                    grown.append(self._grow(state, plan))
            except BaseException:  # a storage failure in a copy: the requests grown so far shrink back
                for state, length in zip(states[: len(grown)], lengths, strict=False):
                    self._truncate_state(state, length)
                raise
            table = PageTable.from_block_tables(
                [state.table for state in states],
                request_ids,
                self._config.block_size,
                sliding_window=self._config.sliding_window,
                generations=[state.generation for state in states],
            )
            self._issued_tables.add(table)
            self._checked_page_table = (table, self._ownership_epoch)
            self._update_pressure()
            slots = np.concatenate(grown) if grown else np.zeros(0, dtype=np.int64)
            return Step(
                self._step_hooks(states),
                request_ids,
                tuple(counts),
                slots,
                table,
                self._config.num_heads,
                self._config.head_dim,
            )

    def write(self, layer: int, slots: SlotsLike, keys: ArrayT, values: ArrayT) -> None:
        """Scatter one layer's new K/V into the pool, for any mix of requests.

        Args:
            layer: ``0 <= layer < num_layers``.
            slots: ``[n]`` distinct slots from :meth:`extend` or :meth:`writable_slots`
                (concatenate several requests' slots to write them in one call).
            keys, values: ``[n, num_heads, head_dim]`` native arrays of the pool's dtype.

        With prefix caching, the writes are what makes a full block cacheable (see the
        class docstring); a block registered in the prefix cache is immutable: rewrite it
        through :meth:`writable_slots`, which takes it out of the cache first.

        Raises:
            LayerIndexError, SlotError (outside the pool, in a free block, repeated, or at
            a position ``extend`` has not handed out yet), SharedBlockWriteError (in a
            block several requests share, or one the prefix cache serves),
            SwappedOutError (a slot of a request swapped out since), ShapeMismatchError,
            DTypeMismatchError, ArrayTypeError.
        """
        with self._lock:
            self._check_open()
            layer = self._config.check_layer(layer)
            slot_array = self._check_slots(slots)
            count = int(slot_array.shape[0])
            expected = (count, self._config.num_heads, self._config.head_dim)
            self._check_array("keys", keys, expected)
            self._check_array("values", values, expected)
            if not count:
                return
            blocks = slot_array // self._config.block_size
            if self._allocator.shared_block_count():
                shared = self._allocator.shared_mask()[blocks]
                if shared.any():
                    self._refuse_shared_write(int(slot_array[np.argmax(shared)]))
            if self._prefix is not None:
                registered = self._registered[blocks]
                if registered.any():
                    slot = int(slot_array[np.argmax(registered)])
                    raise SharedBlockWriteError(
                        f"slot {slot} is in block {slot // self._config.block_size}, which the prefix cache "
                        "serves to every request with the same prompt: take slots from writable_slots() to "
                        "rewrite it (it leaves the prefix cache first)"
                    )
            self._storage.write(layer, slot_array, keys, values)
            if self._written is not None:
                self._written[layer, slot_array] = True
                self._after_write(blocks)

    def gather(self, handle: KvCacheHandle[ArrayT], layer: int) -> tuple[ArrayT, ArrayT]:
        """The request's keys and values as contiguous ``[num_tokens, num_heads, head_dim]``
        copies, in token order. With a sliding window that released leading blocks, the
        tokens still held: positions ``first_logical * block_size`` onwards.

        Raises:
            LayerIndexError, InvalidHandleError, SwappedOutError, ForeignHandleError.
        """
        with self._lock:
            state = self._state_of(handle)
            layer = self._config.check_layer(layer)
            table = state.table
            tokens = table.held_tokens()
            used = _blocks_for(tokens, self._config.block_size)
            blocks = np.asarray(table.physical_blocks[:used], dtype=np.int64)
            state.touch()
            return self._storage.gather(layer, blocks, tokens)

    def page_table(self, handles: Sequence[KvCacheHandle[ArrayT]]) -> PageTable:
        """The page table of a batch, in the order of ``handles``; with a sliding window it
        lists each request from its first held block and carries the window.

        The table's arrays are read-only and it carries each request's ownership
        generation: :meth:`paged_attention` refuses it once one of its requests was
        released, swapped or had a block replaced (copy-on-write, window release).

        Raises:
            InvalidTypeError: ``handles`` is not a sequence (list, tuple) of handles.
            InvalidHandleError, SwappedOutError, ForeignHandleError: for any handle of the
            batch.
        """
        if isinstance(handles, (str, bytes)) or not isinstance(handles, Sequence):
            raise InvalidTypeError(
                f"page_table takes a sequence (list or tuple) of handles, got {type(handles).__name__}"
            )
        with self._lock:
            states = [self._state_of(handle) for handle in handles]
            table = PageTable.from_block_tables(
                [state.table for state in states],
                [state.request_id for state in states],
                self._config.block_size,
                sliding_window=self._config.sliding_window,
                generations=[state.generation for state in states],
            )
            self._issued_tables.add(table)
            self._checked_page_table = (table, self._ownership_epoch)
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
                own position; ``False`` lets every query see the whole sequence. With a
                sliding window ``W`` (carried by the page table) a query never sees keys
                ``W`` or more positions before its own; the page table starts at the
                request's first held block, which the last ``extend`` kept for the
                windows of the tokens it added (an older token's window may start
                before it: such a query sees only the held keys).

        Returns:
            ``[total_q, num_query_heads, head_dim]`` of the query's dtype.

        Raises:
            LayerIndexError, ShapeMismatchError, DTypeMismatchError, ArrayTypeError,
            InvalidArgumentError (bad ``qo_indptr`` or ``scale``, or a page table whose
            ``sliding_window`` is not the pool's), SlotError (the page table names blocks
            outside the pool or not in use), SwappedOutError (blocks of a request swapped
            out since the page table was taken).
        """
        with self._lock:
            self._check_open()
            layer = self._config.check_layer(layer)
            shape = self._check_query(query)
            if not isinstance(page_table, PageTable):
                raise InvalidTypeError(f"page_table must be a PageTable, got {type(page_table).__name__}")
            if page_table.block_size != self._config.block_size:
                raise InvalidArgumentError(
                    f"page table block_size {page_table.block_size} != pool block_size {self._config.block_size}"
                )
            if page_table.sliding_window != self._config.sliding_window:
                raise InvalidArgumentError(
                    f"page table sliding_window {page_table.sliding_window} != the pool's sliding_window "
                    f"{self._config.sliding_window}; take the page table from manager.page_table"
                )
            if self._checked_page_table != (page_table, self._ownership_epoch):
                self._check_page_table(page_table)
                self._checked_page_table = (page_table, self._ownership_epoch)
            indptr = validate_query_indptr(qo_indptr, page_table, shape[0])
            checked_scale = check_scale(scale, self._config.head_dim)
            if not isinstance(causal, bool):
                raise InvalidTypeError(f"causal must be a bool, got {causal!r}")
            return self._storage.paged_attention(layer, query, page_table, indptr, checked_scale, causal)

    # -- figures -----------------------------------------------------------------------

    def stats(self) -> CacheManagerStats:
        """Figures of the whole pool."""
        with self._lock:
            used = self._allocator.used_block_count()
            tokens = sum(state.table.held_tokens() for state in self._requests.values())
            capacity = used * self._config.block_size
            swapped = [state.swap for state in self._requests.values() if state.swap is not None]
            return CacheManagerStats(
                total_memory_bytes=self._config.num_blocks * self._config.bytes_per_block,
                used_memory_bytes=used * self._config.bytes_per_block,
                active_caches=len(self._requests),
                total_blocks=self._config.num_blocks,
                free_blocks=self._allocator.free_block_count(),
                used_blocks=used,
                tokens_stored=tokens,
                utilization=tokens / capacity if capacity else 0.0,
                cache_hit_rate=self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0,
                eviction_count=self._eviction_count,
                allocation_count=self._allocation_count,
                allocation_failures=self._allocation_failures,
                pressure=self._pressure,
                cached_blocks=self._allocator.cached_block_count(),
                prefix_cache_queries=self._prefix_queries,
                prefix_cache_hits=self._prefix_hits,
                hash_collisions=self._hash_collisions,
                copy_on_write_count=self._copy_on_write_count,
                swapped_out_requests=len(swapped),
                swapped_out_blocks=sum(record.num_blocks for record in swapped),
                swapped_out_memory_bytes=sum(record.memory_bytes for record in swapped),
            )

    def gc(self) -> CacheGcStats:
        """Reclaim what is reclaimable: evict every cached block (prefix-cache contents
        nobody references) to the free list. Live requests, shared blocks and swapped-out
        requests are untouched.

        Returns:
            The blocks and bytes returned to the free pool (``caches_freed`` is 0: no live
            request is ended) and the time it took. Evicted blocks count in
            ``stats().eviction_count``.
        """
        started = time.perf_counter()
        with self._lock:
            self._check_open()
            count = self._allocator.cached_block_count()
            self._evict(count)
        return CacheGcStats(
            memory_freed=count * self._config.bytes_per_block,
            caches_freed=0,
            blocks_freed=count,
            gc_time_ms=(time.perf_counter() - started) * 1e3,
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
        """The current memory pressure level: blocks in use (referenced) over the pool.
        Cached blocks count as reclaimable, not as used: allocation evicts them."""
        return self._pressure

    def check_invariants(self) -> None:
        """Verify the pool's records.

        Every block is free, in use or cached, and ``free + used + cached == total``;
        reference counts equal the number of resident requests holding each block (none
        listed twice in one table); the in-use and shared masks and the free extents
        agree; every cached block holds a registered prefix and every registered block is
        in use or cached, fully written and hashed from its entry's parent and tokens;
        swapped-out requests hold no block and their host copies have the right shape;
        the blocks awaited by hash chains are held by the requests awaiting them.

        Raises:
            InvariantError: naming the first inconsistency found.
        """
        with self._lock:
            self._check_block_records()
            self._check_prefix_records()
            self._check_request_records()

    # -- internals: validation ---------------------------------------------------------

    def _state_of(self, handle: object) -> RequestState[ArrayT]:
        """The state of a resident request's handle of this manager."""
        self._check_open()
        as_any = getattr(handle, "as_any", None)  # downcast, as the seed crate does
        concrete: object = as_any() if callable(as_any) else None
        if not _is_paged_handle(concrete):
            raise ForeignHandleError(f"expected a handle from this manager, got {type(handle).__name__}")
        state: RequestState[Any] = concrete.request_state
        if state.owner is not self:
            raise ForeignHandleError(f"the handle of request {state.request_id!r} belongs to another manager")
        state.check_resident()
        return state

    def _live_state(self, request_id: object) -> RequestState[ArrayT]:
        self._check_open()
        state = self._requests.get(request_id) if isinstance(request_id, str) else None
        if state is None:
            raise UnknownRequestError(
                f"unknown request {request_id!r}: it was never allocated or is already "
                f"deallocated ({len(self._requests)} requests are live)"
            )
        return state

    def _new_token_ids(self, state: RequestState[ArrayT], ids: tuple[int, ...], start: int) -> tuple[int, ...]:
        """The ids of ``ids`` (for positions ``start ..``) not known yet, after checking
        that the known ones agree and that no earlier id is missing."""
        if self._prefix is None:
            return ()
        known = state.token_ids
        if start > len(known):
            raise InvalidArgumentError(
                f"token_ids for positions {start}.. of request {state.request_id!r} cannot be used: the ids of "
                f"positions {len(known)} to {start - 1} were never given (pass token_ids to every extend)"
            )
        overlap = min(len(known) - start, len(ids))
        for offset in range(overlap):
            if ids[offset] != known[start + offset]:
                raise InvalidArgumentError(
                    f"token_ids[{offset}] = {ids[offset]} disagrees with the known token {known[start + offset]} "
                    f"at position {start + offset} of request {state.request_id!r}"
                )
        return ids[overlap:]

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
            issued = self._issued[array]
            if not issued.all():
                slot = int(array[np.argmin(issued)])
                raise SlotError(
                    f"slot {slot} (block {slot // self._config.block_size}, offset "
                    f"{slot % self._config.block_size}) is reserved but its position was not handed out: "
                    "write only slots returned by extend() or writable_slots()"
                )
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
            owner = self._swapped_blocks.get(block)
            if owner is not None:
                raise SwappedOutError(
                    f"{what} points into block {block}, which request {owner!r} gave up when it was swapped "
                    "out: swap_in brings it back, with new slots"
                )
            raise SlotError(f"{what} points into block {block}, which no live request owns")

    def _check_page_table(self, page_table: PageTable) -> None:
        """Refuse a page table that may read blocks its requests no longer own.

        A table with generations (taken from a manager) must list live, resident
        requests of this manager at the generations it recorded; one this manager did not
        issue must also list exactly their held blocks. A table without generations (built
        by hand) must name blocks in use.
        """
        if not page_table.generations:
            self._check_blocks_in_use(page_table.kv_indices.astype(np.int64), "page table")
            return
        issued = page_table in self._issued_tables
        for index, (request_id, generation) in enumerate(
            zip(page_table.request_ids, page_table.generations, strict=True)
        ):
            state = self._requests.get(request_id)
            if state is not None and state.swap is not None:
                raise SwappedOutError(
                    f"the page table lists request {request_id!r}, swapped out since it was taken: "
                    "swap_in brings it back; then take a new page table"
                )
            if state is None or state.generation != generation:
                why = "released" if state is None else "changed (released, copied or re-planned blocks)"
                raise StalePageTableError(
                    f"the page table lists request {request_id!r}, {why} since the table was taken: "
                    "its blocks may belong to another request now; take a new page table from manager.page_table"
                )
            if not issued:
                table = state.table
                held = table.physical_blocks[: _blocks_for(table.held_tokens(), self._config.block_size)]
                if page_table.blocks(index).tolist() != list(held):
                    raise StalePageTableError(
                        f"the page table lists blocks {page_table.blocks(index).tolist()} for request "
                        f"{request_id!r}, which holds {list(held)}: take page tables from manager.page_table"
                    )

    def _refuse_shared_write(self, slot: int) -> None:
        block = slot // self._config.block_size
        sharers = [rid for rid, state in self._requests.items() if block in state.table.physical_blocks]
        raise SharedBlockWriteError(
            f"slot {slot} is in block {block}, shared by {self._allocator.ref_count(block)} requests "
            f"{sharers}: a write there would change all of them; take private slots from extend() or "
            "writable_slots(), which copy the block first"
        )

    def _array_info(self, name: str, array: object) -> tuple[tuple[int, ...], str]:
        try:
            shape, dtype = self._storage.array_info(array)
        except TypeError as exc:
            raise ArrayTypeError(f"{name}: {exc}") from exc
        return tuple(shape), dtype

    def _check_query(self, query: object) -> tuple[int, ...]:
        """The shape of a query ``[tokens, k * num_heads, head_dim]`` of the pool's dtype."""
        shape, dtype = self._array_info("query", query)
        heads, dim = self._config.num_heads, self._config.head_dim
        if len(shape) != 3 or shape[2] != dim or shape[1] < heads or shape[1] % heads:
            raise ShapeMismatchError(
                f"query must be [tokens, k * {heads}, {dim}] (k >= 1 query heads per KV head), got {shape}"
            )
        if dtype != self._config.io_dtype:  # issue 14: a quantized pool computes in its io_dtype
            raise DTypeMismatchError(f"query has dtype {dtype}, the pool computes in {self._config.io_dtype}")
        return shape

    def _check_array(self, name: str, array: object, expected: tuple[int, ...]) -> None:
        shape, dtype = self._array_info(name, array)
        if shape != expected:
            raise ShapeMismatchError(f"{name} must have shape {expected} ([n, num_heads, head_dim]), got {shape}")
        if dtype != self._config.io_dtype:  # issue 14: a quantized pool computes in its io_dtype
            raise DTypeMismatchError(f"{name} has dtype {dtype}, the pool computes in {self._config.io_dtype}")

    # -- internals: blocks -------------------------------------------------------------

    def _free_note(self) -> str:
        free, cached = self._allocator.free_block_count(), self._allocator.cached_block_count()
        note = f"{free} of {self._config.num_blocks} are free"
        return f"{note} and {cached} cached blocks evictable" if cached else note

    def _cached_note(self, hits: int) -> str:
        return f" beyond {hits} cached ones" if hits else ""

    def _expected_blocks(self, max_sequence_length: int | None, logical_now: int) -> int | None:
        """Blocks a request still expects to need (placement hint), ``None`` if unknown."""
        if max_sequence_length is None:
            return None
        block_size = self._config.block_size
        remaining = _blocks_for(max_sequence_length, block_size) - logical_now
        window = self._config.sliding_window
        if window is not None:
            remaining = min(remaining, _blocks_for(window, block_size) + 1)
        return max(remaining, 0)

    def _take_blocks(self, count: int, after: int | None, expected: int | None, failure: str) -> list[int]:
        """Blocks from the allocator, evicting cached blocks (oldest first) when the free
        ones do not suffice; on a shortage, count the failure and say why."""
        free = self._allocator.free_block_count()
        if count > free:
            if count > free + self._allocator.cached_block_count():
                self._allocation_failures += 1
                raise OutOfBlocksError(f"{failure}: {count} blocks needed, {self._free_note()}")
            self._evict(count - free)
        blocks = self._allocator.allocate(count, after=after, expected=expected)
        if blocks:
            block_slots = self._block_slots(np.asarray(blocks, dtype=np.int64))
            self._issued[block_slots] = False
            if self._written is not None:
                self._written[:, block_slots] = False
            if self._swapped_blocks:
                for block in blocks:
                    self._swapped_blocks.pop(block, None)
        return blocks

    def _evict(self, count: int) -> None:
        """Evict the ``count`` least recently used cached blocks to the free list."""
        if not count:
            return
        assert self._prefix is not None, "cached blocks without a prefix cache"
        for block in self._allocator.evict(count):
            self._unregister(block)
        self._eviction_count += count

    def _keep_cached(self, block: int) -> bool:
        return self._prefix is not None and self._prefix.is_registered(block)

    def _release_blocks(self, blocks: list[int]) -> list[int]:
        """Drop a request's reference on ``blocks`` (its whole table); return those that
        reached zero. Later blocks go first, so within a request the tail is evicted first."""
        tail = blocks[-1] if blocks and self._allocator.ref_count(blocks[-1]) == 1 else None
        return self._allocator.release(blocks[::-1], tail, self._keep_cached)

    def _block_slots(self, blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Every slot of ``blocks``, block by block: ``[len(blocks) * block_size]``."""
        block_size = self._config.block_size
        slots: npt.NDArray[np.int64] = (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)
        return slots

    def _window_release(self, table: BlockTable, length: int) -> int:
        """Held blocks wholly older than the window of the token at position ``length``."""
        first_needed = self._window_start(length)
        return max(0, min(first_needed, table.first_logical + table.num_blocks()) - table.first_logical)

    def _release_leading(self, state: RequestState[ArrayT], count: int) -> None:
        """Release the first ``count`` held blocks of a request (its window passed them)."""
        table = state.table
        all_released = count == table.num_blocks()
        blocks = table.release_leading(count)
        if state.awaiting_block in blocks:
            self._set_awaiting(state, None)
        if len(state.chain) < table.first_logical:
            state.chain_open = False  # an unhashed block is gone: the chain cannot go on
            self._set_awaiting(state, None)
        tail = blocks[-1] if all_released and self._allocator.ref_count(blocks[-1]) == 1 else None
        self._allocator.release(blocks[::-1], tail, self._keep_cached)
        self._new_generation(state)

    def _shared_blocks(self, table: BlockTable, start: int, stop: int) -> list[int]:
        """Held logical blocks that positions ``start .. stop - 1`` fall in and that other
        requests share (they need a copy before a write)."""
        if stop <= start or not self._allocator.shared_block_count():
            return []
        block_size = self._config.block_size
        first = max(start // block_size, table.first_logical)
        last = min(_blocks_for(stop, block_size), table.first_logical + table.num_blocks())
        return [
            logical for logical in range(first, last) if self._allocator.ref_count(table.physical_block(logical)) > 1
        ]

    def _step_counts(self, new_tokens: object, batch: int) -> list[int]:
        if isinstance(new_tokens, Sequence) and not isinstance(new_tokens, (str, bytes)):
            counts: list[object] = list(cast("Sequence[object]", new_tokens))
            if len(counts) != batch:
                raise InvalidArgumentError(f"new_tokens gives {len(counts)} counts for {batch} requests")
            return [check_count(count, f"new_tokens[{index}]") for index, count in enumerate(counts)]
        if isinstance(new_tokens, np.ndarray):
            return self._step_counts(cast("npt.NDArray[Any]", new_tokens).tolist(), batch)
        return [check_count(new_tokens, "new_tokens")] * batch

    def _step_token_ids(self, token_ids: object, counts: list[int]) -> list[tuple[int, ...] | None]:
        if token_ids is None:
            return [None] * len(counts)
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InvalidArgumentError(
                f"token_ids must be a sequence of one id list (or None) per request, got {token_ids!r}"
            )
        per_request: list[object] = list(cast("Sequence[object]", token_ids))
        if len(per_request) != len(counts):
            raise InvalidArgumentError(f"token_ids gives {len(per_request)} id lists for {len(counts)} requests")
        checked: list[tuple[int, ...] | None] = []
        for index, (ids, count) in enumerate(zip(per_request, counts, strict=True)):
            if ids is None:
                checked.append(None)
                continue
            values = check_token_ids(ids, f"token_ids[{index}]")
            if len(values) != count:
                raise InvalidArgumentError(f"token_ids[{index}] holds {len(values)} ids for {count} new tokens")
            checked.append(values)
        return checked

    def _step_hooks(self, states: list[RequestState[ArrayT]]) -> StepHooks[ArrayT]:
        """The hooks of a step over ``states``, stamped with their current generation and plan."""
        stamps = [(state, state.generation, state.plan) for state in states]
        epoch = self._ownership_epoch

        def check_current() -> None:
            self._check_open()
            if self._ownership_epoch == epoch:
                return  # nothing changed anywhere since the step was planned
            for state, generation, plan in stamps:
                if not state.valid or state.swap is not None or state.generation != generation or state.plan != plan:
                    why = (
                        "was released"
                        if not state.valid
                        else "is swapped out"
                        if state.swap is not None
                        else "changed (truncated, forked, extended, copied or planned again)"
                    )
                    raise StaleStepError(
                        f"the step's request {state.request_id!r} {why} since begin_step: plan a new step"
                    )

        return StepHooks(
            lock=self._lock,
            check_current=check_current,
            check_layer=self._config.check_layer,
            check_array=self._check_array,
            check_query=self._check_query,
            write=self._write_planned,
            attention=self._storage.paged_attention,
        )

    def _write_planned(self, layer: int, slots: SlotArray, keys: ArrayT, values: ArrayT) -> None:
        """A step's write: its slots were checked when it was planned (private, handed out)."""
        self._storage.write(layer, slots, keys, values)
        if self._written is not None:
            self._written[layer, slots] = True
            self._after_write(slots // self._config.block_size)

    def _truncate_state(self, state: RequestState[ArrayT], length: int) -> None:
        """Shorten a resident request to ``length`` (checked) tokens; see :meth:`truncate`."""
        table = state.table
        block_size = self._config.block_size
        if length % block_size and length // block_size >= table.first_logical:
            logical = length // block_size
            block = table.physical_block(logical)
            if self._allocator.ref_count(block) == 1:  # shared: the next extend copies it
                if self._registered[block]:
                    self._unregister(block)
                cut = slice(block * block_size + length % block_size, (block + 1) * block_size)
                self._issued[cut] = False
                if self._written is not None:
                    self._written[:, cut] = False
        last = table.physical_blocks[-1] if table.num_blocks() else None
        dropped = table.truncate(length)
        if dropped:
            tail = last if last is not None and self._allocator.ref_count(last) == 1 else None
            self._allocator.release(dropped[::-1], tail, self._keep_cached)
            self._new_generation(state)
        del state.chain[length // block_size :]
        del state.token_ids[length:]
        state.cached_tokens = min(state.cached_tokens, length)
        self._set_awaiting(state, None)
        self._replanned(state)
        self._advance_chain(state)

    def _plan_growth(self, state: RequestState[ArrayT], count: int, ids: tuple[int, ...] | None) -> _GrowthPlan:
        """Check that the request may grow by ``count`` tokens and count the blocks it takes.

        Raises:
            SequenceTooLongError, InvalidArgumentError (token ids): nothing changed.
        """
        table = state.table
        old_length = table.sequence_length
        new_length = old_length + count
        if state.max_sequence_length is not None and new_length > state.max_sequence_length:
            raise SequenceTooLongError(
                f"request {state.request_id!r} would grow to {new_length} tokens, past its "
                f"max_sequence_length of {state.max_sequence_length}"
            )
        new_ids = self._new_token_ids(state, ids, old_length) if ids is not None else ()
        released = freed = 0
        if count and self._config.sliding_window is not None:
            released = self._window_release(table, old_length)
            freed = sum(1 for block in table.physical_blocks[:released] if self._allocator.ref_count(block) == 1)
        copies = self._shared_blocks(table, old_length, new_length)
        held_end = table.first_logical + table.num_blocks()
        missing = max(0, _blocks_for(new_length, self._config.block_size) - held_end)
        return _GrowthPlan(count, new_ids, released, freed, copies, missing)

    def _grow(self, state: RequestState[ArrayT], plan: _GrowthPlan) -> SlotArray:
        """Carry out a checked growth plan (blocks for it are available)."""
        table = state.table
        old_length = table.sequence_length
        spare = self._allocator.free_block_count() + self._allocator.cached_block_count()
        # The copies are the only storage call: made first, so that a storage failure leaves
        # the request as it was. Only when they need the blocks the window frees does the
        # window release (which the request's tokens no longer see) come first.
        copies = [logical for logical in plan.copies if self._allocator.ref_count(table.physical_block(logical)) > 1]
        copy_first = len(copies) <= spare
        if copy_first:
            self._copy_on_write(state, copies)
        if plan.released:
            self._advance_chain(state)  # hash what is ready before the window releases it
            self._release_leading(state, plan.released)
        if not copy_first:
            self._copy_on_write(state, copies)
        if self._prefix is not None and plan.tokens:
            # A block truncated into while shared may be ours alone now and still cached:
            # it leaves the cache before new tokens go into it (a cached block is immutable).
            self._unregister_rewritten(state, old_length, old_length + plan.tokens)
        if plan.missing:
            logical_now = table.first_logical + table.num_blocks()
            last = table.physical_blocks[-1] if table.num_blocks() else None
            table.add_blocks(
                self._take_blocks(
                    plan.missing,
                    last if last is not None and self._allocator.ref_count(last) == 1 else None,
                    self._expected_blocks(state.max_sequence_length, logical_now),
                    f"cannot extend request {state.request_id!r} by {plan.tokens} tokens",
                )
            )
        slots = table.slots(old_length, old_length + plan.tokens)
        table.extend_sequence(plan.tokens)
        self._issued[slots] = True
        if self._written is not None:
            self._written[:, slots] = False  # handed out anew: nothing of this request is there yet
        if plan.new_ids:
            state.token_ids.extend(plan.new_ids)
        if plan.tokens:
            self._replanned(state)
        self._advance_chain(state)
        state.touch()
        return slots

    def _copy_on_write(self, state: RequestState[ArrayT], logicals: list[int]) -> None:
        """Give the request private copies of its shared logical blocks ``logicals``.

        Transactional: the copies are taken, then made in one ``storage.copy_blocks``
        call, then committed; whatever the storage raises (``KeyboardInterrupt``
        included), the copies go back to the free list and the request is unchanged.
        The copies are not registered in the prefix cache (see :meth:`writable_slots`).
        """
        if not logicals:
            return
        table = state.table
        sources = [table.physical_block(logical) for logical in logicals]
        copies: list[int] = []
        try:
            for logical in logicals:
                previous = table.physical_block(logical - 1) if logical > table.first_logical else None
                if copies and logical - 1 == logicals[len(copies) - 1]:
                    previous = copies[-1]
                (copy,) = self._take_blocks(
                    1,
                    previous if previous is not None and self._allocator.ref_count(previous) == 1 else None,
                    None,
                    f"cannot copy block {sources[len(copies)]} of request {state.request_id!r}",
                )
                copies.append(copy)
            self._storage.copy_blocks(np.asarray(sources, dtype=np.int64), np.asarray(copies, dtype=np.int64))
        except BaseException:
            if copies:
                self._allocator.release(copies[::-1], copies[-1])
            raise
        block_size = self._config.block_size
        for logical, source, copy in zip(logicals, sources, copies, strict=True):
            # Only the request's own positions carry over; past its length the copy is new.
            own = min(block_size, max(0, table.sequence_length - logical * block_size))
            source_slots = slice(source * block_size, source * block_size + own)
            copy_slots = slice(copy * block_size, copy * block_size + own)
            if self._written is not None:
                self._written[:, copy_slots] = self._written[:, source_slots]
            self._issued[copy_slots] = self._issued[source_slots]
            table.replace_block(logical, copy)
            self._allocator.release([source], None)  # the other sharers keep it
            if state.awaiting_block == source:
                self._set_awaiting(state, copy)
            self._copy_on_write_count += 1
        self._new_generation(state)

    def _unregister_rewritten(self, state: RequestState[ArrayT], start: int, stop: int) -> None:
        """Take the request's blocks of positions ``start .. stop - 1`` out of the prefix
        cache (they are about to be rewritten), and stop its hash chain before them."""
        prefix = self._prefix
        if prefix is None or stop <= start:
            return
        table = state.table
        block_size = self._config.block_size
        first = max(start // block_size, table.first_logical)
        last = min(_blocks_for(stop, block_size), table.first_logical + table.num_blocks())
        for logical in range(first, last):
            block = table.physical_block(logical)
            if prefix.is_registered(block):
                self._unregister(block)
        if first < len(state.chain):
            del state.chain[first:]
            state.chain_open = False
            self._set_awaiting(state, None)

    def _register(self, block: int, entry: PrefixEntry) -> None:
        assert self._prefix is not None
        self._prefix.register(block, entry)
        self._registered[block] = True

    def _unregister(self, block: int) -> None:
        assert self._prefix is not None
        self._prefix.unregister(block)
        self._registered[block] = False

    def _new_generation(self, state: RequestState[ArrayT]) -> None:
        """The request's blocks changed owner: page tables and steps taken before are stale."""
        state.generation = next_generation()
        self._ownership_epoch += 1

    def _replanned(self, state: RequestState[ArrayT]) -> None:
        """The request's length or sharing changed: steps planned before are stale."""
        state.plan += 1
        self._ownership_epoch += 1

    def _forget_swapped_blocks(self, request_id: str, record: SwapRecord) -> None:
        for block in record.released_blocks:
            if self._swapped_blocks.get(block) == request_id:
                del self._swapped_blocks[block]

    # -- internals: prefix caching ---------------------------------------------------------

    def _plan_allocation(self, request: AllocationRequest) -> _AllocationPlan:
        """Look up the prompt's cached blocks and count the blocks ``allocate`` needs."""
        block_size = self._config.block_size
        hits: list[tuple[PrefixEntry, int]] = []
        queries = collisions = 0
        prompt = request.prompt_token_ids
        if self._prefix is not None and prompt:
            queries = (len(prompt) - 1) // block_size  # the last prompt token is always computed
            salt = request.salt_bytes()
            parent: PrefixEntry | None = None
            for logical in range(queries):
                tokens = prompt[logical * block_size : (logical + 1) * block_size]
                entry, collided = self._prefix.find(parent, tokens, salt)
                collisions += collided
                if entry is None:
                    break
                hits.append((entry, self._pick_block(entry)))
                parent = entry
        cached_tokens = len(hits) * block_size
        released = min(len(hits), self._window_start(cached_tokens))
        logical_total = max(len(hits), _blocks_for(request.initial_tokens, block_size))
        revived = sum(1 for _, block in hits[released:] if self._allocator.is_cached(block))
        return _AllocationPlan(hits, queries, collisions, released, logical_total - len(hits), revived)

    def _window_start(self, length: int) -> int:
        """The first logical block the token at position ``length`` can see."""
        window = self._config.sliding_window
        if window is None or length < window:
            return 0
        return (length - window + 1) // self._config.block_size

    def _pick_block(self, entry: PrefixEntry) -> int:
        """A block of ``entry`` to map: one already in use if any (keeps the cache whole)."""
        for block in entry.blocks:
            if self._allocator.ref_count(block):
                return block
        return next(iter(entry.blocks))

    def _set_awaiting(self, state: RequestState[ArrayT], block: int | None) -> None:
        old = state.awaiting_block
        if old == block:
            return
        if old is not None:
            waiting = self._awaiting[old]
            waiting.discard(state.request_id)
            if not waiting:
                del self._awaiting[old]
                self._awaiting_mask[old] = False
        if block is not None:
            self._awaiting.setdefault(block, set()).add(state.request_id)
            self._awaiting_mask[block] = True
        state.awaiting_block = block

    def _fully_written(self, block: int) -> bool:
        assert self._written is not None
        block_size = self._config.block_size
        return bool(self._written[:, block * block_size : (block + 1) * block_size].all())

    def _after_write(self, blocks: npt.NDArray[np.int64]) -> None:
        """Advance the hash chains waiting for any of ``blocks`` now fully written."""
        if not self._awaiting:
            return
        touched = blocks[self._awaiting_mask[blocks]]
        if not touched.size:
            return
        for block in np.unique(touched).tolist():
            if not self._fully_written(block):
                continue
            for request_id in sorted(self._awaiting.get(block, ())):
                state = self._requests[request_id]
                self._set_awaiting(state, None)
                self._advance_chain(state)

    def _advance_chain(self, state: RequestState[ArrayT]) -> None:
        """Hash (and register) the request's next blocks while they are cacheable; wait
        for the first full block whose writes are missing."""
        prefix = self._prefix
        if prefix is None or not state.chain_open or state.swap is not None:
            return
        table = state.table
        block_size = self._config.block_size
        while True:
            logical = len(state.chain)
            end = (logical + 1) * block_size
            if end > table.sequence_length or end > len(state.token_ids):
                break  # not full yet, or its token ids are not known yet
            if logical < table.first_logical:
                state.chain_open = False  # released before it was hashed
                break
            block = table.physical_block(logical)
            if not self._fully_written(block):
                self._set_awaiting(state, block)
                return
            parent = state.chain[-1] if state.chain else None
            entry, collided = prefix.find_or_create(
                parent, tuple(state.token_ids[logical * block_size : end]), state.salt
            )
            if entry is None:
                self._hash_collisions += collided
                state.chain_open = False
                break
            self._register(block, entry)
            state.chain.append(entry)
        self._set_awaiting(state, None)

    def _rechain(self, state: RequestState[ArrayT]) -> None:
        """After ``swap_in``: register the restored blocks under the request's hash chain,
        re-creating entries evicted meanwhile; the chain stops where that fails."""
        prefix = self._prefix
        if prefix is None:
            return
        table = state.table
        block_size = self._config.block_size
        chain: list[PrefixEntry] = []
        for logical in range(len(state.chain)):
            parent = chain[-1] if chain else None
            tokens = tuple(state.token_ids[logical * block_size : (logical + 1) * block_size])
            if logical < table.first_logical:
                entry, collided = prefix.find(parent, tokens, state.salt)
            else:
                entry, collided = prefix.find_or_create(parent, tokens, state.salt)
                if entry is not None:
                    self._register(table.physical_block(logical), entry)
            self._hash_collisions += collided
            if entry is None:
                state.chain_open = False
                break
            chain.append(entry)
        state.chain = chain

    # -- internals: invariants ---------------------------------------------------------

    def _check_block_records(self) -> None:
        allocator = self._allocator
        num_blocks = self._config.num_blocks
        owners = np.zeros(num_blocks, dtype=np.int64)
        for state in self._requests.values():
            table = state.table
            blocks = table.physical_blocks
            if len(set(blocks)) != len(blocks):
                raise InvariantError(f"request {state.request_id!r} lists a block twice: {blocks}")
            if table.sequence_length > table.capacity():
                raise InvariantError(f"request {state.request_id!r} holds more tokens than its blocks")
            np.add.at(owners, np.asarray(blocks, dtype=np.int64), 1)
        counts = np.asarray([allocator.ref_count(b) for b in range(num_blocks)])
        wrong = np.flatnonzero(owners != counts)
        if wrong.size:
            b = int(wrong[0])
            raise InvariantError(f"block {b} has reference count {int(counts[b])} but {int(owners[b])} owners")
        if not np.array_equal(allocator.shared_mask(), owners > 1):
            raise InvariantError("the shared mask disagrees with the owners")
        if allocator.shared_block_count() != int(np.count_nonzero(owners > 1)):
            raise InvariantError("the shared block count disagrees with the owners")
        free, used, cached = allocator.free_block_count(), allocator.used_block_count(), allocator.cached_block_count()
        if free + used + cached != num_blocks or used != int(np.count_nonzero(owners)):
            raise InvariantError(
                f"free {free} + used {used} + cached {cached} != total {num_blocks}, "
                f"or {int(np.count_nonzero(owners))} blocks are owned"
            )
        if not np.array_equal(allocator.in_use_mask(), owners > 0):
            raise InvariantError("the in-use mask disagrees with the owners")
        free_list, cached_list = allocator.free_blocks(), allocator.cached_blocks()
        if len(set(free_list) | set(cached_list)) != free + cached or np.any(owners[free_list + cached_list] > 0):
            raise InvariantError("a block is both free and cached, or free/cached and owned")
        if allocator.placement == "contiguous":
            extents = allocator.free_extents()
            extent_blocks = sum(end - start for start, end in extents)
            covered = {block for start, end in extents for block in range(start, end)}
            if extent_blocks != free or covered != set(free_list):
                raise InvariantError(f"free extents cover {extent_blocks} blocks, {free} are free")
        for block, request_id in self._swapped_blocks.items():
            swapped = self._requests.get(request_id)
            if swapped is None or swapped.swap is None or allocator.in_use_mask()[block]:
                raise InvariantError(f"block {block} is recorded as released by swapped-out {request_id!r}")

    def _check_prefix_records(self) -> None:
        prefix = self._prefix
        allocator = self._allocator
        if prefix is None:
            if allocator.cached_block_count() or self._awaiting:
                raise InvariantError("cached blocks or awaited blocks without prefix caching")
            return
        for block in allocator.cached_blocks():
            if not prefix.is_registered(block):
                raise InvariantError(f"cached block {block} holds no registered prefix")
        registered = 0
        for entry in prefix.entries():
            if not entry.alive or not entry.blocks or prefix.get(entry.block_hash) is not entry:
                raise InvariantError(f"{entry!r} is mapped but dead or empty")
            if prefix.rehash(entry) != entry.block_hash:
                raise InvariantError(f"{entry!r} does not hash to its key")
            if len(entry.token_ids) != self._config.block_size:
                raise InvariantError(f"{entry!r} holds {len(entry.token_ids)} token ids, not a full block")
            for block in entry.blocks:
                registered += 1
                if prefix.entry_of(block) is not entry:
                    raise InvariantError(f"block {block} is listed by {entry!r} but registered elsewhere")
                if allocator.is_free(block):
                    raise InvariantError(f"registered block {block} is free")
                if not self._fully_written(block):
                    raise InvariantError(f"registered block {block} is not fully written")
        if registered != len(prefix):
            raise InvariantError(f"{len(prefix)} blocks registered, entries list {registered}")
        if int(np.count_nonzero(self._registered)) != registered or not all(
            prefix.is_registered(block) for block in np.flatnonzero(self._registered).tolist()
        ):
            raise InvariantError("the registered-block mask disagrees with the prefix cache")
        for block, waiting in self._awaiting.items():
            if not waiting or not self._awaiting_mask[block]:
                raise InvariantError(f"block {block} is awaited by nobody or unmarked")
            for request_id in waiting:
                state = self._requests.get(request_id)
                if state is None or state.awaiting_block != block or block not in state.table.physical_blocks:
                    raise InvariantError(f"request {request_id!r} awaits block {block} it does not hold")
        if int(np.count_nonzero(self._awaiting_mask)) != len(self._awaiting):
            raise InvariantError("the awaited-block mask disagrees with the awaited blocks")

    def _check_request_records(self) -> None:
        config = self._config
        block_size = config.block_size
        window = config.sliding_window
        for state in self._requests.values():
            table = state.table
            if not state.valid:
                raise InvariantError(f"request {state.request_id!r} is live but invalid")
            record = state.swap
            if record is not None:
                expected = (config.num_layers, record.num_blocks, block_size, config.num_heads, config.head_dim)
                if table.num_blocks() or table.sequence_length or state.awaiting_block is not None:
                    raise InvariantError(f"swapped-out request {state.request_id!r} holds blocks")
                if tuple(record.keys.shape) != expected or tuple(record.values.shape) != expected:
                    raise InvariantError(f"swapped-out request {state.request_id!r} has host copies of the wrong shape")
                if record.num_blocks != _blocks_for(record.sequence_length, block_size) - record.first_logical:
                    raise InvariantError(f"swapped-out request {state.request_id!r} keeps the wrong number of blocks")
                continue
            if window is not None and table.first_logical > self._window_start(table.sequence_length):
                raise InvariantError(f"request {state.request_id!r} released blocks inside its window")
            if self._prefix is None:
                continue
            if len(state.chain) * block_size > min(table.sequence_length, len(state.token_ids)):
                raise InvariantError(f"request {state.request_id!r} hashed blocks it has not filled")
            for logical, entry in enumerate(state.chain):
                tokens = tuple(state.token_ids[logical * block_size : (logical + 1) * block_size])
                parent = state.chain[logical - 1] if logical else None
                if entry.token_ids != tokens or entry.salt != state.salt or not same_prefix(entry.parent, parent):
                    raise InvariantError(f"request {state.request_id!r}: chain entry {logical} is not its prefix")
                if logical >= table.first_logical:
                    block = table.physical_block(logical)
                    if not entry.alive or self._prefix.entry_of(block) is not entry:
                        raise InvariantError(
                            f"request {state.request_id!r}: hashed block {block} is not registered under its entry"
                        )

    # -- internals: pressure -----------------------------------------------------------

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

    # -- closing: release the pool ------------------------------------------------------

    _closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Release the pool: every handle becomes invalid, the manager refuses further use,
        and the storage's optional ``close()`` runs (once, however often this is called).

        ``stats()`` still reports the figures at closing. Using the manager or one of its
        handles afterwards raises :class:`~kvcache_core.errors.ManagerClosedError`.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ownership_epoch += 1  # page tables and steps taken before are refused
            for state in self._requests.values():
                state.valid = False
            release = getattr(self._storage, "close", None)
            if callable(release):
                release()

    def __enter__(self: _ManagerT) -> _ManagerT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(
                f"the {self._backend!r} manager is closed: its pool was released; create a new manager"
            )

    def __repr__(self) -> str:
        return (
            f"PagedKvCacheManager(backend={self._backend!r}, requests={len(self._requests)}, "
            f"used_blocks={self._allocator.used_block_count()}/{self._config.num_blocks})"
        )
