"""The pytest side of the kit: options, markers, the ``kvcache_backend`` fixture, notes.

Loaded through the ``pytest11`` entry point of kvcache-core, so it is present in every
pytest run where kvcache-core is installed; it does nothing until a test asks for the
``kvcache_backend`` fixture (directly or by subclassing ``KvCacheConformance``).
Importing it imports neither hypothesis nor any backend's array library: backends are
listed only when a test needs them, and their libraries load when a manager is built.

Runs are repeatable: Hypothesis draws from a fixed seed (``--kvcache-seed``, default 0,
printed with every failure and in the summary) and keeps no example database, so the
same bug gives the same failures every run. Every failure carries a command that reruns
it when pasted. The summary lists, per backend, the policy capabilities it does not
claim and the tests skipped for that (``--kvcache-require-all`` fails them instead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "POLICY_CAPABILITIES",
    "BackendRecord",
    "KitSettings",
    "OutcomeCounter",
    "backend_records",
    "kit_settings",
    "kvcache_backend",
    "pytest_addoption",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_runtest_makereport",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
    "reproduce_line",
    "skip_unclaimed",
    "summary_lines",
]

BACKEND_FIXTURE = "kvcache_backend"
PIN_MARKER = "kvcache_backends"
REQUIRES_MARKER = "kvcache_requires"

#: The policies of core a backend claims in ``BackendSpec.capabilities`` (the verdict lists
#: the ones it does not claim); ``immutable_arrays`` describes the arrays, not a policy.
POLICY_CAPABILITIES = ("eviction", "fork", "prefix_caching", "sliding_window", "swap")


@dataclass(frozen=True)
class KitSettings:
    """Hypothesis settings of the kit's property tests, from the command line.

    Attributes:
        max_examples: examples per property test (``--kvcache-max-examples``).
        step_count: steps per state-machine run (``--kvcache-steps``).
        deadline_ms: per-example deadline in ms, ``None`` for none (``--kvcache-deadline``).
        seed: the seed every property test and state machine draws from (``--kvcache-seed``).
        require_all: fail, rather than skip, the tests of policies a backend does not claim
            (``--kvcache-require-all``).
    """

    max_examples: int = 20
    step_count: int = 25
    deadline_ms: float | None = None
    seed: int = 0
    require_all: bool = False

    def hypothesis(self) -> Any:
        """The matching ``hypothesis.settings`` (imported here, not at plugin load).

        No example database: a failure found once is not replayed first in the next run,
        so a run's failures depend on the code and the seed alone. Apply the seed with
        ``hypothesis.seed(settings.seed)`` on the test or state machine.
        """
        from hypothesis import HealthCheck, Phase, settings

        return settings(
            max_examples=self.max_examples,
            stateful_step_count=self.step_count,
            deadline=self.deadline_ms,
            database=None,
            # No "explain" phase: its coverage notes bury the failing steps.
            phases=[Phase.explicit, Phase.generate, Phase.target, Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )  # everything else (verbosity, phases, ...) from the loaded Hypothesis profile

    def command_line(self) -> list[str]:
        """The options that give these settings (those that differ from the defaults)."""
        defaults = KitSettings()
        args: list[str] = []
        if self.max_examples != defaults.max_examples:
            args += ["--kvcache-max-examples", str(self.max_examples)]
        if self.step_count != defaults.step_count:
            args += ["--kvcache-steps", str(self.step_count)]
        if self.deadline_ms is not None:
            args += ["--kvcache-deadline", f"{self.deadline_ms:g}"]
        args += ["--kvcache-seed", str(self.seed)]
        if self.require_all:
            args += ["--kvcache-require-all"]
        return args


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _deadline(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of milliseconds or 'none', got {text!r}")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcache", "kvcache conformance kit")
    group.addoption(
        "--kvcache-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the kit against this backend only (repeatable); default: every installed backend",
    )
    group.addoption(
        "--kvcache-max-examples",
        type=_positive_int,
        default=None,
        metavar="N",
        help="Hypothesis examples per property test of the kit (default 20)",
    )
    group.addoption(
        "--kvcache-steps",
        type=_positive_int,
        default=None,
        metavar="N",
        help="steps per state-machine run of the kit (default 25)",
    )
    group.addoption(
        "--kvcache-deadline",
        type=_deadline,
        default=None,
        metavar="MS",
        help="Hypothesis deadline per example in milliseconds, or 'none' (default none: JIT backends compile)",
    )
    group.addoption(
        "--kvcache-seed",
        type=_seed,
        default=None,
        metavar="N",
        help="seed of the kit's property tests and state machines (default 0: every run draws the same examples)",
    )
    group.addoption(
        "--kvcache-require-all",
        action="store_true",
        default=False,
        help="fail, instead of skipping, the tests of policies a backend does not claim "
        f"({', '.join(POLICY_CAPABILITIES)})",
    )
    group.addoption(
        "--kvcache-report",
        default=None,
        metavar="PATH",
        help="write each backend's outcomes, unclaimed capabilities and skipped tests to PATH as JSON",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(OutcomeCounter(config), OutcomeCounter.NAME)
    config.addinivalue_line(
        "markers",
        f"{PIN_MARKER}(*names): run this test or class only against the named kvcache backends",
    )
    config.addinivalue_line(
        "markers",
        f"{REQUIRES_MARKER}(capability): skip on kvcache backends that do not claim the capability",
    )


def kit_settings(config: pytest.Config) -> KitSettings:
    """The kit's Hypothesis settings for this run."""
    defaults = KitSettings()
    max_examples = config.getoption("kvcache_max_examples", default=None)
    steps = config.getoption("kvcache_steps", default=None)
    deadline = config.getoption("kvcache_deadline", default=None)
    seed = config.getoption("kvcache_seed", default=None)
    return KitSettings(
        max_examples=max_examples if max_examples is not None else defaults.max_examples,
        step_count=steps if steps is not None else defaults.step_count,
        deadline_ms=deadline,
        seed=seed if seed is not None else defaults.seed,
        require_all=bool(config.getoption("kvcache_require_all", default=False)),
    )


