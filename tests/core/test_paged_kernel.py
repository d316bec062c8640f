"""The compiled paged-attention kernel equals the NumPy reference, and the backends fall
back to the reference when numba is missing or switched off."""

from __future__ import annotations

import subprocess
import sys
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    InvalidArgumentError,
    PageTable,
    UnsupportedConfigError,
    create_manager,
)
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.attention import kernel_plan
from kvcache_core.attention.reference import paged_attention
from kvcache_core.errors import InvalidTypeError, ShapeMismatchError
from tests.core.support import Array, draw_kernel_batch, draw_kernel_run, hand_built_table, random_pool

needs_numba = pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")

#: The kernel's output is float32 whatever the pool: it matches the reference computed in
#: float64 on the same (decoded) values to this tolerance.
ATOL = RTOL = 1e-5


@needs_numba
@settings(max_examples=60)
@given(data=st.data())
def test_the_kernel_equals_the_reference_on_any_batch(data: st.DataObject) -> None:
    """Random block tables (any runs), ragged lengths, decode / prefill / chunked / mixed
    queries, causal or not, windows, layouts, pool dtypes, threads, splits."""
    batch = draw_kernel_batch(data, max_requests=5, head_dims=[8, 20, 48, 64])
    run = draw_kernel_run(data)

    rng = np.random.default_rng(run.seed)
    layout, dtype, window = batch.layout, batch.dtype, batch.window
    table, keys, values, keys64, values64 = random_pool(
        data, batch.lengths, batch.block_size, batch.heads, batch.dim, layout, dtype, window, rng
    )
    indptr = np.concatenate([[0], np.cumsum(batch.query_counts)]).astype(np.int32)
    query = rng.standard_normal((int(indptr[-1]), batch.heads * batch.group, batch.dim)).astype(np.float32)
    scale = float(rng.uniform(0.05, 0.5))
    with (
        mock.patch.object(kernel_plan, "MIN_SPLIT_KEYS", run.min_split),
        mock.patch.object(kernel_plan, "ROW_SPLIT", run.row_split),
        mock.patch.object(kernel_plan, "MIN_THREAD_WORK", 1),  # these small batches use every thread
    ):
        got = paged_kernel.attend_with_kernel(
            query, keys, values, table, indptr, dtype=dtype, scale=scale, causal=batch.causal, kv_layout=layout,
            sliding_window=window, num_threads=run.threads,
        )  # fmt: skip
    expected = paged_attention(
        query.astype(np.float64), keys64, values64, table, qo_indptr=indptr, scale=scale, causal=batch.causal,
        kv_layout=layout,
    )  # fmt: skip
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


@needs_numba
def test_a_long_context_on_few_heads_is_split_and_merged() -> None:
    """One request of 3000 tokens on one KV head, 4 threads: the plan splits its keys."""
    rng = np.random.default_rng(0)
    table, num_blocks = hand_built_table(list(range(188)), [3000], 16, None)
    keys = rng.standard_normal((num_blocks, 16, 1, 32)).astype(np.float32)
    values = rng.standard_normal((num_blocks, 16, 1, 32)).astype(np.float32)
    query = rng.standard_normal((1, 4, 32)).astype(np.float32)
    indptr = np.array([0, 1], dtype=np.int32)
    with mock.patch.object(kernel_plan, "MIN_THREAD_WORK", 1):
        plan = kernel_plan.cached_plan(table, indptr, 1, 4, True, 0, 4)
        assert plan.merges.shape[0] == 1, plan.merges
        assert plan.merges[0, 4] > 1, plan.merges
        got = paged_kernel.attend_with_kernel(
            query, keys, values, table, indptr, dtype="float32", scale=0.2, causal=True, kv_layout="NHD",
            sliding_window=None, num_threads=4,
        )  # fmt: skip
    expected = paged_attention(query.astype(np.float64), keys, values, table, scale=0.2)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


