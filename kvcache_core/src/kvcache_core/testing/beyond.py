"""The kit's cases for what lies beyond one pool: cache events, the portable prefix-cache
file (saved in one layout, loaded into every other, refused whole when corrupted) and
offload tiers. :class:`~kvcache_core.testing.KvCacheConformance` inherits them, so every
backend that claims prefix caching and host transfers (``swap``) runs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core.contract.config import AllocationRequest
from kvcache_core.errors import CorruptCacheFileError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.events import CachedBlockIndex
from kvcache_core.offload.tiers import DiskTier, HostTier
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.kv_data import pool_hashes as pool_hashes  # re-exported: importable from here as before
from kvcache_core.testing.world import assert_same_state, snapshot

__all__ = ["BeyondPoolCases"]

Manager = PagedKvCacheManager[Any]


def prefill(manager: Manager, request_id: str, prompt: tuple[int, ...]) -> PagedKvCacheHandle[Any]:
    """Allocate with ``prompt`` and write K/V that depend on each position's token and
    place (``token + position / 64``) into the positions the cache did not supply."""
    config = manager.config
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt))
    start = handle.num_tokens()
    slots = manager.extend(handle, len(prompt) - start)
    rows = np.asarray(prompt[start:], dtype=np.float64) + np.arange(start, len(prompt)) / 64
    host = np.broadcast_to(rows[:, None, None], (len(rows), config.num_heads, config.head_dim))
    for layer in range(config.num_layers):
        manager.write(
            layer,
            slots,
            BackendUnderTest.native(manager, host + layer),
            BackendUnderTest.native(manager, -host - layer),
        )
    return handle


def expected_keys(manager: Manager, prompt: tuple[int, ...], layer: int) -> Any:
    config = manager.config
    rows = np.asarray(prompt, dtype=np.float64) + np.arange(len(prompt)) / 64 + layer
    host = np.broadcast_to(rows[:, None, None], (len(rows), config.num_heads, config.head_dim))
    return BackendUnderTest.representable(np.ascontiguousarray(host), config.dtype)


class BeyondPoolCases:
    """Cases every backend runs (through :class:`~kvcache_core.testing.KvCacheConformance`)."""

    @pytest.mark.kvcache_requires("prefix_caching")
    @pytest.mark.kvcache_requires("eviction")
    def test_cache_events_replayed_give_exactly_the_pool_hashes(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True, num_blocks=8))
        block_size = manager.config.block_size
        index = CachedBlockIndex()
        manager.subscribe(index)
        for turn in range(6):
            prompt = tuple([turn % 2] * block_size + list(range(turn * 100, turn * 100 + block_size + 1)))
            prefill(manager, f"r{turn}", prompt)
            manager.deallocate(f"r{turn}")
            assert index.hashes() == pool_hashes(manager)
        assert manager.stats().eviction_count > 0
        manager.gc()
        assert index.hashes() == pool_hashes(manager) == frozenset()

    @pytest.mark.kvcache_requires("prefix_caching")
    @pytest.mark.kvcache_requires("swap")
    def test_a_saved_prefix_cache_loads_into_every_layout_bit_exact(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors")
        layouts = kvcache_backend.kv_layouts
        source = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True, kv_layout=layouts[0]))
        block_size = source.config.block_size
        prompt = tuple(range(3, 3 + 2 * block_size + 1))
        prefill(source, "a", prompt)
        path = tmp_path / "prefix.safetensors"
        assert source.save_prefix_cache(path) == 2
        for layout in layouts:
            target = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True, kv_layout=layout))
            assert target.load_prefix_cache(path) == 2, f"layout {layout}"
            handle = prefill(target, "b", prompt)
            assert handle.num_cached_tokens() == 2 * block_size, f"layout {layout}"
            for layer in range(target.config.num_layers):
                keys = BackendUnderTest.host(target, target.gather(handle, layer)[0])
                expected = expected_keys(target, prompt, layer)
                assert np.array_equal(keys, expected), f"layout {layout}, layer {layer}: loaded keys differ"
            target.check_invariants()

    @pytest.mark.kvcache_requires("prefix_caching")
    @pytest.mark.kvcache_requires("swap")
    def test_a_corrupted_prefix_cache_file_loads_nothing(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors")
        source = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True))
        prompt = tuple(range(3, 3 + 2 * source.config.block_size + 1))
        prefill(source, "a", prompt)
        path = tmp_path / "prefix.safetensors"
        source.save_prefix_cache(path)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10  # one flipped bit in the last block's values
        path.write_bytes(bytes(data))
        target = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True))
        prefill(target, "busy", tuple(range(500, 500 + source.config.block_size + 1)))
        before = snapshot(target)
        with pytest.raises(CorruptCacheFileError, match="checksum"):
            target.load_prefix_cache(path)
        assert_same_state(snapshot(target), before)
        target.check_invariants()

    @pytest.mark.kvcache_requires("prefix_caching")
    @pytest.mark.kvcache_requires("eviction")
    @pytest.mark.kvcache_requires("swap")
    def test_evicted_blocks_come_back_from_host_and_disk_tiers_bit_exact(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors")
        config = kvcache_backend.config(enable_prefix_caching=True, num_blocks=8)
        block_size = config.block_size
        host, disk = HostTier(2 * config.bytes_per_block), DiskTier(tmp_path, 1 << 24)
        manager = kvcache_backend.manager(config, tiers=[host, disk])
        index = CachedBlockIndex()
        manager.subscribe(index)
        prompts = [tuple(range(seed * 100, seed * 100 + 2 * block_size + 1)) for seed in range(1, 4)]
        for turn, prompt in enumerate(prompts):
            prefill(manager, f"r{turn}", prompt)
            manager.deallocate(f"r{turn}")
        manager.gc()  # every cached block leaves the pool: two to host, the rest to disk
        assert index.hashes("host") == frozenset(host.hashes())
        assert index.hashes("disk") == frozenset(disk.hashes())
        assert len(host.hashes()) == 2
        assert len(disk.hashes()) == 4
        for turn, prompt in enumerate(prompts):
            handle = prefill(manager, f"again{turn}", prompt)
            assert handle.num_cached_tokens() == 2 * block_size, f"prompt {turn} was not promoted"
            for layer in range(config.num_layers):
                keys = BackendUnderTest.host(manager, manager.gather(handle, layer)[0])
                assert np.array_equal(keys, expected_keys(manager, prompt, layer)), f"prompt {turn}, layer {layer}"
            manager.deallocate(f"again{turn}")
            assert index.hashes() == pool_hashes(manager)
            assert index.hashes("host") == frozenset(host.hashes())
            assert index.hashes("disk") == frozenset(disk.hashes())
        host_stats, disk_stats = manager.tier_stats()
        assert host_stats.hits > 0
        assert disk_stats.hits > 0
        manager.check_invariants()

    @pytest.mark.kvcache_requires("prefix_caching")
    @pytest.mark.kvcache_requires("eviction")
    @pytest.mark.kvcache_requires("swap")
    def test_a_storage_failure_while_demoting_promoting_or_loading_changes_nothing(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors")
        config = kvcache_backend.config(enable_prefix_caching=True, num_blocks=6)
        block_size = config.block_size
        manager = kvcache_backend.manager(config, tiers=[HostTier(1 << 24)])
        storage: Any = manager.storage
        prompt = tuple(range(7, 7 + 2 * block_size + 1))
        prefill(manager, "a", prompt)
        manager.deallocate("a")
        manager.save_prefix_cache(tmp_path / "prefix.safetensors")

        def interrupted(*args: object) -> None:
            raise KeyboardInterrupt

        # An eviction's copy to the tier fails: the allocation that needed it fails whole.
        before = snapshot(manager)
        original = storage.blocks_to_host
        storage.blocks_to_host = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                manager.allocate(AllocationRequest("big", initial_tokens=6 * block_size))
        finally:
            storage.blocks_to_host = original
        assert_same_state(snapshot(manager), before)
        assert manager.tier_stats()[0].blocks == 0
        manager.gc()  # now the blocks reach the tier
        assert manager.tier_stats()[0].blocks == 2
        # A promotion's copy into the pool fails: nothing is taken, the tier keeps the blocks.
        before = snapshot(manager)
        original = storage.blocks_from_host
        storage.blocks_from_host = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                manager.allocate(AllocationRequest("b", prompt_token_ids=prompt))
            fresh = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True, num_blocks=6))
            fresh_storage: Any = fresh.storage
            fresh_storage.blocks_from_host = interrupted
            fresh_before = snapshot(fresh)
            with pytest.raises(KeyboardInterrupt):
                fresh.load_prefix_cache(tmp_path / "prefix.safetensors")
            assert_same_state(snapshot(fresh), fresh_before)
            fresh.check_invariants()
        finally:
            storage.blocks_from_host = original
        assert_same_state(snapshot(manager), before)
        assert manager.tier_stats()[0].blocks == 2
        handle = prefill(manager, "b", prompt)
        assert handle.num_cached_tokens() == 2 * block_size
        manager.check_invariants()
