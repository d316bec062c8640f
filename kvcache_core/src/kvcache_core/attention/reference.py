"""NumPy reference paged attention: decode and prefill, causal, grouped-query, ragged batch,
optionally over a sliding window.

It reads K/V from the pool in place: each run of physically consecutive blocks of a
request is one zero-copy view of the pool. The runs' scores fill one buffer per request,
one softmax normalises them and each run adds its share of the values, so any number of
runs gives the exact result without a merge step. Nothing copies a request's context;
the score buffer is bounded by splitting very long prefills into chunks of query rows.

Sliding window ``W``: the query at position ``p`` sees keys at positions ``p - W < k``
(the last ``W`` tokens, itself included; and, causal, ``k <= p``). Blocks wholly older
than the window of every query in a chunk are not read at all; the mask is applied only
when some key that is read is older than some query's window.

Per call (so per layer) it also takes the features of :mod:`kvcache_core.attention.features`:
a layer's ``window`` (combined with the page table's), logit ``softcap``, attention
``sinks`` and chunked local attention (``chunk``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvcache_core.attention.features import (
    ArrayCheck,
    check_attention_features,
    check_chunk,
    check_chunk_positions,
    check_finite_logits,
    check_softcap,
    check_window,
    combined_window,
)
from kvcache_core.contract.config import KV_LAYOUTS
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.scalars import check_positive_float32, shown
from kvcache_core.errors import InvalidArgumentError, InvalidTypeError, ShapeMismatchError

__all__ = ["check_attention_call", "check_scale", "decode_indptr", "paged_attention", "validate_query_indptr"]

FloatArray = npt.NDArray[np.floating[Any]]
IntArray = npt.NDArray[np.int64]

#: Most elements of one request's score buffer before its query rows are split in chunks
#: (16 MiB of float32): long prefills stay bounded in memory.
_SCORE_BUDGET = 1 << 22


class _Run(NamedTuple):
    """One run of consecutive blocks: its first token, live tokens and pool views; for a
    quantized pool also its scale views ``[heads, blocks, block_size]``."""

    first_token: int
    tokens: int
    keys: FloatArray
    values: FloatArray
    key_scales: FloatArray | None = None
    value_scales: FloatArray | None = None

    def skip_blocks(self, count: int, block_size: int) -> _Run:
        """The run without its first ``count`` blocks (views, no copy)."""
        return _Run(
            self.first_token + count * block_size,
            self.tokens - count * block_size,
            self.keys[:, count:],
            self.values[:, count:],
            None if self.key_scales is None else self.key_scales[:, count:],
            None if self.value_scales is None else self.value_scales[:, count:],
        )


def decode_indptr(batch_size: int) -> npt.NDArray[np.int32]:
    """``qo_indptr`` of a decode step: one query token per request."""
    return np.arange(batch_size + 1, dtype=np.int32)


def check_scale(scale: object, head_dim: int) -> float:
    """The attention score scale as a ``float``: ``1 / sqrt(head_dim)`` for ``None``, else
    ``scale`` if it is a real number (Python or NumPy) > 0 that float32 holds as a normal
    number (every backend scales scores in float32 or wider).

    Raises:
        InvalidArgumentError: anything else; the message names the range.
    """
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_positive_float32(scale, "scale")


def check_attention_call(
    scale: object,
    causal: object,
    head_dim: int,
    features: dict[str, Any],
    *,
    served: frozenset[str],
    backend: str,
    query_heads: int,
    table_window: int | None,
    check_array: ArrayCheck,
) -> tuple[float, dict[str, Any]]:
    """What a manager's or a step's attention call checks beyond its arrays: the scale,
    ``causal`` and the attention features ``features`` (``window``, ``softcap``, ``sinks``,
    ``chunk``; see :func:`check_attention_features`).

    Returns:
        The scale and the keyword arguments to hand the storage (the features set).

    Raises:
        InvalidArgumentError, InvalidTypeError (``causal``), and what
        :func:`check_attention_features` raises.
    """
    checked_scale = check_scale(scale, head_dim)
    if not isinstance(causal, bool):
        raise InvalidTypeError(f"causal must be a bool, got {shown(causal)}")
    if (
        features["window"] is None
        and features["softcap"] is None
        and features["sinks"] is None
        and features["chunk"] is None
    ):
        return checked_scale, {}
    return checked_scale, check_attention_features(
        **features,
        served=served,
        backend=backend,
        query_heads=query_heads,
        table_window=table_window,
        check_array=check_array,
    )


def validate_query_indptr(qo_indptr: object, page_table: PageTable, total_queries: int) -> npt.NDArray[np.int32]:
    """Check a ``qo_indptr`` (``[B + 1]``) against a page table and the query count.

    Query tokens of request ``b`` are ``query[qo_indptr[b]:qo_indptr[b + 1]]``: the last
    tokens of its sequence, so each request needs at most ``seq_lens[b]`` of them.
    ``None`` means one query per request (decode).

    Raises:
        InvalidArgumentError: wrong length, not offsets from 0 to ``total_queries``, or a
            request with more queries than tokens.
    """
    batch = page_table.batch_size
    if qo_indptr is None:
        if total_queries != batch:
            raise ShapeMismatchError(
                f"decode attention takes one query per request: {batch} requests, "
                f"{total_queries} query tokens; pass qo_indptr for prefill"
            )
        return decode_indptr(batch)
    indptr = np.asarray(qo_indptr)
    if indptr.dtype.kind not in "iu" or indptr.shape != (batch + 1,):
        raise InvalidArgumentError(
            f"qo_indptr must be {batch + 1} integers, got dtype {indptr.dtype} shape {indptr.shape}"
        )
    counts = np.diff(indptr)
    if indptr[0] != 0 or int(indptr[-1]) != total_queries or np.any(counts < 0):
        raise InvalidArgumentError(
            f"qo_indptr must rise from 0 to {total_queries} (the query tokens), got {indptr.tolist()}"
        )
    too_many = np.flatnonzero(counts > page_table.seq_lens)
    if too_many.size:
        b = int(too_many[0])
        raise InvalidArgumentError(
            f"request {b} has {int(counts[b])} query tokens but only {int(page_table.seq_lens[b])} "
            "cached tokens; write a token's K/V before attending from it"
        )
    return indptr.astype(np.int32)


def _run_view(cache: FloatArray, start: int, length: int, layout: str) -> FloatArray:
    """A run of blocks as a ``[num_heads, length, block_size, head_dim]`` view (no copy)."""
    view: FloatArray
    if layout == "NHD":
        view = cache[start : start + length].transpose(2, 0, 1, 3)
    elif layout == "HND":
        view = cache[start : start + length].transpose(1, 0, 2, 3)
    else:
        view = cache[:, start : start + length]
    return view


def paged_attention(
    query: FloatArray,
    key_cache: FloatArray,
    value_cache: FloatArray,
    page_table: PageTable,
    *,
    qo_indptr: object = None,
    scale: float | None = None,
    causal: bool = True,
    kv_layout: str = "NHD",
    sliding_window: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: FloatArray | None = None,
    chunk: int | None = None,
    key_scales: FloatArray | None = None,
    value_scales: FloatArray | None = None,
) -> FloatArray:
    """Attention of packed queries over the paged K/V of a batch.

    Args:
        query: ``[total_queries, num_query_heads, head_dim]``, requests packed in batch
            order; ``num_query_heads`` a multiple of the pool's ``num_heads`` (GQA).
        key_cache, value_cache: one layer's pool in ``kv_layout``; the values' last axis
            (``value_dim``) may differ from the keys' (``head_dim``).
        page_table: the batch's pages (:meth:`KvCacheManager.page_table`).
        qo_indptr: ``[B + 1]`` query offsets per request; ``None`` for decode (one each).
        scale: score scale, ``1 / sqrt(head_dim)`` by default.
        causal: query ``i`` of a request with ``q`` queries and ``n`` tokens sits at
            position ``n - q + i`` and sees keys up to it; otherwise it sees all ``n``.
        kv_layout: ``"NHD"``, ``"HND"`` or ``"heads_first"``.
        sliding_window: ``W``: each query sees only keys at positions ``p - W < k`` (its
            last ``W`` tokens). ``None`` takes the page table's
            :attr:`~PageTable.sliding_window` (``None`` there too: no window).
        window: this layer's window ``W``, combined with the page table's (the smaller
            applies).
        softcap: ``cap``: each scaled score ``s`` becomes ``tanh(s / cap) * cap`` before
            the mask.
        sinks: ``[num_query_heads]`` logits joining each query head's softmax
            denominator, contributing no value.
        chunk: ``C``: a query at ``p`` sees only keys ``k`` with ``k // C == p // C``
            (not with a page table that has a sliding window: its positions are relative).
        key_scales, value_scales: a quantized pool's scales of this layer, ``[num_heads,
            num_blocks, block_size]`` (:mod:`kvcache_core.contract.quantization`): the caches hold raw
            values and ``raw * scale`` is the value. They are applied while reading each
            run, folded into its scores and its softmax weights; no dequantized copy of
            the context is made. Both or neither.

    Returns:
        ``[total_queries, num_query_heads, value_dim]`` in ``query``'s dtype.

    Raises:
        ShapeMismatchError: shapes that do not fit together.
        InvalidArgumentError: bad ``qo_indptr``, ``scale`` (not a normal float32 > 0),
            ``kv_layout``, ``sliding_window`` (not an int from 1 to ``INT32_MAX``, or unlike
            the page table's), ``window`` or ``chunk`` (not an int from 1 to
            ``INT32_MAX``), ``softcap`` (not a normal float32 > 0), a ``chunk`` with a
            page table's sliding window, or ``sinks`` that are not a ``[num_query_heads]``
            float array of finite values.
    """
    window = combined_window(check_window(window), _effective_window(sliding_window, page_table))
    cap = check_softcap(softcap)
    chunk_size = check_chunk(chunk)
    check_chunk_positions(chunk_size, page_table.sliding_window)
    if kv_layout not in KV_LAYOUTS:
        raise InvalidArgumentError(f"kv_layout {kv_layout!r} is unknown; valid: {', '.join(KV_LAYOUTS)}")
    if key_cache.shape[:3] != value_cache.shape[:3] or key_cache.ndim != 4 or value_cache.ndim != 4:
        raise ShapeMismatchError(
            "key and value caches must share one 4-D shape but for their last axis (the key and value widths), "
            f"got {key_cache.shape} and {value_cache.shape}"
        )
    heads_axis = {"NHD": 2, "HND": 1, "heads_first": 0}[kv_layout]
    num_heads, head_dim, value_dim = key_cache.shape[heads_axis], key_cache.shape[3], value_cache.shape[3]
    if query.ndim != 3 or query.shape[2] != head_dim or query.shape[1] % num_heads:
        raise ShapeMismatchError(
            f"query must be [tokens, k * {num_heads}, {head_dim}] for a pool of {num_heads} heads "
            f"of {head_dim}, got {query.shape}"
        )
    checked_scale = check_scale(scale, head_dim)
    indptr = validate_query_indptr(qo_indptr, page_table, query.shape[0])
    scale_shape = (num_heads, key_cache.shape[{"NHD": 0, "HND": 0, "heads_first": 1}[kv_layout]], page_table.block_size)
    if (key_scales is None) != (value_scales is None) or (
        key_scales is not None
        and (key_scales.shape != scale_shape or value_scales is None or value_scales.shape != scale_shape)
    ):
        raise ShapeMismatchError(
            f"key_scales and value_scales must both be None or both {scale_shape} ([heads, blocks, block_size]), got "
            f"{None if key_scales is None else key_scales.shape} and {None if value_scales is None else value_scales.shape}"
        )
    group = query.shape[1] // num_heads
    compute = np.float64 if query.dtype == np.float64 else np.float32
    head_sinks: FloatArray | None = None
    if sinks is not None:
        if not isinstance(sinks, np.ndarray) or sinks.shape != (query.shape[1],) or sinks.dtype.kind != "f":
            raise InvalidArgumentError(
                f"sinks must be a [{query.shape[1]}] float array (one per query head), got "
                f"{getattr(sinks, 'dtype', type(sinks).__name__)} {getattr(sinks, 'shape', '')}"
            )
        check_finite_logits("sinks", sinks)
        head_sinks = sinks.astype(compute).reshape(num_heads, group)
    output = np.empty((*query.shape[:2], value_dim), dtype=query.dtype)
    for b in range(page_table.batch_size):
        q_start, q_stop = int(indptr[b]), int(indptr[b + 1])
        if q_stop == q_start:
            continue
        num_queries, seq_len = q_stop - q_start, int(page_table.seq_lens[b])
        rows = num_queries * group
        # [num_heads, queries * group, head_dim]: the query rows of one KV head together.
        q = (
            query[q_start:q_stop]
            .astype(compute, copy=False)
            .reshape(num_queries, num_heads, group, head_dim)
            .transpose(1, 0, 2, 3)
            .reshape(num_heads, rows, head_dim)
        )
        runs = [
            _Run(
                first_token=run.first_logical * page_table.block_size,
                tokens=min(run.length * page_table.block_size, seq_len - run.first_logical * page_table.block_size),
                keys=_run_view(key_cache, run.start, run.length, kv_layout),
                values=_run_view(value_cache, run.start, run.length, kv_layout),
                key_scales=None if key_scales is None else key_scales[:, run.start : run.start + run.length],
                value_scales=None if value_scales is None else value_scales[:, run.start : run.start + run.length],
            )
            for run in page_table.runs(b)
        ]
        row_positions = np.repeat(np.arange(seq_len - num_queries, seq_len), group)
        out = np.empty((num_heads, rows, value_dim), dtype=compute)
        row_chunk = max(1, _SCORE_BUDGET // (num_heads * seq_len))  # bounds long prefills' scores
        for first_row in range(0, rows, row_chunk):
            last_row = min(rows, first_row + row_chunk)
            out[:, first_row:last_row] = _attend_rows(
                q[:, first_row:last_row],
                runs,
                seq_len,
                row_positions[first_row:last_row],
                compute(checked_scale),
                causal=causal,
                window=window,
                block_size=page_table.block_size,
                softcap=cap,
                sinks=None if head_sinks is None else head_sinks[:, np.arange(first_row, last_row) % group],
                chunk=chunk_size,
            )
        output[q_start:q_stop] = (
            out.reshape(num_heads, num_queries, group, value_dim)
            .transpose(1, 0, 2, 3)
            .reshape(num_queries, num_heads * group, value_dim)
        )
    return output


def _effective_window(argument: object, page_table: PageTable) -> int | None:
    """The window to apply: the argument, else the page table's."""
    window = check_window(argument, "sliding_window")
    table_window = page_table.sliding_window
    if window is None:
        return table_window
    if table_window is not None and table_window != window:
        raise InvalidArgumentError(
            f"sliding_window={window} contradicts the page table's sliding_window={table_window}"
        )
    return window


