"""Offload tiers behind pools with KV-cache groups (hybrid sliding-window models) and behind
one sliding-window pool: one record per hash and group, promotion only when every group is
served, bit-exact in every layer."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("safetensors")

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    InvalidArgumentError,
    LayerSpec,
    PagedKvCacheManager,
    create_manager,
)
from kvcache_core.offload.events import CachedBlockIndex
from kvcache_core.offload.prefix_file import BlockRecord, record_key, split_key
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier
from kvcache_core.paging.prefix import hash_block
from kvcache_core.testing.faults import FaultyStorage, InjectedFaultError
from kvcache_core.testing.hybrid import tier_hashes
from kvcache_core.testing.kv_data import pool_hashes
from kvcache_core.testing.world import assert_same_state, snapshot, untyped
from tests.core.support import DIM, HEADS, Handle, Manager, Workload, counting, token_kv

BLOCK = 4
WINDOW = 6
#: Full, sliding, full, sliding: group 0 holds layers 0 and 2, group 1 (window 6) 1 and 3.
SPECS = (LayerSpec(), LayerSpec(window=WINDOW), LayerSpec(), LayerSpec(window=WINDOW))


def config_of(num_blocks: int, **overrides: Any) -> CacheConfig:
    fields: dict[str, Any] = {"num_layers": 4, "layer_specs": SPECS, **overrides}
    return CacheConfig(
        num_heads=HEADS, head_dim=DIM, num_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=True, **fields
    )


def hybrid(num_blocks: int, *tiers: OffloadTier, **overrides: Any) -> Manager:
    """A hybrid pool of :data:`SPECS` (or ``overrides``) behind ``tiers``."""
    return create_manager("numpy", config_of(num_blocks, **overrides), tiers=list(tiers))


def hybrid_over_host(num_blocks: int) -> tuple[Manager, HostTier]:
    """:func:`hybrid` of ``num_blocks`` blocks over one host tier with room for every record."""
    host = HostTier(1 << 20)
    return hybrid(num_blocks, host), host


def record_bytes(manager: Manager) -> int:
    return manager.config.bytes_per_block


def prompt_of(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + position for position in range(blocks * BLOCK + 1)]


def chain_hashes(prompt: Sequence[int], blocks: int) -> list[bytes]:
    """The hashes of the prompt's first ``blocks`` full blocks (no namespace, no salt)."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for logical in range(blocks):
        parent = hash_block(parent, prompt[logical * BLOCK : (logical + 1) * BLOCK], None)
        hashes.append(parent)
    return hashes


def compute(manager: Manager, handle: Handle, tokens: Sequence[int], count: int) -> None:
    """Extend by ``count`` tokens and write their K/V into every layer (every group)."""
    start = handle.num_tokens()
    slots = manager.extend(handle, count)
    for layer in range(manager.config.num_layers):
        pairs = [token_kv(tokens, position, layer) for position in range(start, start + count)]
        keys = np.stack([pair[0] for pair in pairs]) if pairs else np.zeros((0, HEADS, DIM), np.float32)
        values = np.stack([pair[1] for pair in pairs]) if pairs else np.zeros((0, HEADS, DIM), np.float32)
        manager.write(layer, slots, keys, values)


def admit(manager: Manager, request_id: str, prompt: Sequence[int]) -> Handle:
    """Allocate with the prompt and compute what the cache (pool and tiers) did not supply."""
    handle = manager.allocate(AllocationRequest(request_id, initial_tokens=len(prompt), prompt_token_ids=tuple(prompt)))
    compute(manager, handle, prompt, len(prompt) - handle.num_tokens())
    return handle


