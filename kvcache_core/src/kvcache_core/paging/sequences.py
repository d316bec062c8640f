"""The per-request block policy: what allocating, growing and shortening a request takes.

Plans are worked out without changing anything (``plan_allocation``, ``plan_growth``), so
the manager can refuse a request whole; carrying a plan out (``grow``, ``truncate``) then
copies shared blocks (copy-on-write), releases blocks a sliding window passed, takes new
blocks next to the request's last one and keeps the prefix chains in step.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np

from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.config import AllocationRequest
from kvcache_core.contract.groups import first_visible_block
from kvcache_core.contract.protocols import SlotArray
from kvcache_core.errors import SequenceTooLongError
from kvcache_core.paging.block_pool import BlockPool, blocks_for
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.planner import AllocationPlan, Opened, PrefixPlanner, TierLookup, filled
from kvcache_core.paging.request_state import RequestState, SwapRecord

__all__ = ["AllocationPlan", "GroupGrowth", "GrowthPlan", "SequenceBlocks"]


class GroupGrowth(NamedTuple):
    """What growing a request takes in one KV-cache group."""

    released: int  # leading blocks the sliding window releases
    freed: int  # of those, blocks nobody else holds (they return to the pool)
    copies: list[int]  # shared logical blocks the new positions fall in (copy-on-write)
    missing: int  # new blocks to take


class GrowthPlan(NamedTuple):
    """What growing a request by ``tokens`` tokens takes, worked out without changing anything
    (the totals over its groups are summed once, when it is planned: growth is the hot path)."""

    tokens: int
    new_ids: tuple[int, ...]  # token ids not known before
    groups: list[GroupGrowth]  # per KV-cache group
    needed: int  # blocks to take: the missing ones and the copies of shared ones
    freed: int  # blocks the windows give back to the pool
    copy_count: int  # copies of shared blocks
    released: int  # leading blocks the windows release


class _Reserved(NamedTuple):
    """The blocks one growth took before changing any table."""

    copies: list[list[tuple[int, int, int]]]  # per group: (logical, source, copy) for copy-on-write
    new: list[list[int]]  # per group: the new blocks, in logical order


#: The copies of a growth that copies nothing (shared: never changed).
_NO_COPIES: list[list[tuple[int, int, int]]] = []


class SequenceBlocks:
    """Allocation, growth, copy-on-write, window release and truncation of requests'
    block tables over one :class:`BlockPool` (manager internals). A request has one
    table per KV-cache group (:mod:`kvcache_core.contract.groups`), all of one length; a group's
    window decides which of its blocks it keeps."""

    def __init__(self, pool: BlockPool, chains: PrefixChains) -> None:
        self.pool = pool
        self.chains = chains
        self.block_size = pool.config.block_size
        self.windows = [group.window for group in pool.config.kv_groups]
        self.planner = PrefixPlanner(pool)

    # -- windows and placement hints ---------------------------------------------------

    def window_start(self, length: int, group: int = 0) -> int:
        """The first logical block of ``group`` the token at position ``length`` can see."""
        return first_visible_block(self.windows[group], length, self.block_size)

    def expected_blocks(self, max_sequence_length: int | None, logical_now: int, group: int = 0) -> int | None:
        """Blocks a request still expects to need in ``group`` (placement hint), ``None``
        if unknown."""
        if max_sequence_length is None:
            return None
        remaining = blocks_for(max_sequence_length, self.block_size) - logical_now
        window = self.windows[group]
        if window is not None:
            remaining = min(remaining, blocks_for(window, self.block_size) + 1)
        return max(remaining, 0)

    def held_from(self, state: RequestState[Any]) -> int:
        """The first position every group of the request still holds."""
        return max(table.first_logical for table in state.tables) * self.block_size

    def shortest(self, state: RequestState[Any]) -> tuple[int, bool]:
        """The shortest length the request may be truncated to, and whether a sliding
        window sets it (its last token's window must not reach a released block)."""
        windowed = [
            table.first_logical * self.block_size + window - 1
            for table, window in zip(state.tables, self.windows, strict=True)
            if window is not None and table.first_logical
        ]
        return max([self.held_from(state), *windowed]), bool(windowed)

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
        """Look up the prompt's cached blocks in the pool and count the blocks ``allocate``
        needs (:meth:`PrefixPlanner.plan`)."""
        return self.planner.plan(request)

    def plan_growth(self, state: RequestState[Any], count: int, ids: tuple[int, ...] | None) -> GrowthPlan:
        """Check that the request may grow by ``count`` tokens and count the blocks it takes.

        Raises:
            SequenceTooLongError, InvalidArgumentError (token ids): nothing changed.
        """
        old_length = state.table.sequence_length
        new_length = old_length + count
        if state.max_sequence_length is not None and new_length > state.max_sequence_length:
            raise SequenceTooLongError(
                f"request {state.request_id!r} would grow to {new_length} tokens, past its "
                f"max_sequence_length of {state.max_sequence_length}"
            )
        new_ids = self.chains.new_token_ids(state, ids, old_length) if ids is not None else ()
        ref_count = self.pool.allocator.ref_count
        groups: list[GroupGrowth] = []
        needed = freed_total = copy_count = released_total = 0
        for group, table in enumerate(state.tables):
            released = freed = 0
            if count and self.windows[group] is not None:
                first_needed = self.window_start(old_length, group)
                held_end = table.first_logical + table.num_blocks()
                released = max(0, min(first_needed, held_end) - table.first_logical)
                freed = sum(1 for block in table.physical_blocks[:released] if ref_count(block) == 1)
            copies = self.shared_blocks(table, old_length, new_length)
            missing = max(0, blocks_for(new_length, self.block_size) - (table.first_logical + table.num_blocks()))
            groups.append(GroupGrowth(released, freed, copies, missing))
            needed, copy_count = needed + missing + len(copies), copy_count + len(copies)
            freed_total, released_total = freed_total + freed, released_total + released
        return GrowthPlan(count, new_ids, groups, needed, freed_total, copy_count, released_total)

    # -- carrying plans out ------------------------------------------------------------

    def grow(self, state: RequestState[Any], plan: GrowthPlan) -> SlotArray:
        """Carry out a checked growth plan (blocks for it are available), all or nothing
        as :meth:`grow_all`. Returns the new positions' slots: ``[tokens]``, or
        ``[num_groups, tokens]`` with KV-cache groups."""
        window_first = self._window_first(plan.released, plan.needed)
        if window_first:
            self._release_window(state, plan)
        return self._install(state, plan, self._reserve(state, plan, {}), window_first)

    def grow_all(self, states: list[RequestState[Any]], plans: list[GrowthPlan]) -> list[SlotArray]:
        """Carry out checked growth plans of distinct requests (blocks for all of them are
        available); return each one's new slots, as :meth:`grow`.

        All or nothing: every block the plans take (copy-on-write copies, new blocks of
        every group) is taken, and the copies made, before any table changes. Taking may
        evict, and evicting demote to a tier; whatever that or the copy raises
        (``KeyboardInterrupt`` included), every block taken is given back and every table,
        length and token id is as it was (blocks evicted meanwhile stay evicted, as any
        eviction). Only when the plans need the blocks their windows free does the window
        release (of blocks the requests' next tokens no longer see) come first; it stays.
        """
        window_first = self._window_first(sum(plan.released for plan in plans), sum(plan.needed for plan in plans))
        if window_first:
            for state, plan in zip(states, plans, strict=True):
                self._release_window(state, plan)
        # Copies each source block will lose in this call: a block shared by two requests
        # of the batch is copied for the first only, the second then holds it alone.
        copying: dict[int, int] = {}
        reserved: list[_Reserved] = []
        try:
            for state, plan in zip(states, plans, strict=True):
                reserved.append(self._reserve(state, plan, copying))
        except BaseException:
            for taken in reversed(reserved):
                self._give_back(taken)
            raise
        return [
            self._install(state, plan, taken, window_first)
            for state, plan, taken in zip(states, plans, reserved, strict=True)
        ]

    def _window_first(self, released: int, needed: int) -> bool:
        """Whether plans that release ``released`` blocks and need ``needed`` need the blocks
        their windows free (the release comes first)."""
        return released > 0 and needed > self.pool.available()

    def _reserve(self, state: RequestState[Any], plan: GrowthPlan, copying: dict[int, int]) -> _Reserved:
        """Take the blocks one plan needs and make its copies, changing no table; on any
        exception, give back what it took."""
        pool = self.pool
        tables = state.tables
        copies = _NO_COPIES
        if plan.copy_count:
            ref_count = pool.allocator.ref_count
            wanted = [
                [
                    logical
                    for logical in growth.copies
                    if ref_count(block := table.physical_block(logical)) - copying.get(block, 0) > 1
                ]
                for table, growth in zip(tables, plan.groups, strict=True)
            ]
            copies = self._copies(state, wanted)
            for group_copies in copies:
                for _, source, _ in group_copies:
                    copying[source] = copying.get(source, 0) + 1
        new: list[list[int]] = []
        try:
            for group, (table, growth) in enumerate(zip(tables, plan.groups, strict=True)):
                if not growth.missing:
                    new.append([])
                    continue
                logical_now = table.first_logical + table.num_blocks()
                last = table.physical_blocks[-1] if table.num_blocks() else None
                if copies is not _NO_COPIES:  # the last block's copy, if it is copied, is the one to follow
                    last = next((copy for logical, _, copy in copies[group] if logical == logical_now - 1), last)
                new.append(
                    pool.take(
                        growth.missing,
                        pool.sole_holder(last),
                        self.expected_blocks(state.max_sequence_length, logical_now, group),
                        f"cannot extend request {state.request_id!r} by {plan.tokens} tokens",
                        group,
                    )
                )
        except BaseException:
            self._give_back(_Reserved(copies, new))
            raise
        return _Reserved(copies, new)

    def _give_back(self, taken: _Reserved) -> None:
        """Return blocks :meth:`_reserve` took (no table holds them) to the free list."""
        for blocks in [*taken.new[::-1], [copy for group in taken.copies[::-1] for _, _, copy in group[::-1]]]:
            if blocks:
                self.pool.allocator.release(blocks[::-1], blocks[-1])

    def _install(
        self, state: RequestState[Any], plan: GrowthPlan, taken: _Reserved, window_released: bool
    ) -> SlotArray:
        """Put reserved blocks into the request's tables and grow them (nothing here fails)."""
        pool = self.pool
        tables = state.tables
        old_length = state.table.sequence_length
        if taken.copies is not _NO_COPIES:
            self._install_copies(state, taken.copies)
        if not window_released:
            self._release_window(state, plan)
        if plan.tokens:
            # A block truncated into while shared may be ours alone now and still cached:
            # it leaves the cache before new tokens go into it (a cached block is immutable).
            self.chains.unregister_rewritten(state, old_length, old_length + plan.tokens)
        grown: list[SlotArray] = []
        for table, new_blocks in zip(tables, taken.new, strict=True):
            if new_blocks:
                table.add_blocks(new_blocks)
            slots = table.slots(old_length, old_length + plan.tokens)
            table.extend_sequence(plan.tokens)
            pool.issued[slots] = True
            if pool.written is not None:
                pool.written[:, slots] = False  # handed out anew: nothing of this request is there yet
            grown.append(slots)
        if plan.new_ids:
            state.token_ids.extend(plan.new_ids)
        if plan.tokens:
            pool.replanned(state)
        self.chains.advance(state)
        state.touch()
        return grown[0] if len(grown) == 1 else np.stack(grown)

    def _release_window(self, state: RequestState[Any], plan: GrowthPlan) -> None:
        """Release the leading blocks the plan's windows passed."""
        if plan.released:
            self.chains.advance(state)  # hash what is ready before the window releases it
            for group, growth in enumerate(plan.groups):
                if growth.released:
                    self.release_leading(state, group, growth.released)

    def copy_on_write(self, state: RequestState[Any], logicals: list[list[int]]) -> None:
        """Give the request private copies of its shared logical blocks, ``logicals[g]``
        of group ``g``, in one storage call.

        Transactional (see :meth:`BlockPool.copies_of`): on a storage failure the request
        is unchanged. The copies are not registered in the prefix cache.
        """
        self._install_copies(state, self._copies(state, logicals))

    def _copies(self, state: RequestState[Any], logicals: list[list[int]]) -> list[list[tuple[int, int, int]]]:
        """Copy the request's logical blocks ``logicals[g]`` of each group ``g`` into new
        blocks, in one storage call, changing no table: per group, ``(logical, source,
        copy)`` each. Transactional (see :meth:`BlockPool.copies_of`)."""
        made: list[list[tuple[int, int, int]]] = [[] for _ in logicals]
        if not any(logicals):
            return made
        work = [(group, logical) for group, group_logicals in enumerate(logicals) for logical in group_logicals]
        tables = state.tables
        sources = [tables[group].physical_block(logical) for group, logical in work]
        hints = [
            tables[group].physical_block(logical - 1) if logical > tables[group].first_logical else None
            for group, logical in work
        ]
        follows = [index > 0 and work[index - 1] == (group, logical - 1) for index, (group, logical) in enumerate(work)]
        copies = self.pool.copies_of(sources, hints, follows, f"request {state.request_id!r}", [g for g, _ in work])
        for (group, logical), source, copy in zip(work, sources, copies, strict=True):
            made[group].append((logical, source, copy))
        return made

    def _install_copies(self, state: RequestState[Any], copies: list[list[tuple[int, int, int]]]) -> None:
        """Put copies :meth:`_copies` made in place of their sources."""
        if not any(copies):
            return
        pool = self.pool
        for table, group_copies in zip(state.tables, copies, strict=True):
            for logical, source, copy in group_copies:
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

    def release_leading(self, state: RequestState[Any], group: int, count: int) -> None:
        """Release the first ``count`` held blocks of a request's ``group`` (its window
        passed them)."""
        table = state.tables[group]
        all_released = count == table.num_blocks()
        blocks = table.release_leading(count)
        if state.awaiting_block in blocks:
            self.chains.set_awaiting(state, None)
        if len(state.chain) < min(table.first_logical for table in state.tables):
            state.chain_open = False  # an unhashed block is gone from every group: the chain cannot go on
            self.chains.set_awaiting(state, None)
        self.pool.release(blocks[::-1], self.pool.sole_holder(blocks[-1]) if all_released else None)
        self.pool.new_generation(state)

    def truncate(self, state: RequestState[Any], length: int) -> None:
        """Shorten a resident request to ``length`` (checked) tokens: blocks wholly past it
        are released, a block it cuts into and holds alone leaves the prefix cache."""
        pool = self.pool
        block_size = self.block_size
        changed = False
        for table in state.tables:
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
                changed = True
        if changed:
            pool.new_generation(state)
        del state.chain[length // block_size :]
        del state.token_ids[length:]
        state.cached_tokens = min(state.cached_tokens, length)
        self.chains.set_awaiting(state, None)
        pool.replanned(state)
        self.chains.advance(state)

    # -- whole requests: allocate, fork, release, swap ---------------------------------

    def open(
        self,
        state: RequestState[Any],
        request: AllocationRequest,
        plan: AllocationPlan,
        tiers: TierLookup | None = None,
    ) -> Opened:
        """Give a new request its tables as ``plan`` says, once: its pool hits mapped
        (shared), its promotion's records written into new blocks with one
        ``blocks_from_host`` call (they leave ``tiers``), new blocks taken after them in
        every group (the plan fits: checked by the caller), the promoted blocks registered.

        A promotion that fails with an ``Exception`` (the storage's write) is given up, with
        a warning: the request is opened with its pool hits alone.

        Returns:
            What was served: the cached logical blocks and the tier level of each record.

        Raises:
            BaseException: what taking blocks (evicting, demoting to a tier), the storage or
                a tier raised otherwise (``KeyboardInterrupt``): every block taken or mapped
                is given back first and the request holds nothing.
        """
        promotion = plan.promotion
        if promotion is not None and tiers is not None:
            try:
                return self._open(state, request, plan, tiers)
            except Exception as exc:  # the request is served without them
                failure = f"promoting {len(promotion.records)} blocks from the tiers failed: {exc!r}"
                warnings.warn(failure, RuntimeWarning, stacklevel=3)
        return self._open(state, request, plan, None)

    def _open(
        self, state: RequestState[Any], request: AllocationRequest, plan: AllocationPlan, tiers: TierLookup | None
    ) -> Opened:
        """Carry ``plan`` out, with its promotion when ``tiers`` are given; all or nothing."""
        pool = self.pool
        allocator = pool.allocator
        block_size = self.block_size
        promotion = plan.promotion if tiers is not None else None
        records = promotion.records if promotion is not None else []
        hits, firsts, rows = self.planner.layout(plan, promotion is not None)
        held: list[list[int]] = []  # per group: the pool blocks mapped
        taken: list[list[int]] = []  # per group: the new blocks
        revived: list[int] = []
        try:
            # Every group's hits are held before any group takes new blocks: taking may
            # evict cached blocks, and a later group's hit must not be among them.
            for row in rows:
                held.append([])
                for block in (block for block in row if block is not None):
                    if allocator.is_cached(block):
                        allocator.revive(block)
                        revived.append(block)
                    else:
                        pool.retain(block)
                    held[-1].append(block)
            for group, (row, mapped) in enumerate(zip(rows, held, strict=True)):
                taken.append(
                    pool.take(
                        row.count(None),
                        pool.sole_holder(mapped[-1] if mapped else None),
                        self.expected_blocks(request.max_sequence_length, hits, group),
                        f"cannot allocate request {request.request_id!r}",
                        group,
                    )
                )
            blocks = filled(rows, taken)  # per group: its blocks from its first held on
            if records:
                assert tiers is not None
                targets = [blocks[hit.group][plan.hits + hit.offset - firsts[hit.group]] for hit in records]
                pool.storage.blocks_from_host(
                    np.asarray(targets, dtype=np.int64),
                    np.stack([hit.record.keys for hit in records], axis=1),
                    np.stack([hit.record.values for hit in records], axis=1),
                )
                tiers.take_out([(hit.block_hash, hit.group) for hit in records])  # tiers are exclusive
        except BaseException:  # taking may evict, and demoting to a tier be interrupted: give all back
            self._give_back_opening(held, taken)
            raise
        if promotion is not None:  # the blocks mapped past the pool's hits leave the swap map too
            extension = (row[max(0, plan.hits - first) :] for row, first in zip(rows, firsts, strict=True))
            revived += [block for row in extension for block in row if block is not None]
        for block in revived:
            pool.swapped_blocks.pop(block, None)
        cached_tokens = hits * block_size
        state.tables = [
            BlockTable(block_size, group_blocks, cached_tokens, first_logical=first)
            for group_blocks, first in zip(blocks, firsts, strict=True)
        ]
        state.cached_tokens = cached_tokens
        for table, first in zip(state.tables, firsts, strict=True):
            if cached_tokens > first * block_size:
                pool.issued[table.slots(first * block_size, cached_tokens)] = True
            if promotion is not None and pool.written is not None and hits > max(plan.hits, first):
                pool.written[:, table.slots(max(plan.hits, first) * block_size, cached_tokens)] = True
        if self.chains.enabled:
            state.token_ids = list(request.prompt_token_ids or ())
            state.salt = request.salt_bytes()
            state.chain = list(plan.entries)
        if promotion is not None:
            self.chains.advance(state)  # the promoted blocks join the prefix cache
        return Opened(hits, tuple(hit.level for hit in records))

    def _give_back_opening(self, held: list[list[int]], taken: list[list[int]]) -> None:
        """Return what opening a request held (mapped pool blocks) and took (new blocks)."""
        for mapped in held:
            if mapped:
                self.pool.release_table(mapped)
        for blocks in taken:
            if blocks:
                self.pool.allocator.release(blocks[::-1], blocks[-1])

    def fork(self, parent: RequestState[Any], child: RequestState[Any]) -> None:
        """Give ``child`` the parent's tokens: every block holding them is shared, in
        every group."""
        tables: list[BlockTable] = []
        for table in parent.tables:
            shared = table.physical_blocks[: blocks_for(table.held_tokens(), self.block_size)]
            for block in shared:
                self.pool.retain(block)
            tables.append(BlockTable(self.block_size, shared, table.sequence_length, first_logical=table.first_logical))
            if parent.awaiting_block is not None and parent.awaiting_block in shared:
                self.chains.set_awaiting(child, parent.awaiting_block)
        child.tables = tables
        child.token_ids = list(parent.token_ids)
        child.salt = parent.salt
        child.chain = list(parent.chain)
        child.chain_open = parent.chain_open
        self.pool.replanned(parent)  # its blocks are shared now: a step planned before is stale

    def release(self, state: RequestState[Any]) -> None:
        """Drop everything a deallocated request holds (blocks, or its host copy)."""
        if state.swap is None:
            self.chains.set_awaiting(state, None)
            for table in state.tables:
                self.pool.release_table(list(table.physical_blocks))
        else:
            self.pool.forget_swapped(state.request_id, state.swap)
        state.valid = False
        state.swap = None
        self.pool.new_generation(state)
        state.chain = []
        state.tables = state.empty_tables()

    def swap_out(self, state: RequestState[Any]) -> None:
        """Copy the request's blocks (every group's, in one call) to the host, then drop
        its reference on each."""
        pool = self.pool
        tables = state.tables
        kept_lists = [table.physical_blocks[: blocks_for(table.held_tokens(), self.block_size)] for table in tables]
        kept = np.asarray([block for blocks in kept_lists for block in blocks], dtype=np.int64)
        keys, values = pool.storage.blocks_to_host(kept)
        written = None if pool.written is None else pool.written[:, pool.block_slots(kept)].copy()
        self.chains.set_awaiting(state, None)
        unreferenced = [block for table in tables for block in pool.release_table(list(table.physical_blocks))]
        for block in unreferenced:
            pool.swapped_blocks[block] = state.request_id
        state.swap = SwapRecord(
            keys=keys,
            values=values,
            sequence_length=state.table.sequence_length,
            first_logical=state.table.first_logical,
            written=written,
            released_blocks=tuple(unreferenced),
            first_logicals=tuple(table.first_logical for table in tables),
            group_blocks=tuple(len(blocks) for blocks in kept_lists),
        )
        state.tables = state.empty_tables()
        pool.new_generation(state)

    def swap_in(self, state: RequestState[Any], record: SwapRecord) -> None:
        """Bring a swapped-out request's blocks back (the blocks fit: checked by the
        caller). Transactional: if the storage raises, the blocks go back."""
        pool = self.pool
        counts = record.group_blocks or (record.num_blocks,)
        firsts = record.first_logicals or (record.first_logical,)
        taken: list[list[int]] = []
        try:
            for group, (count, first) in enumerate(zip(counts, firsts, strict=True)):
                taken.append(
                    pool.take(
                        count,
                        None,
                        self.expected_blocks(state.max_sequence_length, first, group),
                        f"cannot swap in request {state.request_id!r}",
                        group,
                    )
                )
            block_array = np.asarray([block for blocks in taken for block in blocks], dtype=np.int64)
            pool.storage.blocks_from_host(block_array, record.keys, record.values)
        except BaseException:  # nothing is committed yet: give the blocks back
            for blocks in taken:
                if blocks:
                    pool.allocator.release(blocks[::-1], blocks[-1])
            raise
        if pool.written is not None and record.written is not None:
            pool.written[:, pool.block_slots(block_array)] = record.written
        pool.forget_swapped(state.request_id, record)
        state.tables = [
            BlockTable(self.block_size, blocks, record.sequence_length, first_logical=first)
            for blocks, first in zip(taken, firsts, strict=True)
        ]
        for table in state.tables:
            held_from = table.first_logical * self.block_size
            pool.issued[table.slots(held_from, max(held_from, record.sequence_length))] = True
        state.swap = None
        pool.new_generation(state)
        self.chains.rechain(state)
        self.chains.advance(state)
