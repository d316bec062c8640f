"""Block digests (``kvcache_core.transfer.digests``): the CRC-32 of each block's bytes, the
same whether one thread or several compute them."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from kvcache_core import CacheConfig, create_manager
from kvcache_core.contract.regions import check_regions, storage_regions
from kvcache_core.transfer import digests


@pytest.mark.parametrize("layout", ["NHD", "heads_first"])
def test_digests_on_several_threads_equal_those_of_one(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    # 2 layers x 4 KV heads x 128 float16 in blocks of 16: 16 KiB chunks with NHD (threads),
    # 4 KiB with heads_first (too small for zlib to release the GIL: one thread).
    config = CacheConfig(
        num_layers=2, num_heads=4, head_dim=128, num_blocks=160, block_size=16, dtype="float16", kv_layout=layout
    )
    with create_manager("numpy", config) as manager:
        found = storage_regions(manager.storage)
        assert found is not None
        regions = list(check_regions(manager.storage.config, found).values())
        rng = np.random.default_rng(0)
        for region in regions:
            memory = np.frombuffer(memoryview(digests.host_memory(region.address, region.length_bytes)), dtype=np.uint8)
            memory[:] = rng.integers(0, 256, memory.size, dtype=np.uint8)
        blocks = np.arange(3, 153, dtype=np.int64)
        monkeypatch.setattr("os.cpu_count", lambda: 1)
        alone = digests.block_digests(regions, blocks, digests.host_memory)
        monkeypatch.setattr("os.cpu_count", lambda: 8)
        threaded = digests.block_digests(regions, blocks, digests.host_memory)
    assert threaded == alone
    assert len(alone) == len(blocks) * digests.DIGEST_BYTES
    # The first block's digest, by hand: its chunks region after region, in address order.
    checksum = 0
    for region in regions:
        for start in sorted(region.block_chunks(blocks[:1]).tolist()):
            checksum = zlib.crc32(digests.host_memory(start, region.block_stride_bytes), checksum)
    assert alone[: digests.DIGEST_BYTES] == checksum.to_bytes(digests.DIGEST_BYTES, "big")


def test_checksums_going_on_region_after_region_equal_the_digests_of_all() -> None:
    config = CacheConfig(num_layers=3, num_heads=2, head_dim=16, num_blocks=12, block_size=4, kv_layout="heads_first")
    with create_manager("numpy", config) as manager:
        found = storage_regions(manager.storage)
        assert found is not None
        regions = list(check_regions(manager.storage.config, found).values())
        rng = np.random.default_rng(1)
        for region in regions:
            memory = np.frombuffer(memoryview(digests.host_memory(region.address, region.length_bytes)), dtype=np.uint8)
            memory[:] = rng.integers(0, 256, memory.size, dtype=np.uint8)
        blocks = np.array([7, 2, 9], dtype=np.int64)
        running = None
        for first in range(0, len(regions), 2):  # as a read arriving in pieces of two regions
            running = digests.block_checksums(regions[first : first + 2], blocks, digests.host_memory, running)
        assert running is not None
        assert digests.pack_digests(running) == digests.block_digests(regions, blocks, digests.host_memory)
