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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager

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
    parser.add_argument("--quick", action="store_true", help="16 requests, a 512-token prompt, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_length, args.repeats = 16, 512, 2
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
