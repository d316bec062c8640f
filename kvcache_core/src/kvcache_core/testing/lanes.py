"""The kit's cases for step lanes (the capability ``"step_lanes"``,
:mod:`kvcache_core.contract.lanes`): a step's plain layers written and attended through the
storage's lane give what the general path gives, leave the same pool and the same prefix
cache, and a lane declines what it was not prepared for without writing anything. On every
backend, lanes or not: decode steps advanced from the last one (:meth:`Step.advance`, the lane
advanced where it can be) give what steps planned anew give, and leave the same pool and
prefix cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.lanes import storage_step_lane
from kvcache_core.errors import ArrayTypeError, ShapeMismatchError
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest

__all__ = ["LaneCases"]

Manager = PagedKvCacheManager[Any]

#: Prompt lengths of the batches the cases run: one request, and a ragged batch.
BATCHES: tuple[tuple[int, ...], ...] = ((9,), (5, 11, 2))


def _arrays(manager: Manager, rng: np.random.Generator, count: int) -> tuple[Any, Any, Any]:
    """Representable random keys, values and queries (two query heads per KV head) of ``count`` tokens."""
    config = manager.config
    shapes = (
        (count, config.num_heads, config.head_dim),
        (count, config.num_heads, config.value_width),
        (count, 2 * config.num_heads, config.head_dim),
    )
    keys, values, query = (
        BackendUnderTest.native(manager, BackendUnderTest.representable(rng.standard_normal(shape), config.io_dtype))
        for shape in shapes
    )
    return keys, values, query


def _steps(
    manager: Manager, lengths: tuple[int, ...], seed: int, *, fused: bool, advanced: bool = False
) -> list[npt.NDArray[np.float64]]:
    """Prefill ``lengths`` then decode 6 tokens, every layer; with ``fused`` through
    ``write_and_attend`` (the lane where the storage has one), else through ``write`` then
    ``attention`` (the general path); with ``advanced``, each decode step is the last one's
    :meth:`~kvcache_core.step.Step.advance`, else planned by ``begin_step``. Returns every
    attention output, float64."""
    rng = np.random.default_rng(seed)
    handles = [manager.allocate(AllocationRequest(f"lane{row}")) for row in range(len(lengths))]
    outputs: list[npt.NDArray[np.float64]] = []
    step = None
    for turn, counts in enumerate([list(lengths)] + [[1] * len(lengths)] * 6):
        ids = [[(turn * 7 + row * 31 + token) % 50 for token in range(count)] for row, count in enumerate(counts)]
        if advanced and step is not None:
            step = step.advance(token_ids=ids)
        else:  # ids: full blocks enter the prefix cache
            step = manager.begin_step(handles, counts, token_ids=ids)
        for layer in range(manager.config.num_layers):
            keys, values, query = _arrays(manager, rng, sum(counts))
            if fused:
                output = step.write_and_attend(layer, keys, values, query)
            else:
                step.write(layer, keys, values)
                output = step.attention(layer, query)
            outputs.append(BackendUnderTest.host(manager, output))
    return outputs


def _pool(manager: Manager) -> tuple[bytes, bytes]:
    """Every block of the pool, as host bytes."""
    blocks = np.arange(manager.config.num_blocks, dtype=np.int64)
    keys, values = manager.storage.blocks_to_host(blocks)
    return np.ascontiguousarray(keys).tobytes(), np.ascontiguousarray(values).tobytes()


def _same_pool_and_cache(one: Manager, other: Manager, context: str) -> None:
    """The two managers' pools hold the same bytes and, once every request is released, their
    prefix caches the same number of blocks (some)."""
    assert _pool(one) == _pool(other), f"{context}: the pools differ"
    for manager in (one, other):  # released: the blocks the prefix cache took stay cached
        for request_id, _ in list(manager.list_handles()):
            manager.deallocate(request_id)
    cached = one.stats().cached_blocks
    assert cached > 0, f"{context}: nothing entered the prefix cache"
    assert cached == other.stats().cached_blocks, f"{context}: the prefix caches differ"


def _configs(kvcache_backend: BackendUnderTest) -> list[CacheConfig]:
    """Every unquantized dtype x layout, prefix caching on, with the measured attention path
    and the array library's own (a lane may serve each its own way)."""
    return [
        config
        for path in ("auto", "native")
        for config in kvcache_backend.configs(num_blocks=40, enable_prefix_caching=True, attention_path=path)
    ]


