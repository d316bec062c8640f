"""The JAX backend side by side with what it replaces: donated vs copying writes, and
jitted paged decode attention vs jitted dense attention on contiguous K/V.

What is compared, in one process, with the same inputs:

* **write cost vs pool size** -- one decode step's write (``--batch`` new tokens) into a
  64 MiB and a 1 GiB pool (K and V of one layer). *donated*: ``manager.write`` of
  ``create_manager("jax", ...)``, whose jitted scatter donates the pool and runs in place
  (the time includes the manager's checks). *copying*: the same pure ``kvcache_jax.write``
  jitted without donation, as a plain ``jax.jit`` step would run it: every call copies the
  pool. The two pool sizes of one contender alternate. Printed: each median and the ratio
  1 GiB / 64 MiB (target for donated: <= 1.3).
* **decode attention** -- ``--batch`` requests at each context of ``--contexts``, their
  blocks allocated while they grew side by side, one query token each. *paged*:
  ``manager.paged_attention(layer, query, page_table)`` on the pool (``--kv-layouts``),
  including the manager's checks. *dense*: jitted softmax attention on the same K/V
  copied into contiguous arrays, heads-first ``[B, heads, tokens, dim]`` and token-major
  ``[B, tokens, heads, dim]``, timed against each other; the faster, "best dense", is then
  timed against paged. Printed: medians and paged / best dense (target at 4096: <= 2).

Before timing, every paged output is compared with the dense one (``np.allclose``,
``rtol=atol=1e-4``); the script exits with status 1 if they differ. Times are medians of
``--repeats`` calls, the contenders alternating; nothing here asserts a time.

Run from the repository root::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/decode_jax.py             # ~1-2 min on 2 cores, ~3 GiB
    .venv/bin/python benchmarks/decode_jax.py --quick     # under a minute
    .venv/bin/python benchmarks/decode_jax.py --contexts 4096 --batch 8 --kv-layouts heads_first
"""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

import kvcache_jax
from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheHandle, PagedKvCacheManager, create_manager
from kvcache_jax import JaxStorage

Manager = PagedKvCacheManager[jax.Array]
Handle = PagedKvCacheHandle[jax.Array]

RECOMMENDED_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
MIB = 1 << 20


@dataclass(frozen=True)
class Geometry:
    """The model whose cache is benchmarked."""

    kv_heads: int
    query_heads: int
    head_dim: int
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        """Keys and values of one block of one layer, float32."""
        return 2 * self.block_size * self.kv_heads * self.head_dim * 4


def seconds_of(call: Callable[[], jax.Array]) -> float:
    """Wall time of one call, until its result is ready."""
    started = time.perf_counter()
    call().block_until_ready()
    return time.perf_counter() - started


def alternate(calls: dict[str, Callable[[], jax.Array]], repeats: int) -> dict[str, float]:
    """Medians of the calls, run in turn ``repeats`` times (each warmed up first)."""
    for call in calls.values():
        call().block_until_ready()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            samples[name].append(seconds_of(call))
    return {name: statistics.median(values) for name, values in samples.items()}


# -- write cost --------------------------------------------------------------------------


@dataclass
class WriteSetup:
    """A pool of one size, with one decode step's slots and tokens ready to write."""

    manager: Manager
    storage: JaxStorage  # the manager's pool, built here (its copy counter is read at the end)
    handle: Handle  # any request: its key_cache is the current pool array
    slots: npt.NDArray[np.int64]
    tokens: jax.Array
    copying_pools: tuple[jax.Array, jax.Array]  # the copying contender's own pools

    def donated(self) -> jax.Array:
        self.manager.write(0, self.slots, self.tokens, self.tokens)
        pool = self.handle.key_cache(0)
        assert pool is not None
        return pool

    def copying(self, program: Callable[..., tuple[jax.Array, jax.Array]]) -> jax.Array:
        slots = jnp.asarray(self.slots, jnp.int32)
        keys, _ = program(self.copying_pools[0], self.copying_pools[1], slots, self.tokens, self.tokens)
        return keys  # its pools stay as they were: the next call copies them again


