"""Every benchmark still runs: each script's ``--quick`` smoke run exits 0 and prints ratios.

No time is asserted (shared machines are noisy); the scripts themselves exit 1 when the
compared implementations disagree, so this also checks they compute the same thing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py") if not path.name.startswith("_"))


def bench_helpers() -> Any:
    """The scripts' shared helpers, ``benchmarks/_bench.py`` (a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("benchmarks_bench", BENCHMARKS / "_bench.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_is_listed_here() -> None:
    assert SCRIPTS == [
        "allocator_runs.py",
        "decode_jax.py",
        "decode_numpy.py",
        "decode_torch.py",
        "generate_hybrid.py",
        "generate_torch.py",
        "hybrid_memory.py",
        "prefix.py",
        "quantized.py",
        "step_overhead.py",
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_quick_run_succeeds_and_prints_ratios(script: str) -> None:
    environment = {**os.environ, **bench_helpers().RECOMMENDED_ENV, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick"],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
        timeout=600,
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "x" in result.stdout
    assert any(character.isdigit() for character in result.stdout)
