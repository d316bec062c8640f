"""Closing a manager: the pool is released through the storage's optional ``close()``."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, ManagerClosedError, PagedKvCacheManager, create_manager
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.errors import InvalidHandleError

CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4)


class ClosingStorage(NumpyStorage):
    """Counts its ``close`` calls."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self.close_calls = 0

    def close(self) -> None:
        self.close_calls += 1


def test_close_calls_the_storage_close_once_however_often_it_is_called() -> None:
    storage = ClosingStorage(CONFIG)
    manager = PagedKvCacheManager(storage)

    manager.close()
    manager.close()

    assert manager.closed
    assert storage.close_calls == 1


def test_the_with_block_closes_the_manager_even_when_it_raises() -> None:
    storage = ClosingStorage(CONFIG)
    manager = PagedKvCacheManager(storage)

    def serve() -> None:
        with manager:
            assert not manager.closed
            raise KeyError("boom")

    with pytest.raises(KeyError):
        serve()
    assert manager.closed
    assert storage.close_calls == 1


def test_a_closed_manager_refuses_every_use_with_manager_closed_error() -> None:
    manager = create_manager("numpy", CONFIG)
    handle = manager.allocate(AllocationRequest("a"))
    slots = manager.extend(handle, 3)
    manager.close()

    keys = np.zeros((3, 2, 4), dtype=np.float32)
    with pytest.raises(ManagerClosedError, match="closed"):
        manager.allocate(AllocationRequest("b"))
    with pytest.raises(ManagerClosedError):
        manager.extend(handle, 1)
    with pytest.raises(ManagerClosedError):
        manager.write(0, slots, keys, keys)
    with pytest.raises(ManagerClosedError):
        manager.gather(handle, 0)
    with pytest.raises(ManagerClosedError):
        manager.deallocate("a")
    with pytest.raises(ManagerClosedError):
        manager.swap_out("a")
    with pytest.raises(ManagerClosedError):
        manager.gc()


def test_handles_of_a_closed_manager_are_invalid_and_refuse_data_access() -> None:
    with create_manager("numpy", CONFIG) as manager:
        handle = manager.allocate(AllocationRequest("a", initial_tokens=2))
        clone = handle.clone_handle()
    assert not handle.is_valid()
    assert not clone.is_valid()
    with pytest.raises(ManagerClosedError, match="closed manager"):
        handle.key_cache(0)
    with pytest.raises(InvalidHandleError):  # ManagerClosedError is an InvalidHandleError
        clone.kv_cache(1)


def test_a_storage_without_close_is_closed_too() -> None:
    manager = create_manager("numpy", CONFIG)
    assert not hasattr(manager.storage, "close")
    manager.close()
    assert manager.closed
    with pytest.raises(ManagerClosedError):
        manager.allocate(AllocationRequest("a"))


def test_figures_stay_readable_after_close() -> None:
    manager = create_manager("numpy", CONFIG)
    manager.allocate(AllocationRequest("a", initial_tokens=5))
    manager.close()
    assert manager.stats().used_blocks == 2
