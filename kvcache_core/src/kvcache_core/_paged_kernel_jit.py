"""The numba-compiled loops of the CPU paged-attention kernel.

numba carries no type information, so this module holds the compiled code only and
nothing imports it but :mod:`kvcache_core.paged_kernel`, the typed wrapper that checks,
plans and converts every argument. Nothing here validates anything: an index out of
range reads the wrong memory (bounds checks are off, as in any compiled kernel).

The wrapper attends every query of a batch for one layer in one call. Its work is a list
of items ``(request, kv_head, first_row, last_row, first_key, last_key, partial_row)``,
shared out among the threads; each thread runs :func:`attend_share` on its share
without the GIL. The rows of a ``(request, kv_head)`` pair
are its queries times the query heads of that KV head (``row = query * group + g``), so
each key and value row is read once for the whole group. An item walks its keys in
tiles of ``KEY_TILE`` following the block table, with an online softmax in float32: the
running maximum and sum of each row rescale its accumulator when the maximum grows.
An item with ``partial_row < 0`` writes its normalised rows into the output; otherwise
it is one KV split of a long context (FlashDecoding) and writes its unnormalised
accumulator, maximum and sum into the partial buffers, which :func:`merge_splits`
merges with a log-sum-exp.

Pools are flat 1-D views of one layer's K or V and element strides of (block, token in
block, head); the feature axis is contiguous. Each key tile's rows are copied (float32)
or decoded (``POOL_FLOAT16`` and ``POOL_BFLOAT16``, handed over as ``uint16`` bits) into
one float32 tile that stays in L1 while every query row reads it; the pool itself is
only read, never copied as a whole. A quantized pool (``POOL_INT8``, ``POOL_FLOAT8``:
int8 or float8 e4m3, handed over as ``uint8``) is decoded into the tile the same way, each
row times its token head's scale, so the dequantized values exist only in that tile. ``cache=True``: the compiled code
is kept on disk, so each machine compiles once (per pool element type).
"""

from __future__ import annotations

# numba publishes no type information: the decorated functions are untyped by nature.
# pyright: reportUntypedFunctionDecorator=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownMemberType=false
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
import math

import numpy as np
from numba import njit

__all__ = [
    "KEY_TILE",
    "POOL_BFLOAT16",
    "POOL_FLOAT8",
    "POOL_FLOAT16",
    "POOL_FLOAT32",
    "POOL_INT8",
    "ROW_TILE",
    "attend_share",
    "merge_splits",
]

#: Element kinds of a pool, as the kernel reads it.
POOL_FLOAT32 = 0
POOL_FLOAT16 = 1
POOL_BFLOAT16 = 2
#: Quantized pools, as their bytes: ``value = decoded byte * scale`` of the token head.
POOL_INT8 = 3
POOL_FLOAT8 = 4

#: Query rows attended together (their K/V rows are read once for all of them).
ROW_TILE = 16
#: Keys per online-softmax step: their K (then V) rows are copied or decoded into one float32
#: tile of ``KEY_TILE x head_dim`` (16 KiB at 128), read from L1 by every query row.
KEY_TILE = 32

# Helpers are inlined: a call between compiled functions (reference counts of its array
# arguments) measured 10x the cost of the 4 x 128 products it made.
# Reassociation lets LLVM vectorise the dot products; no "nnan"/"ninf": -inf is a real value
# here (the running maximum before the first key).
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

_F16_TO_F32 = np.float32(2.0**112)  # a half's bits shifted into a float32, times this, is its value
_F16_OVERFLOW = np.float32(65536.0)  # ... and at least this for an infinity or NaN
_F8_TO_F32 = np.float32(2.0**120)  # an e4m3 byte's bits shifted into a float32, times this, is its value


