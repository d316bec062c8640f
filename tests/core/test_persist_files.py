"""Cache files are opened safely: writes never follow a planted link and always leave a
whole file, even from many writers at once; loads read regular files only, never block and
never read more than the file declares."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

from kvcache_core.errors import CacheFileError, CorruptCacheFileError, InvalidArgumentError
from kvcache_core.offload import safe_files
from kvcache_core.offload.file_header import MAX_HEADER_BYTES
from kvcache_core.offload.prefix_file import cached_records, read_blocks
from kvcache_core.offload.tiers import DiskTier, HostTier
from kvcache_core.testing import inspect
from tests.core.cache_files import (
    PROMPT,
    admit,
    bounded,
    config,
    fifo_at,
    pool,
    saved,
    snapshot,
)
from tests.core.support import BLOCK, Manager

VICTIM = b"a file the process may write, which no save may touch\n"


def planted_link(directory: Path) -> tuple[Path, Path]:
    """``(victim, link)``: a file and a symbolic link to it named like a temporary file."""
    victim = directory / "victim.txt"
    victim.write_bytes(VICTIM)
    link = directory / ".prefix.safetensors.planted.tmp"
    link.symlink_to(victim)
    return victim, link


def names_starting_with(monkeypatch: pytest.MonkeyPatch, planted: str, times: int) -> list[str]:
    """Make the next ``times`` temporary names ``planted`` (then fresh ones); return the
    names drawn."""
    drawn: list[str] = []
    fresh = safe_files.temporary_name

    def name(target: str) -> str:
        drawn.append(planted if len(drawn) < times else fresh(target))
        return drawn[-1]

    monkeypatch.setattr(safe_files, "temporary_name", name)
    return drawn


# -- writing ------------------------------------------------------------------------------


def test_a_save_never_follows_a_link_planted_at_its_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim, link = planted_link(tmp_path)
    drawn = names_starting_with(monkeypatch, link.name, times=3)
    manager = pool()
    admit(manager, "r", PROMPT)
    assert manager.save_prefix_cache(tmp_path / "prefix.safetensors") == 4
    assert drawn[:3] == [link.name] * 3  # taken three times, a fresh name then
    assert len(drawn) == 4
    assert victim.read_bytes() == VICTIM
    assert link.is_symlink()
    assert pool().load_prefix_cache(tmp_path / "prefix.safetensors") == 4


def test_a_save_whose_every_temporary_name_is_taken_fails_and_touches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim, link = planted_link(tmp_path)
    names_starting_with(monkeypatch, link.name, times=safe_files.CREATE_ATTEMPTS)
    manager = pool()
    admit(manager, "r", PROMPT)
    with pytest.raises(CacheFileError, match="temporary names") as caught:
        manager.save_prefix_cache(tmp_path / "prefix.safetensors")
    assert caught.value.errno == errno.EEXIST
    assert victim.read_bytes() == VICTIM
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [link.name, "victim.txt"]


def test_temporary_names_are_fresh_and_carry_no_process_id() -> None:
    names = {safe_files.temporary_name("prefix.safetensors") for _ in range(200)}
    assert len(names) == 200
    # 200 different names in one process: none is derived from the process id alone
    assert f".prefix.safetensors.{os.getpid()}.tmp" not in names
    assert all(name.startswith(".prefix.safetensors.") and name.endswith(".tmp") for name in names)


def test_a_temporary_name_fits_in_a_directory_entry_for_any_target_name(tmp_path: Path) -> None:
    path = saved(tmp_path, name="p" * 240 + ".safetensors")  # 252 bytes: near the limit of 255
    assert pool().load_prefix_cache(path) == 4
    assert [entry.name for entry in tmp_path.iterdir()] == [path.name]


def test_a_link_at_the_target_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    target = tmp_path / "prefix.safetensors"
    target.symlink_to(victim)
    manager = pool()
    admit(manager, "r", PROMPT)
    manager.save_prefix_cache(target)
    assert victim.read_bytes() == VICTIM
    assert not target.is_symlink()
    assert pool().load_prefix_cache(target) == 4


def test_a_disk_tier_write_never_follows_a_link_planted_at_its_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim, link = planted_link(tmp_path)
    names_starting_with(monkeypatch, link.name, times=1)
    tier = DiskTier(tmp_path, 1 << 20)
    tier.bind(config())
    source = pool()
    admit(source, "r", PROMPT)
    record = cached_records(source._pool)[0]  # pyright: ignore[reportPrivateUsage]
    assert tier.put(record) == []
    assert victim.read_bytes() == VICTIM
    peeked = tier.peek(record.key)
    assert peeked is not None
    assert peeked.block_hash == record.block_hash


def test_a_save_into_a_directory_or_an_empty_name_is_refused(tmp_path: Path) -> None:
    manager = pool()
    admit(manager, "r", PROMPT)
    with pytest.raises(CacheFileError, match="names a directory"):
        manager.save_prefix_cache(f"{tmp_path}{os.sep}")
    (tmp_path / "prefix.safetensors").mkdir()
    with pytest.raises(CacheFileError, match=r"prefix\.safetensors"):
        manager.save_prefix_cache(tmp_path / "prefix.safetensors")
    assert [entry.name for entry in tmp_path.iterdir()] == ["prefix.safetensors"]  # no temporary left


@pytest.mark.parametrize("path", ["", "prefix\x00.safetensors"])
@pytest.mark.parametrize("operation", ["save_prefix_cache", "load_prefix_cache"])
def test_an_empty_path_or_one_with_a_nul_is_an_invalid_argument_naming_it(path: str, operation: str) -> None:
    manager = pool()
    admit(manager, "r", PROMPT)
    before = snapshot(manager)
    with pytest.raises(InvalidArgumentError, match="path must be a non-empty str without NUL characters") as caught:
        getattr(manager, operation)(path)
    assert repr(path) in str(caught.value)
    assert snapshot(manager) == before


# -- many writers -------------------------------------------------------------------------


def test_threads_saving_to_one_path_always_leave_a_whole_file_for_a_concurrent_loader(tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    managers: list[Manager] = []
    for blocks in (4, 2):
        manager = pool()
        admit(manager, "r", [blocks * 100 + token for token in range(blocks * BLOCK + 1)])
        managers.append(manager)
    managers[0].save_prefix_cache(path)
    start = threading.Barrier(3)
    failures: list[BaseException] = []

    def save_repeatedly(manager: Manager) -> None:
        start.wait()
        try:
            for _ in range(40):
                manager.save_prefix_cache(path)
        except BaseException as exc:
            failures.append(exc)

    savers = [threading.Thread(target=save_repeatedly, args=(manager,)) for manager in managers]
    for saver in savers:
        saver.start()
    start.wait()
    loaded: list[int] = []
    while any(saver.is_alive() for saver in savers) or not loaded:
        loaded.append(pool().load_prefix_cache(path))
    for saver in savers:
        saver.join()
    assert failures == []
    assert set(loaded) <= {4, 2}
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["prefix.safetensors"]


#: A child process: write a file of ``blocks`` blocks ``times`` times (exit 1 on error).
WRITER = """
import sys
from tests.core.cache_files import write_repeatedly
write_repeatedly(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""
ROOT = Path(__file__).resolve().parents[2]


def test_processes_saving_to_one_path_always_leave_a_whole_file_for_a_concurrent_loader(tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    saved(tmp_path)
    # Fresh interpreters, not forks: a fork of a process where JAX or torch runs threads may deadlock.
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(blocks), "40"], cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        for blocks in (4, 2)
    ]
    counts: list[int] = []
    while any(writer.poll() is None for writer in writers) or not counts:
        counts.append(len(read_blocks(path, config())))
    errors = [writer.communicate()[1] for writer in writers]
    assert [writer.returncode for writer in writers] == [0, 0], errors
    assert set(counts) <= {4, 2}
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["prefix.safetensors"]


