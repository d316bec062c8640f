"""kvcache-core: the paged key/value cache of transformer inference.

This is the user's face: the configuration values (:class:`CacheConfig`,
:class:`AllocationRequest`, :class:`LayerSpec`, :class:`Device`), :func:`create_manager` and
:func:`available_backends`, the manager, its :class:`Step` and handles, block and page tables,
the protocols, stats, offload tiers, the cached-block index of the event stream, the base
error and the errors a caller handles. Backend and tier authors use
:mod:`kvcache_core.plugin`; every error is in :mod:`kvcache_core.errors`; the parts live in
subpackages (``contract``, ``attention``, ``paging``, ``offload``, ``backends``), described in
ARCHITECTURE.md. Names that left this face keep importing from here for one minor version,
with a :class:`DeprecationWarning` naming their new home::

    from kvcache_core import AllocationRequest, CacheConfig, create_manager

    manager = create_manager("numpy", CacheConfig(num_layers=2, num_heads=4, head_dim=64, num_blocks=256))
    handle = manager.allocate(AllocationRequest("req-1", initial_tokens=10))
    slots = manager.extend(handle, 10)
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from kvcache_core import _moved
from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.device import Device
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvCacheHandle, KvCacheManager, KvStorage
from kvcache_core.contract.states import StateSpec
from kvcache_core.contract.stats import CacheManagerStats, MemoryPressure
from kvcache_core.discovery import available_backends, create_manager
from kvcache_core.errors import (
    InvalidArgumentError,
    KvCacheError,
    ManagerClosedError,
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownRequestError,
    UnsupportedConfigError,
)
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.events import CachedBlockIndex
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier, TierStats
from kvcache_core.step import Step

_moved.install()

try:
    __version__ = version("kvcache-core")
except PackageNotFoundError:  # running from an uninstalled tree
    __version__ = "0+unknown"

__all__ = [
    "AllocationRequest",
    "BlockTable",
    "CacheConfig",
    "CacheManagerStats",
    "CachedBlockIndex",
    "Device",
    "DiskTier",
    "HostTier",
    "InvalidArgumentError",
    "KvCacheError",
    "KvCacheHandle",
    "KvCacheManager",
    "KvStorage",
    "LayerSpec",
    "ManagerClosedError",
    "MemoryPressure",
    "OffloadTier",
    "OutOfBlocksError",
    "PageTable",
    "PagedKvCacheHandle",
    "PagedKvCacheManager",
    "SequenceTooLongError",
    "StateSpec",
    "Step",
    "TierStats",
    "UnknownRequestError",
    "UnsupportedConfigError",
    "__version__",
    "available_backends",
    "create_manager",
]


def __getattr__(name: str) -> object:
    """A name that left this face: its value from its new home, with a DeprecationWarning."""
    return _moved.moved_name(name)
