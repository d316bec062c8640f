"""KV memory of Gemma 4 (sliding and full layers of different geometry): PagedCache against
DynamicCache at 8k tokens, side by side in one process.

The model is Gemma 4's text decoder as transformers' ``Gemma4TextConfig`` defaults give it
(30 layers, five sliding of window 512 to one full; sliding layers 4 KV heads of 256, full
layers 4 KV heads of 512, ``global_head_dim``), its widths divided by ``--scale`` (8 by
default: heads of 32 and 64; the window, the layer pattern and every ratio kept), random
weights, float32, CPU. One prompt of ``--tokens`` less ``--new-tokens`` tokens generates
``--new-tokens`` greedily, once with ``DynamicCache`` (``sdpa``; its sliding layers keep their
last ``W - 1`` positions, ``DynamicSlidingWindowLayer``) and once with ``PagedCache``
(``kvcache_paged`` attention, the pool of ``cache_config_for``); both must give the same tokens,
logits within 1e-2 (:data:`TOLERANCE`; exit 1 otherwise).

The pool's sliding layers form KV-cache groups keeping only their window's blocks; each page of
the full layers' shape holds a full layer or two sliding layers side by side (half its
features each: ``CacheConfig.storage_layers``, packed views), so a sliding group has twice a
full group's layers over the same pages (25 sliding layers: two groups of 10 and one of 5, half
filled). The pool is sized for the prefill's peak (``cache_config_for``'s ``max_tokens`` gives every group its
blocks): one step of the whole prompt takes every group's blocks of the prompt (its first
queries see the window before them), released as the request grows.

Printed: the K/V bytes each holds at the end (ours: ``stats().used_memory_bytes``; DynamicCache:
its key and value tensors) and ours / DynamicCache; beside it the floor, computed from the pool's
figures and not measured: the bytes if each layer's blocks took only its own geometry
(``ceil(W / block_size) + 1`` blocks per sliding layer, every block per full layer); and per
KV-cache group (``stats()``) its bytes per token in the pool and at its layers' own geometry, its
blocks in use, and the bytes its pages hold beyond its layers' own (a group filling its pages
only partly).

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/memory_gemma4.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import torch  # after the offline switch, which transformers reads on import
import transformers
from _harness import BenchParser, generation, mib, print_environment, require, run
from _harness.torch_decode import kv_tensor_bytes

from kvcache_core import CacheConfig, create_manager
from kvcache_torch.hf import ATTN_IMPLEMENTATION, PagedCache, cache_config_for

VOCAB, BLOCK = 512, 16
#: Logits through 30 fp32 layers over thousands of positions: transformers' own ``eager`` and
#: ``sdpa`` differ by 7e-4 at 2,048 tokens here, the paged attention from ``sdpa`` by 1.1e-3.
TOLERANCE = 1e-2
#: Gemma 4's text decoder (``Gemma4TextConfig``'s defaults).
LAYERS, WINDOW, KV_HEADS, SLIDING_HEAD, FULL_HEAD, QUERY_HEADS = 30, 512, 4, 256, 512, 8


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(ours, reference)``: the same random weights, ours with the paged attention, the
    reference with ``sdpa``."""
    per_layer: dict[str, Any] = {"global_head_dim": FULL_HEAD // args.scale}  # read by its __post_init__
    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB,
        hidden_size=QUERY_HEADS * SLIDING_HEAD // args.scale,
        intermediate_size=2 * QUERY_HEADS * SLIDING_HEAD // args.scale,
        num_hidden_layers=args.layers,
        num_attention_heads=QUERY_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=SLIDING_HEAD // args.scale,
        sliding_window=WINDOW,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        max_position_embeddings=args.tokens + BLOCK,
        initializer_range=0.02,  # Gemma 4's own (larger weights amplify fp32 rounding over 30 layers)
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        **per_layer,
    )
    torch.random.manual_seed(0)  # pyright: ignore[reportUnknownMemberType]  # seed untyped in torch
    reference: Any = transformers.Gemma4ForCausalLM(config)
    reference.eval()
    reference.set_attn_implementation("sdpa")
    ours: Any = copy.deepcopy(reference)
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    return ours, reference


