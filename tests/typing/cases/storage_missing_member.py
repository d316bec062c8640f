"""Must be rejected: a storage without ``copy_blocks`` is not a ``KvStorage``."""

from __future__ import annotations

from kvcache_core import CacheConfig, KvStorage
from kvcache_core.backends.numpy import NumpyArray, NumpyStorage


class NoCopyStorage:
    """Delegates everything but ``copy_blocks``."""

    def __init__(self, config: CacheConfig) -> None:
        inner = NumpyStorage(config)
        self.config = inner.config
        self.key_cache = inner.key_cache
        self.value_cache = inner.value_cache
        self.write = inner.write
        self.gather = inner.gather
        self.blocks_to_host = inner.blocks_to_host
        self.blocks_from_host = inner.blocks_from_host
        self.paged_attention = inner.paged_attention
        self.array_info = inner.array_info
        self.from_numpy = inner.from_numpy
        self.to_numpy = inner.to_numpy
        self.array_namespace = inner.array_namespace


storage: KvStorage[NumpyArray] = NoCopyStorage(CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=8))
