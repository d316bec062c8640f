"""``kvcache check``: the conformance kit from the command line, one table row per backend."""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import pytest

from kvcache_core.cli import write_table

__all__ = ["CheckResult", "run_check"]

_OUTCOMES = ("passed", "failed", "skipped")


@dataclass
class CheckResult:
    """Per-backend counts of the kit's outcomes, and pytest's exit code."""

    counts: dict[str, Counter[str]] = field(default_factory=dict[str, Counter[str]])
    exit_code: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not any(counts["failed"] for counts in self.counts.values())


class _Collector:
    """A pytest plugin counting each kit test's outcome under its backend."""

    def __init__(self, result: CheckResult) -> None:
        self.result = result
        self.backend_of: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            callspec = getattr(item, "callspec", None)
            backend = callspec.params.get("kvcache_backend") if callspec is not None else None
            self.backend_of[item.nodeid] = backend if isinstance(backend, str) else "(none selected)"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        backend = self.backend_of.get(report.nodeid, "(none selected)")
        counts = self.result.counts.setdefault(backend, Counter())
        if report.when == "call" or (report.when == "setup" and not report.passed):
            counts[report.outcome] += 1
        elif report.when == "teardown" and report.failed:
            counts["failed"] += 1


def run_check(
    backends: Sequence[str] = (),
    *,
    max_examples: int | None = None,
    steps: int | None = None,
    verbose: bool = False,
    out: TextIO,
) -> CheckResult:
    """Run the kit against ``backends`` (every installed one when empty) and print a table.

    pytest runs in this process with an empty configuration of its own, so the current
    directory's pytest settings do not apply.
    """
    result = CheckResult()
    with tempfile.TemporaryDirectory(prefix="kvcache-check-") as directory:
        ini = Path(directory) / "pytest.ini"
        ini.write_text("[pytest]\n")
        args = ["-c", str(ini), "--rootdir", directory, "-p", "kvcache_core.testing", "-p", "no:cacheprovider"]
        args += ["--pyargs", "kvcache_core.testing.test_conformance", "-rfE", "--tb=short"]
        args += ["-v"] if verbose else ["-q"]
        for name in backends:
            args += ["--kvcache-backend", name]
        if max_examples is not None:
            args += ["--kvcache-max-examples", str(max_examples)]
        if steps is not None:
            args += ["--kvcache-steps", str(steps)]
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            result.exit_code = int(pytest.main(args, plugins=[_Collector(result)]))
    report = captured.getvalue()
    if verbose or not result.ok:
        out.write(report)
        out.write("\n")
    _print_table(result, out)
    return result


def _print_table(result: CheckResult, out: TextIO) -> None:
    rows: list[list[Any]] = []
    for backend in sorted(result.counts):
        counts = result.counts[backend]
        verdict = "FAIL" if counts["failed"] else ("ok" if counts["passed"] else "not run")
        rows.append([backend, *(counts[outcome] for outcome in _OUTCOMES), verdict])
    write_table(["backend", *_OUTCOMES, "verdict"], rows, out)
    if not rows:
        out.write("no kit test ran\n")
