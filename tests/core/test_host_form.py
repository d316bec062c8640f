"""Core's host form of pool blocks (``kvcache_core.offload.host_form``) at the edges where blocks
come from outside: prefix-cache files (every tensor's stored dtype checked against the
header, quantized scales checked, version-1 files still read) and offload tiers' records."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("safetensors")

from safetensors.numpy import load, save

from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.errors import (
    CorruptCacheFileError,
    DTypeMismatchError,
    IncompatibleCacheFileError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload import host_form
from kvcache_core.offload.prefix_file import BlockRecord, block_checksum, read_blocks, write_blocks
from kvcache_core.offload.tiers import HostTier
from kvcache_core.testing.world import assert_same_state, snapshot

Manager = PagedKvCacheManager[Any]
HostArray = npt.NDArray[Any]

GEOMETRY: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 8, "num_blocks": 16, "block_size": 4}
PROMPT = tuple(range(40, 49))  # two full blocks of 4 and one token


def config_of(dtype: str = "float32", **fields: Any) -> CacheConfig:
    settings: dict[str, Any] = {**GEOMETRY, "dtype": dtype, "enable_prefix_caching": True, **fields}
    return CacheConfig(**settings)


def prefilled(dtype: str = "float32", **options: Any) -> Manager:
    """A NumPy manager holding ``PROMPT``'s two full blocks as cached blocks."""
    manager = create_manager("numpy", config_of(dtype), **options)
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=PROMPT))
    slots = manager.extend(handle, len(PROMPT))
    rng = np.random.default_rng(1)
    io = np.dtype(manager.config.io_dtype)
    for layer in range(manager.config.num_layers):
        keys = rng.standard_normal((len(slots), 2, 8)).astype(io)
        manager.write(layer, slots, keys, -keys)
    manager.deallocate("a")
    return manager


def saved(tmp_path: Path, dtype: str = "float32") -> Path:
    path = tmp_path / f"{dtype}.safetensors"
    assert prefilled(dtype).save_prefix_cache(path) == 2
    return path


