"""The compiled padded gather (``kvcache_core.attention.gather_kernel``): the runs of a padded
slot array, and a copy run by run equal to NumPy's indexed read, zeros at the padding, for
every element size and either layout; refusals before anything is touched."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core.attention import gather_kernel
from kvcache_core.attention.gather_kernel import MIN_THREAD_BYTES, SlotRuns, gather_runs, gather_runs_together
from kvcache_core.attention.kernel import DISABLE_ENV, kernel_available, max_threads, python_team
from kvcache_core.errors import InvalidArgumentError, InvalidTypeError, ShapeMismatchError

needs_numba = pytest.mark.skipif(not kernel_available(), reason="the compiled gather needs numba")


def _expected(pool: npt.NDArray[Any], slots: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    """``[batch, heads, positions, dim]``: ``pool [heads, slots, dim]`` at ``slots``, zeros at ``-1``."""
    taken = pool[:, np.maximum(slots, 0)].transpose(1, 0, 2, 3)
    return np.where((slots >= 0)[:, None, :, None], taken, np.zeros((), dtype=pool.dtype))


def _counting_team(calls: list[int]) -> Callable[[Callable[[], None], int], None]:
    """The default team, each start's thread count appended to ``calls``."""

    def team(share: Callable[[], None], threads: int) -> None:
        calls.append(threads)
        python_team(share, threads)

    return team


