"""Quantized JAX pools (``jnp.int8``, ``jnp.float8_e4m3fn``): :class:`QuantizedJaxStorage`.

The encodings and their scales are core's (:mod:`kvcache_core.quantization`): int8 with one
scale per token per KV head from its maximum, float8 e4m3 with one scale per KV head per
layer (calibrated, or grown by the running maximum), each token recording its scale. The
pools hold the raw values and are moved by :class:`~kvcache_jax.JaxStorage`'s programs; the
scales, ``[num_heads, num_blocks, block_size]`` float32 per layer and K/V, are moved beside
them. Attention decodes each loop step's blocks only (:func:`kvcache_jax.paged_attention`
with ``key_scales``/``value_scales``).
"""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from kvcache_core import quantization
from kvcache_core.attention_features import combined_window
from kvcache_core.config import QUANTIZED_DTYPES, CacheConfig
from kvcache_core.errors import UnsupportedConfigError
from kvcache_core.page_table import PageTable
from kvcache_jax.attention import paged_attention
from kvcache_jax.storage import JaxStorage

__all__ = ["QuantizedJaxStorage"]

HostArray = npt.NDArray[Any]
IndexArray = npt.NDArray[np.int64]

#: Compute dtypes of a quantized JAX pool.
_COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


@functools.partial(jax.jit, static_argnames=("dtype",))
def _quantize(values: jax.Array, head_scales: jax.Array, *, dtype: str) -> tuple[jax.Array, jax.Array]:
    """``values [n, heads, dim]`` -> ``(raw, scales [n, heads] float32)`` (see core's rules)."""
    data = values.astype(jnp.float32)
    limit = quantization.QUANTIZED_RANGE[dtype]
    if dtype == "int8":
        scales = jnp.abs(data).max(axis=2) * jnp.float32(1.0 / limit)
    else:
        scales = jnp.broadcast_to(head_scales[None, :], data.shape[:2])
    inverse = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)
    scaled = jnp.clip(data * inverse[:, :, None], -limit, limit)
    if dtype == "int8":
        scaled = jnp.round(scaled)
    return scaled.astype(jnp.dtype(dtype)), scales


@jax.jit
def _grow(scales: jax.Array, values: jax.Array) -> jax.Array:
    """The float8 running-maximum rule: ``max(scales, max(|values|) / 448)`` per head."""
    peak = jnp.abs(values.astype(jnp.float32)).max(axis=(0, 2)) * jnp.float32(
        1.0 / quantization.QUANTIZED_RANGE["float8_e4m3fn"]
    )
    return jnp.maximum(scales, peak)


@jax.jit
def _set_scales(scales: jax.Array, blocks: jax.Array, offsets: jax.Array, new: jax.Array) -> jax.Array:
    """``scales [heads, num_blocks, block_size]`` with the tokens at ``(blocks, offsets)`` set to ``new [n, heads]``."""
    return scales.at[:, blocks, offsets].set(new.T)


@jax.jit
def _copy_scales(scales: jax.Array, source: jax.Array, destination: jax.Array) -> jax.Array:
    return scales.at[:, destination].set(scales[:, source])


@functools.partial(jax.jit, static_argnames=("io_dtype",))
def _decode(raw: jax.Array, scales: jax.Array, blocks: jax.Array, *, io_dtype: str) -> jax.Array:
    """Tokens ``raw [m * block_size, heads, dim]`` of ``blocks`` times their scales, in ``io_dtype``."""
    picked = jnp.take(scales, blocks, axis=1)  # [H, m, bs]
    per_token = picked.reshape(picked.shape[0], -1).T  # [m * bs, H]
    return (raw.astype(jnp.float32) * per_token[:, :, None]).astype(jnp.dtype(io_dtype))


