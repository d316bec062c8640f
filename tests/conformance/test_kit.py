"""The kit itself, run with pytester: it passes a good backend and fails broken ones loudly.

Small faulty backends (each breaks one behaviour of the NumPy storage on purpose) are
installed as fake distributions; a kit that cannot fail them would be worth nothing.
"""

from __future__ import annotations

import inspect
import io
import os
import re
import shlex
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
from kvcache_core import PagedKvCacheManager
from kvcache_core.plugin import BackendSpec, hookimpl
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.testing.inspect import allocator


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


class ScalelessCopyStorage(NumpyStorage):
    # Claims int8 and fork, but its block copies leave a quantized block's scales behind.
    def copy_blocks(self, source, destination):
        kept = None if self.scales is None else self.scales.copy()
        super().copy_blocks(source, destination)
        if kept is not None:
            self.scales[...] = kept


class ListGatherStorage(NumpyStorage):
    # Returns a list from gather: it unpacks like the tuple the contract says.
    def gather(self, layer, blocks, num_tokens):
        return list(super().gather(layer, blocks, num_tokens))


HOARD = []


class HoardingStorage(NumpyStorage):
    # Keeps every pool it ever made, closed or not.
    def __init__(self, config):
        super().__init__(config)
        HOARD.append(self)

    def close(self):
        pass


class LeakyManager(PagedKvCacheManager):
    # Keeps the last block of every request it frees.
    def deallocate(self, request_id):
        handle = self.get_handle(request_id)
        blocks = handle.block_table().physical_blocks if handle is not None else []
        if blocks:
            allocator(self).retain(blocks[-1])
        super().deallocate(request_id)


@hookimpl
def kvcache_register_backends():
    yield BackendSpec(name="lossy", storage_factory=LossyStorage, description="loses writes")
    yield BackendSpec(name="copying", storage_factory=CopyingStorage, description="returns copies")
    yield BackendSpec(name="leaky", storage_factory=NumpyStorage, manager_factory=LeakyManager,
                      description="leaks blocks")
    yield BackendSpec(name="nocopy", storage_factory=NoCopyStorage, capabilities=frozenset({"fork"}),
                      description="claims fork, copies nothing")
    yield BackendSpec(name="scaleless", storage_factory=ScalelessCopyStorage, dtypes=("float32", "int8"),
                      capabilities=frozenset({"fork"}), description="copies blocks without their scales")
    yield BackendSpec(name="listy", storage_factory=ListGatherStorage, description="gather returns a list")
    yield BackendSpec(name="hoarding", storage_factory=HoardingStorage, description="keeps closed pools")
    yield BackendSpec(name="bare", storage_factory=NumpyStorage, description="claims no policy")
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


def failing_kit_output(pytester: pytest.Pytester, *args: str) -> str:
    """What :func:`run_kit` prints for a run that must fail (asserted)."""
    result = run_kit(pytester, *args)
    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output
    return output


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
        (
            "scaleless",
            "test_quantized_blocks_round_trip_bit_exact_through_copy_fork_swap_and_prefix_hits",
            "raw bytes or scales differ",
        ),
    ],
)
def test_a_broken_backend_fails_with_its_name_the_case_and_how_to_reproduce(
    pytester: pytest.Pytester, faulty: Path, backend: str, failing_case: str, message: str
) -> None:
    # The case written to catch the bug, alone: what a failure prints is the point here (the
    # whole kit runs against a broken backend in the tests of ``kvcache check``).
    result = run_kit(pytester, "--kvcache-backend", backend, "-k", failing_case)

    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output
    assert result.parseoutcomes()["failed"] >= 1
    assert f"FAILED test_kit_run.py::TestKit::{failing_case}[{backend}]" in output
    assert message in output
    assert f"kvcache backend '{backend}' failed conformance case {failing_case}[{backend}]" in output
    assert re.search(
        rf"reproduce: pytest \S*{failing_case}\S* -p kvcache_core.testing --kvcache-backend {backend}", output
    )


OLD_SIGNATURE_PLUGIN = """
from kvcache_core import BackendSpec, hookimpl
from kvcache_core.backends.numpy import NumpyStorage


class OldSignatureStorage(NumpyStorage):
    # Written before the attention features: paged_attention takes none of their keywords.
    attention_features = frozenset()

    def paged_attention(self, layer, query, page_table, qo_indptr, scale, causal):
        return super().paged_attention(layer, query, page_table, qo_indptr, scale, causal)


@hookimpl
def kvcache_register_backends():
    yield BackendSpec(name="oldsig", storage_factory=OldSignatureStorage, description="paged_attention of 0.1")
"""


