"""Eviction of cached blocks under pressure, pressure levels and gc() figures."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import pytest

from kvcache_core import (
    AllocationRequest,
    MemoryPressure,
    OutOfBlocksError,
)
from kvcache_core.testing import inspect
from tests.core import support
from tests.core.support import Handle, Manager

BLOCK = 4


#: One layer of one head of size 2: the smallest manager.
make_manager = partial(support.make_manager, num_layers=1, num_heads=1, head_dim=2)


def admit(manager: Manager, request_id: str, prompt: Sequence[int]) -> Handle:
    handle = manager.allocate(AllocationRequest(request_id, initial_tokens=len(prompt), prompt_token_ids=tuple(prompt)))
    count = len(prompt) - handle.num_tokens()
    slots = manager.extend(handle, count)
    kv = np.full((count, 1, 2), float(len(request_id)), np.float32)
    manager.write(0, slots, kv, kv)
    return handle


def cached_tokens(manager: Manager, request_id: str, prompt: Sequence[int]) -> int:
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=tuple(prompt)))
    tokens = handle.num_cached_tokens()
    manager.deallocate(request_id)
    return tokens


PROMPT_A = tuple(range(0, 9))  # two cacheable full blocks each
PROMPT_B = tuple(range(100, 109))


def test_allocation_on_a_full_pool_evicts_cached_blocks_before_failing() -> None:
    manager = make_manager(num_blocks=6)
    admit(manager, "a", PROMPT_A)
    manager.deallocate("a")  # 2 cached, 4 free
    handle = manager.allocate(AllocationRequest("big", initial_tokens=5 * BLOCK))
    assert handle.block_table().num_blocks() == 5
    stats = manager.stats()
    assert (stats.eviction_count, stats.cached_blocks, stats.free_blocks) == (1, 1, 0)
    with pytest.raises(OutOfBlocksError, match="0 of 6 are free and 1 cached blocks evictable"):
        manager.allocate(AllocationRequest("more", initial_tokens=2 * BLOCK))
    manager.check_invariants()


def test_blocks_without_a_prefix_are_reused_before_cached_ones() -> None:
    manager = make_manager(num_blocks=8)
    admit(manager, "a", PROMPT_A)
    manager.deallocate("a")  # 2 cached, 6 free
    manager.allocate(AllocationRequest("b", initial_tokens=6 * BLOCK))
    assert manager.stats().eviction_count == 0
    assert cached_tokens(manager, "again", PROMPT_A) == 8


def test_the_least_recently_freed_prefix_is_evicted_first_tail_before_head() -> None:
    manager = make_manager(num_blocks=6)
    admit(manager, "a", PROMPT_A)
    admit(manager, "b", PROMPT_B)
    manager.deallocate("a")  # freed first: evicted first
    manager.deallocate("b")
    assert manager.stats().cached_blocks == 4

    manager.allocate(AllocationRequest("one", initial_tokens=3 * BLOCK))  # 2 free + 1 eviction

    assert manager.stats().eviction_count == 1
    assert cached_tokens(manager, "a-head", PROMPT_A) == 4  # a's tail went, its head stayed
    manager.deallocate("one")
    assert cached_tokens(manager, "b-whole", PROMPT_B) == 8


def evictions_of(manager: Manager, operation: Any) -> int:
    before = manager.stats().eviction_count
    operation()
    manager.check_invariants()
    return manager.stats().eviction_count - before


LONG_PROMPT = tuple(range(17))  # 5 blocks: 4 hashed + 1 partial


def test_extend_evicts_when_free_blocks_run_out() -> None:
    manager = make_manager(num_blocks=7)
    admit(manager, "a", LONG_PROMPT)
    manager.deallocate("a")  # 4 cached, 3 free
    grower = manager.allocate(AllocationRequest("g"))
    assert evictions_of(manager, lambda: manager.extend(grower, 4 * BLOCK + 2)) == 2  # 5 blocks: 3 free + 2


def test_a_copy_on_write_evicts_when_no_block_is_free() -> None:
    manager = make_manager(num_blocks=7)
    admit(manager, "a", LONG_PROMPT)
    manager.deallocate("a")
    parent = manager.allocate(AllocationRequest("p"))
    manager.extend(parent, 4 * BLOCK + 2)
    manager.fork(parent, "c")
    assert manager.stats().free_blocks == 0
    assert evictions_of(manager, lambda: manager.extend(parent, 1)) == 1  # the copy of the shared partial block
    assert manager.stats().copy_on_write_count == 1


def test_swap_in_evicts_when_free_blocks_run_out() -> None:
    manager = make_manager(num_blocks=9)
    admit(manager, "a", LONG_PROMPT)
    manager.swap_out("a")  # its 4 hashed blocks stay cached; 5 free
    manager.allocate(AllocationRequest("filler", initial_tokens=4 * BLOCK))  # 1 free left
    assert evictions_of(manager, lambda: manager.swap_in("a")) == 4
    assert cached_tokens(manager, "again", LONG_PROMPT) == 16  # re-registered after the swap-in


def test_pressure_counts_cached_blocks_as_reclaimable() -> None:
    manager = make_manager(num_blocks=10)
    levels: list[MemoryPressure] = []
    manager.set_pressure_callback(levels.append)
    long_prompt = tuple(range(33))  # 8 hashed blocks + 1
    admit(manager, "a", long_prompt)
    assert manager.stats().pressure == MemoryPressure.HIGH  # 9 of 10 used
    manager.deallocate("a")
    assert manager.stats().cached_blocks == 8
    assert manager.stats().pressure == MemoryPressure.LOW  # cached blocks are not "used"
    manager.allocate(AllocationRequest("b", prompt_token_ids=long_prompt))  # revives 8
    assert manager.stats().pressure == MemoryPressure.HIGH
    assert levels == [MemoryPressure.HIGH, MemoryPressure.LOW, MemoryPressure.HIGH]


def test_gc_evicts_every_cached_block_and_reports_it() -> None:
    manager = make_manager(num_blocks=12)
    admit(manager, "a", PROMPT_A)
    admit(manager, "b", PROMPT_B)
    manager.deallocate("a")
    live = manager.stats()

    report = manager.gc()

    assert report.blocks_freed == 2
    assert report.memory_freed == 2 * manager.config.bytes_per_block
    assert report.caches_freed == 0
    assert report.gc_time_ms >= 0
    stats = manager.stats()
    assert (stats.cached_blocks, stats.used_blocks) == (0, live.used_blocks)
    assert stats.free_blocks == live.free_blocks + 2
    assert stats.eviction_count == 2
    assert cached_tokens(manager, "a-again", PROMPT_A) == 0
    assert cached_tokens(manager, "b-again", PROMPT_B) == 8  # live blocks are untouched
    second = manager.gc()
    assert (second.blocks_freed, second.memory_freed) == (0, 0)
    manager.check_invariants()


def test_a_refused_allocation_evicts_nothing() -> None:
    manager = make_manager(num_blocks=4)
    admit(manager, "a", PROMPT_A)
    manager.deallocate("a")
    before = dataclasses.asdict(manager.stats())
    cached = inspect.cached_blocks(manager)
    with pytest.raises(OutOfBlocksError):
        manager.allocate(AllocationRequest("big", initial_tokens=5 * BLOCK))
    after = dataclasses.asdict(manager.stats())
    assert after.pop("allocation_failures") == before.pop("allocation_failures") + 1
    assert after == before
    assert inspect.cached_blocks(manager) == cached
