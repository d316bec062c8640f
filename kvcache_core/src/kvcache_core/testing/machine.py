"""A Hypothesis state machine driving the backend under test and the NumPy reference in lockstep.

Both managers get the same configuration and placement, so every operation must give
the same outcome on both: the same slots, the same block tables, the same error class,
the same K/V bit for bit (values are drawn representable in the pool's dtype), and
attention within the dtype's tolerance. After every step both managers' invariants are
checked and the backend's figures are compared with the reference's.

The policies run where the backend claims them (``BackendSpec.capabilities``): ``fork``
(copy-on-write; rewrites go through ``writable_slots``), ``prefix_caching`` (requests
with prompts drawn from a few shared prefixes, token ids on every ``extend``),
``swap`` (``swap_out`` / ``swap_in``), ``eviction`` (exhausting a pool that holds cached
blocks) and ``sliding_window`` (a run with a window, and a hybrid run: one full and one
sliding layer, two KV-cache groups, every other claimed policy on).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import seed
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.device import Device
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.discovery import create_manager
from kvcache_core.errors import KvCacheError, OutOfBlocksError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing._plugin import KitSettings
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest

__all__ = ["POLICIES", "ReferenceMachine", "run_config_machine", "run_policy_machine", "run_reference_machine"]

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]

#: Dtypes the NumPy reference holds; others are compared through a float32 reference.
_REFERENCE_DTYPES = ("float16", "float32", "float64")


def _allocate(manager: Manager, request: AllocationRequest) -> Handle:
    return manager.allocate(request)


def _deallocate(manager: Manager, request_id: str) -> None:
    manager.deallocate(request_id)


def _writable_slots(manager: Manager, handle: Handle, start: int, stop: int) -> Any:
    return manager.writable_slots(handle, start, stop)


def _outcome(operation: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", operation()
    except KvCacheError as exc:
        return "error", type(exc).__name__


class ReferenceMachine(RuleBasedStateMachine):
    """The backend under test against the NumPy reference; see the module docstring."""

    backend: BackendUnderTest
    config: CacheConfig
    policies: frozenset[str] = frozenset()

    def __init__(self) -> None:
        super().__init__()
        self.subject: Manager = self.backend.manager(self.config)
        reference_dtype = self.config.dtype if self.config.dtype in _REFERENCE_DTYPES else "float32"
        self.reference: Manager = create_manager(
            "numpy", dataclasses.replace(self.config, dtype=reference_dtype, device=Device.parse("cpu"))
        )
        self.handles: dict[str, tuple[Handle, Handle]] = {}
        self.clones: list[tuple[str, Handle]] = []
        self.counter = 0

    # -- helpers ---------------------------------------------------------------------------

    def both(self, operation: Callable[[Manager], Any], what: str) -> tuple[str, Any]:
        """Run ``operation`` on both managers; fail unless the outcomes agree."""
        got = _outcome(lambda: operation(self.subject))
        want = _outcome(lambda: operation(self.reference))
        if got[0] != want[0] or (got[0] == "error" and got[1] != want[1]):
            raise AssertionError(f"{what}: backend {self.backend.name!r} gave {got}, the NumPy reference {want}")
        return got

    def both_on(
        self, pair: tuple[Handle, Handle], operation: Callable[[Manager, Handle], Any], what: str
    ) -> tuple[str, Any]:
        """Run ``operation`` on each manager with its own handle of one request."""
        got = _outcome(lambda: operation(self.subject, pair[0]))
        want = _outcome(lambda: operation(self.reference, pair[1]))
        if got[0] != want[0] or (got[0] == "error" and got[1] != want[1]):
            raise AssertionError(f"{what}: backend {self.backend.name!r} gave {got}, the NumPy reference {want}")
        return got

    def pick(self, index: int) -> tuple[str, Handle, Handle]:
        request_id = sorted(self.handles)[index % len(self.handles)]
        subject, reference = self.handles[request_id]
        return request_id, subject, reference

    # -- rules -----------------------------------------------------------------------------

    @rule(
        initial=st.integers(0, 14),
        limit=st.one_of(st.none(), st.integers(1, 40)),
    )
    def allocate(self, initial: int, limit: int | None) -> None:
        request_id = f"r{self.counter}"
        self.counter += 1
        if limit is not None:
            limit = max(limit, initial) or 1

        def run(manager: Manager) -> Any:
            return manager.allocate(AllocationRequest(request_id, initial_tokens=initial, max_sequence_length=limit))

        kind, _ = self.both(run, f"allocate({request_id!r}, initial_tokens={initial}, max={limit})")
        if kind == "ok":
            subject = self.subject.get_handle(request_id)
            reference = self.reference.get_handle(request_id)
            assert subject is not None
            assert reference is not None
            assert subject.block_table() == reference.block_table(), f"allocate({request_id!r}): tables differ"
            self.handles[request_id] = (subject, reference)

    def token_ids(self, count: int, seed: int) -> list[int] | None:
        """Ids for ``count`` new tokens when prefix caching is on (a small vocabulary)."""
        if not self.config.enable_prefix_caching:
            return None
        return [int(token) for token in np.random.default_rng(seed).integers(0, 3, count)]

    def kv_shapes(self, layer: int, count: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The shapes of ``count`` tokens' keys and values in ``layer`` (its own geometry)."""
        shape = self.config.layer_geometry(layer)
        return (count, shape.num_heads, shape.head_dim), (count, shape.num_heads, shape.value_width)

    @precondition(lambda self: bool(self.handles))
    @rule(index=st.integers(0, 1 << 16), count=st.integers(0, 9), seed=st.integers(0, 2**16))
    def extend(self, index: int, count: int, seed: int) -> None:
        request_id, subject, reference = self.pick(index)
        ids = self.token_ids(count, seed)
        got = _outcome(lambda: self.subject.extend(subject, count, token_ids=ids))
        want = _outcome(lambda: self.reference.extend(reference, count, token_ids=ids))
        assert got[0] == want[0], f"extend({request_id!r}, {count}): backend {got}, reference {want}"
        if got[0] == "error":
            assert got[1] == want[1], f"extend({request_id!r}, {count}): backend {got}, reference {want}"
            return
        assert np.array_equal(got[1], want[1]), f"extend({request_id!r}, {count}): slots differ"
        # As in a model's step, the new tokens' K/V are written in every layer.
        rng = np.random.default_rng(seed)
        for layer in range(self.config.num_layers):
            shape, value_shape = self.kv_shapes(layer, count)
            keys = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
            values = BackendUnderTest.representable(rng.standard_normal(value_shape), self.config.dtype)
            for manager in (self.subject, self.reference):
                manager.write(
                    layer, got[1], BackendUnderTest.native(manager, keys), BackendUnderTest.native(manager, values)
                )

    @precondition(lambda self: any(s.num_tokens() for s, _ in self.handles.values()))
    @rule(
        first=st.integers(0, 1 << 16),
        second=st.integers(0, 1 << 16),
        layer=st.integers(0, 1),
        seed=st.integers(0, 2**32 - 1),
    )
    def write(self, first: int, second: int, layer: int, seed: int) -> None:
        """One batched write: a window of one request's tokens plus a window of another's."""
        rng = np.random.default_rng(seed)
        slots: list[np.ndarray[Any, Any]] = []
        for chosen in sorted({self.pick(first)[0], self.pick(second)[0]}):
            subject, reference = self.handles[chosen]
            if subject.is_swapped_out():
                continue
            tables = subject.block_tables()
            low = max(table.first_logical for table in tables) * self.config.block_size
            tokens = tables[0].sequence_length
            if tokens <= low:
                continue
            start = int(rng.integers(low, tokens))
            stop = int(rng.integers(start + 1, tokens + 1))
            # Shared blocks (fork, prefix hits) are copied before they are rewritten.
            kind, got = self.both_on(
                (subject, reference),
                functools.partial(_writable_slots, start=start, stop=stop),
                f"writable_slots({chosen!r}, {start}, {stop})",
            )
            if kind == "error":
                continue
            slots.append(got)
        if not slots:
            return
        slot_array = np.concatenate(slots, axis=-1)  # [n], or [groups, n] with KV-cache groups
        layer %= self.config.num_layers
        shape, value_shape = self.kv_shapes(layer, slot_array.shape[-1])
        keys = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
        values = BackendUnderTest.representable(rng.standard_normal(value_shape), self.config.dtype)
        self.subject.write(
            layer,
            slot_array,
            BackendUnderTest.native(self.subject, keys),
            BackendUnderTest.native(self.subject, values),
        )
        self.reference.write(
            layer,
            slot_array,
            BackendUnderTest.native(self.reference, keys),
            BackendUnderTest.native(self.reference, values),
        )

    @precondition(lambda self: bool(self.handles))
    @rule(
        picks=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=3),
        counts=st.lists(st.integers(0, 4), min_size=3, max_size=3),
        seed=st.integers(0, 2**32 - 1),
    )
    def step(self, picks: list[int], counts: list[int], seed: int) -> None:
        """A forward step over a few requests: plan, then write and attend every layer."""
        chosen = sorted({self.pick(index)[0] for index in picks})
        new_tokens = counts[: len(chosen)]
        ids = [self.token_ids(count, seed + offset) for offset, count in enumerate(new_tokens)]
        pairs = [self.handles[request_id] for request_id in chosen]
        token_ids = ids if self.config.enable_prefix_caching else None
        got = _outcome(lambda: self.subject.begin_step([s for s, _ in pairs], new_tokens, token_ids=token_ids))
        want = _outcome(lambda: self.reference.begin_step([r for _, r in pairs], new_tokens, token_ids=token_ids))
        what = f"begin_step({chosen}, {new_tokens})"
        assert got[0] == want[0], f"{what}: backend {got}, reference {want}"
        if got[0] == "error":
            assert got[1] == want[1], f"{what}: backend {got}, reference {want}"
            return
        steps = (got[1], want[1])
        assert np.array_equal(steps[0].slots, steps[1].slots), f"{what}: slots differ"
        rng = np.random.default_rng(seed)
        total = steps[0].num_new_tokens
        rtol, atol = TOLERANCES.get(self.config.dtype, (1e-2, 1e-2))
        for layer in range(self.config.num_layers):
            shape, value_shape = self.kv_shapes(layer, total)
            keys = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
            values = BackendUnderTest.representable(rng.standard_normal(value_shape), self.config.dtype)
            query = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
            outputs: list[npt.NDArray[np.float64]] = []
            for manager, planned in zip((self.subject, self.reference), steps, strict=True):
                planned.write(layer, BackendUnderTest.native(manager, keys), BackendUnderTest.native(manager, values))
                if total:
                    out = planned.attention(layer, BackendUnderTest.native(manager, query))
                    outputs.append(BackendUnderTest.host(manager, out))
            if total:
                assert np.allclose(outputs[0], outputs[1], rtol=rtol, atol=atol), (
                    f"{what}: step attention of layer {layer} differs from the reference by up to "
                    f"{float(np.max(np.abs(outputs[0] - outputs[1]))):.3g}"
                )

    @precondition(lambda self: any(s.num_tokens() for s, _ in self.handles.values()))
    @rule(index=st.integers(0, 1 << 16), cut=st.integers(0, 8))
    def truncate(self, index: int, cut: int) -> None:
        request_id, subject, reference = self.pick(index)
        length = max(0, subject.num_tokens() - cut)
        self.both_on(
            (subject, reference),
            lambda manager, handle: manager.truncate(handle, length),
            f"truncate({request_id!r}, {length})",
        )

    @precondition(lambda self: bool(self.handles))
    @rule(index=st.integers(0, 1 << 16))
    def clone(self, index: int) -> None:
        request_id, subject, _ = self.pick(index)
        clone = subject.clone_handle()
        assert clone.cache_id() == subject.cache_id()
        assert clone.num_tokens() == subject.num_tokens()
        self.clones.append((request_id, clone))

    @precondition(lambda self: "prefix_caching" in self.policies)
    @rule(prefix=st.integers(0, 2), shared=st.integers(0, 14), suffix=st.integers(0, 6), seed=st.integers(0, 2**16))
    def allocate_with_prompt(self, prefix: int, shared: int, suffix: int, seed: int) -> None:
        """A request whose prompt starts with one of three shared prefixes; the part not
        cached is computed (extended with its ids and written in every layer)."""
        prompt = [(prefix + position) % 3 for position in range(shared)] + (self.token_ids(suffix, seed) or [])
        if not prompt:
            return
        request_id = f"p{self.counter}"
        self.counter += 1
        request = AllocationRequest(request_id, initial_tokens=len(prompt), prompt_token_ids=tuple(prompt))
        kind, _ = self.both(functools.partial(_allocate, request=request), f"allocate({request_id!r}, prompt={prompt})")
        if kind == "error":
            return
        subject, reference = self.subject.get_handle(request_id), self.reference.get_handle(request_id)
        assert subject is not None
        assert reference is not None
        self.handles[request_id] = (subject, reference)
        cached = subject.num_tokens()
        assert cached == reference.num_tokens(), f"{request_id!r}: {cached} cached tokens, the reference has "
        rest = prompt[cached:]
        got = _outcome(lambda: self.subject.extend(subject, len(rest), token_ids=rest))
        want = _outcome(lambda: self.reference.extend(reference, len(rest), token_ids=rest))
        assert got[0] == want[0], f"extend({request_id!r}) for its prompt: backend {got}, reference {want}"
        if got[0] == "error":
            return
        assert np.array_equal(got[1], want[1]), f"extend({request_id!r}) for its prompt: slots differ"
        rng = np.random.default_rng(seed)
        for layer in range(self.config.num_layers):
            shape, value_shape = self.kv_shapes(layer, len(rest))
            keys = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
            values = keys  # a pool of two widths draws its values apart
            if value_shape != shape:
                values = BackendUnderTest.representable(rng.standard_normal(value_shape), self.config.dtype)
            for manager, slots in ((self.subject, got[1]), (self.reference, want[1])):
                native = BackendUnderTest.native(manager, keys)
                manager.write(layer, slots, native, BackendUnderTest.native(manager, values))

    @precondition(lambda self: "fork" in self.policies and bool(self.handles))
    @rule(index=st.integers(0, 1 << 16))
    def fork(self, index: int) -> None:
        parent_id, subject, reference = self.pick(index)
        child_id = f"f{self.counter}"
        self.counter += 1
        kind, _ = self.both_on(
            (subject, reference),
            lambda manager, handle: manager.fork(handle, child_id),
            f"fork({parent_id!r}, {child_id!r})",
        )
        if kind == "ok":
            child_subject, child_reference = self.subject.get_handle(child_id), self.reference.get_handle(child_id)
            assert child_subject is not None
            assert child_reference is not None
            self.handles[child_id] = (child_subject, child_reference)

    @precondition(lambda self: "swap" in self.policies and bool(self.handles))
    @rule(index=st.integers(0, 1 << 16))
    def swap(self, index: int) -> None:
        """Swap the request out, or back in when it is out."""
        request_id, subject, _ = self.pick(index)
        if subject.is_swapped_out():
            self.both(lambda manager: manager.swap_in(request_id), f"swap_in({request_id!r})")
        else:
            self.both(lambda manager: manager.swap_out(request_id), f"swap_out({request_id!r})")

    @precondition(lambda self: bool(self.handles))
    @rule(index=st.integers(0, 1 << 16))
    def deallocate(self, index: int) -> None:
        request_id, _, _ = self.pick(index)
        self.both(lambda manager: manager.deallocate(request_id), f"deallocate({request_id!r})")
        del self.handles[request_id]

    @rule(request_id=st.sampled_from(["nope", "r0"]))
    def deallocate_unknown_or_again(self, request_id: str) -> None:
        if request_id in self.handles:
            return
        self.both(lambda manager: manager.deallocate(request_id), f"deallocate({request_id!r})")

    @rule(tokens=st.integers(1, 64))
    def exhaust(self, tokens: int) -> None:
        """Fill the pool with requests of ``tokens`` until both refuse, then free them."""
        created: list[str] = []
        while True:
            request_id = f"x{self.counter}"
            self.counter += 1
            kind, error = self.both(
                functools.partial(_allocate, request=AllocationRequest(request_id, initial_tokens=tokens)),
                f"allocate({request_id!r}, initial_tokens={tokens}) while exhausting",
            )
            if kind == "error":
                assert error == OutOfBlocksError.__name__, error
                break
            created.append(request_id)
        for request_id in created:
            self.both(functools.partial(_deallocate, request_id=request_id), f"deallocate({request_id!r})")

    @precondition(lambda self: any(s.num_tokens() for s, _ in self.handles.values()))
    @rule(group=st.sampled_from([1, 2]), seed=st.integers(0, 2**32 - 1))
    def attention(self, group: int, seed: int) -> None:
        """Decode attention of every resident request holding tokens, compared with the reference."""
        live = [pair for pair in self.handles.values() if pair[0].num_tokens() and not pair[0].is_swapped_out()]
        if not live:
            return
        rng = np.random.default_rng(seed)
        shape = (len(live), self.config.num_heads * group, self.config.head_dim)
        layer = int(rng.integers(0, self.config.num_layers))
        own = self.config.layer_geometry(layer)
        if self.config.mixed_geometry:  # the layer's own heads and width (the draws above unchanged)
            shape = (len(live), own.num_heads * group, own.head_dim)
        query = BackendUnderTest.representable(rng.standard_normal(shape), self.config.dtype)
        kv_group = self.config.layer_place(layer)[0]
        got = self.subject.paged_attention(
            layer,
            BackendUnderTest.native(self.subject, query),
            self.subject.page_table([s for s, _ in live], group=kv_group),
        )
        want = self.reference.paged_attention(
            layer,
            BackendUnderTest.native(self.reference, query),
            self.reference.page_table([r for _, r in live], group=kv_group),
        )
        rtol, atol = TOLERANCES.get(self.config.dtype, (1e-2, 1e-2))
        got_host, want_host = BackendUnderTest.host(self.subject, got), BackendUnderTest.host(self.reference, want)
        assert np.allclose(got_host, want_host, rtol=rtol, atol=atol), (
            f"attention of layer {layer}: backend {self.backend.name!r} differs from the reference by up to "
            f"{float(np.max(np.abs(got_host - want_host))):.3g}"
        )

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def same_state(self) -> None:
        self.subject.check_invariants()
        self.reference.check_invariants()
        subject_stats = dataclasses.asdict(self.subject.stats())
        reference_stats = dataclasses.asdict(self.reference.stats())
        for figures in (subject_stats, reference_stats):  # bytes follow the dtype, which the reference may widen
            for name in (
                "total_memory_bytes",
                "used_memory_bytes",
                "group_bytes_per_token",
                "group_layer_bytes_per_token",
            ):
                figures.pop(name)
        assert subject_stats == reference_stats, f"stats differ: {subject_stats} vs {reference_stats}"
        assert [rid for rid, _ in self.subject.list_handles()] == [rid for rid, _ in self.reference.list_handles()]
        for request_id, (subject, reference) in self.handles.items():
            assert subject.block_tables() == reference.block_tables(), f"{request_id!r}: tables differ"
            assert subject.is_swapped_out() == reference.is_swapped_out(), f"{request_id!r}: swap state differs"
            if subject.is_swapped_out():
                continue
            for layer in range(self.config.num_layers):
                got = self.subject.gather(subject, layer)
                want = self.reference.gather(reference, layer)
                for name, native, expected in (("keys", got[0], want[0]), ("values", got[1], want[1])):
                    assert np.array_equal(
                        BackendUnderTest.host(self.subject, native), BackendUnderTest.host(self.reference, expected)
                    ), f"{request_id!r} layer {layer}: gathered {name} differ from the NumPy reference"
        for request_id, clone in self.clones:
            assert clone.is_valid() == (request_id in self.handles), f"clone of {request_id!r}: is_valid wrong"

    def teardown(self) -> None:
        for request_id in list(self.handles):
            self.subject.deallocate(request_id)
        stats = self.subject.stats()
        assert (stats.used_blocks, stats.active_caches) == (0, 0), (
            f"backend {self.backend.name!r} leaked blocks: {stats.used_blocks} in use after every request ended"
        )
        self.subject.check_invariants()


