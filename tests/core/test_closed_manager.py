"""A closed manager refuses subscriptions and callbacks like every other use."""

from __future__ import annotations

import pytest

from kvcache_core import AllocationRequest, CacheConfig, ManagerClosedError, MemoryPressure, create_manager
from kvcache_core.offload.events import CacheEvent

CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4)


def listen(event: CacheEvent) -> None:
    """A subscriber that ignores what it gets."""


def watch(level: MemoryPressure) -> None:
    """A pressure callback that ignores what it gets."""


def test_a_closed_manager_refuses_a_new_subscriber() -> None:
    manager = create_manager("numpy", CONFIG)
    manager.close()
    with pytest.raises(ManagerClosedError, match="closed"):
        manager.subscribe(listen)


def test_a_closed_manager_refuses_to_unsubscribe_even_a_subscriber() -> None:
    manager = create_manager("numpy", CONFIG)
    manager.subscribe(listen)
    manager.close()
    with pytest.raises(ManagerClosedError, match="closed"):
        manager.unsubscribe(listen)


def test_a_closed_manager_refuses_a_pressure_callback() -> None:
    manager = create_manager("numpy", CONFIG)
    manager.close()
    with pytest.raises(ManagerClosedError, match="closed"):
        manager.set_pressure_callback(watch)
    with pytest.raises(ManagerClosedError, match="closed"):
        manager.set_pressure_callback(None)


def test_a_closed_manager_refuses_reads_of_its_requests_but_not_its_figures() -> None:
    manager = create_manager("numpy", CONFIG)
    handle = manager.allocate(AllocationRequest("a", initial_tokens=5))
    manager.close()
    with pytest.raises(ManagerClosedError):
        manager.get_handle("a")
    with pytest.raises(ManagerClosedError):
        manager.list_handles()
    with pytest.raises(ManagerClosedError):
        manager.can_allocate(AllocationRequest("b"))
    with pytest.raises(ManagerClosedError):
        handle.block_table()
    assert manager.stats().used_blocks == 2
    assert manager.tier_stats() == []
    assert handle.stats().blocks_allocated == 2


def test_a_closed_manager_cannot_be_entered_again() -> None:
    manager = create_manager("numpy", CONFIG)
    manager.close()
    with pytest.raises(ManagerClosedError), manager:
        pass
