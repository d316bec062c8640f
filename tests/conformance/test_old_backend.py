"""A backend written against the last releases' documented imports still imports, with a
DeprecationWarning naming each new home, and still passes the kit: its ``paged_attention``
has the signature of 0.1 (no attention features) and it claims none of them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

AddDistribution = Callable[[Path, str, str, str, str, str], None]

#: Written as the README of 0.1 and 0.2 showed: the top-level names and the old modules.
OLD_PLUGIN = """
from kvcache_core import BackendSpec, CacheConfig, PageTable, hookimpl, paged_attention
from kvcache_core.numpy_backend import POLICY_CAPABILITIES, NumpyStorage
from kvcache_core.config import KV_LAYOUTS


class OldStorage(NumpyStorage):
    # The storage of 0.1: attention without features, delegating to the reference.
    attention_features = frozenset()

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)

    def paged_attention(self, layer, query, page_table: PageTable, qo_indptr, scale, causal):
        return super().paged_attention(layer, query, page_table, qo_indptr, scale, causal)


REFERENCE = paged_attention


@hookimpl
def kvcache_register_backends():
    yield BackendSpec(
        name="old",
        storage_factory=OldStorage,
        kv_layouts=tuple(KV_LAYOUTS),
        capabilities=frozenset(POLICY_CAPABILITIES),
        description="written against kvcache-core 0.2",
    )
"""

KIT_FILE = """
from kvcache_core.testing import KvCacheConformance

class TestKit(KvCacheConformance):
    pass
"""


@pytest.fixture
def old_backend(plugin_dir: Path, add_distribution: AddDistribution) -> Path:
    add_distribution(plugin_dir, "kvtest-old", "0.2", "old", "kvtest_old", OLD_PLUGIN)
    return plugin_dir


def test_the_old_imports_work_and_warn_naming_the_new_homes(old_backend: Path) -> None:
    code = "import warnings; warnings.simplefilter('always'); import kvtest_old"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=old_backend)

    assert result.returncode == 0, result.stderr
    for old, new in [
        ("kvcache_core.BackendSpec", "kvcache_core.plugin.BackendSpec"),
        ("kvcache_core.hookimpl", "kvcache_core.plugin.hookimpl"),
        ("kvcache_core.paged_attention", "kvcache_core.plugin.paged_attention"),
        ("kvcache_core.numpy_backend", "kvcache_core.backends.numpy"),
        ("kvcache_core.config", "kvcache_core.contract.config"),
    ]:
        assert f"DeprecationWarning: {old} moved to {new}" in result.stderr, result.stderr
    # Names still on the face do not warn.
    assert "kvcache_core.CacheConfig moved" not in result.stderr
    assert "kvcache_core.PageTable moved" not in result.stderr


def test_the_old_backend_passes_the_kit(pytester: pytest.Pytester, old_backend: Path) -> None:
    pytester.makepyfile(test_kit_run=KIT_FILE)
    result = pytester.runpytest(
        "-p", "kvcache_core.testing", "--kvcache-max-examples", "5", "-q", "--kvcache-backend", "old"
    )

    outcomes = result.parseoutcomes()
    assert result.ret == 0, result.stdout.str()
    assert outcomes["passed"] >= 40
    assert "failed" not in outcomes
