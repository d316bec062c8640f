"""The per-request block policy: what allocating, growing and shortening a request takes.

Plans are worked out without changing anything (``plan_allocation``, ``plan_growth``), so
the manager can refuse a request whole; carrying a plan out (``grow``, ``truncate``) then
copies shared blocks (copy-on-write), releases blocks a sliding window passed, takes new
blocks next to the request's last one and keeps the prefix chains in step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from kvcache_core.block_pool import BlockPool, blocks_for
from kvcache_core.block_table import BlockTable
from kvcache_core.chains import PrefixChains
from kvcache_core.config import AllocationRequest
from kvcache_core.errors import SequenceTooLongError
from kvcache_core.handle import RequestState, SwapRecord
from kvcache_core.prefix import PrefixEntry
from kvcache_core.protocols import SlotArray

__all__ = ["AllocationPlan", "GrowthPlan", "SequenceBlocks"]


class AllocationPlan(NamedTuple):
    """What ``allocate`` would do, worked out without changing anything."""

    hits: list[tuple[PrefixEntry, int]]  # per cached logical block: its entry and the block to map
    queries: int  # full prompt blocks looked up
    collisions: int
    released: int  # leading hit blocks a sliding window leaves unmapped
    new_blocks: int  # blocks to take from the pool
    revived: int  # mapped hit blocks that are cached now (not free, not in use)


class GrowthPlan(NamedTuple):
    """What growing a request by ``tokens`` tokens takes, worked out without changing anything."""

    tokens: int
    new_ids: tuple[int, ...]  # token ids not known before
    released: int  # leading blocks the sliding window releases
    freed: int  # of those, blocks nobody else holds (they return to the pool)
    copies: list[int]  # shared logical blocks the new positions fall in (copy-on-write)
    missing: int  # new blocks to take

    @property
    def needed(self) -> int:
        return self.missing + len(self.copies)


class SequenceBlocks:
    """Allocation, growth, copy-on-write, window release and truncation of requests'
    block tables over one :class:`BlockPool` (manager internals)."""

    def __init__(self, pool: BlockPool, chains: PrefixChains) -> None:
        self.pool = pool
        self.chains = chains
        self.block_size = pool.config.block_size
        self.window = pool.config.sliding_window

    # -- windows and placement hints ---------------------------------------------------

    def window_start(self, length: int) -> int:
        """The first logical block the token at position ``length`` can see."""
        window = self.window
        if window is None or length < window:
            return 0
        return (length - window + 1) // self.block_size

    def expected_blocks(self, max_sequence_length: int | None, logical_now: int) -> int | None:
        """Blocks a request still expects to need (placement hint), ``None`` if unknown."""
        if max_sequence_length is None:
            return None
        remaining = blocks_for(max_sequence_length, self.block_size) - logical_now
        if self.window is not None:
            remaining = min(remaining, blocks_for(self.window, self.block_size) + 1)
        return max(remaining, 0)

    def shared_blocks(self, table: BlockTable, start: int, stop: int) -> list[int]:
        """Held logical blocks that positions ``start .. stop - 1`` fall in and that other
        requests share (they need a copy before a write)."""
        allocator = self.pool.allocator
        if stop <= start or not allocator.shared_block_count():
            return []
        first = max(start // self.block_size, table.first_logical)
        last = min(blocks_for(stop, self.block_size), table.first_logical + table.num_blocks())
        return [logical for logical in range(first, last) if allocator.ref_count(table.physical_block(logical)) > 1]

    # -- plans -------------------------------------------------------------------------

    def plan_allocation(self, request: AllocationRequest) -> AllocationPlan:
        """Look up the prompt's cached blocks and count the blocks ``allocate`` needs."""
        hits, queries, collisions = self.chains.lookup(request)
        released = min(len(hits), self.window_start(len(hits) * self.block_size))
        logical_total = max(len(hits), blocks_for(request.initial_tokens, self.block_size))
        revived = sum(1 for _, block in hits[released:] if self.pool.allocator.is_cached(block))
        return AllocationPlan(hits, queries, collisions, released, logical_total - len(hits), revived)

    def plan_growth(self, state: RequestState[Any], count: int, ids: tuple[int, ...] | None) -> GrowthPlan:
        """Check that the request may grow by ``count`` tokens and count the blocks it takes.

        Raises:
            SequenceTooLongError, InvalidArgumentError (token ids): nothing changed.
        """
        table = state.table
        old_length = table.sequence_length
        new_length = old_length + count
        if state.max_sequence_length is not None and new_length > state.max_sequence_length:
            raise SequenceTooLongError(
                f"request {state.request_id!r} would grow to {new_length} tokens, past its "
                f"max_sequence_length of {state.max_sequence_length}"
            )
        new_ids = self.chains.new_token_ids(state, ids, old_length) if ids is not None else ()
        released = freed = 0
        if count and self.window is not None:
            first_needed = self.window_start(old_length)
            held_end = table.first_logical + table.num_blocks()
            released = max(0, min(first_needed, held_end) - table.first_logical)
            ref_count = self.pool.allocator.ref_count
            freed = sum(1 for block in table.physical_blocks[:released] if ref_count(block) == 1)
        copies = self.shared_blocks(table, old_length, new_length)
        missing = max(0, blocks_for(new_length, self.block_size) - (table.first_logical + table.num_blocks()))
        return GrowthPlan(count, new_ids, released, freed, copies, missing)

    # -- carrying plans out ------------------------------------------------------------

    def grow(self, state: RequestState[Any], plan: GrowthPlan) -> SlotArray:
        """Carry out a checked growth plan (blocks for it are available)."""
        pool = self.pool
        table = state.table
        old_length = table.sequence_length
        spare = pool.available()
        # The copies are the only storage call: made first, so that a storage failure leaves
        # the request as it was. Only when they need the blocks the window frees does the
        # window release (which the request's tokens no longer see) come first.
        copies = [logical for logical in plan.copies if pool.allocator.ref_count(table.physical_block(logical)) > 1]
        copy_first = len(copies) <= spare
        if copy_first:
            self.copy_on_write(state, copies)
        if plan.released:
            self.chains.advance(state)  # hash what is ready before the window releases it
            self.release_leading(state, plan.released)
        if not copy_first:
            self.copy_on_write(state, copies)
        if plan.tokens:
            # A block truncated into while shared may be ours alone now and still cached:
            # it leaves the cache before new tokens go into it (a cached block is immutable).
            self.chains.unregister_rewritten(state, old_length, old_length + plan.tokens)
        if plan.missing:
            logical_now = table.first_logical + table.num_blocks()
            last = table.physical_blocks[-1] if table.num_blocks() else None
            table.add_blocks(
                pool.take(
                    plan.missing,
                    pool.sole_holder(last),
                    self.expected_blocks(state.max_sequence_length, logical_now),
                    f"cannot extend request {state.request_id!r} by {plan.tokens} tokens",
                )
            )
        slots = table.slots(old_length, old_length + plan.tokens)
        table.extend_sequence(plan.tokens)
        pool.issued[slots] = True
        if pool.written is not None:
            pool.written[:, slots] = False  # handed out anew: nothing of this request is there yet
        if plan.new_ids:
            state.token_ids.extend(plan.new_ids)
        if plan.tokens:
            pool.replanned(state)
        self.chains.advance(state)
        state.touch()
        return slots

    def copy_on_write(self, state: RequestState[Any], logicals: list[int]) -> None:
        """Give the request private copies of its shared logical blocks ``logicals``.

        Transactional (see :meth:`BlockPool.copies_of`): on a storage failure the request
        is unchanged. The copies are not registered in the prefix cache.
        """
        if not logicals:
            return
        pool = self.pool
        table = state.table
        sources = [table.physical_block(logical) for logical in logicals]
        hints = [table.physical_block(logical - 1) if logical > table.first_logical else None for logical in logicals]
        follows = [index > 0 and logical - 1 == logicals[index - 1] for index, logical in enumerate(logicals)]
        copies = pool.copies_of(sources, hints, follows, f"request {state.request_id!r}")
        for logical, source, copy in zip(logicals, sources, copies, strict=True):
            # Only the request's own positions carry over; past its length the copy is new.
            pool.carry_slots(
                source, copy, min(self.block_size, max(0, table.sequence_length - logical * self.block_size))
            )
            table.replace_block(logical, copy)
            pool.release([source], None)  # the other sharers keep it
            if state.awaiting_block == source:
                self.chains.set_awaiting(state, copy)
            pool.copy_on_write_count += 1
        pool.new_generation(state)

    def release_leading(self, state: RequestState[Any], count: int) -> None:
        """Release the first ``count`` held blocks of a request (its window passed them)."""
        table = state.table
        all_released = count == table.num_blocks()
        blocks = table.release_leading(count)
        if state.awaiting_block in blocks:
            self.chains.set_awaiting(state, None)
        if len(state.chain) < table.first_logical:
            state.chain_open = False  # an unhashed block is gone: the chain cannot go on
            self.chains.set_awaiting(state, None)
        self.pool.release(blocks[::-1], self.pool.sole_holder(blocks[-1]) if all_released else None)
        self.pool.new_generation(state)

    def truncate(self, state: RequestState[Any], length: int) -> None:
        """Shorten a resident request to ``length`` (checked) tokens: blocks wholly past it
        are released, a block it cuts into and holds alone leaves the prefix cache."""
        pool = self.pool
        table = state.table
        block_size = self.block_size
        if length % block_size and length // block_size >= table.first_logical:
            block = table.physical_block(length // block_size)
            if pool.allocator.ref_count(block) == 1:  # shared: the next extend copies it
                if pool.registered[block]:
                    pool.unregister(block)
                pool.forget_from(block, length % block_size)
        last = table.physical_blocks[-1] if table.num_blocks() else None
        dropped = table.truncate(length)
        if dropped:
            pool.release(dropped[::-1], pool.sole_holder(last))
            pool.new_generation(state)
        del state.chain[length // block_size :]
        del state.token_ids[length:]
        state.cached_tokens = min(state.cached_tokens, length)
        self.chains.set_awaiting(state, None)
        pool.replanned(state)
        self.chains.advance(state)

    # -- whole requests: allocate, fork, release, swap ---------------------------------

    def open(self, state: RequestState[Any], request: AllocationRequest, plan: AllocationPlan) -> None:
        """Give a new request its table: the plan's prefix hits mapped (shared), new
        blocks taken after them (the plan fits: checked by the caller)."""
        pool = self.pool
        allocator = pool.allocator
        mapped: list[int] = []
        for _, block in plan.hits[plan.released :]:
            if allocator.is_cached(block):
                allocator.revive(block)
                pool.swapped_blocks.pop(block, None)
            else:
                allocator.retain(block)
            mapped.append(block)
        new_blocks = pool.take(
            plan.new_blocks,
            pool.sole_holder(mapped[-1] if mapped else None),
            self.expected_blocks(request.max_sequence_length, len(plan.hits)),
            f"cannot allocate request {request.request_id!r}",
        )
        cached_tokens = len(plan.hits) * self.block_size
        state.table = BlockTable(self.block_size, mapped + new_blocks, cached_tokens, first_logical=plan.released)
        state.cached_tokens = cached_tokens
        if mapped:
            pool.issued[state.table.slots(plan.released * self.block_size, cached_tokens)] = True
        if self.chains.enabled:
            state.token_ids = list(request.prompt_token_ids or ())
            state.salt = request.salt_bytes()
            state.chain = [entry for entry, _ in plan.hits]

    def fork(self, parent: RequestState[Any], child: RequestState[Any]) -> None:
        """Give ``child`` the parent's tokens: every block holding them is shared."""
        table = parent.table
        shared = table.physical_blocks[: blocks_for(table.held_tokens(), self.block_size)]
        for block in shared:
            self.pool.allocator.retain(block)
        child.table = BlockTable(self.block_size, shared, table.sequence_length, first_logical=table.first_logical)
        child.token_ids = list(parent.token_ids)
        child.salt = parent.salt
        child.chain = list(parent.chain)
        child.chain_open = parent.chain_open
        if parent.awaiting_block is not None and parent.awaiting_block in shared:
            self.chains.set_awaiting(child, parent.awaiting_block)
        self.pool.replanned(parent)  # its blocks are shared now: a step planned before is stale

    def release(self, state: RequestState[Any]) -> None:
        """Drop everything a deallocated request holds (blocks, or its host copy)."""
        if state.swap is None:
            self.chains.set_awaiting(state, None)
            self.pool.release_table(list(state.table.physical_blocks))
        else:
            self.pool.forget_swapped(state.request_id, state.swap)
        state.valid = False
        state.swap = None
        self.pool.new_generation(state)
        state.chain = []
        state.table = BlockTable(self.block_size)

    def swap_out(self, state: RequestState[Any]) -> None:
        """Copy the request's blocks to the host, then drop its reference on each."""
        pool = self.pool
        table = state.table
        kept = np.asarray(table.physical_blocks[: blocks_for(table.held_tokens(), self.block_size)], dtype=np.int64)
        keys, values = pool.storage.blocks_to_host(kept)
        written = None if pool.written is None else pool.written[:, pool.block_slots(kept)].copy()
        self.chains.set_awaiting(state, None)
        unreferenced = pool.release_table(list(table.physical_blocks))
        for block in unreferenced:
            pool.swapped_blocks[block] = state.request_id
        state.swap = SwapRecord(
            keys=keys,
            values=values,
            sequence_length=table.sequence_length,
            first_logical=table.first_logical,
            written=written,
            released_blocks=tuple(unreferenced),
        )
        state.table = BlockTable(self.block_size)
        pool.new_generation(state)

    def swap_in(self, state: RequestState[Any], record: SwapRecord) -> None:
        """Bring a swapped-out request's blocks back (the blocks fit: checked by the
        caller). Transactional: if the storage raises, the blocks go back."""
        pool = self.pool
        blocks = pool.take(
            record.num_blocks,
            None,
            self.expected_blocks(state.max_sequence_length, record.first_logical),
            f"cannot swap in request {state.request_id!r}",
        )
        block_array = np.asarray(blocks, dtype=np.int64)
        try:
            pool.storage.blocks_from_host(block_array, record.keys, record.values)
        except BaseException:  # nothing is committed yet: give the blocks back
            if blocks:
                pool.allocator.release(blocks[::-1], blocks[-1])
            raise
        if pool.written is not None and record.written is not None:
            pool.written[:, pool.block_slots(block_array)] = record.written
        pool.forget_swapped(state.request_id, record)
        state.table = BlockTable(self.block_size, blocks, record.sequence_length, first_logical=record.first_logical)
        held_from = record.first_logical * self.block_size
        pool.issued[state.table.slots(held_from, max(held_from, record.sequence_length))] = True
        state.swap = None
        pool.new_generation(state)
        self.chains.rechain(state)
        self.chains.advance(state)
