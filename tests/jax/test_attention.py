"""Paged attention under jax.jit equals dense attention on the same K/V: decode and
prefill, causal, grouped-query, ragged batches, every layout; also inside a user's own
jitted step, next to the pure write."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest

import kvcache_jax
from kvcache_core import AllocationRequest, CacheConfig, InvalidArgumentError, PagedKvCacheManager
from kvcache_core.attention.reference import paged_attention as numpy_reference
from kvcache_core.errors import ShapeMismatchError
from kvcache_core.plugin import KV_LAYOUTS
from kvcache_core.testing.oracle import dense_attention_batch
from kvcache_jax import JaxStorage

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int32]

BLOCK_SIZE, NUM_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 8, 40
LENGTHS = (5, 17, 30)


@dataclass(frozen=True)
class PagedBatch:
    """Three ragged requests whose blocks are scattered over a pool full of NaN."""

    contexts: list[tuple[FloatArray, FloatArray]]  # each request's [tokens, heads, dim] K and V
    key_pool: FloatArray
    value_pool: FloatArray
    block_tables: IntArray
    seq_lens: IntArray


def pool_index(kv_layout: str, block: int, offset: int) -> tuple[Any, ...]:
    if kv_layout == "NHD":
        return (block, offset)
    if kv_layout == "HND":
        return (block, slice(None), offset)
    return (slice(None), block, offset)


def make_batch(kv_layout: str, seed: int = 0) -> PagedBatch:
    rng = np.random.default_rng(seed)
    shape = CacheConfig(1, NUM_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE, kv_layout=kv_layout).block_shape()
    key_pool, value_pool = np.full(shape, np.nan), np.full(shape, np.nan)  # padding must never leak
    free = list(rng.permutation(NUM_BLOCKS))
    widest = max(-(-length // BLOCK_SIZE) for length in LENGTHS)
    block_tables = np.zeros((len(LENGTHS), widest), dtype=np.int32)
    contexts: list[tuple[FloatArray, FloatArray]] = []
    for request, length in enumerate(LENGTHS):
        keys = rng.standard_normal((length, NUM_HEADS, HEAD_DIM))
        values = rng.standard_normal((length, NUM_HEADS, HEAD_DIM))
        for position in range(length):
            block_index, offset = divmod(position, BLOCK_SIZE)
            if offset == 0:
                block_tables[request, block_index] = free.pop()
            index = pool_index(kv_layout, int(block_tables[request, block_index]), offset)
            key_pool[index], value_pool[index] = keys[position], values[position]
        contexts.append((keys, values))
    return PagedBatch(contexts, key_pool, value_pool, block_tables, np.asarray(LENGTHS, dtype=np.int32))


SCENARIOS = [
    pytest.param(None, 1, True, None, id="decode"),
    pytest.param(None, 4, True, None, id="decode-gqa"),
    pytest.param((5, 17, 30), 2, True, None, id="prefill-gqa"),
    pytest.param((2, 6, 1), 2, True, None, id="chunked-prefill-ragged"),
    pytest.param((3, 1, 4), 1, False, None, id="non-causal"),
    pytest.param((5, 9, 7), 2, True, 6, id="prefill-sliding-window"),
]

jitted_attention = jax.jit(
    kvcache_jax.paged_attention,
    static_argnames=("max_query_len", "scale", "causal", "kv_layout", "sliding_window", "blocks_per_step"),
)


# Every layout with the default loop (small pools: one step); and one block per loop step,
# which merges many partial softmaxes, on one layout.
LOOPS = [(layout, None) for layout in KV_LAYOUTS] + [("heads_first", 1)]


@pytest.mark.parametrize(("kv_layout", "blocks_per_step"), LOOPS, ids=[f"{lay}-{n or 'auto'}" for lay, n in LOOPS])
@pytest.mark.parametrize(("query_lens", "group", "causal", "window"), SCENARIOS)
def test_jitted_paged_attention_equals_dense_attention_within_1e_5(
    query_lens: tuple[int, ...] | None,
    group: int,
    causal: bool,
    window: int | None,
    kv_layout: str,
    blocks_per_step: int | None,
) -> None:
    batch = make_batch(kv_layout)
    lens = query_lens or (1,) * len(LENGTHS)
    rng = np.random.default_rng(1)
    query = rng.standard_normal((sum(lens), NUM_HEADS * group, HEAD_DIM))
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)

    output = jitted_attention(
        jnp.asarray(query, jnp.float32),
        jnp.asarray(batch.key_pool, jnp.float32),
        jnp.asarray(batch.value_pool, jnp.float32),
        jnp.asarray(batch.block_tables),
        jnp.asarray(batch.seq_lens),
        None if query_lens is None else jnp.asarray(indptr),
        max_query_len=None if query_lens is None else max(lens),
        causal=causal,
        kv_layout=kv_layout,
        sliding_window=window,
        blocks_per_step=blocks_per_step,
    )

    expected = dense_attention_batch(query, batch.contexts, lens, causal=causal, sliding_window=window)
    assert output.dtype == jnp.float32
    assert output.shape == expected.shape
    assert np.abs(np.asarray(output, dtype=np.float64) - expected).max() < 1e-5


def test_padding_requests_and_rows_give_zeros_and_leave_real_rows_alone() -> None:
    batch = make_batch("NHD")
    query = np.random.default_rng(2).standard_normal((3, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    padded_query = np.concatenate([query, np.ones((5, NUM_HEADS, HEAD_DIM), np.float32)])
    block_tables = np.zeros((4, 16), dtype=np.int32)  # one padding request, padded columns
    block_tables[:3, : batch.block_tables.shape[1]] = batch.block_tables
    seq_lens = np.asarray([*LENGTHS, 0], dtype=np.int32)
    indptr = np.asarray([0, 1, 2, 3, 3], dtype=np.int32)
    arguments = (jnp.asarray(batch.key_pool, jnp.float32), jnp.asarray(batch.value_pool, jnp.float32))

    padded = jitted_attention(
        jnp.asarray(padded_query),
        *arguments,
        jnp.asarray(block_tables),
        jnp.asarray(seq_lens),
        jnp.asarray(indptr),
        max_query_len=2,
    )
    plain = jitted_attention(
        jnp.asarray(query), *arguments, jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens)
    )

    assert np.allclose(np.asarray(padded)[:3], np.asarray(plain), rtol=0, atol=1e-6)
    assert not np.asarray(padded)[3:].any()


DTYPE_TOLERANCES = {"float32": (1e-5, 1e-5), "float16": (2e-3, 4e-3), "bfloat16": (1.6e-2, 3e-2)}


MANAGER_CASES = [("float32", layout) for layout in KV_LAYOUTS] + [("float16", "NHD"), ("bfloat16", "heads_first")]


@pytest.mark.parametrize(("dtype", "kv_layout"), MANAGER_CASES)
def test_the_managers_paged_attention_matches_the_numpy_reference(dtype: str, kv_layout: str) -> None:
    config = CacheConfig(2, NUM_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE, dtype=dtype, kv_layout=kv_layout)
    storage = JaxStorage(config)
    manager = PagedKvCacheManager(storage, backend="jax")
    rng = np.random.default_rng(3)
    host_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(len(LENGTHS))]
    for first in range(0, max(LENGTHS), BLOCK_SIZE):  # grown a block at a time in turn: interleaved
        growing = [
            (handle, min(BLOCK_SIZE, length - first))
            for handle, length in zip(handles, LENGTHS, strict=True)
            if length > first
        ]
        slots = np.concatenate([manager.extend(handle, count) for handle, count in growing])
        for layer in range(2):
            keys = rng.standard_normal((len(slots), NUM_HEADS, HEAD_DIM)).astype(host_dtype)
            manager.write(layer, slots, storage.from_numpy(keys), storage.from_numpy(keys * 2))
    table = manager.page_table(handles)
    indptr = np.asarray([0, 2, 9, 12], dtype=np.int32)
    query = rng.standard_normal((12, NUM_HEADS * 2, HEAD_DIM)).astype(host_dtype)

    output = manager.paged_attention(1, storage.from_numpy(query), table, qo_indptr=indptr)

    expected = numpy_reference(
        query.astype(np.float64),
        storage.to_numpy(storage.key_cache(1)).astype(np.float64),
        storage.to_numpy(storage.value_cache(1)).astype(np.float64),
        table,
        qo_indptr=indptr,
        kv_layout=kv_layout,
    )
    assert output.dtype.name == dtype
    rtol, atol = DTYPE_TOLERANCES[dtype]
    assert np.allclose(storage.to_numpy(output).astype(np.float64), expected, rtol=rtol, atol=atol)


def test_a_users_jitted_step_writes_and_attends_on_donated_pools() -> None:
    """The pure forms inside one jitted model step that donates the pool, then handed back."""
    config = CacheConfig(1, NUM_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE, kv_layout="heads_first")
    storage = JaxStorage(config)
    manager = PagedKvCacheManager(storage, backend="jax")
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(2)]
    rng = np.random.default_rng(4)
    contexts = [rng.standard_normal((length, NUM_HEADS, HEAD_DIM)) for length in (6, 11)]

    @partial(jax.jit, donate_argnums=(1, 2))
    def model_step(
        query: jax.Array,
        key_pool: jax.Array,
        value_pool: jax.Array,
        slots: jax.Array,
        new_tokens: jax.Array,
        block_tables: jax.Array,
        seq_lens: jax.Array,
        qo_indptr: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        key_pool, value_pool = kvcache_jax.write(
            key_pool, value_pool, slots, new_tokens, -new_tokens, kv_layout="heads_first"
        )
        output = kvcache_jax.paged_attention(
            query, key_pool, value_pool, block_tables, seq_lens, qo_indptr, max_query_len=11, kv_layout="heads_first"
        )
        return output, key_pool, value_pool

    slots = np.concatenate([manager.extend(handle, len(ctx)) for handle, ctx in zip(handles, contexts, strict=True)])
    table = manager.page_table(handles)
    query = rng.standard_normal((17, NUM_HEADS * 2, HEAD_DIM))
    key_pool, value_pool = storage.key_cache(0), storage.value_cache(0)
    output, new_keys, new_values = model_step(
        jnp.asarray(query, jnp.float32),
        key_pool,
        value_pool,
        jnp.asarray(slots, jnp.int32),
        jnp.asarray(np.concatenate(contexts), jnp.float32),
        jnp.asarray(table.block_tables),
        jnp.asarray(table.seq_lens),
        jnp.asarray([0, 6, 17], jnp.int32),
    )

    assert key_pool.is_deleted()
    assert value_pool.is_deleted()
    expected = dense_attention_batch(query, [(ctx, -ctx) for ctx in contexts], (6, 11), causal=True)
    assert np.abs(np.asarray(output, dtype=np.float64) - expected).max() < 1e-5
    storage.replace_layer(0, new_keys, new_values)
    gathered_keys, gathered_values = manager.gather(handles[1], 0)
    assert np.array_equal(np.asarray(gathered_keys), contexts[1].astype(np.float32))
    assert np.array_equal(np.asarray(gathered_values), -contexts[1].astype(np.float32))


def test_bad_arguments_to_the_pure_function_raise_kvcache_errors() -> None:
    pool = jnp.zeros((8, 4, 2, 8))
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.asarray([3, 5], jnp.int32)
    query = jnp.zeros((2, 4, 8))
    with pytest.raises(ShapeMismatchError, match=r"query must be \[tokens, k \* 2, 8\].*\(2, 3, 8\)"):
        kvcache_jax.paged_attention(jnp.zeros((2, 3, 8)), pool, pool, tables, lens)
    with pytest.raises(ShapeMismatchError, match="one query per request: 2 requests, 3 query rows"):
        kvcache_jax.paged_attention(jnp.zeros((3, 4, 8)), pool, pool, tables, lens)
    with pytest.raises(ShapeMismatchError, match=r"qo_indptr must be \[3\]"):
        kvcache_jax.paged_attention(query, pool, pool, tables, lens, jnp.asarray([0, 2], jnp.int32))
    with pytest.raises(ShapeMismatchError, match="share one shape but for their last axis"):
        kvcache_jax.paged_attention(query, pool, jnp.zeros((8, 4, 3, 8)), tables, lens)
    with pytest.raises(InvalidArgumentError, match=r"scale.*-1.0"):
        kvcache_jax.paged_attention(query, pool, pool, tables, lens, scale=-1.0)
    with pytest.raises(InvalidArgumentError, match=r"kv_layout 'DHN'.*NHD, HND, heads_first"):
        kvcache_jax.paged_attention(query, pool, pool, tables, lens, kv_layout="DHN")
    with pytest.raises(InvalidArgumentError, match=r"sliding_window.*0"):
        kvcache_jax.paged_attention(query, pool, pool, tables, lens, sliding_window=0)
    with pytest.raises(InvalidArgumentError, match=r"blocks_per_step.*0"):
        kvcache_jax.paged_attention(query, pool, pool, tables, lens, blocks_per_step=0)
    with pytest.raises(ShapeMismatchError, match=r"keys \[n, 2, 8\] and values \[n, 2, 8\]"):
        kvcache_jax.write(pool, pool, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2, 4)), jnp.zeros((2, 2, 4)))


def test_the_pure_write_drops_slots_outside_the_pool_even_negative_ones() -> None:
    pool = jnp.zeros((2, 4, 1, 1))
    slots = jnp.asarray([-1, 3, 8, 100], jnp.int32)
    keys, _ = kvcache_jax.write(pool, pool, slots, jnp.ones((4, 1, 1)), jnp.ones((4, 1, 1)))
    assert np.asarray(keys).ravel().tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
