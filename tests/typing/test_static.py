"""Static typing: Protocol conformance of the NumPy backend, and the whole tree strict-clean.

These run the real type checkers (mypy and pyright, strict) as the CI gate for typing.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache_core import KvCacheHandle, KvCacheManager, KvStorage, PagedKvCacheHandle, PagedKvCacheManager

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).parent / "cases"

# One worker runs them all: its mypy runs share one cache (the third-party stubs analysed
# once), and pyright reads the case files in one run (see ``tests/workers.py``).
pytestmark = pytest.mark.xdist_group("type_checkers")


#: mypy's cache: the tree's own ``.mypy_cache`` (git ignores it), as a plain ``mypy`` run over
#: the tree uses. The third-party stubs (NumPy, torch, ...) are analysed once, and a run checks
#: again only the modules that changed since the last run over this tree, with the same
#: result as a run from scratch: mypy keys every entry by the file's contents, its own
#: version and the options. A fresh clone (CI) starts empty.
MYPY_CACHE = ROOT / ".mypy_cache"

#: The cache is kept as files, each written atomically (``--no-sqlite-cache``), not in mypy's
#: SQLite database: a run in this process opens the database while an earlier run's
#: connection may not yet be closed (mypy closes it only when the build returns a result), and
#: SQLite then refuses the new one ("database is locked"), failing a test on nothing it checks.
MYPY_OPTIONS = ("--strict", "--no-sqlite-cache", "--cache-dir", str(MYPY_CACHE))


def run_mypy(*paths: Path) -> tuple[int, str]:
    from mypy import api

    stdout, stderr, status = api.run([*MYPY_OPTIONS, "--config-file", str(ROOT / "pyproject.toml"), *map(str, paths)])
    return status, stdout + stderr


def run_pyright(*paths: Path, project: Path = ROOT, severity: str = "error") -> tuple[int, list[dict[str, object]]]:
    """pyright's exit status and its diagnostics of ``severity`` for ``paths`` in ``project``;
    files of the cases project are read from one run over all of them (:func:`pyright_cases`)."""
    if project == CASES and paths and all(path.parent == CASES for path in paths):
        status, diagnostics = pyright_cases()
        wanted = {str(path.resolve()) for path in paths}
        return status, [d for d in diagnostics if d["file"] in wanted and d["severity"] == severity]
    return _run_pyright(*paths, project=project, severity=severity)


@functools.cache
def pyright_cases() -> tuple[int, list[dict[str, object]]]:
    """One pyright run over every case file (this process starts pyright, which reads the
    stubs of NumPy, torch and JAX, once for them all): each file's diagnostics are its own,
    as no case imports another."""
    status, diagnostics = _run_pyright(*sorted(CASES.glob("*.py")), project=CASES, severity=None)
    return status, [{**d, "file": str(Path(str(d["file"])).resolve())} for d in diagnostics]


def _run_pyright(*paths: Path, project: Path, severity: str | None) -> tuple[int, list[dict[str, object]]]:
    """Run pyright; ``severity=None`` keeps every diagnostic."""
    executable = shutil.which("pyright", path=str(Path(sys.executable).parent)) or shutil.which("pyright")
    if executable is None:
        pytest.fail("pyright is not installed: pip install -r requirements-test.txt")
    result = subprocess.run(
        [executable, "--outputjson", "--pythonpath", sys.executable, "--project", str(project), *map(str, paths)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    report = json.loads(result.stdout)
    diagnostics: list[dict[str, object]] = [
        d for d in report["generalDiagnostics"] if severity is None or d["severity"] == severity
    ]
    return result.returncode, diagnostics


def test_the_handle_and_manager_satisfy_the_protocols_without_inheriting() -> None:
    for concrete, protocol in ((PagedKvCacheHandle, KvCacheHandle), (PagedKvCacheManager, KvCacheManager)):
        assert protocol not in concrete.__mro__
    assert KvStorage is not None


def test_mypy_accepts_the_numpy_backend_as_the_protocols() -> None:
    status, output = run_mypy(CASES / "handle_conforms.py")
    assert status == 0, output


def test_mypy_rejects_a_handle_missing_a_member() -> None:
    status, output = run_mypy(CASES / "handle_missing_member.py")
    assert status == 1
    assert "cache_id" in output, output


def test_pyright_accepts_the_numpy_backend_as_the_protocols() -> None:
    _, errors = run_pyright(CASES / "handle_conforms.py", project=CASES)
    assert errors == [], errors


def test_pyright_rejects_a_handle_missing_a_member() -> None:
    _, errors = run_pyright(CASES / "handle_missing_member.py", project=CASES)
    assert any("cache_id" in str(error["message"]) for error in errors), errors


def test_mypy_and_pyright_accept_every_backend_storage_as_kv_storage() -> None:
    status, output = run_mypy(CASES / "storage_conforms.py")
    assert status == 0, output
    _, errors = run_pyright(CASES / "storage_conforms.py", project=CASES)
    assert errors == [], errors


def test_mypy_and_pyright_reject_a_storage_missing_a_member() -> None:
    status, output = run_mypy(CASES / "storage_missing_member.py")
    assert status == 1
    assert "copy_blocks" in output, output
    _, errors = run_pyright(CASES / "storage_missing_member.py", project=CASES)
    assert any("copy_blocks" in str(error["message"]) for error in errors), errors


def marked_line(case: Path, marker: str) -> int:
    """The 1-based number of the line of ``case`` that contains ``marker``."""
    lines = case.read_text().splitlines()
    return next(number for number, line in enumerate(lines, start=1) if marker in line)


def pyright_line(diagnostic: dict[str, object]) -> int:
    where = diagnostic["range"]
    assert isinstance(where, dict)
    start: object = where["start"]  # pyright: ignore[reportUnknownVariableType]
    assert isinstance(start, dict)
    line: object = start["line"]  # pyright: ignore[reportUnknownVariableType]
    assert isinstance(line, int)
    return line + 1


@pytest.mark.parametrize(
    ("case", "member"),
    [
        pytest.param("registration_wrong_return.py", "gather", id="gather-returns-a-list"),
        pytest.param("registration_wrong_signature.py", "write", id="write-lacks-values"),
    ],
)
def test_registering_a_nonconforming_storage_fails_at_the_registration_line(case: str, member: str) -> None:
    path = CASES / case
    line = marked_line(path, f"# error: {member}")

    status, output = run_mypy(path)
    assert status == 1, output
    errors = [text for text in output.splitlines() if ": error:" in text]
    assert len(errors) == 1, output
    assert f"{case}:{line}: error: " in errors[0], output
    assert '"storage_factory" to "BackendSpec"' in errors[0], output
    assert "KvStorage" in errors[0], output

    _, diagnostics = run_pyright(path, project=CASES)
    assert [pyright_line(d) for d in diagnostics] == [line], diagnostics
    assert f'"{member}" is an incompatible type' in str(diagnostics[0]["message"]), diagnostics


def test_create_manager_carries_each_builtin_backends_array_type() -> None:
    path = CASES / "create_manager_types.py"
    expected = {
        marked_line(path, "# torch: "): ("torch._tensor.Tensor | None", "Tensor | None"),
        marked_line(path, "# jax: "): ("jax._src.basearray.Array | None", "Array | None"),
        marked_line(path, "# numpy: "): ("numpy.ndarray[tuple[Any, ...], numpy.dtype[Any]] | None", None),
    }

    status, output = run_mypy(path)
    assert status == 0, output  # the assert_type lines hold too
    for line, (mypy_type, _) in expected.items():
        assert f'{path.name}:{line}: note: Revealed type is "{mypy_type}"' in output, output

    _, errors = run_pyright(path, project=CASES)
    assert errors == [], errors
    _, revealed = run_pyright(path, project=CASES, severity="information")
    types = {pyright_line(d): str(d["message"]) for d in revealed}
    for line, (_, pyright_type) in expected.items():
        if pyright_type is not None:
            assert types.get(line, "").endswith(f'is "{pyright_type}"'), types


def test_runtime_isinstance_follows_the_members() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("handle_missing_member", CASES / "handle_missing_member.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not isinstance(module.handle, KvCacheHandle)


def test_the_whole_tree_is_mypy_strict_clean() -> None:
    status, output = run_mypy()
    assert status == 0, output


def test_the_whole_tree_is_pyright_strict_clean() -> None:
    _, errors = run_pyright()
    assert errors == [], json.dumps(errors, indent=1)[:5000]


def test_ruff_finds_nothing() -> None:
    executable = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if executable is None:
        pytest.fail("ruff is not installed: pip install -r requirements-test.txt")
    result = subprocess.run([executable, "check", str(ROOT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
