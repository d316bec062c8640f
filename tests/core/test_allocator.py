"""The allocator: free list, reference counts, and requests kept in long runs of blocks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    OutOfBlocksError,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    create_manager,
)
from kvcache_core.backends.numpy import NumpyArray, NumpyStorage
from kvcache_core.paging.allocator import BlockAllocator, FreeBlockQueue


def test_free_queue_pops_in_free_order_and_removes_any_member() -> None:
    queue = FreeBlockQueue(6)
    for block in (4, 1, 5, 0):
        queue.push_back(block)
    queue.remove(5)
    assert list(queue) == [4, 1, 0]
    assert queue.front() == 4
    queue.remove(4)
    queue.remove(0)
    assert list(queue) == [1]
    assert len(queue) == 1
    assert 1 in queue
    assert 0 not in queue


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 31)), max_size=200))
def test_free_queue_matches_an_ordered_list(operations: list[tuple[bool, int]]) -> None:
    queue, model = FreeBlockQueue(32), list[int]()
    for push, block in operations:
        if push and block not in model:
            queue.push_back(block)
            model.append(block)
        elif not push and block in model:
            queue.remove(block)
            model.remove(block)
        assert list(queue) == model
        assert len(queue) == len(model)
        assert queue.front() == (model[0] if model else -1)


def test_allocator_never_hands_out_a_block_twice_and_counts_add_up() -> None:
    allocator = BlockAllocator(10)
    first = allocator.allocate(4)
    second = allocator.allocate(6)
    assert sorted(first + second) == list(range(10))
    assert allocator.free_block_count() == 0
    with pytest.raises(OutOfBlocksError, match="need 1 free blocks, 0 of 10"):
        allocator.allocate(1)
    allocator.release(first, tail=first[-1])
    assert allocator.free_block_count() == 4
    assert allocator.used_block_count() == 6
    assert all(allocator.ref_count(b) == 0 for b in first)


def test_shared_blocks_return_to_the_pool_only_with_their_last_reference() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.retain(blocks[0])
    allocator.release(blocks, tail=blocks[-1])
    assert allocator.ref_count(blocks[0]) == 1
    assert allocator.free_block_count() == 3
    allocator.release([blocks[0]], tail=None)
    assert allocator.free_block_count() == 4


def test_freed_blocks_merge_back_into_one_gap() -> None:
    allocator = BlockAllocator(12)
    runs = [allocator.allocate(3, expected=3) for _ in range(4)]
    assert allocator.free_extents() == []
    for run in (runs[1], runs[3], runs[2]):
        allocator.release(run, tail=run[-1])
    assert allocator.free_extents() == [(3, 12)]


def test_a_growing_request_takes_the_block_after_its_last_one() -> None:
    allocator = BlockAllocator(100)
    first = allocator.allocate(1)
    other = allocator.allocate(1)
    grown = allocator.allocate(1, after=first[0])
    assert grown == [first[0] + 1]
    assert other[0] != first[0] + 1


def test_a_new_request_with_known_need_lands_where_it_fits_whole() -> None:
    allocator = BlockAllocator(40)
    first = allocator.allocate(1, expected=10)  # reserves 1..9 for itself
    second = allocator.allocate(1, expected=10)
    assert second[0] >= first[0] + 10 or second[0] + 10 <= first[0]


def test_reserved_blocks_are_taken_only_when_nothing_else_is_free() -> None:
    allocator = BlockAllocator(6)
    owner = allocator.allocate(1, expected=3)  # block 0, reserving 1 and 2
    assert owner == [0]
    first, second = allocator.allocate(1)[0], allocator.allocate(1)[0]
    assert (first, second) == (3, 5)  # 4 is left as the next block of the request at 3
    assert allocator.allocate(1, after=owner[0]) == [1]  # the reservation held
    last = allocator.allocate(1)[0]  # only reserved blocks remain: 2 (for 0) and 4 (for 3)
    assert last in {2, 4}


def grow_side_by_side(
    lengths: list[int], with_max_length: bool, headroom: float = 1.25, block_size: int = 16
) -> list[PagedKvCacheHandle[NumpyArray]]:
    needed = sum(-(-length // block_size) for length in lengths)
    config = CacheConfig(
        num_layers=1, num_heads=1, head_dim=1, num_blocks=int(needed * headroom), block_size=block_size
    )
    manager = create_manager("numpy", config)
    handles = [
        manager.allocate(AllocationRequest(f"r{i}", max_sequence_length=length if with_max_length else None))
        for i, length in enumerate(lengths)
    ]
    for step in range(max(lengths)):
        for handle, length in zip(handles, lengths, strict=False):
            if step < length:
                manager.extend(handle, 1)
    manager.check_invariants()
    assert [h.num_tokens() for h in handles] == lengths
    return handles


@pytest.mark.parametrize("seed", range(4))
def test_sixteen_requests_growing_side_by_side_with_max_length_are_one_run_each(seed: int) -> None:
    lengths = [int(n) for n in np.random.default_rng(seed).integers(128, 4097, 16)]
    handles = grow_side_by_side(lengths, with_max_length=True)
    assert [len(h.block_table().runs()) for h in handles] == [1] * 16


@pytest.mark.parametrize("seed", range(4))
def test_sixteen_requests_growing_side_by_side_without_max_length_stay_in_few_runs(seed: int) -> None:
    lengths = [int(n) for n in np.random.default_rng(seed).integers(128, 4097, 16)]
    handles = grow_side_by_side(lengths, with_max_length=False)
    runs = [len(h.block_table().runs()) for h in handles]
    assert max(runs) <= 8, runs


def test_the_fifo_baseline_fragments_the_same_workload() -> None:
    """The comparison that makes the run tests meaningful: a plain free queue scatters."""
    lengths = [int(n) for n in np.random.default_rng(0).integers(128, 1025, 16)]
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=1, num_blocks=700, block_size=16)
    manager = PagedKvCacheManager(NumpyStorage(config), placement="fifo")
    handles = [manager.allocate(AllocationRequest(f"r{i}")) for i in range(16)]
    for step in range(max(lengths)):
        for handle, length in zip(handles, lengths, strict=False):
            if step < length:
                manager.extend(handle, 1)
    assert max(len(h.block_table().runs()) for h in handles) > 8


def test_runs_survive_churn_of_finishing_and_arriving_requests() -> None:
    rng = np.random.default_rng(7)
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=1, num_blocks=400, block_size=16)
    manager = create_manager("numpy", config)
    live: dict[str, tuple[PagedKvCacheHandle[NumpyArray], int]] = {}
    for step in range(3000):
        if len(live) < 8 and rng.random() < 0.05:
            target = int(rng.integers(64, 700))
            rid = f"r{step}"
            live[rid] = (manager.allocate(AllocationRequest(rid, max_sequence_length=target)), target)
        for rid, (handle, target) in list(live.items()):
            if handle.num_tokens() == target:
                assert len(handle.block_table().runs()) <= 2
                manager.deallocate(rid)
                del live[rid]
            else:
                manager.extend(handle, 1)
    manager.check_invariants()
