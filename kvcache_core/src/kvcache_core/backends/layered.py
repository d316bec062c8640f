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
serves the view without knowing of it; ``key_cache`` gives the view itself. Where a page holds
views side by side (``offsets``: Gemma 4's sliding layers two to a page of its full layers'
width), a view's write keeps the rest of each row it writes (the rows are read from the page
first and the view's part replaced), and its queries sit at its offset among zeros.

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
from typing import Any, Generic, NamedTuple, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.groups import LayerGeometry, ViewPlace, widest_geometry
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import BlockArray, KvStorage, SlotArray
from kvcache_core.contract.regions import MemoryRegion, storage_regions
from kvcache_core.contract.states import StateArray
from kvcache_core.contract.views import storage_write_view
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


def page_shapes(
    config: CacheConfig, pages: Sequence[int], offsets: Sequence[ViewPlace] | None = None
) -> dict[int, LayerGeometry]:
    """Per page, the geometry holding each storage layer viewing it (``pages[layer]``, at
    ``offsets[layer]``): the most KV heads, the widest keys and the widest values."""
    reaches: dict[int, list[LayerGeometry]] = {}
    for layer, page in enumerate(pages):
        place = ViewPlace() if offsets is None else offsets[layer]
        reaches.setdefault(page, []).append(place.reach(config.layer_geometry(layer)))
    return {page: widest_geometry(found) for page, found in reaches.items()}


def _placed(namespace: Any, array: Any, shape: tuple[int, ...], start: tuple[int, ...] | None = None) -> Any:
    """``array`` among zeros in an array of ``shape``, from ``start`` (the origin by default)
    along each axis (the Array API's ``concat``, ``zeros_like`` and ``broadcast_to``: on the
    array's own device)."""
    for axis, size in enumerate(shape):
        have = int(array.shape[axis])
        before = 0 if start is None else start[axis]
        after = size - have - before
        if before or after:
            edge = tuple(slice(0, 1) if index == axis else slice(None) for index in range(len(shape)))
            zero = namespace.zeros_like(array[edge])

            def zeros(count: int, axis: int = axis, zero: Any = zero, array: Any = array) -> Any:
                filler = list(array.shape)
                filler[axis] = count
                return namespace.broadcast_to(zero, tuple(filler))

            parts = [zeros(before)] if before else []
            parts += [array, zeros(after)] if after else [array]
            array = namespace.concat(parts, axis=axis)
    return array


def _spliced(namespace: Any, rows: Any, part: Any, start: tuple[int, int]) -> Any:
    """``rows`` ``[n, heads, width]`` with ``part`` in place of its own extent from ``start``
    (first head, first feature): what a view's write makes of the rows of its page."""
    heads, width = (int(size) for size in part.shape[1:])
    head, feature = start
    middle = part
    if width < int(rows.shape[2]):
        around = rows[:, head : head + heads]
        pieces = (around[:, :, :feature], part, around[:, :, feature + width :])
        middle = namespace.concat([piece for piece in pieces if int(piece.shape[2])], axis=2)
    pieces = (rows[:, :head], middle, rows[:, head + heads :])
    return namespace.concat([piece for piece in pieces if int(piece.shape[1])], axis=1)


def _view_index(layout: str, heads: int, width: int, place: ViewPlace, part: str) -> tuple[slice, ...]:
    """The index of ``heads`` heads and ``width`` features of a pool array in ``layout``, from
    ``place`` (in the ``"keys"`` or ``"values"`` pool)."""
    first = place.value if part == "values" else place.key
    every, first_heads, features = slice(None), slice(place.head, place.head + heads), slice(first, first + width)
    if layout == "NHD":
        return (every, every, first_heads, features)
    if layout == "HND":
        return (every, first_heads, every, features)
    return (first_heads, every, every, features)


