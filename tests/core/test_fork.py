"""Fork with copy-on-write: forked requests share blocks until one of them writes."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import AllocationRequest, CacheConfig
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.errors import SharedBlockWriteError
from kvcache_core.testing import inspect
from kvcache_core.testing.oracle import dense_attention
from tests.core import support
from tests.core.support import Array, Handle, Manager

LAYERS, HEADS, DIM, BLOCK = 2, 2, 4, 4


class CountingStorage(NumpyStorage):
    """The NumPy storage, recording every ``copy_blocks`` call."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self.copies: list[tuple[list[int], list[int]]] = []

    def copy_blocks(self, source: npt.NDArray[np.int64], destination: npt.NDArray[np.int64]) -> None:
        self.copies.append((source.tolist(), destination.tolist()))
        super().copy_blocks(source, destination)


def counting_manager(
    num_blocks: int = 32, *, enable_prefix_caching: bool = False, **overrides: Any
) -> tuple[Manager, CountingStorage]:
    """A manager over a ``CountingStorage`` and that storage."""
    manager = support.make_manager(
        num_blocks, enable_prefix_caching=enable_prefix_caching, storage=CountingStorage, **overrides
    )
    assert isinstance(manager.storage, CountingStorage)
    return manager, manager.storage


def write_random(manager: Manager, slots: npt.NDArray[np.int64], seed: int) -> list[tuple[Array, Array]]:
    """Write random K/V into ``slots`` in every layer; return them per layer."""
    rng = np.random.default_rng(seed)
    written: list[tuple[Array, Array]] = []
    for layer in range(LAYERS):
        keys = rng.standard_normal((slots.size, HEADS, DIM)).astype(np.float32)
        values = rng.standard_normal((slots.size, HEADS, DIM)).astype(np.float32)
        manager.write(layer, slots, keys, values)
        written.append((keys, values))
    return written


def grow(manager: Manager, handle: Handle, count: int, seed: int) -> list[tuple[Array, Array]]:
    return write_random(manager, manager.extend(handle, count), seed)


def diverged(manager: Manager, shared: int, parent_tokens: int, child_tokens: int) -> tuple[Handle, Handle]:
    """Request ``"p"`` grown by ``shared`` tokens and forked into ``"c"``, then the parent
    grown by ``parent_tokens`` and the child by ``child_tokens`` (seeds 1, 2 and 3)."""
    parent = manager.allocate(AllocationRequest("p"))
    grow(manager, parent, shared, seed=1)
    child = manager.fork(parent, "c")
    grow(manager, parent, parent_tokens, seed=2)
    grow(manager, child, child_tokens, seed=3)
    return parent, child


def test_fork_shares_every_block_holding_tokens_and_copies_nothing() -> None:
    manager, storage = counting_manager()
    parent = manager.allocate(AllocationRequest("p", initial_tokens=20))  # 5 blocks reserved
    grow(manager, parent, 6, seed=1)  # tokens in 2 of them
    used = manager.stats().used_blocks

    child = manager.fork(parent, "c")

    shared = parent.block_table().physical_blocks[:2]
    assert child.block_table().physical_blocks == shared
    assert child.num_tokens() == 6
    assert [inspect.allocator(manager).ref_count(block) for block in shared] == [2, 2]
    assert manager.stats().used_blocks == used  # the reserved empty blocks stay the parent's
    assert storage.copies == []
    assert manager.stats().copy_on_write_count == 0
    for layer in range(LAYERS):
        for got, expected in zip(manager.gather(child, layer), manager.gather(parent, layer), strict=True):
            assert np.array_equal(got, expected)
    manager.check_invariants()


def test_the_first_write_into_a_shared_block_copies_exactly_that_block() -> None:
    manager, storage = counting_manager()
    parent = manager.allocate(AllocationRequest("p"))
    grow(manager, parent, 10, seed=1)  # blocks 0, 1 full; block 2 holds 2 tokens
    child = manager.fork(parent, "c")
    partial = parent.block_table().physical_blocks[2]

    slots = manager.extend(parent, 1)  # position 10: in the shared partial block

    assert len(storage.copies) == 1
    ((source, destination),) = storage.copies
    assert source == [partial]
    assert slots.tolist() == [destination[0] * BLOCK + 2]
    assert parent.block_table().physical_blocks[:2] == child.block_table().physical_blocks[:2]
    assert child.block_table().physical_blocks[2] == partial
    assert manager.stats().copy_on_write_count == 1
    manager.extend(child, 1)  # the block is the child's alone now: no copy
    assert len(storage.copies) == 1
    assert inspect.allocator(manager).ref_count(partial) == 1
    manager.check_invariants()


def test_forked_requests_diverge_without_seeing_each_others_writes() -> None:
    manager, _ = counting_manager()
    parent = manager.allocate(AllocationRequest("p"))
    prefix = grow(manager, parent, 7, seed=1)
    child = manager.fork(parent, "c")

    parent_tail = grow(manager, parent, 5, seed=2)
    child_tail = grow(manager, child, 3, seed=3)

    for layer in range(LAYERS):
        for handle, tail, length in ((parent, parent_tail, 12), (child, child_tail, 10)):
            keys, values = manager.gather(handle, layer)
            assert keys.shape[0] == length
            assert np.array_equal(keys[:7], prefix[layer][0])
            assert np.array_equal(values[:7], prefix[layer][1])
            assert np.array_equal(keys[7:], tail[layer][0])
            assert np.array_equal(values[7:], tail[layer][1])
    manager.check_invariants()


