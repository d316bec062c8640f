"""Pool memory of hybrid models: KV-cache groups against one table keeping every block.

A Gemma 2 9B-shaped model (42 layers alternating sliding ``W = 4096`` and full attention;
8 KV heads of 256, 16-bit) serves a batch of long requests. Each request is prefilled
in chunks of 2,048 tokens and then decodes 64 tokens, through ``begin_step`` on the NumPy
backend, twice in one process: with ``CacheConfig(layer_specs=...)`` (two KV-cache groups;
a block holds 21 layers) and without (one group keeping every block of every layer; the
window applied by attention only). What is counted is the pool's own figure,
``stats().used_memory_bytes``, at the end; the pools are built with head_dim 1 so the run
fits any machine, and the bytes are scaled to the model's head size (blocks, not bytes,
are what the manager decides).

    .venv/bin/python benchmarks/hybrid_memory.py [--lengths 8192,32768,131072] [--batch 4]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
from _harness import BenchParser, int_list, mib, print_environment, run

from kvcache_core import AllocationRequest, CacheConfig, LayerSpec, create_manager

LAYERS, KV_HEADS, HEAD_DIM, WINDOW, BLOCK = 42, 8, 256, 4096, 16
SPECS = tuple(LayerSpec(window=WINDOW) if layer % 2 == 0 else LayerSpec() for layer in range(LAYERS))


def used_bytes(length: int, batch: int, hybrid: bool) -> int:
    """The pool's used bytes (scaled to the model's head size) after ``batch`` requests of
    ``length`` prompt tokens and 64 decoded ones."""
    blocks = batch * 2 * -(-(length + 64) // BLOCK) + 64  # a block per group (two groups) per position
    config = CacheConfig(
        num_layers=LAYERS,
        num_heads=KV_HEADS,
        head_dim=1,
        num_blocks=blocks,
        block_size=BLOCK,
        dtype="float16",
        layer_specs=SPECS if hybrid else None,
    )
    manager = create_manager("numpy", config)
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(batch)]
    zeros = np.zeros((0, KV_HEADS, 1), dtype=np.float16)

    def step(tokens: int) -> None:
        planned = manager.begin_step(handles, tokens)
        kv = np.zeros((planned.num_new_tokens, KV_HEADS, 1), dtype=np.float16) if tokens else zeros
        for layer in range(LAYERS):
            planned.write(layer, kv, kv)

    done = 0
    while done < length:
        chunk = min(2048, length - done)
        step(chunk)
        done += chunk
    for _ in range(64):
        step(1)
    manager.check_invariants()
    return manager.stats().used_memory_bytes * HEAD_DIM


def main(argv: Sequence[str] | None = None) -> int:
    """Print the pool each layout of tables needs, per prompt length."""
    parser = BenchParser(__doc__, quick="one length, one request")
    parser.flag("--lengths", ([8192, 32768, 131072], [8192]), type=int_list, help="prompt lengths")
    parser.flag("--batch", (4, 1), help="requests")
    args = parser.parse(argv)
    print_environment()
    print(f"Gemma 2 9B-shaped: {LAYERS} layers (half sliding W={WINDOW}), {KV_HEADS}x{HEAD_DIM} KV, 16-bit")
    print(f"{'tokens':>8} {'groups':>12} {'one table':>12} {'ratio':>7}")
    for length in args.lengths:
        grouped = used_bytes(length, args.batch, hybrid=True)
        plain = used_bytes(length, args.batch, hybrid=False)
        print(f"{length + 64:>8} {mib(grouped):>12} {mib(plain):>12} {grouped / plain:>6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
