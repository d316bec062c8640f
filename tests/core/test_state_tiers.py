"""State checkpoints beyond the pool: offload tiers carry them with their blocks, a prefix hit
through the tiers stops at the last block whose checkpoint is held, prefix files carry them,
and a pool with state layers publishes a block only once a checkpoint reaches it."""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, HostTier, LayerSpec, StateSpec, create_manager
from kvcache_core.contract.states import STATE_RECORD_GROUP
from kvcache_core.errors import CorruptCacheFileError, IncompatibleCacheFileError
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.events import BlockRemoved, BlockStored, CachedBlockIndex, CacheEvent
from kvcache_core.offload.prefix_file import BlockRecord, record_key
from kvcache_core.offload.redis_tier import RedisTier
from kvcache_core.offload.tiers import DiskTier, OffloadTier
from kvcache_core.testing.faults import InjectedFaultError
from kvcache_core.testing.inspect import block_pool
from kvcache_core.testing.states import _FaultyStorageWithStates  # pyright: ignore[reportPrivateUsage]
from tests.redis_support import RedisServer, unique_prefix

pytest.importorskip("safetensors")

STATE = StateSpec(arrays=(("conv", (6, 3)), ("recurrent", (2, 3, 4), "float64")))
PROMPT = tuple(range(10, 23))  # 13 tokens: three full blocks of 4, one token more
Manager = Any
#: A request's states: (layer, array name) -> its values.
States = dict[tuple[int, str], np.ndarray[Any, Any]]


@pytest.fixture(autouse=True)
def _quiet_misses() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # every counted miss warns
        yield


def config_of(state: StateSpec = STATE, **fields: Any) -> CacheConfig:
    """State, attention, state, attention; 4 slots; prefix caching."""
    base: dict[str, Any] = {
        "num_layers": 4,
        "num_heads": 2,
        "head_dim": 8,
        "num_blocks": 8,
        "block_size": 4,
        "layer_specs": (LayerSpec(state=state), LayerSpec(), LayerSpec(state=state), LayerSpec()),
        "state_slots": 4,
        "enable_prefix_caching": True,
    }
    return CacheConfig(**{**base, **fields})


def compute(
    manager: Manager, request_id: str, checkpoints: tuple[int, ...] = (1, 2, 3), into: list[States] | None = None
) -> list[States]:
    """Run ``PROMPT``'s three full blocks as request ``request_id``: random K/V and states per
    block, a checkpoint after each block of ``checkpoints``; deallocated at the end. Returns
    the states after each block (appended to ``into`` as they are written, when given)."""
    rng = np.random.default_rng(len(request_id))
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=PROMPT))
    after: list[States] = into if into is not None else []
    for block in (1, 2, 3):
        step = manager.begin_step([handle], 4)
        keys = rng.standard_normal((4, 2, 8)).astype(np.float32)
        for layer in (1, 3):
            step.write(layer, keys, keys)
        states: States = {}
        for layer, array in manager.config.states.arrays:
            values = rng.standard_normal((1, *array.shape)).astype(array.dtype)
            step.write_state(layer, array.name, values)
            states[layer, array.name] = values
        after.append(states)
        if block in checkpoints:
            assert manager.begin_step([handle], 0).checkpoint_states() == 1
    manager.deallocate(request_id)
    return after


def states_of(manager: Manager, handle: Any) -> States:
    step = manager.begin_step([handle], 0)
    return {
        (layer, array.name): np.asarray(step.state(layer, array.name)) for layer, array in manager.config.states.arrays
    }


def assert_states(found: States, expected: States, when: str) -> None:
    for key, values in expected.items():
        assert np.array_equal(found[key], values), f"{when}: state {key} differs"


def tier_of(kind: str, tmp_path: Path) -> OffloadTier:
    return DiskTier(tmp_path / "tier", 1 << 20) if kind == "disk" else HostTier(1 << 20)


