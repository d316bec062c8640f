"""The JAX pool: :class:`JaxStorage`, a ``kvcache_core.KvStorage[jax.Array]``.

Each layer's keys and values are one ``jax.Array`` each. JAX arrays are immutable, so a
write makes a new pool array; the jitted programs here *donate* the old one, and XLA
writes into its buffer in place: a write costs what its tokens cost, whatever the pool's
size. ``key_cache(layer)`` hands out the current pool array itself. Donation deletes the
donated array, so before each donating call the storage checks whether anyone else still
holds that array (its Python reference count, calibrated at import): if so it
copies the pool once, donates the copy, and the caller's array stays readable with the
contents it had. Later writes are in place again.
"""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import sys
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.core import Tracer

from kvcache_core.attention.features import combined_window
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.groups import ViewPlace
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.states import StateArray
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    KvCacheError,
    ShapeMismatchError,
    UnsupportedConfigError,
)
from kvcache_core.offload import host_form
from kvcache_jax.buckets import PaddedBatch, bucket, pad_batch, pad_blocks, pad_slots
from kvcache_jax.programs import Pools, programs_for
from kvcache_jax.sharding import Placement, resolve_placement
from kvcache_jax.spec import ATTENTION_FEATURES, PREFERRED_LAYOUT, VALUE_POOL_DTYPES
from kvcache_jax.states import JaxStateStorage

__all__ = ["JAX_DTYPES", "DeletedPoolError", "JaxStorage"]

#: The dtypes a JAX pool holds (float64 needs ``jax_enable_x64`` and is not offered).
JAX_DTYPES = VALUE_POOL_DTYPES

#: Most slots one pool may have: padding slots past the end must still fit in int32.
_MAX_SLOTS = (1 << 31) - (1 << 24)

HostArray = npt.NDArray[Any]
IndexArray = npt.NDArray[np.int64]


class DeletedPoolError(KvCacheError, RuntimeError):
    """A pool array was deleted outside the storage (donated to another jitted function);
    hand that function's result back with :meth:`JaxStorage.replace_layer`."""


def _put(array: object, sharding: jax.sharding.Sharding) -> jax.Array:
    """``jax.device_put`` (typed). The result may share the input's buffer: never donate it."""
    placed: jax.Array = jax.device_put(array, sharding)
    return placed


def _reference_count(arrays: list[Any], index: int) -> int:
    return sys.getrefcount(arrays[index])


#: What :func:`_reference_count` says of an object only a list holds (calibrated here, so
#: the test follows the interpreter's counting).
_UNSHARED_COUNT = _reference_count([object()], 0)


