"""A bfloat16 prefix cache moves torch -> JAX -> torch, and through the NumPy side, in
files and through a disk tier, bit for bit: both backends hand over core's host form
(``uint16`` bit patterns, ``kvcache_core.host_form``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvcache_core import AllocationRequest, CacheConfig, create_manager, host_form
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.persist import read_blocks, write_blocks
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.tiers import DiskTier

Manager = PagedKvCacheManager[Any]
HostPair = tuple[npt.NDArray[Any], npt.NDArray[Any]]

CONFIG = CacheConfig(
    num_layers=2, num_heads=2, head_dim=8, num_blocks=8, block_size=4, dtype="bfloat16", enable_prefix_caching=True
)
PROMPT = tuple(range(70, 79))  # two full blocks and one token
CACHED = 8


def computed(backend: str, **options: Any) -> Manager:
    """A ``backend`` manager that computed ``PROMPT`` (request ``"a"``, still live)."""
    manager = create_manager(backend, CONFIG, **options)
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=PROMPT))
    slots = manager.extend(handle, len(PROMPT))
    rng = np.random.default_rng(9)
    for layer in range(CONFIG.num_layers):
        keys = BackendUnderTest.representable(rng.standard_normal((len(slots), 2, 8)), "bfloat16")
        manager.write(layer, slots, BackendUnderTest.native(manager, keys), BackendUnderTest.native(manager, -keys))
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
    assert keys.dtype == values.dtype == np.uint16
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


def test_a_bfloat16_prefix_cache_moves_torch_to_jax_to_torch_through_files_bit_exact(tmp_path: Path) -> None:
    torch_source = computed("torch")
    sent, values_sent = held(torch_source, "a"), gathered(torch_source, "a")
    torch_source.save_prefix_cache(tmp_path / "torch.safetensors")
    jax_manager = create_manager("jax", CONFIG)
    assert jax_manager.load_prefix_cache(tmp_path / "torch.safetensors") == 2
    assert_same(hit(jax_manager, "b"), sent)
    assert all(np.array_equal(a, b) for a, b in zip(gathered(jax_manager, "b"), values_sent, strict=True))
    jax_manager.save_prefix_cache(tmp_path / "jax.safetensors")
    torch_back = create_manager("torch", CONFIG)
    assert torch_back.load_prefix_cache(tmp_path / "jax.safetensors") == 2
    assert_same(hit(torch_back, "c"), sent)
    assert all(np.array_equal(a, b) for a, b in zip(gathered(torch_back, "c"), values_sent, strict=True))


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