# -- tiers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_demoted_checkpoint_goes_with_its_block_and_a_hit_through_the_tier_restores_it(
    kind: str, tmp_path: Path
) -> None:
    tier = tier_of(kind, tmp_path)
    manager = create_manager("numpy", config_of(), tiers=[tier])
    after = compute(manager, "first")
    manager.gc()  # every cached block leaves the pool for the tier
    assert manager.stats().checkpoint_state_slots == 0, "a demoted block's checkpoint stayed in the pool"
    held = set(tier.hashes())
    checkpoints = {key for key in held if key[32:] == STATE_RECORD_GROUP.to_bytes(2, "big")}
    assert len(checkpoints) == 3, f"the tier holds {len(checkpoints)} state checkpoints, 3 were filed"
    assert len(held) == 6, f"the tier holds {len(held)} records: 3 blocks and 3 checkpoints were demoted"
    second = manager.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert second.num_cached_tokens() == 12
    assert_states(states_of(manager, second), after[2], "a hit through the tier")
    assert manager.stats().checkpoint_state_slots == 1, "the promoted checkpoint is the pool's again"
    assert record_key(sorted(checkpoints)[0][:32], STATE_RECORD_GROUP) in checkpoints
    assert manager.tier_stats()[0].hits == 3, "hits count the promoted blocks"
    manager.check_invariants()


def test_a_hit_through_the_tiers_stops_at_the_last_block_with_a_checkpoint(tmp_path: Path) -> None:
    manager = create_manager("numpy", config_of(), tiers=[HostTier(1 << 20)])
    after = compute(manager, "first", checkpoints=(1,))  # blocks 2 and 3 have none
    manager.gc()
    second = manager.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert second.num_cached_tokens() == 4, "the hit went past the last checkpoint"
    assert_states(states_of(manager, second), after[0], "a hit stopping at the first block")
    manager.check_invariants()


def test_without_any_checkpoint_the_tiers_serve_no_hit() -> None:
    manager = create_manager("numpy", config_of(), tiers=[HostTier(1 << 20)])
    compute(manager, "first", checkpoints=())
    manager.gc()
    assert manager.tier_stats()[0].blocks == 3
    second = manager.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert second.num_cached_tokens() == 0
    zeros = {(layer, array.name): np.zeros((1, *array.shape)) for layer, array in manager.config.states.arrays}
    assert_states(states_of(manager, second), zeros, "a request without a hit")


def test_a_corrupt_checkpoint_file_is_a_counted_miss_and_the_hit_stops_before_it(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "tier", 1 << 20)
    manager = create_manager("numpy", config_of(), tiers=[tier])
    after = compute(manager, "first")
    manager.gc()
    state_files = sorted((tmp_path / "tier").glob("*.state.safetensors"))
    assert len(state_files) == 3
    # The last block's checkpoint: the one whose parent is another checkpoint's block.
    last = next(
        path
        for path in state_files
        if _parent_of(path) in {_hash_of(other) for other in state_files}
        and _hash_of(path) not in {_parent_of(other) for other in state_files}
    )
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in the state bytes
    last.write_bytes(bytes(data))
    errors = manager.tier_stats()[0].errors
    second = manager.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert second.num_cached_tokens() == 8, "the hit went past a checkpoint that could not be read"
    assert_states(states_of(manager, second), after[1], "a hit stopping at the second block")
    stats = manager.tier_stats()[0]
    assert stats.errors == errors + 1, stats
    assert stats.failures == 1, stats
    manager.check_invariants()


def _header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    table: dict[str, Any] = json.loads(data[8 : 8 + length])
    header: dict[str, Any] = json.loads(table["__metadata__"]["kvcache"])
    return header


def _hash_of(path: Path) -> str:
    return str(_header(path)["checkpoints"][0]["hash"])


def _parent_of(path: Path) -> str | None:
    parent = _header(path)["checkpoints"][0]["parent"]
    return None if parent is None else str(parent)


def test_a_failing_state_copy_leaves_pool_tiers_and_counts_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = HostTier(1 << 20)
    manager = create_manager("numpy", config_of(), tiers=[tier])
    compute(manager, "first")
    manager.gc()
    storage = block_pool(manager).states.storage
    before = (manager.stats(), manager.tier_stats(), sorted(tier.hashes()))

    def broken(*_: object) -> None:
        raise OSError("the state pool's write failed")

    monkeypatch.setattr(storage, "from_host", broken)
    with pytest.raises(OSError, match="state pool's write failed"):
        manager.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert (manager.stats(), manager.tier_stats(), sorted(tier.hashes())) == before
    manager.check_invariants()


