"""The kit's reliability and step cases: storage failures at every call, the soak, page
tables that cannot be edited or go stale, cached blocks that cannot be rewritten, and the
forward step with ``truncate``. :class:`~kvcache_core.testing.KvCacheConformance` inherits
them, so every backend runs them.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest
from kvcache_core.contract.protocols import KvCacheHandle
from kvcache_core.errors import (
    InvalidArgumentError,
    LayerIndexError,
    ManagerClosedError,
    OutOfBlocksError,
    ShapeMismatchError,
    SharedBlockWriteError,
    StalePageTableError,
    StaleStepError,
    SwappedOutError,
)
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest
from kvcache_core.testing.faults import run_fault_injection
from kvcache_core.testing.soak import run_soak
from kvcache_core.testing.world import assert_same_state, snapshot, untyped

__all__ = ["CLOSED_MANAGER_ANSWERS", "HANDLE_READS", "ReliabilityCases", "decode_like", "kv_pair", "public_methods"]

Manager = PagedKvCacheManager[Any]
#: Something done to a manager's requests (given their handles) after a step was planned.
RequestChange = Callable[[Manager, list[PagedKvCacheHandle[Any]]], object]
FloatArray = npt.NDArray[np.float64]


#: The methods a closed manager still answers; every other public method raises
#: ManagerClosedError (properties stay readable).
CLOSED_MANAGER_ANSWERS = frozenset({"close", "stats", "tier_stats"})
#: The methods a handle of a closed manager still answers (figures and identity); every
#: other public method raises ManagerClosedError.
HANDLE_READS = frozenset(
    {
        "as_any",
        "cache_id",
        "device",
        "head_dim",
        "is_swapped_out",
        "is_valid",
        "num_cached_tokens",
        "num_heads",
        "num_layers",
        "num_tokens",
        "stats",
        "value_head_dim",
    }
)


def public_methods(target: object) -> dict[str, Callable[..., object]]:
    """Every public method of ``target`` (its class's functions, not its properties), bound."""
    methods: dict[str, Callable[..., object]] = {}
    for name, member in inspect.getmembers(type(target)):
        if not name.startswith("_") and inspect.isfunction(member):
            methods[name] = getattr(target, name)
    return methods


def call_with_placeholders(method: Callable[..., object]) -> object:
    """Call ``method`` with ``None`` for each required argument."""
    positional: list[object] = []
    keywords: dict[str, object] = {}
    for parameter in inspect.signature(method).parameters.values():
        if parameter.default is not inspect.Parameter.empty or parameter.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            continue
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            keywords[parameter.name] = None
        else:
            positional.append(None)
    with warnings.catch_warnings():  # deprecated methods are called too: they must refuse as well
        warnings.simplefilter("ignore", DeprecationWarning)
        return method(*positional, **keywords)


def not_refused_when_closed(what: str, target: object, answers: frozenset[str]) -> list[str]:
    """Calls every public method of ``target`` (of a closed manager): those in ``answers``
    must answer, every other must raise ManagerClosedError first, whatever its arguments.
    Returns what went otherwise, one line each."""
    wrong: list[str] = []
    for name, method in public_methods(target).items():
        try:
            call_with_placeholders(method)
        except ManagerClosedError as exc:
            if name in answers:
                wrong.append(f"{what}.{name} raised ManagerClosedError: {exc}")
        except Exception as exc:  # an answer failed, or a refusal for another reason came first
            wrong.append(f"{what}.{name} raised {type(exc).__name__}: {exc}")
        else:
            if name not in answers:
                wrong.append(f"{what}.{name} was accepted")
    return wrong


def kv_pair(manager: PagedKvCacheManager[Any], rows: int, value: float) -> tuple[Any, Any]:
    """Native keys and values ``[rows, num_heads, head_dim]``: ``value`` plus the row index."""
    config = manager.config
    host = np.full((rows, config.num_heads, config.head_dim), value) + np.arange(rows)[:, None, None]
    return BackendUnderTest.native(manager, host), BackendUnderTest.native(manager, -host)


def decode_like(manager: PagedKvCacheManager[Any], requests: int) -> Any:
    """A native decode query of ``requests`` rows, one query head per KV head."""
    config = manager.config
    return BackendUnderTest.native(manager, np.ones((requests, config.num_heads, config.head_dim)) / 8)


class ReliabilityCases:
    """Cases every backend runs (through :class:`~kvcache_core.testing.KvCacheConformance`)."""

    # -- reliability -----------------------------------------------------------------------

    def test_a_storage_failure_at_any_call_leaks_nothing_and_corrupts_no_request(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        report = run_fault_injection(kvcache_backend)
        assert report.injections == 2 * len(report.storage_calls)
        report.check(kvcache_backend.claims)

    def test_soak_threads_mix_every_policy_without_a_mismatch_or_a_leak(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        report = run_soak(kvcache_backend, threads=4, operations=150)
        assert report.errors == []
        assert report.mismatches == []
        assert report.leaked_blocks == 0
        assert report.operations.get("verify", 0) > 0

    def test_the_default_layout_resolves_to_the_backends_preferred_one(self, kvcache_backend: BackendUnderTest) -> None:
        spec = kvcache_backend.spec
        assert spec.default_layout in spec.kv_layouts
        config = kvcache_backend.config(kv_layout=None)
        with kvcache_backend.manager(config) as manager:
            resolved = manager.config
            assert resolved.kv_layout == spec.default_layout, (
                f"kv_layout=None resolved to {resolved.kv_layout!r}, the backend declares {spec.default_layout!r}"
            )
            assert resolved == config.with_layout(spec.default_layout), "resolving changed more than the layout"
            for layer in range(resolved.num_layers):
                shape, _ = manager.storage.array_info(manager.storage.key_cache(layer))
                assert tuple(shape) == resolved.block_shape(), f"layer {layer}: pool shape {tuple(shape)}"
            handle = manager.allocate(AllocationRequest("a"))
            keys, values = kv_pair(manager, 19, 1.0)
            slots = manager.extend(handle, 19)
            for layer in range(resolved.num_layers):
                manager.write(layer, slots, keys, values)
                got_keys, got_values = manager.gather(handle, layer)
                np.testing.assert_array_equal(
                    kvcache_backend.host(manager, got_keys), kvcache_backend.host(manager, keys)
                )
                np.testing.assert_array_equal(
                    kvcache_backend.host(manager, got_values), kvcache_backend.host(manager, values)
                )

    def test_page_tables_are_read_only_and_range_checked(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        handle = manager.allocate(AllocationRequest("a"))
        manager.extend(handle, 5)
        table = manager.page_table([handle])
        for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "block_tables", "seq_lens"):
            array = getattr(table, name)
            assert not array.flags.writeable, f"PageTable.{name} is writeable"
            with pytest.raises(ValueError, match="WRITEABLE"):
                array.setflags(write=True)
        with pytest.raises(InvalidArgumentError, match=str(2**32)):
            type(table)(
                table.kv_indptr,
                table.kv_indices,
                table.kv_last_page_len,
                table.block_tables,
                np.array([2**32]),
                table.block_size,
            )

    @pytest.mark.kvcache_requires("swap")
    def test_a_page_table_taken_before_a_swap_is_refused(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        first, second = (manager.allocate(AllocationRequest(rid)) for rid in ("a", "b"))
        for handle in (first, second):
            slots = manager.extend(handle, 4)
            for layer in range(manager.config.num_layers):
                manager.write(layer, slots, *kv_pair(manager, 4, 1.0))
        table = manager.page_table([first, second])
        query = decode_like(manager, 2)
        manager.swap_out("a")
        with pytest.raises(SwappedOutError, match="'a'"):
            manager.paged_attention(0, query, table)
        manager.swap_in("a")  # new blocks: the old table must not read them, nor others'
        with pytest.raises(StalePageTableError, match="'a'"):
            manager.paged_attention(0, query, table)
        manager.paged_attention(0, query, manager.page_table([first, second]))

    def test_a_page_table_of_a_released_request_never_reads_its_successor(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        manager = kvcache_backend.manager(kvcache_backend.config(num_blocks=4))
        old = manager.allocate(AllocationRequest("old", initial_tokens=16))
        slots = manager.extend(old, 16)
        for layer in range(manager.config.num_layers):
            manager.write(layer, slots, *kv_pair(manager, 16, 1.0))
        table = manager.page_table([old])
        manager.deallocate("old")
        new = manager.allocate(AllocationRequest("new", initial_tokens=16))  # takes the same blocks
        assert set(new.block_table().physical_blocks) == set(table.kv_indices.tolist())
        with pytest.raises(StalePageTableError, match="'old', released since"):
            manager.paged_attention(0, decode_like(manager, 1), table)

    def test_counts_and_positions_take_numpy_integers(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        handle = manager.allocate(AllocationRequest("a"))
        slots = manager.extend(handle, untyped(np.int64(3)))
        assert handle.num_tokens() == 3
        rewritten = manager.writable_slots(handle, untyped(np.int64(0)), untyped(np.int64(2)))
        assert rewritten.tolist() == slots[:2].tolist()
        with pytest.raises(InvalidArgumentError, match="True"):
            manager.extend(handle, True)

    @pytest.mark.kvcache_requires("prefix_caching")
    def test_a_rewritten_cached_block_is_never_served_to_a_later_request(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        manager = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True))
        block_size, layers = manager.config.block_size, manager.config.num_layers
        prompt = tuple(range(1, 2 * block_size + 2))  # two full blocks and one token

        def first_block(handle: KvCacheHandle[Any]) -> FloatArray:
            return BackendUnderTest.host(manager, manager.gather(handle, 0)[0])[:block_size]

        def rewrite_first_block(handle: KvCacheHandle[Any]) -> None:
            slots = manager.writable_slots(handle, 0, block_size)
            for layer in range(layers):
                manager.write(layer, slots, *kv_pair(manager, block_size, 666.0))

        writer = manager.allocate(AllocationRequest("a", prompt_token_ids=prompt))
        slots = manager.extend(writer, len(prompt), token_ids=prompt)
        for layer in range(layers):
            manager.write(layer, slots, *kv_pair(manager, len(prompt), 1.0))
        original = first_block(writer)
        # A plain write into a cached block is refused: it is immutable.
        with pytest.raises(SharedBlockWriteError, match="prefix cache"):
            manager.write(0, slots[:1], *kv_pair(manager, 1, 666.0))
        # Shared with a request that hit it: the rewrite copies; the cache keeps the original.
        sharer = manager.allocate(AllocationRequest("b", prompt_token_ids=prompt))
        assert sharer.num_cached_tokens() == 2 * block_size
        rewrite_first_block(writer)
        manager.deallocate("a")
        hit = manager.allocate(AllocationRequest("c", prompt_token_ids=prompt))
        assert hit.num_cached_tokens() == 2 * block_size
        np.testing.assert_array_equal(first_block(hit), original)
        manager.deallocate("b")
        manager.deallocate("c")
        # Held alone: the rewrite takes the block out of the cache before handing out slots.
        alone = manager.allocate(AllocationRequest("d", prompt_token_ids=prompt))
        assert alone.num_cached_tokens() == 2 * block_size
        rewrite_first_block(alone)
        manager.check_invariants()
        manager.deallocate("d")
        later = manager.allocate(AllocationRequest("e", prompt_token_ids=prompt))
        assert later.num_cached_tokens() == 0, "a block rewritten in place was served from the prefix cache"
        manager.check_invariants()

    # -- the step --------------------------------------------------------------------------

    def test_a_step_writes_and_attends_exactly_as_the_raw_calls(self, kvcache_backend: BackendUnderTest) -> None:
        managers = (kvcache_backend.manager(), kvcache_backend.manager())
        config = managers[0].config
        heads, dim = config.num_heads, config.head_dim
        rng = np.random.default_rng(11)
        handles = [[m.allocate(AllocationRequest(rid)) for rid in ("a", "b", "c")] for m in managers]
        rtol, atol = TOLERANCES.get(config.dtype, (1e-2, 1e-2))
        for new_tokens in ([5, 3, 7], [1, 1, 1], [0, 2, 1]):
            total = sum(new_tokens)
            data = [
                [
                    BackendUnderTest.representable(rng.standard_normal((total, heads, dim)), config.dtype)
                    for _ in range(3)
                ]
                for _ in range(config.num_layers)
            ]
            step = managers[0].begin_step(handles[0], new_tokens)
            raw = managers[1]
            slots = np.concatenate([raw.extend(h, n) for h, n in zip(handles[1], new_tokens, strict=True)])
            assert step.slots.tolist() == slots.tolist()
            assert step.qo_indptr.tolist() == np.concatenate(([0], np.cumsum(new_tokens))).tolist()
            table = raw.page_table(handles[1])
            for layer, (keys, values, query) in enumerate(data):
                step.write(
                    layer, BackendUnderTest.native(managers[0], keys), BackendUnderTest.native(managers[0], values)
                )
                raw.write(layer, slots, BackendUnderTest.native(raw, keys), BackendUnderTest.native(raw, values))
                got = step.attention(layer, BackendUnderTest.native(managers[0], query))
                want = raw.paged_attention(layer, BackendUnderTest.native(raw, query), table, qo_indptr=step.qo_indptr)
                np.testing.assert_allclose(
                    BackendUnderTest.host(managers[0], got), BackendUnderTest.host(raw, want), rtol=rtol, atol=atol
                )
        for first, second in zip(handles[0], handles[1], strict=True):
            for layer in range(config.num_layers):
                np.testing.assert_array_equal(
                    BackendUnderTest.host(managers[0], managers[0].gather(first, layer)[0]),
                    BackendUnderTest.host(managers[1], managers[1].gather(second, layer)[0]),
                )

    def test_a_step_is_refused_once_a_request_changed_and_the_refusal_changes_nothing(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        config = kvcache_backend.config()
        changes: dict[str, RequestChange] = {
            "released": lambda m, h: m.deallocate("a"),
            "extended": lambda m, h: m.extend(h[0], 1),
            "truncated": lambda m, h: m.truncate(h[0], 1),
            "planned again": lambda m, h: m.begin_step([h[0]], 1),
        }
        if kvcache_backend.claims("fork"):
            changes["forked"] = lambda m, h: m.fork(h[0], "child")
        if kvcache_backend.claims("swap"):
            changes["swapped out"] = lambda m, h: m.swap_out("a")
        for what, change in changes.items():
            manager = kvcache_backend.manager(config)
            handles = [manager.allocate(AllocationRequest(rid)) for rid in ("a", "b")]
            step = manager.begin_step(handles, [3, 2])
            keys, values = kv_pair(manager, 5, 1.0)
            step.write(0, keys, values)
            change(manager, handles)
            before = snapshot(manager)
            with pytest.raises(StaleStepError, match="'a'") as refusal:
                step.write(1, keys, values)
            assert refusal.value.args, f"no message after the request was {what}"
            with pytest.raises(StaleStepError, match="'a'"):
                step.attention(0, decode_like(manager, 5))
            assert_same_state(snapshot(manager), before)  # a refused step changes nothing, whatever changed

    def test_a_step_refuses_bad_arrays_and_bad_plans_without_changing_anything(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        manager = kvcache_backend.manager(kvcache_backend.config(num_blocks=4))
        handles = [manager.allocate(AllocationRequest(rid)) for rid in ("a", "b")]
        before = snapshot(manager)
        with pytest.raises(InvalidArgumentError, match="'a' is listed twice"):
            manager.begin_step([handles[0], handles[0]], 1)
        with pytest.raises(InvalidArgumentError, match="2 counts for 1 requests"):
            manager.begin_step([handles[0]], [1, 1])
        with pytest.raises(InvalidArgumentError, match=r"new_tokens\[1\]"):
            manager.begin_step(handles, [1, -1])
        with pytest.raises(OutOfBlocksError, match="2 requests"):  # the second cannot grow: neither does
            manager.begin_step(handles, [8, 9])
        assert_same_state(snapshot(manager), before)
        step = manager.begin_step(handles, [2, 1])
        planned = snapshot(manager)
        keys, values = kv_pair(manager, 3, 1.0)
        with pytest.raises(LayerIndexError):
            step.write(manager.config.num_layers, keys, values)
        with pytest.raises(ShapeMismatchError):
            step.write(0, *kv_pair(manager, 2, 1.0))
        with pytest.raises(ShapeMismatchError, match="the step added 3"):
            step.attention(0, decode_like(manager, 2))
        assert_same_state(snapshot(manager), planned)

    @pytest.mark.kvcache_requires("prefix_caching")
    def test_a_step_with_token_ids_makes_its_blocks_cacheable(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True))
        block_size = manager.config.block_size
        prompt = tuple(range(7, 7 + 3 * block_size))
        first = manager.allocate(AllocationRequest("a", prompt_token_ids=prompt))
        step = manager.begin_step([first], [len(prompt)], token_ids=[prompt])
        for layer in range(manager.config.num_layers):
            step.write(layer, *kv_pair(manager, len(prompt), 1.0))
        second = manager.allocate(AllocationRequest("b", prompt_token_ids=prompt))
        assert second.num_cached_tokens() == 2 * block_size  # the last prompt token is always computed
        manager.check_invariants()

    @pytest.mark.kvcache_requires("prefix_caching")
    def test_a_step_never_writes_into_a_block_another_request_maps(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True))
        block_size, layers = manager.config.block_size, manager.config.num_layers
        prompt = tuple(range(1, 2 * block_size + 2))  # two full blocks, cached once written, and one token
        writer = manager.allocate(AllocationRequest("a", prompt_token_ids=prompt))
        step = manager.begin_step([writer], [len(prompt)], token_ids=[prompt])
        for layer in range(layers):
            step.write(layer, *kv_pair(manager, len(prompt), 1.0))
        reader = manager.allocate(AllocationRequest("b", prompt_token_ids=prompt))
        assert reader.num_cached_tokens() == 2 * block_size
        seen = BackendUnderTest.host(manager, manager.gather(reader, 0)[0])
        before = snapshot(manager)
        with pytest.raises(SharedBlockWriteError, match="shared by 2 requests"):
            step.write(0, *kv_pair(manager, len(prompt), 666.0))
        assert_same_state(snapshot(manager), before)
        np.testing.assert_array_equal(BackendUnderTest.host(manager, manager.gather(reader, 0)[0]), seen)
        manager.check_invariants()

    @pytest.mark.kvcache_requires("prefix_caching")
    def test_a_step_never_rewrites_a_block_the_prefix_cache_serves(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True))
        block_size, layers = manager.config.block_size, manager.config.num_layers
        prompt = tuple(range(1, 2 * block_size + 2))
        writer = manager.allocate(AllocationRequest("a", prompt_token_ids=prompt))
        step = manager.begin_step([writer], [len(prompt)], token_ids=[prompt])
        for layer in range(layers):
            step.write(layer, *kv_pair(manager, len(prompt), 1.0))  # the last layer registers the full blocks
        kept = BackendUnderTest.host(manager, manager.gather(writer, 0)[0])
        before = snapshot(manager)
        with pytest.raises(SharedBlockWriteError, match="prefix cache"):
            step.write(0, *kv_pair(manager, len(prompt), 666.0))
        assert_same_state(snapshot(manager), before)
        manager.deallocate("a")  # the blocks stay cached, held by nobody
        hit = manager.allocate(AllocationRequest("c", prompt_token_ids=prompt))
        assert hit.num_cached_tokens() == 2 * block_size
        np.testing.assert_array_equal(BackendUnderTest.host(manager, manager.gather(hit, 0)[0]), kept[: 2 * block_size])
        manager.check_invariants()

    def test_truncate_frees_the_blocks_past_the_end_and_keeps_the_rest(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        block_size = manager.config.block_size
        handle = manager.allocate(AllocationRequest("a"))
        slots = manager.extend(handle, 3 * block_size)
        for layer in range(manager.config.num_layers):
            manager.write(layer, slots, *kv_pair(manager, 3 * block_size, 1.0))
        kept = BackendUnderTest.host(manager, manager.gather(handle, 1)[0])[: block_size + 1]
        table = manager.page_table([handle])
        used = manager.stats().used_blocks
        manager.truncate(handle, block_size + 1)
        assert handle.num_tokens() == block_size + 1
        assert manager.stats().used_blocks == used - 1
        np.testing.assert_array_equal(BackendUnderTest.host(manager, manager.gather(handle, 1)[0]), kept)
        with pytest.raises(StalePageTableError):
            manager.paged_attention(0, decode_like(manager, 1), table)
        with pytest.raises(InvalidArgumentError, match="outside"):
            manager.truncate(handle, block_size + 2)
        again = manager.extend(handle, 2)  # the cut block is written again from its new end
        assert again.tolist() == slots[block_size + 1 : block_size + 3].tolist()
        manager.check_invariants()
        manager.deallocate("a")
        assert manager.stats().used_blocks == 0

    @pytest.mark.kvcache_requires("prefix_caching")
    @pytest.mark.kvcache_requires("fork")
    def test_a_cached_block_truncated_into_while_shared_leaves_the_cache_before_it_is_written(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        manager = kvcache_backend.manager(kvcache_backend.config(enable_prefix_caching=True))
        block_size, layers = manager.config.block_size, manager.config.num_layers
        prompt = tuple(range(1, 3 * block_size + 1))  # three full blocks, all cached once written
        parent = manager.allocate(AllocationRequest("a", prompt_token_ids=prompt))
        step = manager.begin_step([parent], [len(prompt)], token_ids=[prompt])
        for layer in range(layers):
            step.write(layer, *kv_pair(manager, len(prompt), 1.0))
        child = manager.fork(parent, "b")
        manager.truncate(parent, 2 * block_size + 1)  # into the third block, which the child shares
        rewrite = manager.writable_slots(child, 2 * block_size, 3 * block_size)  # the child copies it away
        for layer in range(layers):
            manager.write(layer, rewrite, *kv_pair(manager, block_size, 5.0))
        grow = manager.begin_step([parent], [2])  # into the block the cache still lists
        for layer in range(layers):
            grow.write(layer, *kv_pair(manager, 2, 9.0))
        manager.check_invariants()
        manager.deallocate("a")
        manager.deallocate("b")
        later = manager.allocate(AllocationRequest("c", prompt_token_ids=(*prompt, 99)))
        assert later.num_cached_tokens() <= 2 * block_size, "a block written after truncation was served"
        manager.check_invariants()

    def test_a_closed_manager_refuses_every_method_but_close_and_its_figures(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        manager = kvcache_backend.manager()
        handle = manager.allocate(AllocationRequest("a", initial_tokens=3))
        step = manager.begin_step([handle], 1)
        manager.subscribe(lambda event: None)
        manager.set_pressure_callback(lambda level: None)
        manager.close()
        accepted = [
            *not_refused_when_closed("manager", manager, CLOSED_MANAGER_ANSWERS),
            *not_refused_when_closed("step", step, frozenset()),
            *not_refused_when_closed("handle", handle, HANDLE_READS),
        ]
        assert not accepted, "a closed manager must refuse these first:\n" + "\n".join(accepted)
        with pytest.raises(ManagerClosedError):
            manager.__enter__()
        manager.__exit__(None, None, None)  # closing again is a no-op
        assert manager.stats().used_blocks == 1
        assert manager.closed
        assert not handle.is_valid()

    def test_a_step_is_refused_once_its_manager_is_closed(self, kvcache_backend: BackendUnderTest) -> None:
        manager = kvcache_backend.manager()
        handle = manager.allocate(AllocationRequest("a"))
        step = manager.begin_step([handle], 2)
        keys, values = kv_pair(manager, 2, 1.0)
        step.write(0, keys, values)
        manager.close()
        with pytest.raises(ManagerClosedError):
            step.write(1, keys, values)
        with pytest.raises(ManagerClosedError):
            step.attention(0, decode_like(manager, 2))
        with pytest.raises(ManagerClosedError):
            manager.begin_step([handle], 1)
