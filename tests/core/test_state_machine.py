"""One Hypothesis state machine over the manager's life cycle and its policies, against a
pure-Python model; a policies switch says which policies a run has on.

Rules: allocate (with a prompt, prefix hits, a ``max_sequence_length``) and prefill it,
extend (with or without token ids), write the pending tokens of several requests in one
call per layer in any slot order, rewrite written ones (directly, or through
``writable_slots`` where blocks can be shared or cached), clone a handle, fork,
deallocate, swap out, swap in, exhaust the pool (an allocate or an extend that must fail,
or one that must evict cached blocks), ``gc``, a batched decode step and paged attention.
Every refusal (``OutOfBlocksError``, ``SequenceTooLongError``, a duplicate id, ...) is
checked to change nothing.

The model knows, for every live request, its tokens, the K/V of every written position,
which positions are pending, its held blocks (their identity is read from the manager
when they are new and checked never to be in use by anyone), the reference count of
every block, which blocks are hashed (the cacheability rule), every prefix ever cached
and every counter. K/V are a function of the salt and the token prefix where the token
ids are known (as a model computes them), distinct noise otherwise, so any prefix hit
must read exactly what recomputing would give. After every step: ``check_invariants()``,
reference counts, free + used + cached == total, every counter, every table, every
request's K/V bit for bit (gathered, and read from the pool through its layout), handle
validity (deallocated handles refuse every use), memory-pressure events; prefix hits lie
between what the model can prove cached and what it ever cached; paged attention equals
the kit's dense oracle over the model's K/V.

Runs: no policies, once per pool layout and once with the allocator's "fifo" placement
(scattered block tables: attention reads many runs per request); prefix caching, fork,
swap and eviction (exact eviction and cache accounting); and all of them with a sliding
window in another layout.
"""

from __future__ import annotations

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
    MemoryPressure,
)
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidHandleError,
    OutOfBlocksError,
    SequenceTooLongError,
    SharedBlockWriteError,
    UnknownRequestError,
)
from kvcache_core.paging.allocator import Placement
from kvcache_core.testing import inspect
from kvcache_core.testing.oracle import dense_attention
from kvcache_core.testing.world import assert_same_state, snapshot
from tests.core.support import Array, Handle, Manager, make_manager
from tests.sizes import sized

LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 2, 2, 4, 4, 24
QUERY_GROUP = 2  # query heads per KV head in the attention checks (GQA)
WINDOW = 6  # the sliding window of the runs with "sliding_window" on
MAX_LENGTH = 28  # with prefix caching: the prompts' bases hold this many ids
REQUEST_IDS = tuple(f"r{index}" for index in range(6))
MAX_HANDLES_PER_REQUEST = 3
DEAD_HANDLES_KEPT = 4
# Prompts share prefixes: base 1 starts like base 0 for two blocks, base 2 shares nothing.
BASES = (
    tuple(range(1, 1 + MAX_LENGTH)),
    (*range(1, 9), *range(200, 200 + MAX_LENGTH - 8)),
    tuple(range(500, 500 + MAX_LENGTH)),
)
SALTS = (None, b"tenant")
ALPHABET = (0, 1, 2)  # generated tokens: forks often generate the same ones
ALL_POLICIES = frozenset({"eviction", "fork", "prefix_caching", "swap"})


@functools.lru_cache(maxsize=65536)
def model_kv(salt: bytes | None, prefix: tuple[int, ...], layer: int) -> tuple[Array, Array]:
    """What a model computes for the last token of ``prefix``: a function of the prefix."""
    digest = hashlib.sha256(repr((salt, prefix, layer)).encode()).digest()
    pair = np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal((2, HEADS, DIM))
    return pair[0].astype(np.float32), pair[1].astype(np.float32)


def noise_kv(serial: int, position: int, version: int, layer: int) -> tuple[Array, Array]:
    """K/V of a token whose id is unknown: anything, distinct per request, position and write."""
    pair = np.random.default_rng([serial, position, version, layer]).standard_normal((2, HEADS, DIM))
    return pair[0].astype(np.float32), pair[1].astype(np.float32)


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


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


