"""Admitting requests that share a system prompt, with and without prefix caching, side by side.

What is compared, in one process, on the same workload: ``--requests`` requests (64 by
default) whose prompts are one ``--prompt-length``-token system prompt (1,000) followed by
a distinct suffix of ``--min-suffix`` to ``--max-suffix`` tokens (8 to 64, fixed
``--seed``), admitted one after the other into a NumPy pool of block size
``--block-size`` (16) that is large enough for all of them without sharing:

* **no prefix caching** -- ``CacheConfig(enable_prefix_caching=False)``: every request
  computes its whole prompt;
* **prefix caching** -- ``CacheConfig(enable_prefix_caching=True)``: ``allocate`` maps the
  cached full blocks of the prompt and the request computes only the rest.

Admitting one request is what a serving engine does at prefill, minus the model's
matmuls: ``allocate(AllocationRequest(prompt_token_ids=...))``, ``extend`` over the
tokens not cached, then for every layer one ``write`` of their K/V and one
``paged_attention`` of their queries over the whole context (the NumPy reference, read
in place). The K/V of position ``p`` are the same in both runs, so the attention outputs
must agree: the last request's outputs are compared and the script exits with status 1
if they differ. Printed: blocks in use once every request is admitted, the pool bytes
they take, the tokens computed, the prefix-cache hit rate, and the median time to admit
all requests over ``--repeats`` runs (a fresh manager each, the two configurations
alternating), with ratios. Nothing here asserts a time.

Then a multi-turn chat of several tenants (``--tenants`` 4, each with its own
``cache_salt`` and system prompt, ``--conversations`` 6 each, ``--turns`` 5 turns that
grow each conversation by its answer and a new question), every turn admitted in
round-robin order into a pool a tenth of the working set (the distinct blocks of every
conversation's final prompt), once without offload tiers and once with a host tier (a
third of the working set) and a disk tier (all of it) behind the pool. Printed: the
prefix-cache hit rate (full prompt blocks served from the cache), the tokens computed and
each tier's hits, with the ratio of the hit rates; every turn gathers its request's K/V
from the pool and compares it bit for bit with what was written (exit status 1 on a
difference, or a ratio under 2x).

Run, from the repository root::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 OPENBLAS_NUM_THREADS=1 \\
        .venv/bin/python benchmarks/prefix.py              # ~10 s on 2 cores
    .venv/bin/python benchmarks/prefix.py --quick          # ~1 s
    .venv/bin/python benchmarks/prefix.py --no-attention   # the cache's own work only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager
from kvcache_core.offload.tiers import DiskTier, HostTier, OffloadTier

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class Workload:
    """The requests' prompts and the K/V every position gets."""

    prompts: tuple[tuple[int, ...], ...]
    keys: Array  # [layers, max_length, kv_heads, head_dim]
    values: Array
    queries: Array  # [max_length, query_heads, head_dim]


@dataclass(frozen=True)
class Admission:
    """What admitting every request under one configuration measured."""

    seconds: float
    used_blocks: int
    used_bytes: int
    computed_tokens: int
    hit_rate: float
    last_output: list[Array]  # the last request's attention output, per layer


def make_workload(args: argparse.Namespace) -> Workload:
    rng = np.random.default_rng(args.seed)
    system: list[int] = rng.integers(0, 32_000, int(args.prompt_length)).tolist()
    prompts: list[tuple[int, ...]] = []
    for index in range(args.requests):
        suffix_length = int(rng.integers(int(args.min_suffix), int(args.max_suffix) + 1))
        suffix: list[int] = rng.integers(0, 32_000, suffix_length - 1).tolist()
        prompts.append((*system, 40_000 + index, *suffix))  # distinct from its first token
    longest = max(len(prompt) for prompt in prompts)
    shape = (args.layers, longest, args.kv_heads, args.head_dim)
    return Workload(
        prompts=tuple(prompts),
        keys=rng.standard_normal(shape).astype(np.float32),
        values=rng.standard_normal(shape).astype(np.float32),
        queries=rng.standard_normal((longest, args.kv_heads * args.group, args.head_dim)).astype(np.float32),
    )


