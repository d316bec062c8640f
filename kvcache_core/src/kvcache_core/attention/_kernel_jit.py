"""The numba-compiled loops of the CPU paged-attention kernel.

numba carries no type information, so this module holds the compiled code only and
nothing imports it but :mod:`kvcache_core.attention.kernel`, the typed wrapper that checks,
plans and converts every argument. Nothing here validates anything: an index out of
range reads the wrong memory (bounds checks are off, as in any compiled kernel).

The wrapper attends every query of a batch for one layer in one call. Its work is a list
of items ``(request, kv_head, first_row, last_row, first_key, last_key, partial_row)``;
each thread runs :func:`attend_share`, which claims items one by one from a shared atomic
counter, without the GIL. The rows of a ``(request, kv_head)`` pair
are its queries times the query heads of that KV head (``row = query * group + g``), so
each key and value row is read once for the whole group. An item walks its keys in
tiles of ``KEY_TILE`` following the block table, with an online softmax in float32: the
running maximum and sum of each row rescale its accumulator when the maximum grows.
An item with ``partial_row < 0`` writes its normalised rows into the output; otherwise
it is one KV split of a long context (FlashDecoding) and writes its unnormalised
accumulator, maximum and sum into the partial buffers, which :func:`merge_splits`
merges with a log-sum-exp.

Pools are ``[rows, head_dim]`` views of one layer's K or V, one row per (block, token in
block, head), with the strides of those three in rows. A float32 pool is read in place:
the products read its rows where they are. Where the features are a multiple of the
vector lanes (twice that for the values), they run as the vector blocks of
:mod:`._kernel_ir` (a vector's worth of scores summed together, four rows' value sums held
in registers over a tile); otherwise four query rows times two keys, or four keys times
two rows, per pass, so most loads serve several products. Other pools' rows are
decoded tile by tile (``POOL_FLOAT16`` and ``POOL_BFLOAT16``, handed over as ``uint16``
bits; the quantized ``POOL_INT8`` and ``POOL_FLOAT8``, int8 or float8 e4m3 as ``uint8``,
each row times its token head's scale) into float32 tiles that stay in L1, so the
decoded values exist only there. The pool rows ``PREFETCH_KEYS`` keys ahead are
prefetched into L2 a few keys at a time, the key rows' before each block of products and
the value rows' before each few keys of weighted sums: the hardware prefetchers stop at every
4 KiB page, which a head's keys cross every eight rows of 128 floats, and a burst of a whole
pass's prefetches at once runs out of the core's outstanding misses. The softmax
weights' exponentials are computed in vectorised passes (no call per key).
``cache=True``: the compiled code is kept on disk, so each machine compiles once (once
for float pools, once for quantized ones).
"""

from __future__ import annotations

# numba publishes no type information: the decorated functions are untyped by nature.
# pyright: reportUntypedFunctionDecorator=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownMemberType=false
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
import math

import numpy as np
from numba import njit

from kvcache_core.attention._kernel_cache import register_locators
from kvcache_core.attention._kernel_ir import (
    LANES,
    VALUE_CHUNK,
    claim_next,
    score_block_1,
    score_block_2,
    score_block_4,
    value_block_4,
)
from kvcache_core.attention._kernel_merge import merge_splits, merge_splits_at
from kvcache_core.attention._kernel_rows import (
    FASTMATH,
    POOL_BFLOAT16,
    POOL_FLOAT8,
    POOL_FLOAT16,
    POOL_FLOAT32,
    POOL_INT8,
    PREFETCH_KEYS,
    decode_tile,
    pool_rows,
    prefetch_ahead,
)

# Before any decorator: the cached functions' locators stamp every kernel source.
register_locators()

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
    "merge_splits_at",
]

