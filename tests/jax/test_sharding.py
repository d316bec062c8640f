"""The pool sharded over KV heads on a mesh of 8 host CPU devices.

JAX reads ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` once, when it starts,
and this process's JAX may already run with one device; so the cases in
``mesh_cases.py`` run in a pytest process of their own, started here with the flag.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.process_support import run_python

CASES = Path(__file__).with_name("mesh_cases.py")
ROOT = Path(__file__).resolve().parents[2]


def test_the_mesh_cases_pass_on_8_host_devices() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8".strip()}
    env["JAX_PLATFORMS"] = "cpu"
    result = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES), env=env, cwd=ROOT, timeout=600)
    report = result.stdout[-8000:] + result.stderr[-4000:]
    assert result.returncode == 0, report
    summary = result.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None, report
    assert int(passed.group(1)) >= 24, summary
    assert "skipped" not in summary, summary
