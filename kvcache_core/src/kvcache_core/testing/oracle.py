"""The dense-attention oracle: textbook softmax attention over contiguous K/V, in float64.

What paged attention must equal, written the obvious way so that it is easy to trust:
every query row scores every key it may see, softmax, weighted sum of values. No pool, no
page table, no blocks (for the NumPy paged reference that reads a pool through a page
table, see :func:`kvcache_core.attention.reference.paged_attention`; that one is a backend's
reference path, this one is what the tests hold every path to).

Positions: key ``j`` of a request sits at ``key_start + j`` (``key_start`` > 0 when a
sliding window released the leading blocks); query row ``i`` sits at ``query_start + i``,
by default the request's last ``q`` positions (``key_start + n - q``), as in decode and
chunked prefill. A row at position ``p`` sees key position ``k`` when ``k <= p`` (causal)
and ``k > p - sliding_window`` (with a window).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["dense_attention", "dense_attention_batch"]

FloatArray = npt.NDArray[np.float64]


def dense_attention(
    query: npt.ArrayLike,
    keys: npt.ArrayLike,
    values: npt.ArrayLike,
    *,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    key_start: int = 0,
    query_start: int | None = None,
) -> FloatArray:
    """Softmax attention of one request's query rows over its contiguous keys and values.

    Args:
        query: ``[q, num_query_heads, head_dim]``; ``num_query_heads`` is a multiple of the
            KV heads (grouped-query: query head ``h`` reads KV head ``h // group``).
        keys, values: ``[n, num_kv_heads, head_dim]`` and ``[n, num_kv_heads, value_dim]``
            (the values' width may differ from the keys'), key ``j`` at position ``key_start + j``.
        causal: mask keys after each row's position.
        scale: the score scale; ``1 / sqrt(head_dim)`` by default.
        sliding_window: ``W``: a row at ``p`` sees only keys after ``p - W``.
        key_start: the position of the first key.
        query_start: the position of the first query row; the last ``q`` positions by default.

    Returns:
        ``[q, num_query_heads, value_dim]`` float64. A row that sees no key is all zeros.

    Raises:
        ValueError: when the shapes do not fit together.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"query [q, Hq, D], keys [n, H, D] and values [n, H, Dv] expected, got {q.shape}, {k.shape}, {v.shape}"
        )
    num_queries, query_heads, head_dim = q.shape
    num_tokens, kv_heads, _ = k.shape
    if kv_heads == 0 or query_heads % kv_heads:
        raise ValueError(f"{query_heads} query heads are not a multiple of {kv_heads} KV heads")
    group = query_heads // kv_heads
    first_query = key_start + num_tokens - num_queries if query_start is None else query_start
    row_positions: npt.NDArray[np.int64] = np.arange(first_query, first_query + num_queries, dtype=np.int64)[:, None]
    key_positions: npt.NDArray[np.int64] = np.arange(key_start, key_start + num_tokens, dtype=np.int64)[None, :]
    visible: npt.NDArray[np.bool_] = np.ones((num_queries, num_tokens), dtype=np.bool_)
    if causal:
        visible = visible & (key_positions <= row_positions)
    if sliding_window is not None:
        visible = visible & (key_positions > row_positions - sliding_window)
    factor = 1.0 / math.sqrt(head_dim) if scale is None else scale
    expanded_keys = np.repeat(k, group, axis=1)  # [n, Hq, D]
    expanded_values = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, expanded_keys) * factor
    scores = np.where(visible[None], scores, -np.inf)
    peak = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    weights = np.exp(scores - np.where(np.isfinite(peak), peak, 0.0))
    totals = weights.sum(axis=-1, keepdims=True)
    weights = np.divide(weights, totals, out=np.zeros_like(weights), where=totals > 0)
    output: FloatArray = np.einsum("hqk,khd->qhd", weights, expanded_values)
    return output


def dense_attention_batch(
    query: npt.ArrayLike,
    contexts: Sequence[tuple[Any, Any]],
    query_counts: Sequence[int],
    *,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> FloatArray:
    """:func:`dense_attention` of a ragged batch: ``query`` ``[sum(query_counts), Hq, D]``
    holds each request's rows in turn (the order of ``qo_indptr``), ``contexts`` each
    request's ``(keys, values)`` ``[n_i, H, D]``; returns the rows in the same order."""
    rows = np.asarray(query, dtype=np.float64)
    if len(contexts) != len(query_counts) or sum(query_counts) != rows.shape[0]:
        raise ValueError(f"{len(contexts)} contexts, query counts {list(query_counts)} for {rows.shape[0]} query rows")
    outputs: list[FloatArray] = []
    start = 0
    for (keys, values), count in zip(contexts, query_counts, strict=True):
        outputs.append(
            dense_attention(
                rows[start : start + count], keys, values, causal=causal, scale=scale, sliding_window=sliding_window
            )
        )
        start += count
    if not outputs:
        return np.zeros(rows.shape, dtype=np.float64)
    return np.concatenate(outputs)
