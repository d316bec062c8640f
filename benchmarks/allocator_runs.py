"""Block placement: how many runs a request's blocks form, and what each allocation step costs.

What is compared, side by side in one process: ``--requests`` requests (16 by default)
grow one token per step each, side by side, to lengths drawn uniformly between
``--min-length`` and ``--max-length`` (128 and 4096), in a pool with ``--headroom`` (25%)
more blocks than their final lengths need, through ``PagedKvCacheManager.extend`` over a
tiny NumPy storage (the placement is the same whatever the geometry), under three
placement policies:

* **contiguous, known length** -- the default allocator, each request created with
  ``AllocationRequest(max_sequence_length=length)``, so it reserves room to grow as one run;
* **contiguous, unknown length** -- the default allocator without ``max_sequence_length``
  (a new request starts in the middle of the largest gap);
* **fifo** -- ``PagedKvCacheManager(storage, placement="fifo")``, the least recently freed
  block first, as a plain free queue does (the baseline).

Two arrival patterns: ``together`` (every request starts at step 0 and stops at its
length) and ``staggered`` (request ``r`` starts at step ``max_length - length[r]``, so all
finish together, as in a running batch). For every policy it prints the max and the mean
number of runs per request (``BlockTable.runs()``; 1 means one zero-copy view for
attention), and the median time of one step (one ``extend(handle, 1)`` per active
request) over all steps and over the steps that took at least one block. Ratios are
against fifo. ``check_invariants()`` runs after every growth, outside the timing.
Nothing here asserts a time.

Run, from the repository root::

    .venv/bin/python benchmarks/allocator_runs.py              # 5 seeds, ~8 s on 2 cores
    .venv/bin/python benchmarks/allocator_runs.py --quick      # 1 seed, shorter requests
    .venv/bin/python benchmarks/allocator_runs.py --seeds 0,1,2 --arrivals staggered --verbose
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt
from _harness import (
    BenchParser,
    Stopwatch,
    draw_lengths,
    print_environment,
    run,
    seed_list,
    take_turns,
    timed_call,
)

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheHandle, PagedKvCacheManager
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.paging.allocator import Placement

Array = npt.NDArray[Any]

ARRIVALS = ("together", "staggered")


@dataclass(frozen=True)
class Policy:
    """One placement policy under test."""

    name: str
    placement: Placement
    known_length: bool


POLICIES = (
    Policy("contiguous, known length", "contiguous", known_length=True),
    Policy("contiguous, unknown length", "contiguous", known_length=False),
    Policy("fifo (baseline)", "fifo", known_length=False),
)
BASELINE = POLICIES[-1].name


@dataclass(frozen=True)
class Growth:
    """What one growth of a batch under one policy measured."""

    runs: tuple[int, ...]  # runs per request at the end, in request order
    step_s: tuple[float, ...]  # every step
    block_step_s: tuple[float, ...]  # the steps in which some request took a block


def pool_blocks(lengths: Sequence[int], block_size: int, headroom: float) -> int:
    """Blocks the final lengths need, plus ``headroom`` of them."""
    needed = sum(math.ceil(length / block_size) for length in lengths)
    return math.ceil(needed * (1.0 + headroom))


def grow(policy: Policy, lengths: Sequence[int], arrival: str, block_size: int, headroom: float) -> Growth:
    """Grow every request side by side, one token per step each, timing each step.

    Raises:
        KvCacheError: an allocation failed or the pool's records are inconsistent.
    """
    config = CacheConfig(
        num_layers=1,
        num_heads=1,
        head_dim=1,
        num_blocks=pool_blocks(lengths, block_size, headroom),
        block_size=block_size,
    )
    manager: PagedKvCacheManager[Array] = PagedKvCacheManager(
        NumpyStorage(config), backend="numpy", placement=policy.placement
    )
    longest = max(lengths)
    starts = [0 if arrival == "together" else longest - length for length in lengths]
    handles: list[PagedKvCacheHandle[Array] | None] = [None] * len(lengths)
    step_s: list[float] = []
    block_step_s: list[float] = []

    def one_step(step: int) -> None:
        for request, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            if not start <= step < start + length:
                continue
            handle = handles[request]
            if handle is None:
                handle = manager.allocate(
                    AllocationRequest(f"request-{request}", max_sequence_length=length if policy.known_length else None)
                )
                handles[request] = handle
            manager.extend(handle, 1)

    for step in range(longest):
        free_before = manager.stats().free_blocks
        elapsed, _ = timed_call(functools.partial(one_step, step))
        step_s.append(elapsed)
        if manager.stats().free_blocks != free_before:
            block_step_s.append(elapsed)
    manager.check_invariants()
    runs = tuple(len(handle.block_table().runs()) for handle in handles if handle is not None)
    return Growth(runs, tuple(step_s), tuple(block_step_s))


@dataclass(frozen=True)
class Summary:
    """One policy over every seed."""

    max_runs: int
    mean_runs: float
    step_us: float
    block_step_us: float


def summarise(growths: Sequence[Growth]) -> Summary:
    """Worst and mean runs over every request of every seed; median step times over all steps."""
    runs = [count for growth in growths for count in growth.runs]
    steps = [seconds for growth in growths for seconds in growth.step_s]
    block_steps = [seconds for growth in growths for seconds in growth.block_step_s]
    return Summary(
        max_runs=max(runs),
        mean_runs=statistics.fmean(runs),
        step_us=statistics.median(steps) * 1e6,
        block_step_us=statistics.median(block_steps) * 1e6 if block_steps else math.nan,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with the ``--quick`` defaults applied."""
    parser = BenchParser(__doc__, quick="seed 0 only, requests up to 1024 tokens")
    parser.lengths(count=16, min_length=128, max_length=(4096, 1024), count_flag="--requests")
    parser.geometry(block_size=16)
    parser.flag("--headroom", 0.25, type=float, help="spare pool fraction")
    parser.require(lambda args: args.headroom >= 0, "--headroom must be >= 0")
    parser.flag("--seeds", ([0, 1, 2, 3, 4], [0]), type=seed_list, help="seeds of the lengths")
    parser.add_argument(
        "--arrivals", choices=(*ARRIVALS, "both"), default="both", help="arrival pattern (default both)"
    )
    parser.add_argument("--verbose", action="store_true", help="print the runs of every request of every seed")
    return parser.parse(argv)


