"""Kit cases of hybrid pools: per-layer attention specs and the KV-cache groups they form
(:mod:`kvcache_core.contract.groups`), run on every backend that claims ``sliding_window``.

A hybrid pool of four layers alternates full and sliding (window 6) layers: two groups
of two layers, each request with a block table per group over one pool. The cases check
what a user of a hybrid model relies on: the storage holds one group's layers, a long
request keeps only its window's blocks in the sliding group, each layer's attention
equals the dense reference with its own window, a prefix hit maps every group or none,
the lockstep state machine agrees with the NumPy reference, offload tiers hold one record
per hash and group and give a prefix back to every group bit-exact, and every bad input
raises its error and changes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.errors import (
    IncompatibleCacheFileError,
    InvalidArgumentError,
    InvalidConfigError,
    KvCacheError,
    LayerIndexError,
    ShapeMismatchError,
    SlotError,
)
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.events import CachedBlockIndex
from kvcache_core.offload.prefix_file import split_key
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier
from kvcache_core.paging.block_pool import blocks_for
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest
from kvcache_core.testing.catalogue import BadCall, check_bad_call
from kvcache_core.testing.kv_data import pool_hashes as pool_hashes  # re-exported: importable from here as before
from kvcache_core.testing.kv_data import sevens
from kvcache_core.testing.oracle import dense_attention
from kvcache_core.testing.world import esc, untyped

__all__ = ["HYBRID_CASES", "HybridCases", "HybridWorld", "hybrid_config"]

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]

#: The sliding layers' window, and the specs: full, sliding, full, sliding.
WINDOW = 6
SPECS = (LayerSpec(), LayerSpec(window=WINDOW), LayerSpec(), LayerSpec(window=WINDOW))


def hybrid_config(backend: BackendUnderTest, **fields: Any) -> CacheConfig:
    """The backend's small config with four layers of :data:`SPECS` (block size 4)."""
    return backend.config(**{"num_layers": 4, "num_blocks": 48, "layer_specs": SPECS, **fields})


def run_step(manager: Manager, handles: list[Handle], counts: list[int], seed: int) -> list[Any]:
    """One step: random K/V written and a random query attended in every layer; returns
    ``[(keys, values, query, output)]`` per layer (host arrays)."""
    rng = np.random.default_rng(seed)
    config = manager.config
    step = manager.begin_step(handles, counts)
    total = step.num_new_tokens
    results: list[Any] = []
    for layer in range(config.num_layers):
        keys, values, query = (
            BackendUnderTest.representable(
                rng.standard_normal((total, config.num_heads, config.head_dim)), config.dtype
            )
            for _ in range(3)
        )
        step.write(layer, BackendUnderTest.native(manager, keys), BackendUnderTest.native(manager, values))
        output = step.attention(layer, BackendUnderTest.native(manager, query)) if total else None
        results.append((keys, values, query, None if output is None else BackendUnderTest.host(manager, output)))
    return results


def run_step_with_ids(manager: Manager, handle: Handle, ids: tuple[int, ...]) -> None:
    """Extend ``handle`` by ``ids`` (token ids given: prefix caching) and write each layer's
    K/V, drawn from the ids and positions so that two pools fed alike hold the same."""
    config = manager.config
    start = handle.num_tokens()
    step = manager.begin_step([handle], [len(ids)], token_ids=[list(ids)])
    for layer in range(config.num_layers):
        rng = np.random.default_rng([layer, start, *ids])
        kv = rng.standard_normal((len(ids), config.num_heads, config.head_dim))
        kv = BackendUnderTest.native(manager, BackendUnderTest.representable(kv, config.dtype))
        step.write(layer, kv, kv)


def tier_hashes(tier: OffloadTier) -> frozenset[bytes]:
    """The hashes ``tier`` holds a record of, in any KV-cache group (its events' medium)."""
    return frozenset(split_key(key)[0] for key in tier.hashes())


def source_handle(manager: Manager) -> Handle:
    handle = manager.get_handle("again")
    assert handle is not None
    return handle


