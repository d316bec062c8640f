"""Quantized JAX pools (``jnp.int8``, ``jnp.float8_e4m3fn``): :class:`QuantizedJaxStorage`.

The encodings and their scales are core's (:mod:`kvcache_core.contract.quantization`): int8 with one
scale per token per KV head from its maximum, float8 e4m3 with one scale per KV head per
layer (calibrated, or grown by the running maximum), each token recording its scale. The
pools hold the raw values and are moved by :class:`~kvcache_jax.JaxStorage`'s programs; the
scales, ``[num_heads, num_blocks, block_size]`` float32 per layer and K/V, are moved beside
them by the programs here. Attention is :class:`~kvcache_jax.JaxStorage`'s program, given
the scales: each loop step decodes only the blocks it reads.

Every encoding and scale is per KV head, so on a mesh the scales are split over the heads
as the pool is and every program here runs on each device's own heads, communicating
nothing, exactly as the plain pool's do (:mod:`kvcache_jax.sharding`).
"""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from kvcache_core.contract import quantization
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.scalars import FLOAT32_TINY
from kvcache_core.errors import UnsupportedConfigError
from kvcache_core.offload import host_form
from kvcache_jax.sharding import REPLICATED, Placement, shard_over_heads
from kvcache_jax.spec import QUANTIZED_POOL_DTYPES
from kvcache_jax.storage import JaxStorage

__all__ = ["QuantizedJaxStorage"]

HostArray = npt.NDArray[Any]
IndexArray = npt.NDArray[np.int64]
Scales = tuple[jax.Array, ...]

#: Compute dtypes of a quantized JAX pool.
_COMPUTE_DTYPES = ("float32", "float16", "bfloat16")

#: ``(rank, heads axis)`` of the scales ``[heads, num_blocks, block_size]`` of a layer's K or V.
_SCALES = (3, 0)
#: ``(rank, heads axis)`` of ``[rows, heads]`` arrays: each token head's scale, the per-head
#: scales of K and V.
_COLUMNS = (2, 1)


def _quantize(values: jax.Array, head_scales: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
    """``values [n, heads, dim]`` -> ``(raw, scales [n, heads] float32)`` (see core's rules)."""
    data = values.astype(jnp.float32)
    limit = quantization.QUANTIZED_RANGE[dtype]
    if dtype == "int8":
        scales = jnp.abs(data).max(axis=2) * jnp.float32(1.0 / limit)
    else:
        scales = jnp.broadcast_to(head_scales[None, :], data.shape[:2])
    scales = _flush_tiny(scales)
    inverse = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)
    scaled = jnp.clip(data * inverse[:, :, None], -limit, limit)
    if dtype == "int8":
        scaled = jnp.round(scaled)
    return scaled.astype(jnp.dtype(dtype)), scales


def _grow(scales: jax.Array, values: jax.Array) -> jax.Array:
    """The float8 running-maximum rule: ``max(scales, max(|values|) / 448)`` per head."""
    peak = jnp.abs(values.astype(jnp.float32)).max(axis=(0, 2), initial=0.0) * jnp.float32(
        1.0 / quantization.QUANTIZED_RANGE["float8_e4m3fn"]
    )
    return jnp.maximum(scales, _flush_tiny(peak))


def _flush_tiny(scales: jax.Array) -> jax.Array:
    """Scales below ``FLOAT32_TINY`` set to 0, as core's :func:`~kvcache_core.contract.quantization.flush_tiny_scales`."""
    return jnp.where(scales >= jnp.float32(FLOAT32_TINY), scales, jnp.float32(0))