def test_a_fork_at_a_block_boundary_copies_nothing() -> None:
    manager, storage = counting_manager()
    parent, child = diverged(manager, 8, 3, 3)
    assert storage.copies == []
    assert parent.block_table().physical_blocks[:2] == child.block_table().physical_blocks[:2]


def test_writable_slots_copies_only_the_shared_blocks_it_covers() -> None:
    manager, storage = counting_manager()
    parent = manager.allocate(AllocationRequest("p"))
    original = grow(manager, parent, 12, seed=1)
    child = manager.fork(parent, "c")
    before = child.block_table().physical_blocks

    slots = manager.writable_slots(child, 5, 7)  # positions 5 and 6: block 1 only

    assert [source for source, _ in storage.copies] == [[before[1]]]
    after = child.block_table().physical_blocks
    assert (after[0], after[2]) == (before[0], before[2])
    assert after[1] != before[1]
    rewritten = write_random(manager, slots, seed=9)
    for layer in range(LAYERS):
        parent_keys, _ = manager.gather(parent, layer)
        child_keys, _ = manager.gather(child, layer)
        assert np.array_equal(parent_keys, original[layer][0])  # the parent never sees it
        assert np.array_equal(child_keys[5:7], rewritten[layer][0])
        assert np.array_equal(child_keys[:5], original[layer][0][:5])  # the copy kept the rest
        assert np.array_equal(child_keys[7:], original[layer][0][7:])


def test_a_write_into_a_shared_block_is_refused_and_changes_nothing() -> None:
    manager, _ = counting_manager()
    parent = manager.allocate(AllocationRequest("p"))
    slots = manager.extend(parent, 6)
    write_random(manager, slots[:4], seed=1)  # two slots are still unwritten at the fork
    manager.fork(parent, "c")
    pool = np.array(manager.storage.key_cache(0), copy=True)
    keys = np.ones((2, HEADS, DIM), np.float32)

    with pytest.raises(SharedBlockWriteError, match=r"slot \d+ is in block \d+, shared by 2 requests"):
        manager.write(0, slots[4:], keys, keys)

    assert np.array_equal(manager.storage.key_cache(0), pool)
    private = manager.writable_slots(parent, 4, 6)
    manager.write(0, private, keys, keys)  # after the copy, the write goes through
    manager.check_invariants()


def test_reference_counts_stay_exact_through_forks_writes_and_deallocations() -> None:
    manager, storage = counting_manager(num_blocks=40)
    root = manager.allocate(AllocationRequest("root"))
    grow(manager, root, 9, seed=0)
    handles = {"root": root}
    rng = np.random.default_rng(5)
    for step in range(30):
        name = f"f{step}"
        source = handles[sorted(handles)[int(rng.integers(len(handles)))]]
        if len(handles) < 6:
            handles[name] = manager.fork(source, name)
        target = handles[sorted(handles)[int(rng.integers(len(handles)))]]
        grow(manager, target, int(rng.integers(1, 4)), seed=step)
        if len(handles) > 3:
            victim = sorted(handles)[int(rng.integers(len(handles)))]
            manager.deallocate(victim)
            del handles[victim]
        manager.check_invariants()  # reference counts == holders, for every block
    for name in list(handles):
        manager.deallocate(name)
    stats = manager.stats()
    assert (stats.used_blocks, stats.free_blocks) == (0, 40)
    assert stats.copy_on_write_count == len(storage.copies) > 0


def test_attention_over_forked_requests_reads_each_ones_own_tokens() -> None:
    manager, _ = counting_manager()
    parent, child = diverged(manager, 6, 2, 4)
    query = np.random.default_rng(4).standard_normal((2, HEADS, DIM)).astype(np.float32)
    output = manager.paged_attention(0, query, manager.page_table([parent, child]))
    for row, handle in enumerate((parent, child)):
        keys, values = manager.gather(handle, 0)
        expected = dense_attention(query[row : row + 1], keys, values)
        np.testing.assert_allclose(output[row : row + 1], expected, rtol=1e-5, atol=1e-6)


def test_a_forked_prefix_caching_request_caches_its_own_continuation() -> None:
    manager, _ = counting_manager(enable_prefix_caching=True)
    prompt = tuple(range(10))
    parent = manager.allocate(AllocationRequest("p", initial_tokens=10, prompt_token_ids=prompt))
    write_random(manager, manager.extend(parent, 10), seed=1)
    child = manager.fork(parent, "c")
    write_random(manager, manager.extend(child, 6, token_ids=[7, 7, 7, 7, 7, 7]), seed=2)
    follower = manager.allocate(AllocationRequest("f", prompt_token_ids=(*prompt, 7, 7, 7, 7, 7, 7, 1)))
    assert follower.num_cached_tokens() == 16  # two prompt blocks and the child's third
    for layer in range(LAYERS):
        assert np.array_equal(manager.gather(follower, layer)[0], manager.gather(child, layer)[0][:16])
    manager.check_invariants()