@st.composite
def _batches(draw: st.DrawFn) -> tuple[npt.NDArray[np.int64], int]:
    """A padded slot array over a pool of ``slots`` slots: each row a few runs of distinct slots."""
    batch = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    positions = max(max(lengths), draw(st.integers(0, 3)))
    total = sum(lengths) + draw(st.integers(0, 20))
    order = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(max(total, 1))
    blocks = draw(st.sampled_from([1, 3, 16]))  # runs of this many slots, shuffled
    slots = np.full((batch, positions), -1, dtype=np.int64)
    taken = 0
    for row, length in enumerate(lengths):
        run_order = order[taken // blocks :]  # a shuffle of blocks of consecutive slots
        picked = [int(run_order[index // blocks]) * blocks + index % blocks for index in range(length)]
        taken += -(-length // blocks) * blocks
        slots[row, positions - length :] = picked
    return slots, max(int(slots.max(initial=-1)) + 1, 1) + draw(st.integers(0, 3))


def test_runs_are_found_row_by_row() -> None:
    slots = np.array([[-1, -1, 3, 4, 5, 9, 10], [0, 1, 2, 20, 21, 22, 7], [-1] * 7], dtype=np.int64)
    runs = SlotRuns(slots)
    assert runs.leads.tolist() == [2, 0, 7]
    assert runs.runs.tolist() == [[2, 3, 3], [5, 9, 2], [0, 0, 3], [3, 20, 3], [6, 7, 1]]
    assert runs.run_first.tolist() == [0, 2, 5, 5]
    assert runs.slots_needed == 23
    assert runs.order(2).tolist() == [2, 3, 0, 1, 4, 5]  # the row with most stored positions first
    for array in (runs.leads, runs.runs, runs.run_first, runs.order(2)):  # what the compiled copy trusts
        assert not array.flags.writeable
    with pytest.raises(AttributeError):
        runs.positions = 9  # type: ignore[misc]  # read-only property
    with pytest.raises(InvalidArgumentError, match="heads"):
        runs.order(0)


def _same_runs(found: SlotRuns, expected: SlotRuns) -> None:
    assert (found.batch, found.positions, found.slots_needed) == (
        expected.batch,
        expected.positions,
        expected.slots_needed,
    )
    for name in ("leads", "runs", "run_first"):
        assert getattr(found, name).tolist() == getattr(expected, name).tolist(), name
        assert not getattr(found, name).flags.writeable
    assert found.order(3).tolist() == expected.order(3).tolist()


@settings(max_examples=80, deadline=None)
@given(batch=_batches(), follow=st.lists(st.booleans(), min_size=5, max_size=5), seed=st.integers(0, 2**16))
def test_runs_extended_by_one_position_per_row_are_those_found_anew(
    batch: tuple[npt.NDArray[np.int64], int], follow: list[bool], seed: int
) -> None:
    """A decode step's array (each row one stored slot more) extends the last step's runs: a
    row's last run one longer where its new slot follows it, a run of one otherwise."""
    slots, pool_slots = batch
    runs = SlotRuns(slots)
    before = (runs.runs.tolist(), runs.run_first.tolist())
    column: npt.NDArray[np.int64] = np.random.default_rng(seed).permutation(
        np.arange(pool_slots, pool_slots + slots.shape[0], dtype=np.int64)
    )
    for row in range(slots.shape[0]):
        if follow[row] and slots.shape[1] and slots[row, -1] >= 0 and slots[row, -1] + 1 not in slots:
            column[row] = slots[row, -1] + 1
    grown = np.concatenate([slots, column[:, None].astype(np.int64)], axis=1)
    extended = runs.extended(grown)
    assert extended is not None
    _same_runs(extended, SlotRuns(grown))
    assert (runs.runs.tolist(), runs.run_first.tolist()) == before  # the last step's runs unchanged


def test_runs_extend_only_by_one_stored_slot_per_row() -> None:
    slots = np.array([[-1, 3, 4], [0, 1, 2]], dtype=np.int64)
    runs = SlotRuns(slots)
    assert runs.extended(np.array([[-1, 3, 4, 5], [0, 1, 2, -1]], dtype=np.int64)) is None  # padding after a slot
    assert runs.extended(np.array([[-1, 3, 4, 5, 6], [0, 1, 2, 3, 7]], dtype=np.int64)) is None  # two more
    assert runs.extended(np.array([[-1, 3, 4, 5]], dtype=np.int64)) is None  # another batch
    other_type: Any = np.array([[-1, 3, 4, 5], [0, 1, 2, 3]], dtype=np.int32)
    assert runs.extended(other_type) is None  # another type
    _same_runs(
        runs.extended(np.array([[-1, 3, 4, 5], [0, 1, 2, 9]], dtype=np.int64)),  # type: ignore[arg-type]
        SlotRuns(np.array([[-1, 3, 4, 5], [0, 1, 2, 9]], dtype=np.int64)),
    )


@needs_numba
@settings(max_examples=60, deadline=None)
@given(batch=_batches(), dtype=st.sampled_from([np.float32, np.float16, np.uint8, np.float64]), spare=st.integers(0, 3))
def test_the_gather_equals_the_indexed_read(
    batch: tuple[npt.NDArray[np.int64], int], dtype: type[np.generic], spare: int
) -> None:
    slots, pool_slots = batch
    heads, dim = 3, 5
    # One layer's pool inside a larger array: its heads further apart than its slots.
    values = np.random.default_rng(1).integers(1, 100, size=(heads, pool_slots + spare, dim)).astype(dtype)
    pool = values[:, :pool_slots]
    out = np.full((slots.shape[0], heads, slots.shape[1], dim), 7, dtype=dtype)
    assert gather_runs(pool, out, SlotRuns(slots))
    assert np.array_equal(out, _expected(pool, slots))


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    batch=_batches(), dtype=st.sampled_from([np.float32, np.uint16]), widths=st.sampled_from([(5, 5), (4, 7), (8, 1)])
)
def test_keys_and_values_gathered_together_equal_the_indexed_reads(
    batch: tuple[npt.NDArray[np.int64], int], dtype: type[np.generic], widths: tuple[int, int]
) -> None:
    slots, pool_slots = batch
    heads = 2
    generator = np.random.default_rng(4)
    # Keys and values of their own widths, each inside a larger array (heads further apart).
    keys = generator.integers(1, 100, size=(heads, pool_slots + 2, widths[0])).astype(dtype)[:, :pool_slots]
    values = generator.integers(1, 100, size=(heads, pool_slots + 1, widths[1])).astype(dtype)[:, :pool_slots]
    outs = [np.full((slots.shape[0], heads, slots.shape[1], width), 7, dtype=dtype) for width in widths]
    assert gather_runs_together(((keys, outs[0]), (values, outs[1])), SlotRuns(slots))
    assert np.array_equal(outs[0], _expected(keys, slots))
    assert np.array_equal(outs[1], _expected(values, slots))


@needs_numba
def test_keys_and_values_together_start_the_team_once() -> None:
    calls: list[int] = []
    team = _counting_team(calls)
    heads, dim, positions = 2, 64, 1000
    lengths = (1000, 5)
    slots = np.full((len(lengths), positions), -1, dtype=np.int64)
    slots[0] = np.arange(positions)
    slots[1, -5:] = np.arange(positions + 16, positions + 21)
    generator = np.random.default_rng(5)
    pools = [generator.standard_normal((heads, positions + 21, dim)).astype(np.float32) for _ in range(2)]
    outs = [np.empty((len(lengths), heads, positions, dim), dtype=np.float32) for _ in range(2)]
    assert outs[0].nbytes < MIN_THREAD_BYTES <= outs[0].nbytes + outs[1].nbytes  # together they are worth a team
    assert gather_runs_together(list(zip(pools, outs, strict=True)), SlotRuns(slots), team)
    assert calls == [min(max_threads(), 8)]  # one start: 2 rows x 2 heads x 2 pools
    for pool, out in zip(pools, outs, strict=True):
        assert np.array_equal(out, _expected(pool, slots))


@needs_numba
def test_one_pair_not_in_rows_leaves_every_out_untouched() -> None:
    slots = np.array([[-1, 0, 1, 2]], dtype=np.int64)
    pool = np.ones((2, 3, 4), dtype=np.float32)
    interleaved = np.ones((3, 2, 4), dtype=np.float32).transpose(1, 0, 2)  # [heads, slots, dim] of an NHD pool
    outs = [np.full((1, 2, 4, 4), 5.0, dtype=np.float32) for _ in range(2)]
    assert not gather_runs_together(((pool, outs[0]), (interleaved, outs[1])), SlotRuns(slots))
    assert all((out == 5.0).all() for out in outs)


@pytest.mark.parametrize(
    ("values_shape", "values_dtype", "error", "named"),
    [
        ((3, 8, 4), np.float32, ShapeMismatchError, r"one number of heads, got \[2, 3\]"),
        ((2, 8, 4), np.float64, InvalidTypeError, r"one size, got \[4, 8\]"),
    ],
)
def test_pairs_of_other_heads_or_sizes_are_refused_untouched(
    values_shape: tuple[int, ...], values_dtype: type[np.generic], error: type[Exception], named: str
) -> None:
    runs = SlotRuns(np.array([[-1, 5, 6]], dtype=np.int64))
    keys = np.ones((2, 8, 4), dtype=np.float32)
    values = np.ones(values_shape, dtype=values_dtype)
    outs = [np.full((1, 2, 3, 4), 3, dtype=np.float32), np.full((1, values_shape[0], 3, 4), 3, dtype=values_dtype)]
    with pytest.raises(error, match=named):
        gather_runs_together(((keys, outs[0]), (values, outs[1])), runs)
    assert all((out == 3).all() for out in outs)
    with pytest.raises(InvalidArgumentError, match="at least one"):
        gather_runs_together((), runs)
    for bad in (None, [(keys,)], [(keys, outs[0], outs[0])], "pairs"):
        with pytest.raises(InvalidTypeError, match="pairs must be"):
            gather_runs_together(bad, runs)  # type: ignore[arg-type]  # what a caller might pass
    assert all((out == 3).all() for out in outs)


@needs_numba
@pytest.mark.parametrize("which", ["a pool of heads interleaved", "out of heads interleaved"])
def test_arrays_not_in_rows_are_left_to_the_caller(which: str) -> None:
    slots = np.array([[-1, 0, 1, 2]], dtype=np.int64)
    pool = np.ones((3, 2, 4), dtype=np.float32).transpose(1, 0, 2)  # [heads, slots, dim] of an NHD pool
    out = np.full((1, 2, 4, 4), 5.0, dtype=np.float32)
    if which == "out of heads interleaved":
        pool = np.ascontiguousarray(pool)
        out = np.full((1, 4, 2, 4), 5.0, dtype=np.float32).transpose(0, 2, 1, 3)
    assert not gather_runs(pool, out, SlotRuns(slots))
    assert (out == 5.0).all()


@needs_numba
def test_a_large_gather_runs_on_the_team_it_is_given() -> None:
    calls: list[int] = []
    team = _counting_team(calls)
    heads, dim, positions = 4, 64, 1100
    lengths = (1100, 700, 5, 0)
    slots = np.full((len(lengths), positions), -1, dtype=np.int64)
    first = 0
    for row, length in enumerate(lengths):
        slots[row, positions - length :] = np.arange(first, first + length)
        first += length + 16
    pool = np.random.default_rng(2).standard_normal((heads, first, dim)).astype(np.float32)
    out = np.empty((len(lengths), heads, positions, dim), dtype=np.float32)
    assert out.nbytes >= MIN_THREAD_BYTES
    assert gather_runs(pool, out, SlotRuns(slots), team)
    assert np.array_equal(out, _expected(pool, slots))
    assert calls == [min(max_threads(), 16)]  # 4 rows x 4 heads


class _EntryTeam:
    """A team with a C entry point, as torch's OpenMP team has: ``run_entry`` starts the C
    function on ``threads`` threads at once (ctypes lets go of the GIL while each runs it),
    or declines (``accepts=False``) and the gather runs its Python shares (``shares``)."""

    def __init__(self, accepts: bool = True) -> None:
        self.accepts = accepts
        self.entries: list[int] = []
        self.shares: list[int] = []

    def __call__(self, share: Callable[[], None], threads: int) -> None:
        self.shares.append(threads)
        python_team(share, threads)

    def run_entry(self, entry: int, data: int, threads: int) -> bool:
        self.entries.append(threads)
        if not self.accepts:
            return False
        function = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(entry)
        started = [threading.Thread(target=function, args=(data,)) for _ in range(threads - 1)]
        for thread in started:
            thread.start()
        function(data)
        for thread in started:
            thread.join()
        return True


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    batch=_batches(),
    dtype=st.sampled_from([np.float32, np.float16, np.uint8, np.float64]),
    widths=st.sampled_from([(5,), (4, 7), (8, 1)]),
)
def test_the_gather_through_a_teams_c_entry_equals_the_indexed_reads(
    batch: tuple[npt.NDArray[np.int64], int], dtype: type[np.generic], widths: tuple[int, ...]
) -> None:
    slots, pool_slots = batch
    heads = 3
    generator = np.random.default_rng(6)
    # Each pool inside a larger array (heads further apart than its slots), one pair or two.
    pools = [
        generator.integers(1, 100, size=(heads, pool_slots + 2, width)).astype(dtype)[:, :pool_slots]
        for width in widths
    ]
    outs = [np.full((slots.shape[0], heads, slots.shape[1], width), 7, dtype=dtype) for width in widths]
    team = _EntryTeam()
    with mock.patch.object(gather_kernel, "MIN_THREAD_BYTES", 0):  # every gather on the team
        assert gather_runs_together(list(zip(pools, outs, strict=True)), SlotRuns(slots), team)
    for pool, out in zip(pools, outs, strict=True):
        assert np.array_equal(out, _expected(pool, slots))
    if slots.size and max_threads() > 1:
        assert team.entries
        assert not team.shares  # no thread ran Python


@needs_numba
@pytest.mark.parametrize("case", ["the team declines its entry", "more pairs than the entry takes"])
def test_the_python_shares_run_where_the_c_entry_does_not(case: str) -> None:
    slots = np.array([[-1, 0, 1, 2], [4, 5, 8, 9]], dtype=np.int64)
    count = 3 if case == "more pairs than the entry takes" else 2
    generator = np.random.default_rng(7)
    pools = [generator.standard_normal((2, 10, 4)).astype(np.float32) for _ in range(count)]
    outs = [np.full((2, 2, 4, 4), 5.0, dtype=np.float32) for _ in range(count)]
    team = _EntryTeam(accepts=case != "the team declines its entry")
    with mock.patch.object(gather_kernel, "MIN_THREAD_BYTES", 0):
        assert gather_runs_together(list(zip(pools, outs, strict=True)), SlotRuns(slots), team)
    for pool, out in zip(pools, outs, strict=True):
        assert np.array_equal(out, _expected(pool, slots))
    if max_threads() > 1:
        assert team.shares == [min(max_threads(), 4 * count)]  # 2 rows x 2 heads per pool
        assert team.entries == ([] if count == 3 else team.shares)


def test_without_the_compiled_code_nothing_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "1")
    slots = np.array([[-1, 0, 1]], dtype=np.int64)
    out = np.full((1, 1, 3, 2), 5.0, dtype=np.float32)
    assert not gather_runs(np.ones((1, 4, 2), dtype=np.float32), out, SlotRuns(slots))
    assert (out == 5.0).all()


@pytest.mark.parametrize(
    ("slots", "error", "named"),
    [
        (np.array([[0, 1]], dtype=np.int32), InvalidTypeError, "int64"),
        (np.array([0, 1], dtype=np.int64), InvalidTypeError, "2-D"),
        (np.array([[-2, 1]], dtype=np.int64), InvalidArgumentError, "-2"),
        (np.array([[0, -1, 1]], dtype=np.int64), InvalidArgumentError, "padding"),
    ],
)
def test_bad_slot_arrays_are_refused(slots: npt.NDArray[Any], error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named):
        SlotRuns(slots)


@pytest.mark.parametrize(
    ("pool_shape", "out_shape", "out_dtype", "error", "named"),
    [
        ((2, 8, 4), (1, 2, 3, 4), np.float16, InvalidTypeError, "float16"),
        ((2, 8, 4), (1, 3, 3, 4), np.float32, ShapeMismatchError, r"\(1, 3, 3, 4\)"),
        ((2, 8, 4), (1, 2, 4, 4), np.float32, ShapeMismatchError, "positions 3"),
        ((2, 5, 4), (1, 2, 3, 4), np.float32, ShapeMismatchError, "slots up to 6; the pool has 5"),
    ],
)
def test_mismatched_arrays_are_refused_and_out_is_untouched(
    pool_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    out_dtype: type[np.generic],
    error: type[Exception],
    named: str,
) -> None:
    runs = SlotRuns(np.array([[-1, 5, 6]], dtype=np.int64))
    out = np.full(out_shape, 3, dtype=out_dtype)
    with pytest.raises(error, match=named):
        gather_runs(np.ones(pool_shape, dtype=np.float32), out, runs)
    assert (out == 3).all()
