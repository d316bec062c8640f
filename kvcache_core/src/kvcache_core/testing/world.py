"""The populated pools the bad-input catalogues poke at, and what "changed nothing" compares.

:func:`make_world` builds a small pool of the backend under test (two live requests
holding written K/V, one deallocated request, a handle of another manager);
:func:`make_policy_world` builds one with the policies a case needs in play (cached and
shared prefix blocks, a fork, a swapped-out request). Around a failing call the kit
snapshots everything observable (stats, every block table, reference counts, free
extents, the free list and the cache's LRU order, the in-use and shared masks, prefix
registrations, swapped host copies and every layer's K/V pool) and, to catch hidden
state (placement reservations, the free-list order), replays the same follow-up
operations on the failed manager and on an untouched twin and compares what they do.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import SlotArray
from kvcache_core.errors import KvCacheError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing import inspect
from kvcache_core.testing.backend import BackendUnderTest

__all__ = [
    "CONFIG",
    "GEOMETRY",
    "OLD_PROMPT",
    "POLICY_GEOMETRY",
    "PROMPT",
    "PolicyWorld",
    "Snapshot",
    "World",
    "assert_same_state",
    "esc",
    "fill_pool",
    "make_policy_world",
    "make_world",
    "probe",
    "probe_policies",
    "snapshot",
    "untyped",
    "world_policies",
]

NumpyArray = npt.NDArray[Any]

# 2 layers, 2 KV heads of 4 features, 8 blocks of 4 tokens: 32 slots.
GEOMETRY: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 4, "num_blocks": 8, "block_size": 4}
CONFIG = CacheConfig(**GEOMETRY)
NUM_SLOTS = CONFIG.num_blocks * CONFIG.block_size

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]


def untyped(value: object) -> Any:
    """Pass a deliberately ill-typed value past the type checker."""
    return value


def esc(value: object) -> str:
    """A ``match=`` pattern for the text of ``value``."""
    return re.escape(str(value))


# -- the populated pool ----------------------------------------------------------------


@dataclass
class World:
    """A populated manager of the backend under test and the handles the cases poke at."""

    backend: BackendUnderTest
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
        keys = BackendUnderTest.native(manager, rng.standard_normal(shape))
        values = BackendUnderTest.native(manager, rng.standard_normal(shape))
        manager.write(layer, slots, keys, values)


def make_world(backend: BackendUnderTest) -> World:
    """The same populated pool on every call (the data comes from a fixed seed)."""
    rng = np.random.default_rng(20240601)
    config = backend.config(**GEOMETRY)
    manager = backend.manager(config)
    a = manager.allocate(AllocationRequest("a", initial_tokens=6))
    dead = manager.allocate(AllocationRequest("dead", initial_tokens=4))
    b = manager.allocate(AllocationRequest("b", initial_tokens=4, max_sequence_length=8))
    write_tokens(manager, a, 5, rng)
    write_tokens(manager, dead, 4, rng)
    write_tokens(manager, b, 3, rng)
    stale_page_table = manager.page_table([a, dead])
    dead_slots = dead.block_table().slots(0, 4)
    manager.deallocate("dead")
    other = backend.manager(config)
    foreign = other.allocate(AllocationRequest("a", initial_tokens=4))
    write_tokens(other, foreign, 2, rng)
    return World(backend, manager, a, b, dead, dead_slots, stale_page_table, foreign)


def fill_pool(world: World | PolicyWorld) -> None:
    """Take every free and cached block with one more request, "filler"."""
    stats = world.manager.stats()
    taken = stats.free_blocks + stats.cached_blocks
    world.manager.allocate(AllocationRequest("filler", initial_tokens=taken * world.manager.config.block_size))
    stats = world.manager.stats()
    assert stats.free_blocks == stats.cached_blocks == 0


# -- snapshots -------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Everything observable about a manager's state."""

    stats: dict[str, object]
    tables: list[tuple[str, list[dict[str, Any]]]]
    handle_figures: list[tuple[str, bool, bool, int, int, int, int]]
    ref_counts: list[int]
    free_extents: list[tuple[int, int]]
    free_list: list[int]
    cached_lru: list[int]
    in_use: list[bool]
    shared: list[bool]
    registrations: list[str | None]
    host_copies: list[tuple[str, NumpyArray, NumpyArray]]
    pools: list[tuple[NumpyArray, NumpyArray]]


# Counters that legitimately count refused calls.
FAILURE_COUNTERS = ("allocation_failures",)


