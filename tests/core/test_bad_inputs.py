"""A catalogue of bad inputs: each raises its own exception class and changes nothing.

Every manager case runs on a small populated pool (two live requests holding written
K/V, one deallocated request, a handle of another manager). Around the failing call the
test snapshots everything observable — stats, every live block table, reference counts,
free extents, the in-use mask and every layer's K/V pool — and, to catch hidden state
(placement reservations, the free-list order), replays the same follow-up operations on
the failed manager and on an untouched twin and compares what they do.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvcache_core import (
    AllocationRequest,
    BlockTable,
    CacheConfig,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    PageTable,
    available_backends,
    create_manager,
)
from kvcache_core.errors import (
    ArrayTypeError,
    BackendNotFoundError,
    DTypeMismatchError,
    DuplicateRequestError,
    ForeignHandleError,
    InsufficientBlocksError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidHandleError,
    InvalidTypeError,
    KvCacheError,
    LayerIndexError,
    OutOfBlocksError,
    SequenceTooLongError,
    ShapeMismatchError,
    SlotError,
    UnknownRequestError,
    UnsupportedConfigError,
)
from kvcache_core.numpy_backend import NumpyArray
from kvcache_core.protocols import SlotArray

Manager = PagedKvCacheManager[NumpyArray]
Handle = PagedKvCacheHandle[NumpyArray]

# 2 layers, 2 KV heads of 4 features, 8 blocks of 4 tokens: 32 slots.
CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4)
NUM_SLOTS = CONFIG.num_blocks * CONFIG.block_size


def untyped(value: object) -> Any:
    """Pass a deliberately ill-typed value past the type checker."""
    return value


def esc(value: object) -> str:
    """A ``match=`` pattern for the text of ``value``."""
    return re.escape(str(value))


# -- the populated pool ----------------------------------------------------------------


@dataclass
class World:
    """A populated manager and the handles the cases poke at."""

    manager: Manager
    a: Handle  # "a": 5 tokens written in 2 blocks, no max_sequence_length
    b: Handle  # "b": 3 tokens written in 1 block, max_sequence_length=8
    dead: Handle  # "dead": deallocated after writing 4 tokens
    dead_slots: SlotArray  # the slots "dead" wrote (its block is free now)
    stale_page_table: PageTable  # page table of [a, dead], taken before "dead" was freed
    foreign: Handle  # request "a" of another manager


def write_tokens(manager: Manager, handle: Handle, count: int, rng: np.random.Generator) -> None:
    """Extend ``handle`` by ``count`` tokens and write random K/V into every layer."""
    slots = manager.extend(handle, count)
    shape = (count, CONFIG.num_heads, CONFIG.head_dim)
    for layer in range(CONFIG.num_layers):
        keys = rng.standard_normal(shape).astype(np.float32)
        values = rng.standard_normal(shape).astype(np.float32)
        manager.write(layer, slots, keys, values)


def make_world() -> World:
    """The same populated pool on every call (the data comes from a fixed seed)."""
    rng = np.random.default_rng(20240601)
    manager = create_manager("numpy", CONFIG)
    a = manager.allocate(AllocationRequest("a", initial_tokens=6))
    dead = manager.allocate(AllocationRequest("dead", initial_tokens=4))
    b = manager.allocate(AllocationRequest("b", initial_tokens=4, max_sequence_length=8))
    write_tokens(manager, a, 5, rng)
    write_tokens(manager, dead, 4, rng)
    write_tokens(manager, b, 3, rng)
    stale_page_table = manager.page_table([a, dead])
    dead_slots = dead.block_table().slots(0, 4)
    manager.deallocate("dead")
    other = create_manager("numpy", CONFIG)
    foreign = other.allocate(AllocationRequest("a", initial_tokens=4))
    write_tokens(other, foreign, 2, rng)
    return World(manager, a, b, dead, dead_slots, stale_page_table, foreign)


def fill_pool(world: World) -> None:
    """Take every free block with a third request."""
    free = world.manager.allocator.free_block_count()
    world.manager.allocate(AllocationRequest("filler", initial_tokens=free * CONFIG.block_size))
    assert world.manager.allocator.free_block_count() == 0


# -- snapshots -------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Everything observable about a manager's state."""

    stats: dict[str, object]
    tables: list[tuple[str, dict[str, Any]]]
    handle_figures: list[tuple[str, bool, int, int, int]]
    ref_counts: list[int]
    free_extents: list[tuple[int, int]]
    in_use: list[bool]
    pools: list[tuple[NumpyArray, NumpyArray]]


