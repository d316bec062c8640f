"""Support for the tests that run Python in a process of their own (a fresh interpreter: what
an import loads, flags read once at start-up, a fork, a console command)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def run_python(
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python *args`` with this interpreter in a process of its own (``env``: its whole
    environment, this one's by default), its output captured as text; a non-zero exit is
    returned, not raised (the caller asserts on it with the output)."""
    return subprocess.run(
        [sys.executable, *args],
        env=None if env is None else dict(env),
        cwd=cwd,
        timeout=timeout,
        capture_output=True,
        text=True,
        check=False,
    )
