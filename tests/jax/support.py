"""Helpers shared by the JAX backend's tests: one ``make_manager`` over a ``JaxStorage``.

A support module, not a test file: it holds no tests, and test files import from it (never
from one another)."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvcache_core import CacheConfig, PagedKvCacheManager
from kvcache_jax import JaxStorage

Manager = PagedKvCacheManager[jax.Array]


def make_manager(dtype: str = "float32", kv_layout: str = "NHD", *, num_blocks: int = 12, **fields: Any) -> Manager:
    """A manager over a ``JaxStorage`` of 2 layers, 2 heads of size 4, blocks of 4 tokens;
    ``fields`` are more ``CacheConfig`` fields."""
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=num_blocks, block_size=4)
    config = dataclasses.replace(config, dtype=dtype, kv_layout=kv_layout, **fields)
    return PagedKvCacheManager(JaxStorage(config), backend="jax")


def storage_of(manager: Manager) -> JaxStorage:
    """``manager``'s storage, a ``JaxStorage``."""
    storage = manager.storage
    assert isinstance(storage, JaxStorage)
    return storage
