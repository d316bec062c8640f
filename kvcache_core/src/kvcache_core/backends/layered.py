"""A pool whose layers differ in geometry (capability ``"layer_geometry"``), over any backend.

Gemma 4's full-attention layers hold other KV heads and head sizes than its sliding ones
(``LayerSpec(num_heads=..., head_dim=..., value_head_dim=...)``). Every layer keeps the same
blocks and block ids; only the shape of its arrays differs. :class:`LayeredStorage` builds one
storage of the backend per geometry (the layers of one shape, each in its own arrays of that
shape, all ``num_blocks`` long) and routes each layer's calls to its part, so a block id names
the same block in every part and a block copy (fork, copy-on-write) copies it in each.

Host copies of blocks are in one form per pool, ``[layers, n, block_size, num_heads, width]``,
which layers of several shapes do not fit: this storage hands swap a packed form, ``[n,
elements]`` per part (keys, values), each storage layer's block flat, layer after layer
(``CacheConfig.packed_block_elements``). What keeps host copies beyond one pool (offload tiers,
prefix files, host writes: records with a geometry header) is refused by name for such a pool
before anything changes (``CacheConfig.refuse_host_copies``). Its memory regions are its parts',
each layer of its own geometry (a transfer reads them in place).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.groups import LayerGeometry
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import BlockArray, KvStorage, SlotArray
from kvcache_core.contract.regions import MemoryRegion, storage_regions
from kvcache_core.contract.states import StateArray
from kvcache_core.errors import ShapeMismatchError, UnsupportedConfigError
from kvcache_core.offload.host_form import check_host_array

__all__ = ["LayeredStorage", "geometry_classes", "part_config"]

ArrayT = TypeVar("ArrayT")


def geometry_classes(config: CacheConfig) -> dict[LayerGeometry, list[int]]:
    """The storage layers of ``config`` by geometry, in order of first appearance."""
    classes: dict[LayerGeometry, list[int]] = {}
    for layer in range(config.num_layers):
        classes.setdefault(config.layer_geometry(layer), []).append(layer)
    return classes


def part_config(config: CacheConfig, shape: LayerGeometry, layers: int) -> CacheConfig:
    """The config of the part holding ``layers`` storage layers of ``shape``: one geometry."""
    return dataclasses.replace(
        config,
        num_layers=layers,
        num_heads=shape.num_heads,
        head_dim=shape.head_dim,
        value_head_dim=shape.value_width,
        layer_specs=None,
    )


class LayeredStorage(Generic[ArrayT]):
    """One storage per geometry of a pool's layers, as one :class:`KvStorage` (see the module).

    Args:
        config: the storage config (``CacheConfig.storage_config()``), of mixed geometry.
        factory: the backend's storage factory, called once per geometry with a config of
            that geometry and ``options``.

    Attributes:
        parts: the storages, one per geometry.
        attention_features: the attention capabilities every part serves.
    """

    def __init__(self, config: CacheConfig, factory: Callable[..., KvStorage[ArrayT]], **options: Any) -> None:
        self._config = config
        self._route: list[tuple[int, int]] = [(-1, -1)] * config.num_layers
        parts: list[KvStorage[ArrayT]] = []
        try:
            for index, (shape, layers) in enumerate(geometry_classes(config).items()):
                parts.append(factory(part_config(config, shape, len(layers)), **options))
                for local, layer in enumerate(layers):
                    self._route[layer] = (index, local)
        except BaseException:
            for part in parts:  # built parts are nobody's: release them now
                close = getattr(part, "close", None)
                if callable(close):
                    close()
            raise
        self.parts: tuple[KvStorage[ArrayT], ...] = tuple(parts)
        served: list[frozenset[str]] = [
            frozenset(cast("Iterable[str]", getattr(part, "attention_features", ()))) for part in parts
        ]
        self.attention_features: frozenset[str] = served[0].intersection(*served[1:])

    @property
    def config(self) -> CacheConfig:
        """The pool's (storage) config, every layer's geometry in its layer specs."""
        return self._config

    def _part(self, layer: int) -> tuple[KvStorage[ArrayT], int]:
        index, local = self._route[layer]
        return self.parts[index], local

    def key_cache(self, layer: int) -> ArrayT:
        """The layer's key pool, of its own geometry (its part's array)."""
        part, local = self._part(layer)
        return part.key_cache(local)

    def value_cache(self, layer: int) -> ArrayT:
        """The layer's value pool, of its own geometry."""
        part, local = self._part(layer)
        return part.value_cache(local)

    def write(self, layer: int, slots: SlotArray, keys: ArrayT, values: ArrayT) -> None:
        """Scatter the layer's ``[n, its heads, its widths]`` K/V into ``slots``."""
        part, local = self._part(layer)
        part.write(local, slots, keys, values)

    def gather(self, layer: int, blocks: BlockArray, num_tokens: int) -> tuple[ArrayT, ArrayT]:
        """Contiguous copies of the layer's tokens in ``blocks``, of its own geometry."""
        part, local = self._part(layer)
        return part.gather(local, blocks, num_tokens)

    def copy_blocks(self, source: BlockArray, destination: BlockArray) -> None:
        """Copy every layer's K/V of ``source[i]`` into ``destination[i]`` (each part's)."""
        for part in self.parts:
            part.copy_blocks(source, destination)

    def blocks_to_host(self, blocks: BlockArray) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Host copies of ``blocks`` in the packed form ``[n, elements]`` (keys, then values):
        per block, each storage layer's ``[block_size, its heads, its width]`` in host form
        (:mod:`kvcache_core.offload.host_form`), flat, layer after layer
        (``CacheConfig.packed_block_elements``)."""
        copies = [part.blocks_to_host(blocks) for part in self.parts]
        count = len(blocks)
        packed = [
            np.concatenate(
                [
                    copies[index][kv][local].reshape(count, int(np.prod(copies[index][kv].shape[2:])))
                    for index, local in self._route
                ],
                axis=1,
            )
            for kv in (0, 1)
        ]
        return packed[0], packed[1]

    def blocks_from_host(self, blocks: BlockArray, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> None:
        """Write packed host copies (:meth:`blocks_to_host`) into ``blocks``.

        Raises:
            ArrayTypeError, DTypeMismatchError, ShapeMismatchError: not the packed form of
                ``len(blocks)`` blocks (nothing is written).
        """
        count = len(blocks)
        for name, array in (("keys", keys), ("values", values)):
            expected = (count, self._config.packed_block_elements(name))
            if isinstance(array, np.ndarray) and tuple(array.shape) != expected:
                raise ShapeMismatchError(
                    f"{name} must have shape {expected} (the packed host form of a pool of mixed geometry: [blocks, "
                    f"elements]), got {tuple(array.shape)}"
                )
            check_host_array(self._config, name, array, expected)
        parts: list[list[list[npt.NDArray[Any]]]] = [[[], []] for _ in self.parts]
        for kv, (name, array) in enumerate((("keys", keys), ("values", values))):
            start = 0
            for layer, (index, _) in enumerate(self._route):
                shape = self._config.layer_geometry(layer)
                width = shape.head_dim if name == "keys" else shape.value_width
                elements = self._config.block_size * shape.num_heads * width
                block = array[:, start : start + elements].reshape(
                    count, self._config.block_size, shape.num_heads, width
                )
                parts[index][kv].append(block)
                start += elements
        for part, (part_keys, part_values) in zip(self.parts, parts, strict=True):
            part.blocks_from_host(blocks, np.stack(part_keys), np.stack(part_values))

    def paged_attention(
        self,
        layer: int,
        query: ArrayT,
        page_table: PageTable,
        qo_indptr: npt.NDArray[Any],
        scale: float,
        causal: bool,
        **features: Any,
    ) -> ArrayT:
        """Attention over the layer's pool (its part's kernel): ``query`` ``[tokens, k * its
        heads, its head_dim]``, output ``[tokens, k * its heads, its value width]``."""
        part, local = self._part(layer)
        return part.paged_attention(local, query, page_table, qo_indptr, scale, causal, **features)

    def array_info(self, array: object) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype name)`` of a native array (the backend's)."""
        return self.parts[0].array_info(array)

    def from_numpy(self, array: npt.NDArray[Any]) -> ArrayT:
        """A native array of ``array`` (the backend's)."""
        return self.parts[0].from_numpy(array)

    def to_numpy(self, array: ArrayT) -> npt.NDArray[Any]:
        """A host copy of a native array (the backend's)."""
        return self.parts[0].to_numpy(array)

    def array_namespace(self) -> Any:
        """The backend's array namespace."""
        return self.parts[0].array_namespace()

    def memory_regions(self) -> tuple[MemoryRegion, ...]:
        """Every layer's regions (:mod:`kvcache_core.contract.regions`), each of its own
        geometry: its part's, numbered by the pool's layers.

        Raises:
            UnsupportedConfigError: the backend's storage names no memory (no ``memory_regions``).
        """
        found: list[tuple[MemoryRegion, ...]] = []
        for part in self.parts:
            regions = storage_regions(part)
            if regions is None:
                raise UnsupportedConfigError(f"the storage {type(part).__name__} names no memory (no memory_regions)")
            found.append(regions)
        return tuple(
            dataclasses.replace(region, layer=layer)
            for layer, (index, local) in enumerate(self._route)
            for region in found[index]
            if region.layer == local
        )

    def state_storage(self, arrays: tuple[StateArray, ...], num_slots: int) -> Any:
        """The backend's state pool (capability ``"state_layers"``), built by the first part.

        Raises:
            UnsupportedConfigError: the backend has no state storage.
        """
        build = getattr(self.parts[0], "state_storage", None)
        if not callable(build):
            raise UnsupportedConfigError(
                f"the storage {type(self.parts[0]).__name__} holds no recurrent states (no state_storage)"
            )
        return build(arrays, num_slots)

    def close(self) -> None:
        """Release every part's pool."""
        for part in self.parts:
            close = getattr(part, "close", None)
            if callable(close):
                close()
