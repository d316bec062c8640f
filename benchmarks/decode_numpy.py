"""One decode step: kvcache's NumPy backend against a contiguous NumPy cache, side by side.

What is compared, in one process, with the same inputs:

* **ours** -- ``create_manager("numpy", CacheConfig(...))``. A step is planned once
  (``manager.begin_step(handles, 1)``: every request grows by one token) and then, for
  every layer, scatters the new token's K/V of all requests with one
  ``step.write(layer, K, V)`` and runs ``step.attention(layer, q)``, which reads the pool
  in place.
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
medians over ``--repeats`` steps, each a real decode step (contexts grow by one per
step), alternating the two approaches. Nothing here asserts a time.

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
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from _bench import (
    ATOL,
    RTOL,
    Geometry,
    draw_lengths,
    grow_staggered,
    int_list,
    mib,
    print_environment,
    ratio,
    relative_spread,
)

from kvcache_core import AllocationRequest, PagedKvCacheHandle, PagedKvCacheManager, create_manager
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.plugin import KV_LAYOUTS

Array = npt.NDArray[Any]
Manager = PagedKvCacheManager[Array]
Handle = PagedKvCacheHandle[Array]


@dataclass(frozen=True)
class StepInputs:
    """What the model hands the cache in one decode step, per layer.

    ``keys[layer]``/``values[layer]``: ``[batch, kv_heads, head_dim]``;
    ``queries[layer]``: ``[batch, query_heads, head_dim]``.
    """

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    queries: tuple[Array, ...]


def step_inputs(rng: np.random.Generator, geometry: Geometry, batch: int) -> StepInputs:
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

    def step(self, inputs: StepInputs, scale: float) -> list[Array]:
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


# -- ours ---------------------------------------------------------------------------------


def paged_step(manager: Manager, handles: Sequence[Handle], inputs: StepInputs) -> list[Array]:
    """One decode step through the manager's step (planned once); ``[batch, q_heads, D]`` per layer."""
    step = manager.begin_step(handles, 1)
    outputs: list[Array] = []
    for layer in range(manager.config.num_layers):
        step.write(layer, inputs.keys[layer], inputs.values[layer])
        outputs.append(step.attention(layer, inputs.queries[layer]))
    return outputs


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
    blocks = math.ceil((context + extra_steps) / geometry.block_size)
    manager = make_manager(geometry, blocks)
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
    needed = sum(math.ceil((length + extra_steps) / geometry.block_size) for length in lengths)
    manager = make_manager(geometry, math.ceil(needed * (1.0 + headroom)))
    handles, slots = grow_staggered(manager, lengths)
    return fill_both(f"{len(lengths)} mixed", geometry, manager, handles, slots, rng)


# -- timing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Median seconds of one decode step for each approach, and how much the steps varied."""

    ours_s: float
    dense_s: float
    spread: float  # the larger interquartile range of the two, as a fraction of its median


def outputs_match(ours: Sequence[Array], dense: Sequence[Array]) -> tuple[bool, float]:
    """Whether every layer's outputs agree, and the largest absolute difference."""
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, dense, strict=True))
    return all(np.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(ours, dense, strict=True)), worst


def run_scenario(scenario: Scenario, repeats: int, rng: np.random.Generator) -> Timing:
    """Verify, then time ``repeats`` steps of each approach (alternating); exit 1 on a mismatch."""
    geometry = scenario.geometry
    scale = geometry.scale
    batch = len(scenario.handles)

    def ours(inputs: StepInputs) -> list[Array]:
        return paged_step(scenario.manager, scenario.handles, inputs)

    def dense(inputs: StepInputs) -> list[Array]:
        return scenario.dense.step(inputs, scale)

    approaches: tuple[tuple[str, Callable[[StepInputs], list[Array]]], ...] = (("ours", ours), ("dense", dense))
    times: dict[str, list[float]] = {"ours": [], "dense": []}
    for step in range(repeats + 1):  # step 0: the verification step, untimed
        inputs = step_inputs(rng, geometry, batch)
        results: dict[str, list[Array]] = {}
        order = approaches if step % 2 == 0 else approaches[::-1]
        for name, function in order:
            started = time.perf_counter()
            results[name] = function(inputs)
            if step:
                times[name].append(time.perf_counter() - started)
        same, worst = outputs_match(results["ours"], results["dense"])
        if step == 0:
            verdict = "match" if same else "DIFFER"
            print(
                f"  verify {scenario.name:>10}: paged and dense attention outputs {verdict} "
                f"(np.allclose rtol={RTOL:g} atol={ATOL:g}, max |diff| {worst:.2e}, {geometry.num_layers} layers)"
            )
        if not same:
            print(f"error: outputs differ at step {step} of {scenario.name} (max |diff| {worst:.3e})", file=sys.stderr)
            sys.exit(1)
    spread = max(relative_spread(times["ours"]), relative_spread(times["dense"]))
    return Timing(statistics.median(times["ours"]), statistics.median(times["dense"]), spread)


