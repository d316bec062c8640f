"""``CacheConfig.value_head_dim``: values of another width than the keys (multi-head latent
attention, ``v_head_dim``). The configuration and its sizes, the refusal of a backend or
storage that does not serve it, the prefix-file geometry, the host form's widths and the
attention output's width. What every backend must do with it is the kit's
(:mod:`kvcache_core.testing.value_widths`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.attention.reference import paged_attention
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.contract import quantization
from kvcache_core.errors import (
    IncompatibleCacheFileError,
    InvalidConfigError,
    ShapeMismatchError,
    UnsupportedConfigError,
)
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload import host_form
from kvcache_core.plugin import VALUE_HEAD_DIM, BackendSpec
from kvcache_core.testing.oracle import dense_attention

GEOMETRY: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 8, "num_blocks": 8, "block_size": 4}


def config(**fields: Any) -> CacheConfig:
    return CacheConfig(**{**GEOMETRY, **fields})


@pytest.mark.parametrize("value", [0, -3, 2**31, True, 2.0], ids=["zero", "negative", "too-large", "bool", "float"])
def test_a_value_head_dim_outside_its_range_is_refused_by_name(value: object) -> None:
    with pytest.raises(InvalidConfigError, match=re.escape("CacheConfig.value_head_dim")):
        config(value_head_dim=value)


def test_a_value_head_dim_equal_to_head_dim_is_stored_as_none() -> None:
    assert config(value_head_dim=8).value_head_dim is None
    assert config(value_head_dim=8) == config()
    assert config(value_head_dim=np.int64(4)).value_head_dim == 4


def test_sizes_count_keys_and_values_of_their_own_widths() -> None:
    plain, narrow = config(dtype="float16"), config(dtype="float16", value_head_dim=2)

    assert narrow.value_width == 2
    assert plain.value_width == 8
    assert narrow.bytes_per_token == 2 * 2 * (8 + 2) * 2  # layers x heads x (key + value) x bytes
    assert plain.bytes_per_token == 2 * 2 * 16 * 2
    assert narrow.bytes_per_block == 4 * narrow.bytes_per_token
    quantized = config(dtype="int8", value_head_dim=2)
    assert quantized.bytes_per_token == 2 * 2 * ((8 + 2) * 1 + 2 * 4)  # a float32 scale each for K and V


def test_the_value_block_shape_has_the_value_width_in_every_layout() -> None:
    for layout, expected in (("NHD", (8, 4, 2, 3)), ("HND", (8, 2, 4, 3)), ("heads_first", (2, 8, 4, 3))):
        shaped = config(value_head_dim=3, kv_layout=layout)
        assert shaped.value_block_shape() == expected
        assert shaped.block_shape() == (*expected[:3], 8)


def test_stats_report_the_bytes_of_both_widths() -> None:
    manager = create_manager("numpy", config(value_head_dim=2))
    handle = manager.allocate(AllocationRequest("r", initial_tokens=5))

    assert manager.stats().total_memory_bytes == 8 * 4 * 2 * 2 * (8 + 2) * 4
    assert handle.stats().memory_bytes == 2 * manager.config.bytes_per_block
    assert manager.storage.pool.nbytes == manager.stats().total_memory_bytes  # type: ignore[attr-defined]


def test_the_handle_tells_both_widths() -> None:
    handle = create_manager("numpy", config(value_head_dim=2)).allocate(AllocationRequest("r"))

    assert (handle.head_dim(), handle.value_head_dim()) == (8, 2)


def test_a_backend_that_does_not_claim_the_capability_is_refused_by_name() -> None:
    spec = BackendSpec(name="old", storage_factory=NumpyStorage, kv_layouts=("NHD",))

    problems = spec.check_config(config(value_head_dim=2, kv_layout="NHD"))

    assert len(problems) == 1
    assert "value_head_dim 2" in problems[0]
    assert repr(VALUE_HEAD_DIM) in problems[0]
    assert spec.check_config(config(kv_layout="NHD")) == []


class _OneWidthStorage(NumpyStorage):
    """A storage written before values could differ from keys: it builds its pool from the
    geometry it knows, ``head_dim`` for both."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self._config = config.with_layout("heads_first")
        plain = CacheConfig(2, 2, 8, 8, 4, kv_layout="heads_first")
        self._parts = NumpyStorage(plain)._parts  # pyright: ignore[reportPrivateUsage]


def test_a_manager_refuses_a_storage_whose_values_are_not_that_wide() -> None:
    storage = _OneWidthStorage(config(value_head_dim=2))

    with pytest.raises(UnsupportedConfigError, match="'value_head_dim' capability"):
        PagedKvCacheManager(storage)


