"""A tier that fails, lies or is interrupted never costs the pool a block: every tier call is
guarded (a miss, or a TierError), interrupts propagate after the rollback, close() always
closes the storage, and a tier binds to one manager at a time."""

from __future__ import annotations

import dataclasses
import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("safetensors")

from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.errors import InvalidArgumentError, InvalidTypeError, TierError
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.prefix_file import BlockRecord
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier, create_tier
from kvcache_core.testing.faults import CallInjector, FaultyStorage, InjectedFaultError
from kvcache_core.testing.tiers import FaultyTier
from kvcache_core.testing.world import assert_same_state, snapshot

Manager = PagedKvCacheManager[Any]
BLOCK = 4
PROMPT = tuple(range(100, 100 + 2 * BLOCK + 1))  # two full blocks and one token


class Interrupted(KeyboardInterrupt):
    """Ctrl-C inside a tier call."""


def config() -> CacheConfig:
    return CacheConfig(
        num_layers=2, num_heads=1, head_dim=4, num_blocks=8, block_size=BLOCK, enable_prefix_caching=True
    )


def tiered(*tiers: OffloadTier) -> Manager:
    return create_manager("numpy", config(), tiers=list(tiers))


def admit(manager: Manager, request_id: str, prompt: tuple[int, ...] = PROMPT) -> Any:
    """Allocate with ``prompt`` and write K/V equal to each position's token id."""
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt))
    start = handle.num_tokens()
    slots = manager.extend(handle, len(prompt) - start)
    rows = np.broadcast_to(np.asarray(prompt[start:], dtype=np.float32)[:, None, None], (len(slots), 1, 4))
    for layer in range(2):
        manager.write(layer, slots, rows + layer, -rows)
    return handle


def demoted(*tiers: OffloadTier) -> Manager:
    """A manager whose prompt's two full blocks were written, released and demoted."""
    manager = tiered(*tiers)
    admit(manager, "a")
    manager.deallocate("a")
    manager.gc()
    assert sum(tier.blocks for tier in manager.tier_stats()) == 2
    return manager


def held_keys(manager: Manager, handle: Any) -> Any:
    keys, _ = manager.gather(handle, 1)
    return np.asarray(keys)[:, 0, 0]


class ReadOnlyDisk(DiskTier):
    """A disk tier whose directory turned read-only after it was filled: files still read,
    nothing can be written or removed. (Tests run as root, where a read-only mode bit does
    not stop writes; this tier raises what a read-only file system raises.)"""

    read_only = False

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        if self.read_only:
            raise OSError(errno.EROFS, "Read-only file system")
        return super().put(record)

    def discard(self, key: bytes, /) -> None:
        if self.read_only and key in self:
            raise OSError(errno.EROFS, "Read-only file system")
        super().discard(key)

    def clear(self) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, "Read-only file system")
        super().clear()


def test_a_prefix_hit_from_a_read_only_disk_tier_is_served_and_leaks_nothing(tmp_path: Path) -> None:
    disk = ReadOnlyDisk(tmp_path, 1 << 20)
    manager = demoted(disk)
    disk.read_only = True
    with pytest.warns(RuntimeWarning, match="Read-only file system"):
        handle = admit(manager, "b")
    assert handle.num_cached_tokens() == 2 * BLOCK  # read back: served from the tier
    assert list(held_keys(manager, handle)[: 2 * BLOCK]) == [token + 1 for token in PROMPT[: 2 * BLOCK]]
    manager.check_invariants()
    assert manager.tier_stats()[0].errors == 2  # the two discards that failed


def test_a_planted_file_in_the_disk_tier_is_a_miss_and_leaks_nothing(tmp_path: Path) -> None:
    manager = demoted(DiskTier(tmp_path, 1 << 20))
    for planted in tmp_path.glob("*.safetensors"):
        planted.write_bytes(b"\xff" * 8 + b"{" * 64)  # a header length past the file, then no JSON
    with pytest.warns(RuntimeWarning, match="give back a block"):
        handle = admit(manager, "b")
    assert handle.num_cached_tokens() == 0
    manager.check_invariants()
    manager.deallocate("b")
    manager.gc()
    assert manager.stats().used_blocks == 0


