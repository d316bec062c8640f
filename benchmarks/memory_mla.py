"""KV memory and decode-step time of a multi-head latent attention model: PagedCache against
DynamicCache, side by side in one process.

The model is a random-weight DeepSeek-V3-shaped decoder (``--layers`` layers, 16 query heads,
a latent of ``kv_lora_rank = 128`` and a rotary part of 32 per token, 1 dense layer then
mixture of experts), fp32 on the CPU. Its attention reads the cached latent back and
expands it into every head's K/V itself, so PagedCache runs the contiguous path (``sdpa``);
the pool (``cache_config_for``) holds what ``update`` receives: one head, keys of 128 and
values of 32 (``CacheConfig.value_head_dim``), not expanded heads, and no padding (the cache
is built with the model, whose forward hook hands it each forward's padding mask; the
contiguous K/V handed back hold zeros there, a transient tensor). Two batches generate
``--new-tokens`` tokens greedily:

* **equal**: ``--batch-size`` prompts of one length (the tokens cached at the end fill whole
  blocks), so both caches hold the same tokens;
* **ragged**: prompts of ``--min-length`` to ``--max-length`` tokens, left-padded.

Printed per batch: one run of each checked first (same tokens, logits within 1e-3; exit 1
otherwise), the KV bytes each holds at the end (ours: the pool's ``used_memory_bytes``;
DynamicCache: the bytes of its key and value tensors) and ours / DynamicCache, beside the
floor of a cache keeping every real token and no padding (the batch's real tokens over its
padded positions) and what a pool of expanded heads (``num_heads x (qk_head_dim +
v_head_dim)``) would take; then the decode-step time of each (``--statistic`` of every
forward of one new token over ``--repeats`` runs of ``generate`` in turns, each forward
timed alone) and DynamicCache / ours. Nothing asserts a time.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/memory_mla.py [--quick]
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
from _harness import (
    STATISTICS,
    BenchParser,
    draw_lengths,
    generation,
    mib,
    print_environment,
    require,
    run,
    take_turns,
)
from _harness.torch_decode import kv_tensor_bytes

from kvcache_core import PagedKvCacheManager, create_manager
from kvcache_torch.hf import PagedCache, cache_config_for

Model = generation.Model

VOCAB = 512
BLOCK = 16
QUERY_HEADS, LATENT, ROPE, NOPE, VALUE = 16, 128, 32, 64, 64


def build(args: argparse.Namespace) -> tuple[Model, Model]:
    """``(ours, reference)``: the same random weights, both on ``sdpa`` (their own configs)."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=QUERY_HEADS,
        num_key_value_heads=QUERY_HEADS,
        kv_lora_rank=LATENT,
        q_lora_rank=None,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=VALUE,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=args.max_length + args.new_tokens + BLOCK,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    torch.random.manual_seed(args.seed)  # pyright: ignore[reportUnknownMemberType]  # seed untyped in torch
    reference: Model = transformers.DeepseekV3ForCausalLM(config)
    reference.eval()
    reference.set_attn_implementation("sdpa")
    ours: Model = copy.deepcopy(reference)
    return ours, reference


def generate(model: Model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **options: Any) -> Any:
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **options
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="2 layers, 2 prompts of 48-112 tokens, 16 new tokens, 1 repeat")
    parser.geometry(layers=(4, 2))
    parser.lengths(count=(4, 2), min_length=(256, 48), max_length=(1008, 112))
    parser.flag("--new-tokens", (32, 16), help="tokens to generate")
    parser.timing((3, 1), what="timed runs of each")
    parser.seed(what="weights, prompts and lengths")
    return parser.parse(argv)


