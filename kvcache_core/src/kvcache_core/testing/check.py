"""``kvcache check``: the conformance kit from the command line, one table row per backend.

The kit runs in a child pytest process (this interpreter, its import path, an empty
pytest configuration of its own so the current directory's settings do not apply), exactly
as its printed rerun lines run it; the child writes each backend's outcomes to a JSON
report (``--kvcache-report``) from which the table is made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvcache_core._table import write_table

__all__ = ["BackendVerdict", "CheckResult", "run_check"]

_OUTCOMES = ("passed", "failed", "skipped")


@dataclass
class BackendVerdict:
    """One backend's row: outcome counts, the verdict and the policies it does not claim.

    Attributes:
        counts: ``passed`` / ``failed`` / ``skipped`` kit tests.
        verdict: ``FAIL``, ``not run``, ``ok`` or ``ok (not claimed: fork, swap, ...)``.
        unclaimed: the policy capabilities the backend does not claim.
        unclaimed_skips: capability -> the tests skipped because it is not claimed.
    """

    counts: Counter[str] = field(default_factory=Counter[str])
    verdict: str = "not run"
    unclaimed: list[str] = field(default_factory=list[str])
    unclaimed_skips: dict[str, list[str]] = field(default_factory=dict[str, list[str]])


@dataclass
class CheckResult:
    """Per-backend verdicts of the kit, pytest's exit code and the seed it ran with."""

    backends: dict[str, BackendVerdict] = field(default_factory=dict[str, BackendVerdict])
    exit_code: int = 0
    seed: int = 0

    @property
    def counts(self) -> dict[str, Counter[str]]:
        """``backend -> Counter`` of outcomes."""
        return {name: verdict.counts for name, verdict in self.backends.items()}

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not any(verdict.counts["failed"] for verdict in self.backends.values())


def _kit_command(
    backends: Sequence[str],
    *,
    ini: Path,
    report: Path,
    max_examples: int | None,
    steps: int | None,
    seed: int | None,
    require_all: bool,
    verbose: bool,
) -> list[str]:
    # Root at the directory holding kvcache_core: failures are named kvcache_core/testing/...
    import kvcache_core

    root = Path(kvcache_core.__file__).resolve().parents[1]
    args = [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(root)]
    args += ["-p", "kvcache_core.testing", "-p", "no:cacheprovider", "--kvcache-report", str(report)]
    args += ["--pyargs", "kvcache_core.testing.test_conformance", "-rfE", "--tb=short"]
    args += ["-v"] if verbose else ["-q"]
    for name in backends:
        args += ["--kvcache-backend", name]
    if max_examples is not None:
        args += ["--kvcache-max-examples", str(max_examples)]
    if steps is not None:
        args += ["--kvcache-steps", str(steps)]
    if seed is not None:
        args += ["--kvcache-seed", str(seed)]
    if require_all:
        args.append("--kvcache-require-all")
    return args


def run_check(
    backends: Sequence[str] = (),
    *,
    max_examples: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    require_all: bool = False,
    verbose: bool = False,
    out: TextIO,
) -> CheckResult:
    """Run the kit against ``backends`` (every installed one when empty) and print a table.

    Args:
        backends: backend names; every installed one when empty.
        max_examples, steps, seed: the kit's Hypothesis settings (defaults: the kit's).
        require_all: fail the tests of policies a backend does not claim, instead of
            skipping them.
        verbose: print pytest's whole report, not only when something failed.
        out: where the report and the table go.
    """
    result = CheckResult()
    with tempfile.TemporaryDirectory(prefix="kvcache-check-") as directory:
        ini = Path(directory) / "pytest.ini"
        ini.write_text("[pytest]\n")
        report_path = Path(directory) / "report.json"
        command = _kit_command(
            backends,
            ini=ini,
            report=report_path,
            max_examples=max_examples,
            steps=steps,
            seed=seed,
            require_all=require_all,
            verbose=verbose,
        )
        environment = dict(os.environ)
        # The child imports what this process imports (a plugin directory added at run time included).
        environment["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
        completed = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
        report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.exists() else {}
    result.exit_code = completed.returncode
    result.seed = int(report.get("seed", seed or 0))
    for name, entry in dict(report.get("backends", {})).items():
        result.backends[str(name)] = BackendVerdict(
            counts=Counter({str(k): int(v) for k, v in dict(entry["counts"]).items()}),
            verdict=str(entry["verdict"]),
            unclaimed=[str(item) for item in entry["unclaimed"]],
            unclaimed_skips={str(k): [str(t) for t in v] for k, v in dict(entry["unclaimed_skips"]).items()},
        )
    if verbose or not result.ok:
        out.write(completed.stdout)
        out.write(completed.stderr)
        out.write("\n")
    _print_table(result, out)
    return result


def _print_table(result: CheckResult, out: TextIO) -> None:
    rows: list[list[Any]] = []
    for backend in sorted(result.backends):
        verdict = result.backends[backend]
        rows.append([backend, *(verdict.counts[outcome] for outcome in _OUTCOMES), verdict.verdict])
    write_table(["backend", *_OUTCOMES, "verdict"], rows, out)
    if not rows:
        out.write("no kit test ran\n")
        return
    for backend in sorted(result.backends):
        verdict = result.backends[backend]
        skipped = sorted({test for tests in verdict.unclaimed_skips.values() for test in tests})
        if verdict.unclaimed and skipped:
            out.write(
                f"{backend}: does not claim {', '.join(verdict.unclaimed)}; {len(skipped)} tests skipped: "
                f"{', '.join(test.removesuffix(f'[{backend}]') for test in skipped)}\n"
            )
    if any(verdict.unclaimed for verdict in result.backends.values()):
        out.write("(--require-all fails those tests instead; see 'Capabilities' in kvcache-core's README)\n")
    out.write(f"seed {result.seed} (--seed); the same seed gives the same failures\n")
