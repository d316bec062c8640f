"""The ``kvcache`` command: demo and its self-check."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcache_core import Step
from kvcache_core.cli import main
from kvcache_core.cli.demo import DemoOptions, run_demo
from tests.process_support import run_python


def test_demo_serves_every_request_and_passes_its_check() -> None:
    out = io.StringIO()
    assert main(["demo"], out) == 0
    text = out.getvalue()
    assert "all 8 requests match a recomputation without cache" in text
    assert "0 in use (all returned)" in text
    assert "max-length reservation" in text


def test_demo_report_figures_are_consistent() -> None:
    report = run_demo("numpy", DemoOptions(num_requests=6, seed=3), io.StringIO())
    assert report.ok
    assert report.tokens_generated > 0
    assert 0 < report.peak_blocks_used <= report.total_blocks
    assert 0 < report.peak_utilization <= 1
    assert report.peak_paged_bytes < report.max_length_reservation_bytes
    assert report.max_logit_difference < 1e-4
    assert report.peak_concurrency > 1


def test_demo_fails_with_nonzero_status_when_attention_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    original: Callable[..., Any] = Step[Any].attention

    def skewed(self: Step[Any], *args: Any, **kwargs: Any) -> Any:
        return np.asarray(original(self, *args, **kwargs)) * 1.01

    monkeypatch.setattr(Step, "attention", skewed)
    out = io.StringIO()
    assert main(["demo", "--requests", "3"], out) == 1
    assert "FAILED" in out.getvalue()


def test_demo_on_an_unknown_backend_exits_with_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "nope"], io.StringIO()) == 2
    assert "no kvcache backend named 'nope'" in capsys.readouterr().err


def test_the_installed_console_script_runs() -> None:
    result = run_python("-m", "kvcache_core.cli", "demo", "--requests", "2")
    assert result.returncode == 0, result.stderr
    assert "all 2 requests match" in result.stdout


def test_backends_lists_each_backends_description() -> None:
    out = io.StringIO()
    assert main(["backends"], out) == 0
    header, _, *rows = out.getvalue().splitlines()
    assert header.split()[-1] == "description"
    numpy_row = next(row for row in rows if row.startswith("numpy "))
    assert numpy_row.endswith("NumPy reference backend (host memory), built into kvcache-core")


@pytest.mark.parametrize(
    ("module", "must_not_load"),
    [("kvcache_core.cli", "kvcache_core.testing.check"), ("kvcache_core.testing.check", "kvcache_core.cli")],
)
def test_the_command_and_the_kit_runner_import_alone_without_each_other(module: str, must_not_load: str) -> None:
    """``cli`` runs the kit only on ``kvcache check`` and the kit's runner prints without the command:
    each imports alone, in a fresh interpreter, and loads nothing of the other."""
    probe = f"import importlib, sys; importlib.import_module({module!r}); print({must_not_load!r} in sys.modules)"
    result = run_python("-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"importing {module} loaded {must_not_load}"
