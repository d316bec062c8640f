"""Block digests (``kvcache_core.transfer.digests``): each block's position-weighted 64-bit
sum, the same whether one thread or several compute it and whether a read arrives whole or
region after region, and changed by any change of one word."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcache_core import CacheConfig, create_manager
from kvcache_core.contract.regions import MemoryRegion, check_regions, storage_regions
from kvcache_core.transfer import digests


def _filled_regions(manager: Any, seed: int) -> list[MemoryRegion]:
    """The pool's regions, filled with seeded random bytes."""
    found = storage_regions(manager.storage)
    assert found is not None
    regions = list(check_regions(manager.storage.config, found).values())
    rng = np.random.default_rng(seed)
    for region in regions:
        memory = np.frombuffer(memoryview(digests.host_memory(region.address, region.length_bytes)), dtype=np.uint8)
        memory[:] = rng.integers(0, 256, memory.size, dtype=np.uint8)
    return regions


def _by_hand(regions: list[MemoryRegion], block: int) -> int:
    """One block's digest as the module documents it: its chunks region after region, each
    region's part zero-padded to whole little-endian words, word ``k`` times weight ``k``."""
    words: list[int] = []
    for region in regions:
        part = b"".join(
            bytes(digests.host_memory(start, region.block_stride_bytes))
            for start in sorted(region.block_chunks(np.array([block])).tolist())
        )
        part += bytes(-len(part) % 8)
        words.extend(int.from_bytes(part[index : index + 8], "little") for index in range(0, len(part), 8))
    weights: list[int] = digests.word_weights(len(words)).tolist()
    assert all(weight % 2 == 1 for weight in weights)
    total: int = sum(word * weight for word, weight in zip(words, weights, strict=True))
    return total % 2**64


@pytest.mark.parametrize("layout", ["NHD", "heads_first"])
def test_digests_on_several_threads_equal_those_of_one(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    # 2 layers x 4 KV heads x 128 float16 in blocks of 16: one 16 KiB chunk a block with
    # NHD, four 4 KiB chunks with heads_first (gathered).
    config = CacheConfig(
        num_layers=2, num_heads=4, head_dim=128, num_blocks=160, block_size=16, dtype="float16", kv_layout=layout
    )
    with create_manager("numpy", config) as manager:
        regions = _filled_regions(manager, 0)
        blocks = np.arange(3, 153, dtype=np.int64)[::-1].copy()
        monkeypatch.setattr("os.cpu_count", lambda: 1)
        alone = digests.block_digests(regions, blocks, digests.host_memory)
        monkeypatch.setattr("os.cpu_count", lambda: 8)
        threaded = digests.block_digests(regions, blocks, digests.host_memory)
        first = _by_hand(regions, int(blocks[0]))
    assert threaded == alone
    assert len(alone) == len(blocks) * digests.DIGEST_BYTES
    assert alone[: digests.DIGEST_BYTES] == first.to_bytes(digests.DIGEST_BYTES, "big")


def test_checksums_going_on_region_after_region_equal_the_digests_of_all() -> None:
    # Blocks of 3 tokens x 2 heads x 5 float16 features: 30 bytes a chunk, padded per region.
    config = CacheConfig(num_layers=3, num_heads=2, head_dim=5, num_blocks=12, block_size=3, kv_layout="heads_first")
    with create_manager("numpy", config) as manager:
        regions = _filled_regions(manager, 1)
        blocks = np.array([7, 2, 9], dtype=np.int64)
        arriving = digests.ArrivingChecksums(regions, blocks, digests.host_memory)
        for piece in range(len(arriving.piece_rows) + 1):
            arriving.arrived(piece)
        whole = digests.block_digests(regions, blocks, digests.host_memory)
        sums = np.zeros(len(blocks), dtype=np.uint64)
        words = 0
        for first in range(0, len(regions), 2):  # as a read arriving in pieces of two regions
            sums += digests.block_checksums(regions[first : first + 2], blocks, digests.host_memory, words)
            words += sum(
                -(-region.chunks_per_block * region.block_stride_bytes // 8) for region in regions[first : first + 2]
            )
        assert digests.pack_digests(sums) == whole == arriving.digests()
        assert whole[8:16] == _by_hand(regions, 2).to_bytes(8, "big")


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
def test_runs_of_consecutive_blocks_summed_in_place_equal_blocks_gathered_one_by_one(layout: str) -> None:
    # Runs of 4 blocks or more are summed where they lie, shorter ones gathered: the digests
    # of a mixed list equal each block's alone (a gather) and the documented sum.
    config = CacheConfig(
        num_layers=2, num_heads=4, head_dim=32, num_blocks=64, block_size=8, dtype="float16", kv_layout=layout
    )
    with create_manager("numpy", config) as manager:
        regions = _filled_regions(manager, 3)
        blocks = np.array([*range(5, 17), 40, 2, 41, *range(50, 54), 3, *range(20, 23)], dtype=np.int64)
        together = digests.block_digests(regions, blocks, digests.host_memory)
        alone = b"".join(
            digests.block_digests(regions, np.array([block]), digests.host_memory) for block in blocks.tolist()
        )
        by_hand = b"".join(_by_hand(regions, block).to_bytes(8, "big") for block in (5, 16, 40, 53, 21))
    size = digests.DIGEST_BYTES
    assert together == alone
    assert b"".join(together[index * size : (index + 1) * size] for index in (0, 11, 12, 18, 21)) == by_hand


@pytest.mark.parametrize("change", ["one byte", "one word", "two words swapped", "a chunk of another block"])
def test_a_changed_block_changes_its_digest_and_no_other(change: str) -> None:
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=16, num_blocks=8, block_size=4, kv_layout="heads_first")
    with create_manager("numpy", config) as manager:
        regions = _filled_regions(manager, 2)
        blocks = np.arange(8, dtype=np.int64)
        before = digests.block_digests(regions, blocks, digests.host_memory)
        region = regions[1]
        start = int(region.block_chunks(np.array([5]))[1])  # block 5's second chunk
        memory = np.frombuffer(memoryview(digests.host_memory(start, region.block_stride_bytes)), dtype=np.uint8)
        if change == "one byte":
            memory[17] ^= 0x40
        elif change == "one word":
            memory[8:16] = 255 - memory[8:16]
        elif change == "two words swapped":
            memory[0:16] = np.concatenate([memory[8:16], memory[0:8]])
        else:
            other = int(region.block_chunks(np.array([2]))[1])
            memory[:] = np.frombuffer(bytes(digests.host_memory(other, region.block_stride_bytes)), dtype=np.uint8)
        after = digests.block_digests(regions, blocks, digests.host_memory)
    size = digests.DIGEST_BYTES
    changed = [
        index
        for index in range(len(blocks))
        if before[index * size : (index + 1) * size] != after[index * size : (index + 1) * size]
    ]
    assert changed == [5]
