"""Helpers shared by the torch backend's tests: devices (CUDA skipped cleanly without a GPU),
managers over every layout and dtype, and requests grown side by side with known K/V.

A support module, not a test file: it holds no tests, and test files import from it (never
from one another or from ``conftest``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcache_core import AllocationRequest, PagedKvCacheHandle, PagedKvCacheManager, create_manager
from kvcache_core.backends import dispatch
from kvcache_core.paging.allocator import Placement
from kvcache_torch import TorchStorage
from kvcache_torch import dispatch as torch_dispatch
from tests.core.support import make_config

Manager = PagedKvCacheManager[torch.Tensor]
Handle = PagedKvCacheHandle[torch.Tensor]

LAYOUTS = ("NHD", "HND", "heads_first")
DTYPES = ("float32", "float16", "bfloat16")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: ``(rtol, atol)`` of attention outputs against a float64 reference, per pool dtype.
TOLERANCES = {"float32": (1e-5, 1e-5), "float16": (2e-3, 4e-3), "bfloat16": (1.6e-2, 3e-2)}

NO_CUDA = "no CUDA GPU here (torch.cuda.is_available() is False)"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)),
]


def dispatch_file(directory: Path) -> Path:
    """The torch backend's calibration file in ``directory`` on this machine, under the
    installed versions (``kvcache_core.backends.dispatch.dispatch_file_name``)."""
    machine = dispatch.machine_key(torch_dispatch.DISPATCH.libraries)
    return directory / dispatch.dispatch_file_name("torch", machine)


def make_manager(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    kv_layout: str = "NHD",
    placement: Placement = "contiguous",
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 8,
    num_blocks: int = 64,
    block_size: int = 4,
) -> Manager:
    """A torch manager (``create_manager``, or the fragmenting ``fifo`` placement) over
    ``tests.core.support.make_config``."""
    config = make_config(
        num_blocks,
        block_size,
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        enable_prefix_caching=False,
        dtype=dtype,
        device=device,
        kv_layout=kv_layout,
    )
    if placement == "contiguous":
        manager: Manager = create_manager("torch", config)
        return manager
    return PagedKvCacheManager(TorchStorage(config), backend="torch", placement=placement)


@dataclass
class Filled:
    """Requests grown side by side, and what each layer holds for each of them.

    ``keys[layer][r]``/``values[layer][r]``: ``[tokens, num_heads, head_dim]`` on the
    pool's device and dtype, in token order.
    """

    manager: Manager
    handles: list[Handle]
    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]


def random_kv(manager: Manager, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Random ``[rows, num_heads, head_dim]`` of the pool's dtype on its device."""
    config = manager.config
    data = torch.randn((rows, config.num_heads, config.head_dim), generator=generator)
    return data.to(device=str(config.device), dtype=TORCH_DTYPES[config.dtype])


def fill(manager: Manager, lengths: Sequence[int], seed: int = 0, max_step: int = 6) -> Filled:
    """Grow ``len(lengths)`` requests a few tokens at a time in turn (their blocks interleave),
    writing every step of every request with one batched write per layer."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = manager.config
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(len(lengths))]
    parts: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = [
        [[] for _ in lengths] for _ in range(config.num_layers)
    ]
    done = [0] * len(lengths)
    while done != list(lengths):
        slots: list[Any] = []
        counts: list[tuple[int, int]] = []
        for index, handle in enumerate(handles):
            step = min(int(rng.integers(1, max_step + 1)), lengths[index] - done[index])
            if step:
                slots.append(manager.extend(handle, step))
                counts.append((index, step))
                done[index] += step
        batch_slots = np.concatenate(slots)
        for layer in range(config.num_layers):
            keys = random_kv(manager, len(batch_slots), generator)
            values = random_kv(manager, len(batch_slots), generator)
            manager.write(layer, batch_slots, keys, values)
            row = 0
            for index, step in counts:
                parts[layer][index].append((keys[row : row + step], values[row : row + step]))
                row += step
    empty = torch.empty((0, config.num_heads, config.head_dim), dtype=TORCH_DTYPES[config.dtype])
    keys_out = [[torch.cat([k for k, _ in request]) if request else empty for request in layer] for layer in parts]
    values_out = [[torch.cat([v for _, v in request]) if request else empty for request in layer] for layer in parts]
    return Filled(manager, handles, keys_out, values_out)
