"""For identical operation sequences the jax backend's writes, gathers, block copies and
host transfers equal the NumPy backend's bit for bit."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    OutOfBlocksError,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    SequenceTooLongError,
    create_manager,
)
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.testing import inspect
from kvcache_jax import JaxStorage

HostArray = npt.NDArray[Any]


def bits(array: HostArray) -> HostArray:
    """The raw bits (so -0.0 differs from 0.0 and NaN payloads count)."""
    contiguous = np.ascontiguousarray(array)
    return contiguous.view(f"u{contiguous.dtype.itemsize}")


class Twins:
    """A NumPy and a jax manager driven by the same operations."""

    def __init__(self, config: CacheConfig) -> None:
        self.reference = create_manager("numpy", config)
        self.subject = PagedKvCacheManager(JaxStorage(config), backend="jax")
        self.handles: dict[str, tuple[PagedKvCacheHandle[HostArray], PagedKvCacheHandle[jax.Array]]] = {}
        self.config = config

    @property
    def jax_storage(self) -> JaxStorage:
        storage = self.subject.storage
        assert isinstance(storage, JaxStorage)
        return storage

    @property
    def numpy_storage(self) -> NumpyStorage:
        storage = self.reference.storage
        assert isinstance(storage, NumpyStorage)
        return storage

    def allocate(self, request_id: str, max_length: int | None) -> None:
        request = AllocationRequest(request_id, max_sequence_length=max_length)
        self.handles[request_id] = (self.reference.allocate(request), self.subject.allocate(request))

    def extend(self, request_id: str, count: int) -> npt.NDArray[np.int64] | None:
        reference, subject = self.handles[request_id]
        try:
            slots = self.reference.extend(reference, count)
        except (OutOfBlocksError, SequenceTooLongError) as refused:
            with pytest.raises(type(refused)):
                self.subject.extend(subject, count)
            return None
        assert np.array_equal(self.subject.extend(subject, count), slots)
        return slots

    def write(self, layer: int, slots: npt.NDArray[np.int64], keys: HostArray, values: HostArray) -> None:
        self.reference.write(layer, slots, keys, values)
        storage = self.jax_storage
        self.subject.write(layer, slots, storage.from_numpy(keys), storage.from_numpy(values))

    def deallocate(self, request_id: str) -> None:
        self.reference.deallocate(request_id)
        self.subject.deallocate(request_id)
        del self.handles[request_id]

    def assert_identical(self) -> None:
        storage = self.jax_storage
        for layer in range(self.config.num_layers):
            for reference_pool, subject_pool in (
                (self.numpy_storage.key_cache(layer), storage.key_cache(layer)),
                (self.numpy_storage.value_cache(layer), storage.value_cache(layer)),
            ):
                assert np.array_equal(bits(reference_pool), bits(storage.to_numpy(subject_pool)))
            for reference, subject in self.handles.values():
                for expected, got in zip(
                    self.reference.gather(reference, layer), self.subject.gather(subject, layer), strict=True
                ):
                    assert np.array_equal(bits(expected), bits(storage.to_numpy(got)))


@pytest.mark.parametrize(
    ("dtype", "kv_layout", "seed"),
    [("float32", "NHD", 0), ("float32", "heads_first", 1), ("float16", "HND", 2), ("float16", "heads_first", 3)],
)
def test_random_operation_sequences_give_bit_identical_pools_and_gathers(dtype: str, kv_layout: str, seed: int) -> None:
    config = CacheConfig(
        num_layers=2, num_heads=2, head_dim=4, num_blocks=24, block_size=4, dtype=dtype, kv_layout=kv_layout
    )
    twins = Twins(config)
    rng = np.random.default_rng(seed)
    next_id = 0
    for step in range(60):
        action = rng.choice(["allocate", "extend", "extend", "extend", "deallocate", "copy", "swap"])
        live = sorted(twins.handles)
        if action == "allocate" or not live:
            twins.allocate(f"r{next_id}", None if rng.random() < 0.5 else int(rng.integers(4, 40)))
            next_id += 1
        elif action == "extend":
            chosen = [rid for rid in live if rng.random() < 0.6] or live[:1]
            slot_parts = [twins.extend(rid, int(rng.integers(1, 7))) for rid in chosen]
            slots = np.concatenate([part for part in slot_parts if part is not None] or [np.zeros(0, np.int64)])
            shape = (len(slots), config.num_heads, config.head_dim)
            for layer in range(config.num_layers):
                keys = rng.standard_normal(shape).astype(dtype)
                keys[rng.random(shape) < 0.05] = -0.0  # signed zeros must survive
                twins.write(layer, slots, keys, rng.standard_normal(shape).astype(dtype))
        elif action == "deallocate":
            twins.deallocate(str(rng.choice(live)))
        else:
            in_use = np.flatnonzero(inspect.allocator(twins.reference).in_use_mask())
            free = np.flatnonzero(~inspect.allocator(twins.reference).in_use_mask())
            count = min(len(in_use), len(free), int(rng.integers(1, 4)))
            if count == 0:
                continue
            source = rng.choice(in_use, count, replace=False).astype(np.int64)
            target = rng.choice(free, count, replace=False).astype(np.int64)
            if action == "copy":
                twins.numpy_storage.copy_blocks(source, target)
                twins.jax_storage.copy_blocks(source, target)
            else:
                expected = twins.numpy_storage.blocks_to_host(source)
                got = twins.jax_storage.blocks_to_host(source)
                for reference_half, subject_half in zip(expected, got, strict=True):
                    assert np.array_equal(bits(reference_half), bits(subject_half))
                twins.numpy_storage.blocks_from_host(target, *expected)
                twins.jax_storage.blocks_from_host(target, *got)
        if step % 6 == 5:
            twins.assert_identical()
    twins.assert_identical()
