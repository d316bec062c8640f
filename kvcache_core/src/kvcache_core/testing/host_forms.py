"""The kit's host-form cases: every dtype a backend claims in ``BackendSpec.dtypes``
(float32, float16, bfloat16, int8 and float8 with their scales, ...) leaves the pool in
core's host form (:mod:`kvcache_core.offload.host_form`, the same on every backend) and comes back
bit-exact: through a prefix-cache file saved by the backend, read on the NumPy side (into
the NumPy reference pool where it holds the dtype) and saved again, and through a
``HostTier`` and a ``DiskTier``. Host copies of another dtype are refused, never cast.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.device import Device
from kvcache_core.discovery import create_manager
from kvcache_core.errors import DTypeMismatchError, KvCacheError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload import host_form
from kvcache_core.offload.prefix_file import read_blocks, write_blocks
from kvcache_core.offload.tiers import DiskTier, HostTier
from kvcache_core.testing.backend import BackendUnderTest

__all__ = ["HostFormCases"]

Manager = PagedKvCacheManager[Any]
HostPair = tuple[npt.NDArray[Any], npt.NDArray[Any]]

#: Features per head of these cases: enough for per-head scales to see a spread of values.
_HEAD_DIM = 16


def _configs(backend: BackendUnderTest, **fields: Any) -> list[CacheConfig]:
    """One prefix-caching config per claimed dtype, in the backend's first layout."""
    return [
        backend.config(dtype=dtype, head_dim=_HEAD_DIM, enable_prefix_caching=True, **fields)
        for dtype in backend.dtypes
    ]


def _prompt(config: CacheConfig, seed: int) -> tuple[int, ...]:
    """Two full blocks and one token."""
    return tuple(range(seed * 100, seed * 100 + 2 * config.block_size + 1))


def _prefill(manager: Manager, request_id: str, prompt: tuple[int, ...], seed: int) -> PagedKvCacheHandle[Any]:
    """Allocate ``prompt`` and write Gaussian K/V (representable in the compute dtype) into
    every layer of the positions the cache did not supply."""
    config = manager.config
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt))
    slots = manager.extend(handle, len(prompt) - handle.num_tokens())
    rng = np.random.default_rng(seed)
    shape = (len(slots), config.num_heads, config.head_dim)
    for layer in range(config.num_layers):
        keys, values = (BackendUnderTest.representable(rng.standard_normal(shape), config.io_dtype) for _ in "kv")
        manager.write(
            layer,
            slots,
            BackendUnderTest.native(manager, keys, config.io_dtype),
            BackendUnderTest.native(manager, values, config.io_dtype),
        )
    return handle


def _full_blocks(manager: Manager, handle: PagedKvCacheHandle[Any]) -> HostPair:
    """Host copies of the request's full blocks, checked to be in host form."""
    table = handle.block_table()
    full = table.sequence_length // table.block_size
    keys, values = manager.storage.blocks_to_host(np.asarray(table.physical_blocks[:full], dtype=np.int64))
    expected = host_form.host_dtype(manager.config.dtype)
    for name, part in (("keys", keys), ("values", values)):
        assert isinstance(part, np.ndarray), f"blocks_to_host gave {name} of type {type(part).__name__}"
        assert part.dtype == expected, (
            f"dtype {manager.config.dtype}: blocks_to_host gave {name} of dtype {part.dtype}, not the host form {expected}"
        )
    return np.array(keys, copy=True), np.array(values, copy=True)


def _assert_bit_exact(got: HostPair, expected: HostPair, context: str) -> None:
    for name, after, before in zip(("keys", "values"), got, expected, strict=True):
        assert after.dtype == before.dtype, f"{context}: {name} come back as {after.dtype}, went as {before.dtype}"
        assert after.shape == before.shape, f"{context}: {name} come back of shape {after.shape}, not {before.shape}"
        assert after.tobytes() == before.tobytes(), f"{context}: {name} come back with other bits"


def _numpy_holds(config: CacheConfig) -> bool:
    """Whether the NumPy reference backend holds pools of ``config``'s dtype."""
    try:
        create_manager("numpy", _on_numpy(config)).close()
    except KvCacheError:
        return False
    return True


def _on_numpy(config: CacheConfig) -> CacheConfig:
    return dataclasses.replace(config, device=Device.parse("cpu"), kv_layout=None)


def _gathered(manager: Manager, handle: PagedKvCacheHandle[Any]) -> list[npt.NDArray[np.float64]]:
    return [
        BackendUnderTest.host(manager, part)
        for layer in range(manager.config.num_layers)
        for part in manager.gather(handle, layer)
    ]


