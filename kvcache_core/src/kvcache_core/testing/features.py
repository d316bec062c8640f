"""The kit's attention-feature cases: a layer's sliding window, logit softcapping,
attention sinks and chunked local attention (:mod:`kvcache_core.attention.features`),
alone and together, in decode, prefill, chunked prefill, ragged and non-causal batches,
through :meth:`~kvcache_core.PagedKvCacheManager.paged_attention` and
:meth:`~kvcache_core.Step.attention`, against a dense float64 reference.
:class:`~kvcache_core.testing.KvCacheConformance` inherits them; each runs where the
backend claims the capabilities it needs (``attention_window``, ``softcap``, ``sinks``,
``chunked_attention``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.attention.features import ATTENTION_CAPABILITIES, FEATURE_CAPABILITIES, storage_attention_features
from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.scalars import INT32_MAX
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    KvCacheError,
    ShapeMismatchError,
)
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest
from kvcache_core.testing.catalogue import BadCall, check_bad_call
from kvcache_core.testing.feature_catalogue import FEATURE_VALUE_CASES
from kvcache_core.testing.hybrid import run_step
from kvcache_core.testing.world import World, make_world, probe

__all__ = ["FeatureCases", "dense_feature_attention"]

FloatArray = npt.NDArray[np.float64]
Manager = PagedKvCacheManager[Any]


def dense_feature_attention(
    query: FloatArray,
    keys: FloatArray,
    values: FloatArray,
    *,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    sinks: FloatArray | None = None,
    chunk: int | None = None,
) -> FloatArray:
    """One request's attention in float64, written out from the definitions.

    Args:
        query: ``[q, query_heads, dim]``, the request's last ``q`` positions.
        keys, values: ``[n, kv_heads, dim]`` and ``[n, kv_heads, value_dim]``, positions
            ``0 .. n - 1``.
        scale, causal, window, softcap, sinks, chunk: as
            :mod:`kvcache_core.attention.features` defines them.

    Returns:
        ``[q, query_heads, value_dim]``.
    """
    num_queries, query_heads, _ = query.shape
    num_keys, kv_heads, _ = keys.shape
    group = query_heads // kv_heads
    output = np.zeros((num_queries, query_heads, values.shape[2]))
    for index in range(num_queries):
        position = num_keys - num_queries + index
        # The keys a query sees form one range [low, high): each feature narrows it.
        low, high = 0, num_keys
        if causal:
            high = position + 1
        if window is not None:
            low = max(low, position - window + 1)
        if chunk is not None:
            low = max(low, position // chunk * chunk)
            high = min(high, (position // chunk + 1) * chunk)
        for head in range(query_heads):
            scores = keys[:, head // group] @ query[index, head] * scale
            if softcap is not None:
                scores = np.tanh(scores / softcap) * softcap
            scores[:low] = -np.inf
            scores[high:] = -np.inf
            top = float(scores.max()) if sinks is None else max(float(scores.max()), float(sinks[head]))
            weights = np.exp(scores - top)
            denominator = weights.sum() + (0.0 if sinks is None else math.exp(float(sinks[head]) - top))
            output[index, head] = weights @ values[:, head // group] / denominator
    return output


class _Batch(NamedTuple):
    manager: Manager
    handles: list[PagedKvCacheHandle[Any]]
    keys: list[FloatArray]  # per request [n, kv_heads, dim], as the pool holds them
    values: list[FloatArray]


def _grown_batch(manager: Manager, lengths: tuple[int, ...], rng: np.random.Generator) -> _Batch:
    """Requests of ``lengths`` tokens grown side by side, 3 tokens at a time (so each holds
    several runs of blocks), every layer written."""
    config = manager.config
    handles = [manager.allocate(AllocationRequest(f"feature-{index}")) for index in range(len(lengths))]
    done = [0] * len(lengths)
    while done != list(lengths):
        for index, handle in enumerate(handles):
            step = min(3, lengths[index] - done[index])
            if not step:
                continue
            slots = manager.extend(handle, step)
            for layer in range(config.num_layers):
                host = rng.standard_normal((2, step, config.num_heads, config.head_dim))
                manager.write(
                    layer, slots, BackendUnderTest.native(manager, host[0]), BackendUnderTest.native(manager, host[1])
                )
            done[index] += step
    keys: list[FloatArray] = []
    values: list[FloatArray] = []
    for handle in handles:
        key, value = manager.gather(handle, config.num_layers - 1)
        keys.append(BackendUnderTest.host(manager, key))
        values.append(BackendUnderTest.host(manager, value))
    return _Batch(manager, handles, keys, values)


def _features(names: tuple[str, ...], query_heads: int, rng: np.random.Generator) -> dict[str, Any]:
    """Host values of the named features (sinks as float64, made native by the caller)."""
    chosen: dict[str, Any] = {}
    if "window" in names:
        chosen["window"] = 6
    if "softcap" in names:
        chosen["softcap"] = 1.5
    if "sinks" in names:
        chosen["sinks"] = rng.standard_normal(query_heads) * 2
    if "chunk" in names:
        chosen["chunk"] = 7  # not a multiple of the block size: chunks start inside blocks
    return chosen


def _capabilities(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(FEATURE_CAPABILITIES[name] for name in names)


#: Feature combinations the kit checks: each alone, and the mixes real models use.
COMBINATIONS: tuple[tuple[str, ...], ...] = (
    ("window",),
    ("softcap",),
    ("sinks",),
    ("chunk",),
    ("window", "softcap"),  # Gemma 2's sliding layers
    ("window", "sinks"),  # gpt-oss's sliding layers
    ("chunk", "softcap", "sinks"),
    ("window", "chunk"),
)

#: ``(query lengths per request or None for decode, causal)``; requests hold 5, 17, 30 tokens.
SCENARIOS: dict[str, tuple[tuple[int, ...] | None, bool]] = {
    "decode": (None, True),
    "prefill": ((5, 17, 30), True),
    "chunked-prefill-ragged": ((2, 9, 1), True),
    "non-causal": ((3, 1, 4), False),
}

#: Request lengths of the feature cases (ragged, over several blocks and runs).
LENGTHS = (5, 17, 30)


def _decode_query(manager: Manager, rng: np.random.Generator) -> tuple[Any, PageTable]:
    """A batch of ``LENGTHS`` grown by :func:`_grown_batch`, one native query row per request
    with two query heads per KV head ``[3, 2 * num_heads, head_dim]``, and the batch's page table."""
    batch = _grown_batch(manager, LENGTHS, rng)
    config = manager.config
    query = BackendUnderTest.native(manager, rng.standard_normal((3, 2 * config.num_heads, config.head_dim)))
    return query, manager.page_table(batch.handles)