def header_of(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    table = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    header: dict[str, Any] = json.loads(table["__metadata__"]["kvcache"])
    return header


def rewrite(path: Path, keys: HostArray, values: HostArray, **header_changes: Any) -> None:
    """Store other tensors (and header fields) in ``path``, with every block's checksum
    recomputed, as a forger would."""
    header = header_of(path)
    header.update(header_changes)
    for index, block in enumerate(header["blocks"]):
        block["checksum"] = block_checksum(keys[:, index], values[:, index])
    data = save(
        {"keys": np.ascontiguousarray(keys), "values": np.ascontiguousarray(values)},
        metadata={"kvcache": json.dumps(header)},
    )
    path.write_bytes(data)


def stored(path: Path) -> tuple[HostArray, HostArray]:
    tensors = load(path.read_bytes())
    return tensors["keys"].copy(), tensors["values"].copy()


def refused(path: Path, dtype: str, error: type[Exception], match: str) -> None:
    """Loading ``path`` into a fresh pool of ``dtype`` raises and changes nothing."""
    target = create_manager("numpy", config_of(dtype))
    before = snapshot(target)
    with pytest.raises(error, match=match):
        target.load_prefix_cache(path)
    assert_same_state(snapshot(target), before)
    target.check_invariants()


# -- each tensor's stored dtype is the header's --------------------------------------------


@pytest.mark.parametrize(("wrong", "code"), [("float64", "F64"), ("int32", "I32"), ("float16", "F16")])
def test_tensors_stored_in_another_dtype_than_the_header_says_are_refused_not_cast(
    tmp_path: Path, wrong: str, code: str
) -> None:
    path = saved(tmp_path)
    keys, values = stored(path)
    rewrite(path, keys.astype(wrong), values.astype(wrong))
    refused(path, "float32", CorruptCacheFileError, f"its keys are stored as '{code}'; float32 blocks")


def test_one_tensor_in_another_dtype_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    keys, values = stored(path)
    rewrite(path, keys, values.astype(np.float64))
    refused(path, "float32", CorruptCacheFileError, "its values are stored as 'F64'.*stored as F32")


def test_a_header_declaring_another_tensor_dtype_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    keys, values = stored(path)
    rewrite(path, keys.astype(np.float64), values.astype(np.float64), tensor_dtype="float64")
    refused(path, "float32", IncompatibleCacheFileError, "declares its tensors 'float64'.*'float32'")


def test_a_version_2_header_without_its_tensor_dtype_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    keys, values = stored(path)
    rewrite(path, keys, values, tensor_dtype=None)
    refused(path, "float32", IncompatibleCacheFileError, "declares its tensors None")


def test_a_saved_file_says_its_format_version_and_tensor_dtype(tmp_path: Path) -> None:
    header = header_of(saved(tmp_path, "int8"))
    assert (header["version"], header["dtype"], header["tensor_dtype"]) == (2, "int8", "uint8")


# -- quantized scales -----------------------------------------------------------------------


@pytest.mark.parametrize("scale", [np.nan, np.inf, -np.inf, -1.0, -0.0])
def test_an_int8_file_with_a_bad_scale_is_refused(tmp_path: Path, scale: float) -> None:
    path = saved(tmp_path, "int8")
    keys, values = stored(path)
    scales = keys[..., 8:].copy().view(np.float32)  # [layers, n, block_size, heads, 1]
    scales[1, 1, 2, 0, 0] = scale
    keys[..., 8:] = scales.view(np.uint8)
    rewrite(path, keys, values)
    refused(path, "int8", CorruptCacheFileError, r"block 1: keys\[1, 2, 0\] has scale .*finite and >= 0")


def test_a_float8_file_with_a_nan_value_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("ml_dtypes")
    path = saved(tmp_path, "float8_e4m3fn")
    keys, values = stored(path)
    values[0, 0, 3, 1, 5] = 0x7F  # e4m3fn NaN
    rewrite(path, keys, values)
    refused(path, "float8_e4m3fn", CorruptCacheFileError, r"block 0: values\[0, 3, 1, 5\] is a float8 NaN")


def test_nan_scales_are_never_served(tmp_path: Path) -> None:
    path = saved(tmp_path, "int8")
    keys, values = stored(path)
    scales = values[..., 8:].copy().view(np.float32)
    scales[...] = np.nan
    values[..., 8:] = scales.view(np.uint8)
    rewrite(path, keys, values)
    target = create_manager("numpy", config_of("int8"))
    with pytest.raises(CorruptCacheFileError):
        target.load_prefix_cache(path)
    handle = target.allocate(AllocationRequest("b", prompt_token_ids=PROMPT))
    assert handle.num_cached_tokens() == 0


# -- version 1 files --------------------------------------------------------------------------


def bfloat16_config() -> CacheConfig:
    return config_of("bfloat16")


def version_1_bfloat16_file(tmp_path: Path, keys: HostArray, values: HostArray) -> Path:
    """A file as version 1 wrote it for a bfloat16 pool: no ``tensor_dtype`` in the header,
    the tensors as given (float32 values from torch, bit patterns from JAX)."""
    path = saved(tmp_path)  # the blocks of PROMPT: their hashes and token ids
    header = header_of(path)
    header.pop("tensor_dtype")
    header.update(version=1, dtype="bfloat16")
    for index, block in enumerate(header["blocks"]):
        block["checksum"] = block_checksum(keys[:, index], values[:, index])
    path.write_bytes(save({"keys": keys, "values": values}, metadata={"kvcache": json.dumps(header)}))
    return path


def retype_tensors(path: Path, code: str) -> None:
    """Name another safetensors dtype (of the same element size) for both tensors."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    table = json.loads(data[8 : 8 + length])
    for name in ("keys", "values"):
        table[name]["dtype"] = code
    encoded = json.dumps(table).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data[8 + length :])


def test_a_version_1_bfloat16_file_of_float32_values_loads_as_bit_patterns(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 0x7F80, size=(2, 2, 4, 2, 8), dtype=np.uint16)  # finite, positive
    widened = host_form.bfloat16_to_float32(bits)
    path = version_1_bfloat16_file(tmp_path, widened, -widened)
    records = read_blocks(path, bfloat16_config())
    assert [record.keys.dtype for record in records] == [np.dtype(np.uint16)] * 2
    assert np.array_equal(np.stack([record.keys for record in records], axis=1), bits)
    assert np.array_equal(np.stack([record.values for record in records], axis=1), bits | np.uint16(0x8000))


def test_a_version_1_bfloat16_file_of_float32_values_bfloat16_cannot_hold_is_refused(tmp_path: Path) -> None:
    widened = np.full((2, 2, 4, 2, 8), 1.0, dtype=np.float32)
    widened[1, 0, 2, 1, 3] = 1.0 + 2.0**-20  # not a bfloat16 value
    path = version_1_bfloat16_file(tmp_path, widened, widened)
    with pytest.raises(CorruptCacheFileError, match=r"block 0: value .* is not a bfloat16 value"):
        read_blocks(path, bfloat16_config())


def test_a_version_1_bfloat16_file_of_bf16_tensors_loads_as_bit_patterns(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 0xFFFF, size=(2, 2, 4, 2, 8), dtype=np.uint16)
    path = version_1_bfloat16_file(tmp_path, bits, bits)
    retype_tensors(path, "BF16")  # what safetensors wrote for JAX's ml_dtypes.bfloat16 arrays
    records = read_blocks(path, bfloat16_config())
    assert np.array_equal(np.stack([record.keys for record in records], axis=1), bits)


def test_a_version_2_bfloat16_file_of_float32_values_is_refused(tmp_path: Path) -> None:
    widened = np.ones((2, 2, 4, 2, 8), dtype=np.float32)
    path = version_1_bfloat16_file(tmp_path, widened, widened)
    header = header_of(path)
    header.update(version=2, tensor_dtype="uint16")
    path.write_bytes(save({"keys": widened, "values": widened}, metadata={"kvcache": json.dumps(header)}))
    with pytest.raises(CorruptCacheFileError, match=r"its keys are stored as 'F32'.*stored as U16"):
        read_blocks(path, bfloat16_config())


def test_a_version_1_float32_file_still_loads(tmp_path: Path) -> None:
    path = saved(tmp_path)
    keys, values = stored(path)
    header = header_of(path)
    header.pop("tensor_dtype")
    header["version"] = 1
    path.write_bytes(save({"keys": keys, "values": values}, metadata={"kvcache": json.dumps(header)}))
    target = create_manager("numpy", config_of())
    assert target.load_prefix_cache(path) == 2


# -- tiers' records ---------------------------------------------------------------------------


class ForgingTier(HostTier):
    """A third party's tier that gives records back changed by ``forge``."""

    def __init__(self, max_bytes: int, forge: Any) -> None:
        super().__init__(max_bytes, name="forging")
        self.forge = forge

    def peek(self, key: bytes, /) -> BlockRecord | None:
        record = super().peek(key)
        return None if record is None else self.forge(record)


def nan_scales(record: BlockRecord) -> BlockRecord:
    keys = record.keys.copy()
    keys[..., 8:] = np.full((*keys.shape[:-1], 1), np.nan, np.float32).view(np.uint8)
    return dataclasses.replace(record, keys=keys)


def widened(record: BlockRecord) -> BlockRecord:
    return dataclasses.replace(record, keys=record.keys.astype(np.float64))


@pytest.mark.parametrize(
    ("dtype", "forge", "match"), [("int8", nan_scales, "scale nan|checksum"), ("float32", widened, "float64")]
)
def test_a_tier_record_not_in_host_form_or_with_bad_scales_is_a_miss_with_a_warning(
    dtype: str, forge: Any, match: str
) -> None:
    tier = ForgingTier(1 << 20, forge)
    manager = create_manager("numpy", config_of(dtype), tiers=[tier])
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=PROMPT))
    slots = manager.extend(handle, len(PROMPT))
    io = np.dtype(manager.config.io_dtype)
    for layer in range(2):
        manager.write(layer, slots, np.ones((len(slots), 2, 8), io), np.ones((len(slots), 2, 8), io))
    manager.deallocate("a")
    manager.gc()
    assert len(tier.hashes()) == 2
    with pytest.warns(RuntimeWarning, match=match):
        again = manager.allocate(AllocationRequest("b", prompt_token_ids=PROMPT))
    assert again.num_cached_tokens() == 0
    stats = manager.tier_stats()[0]
    assert (stats.failures, stats.blocks, stats.hits) == (2, 0, 0)  # both dropped, neither served
    manager.check_invariants()


