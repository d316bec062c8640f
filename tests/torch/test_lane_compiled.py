"""The torch lane's compiled per-layer pieces (``kvcache_torch.lanes``): the new K/V written
in one compiled call for both pools (``PoolWriter``), the kernel's query and output handed over
by address (``KernelCall.attend_at``); each gives what the general path gives, and where one
cannot run (arrays not contiguous, no compiled code) the lane writes and attends as before."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvcache_core import AllocationRequest, create_manager
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.attention import kernel_plan, row_writes
from kvcache_core.attention.kernel import KernelCall
from kvcache_core.attention.row_writes import PoolWriter
from tests.core.support import make_config
from tests.torch.support import Manager

pytestmark = [
    pytest.mark.filterwarnings("error"),
    pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)"),
]
LAYERS, HEADS, DIM = 3, 2, 8


def managers(path: str, layout: str, dtype: str) -> tuple[Manager, Manager]:
    """A manager whose lanes take ``path`` and one of torch's own path, its steps written and
    attended layer by layer without a lane (the general path they are compared with)."""
    config = make_config(
        200, 4, num_layers=LAYERS, num_heads=HEADS, head_dim=DIM, enable_prefix_caching=False, kv_layout=layout
    )
    config = dataclasses.replace(config, dtype=dtype)
    lane: Manager = create_manager("torch", dataclasses.replace(config, attention_path=path))
    general: Manager = create_manager("torch", dataclasses.replace(config, attention_path="native"))
    return lane, general


def run(manager: Manager, names: str, through_lane: bool, contiguous: bool = True) -> list[torch.Tensor]:
    """A prefill of ``names`` then three decode steps; every layer's output."""
    torch_dtype = getattr(torch, manager.config.dtype)
    handles = [manager.allocate(AllocationRequest(name)) for name in names]
    outputs: list[torch.Tensor] = []
    for turn, counts in enumerate([[9 + 4 * i for i in range(len(names))], *[[1] * len(names)] * 3]):
        step = manager.begin_step(handles, counts)
        tokens = sum(counts)
        for layer in range(LAYERS):
            generator = torch.Generator().manual_seed(100 * turn + layer)
            keys, values = (torch.randn((tokens, HEADS, 2 * DIM), generator=generator) for _ in range(2))
            keys, values = (part[..., ::2].to(torch_dtype) for part in (keys, values))  # (a view: not contiguous)
            if contiguous:
                keys, values = keys.contiguous(), values.contiguous()
            query = torch.randn((tokens, 2 * HEADS, DIM), generator=generator).to(torch_dtype)
            if through_lane:
                outputs.append(step.write_and_attend(layer, keys, values, query))
            else:
                step.write(layer, keys, values)
                outputs.append(step.attention(layer, query))
    return outputs


def counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Record the writer's calls and ``attend_at``'s answers."""
    seen: dict[str, list[Any]] = {"writes": [], "by_address": []}
    write, attend_at = PoolWriter.__call__, KernelCall.attend_at

    def counted_write(writer: PoolWriter, *arguments: Any) -> None:
        seen["writes"].append(arguments)
        write(writer, *arguments)

    def counted_attend_at(call: KernelCall, *arguments: Any) -> bool:
        ran = attend_at(call, *arguments)
        seen["by_address"].append(ran)
        return ran

    monkeypatch.setattr(PoolWriter, "__call__", counted_write)
    monkeypatch.setattr(KernelCall, "attend_at", counted_attend_at)
    return seen


@pytest.mark.parametrize("layout", ["NHD", "heads_first"])
@pytest.mark.parametrize(("path", "names"), [("kernel", "abcd"), ("native", "a")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_writes_and_calls_by_address_give_the_general_paths_pool_and_outputs(
    layout: str, path: str, names: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lane, general = managers(path, layout, dtype)
    seen = counting(monkeypatch)
    monkeypatch.setattr(kernel_plan, "MIN_THREAD_WORK", 1)  # two threads (torch's team) for these small batches
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = run(lane, names, through_lane=True)
    finally:
        torch.set_num_threads(previous)
    expected = run(general, names, through_lane=False)

    assert len(seen["writes"]) == 4 * LAYERS  # every step's every layer, in one call each
    if path == "kernel" and dtype == "float32" and "OpenMP" in torch.__config__.parallel_info():
        assert any(seen["by_address"])  # the layers after a step's first, through the C launch
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    assert torch.equal(lane.storage.pool, general.storage.pool)  # type: ignore[attr-defined]


@pytest.mark.parametrize("no_compiled_code", [False, True])
def test_without_a_compiled_write_the_lane_writes_as_before(
    no_compiled_code: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arrays that are not contiguous, or no compiled code (``PoolWriter.for_pools`` gives
    none), take the lane's indexed copies: the same pool and outputs."""
    lane, general = managers("kernel", "NHD", "float32")
    seen = counting(monkeypatch)
    if no_compiled_code:
        monkeypatch.setattr(row_writes, "kernel_available", lambda: False)
    got = run(lane, "ab", through_lane=True, contiguous=no_compiled_code)
    expected = run(general, "ab", through_lane=False)

    assert seen["writes"] == []
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(lane.storage.pool, general.storage.pool)  # type: ignore[attr-defined]