@dataclass
class HybridWorld:
    """A hybrid pool with ``a`` (20 tokens, written through steps: its sliding group has
    released blocks) and a deallocated ``dead``."""

    manager: Manager
    a: Handle
    dead: Handle


def make_hybrid_world(backend: BackendUnderTest) -> HybridWorld:
    manager = backend.manager(hybrid_config(backend))
    a = manager.allocate(AllocationRequest("a"))
    run_step(manager, [a], [12], seed=1)
    for seed in range(8):
        run_step(manager, [a], [1], seed=2 + seed)
    dead = manager.allocate(AllocationRequest("dead", initial_tokens=4))
    manager.deallocate("dead")
    return HybridWorld(manager, a, dead)


def probe_hybrid(world: HybridWorld) -> list[object]:
    """Follow-up operations: a decode step, page tables of both groups, a new request."""
    manager = world.manager
    outcomes: list[object] = []
    try:
        for keys, values, query, output in run_step(manager, [world.a], [1], seed=99):
            outcomes.append((keys.tolist(), values.tolist(), query.tolist(), None if output is None else output.shape))
        outcomes.extend(manager.page_table([world.a], group=group).kv_indices.tolist() for group in (0, 1))
        outcomes.append(manager.extend(manager.allocate(AllocationRequest("q", initial_tokens=9)), 9).tolist())
    except KvCacheError as exc:
        outcomes.append(type(exc).__name__)
    return outcomes


def _query(world: HybridWorld, rows: int = 1) -> Any:
    config = world.manager.config
    return BackendUnderTest.native(world.manager, np.ones((rows, config.num_heads, config.head_dim)))


def _kv(world: HybridWorld, rows: int) -> Any:
    config = world.manager.config
    return sevens(world.manager, (rows, config.num_heads, config.head_dim))


HYBRID_CASES: list[BadCall[HybridWorld]] = [
    BadCall(
        "layer-outside-the-specs",
        lambda w: w.manager.write(4, w.a.block_table().slots(19, 20), _kv(w, 1), _kv(w, 1)),
        LayerIndexError,
        "layer 4 is out of range: valid layers are 0 to 3",
    ),
    BadCall(
        "step-layer-outside-the-specs",
        lambda w: w.manager.begin_step([w.a], 0).attention(-1, _query(w, 0)),
        LayerIndexError,
        "layer -1 is out of range: valid layers are 0 to 3",
    ),
    BadCall(
        "page-table-of-another-group",
        lambda w: w.manager.paged_attention(1, _query(w), w.manager.page_table([w.a], group=0)),
        InvalidArgumentError,
        "lists KV-cache group 0, but layer 1 is in group 1",
    ),
    BadCall(
        "page-table-group-out-of-range",
        lambda w: w.manager.page_table([w.a], group=2),
        LayerIndexError,
        "KV-cache group 2 is out of range: valid groups are 0 to 1",
    ),
    BadCall(
        "page-table-relabelled-to-another-group",
        lambda w: w.manager.paged_attention(
            1, _query(w), dataclasses.replace(w.manager.page_table([w.a], group=0), group=1)
        ),
        InvalidArgumentError,
        esc("sliding_window None != KV-cache group 1's sliding_window 6"),
    ),
    BadCall(
        "slots-of-another-group",
        lambda w: w.manager.write(1, w.a.block_tables()[0].slots(19, 20), _kv(w, 1), _kv(w, 1)),
        SlotError,
        "of KV-cache group 0; this layer is in group 1",
    ),
    BadCall(
        "slots-with-a-row-per-group-too-many",
        lambda w: w.manager.write(0, np.zeros((3, 1), dtype=np.int64), _kv(w, 1), _kv(w, 1)),
        ShapeMismatchError,
        esc("slots must be [n] or [2, n] (one row per KV-cache group), got shape (3, 1)"),
    ),
]


def _bad_spec_cases() -> list[tuple[str, Any, str]]:
    """Bad :class:`LayerSpec` fields: ``(id, build, message)``."""
    return [
        ("window-below-1", lambda: LayerSpec(window=0), esc("LayerSpec.window must be None or an int >= 1, got 0")),
        (
            "chunk-not-an-int",
            lambda: LayerSpec(chunk=untyped(2.5)),
            esc("LayerSpec.chunk must be None or an int >= 1, got 2.5"),
        ),
        ("window-and-chunk", lambda: LayerSpec(window=4, chunk=8), "a layer is full, sliding or chunked"),
    ]