# Counters that legitimately count refused calls.
FAILURE_COUNTERS = ("allocation_failures",)


def snapshot(manager: Manager) -> Snapshot:
    """Copy everything observable about ``manager``."""
    stats = dataclasses.asdict(manager.stats())
    for name in FAILURE_COUNTERS:
        del stats[name]
    handles = manager.list_handles()
    allocator = manager.allocator
    return Snapshot(
        stats=stats,
        tables=[(rid, handle.block_table().to_dict()) for rid, handle in handles],
        handle_figures=[
            (
                rid,
                handle.is_valid(),
                handle.num_tokens(),
                handle.stats().blocks_allocated,
                handle.stats().memory_bytes,
            )
            for rid, handle in handles
        ],
        ref_counts=[allocator.ref_count(block) for block in range(allocator.num_blocks)],
        free_extents=allocator.free_extents(),
        in_use=[bool(flag) for flag in allocator.in_use_mask()],
        pools=[
            (
                np.array(manager.storage.key_cache(layer), copy=True),
                np.array(manager.storage.value_cache(layer), copy=True),
            )
            for layer in range(manager.config.num_layers)
        ],
    )


def assert_same_state(after: Snapshot, before: Snapshot) -> None:
    """Fail, naming the first difference, unless the two snapshots agree exactly."""
    assert after.stats == before.stats
    assert after.tables == before.tables
    assert after.handle_figures == before.handle_figures
    assert after.ref_counts == before.ref_counts
    assert after.free_extents == before.free_extents
    assert after.in_use == before.in_use
    assert len(after.pools) == len(before.pools)
    for layer, ((keys_after, values_after), (keys_before, values_before)) in enumerate(
        zip(after.pools, before.pools, strict=True)
    ):
        assert np.array_equal(keys_after, keys_before), f"layer {layer} key pool changed"
        assert np.array_equal(values_after, values_before), f"layer {layer} value pool changed"


def probe(world: World) -> list[object]:
    """Run the same follow-up operations on a world; return what each one did.

    Two managers with the same hidden state (reservations, free-list order) give the
    same outcomes.
    """
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
            outcomes.append(result.block_table().to_dict())
        else:
            outcomes.append(result)

    def extend(request_id: str, count: int) -> Callable[[], object]:
        def run() -> object:
            handle = manager.get_handle(request_id)
            if handle is None:
                return f"no request {request_id}"
            return manager.extend(handle, count)

        return run

    # A one-block request goes where it fits best: it shows whose room is reserved.
    attempt(lambda: manager.allocate(AllocationRequest("probe-0", initial_tokens=4, max_sequence_length=4)))
    attempt(lambda: manager.allocate(AllocationRequest("probe-1", initial_tokens=3)))
    attempt(extend("probe-1", 6))
    attempt(extend("a", 4))
    attempt(lambda: manager.allocate(AllocationRequest("probe-2", initial_tokens=4, max_sequence_length=12)))
    attempt(extend("b", 5))
    attempt(extend("probe-2", 9))
    attempt(lambda: manager.deallocate("a"))
    attempt(lambda: manager.allocate(AllocationRequest("probe-3", initial_tokens=8)))
    attempt(extend("probe-3", 8))
    manager.check_invariants()
    outcomes.append(snapshot(manager).tables)
    return outcomes


# -- the manager catalogue -------------------------------------------------------------


@dataclass(frozen=True)
class BadCall:
    """One bad call on a populated manager, the error it must raise, and its message."""

    id: str
    act: Callable[[World], object]
    error: type[KvCacheError]
    match: str | None = None
    prepare: Callable[[World], None] | None = None


def good_slots(world: World) -> SlotArray:
    """Slots of tokens 0 and 1 of "a" (written already; writing them again is allowed)."""
    return world.a.block_table().slots(0, 2)


def kv(rows: int = 2, heads: int = 2, dim: int = 4, dtype: type[np.generic] = np.float32) -> NumpyArray:
    """A K or V array full of 7s, unlike anything in the pool."""
    return np.full((rows, heads, dim), 7, dtype=dtype)


def write_good_kv(world: World, layer: object = 0, slots: object = None) -> None:
    """``write`` with good keys and values, into ``slots`` (``good_slots`` by default)."""
    target = good_slots(world) if slots is None else slots
    rows = int(np.asarray(target).shape[0]) if np.asarray(target).ndim else 1
    world.manager.write(untyped(layer), untyped(target), kv(rows), kv(rows))


def first_free_block(world: World) -> int:
    return world.manager.allocator.free_extents()[0][0]


