"""kvcache-torch: the PyTorch backend of kvcache.

A paged K/V pool on any torch device (:class:`TorchStorage`) and paged attention that
reads it in place (:func:`paged_attention`). Users reach it through core::

    from kvcache_core import CacheConfig, create_manager

    manager = create_manager("torch", CacheConfig(num_layers=2, num_heads=2, head_dim=64, num_blocks=256))

Importing this package does not import torch (discovery imports :mod:`kvcache_torch.plugin`
to list backends); the names below load it on first use.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcache_torch.attention import paged_attention
    from kvcache_torch.dtypes import TORCH_DTYPES, dtype_name, torch_dtype
    from kvcache_torch.storage import TorchStorage

try:
    __version__ = version("kvcache-torch")
except PackageNotFoundError:  # running from an uninstalled tree
    __version__ = "0+unknown"

__all__ = ["TORCH_DTYPES", "TorchStorage", "__version__", "dtype_name", "paged_attention", "torch_dtype"]

_LAZY = {
    "TorchStorage": "kvcache_torch.storage",
    "paged_attention": "kvcache_torch.attention",
    "TORCH_DTYPES": "kvcache_torch.dtypes",
    "dtype_name": "kvcache_torch.dtypes",
    "torch_dtype": "kvcache_torch.dtypes",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
