"""Helpers shared by the JAX backend's tests: one ``make_manager`` over a ``JaxStorage``.

A support module, not a test file: it holds no tests, and test files import from it (never
from one another)."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

from typing import Any

import jax

from kvcache_core import PagedKvCacheManager
from kvcache_jax import JaxStorage
from tests.core.support import make_config

Manager = PagedKvCacheManager[jax.Array]


def make_manager(dtype: str = "float32", kv_layout: str = "NHD", *, num_blocks: int = 12, **fields: Any) -> Manager:
    """A manager over a ``JaxStorage`` of ``tests.core.support.make_config`` (2 layers, 2 heads
    of size 4, blocks of 4 tokens by default); ``fields`` are more ``CacheConfig`` fields."""
    config = make_config(num_blocks, 4, enable_prefix_caching=False, dtype=dtype, kv_layout=kv_layout, **fields)
    return PagedKvCacheManager(JaxStorage(config), backend="jax")


def storage_of(manager: Manager) -> JaxStorage:
    """``manager``'s storage, a ``JaxStorage``."""
    storage = manager.storage
    assert isinstance(storage, JaxStorage)
    return storage