@pytest.mark.parametrize("error", [RuntimeError("remote tier down"), RecursionError(), OSError(errno.EIO, "EIO")])
def test_a_third_party_tier_whose_peek_raises_is_a_counted_miss(error: Exception) -> None:
    counter = CallInjector(None, "before", type(error))
    tier = FaultyTier(HostTier(1 << 20), counter)
    manager = demoted(tier)
    tier.peek = lambda key: (_ for _ in ()).throw(error)  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="give back a block"):
        handle = admit(manager, "b")
    assert handle.num_cached_tokens() == 0
    (stats,) = manager.tier_stats()
    assert (stats.errors, stats.failures) == (2, 2)  # each of the two blocks, dropped
    manager.check_invariants()


def test_an_interrupt_inside_a_peek_propagates_and_changes_nothing() -> None:
    counter = CallInjector(None, "before", Interrupted)
    manager = demoted(FaultyTier(HostTier(1 << 20), counter))
    before = snapshot(manager)
    calls_before = len(counter.calls)
    for offset in range(12):  # each of the allocation's tier calls in turn
        counter.fail_at, counter.fired = calls_before + offset, None
        del counter.calls[calls_before:]
        try:
            manager.allocate(AllocationRequest("b", prompt_token_ids=PROMPT))
        except Interrupted:
            assert_same_state(snapshot(manager), before)
            manager.check_invariants()
            continue
        assert counter.fired is None  # past the allocation's last tier call
        break
    else:
        pytest.fail("the allocation made more than 12 tier calls")
    assert counter.fired is None
    assert offset >= 3


@pytest.mark.parametrize(
    "garbage",
    [
        "not a record",
        "wrong shape",
        "wrong dtype",
        "flipped byte",
        "another key",
        "forged hash",
    ],
)
def test_a_record_a_tier_gives_back_is_checked_before_it_enters_the_pool(garbage: str) -> None:
    inner = HostTier(1 << 20)
    tier = FaultyTier(inner, CallInjector())
    manager = demoted(tier)

    def lying_peek(key: bytes, /) -> Any:
        record = inner.peek(key)
        assert record is not None
        if garbage == "not a record":
            return (record.keys, record.values)
        if garbage == "wrong shape":
            return _with(record, keys=record.keys[:, :2], values=record.values[:, :2])
        if garbage == "wrong dtype":
            return _with(record, keys=record.keys.astype(np.float64), values=record.values.astype(np.float64))
        if garbage == "flipped byte":
            values = record.values.copy()
            values.reshape(-1).view(np.uint8)[3] ^= 0x40
            return _with(record, values=values)
        if garbage == "another key":
            return _with(record, group=1)
        return _with(record, token_ids=tuple(token + 1 for token in record.token_ids))

    tier.peek = lying_peek  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="give back a block"):
        handle = admit(manager, "b")
    assert handle.num_cached_tokens() == 0
    assert manager.tier_stats()[0].errors == 2  # each of the two blocks, dropped
    manager.check_invariants()


def _with(record: BlockRecord, **changes: Any) -> BlockRecord:
    return dataclasses.replace(record, **changes)


def test_a_tier_that_cannot_take_blocks_loses_them_and_the_eviction_goes_on() -> None:
    counter = CallInjector()
    tier = FaultyTier(HostTier(1 << 20), counter)
    manager = tiered(tier)
    admit(manager, "a")
    manager.deallocate("a")
    tier.put = lambda record: (_ for _ in ()).throw(RuntimeError("quota"))  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="quota"):
        manager.gc()
    assert manager.stats().cached_blocks == 0
    (stats,) = manager.tier_stats()
    assert (stats.blocks, stats.failures, stats.errors) == (0, 2, 2)
    manager.check_invariants()