def decode_query(heads: int = 4, dim: int = 4, rows: int = 2, dtype: type[np.generic] = np.float32) -> NumpyArray:
    return np.ones((rows, heads, dim), dtype=dtype)


def attend(
    world: World,
    query: object = None,
    *,
    layer: object = 0,
    page_table: object = None,
    qo_indptr: object = None,
    scale: object = None,
    causal: object = True,
) -> object:
    """``paged_attention`` over [a, b] (5 and 3 tokens), good arguments unless given."""
    manager = world.manager
    table = manager.page_table([world.a, world.b]) if page_table is None else page_table
    return manager.paged_attention(
        untyped(layer),
        untyped(decode_query() if query is None else query),
        untyped(table),
        qo_indptr=untyped(qo_indptr),
        scale=untyped(scale),
        causal=untyped(causal),
    )


def page_table_with_indices(indices: list[int]) -> PageTable:
    """A hand-made page table of one request of ``4 * len(indices)`` tokens."""
    count = len(indices)
    return PageTable(
        kv_indptr=np.array([0, count]),
        kv_indices=np.array(indices),
        kv_last_page_len=np.array([CONFIG.block_size]),
        block_tables=np.array([indices]),
        seq_lens=np.array([count * CONFIG.block_size]),
        block_size=CONFIG.block_size,
    )


