"""The compiled write of a step's new rows into a layer's pools
(``kvcache_core.attention.row_writes.PoolWriter``): every layout and width, the slots checked
before anything is written, the pools checked once."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.attention.row_writes import PoolWriter
from kvcache_core.errors import ArrayTypeError, InvalidArgumentError, ShapeMismatchError, SlotError

needs_numba = pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")

#: Axes of (block, token in block, head) in each layout, as the pools hold them.
AXES = {"NHD": (0, 1, 2), "HND": (0, 2, 1), "heads_first": (1, 2, 0)}
BLOCKS, BLOCK_SIZE, HEADS = 6, 4, 3


def pool(layout: str, width: int, dtype: type[np.generic]) -> npt.NDArray[Any]:
    extents = [0, 0, 0]
    for axis, extent in zip(AXES[layout], (BLOCKS, BLOCK_SIZE, HEADS), strict=True):
        extents[axis] = extent
    return np.zeros((*extents, width), dtype=dtype)


def expected_after(cache: npt.NDArray[Any], layout: str, rows: npt.NDArray[Any], slots: list[int]) -> npt.NDArray[Any]:
    """``cache`` with token ``t``'s rows for every head at ``slots[t]``, written one by one."""
    result: npt.NDArray[Any] = cache.copy()
    for token, slot in enumerate(slots):
        for head in range(HEADS):
            index = [0, 0, 0]
            for axis, value in zip(AXES[layout], (slot // BLOCK_SIZE, slot % BLOCK_SIZE, head), strict=True):
                index[axis] = value
            result[tuple(index)] = rows[token, head]
    return result


@needs_numba
@pytest.mark.parametrize(
    ("layout", "dtype", "widths"),
    [
        *itertools.product(AXES, [np.float32], [(8, 8), (8, 4)]),
        *itertools.product(AXES, [np.uint16], [(8, 6), (7, 5)]),  # 14 and 10 bytes: copied byte by byte
        ("NHD", np.uint8, (3, 3)),
    ],
)
def test_each_token_s_rows_land_at_its_slot_and_nothing_else_moves(
    layout: str, dtype: type[np.generic], widths: tuple[int, int]
) -> None:
    keys_pool, values_pool = pool(layout, widths[0], dtype), pool(layout, widths[1], dtype)
    keys_pool += 1  # (what was there stays, where nothing is written)
    writer = PoolWriter.for_pools(keys_pool, values_pool, layout)
    assert writer is not None
    slots = [0, 5, 23, 11]
    generator = np.random.default_rng(3)
    keys = generator.integers(2, 200, (len(slots), HEADS, widths[0])).astype(dtype)
    values = generator.integers(2, 200, (len(slots), HEADS, widths[1])).astype(dtype)
    expected = (expected_after(keys_pool, layout, keys, slots), expected_after(values_pool, layout, values, slots))

    writer(keys.ctypes.data, values.ctypes.data, np.asarray(slots, dtype=np.int64))

    assert np.array_equal(keys_pool, expected[0])
    assert np.array_equal(values_pool, expected[1])


@needs_numba
@pytest.mark.parametrize("bad", [-1, BLOCKS * BLOCK_SIZE])
def test_a_slot_outside_the_pools_is_refused_by_name_before_any_row_is_written(bad: int) -> None:
    keys_pool, values_pool = pool("NHD", 4, np.float32), pool("NHD", 4, np.float32)
    writer = PoolWriter.for_pools(keys_pool, values_pool, "NHD")
    assert writer is not None
    rows = np.ones((2, HEADS, 4), dtype=np.float32)

    with pytest.raises(SlotError, match=rf"slot {bad} is outside the pools' slots \[0, {BLOCKS * BLOCK_SIZE}\)"):
        writer(rows.ctypes.data, rows.ctypes.data, np.asarray([3, bad], dtype=np.int64))

    assert not keys_pool.any()  # slot 3, before the bad one, not written either
    assert not values_pool.any()


@needs_numba
@pytest.mark.parametrize(
    "slots", [np.asarray([1, 2], dtype=np.int32), np.arange(4, dtype=np.int64)[::2], np.zeros((1, 2), np.int64)]
)
def test_slots_not_a_contiguous_int64_row_are_refused(slots: npt.NDArray[Any]) -> None:
    keys_pool = pool("NHD", 4, np.float32)
    writer = PoolWriter.for_pools(keys_pool, keys_pool.copy(), "NHD")
    assert writer is not None
    rows = np.ones((2, HEADS, 4), dtype=np.float32)

    with pytest.raises(ArrayTypeError, match="C-contiguous 1-D int64"):
        writer(rows.ctypes.data, rows.ctypes.data, slots)

    assert not keys_pool.any()


def read_only(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.flags.writeable = False
    return array


@pytest.mark.parametrize(
    ("pools", "layout", "error", "message"),
    [
        ((pool("NHD", 4, np.float32), pool("NHD", 4, np.float32)), "HDN", InvalidArgumentError, "kv_layout"),
        (([0.0], pool("NHD", 4, np.float32)), "NHD", ArrayTypeError, "key_cache must be a writeable"),
        ((pool("NHD", 4, np.float32), read_only(pool("NHD", 4, np.float32))), "NHD", ArrayTypeError, "value_cache"),
        ((np.zeros((6, 4, 12), np.float32), pool("NHD", 4, np.float32)), "NHD", ShapeMismatchError, "4-D"),
        ((pool("NHD", 8, np.float32)[..., ::2], pool("NHD", 4, np.float32)), "NHD", ShapeMismatchError, "contiguous"),
        ((pool("NHD", 4, np.float32), pool("NHD", 4, np.uint16)), "NHD", ArrayTypeError, "share an element type"),
        ((pool("NHD", 4, np.float32), pool("NHD", 4, np.float32)[:3]), "NHD", ShapeMismatchError, "same blocks"),
    ],
)
def test_pools_a_writer_cannot_write_are_refused_by_name(
    pools: tuple[Any, Any], layout: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        PoolWriter.for_pools(*pools, layout)


def test_without_compiled_code_there_is_no_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    cache = pool("NHD", 4, np.float32)

    assert PoolWriter.for_pools(cache, cache.copy(), "NHD") is None


@needs_numba
@pytest.mark.parametrize(
    ("keys", "slots", "error", "message"),
    [
        (0, np.zeros(1, np.int64), InvalidArgumentError, "the keys' address"),
        ("0x10", np.zeros(1, np.int64), InvalidArgumentError, "the keys' address"),
        (None, [0], InvalidArgumentError, "the keys' address"),
        (1, [0], ArrayTypeError, "C-contiguous 1-D int64"),
    ],
)
def test_a_call_refuses_what_is_not_an_address_or_slots_by_name(
    keys: Any, slots: Any, error: type[Exception], message: str
) -> None:
    keys_pool = pool("NHD", 4, np.float32)
    writer = PoolWriter.for_pools(keys_pool, keys_pool.copy(), "NHD")
    assert writer is not None
    rows = np.ones((1, HEADS, 4), dtype=np.float32)

    with pytest.raises(error, match=message):
        writer(rows.ctypes.data if keys == 1 else keys, rows.ctypes.data, slots)

    assert not keys_pool.any()


def test_a_layout_that_is_not_a_name_is_refused() -> None:
    cache = pool("NHD", 4, np.float32)

    with pytest.raises(InvalidArgumentError, match="kv_layout"):
        PoolWriter.for_pools(cache, cache.copy(), ["NHD"])  # type: ignore[arg-type]
