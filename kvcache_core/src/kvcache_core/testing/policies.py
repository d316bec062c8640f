"""The kit's policy cases: fork with copy-on-write, swapping, prefix caching, eviction and
the sliding window, the lockstep machine with the policies on, and the policies' bad-input
catalogue. :class:`~kvcache_core.testing.KvCacheConformance` inherits them; each runs only
where the backend claims the capabilities it needs (``BackendSpec.capabilities``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.attention.reference import paged_attention as reference_attention
from kvcache_core.contract.config import AllocationRequest
from kvcache_core.errors import OutOfBlocksError
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest, grow_side_by_side, write_random
from kvcache_core.testing.catalogue import BadCall, check_bad_call
from kvcache_core.testing.machine import POLICIES, run_policy_machine
from kvcache_core.testing.policy_catalogue import POLICY_CASES
from kvcache_core.testing.world import PolicyWorld, make_policy_world, probe_policies

__all__ = ["PolicyCases"]

FloatArray = npt.NDArray[np.float64]


class PolicyCases:
    """Cases every backend runs (through :class:`~kvcache_core.testing.KvCacheConformance`)
    for the policies it claims."""

    # -- the state machine with the policies on ---------------------------------------------

    def test_state_machine_with_the_policies_the_backend_claims(
        self, kvcache_backend: BackendUnderTest, request: pytest.FixtureRequest
    ) -> None:
        from kvcache_core.testing._plugin import kit_settings, skip_unclaimed

        machine_policies = sorted(POLICIES - {"sliding_window"})
        if not set(kvcache_backend.spec.capabilities) & set(machine_policies):
            skip_unclaimed(request, kvcache_backend.name, *machine_policies)
        run_policy_machine(kvcache_backend, kit_settings(request.config), window=False)

    @pytest.mark.kvcache_requires("sliding_window")
    def test_state_machine_with_a_sliding_window(
        self, kvcache_backend: BackendUnderTest, request: pytest.FixtureRequest
    ) -> None:
        from kvcache_core.testing._plugin import kit_settings

        run_policy_machine(kvcache_backend, kit_settings(request.config), window=True)

    # -- policies --------------------------------------------------------------------------

    @pytest.mark.kvcache_requires("fork")
    def test_fork_copies_exactly_the_shared_block_that_is_written(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(17)
        manager = kvcache_backend.manager()
        parent = manager.allocate(AllocationRequest("parent"))
        keys, _ = write_random(manager, manager.extend(parent, 6), rng, 0)  # blocks: 4 + 2 tokens
        child = manager.fork(parent, "child")
        assert child.block_table().physical_blocks == parent.block_table().physical_blocks, "fork copied blocks"

        child_slots = manager.extend(child, 1)  # lands in the shared, half-full second block
        assert manager.stats().copy_on_write_count == 1, "extending into a shared block did not copy it"
        assert child.block_table().physical_blocks[0] == parent.block_table().physical_blocks[0], "full block copied"
        assert child.block_table().physical_blocks[1] != parent.block_table().physical_blocks[1], "no copy made"
        child_keys, _ = write_random(manager, child_slots, rng, 0)
        parent_keys, _ = write_random(manager, manager.extend(parent, 1), rng, 0)  # no longer shared: no copy
        assert manager.stats().copy_on_write_count == 1, "a block no longer shared was copied again"

        parent_back = BackendUnderTest.host(manager, manager.gather(parent, 0)[0])
        child_back = BackendUnderTest.host(manager, manager.gather(child, 0)[0])
        assert np.array_equal(parent_back, np.concatenate([keys, parent_keys])), "the child's write reached the parent"
        assert np.array_equal(child_back, np.concatenate([keys, child_keys])), "the copy lost the shared tokens"
        manager.deallocate("parent")
        manager.deallocate("child")
        manager.check_invariants()
        assert manager.stats().used_blocks == 0, (
            f"{manager.stats().used_blocks} blocks in use after every request ended"
        )

    @pytest.mark.kvcache_requires("swap")
    def test_swap_out_and_in_is_bit_identical_every_dtype_and_layout(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(19)
        for manager, context in kvcache_backend.managers():
            config = manager.config
            handles, _ = grow_side_by_side(manager, [11, 6], rng)
            before = [
                BackendUnderTest.host(manager, a) for layer in range(2) for a in manager.gather(handles[0], layer)
            ]
            blocks_before = handles[0].block_table().num_blocks()
            manager.swap_out("r0")
            assert handles[0].is_swapped_out(), context
            assert manager.stats().used_blocks == handles[1].block_table().num_blocks(), context
            # Another request takes the freed blocks, so swap_in must go elsewhere.
            grow_side_by_side(manager, [blocks_before * config.block_size], rng, prefix="filler")
            manager.swap_in("r0")
            after = [BackendUnderTest.host(manager, a) for layer in range(2) for a in manager.gather(handles[0], layer)]
            for index, (got, want) in enumerate(zip(after, before, strict=True)):
                assert np.array_equal(got, want), f"{context}: array {index} changed through swap_out / swap_in"
            manager.check_invariants()

    @pytest.mark.kvcache_requires("prefix_caching")
    def test_a_shared_prompt_is_stored_once_and_hit_by_every_later_request(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        rng = np.random.default_rng(23)
        config = kvcache_backend.config(num_blocks=64, enable_prefix_caching=True)
        manager = kvcache_backend.manager(config)
        shared = [int(token) for token in rng.integers(0, 1000, 5 * config.block_size + 2)]
        first_keys: FloatArray | None = None
        for index in range(4):
            prompt = (*shared, 1000 + index, 2000 + index)
            handle = manager.allocate(AllocationRequest(f"r{index}", prompt_token_ids=prompt))
            cached = handle.num_tokens()
            assert cached == (0 if index == 0 else 5 * config.block_size), f"request {index}: {cached} cached"
            slots = manager.extend(handle, len(prompt) - cached, token_ids=prompt[cached:])
            for layer in range(config.num_layers):
                write_random(manager, slots, rng, layer)
            keys = BackendUnderTest.host(manager, manager.gather(handle, 0)[0])
            if first_keys is None:
                first_keys = keys
            else:
                shared_tokens = 5 * config.block_size
                assert np.array_equal(keys[:shared_tokens], first_keys[:shared_tokens]), "a hit maps other K/V"
        stats = manager.stats()
        assert stats.prefix_cache_hits == 3 * 5, f"{stats.prefix_cache_hits} prefix-cache hits, expected 15"
        own_blocks = -(-(len(shared) + 2 - 5 * config.block_size) // config.block_size)
        assert stats.used_blocks == 5 + 4 * own_blocks  # the shared blocks once, the rest per request
        manager.check_invariants()

    @pytest.mark.kvcache_requires("eviction")
    def test_a_full_pool_evicts_cached_blocks_before_failing(self, kvcache_backend: BackendUnderTest) -> None:
        config = kvcache_backend.config(num_blocks=8, enable_prefix_caching=True)
        manager = kvcache_backend.manager(config)
        rng = np.random.default_rng(29)
        prompt = tuple(range(6 * config.block_size + 1))
        handle = manager.allocate(AllocationRequest("warm", prompt_token_ids=prompt))
        slots = manager.extend(handle, len(prompt), token_ids=prompt)
        for layer in range(config.num_layers):
            write_random(manager, slots, rng, layer)
        manager.deallocate("warm")
        assert manager.stats().cached_blocks == 6, f"{manager.stats().cached_blocks} blocks cached, expected 6"

        manager.allocate(AllocationRequest("big", initial_tokens=config.num_blocks * config.block_size))

        stats = manager.stats()
        assert stats.eviction_count == 6, f"{stats.eviction_count} blocks evicted, expected 6"
        assert (stats.cached_blocks, stats.free_blocks, stats.used_blocks) == (0, 0, config.num_blocks)
        with pytest.raises(OutOfBlocksError):
            manager.allocate(AllocationRequest("late", initial_tokens=1))
        manager.check_invariants()

    @pytest.mark.kvcache_requires("sliding_window")
    def test_sliding_window_attention_matches_the_reference_and_blocks_are_released(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        rng = np.random.default_rng(31)
        window = 9
        for manager, context in kvcache_backend.managers(num_blocks=32, sliding_window=window):
            config = manager.config
            handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(3)]
            limit = -(-window // config.block_size) + 1
            for step in range(40):
                for index, handle in enumerate(handles):
                    if step < 10 * (index + 1):
                        slots = manager.extend(handle, 1)
                        for layer in range(config.num_layers):
                            write_random(manager, slots, rng, layer)
                        assert handle.block_table().num_blocks() <= limit, f"{context}: holds too many blocks"
            table = manager.page_table(handles)
            query = BackendUnderTest.representable(
                rng.standard_normal((3, 2 * config.num_heads, config.head_dim)), config.dtype
            )
            output = manager.paged_attention(0, BackendUnderTest.native(manager, query), table)
            expected = reference_attention(
                query,
                BackendUnderTest.host(manager, manager.storage.key_cache(0)),
                BackendUnderTest.host(manager, manager.storage.value_cache(0)),
                table,
                kv_layout=config.layout,
                sliding_window=window,
            )
            rtol, atol = TOLERANCES.get(config.dtype, (1e-2, 1e-2))
            got = BackendUnderTest.host(manager, output)
            assert np.allclose(got, expected, rtol=rtol, atol=atol), (
                f"{context}: windowed attention differs by up to {float(np.max(np.abs(got - expected))):.3g}"
            )

    # -- bad inputs ------------------------------------------------------------------------

    @pytest.mark.parametrize("case", POLICY_CASES, ids=[case.id for case in POLICY_CASES])
    def test_bad_policy_input_raises_its_error_and_changes_nothing(
        self, kvcache_backend: BackendUnderTest, case: BadCall[PolicyWorld], request: pytest.FixtureRequest
    ) -> None:
        from kvcache_core.testing._plugin import skip_unclaimed

        missing = [name for name in case.requires if not kvcache_backend.claims(name)]
        if missing:
            skip_unclaimed(request, kvcache_backend.name, *missing)
        check_bad_call(case, lambda: make_policy_world(kvcache_backend), probe_policies)
