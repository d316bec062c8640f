"""What the memory map adds: the bytes survive the storage, and a bad reopen is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError, UnsupportedConfigError
from kvcache_memmap import MemmapStorage

CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4)


def test_a_reopened_pool_holds_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    storage = MemmapStorage(CONFIG, path=path)
    manager = PagedKvCacheManager(storage, backend="memmap")
    handle = manager.allocate(AllocationRequest("r"))
    slots = manager.extend(handle, 6)
    keys = np.arange(6 * 2 * 4, dtype=np.float32).reshape(6, 2, 4)
    manager.write(1, slots, keys, -keys)
    table = handle.block_table().to_dict()
    storage.close()  # flushes, and releases the path's lock for the next opener
    del manager, handle, storage

    reopened = MemmapStorage(CONFIG, path=path, mode="r+")
    blocks = np.asarray(table["physical_blocks"], dtype=np.int64)
    got_keys, got_values = reopened.gather(1, blocks, 6)
    assert np.array_equal(got_keys, keys)
    assert np.array_equal(got_values, -keys)


def test_a_temporary_pool_file_is_removed_with_its_storage() -> None:
    storage = MemmapStorage(CONFIG)
    path = storage.path
    assert path.exists()
    del storage
    assert not path.exists()


def test_reopening_with_another_geometry_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    MemmapStorage(CONFIG, path=path)
    other = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=16, block_size=4)

    with pytest.raises(InvalidConfigError, match="num_blocks"):
        MemmapStorage(other, path=path, mode="r+")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"mode": "r"}, "'r'"),
        ({"mode": "r+"}, "give its path"),
    ],
)
def test_bad_options_are_refused(options: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        MemmapStorage(CONFIG, **options)  # type: ignore[arg-type]


def test_reopening_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no kvcache pool"):
        MemmapStorage(CONFIG, path=tmp_path / "missing.kv", mode="r+")


def test_reopening_a_damaged_pool_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    MemmapStorage(CONFIG, path=path)
    with path.open("r+b") as pool_file:
        pool_file.truncate(100)
    with pytest.raises(InvalidConfigError, match="holds 100 bytes"):
        MemmapStorage(CONFIG, path=path, mode="r+")

    (tmp_path / "pool.kv.json").write_text("{not json")
    with pytest.raises(InvalidConfigError, match="not valid JSON"):
        MemmapStorage(CONFIG, path=path, mode="r+")


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_a_reopened_quantized_pool_holds_its_raw_bytes_and_scales(tmp_path: Path, dtype: str) -> None:
    config = dataclasses.replace(CONFIG, dtype=dtype, head_dim=8)
    path = tmp_path / "pool.kv"
    storage = MemmapStorage(config, path=path)
    manager = PagedKvCacheManager(storage, backend="memmap")
    handle = manager.allocate(AllocationRequest("r"))
    slots = manager.extend(handle, 6)
    rng = np.random.default_rng(5)
    keys, values = (rng.standard_normal((6, 2, 8)).astype(np.float32) for _ in range(2))
    manager.write(1, slots, keys, values)
    blocks = np.asarray(handle.block_table().physical_blocks, dtype=np.int64)
    host = storage.blocks_to_host(blocks)
    gathered = storage.gather(1, blocks, 6)
    head_scales = storage.head_scales(1)
    storage.close()
    del manager, handle, storage

    reopened = MemmapStorage(config, path=path, mode="r+")
    assert isinstance(reopened.scales, np.memmap)  # in the file, not in memory
    for got, expected in zip(reopened.blocks_to_host(blocks), host, strict=True):
        assert got.tobytes() == expected.tobytes()
    for got, expected in zip(reopened.gather(1, blocks, 6), gathered, strict=True):
        assert np.array_equal(got, expected)
    if dtype == "float8_e4m3fn":  # the running maximum resumes where it stood
        assert np.array_equal(reopened.head_scales(1), head_scales)


def test_a_quantized_pool_file_holds_the_blocks_then_their_scales(tmp_path: Path) -> None:
    config = dataclasses.replace(CONFIG, dtype="int8")
    storage = MemmapStorage(config, path=tmp_path / "pool.kv")
    scales = storage.scales
    assert scales is not None
    raw_bytes = storage.pool.nbytes
    assert storage.path.stat().st_size == -(-raw_bytes // 64) * 64 + scales.nbytes
    storage.close()
    with pytest.raises(InvalidConfigError, match="int8"):
        MemmapStorage(CONFIG, path=tmp_path / "pool.kv", mode="r+")  # a float32 config on it


def test_a_quantized_pool_in_a_dtype_numpy_cannot_compute_in_is_refused_before_any_file(tmp_path: Path) -> None:
    config = dataclasses.replace(CONFIG, dtype="int8", compute_dtype="bfloat16")
    with pytest.raises(UnsupportedConfigError, match=r"'bfloat16'.*float32, float16|float32, float16.*'bfloat16'"):
        MemmapStorage(config, path=tmp_path / "pool.kv")
    assert list(tmp_path.iterdir()) == []
