"""Internals that left the public face keep working one minor version, with a warning
that names the replacement; the kit reads them through :mod:`kvcache_core.testing.inspect`."""

from __future__ import annotations

import pytest

from kvcache_core import AllocationRequest
from kvcache_core.testing import inspect
from tests.core.support import make_manager


def test_manager_allocator_warns_and_is_the_inspected_allocator() -> None:
    manager = make_manager()
    with pytest.warns(DeprecationWarning, match=r"allocator is internal and will be removed in 0\.4\.0"):
        allocator = manager.allocator
    assert allocator is inspect.allocator(manager)


def test_manager_prefix_cache_warns_and_is_the_inspected_prefix_cache() -> None:
    manager = make_manager(enable_prefix_caching=True)
    with pytest.warns(DeprecationWarning, match=r"prefix_cache is internal and will be removed in 0\.4\.0"):
        prefix = manager.prefix_cache
    assert prefix is inspect.prefix_cache(manager) is not None


def test_handle_request_state_warns_and_is_the_inspected_state() -> None:
    handle = make_manager().allocate(AllocationRequest("r"))
    with pytest.warns(DeprecationWarning, match=r"request_state is internal and will be removed in 0\.4\.0"):
        state = handle.request_state
    assert state is inspect.request_state(handle)


def test_block_table_mut_warns_naming_block_table() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("r"))
    manager.extend(handle, 5)
    with pytest.warns(
        DeprecationWarning, match=r"block_table_mut\(\) hands out the table the manager owns.*use block_table\(\)"
    ):
        table = handle.block_table_mut()
    assert table.to_dict() == handle.block_table().to_dict()
    assert inspect.request_blocks(handle) == [list(table.physical_blocks)]
