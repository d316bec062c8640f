"""A multi-turn multi-tenant chat in a pool a tenth of its working set, without and with offload
tiers behind the prefix cache, side by side.

Several tenants (``--tenants`` 4, each with its own ``cache_salt`` and system prompt) hold
``--conversations`` conversations each (6), of ``--turns`` turns (5) that grow each
conversation by its answer and a new question; every turn is admitted in round-robin order
into a NumPy pool a tenth of the working set (the distinct blocks of every conversation's
final prompt), once without offload tiers and once with a host tier (a third of the working
set) and a disk tier (all of it) behind the pool. Printed: the prefix-cache hit rate (full
prompt blocks served from the cache), the tokens computed and each tier's hits, with the
ratio of the hit rates; every turn gathers its request's K/V from the pool and compares it
bit for bit with what was written (exit status 1 on a difference, or a ratio under 2x).
``prefix.py`` measures admitting requests with and without the prefix cache.

Run, from the repository root::

    .venv/bin/python benchmarks/prefix_tiers.py              # seconds
    .venv/bin/python benchmarks/prefix_tiers.py --quick      # 3 tenants x 4 conversations x 4 turns
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from _harness import BenchParser, print_environment, ratio, require, run

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier

Array = npt.NDArray[Any]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="3 tenants x 4 conversations x 4 turns")
    parser.flag("--tenants", (4, 3), help="tenants (salts)")
    parser.flag("--conversations", (6, 4), help="conversations per tenant")
    parser.flag("--turns", (5, 4), help="turns per conversation")
    parser.geometry(layers=2, kv_heads=2, head_dim=64, block_size=16)
    parser.seed(what="prompts and K/V")
    return parser.parse(argv)


@dataclass(frozen=True)
class Chat:
    """One conversation: its tenant and the K/V of every position of its final prompt."""

    tenant: int
    turn_lengths: tuple[int, ...]  # the prompt length at each turn
    tokens: tuple[int, ...]  # its final prompt
    keys: Array  # [layers, length, kv_heads, head_dim]
    values: Array


@dataclass(frozen=True)
class ChatRun:
    """What serving every turn measured."""

    queries: int
    hits: int
    computed_tokens: int
    tier_hits: dict[str, int]
    mismatches: int


def make_chats(args: argparse.Namespace) -> list[Chat]:
    """Tenants with their own system prompt; conversations that grow turn by turn."""
    rng = np.random.default_rng(args.seed + 1)
    chats: list[Chat] = []
    for tenant in range(args.tenants):
        system: list[int] = rng.integers(0, 32_000, 4 * int(args.block_size)).tolist()
        system_kv = rng.standard_normal((2, args.layers, len(system), args.kv_heads, args.head_dim)).astype(np.float32)
        for _ in range(args.conversations):
            tokens = list(system)
            lengths: list[int] = []
            for _ in range(args.turns):
                answer_and_question: list[int] = rng.integers(
                    0, 32_000, int(rng.integers(2, 5)) * int(args.block_size)
                ).tolist()
                tokens += answer_and_question
                lengths.append(len(tokens))
            own = (2, args.layers, len(tokens) - len(system), args.kv_heads, args.head_dim)
            kv = np.concatenate([system_kv, rng.standard_normal(own).astype(np.float32)], axis=2)
            chats.append(Chat(tenant, tuple(lengths), tuple(tokens), kv[0], kv[1]))
    return chats


def serve_chats(args: argparse.Namespace, chats: list[Chat], num_blocks: int, tiers: list[OffloadTier]) -> ChatRun:
    """Serve every turn of every conversation, round robin, checking each request's K/V."""
    config = CacheConfig(
        num_layers=args.layers,
        num_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_blocks=num_blocks,
        block_size=args.block_size,
        enable_prefix_caching=True,
        model_id="benchmark-model@1",
    )
    manager: PagedKvCacheManager[Array] = create_manager("numpy", config, tiers=tiers)
    computed = mismatches = 0
    for turn in range(args.turns):
        for index, chat in enumerate(chats):
            length = chat.turn_lengths[turn]
            prompt = chat.tokens[:length]
            request = AllocationRequest(
                f"c{index}t{turn}", initial_tokens=length, prompt_token_ids=prompt, cache_salt=f"tenant-{chat.tenant}"
            )
            handle = manager.allocate(request)
            start = handle.num_tokens()
            slots = manager.extend(handle, length - start)
            computed += length - start
            for layer in range(args.layers):
                manager.write(layer, slots, chat.keys[layer, start:length], chat.values[layer, start:length])
            for layer in range(args.layers):
                keys, values = manager.gather(handle, layer)
                exact = np.array_equal(keys, chat.keys[layer, :length]) and np.array_equal(
                    values, chat.values[layer, :length]
                )
                mismatches += not exact
            manager.deallocate(request.request_id)
    stats = manager.stats()
    tier_hits = {tier.name: tier.hits for tier in manager.tier_stats()}
    manager.close()
    return ChatRun(stats.prefix_cache_queries, stats.prefix_cache_hits, computed, tier_hits, mismatches)


