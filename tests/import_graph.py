"""The import graph of a package, read from its source (no module is imported), and its cycles.

Every ``import`` and ``from ... import`` statement counts wherever it stands: at module
level, inside a function (a lazy import is still an import), under ``if TYPE_CHECKING:``
(a type-only import still ties the two modules together). Relative imports are resolved
against the importing module. ``from package import name`` counts as an import of
``package.name`` when that is a module of the package read, of ``package`` otherwise.
Imports by string (``importlib.import_module(name)``) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Set
from pathlib import Path

__all__ = ["cycles", "import_graph", "imports_of"]


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package in ``package_dir`` (subpackages included) -> its file."""
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        if level - 1 > len(parts) - 1:
            raise ValueError(f"{module}: a relative import of level {level} climbs above its top package")
        parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, target] if target else parts)


def imports_of(source: str, module: str, *, is_package: bool = False, known: Set[str] = frozenset()) -> set[str]:
    """The modules that ``source`` (the text of ``module``) imports, as absolute names.

    Args:
        source: the module's Python source.
        module: its dotted name (resolves relative imports).
        is_package: whether it is a package's ``__init__`` (``from . import x`` then names
            the package itself, not its parent).
        known: module names that exist: ``from p import name`` is an import of ``p.name``
            when ``p.name`` is one of them, of ``p`` otherwise.

    Raises:
        SyntaxError: the source does not parse.
        ValueError: a relative import climbs above the top package.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, is_package, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    found.discard(module)
    return found


def import_graph(package_dir: Path, package: str, *, known: Set[str] = frozenset()) -> dict[str, set[str]]:
    """Each module of ``package`` (its sources in ``package_dir``) -> the modules it imports.

    Every module of the package is a key (``package`` itself for its ``__init__``); the
    values hold every module imported, inside the package or outside it, at any depth of
    the source (module level, functions, ``TYPE_CHECKING`` blocks). ``known`` names modules
    of other packages (the keys of their graphs), so that ``from other import module``
    counts as ``other.module`` rather than ``other``.

    Raises:
        SyntaxError: a module does not parse.
        ValueError: a relative import climbs above the top package.
    """
    modules = module_names(package_dir, package)
    every_known = frozenset(modules) | known
    return {
        name: imports_of(
            path.read_text(encoding="utf-8"), name, is_package=path.name == "__init__.py", known=every_known
        )
        for name, path in modules.items()
    }


def _strongly_connected(graph: Mapping[str, Set[str]]) -> Iterator[list[str]]:
    """Tarjan's components of ``graph`` restricted to its keys (iterative, any depth)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    # The depth-first walk's path: each module with the imports it has still to follow.
    work: list[tuple[str, Iterator[str]]] = []

    def enter(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        work.append((node, iter(sorted(target for target in graph[node] if target in graph))))

    for root in sorted(graph):
        if root in index:
            continue
        enter(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    enter(target)
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                yield component


def _cycle_through(graph: Mapping[str, Set[str]], members: Set[str]) -> list[str]:
    """One shortest cycle inside a strongly connected set, from its first module by name."""
    start = min(members)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1]
                if target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(members)} is not strongly connected")  # unreachable for a component


def cycles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: one per strongly connected group of modules.

    Each cycle lists modules in import order, starting from the group's first module by
    name, and closes back to it: ``["a", "b"]`` is a → b → a; a module importing itself
    is ``["a"]``. Empty when the graph has no cycle. Only the graph's keys are followed
    (imports of modules outside it cannot close a cycle).
    """
    found = [
        _cycle_through(graph, set(component))
        for component in _strongly_connected(graph)
        if len(component) > 1 or component[0] in graph[component[0]]
    ]
    return sorted(found)
