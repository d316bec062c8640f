"""The kit's cases for pools whose layers differ in geometry (``LayerSpec(num_heads=...,
head_dim=..., value_head_dim=...)``: Gemma 4's full-attention layers have a head size and KV
head count of their own), run on every backend that claims the ``"layer_geometry"`` capability.

What they hold the backend to: each layer's arrays in its own shape, over the same blocks
(``key_cache``, ``value_cache``, ``gather``), ``stats()`` counting each layer's bytes; the
lockstep state machine against the NumPy reference with every policy it claims; a storage
failure at any call leaking nothing and corrupting no request (fault injection); writes
of another layer's shape refused by name; attention per layer, with the features it serves,
against the float64 dense reference in every dtype and layout; fork with copy-on-write and a
prefix hit serving every layer in its own shape; swap bit-exact in every layer (a packed host
form); host copies beyond the pool (tiers, prefix files) refused by name, nothing changed. In
KV-cache groups whose layers differ in geometry (:data:`GROUPED_GEOMETRY_SPECS`, layers viewing
one page), the same: each layer its own shape and attention, sliding layers keeping only their
window's blocks, the lockstep state machine; and where narrower layers share a page side by side
(:data:`PACKED_GEOMETRY_SPECS`, Gemma 4's sliding layers two to a page of its full layers'
width), each layer's writes leaving the others' parts of every row as they were, in every
layout, with swap bit-exact.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.errors import ShapeMismatchError, UnsupportedConfigError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.tiers import HostTier
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest
from kvcache_core.testing.features import dense_feature_attention

__all__ = ["GEOMETRY_SPECS", "GROUPED_GEOMETRY_SPECS", "PACKED_GEOMETRY_SPECS", "LayerGeometryCases", "geometry_config"]

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]
FloatArray = npt.NDArray[np.float64]

#: Three layers beside the kit's pool of 2 heads of 8: the pool's, one head of 16 (Gemma 4's
#: full layers: fewer, wider heads), and 4 heads of 8 with values of 4.
GEOMETRY_SPECS: Final = (
    LayerSpec(),
    LayerSpec(num_heads=1, head_dim=16),
    LayerSpec(num_heads=4, value_head_dim=4),
)

#: Gemma 4's shape in KV-cache groups: two sliding layers (window 6) and a full one, each place
#: of the groups in three geometries (the pool's, one head of 16, 4 heads of 8 with values of
#: 4), so the three view one page of 4 heads of 16.
GROUPED_GEOMETRY_SPECS: Final = (
    LayerSpec(window=6),
    LayerSpec(num_heads=1, head_dim=16),
    LayerSpec(window=6, num_heads=4, value_head_dim=4),
)

#: Narrower layers two to a page (:attr:`~kvcache_core.contract.groups.KvGroup.views`): beside
#: full layers of 2 heads of 16, sliding layers of window 6 and one head of 16 (side by side
#: along the heads) and of window 4 and the pool's 2 heads of 8 (along the features): four
#: groups of one page (six unpacked), each sliding group's two layers in one page.
PACKED_GEOMETRY_SPECS: Final = (
    LayerSpec(window=6, num_heads=1, head_dim=16),
    LayerSpec(window=4),
    LayerSpec(head_dim=16),
) * 2

#: Request lengths of the attention cases: ragged, over several blocks and runs.
_LENGTHS: Final = (5, 17, 30)


def geometry_config(backend: BackendUnderTest, **fields: Any) -> CacheConfig:
    """The kit's config with the layers of :data:`GEOMETRY_SPECS` (``fields`` changed)."""
    return backend.config(**{"num_layers": len(GEOMETRY_SPECS), "layer_specs": GEOMETRY_SPECS, **fields})


def _write(
    manager: Manager, layer: int, slots: npt.NDArray[np.int64], rng: np.random.Generator
) -> tuple[FloatArray, FloatArray]:
    """Write Gaussian K/V of ``layer``'s own geometry into ``slots``; return them as float64."""
    shape = manager.config.layer_geometry(layer)
    dtype = manager.config.io_dtype
    keys = BackendUnderTest.representable(rng.standard_normal((len(slots), shape.num_heads, shape.head_dim)), dtype)
    values = BackendUnderTest.representable(
        rng.standard_normal((len(slots), shape.num_heads, shape.value_width)), dtype
    )
    manager.write(
        layer, slots, BackendUnderTest.native(manager, keys, dtype), BackendUnderTest.native(manager, values, dtype)
    )
    return keys, values


