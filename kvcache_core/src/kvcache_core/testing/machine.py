"""A Hypothesis state machine driving the backend under test and the NumPy reference in lockstep.

Both managers get the same configuration and placement, so every operation must give
the same outcome on both: the same slots, the same block tables, the same error class,
the same K/V bit for bit (values are drawn representable in the pool's dtype), and
attention within the dtype's tolerance. After every step both managers' invariants are
checked and the backend's figures are compared with the reference's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvcache_core.config import AllocationRequest, CacheConfig
from kvcache_core.device import Device
from kvcache_core.discovery import create_manager
from kvcache_core.errors import KvCacheError, OutOfBlocksError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing._plugin import KitSettings
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest

__all__ = ["ReferenceMachine", "run_reference_machine"]

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]

#: Dtypes the NumPy reference holds; others are compared through a float32 reference.
_REFERENCE_DTYPES = ("float16", "float32", "float64")


def _allocate(manager: Manager, request: AllocationRequest) -> Handle:
    return manager.allocate(request)


def _deallocate(manager: Manager, request_id: str) -> None:
    manager.deallocate(request_id)


def _outcome(operation: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", operation()
    except KvCacheError as exc:
        return "error", type(exc).__name__


class ReferenceMachine(RuleBasedStateMachine):
    """The backend under test against the NumPy reference; see the module docstring."""

    backend: BackendUnderTest
    config: CacheConfig

    def __init__(self) -> None:
        super().__init__()
        self.subject: Manager = self.backend.manager(self.config)
        reference_dtype = self.config.dtype if self.config.dtype in _REFERENCE_DTYPES else "float32"
        self.reference: Manager = create_manager(
            "numpy", dataclasses.replace(self.config, dtype=reference_dtype, device=Device.parse("cpu"))
        )
        self.handles: dict[str, tuple[Handle, Handle]] = {}
        self.clones: list[tuple[str, Handle]] = []
        self.counter = 0

    # -- helpers ---------------------------------------------------------------------------

    def both(self, operation: Callable[[Manager], Any], what: str) -> tuple[str, Any]:
        """Run ``operation`` on both managers; fail unless the outcomes agree."""
        got = _outcome(lambda: operation(self.subject))
        want = _outcome(lambda: operation(self.reference))
        if got[0] != want[0] or (got[0] == "error" and got[1] != want[1]):
            raise AssertionError(f"{what}: backend {self.backend.name!r} gave {got}, the NumPy reference {want}")
        return got

    def pick(self, index: int) -> tuple[str, Handle, Handle]:
        request_id = sorted(self.handles)[index % len(self.handles)]
        subject, reference = self.handles[request_id]
        return request_id, subject, reference

    # -- rules -----------------------------------------------------------------------------

    @rule(
        initial=st.integers(0, 14),
        limit=st.one_of(st.none(), st.integers(1, 40)),
    )
    def allocate(self, initial: int, limit: int | None) -> None:
        request_id = f"r{self.counter}"
        self.counter += 1
        if limit is not None:
            limit = max(limit, initial) or 1

        def run(manager: Manager) -> Any:
            return manager.allocate(AllocationRequest(request_id, initial_tokens=initial, max_sequence_length=limit))

        kind, _ = self.both(run, f"allocate({request_id!r}, initial_tokens={initial}, max={limit})")
        if kind == "ok":
            subject = self.subject.get_handle(request_id)
            reference = self.reference.get_handle(request_id)
            assert subject is not None
            assert reference is not None
            assert subject.block_table() == reference.block_table(), f"allocate({request_id!r}): tables differ"
            self.handles[request_id] = (subject, reference)

    @precondition(lambda self: bool(self.handles))
    @rule(index=st.integers(0, 1 << 16), count=st.integers(0, 9))
    def extend(self, index: int, count: int) -> None:
        request_id, subject, reference = self.pick(index)
        got = _outcome(lambda: self.subject.extend(subject, count))
        want = _outcome(lambda: self.reference.extend(reference, count))
        assert got[0] == want[0], f"extend({request_id!r}, {count}): backend {got}, reference {want}"
        if got[0] == "ok":
            assert np.array_equal(got[1], want[1]), f"extend({request_id!r}, {count}): slots differ"
        else:
            assert got[1] == want[1], f"extend({request_id!r}, {count}): backend {got}, reference {want}"

    @precondition(lambda self: any(s.num_tokens() for s, _ in self.handles.values()))
    @rule(
        first=st.integers(0, 1 << 16),
        second=st.integers(0, 1 << 16),
        layer=st.integers(0, 1),
        seed=st.integers(0, 2**32 - 1),
    )
    def write(self, first: int, second: int, layer: int, seed: int) -> None:
        """One batched write: a window of one request's tokens plus a window of another's."""
        rng = np.random.default_rng(seed)
        slots: list[np.ndarray[Any, Any]] = []
        for chosen in {self.pick(first)[0], self.pick(second)[0]}:
            handle = self.handles[chosen][0]
            tokens = handle.num_tokens()
            if tokens == 0:
                continue
            start = int(rng.integers(0, tokens))
            stop = int(rng.integers(start + 1, tokens + 1))
            slots.append(handle.block_table().slots(start, stop))
        if not slots:
            return
        slot_array = np.concatenate(slots)
        shape = (len(slot_array), self.config.num_heads, self.config.head_dim)
        keys = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
        values = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
        layer %= self.config.num_layers
        self.subject.write(
            layer,
            slot_array,
            BackendUnderTest.native(self.subject, keys),
            BackendUnderTest.native(self.subject, values),
        )
        self.reference.write(
            layer,
            slot_array,
            BackendUnderTest.native(self.reference, keys),
            BackendUnderTest.native(self.reference, values),
        )

    @precondition(lambda self: bool(self.handles))
    @rule(index=st.integers(0, 1 << 16))
    def clone(self, index: int) -> None:
        request_id, subject, _ = self.pick(index)
        clone = subject.clone_handle()
        assert clone.cache_id() == subject.cache_id()
        assert clone.num_tokens() == subject.num_tokens()
        self.clones.append((request_id, clone))

    @precondition(lambda self: bool(self.handles))
    @rule(index=st.integers(0, 1 << 16))
    def deallocate(self, index: int) -> None:
        request_id, _, _ = self.pick(index)
        self.both(lambda manager: manager.deallocate(request_id), f"deallocate({request_id!r})")
        del self.handles[request_id]

    @rule(request_id=st.sampled_from(["nope", "r0"]))
    def deallocate_unknown_or_again(self, request_id: str) -> None:
        if request_id in self.handles:
            return
        self.both(lambda manager: manager.deallocate(request_id), f"deallocate({request_id!r})")

    @rule(tokens=st.integers(1, 64))
    def exhaust(self, tokens: int) -> None:
        """Fill the pool with requests of ``tokens`` until both refuse, then free them."""
        created: list[str] = []
        while True:
            request_id = f"x{self.counter}"
            self.counter += 1
            kind, error = self.both(
                functools.partial(_allocate, request=AllocationRequest(request_id, initial_tokens=tokens)),
                f"allocate({request_id!r}, initial_tokens={tokens}) while exhausting",
            )
            if kind == "error":
                assert error == OutOfBlocksError.__name__, error
                break
            created.append(request_id)
        for request_id in created:
            self.both(functools.partial(_deallocate, request_id=request_id), f"deallocate({request_id!r})")

    @precondition(lambda self: any(s.num_tokens() for s, _ in self.handles.values()))
    @rule(group=st.sampled_from([1, 2]), seed=st.integers(0, 2**32 - 1))
    def attention(self, group: int, seed: int) -> None:
        """Decode attention of every request holding tokens, compared with the reference."""
        live = [pair for pair in self.handles.values() if pair[0].num_tokens()]
        rng = np.random.default_rng(seed)
        shape = (len(live), self.config.num_heads * group, self.config.head_dim)
        query = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
        layer = int(rng.integers(0, self.config.num_layers))
        got = self.subject.paged_attention(
            layer, BackendUnderTest.native(self.subject, query), self.subject.page_table([s for s, _ in live])
        )
        want = self.reference.paged_attention(
            layer, BackendUnderTest.native(self.reference, query), self.reference.page_table([r for _, r in live])
        )
        rtol, atol = TOLERANCES.get(self.config.dtype, (1e-2, 1e-2))
        got_host, want_host = BackendUnderTest.host(self.subject, got), BackendUnderTest.host(self.reference, want)
        assert np.allclose(got_host, want_host, rtol=rtol, atol=atol), (
            f"attention of layer {layer}: backend {self.backend.name!r} differs from the reference by up to "
            f"{float(np.max(np.abs(got_host - want_host))):.3g}"
        )

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def same_state(self) -> None:
        self.subject.check_invariants()
        self.reference.check_invariants()
        subject_stats = dataclasses.asdict(self.subject.stats())
        reference_stats = dataclasses.asdict(self.reference.stats())
        for figures in (subject_stats, reference_stats):
            figures.pop("total_memory_bytes")
            figures.pop("used_memory_bytes")
        assert subject_stats == reference_stats, f"stats differ: {subject_stats} vs {reference_stats}"
        assert [rid for rid, _ in self.subject.list_handles()] == [rid for rid, _ in self.reference.list_handles()]
        for request_id, (subject, reference) in self.handles.items():
            assert subject.block_table() == reference.block_table(), f"{request_id!r}: tables differ"
            for layer in range(self.config.num_layers):
                got = self.subject.gather(subject, layer)
                want = self.reference.gather(reference, layer)
                for name, native, expected in (("keys", got[0], want[0]), ("values", got[1], want[1])):
                    assert np.array_equal(
                        BackendUnderTest.host(self.subject, native), BackendUnderTest.host(self.reference, expected)
                    ), f"{request_id!r} layer {layer}: gathered {name} differ from the NumPy reference"
        for request_id, clone in self.clones:
            assert clone.is_valid() == (request_id in self.handles), f"clone of {request_id!r}: is_valid wrong"

    def teardown(self) -> None:
        for request_id in list(self.handles):
            self.subject.deallocate(request_id)
        stats = self.subject.stats()
        assert (stats.used_blocks, stats.active_caches) == (0, 0), (
            f"backend {self.backend.name!r} leaked blocks: {stats.used_blocks} in use after every request ended"
        )
        self.subject.check_invariants()


def run_reference_machine(backend: BackendUnderTest, settings: KitSettings) -> None:
    """Run :class:`ReferenceMachine` for every layout of ``backend`` (default dtype)."""
    for layout in backend.kv_layouts:
        config = backend.config(kv_layout=layout, num_blocks=12)
        machine = type(
            f"ReferenceMachine_{backend.name}_{layout}",
            (ReferenceMachine,),
            {"backend": backend, "config": config},
        )
        run_state_machine_as_test(machine, settings=settings.hypothesis())