def test_a_checkpoint_record_of_another_state_shape_is_refused_by_name(tmp_path: Path) -> None:
    from kvcache_core.offload.prefix_file import read_blocks, write_blocks

    config = config_of()
    other = config_of(StateSpec(arrays=(("conv", (5, 3)), ("recurrent", (2, 3, 4), "float64"))))
    tier = HostTier(1 << 20)
    manager = create_manager("numpy", config, tiers=[tier])
    compute(manager, "first")
    manager.gc()
    records = [tier.peek(key) for key in tier.hashes()]
    checkpoint = next(record for record in records if isinstance(record, BlockRecord) and record.is_checkpoint)
    path = tmp_path / "state.safetensors"
    write_blocks(path, config, [checkpoint])
    assert read_blocks(path, config, chained=False)[0].keys.tobytes() == checkpoint.keys.tobytes()
    with pytest.raises(IncompatibleCacheFileError, match=r"state arrays.*'conv', \[5, 3\]"):
        read_blocks(path, other, chained=False)
    empty = LayerSpec(keeps_kv=False)  # the same K/V geometry, no state layers
    stateless = config_of(layer_specs=(empty, LayerSpec(), empty, LayerSpec()), state_slots=None)
    with pytest.raises(
        IncompatibleCacheFileError, match=r"state checkpoints of the arrays .*; this pool's state arrays are \[\]"
    ):
        read_blocks(path, stateless, chained=False)
    plain = CacheConfig(num_layers=4, num_heads=2, head_dim=8, num_blocks=8, block_size=4, enable_prefix_caching=True)
    with pytest.raises(IncompatibleCacheFileError, match="geometry"):
        read_blocks(path, plain, chained=False)


#: A change to a checkpoint file's header (the first checkpoint's entry where named) and the
#: words of its refusal.
DAMAGE: dict[str, tuple[str, dict[str, Any], str]] = {
    "an older version": ("", {"version": 2}, "state checkpoints in a file of version 2"),
    "another checksum": ("entry", {"checksum": "0" * 64}, "does not match its checksum"),
    "a bool token id": ("entry", {"token_ids": [1, 2, 3, True]}, "token id 3"),
    "a group": ("entry", {"group": 1}, "names a group"),
    "no list": ("", {"checkpoints": {}}, "'checkpoints' is"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_bad_checkpoint_header_is_refused_naming_the_field(damage: str, tmp_path: Path) -> None:
    from kvcache_core.offload.prefix_file import read_blocks, write_blocks

    config = config_of()
    tier = HostTier(1 << 20)
    manager = create_manager("numpy", config, tiers=[tier])
    compute(manager, "first")
    manager.gc()
    records = [tier.peek(key) for key in tier.hashes()]
    checkpoint = next(record for record in records if isinstance(record, BlockRecord) and record.is_checkpoint)
    path = tmp_path / "state.safetensors"
    write_blocks(path, config, [checkpoint])
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    table = json.loads(data[8 : 8 + length])
    header: dict[str, Any] = json.loads(table["__metadata__"]["kvcache"])
    where, fields, named = DAMAGE[damage]
    (header["checkpoints"][0] if where == "entry" else header).update(fields)
    table["__metadata__"]["kvcache"] = json.dumps(header)
    encoded = json.dumps(table).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])
    with pytest.raises(CorruptCacheFileError, match=named):
        read_blocks(path, config, chained=False)


def test_a_redis_tier_carries_checkpoints_to_another_manager(redis_server: RedisServer) -> None:
    pytest.importorskip("redis")
    prefix = unique_prefix()
    first_tier = RedisTier(redis_server.url, 1 << 24, prefix=prefix, deadline_s=5.0)
    first = create_manager("numpy", config_of(), tiers=[first_tier])
    after = compute(first, "first", checkpoints=(1, 2))
    first.gc()
    assert first_tier.flush(10.0)
    first.close()
    second_tier = RedisTier(redis_server.url, 1 << 24, prefix=prefix, deadline_s=5.0)
    second = create_manager("numpy", config_of(), tiers=[second_tier])
    handle = second.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert handle.num_cached_tokens() == 8, "the hit through the server went past its last checkpoint"
    assert_states(states_of(second, handle), after[1], "a checkpoint another manager wrote")
    second.check_invariants()
    second.close()


