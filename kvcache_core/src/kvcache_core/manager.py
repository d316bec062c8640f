"""The paged cache manager: policy in core, over any backend's :class:`KvStorage`.

The policies (prefix caching, fork with copy-on-write, swapping, sliding window, hybrid
models, truncation) are described in :mod:`kvcache_core.paging`. The manager owns its parts
(``__init__``) and their lock; a call that raises leaves every table and count as it was.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy.typing as npt

from kvcache_core._data_path import DataPath, extend_arguments
from kvcache_core._requests import PressureGauge, Requests, storage_config
from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import check_group
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvCacheHandle, KvStorage, SlotArray, SlotsLike
from kvcache_core.contract.regions import MemoryRegion, slot_regions
from kvcache_core.contract.stats import CacheGcStats, CacheManagerStats, MemoryPressure
from kvcache_core.errors import InvalidArgumentError, InvalidTypeError, InvariantError
from kvcache_core.handle import PagedKvCacheHandle, resident_state
from kvcache_core.offload import explain, prefix_file
from kvcache_core.offload.events import EventCallback, EventHub, OperationLock
from kvcache_core.offload.tier_stack import TierChain
from kvcache_core.offload.tiers import OffloadTier, TierStats
from kvcache_core.paging.allocator import BlockAllocator, Placement
from kvcache_core.paging.audit import audit
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.checks import ArgumentChecks, check_handle_sequence, step_counts, step_token_ids
from kvcache_core.paging.prefix import PrefixCache
from kvcache_core.paging.request_state import RequestState
from kvcache_core.paging.sequences import SequenceBlocks
from kvcache_core.paging.transported import record_transported
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

    Args:
        storage: the backend's pool; its ``config`` is the manager's.
        backend: the backend's name, for messages and ``kvcache backends``.
        placement: ``"contiguous"`` (default: requests keep their blocks in long runs) or
            ``"fifo"`` (least recently freed block first, for comparison).
        tiers: offload tiers behind the pool, fastest first (see :mod:`kvcache_core.offload.tiers`):
            evicted cached blocks are demoted to them, prompt hits promote them back.
        config: the pool's config when it has KV-cache groups (``layer_specs``; the storage
            built from ``config.storage_config()``); ``None``: the storage's own config.

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
        self._storage, self._config, self._backend = storage, storage_config(storage, config), backend
        config = self._config
        self._events = EventHub(config.block_size)  # listeners run when the operation (the lock) ends
        self._lock = OperationLock(self._events)
        live: dict[str, RequestState[ArrayT]] = {}
        self._pool = BlockPool(config, storage, placement)
        self._chains = PrefixChains(self._pool, live)
        self._sequences = SequenceBlocks(self._pool, self._chains)
        self._checks = ArgumentChecks(self._pool, storage, live)
        if self._pool.prefix is not None:
            self._pool.prefix.listener = self._events
            if self._pool.states.enabled:  # a hash is published once a checkpoint reaches it
                self._events.gate_on_checkpoints(self._pool.prefix)
                self._pool.states.on_filed = self._events.checkpoint_filed
        self._tiers = TierChain(tiers, config, self._events)
        if self._tiers:
            self._pool.eviction_sink = self._tiers  # evicted cached blocks are demoted
            if self._pool.states.enabled:  # and so are state checkpoints evicted for a slot
                self._pool.states.on_evict = functools.partial(self._tiers.demote_checkpoint, self._pool)
        self._gauge = PressureGauge(config, self._pool, self._events)
        paging = (self._pool, self._chains, self._sequences, self._checks)
        self._path: DataPath[ArrayT] = DataPath(config, storage, backend, self._lock, *paging, self._gauge.update)
        self._requests: Requests[ArrayT] = Requests(
            self, config, storage, self._lock, live, self._pool, self._chains, self._sequences, self._tiers, self._gauge
        )

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
        """Deprecated (internal, removed in 0.4.0): :meth:`stats`; tests: ``testing.inspect``."""
        _internal("PagedKvCacheManager.allocator", "stats(); tests: kvcache_core.testing.inspect")
        return self._pool.allocator

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Deprecated (internal, removed in 0.4.0): :meth:`subscribe`; tests: ``testing.inspect``."""
        _internal("PagedKvCacheManager.prefix_cache", "subscribe(); tests: kvcache_core.testing.inspect")
        return self._pool.prefix

    def allocate(self, request: AllocationRequest) -> PagedKvCacheHandle[ArrayT]:
        """Create a request's cache and reserve blocks for its ``initial_tokens``.

        The sequence starts empty, or after its prefix hit (``num_cached_tokens()``, see
        :mod:`kvcache_core.paging`); reserved blocks cover ``max(initial_tokens, cached)``
        positions; cached blocks nobody uses are evicted (oldest first) when needed.

        Raises:
            InvalidTypeError: ``request`` is not an :class:`AllocationRequest`.
            DuplicateRequestError: a live request has this id.
            OutOfBlocksError: fewer free and evictable blocks than ``initial_tokens`` needs.
        """
        with self._lock:
            self._check_open()
            return PagedKvCacheHandle(self._requests.allocate(request))

    def can_allocate(self, request: AllocationRequest) -> bool:
        """Whether :meth:`allocate` would succeed now (id free, free and evictable blocks
        enough, prefix hits taken into account)."""
        with self._lock:
            self._check_open()
            return self._requests.can_allocate(request)

    def extend(
        self, handle: KvCacheHandle[ArrayT], additional_tokens: int, *, token_ids: Sequence[int] | None = None
    ) -> SlotArray:
        """Grow the request by ``additional_tokens`` and return their slots.

        Slots always point at blocks this request alone holds: a shared block (after
        :meth:`fork` or a prefix hit) that the new positions fall in is copied first
        (copy-on-write, one ``storage.copy_blocks`` per shared block). A sliding window
        releases the blocks older than its window first (see :mod:`kvcache_core.paging`).

        Args:
            handle: the request.
            additional_tokens: tokens to add (>= 0).
            token_ids: the new tokens' ids (``[additional_tokens]``), so that their blocks
                can be cached: positions the prompt covers repeat its ids; given only while
                every earlier id is known; checked and ignored without prefix caching.

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
        count, ids = extend_arguments(additional_tokens, token_ids)
        with self._lock:
            return self._path.extend(self._state_of(handle), count, ids)

    def writable_slots(self, handle: KvCacheHandle[ArrayT], start: int, stop: int) -> SlotArray:
        """Slots of the request's positions ``start .. stop - 1``, safe to write into: any
        shared block among them is copied first (copy-on-write), so that rewriting tokens
        of a forked or prefix-shared request changes no other request. A block of
        the prefix cache leaves it first, or is copied (see :mod:`kvcache_core.paging`).

        Returns:
            The slots, ``[stop - start]``; ``[num_groups, stop - start]`` with KV-cache
            groups (row ``g`` for the layers of group ``g``).

        Raises:
            InvalidArgumentError: not ``first_held <= start <= stop <= num_tokens()``
                (``first_held``: the first position every group holds, 0 without a window).
            OutOfBlocksError: fewer free and evictable blocks than the copies need.
            InvalidHandleError, SwappedOutError, ForeignHandleError: as :meth:`extend`.
        """
        with self._lock:
            return self._requests.writable_slots(self._state_of(handle), start, stop)

    def truncate(self, handle: KvCacheHandle[ArrayT], num_tokens: int) -> None:
        """Shorten the request to its first ``num_tokens`` tokens (speculative-decoding
        rollback, transformers' ``crop``). Blocks past the
        new end are released (see :mod:`kvcache_core.paging`); page tables and steps taken
        before are refused afterwards.

        Raises:
            InvalidArgumentError: ``num_tokens`` past ``num_tokens()``, or so short that its
                last token's window reaches released blocks (``< first_held + W - 1``).
            InvalidHandleError, SwappedOutError, ForeignHandleError: as :meth:`extend`.
        """
        with self._lock:
            self._requests.truncate(self._state_of(handle), num_tokens)

    def fork(self, handle: KvCacheHandle[ArrayT], new_request_id: str) -> PagedKvCacheHandle[ArrayT]:
        """A new request that shares every block holding the request's tokens. Nothing is
        copied now (copy-on-write, see :mod:`kvcache_core.paging`); write the K/V of slots
        already handed out before forking: a :meth:`write` into a shared block is refused.

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
            return PagedKvCacheHandle(self._requests.fork(self._state_of(handle), new_request_id))

    def deallocate(self, request_id: str) -> None:
        """Release the request's blocks; every handle to it becomes invalid.

        Blocks shared with other requests stay theirs; blocks holding a cached prefix stay
        cached (evictable) when their last reference goes; the rest become free. A
        swapped-out request's host copy is dropped.

        Raises:
            UnknownRequestError: no live request has this id (never allocated, or deallocated).
        """
        with self._lock:
            self._check_open()
            self._requests.deallocate(request_id)

    def swap_out(self, request_id: str) -> None:
        """Move a request's blocks to host memory and release them to the pool.

        Its blocks are released as :meth:`deallocate` releases them (see
        :mod:`kvcache_core.paging`); its handles stay valid and report ``is_swapped_out()``;
        data access raises :class:`~kvcache_core.errors.SwappedOutError` until :meth:`swap_in`.

        Raises:
            UnknownRequestError: no live request has this id.
            SwappedOutError: the request is already swapped out.
        """
        with self._lock:
            self._check_open()
            self._requests.swap_out(request_id)

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
            self._check_open()
            self._requests.swap_in(request_id)

    def get_handle(self, request_id: str) -> PagedKvCacheHandle[ArrayT] | None:
        """A handle of the live request ``request_id``, or ``None``."""
        with self._lock:
            self._check_open()
            state = self._requests.live.get(request_id) if isinstance(request_id, str) else None
            return None if state is None else PagedKvCacheHandle(state)

    def list_handles(self) -> list[tuple[str, PagedKvCacheHandle[ArrayT]]]:
        """``(request_id, handle)`` of every live request, in allocation order."""
        with self._lock:
            self._check_open()
            return [(rid, PagedKvCacheHandle(state)) for rid, state in self._requests.live.items()]

    def stats(self) -> CacheManagerStats:
        """Figures of the whole pool."""
        with self._lock:
            return self._requests.stats(self._chains, self._gauge.level)

    def gc(self) -> CacheGcStats:
        """Reclaim what is reclaimable: evict every cached block (prefix-cache contents
        nobody references) to the free list. Live requests, shared blocks and swapped-out
        requests are untouched.

        Returns:
            The blocks and bytes freed (``caches_freed`` is 0) and the time it took;
            evicted blocks count in ``stats().eviction_count``.
        """
        with self._lock:
            self._check_open()
            return self._requests.gc()

    def check_invariants(self) -> None:
        """Verify the pool's records against each other (:func:`kvcache_core.paging.audit.audit`).

        Raises:
            ManagerClosedError: the manager is closed (its records describe a released pool).
            InvariantError: naming the first inconsistency found.
        """
        with self._lock:
            self._check_open()
            audit(self._sequences, self._requests.live)

    def begin_step(
        self,
        handles: Sequence[KvCacheHandle[ArrayT]],
        new_tokens: Sequence[int] | int,
        *,
        token_ids: Sequence[Sequence[int] | None] | None = None,
    ) -> Step[ArrayT]:
        """Plan one forward pass: grow every request of the batch, once, with every check.

        Each request grows as :meth:`extend` grows it; the step holds the new slots, the
        page tables after the growth and the query offsets, and checks per layer only the
        layer's arrays.

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
        counts = step_counts(new_tokens, len(handles))
        ids = step_token_ids(token_ids, counts)
        with self._lock:
            return self._path.begin_step([self._state_of(handle) for handle in handles], counts, ids)

    def write(self, layer: int, slots: SlotsLike, keys: ArrayT, values: ArrayT) -> None:
        """Scatter one layer's new K/V into the pool, for any mix of requests.

        Args:
            layer: ``0 <= layer < num_layers``.
            slots: ``[n]`` distinct slots from :meth:`extend` or :meth:`writable_slots`
                (concatenate several requests' slots to write them in one call). With
                KV-cache groups, the ``[num_groups, n]`` slots they return, or the layer's
                group's row of them.
            keys, values: ``[n, num_heads, head_dim]``, ``[n, num_heads, value_width]``, pool dtype.

        The writes make full blocks cacheable (prefix caching); a cached block is immutable:
        rewrite it through :meth:`writable_slots`.

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
        (values: ``value_width``) copies, in token order. With a sliding window that released leading blocks, the
        tokens still held: positions ``first_logical * block_size`` onwards.

        Raises:
            LayerIndexError, InvalidHandleError, SwappedOutError, ForeignHandleError.
        """
        with self._lock:
            return self._path.gather(self._state_of(handle), layer)

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
            InvalidHandleError, SwappedOutError, ForeignHandleError: a handle of the batch.
            LayerIndexError: ``group`` outside ``0 .. num_groups - 1``.
        """
        self._check_open()
        check_handle_sequence(handles, "page_table")
        index = check_group(group, self._config.num_groups)
        with self._lock:
            return self._path.tables.issue([self._state_of(handle) for handle in handles], index)

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
            scale, causal, window, softcap, sinks, chunk: as :meth:`Step.attention`
                (``causal``: each request's queries are its last tokens); a query sees
                only the held keys of its window (see :mod:`kvcache_core.paging`).

        Returns:
            ``[total_q, num_query_heads, value_width]`` of the query's dtype.

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

    def subscribe(self, callback: EventCallback) -> None:
        """Call ``callback(event)`` on every cache event (``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``) from now on (see :mod:`kvcache_core.offload.events`).

        Callbacks run when the operation that made the change ends, with the lock held; an
        ``Exception`` one raises becomes a ``RuntimeWarning``, any other propagates.

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

        It runs when the operation that changed the level ends, with the lock held (it may
        call the manager); an ``Exception`` it raises becomes a ``RuntimeWarning``, any other
        propagates. ``None`` removes it.

        Raises:
            ManagerClosedError: the manager is closed.
            InvalidTypeError: ``callback`` is neither callable nor ``None``.
        """
        with self._lock:
            self._check_open()
            if callback is not None and not callable(callback):
                raise InvalidTypeError(f"callback must be callable or None, got {callback!r}")
            self._gauge.callback = callback

    @property
    def pressure(self) -> MemoryPressure:
        """The current memory pressure level: blocks in use (referenced) over the pool.
        Cached blocks count as reclaimable, not as used: allocation evicts them."""
        return self._gauge.level

    def save_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Write every cached prefix block to ``path`` in the portable format of
        :mod:`kvcache_core.offload.prefix_file` (safetensors data, JSON header, checksums; no
        pickle); returns the blocks written.

        Raises:
            UnsupportedConfigError: no prefix caching, or layers of mixed geometry. CacheFileError:
                the file cannot be written (no partial file is left).
        """
        with self._lock:
            self._check_open()
            self._config.refuse_host_copies("save_prefix_cache")
            return prefix_file.save_prefix_cache(self._pool, self._tiers, path)

    def load_prefix_cache(self, path: str | os.PathLike[str]) -> int:
        """Map the blocks of a file :meth:`save_prefix_cache` wrote (by any backend, in any
        layout) into the prefix cache as cached blocks (those already cached are skipped);
        returns the blocks loaded.

        Raises:
            CorruptCacheFileError, IncompatibleCacheFileError, CacheFileError,
                OutOfBlocksError, UnsupportedConfigError (no prefix caching, or layers of
                mixed geometry): nothing is loaded.
        """
        with self._lock:
            self._check_open()
            self._config.refuse_host_copies("load_prefix_cache")
            return prefix_file.load_prefix_cache(self._pool, self._tiers, path)

    def write_host_blocks(
        self, handle: KvCacheHandle[ArrayT], start: int, keys: npt.NDArray[Any], values: npt.NDArray[Any]
    ) -> None:
        """Write ``keys`` and ``values`` in core's host form (:mod:`kvcache_core.offload.host_form`,
        ``[pool_layers, n, block_size, num_heads, width]``, whatever the pool's layout) into the
        ``n`` blocks holding the request's positions ``start`` to ``num_tokens()``, bit for bit,
        and record every layer of them written (with prefix caching their full blocks are
        registered once the request's token ids are known). What a transport that moved a
        request from another pool calls; grow the request first (:meth:`extend`).

        Raises:
            UnsupportedConfigError: the pool has KV-cache groups, a sliding window,
                recurrent-state layers or layers of mixed geometry.
            InvalidArgumentError: ``start`` is not a block boundary in ``[0, num_tokens())``.
            ArrayTypeError, DTypeMismatchError, ShapeMismatchError: not the host form of
                those blocks (nothing is cast).
            SharedBlockWriteError: one of the blocks is shared (fork, prefix hit) or cached.
            InvalidHandleError, SwappedOutError, ForeignHandleError: as :meth:`extend`.
        Nothing is written when one of these is raised.
        """
        with self._lock:
            self._path.write_host_blocks(self._state_of(handle), start, keys, values)

    def record_blocks_written(self, handle: KvCacheHandle[ArrayT], start: int, *, states: bool = False) -> None:
        """Record the request's positions ``start`` to ``num_tokens()`` written in every layer
        of every KV-cache group holding them (a sliding group: the blocks it still holds):
        their bytes were written into its blocks through the storage's memory regions (a
        transport's one-sided read, :mod:`kvcache_core.contract.regions`); with prefix
        caching their full blocks are registered. Any pool: groups, windows, state layers,
        mixed geometry (:mod:`kvcache_core.paging.transported`). ``states=True``: its state
        slot was written too, with the states after its last token; with prefix caching,
        when that ends a block, they are filed as the checkpoint there, as
        ``Step.checkpoint_states`` does (a later prompt sharing the prefix starts from them).

        Raises:
            InvalidArgumentError: ``start`` is not a block boundary in ``[0, num_tokens())``.
            SharedBlockWriteError: one of the blocks is shared (fork, prefix hit) or cached.
            InvalidHandleError, SwappedOutError, ForeignHandleError: as :meth:`extend`.
        """
        with self._lock:
            self._path.check_open()
            state = self._state_of(handle)
            record_transported(self._pool, self._chains, self._checks, state, start)
            if states:
                self._path.checkpoint_states([state])

    def state_regions(self, handle: KvCacheHandle[ArrayT] | None = None) -> tuple[MemoryRegion, ...]:
        """The memory of the state pool, one region per state array (``config.states.arrays``
        order; :mod:`kvcache_core.contract.regions`): ``[state_slots, *shape]`` each, or with
        ``handle`` its request's slot only, ``[1, *shape]``; empty without state layers.

        Raises:
            UnsupportedConfigError: the backend's state pool names no memory.
            InvalidHandleError, SwappedOutError, ForeignHandleError: as :meth:`extend`.
        """
        with self._lock:
            self._path.check_open()
            slot = None if handle is None else self._state_of(handle).state_slot
            return slot_regions(self._config.states, self._pool.states.storage, slot)

    def tier_stats(self) -> list[TierStats]:
        """Each offload tier's figures (blocks, bytes, hits, demotions, evictions), first to
        last, in records (one per hash and KV-cache group); empty without tiers."""
        with self._lock:
            return self._tiers.stats()

    def explain_prefix(
        self,
        prompt_token_ids: Sequence[int],
        *,
        salt: str | bytes | None = None,
        evicted: explain.EvictionLog | None = None,
    ) -> explain.PrefixExplanation:
        """Where each full block of a prompt's prefix is (pool, which tier) and why the chain
        stops (:mod:`kvcache_core.offload.explain`; ``evicted``: an ``EvictionLog`` subscribed
        to this manager); nothing changes. Raises InvalidArgumentError or InvalidTypeError
        for bad token ids or salt."""
        with self._lock:
            self._check_open()
            return explain.explain_prefix(
                self._config, prompt_token_ids, salt, pool=self._pool, tiers=self._tiers, evicted=evicted
            )

    def _state_of(self, handle: object) -> RequestState[ArrayT]:
        """The state of a resident request's handle of this manager."""
        self._path.check_open()
        return resident_state(handle, self)

    def _check_open(self) -> None:
        self._path.check_open()

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
            self._requests.close(self._events)

    def __enter__(self: _ManagerT) -> _ManagerT:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PagedKvCacheManager(backend={self._backend!r}, requests={len(self._requests.live)}, "
            f"used_blocks={self._pool.allocator.used_block_count()}/{self._config.num_blocks})"
        )


def _internal(name: str, instead: str) -> None:
    warnings.warn(f"{name} is internal and will be removed in 0.4.0; use {instead}", DeprecationWarning, stacklevel=3)
