"""Must type-check cleanly: the NumPy backend satisfies the Protocols without inheriting."""

from __future__ import annotations

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    KvCacheHandle,
    KvCacheManager,
    KvStorage,
    PagedKvCacheManager,
    create_manager,
)
from kvcache_core.backends.numpy import NumpyArray, NumpyStorage

config = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=8)
storage: KvStorage[NumpyArray] = NumpyStorage(config)
manager: KvCacheManager[NumpyArray] = create_manager("numpy", config)
concrete: PagedKvCacheManager[NumpyArray] = PagedKvCacheManager(storage)
handle: KvCacheHandle[NumpyArray] = concrete.allocate(AllocationRequest("a"))
clone: KvCacheHandle[NumpyArray] = handle.clone_handle()
keys: NumpyArray | None = handle.key_cache(0)
