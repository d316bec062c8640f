"""Offload tiers: evicted cached blocks are demoted, prompt hits promote them back, bit-exact."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

from kvcache_core import AllocationRequest, CacheConfig, InvalidArgumentError, UnsupportedConfigError, create_manager
from kvcache_core.errors import InvalidTypeError, TierError
from kvcache_core.offload.events import CachedBlockIndex
from kvcache_core.offload.tiers import DiskTier, HostTier, create_tier
from kvcache_core.testing.kv_data import pool_hashes
from kvcache_core.testing.world import assert_same_state, snapshot
from tests.core.support import BLOCK, BLOCK_BYTES, admit, admit_and_release, assert_holds, counting, prompt_of, tiered


def test_an_evicted_prefix_comes_back_from_the_host_tier_bit_exact() -> None:
    manager = tiered(8, HostTier(64 * BLOCK_BYTES))
    first = prompt_of(1, 3)
    admit(manager, "a", first)
    manager.deallocate("a")
    admit(manager, "b", prompt_of(2, 7))  # needs all 8 blocks: evicts a's 3 cached ones
    assert manager.stats().eviction_count >= 3
    manager.deallocate("b")
    (host,) = manager.tier_stats()
    assert host.demotions >= 3
    again = admit(manager, "again", first)
    assert again.num_cached_tokens() == 12
    assert_holds(manager, again, first)
    assert manager.tier_stats()[0].hits == 3
    manager.check_invariants()


def test_a_full_host_tier_passes_its_oldest_blocks_to_disk_and_both_serve_hits(tmp_path: Path) -> None:
    manager = tiered(8, HostTier(3 * BLOCK_BYTES), DiskTier(tmp_path / "disk", 1 << 20))
    prompts = [prompt_of(seed, 3) for seed in range(4)]
    admit_and_release(manager, prompts)
    manager.gc()  # everything cached leaves the pool: the newest to host, the rest to disk
    host, disk = manager.tier_stats()
    assert host.blocks == 3
    assert host.used_bytes <= host.max_bytes
    assert disk.blocks == 9
    assert len(list((tmp_path / "disk").glob("*.safetensors"))) == 9
    assert not list((tmp_path / "disk").glob(".*"))  # no temporary left
    for index, prompt in reversed(list(enumerate(prompts))):  # the newest first: from host
        handle = admit(manager, f"again{index}", prompt)
        assert handle.num_cached_tokens() == 12, index
        assert_holds(manager, handle, prompt)
        manager.deallocate(f"again{index}")
    host, disk = manager.tier_stats()
    assert host.hits > 0
    assert disk.hits > 0
    manager.check_invariants()


def test_replayed_events_give_exactly_the_blocks_of_every_medium(tmp_path: Path) -> None:
    host_tier, disk_tier = HostTier(5 * BLOCK_BYTES), DiskTier(tmp_path, 12 * (BLOCK_BYTES + 2048))
    manager = tiered(10, host_tier, disk_tier)
    index = CachedBlockIndex()
    manager.subscribe(index)
    rng = random.Random(3)
    shared = [prompt_of(seed, 2)[:-1] for seed in range(5)]
    live: list[str] = []
    for turn in range(80):
        prompt = rng.choice(shared) + [rng.randrange(10_000) for _ in range(rng.randrange(1, 9))]
        if len(live) > 1:
            manager.deallocate(live.pop(0))
        try:
            admit(manager, f"t{turn}", prompt)
            live.append(f"t{turn}")
        except MemoryError:
            pass
        if turn % 23 == 22:
            manager.gc()
        assert index.hashes("pool") == pool_hashes(manager), turn
        assert index.hashes("host") == frozenset(host_tier.hashes()), turn
        assert index.hashes("disk") == frozenset(disk_tier.hashes()), turn
    host, disk = manager.tier_stats()
    assert min(host.hits, host.demotions, host.evictions, disk.demotions, disk.evictions) > 0
    manager.check_invariants()
    manager.close()
    assert index.media() == []
    assert list(tmp_path.iterdir()) == []


def test_a_corrupted_disk_block_is_a_miss_dropped_with_a_warning(tmp_path: Path) -> None:
    manager = tiered(8, DiskTier(tmp_path, 1 << 20))
    index = CachedBlockIndex()
    manager.subscribe(index)
    prompt = prompt_of(1, 3)
    admit(manager, "a", prompt)
    manager.deallocate("a")
    manager.gc()
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    assert manager.tier_stats()[0].blocks == 3
    # Flip one byte of the middle block's data: the first block still promotes, the rest is computed.
    chain = sorted(index.hashes("disk"), key=lambda block_hash: len(_ancestors(index, block_hash)))
    middle = tmp_path / f"{chain[1].hex()}.safetensors"
    data = bytearray(middle.read_bytes())
    data[-2] ^= 0x01
    middle.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="checksum"):
        handle = admit(manager, "again", prompt)
    assert handle.num_cached_tokens() == 4
    assert_holds(manager, handle, prompt)
    assert not middle.exists()
    assert chain[1] not in index.hashes("disk")
    assert manager.tier_stats()[0].failures == 1
    manager.check_invariants()


def _ancestors(index: CachedBlockIndex, block_hash: bytes) -> list[bytes]:
    chain: list[bytes] = []
    parent = index.parents.get(block_hash)
    while parent is not None:
        chain.append(parent)
        parent = index.parents.get(parent)
    return chain


def test_a_disk_tier_that_cannot_write_keeps_the_pool_working(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = tiered(8, DiskTier(tmp_path, 1 << 20))
    prompt = prompt_of(1, 3)
    admit(manager, "a", prompt)
    manager.deallocate("a")

    def full_disk(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.warns(RuntimeWarning, match="No space left"):
        manager.gc()
    assert list(tmp_path.iterdir()) == []  # neither files nor temporaries
    assert manager.tier_stats()[0].failures == 3
    monkeypatch.undo()
    handle = admit(manager, "again", prompt)
    assert handle.num_cached_tokens() == 0
    manager.check_invariants()


def test_a_storage_failure_while_demoting_fails_the_allocation_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = tiered(6, HostTier(64 * BLOCK_BYTES))
    admit(manager, "a", prompt_of(1, 3))
    manager.deallocate("a")
    before = snapshot(manager)

    def failing(blocks: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(manager.storage, "blocks_to_host", failing)
    with pytest.raises(KeyboardInterrupt):
        manager.allocate(AllocationRequest("b", initial_tokens=6 * BLOCK))
    assert_same_state(snapshot(manager), before)
    assert manager.tier_stats()[0].blocks == 0
    manager.check_invariants()


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_storage_failure_while_promoting_gives_every_block_back(
    monkeypatch: pytest.MonkeyPatch, failure: type[BaseException]
) -> None:
    manager = tiered(8, HostTier(64 * BLOCK_BYTES))
    prompt = prompt_of(1, 3)
    admit(manager, "a", prompt)
    manager.deallocate("a")
    manager.gc()
    before = snapshot(manager)

    def failing(*args: object) -> None:
        raise failure("device lost")

    monkeypatch.setattr(manager.storage, "blocks_from_host", failing)
    if failure is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            manager.allocate(AllocationRequest("b", prompt_token_ids=tuple(prompt)))
        assert_same_state(snapshot(manager), before)
    else:
        with pytest.warns(RuntimeWarning, match="device lost"):
            handle = manager.allocate(AllocationRequest("b", prompt_token_ids=tuple(prompt)))
        assert handle.num_cached_tokens() == 0  # served, computing everything
    assert manager.tier_stats()[0].blocks == 3  # the tier keeps them
    manager.check_invariants()


def test_tier_configuration_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(TierError, match="less than one block"):
        tiered(8, HostTier(BLOCK_BYTES - 1))
    with pytest.raises(TierError, match="unique"):
        tiered(8, HostTier(1 << 20), HostTier(1 << 20))
    with pytest.raises(InvalidTypeError, match="OffloadTier"):
        tiered(8, "host")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="enable_prefix_caching"):
        create_manager(
            "numpy",
            CacheConfig(num_layers=1, num_heads=1, head_dim=1, num_blocks=4),
            tiers=[HostTier(1 << 20)],
        )
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(TierError, match="cannot write into"):
        tiered(8, DiskTier(blocker / "tier", 1 << 20))
    with pytest.raises(InvalidArgumentError, match="max_bytes must be an int >= 1, got 0"):
        HostTier(0)
    with pytest.raises(InvalidArgumentError, match="'pool'"):
        HostTier(1, name="pool")


def test_create_tier_builds_tiers_by_kind(tmp_path: Path) -> None:
    assert isinstance(create_tier("host", 1 << 20), HostTier)
    disk = create_tier("disk", 1 << 20, directory=tmp_path)
    assert isinstance(disk, DiskTier)
    assert disk.directory == tmp_path
    with pytest.raises(InvalidArgumentError, match="unknown tier kind 'remote'; known: host, disk"):
        create_tier("remote", 1)


def test_namespaced_tiers_serve_only_their_own_chains() -> None:
    manager = tiered(8, HostTier(64 * BLOCK_BYTES), model_id="model-a")
    prompt = prompt_of(1, 3)
    admit(manager, "a", prompt)
    manager.deallocate("a")
    manager.gc()
    assert manager.tier_stats()[0].blocks == 3
    assert admit(manager, "salted", prompt, cache_salt="tenant-2").num_cached_tokens() == 0
    assert admit(manager, "same", prompt).num_cached_tokens() == 12


def test_a_request_promotes_with_one_transfer_and_an_eviction_demotes_with_one(tmp_path: Path) -> None:
    manager = tiered(12, HostTier(3 * BLOCK_BYTES), DiskTier(tmp_path, 1 << 20))
    prompt = prompt_of(1, 5)
    admit(manager, "a", prompt)
    manager.deallocate("a")
    calls = counting(manager)
    manager.gc()
    assert calls == ["to_host 5"]  # five blocks leave the pool in one transfer (three to host, two on to disk)
    calls.clear()
    handle = admit(manager, "again", prompt)
    assert handle.num_cached_tokens() == 20  # from host and disk alike
    assert calls == ["from_host 5"]
    assert_holds(manager, handle, prompt)


def test_a_salted_chain_is_promoted_only_for_its_salt() -> None:
    manager = tiered(8, HostTier(64 * BLOCK_BYTES))
    prompt = prompt_of(1, 3)
    admit(manager, "a", prompt, cache_salt="tenant-1")
    manager.deallocate("a")
    manager.gc()
    assert admit(manager, "other", prompt, cache_salt="tenant-2").num_cached_tokens() == 0
    manager.deallocate("other")
    assert admit(manager, "same", prompt, cache_salt="tenant-1").num_cached_tokens() == 12


def test_a_third_party_tier_registered_by_entry_point_is_built_and_serves(plugin_dir: Path) -> None:
    (plugin_dir / "kvtest_remote_tier.py").write_text(
        "from kvcache_core.offload.tiers import HostTier\n\n"
        "def make(max_bytes, **options):\n"
        "    return HostTier(max_bytes, name='remote')\n\n"
        "def broken(max_bytes, **options):\n"
        "    return 'not a tier'\n"
    )
    info = plugin_dir / "kvtest_remote_tier-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: remote-tier\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[kvcache_core.tiers]\nremote = kvtest_remote_tier:make\nbroken = kvtest_remote_tier:broken\n"
    )
    remote = create_tier("remote", 64 * BLOCK_BYTES)
    assert remote.name == "remote"
    with pytest.raises(TierError, match="returned 'not a tier', not an OffloadTier"):
        create_tier("broken", 1)
    manager = tiered(8, remote)
    prompt = prompt_of(4, 3)
    admit(manager, "a", prompt)
    manager.deallocate("a")
    manager.gc()
    assert admit(manager, "again", prompt).num_cached_tokens() == 12
    assert manager.tier_stats()[0].name == "remote"
    assert manager.tier_stats()[0].hits == 3


def test_a_saved_prefix_cache_holds_the_tiers_blocks_too(tmp_path: Path) -> None:
    manager = tiered(8, HostTier(3 * BLOCK_BYTES), DiskTier(tmp_path / "disk", 1 << 20))
    prompts = [prompt_of(seed, 3) for seed in range(3)]
    admit_and_release(manager, prompts)
    manager.gc()
    admit(manager, "pool", prompts[0])  # three blocks back in the pool, six in the tiers
    assert manager.save_prefix_cache(tmp_path / "all.safetensors") == 9
    restarted = tiered(16)
    assert restarted.load_prefix_cache(tmp_path / "all.safetensors") == 9
    for index, prompt in enumerate(prompts):
        handle = admit(restarted, f"again{index}", prompt)
        assert handle.num_cached_tokens() == 12
        assert_holds(restarted, handle, prompt)
    restarted.check_invariants()


def test_a_failing_demotion_copy_drops_the_blocks_and_the_operation_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = tiered(8, HostTier(64 * BLOCK_BYTES))
    shared = prompt_of(1, 2)
    admit(manager, "a", shared)
    manager.deallocate("a")
    admit(manager, "b", prompt_of(2, 2))
    manager.deallocate("b")

    def failing(blocks: object) -> None:
        raise RuntimeError("copy engine busy")

    monkeypatch.setattr(manager.storage, "blocks_to_host", failing)
    with pytest.warns(RuntimeWarning, match="copy engine busy"):
        # Hits a's two blocks, and needs b's cached blocks evicted for the rest.
        handle = admit(manager, "c", [*shared[:8], *range(7000, 7017)])
    assert handle.num_cached_tokens() == 8
    assert manager.tier_stats()[0].blocks == 0
    assert manager.tier_stats()[0].failures > 0
    manager.check_invariants()


def test_a_loaded_cache_larger_than_the_free_pool_spills_into_the_tiers(tmp_path: Path) -> None:
    source = tiered(16)
    prompts = [prompt_of(seed, 3) for seed in range(3)]
    for number, prompt in enumerate(prompts):
        admit(source, f"r{number}", prompt)
    assert source.save_prefix_cache(tmp_path / "prefix.safetensors") == 9
    host_tier, disk_tier = HostTier(2 * BLOCK_BYTES), DiskTier(tmp_path / "disk", 1 << 20)
    target = tiered(6, host_tier, disk_tier)
    index = CachedBlockIndex()
    target.subscribe(index)
    assert target.load_prefix_cache(tmp_path / "prefix.safetensors") == 9
    host, disk = target.tier_stats()
    assert (target.stats().cached_blocks, host.blocks, disk.blocks) == (6, 2, 1)
    assert index.hashes() == pool_hashes(target)
    assert index.hashes("host") == frozenset(host_tier.hashes())
    assert index.hashes("disk") == frozenset(disk_tier.hashes())
    for seed, prompt in enumerate(prompts):
        handle = admit(target, f"again{seed}", prompt)
        assert handle.num_cached_tokens() == 12, seed
        assert_holds(target, handle, prompt)
        target.deallocate(f"again{seed}")
    target.check_invariants()