def test_an_interrupt_while_demoting_inside_an_allocation_gives_every_block_back() -> None:
    counter = CallInjector(None, "before", Interrupted)
    manager = tiered(FaultyTier(HostTier(1 << 20), counter))
    admit(manager, "a")
    manager.deallocate("a")
    before = snapshot(manager)
    counter.fail_at = len(counter.calls)  # the first call of the demotion the allocation causes
    with pytest.raises(Interrupted):
        # a prefix hit on the first block, and every other block: the cached second one is evicted
        manager.allocate(AllocationRequest("b", prompt_token_ids=(*PROMPT[:BLOCK], 7), initial_tokens=8 * BLOCK))
    assert_same_state(snapshot(manager), before)
    manager.check_invariants()


def test_close_closes_the_storage_when_a_read_only_disk_tier_cannot_clear(tmp_path: Path) -> None:
    disk = ReadOnlyDisk(tmp_path, 1 << 20)
    storage = FaultyStorage(create_manager("numpy", config()).storage)
    manager = PagedKvCacheManager(storage, tiers=[disk])
    admit(manager, "a")
    manager.deallocate("a")
    manager.gc()
    disk.read_only = True
    with pytest.warns(RuntimeWarning, match="Read-only file system"):
        manager.close()
    assert manager.closed
    assert storage.closed
    assert manager.tier_stats()[0].errors == 1


def test_close_closes_the_storage_when_a_tier_is_interrupted() -> None:
    counter = CallInjector(None, "before", Interrupted)
    storage = FaultyStorage(create_manager("numpy", config()).storage)
    manager = PagedKvCacheManager(storage, tiers=[FaultyTier(HostTier(1 << 20), counter)])
    counter.fail_at = len(counter.calls)
    with pytest.raises(Interrupted):
        manager.close()
    assert manager.closed
    assert storage.closed


def test_a_tier_given_to_a_second_manager_is_refused_and_keeps_serving_the_first() -> None:
    tier = HostTier(1 << 20)
    first = demoted(tier)
    with pytest.raises(TierError, match="'host' is bound to another manager"):
        tiered(tier)
    assert admit(first, "b").num_cached_tokens() == 2 * BLOCK
    assert first.tier_stats()[0].hits == 2


def test_a_closed_manager_releases_its_tiers_cleared() -> None:
    tier = HostTier(1 << 20)
    demoted(tier).close()
    assert tier.hashes() == []
    second = tiered(tier)
    assert admit(second, "a").num_cached_tokens() == 0


def test_a_manager_that_cannot_bind_its_second_tier_leaves_none_bound(tmp_path: Path) -> None:
    host = HostTier(1 << 20)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(TierError, match="cannot write into"):
        tiered(host, DiskTier(blocker / "tier", 1 << 20))
    tiered(host).close()


def test_a_tier_whose_members_fail_to_read_is_refused_by_name() -> None:
    counter = CallInjector(0, "before", InjectedFaultError)
    with pytest.raises(TierError, match="fails when its members are read"):
        tiered(FaultyTier(HostTier(1 << 20), counter))


def test_tiers_that_are_not_a_list_are_refused_by_type() -> None:
    with pytest.raises(InvalidTypeError, match="tiers must be a list or tuple of OffloadTier"):
        create_manager("numpy", config(), tiers=HostTier(1 << 20))  # type: ignore[call-overload]


def test_create_tier_names_an_option_it_does_not_take() -> None:
    with pytest.raises(InvalidTypeError, match=r"create_tier\('host'\) takes the options name; got 'bogus'"):
        create_tier("host", 1 << 20, bogus=1)


def test_create_tier_asks_for_the_disk_tiers_directory() -> None:
    with pytest.raises(InvalidTypeError, match=r"create_tier\('disk'\) needs directory=\.\.\."):
        create_tier("disk", 1 << 20)


