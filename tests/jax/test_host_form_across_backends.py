"""Prefix caches of every dtype move torch -> JAX -> memmap -> NumPy -> torch through files
(each hop on the backends holding the dtype), bfloat16 also through the NumPy side and a
disk tier, bit for bit: every backend hands over core's host form (``kvcache_core.offload.host_form``;
bfloat16 as ``uint16`` bit patterns)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvcache_core import AllocationRequest, CacheConfig, UnsupportedConfigError, create_manager
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload import host_form
from kvcache_core.offload.prefix_file import read_blocks, write_blocks
from kvcache_core.offload.tiers import DiskTier
from kvcache_core.testing.backend import BackendUnderTest

Manager = PagedKvCacheManager[Any]
HostPair = tuple[npt.NDArray[Any], npt.NDArray[Any]]

CONFIG = CacheConfig(
    num_layers=2, num_heads=2, head_dim=8, num_blocks=8, block_size=4, dtype="bfloat16", enable_prefix_caching=True
)
PROMPT = tuple(range(70, 79))  # two full blocks and one token
CACHED = 8


def computed(backend: str, config: CacheConfig = CONFIG, **options: Any) -> Manager:
    """A ``backend`` manager that computed ``PROMPT`` (request ``"a"``, still live)."""
    manager = create_manager(backend, config, **options)
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=PROMPT))
    slots = manager.extend(handle, len(PROMPT))
    rng = np.random.default_rng(9)
    io = config.io_dtype
    for layer in range(config.num_layers):
        keys = BackendUnderTest.representable(rng.standard_normal((len(slots), 2, 8)), io)
        manager.write(
            layer, slots, BackendUnderTest.native(manager, keys, io), BackendUnderTest.native(manager, -keys, io)
        )
    return manager


def hit(manager: Manager, request_id: str) -> HostPair:
    """Allocate ``PROMPT`` again: its two full blocks must be hits; their host copies."""
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=PROMPT))
    assert handle.num_cached_tokens() == CACHED
    return held(manager, request_id)


def held(manager: Manager, request_id: str) -> HostPair:
    handle = manager.get_handle(request_id)
    assert handle is not None
    blocks = np.asarray(handle.block_table().physical_blocks[:2], dtype=np.int64)
    keys, values = manager.storage.blocks_to_host(blocks)
    assert keys.dtype == values.dtype == host_form.host_dtype(manager.config.dtype)
    return np.array(keys, copy=True), np.array(values, copy=True)


def gathered(manager: Manager, request_id: str) -> list[npt.NDArray[np.float64]]:
    handle = manager.get_handle(request_id)
    assert handle is not None
    return [
        BackendUnderTest.host(manager, part)[:CACHED]
        for layer in range(CONFIG.num_layers)
        for part in manager.gather(handle, layer)
    ]


def assert_same(got: HostPair, expected: HostPair) -> None:
    for after, before in zip(got, expected, strict=True):
        assert after.tobytes() == before.tobytes()


#: The hops of a saved prefix cache; a backend that does not hold the dtype is skipped.
HOPS = ("jax", "memmap", "numpy", "torch")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"])
def test_a_prefix_cache_moves_through_every_backend_in_files_bit_exact(tmp_path: Path, dtype: str) -> None:
    config = dataclasses.replace(CONFIG, dtype=dtype)
    source = computed("torch", config)
    sent, values_sent = held(source, "a"), gathered(source, "a")
    path = tmp_path / "torch.safetensors"
    source.save_prefix_cache(path)
    visited = ["torch"]
    for backend in HOPS:
        try:
            manager = create_manager(backend, config)
        except UnsupportedConfigError:
            continue  # NumPy and memmap hold no bfloat16
        assert manager.load_prefix_cache(path) == 2, f"{' -> '.join(visited)} -> {backend}"
        assert_same(hit(manager, "b"), sent)
        assert all(np.array_equal(a, b) for a, b in zip(gathered(manager, "b"), values_sent, strict=True))
        path = tmp_path / f"{backend}.safetensors"
        manager.save_prefix_cache(path)
        manager.close()
        visited.append(backend)
    assert visited[-1] == "torch"
    assert len(visited) == (3 if dtype == "bfloat16" else 5)


def test_a_bfloat16_file_read_and_written_on_the_numpy_side_loads_bit_exact(tmp_path: Path) -> None:
    for source_backend, target_backend in (("torch", "jax"), ("jax", "torch")):
        source = computed(source_backend)
        sent = held(source, "a")
        source.save_prefix_cache(tmp_path / "saved.safetensors")
        records = read_blocks(tmp_path / "saved.safetensors", CONFIG)
        on_numpy = np.stack([record.keys for record in records], axis=1)
        assert_same((on_numpy, np.stack([record.values for record in records], axis=1)), sent)
        values = host_form.host_values(CONFIG, on_numpy)  # the bit patterns decode to the written values
        assert np.array_equal(values[0].reshape(-1, 2, 8), gathered(source, "a")[0])
        write_blocks(tmp_path / "numpy.safetensors", CONFIG, records)
        target = create_manager(target_backend, CONFIG)
        assert target.load_prefix_cache(tmp_path / "numpy.safetensors") == 2
        assert_same(hit(target, "b"), sent)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_disk_tier_behind_a_bfloat16_pool_gives_every_block_back_bit_exact(tmp_path: Path, backend: str) -> None:
    disk = DiskTier(tmp_path / backend, 1 << 24)
    manager = computed(backend, tiers=[disk])
    sent = held(manager, "a")
    manager.deallocate("a")
    manager.gc()
    assert len(disk.hashes()) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no block may be dropped as unreadable
        assert_same(hit(manager, "b"), sent)
    stats = manager.tier_stats()[0]
    assert (stats.hits, stats.failures) == (2, 0)