def test_the_kit_passes_a_storage_whose_paged_attention_predates_the_attention_features(
    pytester: pytest.Pytester, plugin_dir: Path, add_distribution: AddDistribution
) -> None:
    add_distribution(plugin_dir, "kvtest-oldsig", "0.1", "oldsig", "kvtest_oldsig", OLD_SIGNATURE_PLUGIN)
    result = run_kit(pytester, "--kvcache-backend", "oldsig", "-k", "signature or attention or step")

    outcomes = result.parseoutcomes()
    assert result.ret == 0, result.stdout.str()
    assert outcomes["passed"] >= 5
    assert "failed" not in outcomes


def test_kit_failures_show_the_compared_values(pytester: pytest.Pytester, faulty: Path) -> None:
    output = failing_kit_output(pytester, "--kvcache-backend", "lossy", "-k", "batched_write")
    # Assertion rewriting inside the kit: the failed comparison is explained.
    assert "+  where False = <function array_equal" in output, output


def test_the_state_machine_catches_a_lost_write(pytester: pytest.Pytester, faulty: Path) -> None:
    output = failing_kit_output(pytester, "--kvcache-backend", "lossy", "-k", "state_machine")
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


def test_a_storage_returning_a_list_from_gather_fails_on_one_line_naming_it(
    pytester: pytest.Pytester, faulty: Path
) -> None:
    output = failing_kit_output(pytester, "--kvcache-backend", "listy", "-k", "returns")
    lines = output.splitlines()
    header = next(
        i for i, line in enumerate(lines) if "test_every_storage_method_returns" in line and "_ TestKit" in line
    )
    assert lines[header + 1] == (
        "KvStorage.gather returned list of 2, expected a tuple (keys, values) (dtype float32, layout NHD)"
    ), output


def test_a_storage_kept_alive_after_close_fails_the_kit(pytester: pytest.Pytester, faulty: Path) -> None:
    result = run_kit(pytester, "--kvcache-backend", "hoarding", "-k", "close_releases or not_kept_alive")

    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output
    result.assert_outcomes(passed=1, failed=1)
    assert "the storage outlives its closed manager" in output


def test_a_backend_without_close_passes_the_lifecycle_tests(pytester: pytest.Pytester, faulty: Path) -> None:
    result = run_kit(pytester, "--kvcache-backend", "bare", "-k", "close_releases or not_kept_alive")

    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=2)


def test_the_verdict_of_a_backend_claiming_no_policy_says_so(faulty: Path) -> None:
    out = io.StringIO()
    status = main(["check", "--backend", "bare", "--max-examples", "2", "--steps", "3"], out=out)

    text = out.getvalue()
    assert status == 0, text
    row = next(line for line in text.splitlines() if line.startswith("bare "))
    assert row.split(maxsplit=4)[4] == "ok (not claimed: eviction, fork, prefix_caching, sliding_window, swap)", text
    from kvcache_core.testing.suite import KvCacheConformance

    gated = [
        name
        for name, member in inspect.getmembers(KvCacheConformance, inspect.isfunction)  # inherited cases too
        if name.startswith("test_")
        and any(mark.name == "kvcache_requires" for mark in getattr(member, "pytestmark", []))
    ]
    found = re.search(
        r"bare: does not claim eviction, fork, prefix_caching, sliding_window, swap; (\d+) tests skipped: (.*)", text
    )
    assert found is not None, text
    skipped = [name.strip() for name in found.group(2).split(",")]
    assert int(found.group(1)) == len(skipped) >= len(gated) >= 7
    assert set(gated) <= {name.split("[")[0] for name in skipped}, text  # a parametrized case: each of its ids
    assert "test_fork_copies_exactly_the_shared_block_that_is_written" in text


def test_require_all_fails_the_tests_of_unclaimed_policies(pytester: pytest.Pytester, faulty: Path) -> None:
    output = failing_kit_output(pytester, "--kvcache-backend", "bare", "--kvcache-require-all", "-k", "fork or swap")
    assert "kvcache backend 'bare' does not claim capability 'fork' (--kvcache-require-all)" in output
    assert "bare: FAIL" in output


def test_a_pytest_run_lists_the_unclaimed_policies_and_the_seed(pytester: pytest.Pytester, faulty: Path) -> None:
    result = run_kit(pytester, "--kvcache-backend", "bare", "-k", "fork_copies or geometry_device")

    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*= kvcache conformance =*",
            "seed 0 (--kvcache-seed)*",
            "bare: ok (not claimed: eviction, fork, prefix_caching, sliding_window, swap)",
            "  1 tests skipped as not claimed: test_fork_copies_exactly_the_shared_block_that_is_written[[]bare[]]",
        ]
    )


