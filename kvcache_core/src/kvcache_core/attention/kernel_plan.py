"""The work plan of one batch of the compiled paged-attention kernel
(:mod:`kvcache_core.attention.kernel`): which (request, KV head, query rows, key range) items
its threads claim, longest first, where long contexts are split across threads and merged,
computed once per page table, query offsets and geometry.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.page_table import PageTable

__all__ = ["MIN_SPLIT_KEYS", "MIN_THREAD_WORK", "ROW_SPLIT", "Plan", "cached_plan", "plan_batch"]

#: Rows (queries x group) per work item of a long prefill.
ROW_SPLIT: Final = 64
#: Fewest keys in one KV split.
MIN_SPLIT_KEYS: Final = 512

#: Rough cost of reading one K/V row from memory, in units of one query row's products with it.
_ROW_READ_COST = 8
#: Least work (in those units, about 3 ns each) worth a thread of its own: waking a worker and
#: waiting for it costs some 30-50 us, so a small batch runs on the calling thread alone.
MIN_THREAD_WORK = 16384

IndexArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Plan:
    """The work of one batch: items ``[n, 7]`` (request, kv_head, first_row, last_row,
    first_key, last_key, partial_row), longest first, for ``threads`` threads; merges ``[m,
    5]`` (request, kv_head, rows, first_partial_row, splits), partial rows."""

    items: IndexArray
    threads: int
    merges: IndexArray
    partial_rows: int


_plans: weakref.WeakKeyDictionary[PageTable, dict[tuple[Any, ...], Plan]] = weakref.WeakKeyDictionary()
_plans_lock = threading.Lock()


def plan_batch(
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    num_heads: int,
    group: int,
    causal: bool,
    window: int,
    threads: int,
    chunk: int = 0,
) -> Plan:
    """Work items and their shares for ``threads`` threads (see the module docstring);
    ``window`` and ``chunk`` 0 when unset.

    Plain Python over a few ints per request (once per decode step: NumPy's calls on arrays
    this small cost more, the more so in a model's forward, whose weights have pushed them out
    of the CPU's caches)."""
    seq_lens = page_table.seq_lens.tolist()
    offsets = qo_indptr.tolist()
    # Per (request, row chunk), in that order: (work per head, request, first_row, last_row, seq_len, low).
    chunks: list[tuple[int, int, int, int, int, int]] = []
    decode_like: list[tuple[int, int]] = []  # (request, first_key) of one-chunk requests
    total = 0
    for request, seq_len in enumerate(seq_lens):
        num_queries = offsets[request + 1] - offsets[request]
        if num_queries == 0:
            continue
        rows, first_query = num_queries * group, seq_len - num_queries
        for first_row in range(0, rows, ROW_SPLIT):
            last_row = min(rows, first_row + ROW_SPLIT)
            high = first_query + (last_row - 1) // group + 1 if causal else seq_len
            low = _first_visible(first_query + first_row // group, window, chunk)
            work = (high - low) * (_ROW_READ_COST + last_row - first_row)
            chunks.append((work, request, first_row, last_row, seq_len, low))
            total += work * num_heads
        if rows <= ROW_SPLIT:  # one chunk: its low is the request's first visible key
            decode_like.append((request, chunks[-1][5]))
    threads = max(1, min(threads, total // MIN_THREAD_WORK))
    pieces = len(chunks) * num_heads  # one per chunk and KV head
    split: dict[int, tuple[int, int]] = {}  # request -> (splits, first key)
    if threads > 1 and pieces < 4 * threads and decode_like:
        wanted = math.ceil(4 * threads / pieces)
        for request, first_key in decode_like:
            splits = min(wanted, (seq_lens[request] - first_key) // MIN_SPLIT_KEYS)
            if splits > 1:
                split[request] = (splits, first_key)
    items: list[tuple[int, int, int, int, int, int, int, int]] = []  # (work, *item)
    merges: list[tuple[int, int, int, int, int]] = []
    partial_rows = 0
    for work, request, first_row, last_row, seq_len, _ in chunks:
        if request not in split:
            items.extend((work, request, head, first_row, last_row, 0, seq_len, -1) for head in range(num_heads))
            continue
        splits, low = split[request]
        rows = last_row - first_row
        bounds = [low + (seq_len - low) * index // splits for index in range(splits + 1)]
        for head in range(num_heads):
            merges.append((request, head, rows, partial_rows, splits))
            items.extend(
                (
                    work // splits,
                    request,
                    head,
                    first_row,
                    last_row,
                    bounds[index],
                    bounds[index + 1],
                    partial_rows + index * rows,
                )
                for index in range(splits)
            )
            partial_rows += splits * rows
    items.sort(key=operator.itemgetter(0), reverse=True)  # longest first (stable): the threads claim them so
    return Plan(
        items=_frozen(items, 8, 1),
        threads=min(threads, len(items)),
        merges=_frozen(merges, 5),
        partial_rows=partial_rows,
    )


def _frozen(rows: Sequence[tuple[int, ...]], columns: int, skip: int = 0) -> IndexArray:
    """``rows`` of ``columns`` ints, less their first ``skip``, as a read-only C-contiguous int64 array."""
    array = np.array(rows, dtype=np.int64).reshape(-1, columns)
    if skip:
        array = np.ascontiguousarray(array[:, skip:])
    array.flags.writeable = False
    return array


def _first_visible(position: int, window: int, chunk: int) -> int:
    """The oldest key the query at ``position`` may see (``window``/``chunk`` 0: unset)."""
    low = max(0, position - window + 1) if window > 0 else 0
    return max(low, position // chunk * chunk) if chunk > 0 else low


def cached_plan(page_table: PageTable, qo_indptr: npt.NDArray[np.int32], *key: Any) -> Plan:
    """:func:`plan_batch`, computed once per page table, query offsets and geometry."""
    full_key = (qo_indptr.tobytes(), *key)
    with _plans_lock:
        known = _plans.get(page_table)
        if known is not None and full_key in known:
            return known[full_key]
    plan = plan_batch(page_table, qo_indptr, *key)
    with _plans_lock:
        known = _plans.setdefault(page_table, {})
        if len(known) > 8:  # one table attended in many ways: keep the latest few
            known.clear()
        known[full_key] = plan
    return plan
