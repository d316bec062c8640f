"""Quickstart: allocate two requests, write their K/V in one batched call, attend.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import numpy as np

from kvcache_core import AllocationRequest, CacheConfig, create_manager

config = CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=64, block_size=16)
manager = create_manager("numpy", config)  # or "torch", "jax" once installed

handles = [manager.allocate(AllocationRequest(rid, max_sequence_length=64)) for rid in ("a", "b")]
slots = np.concatenate([manager.extend(handles[0], 10), manager.extend(handles[1], 3)])  # prefill

rng = np.random.default_rng(0)
for layer in range(config.num_layers):
    keys = rng.standard_normal((13, 2, 8)).astype(np.float32)  # [tokens, kv_heads, head_dim]
    manager.write(layer, slots, keys, keys)  # one scatter for the whole batch

query = rng.standard_normal((2, 4, 8)).astype(np.float32)  # one decode query per request, 4 query heads
out = manager.paged_attention(0, query, manager.page_table(handles))  # reads the pool in place
print(out.shape, handles[0].block_table(), manager.stats().used_blocks, "blocks in use")
manager.deallocate("a")
assert not handles[0].is_valid()
