"""Old module paths that keep importing, with a :class:`DeprecationWarning` naming the new home.

Core's modules moved into subpackages in 0.3.0 (``kvcache_core.config`` is now
``kvcache_core.contract.config``, ...). A finder on :data:`sys.meta_path` answers an import of
an old path with the module at its new path (the same module object, so classes and state are
shared) and warns once per old path. Remove an entry one minor version after it moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED_MODULES", "install"]

#: old module path -> new module path, with the version that moved it.
MOVED_MODULES: dict[str, str] = {
    f"kvcache_core.{old}": f"kvcache_core.{new}"
    for old, new in {
        "scalars": "contract.scalars",
        "device": "contract.device",
        "config": "contract.config",
        "groups": "contract.groups",
        "stats": "contract.stats",
        "block_table": "contract.block_table",
        "page_table": "contract.page_table",
        "protocols": "contract.protocols",
        "hookspecs": "contract.hookspecs",
        "quantization": "contract.quantization",
        "attention_features": "attention.features",
        "paged_kernel": "attention.kernel",
        "prefix": "paging.prefix",
        "allocator": "paging.allocator",
        "block_pool": "paging.block_pool",
        "chains": "paging.chains",
        "sequences": "paging.sequences",
        "checks": "paging.checks",
        "audit": "paging.audit",
        "figures": "paging.figures",
        "events": "offload.events",
        "event_publisher": "offload.publisher",
        "tiers": "offload.tiers",
        "guarded_tiers": "offload.guarded_tiers",
        "tier_chain": "offload.tier_stack",
        "persist": "offload.prefix_file",
        "cache_file_header": "offload.file_header",
        "file_tensors": "offload.file_tensors",
        "host_form": "offload.host_form",
        "safe_files": "offload.safe_files",
        "strict_json": "offload.strict_json",
        "numpy_backend": "backends.numpy",
        "demo": "cli.demo",
    }.items()
}

#: Where a moved module's import was asked for, so a warning points at the caller.
_IMPORT_FRAMES = ("<frozen importlib", __file__)


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self._new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self._new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        warnings.warn(
            f"{fullname} moved to {new} in kvcache-core 0.3.0; import it from there (the old path goes away in 0.4.0)",
            DeprecationWarning,
            stacklevel=_caller_level(),
        )
        return importlib.machinery.ModuleSpec(fullname, _Loader(new))


def _caller_level() -> int:
    """The stack level of the first frame outside the import machinery and this module."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_IMPORT_FRAMES):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def install() -> None:
    """Put the finder on :data:`sys.meta_path` once."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