@njit(cache=True, nogil=True, fastmath=_FASTMATH, inline="always")
def _load_tile(  # type: ignore[no-untyped-def]
    pool,
    kind,
    block_row,
    request,
    first_key,
    keys,
    block_size,
    block_stride,
    token_stride,
    head_offset,
    tile,
    bits,
    scales,
    scale_strides,
    scale_head_offset,
):
    """Copy (float32) or decode (16-bit, quantized bytes) the rows of keys ``[first_key,
    first_key + keys)`` of one head into ``tile [KEY_TILE, dim]`` float32 (``bits`` is its
    uint32 view), following the block table row ``block_row``."""
    dim = tile.shape[1]
    block_index = first_key // block_size
    offset = first_key - block_index * block_size
    for c in range(keys):
        base = block_row[block_index] * block_stride + offset * token_stride + head_offset
        source = pool[base : base + dim]  # a slice: its indices are known non-negative, so loads vectorise
        target = tile[c]
        target_bits = bits[c]
        if kind == POOL_FLOAT32:
            for d in range(dim):
                target[d] = source[d]
        elif kind >= POOL_INT8:  # POOL_INT8, POOL_FLOAT8
            row_scale = scales[
                block_row[block_index] * scale_strides[0] + offset * scale_strides[1] + scale_head_offset
            ]
            if kind == POOL_INT8:
                for d in range(dim):  # the byte read as a signed int8
                    target[d] = np.float32(np.int32(np.uint32(source[d]) ^ np.uint32(128)) - np.int32(128))
            else:  # e4m3 without NaN (never written): exponent and mantissa shifted under float32's
                for d in range(dim):
                    byte = np.uint32(source[d])
                    target_bits[d] = ((byte & np.uint32(0x7F)) << np.uint32(20)) | (
                        (byte & np.uint32(0x80)) << np.uint32(24)
                    )
                for d in range(dim):
                    target[d] *= _F8_TO_F32
            for d in range(dim):
                target[d] *= row_scale
        elif kind == POOL_BFLOAT16:
            for d in range(dim):
                target_bits[d] = np.uint32(source[d]) << np.uint32(16)
        else:
            for d in range(dim):
                target_bits[d] = (np.uint32(source[d]) & np.uint32(0x7FFF)) << np.uint32(13)
            for d in range(dim):
                target[d] *= _F16_TO_F32  # exact for normal and subnormal halves
            for d in range(dim):
                extra = (np.uint32(source[d]) & np.uint32(0x8000)) << np.uint32(16)
                if target[d] >= _F16_OVERFLOW:
                    extra |= np.uint32(0x7F800000)
                target_bits[d] |= extra
        offset += 1
        if offset == block_size:
            offset = 0
            block_index += 1