class HostFormCases:
    """Host-form cases every backend runs (through
    :class:`~kvcache_core.testing.KvCacheConformance`), for every dtype it claims."""

    @pytest.mark.kvcache_requires("prefix_caching")
    @pytest.mark.kvcache_requires("swap")
    def test_every_claimed_dtype_goes_through_a_file_and_the_numpy_side_and_back_bit_exact(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors")
        for config in _configs(kvcache_backend):
            context = f"dtype {config.dtype}"
            source = kvcache_backend.manager(config)
            prompt = _prompt(config, 1)
            handle = _prefill(source, "a", prompt, seed=3)
            sent = _full_blocks(source, handle)
            gathered = _gathered(source, handle)
            saved = tmp_path / f"{config.dtype}.safetensors"
            assert source.save_prefix_cache(saved) == 2, context
            records = read_blocks(saved, source.config)  # the NumPy side: the host form, as saved
            on_numpy = (
                np.stack([record.keys for record in records], axis=1),
                np.stack([record.values for record in records], axis=1),
            )
            _assert_bit_exact(on_numpy, sent, f"{context}: the file read on the NumPy side")
            again = tmp_path / f"{config.dtype}.again.safetensors"
            if _numpy_holds(config):  # through the NumPy reference pool, saved from there
                reference = create_manager("numpy", _on_numpy(source.config))
                assert reference.load_prefix_cache(saved) == 2, context
                hit = reference.allocate(AllocationRequest("b", prompt_token_ids=prompt))
                _assert_bit_exact(_full_blocks(reference, hit), sent, f"{context}: loaded into the NumPy reference")
                reference.deallocate("b")
                assert reference.save_prefix_cache(again) == 2, context
            else:  # the NumPy side writes the records back as they are
                write_blocks(again, source.config, records)
            target = kvcache_backend.manager(config)
            assert target.load_prefix_cache(again) == 2, context
            back = target.allocate(AllocationRequest("c", prompt_token_ids=prompt))
            assert back.num_cached_tokens() == 2 * config.block_size, f"{context}: the loaded blocks were not hit"
            _assert_bit_exact(_full_blocks(target, back), sent, f"{context}: back in the backend")
            cached = 2 * config.block_size
            for got, expected in zip(_gathered(target, back), gathered, strict=True):
                assert np.array_equal(got, expected[:cached]), f"{context}: gathered K/V differ after the round trip"
            target.check_invariants()

    @pytest.mark.kvcache_requires("prefix_caching")
    @pytest.mark.kvcache_requires("eviction")
    @pytest.mark.kvcache_requires("swap")
    def test_every_claimed_dtype_comes_back_from_host_and_disk_tiers_bit_exact(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors")
        for config in _configs(kvcache_backend, num_blocks=8):
            context = f"dtype {config.dtype}"
            host = HostTier(config.bytes_per_block)  # one block: the other goes on to disk
            disk = DiskTier(tmp_path / config.dtype, 1 << 24)
            manager = kvcache_backend.manager(config, tiers=[host, disk])
            prompt = _prompt(config, 2)
            handle = _prefill(manager, "a", prompt, seed=5)
            sent = _full_blocks(manager, handle)
            manager.deallocate("a")
            manager.gc()
            assert len(host.hashes()) == 1, f"{context}: the host tier holds {len(host.hashes())} blocks"
            assert len(disk.hashes()) == 1, f"{context}: the disk tier holds {len(disk.hashes())} blocks"
            back = manager.allocate(AllocationRequest("b", prompt_token_ids=prompt))
            assert back.num_cached_tokens() == 2 * config.block_size, f"{context}: the tiers' blocks were not hit"
            _assert_bit_exact(_full_blocks(manager, back), sent, f"{context}: back from the tiers")
            host_stats, disk_stats = manager.tier_stats()
            assert (host_stats.hits, disk_stats.hits) == (1, 1), context
            assert (host_stats.failures, disk_stats.failures) == (0, 0), f"{context}: a tier dropped a block"
            manager.check_invariants()

    def test_host_copies_of_another_dtype_are_refused_not_cast(self, kvcache_backend: BackendUnderTest) -> None:
        for config in _configs(kvcache_backend):
            context = f"dtype {config.dtype}"
            manager = kvcache_backend.manager(config)
            handle = _prefill(manager, "a", _prompt(config, 3), seed=7)
            storage = manager.storage
            every = np.arange(config.num_blocks, dtype=np.int64)
            before = _full_blocks(manager, handle), storage.blocks_to_host(every)
            keys, values = before[0]
            targets = every[-keys.shape[1] :]
            other = np.float32 if keys.dtype == np.float64 else np.float64
            for wrong in (keys.astype(other), keys.view(np.int8)):
                with pytest.raises(DTypeMismatchError):
                    storage.blocks_from_host(targets, wrong, values)
            after = storage.blocks_to_host(every)
            _assert_bit_exact(
                (np.asarray(after[0]), np.asarray(after[1])),
                (np.asarray(before[1][0]), np.asarray(before[1][1])),
                f"{context}: a refused blocks_from_host changed the pool",
            )
