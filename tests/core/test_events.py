"""Cache events: a subscriber that replays them knows exactly which hashes the pool holds."""

from __future__ import annotations

import random

import pytest

from kvcache_core import InvalidArgumentError
from kvcache_core.errors import InvalidTypeError
from kvcache_core.offload.events import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlockIndex, CacheEvent
from kvcache_core.testing.kv_data import pool_hashes
from tests.core.support import admit, make_manager


def test_a_replaying_subscriber_holds_exactly_the_pool_hashes_through_evictions_and_gc() -> None:
    manager = make_manager(num_blocks=24)
    index = CachedBlockIndex()
    manager.subscribe(index)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
    live: list[str] = []
    for turn in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        if len(live) > 2 or (live and rng.random() < 0.3):
            manager.deallocate(live.pop(rng.randrange(len(live))))
        try:
            admit(manager, f"r{turn}", prompt)
            live.append(f"r{turn}")
        except MemoryError:  # a full pool: the request waits, as a scheduler would make it
            pass
        if turn % 17 == 16:
            manager.gc()
        assert index.hashes() == pool_hashes(manager)
    assert manager.stats().eviction_count > 0
    for request_id in live:
        manager.deallocate(request_id)
    manager.gc()
    assert index.hashes() == pool_hashes(manager) == frozenset()
    manager.check_invariants()


def test_stored_events_carry_the_chain_tokens_and_block_size() -> None:
    manager = make_manager()
    events: list[CacheEvent] = []
    manager.subscribe(events.append)
    prompt = list(range(100, 109))
    admit(manager, "r", prompt)
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert [event.token_ids for event in stored] == [tuple(prompt[0:4]), tuple(prompt[4:8])]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert {event.block_size for event in stored} == {4}
    assert {event.medium for event in stored} == {"pool"}
    assert {event.lora_id for event in stored} == {None}
    index = CachedBlockIndex()
    for event in events:
        index.apply(event)
    assert index.tokens[stored[1].block_hashes[0]] == tuple(prompt[4:8])


def test_eviction_reports_the_removed_hash_once() -> None:
    manager = make_manager(num_blocks=3)
    events: list[CacheEvent] = []
    admit(manager, "a", list(range(9)))
    manager.deallocate("a")
    manager.subscribe(events.append)
    manager.gc()
    removed = [event for event in events if isinstance(event, BlockRemoved)]
    assert sorted(hash for event in removed for hash in event.block_hashes) == sorted(
        {hash for event in removed for hash in event.block_hashes}
    )
    assert len([hash for event in removed for hash in event.block_hashes]) == 2


def test_close_clears_all_blocks() -> None:
    manager = make_manager()
    index = CachedBlockIndex()
    events: list[CacheEvent] = []
    manager.subscribe(index)
    manager.subscribe(events.append)
    admit(manager, "a", list(range(9)))
    assert index.hashes()
    manager.close()
    assert events[-1] == AllBlocksCleared()
    assert index.hashes() == frozenset()
    assert index.media() == []


def test_unsubscribed_callbacks_hear_nothing_more() -> None:
    manager = make_manager()
    events: list[CacheEvent] = []
    manager.subscribe(events.append)
    admit(manager, "a", list(range(5)))
    heard = len(events)
    manager.unsubscribe(events.append)
    admit(manager, "b", list(range(20, 29)))
    assert len(events) == heard == 1


def test_a_raising_subscriber_becomes_a_warning_and_the_operation_stands() -> None:
    manager = make_manager()
    index = CachedBlockIndex()

    def broken(event: CacheEvent) -> None:
        raise RuntimeError("router down")

    manager.subscribe(broken)
    manager.subscribe(index)
    with pytest.warns(RuntimeWarning, match="router down"):
        admit(manager, "a", list(range(9)))
    assert index.hashes() == pool_hashes(manager)
    assert len(index.hashes()) == 2


def test_bad_subscriptions_are_refused_naming_the_callback() -> None:
    manager = make_manager()
    with pytest.raises(InvalidTypeError, match="callable"):
        manager.subscribe(42)  # type: ignore[arg-type]
    index = CachedBlockIndex()
    manager.subscribe(index)
    with pytest.raises(InvalidArgumentError, match="already subscribed"):
        manager.subscribe(index)
    with pytest.raises(InvalidArgumentError, match="not subscribed"):
        manager.unsubscribe(print)
    admit(manager, "a", list(range(5)))
    assert len(index.hashes()) == 1  # subscribed once: one copy of each event
