"""The kit's cases for pools whose layers keep K/V and a recurrent state in one layer
(``LayerSpec(state=..., keeps_kv=True)``: Falcon-H1, Zamba2) or nothing
(``LayerSpec(keeps_kv=False)``: Nemotron-H's MLP blocks), beside plain attention and state
layers: both parts of a hybrid layer are kept apart and carried by every policy (fork, swap,
a prefix hit), a layer keeping nothing refuses K/V and state calls by name, and the state
cases' lockstep walk and fault injection run on such a pool. They run where the backend
claims ``"state_layers"`` and ``"sliding_window"`` (the pool has a sliding hybrid layer).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.errors import LayerIndexError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.states import (
    STATE,
    Model,
    assert_states,
    run_fault_script,
    run_state_walk,
    state_config,
    write_states,
    zeros,
)

__all__ = ["MIXED", "MixedLayerCases"]

FloatArray = npt.NDArray[np.float64]
Manager = PagedKvCacheManager[Any]
#: A request's K/V in the model: ``layer -> [tokens, heads, head_dim]`` keys (values are the
#: keys, written as both).
KvModel = dict[int, FloatArray]

#: The sliding window of the mixed pool's sliding layers.
WINDOW = 5

#: K/V and a state; nothing; a state only; K/V only; a sliding window and a state; a sliding
#: window. Layers 0 and 3 form the full group, 4 and 5 the sliding one; 0, 2 and 4 keep states.
MIXED = (
    LayerSpec(state=STATE, keeps_kv=True),
    LayerSpec(keeps_kv=False),
    LayerSpec(state=STATE),
    LayerSpec(),
    LayerSpec(window=WINDOW, state=STATE, keeps_kv=True),
    LayerSpec(window=WINDOW),
)


def kv_layers(manager: Manager) -> list[int]:
    """The layers of the manager's pool that keep K/V."""
    config = manager.config
    return [layer for layer in range(config.num_layers) if config.layer_spec(layer).keeps_kv]


def write_kv(manager: Manager, step: Any, rng: np.random.Generator) -> dict[int, FloatArray]:
    """Write random K/V (keys as values) of the step's new tokens in every layer keeping K/V;
    returns them per layer, ``[new tokens, heads, head_dim]``."""
    config = manager.config
    written: dict[int, FloatArray] = {}
    for layer in kv_layers(manager):
        keys = BackendUnderTest.representable(
            rng.standard_normal((step.num_new_tokens, config.num_heads, config.head_dim)), config.dtype
        )
        native = BackendUnderTest.native(manager, keys)
        step.write(layer, native, native)
        written[layer] = keys
    return written


def assert_kv(manager: Manager, handle: PagedKvCacheHandle[Any], expected: KvModel, when: str) -> None:
    """The full layers of ``handle`` hold the model's K/V, the sliding ones at least their
    window's last positions, bit for bit."""
    for layer, keys in expected.items():
        found = BackendUnderTest.host(manager, manager.gather(handle, layer)[0])
        window = manager.config.layer_spec(layer).window
        tail = keys if window is None else keys[-window:]
        assert np.array_equal(found[len(found) - len(tail) :], tail), (
            f"{when}: layer {layer} of request {handle.request_id!r} lost its keys"
        )


def grow(manager: Manager, handle: PagedKvCacheHandle[Any], count: int, rng: np.random.Generator, kv: KvModel) -> None:
    """One step of ``count`` tokens for ``handle``: K/V written and added to ``kv``."""
    written = write_kv(manager, manager.begin_step([handle], count), rng)
    for layer, keys in written.items():
        kv[layer] = np.concatenate([kv[layer], keys]) if layer in kv else keys