def _as_tokens(run: FloatArray) -> FloatArray | None:
    """``[heads, blocks, block_size, dim]`` -> ``[heads, tokens, dim]`` if NumPy can do it
    as a view (NHD and heads_first pools); ``None`` when it would copy (HND)."""
    heads, blocks, tokens, dim = run.shape
    if blocks == 1 or run.strides[1] == tokens * run.strides[2]:
        return run.reshape(heads, blocks * tokens, dim)
    return None


def _window_runs(runs: list[_Run], first_key: int, block_size: int) -> list[_Run]:
    """The runs without the blocks wholly before position ``first_key``."""
    kept: list[_Run] = []
    for run in runs:
        if run.first_token + run.tokens <= first_key:
            continue
        skip = max(0, (first_key - run.first_token) // block_size)
        kept.append(run.skip_blocks(skip, block_size) if skip else run)
    return kept


def _attend_rows(
    q: FloatArray,
    runs: list[_Run],
    seq_len: int,
    row_positions: IntArray,
    scale: np.floating[Any],
    *,
    causal: bool,
    window: int | None,
    block_size: int,
    softcap: float | None = None,
    sinks: FloatArray | None = None,
    chunk: int | None = None,
) -> FloatArray:
    """Softmax attention of query rows ``[heads, rows, dim]`` over every run of a request.

    Each run's scores land in its slice of one ``[heads, rows, keys]`` buffer, one
    softmax normalises them, and each run adds its weighted values: the runs are read in
    place and no merge step is needed. ``row_positions [rows]`` are the rows' positions;
    ``sinks [heads, rows]`` the rows' sink logits."""
    heads, rows, _ = q.shape
    base = 0  # position of the buffer's first key
    first_row_position = int(row_positions.min())
    oldest_visible = 0
    if window is not None:
        oldest_visible = first_row_position - window + 1
    if chunk is not None:
        oldest_visible = max(oldest_visible, first_row_position // chunk * chunk)
    if oldest_visible > 0:
        runs = _window_runs(runs, oldest_visible, block_size)
        base = runs[0].first_token  # the row at the lowest position sees itself
    scores = np.empty((heads, rows, seq_len - base), dtype=q.dtype)
    for run in runs:
        _run_scores(q, run, scores[:, :, run.first_token - base : run.first_token - base + run.tokens])
    scores *= scale
    if softcap is not None:  # before the mask, as Gemma 2 applies it
        scores /= softcap
        np.tanh(scores, out=scores)
        scores *= softcap
    key_positions = np.arange(base, seq_len)[None, :]
    hidden: npt.NDArray[np.bool_] | None = None
    if causal and int(row_positions.min()) < seq_len - 1:
        hidden = key_positions > row_positions[:, None]  # [rows, keys]
    if window is not None and int(row_positions.max()) - window + 1 > base:
        too_old = key_positions <= row_positions[:, None] - window
        hidden = too_old if hidden is None else hidden | too_old
    if chunk is not None:
        row_chunks = row_positions[:, None] // chunk
        other_chunk = key_positions // chunk != row_chunks
        hidden = other_chunk if hidden is None else hidden | other_chunk
    if hidden is not None:
        np.copyto(scores, -np.inf, where=hidden[None])
    top = scores.max(axis=-1, keepdims=True)  # every row sees its own position: the max is finite
    if sinks is not None:
        top = np.maximum(top, sinks[:, :, None])
    scores -= top
    np.exp(scores, out=scores)
    result = np.zeros((heads, rows, runs[0].values.shape[3]), dtype=q.dtype)
    for run in runs:
        start = run.first_token - base
        result += _run_weighted_values(scores[:, :, start : start + run.tokens], run)
    denominator = scores.sum(axis=-1, keepdims=True)
    if sinks is not None:  # the sink joins the denominator and adds no value
        denominator += np.exp(sinks[:, :, None] - top)
    result /= denominator
    return result


def _run_scores(q: FloatArray, run: _Run, out: FloatArray) -> None:
    """``q [heads, rows, dim]`` against the run's keys, into ``out [heads, rows, tokens]``
    (times the keys' scales for a quantized pool: ``q . (raw * s) = (q . raw) * s``)."""
    _run_raw_scores(q, run, out)
    if run.key_scales is not None:
        heads = run.key_scales.shape[0]
        out *= run.key_scales.reshape(heads, -1)[:, None, : run.tokens].astype(out.dtype, copy=False)


def _run_raw_scores(q: FloatArray, run: _Run, out: FloatArray) -> None:
    dtype = q.dtype
    flat = _as_tokens(run.keys)
    if flat is not None:
        np.matmul(q, flat[:, : run.tokens].transpose(0, 2, 1).astype(dtype, copy=False), out=out)
        return
    # One product per block, batched over (head, block): still no copy of the pool.
    per_block: FloatArray = np.matmul(q[:, None], run.keys.transpose(0, 1, 3, 2).astype(dtype, copy=False))
    heads, blocks, rows, tokens = per_block.shape
    out[...] = per_block.transpose(0, 2, 1, 3).reshape(heads, rows, blocks * tokens)[:, :, : run.tokens]


def _run_weighted_values(weights: FloatArray, run: _Run) -> FloatArray:
    """``weights [heads, rows, tokens]`` times the run's values -> ``[heads, rows, dim]``
    (a quantized pool's value scales multiply the weights: ``w . (raw * s) = (w * s) . raw``)."""
    if run.value_scales is not None:
        heads = run.value_scales.shape[0]
        weights = weights * run.value_scales.reshape(heads, -1)[:, None, : run.tokens].astype(weights.dtype, copy=False)
    dtype = weights.dtype
    flat = _as_tokens(run.values)
    result: FloatArray
    if flat is not None:
        result = np.matmul(weights, flat[:, : run.tokens].astype(dtype, copy=False))
        return result
    heads, blocks, tokens, _ = run.values.shape
    padded = np.zeros((heads, weights.shape[1], blocks * tokens), dtype=dtype)
    padded[:, :, : run.tokens] = weights
    per_block = padded.reshape(heads, -1, blocks, tokens).transpose(0, 2, 1, 3)
    result = np.matmul(per_block, run.values.astype(dtype, copy=False)).sum(axis=1)
    return result
