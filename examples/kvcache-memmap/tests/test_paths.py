"""Bad paths are refused with kvcache errors before any file changes; links only when asked."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvcache_core import CacheConfig
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError, KvCacheError
from kvcache_memmap import MemmapStorage, PoolPathError, PoolPathIsADirectoryError, PoolPathNotFoundError
from kvcache_memmap._paths import read_small_file

CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4)
SMALL = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=2, block_size=4)


def closed_filled_pool(path: Path) -> bytes:
    """Make a closed pool at ``path`` whose every element is distinct; its bytes."""
    storage = MemmapStorage(CONFIG, path=path)
    storage.pool[...] = np.arange(storage.pool.size, dtype=np.float32).reshape(storage.pool.shape)
    storage.close()
    return path.read_bytes()


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (PoolPathError, OSError),
        (PoolPathError, ValueError),
        (PoolPathIsADirectoryError, IsADirectoryError),
        (PoolPathNotFoundError, FileNotFoundError),
        (PoolPathNotFoundError, InvalidArgumentError),
    ],
)
def test_path_errors_are_kvcache_errors_and_the_matching_builtin(
    error: type[Exception], builtin: type[BaseException]
) -> None:
    assert issubclass(error, KvCacheError)
    assert issubclass(error, builtin)


def test_a_failing_create_leaves_the_existing_pool_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    before = closed_filled_pool(path)
    sidecar = tmp_path / "pool.kv.json"
    sidecar.unlink()
    sidecar.mkdir()

    with pytest.raises(PoolPathIsADirectoryError, match="sidecar"):
        MemmapStorage(SMALL, path=path)

    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["pool.kv", "pool.kv.json"]  # no temporary file left


def test_a_create_leaves_no_temporary_file(tmp_path: Path) -> None:
    storage = MemmapStorage(CONFIG, path=tmp_path / "pool.kv")

    assert sorted(os.listdir(tmp_path)) == ["pool.kv", "pool.kv.json", "pool.kv.lock"]
    assert json.loads((tmp_path / "pool.kv.json").read_text())["num_blocks"] == CONFIG.num_blocks
    storage.close()


@pytest.mark.parametrize("mode", ["w+", "r+"])
def test_a_directory_as_the_pool_path_is_refused(tmp_path: Path, mode: str) -> None:
    with pytest.raises(PoolPathIsADirectoryError, match="is a directory") as refused:
        MemmapStorage(CONFIG, path=tmp_path, mode=mode)  # type: ignore[arg-type]

    assert refused.value.errno == errno.EISDIR
    assert str(tmp_path) in str(refused.value)


@pytest.mark.parametrize("mode", ["w+", "r+"])
def test_a_missing_parent_directory_is_refused(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "missing" / "pool.kv"

    with pytest.raises(PoolPathNotFoundError, match="create it first"):
        MemmapStorage(CONFIG, path=path, mode=mode)  # type: ignore[arg-type]

    assert not (tmp_path / "missing").exists()


def test_a_parent_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")

    with pytest.raises(PoolPathError, match="not a directory") as refused:
        MemmapStorage(CONFIG, path=tmp_path / "file" / "pool.kv")

    assert refused.value.errno == errno.ENOTDIR


def test_a_fifo_at_the_pool_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    os.mkfifo(path)

    with pytest.raises(PoolPathError, match="not a regular file"):
        MemmapStorage(CONFIG, path=path)


def test_reopening_without_a_pool_file_is_refused_as_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(PoolPathNotFoundError, match="no kvcache pool"):
        MemmapStorage(CONFIG, path=tmp_path / "missing.kv", mode="r+")


@pytest.mark.parametrize(
    ("sidecar_text", "match"),
    [
        ("[" * 100_000 + "]" * 100_000, "more than"),
        ("[" * 30_000 + "]" * 30_000, "not valid JSON"),  # RecursionError inside json
        ('{"num_layers": "\udcff"}', "not valid JSON"),
    ],
    ids=["oversized", "nested", "not-utf8"],
)
def test_a_damaged_sidecar_is_refused_as_invalid_config(tmp_path: Path, sidecar_text: str, match: str) -> None:
    path = tmp_path / "pool.kv"
    closed_filled_pool(path)
    (tmp_path / "pool.kv.json").write_bytes(sidecar_text.encode("utf-8", "surrogateescape"))

    with pytest.raises(InvalidConfigError, match=match):
        MemmapStorage(CONFIG, path=path, mode="r+")


def test_a_nul_in_the_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="NUL"):
        MemmapStorage(CONFIG, path=f"{tmp_path}/pool\0.kv")


def test_follow_symlinks_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(InvalidTypeError, match="follow_symlinks"):
        MemmapStorage(CONFIG, path=tmp_path / "pool.kv", follow_symlinks="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["w+", "r+"])
def test_a_symlink_at_the_pool_path_is_refused_by_default(tmp_path: Path, mode: str) -> None:
    real = tmp_path / "real.kv"
    before = closed_filled_pool(real)
    link = tmp_path / "link.kv"
    link.symlink_to(real)
    (tmp_path / "link.kv.json").write_text((tmp_path / "real.kv.json").read_text())

    with pytest.raises(PoolPathError, match="follow_symlinks=True") as refused:
        MemmapStorage(CONFIG, path=link, mode=mode)  # type: ignore[arg-type]

    assert refused.value.errno == errno.ELOOP
    assert link.is_symlink()
    assert real.read_bytes() == before


def test_a_symlink_at_the_pool_path_is_followed_when_asked(tmp_path: Path) -> None:
    real = tmp_path / "real.kv"
    before = closed_filled_pool(real)
    link = tmp_path / "link.kv"
    link.symlink_to(real)

    reopened = MemmapStorage(CONFIG, path=link, mode="r+", follow_symlinks=True)

    assert reopened.path == real
    assert reopened.pool.tobytes() == before
    reopened.close()
    MemmapStorage(CONFIG, path=link, follow_symlinks=True).close()
    assert link.is_symlink()
    assert real.read_bytes() == bytes(len(before))  # "w+" made the target a new, zeroed pool


def test_a_symlink_at_the_sidecar_path_is_refused_by_default(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    before = closed_filled_pool(path)
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not the pool's")
    sidecar = tmp_path / "pool.kv.json"
    sidecar.unlink()
    sidecar.symlink_to(elsewhere)

    with pytest.raises(PoolPathError, match="follow_symlinks=True"):
        MemmapStorage(CONFIG, path=path)

    assert elsewhere.read_text() == "not the pool's"
    assert path.read_bytes() == before


def test_a_symlink_at_the_sidecar_path_is_followed_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    closed_filled_pool(path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    sidecar = tmp_path / "pool.kv.json"
    sidecar.unlink()
    sidecar.symlink_to(elsewhere)

    MemmapStorage(CONFIG, path=path, follow_symlinks=True).close()

    assert sidecar.is_symlink()
    assert json.loads(elsewhere.read_text())["num_blocks"] == CONFIG.num_blocks


def test_a_symlink_at_the_lock_path_is_refused_by_default(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("precious")
    (tmp_path / "pool.kv.lock").symlink_to(elsewhere)

    with pytest.raises(PoolPathError, match="follow_symlinks=True"):
        MemmapStorage(CONFIG, path=tmp_path / "pool.kv")

    assert elsewhere.read_text() == "precious"
    assert not (tmp_path / "pool.kv").exists()


def test_a_fifo_at_the_lock_path_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pool.kv.lock")

    with pytest.raises(PoolPathError, match=r"the lock file of the pool .* is not a regular file"):
        MemmapStorage(CONFIG, path=tmp_path / "pool.kv")

    assert not (tmp_path / "pool.kv").exists()


def test_reading_a_fifo_as_a_small_file_is_refused_without_waiting(tmp_path: Path) -> None:
    """The sidecar is read after it was checked: one swapped for a FIFO in between must not
    hang the open (no writer ever comes)."""
    fifo = tmp_path / "pool.kv.json"
    os.mkfifo(fifo)

    with pytest.raises(PoolPathError, match="is not a regular file"):
        read_small_file(str(fifo), limit_bytes=64, what="the sidecar of the pool", follow_symlinks=False)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"config": "CacheConfig"}, InvalidTypeError, "config must be a CacheConfig, got str"),
        ({"path": 5}, InvalidTypeError, "path must be a str or os.PathLike, got int"),
        ({"path": b"pool.kv"}, InvalidTypeError, "path must be a str or os.PathLike, got bytes"),
        ({"path": ""}, InvalidArgumentError, "path must name a file, got ''"),
        ({"mode": ["w+"]}, InvalidTypeError, "mode must be 'w\\+' \\(create\\) or 'r\\+' \\(reopen\\), got list"),
        ({"mode": "a"}, InvalidArgumentError, "mode must be 'w\\+' \\(create\\) or 'r\\+' \\(reopen\\), got 'a'"),
    ],
    ids=["config", "int path", "bytes path", "empty path", "list mode", "unknown mode"],
)
def test_a_bad_argument_is_refused_by_type_or_range(
    tmp_path: Path, options: dict[str, object], error: type[KvCacheError], match: str
) -> None:
    arguments: dict[str, object] = {"config": CONFIG, "path": tmp_path / "pool.kv", **options}
    config = arguments.pop("config")

    with pytest.raises(error, match=match):
        MemmapStorage(config, **arguments)  # type: ignore[arg-type]

    assert os.listdir(tmp_path) == []
