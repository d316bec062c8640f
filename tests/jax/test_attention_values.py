"""The pure JAX attention refuses scalars no backend represents and non-finite sinks by
name, and takes NumPy scalars and the largest int32 window like Python's."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcache_jax
from kvcache_core.contract.scalars import INT32_MAX
from kvcache_core.errors import InvalidArgumentError

# One request of 5 tokens in blocks 0 and 1 of an NHD pool [4 blocks, 4 tokens, 2 heads, 8].
KEYS = jnp.asarray(np.random.default_rng(5).standard_normal((4, 4, 2, 8)), jnp.float32)
TABLES, LENS = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([5], jnp.int32)
QUERY = jnp.asarray(np.random.default_rng(6).standard_normal((1, 4, 8)), jnp.float32)


def attend(**arguments: Any) -> jax.Array:
    return kvcache_jax.paged_attention(QUERY, KEYS, KEYS, TABLES, LENS, **arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"window": 2**31}, f"window must be None or an int >= 1, got {2**31}; valid: 1 to {INT32_MAX}"),
        ({"sliding_window": 2**31}, f"sliding_window must be None or an int >= 1, got {2**31}; valid: 1 to"),
        ({"chunk": 2**70}, f"chunk must be None or an int >= 1, got {2**70}; valid: 1 to {INT32_MAX}"),
        ({"softcap": 1e39}, "softcap must be None or a finite number > 0, got 1e+39; valid:"),
        ({"scale": 1e-46}, "scale must be a finite number > 0, got 1e-46; valid:"),
        ({"sinks": jnp.asarray([0.0, math.nan, 0.0, 0.0])}, "sinks[1] = nan: sinks must be finite"),
        ({"sinks": jnp.asarray([math.inf, 0.0, 0.0, 0.0])}, "sinks[0] = inf: sinks must be finite"),
    ],
    ids=["window-past-int32", "sliding-window-past-int32", "chunk-2-to-the-70", "softcap-past-float32",
         "scale-below-float32", "sinks-nan", "sinks-inf"],
)  # fmt: skip
def test_a_value_no_backend_represents_is_refused_by_name(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        attend(**arguments)


def test_the_largest_int32_windows_attend_like_none() -> None:
    plain = np.asarray(attend())
    for arguments in ({"window": INT32_MAX}, {"sliding_window": INT32_MAX}, {"chunk": INT32_MAX}):
        np.testing.assert_array_equal(np.asarray(attend(**arguments)), plain, err_msg=str(arguments))


def test_numpy_scalars_attend_like_python_ones() -> None:
    got = attend(window=np.int64(3), softcap=np.float32(2.0), scale=np.float64(0.5), max_query_len=np.int32(1))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attend(window=3, softcap=2.0, scale=0.5)))


def test_blocks_per_step_past_the_table_reads_the_table_once() -> None:
    np.testing.assert_array_equal(np.asarray(attend(blocks_per_step=2**40)), np.asarray(attend(blocks_per_step=2)))