class JaxStorage:
    """A paged K/V pool of ``jax.Array`` s, updated in place; a ``KvStorage[jax.Array]``.

    Build it through ``kvcache_core.create_manager("jax", config)``, or with a mesh to split
    the KV heads over devices: ``create_manager("jax", config, mesh=mesh, axis="model")``.

    Every write, block copy and host write is a jitted program that donates the pool, so
    it runs in place. An array handed out by :meth:`key_cache` / :meth:`value_cache` is
    never deleted under its holder: while one is alive, the next write to that layer copies
    the pool once instead (:attr:`copies_made` counts those copies). Shapes are padded to
    power-of-two buckets, so a decode loop compiles each program a few times, not every
    step. Calls are not thread-safe on their own; the manager serialises them.

    What counts as holding the pool is holding the array object (or a NumPy view of it,
    which XLA itself refuses to donate). A second ``jax.Array`` over the same buffer made
    with a JAX API (``addressable_data``, ``device_put`` to an equivalent sharding) is not
    seen: keep the array :meth:`key_cache` returned instead. An array deleted outside (you
    donated it to your own jitted step) raises :class:`DeletedPoolError` until the step's
    result is handed back with :meth:`replace_layer`.

    Args:
        config: the pool's geometry, dtype (``float32``, ``float16`` or ``bfloat16``),
            device (``cpu``, ``cuda``/``gpu``, ``rocm``, ``tpu``) and layout.
        mesh: a ``jax.sharding.Mesh`` to split the KV heads over (``None``: one device).
        axis: the mesh axis that splits the heads (may be left out on a 1-axis mesh).

    Raises:
        UnsupportedConfigError: a dtype JAX pools do not hold, no JAX device of
            ``config.device``, a mesh on other devices, heads not divisible by the axis
            size, or a pool of more than about 2**31 slots.
        InvalidTypeError, InvalidArgumentError: a bad ``mesh`` or ``axis``.
    """

    #: The attention capabilities :meth:`paged_attention` serves (all of them).
    attention_features: frozenset[str] = ATTENTION_FEATURES
    #: The pool dtypes this class holds (:class:`kvcache_jax.QuantizedJaxStorage`: int8, float8).
    POOL_DTYPES: ClassVar[tuple[str, ...]] = JAX_DTYPES

    def __init__(self, config: CacheConfig, *, mesh: object = None, axis: object = None) -> None:
        config = config.with_layout(PREFERRED_LAYOUT)  # kv_layout=None: the layout Pallas reads
        if config.attention_path == "kernel":  # pinned by the environment: XLA's path, as "auto"
            raise UnsupportedConfigError(
                "attention_path 'kernel' names the compiled CPU kernel, which the jax backend does not run: its "
                "attention is XLA's (the 'native' path); use 'auto' or 'native'"
            )
        if config.dtype not in self.POOL_DTYPES:
            raise UnsupportedConfigError(
                f"dtype {config.dtype!r} is not offered by the jax backend (supported: {', '.join(self.POOL_DTYPES)})"
            )
        if config.total_tokens > _MAX_SLOTS:
            raise UnsupportedConfigError(
                f"the pool has {config.total_tokens} slots; the jax backend indexes them with int32 and "
                f"takes at most {_MAX_SLOTS}"
            )
        self._config = config
        self._element_dtype: np.dtype[Any] = np.dtype(jnp.dtype(config.dtype))  # ml_dtypes' for bfloat16, float8
        self._placement = resolve_placement(config, mesh, axis)
        self._programs = programs_for(config.kv_layout, self._placement)
        shape, value_shape = config.block_shape(), config.value_block_shape()
        self._keys: list[jax.Array] = [self._programs.zeros(shape, config.dtype) for _ in range(config.num_layers)]
        self._values: list[jax.Array] = [
            self._programs.zeros(value_shape, config.dtype) for _ in range(config.num_layers)
        ]
        self._copies_made = 0
        # The last batch padded for attention: every layer of a step reuses it.
        self._last_batch: tuple[PageTable, bytes, PaddedBatch, tuple[jax.Array, ...]] | None = None

    # -- geometry and placement --------------------------------------------------------

    @property
    def config(self) -> CacheConfig:
        """The pool's configuration."""
        return self._config

    @property
    def placement(self) -> Placement:
        """Where the pool lives: its device, or the mesh and axis splitting its heads."""
        return self._placement

    @property
    def copies_made(self) -> int:
        """Pool arrays copied (instead of updated in place) because a caller held them."""
        return self._copies_made

    def pool_sharding(self) -> jax.sharding.Sharding:
        """The sharding of every pool array (heads split over the mesh axis, if any)."""
        return self._placement.pool(self._config.layout)

    # -- the pool itself ---------------------------------------------------------------

    def key_cache(self, layer: int) -> jax.Array:
        """The layer's key pool array itself, shape ``config.block_shape()``.

        A later write replaces it with a new array and never deletes this one.

        Raises:
            LayerIndexError: ``layer`` outside ``[0, num_layers)``.
        """
        return self._keys[self._config.check_layer(layer)]

    def value_cache(self, layer: int) -> jax.Array:
        """The layer's value pool array itself, shape ``config.value_block_shape()``. Raises
        as :meth:`key_cache`."""
        return self._values[self._config.check_layer(layer)]

    def replace_layer(self, layer: int, key_cache: jax.Array, value_cache: jax.Array) -> None:
        """Make ``key_cache``/``value_cache`` the layer's pool: the result of a user's own
        jitted step that wrote the pool with :func:`kvcache_jax.write` (and donated it).

        Raises:
            LayerIndexError: ``layer`` outside ``[0, num_layers)``.
            ArrayTypeError: not ``jax.Array`` s; DeletedPoolError: a deleted array.
            ShapeMismatchError, DTypeMismatchError: not the pool's shape and dtype.
            Nothing changes when it raises.
        """
        index = self._config.check_layer(layer)
        pools = (
            ("key_cache", key_cache, self._config.block_shape()),
            ("value_cache", value_cache, self._config.value_block_shape()),
        )
        for name, array, expected in pools:
            shape, dtype = self._array_info_or_raise(name, array)
            if shape != expected:
                raise ShapeMismatchError(f"{name} must have the pool's shape {expected}, got {shape}")
            if dtype != self._config.dtype:
                raise DTypeMismatchError(f"{name} has dtype {dtype}, the pool holds {self._config.dtype}")
            if array.is_deleted():
                raise DeletedPoolError(f"{name} of layer {index} was deleted (donated) before it was handed back")
        self._keys[index] = self._adopt(key_cache)
        self._values[index] = self._adopt(value_cache)

    def _adopt(self, array: jax.Array) -> jax.Array:
        """``array`` as a pool array: itself when it is laid out as the pool (so holding it
        counts as a reference), else a copy in the pool's sharding. Never a new object over
        the same buffer, which a later donation would delete under its holder."""
        sharding = self.pool_sharding()
        if array.sharding.is_equivalent_to(sharding, array.ndim):
            return array
        return _put(array, sharding).copy()  # a fresh buffer, whatever device_put aliased

    def _live(self, arrays: list[jax.Array], index: int) -> jax.Array:
        """``arrays[index]``, which must not have been deleted."""
        if arrays[index].is_deleted():
            kind = "key" if arrays is self._keys else "value"
            raise DeletedPoolError(
                f"layer {index}'s {kind} pool was deleted outside the storage (donated to another jitted "
                "function?); hand the function's result back with JaxStorage.replace_layer"
            )
        return arrays[index]

    def _donatable(self, arrays: list[jax.Array], index: int) -> jax.Array:
        """``arrays[index]`` if no one else holds it, else a fresh copy of it: safe to donate."""
        self._live(arrays, index)
        if _reference_count(arrays, index) <= _UNSHARED_COUNT:
            return arrays[index]
        self._copies_made += 1
        return arrays[index].copy()

    def _all_donatable(self) -> tuple[Pools, Pools]:
        layers = range(self._config.num_layers)
        return (
            tuple(self._donatable(self._keys, i) for i in layers),
            tuple(self._donatable(self._values, i) for i in layers),
        )

    # -- data path ---------------------------------------------------------------------

    def _replicated(self, host: npt.NDArray[Any]) -> jax.Array:
        return _put(host, self._placement.replicated)

    def _tokens(self, array: jax.Array, rows: int) -> jax.Array:
        """``array`` on the pool's devices (heads split as the pool's), padded to ``rows``."""
        placed = _put(array, self._placement.tokens)
        if int(placed.shape[0]) == rows:
            return placed
        return self._programs.pad_rows(rows)(placed)

    def write(self, layer: int, slots: IndexArray, keys: jax.Array, values: jax.Array) -> None:
        """Scatter ``[n, heads, dim]`` keys and ``[n, heads, value_width]`` values into
        distinct ``slots`` ``[n]``, in place."""
        padded_slots = pad_slots(np.asarray(slots), self._config.total_tokens)
        rows = int(padded_slots.shape[0])
        keys_in, values_in = self._tokens(keys, rows), self._tokens(values, rows)
        slots_in = self._replicated(padded_slots)
        key_pool = self._donatable(self._keys, layer)
        value_pool = self._donatable(self._values, layer)
        self._keys[layer], self._values[layer] = self._programs.write(
            key_pool, value_pool, slots_in, keys_in, values_in
        )

    def write_view(self, layer: int, slots: IndexArray, keys: jax.Array, values: jax.Array, place: ViewPlace) -> None:
        """Scatter ``[n, h, d]`` keys and ``[n, h, dv]`` values into the part of each of the
        distinct ``slots``' rows from ``place`` (:mod:`kvcache_core.contract.views`; an
        unquantized pool), the rest kept, in place: one jitted program per place."""
        padded_slots = pad_slots(np.asarray(slots), self._config.total_tokens)
        extra = int(padded_slots.shape[0]) - int(keys.shape[0])
        replicated = self._placement.replicated
        keys_in, values_in = (_put(jnp.pad(data, ((0, extra), (0, 0), (0, 0))), replicated) for data in (keys, values))
        key_pool = self._donatable(self._keys, layer)
        value_pool = self._donatable(self._values, layer)
        program = self._programs.write_part((place.head, place.key, place.value))
        self._keys[layer], self._values[layer] = program(
            key_pool, value_pool, self._replicated(padded_slots), keys_in, values_in
        )

    def gather(self, layer: int, blocks: IndexArray, num_tokens: int) -> tuple[jax.Array, jax.Array]:
        """Contiguous ``[num_tokens, heads, dim]`` copies of the first tokens of ``blocks``
        (values ``value_width`` wide)."""
        config = self._config
        if num_tokens == 0:
            dtype = jnp.dtype(config.dtype)
            empty_keys = jnp.zeros((0, config.num_heads, config.head_dim), dtype=dtype)
            empty_values = jnp.zeros((0, config.num_heads, config.value_width), dtype=dtype)
            return _put(empty_keys, self._placement.tokens), _put(empty_values, self._placement.tokens)
        blocks_in = self._replicated(pad_blocks(np.asarray(blocks), 0))
        keys, values = self._programs.gather(self._live(self._keys, layer), self._live(self._values, layer), blocks_in)
        return keys[:num_tokens], values[:num_tokens]

    def copy_blocks(self, source: IndexArray, destination: IndexArray) -> None:
        """Copy every layer's K and V of block ``source[i]`` into ``destination[i]``, in place."""
        if len(source) == 0:
            return
        source_in = self._replicated(pad_blocks(np.asarray(source), 0))
        destination_in = self._replicated(pad_blocks(np.asarray(destination), self._config.num_blocks))
        keys, values = self._all_donatable()
        layers = self._config.num_layers
        copied = self._programs.copy_blocks((*keys, *values), source_in, destination_in)
        self._keys, self._values = list(copied[:layers]), list(copied[layers:])

    def blocks_to_host(self, blocks: IndexArray) -> tuple[HostArray, HostArray]:
        """Host copies ``[layers, n, block_size, heads, dim]`` of keys and values in core's
        host form (:mod:`kvcache_core.offload.host_form`): bfloat16 as its ``uint16`` bit patterns."""
        keys, values = self._elements_to_host(blocks)
        form = host_form.host_dtype(self._config.dtype)
        return keys.view(form), values.view(form)

    def _elements_to_host(self, blocks: IndexArray) -> tuple[HostArray, HostArray]:
        """Host copies of ``blocks`` in the pool's element dtype (``ml_dtypes``' for
        bfloat16 and float8)."""
        config = self._config
        count = len(blocks)
        if count == 0:
            shape = (config.num_layers, 0, config.block_size, config.num_heads, config.head_dim)
            value_shape = (*shape[:4], config.value_width)
            return np.zeros(shape, dtype=self._element_dtype), np.zeros(value_shape, dtype=self._element_dtype)
        blocks_in = self._replicated(pad_blocks(np.asarray(blocks), 0))
        layers = range(config.num_layers)
        keys, values = self._programs.read_all(
            tuple(self._live(self._keys, i) for i in layers),
            tuple(self._live(self._values, i) for i in layers),
            blocks_in,
        )
        return self.to_numpy(keys)[:, :count], self.to_numpy(values)[:, :count]

    def blocks_from_host(self, blocks: IndexArray, keys: HostArray, values: HostArray) -> None:
        """Write host-form copies (:mod:`kvcache_core.offload.host_form`, from any backend) into
        ``blocks``, in place, bit for bit.

        Raises:
            ArrayTypeError: ``keys``/``values`` are not NumPy arrays.
            ShapeMismatchError: not ``[layers, len(blocks), block_size, heads, dim]``.
            DTypeMismatchError: not the host form of the pool's dtype (nothing is cast).
            Nothing changes when it raises.
        """
        shape = host_form.host_shape(self._config, len(blocks))
        host_form.check_host_array(self._config, "keys", keys, shape)
        host_form.check_host_array(
            self._config, "values", values, host_form.host_shape(self._config, len(blocks), "values")
        )
        self._elements_from_host(blocks, keys.view(self._element_dtype), values.view(self._element_dtype))

    def _elements_from_host(self, blocks: IndexArray, keys: HostArray, values: HostArray) -> None:
        """Write host arrays of the pool's element dtype (shapes checked) into ``blocks``."""
        config = self._config
        count = len(blocks)
        if count == 0:
            return
        rows = bucket(count)
        padding = ((0, 0), (0, rows - count), (0, 0), (0, 0), (0, 0))
        keys_in = _put(np.pad(keys, padding), self._placement.host_blocks)
        values_in = _put(np.pad(values, padding), self._placement.host_blocks)
        blocks_in = self._replicated(pad_blocks(np.asarray(blocks), config.num_blocks))
        key_pools, value_pools = self._all_donatable()
        new_keys, new_values = self._programs.write_all(key_pools, value_pools, blocks_in, keys_in, values_in)
        self._keys, self._values = list(new_keys), list(new_values)

    def _batch(
        self, page_table: PageTable, qo_indptr: npt.NDArray[np.int32]
    ) -> tuple[PaddedBatch, tuple[jax.Array, ...]]:
        """The padded batch on the devices; the layers of one step share it."""
        key = np.asarray(qo_indptr, dtype=np.int32).tobytes()
        cached = self._last_batch
        if cached is not None and cached[0] is page_table and cached[1] == key:
            return cached[2], cached[3]
        batch = pad_batch(page_table, qo_indptr)
        arrays = (
            self._replicated(batch.block_tables),
            self._replicated(batch.seq_lens),
            self._replicated(batch.qo_indptr),
        )
        self._last_batch = (page_table, key, batch, arrays)
        return batch, arrays

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
        """Jitted paged attention over this layer's pool (see :func:`kvcache_jax.paged_attention`),
        with the page table's sliding window and the attention features of
        :mod:`kvcache_core.attention.features`; arguments validated by the manager. Output
        ``[total_q, query_heads, dim]``, heads split as the pool's."""
        batch, (block_tables, seq_lens, indptr) = self._batch(page_table, qo_indptr)
        scales = self._attention_scales(layer)
        program = self._programs.attention(
            batch.max_query_len,
            causal,
            float(scale),
            combined_window(window, page_table.sliding_window),
            softcap=softcap,
            chunk=chunk,
            with_sinks=sinks is not None,
            with_scales=bool(scales),
        )
        query_in = self._tokens(query, batch.query_rows)
        key_pool, value_pool = self._live(self._keys, layer), self._live(self._values, layer)
        extra = (*scales, *(() if sinks is None else (sinks,)))
        output = program(query_in, key_pool, value_pool, block_tables, seq_lens, indptr, *extra)
        return output if batch.query_rows == batch.total_queries else output[: batch.total_queries]

    def _attention_scales(self, layer: int) -> tuple[jax.Array, ...]:
        """What attention decodes the layer's pool with: nothing here; a quantized pool's
        key and value scales (:class:`kvcache_jax.QuantizedJaxStorage`)."""
        del layer
        return ()

    # -- arrays ------------------------------------------------------------------------

    def _array_info_or_raise(self, name: str, array: object) -> tuple[tuple[int, ...], str]:
        try:
            return self.array_info(array)
        except TypeError as exc:
            raise ArrayTypeError(f"{name}: {exc}") from exc

    def array_info(self, array: object) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype name)`` of a ``jax.Array``.

        Raises:
            TypeError: anything else, a tracer included (manager calls run eagerly; inside
                ``jax.jit`` use :func:`kvcache_jax.write` and :func:`kvcache_jax.paged_attention`).
        """
        if isinstance(array, Tracer):
            raise TypeError(
                "got a JAX tracer: the manager runs outside jax.jit; inside a jitted step use "
                "kvcache_jax.write and kvcache_jax.paged_attention on the pool arrays"
            )
        if not isinstance(array, jax.Array):
            raise TypeError(f"expected a jax.Array, got {type(array).__name__}")
        return tuple(int(size) for size in array.shape), str(array.dtype.name)

    def from_numpy(self, array: HostArray) -> jax.Array:
        """A ``jax.Array`` with the same values, on the pool's devices (replicated over a mesh).

        The dtype is kept, except that while ``jax_enable_x64`` is off 64-bit integers
        become 32-bit ones (their values must fit), as JAX holds them.

        Raises:
            DTypeMismatchError: float64 or complex128 while ``jax_enable_x64`` is off (JAX
                would silently round the values), or 64-bit integers that do not fit in 32.
        """
        host = np.asarray(array)
        if not bool(getattr(jax.config, "jax_enable_x64", False)):
            if host.dtype in (np.dtype(np.float64), np.dtype(np.complex128)):
                raise DTypeMismatchError(
                    f"JAX holds {host.dtype.name} only with jax_enable_x64 on; convert the array first "
                    f"(the pool holds {self._config.dtype})"
                )
            if host.dtype.kind in "iu" and host.dtype.itemsize == 8:
                narrow = np.dtype(np.int32 if host.dtype.kind == "i" else np.uint32)
                limits = np.iinfo(narrow)
                if host.size and (int(host.min()) < limits.min or int(host.max()) > limits.max):
                    raise DTypeMismatchError(
                        f"{host.dtype.name} values outside {narrow.name} range: JAX holds 64-bit integers "
                        "only with jax_enable_x64 on"
                    )
                host = host.astype(narrow)
        return _put(host, self._placement.replicated)

    def to_numpy(self, array: jax.Array) -> HostArray:
        """A host NumPy copy (bfloat16 as an ``ml_dtypes.bfloat16`` array, which NumPy casts
        to float32 exactly). On several hosts the shards are gathered from every process."""
        if not array.is_fully_addressable:
            from jax.experimental import multihost_utils

            gathered: object = multihost_utils.process_allgather(array, tiled=True)  # pyright: ignore[reportUnknownMemberType]
            result: HostArray = np.array(gathered)
            return result
        copied: HostArray = np.array(array)
        return copied

    def array_namespace(self) -> Any:
        """``jax.numpy``, JAX's Array API namespace."""
        return jnp

    def state_storage(self, arrays: tuple[StateArray, ...], num_slots: int) -> JaxStateStorage:
        """The state pool of a config with recurrent-state layers, replicated on the pool's
        devices (capability ``"state_layers"``).

        Raises:
            UnsupportedConfigError: a state array of a dtype the backend does not hold.
        """
        return JaxStateStorage(arrays, num_slots, lambda array: _put(array, self._placement.replicated))
