"""Layers of their own geometry (``LayerSpec(num_heads=..., head_dim=..., value_head_dim=...)``,
Gemma 4's full-attention layers): the configuration, its sizes and its refusals, the storage
core builds per geometry, and the refusal of a backend or storage that does not serve it.
What every backend must do with such a pool is the kit's
(:mod:`kvcache_core.testing.layer_geometry`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import AllocationRequest, CacheConfig, LayerSpec, create_manager
from kvcache_core.backends.layered import LayeredStorage
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.contract.groups import LayerGeometry, ViewPlace
from kvcache_core.contract.states import StateArray, StateSpec
from kvcache_core.errors import InvalidConfigError, LayerIndexError, ShapeMismatchError, UnsupportedConfigError
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.plugin import LAYER_GEOMETRY, BackendSpec

GEOMETRY: dict[str, Any] = {"num_layers": 3, "num_heads": 2, "head_dim": 8, "num_blocks": 8, "block_size": 4}
SPECS = (LayerSpec(), LayerSpec(num_heads=1, head_dim=16), LayerSpec(value_head_dim=4))


def config(**fields: Any) -> CacheConfig:
    given: dict[str, Any] = {**GEOMETRY, "layer_specs": SPECS, **fields}
    return CacheConfig(**given)


@pytest.mark.parametrize("field", ["num_heads", "head_dim", "value_head_dim"])
@pytest.mark.parametrize("value", [0, -1, 2**31, True, 2.5], ids=["zero", "negative", "too-large", "bool", "float"])
def test_a_layer_geometry_outside_its_range_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(InvalidConfigError, match=rf"LayerSpec\.{field} must be None or an int >= 1, got .*"):
        LayerSpec(**{field: value})  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]  # refused


def test_a_state_layer_with_a_geometry_is_refused_by_name() -> None:
    state = StateSpec((StateArray("conv", (4, 3), "float32"),))

    with pytest.raises(InvalidConfigError, match=r"without window or chunk \(nor K/V geometry\).*head_dim=16"):
        LayerSpec(state=state, head_dim=16)


def test_each_layer_resolves_its_geometry_from_its_spec_then_the_pool() -> None:
    pool = config()

    assert [pool.layer_geometry(layer) for layer in range(3)] == [
        LayerGeometry(2, 8, 8),
        LayerGeometry(1, 16, 16),  # values as wide as its own keys
        LayerGeometry(2, 8, 4),
    ]
    assert pool.mixed_geometry
    assert not CacheConfig(**GEOMETRY).mixed_geometry
    assert not CacheConfig(**GEOMETRY, layer_specs=[LayerSpec(head_dim=8)] * 3).mixed_geometry  # the pool's own
    with pytest.raises(LayerIndexError, match="layer 3 is out of range"):
        pool.layer_geometry(3)


def test_sizes_sum_every_layers_own_bytes() -> None:
    pool = config(dtype="float16")

    assert pool.bytes_per_token == (2 * (8 + 8) + 1 * (16 + 16) + 2 * (8 + 4)) * 2
    assert pool.bytes_per_block == 4 * pool.bytes_per_token
    with create_manager("numpy", pool) as manager:
        assert manager.stats().total_memory_bytes == 8 * pool.bytes_per_block
        handle = manager.allocate(AllocationRequest("r"))
        manager.extend(handle, 5)
        assert handle.stats().memory_bytes == 2 * pool.bytes_per_block


def test_a_layers_block_shape_follows_the_layout() -> None:
    for layout, shape in (("NHD", (8, 4, 1, 16)), ("HND", (8, 1, 4, 16)), ("heads_first", (1, 8, 4, 16))):
        assert config(kv_layout=layout).layer_block_shape(1) == shape
    assert config(kv_layout="NHD").layer_block_shape(2, "values") == (8, 4, 2, 4)


def test_the_storage_config_keeps_each_storage_layers_geometry_and_is_its_own() -> None:
    grouped = config(
        num_layers=4,
        layer_specs=[LayerSpec(window=4), LayerSpec(window=4, head_dim=16), LayerSpec(), LayerSpec(head_dim=16)],
    )  # groups [0, 1] (window 4) and [2, 3]: storage layer 1 is 16 wide in both

    storage = grouped.storage_config()

    assert grouped.num_groups == 2
    assert [storage.layer_geometry(layer).head_dim for layer in range(2)] == [8, 16]
    assert storage.storage_config() == storage
    assert grouped.bytes_per_token == (2 * 16 + 2 * 32) * 2 * 4


def test_groups_whose_layers_differ_in_geometry_view_one_page_sized_for_the_widest() -> None:
    specs = [LayerSpec(window=4), LayerSpec(num_heads=1, head_dim=16)]
    grouped = config(num_layers=2, layer_specs=specs)
    storage = grouped.storage_layers

    assert grouped.num_groups == 2  # a sliding layer and a full one: groups of one layer
    assert storage.places == ((0, 0), (1, 1))
    assert storage.pages == (0, 0)
    assert storage.page_geometry == (LayerGeometry(2, 16, 16),)  # the most heads, the widest keys and values
    assert storage.shares_pages
    assert not storage.packs_views  # each view side by side with another would take no fewer pages
    assert grouped.pool_layers == 2
    assert grouped.bytes_per_block == 4 * 2 * (16 + 16) * 4  # one page of every block
    assert grouped.bytes_per_token == 2 * 2 * (16 + 16) * 4  # each group's layer its page
    built = grouped.storage_config()
    assert [built.layer_geometry(layer) for layer in range(2)] == [LayerGeometry(2, 8, 8), LayerGeometry(1, 16, 16)]


def test_narrower_layers_share_a_page_side_by_side_where_that_takes_fewer_pages() -> None:
    specs = [LayerSpec(window=4), LayerSpec(num_heads=1, head_dim=16), LayerSpec(window=4)]
    grouped = config(num_layers=3, layer_specs=specs)
    storage = grouped.storage_layers

    # Both sliding layers (2 heads of 8) side by side in a page of 2 heads of 16, along the
    # features; the full layer (1 head of 16) in its first head: two groups, not three.
    assert [(group.layers, group.views) for group in grouped.kv_groups] == [((0, 2), 2), ((1,), 2)]
    assert storage.places == ((0, 0), (1, 2), (0, 1))
    assert storage.pages == (0, 0, 0)
    assert storage.offsets == (ViewPlace(), ViewPlace(0, 8, 8), ViewPlace())
    assert storage.page_geometry == (LayerGeometry(2, 16, 16),)
    assert storage.packs_views
    assert grouped.bytes_per_token == 2 * 2 * (16 + 16) * 4  # a page a group (three groups unpacked)


@pytest.mark.parametrize(
    ("kinds", "groups"),
    [
        # Gemma 4 (30 layers, five sliding of half the head size to one full): 4 groups of 5
        # pages, the last sliding one half filled (6 groups of 5 pages unpacked).
        ([(4, 32, 512)] * 5 + [(4, 64, None)], [(512, 10, 2), (None, 5, 1), (512, 10, 2), (512, 5, 2)]),
        # Half the KV heads on the sliding layers (10 to 5 full): side by side along the heads,
        # one group of each kind over 5 pages (3 groups unpacked).
        ([(2, 64, 512)] * 2 + [(4, 64, None)], [(512, 10, 2), (None, 5, 1)]),
    ],
)
def test_packed_groups_take_a_whole_number_of_pages(
    kinds: list[tuple[int, int, int | None]], groups: list[tuple[int | None, int, int]]
) -> None:
    specs = [LayerSpec(window=window, num_heads=heads, head_dim=dim) for heads, dim, window in kinds] * 5
    grouped = CacheConfig(
        num_layers=len(specs), num_heads=4, head_dim=64, num_blocks=8, block_size=4, layer_specs=specs
    )

    assert [(group.window, len(group.layers), group.views) for group in grouped.kv_groups] == groups
    storage = grouped.storage_layers
    pages = len(storage.page_geometry)
    assert storage.page_geometry == (LayerGeometry(4, 64, 64),) * pages
    seen: dict[tuple[int, int, int], int] = {}
    for layer, spec in enumerate(specs):
        group, row = grouped.layer_place(layer)
        shape, place = storage.geometry[row], storage.view_place(row)
        assert (shape.num_heads, shape.head_dim) == (spec.num_heads, spec.head_dim)
        assert place.head + shape.num_heads <= 4 and place.key + shape.head_dim <= 64  # noqa: PT018
        for head in range(place.head, place.head + shape.num_heads):  # no two layers of a group in one place
            for key in range(place.key, place.key + shape.head_dim):
                assert seen.setdefault((group, storage.pages[row], head * 64 + key), layer) == layer
    assert grouped.bytes_per_token == len(groups) * pages * 4 * 128 * 4


def test_stats_report_each_groups_bytes_per_token_in_the_pool_and_at_its_own_geometry() -> None:
    specs = [LayerSpec(window=4), LayerSpec(num_heads=1, head_dim=12), LayerSpec(window=4)]  # no views side by side
    grouped = config(num_layers=3, layer_specs=specs, num_blocks=16)
    page, sliding, full = 2 * (12 + 12) * 4, 2 * (8 + 8) * 4, 1 * (12 + 12) * 4

    with create_manager("numpy", grouped) as manager:
        handle = manager.allocate(AllocationRequest("r"))
        manager.extend(handle, 9)  # three blocks in each group
        manager.allocate(AllocationRequest("other", initial_tokens=1))
        stats = manager.stats()

    assert stats.group_bytes_per_token == (page, page, page)
    assert stats.group_layer_bytes_per_token == (sliding, full, sliding)
    assert stats.group_used_blocks == (4, 4, 4)
    assert stats.used_memory_bytes == sum(
        blocks * grouped.block_size * size
        for blocks, size in zip(stats.group_used_blocks, stats.group_bytes_per_token, strict=True)
    )


@pytest.mark.parametrize(("dtype", "per_head"), [("float32", (8 + 8) * 4), ("int8", 8 + 8 + 2 * 4)])
def test_a_pool_of_one_geometry_reports_no_padding_per_group(dtype: str, per_head: int) -> None:
    pool = CacheConfig(**GEOMETRY, dtype=dtype, layer_specs=[LayerSpec(window=4), LayerSpec(), LayerSpec(window=4)])

    with create_manager("numpy", pool) as manager:
        stats = manager.stats()

    assert stats.group_bytes_per_token == stats.group_layer_bytes_per_token == (2 * per_head,) * 3
    assert stats.group_used_blocks == (0, 0, 0)


def test_layers_viewing_one_page_hold_their_own_shape_over_its_memory() -> None:
    grouped = config(
        num_layers=2,
        num_blocks=16,
        kv_layout="HND",
        layer_specs=[LayerSpec(window=4), LayerSpec(num_heads=1, head_dim=16)],
    )
    with create_manager("numpy", grouped) as manager:
        storage = manager.storage
        assert isinstance(storage, LayeredStorage)
        assert storage.shares_pages
        assert [part.config.num_layers for part in storage.parts] == [1]  # one page array for both layers
        assert storage.key_cache(0).shape == (16, 2, 4, 8)
        assert np.shares_memory(storage.key_cache(0), storage.key_cache(1))
        handle = manager.allocate(AllocationRequest("r"))
        slots = manager.extend(handle, 9)
        rng = np.random.default_rng(3)
        narrow = rng.standard_normal((9, 2, 8)).astype(np.float32)
        wide = rng.standard_normal((9, 1, 16)).astype(np.float32)
        manager.write(0, slots[0], narrow, 2 * narrow)
        manager.write(1, slots[1], wide, 2 * wide)
        kept = manager.gather(handle, 0)[0]
        assert np.array_equal(kept, narrow[len(narrow) - len(kept) :])
        assert np.array_equal(manager.gather(handle, 1)[1], 2 * wide)
        grown = manager.extend(handle, 12)
        more = np.ones((12, 2, 8), dtype=np.float32)
        manager.write(0, grown[0], more, more)
        manager.write(1, grown[1], more.reshape(12, 1, 16), more.reshape(12, 1, 16))
        last = manager.extend(handle, 1)  # one token more: its window starts in block 4 of 6
        manager.write(0, last[0], more[:1], more[:1])
        assert handle.stats().blocks_allocated == 6 + 2  # every block of the full group, 2 of the sliding
        assert np.array_equal(manager.gather(handle, 1)[0][:9], wide)
        manager.check_invariants()
        with pytest.raises(UnsupportedConfigError, match="share pages"):
            storage.memory_regions()


def test_a_quantized_pool_of_mixed_geometry_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfigError, match="a int8 pool holds one geometry for every layer"):
        config(dtype="int8")


def test_a_backend_that_does_not_claim_the_capability_is_refused_by_name() -> None:
    spec = BackendSpec(
        name="old", storage_factory=NumpyStorage, kv_layouts=("NHD",), capabilities=frozenset({"value_head_dim"})
    )

    problems = spec.check_config(config(kv_layout="NHD"))

    assert len(problems) == 1
    assert repr(LAYER_GEOMETRY) in problems[0]
    assert "1 heads of 16" in problems[0]


def test_create_manager_builds_one_part_per_geometry_over_the_same_blocks() -> None:
    with create_manager("numpy", config()) as manager:
        storage = manager.storage
        assert isinstance(storage, LayeredStorage)
        parts = storage.parts
        assert [part.config.num_layers for part in parts] == [1, 1, 1]
        assert {part.config.num_blocks for part in parts} == {8}
        handle = manager.allocate(AllocationRequest("r"))
        slots = manager.extend(handle, 3)
        keys = np.ones((3, 1, 16), dtype=np.float32)
        manager.write(1, slots, keys, 2 * keys)
        child = manager.fork(handle, "child")
        manager.write(1, manager.extend(child, 1), keys[:1], keys[:1])  # copies the shared block in every part
        gathered = manager.gather(handle, 1)
        assert np.array_equal(gathered[0], keys)
        assert np.array_equal(gathered[1], 2 * keys)
        manager.check_invariants()


def test_a_manager_refuses_a_storage_that_holds_one_shape_for_every_layer() -> None:
    storage = NumpyStorage(config())  # built as if every layer had the pool's geometry

    with pytest.raises(UnsupportedConfigError, match=r"layer 1 as .* not \(1, 8, 4, 16\).*'layer_geometry'"):
        PagedKvCacheManager(storage)


def test_host_copies_of_the_layered_storage_are_packed_per_block_and_come_back_bit_exact() -> None:
    pool = config(kv_layout="HND").storage_config()
    storage = LayeredStorage(pool, NumpyStorage)
    rng = np.random.default_rng(5)
    for layer in range(3):
        shape = pool.layer_geometry(layer)
        slots = np.arange(8, dtype=np.int64)  # blocks 0 and 1
        keys = rng.standard_normal((8, shape.num_heads, shape.head_dim)).astype(np.float32)
        values = rng.standard_normal((8, shape.num_heads, shape.value_width)).astype(np.float32)
        storage.write(layer, slots, keys, values)

    keys, values = storage.blocks_to_host(np.array([1, 0], dtype=np.int64))

    assert keys.shape == (2, pool.packed_block_elements()) == (2, 4 * (2 * 8 + 1 * 16 + 2 * 8))
    assert values.shape == (2, 4 * (2 * 8 + 1 * 16 + 2 * 4))
    storage.blocks_from_host(np.array([3, 2], dtype=np.int64), keys, values)
    for layer in range(3):
        moved = storage.gather(layer, np.array([2, 3], dtype=np.int64), 8)
        kept = storage.gather(layer, np.array([0, 1], dtype=np.int64), 8)
        assert np.array_equal(moved[0], kept[0]) and np.array_equal(moved[1], kept[1])  # noqa: PT018
    with pytest.raises(ShapeMismatchError, match=r"keys must have shape \(1, 192\) \(the packed host form"):
        storage.blocks_from_host(np.array([3], dtype=np.int64), keys, values)


def test_a_backend_that_does_not_claim_it_is_refused_by_create_manager_before_any_pool() -> None:
    pytest.importorskip("kvcache_memmap", reason="the memmap example backend is not installed")

    with pytest.raises(UnsupportedConfigError, match=r"backend 'memmap' does not support layers of different geometry"):
        create_manager("memmap", config())


def test_state_layers_beside_layers_of_their_own_geometry() -> None:
    state = StateSpec((StateArray("conv", (4, 3), "float32"),))
    pool = config(layer_specs=(LayerSpec(state=state), LayerSpec(), LayerSpec(num_heads=1, head_dim=16)))

    assert pool.bytes_per_token == (2 * 16 + 1 * 32) * 4  # the state layer keeps no K/V
    with create_manager("numpy", pool) as manager:
        handle = manager.allocate(AllocationRequest("r"))
        step = manager.begin_step([handle], [5])
        for layer, (heads, dim) in ((1, (2, 8)), (2, (1, 16))):
            keys = np.ones((5, heads, dim), dtype=np.float32)
            step.write(layer, keys, keys)
            assert step.attention(layer, np.ones((5, 2 * heads, dim), dtype=np.float32)).shape == (5, 2 * heads, dim)
        step.write_state(0, "conv", np.ones((1, 4, 3), dtype=np.float32))
        assert np.array_equal(step.state(0, "conv"), np.ones((1, 4, 3), dtype=np.float32))
        manager.check_invariants()


def test_a_block_of_layers_viewing_one_page_is_cached_once_its_groups_layers_wrote_it() -> None:
    specs = [LayerSpec(window=8), LayerSpec(num_heads=1, head_dim=16)]
    grouped = config(num_layers=2, num_blocks=16, layer_specs=specs, enable_prefix_caching=True)
    prompt = tuple(range(100, 109))  # two full blocks of 4 and one token
    with create_manager("numpy", grouped) as manager:
        first = manager.allocate(AllocationRequest("first", prompt_token_ids=prompt))
        slots = manager.extend(first, len(prompt))
        keys = np.arange(9 * 16, dtype=np.float32).reshape(9, 2, 8)
        manager.write(0, slots[0], keys, keys)
        manager.write(1, slots[1], keys.reshape(9, 1, 16), keys.reshape(9, 1, 16))  # every storage layer it has
        hit = manager.allocate(AllocationRequest("hit", prompt_token_ids=prompt))
        assert hit.num_tokens() == 8
        assert np.array_equal(manager.gather(hit, 1)[0], keys[:8].reshape(8, 1, 16))
        manager.check_invariants()


class _NoViewWrites(NumpyStorage):
    """A NumPy storage without ``write_view`` (:mod:`kvcache_core.contract.views`)."""

    def __getattribute__(self, name: str) -> Any:
        if name == "write_view":
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
@pytest.mark.parametrize("factory", [NumpyStorage, _NoViewWrites], ids=["write_view", "rows-read-and-written"])
def test_views_side_by_side_keep_each_others_rows_with_or_without_write_view(factory: Any, layout: str) -> None:
    specs = [LayerSpec(window=4), LayerSpec(num_heads=1, head_dim=16), LayerSpec(window=4)]
    pool = config(num_layers=3, layer_specs=specs, kv_layout=layout)
    layers = pool.storage_layers
    storage = LayeredStorage(pool.storage_config(), factory, pages=layers.pages, offsets=layers.offsets)
    rng = np.random.default_rng(11)
    slots = np.array([5, 0, 9, 30], dtype=np.int64)
    written: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]] = []
    rows = layers.group_rows(pool.kv_groups[0])  # the sliding group's two layers, side by side in a page
    assert [layers.view_place(row) for row in rows] == [ViewPlace(), ViewPlace(0, 8, 8)]
    for row in rows:  # then the first again: its rewrite keeps the other's part of each row
        shape = layers.geometry[row]
        keys = rng.standard_normal((4, shape.num_heads, shape.head_dim)).astype(np.float32)
        values = rng.standard_normal((4, shape.num_heads, shape.value_width)).astype(np.float32)
        storage.write(row, slots, keys, values)
        written.append((keys, values))
    storage.write(0, slots[:2], 3 * written[0][0][:2], 3 * written[0][1][:2])
    written[0] = (
        np.concatenate([3 * written[0][0][:2], written[0][0][2:]]),
        np.concatenate([3 * written[0][1][:2], written[0][1][2:]]),
    )

    for row, (keys, values) in zip(rows, written, strict=True):
        blocks = slots // pool.block_size
        got_keys, got_values = storage.gather(row, np.unique(blocks), len(np.unique(blocks)) * pool.block_size)
        at = np.searchsorted(np.unique(blocks), blocks) * pool.block_size + slots % pool.block_size
        assert np.array_equal(got_keys[at], keys), f"storage layer {row}: keys"
        assert np.array_equal(got_values[at], values), f"storage layer {row}: values"


@pytest.mark.parametrize("field", ["head", "key", "value"])
@pytest.mark.parametrize("value", [-1, 2**31, True, 2.5, None], ids=["negative", "too-large", "bool", "float", "none"])
def test_a_view_place_outside_its_range_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(InvalidConfigError, match=rf"ViewPlace\.{field} must be an int >= 0.*got"):
        ViewPlace(**{field: value})  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]  # refused
