"""Pure functions that move the pool's bytes: write slots, gather tokens, copy blocks.

Each takes pool arrays and returns new ones, so it runs inside any ``jax.jit`` (a
user's model step included). Jitted with the pool donated, XLA updates the pool's buffer
in place: the cost follows the tokens moved, not the pool's size.

Pool layouts (:data:`kvcache_core.KV_LAYOUTS`): ``"NHD"`` ``[blocks, block_size, heads,
dim]``, ``"HND"`` ``[blocks, heads, block_size, dim]``, ``"heads_first"`` ``[heads,
blocks, block_size, dim]``.
"""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvcache_core.contract.config import KV_LAYOUTS
from kvcache_core.errors import InvalidArgumentError, ShapeMismatchError

__all__ = [
    "BLOCK_AXIS",
    "HEADS_AXIS",
    "copy_blocks",
    "gather",
    "pool_geometry",
    "read_blocks",
    "write",
    "write_blocks",
    "write_part",
]

#: Axis of the block index in each layout.
BLOCK_AXIS: dict[str, int] = {"NHD": 0, "HND": 0, "heads_first": 1}
#: Axis of the KV heads in each layout (the axis a mesh shards).
HEADS_AXIS: dict[str, int] = {"NHD": 2, "HND": 1, "heads_first": 0}


