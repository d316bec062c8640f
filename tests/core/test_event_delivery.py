"""When listeners run: after the change that made the event is complete, whatever they raise."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, MemoryPressure, PagedKvCacheManager
from kvcache_core.offload.events import BlockRemoved, BlockStored, CachedBlockIndex, CacheEvent
from kvcache_core.testing.kv_data import pool_hashes
from tests.core import support

Manager = PagedKvCacheManager[Any]
BLOCK_SIZE = 4
PROMPT = tuple(range(1, 2 * BLOCK_SIZE + 2))  # two full blocks and one token


make_manager = partial(support.make_manager, num_blocks=16)


def compute(manager: Manager, request_id: str, prompt: Sequence[int]) -> None:
    """Allocate ``prompt`` and write every token the cache did not supply, in every layer."""
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=tuple(prompt)))
    count = len(prompt) - handle.num_tokens()
    slots = manager.extend(handle, count, token_ids=prompt[handle.num_tokens() :])
    rows = np.ones((count, 2, 4), dtype=np.float32)
    for layer in range(manager.config.num_layers):
        manager.write(layer, slots, rows, rows)


def interrupt_on(kind: type[CacheEvent]) -> Any:
    def callback(event: CacheEvent) -> None:
        if isinstance(event, kind):
            raise KeyboardInterrupt

    return callback


def test_an_interrupting_stored_listener_leaves_the_registration_complete_and_still_interrupts() -> None:
    manager = make_manager()
    manager.subscribe(interrupt_on(BlockStored))
    with pytest.raises(KeyboardInterrupt):
        compute(manager, "a", PROMPT)
    manager.check_invariants()
    hit = manager.allocate(AllocationRequest("b", prompt_token_ids=PROMPT))
    assert hit.num_cached_tokens() == 2 * BLOCK_SIZE


def test_an_interrupting_removed_listener_leaves_the_eviction_complete() -> None:
    manager = make_manager(num_blocks=4)
    compute(manager, "a", PROMPT)
    manager.deallocate("a")  # its two full blocks stay cached
    manager.subscribe(interrupt_on(BlockRemoved))
    with pytest.raises(KeyboardInterrupt):
        manager.allocate(AllocationRequest("b", initial_tokens=4 * BLOCK_SIZE))  # evicts both
    manager.check_invariants()
    assert manager.get_handle("b") is not None
    assert pool_hashes(manager) == frozenset()


def test_listeners_see_the_state_after_the_change_is_complete() -> None:
    manager = make_manager(num_blocks=4)
    failures: list[str] = []

    def audit(event: CacheEvent) -> None:
        try:
            manager.check_invariants()
        except AssertionError as exc:  # InvariantError is an AssertionError
            failures.append(f"{type(event).__name__}: {exc}")

    manager.subscribe(audit)
    compute(manager, "a", PROMPT)
    manager.deallocate("a")
    manager.allocate(AllocationRequest("b", initial_tokens=4 * BLOCK_SIZE))
    assert failures == []


def test_other_subscribers_get_every_event_when_one_interrupts() -> None:
    manager = make_manager()
    manager.subscribe(interrupt_on(BlockStored))
    index = CachedBlockIndex()
    manager.subscribe(index)
    with pytest.raises(KeyboardInterrupt):
        compute(manager, "a", PROMPT)
    assert index.hashes() == pool_hashes(manager) != frozenset()


def test_a_listener_raising_an_exception_gives_a_warning_and_the_operation_succeeds() -> None:
    manager = make_manager()

    def broken(event: CacheEvent) -> None:
        raise ValueError("broken subscriber")

    manager.subscribe(broken)
    with pytest.warns(RuntimeWarning, match="broken subscriber"):
        compute(manager, "a", PROMPT)
    manager.check_invariants()
    assert len(pool_hashes(manager)) == 2


def test_a_listener_calling_the_manager_gets_its_events_after_the_current_ones() -> None:
    manager = make_manager()
    events: list[CacheEvent] = []

    def replay(event: CacheEvent) -> None:
        events.append(event)
        if isinstance(event, BlockStored) and manager.get_handle("b") is None:
            compute(manager, "b", (*PROMPT[: 2 * BLOCK_SIZE], 50, 51, 52, 53, 54))  # stores a third block

    manager.subscribe(replay)
    compute(manager, "a", PROMPT)
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert [len(event.token_ids) for event in stored] == [BLOCK_SIZE] * 3
    assert stored[2].parent_block_hash == stored[1].block_hashes[0]  # after the two of "a"
    manager.check_invariants()


def test_an_interrupting_pressure_callback_runs_after_the_allocation_is_complete() -> None:
    manager = make_manager(num_blocks=4)
    levels: list[MemoryPressure] = []

    def interrupt(level: MemoryPressure) -> None:
        levels.append(level)
        manager.check_invariants()
        raise KeyboardInterrupt

    manager.set_pressure_callback(interrupt)
    with pytest.raises(KeyboardInterrupt):
        manager.allocate(AllocationRequest("a", initial_tokens=4 * BLOCK_SIZE))
    assert levels == [MemoryPressure.CRITICAL]
    assert manager.get_handle("a") is not None
    manager.check_invariants()
