"""The torch pool's padded gather reads each way it has (on CPU, run by run in compiled code;
without it, one head, a row per call, a head of a row per call from 256 KiB a head) what
``manager.gather`` gives, padded on the left."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, Step, create_manager
from kvcache_core.attention.gather_kernel import SlotRuns, gather_runs_together
from kvcache_core.attention.kernel import DISABLE_ENV, kernel_available
from kvcache_torch import TorchStorage


@dataclass
class CompiledReads:
    """Whether the compiled gather is on, and each of its results (``True``: it copied)."""

    on: bool
    results: list[bool] = field(default_factory=list[bool])

    def expect(self, reads: int) -> None:
        """``reads`` compiled copies where it is on; none where it is off (the torch reads ran)."""
        assert self.results == [True] * (reads if self.on else 0)


@pytest.fixture(params=["compiled", "torch"])
def compiled_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> CompiledReads:
    """The compiled gather's calls while the test runs; ``"torch"`` switches the compiled code off."""
    if request.param == "torch":
        monkeypatch.setenv(DISABLE_ENV, "1")
    elif not kernel_available():
        pytest.skip("the compiled gather needs numba")
    reads = CompiledReads(request.param == "compiled")
    original = gather_runs_together

    def counted(*args: object) -> bool:
        reads.results.append(original(*args))  # type: ignore[arg-type]  # the reader's own arguments
        return reads.results[-1]

    monkeypatch.setattr("kvcache_torch.padded.gather_runs_together", counted)
    return reads


def _expected(manager: PagedKvCacheManager[torch.Tensor], handles: list[object], layer: int) -> torch.Tensor:
    """``[B, heads, width, dim]`` keys from ``manager.gather``, zeros before each row's tokens."""
    rows = [manager.gather(handle, layer)[0] for handle in handles]  # type: ignore[arg-type]  # handles
    width = max(int(row.shape[0]) for row in rows)
    out = torch.zeros((len(rows), rows[0].shape[1], width, rows[0].shape[2]))
    for index, row in enumerate(rows):
        out[index, :, width - row.shape[0] :] = row.transpose(0, 1)
    return out


