"""transformers ``generate`` on a hybrid-attention model: PagedCache (KV-cache groups)
against DynamicCache, side by side in one process.

The model is a random-weight Qwen2 whose layers alternate sliding-window (``--window``) and
full attention (``layer_types``, the pattern of Gemma 2, gpt-oss and Cohere 2), fp32 on the
CPU. A batch of ``--batch-size`` left-padded prompts of ``--min-length`` to ``--max-length``
tokens generates ``--new-tokens`` tokens greedily, three ways:

* **ours**: ``PagedCache`` over ``create_manager("torch", cache_config_for(model, ...))``
  with ``attn_implementation="kvcache_paged"``; the pool has a KV-cache group per attention
  kind, so the sliding layers keep only their window's blocks;
* **ours, one group** (``cache_config_for(..., hybrid=False)``): every layer keeps every
  block, the window applied by attention only (memory only, for comparison);
* **DynamicCache** with ``sdpa``: transformers' default, whose sliding layers keep only
  their last ``W - 1`` tokens.

Printed: one run of each is checked first (same tokens, logits within 1e-3; exit 1
otherwise), then the median times of ``--repeats`` runs taken in turns and DynamicCache /
ours, and the KV memory each holds at the end (ours: the pool's ``used_memory_bytes``;
DynamicCache: the bytes of its key and value tensors). Nothing asserts a time.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/generate_hybrid.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # after the offline switch, which transformers reads on import
import transformers
from _bench import draw_lengths, mib, print_environment

from kvcache_core import PagedKvCacheManager, create_manager
from kvcache_torch.hf import ATTN_IMPLEMENTATION, PagedCache, cache_config_for

LOGIT_TOLERANCE = 1e-3
Model = Any


def build(args: argparse.Namespace) -> tuple[Model, Model]:
    """``(ours, reference)``: the same random weights, each with its attention."""
    layer_types = ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(args.layers)]
    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=args.max_length + args.new_tokens,
        use_sliding_window=True,
        sliding_window=args.window,
        layer_types=layer_types,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.random.manual_seed(args.seed)  # pyright: ignore[reportUnknownMemberType]  # seed untyped in torch
    reference: Model = transformers.Qwen2ForCausalLM(config)
    reference.eval()
    ours: Model = copy.deepcopy(reference)
    reference.set_attn_implementation("sdpa")
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    return ours, reference


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = draw_lengths(args.seed, args.batch_size, args.min_length, args.max_length)
    longest = max(lengths)
    generator = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.zeros((len(lengths), longest), dtype=torch.long)
    mask = torch.zeros((len(lengths), longest), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, longest - length :] = torch.randint(2, 512, (length,), generator=generator)
        mask[row, longest - length :] = 1
    return ids, mask


def generate(model: Model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **options: Any) -> Any:
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **options
    )


def dynamic_bytes(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--min-length", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: short prompts, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.window, args.min_length, args.max_length = 4, 32, 64, 128
        args.batch_size, args.new_tokens, args.repeats = 2, 8, 1
    print_environment()
    ours_model, reference = build(args)
    ids, mask = batch(args)
    blocks = args.batch_size * 2 * -(-(ids.shape[1] + args.new_tokens) // 16) + 16
    pools: dict[str, PagedKvCacheManager[torch.Tensor]] = {
        "groups": create_manager("torch", cache_config_for(ours_model, num_blocks=blocks)),
        "one group": create_manager("torch", cache_config_for(ours_model, num_blocks=blocks, hybrid=False)),
    }
    print(
        f"Qwen2-like, {args.layers} layers alternating sliding (W={args.window}) / full, 8 query / 2 KV heads of 32, "
        f"fp32; {args.batch_size} prompts of {args.min_length}-{args.max_length} tokens, {args.new_tokens} new"
    )

    def ours(name: str, **options: Any) -> tuple[Any, int]:
        manager = pools[name]
        with PagedCache(manager, ours_model.config) as cache:
            out = generate(ours_model, ids, mask, args.new_tokens, cache=cache, **options)
            return out, manager.stats().used_memory_bytes

    checked, ours_bytes = ours("groups", output_logits=True)
    _, one_group_bytes = ours("one group")
    expected = generate(reference, ids, mask, args.new_tokens, output_logits=True)
    worst = max(float((a - b).abs().max()) for a, b in zip(checked.logits, expected.logits, strict=True))
    same = bool(torch.equal(checked.sequences, expected.sequences))
    print(f"check: same tokens as DynamicCache {same}, max |logit difference| {worst:.2e}")
    if not same or worst > LOGIT_TOLERANCE:
        return 1
    reference_bytes = dynamic_bytes(expected.cache)

    samples: dict[str, list[float]] = {"ours": [], "dynamic": []}
    for repeat in range(args.repeats):
        turns: list[tuple[str, Callable[[], object]]] = [
            ("ours", lambda: ours("groups")),
            ("dynamic", lambda: generate(reference, ids, mask, args.new_tokens)),
        ]
        for name, run in turns[repeat % 2 :] + turns[: repeat % 2]:
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    mine, theirs = statistics.median(samples["ours"]), statistics.median(samples["dynamic"])
    print(f"generate (median of {args.repeats}): ours {mine:.2f} s, DynamicCache {theirs:.2f} s: {theirs / mine:.2f}x")
    print(
        f"KV memory at the end: ours {mib(ours_bytes)} (one group: {mib(one_group_bytes)}, "
        f"{ours_bytes / one_group_bytes:.2f}x), DynamicCache {mib(reference_bytes)} (padding included): "
        f"ours / DynamicCache {ours_bytes / reference_bytes:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
