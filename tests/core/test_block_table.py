"""BlockTable against the seed crate's formulas, as properties."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_core import BlockTable, InvalidArgumentError
from kvcache_core.contract.block_table import BlockRun
from kvcache_core.errors import InsufficientBlocksError

block_sizes = st.integers(min_value=1, max_value=64)
lengths = st.integers(min_value=0, max_value=10_000)


@st.composite
def tables(draw: st.DrawFn) -> BlockTable:
    block_size = draw(block_sizes)
    blocks = draw(st.lists(st.integers(0, 500), unique=True, max_size=40))
    length = draw(st.integers(0, len(blocks) * block_size))
    return BlockTable(block_size, blocks, length)


@given(lengths, block_sizes)
def test_blocks_needed_is_ceiling_division(length: int, block_size: int) -> None:
    needed = BlockTable.blocks_needed_for_length(length, block_size)
    assert needed == (length + block_size - 1) // block_size
    assert needed * block_size >= length
    assert (needed - 1) * block_size < length or needed == 0


@given(tables())
def test_has_free_space_follows_the_seed_formula(table: BlockTable) -> None:
    used = BlockTable.blocks_needed_for_length(table.sequence_length, table.block_size)
    assert table.has_free_space() == (used < table.num_blocks())


@given(tables())
def test_free_tokens_follows_the_seed_formula(table: BlockTable) -> None:
    expected = 0 if table.num_blocks() == 0 else table.num_blocks() * table.block_size - table.sequence_length
    assert table.free_tokens() == expected
    assert table.free_tokens() >= 0


@given(tables(), st.lists(st.integers(501, 900), unique=True, max_size=10))
def test_add_blocks_appends_in_order_and_maps_logical_indices(table: BlockTable, new: list[int]) -> None:
    before = table.physical_blocks
    table.add_blocks(new)
    assert table.physical_blocks == before + tuple(new)
    assert table.logical_to_physical == tuple(range(table.num_blocks()))


@given(tables(), st.integers(0, 2000))
def test_extend_sequence_succeeds_exactly_when_blocks_cover_the_new_length(table: BlockTable, extra: int) -> None:
    before = table.copy()
    new_length = table.sequence_length + extra
    fits = BlockTable.blocks_needed_for_length(new_length, table.block_size) <= table.num_blocks()
    if fits:
        table.extend_sequence(extra)
        assert table.sequence_length == new_length
    else:
        with pytest.raises(InsufficientBlocksError, match=f"length {new_length} needs"):
            table.extend_sequence(extra)
        assert table == before


@given(tables())
def test_dict_form_round_trips_losslessly(table: BlockTable) -> None:
    data = table.to_dict()
    assert all(isinstance(v, (int, list)) for v in data.values())
    assert BlockTable.from_dict(data) == table


@given(tables())
def test_copy_is_equal_and_independent(table: BlockTable) -> None:
    for clone in (table.copy(), copy.copy(table), copy.deepcopy(table)):
        assert clone == table
        clone.add_blocks([10_000])
        assert clone != table


@given(tables())
def test_runs_cover_the_table_in_order_with_maximal_runs(table: BlockTable) -> None:
    runs = table.runs()
    rebuilt = [run.start + i for run in runs for i in range(run.length)]
    assert rebuilt == list(table.physical_blocks)
    firsts = [sum(run.length for run in runs[:index]) for index in range(len(runs))]
    assert [run.first_logical for run in runs] == firsts
    for left, right in itertools.pairwise(runs):
        assert right.start != left.start + left.length  # maximal: neighbours do not continue


@given(tables())
def test_slots_map_positions_to_block_and_offset(table: BlockTable) -> None:
    slots = table.slots(0, table.sequence_length)
    expected = [
        table.physical_blocks[t // table.block_size] * table.block_size + t % table.block_size
        for t in range(table.sequence_length)
    ]
    assert slots.tolist() == expected
    assert slots.dtype == np.int64


def test_runs_of_a_fragmented_table() -> None:
    table = BlockTable(4, [3, 4, 5, 9, 10, 2])
    assert table.runs() == [BlockRun(3, 3, 0), BlockRun(9, 2, 3), BlockRun(2, 1, 5)]


def test_physical_blocks_cannot_be_changed_from_outside() -> None:
    table = BlockTable(4, [1, 2])
    with pytest.raises(AttributeError):
        table.sequence_length = 5  # type: ignore[misc]
    assert isinstance(table.physical_blocks, tuple)


def test_from_dict_rejects_an_inconsistent_mapping() -> None:
    data = BlockTable(4, [1, 2], 5).to_dict()
    data["logical_to_physical"] = [1, 0]
    with pytest.raises(InvalidArgumentError, match="logical_to_physical"):
        BlockTable.from_dict(data)


def test_tables_are_not_hashable() -> None:
    with pytest.raises(TypeError):
        hash(BlockTable(4))
