"""The kit for offload tiers: :class:`TierCases` runs any :class:`~kvcache_core.offload.tiers.OffloadTier`
(``HostTier``, ``DiskTier``, a third party's) behind every backend, with a fault injected at
every call of a tier and of the storage.

::

    import pytest
    from kvcache_core.testing.tiers import TierCases

    class TestMyTier(TierCases):
        @pytest.fixture
        def kvcache_tier_factory(self, tmp_path):
            return lambda max_bytes, name: MyTier(max_bytes, name=name)

:func:`run_tier_fault_injection` runs a scripted workload (allocate with prefix hits,
eviction that demotes into the tiers, promotion back, a saved prefix cache, the tiers'
figures, ``close()``) over two tiers made by the factory (a small one in front of a large
one, so that blocks also move between them) once without faults, counting the storage and
tier calls, then once per call with that call failing: every storage call before and after
it (as :func:`~kvcache_core.testing.faults.run_fault_injection`), every tier call
(:data:`TIER_CALLS`) raising before or after it and giving back garbage. After each run it
checks what :func:`~kvcache_core.testing.faults.check_after_fault` checks (records
consistent, no live request's K/V changed, nothing leaked), that a tier's exception never
escaped as itself (a miss, or a :class:`~kvcache_core.errors.TierError`), that ``close()``
closed the storage whatever it raised, and that the tiers are free to bind again.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.errors import TierError
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.events import EventHub
from kvcache_core.offload.guarded_tiers import GuardedTiers
from kvcache_core.offload.prefix_file import BlockRecord
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.faults import (
    PROMPT,
    CallInjector,
    FaultScript,
    FaultyStorage,
    InjectedFaultError,
    check_after_fault,
)
from kvcache_core.testing.states import Model, assert_states, state_config, write_attention, write_states, zeros

__all__ = [
    "TIER_CALLS",
    "FaultyTier",
    "TierCases",
    "TierFactory",
    "TierFaultReport",
    "run_tier_fault_injection",
]

#: The members of :class:`~kvcache_core.offload.tiers.OffloadTier` the manager calls; each call of
#: one is an injection point (``contains`` is ``key in tier``).
TIER_CALLS = ("name", "max_bytes", "used_bytes", "bind", "put", "peek", "discard", "hashes", "contains", "clear")

#: Makes a new tier: ``factory(max_bytes, name)``.
TierFactory = Callable[[int, str], OffloadTier]

Manager = PagedKvCacheManager[Any]

SECOND_PROMPT = tuple(range(201, 214))  # 13 tokens: three full blocks of 4 and one token more


class Interrupted(KeyboardInterrupt):
    """Ctrl-C arriving inside a tier or storage call."""


class FaultyTier(CallInjector):
    """An :class:`~kvcache_core.offload.tiers.OffloadTier` wrapper whose ``fail_at``-th call fails.

    Calls of :data:`TIER_CALLS` are counted in the shared ``counter`` (so the calls of
    several tiers are numbered together). The armed call raises ``counter.fault`` before
    (``when="before"``) or after (``"after"``) the wrapped tier's call, or gives back
    garbage (``"garbage"``): a name that is no str, byte counts that are no ints, a
    record with its values' bytes flipped (or a string for no record), a ``put`` result
    that is no list, keys that are no bytes, the opposite answer to ``key in tier``, and a
    ``bind``, ``discard`` or ``clear`` that does nothing.
    """

    def __init__(self, inner: OffloadTier, counter: CallInjector) -> None:
        super().__init__()
        self._inner = inner
        self._counter = counter

    @property
    def counter(self) -> CallInjector:
        return self._counter

    def _tier_call(self, name: str, call: Callable[[], Any], garbage: Callable[[Any], Any]) -> Any:
        if self._counter.when != "garbage":
            return self._call(name, call)
        if not self.armed(name):
            return call()
        self._counter.fired = name
        return garbage(call)

    @property
    def name(self) -> str:
        result: str = self._tier_call("name", lambda: self._inner.name, lambda call: 42)
        return result

    @property
    def max_bytes(self) -> int:
        result: int = self._tier_call("max_bytes", lambda: self._inner.max_bytes, lambda call: "many")
        return result

    @property
    def used_bytes(self) -> int:
        result: int = self._tier_call("used_bytes", lambda: self._inner.used_bytes, lambda call: "some")
        return result

    def bind(self, config: CacheConfig) -> None:
        self._tier_call("bind", lambda: self._inner.bind(config), lambda call: None)

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        result: list[BlockRecord | bytes] = self._tier_call(
            "put", lambda: self._inner.put(record), lambda call: (call(), "let go")[1]
        )
        return result

    def peek(self, key: bytes, /) -> BlockRecord | None:
        result: BlockRecord | None = self._tier_call("peek", lambda: self._inner.peek(key), _flipped)
        return result

    def discard(self, key: bytes, /) -> None:
        self._tier_call("discard", lambda: self._inner.discard(key), lambda call: None)

    def hashes(self) -> list[bytes]:
        result: list[bytes] = self._tier_call("hashes", self._inner.hashes, lambda call: [*call(), "not a key", 7])
        return result

    def __contains__(self, key: object, /) -> bool:
        result: bool = self._tier_call("contains", lambda: key in self._inner, lambda call: not call())
        return result

    def clear(self) -> None:
        self._tier_call("clear", self._inner.clear, lambda call: None)


def _flipped(call: Callable[[], Any]) -> Any:
    """The record ``call()`` gives back with one byte of its values flipped (same shape and
    dtype: only a checksum tells), or a string where it gives none."""
    record = call()
    if not isinstance(record, BlockRecord):
        return "no record"
    values = np.array(record.values, copy=True)
    values.reshape(-1).view(np.uint8)[0] ^= 0xFF
    return BlockRecord(
        record.block_hash, record.parent_hash, record.salt, record.token_ids, record.keys, values, record.group
    )


@dataclass
class _TierScript(FaultScript):
    """The tier workload: prefix hits, demotion by ``gc`` and by eviction, promotion into
    requests that reserved blocks for their whole prompt."""

    directory: Path = Path()

    def steps(self) -> list[tuple[str, Callable[[], None]]]:
        return [
            ("allocate a", lambda: self.allocate("a", PROMPT)),
            ("prefill a", lambda: self.extend_and_write("a", len(PROMPT), PROMPT)),
            ("allocate b with a prefix hit", lambda: self.allocate("b", PROMPT)),
            ("prefill the rest of b", lambda: self.extend_and_write("b", None, PROMPT)),
            ("deallocate a", lambda: self.deallocate("a")),
            ("deallocate b", lambda: self.deallocate("b")),
            ("gc: the prompt's blocks are demoted", lambda: _discard_result(self.manager.gc())),
            ("allocate c, promoting the prompt", lambda: self.allocate("c", PROMPT, len(PROMPT))),
            ("prefill the rest of c", lambda: self.extend_and_write("c", None, PROMPT)),
            ("allocate f with a second prompt", lambda: self.allocate("f", SECOND_PROMPT)),
            ("prefill f", lambda: self.extend_and_write("f", len(SECOND_PROMPT), SECOND_PROMPT)),
            ("deallocate f", lambda: self.deallocate("f")),
            ("allocate d over every free and cached block (eviction demotes)", self.fill_pool),
            ("deallocate d", lambda: self.deallocate("d")),
            ("allocate e, promoting the second prompt", lambda: self.allocate("e", SECOND_PROMPT, len(SECOND_PROMPT))),
            ("prefill the rest of e", lambda: self.extend_and_write("e", None, SECOND_PROMPT)),
            ("save the prefix cache", self.save),
            ("read the tiers' figures", lambda: _discard_result(self.manager.tier_stats())),
            ("gather every request", self.gather_all),
        ]

    def save(self) -> None:
        self.manager.save_prefix_cache(self.directory / "prefix.safetensors")


def _discard_result(_: object) -> None:
    return None


@dataclass(frozen=True)
class TierFaultReport:
    """What :func:`run_tier_fault_injection` covered and found.

    Attributes:
        storage_calls: the storage calls of the script (each injected before and after).
        tier_calls: the tier calls of the script, ``close()`` included (each injected with
            every mode: before, after, garbage).
        storage_injections, tier_injections: the runs with a fault injected.
        promoted: blocks the script promoted from the tiers without a fault.
        leaks: runs that leaked blocks. corruptions: runs after which a live request's K/V
            differed from what was written.
        failures: one line per broken promise (empty when the tier and backend pass).
    """

    storage_calls: tuple[str, ...]
    tier_calls: tuple[str, ...]
    storage_injections: int
    tier_injections: int
    promoted: int
    leaks: int
    corruptions: int
    failures: tuple[str, ...]

    @property
    def injections(self) -> int:
        return self.storage_injections + self.tier_injections

    @property
    def tier_kinds(self) -> frozenset[str]:
        """The tier members the script called."""
        return frozenset(self.tier_calls)


@dataclass
class _Run:
    """One run's injectors and what it found."""

    storage_injector: FaultyStorage | None = None
    tier_injector: CallInjector | None = None
    leaks: int = 0
    corruptions: int = 0
    promoted: int = 0


