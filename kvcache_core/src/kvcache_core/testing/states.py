"""The kit's cases for recurrent-state layers (``LayerSpec(state=...)``): the state pool's
slots, its policies (fork copies, swap carries bit-identical, truncate refused, slots run
out atomically), a lockstep walk against a plain model, and fault injection at every
storage call. They run where the backend claims ``"state_layers"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.contract.states import STATE_DTYPES, StateArray, StateSpec
from kvcache_core.errors import OutOfStateSlotsError, StateRollbackError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.faults import CallInjector, FaultyStorage, InjectedFaultError

__all__ = ["StateCases"]

FloatArray = npt.NDArray[np.float64]
Manager = PagedKvCacheManager[Any]
#: A request's states in the model: ``(layer, array name) -> [*shape]`` float64.
Model = dict[tuple[int, str], FloatArray]

#: Two arrays of different ranks, as a Mamba layer keeps (a convolution window, an SSM state).
STATE = StateSpec(arrays=(("conv", (6, 3)), ("recurrent", (2, 3, 4))))
#: State, attention, state, attention: the attention layers form one KV-cache group.
LAYERS = (LayerSpec(state=STATE), LayerSpec(), LayerSpec(state=STATE), LayerSpec())


def state_config(
    backend: BackendUnderTest,
    dtype: str | None = None,
    slots: int = 4,
    layers: tuple[LayerSpec, ...] = LAYERS,
    **fields: Any,
) -> CacheConfig:
    """A small pool with state layers on ``backend`` (``layers``: :data:`LAYERS` by default),
    states in ``dtype`` (the backend's default dtype by default)."""
    spec = STATE
    if dtype is not None:
        spec = StateSpec(arrays=tuple(StateArray(array.name, array.shape, dtype) for array in STATE.arrays))
    layers = tuple(
        LayerSpec(layer.window, layer.chunk, spec, layer.keeps_kv) if layer.state is not None else layer
        for layer in layers
    )
    fields = {"num_layers": len(layers), "layer_specs": layers, "state_slots": slots, **fields}
    return backend.config(**fields)


def state_dtypes(backend: BackendUnderTest) -> tuple[str, ...]:
    """The dtypes the kit puts states in: those the backend claims that states may have."""
    return tuple(dtype for dtype in backend.unquantized_dtypes if dtype in STATE_DTYPES)


def state_arrays(config: CacheConfig) -> list[tuple[int, StateArray]]:
    """Every ``(layer, array)`` of a config's state layers."""
    return list(config.states.arrays)


def write_states(
    manager: Manager, handles: list[PagedKvCacheHandle[Any]], rng: np.random.Generator, models: dict[str, Model]
) -> None:
    """Write representable random states for ``handles`` through a step of 0 new tokens,
    recording them in ``models``."""
    step = manager.begin_step(handles, 0)
    for layer, array in state_arrays(manager.config):
        values = BackendUnderTest.representable(rng.standard_normal((len(handles), *array.shape)), array.dtype)
        step.write_state(layer, array.name, BackendUnderTest.native(manager, values, array.dtype))
        for row, handle in enumerate(handles):
            models[handle.request_id][layer, array.name] = values[row]


def write_attention(manager: Manager, step: Any, rng: np.random.Generator) -> None:
    """Write random K/V of the step's new tokens in every layer keeping K/V."""
    config = manager.config
    for layer in range(config.num_layers):
        if config.layer_spec(layer).keeps_kv:
            keys = rng.standard_normal((step.num_new_tokens, config.num_heads, config.head_dim))
            native = BackendUnderTest.native(manager, BackendUnderTest.representable(keys, config.dtype))
            step.write(layer, native, native)


def read_states(manager: Manager, handles: list[PagedKvCacheHandle[Any]]) -> list[Model]:
    """Every state of ``handles`` as float64, through a step of 0 new tokens."""
    step = manager.begin_step(handles, 0)
    found: list[Model] = [{} for _ in handles]
    for layer, array in state_arrays(manager.config):
        values = BackendUnderTest.host(manager, step.state(layer, array.name))
        assert values.shape == (len(handles), *array.shape), (
            f"step.state({layer}, {array.name!r}) has shape {values.shape}, expected {(len(handles), *array.shape)}"
        )
        for row in range(len(handles)):
            found[row][layer, array.name] = values[row]
    return found


def zeros(config: CacheConfig) -> Model:
    """A fresh request's states."""
    return {(layer, array.name): np.zeros(array.shape) for layer, array in state_arrays(config)}


def assert_states(
    manager: Manager, handles: list[PagedKvCacheHandle[Any]], models: dict[str, Model], when: str
) -> None:
    """Every state of ``handles`` equals the model, bit for bit."""
    for handle, found in zip(handles, read_states(manager, handles), strict=True):
        for key, expected in models[handle.request_id].items():
            assert np.array_equal(found[key], expected), (
                f"{when}: state {key[1]!r} of layer {key[0]} of request {handle.request_id!r} differs from what was "
                f"written (max difference {np.max(np.abs(found[key] - expected))})"
            )


class StateCases:
    """Cases every backend claiming ``"state_layers"`` runs (through
    :class:`~kvcache_core.testing.KvCacheConformance`)."""

    @pytest.mark.kvcache_requires("state_layers")
    def test_states_start_from_zeros_and_keep_what_a_step_wrote(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(3)
        for dtype in state_dtypes(kvcache_backend):
            manager = kvcache_backend.manager(state_config(kvcache_backend, dtype))
            handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b", "c")]
            models = {handle.request_id: zeros(manager.config) for handle in handles}
            assert_states(manager, handles, models, f"fresh requests ({dtype} states)")
            write_states(manager, handles[:2], rng, models)
            assert_states(manager, handles, models, f"after a step wrote two of three ({dtype} states)")
            manager.close()

    @pytest.mark.kvcache_requires("state_layers")
    def test_a_state_view_holds_the_states_a_copy_holds(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(state_config(kvcache_backend))
        handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b", "c")]
        write_states(manager, handles, np.random.default_rng(5), {handle.request_id: {} for handle in handles})
        step = manager.begin_step(handles[1:], 0)  # slots that follow one another
        for layer, array in state_arrays(manager.config):
            rows = step.state_view(layer, array.name)
            assert rows is not None, f"step.state_view({layer}, {array.name!r}) gave None for slots in a run"
            copy = BackendUnderTest.host(manager, step.state(layer, array.name))
            assert np.array_equal(BackendUnderTest.host(manager, rows), copy), f"state_view({layer}) differs"
        layer, array = state_arrays(manager.config)[0]
        assert manager.begin_step(handles[::-1], 0).state_view(layer, array.name) is None, "slots not ascending"
        manager.close()

    @pytest.mark.kvcache_requires("state_layers")
    def test_attention_layers_beside_state_layers_keep_their_kv(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(4)
        manager = kvcache_backend.manager(state_config(kvcache_backend))
        config = manager.config
        handle = manager.allocate(AllocationRequest("a"))
        step = manager.begin_step([handle], 5)
        written: dict[int, FloatArray] = {}
        for layer in (1, 3):
            keys = BackendUnderTest.representable(
                rng.standard_normal((5, config.num_heads, config.head_dim)), "float32"
            )
            native = BackendUnderTest.native(manager, keys)
            step.write(layer, native, native)
            written[layer] = keys
        for layer, keys in written.items():
            back = BackendUnderTest.host(manager, manager.gather(handle, layer)[0])
            assert np.array_equal(back, keys), f"attention layer {layer} beside state layers lost its keys"
        assert manager.stats().state_memory_bytes == config.states.num_slots * config.states.bytes_per_slot

    @pytest.mark.kvcache_requires("state_layers", "fork")
    def test_a_fork_starts_from_its_parents_states_and_then_diverges(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(5)
        manager = kvcache_backend.manager(state_config(kvcache_backend))
        parent = manager.allocate(AllocationRequest("parent"))
        manager.extend(parent, 3)
        models: dict[str, Model] = {"parent": zeros(manager.config)}
        write_states(manager, [parent], rng, models)
        child = manager.fork(parent, "child")
        models["child"] = dict(models["parent"])
        assert_states(manager, [parent, child], models, "after fork")
        write_states(manager, [child], rng, models)
        assert_states(manager, [parent, child], models, "after the child wrote its states")

    @pytest.mark.kvcache_requires("state_layers", "swap")
    def test_swap_carries_the_states_bit_identical(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(6)
        for dtype in state_dtypes(kvcache_backend):
            manager = kvcache_backend.manager(state_config(kvcache_backend, dtype, slots=2))
            first = manager.allocate(AllocationRequest("first"))
            manager.extend(first, 6)
            models: dict[str, Model] = {"first": zeros(manager.config)}
            write_states(manager, [first], rng, models)
            manager.swap_out("first")
            assert manager.stats().used_state_slots == 0, "a swapped-out request still holds its state slot"
            other = manager.allocate(AllocationRequest("other"))  # takes the freed slot
            models["other"] = zeros(manager.config)
            write_states(manager, [other], rng, models)
            manager.swap_in("first")
            assert_states(manager, [first, other], models, f"after swap_out and swap_in ({dtype} states)")
            manager.check_invariants()

    @pytest.mark.kvcache_requires("state_layers")
    def test_slots_run_out_with_a_specific_error_and_nothing_taken(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(state_config(kvcache_backend, slots=2))
        first = manager.allocate(AllocationRequest("a", initial_tokens=4))
        manager.allocate(AllocationRequest("b"))
        before = manager.stats()
        with pytest.raises(OutOfStateSlotsError, match="state slots"):
            manager.allocate(AllocationRequest("c", initial_tokens=8))
        assert not manager.can_allocate(AllocationRequest("c"))
        if kvcache_backend.claims("fork"):
            with pytest.raises(OutOfStateSlotsError):
                manager.fork(first, "child")
        after = manager.stats()
        assert (after.used_blocks, after.used_state_slots, after.active_caches) == (
            before.used_blocks,
            before.used_state_slots,
            before.active_caches,
        ), "a refused allocation took blocks or slots"
        assert manager.get_handle("c") is None, "a refused allocation left a live request"
        assert manager.get_handle("child") is None, "a refused fork left a live request"
        manager.check_invariants()
        manager.deallocate("b")
        manager.allocate(AllocationRequest("c"))  # the freed slot serves a new request
        manager.check_invariants()

    @pytest.mark.kvcache_requires("state_layers")
    def test_truncate_of_a_state_request_is_refused_by_name(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(state_config(kvcache_backend))
        handle = manager.allocate(AllocationRequest("a"))
        manager.extend(handle, 5)
        with pytest.raises(StateRollbackError, match="checkpoint"):
            manager.truncate(handle, 3)
        assert handle.num_tokens() == 5
        manager.truncate(handle, 5)  # the current length is no rollback

    @pytest.mark.kvcache_requires("state_layers")
    def test_a_pool_of_state_layers_only_serves_its_states(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(8)
        config = kvcache_backend.config(
            num_layers=2, num_heads=1, head_dim=1, layer_specs=(LayerSpec(state=STATE),) * 2, state_slots=3
        )
        manager = kvcache_backend.manager(config)
        handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
        models = {handle.request_id: zeros(config) for handle in handles}
        manager.begin_step(handles, [4, 2])
        write_states(manager, handles, rng, models)
        assert_states(manager, handles, models, "a pool without attention layers")
        assert [handle.num_tokens() for handle in handles] == [4, 2]

    @pytest.mark.kvcache_requires("state_layers", "prefix_caching")
    def test_a_prefix_hit_starts_from_the_last_state_checkpoint(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(9)
        manager = kvcache_backend.manager(state_config(kvcache_backend, enable_prefix_caching=True))
        prompt = tuple(range(10, 23))  # 13 tokens: three full blocks of 4, one token more
        models: dict[str, Model] = {"first": zeros(manager.config)}
        at_eight: Model = {}
        first = manager.allocate(AllocationRequest("first", prompt_token_ids=prompt))
        for count in (4, 4, 4):
            step = manager.begin_step([first], count)
            write_attention(manager, step, rng)
            write_states(manager, [first], rng, models)
            assert manager.begin_step([first], 0).checkpoint_states() == 1, "no checkpoint at a block's end"
            if first.num_tokens() == 8:
                at_eight = dict(models["first"])
        manager.deallocate("first")
        stats = manager.stats()
        assert stats.checkpoint_state_slots == 3, f"{stats.checkpoint_state_slots} checkpoints kept, 3 filed"
        second = manager.allocate(AllocationRequest("second", prompt_token_ids=prompt))
        assert second.num_cached_tokens() == 12, "the hit stops before the last block with a checkpoint"
        models["second"] = dict(models["first"])
        assert_states(manager, [second], models, "a prefix hit")
        manager.truncate(second, 8)  # back to the checkpoint after two blocks
        models["second"] = at_eight
        assert_states(manager, [second], models, "truncated to a checkpoint")
        with pytest.raises(StateRollbackError):
            manager.truncate(second, 6)
        manager.truncate(second, 0)
        models["second"] = zeros(manager.config)
        assert_states(manager, [second], models, "truncated to nothing")
        manager.check_invariants()

    @pytest.mark.kvcache_requires("state_layers", "prefix_caching")
    def test_without_a_checkpoint_a_state_pool_maps_no_prefix(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(10)
        manager = kvcache_backend.manager(state_config(kvcache_backend, enable_prefix_caching=True))
        prompt = tuple(range(30, 39))
        first = manager.allocate(AllocationRequest("first", prompt_token_ids=prompt))
        write_attention(manager, manager.begin_step([first], 8), rng)
        manager.deallocate("first")
        second = manager.allocate(AllocationRequest("second", prompt_token_ids=prompt))
        assert second.num_cached_tokens() == 0, "a hit without a state checkpoint would skip uncomputed states"

    @pytest.mark.kvcache_requires("state_layers")
    def test_lockstep_walk_with_state_layers_matches_the_model(self, kvcache_backend: BackendUnderTest) -> None:
        run_state_walk(kvcache_backend, seed=11, operations=60)

    @pytest.mark.kvcache_requires("state_layers")
    def test_a_fault_at_any_storage_call_leaks_no_state_slot(self, kvcache_backend: BackendUnderTest) -> None:
        for when in ("before", "after"):
            fail_at = 0
            while run_fault_script(kvcache_backend, fail_at, when):
                fail_at += 1
            assert fail_at > 5, f"the state fault script made only {fail_at} storage calls"


def run_state_walk(
    backend: BackendUnderTest, seed: int, operations: int, layers: tuple[LayerSpec, ...] = LAYERS
) -> None:
    """Random operations on a pool with state layers (``layers``), in lockstep with a plain
    model of each request's states; the records are audited after each, nothing is left at
    the end."""
    rng = np.random.default_rng(seed)
    manager = backend.manager(state_config(backend, slots=3, layers=layers, num_blocks=24))
    models: dict[str, Model] = {}
    resident: dict[str, PagedKvCacheHandle[Any]] = {}
    swapped: dict[str, PagedKvCacheHandle[Any]] = {}
    names = iter(f"r{index}" for index in range(10_000))
    kinds = ["allocate", "deallocate", "step"] + (["fork"] if backend.claims("fork") else [])
    kinds += ["swap_out", "swap_in"] if backend.claims("swap") else []
    for _ in range(operations):
        kind = kinds[int(rng.integers(len(kinds)))]
        if kind == "allocate":
            name = next(names)
            if len(resident) < 3:
                resident[name] = manager.allocate(AllocationRequest(name))
                models[name] = zeros(manager.config)
            else:
                with pytest.raises(OutOfStateSlotsError):
                    manager.allocate(AllocationRequest(name))
        elif kind == "deallocate" and (resident or swapped):
            pool = resident if resident and (not swapped or rng.random() < 0.5) else swapped
            name = sorted(pool)[int(rng.integers(len(pool)))]
            manager.deallocate(name)
            del pool[name], models[name]
        elif kind == "fork" and resident and len(resident) < 3:
            parent = sorted(resident)[int(rng.integers(len(resident)))]
            name = next(names)
            resident[name] = manager.fork(resident[parent], name)
            models[name] = dict(models[parent])
        elif kind == "swap_out" and resident:
            name = sorted(resident)[int(rng.integers(len(resident)))]
            manager.swap_out(name)
            swapped[name] = resident.pop(name)
        elif kind == "swap_in" and swapped and len(resident) < 3:
            name = sorted(swapped)[int(rng.integers(len(swapped)))]
            manager.swap_in(name)
            resident[name] = swapped.pop(name)
        elif kind == "step" and resident:
            batch = [resident[name] for name in sorted(resident) if rng.random() < 0.7] or [
                next(iter(resident.values()))
            ]
            assert_states(manager, batch, models, "before a step")
            manager.begin_step(batch, [int(rng.integers(0, 3)) for _ in batch])
            write_states(manager, batch, rng, models)
        manager.check_invariants()
        assert manager.stats().used_state_slots == len(resident), "state slots held differ from resident requests"
    assert_states(manager, list(resident.values()), models, "at the end of the walk")
    for name in [*resident, *swapped]:
        manager.deallocate(name)
    manager.gc()
    stats = manager.stats()
    assert (stats.used_state_slots, stats.used_blocks) == (0, 0), f"leaked after every request ended: {stats}"


class _FaultyStateStorage(CallInjector):
    """A state storage whose calls are numbered with a :class:`FaultyStorage`'s."""

    def __init__(self, inner: Any, shared: CallInjector) -> None:
        super().__init__()
        self._inner = inner
        self._shared = shared

    @property
    def counter(self) -> CallInjector:
        return self._shared

    def read(self, index: int, slots: Any) -> Any:
        return self._call("state.read", lambda: self._inner.read(index, slots))

    def write(self, index: int, slots: Any, values: Any) -> None:
        self._call("state.write", lambda: self._inner.write(index, slots, values))

    def copy(self, source: Any, destination: Any) -> None:
        self._call("state.copy", lambda: self._inner.copy(source, destination))

    def zero(self, slots: Any) -> None:
        self._call("state.zero", lambda: self._inner.zero(slots))

    def to_host(self, slots: Any) -> Any:
        return self._call("state.to_host", lambda: self._inner.to_host(slots))

    def from_host(self, slots: Any, arrays: Any) -> None:
        self._call("state.from_host", lambda: self._inner.from_host(slots, arrays))

    def array(self, index: int) -> Any:
        return self._inner.array(index)


class _FaultyStorageWithStates(FaultyStorage):
    """A :class:`FaultyStorage` whose state pool's calls fail in the same numbering."""

    def state_storage(self, arrays: tuple[StateArray, ...], num_slots: int) -> _FaultyStateStorage:
        return _FaultyStateStorage(self._inner.state_storage(arrays, num_slots), self)  # type: ignore[attr-defined]


def run_fault_script(
    backend: BackendUnderTest, fail_at: int, when: str, layers: tuple[LayerSpec, ...] = LAYERS
) -> bool:
    """Run the state script on a pool of ``layers`` with storage call ``fail_at`` failing
    ``when``; after the fault, the records are consistent, an atomic operation changed
    nothing, and nothing leaks once every request ends. Returns whether the fault fired."""
    rng = np.random.default_rng(fail_at)
    caching = backend.claims("prefix_caching")  # then steps file checkpoints, and prompts hit them
    config = state_config(backend, slots=3, layers=layers, enable_prefix_caching=caching)
    prompt = tuple(range(50, 59))
    filed: dict[int, Model] = {}  # the states of each checkpoint filed, by length
    inner = backend.manager(config).storage
    storage = _FaultyStorageWithStates(inner, fail_at, "after" if when == "after" else "before")
    manager: Manager = PagedKvCacheManager(storage, backend=backend.name, config=config)
    models: dict[str, Model] = {}
    handles: dict[str, PagedKvCacheHandle[Any]] = {}

    def allocate(name: str) -> Callable[[], None]:
        def run() -> None:
            handles[name] = manager.allocate(AllocationRequest(name, prompt_token_ids=prompt if caching else None))
            cached = handles[name].num_cached_tokens()
            models[name] = dict(filed[cached]) if cached else zeros(config)

        return run

    def step(names: tuple[str, ...] | None, count: int) -> Callable[[], None]:
        def run() -> None:  # names None: every resident request
            batch = [
                handle
                for name, handle in handles.items()
                if (name in names if names is not None else manager.get_handle(name) is not None)
            ]
            write_attention(manager, manager.begin_step(batch, count), rng)
            write_states(manager, batch, rng, models)
            for handle in batch if caching else ():
                if manager.begin_step([handle], 0).checkpoint_states():
                    filed.setdefault(handle.num_tokens(), dict(models[handle.request_id]))

        return run

    def fork(parent: str, child: str) -> Callable[[], None]:
        def run() -> None:
            handles[child] = manager.fork(handles[parent], child)
            models[child] = dict(models[parent])

        return run

    script: list[tuple[bool, Callable[[], None]]] = [
        (True, allocate("a")),
        (False, step(("a",), 3)),
        (True, allocate("b")),
        (False, step(("a", "b"), 1)),  # a ends a block: a checkpoint
        (True, lambda: manager.deallocate("b")),
        (True, allocate("d")),  # from a's checkpoint
    ]
    if backend.claims("fork"):
        script.append((True, fork("a", "c")))
    if backend.claims("swap"):
        script += [(True, lambda: manager.swap_out("a")), (True, lambda: manager.swap_in("a"))]
    script += [(True, lambda: manager.deallocate("d")), (False, step(None, 1))]
    for atomic, operation in script:
        before = manager.stats()
        try:
            operation()
        except InjectedFaultError:
            manager.check_invariants()
            if atomic:
                after = manager.stats()
                assert (after.used_state_slots, after.used_blocks, after.active_caches) == (
                    before.used_state_slots,
                    before.used_blocks,
                    before.active_caches,
                ), f"a fault at storage call {fail_at} ({storage.fired}, {when}) left a partial change"
                live = [handle for name, handle in handles.items() if manager.get_handle(name) is not None]
                storage.fail_at = None
                assert_states(manager, [h for h in live if not h.is_swapped_out()], models, "after a fault")
            break
    storage.fail_at = None
    for name, _ in manager.list_handles():
        manager.deallocate(name)
    manager.gc()
    stats = manager.stats()
    assert (stats.used_state_slots, stats.used_blocks) == (0, 0), (
        f"a fault at storage call {fail_at} ({storage.fired}, {when}) leaked: {stats}"
    )
    return storage.fired is not None
