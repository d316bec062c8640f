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
must agree: the last request's outputs are compared every run and the script exits with
status 1 if they differ. Printed: blocks in use once every request is admitted, the pool
bytes they take, the tokens computed, the prefix-cache hit rate, and the median time
(``--statistic``) to admit all requests over ``--repeats`` runs (a fresh manager each, made
outside the timed region, the two configurations taking turns), with ratios. Nothing here
asserts a time. ``prefix_tiers.py`` measures the prefix cache with offload tiers behind it.

Run, from the repository root::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 OPENBLAS_NUM_THREADS=1 \\
        .venv/bin/python benchmarks/prefix.py              # ~10 s on 2 cores
    .venv/bin/python benchmarks/prefix.py --quick          # ~1 s
    .venv/bin/python benchmarks/prefix.py --no-attention   # the cache's own work only
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from _harness import BenchParser, agree, print_environment, ratio, require, run, take_turns

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager

Array = npt.NDArray[Any]
Manager = PagedKvCacheManager[Array]
LABELS = {False: "no prefix caching", True: "prefix caching"}


@dataclass(frozen=True)
class Workload:
    """The requests' prompts and the K/V every position gets."""

    prompts: tuple[tuple[int, ...], ...]
    keys: Array  # [layers, max_length, kv_heads, head_dim]
    values: Array
    queries: Array  # [max_length, query_heads, head_dim]


@dataclass(frozen=True)
class Admission:
    """What admitting every request under one configuration left."""

    manager: Manager
    computed_tokens: int
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


def fresh_managers(args: argparse.Namespace, workload: Workload) -> dict[bool, Manager]:
    """An empty pool per configuration (prefix caching off, on), large enough for every
    prompt without sharing."""
    block_size = args.block_size
    managers: dict[bool, Manager] = {}
    for prefix_caching in (False, True):
        config = CacheConfig(
            num_layers=args.layers,
            num_heads=args.kv_heads,
            head_dim=args.head_dim,
            num_blocks=sum(-(-len(prompt) // block_size) for prompt in workload.prompts),
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
        )
        managers[prefix_caching] = create_manager("numpy", config)
    return managers


def admit_all(args: argparse.Namespace, workload: Workload, manager: Manager) -> Admission:
    """Admit every request into ``manager``."""
    computed = 0
    outputs: list[Array] = []
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
    return Admission(manager, computed, outputs)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="16 requests, a 512-token prompt, 2 repeats")
    parser.flag("--requests", (64, 16), help="requests admitted")
    parser.flag("--prompt-length", (1000, 512), help="tokens of the shared system prompt")
    parser.flag("--min-suffix", 8, help="shortest distinct suffix")
    parser.flag("--max-suffix", 64, help="longest distinct suffix")
    parser.require(lambda args: args.min_suffix <= args.max_suffix, "--min-suffix must be <= --max-suffix")
    parser.geometry(layers=2, kv_heads=2, head_dim=64, block_size=16)
    parser.flag("--group", 2, help="query heads per KV head")
    parser.timing((3, 2), what="timed admissions of each configuration")
    parser.seed(what="prompts and K/V")
    parser.add_argument("--no-attention", dest="attention", action="store_false", help="skip the prefill attention")
    return parser.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Admit the workload under both configurations and print them side by side;
    ``DisagreementError`` if their attention outputs differ."""
    args = parse_args(argv)
    print_environment()
    workload = make_workload(args)
    print(
        f"{args.requests} requests: a {args.prompt_length}-token shared prompt + {args.min_suffix}-{args.max_suffix} "
        f"distinct tokens; block size {args.block_size}; {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_dim} (float32); prefill attention {'on' if args.attention else 'off'}; "
        f"{args.statistic} of {args.repeats} runs"
    )
    # The last request's outputs for the tokens both configurations computed.
    suffix = len(workload.prompts[-1]) - (len(workload.prompts[-1]) - 1) // args.block_size * args.block_size
    admissions: dict[bool, Admission] = {}

    def check(results: Mapping[str, Admission], index: int) -> None:
        plain, cached = results[LABELS[False]], results[LABELS[True]]
        admissions.update({False: plain, True: cached})
        if args.attention:
            same, worst = agree(
                [out[-suffix:] for out in plain.last_output], [out[-suffix:] for out in cached.last_output]
            )
            require(same, f"attention outputs differ between the two configurations by {worst:.3e} (run {index})")

    def admitting(prefix_caching: bool) -> Callable[[dict[bool, Manager]], Admission]:
        return lambda managers: admit_all(args, workload, managers[prefix_caching])

    times = take_turns(
        {label: admitting(prefix_caching) for prefix_caching, label in LABELS.items()},
        rounds=args.repeats,
        inputs=lambda: fresh_managers(args, workload),
        check=check,
        statistic=args.statistic,
    )
    header = f"{'':<20}{'blocks used':>13}{'pool MiB':>10}{'tokens computed':>17}{'hit rate':>10}{'admit all (s)':>15}"
    print(header)
    print("-" * len(header))
    stats = {on: admission.manager.stats() for on, admission in admissions.items()}
    for on, label in LABELS.items():
        print(
            f"{label:<20}{stats[on].used_blocks:>13}{stats[on].used_memory_bytes / 2**20:>10.1f}"
            f"{admissions[on].computed_tokens:>17}{stats[on].cache_hit_rate:>10.3f}{times.seconds(label):>15.3f}"
        )
    print(
        f"ratios (no caching / caching): blocks {ratio(stats[False].used_blocks, stats[True].used_blocks)}, "
        f"tokens computed {ratio(admissions[False].computed_tokens, admissions[True].computed_tokens)}, "
        f"time {ratio(times.seconds(LABELS[False]), times.seconds(LABELS[True]))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
