"""A tier that looks ahead (``prefetch(keys, salt)``) is told a prompt's blocks once, before it
is asked about them; one whose look-up fails is a counted miss."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest

from kvcache_core.offload.prefix_file import record_key
from kvcache_core.offload.tiers import HostTier
from kvcache_core.paging.prefix import hash_block, namespace_root
from tests.core.support import BLOCK, admit, admit_and_release, prompt_of, tiered

pytest.importorskip("safetensors")


class LookingAhead(HostTier):
    """A host tier that records every look-ahead it is given (or fails it)."""

    def __init__(self, max_bytes: int, *, fail: bool = False) -> None:
        super().__init__(max_bytes)
        self.looked: list[tuple[list[bytes], bytes | None]] = []
        self.fail = fail

    def prefetch(self, keys: Sequence[bytes], salt: bytes | None) -> None:
        self.looked.append((list(keys), salt))
        if self.fail:
            raise ConnectionError("the store is down")


def test_a_prompt_is_told_once_in_order_with_its_salt() -> None:
    tier = LookingAhead(1 << 20)
    manager = tiered(16, tier)
    prompt = prompt_of(1, 3)
    admit(manager, "a", prompt, cache_salt="tenant")
    manager.deallocate("a")
    manager.gc()
    tier.looked.clear()
    assert admit(manager, "b", prompt, cache_salt="tenant").num_cached_tokens() == 3 * BLOCK
    parent = namespace_root(manager.config.model_id)
    expected: list[bytes] = []
    for index in range(3):
        parent = hash_block(parent, prompt[index * BLOCK : (index + 1) * BLOCK], b"tenant")
        expected.append(record_key(parent, 0))
    assert tier.looked == [(expected, b"tenant")]


def test_a_failing_look_ahead_is_a_counted_miss_and_the_request_is_served() -> None:
    tier = LookingAhead(1 << 20, fail=True)
    manager = tiered(16, tier)
    prompt = prompt_of(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        admit_and_release(manager, [prompt])
    manager.gc()
    errors = manager.tier_stats()[0].errors
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = admit(manager, "b", prompt)
    assert any("look blocks up" in str(warning.message) for warning in caught)
    assert manager.tier_stats()[0].errors == errors + 1
    assert handle.num_cached_tokens() == 3 * BLOCK, "a tier that says what it holds still serves it"
    manager.check_invariants()