def _config(backend: BackendUnderTest, hybrid: bool = False) -> CacheConfig:
    if hybrid:  # a full and a sliding layer (window 5): two KV-cache groups
        return backend.config(
            num_blocks=28,
            block_size=4,
            num_layers=2,
            enable_prefix_caching=True,
            layer_specs=(LayerSpec(), LayerSpec(window=5)),
        )
    return backend.config(num_blocks=14, block_size=4, enable_prefix_caching=True)


def _one_run(
    backend: BackendUnderTest,
    make_tier: TierFactory,
    directory: Path,
    storage_fault: tuple[int, str] | None,
    tier_fault: tuple[int, str] | None,
    fault: type[BaseException],
    label: str,
    failures: list[str],
    hybrid: bool = False,
) -> tuple[_Run, tuple[str, ...], tuple[str, ...]]:
    """Run the script once with at most one fault; return what it found and the calls made."""
    config = _config(backend, hybrid)
    inner = backend.manager(config).storage
    storage_at, storage_when = storage_fault or (None, "before")
    tier_at, tier_when = tier_fault or (None, "before")
    storage = FaultyStorage(inner, storage_at, "after" if storage_when == "after" else "before", fault)
    counter = CallInjector(tier_at, tier_when, fault)
    near = config.bytes_per_block + 1200  # one block: what it lets go moves to the far tier
    tiers: list[OffloadTier] = [
        FaultyTier(make_tier(near, "near"), counter),
        FaultyTier(make_tier(64 * config.bytes_per_block + (1 << 16), "far"), counter),
    ]
    run = _Run(storage, counter)
    is_tier_exception = tier_fault is not None and issubclass(fault, Exception)

    def escaped(exc: BaseException, where: str) -> None:
        if tier_fault is not None and isinstance(exc, TierError):
            return  # a tier's failure surfaced as a TierError
        if isinstance(exc, fault) and not is_tier_exception:
            return  # the storage's exception passes unchanged; an interrupt propagates
        failures.append(f"{label}: {where} raised {exc!r} (a tier's failure must be a miss or a TierError)")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # every miss warns
        try:
            grouped: dict[str, Any] = {"config": config} if config.num_groups > 1 else {}
            manager = PagedKvCacheManager(storage, backend=backend.name, tiers=tiers, **grouped)
        except BaseException as exc:
            escaped(exc, "creating the manager")
            calls = tuple(counter.calls)
            counter.fail_at = None
            _check_released(backend, config, tiers, label, failures)
            return run, tuple(storage.calls), calls
        script = _TierScript(manager, backend.claims, directory=directory)
        for name, step in script.steps():
            try:
                step()
            except BaseException as exc:
                escaped(exc, f"step {name!r}")
                break
        storage_fired, tier_fired = storage.fired, counter.fired
        armed = (storage.fail_at, counter.fail_at)
        storage.fail_at = counter.fail_at = None
        storage_calls, tier_calls = len(storage.calls), len(counter.calls)
        try:
            run.promoted = sum(tier.hits for tier in manager.tier_stats())
        except TierError as exc:  # only a tier's garbage byte counts may refuse the figures
            if tier_fault is None or tier_fault[1] != "garbage":
                failures.append(f"{label}: the tiers' figures are refused after the fault: {exc}")
        for kind, problem in check_after_fault(script):
            failures.append(f"{label}: {problem}")
            run.leaks += kind == "leak"
            run.corruptions += kind == "corruption"
        del storage.calls[storage_calls:]
        del counter.calls[tier_calls:]
        storage.fired, counter.fired = storage_fired, tier_fired
        storage.fail_at, counter.fail_at = armed
        try:
            manager.close()
        except BaseException as exc:
            escaped(exc, "close()")
        if not storage.closed:
            failures.append(f"{label}: close() did not close the storage")
        storage.fail_at = counter.fail_at = None
    if (storage_fault is not None and storage.fired is None) or (tier_fault is not None and counter.fired is None):
        failures.append(f"{label}: the script made fewer calls than without a fault")
    calls = tuple(counter.calls)
    _check_released(backend, config, tiers, label, failures)
    return run, tuple(storage.calls), calls


