"""Filling a request's blocks from host copies: what a transport that moved a request's
blocks from another pool (:mod:`kvcache_core.transfer`) or a store calls to hand them to the
manager, as if every layer of those positions had been written.

The manager's public face, kept beside it (the manager composes its parts; this is one call
over them, under its lock).
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from kvcache_core.contract.protocols import KvCacheHandle
from kvcache_core.manager import PagedKvCacheManager

__all__ = ["record_blocks_written", "write_host_blocks"]


def write_host_blocks(
    manager: PagedKvCacheManager[Any],
    handle: KvCacheHandle[Any],
    start: int,
    keys: npt.NDArray[Any],
    values: npt.NDArray[Any],
) -> None:
    """Write ``keys`` and ``values`` in core's host form (:mod:`kvcache_core.offload.host_form`,
    ``[pool_layers, n, block_size, num_heads, width]``, whatever the pool's layout) into the
    ``n`` blocks that hold the request's positions ``start`` to ``num_tokens()``, bit for bit,
    and record every layer of them written: with prefix caching, their full blocks are
    registered (findable by later prompts) when the request's token ids are known (given to
    ``allocate`` or ``extend``). Grow the request first (``manager.extend``).

    Raises:
        UnsupportedConfigError: the pool has KV-cache groups, a sliding window or recurrent-state
            layers.
        InvalidArgumentError: ``start`` is not a block boundary in ``[0, num_tokens())``.
        ArrayTypeError, DTypeMismatchError, ShapeMismatchError: ``keys`` or ``values`` is not
            the host form of those blocks (nothing is cast).
        SharedBlockWriteError: one of the blocks is shared (fork, prefix hit) or cached.
        InvalidHandleError, SwappedOutError, ForeignHandleError, ManagerClosedError: as
            ``manager.extend``.
    Nothing is written when one of these is raised.
    """
    with manager._lock:  # pyright: ignore[reportPrivateUsage]
        state = manager._state_of(handle)  # pyright: ignore[reportPrivateUsage]
        manager._path.write_host_blocks(state, start, keys, values)  # pyright: ignore[reportPrivateUsage]


def record_blocks_written(manager: PagedKvCacheManager[Any], handle: KvCacheHandle[Any], start: int) -> None:
    """Record every layer of the request's positions ``start`` to ``num_tokens()`` written,
    their bytes having been written into its blocks through the storage's memory regions
    (:mod:`kvcache_core.contract.regions`, a one-sided read of a transport): as
    :func:`write_host_blocks`, without the copy.

    Raises:
        As :func:`write_host_blocks` (no array errors).
    """
    with manager._lock:  # pyright: ignore[reportPrivateUsage]
        state = manager._state_of(handle)  # pyright: ignore[reportPrivateUsage]
        manager._path.write_host_blocks(state, start, None, None)  # pyright: ignore[reportPrivateUsage]
