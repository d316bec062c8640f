"""The kit itself, run with pytester: it passes a good backend and fails broken ones loudly.

Small faulty backends (each breaks one behaviour of the NumPy storage on purpose) are
installed as fake distributions; a kit that cannot fail them would be worth nothing.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache_core.cli import main

AddDistribution = Callable[[Path, str, str, str, str, str], None]

KIT_FILE = """
import pytest
from kvcache_core.testing import KvCacheConformance

class TestKit(KvCacheConformance):
    pass
"""

FAULTY_PLUGIN = """
import numpy as np
from kvcache_core import BackendSpec, PagedKvCacheManager, hookimpl
from kvcache_core.numpy_backend import NumpyStorage


class LossyStorage(NumpyStorage):
    # Loses the last token of every write.
    def write(self, layer, slots, keys, values):
        super().write(layer, slots[:-1], keys[:-1], values[:-1])


class CopyingStorage(NumpyStorage):
    # Hands out copies of the pool instead of references.
    def key_cache(self, layer):
        return super().key_cache(layer).copy()

    def value_cache(self, layer):
        return super().value_cache(layer).copy()


class NoCopyStorage(NumpyStorage):
    # Claims fork, but its block copies copy nothing.
    def copy_blocks(self, source, destination):
        pass


class LeakyManager(PagedKvCacheManager):
    # Keeps the last block of every request it frees.
    def deallocate(self, request_id):
        handle = self.get_handle(request_id)
        blocks = handle.block_table().physical_blocks if handle is not None else []
        if blocks:
            self.allocator.retain(blocks[-1])
        super().deallocate(request_id)


@hookimpl
def kvcache_register_backends():
    yield BackendSpec(name="lossy", storage_factory=LossyStorage, description="loses writes")
    yield BackendSpec(name="copying", storage_factory=CopyingStorage, description="returns copies")
    yield BackendSpec(name="leaky", storage_factory=NumpyStorage, manager_factory=LeakyManager,
                      description="leaks blocks")
    yield BackendSpec(name="nocopy", storage_factory=NoCopyStorage, capabilities=frozenset({"fork"}),
                      description="claims fork, copies nothing")
    yield BackendSpec(name="offline", storage_factory=NumpyStorage, is_available=lambda: False,
                      unavailable_reason=lambda: "the offline device is unplugged")
"""


@pytest.fixture
def faulty(plugin_dir: Path, add_distribution: AddDistribution) -> Path:
    add_distribution(plugin_dir, "kvtest-faulty", "0.1", "faulty", "kvtest_faulty", FAULTY_PLUGIN)
    return plugin_dir


def run_kit(pytester: pytest.Pytester, *args: str, source: str = KIT_FILE) -> pytest.RunResult:
    pytester.makepyfile(test_kit_run=source)
    return pytester.runpytest("-p", "kvcache_core.testing", "--kvcache-max-examples", "5", "-q", *args)


def test_the_kit_passes_the_numpy_backend(pytester: pytest.Pytester, faulty: Path) -> None:
    result = run_kit(pytester, "--kvcache-backend", "numpy")

    outcomes = result.parseoutcomes()
    assert result.ret == 0, result.stdout.str()
    assert outcomes["passed"] >= 40
    assert "failed" not in outcomes
    # Narrowed to numpy: the faulty backends installed beside it did not run.
    assert "lossy" not in result.stdout.str()


@pytest.mark.parametrize(
    ("backend", "failing_case", "message"),
    [
        ("lossy", "test_write_then_gather_round_trips_every_dtype_and_layout", "differs from what was written"),
        ("copying", "test_key_and_value_cache_are_references_to_the_pool_not_copies", "a copy, not a reference"),
        ("leaky", "test_exhausting_the_pool_fails_atomically_and_frees_everything", "has reference count 1 but 0"),
        ("nocopy", "test_fork_copies_exactly_the_shared_block_that_is_written", "the copy lost the shared tokens"),
    ],
)
def test_a_broken_backend_fails_with_its_name_the_case_and_how_to_reproduce(
    pytester: pytest.Pytester, faulty: Path, backend: str, failing_case: str, message: str
) -> None:
    result = run_kit(pytester, "--kvcache-backend", backend)

    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output
    assert result.parseoutcomes()["failed"] >= 1
    assert f"FAILED test_kit_run.py::TestKit::{failing_case}[{backend}]" in output
    assert message in output
    assert f"kvcache backend '{backend}' failed conformance case {failing_case}[{backend}]" in output
    assert re.search(
        rf"reproduce: pytest \S*{failing_case}\S* -p kvcache_core.testing --kvcache-backend {backend}", output
    )


def test_kit_failures_show_the_compared_values(pytester: pytest.Pytester, faulty: Path) -> None:
    result = run_kit(pytester, "--kvcache-backend", "lossy", "-k", "batched_write")

    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output
    # Assertion rewriting inside the kit: the failed comparison is explained.
    assert "+  where False = <function array_equal" in output, output


def test_the_state_machine_catches_a_lost_write(pytester: pytest.Pytester, faulty: Path) -> None:
    result = run_kit(pytester, "--kvcache-backend", "lossy", "-k", "state_machine")

    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output
    assert "differ from the NumPy reference" in output
    assert "state = ReferenceMachine_lossy" in output  # Hypothesis prints the failing steps


def test_an_unavailable_backend_is_skipped_with_its_reason(pytester: pytest.Pytester, faulty: Path) -> None:
    result = run_kit(pytester, "--kvcache-backend", "offline", "-rs", "-k", "geometry")

    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*unavailable here*the offline device is unplugged*"])


def test_an_unknown_backend_name_fails_listing_the_installed_ones(pytester: pytest.Pytester) -> None:
    result = run_kit(pytester, "--kvcache-backend", "nosuch", "-k", "geometry")

    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*no kvcache backend named 'nosuch'*installed:*numpy*"])


def test_the_pin_marker_and_the_command_line_intersect(pytester: pytest.Pytester, faulty: Path) -> None:
    source = """
