"""kvcache_torch.paged_attention (the function, outside the manager) with the attention
features equals the NumPy reference, on the compiled CPU kernel and on the torch path,
and refuses bad features."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, InvalidArgumentError, create_manager
from kvcache_core.attention.reference import paged_attention as numpy_reference

torch = pytest.importorskip("torch")

from kvcache_torch.attention import paged_attention  # noqa: E402  # after the skip: it imports torch

FEATURES: list[dict[str, Any]] = [
    {"window": 5},
    {"softcap": 1.5},
    {"sinks": True},
    {"chunk": 6},
    {"window": 9, "chunk": 7, "softcap": 2.0, "sinks": True},
]


@pytest.fixture(params=["kernel", "torch-path"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch-path":
        monkeypatch.setenv("KVCACHE_DISABLE_NUMBA", "1")
    return str(request.param)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND", "heads_first"])
@pytest.mark.parametrize("features", FEATURES, ids=lambda chosen: "+".join(sorted(chosen)))
def test_the_function_with_features_equals_the_numpy_reference(
    path: str, kv_layout: str, features: dict[str, Any]
) -> None:
    config = CacheConfig(num_layers=1, num_heads=2, head_dim=8, num_blocks=40, block_size=4, kv_layout=kv_layout)
    manager = create_manager("torch", config)
    rng = np.random.default_rng(5)
    handles = [manager.allocate(AllocationRequest(rid)) for rid in ("a", "b", "c")]
    for handle, length in zip(handles, (5, 17, 30), strict=True):
        slots = manager.extend(handle, length)
        data = torch.from_numpy(rng.standard_normal((2, length, 2, 8)).astype(np.float32))
        manager.write(0, slots, data[0], data[1])
    table = manager.page_table(handles)
    indptr = np.array([0, 2, 11, 12], dtype=np.int32)
    query = (rng.standard_normal((12, 4, 8)) * 2).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    host: dict[str, Any] = {
        name: sinks.astype(np.float64) if name == "sinks" else value for name, value in features.items()
    }
    native: dict[str, Any] = {
        name: torch.from_numpy(sinks) if name == "sinks" else value for name, value in features.items()
    }
    keys, values = manager.storage.key_cache(0), manager.storage.value_cache(0)
    got = paged_attention(torch.from_numpy(query), keys, values, table, qo_indptr=indptr, kv_layout=kv_layout, **native)
    expected = numpy_reference(
        query.astype(np.float64),
        keys.numpy().astype(np.float64),
        values.numpy().astype(np.float64),
        table,
        qo_indptr=indptr,
        kv_layout=kv_layout,
        **host,
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"window": 0}, "window"),
        ({"chunk": -1}, "chunk"),
        ({"softcap": float("nan")}, "softcap"),
        ({"sinks": "zeros"}, "sinks"),
        ({"sinks": np.zeros(4, dtype=np.float32)}, "sinks"),  # not a tensor
        ({"sinks": torch.zeros(5)}, "sinks"),  # not one per query head
        ({"sinks": torch.zeros(4, dtype=torch.float64)}, "sinks"),  # not the query's dtype
    ],
)
def test_bad_features_are_refused_by_the_function(arguments: dict[str, Any], named: str) -> None:
    config = CacheConfig(num_layers=1, num_heads=2, head_dim=8, num_blocks=4, block_size=4)
    manager = create_manager("torch", config)
    handle = manager.allocate(AllocationRequest("a"))
    manager.extend(handle, 3)
    table = manager.page_table([handle])
    storage = manager.storage
    layout = manager.config.kv_layout
    assert layout is not None  # resolved by the backend
    with pytest.raises(InvalidArgumentError, match=named):
        paged_attention(
            torch.zeros((1, 4, 8)), storage.key_cache(0), storage.value_cache(0), table, kv_layout=layout, **arguments
        )