def test_another_state_shape_never_reads_a_redis_checkpoint(redis_server: RedisServer) -> None:
    pytest.importorskip("redis")
    prefix = unique_prefix()
    first_tier = RedisTier(redis_server.url, 1 << 24, prefix=prefix, deadline_s=5.0)
    first = create_manager("numpy", config_of(), tiers=[first_tier])
    compute(first, "first")
    first.gc()
    assert first_tier.flush(10.0)
    first.close()
    other = StateSpec(arrays=(("conv", (5, 3)), ("recurrent", (2, 3, 4), "float64")))
    second_tier = RedisTier(redis_server.url, 1 << 24, prefix=prefix, deadline_s=5.0)
    second = create_manager("numpy", config_of(other), tiers=[second_tier])
    handle = second.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert handle.num_cached_tokens() == 0, "a pool of other state arrays read another's records"
    assert second_tier.stats().refused == 0, "the records should live under another format tag, not be refused"
    second.close()


# -- prefix files --------------------------------------------------------------------------------


def test_a_prefix_file_carries_checkpoints_and_a_new_pool_resumes_from_them(tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    manager = create_manager("numpy", config_of())
    after = compute(manager, "first", checkpoints=(1, 2))
    assert manager.save_prefix_cache(path) == 3, "the blocks written (checkpoints are not counted)"
    fresh = create_manager("numpy", config_of())
    assert fresh.load_prefix_cache(path) == 3
    assert fresh.stats().checkpoint_state_slots == 2
    handle = fresh.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert handle.num_cached_tokens() == 8
    assert_states(states_of(fresh, handle), after[1], "a checkpoint loaded from a file")
    fresh.check_invariants()


def test_a_prefix_file_without_checkpoints_still_loads_and_serves_no_state_hit(tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    manager = create_manager("numpy", config_of())
    compute(manager, "first", checkpoints=())
    assert manager.save_prefix_cache(path) == 3
    assert _version(path) == 2, "a file without checkpoints keeps the format version older readers know"
    fresh = create_manager("numpy", config_of())
    assert fresh.load_prefix_cache(path) == 3
    handle = fresh.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert handle.num_cached_tokens() == 0


def _version(path: Path) -> int:
    return int(_header(path)["version"])


def test_a_prefix_file_with_checkpoints_is_refused_by_a_pool_of_other_states(tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    manager = create_manager("numpy", config_of())
    compute(manager, "first")
    manager.save_prefix_cache(path)
    assert _version(path) == 3
    other = create_manager("numpy", config_of(StateSpec(arrays=(("conv", (6, 3)),))))
    with pytest.raises(IncompatibleCacheFileError, match="state arrays"):
        other.load_prefix_cache(path)
    assert other.stats().cached_blocks == 0, "a refused file loaded blocks"


def test_checkpoints_past_the_free_slots_go_to_the_tiers(tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    manager = create_manager("numpy", config_of())
    compute(manager, "first")
    manager.save_prefix_cache(path)
    tier = HostTier(1 << 20)
    fresh = create_manager("numpy", config_of(state_slots=2), tiers=[tier])
    assert fresh.load_prefix_cache(path) == 3
    assert fresh.stats().checkpoint_state_slots == 2
    assert sum(1 for key in tier.hashes() if key[32:] == b"\xff\xff") == 1
    handle = fresh.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert handle.num_cached_tokens() == 12, "the third block's checkpoint, in the tier, serves the hit"
    fresh.check_invariants()


# -- events ----------------------------------------------------------------------------------------


def test_a_state_pool_publishes_a_block_only_once_a_checkpoint_reaches_it() -> None:
    manager = create_manager("numpy", config_of(), tiers=[HostTier(1 << 20)])
    events: list[CacheEvent] = []
    index = CachedBlockIndex()
    manager.subscribe(events.append)
    manager.subscribe(index)
    compute(manager, "first", checkpoints=(2,))
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert len(stored) == 1, "the pool published blocks before a checkpoint reached them"
    assert len(stored[0].block_hashes) == 2, "the pool published the third block, which has no checkpoint"
    hashes = set(stored[0].block_hashes)
    assert index.hashes("pool") == hashes
    manager.gc()  # demoted: the tier publishes what the pool did, the block without a checkpoint nowhere
    assert index.hashes("pool") == frozenset()
    assert index.hashes("host") == hashes
    removed = [event for event in events if isinstance(event, BlockRemoved)]
    assert all(set(event.block_hashes) <= hashes for event in removed), "a never-published hash was removed"
    second = manager.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert second.num_cached_tokens() == 8, "a router claiming what the events say would claim 8 tokens"
    assert index.hashes("pool") == hashes
    assert index.hashes("host") == frozenset()


def test_a_pool_without_state_layers_publishes_every_block_as_before() -> None:
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=8, block_size=4, enable_prefix_caching=True)
    manager = create_manager("numpy", config)
    index = CachedBlockIndex()
    manager.subscribe(index)
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=PROMPT))
    step = manager.begin_step([handle], 12)
    keys = np.zeros((12, 2, 8), np.float32)
    for layer in range(2):
        step.write(layer, keys, keys)
    assert len(index.hashes("pool")) == 3


# -- explain -----------------------------------------------------------------------------------------


def test_explain_stops_a_state_pools_chain_at_its_last_checkpoint() -> None:
    manager = create_manager("numpy", config_of(), tiers=[HostTier(1 << 20)])
    compute(manager, "first", checkpoints=(1,))
    manager.gc()
    explained = manager.explain_prefix(PROMPT)
    assert explained.cached_tokens == 4, str(explained)
    assert explained.reason == "no state checkpoint"
    assert "blocks 1 to 2" in explained.detail
    second = manager.allocate(AllocationRequest("second", prompt_token_ids=PROMPT))
    assert second.num_cached_tokens() == explained.cached_tokens, "explain and allocate disagree"


# -- faults ------------------------------------------------------------------------------------------


def run_with_fault(fail_at: int, when: str) -> bool:
    """Compute ``PROMPT`` with checkpoints, demote it to a tier, hit it again, with storage
    call ``fail_at`` (K/V or state pool) failing ``when``: a failed allocation changes
    nothing, a request's states are those of the checkpoint its hit ends at, nothing leaks.
    Returns whether the fault fired."""
    base = create_manager("numpy", config_of())  # its config has the layout resolved
    storage = _FaultyStorageWithStates(base.storage, fail_at, "after" if when == "after" else "before")
    tier = HostTier(1 << 20)
    manager: Manager = PagedKvCacheManager(storage, backend="numpy", config=base.config, tiers=[tier])
    after: list[States] = []
    try:
        compute(manager, "first", into=after)
        manager.gc()
    except InjectedFaultError:
        manager.check_invariants()
    for name in ("second", "third"):
        before = (manager.stats(), manager.tier_stats(), sorted(tier.hashes()))
        try:
            handle = manager.allocate(AllocationRequest(name, prompt_token_ids=PROMPT))
        except InjectedFaultError:
            manager.check_invariants()
            assert (manager.stats(), manager.tier_stats(), sorted(tier.hashes())) == before, (
                f"a fault {when} storage call {fail_at} ({storage.fired}) left a partial allocation"
            )
            continue
        storage.fail_at = None
        cached: int = handle.num_cached_tokens() // 4
        if cached:
            assert_states(states_of(manager, handle), after[cached - 1], f"a hit after a fault at call {fail_at}")
        manager.check_invariants()
    storage.fail_at = None
    for name, _ in manager.list_handles():
        manager.deallocate(name)
    manager.gc()
    stats = manager.stats()
    assert (stats.used_state_slots, stats.used_blocks) == (0, 0), f"a fault at call {fail_at} leaked: {stats}"
    return storage.fired is not None


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_fault_at_any_storage_call_of_a_state_pool_with_tiers_leaks_nothing(when: str) -> None:
    fail_at = 0
    while run_with_fault(fail_at, when):
        fail_at += 1
    assert fail_at > 10, f"the script made only {fail_at} storage calls"


def test_a_checkpoint_evicted_for_a_slot_goes_to_the_tier_and_still_serves_a_hit() -> None:
    tier = HostTier(1 << 20)
    manager = create_manager("numpy", config_of(state_slots=2), tiers=[tier])
    after = compute(manager, "first", checkpoints=(1, 2))  # one slot to spare: the second evicts the first
    assert manager.stats().checkpoint_state_slots == 1
    assert sum(1 for key in tier.hashes() if key[32:] == b"\xff\xff") == 1, "the evicted checkpoint was dropped"
    prompt = PROMPT[:5]  # the first block, one token more: its checkpoint is in the tier only
    second = manager.allocate(AllocationRequest("second", prompt_token_ids=prompt))
    assert second.num_cached_tokens() == 4, "the pool's block and the tier's checkpoint serve the first block"
    assert_states(states_of(manager, second), after[0], "a checkpoint demoted when its slot was needed")
    manager.check_invariants()