@njit(cache=True, nogil=True, fastmath=_FASTMATH, inline="always")
def _attend_item(  # type: ignore[no-untyped-def]
    item,
    query,
    key_pool,
    value_pool,
    pool_kind,
    strides,
    block_tables,
    seq_lens,
    qo_indptr,
    group,
    block_size,
    scale,
    causal,
    window,
    out,
    partial_acc,
    partial_stats,
    queries,
    acc,
    scores,
    row_max,
    row_sum,
    row_low,
    row_high,
    tile,
    bits,
    features,
    scaling,
):
    """Attend the rows ``[item[2], item[3])`` of one ``(request, kv_head)`` over its keys
    ``[item[4], item[5])``; scratch buffers are the thread's. Attention features:
    ``features = (softcap, sinks, chunk)``: ``softcap`` (0: none), ``sinks [query_heads]``
    (empty: none), ``chunk`` (0: none); ``scaling = (key_scales, value_scales,
    scale_strides)`` of a quantized pool. (Packed in tuples: CPython compiles a call of
    more than 30 arguments as a ``*args`` call, which numba cannot inline.)"""
    softcap, sinks, chunk = features
    key_scales, value_scales, scale_strides = scaling
    request, head, first_row, last_row, first_key, last_key, partial_row = (
        item[0],
        item[1],
        item[2],
        item[3],
        item[4],
        item[5],
        item[6],
    )
    dim = query.shape[2]
    query_start = qo_indptr[request]
    num_queries = qo_indptr[request + 1] - query_start
    seq_len = seq_lens[request]
    block_stride, token_stride, head_stride = strides[0], strides[1], strides[2]
    head_offset = head * head_stride
    scale_head_offset = head * scale_strides[2]
    block_row = block_tables[request]
    for tile_row in range(first_row, last_row, ROW_TILE):
        rows = min(ROW_TILE, last_row - tile_row)
        low_all = last_key
        high_all = first_key
        for j in range(rows):
            r = tile_row + j
            q_index = r // group
            q_head = head * group + (r - q_index * group)
            position = seq_len - num_queries + q_index
            low, high = first_key, last_key
            if causal:
                high = min(high, position + 1)
            if window > 0:
                low = max(low, position - window + 1)
            if chunk > 0:  # chunked local attention: the query's own chunk only
                chunk_start = position // chunk * chunk
                low = max(low, chunk_start)
                high = min(high, chunk_start + chunk)
            row_low[j] = low
            row_high[j] = high
            low_all = min(low_all, low)
            high_all = max(high_all, high)
            for d in range(dim):
                queries[j, d] = query[query_start + q_index, q_head, d] * scale
                acc[j, d] = 0.0
            row_max[j] = -np.inf
            row_sum[j] = 0.0
        for tile_key in range(low_all, high_all, KEY_TILE):
            keys = min(KEY_TILE, high_all - tile_key)
            _load_tile(
                key_pool,
                pool_kind,
                block_row,
                request,
                tile_key,
                keys,
                block_size,
                block_stride,
                token_stride,
                head_offset,
                tile,
                bits,
                key_scales,
                scale_strides,
                scale_head_offset,
            )
            for c in range(keys):
                key_row = tile[c]
                j = 0
                while j + 4 <= rows:  # four rows per pass: each key element loaded once for them
                    q0, q1, q2, q3 = queries[j], queries[j + 1], queries[j + 2], queries[j + 3]
                    t0 = t1 = t2 = t3 = np.float32(0.0)
                    for d in range(dim):
                        k = key_row[d]
                        t0 += q0[d] * k
                        t1 += q1[d] * k
                        t2 += q2[d] * k
                        t3 += q3[d] * k
                    scores[j, c] = t0
                    scores[j + 1, c] = t1
                    scores[j + 2, c] = t2
                    scores[j + 3, c] = t3
                    j += 4
                while j < rows:
                    query_row = queries[j]
                    total = np.float32(0.0)
                    for d in range(dim):
                        total += query_row[d] * key_row[d]
                    scores[j, c] = total
                    j += 1
            for j in range(rows):
                low = max(row_low[j], tile_key) - tile_key
                high = min(row_high[j], tile_key + keys) - tile_key
                if low >= high:
                    for c in range(keys):
                        scores[j, c] = 0.0
                    continue
                if softcap > 0.0:  # logit softcapping, before the mask
                    inverse_cap = np.float32(1.0) / softcap
                    for c in range(low, high):
                        scores[j, c] = np.float32(math.tanh(scores[j, c] * inverse_cap)) * softcap
                new_max = row_max[j]
                for c in range(low, high):
                    new_max = max(new_max, scores[j, c])
                if new_max > row_max[j]:
                    shrink = np.float32(math.exp(row_max[j] - new_max))
                    row_sum[j] *= shrink
                    for d in range(dim):
                        acc[j, d] *= shrink
                    row_max[j] = new_max
                total = np.float32(0.0)
                for c in range(low):
                    scores[j, c] = 0.0
                for c in range(low, high):
                    weight = np.float32(math.exp(scores[j, c] - new_max))
                    scores[j, c] = weight
                    total += weight
                for c in range(high, keys):
                    scores[j, c] = 0.0
                row_sum[j] += total
            _load_tile(
                value_pool,
                pool_kind,
                block_row,
                request,
                tile_key,
                keys,
                block_size,
                block_stride,
                token_stride,
                head_offset,
                tile,
                bits,
                value_scales,
                scale_strides,
                scale_head_offset,
            )
            for c in range(keys):
                value_row = tile[c]
                j = 0
                while j + 4 <= rows:  # four rows per pass: each value element loaded once for them
                    w0, w1, w2, w3 = scores[j, c], scores[j + 1, c], scores[j + 2, c], scores[j + 3, c]
                    a0, a1, a2, a3 = acc[j], acc[j + 1], acc[j + 2], acc[j + 3]
                    for d in range(dim):
                        v = value_row[d]
                        a0[d] += w0 * v
                        a1[d] += w1 * v
                        a2[d] += w2 * v
                        a3[d] += w3 * v
                    j += 4
                while j < rows:
                    weight = scores[j, c]
                    if weight != 0.0:
                        acc_row = acc[j]
                        for d in range(dim):
                            acc_row[d] += weight * value_row[d]
                    j += 1
        for j in range(rows):
            r = tile_row + j
            if partial_row < 0:
                q_index = r // group
                q_head = head * group + (r - q_index * group)
                total = row_sum[j]
                if sinks.shape[0] > 0:  # the sink joins the denominator, adds no value
                    total += np.float32(math.exp(sinks[q_head] - row_max[j]))
                inverse = np.float32(1.0) / total
                for d in range(dim):
                    out[query_start + q_index, q_head, d] = acc[j, d] * inverse
            else:
                target = partial_row + r - first_row
                for d in range(dim):
                    partial_acc[target, d] = acc[j, d]
                partial_stats[target, 0] = row_max[j]
                partial_stats[target, 1] = row_sum[j]


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def attend_share(  # type: ignore[no-untyped-def]
    query,
    key_pool,
    value_pool,
    pool_kind,
    strides,
    block_tables,
    seq_lens,
    qo_indptr,
    items,
    group,
    block_size,
    scale,
    causal,
    window,
    out,
    partial_acc,
    partial_stats,
    softcap,
    sinks,
    chunk,
    key_scales,
    value_scales,
    scale_strides,
):
    """Run the items ``items [n, 7]`` int64 (one thread's share) in order, without the GIL.

    ``query [tokens, query_heads, dim]`` and ``out`` (same shape) are float32;
    ``partial_acc [p, dim]`` and ``partial_stats [p, 2]`` (maximum, sum) float32; the
    attention features ``softcap`` (float, 0: none), ``sinks [query_heads]`` float32
    (empty: none) and ``chunk`` (int, 0: none). For
    ``POOL_INT8`` and ``POOL_FLOAT8``: ``key_scales``/``value_scales`` flat float32 scales with
    element strides ``scale_strides`` (block, token, head); other kinds ignore them."""
    dim = query.shape[2]
    queries = np.empty((ROW_TILE, dim), np.float32)
    acc = np.empty((ROW_TILE, dim), np.float32)
    scores = np.empty((ROW_TILE, KEY_TILE), np.float32)
    row_max = np.empty(ROW_TILE, np.float32)
    row_sum = np.empty(ROW_TILE, np.float32)
    row_low = np.empty(ROW_TILE, np.int64)
    row_high = np.empty(ROW_TILE, np.int64)
    bits = np.empty((KEY_TILE, dim), np.uint32)
    tile = bits.view(np.float32)
    for position in range(items.shape[0]):
        _attend_item(
            items[position],
            query,
            key_pool,
            value_pool,
            pool_kind,
            strides,
            block_tables,
            seq_lens,
            qo_indptr,
            group,
            block_size,
            scale,
            causal,
            window,
            out,
            partial_acc,
            partial_stats,
            queries,
            acc,
            scores,
            row_max,
            row_sum,
            row_low,
            row_high,
            tile,
            bits,
            (softcap, sinks, chunk),
            (key_scales, value_scales, scale_strides),
        )


