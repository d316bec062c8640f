"""Recurrent-state layers in core: their specs and config values, the state pool's figures,
what is refused by name, and the step's state arguments (the policies over every backend
are the kit's: kvcache_core/testing/states.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    LayerSpec,
    PagedKvCacheManager,
    StateSpec,
    create_manager,
)
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.contract.states import StateArray
from kvcache_core.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    InvalidConfigError,
    LayerIndexError,
    ShapeMismatchError,
    StaleStepError,
    UnsupportedConfigError,
)

STATE = StateSpec(arrays=(("conv", (6, 3)), ("recurrent", (2, 3, 4), "float64")))


def hybrid_config(**fields: Any) -> CacheConfig:
    """State, attention, state, attention; 4 state slots."""
    base: dict[str, Any] = {
        "num_layers": 4,
        "num_heads": 2,
        "head_dim": 8,
        "num_blocks": 16,
        "block_size": 4,
        "layer_specs": (LayerSpec(state=STATE), LayerSpec(), LayerSpec(state=STATE), LayerSpec()),
        "state_slots": 4,
    }
    return CacheConfig(**{**base, **fields})


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (("", (2,)), "name"),
        (("conv", ()), "1 or more dimensions"),
        (("conv", (2, 0)), r"\[1, "),
        (("conv", (2, True)), "True"),
        (("conv", "ab"), "sequence of ints"),
        (("conv", (2,), "int8"), "dtype 'int8'"),
        (("conv", (2**20, 2**20)), "at most"),
    ],
)
def test_a_bad_state_array_is_refused_naming_the_value(arguments: tuple[Any, ...], named: str) -> None:
    with pytest.raises(InvalidConfigError, match=named):
        StateArray(*arguments)


def test_a_state_spec_needs_distinct_arrays() -> None:
    with pytest.raises(InvalidConfigError, match="distinct names"):
        StateSpec(arrays=(("conv", (2,)), ("conv", (3,))))
    with pytest.raises(InvalidConfigError, match="distinct names"):
        StateSpec(arrays=())
    with pytest.raises(InvalidConfigError, match="neither a StateArray"):
        StateSpec(arrays=(("conv",),))


def test_a_state_layer_has_no_window_or_chunk() -> None:
    with pytest.raises(
        InvalidConfigError, match=r"window=4 chunk=None on a layer keeping a state only \(keeps_kv=False\)"
    ):
        LayerSpec(window=4, state=STATE)
    with pytest.raises(InvalidConfigError, match="must be a StateSpec"):
        LayerSpec(state="conv")  # type: ignore[arg-type]
    assert LayerSpec(state=STATE).kind == "state"


def test_state_layers_form_no_kv_group_and_the_storage_holds_the_attention_layers() -> None:
    config = hybrid_config()
    assert [group.layers for group in config.kv_groups] == [(1, 3)]
    assert config.storage_config().num_layers == 2
    assert config.storage_config().state_slots is None
    assert [(layer, array.name) for layer, array in config.states.arrays] == [
        (0, "conv"),
        (0, "recurrent"),
        (2, "conv"),
        (2, "recurrent"),
    ]
    assert config.states.bytes_per_slot == 2 * (6 * 3 * 4 + 2 * 3 * 4 * 8)
    assert config.bytes_per_token == 2 * 2 * 2 * 8 * 4  # two attention layers, K and V


@pytest.mark.parametrize(("slots", "named"), [(0, r"\[1, "), (-1, r"\[1, "), (2.5, "2.5")])
def test_state_slots_out_of_range_are_refused(slots: object, named: str) -> None:
    with pytest.raises(InvalidConfigError, match=named):
        hybrid_config(state_slots=slots)


def test_state_slots_without_state_layers_are_refused() -> None:
    with pytest.raises(InvalidConfigError, match="state layers"):
        CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=16, state_slots=4)


def test_state_slots_default_to_a_few_per_pool() -> None:
    assert hybrid_config(state_slots=None).states.num_slots == 16
    assert hybrid_config(state_slots=None, num_blocks=100).states.num_slots == 32


def test_a_kv_call_on_a_state_layer_is_refused_by_name() -> None:
    manager = create_manager("numpy", hybrid_config())
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], 2)
    keys = np.zeros((2, 2, 8), dtype=np.float32)
    with pytest.raises(LayerIndexError, match="keeps a recurrent state"):
        step.write(0, keys, keys)
    with pytest.raises(LayerIndexError, match="keeps a recurrent state"):
        handle.key_cache(2)
    with pytest.raises(LayerIndexError, match="keeps K/V, not a recurrent state"):
        step.state(1, "conv")
    with pytest.raises(InvalidArgumentError, match="its arrays: conv, recurrent"):
        step.state(0, "ssm")


def test_a_state_write_of_the_wrong_shape_or_dtype_is_refused() -> None:
    manager = create_manager("numpy", hybrid_config())
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    step = manager.begin_step(handles, 1)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 6, 3\)"):
        step.write_state(0, "conv", np.zeros((1, 6, 3), dtype=np.float32))
    with pytest.raises(DTypeMismatchError, match="float64"):
        step.write_state(0, "recurrent", np.zeros((2, 2, 3, 4), dtype=np.float32))
    assert not np.any(step.state(0, "conv")), "a refused write changed the states"


def test_a_steps_state_view_is_the_pools_rows_while_its_slots_follow_one_another() -> None:
    manager = create_manager("numpy", hybrid_config())
    a, b, c = (manager.allocate(AllocationRequest(name)) for name in ("a", "b", "c"))  # slots 0, 1, 2
    step = manager.begin_step([a, b], 1)

    rows = step.state_view(2, "recurrent")
    assert rows is not None
    rows[1] = 7.0  # in place: b's state in the pool

    assert rows.shape == (2, 2, 3, 4)
    assert np.all(manager.begin_step([b], 0).state(2, "recurrent") == 7.0)
    assert not np.any(manager.begin_step([a, c], 0).state(2, "recurrent"))
    assert manager.begin_step([b, a], 0).state_view(2, "recurrent") is None  # not ascending: state() copies
    assert manager.begin_step([a, c], 0).state_view(2, "recurrent") is None  # a gap
    with pytest.raises(InvalidArgumentError, match="its arrays: conv, recurrent"):
        step.state_view(0, "ssm")
    manager.deallocate("b")
    with pytest.raises(StaleStepError):
        step.state_view(0, "conv")


def test_requests_allocated_after_releases_hold_ascending_slots_and_read_their_states_in_place() -> None:
    manager = create_manager("numpy", hybrid_config())
    first = [manager.allocate(AllocationRequest(name)) for name in ("a", "b", "c", "d")]
    for handle in first:  # given back 0, 1, 2, 3: a stack would hand them out 3, 2, 1, 0
        manager.deallocate(handle.request_id)
    again = [manager.allocate(AllocationRequest(name)) for name in ("e", "f", "g", "h")]
    assert manager.begin_step(again, 1).state_view(2, "recurrent") is not None
    manager.deallocate("f")
    manager.deallocate("h")
    late = [manager.allocate(AllocationRequest(name)) for name in ("i", "j")]  # the lowest free: f's, then h's
    assert manager.begin_step([again[0], late[0], again[2], late[1]], 1).state_view(2, "recurrent") is not None


def test_stats_count_the_state_pool_and_the_slots_held() -> None:
    config = hybrid_config()
    manager = create_manager("numpy", config)
    empty = manager.stats()
    handle = manager.allocate(AllocationRequest("a", initial_tokens=4))
    stats = manager.stats()
    per_slot = config.states.bytes_per_slot
    assert empty.total_memory_bytes == config.num_blocks * config.bytes_per_block + 4 * per_slot
    assert (stats.state_slots, stats.used_state_slots, stats.state_memory_bytes) == (4, 1, 4 * per_slot)
    assert stats.used_memory_bytes == config.bytes_per_block + per_slot
    assert handle.stats().memory_bytes == config.bytes_per_block + per_slot


def test_a_storage_without_state_storage_is_refused_by_capability() -> None:
    class OldStorage(NumpyStorage):
        state_storage = None  # type: ignore[assignment]

    config = hybrid_config(kv_layout="NHD")
    with pytest.raises(UnsupportedConfigError, match="'state_layers'"):
        PagedKvCacheManager(OldStorage(config.storage_config()), backend="old", config=config)


def test_a_checkpoint_is_filed_only_at_a_cached_blocks_end() -> None:
    manager = create_manager("numpy", hybrid_config(enable_prefix_caching=True))
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=list(range(1, 10))))
    step = manager.begin_step([handle], 6)
    keys = np.zeros((6, 2, 8), dtype=np.float32)
    for layer in (1, 3):
        step.write(layer, keys, keys)
    assert step.checkpoint_states() == 0, "6 tokens end no block"
    assert manager.stats().checkpoint_state_slots == 0


def test_bfloat16_states_are_refused_by_the_numpy_backend() -> None:
    spec = StateSpec(arrays=(("conv", (2,), "bfloat16"),))
    config = hybrid_config(layer_specs=(LayerSpec(state=spec), LayerSpec(), LayerSpec(state=spec), LayerSpec()))
    with pytest.raises(UnsupportedConfigError, match="bfloat16"):
        create_manager("numpy", config)


#: A backend whose storage has ``state_storage`` (NumPy's) but whose spec does not claim it.
UNCLAIMED_PLUGIN = """
from kvcache_core.plugin import BackendSpec, hookimpl
from kvcache_core.backends.numpy import NumpyStorage

@hookimpl
def kvcache_register_backends():
    yield BackendSpec(name="nostates", storage_factory=NumpyStorage, dtypes=("float32",),
                      description="a backend not claiming state_layers")
"""


def test_a_backend_not_claiming_state_layers_is_refused_by_name(
    plugin_dir: Path, add_distribution: Callable[[Path, str, str, str, str, str], None]
) -> None:
    add_distribution(plugin_dir, "kvtest-nostates", "1.0", "nostates", "kvtest_nostates", UNCLAIMED_PLUGIN)
    with pytest.raises(UnsupportedConfigError, match="capability 'state_layers' not claimed"):
        create_manager("nostates", hybrid_config())