def _check_released(
    backend: BackendUnderTest, config: CacheConfig, tiers: list[OffloadTier], label: str, failures: list[str]
) -> None:
    """The tiers of a closed (or never created) manager bind to a new one (bound as a
    manager binds them, without a pool)."""
    try:
        GuardedTiers(tiers, config, EventHub(config.block_size)).close()
    except TierError as exc:
        failures.append(f"{label}: the tiers stay bound: {exc}")


def run_tier_fault_injection(
    backend: BackendUnderTest,
    make_tier: TierFactory,
    directory: Path,
    fault: type[BaseException] = InjectedFaultError,
    *,
    storage_faults: bool = True,
    modes: tuple[str, ...] = ("before", "after", "garbage"),
    hybrid: bool = False,
) -> TierFaultReport:
    """Run the tier script once per storage call (before and after it) and once per tier
    call and mode (``"before"``, ``"after"``, ``"garbage"``; an interrupt ``fault`` is not
    garbage: that mode is left out for it), failing that call with ``fault``.

    Args:
        backend: the backend under test (needs prefix caching and host transfers).
        make_tier: ``make_tier(max_bytes, name)``, a new tier each call.
        directory: where the script saves its prefix cache.
        fault: the exception class injected.
        storage_faults: inject at the storage calls too.
        modes: the tier modes injected.
        hybrid: on a pool of a full and a sliding layer (window 5: two KV-cache groups).

    Returns:
        The counts and every failure found (see the module docstring).
    """
    failures: list[str] = []
    clean, storage_calls, tier_calls = _one_run(
        backend, make_tier, directory, None, None, fault, "without a fault", failures, hybrid
    )
    leaks, corruptions = clean.leaks, clean.corruptions
    storage_injections = tier_injections = 0
    if storage_faults:
        for index, name in enumerate(storage_calls):
            for when in ("before", "after"):
                label = f"fault {when} storage call {index} ({name})"
                run, _, _ = _one_run(backend, make_tier, directory, (index, when), None, fault, label, failures, hybrid)
                storage_injections += 1
                leaks += run.leaks > 0
                corruptions += run.corruptions > 0
    tier_modes = tuple(mode for mode in modes if mode != "garbage" or issubclass(fault, Exception))
    for index, name in enumerate(tier_calls):
        for mode in tier_modes:
            label = f"fault {mode} tier call {index} ({name})"
            run, _, _ = _one_run(backend, make_tier, directory, None, (index, mode), fault, label, failures, hybrid)
            tier_injections += 1
            leaks += run.leaks > 0
            corruptions += run.corruptions > 0
    return TierFaultReport(
        storage_calls,
        tier_calls,
        storage_injections,
        tier_injections,
        clean.promoted,
        leaks,
        corruptions,
        tuple(failures),
    )


