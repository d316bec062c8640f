"""Growing requests is all or nothing: when taking blocks for a later KV-cache group (or a
later request of a step) is interrupted, the blocks and copies taken before go back and
every table is as it was."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

pytest.importorskip("safetensors")

from kvcache_core import AllocationRequest, CacheConfig, LayerSpec, PagedKvCacheHandle, create_manager
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.tiers import HostTier
from kvcache_core.testing.faults import CallInjector, FaultyStorage, InjectedFaultError
from kvcache_core.testing.tiers import FaultyTier, Interrupted
from kvcache_core.testing.world import Snapshot, assert_same_state, snapshot

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]
BLOCK = 4
OLD = tuple(range(500, 500 + 2 * BLOCK))  # two full blocks, cached once released
PROMPT = tuple(range(100, 100 + BLOCK + 2))  # a full block and a partial one


def hybrid(num_blocks: int) -> tuple[Manager, CallInjector, FaultyStorage]:
    """A full-attention group and a sliding-window group over ``num_blocks`` blocks, with a
    host tier whose calls can be interrupted and a storage whose calls can fail; the prompt
    ``OLD`` is cached (two blocks per group) and request ``"r"`` holds ``PROMPT`` (two
    blocks per group)."""
    config = CacheConfig(
        num_layers=2,
        num_heads=1,
        head_dim=4,
        num_blocks=num_blocks,
        block_size=BLOCK,
        layer_specs=[LayerSpec(), LayerSpec(window=2 * BLOCK)],
        enable_prefix_caching=True,
    )
    counter = CallInjector(None, "before", Interrupted)
    built = create_manager("numpy", config)
    storage = FaultyStorage(built.storage)
    manager: Manager = PagedKvCacheManager(storage, tiers=[FaultyTier(HostTier(1 << 20), counter)], config=built.config)
    admit(manager, "old", OLD)
    manager.deallocate("old")
    admit(manager, "r", PROMPT)
    assert manager.stats().cached_blocks == 4
    return manager, counter, storage


def admit(manager: Manager, request_id: str, prompt: tuple[int, ...]) -> Any:
    """Allocate with ``prompt`` and write K/V equal to each position's token id."""
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt))
    start = handle.num_tokens()
    slots = manager.extend(handle, len(prompt) - start)
    rows = np.broadcast_to(np.asarray(prompt[start:], dtype=np.float32)[:, None, None], (slots.shape[-1], 1, 4))
    for layer in range(2):
        manager.write(layer, slots[layer], rows + layer, -rows)
    return handle


def interrupt_next_tier_call(counter: CallInjector) -> None:
    counter.fail_at = len(counter.calls)


def tables_and_counts(state: Snapshot) -> Snapshot:
    """The snapshot without the pool's contents: a copy made into a free block and given
    back leaves bytes there that no request can see."""
    return dataclasses.replace(state, pools=[])


def forked_before_an_interrupt(num_blocks: int) -> tuple[Manager, Handle, Handle, Snapshot]:
    """``hybrid(num_blocks)`` with ``"r"`` forked into ``"f"``: the manager, the parent, the
    child and the snapshot taken then; the tier's next call is interrupted."""
    manager, counter, _ = hybrid(num_blocks)
    parent = manager.get_handle("r")
    assert parent is not None
    child = manager.fork(parent, "f")
    before = snapshot(manager)
    interrupt_next_tier_call(counter)
    return manager, parent, child, before


def test_an_interrupted_demotion_for_the_second_group_gives_back_the_first_groups_blocks() -> None:
    manager, counter, _ = hybrid(num_blocks=9)  # one free block: the window group's must evict
    handle = manager.get_handle("r")
    assert handle is not None
    before = snapshot(manager)
    interrupt_next_tier_call(counter)
    with pytest.raises(Interrupted):
        manager.extend(handle, BLOCK)
    assert counter.fired is not None
    assert_same_state(snapshot(manager), before)
    manager.check_invariants()
    assert manager.extend(handle, BLOCK).shape == (2, BLOCK)  # the tier works again: it evicts now
    manager.check_invariants()


def test_an_interrupted_demotion_after_copies_gives_back_the_copies() -> None:
    # Three free blocks: two copies and the first group's block.
    manager, parent, child, before = forked_before_an_interrupt(num_blocks=11)
    with pytest.raises(Interrupted):
        manager.extend(child, BLOCK)
    assert_same_state(tables_and_counts(snapshot(manager)), tables_and_counts(before))
    manager.check_invariants()
    for layer in range(2):
        for kv_parent, kv_child in zip(manager.gather(parent, layer), manager.gather(child, layer), strict=True):
            assert np.array_equal(kv_parent, kv_child)


def test_an_interrupted_step_leaves_every_request_of_the_batch_as_it_was() -> None:
    # Five free blocks: the fork's copies and blocks, one of "r"'s.
    manager, parent, child, before = forked_before_an_interrupt(num_blocks=13)
    with pytest.raises(Interrupted):
        manager.begin_step([child, parent], BLOCK)
    assert_same_state(tables_and_counts(snapshot(manager)), tables_and_counts(before))
    manager.check_invariants()
    step = manager.begin_step([child, parent], BLOCK)
    assert step.slots.shape == (2, 2 * BLOCK)
    manager.check_invariants()


def test_a_failed_copy_for_a_later_request_of_a_step_gives_back_the_earlier_copies() -> None:
    manager, _, storage = hybrid(num_blocks=16)  # no eviction
    parent = manager.get_handle("r")
    assert parent is not None
    first, second = manager.fork(parent, "f1"), manager.fork(parent, "f2")
    before = snapshot(manager)
    storage.fail_at = len(storage.calls) + 1  # the second request's copy
    with pytest.raises(InjectedFaultError):
        manager.begin_step([first, second], BLOCK)
    assert storage.fired == "copy_blocks"
    assert_same_state(tables_and_counts(snapshot(manager)), tables_and_counts(before))
    manager.check_invariants()
