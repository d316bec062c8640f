"""JaxStorage moves bytes exactly, in every dtype and layout, and refuses bad arrays with
the same kvcache errors as the NumPy storage, changing nothing."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheHandle, create_manager
from kvcache_core.errors import ArrayTypeError, DTypeMismatchError, LayerIndexError, ShapeMismatchError
from kvcache_core.plugin import KV_LAYOUTS
from kvcache_jax import DeletedPoolError, JaxStorage
from tests.jax.support import Manager, make_manager, storage_of

HostArray = npt.NDArray[Any]
DTYPES = ("float32", "float16", "bfloat16")


def host_values(shape: tuple[int, ...], seed: int, dtype: str) -> HostArray:
    """Random values exactly representable in ``dtype``, as a host array of that dtype."""
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    converted: HostArray = values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    return converted


def native(manager: Manager, host: HostArray) -> jax.Array:
    return storage_of(manager).from_numpy(host)


def as_float(array: HostArray) -> npt.NDArray[np.float32]:
    return np.asarray(array, dtype=np.float32)


def tokens_in_pool(config: CacheConfig, pool: HostArray, slots: npt.NDArray[np.int64]) -> HostArray:
    blocks, offsets = np.divmod(slots, config.block_size)
    picked: HostArray
    if config.kv_layout == "NHD":
        picked = pool[blocks, offsets]
    elif config.kv_layout == "HND":
        picked = pool[blocks, :, offsets]
    else:  # the indexed axes stay in place: [heads, n, dim]
        picked = pool[:, blocks, offsets].transpose(1, 0, 2)
    return picked


def every_dtype_and_layout() -> Iterator[tuple[str, str]]:
    for dtype in DTYPES:
        for layout in KV_LAYOUTS:
            yield dtype, layout


@pytest.mark.parametrize(("dtype", "kv_layout"), list(every_dtype_and_layout()))
def test_written_tokens_gather_back_exactly_and_sit_at_their_slots(dtype: str, kv_layout: str) -> None:
    manager = make_manager(dtype, kv_layout)
    config = manager.config
    handles = [manager.allocate(AllocationRequest(rid)) for rid in ("a", "b")]
    slots = np.concatenate([manager.extend(handles[0], 7), manager.extend(handles[1], 5)])
    keys, values = host_values((12, 2, 4), 1, dtype), host_values((12, 2, 4), 2, dtype)
    for layer in range(config.num_layers):
        manager.write(layer, slots, native(manager, keys), native(manager, values + layer))

    for layer in range(config.num_layers):
        gathered_keys, gathered_values = manager.gather(handles[0], layer)
        assert gathered_keys.dtype.name == dtype
        assert np.array_equal(storage_of(manager).to_numpy(gathered_keys), keys[:7])
        assert np.array_equal(storage_of(manager).to_numpy(gathered_values), values[:7] + layer)
        pool = storage_of(manager).to_numpy(manager.storage.key_cache(layer))
        assert np.array_equal(tokens_in_pool(config, pool, slots), keys)
    empty = manager.allocate(AllocationRequest("empty"))
    assert tuple(manager.gather(empty, 0)[0].shape) == (0, 2, 4)


def test_bfloat16_values_reach_numpy_as_ml_dtypes_bfloat16_and_blocks_as_their_bit_patterns() -> None:
    manager = make_manager("bfloat16")
    handle = manager.allocate(AllocationRequest("a"))
    slots = manager.extend(handle, 3)
    keys = host_values((3, 2, 4), 3, "bfloat16")
    manager.write(0, slots, native(manager, keys), native(manager, keys))

    host = storage_of(manager).to_numpy(manager.gather(handle, 0)[0])
    assert host.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(host.astype(np.float32), keys.astype(np.float32))
    blocks_keys, _ = manager.storage.blocks_to_host(np.asarray(handle.block_table().physical_blocks))
    assert blocks_keys.dtype == np.uint16  # core's host form: the bit patterns
    written = blocks_keys[0].reshape(-1, 2, 4)[:3]
    assert np.array_equal(written.view(ml_dtypes.bfloat16).astype(np.float32), keys.astype(np.float32))


def test_to_numpy_returns_an_independent_writable_copy() -> None:
    manager = make_manager()
    pool = manager.storage.key_cache(0)
    host = storage_of(manager).to_numpy(pool)
    host[0] = 1.0
    assert not np.asarray(manager.storage.key_cache(0)).any()


def test_from_numpy_refuses_what_jax_would_round_and_narrows_fitting_integers() -> None:
    storage = storage_of(make_manager())
    with pytest.raises(DTypeMismatchError, match=r"float64.*jax_enable_x64"):
        storage.from_numpy(np.zeros((2, 2, 4)))
    with pytest.raises(DTypeMismatchError, match=r"int64 values outside int32"):
        storage.from_numpy(np.asarray([0, 1 << 40]))
    assert storage.from_numpy(np.zeros((2, 2, 4), np.float16)).dtype == jnp.float16
    assert storage.from_numpy(np.zeros(2, np.complex64)).dtype == jnp.complex64
    token_ids = storage.from_numpy(np.asarray([3, -7, (1 << 31) - 1]))
    assert token_ids.dtype == jnp.int32
    assert np.asarray(token_ids).tolist() == [3, -7, (1 << 31) - 1]


# -- bad arrays: the same errors as the NumPy storage, nothing changed ---------------------


def pool_state(manager: Manager) -> list[tuple[jax.Array, HostArray]]:
    """Every pool array object and a host copy of its contents."""
    storage = storage_of(manager)
    return [
        (pool, storage.to_numpy(pool))
        for layer in range(manager.config.num_layers)
        for pool in (storage.key_cache(layer), storage.value_cache(layer))
    ]


def assert_unchanged(manager: Manager, before: list[tuple[jax.Array, HostArray]]) -> None:
    after = pool_state(manager)
    for (pool_before, host_before), (pool_after, host_after) in zip(before, after, strict=True):
        assert pool_after is pool_before
        assert np.array_equal(host_after, host_before)


@pytest.fixture
def written() -> tuple[Manager, PagedKvCacheHandle[jax.Array], npt.NDArray[np.int64]]:
    manager = make_manager()
    handle = manager.allocate(AllocationRequest("a"))
    slots = manager.extend(handle, 3)
    keys = host_values((3, 2, 4), 4, "float32")
    for layer in range(2):
        manager.write(layer, slots, native(manager, keys), native(manager, keys))
    return manager, handle, slots


BAD_WRITES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("numpy-keys", lambda: np.zeros((3, 2, 4), np.float32), ArrayTypeError, "keys: expected a jax.Array, got ndarray"),
    ("list-keys", lambda: [[0.0] * 4] * 2, ArrayTypeError, "expected a jax.Array, got list"),
    ("float16-keys", lambda: jnp.zeros((3, 2, 4), jnp.float16), DTypeMismatchError, "float16.*float32"),
    ("bfloat16-keys", lambda: jnp.zeros((3, 2, 4), jnp.bfloat16), DTypeMismatchError, "bfloat16.*float32"),
    ("too-few-rows", lambda: jnp.zeros((2, 2, 4)), ShapeMismatchError, r"\(3, 2, 4\).*\(2, 2, 4\)"),
    ("too-many-heads", lambda: jnp.zeros((3, 4, 4)), ShapeMismatchError, r"\(3, 4, 4\)"),
    ("flat", lambda: jnp.zeros((3, 8)), ShapeMismatchError, r"\(3, 8\)"),
]


def untyped(value: object) -> Any:
    """Pass a deliberately ill-typed value past the type checker."""
    return value


@pytest.mark.parametrize(("bad", "error", "match"), [case[1:] for case in BAD_WRITES], ids=[c[0] for c in BAD_WRITES])
def test_a_bad_key_array_is_refused_and_changes_nothing(
    written: tuple[Manager, PagedKvCacheHandle[jax.Array], npt.NDArray[np.int64]],
    bad: Callable[[], object],
    error: type[Exception],
    match: str,
) -> None:
    manager, _, slots = written
    before = pool_state(manager)
    good = jnp.zeros((3, 2, 4))
    with pytest.raises(error, match=match):
        manager.write(1, slots, untyped(bad()), good)
    with pytest.raises(error):
        manager.write(1, slots, good, untyped(bad()))
    assert_unchanged(manager, before)
    assert storage_of(manager).copies_made == 0


def test_a_tracer_is_refused_with_a_pointer_to_the_pure_functions(
    written: tuple[Manager, PagedKvCacheHandle[jax.Array], npt.NDArray[np.int64]],
) -> None:
    manager, _, slots = written
    before = pool_state(manager)

    def step(keys: jax.Array) -> jax.Array:
        manager.write(0, slots, keys, keys)
        return keys

    with pytest.raises(ArrayTypeError, match=r"tracer.*kvcache_jax.write"):
        jax.jit(step)(jnp.zeros((3, 2, 4)))
    assert_unchanged(manager, before)


def test_a_bad_query_is_refused_like_bad_keys(
    written: tuple[Manager, PagedKvCacheHandle[jax.Array], npt.NDArray[np.int64]],
) -> None:
    manager, handle, _ = written
    table = manager.page_table([handle])
    with pytest.raises(ArrayTypeError, match="query"):
        manager.paged_attention(0, untyped(np.zeros((1, 2, 4), np.float32)), table)
    with pytest.raises(DTypeMismatchError, match="float16"):
        manager.paged_attention(0, jnp.zeros((1, 2, 4), jnp.float16), table)
    with pytest.raises(ShapeMismatchError, match=r"\(1, 3, 4\)"):
        manager.paged_attention(0, jnp.zeros((1, 3, 4)), table)


def test_replace_layer_installs_arrays_and_refuses_bad_ones_without_change(
    written: tuple[Manager, PagedKvCacheHandle[jax.Array], npt.NDArray[np.int64]],
) -> None:
    manager, handle, _ = written
    storage = storage_of(manager)
    shape = manager.config.block_shape()
    before = pool_state(manager)
    good = jnp.ones(shape)
    cases: list[tuple[int, Any, type[Exception], str]] = [
        (0, np.ones(shape, np.float32), ArrayTypeError, "expected a jax.Array, got ndarray"),
        (0, jnp.ones((12, 4, 2, 2)), ShapeMismatchError, r"\(12, 4, 2, 4\).*\(12, 4, 2, 2\)"),
        (0, jnp.ones(shape, jnp.float16), DTypeMismatchError, "float16.*float32"),
        (2, good, LayerIndexError, "layer 2.*0 to 1"),
    ]
    for layer, bad, error, match in cases:
        with pytest.raises(error, match=match):
            storage.replace_layer(layer, bad, good)
        with pytest.raises(error, match=match):
            storage.replace_layer(layer, good, bad)
    deleted = jnp.ones(shape)
    deleted.delete()
    with pytest.raises(DeletedPoolError, match="value_cache of layer 1"):
        storage.replace_layer(1, good, deleted)
    assert_unchanged(manager, before)

    storage.replace_layer(1, good, good * 2)
    assert storage.key_cache(1) is good  # adopted as is, so holding it counts
    keys_back, values_back = manager.gather(handle, 1)
    assert np.array_equal(np.asarray(keys_back), np.ones((3, 2, 4), np.float32))
    assert np.array_equal(np.asarray(values_back), np.full((3, 2, 4), 2, np.float32))
    manager.write(1, handle.block_table().slots(0, 3), jnp.zeros((3, 2, 4)), jnp.zeros((3, 2, 4)))
    assert not good.is_deleted()  # the caller still holds it: copied, not donated
    assert bool(jnp.all(good == 1))


def test_blocks_from_host_refuses_bad_arrays_without_change(
    written: tuple[Manager, PagedKvCacheHandle[jax.Array], npt.NDArray[np.int64]],
) -> None:
    manager, handle, _ = written
    storage = storage_of(manager)
    blocks = np.asarray(handle.block_table().physical_blocks, dtype=np.int64)
    keys, values = storage.blocks_to_host(blocks)
    before = pool_state(manager)
    cases: list[tuple[Any, type[Exception], str]] = [
        (jnp.asarray(keys), ArrayTypeError, "keys must be a numpy.ndarray"),
        (keys[:, :0], ShapeMismatchError, r"\(2, 1, 4, 2, 4\)"),
        (keys.astype(np.float16), DTypeMismatchError, "float16.*float32"),
    ]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            storage.blocks_from_host(blocks, bad, values)
    assert_unchanged(manager, before)
    assert storage.copies_made == 0


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_host_round_trips_and_block_copies_are_exact(kv_layout: str) -> None:
    manager = make_manager("float16", kv_layout)
    storage = storage_of(manager)
    handle = manager.allocate(AllocationRequest("a"))
    slots = manager.extend(handle, 10)
    for layer in range(2):
        keys = host_values((10, 2, 4), 10 + layer, "float16")
        manager.write(layer, slots, native(manager, keys), native(manager, -keys))
    blocks = np.asarray(handle.block_table().physical_blocks, dtype=np.int64)
    keys_host, values_host = storage.blocks_to_host(blocks)
    assert keys_host.shape == (2, 3, 4, 2, 4)
    assert np.array_equal(keys_host.reshape(2, 12, 2, 4)[1, :10], np.asarray(manager.gather(handle, 1)[0]))

    other = manager.allocate(AllocationRequest("b", initial_tokens=12))
    targets = np.asarray(other.block_table().physical_blocks, dtype=np.int64)
    storage.blocks_from_host(targets, keys_host, values_host)
    assert all(
        np.array_equal(a, b) for a, b in zip(storage.blocks_to_host(targets), (keys_host, values_host), strict=True)
    )

    storage.copy_blocks(blocks[:2], targets[1:])  # overlapping: every source is read first
    copied = storage.blocks_to_host(targets[1:])
    assert np.array_equal(copied[0], keys_host[:, :2])
    assert np.array_equal(copied[1], values_host[:, :2])
    assert np.array_equal(storage.blocks_to_host(targets[:1])[0], keys_host[:, :1])
    assert storage.blocks_to_host(blocks[:0])[0].shape == (2, 0, 4, 2, 4)


def test_create_manager_returns_the_same_storage_type_as_direct_construction() -> None:
    config = CacheConfig(num_layers=1, num_heads=2, head_dim=4, num_blocks=4)
    assert type(create_manager("jax", config).storage) is JaxStorage


def _rows_part(
    config: CacheConfig, pool: HostArray, slots: npt.NDArray[np.int64], part: tuple[slice, slice]
) -> HostArray:
    """The part ``(heads, features)`` of each slot's row, ``[n, h, d]``."""
    return tokens_in_pool(config, pool, slots)[:, part[0], part[1]]


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_a_write_into_part_of_each_row_keeps_the_rest_in_place(kv_layout: str) -> None:
    """``write_view`` (a layer viewing a page beside others) writes its heads and features of
    each slot's row and keeps every other element, donating the pool (no copy)."""
    from kvcache_core.contract.groups import ViewPlace

    config = CacheConfig(
        num_layers=1, num_heads=4, head_dim=8, value_head_dim=6, num_blocks=8, block_size=4, kv_layout=kv_layout
    )
    storage = JaxStorage(config)
    slots = np.asarray([3, 9, 17, 30], dtype=np.int64)
    whole = (host_values((4, 4, 8), 1, "float32"), host_values((4, 4, 6), 2, "float32"))
    storage.write(0, slots, *(storage.from_numpy(array) for array in whole))
    before = [storage.to_numpy(storage.key_cache(0)), storage.to_numpy(storage.value_cache(0))]
    part = (host_values((2, 2, 4), 3, "float32"), host_values((2, 2, 2), 4, "float32"))

    keys, values = (storage.from_numpy(array) for array in part)
    storage.write_view(0, slots[1:3], keys, values, ViewPlace(2, 4, 3))

    after = [storage.to_numpy(storage.key_cache(0)), storage.to_numpy(storage.value_cache(0))]
    assert storage.copies_made == 0
    for pool, old, data, features in zip(after, before, part, (slice(4, 8), slice(3, 5)), strict=True):
        assert np.array_equal(_rows_part(config, pool, slots[1:3], (slice(2, 4), features)), data)
        restored = pool.copy()  # every other element as it was
        if kv_layout == "NHD":
            restored[slots[1:3] // 4, slots[1:3] % 4, 2:4, features] = old[
                slots[1:3] // 4, slots[1:3] % 4, 2:4, features
            ]
        elif kv_layout == "HND":
            restored[slots[1:3] // 4, 2:4, slots[1:3] % 4, features] = old[
                slots[1:3] // 4, 2:4, slots[1:3] % 4, features
            ]
        else:
            restored[2:4, slots[1:3] // 4, slots[1:3] % 4, features] = old[
                2:4, slots[1:3] // 4, slots[1:3] % 4, features
            ]
        assert np.array_equal(restored, old)


def test_a_part_outside_the_rows_is_refused_and_the_pool_kept() -> None:
    from kvcache_core.contract.groups import ViewPlace

    storage = JaxStorage(CacheConfig(num_layers=1, num_heads=4, head_dim=8, num_blocks=8, block_size=4))
    slots = np.asarray([1, 2], dtype=np.int64)
    storage.write(0, slots, *(storage.from_numpy(host_values((2, 4, 8), seed, "float32")) for seed in (5, 6)))
    before = storage.to_numpy(storage.key_cache(0))
    data = storage.from_numpy(host_values((2, 2, 4), 7, "float32"))

    for place in (ViewPlace(3, 0, 0), ViewPlace(0, 6, 0), ViewPlace(0, 0, 5)):
        with pytest.raises(ShapeMismatchError, match="inside heads 4"):
            storage.write_view(0, slots, data, data, place)

    assert np.array_equal(storage.to_numpy(storage.key_cache(0)), before)