MANAGER_CASES: list[BadCall] = [
    # write: keys and values
    BadCall(
        "write-keys-wrong-head-dim",
        lambda w: w.manager.write(0, good_slots(w), kv(dim=5), kv()),
        ShapeMismatchError,
        esc((2, 2, 5)),
    ),
    BadCall(
        "write-keys-wrong-head-count",
        lambda w: w.manager.write(0, good_slots(w), kv(heads=3), kv()),
        ShapeMismatchError,
        esc((2, 3, 4)),
    ),
    BadCall(
        "write-values-more-rows-than-slots",
        lambda w: w.manager.write(0, good_slots(w), kv(), kv(rows=3)),
        ShapeMismatchError,
        esc((3, 2, 4)),
    ),
    BadCall(
        "write-keys-2d",
        lambda w: w.manager.write(0, good_slots(w), np.ones((2, 8), dtype=np.float32), kv()),
        ShapeMismatchError,
        esc((2, 8)),
    ),
    BadCall(
        "write-keys-float64",
        lambda w: w.manager.write(0, good_slots(w), kv(dtype=np.float64), kv()),
        DTypeMismatchError,
        "float64",
    ),
    BadCall(
        "write-values-float16",
        lambda w: w.manager.write(0, good_slots(w), kv(), kv(dtype=np.float16)),
        DTypeMismatchError,
        "float16",
    ),
    BadCall(
        "write-keys-nested-list",
        lambda w: w.manager.write(0, good_slots(w), untyped(kv().tolist()), kv()),
        ArrayTypeError,
        "list",
    ),
    BadCall(
        "write-values-none",
        lambda w: w.manager.write(0, good_slots(w), kv(), untyped(None)),
        ArrayTypeError,
        "NoneType",
    ),
    # write: layer
    BadCall("write-layer-negative", lambda w: write_good_kv(w, layer=-1), LayerIndexError, "layer -1 .*0 to 1"),
    BadCall("write-layer-too-big", lambda w: write_good_kv(w, layer=2), LayerIndexError, "layer 2 .*0 to 1"),
    BadCall("write-layer-bool", lambda w: write_good_kv(w, layer=True), LayerIndexError, "True"),
    BadCall("write-layer-float", lambda w: write_good_kv(w, layer=0.0), LayerIndexError, esc(0.0)),
    # write: slots
    BadCall(
        "write-slot-past-pool",
        lambda w: write_good_kv(w, slots=np.array([0, NUM_SLOTS])),
        SlotError,
        f"{NUM_SLOTS}.*0 to {NUM_SLOTS - 1}",
    ),
    BadCall("write-slot-negative", lambda w: write_good_kv(w, slots=np.array([-1, 0])), SlotError, "-1"),
    BadCall(
        "write-slot-uint64-past-int64",
        lambda w: write_good_kv(w, slots=np.array([2**63], dtype=np.uint64)),
        SlotError,
        r"slot 9223372036854775808\b",
    ),
    BadCall(
        "write-slot-in-free-block",
        lambda w: write_good_kv(w, slots=np.array([first_free_block(w) * CONFIG.block_size])),
        SlotError,
        "which no live request owns",
    ),
    BadCall(
        "write-slot-of-deallocated-request",
        lambda w: write_good_kv(w, slots=w.dead_slots[:2]),
        SlotError,
        "no live request owns",
    ),
    BadCall(
        "write-slot-repeated",
        lambda w: write_good_kv(w, slots=np.repeat(good_slots(w)[:1], 2)),
        SlotError,
        "more than once",
    ),
    BadCall(
        "write-slots-2d",
        lambda w: write_good_kv(w, slots=good_slots(w)[np.newaxis, :]),
        ShapeMismatchError,
        esc((1, 2)),
    ),
    BadCall(
        "write-slots-float",
        lambda w: write_good_kv(w, slots=good_slots(w).astype(np.float64)),
        InvalidTypeError,
        "float64",
    ),
    # extend
    BadCall("extend-negative", lambda w: w.manager.extend(w.a, -1), InvalidArgumentError, "-1"),
    BadCall("extend-bool", lambda w: w.manager.extend(w.a, untyped(True)), InvalidArgumentError, "True"),
    BadCall("extend-float", lambda w: w.manager.extend(w.a, untyped(1.0)), InvalidArgumentError, esc(1.0)),
    BadCall(
        "extend-past-max-sequence-length",
        lambda w: w.manager.extend(w.b, 6),
        SequenceTooLongError,
        "9 tokens.*max_sequence_length of 8",
    ),
    BadCall(
        "extend-more-than-free-blocks",
        lambda w: w.manager.extend(w.a, 100),
        OutOfBlocksError,
        "'a'",
    ),
    BadCall(
        "extend-on-full-pool",
        lambda w: w.manager.extend(w.a, 4),
        OutOfBlocksError,
        "'a'",
        prepare=fill_pool,
    ),
    BadCall("extend-deallocated", lambda w: w.manager.extend(w.dead, 1), InvalidHandleError, "'dead'"),
    BadCall("extend-foreign-handle", lambda w: w.manager.extend(w.foreign, 1), ForeignHandleError, "another manager"),
    BadCall("extend-not-a-handle", lambda w: w.manager.extend(untyped("a"), 1), ForeignHandleError, "str"),
    # allocate
    BadCall(
        "allocate-duplicate-id",
        lambda w: w.manager.allocate(AllocationRequest("a")),
        DuplicateRequestError,
        "'a'",
    ),
    BadCall(
        "allocate-more-than-free-blocks",
        lambda w: w.manager.allocate(AllocationRequest("big", initial_tokens=6 * CONFIG.block_size)),
        OutOfBlocksError,
        "'big'.*need 6 blocks",
    ),
    BadCall(
        "allocate-on-full-pool",
        lambda w: w.manager.allocate(AllocationRequest("c", initial_tokens=1)),
        OutOfBlocksError,
        "'c'",
        prepare=fill_pool,
    ),
    BadCall(
        "allocate-not-a-request",
        lambda w: w.manager.allocate(untyped({"request_id": "c"})),
        InvalidTypeError,
        "dict",
    ),
    # deallocate
    BadCall("deallocate-unknown", lambda w: w.manager.deallocate("nope"), UnknownRequestError, "'nope'"),
    BadCall("deallocate-twice", lambda w: w.manager.deallocate("dead"), UnknownRequestError, "'dead'"),
    BadCall("deallocate-not-a-str", lambda w: w.manager.deallocate(untyped(w.a)), UnknownRequestError),
    # use after deallocate
    BadCall("key-cache-after-deallocate", lambda w: w.dead.key_cache(0), InvalidHandleError, "'dead'"),
    BadCall("value-cache-after-deallocate", lambda w: w.dead.value_cache(0), InvalidHandleError, "'dead'"),
    BadCall("kv-cache-after-deallocate", lambda w: w.dead.kv_cache(0), InvalidHandleError, "'dead'"),
    BadCall(
        "clone-key-cache-after-deallocate",
        lambda w: w.dead.clone_handle().key_cache(1),
        InvalidHandleError,
        "'dead'",
    ),
    BadCall("gather-after-deallocate", lambda w: w.manager.gather(w.dead, 0), InvalidHandleError, "'dead'"),
    BadCall(
        "page-table-after-deallocate",
        lambda w: w.manager.page_table([w.a, w.dead]),
        InvalidHandleError,
        "'dead'",
    ),
    # handle and gather: layer, ownership
    BadCall("key-cache-layer-too-big", lambda w: w.a.key_cache(2), LayerIndexError, "layer 2 .*0 to 1"),
    BadCall("value-cache-layer-negative", lambda w: w.a.value_cache(-1), LayerIndexError, "layer -1"),
    BadCall("kv-cache-layer-bool", lambda w: w.a.kv_cache(untyped(False)), LayerIndexError, "False"),
    BadCall("gather-layer-too-big", lambda w: w.manager.gather(w.a, 5), LayerIndexError, "layer 5"),
    BadCall("gather-layer-float", lambda w: w.manager.gather(w.a, untyped(1.0)), LayerIndexError, esc(1.0)),
    BadCall("gather-foreign-handle", lambda w: w.manager.gather(w.foreign, 0), ForeignHandleError, "'a'"),
    BadCall("page-table-foreign-handle", lambda w: w.manager.page_table([w.b, w.foreign]), ForeignHandleError),
    # paged_attention
    BadCall(
        "attention-query-heads-not-a-multiple",
        lambda w: attend(w, decode_query(heads=3)),
        ShapeMismatchError,
        esc((2, 3, 4)),
    ),
    BadCall(
        "attention-query-heads-fewer-than-kv-heads",
        lambda w: attend(w, decode_query(heads=1)),
        ShapeMismatchError,
        esc((2, 1, 4)),
    ),
    BadCall(
        "attention-query-wrong-head-dim",
        lambda w: attend(w, decode_query(dim=8)),
        ShapeMismatchError,
        esc((2, 4, 8)),
    ),
    BadCall(
        "attention-query-float64",
        lambda w: attend(w, decode_query(dtype=np.float64)),
        DTypeMismatchError,
        "float64",
    ),
    BadCall("attention-query-list", lambda w: attend(w, decode_query().tolist()), ArrayTypeError, "list"),
    BadCall("attention-layer-too-big", lambda w: attend(w, layer=2), LayerIndexError, "layer 2"),
    BadCall(
        "attention-decode-wrong-query-count",
        lambda w: attend(w, decode_query(rows=3)),
        ShapeMismatchError,
        "2 requests, 3 query tokens",
    ),
    BadCall(
        "attention-qo-indptr-wrong-length",
        lambda w: attend(w, qo_indptr=np.array([0, 2])),
        InvalidArgumentError,
        esc((2,)),
    ),
    BadCall(
        "attention-qo-indptr-float",
        lambda w: attend(w, qo_indptr=np.array([0.0, 1.0, 2.0])),
        InvalidArgumentError,
        "float64",
    ),
    BadCall(
        "attention-qo-indptr-not-monotonic",
        lambda w: attend(w, decode_query(rows=4), qo_indptr=np.array([0, 5, 4])),
        InvalidArgumentError,
        esc([0, 5, 4]),
    ),
    BadCall(
        "attention-qo-indptr-wrong-total",
        lambda w: attend(w, decode_query(rows=4), qo_indptr=np.array([0, 1, 3])),
        InvalidArgumentError,
        esc([0, 1, 3]),
    ),
    BadCall(
        "attention-more-queries-than-tokens",
        lambda w: attend(w, decode_query(rows=6), qo_indptr=np.array([0, 2, 6])),
        InvalidArgumentError,
        "request 1 has 4 query tokens but only 3",
    ),
    BadCall("attention-scale-zero", lambda w: attend(w, scale=0.0), InvalidArgumentError, esc(0.0)),
    BadCall("attention-scale-negative", lambda w: attend(w, scale=-0.5), InvalidArgumentError, esc(-0.5)),
    BadCall("attention-scale-nan", lambda w: attend(w, scale=math.nan), InvalidArgumentError, "nan"),
    BadCall("attention-scale-inf", lambda w: attend(w, scale=math.inf), InvalidArgumentError, "inf"),
    BadCall("attention-scale-bool", lambda w: attend(w, scale=True), InvalidArgumentError, "True"),
    BadCall("attention-causal-not-bool", lambda w: attend(w, causal="yes"), InvalidTypeError, "'yes'"),
    BadCall(
        "attention-page-table-not-a-page-table",
        lambda w: attend(w, page_table={"seq_lens": [5, 3]}),
        InvalidTypeError,
        "dict",
    ),
    BadCall(
        "attention-stale-page-table-of-deallocated-request",
        lambda w: attend(w, page_table=w.stale_page_table),
        SlotError,
        "no live request owns",
    ),
    BadCall(
        "attention-page-table-block-past-pool",
        lambda w: attend(w, decode_query(rows=1), page_table=page_table_with_indices([CONFIG.num_blocks])),
        SlotError,
        f"block {CONFIG.num_blocks}",
    ),
    BadCall(
        "attention-page-table-negative-block",
        lambda w: attend(w, decode_query(rows=1), page_table=page_table_with_indices([3, -1])),
        SlotError,
        "-1",
    ),
]