def snapshot(manager: Manager) -> Snapshot:
    """Copy everything observable about ``manager``."""
    stats = dataclasses.asdict(manager.stats())
    for name in FAILURE_COUNTERS:
        del stats[name]
    handles = manager.list_handles()
    allocator = inspect.allocator(manager)
    prefix = inspect.prefix_cache(manager)
    entries = [None if prefix is None else prefix.entry_of(block) for block in range(allocator.num_blocks)]
    swapped = [(rid, inspect.request_state(handle).swap) for rid, handle in handles]
    return Snapshot(
        stats=stats,
        tables=[(rid, [table.to_dict() for table in handle.block_tables()]) for rid, handle in handles],
        handle_figures=[
            (
                rid,
                handle.is_valid(),
                handle.is_swapped_out(),
                handle.num_tokens(),
                handle.num_cached_tokens(),
                handle.stats().blocks_allocated,
                handle.stats().memory_bytes,
            )
            for rid, handle in handles
        ],
        ref_counts=[allocator.ref_count(block) for block in range(allocator.num_blocks)],
        free_extents=allocator.free_extents(),
        free_list=sorted(allocator.free_blocks()),  # which blocks, not the queue order (a rollback may requeue)
        cached_lru=allocator.cached_blocks(),
        in_use=[bool(flag) for flag in allocator.in_use_mask()],
        shared=[bool(flag) for flag in allocator.shared_mask()],
        registrations=[None if entry is None else entry.block_hash.hex() for entry in entries],
        host_copies=[
            (rid, np.array(swap.keys, copy=True), np.array(swap.values, copy=True))
            for rid, swap in swapped
            if swap is not None
        ],
        pools=[
            (
                BackendUnderTest.host(manager, manager.storage.key_cache(layer)),
                BackendUnderTest.host(manager, manager.storage.value_cache(layer)),
            )
            for layer in range(manager.storage.config.num_layers)
        ],
    )


def assert_same_state(after: Snapshot, before: Snapshot) -> None:
    """Fail, naming the first difference, unless the two snapshots agree exactly."""
    for name in ("stats", "tables", "handle_figures", "ref_counts", "free_extents", "free_list", "cached_lru"):
        assert getattr(after, name) == getattr(before, name), f"{name} changed"
    for name in ("in_use", "shared", "registrations"):
        assert getattr(after, name) == getattr(before, name), f"{name} changed"
    assert [rid for rid, _, _ in after.host_copies] == [rid for rid, _, _ in before.host_copies]
    for (rid, keys_after, values_after), (_, keys_before, values_before) in zip(
        after.host_copies, before.host_copies, strict=True
    ):
        assert np.array_equal(keys_after, keys_before), f"the host copy of {rid!r} changed"
        assert np.array_equal(values_after, values_before), f"the host copy of {rid!r} changed"
    assert len(after.pools) == len(before.pools)
    for layer, ((keys_after, values_after), (keys_before, values_before)) in enumerate(
        zip(after.pools, before.pools, strict=True)
    ):
        assert np.array_equal(keys_after, keys_before), f"layer {layer} key pool changed"
        assert np.array_equal(values_after, values_before), f"layer {layer} value pool changed"


def _record_outcome(
    outcomes: list[object],
    operation: Callable[[], object],
    shown: Callable[[PagedKvCacheHandle[Any]], object],
) -> None:
    """Append what ``operation`` did to ``outcomes``: the name of the ``KvCacheError`` it
    raised, an array it returned as a list, a handle it returned as ``shown`` gives it, or
    what it returned."""
    try:
        result = operation()
    except KvCacheError as exc:
        outcomes.append(type(exc).__name__)
        return
    if isinstance(result, np.ndarray):
        outcomes.append(result.tolist())
    elif isinstance(result, PagedKvCacheHandle):
        handle: PagedKvCacheHandle[Any] = result  # pyright: ignore[reportUnknownVariableType]
        outcomes.append(shown(handle))
    else:
        outcomes.append(result)


def probe(world: World) -> list[object]:
    """Run the same follow-up operations on a world; return what each one did.

    Two managers with the same hidden state (reservations, free-list order) give the
    same outcomes.
    """
    manager = world.manager
    outcomes: list[object] = []

    def attempt(operation: Callable[[], object]) -> None:
        _record_outcome(outcomes, operation, lambda handle: handle.block_table().to_dict())

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


# -- the populated pool with the policies in play --------------------------------------

# 2 layers, 2 KV heads of 4 features, 20 blocks of 4 tokens.
POLICY_GEOMETRY: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 4, "num_blocks": 20, "block_size": 4}
PROMPT = tuple(range(10, 20))  # 10 tokens: 2 full blocks, the 3rd partial
OLD_PROMPT = tuple(range(50, 59))  # computed, then deallocated: 2 cached blocks


@dataclass
class PolicyWorld:
    """A populated manager with the policies of :attr:`policies` in play."""

    backend: BackendUnderTest
    manager: Manager
    policies: frozenset[str]
    a: Handle  # prompt PROMPT, computed; with prefix caching its full blocks are hashed and shared with "b"
    b: Handle  # prompt PROMPT: with prefix caching 8 tokens from the cache; 2 computed
    c: Handle | None  # fork of "a" (with ``fork``)
    p: Handle  # prompt of 12 tokens, only 6 computed so far
    g: Handle  # no prompt: 3 tokens whose ids were never given
    s: Handle  # 5 tokens written; swapped out (with ``swap``)
    s_slots: SlotArray
    dead: Handle
    foreign: Handle

    @property
    def fork(self) -> Handle:
        """The fork "c" (a case that uses it requires ``fork``)."""
        assert self.c is not None, "this world has no fork"
        return self.c


