"""Paged attention as a pure, jittable JAX function: decode and prefill, causal,
grouped-query, ragged batches, sliding window, block tables as int32 arrays, and the
attention features of :mod:`kvcache_core.attention.features` (a layer's window, logit
softcapping, attention sinks, chunked local attention).

The context is never gathered whole. A loop walks the batch's block tables a few blocks
at a time (a ``jax.lax.fori_loop`` whose trip count follows the longest live request, not
the padded table): each step takes those blocks of every request from the pool, small
enough to stay in cache, scores them and folds them into a running softmax (maximum,
normaliser, weighted values), as flash-decoding does. On a shared 2-core CPU it ran at
0.9-1.7x the time of a dense heads-first einsum over contiguous K/V at 4096 tokens
(``benchmarks/decode_jax.py`` measures it).
"""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

from kvcache_core.attention.features import (
    check_chunk,
    check_finite_logits,
    check_softcap,
    check_window,
    combined_window,
)
from kvcache_core.attention.reference import check_scale
from kvcache_core.contract.scalars import check_count, check_optional_count
from kvcache_core.errors import ShapeMismatchError
from kvcache_jax.buckets import bucket
from kvcache_jax.scatter import BLOCK_AXIS, pool_geometry

__all__ = ["paged_attention"]

#: Bytes of keys plus values one loop step gathers: cache-sized on CPU; accelerators,
#: whose loop steps cost more and whose memory is fast, take bigger steps.
_KV_STEP_BYTES = {"cpu": 4 << 20}
_KV_STEP_BYTES_ACCELERATOR = 64 << 20
#: Bytes of one loop step's scores (bounds long prefills).
_SCORE_STEP_BYTES = 16 << 20


def _floor_power_of_two(value: int) -> int:
    return 1 << (value.bit_length() - 1) if value >= 1 else 1


