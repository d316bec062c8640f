"""The slowest tests run at the size ``KVCACHE_TEST_SIZE`` chooses (``tests.sizes``); an
everyday run keeps its temporary files in memory (``tests.temp_files``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests import sizes, temp_files


@pytest.mark.parametrize(("environ", "expected"), [({}, "everyday"), ({"KVCACHE_TEST_SIZE": ""}, "everyday")])
def test_the_everyday_size_is_the_default(environ: dict[str, str], expected: str) -> None:
    assert sizes.chosen_size(environ) == expected


@pytest.mark.parametrize("size", sizes.SIZES)
def test_each_size_is_chosen_by_name(size: str) -> None:
    assert sizes.chosen_size({"KVCACHE_TEST_SIZE": size}) == size


def test_an_unknown_size_is_refused_naming_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"KVCACHE_TEST_SIZE must be one of everyday, full \(or unset\), got 'huge'"):
        sizes.chosen_size({"KVCACHE_TEST_SIZE": "huge"})


def test_sized_gives_the_full_size_only_in_a_full_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizes, "FULL", True)
    assert sizes.sized(full=300, everyday=100) == 300
    monkeypatch.setattr(sizes, "FULL", False)
    assert sizes.sized(full=300, everyday=100) == 100


def test_an_everyday_run_puts_temporary_files_in_a_private_folder_of_the_memory_root(tmp_path: Path) -> None:
    folder = temp_files.memory_temp_folder({}, full=False, root=tmp_path)
    assert folder == tmp_path / f"kvcache-tests-{os.getuid()}"
    assert folder is not None
    assert folder.is_dir()
    assert folder.stat().st_mode & 0o777 == 0o700
    assert temp_files.memory_temp_folder({}, full=False, root=tmp_path) == folder  # the same folder again


@pytest.mark.parametrize(("environ", "full"), [({}, True), ({"TMPDIR": "/elsewhere"}, False)])
def test_a_full_run_or_a_chosen_tmpdir_keeps_the_systems_temporary_folder(
    tmp_path: Path, environ: dict[str, str], full: bool
) -> None:
    assert temp_files.memory_temp_folder(environ, full=full, root=tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_missing_root_or_a_folder_others_may_write_is_not_used(tmp_path: Path) -> None:
    assert temp_files.private_folder(tmp_path / "missing", os.getuid()) is None
    shared = tmp_path / f"kvcache-tests-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert temp_files.private_folder(tmp_path, os.getuid()) is None
    shared.rmdir()
    (tmp_path / "target").mkdir(mode=0o700)
    shared.symlink_to(tmp_path / "target")
    assert temp_files.private_folder(tmp_path, os.getuid()) is None


def test_a_root_without_the_free_space_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(temp_files, "MIN_FREE_BYTES", 1 << 62)
    assert temp_files.private_folder(tmp_path, os.getuid()) is None


def test_using_the_folder_sets_tmpdir_for_this_process_and_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)  # restored after the test
    environ: dict[str, str] = {}
    folder = temp_files.use_memory_temp_folder(environ, full=False, root=tmp_path)
    assert folder is not None
    assert environ == {"TMPDIR": str(folder)}
    assert tempfile.gettempdir() == str(folder)
    assert temp_files.use_memory_temp_folder({}, full=True, root=tmp_path) is None
    assert tempfile.gettempdir() == str(folder)  # a full run changes nothing
