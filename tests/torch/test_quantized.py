"""Quantized torch pools (int8, float8_e4m3fn): the pool and its scales, agreement with the
NumPy backend, the compiled-kernel and torch attention paths, and host copies (the kit's
QuantizedCases cover the contract)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache_core import AllocationRequest, create_manager
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.errors import ShapeMismatchError
from kvcache_torch.storage import TorchStorage
from tests.quantized_support import QUANTIZED, filled, pool

LAYOUTS = ("NHD", "HND", "heads_first")


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_the_pool_holds_raw_values_and_scales_beside_them(dtype: str) -> None:
    manager = create_manager("torch", pool(dtype=dtype))
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    assert storage.pool.dtype == {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}[dtype]
    assert storage.scales is not None
    assert tuple(storage.scales.shape) == (2, 2, 2, 48, 4)
    assert manager.stats().total_memory_bytes == storage.pool.nbytes + storage.scales.nbytes


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_torch_encodes_exactly_as_the_numpy_reference(dtype: str) -> None:
    numpy_manager, numpy_handles = filled(pool(dtype=dtype), "numpy")
    torch_manager, torch_handles = filled(pool(dtype=dtype), "torch")
    for numpy_handle, torch_handle in zip(numpy_handles, torch_handles, strict=True):
        blocks = np.asarray(numpy_handle.block_table().physical_blocks, dtype=np.int64)
        assert list(blocks) == list(torch_handle.block_table().physical_blocks)
        expected = numpy_manager.storage.blocks_to_host(blocks)
        got = torch_manager.storage.blocks_to_host(blocks)
        for got_array, expected_array in zip(got, expected, strict=True):
            assert got_array.tobytes() == expected_array.tobytes()


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("window", [None, 6])
def test_the_kernel_and_the_torch_path_agree_on_prefill_and_decode(
    dtype: str, kv_layout: str, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not paged_kernel.kernel_available():
        pytest.skip("numba is not installed")
    manager, handles = filled(pool(dtype=dtype, kv_layout=kv_layout, sliding_window=window), "torch")
    table = manager.page_table(handles)
    rng = np.random.default_rng(9)
    indptr = np.array([0, 3, 8], dtype=np.int32)
    query = manager.storage.from_numpy(rng.standard_normal((8, 4, 32)).astype(np.float32))
    compiled = manager.paged_attention(1, query, table, qo_indptr=indptr)
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    torch_path = manager.paged_attention(1, query, table, qo_indptr=indptr)
    torch.testing.assert_close(compiled, torch_path, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_compute_dtype_writes_and_attends_in_bfloat16() -> None:
    manager = create_manager("torch", pool(dtype="int8", compute_dtype="bfloat16"))
    handle = manager.allocate(AllocationRequest("a"))
    slots = manager.extend(handle, 9)
    keys = torch.randn(9, 2, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    manager.write(0, slots, keys, keys)
    gathered, _ = manager.gather(handle, 0)
    assert gathered.dtype == torch.bfloat16
    got, wrote = gathered.float().numpy(), keys.float().numpy()
    assert float(np.linalg.norm(got - wrote) / np.linalg.norm(wrote)) < 0.02
    output = manager.paged_attention(0, keys[-1:].repeat(1, 2, 1), manager.page_table([handle]))
    assert output.dtype == torch.bfloat16


def test_host_copies_of_the_wrong_geometry_are_refused() -> None:
    manager = create_manager("torch", pool(dtype="int8"))
    storage = manager.storage
    blocks = np.array([0, 1], dtype=np.int64)
    keys, values = storage.blocks_to_host(blocks)
    assert keys.dtype == np.uint8
    assert keys.shape == (2, 2, 4, 2, 36)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 2, 4, 2, 36\).*head_dim \+ 4 scale bytes.*\(2, 2, 4, 2, 32\)"):
        storage.blocks_from_host(blocks, keys[..., :32], values)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 1, 4, 2, 36\)"):
        storage.blocks_from_host(np.array([0], dtype=np.int64), keys, values)
