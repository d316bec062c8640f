"""Registration of the torch backend under the entry-point group ``kvcache_core.backends``.

Discovery imports this module to list backends, so it imports neither torch nor the rest
of this package at module level: what it registers comes from :mod:`kvcache_torch.spec`
(torch-free), and the storage factory imports the storage when a manager is built.
``CAPABILITIES``, ``DTYPES`` and ``PREFERRED_LAYOUT`` stay importable from here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.hookspecs import BackendSpec, hookimpl
from kvcache_torch.spec import CAPABILITIES, DEVICES, DTYPES, LAYOUTS, PREFERRED_LAYOUT

if TYPE_CHECKING:
    import torch

    from kvcache_torch.storage import TorchStorage

__all__ = ["CAPABILITIES", "DTYPES", "PREFERRED_LAYOUT", "kvcache_register_backends", "make_storage"]


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
        devices=DEVICES,
        dtypes=DTYPES,
        kv_layouts=LAYOUTS,
        preferred_layout=PREFERRED_LAYOUT,
        capabilities=CAPABILITIES,
        description="PyTorch backend: pool on any torch device, paged attention over zero-copy block runs",
    )
