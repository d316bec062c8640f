"""``PagedCache.update``'s check of a layer's keys and values (``pool_fit.UpdateCheck``): its
quick comparisons accept exactly what the full checks accept, and refuse the rest with the
full checks' errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache_core import CacheConfig, LayerSpec
from kvcache_core.errors import KvCacheError
from kvcache_torch.hf.pool_fit import UpdateCheck, check_update_arrays

#: Three layers of their own geometry (Gemma 4-like): the pool's, wider keys, more heads.
MIXED = CacheConfig(
    num_layers=3,
    num_heads=2,
    head_dim=8,
    num_blocks=8,
    block_size=4,
    layer_specs=[LayerSpec(), LayerSpec(head_dim=16), LayerSpec(num_heads=4)],
)
LATENT = CacheConfig(num_layers=2, num_heads=1, head_dim=12, value_head_dim=4, num_blocks=8, block_size=4)
QUANTIZED = CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=8, block_size=4, dtype="int8")


def _full(pool: CacheConfig, keys: object, values: object, layer: object, rows: int | None) -> object:
    """What the full checks give: the layer index, or the error raised."""
    try:
        index = pool.check_layer(layer)
        check_update_arrays(keys, values, pool, rows, index)
    except KvCacheError as error:
        return type(error), str(error)
    return index


def _quick(pool: CacheConfig, keys: object, values: object, layer: object, rows: int | None) -> object:
    try:
        return UpdateCheck(pool)(keys, values, layer, rows)
    except KvCacheError as error:
        return type(error), str(error)


def _cases(pool: CacheConfig) -> list[tuple[object, object, object, int | None]]:
    cases: list[tuple[object, object, object, int | None]] = []
    for layer in range(pool.num_layers):
        shape = pool.layer_geometry(layer)
        keys = torch.zeros(2, shape.num_heads, 1, shape.head_dim)
        values = torch.zeros(2, shape.num_heads, 1, shape.value_width)
        prompt = (
            torch.zeros(2, shape.num_heads, 5, shape.head_dim),
            torch.zeros(2, shape.num_heads, 5, shape.value_width),
        )
        cases += [
            (keys, values, layer, 2),
            (keys, values, layer, None),
            (*prompt, layer, 2),
            (keys, values, np.int64(layer), 2),  # NumPy integers are layer indexes too
            (keys, values, True if layer == 1 else layer + 0.5, 2),  # neither a bool nor a float is
            (keys, values, layer, 3),  # another batch than the cache holds
            (keys, values, -1, 2),
            (keys, values, pool.num_layers, 2),
            (keys.double(), values.double(), layer, 2),
            (keys, values.to(torch.bfloat16), layer, 2),
            (keys, keys, layer, 2),  # values as wide as the keys where they differ
            (values, values, layer, 2),
            (keys[:1], values, layer, 2),
            (keys, values[:, :, :0], layer, 2),
            (keys[0], values[0], layer, 2),
            (keys.numpy(), values.numpy(), layer, 2),
            (torch.nn.Parameter(keys), torch.nn.Parameter(values), layer, 2),  # a subclass: the full checks
        ]
    return cases


@pytest.mark.parametrize("pool", [MIXED, LATENT, QUANTIZED], ids=["mixed-geometry", "latent", "int8"])
def test_the_quick_check_accepts_and_refuses_what_the_full_checks_do(pool: CacheConfig) -> None:
    accepted = 0
    for keys, values, layer, rows in _cases(pool):
        expected = _full(pool, keys, values, layer, rows)
        assert _quick(pool, keys, values, layer, rows) == expected, (layer, rows)
        accepted += isinstance(expected, int)
    assert accepted >= 3 * pool.num_layers  # the case is not only refusals
