"""Memory and decode time of a hybrid state-space model: PagedCache against DynamicCache.

A Bamba-shaped random-weight model (Mamba2 mixers in three layers of four, attention in the
fourth; float32, CPU) generates greedily through transformers' ``generate``, once with
transformers' ``DynamicCache`` and once with kvcache's ``PagedCache`` (``kvcache_paged``
attention; recurrent states in the pool's state slots, K/V in its blocks). Printed, side by
side: the bytes each cache holds at the end (DynamicCache: every layer's K/V and states;
ours: ``stats().used_memory_bytes``, the blocks and state slots in use) for a batch of
equal prompts and for a ragged, left-padded batch, and the time per generated token. Both
runs must produce the same tokens.

    .venv/bin/python benchmarks/memory_hybrid.py [--batch 4] [--prompt 256] [--new-tokens 32]
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from _harness import BenchParser, DisagreementError, mib, print_environment, run, take_turns

from kvcache_core import create_manager
from kvcache_torch.hf import ATTN_IMPLEMENTATION, PagedCache, cache_config_for

VOCAB, BLOCK = 512, 16


def build(layers: int, hidden: int) -> tuple[Any, Any]:
    """``(ours, reference)``: the same random weights, ours with the paged attention."""
    config = transformers.BambaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        attn_layer_indices=list(range(3, layers, 4)),
        mamba_n_heads=hidden // 16,
        mamba_d_head=32,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_expand=2,
        mamba_d_conv=4,
        mamba_chunk_size=64,
        initializer_range=0.1,
        pad_token_id=0,
        eos_token_id=None,
    )
    torch.random.manual_seed(0)  # pyright: ignore[reportUnknownMemberType]  # seed untyped in torch
    reference: Any = transformers.BambaForCausalLM(config).eval()
    ours: Any = copy.deepcopy(reference)
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    return ours, reference


def prompts(batch: int, length: int, ragged: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and mask; a ragged batch's row ``i`` is left-padded to hold ``length / 2**i`` tokens."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch if ragged else 0):
        pad = length - max(1, length >> row)
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def dynamic_bytes(cache: Any) -> int:
    """Bytes a ``DynamicCache`` holds: each layer's K/V and its conv and recurrent states."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            total += tensor.nbytes if isinstance(tensor, torch.Tensor) else 0
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            total += sum(tensor.nbytes for tensor in states.values() if isinstance(tensor, torch.Tensor))
    return total


def generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, cache: Any = None) -> Any:
    settings: dict[str, Any] = {"max_new_tokens": new_tokens, "do_sample": False, "return_dict_in_generate": True}
    if cache is not None:
        settings["cache"] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **settings)


def paged_cache(model: Any, batch: int, tokens: int) -> PagedCache:
    blocks = batch * -(-tokens // BLOCK) + batch
    config = cache_config_for(model, num_blocks=blocks, block_size=BLOCK, state_slots=batch)
    return PagedCache(create_manager("torch", config), model.config)


def main(argv: Sequence[str] | None = None) -> int:
    """Print bytes and time per token of both caches."""
    parser = BenchParser(__doc__, quick="a small model, short prompts")
    parser.flag("--batch", (4, 2), help="requests")
    parser.flag("--prompt", (256, 32), help="prompt tokens (the longest row of the ragged batch)")
    parser.flag("--new-tokens", (32, 4), help="tokens generated")
    parser.flag("--layers", (8, 4), help="layers (every fourth is attention)")
    parser.flag("--hidden", (256, 64), help="hidden size")
    parser.flag("--rounds", (3, 1), help="timed rounds")
    args = parser.parse(argv)
    print_environment()
    torch.set_num_threads(1)
    ours, reference = build(args.layers, args.hidden)
    tokens = args.prompt + args.new_tokens
    print(f"Bamba-shaped: {args.layers} layers (every fourth attention), hidden {args.hidden}, float32")
    print(f"{'batch':>8} {'DynamicCache':>14} {'PagedCache':>12} {'ratio':>7}")
    for ragged in (False, True):
        ids, mask = prompts(args.batch, args.prompt, ragged)
        expected = generate(reference, ids, mask, args.new_tokens)
        cache = paged_cache(ours, args.batch, tokens)
        found = generate(ours, ids, mask, args.new_tokens, cache)
        if not torch.equal(found.sequences, expected.sequences):
            raise DisagreementError("PagedCache generated other tokens than DynamicCache")
        theirs, mine = dynamic_bytes(expected.cache), cache.manager.stats().used_memory_bytes
        print(f"{'ragged' if ragged else 'equal':>8} {mib(theirs):>14} {mib(mine):>12} {mine / theirs:>6.3f}x")
        cache.release()
    ids, mask = prompts(args.batch, args.prompt, False)
    cache = paged_cache(ours, args.batch, tokens)

    def with_paged() -> Any:
        cache.release()
        return generate(ours, ids, mask, args.new_tokens, cache)

    timings = take_turns(
        {"dynamic": lambda: generate(reference, ids, mask, args.new_tokens), "paged": with_paged},
        rounds=args.rounds,
        warmup=1,
    )
    per_token = {name: timings.seconds(name) / args.new_tokens * 1e3 for name in ("dynamic", "paged")}
    print(
        f"generate, ms per token (prefill included): DynamicCache {per_token['dynamic']:.2f}, "
        f"PagedCache {per_token['paged']:.2f}, {per_token['paged'] / per_token['dynamic']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
