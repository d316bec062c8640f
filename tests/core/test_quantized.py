"""Quantized pools in core: the config fields, the encodings and their rules, the host form,
and the NumPy backend's memory figures (the kit's QuantizedCases cover the data path on
every backend)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.contract.quantization import (
    dequantize,
    dequantize_host,
    grow_running_scales,
    pack_host,
    quantize,
    unpack_host,
)
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    InvalidConfigError,
    ShapeMismatchError,
    UnsupportedConfigError,
)
from kvcache_core.offload.tiers import HostTier


def pool(**fields: Any) -> CacheConfig:
    """2 layers, 2 KV heads of 128 features, 8 blocks of 4 tokens, with ``fields`` changed."""
    base: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 128, "num_blocks": 8, "block_size": 4}
    return CacheConfig(**{**base, **fields})


def written(manager: Any, layer: int, lengths: tuple[int, int], rng: np.random.Generator) -> list[Any]:
    """Requests ``"a"`` and ``"b"`` of ``lengths`` tokens, written in ``layer`` with Gaussian
    K/V of 2 heads of 32 features drawn from ``rng``; their handles."""
    handles = [manager.allocate(AllocationRequest(rid)) for rid in ("a", "b")]
    slots = np.concatenate([manager.extend(handle, length) for handle, length in zip(handles, lengths, strict=True)])
    manager.write(layer, slots, *(rng.standard_normal((len(slots), 2, 32)).astype(np.float32) for _ in range(2)))
    return handles


def prompt_written(manager: Any, prompt: tuple[int, ...], rng: np.random.Generator) -> Any:
    """Request ``"a"`` of ``prompt`` (its token ids given), every layer written with Gaussian
    keys from ``rng`` and their negation as values; its handle."""
    config = manager.config
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=prompt))
    slots = manager.extend(handle, len(prompt), token_ids=prompt)
    for layer in range(config.num_layers):
        keys = rng.standard_normal((len(prompt), config.num_heads, config.head_dim)).astype(np.float32)
        manager.write(layer, slots, keys, -keys)
    return handle


# -- config -------------------------------------------------------------------------------


def test_a_quantized_pool_computes_in_float32_by_default_and_a_plain_pool_in_its_dtype() -> None:
    assert pool(dtype="int8").io_dtype == "float32"
    assert pool(dtype="float8_e4m3fn", compute_dtype="float16").io_dtype == "float16"
    assert pool(dtype="float16").io_dtype == "float16"
    assert pool(dtype="float16", compute_dtype="float16").io_dtype == "float16"
    assert pool(dtype="int8").quantized
    assert not pool().quantized


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "float32", "compute_dtype": "float16"}, "differs from dtype 'float32'"),
        ({"dtype": "int8", "compute_dtype": "int8"}, "valid: float32, float16, bfloat16"),
        ({"dtype": "int8", "compute_dtype": "float64"}, "'float64' is not a compute dtype"),
        ({"dtype": "int8", "kv_scales": [[[1.0, 1.0]] * 2] * 2}, "only for dtype 'float8_e4m3fn'"),
        ({"dtype": "float8_e4m3fn", "kv_scales": [[[1.0, 1.0]] * 2]}, r"shape \(2, 2, 2\)"),
        (
            {"dtype": "float8_e4m3fn", "kv_scales": [[[1.0, 0.0]] * 2] * 2},
            r"kv_scales\[0, 0, 1\] must be a finite number > 0, got 0.0",
        ),
        ({"dtype": "float8_e4m3fn", "kv_scales": [[[1.0, float("nan")]] * 2] * 2}, "finite number > 0, got nan"),
        ({"dtype": "float8_e4m3fn", "kv_scales": "big"}, r"shape \(2, 2, 2\)"),
    ],
)
def test_bad_compute_dtypes_and_scales_are_refused_naming_the_value(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        pool(**fields)


def test_calibrated_scales_are_stored_as_nested_tuples_and_replace_keeps_them() -> None:
    config = pool(dtype="float8_e4m3fn", kv_scales=np.full((2, 2, 2), 0.5))
    assert config.kv_scales == (((0.5, 0.5), (0.5, 0.5)),) * 2
    assert dataclasses.replace(config, num_blocks=4).kv_scales == config.kv_scales
    assert hash(config) == hash(dataclasses.replace(config))


def test_a_plain_config_still_changes_dtype_through_replace() -> None:
    assert dataclasses.replace(pool(), dtype="float16").io_dtype == "float16"


def test_memory_of_int8_and_fp8_pools_with_scales_at_head_dim_128() -> None:
    float32 = pool().bytes_per_block
    float16 = pool(dtype="float16").bytes_per_block
    for dtype in ("int8", "float8_e4m3fn"):
        quantized = pool(dtype=dtype).bytes_per_block
        assert quantized == float32 * (128 + 4) // 512  # one float32 scale per token per head
        assert quantized / float32 <= 0.26
        assert quantized / float16 <= 0.53


def test_the_manager_reports_the_quantized_pool_with_its_scales() -> None:
    config = pool(dtype="int8")
    manager = create_manager("numpy", config)
    storage = manager.storage
    assert isinstance(storage, NumpyStorage)
    assert storage.scales is not None
    held = storage.pool.nbytes + storage.scales.nbytes
    assert manager.stats().total_memory_bytes == held


def test_a_numpy_pool_refuses_a_bfloat16_compute_dtype() -> None:
    with pytest.raises(UnsupportedConfigError, match="bfloat16"):
        create_manager("numpy", pool(dtype="int8", compute_dtype="bfloat16"))


# -- encodings ----------------------------------------------------------------------------


def test_int8_scales_each_token_head_by_its_maximum_and_rounds_to_nearest() -> None:
    values = np.array([[[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]], [[-254.0, 127.0, 1.0], [2.0, 1.0, 0.5]]])
    raw, scales = quantize("int8", values)
    np.testing.assert_array_equal(scales, np.array([[1 / 127, 0.0], [2.0, 2 / 127]], dtype=np.float32))
    np.testing.assert_array_equal(raw[1, 0], [-127, 64, 0])  # 63.5 rounds to even (64), 0.5 to 0
    np.testing.assert_array_equal(raw[0, 1], [0, 0, 0])  # a zero head stays zero, scale 0
    assert np.abs(dequantize(raw, scales) - values).max() <= 1.0 + 1e-6  # half the largest step


def test_fp8_running_maximum_only_grows_and_older_tokens_keep_their_scale() -> None:
    first = np.full((1, 2, 4), 2.0)
    scales = grow_running_scales(np.zeros(2, np.float32), first)
    np.testing.assert_array_equal(scales, np.array([2 / 448, 2 / 448], dtype=np.float32))
    assert np.array_equal(grow_running_scales(scales, first / 4), scales)  # smaller values: unchanged
    bigger = np.full((1, 2, 4), 8.0)
    grown = grow_running_scales(scales, bigger)
    np.testing.assert_array_equal(grown, np.array([8 / 448, 8 / 448], dtype=np.float32))
    raw, token_scales = quantize("float8_e4m3fn", first, scales)
    assert raw.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(dequantize(raw, token_scales), first.astype(np.float32))


def test_fp8_calibrated_scales_saturate_beyond_their_range() -> None:
    raw, _ = quantize("float8_e4m3fn", np.array([[[1.0, 10.0, -10.0]]]), np.array([1 / 448], dtype=np.float32))
    np.testing.assert_array_equal(raw.astype(np.float32), [[[448.0, 448.0, -448.0]]])


def test_the_host_form_packs_raw_bytes_and_scales_losslessly() -> None:
    config = pool(dtype="int8")
    values = np.random.default_rng(0).standard_normal((3, 2, 128))
    raw, scales = quantize("int8", values)
    packed = pack_host(raw, scales)
    assert packed.dtype == np.uint8
    assert packed.shape == (3, 2, 132)
    back_raw, back_scales = unpack_host(config, packed)
    assert back_raw.tobytes() == raw.tobytes()
    assert back_scales.tobytes() == scales.tobytes()
    np.testing.assert_array_equal(dequantize_host(config, packed), dequantize(raw, scales))


def test_a_host_form_of_the_wrong_dtype_or_width_is_refused() -> None:
    config = pool(dtype="int8")
    with pytest.raises(DTypeMismatchError, match="uint8"):
        unpack_host(config, np.zeros((2, 132), np.float32))
    with pytest.raises(ShapeMismatchError, match="132 bytes"):
        unpack_host(config, np.zeros((2, 128), np.uint8))


def test_swap_out_keeps_the_packed_form_and_swap_in_restores_it_bit_exact() -> None:
    config = pool(dtype="float8_e4m3fn")
    manager = create_manager("numpy", config)
    handle = manager.allocate(AllocationRequest("a"))
    slots = manager.extend(handle, 7)
    values = np.random.default_rng(1).standard_normal((7, 2, 128)).astype(np.float32)
    manager.write(0, slots, values, -values)
    before = [array.copy() for array in manager.gather(handle, 0)]
    manager.swap_out("a")
    assert manager.stats().swapped_out_memory_bytes == 2 * config.bytes_per_block
    manager.swap_in("a")
    after = manager.gather(handle, 0)
    for got, expected in zip(after, before, strict=True):
        assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND", "heads_first"])
def test_the_compiled_kernel_dequantizes_like_the_reference(
    dtype: str, kv_layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not paged_kernel.kernel_available():
        pytest.skip("numba is not installed")
    config = pool(dtype=dtype, kv_layout=kv_layout, num_blocks=64, head_dim=32, sliding_window=None)
    manager = create_manager("numpy", config)
    rng = np.random.default_rng(5)
    handles = written(manager, 1, (37, 90), rng)
    query = rng.standard_normal((2, 4, 32)).astype(np.float32)
    table = manager.page_table(handles)
    compiled = manager.paged_attention(1, query, table)
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    reference = manager.paged_attention(1, query, table)
    np.testing.assert_allclose(compiled, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_attention_features_on_a_quantized_pool_match_the_reference(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window, softcapping and sinks on a quantized pool: the compiled kernel (which decodes
    the tiles) against the NumPy reference (which folds the scales into scores and weights)."""
    if not paged_kernel.kernel_available():
        pytest.skip("numba is not installed")
    config = pool(dtype=dtype, num_blocks=64, head_dim=32, sliding_window=None)
    manager = create_manager("numpy", config)
    rng = np.random.default_rng(8)
    handles = written(manager, 0, (41, 77), rng)
    query = rng.standard_normal((2, 4, 32)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    table = manager.page_table(handles)
    compiled = manager.paged_attention(0, query, table, window=19, softcap=2.5, sinks=sinks)
    plain = manager.paged_attention(0, query, table)
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    reference = manager.paged_attention(0, query, table, window=19, softcap=2.5, sinks=sinks)
    np.testing.assert_allclose(compiled, reference, rtol=1e-5, atol=1e-5)
    assert not np.allclose(compiled, plain, atol=1e-3), "the features changed nothing"


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_a_saved_prefix_cache_loads_back_with_its_raw_bytes_and_scales(dtype: str, tmp_path: Path) -> None:
    config = pool(dtype=dtype, head_dim=8, num_blocks=16, enable_prefix_caching=True, model_id="m")
    prompt = tuple(range(10, 22))
    saved = create_manager("numpy", config)
    handle = prompt_written(saved, prompt, np.random.default_rng(4))
    blocks = np.asarray(handle.block_table().physical_blocks, dtype=np.int64)
    expected = saved.storage.blocks_to_host(blocks)
    saved.deallocate("a")
    saved.save_prefix_cache(tmp_path / "prefix.kvc")
    loaded = create_manager("numpy", config)
    loaded.load_prefix_cache(tmp_path / "prefix.kvc")
    hit = loaded.allocate(AllocationRequest("b", prompt_token_ids=prompt))
    assert hit.num_tokens() == 8  # the full blocks before the prompt's last token
    got = loaded.storage.blocks_to_host(np.asarray(hit.block_table().physical_blocks[:2], dtype=np.int64))
    for got_array, expected_array in zip(got, expected, strict=True):
        assert got_array.tobytes() == np.ascontiguousarray(expected_array[:, :2]).tobytes()


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_an_offload_tier_gives_back_evicted_blocks_with_their_scales(dtype: str) -> None:
    config = pool(dtype=dtype, head_dim=8, num_blocks=6, enable_prefix_caching=True, model_id="m")
    manager = create_manager("numpy", config, tiers=[HostTier(1 << 20)])
    prompt = tuple(range(10, 19))
    handle = prompt_written(manager, prompt, np.random.default_rng(6))
    before = [array.copy() for array in manager.gather(handle, 1)]
    manager.deallocate("a")
    manager.allocate(AllocationRequest("fill", initial_tokens=24))  # the whole pool: evicts the cached blocks
    manager.deallocate("fill")
    hit = manager.allocate(AllocationRequest("b", prompt_token_ids=prompt))
    assert hit.num_tokens() == 8
    for got, expected in zip(manager.gather(hit, 1), before, strict=True):
        assert got.tobytes() == expected[:8].tobytes()


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_a_quantized_pool_over_given_memory_keeps_its_scales_there(dtype: str) -> None:
    config = pool(dtype=dtype)
    raw = np.zeros(NumpyStorage.pool_shape(config), dtype=NumpyStorage.element_dtype(config))
    shape = NumpyStorage.scales_shape(config)
    assert shape is not None
    assert shape == (2, 2, 2, config.num_blocks, config.block_size)
    scales = np.zeros(shape, dtype=np.float32)
    storage = NumpyStorage(config, pool=raw, scales=scales)
    storage.write(1, np.arange(5, dtype=np.int64), np.ones((5, 2, 128), np.float32), np.ones((5, 2, 128), np.float32))
    assert storage.scales is scales
    assert np.count_nonzero(scales[1]) == 2 * 2 * 5  # K and V of 2 heads of 5 tokens
    if dtype == "float8_e4m3fn":  # a new storage over them resumes the running maximum
        assert np.array_equal(NumpyStorage(config, pool=raw, scales=scales).head_scales(1), storage.head_scales(1))


@pytest.mark.parametrize(
    ("scales", "error", "message"),
    [
        ([0.0], ArrayTypeError, "scales must be a numpy.ndarray, got list"),
        (np.zeros((2, 2, 2, 8, 5), np.float32), ShapeMismatchError, r"\(2, 2, 2, 8, 5\), expected \(2, 2, 2, 8, 4\)"),
        (np.zeros((2, 2, 2, 8, 4), np.float64), DTypeMismatchError, "float64, expected float32"),
        (np.zeros((2, 2, 2, 8, 4), np.float32, order="F"), InvalidArgumentError, "C-contiguous: False"),
    ],
)
def test_bad_memory_for_the_scales_is_refused_naming_it(scales: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        NumpyStorage(pool(dtype="int8"), scales=scales)


def test_scales_for_an_unquantized_pool_are_refused() -> None:
    assert NumpyStorage.scales_shape(pool(dtype="float32")) is None
    with pytest.raises(InvalidArgumentError, match="a float32 pool has none"):
        NumpyStorage(pool(dtype="float32"), scales=np.zeros((2, 2, 2, 8, 4), np.float32))
