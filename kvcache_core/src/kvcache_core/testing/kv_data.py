"""The K/V the kit's cases write and read back, in one place.

:func:`keyed_kv` is K/V decided by a key alone (the same key gives the same values in
every process and on every backend), exact in every float dtype; :func:`sevens` is a
native array full of 7s, unlike anything a pool holds; :func:`pool_hashes` is what the
pool's prefix cache holds (the ``"pool"`` medium of the events).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing import inspect
from kvcache_core.testing.backend import BackendUnderTest

__all__ = ["keyed_kv", "pool_hashes", "sevens"]

FloatArray = npt.NDArray[np.float64]


def keyed_kv(key: object, shape: tuple[int, ...]) -> tuple[FloatArray, FloatArray]:
    """Keys and values of ``shape`` decided by ``key`` alone: a SHA-256 of its ``repr``
    seeds the draw, and every value is a multiple of 1/8 (exact in every float dtype)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    pair = np.round(rng.standard_normal((2, *shape)) * 8) / 8
    return pair[0], pair[1]


def sevens(manager: PagedKvCacheManager[Any], shape: tuple[int, ...], dtype: str | None = None) -> Any:
    """A native array of ``shape`` full of 7s, of ``dtype`` (the pool's by default) on the
    pool's device: unlike anything the kit writes into a pool."""
    return BackendUnderTest.native(manager, np.full(shape, 7.0), dtype)


def pool_hashes(manager: PagedKvCacheManager[Any]) -> frozenset[bytes]:
    """The block hashes ``manager``'s prefix cache holds (none without prefix caching)."""
    return inspect.pool_hashes(manager)
