"""Blocks a transport filled from outside (a one-sided read into the pool's memory regions),
recorded as if every layer had been written there, in every KV-cache group.

A sliding group holds only the blocks its window still sees (from its table's first logical
block on): those are the ones recorded; the blocks it released are nobody's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcache_core.errors import InvalidArgumentError
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.chains import PrefixChains
from kvcache_core.paging.checks import ArgumentChecks
from kvcache_core.paging.request_state import RequestState

__all__ = ["record_transported"]


def record_transported(
    pool: BlockPool, chains: PrefixChains, checks: ArgumentChecks, state: RequestState[Any], start: int
) -> None:
    """Record the request's positions ``start`` to its end written in every layer of every
    group that holds them (prefix caching then registers the full blocks).

    Raises:
        InvalidArgumentError: ``start`` is not a block boundary in ``[0, num_tokens())``.
        SharedBlockWriteError: one of the blocks is shared or served by the prefix cache.
    Nothing is recorded when one of these is raised.
    """
    block_size = pool.config.block_size
    length = state.table.sequence_length
    if not (type(start) is int and 0 <= start < length and start % block_size == 0):
        raise InvalidArgumentError(
            f"start must be a multiple of block_size {block_size} in [0, {length}), got {start!r}"
        )
    held = [
        table.slots(first, length)
        for table in state.tables
        if (first := max(start, table.first_logical * block_size)) < length
    ]
    slots = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
    checks.writable(slots)
    written = pool.written
    if written is not None:
        written[:, slots] = True
        chains.after_write(np.unique(slots // block_size))