class HybridCases:
    """Cases of hybrid pools every backend claiming ``sliding_window`` runs (through
    :class:`~kvcache_core.testing.KvCacheConformance`)."""

    @pytest.mark.kvcache_requires("sliding_window")
    def test_a_hybrid_pool_stores_one_groups_layers_per_block(self, kvcache_backend: BackendUnderTest) -> None:
        config = hybrid_config(kvcache_backend)
        assert [group.layers for group in config.kv_groups] == [(0, 2), (1, 3)]
        assert [group.window for group in config.kv_groups] == [None, WINDOW]
        manager = kvcache_backend.manager(config)
        assert manager.config.num_groups == 2, "the manager lost the layer specs"
        assert manager.storage.config.num_layers == 2, "the storage holds more than one group's layers"
        plain = kvcache_backend.config(num_layers=4, num_blocks=48)
        assert config.bytes_per_block * 2 == plain.bytes_per_block, "a block is not one group's layers"
        assert manager.stats().total_memory_bytes == config.num_blocks * config.bytes_per_block

    @pytest.mark.kvcache_requires("sliding_window")
    def test_a_long_request_keeps_its_window_in_sliding_groups_and_everything_in_full_ones(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        manager = kvcache_backend.manager(hybrid_config(kvcache_backend, num_blocks=64))
        handle = manager.allocate(AllocationRequest("long"))
        run_step(manager, [handle], [8], seed=0)
        block_size = manager.config.block_size
        for seed in range(64):
            run_step(manager, [handle], [1], seed=seed + 1)
            full, sliding = handle.block_tables()
            tokens = handle.num_tokens()
            assert full.num_blocks() == blocks_for(tokens, block_size), f"full group at {tokens} tokens: {full}"
            assert sliding.num_blocks() <= blocks_for(WINDOW, block_size) + 1, (
                f"sliding group holds {sliding.num_blocks()} blocks at {tokens} tokens (window {WINDOW})"
            )
            manager.check_invariants()
        assert manager.stats().used_blocks == blocks_for(72, block_size) + handle.block_tables()[1].num_blocks()
        manager.deallocate("long")
        assert manager.stats().used_blocks == 0

    @pytest.mark.kvcache_requires("sliding_window")
    def test_each_layer_attends_with_its_own_spec_like_the_dense_reference(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        manager = kvcache_backend.manager(hybrid_config(kvcache_backend))
        config = manager.config
        handles = [manager.allocate(AllocationRequest(name)) for name in ("x", "y", "z")]
        history: list[list[tuple[list[Any], list[Any]]]] = [
            [([], []) for _ in handles] for _ in range(config.num_layers)
        ]
        rtol, atol = TOLERANCES.get(config.dtype, (1e-2, 1e-2))
        for round_, counts in enumerate(([7, 13, 3], [1, 1, 1], [5, 0, 9], [1, 1, 1], [1, 1, 1])):
            results = run_step(manager, handles, counts, seed=10 + round_)
            for layer, (keys, values, query, output) in enumerate(results):
                start = 0
                window = config.layer_spec(layer).window
                for index, count in enumerate(counts):
                    seen_keys, seen_values = history[layer][index]
                    seen_keys.extend(keys[start : start + count])
                    seen_values.extend(values[start : start + count])
                    if count:
                        want = dense_attention(
                            query[start : start + count],
                            np.asarray(seen_keys),
                            np.asarray(seen_values),
                            sliding_window=window,
                        )
                        got = output[start : start + count]
                        assert np.allclose(got, want, rtol=rtol, atol=atol), (
                            f"layer {layer} (window {window}), request {index}: off the dense reference by "
                            f"{float(np.max(np.abs(got - want))):.3g}"
                        )
                    start += count
        manager.check_invariants()

    @pytest.mark.kvcache_requires("sliding_window", "prefix_caching", "eviction")
    def test_a_prefix_hit_maps_every_group_or_none(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(hybrid_config(kvcache_backend, enable_prefix_caching=True))
        prompt = list(range(32))
        first = manager.allocate(AllocationRequest("first", prompt_token_ids=tuple(prompt)))
        step = manager.begin_step([first], [32], token_ids=[prompt])
        rng = np.random.default_rng(0)
        config = manager.config
        for layer in range(config.num_layers):
            kv = BackendUnderTest.native(manager, rng.standard_normal((32, config.num_heads, config.head_dim)))
            step.write(layer, kv, kv)
        for token in range(8):  # decoding: the sliding group releases (and caches) its old blocks
            decode = manager.begin_step([first], [1], token_ids=[[100 + token]])
            for layer in range(config.num_layers):
                kv = BackendUnderTest.native(manager, rng.standard_normal((1, config.num_heads, config.head_dim)))
                decode.write(layer, kv, kv)
        full, sliding = first.block_tables()
        assert sliding.first_logical >= 7, f"the sliding group kept blocks its window left: {sliding}"

        # Every group serves the 8 prompt blocks: the full one from "first", the sliding one
        # from its cached blocks (the two its window needs from the first uncached token).
        second = manager.allocate(AllocationRequest("second", prompt_token_ids=(*prompt, 7)))
        assert second.num_cached_tokens() == 32
        second_full, second_sliding = second.block_tables()
        assert second_full.physical_blocks == full.physical_blocks[:8]
        assert (second_sliding.first_logical, second_sliding.num_blocks()) == (6, 2)
        manager.deallocate("second")
        manager.check_invariants()

        # Without the sliding group's cached blocks, the full group's alone must not serve it.
        manager.gc()
        third = manager.allocate(AllocationRequest("third", prompt_token_ids=(*prompt, 7)))
        assert third.num_cached_tokens() == 0, "a prefix hit mapped the full group without the sliding one"
        assert [table.first_logical for table in third.block_tables()] == [0, 0]
        manager.check_invariants()

    @pytest.mark.kvcache_requires("sliding_window", "prefix_caching", "eviction")
    def test_a_saved_hybrid_prefix_cache_loads_and_serves_every_group_bit_exact(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors")
        config = hybrid_config(kvcache_backend, enable_prefix_caching=True)
        source = kvcache_backend.manager(config)
        prompt = tuple(range(32))
        first = source.allocate(AllocationRequest("first", prompt_token_ids=prompt))
        run_step_with_ids(source, first, prompt)
        for token in range(8):  # the sliding group releases (and caches) its old blocks
            run_step_with_ids(source, first, (100 + token,))
        source.deallocate("first")
        saved = source.save_prefix_cache(tmp_path / "hybrid.safetensors")
        assert saved == source.stats().cached_blocks, "a cached block of some group was not saved"

        target = kvcache_backend.manager(config)
        assert target.load_prefix_cache(tmp_path / "hybrid.safetensors") == saved
        target.check_invariants()
        for manager in (source, target):
            handle = manager.allocate(AllocationRequest("again", prompt_token_ids=(*prompt, 7)))
            assert handle.num_cached_tokens() == 32, "the loaded cache does not serve every group"
        for layer in range(config.num_layers):
            want = [BackendUnderTest.host(source, array) for array in source.gather(source_handle(source), layer)]
            got = [BackendUnderTest.host(target, array) for array in target.gather(source_handle(target), layer)]
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), f"layer {layer} differs"
        target.check_invariants()
        plain = kvcache_backend.manager(kvcache_backend.config(num_layers=4, enable_prefix_caching=True))
        with pytest.raises(IncompatibleCacheFileError, match="kv_groups"):
            plain.load_prefix_cache(tmp_path / "hybrid.safetensors")
        assert plain.stats().cached_blocks == 0

    @pytest.mark.kvcache_requires("sliding_window", "prefix_caching", "eviction", "swap")
    def test_a_hybrid_prefix_comes_back_from_host_and_disk_tiers_in_every_group_bit_exact(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors")
        config = hybrid_config(kvcache_backend, enable_prefix_caching=True, num_blocks=24)
        block_size = config.block_size
        host, disk = HostTier(8 * config.bytes_per_block), DiskTier(tmp_path, 1 << 24)
        manager = kvcache_backend.manager(config, tiers=[host, disk])
        index = CachedBlockIndex()
        manager.subscribe(index)
        prompt = tuple(range(8 * block_size))
        first = manager.allocate(AllocationRequest("first", prompt_token_ids=prompt))
        run_step_with_ids(manager, first, prompt)  # one step: the sliding group keeps every block
        want = [
            [BackendUnderTest.host(manager, array) for array in manager.gather(first, layer)]
            for layer in range(config.num_layers)
        ]
        manager.deallocate("first")
        manager.gc()  # 8 hashes, a record of each in each group: 8 to host, 8 on to disk
        assert (len(host.hashes()), len(disk.hashes())) == (8, 8), "not one record per hash and group"
        assert index.hashes("host") == tier_hashes(host)
        assert index.hashes("disk") == tier_hashes(disk)

        again = manager.allocate(AllocationRequest("again", prompt_token_ids=(*prompt, 7)))
        assert again.num_cached_tokens() == len(prompt), "the tiers did not serve every group"
        full, sliding = again.block_tables()
        seen = (len(prompt) - WINDOW + 1) // block_size  # the first block the window sees
        assert full.first_logical == 0
        assert (sliding.first_logical, sliding.num_blocks()) == (seen, 8 - seen), (
            f"the sliding group mapped blocks its window does not see: {sliding}"
        )
        for layer in range(config.num_layers):
            group, _ = config.layer_place(layer)
            offset = (0, seen * block_size)[group]
            got = [BackendUnderTest.host(manager, array) for array in manager.gather(again, layer)]
            for name, array, expected in zip(("keys", "values"), got, want[layer], strict=True):
                assert np.array_equal(array, expected[offset:]), f"layer {layer}: promoted {name} differ"
        # The sliding group's records of the blocks its window passed stay in the tiers.
        assert len(host.hashes()) + len(disk.hashes()) == seen
        assert index.hashes() == pool_hashes(manager)
        assert index.hashes("host") == tier_hashes(host)
        assert index.hashes("disk") == tier_hashes(disk)
        host_stats, disk_stats = manager.tier_stats()
        assert host_stats.hits + disk_stats.hits == 8 + 8 - seen
        manager.check_invariants()

    @pytest.mark.kvcache_requires("sliding_window", "prefix_caching", "eviction", "swap")
    def test_a_sliding_window_pool_promotes_from_its_tier_as_far_as_the_window_reaches_back(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        pytest.importorskip("safetensors")
        config = kvcache_backend.config(enable_prefix_caching=True, num_blocks=16, sliding_window=WINDOW)
        block_size = config.block_size
        manager = kvcache_backend.manager(config, tiers=[HostTier(1 << 24)])
        prompt = tuple(range(100, 100 + 5 * block_size))
        first = manager.allocate(AllocationRequest("first", prompt_token_ids=prompt))
        run_step_with_ids(manager, first, prompt)  # one step: every block held and cached
        want = [
            [BackendUnderTest.host(manager, array) for array in manager.gather(first, layer)]
            for layer in range(config.num_layers)
        ]
        manager.deallocate("first")
        manager.gc()
        assert manager.tier_stats()[0].blocks == 5
        # A promoted block must stay held by the request to be hashed: the run ends where
        # the window from the first uncached token no longer sees the first promoted block.
        reach = max(blocks for blocks in range(1, 6) if blocks * block_size - WINDOW + 1 < block_size)
        again = manager.allocate(AllocationRequest("again", prompt_token_ids=(*prompt, 7)))
        assert again.num_cached_tokens() == reach * block_size
        assert again.block_table().first_logical == 0
        for layer in range(config.num_layers):
            got = [BackendUnderTest.host(manager, array) for array in manager.gather(again, layer)]
            for name, array, expected in zip(("keys", "values"), got, want[layer], strict=True):
                assert np.array_equal(array, expected[: reach * block_size]), f"layer {layer}: promoted {name} differ"
        assert manager.tier_stats()[0].blocks == 5 - reach, "blocks past the promoted run left the tier"
        manager.check_invariants()

    @pytest.mark.kvcache_requires("sliding_window", "fork", "swap")
    def test_fork_swap_and_truncate_carry_every_group(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(hybrid_config(kvcache_backend))
        parent = manager.allocate(AllocationRequest("parent"))
        run_step(manager, [parent], [10], seed=0)
        for seed in range(5):
            run_step(manager, [parent], [1], seed=seed + 1)
        child = manager.fork(parent, "child")
        assert child.block_tables() == parent.block_tables()
        before = [manager.gather(child, layer) for layer in range(4)]
        manager.swap_out("child")
        manager.check_invariants()
        manager.swap_in("child")
        for layer, (keys, values) in enumerate(before):
            got_keys, got_values = manager.gather(child, layer)
            assert np.array_equal(BackendUnderTest.host(manager, got_keys), BackendUnderTest.host(manager, keys))
            assert np.array_equal(BackendUnderTest.host(manager, got_values), BackendUnderTest.host(manager, values))
        assert [(t.first_logical, t.num_blocks()) for t in child.block_tables()] == [
            (t.first_logical, t.num_blocks()) for t in parent.block_tables()
        ]
        manager.truncate(child, 14)
        run_step(manager, [child, parent], [2, 1], seed=50)
        manager.check_invariants()
        for request_id in ("child", "parent"):
            manager.deallocate(request_id)
        assert manager.stats().used_blocks == 0

    @pytest.mark.kvcache_requires("sliding_window")
    def test_a_storage_failure_anywhere_in_a_hybrid_pool_changes_nothing(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        from kvcache_core.testing.faults import run_fault_injection

        report = run_fault_injection(kvcache_backend, hybrid=True)
        assert report.failures == (), "\n".join(report.failures)
        assert report.injections == 2 * len(report.storage_calls) > 0

    @pytest.mark.parametrize("case", HYBRID_CASES, ids=[case.id for case in HYBRID_CASES])
    def test_bad_hybrid_input_raises_its_error_and_changes_nothing(
        self, kvcache_backend: BackendUnderTest, case: BadCall[HybridWorld], request: pytest.FixtureRequest
    ) -> None:
        from kvcache_core.testing._plugin import skip_unclaimed

        if not kvcache_backend.claims("sliding_window"):
            skip_unclaimed(request, kvcache_backend.name, "sliding_window")
        check_bad_call(case, lambda: make_hybrid_world(kvcache_backend), probe_hybrid)

    @pytest.mark.parametrize("case", _bad_spec_cases(), ids=[case[0] for case in _bad_spec_cases()])
    def test_a_bad_layer_spec_is_refused(self, case: tuple[str, Any, str]) -> None:
        _, build, message = case
        with pytest.raises(InvalidConfigError, match=message):
            build()

    def test_layer_specs_that_do_not_fit_the_pool_are_refused(self, kvcache_backend: BackendUnderTest) -> None:
        with pytest.raises(InvalidConfigError, match="names 2 layers, the pool has num_layers=4"):
            kvcache_backend.config(num_layers=4, layer_specs=SPECS[:2])
        with pytest.raises(InvalidConfigError, match="sliding_window=8 and layer_specs"):
            kvcache_backend.config(num_layers=4, layer_specs=SPECS, sliding_window=8)
        with pytest.raises(InvalidConfigError, match=esc("layer_specs[1] must be a LayerSpec, got 6")):
            kvcache_backend.config(num_layers=2, layer_specs=(LayerSpec(), 6))

    @pytest.mark.kvcache_requires("sliding_window")
    def test_state_machine_with_a_hybrid_config_of_two_kv_cache_groups(
        self, kvcache_backend: BackendUnderTest, request: pytest.FixtureRequest
    ) -> None:
        from kvcache_core.testing._plugin import kit_settings
        from kvcache_core.testing.machine import run_policy_machine

        run_policy_machine(kvcache_backend, kit_settings(request.config), window=False, hybrid=True)
