"""Paged attention equals dense attention computed from scratch."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core import (
    AllocationRequest,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    PageTable,
)
from kvcache_core.attention.reference import paged_attention
from kvcache_core.testing.oracle import dense_attention
from tests.core.support import Array, make_manager


def fill(
    manager: PagedKvCacheManager[Array], lengths: list[int], rng: np.random.Generator, layer: int = 0
) -> tuple[list[PagedKvCacheHandle[Array]], list[tuple[Array, Array]]]:
    """Allocate requests, grow them side by side in uneven steps, write random K/V."""
    config = manager.config
    handles = [manager.allocate(AllocationRequest(f"r{i}")) for i in range(len(lengths))]
    data = [
        (
            rng.standard_normal((n, config.num_heads, config.head_dim)).astype(config.dtype),
            rng.standard_normal((n, config.num_heads, config.head_dim)).astype(config.dtype),
        )
        for n in lengths
    ]
    written = [0] * len(lengths)
    while written != lengths:
        slots: list[npt.NDArray[np.int64]] = []
        keys: list[Array] = []
        values: list[Array] = []
        for index, handle in enumerate(handles):
            step = min(int(rng.integers(1, 6)), lengths[index] - written[index])
            if step == 0:
                continue
            slots.append(manager.extend(handle, step))
            keys.append(data[index][0][written[index] : written[index] + step])
            values.append(data[index][1][written[index] : written[index] + step])
            written[index] += step
        manager.write(layer, np.concatenate(slots), np.concatenate(keys), np.concatenate(values))
    return handles, data


def make(
    layout: str = "NHD",
    heads: int = 2,
    dim: int = 8,
    blocks: int = 128,
    dtype: str = "float64",
    placement: str = "contiguous",
    block_size: int = 4,
) -> PagedKvCacheManager[Array]:
    """A one-layer NumPy manager without prefix caching (``tests.core.support.make_manager``)."""
    return make_manager(
        blocks,
        block_size,
        placement="fifo" if placement == "fifo" else "contiguous",
        num_layers=1,
        num_heads=heads,
        head_dim=dim,
        enable_prefix_caching=False,
        dtype=dtype,
        kv_layout=layout,
    )


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
@pytest.mark.parametrize("placement", ["contiguous", "fifo"])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_of_a_ragged_batch_equals_dense(layout: str, placement: str, group: int) -> None:
    rng = np.random.default_rng(0)
    manager = make(layout, placement=placement)
    lengths = [1, 4, 5, 13, 30]
    handles, data = fill(manager, lengths, rng)
    if placement == "fifo":
        assert any(len(h.block_table().runs()) > 1 for h in handles)  # runs really are merged
    query = rng.standard_normal((len(lengths), 2 * group, 8))
    out = manager.paged_attention(0, query, manager.page_table(handles))
    for b, (keys, values) in enumerate(data):
        np.testing.assert_allclose(out[b : b + 1], dense_attention(query[b : b + 1], keys, values), atol=1e-12)


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
def test_prefill_and_chunked_prefill_in_one_batch_equal_dense(layout: str) -> None:
    rng = np.random.default_rng(1)
    manager = make(layout, placement="fifo")
    lengths = [9, 17, 3, 22]
    query_counts = [9, 5, 1, 22]  # full prefill, chunk on a non-empty cache, decode, prefill
    handles, data = fill(manager, lengths, rng)
    query = rng.standard_normal((sum(query_counts), 4, 8))
    indptr = np.concatenate(([0], np.cumsum(query_counts)))
    out = manager.paged_attention(0, query, manager.page_table(handles), qo_indptr=indptr)
    for b, (keys, values) in enumerate(data):
        rows = slice(int(indptr[b]), int(indptr[b + 1]))
        np.testing.assert_allclose(out[rows], dense_attention(query[rows], keys, values), atol=1e-12)


def test_non_causal_attention_sees_the_whole_sequence() -> None:
    rng = np.random.default_rng(2)
    manager = make()
    handles, data = fill(manager, [6, 11], rng)
    query = rng.standard_normal((6, 2, 8))
    indptr = np.array([0, 3, 6])
    out = manager.paged_attention(0, query, manager.page_table(handles), qo_indptr=indptr, causal=False)
    for b, (keys, values) in enumerate(data):
        rows = slice(3 * b, 3 * b + 3)
        np.testing.assert_allclose(out[rows], dense_attention(query[rows], keys, values, causal=False), atol=1e-12)


def test_float32_pool_matches_within_float32_tolerance() -> None:
    rng = np.random.default_rng(3)
    manager = make(dtype="float32", dim=64, heads=4)
    handles, data = fill(manager, [100, 37], rng)
    query = rng.standard_normal((2, 16, 64)).astype(np.float32)
    out = manager.paged_attention(0, query, manager.page_table(handles))
    assert out.dtype == np.float32
    for b, (keys, values) in enumerate(data):
        np.testing.assert_allclose(out[b : b + 1], dense_attention(query[b : b + 1], keys, values), atol=1e-5)


def test_a_custom_scale_is_applied() -> None:
    rng = np.random.default_rng(4)
    manager = make()
    handles, data = fill(manager, [12], rng)
    query = rng.standard_normal((1, 2, 8))
    out = manager.paged_attention(0, query, manager.page_table(handles), scale=2.0 / np.sqrt(8))
    expected = dense_attention(query * 2.0, data[0][0], data[0][1])
    np.testing.assert_allclose(out, expected, atol=1e-12)


@settings(max_examples=40)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    group=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(["NHD", "HND", "heads_first"]),
    placement=st.sampled_from(["contiguous", "fifo"]),
)
def test_any_ragged_decode_batch_equals_dense(
    lengths: list[int], group: int, seed: int, layout: str, placement: str
) -> None:
    rng = np.random.default_rng(seed)
    manager = make(layout, placement=placement)
    handles, data = fill(manager, lengths, rng)
    query = rng.standard_normal((len(lengths), 2 * group, 8))
    out = manager.paged_attention(0, query, manager.page_table(handles))
    for b, (keys, values) in enumerate(data):
        np.testing.assert_allclose(out[b : b + 1], dense_attention(query[b : b + 1], keys, values), atol=1e-10)


def test_the_free_function_reads_a_hand_built_page_table() -> None:
    """FlashInfer's CSR arrays, written by hand, over a pool filled by hand."""
    rng = np.random.default_rng(5)
    pool_keys = rng.standard_normal((6, 4, 1, 8))
    pool_values = rng.standard_normal((6, 4, 1, 8))
    pages = [5, 0, 3]  # request of 10 tokens: blocks 5, 0 and the first 2 tokens of 3
    table = PageTable(
        kv_indptr=np.array([0, 3]),
        kv_indices=np.array(pages),
        kv_last_page_len=np.array([2]),
        block_tables=np.array([pages]),
        seq_lens=np.array([10]),
        block_size=4,
    )
    keys = pool_keys[pages].reshape(-1, 1, 8)[:10]
    values = pool_values[pages].reshape(-1, 1, 8)[:10]
    query = rng.standard_normal((1, 2, 8))
    out = paged_attention(query, pool_keys, pool_values, table)
    np.testing.assert_allclose(out, dense_attention(query, keys, values), atol=1e-12)


