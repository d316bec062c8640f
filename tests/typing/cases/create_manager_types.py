"""Must type-check cleanly: ``create_manager`` carries each built-in backend's array type.

``reveal_type`` lines are read by the typing tests (mypy and pyright print the types);
``assert_type`` makes either checker fail if a type drifts.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy.typing as npt
import torch
from typing_extensions import assert_type, reveal_type

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager

config = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=8)
request = AllocationRequest("a")

torch_manager = create_manager("torch", config)
assert_type(torch_manager, PagedKvCacheManager[torch.Tensor])
torch_keys = create_manager("torch", config).allocate(request).key_cache(0)
reveal_type(torch_keys)  # torch: Tensor | None
assert_type(torch_keys, torch.Tensor | None)
assert_type(torch_manager.gather(torch_manager.allocate(request), 0), tuple[torch.Tensor, torch.Tensor])

jax_keys = create_manager("jax", config).allocate(request).key_cache(0)
reveal_type(jax_keys)  # jax: Array | None
assert_type(jax_keys, jax.Array | None)

numpy_keys = create_manager("numpy", config).allocate(request).key_cache(0)
reveal_type(numpy_keys)  # numpy: ndarray | None
assert_type(numpy_keys, npt.NDArray[Any] | None)

with create_manager("torch", config) as managed:
    assert_type(managed, PagedKvCacheManager[torch.Tensor])

name = "mine"
assert_type(create_manager(name, config), PagedKvCacheManager[Any])
