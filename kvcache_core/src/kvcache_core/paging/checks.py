"""The manager's argument checks: slots, arrays, page tables and step arguments.

Every check raises a specific :class:`~kvcache_core.errors.KvCacheError` subclass naming
the bad value and what is valid, and changes nothing: the manager calls them before it
changes any state.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.attention.features import check_finite_logits
from kvcache_core.contract.config import check_count, check_token_ids
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvStorage, SlotArray, SlotsLike
from kvcache_core.contract.scalars import shown
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    InvalidTypeError,
    ShapeMismatchError,
    SharedBlockWriteError,
    SlotError,
    StalePageTableError,
    SwappedOutError,
)
from kvcache_core.paging.block_pool import BlockPool, blocks_for
from kvcache_core.paging.request_state import RequestState

__all__ = ["ArgumentChecks", "check_handle_sequence", "step_counts", "step_token_ids"]


def check_handle_sequence(handles: object, what: str) -> None:
    """Refuse anything but a sequence (list, tuple) of handles."""
    if isinstance(handles, (str, bytes)) or not isinstance(handles, Sequence):
        raise InvalidTypeError(f"{what} takes a sequence (list or tuple) of handles, got {type(handles).__name__}")


def step_counts(new_tokens: object, batch: int) -> list[int]:
    """``begin_step``'s ``new_tokens``: one int >= 0 per request, or one for all."""
    if isinstance(new_tokens, Sequence) and not isinstance(new_tokens, (str, bytes)):
        counts: list[object] = list(cast("Sequence[object]", new_tokens))
        if len(counts) != batch:
            raise InvalidArgumentError(f"new_tokens gives {len(counts)} counts for {batch} requests")
        return [check_count(count, f"new_tokens[{index}]") for index, count in enumerate(counts)]
    if isinstance(new_tokens, np.ndarray):
        return step_counts(cast("npt.NDArray[Any]", new_tokens).tolist(), batch)
    return [check_count(new_tokens, "new_tokens")] * batch


