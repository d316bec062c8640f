"""The kit's dense-attention oracle pins down what it computes, from cases worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcache_core.testing.oracle import dense_attention, dense_attention_batch


def test_one_key_gives_its_value_whatever_the_query() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((1, 1, 3))
    out = dense_attention(rng.standard_normal((1, 1, 3)), rng.standard_normal((1, 1, 3)), values)
    np.testing.assert_allclose(out, values, atol=1e-12)


def test_two_keys_are_weighted_by_the_softmax_of_their_scaled_scores() -> None:
    query = np.array([[[1.0, 0.0, 0.0, 0.0]]])
    keys = np.array([[[2.0, 0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]]])
    values = np.array([[[1.0, 0.0, 0.0, 0.0]], [[0.0, 1.0, 0.0, 0.0]]])
    weight = 1.0 / (1.0 + math.exp(-2.0 / 2.0))  # scores 2 / sqrt(4) and 0
    out = dense_attention(query, keys, values, causal=False)
    np.testing.assert_allclose(out[0, 0], [weight, 1.0 - weight, 0.0, 0.0], atol=1e-12)
    doubled = dense_attention(query, keys, values, causal=False, scale=1.0)
    weight = 1.0 / (1.0 + math.exp(-2.0))
    np.testing.assert_allclose(doubled[0, 0], [weight, 1.0 - weight, 0.0, 0.0], atol=1e-12)


def equal_keys(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Equal keys (uniform weights) and values holding their position: the output is the
    mean of the visible positions."""
    keys = np.ones((length, 1, 2))
    values = np.repeat(np.arange(length, dtype=np.float64)[:, None, None], 2, axis=2)
    return keys, values


def test_causal_rows_are_the_last_positions_and_see_up_to_their_own() -> None:
    keys, values = equal_keys(6)
    out = dense_attention(np.ones((3, 1, 2)), keys, values)  # rows at positions 3, 4, 5
    np.testing.assert_allclose(out[:, 0, 0], [1.5, 2.0, 2.5])
    np.testing.assert_allclose(dense_attention(np.ones((3, 1, 2)), keys, values, causal=False)[:, 0, 0], 2.5)


def test_query_start_and_key_start_place_the_rows_and_keys() -> None:
    keys, values = equal_keys(6)
    out = dense_attention(np.ones((2, 1, 2)), keys, values, query_start=0)  # positions 0, 1
    np.testing.assert_allclose(out[:, 0, 0], [0.0, 0.5])
    shifted = dense_attention(np.ones((1, 1, 2)), keys, values, key_start=10, query_start=12)  # sees keys 10..12
    np.testing.assert_allclose(shifted[0, 0, 0], 1.0)


def test_a_sliding_window_sees_the_last_w_positions() -> None:
    keys, values = equal_keys(8)
    out = dense_attention(np.ones((2, 1, 2)), keys, values, sliding_window=3)  # rows 6 and 7
    np.testing.assert_allclose(out[:, 0, 0], [5.0, 6.0])
    wide = dense_attention(np.ones((1, 1, 2)), keys, values, causal=False, sliding_window=3, query_start=2)
    np.testing.assert_allclose(wide[0, 0, 0], np.mean(np.arange(8)))  # window bounds from below only


def test_grouped_query_heads_read_their_kv_head() -> None:
    keys = np.ones((2, 2, 2))
    values = np.stack([np.full((2, 2), 1.0), np.full((2, 2), 2.0)], axis=1)  # KV head h holds h + 1
    out = dense_attention(np.ones((1, 4, 2)), keys, values)
    np.testing.assert_allclose(out[0, :, 0], [1.0, 1.0, 2.0, 2.0])


def test_a_row_that_sees_nothing_is_zero() -> None:
    keys, values = equal_keys(3)
    out = dense_attention(np.ones((1, 1, 2)), keys, values, key_start=5, query_start=0)
    assert np.array_equal(out, np.zeros((1, 1, 2)))


def test_a_batch_is_each_request_in_turn() -> None:
    rng = np.random.default_rng(1)
    contexts = [(rng.standard_normal((n, 2, 4)), rng.standard_normal((n, 2, 4))) for n in (5, 3)]
    query = rng.standard_normal((4, 4, 4))
    out = dense_attention_batch(query, contexts, [3, 1])
    np.testing.assert_allclose(out[:3], dense_attention(query[:3], *contexts[0]))
    np.testing.assert_allclose(out[3:], dense_attention(query[3:], *contexts[1]))


@pytest.mark.parametrize(
    ("query_shape", "key_shape"), [((1, 3, 4), (2, 2, 4)), ((1, 2, 4), (2, 2, 5)), ((2, 4), (2, 2, 4))]
)
def test_shapes_that_do_not_fit_are_refused(query_shape: tuple[int, ...], key_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"expected|multiple"):
        dense_attention(np.ones(query_shape), np.ones(key_shape), np.ones(key_shape))
