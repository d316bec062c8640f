"""The pure JAX attention refuses scalars no backend represents and non-finite sinks by
name, and takes NumPy scalars and the largest int32 window like Python's."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcache_jax
from kvcache_core.errors import InvalidArgumentError
from tests.attention_values_support import LARGEST_INT32_WINDOWS, refused_values

# One request of 5 tokens in blocks 0 and 1 of an NHD pool [4 blocks, 4 tokens, 2 heads, 8].
KEYS = jnp.asarray(np.random.default_rng(5).standard_normal((4, 4, 2, 8)), jnp.float32)
TABLES, LENS = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([5], jnp.int32)
QUERY = jnp.asarray(np.random.default_rng(6).standard_normal((1, 4, 8)), jnp.float32)


def attend(**arguments: Any) -> jax.Array:
    return kvcache_jax.paged_attention(QUERY, KEYS, KEYS, TABLES, LENS, **arguments)


@pytest.mark.parametrize(("arguments", "message"), refused_values(jnp.asarray))
def test_a_value_no_backend_represents_is_refused_by_name(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        attend(**arguments)


def test_the_largest_int32_windows_attend_like_none() -> None:
    plain = np.asarray(attend())
    for arguments in LARGEST_INT32_WINDOWS:
        np.testing.assert_array_equal(np.asarray(attend(**arguments)), plain, err_msg=str(arguments))


def test_numpy_scalars_attend_like_python_ones() -> None:
    got = attend(window=np.int64(3), softcap=np.float32(2.0), scale=np.float64(0.5), max_query_len=np.int32(1))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attend(window=3, softcap=2.0, scale=0.5)))


def test_blocks_per_step_past_the_table_reads_the_table_once() -> None:
    np.testing.assert_array_equal(np.asarray(attend(blocks_per_step=2**40)), np.asarray(attend(blocks_per_step=2)))
