"""On CPU, torch paged attention is one call of the compiled kernel per layer, with torch's
thread count; without it (switched off) the torch path gives the same result."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.testing.oracle import dense_attention
from tests.torch.support import DTYPES, LAYOUTS, TOLERANCES, TORCH_DTYPES, fill, make_manager

needs_numba = pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")


def decode_query(rows: int, heads: int, dim: int, dtype: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randn((rows, heads, dim), generator=generator).to(TORCH_DTYPES[dtype])


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_attention_is_one_kernel_call_with_torch_threads(
    dtype: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = make_manager(dtype=dtype, kv_layout=layout, placement="fifo")
    filled = fill(manager, [5, 17, 30])
    table = manager.page_table(filled.handles)
    query = decode_query(3, 4, 8, dtype)
    calls: list[dict[str, Any]] = []
    real = paged_kernel.attend_with_kernel

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_kernel, "attend_with_kernel", counted)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fast = manager.paged_attention(1, query, table)
    finally:
        torch.set_num_threads(previous)
    assert [(call["dtype"], call["num_threads"]) for call in calls] == [(dtype, 1)]
    assert fast.dtype == TORCH_DTYPES[dtype]
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    torch_path = manager.paged_attention(1, query, table)
    assert len(calls) == 1  # switched off: the torch path ran
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(fast, torch_path, rtol=rtol, atol=atol)


@needs_numba
def test_the_kernel_reads_the_pool_in_place() -> None:
    """A change to the pool after the page table was taken shows in the next result."""
    manager = make_manager(kv_layout="heads_first")
    filled = fill(manager, [20])
    table = manager.page_table(filled.handles)
    query = decode_query(1, 2, 8, "float32")
    before = manager.paged_attention(0, query, table)
    key_cache = manager.storage.key_cache(0)
    assert isinstance(key_cache, torch.Tensor)
    key_cache[:, int(table.kv_indices[0]), 0] += 1.0
    after = manager.paged_attention(0, query, table)
    assert not torch.allclose(before, after)
    keys = filled.keys[0][0].clone()
    keys[0] += 1.0
    expected = dense_attention(query[:1].cpu().numpy(), keys.cpu().numpy(), filled.values[0][0].cpu().numpy())
    np.testing.assert_allclose(after[:1].cpu().numpy(), expected, rtol=1e-5, atol=1e-5)
