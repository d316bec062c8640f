"""Torch paged attention equals the kit's dense-attention oracle on the same K/V and the
NumPy reference, reading the pool in place through the page table."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core import CacheConfig, InvalidArgumentError, PageTable, create_manager
from kvcache_core.attention.reference import paged_attention as numpy_reference
from kvcache_core.errors import ArrayTypeError, DTypeMismatchError, ShapeMismatchError
from kvcache_core.paging.allocator import Placement
from kvcache_core.testing.oracle import dense_attention_batch
from kvcache_torch import TorchStorage, paged_attention
from kvcache_torch import attention as attention_module
from tests.torch.support import DTYPES, LAYOUTS, TOLERANCES, TORCH_DTYPES, Filled, Manager, fill, make_manager

#: fp32 paged attention equals the dense oracle to this maximum absolute difference.
FP32_ATOL = 1e-5


def untyped(value: object) -> Any:
    """Pass a deliberately ill-typed value past the type checker."""
    return value


def indptr_of(query_counts: list[int]) -> npt.NDArray[np.int32]:
    return np.concatenate([[0], np.cumsum(query_counts)]).astype(np.int32)


def random_query(manager: Manager, rows: int, group: int, seed: int) -> torch.Tensor:
    config = manager.config
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn((rows, config.num_heads * group, config.head_dim), generator=generator)
    return query.to(device=str(config.device), dtype=TORCH_DTYPES[config.dtype])


def dense_oracle(
    filled: Filled, layer: int, query: torch.Tensor, counts: list[int], causal: bool, window: int | None = None
) -> torch.Tensor:
    """The kit's dense oracle on each request's own contiguous K/V (what was written), the
    query rows being the request's last tokens, on the query's device."""
    contexts = [
        (keys.cpu().double().numpy(), values.cpu().double().numpy())
        for keys, values in zip(filled.keys[layer], filled.values[layer], strict=True)
    ]
    rows = query.cpu().double().numpy()
    expected = dense_attention_batch(rows, contexts, counts, causal=causal, sliding_window=window)
    return torch.tensor(expected, dtype=torch.float64, device=query.device)


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def public_attention(
    manager: Manager, layer: int, query: torch.Tensor, table: PageTable, counts: list[int], **options: Any
) -> torch.Tensor:
    """The public ``paged_attention`` on the pool's layer ``layer`` (``options`` are its
    keywords: ``causal``, ``kv_layout``, ``sliding_window``)."""
    storage = manager.storage
    return paged_attention(
        query, storage.key_cache(layer), storage.value_cache(layer), table, qo_indptr=indptr_of(counts), **options
    )


def numpy_expected(
    manager: Manager, layer: int, query: torch.Tensor, table: PageTable, counts: list[int], **options: Any
) -> npt.NDArray[np.floating[Any]]:
    """The NumPy reference in float64 on the pool's own layer ``layer`` (``options`` are the
    reference's keywords: ``causal``, ``kv_layout``, ``sliding_window``)."""
    storage = manager.storage
    return numpy_reference(
        storage.to_numpy(query).astype(np.float64),
        storage.to_numpy(storage.key_cache(layer)).astype(np.float64),
        storage.to_numpy(storage.value_cache(layer)).astype(np.float64),
        table,
        qo_indptr=indptr_of(counts),
        **options,
    )