def assert_holds(manager: Manager, handle: Handle, tokens: Sequence[int]) -> None:
    """Every layer holds exactly the K/V of ``tokens`` at every position its group keeps."""
    config = manager.config
    tables = handle.block_tables()
    for layer in range(config.num_layers):
        group, _ = config.layer_place(layer)
        first = tables[group].first_logical * BLOCK
        keys, values = manager.gather(handle, layer)
        assert keys.shape[0] == handle.num_tokens() - first, (handle.request_id, layer)
        for position in range(first, handle.num_tokens()):
            expected_keys, expected_values = token_kv(tokens, position, layer)
            assert np.array_equal(keys[position - first], expected_keys), (handle.request_id, layer, position)
            assert np.array_equal(values[position - first], expected_values), (handle.request_id, layer, position)


def demote(manager: Manager, prompt: Sequence[int]) -> None:
    """Admit ``prompt`` as ``"a"``, release it and demote its cached blocks to the tiers."""
    admit(manager, "a", prompt)
    manager.deallocate("a")
    manager.gc()


def assert_hit(manager: Manager, prompt: Sequence[int], cached_tokens: int) -> Handle:
    """Admit ``prompt`` as ``"again"``: ``cached_tokens`` come from the cache and every layer
    holds the prompt's K/V."""
    again = admit(manager, "again", prompt)
    assert again.num_cached_tokens() == cached_tokens
    assert_holds(manager, again, prompt)
    return again


def tier_keys(tier: OffloadTier) -> set[tuple[bytes, int]]:
    return {split_key(key) for key in tier.hashes()}


def tier_of(kind: str, tmp_path: Path) -> OffloadTier:
    return HostTier(1 << 20) if kind == "host" else DiskTier(tmp_path / "disk", 1 << 22)


def test_record_keys_keep_the_groups_of_one_hash_apart_and_refuse_bad_input() -> None:
    block_hash = bytes(range(32))
    assert record_key(block_hash, 0) == block_hash  # a pool without groups keys blocks by hash
    assert len({record_key(block_hash, group) for group in range(4)}) == 4
    for group in (0, 1, 65535):
        assert split_key(record_key(block_hash, group)) == (block_hash, group)
    with pytest.raises(InvalidArgumentError, match="a block hash is 32 bytes, got b'ab'"):
        record_key(b"ab", 0)
    for bad in (-1, 1 << 16, True, 1.0):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"int in [0, 65535], got {bad!r}")):
            record_key(block_hash, untyped(bad))
    with pytest.raises(InvalidArgumentError, match=re.escape("32 bytes (group 0) or 34 (other groups), got b'xxx")):
        split_key(b"x" * 33)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_hybrid_prefix_is_demoted_per_group_and_promoted_bit_exact_in_every_group(kind: str, tmp_path: Path) -> None:
    tier = tier_of(kind, tmp_path)
    manager = hybrid(16, tier)
    prompt = prompt_of(1, 5)
    hashes = chain_hashes(prompt, 5)
    admit(manager, "a", prompt)  # one prefill: the sliding group still holds every block
    manager.deallocate("a")
    calls = counting(manager)
    manager.gc()
    assert calls == ["to_host 10"]  # every group's block of every hash, one transfer
    assert tier_keys(tier) == {(block_hash, group) for block_hash in hashes for group in (0, 1)}
    calls.clear()
    again = admit(manager, "again", prompt)
    assert again.num_cached_tokens() == 20
    # Five full-group blocks, and the two the window (6 tokens) sees from position 20.
    assert calls == ["from_host 7"]
    full, sliding = again.block_tables()
    assert full.first_logical == 0
    assert (sliding.first_logical, sliding.num_blocks()) == (3, 3)
    assert_holds(manager, again, prompt)
    assert tier_keys(tier) == {(block_hash, 1) for block_hash in hashes[:3]}  # unmapped: they stay
    (stats,) = manager.tier_stats()
    assert (stats.blocks, stats.hits, stats.demotions) == (3, 7, 10)
    manager.check_invariants()