def write_setup(geometry: Geometry, size_mib: int, batch: int) -> WriteSetup:
    config = CacheConfig(
        num_layers=1,
        num_heads=geometry.kv_heads,
        head_dim=geometry.head_dim,
        num_blocks=size_mib * MIB // geometry.bytes_per_block,
        block_size=geometry.block_size,
        kv_layout="NHD",  # the layout the copying contender (kvcache_jax.write's default) writes
    )
    storage = JaxStorage(config)
    manager: Manager = PagedKvCacheManager(storage, backend="jax")
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(batch)]
    for handle in handles:
        manager.extend(handle, 100)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.standard_normal((batch, geometry.kv_heads, geometry.head_dim), np.float32))
    slots = np.concatenate([manager.extend(handle, 1) for handle in handles])
    pools = (jnp.zeros(config.block_shape()), jnp.zeros(config.block_shape()))
    return WriteSetup(manager, storage, handles[0], slots, tokens, pools)


def write_costs(geometry: Geometry, pool_mib: Sequence[int], batch: int, repeats: int) -> dict[str, list[float]]:
    """Median write times per pool size, donated and copying; the sizes of one contender
    alternate, so both run under the same conditions."""
    setups = [write_setup(geometry, size, batch) for size in pool_mib]
    copying_program: Callable[..., tuple[jax.Array, jax.Array]] = jax.jit(
        kvcache_jax.write, static_argnames="kv_layout"
    )
    costs: dict[str, list[float]] = {}
    donated = alternate({str(index): setup.donated for index, setup in enumerate(setups)}, repeats)
    costs["donated"] = [donated[str(index)] for index in range(len(setups))]
    copying = alternate(
        {str(index): partial(setup.copying, copying_program) for index, setup in enumerate(setups)}, repeats
    )
    costs["copying"] = [copying[str(index)] for index in range(len(setups))]
    for setup in setups:
        if setup.storage.copies_made:
            print(f"  warning: {setup.storage.copies_made} pools copied on write (a reference was held)")
    return costs


# -- decode attention --------------------------------------------------------------------


def grown_batch(geometry: Geometry, context: int, batch: int, kv_layout: str) -> tuple[Manager, list[Handle]]:
    """``batch`` requests of ``context`` tokens, grown side by side a block at a time."""
    blocks = batch * -(-context // geometry.block_size) + batch
    config = CacheConfig(
        num_layers=1,
        num_heads=geometry.kv_heads,
        head_dim=geometry.head_dim,
        num_blocks=blocks,
        block_size=geometry.block_size,
        kv_layout=kv_layout,
    )
    manager: Manager = create_manager("jax", config)
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(batch)]
    rng = np.random.default_rng(context)
    chunk = 32 * geometry.block_size
    for first in range(0, context, chunk):
        count = min(chunk, context - first)
        slots = np.concatenate([manager.extend(handle, count) for handle in handles])
        shape = (len(slots), geometry.kv_heads, geometry.head_dim)
        keys = jnp.asarray(rng.standard_normal(shape, np.float32))
        values = jnp.asarray(rng.standard_normal(shape, np.float32))
        manager.write(0, slots, keys, values)
    return manager, handles


def dense_heads_first(query: jax.Array, keys: jax.Array, values: jax.Array) -> jax.Array:
    """``query [B, QH, D]`` over contiguous ``[B, H, S, D]`` K/V."""
    batch, heads, _, dim = keys.shape
    grouped = query.reshape(batch, heads, -1, dim)
    scores = jnp.einsum("bhgd,bhsd->bhgs", grouped, keys) / math.sqrt(dim)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhgs,bhsd->bhgd", weights, values).reshape(query.shape)


def dense_token_major(query: jax.Array, keys: jax.Array, values: jax.Array) -> jax.Array:
    """``query [B, QH, D]`` over contiguous ``[B, S, H, D]`` K/V."""
    batch, _, heads, dim = keys.shape
    grouped = query.reshape(batch, heads, -1, dim)
    scores = jnp.einsum("bhgd,bshd->bhgs", grouped, keys) / math.sqrt(dim)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhgs,bshd->bhgd", weights, values).reshape(query.shape)


