"""Shared test configuration: Hypothesis profiles, the size of the slowest tests
(``tests.sizes``), worker processes for the whole suite (the ``tests.workers`` plugin) and
small fixtures."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from kvcache_core.discovery import refresh_backends
from kvcache_core.plugin import ENTRY_POINT_GROUP
from tests.sizes import FULL, SIZE_ENV, chosen_size
from tests.temp_files import use_memory_temp_folder

pytest_plugins = ["pytester", "tests.workers", "tests.redis_support"]

# Temporary files (tmp_path, the memmap backend's temporary pools) in memory at the everyday
# size, before anything makes one; the workers and processes the tests start inherit TMPDIR.
TEMP_FOLDER = use_memory_temp_folder(os.environ, full=FULL)

# Shared CI machines are noisy: no deadlines. "ci" is derandomized so a run is repeatable.
settings.register_profile("default", deadline=None)
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _settle_numba() -> None:
    """Load numba's CPU lowering registries now, once per process.

    numba loads them (and registers their types globally) on its first compile or cache load,
    and its boxing registry (``numba.core.boxing``) on the first wrapper it builds for a call
    from Python. An in-process ``pytester`` run forgets every module imported during it; if
    that first load happened inside one, the next compile imports them again and fails with
    "duplicate registration for <class '...Boolean'>". Which test compiles first depends on
    the order (and on the worker), so the registries are loaded, and one function boxing a
    bool and an array is compiled and called, before any test runs.
    """
    try:
        import numba
        from numba.core.registry import cpu_target
    except ImportError:  # numba is optional: nothing to settle
        return
    context: Any = cpu_target.target_context  # numba's untyped cached property
    context.refresh()

    def first(flag: bool, values: Any) -> float:
        return float(values[0]) if flag else 0.0

    compiled: Any = numba.njit(first)  # pyright: ignore[reportUnknownMemberType]
    compiled(True, np.ones(1))


_settle_numba()

# The attention path: the compiled kernel wherever it runs, as before dispatch existed, so
# that a test's numbers do not depend on which path won a timing on a busy machine; the
# measured choice ("auto", the users' default) has its own tests (tests/*/test_dispatch.py).
# Calibration files never land in the home directory of whoever runs the suite.
os.environ.setdefault("KVCACHE_ATTENTION_PATH", "kernel")
os.environ.setdefault("KVCACHE_CACHE_DIR", "off")


def _settle_ml_dtypes() -> None:
    """Import ``ml_dtypes`` now, once per process (when installed: JAX and float8 pools use it).

    It registers its dtypes with NumPy as it is imported; if that first import happened inside
    an in-process ``pytester`` run, the run forgets the module and the next import registers
    them again and fails with "DType <class 'ml_dtypes.bfloat16'> appears already registered?"
    (every later JAX or float8 case of that worker fails so). Which test imports it first
    depends on the order and on the worker, as with numba above.
    """
    try:
        import ml_dtypes  # noqa: F401  # pyright: ignore[reportUnusedImport]  # imported for its registration
    except ImportError:  # optional: nothing to settle
        return


_settle_ml_dtypes()


def pytest_report_header() -> list[str]:
    """The size the slowest tests run at (``tests/sizes.py``) and where temporary files go
    (``tests/temp_files.py``)."""
    where = "the system's temporary folder" if TEMP_FOLDER is None else f"{TEMP_FOLDER} (in memory)"
    return [
        f"test size: {chosen_size()} ({SIZE_ENV}=full: the slowest tests at full size)",
        f"temporary files: {where}",
    ]


def _add_distribution(root: Path, dist: str, version: str, entry_name: str, module: str, source: str) -> None:
    """A minimal installed distribution: a module and a dist-info with one entry point."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_name} = {module}\n")


@pytest.fixture
def add_distribution() -> Callable[[Path, str, str, str, str, str], None]:
    """``add_distribution(root, dist, version, entry_name, module, source)``: a fake
    installed backend distribution (use with ``plugin_dir``)."""
    return _add_distribution


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on ``sys.path`` for fake distributions; backends are rediscovered
    before and after the test, and its ``kvtest_*`` modules forgotten."""
    monkeypatch.syspath_prepend(str(tmp_path))  # pyright: ignore[reportUnknownMemberType]
    refresh_backends()
    yield tmp_path
    for module in [name for name in sys.modules if name.startswith("kvtest_")]:
        del sys.modules[module]
    refresh_backends()