def test_each_groups_block_is_demoted_when_the_last_pool_block_of_its_group_leaves() -> None:
    manager, host = hybrid_over_host(12)
    prompt = prompt_of(1, 3)
    hashes = chain_hashes(prompt, 3)
    admit(manager, "a", prompt)
    manager.deallocate("a")  # group 0's blocks are cached first, so evicted first
    admit(manager, "b", prompt_of(2, 4))  # five blocks per group: four of a's six cached blocks go
    # Group 0's three leave the pool and its tier record is made; of group 1 only block 2 left.
    assert tier_keys(host) == {(block_hash, 0) for block_hash in hashes} | {(hashes[2], 1)}
    assert manager.stats().cached_blocks == 2  # group 1's blocks 0 and 1 of a's prompt
    manager.deallocate("b")
    manager.gc()
    assert {(block_hash, 1) for block_hash in hashes} <= tier_keys(host)
    assert_hit(manager, prompt, 12)
    manager.check_invariants()


def half_demoted(host: HostTier) -> tuple[Manager, list[int]]:
    """A hybrid pool whose prompt's blocks 1 and 2 are in ``host`` for group 0 and still in
    the pool (cached) for group 1; block 0 is in the pool in both groups."""
    manager = hybrid(14, host)
    prompt = prompt_of(1, 3)
    hashes = chain_hashes(prompt, 3)
    admit(manager, "a", prompt)
    manager.deallocate("a")
    admit(manager, "b", prompt_of(2, 4))  # evicts group 0's blocks 2 and 1 of a's prompt
    manager.deallocate("b")
    assert tier_keys(host) == {(hashes[1], 0), (hashes[2], 0)}
    return manager, prompt


def test_a_group_whose_blocks_are_still_in_the_pool_maps_them_beside_the_other_groups_records() -> None:
    host = HostTier(1 << 20)
    manager, prompt = half_demoted(host)
    cached_before = manager.stats().cached_blocks
    calls = counting(manager)
    again = manager.allocate(AllocationRequest("again", prompt_token_ids=tuple(prompt)))  # reserves nothing more
    # Block 0 is a prefix hit; blocks 1 and 2 come from the tier in group 0 and from the pool in group 1.
    assert again.num_cached_tokens() == 12
    assert calls == ["from_host 2"]
    assert tier_keys(host) == set()
    # Mapped from the pool: group 0's block 0, group 1's blocks 1 and 2 (its block 0 is past the window).
    assert manager.stats().cached_blocks == cached_before - 3
    assert [(table.first_logical, table.num_blocks()) for table in again.block_tables()] == [(0, 3), (1, 2)]
    compute(manager, again, prompt, 1)
    assert_holds(manager, again, prompt)
    manager.check_invariants()


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_failed_promotion_gives_back_the_pool_blocks_it_mapped(
    monkeypatch: pytest.MonkeyPatch, failure: type[BaseException]
) -> None:
    host = HostTier(1 << 20)
    manager, prompt = half_demoted(host)
    cached_before = manager.stats().cached_blocks

    def failing(*args: object) -> None:
        raise failure("device lost")

    monkeypatch.setattr(manager.storage, "blocks_from_host", failing)
    request = AllocationRequest("again", prompt_token_ids=tuple(prompt))
    if failure is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            manager.allocate(request)
        assert manager.stats().cached_blocks == cached_before  # the hit and the pool blocks are cached again
    else:
        with pytest.warns(RuntimeWarning, match="device lost"):
            handle = manager.allocate(request)
        assert handle.num_cached_tokens() == 4  # served by the prefix hit alone
        assert [table.num_blocks() for table in handle.block_tables()] == [1, 1]
        assert manager.stats().cached_blocks == cached_before - 2  # only the hit's blocks are mapped
        manager.deallocate("again")
    assert len(tier_keys(host)) == 2
    manager.check_invariants()
    monkeypatch.undo()
    again = manager.allocate(request)
    assert again.num_cached_tokens() == 12
    manager.check_invariants()


