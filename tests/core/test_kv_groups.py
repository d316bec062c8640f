"""KV-cache groups (``CacheConfig(layer_specs=...)``): what the kit's hybrid cases do not
pin down, and the sequences its lockstep machine once found wrong, replayed step by step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, LayerSpec, PagedKvCacheManager, create_manager
from kvcache_core.contract.groups import plan_groups
from kvcache_core.discovery import get_backend
from kvcache_core.errors import InvalidConfigError, InvalidTypeError
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.machine import POLICIES, ReferenceMachine
from kvcache_core.testing.world import untyped

FULL, SLIDING = LayerSpec(), LayerSpec(window=7)


def machine() -> Any:
    """The kit's lockstep machine on the hybrid config of its hybrid run (NumPy)."""
    backend = BackendUnderTest(name="numpy", spec=get_backend("numpy"))
    config = backend.config(num_blocks=16, num_layers=2, layer_specs=(FULL, SLIDING), enable_prefix_caching=True)
    cls = type("HybridMachine", (ReferenceMachine,), {"backend": backend, "config": config, "policies": POLICIES})
    return cls()


def test_a_later_groups_prefix_hit_is_not_evicted_for_an_earlier_groups_new_blocks() -> None:
    state = machine()
    state.allocate_with_prompt(prefix=0, seed=0, shared=4, suffix=6)
    state.extend(count=6, index=0, seed=0)
    state.deallocate(index=0)
    state.allocate(initial=0, limit=None)
    state.extend(count=9, index=0, seed=0)  # the pool is full: new blocks evict cached ones
    state.allocate_with_prompt(prefix=0, seed=0, shared=7, suffix=6)
    state.same_state()
    state.teardown()


def test_a_step_grows_first_the_requests_whose_window_frees_blocks() -> None:
    state = machine()
    state.allocate_with_prompt(prefix=0, seed=0, shared=6, suffix=6)
    state.allocate(initial=5, limit=None)
    state.allocate_with_prompt(prefix=1, seed=0, shared=4, suffix=6)
    # The first request needs a block in each group; only the second's window frees one.
    state.step(counts=[1, 1, 0], picks=[0, 1], seed=0)
    state.same_state()
    state.teardown()


@pytest.mark.parametrize(
    ("windows", "size", "groups"),
    [
        ([None, 6] * 13, 13, [(None, 13), (6, 13)]),  # Gemma 2: alternating
        ([6] * 5 + [None] + [6] * 5 + [None], 2, [(6, 2)] * 3 + [(None, 2)] + [(6, 2)] * 2),  # 5:1: by first layer
        ([None] * 21 + [6] * 7, 7, [(None, 7)] * 3 + [(6, 7)]),  # Qwen2: max_window_layers 21
        ([None] * 3 + [6] * 2, 1, [(None, 1)] * 3 + [(6, 1)] * 2),  # coprime counts: one layer each
    ],
)
def test_groups_have_the_gcd_of_the_kinds_layer_counts(
    windows: list[int | None], size: int, groups: list[tuple[int | None, int]]
) -> None:
    planned = plan_groups(len(windows), tuple(LayerSpec(window=w) for w in windows), None)
    assert [(group.window, len(group.layers)) for group in planned] == groups
    assert {len(group.layers) for group in planned} == {size}
    assert sorted(layer for group in planned for layer in group.layers) == list(range(len(windows)))
    for group in planned:
        assert all(windows[layer] == group.window for layer in group.layers)
        assert list(group.layers) == sorted(group.layers)


def test_a_chunked_layer_keeps_every_block_and_attends_its_chunk_by_default() -> None:
    config = CacheConfig(
        num_layers=2, num_heads=1, head_dim=4, num_blocks=16, block_size=4, layer_specs=(LayerSpec(chunk=4), FULL)
    )
    assert config.num_groups == 1
    manager = create_manager("numpy", config)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], 10)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((10, 1, 4)).astype(np.float32)
    query = rng.standard_normal((10, 1, 4)).astype(np.float32)
    for layer in range(2):
        step.write(layer, kv, kv)
    chunked = step.attention(0, query)
    assert np.allclose(chunked, step.attention(0, query, chunk=4))
    assert not np.allclose(chunked, step.attention(1, query))
    assert handle.block_table().num_blocks() == 3


def test_calibrated_fp8_scales_of_a_grouped_pool_take_the_largest_of_a_storage_layers_model_layers() -> None:
    scales = tuple(((float(layer + 1),) * 2, (0.5,) * 2) for layer in range(4))
    config = CacheConfig(
        num_layers=4,
        num_heads=2,
        head_dim=4,
        num_blocks=8,
        dtype="float8_e4m3fn",
        kv_scales=scales,
        layer_specs=(FULL, SLIDING, FULL, SLIDING),
    )
    storage = config.storage_config()
    assert storage.num_layers == 2
    assert storage.layer_specs is None
    assert storage.kv_scales == (((2.0, 2.0), (0.5, 0.5)), ((4.0, 4.0), (0.5, 0.5)))


def test_a_manager_refuses_a_config_its_storage_was_not_built_from() -> None:
    config = CacheConfig(num_layers=2, num_heads=1, head_dim=4, num_blocks=8, layer_specs=(FULL, SLIDING))
    storage = create_manager("numpy", CacheConfig(num_layers=2, num_heads=1, head_dim=4, num_blocks=8)).storage
    with pytest.raises(InvalidConfigError, match=r"build the storage from config\.storage_config"):
        PagedKvCacheManager(storage, config=config)


def test_a_manager_refuses_a_config_that_is_not_one() -> None:
    storage = create_manager("numpy", CacheConfig(num_layers=2, num_heads=1, head_dim=4, num_blocks=8)).storage
    with pytest.raises(InvalidTypeError, match="config must be a CacheConfig or None, got dict"):
        PagedKvCacheManager(storage, config=untyped({}))
