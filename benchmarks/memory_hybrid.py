"""Memory and decode-step time of a hybrid state-space model: PagedCache against DynamicCache.

The model is Bamba-9B's shape scaled down uniformly by 16 in width, so that what matters for
memory keeps its proportion: transformers' ``BambaConfig`` defaults (those of
``ibm-fms/Bamba-9.8b-2.2T-hf``: hidden 4096, 32 layers, attention in layers 9, 18 and 27, 32
query and 8 KV heads of 128, Mamba2 mixers of 128 heads of 64 with a state of 256, one group,
expand 2, conv 4) become hidden 256, 8 query and 2 KV heads of 32, 8 Mamba heads of 64, the
state of 256, the 32 layers and their pattern kept. A row's recurrent states then weigh as
many K/V tokens as in Bamba-9B (about 10,000: the break-even is printed), since each mixer's
state (heads x head size x state size) and each attention layer's K/V per token shrink by 16
alike. Random weights, float32, CPU.

It generates greedily through transformers' ``generate``, once with transformers'
``DynamicCache`` and once with kvcache's ``PagedCache`` (``kvcache_paged`` attention;
recurrent states in the pool's state slots, K/V in its blocks). Printed per prompt length
(``--lengths``, the longest row's), for a batch of equal prompts and a ragged, left-padded
batch (row ``i`` holds ``length / 2**i`` tokens): the bytes each cache holds at the end
(DynamicCache: every layer's K/V and states; ours: ``stats().used_memory_bytes``, the blocks
and state slots in use), ours / DynamicCache, and the floor no cache keeping every real
token can go below (the states plus the real tokens' K/V, over DynamicCache's). Then the
decode-step time of each on the equal batch of the first length (``--statistic`` of the
forwards of one new token of ``--repeats`` runs of ``generate`` in turns, each forward timed
alone). Both must produce the same tokens (exit 1 otherwise). Nothing asserts a time.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/memory_hybrid.py [--quick] [--lengths 256,2048]
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from _harness import STATISTICS, BenchParser, generation, int_list, mib, print_environment, require, run, take_turns

from kvcache_core import create_manager
from kvcache_torch.hf import ATTN_IMPLEMENTATION, PagedCache, cache_config_for

VOCAB, BLOCK, SCALE = 512, 16, 16
#: Bamba-9B (``BambaConfig``'s defaults) and its attention layers.
HIDDEN, LAYERS, QUERY_HEADS, KV_HEADS, ATTENTION_LAYERS = 4096, 32, 32, 8, (9, 18, 27)
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE, MAMBA_CONV, MAMBA_EXPAND = 128, 64, 256, 4, 2


def build() -> tuple[Any, Any]:
    """``(ours, reference)``: the same random weights, ours with the paged attention."""
    config = transformers.BambaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN // SCALE,
        intermediate_size=2 * HIDDEN // SCALE,
        num_hidden_layers=LAYERS,
        num_attention_heads=QUERY_HEADS // 4,  # head size 32: KV heads x head size shrink by 16
        num_key_value_heads=KV_HEADS // 4,
        attn_layer_indices=list(ATTENTION_LAYERS),
        mamba_n_heads=MAMBA_HEADS // SCALE,
        mamba_d_head=MAMBA_HEAD_DIM,
        mamba_d_state=MAMBA_STATE,
        mamba_n_groups=1,
        mamba_expand=MAMBA_EXPAND,
        mamba_d_conv=MAMBA_CONV,
        mamba_chunk_size=64,
        initializer_range=0.1,
        pad_token_id=0,
        eos_token_id=None,
    )
    torch.random.manual_seed(0)  # pyright: ignore[reportUnknownMemberType]  # seed untyped in torch
    reference: Any = transformers.BambaForCausalLM(config)
    reference.eval()
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


def dynamic_bytes(cache: Any) -> tuple[int, int]:
    """``(K/V bytes, state bytes)`` a ``DynamicCache`` holds: each layer's K/V, and its conv and recurrent states."""
    kv = states = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            kv += tensor.nbytes if isinstance(tensor, torch.Tensor) else 0
        for held in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            states += sum(tensor.nbytes for tensor in held.values() if isinstance(tensor, torch.Tensor))
    return kv, states


def generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, cache: Any = None) -> Any:
    settings: dict[str, Any] = {"max_new_tokens": new_tokens, "do_sample": False, "return_dict_in_generate": True}
    if cache is not None:
        settings["cache"] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **settings)