# -- the cases ---------------------------------------------------------------------------------


def host_tier_factory(max_bytes: int, name: str) -> OffloadTier:
    """A :class:`~kvcache_core.offload.tiers.HostTier` (the kit's default tier)."""
    return HostTier(max_bytes, name=name)


def disk_tier_factory(directory: Path) -> TierFactory:
    """A factory of :class:`~kvcache_core.offload.tiers.DiskTier` objects, each in a new
    directory under ``directory``."""

    def make(max_bytes: int, name: str) -> OffloadTier:
        return DiskTier(tempfile.mkdtemp(prefix=f"{name}-", dir=directory), max_bytes, name=name)

    return make


class TierCases:
    """Cases any offload tier runs behind every backend: subclass it and give the
    ``kvcache_tier_factory`` fixture (``factory(max_bytes, name)`` -> a new tier); by
    default it makes :class:`~kvcache_core.offload.tiers.HostTier` objects."""

    #: Whether the fault-injection case also fails each storage call of the script (a tier
    #: kit run beside KvCacheConformance, which runs them with HostTier, may leave them out).
    inject_storage_faults: ClassVar[bool] = True

    @pytest.fixture
    def kvcache_tier_factory(self) -> TierFactory:
        return host_tier_factory

    @staticmethod
    def _needs_tiers(backend: BackendUnderTest) -> None:
        missing = [name for name in ("prefix_caching", "swap") if not backend.claims(name)]
        if missing:
            pytest.skip(f"offload tiers need {' and '.join(missing)} (host transfers), unclaimed")
        pytest.importorskip("safetensors")

    @classmethod
    def _pool_and_tier(cls, backend: BackendUnderTest, factory: TierFactory) -> tuple[CacheConfig, OffloadTier]:
        """The cases' pool config and a tier of ``factory`` room for 64 of its blocks (skips
        where the backend cannot run tiers)."""
        cls._needs_tiers(backend)
        config = _config(backend)
        return config, factory(64 * config.bytes_per_block + (1 << 16), "tier")

    def test_an_evicted_prefix_comes_back_from_the_tier_bit_exact(
        self, kvcache_backend: BackendUnderTest, kvcache_tier_factory: TierFactory
    ) -> None:
        config, tier = self._pool_and_tier(kvcache_backend, kvcache_tier_factory)
        with kvcache_backend.manager(config, tiers=[tier]) as manager:
            script = FaultScript(manager, kvcache_backend.claims)
            script.allocate("a", PROMPT)
            script.extend_and_write("a", len(PROMPT), PROMPT)
            script.deallocate("a")
            manager.gc()
            assert manager.tier_stats()[0].blocks == 2, "the prompt's two full blocks were not demoted"
            script.allocate("b", PROMPT)
            assert script.handles["b"].num_cached_tokens() == 8, "the demoted blocks were not promoted"
            assert script.mismatches() == []
            assert manager.tier_stats()[0].hits == 2
            manager.check_invariants()

    def test_a_state_checkpoint_goes_with_its_block_and_comes_back_bit_exact(
        self, kvcache_backend: BackendUnderTest, kvcache_tier_factory: TierFactory
    ) -> None:
        self._needs_tiers(kvcache_backend)
        if not kvcache_backend.claims("state_layers"):
            pytest.skip("state checkpoints in tiers need 'state_layers', unclaimed")
        config = state_config(kvcache_backend, enable_prefix_caching=True)
        room = 64 * (config.bytes_per_block + config.states.bytes_per_slot) + (1 << 16)
        rng = np.random.default_rng(12)
        prompt = tuple(range(10, 23))  # three full blocks of 4, one token more
        with kvcache_backend.manager(config, tiers=[kvcache_tier_factory(room, "tier")]) as manager:
            first = manager.allocate(AllocationRequest("first", prompt_token_ids=prompt))
            models: dict[str, Model] = {"first": zeros(config)}
            after: list[Model] = []
            for block in range(3):
                write_attention(manager, manager.begin_step([first], 4), rng)
                write_states(manager, [first], rng, models)
                after.append(dict(models["first"]))
                if block < 2:  # the third block has no checkpoint
                    assert manager.begin_step([first], 0).checkpoint_states() == 1
            manager.deallocate("first")
            manager.gc()  # blocks and checkpoints leave the pool for the tier
            assert manager.stats().checkpoint_state_slots == 0, "a demoted block's checkpoint stayed in the pool"
            second = manager.allocate(AllocationRequest("second", prompt_token_ids=prompt))
            assert second.num_cached_tokens() == 8, "a hit through the tier must stop at its last checkpoint"
            models["second"] = after[1]
            assert_states(manager, [second], models, "a checkpoint promoted from the tier")
            manager.check_invariants()

    def test_a_tier_is_bound_to_one_manager_until_it_closes(
        self, kvcache_backend: BackendUnderTest, kvcache_tier_factory: TierFactory
    ) -> None:
        config, tier = self._pool_and_tier(kvcache_backend, kvcache_tier_factory)
        first = kvcache_backend.manager(config, tiers=[tier])
        with pytest.raises(TierError, match="bound to another manager"):
            kvcache_backend.manager(config, tiers=[tier])
        script = FaultScript(first, kvcache_backend.claims)
        script.allocate("a", PROMPT)
        script.extend_and_write("a", len(PROMPT), PROMPT)
        script.deallocate("a")
        first.gc()
        script.allocate("b", PROMPT)
        assert script.handles["b"].num_cached_tokens() == 8, "the refused second manager took the tier"
        first.close()
        kvcache_backend.manager(config, tiers=[tier]).close()

    def test_a_fault_at_any_tier_or_storage_call_leaks_nothing_and_corrupts_no_request(
        self, kvcache_backend: BackendUnderTest, kvcache_tier_factory: TierFactory, tmp_path: Path
    ) -> None:
        self._needs_tiers(kvcache_backend)
        report = run_tier_fault_injection(
            kvcache_backend, kvcache_tier_factory, tmp_path, storage_faults=self.inject_storage_faults
        )
        assert report.promoted >= 5, f"the script promoted {report.promoted} blocks without a fault"
        assert {"bind", "put", "peek", "discard", "hashes", "contains", "clear"} <= report.tier_kinds
        shown = "\n".join(report.failures[:5])
        assert not report.failures, (
            f"{len(report.failures)} of {report.injections} injected faults broke a promise "
            f"({report.leaks} runs leaked, {report.corruptions} corrupted a request):\n{shown}"
        )

    def test_an_interrupt_at_any_tier_call_leaks_nothing_and_corrupts_no_request(
        self, kvcache_backend: BackendUnderTest, kvcache_tier_factory: TierFactory, tmp_path: Path
    ) -> None:
        self._needs_tiers(kvcache_backend)
        report = run_tier_fault_injection(
            kvcache_backend, kvcache_tier_factory, tmp_path, Interrupted, storage_faults=False
        )
        shown = "\n".join(report.failures[:5])
        assert not report.failures, (
            f"{len(report.failures)} of {report.injections} interrupts broke a promise:\n{shown}"
        )

    def test_close_closes_the_storage_and_frees_the_tier_whatever_the_tier_raises(
        self, kvcache_backend: BackendUnderTest, kvcache_tier_factory: TierFactory
    ) -> None:
        self._needs_tiers(kvcache_backend)
        config = _config(kvcache_backend)
        for fault in (InjectedFaultError, Interrupted):
            offset = 0
            while True:  # each tier call close() makes, in turn
                counter = CallInjector(None, "before", fault)
                tier = FaultyTier(kvcache_tier_factory(64 * config.bytes_per_block + (1 << 16), "tier"), counter)
                storage = FaultyStorage(kvcache_backend.manager(config).storage)
                manager = PagedKvCacheManager(storage, backend=kvcache_backend.name, tiers=[tier])
                counter.fail_at = len(counter.calls) + offset
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    try:
                        manager.close()
                    except Interrupted:
                        assert fault is Interrupted, "close() raised an interrupt nobody injected"
                if counter.fired is None:
                    break
                assert storage.closed, f"close() left the storage open when the tier's {counter.fired} raised"
                assert manager.closed
                counter.fail_at = None
                kvcache_backend.manager(config, tiers=[tier]).close()  # freed
                offset += 1
            assert offset >= 1, "close() made no tier call"
