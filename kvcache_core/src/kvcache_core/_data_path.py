"""The manager's data path: the step, the raw write, gather, page tables, attention.

:class:`DataPath` is a base of :class:`~kvcache_core.PagedKvCacheManager` (not used
alone): the per-step hot path, separate from the request lifecycle and the policies.
Every method takes the manager's lock and checks its arguments before it changes state.

Top to bottom (raw calls; :meth:`DataPath.begin_step` plans them once per forward)::

    extend(handle, n) -> slots [n]          the sequence grows; new blocks when needed
    write(layer, slots, keys, values)       one scatter per layer, batched across requests
    paged_attention(layer, q, page_table)   reads the pool in place
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeGuard, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache_core.attention.features import storage_attention_features
from kvcache_core.attention.reference import check_attention_call, validate_query_indptr
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.groups import check_group
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvCacheHandle, KvStorage, SlotArray, SlotsLike
from kvcache_core.contract.stats import MemoryPressure
from kvcache_core.errors import (
    ForeignHandleError,
    InvalidArgumentError,
    ManagerClosedError,
    StaleStepError,
)
from kvcache_core.handle import PagedKvCacheHandle, RequestState
from kvcache_core.offload.events import EventHub, OperationLock
from kvcache_core.paging.block_pool import BlockPool, blocks_for
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.checks import ArgumentChecks, check_handle_sequence, step_counts, step_token_ids
from kvcache_core.paging.sequences import SequenceBlocks
from kvcache_core.step import Step, StepHooks

__all__ = ["DataPath"]

ArrayT = TypeVar("ArrayT")


def _is_paged_handle(value: object) -> TypeGuard[PagedKvCacheHandle[Any]]:
    return isinstance(value, PagedKvCacheHandle)


def _notify_pressure(callback: Callable[[MemoryPressure], object], level: MemoryPressure) -> None:
    try:
        callback(level)
    except Exception as exc:  # the operation succeeded; do not report it as failed
        warnings.warn(
            f"memory pressure callback {callback!r} raised {exc!r} on level {level.name}", RuntimeWarning, stacklevel=2
        )


class DataPath(Generic[ArrayT]):
    """The data path of a paged manager, and the internals it shares with the lifecycle."""

    _lock: OperationLock
    _config: CacheConfig
    _storage: KvStorage[ArrayT]
    _backend: str
    _requests: dict[str, RequestState[ArrayT]]
    _pool: BlockPool
    _events: EventHub
    _chains: PrefixChains
    _sequences: SequenceBlocks
    _checks: ArgumentChecks
    _pressure: MemoryPressure
    _pressure_callback: Callable[[MemoryPressure], object] | None
    _closed = False

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
            plans = [
                self._sequences.plan_growth(state, count, state_ids)
                for state, count, state_ids in zip(states, counts, ids, strict=True)
            ]
            needed = sum(plan.needed for plan in plans)
            freed = sum(plan.freed for plan in plans)
            if needed > self._pool.available() + freed:
                raise self._pool.shortage(
                    f"cannot plan a step of {batch} requests adding {sum(counts)} tokens: {needed} more blocks needed"
                )
            # All or nothing: a failure taking blocks (a demotion interrupted) or copying
            # leaves every request of the batch as it was.
            grown = self._sequences.grow_all(states, plans)
            tables = tuple(self._issue_page_table(states, group) for group in range(self._config.num_groups))
            self._update_pressure()
            empty = np.zeros((0,) if self._config.num_groups == 1 else (self._config.num_groups, 0), dtype=np.int64)
            slots = np.concatenate(grown, axis=-1) if grown else empty
            hooks = StepHooks(
                lock=self._lock,
                check_current=self._step_check(states),
                place=self._config.layer_place,
                layer_chunk=self._layer_chunk,
                check_array=self._checks.array,
                check_query=self._checks.query,
                write=self._write_slots,
                attention=self._storage.paged_attention,
                attention_features=storage_attention_features(self._storage),
                backend=self._backend,
            )
            return Step(hooks, request_ids, tuple(counts), slots, tables, self._config.num_heads, self._config.head_dim)

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
            self._write_slots(index, self._checks.slots(slots, group), keys, values)

    def gather(self, handle: KvCacheHandle[ArrayT], layer: int) -> tuple[ArrayT, ArrayT]:
        """The request's keys and values as contiguous ``[num_tokens, num_heads, head_dim]``
        copies, in token order. With a sliding window that released leading blocks, the
        tokens still held: positions ``first_logical * block_size`` onwards.

        Raises:
            LayerIndexError, InvalidHandleError, SwappedOutError, ForeignHandleError.
        """
        with self._lock:
            state = self._state_of(handle)
            group, index = self._config.layer_place(layer)
            table = state.tables[group]
            tokens = table.held_tokens()
            used = blocks_for(tokens, self._config.block_size)
            blocks = np.asarray(table.physical_blocks[:used], dtype=np.int64)
            state.touch()
            return self._storage.gather(index, blocks, tokens)

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
            return self._issue_page_table([self._state_of(handle) for handle in handles], index)

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
            group, index = self._config.layer_place(layer)
            shape = self._checks.query(query)
            table = self._checks.page_table(page_table)
            if table.group != group:
                raise InvalidArgumentError(
                    f"the page table lists KV-cache group {table.group}, but layer {layer} is in group {group}: "
                    f"take it with manager.page_table(handles, group={group})"
                )
            if chunk is None:
                chunk = self._layer_chunk(int(layer))
            indptr = validate_query_indptr(qo_indptr, table, shape[0])
            checked_scale, features = check_attention_call(
                scale,
                causal,
                self._config.head_dim,
                {"window": window, "softcap": softcap, "sinks": sinks, "chunk": chunk},
                served=storage_attention_features(self._storage),
                backend=self._backend,
                query_heads=shape[1],
                table_window=table.sliding_window,
                check_array=self._checks.array,
            )
            return self._storage.paged_attention(index, query, table, indptr, checked_scale, causal, **features)

    # -- internals shared with the lifecycle ---------------------------------------------

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

    def _issue_page_table(self, states: list[RequestState[ArrayT]], group: int = 0) -> PageTable:
        return self._checks.issue(
            PageTable.from_block_tables(
                [state.tables[group] for state in states],
                [state.request_id for state in states],
                self._config.block_size,
                sliding_window=self._config.kv_groups[group].window,
                generations=[state.generation for state in states],
                group=group,
            )
        )

    def _layer_chunk(self, layer: int) -> int | None:
        """A (checked) layer's chunk from the config's ``layer_specs``."""
        return self._config.layer_spec(layer).chunk

    def _step_check(self, states: list[RequestState[ArrayT]]) -> Callable[[], None]:
        """A step's staleness check, stamped with its requests' generation and plan now."""
        stamps = [(state, state.generation, state.plan) for state in states]
        pool = self._pool
        epoch = pool.epoch

        def check_current() -> None:
            self._check_open()
            if pool.epoch == epoch:
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

        return check_current

    def _write_slots(self, layer: int, slots: SlotArray, keys: ArrayT, values: ArrayT, writable_at: int = -1) -> int:
        """The one write path of :meth:`write` and :meth:`Step.write`: check the arrays and
        that no slot is in a block several requests share or the prefix cache serves, then
        scatter into the storage's ``layer`` and record the writes (prefix caching).

        ``slots`` were checked (in the pool, handed out, distinct, of the layer's group).
        ``writable_at`` is the :attr:`BlockPool.immutable_epoch` at which these slots were
        last found writable (``-1``: never): no block can have become immutable since, so the
        mask lookup is skipped. Returns the epoch at which they were found writable now.
        """
        expected = (int(slots.shape[0]), self._config.num_heads, self._config.head_dim)
        self._checks.array("keys", keys, expected)
        self._checks.array("values", values, expected)
        pool = self._pool
        epoch = pool.immutable_epoch
        if not slots.shape[0]:
            return epoch
        if writable_at != epoch:
            self._checks.writable(slots)
        self._storage.write(layer, slots, keys, values)
        written = pool.written
        if written is not None:
            written[layer, slots] = True
            self._chains.after_write(slots // self._config.block_size)  # may register blocks: a new epoch
        return epoch

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
        if self._closed:
            raise ManagerClosedError(
                f"the {self._backend!r} manager is closed: its pool was released; create a new manager"
            )