def step_token_ids(token_ids: object, counts: list[int]) -> list[tuple[int, ...] | None]:
    """``begin_step``'s ``token_ids``: per request its new tokens' ids, or ``None``."""
    if token_ids is None:
        return [None] * len(counts)
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidArgumentError(
            f"token_ids must be a sequence of one id list (or None) per request, got {shown(token_ids)}"
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


class ArgumentChecks:
    """Checks of what callers hand the manager, against its pool and requests."""

    def __init__(self, pool: BlockPool, storage: KvStorage[Any], requests: Mapping[str, RequestState[Any]]) -> None:
        self.pool = pool
        self.storage = storage
        self.requests = requests
        self.config = pool.config
        self._io_dtype = pool.config.io_dtype  # what arrays must hold (the config is frozen)
        # Tables this manager issued (read-only: their blocks are the requests' own).
        self.issued_tables: weakref.WeakSet[PageTable] = weakref.WeakSet()
        self._checked: tuple[PageTable, int] | None = None

    # -- slots and blocks --------------------------------------------------------------

    def slots(self, slots: SlotsLike, group: int = 0) -> SlotArray:
        """Distinct slots of blocks in use of KV-cache group ``group``, at positions
        already handed out; with groups, the group's row of ``[num_groups, n]`` slots."""
        array = np.asarray(slots)
        groups = self.config.num_groups
        if groups > 1 and array.ndim == 2 and array.shape[0] == groups:
            array = array[group]
        if array.ndim != 1:
            shapes = "[n]" if groups == 1 else f"[n] or [{groups}, n] (one row per KV-cache group)"
            raise ShapeMismatchError(f"slots must be {shapes}, got shape {array.shape}")
        if array.size and array.dtype.kind not in "iu":
            raise InvalidTypeError(f"slots must be integers, got dtype {array.dtype}")
        block_size = self.config.block_size
        total = self.config.num_blocks * block_size
        if array.size:
            low, high = int(array.min()), int(array.max())  # before any cast: uint64 stays exact
            if low < 0 or high >= total:
                bad = low if low < 0 else high
                raise SlotError(f"slot {bad} is outside the pool: valid slots are 0 to {total - 1}")
        array = array.astype(np.int64, copy=False)
        if array.size:
            self.blocks_in_use(array // block_size, "slot")
            issued = self.pool.issued[array]
            if not issued.all():
                slot = int(array[np.argmin(issued)])
                raise SlotError(
                    f"slot {slot} (block {slot // block_size}, offset {slot % block_size}) is reserved but its "
                    "position was not handed out: write only slots returned by extend() or writable_slots()"
                )
            if np.unique(array).size != array.size:
                values, counts = np.unique(array, return_counts=True)
                raise SlotError(f"slot {int(values[counts > 1][0])} appears more than once in one write")
            if groups > 1:
                other = self.pool.group_of[array // block_size] != group
                if other.any():
                    slot = int(array[np.argmax(other)])
                    raise SlotError(
                        f"slot {slot} is in block {slot // block_size} of KV-cache group "
                        f"{int(self.pool.group_of[slot // block_size])}; this layer is in group {group}: "
                        f"write row {group} of the slots extend() returned"
                    )
        return array

    def blocks_in_use(self, blocks: npt.NDArray[np.int64], what: str) -> None:
        if not blocks.size:
            return
        low, high = int(blocks.min()), int(blocks.max())
        if low < 0 or high >= self.config.num_blocks:
            raise SlotError(
                f"{what} names block {low if low < 0 else high}: valid blocks are 0 to {self.config.num_blocks - 1}"
            )
        in_use = self.pool.allocator.in_use_mask()[blocks]
        if not in_use.all():
            block = int(blocks[np.argmin(in_use)])
            owner = self.pool.swapped_blocks.get(block)
            if owner is not None:
                raise SwappedOutError(
                    f"{what} points into block {block}, which request {owner!r} gave up when it was swapped "
                    "out: swap_in brings it back, with new slots"
                )
            raise SlotError(f"{what} points into block {block}, which no live request owns")

    def writable(self, slots: SlotArray) -> None:
        """Refuse slots in blocks several requests share or the prefix cache serves."""
        pool = self.pool
        block_size = self.config.block_size
        blocks = slots // block_size
        if pool.allocator.shared_block_count():
            shared = pool.allocator.shared_mask()[blocks]
            if shared.any():
                slot = int(slots[np.argmax(shared)])
                block = slot // block_size
                sharers = [
                    rid
                    for rid, state in self.requests.items()
                    if any(block in table.physical_blocks for table in state.tables)
                ]
                raise SharedBlockWriteError(
                    f"slot {slot} is in block {block}, shared by {pool.allocator.ref_count(block)} requests "
                    f"{sharers}: a write there would change all of them; take private slots from extend() or "
                    "writable_slots(), which copy the block first"
                )
        if pool.prefix is not None:
            registered = pool.registered[blocks]
            if registered.any():
                slot = int(slots[np.argmax(registered)])
                raise SharedBlockWriteError(
                    f"slot {slot} is in block {slot // block_size}, which the prefix cache serves to every "
                    "request with the same prompt: take slots from writable_slots() to rewrite it (it leaves "
                    "the prefix cache first)"
                )

    # -- arrays ------------------------------------------------------------------------

    def array_info(self, name: str, array: object) -> tuple[tuple[int, ...], str]:
        try:
            shape, dtype = self.storage.array_info(array)
        except TypeError as exc:
            raise ArrayTypeError(f"{name}: {exc}") from exc
        return tuple(shape), dtype

    def query(self, query: object, heads: int | None = None, dim: int | None = None) -> tuple[int, ...]:
        """The shape of a query ``[tokens, k * num_heads, head_dim]`` of the pool's dtype
        (``heads`` and ``dim``: a layer's own geometry, by default the pool's)."""
        shape, dtype = self.array_info("query", query)
        heads = self.config.num_heads if heads is None else heads
        dim = self.config.head_dim if dim is None else dim
        if len(shape) != 3 or shape[2] != dim or shape[1] < heads or shape[1] % heads:
            raise ShapeMismatchError(
                f"query must be [tokens, k * {heads}, {dim}] (k >= 1 query heads per KV head), got {shape}"
            )
        if dtype != self._io_dtype:  # issue 14: a quantized pool computes in its io_dtype
            raise DTypeMismatchError(f"query has dtype {dtype}, the pool computes in {self._io_dtype}")
        return shape

    def array(self, name: str, array: object, expected: tuple[int, ...], *, finite: bool = False) -> None:
        """A native array of shape ``expected`` in the pool's compute dtype; with ``finite``
        (small arrays: ``sinks``) also every value finite, read through a host copy."""
        shape, dtype = self.array_info(name, array)
        if shape != expected:
            width = "value_width" if name == "values" and self.config.value_head_dim is not None else "head_dim"
            what = f" ([n, num_heads, {width}])" if len(expected) == 3 else ""
            raise ShapeMismatchError(f"{name} must have shape {expected}{what}, got {shape}")
        if dtype != self._io_dtype:  # a quantized pool computes in its io_dtype
            raise DTypeMismatchError(f"{name} has dtype {dtype}, the pool computes in {self._io_dtype}")
        if finite:
            check_finite_logits(name, np.asarray(self.storage.to_numpy(array)))

    # -- page tables -------------------------------------------------------------------

    def issue(self, table: PageTable) -> PageTable:
        """Record a table this manager built from its requests' own blocks."""
        self.issued_tables.add(table)
        self._checked = (table, self.pool.epoch)
        return table

    def page_table(self, page_table: object) -> PageTable:
        """A page table this pool can read now (checked at most once per ownership epoch)."""
        if not isinstance(page_table, PageTable):
            raise InvalidTypeError(f"page_table must be a PageTable, got {type(page_table).__name__}")
        config = self.config
        if page_table.block_size != config.block_size:
            raise InvalidArgumentError(
                f"page table block_size {page_table.block_size} != pool block_size {config.block_size}"
            )
        if not page_table.group < config.num_groups:
            raise InvalidArgumentError(
                f"page table of KV-cache group {page_table.group}: the pool has groups 0 to {config.num_groups - 1}"
            )
        window = config.kv_groups[page_table.group].window
        if page_table.sliding_window != window:
            whose = "the pool's" if config.num_groups == 1 else f"KV-cache group {page_table.group}'s"
            raise InvalidArgumentError(
                f"page table sliding_window {page_table.sliding_window} != {whose} sliding_window {window}; "
                "take the page table from manager.page_table"
            )
        if self._checked != (page_table, self.pool.epoch):
            self._current(page_table)
            self._checked = (page_table, self.pool.epoch)
        return page_table

    def _current(self, page_table: PageTable) -> None:
        """Refuse a page table that may read blocks its requests no longer own.

        A table with generations (taken from a manager) must list live, resident
        requests of this manager at the generations it recorded; one this manager did not
        issue must also list exactly their held blocks. A table without generations (built
        by hand) must name blocks in use.
        """
        if not page_table.generations:
            blocks = page_table.kv_indices.astype(np.int64)
            self.blocks_in_use(blocks, "page table")
            other = self.pool.group_of[blocks] != page_table.group
            if self.config.num_groups > 1 and other.any():
                block = int(blocks[np.argmax(other)])
                raise SlotError(
                    f"the page table of KV-cache group {page_table.group} names block {block} of group "
                    f"{int(self.pool.group_of[block])}"
                )
            return
        issued = page_table in self.issued_tables
        for index, (request_id, generation) in enumerate(
            zip(page_table.request_ids, page_table.generations, strict=True)
        ):
            state = self.requests.get(request_id)
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
                table = state.tables[page_table.group]
                held = table.physical_blocks[: blocks_for(table.held_tokens(), self.config.block_size)]
                if page_table.blocks(index).tolist() != list(held):
                    raise StalePageTableError(
                        f"the page table lists blocks {page_table.blocks(index).tolist()} for request "
                        f"{request_id!r}, which holds {list(held)}: take page tables from manager.page_table"
                    )
