"""How the test suite shares out the machine: worker processes (pytest-xdist) and the
threads each of them runs. A pytest plugin that ``tests/conftest.py`` loads.

A support module, not a test file: it holds no tests.

The rules:

- ``python -m pytest`` with no paths (the README's command: the whole suite) runs on one
  worker per core the process may use, at most :data:`MAX_WORKERS`, when pytest-xdist is
  installed and the process may use two cores or more; tests marked
  ``xdist_group(name)`` share a worker (``--dist loadgroup``).
- A run of chosen paths (``pytest tests/core/test_x.py``), an explicit ``-n``/``--dist``,
  ``--pdb``, ``--collect-only`` or ``-p no:xdist`` run as asked: nothing is added.
- On the workers, the tests that run for minutes (type checkers over the whole tree,
  subprocess runs of the kit, the benchmarks' quick runs, the 8-device mesh) are handed out
  first, so that none of them starts last while the other workers have nothing left to do.
- A worker runs torch's intra-op pool at its share of the cores (one thread each when there
  are as many workers as cores), so that the workers do not fight over the cores; a test
  about torch's threads asks for the threads it needs. A process a worker starts (a
  benchmark's quick run) gets the same share through the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping

import pytest

#: The most workers the whole suite starts on its own (memory: each imports torch, JAX and
#: transformers).
MAX_WORKERS = 4

#: The distribution mode: like ``load``, but the tests of one ``xdist_group`` run on one worker.
DIST_MODE = "loadgroup"


def usable_cpus() -> int:
    """The cores this process may run on (its affinity where the platform tells)."""
    affinity: Callable[[int], set[int]] | None = getattr(os, "sched_getaffinity", None)
    count = len(affinity(0)) if affinity is not None else os.cpu_count()
    return max(1, count or 1)


def default_workers(cpus: int) -> int:
    """The workers the whole suite runs on with ``cpus`` cores: one per core, at most
    :data:`MAX_WORKERS`; 0 (one process, no workers) with a single core.

    Raises:
        ValueError: ``cpus`` is below 1.
    """
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1, got {cpus}")
    return 0 if cpus == 1 else min(cpus, MAX_WORKERS)


def threads_per_worker(cpus: int, workers: int) -> int:
    """The intra-op threads each of ``workers`` processes runs on ``cpus`` cores (at least 1).

    Raises:
        ValueError: ``cpus`` or ``workers`` is below 1.
    """
    if cpus < 1 or workers < 1:
        raise ValueError(f"cpus and workers must be >= 1, got cpus={cpus}, workers={workers}")
    return max(1, cpus // workers)


#: The variables that size the thread pools of a process (OpenMP, which torch runs its
#: operators on, and BLAS).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def worker_thread_environment(environ: Mapping[str, str], cpus: int) -> dict[str, str]:
    """What a process a worker starts adds to its environment so that it runs at the worker's
    share of ``cpus`` cores: each variable of :data:`THREAD_VARIABLES` that ``environ`` does not
    set; nothing outside a worker. (OpenMP threads that wait spin: a second team on a core
    another worker uses burns it.)"""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT")  # set by pytest-xdist in a worker
    if workers is None:
        return {}
    threads = str(threads_per_worker(cpus, int(workers)))
    return {name: threads for name in THREAD_VARIABLES if name not in environ}


#: Node-id prefixes of the tests that run for minutes, handed out to the workers first
#: (measured on a 2-core machine: each of these runs for a minute or more). The type checkers
#: share one worker (an ``xdist_group``); mypy over the whole tree runs first there, so that
#: the other mypy runs read the third-party stubs it analysed from its cache.
LONG_FIRST = (
    "tests/typing/test_static.py::test_the_whole_tree_is_mypy_strict_clean",
    "tests/typing/",
    "tests/jax/test_sharding.py",
    "tests/test_benchmarks.py",
    "tests/conformance/test_kit.py",
)


def start_rank(nodeid: str) -> int:
    """Where a test starts on the workers: the index of its :data:`LONG_FIRST` prefix, after
    them all (``len(LONG_FIRST)``) for any other test."""
    return next((rank for rank, prefix in enumerate(LONG_FIRST) if nodeid.startswith(prefix)), len(LONG_FIRST))


def distributes_by_default(
    *, has_xdist: bool, whole_suite: bool, numprocesses: object, dist: str, usepdb: bool, collectonly: bool
) -> bool:
    """Whether a run with these options gets the default workers: pytest-xdist installed, the
    whole suite (no paths given), and nothing chosen about distribution, debugging or
    collecting only."""
    return has_xdist and whole_suite and numprocesses is None and dist == "no" and not usepdb and not collectonly


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Give the whole suite its default workers (see the module's rules). Runs before
    pytest-xdist's own hook, which turns the worker count into processes."""
    if hasattr(config, "workerinput"):  # a worker: the controller has decided
        return
    option = config.option
    if not distributes_by_default(
        has_xdist=config.pluginmanager.hasplugin("xdist"),
        whole_suite=config.args_source is pytest.Config.ArgsSource.TESTPATHS,
        numprocesses=getattr(option, "numprocesses", None),
        dist=str(getattr(option, "dist", "no")),
        usepdb=bool(option.usepdb),
        collectonly=bool(option.collectonly),
    ):
        return
    workers = default_workers(usable_cpus())
    if workers:
        option.numprocesses = workers
        option.dist = DIST_MODE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker, the tests of :data:`LONG_FIRST` come first (the order is the same on
    every worker; pytest-xdist hands the tests out in it). A run in one process keeps the
    order of the files."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: start_rank(item.nodeid))


def pytest_collection_finish(session: pytest.Session) -> None:
    """In a worker, torch's intra-op pool gets the worker's share of the cores."""
    torch = sys.modules.get("torch")
    if not hasattr(session.config, "workerinput") or torch is None:
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set by pytest-xdist in a worker
    torch.set_num_threads(threads_per_worker(usable_cpus(), workers))