# -- the host form itself ---------------------------------------------------------------------


def test_float32_to_bfloat16_rounds_to_nearest_even_as_ml_dtypes_does() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    words = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    values = words.view(np.float32)
    values = values[~np.isnan(values)]
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38], np.float32)
    values = np.concatenate([values, specials])
    expected = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(host_form.float32_to_bfloat16(values), expected)


def test_float32_to_bfloat16_keeps_nan_a_nan() -> None:
    nans = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000], np.uint32).view(np.float32)
    assert np.isnan(host_form.bfloat16_to_float32(host_form.float32_to_bfloat16(nans))).all()


def test_bfloat16_bit_patterns_widen_exactly_and_back() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    widened_values = host_form.bfloat16_to_float32(bits)
    finite = ~np.isnan(widened_values)
    assert np.array_equal(host_form.float32_to_bfloat16(widened_values, exact=True)[finite], bits[finite])


def test_host_arrays_of_another_dtype_or_shape_are_refused_by_name() -> None:
    config = config_of("bfloat16")
    shape = host_form.host_shape(config, 3)
    assert shape == (2, 3, 4, 2, 8)
    with pytest.raises(DTypeMismatchError, match="float32; the host form of a bfloat16 pool is uint16"):
        host_form.check_host_array(config, "keys", np.zeros(shape, np.float32), shape)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 3, 4, 2, 8\).*got \(2, 3, 4, 2, 7\)"):
        host_form.check_host_array(config, "keys", np.zeros((2, 3, 4, 2, 7), np.uint16), shape)
    with pytest.raises(InvalidArgumentError, match="no host form for dtype 'int4'"):
        host_form.host_dtype("int4")


def test_every_pool_dtype_has_a_host_form() -> None:
    from kvcache_core.contract.config import DTYPE_SIZES

    assert set(host_form.HOST_DTYPES) == set(DTYPE_SIZES)


def test_a_refused_write_of_records_leaves_no_file(tmp_path: Path) -> None:
    manager = prefilled()
    records = read_blocks(saved(tmp_path), manager.config)
    forged = [dataclasses.replace(records[0], keys=records[0].keys.astype(np.float64)), records[1]]
    target = tmp_path / "forged.safetensors"
    with pytest.raises(DTypeMismatchError, match="block 0's keys have dtype float64"):
        write_blocks(target, manager.config, forged)
    assert not target.exists()


def test_a_good_int8_file_loads_without_a_warning(tmp_path: Path) -> None:
    path = saved(tmp_path, "int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert create_manager("numpy", config_of("int8")).load_prefix_cache(path) == 2
