"""The thin per-layer path of a step: ``write_and_attend`` equals a write then an attention,
refuses bad input before writing anything, and a decode step's page table shares the last
one's pages only when no request's blocks changed (``PageTable.with_seq_lens``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import AllocationRequest, InvalidArgumentError
from kvcache_core.errors import ShapeMismatchError
from tests.core.support import DIM, HEADS, LAYERS, make_manager


def kv(tokens: int, seed: int) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((tokens, HEADS, DIM)).astype(np.float32)


def test_write_and_attend_equals_a_write_then_an_attention() -> None:
    results: list[list[npt.NDArray[np.float32]]] = []
    for combined in (False, True):
        manager = make_manager(enable_prefix_caching=False)
        handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
        prefill = manager.begin_step(handles, [5, 3])
        for layer in range(LAYERS):
            prefill.write(layer, kv(8, layer), kv(8, layer + 10))
        step = manager.begin_step(handles, 1)
        outputs: list[npt.NDArray[np.float32]] = []
        for layer in range(LAYERS):
            keys, values, query = kv(2, 20 + layer), kv(2, 30 + layer), kv(2, 40 + layer)
            if combined:
                outputs.append(step.write_and_attend(layer, keys, values, query))
            else:
                step.write(layer, keys, values)
                outputs.append(step.attention(layer, query))
        results.append(outputs)
    for separate, combined_output in zip(*results, strict=True):
        np.testing.assert_array_equal(separate, combined_output)


def test_a_refused_attention_writes_nothing() -> None:
    manager = make_manager(enable_prefix_caching=False)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], 3)
    keys, values = kv(3, 1), kv(3, 2)
    with pytest.raises(ShapeMismatchError):
        step.write_and_attend(0, keys, values, kv(2, 3))  # a query of 2 tokens for a step of 3
    with pytest.raises(InvalidArgumentError):
        step.write_and_attend(0, keys, values, kv(3, 3), scale=-1.0)
    stored_keys, _ = manager.gather(handle, 0)
    assert not np.any(stored_keys)  # the pool's slots still hold zeros: nothing was written


def test_a_decode_page_table_shares_the_pages_until_a_block_is_added() -> None:
    manager = make_manager(enable_prefix_caching=False)
    handle = manager.allocate(AllocationRequest("a"))
    first = manager.begin_step([handle], 5).page_table  # 5 tokens in 2 blocks of 4
    second = manager.begin_step([handle], 1).page_table  # 6 tokens: the same 2 blocks
    assert second.kv_indices is first.kv_indices
    assert second.seq_lens.tolist() == [6]
    assert second.kv_last_page_len.tolist() == [2]
    third = manager.begin_step([handle], 3).page_table  # 9 tokens: a third block
    assert third.kv_indices is not first.kv_indices
    assert third.kv_indptr.tolist() == [0, 3]
    assert third.seq_lens.tolist() == [9]


@pytest.mark.parametrize("lengths", [[-1], [1.5], ["7"], [2**31], [9], [4], [5, 6]])
def test_with_seq_lens_refuses_lengths_its_pages_do_not_fit(lengths: list[object]) -> None:
    manager = make_manager(enable_prefix_caching=False)
    handle = manager.allocate(AllocationRequest("a"))
    table = manager.begin_step([handle], 5).page_table  # 2 pages of 4: lengths 5 to 8 fit
    with pytest.raises(InvalidArgumentError):
        table.with_seq_lens(lengths)  # type: ignore[arg-type]
    assert table.seq_lens.tolist() == [5]
    assert table.with_seq_lens([8]).kv_last_page_len.tolist() == [4]


@pytest.mark.parametrize("lengths", [[-1], [-3], [0.5]])
def test_with_seq_lens_refuses_a_bad_length_of_an_empty_request(lengths: list[object]) -> None:
    manager = make_manager(enable_prefix_caching=False)
    handle = manager.allocate(AllocationRequest("a"))
    table = manager.page_table([handle])  # no token, no page
    with pytest.raises(InvalidArgumentError):
        table.with_seq_lens(lengths)  # type: ignore[arg-type]
    assert table.with_seq_lens([0]).seq_lens.tolist() == [0]


def test_with_seq_lens_appends_new_pages_as_a_rebuilt_table_lists_them() -> None:
    manager = make_manager(enable_prefix_caching=False)
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b", "c")]
    before = manager.begin_step(handles, [4, 8, 2]).page_table  # 1, 2 and 1 pages of 4
    after = manager.begin_step(handles, [1, 1, 1]).page_table  # "a" and "b" start a page
    appended = [[int(after.blocks(0)[-1])], [int(after.blocks(1)[-1])], []]
    grown = before.with_seq_lens([5, 9, 3], new_pages=appended)
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "block_tables", "seq_lens"):
        np.testing.assert_array_equal(getattr(grown, name), getattr(after, name))
        assert not getattr(grown, name).flags.writeable
    assert grown.request_ids == before.request_ids


@pytest.mark.parametrize(
    ("new_pages", "lengths"),
    [
        ([[9]], [5]),  # one request's pages for a batch of two
        ([[9], None], [5, 4]),
        ([[-1], []], [5, 4]),
        ([[2**31], []], [5, 4]),
        ([[1.5], []], [5, 4]),
        ([["9"], []], [5, 4]),
        ([[9], []], [4, 4]),  # a length that does not need the new page
        ([[9, 10], []], [5, 4]),  # two pages for one more token
    ],
)
def test_with_seq_lens_refuses_new_pages_that_do_not_fit(new_pages: list[object], lengths: list[int]) -> None:
    manager = make_manager(enable_prefix_caching=False)
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    table = manager.begin_step(handles, [4, 3]).page_table
    with pytest.raises(InvalidArgumentError):
        table.with_seq_lens(lengths, new_pages=new_pages)  # type: ignore[arg-type]
    assert table.kv_indptr.tolist() == [0, 1, 2]
    assert table.seq_lens.tolist() == [4, 3]
