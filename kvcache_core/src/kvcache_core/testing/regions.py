"""The kit's cases for a storage's memory regions (the capability ``"memory_regions"``): they
cover the pool exactly, and the bytes they name are the pool's blocks, in every layout and
dtype the backend claims, quantized pools with their scales, values of another width; with
``"state_layers"`` too, the state pool's regions name each request's states.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.contract.regions import MemoryRegion, check_regions, host_form_from_parts, storage_regions
from kvcache_core.contract.states import StateSpec
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import BackendUnderTest

__all__ = ["RegionCases", "region_bytes"]


def region_bytes(region: MemoryRegion) -> npt.NDArray[np.uint8]:
    """A copy of the bytes a host region names."""
    buffer = memoryview((ctypes.c_uint8 * region.length_bytes).from_address(region.address)).cast("B")
    copy: npt.NDArray[np.uint8] = np.frombuffer(buffer, dtype=np.uint8).copy()
    return copy


def _fill(manager: PagedKvCacheManager[Any], rng: np.random.Generator) -> None:
    """Write Gaussian K/V into a request spanning most of the pool."""
    config = manager.config
    tokens = (config.num_blocks - 1) * config.block_size - 3
    handle = manager.allocate(AllocationRequest("filled"))
    slots = manager.extend(handle, tokens)
    for layer in range(config.num_layers):
        keys, values = (
            BackendUnderTest.native(
                manager,
                BackendUnderTest.representable(rng.standard_normal((tokens, config.num_heads, width)), config.io_dtype),
                config.io_dtype,
            )
            for width in (config.head_dim, config.value_width)
        )
        manager.write(layer, slots, keys, values)


def _configs(kvcache_backend: BackendUnderTest) -> list[CacheConfig]:
    """Every dtype x layout claimed; and, where claimed, values twice as wide as the keys."""
    configs = [
        kvcache_backend.config(dtype=dtype, kv_layout=layout)
        for dtype in kvcache_backend.dtypes
        for layout in kvcache_backend.kv_layouts
    ]
    if kvcache_backend.claims("value_head_dim"):
        width = 2 * kvcache_backend.config().head_dim
        configs += [
            kvcache_backend.config(dtype=dtype, kv_layout=layout, value_head_dim=width)
            for dtype in kvcache_backend.dtypes
            for layout in kvcache_backend.kv_layouts
        ]
    return configs


class RegionCases:
    """Cases every backend claiming ``"memory_regions"`` runs."""

    @pytest.mark.kvcache_requires("memory_regions")
    def test_memory_regions_name_every_layer_and_part_once(self, kvcache_backend: BackendUnderTest) -> None:
        for config in _configs(kvcache_backend):
            with kvcache_backend.manager(config) as manager:
                regions = storage_regions(manager.storage)
                assert regions is not None, "the backend claims memory_regions; its storage has no memory_regions()"
                check_regions(manager.storage.config, regions)

    @pytest.mark.kvcache_requires("memory_regions")
    def test_memory_regions_hold_the_pool_blocks_bit_for_bit(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(7)
        for config in _configs(kvcache_backend):
            with kvcache_backend.manager(config) as manager:
                storage = manager.storage
                regions = check_regions(storage.config, storage_regions(storage) or ())
                if any(region.device_kind != "cpu" for region in regions.values()):
                    pytest.skip("the regions are device memory: their bytes are read by a transport, not here")
                _fill(manager, rng)
                parts = {key: region_bytes(region) for key, region in regions.items()}
                keys, values = host_form_from_parts(storage.config, storage.config.layout, parts)
                every_block = np.arange(storage.config.num_blocks, dtype=np.int64)
                expected_keys, expected_values = storage.blocks_to_host(every_block)
                context = f"dtype {config.dtype}, layout {config.kv_layout}"
                assert keys.tobytes() == np.ascontiguousarray(expected_keys).tobytes(), f"{context}: keys differ"
                assert values.tobytes() == np.ascontiguousarray(expected_values).tobytes(), f"{context}: values differ"

    @pytest.mark.kvcache_requires("memory_regions", "state_layers")
    def test_state_pool_regions_hold_each_requests_states(self, kvcache_backend: BackendUnderTest) -> None:
        state = StateSpec([("conv", (3, 4), "float32"), ("ssm", (2, 3), "float16")])
        config = kvcache_backend.config(
            dtype="float32", num_layers=2, layer_specs=(LayerSpec(state=state), LayerSpec()), state_slots=3
        )
        rng = np.random.default_rng(11)
        with kvcache_backend.manager(config) as manager:
            whole = manager.state_regions()  # raises when the state pool names no memory
            assert [region.shape for region in whole] == [(3, 3, 4), (3, 2, 3)]
            if any(region.device_kind != "cpu" for region in whole):
                pytest.skip("the state regions are device memory: their bytes are read by a transport, not here")
            handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
            step = manager.begin_step(handles, [1, 1])
            written = {array.name: rng.standard_normal((2, *array.shape)).astype(array.dtype) for array in state.arrays}
            for name, values in written.items():
                step.write_state(0, name, BackendUnderTest.native(manager, values, str(values.dtype)))
            for row, handle in enumerate(handles):
                regions = manager.state_regions(handle)
                got = [region_bytes(region).tobytes() for region in regions]
                assert got == [values[row].tobytes() for values in written.values()], f"request {row}'s states differ"