@dataclass(frozen=True)
class _ScalePrograms:
    """The jitted programs of one quantized encoding and placement, each run per device on
    its own heads (shared by every pool of them)."""

    placement: Placement
    dtype: str
    io_dtype: str
    track_scales: bool

    def _jit(self, function: Callable[..., Any], in_specs: tuple[Any, ...], out_specs: Any) -> Callable[..., Any]:
        return jax.jit(shard_over_heads(function, self.placement, in_specs, out_specs))

    @functools.cached_property
    def encode(self) -> Callable[..., tuple[jax.Array, ...]]:
        """``(head_scales [2, heads], keys, values) -> (raw_keys, raw_values, key_scales [n,
        heads], value_scales [n, heads], head_scales [2, heads])``; float8 head scales grown
        by the running maximum when tracked."""
        dtype, grow = self.dtype, self.dtype == "float8_e4m3fn" and self.track_scales
        tokens, columns = self.placement.tokens_spec, self.placement.heads_at(*_COLUMNS)

        def encode(heads: jax.Array, keys: jax.Array, values: jax.Array) -> tuple[jax.Array, ...]:
            if grow:
                heads = jnp.stack([_grow(heads[0], keys), _grow(heads[1], values)])
            raw_keys, key_scales = _quantize(keys, heads[0], dtype)
            raw_values, value_scales = _quantize(values, heads[1], dtype)
            return raw_keys, raw_values, key_scales, value_scales, heads

        return self._jit(encode, (columns, tokens, tokens), (tokens, tokens, columns, columns, columns))

    @functools.cached_property
    def set_tokens(self) -> Callable[..., tuple[jax.Array, jax.Array]]:
        """``(key_scales, value_scales, blocks [n], offsets [n], new_keys [n, heads],
        new_values [n, heads]) -> scales`` with the tokens at ``(blocks, offsets)`` set."""
        scales, columns = self.placement.heads_at(*_SCALES), self.placement.heads_at(*_COLUMNS)

        def set_tokens(
            k: jax.Array, v: jax.Array, blocks: jax.Array, offsets: jax.Array, x: jax.Array, y: jax.Array
        ) -> tuple[jax.Array, jax.Array]:
            return k.at[:, blocks, offsets].set(x.T), v.at[:, blocks, offsets].set(y.T)

        return self._jit(set_tokens, (scales, scales, REPLICATED, REPLICATED, columns, columns), (scales, scales))

    @functools.cached_property
    def copy_blocks(self) -> Callable[..., Scales]:
        """``(every layer's scales, source, destination) -> scales`` with ``source[i]``'s
        copied into ``destination[i]``."""
        scales = self.placement.heads_at(*_SCALES)

        def copy(every: Scales, source: jax.Array, destination: jax.Array) -> Scales:
            return tuple(part.at[:, destination].set(part[:, source]) for part in every)

        return self._jit(copy, (scales, REPLICATED, REPLICATED), scales)

    @functools.cached_property
    def set_blocks(self) -> Callable[..., jax.Array]:
        """``(scales, blocks [n], new [heads, n, block_size]) -> scales`` with ``blocks`` set."""
        scales = self.placement.heads_at(*_SCALES)

        def set_blocks(part: jax.Array, blocks: jax.Array, new: jax.Array) -> jax.Array:
            return part.at[:, blocks].set(new)

        return self._jit(set_blocks, (scales, REPLICATED, scales), scales)

    @functools.cached_property
    def decode(self) -> Callable[..., jax.Array]:
        """``(raw [m * block_size, heads, dim], scales, blocks [m]) -> values`` in the compute dtype."""
        io_dtype, tokens, scales = self.io_dtype, self.placement.tokens_spec, self.placement.heads_at(*_SCALES)

        def decode(raw: jax.Array, part: jax.Array, blocks: jax.Array) -> jax.Array:
            picked = jnp.take(part, blocks, axis=1)  # [H, m, bs]
            per_token = picked.reshape(picked.shape[0], -1).T  # [m * bs, H]
            return (raw.astype(jnp.float32) * per_token[:, :, None]).astype(jnp.dtype(io_dtype))

        return self._jit(decode, (tokens, scales, REPLICATED), tokens)


@functools.cache
def _scale_programs(placement: Placement, dtype: str, io_dtype: str, track_scales: bool) -> _ScalePrograms:
    return _ScalePrograms(placement, dtype, io_dtype, track_scales)


