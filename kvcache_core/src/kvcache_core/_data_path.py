"""The manager's data path, a service over request states: growing a batch, the write
path, gather, page tables, attention and the per-step runner.

:class:`DataPath` is one part of a :class:`~kvcache_core.PagedKvCacheManager` (which
resolves handles to request states, holds the lock around every call and checks that it is
open); it is the per-step hot path, separate from the request lifecycle and the policies.
Every operation checks its arguments before it changes state.

Top to bottom (raw calls; ``begin_step`` plans them once per forward)::

    grow(states, counts) -> slots           the sequences grow; new blocks when needed
    write(layer, slots, keys, values)       one scatter per layer, batched across requests
    attention(layer, q, page_table)         reads the pool in place
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import numpy as np

from kvcache_core._step_runner import DataPathRunner
from kvcache_core.attention.features import storage_attention_features
from kvcache_core.attention.reference import check_attention_call, validate_query_indptr
from kvcache_core.contract.config import CacheConfig, check_count, check_token_ids
from kvcache_core.contract.lanes import LaneStorage
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvStorage, SlotArray
from kvcache_core.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    ManagerClosedError,
    ShapeMismatchError,
    StaleStepError,
    UnsupportedConfigError,
)
from kvcache_core.offload import host_form
from kvcache_core.paging.block_pool import BlockPool, blocks_for
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.checks import ArgumentChecks
from kvcache_core.paging.in_place import InPlace, grow_in_place, grow_opening, plan_in_place, plan_openings
from kvcache_core.paging.issued_tables import IssuedTables
from kvcache_core.paging.request_state import RequestState
from kvcache_core.paging.sequences import GrowthPlan, SequenceBlocks
from kvcache_core.step import Step

__all__ = ["DataPath", "extend_arguments"]

ArrayT = TypeVar("ArrayT")

ShortageMessage = Callable[[int, int], str]
"""``(blocks needed, of which copies of shared blocks) -> message`` of a growth that does
not fit (the free blocks are appended)."""


class DataPath(Generic[ArrayT]):
    """The data path of a paged manager over its request states (manager internals).

    Args:
        config: the manager's config.
        storage: the backend's pool.
        backend: the backend's name, for messages.
        lock: the manager's lock (a step holds it around each call).
        pool, chains, sequences, checks: the manager's paging parts.
        after_growth: called after each growth of requests (the manager's pressure gauge).

    Attributes:
        closed: set when the manager closes; every operation of a step then raises
            :class:`~kvcache_core.errors.ManagerClosedError`.
    """

    def __init__(
        self,
        config: CacheConfig,
        storage: KvStorage[ArrayT],
        backend: str,
        lock: AbstractContextManager[object],
        pool: BlockPool,
        chains: PrefixChains,
        sequences: SequenceBlocks,
        checks: ArgumentChecks,
        after_growth: Callable[[], None],
    ) -> None:
        self.config = config
        self.storage = storage
        self.backend = backend
        self.lock = lock
        self.closed = False
        self._pool = pool
        self._chains = chains
        self._sequences = sequences
        self._checks = checks
        built = config.storage_config()
        # Each storage layer's (heads, key width, value width): its own in a pool of mixed geometry.
        self._geometry = tuple(built.layer_geometry(index) for index in range(built.num_layers))
        self.tables = IssuedTables(config, checks)  # the page tables issued, each built on the last
        # Each layer's attention chunk (its LayerSpec's), read once.
        self._chunks = tuple(config.layer_spec(layer).chunk for layer in range(config.num_layers))
        # Per layer, (group, storage layer, head_dim) where a step lane may serve it (no chunk).
        plain = [config.layer_spec(layer).keeps_kv and chunk is None for layer, chunk in enumerate(self._chunks)]
        places = [config.layer_place(layer) if keeps else None for layer, keeps in enumerate(plain)]
        self.lane_places = tuple(
            None if place is None else (*place, self._geometry[place[1]].head_dim) for place in places
        )
        self.lanes = isinstance(storage, LaneStorage)  # the storage prepares steps' plain layers
        self._after_growth = after_growth

    def check_open(self) -> None:
        """Raise :class:`~kvcache_core.errors.ManagerClosedError` once the manager closed."""
        if self.closed:
            raise ManagerClosedError(
                f"the {self.backend!r} manager is closed: its pool was released; create a new manager"
            )

    # -- growth --------------------------------------------------------------------------

    def grow(
        self,
        states: list[RequestState[ArrayT]],
        counts: Sequence[int],
        ids: Sequence[tuple[int, ...] | None],
        shortage: ShortageMessage,
    ) -> list[SlotArray]:
        """Grow distinct requests by ``counts`` tokens (with their ``ids``), all or nothing:
        the requests whose new tokens fit the block of their last token in place
        (:func:`~kvcache_core.paging.in_place.grow_in_place`), after the others: those are
        planned, the free and evictable blocks checked to cover them (else
        ``OutOfBlocksError`` with ``shortage``'s message, nothing changed) and the plans
        carried out. Returns the new slots: each request's, or (all in place) the batch's in
        one array.

        Raises:
            SequenceTooLongError, InvalidArgumentError: a plan is refused.
            OutOfBlocksError: the batch's growth does not fit.
        """
        return self._grow_around(
            states, counts, ids, shortage, plan_in_place(self._sequences, states, counts, ids)
        )  # in place: a decode step, mostly

    def _grow_around(
        self,
        states: list[RequestState[ArrayT]],
        counts: Sequence[int],
        ids: Sequence[tuple[int, ...] | None],
        shortage: ShortageMessage,
        in_place: InPlace | None,
    ) -> list[SlotArray]:
        """:meth:`grow`, given what :func:`~kvcache_core.paging.in_place.plan_in_place` found
        for these arguments (nothing changed since)."""
        if in_place is not None and len(in_place.rows) == len(states):
            return [grow_in_place(self._sequences, states, counts, in_place)]
        rows = list(range(len(states))) if in_place is None else sorted(set(range(len(states))) - set(in_place.rows))
        general = self._grow_planned(
            [states[row] for row in rows], [counts[row] for row in rows], [ids[row] for row in rows], shortage
        )
        if in_place is None or not in_place.rows:
            return general
        grown: list[SlotArray] = [np.zeros(0, dtype=np.int64)] * len(states)
        for row, slots in zip(rows, general, strict=True):
            grown[row] = slots
        in_slots = grow_in_place(self._sequences, states, counts, in_place)  # cannot fail: after the general path
        ends = np.cumsum([counts[row] for row in in_place.rows]).tolist()
        for row, end, first in zip(in_place.rows, ends, [0, *ends], strict=False):
            grown[row] = in_slots[first:end]
        return grown

    def _grow_planned(
        self,
        states: list[RequestState[ArrayT]],
        counts: Sequence[int],
        ids: Sequence[tuple[int, ...] | None],
        shortage: ShortageMessage,
    ) -> list[SlotArray]:
        """Plan each request's growth, check that the blocks suffice, carry the plans out, then
        call ``after_growth``."""
        plan_growth = self._sequences.plan_growth
        plans: list[GrowthPlan]
        if len(states) == 1:  # one request (extend): no loop over the batch
            plan = plan_growth(states[0], counts[0], ids[0])
            plans, needed, freed = [plan], plan.needed, plan.freed
        else:
            plans, needed, freed = [], 0, 0
            for state, count, state_ids in zip(states, counts, ids, strict=True):
                plan = plan_growth(state, count, state_ids)
                plans.append(plan)
                needed += plan.needed
                freed += plan.freed
        if needed > self._pool.available() + freed:
            raise self._pool.shortage(shortage(needed, sum(plan.copy_count for plan in plans)))
        if len(plans) == 1:  # one request: the same growth without the batch's bookkeeping
            grown = [self._sequences.grow(states[0], plans[0])]
        else:
            grown = self._sequences.grow_all(states, plans)
        self._after_growth()  # blocks were taken or released (growth in place takes none)
        return grown

    def extend(self, state: RequestState[ArrayT], count: int, ids: tuple[int, ...] | None) -> SlotArray:
        """Grow one request (``manager.extend``, arguments checked by :func:`extend_arguments`).

        Raises:
            SequenceTooLongError, InvalidArgumentError, OutOfBlocksError.
        """
        (slots,) = self.grow(
            [state],
            [count],
            [ids],
            lambda needed, copies: (
                f"cannot extend request {state.request_id!r} by {count} tokens: {needed} more blocks needed"
                + (f" ({copies} to copy shared blocks)" if copies else "")
            ),
        )
        return slots

    def begin_step(
        self,
        states: list[RequestState[ArrayT]],
        counts: list[int],
        ids: list[tuple[int, ...] | None],
        previous: tuple[DataPathRunner[ArrayT], Step[ArrayT]] | None = None,
    ) -> Step[ArrayT]:
        """Plan a step (``manager.begin_step``): grow every request of the batch, all or
        nothing, and bind the step to them (``previous``: see :meth:`step`).

        Raises:
            InvalidArgumentError: a request listed twice; and what :meth:`grow` raises.
        """
        request_ids = [state.request_id for state in states]
        if len(set(request_ids)) != len(states):
            twice = next(rid for rid in request_ids if request_ids.count(rid) > 1)
            raise InvalidArgumentError(f"request {twice!r} is listed twice in one step")
        # All or nothing: a failure taking blocks (a demotion interrupted) or copying
        # leaves every request of the batch as it was.
        grown = self.grow(states, counts, ids, _step_shortage(len(states), sum(counts)))
        return self.step(states, counts, grown, previous)

    def advance_step(
        self,
        states: list[RequestState[ArrayT]],
        last: Step[ArrayT],
        previous: DataPathRunner[ArrayT],
        ids: list[tuple[int, ...] | None],
    ) -> Step[ArrayT]:
        """The decode step after ``last`` (current, of ``states``, run by ``previous``): each
        request one token more, as :meth:`begin_step` plans it. Where every request's token
        lands in the block of its last one or (no prefix caching) opens one free block, and
        ``last``'s page table is the last one issued, the new table shares its pages (lengths
        one more, opened blocks appended); otherwise the batch grows as :meth:`begin_step`
        grows it (what is found in place found once). Either way ``previous`` hands the new
        step what the two share (:meth:`~kvcache_core._step_runner.DataPathRunner.hand_over`).

        Raises:
            What :meth:`begin_step` raises (the general path).
        """
        counts = [1] * len(states)
        in_place = plan_in_place(self._sequences, states, counts, ids)
        opening = None if in_place is None else plan_openings(self._sequences, states, counts, ids, in_place)
        if opening is None or len(last.page_tables) != 1 or not self.tables.is_last(last.page_table):
            # the requests are distinct (a step's): grown as begin_step grows them, planned once
            grown = self._grow_around(states, counts, ids, _step_shortage(len(states), len(states)), in_place)
            return self.step(states, counts, grown, (previous, last))
        assert in_place is not None  # (plan_openings runs only on a plan)
        if opening:  # some requests open a block: the others grow in place
            slots = grow_opening(self._sequences, states, counts, in_place, opening)
            self._after_growth()
            table = self.tables.issue(states)
        else:  # no block taken or released
            slots = grow_in_place(self._sequences, states, counts, in_place)
            table = self.tables.grown_in_place(last.page_table, states)
        runner = DataPathRunner(self, states, 1)
        step = Step(
            runner, last.request_ids, tuple(counts), slots, (table,), last.num_heads, last.head_dim, last.value_width
        )
        previous.hand_over(last, runner, step, same_blocks=not opening, extends=True)
        return step

    def step(
        self,
        states: list[RequestState[ArrayT]],
        counts: Sequence[int],
        grown: list[SlotArray],
        previous: tuple[DataPathRunner[ArrayT], Step[ArrayT]] | None = None,
    ) -> Step[ArrayT]:
        """The step of a batch just grown by ``counts`` tokens (``grown``: their slots);
        ``previous``: the runner and step this one is the next decode step of, which hands it
        what the two share."""
        config = self.config
        tables = tuple(self.tables.issue(states, group) for group in range(config.num_groups))
        if len(grown) == 1:  # one array (a decode step grown in place): the step copies it
            slots = grown[0]
        elif grown:
            slots = np.concatenate(grown, axis=-1)
        else:
            slots = np.zeros((0,) if config.num_groups == 1 else (config.num_groups, 0), dtype=np.int64)
        runner = DataPathRunner(self, states, len(tables))
        request_ids = tuple(state.request_id for state in states)
        step = Step(
            runner, request_ids, tuple(counts), slots, tables, config.num_heads, config.head_dim, config.value_width
        )
        if previous is not None:
            previous[0].hand_over(previous[1], runner, step, same_blocks=False)
        return step

    # -- writes, reads --------------------------------------------------------------------

    def write(self, layer: int, slots: SlotArray, keys: ArrayT, values: ArrayT, writable_at: int = -1) -> int:
        """The one write path of ``manager.write`` and :meth:`Step.write`: check the arrays
        and that no slot is in a block several requests share or the prefix cache serves,
        then scatter into the storage's ``layer`` and record the writes (prefix caching).

        ``slots`` were checked (in the pool, handed out, distinct, of the layer's group).
        ``writable_at`` is the :attr:`BlockPool.immutable_epoch` at which these slots were
        last found writable (``-1``: never): no block can have become immutable since, so the
        mask lookup is skipped. Returns the epoch at which they were found writable now.
        """
        shape = self._geometry[layer]
        expected = (int(slots.shape[0]), shape.num_heads, shape.head_dim)
        self._checks.array("keys", keys, expected)
        self._checks.array("values", values, (*expected[:2], shape.value_width))
        if not slots.shape[0]:
            return self._pool.immutable_epoch
        epoch = self.writable(slots, writable_at)
        self.storage.write(layer, slots, keys, values)
        self.record_written(layer, slots)
        return epoch

    def writable(self, slots: SlotArray, writable_at: int) -> int:
        """Refuse ``slots`` in a block several requests share or the prefix cache serves
        (``SharedBlockWriteError``), unless they were found writable at the current
        immutable epoch ``writable_at``; the epoch now."""
        epoch = self._pool.immutable_epoch
        if writable_at != epoch:
            self._checks.writable(slots)
        return epoch

    def record_written(self, layer: int, slots: SlotArray) -> None:
        """Record that storage layer ``layer`` holds ``slots`` now (prefix caching: a block
        every layer wrote is registered)."""
        written = self._pool.written
        if written is not None:
            written[layer, slots] = True
            self._chains.after_write(slots // self.config.block_size)  # may register blocks: a new epoch

    def write_host_blocks(self, state: RequestState[ArrayT], start: int, keys: Any, values: Any) -> None:
        """Write host-form blocks (``[pool_layers, n, block_size, num_heads, width]``, the
        values' width theirs) into the
        request's blocks holding positions ``start ..`` its end (``keys`` ``None``: their bytes
        were written through the storage's memory regions already), and record them written
        in every layer (prefix caching registers the full ones), as if each layer were written.

        Raises:
            UnsupportedConfigError: the pool has KV-cache groups, a sliding window or state layers.
            InvalidArgumentError: ``start`` is not a block boundary in ``[0, num_tokens())``.
            ArrayTypeError, DTypeMismatchError, ShapeMismatchError: not the host form of those blocks.
            SharedBlockWriteError: a block is shared or served by the prefix cache.
        """
        config, table = self.config, state.table
        if (
            config.num_groups != 1
            or config.sliding_window is not None
            or table.first_logical
            or config.states.arrays
            or config.mixed_geometry
        ):
            raise UnsupportedConfigError(
                "host blocks are written only into a pool of one KV-cache group without a sliding window, "
                "recurrent-state layers or layers of their own geometry"
            )
        length = table.sequence_length
        if not (isinstance(start, int) and 0 <= start < length and start % config.block_size == 0):
            raise InvalidArgumentError(
                f"start must be a multiple of block_size {config.block_size} in [0, {length}), got {start!r}"
            )
        slots = table.slots(start, length)
        first, stop = start // config.block_size, blocks_for(length, config.block_size)
        blocks = np.asarray(table.physical_blocks[first:stop], dtype=np.int64)
        if keys is not None:
            host_form.check_host_array(config, "keys", keys, host_form.host_shape(config, len(blocks)))
            host_form.check_host_array(config, "values", values, host_form.host_shape(config, len(blocks), "values"))
        self._checks.writable(slots)
        if keys is not None:
            self.storage.blocks_from_host(blocks, keys, values)
        written = self._pool.written
        if written is not None:
            written[:, slots] = True
            self._chains.after_write(blocks)

    def gather(self, state: RequestState[ArrayT], layer: int) -> tuple[ArrayT, ArrayT]:
        """The request's held K/V of ``layer`` as contiguous copies, in token order."""
        group, index = self.config.layer_place(layer)
        table = state.tables[group]
        tokens = table.held_tokens()
        used = blocks_for(tokens, self.config.block_size)
        blocks = np.asarray(table.physical_blocks[:used], dtype=np.int64)
        state.touch()
        return self.storage.gather(index, blocks, tokens)

    def attention(
        self,
        layer: int,
        query: ArrayT,
        scale: float | None,
        causal: bool,
        features: dict[str, Any],
        *,
        page_table: object = None,
        qo_indptr: object = None,
        step: Step[ArrayT] | None = None,
        served: frozenset[str] | None = None,
    ) -> ArrayT:
        """The one attention entry of ``manager.paged_attention`` (``page_table`` and
        ``qo_indptr`` as given, checked here) and :meth:`Step.attention` (``step``: its
        tables and offsets, checked when it was planned; ``served``: the storage's attention
        features, read when it was planned).

        ``features`` (``window``, ``softcap``, ``sinks``, ``chunk``; ``chunk`` by default the
        layer's) reach the storage only when set and served: a storage that claims no
        attention feature is called with the six positional arguments alone.

        Raises:
            LayerIndexError, ShapeMismatchError, DTypeMismatchError, ArrayTypeError,
            InvalidArgumentError, InvalidTypeError, UnsupportedConfigError, SlotError,
            SwappedOutError: as ``manager.paged_attention`` and :meth:`Step.attention`.
        """
        _, call, keywords = self.attention_call(
            layer, query, scale, causal, features, page_table, qo_indptr, step, served
        )
        return self.storage.paged_attention(*call, **keywords)

    def attention_call(
        self,
        layer: int,
        query: ArrayT,
        scale: float | None,
        causal: bool,
        features: dict[str, Any],
        page_table: object,
        qo_indptr: object,
        step: Step[ArrayT] | None,
        served: frozenset[str] | None,
    ) -> tuple[int, tuple[int, ArrayT, PageTable, Any, float, bool], dict[str, Any]]:
        """``(group, arguments, keywords)``: the layer's KV-cache group and the checked
        arguments of the storage's ``paged_attention`` for :meth:`attention` (the storage
        layer, query, table, offsets, scale, ``causal``; the features): every check of the
        call, nothing run.

        Raises:
            What :meth:`attention` raises.
        """
        group, index = self.config.layer_place(layer)  # layer: an int in range from here on
        geometry = self._geometry[index]
        shape = self._checks.query(query, geometry.num_heads, geometry.head_dim)
        if step is None:
            table = self._checks.page_table(page_table)
            if table.group != group:
                raise InvalidArgumentError(
                    f"the page table lists KV-cache group {table.group}, but layer {layer} is in group {group}: "
                    f"take it with manager.page_table(handles, group={group})"
                )
        else:
            table = step.page_tables[group]
            if shape[0] != step.num_new_tokens:
                raise ShapeMismatchError(
                    f"query has {shape[0]} tokens; the step added {step.num_new_tokens} "
                    f"(new tokens per request: {list(step.new_tokens)})"
                )
        if features["chunk"] is None:
            features["chunk"] = self._chunks[int(layer)]  # a chunked layer of layer_specs
        indptr = validate_query_indptr(qo_indptr, table, shape[0]) if step is None else step.qo_indptr
        checked_scale, keywords = check_attention_call(
            scale,
            causal,
            geometry.head_dim,
            features,
            served=storage_attention_features(self.storage) if served is None else served,
            backend=self.backend,
            query_heads=shape[1],
            table_window=table.sliding_window,
            check_array=self._checks.array,
        )
        return group, (index, query, table, indptr, checked_scale, causal), keywords

    # -- recurrent states -----------------------------------------------------------------

    def read_state(self, slots: SlotArray, layer: object, name: object) -> ArrayT:
        """A copy of state array ``name`` of ``layer`` for the requests holding ``slots``:
        ``[len(slots), *shape]``.

        Raises:
            LayerIndexError, InvalidArgumentError: not a state layer, or no such array.
        """
        states = self._pool.states
        index = states.index(layer, name)
        assert states.storage is not None
        values: ArrayT = states.storage.read(index, slots)
        return values

    def read_state_rows(self, run: tuple[int, int] | None, layer: object, name: object) -> ArrayT | None:
        """State array ``name`` of ``layer`` for the requests holding the slots of ``run``
        ``(first, count)`` (:func:`~kvcache_core.paging.state_slots.slot_run`), sliced from the
        pool's array (a view with a mutable array library, the current values with an
        immutable one); ``None`` when the slots are not one ascending run (``run`` ``None``).

        Raises:
            LayerIndexError, InvalidArgumentError: as :meth:`read_state`.
        """
        states = self._pool.states
        index = states.index(layer, name)
        assert states.storage is not None
        if run is None:
            return None
        first, count = run
        rows: ArrayT = states.storage.array(index)[first : first + count]
        return rows

    def write_state(self, slots: SlotArray, layer: object, name: object, values: ArrayT) -> None:
        """Write ``values`` ``[len(slots), *shape]`` (the array's dtype) into state array
        ``name`` of ``layer`` for the requests holding ``slots``.

        Raises:
            LayerIndexError, InvalidArgumentError, ShapeMismatchError, DTypeMismatchError,
            ArrayTypeError.
        """
        states = self._pool.states
        index = states.index(layer, name)
        array = self.config.states.arrays[index][1]
        shape, dtype = self._checks.array_info(f"state {name!r}", values)
        expected = (int(slots.shape[0]), *array.shape)
        if shape != expected:
            raise ShapeMismatchError(
                f"state {name!r} of layer {layer} must have shape {expected} ([requests, *state shape]), got {shape}"
            )
        if dtype != array.dtype:
            raise DTypeMismatchError(f"state {name!r} of layer {layer} has dtype {array.dtype}, got {dtype}")
        assert states.storage is not None
        states.storage.write(index, slots, values)

    def checkpoint_states(self, states: list[RequestState[ArrayT]]) -> int:
        """File a checkpoint of each request's states whose length ends a cached block (see
        :mod:`kvcache_core.paging.state_slots`); returns how many are filed."""
        slots, block_size = self._pool.states, self.config.block_size
        filed = 0
        for state in states:
            blocks, rest = divmod(state.table.sequence_length, block_size)
            if slots.enabled and blocks and not rest and len(state.chain) >= blocks:
                filed += slots.save_checkpoint(state.state_slot, state.chain[blocks - 1].block_hash)
        return filed

    # -- steps ---------------------------------------------------------------------------

    def stamp(self, states: list[RequestState[ArrayT]]) -> Callable[[], None]:
        """A step's staleness check, stamped with its requests' generation and plan now:
        it raises :class:`~kvcache_core.errors.StaleStepError` once one of them changed."""
        stamps = [(state, state.generation, state.plan) for state in states]
        pool = self._pool
        epoch = pool.epoch

        def check_current() -> None:
            self.check_open()
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


def extend_arguments(additional_tokens: object, token_ids: object) -> tuple[int, tuple[int, ...] | None]:
    """``manager.extend``'s count and token ids, checked.

    Raises:
        InvalidArgumentError: not an int >= 0, bad ids, or as many ids as tokens.
    """
    count = check_count(additional_tokens, "additional_tokens")
    ids = None if token_ids is None else check_token_ids(token_ids, "token_ids")
    if ids is not None and len(ids) != count:
        raise InvalidArgumentError(
            f"token_ids holds {len(ids)} ids for additional_tokens={count}; give one id per new token"
        )
    return count, ids


def _step_shortage(requests: int, tokens: int) -> ShortageMessage:
    """The message of a step of ``requests`` adding ``tokens`` that the pool cannot hold."""
    return lambda needed, _: (
        f"cannot plan a step of {requests} requests adding {tokens} tokens: {needed} more blocks needed"
    )