class MixedLayerCases:
    """Cases of pools mixing layers that keep K/V, a state, both or nothing, which every
    backend claiming ``"state_layers"`` and ``"sliding_window"`` runs (through
    :class:`~kvcache_core.testing.KvCacheConformance`)."""

    @pytest.mark.kvcache_requires("state_layers", "sliding_window")
    def test_a_hybrid_layer_keeps_its_kv_and_its_state_apart(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(21)
        manager = kvcache_backend.manager(state_config(kvcache_backend, layers=MIXED))
        config = manager.config
        assert [group.layers for group in config.kv_groups] == [(0, 3), (4, 5)]
        assert sorted({layer for layer, _ in config.states.arrays}) == [0, 2, 4]
        assert [config.layer_spec(layer).kind for layer in range(6)] == [
            "full+state",
            "none",
            "state",
            "full",
            "sliding+state",
            "sliding",
        ]
        per_layer = config.num_heads * 2 * config.head_dim * config.dtype_size
        assert config.bytes_per_token == 4 * per_layer, "the pool counts K/V of layers keeping none"
        handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
        models: dict[str, Model] = {handle.request_id: zeros(config) for handle in handles}
        kv: dict[str, KvModel] = {"a": {}, "b": {}}
        for count in (3, 4):
            for handle in handles:
                grow(manager, handle, count, rng, kv[handle.request_id])
            write_states(manager, handles, rng, models)
        for handle in handles:
            assert_kv(manager, handle, kv[handle.request_id], "after K/V and states were written in turn")
        assert_states(manager, handles, models, "after K/V and states were written in turn")
        assert manager.stats().state_memory_bytes == config.states.num_slots * config.states.bytes_per_slot
        manager.check_invariants()

    @pytest.mark.kvcache_requires("state_layers", "sliding_window")
    def test_a_layer_keeping_nothing_refuses_kv_and_state_calls_by_name(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        manager = kvcache_backend.manager(state_config(kvcache_backend, layers=MIXED))
        config = manager.config
        handle = manager.allocate(AllocationRequest("a"))
        step = manager.begin_step([handle], 2)
        keys = BackendUnderTest.native(manager, np.zeros((2, config.num_heads, config.head_dim)))
        with pytest.raises(LayerIndexError, match="layer 1 keeps nothing"):
            step.write(1, keys, keys)
        with pytest.raises(LayerIndexError, match="layer 1 keeps nothing"):
            handle.key_cache(1)
        with pytest.raises(LayerIndexError, match="layer 1 keeps nothing, not a recurrent state"):
            step.state(1, "conv")
        with pytest.raises(LayerIndexError, match="layer 3 keeps K/V, not a recurrent state"):
            step.state(3, "conv")
        assert handle.num_tokens() == 2, "a refused call changed the request"
        manager.check_invariants()

    @pytest.mark.kvcache_requires("state_layers", "sliding_window", "fork", "swap")
    def test_fork_and_swap_carry_a_hybrid_layers_kv_and_state(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(22)
        manager = kvcache_backend.manager(state_config(kvcache_backend, layers=MIXED, slots=3))
        parent = manager.allocate(AllocationRequest("parent"))
        models: dict[str, Model] = {"parent": zeros(manager.config)}
        kv: dict[str, KvModel] = {"parent": {}}
        grow(manager, parent, 6, rng, kv["parent"])
        write_states(manager, [parent], rng, models)
        child = manager.fork(parent, "child")
        models["child"], kv["child"] = dict(models["parent"]), dict(kv["parent"])
        grow(manager, child, 2, rng, kv["child"])
        write_states(manager, [child], rng, models)
        for handle in (parent, child):
            assert_kv(manager, handle, kv[handle.request_id], "after a fork diverged")
        assert_states(manager, [parent, child], models, "after a fork diverged")
        manager.swap_out("parent")
        manager.swap_in("parent")
        assert_kv(manager, parent, kv["parent"], "after swap_out and swap_in")
        assert_states(manager, [parent, child], models, "after swap_out and swap_in")
        manager.check_invariants()

    @pytest.mark.kvcache_requires("state_layers", "sliding_window", "prefix_caching")
    def test_a_prefix_hit_restores_a_hybrid_layers_kv_and_its_state_checkpoint(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        rng = np.random.default_rng(23)
        layers = tuple(spec for spec in MIXED if spec.window is None)  # full layers: a hit maps every block
        manager = kvcache_backend.manager(state_config(kvcache_backend, layers=layers, enable_prefix_caching=True))
        prompt = tuple(range(60, 70))  # 10 tokens: two full blocks of 4 and two more
        first = manager.allocate(AllocationRequest("first", prompt_token_ids=prompt))
        models: dict[str, Model] = {"first": zeros(manager.config)}
        kv: KvModel = {}
        for _ in range(2):
            grow(manager, first, 4, rng, kv)
            write_states(manager, [first], rng, models)
            assert manager.begin_step([first], 0).checkpoint_states() == 1, "no checkpoint at a block's end"
        manager.deallocate("first")
        second = manager.allocate(AllocationRequest("second", prompt_token_ids=prompt))
        assert second.num_cached_tokens() == 8, "the hit stops before the blocks with a checkpoint"
        assert_kv(manager, second, kv, "a prefix hit")
        assert_states(manager, [second], {"second": models["first"]}, "a prefix hit")
        manager.check_invariants()

    @pytest.mark.kvcache_requires("state_layers", "sliding_window")
    def test_lockstep_walk_with_mixed_layers_matches_the_model(self, kvcache_backend: BackendUnderTest) -> None:
        run_state_walk(kvcache_backend, seed=24, operations=60, layers=MIXED)

    @pytest.mark.kvcache_requires("state_layers", "sliding_window")
    def test_a_fault_at_any_storage_call_leaks_nothing_with_mixed_layers(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        for when in ("before", "after"):
            fail_at = 0
            while run_fault_script(kvcache_backend, fail_at, when, layers=MIXED):
                fail_at += 1
            assert fail_at > 5, f"the mixed-layer fault script made only {fail_at} storage calls"
