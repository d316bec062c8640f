"""Fault injection: a storage that fails at its k-th call, and a scripted run through every
policy that is checked after each failure.

Every manager operation that calls the storage must be transactional: take, call, commit,
or give back everything it took, whatever the storage raised. :func:`run_fault_injection`
proves it for one backend. It runs a script (allocate, prefill, prefix hit, fork,
copy-on-write, rewrite of a cached block, swap out and in, attention, eviction, gather,
deallocate) once without faults to count the storage calls ``N``, then ``2 * N`` times more:
for each ``k < N`` the ``k``-th storage call raises :class:`InjectedFaultError`, once before the
real call and once after it (the storage did the work, then failed). After each failure
it checks that

* the exception reached the caller unchanged and the pool's records are consistent
  (``check_invariants``);
* every live request gathers exactly the K/V the script wrote for it (only a failed
  ``write`` leaves its own rows unknown: a storage may fail half-way through a scatter);
* nothing leaked: once every request is deallocated no block is in use, and ``gc`` returns
  every cached block to the free list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvcache_core.attention.features import storage_attention_features
from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvStorage, SlotArray
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.kv_data import keyed_kv

__all__ = [
    "STORAGE_CALLS",
    "CallInjector",
    "FaultReport",
    "FaultScript",
    "FaultyStorage",
    "InjectedFaultError",
    "check_after_fault",
    "run_fault_injection",
]

#: The storage methods the manager calls on the data path and in its policies; each call
#: of one of them is an injection point.
STORAGE_CALLS = ("write", "gather", "copy_blocks", "blocks_to_host", "blocks_from_host", "paged_attention")

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]
FloatArray = npt.NDArray[np.float64]
When = Literal["before", "after"]


class InjectedFaultError(Exception):
    """The failure :class:`FaultyStorage` injects (a storage's own error, not a
    ``KvCacheError``: the manager must pass it on unchanged)."""


class CallInjector:
    """Counts calls and fails the ``fail_at``-th: what :class:`FaultyStorage` and the tier
    kit's :class:`~kvcache_core.testing.tiers.FaultyTier` share.

    Calls are counted from 0 in :attr:`calls` (by name). The call numbered ``fail_at``
    raises ``fault`` (:class:`InjectedFaultError` by default; a ``KeyboardInterrupt``
    subclass tests interruption) before the real call (``when="before"``) or after it
    returned (``when="after"``); :attr:`fired` names it once it fired. Several wrappers may
    share one injector (:attr:`counter`), so that their calls are numbered together.
    """

    def __init__(
        self,
        fail_at: int | None = None,
        when: str = "before",
        fault: type[BaseException] = InjectedFaultError,
    ) -> None:
        self.fail_at = fail_at
        self.when = when
        self.fault = fault
        self.calls: list[str] = []
        self.fired: str | None = None

    @property
    def counter(self) -> CallInjector:
        """The injector whose numbering this one's calls share (itself)."""
        return self

    def armed(self, name: str) -> bool:
        """Count a call of ``name``; whether it is the one to fail."""
        counter = self.counter
        index = len(counter.calls)
        counter.calls.append(name)
        return index == counter.fail_at

    def fire(self, name: str, where: str) -> BaseException:
        """The fault for the armed call of ``name`` (recorded as fired)."""
        counter = self.counter
        counter.fired = name
        return counter.fault(f"injected {where} call {len(counter.calls) - 1} ({name})")

    def _call(self, name: str, call: Callable[[], Any]) -> Any:
        armed = self.armed(name)
        if armed and self.counter.when == "before":
            raise self.fire(name, "before")
        result = call()
        if armed:
            raise self.fire(name, "after")
        return result


