"""``PagedKvCacheManager.write_host_blocks``: a request's blocks filled from host copies,
bit for bit, recorded written (prefix caching registers them), refused whole on bad input;
and ``handle.token_ids()``, the ids a request was given."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import AllocationRequest
from kvcache_core.errors import InvalidArgumentError, ShapeMismatchError, SharedBlockWriteError
from tests.core.support import BLOCK, Manager, make_manager, prompt_of


def _host_copy(manager: Manager, blocks: int, seed: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Random host-form keys and values of ``blocks`` blocks."""
    config = manager.config
    shape = (config.num_layers, blocks, config.block_size, config.num_heads, config.head_dim)
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def test_filled_blocks_read_back_bit_for_bit_and_serve_later_prompts() -> None:
    manager = make_manager(kv_layout="heads_first")
    prompt = prompt_of(1, 3)[:-1]  # three full blocks
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=prompt))
    manager.extend(handle, len(prompt))
    keys, values = _host_copy(manager, 3, seed=1)
    manager.write_host_blocks(handle, 0, keys, values)
    got_keys, got_values = manager.storage.blocks_to_host(np.asarray(handle.block_table().physical_blocks[:3]))
    assert got_keys.tobytes() == keys.tobytes()
    assert got_values.tobytes() == values.tobytes()
    later = manager.allocate(AllocationRequest("b", prompt_token_ids=[*prompt, 5]))
    assert later.num_cached_tokens() == 3 * BLOCK
    manager.check_invariants()


def test_a_start_off_a_block_boundary_is_refused_and_nothing_is_written() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a"))
    manager.extend(handle, 2 * BLOCK)
    before = manager.storage.blocks_to_host(np.arange(manager.config.num_blocks))
    with pytest.raises(InvalidArgumentError, match="multiple of block_size"):
        manager.write_host_blocks(handle, 1, *_host_copy(manager, 2, seed=2))
    with pytest.raises(ShapeMismatchError):
        manager.write_host_blocks(handle, 0, *_host_copy(manager, 1, seed=2))
    after = manager.storage.blocks_to_host(np.arange(manager.config.num_blocks))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after, strict=True))


def test_a_shared_block_is_refused() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a"))
    manager.extend(handle, BLOCK)
    manager.fork(handle, "b")
    with pytest.raises(SharedBlockWriteError):
        manager.write_host_blocks(handle, 0, *_host_copy(manager, 1, seed=3))


def test_a_handle_tells_the_token_ids_it_was_given() -> None:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a", prompt_token_ids=[4, 5, 6]))
    manager.extend(handle, 3)
    manager.extend(handle, 2, token_ids=[7, 8])
    assert handle.token_ids() == (4, 5, 6, 7, 8)
