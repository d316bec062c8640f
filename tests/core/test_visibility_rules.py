"""The rules of which keys a query sees and which layers a KV-cache group serves, as core
states them once for every integration (transformers' dense masks, the cache's layer checks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_core import LayerSpec
from kvcache_core.attention.features import visible_key_range
from kvcache_core.contract.groups import group_serves_layer

sizes = st.one_of(st.none(), st.integers(min_value=1, max_value=9))


@given(num_keys=st.integers(min_value=1, max_value=24), causal=st.booleans(), window=sizes, chunk=sizes)
def test_each_query_sees_exactly_the_keys_every_rule_admits(
    num_keys: int, causal: bool, window: int | None, chunk: int | None
) -> None:
    positions = np.arange(num_keys)
    low, high = visible_key_range(positions, num_keys, causal=causal, window=window, chunk=chunk)
    for position in positions:
        seen = [
            key
            for key in range(num_keys)
            if (not causal or key <= position)
            and (window is None or key > position - window)
            and (chunk is None or key // chunk == position // chunk)
        ]
        assert list(range(low[position], high[position])) == seen


def test_the_ranges_keep_the_shape_of_the_positions() -> None:
    low, high = visible_key_range([[5, 6], [7, 8]], 9, window=2)
    assert low.tolist() == [[4, 5], [6, 7]]
    assert high.tolist() == [[6, 7], [8, 9]]


@pytest.mark.parametrize(
    ("kept", "spec", "serves"),
    [
        (None, LayerSpec(), True),
        (None, LayerSpec(window=4), True),
        (None, LayerSpec(chunk=4), True),
        (8, LayerSpec(window=8), True),
        (8, LayerSpec(window=4), True),
        (8, LayerSpec(window=9), False),
        (8, LayerSpec(), False),
        (8, LayerSpec(chunk=4), False),
    ],
)
def test_a_group_keeping_a_window_serves_only_layers_that_see_no_further(
    kept: int | None, spec: LayerSpec, serves: bool
) -> None:
    assert group_serves_layer(kept, spec) is serves