# -- command line -----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with the ``--quick`` defaults applied."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--query-heads", type=int, default=32, help="query heads (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="features per head (default 128)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default="NHD", help="layout of our pool (default NHD)")
    parser.add_argument(
        "--placement",
        choices=("contiguous", "fifo"),
        default="contiguous",
        help="our allocator's placement (default contiguous; fifo fragments scenario (b) into many runs)",
    )
    parser.add_argument(
        "--contexts", type=int_list, default=None, help="scenario (a) contexts (default 1024,4096,8192)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="scenario (b) requests (default 16)")
    parser.add_argument("--min-length", type=int, default=128, help="scenario (b) shortest request (default 128)")
    parser.add_argument("--max-length", type=int, default=None, help="scenario (b) longest request (default 4096)")
    parser.add_argument("--headroom", type=float, default=0.25, help="scenario (b) spare pool fraction (default 0.25)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per scenario (default 15)")
    parser.add_argument("--seed", type=int, default=0, help="seed of lengths and data (default 0)")
    parser.add_argument("--skip-batch", action="store_true", help="run scenario (a) only")
    parser.add_argument(
        "--quick", action="store_true", help="smaller defaults: contexts 1024,4096, batch up to 1024, 7 repeats"
    )
    args = parser.parse_args(argv)
    if args.contexts is None:
        args.contexts = [1024, 4096] if args.quick else [1024, 4096, 8192]
    if args.max_length is None:
        args.max_length = 1024 if args.quick else 4096
    if args.repeats is None:
        args.repeats = 7 if args.quick else 15
    if args.repeats < 1 or args.layers < 1 or args.batch_size < 1 or not 1 <= args.min_length <= args.max_length:
        parser.error("--repeats, --layers, --batch-size must be >= 1 and 1 <= --min-length <= --max-length")
    if args.query_heads % args.kv_heads:
        parser.error("--query-heads must be a multiple of --kv-heads")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run every scenario and print the table; 1 if the two approaches disagree."""
    args = parse_args(argv)
    print_environment()
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    print(
        f"  on a machine other processes share, add OPENBLAS_NUM_THREADS=1 (now {threads}): BLAS threads "
        "waiting for a busy core can make a step 10x slower"
    )
    geometry = Geometry(
        args.layers,
        args.query_heads,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        kv_layout=args.kv_layout,
        placement=args.placement,
    )
    print(f"geometry: {geometry.describe()}")
    print(f"{args.repeats} timed decode steps per scenario after one verification step; medians")
    print(f"numpy {np.__version__}, {os.cpu_count()} CPUs")
    rng = np.random.default_rng(args.seed)
    extra_steps = args.repeats + 1
    rows: list[tuple[str, Timing]] = []
    started = time.perf_counter()
    for context in args.contexts:
        scenario = single_request(geometry, context, extra_steps, rng)
        rows.append((scenario.name, run_scenario(scenario, args.repeats, rng)))
        del scenario
    batch_notes: list[str] = []
    if not args.skip_batch:
        lengths = sorted(draw_lengths(args.seed, args.batch_size, args.min_length, args.max_length))
        build_started = time.perf_counter()
        scenario = staggered_batch(geometry, lengths, extra_steps, args.headroom, rng)
        build_s = time.perf_counter() - build_started
        runs = [len(handle.block_table().runs()) for handle in scenario.handles]
        pool_bytes = scenario.manager.stats().total_memory_bytes
        rows.append((scenario.name, run_scenario(scenario, args.repeats, rng)))
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
        "(median of one decode step over all layers; dense/ours > 1 means the paged cache is faster;\n"
        " IQR/median: the noisier approach's spread -- rerun or raise --repeats when it is large)"
    )
    for note in batch_notes:
        print(note)
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
