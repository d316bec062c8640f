"""Must be rejected: a handle class without ``cache_id`` is not a KvCacheHandle."""

from __future__ import annotations

from kvcache_core import BlockTable, Device, KvCacheHandle
from kvcache_core.backends.numpy import NumpyArray
from kvcache_core.contract.stats import CacheHandleStats


class IncompleteHandle:
    def block_table(self) -> BlockTable:
        return BlockTable(16)

    def block_table_mut(self) -> BlockTable:
        return BlockTable(16)

    def as_any(self) -> object:
        return self

    def device(self) -> Device:
        return Device("cpu")

    def num_layers(self) -> int:
        return 1

    def num_heads(self) -> int:
        return 1

    def head_dim(self) -> int:
        return 1

    def key_cache(self, layer: int) -> NumpyArray | None:
        return None

    def value_cache(self, layer: int) -> NumpyArray | None:
        return None

    def kv_cache(self, layer: int) -> tuple[NumpyArray | None, NumpyArray | None]:
        return (None, None)

    def clone_handle(self) -> IncompleteHandle:
        return self

    def stats(self) -> CacheHandleStats:
        return CacheHandleStats(0, 0, 0, 0.0, 0.0)

    def is_valid(self) -> bool:
        return True

    def num_tokens(self) -> int:
        return 0


handle: KvCacheHandle[NumpyArray] = IncompleteHandle()
