"""Prefix caching: hash-chained full blocks, shared by requests whose prompts share them."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.paging.prefix import PrefixCache, hash_block
from kvcache_core.testing import inspect
from tests.core.support import DIM, HEADS, LAYERS, Manager, admit, assert_holds, compute, make_manager, token_kv


def full_blocks_in_common(prompt: Sequence[int], others: Sequence[Sequence[int]], block_size: int) -> int:
    """The most leading full blocks of ``prompt`` that some earlier prompt also starts with,
    capped so that the last prompt token is left to compute."""
    cap = (len(prompt) - 1) // block_size
    best = 0
    for other in others:
        blocks = 0
        while (
            blocks < cap
            and (blocks + 1) * block_size <= len(other)
            and tuple(prompt[blocks * block_size : (blocks + 1) * block_size])
            == tuple(other[blocks * block_size : (blocks + 1) * block_size])
        ):
            blocks += 1
        best = max(best, blocks)
    return best


def test_sixty_four_requests_sharing_a_1000_token_prompt_hit_every_shared_block() -> None:
    block_size, shared_length = 16, 1000
    rng = np.random.default_rng(64)
    shared = [int(t) for t in rng.integers(0, 32_000, shared_length)]
    prompts = [
        [*shared, 40_000 + index, *(int(t) for t in rng.integers(0, 32_000, int(rng.integers(4, 60))))]
        for index in range(64)
    ]
    needed = sum(-(-len(p) // block_size) for p in prompts)
    manager = make_manager(num_blocks=needed, block_size=block_size)
    handles = [admit(manager, f"r{index}", prompt) for index, prompt in enumerate(prompts)]

    expected_hits = sum(full_blocks_in_common(p, prompts[:index], block_size) for index, p in enumerate(prompts))
    shared_blocks = shared_length // block_size  # 62: the 63rd mixes shared and distinct tokens
    assert expected_hits == 63 * shared_blocks  # every request after the first hits all of them
    stats = manager.stats()
    assert stats.prefix_cache_hits == expected_hits
    assert stats.prefix_cache_queries == sum((len(p) - 1) // block_size for p in prompts)
    assert stats.cache_hit_rate == pytest.approx(expected_hits / stats.prefix_cache_queries)
    assert [h.num_cached_tokens() for h in handles] == [0] + [shared_blocks * block_size] * 63
    # The pool holds the shared blocks once: each request adds only its own blocks.
    own_blocks = sum(-(-len(p) // block_size) - shared_blocks for p in prompts)
    assert stats.used_blocks == shared_blocks + own_blocks
    first_blocks = {h.block_table().physical_blocks[:shared_blocks] for h in handles}
    assert len(first_blocks) == 1
    assert all(inspect.allocator(manager).ref_count(block) == 64 for block in next(iter(first_blocks)))
    manager.check_invariants()
    for handle, prompt in zip(handles[::9], prompts[::9], strict=True):
        assert_holds(manager, handle, prompt)


def test_allocate_starts_the_sequence_at_the_cached_tokens() -> None:
    manager = make_manager()
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks of 4
    admit(manager, "a", prompt)
    handle = manager.allocate(AllocationRequest("b", initial_tokens=13, prompt_token_ids=tuple(prompt)))

    assert handle.num_cached_tokens() == 12
    assert handle.num_tokens() == 12
    assert handle.block_table().num_blocks() == 4  # 3 shared + 1 reserved for the rest
    compute(manager, handle, prompt, 1)  # the slot handed out is the reserved block's first
    assert handle.num_tokens() == 13
    assert handle.block_table().num_blocks() == 4
    assert_holds(manager, handle, prompt)


def test_the_last_prompt_token_is_always_computed() -> None:
    manager = make_manager()
    prompt = list(range(8))  # exactly two full blocks
    admit(manager, "a", prompt)
    handle = manager.allocate(AllocationRequest("b", initial_tokens=8, prompt_token_ids=tuple(prompt)))
    assert handle.num_cached_tokens() == 4  # not 8: the logits need the last token computed
    assert manager.stats().prefix_cache_queries == 1 + 1


def test_a_block_becomes_cacheable_only_when_written_in_every_layer() -> None:
    manager = make_manager()
    prompt = list(range(9))
    writer = manager.allocate(AllocationRequest("w", initial_tokens=9, prompt_token_ids=tuple(prompt)))
    slots = manager.extend(writer, 9)
    keys = np.ones((9, HEADS, DIM), np.float32)
    manager.write(0, slots, keys, keys)
    assert manager.allocate(AllocationRequest("early", prompt_token_ids=tuple(prompt))).num_cached_tokens() == 0
    manager.write(1, slots[:6], keys[:6], keys[:6])  # block 1 is missing two slots in layer 1
    assert manager.allocate(AllocationRequest("half", prompt_token_ids=tuple(prompt))).num_cached_tokens() == 4
    manager.write(1, slots[6:], keys[6:], keys[6:])
    assert manager.allocate(AllocationRequest("late", prompt_token_ids=tuple(prompt))).num_cached_tokens() == 8
    manager.check_invariants()


def test_freed_blocks_keep_their_prefix_until_evicted() -> None:
    manager = make_manager(num_blocks=16)
    prompt = list(range(100, 113))
    admit(manager, "a", prompt)
    manager.deallocate("a")
    stats = manager.stats()
    assert (stats.used_blocks, stats.cached_blocks, stats.free_blocks) == (0, 3, 13)  # the partial block is free

    handle = admit(manager, "b", prompt)
    assert handle.num_cached_tokens() == 12
    assert manager.stats().cached_blocks == 0  # revived
    assert_holds(manager, handle, prompt)
    manager.check_invariants()


def test_the_same_prompt_under_another_salt_is_a_miss() -> None:
    manager = make_manager()
    prompt = list(range(13))
    admit(manager, "a", prompt, cache_salt="tenant-1")

    def cached(request_id: str, salt: str | bytes | None) -> int:
        return manager.allocate(
            AllocationRequest(request_id, prompt_token_ids=tuple(prompt), cache_salt=salt)
        ).num_cached_tokens()

    assert cached("other-tenant", "tenant-2") == 0
    assert cached("no-salt", None) == 0
    assert cached("empty-salt", b"") == 0
    assert cached("same-tenant", "tenant-1") == 12
    assert cached("same-tenant-bytes", b"tenant-1") == 12  # a str salt is hashed as UTF-8


def test_generated_tokens_are_cached_when_their_ids_are_given() -> None:
    manager = make_manager()
    sequence = list(range(50, 70))
    handle = admit(manager, "a", sequence[:6])
    for position in range(6, 20):  # decode: one token at a time, with its id
        slots = manager.extend(handle, 1, token_ids=[sequence[position]])
        for layer in range(LAYERS):
            keys, values = token_kv(sequence, position, layer)
            manager.write(layer, slots, keys[None], values[None])
    follower = manager.allocate(AllocationRequest("b", prompt_token_ids=tuple(sequence)))
    assert follower.num_cached_tokens() == 16
    assert_holds(manager, follower, sequence)


def test_generated_tokens_without_ids_are_never_cached() -> None:
    manager = make_manager()
    sequence = list(range(50, 70))
    handle = admit(manager, "a", sequence[:6])
    compute(manager, handle, sequence, 14)  # no token_ids: their blocks cannot be hashed
    follower = manager.allocate(AllocationRequest("b", prompt_token_ids=tuple(sequence)))
    assert follower.num_cached_tokens() == 4  # only the prompt's full block


def test_hash_is_sha256_over_a_fixed_encoding_and_the_same_in_every_process() -> None:
    digest = hash_block(None, [1, 2, 3, 4], b"salt")
    assert len(digest) == 32
    assert hash_block(digest, [5, 6, 7, 8], None) != hash_block(None, [5, 6, 7, 8], None)
    assert hash_block(None, [1, 2, 3, 4], None) != hash_block(None, [1, 2, 3, 4], b"")
    script = "from kvcache_core.paging.prefix import hash_block; print(hash_block(None, [1, 2, 3, 4], b'salt').hex())"
    for seed in ("1", "2"):
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert result.stdout.strip() == digest.hex()


def test_a_forced_hash_collision_is_a_miss_and_never_maps_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    def constant_hash(parent: bytes | None, token_ids: Sequence[int], salt: bytes | None) -> bytes:
        return b"\x00" * 32

    monkeypatch.setattr("kvcache_core.paging.prefix.hash_block", constant_hash)
    manager = make_manager()
    first = list(range(9))
    other = list(range(100, 109))
    admit(manager, "a", first)  # block 0 takes the only hash; block 1 collides with it

    intruder = admit(manager, "b", other)
    assert intruder.num_cached_tokens() == 0
    assert_holds(manager, intruder, other)
    again = admit(manager, "c", first)
    assert again.num_cached_tokens() == 4  # block 0 matches; block 1 was never cached
    assert_holds(manager, again, first)
    assert manager.stats().hash_collisions >= 2
    manager.check_invariants()


def test_an_entry_matches_only_its_own_parent_tokens_and_salt(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hash that ignores the parent makes every chain collide at every step.
    def parentless_hash(parent: bytes | None, token_ids: Sequence[int], salt: bytes | None) -> bytes:
        return hashlib.sha256(bytes(token_ids)).digest()

    monkeypatch.setattr("kvcache_core.paging.prefix.hash_block", parentless_hash)
    cache = PrefixCache()
    root_a, _ = cache.find_or_create(None, (1, 2), None)
    root_b, _ = cache.find_or_create(None, (3, 4), None)
    assert root_a is not None
    assert root_b is not None
    cache.register(0, root_a)
    cache.register(1, root_b)
    child, _ = cache.find_or_create(root_a, (5, 6), None)
    assert child is not None
    cache.register(2, child)

    assert cache.find(root_a, (5, 6), None) == (child, False)
    assert cache.find(root_b, (5, 6), None) == (None, True)  # same hash, other parent
    assert cache.find(None, (1, 2), b"x") == (None, True)  # same hash, other salt
    assert cache.find_or_create(root_b, (5, 6), None) == (None, True)
    cache.unregister(0)
    assert not root_a.alive
    assert cache.find(root_a, (5, 6), None) == (None, False)  # its parent is gone


def test_cache_hit_rate_counts_full_prompt_blocks_looked_up() -> None:
    manager = make_manager()
    prompt = list(range(17))  # 4 full blocks may be cached
    admit(manager, "a", prompt)  # 4 queries, 0 hits
    admit(manager, "b", prompt[:10])  # 2 queries, 2 hits
    admit(manager, "c", [99, *prompt[1:]])  # 4 queries, 0 hits
    stats = manager.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10, 2)
    assert stats.cache_hit_rate == pytest.approx(0.2)


def test_can_allocate_counts_prefix_hits_and_evictable_blocks() -> None:
    manager = make_manager(num_blocks=6)
    prompt = list(range(16))
    admit(manager, "a", prompt)  # 4 blocks, 3 of them cacheable
    request = AllocationRequest("b", initial_tokens=16, prompt_token_ids=tuple(prompt))
    assert manager.can_allocate(request)  # 3 hits + 1 new block; 2 are free
    manager.allocate(AllocationRequest("filler", initial_tokens=8))
    assert not manager.can_allocate(request)  # no free block left for the 4th
    manager.deallocate("a")  # 3 blocks cached, 1 free
    assert manager.can_allocate(request)
    handle = manager.allocate(request)
    assert handle.num_cached_tokens() == 12
    manager.check_invariants()


def test_without_prefix_caching_the_prompt_maps_nothing() -> None:
    config = CacheConfig(num_layers=LAYERS, num_heads=HEADS, head_dim=DIM, num_blocks=16, block_size=4)
    manager: Manager = create_manager("numpy", config)
    prompt = list(range(13))
    first = manager.allocate(AllocationRequest("a", initial_tokens=13, prompt_token_ids=tuple(prompt)))
    compute(manager, first, prompt, 13)
    manager.deallocate("a")
    second = manager.allocate(AllocationRequest("b", initial_tokens=13, prompt_token_ids=tuple(prompt)))
    assert second.num_tokens() == second.num_cached_tokens() == 0
    stats = manager.stats()
    assert (stats.cached_blocks, stats.prefix_cache_queries, stats.cache_hit_rate) == (0, 0, 0.0)


def test_token_ids_may_be_given_as_a_numpy_array() -> None:
    request = AllocationRequest("a", prompt_token_ids=np.arange(5, dtype=np.int32))
    assert request.prompt_token_ids is not None
    assert request.prompt_token_ids == (0, 1, 2, 3, 4)
    assert all(type(token) is int for token in request.prompt_token_ids)


def test_a_prefix_computed_twice_is_cached_twice_and_hits_prefer_blocks_in_use() -> None:
    manager = make_manager(num_blocks=16)
    prompt = list(range(13))
    first = manager.allocate(AllocationRequest("a", initial_tokens=13, prompt_token_ids=tuple(prompt)))
    second = manager.allocate(AllocationRequest("b", initial_tokens=13, prompt_token_ids=tuple(prompt)))
    compute(manager, first, prompt, 13)  # both computed before either was cached
    compute(manager, second, prompt, 13)
    prefix = inspect.prefix_cache(manager)
    assert prefix is not None
    assert len(prefix) == 6  # three hashes, two blocks each
    manager.deallocate("a")
    used, cached = manager.stats().used_blocks, manager.stats().cached_blocks
    assert cached == 3

    third = manager.allocate(AllocationRequest("c", prompt_token_ids=tuple(prompt)))

    assert third.num_cached_tokens() == 12
    assert third.block_table().physical_blocks[:3] == second.block_table().physical_blocks[:3]
    assert (manager.stats().used_blocks, manager.stats().cached_blocks) == (used, cached)  # nothing revived
    manager.check_invariants()
