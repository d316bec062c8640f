"""The conformance suite: one base class a backend's test file subclasses.

::

    import pytest
    from kvcache_core.testing import KvCacheConformance

    @pytest.mark.kvcache_backends("mine")
    class TestMine(KvCacheConformance):
        pass

Every test takes the ``kvcache_backend`` fixture, which the plugin parametrizes over the
installed backends the run selects (``--kvcache-backend``, the class's pin marker).
"""

from __future__ import annotations

import gc
import inspect
import threading
import weakref
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.attention.features import FEATURE_CAPABILITIES, storage_attention_features
from kvcache_core.attention.reference import paged_attention as reference_attention
from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.protocols import KvCacheHandle, KvStorage
from kvcache_core.errors import (
    ManagerClosedError,
    OutOfBlocksError,
)
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload import host_form
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest, grow_side_by_side, write_random
from kvcache_core.testing.beyond import BeyondPoolCases
from kvcache_core.testing.catalogue import MANAGER_CASES, BadCall, check_bad_call, decode_query, kv
from kvcache_core.testing.features import FeatureCases
from kvcache_core.testing.host_forms import HostFormCases
from kvcache_core.testing.hybrid import HybridCases
from kvcache_core.testing.inspect import allocator
from kvcache_core.testing.lanes import LaneCases
from kvcache_core.testing.layer_geometry import LayerGeometryCases
from kvcache_core.testing.machine import run_reference_machine
from kvcache_core.testing.mixed_layers import MixedLayerCases
from kvcache_core.testing.padded import PaddedGatherCases
from kvcache_core.testing.policies import PolicyCases
from kvcache_core.testing.quantized import QuantizedCases
from kvcache_core.testing.regions import RegionCases
from kvcache_core.testing.reliability import ReliabilityCases
from kvcache_core.testing.returns import storage_return_problems
from kvcache_core.testing.states import StateCases
from kvcache_core.testing.tiers import TierCases
from kvcache_core.testing.value_widths import ValueWidthCases
from kvcache_core.testing.world import World, assert_same_state, make_world, probe, snapshot

__all__ = ["KvCacheConformance"]


Manager = PagedKvCacheManager[Any]
FloatArray = npt.NDArray[np.float64]


def _protocol_members(protocol: type) -> dict[str, Any]:
    members: dict[str, Any] = {}
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(value) or isinstance(value, property):
            members[name] = value
    return members


def _signature_problem(
    protocol_member: Any, implementation: Any, unclaimed: frozenset[str] = frozenset()
) -> str | None:
    """Why ``implementation`` cannot be called as ``protocol_member`` is, or ``None``.

    Protocols grow additively: an optional parameter in ``unclaimed`` (one that serves a
    capability the storage does not claim, which the manager never passes it) may be
    missing."""
    if isinstance(protocol_member, property):
        return None
    if not callable(implementation):
        return "is not callable"
    try:
        signature = inspect.signature(implementation)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to compare
    positional: list[object] = []
    keywords: dict[str, object] = {}
    for parameter in list(inspect.signature(protocol_member).parameters.values())[1:]:
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            if parameter.default is parameter.empty:
                positional.append(object())
        elif parameter.kind is parameter.KEYWORD_ONLY and parameter.name not in unclaimed:
            keywords[parameter.name] = object()
    try:
        signature.bind(*positional, **keywords)
    except TypeError as exc:
        return f"cannot be called like the Protocol's {signature}: {exc}"
    # Every optional parameter of the Protocol must be accepted too.
    for parameter in list(inspect.signature(protocol_member).parameters.values())[1:]:
        if (
            parameter.default is not parameter.empty
            and parameter.kind is not parameter.VAR_KEYWORD
            and parameter.name not in unclaimed
        ):
            try:
                signature.bind_partial(**{parameter.name: object()})
            except TypeError:
                return f"does not accept the Protocol's parameter {parameter.name!r}"
    return None


def _token_positions(config: CacheConfig, slots: npt.NDArray[np.int64]) -> tuple[Any, ...]:
    """Index of ``slots``' tokens in a host copy of a layer's pool: gives ``[n, heads, dim]``."""
    blocks, offsets = np.divmod(slots, config.block_size)
    if config.kv_layout == "NHD":
        return (blocks, offsets)
    if config.kv_layout == "HND":
        return (blocks, slice(None), offsets)
    return (slice(None), blocks, offsets)


