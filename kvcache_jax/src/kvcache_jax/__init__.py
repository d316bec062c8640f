"""kvcache-jax: the JAX backend of kvcache.

A paged K/V pool of ``jax.Array`` s updated in place by jitted programs that donate it,
jitted paged attention, and a pool sharded over KV heads on a ``jax.sharding.Mesh``::

    from kvcache_core import CacheConfig, create_manager

    manager = create_manager("jax", CacheConfig(num_layers=2, num_heads=8, head_dim=64, num_blocks=256))
    manager = create_manager("jax", config, mesh=jax.make_mesh((8,), ("model",)), axis="model")

The pure functions :func:`write` and :func:`paged_attention` take and return arrays, for
use inside your own ``jax.jit`` step. Importing this package imports no JAX; its names
load on first use (discovery imports :mod:`kvcache_jax.plugin` through this package).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcache_jax.attention import paged_attention
    from kvcache_jax.buckets import PaddedBatch, bucket, pad_batch
    from kvcache_jax.quantized import QuantizedJaxStorage
    from kvcache_jax.scatter import copy_blocks, gather, read_blocks, write, write_blocks
    from kvcache_jax.sharding import Placement
    from kvcache_jax.storage import JAX_DTYPES, DeletedPoolError, JaxStorage

try:
    __version__ = version("kvcache-jax")
except PackageNotFoundError:  # running from an uninstalled tree
    __version__ = "0+unknown"

#: Public name -> the module defining it (imported on first access).
_LAZY: dict[str, str] = {
    "JAX_DTYPES": "kvcache_jax.storage",
    "DeletedPoolError": "kvcache_jax.storage",
    "JaxStorage": "kvcache_jax.storage",
    "PaddedBatch": "kvcache_jax.buckets",
    "Placement": "kvcache_jax.sharding",
    "QuantizedJaxStorage": "kvcache_jax.quantized",
    "bucket": "kvcache_jax.buckets",
    "copy_blocks": "kvcache_jax.scatter",
    "gather": "kvcache_jax.scatter",
    "pad_batch": "kvcache_jax.buckets",
    "paged_attention": "kvcache_jax.attention",
    "read_blocks": "kvcache_jax.scatter",
    "write": "kvcache_jax.scatter",
    "write_blocks": "kvcache_jax.scatter",
}

__all__ = [
    "JAX_DTYPES",
    "DeletedPoolError",
    "JaxStorage",
    "PaddedBatch",
    "Placement",
    "QuantizedJaxStorage",
    "__version__",
    "bucket",
    "copy_blocks",
    "gather",
    "pad_batch",
    "paged_attention",
    "read_blocks",
    "write",
    "write_blocks",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcache_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
