"""The JAX backend side by side with what it replaces: donated vs copying writes, and a
jitted paged decode step vs jitted dense attention on contiguous K/V.

What is compared, in one process, with the same inputs:

* **write cost vs pool size** -- one decode step's write (``--batch`` new tokens) into a
  64 MiB and a 1 GiB pool (K and V of one layer). *donated*: a step of
  ``create_manager("jax", ...)`` (``manager.begin_step(handles, 1)``, then
  ``step.write(0, K, V)``), whose jitted scatter donates the pool and runs in place (the
  time includes planning the step). *copying*: the same pure ``kvcache_jax.write`` jitted
  without donation, as a plain ``jax.jit`` step would run it: every call copies the pool.
  The two pool sizes of one contender alternate. Printed: each median and the ratio
  1 GiB / 64 MiB (target for donated: <= 1.3).
* **decode step** -- ``--batch`` requests at each context of ``--contexts``, their blocks
  allocated while they grew side by side, one query token each. *paged*: one decode step
  through the manager, as ``decode_numpy.py`` and ``decode_torch.py`` run it:
  ``step = manager.begin_step(handles, 1)``, ``step.write(0, K, V)`` and
  ``step.attention(0, query)``, which reads the pool (``--kv-layouts``) in place. *dense*:
  jitted softmax attention alone on the same K/V copied into contiguous arrays (no write: a
  floor), heads-first ``[B, heads, tokens, dim]`` and token-major ``[B, tokens, heads, dim]``,
  timed against each other; the faster, "best dense", is then timed against paged.
  Printed: medians and paged / best dense (target at 4096: <= 2).

Before timing, a paged step's output is compared with dense attention over the same
contexts (``np.allclose`` with the benchmarks' fp32 tolerance); the script exits with
status 1 if they differ. Times are medians (``--statistic``) of ``--repeats`` calls after one
untimed call each, the contenders taking turns; nothing here asserts a time.

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
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from _harness import (
    BenchParser,
    Geometry,
    agree,
    geometry_of,
    int_list,
    layout_list,
    met,
    print_environment,
    ratio,
    require,
    run,
    take_turns,
)

import kvcache_jax
from kvcache_core import AllocationRequest, PagedKvCacheHandle, PagedKvCacheManager, create_manager
from kvcache_jax import JaxStorage

Manager = PagedKvCacheManager[jax.Array]
Handle = PagedKvCacheHandle[jax.Array]

MIB = 1 << 20


def alternate(calls: Mapping[str, Callable[[], jax.Array]], args: argparse.Namespace) -> dict[str, float]:
    """Seconds per call (the chosen statistic) of the calls taking turns ``--repeats`` times,
    after one untimed call each; a call's time runs until its result is ready."""
    times = take_turns(
        calls, rounds=args.repeats, warmup=1, settle=lambda array: array.block_until_ready(), statistic=args.statistic
    )
    return {name: times.seconds(name) for name in calls}


# -- write cost --------------------------------------------------------------------------


@dataclass
class WriteSetup:
    """A pool of one size, with one decode step's slots and tokens ready to write."""

    manager: Manager
    storage: JaxStorage  # the manager's pool, built here (its copy counter is read at the end)
    handles: list[Handle]  # the batch; the first one's key_cache is the current pool array
    slots: npt.NDArray[np.int64]  # the copying contender's slots: one decode step's
    tokens: jax.Array
    copying_pools: tuple[jax.Array, jax.Array]  # the copying contender's own pools

    def donated(self) -> jax.Array:
        """A decode step through the manager: plan one new token per request, write it."""
        step = self.manager.begin_step(self.handles, 1)
        step.write(0, self.tokens, self.tokens)
        pool = self.handles[0].key_cache(0)
        assert pool is not None
        return pool

    def copying(self, program: Callable[..., tuple[jax.Array, jax.Array]]) -> jax.Array:
        slots = jnp.asarray(self.slots, jnp.int32)
        keys, _ = program(self.copying_pools[0], self.copying_pools[1], slots, self.tokens, self.tokens)
        return keys  # its pools stay as they were: the next call copies them again


def write_setup(geometry: Geometry, size_mib: int, batch: int) -> WriteSetup:
    config = geometry.config(size_mib * MIB // geometry.bytes_per_block)  # NHD: what kvcache_jax.write writes
    storage = JaxStorage(config)
    manager: Manager = PagedKvCacheManager(storage, backend="jax")
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(batch)]
    for handle in handles:
        manager.extend(handle, 100)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.standard_normal((batch, geometry.num_kv_heads, geometry.head_dim), np.float32))
    slots = np.concatenate([manager.extend(handle, 1) for handle in handles])
    pools = (jnp.zeros(config.block_shape()), jnp.zeros(config.block_shape()))
    return WriteSetup(manager, storage, handles, slots, tokens, pools)


