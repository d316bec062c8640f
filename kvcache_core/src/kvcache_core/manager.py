"""The paged cache manager: policy in core, over any backend's :class:`KvStorage`.

Policies, the same for every backend (they move bytes only through ``KvStorage``):

* **prefix caching** (``CacheConfig(enable_prefix_caching=True)``): a full block whose K/V
  are written is hashed (chained with its prefix, see :mod:`kvcache_core.paging.prefix`);
  ``allocate`` maps the cached full blocks of ``AllocationRequest.prompt_token_ids`` and
  starts the sequence after them. Blocks nobody references stay cached until evicted,
  least recently used first; blocks without a hash are always reused first.
* **fork with copy-on-write**: :meth:`PagedKvCacheManager.fork` shares blocks; the first
  slot handed out in a shared block (``extend``, ``writable_slots``) copies that block.
* **swapping**: ``swap_out`` copies a request's blocks to host memory and releases them;
  ``swap_in`` brings them back, bit-identical, into any free blocks.
* **sliding window** (``CacheConfig(sliding_window=W)``): blocks wholly older than the
  window of the next token are released as a request grows; attention masks the rest.
* **hybrid models** (``CacheConfig(layer_specs=...)``): layers that keep the same blocks
  form KV-cache groups (:mod:`kvcache_core.contract.groups`); a request has a block table per
  group over the one pool, every policy above runs over all of them, and a prefix hit
  maps blocks in every group or in none.

Every public method takes the manager's lock, validates everything first and only then
changes state, so a call that raises leaves every table and count as it was.

Where the parts live: the per-block records (allocator, prefix-cache registrations,
written and handed-out slots, ownership epoch) in :mod:`kvcache_core.paging.block_pool`; hash-chain
tracking in :mod:`kvcache_core.paging.chains`; allocation, growth, copy-on-write, window release,
truncation, fork and swap of a request's table in :mod:`kvcache_core.paging.sequences`; argument
checks in :mod:`kvcache_core.paging.checks`; the invariant audit in :mod:`kvcache_core.paging.audit`; the
figures in :mod:`kvcache_core.paging.figures`; per-layer specs and KV-cache groups in
:mod:`kvcache_core.contract.groups`; the step, write, gather and attention in
:mod:`kvcache_core._data_path`. This module keeps the public API and the request lifecycle.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeGuard, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache_core._data_path import DataPath
from kvcache_core.contract.config import AllocationRequest, CacheConfig, check_count, check_token_ids
from kvcache_core.contract.groups import check_group
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvCacheHandle, KvStorage, SlotArray, SlotsLike
from kvcache_core.contract.stats import CacheGcStats, CacheManagerStats, MemoryPressure
from kvcache_core.errors import (
    DuplicateRequestError,
    ForeignHandleError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTypeError,
    InvariantError,
    NotSwappedOutError,
    SwappedOutError,
    UnknownRequestError,
)
from kvcache_core.handle import PagedKvCacheHandle, handle_state
from kvcache_core.offload import prefix_file
from kvcache_core.offload.events import AllBlocksCleared, EventCallback, EventHub, OperationLock
from kvcache_core.offload.tier_stack import TierChain
from kvcache_core.offload.tiers import OffloadTier, TierStats
from kvcache_core.paging.allocator import BlockAllocator, Placement
from kvcache_core.paging.audit import audit
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.checks import ArgumentChecks, check_handle_sequence, step_counts, step_token_ids
from kvcache_core.paging.figures import manager_stats
from kvcache_core.paging.prefix import PrefixCache
from kvcache_core.paging.request_state import RequestState
from kvcache_core.paging.sequences import SequenceBlocks
from kvcache_core.step import Step

__all__ = ["InvariantError", "PagedKvCacheManager"]

ArrayT = TypeVar("ArrayT")
_ManagerT = TypeVar("_ManagerT", bound="PagedKvCacheManager[Any]")


class PagedKvCacheManager(Generic[ArrayT]):
    """Allocates request caches in one paged pool, runs the write/read path and the cache
    policies (prefix caching, fork with copy-on-write, eviction, swapping, sliding window).

    Satisfies :class:`~kvcache_core.KvCacheManager` structurally. Thread-safe: every
    public method holds one re-entrant lock.

    Once closed (:meth:`close`), every method but :meth:`close`, :meth:`stats` and
    :meth:`tier_stats` raises :class:`~kvcache_core.errors.ManagerClosedError` before it
    looks at its arguments, and so do the closed manager's steps and the cache accessors
    of its handles; properties and the figures of handles stay readable.

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
        tiers: offload tiers behind the pool, fastest first (see :mod:`kvcache_core.offload.tiers`):
            evicted cached blocks are demoted to them, prompt hits promote them back.
        config: the pool's config when it has KV-cache groups (``layer_specs``): the
            storage is then built from ``config.storage_config()``; ``None``: the
            storage's own config.

    Raises:
        InvalidTypeError: ``config`` is not a ``CacheConfig``.
        InvalidConfigError: ``config`` is not the one ``storage`` was built from.
    """

    def __init__(
        self,
        storage: KvStorage[ArrayT],
        *,
        backend: str = "custom",
        placement: Placement = "contiguous",
        tiers: Sequence[OffloadTier] = (),
        config: CacheConfig | None = None,
    ) -> None:
        if config is None:
            config = storage.config
        elif not isinstance(config, CacheConfig):
            raise InvalidTypeError(f"config must be a CacheConfig or None, got {type(config).__name__}")
        elif config.storage_config() != storage.config:
            raise InvalidConfigError(
                f"config {config!r} is not the config of the storage ({storage.config!r}): build the storage "
                "from config.storage_config()"
            )
        self._storage = storage
        self._config = config
        self._backend = backend
        # Cache events: the prefix cache reports hashes entering and leaving it; listeners
        # run when the operation that made the change ends (the lock marks operations).
        self._events = EventHub(config.block_size)
        self._lock = OperationLock(self._events)
        self._requests: dict[str, RequestState[ArrayT]] = {}
        self._pool = BlockPool(config, storage, placement)
        self._chains = PrefixChains(self._pool, self._requests)
        self._sequences = SequenceBlocks(self._pool, self._chains)
        self._checks = ArgumentChecks(self._pool, storage, self._requests)
        if self._pool.prefix is not None:
            self._pool.prefix.listener = self._events
        self._tiers = TierChain(tiers, config, self._events)
        if self._tiers:
            self._pool.eviction_sink = self._tiers  # evicted cached blocks are demoted
        self._path: DataPath[ArrayT] = DataPath(
            config, storage, backend, self._lock, self._pool, self._chains, self._sequences, self._checks
        )
        self._pressure = MemoryPressure.LOW
        self._pressure_callback: Callable[[MemoryPressure], object] | None = None
        self._allocation_count = 0

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
        """Deprecated: the block allocator; internal, will be removed in 0.4.0 (figures:
        :meth:`stats`; tests: :func:`kvcache_core.testing.inspect.allocator`)."""
        _internal("PagedKvCacheManager.allocator", "stats(); tests: kvcache_core.testing.inspect.allocator(manager)")
        return self._pool.allocator

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Deprecated: the prefix cache's hash map; internal, will be removed in 0.4.0 (cache
        events: :meth:`subscribe`; tests: :func:`kvcache_core.testing.inspect.prefix_cache`)."""
        _internal(
            "PagedKvCacheManager.prefix_cache", "subscribe(); tests: kvcache_core.testing.inspect.prefix_cache(manager)"
        )
        return self._pool.prefix

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
        self._check_open()
        if not isinstance(request, AllocationRequest):
            raise InvalidTypeError(f"allocate takes an AllocationRequest, got {type(request).__name__}")
        with self._lock:
            self._check_open()
            if request.request_id in self._requests:
                raise DuplicateRequestError(f"request {request.request_id!r} is already allocated")
            plan = self._sequences.plan_allocation(request)
            if plan.new_blocks > self._pool.available() - plan.revived:
                cached = f" beyond {plan.hits} cached ones" if plan.hits else ""
                raise self._pool.shortage(
                    f"cannot allocate request {request.request_id!r}: {request.initial_tokens} initial tokens "
                    f"need {plan.new_blocks} blocks{cached}"
                )
            state = self._new_state(request.request_id, request.max_sequence_length, request.priority)
            self._sequences.open(state, request, plan)
            promoted = self._tiers.promote(self._pool, self._chains, state)  # tier blocks continuing the cached prefix
            if self._chains.enabled:
                self._chains.queries += plan.queries
                self._chains.hits += plan.hits + promoted
                self._chains.collisions += plan.collisions
            self._requests[request.request_id] = state
            self._allocation_count += 1
            self._update_pressure()
            return PagedKvCacheHandle(state)

    def can_allocate(self, request: AllocationRequest) -> bool:
        """Whether :meth:`allocate` would succeed now (id free, free and evictable blocks
        enough, prefix hits taken into account)."""
        with self._lock:
            self._check_open()
            if not isinstance(request, AllocationRequest):
                return False
            if request.request_id in self._requests:
                return False
            plan = self._sequences.plan_allocation(request)
            return plan.new_blocks <= self._pool.available() - plan.revived

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
        self._check_open()
        additional_tokens = check_count(additional_tokens, "additional_tokens")
        ids = None if token_ids is None else check_token_ids(token_ids, "token_ids")
        if ids is not None and len(ids) != additional_tokens:
            raise InvalidArgumentError(
                f"token_ids holds {len(ids)} ids for additional_tokens={additional_tokens}; give one id per new token"
            )
        with self._lock:
            state = self._state_of(handle)
            (slots,) = self._path.grow(
                [state],
                [additional_tokens],
                [ids],
                lambda needed, copies: (
                    f"cannot extend request {state.request_id!r} by {additional_tokens} tokens: "
                    f"{needed} more blocks needed" + (f" ({copies} to copy shared blocks)" if copies else "")
                ),
            )
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

        Returns:
            The slots, ``[stop - start]``; ``[num_groups, stop - start]`` with KV-cache
            groups (row ``g`` for the layers of group ``g``).

        Raises:
            InvalidArgumentError: not ``first_held <= start <= stop <= num_tokens()``
                (``first_held`` is 0 unless a sliding window released leading blocks; with
                KV-cache groups, the first position every group holds).
            OutOfBlocksError: fewer free and evictable blocks than the copies need.
            InvalidHandleError, SwappedOutError, ForeignHandleError: as :meth:`extend`.
        """
        with self._lock:
            state = self._state_of(handle)
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
                self._update_pressure()
            state.touch()
            if len(state.tables) == 1:
                return table.slots(first, last)
            return np.stack([group.slots(first, last) for group in state.tables])

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
            self._sequences.truncate(state, length)
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
        self._check_open()
        if not isinstance(new_request_id, str) or not new_request_id:
            raise InvalidArgumentError(f"new_request_id must be a non-empty str, got {new_request_id!r}")
        with self._lock:
            parent = self._state_of(handle)
            if new_request_id in self._requests:
                raise DuplicateRequestError(f"cannot fork into {new_request_id!r}: it is already allocated")
            child = self._new_state(new_request_id, parent.max_sequence_length, parent.priority)
            self._sequences.fork(parent, child)
            self._requests[new_request_id] = child
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
                raise self._unknown(request_id)
            self._sequences.release(state)
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
            self._sequences.swap_out(state)
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
            if record.num_blocks > self._pool.available():
                raise self._pool.shortage(f"cannot swap in request {request_id!r}: it needs {record.num_blocks} blocks")
            self._sequences.swap_in(state, record)
            state.touch()
            self._update_pressure()

    def get_handle(self, request_id: str) -> PagedKvCacheHandle[ArrayT] | None:
        """A handle of the live request ``request_id``, or ``None``."""
        with self._lock:
            self._check_open()
            state = self._requests.get(request_id) if isinstance(request_id, str) else None
            return None if state is None else PagedKvCacheHandle(state)

    def list_handles(self) -> list[tuple[str, PagedKvCacheHandle[ArrayT]]]:
        """``(request_id, handle)`` of every live request, in allocation order."""
        with self._lock:
            self._check_open()
            return [(rid, PagedKvCacheHandle(state)) for rid, state in self._requests.items()]

    # -- figures -----------------------------------------------------------------------

    def stats(self) -> CacheManagerStats:
        """Figures of the whole pool."""
        with self._lock:
            return manager_stats(self._pool, self._chains, self._requests, self._pressure, self._allocation_count)

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
            count = self._pool.allocator.cached_block_count()
            self._pool.evict(count)
        return CacheGcStats(
            memory_freed=count * self._config.bytes_per_block,
            caches_freed=0,
            blocks_freed=count,
            gc_time_ms=(time.perf_counter() - started) * 1e3,
        )

    def check_invariants(self) -> None:
        """Verify the pool's records against each other (what is checked:
        :func:`kvcache_core.paging.audit.audit`).

        Raises:
            ManagerClosedError: the manager is closed (its records describe a released pool).
            InvariantError: naming the first inconsistency found.
        """
        with self._lock:
            self._check_open()
            audit(self._sequences, self._requests)

    # -- data path (the service: kvcache_core._data_path) ----------------------------

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
        self._check_open()
        check_handle_sequence(handles, "begin_step")
        batch = len(handles)
        counts = step_counts(new_tokens, batch)
        ids = step_token_ids(token_ids, counts)
        with self._lock:
            states = [self._state_of(handle) for handle in handles]
            request_ids = tuple(state.request_id for state in states)
            if len(set(request_ids)) != batch:
                twice = next(rid for rid in request_ids if request_ids.count(rid) > 1)
                raise InvalidArgumentError(f"request {twice!r} is listed twice in one step")
            # All or nothing: a failure taking blocks (a demotion interrupted) or copying
            # leaves every request of the batch as it was.
            grown = self._path.grow(
                states,
                counts,
                ids,
                lambda needed, _: (
                    f"cannot plan a step of {batch} requests adding {sum(counts)} tokens: {needed} more blocks needed"
                ),
            )
            self._update_pressure()
            return self._path.step(states, counts, grown)

    def write(self, layer: int, slots: SlotsLike, keys: ArrayT, values: ArrayT) -> None:
        """Scatter one layer's new K/V into the pool, for any mix of requests.

        Args:
            layer: ``0 <= layer < num_layers``.
            slots: ``[n]`` distinct slots from :meth:`extend` or :meth:`writable_slots`
                (concatenate several requests' slots to write them in one call). With
                KV-cache groups, the ``[num_groups, n]`` slots they return, or the layer's
                group's row of them.
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
            group, index = self._config.layer_place(layer)
            self._path.write(index, self._checks.slots(slots, group), keys, values)

    def gather(self, handle: KvCacheHandle[ArrayT], layer: int) -> tuple[ArrayT, ArrayT]:
        """The request's keys and values as contiguous ``[num_tokens, num_heads, head_dim]``
        copies, in token order. With a sliding window that released leading blocks, the
        tokens still held: positions ``first_logical * block_size`` onwards.

        Raises:
            LayerIndexError, InvalidHandleError, SwappedOutError, ForeignHandleError.
        """
        with self._lock:
            state = self._state_of(handle)
            return self._path.gather(state, layer)

    def page_table(self, handles: Sequence[KvCacheHandle[ArrayT]], *, group: int = 0) -> PageTable:
        """The page table of a batch, in the order of ``handles``; with a sliding window it
        lists each request from its first held block and carries the window. With
        KV-cache groups, the table of ``group`` (``CacheConfig.kv_groups``; a layer's is
        ``config.layer_place(layer)[0]``), for the attention of that group's layers.

        The table's arrays are read-only and it carries each request's ownership
        generation: :meth:`paged_attention` refuses it once one of its requests was
        released, swapped or had a block replaced (copy-on-write, window release).

        Raises:
            InvalidTypeError: ``handles`` is not a sequence (list, tuple) of handles.
            InvalidHandleError, SwappedOutError, ForeignHandleError: for any handle of the
            batch.
            LayerIndexError: ``group`` outside ``0 .. num_groups - 1``.
        """
        self._check_open()
        check_handle_sequence(handles, "page_table")
        index = check_group(group, self._config.num_groups)
        with self._lock:
            return self._path.issue_page_table([self._state_of(handle) for handle in handles], index)

    def paged_attention(
        self,
        layer: int,
        query: ArrayT,
        page_table: PageTable,
        *,
        qo_indptr: npt.ArrayLike | None = None,
        scale: float | None = None,
        causal: bool = True,
        window: int | None = None,
        softcap: float | None = None,
        sinks: ArrayT | None = None,
        chunk: int | None = None,
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
            window, softcap, sinks, chunk: this call's (layer's) attention features, see
                :mod:`kvcache_core.attention.features`: a window ``W`` (combined with
                the pool's), logit softcapping, ``[num_query_heads]`` sinks of the
                query's dtype, chunked local attention ``C``.

        Returns:
            ``[total_q, num_query_heads, head_dim]`` of the query's dtype.

        Raises:
            LayerIndexError, ShapeMismatchError, DTypeMismatchError, ArrayTypeError,
            InvalidArgumentError (bad ``qo_indptr``, ``scale``, ``window``, ``softcap`` or
            ``chunk``, or a page table whose ``sliding_window`` is not the pool's, or of
            another KV-cache group than the layer's),
            UnsupportedConfigError (a feature the storage does not serve: the message
            names the capability), SlotError (the page table names blocks outside the
            pool or not in use), SwappedOutError (blocks of a request swapped out since
            the page table was taken).
        """
        with self._lock:
            self._check_open()
            features = {"window": window, "softcap": softcap, "sinks": sinks, "chunk": chunk}
            return self._path.attention(
                layer, query, scale, causal, features, page_table=page_table, qo_indptr=qo_indptr
            )

    # -- listeners, save/load, offload tiers ------------------------------------------

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
            return prefix_file.save_prefix_cache(self._pool, self._tiers, path)

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
            return prefix_file.load_prefix_cache(self._pool, self._tiers, path)

    def tier_stats(self) -> list[TierStats]:
        """Each offload tier's figures (blocks, bytes, hits, demotions, evictions), first
        to last, in records (one per hash and KV-cache group); empty without tiers (see
        :mod:`kvcache_core.offload.tiers`)."""
        with self._lock:
            return self._tiers.stats()

    # -- internals -----------------------------------------------------------------------

    def _state_of(self, handle: object) -> RequestState[ArrayT]:
        """The state of a resident request's handle of this manager."""
        self._check_open()
        as_any = getattr(handle, "as_any", None)  # downcast, as the seed crate does
        concrete: object = as_any() if callable(as_any) else None
        if not _is_paged_handle(concrete):
            raise ForeignHandleError(f"expected a handle from this manager, got {type(handle).__name__}")
        state: RequestState[Any] = handle_state(concrete)
        if state.owner is not self:
            raise ForeignHandleError(f"the handle of request {state.request_id!r} belongs to another manager")
        state.check_resident()
        return state

    def _update_pressure(self) -> None:
        """Recompute the pressure level; on a change, the callback runs when the operation
        ends (after its change is complete, as cache events do)."""
        config = self._config
        level = MemoryPressure.from_usage(
            self._pool.allocator.used_block_count() / config.num_blocks,
            config.medium_pressure_threshold,
            config.high_pressure_threshold,
            config.critical_pressure_threshold,
        )
        if level == self._pressure:
            return
        self._pressure = level
        callback = self._pressure_callback
        if callback is not None:
            self._events.defer(lambda: _notify_pressure(callback, level))

    def _check_open(self) -> None:
        self._path.check_open()

    def _new_state(self, request_id: str, max_sequence_length: int | None, priority: int) -> RequestState[ArrayT]:
        return RequestState(
            request_id=request_id,
            owner=self,
            storage=self._storage,
            lock=self._lock,
            max_sequence_length=max_sequence_length,
            priority=priority,
            config=self._config,
        )

    def _unknown(self, request_id: object) -> UnknownRequestError:
        return UnknownRequestError(
            f"unknown request {request_id!r}: it was never allocated or is already "
            f"deallocated ({len(self._requests)} requests are live)"
        )

    def _live_state(self, request_id: object) -> RequestState[ArrayT]:
        self._check_open()
        state = self._requests.get(request_id) if isinstance(request_id, str) else None
        if state is None:
            raise self._unknown(request_id)
        return state

    # -- closing: release the pool ------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._path.closed

    def close(self) -> None:
        """Release the pool: handles become invalid, the tiers are cleared and freed for
        another manager, the storage's optional ``close()`` runs (once) whatever the tiers
        raise. ``stats()`` still works; other use raises ``ManagerClosedError``."""
        with self._lock:
            if self._path.closed:
                return
            self._path.closed = True
            self._pool.epoch += 1  # page tables and steps taken before are refused
            for state in self._requests.values():
                state.valid = False
            try:
                self._tiers.close()
                self._events.emit(AllBlocksCleared())
            finally:
                release = getattr(self._storage, "close", None)
                if callable(release):
                    release()

    def __enter__(self: _ManagerT) -> _ManagerT:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PagedKvCacheManager(backend={self._backend!r}, requests={len(self._requests)}, "
            f"used_blocks={self._pool.allocator.used_block_count()}/{self._config.num_blocks})"
        )


def _is_paged_handle(value: object) -> TypeGuard[PagedKvCacheHandle[Any]]:
    return isinstance(value, PagedKvCacheHandle)


def _notify_pressure(callback: Callable[[MemoryPressure], object], level: MemoryPressure) -> None:
    try:
        callback(level)
    except Exception as exc:  # the operation succeeded; do not report it as failed
        warnings.warn(
            f"memory pressure callback {callback!r} raised {exc!r} on level {level.name}", RuntimeWarning, stacklevel=2
        )


def _internal(name: str, instead: str) -> None:
    warnings.warn(f"{name} is internal and will be removed in 0.4.0; use {instead}", DeprecationWarning, stacklevel=3)
