"""kvcache-core: the paged key/value cache of transformer inference.

The public names a user needs: the contract (:class:`KvCacheHandle`, :class:`KvCacheManager`,
:class:`KvStorage`, :class:`BlockTable`), the values (:class:`CacheConfig`,
:class:`AllocationRequest`, :class:`PageTable`, the stats), the manager and its
:class:`Step`, discovery (:func:`create_manager`, :class:`BackendSpec`) and the errors.
Internals stay importable from their modules: the allocator (``kvcache_core.paging.allocator``), the
prefix cache and its hash (``kvcache_core.paging.prefix``), the NumPy reference attention
(``kvcache_core.attention.reference``), pluggy plumbing (``kvcache_core.discovery``,
``kvcache_core.contract.hookspecs``)::

    from kvcache_core import AllocationRequest, CacheConfig, create_manager

    manager = create_manager("numpy", CacheConfig(num_layers=2, num_heads=4, head_dim=64, num_blocks=256))
    handle = manager.allocate(AllocationRequest("req-1", initial_tokens=10))
    slots = manager.extend(handle, 10)
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from kvcache_core.contract.block_table import BlockRun, BlockTable
from kvcache_core.contract.config import (
    DTYPE_SIZES,
    KV_LAYOUTS,
    MAX_TOKEN_ID,
    QUANTIZED_DTYPES,
    AllocationRequest,
    CacheConfig,
)
from kvcache_core.contract.device import Device
from kvcache_core.contract.groups import KvGroup, LayerSpec
from kvcache_core.contract.hookspecs import CAPABILITIES, BackendSpec, hookimpl
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvCacheHandle, KvCacheManager, KvStorage
from kvcache_core.contract.stats import CacheGcStats, CacheHandleStats, CacheManagerStats, MemoryPressure
from kvcache_core.discovery import (
    ENTRY_POINT_GROUP,
    BackendInfo,
    available_backends,
    create_manager,
    get_backend,
    installed_backends,
    refresh_backends,
)
from kvcache_core.errors import (
    ArrayTypeError,
    BackendConflictError,
    BackendNotFoundError,
    BackendUnavailableError,
    CacheFileError,
    CorruptCacheFileError,
    DTypeMismatchError,
    DuplicateRequestError,
    ForeignHandleError,
    IncompatibleCacheFileError,
    InsufficientBlocksError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidHandleError,
    InvalidTypeError,
    InvariantError,
    KvCacheError,
    KvCachePluginWarning,
    LayerIndexError,
    ManagerClosedError,
    NotSwappedOutError,
    OutOfBlocksError,
    SequenceTooLongError,
    ShapeMismatchError,
    SharedBlockWriteError,
    SlotError,
    StalePageTableError,
    StaleStepError,
    SwappedOutError,
    TierError,
    UnknownRequestError,
    UnsupportedConfigError,
)
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.events import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlockIndex, CacheEvent
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier, TierStats
from kvcache_core.step import Step

try:
    __version__ = version("kvcache-core")
except PackageNotFoundError:  # running from an uninstalled tree
    __version__ = "0+unknown"

__all__ = [
    "DTYPE_SIZES",
    "QUANTIZED_DTYPES",
    "ENTRY_POINT_GROUP",
    "KV_LAYOUTS",
    "MAX_TOKEN_ID",
    "AllocationRequest",
    "ArrayTypeError",
    "BackendConflictError",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendSpec",
    "BackendUnavailableError",
    "CAPABILITIES",
    "BlockRun",
    "BlockTable",
    "CacheConfig",
    "KvGroup",
    "LayerSpec",
    "CacheGcStats",
    "CacheHandleStats",
    "CacheManagerStats",
    "DTypeMismatchError",
    "Device",
    "DuplicateRequestError",
    "ForeignHandleError",
    "InsufficientBlocksError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvalidHandleError",
    "InvalidTypeError",
    "InvariantError",
    "KvCacheError",
    "KvCacheHandle",
    "KvCacheManager",
    "KvCachePluginWarning",
    "KvStorage",
    "LayerIndexError",
    "ManagerClosedError",
    "MemoryPressure",
    "NotSwappedOutError",
    "OutOfBlocksError",
    "PageTable",
    "PagedKvCacheHandle",
    "PagedKvCacheManager",
    "SequenceTooLongError",
    "ShapeMismatchError",
    "SharedBlockWriteError",
    "SlotError",
    "StalePageTableError",
    "Step",
    "StaleStepError",
    "SwappedOutError",
    "UnknownRequestError",
    "UnsupportedConfigError",
    "__version__",
    "available_backends",
    "create_manager",
    "get_backend",
    "hookimpl",
    "installed_backends",
    "refresh_backends",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "CachedBlockIndex",
    "CacheFileError",
    "CorruptCacheFileError",
    "IncompatibleCacheFileError",
    "TierError",
    "DiskTier",
    "HostTier",
    "OffloadTier",
    "TierStats",
]
