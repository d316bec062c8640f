"""The paged manager's lifecycle, handles, figures and pressure levels on the NumPy backend."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from kvcache_core import AllocationRequest, Device, KvCacheHandle, MemoryPressure, OutOfBlocksError, PageTable
from kvcache_core.errors import InvalidHandleError
from tests.core import support
from tests.core.support import Array

make_manager = partial(support.make_manager, num_blocks=32, enable_prefix_caching=False)


def random_kv(count: int, seed: int = 0, dtype: str = "float32") -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((count, 2, 4)).astype(dtype),
        rng.standard_normal((count, 2, 4)).astype(dtype),
    )


def test_allocate_reserves_blocks_for_initial_tokens_and_starts_empty() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a", initial_tokens=9))
    assert handle.num_tokens() == 0
    assert handle.block_table().num_blocks() == 3
    assert manager.stats().used_blocks == 3


def test_extend_uses_reserved_blocks_before_taking_new_ones() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a", initial_tokens=8))
    reserved = handle.block_table().physical_blocks
    slots = manager.extend(handle, 8)
    assert handle.block_table().physical_blocks == reserved
    assert slots.tolist() == [b * 4 + o for b in reserved for o in range(4)]
    manager.extend(handle, 1)
    assert handle.block_table().num_blocks() == 3


def test_written_tokens_read_back_bit_exact_for_every_dtype_and_layout() -> None:
    for dtype in ("float16", "float32", "float64"):
        for layout in ("NHD", "HND", "heads_first"):
            manager = make_manager(dtype=dtype, kv_layout=layout)
            first = manager.allocate(AllocationRequest("a"))
            second = manager.allocate(AllocationRequest("b"))
            keys_a, values_a = random_kv(7, 1, dtype)
            keys_b, values_b = random_kv(5, 2, dtype)
            slots = np.concatenate([manager.extend(first, 7), manager.extend(second, 5)])
            manager.write(1, slots, np.concatenate([keys_a, keys_b]), np.concatenate([values_a, values_b]))
            for handle, keys, values in ((first, keys_a, values_a), (second, keys_b, values_b)):
                got_keys, got_values = manager.gather(handle, 1)
                assert np.array_equal(got_keys, keys), (dtype, layout)
                assert np.array_equal(got_values, values), (dtype, layout)
                assert got_keys.flags.c_contiguous
            zeros, _ = manager.gather(first, 0)
            assert not zeros.any()  # layer 0 was never written


def test_key_cache_is_a_view_that_later_writes_show_through() -> None:
    manager = make_manager(kv_layout="NHD")
    handle = manager.allocate(AllocationRequest("a"))
    key_pool, value_pool = handle.kv_cache(0)
    assert key_pool is not None
    assert value_pool is not None
    assert key_pool.shape == (32, 4, 2, 4)  # [num_blocks, block_size, num_heads, head_dim]
    slots = manager.extend(handle, 3)
    keys, values = random_kv(3)
    manager.write(0, slots, keys, values)
    blocks, offsets = np.divmod(slots, 4)
    assert np.array_equal(key_pool[blocks, offsets], keys)
    assert np.array_equal(value_pool[blocks, offsets], values)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [("NHD", (32, 4, 2, 4)), ("HND", (32, 2, 4, 4)), ("heads_first", (2, 32, 4, 4))],
)
def test_key_cache_follows_the_configured_layout(layout: str, shape: tuple[int, ...]) -> None:
    handle = make_manager(kv_layout=layout).allocate(AllocationRequest("a"))
    key_pool = handle.key_cache(1)
    assert key_pool is not None
    assert key_pool.shape == shape


def test_clone_is_a_reference_to_the_same_cache() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a"))
    clone = handle.clone_handle()
    assert clone.cache_id() == handle.cache_id()
    assert clone == handle
    manager.extend(handle, 5)
    assert clone.num_tokens() == 5
    assert clone.block_table() == handle.block_table()


def test_deallocate_invalidates_every_reference_and_refuses_data_access() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a", initial_tokens=5))
    clone = handle.clone_handle()
    looked_up = manager.get_handle("a")
    manager.deallocate("a")
    for reference in (handle, clone, looked_up):
        assert reference is not None
        assert not reference.is_valid()
        with pytest.raises(InvalidHandleError, match=r"'a'.*deallocated"):
            reference.key_cache(0)
        with pytest.raises(InvalidHandleError):
            manager.extend(reference, 1)
    assert manager.get_handle("a") is None
    assert manager.stats().used_blocks == 0


def test_handle_stats_are_true() -> None:
    manager = make_manager(dtype="float16")
    handle = manager.allocate(AllocationRequest("a", initial_tokens=10))
    manager.extend(handle, 6)
    stats = handle.stats()
    bytes_per_block = 4 * 2 * 2 * 4 * 2 * 2  # block_size * layers * (K, V) * heads * head_dim * 2 bytes
    assert stats.blocks_allocated == 3
    assert stats.memory_bytes == 3 * bytes_per_block
    assert stats.tokens_stored == 6
    assert stats.utilization == pytest.approx(6 / 12)
    before = stats.last_access
    manager.extend(handle, 1)
    assert handle.stats().last_access >= before


def test_manager_stats_count_blocks_tokens_and_allocations() -> None:
    manager = make_manager(num_blocks=8)
    first = manager.allocate(AllocationRequest("a"))
    manager.extend(first, 5)
    with pytest.raises(OutOfBlocksError):
        manager.allocate(AllocationRequest("b", initial_tokens=100))
    stats = manager.stats()
    assert (stats.total_blocks, stats.used_blocks, stats.free_blocks) == (8, 2, 6)
    assert stats.tokens_stored == 5
    assert stats.utilization == pytest.approx(5 / 8)
    assert (stats.allocation_count, stats.allocation_failures) == (1, 1)
    assert stats.active_caches == 1
    assert stats.used_memory_bytes == 2 * manager.config.bytes_per_block


def test_list_and_get_handles() -> None:
    manager = make_manager()
    for rid in ("x", "y", "z"):
        manager.allocate(AllocationRequest(rid))
    manager.deallocate("y")
    assert [rid for rid, _ in manager.list_handles()] == ["x", "z"]
    found = manager.get_handle("z")
    assert found is not None
    assert found.is_valid()
    assert manager.get_handle("y") is None


def test_can_allocate_matches_allocate() -> None:
    manager = make_manager(num_blocks=4)
    assert manager.can_allocate(AllocationRequest("a", initial_tokens=16))
    assert not manager.can_allocate(AllocationRequest("a", initial_tokens=17))
    manager.allocate(AllocationRequest("a", initial_tokens=8))
    assert not manager.can_allocate(AllocationRequest("a"))  # the id is taken
    assert not manager.can_allocate(AllocationRequest("b", initial_tokens=9))
    assert manager.can_allocate(AllocationRequest("b", initial_tokens=8))


def test_pressure_callback_fires_once_per_level_change() -> None:
    manager = make_manager(num_blocks=20, block_size=1)
    levels: list[MemoryPressure] = []
    manager.set_pressure_callback(levels.append)
    handle = manager.allocate(AllocationRequest("a"))
    for _ in range(20):
        manager.extend(handle, 1)
    assert levels == [MemoryPressure.MEDIUM, MemoryPressure.HIGH, MemoryPressure.CRITICAL]
    manager.deallocate("a")
    assert levels[-1] == MemoryPressure.LOW
    assert len(levels) == 4
    assert manager.stats().pressure == MemoryPressure.LOW


def test_pressure_levels_use_the_configured_thresholds() -> None:
    manager = make_manager(
        num_blocks=10,
        block_size=1,
        medium_pressure_threshold=0.1,
        high_pressure_threshold=0.2,
        critical_pressure_threshold=0.3,
    )
    handle = manager.allocate(AllocationRequest("a", initial_tokens=2))
    assert manager.pressure == MemoryPressure.HIGH
    manager.extend(handle, 3)
    assert manager.stats().pressure == MemoryPressure.CRITICAL


def test_a_failing_pressure_callback_warns_and_the_operation_stands() -> None:
    manager = make_manager(num_blocks=2, block_size=1)

    def broken(level: MemoryPressure) -> None:
        raise RuntimeError(f"cannot handle {level.name}")

    manager.set_pressure_callback(broken)
    with pytest.warns(RuntimeWarning, match="cannot handle CRITICAL"):
        handle = manager.allocate(AllocationRequest("a", initial_tokens=2))
    assert handle.block_table().num_blocks() == 2


def test_out_of_blocks_on_extend_changes_nothing() -> None:
    manager = make_manager(num_blocks=3)
    handle = manager.allocate(AllocationRequest("a"))
    manager.extend(handle, 10)
    before = handle.block_table()
    with pytest.raises(OutOfBlocksError, match="2 more blocks needed, 0 of 3 are free"):
        manager.extend(handle, 10)
    assert handle.block_table() == before
    manager.check_invariants()


def test_gc_reports_true_zero_figures_without_a_prefix_cache() -> None:
    manager = make_manager()
    manager.allocate(AllocationRequest("a", initial_tokens=5))
    stats = manager.gc()
    assert (stats.blocks_freed, stats.caches_freed, stats.memory_freed) == (0, 0, 0)
    assert stats.gc_time_ms >= 0
    assert manager.stats().used_blocks == 2


def test_geometry_and_device_of_handles() -> None:
    handle = make_manager().allocate(AllocationRequest("a"))
    assert (handle.num_layers(), handle.num_heads(), handle.head_dim()) == (2, 2, 4)
    assert handle.device() == Device("cpu")
    assert handle.as_any() is handle
    assert isinstance(handle, KvCacheHandle)


def test_a_handle_of_another_manager_is_refused() -> None:
    from kvcache_core.errors import ForeignHandleError

    first, second = make_manager(), make_manager()
    handle = first.allocate(AllocationRequest("a"))
    with pytest.raises(ForeignHandleError, match="another manager"):
        second.extend(handle, 1)


def test_paged_requests_take_far_less_memory_than_max_length_reservations() -> None:
    manager = make_manager(num_blocks=64)
    lengths = [3, 17, 40, 9]
    for index, length in enumerate(lengths):
        manager.extend(manager.allocate(AllocationRequest(f"r{index}", max_sequence_length=64)), length)
    ideal_blocks = sum(-(-length // 4) for length in lengths)
    assert manager.stats().used_blocks == ideal_blocks


def test_a_page_table_naming_freed_blocks_is_refused() -> None:
    from kvcache_core.errors import SlotError, StalePageTableError

    manager = make_manager()
    first = manager.allocate(AllocationRequest("a"))
    second = manager.allocate(AllocationRequest("b"))
    for handle in (first, second):
        manager.write(0, manager.extend(handle, 3), *random_kv(3))
    table = manager.page_table([first, second])
    query = np.zeros((2, 2, 4), dtype=np.float32)
    manager.paged_attention(0, query, table)
    manager.deallocate("a")
    with pytest.raises(StalePageTableError, match="'a', released since"):
        manager.paged_attention(0, query, table)
    hand_built = PageTable(
        table.kv_indptr, table.kv_indices, table.kv_last_page_len, table.block_tables, table.seq_lens, 4
    )
    with pytest.raises(SlotError, match="no live request owns"):
        manager.paged_attention(0, query, hand_built)
