"""The pytest side of the kit: options, markers, the ``kvcache_backend`` fixture, notes.

Loaded through the ``pytest11`` entry point of kvcache-core, so it is present in every
pytest run where kvcache-core is installed; it does nothing until a test asks for the
``kvcache_backend`` fixture (directly or by subclassing ``KvCacheConformance``).
Importing it imports neither hypothesis nor any backend's array library: backends are
listed only when a test needs them, and their libraries load when a manager is built.
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = [
    "KitSettings",
    "kit_settings",
    "kvcache_backend",
    "pytest_addoption",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_runtest_makereport",
]

BACKEND_FIXTURE = "kvcache_backend"
PIN_MARKER = "kvcache_backends"
REQUIRES_MARKER = "kvcache_requires"


@dataclass(frozen=True)
class KitSettings:
    """Hypothesis settings of the kit's property tests, from the command line.

    Attributes:
        max_examples: examples per property test (``--kvcache-max-examples``).
        step_count: steps per state-machine run (``--kvcache-steps``).
        deadline_ms: per-example deadline in ms, ``None`` for none (``--kvcache-deadline``).
    """

    max_examples: int = 20
    step_count: int = 25
    deadline_ms: float | None = None

    def hypothesis(self) -> Any:
        """The matching ``hypothesis.settings`` (imported here, not at plugin load)."""
        from hypothesis import HealthCheck, settings

        return settings(
            max_examples=self.max_examples,
            stateful_step_count=self.step_count,
            deadline=self.deadline_ms,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )  # everything else (derandomize, database, ...) from the loaded Hypothesis profile


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
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


def pytest_configure(config: pytest.Config) -> None:
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
    return KitSettings(
        max_examples=max_examples if max_examples is not None else defaults.max_examples,
        step_count=steps if steps is not None else defaults.step_count,
        deadline_ms=deadline,
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


@pytest.fixture
def kvcache_backend(request: pytest.FixtureRequest) -> Any:
    """The backend under test (a :class:`~kvcache_core.testing.BackendUnderTest`).

    Skips, with the reason, when the backend is not installed, is unavailable here, or
    lacks a capability the test requires (``@pytest.mark.kvcache_requires("swap")``).
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
    for marker in request.node.iter_markers(REQUIRES_MARKER):
        for capability in marker.args:
            if capability not in spec.capabilities:
                pytest.skip(f"kvcache backend {name!r} does not claim capability {capability!r}")
    return BackendUnderTest(name=name, spec=spec)


def _reproduce_line(item: pytest.Item, backend: str) -> str:
    return shlex.join(["pytest", item.nodeid, "-p", "kvcache_core.testing", "--kvcache-backend", backend])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Add a note naming the backend and how to rerun the case to every failure of a kit test."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed:
        return
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get(BACKEND_FIXTURE) if callspec is not None else None
    if not isinstance(backend, str):
        return
    note = (
        f"kvcache backend {backend!r} failed conformance case {item.name}\nreproduce: {_reproduce_line(item, backend)}"
    )
    report.sections.append(("kvcache conformance", note))