def test_the_summary_is_printed_under_pytest_xdist(
    pytester: pytest.Pytester, add_distribution: AddDistribution
) -> None:
    pytest.importorskip("xdist")
    # The worker's sys.path is the one this process started with, and the run's directory: the
    # faulty distribution goes there.
    add_distribution(pytester.path, "kvtest-faulty", "0.1", "faulty", "kvtest_faulty", FAULTY_PLUGIN)
    result = run_kit(
        pytester, "-p", "xdist", "-n", "1", "--kvcache-backend", "bare", "-k", "fork_copies or geometry_device"
    )

    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*= kvcache conformance =*",
            "seed 0 (--kvcache-seed)*",
            "bare: ok (not claimed: eviction, fork, prefix_caching, sliding_window, swap)",
            "  1 tests skipped as not claimed: test_fork_copies_exactly_the_shared_block_that_is_written[[]bare[]]",
        ]
    )


def _failure_story(output: str) -> list[str]:
    """The FAILED lines and Hypothesis's steps, without memory addresses."""
    # Several distinct failures come as an exception group, each line behind "| ".
    stripped = [line.removeprefix("E").strip().removeprefix("|").strip() for line in output.splitlines()]
    kept = [line for line in stripped if line.startswith(("FAILED", "state.", "state = "))]
    return [re.sub(r"0x[0-9a-f]+", "0x?", line) for line in kept]


def test_the_same_bug_gives_the_same_failures_every_run(pytester: pytest.Pytester, faulty: Path) -> None:
    args = ("--kvcache-backend", "lossy", "-k", "state_machine or batched", "-p", "no:randomly")
    first = run_kit(pytester, *args)
    second = run_kit(pytester, *args)

    assert first.ret == pytest.ExitCode.TESTS_FAILED, first.stdout.str()
    story = _failure_story(first.stdout.str())
    assert any(line.startswith("state.") for line in story), first.stdout.str()
    assert _failure_story(second.stdout.str()) == story
    assert first.parseoutcomes()["failed"] == second.parseoutcomes()["failed"]


def test_failure_explanations_truncate_arrays(pytester: pytest.Pytester, faulty: Path) -> None:
    # -vv lifts pytest's own length limit on reprs: the arrays' print options still cut them.
    output = failing_kit_output(pytester, "--kvcache-backend", "lossy", "-k", "references_to_the_pool", "-vv")
    explanation = [line for line in output.splitlines() if line.startswith("E ")]
    assert explanation[0].split(maxsplit=1)[1] == (
        "AssertionError: dtype float32, layout NHD: a write is not visible through key_cache taken "
        "before it (a copy, not a reference)"
    ), output
    assert "shape=(24, 4, 2, 8)" in output  # the whole pool appears, as its edges (1536 values in full)
    assert sum(len(line) for line in explanation) < 8000, output


def _run_pasted(line: str, cwd: Path, plugin_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run a printed rerun line as a user pastes it into a shell (pytest on PATH)."""
    environment = dict(os.environ)
    environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environment.get("PATH", "")])
    environment["PYTHONPATH"] = str(plugin_dir)
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=False, cwd=cwd, env=environment)


def test_the_rerun_line_of_kvcache_check_reproduces_the_failure_when_pasted(faulty: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    status = main(["check", "--backend", "lossy", "--max-examples", "2", "--steps", "3"], out=out)

    text = out.getvalue()
    assert status == 1, text
    assert "PytestAssertRewriteWarning" not in text
    assert "kvcache-check-" not in text  # no FAILED line points at the deleted temporary directory
    reruns = [line.removeprefix("reproduce: ") for line in text.splitlines() if line.startswith("reproduce: ")]
    assert reruns, text
    case = re.search(r"::TestKvCacheConformance::(\w+\[lossy\])", reruns[0])
    assert case is not None, reruns[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    rerun = _run_pasted(reruns[0], elsewhere, faulty)

    assert rerun.returncode == 1, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "1 failed" in rerun.stdout, rerun.stdout[-3000:]
    assert f"failed conformance case {case.group(1)}" in rerun.stdout
    assert shlex.split(reruns[0])[0] == "pytest"


def test_the_rerun_line_of_a_backends_own_test_file_reproduces_when_pasted(
    pytester: pytest.Pytester, faulty: Path
) -> None:
    output = failing_kit_output(pytester, "--kvcache-backend", "lossy", "-k", "round_trips")
    line = next(line for line in output.splitlines() if line.startswith("reproduce: ")).removeprefix("reproduce: ")
    assert shlex.split(line)[1].startswith("test_kit_run.py::TestKit::test_write_then_gather_round_trips"), line

    rerun = _run_pasted(line, pytester.path, faulty)

    assert rerun.returncode == 1, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "1 failed" in rerun.stdout, rerun.stdout[-3000:]
    assert "differs from what was written" in rerun.stdout


def test_the_kit_docstring_names_modules_that_exist() -> None:
    import importlib

    import kvcache_core.testing

    named = re.findall(r"--pyargs ([\w.]+)", kvcache_core.testing.__doc__ or "")
    assert named, kvcache_core.testing.__doc__
    for module in named:
        importlib.import_module(module)
