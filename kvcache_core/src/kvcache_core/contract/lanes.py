"""Step lanes: a storage's own path for a step's plain layers, prepared once per step.

Inside a model, a decode step calls the same write and attention once per layer with arrays
of one shape; what the manager checks and what the storage looks up are the same for every
layer. A storage that claims :data:`STEP_LANES` has the optional member
``step_lane(page_table, slots, qo_indptr) -> StepLane | None`` (:class:`LaneStorage`): once
per step and KV-cache group, the manager hands it the group's page table, the step's slots
of that group and the query offsets, every one already checked, and the storage prepares
what its layers share (the slots as its own index, the path its attention takes, a kernel's
plan). The manager then runs each plain layer (causal, no per-call window, softcap, sinks or
chunk) of the group through the returned :class:`StepLane`: one call writes the layer's new
K/V into the slots and returns its attention over the pool.

The manager keeps every policy: the staleness of the step, the scale, that no slot is in a
block the prefix cache serves or several requests share, the record of written blocks. The
lane checks only its arrays, cheaply, and declines (``None``) *before writing anything*
whatever it was not prepared for: another shape, dtype or device, a non-contiguous array.
The manager then runs its general, fully checked path, which raises the specific error or
serves the call; so a lane never changes what a call means, only how fast it runs. A storage
may return ``None`` from ``step_lane`` for a step it has no lane for.

A lane may also have the optional member ``advance(page_table, slots, qo_indptr) -> StepLane |
None``: the lane of the next decode step of the same requests
(:meth:`~kvcache_core.step.Step.advance`), each grown by one token (``page_table``, the group's
new table, lists the same pages with lengths one more, and any page appended for a token that
opened a block; ``slots`` and ``qo_indptr`` are the new step's, checked). A lane carries over
what the two steps share (its path, its views of the pool, a kernel's settled call) and
returns ``None`` where it would rather be prepared anew by ``step_lane``. It may return
itself, updated: the last step is stale by then, so the manager never calls its lane again.

A lane may have one more optional member, ``write_and_view(layer, keys, values, positions,
layout) -> (keys, values) | None`` (:class:`ViewLane`): a plain layer's write, then the views
of the pool that :meth:`~kvcache_core.step.Step.padded_view` would return for the last
``positions`` tokens (``None``: all of them) in ``layout`` (``"NHD"`` or ``"HND"``, checked by
the manager), for :meth:`~kvcache_core.step.Step.write_and_view` (transformers' contiguous path
hands a model its K/V so, once per layer). It declines (``None``, nothing written) whatever it
was not prepared for, as the lane's call does, and wherever the step is not one request whose
last ``positions`` tokens are one run of slots (then the manager writes and reads the views on
its general path).
"""

from __future__ import annotations

from typing import Any, Final, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import SlotArray

__all__ = [
    "STEP_LANES",
    "LaneStorage",
    "StepLane",
    "ViewLane",
    "advance_lane",
    "lane_write_and_view",
    "storage_step_lane",
]

#: The capability of a storage whose ``step_lane(...)`` prepares a step's plain layers.
STEP_LANES: Final = "step_lanes"

ArrayT = TypeVar("ArrayT")


class StepLane(Protocol[ArrayT]):
    """One step's lane for one KV-cache group (from :meth:`LaneStorage.step_lane`)."""

    def __call__(self, layer: int, keys: ArrayT, values: ArrayT, query: ArrayT, scale: float) -> ArrayT | None:
        """Write ``keys`` ``[n, num_heads, head_dim]`` and ``values`` ``[n, num_heads,
        value_width]`` into the step's slots of storage layer ``layer``, then return the causal
        attention of ``query`` ``[n, k * num_heads, head_dim]`` over the pool, ``[n, k *
        num_heads, value_width]`` in the query's dtype, as ``write`` then ``paged_attention``
        would (``scale`` checked by the manager).

        Returns ``None``, having written nothing, for arrays the lane was not prepared for.
        """
        ...


class ViewLane(Protocol[ArrayT]):
    """The optional member of a :class:`StepLane` that writes a layer and shows its K/V in place."""

    def write_and_view(
        self, layer: int, keys: ArrayT, values: ArrayT, positions: int | None, layout: str
    ) -> tuple[ArrayT, ArrayT] | None:
        """Write ``keys`` and ``values`` (as the lane's call writes them) into the step's slots of
        storage layer ``layer``, then return the views of the pool that ``Step.padded_view``
        returns for the step's one request's last ``positions`` tokens (``None``: all), in
        ``layout`` (``"NHD"`` ``[1, positions, num_heads, width]`` or ``"HND"`` ``[1,
        num_heads, positions, width]``).

        Returns ``None``, having written nothing, for arrays the lane was not prepared for and
        for any step it cannot show so (several requests, several runs, too many positions).
        """
        ...


@runtime_checkable
class LaneStorage(Protocol):
    """The optional :class:`~kvcache_core.plugin.KvStorage` member of a storage that claims
    :data:`STEP_LANES`."""

    def step_lane(
        self, page_table: PageTable, slots: SlotArray, qo_indptr: npt.NDArray[np.int32]
    ) -> StepLane[Any] | None:
        """A lane for the layers of one step's KV-cache group (``page_table``: the group's;
        ``slots``: the step's slots in that group, read-only; ``qo_indptr``: the step's query
        offsets, read-only), or ``None`` where the storage has none for this step."""
        ...


def storage_step_lane(
    storage: object, page_table: PageTable, slots: SlotArray, qo_indptr: npt.NDArray[np.int32]
) -> StepLane[Any] | None:
    """``storage.step_lane(...)``, or ``None`` when the storage has no such member."""
    if not isinstance(storage, LaneStorage):
        return None
    return storage.step_lane(page_table, slots, qo_indptr)


def advance_lane(
    lane: object, page_table: PageTable, slots: SlotArray, qo_indptr: npt.NDArray[np.int32]
) -> StepLane[Any] | None:
    """``lane.advance(page_table, slots, qo_indptr)``, the lane of the next decode step, or
    ``None`` when the lane has no such member (the storage then prepares one)."""
    advance = getattr(lane, "advance", None)
    if advance is None:
        return None
    return cast("StepLane[Any] | None", advance(page_table, slots, qo_indptr))


def lane_write_and_view(
    lane: object, layer: int, keys: ArrayT, values: ArrayT, positions: int | None, layout: str
) -> tuple[ArrayT, ArrayT] | None:
    """``lane.write_and_view(...)`` (:class:`ViewLane`), or ``None``, nothing written, when the
    lane has no such member."""
    write_and_view = getattr(lane, "write_and_view", None)
    if write_and_view is None:
        return None
    return cast("tuple[ArrayT, ArrayT] | None", write_and_view(layer, keys, values, positions, layout))