def expanded_bytes(model: Model, tokens: int) -> int:
    """What a pool of expanded heads would hold for ``tokens`` (K of ``qk_head_dim``, V of
    ``v_head_dim`` per query head, every layer), in the model's dtype (fp32)."""
    config = model.config
    per_head = int(config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return tokens * int(config.num_hidden_layers) * int(config.num_attention_heads) * per_head * 4


def compare(
    name: str, ours_model: Model, reference: Model, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace
) -> None:
    """Check one batch, then print its memory and decode-step times."""
    blocks = ids.shape[0] * -(-(ids.shape[1] + args.new_tokens) // BLOCK) + BLOCK
    manager: PagedKvCacheManager[torch.Tensor] = create_manager(
        "torch", cache_config_for(ours_model, num_blocks=blocks, block_size=BLOCK)
    )

    def ours(new_tokens: int, **options: Any) -> tuple[Any, int]:
        with PagedCache(manager, ours_model) as cache:  # the model: its hook brings the padding mask
            out = generate(ours_model, ids, mask, new_tokens, cache=cache, **options)
            return out, manager.stats().used_memory_bytes

    checked, ours_bytes = ours(args.new_tokens, output_logits=True)
    expected = generate(reference, ids, mask, args.new_tokens, output_logits=True)
    same, worst = generation.agreement(checked, expected)
    print(f"{name}: same tokens as DynamicCache {same}, max |logit difference| {worst:.2e}")
    require(same and worst <= generation.LOGIT_TOLERANCE, f"{name}: ours and DynamicCache disagree")
    reference_bytes = kv_tensor_bytes(expected.cache)
    stored = int(mask.sum()) + ids.shape[0] * args.new_tokens
    # The floor of any cache keeping every real token: real tokens over the padded batch's positions
    # (the last new token is never fed back).
    kept = int(mask.sum()) + ids.shape[0] * (args.new_tokens - 1)
    floor = kept / (ids.shape[0] * (ids.shape[1] + args.new_tokens - 1))
    print(
        f"{name}: KV memory at the end: ours {mib(ours_bytes)}, DynamicCache {mib(reference_bytes)}: "
        f"ours / DynamicCache {ours_bytes / reference_bytes:.2f}x (the real tokens alone: {floor:.2f}x; "
        f"expanded heads: {mib(expanded_bytes(ours_model, stored))})"
    )
    decode: dict[str, list[float]] = {"ours": [], "dynamic": []}
    take_turns(
        {
            "ours": generation.timed_decode(ours_model, lambda: ours(args.new_tokens), decode["ours"]),
            "dynamic": generation.timed_decode(
                reference, lambda: generate(reference, ids, mask, args.new_tokens), decode["dynamic"]
            ),
        },
        rounds=args.repeats,
        statistic=args.statistic,
    )
    mine, theirs = (STATISTICS[args.statistic](decode[name]) for name in ("ours", "dynamic"))
    print(
        f"{name}: decode step ({args.statistic} of {len(decode['ours'])} forwards of one token, {args.repeats} runs "
        f"each): ours {mine * 1e3:.2f} ms, DynamicCache {theirs * 1e3:.2f} ms: DynamicCache / ours {theirs / mine:.2f}x"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Check, measure and print; ``DisagreementError`` if ours disagrees with DynamicCache."""
    args = parse_args(argv)
    print_environment()
    ours_model, reference = build(args)
    print(
        f"DeepSeek-V3-like, {args.layers} layers, {QUERY_HEADS} query heads, latent {LATENT} + rotary {ROPE} per token, "
        f"fp32; {args.batch_size} prompts, {args.new_tokens} new tokens; pool: "
        f"{cache_config_for(ours_model, num_blocks=1).bytes_per_token} bytes per token"
    )
    # The last new token is never fed back: the caches end holding prompt + new - 1 tokens,
    # a whole number of blocks here.
    equal = args.max_length - (args.max_length + args.new_tokens - 1) % BLOCK
    ids, mask = generation.left_padded_prompts([equal] * args.batch_size, VOCAB, args.seed + 1)
    compare("equal", ours_model, reference, ids, mask, args)
    lengths = draw_lengths(args.seed, args.batch_size, args.min_length, args.max_length)
    ids, mask = generation.left_padded_prompts(lengths, VOCAB, args.seed + 2)
    compare("ragged", ours_model, reference, ids, mask, args)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