@pytest.mark.parametrize("case", MANAGER_CASES, ids=[case.id for case in MANAGER_CASES])
def test_bad_manager_call_raises_its_error_and_changes_nothing(case: BadCall) -> None:
    world, twin = make_world(), make_world()
    if case.prepare is not None:
        case.prepare(world)
        case.prepare(twin)
    before = snapshot(world.manager)

    with pytest.raises(case.error, match=case.match) as caught:
        case.act(world)

    assert type(caught.value) is case.error, f"raised {type(caught.value).__name__}"
    world.manager.check_invariants()
    assert_same_state(snapshot(world.manager), before)
    assert world.a.is_valid()
    assert world.b.is_valid()
    assert not world.dead.is_valid()
    # Hidden state too: the failed manager behaves exactly like an untouched twin.
    assert probe(world) == probe(twin)
    assert_same_state(snapshot(world.manager), snapshot(twin.manager))


def test_catalogue_is_large_and_every_id_is_unique() -> None:
    ids = [case.id for case in MANAGER_CASES]
    assert len(ids) >= 30
    assert len(set(ids)) == len(ids)


def test_failed_allocations_are_counted() -> None:
    world = make_world()
    failures = world.manager.stats().allocation_failures

    with pytest.raises(OutOfBlocksError):
        world.manager.extend(world.a, 100)
    with pytest.raises(OutOfBlocksError):
        world.manager.allocate(AllocationRequest("big", initial_tokens=NUM_SLOTS))

    assert world.manager.stats().allocation_failures == failures + 2


