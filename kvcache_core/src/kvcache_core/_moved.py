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

__all__ = ["MOVED_ATTRIBUTES", "MOVED_MODULES", "MOVED_NAMES", "install", "moved_attribute", "moved_name"]

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

#: Names that left the top-level face ``kvcache_core``: name -> (new module, attribute there,
#: the version that moved it). Those of 0.2.0 left without a warning; they are back, warning.
MOVED_NAMES: dict[str, tuple[str, str, str]] = {
    "AllBlocksCleared": ("kvcache_core.offload.events", "AllBlocksCleared", "0.3.0"),
    "ArrayTypeError": ("kvcache_core.errors", "ArrayTypeError", "0.3.0"),
    "BackendConflictError": ("kvcache_core.errors", "BackendConflictError", "0.3.0"),
    "BackendInfo": ("kvcache_core.discovery", "BackendInfo", "0.3.0"),
    "BackendNotFoundError": ("kvcache_core.errors", "BackendNotFoundError", "0.3.0"),
    "BackendSpec": ("kvcache_core.plugin", "BackendSpec", "0.3.0"),
    "BackendUnavailableError": ("kvcache_core.errors", "BackendUnavailableError", "0.3.0"),
    "BlockAllocator": ("kvcache_core.paging.allocator", "BlockAllocator", "0.2.0"),
    "BlockEvictor": ("kvcache_core.paging.prefix", "BlockEvictor", "0.2.0"),
    "BlockRemoved": ("kvcache_core.offload.events", "BlockRemoved", "0.3.0"),
    "BlockRun": ("kvcache_core.contract.block_table", "BlockRun", "0.3.0"),
    "BlockStored": ("kvcache_core.offload.events", "BlockStored", "0.3.0"),
    "CAPABILITIES": ("kvcache_core.plugin", "CAPABILITIES", "0.3.0"),
    "CacheEvent": ("kvcache_core.offload.events", "CacheEvent", "0.3.0"),
    "CacheFileError": ("kvcache_core.errors", "CacheFileError", "0.3.0"),
    "CacheGcStats": ("kvcache_core.contract.stats", "CacheGcStats", "0.3.0"),
    "CacheHandleStats": ("kvcache_core.contract.stats", "CacheHandleStats", "0.3.0"),
    "CorruptCacheFileError": ("kvcache_core.errors", "CorruptCacheFileError", "0.3.0"),
    "DTYPE_SIZES": ("kvcache_core.plugin", "DTYPE_SIZES", "0.3.0"),
    "DTypeMismatchError": ("kvcache_core.errors", "DTypeMismatchError", "0.3.0"),
    "DuplicateRequestError": ("kvcache_core.errors", "DuplicateRequestError", "0.3.0"),
    "ENTRY_POINT_GROUP": ("kvcache_core.plugin", "ENTRY_POINT_GROUP", "0.3.0"),
    "ForeignHandleError": ("kvcache_core.errors", "ForeignHandleError", "0.3.0"),
    "FreeBlockQueue": ("kvcache_core.paging.allocator", "FreeBlockQueue", "0.2.0"),
    "IncompatibleCacheFileError": ("kvcache_core.errors", "IncompatibleCacheFileError", "0.3.0"),
    "InsufficientBlocksError": ("kvcache_core.errors", "InsufficientBlocksError", "0.3.0"),
    "InvalidConfigError": ("kvcache_core.errors", "InvalidConfigError", "0.3.0"),
    "InvalidHandleError": ("kvcache_core.errors", "InvalidHandleError", "0.3.0"),
    "InvalidTypeError": ("kvcache_core.errors", "InvalidTypeError", "0.3.0"),
    "InvariantError": ("kvcache_core.errors", "InvariantError", "0.3.0"),
    "KV_LAYOUTS": ("kvcache_core.plugin", "KV_LAYOUTS", "0.3.0"),
    "KvCachePluginWarning": ("kvcache_core.plugin", "KvCachePluginWarning", "0.3.0"),
    "KvGroup": ("kvcache_core.contract.groups", "KvGroup", "0.3.0"),
    "LayerIndexError": ("kvcache_core.errors", "LayerIndexError", "0.3.0"),
    "MAX_TOKEN_ID": ("kvcache_core.contract.config", "MAX_TOKEN_ID", "0.3.0"),
    "NotSwappedOutError": ("kvcache_core.errors", "NotSwappedOutError", "0.3.0"),
    "PrefixCache": ("kvcache_core.paging.prefix", "PrefixCache", "0.2.0"),
    "QUANTIZED_DTYPES": ("kvcache_core.plugin", "QUANTIZED_DTYPES", "0.3.0"),
    "ShapeMismatchError": ("kvcache_core.errors", "ShapeMismatchError", "0.3.0"),
    "SharedBlockWriteError": ("kvcache_core.errors", "SharedBlockWriteError", "0.3.0"),
    "SlotError": ("kvcache_core.errors", "SlotError", "0.3.0"),
    "StalePageTableError": ("kvcache_core.errors", "StalePageTableError", "0.3.0"),
    "StaleStepError": ("kvcache_core.errors", "StaleStepError", "0.3.0"),
    "SwappedOutError": ("kvcache_core.errors", "SwappedOutError", "0.3.0"),
    "TierError": ("kvcache_core.errors", "TierError", "0.3.0"),
    "decode_indptr": ("kvcache_core.attention", "decode_indptr", "0.2.0"),
    "get_backend": ("kvcache_core.discovery", "get_backend", "0.3.0"),
    "get_plugin_manager": ("kvcache_core.discovery", "get_plugin_manager", "0.2.0"),
    "hash_block": ("kvcache_core.paging.prefix", "hash_block", "0.2.0"),
    "hookimpl": ("kvcache_core.plugin", "hookimpl", "0.3.0"),
    "hookspec": ("kvcache_core.contract.hookspecs", "hookspec", "0.2.0"),
    "installed_backends": ("kvcache_core.discovery", "installed_backends", "0.3.0"),
    "paged_attention": ("kvcache_core.plugin", "paged_attention", "0.2.0"),
    "refresh_backends": ("kvcache_core.discovery", "refresh_backends", "0.3.0"),
}


