"""Must type-check cleanly: every backend's storage satisfies ``KvStorage`` without inheriting it."""

from __future__ import annotations

from kvcache_core import CacheConfig, KvStorage, LayerSpec
from kvcache_core.backends.layered import LayeredStorage
from kvcache_core.backends.numpy import NumpyArray, NumpyStorage
from kvcache_memmap import MemmapStorage

config = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=8)
numpy_storage: KvStorage[NumpyArray] = NumpyStorage(config)
memmap_storage: KvStorage[NumpyArray] = MemmapStorage(config)
mixed = CacheConfig(
    num_layers=2, num_heads=1, head_dim=4, num_blocks=8, layer_specs=[LayerSpec(), LayerSpec(head_dim=8)]
)
layered_storage: KvStorage[NumpyArray] = LayeredStorage(mixed.storage_config(), NumpyStorage)


def jax_storage_conforms() -> None:
    import jax

    from kvcache_jax import JaxStorage

    storage: KvStorage[jax.Array] = JaxStorage(config)
    del storage


def torch_storage_conforms() -> None:
    import torch

    from kvcache_torch import TorchStorage

    storage: KvStorage[torch.Tensor] = TorchStorage(config)
    del storage
