"""Swapping: a request's blocks go to host memory and come back bit-identical."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest

from kvcache_core import AllocationRequest, OutOfBlocksError, UnknownRequestError
from kvcache_core.errors import InvalidHandleError, NotSwappedOutError, SwappedOutError
from kvcache_core.testing import inspect
from tests.core import support
from tests.core.support import Array, Handle, Manager

LAYERS, HEADS, DIM, BLOCK = 2, 2, 4, 4


make_manager = partial(support.make_manager, num_blocks=16, enable_prefix_caching=False)


def grow(manager: Manager, handle: Handle, count: int, seed: int, dtype: str = "float32") -> None:
    rng = np.random.default_rng(seed)
    slots = manager.extend(handle, count)
    for layer in range(LAYERS):
        keys = rng.standard_normal((count, HEADS, DIM)).astype(dtype)
        values = rng.standard_normal((count, HEADS, DIM)).astype(dtype)
        manager.write(layer, slots, keys, values)


def contents(manager: Manager, handle: Handle) -> list[tuple[Array, Array]]:
    return [manager.gather(handle, layer) for layer in range(LAYERS)]


def assert_same_contents(after: list[tuple[Array, Array]], before: list[tuple[Array, Array]]) -> None:
    for (keys, values), (keys_before, values_before) in zip(after, before, strict=True):
        assert keys.dtype == keys_before.dtype
        assert np.array_equal(keys.view(np.uint8), keys_before.view(np.uint8))  # bit for bit
        assert np.array_equal(values.view(np.uint8), values_before.view(np.uint8))


def test_swap_out_returns_the_blocks_and_reports_host_figures() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a", initial_tokens=16))
    grow(manager, handle, 10, seed=1)

    manager.swap_out("a")

    stats = manager.stats()
    assert (stats.used_blocks, stats.free_blocks) == (0, 16)
    assert (stats.swapped_out_requests, stats.swapped_out_blocks) == (1, 3)  # the reserved 4th is just freed
    assert stats.swapped_out_memory_bytes == 3 * manager.config.bytes_per_block
    assert stats.active_caches == 1
    assert handle.is_valid()
    assert handle.is_swapped_out()
    assert handle.num_tokens() == 0
    assert handle.stats().blocks_allocated == 0
    manager.check_invariants()


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_swap_in_brings_the_blocks_back_bit_identical_into_other_blocks(layout: str, dtype: str) -> None:
    manager = make_manager(kv_layout=layout, dtype=dtype)
    handle = manager.allocate(AllocationRequest("a"))
    grow(manager, handle, 11, seed=1, dtype=dtype)
    before = contents(manager, handle)
    old_blocks = handle.block_table().physical_blocks
    manager.swap_out("a")
    squatter = manager.allocate(AllocationRequest("squatter", initial_tokens=4 * 8))
    grow(manager, squatter, 32, seed=2, dtype=dtype)  # overwrites the blocks "a" left

    manager.swap_in("a")

    assert not handle.is_swapped_out()
    assert handle.num_tokens() == 11
    assert set(handle.block_table().physical_blocks).isdisjoint(squatter.block_table().physical_blocks)
    assert handle.block_table().physical_blocks != old_blocks
    assert_same_contents(contents(manager, handle), before)
    grow(manager, handle, 3, seed=3, dtype=dtype)  # it grows on as before
    assert handle.num_tokens() == 14
    manager.check_invariants()


def test_a_swapped_out_handle_refuses_data_access_and_says_so() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a"))
    slots = manager.extend(handle, 5)
    stale_page_table = manager.page_table([handle])
    manager.swap_out("a")
    keys = np.zeros((5, HEADS, DIM), np.float32)
    query = np.zeros((1, HEADS, DIM), np.float32)
    calls: dict[str, Callable[[], object]] = {
        "key_cache": lambda: handle.key_cache(0),
        "value_cache": lambda: handle.value_cache(1),
        "kv_cache": lambda: handle.kv_cache(0),
        "gather": lambda: manager.gather(handle, 0),
        "extend": lambda: manager.extend(handle, 1),
        "writable_slots": lambda: manager.writable_slots(handle, 0, 1),
        "page_table": lambda: manager.page_table([handle]),
        "fork": lambda: manager.fork(handle, "b"),
        "write": lambda: manager.write(0, slots, keys, keys),
        "attention": lambda: manager.paged_attention(0, query, stale_page_table),
    }
    for name, call in calls.items():
        with pytest.raises(SwappedOutError, match="swapped out") as caught:
            call()
        assert isinstance(caught.value, InvalidHandleError), name
    assert handle.is_valid()
    manager.check_invariants()


def test_swap_in_that_does_not_fit_changes_nothing() -> None:
    manager = make_manager(num_blocks=6)
    handle = manager.allocate(AllocationRequest("a"))
    grow(manager, handle, 12, seed=1)
    before = contents(manager, handle)
    manager.swap_out("a")
    manager.allocate(AllocationRequest("b", initial_tokens=16))  # 4 of 6 blocks: 2 left, 3 needed
    stats = dataclasses.asdict(manager.stats())

    with pytest.raises(OutOfBlocksError, match="cannot swap in request 'a': it needs 3 blocks, 2 of 6 are free"):
        manager.swap_in("a")

    after = dataclasses.asdict(manager.stats())
    assert after.pop("allocation_failures") == stats.pop("allocation_failures") + 1
    assert after == stats
    assert handle.is_swapped_out()
    manager.deallocate("b")
    manager.swap_in("a")
    assert_same_contents(contents(manager, handle), before)


def test_swapping_out_a_request_that_shares_blocks_leaves_them_to_the_other() -> None:
    manager = make_manager()
    parent = manager.allocate(AllocationRequest("p"))
    grow(manager, parent, 10, seed=1)
    child = manager.fork(parent, "c")
    parent_before, child_before = contents(manager, parent), contents(manager, child)
    shared = child.block_table().physical_blocks

    manager.swap_out("p")

    assert child.block_table().physical_blocks == shared
    assert all(inspect.allocator(manager).ref_count(block) == 1 for block in shared)
    assert_same_contents(contents(manager, child), child_before)
    grow(manager, child, 4, seed=2)  # the child's blocks are its own now: no copy needed
    assert manager.stats().copy_on_write_count == 0
    manager.swap_in("p")
    assert set(parent.block_table().physical_blocks).isdisjoint(child.block_table().physical_blocks)
    assert_same_contents(contents(manager, parent), parent_before)
    manager.check_invariants()


def test_swap_with_prefix_caching_keeps_the_cached_blocks_findable() -> None:
    manager = make_manager(enable_prefix_caching=True)
    prompt = tuple(range(13))
    handle = manager.allocate(AllocationRequest("a", initial_tokens=13, prompt_token_ids=prompt))
    grow(manager, handle, 13, seed=1)
    before = contents(manager, handle)
    manager.swap_out("a")
    assert manager.stats().cached_blocks == 3  # its hashed blocks stay cached
    manager.gc()  # and may be evicted while it is away

    manager.swap_in("a")

    assert_same_contents(contents(manager, handle), before)
    follower = manager.allocate(AllocationRequest("b", prompt_token_ids=prompt))
    assert follower.num_cached_tokens() == 12  # the restored blocks are registered again
    manager.check_invariants()


def test_swap_state_errors_name_the_request() -> None:
    manager = make_manager()
    manager.allocate(AllocationRequest("a", initial_tokens=4))
    with pytest.raises(NotSwappedOutError, match="'a' is resident"):
        manager.swap_in("a")
    manager.swap_out("a")
    with pytest.raises(SwappedOutError, match="'a' is already swapped out"):
        manager.swap_out("a")
    with pytest.raises(UnknownRequestError, match="'nope'"):
        manager.swap_out("nope")
    with pytest.raises(UnknownRequestError, match="'nope'"):
        manager.swap_in("nope")


def test_deallocating_a_swapped_out_request_drops_its_host_copy() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a"))
    grow(manager, handle, 6, seed=1)
    manager.swap_out("a")
    manager.deallocate("a")
    stats = manager.stats()
    assert (stats.swapped_out_requests, stats.swapped_out_blocks, stats.active_caches) == (0, 0, 0)
    assert not handle.is_valid()
    with pytest.raises(UnknownRequestError):
        manager.swap_in("a")
    manager.check_invariants()
