"""The merge of a long context's KV splits (FlashDecoding), compiled: the second pass of
:mod:`kvcache_core.attention._kernel_jit`, which re-exports it (nothing else imports this
module). Each split left an unnormalised accumulator, its maximum and sum; the rows are
merged with a log-sum-exp.
"""

from __future__ import annotations

# numba publishes no type information: the decorated functions are untyped by nature.
# pyright: reportUntypedFunctionDecorator=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownMemberType=false
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
import math

import numpy as np
from numba import njit
from numba.np.numpy_support import carray

from kvcache_core.attention._kernel_cache import register_locators
from kvcache_core.attention._kernel_ir import address_pointer
from kvcache_core.attention._kernel_rows import FASTMATH

# Before any decorator: the cached functions' locators stamp every kernel source.
register_locators()

__all__ = ["merge_splits", "merge_splits_at"]


@njit(cache=True, nogil=True, fastmath=FASTMATH)  # (the kernel's: -inf is a real value here too)
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


@njit(cache=True, nogil=True)
def merge_splits_at(qo_indptr, merges, group, out_address, out_shape, partial_acc, partial_stats, sinks):  # type: ignore[no-untyped-def]
    """:func:`merge_splits` into the C-contiguous float32 output at ``out_address`` of
    ``out_shape`` (a caller's array, by address: nothing converted)."""
    out = carray(address_pointer(out_address, np.float32), out_shape)
    merge_splits(qo_indptr, merges, group, out, partial_acc, partial_stats, sinks)