#: Query rows attended together (their K/V rows are read once for all of them).
ROW_TILE = 16
#: Keys per online-softmax step: their K (then V) rows are copied or decoded into one float32
#: tile of ``KEY_TILE x head_dim`` (16 KiB at 128), read from L1 by every query row.
KEY_TILE = 32
#: Keys per weighted sum of a decode's few rows (at most :data:`FINE_ROWS`) over a float32
#: pool read in place, each preceded by the prefetch of its keys' value rows ahead. Measured on
#: an AMD EPYC (Zen 5, 2 cores, 32 MiB L3), a 4096-key decode of 32 layers (8 KV heads of 128,
#: 4 query heads each) from memory, one thread: 105-110 ns per key and KV head with every
#: prefetch of a 16-key pass issued at once before its products, 64-67 with the value rows'
#: prefetched before each 8 keys of sums, 50-53 before each 4 keys; 43-44 ns either way with
#: the pool in the L3 cache. (A plain read of the same bytes runs at 31-36 ns.)
VALUE_KEYS = 4
#: The most rows of a tile whose weighted sums go :data:`VALUE_KEYS` at a time (more rows read
#: each value row for more products, and each pass loads and stores their sums).
FINE_ROWS = 8

# exp(x) for x <= 0: x = n ln 2 + r, 2**n built from its float32 bits. Below this, weights are
# under 2**-125 (a difference from 0 far under float32's resolution next to the maximum's 1).
_EXP_LOWEST = np.float32(-87.0)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HIGH = np.float32(0.693359375)  # ln 2 in two parts: n * _LN2_HIGH is exact
_LN2_LOW = np.float32(-2.1219444005469057e-4)
_C3, _C4, _C5 = np.float32(1.0 / 6.0), np.float32(1.0 / 24.0), np.float32(1.0 / 120.0)
_C6, _C7 = np.float32(1.0 / 720.0), np.float32(1.0 / 5040.0)


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _pair_scores(queries, rows, key_rows, rows_at, first, start, stop, scores):  # type: ignore[no-untyped-def]
    """``scores[j, c]`` = query row ``j`` times key row ``key_rows[rows_at[first + c]]`` for
    the keys ``[start, stop)``, four query rows times two keys per pass (each element loaded
    once for all of them, the products stay in registers)."""
    dim = queries.shape[1]
    c = start
    while c < stop:
        pair = c + 1 < stop
        a0 = rows_at[first + c]
        a1 = rows_at[first + c + 1] if pair else a0
        j = 0
        while j + 4 <= rows:
            t00 = t01 = t10 = t11 = t20 = t21 = t30 = t31 = np.float32(0.0)
            for d in range(dim):
                k0, k1 = key_rows[a0, d], key_rows[a1, d]
                q0, q1, q2, q3 = queries[j, d], queries[j + 1, d], queries[j + 2, d], queries[j + 3, d]
                t00 += q0 * k0
                t01 += q0 * k1
                t10 += q1 * k0
                t11 += q1 * k1
                t20 += q2 * k0
                t21 += q2 * k1
                t30 += q3 * k0
                t31 += q3 * k1
            scores[j, c], scores[j + 1, c], scores[j + 2, c], scores[j + 3, c] = t00, t10, t20, t30
            if pair:
                scores[j, c + 1], scores[j + 1, c + 1], scores[j + 2, c + 1], scores[j + 3, c + 1] = t01, t11, t21, t31
            j += 4
        while j < rows:
            t0 = t1 = np.float32(0.0)
            for d in range(dim):
                t0 += queries[j, d] * key_rows[a0, d]
                t1 += queries[j, d] * key_rows[a1, d]
            scores[j, c] = t0
            if pair:
                scores[j, c + 1] = t1
            j += 1
        c += 2


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _key_scores(queries, rows, key_rows, rows_at, first, keys, scores, ahead, pool_rows, upcoming):  # type: ignore[no-untyped-def]
    """``scores[j, c]`` = query row ``j`` times key row ``key_rows[rows_at[first + c]]``;
    ``ahead`` (:func:`._kernel_rows.prefetch_ahead`): the rows ``pool_rows[upcoming + c]``
    below its end of the key pool (float32, read in place; the value pool's go with the
    sums, :func:`_add_values`), or of both raw pools, are prefetched a block of keys at a time,
    before the block's products. Where the features are a multiple of ``LANES``, ``LANES``
    keys per pass go through the vector blocks of :mod:`._kernel_ir` (a last pass of fewer
    keys, and other feature counts, through :func:`_pair_scores`, two keys per pass)."""
    values_too = not ahead[0]  # raw pools: both decoded at the next tiles' start
    step = LANES if queries.shape[1] % LANES == 0 else 2
    c = 0
    while c < keys:
        if step < LANES or c + LANES > keys:
            prefetch_ahead(ahead, pool_rows, upcoming + c, step, True, values_too)
            _pair_scores(queries, rows, key_rows, rows_at, first, c, min(c + step, keys), scores)
        else:
            # The first rows' blocks prefetch their keys' rows, each block before its products:
            # spread over the pass, the prefetches do not wait on each other for the core's
            # outstanding misses (see VALUE_KEYS).
            j = 0
            while j + 4 <= rows:
                for k in range(0, LANES, LANES // 4):
                    if j == 0:
                        prefetch_ahead(ahead, pool_rows, upcoming + c + k, LANES // 4, True, values_too)
                    score_block_4(queries, j, key_rows, rows_at, first, scores, c + k)
                j += 4
            if j + 2 <= rows:
                for k in range(0, LANES, LANES // 2):
                    if j == 0:
                        prefetch_ahead(ahead, pool_rows, upcoming + c + k, LANES // 2, True, values_too)
                    score_block_2(queries, j, key_rows, rows_at, first, scores, c + k)
                j += 2
            if j < rows:
                if j == 0:
                    prefetch_ahead(ahead, pool_rows, upcoming + c, LANES, True, values_too)
                score_block_1(queries, j, key_rows, rows_at, first, scores, c)
        c += step


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _softmax_step(rows, keys, tile_key, work, softcap):  # type: ignore[no-untyped-def]
    """Turn the scores of keys ``[tile_key, tile_key + keys)`` into weights (0 where a row
    may not see a key), rescaling each row's accumulator and sum when its maximum grows."""
    scores, acc, row_max, row_sum, row_low, row_high, powers, power_values = work
    dim = acc.shape[1]
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
        # The tile's maximum: a decode row sees every key of its tiles, and eight independent
        # maxima there take an eighth of the serial chain (LLVM cannot vectorise a float
        # maximum without "nnan"). Measured on machine C, a warm decode of 4 query heads per
        # KV head of 64 features: 43.5 -> 40.8 ns per key and KV head.
        if low == 0 and high == keys:
            m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = new_max
            c = 0
            while c + 8 <= keys:
                m0 = max(m0, scores[j, c])
                m1 = max(m1, scores[j, c + 1])
                m2 = max(m2, scores[j, c + 2])
                m3 = max(m3, scores[j, c + 3])
                m4 = max(m4, scores[j, c + 4])
                m5 = max(m5, scores[j, c + 5])
                m6 = max(m6, scores[j, c + 6])
                m7 = max(m7, scores[j, c + 7])
                c += 8
            while c < keys:
                m0 = max(m0, scores[j, c])
                c += 1
            new_max = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
        else:
            for c in range(low, high):
                new_max = max(new_max, scores[j, c])
        if new_max > row_max[j]:
            shrink = np.float32(math.exp(row_max[j] - new_max))
            row_sum[j] *= shrink
            for d in range(dim):
                acc[j, d] *= shrink
            row_max[j] = new_max
        # exp(s - max) in two vectorised passes: 2**n through its float32 bits, exp(r) of the
        # rest (|r| <= ln 2 / 2) by its Taylor series to r**7 (relative error under 1e-8).
        # The passes run over the whole tile (an index from 0 is known non-negative, which
        # LLVM needs to vectorise) and a select keeps the keys the row sees.
        for c in range(keys):
            x = min(max(scores[j, c] - new_max, _EXP_LOWEST), np.float32(0.0))
            n = np.floor(x * _LOG2E + np.float32(0.5))
            r = x - n * _LN2_HIGH - n * _LN2_LOW
            p = r * (_C4 + r * (_C5 + r * (_C6 + r * _C7)))
            scores[j, c] = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(0.5) + r * (_C3 + p)))
            powers[c] = np.int32((n + np.float32(127.0)) * np.float32(8388608.0))
        total = np.float32(0.0)
        for c in range(keys):
            weight = scores[j, c] * power_values[c] if low <= c < high else np.float32(0.0)
            scores[j, c] = weight
            total += weight
        row_sum[j] += total


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _add_values(rows, value_rows, rows_at, first, keys, scores, acc, ahead, pool_rows, upcoming):  # type: ignore[no-untyped-def]
    """``acc[j] += sum_c scores[j, c] * value_rows[rows_at[first + c]]``: four rows at a time
    through :func:`._kernel_ir.value_block_4` where the features are a multiple of
    ``VALUE_CHUNK``; the other rows four keys times two rows per pass, so each accumulator
    element is loaded and stored once for four keys. A float32 pool read in place (``ahead``,
    as :func:`_key_scores` takes it) has its value rows ``pool_rows[next + c]`` prefetched
    before the sums of keys ``c``: for at most :data:`FINE_ROWS` rows, :data:`VALUE_KEYS`
    keys at a time."""
    dim = acc.shape[1]
    in_place = ahead[0]
    vector_rows = 0
    if dim % VALUE_CHUNK == 0 and rows >= 4:
        part = VALUE_KEYS if in_place and rows <= FINE_ROWS else keys
        for sub in range(0, keys, part):
            if in_place:
                prefetch_ahead(ahead, pool_rows, upcoming + sub, part, False, True)
            sub_keys = min(part, keys - sub)
            vector_rows = 0
            while vector_rows + 4 <= rows:
                # (the weights from column ``sub``: no view, which would take atomic reference counts)
                value_block_4(value_rows, rows_at, first + sub, sub_keys, scores, sub, vector_rows, acc)
                vector_rows += 4
    c = 0 if vector_rows < rows else keys
    prefetched = vector_rows > 0 or not in_place  # (the vector blocks' passes prefetched every value row)
    while c + 4 <= keys:
        if not prefetched:
            prefetch_ahead(ahead, pool_rows, upcoming + c, 4, False, True)
        v0, v1, v2, v3 = rows_at[first + c], rows_at[first + c + 1], rows_at[first + c + 2], rows_at[first + c + 3]
        j = vector_rows
        while j + 2 <= rows:
            w0, w1, w2, w3 = scores[j, c], scores[j, c + 1], scores[j, c + 2], scores[j, c + 3]
            u0, u1, u2, u3 = scores[j + 1, c], scores[j + 1, c + 1], scores[j + 1, c + 2], scores[j + 1, c + 3]
            for d in range(dim):
                e0, e1, e2, e3 = value_rows[v0, d], value_rows[v1, d], value_rows[v2, d], value_rows[v3, d]
                acc[j, d] += w0 * e0 + w1 * e1 + w2 * e2 + w3 * e3
                acc[j + 1, d] += u0 * e0 + u1 * e1 + u2 * e2 + u3 * e3
            j += 2
        if j < rows:
            w0, w1, w2, w3 = scores[j, c], scores[j, c + 1], scores[j, c + 2], scores[j, c + 3]
            for d in range(dim):
                e0, e1, e2, e3 = value_rows[v0, d], value_rows[v1, d], value_rows[v2, d], value_rows[v3, d]
                acc[j, d] += w0 * e0 + w1 * e1 + w2 * e2 + w3 * e3
        c += 4
    while c < keys:
        if not prefetched:
            prefetch_ahead(ahead, pool_rows, upcoming + c, 1, False, True)
        at = rows_at[first + c]
        for j in range(vector_rows, rows):
            weight = scores[j, c]
            for d in range(dim):
                acc[j, d] += weight * value_rows[at, d]
        c += 1


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _visible(position, first_key, last_key, causal, window, chunk):  # type: ignore[no-untyped-def]
    """The keys ``[low, high)`` of ``[first_key, last_key)`` the query at ``position`` sees."""
    low, high = first_key, last_key
    if causal:
        high = min(high, position + 1)
    if window > 0:
        low = max(low, position - window + 1)
    if chunk > 0:  # chunked local attention: the query's own chunk only
        chunk_start = position // chunk * chunk
        low = max(low, chunk_start)
        high = min(high, chunk_start + chunk)
    return low, high


@njit(cache=True, nogil=True, fastmath=FASTMATH, inline="always")
def _attend_item(  # type: ignore[no-untyped-def]
    item,
    query,
    pools,
    raw_pools,
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
    partials,
    queries,
    work,
    tiles,
    features,
    scaling,
):
    """Attend the rows ``[item[2], item[3])`` of one ``(request, kv_head)`` over its keys
    ``[item[4], item[5])``, from ``pools = (key_rows, value_rows)`` (float32) or ``raw_pools``
    (their bits) as ``pool_kind`` says; ``queries``, ``work`` (see :func:`_softmax_step`) and ``tiles =
    (rows_at, scales_at, tile_rows, key_tile, key_bits, value_tile, value_bits)`` are the
    thread's buffers; ``partials = (partial_acc, partial_stats)``. Attention features:
    ``features = (softcap, sinks, chunk)``: ``softcap`` (0: none), ``sinks [query_heads]``
    (empty: none), ``chunk`` (0: none); ``scaling = (key_scales, value_scales,
    scale_strides)`` of a quantized pool. (Packed in tuples: CPython compiles a call of more
    than 30 arguments as a ``*args`` call, which numba cannot inline.)"""
    softcap, sinks, chunk = features
    in_place = pool_kind == POOL_FLOAT32
    key_scales, value_scales, scale_strides = scaling
    partial_acc, partial_stats = partials
    rows_at, scales_at, tile_rows, key_tile, key_bits, value_tile, value_bits = tiles
    scores, acc, row_max, row_sum, row_low, row_high = work[0], work[1], work[2], work[3], work[4], work[5]
    request, head, first_row, last_row = item[0], item[1], item[2], item[3]
    first_key, last_key, partial_row = item[4], item[5], item[6]
    dim = query.shape[2]
    value_dim = acc.shape[1]  # the values' width may differ from the keys' (MLA, v_head_dim)
    query_start = qo_indptr[request]
    num_queries = qo_indptr[request + 1] - query_start
    seq_len = seq_lens[request]
    block_row = block_tables[request]
    # The keys any row of the item sees, and their pool rows, once for all its row tiles.
    item_low, item_high = last_key, first_key
    for r in range(first_row, last_row):
        low, high = _visible(seq_len - num_queries + r // group, first_key, last_key, causal, window, chunk)
        item_low, item_high = min(item_low, low), max(item_high, high)
    item_keys = max(0, item_high - item_low)
    scaled = pool_kind >= POOL_INT8  # quantized: each row has its token head's scale
    pool_rows(block_row, item_low, item_keys, block_size, strides, scale_strides, head, rows_at, scales_at, scaled)
    key_pool, value_pool = pools
    key_raw, value_raw = raw_pools
    # What the prefetches read, as integers (an array in a tuple or passed on in a loop takes
    # atomic reference-count updates each time): the pools' addresses and row bytes.
    if in_place:
        read = (key_pool.ctypes.data, value_pool.ctypes.data, key_pool.strides[0], value_pool.strides[0])
    else:
        read = (key_raw.ctypes.data, value_raw.ctypes.data, key_raw.strides[0], value_raw.strides[0])
    ahead = (in_place, read[0], read[1], read[2], read[3], item_keys)
    for tile_row in range(first_row, last_row, ROW_TILE):
        rows = min(ROW_TILE, last_row - tile_row)
        low_all = last_key
        high_all = first_key
        for j in range(rows):
            r = tile_row + j
            q_index = r // group
            q_head = head * group + (r - q_index * group)
            low, high = _visible(seq_len - num_queries + q_index, first_key, last_key, causal, window, chunk)
            row_low[j] = low
            row_high[j] = high
            low_all = min(low_all, low)
            high_all = max(high_all, high)
            for d in range(dim):
                queries[j, d] = query[query_start + q_index, q_head, d] * scale
            for d in range(value_dim):
                acc[j, d] = 0.0
            row_max[j] = -np.inf
            row_sum[j] = 0.0
        # The tiles' calls name the same arrays at every tile (no array chosen per tile): an
        # array a loop rebinds or packs anew takes atomic reference-count updates each time.
        for tile_key in range(low_all, high_all, KEY_TILE):
            keys = min(KEY_TILE, high_all - tile_key)
            first = tile_key - item_low
            upcoming = first + PREFETCH_KEYS
            if in_place:  # float32: the rows read where they are
                _key_scores(queries, rows, key_pool, rows_at, first, keys, scores, ahead, rows_at, upcoming)
            else:
                decode_tile(key_raw, pool_kind, rows_at, scales_at, first, keys, key_tile, key_bits, key_scales)
                decode_tile(value_raw, pool_kind, rows_at, scales_at, first, keys, value_tile, value_bits, value_scales)
                _key_scores(queries, rows, key_tile, tile_rows, 0, keys, scores, ahead, rows_at, upcoming)
            _softmax_step(rows, keys, tile_key, work, softcap)
            if in_place:
                _add_values(rows, value_pool, rows_at, first, keys, scores, acc, ahead, rows_at, upcoming)
            else:
                _add_values(rows, value_tile, tile_rows, 0, keys, scores, acc, ahead, rows_at, upcoming)
        for j in range(rows):
            r = tile_row + j
            if partial_row < 0:
                q_index = r // group
                q_head = head * group + (r - q_index * group)
                total = row_sum[j]
                if sinks.shape[0] > 0:  # the sink joins the denominator, adds no value
                    total += np.float32(math.exp(sinks[q_head] - row_max[j]))
                inverse = np.float32(1.0) / total
                for d in range(value_dim):
                    out[query_start + q_index, q_head, d] = acc[j, d] * inverse
            else:
                target = partial_row + r - first_row
                for d in range(value_dim):
                    partial_acc[target, d] = acc[j, d]
                partial_stats[target, 0] = row_max[j]
                partial_stats[target, 1] = row_sum[j]


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def attend_share(  # type: ignore[no-untyped-def]
    query,
    key_rows,
    value_rows,
    key_raw,
    value_raw,
    pool_kind,
    strides,
    block_tables,
    seq_lens,
    qo_indptr,
    items,
    claimed,
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
    """Run items of ``items [n, 7]`` int64 without the GIL until none is left: each thread
    of a call claims the next one from ``claimed [1]`` int64 (0 at the start, shared).

    The pools are ``[pool rows, dim]`` (one row per token head) with the row strides
    ``strides`` of (block, token in block, head): ``key_rows``/``value_rows`` float32 for
    ``POOL_FLOAT32``, ``key_raw``/``value_raw`` the bits of the other kinds (value rows may be
    of another width than key rows, with the same row strides; ``out`` is as wide as a value row) (``uint16`` or
    ``uint8``); the pair not used is any array of its type (so one compiled version serves
    float32, float16 and bfloat16 pools, one the quantized ones); ``query [tokens,
    query_heads, dim]`` and ``out`` (same shape) are float32; ``partial_acc [p, dim]`` and
    ``partial_stats [p, 2]`` (maximum, sum) float32; the attention features ``softcap``
    (float, 0: none), ``sinks [query_heads]`` float32 (empty: none) and ``chunk`` (int, 0:
    none). For ``POOL_INT8`` and ``POOL_FLOAT8``: ``key_scales``/``value_scales`` flat
    float32 scales with element strides ``scale_strides`` (block, token, head); other kinds
    ignore them."""
    dim = query.shape[2]
    value_dim = out.shape[2]
    longest = 1
    for position in range(items.shape[0]):
        longest = max(longest, items[position, 5] - items[position, 4])
    queries = np.empty((ROW_TILE, dim), np.float32)
    powers = np.empty(KEY_TILE, np.int32)
    work = (
        np.empty((ROW_TILE, KEY_TILE), np.float32),  # scores, then weights
        np.empty((ROW_TILE, value_dim), np.float32),  # accumulators
        np.empty(ROW_TILE, np.float32),  # running maxima
        np.empty(ROW_TILE, np.float32),  # running sums
        np.empty(ROW_TILE, np.int64),  # first key of each row
        np.empty(ROW_TILE, np.int64),  # last key + 1
        powers,
        powers.view(np.float32),
    )
    key_bits = np.empty((KEY_TILE, dim), np.uint32)
    value_bits = np.empty((KEY_TILE, value_dim), np.uint32)
    tiles = (
        np.empty(longest, np.int64),  # pool row of each key of an item
        np.empty(longest, np.int64),  # its scale's index
        np.arange(KEY_TILE),
        key_bits.view(np.float32),
        key_bits,
        value_bits.view(np.float32),
        value_bits,
    )
    while True:
        position = claim_next(claimed)
        if position >= items.shape[0]:
            break
        _attend_item(
            items[position],
            query,
            (key_rows, value_rows),
            (key_raw, value_raw),
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
            (partial_acc, partial_stats),
            queries,
            work,
            tiles,
            (softcap, sinks, chunk),
            (key_scales, value_scales, scale_strides),
        )
