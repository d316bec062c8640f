"""The kernel's work plan (:func:`~kvcache_core.attention.kernel_plan.plan_batch`) compiled
with numba: a decode step plans its batch once, and in Python over a few ints per request it
cost 27 us in isolation (2.3 us compiled; 8 requests, AMD EPYC, 2 cores) and some 50 us
inside a model, whose work had pushed the interpreter's code out of the CPU's caches (there a
first call of anything pays most of that). Imported only where the kernel runs (numba is
installed). A key's visibility is the kernel's own rule (``_kernel_jit._visible``).
"""

# pyright: reportUntypedFunctionDecorator=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownMemberType=false
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false

from __future__ import annotations

import numpy as np
from numba import njit

from kvcache_core.attention._kernel_cache import register_locators
from kvcache_core.attention._kernel_jit import _visible  # pyright: ignore[reportPrivateUsage]

# Before any decorator: the cached functions' locators stamp every kernel source.
register_locators()

__all__ = ["plan_work"]


@njit(cache=True, nogil=True)
def plan_work(  # type: ignore[no-untyped-def]
    seq_lens, offsets, num_heads, group, causal, window, chunk, threads, tuning
):
    """The items ``[n, 7]`` (longest first, ties in order), merges ``[m, 5]``, threads and
    partial rows of a batch (``seq_lens`` int32 ``[B]``, ``offsets`` the query offsets ``[B +
    1]``); ``tuning``: rows per item, fewest keys per split, the cost of reading a row, the
    least work worth a thread. As :class:`~kvcache_core.attention.kernel_plan.Plan` describes."""
    row_split, min_split_keys, read_cost, min_thread_work = tuning[0], tuning[1], tuning[2], tuning[3]
    requests = seq_lens.shape[0]
    count = 0  # row chunks
    for request in range(requests):
        rows = (offsets[request + 1] - offsets[request]) * group
        count += (rows + row_split - 1) // row_split
    # Per row chunk: work per head, request, first row, last row, sequence length, first key.
    chunks = np.empty((count, 6), dtype=np.int64)
    decode_first = np.full(requests, -1, dtype=np.int64)  # a one-chunk request's first key
    total, at = 0, 0
    for request in range(requests):
        num_queries = offsets[request + 1] - offsets[request]
        seq_len = np.int64(seq_lens[request])
        rows, first_query = num_queries * group, seq_len - num_queries
        for first_row in range(0, rows, row_split):
            last_row = min(rows, first_row + row_split)
            high = first_query + (last_row - 1) // group + 1 if causal else seq_len
            low = _visible(first_query + first_row // group, 0, seq_len, False, window, chunk)[0]  # oldest key seen
            work = (high - low) * (read_cost + last_row - first_row)
            chunks[at, 0], chunks[at, 1], chunks[at, 2] = work, request, first_row
            chunks[at, 3], chunks[at, 4], chunks[at, 5] = last_row, seq_len, low
            total += work * num_heads
            at += 1
        if 0 < rows <= row_split:
            decode_first[request] = chunks[at - 1, 5]
    threads = max(1, min(threads, total // min_thread_work))
    pieces = count * num_heads
    splits = np.ones(requests, dtype=np.int64)
    if threads > 1 and pieces < 4 * threads:
        wanted = -(-4 * threads // pieces)
        for request in range(requests):
            if decode_first[request] >= 0:
                splits[request] = max(1, min(wanted, (seq_lens[request] - decode_first[request]) // min_split_keys))
    size, merge_count = 0, 0
    for index in range(count):
        split = splits[chunks[index, 1]]
        size += num_heads * split
        merge_count += num_heads if split > 1 else 0
    work_of = np.empty(size, dtype=np.int64)
    items = np.empty((size, 7), dtype=np.int64)
    merges = np.empty((merge_count, 5), dtype=np.int64)
    partial_rows, at, merged = 0, 0, 0
    for index in range(count):
        work, request, first_row = chunks[index, 0], chunks[index, 1], chunks[index, 2]
        last_row, seq_len, low = chunks[index, 3], chunks[index, 4], chunks[index, 5]
        split = splits[request]
        for head in range(num_heads):
            if split == 1:
                work_of[at] = work
                items[at, 0], items[at, 1], items[at, 2], items[at, 3] = request, head, first_row, last_row
                items[at, 4], items[at, 5], items[at, 6] = 0, seq_len, -1
                at += 1
                continue
            rows = last_row - first_row
            merges[merged, 0], merges[merged, 1], merges[merged, 2] = request, head, rows
            merges[merged, 3], merges[merged, 4] = partial_rows, split
            merged += 1
            for part in range(split):
                work_of[at] = work // split
                items[at, 0], items[at, 1], items[at, 2], items[at, 3] = request, head, first_row, last_row
                items[at, 4] = low + (seq_len - low) * part // split
                items[at, 5] = low + (seq_len - low) * (part + 1) // split
                items[at, 6] = partial_rows + part * rows
                at += 1
            partial_rows += split * rows
    order = np.argsort(-work_of, kind="mergesort")  # longest first, ties in order (stable)
    return np.ascontiguousarray(items[order]), min(threads, size), merges, partial_rows
