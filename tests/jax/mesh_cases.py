"""Sharding cases, run by ``test_sharding.py`` in a process with 8 host CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts, so
these run in their own process (the name keeps pytest from collecting them in the main
run, whose JAX may have started with one device)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/jax/mesh_cases.py
"""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import kvcache_jax
from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    InvalidArgumentError,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    UnsupportedConfigError,
    create_manager,
)
from kvcache_core.discovery import get_backend
from kvcache_core.plugin import KV_LAYOUTS
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.quantized import QuantizedCases
from kvcache_jax import JaxStorage, QuantizedJaxStorage
from kvcache_jax.sharding import partition_spec

if jax.device_count() < 8:
    pytest.skip("needs 8 devices: run through tests/jax/test_sharding.py", allow_module_level=True)

Manager = PagedKvCacheManager[jax.Array]
Handle = PagedKvCacheHandle[jax.Array]
HostArray = npt.NDArray[Any]

CONFIG = CacheConfig(num_layers=2, num_heads=8, head_dim=4, num_blocks=16, block_size=4)
HEADS_AXIS = {"NHD": 2, "HND": 1, "heads_first": 0}
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def line_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]), ("model",))


def grid_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


MESHES = {"8-devices": line_mesh, "2x4-devices": grid_mesh}


def pool_spec(kv_layout: str) -> PartitionSpec:
    entries: list[str | None] = [None] * 4
    entries[HEADS_AXIS[kv_layout]] = "model"
    return partition_spec(*entries)


def storage_of(manager: Manager) -> JaxStorage:
    storage = manager.storage
    assert isinstance(storage, JaxStorage)
    return storage


def assert_split_over_heads(array: jax.Array, mesh: Mesh, spec: PartitionSpec, heads_axis: int) -> None:
    """Sharded as ``spec``, every device holding only its share of the heads."""
    assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), array.sharding
    share = array.shape[heads_axis] // int(mesh.shape["model"])
    assert len(array.addressable_shards) == mesh.devices.size
    assert all(shard.data.shape[heads_axis] == share for shard in array.addressable_shards)


class Twins:
    """A manager over a pool sharded on ``mesh`` and one over a single device."""

    def __init__(self, mesh: Mesh, kv_layout: str, **fields: Any) -> None:
        config = dataclasses.replace(CONFIG, kv_layout=kv_layout, **fields)
        self.sharded: Manager = create_manager("jax", config, mesh=mesh, axis="model")
        self.single: Manager = create_manager("jax", config)
        self.handles: list[tuple[Handle, Handle]] = []
        self.rng = np.random.default_rng(0)

    def allocate(self, request_id: str) -> None:
        request = AllocationRequest(request_id)
        self.handles.append((self.sharded.allocate(request), self.single.allocate(request)))

    def grow(self, counts: list[int]) -> None:
        slots = [
            np.concatenate(
                [manager.extend(pair[side], count) for pair, count in zip(self.handles, counts, strict=True)]
            )
            for side, manager in enumerate((self.sharded, self.single))
        ]
        assert np.array_equal(slots[0], slots[1])
        for layer in range(CONFIG.num_layers):
            keys = self.rng.standard_normal((len(slots[0]), 8, 4)).astype(np.float32)
            for manager in (self.sharded, self.single):
                storage = storage_of(manager)
                manager.write(layer, slots[0], storage.from_numpy(keys), storage.from_numpy(-keys))

    def attend(self, query: HostArray, qo_indptr: HostArray, **features: Any) -> list[jax.Array]:
        """Layer 1's attention of every request on each side (sharded first), with ``features``
        (``sinks`` as a host array)."""
        outputs = []
        for side, manager in enumerate((self.sharded, self.single)):
            storage = storage_of(manager)
            native: dict[str, Any] = {
                name: storage.from_numpy(value) if name == "sinks" else value for name, value in features.items()
            }
            table = manager.page_table([pair[side] for pair in self.handles])
            outputs.append(manager.paged_attention(1, storage.from_numpy(query), table, qo_indptr=qo_indptr, **native))
        return outputs