def _pinned(metafunc: pytest.Metafunc) -> set[str] | None:
    names: set[str] | None = None
    for marker in metafunc.definition.iter_markers(PIN_MARKER):
        pinned = {str(name) for name in marker.args}
        names = pinned if names is None else names & pinned
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``kvcache_backend`` over the installed backends the run selects."""
    if BACKEND_FIXTURE not in metafunc.fixturenames:
        return
    from kvcache_core.discovery import installed_backends

    selected: list[str] = list(metafunc.config.getoption("kvcache_backend", default=[]) or [])
    installed = {info.name for info in installed_backends()}
    pinned = _pinned(metafunc)
    params: list[Any] = []
    names = selected or sorted(installed)
    for name in names:
        if pinned is not None and name not in pinned:
            continue
        params.append(pytest.param(name, id=name))
    if not params:
        reason = f"no kvcache backend selected (installed: {', '.join(sorted(installed)) or 'none'}"
        reason += f"; selected: {', '.join(selected)}" if selected else ""
        reason += f"; pinned to: {', '.join(sorted(pinned))})" if pinned is not None else ")"
        params.append(pytest.param(None, id="no-backend", marks=pytest.mark.skip(reason=reason)))
    metafunc.parametrize(BACKEND_FIXTURE, params, indirect=True)


@dataclass
class BackendRecord:
    """What one run learnt of one backend: outcomes, claims, tests skipped for want of a claim."""

    counts: Counter[str] = field(default_factory=Counter[str])
    capabilities: frozenset[str] | None = None
    unclaimed_skips: dict[str, list[str]] = field(default_factory=dict[str, list[str]])

    def unclaimed(self) -> list[str]:
        """The policy capabilities the backend does not claim (empty when unknown)."""
        if self.capabilities is None:
            return []
        return [name for name in POLICY_CAPABILITIES if name not in self.capabilities]

    def verdict(self) -> str:
        """``FAIL``, ``not run``, ``ok``, or ``ok (not claimed: fork, swap)``."""
        if self.counts["failed"]:
            return "FAIL"
        if not self.counts["passed"]:
            return "not run"
        unclaimed = self.unclaimed()
        return f"ok (not claimed: {', '.join(unclaimed)})" if unclaimed else "ok"


_RECORDS = pytest.StashKey[dict[str, BackendRecord]]()
_UNCLAIMED = pytest.StashKey[tuple[str, ...]]()
_CLAIMED = pytest.StashKey[frozenset[str]]()

#: The user properties of a kit test's reports: its backend, its name, the capabilities the
#: backend claims and those a skip was for (comma-separated). The outcomes are counted from
#: the reports, in the process that prints the summary (the controller, under pytest-xdist).
_BACKEND, _TEST, _CAPABILITIES, _SKIPPED_FOR = (
    "kvcache_backend",
    "kvcache_test",
    "kvcache_claims",
    "kvcache_skipped_for",
)


def backend_records(config: pytest.Config) -> dict[str, BackendRecord]:
    """The per-backend records of this run (filled as kit tests report)."""
    return config.stash.setdefault(_RECORDS, {})


@contextlib.contextmanager
def _short_array_reprs() -> Generator[None, None, None]:
    """Arrays in failure explanations as a few edge items, not whole pools."""
    import numpy as np

    with np.printoptions(threshold=16, edgeitems=2, precision=4, linewidth=100):
        yield


def skip_unclaimed(request: pytest.FixtureRequest, backend: str, *capabilities: str) -> None:
    """Skip this test because ``backend`` claims none of ``capabilities``, or fail it under
    ``--kvcache-require-all`` (when one of them is a policy)."""
    request.node.stash[_UNCLAIMED] = capabilities
    names = " or ".join(repr(name) for name in capabilities)
    message = f"kvcache backend {backend!r} does not claim capability {names}"
    if kit_settings(request.config).require_all and set(capabilities) & set(POLICY_CAPABILITIES):
        pytest.fail(f"{message} (--kvcache-require-all)", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def kvcache_backend(request: pytest.FixtureRequest) -> Generator[Any, None, None]:
    """The backend under test (a :class:`~kvcache_core.testing.BackendUnderTest`).

    Skips, with the reason, when the backend is not installed, is unavailable here, or
    lacks a capability the test requires (``@pytest.mark.kvcache_requires("swap")``;
    under ``--kvcache-require-all`` a policy capability not claimed fails instead).
    """
    from kvcache_core.discovery import get_backend
    from kvcache_core.errors import BackendUnavailableError, KvCacheError
    from kvcache_core.testing.backend import BackendUnderTest

    name = getattr(request, "param", None)
    if not isinstance(name, str):
        pytest.fail("the kvcache_backend fixture is parametrized by the kvcache_core.testing plugin")
    try:
        spec = get_backend(name)
    except BackendUnavailableError as exc:
        pytest.skip(f"kvcache backend {name!r} is unavailable here: {exc}")
    except KvCacheError as exc:
        pytest.fail(f"kvcache backend {name!r} cannot be used: {exc}")
    request.node.stash[_CLAIMED] = frozenset(spec.capabilities)
    for marker in request.node.iter_markers(REQUIRES_MARKER):
        for capability in marker.args:
            if capability not in spec.capabilities:
                skip_unclaimed(request, name, str(capability))
    with _short_array_reprs():
        yield BackendUnderTest(name=name, spec=spec)


def _test_path(item: pytest.Item) -> list[str]:
    """How to name ``item`` on a command line run from the current directory."""
    _, _, selection = item.nodeid.partition("::")
    module = getattr(getattr(item, "module", None), "__name__", None)
    package = Path(__file__).resolve().parent
    path = Path(str(item.path)).resolve()
    if isinstance(module, str) and path.parent == package:  # the kit's own module, wherever installed
        return ["--pyargs", f"{module}::{selection}"]
    try:
        shown = str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    return [f"{shown}::{selection}"]


def reproduce_line(item: pytest.Item, backend: str) -> str:
    """A shell command that reruns ``item`` against ``backend`` with this run's kit settings."""
    settings = kit_settings(item.config)
    return shlex.join(
        [
            "pytest",
            *_test_path(item),
            "-p",
            "kvcache_core.testing",
            "--kvcache-backend",
            backend,
            *settings.command_line(),
        ]
    )


