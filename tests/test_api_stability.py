"""The public API evolves additively: every public name of the last release still imports
from where it was (moved ones warn, naming their new home), the faces stay small and sorted,
and every deprecation entry points at something that exists."""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from pathlib import Path

import pytest

import kvcache_core
import kvcache_core.plugin
from kvcache_core._moved import MOVED_ATTRIBUTES, MOVED_MODULES, MOVED_NAMES

API = Path(__file__).resolve().parent / "api"


def released_names(release: str) -> list[tuple[str, str]]:
    """``(module, name)`` for every public name of ``release`` (``tests/api/<release>.txt``)."""
    lines = (API / f"{release}.txt").read_text(encoding="utf-8").splitlines()
    pairs = [tuple(line.split(":")) for line in lines if line and not line.startswith("#")]
    return [(module, name) for module, name in pairs]


#: What 0.2.0 documented as the manager's plumbing (its docstring's "Where the parts live"),
#: not as API: these may change in any minor version. From 0.3.0 such modules are private
#: (``_``-prefixed) or live in ``kvcache_core.paging``, which ARCHITECTURE.md marks internal.
INTERNAL_OF_0_2 = frozenset(
    {
        "kvcache_core.audit",
        "kvcache_core.beyond_pool",
        "kvcache_core.block_pool",
        "kvcache_core.chains",
        "kvcache_core.checks",
        "kvcache_core.data_path",
        "kvcache_core.figures",
        "kvcache_core.pool_access",
        "kvcache_core.sequences",
        "kvcache_core.tier_chain",
        "kvcache_core.step:StepHooks",
    }
)

RELEASED = [
    (module, name)
    for module, name in released_names("0.2.0")
    if module not in INTERNAL_OF_0_2 and f"{module}:{name}" not in INTERNAL_OF_0_2
]


def test_the_release_list_is_read() -> None:
    assert len(RELEASED) > 400
    assert ("kvcache_core", "CacheConfig") in RELEASED
    assert ("kvcache_core.numpy_backend", "NumpyStorage") in RELEASED
    assert ("kvcache_core.data_path", "DataPath") not in RELEASED


@pytest.mark.parametrize("module", sorted({module for module, _ in RELEASED}))
def test_every_public_name_of_the_last_release_still_imports_from_where_it_was(module: str) -> None:
    pytest.importorskip("torch") if module.startswith("kvcache_torch") else None
    pytest.importorskip("jax") if module.startswith("kvcache_jax") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # moved ones warn: tested below
        loaded = importlib.import_module(module)
        missing = [name for released, name in RELEASED if released == module and not hasattr(loaded, name)]
    assert missing == [], f"{module} lost {missing} without a deprecation entry (kvcache_core/_moved.py)"


def test_a_name_that_left_the_face_warns_naming_its_new_home() -> None:
    for name, (module, attribute, _) in MOVED_NAMES.items():
        with pytest.warns(DeprecationWarning, match=rf"kvcache_core\.{name} moved to {module}\.{attribute}"):
            value = getattr(kvcache_core, name)
        assert value is getattr(importlib.import_module(module), attribute)


def test_a_name_that_left_a_module_warns_naming_its_new_home() -> None:
    for module, names in MOVED_ATTRIBUTES.items():
        loaded = importlib.import_module(module)
        for name, (new, _) in names.items():
            if name in vars(loaded):  # still imported there for its own use: no warning due
                continue
            with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} moved to {new}\.{name}"):
                value = getattr(loaded, name)
            assert value is getattr(importlib.import_module(new), name)


def test_every_moved_module_names_a_module_that_exists() -> None:
    for old, new in MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}"
        assert importlib.util.find_spec(old.replace("kvcache_core.", "kvcache_core._gone_")) is None


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        kvcache_core.NoSuchName  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]


@pytest.mark.parametrize(("face", "limit"), [(kvcache_core, 30), (kvcache_core.plugin, 30)])
def test_the_faces_are_small_sorted_and_complete(face: object, limit: int) -> None:
    names: list[str] = list(face.__all__)  # type: ignore[attr-defined]
    assert len(names) <= limit
    assert names == sorted(names, key=lambda name: (not name.isupper(), name)) or names == sorted(names)
    assert all(hasattr(face, name) for name in names)


def test_the_user_face_and_the_deprecations_do_not_overlap() -> None:
    assert set(kvcache_core.__all__).isdisjoint(MOVED_NAMES)
