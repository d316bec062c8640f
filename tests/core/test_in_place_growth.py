"""A decode step's fast paths change nothing but speed: growth inside the block of a request's
last token (:mod:`kvcache_core.paging.in_place`) and page tables extended by the blocks a step
appended (``PageTable.with_seq_lens(new_pages=...)``) give exactly what the general path gives
-- slots, page tables, lengths, free blocks, prefix-cache hits and errors -- over random
batches with forks (shared blocks), truncations, token ids and prefix caching."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core import AllocationRequest, KvCacheError, PagedKvCacheHandle
from kvcache_core.paging import in_place
from tests.core.support import DIM, HEADS, LAYERS, make_manager

# One operation: (kind, request index, amount).
OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["step", "step", "step", "step", "extend", "fork", "truncate", "release", "allocate"]),
        st.integers(0, 4),
        st.integers(0, 9),
    ),
    min_size=1,
    max_size=30,
)


def _ids(start: int, count: int) -> list[int]:
    """The token ids of positions ``start ..``: every request holds the same text, so a new
    request's prompt hits what others cached."""
    return [(position * 7) % 50 for position in range(start, start + count)]


def _replay(operations: list[tuple[str, int, int]], prefix: bool, fast: bool) -> list[object]:
    """Run ``operations`` on a fresh manager, with the fast paths or without; what each
    operation gave, as plain values."""
    manager = make_manager(48, enable_prefix_caching=prefix)
    handles: list[PagedKvCacheHandle[np.ndarray]] = []
    seen: list[object] = []
    names = 0
    general = mock.patch("kvcache_core._data_path.plan_in_place", return_value=None)
    with contextlib.nullcontext() if fast else general:
        for kind, which, amount in [("allocate", 0, 5), ("allocate", 0, 0), *operations]:
            try:
                if kind == "allocate" or not handles:
                    prompt = _ids(0, amount)
                    handles.append(manager.allocate(AllocationRequest(f"r{names}", prompt_token_ids=prompt)))
                    names += 1
                    seen.append(("allocated", handles[-1].num_cached_tokens()))
                    continue
                handle = handles[which % len(handles)]
                if kind == "step":
                    counts = [(amount + offset) % 3 for offset in range(len(handles))]
                    ids = [
                        None if (amount + row) % 4 == 0 else _ids(h.num_tokens(), count)
                        for row, (h, count) in enumerate(zip(handles, counts, strict=True))
                    ]
                    step = manager.begin_step(handles, counts, token_ids=ids)
                    table = step.page_table
                    seen.append(
                        (
                            step.slots.tolist(),
                            table.kv_indptr.tolist(),
                            table.kv_indices.tolist(),
                            table.block_tables.tolist(),
                            table.seq_lens.tolist(),
                            table.kv_last_page_len.tolist(),
                        )
                    )
                    for layer in range(LAYERS):
                        data = np.full((len(step.slots), HEADS, DIM), layer + 1, dtype=np.float32)
                        step.write(layer, data, data)
                elif kind == "extend":
                    seen.append(manager.extend(handle, amount % 5).tolist())
                elif kind == "fork":
                    handles.append(manager.fork(handle, f"r{names}"))
                    names += 1
                elif kind == "truncate":
                    manager.truncate(handle, min(amount, handle.num_tokens()))
                else:
                    manager.deallocate(handles.pop(which % len(handles)).request_id)
            except KvCacheError as error:
                seen.append(type(error).__name__)
            stats = manager.stats()
            seen.append(([h.num_tokens() for h in handles], stats.free_blocks, stats.cached_blocks))
        seen.append(manager.stats().prefix_cache_hits)
    return seen


@settings(max_examples=80, deadline=None)
@given(operations=OPERATIONS, prefix=st.booleans())
def test_the_fast_paths_equal_the_general_path(operations: list[tuple[str, int, int]], prefix: bool) -> None:
    assert _replay(operations, prefix, fast=True) == _replay(operations, prefix, fast=False)


def test_a_ragged_decode_grows_mostly_in_place() -> None:
    manager = make_manager(64, enable_prefix_caching=True)
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(3)]
    manager.begin_step(handles, [3, 6, 9], token_ids=[_ids(0, 3), _ids(0, 6), _ids(0, 9)])
    with mock.patch("kvcache_core._data_path.grow_in_place", wraps=in_place.grow_in_place) as grown:
        for _ in range(8):
            lengths = [handle.num_tokens() for handle in handles]
            manager.begin_step(handles, 1, token_ids=[_ids(length, 1) for length in lengths])
    # Blocks of 4: of the 24 growths, 6 start a block (the general path), 18 grow in place.
    assert sum(len(call.args[3].rows) for call in grown.call_args_list) == 18