# Every layout on the 2-D mesh (heads split over "model", replicated over "data"); the
# 8-device line mesh with the layout the other cases use, whose programs they reuse.
LAYOUTS_AND_MESHES = [(layout, "2x4-devices") for layout in KV_LAYOUTS] + [("heads_first", "8-devices")]


@pytest.mark.parametrize(("kv_layout", "mesh_name"), LAYOUTS_AND_MESHES)
def test_writes_gathers_and_attention_equal_the_single_device_pool_and_stay_split(
    kv_layout: str, mesh_name: str
) -> None:
    mesh = MESHES[mesh_name]()
    twins = Twins(mesh, kv_layout)
    for request_id in ("a", "b", "c"):
        twins.allocate(request_id)
    twins.grow([5, 9, 2])
    twins.grow([1, 1, 1])
    sharded, single = storage_of(twins.sharded), storage_of(twins.single)
    tokens_spec = partition_spec(None, "model", None)

    for layer in range(CONFIG.num_layers):
        for got, expected in ((sharded.key_cache(layer), single.key_cache(layer)),):
            assert_split_over_heads(got, mesh, pool_spec(kv_layout), HEADS_AXIS[kv_layout])
            assert np.array_equal(sharded.to_numpy(got), single.to_numpy(expected))
        for sharded_handle, single_handle in twins.handles:
            for got, expected in zip(
                twins.sharded.gather(sharded_handle, layer), twins.single.gather(single_handle, layer), strict=True
            ):
                assert_split_over_heads(got, mesh, tokens_spec, 1)
                assert np.array_equal(np.asarray(got), np.asarray(expected))

    rng = np.random.default_rng(1)
    query = rng.standard_normal((3, 16, 4)).astype(np.float32)  # two query heads per KV head
    prefill = rng.standard_normal((9, 16, 4)).astype(np.float32)
    indptr = np.asarray([0, 3, 9, 9], dtype=np.int32)
    for host_query, qo_indptr in ((query, None), (prefill, indptr)):
        outputs = [
            manager.paged_attention(
                1,
                storage_of(manager).from_numpy(host_query),
                manager.page_table([pair[side] for pair in twins.handles]),
                qo_indptr=qo_indptr,
            )
            for side, manager in enumerate((twins.sharded, twins.single))
        ]
        assert_split_over_heads(outputs[0], mesh, tokens_spec, 1)
        assert np.allclose(np.asarray(outputs[0]), np.asarray(outputs[1]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_attention_features_on_a_sharded_pool_equal_the_single_device_pool(mesh_name: str) -> None:
    """Window, softcap, chunk and per-query-head sinks (split over the heads as the queries)."""
    mesh = MESHES[mesh_name]()
    twins = Twins(mesh, "heads_first")
    for request_id in ("a", "b", "c"):
        twins.allocate(request_id)
    twins.grow([5, 9, 2])
    twins.grow([7, 1, 3])
    rng = np.random.default_rng(2)
    prefill = rng.standard_normal((9, 16, 4)).astype(np.float32)
    sinks = rng.standard_normal(16).astype(np.float32)
    indptr = np.asarray([0, 3, 9, 9], dtype=np.int32)
    features: list[dict[str, Any]] = [
        {"window": 4, "softcap": 1.5},
        {"chunk": 5},
        {"window": 6, "chunk": 7, "softcap": 2.0, "sinks": sinks},
    ]
    for chosen in features:
        outputs = twins.attend(prefill, indptr, **chosen)
        assert_split_over_heads(outputs[0], mesh, partition_spec(None, "model", None), 1)
        assert np.allclose(np.asarray(outputs[0]), np.asarray(outputs[1]), rtol=0, atol=1e-6), chosen


def test_sharded_writes_run_in_place_on_every_device_and_spare_held_arrays() -> None:
    kv_layout = "heads_first"
    mesh = line_mesh()
    twins = Twins(mesh, kv_layout)
    twins.allocate("a")
    twins.grow([3])
    storage = storage_of(twins.sharded)

    def pointers() -> list[int]:
        return [int(shard.data.unsafe_buffer_pointer()) for shard in storage.key_cache(0).addressable_shards]

    before = pointers()
    twins.grow([2])
    assert pointers() == before
    assert storage.copies_made == 0

    held = storage.key_cache(0)
    held_contents = np.asarray(held).copy()
    twins.grow([1])
    assert not held.is_deleted()
    assert np.array_equal(np.asarray(held), held_contents)
    assert storage.copies_made == 1
    assert_split_over_heads(storage.key_cache(0), mesh, pool_spec(kv_layout), HEADS_AXIS[kv_layout])


@pytest.mark.parametrize("dtype", ["float32", "int8", "float8_e4m3fn"])
def test_block_copies_and_host_transfers_equal_the_single_device_pool(dtype: str) -> None:
    """Quantized pools: raw bytes and scales (host copies are core's packed uint8 form)."""
    twins = Twins(grid_mesh(), "NHD", dtype=dtype)
    twins.allocate("a")
    twins.allocate("b")
    twins.grow([9, 4])
    sharded, single = storage_of(twins.sharded), storage_of(twins.single)
    source = np.asarray(twins.handles[0][0].block_table().physical_blocks, dtype=np.int64)
    target = np.asarray([12, 13, 14], dtype=np.int64)
    for storage in (sharded, single):
        storage.copy_blocks(source[:2], target[:2])
    host = [storage.blocks_to_host(source) for storage in (sharded, single)]
    for got, expected in zip(host[0], host[1], strict=True):
        assert np.array_equal(got, expected)
    for storage, (keys, values) in zip((sharded, single), host, strict=True):
        storage.blocks_from_host(target, keys[:, ::-1].copy(), values)
    for layer in range(CONFIG.num_layers):
        assert np.array_equal(sharded.to_numpy(sharded.key_cache(layer)), single.to_numpy(single.key_cache(layer)))
        assert np.array_equal(sharded.to_numpy(sharded.value_cache(layer)), single.to_numpy(single.value_cache(layer)))
    if dtype != "float32":
        assert_same_bytes_and_scales(quantized_storage(twins.sharded), quantized_storage(twins.single))


def test_the_compiled_kernels_communicate_nothing() -> None:
    """White-box: the sharded programs hold no collective, so no device ever receives
    another device's heads (let alone the whole pool)."""
    twins = Twins(line_mesh(), "heads_first")
    twins.allocate("a")
    twins.grow([6])
    storage = storage_of(twins.sharded)
    programs = storage._programs  # pyright: ignore[reportPrivateUsage]
    pool = storage.key_cache(0)
    replicated = storage.placement.replicated
    tokens = storage.placement.tokens
    slots = jax.device_put(np.arange(8, dtype=np.int32), replicated)
    new_tokens = jax.device_put(np.zeros((8, 8, 4), np.float32), tokens)
    query = jax.device_put(np.zeros((4, 16, 4), np.float32), tokens)
    tables = jax.device_put(np.zeros((4, 16), np.int32), replicated)
    lens = jax.device_put(np.ones(4, np.int32), replicated)
    indptr = jax.device_put(np.arange(5, dtype=np.int32), replicated)
    lowered = [
        programs.write.lower(pool, pool, slots, new_tokens, new_tokens),  # type: ignore[attr-defined]
        programs.gather.lower(pool, pool, slots),  # type: ignore[attr-defined]
        programs.attention(1, True, 0.5).lower(query, pool, pool, tables, lens, indptr),  # type: ignore[attr-defined]
        programs.attention(1, True, 0.5, 3, softcap=2.0, chunk=4, with_sinks=True).lower(  # type: ignore[attr-defined]
            query, pool, pool, tables, lens, indptr, jax.device_put(np.zeros(16, np.float32), replicated)
        ),
    ]
    for stage in lowered:
        text = stage.compile().as_text().lower()
        assert not [name for name in COLLECTIVES if name in text]


def test_a_users_jitted_step_on_a_sharded_pool_keeps_it_sharded() -> None:
    """The pure functions in a user's own jit over sharded arrays (XLA's partitioner)."""
    mesh = line_mesh()
    twins = Twins(mesh, "heads_first")
    twins.allocate("a")
    twins.grow([7])
    storage = storage_of(twins.sharded)
    handle = twins.handles[0][0]

    @partial(jax.jit, donate_argnums=(1, 2))
    def step(
        query: jax.Array, key_pool: jax.Array, value_pool: jax.Array, slots: jax.Array, tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        key_pool, value_pool = kvcache_jax.write(key_pool, value_pool, slots, tokens, tokens, kv_layout="heads_first")
        tables = jnp.asarray([handle.block_table().physical_blocks], jnp.int32)
        output = kvcache_jax.paged_attention(
            query, key_pool, value_pool, tables, jnp.asarray([8], jnp.int32), kv_layout="heads_first"
        )
        return output, key_pool, value_pool

    slots = twins.sharded.extend(handle, 1)
    new_token = np.ones((1, 8, 4), np.float32)
    query = np.ones((1, 8, 4), np.float32)
    output, keys, values = step(
        jax.device_put(query, storage.placement.tokens),
        storage.key_cache(0),
        storage.value_cache(0),
        jnp.asarray(slots, jnp.int32),
        jax.device_put(new_token, storage.placement.tokens),
    )
    assert_split_over_heads(keys, mesh, pool_spec("heads_first"), 0)
    storage.replace_layer(0, keys, values)
    single = storage_of(twins.single)
    twins.single.write(
        0, twins.single.extend(twins.handles[0][1], 1), single.from_numpy(new_token), single.from_numpy(new_token)
    )
    expected = twins.single.paged_attention(0, single.from_numpy(query), twins.single.page_table([twins.handles[0][1]]))
    assert np.allclose(np.asarray(output), np.asarray(expected), rtol=0, atol=1e-6)


def test_heads_that_do_not_split_evenly_and_an_unnamed_axis_are_refused() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"num_heads=6.*'model' of size 8"):
        create_manager("jax", dataclasses.replace(CONFIG, num_heads=6), mesh=line_mesh(), axis="model")
    with pytest.raises(InvalidArgumentError, match=r"\('data', 'model'\)"):
        create_manager("jax", CONFIG, mesh=grid_mesh())


# -- quantized pools ----------------------------------------------------------------------

QUANTIZED = ("int8", "float8_e4m3fn")


def quantized_storage(manager: Manager) -> QuantizedJaxStorage:
    storage = manager.storage
    assert isinstance(storage, QuantizedJaxStorage)
    return storage


def assert_same_bytes_and_scales(sharded: QuantizedJaxStorage, single: QuantizedJaxStorage) -> None:
    """Every block's raw bytes and scales, and every layer's scales, equal to the bit."""
    blocks = np.arange(CONFIG.num_blocks, dtype=np.int64)
    for got, expected in zip(sharded.blocks_to_host(blocks), single.blocks_to_host(blocks), strict=True):
        assert got.dtype == expected.dtype == np.uint8
        assert got.tobytes() == expected.tobytes()
    for layer in range(CONFIG.num_layers):
        for got_scales, expected_scales in zip(sharded.scales(layer), single.scales(layer), strict=True):
            assert np.asarray(got_scales).tobytes() == np.asarray(expected_scales).tobytes()


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(("kv_layout", "mesh_name"), [("NHD", "2x4-devices"), ("heads_first", "8-devices")])
def test_a_quantized_pool_on_a_mesh_equals_the_single_device_pool_and_stays_split(
    dtype: str, kv_layout: str, mesh_name: str
) -> None:
    mesh = MESHES[mesh_name]()
    twins = Twins(mesh, kv_layout, dtype=dtype)
    for request_id in ("a", "b", "c"):
        twins.allocate(request_id)
    twins.grow([5, 9, 2])
    twins.grow([1, 3, 1])  # float8: the running maximum grows between writes
    sharded, single = quantized_storage(twins.sharded), quantized_storage(twins.single)
    assert_same_bytes_and_scales(sharded, single)
    scales_spec = partition_spec("model", None, None)
    for layer in range(CONFIG.num_layers):
        assert sharded.key_cache(layer).dtype == jnp.dtype(dtype)
        assert_split_over_heads(sharded.key_cache(layer), mesh, pool_spec(kv_layout), HEADS_AXIS[kv_layout])
        for scales in sharded.scales(layer):
            assert_split_over_heads(scales, mesh, scales_spec, 0)
        for sharded_handle, single_handle in twins.handles:
            for got, expected in zip(
                twins.sharded.gather(sharded_handle, layer), twins.single.gather(single_handle, layer), strict=True
            ):
                assert_split_over_heads(got, mesh, partition_spec(None, "model", None), 1)
                assert np.array_equal(np.asarray(got), np.asarray(expected))

    rng = np.random.default_rng(4)
    prefill = rng.standard_normal((9, 16, 4)).astype(np.float32)
    sinks = rng.standard_normal(16).astype(np.float32)
    indptr = np.asarray([0, 3, 9, 9], dtype=np.int32)
    cases: list[dict[str, Any]] = [{}, {"window": 4, "softcap": 1.5, "sinks": sinks}]
    for features in cases:
        outputs = twins.attend(prefill, indptr, **features)
        assert_split_over_heads(outputs[0], mesh, partition_spec(None, "model", None), 1)
        assert np.allclose(np.asarray(outputs[0]), np.asarray(outputs[1]), rtol=0, atol=1e-6), features


def test_bad_mesh_options_for_a_quantized_pool_are_refused_naming_the_value() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"num_heads=6.*'model' of size 8.*divisible by 8"):
        create_manager("jax", dataclasses.replace(CONFIG, dtype="int8", num_heads=6), mesh=line_mesh(), axis="model")
    with pytest.raises(
        InvalidArgumentError, match=r"axis 'heads' is not an axis of the mesh; its axes are \('model',\)"
    ):
        create_manager("jax", dataclasses.replace(CONFIG, dtype="float8_e4m3fn"), mesh=line_mesh(), axis="heads")


def test_the_compiled_quantized_programs_communicate_nothing() -> None:
    """White-box: encoding, scale moves, decoding and attention with the scales hold no
    collective on a mesh."""
    twins = Twins(line_mesh(), "heads_first", dtype="float8_e4m3fn")
    twins.allocate("a")
    twins.grow([6])
    storage = quantized_storage(twins.sharded)
    placement = storage.placement
    scale_programs = storage._scale_programs  # pyright: ignore[reportPrivateUsage]
    programs = storage._programs  # pyright: ignore[reportPrivateUsage]
    replicated, tokens = placement.replicated, placement.tokens
    columns = placement.sharding(placement.heads_at(2, 1))
    keys, values = storage.scales(0)
    pool = storage.key_cache(0)
    index = jax.device_put(np.arange(4, dtype=np.int32), replicated)
    new_tokens = jax.device_put(np.zeros((4, 8, 4), np.float32), tokens)
    raw_blocks = jax.device_put(np.zeros((16, 8, 4), np.float32), tokens)  # 4 blocks of 4 tokens
    token_scales = jax.device_put(np.zeros((4, 8), np.float32), columns)
    head_scales = jax.device_put(np.zeros((2, 8), np.float32), columns)
    query = jax.device_put(np.zeros((4, 16, 4), np.float32), tokens)
    tables = jax.device_put(np.zeros((4, 16), np.int32), replicated)
    lens = jax.device_put(np.ones(4, np.int32), replicated)
    indptr = jax.device_put(np.arange(5, dtype=np.int32), replicated)
    lowered = [
        scale_programs.encode.lower(head_scales, new_tokens, new_tokens),  # type: ignore[attr-defined]
        scale_programs.set_tokens.lower(keys, values, index, index, token_scales, token_scales),  # type: ignore[attr-defined]
        scale_programs.copy_blocks.lower((keys, values), index, index),  # type: ignore[attr-defined]
        scale_programs.decode.lower(raw_blocks, keys, index),  # type: ignore[attr-defined]
        programs.attention(1, True, 0.5, with_scales=True).lower(  # type: ignore[attr-defined]
            query, pool, pool, tables, lens, indptr, keys, values
        ),
    ]
    for stage in lowered:
        text = stage.compile().as_text().lower()
        assert not [name for name in COLLECTIVES if name in text]


@dataclasses.dataclass(frozen=True)
class MeshBackend(BackendUnderTest):
    """The jax backend as the kit sees it, with every manager's KV heads split over ``mesh``."""

    mesh: Any = None

    def manager(self, config: CacheConfig | None = None, **options: Any) -> Manager:
        return super().manager(config, mesh=self.mesh, axis="model", **options)


@pytest.fixture
def kvcache_backend(request: pytest.FixtureRequest) -> MeshBackend:
    """The kit's backend fixture, overridden here: jax on a mesh of 2 devices (the kit's
    pools have 2 KV heads)."""
    name = str(request.param)
    return MeshBackend(name, get_backend(name), mesh=Mesh(np.array(jax.devices()[:2]), ("model",)))


@pytest.mark.kvcache_backends("jax")
class TestTheKitsQuantizedCasesOnAMesh(QuantizedCases):
    """The kit's quantized cases (tolerance contract, bit-exact copy, fork, swap and prefix
    hits, refused bad K/V) against quantized pools split over 2 devices."""

    # jax claims every quantized dtype: the kit has no unclaimed one to see refused (it
    # would skip, and the runner in test_sharding.py accepts no skip).
    test_an_unclaimed_quantized_dtype_is_refused_with_the_claimed_list = None  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]

    def test_the_pools_are_split(self, kvcache_backend: MeshBackend) -> None:
        storage = kvcache_backend.manager(kvcache_backend.config(dtype="int8", head_dim=32)).storage
        assert isinstance(storage, QuantizedJaxStorage)
        assert storage.placement.shards == 2
        assert_split_over_heads(storage.scales(0)[0], kvcache_backend.mesh, partition_spec("model", None, None), 0)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_a_write_into_part_of_each_row_equals_the_single_device_pool_and_stays_split(kv_layout: str) -> None:
    """A view's heads across the split (heads 3 and 4 of 8, one a device): the sharded pool
    writes its part as the single-device pool does, and stays split over the heads."""
    from kvcache_core.contract.groups import ViewPlace

    mesh = line_mesh()
    config = dataclasses.replace(CONFIG, kv_layout=kv_layout)
    sharded, single = JaxStorage(config, mesh=mesh, axis="model"), JaxStorage(config)
    rng = np.random.default_rng(4)
    slots = np.asarray([2, 7, 11], dtype=np.int64)
    whole = [rng.standard_normal((3, 8, 4)).astype(np.float32) for _ in range(2)]
    part = [rng.standard_normal((3, 2, 2)).astype(np.float32) for _ in range(2)]
    for storage in (sharded, single):
        storage.write(0, slots, *(storage.from_numpy(array) for array in whole))
        keys, values = (storage.from_numpy(array) for array in part)
        storage.write_view(0, slots, keys, values, ViewPlace(3, 2, 1))

    for got, expected in ((sharded.key_cache(0), single.key_cache(0)), (sharded.value_cache(0), single.value_cache(0))):
        assert_split_over_heads(got, mesh, pool_spec(kv_layout), HEADS_AXIS[kv_layout])
        assert np.array_equal(sharded.to_numpy(got), single.to_numpy(expected))
    assert not np.array_equal(single.to_numpy(single.key_cache(0)), single.to_numpy(JaxStorage(config).key_cache(0)))
