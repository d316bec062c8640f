"""The NumPy backend: the reference storage, built into kvcache-core.

Registered like any third-party backend, through the ``kvcache_core.backends`` entry
point named ``numpy`` that points at this module.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.attention.features import combined_window
from kvcache_core.attention.gather_kernel import SlotRuns, gather_runs_together
from kvcache_core.attention.reference import paged_attention
from kvcache_core.backends.dispatch import kernel_or_reference
from kvcache_core.backends.numpy.states import NumpyStateStorage
from kvcache_core.contract import quantization
from kvcache_core.contract.config import KV_LAYOUTS, CacheConfig
from kvcache_core.contract.groups import ViewPlace
from kvcache_core.contract.hookspecs import (
    ATTENTION_CAPABILITIES,
    LAYER_GEOMETRY,
    POLICY_CAPABILITIES,
    VALUE_HEAD_DIM,
    BackendSpec,
    hookimpl,
)
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.regions import MEMORY_REGIONS, MemoryRegion, pool_regions
from kvcache_core.contract.states import STATE_LAYERS, StateArray
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    UnsupportedConfigError,
)
from kvcache_core.offload import host_form

__all__ = [
    "ATTENTION_CAPABILITIES",
    "POLICY_CAPABILITIES",
    "PREFERRED_LAYOUT",
    "NumpyArray",
    "NumpyStorage",
    "kvcache_register_backends",
]

# The layout ``CacheConfig(kv_layout=None)`` resolves to: each head's keys are one strided
# run per block, which the compiled kernel reads fastest (16 requests x 1024 tokens, 8 KV
# heads of 128: NHD 1.7x, HND 1.3x its time on this 2-core CPU).
PREFERRED_LAYOUT = "heads_first"

NumpyArray = npt.NDArray[Any]
IntArray = npt.NDArray[np.int64]

# dtype -> its name, filled on first use.
_DTYPE_NAMES: dict[np.dtype[Any], str] = {}

#: The dtypes NumPy holds natively (no bfloat16), and the quantized ones: int8, and float8
#: (e4m3) where ``ml_dtypes`` is installed (``pip install ml_dtypes``; JAX depends on it).
NUMPY_DTYPES = ("float16", "float32", "float64", "int8") + (
    ("float8_e4m3fn",) if importlib.util.find_spec("ml_dtypes") is not None else ()
)

#: The compute dtypes of a quantized NumPy pool (what ``write`` takes, attention returns).
NUMPY_COMPUTE_DTYPES = ("float32", "float16")


class NumpyStorage:
    """A pool of ``num_layers x (K, V)`` NumPy arrays in one allocation.

    ``key_cache(layer)`` and ``value_cache(layer)`` are views of that allocation, so a
    later :meth:`write` shows through a reference taken before it. A pool whose values
    differ in width from its keys (``CacheConfig.value_head_dim``) holds, per layer, its
    keys then its values in one flat run (:meth:`pool_shape`); each is a C-contiguous view.

    A quantized pool (``int8``, ``float8_e4m3fn``: :mod:`kvcache_core.contract.quantization`) holds the
    raw bytes in that allocation and its scales in a second one, :attr:`scales`
    ``[num_layers, 2, num_heads, num_blocks, block_size]`` float32, moved with their blocks.

    Attributes:
        attention_features: the attention capabilities :meth:`paged_attention` serves
            (all of :data:`~kvcache_core.contract.hookspecs.ATTENTION_CAPABILITIES`).
    """

    attention_features: frozenset[str] = ATTENTION_CAPABILITIES

    def __init__(
        self, config: CacheConfig, *, pool: NumpyArray | None = None, scales: NumpyArray | None = None
    ) -> None:
        """Build the pool for ``config``.

        Args:
            config: the pool's configuration.
            pool: memory to use instead of a new zeroed allocation (a memory-mapped file,
                shared memory, ...): shape :meth:`pool_shape` of ``config``, dtype
                :meth:`element_dtype`, writeable. Its contents are kept.
            scales: for a quantized pool, memory to hold its scales instead of a new zeroed
                allocation: shape :meth:`scales_shape`, float32, writeable. Its contents
                are kept (a float8 pool tracking its scales resumes its running maximum
                from them).

        Raises:
            ArrayTypeError: ``pool`` or ``scales`` is not a NumPy array.
            ShapeMismatchError, DTypeMismatchError: ``pool`` or ``scales`` has the wrong
                shape or dtype.
            InvalidArgumentError: ``pool`` or ``scales`` is read-only, not C-contiguous, or
                has a zero or negative stride; ``scales`` for an unquantized pool.
            UnsupportedConfigError: a quantized pool whose compute dtype NumPy does not hold.
        """
        config = config.with_layout(PREFERRED_LAYOUT)
        self._config = config
        self._path = kernel_or_reference(config)
        scales_shape = self.scales_shape(config)
        self._scales: npt.NDArray[np.float32] | None = None
        if scales_shape is None:
            if scales is not None:
                raise InvalidArgumentError(f"scales are for a quantized pool; a {config.dtype} pool has none")
        else:
            if config.io_dtype not in NUMPY_COMPUTE_DTYPES:
                raise UnsupportedConfigError(
                    f"a quantized NumPy pool computes in {', '.join(NUMPY_COMPUTE_DTYPES)}; got compute_dtype "
                    f"{config.io_dtype!r} (NumPy has no bfloat16)"
                )
            if scales is None:
                scales = np.zeros(scales_shape, dtype=np.float32)
            else:
                _check_memory("scales", scales, scales_shape, np.dtype(np.float32))
            self._scales = scales
            # float8: the per-(layer, K/V, head) scale, calibrated or grown by the running maximum
            # (from the largest scale a token holds: 0 for a new pool).
            calibrated = config.kv_scales is not None
            self._head_scales = (
                np.asarray(config.kv_scales, dtype=np.float32) * np.ones(scales_shape[:3], dtype=np.float32)
                if calibrated
                else scales.max(axis=(3, 4), initial=np.float32(0)).astype(np.float32)
            )
            self._track_scales = not calibrated
        if pool is None:
            # [layer, K/V, *layout]: one block copy moves every layer at once.
            pool = np.zeros(self.pool_shape(config), dtype=self.element_dtype(config))
        else:
            _check_memory("pool", pool, self.pool_shape(config), self.element_dtype(config))
        self._pool = pool
        self._block_axis = 3 if config.kv_layout == "heads_first" else 2
        self._slot_runs: dict[int, tuple[IntArray, SlotRuns]] = {}  # the latest padded gathers' (by id, kept alive)
        self._split = config.value_head_dim is not None
        if self._split:  # [layer, keys then values]: one C-contiguous view of each per layer
            key_elements = int(np.prod(config.block_shape()))
            self._parts = (
                pool[:, :key_elements].reshape(config.num_layers, *config.block_shape()),
                pool[:, key_elements:].reshape(config.num_layers, *config.value_block_shape()),
            )
        else:
            self._parts = (pool[:, 0], pool[:, 1])

    @staticmethod
    def element_dtype(config: CacheConfig) -> np.dtype[Any]:
        """The NumPy dtype of the pool's elements: ``config.dtype``, or a quantized pool's
        raw dtype (:func:`kvcache_core.contract.quantization.raw_numpy_dtype`)."""
        if config.quantized:
            return quantization.raw_numpy_dtype(config.dtype)
        return np.dtype(config.dtype)

    @staticmethod
    def scales_shape(config: CacheConfig) -> tuple[int, int, int, int, int] | None:
        """Shape of a quantized pool's float32 scales, ``[num_layers, 2, num_heads,
        num_blocks, block_size]``; ``None`` for an unquantized pool."""
        if not config.quantized:
            return None
        return (config.num_layers, 2, config.num_heads, config.num_blocks, config.block_size)

    @staticmethod
    def pool_shape(config: CacheConfig) -> tuple[int, ...]:
        """Shape of the one array holding every layer: ``[num_layers, 2, *block_shape]``
        (``kv_layout=None`` resolved to :data:`PREFERRED_LAYOUT`); with a ``value_head_dim``
        ``[num_layers, keys + values]``, each layer's keys (``block_shape``) then its values
        (``value_block_shape``) flat."""
        resolved = config.with_layout(PREFERRED_LAYOUT)
        if resolved.value_head_dim is None:
            return (config.num_layers, 2, *resolved.block_shape())
        elements = int(np.prod(resolved.block_shape())) + int(np.prod(resolved.value_block_shape()))
        return (config.num_layers, elements)

    @property
    def pool(self) -> NumpyArray:
        """The array holding every layer's keys and values."""
        return self._pool

    @property
    def config(self) -> CacheConfig:
        """The pool's configuration."""
        return self._config

    @property
    def scales(self) -> npt.NDArray[np.float32] | None:
        """A quantized pool's scales ``[num_layers, 2, num_heads, num_blocks, block_size]``
        (``raw * scale`` is the value), ``None`` for an unquantized pool."""
        return self._scales

    def head_scales(self, layer: int) -> npt.NDArray[np.float32]:
        """A float8 pool's current per-head scales of ``layer``: ``[2, num_heads]`` (K, V)."""
        current: npt.NDArray[np.float32] = self._head_scales[layer].copy()
        return current

    def memory_regions(self) -> tuple[MemoryRegion, ...]:
        """The pool's memory per layer and part (:mod:`kvcache_core.contract.regions`):
        host memory, stable for the storage's life (a memmap pool's mapping)."""
        scales = None if self._scales is None else int(self._scales.ctypes.data)
        return pool_regions(self._config, int(self._pool.ctypes.data), self._pool.dtype.itemsize, scales)

    def key_cache(self, layer: int) -> NumpyArray:
        """View of the layer's key pool."""
        view: NumpyArray = self._parts[0][layer]
        return view

    def value_cache(self, layer: int) -> NumpyArray:
        """View of the layer's value pool (its last axis ``value_width``)."""
        view: NumpyArray = self._parts[1][layer]
        return view

    def write(self, layer: int, slots: IntArray, keys: NumpyArray, values: NumpyArray) -> None:
        """Scatter ``[n, heads, dim]`` keys and ``[n, heads, value_width]`` values into
        ``slots`` (quantized pools: encoded in one pass, NaN and infinities refused with
        InvalidArgumentError first)."""
        if self._scales is not None:
            keys, values = self._quantize(layer, slots, keys, values)
        for kv, data in ((0, keys), (1, values)):
            cache = self._parts[kv][layer]
            if self._config.kv_layout == "NHD":
                cache.reshape(-1, self._config.num_heads, data.shape[2])[slots] = data
            else:
                blocks, offsets = np.divmod(slots, self._config.block_size)
                if self._config.kv_layout == "HND":
                    cache[blocks, :, offsets, :] = data
                else:  # heads_first: the indexed axes stay in place -> [heads, n, dim]
                    cache[:, blocks, offsets, :] = data.transpose(1, 0, 2)

    def write_view(self, layer: int, slots: IntArray, keys: NumpyArray, values: NumpyArray, place: ViewPlace) -> None:
        """Scatter ``[n, h, d]`` keys and ``[n, h, dv]`` values into the part of each slot's row
        from ``place`` (an unquantized pool; :mod:`kvcache_core.contract.views`), the rest kept."""
        for kv, data, first in ((0, keys, place.key), (1, values, place.value)):
            cache = self._parts[kv][layer]
            heads, features = slice(place.head, place.head + data.shape[1]), slice(first, first + data.shape[2])
            if self._config.kv_layout == "NHD":
                cache.reshape(-1, *cache.shape[2:])[slots, heads, features] = data
            else:
                blocks, offsets = np.divmod(slots, self._config.block_size)
                if self._config.kv_layout == "HND":
                    cache[blocks, heads, offsets, features] = data  # the indexed axes first -> [n, h, d]
                else:  # heads_first: the indexed axes stay in place -> [h, n, d]
                    cache[heads, blocks, offsets, features] = data.transpose(1, 0, 2)

    def _quantize(
        self, layer: int, slots: IntArray, keys: NumpyArray, values: NumpyArray
    ) -> tuple[NumpyArray, NumpyArray]:
        """Raw K/V for ``slots``; their scales written (after every check passed)."""
        assert self._scales is not None
        quantization.check_finite("keys", keys)
        quantization.check_finite("values", values)
        dtype = self._config.dtype
        head_scales = self._head_scales[layer]
        if dtype == "float8_e4m3fn" and self._track_scales:
            head_scales = np.stack(
                [quantization.grow_running_scales(head_scales[kv], data) for kv, data in ((0, keys), (1, values))]
            )
        raw_keys, key_scales = quantization.quantize(dtype, keys, head_scales[0])
        raw_values, value_scales = quantization.quantize(dtype, values, head_scales[1])
        self._head_scales[layer] = head_scales
        blocks, offsets = np.divmod(slots, self._config.block_size)
        self._scales[layer, 0][:, blocks, offsets] = key_scales.T
        self._scales[layer, 1][:, blocks, offsets] = value_scales.T
        return raw_keys, raw_values

    def gather(self, layer: int, blocks: IntArray, num_tokens: int) -> tuple[NumpyArray, NumpyArray]:
        """Contiguous ``[num_tokens, heads, dim]`` copies of the tokens in ``blocks`` (values
        ``value_width`` wide; dequantized to the compute dtype for a quantized pool)."""
        if self._scales is not None:
            decoded: list[NumpyArray] = []
            for kv in (0, 1):
                raw = self._tokens(self._parts[kv][layer], blocks, num_tokens)
                scales = self._scales[layer, kv][:, blocks].transpose(1, 2, 0).reshape(-1, self._config.num_heads)
                decoded.append(quantization.dequantize(raw, scales[:num_tokens]).astype(self._config.io_dtype))
            return decoded[0], decoded[1]
        return self._tokens(self._parts[0][layer], blocks, num_tokens), self._tokens(
            self._parts[1][layer], blocks, num_tokens
        )

    def gather_padded(self, layer: int, slots: IntArray, layout: str) -> tuple[NumpyArray, NumpyArray] | None:
        """A step's padded batch heads second (``"HND"``) from a heads-first pool, run by run
        in compiled code (:mod:`kvcache_core.attention.gather_kernel`); ``None`` otherwise
        (another layout, a quantized pool, numba missing: core gathers request by request)."""
        if self._scales is not None or layout != "HND" or self._config.kv_layout != "heads_first":
            return None
        known = self._slot_runs.get(id(slots))
        if known is None or known[0] is not slots:  # the same array for a step's layers (one per group)
            if len(self._slot_runs) >= 8:  # earlier steps'
                self._slot_runs.clear()
            known = self._slot_runs[id(slots)] = (slots, SlotRuns(slots))
        pairs: list[tuple[NumpyArray, NumpyArray]] = []
        for part in self._parts:
            cache = part[layer]  # [heads, blocks, block_size, dim]: a C-contiguous layer
            rows = cache.reshape(cache.shape[0], -1, cache.shape[3])
            pairs.append(
                (rows, np.empty((known[1].batch, rows.shape[0], known[1].positions, rows.shape[2]), rows.dtype))
            )
        if not gather_runs_together(pairs, known[1]):  # keys and values in one call
            return None
        return pairs[0][1], pairs[1][1]

    def _tokens(self, cache: NumpyArray, blocks: IntArray, num_tokens: int) -> NumpyArray:
        heads, dim = self._config.num_heads, cache.shape[3]
        if self._config.kv_layout == "NHD":
            picked = cache[blocks]
        elif self._config.kv_layout == "HND":
            picked = cache[blocks].transpose(0, 2, 1, 3)
        else:
            picked = cache[:, blocks].transpose(1, 2, 0, 3)
        return np.ascontiguousarray(picked.reshape(-1, heads, dim)[:num_tokens])

    def copy_blocks(self, source: IntArray, destination: IntArray) -> None:
        """Copy every layer's K and V of ``source[i]`` into ``destination[i]``."""
        # One copy moves every layer's K and V at once; a pool of two widths copies each part.
        parts = self._parts if self._split else (self._pool,)
        for part in parts:
            axis = self._block_axis - (1 if self._split else 0)
            index: list[Any] = [slice(None)] * part.ndim
            src, dst = list(index), list(index)
            src[axis], dst[axis] = source, destination
            part[tuple(dst)] = part[tuple(src)]
        if self._scales is not None:  # [L, 2, H, blocks, bs]
            self._scales[:, :, :, destination] = self._scales[:, :, :, source]

    def blocks_to_host(self, blocks: IntArray) -> tuple[NumpyArray, NumpyArray]:
        """Copies ``[layers, n, block_size, heads, dim]`` of keys and values (values
        ``value_width`` wide); for a quantized pool their raw bytes and scales, ``uint8
        [layers, n, block_size, heads, dim + 4]`` (:func:`kvcache_core.contract.quantization.unpack_host`)."""
        if self._split:
            canonical = [self._part_to_nhd(np.take(part, blocks, axis=self._block_axis - 1)) for part in self._parts]
        else:
            both = self._to_nhd(np.take(self._pool, blocks, axis=self._block_axis))
            canonical = [both[:, 0], both[:, 1]]
        if self._scales is not None:
            scales = self._scales[:, :, :, blocks].transpose(0, 1, 3, 4, 2)  # [L, 2, n, bs, H]
            canonical = [quantization.pack_host(canonical[kv], scales[:, kv]) for kv in (0, 1)]
        return np.ascontiguousarray(canonical[0]), np.ascontiguousarray(canonical[1])

    def blocks_from_host(self, blocks: IntArray, keys: NumpyArray, values: NumpyArray) -> None:
        """Write host-form copies (:mod:`kvcache_core.offload.host_form`) into ``blocks``.

        Raises:
            ArrayTypeError, DTypeMismatchError, ShapeMismatchError: not the host form of
                ``len(blocks)`` blocks (nothing is cast or written).
        """
        host_form.check_host_array(self._config, "keys", keys, host_form.host_shape(self._config, len(blocks)))
        host_form.check_host_array(
            self._config, "values", values, host_form.host_shape(self._config, len(blocks), "values")
        )
        if self._scales is not None:
            raw_keys, key_scales = quantization.unpack_host(self._config, keys, "keys")
            raw_values, value_scales = quantization.unpack_host(self._config, values, "values")
            keys, values = raw_keys, raw_values
            self._scales[:, :, :, blocks] = np.stack([key_scales, value_scales], axis=1).transpose(0, 1, 4, 2, 3)
        if self._split:
            for part, data in zip(self._parts, (keys, values), strict=True):
                index: list[Any] = [slice(None)] * part.ndim
                index[self._block_axis - 1] = blocks
                part[tuple(index)] = self._part_from_nhd(data)
            return
        stacked = np.stack([keys, values], axis=1)  # [layers, 2, n, bs, heads, dim]
        if self._config.kv_layout == "HND":
            stacked = stacked.transpose(0, 1, 2, 4, 3, 5)
        elif self._config.kv_layout == "heads_first":
            stacked = stacked.transpose(0, 1, 4, 2, 3, 5)
        index = [slice(None)] * self._pool.ndim
        index[self._block_axis] = blocks
        self._pool[tuple(index)] = stacked

    def _to_nhd(self, pool_part: NumpyArray) -> NumpyArray:
        canonical: NumpyArray = pool_part
        if self._config.kv_layout == "HND":  # [L, 2, n, H, bs, D]
            canonical = pool_part.transpose(0, 1, 2, 4, 3, 5)
        elif self._config.kv_layout == "heads_first":  # [L, 2, H, n, bs, D]
            canonical = pool_part.transpose(0, 1, 3, 4, 2, 5)
        return canonical

    def _part_to_nhd(self, picked: NumpyArray) -> NumpyArray:
        """One part's blocks ``[L, *layout]`` as ``[L, n, block_size, heads, dim]``."""
        canonical: NumpyArray = picked
        if self._config.kv_layout == "HND":  # [L, n, H, bs, D]
            canonical = picked.transpose(0, 1, 3, 2, 4)
        elif self._config.kv_layout == "heads_first":  # [L, H, n, bs, D]
            canonical = picked.transpose(0, 2, 3, 1, 4)
        return canonical

    def _part_from_nhd(self, canonical: NumpyArray) -> NumpyArray:
        """``[L, n, block_size, heads, dim]`` in the pool's layout (the inverse of :meth:`_part_to_nhd`)."""
        laid: NumpyArray = canonical
        if self._config.kv_layout == "HND":
            laid = canonical.transpose(0, 1, 3, 2, 4)
        elif self._config.kv_layout == "heads_first":
            laid = canonical.transpose(0, 3, 1, 2, 4)
        return laid

    def paged_attention(
        self,
        layer: int,
        query: NumpyArray,
        page_table: PageTable,
        qo_indptr: npt.NDArray[np.int32],
        scale: float,
        causal: bool,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: NumpyArray | None = None,
        chunk: int | None = None,
    ) -> NumpyArray:
        """Attention over this layer's pool, read in place: the compiled kernel
        (:mod:`kvcache_core.attention.kernel`) for float32 and float16 pools when numba is
        installed, else (or with ``attention_path="native"``) the NumPy reference. ``window``, ``softcap``, ``sinks`` and
        ``chunk``: the attention features (:mod:`kvcache_core.attention.features`),
        checked by the manager. A quantized pool is dequantized while it is read: the
        kernel decodes each tile of keys with their scales, the reference folds the scales
        into each run's scores and weights."""
        dtype = self._config.dtype
        keys, values = self._parts[0][layer], self._parts[1][layer]
        key_scales = value_scales = None
        if self._scales is not None:
            key_scales, value_scales = self._scales[layer, 0], self._scales[layer, 1]
        # The kernel reads raw bytes: half floats and quantized values from their bits.
        raw_keys, raw_values = keys, values
        if self._scales is not None:
            raw_keys, raw_values = keys.view(np.uint8), values.view(np.uint8)
        elif dtype == "float16":
            raw_keys, raw_values = keys.view(np.uint16), values.view(np.uint16)
        if (
            self._path != "native"
            and paged_kernel.kernel_available()
            and paged_kernel.kernel_reads(dtype, raw_keys, raw_values)
        ):
            output = paged_kernel.attend_with_kernel(
                query,
                raw_keys,
                raw_values,
                page_table,
                qo_indptr,
                dtype=dtype,
                scale=scale,
                causal=causal,
                kv_layout=self._config.layout,
                sliding_window=combined_window(window, page_table.sliding_window),
                softcap=softcap,
                sinks=sinks,
                chunk=chunk,
                key_scales=key_scales,
                value_scales=value_scales,
            )
            return output.astype(query.dtype, copy=False)
        return paged_attention(
            query,
            keys,
            values,
            page_table,
            qo_indptr=qo_indptr,
            scale=scale,
            causal=causal,
            kv_layout=self._config.layout,
            window=window,
            softcap=softcap,
            sinks=sinks,
            chunk=chunk,
            key_scales=key_scales,
            value_scales=value_scales,
        )

    def array_info(self, array: object) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype name)`` of a NumPy array; ``TypeError`` for anything else."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"expected a numpy.ndarray, got {type(array).__name__}")
        checked = cast("NumpyArray", array)
        dtype = checked.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:  # dtype.name builds a new string each time (microseconds per layer call)
            name = _DTYPE_NAMES.setdefault(dtype, dtype.name)
        return tuple(checked.shape), name

    def from_numpy(self, array: NumpyArray) -> NumpyArray:
        """The array itself (NumPy is the host format)."""
        return np.asarray(array)

    def to_numpy(self, array: NumpyArray) -> NumpyArray:
        """The array itself."""
        return np.asarray(array)

    def array_namespace(self) -> Any:
        """``numpy``, which implements the Array API standard since 2.0."""
        return np

    def state_storage(self, arrays: tuple[StateArray, ...], num_slots: int) -> NumpyStateStorage:
        """The state pool of a config with recurrent-state layers (capability ``"state_layers"``).

        Raises:
            UnsupportedConfigError: a bfloat16 state array (NumPy has no bfloat16).
        """
        return NumpyStateStorage(arrays, num_slots)


