"""Bad inputs to the cache policies: each raises its own exception class and changes nothing.

The manager cases run on a small populated pool with every policy in play: prefix caching
(cached blocks, hashed blocks shared by a prefix hit), a fork sharing blocks, a swapped-out
request, a deallocated one and a handle of another manager. Around the failing call the
test snapshots everything observable — stats, tables, reference counts, the shared mask,
free extents, the free list and the cache's LRU order, the prefix registrations, swapped
host copies and every layer's pool — and replays the same follow-up operations on the
failed manager and on an untouched twin, comparing what they do.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import (
    MAX_TOKEN_ID,
    AllocationRequest,
    BlockTable,
    CacheConfig,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    PageTable,
    create_manager,
)
from kvcache_core.attention import paged_attention
from kvcache_core.errors import (
    DuplicateRequestError,
    ForeignHandleError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidHandleError,
    KvCacheError,
    NotSwappedOutError,
    OutOfBlocksError,
    SharedBlockWriteError,
    SwappedOutError,
    UnknownRequestError,
)

Array = npt.NDArray[Any]
Manager = PagedKvCacheManager[Array]
Handle = PagedKvCacheHandle[Array]

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 2, 4, 4, 20
CONFIG = CacheConfig(
    num_layers=LAYERS,
    num_heads=HEADS,
    head_dim=DIM,
    num_blocks=BLOCKS,
    block_size=BLOCK,
    enable_prefix_caching=True,
)
PROMPT = tuple(range(10, 20))  # 10 tokens: 2 full blocks, the 3rd partial
OLD_PROMPT = tuple(range(50, 59))  # computed, then deallocated: 2 cached blocks


def untyped(value: object) -> Any:
    """Pass a deliberately ill-typed value past the type checker."""
    return value


def esc(value: object) -> str:
    return re.escape(str(value))


@dataclass
class World:
    manager: Manager
    a: Handle  # prompt PROMPT, computed; its full blocks are hashed and shared with "b"
    b: Handle  # prompt PROMPT: 8 tokens from the cache, 2 computed
    c: Handle  # fork of "a"
    p: Handle  # prompt of 12 tokens, only 6 computed so far
    g: Handle  # no prompt: 3 tokens whose ids were never given
    s: Handle  # swapped out after writing 5 tokens
    s_slots: npt.NDArray[np.int64]
    dead: Handle
    foreign: Handle


def compute(manager: Manager, handle: Handle, count: int, seed: int) -> npt.NDArray[np.int64]:
    rng = np.random.default_rng(seed)
    slots = manager.extend(handle, count)
    for layer in range(LAYERS):
        keys = rng.standard_normal((count, HEADS, DIM)).astype(np.float32)
        manager.write(layer, slots, keys, -keys)
    return slots


def make_world() -> World:
    manager: Manager = create_manager("numpy", CONFIG)
    old = manager.allocate(AllocationRequest("old", initial_tokens=9, prompt_token_ids=OLD_PROMPT))
    compute(manager, old, 9, seed=0)
    manager.deallocate("old")
    a = manager.allocate(AllocationRequest("a", initial_tokens=10, prompt_token_ids=PROMPT))
    compute(manager, a, 10, seed=1)
    b = manager.allocate(AllocationRequest("b", initial_tokens=10, prompt_token_ids=PROMPT))
    compute(manager, b, 2, seed=2)
    c = manager.fork(a, "c")
    p = manager.allocate(AllocationRequest("p", prompt_token_ids=tuple(range(30, 42))))
    compute(manager, p, 6, seed=3)
    g = manager.allocate(AllocationRequest("g"))
    compute(manager, g, 3, seed=4)
    s = manager.allocate(AllocationRequest("s"))
    s_slots = compute(manager, s, 5, seed=5)
    manager.swap_out("s")
    dead = manager.allocate(AllocationRequest("dead", initial_tokens=4))
    manager.deallocate("dead")
    other: Manager = create_manager("numpy", CONFIG)
    foreign = other.allocate(AllocationRequest("a", initial_tokens=4))
    return World(manager, a, b, c, p, g, s, s_slots, dead, foreign)


def fill_pool(world: World) -> None:
    """Take every free and cached block with one more request."""
    allocator = world.manager.allocator
    count = allocator.free_block_count() + allocator.cached_block_count()
    world.manager.allocate(AllocationRequest("filler", initial_tokens=count * BLOCK))
    assert allocator.free_block_count() == allocator.cached_block_count() == 0


@dataclass(frozen=True)
class Snapshot:
    stats: dict[str, object]
    tables: list[tuple[str, dict[str, Any], bool, int, int]]
    ref_counts: list[int]
    shared: list[bool]
    free_extents: list[tuple[int, int]]
    free_list: list[int]
    cached_lru: list[int]
    registrations: list[tuple[int, str | None]]
    host_copies: list[tuple[str, bytes]]
    pools: list[bytes]


def snapshot(manager: Manager) -> Snapshot:
    stats = dataclasses.asdict(manager.stats())
    del stats["allocation_failures"]  # counts refusals
    allocator = manager.allocator
    prefix = manager.prefix_cache
    assert prefix is not None
    handles = manager.list_handles()
    entries = [prefix.entry_of(block) for block in range(BLOCKS)]
    return Snapshot(
        stats=stats,
        tables=[
            (rid, h.block_table().to_dict(), h.is_swapped_out(), h.num_tokens(), h.num_cached_tokens())
            for rid, h in handles
        ],
        ref_counts=[allocator.ref_count(block) for block in range(BLOCKS)],
        shared=[bool(flag) for flag in allocator.shared_mask()],
        free_extents=allocator.free_extents(),
        free_list=allocator.free_blocks(),
        cached_lru=allocator.cached_blocks(),
        registrations=[
            (block, None if entry is None else entry.block_hash.hex()) for block, entry in enumerate(entries)
        ],
        host_copies=[
            (rid, state.swap.keys.tobytes() + state.swap.values.tobytes())
            for rid, h in handles
            if (state := h.request_state).swap is not None
        ],
        pools=[
            np.ascontiguousarray(pool(layer)).tobytes()
            for layer in range(LAYERS)
            for pool in (manager.storage.key_cache, manager.storage.value_cache)
        ],
    )


def probe(world: World) -> list[object]:
    """The same follow-up operations on any world; what each did."""
    manager = world.manager
    outcomes: list[object] = []

    def attempt(operation: Callable[[], object]) -> None:
        try:
            result = operation()
        except KvCacheError as exc:
            outcomes.append(type(exc).__name__)
            return
        if isinstance(result, np.ndarray):
            outcomes.append(result.tolist())
        elif isinstance(result, PagedKvCacheHandle):
            outcomes.append((result.block_table().to_dict(), result.num_cached_tokens()))
        else:
            outcomes.append(result)

    def handle(request_id: str) -> Handle:
        found = manager.get_handle(request_id)
        assert found is not None
        return found

    attempt(lambda: manager.allocate(AllocationRequest("q1", initial_tokens=10, prompt_token_ids=PROMPT)))
    attempt(lambda: manager.allocate(AllocationRequest("q2", prompt_token_ids=OLD_PROMPT)))
    attempt(lambda: manager.extend(handle("c"), 3))
    attempt(lambda: manager.extend(handle("p"), 2, token_ids=[36, 37]))
    attempt(lambda: manager.swap_in("s"))
    attempt(lambda: manager.fork(handle("b"), "q3"))
    attempt(lambda: manager.swap_out("a"))
    attempt(lambda: manager.allocate(AllocationRequest("q4", initial_tokens=6 * BLOCK)))
    attempt(lambda: manager.gc().blocks_freed)
    attempt(lambda: manager.swap_in("a"))
    manager.check_invariants()
    outcomes.append(snapshot(manager).tables)
    return outcomes


@dataclass(frozen=True)
class BadCall:
    id: str
    act: Callable[[World], object]
    error: type[KvCacheError]
    match: str | None = None
    prepare: Callable[[World], None] | None = None


def kv(rows: int) -> Array:
    return np.full((rows, HEADS, DIM), 7, dtype=np.float32)


def shared_slot(world: World) -> npt.NDArray[np.int64]:
    """Slot 0 of "a": in a block "a", "b" and "c" share."""
    return world.a.block_table().slots(0, 1)


MANAGER_CASES: list[BadCall] = [
    # fork
    BadCall("fork-deallocated", lambda w: w.manager.fork(w.dead, "x"), InvalidHandleError, "'dead'"),
    BadCall("fork-swapped-out", lambda w: w.manager.fork(w.s, "x"), SwappedOutError, "'s' is swapped out"),
    BadCall("fork-into-live-id", lambda w: w.manager.fork(w.a, "c"), DuplicateRequestError, "'c'"),
    BadCall("fork-into-swapped-out-id", lambda w: w.manager.fork(w.a, "s"), DuplicateRequestError, "'s'"),
    BadCall("fork-into-itself", lambda w: w.manager.fork(w.a, "a"), DuplicateRequestError, "'a'"),
    BadCall("fork-empty-id", lambda w: w.manager.fork(w.a, ""), InvalidArgumentError, "non-empty str, got ''"),
    BadCall("fork-id-not-a-str", lambda w: w.manager.fork(w.a, untyped(7)), InvalidArgumentError, "got 7"),
    BadCall("fork-foreign-handle", lambda w: w.manager.fork(w.foreign, "x"), ForeignHandleError, "another manager"),
    BadCall("fork-not-a-handle", lambda w: w.manager.fork(untyped("a"), "x"), ForeignHandleError, "str"),
    # swap
    BadCall("swap-in-resident", lambda w: w.manager.swap_in("a"), NotSwappedOutError, "'a' is resident"),
    BadCall("swap-in-unknown", lambda w: w.manager.swap_in("nope"), UnknownRequestError, "'nope'"),
    BadCall("swap-in-deallocated", lambda w: w.manager.swap_in("dead"), UnknownRequestError, "'dead'"),
    BadCall("swap-in-not-a-str", lambda w: w.manager.swap_in(untyped(3)), UnknownRequestError, "3"),
    BadCall("swap-out-swapped-out", lambda w: w.manager.swap_out("s"), SwappedOutError, "'s' is already swapped out"),
    BadCall("swap-out-unknown", lambda w: w.manager.swap_out("nope"), UnknownRequestError, "'nope'"),
    BadCall("swap-out-not-a-str", lambda w: w.manager.swap_out(untyped(w.a)), UnknownRequestError),
    BadCall(
        "swap-in-no-room",
        lambda w: w.manager.swap_in("s"),
        OutOfBlocksError,
        "cannot swap in request 's': it needs 2 blocks, 0 of 20 are free",
        prepare=fill_pool,
    ),
    # data access of a swapped-out request
    BadCall(
        "write-stale-slots-of-swapped-out",
        lambda w: w.manager.write(0, w.s_slots, kv(5), kv(5)),
        SwappedOutError,
        "request 's' gave up when it was swapped out",
    ),
    BadCall("gather-swapped-out", lambda w: w.manager.gather(w.s, 0), SwappedOutError, "'s' is swapped out"),
    BadCall("key-cache-swapped-out", lambda w: w.s.key_cache(1), SwappedOutError, "swap_in"),
    BadCall("extend-swapped-out", lambda w: w.manager.extend(w.s, 1), SwappedOutError, "'s'"),
    BadCall("page-table-swapped-out", lambda w: w.manager.page_table([w.a, w.s]), SwappedOutError, "'s'"),
    BadCall("writable-slots-swapped-out", lambda w: w.manager.writable_slots(w.s, 0, 1), SwappedOutError, "'s'"),
    # shared blocks
    BadCall(
        "write-into-shared-block",
        lambda w: w.manager.write(1, shared_slot(w), kv(1), kv(1)),
        SharedBlockWriteError,
        r"shared by 3 requests \['a', 'b', 'c'\]",
    ),
    BadCall(
        "extend-copy-on-write-no-room",
        lambda w: w.manager.extend(w.c, 1),
        OutOfBlocksError,
        r"1 more blocks needed \(1 to copy shared blocks\)",
        prepare=fill_pool,
    ),
    BadCall(
        "writable-slots-copy-no-room",
        lambda w: w.manager.writable_slots(w.c, 0, 9),
        OutOfBlocksError,
        "cannot copy 3 shared blocks of request 'c'",
        prepare=fill_pool,
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
    ),
    BadCall(
        "token-ids-after-unknown-ones",
        lambda w: w.manager.extend(w.g, 1, token_ids=[5]),
        InvalidArgumentError,
        "ids of positions 0 to 2 were never given",
    ),
    # allocate with a prompt
    BadCall(
        "allocate-prompt-no-room-beyond-the-hits",
        lambda w: w.manager.allocate(AllocationRequest("x", initial_tokens=10, prompt_token_ids=PROMPT)),
        OutOfBlocksError,
        "need 1 blocks beyond 2 cached ones",
        prepare=fill_pool,
    ),
    BadCall(
        "attention-page-table-without-the-window",
        lambda w: w.manager.paged_attention(
            0,
            np.ones((1, HEADS, DIM), np.float32),
            dataclasses.replace(w.manager.page_table([w.a]), sliding_window=3),
        ),
        InvalidArgumentError,
        "page table sliding_window 3 != the pool's sliding_window None",
    ),
]


@pytest.mark.parametrize("case", MANAGER_CASES, ids=[case.id for case in MANAGER_CASES])
def test_bad_policy_call_raises_its_error_and_changes_nothing(case: BadCall) -> None:
    world, twin = make_world(), make_world()
    if case.prepare is not None:
        case.prepare(world)
        case.prepare(twin)
    before = snapshot(world.manager)

    with pytest.raises(case.error, match=case.match) as caught:
        case.act(world)

    assert type(caught.value) is case.error, f"raised {type(caught.value).__name__}"
    world.manager.check_invariants()
    assert snapshot(world.manager) == before
    assert world.s.is_valid()
    assert world.s.is_swapped_out()
    assert not world.dead.is_valid()
    # Hidden state too: the failed manager behaves exactly like an untouched twin.
    assert probe(world) == probe(twin)
    assert snapshot(world.manager) == snapshot(twin.manager)


def test_the_catalogue_is_large_and_every_id_is_unique() -> None:
    ids = [case.id for case in MANAGER_CASES]
    assert len(ids) >= 30
    assert len(set(ids)) == len(ids)


# -- value types ---------------------------------------------------------------------------


BAD_REQUESTS: list[tuple[str, dict[str, object], str]] = [
    ("salt-int", {"cache_salt": 5}, "cache_salt must be a str, bytes or None, got int 5"),
    ("salt-list", {"cache_salt": ["a"]}, esc("got list ['a']")),
    ("salt-bytearray", {"cache_salt": bytearray(b"a")}, "got bytearray"),
    ("salt-unencodable", {"cache_salt": "\ud800"}, "cannot be encoded as UTF-8"),
    ("prompt-token-too-big", {"prompt_token_ids": (1, 2**63)}, esc(f"prompt_token_ids[1] = {2**63}")),
    ("prompt-bool-token", {"prompt_token_ids": (1, True)}, esc("prompt_token_ids[1] = True")),
    ("prompt-nested", {"prompt_token_ids": ((1, 2),)}, esc("prompt_token_ids[0] = (1, 2)")),
    ("prompt-float-array", {"prompt_token_ids": np.array([1.0, 2.0])}, "1-D integer array, got dtype float64"),
    ("prompt-2d-array", {"prompt_token_ids": np.zeros((2, 2), np.int64)}, esc("shape (2, 2)")),
    ("prompt-bytes", {"prompt_token_ids": b"\x01\x02"}, "prompt_token_ids must be a sequence"),
    (
        "prompt-longer-than-max-sequence-length",
        {"prompt_token_ids": (1, 2, 3), "max_sequence_length": 2},
        "holds 3 tokens, more than max_sequence_length=2",
    ),
]


@pytest.mark.parametrize(
    ("fields", "match"), [pytest.param(fields, match, id=case_id) for case_id, fields, match in BAD_REQUESTS]
)
def test_bad_allocation_request_field_raises_invalid_argument_error(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        AllocationRequest(**untyped({"request_id": "r", **fields}))
    assert type(caught.value) is InvalidArgumentError


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_bad_sliding_window_raises_invalid_config_error(window: object) -> None:
    with pytest.raises(InvalidConfigError, match=f"sliding_window must be an int >= 1, got {esc(repr(window))}"):
        dataclasses.replace(CONFIG, sliding_window=untyped(window))


@pytest.mark.parametrize("window", [0, True, 1.5])
def test_bad_page_table_window_raises(window: object) -> None:
    table = PageTable.from_block_tables([BlockTable(4, [1], 3)])
    with pytest.raises(InvalidArgumentError, match=f"sliding_window must be None or an int >= 1, got {window!r}"):
        dataclasses.replace(table, sliding_window=untyped(window))
    pool = np.zeros((4, 4, 1, 2), np.float32)
    with pytest.raises(InvalidArgumentError, match=f"got {window!r}"):
        paged_attention(np.zeros((1, 1, 2), np.float32), pool, pool, table, sliding_window=untyped(window))


TABLE_CASES: list[tuple[str, Callable[[BlockTable], object], str]] = [
    ("release-more-than-held", lambda t: t.release_leading(4), esc("[0, 3] (the held blocks), got 4")),
    ("release-negative", lambda t: t.release_leading(-1), "got -1"),
    ("release-past-the-sequence", lambda t: t.release_leading(3), "at or after the sequence length 10"),
    (
        "replace-released-block",
        lambda t: t.replace_block(0, 40),
        "logical block 0 is not held: valid held blocks are 1",
    ),
    ("replace-past-the-table", lambda t: t.replace_block(4, 40), "logical block 4 is not held"),
    ("replace-with-a-block-in-the-table", lambda t: t.replace_block(1, 9), "block 9 is already in this table"),
    ("replace-with-a-negative-block", lambda t: t.replace_block(1, -2), "-2"),
]


@pytest.mark.parametrize(("act", "match"), [pytest.param(act, match, id=cid) for cid, act, match in TABLE_CASES])
def test_bad_block_table_policy_call_raises_and_changes_nothing(
    act: Callable[[BlockTable], object], match: str
) -> None:
    table = BlockTable(4, [8, 9, 10, 11], 10)
    table.release_leading(1)
    before = table.to_dict()
    with pytest.raises(InvalidArgumentError, match=match):
        act(table)
    assert table.to_dict() == before