#: Names that left a module that stays: module -> {name: (new module, the version that moved it)}.
MOVED_ATTRIBUTES: dict[str, dict[str, tuple[str, str]]] = {
    "kvcache_core.handle": {
        "RequestState": ("kvcache_core.paging.request_state", "0.3.0"),
        "SwapRecord": ("kvcache_core.paging.request_state", "0.3.0"),
        "next_generation": ("kvcache_core.paging.request_state", "0.3.0"),
    },
}


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
            stacklevel=2,  # warnings skips the import machinery's frames: 2 is the importer
        )
        return importlib.machinery.ModuleSpec(fullname, _Loader(new))


def moved_name(name: str) -> object:
    """The value of a name that left ``kvcache_core``, with a :class:`DeprecationWarning`.

    Raises:
        AttributeError: ``kvcache_core`` has no such name, moved or not.
    """
    try:
        module, attribute, since = MOVED_NAMES[name]
    except KeyError:
        raise AttributeError(f"module 'kvcache_core' has no attribute {name!r}") from None
    warnings.warn(
        f"kvcache_core.{name} moved to {module}.{attribute} in kvcache-core {since}; import it from "
        "there (kvcache_core keeps it until 0.4.0)",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(module), attribute)


def moved_attribute(module: str, name: str) -> object:
    """For a module's ``__getattr__``: the value of a name that left ``module``, with a
    :class:`DeprecationWarning` naming its new home.

    Raises:
        AttributeError: ``module`` has no such name, moved or not.
    """
    moved = MOVED_ATTRIBUTES.get(module, {}).get(name)
    if moved is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new, since = moved
    warnings.warn(
        f"{module}.{name} moved to {new}.{name} in kvcache-core {since}; import it from there "
        f"({module} keeps it until 0.4.0)",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(new), name)


def install() -> None:
    """Put the finder on :data:`sys.meta_path` once."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