def _blocks_per_step(heads: int, batch: int, rows: int, block_size: int, head_dim: int, columns: int) -> int:
    """Blocks per request one loop step reads: a power of two within both budgets."""
    kv_budget = _KV_STEP_BYTES.get(jax.default_backend(), _KV_STEP_BYTES_ACCELERATOR)
    kv_bytes = 2 * heads * batch * block_size * head_dim * 4
    score_bytes = heads * batch * rows * block_size * 4
    fitting = min(kv_budget // max(kv_bytes, 1), _SCORE_STEP_BYTES // max(score_bytes, 1))
    return min(_floor_power_of_two(fitting), bucket(columns))


def _take_heads_first(cache: jax.Array, blocks: jax.Array, kv_layout: str, dtype: jnp.dtype) -> jax.Array:
    """Blocks ``[B, c]`` of a pool as ``[heads, B, c * block_size, dim]`` in ``dtype``."""
    picked = jnp.take(cache, blocks, axis=BLOCK_AXIS[kv_layout], mode="clip")
    if kv_layout == "NHD":  # [B, c, block_size, heads, dim]
        picked = picked.transpose(3, 0, 1, 2, 4)
    elif kv_layout == "HND":  # [B, c, heads, block_size, dim]
        picked = picked.transpose(2, 0, 1, 3, 4)
    heads, batch, count, block_size, dim = picked.shape  # heads_first: already [heads, B, c, bs, dim]
    return picked.reshape(heads, batch, count * block_size, dim).astype(dtype)


def _take_scales(scales: jax.Array, blocks: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Scales ``[heads, num_blocks, block_size]`` of blocks ``[B, c]`` as ``[heads, B, c *
    block_size, 1]`` in ``dtype``."""
    picked = jnp.take(scales, blocks, axis=1, mode="clip")  # [H, B, c, bs]
    heads, batch, count, block_size = picked.shape
    return picked.reshape(heads, batch, count * block_size, 1).astype(dtype)


def paged_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    qo_indptr: jax.Array | None = None,
    *,
    max_query_len: int | None = None,
    scale: float | None = None,
    causal: bool = True,
    kv_layout: str = "NHD",
    sliding_window: int | None = None,
    blocks_per_step: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    chunk: int | None = None,
    key_scales: jax.Array | None = None,
    value_scales: jax.Array | None = None,
) -> jax.Array:
    """Attention of packed queries over the paged K/V of a batch; pure and jittable.

    Request ``b`` holds ``seq_lens[b]`` tokens in blocks ``block_tables[b, :]`` (entries
    past its last block are ignored) and owns query rows ``qo_indptr[b]:qo_indptr[b + 1]``,
    which are its last tokens: with ``causal`` the ``i``-th of its ``q`` rows sits at
    position ``seq_lens[b] - q + i`` and sees keys up to it; otherwise every row sees all
    ``seq_lens[b]`` keys. With ``sliding_window`` ``W`` a row at position ``p`` sees only
    keys at positions ``k > p - W`` (its last ``W`` tokens; positions count from the
    request's first listed block, as :class:`kvcache_core.PageTable` lists them). Query head ``j`` reads KV head ``j // (num_query_heads //
    num_heads)`` (grouped-query attention).

    Use it inside your own ``jax.jit`` step, next to :func:`kvcache_jax.write`::

        @partial(jax.jit, donate_argnums=(1, 2))
        def step(q, k_pool, v_pool, slots, k, v, block_tables, seq_lens):
            k_pool, v_pool = kvcache_jax.write(k_pool, v_pool, slots, k, v)
            out = kvcache_jax.paged_attention(q, k_pool, v_pool, block_tables, seq_lens)
            return out, k_pool, v_pool

    Args:
        query: ``[total_queries, num_query_heads, head_dim]``, requests packed in batch order.
        key_cache, value_cache: one layer's pools in ``kv_layout``; the values' last axis
            (``value_dim``) may differ from the keys' (``head_dim``).
        block_tables: ``[B, max_blocks]`` int32 physical block ids.
        seq_lens: ``[B]`` int32 tokens per request (0 for a padding request).
        qo_indptr: ``[B + 1]`` int32 query offsets; ``None`` for decode (one query per
            request, ``total_queries == B``). Rows past ``qo_indptr[B]`` give zeros.
        max_query_len: static bound on one request's query rows (default:
            ``total_queries``; a tight bound saves work on mixed batches).
        scale: score scale, ``1 / sqrt(head_dim)`` by default.
        causal: as above.
        kv_layout: ``"NHD"``, ``"HND"`` or ``"heads_first"``.
        sliding_window: ``W`` (static), or ``None`` for no window.
        blocks_per_step: blocks of every request one loop step reads (static; at most the
            table's columns rounded up to a power of two); by default the most, as a power
            of two, whose keys and values stay within 4 MiB (64 MiB on accelerators) and
            whose scores within 16 MiB.
        window: this layer's window ``W`` (static), combined with ``sliding_window``
            (the smaller applies).
        softcap: ``cap`` (static): scaled scores become ``tanh(s / cap) * cap`` before
            the mask.
        sinks: ``[num_query_heads]`` logits joining each query head's softmax
            denominator, contributing no value.
        chunk: ``C`` (static): a row at ``p`` sees only keys ``k`` with ``k // C == p // C``
            (positions as above: absolute only without a sliding window).
        key_scales, value_scales: a quantized pool's scales of this layer, ``[num_heads,
            num_blocks, block_size]`` float32 (:mod:`kvcache_core.contract.quantization`): the pools
            hold raw int8 / float8 values and ``raw * scale`` is the value; each loop step
            decodes only the blocks it reads. Both or neither.

    Returns:
        ``[total_queries, num_query_heads, value_dim]`` in ``query``'s dtype; softmax in
        float32 (float64 for a float64 query).

    Raises:
        ShapeMismatchError: shapes that do not fit together (at trace time).
        InvalidArgumentError: bad ``scale`` (not a normal float32 > 0), ``max_query_len``,
            ``sliding_window``, ``blocks_per_step``, layout, ``window``, ``chunk`` (not ints
            from 1 to ``INT32_MAX``), ``softcap``, or non-finite ``sinks`` (checked when
            they are concrete; under ``jit`` the caller checks them, as the manager does).
    """
    _, block_size, num_heads, head_dim = pool_geometry(key_cache, kv_layout)
    if key_cache.shape[:3] != value_cache.shape[:3] or value_cache.ndim != 4:
        raise ShapeMismatchError(
            "key and value pools must share one shape but for their last axis (the key and value widths), got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    value_dim = int(value_cache.shape[3])
    if query.ndim != 3 or query.shape[2] != head_dim or query.shape[1] % num_heads or query.shape[1] == 0:
        raise ShapeMismatchError(
            f"query must be [tokens, k * {num_heads}, {head_dim}] (k >= 1), got {tuple(query.shape)}"
        )
    scale_shape = (num_heads, int(key_cache.shape[BLOCK_AXIS[kv_layout]]), block_size)
    for scales in (key_scales, value_scales):
        if (key_scales is None) != (value_scales is None) or (scales is not None and scales.shape != scale_shape):
            raise ShapeMismatchError(
                f"key_scales and value_scales must both be None or both {scale_shape} ([heads, blocks, block_size])"
            )
    if block_tables.ndim != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ShapeMismatchError(
            f"block_tables must be [B, max_blocks] and seq_lens [B], got {tuple(block_tables.shape)} "
            f"and {tuple(seq_lens.shape)}"
        )
    total_queries, query_heads, _ = (int(size) for size in query.shape)
    batch, columns = int(block_tables.shape[0]), int(block_tables.shape[1])
    if qo_indptr is None:
        if total_queries != batch:
            raise ShapeMismatchError(
                f"decode takes one query per request: {batch} requests, {total_queries} query rows; "
                "pass qo_indptr for prefill"
            )
        qo_indptr = jnp.arange(batch + 1, dtype=jnp.int32)
        max_query_len = 1
    elif qo_indptr.shape != (batch + 1,):
        raise ShapeMismatchError(f"qo_indptr must be [{batch + 1}], got {tuple(qo_indptr.shape)}")
    max_query_len = check_count(max(total_queries, 1) if max_query_len is None else max_query_len, "max_query_len", 1)
    sliding_window = combined_window(check_window(window), check_window(sliding_window, "sliding_window"))
    cap, chunk = check_softcap(softcap), check_chunk(chunk)
    if sinks is not None and sinks.shape != (query_heads,):
        raise ShapeMismatchError(f"sinks must be [{query_heads}] (one per query head), got {tuple(sinks.shape)}")
    if sinks is not None and not isinstance(sinks, Tracer):  # traced (under jit): checked by the caller
        check_finite_logits("sinks", np.asarray(sinks, dtype=np.float32))
    blocks_per_step = check_optional_count(blocks_per_step, "blocks_per_step", 1, None)
    scale = check_scale(scale, head_dim)
    if total_queries == 0 or batch == 0 or columns == 0:
        return jnp.zeros((total_queries, query_heads, value_dim), query.dtype)

    compute = jnp.float64 if query.dtype == jnp.float64 else jnp.float32
    group = query_heads // num_heads
    rows_per_request = max_query_len * group
    qo_indptr = qo_indptr.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    query_lens = qo_indptr[1:] - qo_indptr[:-1]  # [B]

    # Packed rows -> [B, max_query_len] padded rows, each with its position in its sequence.
    slot = jnp.arange(max_query_len, dtype=jnp.int32)
    rows = jnp.clip(qo_indptr[:-1, None] + slot[None, :], 0, total_queries - 1)
    row_valid = slot[None, :] < query_lens[:, None]
    last = seq_lens[:, None] - 1
    own = (seq_lens - query_lens)[:, None] + slot[None, :]  # each row's own position
    positions = own if causal else jnp.broadcast_to(last, rows.shape)
    positions = jnp.where(row_valid, positions, -1)  # a padding row sees no key
    row_positions = jnp.repeat(positions, group, axis=1)  # [B, R]: row q * group + g, the last key it sees
    row_own = jnp.repeat(jnp.where(row_valid, own, -1), group, axis=1)  # [B, R]: its position
    padded = jnp.take(query, rows, axis=0).astype(compute) * jnp.asarray(scale, compute)  # [B, Q, QH, D]
    q = (
        padded.reshape(batch, max_query_len, num_heads, group, head_dim)
        .transpose(2, 0, 1, 3, 4)
        .reshape(num_heads, batch, rows_per_request, head_dim)
    )

    if blocks_per_step is None:
        step_blocks = _blocks_per_step(
            num_heads, batch, rows_per_request, block_size, (head_dim + value_dim) // 2, columns
        )
    else:  # more blocks than the table pads to would only pad it further
        step_blocks = min(blocks_per_step, bucket(columns))
    padded_columns = -(-columns // step_blocks) * step_blocks
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_columns - columns)))
    step_tokens = step_blocks * block_size
    steps = jnp.minimum((jnp.max(seq_lens) + step_tokens - 1) // step_tokens, padded_columns // step_blocks)
    key_offsets = jnp.arange(step_tokens, dtype=jnp.int32)

    def fold(step: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        running_max, normaliser, weighted = carry
        blocks = lax.dynamic_slice_in_dim(tables, step * step_blocks, step_blocks, axis=1)  # [B, c]
        keys = _take_heads_first(key_cache, blocks, kv_layout, compute)  # [H, B, S, D]
        values = _take_heads_first(value_cache, blocks, kv_layout, compute)
        if key_scales is not None and value_scales is not None:  # decode this step's blocks only
            keys = keys * _take_scales(key_scales, blocks, compute)
            values = values * _take_scales(value_scales, blocks, compute)
        key_positions = step * step_tokens + key_offsets  # [S]
        # Padding tokens may hold anything (even NaN): zero their values, hide their scores.
        values = jnp.where((key_positions[None, :] < seq_lens[:, None])[None, :, :, None], values, 0)
        scores = jnp.einsum("hbrd,hbsd->hbrs", q, keys, precision=lax.Precision.HIGHEST)
        visible = key_positions[None, None, :] <= row_positions[:, :, None]  # [B, R, S]
        if sliding_window is not None:
            visible &= key_positions[None, None, :] > row_own[:, :, None] - sliding_window
        if chunk is not None:
            visible &= key_positions[None, None, :] // chunk == row_own[:, :, None] // chunk
        if cap is not None:  # before the mask, as Gemma 2 applies it
            scores = jnp.tanh(scores / cap) * cap
        scores = jnp.where(visible[None], scores, -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        shift = jnp.where(jnp.isneginf(new_max), 0, new_max)  # rows that saw no key yet
        weights = jnp.exp(scores - shift[..., None])
        correction = jnp.exp(running_max - shift)
        normaliser = normaliser * correction + weights.sum(axis=-1)
        weighted = weighted * correction[..., None] + jnp.einsum(
            "hbrs,hbsd->hbrd", weights, values, precision=lax.Precision.HIGHEST
        )
        return new_max, normaliser, weighted

    shape = (num_heads, batch, rows_per_request)
    if sinks is None:
        start = (
            jnp.full(shape, -jnp.inf, compute),
            jnp.zeros(shape, compute),
            jnp.zeros((*shape, value_dim), compute),
        )
    else:  # each row starts from its head's sink: in the denominator (exp 0 = 1), no value
        row_sinks = jnp.tile(sinks.astype(compute).reshape(num_heads, group), (1, max_query_len))  # [H, R]
        start = (
            jnp.broadcast_to(row_sinks[:, None, :], shape),
            jnp.ones(shape, compute),
            jnp.zeros((*shape, value_dim), compute),
        )
    _, normaliser, weighted = lax.fori_loop(0, steps, fold, start)
    safe = jnp.where(normaliser > 0, normaliser, 1)[..., None]
    attended = jnp.where(normaliser[..., None] > 0, weighted / safe, 0)  # [H, B, R, D]
    per_request = (
        attended.reshape(num_heads, batch, max_query_len, group, value_dim)
        .transpose(1, 2, 0, 3, 4)
        .reshape(batch, max_query_len, query_heads, value_dim)
    )

    # Padded rows -> packed rows.
    token = jnp.arange(total_queries, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(qo_indptr[1:], token, side="right"), 0, batch - 1).astype(jnp.int32)
    within = jnp.clip(token - qo_indptr[owner], 0, max_query_len - 1)
    packed = per_request[owner, within]
    packed = jnp.where((token < qo_indptr[batch])[:, None, None], packed, 0)
    return packed.astype(query.dtype)
