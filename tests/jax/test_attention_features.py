"""kvcache_jax.paged_attention (the pure function) with the attention features, under
jax.jit, equals the NumPy reference, and refuses bad features."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcache_jax
from kvcache_core import AllocationRequest, CacheConfig, InvalidArgumentError, create_manager
from kvcache_core.attention.reference import paged_attention as numpy_reference
from kvcache_core.errors import ShapeMismatchError


def _filled() -> tuple[Any, Any, Any]:
    config = CacheConfig(num_layers=1, num_heads=2, head_dim=8, num_blocks=40, block_size=4, kv_layout="NHD")
    manager = create_manager("jax", config)
    rng = np.random.default_rng(7)
    handles = [manager.allocate(AllocationRequest(rid)) for rid in ("a", "b", "c")]
    for handle, length in zip(handles, (5, 17, 30), strict=True):
        slots = manager.extend(handle, length)
        data = rng.standard_normal((2, length, 2, 8)).astype(np.float32)
        manager.write(0, slots, jnp.asarray(data[0]), jnp.asarray(data[1]))
    return manager, manager.page_table(handles), rng


@pytest.mark.parametrize("causal", [True, False])
def test_the_jitted_function_with_every_feature_equals_the_numpy_reference(causal: bool) -> None:
    manager, table, rng = _filled()
    indptr = np.array([0, 2, 11, 12], dtype=np.int32)
    query = (rng.standard_normal((12, 4, 8)) * 2).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    keys, values = manager.storage.key_cache(0), manager.storage.value_cache(0)

    @partial(jax.jit, static_argnames=("window", "softcap", "chunk"))
    def attend(q: jax.Array, s: jax.Array, window: int, softcap: float, chunk: int) -> jax.Array:
        return kvcache_jax.paged_attention(
            q, keys, values, jnp.asarray(table.block_tables), jnp.asarray(table.seq_lens), jnp.asarray(indptr),
            max_query_len=9, causal=causal, window=window, softcap=softcap, sinks=s, chunk=chunk,
        )  # fmt: skip

    for window, softcap, chunk in ((5, 1.5, 30), (9, 2.0, 7), (40, 0.5, 3)):
        got = attend(jnp.asarray(query), jnp.asarray(sinks), window=window, softcap=softcap, chunk=chunk)
        expected = numpy_reference(
            query.astype(np.float64), np.asarray(keys, np.float64), np.asarray(values, np.float64), table,
            qo_indptr=indptr, causal=causal, window=window, softcap=softcap, sinks=sinks.astype(np.float64),
            chunk=chunk,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"window": 0}, InvalidArgumentError),
        ({"chunk": 1.5}, InvalidArgumentError),
        ({"softcap": -1.0}, InvalidArgumentError),
        ({"sinks": jnp.zeros(3)}, ShapeMismatchError),
    ],
)
def test_bad_features_are_refused_by_the_pure_function(arguments: dict[str, Any], error: type[Exception]) -> None:
    manager, table, _ = _filled()
    with pytest.raises(error, match=next(iter(arguments))):
        kvcache_jax.paged_attention(
            jnp.zeros((3, 4, 8)), manager.storage.key_cache(0), manager.storage.value_cache(0),
            jnp.asarray(table.block_tables), jnp.asarray(table.seq_lens), **arguments,
        )  # fmt: skip
