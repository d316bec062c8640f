"""The NumPy backend: the reference storage, built into kvcache-core.

Registered like any third-party backend, through the ``kvcache_core.backends`` entry
point named ``numpy`` that points at this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvcache_core import paged_kernel
from kvcache_core.attention import paged_attention
from kvcache_core.attention_features import ATTENTION_CAPABILITIES, combined_window
from kvcache_core.config import KV_LAYOUTS, CacheConfig
from kvcache_core.errors import ArrayTypeError, DTypeMismatchError, InvalidArgumentError, ShapeMismatchError
from kvcache_core.hookspecs import BackendSpec, hookimpl
from kvcache_core.page_table import PageTable

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

#: The cache policies of core (fork, prefix caching, ...) this storage supports: all of them,
#: through ``copy_blocks``, ``blocks_to_host`` / ``blocks_from_host`` and windowed attention.
POLICY_CAPABILITIES = frozenset({"fork", "prefix_caching", "swap", "eviction", "sliding_window"})

# dtype -> its name, filled on first use.
_DTYPE_NAMES: dict[np.dtype[Any], str] = {}

#: The dtypes NumPy holds natively (no bfloat16).
NUMPY_DTYPES = ("float16", "float32", "float64")


class NumpyStorage:
    """A pool of ``num_layers x (K, V)`` NumPy arrays in one allocation.

    ``key_cache(layer)`` and ``value_cache(layer)`` are views of that allocation, so a
    later :meth:`write` shows through a reference taken before it.

    Attributes:
        attention_features: the attention capabilities :meth:`paged_attention` serves
            (all of :data:`~kvcache_core.attention_features.ATTENTION_CAPABILITIES`).
    """

    attention_features: frozenset[str] = ATTENTION_CAPABILITIES

    def __init__(self, config: CacheConfig, *, pool: NumpyArray | None = None) -> None:
        """Build the pool for ``config``.

        Args:
            config: the pool's configuration.
            pool: memory to use instead of a new zeroed allocation (a memory-mapped file,
                shared memory, ...): shape :meth:`pool_shape` of ``config``, its dtype,
                writeable. Its contents are kept.

        Raises:
            ArrayTypeError: ``pool`` is not a NumPy array.
            ShapeMismatchError, DTypeMismatchError: ``pool`` has the wrong shape or dtype.
            InvalidArgumentError: ``pool`` is read-only, not C-contiguous, or has a zero
                or negative stride.
        """
        config = config.with_layout(PREFERRED_LAYOUT)
        self._config = config
        shape = self.pool_shape(config)
        if pool is None:
            # [layer, K/V, *layout]: one block copy moves every layer at once.
            pool = np.zeros(shape, dtype=np.dtype(config.dtype))
        elif not isinstance(pool, np.ndarray):
            raise ArrayTypeError(f"pool must be a numpy.ndarray, got {type(pool).__name__}")
        elif tuple(pool.shape) != shape:
            raise ShapeMismatchError(f"pool has shape {tuple(pool.shape)}, expected {shape}")
        elif pool.dtype != np.dtype(config.dtype):
            raise DTypeMismatchError(f"pool has dtype {pool.dtype.name}, expected {config.dtype}")
        elif not pool.flags.writeable:
            raise InvalidArgumentError("pool must be writeable, got a read-only array")
        elif not pool.flags.c_contiguous or any(
            stride <= 0 for stride, extent in zip(pool.strides, pool.shape, strict=True) if extent > 1
        ):
            # Writes go through reshaped views: on any other memory order they would land
            # in a temporary copy and vanish; a zero stride aliases many elements in one.
            raise InvalidArgumentError(
                f"pool must be C-contiguous with positive strides, got strides {pool.strides} "
                f"(C-contiguous: {pool.flags.c_contiguous}); pass numpy.ascontiguousarray(pool) "
                "or allocate it in C order"
            )
        self._pool = pool
        self._block_axis = 3 if config.kv_layout == "heads_first" else 2

    @staticmethod
    def pool_shape(config: CacheConfig) -> tuple[int, ...]:
        """Shape of the one array holding every layer: ``[num_layers, 2, *block_shape]``
        (``kv_layout=None`` resolved to :data:`PREFERRED_LAYOUT`)."""
        return (config.num_layers, 2, *config.with_layout(PREFERRED_LAYOUT).block_shape())

    @property
    def pool(self) -> NumpyArray:
        """The array holding every layer's keys and values."""
        return self._pool

    @property
    def config(self) -> CacheConfig:
        """The pool's configuration."""
        return self._config

    def key_cache(self, layer: int) -> NumpyArray:
        """View of the layer's key pool."""
        view: NumpyArray = self._pool[layer, 0]
        return view

    def value_cache(self, layer: int) -> NumpyArray:
        """View of the layer's value pool."""
        view: NumpyArray = self._pool[layer, 1]
        return view

    def write(self, layer: int, slots: IntArray, keys: NumpyArray, values: NumpyArray) -> None:
        """Scatter ``[n, heads, dim]`` keys and values into ``slots``."""
        for kv, data in ((0, keys), (1, values)):
            cache = self._pool[layer, kv]
            if self._config.kv_layout == "NHD":
                cache.reshape(-1, self._config.num_heads, self._config.head_dim)[slots] = data
            else:
                blocks, offsets = np.divmod(slots, self._config.block_size)
                if self._config.kv_layout == "HND":
                    cache[blocks, :, offsets, :] = data
                else:  # heads_first: the indexed axes stay in place -> [heads, n, dim]
                    cache[:, blocks, offsets, :] = data.transpose(1, 0, 2)

    def gather(self, layer: int, blocks: IntArray, num_tokens: int) -> tuple[NumpyArray, NumpyArray]:
        """Contiguous ``[num_tokens, heads, dim]`` copies of the tokens in ``blocks``."""
        return self._tokens(self._pool[layer, 0], blocks, num_tokens), self._tokens(
            self._pool[layer, 1], blocks, num_tokens
        )

    def _tokens(self, cache: NumpyArray, blocks: IntArray, num_tokens: int) -> NumpyArray:
        heads, dim = self._config.num_heads, self._config.head_dim
        if self._config.kv_layout == "NHD":
            picked = cache[blocks]
        elif self._config.kv_layout == "HND":
            picked = cache[blocks].transpose(0, 2, 1, 3)
        else:
            picked = cache[:, blocks].transpose(1, 2, 0, 3)
        return np.ascontiguousarray(picked.reshape(-1, heads, dim)[:num_tokens])

    def copy_blocks(self, source: IntArray, destination: IntArray) -> None:
        """Copy every layer's K and V of ``source[i]`` into ``destination[i]``."""
        index: list[Any] = [slice(None)] * self._pool.ndim
        src, dst = list(index), list(index)
        src[self._block_axis], dst[self._block_axis] = source, destination
        self._pool[tuple(dst)] = self._pool[tuple(src)]

    def blocks_to_host(self, blocks: IntArray) -> tuple[NumpyArray, NumpyArray]:
        """Copies ``[layers, n, block_size, heads, dim]`` of keys and values."""
        picked = np.take(self._pool, blocks, axis=self._block_axis)
        canonical = self._to_nhd(picked)
        return np.ascontiguousarray(canonical[:, 0]), np.ascontiguousarray(canonical[:, 1])

    def blocks_from_host(self, blocks: IntArray, keys: NumpyArray, values: NumpyArray) -> None:
        """Write copies made by :meth:`blocks_to_host` back into ``blocks``."""
        stacked = np.stack([keys, values], axis=1)  # [layers, 2, n, bs, heads, dim]
        if self._config.kv_layout == "HND":
            stacked = stacked.transpose(0, 1, 2, 4, 3, 5)
        elif self._config.kv_layout == "heads_first":
            stacked = stacked.transpose(0, 1, 4, 2, 3, 5)
        index: list[Any] = [slice(None)] * self._pool.ndim
        index[self._block_axis] = blocks
        self._pool[tuple(index)] = stacked

    def _to_nhd(self, pool_part: NumpyArray) -> NumpyArray:
        canonical: NumpyArray = pool_part
        if self._config.kv_layout == "HND":  # [L, 2, n, H, bs, D]
            canonical = pool_part.transpose(0, 1, 2, 4, 3, 5)
        elif self._config.kv_layout == "heads_first":  # [L, 2, H, n, bs, D]
            canonical = pool_part.transpose(0, 1, 3, 4, 2, 5)
        return canonical

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
        (:mod:`kvcache_core.paged_kernel`) for float32 and float16 pools when numba is
        installed, else the NumPy reference. ``window``, ``softcap``, ``sinks`` and
        ``chunk``: the attention features (:mod:`kvcache_core.attention_features`),
        checked by the manager."""
        keys, values = self._pool[layer, 0], self._pool[layer, 1]
        dtype = self._config.dtype
        if dtype == "float16":  # the kernel decodes half floats from their bits
            keys, values = keys.view(np.uint16), values.view(np.uint16)
        if paged_kernel.kernel_available() and paged_kernel.kernel_reads(dtype, keys, values):
            output = paged_kernel.attend_with_kernel(
                query,
                keys,
                values,
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
            )
            return output.astype(query.dtype, copy=False)
        return paged_attention(
            query,
            self._pool[layer, 0],
            self._pool[layer, 1],
            page_table,
            qo_indptr=qo_indptr,
            scale=scale,
            causal=causal,
            kv_layout=self._config.layout,
            window=window,
            softcap=softcap,
            sinks=sinks,
            chunk=chunk,
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
        capabilities=POLICY_CAPABILITIES | ATTENTION_CAPABILITIES,
    )