def pool_geometry(cache: jax.Array, kv_layout: str) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, num_heads, head_dim)`` of a pool array.

    Raises:
        InvalidArgumentError: unknown layout.
        ShapeMismatchError: ``cache`` is not 4-D.
    """
    if kv_layout not in KV_LAYOUTS:
        raise InvalidArgumentError(f"kv_layout {kv_layout!r} is unknown; valid: {', '.join(KV_LAYOUTS)}")
    if cache.ndim != 4:
        raise ShapeMismatchError(f"a pool must be 4-D in layout {kv_layout}, got shape {tuple(cache.shape)}")
    shape = tuple(int(size) for size in cache.shape)
    if kv_layout == "NHD":
        return shape[0], shape[1], shape[2], shape[3]
    if kv_layout == "HND":
        return shape[0], shape[2], shape[1], shape[3]
    return shape[1], shape[2], shape[0], shape[3]


def _check_pair(key_cache: jax.Array, value_cache: jax.Array, kv_layout: str) -> tuple[int, int, int, int]:
    geometry = pool_geometry(key_cache, kv_layout)
    # The values' last axis may differ from the keys' (CacheConfig.value_head_dim).
    if key_cache.shape[:3] != value_cache.shape[:3] or value_cache.ndim != 4 or key_cache.dtype != value_cache.dtype:
        raise ShapeMismatchError(
            f"key and value pools must share shape (but for their widths) and dtype, got {tuple(key_cache.shape)} "
            f"{key_cache.dtype} and {tuple(value_cache.shape)} {value_cache.dtype}"
        )
    return geometry


def _token_index(kv_layout: str, blocks: jax.Array, offsets: jax.Array) -> tuple[Any, ...]:
    """Index of tokens ``(blocks[i], offsets[i])``: ``[n, heads, dim]`` (``[heads, n, dim]``
    for heads_first, where the indexed axes stay in place)."""
    if kv_layout == "NHD":
        return (blocks, offsets)
    if kv_layout == "HND":
        return (blocks, slice(None), offsets)
    return (slice(None), blocks, offsets)


def _blocks_and_offsets(slots: jax.Array, count: int, num_blocks: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    """The blocks and offsets of ``slots``, those outside the pool past its end (dropped)."""
    total = num_blocks * block_size
    slots = slots.astype(jnp.int32)
    # Out-of-range slots become distinct slots past the end, which mode="drop" discards
    # (a negative one would otherwise wrap around to the pool's end).
    slots = jnp.where((slots >= 0) & (slots < total), slots, total + jnp.arange(count, dtype=jnp.int32))
    return slots // block_size, slots % block_size


def write_part(
    key_cache: jax.Array,
    value_cache: jax.Array,
    slots: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    *,
    place: tuple[int, int, int],
    kv_layout: str = "NHD",
) -> tuple[jax.Array, jax.Array]:
    """:func:`write` into a part of each slot's row: ``keys`` ``[n, h, d]`` into heads
    ``place[0]`` to ``place[0] + h`` and key features ``place[1]`` to ``place[1] + d``,
    ``values`` ``[n, h, dv]`` into the same heads and value features from ``place[2]``; the
    rest of each row is kept (a layer viewing a page side by side with others,
    :class:`~kvcache_core.contract.groups.ViewPlace`). Pure, as :func:`write`.

    Raises:
        InvalidArgumentError: unknown layout.
        ShapeMismatchError: shapes that do not fit together, or a part outside the rows.
    """
    num_blocks, block_size, num_heads, head_dim = _check_pair(key_cache, value_cache, kv_layout)
    count = int(slots.shape[0]) if slots.ndim == 1 else -1
    head, key_at, value_at = place
    heads = int(keys.shape[1]) if keys.ndim == 3 else -1
    parts = ((key_cache, keys, key_at, head_dim), (value_cache, values, value_at, int(value_cache.shape[3])))
    if (
        count < 0
        or heads < 0
        or min(place) < 0
        or head + heads > num_heads
        or any(
            tuple(data.shape[:2]) != (count, heads) or first + data.shape[-1] > width for _, data, first, width in parts
        )
    ):
        raise ShapeMismatchError(
            f"write_part takes slots [n] and keys [n, h, d], values [n, h, dv] inside heads {num_heads}, key features "
            f"{head_dim} and value features {parts[1][3]} from {place}; got slots {tuple(slots.shape)}, keys "
            f"{tuple(keys.shape)}, values {tuple(values.shape)}"
        )
    blocks, offsets = _blocks_and_offsets(slots, count, num_blocks, block_size)
    new_pools: list[jax.Array] = []
    for cache, data, first, _ in parts:
        head_part, features = slice(head, head + heads), slice(first, first + int(data.shape[2]))
        update = data.astype(cache.dtype)
        index: tuple[Any, ...]
        if kv_layout == "NHD":
            index = (blocks, offsets, head_part, features)  # -> [n, h, d]
        elif kv_layout == "HND":
            index = (blocks, head_part, offsets, features)  # the indexed axes first -> [n, h, d]
        else:  # heads_first: the indexed axes stay in place -> [h, n, d]
            index, update = (head_part, blocks, offsets, features), update.transpose(1, 0, 2)
        new_pools.append(cache.at[index].set(update, mode="drop", unique_indices=True))
    return new_pools[0], new_pools[1]


def write(
    key_cache: jax.Array,
    value_cache: jax.Array,
    slots: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    *,
    kv_layout: str = "NHD",
) -> tuple[jax.Array, jax.Array]:
    """Scatter ``keys``/``values`` ``[n, num_heads, head_dim]`` into ``slots`` ``[n]``.

    Pure: returns the new ``(key_cache, value_cache)``. Jit it with the caches donated
    (``jax.jit(write, donate_argnums=(0, 1), static_argnames="kv_layout")``, or inside a
    jitted step that donates them) and XLA writes the pool's buffer in place.

    Args:
        key_cache, value_cache: one layer's pools in ``kv_layout``.
        slots: ``[n]`` int32, ``block * block_size + offset``, distinct. A slot outside
            ``[0, num_blocks * block_size)`` writes nothing (pad a batch with them).
        keys, values: ``[n, num_heads, head_dim]`` and ``[n, num_heads, value_dim]`` (the
            value pool's last axis), cast to the pool's dtype.
        kv_layout: ``"NHD"``, ``"HND"`` or ``"heads_first"``.

    Raises:
        InvalidArgumentError: unknown layout.
        ShapeMismatchError: shapes that do not fit together (at trace time).
    """
    num_blocks, block_size, num_heads, head_dim = _check_pair(key_cache, value_cache, kv_layout)
    value_dim = int(value_cache.shape[3])
    count = int(slots.shape[0]) if slots.ndim == 1 else -1
    expected = (count, num_heads, head_dim)
    if count < 0 or tuple(keys.shape) != expected or tuple(values.shape) != (count, num_heads, value_dim):
        raise ShapeMismatchError(
            f"write takes slots [n], keys [n, {num_heads}, {head_dim}] and values [n, {num_heads}, {value_dim}], got slots "
            f"{tuple(slots.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}"
        )
    blocks, offsets = _blocks_and_offsets(slots, count, num_blocks, block_size)
    index = _token_index(kv_layout, blocks, offsets)
    new_pools: list[jax.Array] = []
    for cache, tokens in ((key_cache, keys), (value_cache, values)):
        update = tokens.astype(cache.dtype)
        if kv_layout == "heads_first":
            update = update.transpose(1, 0, 2)
        new_pools.append(cache.at[index].set(update, mode="drop", unique_indices=True))
    return new_pools[0], new_pools[1]


def read_blocks(cache: jax.Array, blocks: jax.Array, *, kv_layout: str = "NHD") -> jax.Array:
    """Blocks ``[m]`` of one pool as ``[m, block_size, num_heads, head_dim]`` (every layout).

    Block ids outside the pool are clipped to it.
    """
    pool_geometry(cache, kv_layout)
    picked = jnp.take(cache, blocks, axis=BLOCK_AXIS[kv_layout], mode="clip")
    if kv_layout == "HND":  # [m, heads, block_size, dim]
        return picked.transpose(0, 2, 1, 3)
    if kv_layout == "heads_first":  # [heads, m, block_size, dim]
        return picked.transpose(1, 2, 0, 3)
    return picked


def write_blocks(cache: jax.Array, blocks: jax.Array, data: jax.Array, *, kv_layout: str = "NHD") -> jax.Array:
    """Pure: ``cache`` with blocks ``[m]`` set to ``data`` ``[m, block_size, num_heads,
    head_dim]`` (every layout); block ids outside the pool write nothing."""
    pool_geometry(cache, kv_layout)
    update = data.astype(cache.dtype)
    if kv_layout == "HND":
        update = update.transpose(0, 2, 1, 3)
    elif kv_layout == "heads_first":
        update = update.transpose(2, 0, 1, 3)
    if kv_layout == "heads_first":
        return cache.at[:, blocks].set(update, mode="drop")
    return cache.at[blocks].set(update, mode="drop")


def gather(
    key_cache: jax.Array, value_cache: jax.Array, blocks: jax.Array, *, kv_layout: str = "NHD"
) -> tuple[jax.Array, jax.Array]:
    """The tokens of blocks ``[m]``, in order, as contiguous ``[m * block_size, num_heads,
    head_dim]`` keys and values (cut the result to the sequence's length)."""
    _check_pair(key_cache, value_cache, kv_layout)
    result: list[jax.Array] = []
    for cache in (key_cache, value_cache):
        picked = read_blocks(cache, blocks, kv_layout=kv_layout)
        result.append(picked.reshape(-1, picked.shape[2], picked.shape[3]))
    return result[0], result[1]


def copy_blocks(
    caches: Sequence[jax.Array], source: jax.Array, destination: jax.Array, *, kv_layout: str = "NHD"
) -> tuple[jax.Array, ...]:
    """Pure: every pool of ``caches`` with block ``destination[i]`` set to block
    ``source[i]`` (all sources are read before any is written). A destination outside the
    pool writes nothing."""
    axis = BLOCK_AXIS.get(kv_layout, -1)
    copied: list[jax.Array] = []
    for cache in caches:
        pool_geometry(cache, kv_layout)
        moved = jnp.take(cache, source, axis=axis, mode="clip")
        index: tuple[Any, ...] = (slice(None),) * axis + (destination,)
        copied.append(cache.at[index].set(moved, mode="drop"))
    return tuple(copied)
