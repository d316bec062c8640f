"""The kernel's vector blocks (``kvcache_core.attention._kernel_ir``) equal the products
and weighted sums they stand for, on pool rows anywhere in a strided pool, and write
nothing outside their block."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
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

    def block_4(queries: Any, j: int, keys: Any, rows_at: Any, first: int, scores: Any, c: int) -> None:
        simd.score_block_4(queries, j, keys, rows_at, first, scores, c)

    def block_2(queries: Any, j: int, keys: Any, rows_at: Any, first: int, scores: Any, c: int) -> None:
        simd.score_block_2(queries, j, keys, rows_at, first, scores, c)

    def block_1(queries: Any, j: int, keys: Any, rows_at: Any, first: int, scores: Any, c: int) -> None:
        simd.score_block_1(queries, j, keys, rows_at, first, scores, c)

    def values_4(
        values: Any, rows_at: Any, first: int, count: int, weights: Any, column: int, j: int, acc: Any
    ) -> None:
        simd.value_block_4(values, rows_at, first, count, weights, column, j, acc)

    jit: Any = njit
    return {
        "rows 4": jit(block_4),
        "rows 2": jit(block_2),
        "rows 1": jit(block_1),
        "values": jit(values_4),
    }


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
    rows=st.sampled_from([4, 2, 1]),
    vectors=st.integers(1, 9),
    padding=st.sampled_from([0, 3, 16]),
    first_row=st.integers(0, 12),
    first=st.integers(0, 20),
    column=st.integers(0, 16),
    seed=st.integers(0, 2**16),
)
def test_a_score_block_is_a_vector_of_dot_products(
    blocks: dict[str, Callable[..., None]],
    rows: int,
    vectors: int,
    padding: int,
    first_row: int,
    first: int,
    column: int,
    seed: int,
) -> None:
    from kvcache_core.attention._kernel_ir import LANES

    keys = LANES // rows
    features = LANES * vectors
    rng = np.random.default_rng(seed)
    queries = rng.standard_normal((16, features)).astype(np.float32)
    pool = _pool(rng, 64, features, padding)
    rows_at = rng.permutation(64).astype(np.int64)
    scores = np.full((16, 32), SENTINEL, dtype=np.float32)
    first_row = min(first_row, 16 - rows)
    blocks[f"rows {rows}"](queries, first_row, pool, rows_at, first, scores, column)
    taken = pool[rows_at[first + column : first + column + keys]].astype(np.float64)
    expected = queries[first_row : first_row + rows].astype(np.float64) @ taken.T
    block = scores[first_row : first_row + rows, column : column + keys]
    np.testing.assert_allclose(block, expected, rtol=1e-5, atol=1e-4)
    outside = np.ones(scores.shape, dtype=bool)
    outside[first_row : first_row + rows, column : column + keys] = False
    assert np.all(scores[outside] == SENTINEL)


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.integers(1, 8),
    padding=st.sampled_from([0, 5, 32]),
    first_row=st.integers(0, 12),
    first=st.integers(0, 20),
    count=st.integers(0, 32),
    seed=st.integers(0, 2**16),
    column=st.integers(0, 8),
)
def test_a_value_block_adds_four_rows_of_weighted_values(
    blocks: dict[str, Callable[..., None]],
    chunks: int,
    padding: int,
    first_row: int,
    first: int,
    count: int,
    seed: int,
    column: int,
) -> None:
    from kvcache_core.attention._kernel_ir import VALUE_CHUNK

    features = VALUE_CHUNK * chunks
    rng = np.random.default_rng(seed)
    pool = _pool(rng, 64, features, padding)
    rows_at = rng.permutation(64).astype(np.int64)
    weights = rng.random((16, 40)).astype(np.float32)
    acc = rng.standard_normal((16, features)).astype(np.float32)
    before = acc.copy()
    blocks["values"](pool, rows_at, first, count, weights, column, first_row, acc)  # weights from column
    rows = slice(first_row, first_row + 4)
    taken = pool[rows_at[first : first + count]].astype(np.float64)
    expected = before[rows].astype(np.float64) + weights[rows, column : column + count].astype(np.float64) @ taken
    np.testing.assert_allclose(acc[rows], expected, rtol=1e-5, atol=1e-4)
    others = np.ones(16, dtype=bool)
    others[rows] = False
    np.testing.assert_array_equal(acc[others], before[others])


def test_without_avx512_the_blocks_are_eight_lanes_wide_and_still_exact() -> None:
    """Compiled for a CPU without AVX-512 (numba told so, on this one), the blocks take 8
    lanes (16 would not fit AVX2's registers) and pass the same tests."""
    from kvcache_core.attention._kernel_ir import compile_features

    host = compile_features()
    if "+avx512f" not in host or "+avx2" not in host or "+fma" not in host:
        pytest.skip("this CPU compiles the 8-lane blocks already (or cannot run Haswell's code)")
    features = [f for f in host if not f.startswith("+avx512")] + ["-avx512f"]
    environment = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ",".join(features)}
    lanes = subprocess.run(
        [sys.executable, "-c", "from kvcache_core.attention._kernel_ir import LANES; print(LANES)"],
        env=environment, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert lanes.stdout.split() == ["8"]
    tests = [f"{__file__}::test_a_score_block_is_a_vector_of_dot_products",
             f"{__file__}::test_a_value_block_adds_four_rows_of_weighted_values"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
        env=environment, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