def grow_every_seed(args: argparse.Namespace, arrival: str) -> dict[str, list[Growth]]:
    """Each seed's lengths grown under every policy, the order rotating so drift in machine
    speed favours none; every policy's growths, in seed order."""
    seeds: list[int] = args.seeds
    lengths_of_seed = iter([draw_lengths(seed, args.requests, args.min_length, args.max_length) for seed in seeds])
    growths: dict[str, list[Growth]] = {policy.name: [] for policy in POLICIES}

    def collect(results: Mapping[str, Growth], index: int) -> None:
        for name, growth in results.items():
            growths[name].append(growth)
            if args.verbose:
                print(f"  {arrival} seed {seeds[index]} {name:<27} runs {list(growth.runs)}")

    def policy_growth(policy: Policy) -> Callable[[list[int]], Growth]:
        return lambda lengths: grow(policy, lengths, arrival, args.block_size, args.headroom)

    take_turns(
        {policy.name: policy_growth(policy) for policy in POLICIES},
        rounds=len(seeds),
        inputs=lengths_of_seed.__next__,
        check=collect,
    )
    return growths


def print_table(arrival: str, summaries: dict[str, Summary]) -> None:
    """The policies of one arrival pattern, with ratios against fifo."""
    base = summaries[BASELINE]
    header = (
        f"{'policy':<27} | {'max runs':>8} | {'mean runs':>9} | {'fifo/this':>9} | "
        f"{'us/step':>8} | {'this/fifo':>9} | {'us/block step':>13} | {'this/fifo':>9}"
    )
    print(f"\narrival: {arrival}")
    print(header)
    print("-" * len(header))
    for name, summary in summaries.items():
        print(
            f"{name:<27} | {summary.max_runs:8d} | {summary.mean_runs:9.2f} | "
            f"{base.mean_runs / summary.mean_runs:8.1f}x | {summary.step_us:8.1f} | "
            f"{summary.step_us / base.step_us:8.2f}x | {summary.block_step_us:13.1f} | "
            f"{summary.block_step_us / base.block_step_us:8.2f}x"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Grow the batches under every policy and print one table per arrival pattern."""
    args = parse_args(argv)
    print_environment()
    arrivals = ARRIVALS if args.arrivals == "both" else (args.arrivals,)
    print(
        f"{args.requests} requests growing one token per step side by side, lengths uniform in "
        f"[{args.min_length}, {args.max_length}], block_size {args.block_size}, pool {args.headroom:.0%} "
        f"larger than needed, seeds {args.seeds}"
    )
    clock = Stopwatch()
    for arrival in arrivals:
        growths = grow_every_seed(args, arrival)
        print_table(arrival, {name: summarise(found) for name, found in growths.items()})
    print(
        "\nruns: per request at full length (1 = one zero-copy view); fifo/this > 1: fewer runs than fifo."
        "\nus/step: median time of one step (one extend per active request); us/block step: the same over"
        "\nsteps that took a block; this/fifo > 1: slower than fifo."
    )
    print(f"total {clock.seconds():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
