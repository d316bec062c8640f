"""The attention features (a layer's window, softcap, sinks, chunk): the compiled kernel
equals the NumPy reference on any batch, the reference equals the dense definition, and
the manager and the step never call a storage with a feature it does not serve."""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    InvalidArgumentError,
    PagedKvCacheManager,
    UnsupportedConfigError,
    create_manager,
)
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.attention import kernel_plan
from kvcache_core.attention.features import (
    ATTENTION_CAPABILITIES,
    FEATURE_CAPABILITIES,
    check_chunk,
    check_softcap,
    check_window,
    combined_window,
    storage_attention_features,
)
from kvcache_core.attention.reference import paged_attention
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.contract.hookspecs import CAPABILITIES
from kvcache_core.errors import InvalidTypeError
from kvcache_core.testing.features import dense_feature_attention
from tests.core.support import Array, draw_kernel_batch, draw_kernel_run, hand_built_table, random_pool

needs_numba = pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")


@needs_numba
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_kernel_equals_the_reference_with_any_features(data: st.DataObject) -> None:
    """Random block tables, ragged lengths, decode / prefill / chunked queries, causal or
    not, windows, softcaps, sinks, chunk sizes, layouts, pool dtypes, threads, KV splits."""
    batch = draw_kernel_batch(data, max_requests=4, head_dims=[8, 20, 64])
    softcap = data.draw(st.none() | st.floats(0.25, 50.0), label="softcap")
    with_sinks = data.draw(st.booleans(), label="sinks")
    chunk = data.draw(st.none() | st.integers(1, 30), label="chunk")
    run = draw_kernel_run(data)

    rng = np.random.default_rng(run.seed)
    layout, dtype, window, heads, group = batch.layout, batch.dtype, batch.window, batch.heads, batch.group
    table, keys, values, keys64, values64 = random_pool(
        data, batch.lengths, batch.block_size, heads, batch.dim, layout, dtype, None, rng
    )
    indptr = np.concatenate([[0], np.cumsum(batch.query_counts)]).astype(np.int32)
    query = (rng.standard_normal((int(indptr[-1]), heads * group, batch.dim)) * 3).astype(np.float32)
    sinks = (rng.standard_normal(heads * group) * 3).astype(np.float32) if with_sinks else None
    scale = float(rng.uniform(0.05, 0.5))
    with (
        mock.patch.object(kernel_plan, "MIN_SPLIT_KEYS", run.min_split),
        mock.patch.object(kernel_plan, "ROW_SPLIT", run.row_split),
    ):
        got = paged_kernel.attend_with_kernel(
            query, keys, values, table, indptr, dtype=dtype, scale=scale, causal=batch.causal, kv_layout=layout,
            sliding_window=window, num_threads=run.threads, softcap=softcap, sinks=sinks, chunk=chunk,
        )  # fmt: skip
    expected = paged_attention(
        query.astype(np.float64), keys64, values64, table, qo_indptr=indptr, scale=scale, causal=batch.causal,
        kv_layout=layout, window=window, softcap=softcap, sinks=None if sinks is None else sinks.astype(np.float64),
        chunk=chunk,
    )  # fmt: skip
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_reference_equals_the_dense_definition(data: st.DataObject) -> None:
    """One request in scattered blocks: the paged reference against the dense float64
    attention written out from the definitions (non-causal and the pool window included)."""
    length = data.draw(st.integers(1, 60), label="length")
    queries = data.draw(st.integers(1, length), label="queries")
    block_size = data.draw(st.sampled_from([2, 4, 5]), label="block_size")
    causal = data.draw(st.booleans(), label="causal")
    window = data.draw(st.none() | st.integers(1, 30), label="window")
    table_window = data.draw(st.none() | st.integers(1, 30), label="table_window")
    softcap = data.draw(st.none() | st.floats(0.25, 20.0), label="softcap")
    chunk = None if table_window is not None else data.draw(st.none() | st.integers(1, 20), label="chunk")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    count = -(-length // block_size)
    order = data.draw(st.permutations(range(count + 2)), label="order")
    table, _ = hand_built_table(list(order), [length], block_size, table_window)
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((count + 2, block_size, 2, 8))
    values = rng.standard_normal((count + 2, block_size, 2, 8))
    query = rng.standard_normal((queries, 4, 8)) * 3
    sinks = rng.standard_normal(4) * 3 if data.draw(st.booleans(), label="sinks") else None
    got = paged_attention(
        query, keys, values, table, qo_indptr=np.array([0, queries]), scale=0.3, causal=causal,
        window=window, softcap=softcap, sinks=sinks, chunk=chunk,
    )  # fmt: skip
    blocks = np.asarray(order[:count])
    dense_keys = keys[blocks].reshape(-1, 2, 8)[:length]
    dense_values = values[blocks].reshape(-1, 2, 8)[:length]
    expected = dense_feature_attention(
        query, dense_keys, dense_values, scale=0.3, causal=causal, window=combined_window(window, table_window),
        softcap=softcap, sinks=sinks, chunk=chunk,
    )  # fmt: skip
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


def test_every_feature_has_a_capability_in_the_vocabulary() -> None:
    assert set(FEATURE_CAPABILITIES.values()) == ATTENTION_CAPABILITIES
    assert set(CAPABILITIES) >= ATTENTION_CAPABILITIES


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_window_and_chunk_checks(bad: object) -> None:
    if bad is None:
        assert check_window(bad) is None
        assert check_chunk(bad) is None
        return
    with pytest.raises(InvalidArgumentError, match=r"window must be None or an int >= 1, got"):
        check_window(bad)
    with pytest.raises(InvalidArgumentError, match=r"chunk must be None or an int >= 1, got"):
        check_chunk(bad)


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf"), True, "30"])
def test_softcap_check(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"softcap must be None or a finite number > 0, got"):
        check_softcap(bad)
    assert check_softcap(np.float32(30.0)) == 30.0


def test_the_smaller_window_applies() -> None:
    assert combined_window(None, None) is None
    assert combined_window(8, None) == 8
    assert combined_window(None, 8) == 8
    assert combined_window(4, 8) == combined_window(8, 4) == 4


class _PlainStorage(NumpyStorage):
    """A storage serving no attention feature (as a third-party one written before them)."""

    attention_features: frozenset[str] = frozenset()


def _prefilled(manager: PagedKvCacheManager[Array]) -> list[Any]:
    handles = [manager.allocate(AllocationRequest(rid)) for rid in ("a", "b")]
    config = manager.config
    for handle in handles:
        slots = manager.extend(handle, 9)
        for layer in range(config.num_layers):
            data = np.ones((9, config.num_heads, config.head_dim), dtype=np.float32)
            manager.write(layer, slots, data, data)
    return handles


CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=16, block_size=4)


