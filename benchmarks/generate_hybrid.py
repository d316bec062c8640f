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
otherwise), then the median times (``--statistic``) of ``--repeats`` runs taken in turns and
DynamicCache / ours, and the KV memory each holds at the end (ours: the pool's
``used_memory_bytes``; DynamicCache: the bytes of its key and value tensors). Nothing
asserts a time.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/generate_hybrid.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import torch  # after the offline switch, which transformers reads on import
from _harness import BenchParser, draw_lengths, generation, mib, print_environment, require, run, take_turns
from _harness.torch_decode import kv_tensor_bytes

from kvcache_core import PagedKvCacheManager, create_manager
from kvcache_torch.hf import PagedCache, cache_config_for

Model = generation.Model

VOCAB = 512


def build(args: argparse.Namespace) -> tuple[Model, Model]:
    """``(ours, reference)``: the same random weights, each with its attention."""
    layer_types = ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(args.layers)]
    model = generation.random_model(
        "qwen2",
        generation.ModelShape(args.layers, hidden=256, intermediate=512, query_heads=8, kv_heads=2, vocab=VOCAB),
        seed=args.seed,
        max_positions=args.max_length + args.new_tokens,
        initializer_range=0.1,
        use_sliding_window=True,
        sliding_window=args.window,
        layer_types=layer_types,
    )
    return generation.paired_models(model)


def generate(model: Model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **options: Any) -> Any:
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **options
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="4 layers, window 32, 2 prompts of 64-128 tokens, 8 new tokens, 1 repeat")
    parser.geometry(layers=(8, 4))
    parser.flag("--window", (256, 32), help="sliding window of the even layers")
    parser.lengths(count=(4, 2), min_length=(1024, 64), max_length=(2048, 128))
    parser.flag("--new-tokens", (64, 8), help="tokens to generate")
    parser.timing((3, 1), what="timed runs of each")
    parser.seed(what="weights, prompts and lengths")
    return parser.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Check, time and print; ``DisagreementError`` if ours disagrees with DynamicCache."""
    args = parse_args(argv)
    print_environment()
    ours_model, reference = build(args)
    lengths = draw_lengths(args.seed, args.batch_size, args.min_length, args.max_length)
    ids, mask = generation.left_padded_prompts(lengths, VOCAB, args.seed + 1)
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
    same, worst = generation.agreement(checked, expected)
    print(f"check: same tokens as DynamicCache {same}, max |logit difference| {worst:.2e}")
    require(same and worst <= generation.LOGIT_TOLERANCE, "ours and DynamicCache disagree")
    reference_bytes = kv_tensor_bytes(expected.cache)

    times = take_turns(
        {"ours": lambda: ours("groups"), "dynamic": lambda: generate(reference, ids, mask, args.new_tokens)},
        rounds=args.repeats,
        statistic=args.statistic,
    )
    mine, theirs = times.seconds("ours"), times.seconds("dynamic")
    print(
        f"generate ({args.statistic} of {args.repeats}): ours {mine:.2f} s, DynamicCache {theirs:.2f} s: "
        f"{theirs / mine:.2f}x"
    )
    print(
        f"KV memory at the end: ours {mib(ours_bytes)} (one group: {mib(one_group_bytes)}, "
        f"{ours_bytes / one_group_bytes:.2f}x), DynamicCache {mib(reference_bytes)} (padding included): "
        f"ours / DynamicCache {ours_bytes / reference_bytes:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