@needs_numba
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 9])
@pytest.mark.parametrize(("dim", "value_dim"), [(64, 64), (128, 128), (48, 48), (64, 32)])
@pytest.mark.parametrize("layout", ["NHD", "heads_first"])
def test_decode_rows_of_every_count_read_the_pool_right(group: int, dim: int, value_dim: int, layout: str) -> None:
    """Decode of ragged requests (lengths off every tile and block boundary, blocks out of
    order) for each count of rows per KV head: the blocks of products and sums with the
    pool rows prefetched a few keys at a time (up to 8 rows), the whole tile at once (9), the
    scalar rows after the vector ones (3, 6, 9), and features off the vector width (48)."""
    rng = np.random.default_rng(group * 1000 + dim + value_dim)
    lengths = [1, 3, 37, 130, 517]
    blocks = sum(-(-n // 16) for n in lengths)
    num_blocks = blocks + 3  # (three blocks no request holds)
    table, _ = hand_built_table([int(b) for b in rng.permutation(num_blocks)[:blocks]], lengths, 16, None)
    heads = 2
    shape = (num_blocks, 16, heads) if layout == "NHD" else (heads, num_blocks, 16)
    keys = rng.standard_normal((*shape, dim)).astype(np.float32)
    values = rng.standard_normal((*shape, value_dim)).astype(np.float32)
    query = rng.standard_normal((len(lengths), heads * group, dim)).astype(np.float32)
    indptr = np.arange(len(lengths) + 1, dtype=np.int32)
    got = paged_kernel.attend_with_kernel(
        query, keys, values, table, indptr, dtype="float32", scale=0.125, causal=True, kv_layout=layout,
        sliding_window=None, num_threads=1,
    )  # fmt: skip
    expected = paged_attention(
        query.astype(np.float64), keys, values, table, qo_indptr=indptr, scale=0.125, kv_layout=layout
    )
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


@needs_numba
def test_a_prepared_call_runs_every_layer_and_refuses_arrays_it_was_not_prepared_for() -> None:
    rng = np.random.default_rng(1)
    table, _ = hand_built_table([0, 1, 2, 5, 6], [30, 40], 16, None)  # blocks up to 6: a pool of 7

    def pool() -> npt.NDArray[np.float32]:
        return rng.standard_normal((7, 16, 2, 8)).astype(np.float32)

    layers = [(pool(), pool()) for _ in range(3)]
    indptr = np.array([0, 1, 2], dtype=np.int32)
    query = rng.standard_normal((2, 4, 8)).astype(np.float32)
    keys, values = layers[0]
    call = paged_kernel.prepare_kernel_call(
        query.shape, keys, values, table, indptr, dtype="float32", causal=True, kv_layout="NHD", sliding_window=None
    )
    for layer_keys, layer_values in layers:  # one preparation, every layer's pools
        expected = paged_attention(query.astype(np.float64), layer_keys, layer_values, table, scale=0.3)
        np.testing.assert_allclose(call(query, layer_keys, layer_values, 0.3), expected, rtol=RTOL, atol=ATOL)
    bad_calls: list[tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]] = [
        (query[:1], keys, values),  # another query
        (query, keys[:, :, :1], values),  # pools of another shape
        (query, np.asfortranarray(keys), values),  # of other strides
        (query, keys, values.astype(np.float16)),  # of another dtype
    ]
    for bad_query, bad_keys, bad_values in bad_calls:
        with pytest.raises(ShapeMismatchError, match="KernelCall prepared for"):
            call(bad_query, bad_keys, bad_values, 0.3)


@needs_numba
def test_the_kernel_only_reads_its_inputs() -> None:
    """Read-only page-table arrays and pools are accepted and left as they were."""
    rng = np.random.default_rng(1)
    table, num_blocks = hand_built_table([3, 0, 1, 2, 6, 5, 4], [9, 13], 4, None)
    pool = rng.standard_normal((2, num_blocks + 1, 4, 2, 8)).astype(np.float32)
    inputs: tuple[Array, ...] = (pool, table.kv_indices, table.block_tables, table.seq_lens, table.kv_indptr)
    for array in inputs:
        array.flags.writeable = False
    before = [array.copy() for array in (pool, table.block_tables, table.seq_lens)]
    query = rng.standard_normal((2, 4, 8)).astype(np.float32)
    indptr = np.array([0, 1, 2], dtype=np.int32)
    got = paged_kernel.attend_with_kernel(
        query, pool[0], pool[1], table, indptr, dtype="float32", scale=0.3, causal=True, kv_layout="NHD",
        sliding_window=None,
    )  # fmt: skip
    expected = paged_attention(query, pool[0], pool[1], table, scale=0.3)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    for original, array in zip(before, (pool, table.block_tables, table.seq_lens), strict=True):
        assert np.array_equal(original, array)


def numpy_manager(dtype: str = "float32") -> tuple[Any, Array, PageTable]:
    """A NumPy-backend manager with three ragged requests written; ``(manager, query, table)``."""
    rng = np.random.default_rng(2)
    config = CacheConfig(num_layers=1, num_heads=2, head_dim=16, num_blocks=32, block_size=4, dtype=dtype)
    manager = create_manager("numpy", config)
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(3)]
    for handle, length in zip(handles, (5, 17, 30), strict=True):
        slots = manager.extend(handle, length)
        data = rng.standard_normal((2, length, 2, 16)).astype(dtype)
        manager.write(0, slots, data[0], data[1])
    return manager, rng.standard_normal((3, 4, 16)).astype(dtype), manager.page_table(handles)


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_numpy_backend_uses_the_kernel(dtype: str) -> None:
    manager, query, table = numpy_manager(dtype)
    calls: list[str] = []
    real = paged_kernel.attend_with_kernel

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["dtype"])
        return real(*args, **kwargs)

    with mock.patch.object(paged_kernel, "attend_with_kernel", counted):
        got = manager.paged_attention(0, query, table)
    assert calls == [dtype]
    assert got.dtype == np.dtype(dtype)
    expected = paged_attention(
        query, manager.storage.key_cache(0), manager.storage.value_cache(0), table, kv_layout=manager.config.layout
    )
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def test_the_environment_switch_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    assert not paged_kernel.kernel_available()
    manager, query, table = numpy_manager()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the kernel ran although it is switched off")

    monkeypatch.setattr(paged_kernel, "attend_with_kernel", refuse)
    got = manager.paged_attention(0, query, table)
    expected = paged_attention(
        query, manager.storage.key_cache(0), manager.storage.value_cache(0), table, kv_layout=manager.config.layout
    )
    np.testing.assert_array_equal(got, expected)  # the reference itself


