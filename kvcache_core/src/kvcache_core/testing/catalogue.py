"""The bad-input catalogue: each bad call raises its own exception class and changes nothing.

Every case runs on a populated pool of the backend under test (:mod:`kvcache_core.testing.world`):
:data:`MANAGER_CASES` on the plain one, :data:`~kvcache_core.testing.policy_catalogue.POLICY_CASES`
on one with the cache policies in play, each case only where the backend claims the
capabilities it ``requires``. :func:`check_bad_call` checks the error class and message,
that nothing observable changed, and that the failed manager behaves exactly like an
untouched twin (hidden state: placement reservations, the free-list order).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from kvcache_core.contract.config import AllocationRequest
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import SlotArray
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    DuplicateRequestError,
    ForeignHandleError,
    InvalidArgumentError,
    InvalidHandleError,
    InvalidTypeError,
    KvCacheError,
    LayerIndexError,
    OutOfBlocksError,
    SequenceTooLongError,
    ShapeMismatchError,
    SlotError,
    StalePageTableError,
    UnknownRequestError,
)
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing import inspect
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.kv_data import sevens
from kvcache_core.testing.world import (
    CONFIG,
    NUM_SLOTS,
    World,
    assert_same_state,
    esc,
    fill_pool,
    snapshot,
    untyped,
)

__all__ = ["MANAGER_CASES", "BadCall", "attend", "check_bad_call"]

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]


class CaseWorld(Protocol):
    """What :func:`check_bad_call` needs of a populated pool."""

    @property
    def manager(self) -> Manager: ...

    @property
    def dead(self) -> Handle: ...


WorldT = TypeVar("WorldT", bound=CaseWorld)


# -- the manager catalogue -------------------------------------------------------------


@dataclass(frozen=True)
class BadCall(Generic[WorldT]):
    """One bad call on a populated manager, the error it must raise, and its message.

    Attributes:
        requires: the capabilities (``BackendSpec.capabilities``) a backend must claim for
            the case to run; a backend that does not claim one skips it.
    """

    id: str
    act: Callable[[WorldT], object]
    error: type[KvCacheError]
    match: str | Callable[[WorldT], str] | None = None
    prepare: Callable[[WorldT], None] | None = None
    requires: tuple[str, ...] = ()

    def pattern(self, world: WorldT) -> str | None:
        """The ``match=`` pattern for this world (some depend on the pool's dtype)."""
        return self.match(world) if callable(self.match) else self.match


def good_slots(world: World) -> SlotArray:
    """Slots of tokens 0 and 1 of "a" (written already; writing them again is allowed)."""
    return world.a.block_table().slots(0, 2)


def other_dtype(world: World) -> str:
    """A dtype every backend holds that is not the pool's."""
    return "float16" if world.manager.config.dtype != "float16" else "float32"


def kv(world: World, rows: int = 2, heads: int = 2, dim: int = 4, dtype: str | None = None) -> Any:
    """A native K or V array full of 7s, unlike anything in the pool (the pool's dtype by default)."""
    return sevens(world.manager, (rows, heads, dim), dtype)


def write_good_kv(world: World, layer: object = 0, slots: object = None) -> None:
    """``write`` with good keys and values, into ``slots`` (``good_slots`` by default)."""
    target = good_slots(world) if slots is None else slots
    rows = int(np.asarray(target).shape[0]) if np.asarray(target).ndim else 1
    world.manager.write(untyped(layer), untyped(target), kv(world, rows), kv(world, rows))


def first_free_block(world: World) -> int:
    return inspect.allocator(world.manager).free_extents()[0][0]


def decode_query(world: World, heads: int = 4, dim: int = 4, rows: int = 2, dtype: str | None = None) -> Any:
    """A native query (the pool's dtype by default)."""
    return BackendUnderTest.native(world.manager, np.ones((rows, heads, dim)), dtype)


def attend(
    world: World,
    query: object = None,
    *,
    layer: object = 0,
    page_table: object = None,
    qo_indptr: object = None,
    scale: object = None,
    causal: object = True,
    **features: object,
) -> object:
    """``paged_attention`` over [a, b] (5 and 3 tokens), good arguments unless given;
    ``features``: ``window``, ``softcap``, ``sinks``, ``chunk``."""
    manager = world.manager
    table = manager.page_table([world.a, world.b]) if page_table is None else page_table
    return manager.paged_attention(
        untyped(layer),
        untyped(decode_query(world) if query is None else query),
        untyped(table),
        qo_indptr=untyped(qo_indptr),
        scale=untyped(scale),
        causal=untyped(causal),
        **{name: untyped(value) for name, value in features.items()},
    )


def forged_page_table(world: World) -> PageTable:
    """A page table claiming request "a" at its current generation, but listing a block
    of "b" in place of a's first block (built by hand, not by the manager)."""
    table = world.manager.page_table([world.a])
    indices = np.array(table.kv_indices)
    indices[0] = world.b.block_table().physical_blocks[0]
    return dataclasses.replace(table, kv_indices=indices, block_tables=indices[None, :])


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


MANAGER_CASES: list[BadCall[World]] = [
    # write: keys and values
    BadCall(
        "write-keys-wrong-head-dim",
        lambda w: w.manager.write(0, good_slots(w), kv(w, dim=5), kv(w)),
        ShapeMismatchError,
        esc((2, 2, 5)),
    ),
    BadCall(
        "write-keys-wrong-head-count",
        lambda w: w.manager.write(0, good_slots(w), kv(w, heads=3), kv(w)),
        ShapeMismatchError,
        esc((2, 3, 4)),
    ),
    BadCall(
        "write-values-more-rows-than-slots",
        lambda w: w.manager.write(0, good_slots(w), kv(w), kv(w, rows=3)),
        ShapeMismatchError,
        esc((3, 2, 4)),
    ),
    BadCall(
        "write-keys-2d",
        lambda w: w.manager.write(0, good_slots(w), BackendUnderTest.native(w.manager, np.ones((2, 8))), kv(w)),
        ShapeMismatchError,
        esc((2, 8)),
    ),
    BadCall(
        "write-keys-other-dtype",
        lambda w: w.manager.write(0, good_slots(w), kv(w, dtype=other_dtype(w)), kv(w)),
        DTypeMismatchError,
        other_dtype,
    ),
    BadCall(
        "write-values-other-dtype",
        lambda w: w.manager.write(0, good_slots(w), kv(w), kv(w, dtype=other_dtype(w))),
        DTypeMismatchError,
        other_dtype,
    ),
    BadCall(
        "write-keys-nested-list",
        lambda w: w.manager.write(0, good_slots(w), untyped(np.full((2, 2, 4), 7.0).tolist()), kv(w)),
        ArrayTypeError,
        "list",
    ),
    BadCall(
        "write-keys-numpy-array-on-another-backend",
        lambda w: w.manager.write(0, good_slots(w), untyped(object()), kv(w)),
        ArrayTypeError,
        "object",
    ),
    BadCall(
        "write-values-none",
        lambda w: w.manager.write(0, good_slots(w), kv(w), untyped(None)),
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
        lambda w: attend(w, decode_query(w, heads=3)),
        ShapeMismatchError,
        esc((2, 3, 4)),
    ),
    BadCall(
        "attention-query-heads-fewer-than-kv-heads",
        lambda w: attend(w, decode_query(w, heads=1)),
        ShapeMismatchError,
        esc((2, 1, 4)),
    ),
    BadCall(
        "attention-query-wrong-head-dim",
        lambda w: attend(w, decode_query(w, dim=8)),
        ShapeMismatchError,
        esc((2, 4, 8)),
    ),
    BadCall(
        "attention-query-other-dtype",
        lambda w: attend(w, decode_query(w, dtype=other_dtype(w))),
        DTypeMismatchError,
        other_dtype,
    ),
    BadCall("attention-query-list", lambda w: attend(w, np.ones((2, 4, 4)).tolist()), ArrayTypeError, "list"),
    BadCall("attention-layer-too-big", lambda w: attend(w, layer=2), LayerIndexError, "layer 2"),
    BadCall(
        "attention-decode-wrong-query-count",
        lambda w: attend(w, decode_query(w, rows=3)),
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
        lambda w: attend(w, decode_query(w, rows=4), qo_indptr=np.array([0, 5, 4])),
        InvalidArgumentError,
        esc([0, 5, 4]),
    ),
    BadCall(
        "attention-qo-indptr-wrong-total",
        lambda w: attend(w, decode_query(w, rows=4), qo_indptr=np.array([0, 1, 3])),
        InvalidArgumentError,
        esc([0, 1, 3]),
    ),
    BadCall(
        "attention-more-queries-than-tokens",
        lambda w: attend(w, decode_query(w, rows=6), qo_indptr=np.array([0, 2, 6])),
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
        StalePageTableError,
        "'dead', released since",
    ),
    BadCall(
        "attention-page-table-forged-with-another-requests-block",
        lambda w: attend(w, decode_query(w, rows=1), page_table=forged_page_table(w)),
        StalePageTableError,
        "for request 'a'",
    ),
    BadCall(
        "attention-hand-made-page-table-naming-a-freed-block",
        lambda w: attend(
            w, decode_query(w, rows=1), page_table=page_table_with_indices([int(w.dead_slots[0]) // CONFIG.block_size])
        ),
        SlotError,
        "no live request owns",
    ),
    BadCall(
        "attention-page-table-block-past-pool",
        lambda w: attend(w, decode_query(w, rows=1), page_table=page_table_with_indices([CONFIG.num_blocks])),
        SlotError,
        f"block {CONFIG.num_blocks}",
    ),
    BadCall(
        "attention-page-table-negative-block",
        lambda w: attend(w, decode_query(w, rows=1), page_table=page_table_with_indices([3, -1])),
        InvalidArgumentError,
        "holds -1: entries must be in",
    ),
    BadCall(
        "attention-page-table-block-past-int32",
        lambda w: attend(w, decode_query(w, rows=1), page_table=page_table_with_indices([2**32 + 3])),
        InvalidArgumentError,
        str(2**32 + 3),
    ),
    # page_table: what it takes
    BadCall("page-table-of-none", lambda w: w.manager.page_table(untyped(None)), InvalidTypeError, "NoneType"),
    BadCall("page-table-of-one-handle", lambda w: w.manager.page_table(untyped(w.a)), InvalidTypeError, "Handle"),
    # write: only positions extend handed out
    BadCall(
        "write-slot-reserved-but-not-handed-out",
        lambda w: w.manager.write(0, w.b.block_table().slots(3, 4), kv(w, rows=1), kv(w, rows=1)),
        SlotError,
        "not handed out",
    ),
]


def check_bad_call(case: BadCall[WorldT], build: Callable[[], WorldT], probe: Callable[[WorldT], list[object]]) -> None:
    """Run one case on a world from ``build``: its error and message, nothing changed, and
    ``probe`` (follow-up operations) does the same on it as on an untouched twin.

    Raises:
        AssertionError: naming the first difference.
    """
    import pytest

    world, twin = build(), build()
    if case.prepare is not None:
        case.prepare(world)
        case.prepare(twin)
    before = snapshot(world.manager)
    live = [(rid, handle.is_swapped_out()) for rid, handle in world.manager.list_handles()]

    with pytest.raises(case.error, match=case.pattern(world)) as caught:
        case.act(world)

    assert type(caught.value) is case.error, f"raised {type(caught.value).__name__}, expected {case.error.__name__}"
    world.manager.check_invariants()
    assert_same_state(snapshot(world.manager), before)
    assert [(rid, handle.is_valid(), handle.is_swapped_out()) for rid, handle in world.manager.list_handles()] == [
        (rid, True, swapped) for rid, swapped in live
    ]
    assert not world.dead.is_valid()
    # Hidden state too: the failed manager behaves exactly like an untouched twin.
    assert probe(world) == probe(twin)
    assert_same_state(snapshot(world.manager), snapshot(twin.manager))