#: The policies the machine drives where a backend claims them.
POLICIES = frozenset({"fork", "prefix_caching", "swap", "eviction", "sliding_window"})


def _run(
    backend: BackendUnderTest, config: CacheConfig, policies: frozenset[str], name: str, settings: KitSettings
) -> None:
    machine = type(
        f"ReferenceMachine_{backend.name}_{name}",
        (ReferenceMachine,),
        {"backend": backend, "config": config, "policies": policies},
    )
    # The kit's seed, not a random one: the same bug gives the same failing steps every run.
    run_state_machine_as_test(seed(settings.seed)(machine), settings=settings.hypothesis())


def run_reference_machine(backend: BackendUnderTest, settings: KitSettings) -> None:
    """Run :class:`ReferenceMachine` for every layout of ``backend`` (default dtype)."""
    for layout in backend.kv_layouts:
        _run(backend, backend.config(kv_layout=layout, num_blocks=12), frozenset(), layout, settings)


def run_config_machine(backend: BackendUnderTest, config: CacheConfig, name: str, settings: KitSettings) -> None:
    """Run :class:`ReferenceMachine` on ``config`` (a geometry of another case's choosing)
    with every policy ``backend`` claims (prefix caching as ``config`` says)."""
    claimed = frozenset(backend.spec.capabilities) & POLICIES
    if not config.enable_prefix_caching:
        claimed -= {"prefix_caching"}
    _run(backend, config, claimed, name, settings)


def run_policy_machine(backend: BackendUnderTest, settings: KitSettings, *, window: bool, hybrid: bool = False) -> None:
    """Run :class:`ReferenceMachine` with every policy ``backend`` claims (prefix caching on
    where claimed), or, with ``window``, with a sliding window of 7 tokens, or, with
    ``hybrid``, with a full and a sliding layer (window 7: two KV-cache groups) and every
    claimed policy."""
    claimed = frozenset(backend.spec.capabilities) & POLICIES
    if hybrid:
        specs = (LayerSpec(), LayerSpec(window=7))
        config = backend.config(
            num_blocks=16, num_layers=2, layer_specs=specs, enable_prefix_caching="prefix_caching" in claimed
        )
        _run(backend, config, claimed, "hybrid", settings)
        return
    if window:
        config = backend.config(num_blocks=12, sliding_window=7)
        _run(backend, config, claimed - {"prefix_caching"}, "window", settings)
        return
    config = backend.config(num_blocks=12, enable_prefix_caching="prefix_caching" in claimed)
    _run(backend, config, claimed, "policies", settings)
