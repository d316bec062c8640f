"""Configuration values are plain Python values every backend represents, or refused by name.

NumPy integers, floats and strings are accepted and stored as Python's (so configs compare,
hash and serialize alike); bools are refused where numbers are meant; counts and windows
stay within int32, scales are normal float32 numbers; a refused value is named with its
valid range, and nothing is built.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, Device, InvalidArgumentError, create_manager
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.config import MAX_KV_SCALE
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.scalars import FLOAT32_TINY, INT32_MAX
from kvcache_core.errors import InvalidConfigError, InvalidTypeError
from kvcache_core.offload.tiers import DiskTier, HostTier
from kvcache_core.testing.world import esc, untyped

GEOMETRY: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 4, "num_blocks": 8, "block_size": 4}


def hybrid_specs(window: Any) -> tuple[LayerSpec, ...]:
    return (LayerSpec(), LayerSpec(window=window))


def test_a_numpy_integer_window_is_stored_as_an_int() -> None:
    spec = LayerSpec(window=np.int64(4))
    assert type(spec.window) is int
    assert spec == LayerSpec(window=4)
    assert hash(spec) == hash(LayerSpec(window=4))


def test_a_numpy_integer_chunk_is_stored_as_an_int() -> None:
    assert type(LayerSpec(chunk=np.int32(8)).chunk) is int


def test_numpy_geometry_and_thresholds_make_the_python_config() -> None:
    config = CacheConfig(
        num_layers=np.int64(2),
        num_heads=np.int32(2),
        head_dim=np.uint8(4),
        num_blocks=np.int64(8),
        block_size=np.int16(4),
        sliding_window=np.int64(6),
        medium_pressure_threshold=np.float32(0.5),
        dtype=np.str_("float32"),
        enable_prefix_caching=untyped(np.True_),
    )
    expected = CacheConfig(
        **GEOMETRY,
        sliding_window=6,
        medium_pressure_threshold=float(np.float32(0.5)),
        dtype="float32",
        enable_prefix_caching=True,
    )
    assert config == expected
    assert [type(getattr(config, name)) for name in (*GEOMETRY, "sliding_window")] == [int] * 6
    assert type(config.medium_pressure_threshold) is float
    assert type(config.dtype) is str
    assert type(config.enable_prefix_caching) is bool


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "head_dim", "num_blocks", "block_size"])
@pytest.mark.parametrize("value", [True, np.True_, 2.0, "2"], ids=["bool", "numpy-bool", "float", "str"])
def test_geometry_that_is_not_an_integer_is_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidConfigError, match=f"CacheConfig.{field} must be an int >= 1, got {esc(repr(value))}"):
        CacheConfig(**untyped({**GEOMETRY, field: value}))


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "head_dim"])
def test_geometry_past_int32_is_refused_with_the_range(field: str) -> None:
    with pytest.raises(InvalidConfigError, match=f"CacheConfig.{field} .*got {2**31}; valid: 1 to {INT32_MAX}"):
        CacheConfig(**untyped({**GEOMETRY, field: 2**31}))


def test_an_int_too_long_to_print_is_refused_by_name() -> None:
    """Python refuses to print ints of more than 4300 digits: the message says its size."""
    with pytest.raises(
        InvalidConfigError, match=esc("CacheConfig.num_layers must be an int >= 1, got an int of 16610 bits")
    ):
        CacheConfig(**untyped({**GEOMETRY, "num_layers": 10**5000}))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: CacheConfig(**GEOMETRY, sliding_window=2**31),
            f"sliding_window must be an int >= 1, got {2**31}; valid: 1 to {INT32_MAX}",
        ),
        (
            lambda: LayerSpec(window=2**31),
            f"LayerSpec.window must be None or an int >= 1, got {2**31}; valid: 1 to {INT32_MAX}",
        ),
        (
            lambda: LayerSpec(chunk=2**70),
            f"LayerSpec.chunk must be None or an int >= 1, got {2**70}; valid: 1 to {INT32_MAX}",
        ),
        (lambda: LayerSpec(window=untyped(np.True_)), "LayerSpec.window must be None or an int >= 1, got np.True_"),
    ],
    ids=["pool-window-past-int32", "layer-window-past-int32", "layer-chunk-2-to-the-70", "layer-window-numpy-bool"],
)
def test_windows_and_chunks_past_int32_are_refused_with_the_range(build: Any, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=esc(message)):
        build()


def test_the_largest_windows_are_accepted() -> None:
    assert CacheConfig(**GEOMETRY, sliding_window=INT32_MAX).sliding_window == INT32_MAX
    assert LayerSpec(window=INT32_MAX).window == INT32_MAX


@pytest.mark.parametrize(
    "thresholds",
    [(float("nan"), 0.8, 0.95), (0.6, 10**400, 0.95), (0.6, 0.8, True), (0.6, 0.8, "0.95")],
    ids=["nan", "int-past-float", "bool", "str"],
)
def test_pressure_thresholds_that_are_not_numbers_in_order_are_refused(thresholds: tuple[object, ...]) -> None:
    medium, high, critical = thresholds
    with pytest.raises(InvalidConfigError, match="pressure thresholds must be numbers with 0 < medium < high"):
        CacheConfig(
            **GEOMETRY,
            medium_pressure_threshold=untyped(medium),
            high_pressure_threshold=untyped(high),
            critical_pressure_threshold=untyped(critical),
        )


# -- float8 scales: used as float32 by every backend ----------------------------------------


def float8_config(scale: object) -> CacheConfig:
    return CacheConfig(
        **untyped({**GEOMETRY, "num_layers": 1}), dtype="float8_e4m3fn", kv_scales=[[[scale, 1.0], [1.0, 1.0]]]
    )


@pytest.mark.parametrize(
    "scale",
    [1e39, 1e36, 1e-46, 1e-40, float("inf"), True, "1.0"],
    ids=["past-float32", "448-fold-past-float32", "below-float32", "subnormal", "inf", "bool", "str"],
)
def test_a_kv_scale_float32_cannot_use_is_refused_with_the_range(scale: object) -> None:
    with pytest.raises(
        InvalidConfigError,
        match=esc(
            f"CacheConfig.kv_scales[0, 0, 0] must be a finite number > 0, got {scale!r}; valid: {FLOAT32_TINY!r} to {MAX_KV_SCALE!r}"
        ),
    ):
        float8_config(scale)


@pytest.mark.parametrize("scale", [MAX_KV_SCALE, FLOAT32_TINY], ids=["largest", "smallest"])
def test_the_extreme_kv_scales_read_back_what_was_written(scale: float) -> None:
    """At the largest scale the largest float8 value stays finite; at the smallest, a value
    written reads back unchanged, not 0."""
    with create_manager("numpy", float8_config(scale)) as manager:
        handle = manager.allocate(AllocationRequest("a"))
        slots = manager.extend(handle, 1)
        keys = np.zeros((1, 2, 4), np.float32)
        keys[0, 0] = np.float32(scale) * np.float32(448.0)  # the largest value head 0 decodes
        manager.write(0, slots, keys, np.zeros_like(keys))
        gathered, _ = manager.gather(handle, 0)
    assert np.isfinite(gathered).all()
    np.testing.assert_array_equal(gathered, keys)


# -- requests ---------------------------------------------------------------------------


def test_numpy_request_fields_are_stored_as_python_values() -> None:
    request = AllocationRequest(
        np.str_("a"),
        initial_tokens=np.int64(3),
        max_sequence_length=np.int32(8),
        priority=np.int8(-2),
        cache_salt=np.bytes_(b"tenant"),
    )
    assert request == AllocationRequest("a", initial_tokens=3, max_sequence_length=8, priority=-2, cache_salt=b"tenant")
    fields = (
        request.request_id,
        request.initial_tokens,
        request.max_sequence_length,
        request.priority,
        request.cache_salt,
    )
    assert [type(value) for value in fields] == [str, int, int, int, bytes]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"max_sequence_length": 2**31},
            f"max_sequence_length must be an int >= 1, got {2**31}; valid: 1 to {INT32_MAX}",
        ),
        ({"initial_tokens": 2**70}, f"initial_tokens must be an int >= 0, got {2**70}; valid: 0 to {INT32_MAX}"),
        ({"priority": True}, "priority must be an int, got True"),
    ],
    ids=["max-sequence-length-past-int32", "initial-tokens-2-to-the-70", "priority-bool"],
)
def test_request_counts_past_int32_are_refused_with_the_range(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=esc(message)):
        AllocationRequest("a", **untyped(fields))


# -- a NumPy-integer window through the data path, the file format and a disk tier ----------


def grown_hybrid_manager(window: Any, tiers: tuple[DiskTier, ...] = (), **fields: Any) -> Any:
    """A numpy manager of one full and one sliding layer, request "a" grown by 5 tokens in
    one step with every layer written."""
    config = CacheConfig(
        **untyped({**GEOMETRY, **fields}), layer_specs=hybrid_specs(window), enable_prefix_caching=True
    )
    manager = create_manager("numpy", config, tiers=tiers)
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=tuple(range(5))))
    step = manager.begin_step([handle], [5], token_ids=[list(range(5))])
    for layer in range(config.num_layers):
        step.write(layer, np.ones((5, 2, 4), np.float32), np.ones((5, 2, 4), np.float32))
    return manager


def test_a_numpy_integer_window_goes_through_a_step_and_its_page_tables() -> None:
    with grown_hybrid_manager(np.int64(4)) as manager:
        handle = manager.get_handle("a")
        assert handle is not None
        assert [manager.page_table([handle], group=group).sliding_window for group in range(2)] == [None, 4]
        assert handle.num_tokens() == 5
        manager.check_invariants()


def test_a_numpy_integer_window_saves_and_loads_a_prefix_cache(tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    with grown_hybrid_manager(np.int64(4)) as manager:
        saved = manager.save_prefix_cache(path)
    assert saved > 0
    config = CacheConfig(**GEOMETRY, layer_specs=hybrid_specs(4), enable_prefix_caching=True)
    with create_manager("numpy", config) as other:
        assert other.load_prefix_cache(path) == saved


def test_a_numpy_integer_window_demotes_into_a_disk_tier(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "tier", max_bytes=1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed demotion is a warning
        with grown_hybrid_manager(np.int64(4), (tier,), num_blocks=4) as manager:
            manager.deallocate("a")  # its full block stays cached, in both groups
            manager.allocate(AllocationRequest("big", initial_tokens=8))  # evicts it into the tier
            assert len(tier.hashes()) == 2  # one record per KV-cache group


# -- create_manager's arguments -----------------------------------------------------------


def test_one_tier_not_in_a_list_is_refused_by_name() -> None:
    config = CacheConfig(**GEOMETRY, enable_prefix_caching=True)
    with pytest.raises(
        InvalidTypeError,
        match=r"tiers must be a list or tuple of OffloadTier .*got <.*HostTier.*pass one tier as \[tier\]",
    ):
        create_manager("numpy", config, tiers=untyped(HostTier(1 << 20)))


def test_a_tier_list_holding_something_else_is_refused_by_name() -> None:
    config = CacheConfig(**GEOMETRY, enable_prefix_caching=True)
    with pytest.raises(
        InvalidTypeError, match=esc("tiers must be OffloadTier objects (HostTier, DiskTier, ...), got 'disk'")
    ):
        create_manager("numpy", config, tiers=untyped([HostTier(1 << 20), "disk"]))


def test_a_manager_that_cannot_be_built_closes_its_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[NumpyStorage] = []

    def close(storage: NumpyStorage) -> None:
        closed.append(storage)

    monkeypatch.setattr(NumpyStorage, "close", close, raising=False)
    with pytest.raises(InvalidArgumentError, match="placement must be 'contiguous' or 'fifo'"):
        create_manager("numpy", CacheConfig(**GEOMETRY), placement=untyped("lowest"))
    assert len(closed) == 1


# -- devices -----------------------------------------------------------------------------


def test_a_numpy_device_index_is_stored_as_an_int() -> None:
    device = Device(np.str_("cuda"), untyped(np.int64(1)))
    assert device == Device("cuda", 1)
    assert (type(device.kind), type(device.index)) == (str, int)


@pytest.mark.parametrize("text", ["cuda:99999999999999999999", "cuda:" + "9" * 5000, "cuda:2147483648"])
def test_a_device_index_past_int32_is_refused_by_name(text: str) -> None:
    with pytest.raises(InvalidConfigError, match=r"CacheConfig.device: .*2147483647"):
        CacheConfig(**GEOMETRY, device=text)


# -- tables built from NumPy integers -----------------------------------------------------


def test_a_block_table_of_numpy_integers_holds_ints() -> None:
    table = BlockTable(untyped(np.int64(4)), untyped([np.int32(3), np.int64(5)]), untyped(np.int64(6)))
    table.extend_sequence(untyped(np.int64(1)))
    assert table == BlockTable(4, [3, 5], 7)
    assert BlockTable.blocks_needed_for_length(untyped(np.int64(9)), untyped(np.int16(4))) == 3


def test_a_page_table_of_numpy_integers_holds_ints() -> None:
    table = PageTable(
        kv_indptr=np.array([0, 1]),
        kv_indices=np.array([2]),
        kv_last_page_len=np.array([3]),
        block_tables=np.array([[2]]),
        seq_lens=np.array([3]),
        block_size=untyped(np.int64(4)),
        sliding_window=untyped(np.int32(8)),
        group=untyped(np.uint8(0)),
    )
    assert (type(table.block_size), type(table.sliding_window), type(table.group)) == (int, int, int)


def test_a_page_table_window_past_int32_is_refused_with_the_range() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=esc(f"PageTable.sliding_window must be None or an int >= 1, got {2**31}; valid: 1 to {INT32_MAX}"),
    ):
        PageTable(
            kv_indptr=np.array([0]),
            kv_indices=np.array([], dtype=np.int32),
            kv_last_page_len=np.array([], dtype=np.int32),
            block_tables=np.zeros((0, 0), dtype=np.int32),
            seq_lens=np.array([], dtype=np.int32),
            block_size=4,
            sliding_window=2**31,
        )
