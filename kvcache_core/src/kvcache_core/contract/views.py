"""The optional storage member that writes part of each row of a pool: a layer viewing a page
side by side with others (:class:`~kvcache_core.contract.groups.ViewPlace`, Gemma 4's sliding
layers two to a page of its full layers' width, :mod:`kvcache_core.backends.layered`).

A storage without it still serves such pools: the layered storage then reads the rows it writes
(``gather`` of their blocks), puts the view's part in and writes whole rows, several array
operations a layer where one indexed copy would do.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from kvcache_core.contract.groups import ViewPlace
from kvcache_core.contract.protocols import SlotArray

__all__ = ["ViewWriteStorage", "storage_write_view"]


@runtime_checkable
class ViewWriteStorage(Protocol):
    """The optional :class:`~kvcache_core.plugin.KvStorage` member that scatters into a part
    of each row."""

    def write_view(self, layer: int, slots: SlotArray, keys: Any, values: Any, place: ViewPlace) -> None:
        """Scatter ``[n, h, d]`` keys and ``[n, h, dv]`` values into distinct ``slots`` of
        storage layer ``layer``, into heads ``place.head`` to ``place.head + h``, key features
        ``place.key`` to ``place.key + d`` and value features ``place.value`` to ``place.value
        + dv`` of each slot's row (all checked to lie inside the row, the arrays of the
        pool's dtype); the rest of each row stays as it was. Called for unquantized pools
        only."""
        ...


def storage_write_view(storage: object, layer: int, slots: SlotArray, keys: Any, values: Any, place: ViewPlace) -> bool:
    """``storage.write_view(...)`` and ``True``, or ``False`` having written nothing when the
    storage has no such member (looked up as an attribute: this runs once per layer)."""
    write: Any = getattr(storage, "write_view", None)
    if write is None:
        return False
    write(layer, slots, keys, values, place)
    return True