# -- create_manager --------------------------------------------------------------------


@dataclass(frozen=True)
class BadFactoryCall:
    id: str
    backend: object
    config: object
    error: type[KvCacheError]
    match: str


FACTORY_CASES: list[BadFactoryCall] = [
    BadFactoryCall("unknown-backend", "quantum-annealer", CONFIG, BackendNotFoundError, "'quantum-annealer'"),
    BadFactoryCall("backend-name-not-a-str", 42, CONFIG, InvalidTypeError, "42"),
    BadFactoryCall(
        "numpy-bfloat16",
        "numpy",
        dataclasses.replace(CONFIG, dtype="bfloat16"),
        UnsupportedConfigError,
        "bfloat16.*float32",
    ),
    BadFactoryCall(
        "numpy-cuda-device",
        "numpy",
        dataclasses.replace(CONFIG, device=untyped("cuda:0")),
        UnsupportedConfigError,
        "cuda:0.*cpu",
    ),
    BadFactoryCall("config-not-a-config", "numpy", {"num_layers": 2}, InvalidTypeError, "dict"),
    BadFactoryCall(
        "prefix-caching-not-built",
        "numpy",
        dataclasses.replace(CONFIG, enable_prefix_caching=True),
        UnsupportedConfigError,
        "enable_prefix_caching",
    ),
    BadFactoryCall(
        "sliding-window-not-built",
        "numpy",
        dataclasses.replace(CONFIG, sliding_window=8),
        UnsupportedConfigError,
        "sliding_window=8",
    ),
]


@pytest.mark.parametrize("case", FACTORY_CASES, ids=[case.id for case in FACTORY_CASES])
def test_bad_create_manager_call_raises_its_error(case: BadFactoryCall) -> None:
    backends_before = available_backends()

    with pytest.raises(case.error, match=case.match) as caught:
        create_manager(untyped(case.backend), untyped(case.config))

    assert type(caught.value) is case.error
    assert available_backends() == backends_before


def test_unknown_backend_message_lists_installed_backends_and_how_to_install() -> None:
    with pytest.raises(BackendNotFoundError) as caught:
        create_manager("quantum-annealer", CONFIG)

    message = str(caught.value)
    installed = available_backends()
    assert "numpy" in installed
    assert all(name in message for name in installed), message
    assert "installed:" in message
    assert re.search(r"pip install \S+", message), message


# -- CacheConfig -----------------------------------------------------------------------


CONFIG_FIELDS: dict[str, object] = {"num_layers": 2, "num_heads": 2, "head_dim": 4, "num_blocks": 8}

