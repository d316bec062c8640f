"""Registration of the torch backend under the entry-point group ``kvcache_core.backends``.

Discovery imports this module to list backends, so it imports neither torch nor the rest
of this package at module level: the storage factory and the availability probe do.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcache_core.contract.config import KV_LAYOUTS, CacheConfig
from kvcache_core.contract.hookspecs import BackendSpec, hookimpl

if TYPE_CHECKING:
    import torch

    from kvcache_torch.storage import TorchStorage

__all__ = ["CAPABILITIES", "DTYPES", "PREFERRED_LAYOUT", "kvcache_register_backends", "make_storage"]

#: The layout ``CacheConfig(kv_layout=None)`` resolves to: a head's keys are one strided
#: run per block, read zero-copy by the compiled kernel and by SDPA (a decode step at 4096
#: tokens measured 1.33x the dense floor with NHD, 1.25x with heads_first).
PREFERRED_LAYOUT = "heads_first"

#: Pool dtypes the backend claims (keep in step with ``kvcache_torch.dtypes.TORCH_DTYPES``).
DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn")

#: Optional features of the conformance kit the backend claims: the policies are core's,
#: over this storage's block copies (fork), host transfers (swap) and windowed attention.
#: The attention features (window, softcap, sinks, chunk) are served by ``attend_pool``.
CAPABILITIES = frozenset(
    {"fork", "prefix_caching", "swap", "eviction", "sliding_window"}
    | {"attention_window", "softcap", "sinks", "chunked_attention"}
)


def make_storage(config: CacheConfig) -> TorchStorage:
    """Build the pool for ``config`` (imports torch).

    Raises:
        UnsupportedConfigError: the config's device is not present here (CUDA without a GPU,
            a device index past the last GPU).
    """
    from kvcache_torch.storage import TorchStorage

    return TorchStorage(config)


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _why_unavailable() -> str:
    return "torch is not installed (pip install kvcache-torch)"


@hookimpl
def kvcache_register_backends() -> Iterator[BackendSpec[torch.Tensor]]:
    """Register the torch backend."""
    yield BackendSpec(
        name="torch",
        storage_factory=make_storage,
        is_available=_torch_installed,
        unavailable_reason=_why_unavailable,
        devices=("cpu", "cuda"),
        dtypes=DTYPES,
        kv_layouts=KV_LAYOUTS,
        preferred_layout=PREFERRED_LAYOUT,
        capabilities=CAPABILITIES,
        description="PyTorch backend: pool on any torch device, paged attention over zero-copy block runs",
    )