def paged_cache(model: Any, batch: int, tokens: int) -> PagedCache:
    blocks = batch * -(-tokens // BLOCK) + batch
    config = cache_config_for(model, num_blocks=blocks, block_size=BLOCK, state_slots=batch)
    return PagedCache(create_manager("torch", config), model)


def break_even(model: Any) -> str:
    """A row's recurrent states in K/V tokens (bytes per row of every state layer over bytes
    per token of every attention layer), from our pool's figures."""
    config = cache_config_for(model, num_blocks=1, block_size=BLOCK)
    return f"a row's states weigh {config.states.bytes_per_slot / config.bytes_per_token:,.0f} K/V tokens"


def main(argv: Sequence[str] | None = None) -> int:
    """Print bytes and decode-step time of both caches."""
    parser = BenchParser(__doc__, quick="2 rows, prompts of 32, 4 new tokens, 1 repeat")
    parser.flag("--batch", (4, 2), help="requests")
    parser.flag("--lengths", ([256, 2048], [32]), type=int_list, help="prompt tokens (the longest row's)")
    parser.flag("--new-tokens", (16, 4), help="tokens generated")
    parser.timing((3, 1), what="timed runs of each")
    args = parser.parse(argv)
    print_environment()
    torch.set_num_threads(1)
    ours, reference = build()
    print(
        f"Bamba-9B-shaped, 1/{SCALE} the width: {LAYERS} layers (attention in {list(ATTENTION_LAYERS)}), hidden "
        f"{HIDDEN // SCALE}, {KV_HEADS // 4}x32 KV heads, {MAMBA_HEADS // SCALE} Mamba heads of {MAMBA_HEAD_DIM}, "
        f"state {MAMBA_STATE}, float32; {args.batch} rows, {args.new_tokens} new tokens; {break_even(ours)}"
    )
    print(
        f"{'tokens':>7} {'batch':>7} {'DynamicCache':>13} {'(states)':>9} {'PagedCache':>11} {'ratio':>7} {'floor':>7}"
    )
    for length in args.lengths:
        for ragged in (False, True):
            ids, mask = prompts(args.batch, length, ragged)
            expected = generate(reference, ids, mask, args.new_tokens)
            cache = paged_cache(ours, args.batch, length + args.new_tokens)
            found = generate(ours, ids, mask, args.new_tokens, cache)
            require(torch.equal(found.sequences, expected.sequences), "PagedCache generated other tokens")
            kv, states = dynamic_bytes(expected.cache)
            theirs, mine = kv + states, cache.manager.stats().used_memory_bytes
            stored = int(mask.sum()) + args.batch * (args.new_tokens - 1)  # the last token is never fed back
            floor = (states + kv * stored / (args.batch * (length + args.new_tokens - 1))) / theirs
            print(
                f"{length:>7} {'ragged' if ragged else 'equal':>7} {mib(theirs):>13} {mib(states):>9} "
                f"{mib(mine):>11} {mine / theirs:>6.3f}x {floor:>6.3f}x"
            )
            cache.release()
    ids, mask = prompts(args.batch, args.lengths[0], False)
    cache = paged_cache(ours, args.batch, args.lengths[0] + args.new_tokens)

    decode: dict[str, list[float]] = {"paged": [], "dynamic": []}

    def with_paged() -> Any:
        cache.release()
        return generate(ours, ids, mask, args.new_tokens, cache)

    competitors = {
        "dynamic": generation.timed_decode(
            reference, lambda: generate(reference, ids, mask, args.new_tokens), decode["dynamic"]
        ),
        "paged": generation.timed_decode(ours, with_paged, decode["paged"]),
    }
    for warm in competitors.values():  # untimed: first touches
        warm()
    for samples in decode.values():
        samples.clear()
    take_turns(competitors, rounds=args.repeats, statistic=args.statistic)
    ours_step, their_step = (STATISTICS[args.statistic](decode[name]) for name in ("paged", "dynamic"))
    print(
        f"decode step, {args.lengths[0]}-token prompts ({args.statistic} of {len(decode['paged'])} forwards of one "
        f"token, {args.repeats} runs each): PagedCache {ours_step * 1e3:.2f} ms, DynamicCache "
        f"{their_step * 1e3:.2f} ms: DynamicCache / ours {their_step / ours_step:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
