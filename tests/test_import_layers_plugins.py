"""The backend distributions import downward only: no import cycle (lazy imports included),
nothing imports the plugin module, and the plugin reads its facts without the array library."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]

#: package -> its source folder, for every backend distribution of the repository.
PACKAGES = {
    "kvcache_torch": ROOT / "kvcache_torch" / "src" / "kvcache_torch",
    "kvcache_jax": ROOT / "kvcache_jax" / "src" / "kvcache_jax",
    "kvcache_memmap": ROOT / "examples" / "kvcache-memmap" / "src" / "kvcache_memmap",
}

#: package -> the array library its discovery-time modules must not import.
ARRAY_LIBRARIES = {"kvcache_torch": "torch", "kvcache_jax": "jax"}


def write_package(root: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``root`` made of ``files`` (path inside it -> source)."""
    for name, source in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return root / "pkg"


def test_the_graph_reads_module_level_lazy_type_only_and_relative_imports(tmp_path: Path) -> None:
    package = write_package(
        tmp_path,
        {
            "__init__.py": "from . import api\nfrom .api import helper\n",
            "api.py": "import os\n\ndef helper() -> None:\n    from pkg.sub import deep\n",
            "sub/__init__.py": "",
            "sub/deep.py": (
                "from typing import TYPE_CHECKING\n"
                "from .. import api\n"
                "from ..api import helper\n"
                "from . import sibling\n"
                "from pkg import VERSION\n"
                "if TYPE_CHECKING:\n"
                "    import numpy\n"
            ),
            "sub/sibling.py": "",
        },
    )
    assert import_graph(package, "pkg") == {
        "pkg": {"pkg.api"},
        "pkg.api": {"os", "pkg.sub.deep"},
        "pkg.sub": set(),
        "pkg.sub.deep": {"typing", "pkg.api", "pkg.sub.sibling", "pkg", "numpy"},
        "pkg.sub.sibling": set(),
    }


def test_modules_of_other_packages_named_as_known_are_resolved(tmp_path: Path) -> None:
    package = write_package(tmp_path, {"__init__.py": "", "api.py": "from other import tool, VERSION\n"})
    assert import_graph(package, "pkg")["pkg.api"] == {"other"}
    assert import_graph(package, "pkg", known={"other.tool"})["pkg.api"] == {"other", "other.tool"}


def test_a_cycle_closed_by_a_lazy_import_is_found(tmp_path: Path) -> None:
    package = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "plugin.py": "def factory() -> None:\n    from pkg.storage import Storage\n",
            "storage.py": "from pkg.spec import LAYOUT\n\nclass Storage:\n    def __init__(self) -> None:\n"
            "        from pkg.plugin import factory\n",
            "spec.py": "LAYOUT = 'NHD'\n",
        },
    )
    assert cycles(import_graph(package, "pkg")) == [["pkg.plugin", "pkg.storage"]]


def test_cycles_gives_one_cycle_per_tangle_in_import_order() -> None:
    graph: dict[str, set[str]] = {
        "a": {"b"},
        "b": {"c", "outside"},
        "c": {"a"},
        "d": {"a", "e"},
        "e": {"d"},
        "f": {"f"},
        "g": set(),
    }
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_backend_distribution_has_no_import_cycle(package: str) -> None:
    graph = import_graph(PACKAGES[package], package)
    assert f"{package}.storage" in graph, f"the sources of {package} were not found"
    assert cycles(graph) == []


@pytest.mark.parametrize("package", sorted(ARRAY_LIBRARIES))
def test_no_module_imports_the_plugin_module(package: str) -> None:
    plugin = f"{package}.plugin"
    graph = import_graph(PACKAGES[package], package)
    assert plugin in graph
    assert sorted(module for module, imported in graph.items() if plugin in imported) == []


@pytest.mark.parametrize("package", sorted(ARRAY_LIBRARIES))
def test_the_spec_and_the_plugin_import_no_array_library(package: str) -> None:
    library = ARRAY_LIBRARIES[package]
    script = textwrap.dedent(
        f"""
        import sys
        import {package}.spec, {package}.plugin
        [spec] = {package}.plugin.kvcache_register_backends()
        assert spec.capabilities == {package}.spec.CAPABILITIES
        assert spec.dtypes == {package}.spec.DTYPES
        assert spec.kv_layouts == {package}.spec.LAYOUTS
        assert spec.preferred_layout == {package}.spec.PREFERRED_LAYOUT
        print(sorted(name for name in sys.modules if name.split(".")[0] in ({library!r}, "jaxlib")))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
