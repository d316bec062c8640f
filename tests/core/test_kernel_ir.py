"""The kernel's vector blocks (``kvcache_core.attention._kernel_ir``) equal the products
and weighted sums they stand for, on pool rows anywhere in a strided pool, and write
nothing outside their block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core.attention.kernel import kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the vector blocks are compiled by numba")

FloatArray = npt.NDArray[np.float32]
#: Untouched entries of an output hold this.
SENTINEL = np.float32(-7.25)


def _compiled() -> dict[str, Callable[..., None]]:
    """One small compiled caller per block (an intrinsic is called from compiled code only)."""
    from numba import njit  # imported here: the module is skipped without numba

    from kvcache_core.attention import _kernel_ir as simd

    def block_4x4(queries: Any, j: int, keys: Any, rows_at: Any, first: int, scores: Any, c: int) -> None:
        simd.score_block_4x4(queries, j, keys, rows_at, first, scores, c)

    def block_2x8(queries: Any, j: int, keys: Any, rows_at: Any, first: int, scores: Any, c: int) -> None:
        simd.score_block_2x8(queries, j, keys, rows_at, first, scores, c)

    def block_1x16(queries: Any, j: int, keys: Any, rows_at: Any, first: int, scores: Any, c: int) -> None:
        simd.score_block_1x16(queries, j, keys, rows_at, first, scores, c)

    def values_4(values: Any, rows_at: Any, first: int, count: int, weights: Any, j: int, acc: Any) -> None:
        simd.value_block_4(values, rows_at, first, count, weights, j, acc)

    jit: Any = njit
    return {"4x4": jit(block_4x4), "2x8": jit(block_2x8), "1x16": jit(block_1x16), "values": jit(values_4)}


@pytest.fixture(scope="module")
def blocks() -> dict[str, Callable[..., None]]:
    return _compiled()


def _pool(rng: np.random.Generator, rows: int, features: int, padding: int) -> FloatArray:
    """``[rows, features]`` float32 whose rows are ``padding`` floats apart beyond their width
    (a strided view, as a pool's rows are)."""
    wide = rng.standard_normal((rows, features + padding)).astype(np.float32)
    return wide[:, :features]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([("4x4", 4, 4), ("2x8", 2, 8), ("1x16", 1, 16)]),
    vectors=st.integers(1, 9),
    padding=st.sampled_from([0, 3, 16]),
    first_row=st.integers(0, 12),
    first=st.integers(0, 20),
    column=st.integers(0, 16),
    seed=st.integers(0, 2**16),
)
def test_a_score_block_is_sixteen_dot_products(
    blocks: dict[str, Callable[..., None]],
    shape: tuple[str, int, int],
    vectors: int,
    padding: int,
    first_row: int,
    first: int,
    column: int,
    seed: int,
) -> None:
    name, rows, keys = shape
    features = 16 * vectors
    rng = np.random.default_rng(seed)
    queries = rng.standard_normal((16, features)).astype(np.float32)
    pool = _pool(rng, 64, features, padding)
    rows_at = rng.permutation(64).astype(np.int64)
    scores = np.full((16, 32), SENTINEL, dtype=np.float32)
    first_row = min(first_row, 16 - rows)
    blocks[name](queries, first_row, pool, rows_at, first, scores, column)
    taken = pool[rows_at[first + column : first + column + keys]].astype(np.float64)
    expected = queries[first_row : first_row + rows].astype(np.float64) @ taken.T
    block = scores[first_row : first_row + rows, column : column + keys]
    np.testing.assert_allclose(block, expected, rtol=1e-5, atol=1e-4)
    outside = np.ones(scores.shape, dtype=bool)
    outside[first_row : first_row + rows, column : column + keys] = False
    assert np.all(scores[outside] == SENTINEL)


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.integers(1, 5),
    padding=st.sampled_from([0, 5, 32]),
    first_row=st.integers(0, 12),
    first=st.integers(0, 20),
    count=st.integers(0, 32),
    seed=st.integers(0, 2**16),
)
def test_a_value_block_adds_four_rows_of_weighted_values(
    blocks: dict[str, Callable[..., None]],
    chunks: int,
    padding: int,
    first_row: int,
    first: int,
    count: int,
    seed: int,
) -> None:
    features = 32 * chunks
    rng = np.random.default_rng(seed)
    pool = _pool(rng, 64, features, padding)
    rows_at = rng.permutation(64).astype(np.int64)
    weights = rng.random((16, 32)).astype(np.float32)
    acc = rng.standard_normal((16, features)).astype(np.float32)
    before = acc.copy()
    blocks["values"](pool, rows_at, first, count, weights, first_row, acc)
    rows = slice(first_row, first_row + 4)
    taken = pool[rows_at[first : first + count]].astype(np.float64)
    expected = before[rows].astype(np.float64) + weights[rows, :count].astype(np.float64) @ taken
    np.testing.assert_allclose(acc[rows], expected, rtol=1e-5, atol=1e-4)
    others = np.ones(16, dtype=bool)
    others[rows] = False
    np.testing.assert_array_equal(acc[others], before[others])