def main(argv: Sequence[str] | None = None) -> int:
    """The multi-turn chat without and with offload tiers; ``DisagreementError`` on a K/V mismatch,
    1 when the tiers raise the hit rate less than 2x."""
    args = parse_args(argv)
    print_environment()
    chats = make_chats(args)
    block_size = args.block_size
    blocks: set[tuple[int, ...]] = set()
    for chat in chats:  # the working set: distinct (salt, prefix) full blocks, and each partial one
        for end in range(block_size, len(chat.tokens) + block_size, block_size):
            blocks.add((chat.tenant, *chat.tokens[: min(end, len(chat.tokens))]))
    working_set = len(blocks)
    longest = max(-(-len(chat.tokens) // block_size) for chat in chats)
    pool = max(working_set // 10, longest)
    block_bytes = 2 * args.layers * args.kv_heads * args.head_dim * 4 * block_size
    print(
        f"multi-turn chat: {args.tenants} tenants x {args.conversations} conversations x {args.turns} turns; "
        f"working set {working_set} blocks, pool {pool} blocks ({pool / working_set:.0%}); "
        f"host tier {working_set // 3} blocks, disk tier {working_set} blocks"
    )
    plain = serve_chats(args, chats, pool, [])
    with tempfile.TemporaryDirectory(prefix="kvcache-disk-tier-") as directory:
        tiers: list[OffloadTier] = [
            HostTier(working_set // 3 * block_bytes),
            DiskTier(directory, working_set * (block_bytes + 4096)),
        ]
        tiered = serve_chats(args, chats, pool, tiers)
    header = f"{'':<20}{'hit rate':>10}{'tokens computed':>17}{'host hits':>11}{'disk hits':>11}{'K/V exact':>11}"
    print(header)
    print("-" * len(header))
    for name, chat_run in (("no tiers", plain), ("host + disk tiers", tiered)):
        print(
            f"{name:<20}{chat_run.hits / chat_run.queries:>10.3f}{chat_run.computed_tokens:>17}{chat_run.tier_hits.get('host', 0):>11}"
            f"{chat_run.tier_hits.get('disk', 0):>11}{'yes' if not chat_run.mismatches else 'NO':>11}"
        )
    hit_rates = (tiered.hits / tiered.queries, max(plain.hits / plain.queries, 1e-9))
    print(
        f"ratios (tiers / no tiers): hit rate {ratio(*hit_rates)}, "
        f"tokens computed {ratio(tiered.computed_tokens, plain.computed_tokens)}"
    )
    require(not (plain.mismatches or tiered.mismatches), "a gathered K/V differs from what was written")
    if hit_rates[0] / hit_rates[1] < 2:
        print(f"FAIL: the tiers raise the hit rate {ratio(*hit_rates)}, under 2x", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