def _write_all(manager: Manager, slots: npt.NDArray[np.int64], rng: np.random.Generator) -> list[tuple[Any, Any]]:
    """Write every layer; ``slots`` ``[n]``, or ``[groups, n]`` with KV-cache groups (each
    layer its group's)."""
    config = manager.config
    return [
        _write(manager, layer, slots if slots.ndim == 1 else slots[config.layer_place(layer)[0]], rng)
        for layer in range(config.num_layers)
    ]


def _grow(manager: Manager, rng: np.random.Generator) -> list[Handle]:
    """Requests of :data:`_LENGTHS` grown side by side, 3 tokens at a time (several runs)."""
    handles = [manager.allocate(AllocationRequest(f"shaped-{index}")) for index in range(len(_LENGTHS))]
    done = [0] * len(_LENGTHS)
    while done != list(_LENGTHS):
        for index, handle in enumerate(handles):
            step = min(3, _LENGTHS[index] - done[index])
            if step:
                _write_all(manager, manager.extend(handle, step), rng)
                done[index] += step
    return handles


def _gathered(manager: Manager, handle: Handle) -> list[tuple[FloatArray, FloatArray]]:
    pairs = [manager.gather(handle, layer) for layer in range(manager.config.num_layers)]
    return [(BackendUnderTest.host(manager, keys), BackendUnderTest.host(manager, values)) for keys, values in pairs]


