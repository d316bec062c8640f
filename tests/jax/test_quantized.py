"""Quantized JAX pools (jnp.int8, jnp.float8_e4m3fn): raw pools and scales, encoding and
attention against the NumPy backend, and what they refuse (the kit's QuantizedCases cover
the contract)."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvcache_core import create_manager
from kvcache_core.errors import ShapeMismatchError
from kvcache_jax import QuantizedJaxStorage, paged_attention
from tests.quantized_support import QUANTIZED, filled, pool


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_the_pool_holds_raw_values_and_scales_beside_them(dtype: str) -> None:
    manager = create_manager("jax", pool(dtype=dtype))
    storage = manager.storage
    assert isinstance(storage, QuantizedJaxStorage)
    assert storage.key_cache(0).dtype == jnp.dtype(dtype)
    key_scales, value_scales = storage.scales(0)
    assert key_scales.shape == value_scales.shape == (2, 48, 4)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("kv_layout", ["NHD", "HND", "heads_first"])
def test_jax_encodes_and_attends_like_the_numpy_backend(dtype: str, kv_layout: str) -> None:
    config = pool(dtype=dtype, kv_layout=kv_layout)
    numpy_manager, numpy_handles = filled(config, "numpy")
    jax_manager, jax_handles = filled(config, "jax")
    blocks = np.arange(config.num_blocks, dtype=np.int64)
    for got, expected in zip(
        jax_manager.storage.blocks_to_host(blocks), numpy_manager.storage.blocks_to_host(blocks), strict=True
    ):
        assert got.tobytes() == expected.tobytes()
    query = np.random.default_rng(3).standard_normal((8, 4, 32)).astype(np.float32)
    indptr = np.array([0, 3, 8], dtype=np.int32)
    expected_output = numpy_manager.paged_attention(1, query, numpy_manager.page_table(numpy_handles), qo_indptr=indptr)
    output = jax_manager.paged_attention(
        1, jax_manager.storage.from_numpy(query), jax_manager.page_table(jax_handles), qo_indptr=indptr
    )
    np.testing.assert_allclose(np.asarray(output), expected_output, rtol=2e-5, atol=2e-5)


def test_paged_attention_takes_both_scales_of_the_pool_shape_or_neither() -> None:
    cache = jnp.zeros((48, 4, 2, 32), jnp.int8)
    scales = jnp.ones((2, 48, 4), jnp.float32)
    query = jnp.zeros((1, 2, 32), jnp.float32)
    tables, lengths = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 48, 4\)"):
        paged_attention(query, cache, cache, tables, lengths, key_scales=scales)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 48, 4\)"):
        paged_attention(query, cache, cache, tables, lengths, key_scales=scales, value_scales=scales[:, :4])