@pytest.mark.parametrize(
    ("group", "logical", "cached"),
    [
        (0, 3, 12),  # the full group lacks block 3: blocks 0 to 2 promote
        (1, 4, 16),  # the window needs group 1's block 4 at 20 tokens: 4 blocks promote (window sees 2, 3)
        (1, 0, 20),  # group 1's block 0 is past the window: not needed
    ],
)
def test_a_promotion_is_shortened_until_every_group_has_the_records_it_needs(
    group: int, logical: int, cached: int
) -> None:
    manager, host = hybrid_over_host(16)
    prompt = prompt_of(1, 5)
    demote(manager, prompt)
    host.discard(record_key(chain_hashes(prompt, 5)[logical], group))
    assert_hit(manager, prompt, cached)
    manager.check_invariants()


def test_a_pool_prefix_hit_continues_from_the_tiers_in_every_group() -> None:
    manager, host = hybrid_over_host(16)
    prompt = prompt_of(1, 5)
    hashes = chain_hashes(prompt, 5)
    demote(manager, prompt)
    admit(manager, "short", prompt[:9])  # blocks 0 and 1 promoted, back in the pool in both groups
    manager.deallocate("short")
    assert_hit(manager, prompt, 20)
    assert tier_keys(host) == {(hashes[2], 1)}  # group 1's blocks 0 and 1 are in the pool, 2 unneeded
    manager.check_invariants()


@pytest.mark.parametrize(
    ("fault", "after"),
    [(InjectedFaultError, False), (InjectedFaultError, True), (KeyboardInterrupt, False)],
)
def test_a_storage_failure_while_promoting_a_hybrid_prefix_leaks_nothing(
    fault: type[BaseException], after: bool, tmp_path: Path
) -> None:
    inner = create_manager("numpy", config_of(16))
    storage = FaultyStorage(inner.storage, None, "after" if after else "before", fault)
    disk = DiskTier(tmp_path, 1 << 22)
    manager: Manager = PagedKvCacheManager(storage, backend="numpy", config=inner.config, tiers=[disk])
    prompt = prompt_of(1, 5)
    demote(manager, prompt)
    before = snapshot(manager)
    storage.fail_at = len(storage.calls)  # the promotion's blocks_from_host
    request = AllocationRequest("b", initial_tokens=len(prompt), prompt_token_ids=tuple(prompt))
    if fault is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            manager.allocate(request)
        assert_same_state(snapshot(manager), before)
    else:
        with pytest.warns(RuntimeWarning, match="injected"):
            handle = manager.allocate(request)
        assert handle.num_cached_tokens() == 0  # served, computing everything
        compute(manager, handle, prompt, len(prompt))
        assert_holds(manager, handle, prompt)
        manager.deallocate("b")
    assert storage.fired == "blocks_from_host"
    assert manager.tier_stats()[0].blocks == 10  # the tier keeps every record
    manager.check_invariants()
    manager.gc()
    stats = manager.stats()
    assert (stats.used_blocks, stats.cached_blocks, stats.free_blocks) == (0, 0, 16)  # nothing leaked
    assert_hit(manager, prompt, 20)
    manager.check_invariants()


def test_a_disk_tier_files_each_groups_record_apart_and_reads_its_group_back(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 22)
    manager = hybrid(16, disk)
    prompt = prompt_of(1, 2)
    hashes = chain_hashes(prompt, 2)
    demote(manager, prompt)
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == sorted(
        [f"{block_hash.hex()}.safetensors" for block_hash in hashes]
        + [f"{block_hash.hex()}.g1.safetensors" for block_hash in hashes]
    )
    for group in (0, 1):
        record = disk.peek(record_key(hashes[1], group))
        assert record is not None
        assert (record.group, record.block_hash, record.key) == (group, hashes[1], record_key(hashes[1], group))
        layer = manager.config.kv_groups[group].layers[0]
        expected = np.stack([token_kv(prompt, position, layer)[0] for position in range(BLOCK, 2 * BLOCK)])
        assert np.array_equal(record.keys[0], expected), f"group {group}'s record holds another group's keys"
    manager.close()
    assert list(tmp_path.iterdir()) == []