# -- equal to the dense oracle (fp32, within 1e-5) ----------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("lengths", "query_counts", "group", "causal"),
    [
        pytest.param([5, 17, 30, 1], None, 1, True, id="decode"),
        pytest.param([5, 17, 30, 1], None, 4, True, id="decode-gqa-ragged"),
        pytest.param([5, 17, 30], [5, 17, 30], 2, True, id="prefill-gqa"),
        pytest.param([9, 21, 30], [2, 7, 1], 2, True, id="chunked-prefill"),
        pytest.param([9, 21, 30], [3, 0, 4], 4, True, id="request-without-queries"),
        pytest.param([9, 21, 30], [3, 1, 4], 2, False, id="non-causal"),
    ],
)
def test_equals_dense_oracle_in_fp32(
    device: str, layout: str, lengths: list[int], query_counts: list[int] | None, group: int, causal: bool
) -> None:
    manager = make_manager(device=device, kv_layout=layout, num_heads=2, head_dim=16)
    filled = fill(manager, lengths, seed=11)
    counts = query_counts or [1] * len(lengths)
    query = random_query(manager, sum(counts), group, seed=12)
    table = manager.page_table(filled.handles)
    output = manager.paged_attention(
        1, query, table, qo_indptr=None if query_counts is None else indptr_of(counts), causal=causal
    )
    assert output.shape == query.shape
    assert output.dtype == query.dtype
    assert output.device == query.device
    expected = dense_oracle(filled, 1, query, counts, causal)
    assert max_difference(output, expected) <= FP32_ATOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fragmented_block_tables_with_many_runs_equal_dense_oracle(layout: str) -> None:
    # The fifo placement scatters requests growing side by side into many short runs.
    manager = make_manager(kv_layout=layout, placement="fifo", num_blocks=96, block_size=4, head_dim=16)
    filled = fill(manager, [70, 90, 45, 3], seed=13, max_step=3)
    table = manager.page_table(filled.handles)
    runs = [len(table.runs(b)) for b in range(table.batch_size)]
    assert min(runs[:3]) >= 5, f"the table is not fragmented enough to test runs: {runs}"
    counts = [1, 6, 45, 2]
    query = random_query(manager, sum(counts), 4, seed=14)
    output = manager.paged_attention(0, query, table, qo_indptr=indptr_of(counts))
    assert max_difference(output, dense_oracle(filled, 0, query, counts, True)) <= FP32_ATOL


