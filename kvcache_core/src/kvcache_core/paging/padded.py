"""A step's K/V of one layer as one padded batch (:meth:`Step.gather_padded
<kvcache_core.step.Step.gather_padded>`; the contract: :mod:`kvcache_core.contract.padded`).

:func:`padded_slots` finds where every position of the batch lives, from a page table:
request ``b`` of ``n`` listed tokens fills the last ``min(width, n)`` positions of its row
with its last tokens, the positions before are padding (slot ``-1``). :func:`read_padded`
hands the slots to the storage's one-pass read, or gathers request by request
(``KvStorage.gather``) and pads with the storage's Array API namespace, which gives the same
arrays on any backend, mutable or not.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from kvcache_core.contract.padded import PADDED_LAYOUTS, storage_gather_padded
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvStorage, SlotArray
from kvcache_core.errors import InvalidArgumentError

__all__ = ["check_padded_layout", "padded_slots", "read_padded"]

ArrayT = TypeVar("ArrayT")


def check_padded_layout(layout: object) -> str:
    """``layout`` if it is one of :data:`~kvcache_core.contract.padded.PADDED_LAYOUTS`.

    Raises:
        InvalidArgumentError: anything else, naming the valid ones.
    """
    if type(layout) is not str or layout not in PADDED_LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {', '.join(map(repr, PADDED_LAYOUTS))}, got {layout!r}")
    return layout


def padded_slots(table: PageTable, width: int | None) -> SlotArray:
    """``[batch, width]`` int64 pool slots (read-only) of every request's last ``min(width,
    n)`` tokens, ``n`` those ``table`` lists for it, ending its row; ``-1`` before them.
    ``width`` ``None``: the longest request's ``n``."""
    lengths = table.seq_lens.astype(np.int64)
    batch = int(lengths.shape[0])
    columns = (int(lengths.max()) if batch else 0) if width is None else width
    slots = np.full((batch, columns), -1, dtype=np.int64)
    if batch and columns:
        position = np.arange(columns, dtype=np.int64)[None, :]
        token = position - (columns - lengths)[:, None]  # the request's token at each position
        held = token >= 0
        token = np.where(held, token, 0)
        block_size = table.block_size
        tables = table.block_tables.astype(np.int64)
        if tables.shape[1]:
            blocks = np.take_along_axis(tables, token // block_size, axis=1)
            slots = np.where(held, blocks * block_size + token % block_size, -1)
    slots.flags.writeable = False
    frozen: SlotArray = slots.view()  # a view of a read-only base: nobody can make it writeable again
    return frozen


def padded_slots_after(
    previous: SlotArray, width: int | None, table: PageTable, new_slots: SlotArray
) -> SlotArray | None:
    """:func:`padded_slots` of ``table`` at ``width`` for the decode step after the one whose
    array at the width one less (``None``: ``None``) was ``previous``, found from it: that
    array with the step's new slots (``new_slots``, one per request) as one more column. A
    request's last ``w`` tokens of ``n`` are its last ``w - 1`` of ``n - 1`` and the new one, at
    the same place (as many padding positions before them), whether or not they are all of
    its tokens. Only the caller knows that the step grew each request by one token and moved
    none of its earlier ones (grown in place or into a block of its own); this checks the
    rest (the table has no window, one new slot per request, the longest request one token
    longer at width ``None``), else ``None`` (then :func:`padded_slots` finds it)."""
    batch, columns = (int(size) for size in previous.shape)
    lengths = table.seq_lens
    if table.sliding_window is not None or new_slots.shape != (batch,) or int(lengths.shape[0]) != batch:
        return None
    if width is None and batch and int(lengths.max()) != columns + 1:
        return None
    grown = np.empty((batch, columns + 1), dtype=np.int64)
    grown[:, :columns] = previous
    grown[:, columns] = new_slots
    grown.flags.writeable = False
    frozen: SlotArray = grown.view()  # as padded_slots gives it
    return frozen


def read_padded(
    storage: KvStorage[ArrayT], layer: int, table: PageTable, slots: SlotArray, layout: str
) -> tuple[ArrayT, ArrayT]:
    """The keys and values at ``slots`` (from :func:`padded_slots` of ``table``) of storage
    layer ``layer``, zeros at padding, in ``layout``: the storage's own read where it has
    one, else request by request."""
    read = storage_gather_padded(storage, layer, slots, layout)
    if read is not None:
        keys, values = read
        return keys, values
    xp = storage.array_namespace()
    columns = int(slots.shape[1])
    if not slots.shape[0]:  # no request: an empty batch of the layer's geometry and dtype
        empty: tuple[Any, Any] = storage.gather(layer, np.zeros(0, dtype=np.int64), 0)  # Array API arrays
        keys, values = (xp.reshape(array, (0, columns, *(int(size) for size in array.shape[1:]))) for array in empty)
        return _laid_out(xp, keys, layout), _laid_out(xp, values, layout)
    parts: tuple[list[Any], list[Any]] = ([], [])
    block_size = table.block_size
    for request, tokens in enumerate(table.seq_lens.tolist()):
        used = -(-tokens // block_size)
        blocks = np.asarray(table.block_tables[request, :used], dtype=np.int64)
        gathered: tuple[Any, Any] = storage.gather(layer, blocks, tokens)  # Array API arrays
        taken = min(columns, tokens)
        for rows, array in zip(parts, gathered, strict=True):
            kept = array[tokens - taken :]
            if taken < columns:
                shape = (columns - taken, *(int(size) for size in array.shape[1:]))
                padding = xp.astype(storage.from_numpy(np.zeros(shape, dtype=np.float32)), array.dtype)
                kept = xp.concat([padding, kept], axis=0)
            rows.append(kept)
    keys, values = (_laid_out(xp, xp.stack(rows, axis=0), layout) for rows in parts)
    return keys, values


def _laid_out(xp: Any, batch: Any, layout: str) -> Any:
    """A ``[batch, positions, heads, dim]`` batch in ``layout``."""
    return batch if layout == "NHD" else xp.permute_dims(batch, (0, 2, 1, 3))