def _feature_value_params() -> list[Any]:
    return [
        pytest.param(case, id=case.id, marks=pytest.mark.kvcache_requires(*case.requires))
        for case in FEATURE_VALUE_CASES
    ]


def _combination_params() -> list[Any]:
    params: list[Any] = []
    for names in COMBINATIONS:
        for scenario in SCENARIOS:
            params.append(
                pytest.param(
                    names,
                    scenario,
                    id=f"{'+'.join(names)}-{scenario}",
                    marks=pytest.mark.kvcache_requires(*_capabilities(names)),
                )
            )
    return params


def _attend_and_compare(
    batch: _Batch,
    names: tuple[str, ...],
    query_lengths: tuple[int, ...] | None,
    causal: bool,
    rng: np.random.Generator,
    context: str,
) -> None:
    """One ``paged_attention`` call with the named features, checked against the dense reference."""
    manager = batch.manager
    config = manager.config
    group = 2
    query_heads = config.num_heads * group
    lengths = query_lengths or (1,) * len(batch.handles)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    query = BackendUnderTest.representable(
        rng.standard_normal((int(indptr[-1]), query_heads, config.head_dim)) * 2, config.dtype
    )
    chosen = _features(names, query_heads, rng)
    native = dict(chosen)
    if "sinks" in chosen:
        chosen["sinks"] = BackendUnderTest.representable(chosen["sinks"], config.dtype)
        native["sinks"] = BackendUnderTest.native(manager, chosen["sinks"])
    scale = 1.0 / math.sqrt(config.head_dim)
    output = manager.paged_attention(
        config.num_layers - 1,
        BackendUnderTest.native(manager, query),
        manager.page_table(batch.handles),
        qo_indptr=None if query_lengths is None else indptr,
        scale=scale,
        causal=causal,
        **native,
    )
    expected = np.concatenate(
        [
            dense_feature_attention(
                query[indptr[index] : indptr[index + 1]],
                batch.keys[index],
                batch.values[index],
                scale=scale,
                causal=causal,
                **chosen,
            )
            for index in range(len(batch.handles))
        ]
    )
    _assert_close(manager, output, expected, f"{context}, features {chosen}")


