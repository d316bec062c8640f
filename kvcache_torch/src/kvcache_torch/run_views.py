"""torch's own attention over zero-copy views of a request's run of blocks.

A request the allocator kept in one run of consecutive blocks is, in the heads-first layout,
one contiguous ``[H, tokens, D]`` view per pool (``[tokens, H, D]`` in NHD, read through a
transposed view): a decode step of that request is one ``scaled_dot_product_attention`` call
on the pool in place, as dense attention on contiguous K/V is, with nothing gathered. The
native path of :func:`kvcache_torch.attention.attend_pool` takes this lane where it applies
and its general path (pieces of runs, masks, features) elsewhere. transformers' contiguous
path hands such a request's K/V to the model's own attention the same way
(``Step.padded_view``), where ``DynamicCache`` copies the whole K/V at every step.
"""

from __future__ import annotations

import weakref

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.contract.page_table import PageTable

__all__ = ["one_run_decode", "one_run_span"]

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
    run = page_table.one_run_slots()
    span = run if run is not None and run[1] else None
    _SPANS[page_table] = span
    return span


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
