"""One prefix-hit plan for pool and tiers: a prompt whose first blocks are in the pool and
whose next are in a tier is served by one plan, carried out with one transfer."""

from __future__ import annotations

import pytest

pytest.importorskip("safetensors")

from kvcache_core import AllocationRequest
from kvcache_core.offload.tiers import HostTier
from tests.core.support import BLOCK, BLOCK_BYTES, Manager, admit, assert_holds, counting, prompt_of, tiered


def _pool_then_tier(num_blocks: int) -> tuple[Manager, list[int]]:
    """A manager whose pool caches a 4-block prompt's first 2 blocks and whose host tier
    holds its last 2; and the prompt."""
    manager = tiered(num_blocks, HostTier(64 * BLOCK_BYTES))
    prompt = prompt_of(1, 4)
    admit(manager, "a", prompt)
    manager.deallocate("a")
    manager.gc()  # all four blocks leave the pool for the tier
    admit(manager, "head", prompt[: 2 * BLOCK + 1])  # the first two come back to the pool
    manager.deallocate("head")
    assert manager.tier_stats()[0].blocks == 2
    return manager, prompt


def test_a_prompt_hit_in_the_pool_and_a_tier_is_opened_with_one_transfer_of_the_tier_blocks() -> None:
    manager, prompt = _pool_then_tier(12)
    calls = counting(manager)
    handle = manager.allocate(AllocationRequest("b", initial_tokens=len(prompt), prompt_token_ids=tuple(prompt)))
    assert calls == ["from_host 2"]
    assert handle.num_cached_tokens() == 4 * BLOCK
    assert_holds(manager, handle, prompt)
    manager.check_invariants()


def test_the_hits_of_pool_and_tier_are_counted_once_each() -> None:
    manager, prompt = _pool_then_tier(12)
    before = manager.stats()
    tier_hits = manager.tier_stats()[0].hits
    admit(manager, "b", prompt)
    after = manager.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4
    assert after.prefix_cache_hits - before.prefix_cache_hits == 4  # two from the pool, two from the tier
    assert manager.tier_stats()[0].hits - tier_hits == 2
    assert manager.tier_stats()[0].blocks == 0  # the promoted records left the tier