def admit_all(args: argparse.Namespace, workload: Workload, prefix_caching: bool) -> Admission:
    """Admit every request into a fresh manager; time only the admissions."""
    block_size = args.block_size
    config = CacheConfig(
        num_layers=args.layers,
        num_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_blocks=sum(-(-len(prompt) // block_size) for prompt in workload.prompts),
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
    )
    manager: PagedKvCacheManager[Array] = create_manager("numpy", config)
    computed = 0
    outputs: list[Array] = []
    started = time.perf_counter()
    for index, prompt in enumerate(workload.prompts):
        handle = manager.allocate(AllocationRequest(f"r{index}", initial_tokens=len(prompt), prompt_token_ids=prompt))
        start = handle.num_tokens()
        count = len(prompt) - start
        slots = manager.extend(handle, count)
        computed += count
        for layer in range(args.layers):
            manager.write(
                layer, slots, workload.keys[layer, start : len(prompt)], workload.values[layer, start : len(prompt)]
            )
        if args.attention:
            page_table = manager.page_table([handle])
            indptr = np.array([0, count], dtype=np.int32)
            outputs = [
                manager.paged_attention(layer, workload.queries[start : len(prompt)], page_table, qo_indptr=indptr)
                for layer in range(args.layers)
            ]
    seconds = time.perf_counter() - started
    stats = manager.stats()
    return Admission(
        seconds=seconds,
        used_blocks=stats.used_blocks,
        used_bytes=stats.used_memory_bytes,
        computed_tokens=computed,
        hit_rate=stats.cache_hit_rate,
        last_output=outputs,
    )


def outputs_agree(first: Admission, second: Admission, suffix: int) -> bool:
    """The last request's outputs for the tokens both computed agree."""
    return all(
        np.allclose(a[-suffix:], b[-suffix:], rtol=1e-4, atol=1e-5)
        for a, b in zip(first.last_output, second.last_output, strict=True)
    )


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


def compare_tiers(args: argparse.Namespace) -> int:
    """The multi-turn chat without and with offload tiers; 1 on a K/V mismatch or under 2x."""
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
        f"\nmulti-turn chat: {args.tenants} tenants x {args.conversations} conversations x {args.turns} turns; "
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
    for name, run in (("no tiers", plain), ("host + disk tiers", tiered)):
        print(
            f"{name:<20}{run.hits / run.queries:>10.3f}{run.computed_tokens:>17}{run.tier_hits.get('host', 0):>11}"
            f"{run.tier_hits.get('disk', 0):>11}{'yes' if not run.mismatches else 'NO':>11}"
        )
    ratio = (tiered.hits / tiered.queries) / max(plain.hits / plain.queries, 1e-9)
    print(
        f"ratios (tiers / no tiers): hit rate {ratio:.1f}x, "
        f"tokens computed {tiered.computed_tokens / plain.computed_tokens:.2f}x"
    )
    if plain.mismatches or tiered.mismatches:
        print("FAIL: a gathered K/V differs from what was written", file=sys.stderr)
        return 1
    if ratio < 2:
        print(f"FAIL: the tiers raise the hit rate {ratio:.2f}x, under 2x", file=sys.stderr)
        return 1
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=1000, help="tokens of the shared system prompt")
    parser.add_argument("--min-suffix", type=int, default=8)
    parser.add_argument("--max-suffix", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=2, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-attention", dest="attention", action="store_false", help="skip the prefill attention")
    parser.add_argument("--tenants", type=int, default=4, help="multi-turn chat: tenants (salts)")
    parser.add_argument("--conversations", type=int, default=6, help="multi-turn chat: conversations per tenant")
    parser.add_argument("--turns", type=int, default=5, help="multi-turn chat: turns per conversation")
    parser.add_argument("--quick", action="store_true", help="16 requests, a 512-token prompt, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_length, args.repeats = 16, 512, 2
        args.tenants, args.conversations, args.turns = 3, 4, 4
    if not (1 <= args.min_suffix <= args.max_suffix) or args.requests < 1 or args.repeats < 1:
        parser.error("need 1 <= --min-suffix <= --max-suffix, --requests >= 1 and --repeats >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Admit the workload under both configurations and print them side by side."""
    args = parse_args(argv)
    workload = make_workload(args)
    print(
        f"{args.requests} requests: a {args.prompt_length}-token shared prompt + {args.min_suffix}-{args.max_suffix} "
        f"distinct tokens; block size {args.block_size}; {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_dim} (float32); prefill attention {'on' if args.attention else 'off'}; "
        f"median of {args.repeats} runs"
    )
    runs: dict[bool, list[Admission]] = {False: [], True: []}
    for _ in range(args.repeats):
        for prefix_caching in (False, True):
            runs[prefix_caching].append(admit_all(args, workload, prefix_caching))
    if args.attention:
        suffix = len(workload.prompts[-1]) - (len(workload.prompts[-1]) - 1) // args.block_size * args.block_size
        if not outputs_agree(runs[False][-1], runs[True][-1], suffix):
            print("FAIL: attention outputs differ between the two configurations", file=sys.stderr)
            return 1
    rows = {
        "no prefix caching": runs[False],
        "prefix caching": runs[True],
    }
    header = f"{'':<20}{'blocks used':>13}{'pool MiB':>10}{'tokens computed':>17}{'hit rate':>10}{'admit all (s)':>15}"
    print(header)
    print("-" * len(header))
    medians: dict[str, float] = {}
    for name, admissions in rows.items():
        first = admissions[0]
        medians[name] = statistics.median(a.seconds for a in admissions)
        print(
            f"{name:<20}{first.used_blocks:>13}{first.used_bytes / 2**20:>10.1f}{first.computed_tokens:>17}"
            f"{first.hit_rate:>10.3f}{medians[name]:>15.3f}"
        )
    plain, cached = runs[False][0], runs[True][0]
    print(
        f"ratios (no caching / caching): blocks {plain.used_blocks / cached.used_blocks:.1f}x, "
        f"tokens computed {plain.computed_tokens / cached.computed_tokens:.1f}x, "
        f"time {medians['no prefix caching'] / medians['prefix caching']:.1f}x"
    )
    return compare_tiers(args)


if __name__ == "__main__":
    sys.exit(main())