class FaultyStorage(CallInjector):
    """A :class:`~kvcache_core.KvStorage` wrapper whose ``fail_at``-th storage call raises.

    Calls of :data:`STORAGE_CALLS` are counted from 0 in :attr:`calls`. The call numbered
    ``fail_at`` raises ``fault`` (:class:`InjectedFaultError` by default; a
    ``KeyboardInterrupt`` subclass tests interruption) before reaching the wrapped storage
    (``when="before"``) or after it returned (``when="after"``); every other call, and
    every other member, goes straight through. :attr:`closed` tells whether ``close()``
    ran.
    """

    def __init__(
        self,
        inner: KvStorage[Any],
        fail_at: int | None = None,
        when: When = "before",
        fault: type[BaseException] = InjectedFaultError,
    ) -> None:
        super().__init__(fail_at, when, fault)
        self._inner = inner
        self.closed = False

    @property
    def config(self) -> CacheConfig:
        return self._inner.config

    def key_cache(self, layer: int) -> Any:
        return self._inner.key_cache(layer)

    def value_cache(self, layer: int) -> Any:
        return self._inner.value_cache(layer)

    def write(self, layer: int, slots: SlotArray, keys: Any, values: Any) -> None:
        self._call("write", lambda: self._inner.write(layer, slots, keys, values))

    def gather(self, layer: int, blocks: SlotArray, num_tokens: int) -> tuple[Any, Any]:
        result: tuple[Any, Any] = self._call("gather", lambda: self._inner.gather(layer, blocks, num_tokens))
        return result

    def copy_blocks(self, source: SlotArray, destination: SlotArray) -> None:
        self._call("copy_blocks", lambda: self._inner.copy_blocks(source, destination))

    def blocks_to_host(self, blocks: SlotArray) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        result: tuple[npt.NDArray[Any], npt.NDArray[Any]] = self._call(
            "blocks_to_host", lambda: self._inner.blocks_to_host(blocks)
        )
        return result

    def blocks_from_host(self, blocks: SlotArray, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> None:
        self._call("blocks_from_host", lambda: self._inner.blocks_from_host(blocks, keys, values))

    def paged_attention(
        self,
        layer: int,
        query: Any,
        page_table: PageTable,
        qo_indptr: npt.NDArray[np.int32],
        scale: float,
        causal: bool,
        **given: Any,
    ) -> Any:
        """The wrapped storage's attention; the attention features the manager passes
        (``window``, ``softcap``, ``sinks``, ``chunk``) go through, those left at ``None``
        left out (a storage that serves none of them need not accept them)."""
        features = {name: value for name, value in given.items() if value is not None}
        return self._call(
            "paged_attention",
            lambda: self._inner.paged_attention(layer, query, page_table, qo_indptr, scale, causal, **features),
        )

    @property
    def attention_features(self) -> frozenset[str]:
        """The wrapped storage's attention capabilities."""
        return storage_attention_features(self._inner)

    def array_info(self, array: object) -> tuple[tuple[int, ...], str]:
        return self._inner.array_info(array)

    def from_numpy(self, array: npt.NDArray[Any]) -> Any:
        return self._inner.from_numpy(array)

    def to_numpy(self, array: Any) -> npt.NDArray[Any]:
        return self._inner.to_numpy(array)

    def array_namespace(self) -> Any:
        return self._inner.array_namespace()

    def close(self) -> None:
        """Release the wrapped storage (if it has anything to release)."""
        self.closed = True
        release = getattr(self._inner, "close", None)
        if callable(release):
            release()


# -- the script ------------------------------------------------------------------------------

PROMPT = tuple(range(101, 111))  # 10 tokens: two full blocks of 4 and two tokens more


def _kv_of(key: object, config: CacheConfig, layer: int) -> tuple[FloatArray, FloatArray]:
    """K/V of ``layer``'s own geometry determined by ``key`` and the layer, exact in every
    float dtype (multiples of 1/8); values of another width than the keys drawn apart."""
    shape = config.layer_geometry(layer)
    keys, values = keyed_kv((key, layer), (shape.num_heads, shape.head_dim))
    if shape.value_width != shape.head_dim:
        values = keyed_kv((key, layer, "values"), (shape.num_heads, shape.value_width))[1]
    return keys, values


@dataclass
class _Expected:
    """What one request holds: known K/V per layer per position (unknown ones absent)."""

    tokens: list[int] = field(default_factory=list[int])
    rows: list[dict[int, tuple[FloatArray, FloatArray]]] = field(
        default_factory=list[dict[int, tuple[FloatArray, FloatArray]]]
    )


@dataclass
class FaultScript:
    """Runs the script on one manager, keeping the K/V every request should hold
    (:meth:`mismatches` compares the pool with them); the tier kit's script extends it."""

    manager: Manager
    claims: Callable[[str], bool]
    handles: dict[str, Handle] = field(default_factory=dict[str, Handle])
    expected: dict[str, _Expected] = field(default_factory=dict[str, _Expected])
    versions: int = 0

    @property
    def config(self) -> CacheConfig:
        return self.manager.config

    def steps(self) -> list[tuple[str, Callable[[], None]]]:
        """The script's steps, those of unclaimed policies left out."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("allocate a", lambda: self.allocate("a", PROMPT)),
            ("prefill a", lambda: self.extend_and_write("a", len(PROMPT), PROMPT)),
        ]
        if self.claims("prefix_caching"):
            steps += [
                ("allocate b with a prefix hit", lambda: self.allocate("b", PROMPT)),
                ("prefill the rest of b", lambda: self.extend_and_write("b", None, PROMPT)),
            ]
        else:
            steps += [
                ("allocate b", lambda: self.allocate("b", ())),
                ("prefill b", lambda: self.extend_and_write("b", len(PROMPT), PROMPT)),
            ]
        if self.claims("fork"):
            steps += [
                ("fork a into c", lambda: self.fork("a", "c")),
                ("a decode step over a and c (copy-on-write)", lambda: self.decode_step(["a", "c"])),
                ("extend c into a shared block (copy-on-write)", lambda: self.extend_and_write("c", 3, None)),
                ("rewrite a's first held block (shared or cached)", lambda: self.rewrite("a", 0, 4)),
            ]
        if self.claims("swap"):
            steps.append(("swap b out", lambda: self.manager.swap_out("b")))
        steps.append(("attention over the resident requests", self.attend))
        if self.claims("swap"):
            steps.append(("swap b in", lambda: self.manager.swap_in("b")))
        if self.claims("fork"):
            steps.append(("deallocate c", lambda: self.deallocate("c")))
        if self.claims("eviction") and self.claims("prefix_caching"):
            steps += [
                ("allocate d over every free and cached block", self.fill_pool),
                ("deallocate d", lambda: self.deallocate("d")),
            ]
        steps += [
            ("allocate e with the prompt again", lambda: self.allocate("e", PROMPT)),
            ("prefill the rest of e", lambda: self.extend_and_write("e", None, PROMPT)),
            ("gather every request", self.gather_all),
            ("deallocate a", lambda: self.deallocate("a")),
        ]
        return steps

    # -- steps -------------------------------------------------------------------------------

    def allocate(self, request_id: str, prompt: tuple[int, ...], initial_tokens: int = 0) -> None:
        handle = self.manager.allocate(
            AllocationRequest(request_id, initial_tokens, prompt_token_ids=prompt or None, max_sequence_length=32)
        )
        self.handles[request_id] = handle
        expected = _Expected(rows=[{} for _ in range(self.config.num_layers)])
        cached = handle.num_cached_tokens()
        for position in range(cached):  # mapped from the prefix cache: the prompt's K/V
            for layer in range(self.config.num_layers):
                expected.rows[layer][position] = self.prompt_kv(prompt, position, layer)
        expected.tokens = list(prompt[:cached])
        self.expected[request_id] = expected

    def prompt_kv(self, prompt: tuple[int, ...], position: int, layer: int) -> tuple[FloatArray, FloatArray]:
        return _kv_of(("prompt", prompt[: position + 1]), self.config, layer)

    def extend_and_write(self, request_id: str, count: int | None, prompt: tuple[int, ...] | None) -> None:
        handle = self.handles[request_id]
        start = handle.num_tokens()
        if count is None:
            count = len(prompt or ()) - start
        ids = list(prompt[start : start + count]) if prompt is not None else None
        slots = self.manager.extend(handle, count, token_ids=ids)
        self.expected[request_id].tokens.extend(ids or [])
        self.write(request_id, slots, start, prompt)

    def write(self, request_id: str, slots: SlotArray, start: int, prompt: tuple[int, ...] | None) -> None:
        count = int(slots.shape[-1])  # [n], or [groups, n] with KV-cache groups
        self.versions += 1
        for layer in range(self.config.num_layers):
            shape = self.config.layer_geometry(layer)
            pairs = [
                self.prompt_kv(prompt, start + row, layer)
                if prompt is not None
                else _kv_of(("noise", request_id, start + row, self.versions), self.config, layer)
                for row in range(count)
            ]
            keys = np.stack([pair[0] for pair in pairs]) if pairs else np.zeros((0, shape.num_heads, shape.head_dim))
            values = (
                np.stack([pair[1] for pair in pairs]) if pairs else np.zeros((0, shape.num_heads, shape.value_width))
            )
            rows = self.expected[request_id].rows[layer]
            for row in range(count):
                rows.pop(start + row, None)  # unknown until the write returns
            self.manager.write(
                layer, slots, BackendUnderTest.native(self.manager, keys), BackendUnderTest.native(self.manager, values)
            )
            for row in range(count):
                rows[start + row] = (keys[row], values[row])

    def decode_step(self, request_ids: list[str]) -> None:
        """One token more for each request, through a planned step, every layer written and attended."""
        handles = [self.handles[request_id] for request_id in request_ids]
        positions = [handle.num_tokens() for handle in handles]
        step = self.manager.begin_step(handles, 1)
        self.versions += 1
        for layer in range(self.config.num_layers):
            pairs = [
                _kv_of(("noise", request_id, position, self.versions), self.config, layer)
                for request_id, position in zip(request_ids, positions, strict=True)
            ]
            for request_id, position in zip(request_ids, positions, strict=True):
                self.expected[request_id].rows[layer].pop(position, None)
            keys = np.stack([pair[0] for pair in pairs])
            values = np.stack([pair[1] for pair in pairs])
            step.write(
                layer, BackendUnderTest.native(self.manager, keys), BackendUnderTest.native(self.manager, values)
            )
            for request_id, position, pair in zip(request_ids, positions, pairs, strict=True):
                self.expected[request_id].rows[layer][position] = pair
            step.attention(layer, BackendUnderTest.native(self.manager, keys))

    def fork(self, parent: str, child: str) -> None:
        self.handles[child] = self.manager.fork(self.handles[parent], child)
        source = self.expected[parent]
        self.expected[child] = _Expected(list(source.tokens), [dict(rows) for rows in source.rows])

    def rewrite(self, request_id: str, start: int, stop: int) -> None:
        """Rewrite positions ``start .. stop - 1``, moved past blocks a window released."""
        handle = self.handles[request_id]
        held = max(table.first_logical for table in handle.block_tables()) * self.config.block_size
        start, stop = start + held, min(stop + held, handle.num_tokens())
        slots = self.manager.writable_slots(handle, start, stop)
        self.write(request_id, slots, start, None)  # new K/V: a cached copy must not change

    def attend(self) -> None:
        handles = [h for h in self.handles.values() if not h.is_swapped_out()]
        shape = self.config.layer_geometry(0)
        query = BackendUnderTest.native(self.manager, np.ones((len(handles), shape.num_heads, shape.head_dim)) / 8)
        self.manager.paged_attention(0, query, self.manager.page_table(handles))

    def fill_pool(self) -> None:
        stats = self.manager.stats()
        blocks = (stats.free_blocks + stats.cached_blocks) // self.config.num_groups  # a block per group
        self.handles["d"] = self.manager.allocate(
            AllocationRequest("d", initial_tokens=blocks * self.config.block_size)
        )
        self.expected["d"] = _Expected(rows=[{} for _ in range(self.config.num_layers)])

    def gather_all(self) -> None:
        for handle in list(self.handles.values()):
            if not handle.is_swapped_out():
                for layer in range(self.config.num_layers):
                    self.manager.gather(handle, layer)

    def deallocate(self, request_id: str) -> None:
        self.manager.deallocate(request_id)
        del self.handles[request_id]
        del self.expected[request_id]

    # -- checks ------------------------------------------------------------------------------

    def mismatches(self) -> list[str]:
        """Every live request's known K/V that the pool does not hold bit for bit."""
        problems: list[str] = []
        for request_id, handle in self.handles.items():
            if handle.is_swapped_out():
                continue
            tables = handle.block_tables()
            for layer in range(self.config.num_layers):
                low = tables[self.config.layer_place(layer)[0]].first_logical * self.config.block_size
                keys, values = self.manager.gather(handle, layer)
                host_keys = BackendUnderTest.host(self.manager, keys)
                host_values = BackendUnderTest.host(self.manager, values)
                for position, (key, value) in sorted(self.expected[request_id].rows[layer].items()):
                    if position < low or position >= handle.num_tokens():
                        continue
                    row = position - low
                    if not (np.array_equal(host_keys[row], key) and np.array_equal(host_values[row], value)):
                        problems.append(f"request {request_id!r} layer {layer} position {position} changed")
        return problems


@dataclass(frozen=True)
class FaultReport:
    """What :func:`run_fault_injection` covered.

    Attributes:
        storage_calls: the storage calls of the script, in order (each one an injection
            point, injected before and after the call).
        injections: the runs with a fault injected (``2 * len(storage_calls)``).
        failures: one line per broken promise (empty when the backend passes).
    """

    storage_calls: tuple[str, ...]
    injections: int
    failures: tuple[str, ...]

    @property
    def kinds(self) -> frozenset[str]:
        """The storage methods the script called."""
        return frozenset(self.storage_calls)

    def check(self, claims: Callable[[str], bool], context: str = "") -> None:
        """Assert that the script called every storage method the backend's ``claims`` imply
        (write, gather, attention; copies with fork; host copies with swap) and that no
        injected fault broke a promise; ``context`` leads each message."""
        expected = {"write", "gather", "paged_attention"}
        if claims("fork"):
            expected.add("copy_blocks")
        if claims("swap"):
            expected |= {"blocks_to_host", "blocks_from_host"}
        assert expected <= self.kinds, f"{context}the script never called {sorted(expected - self.kinds)}"
        shown = "\n".join(self.failures[:5])
        assert not self.failures, (
            f"{context}{len(self.failures)} of {self.injections} injected faults broke a promise:\n{shown}"
        )


def _faulty_manager(
    backend: BackendUnderTest,
    config: CacheConfig,
    fail_at: int | None,
    when: When,
    fault: type[BaseException] = InjectedFaultError,
) -> Manager:
    inner = backend.manager(config).storage
    storage = FaultyStorage(inner, fail_at, when, fault)
    factory = backend.spec.manager_factory
    grouped: dict[str, Any] = {"config": config} if config.num_groups > 1 else {}
    if factory is not None:
        made = factory(storage, backend=backend.name, placement="contiguous", **grouped)
        assert isinstance(made, PagedKvCacheManager), f"{backend.name}'s manager_factory returned {type(made).__name__}"
        return made
    return PagedKvCacheManager(storage, backend=backend.name, **grouped)


def check_after_fault(script: FaultScript) -> list[tuple[str, str]]:
    """Check a manager after a fault: its records consistent, every live request's known
    K/V intact, and nothing leaked once every request is deallocated and ``gc`` ran.

    Returns:
        ``(kind, problem)`` per broken promise, ``kind`` one of ``"invariants"``,
        ``"corruption"`` and ``"leak"``.
    """
    manager = script.manager
    try:
        manager.check_invariants()
    except AssertionError as exc:
        return [("invariants", f"invariants broken: {exc}")]
    problems = [("corruption", problem) for problem in script.mismatches()]
    for request_id in list(script.handles):
        script.deallocate(request_id)
    manager.gc()
    stats = manager.stats()
    if stats.used_blocks or stats.free_blocks != stats.total_blocks:
        problems.append(
            (
                "leak",
                f"after deallocating everything and gc, {stats.used_blocks} blocks are in use and "
                f"{stats.free_blocks} of {stats.total_blocks} free: blocks leaked",
            )
        )
    try:
        manager.check_invariants()
    except AssertionError as exc:
        problems.append(("invariants", f"invariants broken after cleanup: {exc}"))
    return problems


def _check_run(script: FaultScript, label: str, failures: list[str]) -> None:
    failures.extend(f"{label}: {problem}" for _, problem in check_after_fault(script))


def run_fault_injection(
    backend: BackendUnderTest,
    fault: type[BaseException] = InjectedFaultError,
    *,
    hybrid: bool = False,
    layer_specs: tuple[LayerSpec, ...] | None = None,
) -> FaultReport:
    """Run the script once per storage call and per side (before/after), failing that call
    with ``fault`` (any exception class, ``KeyboardInterrupt`` subclasses included). With
    ``hybrid``, on a pool of a full and a sliding layer (window 5: two KV-cache groups); with
    ``layer_specs``, on a pool of those layers (layers of their own geometry).

    Returns:
        The calls covered and every failure found (see the module docstring).
    """
    fields: dict[str, Any] = {"num_blocks": 14, "block_size": 4}
    if backend.claims("prefix_caching"):
        fields["enable_prefix_caching"] = True
    if hybrid:
        fields.update(num_blocks=28, num_layers=2, layer_specs=(LayerSpec(), LayerSpec(window=5)))
    if layer_specs is not None:
        fields.update(num_layers=len(layer_specs), layer_specs=layer_specs)
    config = backend.config(**fields)
    if config.num_groups > 1:  # each group takes its own blocks
        config = replace(config, num_blocks=14 * config.num_groups)
    failures: list[str] = []

    clean = FaultScript(_faulty_manager(backend, config, None, "before"), backend.claims)
    for _, step in clean.steps():
        step()
    storage = clean.manager.storage
    assert isinstance(storage, FaultyStorage)
    calls = tuple(storage.calls)
    _check_run(clean, "without a fault", failures)

    injections = 0
    for fail_at in range(len(calls)):
        for when in ("before", "after"):
            manager = _faulty_manager(backend, config, fail_at, when, fault)
            script = FaultScript(manager, backend.claims)
            faulty = manager.storage
            assert isinstance(faulty, FaultyStorage)
            label = f"fault {when} storage call {fail_at} ({calls[fail_at]})"
            for name, step in script.steps():
                try:
                    step()
                except fault:
                    label = f"{label} in step {name!r}"
                    break
            injections += 1
            if faulty.fired is None:
                failures.append(f"{label}: the script made fewer storage calls than without a fault")
                continue
            faulty.fail_at = None
            _check_run(script, label, failures)
    return FaultReport(calls, injections, tuple(failures))
