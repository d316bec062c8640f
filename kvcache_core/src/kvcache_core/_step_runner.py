"""The data path bound to one step's requests: what a :class:`~kvcache_core.step.Step` calls
(manager internals). Each call holds the manager's lock and checks that the step is current;
a plain layer's write and attention go through the storage's step lane where it has one
(:mod:`kvcache_core.contract.lanes`), every other call through the data path's checked calls.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, Literal, Protocol, TypeVar, cast

import numpy as np

from kvcache_core.attention.features import storage_attention_features
from kvcache_core.attention.reference import check_scale
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.lanes import LaneStorage, StepLane, advance_lane, lane_write_and_view
from kvcache_core.contract.padded import storage_view_padded
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvStorage, SlotArray
from kvcache_core.contract.scalars import check_optional_count
from kvcache_core.paging.checks import step_token_ids
from kvcache_core.paging.padded import check_padded_layout, padded_slots, padded_slots_after, read_padded
from kvcache_core.paging.request_state import RequestState
from kvcache_core.paging.state_slots import slot_run
from kvcache_core.step import Step

__all__ = ["DataPathRunner", "RunnerPath"]

ArrayT = TypeVar("ArrayT")
_Out = TypeVar("_Out")


class RunnerPath(Protocol[ArrayT]):
    """What a step's runner uses of the manager's data path
    (:class:`~kvcache_core._data_path.DataPath`)."""

    config: CacheConfig
    storage: KvStorage[ArrayT]
    lock: AbstractContextManager[object]
    #: Per layer, ``(group, storage layer, head_dim)`` where a lane may serve it, else ``None``.
    lane_places: tuple[tuple[int, int, int] | None, ...]
    #: Whether the storage prepares step lanes.
    lanes: bool

    def stamp(self, states: list[RequestState[ArrayT]]) -> Callable[[], None]: ...

    def write(self, layer: int, slots: SlotArray, keys: ArrayT, values: ArrayT, writable_at: int = -1) -> int: ...

    def writable(self, slots: SlotArray, writable_at: int) -> int: ...

    def record_written(self, layer: int, slots: SlotArray) -> None: ...

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
    ) -> tuple[int, tuple[int, ArrayT, PageTable, Any, float, bool], dict[str, Any]]: ...

    def read_state(self, slots: SlotArray, layer: object, name: object) -> ArrayT: ...

    def read_state_rows(self, run: tuple[int, int] | None, layer: object, name: object) -> ArrayT | None: ...

    def write_state(self, slots: SlotArray, layer: object, name: object, values: ArrayT) -> None: ...

    def checkpoint_states(self, states: list[RequestState[ArrayT]]) -> int: ...

    def advance_step(
        self,
        states: list[RequestState[ArrayT]],
        last: Step[ArrayT],
        previous: DataPathRunner[ArrayT],
        ids: list[tuple[int, ...] | None],
    ) -> Step[ArrayT]: ...


#: The types of scale a lane takes (anything else takes the general path, which checks it).
_SCALES: frozenset[type] = frozenset({float, type(None)})


class DataPathRunner(Generic[ArrayT]):
    """The data path bound to one step's requests: what its :class:`Step` calls
    (:class:`~kvcache_core.step.StepRunner`), under the manager's lock."""

    __slots__ = (
        "_check_current",
        "_group_slots",
        "_lanes",
        "_padded",
        "_padded_before",
        "_path",
        "_scale",
        "_served",
        "_state_run",
        "_state_slots",
        "_states",
        "_writable_at",
    )

    def __init__(self, path: RunnerPath[ArrayT], states: list[RequestState[ArrayT]], groups: int) -> None:
        self._path = path
        self._check_current = path.stamp(states)
        self._state_slots: SlotArray | None = None  # the requests' state slots, where a state layer asks
        self._state_run: tuple[int, int] | Literal[False] | None = False  # False: not found yet
        self._states = states
        self._served: frozenset[str] | None = None  # the storage's attention features, read by the general path
        # Per KV-cache group, the epoch at which the group's slots were last found writable
        # (-1: not yet): a block of the step that is registered in the prefix cache or
        # mapped by another request after planning is never written in place.
        self._writable_at = [-1] * groups
        self._group_slots: tuple[SlotArray, ...] | None = None
        # Per KV-cache group, the storage's lane for this step (None: not asked yet; False: none).
        unasked: list[StepLane[Any] | Literal[False] | None] = [None] * groups
        self._lanes = unasked if path.lanes else None
        self._scale: tuple[float | None, float] = (None, 0.0)  # the last scale given and checked
        # The padded gathers' slots by (group, width): the same for every layer of a group.
        self._padded: dict[tuple[int, int | None], SlotArray] = {}
        # The last step's, where this step is its decode step that moved no earlier token: each
        # of this step's is one of those with a column more (paging.padded.padded_slots_after).
        self._padded_before: dict[tuple[int, int | None], SlotArray] | None = None

    def _states_slots(self) -> SlotArray:
        """The requests' state slots (found once per step, by the first state layer)."""
        slots = self._state_slots
        if slots is None:
            slots = self._state_slots = np.array([state.state_slot for state in self._states], dtype=np.int64)
        return slots

    def _features_served(self) -> frozenset[str]:
        """The storage's attention features (read once per step, where a call needs them)."""
        served = self._served
        if served is None:
            served = self._served = storage_attention_features(self._path.storage)
        return served

    def _slots(self, step: Step[ArrayT], group: int) -> SlotArray:
        """The step's slots of KV-cache ``group``: the same read-only array for every layer
        (a storage converts it once)."""
        if self._group_slots is None:
            slots = step.slots
            self._group_slots = (slots,) if slots.ndim == 1 else tuple(slots)
        return self._group_slots[group]

    def write(self, step: Step[ArrayT], layer: int, keys: ArrayT, values: ArrayT) -> None:
        path = self._path
        with path.lock:
            self._check_current()
            group, index = path.config.layer_place(layer)
            self._writable_at[group] = path.write(
                index, self._slots(step, group), keys, values, self._writable_at[group]
            )

    def attention(
        self, step: Step[ArrayT], layer: int, query: ArrayT, scale: float | None, causal: bool, features: dict[str, Any]
    ) -> ArrayT:
        path = self._path
        with path.lock:
            self._check_current()
            _, call, keywords = path.attention_call(
                layer, query, scale, causal, features, None, None, step, self._features_served()
            )
            return path.storage.paged_attention(*call, **keywords)

    def write_and_attend(
        self,
        step: Step[ArrayT],
        layer: int,
        keys: ArrayT,
        values: ArrayT,
        query: ArrayT,
        scale: float | None,
        causal: bool,
        features: dict[str, Any],
    ) -> ArrayT:
        path = self._path
        with path.lock:
            self._check_current()
            plain = features["window"] is None and features["softcap"] is None and features["sinks"] is None
            if self._lanes is not None and causal is True and plain and features["chunk"] is None:
                output = self._lane_call(step, layer, keys, values, query, scale)
                if output is not None:
                    return output
            # Every check of the attention first: a refused call writes nothing.
            group, call, keywords = path.attention_call(
                layer, query, scale, causal, features, None, None, step, self._features_served()
            )
            self._writable_at[group] = path.write(
                call[0], self._slots(step, group), keys, values, self._writable_at[group]
            )
            return path.storage.paged_attention(*call, **keywords)

    def _lane(self, step: Step[ArrayT], layer: int) -> tuple[StepLane[Any], int, int, int] | None:
        """The storage's lane for the step's KV-cache group of a plain ``layer`` (prepared at the
        group's first call), with the layer's ``(group, storage layer, head_dim)``; ``None``
        where no lane serves the layer."""
        path, lanes = self._path, self._lanes
        places = path.lane_places
        if lanes is None or type(layer) is not int or not 0 <= layer < len(places):
            return None
        place = places[layer]
        if place is None:
            return None
        group, index, head_dim = place
        lane = lanes[group]
        if lane is None:
            slots = self._slots(step, group)
            made = (
                # path.lanes: the storage is a LaneStorage (checked once, not per step)
                cast(LaneStorage, path.storage).step_lane(step.page_tables[group], slots, step.qo_indptr)
                if len(slots)
                else None
            )
            lanes[group] = lane = False if made is None else made
        return None if lane is False else (lane, group, index, head_dim)

    def _lane_call(
        self, step: Step[ArrayT], layer: int, keys: ArrayT, values: ArrayT, query: ArrayT, scale: float | None
    ) -> ArrayT | None:
        """A plain layer's write and attention through the storage's lane for the step
        (:mod:`kvcache_core.contract.lanes`), the manager's policies kept; ``None`` where no
        lane serves the call (nothing written: the general path then runs)."""
        found = self._lane(step, layer) if type(scale) in _SCALES else None
        if found is None:
            return None
        lane, group, index, head_dim = found
        given, checked = self._scale
        if scale != given or scale is None:
            checked = check_scale(scale, head_dim)
            self._scale = (scale, checked)
        return self._through_lane(step, group, index, lambda: lane(index, keys, values, query, checked))

    def _through_lane(self, step: Step[ArrayT], group: int, index: int, call: Callable[[], _Out | None]) -> _Out | None:
        """``call``, a lane's write into the step's slots of ``group`` (storage layer
        ``index``), between the manager's policies: a slot in a shared block is refused first,
        and what the lane wrote is recorded; ``None`` where the lane declined (nothing written)."""
        path = self._path
        slots = self._slots(step, group)
        epoch = path.writable(slots, self._writable_at[group])  # a shared block is refused first
        output = call()
        if output is not None:
            self._writable_at[group] = epoch
            path.record_written(index, slots)
        return output

    def _padded_place(self, layer: int, width: int | None, layout: str) -> tuple[int, int, int | None]:
        """Under the lock: the step still current, the layer's ``(group, storage layer)`` and
        the checked ``width`` of a padded batch in ``layout``."""
        config = self._path.config
        self._check_current()
        group, index = config.layer_place(layer)
        check_padded_layout(layout)
        return group, index, check_optional_count(width, "width", 0, config.num_blocks * config.block_size)

    def padded_view(
        self, step: Step[ArrayT], layer: int, width: int | None, layout: str
    ) -> tuple[ArrayT, ArrayT] | None:
        path = self._path
        with path.lock:
            group, index, width = self._padded_place(layer, width, layout)
            run = step.page_tables[group].one_run_slots(width)
            return None if run is None else storage_view_padded(path.storage, index, *run, layout)

    def write_and_view(
        self, step: Step[ArrayT], layer: int, keys: ArrayT, values: ArrayT, width: int | None, layout: str
    ) -> tuple[ArrayT, ArrayT] | None:
        path = self._path
        with path.lock:
            group, index, width = self._padded_place(layer, width, layout)  # checked before any write
            found = self._lane(step, layer) if self._lanes is not None else None
            if found is not None:
                lane = found[0]
                shown = self._through_lane(
                    step, group, index, lambda: lane_write_and_view(lane, index, keys, values, width, layout)
                )
                if shown is not None:
                    return shown
            self._writable_at[group] = path.write(
                index, self._slots(step, group), keys, values, self._writable_at[group]
            )
            run = step.page_tables[group].one_run_slots(width)
            return None if run is None else storage_view_padded(path.storage, index, *run, layout)

    def gather_padded(self, step: Step[ArrayT], layer: int, width: int | None, layout: str) -> tuple[ArrayT, ArrayT]:
        path = self._path
        with path.lock:
            group, index, width = self._padded_place(layer, width, layout)
            table = step.page_tables[group]
            slots = self._padded.get((group, width))
            if slots is None:  # planned once per group and width
                slots = self._extended_padded(step, group, width)
                if slots is None:
                    slots = padded_slots(table, width)
                self._padded[group, width] = slots
            return read_padded(path.storage, index, table, slots, layout)

    def _extended_padded(self, step: Step[ArrayT], group: int, width: int | None) -> SlotArray | None:
        """The padded slots of ``group`` at ``width`` from the last step's (see
        ``_padded_before``), or ``None``."""
        before = self._padded_before
        previous = None if before is None else before.get((group, None if width is None else width - 1))
        if previous is None:
            return None
        return padded_slots_after(previous, width, step.page_tables[group], self._slots(step, group))

    def read_state(self, step: Step[ArrayT], layer: int, name: str) -> ArrayT:
        path = self._path
        with path.lock:
            self._check_current()
            return path.read_state(self._states_slots(), layer, name)

    def read_state_view(self, step: Step[ArrayT], layer: int, name: str) -> ArrayT | None:
        path = self._path
        with path.lock:
            self._check_current()
            run = self._state_run
            if run is False:  # found once per step: the step's slots do not change
                run = self._state_run = slot_run(self._states_slots())
            return path.read_state_rows(run, layer, name)

    def write_state(self, step: Step[ArrayT], layer: int, name: str, values: ArrayT) -> None:
        path = self._path
        with path.lock:
            self._check_current()
            path.write_state(self._states_slots(), layer, name, values)

    def checkpoint_states(self, step: Step[ArrayT]) -> int:
        path = self._path
        with path.lock:
            self._check_current()
            return path.checkpoint_states(self._states)

    def advance(self, step: Step[ArrayT], token_ids: object) -> Step[ArrayT]:
        states = self._states
        ids: list[tuple[int, ...] | None] = (
            [None] * len(states) if token_ids is None else step_token_ids(token_ids, [1] * len(states))
        )
        path = self._path
        with path.lock:
            self._check_current()
            return path.advance_step(states, step, self, ids)

    def hand_over(
        self,
        last: Step[ArrayT],
        runner: DataPathRunner[ArrayT],
        step: Step[ArrayT],
        *,
        same_blocks: bool,
        extends: bool = False,
    ) -> None:
        """Hand ``runner`` of ``step``, the decode step after ``last`` (this runner's), what the
        two share: each KV-cache group's lane, advanced (where it cannot be, the storage is
        asked for one as for any step), the last scale checked, and, where every request grew
        inside the blocks it held (``same_blocks``) and had a slot in ``last``, the epoch at
        which the slots were found writable (the new slots lie in the same blocks); where no
        request's earlier token moved (``extends``: grown in place or into a block of its own),
        ``last``'s padded slots, which ``step``'s extend by a column."""
        if extends:
            runner._padded_before = self._padded
        if same_blocks and min(last.new_tokens, default=0) >= 1:
            runner._writable_at[:] = self._writable_at
        runner._scale = self._scale  # the scale the model gives every step: checked once
        lanes, carried = runner._lanes, self._lanes
        if lanes is None or carried is None:
            return
        for group, lane in enumerate(carried):
            if lane is not None and lane is not False:
                slots = runner._slots(step, group)
                lanes[group] = advance_lane(lane, step.page_tables[group], slots, step.qo_indptr)