# -- reading ------------------------------------------------------------------------------


def refused_quickly(manager: Manager, path: Path | str, match: str) -> None:
    before = snapshot(manager)
    raised = bounded(lambda: manager.load_prefix_cache(path))
    assert isinstance(raised, CacheFileError), raised
    assert str(path) in str(raised)
    assert match in str(raised)
    assert snapshot(manager) == before
    manager.check_invariants()


def test_a_fifo_is_refused_without_blocking_and_the_manager_stays_usable(tmp_path: Path) -> None:
    manager = pool()
    admit(manager, "r", PROMPT)
    with fifo_at(tmp_path / "prefix.safetensors") as fifo:
        refused_quickly(manager, fifo, "FIFO")
    assert admit(manager, "again", PROMPT) == 16  # the lock was released


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_is_refused_unread() -> None:
    refused_quickly(pool(), "/dev/zero", "device")


def test_a_directory_is_refused(tmp_path: Path) -> None:
    refused_quickly(pool(), tmp_path, "directory")


def test_a_link_as_the_last_component_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    refused_quickly(pool(), link, "symbolic link")


def test_a_disk_tier_file_replaced_by_a_fifo_is_a_miss_without_blocking(tmp_path: Path) -> None:
    manager = pool(DiskTier(tmp_path, 1 << 20), num_blocks=8)
    admit(manager, "a", PROMPT)
    manager.deallocate("a")
    manager.gc()  # the four cached blocks go to the disk tier
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 4
    for file in files:
        file.unlink()
    with fifo_at(files[0]), fifo_at(files[1]), fifo_at(files[2]), fifo_at(files[3]):
        with pytest.warns(RuntimeWarning, match="FIFO"):
            raised = bounded(lambda: admit(manager, "again", PROMPT))
        assert raised is None
    manager.check_invariants()


