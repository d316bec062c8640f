"""The jitted programs of a JAX pool: one set per layout and placement, shared by every
pool of them (:class:`JaxStorage` holds one and calls it; the programs donate the pools
they update, so XLA writes in place)."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from kvcache_jax.attention import paged_attention
from kvcache_jax.scatter import copy_blocks, gather, read_blocks, write, write_blocks, write_part
from kvcache_jax.sharding import REPLICATED, Placement, shard_over_heads

__all__ = ["Pools", "Programs", "programs_for", "zeros_program"]

Pools = tuple[jax.Array, ...]


def _pad_rows(rows: int) -> Callable[[jax.Array], jax.Array]:
    def pad(tokens: jax.Array) -> jax.Array:
        return jnp.pad(tokens, ((0, rows - tokens.shape[0]), (0, 0), (0, 0)))

    return pad


@dataclass(frozen=True)
class Programs:
    """The jitted programs of one layout and placement (shared by every pool of them)."""

    kv_layout: str
    placement: Placement
    _attention: dict[tuple[Any, ...], Callable[..., jax.Array]] = field(
        default_factory=dict[tuple[Any, ...], Callable[..., jax.Array]], compare=False, hash=False
    )
    _padders: dict[int, Callable[[jax.Array], jax.Array]] = field(
        default_factory=dict[int, Callable[[jax.Array], jax.Array]], compare=False, hash=False
    )
    _part_writes: dict[tuple[int, int, int], Callable[..., tuple[jax.Array, jax.Array]]] = field(
        default_factory=dict[tuple[int, int, int], Callable[..., tuple[jax.Array, jax.Array]]],
        compare=False,
        hash=False,
    )

    def _jit(
        self, function: Callable[..., Any], in_specs: tuple[Any, ...], out_specs: Any, donate: tuple[int, ...] = ()
    ) -> Callable[..., Any]:
        mapped = shard_over_heads(function, self.placement, in_specs, out_specs)
        return jax.jit(mapped, donate_argnums=donate)

    @functools.cached_property
    def write(self) -> Callable[..., tuple[jax.Array, jax.Array]]:
        """``(keys_pool, values_pool, slots, keys, values) -> pools``, pools donated."""
        layout, pool, tokens = self.kv_layout, self.placement.pool_spec(self.kv_layout), self.placement.tokens_spec

        def program(k: jax.Array, v: jax.Array, s: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
            return write(k, v, s, x, y, kv_layout=layout)

        return self._jit(program, (pool, pool, REPLICATED, tokens, tokens), (pool, pool), donate=(0, 1))

    def write_part(self, place: tuple[int, int, int]) -> Callable[..., tuple[jax.Array, jax.Array]]:
        """``(keys_pool, values_pool, slots, keys, values) -> pools``, pools donated, into the
        part of each row from ``place`` (first head, key feature, value feature:
        :func:`~kvcache_jax.scatter.write_part`). Jitted over the whole pools with their
        sharding, not per shard: a view's heads may lie across the mesh's split (XLA splits
        the scatter); the sources come replicated."""
        program = self._part_writes.get(place)
        if program is None:
            layout, pools = self.kv_layout, self.placement.pool(self.kv_layout)

            def scatter(k: jax.Array, v: jax.Array, s: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
                return write_part(k, v, s, x, y, place=place, kv_layout=layout)

            program = self._part_writes[place] = jax.jit(scatter, donate_argnums=(0, 1), out_shardings=(pools, pools))
        return program

    @functools.cached_property
    def gather(self) -> Callable[..., tuple[jax.Array, jax.Array]]:
        """``(keys_pool, values_pool, blocks) -> (keys, values)`` ``[m * block_size, heads, dim]``."""
        layout, pool, tokens = self.kv_layout, self.placement.pool_spec(self.kv_layout), self.placement.tokens_spec

        def program(k: jax.Array, v: jax.Array, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
            return gather(k, v, blocks, kv_layout=layout)

        return self._jit(program, (pool, pool, REPLICATED), (tokens, tokens))

    @functools.cached_property
    def copy_blocks(self) -> Callable[..., Pools]:
        """``(pools, source, destination) -> pools``, every pool donated."""
        layout, pool = self.kv_layout, self.placement.pool_spec(self.kv_layout)

        def program(pools: Pools, source: jax.Array, destination: jax.Array) -> Pools:
            return copy_blocks(pools, source, destination, kv_layout=layout)

        return self._jit(program, (pool, REPLICATED, REPLICATED), pool, donate=(0,))

    @functools.cached_property
    def read_all(self) -> Callable[..., tuple[jax.Array, jax.Array]]:
        """``(key_pools, value_pools, blocks) -> [layers, m, block_size, heads, dim]`` twice."""
        layout, pool, host = self.kv_layout, self.placement.pool_spec(self.kv_layout), self.placement.host_blocks_spec

        def program(keys: Pools, values: Pools, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
            return (
                jnp.stack([read_blocks(cache, blocks, kv_layout=layout) for cache in keys]),
                jnp.stack([read_blocks(cache, blocks, kv_layout=layout) for cache in values]),
            )

        return self._jit(program, (pool, pool, REPLICATED), (host, host))

    @functools.cached_property
    def write_all(self) -> Callable[..., tuple[Pools, Pools]]:
        """``(key_pools, value_pools, blocks, keys, values) -> pools``, every pool donated."""
        layout, pool, host = self.kv_layout, self.placement.pool_spec(self.kv_layout), self.placement.host_blocks_spec

        def program(
            keys: Pools, values: Pools, blocks: jax.Array, new_keys: jax.Array, new_values: jax.Array
        ) -> tuple[Pools, Pools]:
            return (
                tuple(write_blocks(cache, blocks, new_keys[i], kv_layout=layout) for i, cache in enumerate(keys)),
                tuple(write_blocks(cache, blocks, new_values[i], kv_layout=layout) for i, cache in enumerate(values)),
            )

        return self._jit(program, (pool, pool, REPLICATED, host, host), (pool, pool), donate=(0, 1))

    def attention(
        self,
        max_query_len: int,
        causal: bool,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
        chunk: int | None = None,
        with_sinks: bool = False,
        with_scales: bool = False,
    ) -> Callable[..., jax.Array]:
        """``(query, keys_pool, values_pool, block_tables, seq_lens, qo_indptr[, key_scales,
        value_scales][, sinks]) -> output``: the scales ``[heads, num_blocks, block_size]`` of
        a quantized pool only ``with_scales`` (each loop step decodes the blocks it reads),
        split over the heads as the pool is; ``sinks [query_heads]`` only ``with_sinks``,
        split over the heads as the queries are."""
        key = (max_query_len, causal, scale, sliding_window, softcap, chunk, with_sinks, with_scales)
        program = self._attention.get(key)
        if program is None:
            layout, pool, tokens = self.kv_layout, self.placement.pool_spec(self.kv_layout), self.placement.tokens_spec

            def attend(
                query: jax.Array,
                k: jax.Array,
                v: jax.Array,
                block_tables: jax.Array,
                seq_lens: jax.Array,
                qo_indptr: jax.Array,
                *extra: jax.Array,
            ) -> jax.Array:
                key_scales, value_scales = extra[:2] if with_scales else (None, None)
                sinks = extra[-1] if with_sinks else None
                return paged_attention(
                    query,
                    k,
                    v,
                    block_tables,
                    seq_lens,
                    qo_indptr,
                    max_query_len=max_query_len,
                    scale=scale,
                    causal=causal,
                    kv_layout=layout,
                    sliding_window=sliding_window,
                    softcap=softcap,
                    sinks=sinks,
                    chunk=chunk,
                    key_scales=key_scales,
                    value_scales=value_scales,
                )

            replicated = REPLICATED
            specs: tuple[Any, ...] = (tokens, pool, pool, replicated, replicated, replicated)
            if with_scales:
                scales_spec = self.placement.heads_at(3, 0)  # [heads, num_blocks, block_size]
                specs = (*specs, scales_spec, scales_spec)
            if with_sinks:
                specs = (*specs, self.placement.heads_spec)
            program = self._jit(attend, specs, tokens)
            self._attention[key] = program
        return program

    def pad_rows(self, rows: int) -> Callable[[jax.Array], jax.Array]:
        """``[n, heads, dim] -> [rows, heads, dim]``, zero rows appended."""
        program = self._padders.get(rows)
        if program is None:
            tokens = self.placement.tokens_spec
            program = self._jit(_pad_rows(rows), (tokens,), tokens)
            self._padders[rows] = program
        return program

    def zeros(self, shape: tuple[int, ...], dtype: str) -> jax.Array:
        """A new zeroed pool array, created in place on its device(s)."""
        return zeros_program(shape, dtype, self.kv_layout, self.placement)()


@functools.cache
def programs_for(kv_layout: str, placement: Placement) -> Programs:
    return Programs(kv_layout, placement)


@functools.cache
def zeros_program(shape: tuple[int, ...], dtype: str, kv_layout: str, placement: Placement) -> Callable[[], jax.Array]:
    def zeros() -> jax.Array:
        return jnp.zeros(shape, dtype=jnp.dtype(dtype))

    return jax.jit(zeros, out_shardings=placement.pool(kv_layout))
