"""The ``jax`` backend's plugin: the module the ``kvcache_core.backends`` entry point names.

Discovery imports this module to list backends, so it imports no JAX: what it registers
comes from :mod:`kvcache_jax.spec` (JAX-free), and the storage factory imports the
storages when a manager is built. ``CAPABILITIES``, ``DEVICES``, ``DTYPES`` and
``PREFERRED_LAYOUT`` stay importable from here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.hookspecs import BackendSpec, hookimpl
from kvcache_core.errors import BackendUnavailableError
from kvcache_jax.spec import CAPABILITIES, DEVICES, DTYPES, LAYOUTS, PREFERRED_LAYOUT

if TYPE_CHECKING:
    import jax

    from kvcache_jax.storage import JaxStorage

__all__ = [
    "CAPABILITIES",
    "DEVICES",
    "DTYPES",
    "PREFERRED_LAYOUT",
    "is_available",
    "kvcache_register_backends",
    "make_storage",
    "unavailable_reason",
]


def make_storage(config: CacheConfig, *, mesh: object = None, axis: object = None) -> JaxStorage:
    """The storage factory: a :class:`~kvcache_jax.JaxStorage` for ``config``.

    ``create_manager("jax", config, mesh=mesh, axis="model")`` passes ``mesh`` and ``axis``
    here to split the pool's KV heads over that mesh axis.
    """
    try:
        from kvcache_jax.storage import JaxStorage
    except ImportError as exc:  # jax or jaxlib installed but broken (mismatched versions, ...)
        raise BackendUnavailableError(f"the jax backend cannot import JAX: {exc}; {unavailable_reason()}") from exc
    if config.quantized:
        from kvcache_jax.quantized import QuantizedJaxStorage

        return QuantizedJaxStorage(config, mesh=mesh, axis=axis)
    return JaxStorage(config, mesh=mesh, axis=axis)


def is_available() -> bool:
    """Whether JAX and jaxlib are installed here (looked up without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("jax", "jaxlib"))


def unavailable_reason() -> str:
    """Why the backend cannot run, with the command that fixes it."""
    return "jax is not installed: pip install kvcache-jax (or pip install jax jaxlib)"


@hookimpl
def kvcache_register_backends() -> Iterator[BackendSpec[jax.Array]]:
    """Register the ``jax`` backend."""
    yield BackendSpec(
        name="jax",
        storage_factory=make_storage,
        is_available=is_available,
        unavailable_reason=unavailable_reason,
        devices=DEVICES,
        dtypes=DTYPES,
        kv_layouts=LAYOUTS,
        preferred_layout=PREFERRED_LAYOUT,
        description="JAX pool updated in place (donated), jitted paged attention, KV heads sharded over a mesh",
        capabilities=CAPABILITIES,
    )