def test_a_disk_tier_file_of_another_size_than_written_is_refused_unread(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.bind(config())
    source = pool()
    admit(source, "r", PROMPT)
    record = cached_records(source._pool)[0]  # pyright: ignore[reportPrivateUsage]
    tier.put(record)
    with tier.path_of(record.key).open("ab") as stream:
        stream.write(b"\x00" * 64)
    with pytest.raises(CorruptCacheFileError, match=r"bytes; \d+ were written"):
        tier.peek(record.key)


def test_a_header_longer_than_the_cap_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "prefix.safetensors"
    with path.open("wb") as stream:
        stream.write((MAX_HEADER_BYTES + 1).to_bytes(8, "little"))
        stream.truncate(MAX_HEADER_BYTES + 16)  # sparse: nothing is read or stored
    manager = pool()
    before = snapshot(manager)
    with pytest.raises(CorruptCacheFileError, match=f"at most {MAX_HEADER_BYTES}"):
        manager.load_prefix_cache(path)
    assert snapshot(manager) == before


def test_tensors_declared_past_the_end_of_the_file_are_refused_unread(tmp_path: Path) -> None:
    path = saved(tmp_path)
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    table = json.loads(data[8 : 8 + length])
    tensor_bytes = 2 * 10**9 * 4 * 2 * 4 * 4  # [layers, 10**9 blocks, block_size, heads, dim] float32
    for name, begin in (("keys", 0), ("values", tensor_bytes)):
        table[name]["shape"] = [2, 10**9, 4, 2, 4]
        table[name]["data_offsets"] = [begin, begin + tensor_bytes]
    encoded = json.dumps(table).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data[8 + length :])
    with pytest.raises(CorruptCacheFileError, match="truncated: its header and tensors take"):
        pool().load_prefix_cache(path)


def test_bytes_past_the_declared_tensors_are_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    with path.open("ab") as stream:
        stream.write(b"\x00" * 8)
    with pytest.raises(CorruptCacheFileError, match="too long"):
        pool().load_prefix_cache(path)


@pytest.mark.parametrize("forget", ["discard", "clear"])
def test_a_disk_tier_file_that_cannot_be_removed_is_forgotten_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forget: str
) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.bind(config())
    source = pool()
    admit(source, "r", PROMPT)
    records = cached_records(inspect.block_pool(source))
    for record in records:
        tier.put(record)
    real_unlink = os.unlink

    def read_only(path: str, *, dir_fd: int | None = None) -> None:
        if str(path).startswith(str(tmp_path)):
            raise PermissionError(errno.EROFS, "Read-only file system", str(path))
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", read_only)
    forgetting: Callable[[], None] = (lambda: tier.discard(records[0].key)) if forget == "discard" else tier.clear
    with pytest.warns(RuntimeWarning, match="Read-only file system"):
        forgetting()
    gone = records[:1] if forget == "discard" else records
    assert all(record.key not in tier for record in gone)
    assert tier.used_bytes == sum(tier.path_of(key).stat().st_size for key in tier.hashes())


def test_a_chain_longer_than_the_recursion_limit_saves_and_loads_from_the_pool_and_a_tier(tmp_path: Path) -> None:
    length = sys.getrecursionlimit() + 50
    source = pool(HostTier(1 << 30), num_blocks=length + 8, block_size=1)
    admit(source, "r", range(length))
    source.deallocate("r")
    source.gc()  # the whole chain goes to the tier, children first
    path = tmp_path / "prefix.safetensors"
    assert source.save_prefix_cache(path) == length
    target = pool(num_blocks=length + 8, block_size=1)
    assert target.load_prefix_cache(path) == length
    assert target.save_prefix_cache(path) == length