def world_policies(claimed: frozenset[str] | tuple[str, ...]) -> frozenset[str]:
    """The policies a policy world of a backend claiming ``claimed`` puts in play: ``fork``,
    ``swap`` and ``prefix_caching``; a pool with cached blocks evicts when it is filled, so
    prefix caching only where ``eviction`` is claimed too."""
    policies = {name for name in ("fork", "swap") if name in claimed}
    if "prefix_caching" in claimed and "eviction" in claimed:
        policies.add("prefix_caching")
    return frozenset(policies)


def _compute(manager: Manager, handle: Handle, count: int, seed: int) -> SlotArray:
    """Extend ``handle`` by ``count`` tokens; write keys ``k`` and values ``-k`` in every layer."""
    rng = np.random.default_rng(seed)
    slots = manager.extend(handle, count)
    config = manager.config
    for layer in range(config.num_layers):
        keys = rng.standard_normal((count, config.num_heads, config.head_dim))
        manager.write(layer, slots, BackendUnderTest.native(manager, keys), BackendUnderTest.native(manager, -keys))
    return slots


def make_policy_world(backend: BackendUnderTest) -> PolicyWorld:
    """The same populated pool on every call, with :func:`world_policies` of ``backend`` in play."""
    policies = world_policies(tuple(backend.spec.capabilities))
    config = backend.config(**POLICY_GEOMETRY, enable_prefix_caching="prefix_caching" in policies)
    manager = backend.manager(config)
    old = manager.allocate(AllocationRequest("old", initial_tokens=9, prompt_token_ids=OLD_PROMPT))
    _compute(manager, old, 9, seed=0)
    manager.deallocate("old")
    a = manager.allocate(AllocationRequest("a", initial_tokens=10, prompt_token_ids=PROMPT))
    _compute(manager, a, 10, seed=1)
    b = manager.allocate(AllocationRequest("b", initial_tokens=10, prompt_token_ids=PROMPT))
    _compute(manager, b, 2, seed=2)
    c = manager.fork(a, "c") if "fork" in policies else None
    p = manager.allocate(AllocationRequest("p", prompt_token_ids=tuple(range(30, 42))))
    _compute(manager, p, 6, seed=3)
    g = manager.allocate(AllocationRequest("g"))
    _compute(manager, g, 3, seed=4)
    s = manager.allocate(AllocationRequest("s"))
    s_slots = _compute(manager, s, 5, seed=5)
    if "swap" in policies:
        manager.swap_out("s")
    dead = manager.allocate(AllocationRequest("dead", initial_tokens=4))
    manager.deallocate("dead")
    foreign = backend.manager(config).allocate(AllocationRequest("a", initial_tokens=4))
    return PolicyWorld(backend, manager, policies, a, b, c, p, g, s, s_slots, dead, foreign)


def probe_policies(world: PolicyWorld) -> list[object]:
    """The same follow-up operations on any policy world (those of its policies); what each did."""
    manager = world.manager
    outcomes: list[object] = []

    def attempt(operation: Callable[[], object]) -> None:
        _record_outcome(
            outcomes, operation, lambda handle: (handle.block_table().to_dict(), handle.num_cached_tokens())
        )

    def handle(request_id: str) -> Handle:
        found = manager.get_handle(request_id)
        assert found is not None, f"request {request_id!r} is gone"
        return found

    policies = world.policies
    attempt(lambda: manager.allocate(AllocationRequest("q1", initial_tokens=10, prompt_token_ids=PROMPT)))
    attempt(lambda: manager.allocate(AllocationRequest("q2", prompt_token_ids=OLD_PROMPT)))
    if "fork" in policies:
        attempt(lambda: manager.extend(handle("c"), 3))
    attempt(lambda: manager.extend(handle("p"), 2, token_ids=[36, 37]))
    if "swap" in policies:
        attempt(lambda: manager.swap_in("s"))
    if "fork" in policies:
        attempt(lambda: manager.fork(handle("b"), "q3"))
    if "swap" in policies:
        attempt(lambda: manager.swap_out("a"))
    attempt(lambda: manager.allocate(AllocationRequest("q4", initial_tokens=6 * POLICY_GEOMETRY["block_size"])))
    attempt(lambda: manager.gc().blocks_freed)
    if "swap" in policies:
        attempt(lambda: manager.swap_in("a"))
    manager.check_invariants()
    outcomes.append(snapshot(manager).tables)
    return outcomes
