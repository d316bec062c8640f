"""``PageTable.one_run_slots``: the first slot and count of one request's last tokens when they
are consecutive slots, or ``None``; a bad count is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache_core.contract.page_table import PageTable
from kvcache_core.errors import InvalidArgumentError


def _table(pages: list[list[int]], tokens: list[int], window: int | None = None) -> PageTable:
    """Requests in blocks of 4: ``pages[b]`` hold ``tokens[b]`` tokens."""
    width = max([len(row) for row in pages] + [1])
    return PageTable(
        kv_indptr=np.array([0, *np.cumsum([len(row) for row in pages])]),
        kv_indices=np.array([page for row in pages for page in row], dtype=np.int32),
        kv_last_page_len=np.array([n - (len(row) - 1) * 4 if row else 0 for row, n in zip(pages, tokens, strict=True)]),
        block_tables=np.array([row + [0] * (width - len(row)) for row in pages], dtype=np.int32),
        seq_lens=np.array(tokens),
        block_size=4,
        sliding_window=window,
    )


@pytest.mark.parametrize(("positions", "expected"), [(None, (12, 10)), (10, (12, 10)), (3, (19, 3)), (0, (0, 0))])
def test_one_request_in_one_run_gives_its_last_tokens_slots(positions: int | None, expected: tuple[int, int]) -> None:
    table = _table([[3, 4, 5]], [10])  # slots 12..21
    assert table.one_run_slots(positions) == expected
    first, count = expected
    if count:  # the slots padded_slots would list for them, consecutive
        slots = [int(table.block_tables[0, t // 4]) * 4 + t % 4 for t in range(10 - count, 10)]
        assert slots == list(range(first, first + count))


def test_no_run_where_the_tokens_are_not_consecutive_slots() -> None:
    assert _table([[3, 5, 6]], [10]).one_run_slots() is None  # two runs
    assert _table([[3, 4, 5]], [10]).one_run_slots(11) is None  # a position before its first token
    assert _table([[3, 4], [5]], [8, 2]).one_run_slots() is None  # two requests
    assert _table([[3, 4, 5]], [10], window=4).one_run_slots() is None  # a window's table
    assert _table([[]], [0]).one_run_slots() == (0, 0)


@pytest.mark.parametrize("positions", [-1, 2.0, "3", True])
def test_a_bad_count_is_refused_by_name(positions: object) -> None:
    with pytest.raises(InvalidArgumentError, match="positions"):
        _table([[3, 4, 5]], [10]).one_run_slots(positions)  # type: ignore[arg-type]  # what the test checks