@dataclass
class ModelRequest:
    """What the model knows of one live request."""

    handles: list[Handle]  # the first one and clones of it
    serial: int
    salt: bytes | None
    prompt: tuple[int, ...]
    tokens: list[int]  # ids known so far, positions 0 ..
    max_length: int | None = None
    length: int = 0
    first_logical: int = 0
    blocks: list[int] = field(default_factory=list[int])  # held physical blocks
    kv: dict[int, list[tuple[Array, Array]]] = field(default_factory=dict[int, list[tuple[Array, Array]]])
    pending: list[int] = field(default_factory=list[int])  # positions handed out, not written
    versions: dict[tuple[int, int], int] = field(default_factory=dict[tuple[int, int], int])  # (position, layer)
    hashed: int = 0  # leading logical blocks hashed (cacheable): the request's hash chain
    registered_until: int = 0  # blocks past a chain a rewrite cut stay registered up to here
    dropped: set[int] = field(default_factory=set[int])  # logical blocks a rewrite took out of the cache
    chain_open: bool = True
    certain: bool = True  # False once the model cannot follow the manager's hash chain
    swapped_blocks: int | None = None  # blocks in host memory while swapped out

    @property
    def handle(self) -> Handle:
        return self.handles[0]

    @property
    def swapped(self) -> bool:
        return self.swapped_blocks is not None

    def slot(self, position: int) -> int:
        return self.blocks[position // BLOCK - self.first_logical] * BLOCK + position % BLOCK

    def held_tokens(self) -> int:
        return max(0, self.length - self.first_logical * BLOCK)

    def key(self, logical: int) -> tuple[bytes | None, tuple[int, ...]]:
        return (self.salt, tuple(self.tokens[: (logical + 1) * BLOCK]))


class CacheMachine(RuleBasedStateMachine):
    """Drives one manager; subclasses choose the policies, the pool layout and the placement."""

    policies: ClassVar[frozenset[str]] = frozenset()
    kv_layout: ClassVar[str] = "NHD"
    placement: ClassVar[Placement] = "contiguous"

    def __init__(self) -> None:
        super().__init__()
        self.caching = "prefix_caching" in self.policies
        self.window = WINDOW if "sliding_window" in self.policies else None
        self.manager: Manager = make_manager(
            NUM_BLOCKS,
            BLOCK,
            num_layers=LAYERS,
            num_heads=HEADS,
            head_dim=DIM,
            kv_layout=self.kv_layout,
            enable_prefix_caching=self.caching,
            sliding_window=self.window,
            placement=self.placement,
            storage=None if self.placement == "contiguous" else NumpyStorage,
        )
        self.model: dict[str, ModelRequest] = {}
        self.dead: list[Handle] = []
        self.ever_hashed: set[tuple[bytes | None, tuple[int, ...]]] = set()
        self.serial = 0
        self.counters = Counter[str]()
        self.exact = self.window is None  # eviction and cache accounting are exact without a window
        self.expect_after: tuple[int, int] | None = None
        self.pressure_events: list[MemoryPressure] = []
        self.expected_pressure_events: list[MemoryPressure] = []
        self.last_pressure = MemoryPressure.LOW
        self.manager.set_pressure_callback(self.pressure_events.append)

    # -- model helpers -------------------------------------------------------------------

    def resident(self) -> list[str]:
        return sorted(rid for rid, request in self.model.items() if not request.swapped)

    def in_use(self) -> Counter[int]:
        return Counter(block for request in self.model.values() if not request.swapped for block in request.blocks)

    def figures(self) -> tuple[int, int]:
        stats = self.manager.stats()
        return stats.free_blocks, stats.cached_blocks

    def note_pressure(self) -> None:
        """The manager fires the callback on each change of level: follow the model's usage."""
        level = expected_pressure(len(self.in_use()))
        if level != self.last_pressure:
            self.expected_pressure_events.append(level)
            self.last_pressure = level

    def window_start(self, length: int) -> int:
        if self.window is None or length < self.window:
            return 0
        return (length - self.window + 1) // BLOCK

    def advance(self, request: ModelRequest) -> None:
        """The cacheability rule: full, ids known, written in every layer, parent hashed."""
        while self.caching and request.chain_open and not request.swapped:
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

    def advance_all(self) -> None:
        """The manager advances every chain whose next block becomes cacheable."""
        for request in self.model.values():
            self.advance(request)

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
        return noise_kv(request.serial, position, request.versions.get((position, layer), 0), layer)

    def release(self, request: ModelRequest) -> None:
        """Account for a request dropping its reference on all its blocks."""
        free, cached = self.figures()
        counts = self.in_use()
        to_cache = to_free = 0
        known = True
        for index, block in enumerate(request.blocks):
            if counts[block] == 1:
                registered = self.registered(request, request.first_logical + index)
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

    def check_accounting(self) -> None:
        expected = self.expect_after
        self.expect_after = None
        if expected is not None:
            assert self.figures() == expected

    def refused(self, error: type[Exception], call: Any) -> None:
        """``call`` raises ``error`` and changes nothing."""
        before = snapshot(self.manager)
        with pytest.raises(error):
            call()
        self.manager.check_invariants()
        assert_same_state(snapshot(self.manager), before)

    def refused_for_room(self, call: Any) -> None:
        """``call`` runs out of blocks, changes nothing, and is counted."""
        self.refused(OutOfBlocksError, call)
        self.counters["failures"] += 1

    def pick_handle(self, data: st.DataObject, request: ModelRequest) -> Handle:
        return data.draw(st.sampled_from(request.handles), label="handle")

    def write_kv(self, layer: int, slots: npt.NDArray[np.int64], pairs: list[tuple[Array, Array]]) -> None:
        self.manager.write(layer, slots, np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]))

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
        room=st.one_of(st.none(), st.integers(0, 24)),
        prefill=st.booleans(),
    )
    def allocate(
        self,
        request_id: str,
        base: int,
        prompt_length: int,
        salt: bytes | None,
        extra: int,
        room: int | None,
        prefill: bool,
    ) -> None:
        """Allocate a request (with prefix caching, from a prompt); with ``prefill``, also
        extend it over its prompt and write the prompt's K/V at once."""
        prompt = BASES[base][:prompt_length] if self.caching else ()
        salt = salt if self.caching else None
        initial = prompt_length + extra
        max_length = None if room is None else max(1, initial + room)
        allocation = AllocationRequest(
            request_id,
            initial_tokens=initial,
            max_sequence_length=max_length,
            prompt_token_ids=prompt or None,
            cache_salt=salt,
        )
        if request_id in self.model:
            self.refused(DuplicateRequestError, lambda: self.manager.allocate(allocation))
            return
        if not self.manager.can_allocate(allocation):
            self.refused_for_room(lambda: self.manager.allocate(allocation))
            return
        counts = self.in_use()
        free, cached = self.figures()
        handle = self.manager.allocate(allocation)
        self.counters["allocations"] += 1
        assert handle.is_valid()
        assert handle.request_id == request_id
        assert handle.max_sequence_length == max_length
        cached_tokens = handle.num_cached_tokens()
        hits = cached_tokens // BLOCK
        assert cached_tokens % BLOCK == 0
        assert handle.num_tokens() == cached_tokens
        queries = max(0, (len(prompt) - 1) // BLOCK)
        self.counters["queries"] += queries
        self.counters["hits"] += hits
        keys = [(salt, tuple(prompt[: (i + 1) * BLOCK])) for i in range(queries)]
        upper = next((i for i, key in enumerate(keys) if key not in self.ever_hashed), queries)
        surely = self.surely_cached()
        lower = next((i for i, key in enumerate(keys) if key not in surely), queries)
        assert lower <= hits <= upper, (lower, hits, upper)

        self.serial += 1
        request = ModelRequest([handle], self.serial, salt, prompt, list(prompt), max_length, length=cached_tokens)
        table = handle.block_table()
        request.first_logical = min(hits, self.window_start(cached_tokens))
        assert table.first_logical == request.first_logical
        request.blocks = list(table.physical_blocks)
        mapped = hits - request.first_logical
        assert all(counts[block] == 0 for block in request.blocks[mapped:]), "a new block was in use"
        revived = sum(1 for block in request.blocks[:mapped] if counts[block] == 0)
        new_blocks = max(hits, blocks_for(initial)) - hits
        assert len(request.blocks) == mapped + new_blocks
        for position in range(cached_tokens):
            request.kv[position] = [model_kv(salt, prompt[: position + 1], layer) for layer in range(LAYERS)]
        request.hashed = hits
        self.model[request_id] = request
        self.take(new_blocks, (free, cached), revived)
        self.check_accounting()
        self.note_pressure()
        if prefill and initial > cached_tokens:
            self.do_extend(request_id, request.handle, initial - cached_tokens, None)
            self.write_pending({request_id: len(request.pending)}, order=None)

    def do_extend(self, request_id: str, handle: Handle, count: int, token_ids: list[int] | None) -> None:
        request = self.model[request_id]
        start, stop = request.length, request.length + count
        if request.max_length is not None and stop > request.max_length:
            self.refused(SequenceTooLongError, lambda: self.manager.extend(handle, count, token_ids=token_ids))
            return
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
            self.refused_for_room(lambda: self.manager.extend(handle, count, token_ids=token_ids))
            return
        slots = self.manager.extend(handle, count, token_ids=token_ids)
        assert slots.dtype == np.int64
        assert slots.shape == (count,)
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
        self.note_pressure()

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data(), count=st.integers(0, 10), with_ids=st.booleans())
    def extend(self, data: st.DataObject, count: int, with_ids: bool) -> None:
        request_id = data.draw(st.sampled_from(self.resident()), label="request")
        request = self.model[request_id]
        handle = self.pick_handle(data, request)
        token_ids = None
        if self.caching:  # the prompts' ids run out at MAX_LENGTH
            count = min(count, 6, MAX_LENGTH - request.length)
        if self.caching and with_ids:
            if len(request.tokens) < request.length:
                self.refused(InvalidArgumentError, lambda: self.manager.extend(handle, 1, token_ids=[0]))
                return
            known = request.tokens[request.length : request.length + count]
            fresh = data.draw(
                st.lists(st.sampled_from(ALPHABET), min_size=count - len(known), max_size=count - len(known))
            )
            token_ids = [*known, *fresh]
        self.do_extend(request_id, handle, count, token_ids)

    def make_private(self, request_id: str) -> bool:
        """Pending slots handed out before a fork lie in shared blocks: a write into them is
        refused, then ``writable_slots`` copies them. False when there is no room for that."""
        request = self.model[request_id]
        positions = request.pending
        copies = self.shared_logicals(request, positions[0], positions[-1] + 1)
        if not copies:
            return True
        slots = np.array([request.slot(position) for position in positions], dtype=np.int64)
        keys = np.zeros((len(positions), HEADS, DIM), np.float32)
        self.refused(SharedBlockWriteError, lambda: self.manager.write(0, slots, keys, keys))
        free, cached = self.figures()
        if len(copies) > free + cached:
            self.refused_for_room(lambda: self.manager.writable_slots(request.handle, positions[0], positions[-1] + 1))
            return False
        slots = self.manager.writable_slots(request.handle, positions[0], positions[-1] + 1)
        self.copy_on_write(request, copies, request.handle.block_table().physical_blocks)
        self.take(len(copies), (free, cached))
        self.check_accounting()
        self.note_pressure()
        assert slots.tolist() == [request.slot(position) for position in positions]
        return True

    def write_pending(self, counts: dict[str, int], order: list[int] | None) -> None:
        """Write the first ``counts[rid]`` pending tokens of each request: one ``write``
        per layer for all of them, the slots in ``order`` (as handed out when None)."""
        chosen = [rid for rid in counts if counts[rid] and self.make_private(rid)]
        if not chosen:
            return
        positions = [(rid, position) for rid in chosen for position in self.model[rid].pending[: counts[rid]]]
        slots = np.array([self.model[rid].slot(position) for rid, position in positions], dtype=np.int64)
        # The drawn order applies when every chosen request takes part (none was refused).
        index = np.array(order if order is not None and len(order) == len(positions) else range(len(positions)))
        for layer in range(LAYERS):
            pairs = [self.expected_kv(self.model[rid], position, layer) for rid, position in positions]
            self.write_kv(layer, slots[index], [pairs[i] for i in index])
        for rid, position in positions:
            request = self.model[rid]
            request.kv[position] = [self.expected_kv(request, position, layer) for layer in range(LAYERS)]
        for rid in chosen:
            del self.model[rid].pending[: counts[rid]]
        self.advance_all()

    @precondition(lambda self: any(self.model[rid].pending for rid in self.resident()))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """A batched write of the first pending tokens of several requests, in any slot order."""
        candidates = [rid for rid in self.resident() if self.model[rid].pending]
        chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, unique=True), label="requests")
        counts = {
            rid: data.draw(st.integers(1, len(self.model[rid].pending)), label=f"tokens of {rid}") for rid in chosen
        }
        order = data.draw(st.permutations(range(sum(counts.values()))), label="slot order")
        self.write_pending(counts, list(order))

    @precondition(lambda self: any(self.model[rid].kv for rid in self.resident()))
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1))
    def rewrite(self, data: st.DataObject, layer: int) -> None:
        """Rewrite written tokens: where blocks can be shared or cached, through
        ``writable_slots`` (shared blocks are copied first, cached ones leave the cache) in
        every layer; otherwise straight into their slots, in one layer."""
        direct = not ({"fork", "prefix_caching"} & self.policies)
        candidates = [
            rid
            for rid in self.resident()
            if any(p >= self.model[rid].first_logical * BLOCK for p in self.model[rid].kv)
            and (direct or not self.model[rid].pending)
        ]
        if not candidates:
            return
        request = self.model[data.draw(st.sampled_from(candidates), label="request")]
        low = request.first_logical * BLOCK
        if direct:
            written = sorted(p for p in request.kv if p >= low)
            positions = data.draw(
                st.lists(st.sampled_from(written), min_size=1, max_size=6, unique=True), label="positions"
            )
            for position in positions:
                request.versions[(position, layer)] = request.versions.get((position, layer), 0) + 1
            pairs = [self.expected_kv(request, position, layer) for position in positions]
            self.write_kv(layer, np.array([request.slot(p) for p in positions], dtype=np.int64), pairs)
            for position, pair in zip(positions, pairs, strict=True):
                request.kv[position][layer] = pair
            return
        start = data.draw(st.integers(low, request.length - 1), label="start")
        stop = data.draw(st.integers(start + 1, request.length), label="stop")
        copies = self.shared_logicals(request, start, stop)
        free, cached = self.figures()
        if len(copies) > free + cached:
            self.refused_for_room(lambda: self.manager.writable_slots(request.handle, start, stop))
            return
        slots = self.manager.writable_slots(request.handle, start, stop)
        self.copy_on_write(request, copies, request.handle.block_table().physical_blocks)
        self.take(len(copies), (free, cached))
        self.check_accounting()
        self.note_pressure()
        # A cached block is immutable: the rewritten ones leave the prefix cache, and the
        # request's chain stops before the first of them (later ones stay registered).
        first = max(start // BLOCK, request.first_logical)
        last = min(blocks_for(stop), max(request.hashed, request.registered_until))
        request.dropped.update(range(first, last))
        if first < request.hashed:
            request.registered_until = max(request.registered_until, request.hashed)
            request.hashed = first
            request.chain_open = False
        positions = list(range(start, stop))
        for position in positions:
            if position >= len(request.tokens):  # unknown ids: new noise; known ids: the same K/V again
                for each_layer in range(LAYERS):
                    request.versions[(position, each_layer)] = request.versions.get((position, each_layer), 0) + 1
        for each_layer in range(LAYERS):
            self.write_kv(each_layer, slots, [self.expected_kv(request, p, each_layer) for p in positions])
        for position in positions:
            request.kv[position] = [self.expected_kv(request, position, each_layer) for each_layer in range(LAYERS)]

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def clone_handle(self, data: st.DataObject) -> None:
        request = self.model[data.draw(st.sampled_from(sorted(self.model)), label="request")]
        handle = self.pick_handle(data, request)
        clone = handle.clone_handle()
        assert clone == handle
        assert clone is not handle
        assert clone.cache_id() == handle.cache_id()
        if len(request.handles) < MAX_HANDLES_PER_REQUEST:
            request.handles.append(clone)

    @precondition(lambda self: "fork" in self.policies and bool(self.resident()))
    @rule(data=st.data(), new_id=st.sampled_from(REQUEST_IDS))
    def fork(self, data: st.DataObject, new_id: str) -> None:
        parent = self.model[data.draw(st.sampled_from(self.resident()), label="parent")]
        handle = self.pick_handle(data, parent)
        if new_id in self.model:
            self.refused(DuplicateRequestError, lambda: self.manager.fork(handle, new_id))
            return
        figures = self.figures()
        child_handle = self.manager.fork(handle, new_id)
        self.serial += 1
        shared = parent.blocks[: blocks_for(parent.held_tokens())]
        child = ModelRequest(
            [child_handle],
            self.serial,
            parent.salt,
            parent.prompt,
            list(parent.tokens),
            parent.max_length,
            length=parent.length,
            first_logical=parent.first_logical,
            blocks=list(shared),
            kv={position: list(pairs) for position, pairs in parent.kv.items()},
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
            self.release(request)
        self.manager.deallocate(request_id)
        del self.model[request_id]
        assert self.manager.get_handle(request_id) is None
        for handle in request.handles:
            assert not handle.is_valid()
        self.dead = [*self.dead, *request.handles[:2]][-DEAD_HANDLES_KEPT:]
        self.check_accounting()
        self.note_pressure()

    @precondition(lambda self: "swap" in self.policies and bool(self.resident()))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        request = self.model[data.draw(st.sampled_from(self.resident()), label="request")]
        self.advance(request)
        self.release(request)
        self.manager.swap_out(request.handle.request_id)
        request.swapped_blocks = blocks_for(request.held_tokens())
        request.blocks = []
        assert request.handle.is_swapped_out()
        assert request.handle.is_valid()
        self.check_accounting()
        self.note_pressure()

    @precondition(lambda self: any(request.swapped for request in self.model.values()))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(r for r, q in self.model.items() if q.swapped)), label="request")
        request = self.model[request_id]
        needed = request.swapped_blocks
        assert needed is not None
        free, cached = self.figures()
        if needed > free + cached:
            self.refused_for_room(lambda: self.manager.swap_in(request_id))
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
        self.note_pressure()
        self.advance_all()

    # -- refusals and eviction ---------------------------------------------------------------

    @rule(
        data=st.data(),
        fail=st.booleans(),
        extend_instead=st.booleans(),
        with_limit=st.booleans(),
        request_id=st.sampled_from(REQUEST_IDS),
    )
    def exhaust(self, data: st.DataObject, fail: bool, extend_instead: bool, with_limit: bool, request_id: str) -> None:
        """An allocate, or an extend, needing one block more than the pool can give (free
        and cached blocks); or, with cached blocks, an allocation that must evict some."""
        free, cached = self.figures()
        unlimited = [rid for rid in self.resident() if self.model[rid].max_length is None]
        if extend_instead and unlimited and self.window is None:
            request = self.model[data.draw(st.sampled_from(unlimited), label="request")]
            handle = self.pick_handle(data, request)
            room_in_blocks = (request.first_logical + len(request.blocks)) * BLOCK - request.length
            self.refused_for_room(lambda: self.manager.extend(handle, room_in_blocks + (free + cached) * BLOCK + 1))
            return
        if request_id in self.model:  # a live id is refused before the pool is looked at
            allocation = AllocationRequest(request_id, initial_tokens=(free + cached + 1) * BLOCK)
            self.refused(DuplicateRequestError, lambda: self.manager.allocate(allocation))
            return
        if fail or not cached:
            tokens = (free + cached + 1) * BLOCK
            allocation = AllocationRequest(
                request_id, initial_tokens=tokens, max_sequence_length=tokens + 8 if with_limit else None
            )
            self.refused_for_room(lambda: self.manager.allocate(allocation))
            assert self.manager.get_handle(request_id) is None
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
        self.model[request_id] = ModelRequest([handle], self.serial, None, (), [], blocks=blocks)
        assert self.figures() == (0, cached - extra)
        self.note_pressure()

    @rule()
    def gc(self) -> None:
        free, cached = self.figures()
        report = self.manager.gc()
        assert report.blocks_freed == cached
        assert report.memory_freed == cached * self.manager.config.bytes_per_block
        self.counters["evictions"] += cached
        assert self.figures() == (free + cached, 0)

    # -- attention -------------------------------------------------------------------------

    def attendable_queries(self, request: ModelRequest) -> int:
        """Queries whose whole window is held: with a window, the manager keeps what the
        tokens of the latest extend can see; earlier tokens' windows may be released."""
        if request.swapped or request.pending or not request.held_tokens():
            return 0
        earliest = request.first_logical * BLOCK + (self.window or 1) - 1 if request.first_logical else 0
        return min(3, request.length - earliest)

    def check_attention(
        self, data: st.DataObject, batch: list[str], counts: list[int], layer: int, causal: bool, seed: int
    ) -> None:
        """Paged attention over ``batch`` equals the dense oracle over the model's K/V."""
        rng = np.random.default_rng(seed)
        query = rng.standard_normal((sum(counts), HEADS * QUERY_GROUP, DIM)).astype(np.float32)
        handles = [self.pick_handle(data, self.model[rid]) for rid in batch]
        page_table = self.manager.page_table(handles)
        decode = all(count == 1 for count in counts) and data.draw(st.booleans(), label="omit qo_indptr")
        indptr = None if decode else np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        output = self.manager.paged_attention(layer, query, page_table, qo_indptr=indptr, causal=causal)
        assert output.shape == query.shape
        assert output.dtype == np.float32
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

    @precondition(lambda self: bool(self.resident()))
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), seed=st.integers(0, 2**16))
    def decode_step(self, data: st.DataObject, layer: int, seed: int) -> None:
        """One decode step of a batch: extend each by one token, write the new K/V of all
        of them in one call per layer, attend with one query each."""
        ready = [
            rid
            for rid in self.resident()
            if (limit := self.model[rid].max_length) is None or self.model[rid].length < limit
        ]
        if self.caching:
            ready = [rid for rid in ready if self.model[rid].length < MAX_LENGTH]
        batch = data.draw(st.lists(st.sampled_from(ready), unique=True, max_size=4), label="batch") if ready else []
        for rid in batch:  # where the pool is full, a request sits the step out
            self.do_extend(rid, self.model[rid].handle, 1, None)
        self.write_pending({rid: len(self.model[rid].pending) for rid in batch}, order=None)
        attendable = [rid for rid in batch if self.attendable_queries(self.model[rid])]
        if attendable:
            self.check_attention(data, attendable, [1] * len(attendable), layer, True, seed)

    @precondition(lambda self: any(self.attendable_queries(self.model[r]) for r in self.resident()))
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), causal=st.booleans(), seed=st.integers(0, 2**16))
    def attend(self, data: st.DataObject, layer: int, causal: bool, seed: int) -> None:
        """Prefill-shaped attention: several queries per request, causal or not."""
        ready = [r for r in self.resident() if self.attendable_queries(self.model[r])]
        batch = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True), label="batch")
        counts = [
            data.draw(st.integers(1, self.attendable_queries(self.model[r])), label=f"queries of {r}") for r in batch
        ]
        self.check_attention(data, batch, counts, layer, causal, seed)

    def teardown(self) -> None:
        """Label the run, so that ``--hypothesis-show-statistics`` shows what was exercised."""
        stats = self.manager.stats()
        for name, value in (
            ("prefix hits", stats.prefix_cache_hits),
            ("copies on write", stats.copy_on_write_count),
            ("evictions", stats.eviction_count),
            ("allocation failures", stats.allocation_failures),
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
        if not self.caching:
            assert stats.cached_blocks == 0
        allocator = inspect.allocator(self.manager)
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
        assert sorted(rid for rid, _ in self.manager.list_handles()) == sorted(self.model)
        for request_id, request in self.model.items():
            assert len({handle.cache_id() for handle in request.handles}) == 1
            for handle in request.handles:
                assert handle.is_valid()
                assert handle.request_id == request_id
                assert handle.is_swapped_out() == request.swapped
            handle = request.handles[-1]
            if request.swapped:
                assert handle.num_tokens() == 0
                continue
            assert handle.num_tokens() == request.length
            table = handle.block_table()
            assert table.sequence_length == request.length, request_id
            assert table.first_logical == request.first_logical, request_id
            assert list(table.physical_blocks) == request.blocks, request_id
            if self.window is not None:
                assert table.first_logical <= self.window_start(request.length)
            low = request.first_logical * BLOCK
            for layer in range(LAYERS):
                keys, values = self.manager.gather(handle, layer)
                assert keys.shape == values.shape == (request.length - low, HEADS, DIM)
                for position, pairs in request.kv.items():
                    if position >= low:
                        assert np.array_equal(keys[position - low], pairs[layer][0]), (request_id, position, layer)
                        assert np.array_equal(values[position - low], pairs[layer][1]), (request_id, position, layer)

    @invariant()
    def the_pool_holds_written_tokens_in_its_layout(self) -> None:
        """``key_cache`` read through the documented layout holds each written token."""
        for request_id, request in self.model.items():
            low = request.first_logical * BLOCK
            positions = sorted(p for p in request.kv if p >= low) if not request.swapped else []
            if not positions:
                continue
            slots = np.array([request.slot(p) for p in positions], dtype=np.int64)
            blocks, offsets = np.divmod(slots, BLOCK)
            for layer in range(LAYERS):
                key_pool, value_pool = request.handle.kv_cache(layer)
                assert key_pool is not None
                assert value_pool is not None
                assert key_pool.shape == self.manager.config.block_shape()
                for side, pool in enumerate((key_pool, value_pool)):
                    if self.kv_layout == "NHD":
                        tokens = pool[blocks, offsets]
                    elif self.kv_layout == "HND":
                        tokens = pool[blocks, :, offsets]
                    else:
                        tokens = pool[:, blocks, offsets].transpose(1, 0, 2)
                    expected = np.stack([request.kv[p][layer][side] for p in positions])
                    assert np.array_equal(tokens, expected), (request_id, layer)

    @invariant()
    def deallocated_handles_stay_invalid(self) -> None:
        """Kept handles of deallocated requests refuse every use and change nothing, even
        after their id was allocated again."""
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
                self.manager.gather(handle, LAYERS - 1)
            if handle.request_id not in self.model:
                with pytest.raises(UnknownRequestError):
                    self.manager.deallocate(handle.request_id)
        assert_same_state(snapshot(self.manager), before)

    @invariant()
    def pressure_follows_usage(self) -> None:
        assert self.manager.pressure == self.last_pressure == expected_pressure(len(self.in_use()))
        assert self.pressure_events == self.expected_pressure_events


# Runs at the size tests.sizes chooses: the same steps per run, fewer runs in an everyday run.
LIFE_CYCLE = settings(max_examples=sized(full=80, everyday=40), stateful_step_count=50, deadline=None)
POLICIES = settings(max_examples=sized(full=300, everyday=100), stateful_step_count=60, deadline=None)


@LIFE_CYCLE
class NHDCacheMachine(CacheMachine):
    kv_layout = "NHD"


@LIFE_CYCLE
class HNDCacheMachine(CacheMachine):
    kv_layout = "HND"


@LIFE_CYCLE
class HeadsFirstCacheMachine(CacheMachine):
    kv_layout = "heads_first"


@LIFE_CYCLE
class FifoPlacementCacheMachine(CacheMachine):
    """Least-recently-freed placement scatters requests over many short runs, so
    attention reads many runs per request."""

    kv_layout = "HND"
    placement = "fifo"


@POLICIES
class PrefixForkSwapMachine(CacheMachine):
    """Prefix caching, fork, swap and eviction: exact eviction and cache accounting."""

    policies = ALL_POLICIES
    kv_layout = "NHD"


@POLICIES
class WindowedMachine(CacheMachine):
    """Every policy and a sliding window of 6 tokens, in another layout."""

    policies = ALL_POLICIES | {"sliding_window"}
    kv_layout = "heads_first"


TestNHDLayout = NHDCacheMachine.TestCase
TestHNDLayout = HNDCacheMachine.TestCase
TestHeadsFirstLayout = HeadsFirstCacheMachine.TestCase
TestFifoPlacement = FifoPlacementCacheMachine.TestCase
TestPrefixForkSwap = PrefixForkSwapMachine.TestCase
TestWindowed = WindowedMachine.TestCase