class QuantizedJaxStorage(JaxStorage):
    """A quantized JAX pool, on one device or with its KV heads split over a mesh axis: raw
    int8 / float8 pools (moved by :class:`~kvcache_jax.JaxStorage`) and their scales, split
    over the heads as the pools are. ``write`` takes and ``gather`` and attention return
    ``config.io_dtype``; host copies are core's packed ``uint8`` form.

    Raises:
        UnsupportedConfigError: a compute dtype JAX pools do not take, or what
            :class:`~kvcache_jax.JaxStorage` refuses (heads not divisible by the mesh
            axis's size, ...).
        InvalidTypeError, InvalidArgumentError: a bad ``mesh`` or ``axis``.
    """

    POOL_DTYPES: ClassVar[tuple[str, ...]] = QUANTIZED_POOL_DTYPES

    def __init__(self, config: CacheConfig, *, mesh: object = None, axis: object = None) -> None:
        if config.io_dtype not in _COMPUTE_DTYPES:
            raise UnsupportedConfigError(
                f"compute_dtype {config.io_dtype!r} is not one of the jax backend's {', '.join(_COMPUTE_DTYPES)}"
            )
        super().__init__(config, mesh=mesh, axis=axis)
        config, placement = self.config, self.placement
        self._scale_programs = _scale_programs(placement, config.dtype, config.io_dtype, config.kv_scales is None)
        self._scales_sharding = placement.sharding(placement.heads_at(*_SCALES))
        shape = (config.num_heads, config.num_blocks, config.block_size)
        self._scales: list[list[jax.Array]] = [
            [jax.device_put(np.zeros(shape, np.float32), self._scales_sharding) for _ in range(config.num_layers)]
            for _ in range(2)
        ]
        initial = np.asarray(config.kv_scales if config.kv_scales is not None else 0.0, dtype=np.float32)
        per_layer = initial * np.ones((config.num_layers, 2, config.num_heads), np.float32)
        columns = placement.sharding(placement.heads_at(*_COLUMNS))
        self._head_scales: list[jax.Array] = [jax.device_put(heads, columns) for heads in per_layer]

    def scales(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """The layer's key and value scales, ``[num_heads, num_blocks, block_size]`` float32
        each, split over the heads as the pool is."""
        index = self.config.check_layer(layer)
        return self._scales[0][index], self._scales[1][index]

    def write(self, layer: int, slots: IndexArray, keys: jax.Array, values: jax.Array) -> None:
        """Encode ``[n, heads, dim]`` K/V and scatter them with their scales into ``slots``.

        Raises:
            InvalidArgumentError: NaN or an infinity in ``keys`` or ``values`` (nothing changed).
        """
        config = self.config
        for name, data in (("keys", keys), ("values", values)):
            if not bool(jnp.isfinite(data).all()):
                quantization.check_finite(name, np.asarray(data.astype(jnp.float32)))
        rows = int(keys.shape[0])
        raw_keys, raw_values, key_scales, value_scales, head_scales = self._scale_programs.encode(
            self._head_scales[layer], self._tokens(keys, rows), self._tokens(values, rows)
        )
        super().write(layer, slots, raw_keys, raw_values)
        self._head_scales[layer] = head_scales
        blocks, offsets = np.divmod(np.asarray(slots, dtype=np.int64), config.block_size)
        self._scales[0][layer], self._scales[1][layer] = self._scale_programs.set_tokens(
            self._scales[0][layer],
            self._scales[1][layer],
            self._replicated(blocks.astype(np.int32)),
            self._replicated(offsets.astype(np.int32)),
            key_scales,
            value_scales,
        )

    def gather(self, layer: int, blocks: IndexArray, num_tokens: int) -> tuple[jax.Array, jax.Array]:
        """Dequantized ``[num_tokens, heads, dim]`` copies of the first tokens of ``blocks``."""
        config = self.config
        if num_tokens == 0:
            dtype = jnp.dtype(config.io_dtype)
            empty_keys = jnp.zeros((0, config.num_heads, config.head_dim), dtype=dtype)
            empty_values = jnp.zeros((0, config.num_heads, config.value_width), dtype=dtype)
            placed_keys: jax.Array = jax.device_put(empty_keys, self.placement.tokens)
            placed_values: jax.Array = jax.device_put(empty_values, self.placement.tokens)
            return placed_keys, placed_values
        raw_keys, raw_values = super().gather(layer, blocks, len(blocks) * config.block_size)
        block_index = self._replicated(np.asarray(blocks, dtype=np.int32))
        keys = self._scale_programs.decode(raw_keys, self._scales[0][layer], block_index)
        values = self._scale_programs.decode(raw_values, self._scales[1][layer], block_index)
        return keys[:num_tokens], values[:num_tokens]

    def copy_blocks(self, source: IndexArray, destination: IndexArray) -> None:
        """Copy every layer's raw K/V and scales of ``source[i]`` into ``destination[i]``."""
        super().copy_blocks(source, destination)
        if len(source) == 0:
            return
        layers = self.config.num_layers
        copied = self._scale_programs.copy_blocks(
            (*self._scales[0], *self._scales[1]),
            self._replicated(np.asarray(source, dtype=np.int32)),
            self._replicated(np.asarray(destination, dtype=np.int32)),
        )
        self._scales = [list(copied[:layers]), list(copied[layers:])]

    def _host_scales(self, kv: int, blocks: IndexArray) -> npt.NDArray[np.float32]:
        """``[layers, n, block_size, heads]`` host copies of the scales of ``blocks``."""
        index = np.asarray(blocks, dtype=np.int64)
        stacked = np.stack([self.to_numpy(scales)[:, index] for scales in self._scales[kv]])  # [L, H, n, bs]
        host: npt.NDArray[np.float32] = stacked.transpose(0, 2, 3, 1).astype(np.float32)
        return host

    def blocks_to_host(self, blocks: IndexArray) -> tuple[HostArray, HostArray]:
        """Packed host copies ``uint8 [layers, n, block_size, heads, dim + 4]``: raw bytes and
        scale of each token head (:func:`kvcache_core.contract.quantization.unpack_host`)."""
        raw_keys, raw_values = self._elements_to_host(blocks)
        return (
            quantization.pack_host(raw_keys, self._host_scales(0, blocks)),
            quantization.pack_host(raw_values, self._host_scales(1, blocks)),
        )

    def blocks_from_host(self, blocks: IndexArray, keys: HostArray, values: HostArray) -> None:
        """Write packed host copies made by :meth:`blocks_to_host` into ``blocks``.

        Raises:
            ArrayTypeError, DTypeMismatchError, ShapeMismatchError: not the packed form of
                ``len(blocks)`` blocks of this pool. Nothing changes when it raises.
        """
        shape = host_form.host_shape(self.config, len(blocks))
        host_form.check_host_array(self.config, "keys", keys, shape)
        host_form.check_host_array(
            self.config, "values", values, host_form.host_shape(self.config, len(blocks), "values")
        )
        raw_keys, key_scales = quantization.unpack_host(self.config, keys, "keys")
        raw_values, value_scales = quantization.unpack_host(self.config, values, "values")
        self._elements_from_host(blocks, raw_keys, raw_values)
        if len(blocks) == 0:
            return
        index = self._replicated(np.asarray(blocks, dtype=np.int32))
        for kv, host in ((0, key_scales), (1, value_scales)):
            for layer in range(self.config.num_layers):
                per_layer = np.ascontiguousarray(host[layer].transpose(2, 0, 1))  # [H, n, bs]
                new = jax.device_put(per_layer, self._scales_sharding)
                self._scales[kv][layer] = self._scale_programs.set_blocks(self._scales[kv][layer], index, new)

    def _attention_scales(self, layer: int) -> tuple[jax.Array, ...]:
        """The layer's key and value scales: attention decodes each block it reads."""
        return self._scales[0][layer], self._scales[1][layer]
