"""Blocks a transport filled from outside (``manager.record_blocks_written``) in pools of
several KV-cache groups, and a request's state slot as memory (``manager.state_regions``)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.contract.states import StateSpec
from kvcache_core.errors import InvalidArgumentError

PROMPT = list(range(100, 117))


def _grouped() -> CacheConfig:
    return CacheConfig(
        num_layers=4,
        num_heads=2,
        head_dim=8,
        num_blocks=32,
        block_size=4,
        layer_specs=(LayerSpec(window=6), LayerSpec(), LayerSpec(window=6), LayerSpec()),
        enable_prefix_caching=True,
    )


def test_recorded_blocks_of_every_group_serve_a_later_prompt() -> None:
    with create_manager("numpy", _grouped()) as manager:
        handle = manager.allocate(AllocationRequest("r", prompt_token_ids=PROMPT))
        manager.extend(handle, 16, token_ids=PROMPT[:16])
        manager.extend(handle, 1, token_ids=PROMPT[16:])
        sliding, _ = handle.block_tables()
        assert sliding.first_logical > 0  # the window released the blocks it passed
        manager.record_blocks_written(handle, 0)
        manager.check_invariants()
        later = manager.allocate(AllocationRequest("later", prompt_token_ids=PROMPT))
        assert later.num_tokens() == 16  # every full block of the full group is registered
        manager.check_invariants()


def test_a_start_off_a_block_boundary_is_refused() -> None:
    with create_manager("numpy", _grouped()) as manager:
        handle = manager.allocate(AllocationRequest("r", prompt_token_ids=PROMPT))
        manager.extend(handle, 17, token_ids=PROMPT)
        with pytest.raises(InvalidArgumentError, match="start must be a multiple of block_size 4"):
            manager.record_blocks_written(handle, 3)
        assert manager.stats().cached_blocks == 0


def _stateful(state: StateSpec, *, prefix_caching: bool = False) -> CacheConfig:
    """A pool of a state layer (``state``) and a full attention layer, 3 state slots."""
    return CacheConfig(
        num_layers=2,
        num_heads=2,
        head_dim=8,
        num_blocks=16,
        block_size=4,
        layer_specs=(LayerSpec(state=state), LayerSpec()),
        state_slots=3,
        enable_prefix_caching=prefix_caching,
    )


def test_a_requests_state_slot_is_its_memory() -> None:
    config = _stateful(StateSpec([("conv", (3, 2)), ("ssm", (2, 2), "float64")]))
    with create_manager("numpy", config) as manager:
        handle = manager.allocate(AllocationRequest("r"))
        step = manager.begin_step([handle], [1])
        conv = np.arange(6, dtype=np.float32).reshape(1, 3, 2)
        step.write_state(0, "conv", conv)
        regions = manager.state_regions(handle)
        assert [region.shape for region in regions] == [(1, 3, 2), (1, 2, 2)]
        assert ctypes.string_at(regions[0].address, regions[0].length_bytes) == conv.tobytes()
        assert [region.shape for region in manager.state_regions()] == [(3, 3, 2), (3, 2, 2)]


@pytest.mark.parametrize("states", [True, False], ids=["states written", "blocks only"])
def test_states_written_with_the_blocks_are_filed_as_the_checkpoint_at_a_block_boundary(states: bool) -> None:
    with create_manager("numpy", _stateful(StateSpec([("conv", (3, 2))]), prefix_caching=True)) as manager:
        handle = manager.allocate(AllocationRequest("r", prompt_token_ids=PROMPT[:8]))
        manager.extend(handle, 8, token_ids=PROMPT[:8])
        (region,) = manager.state_regions(handle)
        conv = np.arange(6, dtype=np.float32) + 0.5
        ctypes.memmove(region.address, conv.tobytes(), conv.nbytes)  # as a transport writes the slot
        manager.record_blocks_written(handle, 0, states=states)
        assert manager.stats().checkpoint_state_slots == int(states)
        manager.deallocate("r")
        later = manager.allocate(AllocationRequest("later", prompt_token_ids=PROMPT[:10]))
        assert later.num_tokens() == (8 if states else 0)  # a state pool serves prefixes up to a checkpoint
        if states:
            (slot,) = manager.state_regions(later)
            assert ctypes.string_at(slot.address, slot.length_bytes) == conv.tobytes()
        manager.check_invariants()
