"""The bad-input catalogue of the cache policies: fork, swapping, shared blocks, rewrites
and token ids, each case run on a :class:`~kvcache_core.testing.world.PolicyWorld` of the
backend under test where it claims the capabilities the case ``requires``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvcache_core.contract.config import MAX_TOKEN_ID, AllocationRequest
from kvcache_core.contract.protocols import SlotArray
from kvcache_core.errors import (
    DuplicateRequestError,
    ForeignHandleError,
    InvalidArgumentError,
    InvalidHandleError,
    NotSwappedOutError,
    OutOfBlocksError,
    SharedBlockWriteError,
    SwappedOutError,
    UnknownRequestError,
)
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.catalogue import BadCall
from kvcache_core.testing.kv_data import sevens
from kvcache_core.testing.world import PROMPT, PolicyWorld, esc, fill_pool, untyped

__all__ = ["POLICY_CASES"]

# A world with prefix caching evicts its cached blocks when it is filled (see world_policies).
PREFIX = ("prefix_caching", "eviction")


def kv(world: PolicyWorld, rows: int) -> Any:
    """Native K or V ``[rows, 2, 4]`` full of 7s."""
    return sevens(world.manager, (rows, 2, 4))


def shared_slot(world: PolicyWorld) -> SlotArray:
    """Slot 0 of "a": in a block "a", "b" (the prefix hit) and "c" (the fork) share."""
    return world.a.block_table().slots(0, 1)


POLICY_CASES: list[BadCall[PolicyWorld]] = [
    # fork
    BadCall(
        "fork-deallocated", lambda w: w.manager.fork(w.dead, "x"), InvalidHandleError, "'dead'", requires=("fork",)
    ),
    BadCall(
        "fork-swapped-out",
        lambda w: w.manager.fork(w.s, "x"),
        SwappedOutError,
        "'s' is swapped out",
        requires=("fork", "swap"),
    ),
    BadCall("fork-into-live-id", lambda w: w.manager.fork(w.a, "c"), DuplicateRequestError, "'c'", requires=("fork",)),
    BadCall(
        "fork-into-swapped-out-id",
        lambda w: w.manager.fork(w.a, "s"),
        DuplicateRequestError,
        "'s'",
        requires=("fork", "swap"),
    ),
    BadCall("fork-into-itself", lambda w: w.manager.fork(w.a, "a"), DuplicateRequestError, "'a'", requires=("fork",)),
    BadCall(
        "fork-empty-id",
        lambda w: w.manager.fork(w.a, ""),
        InvalidArgumentError,
        "non-empty str, got ''",
        requires=("fork",),
    ),
    BadCall(
        "fork-id-not-a-str",
        lambda w: w.manager.fork(w.a, untyped(7)),
        InvalidArgumentError,
        "got 7",
        requires=("fork",),
    ),
    BadCall(
        "fork-foreign-handle",
        lambda w: w.manager.fork(w.foreign, "x"),
        ForeignHandleError,
        "another manager",
        requires=("fork",),
    ),
    BadCall(
        "fork-not-a-handle",
        lambda w: w.manager.fork(untyped("a"), "x"),
        ForeignHandleError,
        "str",
        requires=("fork",),
    ),
    # swap
    BadCall(
        "swap-in-resident",
        lambda w: w.manager.swap_in("a"),
        NotSwappedOutError,
        "'a' is resident",
        requires=("swap",),
    ),
    BadCall("swap-in-unknown", lambda w: w.manager.swap_in("nope"), UnknownRequestError, "'nope'", requires=("swap",)),
    BadCall(
        "swap-in-deallocated", lambda w: w.manager.swap_in("dead"), UnknownRequestError, "'dead'", requires=("swap",)
    ),
    BadCall("swap-in-not-a-str", lambda w: w.manager.swap_in(untyped(3)), UnknownRequestError, "3", requires=("swap",)),
    BadCall(
        "swap-out-swapped-out",
        lambda w: w.manager.swap_out("s"),
        SwappedOutError,
        "'s' is already swapped out",
        requires=("swap",),
    ),
    BadCall(
        "swap-out-unknown", lambda w: w.manager.swap_out("nope"), UnknownRequestError, "'nope'", requires=("swap",)
    ),
    BadCall("swap-out-not-a-str", lambda w: w.manager.swap_out(untyped(w.a)), UnknownRequestError, requires=("swap",)),
    BadCall(
        "swap-in-no-room",
        lambda w: w.manager.swap_in("s"),
        OutOfBlocksError,
        "cannot swap in request 's': it needs 2 blocks, 0 of 20 are free",
        prepare=fill_pool,
        requires=("swap",),
    ),
    # data access of a swapped-out request
    BadCall(
        "write-stale-slots-of-swapped-out",
        lambda w: w.manager.write(0, w.s_slots, kv(w, 5), kv(w, 5)),
        SwappedOutError,
        "request 's' gave up when it was swapped out",
        requires=("swap",),
    ),
    BadCall(
        "gather-swapped-out",
        lambda w: w.manager.gather(w.s, 0),
        SwappedOutError,
        "'s' is swapped out",
        requires=("swap",),
    ),
    BadCall("key-cache-swapped-out", lambda w: w.s.key_cache(1), SwappedOutError, "swap_in", requires=("swap",)),
    BadCall("extend-swapped-out", lambda w: w.manager.extend(w.s, 1), SwappedOutError, "'s'", requires=("swap",)),
    BadCall(
        "page-table-swapped-out",
        lambda w: w.manager.page_table([w.a, w.s]),
        SwappedOutError,
        "'s'",
        requires=("swap",),
    ),
    BadCall(
        "writable-slots-swapped-out",
        lambda w: w.manager.writable_slots(w.s, 0, 1),
        SwappedOutError,
        "'s'",
        requires=("swap",),
    ),
    # shared blocks
    BadCall(
        "write-into-shared-block",
        lambda w: w.manager.write(1, shared_slot(w), kv(w, 1), kv(w, 1)),
        SharedBlockWriteError,
        r"shared by 3 requests \['a', 'b', 'c'\]",
        requires=("fork", *PREFIX),
    ),
    BadCall(
        "extend-copy-on-write-no-room",
        lambda w: w.manager.extend(w.fork, 1),
        OutOfBlocksError,
        r"1 more blocks needed \(1 to copy shared blocks\)",
        prepare=fill_pool,
        requires=("fork",),
    ),
    BadCall(
        "writable-slots-copy-no-room",
        lambda w: w.manager.writable_slots(w.fork, 0, 9),
        OutOfBlocksError,
        "cannot copy 3 shared blocks of request 'c'",
        prepare=fill_pool,
        requires=("fork",),
    ),
    # writable_slots ranges
    BadCall(
        "writable-slots-past-length",
        lambda w: w.manager.writable_slots(w.a, 8, 11),
        InvalidArgumentError,
        esc("[8, 11) are outside the held positions [0, 10)"),
    ),
    BadCall("writable-slots-reversed", lambda w: w.manager.writable_slots(w.a, 5, 4), InvalidArgumentError, "5"),
    BadCall("writable-slots-negative", lambda w: w.manager.writable_slots(w.a, -1, 2), InvalidArgumentError, "-1"),
    BadCall(
        "writable-slots-float", lambda w: w.manager.writable_slots(w.a, untyped(0.0), 2), InvalidArgumentError, "0.0"
    ),
    # extend with token ids
    BadCall(
        "token-ids-wrong-length",
        lambda w: w.manager.extend(w.p, 3, token_ids=[36, 37]),
        InvalidArgumentError,
        "holds 2 ids for additional_tokens=3",
    ),
    BadCall(
        "token-ids-negative",
        lambda w: w.manager.extend(w.g, 2, token_ids=[1, -1]),
        InvalidArgumentError,
        esc("token_ids[1] = -1"),
    ),
    BadCall(
        "token-ids-past-int64",
        lambda w: w.manager.extend(w.g, 1, token_ids=[MAX_TOKEN_ID + 1]),
        InvalidArgumentError,
        esc(f"[0, {MAX_TOKEN_ID}]"),
    ),
    BadCall(
        "token-ids-float",
        lambda w: w.manager.extend(w.g, 1, token_ids=untyped([1.0])),
        InvalidArgumentError,
        esc("token_ids[0] = 1.0"),
    ),
    BadCall(
        "token-ids-bool",
        lambda w: w.manager.extend(w.g, 1, token_ids=untyped([True])),
        InvalidArgumentError,
        esc("token_ids[0] = True"),
    ),
    BadCall("token-ids-str", lambda w: w.manager.extend(w.g, 2, token_ids=untyped("ab")), InvalidArgumentError, "'ab'"),
    BadCall(
        "token-ids-disagree-with-the-prompt",
        lambda w: w.manager.extend(w.p, 2, token_ids=[36, 99]),
        InvalidArgumentError,
        "token_ids.1. = 99 disagrees with the known token 37 at position 7",
        requires=PREFIX,  # the ids a request was given are kept for prefix caching
    ),
    BadCall(
        "token-ids-after-unknown-ones",
        lambda w: w.manager.extend(w.g, 1, token_ids=[5]),
        InvalidArgumentError,
        "ids of positions 0 to 2 were never given",
        requires=PREFIX,  # the ids a request was given are kept for prefix caching
    ),
    # allocate with a prompt
    BadCall(
        "allocate-prompt-no-room-beyond-the-hits",
        lambda w: w.manager.allocate(AllocationRequest("x", initial_tokens=10, prompt_token_ids=PROMPT)),
        OutOfBlocksError,
        "need 1 blocks beyond 2 cached ones",
        prepare=fill_pool,
        requires=PREFIX,
    ),
    # a page table of a windowed pool on one without a window
    BadCall(
        "attention-page-table-without-the-window",
        lambda w: w.manager.paged_attention(
            0,
            BackendUnderTest.native(w.manager, np.ones((1, 2, 4))),
            dataclasses.replace(w.manager.page_table([w.a]), sliding_window=3),
        ),
        InvalidArgumentError,
        "page table sliding_window 3 != the pool's sliding_window None",
    ),
]