@njit(cache=True, nogil=True, fastmath=_FASTMATH)
def merge_splits(qo_indptr, merges, group, out, partial_acc, partial_stats, sinks):  # type: ignore[no-untyped-def]
    """Merge the KV splits with a log-sum-exp: ``merges [m, 5]`` int64 rows ``(request,
    kv_head, rows, first_partial_row, splits)``, split ``s`` of row ``r`` at partial row
    ``first + s * rows + r``; the normalised rows go into ``out``. ``sinks
    [query_heads]`` (empty: none) join each row's denominator."""
    dim = out.shape[2]
    merged = np.empty(dim, np.float32)
    for merge in range(merges.shape[0]):
        request, head, rows, first, splits = (
            merges[merge, 0],
            merges[merge, 1],
            merges[merge, 2],
            merges[merge, 3],
            merges[merge, 4],
        )
        query_start = qo_indptr[request]
        for r in range(rows):
            q_index = r // group
            q_head = head * group + (r - q_index * group)
            top = -np.inf
            for s in range(splits):
                at = first + s * rows + r
                if partial_stats[at, 1] > 0.0:
                    top = max(top, partial_stats[at, 0])
            if sinks.shape[0] > 0:
                top = max(top, sinks[q_head])
            total = np.float32(0.0)
            for d in range(dim):
                merged[d] = 0.0
            for s in range(splits):
                at = first + s * rows + r
                if partial_stats[at, 1] > 0.0:
                    weight = np.float32(math.exp(partial_stats[at, 0] - top))
                    total += weight * partial_stats[at, 1]
                    for d in range(dim):
                        merged[d] += weight * partial_acc[at, d]
            if sinks.shape[0] > 0:  # the sink joins the denominator, adds no value
                total += np.float32(math.exp(sinks[q_head] - top))
            inverse = np.float32(1.0) / total
            for d in range(dim):
                out[query_start + q_index, q_head, d] = merged[d] * inverse