@pytest.mark.parametrize("placement", ["contiguous", "fifo"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_prefill_split_into_query_chunks_equals_dense_oracle(
    layout: str, placement: Placement, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small score budget forces the chunked path (and causal chunks that read fewer keys),
    # over one run per request (contiguous) and over many (fifo).
    monkeypatch.setattr(attention_module, "_SCORE_BUDGET", 2 * 4 * 64)
    manager = make_manager(kv_layout=layout, placement=placement, num_blocks=64, head_dim=16)
    filled = fill(manager, [40, 64], seed=15)
    counts = [40, 23]
    query = random_query(manager, sum(counts), 2, seed=16)
    table = manager.page_table(filled.handles)
    for causal in (True, False):
        output = manager.paged_attention(0, query, table, qo_indptr=indptr_of(counts), causal=causal)
        assert max_difference(output, dense_oracle(filled, 0, query, counts, causal)) <= FP32_ATOL


# -- sliding window --------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["contiguous", "fifo"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("query_counts", "causal", "window"),
    [
        pytest.param([1, 1, 1], True, 5, id="decode"),
        pytest.param([7, 30, 2], True, 6, id="prefill"),
        pytest.param([3, 11, 1], False, 9, id="non-causal"),
        pytest.param([4, 4, 4], True, 64, id="window-past-every-length"),
    ],
)
def test_a_sliding_window_equals_dense_oracle_with_the_window_mask(
    layout: str, placement: Placement, query_counts: list[int], causal: bool, window: int
) -> None:
    manager = make_manager(kv_layout=layout, placement=placement, num_blocks=64, head_dim=16)
    filled = fill(manager, [13, 30, 6], seed=24)
    query = random_query(manager, sum(query_counts), 2, seed=25)
    table = dataclasses.replace(manager.page_table(filled.handles), sliding_window=window)
    output = public_attention(manager, 0, query, table, query_counts, causal=causal, kv_layout=layout)
    expected = dense_oracle(filled, 0, query, query_counts, causal, window)
    assert max_difference(output, expected) <= FP32_ATOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_windowed_pool_that_released_old_blocks_matches_the_numpy_reference(layout: str) -> None:
    config = CacheConfig(
        num_layers=1, num_heads=2, head_dim=8, num_blocks=48, block_size=4, kv_layout=layout, sliding_window=7
    )
    manager: Manager = create_manager("torch", config)
    filled = fill(manager, [29, 17, 3], seed=26)
    table = manager.page_table(filled.handles)
    assert table.sliding_window == 7
    assert table.seq_lens[0] < 29, "the window released no block: nothing to test"
    storage = manager.storage
    for counts, causal in (([1, 1, 1], True), ([5, 9, 3], True), ([2, 4, 1], False)):
        query = random_query(manager, sum(counts), 2, seed=sum(counts))
        output = manager.paged_attention(0, query, table, qo_indptr=indptr_of(counts), causal=causal)
        expected = numpy_expected(manager, 0, query, table, counts, causal=causal, kv_layout=layout)
        assert np.allclose(storage.to_numpy(output), expected, rtol=1e-5, atol=1e-5)


# -- equal to the NumPy reference in every layout and dtype ---------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_numpy_reference_in_every_dtype_and_layout(device: str, dtype: str, layout: str) -> None:
    manager = make_manager(device=device, dtype=dtype, kv_layout=layout, placement="fifo", head_dim=16)
    filled = fill(manager, [13, 30, 6], seed=17)
    counts = [4, 9, 6]
    query = random_query(manager, sum(counts), 2, seed=18)
    table = manager.page_table(filled.handles)
    storage = manager.storage
    output = manager.paged_attention(1, query, table, qo_indptr=indptr_of(counts))
    expected = numpy_expected(manager, 1, query, table, counts, kv_layout=layout)
    rtol, atol = TOLERANCES[dtype]
    got = storage.to_numpy(output).astype(np.float64)
    assert output.dtype == TORCH_DTYPES[dtype]
    assert np.allclose(got, expected, rtol=rtol, atol=atol), float(np.max(np.abs(got - expected)))


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    data=st.data(),
    group=st.sampled_from([1, 2, 3]),
    layout=st.sampled_from(LAYOUTS),
    causal=st.booleans(),
    fragmented=st.booleans(),
    window=st.none() | st.integers(1, 24),
    path=st.sampled_from(["auto", "kernel", "native"]),
)
def test_any_batch_matches_the_numpy_reference(
    lengths: list[int],
    data: st.DataObject,
    group: int,
    layout: str,
    causal: bool,
    fragmented: bool,
    window: int | None,
    path: str,
) -> None:
    """On every attention path, forced (``auto``: the one measured faster here)."""
    counts = [data.draw(st.integers(0, length)) for length in lengths]
    manager = make_manager(kv_layout=layout, placement="fifo" if fragmented else "contiguous", num_blocks=48)
    filled = fill(manager, lengths, seed=sum(lengths))
    query = random_query(manager, sum(counts), group, seed=len(lengths))
    table = manager.page_table(filled.handles)
    storage = manager.storage
    options: dict[str, Any] = {"causal": causal, "kv_layout": layout, "sliding_window": window}
    output = public_attention(manager, 0, query, table, counts, path=path, **options)
    expected = numpy_expected(manager, 0, query, table, counts, **options)
    assert np.allclose(storage.to_numpy(output), expected, rtol=1e-5, atol=1e-5)


# -- reading in place -------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_piece_of_context_attention_reads_is_a_view_of_the_pool(layout: str) -> None:
    manager = make_manager(kv_layout=layout, placement="fifo", num_blocks=64)
    filled = fill(manager, [30, 41], seed=19)
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    table = manager.page_table(filled.handles)
    reader = attention_module._PoolReader(  # pyright: ignore[reportPrivateUsage]
        storage.key_cache(0), storage.value_cache(0), layout, table.block_size
    )
    base = storage.pool.untyped_storage().data_ptr()
    for b in range(table.batch_size):
        seq_len = int(table.seq_lens[b])
        firsts = [run.first_logical * table.block_size for run in table.runs(b)]
        spans = [
            (run.start, first, min(run.length * table.block_size, seq_len - first))
            for run, first in zip(table.runs(b), firsts, strict=True)
        ]
        # Any token range (a causal chunk stops early, a sliding window starts late) is read
        # as views of the pool holding exactly the request's tokens in that range, in order.
        for low, high in ((0, seq_len), (5, seq_len), (3, seq_len - 6), (seq_len - 1, seq_len)):
            pieces = reader.pieces(spans, low, high)
            assert sum(piece.tokens for piece in pieces) == high - low
            for piece in pieces:
                for view in (piece.keys, piece.values):
                    assert view.untyped_storage().data_ptr() == base  # a view, never a copy
            keys = torch.cat(
                [p.keys.transpose(0, 1) if not p.blocked else p.keys.permute(0, 2, 1, 3).flatten(0, 1) for p in pieces]
            )
            assert torch.equal(keys, filled.keys[0][b][low:high])


def test_attention_leaves_the_pool_unchanged_and_carries_no_gradient() -> None:
    manager = make_manager()
    filled = fill(manager, [12, 7], seed=20)
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    before = storage.pool.clone()
    query = random_query(manager, 2, 2, seed=21).requires_grad_(True)
    output = manager.paged_attention(0, query, manager.page_table(filled.handles))
    assert output.grad_fn is None
    assert torch.equal(storage.pool, before)


# -- the public function validates what the manager would -----------------------------------


def test_the_public_function_equals_the_manager_path() -> None:
    manager = make_manager(kv_layout="heads_first")
    filled = fill(manager, [8, 19], seed=22)
    table = manager.page_table(filled.handles)
    query = random_query(manager, 2, 2, seed=23)
    storage = manager.storage
    direct = paged_attention(
        query, storage.key_cache(1), storage.value_cache(1), table, scale=0.3, kv_layout="heads_first"
    )
    assert torch.equal(direct, manager.paged_attention(1, query, table, scale=0.3))


def _one_request_table(blocks: list[int], block_size: int = 4) -> PageTable:
    return PageTable(
        kv_indptr=np.array([0, len(blocks)]),
        kv_indices=np.array(blocks),
        kv_last_page_len=np.array([block_size]),
        block_tables=np.array([blocks]),
        seq_lens=np.array([len(blocks) * block_size]),
        block_size=block_size,
    )


BadCall = Callable[[torch.Tensor, torch.Tensor, PageTable], object]

BAD_CALLS: list[tuple[str, BadCall, type[Exception], str]] = [
    ("unknown-layout", lambda q, k, t: paged_attention(q, k, k, t, kv_layout="NCHW"), InvalidArgumentError, "NCHW"),
    ("query-float64", lambda q, k, t: paged_attention(q.double(), k, k, t), DTypeMismatchError, "float64"),
    ("query-numpy", lambda q, k, t: paged_attention(untyped(q.numpy()), k, k, t), ArrayTypeError, "ndarray"),
    ("query-3-heads", lambda q, k, t: paged_attention(q[:, :3], k, k, t), ShapeMismatchError, r"\(1, 3, 8\)"),
    ("caches-differ", lambda q, k, t: paged_attention(q, k, k[:-1], t), ShapeMismatchError, "share one 4-D shape"),
    ("scale-zero", lambda q, k, t: paged_attention(q, k, k, t, scale=0.0), InvalidArgumentError, "scale"),
    (
        "qo-indptr-past-queries",
        lambda q, k, t: paged_attention(q, k, k, t, qo_indptr=np.array([0, 2])),
        InvalidArgumentError,
        "0 to 1",
    ),
    (
        "block-past-pool",
        lambda q, k, t: paged_attention(q, k, k, _one_request_table([3, 16])),
        InvalidArgumentError,
        "0 to 15",
    ),
    ("window-zero", lambda q, k, t: paged_attention(q, k, k, t, sliding_window=0), InvalidArgumentError, "int >= 1"),
    (
        "window-unlike-the-table",
        lambda q, k, t: paged_attention(q, k, k, dataclasses.replace(t, sliding_window=4), sliding_window=5),
        InvalidArgumentError,
        "contradicts",
    ),
    (
        "block-size-differs",
        lambda q, k, t: paged_attention(q, k, k, _one_request_table([1, 2], block_size=2)),
        InvalidArgumentError,
        "block_size 2",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [pytest.param(*case[1:], id=case[0]) for case in BAD_CALLS])
def test_the_public_function_refuses_bad_arguments(call: BadCall, error: type[Exception], match: str) -> None:
    keys = torch.zeros(16, 4, 2, 8)  # NHD: 16 blocks of 4 tokens, 2 heads of 8
    query = torch.zeros(1, 4, 8)
    with pytest.raises(error, match=match):
        call(query, keys, _one_request_table([3, 4]))
