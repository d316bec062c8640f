"""Shape buckets keep a decode loop on a few compiled programs: a 500-step decode with a
growing context compiles a handful of times, not once a step."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, PageTable
from kvcache_jax import JaxStorage, bucket, pad_batch
from kvcache_jax.buckets import MIN_BLOCK_BUCKET, pad_slots

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def test_buckets_are_the_next_power_of_two() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 1000)] == [1, 1, 2, 4, 8, 8, 16, 1024]
    assert bucket(3, minimum=16) == 16
    assert bucket(17, minimum=16) == 32


def test_padded_slots_are_distinct_and_past_the_pool() -> None:
    padded = pad_slots(np.asarray([7, 3, 12]), total_slots=16)
    assert padded.dtype == np.int32
    assert padded.tolist() == [7, 3, 12, 19]
    assert pad_slots(np.asarray([1, 2, 3, 4, 5]), total_slots=8).tolist() == [1, 2, 3, 4, 5, 13, 14, 15]


def test_a_padded_batch_masks_its_padding() -> None:
    table = PageTable(
        kv_indptr=np.asarray([0, 2, 5]),
        kv_indices=np.asarray([4, 5, 0, 1, 2]),
        kv_last_page_len=np.asarray([3, 1]),
        block_tables=np.asarray([[4, 5, 0], [0, 1, 2]]),
        seq_lens=np.asarray([7, 9]),
        block_size=4,
    )
    padded = pad_batch(table, np.asarray([0, 3, 4], dtype=np.int32))
    assert padded.block_tables.shape == (2, MIN_BLOCK_BUCKET)
    assert padded.block_tables[:, :3].tolist() == [[4, 5, 0], [0, 1, 2]]
    assert padded.seq_lens.tolist() == [7, 9]
    assert padded.qo_indptr.tolist() == [0, 3, 4]
    assert (padded.max_query_len, padded.query_rows, padded.total_queries) == (4, 4, 4)
    decode = pad_batch(table, np.asarray([0, 1, 2], dtype=np.int32))
    assert (decode.max_query_len, decode.query_rows, decode.total_queries) == (1, 2, 2)


@pytest.fixture
def compilations() -> Iterator[list[str]]:
    """Names of the XLA compilations that happen while the test runs."""
    events: list[str] = []

    def listener(event: str, duration_secs: float, **metadata: str | int) -> None:
        if event == COMPILE_EVENT:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


def decode(manager: PagedKvCacheManager[jax.Array], steps: int, batch: int) -> list[int]:
    """Prefill ``batch`` ragged requests, then ``steps`` decode steps (a write and an
    attention per layer); returns the context lengths reached."""
    storage = manager.storage
    config = manager.config
    rng = np.random.default_rng(0)
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(batch)]
    for index, handle in enumerate(handles):
        slots = manager.extend(handle, 3 + 4 * index)
        tokens = storage.from_numpy(rng.standard_normal((len(slots), config.num_heads, config.head_dim), np.float32))
        for layer in range(config.num_layers):
            manager.write(layer, slots, tokens, tokens)
    tokens = storage.from_numpy(rng.standard_normal((batch, config.num_heads, config.head_dim), np.float32))
    query = storage.from_numpy(rng.standard_normal((batch, 2 * config.num_heads, config.head_dim), np.float32))
    for _ in range(steps):
        slots = np.concatenate([manager.extend(handle, 1) for handle in handles])
        table = manager.page_table(handles)
        for layer in range(config.num_layers):
            manager.write(layer, slots, tokens, tokens)
            manager.paged_attention(layer, query, table).block_until_ready()
    return [handle.num_tokens() for handle in handles]


def test_a_500_step_decode_with_growing_context_compiles_a_handful_of_times(
    compilations: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=400, block_size=4)
    manager = PagedKvCacheManager(JaxStorage(config), backend="jax")
    decode(manager, steps=2, batch=3)  # the prefill's programs, the first decode step's
    warm = len(compilations)

    storage = JaxStorage(config)
    lengths = decode(PagedKvCacheManager(storage, backend="jax"), steps=500, batch=3)

    during = len(compilations) - warm
    with capsys.disabled():
        print(f"\n500 decode steps, contexts up to {max(lengths)} tokens: {during} compilations ({warm} to warm up)")
    # Block-table buckets 16 .. 128 blocks: 3 more attention programs; a few spare.
    assert lengths == [503, 507, 511]
    assert during <= 6
    assert warm <= 20
    assert storage.copies_made == 0  # and every write of the loop was in place
