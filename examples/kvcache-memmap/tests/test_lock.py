"""One live pool per path: a second opener is refused and the first keeps its bytes."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvcache_core import CacheConfig, create_manager
from kvcache_core.errors import KvCacheError
from kvcache_memmap import MemmapStorage, PoolLockedError

CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4)
#: A smaller geometry: a truncating open with it would cut the first pool's mapping short.
SMALL = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=2, block_size=4)
SMALL_ARGS = "num_layers=1, num_heads=1, head_dim=4, num_blocks=2, block_size=4"
CONFIG_ARGS = "num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4"
#: Seconds a child process may take before the test fails (a bound, not a wait).
CHILD_TIMEOUT_S = 120


def filled_pool(path: Path) -> MemmapStorage:
    """A pool at ``path`` whose every element is distinct, flushed to the file."""
    storage = MemmapStorage(CONFIG, path=path)
    storage.pool[...] = np.arange(storage.pool.size, dtype=np.float32).reshape(storage.pool.shape)
    storage.flush()
    return storage


def expected_pool(storage: MemmapStorage) -> np.ndarray:
    return np.arange(storage.pool.size, dtype=np.float32).reshape(storage.pool.shape)


@pytest.mark.parametrize(("config", "mode"), [(SMALL, "w+"), (CONFIG, "w+"), (CONFIG, "r+")])
def test_a_second_opener_in_this_process_is_refused_and_the_pool_keeps_its_bytes(
    tmp_path: Path, config: CacheConfig, mode: str
) -> None:
    path = tmp_path / "pool.kv"
    first = filled_pool(path)
    before = path.read_bytes()

    with pytest.raises(PoolLockedError, match="this process") as refused:
        MemmapStorage(config, path=path, mode=mode)  # type: ignore[arg-type]

    assert str(path) in str(refused.value)
    assert refused.value.holder_pid == os.getpid()
    assert isinstance(refused.value, KvCacheError)
    assert isinstance(refused.value, BlockingIOError)
    assert path.read_bytes() == before
    assert np.array_equal(first.pool, expected_pool(first))


def test_a_second_opener_in_another_process_is_refused_and_the_pool_keeps_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    first = filled_pool(path)
    before = path.read_bytes()
    opener = textwrap.dedent(
        f"""
        import sys
        from kvcache_core import CacheConfig
        from kvcache_memmap import MemmapStorage, PoolLockedError
        try:
            MemmapStorage(CacheConfig({SMALL_ARGS}), path=sys.argv[1])
        except PoolLockedError as exc:
            print(exc.holder_pid)
        else:
            sys.exit("the second opener was let in")
        """
    )

    result = subprocess.run(
        [sys.executable, "-c", opener, str(path)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(os.getpid())
    assert path.read_bytes() == before
    assert np.array_equal(first.pool, expected_pool(first))


def test_a_pool_in_another_process_survives_a_smaller_second_opener(tmp_path: Path) -> None:
    """The issue's case: the first process read its whole mapping after the second open
    (a truncated file would kill it with SIGBUS, return code -7)."""
    path = tmp_path / "pool.kv"
    holder = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from kvcache_core import CacheConfig
        from kvcache_memmap import MemmapStorage
        storage = MemmapStorage(CacheConfig({CONFIG_ARGS}), path=sys.argv[1])
        expected = np.arange(storage.pool.size, dtype=np.float32).reshape(storage.pool.shape)
        storage.pool[...] = expected
        storage.flush()
        print("ready", flush=True)
        sys.stdin.readline()
        print("intact" if np.array_equal(storage.pool, expected) else "changed", flush=True)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", holder, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready"
            before = path.read_bytes()

            with pytest.raises(PoolLockedError, match=f"process {process.pid}") as refused:
                MemmapStorage(SMALL, path=path)

            assert refused.value.holder_pid == process.pid
            output, errors = process.communicate("go\n", timeout=CHILD_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, errors
    assert output.strip() == "intact"
    assert path.read_bytes() == before


def test_close_releases_the_path_and_removes_the_lock_file(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    first = filled_pool(path)
    assert (tmp_path / "pool.kv.lock").read_text().strip() == str(os.getpid())

    first.close()
    first.close()  # idempotent

    assert first.closed
    assert sorted(os.listdir(tmp_path)) == ["pool.kv", "pool.kv.json"]
    again = MemmapStorage(CONFIG, path=path, mode="r+")
    assert np.array_equal(again.pool, expected_pool(again))


def test_a_dropped_manager_releases_the_path(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    manager = create_manager("memmap", CONFIG, path=path)
    with pytest.raises(PoolLockedError):
        MemmapStorage(CONFIG, path=path, mode="r+")

    del manager
    gc.collect()

    MemmapStorage(CONFIG, path=path, mode="r+").close()


def test_a_lock_file_left_by_a_dead_process_does_not_block(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    (tmp_path / "pool.kv.lock").write_text("999999999\n")  # flock locks die with their process

    storage = MemmapStorage(CONFIG, path=path)

    assert (tmp_path / "pool.kv.lock").read_text().strip() == str(os.getpid())
    storage.close()


def test_a_temporary_pool_is_removed_on_close() -> None:
    storage = MemmapStorage(CONFIG)
    pool = storage.path
    files = [pool, pool.with_name(pool.name + ".json"), pool.with_name(pool.name + ".lock")]
    assert all(file.exists() for file in files)

    storage.close()

    assert not any(file.exists() for file in files)
    assert not pool.parent.exists()


def test_a_temporary_pool_lives_alone_in_a_private_directory() -> None:
    storage = MemmapStorage(CONFIG)
    directory = storage.path.parent

    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(os.listdir(directory)) == ["pool.kv", "pool.kv.json", "pool.kv.lock"]
    storage.close()


def alias_of(path: Path, alias: Path) -> None:
    """Hard-link the pool at ``path`` and its sidecar under the name ``alias``."""
    os.link(path, alias)
    os.link(path.with_name(path.name + ".json"), alias.with_name(alias.name + ".json"))


@pytest.mark.parametrize("mode", ["r+", "w+"])
def test_a_second_opener_through_a_hard_link_is_refused_and_the_pool_keeps_its_bytes(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "pool.kv"
    first = filled_pool(path)
    alias_of(path, tmp_path / "alias.kv")
    before = path.read_bytes()

    with pytest.raises(PoolLockedError, match="through another name") as refused:
        MemmapStorage(CONFIG, path=tmp_path / "alias.kv", mode=mode)  # type: ignore[arg-type]

    assert str(tmp_path / "alias.kv") in str(refused.value)
    assert refused.value.holder_pid is None
    assert path.read_bytes() == before
    assert np.array_equal(first.pool, expected_pool(first))
    assert sorted(os.listdir(tmp_path)) == ["alias.kv", "alias.kv.json", "pool.kv", "pool.kv.json", "pool.kv.lock"]


def test_the_first_opener_through_a_hard_link_holds_the_file_for_every_name(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    filled_pool(path).close()
    alias_of(path, tmp_path / "alias.kv")
    first = MemmapStorage(CONFIG, path=tmp_path / "alias.kv", mode="r+")

    with pytest.raises(PoolLockedError, match="through another name"):
        MemmapStorage(CONFIG, path=path, mode="r+")

    first.close()
    MemmapStorage(CONFIG, path=path, mode="r+").close()


def test_a_hard_link_opener_in_another_process_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    first = filled_pool(path)
    alias_of(path, tmp_path / "alias.kv")
    before = path.read_bytes()
    opener = textwrap.dedent(
        f"""
        import sys
        from kvcache_core import CacheConfig
        from kvcache_memmap import MemmapStorage, PoolLockedError
        try:
            MemmapStorage(CacheConfig({CONFIG_ARGS}), path=sys.argv[1], mode="r+")
        except PoolLockedError as exc:
            print("refused")
        else:
            sys.exit("the second opener was let in")
        """
    )

    result = subprocess.run(
        [sys.executable, "-c", opener, str(tmp_path / "alias.kv")],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused"
    assert path.read_bytes() == before
    assert np.array_equal(first.pool, expected_pool(first))


def test_a_symlinked_directory_reaches_the_same_lock(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    first = filled_pool(tmp_path / "real" / "pool.kv")

    with pytest.raises(PoolLockedError):
        MemmapStorage(CONFIG, path=tmp_path / "link" / "pool.kv", mode="r+")

    assert np.array_equal(first.pool, expected_pool(first))


def test_arrays_kept_after_close_do_not_hold_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pool.kv"
    first = filled_pool(path)
    kept = first.pool  # its mapping keeps a descriptor of the file open
    alias_of(path, tmp_path / "alias.kv")
    first.close()

    again = MemmapStorage(CONFIG, path=tmp_path / "alias.kv", mode="r+")

    assert np.array_equal(again.pool, expected_pool(again))
    assert np.array_equal(kept, expected_pool(again))
    again.close()
