"""The block allocator: a free list, reference counts and run-keeping placement.

Every block is in exactly one of three states:

* **free**: reference count 0, in the free list and in exactly one free extent;
* **in use**: reference count >= 1 (more than 1 when requests share it);
* **cached**: reference count 0, but its contents are kept for prefix-cache hits; it sits in
  the least-recently-used :class:`~kvcache_core.paging.prefix.BlockEvictor`, not in the free list.

``free + in_use + cached == num_blocks``. Allocation takes free blocks only: the manager
evicts cached blocks (oldest first) when the free ones do not suffice, so blocks without a
cached prefix are always reused before those with one.

A sequence keeps its blocks physically consecutive where it can:

* a new sequence starts in a free extent with room to grow, sized from its expected
  need when known (best fit), otherwise in the middle of the largest gap;
* a growing sequence takes the block right after its last one;
* the free blocks right after a sequence's last block are *reserved* for it (as many as
  it expects to need, or the first half of the gap when its need is unknown); other
  sequences take them only when nothing else is free.

So a sequence's blocks form a few long runs, which attention reads as zero-copy views.

Costs: taking the next block, taking any given free block, and freeing a block are
O(1) (linked free list plus extent maps keyed by both ends). Choosing where a *new run*
starts scans the free extents, O(number of gaps), once per run rather than per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.scalars import check_count
from kvcache_core.errors import InvalidArgumentError, OutOfBlocksError
from kvcache_core.paging.prefix import BlockEvictor

__all__ = ["BlockAllocator", "FreeBlockQueue", "Placement"]

#: ``"contiguous"`` keeps sequences in runs (the default); ``"fifo"`` hands out the
#: least recently freed block, like a plain free queue (kept for comparison).
Placement = Literal["contiguous", "fifo"]

_NIL: Final = -1


class FreeBlockQueue:
    """A doubly linked list over block ids ``0 .. num_blocks - 1``.

    O(1) ``push_back``, ``pop_front`` and ``remove`` of any given member. Blocks are
    appended when freed, so the front is the least recently freed block.
    """

    __slots__ = ("_head", "_in_queue", "_next", "_prev", "_size", "_tail")

    def __init__(self, num_blocks: int) -> None:
        self._prev = [_NIL] * num_blocks
        self._next = [_NIL] * num_blocks
        self._in_queue = [False] * num_blocks
        self._head = _NIL
        self._tail = _NIL
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: int) -> bool:
        return self._in_queue[block]

    def push_back(self, block: int) -> None:
        """Append ``block`` (which must not be in the queue)."""
        assert not self._in_queue[block], f"block {block} is already free"
        self._prev[block] = self._tail
        self._next[block] = _NIL
        if self._tail == _NIL:
            self._head = block
        else:
            self._next[self._tail] = block
        self._tail = block
        self._in_queue[block] = True
        self._size += 1

    def remove(self, block: int) -> None:
        """Unlink ``block`` (which must be in the queue)."""
        assert self._in_queue[block], f"block {block} is not free"
        prev, nxt = self._prev[block], self._next[block]
        if prev == _NIL:
            self._head = nxt
        else:
            self._next[prev] = nxt
        if nxt == _NIL:
            self._tail = prev
        else:
            self._prev[nxt] = prev
        self._in_queue[block] = False
        self._size -= 1

    def front(self) -> int:
        """The least recently freed block, or -1 when empty."""
        return self._head

    def __iter__(self) -> _QueueIterator:
        return _QueueIterator(self._head, self._next)


class _QueueIterator:
    __slots__ = ("_block", "_next")

    def __init__(self, head: int, links: list[int]) -> None:
        self._block = head
        self._next = links

    def __iter__(self) -> _QueueIterator:
        return self

    def __next__(self) -> int:
        block = self._block
        if block == _NIL:
            raise StopIteration
        self._block = self._next[block]
        return block


class BlockAllocator:
    """Hands out blocks of a pool of ``num_blocks``; see the module docstring for policy.

    Not thread-safe by itself: the manager serialises calls.
    """

    def __init__(self, num_blocks: int, placement: Placement = "contiguous") -> None:
        num_blocks = check_count(num_blocks, "num_blocks", 1)
        if placement not in ("contiguous", "fifo"):
            raise InvalidArgumentError(f"placement must be 'contiguous' or 'fifo', got {placement!r}")
        self._num_blocks = num_blocks
        self._placement: Placement = placement
        self._ref_counts = [0] * num_blocks
        self._in_use = np.zeros(num_blocks, dtype=np.bool_)
        self._shared = np.zeros(num_blocks, dtype=np.bool_)  # reference count >= 2
        self._shared_count = 0
        self._cached = BlockEvictor()
        self._free = FreeBlockQueue(num_blocks)
        for block in range(num_blocks):
            self._free.push_back(block)
        # Free extents [start, end), indexed by both ends so merging and splitting are O(1).
        self._extent_end: dict[int, int] = {0: num_blocks}
        self._extent_start: dict[int, int] = {num_blocks: 0}
        # Last block of a growing sequence -> blocks it still expects to need (None: unknown).
        self._tails: dict[int, int | None] = {}

    # -- figures -----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._num_blocks

    @property
    def placement(self) -> Placement:
        """The placement policy."""
        return self._placement

    def free_block_count(self) -> int:
        """Free blocks."""
        return len(self._free)

    def used_block_count(self) -> int:
        """Blocks with a reference count of 1 or more."""
        return self._num_blocks - len(self._free) - len(self._cached)

    def cached_block_count(self) -> int:
        """Unreferenced blocks kept for prefix-cache hits (evictable)."""
        return len(self._cached)

    def cached_blocks(self) -> list[int]:
        """The cached blocks, least recently used first."""
        return list(self._cached)

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is cached (unreferenced, contents kept)."""
        return block in self._cached

    def is_free(self, block: int) -> bool:
        """Whether ``block`` is free."""
        return block in self._free

    def free_blocks(self) -> list[int]:
        """The free blocks, least recently freed first."""
        return list(self._free)

    def ref_count(self, block: int) -> int:
        """References held on ``block``."""
        return self._ref_counts[block]

    def in_use_mask(self) -> npt.NDArray[np.bool_]:
        """Read-only ``[num_blocks]`` mask of blocks in use."""
        view: npt.NDArray[np.bool_] = self._in_use.view()
        view.flags.writeable = False
        return view

    def shared_block_count(self) -> int:
        """Blocks with two or more references."""
        return self._shared_count

    def shared_mask(self) -> npt.NDArray[np.bool_]:
        """Read-only ``[num_blocks]`` mask of blocks with two or more references."""
        view: npt.NDArray[np.bool_] = self._shared.view()
        view.flags.writeable = False
        return view

    def free_extents(self) -> list[tuple[int, int]]:
        """The free gaps as sorted ``(start, end)`` pairs, ``end`` exclusive."""
        return sorted(self._extent_end.items())

    # -- taking and releasing ----------------------------------------------------------

    def allocate(self, count: int, after: int | None = None, expected: int | None = None) -> list[int]:
        """Take ``count`` blocks for a sequence.

        Args:
            count: blocks to take now (>= 0).
            after: the sequence's current last block, or ``None`` for a new sequence.
            expected: blocks the sequence still expects to need from here, including these
                ``count`` (``None`` when unknown); it sizes the room kept after the run.

        Returns:
            The blocks, in the order the sequence uses them.

        Raises:
            OutOfBlocksError: fewer than ``count`` blocks are free; nothing was taken.
        """
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} free blocks, {len(self._free)} of {self._num_blocks} are free")
        if count == 0:
            return []
        if after is not None:
            self._tails.pop(after, None)
        remaining = None if expected is None else max(expected, count)
        blocks: list[int] = []
        last = after
        for _ in range(count):
            block, extent_start = self._next_block(last, remaining)
            self._take(block, extent_start)
            blocks.append(block)
            last = block
            if remaining is not None:
                remaining -= 1
        assert last is not None
        self._tails[last] = remaining
        return blocks

    def release(
        self, blocks: list[int], tail: int | None, keep_cached: Callable[[int], bool] | None = None
    ) -> list[int]:
        """Drop one reference on each block, in the order given.

        A block reaching zero becomes cached (the most recently used) if ``keep_cached``
        says so, and free otherwise. ``tail`` is the releasing sequence's last block (its
        reservation ends).

        Returns:
            The blocks that reached zero, in order.
        """
        if tail is not None:
            self._tails.pop(tail, None)
        unreferenced: list[int] = []
        for block in blocks:
            count = self._ref_counts[block]
            assert count > 0, f"block {block} released while free"
            self._ref_counts[block] = count - 1
            if count == 2:
                self._shared[block] = False
                self._shared_count -= 1
            elif count == 1:
                unreferenced.append(block)
                if keep_cached is not None and keep_cached(block):
                    self._in_use[block] = False
                    self._cached.push(block)
                else:
                    self._give_back(block)
        return unreferenced

    def retain(self, block: int) -> None:
        """Add a reference on an in-use block (sharing)."""
        count = self._ref_counts[block]
        assert count > 0, f"block {block} is not in use"
        self._ref_counts[block] = count + 1
        if count == 1:
            self._shared[block] = True
            self._shared_count += 1

    def revive(self, block: int) -> None:
        """Take a cached block back into use with one reference (a prefix-cache hit)."""
        self._cached.remove(block)
        self._ref_counts[block] = 1
        self._in_use[block] = True

    def evict(self, count: int) -> list[int]:
        """Move the ``count`` least recently used cached blocks to the free list.

        Returns:
            The evicted blocks, oldest first (their contents are now unowned).
        """
        assert count <= len(self._cached), f"cannot evict {count} of {len(self._cached)} cached blocks"
        evicted = [self._cached.pop_oldest() for _ in range(count)]
        for block in evicted:
            self._give_back(block)
        return evicted

    def uncache(self, block: int) -> None:
        """Move one cached block to the free list."""
        self._cached.remove(block)
        self._give_back(block)

    # -- internals ---------------------------------------------------------------------

    def _next_block(self, last: int | None, remaining: int | None) -> tuple[int, int | None]:
        """The block to take next and the start of its free extent (``None`` under fifo)."""
        if self._placement == "fifo":
            return self._free.front(), None
        following = -1 if last is None else last + 1
        if 0 < following < self._num_blocks and following in self._free:
            return following, following  # the block after a used one starts a gap
        return self._choose_start(remaining)

    def _choose_start(self, need: int | None) -> tuple[int, int]:
        """Where a new run starts, and the start of the gap it is in.

        Ranks every gap and keeps the lowest rank: first the gaps where the run fits
        without touching another sequence's reserved room (best fit), then gaps shared
        with a neighbour of unknown need that keeps at least half, then the largest open
        room, and last, when nothing else is free, room another sequence reserved.
        """
        best_rank: tuple[int, int] | None = None
        best = (-1, -1)
        for start, end in self._extent_end.items():
            block, rank = self._rank_gap(start, end, need)
            if best_rank is None or rank < best_rank:
                best_rank, best = rank, (block, start)
        assert best_rank is not None, "no free extent although blocks are free"
        return best

    def _rank_gap(self, start: int, end: int, need: int | None) -> tuple[int, tuple[int, int]]:
        length = end - start
        claim = self._tails.get(start - 1, 0) if start > 0 else 0
        if claim is None:  # neighbour of unknown need: it keeps the first half
            if need is not None and need <= length // 2:
                return end - need, (1, need - length)  # at the far end, neighbour keeps most
            open_start = start + length // 2
            reserved_only = length < 2
        elif claim < length:  # no neighbour, or one that reserved only part of the gap
            open_start, reserved_only = start + claim, False
            if need is not None and length - claim >= need:
                return open_start, (0, length - claim - need)  # best fit
        else:  # the whole gap is reserved by the neighbour
            open_start, reserved_only = start + length // 2, True
        return open_start, (3 if reserved_only else 2, open_start - end)

    def _take(self, block: int, extent_start: int | None) -> None:
        assert self._ref_counts[block] == 0, f"block {block} would be owned twice"
        self._free.remove(block)
        self._ref_counts[block] = 1
        self._in_use[block] = True
        if extent_start is None:
            return
        end = self._extent_end.pop(extent_start)
        del self._extent_start[end]
        if extent_start < block:
            self._extent_end[extent_start] = block
            self._extent_start[block] = extent_start
        if block + 1 < end:
            self._extent_end[block + 1] = end
            self._extent_start[end] = block + 1

    def _give_back(self, block: int) -> None:
        self._in_use[block] = False
        self._free.push_back(block)
        if self._placement == "fifo":
            return
        start, end = block, block + 1
        if block in self._extent_start:  # a gap ends right before this block
            start = self._extent_start.pop(block)
            del self._extent_end[start]
        if end in self._extent_end:  # a gap starts right after it
            end = self._extent_end.pop(end)
            del self._extent_start[end]
        self._extent_end[start] = end
        self._extent_start[end] = start