def generate(model: Any, ids: torch.Tensor, new_tokens: int, cache: Any = None) -> Any:
    settings: dict[str, Any] = {"max_new_tokens": new_tokens, "do_sample": False, "return_dict_in_generate": True}
    if cache is not None:
        settings["cache"] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), output_logits=True, **settings)


def windowed_bytes(pool: CacheConfig, layer_types: Sequence[str], tokens: int) -> int:
    """The bytes a request of ``tokens`` would hold if each sliding layer kept only the
    blocks its window sees (``ceil(W / block_size) + 1``, as a sliding KV-cache group does)
    and each full layer every block: per layer, its blocks times its own block bytes."""
    blocks = -(-tokens // pool.block_size)
    total = 0
    for layer, kind in enumerate(layer_types):
        shape = pool.layer_geometry(layer)
        kept = min(blocks, -(-WINDOW // pool.block_size) + 1) if kind == "sliding_attention" else blocks
        total += kept * pool.block_size * shape.num_heads * (shape.head_dim + shape.value_width) * pool.dtype_size
    return total


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="6 layers, 1,024 tokens, 4 new")
    parser.flag("--layers", (LAYERS, 6), help="layers (five sliding to one full)")
    parser.flag("--tokens", (8192, 1024), help="tokens cached at the end (prompt + new - 1)")
    parser.flag("--new-tokens", (8, 4), help="tokens generated")
    parser.flag("--scale", 8, help="divisor of the widths (heads of 256 / scale and 512 / scale)")
    return parser.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Check, measure and print; ``DisagreementError`` if ours disagrees with DynamicCache."""
    args = parse_args(argv)
    print_environment()
    torch.set_num_threads(1)
    ours, reference = build(args)
    pool = cache_config_for(ours, max_tokens=args.tokens + BLOCK, block_size=BLOCK)  # blocks per group
    sliding = sum(kind == "sliding_attention" for kind in ours.config.layer_types)
    print(
        f"Gemma 4-shaped, widths / {args.scale}: {args.layers} layers ({sliding} sliding of W={WINDOW}, "
        f"{KV_HEADS}x{SLIDING_HEAD // args.scale} KV; {args.layers - sliding} full, {KV_HEADS}x{FULL_HEAD // args.scale}),"
        f" float32; one prompt, {args.tokens} tokens cached at the end; pool: {pool.num_groups} KV-cache group(s), "
        f"{pool.bytes_per_token} bytes per token"
    )
    ids, _ = generation.left_padded_prompts([args.tokens - args.new_tokens + 1], VOCAB, 1)
    expected = generate(reference, ids, args.new_tokens)
    with PagedCache(create_manager("torch", pool), ours) as cache:
        found = generate(ours, ids, args.new_tokens, cache)
        stats = cache.manager.stats()
        mine = stats.used_memory_bytes
    same, worst = generation.agreement(found, expected)
    print(f"same tokens as DynamicCache {same}, max |logit difference| {worst:.2e}")
    require(same and worst <= TOLERANCE, "ours and DynamicCache disagree")
    theirs = kv_tensor_bytes(expected.cache)
    windowed = windowed_bytes(pool, ours.config.layer_types, args.tokens)
    print(
        f"KV memory at {args.tokens} tokens: ours {mib(mine)}, DynamicCache {mib(theirs)}: ours / DynamicCache "
        f"{mine / theirs:.2f}x; floor (each layer's blocks of its own geometry, computed) {mib(windowed)}: "
        f"{windowed / theirs:.2f}x DynamicCache"
    )
    padding = sum(
        blocks * pool.block_size * (size - own)
        for blocks, size, own in zip(
            stats.group_used_blocks, stats.group_bytes_per_token, stats.group_layer_bytes_per_token, strict=True
        )
    )
    print(
        f"per KV-cache group (stats()): bytes per token in the pool {list(stats.group_bytes_per_token)}, at the "
        f"layers' own geometry {list(stats.group_layer_bytes_per_token)}, blocks used {list(stats.group_used_blocks)};"
        f" pages' bytes beyond the layers' own {mib(padding)} ({padding / mine:.0%} of ours)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
