"""One freshness stamp for the compiled kernel's sources, for numba's on-disk cache and the
dispatch's calibrations.

numba keeps compiled code on disk and reloads it while the one file that defines a
function is unchanged (its time and size). The kernel's compiled functions inline code from
several modules (the loops, the LLVM IR blocks, the split merge), so an edit of one of the
others left stale machine code in use, silently. :func:`register_locators` puts cache
locators in front of numba's own, for the kernel's modules only, whose stamp is the defining
file's and :func:`sources_stamp` together; the dispatch keys its calibrations by the same
stamp, so a changed kernel is measured again.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Final

__all__ = ["KERNEL_MODULES", "register_locators", "sources_stamp"]

_PACKAGE: Final = "kvcache_core.attention"
#: The modules compiled into the kernel and the padded gather, or defining their cached functions.
KERNEL_MODULES: Final = (
    "_kernel_jit",
    "_kernel_rows",
    "_kernel_ir",
    "_kernel_merge",
    "_kernel_entry",
    "_gather_jit",
    "_plan_jit",
    "_row_writes_jit",
)
_QUALIFIED: Final = frozenset(f"{_PACKAGE}.{name}" for name in KERNEL_MODULES)


@functools.cache
def sources_stamp() -> str:
    """A hash of the kernel's source files (16 hex digits): it changes with any of them;
    ``"unreadable"`` where they are not files on disk (a zip import: numba's own stamps and
    the versions then decide, as before)."""
    digest = hashlib.sha256()
    folder = Path(__file__).parent
    try:
        for name in KERNEL_MODULES:
            digest.update(name.encode())
            digest.update((folder / f"{name}.py").read_bytes())
    except OSError:
        return "unreadable"
    return digest.hexdigest()[:16]


class _KernelSourcesStamp:
    """A locator of numba's that serves the kernel's modules only, stamped with every kernel
    source (mixed in front of one of numba's locator classes)."""

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Any:
        if getattr(py_func, "__module__", None) not in _QUALIFIED:
            return None
        parent: Any = super()
        return parent.from_function(py_func, py_file)

    def get_source_stamp(self) -> Any:
        parent: Any = super()
        return (parent.get_source_stamp(), sources_stamp())


@functools.cache
def register_locators() -> bool:
    """Put the kernel's locators in front of numba's user-provided, in-tree and user-wide
    ones (once); ``False`` where this numba has none of those (each file's own stamp then
    applies, as before)."""
    try:
        from numba.core import caching  # a kernel module imports numba anyway
    except ImportError:
        return False
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    impl: Any = getattr(caching, "CacheImpl", None)
    locators: list[Any] | None = getattr(impl, "_locator_classes", None)
    if not isinstance(locators, list) or not all(hasattr(caching, name) for name in names):
        return False
    for name in names:
        base: Any = getattr(caching, name)
        if base in locators:
            mixed = type(f"KernelSources{name}", (_KernelSourcesStamp, base), {})
            locators.insert(locators.index(base), mixed)
    return True