READ_ONLY_SCRIPT = """
import json, subprocess, sys, warnings
import numpy as np
from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.offload.tiers import DiskTier

directory = sys.argv[1]
config = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=8, block_size=4, enable_prefix_caching=True)
manager = create_manager("numpy", config, tiers=[DiskTier(directory, 1 << 20)])
prompt = tuple(range(100, 109))
handle = manager.allocate(AllocationRequest("a", prompt_token_ids=prompt))
slots = manager.extend(handle, 9)
rows = np.ones((9, 1, 4), np.float32)
manager.write(0, slots, rows, rows)
manager.deallocate("a")
manager.gc()
for command in (["mount", "--bind", directory, directory], ["mount", "-o", "remount,ro,bind", directory]):
    subprocess.run(command, check=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cached = manager.allocate(AllocationRequest("b", prompt_token_ids=prompt)).num_cached_tokens()
    manager.check_invariants()
    manager.deallocate("b")
    manager.close()
print(json.dumps({"cached": cached, "warnings": [str(w.message) for w in caught], "closed": manager.closed}))
"""


def _mount_namespaces() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "--map-root-user", "true"], check=False).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _mount_namespaces(), reason="needs unshare --mount --map-root-user (a mount namespace)")
def test_a_disk_tier_whose_file_system_is_remounted_read_only_serves_hits_and_closes(tmp_path: Path) -> None:
    script = tmp_path / "read_only.py"
    script.write_text(READ_ONLY_SCRIPT)
    directory = tmp_path / "tier"
    result = subprocess.run(
        ["unshare", "--mount", "--map-root-user", sys.executable, str(script), str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["cached"] == 8  # read back from the read-only files
    assert any("Read-only file system" in message for message in report["warnings"])
    assert report["closed"]


def test_a_manager_dropped_without_close_frees_its_tiers() -> None:
    tier = HostTier(1 << 20)
    dropped = tiered(tier)
    del dropped  # unreachable (its pool and its eviction hook form a cycle): collected on demand
    tiered(tier).close()


def test_a_closed_manager_reports_its_tier_counts_without_asking_the_tier_it_freed() -> None:
    tier = HostTier(1 << 20)
    first = demoted(tier)
    first.close()
    second = demoted(tier)
    (closed,) = first.tier_stats()
    assert (closed.blocks, closed.used_bytes, closed.demotions) == (0, 0, 2)
    assert second.tier_stats()[0].blocks == 2


def test_a_disk_tier_drops_an_oldest_file_it_cannot_read_however_reading_fails(tmp_path: Path) -> None:
    source = DiskTier(tmp_path / "source", 1 << 20)
    manager = demoted(source)
    records = [source.peek(key) for key in source.hashes()]
    file_bytes = manager.tier_stats()[0].used_bytes // 2
    tier = DiskTier(tmp_path / "small", file_bytes + file_bytes // 2)  # room for one file
    tier.bind(config())
    first, second = records
    assert first is not None
    assert second is not None
    assert tier.put(first) == []
    nested = b"[" * 100_000  # a header nested past the recursion limit
    tier.path_of(first.key).write_bytes(len(nested).to_bytes(8, "little") + nested)
    assert tier.put(second) == [first.key]  # dropped, not passed on
    assert tier.hashes() == [second.key]


@pytest.mark.parametrize("directory", ["", "a\x00b"])
def test_a_disk_tier_refuses_an_empty_directory_or_one_with_a_nul(directory: str) -> None:
    with pytest.raises(InvalidArgumentError, match="a disk tier's directory must be a non-empty str"):
        DiskTier(directory, 1 << 20)


def test_a_tier_takes_a_numpy_integer_capacity() -> None:
    capacity: Any = np.int64(1 << 20)  # what a NumPy computation of the size gives
    assert HostTier(capacity).max_bytes == 1 << 20