def test_write_refuses_values_of_the_key_width_and_changes_nothing() -> None:
    manager = create_manager("numpy", config(value_head_dim=2))
    handle = manager.allocate(AllocationRequest("r"))
    slots = manager.extend(handle, 3)
    keys = np.ones((3, 2, 8), np.float32)

    with pytest.raises(
        ShapeMismatchError, match=re.escape("values must have shape (3, 2, 2) ([n, num_heads, value_width])")
    ):
        manager.write(0, slots, keys, keys)
    assert not manager.gather(handle, 0)[1].any()


def test_the_host_form_of_values_has_the_value_width() -> None:
    narrow = config(value_head_dim=2)
    quantized = config(value_head_dim=2, dtype="int8")

    assert host_form.host_shape(narrow, 3) == (2, 3, 4, 2, 8)
    assert host_form.host_shape(narrow, 3, "values") == (2, 3, 4, 2, 2)
    assert host_form.host_record_shape(quantized, "values") == (2, 4, 2, 6)
    raw, scales = quantization.unpack_host(quantized, np.zeros((4, 2, 6), np.uint8))
    assert raw.shape == (4, 2, 2)
    assert scales.shape == (4, 2)
    with pytest.raises(ShapeMismatchError, match="6 or 12 bytes"):
        quantization.unpack_host(quantized, np.zeros((4, 2, 7), np.uint8))


def test_blocks_from_host_refuses_values_of_the_key_width() -> None:
    manager = create_manager("numpy", config(value_head_dim=2))
    keys = np.zeros(host_form.host_shape(manager.config, 1), np.float32)

    with pytest.raises(ShapeMismatchError, match="value_width"):
        manager.storage.blocks_from_host(np.array([0]), keys, keys)


def test_the_reference_attention_returns_the_value_width() -> None:
    rng = np.random.default_rng(5)
    manager = create_manager("numpy", config(value_head_dim=3, kv_layout="NHD"))
    handle = manager.allocate(AllocationRequest("r"))
    slots = manager.extend(handle, 7)
    keys, values = rng.standard_normal((7, 2, 8)).astype(np.float32), rng.standard_normal((7, 2, 3)).astype(np.float32)
    manager.write(0, slots, keys, values)
    query = rng.standard_normal((7, 4, 8)).astype(np.float32)

    output = paged_attention(
        query,
        manager.storage.key_cache(0),
        manager.storage.value_cache(0),
        manager.page_table([handle]),
        qo_indptr=[0, 7],
    )

    assert output.shape == (7, 4, 3)
    np.testing.assert_allclose(output, dense_attention(query, keys, values), rtol=1e-5, atol=1e-5)


@pytest.fixture
def saved_file(tmp_path: Path) -> Callable[[CacheConfig], Path]:
    pytest.importorskip("safetensors")

    def save(pool_config: CacheConfig) -> Path:
        manager = create_manager("numpy", pool_config)
        handle = manager.allocate(AllocationRequest("r", prompt_token_ids=tuple(range(9))))
        slots = manager.extend(handle, 9)
        rng = np.random.default_rng(7)
        for layer in range(2):
            keys = rng.standard_normal((9, 2, 8)).astype(np.float32)
            values = rng.standard_normal((9, 2, pool_config.value_width)).astype(np.float32)
            manager.write(layer, slots, keys, values)
        path = tmp_path / f"prefix-{pool_config.value_width}.safetensors"
        manager.save_prefix_cache(path)
        return path

    return save


def test_a_prefix_file_states_the_value_width_and_loads_into_the_same_widths(
    saved_file: Callable[[CacheConfig], Path],
) -> None:
    narrow = config(value_head_dim=2, enable_prefix_caching=True)
    path = saved_file(narrow)

    assert create_manager("numpy", narrow).load_prefix_cache(path) == 2
    assert b'\\"value_head_dim\\":2' in path.read_bytes()


def test_a_pool_of_one_width_refuses_a_file_of_two_by_name(saved_file: Callable[[CacheConfig], Path]) -> None:
    path = saved_file(config(value_head_dim=2, enable_prefix_caching=True))

    with pytest.raises(IncompatibleCacheFileError, match=r"value_head_dim 2\); this pool's value_head_dim is None"):
        create_manager("numpy", config(enable_prefix_caching=True)).load_prefix_cache(path)


def test_a_pool_of_two_widths_refuses_a_file_of_one_by_name(saved_file: Callable[[CacheConfig], Path]) -> None:
    path = saved_file(config(enable_prefix_caching=True))

    with pytest.raises(IncompatibleCacheFileError, match="this pool's value_head_dim is 2"):
        create_manager("numpy", config(value_head_dim=2, enable_prefix_caching=True)).load_prefix_cache(path)


def test_a_file_of_one_width_keeps_its_header_and_loads(saved_file: Callable[[CacheConfig], Path]) -> None:
    plain = config(enable_prefix_caching=True)
    path = saved_file(plain)

    assert b"value_head_dim" not in path.read_bytes()
    assert create_manager("numpy", plain).load_prefix_cache(path) == 2
