"""Support for the quantized-pool tests of every backend: the pool they share and a manager
with K/V written, to hold a quantized pool of one backend beside the NumPy backend's."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcache_core import AllocationRequest, CacheConfig, create_manager

#: The quantized dtypes every array backend stores.
QUANTIZED = ("int8", "float8_e4m3fn")


def pool(**fields: Any) -> CacheConfig:
    """2 layers, 2 KV heads of 32 features, 48 blocks of 4 tokens, with ``fields`` changed."""
    base: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 32, "num_blocks": 48, "block_size": 4}
    return CacheConfig(**{**base, **fields})


def filled(config: CacheConfig, backend: str, lengths: tuple[int, ...] = (13, 40)) -> tuple[Any, list[Any]]:
    """A manager of ``backend`` with requests of ``lengths`` tokens written in layer 1 (seeded
    Gaussian K/V ``[tokens, num_heads, head_dim]`` of 2 heads of 32 features), and their handles."""
    manager = create_manager(backend, config)
    handles = [manager.allocate(AllocationRequest(f"r{i}")) for i in range(len(lengths))]
    slots = np.concatenate([manager.extend(h, n) for h, n in zip(handles, lengths, strict=True)])
    rng = np.random.default_rng(2)
    keys, values = (rng.standard_normal((len(slots), 2, 32)).astype(np.float32) for _ in range(2))
    manager.write(1, slots, manager.storage.from_numpy(keys), manager.storage.from_numpy(values))
    return manager, handles
