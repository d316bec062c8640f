"""Every benchmark still runs: each script's ``--quick`` smoke run exits 0 and prints ratios.

No time is asserted (shared machines are noisy); the scripts themselves exit 1 when the
compared implementations disagree, so this also checks they compute the same thing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py") if not path.name.startswith("_"))


def test_every_benchmark_is_listed_here() -> None:
    assert SCRIPTS == [
        "allocator_runs.py",
        "decode_jax.py",
        "decode_numpy.py",
        "decode_torch.py",
        "generate_torch.py",
        "prefix.py",
        "quantized.py",
        "step_overhead.py",
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_quick_run_succeeds_and_prints_ratios(script: str) -> None:
    environment = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "4294967296",
        "MALLOC_TRIM_THRESHOLD_": "68719476736",
        "HF_HUB_OFFLINE": "1",
    }
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
