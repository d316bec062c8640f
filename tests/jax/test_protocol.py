"""JaxStorage is a ``KvStorage[jax.Array]`` and its manager's handles are
``KvCacheHandle[jax.Array]``: statically (mypy and pyright strict check the functions
below as part of the whole tree) and at run time, member by member."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import inspect

import jax

from kvcache_core import CacheConfig, KvCacheHandle, KvCacheManager, KvStorage, PagedKvCacheManager
from kvcache_core.contract.config import AllocationRequest
from kvcache_jax import JaxStorage

CONFIG = CacheConfig(num_layers=1, num_heads=2, head_dim=4, num_blocks=4, block_size=4)


def as_kv_storage(storage: JaxStorage) -> KvStorage[jax.Array]:
    checked: KvStorage[jax.Array] = storage  # the static check: a type error if a member is off
    return checked


def as_manager_and_handle(
    manager: PagedKvCacheManager[jax.Array],
) -> tuple[KvCacheManager[jax.Array], KvCacheHandle[jax.Array]]:
    typed_manager: KvCacheManager[jax.Array] = manager
    handle: KvCacheHandle[jax.Array] = manager.allocate(AllocationRequest("typed"))
    return typed_manager, handle


def test_jax_storage_satisfies_the_storage_protocol_without_inheriting_it() -> None:
    storage = JaxStorage(CONFIG)
    assert as_kv_storage(storage) is storage
    assert KvStorage not in type(storage).__mro__
    for name, member in vars(KvStorage).items():
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
            continue
        assert hasattr(storage, name), name
        if inspect.isfunction(member):
            expected = list(inspect.signature(member).parameters)[1:]
            assert list(inspect.signature(getattr(storage, name)).parameters) == expected, name


def test_the_managers_handles_are_jax_handles() -> None:
    manager = PagedKvCacheManager(JaxStorage(CONFIG), backend="jax")
    typed_manager, handle = as_manager_and_handle(manager)
    assert typed_manager is manager
    assert isinstance(handle, KvCacheHandle)
    assert isinstance(handle.key_cache(0), jax.Array)