BAD_CONFIG_FIELDS: list[tuple[str, dict[str, object], str]] = [
    ("num_layers-zero", {"num_layers": 0}, "num_layers.*>= 1.*got 0"),
    ("num_layers-negative", {"num_layers": -2}, "num_layers.*-2"),
    ("num_layers-bool", {"num_layers": True}, "num_layers.*True"),
    ("num_layers-float", {"num_layers": 2.0}, "num_layers.*2.0"),
    ("num_layers-str", {"num_layers": "2"}, "num_layers.*'2'"),
    ("num_heads-zero", {"num_heads": 0}, "num_heads.*got 0"),
    ("num_heads-bool", {"num_heads": False}, "num_heads.*False"),
    ("head_dim-negative", {"head_dim": -4}, "head_dim.*-4"),
    ("num_blocks-zero", {"num_blocks": 0}, "num_blocks.*got 0"),
    ("num_blocks-float", {"num_blocks": 8.5}, "num_blocks.*8.5"),
    ("block_size-zero", {"block_size": 0}, "block_size.*got 0"),
    ("block_size-bool", {"block_size": True}, "block_size.*True"),
    ("dtype-unknown", {"dtype": "int8"}, "'int8'.*float32"),
    ("dtype-numpy-type", {"dtype": np.float32}, "dtype"),
    ("dtype-list", {"dtype": ["float32"]}, esc(["float32"])),
    ("kv_layout-unknown", {"kv_layout": "NDH"}, "'NDH'.*NHD, HND, heads_first"),
    ("kv_layout-lowercase", {"kv_layout": "nhd"}, "'nhd'"),
    ("device-bad-index", {"device": "cuda:x"}, "cuda:x"),
    ("device-negative-index", {"device": "cuda:-1"}, "cuda:-1"),
    ("device-empty-index", {"device": "cuda:"}, "cuda:"),
    ("device-superscript-index", {"device": "cuda:\u00b2"}, "cuda:\u00b2"),
    ("device-unknown-kind", {"device": "quantum"}, "'quantum'.*cpu"),
    ("device-not-a-str", {"device": 3}, "3"),
    ("enable_prefix_caching-str", {"enable_prefix_caching": "yes"}, "'yes'"),
    ("sliding_window-zero", {"sliding_window": 0}, "sliding_window.*got 0"),
    ("thresholds-medium-above-high", {"medium_pressure_threshold": 0.85}, "medium=0.85"),
    ("thresholds-high-equals-critical", {"high_pressure_threshold": 0.95}, "high=0.95"),
    ("thresholds-critical-above-one", {"critical_pressure_threshold": 1.5}, "critical=1.5"),
    ("thresholds-medium-zero", {"medium_pressure_threshold": 0.0}, "medium=0.0"),
    ("thresholds-nan", {"high_pressure_threshold": math.nan}, "high=nan"),
    ("thresholds-bool", {"critical_pressure_threshold": True}, "critical=True"),
    ("thresholds-str", {"medium_pressure_threshold": "0.5"}, "medium='0.5'"),
]


@pytest.mark.parametrize(
    ("fields", "match"),
    [pytest.param(fields, match, id=case_id) for case_id, fields, match in BAD_CONFIG_FIELDS],
)
def test_bad_cache_config_field_raises_invalid_config_error(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match) as caught:
        CacheConfig(**untyped({**CONFIG_FIELDS, **fields}))

    assert type(caught.value) is InvalidConfigError


# -- AllocationRequest -----------------------------------------------------------------


BAD_REQUESTS: list[tuple[str, dict[str, object], str]] = [
    ("empty-id", {"request_id": ""}, "request_id.*''"),
    ("id-not-a-str", {"request_id": 7}, "request_id.*7"),
    ("initial_tokens-negative", {"initial_tokens": -1}, "initial_tokens.*-1"),
    ("initial_tokens-bool", {"initial_tokens": True}, "initial_tokens.*True"),
    ("initial_tokens-float", {"initial_tokens": 2.0}, "initial_tokens.*2.0"),
    ("max_sequence_length-zero", {"max_sequence_length": 0}, "max_sequence_length.*got 0"),
    (
        "initial_tokens-above-max_sequence_length",
        {"initial_tokens": 10, "max_sequence_length": 8},
        "initial_tokens=10.*max_sequence_length=8",
    ),
    ("prompt-negative-token-id", {"prompt_token_ids": (1, -2, 3)}, "prompt_token_ids"),
    ("prompt-float-token-id", {"prompt_token_ids": (1, 2.0)}, "prompt_token_ids"),
    ("prompt-str", {"prompt_token_ids": "abc"}, "prompt_token_ids"),
    ("prompt-not-a-sequence", {"prompt_token_ids": 5}, "prompt_token_ids"),
    ("priority-float", {"priority": 1.5}, "priority.*1.5"),
    ("priority-bool", {"priority": True}, "priority.*True"),
]


