"""A Hypothesis state machine over the cache policies, against a pure-Python model.

Rules: allocate with a prompt (prefix hits) and prefill it, extend (with or without token
ids), write the pending tokens, rewrite written ones through ``writable_slots``, fork,
deallocate, swap out, swap in, exhaust the pool (an allocation that must evict cached
blocks, or one that must fail), ``gc`` and paged attention.

The model knows, for every live request, its tokens, the K/V of every written position,
which positions are pending, its held blocks (their identity is read from the manager
when they are new and checked never to be in use by anyone), the reference count of
every block, which blocks are hashed (the cacheability rule), every prefix ever cached
and every counter. K/V are a function of the salt and the token prefix where the token
ids are known (as a model computes them), random otherwise, so any prefix hit must read
exactly what recomputing would give. After every step: ``check_invariants()``, reference
counts, free + used + cached == total, every counter, every table, every request's K/V
bit for bit; prefix hits lie between what the model can prove cached and what it ever
cached. The machine runs once without a window (exact eviction and cache accounting) and
once with a sliding window and another layout, where attention is checked against dense
windowed attention over the whole history.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    create_manager,
)
from kvcache_core.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    OutOfBlocksError,
    SharedBlockWriteError,
)
from kvcache_core.testing.oracle import dense_attention

Array = npt.NDArray[Any]
Manager = PagedKvCacheManager[Array]
Handle = PagedKvCacheHandle[Array]

LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 2, 2, 4, 4, 24
QUERY_GROUP = 2
MAX_LENGTH = 28
REQUEST_IDS = tuple(f"r{index}" for index in range(6))
# Prompts share prefixes: base 1 starts like base 0 for two blocks, base 2 shares nothing.
BASES = (
    tuple(range(1, 1 + MAX_LENGTH)),
    (*range(1, 9), *range(200, 200 + MAX_LENGTH - 8)),
    tuple(range(500, 500 + MAX_LENGTH)),
)
SALTS = (None, b"tenant")
ALPHABET = (0, 1, 2)  # generated tokens: forks often generate the same ones


@functools.lru_cache(maxsize=65536)
def model_kv(salt: bytes | None, prefix: tuple[int, ...], layer: int) -> tuple[Array, Array]:
    """What a model computes for the last token of ``prefix``: a function of the prefix."""
    digest = hashlib.sha256(repr((salt, prefix, layer)).encode()).digest()
    pair = np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal((2, HEADS, DIM))
    return pair[0].astype(np.float32), pair[1].astype(np.float32)


def noise_kv(serial: int, position: int, version: int, layer: int) -> tuple[Array, Array]:
    """K/V of a token whose id is unknown: anything, distinct per request and write."""
    pair = np.random.default_rng([serial, position, version, layer]).standard_normal((2, HEADS, DIM))
    return pair[0].astype(np.float32), pair[1].astype(np.float32)


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


@dataclass
class ModelRequest:
    """What the model knows of one live request."""

    handle: Handle
    serial: int
    salt: bytes | None
    prompt: tuple[int, ...]
    tokens: list[int]  # ids known so far, positions 0 ..
    length: int = 0
    first_logical: int = 0
    blocks: list[int] = field(default_factory=list[int])  # held physical blocks
    kv: dict[int, list[tuple[Array, Array]]] = field(default_factory=dict[int, list[tuple[Array, Array]]])
    pending: list[int] = field(default_factory=list[int])  # positions handed out, not written
    versions: dict[int, int] = field(default_factory=dict[int, int])
    hashed: int = 0  # leading logical blocks hashed (cacheable): the request's hash chain
    registered_until: int = 0  # blocks past a chain a rewrite cut stay registered up to here
    dropped: set[int] = field(default_factory=set[int])  # logical blocks a rewrite took out of the cache
    chain_open: bool = True
    certain: bool = True  # False once the model cannot follow the manager's hash chain
    swapped_blocks: int | None = None  # blocks in host memory while swapped out

    @property
    def swapped(self) -> bool:
        return self.swapped_blocks is not None

    def slot(self, position: int) -> int:
        return self.blocks[position // BLOCK - self.first_logical] * BLOCK + position % BLOCK

    def held_tokens(self) -> int:
        return max(0, self.length - self.first_logical * BLOCK)

    def key(self, logical: int) -> tuple[bytes | None, tuple[int, ...]]:
        return (self.salt, tuple(self.tokens[: (logical + 1) * BLOCK]))


class PolicyMachine(RuleBasedStateMachine):
    kv_layout: ClassVar[str] = "NHD"
    window: ClassVar[int | None] = None

    def __init__(self) -> None:
        super().__init__()
        config = CacheConfig(
            num_layers=LAYERS,
            num_heads=HEADS,
            head_dim=DIM,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK,
            kv_layout=self.kv_layout,
            enable_prefix_caching=True,
            sliding_window=self.window,
        )
        self.manager: Manager = create_manager("numpy", config)
        self.model: dict[str, ModelRequest] = {}
        self.ever_hashed: set[tuple[bytes | None, tuple[int, ...]]] = set()
        self.serial = 0
        self.counters = Counter[str]()
        self.exact = self.window is None  # eviction and cache accounting are exact without a window

    # -- model helpers -------------------------------------------------------------------

    def resident(self) -> list[str]:
        return sorted(rid for rid, request in self.model.items() if not request.swapped)

    def in_use(self) -> Counter[int]:
        return Counter(block for request in self.model.values() if not request.swapped for block in request.blocks)

    def figures(self) -> tuple[int, int]:
        stats = self.manager.stats()
        return stats.free_blocks, stats.cached_blocks

    def window_start(self, length: int) -> int:
        if self.window is None or length < self.window:
            return 0
        return (length - self.window + 1) // BLOCK

    def advance(self, request: ModelRequest) -> None:
        """The cacheability rule: full, ids known, written in every layer, parent hashed."""
        while request.chain_open and not request.swapped:
            logical = request.hashed
            end = (logical + 1) * BLOCK
            if end > request.length or end > len(request.tokens):
                return
            if logical < request.first_logical:
                request.chain_open = False
                return
            if any(position not in request.kv for position in range(logical * BLOCK, end)):
                return
            self.ever_hashed.add(request.key(logical))
            request.hashed += 1

    def surely_cached(self) -> set[tuple[bytes | None, tuple[int, ...]]]:
        """Prefixes held, hashed, by a resident request the model follows exactly."""
        if not self.exact:
            return set()
        return {
            request.key(logical)
            for request in self.model.values()
            if request.certain and not request.swapped
            for logical in range(request.first_logical, request.hashed)
        }

    def registered(self, request: ModelRequest, logical: int) -> bool | None:
        """Whether the block of ``logical`` holds a cached prefix (None: unknown)."""
        if not (self.exact and request.certain):
            return None
        return logical < max(request.hashed, request.registered_until) and logical not in request.dropped

    def expected_kv(self, request: ModelRequest, position: int, layer: int) -> tuple[Array, Array]:
        if position < len(request.tokens):
            return model_kv(request.salt, tuple(request.tokens[: position + 1]), layer)
        return noise_kv(request.serial, position, request.versions.get(position, 0), layer)

    def release(self, request: ModelRequest, blocks: list[int], logicals: list[int]) -> None:
        """Account for a request dropping its reference on ``blocks``."""
        free, cached = self.figures()
        counts = self.in_use()
        to_cache = to_free = 0
        known = True
        for block, logical in zip(blocks, logicals, strict=True):
            if counts[block] == 1:
                registered = self.registered(request, logical)
                if registered is None:
                    known = False
                elif registered:
                    to_cache += 1
                else:
                    to_free += 1
        self.expect_after = (free + to_free, cached + to_cache) if known else None

    def take(self, needed: int, figures: tuple[int, int], revived: int = 0) -> None:
        """Account for taking ``needed`` blocks from a pool of ``(free, cached)`` blocks,
        evicting the oldest cached ones when the free ones run out."""
        free, cached = figures
        evictions = max(0, needed - free)
        self.counters["evictions"] += evictions
        self.expect_after = (free + evictions - needed, cached - revived - evictions) if self.exact else None

    def advance_all(self) -> None:
        """The manager advances every chain whose next block becomes cacheable."""
        for request in self.model.values():
            self.advance(request)

    def check_accounting(self) -> None:
        expected = getattr(self, "expect_after", None)
        self.expect_after = None
        if expected is not None:
            assert self.figures() == expected

    def refused(self, error: type[Exception], call: Any) -> None:
        """``call`` raises ``error`` and changes nothing."""
        before = self.snapshot()
        with pytest.raises(error):
            call()
        assert self.snapshot() == before

    def snapshot(self) -> tuple[object, ...]:
        stats = dataclasses.asdict(self.manager.stats())
        del stats["allocation_failures"]
        allocator = self.manager.allocator
        return (
            stats,
            [(rid, h.block_table().to_dict(), h.is_swapped_out()) for rid, h in self.manager.list_handles()],
            [allocator.ref_count(block) for block in range(NUM_BLOCKS)],
            allocator.cached_blocks(),
            allocator.free_blocks(),
            [np.ascontiguousarray(self.manager.storage.key_cache(layer)).tobytes() for layer in range(LAYERS)],
        )

    def write_positions(self, request: ModelRequest, positions: list[int], slots: npt.NDArray[np.int64]) -> None:
        for layer in range(LAYERS):
            pairs = [self.expected_kv(request, position, layer) for position in positions]
            keys = np.stack([pair[0] for pair in pairs])
            values = np.stack([pair[1] for pair in pairs])
            self.manager.write(layer, slots, keys, values)
        for position in positions:
            request.kv[position] = [self.expected_kv(request, position, layer) for layer in range(LAYERS)]

    def copy_on_write(self, request: ModelRequest, logicals: list[int], table_blocks: tuple[int, ...]) -> None:
        """The manager gave ``request`` private copies of the shared blocks ``logicals``."""
        counts = self.in_use()
        for logical in logicals:
            index = logical - request.first_logical
            copy = table_blocks[index]
            assert copy != request.blocks[index]
            assert counts[copy] == 0, f"copy-on-write into block {copy}, which is in use"
            request.blocks[index] = copy
        self.counters["copies"] += len(logicals)

    def shared_logicals(self, request: ModelRequest, start: int, stop: int) -> list[int]:
        if stop <= start:
            return []
        counts = self.in_use()
        first = max(start // BLOCK, request.first_logical)
        last = min(blocks_for(stop), request.first_logical + len(request.blocks))
        return [
            logical for logical in range(first, last) if counts[request.blocks[logical - request.first_logical]] > 1
        ]

    # -- life cycle ------------------------------------------------------------------------

    @rule(
        request_id=st.sampled_from(REQUEST_IDS),
        base=st.integers(0, len(BASES) - 1),
        prompt_length=st.integers(0, 18),
        salt=st.sampled_from(SALTS),
        extra=st.integers(0, 6),
        prefill=st.booleans(),
    )
    def allocate(
        self, request_id: str, base: int, prompt_length: int, salt: bytes | None, extra: int, prefill: bool
    ) -> None:
        prompt = BASES[base][:prompt_length]
        allocation = AllocationRequest(
            request_id,
            initial_tokens=prompt_length + extra,
            prompt_token_ids=prompt or None,
            cache_salt=salt,
        )
        if request_id in self.model:
            self.refused(DuplicateRequestError, lambda: self.manager.allocate(allocation))
            return
        if not self.manager.can_allocate(allocation):
            self.refused(OutOfBlocksError, lambda: self.manager.allocate(allocation))
            self.counters["failures"] += 1
            return
        counts = self.in_use()
        free, cached = self.figures()
        handle = self.manager.allocate(allocation)
        self.counters["allocations"] += 1
        cached_tokens = handle.num_cached_tokens()
        hits = cached_tokens // BLOCK
        assert cached_tokens % BLOCK == 0
        assert handle.num_tokens() == cached_tokens
        queries = max(0, (prompt_length - 1) // BLOCK)
        self.counters["queries"] += queries
        self.counters["hits"] += hits
        keys = [(salt, tuple(prompt[: (i + 1) * BLOCK])) for i in range(queries)]
        upper = next((i for i, key in enumerate(keys) if key not in self.ever_hashed), queries)
        surely = self.surely_cached()
        lower = next((i for i, key in enumerate(keys) if key not in surely), queries)
        assert lower <= hits <= upper, (lower, hits, upper)

        self.serial += 1
        request = ModelRequest(handle, self.serial, salt, prompt, list(prompt), length=cached_tokens)
        table = handle.block_table()
        request.first_logical = min(hits, self.window_start(cached_tokens))
        assert table.first_logical == request.first_logical
        request.blocks = list(table.physical_blocks)
        mapped = hits - request.first_logical
        assert all(counts[block] == 0 for block in request.blocks[mapped:]), "a new block was in use"
        revived = sum(1 for block in request.blocks[:mapped] if counts[block] == 0)
        new_blocks = max(hits, blocks_for(prompt_length + extra)) - hits
        assert len(request.blocks) == mapped + new_blocks
        for position in range(cached_tokens):
            request.kv[position] = [model_kv(salt, prompt[: position + 1], layer) for layer in range(LAYERS)]
        request.hashed = hits
        self.model[request_id] = request
        self.take(new_blocks, (free, cached), revived)
        self.check_accounting()
        if prefill and prompt_length > cached_tokens:
            self.do_extend(request_id, prompt_length - cached_tokens, None)
            self.do_write(request_id)

    def do_extend(self, request_id: str, count: int, token_ids: list[int] | None) -> None:
        request = self.model[request_id]
        start, stop = request.length, request.length + count
        self.advance(request)
        released = 0
        if count:
            released = max(
                0,
                min(self.window_start(start), request.first_logical + len(request.blocks)) - request.first_logical,
            )
        counts = self.in_use()
        freed = sum(1 for block in request.blocks[:released] if counts[block] == 1)
        copies = self.shared_logicals(request, start, stop)
        missing = max(0, blocks_for(stop) - request.first_logical - len(request.blocks))
        free, cached = self.figures()
        if missing + len(copies) > free + cached + freed:
            self.refused(OutOfBlocksError, lambda: self.manager.extend(request.handle, count, token_ids=token_ids))
            self.counters["failures"] += 1
            return
        slots = self.manager.extend(request.handle, count, token_ids=token_ids)
        table = request.handle.block_table()
        if released:
            request.first_logical += released
            del request.blocks[:released]
            if request.hashed < request.first_logical:
                request.chain_open = False
            # Positions handed out but never written before their block was released are lost.
            request.pending = [p for p in request.pending if p >= request.first_logical * BLOCK]
        assert table.first_logical == request.first_logical
        self.copy_on_write(request, copies, table.physical_blocks)
        counts_after_release = self.in_use()
        new = list(table.physical_blocks[len(request.blocks) :])
        assert len(new) == missing
        assert all(counts_after_release[block] == 0 for block in new), "a new block was in use"
        request.blocks.extend(new)
        if token_ids is not None:
            request.tokens.extend(token_ids[len(request.tokens) - start :])
        request.length = stop
        request.pending.extend(range(start, stop))
        assert slots.tolist() == [request.slot(position) for position in range(start, stop)]
        if self.exact:  # no window: nothing was released
            self.take(missing + len(copies), (free, cached))
        self.advance_all()
        self.check_accounting()

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data(), count=st.integers(0, 6), with_ids=st.booleans())
    def extend(self, data: st.DataObject, count: int, with_ids: bool) -> None:
        request_id = data.draw(st.sampled_from(self.resident()), label="request")
        request = self.model[request_id]
        count = min(count, MAX_LENGTH - request.length)
        token_ids = None
        if with_ids:
            if len(request.tokens) < request.length:
                self.refused(InvalidArgumentError, lambda: self.manager.extend(request.handle, 1, token_ids=[0]))
                return
            known = request.tokens[request.length : request.length + count]
            fresh = data.draw(
                st.lists(st.sampled_from(ALPHABET), min_size=count - len(known), max_size=count - len(known))
            )
            token_ids = [*known, *fresh]
        self.do_extend(request_id, count, token_ids)

    def do_write(self, request_id: str) -> None:
        request = self.model[request_id]
        positions = list(request.pending)
        if not positions:
            return
        slots = np.array([request.slot(position) for position in positions], dtype=np.int64)
        copies = self.shared_logicals(request, positions[0], positions[-1] + 1)
        if copies:  # slots handed out before a fork: refused, then made private
            keys = np.zeros((len(positions), HEADS, DIM), np.float32)
            self.refused(SharedBlockWriteError, lambda: self.manager.write(0, slots, keys, keys))
            free, cached = self.figures()
            if len(copies) > free + cached:
                self.refused(
                    OutOfBlocksError,
                    lambda: self.manager.writable_slots(request.handle, positions[0], positions[-1] + 1),
                )
                self.counters["failures"] += 1
                return
            slots = self.manager.writable_slots(request.handle, positions[0], positions[-1] + 1)
            self.copy_on_write(request, copies, request.handle.block_table().physical_blocks)
            self.take(len(copies), (free, cached))
            self.check_accounting()
            assert slots.tolist() == [request.slot(position) for position in positions]
        self.write_positions(request, positions, slots)
        request.pending.clear()
        self.advance_all()

    @precondition(lambda self: any(self.model[rid].pending for rid in self.resident()))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        candidates = [rid for rid in self.resident() if self.model[rid].pending]
        self.do_write(data.draw(st.sampled_from(candidates), label="request"))

    @precondition(lambda self: any(self.model[rid].kv for rid in self.resident()))
    @rule(data=st.data())
    def rewrite(self, data: st.DataObject) -> None:
        """Rewrite written tokens through writable_slots: shared blocks are copied first."""
        candidates = [
            rid
            for rid in self.resident()
            if any(p >= self.model[rid].first_logical * BLOCK for p in self.model[rid].kv)
            and not self.model[rid].pending
        ]
        if not candidates:
            return
        request = self.model[data.draw(st.sampled_from(candidates), label="request")]
        low = request.first_logical * BLOCK
        start = data.draw(st.integers(low, request.length - 1), label="start")
        stop = data.draw(st.integers(start + 1, request.length), label="stop")
        copies = self.shared_logicals(request, start, stop)
        free, cached = self.figures()
        if len(copies) > free + cached:
            self.refused(OutOfBlocksError, lambda: self.manager.writable_slots(request.handle, start, stop))
            self.counters["failures"] += 1
            return
        slots = self.manager.writable_slots(request.handle, start, stop)
        self.copy_on_write(request, copies, request.handle.block_table().physical_blocks)
        self.take(len(copies), (free, cached))
        self.check_accounting()
        # A cached block is immutable: the rewritten ones leave the prefix cache, and the
        # request's chain stops before the first of them (later ones stay registered).
        first = max(start // BLOCK, request.first_logical)
        last = min(blocks_for(stop), max(request.hashed, request.registered_until))
        request.dropped.update(range(first, last))
        if first < request.hashed:
            request.registered_until = max(request.registered_until, request.hashed)
            request.hashed = first
            request.chain_open = False
        for position in range(start, stop):
            if position >= len(request.tokens):  # unknown ids: new noise; known ids: the same K/V again
                request.versions[position] = request.versions.get(position, 0) + 1
        self.write_positions(request, list(range(start, stop)), slots)

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data(), new_id=st.sampled_from(REQUEST_IDS))
    def fork(self, data: st.DataObject, new_id: str) -> None:
        parent = self.model[data.draw(st.sampled_from(self.resident()), label="parent")]
        if new_id in self.model:
            self.refused(DuplicateRequestError, lambda: self.manager.fork(parent.handle, new_id))
            return
        figures = self.figures()
        child_handle = self.manager.fork(parent.handle, new_id)
        self.serial += 1
        shared = parent.blocks[: blocks_for(parent.held_tokens())]
        child = ModelRequest(
            child_handle,
            self.serial,
            parent.salt,
            parent.prompt,
            list(parent.tokens),
            length=parent.length,
            first_logical=parent.first_logical,
            blocks=list(shared),
            kv=dict(parent.kv),
            pending=list(parent.pending),
            versions=dict(parent.versions),
            hashed=parent.hashed,
            registered_until=parent.registered_until,
            dropped=set(parent.dropped),
            chain_open=parent.chain_open,
            certain=parent.certain,
        )
        self.model[new_id] = child
        assert child_handle.block_table().physical_blocks == tuple(shared)
        assert self.figures() == figures

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def deallocate(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model)), label="request")
        request = self.model[request_id]
        if request.swapped:
            self.expect_after = self.figures()
        else:
            self.release(
                request, request.blocks, list(range(request.first_logical, request.first_logical + len(request.blocks)))
            )
        self.manager.deallocate(request_id)
        del self.model[request_id]
        assert not request.handle.is_valid()
        self.check_accounting()

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        request = self.model[data.draw(st.sampled_from(self.resident()), label="request")]
        self.advance(request)
        self.release(
            request, request.blocks, list(range(request.first_logical, request.first_logical + len(request.blocks)))
        )
        self.manager.swap_out(request.handle.request_id)
        request.swapped_blocks = blocks_for(request.held_tokens())
        request.blocks = []
        assert request.handle.is_swapped_out()
        assert request.handle.is_valid()
        self.check_accounting()

    @precondition(lambda self: any(request.swapped for request in self.model.values()))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(r for r, q in self.model.items() if q.swapped)), label="request")
        request = self.model[request_id]
        needed = request.swapped_blocks
        assert needed is not None
        free, cached = self.figures()
        if needed > free + cached:
            self.refused(OutOfBlocksError, lambda: self.manager.swap_in(request_id))
            self.counters["failures"] += 1
            return
        counts = self.in_use()
        self.take(needed, (free, cached))
        self.manager.swap_in(request_id)
        table = request.handle.block_table()
        request.blocks = list(table.physical_blocks)
        request.swapped_blocks = None
        assert len(request.blocks) == needed
        assert all(counts[block] == 0 for block in request.blocks)
        assert table.first_logical == request.first_logical
        request.certain = False  # re-registration may stop where entries were evicted meanwhile
        self.check_accounting()
        self.advance_all()

    @rule(data=st.data(), fail=st.booleans(), request_id=st.sampled_from(REQUEST_IDS))
    def exhaust(self, data: st.DataObject, fail: bool, request_id: str) -> None:
        """An allocation past the free blocks: it evicts cached blocks, or it fails."""
        if request_id in self.model:
            return
        free, cached = self.figures()
        if fail or not cached:
            allocation = AllocationRequest(request_id, initial_tokens=(free + cached + 1) * BLOCK)
            self.refused(OutOfBlocksError, lambda: self.manager.allocate(allocation))
            self.counters["failures"] += 1
            return
        extra = data.draw(st.integers(1, cached), label="evictions")
        before = self.manager.stats().eviction_count
        handle = self.manager.allocate(AllocationRequest(request_id, initial_tokens=(free + extra) * BLOCK))
        self.counters["allocations"] += 1
        assert self.manager.stats().eviction_count - before == extra
        self.counters["evictions"] += extra
        counts = self.in_use()
        blocks = list(handle.block_table().physical_blocks)
        assert all(counts[block] == 0 for block in blocks)
        self.serial += 1
        self.model[request_id] = ModelRequest(handle, self.serial, None, (), [], blocks=blocks)
        assert self.figures() == (0, cached - extra)

    @rule()
    def gc(self) -> None:
        free, cached = self.figures()
        report = self.manager.gc()
        assert report.blocks_freed == cached
        assert report.memory_freed == cached * self.manager.config.bytes_per_block
        self.counters["evictions"] += cached
        assert self.figures() == (free + cached, 0)

    def attendable_queries(self, request: ModelRequest) -> int:
        """Queries whose whole window is held: with a window, the manager keeps what the
        tokens of the latest extend can see; earlier tokens' windows may be released."""
        if request.pending or not request.held_tokens():
            return 0
        earliest = request.first_logical * BLOCK + (self.window or 1) - 1 if request.first_logical else 0
        return min(3, request.length - earliest)

    @precondition(lambda self: any(self.attendable_queries(self.model[r]) for r in self.resident()))
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), causal=st.booleans(), seed=st.integers(0, 2**16))
    def attend(self, data: st.DataObject, layer: int, causal: bool, seed: int) -> None:
        ready = [r for r in self.resident() if self.attendable_queries(self.model[r])]
        batch = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True), label="batch")
        counts = [
            data.draw(st.integers(1, self.attendable_queries(self.model[r])), label=f"queries of {r}") for r in batch
        ]
        rng = np.random.default_rng(seed)
        query = rng.standard_normal((sum(counts), HEADS * QUERY_GROUP, DIM)).astype(np.float32)
        page_table = self.manager.page_table([self.model[r].handle for r in batch])
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        output = self.manager.paged_attention(layer, query, page_table, qo_indptr=indptr, causal=causal)
        start = 0
        for rid, count in zip(batch, counts, strict=True):
            request = self.model[rid]
            first_held = request.first_logical * BLOCK
            if self.window is not None:  # the window of the first query row is held
                assert request.length - count - self.window + 1 >= first_held or first_held == 0
            held = range(first_held, request.length)
            keys = np.stack([request.kv[position][layer][0] for position in held])
            values = np.stack([request.kv[position][layer][1] for position in held])
            expected = dense_attention(
                query[start : start + count],
                keys,
                values,
                causal=causal,
                sliding_window=self.window,
                key_start=first_held,
            )
            np.testing.assert_allclose(output[start : start + count], expected, rtol=1e-4, atol=1e-5)
            start += count

    def teardown(self) -> None:
        """Label the run, so that ``--hypothesis-show-statistics`` shows what was exercised."""
        stats = self.manager.stats()
        for name, value in (
            ("prefix hits", stats.prefix_cache_hits),
            ("copies on write", stats.copy_on_write_count),
            ("evictions", stats.eviction_count),
            ("swapped out at the end", stats.swapped_out_requests),
            ("released by the window", sum(r.first_logical for r in self.model.values())),
        ):
            event(f"{name}: {'some' if value else 'none'}")

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def records_match_the_model(self) -> None:
        self.advance_all()
        self.manager.check_invariants()
        stats = self.manager.stats()
        counts = self.in_use()
        assert stats.free_blocks + stats.used_blocks + stats.cached_blocks == NUM_BLOCKS
        assert stats.used_blocks == len(counts)
        allocator = self.manager.allocator
        assert [allocator.ref_count(block) for block in range(NUM_BLOCKS)] == [counts[b] for b in range(NUM_BLOCKS)]
        assert stats.active_caches == len(self.model)
        swapped = [request for request in self.model.values() if request.swapped]
        assert stats.swapped_out_requests == len(swapped)
        assert stats.swapped_out_blocks == sum(request.swapped_blocks or 0 for request in swapped)
        assert stats.tokens_stored == sum(r.held_tokens() for r in self.model.values() if not r.swapped)
        assert stats.allocation_count == self.counters["allocations"]
        assert stats.allocation_failures == self.counters["failures"]
        assert stats.prefix_cache_queries == self.counters["queries"]
        assert stats.prefix_cache_hits == self.counters["hits"]
        assert stats.copy_on_write_count == self.counters["copies"]
        if self.exact:
            assert stats.eviction_count == self.counters["evictions"]
        assert stats.hash_collisions == 0

    @invariant()
    def every_request_holds_its_tokens(self) -> None:
        for request_id, request in self.model.items():
            handle = request.handle
            assert handle.is_valid()
            assert handle.is_swapped_out() == request.swapped
            if request.swapped:
                assert handle.num_tokens() == 0
                continue
            table = handle.block_table()
            assert table.sequence_length == request.length, request_id
            assert table.first_logical == request.first_logical, request_id
            assert list(table.physical_blocks) == request.blocks, request_id
            if self.window is not None:
                assert table.first_logical <= self.window_start(request.length)
            low = request.first_logical * BLOCK
            for layer in range(LAYERS):
                keys, values = self.manager.gather(handle, layer)
                assert keys.shape[0] == request.length - low
                for position, pairs in request.kv.items():
                    if position >= low:
                        assert np.array_equal(keys[position - low], pairs[layer][0]), (request_id, position, layer)
                        assert np.array_equal(values[position - low], pairs[layer][1]), (request_id, position, layer)


MACHINE_SETTINGS = settings(max_examples=300, stateful_step_count=60, deadline=None)


class PrefixForkSwapMachine(PolicyMachine):
    kv_layout = "NHD"
    window = None


class WindowedMachine(PolicyMachine):
    kv_layout = "heads_first"
    window = 6


TestPrefixForkSwap = PrefixForkSwapMachine.TestCase
TestPrefixForkSwap.settings = MACHINE_SETTINGS
TestWindowed = WindowedMachine.TestCase
TestWindowed.settings = MACHINE_SETTINGS
