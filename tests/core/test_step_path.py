"""The thin per-layer path of a step: ``write_and_attend`` equals a write then an attention,
refuses bad input before writing anything, a decode step's page table shares the last
one's pages only when no request's blocks changed (``PageTable.with_seq_lens``), and a step
advanced (``Step.advance``) plans what ``begin_step`` plans, or refuses and changes nothing."""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import AllocationRequest, InvalidArgumentError, OutOfBlocksError, SequenceTooLongError, Step
from kvcache_core.errors import ShapeMismatchError, StaleStepError
from kvcache_core.paging import in_place, padded
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.sequences import SequenceBlocks
from tests.core.support import BLOCK, DIM, HEADS, LAYERS, Manager, make_manager


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


def _snapshot(manager: Manager, step: Step[Any]) -> tuple[object, ...]:
    """What a step planned and the manager holds, comparable across managers."""
    table = step.page_table
    return (
        step.slots.tolist(),
        step.qo_indptr.tolist(),
        table.kv_indices.tolist(),
        table.kv_indptr.tolist(),
        table.seq_lens.tolist(),
        table.kv_last_page_len.tolist(),
        [(request_id, handle.num_tokens()) for request_id, handle in manager.list_handles()],
        manager.stats().free_blocks,
    )


@pytest.mark.parametrize("lengths", [[5], [3, 4, 8]])
def test_a_step_advanced_plans_what_begin_step_plans(lengths: list[int]) -> None:
    managers = [make_manager(enable_prefix_caching=False) for _ in range(2)]
    handles = [[manager.allocate(AllocationRequest(f"r{row}")) for row in range(len(lengths))] for manager in managers]
    steps = [manager.begin_step(rows, lengths) for manager, rows in zip(managers, handles, strict=True)]
    for turn in range(9):  # across block boundaries (blocks of 4): some in place, some not
        advanced = steps[0].advance()
        planned = managers[1].begin_step(handles[1], 1)
        assert _snapshot(managers[0], advanced) == _snapshot(managers[1], planned), f"turn {turn}"
        for layer in range(LAYERS):
            keys, values, query = kv(len(lengths), turn), kv(len(lengths), turn + 50), kv(len(lengths), turn + 90)
            np.testing.assert_array_equal(
                advanced.write_and_attend(layer, keys, values, query),
                planned.write_and_attend(layer, keys, values, query),
            )
        in_place = all((length + turn) % BLOCK for length in lengths)
        assert (advanced.page_table.kv_indices is steps[0].page_table.kv_indices) == in_place  # pages shared
        steps = [advanced, planned]
    # What the advanced tables were built from stays right: a step planned anew after them
    # (which shares their pages where it can) is the other manager's.
    again = [manager.begin_step(rows, 1) for manager, rows in zip(managers, handles, strict=True)]
    assert _snapshot(managers[0], again[0]) == _snapshot(managers[1], again[1])


def test_an_advanced_step_s_padded_slots_extend_the_last_step_s() -> None:
    """A decode step advanced from the last one finds its padded slots as the last step's
    with a column more, not from its page table again, at every width the last step read
    one less of (the longest request cut short included), whether a request opened a block
    or not; they equal what its page table gives. A step planned anew finds them anew."""
    manager = make_manager(enable_prefix_caching=False)
    handles = [manager.allocate(AllocationRequest(f"r{row}")) for row in range(3)]
    step = manager.begin_step(handles, [5, 2, BLOCK])
    for layer in range(LAYERS):
        step.write(layer, kv(7 + BLOCK, layer), kv(7 + BLOCK, layer + 10))
    widths = [None, 3, 6, 10]  # each one more at each step
    for width in widths:
        step.gather_padded(0, width=width)
    for turn in range(2 * BLOCK):
        step = step.advance()
        widths = [None if width is None else width + 1 for width in widths]
        keys, values = kv(3, turn), kv(3, turn + 40)
        for layer in range(LAYERS):
            step.write(layer, keys, values)
        with mock.patch("kvcache_core._step_runner.padded_slots", wraps=padded.padded_slots) as found:
            for width in widths:
                for layer in range(LAYERS):
                    got_keys, got_values = step.gather_padded(layer, width=width)
                    table_slots = padded.padded_slots(step.page_table, width)
                    expected = padded.read_padded(manager.storage, layer, step.page_table, table_slots, "NHD")
                    np.testing.assert_array_equal(got_keys, expected[0])
                    np.testing.assert_array_equal(got_values, expected[1])
            assert found.call_count == 0, f"turn {turn}: padded slots found from the page table"
            assert step.gather_padded(0, width=2)[0].shape[1] == 2  # a width the last step did not read
            assert found.call_count == 1
    planned = manager.begin_step(handles, 1)
    with mock.patch("kvcache_core._step_runner.padded_slots", wraps=padded.padded_slots) as found:
        planned.gather_padded(0)
    assert found.call_count == 1