import pytest
from kvcache_core.testing import KvCacheConformance

@pytest.mark.kvcache_backends("numpy")
class TestPinned(KvCacheConformance):
    pass
"""
    pinned = run_kit(pytester, "-k", "geometry", "--co", source=source)
    pinned.stdout.fnmatch_lines(["*test_geometry_device_dtype_and_pool_shapes[[]numpy[]]*"])
    assert "lossy" not in pinned.stdout.str()

    elsewhere = run_kit(pytester, "--kvcache-backend", "lossy", "-k", "geometry", "-rs", source=source)
    assert elsewhere.ret == 0
    elsewhere.stdout.fnmatch_lines(["*no kvcache backend selected*selected: lossy*pinned to: numpy*"])


def test_a_required_capability_skips_backends_without_it(pytester: pytest.Pytester) -> None:
    source = """
import pytest

@pytest.mark.kvcache_requires("teleport")
def test_teleport(kvcache_backend):
    raise AssertionError("must not run")

def test_plain(kvcache_backend):
    assert kvcache_backend.name == "numpy"
"""
    result = run_kit(pytester, "--kvcache-backend", "numpy", "-rs", source=source)

    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=1, skipped=1, warnings=result.parseoutcomes().get("warnings", 0))
    result.stdout.fnmatch_lines(["*'numpy' does not claim capability 'teleport'*"])


def test_without_the_fixture_the_plugin_is_inert(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_one():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest("-q", "--co")

    assert result.ret == 0
    result.stdout.fnmatch_lines(["test_plain.py::test_one"])
    assert "kvcache" not in result.stdout.str()


def test_hypothesis_settings_come_from_the_command_line(pytester: pytest.Pytester) -> None:
    bad = run_kit(pytester, "--kvcache-max-examples", "0", "-k", "geometry")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--kvcache-max-examples*expected an integer >= 1, got *0*"])

    good = run_kit(
        pytester, "--kvcache-backend", "numpy", "--kvcache-steps", "3", "--kvcache-deadline", "none", "-k", "state"
    )
    assert good.ret == 0, good.stdout.str()


def test_importing_the_plugin_imports_no_array_library_nor_hypothesis() -> None:
    code = (
        "import sys, kvcache_core.testing, kvcache_core.testing._plugin as p; "
        "leaked = [m for m in ('torch', 'jax', 'hypothesis', 'kvcache_core.testing.suite') if m in sys.modules]; "
        "print(leaked); sys.exit(1 if leaked else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)

    assert result.returncode == 0, result.stdout + result.stderr


def test_the_documented_command_runs_the_kit_on_numpy(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "kvcache_core.testing",
        "--kvcache-backend",
        "numpy",
        "--kvcache-max-examples",
        "3",
        "--pyargs",
        "kvcache_core.testing.test_conformance",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tmp_path)

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"\b\d{2,} passed\b", result.stdout), result.stdout[-2000:]


def test_kvcache_check_prints_a_table_per_backend(faulty: Path) -> None:
    out = io.StringIO()
    status = main(["check", "--backend", "numpy", "--backend", "lossy", "--max-examples", "3"], out=out)

    text = out.getvalue()
    assert status == 1, text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith(("numpy ", "lossy "))}
    passed, failed, _skipped, verdict = rows["numpy"]
    assert (failed, verdict) == ("0", "ok")
    assert int(passed) >= 40
    assert rows["lossy"][1] != "0"
    assert rows["lossy"][3] == "FAIL"
    assert "kvcache backend 'lossy' failed conformance case" in text  # the failures are shown


def test_kvcache_check_of_a_good_backend_exits_zero() -> None:
    out = io.StringIO()
    status = main(["check", "--backend", "numpy", "--steps", "5"], out=out)

    assert status == 0, out.getvalue()
    assert out.getvalue().splitlines()[0].split() == ["backend", "passed", "failed", "skipped", "verdict"]
