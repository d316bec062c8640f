"""What the memory map adds: the bytes survive the storage, and a bad reopen is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError
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
        ({"path": 42}, "int"),
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
