"""One decode step: kvcache's NumPy backend against a contiguous NumPy cache, side by side.

What is compared, in one process, with the same inputs:

* **ours** -- ``create_manager("numpy", CacheConfig(...))``. A step is planned once
  (``manager.begin_step(handles, 1)``: every request grows by one token) and then, for
  every layer, makes one ``step.write_and_attend(layer, K, V, q)`` (as ``PagedCache`` does):
  it scatters the new token's K/V of all requests and attends, reading the pool in place.
* **dense** -- the usual competitor: one contiguous ``[kv_heads, tokens, head_dim]``
  array per request per layer that grows by ``np.concatenate`` each step, followed by
  grouped-query softmax attention on it (the query heads of one KV head grouped into
  one matmul, softmax in place, a second matmul).

Scenarios: (a) one request at each context of ``--contexts``; (b) a batch of
``--batch-size`` requests with lengths spread between ``--min-length`` and
``--max-length`` (fixed ``--seed``), whose blocks were allocated while the requests grew
side by side, one token per step each (staggered arrivals, so all of them are still
decoding), as a serving engine would have placed them. ``--kv-layout`` picks our pool's
layout (``NHD`` by default; ``heads_first`` and ``HND`` for comparison) and ``--placement
fifo`` the allocator's fragmenting baseline (through ``PagedKvCacheManager(storage,
placement="fifo")``), to show what many short block runs cost attention.

Before timing, both approaches run one step on the same inputs and their attention
outputs are compared with ``np.allclose``; the script exits with status 1 if they
differ (every timed step is checked the same way, outside the timed region). Times are
medians (``--statistic``) over ``--repeats`` steps, each a real decode step (contexts grow
by one per step), alternating the two approaches. Nothing here asserts a time.

Run, from the repository root (the environment keeps glibc from returning large
buffers to the OS after every step, which otherwise dominates the dense cache's time;
on a machine other processes share, add ``OPENBLAS_NUM_THREADS=1``)::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/decode_numpy.py            # ~25 s on 2 cores, ~3 GiB
    .venv/bin/python benchmarks/decode_numpy.py --quick        # ~6 s
    .venv/bin/python benchmarks/decode_numpy.py --layers 2 --contexts 2048,16384 --repeats 9
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from _harness import (
    BenchParser,
    Geometry,
    StepInputs,
    Stopwatch,
    agreement_check,
    draw_lengths,
    geometry_of,
    grow_staggered,
    int_list,
    mib,
    paged_decode_step,
    print_environment,
    ratio,
    run,
    take_turns,
)

from kvcache_core import AllocationRequest, PagedKvCacheHandle, PagedKvCacheManager, create_manager
from kvcache_core.backends.numpy import NumpyStorage

Array = npt.NDArray[Any]
Manager = PagedKvCacheManager[Array]
Handle = PagedKvCacheHandle[Array]

#: The untimed first step, which verifies and prints.
WARMUP_STEPS = 1


def step_inputs(rng: np.random.Generator, geometry: Geometry, batch: int) -> StepInputs[Array]:
    """Random new-token K/V and queries for every layer."""
    dtype = np.dtype(geometry.dtype)
    kv_shape = (batch, geometry.num_kv_heads, geometry.head_dim)
    q_shape = (batch, geometry.num_query_heads, geometry.head_dim)
    layers = range(geometry.num_layers)
    return StepInputs(
        keys=tuple(rng.standard_normal(kv_shape, dtype=np.float32).astype(dtype, copy=False) for _ in layers),
        values=tuple(rng.standard_normal(kv_shape, dtype=np.float32).astype(dtype, copy=False) for _ in layers),
        queries=tuple(rng.standard_normal(q_shape, dtype=np.float32).astype(dtype, copy=False) for _ in layers),
    )


# -- the competitor: a contiguous cache per request per layer ---------------------------


def dense_decode_attention(query: Array, keys: Array, values: Array, scale: float) -> Array:
    """Grouped-query softmax attention of one token over a contiguous cache.

    Args:
        query: ``[query_heads, head_dim]``.
        keys, values: ``[kv_heads, tokens, head_dim]``, C-contiguous.
        scale: score scale.

    Returns:
        ``[query_heads, head_dim]``.
    """
    kv_heads, _, head_dim = keys.shape
    grouped = (query * query.dtype.type(scale)).reshape(kv_heads, -1, head_dim)  # [H, group, D]
    scores = np.matmul(grouped, keys.transpose(0, 2, 1))  # [H, group, tokens]; BLAS reads K transposed
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    output = np.matmul(scores, values)  # [H, group, D]
    output /= scores.sum(axis=-1, keepdims=True)
    result: Array = output.reshape(-1, head_dim)
    return result


class DenseCache:
    """``keys[layer][request]``: ``[kv_heads, tokens, head_dim]`` arrays grown by concatenation."""

    def __init__(self, keys: list[list[Array]], values: list[list[Array]]) -> None:
        self.keys = keys
        self.values = values

    def step(self, inputs: StepInputs[Array], scale: float) -> list[Array]:
        """Append each request's new K/V and attend, layer by layer; ``[batch, q_heads, D]`` per layer."""
        outputs: list[Array] = []
        for layer, (layer_keys, layer_values) in enumerate(zip(self.keys, self.values, strict=True)):
            new_keys, new_values, queries = inputs.keys[layer], inputs.values[layer], inputs.queries[layer]
            result = np.empty_like(queries)
            for request in range(len(layer_keys)):
                layer_keys[request] = np.concatenate((layer_keys[request], new_keys[request][:, None, :]), axis=1)
                layer_values[request] = np.concatenate((layer_values[request], new_values[request][:, None, :]), axis=1)
                result[request] = dense_decode_attention(
                    queries[request], layer_keys[request], layer_values[request], scale
                )
            outputs.append(result)
        return outputs

    def memory_bytes(self) -> int:
        """Bytes the arrays hold (exactly the tokens stored)."""
        return sum(array.nbytes for layer in (*self.keys, *self.values) for array in layer)


