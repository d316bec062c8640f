"""Growth inside the blocks requests already fill: the decode step's common case.

A request whose new tokens land in the block of its last token takes no block, copies
nothing and releases nothing, so most of what :meth:`SequenceBlocks.plan_growth` and
:meth:`SequenceBlocks.grow_all` work out is known in advance. :func:`plan_in_place` picks
the requests of a batch that grow so, and :func:`grow_in_place` grows them with a few
operations per request and one array update for the batch, with the same effect on tables,
slots, token ids and the prefix cache as the general path, which grows the others.

In a pool without prefix caching, a request whose new tokens open exactly one block (a
decode step of a batch, one request in a block's worth of steps) is as simple: it takes one
free block, placed as the general path places it, and nothing is hashed or looked up.
:func:`plan_openings` picks those of a decode step and :func:`grow_opening` grows them
beside the requests growing in place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvcache_core.paging.request_state import RequestState
from kvcache_core.paging.sequences import SequenceBlocks

__all__ = ["InPlace", "grow_in_place", "grow_opening", "plan_in_place", "plan_openings"]


class InPlace(NamedTuple):
    """The requests of a batch that grow in place, checked (nothing changed yet)."""

    rows: list[int]  # their indexes in the batch, ascending
    firsts: list[int]  # per row, its first new slot
    new_ids: list[tuple[int, ...]]  # per row, its token ids not known before


def plan_in_place(
    blocks: SequenceBlocks,
    states: Sequence[RequestState[Any]],
    counts: Sequence[int],
    ids: Sequence[tuple[int, ...] | None],
) -> InPlace | None:
    """The requests whose ``counts`` (>= 1) new tokens fall in the block holding their last
    token: one KV-cache group without a window, the block held by the request alone, its
    ``max_sequence_length`` not passed, its ``ids`` agreeing with the known ones. The others
    (and any that would raise) are left to the general path. ``None``: the pool's groups or
    window rule growth in place out for every request. Changes nothing."""
    if len(blocks.windows) != 1 or blocks.windows[0] is not None:
        return None
    size = blocks.block_size
    shared = blocks.pool.allocator.shared_block_count() > 0
    ref_count = blocks.pool.allocator.ref_count
    prefix = blocks.pool.prefix is not None
    plan = InPlace([], [], [])
    for row, (state, count, request_ids) in enumerate(zip(states, counts, ids, strict=True)):
        table = state.tables[0]
        old = table.sequence_length
        offset = old % size
        if count < 1 or offset == 0 or offset + count > size:  # a new block: the general path
            continue
        if state.max_sequence_length is not None and old + count > state.max_sequence_length:
            continue
        block = table.physical_block(old // size)
        if shared and ref_count(block) > 1:  # copy-on-write first
            continue
        known = state.token_ids
        if request_ids is not None and prefix:
            if old > len(known) or any(given != was for given, was in zip(request_ids, known[old:], strict=False)):
                continue  # ids missing before, or disagreeing: the general path names them
            plan.new_ids.append(request_ids[len(known) - old :])
        else:
            plan.new_ids.append(())
        plan.rows.append(row)
        plan.firsts.append(block * size + offset)
    return plan


def grow_in_place(
    blocks: SequenceBlocks, states: Sequence[RequestState[Any]], counts: Sequence[int], plan: InPlace
) -> npt.NDArray[np.int64]:
    """Carry out ``plan`` (of the same ``states`` and ``counts``, nothing changed since;
    nothing here fails): grow its requests, hand out their new slots and keep the prefix
    chains in step, as :meth:`SequenceBlocks.grow_all` does. Returns the new slots, row
    after row."""
    pool, chains = blocks.pool, blocks.chains
    prefix = pool.prefix is not None
    grown = [(states[row], counts[row]) for row in plan.rows]
    if all(count == 1 for _, count in grown):
        slots = np.array(plan.firsts, dtype=np.int64)
    else:
        slots = np.concatenate(
            [
                np.arange(first, first + count, dtype=np.int64)
                for first, (_, count) in zip(plan.firsts, grown, strict=True)
            ]
        )
    for state, count in grown:
        table = state.tables[0]
        if prefix:  # a block truncated into may still be cached: it leaves before new tokens go in
            chains.unregister_rewritten(state, table.sequence_length, table.sequence_length + count)
        table.extend_sequence(count)
    pool.issued[slots] = True
    if pool.written is not None:
        pool.written[:, slots] = False  # handed out anew: nothing of these requests is there yet
    now = time.monotonic()
    for (state, _), new_ids in zip(grown, plan.new_ids, strict=True):
        if new_ids:
            state.token_ids.extend(new_ids)
        pool.replanned(state)
        if prefix:
            chains.advance(state)
        state.last_access = now
    return slots


def plan_openings(
    blocks: SequenceBlocks,
    states: Sequence[RequestState[Any]],
    counts: Sequence[int],
    ids: Sequence[tuple[int, ...] | None],
    in_place: InPlace,
) -> list[int] | None:
    """The rows of a decode step (``counts`` all 1), besides those ``in_place`` grows (its plan
    for these arguments), whose new token opens a block they do not hold yet, in a pool without prefix
    caching, given no token ids, within their ``max_sequence_length``; ``[]`` when every row
    grows in place. ``None`` (the general path grows the batch) where any other row is left
    or the free blocks do not cover one each. Changes nothing."""
    if len(in_place.rows) == len(states):
        return []
    pool = blocks.pool
    if pool.prefix is not None:
        return None
    size, placed = blocks.block_size, set(in_place.rows)
    rows: list[int] = []
    for row, (state, count, row_ids) in enumerate(zip(states, counts, ids, strict=True)):
        if row in placed:
            continue
        table = state.tables[0]
        old = table.sequence_length
        if row_ids is not None or count != 1 or old % size:
            return None
        if table.first_logical + table.num_blocks() != old // size:  # the block is held already
            return None
        if state.max_sequence_length is not None and old + count > state.max_sequence_length:
            return None
        rows.append(row)
    return rows if len(rows) <= pool.allocator.free_block_count() else None


def grow_opening(
    blocks: SequenceBlocks,
    states: Sequence[RequestState[Any]],
    counts: Sequence[int],
    in_place: InPlace,
    opening: list[int],
) -> npt.NDArray[np.int64]:
    """Carry out a decode step (``counts`` all 1) whose rows grow ``in_place`` or open a block
    (``opening``, from :func:`plan_openings` for the same arguments, nothing changed since):
    each opening row takes one free block in row order, placed after its last block with its
    expected blocks as the general path places them, then every row grows. All or nothing:
    whatever interrupts the taking gives every block taken back. Returns the slots, one per row."""
    pool = blocks.pool
    taken: list[int] = []
    try:
        for row in opening:
            state = states[row]
            table = state.tables[0]
            held = table.num_blocks()
            after = pool.sole_holder(table.physical_block(table.first_logical + held - 1) if held else None)
            expected = blocks.expected_blocks(state.max_sequence_length, table.first_logical + held)
            taken += pool.take(1, after, expected, f"cannot extend request {state.request_id!r} by 1 token")
    except BaseException:
        if taken:
            pool.allocator.release(taken[::-1], taken[-1])
        raise
    slots = np.empty(len(states), dtype=np.int64)
    size, now = blocks.block_size, time.monotonic()
    for row, block in zip(opening, taken, strict=True):
        state = states[row]
        table = state.tables[0]
        table.add_blocks((block,))
        table.extend_sequence(counts[row])
        slots[row] = block * size
        pool.replanned(state)
        state.last_access = now
    opened = slots[opening]
    pool.issued[opened] = True
    if pool.written is not None:
        pool.written[:, opened] = False  # handed out anew: nothing of these requests is there yet
    if in_place.rows:
        slots[in_place.rows] = grow_in_place(blocks, states, counts, in_place)
    return slots
