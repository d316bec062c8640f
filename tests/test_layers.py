"""The layer rules of ARCHITECTURE.md hold: core imports downward only, with no cycle, and the
plugins import no private module of core. The rules are read from ARCHITECTURE.md's table,
so the document and the code cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "kvcache_core" / "src" / "kvcache_core"
PLUGINS = {
    "kvcache_torch": ROOT / "kvcache_torch" / "src" / "kvcache_torch",
    "kvcache_jax": ROOT / "kvcache_jax" / "src" / "kvcache_jax",
    "kvcache_memmap": ROOT / "examples" / "kvcache-memmap" / "src" / "kvcache_memmap",
}

_ROW = re.compile(r"^\| (\d+) (\w+) \| (.+) \|$")


def layer_table(text: str) -> list[tuple[int, str, list[str]]]:
    """The rows of the layer table: ``(rank, layer, module patterns)``; a pattern ending in
    ``*`` names a package and everything in it."""
    rows: list[tuple[int, str, list[str]]] = []
    for line in text.splitlines():
        match = _ROW.match(line)
        if match:
            patterns = re.findall(r"`([\w.*]+)`", match.group(3))
            rows.append((int(match.group(1)), match.group(2), patterns))
    return rows


def rank_of(module: str, table: list[tuple[int, str, list[str]]]) -> int | None:
    """The layer of ``module`` by the table (the most specific pattern wins), or ``None``."""
    best: tuple[int, int] | None = None  # (pattern length, rank)
    for rank, _, patterns in table:
        for pattern in patterns:
            if pattern.endswith("*"):
                base = pattern[:-1]
                hit = module == base or module.startswith(base + ".")
            else:
                base = pattern
                hit = module == base
            if hit and (best is None or len(base) > best[0]):
                best = (len(base), rank)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]], table: list[tuple[int, str, list[str]]]) -> list[str]:
    """``"a -> b"`` for every import of a module of a higher layer (or of no layer)."""
    found: list[str] = []
    for module in sorted(graph):
        own = rank_of(module, table)
        for target in sorted(graph[module]):
            if target.split(".")[0] != "kvcache_core" or target == module:
                continue
            theirs = rank_of(target, table)
            if own is None or theirs is None or theirs > own:
                found.append(f"{module} ({own}) -> {target} ({theirs})")
    return found


def is_internal(module: str) -> bool:
    """Whether ``module`` is one of core's internals: ``paging`` or a ``_``-prefixed module."""
    parts = module.split(".")
    return parts[0] == "kvcache_core" and (parts[1:2] == ["paging"] or any(part.startswith("_") for part in parts[1:]))


@pytest.fixture(scope="module")
def table() -> list[tuple[int, str, list[str]]]:
    rows = layer_table((ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert [rank for rank, _, _ in rows] == list(range(len(rows))), "the layers are numbered 0, 1, 2, ..."
    return rows


@pytest.fixture(scope="module")
def core_graph() -> dict[str, set[str]]:
    return import_graph(CORE, "kvcache_core")


def test_every_core_module_has_a_layer(
    core_graph: dict[str, set[str]], table: list[tuple[int, str, list[str]]]
) -> None:
    assert len(core_graph) > 50
    assert [module for module in sorted(core_graph) if rank_of(module, table) is None] == []


def test_core_has_no_import_cycle(core_graph: dict[str, set[str]]) -> None:
    assert cycles(core_graph) == []


def test_no_core_module_imports_from_a_higher_layer(
    core_graph: dict[str, set[str]], table: list[tuple[int, str, list[str]]]
) -> None:
    assert upward_imports(core_graph, table) == []


def test_the_checks_find_what_they_look_for(table: list[tuple[int, str, list[str]]]) -> None:
    graph = {
        "kvcache_core.paging.sequences": {"kvcache_core.handle", "kvcache_core.contract.config", "numpy"},
        "kvcache_core.contract.config": {"kvcache_core.errors"},
        "kvcache_core.new_module": {"kvcache_core.errors"},
    }
    assert upward_imports(graph, table) == [
        "kvcache_core.new_module (None) -> kvcache_core.errors (0)",
        "kvcache_core.paging.sequences (3) -> kvcache_core.handle (6)",
    ]
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert rank_of("kvcache_core.offload.tiers", table) == 4
    assert rank_of("kvcache_core", table) == 7
    assert is_internal("kvcache_core.paging.allocator")
    assert is_internal("kvcache_core._data_path")
    assert not is_internal("kvcache_core.contract.config")
    assert not is_internal("kvcache_core_extra._x")


@pytest.mark.parametrize("package", sorted(PLUGINS))
def test_plugins_import_no_internal_module_of_core(package: str) -> None:
    graph = import_graph(PLUGINS[package], package)
    private = sorted(
        f"{module} -> {target}" for module, targets in graph.items() for target in targets if is_internal(target)
    )
    assert private == []