def test_an_advance_looks_for_growth_in_place_once() -> None:
    """A decode step in which one request opens a block and the other grows inside its block
    finds the growth in place once, not again for the requests that grow as begin_step grows them."""
    manager, other = make_manager(enable_prefix_caching=False), make_manager(enable_prefix_caching=False)
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    others = [other.allocate(AllocationRequest(name)) for name in ("a", "b")]
    step = manager.begin_step(handles, [BLOCK, 2])  # a's next token opens a block, b's fits its block
    other.begin_step(others, [BLOCK, 2])
    with mock.patch("kvcache_core._data_path.plan_in_place", wraps=in_place.plan_in_place) as found:
        advanced = step.advance()
    assert found.call_count == 1
    assert advanced.page_table.seq_lens.tolist() == [BLOCK + 1, 3]
    assert _snapshot(manager, advanced) == _snapshot(other, other.begin_step(others, 1))


def test_advancing_a_stale_step_is_refused_and_changes_nothing() -> None:
    manager = make_manager(enable_prefix_caching=False)
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    step = manager.begin_step(handles, [5, 6])
    manager.truncate(handles[0], 3)
    with pytest.raises(StaleStepError, match="'a'"):
        step.advance()
    assert [handle.num_tokens() for handle in handles] == [3, 6]
    current = manager.begin_step(handles, 1)
    assert current.advance().page_table.seq_lens.tolist() == [5, 8]
    with pytest.raises(StaleStepError):  # the step advanced from is done with, as after any begin_step
        current.write(0, kv(2, 1), kv(2, 2))


def test_an_advance_the_pool_or_a_length_limit_refuses_changes_nothing() -> None:
    manager = make_manager(num_blocks=2, enable_prefix_caching=False)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], 8)  # both blocks full: the next token needs a third
    with pytest.raises(OutOfBlocksError):
        step.advance()
    assert handle.num_tokens() == 8
    assert manager.stats().free_blocks == 0
    step.write(0, kv(8, 1), kv(8, 2))  # still current
    limited = make_manager(enable_prefix_caching=False)
    short = limited.allocate(AllocationRequest("b", max_sequence_length=6))
    step = limited.begin_step([short], 6)
    with pytest.raises(SequenceTooLongError):
        step.advance()
    assert short.num_tokens() == 6
    step.write(0, kv(6, 1), kv(6, 2))


@pytest.mark.parametrize("token_ids", [[[1, 2]], [[1], [2]], [["x"]], "ab", [[-1]]])
def test_an_advance_refuses_bad_token_ids_and_changes_nothing(token_ids: object) -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], 5, token_ids=[[7, 8, 9, 10, 11]])
    with pytest.raises(InvalidArgumentError):
        step.advance(token_ids=token_ids)  # type: ignore[arg-type]
    assert handle.num_tokens() == 5
    assert step.advance(token_ids=[[12]]).page_table.seq_lens.tolist() == [6]


def test_a_decode_step_opening_blocks_takes_one_free_block_each_without_the_general_path() -> None:
    """Without prefix caching, requests whose next token opens a block take one free block
    each beside those growing in place; the step is the one ``begin_step`` plans."""
    manager, other = make_manager(enable_prefix_caching=False), make_manager(enable_prefix_caching=False)
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b", "c")]
    others = [other.allocate(AllocationRequest(name)) for name in ("a", "b", "c")]
    lengths = [BLOCK, 2, 2 * BLOCK]  # a and c open a block, b grows inside its own
    step = manager.begin_step(handles, lengths)
    other.begin_step(others, lengths)
    with mock.patch.object(SequenceBlocks, "grow_all", side_effect=AssertionError("the general path")):
        advanced = step.advance()
    assert advanced.page_table.seq_lens.tolist() == [BLOCK + 1, 3, 2 * BLOCK + 1]
    planned = other.begin_step(others, 1)
    assert _snapshot(manager, advanced) == _snapshot(other, planned)
    keys, values, query = kv(3, 1), kv(3, 2), kv(3, 3)
    np.testing.assert_array_equal(
        advanced.write_and_attend(0, keys, values, query), planned.write_and_attend(0, keys, values, query)
    )


def test_a_decode_step_interrupted_while_opening_blocks_gives_them_back() -> None:
    manager = make_manager(enable_prefix_caching=False)
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    step = manager.begin_step(handles, [BLOCK, 2 * BLOCK])  # both open a block
    free = manager.stats().free_blocks
    take = BlockPool.take
    calls: list[int] = []

    def interrupted(pool: BlockPool, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return take(pool, *args, **kwargs)

    with mock.patch.object(BlockPool, "take", interrupted), pytest.raises(KeyboardInterrupt):
        step.advance()
    assert manager.stats().free_blocks == free
    assert [handle.num_tokens() for handle in handles] == [BLOCK, 2 * BLOCK]
    advanced = step.advance()  # nothing changed: the step is still current
    assert advanced.page_table.seq_lens.tolist() == [BLOCK + 1, 2 * BLOCK + 1]
    assert manager.stats().free_blocks == free - 2


def test_a_decode_step_opening_more_blocks_than_are_free_is_refused_by_the_general_path() -> None:
    manager = make_manager(num_blocks=3, enable_prefix_caching=False)
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    step = manager.begin_step(handles, [BLOCK, BLOCK])  # one block free, two needed
    with pytest.raises(OutOfBlocksError, match="2 more blocks"):
        step.advance()
    assert [handle.num_tokens() for handle in handles] == [BLOCK, BLOCK]
    assert manager.stats().free_blocks == 1
