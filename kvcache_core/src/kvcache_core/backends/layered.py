"""A pool whose layers differ in geometry (capability ``"layer_geometry"``), over any backend.

Gemma 4's full-attention layers hold other KV heads and head sizes than its sliding ones
(``LayerSpec(num_heads=..., head_dim=..., value_head_dim=...)``). Every layer keeps the same
blocks and block ids; only the shape of its arrays differs. :class:`LayeredStorage` builds one
storage of the backend per geometry (the layers of one shape, each in its own arrays of that
shape, all ``num_blocks`` long) and routes each layer's calls to its part, so a block id names
the same block in every part and a block copy (fork, copy-on-write) copies it in each.

Storage layers may share **pages** (``CacheConfig.storage_layers``: Gemma 4's sliding and full
layers in KV-cache groups, whose blocks one group holds at a time): the parts then hold one
array per page, of the page's geometry (the most heads, the widest keys and values of its
views), and each storage layer is a view of its page's first heads and features. A narrower
layer's writes are padded with zeros to the page's shape, its queries too (zero features add
nothing to a score; extra heads are dropped from the output), so every backend's storage
serves the view without knowing of it; ``key_cache`` gives the view itself.

Host copies of blocks are in one form per pool, ``[layers, n, block_size, num_heads, width]``,
which layers of several shapes do not fit: this storage hands swap a packed form, ``[n,
elements]`` per part (keys, values), each storage layer's block flat, layer after layer
(``CacheConfig.packed_block_elements``). What keeps host copies beyond one pool (offload tiers,
prefix files, host writes: records with a geometry header) is refused by name for such a pool
before anything changes (``CacheConfig.refuse_host_copies``). Its memory regions are its parts',
each layer of its own geometry (a transfer reads them in place); a storage whose layers share
pages names none (a region is one layer's whole memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.groups import LayerGeometry
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import BlockArray, KvStorage, SlotArray
from kvcache_core.contract.regions import MemoryRegion, storage_regions
from kvcache_core.contract.states import StateArray
from kvcache_core.errors import InvalidConfigError, ShapeMismatchError, UnsupportedConfigError
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


def page_shapes(config: CacheConfig, pages: Sequence[int]) -> dict[int, LayerGeometry]:
    """Per page, the geometry holding each storage layer viewing it (``pages[layer]``): the
    most KV heads, the widest keys and the widest values."""
    found: dict[int, LayerGeometry] = {}
    for layer, page in enumerate(pages):
        shape = config.layer_geometry(layer)
        held = found.get(page, shape)
        found[page] = LayerGeometry(
            max(held.num_heads, shape.num_heads),
            max(held.head_dim, shape.head_dim),
            max(held.value_width, shape.value_width),
        )
    return found


def _padded(namespace: Any, array: Any, shape: tuple[int, ...]) -> Any:
    """``array`` with zeros appended along each axis shorter than ``shape``'s (the Array API's
    ``concat``, ``zeros_like`` and ``broadcast_to``: on the array's own device)."""
    for axis, size in enumerate(shape):
        have = int(array.shape[axis])
        if have < size:
            edge = tuple(slice(0, 1) if index == axis else slice(None) for index in range(len(shape)))
            filler = list(array.shape)
            filler[axis] = size - have
            zeros = namespace.broadcast_to(namespace.zeros_like(array[edge]), tuple(filler))
            array = namespace.concat([array, zeros], axis=axis)
    return array


def _view_index(layout: str, heads: int, width: int) -> tuple[slice, ...]:
    """The index of the first ``heads`` heads and ``width`` features of a pool array in ``layout``."""
    every, first_heads, features = slice(None), slice(0, heads), slice(0, width)
    if layout == "NHD":
        return (every, every, first_heads, features)
    if layout == "HND":
        return (every, first_heads, every, features)
    return (first_heads, every, every, features)


