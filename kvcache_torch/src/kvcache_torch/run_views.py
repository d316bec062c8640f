"""torch's own attention over zero-copy views of a request's run of blocks.

A request the allocator kept in one run of consecutive blocks is, in the heads-first layout,
one contiguous ``[H, tokens, D]`` view per pool (``[tokens, H, D]`` in NHD, read through a
transposed view): a decode step of that request is one ``scaled_dot_product_attention`` call
on the pool in place, as dense attention on contiguous K/V is, with nothing gathered. The
native path of :func:`kvcache_torch.attention.attend_pool` takes this lane where it applies
and its general path (pieces of runs, masks, features) elsewhere.
"""

from __future__ import annotations

import weakref

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.contract.page_table import PageTable

__all__ = ["one_run_decode", "one_run_span", "request_run_views"]

#: Per page table: ``(first slot, tokens)`` of its one request when that request's blocks
#: are one run, else ``None`` (the layers of a step share the table: found once per step).
_SPANS: weakref.WeakKeyDictionary[PageTable, tuple[int, int] | None] = weakref.WeakKeyDictionary()


def one_run_span(page_table: PageTable, qo_indptr: npt.NDArray[np.int32]) -> tuple[int, int] | None:
    """``(first slot, tokens)`` of a decode step of one request whose blocks are one run of
    consecutive blocks, without the table's window; ``None`` for any other step."""
    if qo_indptr.shape[0] != 2 or int(qo_indptr[1]) != 1 or page_table.sliding_window is not None:
        return None
    return _span(page_table)


def _span(page_table: PageTable) -> tuple[int, int] | None:
    if page_table in _SPANS:
        return _SPANS[page_table]
    span = None
    if page_table.batch_size == 1 and page_table.kv_indices.shape[0] and page_table.one_run_each:
        span = (int(page_table.kv_indices[0]) * page_table.block_size, int(page_table.seq_lens[0]))
    _SPANS[page_table] = span
    return span


#: Per layout whose blocks' tokens follow each other: the axes of (head, block, token in block).
_RUN_AXES = {"heads_first": (0, 1, 2), "NHD": (2, 0, 1)}


def request_run_views(
    page_table: PageTable, key_cache: torch.Tensor, value_cache: torch.Tensor, kv_layout: str, tokens: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The last ``tokens`` tokens of the one request of ``page_table`` as ``[1, heads,
    tokens, dim]`` views of one layer's pools (values: their own width), when its blocks are
    one run: what a dense attention reads, with nothing copied (each head's tokens contiguous
    in the heads-first layout, strided in NHD). ``None`` for another batch, blocks in several
    runs, a table with a window, more tokens than the request holds, the HND layout, or pools
    whose blocks do not follow each other in memory.

    The views show the pool: valid until its blocks are written, freed or reused.
    """
    axes = _RUN_AXES.get(kv_layout)
    if axes is None or page_table.sliding_window is not None:
        return None
    span = _span(page_table)
    if span is None or not 0 <= tokens <= span[1]:
        return None
    first = span[0] + span[1] - tokens
    keys, values = _run_view(key_cache, axes, first, tokens), _run_view(value_cache, axes, first, tokens)
    return None if keys is None or values is None else (keys, values)


def _run_view(cache: torch.Tensor, axes: tuple[int, int, int], first: int, tokens: int) -> torch.Tensor | None:
    """Slots ``[first, first + tokens)`` of a pool view as ``[1, heads, tokens, dim]``, one
    ``as_strided`` (a slot's token follows the one before across a block's end)."""
    heads, blocks, token = axes
    stride = cache.stride()
    if stride[blocks] != cache.shape[token] * stride[token]:
        return None
    shape = (1, cache.shape[heads], tokens, cache.shape[3])
    strides = (cache.shape[heads] * stride[heads], stride[heads], stride[token], stride[3])
    return cache.as_strided(shape, strides, cache.storage_offset() + first * stride[token])


def one_run_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    scale: float,
    kv_layout: str,
) -> torch.Tensor | None:
    """The attention of a decode step of one request whose blocks are one run: one fused call
    on views of the pools; ``None`` where this lane does not apply (another batch, several
    query tokens, several runs, the HND layout).

    Args:
        query: ``[1, num_query_heads, head_dim]``.
        key_cache, value_cache: one layer's pool in ``kv_layout``.
        page_table, qo_indptr: the batch's pages and query offsets.
        scale: score scale.

    Returns:
        ``[1, num_query_heads, value_dim]`` in ``query``'s dtype, or ``None``.
    """
    if query.shape[0] != 1 or kv_layout == "HND" or qo_indptr.shape[0] != 2:
        return None
    span = _span(page_table)
    if span is None:
        return None
    first, tokens = span
    if kv_layout == "heads_first":  # [H, blocks, bs, D] -> [H, tokens, D]
        keys = key_cache.flatten(1, 2).narrow(1, first, tokens)
        values = value_cache.flatten(1, 2).narrow(1, first, tokens)
    else:  # NHD [blocks, bs, H, D] -> [H, tokens, D], strided
        keys = key_cache.flatten(0, 1).narrow(0, first, tokens).transpose(0, 1)
        values = value_cache.flatten(0, 1).narrow(0, first, tokens).transpose(0, 1)
    heads, head_dim = keys.shape[0], query.shape[2]
    rows = query.view(1, heads, query.shape[1] // heads, head_dim)  # query head h * G + g reads KV head h
    with torch.no_grad():
        output = torch.nn.functional.scaled_dot_product_attention(rows, keys[None], values[None], scale=scale)
    return output.view(1, query.shape[1], values.shape[-1])