def test_replayed_events_name_the_hashes_of_every_medium_with_groups(tmp_path: Path) -> None:
    probe = hybrid(12)
    block_bytes = record_bytes(probe)
    host, disk = HostTier(5 * block_bytes), DiskTier(tmp_path, 9 * (block_bytes + 2048))
    manager = hybrid(12, host, disk)
    index = CachedBlockIndex()
    manager.subscribe(index)
    rng = random.Random(5)
    shared = [prompt_of(seed, 3)[:-1] for seed in range(4)]
    live: list[str] = []
    for turn in range(60):
        prompt = rng.choice(shared)[: rng.choice([4, 8, 12])] + [
            rng.randrange(10_000) for _ in range(rng.randrange(1, 7))
        ]
        if len(live) > 1:
            manager.deallocate(live.pop(0))
        try:
            handle = admit(manager, f"t{turn}", prompt)
        except MemoryError:
            continue
        assert_holds(manager, handle, prompt)
        live.append(f"t{turn}")
        if turn % 17 == 16:
            manager.gc()
        manager.check_invariants()
        assert index.hashes("pool") == pool_hashes(manager), turn
        assert index.hashes("host") == tier_hashes(host), turn
        assert index.hashes("disk") == tier_hashes(disk), turn
    host_stats, disk_stats = manager.tier_stats()
    assert min(host_stats.hits, host_stats.demotions, host_stats.evictions, disk_stats.demotions) > 0
    manager.close()
    assert index.media() == []
    assert list(tmp_path.iterdir()) == []


def test_a_saved_prefix_cache_holds_the_tiers_group_records_and_loads_them_back(tmp_path: Path) -> None:
    manager, _ = hybrid_over_host(16)
    prompts = [prompt_of(seed, 3) for seed in range(2)]
    for number, prompt in enumerate(prompts):
        admit(manager, f"r{number}", prompt)
        manager.deallocate(f"r{number}")
    manager.gc()
    admit(manager, "pool", prompts[0])  # prompt 0 back in the pool (group 1: the window's blocks)
    manager.deallocate("pool")
    in_pool, in_tier = manager.stats().cached_blocks, manager.tier_stats()[0].blocks
    assert in_tier > 6
    assert manager.save_prefix_cache(tmp_path / "all.safetensors") == in_pool + in_tier == 12
    restarted = hybrid(32)
    assert restarted.load_prefix_cache(tmp_path / "all.safetensors") == 12
    # And into a small tiered pool: what the free blocks cannot take goes to the tier.
    spill_host = HostTier(1 << 20)
    spilled = hybrid(8, spill_host)
    index = CachedBlockIndex()
    spilled.subscribe(index)
    assert spilled.load_prefix_cache(tmp_path / "all.safetensors") == 12
    assert (spilled.stats().cached_blocks, spilled.tier_stats()[0].blocks) == (8, 4)
    assert index.hashes("host") == tier_hashes(spill_host)
    for loaded in (restarted, spilled):
        for number, prompt in enumerate(prompts):
            handle = admit(loaded, f"again{number}", prompt)
            assert handle.num_cached_tokens() == 12, number
            assert_holds(loaded, handle, prompt)
            loaded.deallocate(f"again{number}")
        loaded.check_invariants()


def test_a_sliding_window_pool_promotes_as_far_as_its_window_reaches_back(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 22)
    manager = hybrid(16, disk, num_layers=2, layer_specs=None, sliding_window=WINDOW)
    assert manager.config.num_groups == 1
    prompt = prompt_of(1, 5)
    demote(manager, prompt)
    assert set(disk.hashes()) == set(chain_hashes(prompt, 5))  # one group: keyed by the bare hash
    # Every promoted block must stay held to be hashed: the window (6) from position 8
    # still sees block 0, from 12 it does not.
    assert_hit(manager, prompt, 8)
    manager.check_invariants()
    # A pool hit over the first three blocks lets the tiers serve the last two.
    manager.deallocate("again")
    manager.gc()
    admit(manager, "pool", prompt[:13])
    manager.deallocate("pool")
    handle = admit(manager, "whole", prompt)
    assert handle.num_cached_tokens() == 20
    assert handle.block_table().first_logical == 3
    assert_holds(manager, handle, prompt)
    manager.check_invariants()


