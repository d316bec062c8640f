"""A really installed broken plugin (examples/kvcache-broken) warns by name and hides nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BROKEN = ROOT / "examples" / "kvcache-broken"

# One pip install serves the module: its tests run on the same pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("broken_plugin")


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvcache-broken installed with pip into a directory of its own."""
    target = tmp_path_factory.mktemp("broken-site")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    command += ["--no-index", "--target", str(target), str(BROKEN)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(target.glob("kvcache_broken-0.1.0.dist-info"))
    return target


def run_with(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, env=environment)


def test_kvcache_backends_warns_naming_the_broken_distribution_and_lists_the_rest(broken_site: Path) -> None:
    result = run_with(broken_site, "-m", "kvcache_core.cli", "backends")

    assert result.returncode == 0, result.stderr
    table, _, notes = result.stdout.partition("\n\n")
    rows = {line.split()[0] for line in table.splitlines()[2:]}
    assert {"numpy", "memmap"} <= rows, result.stdout
    assert "broken" not in rows
    warning = next(line for line in notes.splitlines() if line.startswith("warning:"))
    assert "'broken' from distribution kvcache-broken 0.1.0" in warning
    assert "No module named 'kvcache_broken._native'" in warning  # the cause, not just "failed"


def test_the_other_backends_still_work_beside_it(broken_site: Path) -> None:
    code = (
        "import warnings\n"
        "from kvcache_core import CacheConfig, available_backends, create_manager\n"
        "from kvcache_core.plugin import KvCachePluginWarning\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    names = available_backends()\n"
        "assert 'broken' not in names and {'numpy', 'memmap'} <= set(names), names\n"
        "assert any(issubclass(w.category, KvCachePluginWarning) and 'kvcache-broken' in str(w.message)"
        " for w in caught), [str(w.message) for w in caught]\n"
        "manager = create_manager('memmap', CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=2))\n"
        "print('ok', manager.backend)\n"
    )
    result = run_with(broken_site, "-c", code)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok memmap" in result.stdout