def attention_times(
    geometry: Geometry, context: int, batch: int, kv_layout: str, repeats: int
) -> dict[str, float] | None:
    """Medians of paged and dense decode attention; ``None`` if their outputs differ."""
    manager, handles = grown_batch(geometry, context, batch, kv_layout)
    rng = np.random.default_rng(1)
    query = jnp.asarray(rng.standard_normal((batch, geometry.query_heads, geometry.head_dim), np.float32))
    table = manager.page_table(handles)
    gathered = [manager.gather(handle, 0) for handle in handles]
    token_major = [jnp.stack([pair[side] for pair in gathered]) for side in (0, 1)]  # [B, S, H, D]
    heads_first = [jnp.transpose(array, (0, 2, 1, 3)).copy() for array in token_major]  # [B, H, S, D]
    jitted_heads_first: Callable[..., jax.Array] = jax.jit(dense_heads_first)
    jitted_token_major: Callable[..., jax.Array] = jax.jit(dense_token_major)

    def paged() -> jax.Array:
        return manager.paged_attention(0, query, table)

    def dense_contiguous_heads_first() -> jax.Array:
        return jitted_heads_first(query, heads_first[0], heads_first[1])

    def dense_contiguous_token_major() -> jax.Array:
        return jitted_token_major(query, token_major[0], token_major[1])

    calls: dict[str, Callable[[], jax.Array]] = {
        "paged": paged,
        "dense heads-first": dense_contiguous_heads_first,
        "dense token-major": dense_contiguous_token_major,
    }
    reference = np.asarray(calls["dense heads-first"]())
    for name, call in calls.items():
        output = np.asarray(call())
        if not np.allclose(output, reference, rtol=1e-4, atol=1e-4):
            error = float(np.max(np.abs(output - reference)))
            print(f"  {name} differs from dense heads-first by {error:.3g} at context {context}")
            return None
    # The two dense layouts against each other first; then the faster one against paged
    # (alternating with a much slower contender would slow whichever call follows it).
    dense = alternate({name: calls[name] for name in ("dense heads-first", "dense token-major")}, repeats)
    best = min(dense, key=dense.__getitem__)
    head_to_head = alternate({"paged": calls["paged"], best: calls[best]}, repeats)
    return {**dense, **head_to_head}


# -- report ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smoke mode: fewer contexts and repeats (< 1 min)")
    parser.add_argument("--contexts", default="1024,4096,8192", help="decode contexts, comma-separated")
    parser.add_argument("--pool-mib", default="64,1024", help="pool sizes of the write test, MiB (small,large)")
    parser.add_argument("--batch", type=int, default=4, help="requests per decode step")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--query-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-layouts", default="heads_first,NHD", help="pool layouts of the paged contender")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per contender (median)")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.repeats, args.kv_layouts = "1024,4096", 5, args.kv_layouts.split(",")[0]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [name for name, value in RECOMMENDED_ENV.items() if os.environ.get(name) != value]
    if missing:
        print(f"note: set {' '.join(f'{name}={RECOMMENDED_ENV[name]}' for name in missing)} for steadier times")
    geometry = Geometry(args.kv_heads, args.query_heads, args.head_dim, args.block_size)
    contexts = [int(text) for text in args.contexts.split(",")]
    pool_mib = [int(text) for text in args.pool_mib.split(",")]
    layouts = args.kv_layouts.split(",")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus); {geometry.kv_heads} KV heads, "
        f"{geometry.query_heads} query heads of {geometry.head_dim}, blocks of {geometry.block_size}, float32; "
        f"batch {args.batch}; medians of {args.repeats}"
    )

    print(f"\nwrite of {args.batch} tokens into one layer's pool (K and V) of {' vs '.join(map(str, pool_mib))} MiB")
    costs = write_costs(geometry, pool_mib, args.batch, args.repeats)
    for contender, medians in costs.items():
        sizes = "  ".join(f"{size:>5} MiB {value * 1e3:8.3f} ms" for size, value in zip(pool_mib, medians, strict=True))
        print(f"  {contender:<8} {sizes}   ratio {medians[-1] / medians[0]:6.2f}x")
    donated_ratio = costs["donated"][-1] / costs["donated"][0]
    print(f"  target: donated ratio <= 1.3 -> {'met' if donated_ratio <= 1.3 else 'NOT met'} ({donated_ratio:.2f})")

    failed = False
    for layout in layouts:
        print(f"\ndecode attention, {args.batch} requests, pool layout {layout}")
        for context in contexts:
            measured = attention_times(geometry, context, args.batch, layout, args.repeats)
            if measured is None:
                failed = True
                continue
            dense = {name: measured[name] for name in ("dense heads-first", "dense token-major")}
            best_name = min(dense, key=dense.__getitem__)
            ratio = measured["paged"] / measured[best_name]
            listing = "  ".join(f"{name} {value * 1e3:7.3f} ms" for name, value in measured.items())
            verdict = ""
            if context == 4096:
                verdict = f"  target <= 2x: {'met' if ratio <= 2 else 'NOT met'}"
            print(f"  context {context:>5}: {listing}  paged/best dense ({best_name}) {ratio:5.2f}x{verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