# -- building both caches with the same contents ------------------------------------------


@dataclass
class Scenario:
    """Both caches of one scenario, holding the same tokens."""

    name: str
    geometry: Geometry
    manager: Manager
    handles: list[Handle]
    dense: DenseCache


def fill_both(
    name: str, geometry: Geometry, manager: Manager, handles: list[Handle], slots: list[Array], rng: np.random.Generator
) -> Scenario:
    """Write random contexts into the pool (one write per layer) and keep them as the dense cache.

    ``slots[r]`` are the slots ``extend`` handed request ``r`` for its tokens, in order.
    """
    all_slots = np.concatenate(slots)
    dense_keys: list[list[Array]] = []
    dense_values: list[list[Array]] = []
    shape = (geometry.num_kv_heads, -1, geometry.head_dim)
    for layer in range(geometry.num_layers):
        per_kind: list[list[Array]] = []
        for _kind in ("keys", "values"):
            # [kv_heads, tokens, head_dim] per request: the dense layout, generated directly.
            arrays = [
                rng.standard_normal((shape[0], request_slots.size, shape[2]), dtype=np.float32).astype(
                    geometry.dtype, copy=False
                )
                for request_slots in slots
            ]
            per_kind.append(arrays)
        token_major = [
            np.concatenate([array.transpose(1, 0, 2) for array in arrays]) for arrays in per_kind
        ]  # [sum tokens, kv_heads, head_dim]
        manager.write(layer, all_slots, token_major[0], token_major[1])
        del token_major
        dense_keys.append(per_kind[0])
        dense_values.append(per_kind[1])
    return Scenario(name, geometry, manager, handles, DenseCache(dense_keys, dense_values))


def make_manager(geometry: Geometry, num_blocks: int) -> Manager:
    """A NumPy-backend manager with this geometry and pool size (``create_manager`` unless
    another placement than the default is asked for)."""
    config = geometry.config(num_blocks)
    if geometry.placement == "contiguous":
        return create_manager("numpy", config)
    return PagedKvCacheManager(NumpyStorage(config), backend="numpy", placement=geometry.placement)


def single_request(geometry: Geometry, context: int, extra_steps: int, rng: np.random.Generator) -> Scenario:
    """Scenario (a): one request holding ``context`` tokens."""
    manager = make_manager(geometry, geometry.blocks_for(context + extra_steps))
    handle = manager.allocate(AllocationRequest("request-0"))
    slots = manager.extend(handle, context)
    return fill_both(f"1 x {context}", geometry, manager, [handle], [slots], rng)


def staggered_batch(
    geometry: Geometry, lengths: Sequence[int], extra_steps: int, headroom: float, rng: np.random.Generator
) -> Scenario:
    """Scenario (b): requests that grew side by side, one token per step each.

    Request ``r`` arrives at step ``max(lengths) - lengths[r]``, so at the end every
    request holds its length and is still decoding; the pool has ``headroom`` more blocks
    than the final lengths plus the benchmark's steps need.
    """
    needed = sum(geometry.blocks_for(length + extra_steps) for length in lengths)
    manager = make_manager(geometry, math.ceil(needed * (1.0 + headroom)))
    handles, slots = grow_staggered(manager, lengths)
    return fill_both(f"{len(lengths)} mixed", geometry, manager, handles, slots, rng)