@pytest.mark.parametrize(
    ("fields", "match"),
    [pytest.param(fields, match, id=case_id) for case_id, fields, match in BAD_REQUESTS],
)
def test_bad_allocation_request_raises_invalid_argument_error(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        AllocationRequest(**untyped({"request_id": "r", **fields}))

    assert type(caught.value) is InvalidArgumentError


# -- BlockTable --------------------------------------------------------------------------


def five_token_table() -> BlockTable:
    """Blocks 3 and 4 of 4 tokens, holding 5 tokens (capacity 8)."""
    return BlockTable(4, [3, 4], 5)


@dataclass(frozen=True)
class BadTableCall:
    id: str
    act: Callable[[BlockTable], object]
    error: type[KvCacheError]
    match: str


TABLE_CASES: list[BadTableCall] = [
    BadTableCall(
        "extend-sequence-past-capacity",
        lambda t: t.extend_sequence(4),
        InsufficientBlocksError,
        "length 9 needs 3 blocks.*has 2",
    ),
    BadTableCall("extend-sequence-negative", lambda t: t.extend_sequence(-1), InvalidArgumentError, "-1"),
    BadTableCall("extend-sequence-float", lambda t: t.extend_sequence(untyped(1.0)), InvalidArgumentError, esc(1.0)),
    BadTableCall("add-block-already-in-table", lambda t: t.add_blocks([5, 3]), InvalidArgumentError, "block 3"),
    BadTableCall("add-block-twice-in-one-call", lambda t: t.add_blocks([7, 7]), InvalidArgumentError, "block 7"),
    BadTableCall("add-block-negative", lambda t: t.add_blocks([8, -1]), InvalidArgumentError, "-1"),
    BadTableCall("add-block-bool", lambda t: t.add_blocks(untyped([True])), InvalidArgumentError, "True"),
    BadTableCall("add-block-float", lambda t: t.add_blocks(untyped([9.0])), InvalidArgumentError, esc(9.0)),
    BadTableCall("slots-past-capacity", lambda t: t.slots(0, 9), InvalidArgumentError, esc("[0, 9)")),
    BadTableCall("slots-float-stop", lambda t: t.slots(0, untyped(1.5)), InvalidArgumentError, esc(1.5)),
]


@pytest.mark.parametrize("case", TABLE_CASES, ids=[case.id for case in TABLE_CASES])
def test_bad_block_table_call_raises_its_error_and_changes_nothing(case: BadTableCall) -> None:
    table = five_token_table()
    before = table.to_dict()

    with pytest.raises(case.error, match=case.match) as caught:
        case.act(table)

    assert type(caught.value) is case.error
    assert table.to_dict() == before
    assert table == five_token_table()
    table.extend_sequence(3)  # still usable: exactly the 3 free tokens fit
    assert table.free_tokens() == 0


@pytest.mark.parametrize(
    ("block_size", "blocks", "length"),
    [
        pytest.param(0, [], 0, id="block-size-zero"),
        pytest.param(True, [], 0, id="block-size-bool"),
        pytest.param(4, [1, 1], 0, id="duplicate-block"),
        pytest.param(4, [1], 5, id="length-past-capacity"),
    ],
)
def test_bad_block_table_construction_raises(block_size: int, blocks: list[int], length: int) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockTable(block_size, blocks, length)


def test_blocks_needed_for_negative_length_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="-1"):
        BlockTable.blocks_needed_for_length(-1, 4)


def test_block_table_from_dict_with_wrong_mapping_raises() -> None:
    data = five_token_table().to_dict()
    data["logical_to_physical"] = [1, 0]

    with pytest.raises(InvalidArgumentError, match=esc([1, 0])):
        BlockTable.from_dict(data)


# -- boundaries that are not bad inputs ----------------------------------------------------


def test_empty_decode_batch_attends_to_nothing() -> None:
    world = make_world()
    before = snapshot(world.manager)

    output = world.manager.paged_attention(0, decode_query(rows=0), world.manager.page_table([]))

    assert output.shape == (0, 4, 4)
    assert_same_state(snapshot(world.manager), before)


def test_extend_by_zero_hands_out_no_slots() -> None:
    world = make_world()
    before = snapshot(world.manager)

    slots = world.manager.extend(world.a, 0)

    assert slots.shape == (0,)
    assert_same_state(snapshot(world.manager), before)


def test_write_of_no_slots_changes_nothing() -> None:
    world = make_world()
    before = snapshot(world.manager)

    world.manager.write(1, np.zeros(0, dtype=np.int64), kv(rows=0), kv(rows=0))

    assert_same_state(snapshot(world.manager), before)
