"""The torch pool's step lane (``kvcache_torch.lanes``) keeps every policy of the manager:
a stale step, a block the prefix cache serves since the step was planned, an array of
another dtype and autograd are handled as on the general path, and nothing is written
where a call is refused. (The kit's ``LaneCases`` compare the lane with the general path.)"""

from __future__ import annotations

import pytest
import torch

from kvcache_core import AllocationRequest, PagedKvCacheManager, create_manager
from kvcache_core.errors import DTypeMismatchError, SharedBlockWriteError, StaleStepError
from kvcache_torch import TorchStorage
from kvcache_torch.lanes import TorchLane
from tests.core.support import make_config
from tests.torch.support import Manager, make_manager

pytestmark = pytest.mark.filterwarnings("error")


def arrays(manager: Manager, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    config = manager.config
    keys = torch.randn((tokens, config.num_heads, config.head_dim), generator=generator)
    values = torch.randn((tokens, config.num_heads, config.head_dim), generator=generator)
    query = torch.randn((tokens, 2 * config.num_heads, config.head_dim), generator=generator)
    return keys, values, query


def pool_copy(manager: Manager) -> torch.Tensor:
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    return storage.pool.clone()


@pytest.mark.parametrize("layout", ["NHD", "heads_first"])
def test_the_storage_prepares_a_lane_for_its_plain_pools_only(layout: str) -> None:
    manager = make_manager(kv_layout=layout)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [3])
    lane = manager.storage.step_lane(step.page_table, step.slots, step.qo_indptr)  # type: ignore[attr-defined]
    assert isinstance(lane, TorchLane)
    hnd = make_manager(kv_layout="HND")
    other = hnd.allocate(AllocationRequest("a"))
    step = hnd.begin_step([other], [3])
    assert hnd.storage.step_lane(step.page_table, step.slots, step.qo_indptr) is None  # type: ignore[attr-defined]


def test_a_stale_step_is_refused_before_the_lane_writes() -> None:
    manager = make_manager(kv_layout="heads_first")
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    step = manager.begin_step(handles, [2, 3])
    keys, values, query = arrays(manager, 5, 0)
    step.write_and_attend(0, keys, values, query)  # the lane is prepared and used
    manager.deallocate("b")
    before = pool_copy(manager)
    with pytest.raises(StaleStepError):
        step.write_and_attend(1, keys, values, query)
    assert torch.equal(pool_copy(manager), before)


def test_a_block_the_prefix_cache_took_since_planning_is_not_rewritten_through_the_lane() -> None:
    config = make_config(
        32, 4, num_layers=2, num_heads=2, head_dim=8, enable_prefix_caching=True, kv_layout="heads_first"
    )
    manager: Manager = create_manager("torch", config)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [4], token_ids=[[1, 2, 3, 4]])
    keys, values, query = arrays(manager, 4, 1)
    for layer in range(2):  # every layer written: the full block enters the prefix cache
        step.write_and_attend(layer, keys, values, query)
    before = pool_copy(manager)
    with pytest.raises(SharedBlockWriteError):
        step.write_and_attend(0, keys * 2, values, query)
    assert torch.equal(pool_copy(manager), before)


def test_arrays_of_another_dtype_get_the_general_paths_error_and_write_nothing() -> None:
    manager = make_manager(kv_layout="heads_first")
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [3])
    keys, values, query = arrays(manager, 3, 2)
    before = pool_copy(manager)
    with pytest.raises(DTypeMismatchError):
        step.write_and_attend(0, keys.double(), values.double(), query.double())
    assert torch.equal(pool_copy(manager), before)
    output = step.write_and_attend(0, keys, values, query)  # the same step goes on
    assert output.shape == (3, 4, 8)


def test_the_lane_records_no_autograd_in_the_pool() -> None:
    manager = make_manager(kv_layout="heads_first")
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [3])
    keys, values, query = arrays(manager, 3, 3)
    keys.requires_grad_(True)
    with torch.enable_grad():
        output = step.write_and_attend(0, keys, values, query)
    assert not output.requires_grad
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    assert not storage.pool.requires_grad
    assert storage.pool.grad_fn is None


def test_a_one_run_decode_through_the_lane_equals_the_kernels_and_the_general_path() -> None:
    outputs: list[list[torch.Tensor]] = []
    for path in ("native", "kernel", "native-general"):
        config = make_config(
            64,
            4,
            num_layers=3,
            num_heads=2,
            head_dim=8,
            enable_prefix_caching=False,
            kv_layout="heads_first",
            attention_path="kernel" if path == "kernel" else "native",
        )
        manager: PagedKvCacheManager[torch.Tensor] = create_manager("torch", config)
        handle = manager.allocate(AllocationRequest("a"))
        got: list[torch.Tensor] = []
        for turn, count in enumerate([13, 1, 1, 1]):
            step = manager.begin_step([handle], [count])
            for layer in range(3):
                keys, values, query = arrays(manager, count, 10 * turn + layer)
                if path == "native-general":
                    step.write(layer, keys, values)
                    got.append(step.attention(layer, query))
                else:
                    got.append(step.write_and_attend(layer, keys, values, query))
        outputs.append(got)
    for lane_native, lane_kernel, general in zip(*outputs, strict=True):
        torch.testing.assert_close(lane_native, general, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lane_kernel, general, rtol=1e-5, atol=1e-5)