def _check_memory(name: str, array: object, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """Refuse memory handed to :class:`NumpyStorage` that writes could not go through."""
    if not isinstance(array, np.ndarray):
        raise ArrayTypeError(f"{name} must be a numpy.ndarray, got {type(array).__name__}")
    checked = cast("NumpyArray", array)
    if tuple(checked.shape) != shape:
        raise ShapeMismatchError(f"{name} has shape {tuple(checked.shape)}, expected {shape}")
    if checked.dtype != dtype:
        raise DTypeMismatchError(f"{name} has dtype {checked.dtype.name}, expected {dtype.name}")
    if not checked.flags.writeable:
        raise InvalidArgumentError(f"{name} must be writeable, got a read-only array")
    if not checked.flags.c_contiguous or any(
        stride <= 0 for stride, extent in zip(checked.strides, checked.shape, strict=True) if extent > 1
    ):
        # Writes go through reshaped views: on any other memory order they would land
        # in a temporary copy and vanish; a zero stride aliases many elements in one.
        raise InvalidArgumentError(
            f"{name} must be C-contiguous with positive strides, got strides {checked.strides} "
            f"(C-contiguous: {checked.flags.c_contiguous}); pass numpy.ascontiguousarray({name}) "
            "or allocate it in C order"
        )


@hookimpl
def kvcache_register_backends() -> Iterator[BackendSpec[NumpyArray]]:
    """Register the NumPy backend."""
    yield BackendSpec(
        name="numpy",
        storage_factory=NumpyStorage,
        devices=("cpu",),
        dtypes=NUMPY_DTYPES,
        kv_layouts=KV_LAYOUTS,
        preferred_layout=PREFERRED_LAYOUT,
        description="NumPy reference backend (host memory), built into kvcache-core",
        capabilities=POLICY_CAPABILITIES
        | ATTENTION_CAPABILITIES
        | {
            LAYER_GEOMETRY,
            MEMORY_REGIONS,
            STATE_LAYERS,
            VALUE_HEAD_DIM,
        },
    )