def write_costs(geometry: Geometry, args: argparse.Namespace) -> dict[str, list[float]]:
    """Write times per pool size, donated and copying; the sizes of one contender take
    turns, so both run under the same conditions."""
    setups = [write_setup(geometry, size, args.batch) for size in args.pool_mib]
    copying_program: Callable[..., tuple[jax.Array, jax.Array]] = jax.jit(
        kvcache_jax.write, static_argnames="kv_layout"
    )
    costs: dict[str, list[float]] = {}
    donated = alternate({str(index): setup.donated for index, setup in enumerate(setups)}, args)
    costs["donated"] = [donated[str(index)] for index in range(len(setups))]
    copying = alternate(
        {str(index): partial(setup.copying, copying_program) for index, setup in enumerate(setups)}, args
    )
    costs["copying"] = [copying[str(index)] for index in range(len(setups))]
    for setup in setups:
        if setup.storage.copies_made:
            print(f"  warning: {setup.storage.copies_made} pools copied on write (a reference was held)")
    return costs


# -- decode attention --------------------------------------------------------------------


def grown_batch(geometry: Geometry, context: int, batch: int, extra_steps: int) -> tuple[Manager, list[Handle]]:
    """``batch`` requests of ``context`` tokens, grown side by side a block at a time, in a
    pool (``geometry.kv_layout``) with room for ``extra_steps`` more tokens each."""
    blocks = batch * -(-(context + extra_steps) // geometry.block_size) + batch
    manager: Manager = create_manager("jax", geometry.config(blocks))
    handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(batch)]
    rng = np.random.default_rng(context)
    chunk = 32 * geometry.block_size
    for first in range(0, context, chunk):
        count = min(chunk, context - first)
        slots = np.concatenate([manager.extend(handle, count) for handle in handles])
        shape = (len(slots), geometry.num_kv_heads, geometry.head_dim)
        keys = jnp.asarray(rng.standard_normal(shape, np.float32))
        values = jnp.asarray(rng.standard_normal(shape, np.float32))
        manager.write(0, slots, keys, values)
    return manager, handles


#: The einsum specs of dense decode attention (scores, then output) over contiguous K/V:
#: heads-first ``[B, H, S, D]`` or token-major ``[B, S, H, D]``.
DENSE_LAYOUTS = {
    "heads-first": (1, "bhgd,bhsd->bhgs", "bhgs,bhsd->bhgd"),
    "token-major": (2, "bhgd,bshd->bhgs", "bhgs,bshd->bhgd"),
}


def dense_attention(layout: str, query: jax.Array, keys: jax.Array, values: jax.Array) -> jax.Array:
    """``query [B, QH, D]`` over contiguous K/V in ``layout`` (a key of ``DENSE_LAYOUTS``)."""
    heads_axis, scores_spec, output_spec = DENSE_LAYOUTS[layout]
    batch, heads, dim = keys.shape[0], keys.shape[heads_axis], keys.shape[3]
    grouped = query.reshape(batch, heads, -1, dim)
    scores = jnp.einsum(scores_spec, grouped, keys) / math.sqrt(dim)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum(output_spec, weights, values).reshape(query.shape)