class OutcomeCounter:
    """Counts the outcomes of kit tests per backend into :func:`backend_records`, from the
    reports' user properties: in the process that reports the run (under pytest-xdist, the
    controller, which prints the summary and writes ``--kvcache-report``)."""

    NAME = "kvcache-conformance-outcomes"

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        properties = {name: value for name, value in report.user_properties if isinstance(name, str)}
        backend = properties.get(_BACKEND)
        if not isinstance(backend, str):
            return
        record = backend_records(self._config).setdefault(backend, BackendRecord())
        claims = properties.get(_CAPABILITIES)
        if isinstance(claims, str):
            record.capabilities = frozenset(claims.split(",")) - {""}
        if report.when == "call" or (report.when == "setup" and not report.passed):
            record.counts[report.outcome] += 1
        elif report.when == "teardown" and report.failed:
            record.counts["failed"] += 1
        skipped_for = properties.get(_SKIPPED_FOR)
        if report.skipped and isinstance(skipped_for, str) and skipped_for:
            for capability in skipped_for.split(","):
                record.unclaimed_skips.setdefault(capability, []).append(str(properties.get(_TEST)))


def _properties(item: pytest.Item, backend: str) -> list[tuple[str, object]]:
    """The user properties that carry what :class:`OutcomeCounter` counts of ``item``."""
    claimed = item.stash.get(_CLAIMED, None)
    skipped_for: tuple[str, ...] = item.stash.get(_UNCLAIMED, ())
    return [
        (_BACKEND, backend),
        (_TEST, item.name),
        *([] if claimed is None else [(_CAPABILITIES, ",".join(sorted(claimed)))]),
        (_SKIPPED_FOR, ",".join(skipped_for)),
    ]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Give a kit test's reports what :class:`OutcomeCounter` counts per backend, and add a note
    naming the backend, the seed and how to rerun the case to every failure of a kit test."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get(BACKEND_FIXTURE) if callspec is not None else None
    if not isinstance(backend, str):
        return
    report.user_properties = [*report.user_properties, *_properties(item, backend)]  # this report's own list
    if not report.failed:
        return
    note = (
        f"kvcache backend {backend!r} failed conformance case {item.name} "
        f"(seed {kit_settings(item.config).seed})\nreproduce: {reproduce_line(item, backend)}"
    )
    report.sections.append(("kvcache conformance", note))