class _Route(NamedTuple):
    """Where a storage layer lives: its part, its page's place in the part, its own and its
    page's geometry, its view's place in the page, whether it is narrower than its page and
    whether its page holds views side by side (its writes then keep the rest of each row)."""

    part: int
    local: int
    own: LayerGeometry
    page: LayerGeometry
    place: ViewPlace
    narrow: bool
    packed: bool

    def host_index(self, kv: int) -> tuple[slice, slice, slice, slice]:
        """The view in a host copy ``[n, block_size, heads, width]`` of its page's blocks
        (keys for ``kv`` 0, values for 1): its heads and features."""
        width, first = (self.own.value_width, self.place.value) if kv else (self.own.head_dim, self.place.key)
        heads = slice(self.place.head, self.place.head + self.own.num_heads)
        return slice(None), slice(None), heads, slice(first, first + width)


class LayeredStorage(Generic[ArrayT]):
    """One storage per geometry of a pool's layers, as one :class:`KvStorage` (see the module).

    Args:
        config: the storage config (``CacheConfig.storage_config()``), of mixed geometry.
        factory: the backend's storage factory, called once per geometry with a config of
            that geometry and ``options``.
        pages: per storage layer, the page whose memory it views
            (``CacheConfig.storage_layers.pages`` of the pool's config); ``None``: each layer
            its own.
        offsets: per storage layer, where its view lies in its page
            (``CacheConfig.storage_layers.offsets``); ``None``: each at its page's origin.

    Attributes:
        parts: the storages, one per geometry (of pages).
        attention_features: the attention capabilities every part serves.

    Raises:
        InvalidConfigError: ``pages`` or ``offsets`` not one per storage layer.
    """

    def __init__(
        self,
        config: CacheConfig,
        factory: Callable[..., KvStorage[ArrayT]],
        *,
        pages: Sequence[int] | None = None,
        offsets: Sequence[ViewPlace] | None = None,
        **options: Any,
    ) -> None:
        self._config = config
        viewed = tuple(range(config.num_layers)) if pages is None else tuple(pages)
        places = (ViewPlace(),) * config.num_layers if offsets is None else tuple(offsets)
        for name, given in (("pages", viewed), ("offsets", places)):
            if len(given) != config.num_layers:
                raise InvalidConfigError(
                    f"{name} names {len(given)} storage layers, the storage config has {config.num_layers}: give "
                    f"one per storage layer (CacheConfig.storage_layers.{name})"
                )
        shapes = page_shapes(config, viewed, places)
        classes: dict[LayerGeometry, list[int]] = {}
        for page, shape in shapes.items():
            classes.setdefault(shape, []).append(page)
        self.shares_pages = len(shapes) != config.num_layers
        packed = {page for page, place in zip(viewed, places, strict=True) if not place.origin}
        self._route: list[_Route] = []
        parts: list[KvStorage[ArrayT]] = []
        try:
            for shape, held in classes.items():
                parts.append(factory(part_config(config, shape, len(held)), **options))
            for layer, (page, place) in enumerate(zip(viewed, places, strict=True)):
                own, whole = config.layer_geometry(layer), shapes[page]
                index = list(classes).index(whole)
                narrow = own != whole
                self._route.append(
                    _Route(index, classes[whole].index(page), own, whole, place, narrow, narrow and page in packed)
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
        route = self._route[layer]
        return self.parts[route.part], route.local

    def _view(self, layer: int, array: ArrayT, part: str) -> ArrayT:
        """``array``, the page's pool of ``layer``, as the layer's view: its heads and features."""
        route = self._route[layer]
        if not route.narrow:
            return array
        own = route.own
        width = own.value_width if part == "values" else own.head_dim
        view: ArrayT = cast("Any", array)[_view_index(self._config.layout, own.num_heads, width, route.place, part)]
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
        zeros to its page's shape where it views a wider page; where the page holds views side
        by side, into the rows as they are, the other views' parts kept)."""
        part, local = self._part(layer)
        route = self._route[layer]
        if route.packed:
            if storage_write_view(part, local, slots, keys, values, route.place):
                return
            keys, values = self._rows_with(part, local, slots, keys, values, route)
        elif route.narrow:
            namespace, page = part.array_namespace(), route.page
            count = int(cast("Any", keys).shape[0])
            keys = _placed(namespace, keys, (count, page.num_heads, page.head_dim))
            values = _placed(namespace, values, (count, page.num_heads, page.value_width))
        part.write(local, slots, keys, values)

    def _rows_with(
        self, part: KvStorage[ArrayT], local: int, slots: SlotArray, keys: ArrayT, values: ArrayT, route: _Route
    ) -> tuple[ArrayT, ArrayT]:
        """The page's rows at ``slots``, as they are, with the view's part replaced by ``keys``
        and ``values``: read through the part's ``gather`` of the slots' blocks (for a part
        without ``write_view``, :mod:`kvcache_core.contract.views`)."""
        block_size = self._config.block_size
        written = np.asarray(slots, dtype=np.int64)
        blocks, where = np.unique(written // block_size, return_inverse=True)
        rows = where.reshape(-1) * block_size + written % block_size
        namespace = part.array_namespace()
        held = part.gather(local, blocks, len(blocks) * block_size)
        index = part.from_numpy(rows)
        spliced: list[ArrayT] = []
        for kept, new, feature in zip(held, (keys, values), (route.place.key, route.place.value), strict=True):
            current = namespace.astype(namespace.take(kept, index, axis=0), cast("Any", new).dtype)
            spliced.append(_spliced(namespace, current, new, (route.place.head, feature)))
        return spliced[0], spliced[1]

    def gather(self, layer: int, blocks: BlockArray, num_tokens: int) -> tuple[ArrayT, ArrayT]:
        """Contiguous copies of the layer's tokens in ``blocks``, of its own geometry."""
        part, local = self._part(layer)
        keys, values = part.gather(local, blocks, num_tokens)
        route = self._route[layer]
        if not route.narrow:
            return keys, values
        own, place = route.own, route.place
        heads = slice(place.head, place.head + own.num_heads)
        narrow: tuple[Any, Any] = (
            cast("Any", keys)[:, heads, place.key : place.key + own.head_dim],
            cast("Any", values)[:, heads, place.value : place.value + own.value_width],
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
                    copies[route.part][kv][route.local][route.host_index(kv)].reshape(
                        count, block_size * route.own.num_heads * (route.own.value_width if kv else route.own.head_dim)
                    )
                    for route in self._route
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
            for route in self._route:
                own = route.own
                width = own.value_width if kv else own.head_dim
                elements = block_size * own.num_heads * width
                block = array[:, start : start + elements].reshape(count, block_size, own.num_heads, width)
                pages[route.part][kv][route.local][route.host_index(kv)] = block
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
        a wider page attends with queries among zeros at its place: a zero feature adds
        nothing to a score, whatever another view of the page holds there)."""
        part, local = self._part(layer)
        route = self._route[layer]
        if not route.narrow:
            return part.paged_attention(local, query, page_table, qo_indptr, scale, causal, **features)
        own, page, place = route.own, route.page, route.place
        namespace = part.array_namespace()
        tokens, query_heads = (int(size) for size in cast("Any", query).shape[:2])
        group = query_heads // own.num_heads
        heads, first = group * page.num_heads, group * place.head
        placed = _placed(namespace, query, (tokens, heads, page.head_dim), (0, first, place.key))
        sinks = features.get("sinks")
        if sinks is not None and heads != query_heads:  # the other heads' sinks: any, their outputs are dropped
            features["sinks"] = _placed(np if isinstance(sinks, np.ndarray) else namespace, sinks, (heads,), (first,))
        output = part.paged_attention(local, placed, page_table, qo_indptr, scale, causal, **features)
        narrow: ArrayT = cast("Any", output)[
            :, first : first + query_heads, place.value : place.value + own.value_width
        ]
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
            for layer, route in enumerate(self._route)
            for region in found[route.part]
            if region.layer == route.local
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