# -- timing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Seconds of one decode step for each approach (the chosen statistic), and how much the
    steps varied."""

    ours_s: float
    dense_s: float
    spread: float  # the larger interquartile range of the two, as a fraction of its median


def run_scenario(scenario: Scenario, args: argparse.Namespace, rng: np.random.Generator) -> Timing:
    """Verify, then time ``--repeats`` steps of each approach (alternating); ``DisagreementError``
    on a mismatch."""
    geometry = scenario.geometry
    competitors: dict[str, Callable[[StepInputs[Array]], list[Array]]] = {
        "ours": lambda inputs: paged_decode_step(scenario.manager, scenario.handles, inputs),
        "dense": lambda inputs: scenario.dense.step(inputs, geometry.scale),
    }
    times = take_turns(
        competitors,
        rounds=args.repeats,
        warmup=WARMUP_STEPS,
        inputs=lambda: step_inputs(rng, geometry, len(scenario.handles)),
        check=agreement_check("ours", {"dense": "dense"}, what=f"{scenario.name} ({geometry.num_layers} layers)"),
        statistic=args.statistic,
    )
    return Timing(times.seconds("ours"), times.seconds("dense"), times.spread())


# -- command line -----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with the ``--quick`` defaults applied."""
    parser = BenchParser(__doc__, quick="contexts 1024,2048, batch up to 512 tokens, 3 repeats")
    parser.geometry(layers=4, query_heads=32, kv_heads=8, head_dim=128, block_size=16, kv_layout="NHD")
    parser.add_argument(
        "--placement",
        choices=("contiguous", "fifo"),
        default="contiguous",
        help="our allocator's placement (default contiguous; fifo fragments scenario (b) into many runs)",
    )
    parser.flag("--contexts", ([1024, 4096, 8192], [1024, 2048]), type=int_list, help="scenario (a) contexts")
    parser.lengths(count=16, min_length=128, max_length=(4096, 512))
    parser.flag("--headroom", 0.25, type=float, help="scenario (b) spare pool fraction")
    parser.timing((15, 3))
    parser.seed()
    parser.add_argument("--skip-batch", action="store_true", help="run scenario (a) only")
    return parser.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every scenario and print the table; ``DisagreementError`` if the two approaches disagree."""
    args = parse_args(argv)
    print_environment()
    geometry = geometry_of(args)
    print(f"geometry: {geometry.describe()}")
    print(f"{args.repeats} timed decode steps per scenario after one verification step; {args.statistic}s")
    rng = np.random.default_rng(args.seed)
    extra_steps = args.repeats + WARMUP_STEPS
    rows: list[tuple[str, Timing]] = []
    clock = Stopwatch()
    for context in args.contexts:
        scenario = single_request(geometry, context, extra_steps, rng)
        rows.append((scenario.name, run_scenario(scenario, args, rng)))
        del scenario
    batch_notes: list[str] = []
    if not args.skip_batch:
        lengths = sorted(draw_lengths(args.seed, args.batch_size, args.min_length, args.max_length))
        build = Stopwatch()
        scenario = staggered_batch(geometry, lengths, extra_steps, args.headroom, rng)
        build_s = build.seconds()
        runs = [len(handle.block_table().runs()) for handle in scenario.handles]
        pool_bytes = scenario.manager.stats().total_memory_bytes
        rows.append((scenario.name, run_scenario(scenario, args, rng)))
        manager_stats = scenario.manager.stats()
        tokens = manager_stats.tokens_stored
        batch_notes = [
            f"scenario (b): {len(lengths)} requests, lengths {lengths} (seed {args.seed}), "
            f"built in {build_s:.1f} s "
            "(grown one token per step side by side, then filled)",
            f"  block runs per request (BlockTable.runs()): {runs}  -> max {max(runs)}, "
            f"mean {statistics.fmean(runs):.2f}",
            f"  KV memory after the steps, {tokens:,} tokens:",
            f"    ours : pool {mib(pool_bytes)} allocated ({args.headroom:.0%} headroom), "
            f"{mib(manager_stats.used_memory_bytes)} in {manager_stats.used_blocks:,} used blocks "
            f"(utilization {manager_stats.utilization:.1%})",
            f"    dense: {mib(scenario.dense.memory_bytes())} (exact), plus a transient copy of one "
            f"request-layer array per append",
            f"    exact: {mib(tokens * geometry.bytes_per_token)}",
        ]
        del scenario

    print()
    header = f"{'scenario':>12} | {'ours (ms)':>10} | {'dense (ms)':>10} | {'dense/ours':>10} | {'IQR/median':>10}"
    print(header)
    print("-" * len(header))
    for name, timing in rows:
        print(
            f"{name:>12} | {timing.ours_s * 1e3:10.2f} | {timing.dense_s * 1e3:10.2f} | "
            f"{ratio(timing.dense_s, timing.ours_s):>10}"
            f" | {timing.spread:9.0%}"
        )
    print(
        f"({args.statistic} of one decode step over all layers; dense/ours > 1 means the paged cache is faster;\n"
        " IQR/median: the noisier approach's spread -- rerun or raise --repeats when it is large)"
    )
    for note in batch_notes:
        print(note)
    print(f"total {clock.seconds():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