def test_without_numba_the_kernel_is_unavailable_and_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine where numba is not installed: its import fails."""
    monkeypatch.delenv(paged_kernel.DISABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.delitem(sys.modules, "kvcache_core.attention._kernel_jit", raising=False)
    monkeypatch.setattr(paged_kernel, "_jit_module", None)
    monkeypatch.setattr(paged_kernel, "_jit_missing", False)
    assert not paged_kernel.kernel_available()
    manager, query, table = numpy_manager()
    got = manager.paged_attention(0, query, table)
    expected = paged_attention(
        query, manager.storage.key_cache(0), manager.storage.value_cache(0), table, kv_layout=manager.config.layout
    )
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(UnsupportedConfigError, match="pip install numba"):
        paged_kernel.attend_with_kernel(
            query, manager.storage.key_cache(0), manager.storage.value_cache(0), table,
            np.arange(4, dtype=np.int32), dtype="float32", scale=0.25, causal=True, kv_layout="NHD",
            sliding_window=None,
        )  # fmt: skip


def test_importing_kvcache_core_does_not_import_numba() -> None:
    """Discovery stays light: numba is imported at the first kernel call only."""
    code = "import sys, kvcache_core; kvcache_core.available_backends(); print('numba' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_float64_pools_keep_the_reference_path() -> None:
    """The kernel reads float32, float16 and bfloat16 pools; float64 stays exact on the reference."""
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((2, 4, 4, 2, 8))
    assert not paged_kernel.kernel_reads("float64", pool[0], pool[1])
    assert not paged_kernel.kernel_reads("float32", pool[0], pool[1])  # float64 arrays are not float32
    single = pool.astype(np.float32)
    assert paged_kernel.kernel_reads("float32", single[0], single[1])
    assert not paged_kernel.kernel_reads("float32", single[0][..., ::2], single[1][..., ::2])  # strided features


def split_batch() -> tuple[PageTable, Array, Array, Array, Array]:
    """A batch of long requests worth two threads: ``(table, query, keys, values, indptr)``."""
    rng = np.random.default_rng(3)
    lengths = [1500, 900, 2000]
    blocks = sum(-(-length // 16) for length in lengths)
    table, num_blocks = hand_built_table(list(range(blocks))[::-1], lengths, 16, None)
    keys = rng.standard_normal((num_blocks, 16, 2, 32)).astype(np.float32)
    values = rng.standard_normal((num_blocks, 16, 2, 32)).astype(np.float32)
    query = rng.standard_normal((3, 8, 32)).astype(np.float32)
    return table, query, keys, values, np.arange(4, dtype=np.int32)


@needs_numba
def test_a_team_runs_the_shares_of_a_call() -> None:
    """A caller's team runs every share it is given; the result is the default team's."""
    table, query, keys, values, indptr = split_batch()
    options: dict[str, Any] = {
        "dtype": "float32", "scale": 0.2, "causal": True, "kv_layout": "NHD", "sliding_window": None,
        "num_threads": 2,
    }  # fmt: skip
    launched: list[int] = []

    def in_turn(share: Any, threads: int) -> None:  # one thread after the other: still every item
        launched.append(threads)
        for _ in range(threads):
            share()

    with mock.patch.object(kernel_plan, "MIN_THREAD_WORK", 1):
        expected = paged_kernel.attend_with_kernel(query, keys, values, table, indptr, **options)
        got = paged_kernel.attend_with_kernel(query, keys, values, table, indptr, team=in_turn, **options)
    assert launched == [2]
    np.testing.assert_array_equal(got, expected)
    reference = paged_attention(query.astype(np.float64), keys, values, table, scale=0.2)
    np.testing.assert_allclose(got, reference, rtol=RTOL, atol=ATOL)


@needs_numba
def test_a_team_that_fails_fails_the_call() -> None:
    """An error raised in a team reaches the caller, and the default team raises a share's
    (a share not yet started when another failed is cancelled: it has nothing left to do)."""
    table, query, keys, values, indptr = split_batch()

    def broken(share: Any, threads: int) -> None:
        raise RuntimeError("team lost")

    with mock.patch.object(kernel_plan, "MIN_THREAD_WORK", 1), pytest.raises(RuntimeError, match="team lost"):
        paged_kernel.attend_with_kernel(
            query, keys, values, table, indptr, dtype="float32", scale=0.2, causal=True, kv_layout="NHD",
            sliding_window=None, num_threads=2, team=broken,
        )  # fmt: skip
    calls: list[int] = []

    def share() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("share failed")

    with pytest.raises(ValueError, match="share failed"):
        paged_kernel.python_team(share, 2)
    calls.clear()
    paged_kernel.python_team(lambda: calls.append(1), 2)  # the pool still works
    assert 1 <= len(calls) <= 2  # a worker not started once the caller's share returned is skipped


@pytest.mark.parametrize(("share", "threads", "error"), [
    ("not callable", 2, InvalidTypeError),
    (lambda: None, 0, InvalidArgumentError),
    (lambda: None, True, InvalidArgumentError),
    (lambda: None, 1.5, InvalidArgumentError),
])  # fmt: skip
def test_a_team_refuses_a_bad_call_before_running_anything(share: Any, threads: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="team runs"):
        paged_kernel.python_team(share, threads)


@needs_numba
def test_a_team_that_is_not_callable_is_refused_by_name() -> None:
    table, query, keys, values, indptr = split_batch()
    with pytest.raises(InvalidTypeError, match="team must be a ThreadTeam"):
        paged_kernel.attend_with_kernel(
            query, keys, values, table, indptr, dtype="float32", scale=0.2, causal=True, kv_layout="NHD",
            sliding_window=None, team="openmp",  # type: ignore[arg-type]
        )  # fmt: skip