#: An operation: ("admit", prefix, its blocks, suffix length), ("release", index), ("gc",).
operations = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 2), st.integers(0, 3), st.integers(1, 7)),
        st.tuples(st.just("release"), st.integers(0, 5)),
        st.tuples(st.just("gc")),
    ),
    min_size=8,
    max_size=30,
)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(script=operations, host_records=st.integers(1, 8), disk_records=st.integers(1, 16))
def test_a_hybrid_pool_and_its_tiers_stay_exact_whatever_the_workload(
    tmp_path_factory: pytest.TempPathFactory, script: list[tuple[object, ...]], host_records: int, disk_records: int
) -> None:
    directory: Path = tmp_path_factory.mktemp("disk")
    block_bytes = config_of(12).bytes_per_block
    host, disk = HostTier(host_records * block_bytes), DiskTier(directory, disk_records * (block_bytes + 2048))
    prefixes = [prompt_of(seed, 3)[:-1] for seed in range(3)]

    def admission(step: int, operation: tuple[object, ...]) -> tuple[list[int], dict[str, Any]]:
        _, prefix, blocks, suffix = operation
        assert isinstance(prefix, int)
        assert isinstance(blocks, int)
        assert isinstance(suffix, int)
        return prefixes[prefix][: blocks * BLOCK] + list(range(5000 + step * 10, 5000 + step * 10 + suffix)), {}

    workload = Workload(admission, admit, assert_holds, "records promoted", strict=True)
    workload.run(hybrid(12, host, disk), host, disk, directory, script)


class HashKeyedTier:
    """A third-party tier written before KV-cache groups: it files records by ``block_hash``."""

    name = "legacy"
    max_bytes = 1 << 20
    used_bytes = 0

    def __init__(self) -> None:
        self.blocks: dict[bytes, BlockRecord] = {}

    def bind(self, config: CacheConfig) -> None:
        pass

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        self.blocks[record.block_hash] = record
        return []

    def peek(self, block_hash: bytes) -> BlockRecord | None:
        return self.blocks.get(block_hash)

    def discard(self, block_hash: bytes) -> None:
        self.blocks.pop(block_hash, None)

    def hashes(self) -> list[bytes]:
        return list(self.blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def clear(self) -> None:
        self.blocks.clear()


def test_a_tier_keyed_by_hash_serves_a_plain_pool_and_never_gives_another_groups_record(tmp_path: Path) -> None:
    legacy = HashKeyedTier()
    plain = hybrid(8, legacy, num_layers=2, layer_specs=None)
    prompt = prompt_of(1, 3)
    admit(plain, "a", prompt)
    plain.deallocate("a")
    plain.gc()
    again = admit(plain, "again", prompt)
    assert again.num_cached_tokens() == 12
    assert_holds(plain, again, prompt)

    legacy = HashKeyedTier()
    manager = hybrid(16, legacy)
    admit(manager, "a", prompt)
    manager.deallocate("a")
    manager.gc()  # group 1's record of each hash overwrote group 0's under the bare hash
    with pytest.warns(RuntimeWarning, match="record of KV-cache group 1"):
        assert manager.save_prefix_cache(tmp_path / "saved.safetensors") == 0  # none passes as group 0's
    assert manager.tier_stats()[0].failures == 3
    assert legacy.hashes() == []  # dropped as unreadable
    assert_hit(manager, prompt, 0)
    manager.check_invariants()