@pytest.mark.parametrize(
    ("arguments", "capability"),
    [
        ({"window": 4}, "attention_window"),
        ({"softcap": 30.0}, "softcap"),
        ({"sinks": np.zeros(4, dtype=np.float32)}, "sinks"),
        ({"chunk": 8}, "chunked_attention"),
    ],
)
def test_a_feature_the_storage_does_not_serve_is_refused_naming_the_capability(
    arguments: dict[str, Any], capability: str
) -> None:
    manager = PagedKvCacheManager(_PlainStorage(CONFIG), backend="plain")
    handles = _prefilled(manager)
    query = np.ones((2, 4, 8), dtype=np.float32)
    with mock.patch.object(_PlainStorage, "paged_attention", side_effect=AssertionError("called")) as kernel:
        with pytest.raises(UnsupportedConfigError, match=capability):
            manager.paged_attention(0, query, manager.page_table(handles), **arguments)
        step = manager.begin_step(handles, 1)
        with pytest.raises(UnsupportedConfigError, match=capability):
            step.attention(0, query, **arguments)
        assert kernel.call_count == 0


def test_a_storage_serving_none_is_called_without_the_keywords() -> None:
    manager = PagedKvCacheManager(_PlainStorage(CONFIG), backend="plain")
    handles = _prefilled(manager)
    with mock.patch.object(_PlainStorage, "paged_attention", return_value=np.zeros((2, 4, 8))) as kernel:
        manager.paged_attention(0, np.ones((2, 4, 8), dtype=np.float32), manager.page_table(handles))
        manager.begin_step(handles, 1).attention(1, np.ones((2, 4, 8), dtype=np.float32))
    for call in kernel.call_args_list:
        assert call.kwargs == {}, call


def test_attention_features_must_name_known_capabilities() -> None:
    class Odd(NumpyStorage):
        attention_features = frozenset({"flash"})

    with pytest.raises(InvalidTypeError, match="flash"):
        storage_attention_features(Odd(CONFIG))
    assert storage_attention_features(object()) == frozenset()


def test_the_step_and_the_raw_call_give_the_same_result_with_features() -> None:
    manager = create_manager("numpy", CONFIG)
    handles = _prefilled(manager)
    rng = np.random.default_rng(3)
    query = rng.standard_normal((2, 4, 8)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    step = manager.begin_step(handles, 1)
    data = rng.standard_normal((2, 2, 8)).astype(np.float32)
    step.write(1, data, data)
    features: dict[str, Any] = {"window": 5, "softcap": 2.0, "sinks": sinks, "chunk": 6}
    raw = manager.paged_attention(1, query, step.page_table, qo_indptr=step.qo_indptr, **features)
    np.testing.assert_array_equal(step.attention(1, query, **features), raw)