def test_attention_reads_the_pool_in_place_without_copying_the_context() -> None:
    """Each run is a view of the pool: changing a key in the pool after building the page
    table changes the result."""
    rng = np.random.default_rng(6)
    manager = make(blocks=32)
    handles, data = fill(manager, [40], rng)
    query = rng.standard_normal((1, 2, 8))
    table = manager.page_table(handles)
    before = manager.paged_attention(0, query, table)
    key_pool = handles[0].key_cache(0)
    assert key_pool is not None
    key_pool[table.kv_indices[0], 0] += 1.0  # the first token's keys, in place
    after = manager.paged_attention(0, query, table)
    assert not np.allclose(before, after)
    keys = data[0][0].copy()
    keys[0] += 1.0
    np.testing.assert_allclose(after, dense_attention(query, keys, data[0][1]), atol=1e-12)


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
def test_decode_allocates_far_less_than_the_context(layout: str) -> None:
    """A copy of the context would allocate at least its K bytes; the views do not (the HND
    path keeps one partial output per block, a 1/block_size share)."""
    import tracemalloc

    rng = np.random.default_rng(7)
    manager = make(layout, heads=2, dim=64, blocks=150, block_size=16)
    handles, _ = fill(manager, [2000], rng)
    query = rng.standard_normal((1, 2, 64))
    table = manager.page_table(handles)
    manager.paged_attention(0, query, table)  # warm caches
    context_key_bytes = 2000 * 2 * 64 * 8
    tracemalloc.start()
    manager.paged_attention(0, query, table)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < context_key_bytes / 4, (peak, context_key_bytes)


def test_long_prefill_split_into_query_chunks_equals_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """The score buffer is bounded by chunking query rows; chunks must not change results."""
    import kvcache_core.attention.reference as attention_module

    monkeypatch.setattr(attention_module, "_SCORE_BUDGET", 2 * 30 * 3)  # a few rows per chunk
    rng = np.random.default_rng(8)
    manager = make(placement="fifo")
    handles, data = fill(manager, [30, 25], rng)
    query = rng.standard_normal((55, 4, 8))
    indptr = np.array([0, 30, 55])
    out = manager.paged_attention(0, query, manager.page_table(handles), qo_indptr=indptr)
    for b, (keys, values) in enumerate(data):
        rows = slice(int(indptr[b]), int(indptr[b + 1]))
        np.testing.assert_allclose(out[rows], dense_attention(query[rows], keys, values), atol=1e-12)