class LayerGeometryCases:
    """Cases for layers of their own geometry, on every backend claiming ``"layer_geometry"``
    (through :class:`~kvcache_core.testing.KvCacheConformance`)."""

    @pytest.mark.kvcache_requires("layer_geometry")
    def test_each_layer_is_shaped_and_sized_by_its_own_geometry(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(61)
        for config in kvcache_backend.configs(num_layers=len(GEOMETRY_SPECS), layer_specs=GEOMETRY_SPECS):
            context = f"dtype {config.dtype}, layout {config.kv_layout}"
            with kvcache_backend.manager(config) as manager:
                resolved, storage = manager.config, manager.storage
                handle = manager.allocate(AllocationRequest("r"))
                written = _write_all(manager, manager.extend(handle, 6), rng)
                for layer, (keys, values) in enumerate(written):
                    shape = resolved.layer_geometry(layer)
                    where = f"{context}, layer {layer} ({shape})"
                    assert storage.array_info(handle.key_cache(layer))[0] == resolved.layer_block_shape(layer), where
                    assert storage.array_info(handle.value_cache(layer))[0] == resolved.layer_block_shape(
                        layer, "values"
                    ), where
                    got_keys, got_values = _gathered(manager, handle)[layer]
                    assert np.array_equal(got_keys, keys), f"{where}: keys changed through the pool"
                    assert np.array_equal(got_values, values), f"{where}: values changed through the pool"
                per_token = sum(
                    shape.num_heads * (shape.head_dim + shape.value_width)
                    for shape in (resolved.layer_geometry(layer) for layer in range(resolved.num_layers))
                )
                assert resolved.bytes_per_token == per_token * resolved.dtype_size, context
                assert handle.stats().memory_bytes == 2 * resolved.bytes_per_block, context
                assert manager.stats().total_memory_bytes == resolved.num_blocks * resolved.bytes_per_block, context

    @pytest.mark.kvcache_requires("layer_geometry")
    def test_state_machine_with_layers_of_their_own_geometry(
        self, kvcache_backend: BackendUnderTest, request: pytest.FixtureRequest
    ) -> None:
        from kvcache_core.testing._plugin import kit_settings
        from kvcache_core.testing.machine import run_config_machine

        caching = kvcache_backend.claims("prefix_caching")
        for layout in dict.fromkeys((kvcache_backend.kv_layouts[0], kvcache_backend.kv_layouts[-1])):
            # each layer its own part; then KV-cache groups whose layers view one page
            for name, specs, blocks in (
                ("layer", GEOMETRY_SPECS, 12),
                ("grouped", GROUPED_GEOMETRY_SPECS, 16),
                ("packed", PACKED_GEOMETRY_SPECS, 20),
            ):
                config = kvcache_backend.config(
                    num_layers=len(specs),
                    layer_specs=specs,
                    kv_layout=layout,
                    num_blocks=blocks,
                    enable_prefix_caching=caching,
                )
                run_config_machine(kvcache_backend, config, f"{name}_geometry_{layout}", kit_settings(request.config))

    @pytest.mark.kvcache_requires("layer_geometry")
    def test_a_storage_failure_at_any_call_leaks_nothing_in_a_pool_of_mixed_geometry(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        from kvcache_core.testing.faults import run_fault_injection

        # each layer its part; layers viewing one page; layers side by side in a page
        for specs in (GEOMETRY_SPECS, GROUPED_GEOMETRY_SPECS, PACKED_GEOMETRY_SPECS):
            run_fault_injection(kvcache_backend, layer_specs=specs).check(kvcache_backend.claims, f"{specs}: ")

    @pytest.mark.kvcache_requires("layer_geometry")
    def test_a_write_of_another_layers_shape_is_refused_by_name(self, kvcache_backend: BackendUnderTest) -> None:
        with kvcache_backend.manager(geometry_config(kvcache_backend)) as manager:
            handle = manager.allocate(AllocationRequest("r"))
            slots = manager.extend(handle, 3)
            wrong = BackendUnderTest.native(manager, np.zeros((3, 2, 8)))  # layer 0's shape, not layer 1's
            with pytest.raises(ShapeMismatchError, match=r"keys must have shape \(3, 1, 16\)"):
                manager.write(1, slots, wrong, wrong)
            query = BackendUnderTest.native(manager, np.zeros((3, 4, 8)))
            with pytest.raises(ShapeMismatchError, match=r"query must be \[tokens, k \* 1, 16\]"):
                manager.paged_attention(1, query, manager.page_table([handle]))
            manager.check_invariants()

    @pytest.mark.kvcache_requires("layer_geometry")
    def test_attention_of_each_layer_matches_the_dense_reference(self, kvcache_backend: BackendUnderTest) -> None:
        served = kvcache_backend.claims("attention_window") and kvcache_backend.claims("softcap")
        rng = np.random.default_rng(67)
        for config in kvcache_backend.configs(
            num_layers=len(GEOMETRY_SPECS), layer_specs=GEOMETRY_SPECS, num_blocks=32
        ):
            with kvcache_backend.manager(config) as manager:
                handles = _grow(manager, rng)
                contexts = [_gathered(manager, handle) for handle in handles]
                for layer in range(config.num_layers):
                    for features in ({}, {"window": 6, "softcap": 5.0} if served else {}):
                        context = f"dtype {config.dtype}, layout {config.kv_layout}, layer {layer}, {features}"
                        self._attend_layer_and_compare(manager, handles, contexts, layer, features, rng, context)

    @pytest.mark.kvcache_requires("layer_geometry")
    @pytest.mark.kvcache_requires("attention_window")
    @pytest.mark.parametrize(
        ("specs", "groups", "packed"), [(GROUPED_GEOMETRY_SPECS, 3, False), (PACKED_GEOMETRY_SPECS, 4, True)]
    )
    def test_groups_of_mixed_geometry_keep_their_window_and_each_layer_its_shape(
        self, kvcache_backend: BackendUnderTest, specs: tuple[LayerSpec, ...], groups: int, packed: bool
    ) -> None:
        rng = np.random.default_rng(83)
        for config in kvcache_backend.configs(num_layers=len(specs), layer_specs=specs, num_blocks=64):
            context = f"dtype {config.dtype}, layout {config.kv_layout}"
            with kvcache_backend.manager(config) as manager:
                resolved = manager.config
                assert resolved.num_groups == groups, context
                assert resolved.storage_layers.shares_pages, f"{context}: its layers do not view one page"
                assert resolved.storage_layers.packs_views == packed, context
                handles = _grow(manager, rng)
                for layer in range(resolved.num_layers):
                    assert manager.storage.array_info(handles[0].key_cache(layer))[0] == resolved.layer_block_shape(
                        layer
                    ), f"{context}, layer {layer}: its key pool is not of its own shape"
                contexts = [_gathered(manager, handle) for handle in handles]
                for handle, length in zip(handles, _LENGTHS, strict=True):
                    full = -(-length // resolved.block_size)
                    kept = sum(
                        full if group.window is None else min(full, -(-group.window // resolved.block_size) + 2)
                        for group in resolved.kv_groups
                    )
                    assert handle.stats().blocks_allocated <= kept, (
                        f"{context}: a request of {length} tokens holds {handle.stats().blocks_allocated} blocks; its "
                        "sliding layers keep only their window's"
                    )
                    assert handle.stats().memory_bytes == handle.stats().blocks_allocated * resolved.bytes_per_block
                sinks = kvcache_backend.claims("sinks")  # at the view's place among the page's heads
                for layer, spec in enumerate(specs):
                    features: dict[str, Any] = {} if spec.window is None else {"window": spec.window}
                    features.update({"sinks": True} if sinks and layer % 2 else {})
                    where = f"{context}, layer {layer}, {features}"
                    self._attend_layer_and_compare(manager, handles, contexts, layer, features, rng, where, (1, 1, 1))
                manager.check_invariants()

    @pytest.mark.kvcache_requires("layer_geometry")
    @pytest.mark.kvcache_requires("attention_window")
    def test_layers_side_by_side_in_a_page_keep_what_each_wrote(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(89)
        specs = PACKED_GEOMETRY_SPECS
        for config in kvcache_backend.configs(num_layers=len(specs), layer_specs=specs, num_blocks=32):
            context = f"dtype {config.dtype}, layout {config.kv_layout}"
            with kvcache_backend.manager(config) as manager:
                handle = manager.allocate(AllocationRequest("r"))
                written = _write_all(manager, manager.extend(handle, 5), rng)
                # a later write of each layer, into rows its page's other views hold already
                for layer, more in enumerate(_write_all(manager, manager.extend(handle, 3), rng)):
                    written[layer] = (
                        np.concatenate([written[layer][0], more[0]]),
                        np.concatenate([written[layer][1], more[1]]),
                    )
                for layer, (got, sent) in enumerate(zip(_gathered(manager, handle), written, strict=True)):
                    for name, kept, wrote in zip(("keys", "values"), got, sent, strict=True):
                        assert np.array_equal(kept, wrote[len(wrote) - len(kept) :]), (
                            f"{context}, layer {layer}: its {name} changed when the layers beside it in its page wrote"
                        )
                manager.check_invariants()

    @staticmethod
    def _attend_layer_and_compare(
        manager: Manager,
        handles: list[Handle],
        contexts: list[list[tuple[FloatArray, FloatArray]]],
        layer: int,
        features: dict[str, Any],
        rng: np.random.Generator,
        context: str,
        counts: tuple[int, ...] = (2, 9, 1),
    ) -> None:
        config = manager.config
        shape = config.layer_geometry(layer)
        query_heads = 2 * shape.num_heads
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        query = BackendUnderTest.representable(
            rng.standard_normal((int(indptr[-1]), query_heads, shape.head_dim)), config.dtype
        )
        scale = 1.0 / math.sqrt(shape.head_dim)
        if features.get("sinks") is True:  # a sink per query head, drawn here
            features = {
                **features,
                "sinks": BackendUnderTest.representable(rng.standard_normal(query_heads), config.dtype),
            }
        native = {
            name: BackendUnderTest.native(manager, value) if name == "sinks" else value
            for name, value in features.items()
        }
        output = manager.paged_attention(
            layer,
            BackendUnderTest.native(manager, query),
            manager.page_table(handles, group=config.layer_place(layer)[0]),
            qo_indptr=indptr,
            scale=scale,
            **native,
        )
        expected = np.concatenate(
            [
                dense_feature_attention(
                    query[indptr[index] : indptr[index + 1]], *gathered[layer], scale=scale, **features
                )
                for index, gathered in enumerate(contexts)
            ]
        )
        got = BackendUnderTest.host(manager, output)
        assert got.shape == (int(indptr[-1]), query_heads, shape.value_width), f"{context}: output {got.shape}"
        rtol, atol = TOLERANCES.get(config.dtype, (1e-2, 1e-2))
        assert np.allclose(got, expected, rtol=rtol, atol=atol), (
            f"{context}: differs from the dense reference by up to {float(np.max(np.abs(got - expected))):.3g}"
        )

    @pytest.mark.kvcache_requires("layer_geometry")
    @pytest.mark.kvcache_requires("fork")
    @pytest.mark.kvcache_requires("prefix_caching")
    def test_fork_and_a_prefix_hit_serve_every_layer_in_its_own_shape(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(71)
        prompt = tuple(range(200, 210))  # two full blocks of 4 and two tokens
        config = geometry_config(kvcache_backend, enable_prefix_caching=True)
        with kvcache_backend.manager(config) as manager:
            parent = manager.allocate(AllocationRequest("parent", prompt_token_ids=prompt))
            _write_all(manager, manager.extend(parent, len(prompt)), rng)
            before = _gathered(manager, parent)
            child = manager.fork(parent, "child")
            _write_all(manager, manager.extend(child, 1), rng)  # copies the shared last block, every layer
            for layer, (after, sent) in enumerate(zip(_gathered(manager, parent), before, strict=True)):
                for name, got, wrote in zip(("keys", "values"), after, sent, strict=True):
                    assert np.array_equal(got, wrote), f"layer {layer}: the child's write changed the parent's {name}"
            for layer, (kept, sent) in enumerate(zip(_gathered(manager, child), before, strict=True)):
                assert np.array_equal(kept[0][: len(prompt)], sent[0]), f"layer {layer}: the fork lost its keys"
            hit = manager.allocate(AllocationRequest("hit", prompt_token_ids=prompt))
            assert hit.num_tokens() == 8, "the prompt's two full blocks gave no prefix hit"
            for layer, (mapped, sent) in enumerate(zip(_gathered(manager, hit), before, strict=True)):
                for name, got, wrote in zip(("keys", "values"), mapped, sent, strict=True):
                    assert np.array_equal(got, wrote[:8]), f"layer {layer}: the prefix hit's {name} differ"
            manager.check_invariants()

    @pytest.mark.kvcache_requires("layer_geometry")
    @pytest.mark.kvcache_requires("swap")
    @pytest.mark.parametrize("specs", [GEOMETRY_SPECS, PACKED_GEOMETRY_SPECS], ids=["own", "packed"])
    def test_swap_keeps_every_layer_bit_exact_in_its_own_shape(
        self, kvcache_backend: BackendUnderTest, specs: tuple[LayerSpec, ...]
    ) -> None:
        rng = np.random.default_rng(79)
        for config in kvcache_backend.configs(num_layers=len(specs), layer_specs=specs, num_blocks=48):
            context = f"dtype {config.dtype}, layout {config.kv_layout}"
            with kvcache_backend.manager(config) as manager:
                handle = manager.allocate(AllocationRequest("r"))
                _write_all(manager, manager.extend(handle, 7), rng)
                other = manager.allocate(AllocationRequest("other"))
                _write_all(manager, manager.extend(other, 5), rng)
                before = _gathered(manager, handle)
                manager.swap_out("r")
                manager.deallocate("other")  # swap_in lands in other blocks
                _write_all(manager, manager.extend(manager.allocate(AllocationRequest("x")), 9), rng)
                manager.swap_in("r")
                for layer, (after, sent) in enumerate(zip(_gathered(manager, handle), before, strict=True)):
                    for name, got, wrote in zip(("keys", "values"), after, sent, strict=True):
                        assert np.array_equal(got, wrote), f"{context}, layer {layer}: {name} changed through swap"
                manager.check_invariants()

    @pytest.mark.kvcache_requires("layer_geometry")
    def test_host_copies_beyond_the_pool_are_refused_by_name(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        rng = np.random.default_rng(73)
        config = geometry_config(kvcache_backend, enable_prefix_caching=True)
        with kvcache_backend.manager(config) as manager:
            handle = manager.allocate(AllocationRequest("r", prompt_token_ids=tuple(range(5))))
            _write_all(manager, manager.extend(handle, 5), rng)
            before = manager.stats().used_blocks
            with pytest.raises(UnsupportedConfigError, match=r"save_prefix_cache moves host copies.*1 heads of 16"):
                manager.save_prefix_cache(tmp_path / "cache.safetensors")
            with pytest.raises(UnsupportedConfigError, match="load_prefix_cache moves host copies"):
                manager.load_prefix_cache(tmp_path / "cache.safetensors")
            assert manager.stats().used_blocks == before
            assert not (tmp_path / "cache.safetensors").exists()
            manager.check_invariants()
        with pytest.raises(UnsupportedConfigError, match="an offload tier moves host copies"):
            kvcache_backend.manager(config, tiers=[HostTier(1 << 20)])