class LayeredStorage(Generic[ArrayT]):
    """One storage per geometry of a pool's layers, as one :class:`KvStorage` (see the module).

    Args:
        config: the storage config (``CacheConfig.storage_config()``), of mixed geometry.
        factory: the backend's storage factory, called once per geometry with a config of
            that geometry and ``options``.
        pages: per storage layer, the page whose memory it views
            (``CacheConfig.storage_layers.pages`` of the pool's config); ``None``: each layer
            its own.

    Attributes:
        parts: the storages, one per geometry (of pages).
        attention_features: the attention capabilities every part serves.

    Raises:
        InvalidConfigError: ``pages`` not one page per storage layer.
    """

    def __init__(
        self,
        config: CacheConfig,
        factory: Callable[..., KvStorage[ArrayT]],
        *,
        pages: Sequence[int] | None = None,
        **options: Any,
    ) -> None:
        self._config = config
        viewed = tuple(range(config.num_layers)) if pages is None else tuple(pages)
        if len(viewed) != config.num_layers:
            raise InvalidConfigError(
                f"pages names {len(viewed)} storage layers, the storage config has {config.num_layers}: give one "
                "page per storage layer (CacheConfig.storage_layers.pages)"
            )
        shapes = page_shapes(config, viewed)
        classes: dict[LayerGeometry, list[int]] = {}
        for page, shape in shapes.items():
            classes.setdefault(shape, []).append(page)
        self.shares_pages = len(shapes) != config.num_layers
        # Per storage layer: its part, the page's place in it, its own and its page's geometry.
        self._route: list[tuple[int, int, LayerGeometry, LayerGeometry]] = []
        parts: list[KvStorage[ArrayT]] = []
        try:
            for shape, held in classes.items():
                parts.append(factory(part_config(config, shape, len(held)), **options))
            for layer, page in enumerate(viewed):
                index = list(classes).index(shapes[page])
                self._route.append(
                    (index, classes[shapes[page]].index(page), config.layer_geometry(layer), shapes[page])
                )
        except BaseException:
            for part in parts:  # built parts are nobody's: release them now
                close = getattr(part, "close", None)
                if callable(close):
                    close()
            raise
        self.parts: tuple[KvStorage[ArrayT], ...] = tuple(parts)
        self._part_pages = tuple((shape, len(held)) for shape, held in classes.items())
        served: list[frozenset[str]] = [
            frozenset(cast("Iterable[str]", getattr(part, "attention_features", ()))) for part in parts
        ]
        self.attention_features: frozenset[str] = served[0].intersection(*served[1:])

    @property
    def config(self) -> CacheConfig:
        """The pool's (storage) config, every layer's geometry in its layer specs."""
        return self._config

    def _part(self, layer: int) -> tuple[KvStorage[ArrayT], int]:
        index, local, _, _ = self._route[layer]
        return self.parts[index], local

    def _view(self, layer: int, array: ArrayT, part: str) -> ArrayT:
        """``array``, the page's pool of ``layer``, as the layer's view: its first heads and features."""
        _, _, own, page = self._route[layer]
        if own == page:
            return array
        width = own.value_width if part == "values" else own.head_dim
        view: ArrayT = cast("Any", array)[_view_index(self._config.layout, own.num_heads, width)]
        return view

    def key_cache(self, layer: int) -> ArrayT:
        """The layer's key pool, of its own geometry (its part's array, or its view of the page)."""
        part, local = self._part(layer)
        return self._view(layer, part.key_cache(local), "keys")

    def value_cache(self, layer: int) -> ArrayT:
        """The layer's value pool, of its own geometry."""
        part, local = self._part(layer)
        return self._view(layer, part.value_cache(local), "values")

    def write(self, layer: int, slots: SlotArray, keys: ArrayT, values: ArrayT) -> None:
        """Scatter the layer's ``[n, its heads, its widths]`` K/V into ``slots`` (padded with
        zeros to its page's shape where it views a wider page)."""
        part, local = self._part(layer)
        _, _, own, page = self._route[layer]
        if own != page:
            namespace = part.array_namespace()
            count = int(cast("Any", keys).shape[0])
            keys = _padded(namespace, keys, (count, page.num_heads, page.head_dim))
            values = _padded(namespace, values, (count, page.num_heads, page.value_width))
        part.write(local, slots, keys, values)

    def gather(self, layer: int, blocks: BlockArray, num_tokens: int) -> tuple[ArrayT, ArrayT]:
        """Contiguous copies of the layer's tokens in ``blocks``, of its own geometry."""
        part, local = self._part(layer)
        keys, values = part.gather(local, blocks, num_tokens)
        _, _, own, page = self._route[layer]
        if own == page:
            return keys, values
        heads = slice(0, own.num_heads)
        narrow: tuple[Any, Any] = (
            cast("Any", keys)[:, heads, : own.head_dim],
            cast("Any", values)[:, heads, : own.value_width],
        )
        return narrow

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
        count, block_size = len(blocks), self._config.block_size
        packed = [
            np.concatenate(
                [
                    copies[index][kv][local][:, :, : own.num_heads, : own.value_width if kv else own.head_dim].reshape(
                        count, block_size * own.num_heads * (own.value_width if kv else own.head_dim)
                    )
                    for index, local, own, _ in self._route
                ],
                axis=1,
            )
            for kv in (0, 1)
        ]
        return packed[0], packed[1]

    def blocks_from_host(self, blocks: BlockArray, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> None:
        """Write packed host copies (:meth:`blocks_to_host`) into ``blocks`` (the views of a
        page, read from it together, agree where they overlap).

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
        block_size = self._config.block_size
        pages = [  # per part, its pages' host form, each view's copy put in its place below
            [
                np.zeros(
                    (held, count, block_size, shape.num_heads, shape.value_width if kv else shape.head_dim), array.dtype
                )
                for kv, array in enumerate((keys, values))
            ]
            for shape, held in self._part_pages
        ]
        for kv, array in enumerate((keys, values)):
            start = 0
            for index, local, own, _ in self._route:
                width = own.value_width if kv else own.head_dim
                elements = block_size * own.num_heads * width
                block = array[:, start : start + elements].reshape(count, block_size, own.num_heads, width)
                pages[index][kv][local][:, :, : own.num_heads, :width] = block
                start += elements
        for part, (part_keys, part_values) in zip(self.parts, pages, strict=True):
            part.blocks_from_host(blocks, part_keys, part_values)

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
        heads, its head_dim]``, output ``[tokens, k * its heads, its value width]`` (a view of
        a wider page attends with queries padded by zeros: no score changes)."""
        part, local = self._part(layer)
        _, _, own, page = self._route[layer]
        if own == page:
            return part.paged_attention(local, query, page_table, qo_indptr, scale, causal, **features)
        namespace = part.array_namespace()
        tokens, query_heads = (int(size) for size in cast("Any", query).shape[:2])
        heads = query_heads // own.num_heads * page.num_heads
        padded = _padded(namespace, query, (tokens, heads, page.head_dim))
        sinks = features.get("sinks")
        if sinks is not None and heads != query_heads:  # the extra heads' sinks: any, their outputs are dropped
            features["sinks"] = _padded(np if isinstance(sinks, np.ndarray) else namespace, sinks, (heads,))
        output = part.paged_attention(local, padded, page_table, qo_indptr, scale, causal, **features)
        narrow: ArrayT = cast("Any", output)[:, :query_heads, : own.value_width]
        return narrow

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
            UnsupportedConfigError: the backend's storage names no memory (no ``memory_regions``), or
                storage layers share pages.
        """
        if self.shares_pages:
            raise UnsupportedConfigError(
                "this pool's storage layers share pages (layers of different geometry in KV-cache groups): a memory "
                "region holds one layer's whole memory, so it names none"
            )
        found: list[tuple[MemoryRegion, ...]] = []
        for part in self.parts:
            regions = storage_regions(part)
            if regions is None:
                raise UnsupportedConfigError(f"the storage {type(part).__name__} names no memory (no memory_regions)")
            found.append(regions)
        return tuple(
            dataclasses.replace(region, layer=layer)
            for layer, (index, local, _, _) in enumerate(self._route)
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
