"""What the torch backend claims, without torch: its layouts, dtypes, devices and capabilities.

The plugin module registers these facts and the storage follows them; both read them
here, so discovery lists the backend without importing torch and nothing in this package
imports the plugin module.
"""

from __future__ import annotations

from typing import Final

from kvcache_core.contract.config import KV_LAYOUTS
from kvcache_core.contract.hookspecs import (
    ATTENTION_CAPABILITIES,
    LAYER_GEOMETRY,
    POLICY_CAPABILITIES,
    VALUE_HEAD_DIM,
)
from kvcache_core.contract.lanes import STEP_LANES
from kvcache_core.contract.regions import MEMORY_REGIONS
from kvcache_core.contract.states import STATE_LAYERS

__all__ = ["ATTENTION_FEATURES", "CAPABILITIES", "DEVICES", "DTYPES", "LAYOUTS", "PREFERRED_LAYOUT"]

#: Pool layouts the backend holds: all of core's.
LAYOUTS: Final[tuple[str, ...]] = KV_LAYOUTS

#: The layout ``CacheConfig(kv_layout=None)`` resolves to: a head's keys are one strided
#: run per block, read zero-copy by the compiled kernel and by SDPA (a decode step at 4096
#: tokens measured 1.33x the dense floor with NHD, 1.25x with heads_first).
PREFERRED_LAYOUT: Final = "heads_first"

#: Device kinds a torch pool can live on (when torch has such a device here).
DEVICES: Final[tuple[str, ...]] = ("cpu", "cuda")

#: Pool dtypes the backend holds, by the names :class:`~kvcache_core.CacheConfig` uses and
#: torch's own (``torch.<name>``); ``int8`` and ``float8_e4m3fn`` are quantized pools.
DTYPES: Final[tuple[str, ...]] = ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn")

#: The attention features ``TorchStorage.paged_attention`` serves: all of them (``attend_pool``).
ATTENTION_FEATURES: Final = ATTENTION_CAPABILITIES

#: Optional features of the conformance kit the backend claims: core's policies, over this
#: storage's block copies (fork), host transfers (swap) and windowed attention, the
#: attention features, recurrent-state layers (``TorchStorage.state_storage``), values of
#: another width than the keys, layers of their own geometry (one storage per geometry), its
#: pool's memory regions (CPU and CUDA tensors keep their addresses), and step lanes
#: (:mod:`kvcache_torch.lanes`).
CAPABILITIES: Final = (
    POLICY_CAPABILITIES
    | ATTENTION_FEATURES
    | {
        LAYER_GEOMETRY,
        MEMORY_REGIONS,
        STATE_LAYERS,
        STEP_LANES,
        VALUE_HEAD_DIM,
    }
)
