"""The core policies that move bytes through the storage -- prefix caching, fork with
copy-on-write, swapping and the sliding window -- give the jax backend the same pools,
gathers and (within float tolerance) attention as the NumPy backend, operation for
operation."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from operator import methodcaller
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    KvCacheError,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    create_manager,
)
from kvcache_jax import JaxStorage

HostArray = npt.NDArray[Any]
Manager = PagedKvCacheManager[Any]


def handle_of(manager: Manager, request_id: str) -> PagedKvCacheHandle[Any]:
    handle = manager.get_handle(request_id)
    assert handle is not None, request_id
    return handle


def allocate(request_id: str, prompt: tuple[int, ...], manager: Manager) -> PagedKvCacheHandle[Any]:
    return manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt))


def extend(request_id: str, token_ids: Sequence[int], manager: Manager) -> npt.NDArray[np.int64]:
    return manager.extend(handle_of(manager, request_id), len(token_ids), token_ids=token_ids)


def fork(parent: str, child: str, manager: Manager) -> PagedKvCacheHandle[Any]:
    return manager.fork(handle_of(manager, parent), child)


def gather(request_id: str, manager: Manager) -> tuple[Any, Any]:
    return manager.gather(handle_of(manager, request_id), 0)


def bits(array: HostArray) -> HostArray:
    contiguous = np.ascontiguousarray(array)
    return contiguous.view(f"u{contiguous.dtype.itemsize}")


class Twins:
    """The same operations on a NumPy and a jax manager; outcomes (results or errors) compared."""

    def __init__(self, config: CacheConfig) -> None:
        self.managers: tuple[Manager, Manager] = (
            create_manager("numpy", config),
            PagedKvCacheManager(JaxStorage(config), backend="jax"),
        )
        self.config = config
        storage = self.managers[1].storage
        assert isinstance(storage, JaxStorage)
        self.jax_storage = storage

    def both(self, operation: Callable[[Manager], Any]) -> tuple[Any, Any] | None:
        """``operation`` on each manager: both succeed (results returned) or both raise the
        same error class (``None`` returned)."""
        outcomes: list[Any] = []
        for manager in self.managers:
            try:
                outcomes.append(operation(manager))
            except KvCacheError as error:
                outcomes.append(type(error))
        if isinstance(outcomes[0], type) or isinstance(outcomes[1], type):
            assert outcomes[0] == outcomes[1], outcomes
            return None
        return outcomes[0], outcomes[1]

    def native(self, side: int, host: HostArray) -> Any:
        return host if side == 0 else self.jax_storage.from_numpy(host)

    def write(self, slots: npt.NDArray[np.int64], rng: np.random.Generator) -> None:
        shape = (len(slots), self.config.num_heads, self.config.head_dim)
        for layer in range(self.config.num_layers):
            keys = rng.standard_normal(shape).astype(self.config.dtype)
            values = rng.standard_normal(shape).astype(self.config.dtype)
            for side, manager in enumerate(self.managers):
                manager.write(layer, slots, self.native(side, keys), self.native(side, values))

    def assert_identical(self, rng: np.random.Generator) -> None:
        reference, subject = self.managers
        for layer in range(self.config.num_layers):
            for ours, theirs in (
                (reference.storage.key_cache(layer), subject.storage.key_cache(layer)),
                (reference.storage.value_cache(layer), subject.storage.value_cache(layer)),
            ):
                assert np.array_equal(bits(ours), bits(self.jax_storage.to_numpy(theirs)))
        resident: list[str] = []
        for request_id, handle in reference.list_handles():
            gathered = self.both(partial(gather, request_id))
            if gathered is None:  # swapped out: refused by both
                continue
            resident.append(request_id)
            for ours, theirs in zip(gathered[0], gathered[1], strict=True):
                assert np.array_equal(bits(ours), bits(self.jax_storage.to_numpy(theirs)))
            assert handle.num_tokens() == handle_of(subject, request_id).num_tokens()
        batch = [rid for rid in resident if handle_of(reference, rid).num_tokens() > 0]
        if not batch:
            return
        query = rng.standard_normal((len(batch), 2 * self.config.num_heads, self.config.head_dim))
        query = query.astype(self.config.dtype)
        outputs = [
            manager.paged_attention(
                1, self.native(side, query), manager.page_table([handle_of(manager, rid) for rid in batch])
            )
            for side, manager in enumerate(self.managers)
        ]
        tolerance = 1e-5 if self.config.dtype == "float32" else 4e-3
        expected = np.asarray(outputs[0], dtype=np.float64)
        got = self.jax_storage.to_numpy(outputs[1]).astype(np.float64)
        assert np.allclose(got, expected, rtol=tolerance, atol=tolerance)


PROMPTS = ((5, 6, 7, 8, 9, 10, 11, 12, 13), (5, 6, 7, 8, 1, 2), (3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4))


@pytest.mark.parametrize(
    ("fields", "seed"),
    [
        pytest.param({"enable_prefix_caching": True}, 0, id="prefix-caching-fork-swap"),
        pytest.param({"sliding_window": 6, "kv_layout": "heads_first", "dtype": "float16"}, 1, id="sliding-window"),
    ],
)
def test_policy_operations_match_the_numpy_backend(fields: dict[str, Any], seed: int) -> None:
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=32, block_size=4, **fields)
    twins = Twins(config)
    rng = np.random.default_rng(seed)
    swapped: set[str] = set()
    done: Counter[str] = Counter()
    next_id = 0
    for step in range(45):
        reference = twins.managers[0]
        live = [rid for rid, _ in reference.list_handles()]
        resident = [rid for rid in live if rid not in swapped]
        action = str(rng.choice(["allocate", "decode", "decode", "fork", "swap", "deallocate"]))
        if action == "allocate" or not resident:
            request_id, prompt = f"r{next_id}", PROMPTS[next_id % len(PROMPTS)]
            next_id += 1
            if twins.both(partial(allocate, request_id, prompt)):
                cached = handle_of(reference, request_id).num_tokens()
                slots = twins.both(partial(extend, request_id, prompt[cached:]))
                if slots is not None:
                    assert np.array_equal(slots[0], slots[1])
                    twins.write(slots[0], rng)
        elif action == "decode":
            for request_id in resident:
                token = int(rng.integers(0, 16))
                slots = twins.both(partial(extend, request_id, [token]))
                if slots is not None:
                    assert np.array_equal(slots[0], slots[1])
                    twins.write(slots[0], rng)
        elif action == "fork":
            parent = str(rng.choice(resident))
            if twins.both(partial(fork, parent, f"r{next_id}")):
                done["fork"] += 1
            next_id += 1
        elif action == "swap" and swapped:
            request_id = sorted(swapped)[0]
            if twins.both(methodcaller("swap_in", request_id)) is not None:
                swapped.discard(request_id)
                done["swap_in"] += 1
        elif action == "swap":
            request_id = str(rng.choice(resident))
            twins.both(methodcaller("swap_out", request_id))
            swapped.add(request_id)
            done["swap_out"] += 1
        else:
            request_id = str(rng.choice(live))
            twins.both(methodcaller("deallocate", request_id))
            swapped.discard(request_id)
        done["window_released"] += any(h.block_table().first_logical > 0 for _, h in reference.list_handles())
        if step % 5 == 4:
            twins.assert_identical(rng)
    twins.assert_identical(rng)
    stats = twins.managers[0].stats()
    assert min(done["fork"], done["swap_out"], done["swap_in"]) > 0, done  # every policy ran
    if config.enable_prefix_caching:
        assert stats.prefix_cache_hits > 0
        assert stats.copy_on_write_count > 0
    else:
        assert done["window_released"] > 0
    assert twins.jax_storage.copies_made == 0  # and the jax pool was updated in place throughout


def test_the_jax_backend_claims_the_policies_it_passes() -> None:
    from kvcache_core.discovery import get_backend

    assert {"fork", "prefix_caching", "swap", "eviction", "sliding_window", "immutable_arrays"} <= set(
        get_backend("jax").capabilities
    )