def _tokens_from_pool(config: CacheConfig, pool: FloatArray, slots: npt.NDArray[np.int64]) -> FloatArray:
    picked = pool[_token_positions(config, slots)]
    if config.kv_layout == "heads_first":  # advanced indices after a slice: [heads, n, dim]
        picked = picked.transpose(1, 0, 2)
    return np.asarray(picked)


class KvCacheConformance(
    ReliabilityCases,
    PolicyCases,
    BeyondPoolCases,
    FeatureCases,
    QuantizedCases,
    HybridCases,
    TierCases,
    HostFormCases,
    RegionCases,
    LaneCases,
    StateCases,
    MixedLayerCases,
    ValueWidthCases,
    LayerGeometryCases,
    PaddedGatherCases,
):
    """The contract's tests, run against every backend the ``kvcache_backend`` fixture yields."""

    #: Request lengths of the attention tests (ragged, over several blocks and runs).
    attention_lengths: ClassVar[tuple[int, ...]] = (5, 17, 30)

    # -- the Protocol ----------------------------------------------------------------------

    def test_storage_has_every_protocol_member_with_a_compatible_signature(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        storage = kvcache_backend.manager().storage
        served = storage_attention_features(storage)
        # The attention features' keywords are optional for a storage that serves none of them.
        unclaimed = frozenset(name for name, capability in FEATURE_CAPABILITIES.items() if capability not in served)
        problems: list[str] = []
        for name, member in _protocol_members(KvStorage).items():
            if not hasattr(storage, name):
                problems.append(f"{name}: missing")
                continue
            problem = _signature_problem(
                member, getattr(storage, name), unclaimed if name == "paged_attention" else frozenset()
            )
            if problem is not None:
                problems.append(f"{name}: {problem}")
        if problems:
            pytest.fail(f"{type(storage).__name__} does not implement KvStorage: {'; '.join(problems)}", pytrace=False)
        assert isinstance(storage.config, CacheConfig), f"KvStorage.config is {type(storage.config).__name__}"

    def test_every_storage_method_returns_the_contracts_types_and_shapes(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        problems: list[str] = []
        for config in kvcache_backend.configs():
            problems += storage_return_problems(kvcache_backend, config)
        if problems:  # the first line names the method and what it returned
            pytest.fail("\n".join(dict.fromkeys(problems)), pytrace=False)

    # -- lifecycle -------------------------------------------------------------------------

    def test_close_releases_the_pool_once_and_refuses_further_use(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        storage = manager.storage
        release = getattr(storage, "close", None)
        calls: list[int] = []
        if callable(release):

            def counted() -> None:
                calls.append(1)
                release()

            try:
                storage.close = counted  # type: ignore[attr-defined]  # pyright: ignore[reportAttributeAccessIssue]
            except (AttributeError, TypeError):  # a storage with __slots__: count nothing
                calls = [1]
        with manager:
            handle = manager.allocate(AllocationRequest("r"))
            write_random(manager, manager.extend(handle, 5), np.random.default_rng(37), 0)
        manager.close()  # a second close does nothing
        assert manager.closed, "the with block did not close the manager"
        if callable(release):
            assert len(calls) == 1, f"KvStorage.close was called {len(calls)} times by two closes, expected once"
        with pytest.raises(ManagerClosedError):
            handle.key_cache(0)
        with pytest.raises(ManagerClosedError):
            manager.allocate(AllocationRequest("late"))
        assert not handle.is_valid(), "a handle of a closed manager reports is_valid() == True"

    def test_a_closed_pool_is_released_not_kept_alive(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        handle = manager.allocate(AllocationRequest("r", initial_tokens=3))
        storage_ref = weakref.ref(manager.storage)
        manager.close()
        del manager, handle
        gc.collect()
        assert storage_ref() is None, "the storage outlives its closed manager and every handle: something keeps it"

    def test_handles_satisfy_the_handle_protocol(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        handle = manager.allocate(AllocationRequest("r", initial_tokens=3))
        assert isinstance(handle, KvCacheHandle)
        for name, member in _protocol_members(KvCacheHandle).items():
            assert _signature_problem(member, getattr(handle, name)) is None, name
        clone = handle.clone_handle()
        assert isinstance(clone, KvCacheHandle)
        assert clone.cache_id() == handle.cache_id(), "a clone has another cache_id than its handle"
        assert isinstance(handle.block_table(), BlockTable)

    # -- geometry and references -----------------------------------------------------------

    def test_geometry_device_dtype_and_pool_shapes(self, kvcache_backend: BackendUnderTest) -> None:
        for manager, context in kvcache_backend.managers():
            config = manager.config
            handle = manager.allocate(AllocationRequest("r", initial_tokens=5))
            assert (handle.num_layers(), handle.num_heads(), handle.head_dim()) == (
                config.num_layers,
                config.num_heads,
                config.head_dim,
            ), context
            assert handle.device() == config.device, context
            assert manager.storage.config == config, context
            for layer in range(config.num_layers):
                for cache in handle.kv_cache(layer):
                    assert cache is not None, context
                    shape, dtype = manager.storage.array_info(cache)
                    assert shape == config.block_shape(), f"{context}: pool shape {shape}"
                    assert dtype == config.dtype, f"{context}: pool dtype {dtype}"

    def test_key_and_value_cache_are_references_to_the_pool_not_copies(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(3)
        for manager, context in kvcache_backend.managers():
            config = manager.config
            handle = manager.allocate(AllocationRequest("r"))
            slots = manager.extend(handle, 6)
            keys_before, values_before = handle.kv_cache(1)
            keys, values = write_random(manager, slots, rng, 1)
            if kvcache_backend.claims("immutable_arrays"):
                # The old arrays stay readable (never deleted by the write) with the old contents...
                old_keys = BackendUnderTest.host(manager, keys_before)
                assert not np.any(_tokens_from_pool(config, old_keys, slots)), context
                # ...and, with no write in between, key_cache hands out the pool itself.
                assert handle.key_cache(1) is handle.key_cache(1), f"{context}: key_cache made a new array"
                assert handle.value_cache(1) is manager.storage.value_cache(1), context
                keys_now = BackendUnderTest.host(manager, handle.key_cache(1))
                values_now = BackendUnderTest.host(manager, handle.value_cache(1))
            else:
                keys_now = BackendUnderTest.host(manager, keys_before)
                values_now = BackendUnderTest.host(manager, values_before)
            assert np.array_equal(_tokens_from_pool(config, keys_now, slots), keys), (
                f"{context}: a write is not visible through key_cache taken before it (a copy, not a reference)"
            )
            assert np.array_equal(_tokens_from_pool(config, values_now, slots), values), (
                f"{context}: a write is not visible through value_cache taken before it (a copy, not a reference)"
            )

    # -- data ------------------------------------------------------------------------------

    def test_write_then_gather_round_trips_every_dtype_and_layout(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(5)
        for manager, context in kvcache_backend.managers():
            config = manager.config
            handles, written = grow_side_by_side(manager, [9, 14, 3], rng)
            for handle, (keys, values) in zip(handles, written, strict=True):
                gathered_keys, gathered_values = manager.gather(handle, 0)
                assert manager.storage.array_info(gathered_keys) == (keys.shape, config.dtype), context
                assert np.array_equal(BackendUnderTest.host(manager, gathered_keys), keys), (
                    f"{context}: gather of {handle.request_id!r} differs from what was written"
                )
                assert np.array_equal(BackendUnderTest.host(manager, gathered_values), values), (
                    f"{context}: gathered values of {handle.request_id!r} differ from what was written"
                )
                # The tokens sit where the slots say, in the configured layout.
                slots = handle.block_table().slots(0, handle.num_tokens())
                pool_keys = BackendUnderTest.host(manager, manager.storage.key_cache(0))
                assert np.array_equal(_tokens_from_pool(config, pool_keys, slots), keys), (
                    f"{context}: the pool does not hold {handle.request_id!r}'s keys at its slots"
                )

    def test_a_batched_write_across_requests_lands_every_row(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(8)
        manager = kvcache_backend.manager()
        first = manager.allocate(AllocationRequest("a"))
        second = manager.allocate(AllocationRequest("b"))
        slots = np.concatenate([manager.extend(first, 5), manager.extend(second, 3)])
        keys, values = write_random(manager, slots, rng, 0)
        for handle, rows in ((first, slice(0, 5)), (second, slice(5, 8))):
            gathered_keys, gathered_values = manager.gather(handle, 0)
            assert np.array_equal(BackendUnderTest.host(manager, gathered_keys), keys[rows]), (
                f"gathered keys of {handle.request_id!r} differ from its rows of the batched write"
            )
            assert np.array_equal(BackendUnderTest.host(manager, gathered_values), values[rows]), (
                f"gathered values of {handle.request_id!r} differ from its rows of the batched write"
            )

    def test_copy_blocks_and_host_transfers_are_exact(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(11)
        for manager, context in kvcache_backend.managers():
            config = manager.config
            handles, _ = grow_side_by_side(manager, [12, 7], rng)
            storage = manager.storage
            blocks = np.asarray(handles[0].block_table().physical_blocks, dtype=np.int64)
            keys, values = storage.blocks_to_host(blocks)
            expected = (config.num_layers, len(blocks), config.block_size, config.num_heads, config.head_dim)
            assert keys.shape == expected, f"{context}: blocks_to_host shape {keys.shape}"
            gathered = BackendUnderTest.host(manager, manager.gather(handles[0], 1)[0])
            flat = host_form.host_values(config, keys)[1].reshape(-1, config.num_heads, config.head_dim)
            assert np.array_equal(flat[: handles[0].num_tokens()], gathered), f"{context}: blocks_to_host"
            free = [b for b in range(config.num_blocks) if not allocator(manager).in_use_mask()[b]][: len(blocks)]
            targets = np.asarray(free, dtype=np.int64)
            storage.blocks_from_host(targets, keys, values)
            back_keys, back_values = storage.blocks_to_host(targets)
            assert np.array_equal(np.asarray(back_keys), np.asarray(keys)), f"{context}: blocks_from_host keys"
            assert np.array_equal(np.asarray(back_values), np.asarray(values)), f"{context}: blocks_from_host"
            source = np.asarray(handles[1].block_table().physical_blocks, dtype=np.int64)
            storage.copy_blocks(source, targets[: len(source)])
            copied_keys, copied_values = storage.blocks_to_host(targets[: len(source)])
            source_keys, source_values = storage.blocks_to_host(source)
            assert np.array_equal(np.asarray(copied_keys), np.asarray(source_keys)), f"{context}: copy_blocks"
            assert np.array_equal(np.asarray(copied_values), np.asarray(source_values)), f"{context}: copy_blocks"

    # -- attention -------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("query_lengths", "group", "causal"),
        [
            pytest.param(None, 1, True, id="decode"),
            pytest.param(None, 2, True, id="decode-gqa"),
            pytest.param((5, 17, 30), 2, True, id="prefill-gqa"),
            pytest.param((2, 6, 1), 2, True, id="chunked-prefill-ragged"),
            pytest.param((3, 1, 4), 1, False, id="non-causal"),
        ],
    )
    def test_paged_attention_matches_the_numpy_reference(
        self,
        kvcache_backend: BackendUnderTest,
        query_lengths: tuple[int, ...] | None,
        group: int,
        causal: bool,
    ) -> None:
        rng = np.random.default_rng(13)
        for manager, context in kvcache_backend.managers(num_blocks=32):
            config = manager.config
            handles, _ = grow_side_by_side(manager, list(self.attention_lengths), rng)
            table = manager.page_table(handles)
            lengths = query_lengths or (1,) * len(handles)
            indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            heads = config.num_heads * group
            query = BackendUnderTest.representable(
                rng.standard_normal((int(indptr[-1]), heads, config.head_dim)), config.dtype
            )
            scale = 1.0 / float(np.sqrt(config.head_dim))
            layer = config.num_layers - 1
            output = manager.paged_attention(
                layer,
                BackendUnderTest.native(manager, query),
                table,
                qo_indptr=None if query_lengths is None else indptr,
                scale=scale,
                causal=causal,
            )
            expected = reference_attention(
                query,
                BackendUnderTest.host(manager, manager.storage.key_cache(layer)),
                BackendUnderTest.host(manager, manager.storage.value_cache(layer)),
                table,
                qo_indptr=indptr,
                scale=scale,
                causal=causal,
                kv_layout=config.layout,
            )
            shape, dtype = manager.storage.array_info(output)
            assert shape == expected.shape, f"{context}: output shape {shape}"
            assert dtype == config.dtype, f"{context}: output dtype {dtype}"
            rtol, atol = TOLERANCES.get(config.dtype, (1e-2, 1e-2))
            got = BackendUnderTest.host(manager, output)
            error = float(np.max(np.abs(got - expected)))
            assert np.allclose(got, expected, rtol=rtol, atol=atol), (
                f"{context}: paged attention differs from the NumPy reference by up to {error:.3g} "
                f"(tolerance rtol={rtol}, atol={atol})"
            )

    # -- the state machine -----------------------------------------------------------------

    def test_state_machine_against_the_numpy_reference(
        self, kvcache_backend: BackendUnderTest, request: pytest.FixtureRequest
    ) -> None:
        from kvcache_core.testing._plugin import kit_settings

        run_reference_machine(kvcache_backend, kit_settings(request.config))

    # -- bad inputs ------------------------------------------------------------------------

    @pytest.mark.parametrize("case", MANAGER_CASES, ids=[case.id for case in MANAGER_CASES])
    def test_bad_input_raises_its_error_and_changes_nothing(
        self, kvcache_backend: BackendUnderTest, case: BadCall[World]
    ) -> None:
        check_bad_call(case, lambda: make_world(kvcache_backend), probe)

    def test_empty_batches_are_not_errors_and_change_nothing(self, kvcache_backend: BackendUnderTest) -> None:
        world = make_world(kvcache_backend)
        before = snapshot(world.manager)

        output = world.manager.paged_attention(0, decode_query(world, rows=0), world.manager.page_table([]))
        assert world.manager.storage.array_info(output)[0] == (0, 4, 4)
        assert world.manager.extend(world.a, 0).shape == (0,)
        world.manager.write(1, np.zeros(0, dtype=np.int64), kv(world, rows=0), kv(world, rows=0))

        assert_same_state(snapshot(world.manager), before)

    def test_exhausting_the_pool_fails_atomically_and_frees_everything(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        config = manager.config
        taken = 0
        while True:
            try:
                manager.allocate(AllocationRequest(f"r{taken}", initial_tokens=3 * config.block_size))
            except OutOfBlocksError:
                break
            taken += 1
        assert taken == config.num_blocks // 3, f"{taken} requests of 3 blocks fit in {config.num_blocks} blocks"
        before = (manager.stats().used_blocks, [h.block_table() for _, h in manager.list_handles()])
        with pytest.raises(OutOfBlocksError):
            manager.allocate(AllocationRequest("late", initial_tokens=config.num_blocks * config.block_size))
        assert (manager.stats().used_blocks, [h.block_table() for _, h in manager.list_handles()]) == before
        for index in range(taken):
            manager.deallocate(f"r{index}")
        manager.check_invariants()
        stats = manager.stats()
        assert (stats.used_blocks, stats.active_caches) == (0, 0), f"blocks leaked: {stats}"

    # -- threads ---------------------------------------------------------------------------

    def test_threads_share_one_manager_without_losing_or_leaking_anything(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        config = kvcache_backend.config(num_blocks=96)
        manager = kvcache_backend.manager(config)
        failures: list[str] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(4)
        heads, dim = config.num_heads, config.head_dim

        def worker(worker_id: int) -> None:
            rng = np.random.default_rng(worker_id)
            barrier.wait()
            for round_index in range(12):
                request_id = f"w{worker_id}-{round_index}"
                try:
                    handle = manager.allocate(AllocationRequest(request_id, max_sequence_length=40))
                except OutOfBlocksError:
                    continue
                # Layer l holds keys k + l and values -k (k rounded so that both are exact).
                written: list[FloatArray] = []
                try:
                    for _ in range(int(rng.integers(1, 5))):
                        count = int(rng.integers(1, 8))
                        slots = manager.extend(handle, count)
                        keys = np.round(rng.standard_normal((count, heads, dim)) * 8) / 8
                        for layer in range(config.num_layers):
                            manager.write(
                                layer,
                                slots,
                                BackendUnderTest.native(manager, keys + layer),
                                BackendUnderTest.native(manager, -keys),
                            )
                        written.append(keys)
                except OutOfBlocksError:
                    pass
                expected = np.concatenate(written) if written else np.zeros((0, heads, dim))
                for layer in range(config.num_layers):
                    keys_back, values_back = manager.gather(handle, layer)
                    if not (
                        np.array_equal(BackendUnderTest.host(manager, keys_back), expected + layer)
                        and np.array_equal(BackendUnderTest.host(manager, values_back), -expected)
                    ):
                        failures.append(f"{request_id} layer {layer}: data changed under another thread")
                manager.deallocate(request_id)

        def guarded(worker_id: int) -> None:
            try:
                worker(worker_id)
            except BaseException as exc:  # reported below, not lost in the thread
                errors.append(exc)

        threads = [threading.Thread(target=guarded, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [], f"a worker raised: {errors[0]!r}" if errors else ""
        assert failures == [], f"{len(failures)} reads disagree with what was written, first: {failures[0]}"
        manager.check_invariants()
        stats = manager.stats()
        assert (stats.used_blocks, stats.active_caches) == (0, 0), f"blocks leaked: {stats}"
        assert stats.allocation_count > 0, "no worker allocated anything"
        assert stats.allocation_count > 0
