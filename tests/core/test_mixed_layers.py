"""Layers keeping K/V and a recurrent state in one layer, or nothing, in core: the values of
``LayerSpec(keeps_kv=...)``, what is refused by name, and the groups, state pool and figures
of a pool mixing them (the policies over every backend are the kit's:
kvcache_core/testing/mixed_layers.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, LayerSpec, StateSpec, create_manager
from kvcache_core.errors import InvalidConfigError, LayerIndexError

STATE = StateSpec(arrays=(("conv", (6, 3)), ("recurrent", (2, 3, 4))))


def mixed_config(**fields: Any) -> CacheConfig:
    """K/V and a state; nothing; a state; K/V: one group of layers 0 and 3."""
    base: dict[str, Any] = {
        "num_layers": 4,
        "num_heads": 2,
        "head_dim": 8,
        "num_blocks": 16,
        "block_size": 4,
        "layer_specs": (
            LayerSpec(state=STATE, keeps_kv=True),
            LayerSpec(keeps_kv=False),
            LayerSpec(state=STATE),
            LayerSpec(),
        ),
        "state_slots": 2,
    }
    return CacheConfig(**{**base, **fields})


def test_keeps_kv_defaults_to_what_a_layer_kept_before() -> None:
    assert LayerSpec().keeps_kv
    assert LayerSpec(window=4).keeps_kv
    assert LayerSpec(chunk=8).keeps_kv
    assert not LayerSpec(state=STATE).keeps_kv
    assert LayerSpec(state=STATE) == LayerSpec(state=STATE, keeps_kv=False)
    assert LayerSpec() == LayerSpec(keeps_kv=True)
    assert LayerSpec(keeps_kv=np.bool_(True)).keeps_kv is True


@pytest.mark.parametrize(
    ("spec", "kind", "keeps_state"),
    [
        (LayerSpec(), "full", False),
        (LayerSpec(window=4), "sliding", False),
        (LayerSpec(chunk=8), "chunked", False),
        (LayerSpec(state=STATE), "state", True),
        (LayerSpec(state=STATE, keeps_kv=True), "full+state", True),
        (LayerSpec(window=4, state=STATE, keeps_kv=True), "sliding+state", True),
        (LayerSpec(chunk=8, state=STATE, keeps_kv=True), "chunked+state", True),
        (LayerSpec(keeps_kv=False), "none", False),
    ],
)
def test_a_layers_kind_names_what_it_keeps(spec: LayerSpec, kind: str, keeps_state: bool) -> None:
    assert (spec.kind, spec.keeps_state) == (kind, keeps_state)


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: LayerSpec(keeps_kv=1), "LayerSpec.keeps_kv must be a bool, got 1"),  # type: ignore[arg-type]
        (lambda: LayerSpec(keeps_kv="yes"), "LayerSpec.keeps_kv must be a bool, got 'yes'"),  # type: ignore[arg-type]
        (lambda: LayerSpec(window=4, keeps_kv=False), r"window=4 chunk=None on a layer keeping nothing"),
        (lambda: LayerSpec(chunk=8, state=STATE), r"window=None chunk=8 on a layer keeping a state only"),
        (lambda: LayerSpec(state=(("conv", (2,)),), keeps_kv=True), "must be a StateSpec or None"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_layer_spec_is_refused_naming_the_value(build: Any, named: str) -> None:
    with pytest.raises(InvalidConfigError, match=named):
        build()


def test_a_hybrid_layer_joins_its_group_and_the_state_pool_and_an_empty_layer_neither() -> None:
    config = mixed_config()
    assert [group.layers for group in config.kv_groups] == [(0, 3)]
    assert sorted({layer for layer, _ in config.states.arrays}) == [0, 2]
    assert config.storage_config().num_layers == 2
    assert config.bytes_per_token == 2 * 2 * 2 * 8 * 4  # two layers keep K/V, K and V
    assert config.layer_place(0) == (0, 0)
    assert config.layer_place(3) == (0, 1)


def test_a_hybrid_sliding_layer_groups_with_the_sliding_layers_of_its_window() -> None:
    specs = (LayerSpec(window=4, state=STATE, keeps_kv=True), LayerSpec(), LayerSpec(window=4), LayerSpec())
    config = mixed_config(layer_specs=specs)
    assert [(group.window, group.layers) for group in config.kv_groups] == [(4, (0, 2)), (None, (1, 3))]


def test_a_pool_of_layers_keeping_nothing_but_states_keeps_one_empty_group() -> None:
    config = mixed_config(layer_specs=(LayerSpec(keeps_kv=False), LayerSpec(state=STATE)) * 2)
    assert [group.layers for group in config.kv_groups] == [()]
    assert config.states.num_slots == 2


def test_kv_and_state_calls_on_a_layer_keeping_nothing_are_refused_by_name() -> None:
    config = mixed_config()
    with pytest.raises(LayerIndexError, match=r"layer 1 keeps nothing \(LayerSpec\(keeps_kv=False\)"):
        config.layer_place(1)
    with pytest.raises(LayerIndexError, match="layer 2 keeps a recurrent state"):
        config.layer_place(2)
    manager = create_manager("numpy", config)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], 2)
    keys = np.ones((2, 2, 8), dtype=np.float32)
    step.write(0, keys, keys)  # the hybrid layer keeps K/V ...
    step.write_state(0, "conv", np.ones((1, 6, 3), dtype=np.float32))  # ... and a state
    with pytest.raises(LayerIndexError, match="layer 1 keeps nothing"):
        step.write(1, keys, keys)
    with pytest.raises(LayerIndexError, match="layer 1 keeps nothing, not a recurrent state"):
        step.state(1, "conv")
    assert np.array_equal(manager.gather(handle, 0)[0], keys)
    assert np.array_equal(step.state(0, "conv"), np.ones((1, 6, 3), dtype=np.float32))