class QuantizedJaxStorage(JaxStorage):
    """A quantized JAX pool on one device: raw int8 / float8 pools (moved by
    :class:`~kvcache_jax.JaxStorage`) and their scales. ``write`` takes and ``gather`` and
    attention return ``config.io_dtype``; host copies are core's packed ``uint8`` form.

    Raises:
        UnsupportedConfigError: a mesh (quantized pools are not sharded yet), a compute
            dtype JAX pools do not take, or what :class:`~kvcache_jax.JaxStorage` refuses.
    """

    POOL_DTYPES: ClassVar[tuple[str, ...]] = QUANTIZED_DTYPES

    def __init__(self, config: CacheConfig, *, mesh: object = None, axis: object = None) -> None:
        if mesh is not None:
            raise UnsupportedConfigError(f"a {config.dtype} pool of the jax backend lives on one device: pass no mesh")
        if config.io_dtype not in _COMPUTE_DTYPES:
            raise UnsupportedConfigError(
                f"compute_dtype {config.io_dtype!r} is not one of the jax backend's {', '.join(_COMPUTE_DTYPES)}"
            )
        super().__init__(config, mesh=None, axis=axis)
        shape = (config.num_heads, config.num_blocks, config.block_size)
        device = self.placement.replicated
        self._scales: list[list[jax.Array]] = [
            [jax.device_put(jnp.zeros(shape, jnp.float32), device) for _ in range(config.num_layers)] for _ in range(2)
        ]
        initial = np.asarray(config.kv_scales if config.kv_scales is not None else 0.0, dtype=np.float32)
        self._head_scales = jax.device_put(
            jnp.asarray(initial * np.ones((config.num_layers, 2, config.num_heads), np.float32)), device
        )
        self._track_scales = config.kv_scales is None
        self._attention_programs: dict[tuple[object, ...], Callable[..., jax.Array]] = {}

    def scales(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """The layer's key and value scales, ``[num_heads, num_blocks, block_size]`` float32 each."""
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
        head_scales = self._head_scales[layer]
        if config.dtype == "float8_e4m3fn" and self._track_scales:
            head_scales = jnp.stack([_grow(head_scales[0], keys), _grow(head_scales[1], values)])
        raw_keys, key_scales = _quantize(keys, head_scales[0], dtype=config.dtype)
        raw_values, value_scales = _quantize(values, head_scales[1], dtype=config.dtype)
        super().write(layer, slots, raw_keys, raw_values)
        self._head_scales = self._head_scales.at[layer].set(head_scales)
        blocks, offsets = np.divmod(np.asarray(slots, dtype=np.int64), config.block_size)
        block_index, offset_index = jnp.asarray(blocks, jnp.int32), jnp.asarray(offsets, jnp.int32)
        for kv, new in ((0, key_scales), (1, value_scales)):
            self._scales[kv][layer] = _set_scales(self._scales[kv][layer], block_index, offset_index, new)

    def gather(self, layer: int, blocks: IndexArray, num_tokens: int) -> tuple[jax.Array, jax.Array]:
        """Dequantized ``[num_tokens, heads, dim]`` copies of the first tokens of ``blocks``."""
        config = self.config
        if num_tokens == 0:
            empty = jnp.zeros((0, config.num_heads, config.head_dim), dtype=jnp.dtype(config.io_dtype))
            return empty, empty
        raw_keys, raw_values = super().gather(layer, blocks, len(blocks) * config.block_size)
        block_index = jnp.asarray(np.asarray(blocks, dtype=np.int64), jnp.int32)
        keys = _decode(raw_keys, self._scales[0][layer], block_index, io_dtype=config.io_dtype)
        values = _decode(raw_values, self._scales[1][layer], block_index, io_dtype=config.io_dtype)
        return keys[:num_tokens], values[:num_tokens]

    def copy_blocks(self, source: IndexArray, destination: IndexArray) -> None:
        """Copy every layer's raw K/V and scales of ``source[i]`` into ``destination[i]``."""
        super().copy_blocks(source, destination)
        if len(source) == 0:
            return
        source_in = jnp.asarray(np.asarray(source, dtype=np.int64), jnp.int32)
        destination_in = jnp.asarray(np.asarray(destination, dtype=np.int64), jnp.int32)
        for per_kv in self._scales:
            for layer, scales in enumerate(per_kv):
                per_kv[layer] = _copy_scales(scales, source_in, destination_in)

    def _host_scales(self, kv: int, blocks: IndexArray) -> npt.NDArray[np.float32]:
        """``[layers, n, block_size, heads]`` host copies of the scales of ``blocks``."""
        index = np.asarray(blocks, dtype=np.int64)
        stacked = np.stack([np.asarray(scales)[:, index] for scales in self._scales[kv]])  # [L, H, n, bs]
        host: npt.NDArray[np.float32] = stacked.transpose(0, 2, 3, 1).astype(np.float32)
        return host

    def blocks_to_host(self, blocks: IndexArray) -> tuple[HostArray, HostArray]:
        """Packed host copies ``uint8 [layers, n, block_size, heads, dim + 4]``: raw bytes and
        scale of each token head (:func:`kvcache_core.quantization.unpack_host`)."""
        raw_keys, raw_values = super().blocks_to_host(blocks)
        return (
            quantization.pack_host(raw_keys, self._host_scales(0, blocks)),
            quantization.pack_host(raw_values, self._host_scales(1, blocks)),
        )

    def blocks_from_host(self, blocks: IndexArray, keys: HostArray, values: HostArray) -> None:
        """Write packed host copies made by :meth:`blocks_to_host` into ``blocks``.

        Raises:
            DTypeMismatchError, ShapeMismatchError: not the packed form of ``len(blocks)``
                blocks of this pool. Nothing changes when it raises.
        """
        raw_keys, key_scales = quantization.unpack_host(self.config, keys, "keys")
        raw_values, value_scales = quantization.unpack_host(self.config, values, "values")
        super().blocks_from_host(blocks, raw_keys, raw_values)
        if len(blocks) == 0:
            return
        index = jnp.asarray(np.asarray(blocks, dtype=np.int64), jnp.int32)
        for kv, host in ((0, key_scales), (1, value_scales)):
            for layer in range(self.config.num_layers):
                per_layer = jnp.asarray(np.ascontiguousarray(host[layer].transpose(2, 0, 1)))  # [H, n, bs]
                self._scales[kv][layer] = self._scales[kv][layer].at[:, index].set(per_layer)

    def paged_attention(
        self,
        layer: int,
        query: jax.Array,
        page_table: PageTable,
        qo_indptr: npt.NDArray[np.int32],
        scale: float,
        causal: bool,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: jax.Array | None = None,
        chunk: int | None = None,
    ) -> jax.Array:
        """Jitted paged attention that decodes each loop step's blocks with their scales,
        with the attention features of :mod:`kvcache_core.attention_features`."""
        batch, (block_tables, seq_lens, indptr) = self._batch(page_table, qo_indptr)
        program = self._quantized_program(
            batch.max_query_len,
            causal,
            float(scale),
            combined_window(window, page_table.sliding_window),
            softcap,
            chunk,
            sinks is not None,
        )
        query_in = self._tokens(query, batch.query_rows)
        extra = () if sinks is None else (sinks,)
        output = program(
            query_in,
            self.key_cache(layer),
            self.value_cache(layer),
            self._scales[0][layer],
            self._scales[1][layer],
            block_tables,
            seq_lens,
            indptr,
            *extra,
        )
        return output if batch.query_rows == batch.total_queries else output[: batch.total_queries]

    def _quantized_program(
        self,
        max_query_len: int,
        causal: bool,
        scale: float,
        window: int | None,
        softcap: float | None,
        chunk: int | None,
        with_sinks: bool,
    ) -> Callable[..., jax.Array]:
        key = (max_query_len, causal, scale, window, softcap, chunk, with_sinks)
        program = self._attention_programs.get(key)
        if program is None:
            layout = self.config.layout

            def attend(
                query: jax.Array,
                k: jax.Array,
                v: jax.Array,
                key_scales: jax.Array,
                value_scales: jax.Array,
                block_tables: jax.Array,
                seq_lens: jax.Array,
                qo_indptr: jax.Array,
                sinks: jax.Array | None = None,
            ) -> jax.Array:
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
                    sliding_window=window,
                    softcap=softcap,
                    sinks=sinks,
                    chunk=chunk,
                    key_scales=key_scales,
                    value_scales=value_scales,
                )

            program = jax.jit(attend)
            self._attention_programs[key] = program
        return program
