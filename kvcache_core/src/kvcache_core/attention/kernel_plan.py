"""The work plan of one batch of the compiled paged-attention kernel
(:mod:`kvcache_core.attention.kernel`): which (request, KV head, query rows, key range) items
its threads claim, longest first, where long contexts are split across threads and merged,
computed once per page table, query offsets and geometry.
"""

from __future__ import annotations

import functools
import importlib
import threading
import weakref
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


@functools.cache
def _plan_work() -> Any:
    """The compiled planner, imported at the first plan (it needs numba, as the kernel does)."""
    return importlib.import_module("kvcache_core.attention._plan_jit").plan_work


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
    ``window`` and ``chunk`` 0 when unset. Per request and row chunk of :data:`ROW_SPLIT`
    rows, one item per KV head, weighted by its keys times (rows + the cost of reading a
    row); where the threads would have fewer than four pieces each, the one-chunk requests'
    keys are split (at most as many ways, each of :data:`MIN_SPLIT_KEYS` keys or more) and
    their partial results merged. A batch worth less than :data:`MIN_THREAD_WORK` per thread
    runs on fewer threads.

    Compiled (:mod:`._plan_jit`): the kernel that reads the plan needs numba anyway, and the
    plan is made once per decode step, inside a model, where interpreted code runs slowly.
    """
    tuning = (ROW_SPLIT, MIN_SPLIT_KEYS, _ROW_READ_COST, MIN_THREAD_WORK)
    items, threads, merges, partial_rows = _plan_work()(
        page_table.seq_lens, qo_indptr, num_heads, group, bool(causal), window, chunk, threads, tuning
    )
    items.flags.writeable = False
    merges.flags.writeable = False
    return Plan(items=items, threads=int(threads), merges=merges, partial_rows=int(partial_rows))


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