def summary_lines(records: dict[str, BackendRecord], settings: KitSettings) -> list[str]:
    """The kit's summary: the seed, then per backend its verdict and the tests skipped
    because it does not claim a policy."""
    lines = [f"seed {settings.seed} (--kvcache-seed); rerun with the same seed to see the same failures"]
    for name in sorted(records):
        record = records[name]
        lines.append(f"{name}: {record.verdict()}")
        skipped = sorted({test for tests in record.unclaimed_skips.values() for test in tests})
        if record.unclaimed() and skipped:
            lines.append(f"  {len(skipped)} tests skipped as not claimed: {', '.join(skipped)}")
    if any(record.unclaimed() for record in records.values()) and not settings.require_all:
        lines.append("claim a capability in BackendSpec.capabilities once the storage serves it; ")
        lines[-1] += "--kvcache-require-all fails the tests of unclaimed ones"
    return lines


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """After a run of kit tests: the seed, each backend's verdict and what was not claimed."""
    records = backend_records(config)
    if not records:
        return
    terminalreporter.section("kvcache conformance")
    for line in summary_lines(records, kit_settings(config)):
        terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the ``--kvcache-report`` JSON file (for ``kvcache check``)."""
    path = session.config.getoption("kvcache_report", default=None)
    if not path or hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller writes it
        return
    records = backend_records(session.config)
    document = {
        "exit_code": int(exitstatus),
        "seed": kit_settings(session.config).seed,
        "backends": {
            name: {
                "counts": dict(record.counts),
                "verdict": record.verdict(),
                "unclaimed": record.unclaimed(),
                "unclaimed_skips": record.unclaimed_skips,
            }
            for name, record in records.items()
        },
    }
    Path(path).write_text(json.dumps(document, indent=1, sort_keys=True))
