"""kvcache-memmap: the key/value pool in a memory-mapped file.

A cache can exceed RAM (the operating system pages blocks in and out) and outlive the
process: reopen the same file with ``mode="r+"`` and the K/V written before are there.
The storage reuses the NumPy reference kernels of kvcache-core over the mapped array.
A live pool locks its path (a second opener gets :class:`PoolLockedError`); ``close()``
releases it.

Registered only through the ``kvcache_core.backends`` entry point named ``memmap``::

    from kvcache_core import CacheConfig, create_manager
    manager = create_manager("memmap", config, path="cache.kv")
"""

from __future__ import annotations

from kvcache_memmap.errors import PoolLockedError, PoolPathError, PoolPathIsADirectoryError, PoolPathNotFoundError
from kvcache_memmap.storage import MemmapStorage, kvcache_register_backends

__all__ = [
    "MemmapStorage",
    "PoolLockedError",
    "PoolPathError",
    "PoolPathIsADirectoryError",
    "PoolPathNotFoundError",
    "kvcache_register_backends",
]
__version__ = "0.3.0"
