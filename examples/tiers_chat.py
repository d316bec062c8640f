"""A multi-turn chat of two tenants in a small pool with host and disk tiers behind it:
hits per tier, what a router learns from the cache events, and a prefix cache that
survives a restart (``pip install "kvcache-core[tiers]"``)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from kvcache_core import AllocationRequest, CacheConfig, CachedBlockIndex, DiskTier, HostTier, create_manager

config = CacheConfig(
    num_layers=2, num_heads=2, head_dim=16, num_blocks=16, block_size=8, enable_prefix_caching=True, model_id="demo@1"
)
rng = np.random.default_rng(0)
block_bytes = config.bytes_per_block

with tempfile.TemporaryDirectory() as directory:
    manager = create_manager(
        "numpy", config, tiers=[HostTier(8 * block_bytes), DiskTier(Path(directory) / "disk", 256 * block_bytes)]
    )
    router = CachedBlockIndex()
    manager.subscribe(router)
    chats = {(tenant, chat): list(range(tenant * 1000, tenant * 1000 + 24)) for tenant in (1, 2) for chat in range(3)}
    computed = total = 0
    for turn in range(4):
        for (tenant, chat), tokens in chats.items():
            tokens += rng.integers(0, 30_000, 12).tolist()  # the answer and the next question
            request = AllocationRequest(
                f"t{tenant}c{chat}n{turn}", prompt_token_ids=tuple(tokens), cache_salt=f"tenant-{tenant}"
            )
            handle = manager.allocate(request)
            new = len(tokens) - handle.num_tokens()
            slots = manager.extend(handle, new)
            for layer in range(config.num_layers):
                kv = rng.standard_normal((new, config.num_heads, config.head_dim)).astype(np.float32)
                manager.write(layer, slots, kv, kv)
            computed, total = computed + new, total + len(tokens)
            manager.deallocate(request.request_id)
    print(f"computed {computed} of {total} prompt tokens; prefix-cache hit rate {manager.stats().cache_hit_rate:.2f}")
    for tier in manager.tier_stats():
        print(f"  tier {tier.name}: {tier.blocks} blocks, {tier.hits} hits, {tier.demotions} demotions")
    print("a router knows:", {medium: len(router.hashes(medium)) for medium in ("pool", *router.media())})

    saved = Path(directory) / "prefix.safetensors"
    manager.save_prefix_cache(saved)
    # A new process (another layout or backend alike), whose pool holds what the old pool and tiers held.
    restarted = create_manager("numpy", dataclasses.replace(config, num_blocks=64, kv_layout="heads_first"))
    print(f"restart: loaded {restarted.load_prefix_cache(saved)} blocks from {saved.name}")
    manager.close()
