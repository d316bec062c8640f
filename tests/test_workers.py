"""The whole suite runs on one pytest-xdist worker per core; a run of chosen paths, or one
that says how to distribute, runs as asked (the ``tests.workers`` plugin)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import workers

ROOT = Path(__file__).resolve().parents[1]

ON_A_WORKER = """
def test_where(request):
    assert hasattr(request.config, "workerinput") is {expected}
"""


def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *, cpus: int, expected: bool) -> None:
    """A project whose ``testpaths`` hold one test asserting whether it runs on a worker;
    it loads the plugin, which sees ``cpus`` cores; its workers can import ``tests``."""
    pytest.importorskip("xdist")
    monkeypatch.setattr(workers, "usable_cpus", lambda: cpus)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    pytester.makeini("[pytest]\ntestpaths = inner\n")
    pytester.makeconftest('pytest_plugins = ["tests.workers"]')
    pytester.mkdir("inner")
    (pytester.path / "inner" / "test_inner.py").write_text(ON_A_WORKER.format(expected=expected))


def test_the_whole_suite_runs_on_workers(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    project(pytester, monkeypatch, cpus=2, expected=True)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*2 workers*"])


def test_chosen_paths_run_in_one_process(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    project(pytester, monkeypatch, cpus=2, expected=False)
    pytester.runpytest("inner").assert_outcomes(passed=1)


def test_without_xdist_the_whole_suite_runs_in_one_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project(pytester, monkeypatch, cpus=2, expected=False)
    pytester.runpytest("-p", "no:xdist").assert_outcomes(passed=1)


def test_an_explicit_worker_count_is_kept(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    project(pytester, monkeypatch, cpus=2, expected=False)
    pytester.runpytest("-n", "0").assert_outcomes(passed=1)


def test_one_core_runs_the_whole_suite_in_one_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project(pytester, monkeypatch, cpus=1, expected=False)
    pytester.runpytest().assert_outcomes(passed=1)


def test_a_worker_runs_torch_at_its_share_of_the_cores(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    project(pytester, monkeypatch, cpus=2, expected=True)
    (pytester.path / "inner" / "test_threads.py").write_text(
        "import torch\n"
        "from tests.workers import threads_per_worker, usable_cpus\n\n"
        "def test_threads():\n"
        "    assert torch.get_num_threads() == threads_per_worker(usable_cpus(), 2)\n"
    )
    pytester.runpytest().assert_outcomes(passed=2)


@pytest.mark.parametrize(("cpus", "expected"), [(1, 0), (2, 2), (3, 3), (4, 4), (64, workers.MAX_WORKERS)])
def test_one_worker_per_core_up_to_the_cap(cpus: int, expected: int) -> None:
    assert workers.default_workers(cpus) == expected


@pytest.mark.parametrize(("cpus", "count", "expected"), [(2, 2, 1), (1, 2, 1), (8, 4, 2), (9, 4, 2)])
def test_each_worker_gets_its_share_of_the_cores(cpus: int, count: int, expected: int) -> None:
    assert workers.threads_per_worker(cpus, count) == expected


def test_a_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="cpus must be >= 1, got 0"):
        workers.default_workers(0)
    with pytest.raises(ValueError, match="got cpus=2, workers=0"):
        workers.threads_per_worker(2, 0)


@pytest.mark.parametrize(
    ("nodeid", "rank"),
    [
        ("tests/typing/test_static.py::test_the_whole_tree_is_mypy_strict_clean", 0),
        ("tests/typing/test_static.py::test_the_whole_tree_is_pyright_strict_clean", 1),
        ("tests/jax/test_sharding.py::test_the_mesh_cases_pass_on_8_host_devices", 2),
        ("tests/core/test_manager.py::test_anything", len(workers.LONG_FIRST)),
    ],
)
def test_the_tests_that_run_for_minutes_start_first(nodeid: str, rank: int) -> None:
    assert workers.start_rank(nodeid) == rank


def test_a_process_a_worker_starts_gets_the_workers_share_of_the_cores() -> None:
    environ = {"PYTEST_XDIST_WORKER_COUNT": "2", "MKL_NUM_THREADS": "3"}

    assert workers.worker_thread_environment(environ, cpus=4) == {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}


def test_outside_a_worker_a_started_process_keeps_its_threads() -> None:
    assert workers.worker_thread_environment({}, cpus=4) == {}
