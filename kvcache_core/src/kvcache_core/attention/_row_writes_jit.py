"""The compiled copy of a step's new tokens' rows into a layer's key and value pools, one
call for both (:mod:`kvcache_core.attention.row_writes` is its typed face).

Everything but the slots comes as integers (addresses, counts, strides in bytes): numba
types an integer quicker than an array, and inside a model each lookup costs several times
what it costs in a loop. Nothing here checks anything: the typed face's
:class:`~kvcache_core.attention.row_writes.PoolWriter` checked the pools once, its caller
vouches for the sources and the slots.
"""

from __future__ import annotations

# numba publishes no type information: the decorated functions are untyped by nature.
# pyright: reportUntypedFunctionDecorator=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownMemberType=false
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
import numpy as np
from numba import njit
from numba.np.numpy_support import carray

from kvcache_core.attention._kernel_cache import register_locators
from kvcache_core.attention._kernel_ir import address_pointer

# Before any decorator: the cached functions' locators stamp every kernel source.
register_locators()

__all__ = ["write_rows"]


@njit(cache=True, nogil=True, inline="always")
def _copy_part(source, pool, slots, count, heads, row_bytes, block_size, strides):  # type: ignore[no-untyped-def]
    """Rows ``[count, heads, row_bytes]`` (C-contiguous, from address ``source``) into the pool
    at ``pool``: token ``t``, head ``h`` at ``slots[t] // block_size * strides[0] + slots[t] %
    block_size * strides[1] + h * strides[2]`` bytes, in 32-bit words where the rows are whole
    words (as every float32 row is, and every 16-bit row of an even width)."""
    words = row_bytes % 4 == 0
    unit = 4 if words else 1
    width = row_bytes // unit
    for t in range(count):
        slot = slots[t]
        block = slot // block_size
        at = pool + block * strides[0] + (slot - block * block_size) * strides[1]
        for h in range(heads):
            target = at + h * strides[2]
            start = source + (t * heads + h) * row_bytes
            if words:
                into = carray(address_pointer(target, np.uint32), (width,))
                taken = carray(address_pointer(start, np.uint32), (width,))
                for i in range(width):
                    into[i] = taken[i]
            else:
                into_bytes = carray(address_pointer(target, np.uint8), (width,))
                taken_bytes = carray(address_pointer(start, np.uint8), (width,))
                for i in range(width):
                    into_bytes[i] = taken_bytes[i]


@njit(cache=True, nogil=True)
def write_rows(  # type: ignore[no-untyped-def]
    keys,
    values,
    slots,
    key_pool,
    value_pool,
    limit,
    heads,
    key_bytes,
    value_bytes,
    block_size,
    key_strides,
    value_strides,
):
    """Copy ``count`` tokens' key rows (at address ``keys``) and value rows (``values``) into
    the pools at ``key_pool`` and ``value_pool``, at the slots ``slots`` (int64, one per
    token); ``key_strides`` and ``value_strides`` are ``(block, token in block,
    head)`` in bytes. Returns the position of the first slot outside ``[0, limit)``, having
    written nothing, or -1 once every row is written."""
    count = slots.shape[0]
    for t in range(count):
        if slots[t] < 0 or slots[t] >= limit:
            return t
    _copy_part(keys, key_pool, slots, count, heads, key_bytes, block_size, key_strides)
    _copy_part(values, value_pool, slots, count, heads, value_bytes, block_size, value_strides)
    return -1