@pytest.mark.parametrize(
    ("heads", "head_dim", "lengths"),
    [(1, 40, (37, 5, 12)), (2, 16, (37, 5, 12)), (2, 64, (1100, 700, 5))],
    ids=["one head", "a row per call", "a head of a row per call"],
)
@pytest.mark.parametrize("kv_layout", ["heads_first", "NHD"])
def test_the_padded_read_holds_each_row_s_tokens_after_zeros(
    heads: int, head_dim: int, lengths: tuple[int, ...], kv_layout: str, compiled_reads: CompiledReads
) -> None:
    config = CacheConfig(
        num_layers=2, num_heads=heads, head_dim=head_dim, block_size=16, num_blocks=160, kv_layout=kv_layout
    )
    with create_manager("torch", config) as manager:
        handles = [manager.allocate(AllocationRequest(f"r{row}")) for row in range(len(lengths))]
        step = manager.begin_step(handles, list(lengths))
        generator = torch.Generator().manual_seed(3)
        for layer in range(2):
            shape = (sum(lengths), heads, head_dim)
            step.write(layer, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for layer in range(2):
            keys, _ = step.gather_padded(layer, layout="HND")
            assert keys.is_contiguous()
            assert torch.equal(keys, _expected(manager, list(handles), layer))
            nhd, _ = step.gather_padded(layer, layout="NHD")
            assert torch.equal(nhd, keys.transpose(1, 2))
        assert np.array_equal(step.page_table.seq_lens, lengths)
    if kv_layout != "heads_first":  # an NHD pool is read by torch
        compiled_reads.expect(0)
    else:
        compiled_reads.expect(2)  # two layers, K and V read heads second in one call each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_of_many_runs_are_read_after_decode_steps(dtype: torch.dtype, compiled_reads: CompiledReads) -> None:
    """Decode steps give each row a block at a time, between the other rows': many runs per row."""
    lengths = [21, 3, 40]
    config = CacheConfig(
        num_layers=1,
        num_heads=3,
        head_dim=8,
        block_size=4,
        num_blocks=64,
        kv_layout="heads_first",
        dtype=str(dtype).removeprefix("torch."),
    )
    generator = torch.Generator().manual_seed(7)
    with create_manager("torch", config) as manager:
        handles = [manager.allocate(AllocationRequest(f"r{row}")) for row in range(len(lengths))]

        def run(counts: list[int]) -> Step[torch.Tensor]:
            step = manager.begin_step(handles, counts)
            shape = (sum(counts), 3, 8)
            keys = torch.randn(shape, generator=generator).to(dtype)
            step.write(0, keys, torch.randn(shape, generator=generator).to(dtype))
            return step

        step = run(lengths)  # a prefill, then ten decode steps
        for _ in range(10):
            step = run([1] * len(lengths))
        keys, values = step.gather_padded(0, layout="HND")
        assert torch.equal(keys, _expected(manager, list(handles), 0).to(dtype))
        assert torch.equal(values.transpose(1, 2), step.gather_padded(0, layout="NHD")[1])
        assert manager.gather(handles[1], 0)[0].shape[0] == 13  # 3 + 10 tokens, in 4 blocks of 4
    compiled_reads.expect(1)  # K and V read heads second in one call


@pytest.mark.parametrize("kv_layout", ["heads_first", "NHD", "HND"])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_one_request_s_run_is_shown_in_place_where_the_layout_keeps_its_tokens_in_order(
    kv_layout: str, dtype: str
) -> None:
    config = CacheConfig(
        num_layers=2, num_heads=2, head_dim=8, block_size=4, num_blocks=16, kv_layout=kv_layout, dtype=dtype
    )
    with create_manager("torch", config) as manager:
        handle = manager.allocate(AllocationRequest("r"))
        step = manager.begin_step([handle], [13])  # four blocks, one run
        generator = torch.Generator().manual_seed(5)
        step.write(1, torch.randn((13, 2, 8), generator=generator), torch.randn((13, 2, 8), generator=generator))
        shown = dtype == "float32" and kv_layout != "HND"  # HND interleaves a block's tokens with its heads
        for width, layout in ((None, "HND"), (9, "HND"), (9, "NHD"), (0, "NHD")):
            view = step.padded_view(1, width=width, layout=layout)
            if not shown:
                assert view is None
                continue
            assert view is not None
            copies = step.gather_padded(1, width=width, layout=layout)
            storage = manager.storage
            assert isinstance(storage, TorchStorage)
            for got, copied in zip(view, copies, strict=True):
                assert got.shape == copied.shape
                assert torch.equal(got, copied)
                assert got.untyped_storage().data_ptr() == storage.pool.untyped_storage().data_ptr()  # no copy
        assert step.padded_view(1, width=14) is None  # a position before its first token: padding


@pytest.mark.skipif(not kernel_available(), reason="the compiled gather needs numba")
def test_a_decode_step_s_read_extends_the_last_step_s_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading every step of a decode, the runs are found once, at the first step, and extended
    after (new blocks open new runs between the rows' blocks); each read is the request's tokens."""
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=8, block_size=4, num_blocks=64, kv_layout="heads_first")
    generator = torch.Generator().manual_seed(5)
    found: list[int] = []
    original = SlotRuns.__init__

    def counted(runs: SlotRuns, slots: npt.NDArray[np.int64]) -> None:
        found.append(int(slots.shape[1]))
        original(runs, slots)

    monkeypatch.setattr(SlotRuns, "__init__", counted)
    with create_manager("torch", config) as manager:
        handles = [manager.allocate(AllocationRequest(f"r{row}")) for row in range(3)]
        counts = [9, 2, 5]
        for _ in range(9):  # a prefill, then decode steps of one token per row
            step = manager.begin_step(handles, counts)
            shape = (sum(counts), 2, 8)
            for layer in range(2):
                step.write(layer, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
                keys, _ = step.gather_padded(layer, layout="HND")
                assert torch.equal(keys, _expected(manager, list(handles), layer))
            counts = [1, 1, 1]
    assert found == [9]  # the prefill's; the decode steps' runs are extended