class LaneCases:
    """Cases every backend claiming ``"step_lanes"`` runs."""

    @pytest.mark.kvcache_requires("step_lanes")
    def test_a_step_through_its_lane_gives_what_the_general_path_gives(self, kvcache_backend: BackendUnderTest) -> None:
        for config in _configs(kvcache_backend):
            for lengths in BATCHES:
                context = (
                    f"dtype {config.dtype}, layout {config.kv_layout}, path {config.attention_path}, "
                    f"prompts {list(lengths)}"
                )
                with kvcache_backend.manager(config) as fused, kvcache_backend.manager(config) as general:
                    got = _steps(fused, lengths, 3, fused=True)
                    expected = _steps(general, lengths, 3, fused=False)
                    relative, absolute = TOLERANCES[config.dtype]
                    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
                        np.testing.assert_allclose(
                            ours, theirs, rtol=relative, atol=absolute, err_msg=f"{context}: call {index}"
                        )
                    _same_pool_and_cache(fused, general, context)

    def test_decode_steps_advanced_give_what_steps_planned_anew_give(self, kvcache_backend: BackendUnderTest) -> None:
        for config in kvcache_backend.configs(num_blocks=40, enable_prefix_caching=True):
            for lengths in BATCHES:
                context = f"dtype {config.dtype}, layout {config.kv_layout}, prompts {list(lengths)}"
                with kvcache_backend.manager(config) as advanced, kvcache_backend.manager(config) as planned:
                    got = _steps(advanced, lengths, 4, fused=True, advanced=True)
                    expected = _steps(planned, lengths, 4, fused=True)
                    relative, absolute = TOLERANCES[config.dtype]
                    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
                        np.testing.assert_allclose(
                            ours, theirs, rtol=relative, atol=absolute, err_msg=f"{context}: call {index}"
                        )
                    assert [handle.num_tokens() for _, handle in advanced.list_handles()] == [
                        handle.num_tokens() for _, handle in planned.list_handles()
                    ]
                    _same_pool_and_cache(advanced, planned, context)

    @pytest.mark.kvcache_requires("step_lanes")
    def test_a_lane_declines_arrays_it_was_not_prepared_for_and_writes_nothing(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        rng = np.random.default_rng(5)
        for config in _configs(kvcache_backend):
            with kvcache_backend.manager(config) as manager:
                handles = [manager.allocate(AllocationRequest(f"r{row}")) for row in range(2)]
                step = manager.begin_step(handles, [3, 2])
                table, slots = step.page_tables[0], step.slots if step.slots.ndim == 1 else step.slots[0]
                lane = storage_step_lane(manager.storage, table, slots, step.qo_indptr)
                if lane is None:
                    continue  # the storage has no lane for this pool (the general path serves it)
                keys, values, query = _arrays(manager, rng, 5)
                short_keys, short_values, short_query = _arrays(manager, rng, 4)
                before = _pool(manager)
                scale = 1.0 / np.sqrt(config.head_dim)
                for arrays in ((short_keys, values, query), (keys, short_values, query), (keys, values, short_query)):
                    assert lane(0, *arrays, scale) is None, (
                        f"dtype {config.dtype}: a lane took arrays of 4 tokens for 5"
                    )
                assert _pool(manager) == before, (
                    f"dtype {config.dtype}, layout {config.kv_layout}: a declined call wrote"
                )
                with pytest.raises(ShapeMismatchError):  # the general path names what is wrong
                    step.write_and_attend(0, short_keys, short_values, query)
                not_arrays: tuple[tuple[Any, Any, Any], ...] = (
                    (None, values, query),
                    (keys, [0.0], query),
                    (keys, values, "q"),
                )
                for bad_keys, bad_values, bad_query in not_arrays:
                    assert lane(0, bad_keys, bad_values, bad_query, scale) is None, (
                        f"dtype {config.dtype}: a lane took {type(bad_keys).__name__}, {type(bad_values).__name__}, "
                        f"{type(bad_query).__name__}"
                    )
                    with pytest.raises(ArrayTypeError):  # named by the general path, not an AttributeError
                        step.write_and_attend(0, bad_keys, bad_values, bad_query)
                assert _pool(manager) == before
