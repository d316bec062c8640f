"""What the jax backend claims, without JAX: its layouts, dtypes, devices and capabilities.

The plugin module registers these facts and the storages follow them; both read them
here, so discovery lists the backend without importing JAX and nothing in this package
imports the plugin module.
"""

from __future__ import annotations

from typing import Final

from kvcache_core.contract.config import KV_LAYOUTS, QUANTIZED_DTYPES
from kvcache_core.contract.hookspecs import (
    ATTENTION_CAPABILITIES,
    IMMUTABLE_ARRAYS,
    LAYER_GEOMETRY,
    POLICY_CAPABILITIES,
    VALUE_HEAD_DIM,
)
from kvcache_core.contract.states import STATE_LAYERS

__all__ = [
    "ATTENTION_FEATURES",
    "CAPABILITIES",
    "DEVICES",
    "DTYPES",
    "LAYOUTS",
    "PREFERRED_LAYOUT",
    "QUANTIZED_POOL_DTYPES",
    "VALUE_POOL_DTYPES",
]

#: Pool layouts the backend holds: all of core's.
LAYOUTS: Final[tuple[str, ...]] = KV_LAYOUTS

#: The layout ``CacheConfig(kv_layout=None)`` resolves to on JAX: ``[heads, blocks,
#: block_size, head_dim]``, what JAX's Pallas paged attention reads.
PREFERRED_LAYOUT: Final = "heads_first"

#: Device kinds a JAX pool can live on (when JAX has such a device here).
DEVICES: Final[tuple[str, ...]] = ("cpu", "cuda", "gpu", "rocm", "tpu")

#: The dtypes a :class:`~kvcache_jax.JaxStorage` holds (float64 needs ``jax_enable_x64``
#: and is not offered).
VALUE_POOL_DTYPES: Final[tuple[str, ...]] = ("float32", "float16", "bfloat16")

#: The dtypes a :class:`~kvcache_jax.QuantizedJaxStorage` holds: all of core's quantized ones.
QUANTIZED_POOL_DTYPES: Final[tuple[str, ...]] = QUANTIZED_DTYPES

#: Every pool dtype of the backend.
DTYPES: Final[tuple[str, ...]] = VALUE_POOL_DTYPES + QUANTIZED_POOL_DTYPES

#: The attention features the storages' ``paged_attention`` serves: all of them.
ATTENTION_FEATURES: Final = ATTENTION_CAPABILITIES

#: What the conformance kit may check: the pool arrays are immutable (``key_cache`` hands
#: out the current array, never deleted under its holder), the core policies run through
#: the storage's block copies and host transfers, the attention features, recurrent-state
#: layers, values of another width than the keys, and layers of their own geometry (one
#: storage per geometry).
CAPABILITIES: Final = (
    POLICY_CAPABILITIES
    | ATTENTION_FEATURES
    | {
        IMMUTABLE_ARRAYS,
        LAYER_GEOMETRY,
        STATE_LAYERS,
        VALUE_HEAD_DIM,
    }
)
