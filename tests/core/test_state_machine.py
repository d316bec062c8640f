"""A Hypothesis state machine over the manager's life cycle, against a pure-Python model.

Rules: allocate, extend, write (batched across requests, in any slot order), rewrite,
clone a handle, deallocate, and the refusals — an allocate or extend that must fail with
``OutOfBlocksError`` because the pool is full, an extend past ``max_sequence_length``, a
duplicate id, a second deallocate — each checked to change nothing. After every step the
invariants compare the manager with the model: block counts, every live request's
gathered K/V bit for bit, the pool read through its layout, handle validity, stats and
memory-pressure events. Paged attention over live requests is compared with a dense
softmax attention computed here from the model's K/V.

The machine runs once per pool layout ("NHD", "HND", "heads_first"), and once more with
the allocator's "fifo" placement, whose scattered block tables make attention read many
runs per request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    MemoryPressure,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    create_manager,
)
from kvcache_core.allocator import Placement
from kvcache_core.errors import (
    DuplicateRequestError,
    InvalidHandleError,
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownRequestError,
)
from kvcache_core.numpy_backend import NumpyArray, NumpyStorage
from kvcache_core.testing.oracle import dense_attention

Manager = PagedKvCacheManager[NumpyArray]
Handle = PagedKvCacheHandle[NumpyArray]

NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 4
BLOCK_SIZE = 4
NUM_BLOCKS = 24
QUERY_GROUP = 2  # query heads per KV head in the attention checks (GQA)
REQUEST_IDS = tuple(f"r{index}" for index in range(6))
MAX_HANDLES_PER_REQUEST = 3
DEAD_HANDLES_KEPT = 4


def make_config(kv_layout: str) -> CacheConfig:
    return CacheConfig(
        num_layers=NUM_LAYERS,
        num_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        kv_layout=kv_layout,
    )


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def expected_pressure(used_blocks: int) -> MemoryPressure:
    """The level for the default thresholds 0.6 / 0.8 / 0.95, computed here."""
    used = used_blocks / NUM_BLOCKS
    if used >= 0.95:
        return MemoryPressure.CRITICAL
    if used >= 0.8:
        return MemoryPressure.HIGH
    if used >= 0.6:
        return MemoryPressure.MEDIUM
    return MemoryPressure.LOW


def random_kv(rng: np.random.Generator, rows: int) -> NumpyArray:
    return rng.standard_normal((rows, NUM_HEADS, HEAD_DIM)).astype(np.float32)


def empty_kv() -> NumpyArray:
    return np.zeros((0, NUM_HEADS, HEAD_DIM), dtype=np.float32)


@dataclass
class ModelRequest:
    """What the model knows of one live request."""

    handles: list[Handle]
    max_sequence_length: int | None
    blocks: int
    keys: list[NumpyArray]  # per layer, [written, num_heads, head_dim]
    values: list[NumpyArray]
    pending: list[int] = field(default_factory=list[int])  # slots handed out, not yet written

    @property
    def written(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def length(self) -> int:
        return self.written + len(self.pending)


@dataclass(frozen=True)
class Snapshot:
    """Everything observable about a manager, for "a refused call changed nothing"."""

    stats: dict[str, object]
    tables: list[tuple[str, dict[str, Any]]]
    ref_counts: list[int]
    free_extents: list[tuple[int, int]]
    pools: list[NumpyArray]


def snapshot(manager: Manager) -> Snapshot:
    stats = dataclasses.asdict(manager.stats())
    del stats["allocation_failures"]  # counts refusals: checked against the model instead
    allocator = manager.allocator
    return Snapshot(
        stats=stats,
        tables=[(rid, handle.block_table().to_dict()) for rid, handle in manager.list_handles()],
        ref_counts=[allocator.ref_count(block) for block in range(allocator.num_blocks)],
        free_extents=allocator.free_extents(),
        pools=[
            np.array(pool(layer), copy=True)
            for layer in range(NUM_LAYERS)
            for pool in (manager.storage.key_cache, manager.storage.value_cache)
        ],
    )


def assert_unchanged(manager: Manager, before: Snapshot) -> None:
    manager.check_invariants()
    after = snapshot(manager)
    assert after.stats == before.stats
    assert after.tables == before.tables
    assert after.ref_counts == before.ref_counts
    assert after.free_extents == before.free_extents
    for pool_after, pool_before in zip(after.pools, before.pools, strict=True):
        assert np.array_equal(pool_after, pool_before)


class PagedCacheMachine(RuleBasedStateMachine):
    """Drives one manager; subclasses choose the pool layout."""

    kv_layout: ClassVar[str] = "NHD"
    placement: ClassVar[Placement] = "contiguous"

    def __init__(self) -> None:
        super().__init__()
        config = make_config(self.kv_layout)
        self.manager: Manager = (
            create_manager("numpy", config)
            if self.placement == "contiguous"
            else PagedKvCacheManager(NumpyStorage(config), backend="numpy", placement=self.placement)
        )
        self.model: dict[str, ModelRequest] = {}
        self.dead: list[Handle] = []
        self.allocation_count = 0
        self.allocation_failures = 0
        self.pressure_events: list[MemoryPressure] = []
        self.expected_pressure_events: list[MemoryPressure] = []
        self.last_pressure = MemoryPressure.LOW
        self.manager.set_pressure_callback(self.pressure_events.append)

    # -- model helpers -------------------------------------------------------------------

    def free_blocks(self) -> int:
        return NUM_BLOCKS - sum(request.blocks for request in self.model.values())

    def note_pressure(self) -> None:
        level = expected_pressure(NUM_BLOCKS - self.free_blocks())
        if level != self.last_pressure:
            self.expected_pressure_events.append(level)
            self.last_pressure = level

    def live_ids(self) -> list[str]:
        return sorted(self.model)

    def pick_live(self, data: st.DataObject) -> tuple[str, ModelRequest, Handle]:
        request_id = data.draw(st.sampled_from(self.live_ids()), label="request")
        request = self.model[request_id]
        handle = data.draw(st.sampled_from(request.handles), label="handle")
        return request_id, request, handle

    def slot_of(self, request_id: str, position: int) -> int:
        """The slot of token ``position``, from the request's block table."""
        blocks = self.model[request_id].handles[0].block_table().physical_blocks
        return blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    # -- life cycle ------------------------------------------------------------------------

    @rule(
        data=st.data(),
        request_id=st.sampled_from(REQUEST_IDS),
        initial_tokens=st.integers(0, 24),
        room=st.one_of(st.none(), st.integers(0, 24)),
        prefill=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def allocate(
        self, data: st.DataObject, request_id: str, initial_tokens: int, room: int | None, prefill: bool, seed: int
    ) -> None:
        """Allocate a request; with ``prefill``, also extend it over its initial tokens and
        write their K/V at once."""
        max_length = None if room is None else max(1, initial_tokens + room)
        request = AllocationRequest(request_id, initial_tokens=initial_tokens, max_sequence_length=max_length)
        needed = blocks_for(initial_tokens)
        if request_id in self.model:
            before = snapshot(self.manager)
            with pytest.raises(DuplicateRequestError):
                self.manager.allocate(request)
            assert_unchanged(self.manager, before)
            return
        if needed > self.free_blocks():
            before = snapshot(self.manager)
            with pytest.raises(OutOfBlocksError):
                self.manager.allocate(request)
            self.allocation_failures += 1
            assert_unchanged(self.manager, before)
            return
        handle = self.manager.allocate(request)
        self.allocation_count += 1
        assert handle.is_valid()
        assert handle.request_id == request_id
        assert handle.num_tokens() == 0
        assert handle.block_table().num_blocks() == needed
        assert handle.max_sequence_length == max_length
        self.model[request_id] = ModelRequest(
            handles=[handle],
            max_sequence_length=max_length,
            blocks=needed,
            keys=[empty_kv() for _ in range(NUM_LAYERS)],
            values=[empty_kv() for _ in range(NUM_LAYERS)],
        )
        self.note_pressure()
        if prefill and initial_tokens:
            slots = self.manager.extend(handle, initial_tokens)  # within the reserved blocks
            assert handle.block_table().num_blocks() == needed
            self.model[request_id].pending.extend(int(slot) for slot in slots)
            self.write_pending({request_id: initial_tokens}, seed, data)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), count=st.integers(0, 10))
    def extend(self, data: st.DataObject, count: int) -> None:
        request_id, request, handle = self.pick_live(data)
        old_length = request.length
        new_length = old_length + count
        limit = request.max_sequence_length
        if limit is not None and new_length > limit:
            before = snapshot(self.manager)
            with pytest.raises(SequenceTooLongError):
                self.manager.extend(handle, count)
            assert_unchanged(self.manager, before)
            return
        missing = max(0, blocks_for(new_length) - request.blocks)
        if missing > self.free_blocks():
            before = snapshot(self.manager)
            with pytest.raises(OutOfBlocksError):
                self.manager.extend(handle, count)
            self.allocation_failures += 1
            assert_unchanged(self.manager, before)
            return
        slots = self.manager.extend(handle, count)
        request.blocks += missing
        assert slots.dtype == np.int64
        assert slots.shape == (count,)
        assert [int(slot) for slot in slots] == [
            self.slot_of(request_id, position) for position in range(old_length, new_length)
        ]
        request.pending.extend(int(slot) for slot in slots)
        self.note_pressure()

    def write_pending(self, counts: dict[str, int], seed: int, data: st.DataObject) -> None:
        """Write the first ``counts[rid]`` pending tokens of each request: one ``write``
        per layer for all of them, the slots in a drawn order."""
        if not counts:
            return
        chosen = list(counts)
        slots = np.array([slot for rid in chosen for slot in self.model[rid].pending[: counts[rid]]], dtype=np.int64)
        order = np.array(data.draw(st.permutations(range(slots.size)), label="slot order"), dtype=np.int64)
        rng = np.random.default_rng(seed)
        for layer in range(NUM_LAYERS):
            keys, values = random_kv(rng, slots.size), random_kv(rng, slots.size)
            self.manager.write(layer, slots[order], keys[order], values[order])
            start = 0
            for rid in chosen:
                request, stop = self.model[rid], start + counts[rid]
                request.keys[layer] = np.concatenate([request.keys[layer], keys[start:stop]])
                request.values[layer] = np.concatenate([request.values[layer], values[start:stop]])
                start = stop
        for rid in chosen:
            del self.model[rid].pending[: counts[rid]]

    @precondition(lambda self: any(request.pending for request in self.model.values()))
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def write(self, data: st.DataObject, seed: int) -> None:
        """A batched write of the first pending tokens of several requests."""
        candidates = [rid for rid in self.live_ids() if self.model[rid].pending]
        chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, unique=True), label="requests")
        counts = {
            rid: data.draw(st.integers(1, len(self.model[rid].pending)), label=f"tokens of {rid}") for rid in chosen
        }
        self.write_pending(counts, seed, data)

    @precondition(lambda self: any(request.written for request in self.model.values()))
    @rule(data=st.data(), layer=st.integers(0, NUM_LAYERS - 1), seed=st.integers(0, 2**32 - 1))
    def rewrite(self, data: st.DataObject, layer: int, seed: int) -> None:
        """Overwrite some written tokens of one request in one layer."""
        request_id = data.draw(st.sampled_from([rid for rid in self.live_ids() if self.model[rid].written]))
        request = self.model[request_id]
        positions = data.draw(
            st.lists(st.integers(0, request.written - 1), min_size=1, max_size=6, unique=True), label="positions"
        )
        slots = np.array([self.slot_of(request_id, position) for position in positions], dtype=np.int64)
        rng = np.random.default_rng(seed)
        keys, values = random_kv(rng, len(positions)), random_kv(rng, len(positions))
        self.manager.write(layer, slots, keys, values)
        request.keys[layer][positions] = keys
        request.values[layer][positions] = values

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def clone_handle(self, data: st.DataObject) -> None:
        _, request, handle = self.pick_live(data)
        clone = handle.clone_handle()
        assert clone == handle
        assert clone is not handle
        assert clone.cache_id() == handle.cache_id()
        if len(request.handles) < MAX_HANDLES_PER_REQUEST:
            request.handles.append(clone)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def deallocate(self, data: st.DataObject) -> None:
        request_id, request, _ = self.pick_live(data)
        self.manager.deallocate(request_id)
        del self.model[request_id]
        assert self.manager.get_handle(request_id) is None
        for handle in request.handles:
            assert not handle.is_valid()
        self.dead = [*self.dead, *request.handles[:2]][-DEAD_HANDLES_KEPT:]
        self.note_pressure()

    # -- refusals --------------------------------------------------------------------------

    @rule(data=st.data(), extend_instead=st.booleans(), with_limit=st.booleans())
    def exhaust(self, data: st.DataObject, extend_instead: bool, with_limit: bool) -> None:
        """An allocate, or an extend, needing one block more than the pool has free."""
        unlimited = [rid for rid in self.live_ids() if self.model[rid].max_sequence_length is None]
        before = snapshot(self.manager)
        if extend_instead and unlimited:
            request = self.model[data.draw(st.sampled_from(unlimited), label="request")]
            handle = data.draw(st.sampled_from(request.handles), label="handle")
            room_in_blocks = request.blocks * BLOCK_SIZE - request.length
            with pytest.raises(OutOfBlocksError):
                self.manager.extend(handle, room_in_blocks + self.free_blocks() * BLOCK_SIZE + 1)
            self.allocation_failures += 1
        else:
            request_id = data.draw(st.sampled_from(REQUEST_IDS), label="request id")
            tokens = (self.free_blocks() + 1) * BLOCK_SIZE
            allocation = AllocationRequest(
                request_id, initial_tokens=tokens, max_sequence_length=tokens + 8 if with_limit else None
            )
            if request_id in self.model:  # a live id is refused before the pool is looked at
                with pytest.raises(DuplicateRequestError):
                    self.manager.allocate(allocation)
            else:
                with pytest.raises(OutOfBlocksError):
                    self.manager.allocate(allocation)
                self.allocation_failures += 1
                assert self.manager.get_handle(request_id) is None
        assert_unchanged(self.manager, before)

    # -- attention -------------------------------------------------------------------------

    def attendable(self) -> list[str]:
        return [rid for rid in self.live_ids() if self.model[rid].written and not self.model[rid].pending]

    def check_attention(
        self, layer: int, batch: list[str], query_counts: list[int], *, causal: bool, seed: int, data: st.DataObject
    ) -> None:
        """Paged attention over ``batch`` equals dense attention over the model's K/V."""
        rng = np.random.default_rng(seed)
        query = rng.standard_normal((sum(query_counts), NUM_HEADS * QUERY_GROUP, HEAD_DIM)).astype(np.float32)
        handles = [data.draw(st.sampled_from(self.model[rid].handles), label=f"handle of {rid}") for rid in batch]
        page_table = self.manager.page_table(handles)
        decode = all(count == 1 for count in query_counts) and data.draw(st.booleans(), label="omit qo_indptr")
        indptr = None if decode else np.concatenate([[0], np.cumsum(query_counts)]).astype(np.int32)
        output = self.manager.paged_attention(layer, query, page_table, qo_indptr=indptr, causal=causal)
        assert output.shape == query.shape
        assert output.dtype == np.float32
        start = 0
        for rid, count in zip(batch, query_counts, strict=True):
            request = self.model[rid]
            expected = dense_attention(
                query[start : start + count], request.keys[layer], request.values[layer], causal=causal
            )
            np.testing.assert_allclose(output[start : start + count], expected, rtol=1e-5, atol=1e-5)
            start += count

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), layer=st.integers(0, NUM_LAYERS - 1), seed=st.integers(0, 2**32 - 1))
    def decode_step(self, data: st.DataObject, layer: int, seed: int) -> None:
        """One decode step of a batch: extend each by one token, write the new K/V of all
        of them in one call per layer, attend with one query each."""
        ready = [
            rid
            for rid in self.live_ids()
            if (limit := self.model[rid].max_sequence_length) is None or self.model[rid].length < limit
        ]
        batch = data.draw(st.lists(st.sampled_from(ready), unique=True, max_size=4), label="batch") if ready else []
        for rid in batch:
            request = self.model[rid]
            missing = max(0, blocks_for(request.length + 1) - request.blocks)
            if missing > self.free_blocks():  # the pool is full: this one sits the step out
                before = snapshot(self.manager)
                with pytest.raises(OutOfBlocksError):
                    self.manager.extend(request.handles[0], 1)
                self.allocation_failures += 1
                assert_unchanged(self.manager, before)
                continue
            slots = self.manager.extend(request.handles[0], 1)
            request.blocks += missing
            request.pending.extend(int(slot) for slot in slots)
        self.note_pressure()
        self.write_pending({rid: len(self.model[rid].pending) for rid in batch if self.model[rid].pending}, seed, data)
        attendable = [rid for rid in batch if rid in self.attendable()]
        if attendable:
            self.check_attention(layer, attendable, [1] * len(attendable), causal=True, seed=seed, data=data)

    @precondition(lambda self: bool(self.attendable()))
    @rule(data=st.data(), layer=st.integers(0, NUM_LAYERS - 1), causal=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def attend(self, data: st.DataObject, layer: int, causal: bool, seed: int) -> None:
        """Prefill-shaped attention: several queries per request, causal or not."""
        batch = data.draw(st.lists(st.sampled_from(self.attendable()), min_size=1, unique=True), label="batch")
        query_counts = [
            data.draw(st.integers(1, min(3, self.model[rid].written)), label=f"queries of {rid}") for rid in batch
        ]
        self.check_attention(layer, batch, query_counts, causal=causal, seed=seed, data=data)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def records_are_consistent(self) -> None:
        self.manager.check_invariants()
        stats = self.manager.stats()
        assert stats.free_blocks + stats.used_blocks == stats.total_blocks == NUM_BLOCKS
        assert stats.free_blocks == self.free_blocks()
        assert stats.active_caches == len(self.model)
        assert stats.tokens_stored == sum(request.length for request in self.model.values())
        assert stats.allocation_count == self.allocation_count
        assert stats.allocation_failures == self.allocation_failures

    @invariant()
    def live_requests_match_the_model(self) -> None:
        assert sorted(rid for rid, _ in self.manager.list_handles()) == self.live_ids()
        for request_id, request in self.model.items():
            cache_ids = {handle.cache_id() for handle in request.handles}
            assert len(cache_ids) == 1
            for handle in request.handles:
                assert handle.is_valid()
                assert handle.request_id == request_id
                assert handle.num_tokens() == request.length
                table = handle.block_table()
                assert table.sequence_length == request.length
                assert table.num_blocks() == request.blocks

    @invariant()
    def gather_returns_what_was_written(self) -> None:
        for request_id, request in self.model.items():
            handle = request.handles[-1]
            for layer in range(NUM_LAYERS):
                keys, values = self.manager.gather(handle, layer)
                assert keys.shape == values.shape == (request.length, NUM_HEADS, HEAD_DIM), request_id
                assert np.array_equal(keys[: request.written], request.keys[layer]), request_id
                assert np.array_equal(values[: request.written], request.values[layer]), request_id

    @invariant()
    def pool_holds_written_tokens_in_its_layout(self) -> None:
        """``key_cache`` read through the documented layout holds each written token."""
        for request_id, request in self.model.items():
            if not request.written:
                continue
            slots = np.array([self.slot_of(request_id, p) for p in range(request.written)], dtype=np.int64)
            blocks, offsets = np.divmod(slots, BLOCK_SIZE)
            for layer in range(NUM_LAYERS):
                key_pool, value_pool = request.handles[0].kv_cache(layer)
                assert key_pool is not None
                assert value_pool is not None
                assert key_pool.shape == self.manager.config.block_shape()
                for pool, expected in ((key_pool, request.keys[layer]), (value_pool, request.values[layer])):
                    if self.kv_layout == "NHD":
                        tokens = pool[blocks, offsets]
                    elif self.kv_layout == "HND":
                        tokens = pool[blocks, :, offsets]
                    else:
                        tokens = pool[:, blocks, offsets].transpose(1, 0, 2)
                    assert np.array_equal(tokens, expected), (request_id, layer)

    @invariant()
    def deallocated_handles_stay_invalid(self) -> None:
        """Kept handles of deallocated requests refuse every use and change nothing,
        even after their id was allocated again."""
        if not self.dead:
            return
        before = snapshot(self.manager)
        for handle in self.dead:
            assert not handle.is_valid()
            assert handle.num_tokens() == 0
            with pytest.raises(InvalidHandleError):
                handle.key_cache(0)
            with pytest.raises(InvalidHandleError):
                self.manager.extend(handle, 1)
            with pytest.raises(InvalidHandleError):
                self.manager.gather(handle, NUM_LAYERS - 1)
            if handle.request_id not in self.model:
                with pytest.raises(UnknownRequestError):
                    self.manager.deallocate(handle.request_id)
        assert_unchanged(self.manager, before)

    @invariant()
    def pressure_follows_usage(self) -> None:
        assert self.manager.pressure == self.last_pressure
        assert self.pressure_events == self.expected_pressure_events


MACHINE_SETTINGS = settings(max_examples=80, stateful_step_count=50, deadline=None)


class NHDCacheMachine(PagedCacheMachine):
    kv_layout = "NHD"


class HNDCacheMachine(PagedCacheMachine):
    kv_layout = "HND"


class HeadsFirstCacheMachine(PagedCacheMachine):
    kv_layout = "heads_first"


class FifoPlacementCacheMachine(PagedCacheMachine):
    """Least-recently-freed placement scatters requests over many short runs, so
    attention reads many runs per request."""

    kv_layout = "HND"
    placement = "fifo"


TestNHDLayout = NHDCacheMachine.TestCase
TestNHDLayout.settings = MACHINE_SETTINGS
TestHNDLayout = HNDCacheMachine.TestCase
TestHNDLayout.settings = MACHINE_SETTINGS
TestHeadsFirstLayout = HeadsFirstCacheMachine.TestCase
TestHeadsFirstLayout.settings = MACHINE_SETTINGS
TestFifoPlacement = FifoPlacementCacheMachine.TestCase
TestFifoPlacement.settings = MACHINE_SETTINGS