def attention_times(geometry: Geometry, context: int, args: argparse.Namespace) -> dict[str, float]:
    """Seconds of a paged decode step and of dense decode attention.

    *paged* is one decode step through the manager: ``begin_step`` grows every request by a
    token, ``step.write`` stores its K/V in the pool (donated, in place) and ``step.attention``
    reads the pool. *dense* is attention alone on K/V already contiguous (no write): a floor.

    Raises:
        DisagreementError: paged or token-major attention differs from heads-first.
    """
    batch = args.batch
    warmup = 2  # the verification step and alternate()'s warm-up call of paged
    manager, handles = grown_batch(geometry, context, batch, extra_steps=warmup + 2 * args.repeats)
    rng = np.random.default_rng(1)
    query = jnp.asarray(rng.standard_normal((batch, geometry.num_query_heads, geometry.head_dim), np.float32))
    new_kv = jnp.asarray(rng.standard_normal((batch, geometry.num_kv_heads, geometry.head_dim), np.float32))

    def paged() -> jax.Array:
        step = manager.begin_step(handles, 1)
        step.write(0, new_kv, new_kv)
        return step.attention(0, query)

    verified = np.asarray(paged())  # the contexts now hold the new token too
    gathered = [manager.gather(handle, 0) for handle in handles]
    token_major = [jnp.stack([pair[side] for pair in gathered]) for side in (0, 1)]  # [B, S, H, D]
    heads_first = [jnp.transpose(array, (0, 2, 1, 3)).copy() for array in token_major]  # [B, H, S, D]
    contiguous = {"heads-first": heads_first, "token-major": token_major}

    def dense(layout: str) -> Callable[[], jax.Array]:
        jitted: Callable[..., jax.Array] = jax.jit(partial(dense_attention, layout))
        keys, values = contiguous[layout]

        def call() -> jax.Array:
            return jitted(query, keys, values)

        return call

    calls: dict[str, Callable[[], jax.Array]] = {
        "paged": paged,
        **{f"dense {name}": dense(name) for name in contiguous},
    }
    reference = np.asarray(calls["dense heads-first"]())
    for name, output in (("paged", verified), ("dense token-major", np.asarray(calls["dense token-major"]()))):
        same, error = agree([output], [reference])
        require(same, f"{name} differs from dense heads-first by {error:.3g} at context {context}")
    # The two dense layouts against each other first; then the faster one against paged
    # (alternating with a much slower contender would slow whichever call follows it).
    dense_times = alternate({name: calls[name] for name in ("dense heads-first", "dense token-major")}, args)
    best = min(dense_times, key=dense_times.__getitem__)
    head_to_head = alternate({"paged": calls["paged"], best: calls[best]}, args)
    return {**dense_times, **head_to_head}


# -- report ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="contexts 1024,2048, pools of 16 and 256 MiB, 3 repeats, the first layout only")
    parser.geometry(query_heads=32, kv_heads=8, head_dim=128, block_size=16)
    parser.flag("--contexts", ([1024, 4096, 8192], [1024, 2048]), type=int_list, help="decode contexts")
    parser.flag(
        "--pool-mib", ([64, 1024], [16, 256]), type=int_list, help="pool sizes of the write test, MiB (small,large)"
    )
    parser.flag("--batch", 4, help="requests per decode step")
    parser.flag(
        "--kv-layouts", (["heads_first", "NHD"], ["heads_first"]), type=layout_list, help="pool layouts of paged"
    )
    parser.timing((15, 3), what="timed calls per contender")
    return parser.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the write costs and the decode steps; ``DisagreementError`` if paged and dense disagree."""
    args = parse_args(argv)
    print_environment()
    geometry = geometry_of(args, num_layers=1)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {geometry.num_kv_heads} KV "
        f"heads, {geometry.num_query_heads} query heads of {geometry.head_dim}, blocks of {geometry.block_size}, "
        f"float32; batch {args.batch}; {args.statistic}s of {args.repeats}"
    )

    pool_mib: list[int] = args.pool_mib
    print(f"\nwrite of {args.batch} tokens into one layer's pool (K and V) of {' vs '.join(map(str, pool_mib))} MiB")
    costs = write_costs(geometry, args)
    for contender, medians in costs.items():
        sizes = "  ".join(f"{size:>5} MiB {value * 1e3:8.3f} ms" for size, value in zip(pool_mib, medians, strict=True))
        print(f"  {contender:<8} {sizes}   ratio {ratio(medians[-1], medians[0]):>7}")
    donated_ratio = costs["donated"][-1] / costs["donated"][0]
    print(f"  target: donated ratio <= 1.3 -> {met(donated_ratio <= 1.3)} ({donated_ratio:.2f})")

    for layout in args.kv_layouts:
        print(
            f"\ndecode step, {args.batch} requests, pool layout {layout} (paged: write + attention; dense: attention)"
        )
        for context in args.contexts:
            measured = attention_times(replace(geometry, kv_layout=layout), context, args)
            dense = {name: measured[name] for name in ("dense heads-first", "dense token-major")}
            best_name = min(dense, key=dense.__getitem__)
            paged_over_dense = measured["paged"] / measured[best_name]
            listing = "  ".join(f"{name} {value * 1e3:7.3f} ms" for name, value in measured.items())
            target = f"  target <= 2x: {met(paged_over_dense <= 2)}" if context == 4096 else ""
            print(
                f"  context {context:>5}: {listing}  paged/best dense ({best_name}) "
                f"{ratio(measured['paged'], measured[best_name]):>6}{target}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
