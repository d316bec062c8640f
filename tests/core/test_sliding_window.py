"""Sliding window: blocks older than the window are released; attention sees the last W tokens."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest

from kvcache_core import (
    AllocationRequest,
    BlockTable,
    InvalidArgumentError,
)
from kvcache_core.attention.reference import paged_attention
from kvcache_core.testing.oracle import dense_attention
from tests.core import support
from tests.core.support import Manager

LAYERS, HEADS, DIM, GROUP = 1, 2, 4, 2


make_manager = partial(support.make_manager, num_layers=LAYERS, enable_prefix_caching=False)


class History:
    """A request and every K/V it ever wrote (what a full-attention cache would hold)."""

    def __init__(self, manager: Manager, request_id: str, seed: int) -> None:
        self.manager = manager
        self.handle = manager.allocate(AllocationRequest(request_id))
        self.rng = np.random.default_rng(seed)
        self.keys = np.zeros((0, HEADS, DIM), np.float32)
        self.values = np.zeros((0, HEADS, DIM), np.float32)

    def grow(self, count: int) -> None:
        slots = self.manager.extend(self.handle, count)
        keys = self.rng.standard_normal((count, HEADS, DIM)).astype(np.float32)
        values = self.rng.standard_normal((count, HEADS, DIM)).astype(np.float32)
        self.manager.write(0, slots, keys, values)
        self.keys = np.concatenate([self.keys, keys])
        self.values = np.concatenate([self.values, values])

    def check_attention(self, num_queries: int, *, causal: bool, window: int) -> None:
        query = self.rng.standard_normal((num_queries, HEADS * GROUP, DIM)).astype(np.float32)
        page_table = self.manager.page_table([self.handle])
        output = self.manager.paged_attention(0, query, page_table, qo_indptr=np.array([0, num_queries]), causal=causal)
        expected = dense_attention(query, self.keys, self.values, causal=causal, sliding_window=window)
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("window", "block_size"), [(1, 4), (5, 4), (8, 4), (16, 16), (17, 16), (3, 1)])
def test_a_growing_request_never_holds_more_than_the_window_needs(window: int, block_size: int) -> None:
    limit = -(-window // block_size) + 1
    manager = make_manager(block_size=block_size, sliding_window=window, num_blocks=limit)  # no room for more
    history = History(manager, "a", seed=window)
    for _ in range(6 * window + 3 * block_size):
        history.grow(1)
        table = history.handle.block_table()
        assert table.num_blocks() <= limit, table
        oldest_needed = max(0, table.sequence_length - 1 - window + 1)  # the last token's window
        assert table.first_logical * block_size <= oldest_needed
        assert manager.stats().used_blocks == table.num_blocks()
        manager.check_invariants()
    assert history.handle.block_table().first_logical > 0


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
@pytest.mark.parametrize(("window", "block_size"), [(5, 4), (8, 4), (3, 2)])
def test_decode_attention_sees_only_the_last_window_tokens(layout: str, window: int, block_size: int) -> None:
    manager = make_manager(block_size=block_size, sliding_window=window, num_blocks=16, kv_layout=layout)
    history = History(manager, "a", seed=1)
    for _ in range(23):
        history.grow(1)
        history.check_attention(1, causal=True, window=window)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_attention_honours_each_querys_own_window(causal: bool) -> None:
    window, block_size = 6, 4
    manager = make_manager(block_size=block_size, sliding_window=window, num_blocks=32)
    history = History(manager, "a", seed=2)
    history.grow(9)
    history.check_attention(9, causal=causal, window=window)
    history.grow(13)  # a chunk: its first query still needs keys from before the chunk
    table = history.handle.block_table()
    assert table.first_logical == (9 - window + 1) // block_size
    history.check_attention(13, causal=causal, window=window)
    history.check_attention(4, causal=causal, window=window)


def test_the_reference_takes_the_window_as_an_argument_or_from_the_page_table() -> None:
    manager = make_manager(sliding_window=5, block_size=4, num_blocks=16)
    history = History(manager, "a", seed=3)
    history.grow(11)
    with_window = manager.page_table([history.handle])
    without = dataclasses.replace(with_window, sliding_window=None)
    query = np.ones((3, HEADS * GROUP, DIM), np.float32)
    pool = manager.storage.key_cache(0), manager.storage.value_cache(0)
    indptr = np.array([0, 3])

    from_table = paged_attention(query, *pool, with_window, qo_indptr=indptr)
    from_argument = paged_attention(query, *pool, without, qo_indptr=indptr, sliding_window=5)
    no_window = paged_attention(query, *pool, without, qo_indptr=indptr)

    assert np.array_equal(from_table, from_argument)
    assert not np.allclose(from_table, no_window)
    with pytest.raises(InvalidArgumentError, match="sliding_window=4 contradicts the page table's sliding_window=5"):
        paged_attention(query, *pool, with_window, qo_indptr=indptr, sliding_window=4)


def test_the_page_table_lists_held_blocks_from_the_first_one() -> None:
    manager = make_manager(sliding_window=4, block_size=4, num_blocks=16)
    history = History(manager, "a", seed=4)
    history.grow(14)
    history.grow(1)  # position 14: its window starts at 11, in block 2
    table = history.handle.block_table()
    page_table = manager.page_table([history.handle])
    assert table.first_logical == 2
    assert page_table.blocks(0).tolist() == list(table.physical_blocks)
    assert page_table.seq_lens.tolist() == [15 - 8]
    assert page_table.sliding_window == 4
    keys, _ = manager.gather(history.handle, 0)
    assert np.array_equal(keys, history.keys[8:])  # gather returns the held tokens


def test_released_blocks_are_recorded_in_the_block_table() -> None:
    table = BlockTable(4, [7, 8, 9], 10)
    assert table.release_leading(2) == [7, 8]
    assert table.first_logical == 2
    assert table.physical_blocks == (9,)
    assert list(table.logical_to_physical) == [-1, -1, 0]
    assert table.capacity() == 12
    assert table.free_tokens() == 2
    assert table.slots(8, 10).tolist() == [36, 37]
    assert table.runs()[0].first_logical == 2
    assert BlockTable.from_dict(table.to_dict()) == table
    with pytest.raises(InvalidArgumentError, match=r"\[5, 9\) is outside \[8, 12\]"):
        table.slots(5, 9)
    table.add_blocks([3])
    table.extend_sequence(2)
    assert list(table.logical_to_physical) == [-1, -1, 0, 1]


def test_key_cache_is_none_when_the_window_released_every_block() -> None:
    manager = make_manager(sliding_window=1, block_size=4, num_blocks=16, enable_prefix_caching=True)
    prompt = tuple(range(9))
    first = manager.allocate(AllocationRequest("a", initial_tokens=9, prompt_token_ids=prompt))
    slots = manager.extend(first, 9)
    manager.write(0, slots, np.ones((9, HEADS, DIM), np.float32), np.ones((9, HEADS, DIM), np.float32))
    # Position 8 (the first to compute) sees only itself: the two cached blocks are not mapped.
    second = manager.allocate(AllocationRequest("b", prompt_token_ids=prompt))
    assert second.num_cached_tokens() == 8
    assert second.block_table().num_blocks() == 0
    assert second.block_table().first_logical == 2
    assert second.key_cache(0) is None
    assert second.kv_cache(0) == (None, None)
    manager.extend(second, 1)
    assert second.key_cache(0) is not None
    manager.check_invariants()


def test_a_page_table_without_the_pools_window_is_refused() -> None:
    manager = make_manager(sliding_window=4, block_size=4, num_blocks=8)
    history = History(manager, "a", seed=5)
    history.grow(6)
    stripped = dataclasses.replace(manager.page_table([history.handle]), sliding_window=None)
    with pytest.raises(InvalidArgumentError, match="sliding_window None != the pool's sliding_window 4"):
        manager.paged_attention(0, np.ones((1, HEADS, DIM), np.float32), stripped)


def test_a_windowed_request_survives_fork_and_swap() -> None:
    manager = make_manager(sliding_window=5, block_size=4, num_blocks=16)
    history = History(manager, "a", seed=6)
    history.grow(17)
    child = manager.fork(history.handle, "c")
    assert child.block_table().first_logical == history.handle.block_table().first_logical
    held = manager.gather(history.handle, 0)
    manager.swap_out("a")
    manager.swap_in("a")
    assert history.handle.block_table().first_logical == child.block_table().first_logical
    for got, expected in zip(manager.gather(history.handle, 0), held, strict=True):
        assert np.array_equal(got, expected)
    history.grow(3)
    history.check_attention(2, causal=True, window=5)
    manager.check_invariants()