def _assert_close(manager: Manager, output: Any, expected: FloatArray, context: str) -> None:
    config = manager.config
    shape, dtype = manager.storage.array_info(output)
    assert shape == expected.shape, f"{context}: output shape {shape}, expected {expected.shape}"
    assert dtype == config.dtype, f"{context}: output dtype {dtype}, expected {config.dtype}"
    rtol, atol = TOLERANCES.get(config.dtype, (1e-2, 1e-2))
    got = BackendUnderTest.host(manager, output)
    error = float(np.max(np.abs(got - expected))) if got.size else 0.0
    assert np.allclose(got, expected, rtol=rtol, atol=atol), (
        f"{context}: differs from the dense reference by up to {error:.3g} (tolerance rtol={rtol}, atol={atol})"
    )


class FeatureCases:
    """Attention-feature cases every claiming backend runs (through
    :class:`~kvcache_core.testing.KvCacheConformance`)."""

    def test_storage_serves_the_attention_features_the_backend_claims(self, kvcache_backend: BackendUnderTest) -> None:
        """A claimed feature the storage does not list would be refused by the manager; a
        listed one the spec does not claim is served but not checked by the kit."""
        with kvcache_backend.manager() as manager:
            served = storage_attention_features(manager.storage)
        claimed = frozenset(kvcache_backend.spec.capabilities) & ATTENTION_CAPABILITIES
        assert claimed <= served, (
            f"BackendSpec.capabilities claims the attention features {sorted(claimed)}, but the storage's "
            f"attention_features lists {sorted(served)}: the manager calls the storage only with the latter, "
            f"so {sorted(claimed - served)} would be refused"
        )

    @pytest.mark.parametrize(("names", "scenario"), _combination_params())
    def test_attention_features_match_the_dense_reference(
        self, kvcache_backend: BackendUnderTest, names: tuple[str, ...], scenario: str
    ) -> None:
        query_lengths, causal = SCENARIOS[scenario]
        rng = np.random.default_rng(29)
        with kvcache_backend.manager(kvcache_backend.config(num_blocks=32)) as manager:
            batch = _grown_batch(manager, LENGTHS, rng)
            _attend_and_compare(batch, names, query_lengths, causal, rng, f"{scenario}")

    @pytest.mark.kvcache_requires(*sorted(ATTENTION_CAPABILITIES))
    def test_every_feature_at_once_in_every_dtype_and_layout(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(31)
        for config in kvcache_backend.configs(num_blocks=32):
            with kvcache_backend.manager(config) as manager:
                batch = _grown_batch(manager, LENGTHS, rng)
                context = f"dtype {config.dtype}, layout {config.kv_layout}"
                for names in (("window", "softcap", "sinks"), ("chunk", "softcap", "sinks")):
                    _attend_and_compare(batch, names, (2, 9, 1), True, rng, context)

    @pytest.mark.kvcache_requires(*sorted(ATTENTION_CAPABILITIES))
    def test_step_attention_takes_each_layers_features(self, kvcache_backend: BackendUnderTest) -> None:
        """A hybrid model's forward: prefill then decode steps, each layer with its own
        features (sliding + softcap, full + sinks, chunked), checked per layer."""
        rng = np.random.default_rng(37)
        config = kvcache_backend.config(num_layers=3, num_blocks=48)
        per_layer: tuple[tuple[str, ...], ...] = (("window", "softcap"), ("sinks",), ("chunk", "sinks"))
        with kvcache_backend.manager(config) as manager:
            handles = [manager.allocate(AllocationRequest(f"step-{index}")) for index in range(3)]
            written: list[list[list[FloatArray]]] = [[[] for _ in handles] for _ in range(config.num_layers)]
            query_heads = 2 * config.num_heads
            features = [_features(names, query_heads, rng) for names in per_layer]
            native_features: list[dict[str, Any]] = []
            for chosen in features:
                native = dict(chosen)
                if "sinks" in chosen:
                    chosen["sinks"] = BackendUnderTest.representable(chosen["sinks"], config.dtype)
                    native["sinks"] = BackendUnderTest.native(manager, chosen["sinks"])
                native_features.append(native)
            for new_tokens in ((9, 14, 3), (1, 1, 1), (1, 1, 1), (4, 1, 2)):
                step = manager.begin_step(handles, list(new_tokens))
                for layer in range(config.num_layers):
                    host = BackendUnderTest.representable(
                        rng.standard_normal((2, step.num_new_tokens, config.num_heads, config.head_dim)), config.dtype
                    )
                    step.write(
                        layer, BackendUnderTest.native(manager, host[0]), BackendUnderTest.native(manager, host[1])
                    )
                    query = BackendUnderTest.representable(
                        rng.standard_normal((step.num_new_tokens, query_heads, config.head_dim)) * 2, config.dtype
                    )
                    output = step.attention(layer, BackendUnderTest.native(manager, query), **native_features[layer])
                    expected_parts: list[FloatArray] = []
                    for index in range(len(handles)):
                        start, stop = int(step.qo_indptr[index]), int(step.qo_indptr[index + 1])
                        written[layer][index].append(np.stack([host[0][start:stop], host[1][start:stop]]))
                        held = np.concatenate(written[layer][index], axis=1)
                        expected_parts.append(
                            dense_feature_attention(
                                query[start:stop],
                                held[0],
                                held[1],
                                scale=1.0 / math.sqrt(config.head_dim),
                                **features[layer],
                            )
                        )
                    _assert_close(
                        manager,
                        output,
                        np.concatenate(expected_parts),
                        f"step adding {list(new_tokens)}, layer {layer}, features {per_layer[layer]}",
                    )

    @pytest.mark.kvcache_requires(*sorted(ATTENTION_CAPABILITIES))
    def test_bad_attention_features_are_refused_and_change_nothing(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(41)
        with kvcache_backend.manager(kvcache_backend.config(num_blocks=32)) as manager:
            query, table = _decode_query(manager, rng)
            config = manager.config
            query_heads = 2 * config.num_heads
            good_sinks = BackendUnderTest.native(manager, np.zeros(query_heads))
            before = BackendUnderTest.host(manager, manager.paged_attention(0, query, table, sinks=good_sinks))
            stats = manager.stats()
            wrong_dtype = "float32" if config.dtype != "float32" else "float16"
            cases: list[tuple[dict[str, Any], type[KvCacheError], str]] = [
                ({"window": 0}, InvalidArgumentError, "window"),
                ({"window": -3}, InvalidArgumentError, "window"),
                ({"window": 2.5}, InvalidArgumentError, "window"),
                ({"window": True}, InvalidArgumentError, "window"),
                ({"chunk": 0}, InvalidArgumentError, "chunk"),
                ({"chunk": "8"}, InvalidArgumentError, "chunk"),
                ({"softcap": 0.0}, InvalidArgumentError, "softcap"),
                ({"softcap": -1.0}, InvalidArgumentError, "softcap"),
                ({"softcap": float("nan")}, InvalidArgumentError, "softcap"),
                ({"softcap": float("inf")}, InvalidArgumentError, "softcap"),
                ({"softcap": "30"}, InvalidArgumentError, "softcap"),
                ({"sinks": BackendUnderTest.native(manager, np.zeros(query_heads + 1))}, ShapeMismatchError, "sinks"),
                ({"sinks": BackendUnderTest.native(manager, np.zeros((1, query_heads)))}, ShapeMismatchError, "sinks"),
                ({"sinks": np.zeros(query_heads).tolist()}, ArrayTypeError, "sinks"),
                (
                    {"sinks": BackendUnderTest.native(manager, np.zeros(query_heads), dtype=wrong_dtype)},
                    DTypeMismatchError,
                    "sinks",
                ),
            ]
            for arguments, error, named in cases:
                with pytest.raises(error) as caught:
                    manager.paged_attention(0, query, table, **arguments)
                assert named in str(caught.value), f"{arguments}: the message {caught.value} does not name {named}"
            assert manager.stats() == stats
            after = BackendUnderTest.host(manager, manager.paged_attention(0, query, table, sinks=good_sinks))
            np.testing.assert_array_equal(after, before)

    @pytest.mark.parametrize("case", _feature_value_params())
    def test_feature_value_no_backend_represents_is_refused_and_changes_nothing(
        self, kvcache_backend: BackendUnderTest, case: BadCall[World]
    ) -> None:
        """Windows and chunks past int32, softcaps and scales that are no normal float32 and
        non-finite sinks raise ``InvalidArgumentError`` naming the value and the range, on
        every backend alike, and leave the pool as it was."""
        check_bad_call(case, lambda: make_world(kvcache_backend), probe)

    @pytest.mark.kvcache_requires("attention_window", "softcap", "chunked_attention")
    def test_numpy_scalars_as_features_act_as_python_ones(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(47)
        with kvcache_backend.manager(kvcache_backend.config(num_blocks=32)) as manager:
            query, table = _decode_query(manager, rng)
            pairs: list[tuple[dict[str, Any], dict[str, Any]]] = [
                (
                    {"window": np.int64(6), "softcap": np.float32(1.5), "scale": np.float64(0.25)},
                    {"window": 6, "softcap": 1.5, "scale": 0.25},
                ),
                ({"chunk": np.int32(7), "softcap": np.float64(2.0)}, {"chunk": 7, "softcap": 2.0}),
            ]
            for numpy_scalars, python_scalars in pairs:
                got = BackendUnderTest.host(manager, manager.paged_attention(0, query, table, **numpy_scalars))
                expected = BackendUnderTest.host(manager, manager.paged_attention(0, query, table, **python_scalars))
                np.testing.assert_array_equal(got, expected, err_msg=f"{numpy_scalars} vs {python_scalars}")

    @pytest.mark.kvcache_requires("attention_window", "chunked_attention")
    def test_the_largest_window_and_chunk_attend_like_none(self, kvcache_backend: BackendUnderTest) -> None:
        """A window and a chunk of ``INT32_MAX`` positions (the largest every backend holds)
        hide nothing: the output is that of a call without them."""
        rng = np.random.default_rng(53)
        with kvcache_backend.manager(kvcache_backend.config(num_blocks=32)) as manager:
            query, table = _decode_query(manager, rng)
            plain = BackendUnderTest.host(manager, manager.paged_attention(0, query, table))
            cases: list[dict[str, Any]] = [{"window": INT32_MAX}, {"chunk": INT32_MAX}]
            for features in cases:
                got = BackendUnderTest.host(manager, manager.paged_attention(0, query, table, **features))
                np.testing.assert_array_equal(got, plain, err_msg=f"{features}")

    @pytest.mark.kvcache_requires("sliding_window")
    def test_a_pool_window_of_int32_max_attends_like_none(self, kvcache_backend: BackendUnderTest) -> None:
        outputs: list[Any] = []
        for window in (None, INT32_MAX):
            rng = np.random.default_rng(59)
            with kvcache_backend.manager(kvcache_backend.config(num_blocks=32, sliding_window=window)) as manager:
                query, table = _decode_query(manager, rng)
                outputs.append(BackendUnderTest.host(manager, manager.paged_attention(0, query, table)))
        np.testing.assert_array_equal(outputs[1], outputs[0])

    @pytest.mark.kvcache_requires("sliding_window", "chunked_attention")
    def test_layer_specs_of_numpy_integers_are_the_python_ones(self, kvcache_backend: BackendUnderTest) -> None:
        """A config whose layer specs hold NumPy integers is the same config (equal, same
        hash, plain ints), and its pool grows, attends and lists pages as the other does."""

        def specs(integer: Any) -> tuple[LayerSpec, ...]:
            window, chunk = integer(6), integer(8)
            return (LayerSpec(), LayerSpec(window=window), LayerSpec(chunk=chunk), LayerSpec(window=window))

        numpy_config = kvcache_backend.config(num_layers=4, num_blocks=48, layer_specs=specs(np.int64))
        python_config = kvcache_backend.config(num_layers=4, num_blocks=48, layer_specs=specs(int))
        assert numpy_config == python_config
        assert hash(numpy_config) == hash(python_config)
        assert numpy_config.layer_specs is not None
        assert [type(spec.window or spec.chunk) for spec in numpy_config.layer_specs[1:]] == [int, int, int]
        outputs: list[list[Any]] = []
        for config in (numpy_config, python_config):
            with kvcache_backend.manager(config) as manager:
                handle = manager.allocate(AllocationRequest("a"))
                steps = [run_step(manager, [handle], [5], seed=1), run_step(manager, [handle], [3], seed=2)]
                for group in range(config.num_groups):
                    assert manager.page_table([handle], group=group).seq_lens.tolist() == [8]
                manager.check_invariants()
                outputs.append([layer[3] for step in steps for layer in step])
        for got, expected in zip(*outputs, strict=True):
            np.testing.assert_array_equal(got, expected)

    @pytest.mark.kvcache_requires("sliding_window", "chunked_attention")
    def test_a_chunk_over_a_pool_window_is_refused(self, kvcache_backend: BackendUnderTest) -> None:
        config: CacheConfig = kvcache_backend.config(num_blocks=32, sliding_window=8)
        with kvcache_backend.manager(config) as manager:
            batch = _grown_batch(manager, LENGTHS, np.random.default_rng(43))
            query = BackendUnderTest.native(manager, np.ones((3, config.num_heads, config.head_dim)))
            with pytest.raises(InvalidArgumentError, match="chunk=8"):
                manager.paged_attention(0, query, manager.page_table(batch.handles), chunk=8)
