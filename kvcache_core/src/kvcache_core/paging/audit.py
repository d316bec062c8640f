"""The invariant audit: every record of a manager checked against every other.

:func:`audit` is what ``PagedKvCacheManager.check_invariants`` runs; the conformance kit's
state machines call it after every step. It changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvcache_core.errors import InvariantError
from kvcache_core.paging.block_pool import BlockPool, blocks_for
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.prefix import same_prefix
from kvcache_core.paging.request_state import RequestState
from kvcache_core.paging.sequences import SequenceBlocks
from kvcache_core.paging.state_slots import check_state_slots

__all__ = ["audit"]


def audit(sequences: SequenceBlocks, requests: Mapping[str, RequestState[Any]]) -> None:
    """Verify the records of the manager whose pool, chains and requests these are.

    Every block is free, in use or cached, and ``free + used + cached == total``;
    reference counts equal the number of resident requests holding each block (none
    listed twice in one table); the in-use and shared masks and the free extents agree;
    every cached block holds a registered prefix and every registered block is in use or
    cached, fully written and hashed from its entry's parent and tokens; swapped-out
    requests hold no block and their host copies have the right shape; the blocks awaited
    by hash chains are held by the requests awaiting them. With KV-cache groups, every
    request's tables are of one length, each block is of the group whose table holds it,
    and a sliding group keeps no block its window left behind nor drops one it sees. With
    recurrent-state layers, each resident request holds its own state slot, a swapped-out
    one holds host copies instead, and no other slot is taken.

    Raises:
        InvariantError: naming the first inconsistency found.
    """
    _check_blocks(sequences.pool, requests)
    _check_prefix(sequences.pool, sequences.chains, requests)
    _check_requests(sequences, requests)
    check_state_slots(sequences.pool.states, requests)


def _check_blocks(pool: BlockPool, requests: Mapping[str, RequestState[Any]]) -> None:
    config = pool.config
    allocator = pool.allocator
    num_blocks = config.num_blocks
    owners = np.zeros(num_blocks, dtype=np.int64)
    for state in requests.values():
        if len(state.tables) != config.num_groups:
            raise InvariantError(f"request {state.request_id!r} has {len(state.tables)} tables, not one per group")
        for group, table in enumerate(state.tables):
            blocks = table.physical_blocks
            if len(set(blocks)) != len(blocks):
                raise InvariantError(f"request {state.request_id!r} lists a block twice: {blocks}")
            if table.sequence_length > table.capacity():
                raise InvariantError(f"request {state.request_id!r} holds more tokens than its blocks")
            if table.sequence_length != state.table.sequence_length:
                raise InvariantError(f"request {state.request_id!r}: group {group} holds another length")
            array = np.asarray(blocks, dtype=np.int64)
            if np.any(pool.group_of[array] != group):
                raise InvariantError(f"request {state.request_id!r}: group {group} holds a block of another group")
            np.add.at(owners, array, 1)
    counts = np.asarray([allocator.ref_count(b) for b in range(num_blocks)])
    wrong = np.flatnonzero(owners != counts)
    if wrong.size:
        b = int(wrong[0])
        raise InvariantError(f"block {b} has reference count {int(counts[b])} but {int(owners[b])} owners")
    if not np.array_equal(allocator.shared_mask(), owners > 1):
        raise InvariantError("the shared mask disagrees with the owners")
    if allocator.shared_block_count() != int(np.count_nonzero(owners > 1)):
        raise InvariantError("the shared block count disagrees with the owners")
    free, used, cached = allocator.free_block_count(), allocator.used_block_count(), allocator.cached_block_count()
    if free + used + cached != num_blocks or used != int(np.count_nonzero(owners)):
        raise InvariantError(
            f"free {free} + used {used} + cached {cached} != total {num_blocks}, "
            f"or {int(np.count_nonzero(owners))} blocks are owned"
        )
    if not np.array_equal(allocator.in_use_mask(), owners > 0):
        raise InvariantError("the in-use mask disagrees with the owners")
    free_list, cached_list = allocator.free_blocks(), allocator.cached_blocks()
    if len(set(free_list) | set(cached_list)) != free + cached or np.any(owners[free_list + cached_list] > 0):
        raise InvariantError("a block is both free and cached, or free/cached and owned")
    if allocator.placement == "contiguous":
        extents = allocator.free_extents()
        extent_blocks = sum(end - start for start, end in extents)
        covered = {block for start, end in extents for block in range(start, end)}
        if extent_blocks != free or covered != set(free_list):
            raise InvariantError(f"free extents cover {extent_blocks} blocks, {free} are free")
    for block, request_id in pool.swapped_blocks.items():
        swapped = requests.get(request_id)
        if swapped is None or swapped.swap is None or allocator.in_use_mask()[block]:
            raise InvariantError(f"block {block} is recorded as released by swapped-out {request_id!r}")


def _check_prefix(pool: BlockPool, chains: PrefixChains, requests: Mapping[str, RequestState[Any]]) -> None:
    config = pool.config
    prefix = pool.prefix
    allocator = pool.allocator
    if prefix is None:
        if allocator.cached_block_count() or chains.awaiting:
            raise InvariantError("cached blocks or awaited blocks without prefix caching")
        return
    for block in allocator.cached_blocks():
        if not prefix.is_registered(block):
            raise InvariantError(f"cached block {block} holds no registered prefix")
    registered = 0
    for entry in prefix.entries():
        if not entry.alive or not entry.blocks or prefix.get(entry.block_hash) is not entry:
            raise InvariantError(f"{entry!r} is mapped but dead or empty")
        if prefix.rehash(entry) != entry.block_hash:
            raise InvariantError(f"{entry!r} does not hash to its key")
        if len(entry.token_ids) != config.block_size:
            raise InvariantError(f"{entry!r} holds {len(entry.token_ids)} token ids, not a full block")
        for block in entry.blocks:
            registered += 1
            if prefix.entry_of(block) is not entry:
                raise InvariantError(f"block {block} is listed by {entry!r} but registered elsewhere")
            if allocator.is_free(block):
                raise InvariantError(f"registered block {block} is free")
            if not pool.fully_written(block):
                raise InvariantError(f"registered block {block} is not fully written")
    if registered != len(prefix):
        raise InvariantError(f"{len(prefix)} blocks registered, entries list {registered}")
    if int(np.count_nonzero(pool.registered)) != registered or not all(
        prefix.is_registered(block) for block in np.flatnonzero(pool.registered).tolist()
    ):
        raise InvariantError("the registered-block mask disagrees with the prefix cache")
    for block, waiting in chains.awaiting.items():
        if not waiting or not chains.awaiting_mask[block]:
            raise InvariantError(f"block {block} is awaited by nobody or unmarked")
        for request_id in waiting:
            state = requests.get(request_id)
            if (
                state is None
                or state.awaiting_block != block
                or not any(block in table.physical_blocks for table in state.tables)
            ):
                raise InvariantError(f"request {request_id!r} awaits block {block} it does not hold")
    if int(np.count_nonzero(chains.awaiting_mask)) != len(chains.awaiting):
        raise InvariantError("the awaited-block mask disagrees with the awaited blocks")


def _check_requests(sequences: SequenceBlocks, requests: Mapping[str, RequestState[Any]]) -> None:
    pool = sequences.pool
    config = pool.config
    block_size = config.block_size
    for state in requests.values():
        table = state.table
        if not state.valid:
            raise InvariantError(f"request {state.request_id!r} is live but invalid")
        record = state.swap
        if record is not None:
            expected: tuple[int, ...] = (
                config.pool_layers,
                record.num_blocks,
                block_size,
                config.num_heads,
                config.head_dim,
            )
            expected_values: tuple[int, ...] = (*expected[:4], config.value_width)
            if config.mixed_geometry:  # the packed host form (backends/layered.py)
                expected = (record.num_blocks, config.packed_block_elements())
                expected_values = (record.num_blocks, config.packed_block_elements("values"))
            if any(t.num_blocks() or t.sequence_length for t in state.tables) or state.awaiting_block is not None:
                raise InvariantError(f"swapped-out request {state.request_id!r} holds blocks")
            if tuple(record.keys.shape) != expected or tuple(record.values.shape) != expected_values:
                raise InvariantError(f"swapped-out request {state.request_id!r} has host copies of the wrong shape")
            firsts = record.first_logicals or (record.first_logical,)
            needed = sum(blocks_for(record.sequence_length, block_size) - first for first in firsts)
            if record.num_blocks != needed or sum(record.group_blocks or (needed,)) != needed:
                raise InvariantError(f"swapped-out request {state.request_id!r} keeps the wrong number of blocks")
            continue
        _check_windows(sequences, state)
        if pool.prefix is None:
            continue
        if len(state.chain) * block_size > min(table.sequence_length, len(state.token_ids)):
            raise InvariantError(f"request {state.request_id!r} hashed blocks it has not filled")
        for logical, entry in enumerate(state.chain):
            tokens = tuple(state.token_ids[logical * block_size : (logical + 1) * block_size])
            parent = state.chain[logical - 1] if logical else None
            if entry.token_ids != tokens or entry.salt != state.salt or not same_prefix(entry.parent, parent):
                raise InvariantError(f"request {state.request_id!r}: chain entry {logical} is not its prefix")
            for group in state.tables:
                if logical < group.first_logical:
                    continue
                block = group.physical_block(logical)
                if not entry.alive or pool.prefix.entry_of(block) is not entry:
                    raise InvariantError(
                        f"request {state.request_id!r}: hashed block {block} is not registered under its entry"
                    )


def _check_windows(sequences: SequenceBlocks, state: RequestState[Any]) -> None:
    """A full group released nothing; a sliding group released no block its window
    still sees."""
    for group, (table, window) in enumerate(zip(state.tables, sequences.windows, strict=True)):
        if window is None:
            if table.first_logical:
                raise InvariantError(f"request {state.request_id!r}: full group {group} released blocks")
            continue
        if table.first_logical > sequences.window_start(table.sequence_length, group):
            raise InvariantError(f"request {state.request_id!r} released blocks inside its window (group {group})")
