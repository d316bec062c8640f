"""How the compiled paged-attention kernel reads a pool's rows: their indices along a block
table, the prefetch of rows ahead, and the decode of 16-bit and quantized rows into float32
tiles.

Only :mod:`kvcache_core.attention._kernel_jit` imports this module (numba carries no type
information: the compiled functions are untyped by nature); nothing here checks anything.
"""

from __future__ import annotations

# pyright: reportUntypedFunctionDecorator=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownMemberType=false
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
import numpy as np
from numba import njit

from kvcache_core.attention._kernel_cache import register_locators
from kvcache_core.attention._kernel_ir import prefetch_at

# Before any decorator: the cached functions' locators stamp every kernel source.
register_locators()

__all__ = [
    "FASTMATH",
    "POOL_BFLOAT16",
    "POOL_FLOAT8",
    "POOL_FLOAT16",
    "POOL_FLOAT32",
    "POOL_INT8",
    "PREFETCH_KEYS",
    "decode_tile",
    "pool_rows",
    "prefetch_ahead",
]

#: Element kinds of a pool, as the kernel reads it.
POOL_FLOAT32 = 0
POOL_FLOAT16 = 1
POOL_BFLOAT16 = 2
#: Quantized pools, as their bytes: ``value = decoded byte * scale`` of the token head.
POOL_INT8 = 3
POOL_FLOAT8 = 4

#: How far ahead (in keys) the pool rows are prefetched: about two tiles' work covers a load
#: from memory (measured best at 64; none or a whole tile at once ran 1.7x slower).
PREFETCH_KEYS = 64

# Helpers are inlined: a call between compiled functions (reference counts of its array
# arguments) measured 10x the cost of the 4 x 128 products it made.
# Reassociation lets LLVM vectorise the dot products; no "nnan"/"ninf": -inf is a real value
# here (the running maximum before the first key).
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

_F16_TO_F32 = np.float32(2.0**112)  # a half's bits shifted into a float32, times this, is its value
_F16_OVERFLOW = np.float32(65536.0)  # ... and at least this for an infinity or NaN
_F8_TO_F32 = np.float32(2.0**120)  # an e4m3 byte's bits shifted into a float32, times this, is its value


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def pool_rows(block_row, first_key, keys, block_size, strides, scale_strides, head, rows_at, scales_at, scaled):  # type: ignore[no-untyped-def]
    """The pool rows (``rows_at``) and, where ``scaled``, the scale indices (``scales_at``)
    of keys ``[first_key, first_key + keys)`` of one head, following the block table row
    ``block_row``: block by block, each block's rows a progression (a vectorised loop)."""
    block_index = first_key // block_size
    offset = first_key - block_index * block_size
    head_row = head * strides[2]
    head_scale = head * scale_strides[2]
    c = 0
    while c < keys:
        block = block_row[block_index]
        run = min(block_size - offset, keys - c)
        first_row = block * strides[0] + offset * strides[1] + head_row
        for t in range(run):
            rows_at[c + t] = first_row + t * strides[1]
        if scaled:
            first_scale = block * scale_strides[0] + offset * scale_strides[1] + head_scale
            for t in range(run):
                scales_at[c + t] = first_scale + t * scale_strides[1]
        c += run
        offset = 0
        block_index += 1


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def decode_tile(pool, kind, rows_at, scales_at, first, keys, tile, bits, scales):  # type: ignore[no-untyped-def]
    """Decode the pool rows ``rows_at[first : first + keys]`` (16-bit or quantized bits) into
    ``tile [KEY_TILE, dim]`` float32 (``bits`` is its uint32 view)."""
    dim = tile.shape[1]
    for c in range(keys):
        row = rows_at[first + c]
        if kind >= POOL_INT8:  # POOL_INT8, POOL_FLOAT8
            row_scale = scales[scales_at[first + c]]
            if kind == POOL_INT8:
                for d in range(dim):  # the byte read as a signed int8
                    tile[c, d] = np.float32(np.int32(np.uint32(pool[row, d]) ^ np.uint32(128)) - np.int32(128))
            else:  # e4m3 without NaN (never written): exponent and mantissa shifted under float32's
                for d in range(dim):
                    byte = np.uint32(pool[row, d])
                    bits[c, d] = ((byte & np.uint32(0x7F)) << np.uint32(20)) | (
                        (byte & np.uint32(0x80)) << np.uint32(24)
                    )
                for d in range(dim):
                    tile[c, d] *= _F8_TO_F32
            for d in range(dim):
                tile[c, d] *= row_scale
        elif kind == POOL_BFLOAT16:
            for d in range(dim):
                bits[c, d] = np.uint32(pool[row, d]) << np.uint32(16)
        else:
            for d in range(dim):
                bits[c, d] = (np.uint32(pool[row, d]) & np.uint32(0x7FFF)) << np.uint32(13)
            for d in range(dim):
                tile[c, d] *= _F16_TO_F32  # exact for normal and subnormal halves
            for d in range(dim):
                extra = (np.uint32(pool[row, d]) & np.uint32(0x8000)) << np.uint32(16)
                if tile[c, d] >= _F16_OVERFLOW:
                    extra |= np.uint32(0x7F800000)
                bits[c, d] |= extra


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def prefetch_ahead(ahead, pool_rows, start, count, keys_too, values_too):  # type: ignore[no-untyped-def]
    """Prefetch the pool rows ``pool_rows[start : start + count]`` (below ``end``) of the
    key pool (``keys_too``) and the value pool (``values_too``); ``ahead = (in_place,
    key_address, value_address, key_row_bytes, value_row_bytes, end)``, the addresses of the
    pools read (the float32 pools where they are read in place, else their bits). Integers
    only: an array taken out of a tuple, or passed on, inside a loop costs atomic
    reference-count updates each time."""
    _, key_address, value_address, key_bytes, value_bytes, end = ahead
    for later in range(start, min(start + count, end)):
        row = pool_rows[later]
        if keys_too:
            prefetch_at(key_address, row, key_bytes)
        if values_too:
            prefetch_at(value_address, row, value_bytes)
