"""Must be rejected: a storage without ``copy_blocks`` is not a ``KvStorage``."""

from __future__ import annotations

from kvcache_core import CacheConfig, KvStorage
from kvcache_core.backends.numpy import NumpyArray
from kvcache_core.contract.protocols import BlockArray, SlotArray

from .numpy_delegate import DelegatingStorage


class NoCopyStorage(DelegatingStorage):
    """Delegates everything but ``copy_blocks``."""

    def write(self, layer: int, slots: SlotArray, keys: NumpyArray, values: NumpyArray) -> None:
        self._inner.write(layer, slots, keys, values)

    def gather(self, layer: int, blocks: BlockArray, num_tokens: int) -> tuple[NumpyArray, NumpyArray]:
        return self._inner.gather(layer, blocks, num_tokens)


storage: KvStorage[NumpyArray] = NoCopyStorage(CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=8))
