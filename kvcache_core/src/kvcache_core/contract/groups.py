"""Per-layer attention specs and the KV-cache groups they form (hybrid models).

Many decoders mix attention kinds across layers: sliding-window layers between
full-attention ones (Gemma 2 and 3, gpt-oss, Cohere 2, Qwen2 with ``use_sliding_window``),
chunked local attention (Llama 4). ``CacheConfig(layer_specs=...)`` names the
:class:`LayerSpec` of every layer. What a layer *keeps* decides its blocks: a full or
chunked layer keeps every block of a request, a sliding layer of window ``W`` only the
blocks its window still sees (``ceil(W / block_size) + 1`` once the request is long).
A layer keeping a recurrent state besides its K/V (``LayerSpec(state=..., keeps_kv=True)``)
keeps the blocks of its attention's kind; a layer keeping a state only, or nothing, keeps
no blocks and joins no group.

Layers that keep the same blocks form a **KV-cache group**; each request has one block
table per group, and the blocks of every group come from one pool. So that one block's
memory serves every group alike, all groups have the same number of layers, ``g``: the
greatest common divisor of the layer counts of the distinct kinds, each kind's layers
split in layer order into groups of ``g``. The storage is built for ``g`` layers
(:meth:`CacheConfig.storage_config`); layer ``i`` of a group lives in the storage's layer
``i``, in that group's blocks. Gemma 2's 13 sliding and 13 full layers are two groups of
13; a 5:1 pattern of 25 sliding and 5 full layers is six groups of 5.

A pool without ``layer_specs`` is one group of every layer (with the pool's
``sliding_window``, if any): nothing changes for it.

A layer may also hold its own **geometry** (Gemma 4's full-attention layers have a head size
and KV head count of their own): ``LayerSpec(num_heads=..., head_dim=..., value_head_dim=...)``,
each ``None`` for the pool's. Every layer keeps the same blocks and block ids; only the shape
of its arrays differs (:meth:`CacheConfig.layer_geometry`). Where the layers that share a
storage layer's place in their groups differ in geometry (Gemma 4's sliding and full layers),
each geometry gets a storage layer of its own and they all view one **page**
(:func:`plan_storage`): a page is as large as its widest view (the most KV heads, the widest
keys, the widest values), each view its first heads and features, so the memory of a block
still serves whichever group holds it.

Where a page is wider than a narrower kind's layers by a whole factor (Gemma 4's sliding
layers have half the head size of its full ones), the page holds several of them side by side
(**packed views**): a view at an offset of heads or features, each layer's K/V written into
its own part of every row of the page (:class:`ViewPlace`). A group of such a kind then has
that factor times as many layers as a group of the widest kind, over the same pages
(:func:`plan_groups`), so its blocks take no padding. Packing is chosen only where it takes
fewer pages per block than one layer a page (the last group of a kind may fill its pages only
partly).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvcache_core.contract.scalars import (
    INT32_MAX,
    IntLike,
    as_integer,
    check_count,
    check_flag,
    check_optional_count,
    shown,
)
from kvcache_core.contract.states import StateSpec
from kvcache_core.errors import InvalidConfigError, LayerIndexError

__all__ = [
    "KvGroup",
    "LayerGeometry",
    "LayerSpec",
    "StorageLayers",
    "ViewPlace",
    "check_group",
    "first_visible_block",
    "group_serves_layer",
    "layer_slot",
    "plan_groups",
    "plan_storage",
    "token_bytes",
    "view_folds",
    "widest_geometry",
]


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """The shape of one layer's K/V: ``num_heads`` KV heads, keys ``head_dim`` wide, values
    ``value_width`` wide (:meth:`CacheConfig.layer_geometry`)."""

    num_heads: int
    head_dim: int
    value_width: int

    def __str__(self) -> str:
        values = "" if self.value_width == self.head_dim else f", values of {self.value_width}"
        return f"{self.num_heads} heads of {self.head_dim}{values}"


def token_bytes(shape: LayerGeometry, element_bytes: int, scale_bytes: int = 0) -> int:
    """Bytes one token of a layer of ``shape`` takes: keys and values of every KV head
    (``element_bytes`` each), and each head's two scales (``scale_bytes`` each) in a
    quantized pool."""
    return shape.num_heads * ((shape.head_dim + shape.value_width) * element_bytes + 2 * scale_bytes)


#: The geometry fields of :class:`LayerSpec`, in order.
GEOMETRY_FIELDS = ("num_heads", "head_dim", "value_head_dim")


@dataclass(frozen=True, slots=True, init=False)
class LayerSpec:
    """What one layer keeps: its K/V, its recurrent state, both, or nothing.

    A layer's attention is full (the default), a sliding window ``W`` (each query sees its
    last ``W`` positions, itself included) or chunked local attention ``C`` (a query at
    ``p`` sees the positions of its chunk, ``C * (p // C)`` to ``p``). With ``state`` it also
    keeps a recurrent state (:mod:`kvcache_core.contract.states`); ``keeps_kv`` says whether
    it keeps K/V besides:

    - ``LayerSpec()``, ``LayerSpec(window=W)``, ``LayerSpec(chunk=C)``: K/V only;
    - ``LayerSpec(state=S)``: a state only (a Mamba or linear-attention layer);
    - ``LayerSpec(state=S, keeps_kv=True)`` (with a window or chunk if its attention has
      one): K/V *and* a state in one layer (Falcon-H1's and Zamba2's hybrid layers, which
      run a Mamba mixer and attention side by side); its K/V join the KV-cache group of
      its window like any attention layer's, its state takes a place in the state pool;
    - ``LayerSpec(keeps_kv=False)``: nothing (an MLP or mixture-of-experts layer of a
      hybrid stack, Nemotron-H's): it joins no group and holds no state.

    ``keeps_kv`` defaults to ``state is None`` and is stored resolved, as a ``bool`` (NumPy's
    bool is accepted); ``window`` and ``chunk`` are stored as ``int`` (NumPy integers are
    accepted) and span at most ``INT32_MAX`` positions (page tables and kernels hold
    positions in int32).

    ``num_heads``, ``head_dim`` and ``value_head_dim`` give an attention layer a geometry of
    its own (KV heads, key width, value width), each ``None`` for the pool's
    (:meth:`CacheConfig.layer_geometry` resolves them: a layer's values are as wide as the
    pool's ``value_head_dim``, else as its own keys). Backends claiming ``"layer_geometry"``
    hold such pools.

    Raises:
        InvalidConfigError: a window, chunk, head count or width that is not an int in
            ``[1, INT32_MAX]``, or window and chunk both set; a ``state`` that is not a
            :class:`StateSpec`; a ``keeps_kv`` that is not a bool (nor ``None``); a window,
            chunk or geometry on a layer keeping no K/V.
    """

    window: int | None = None
    chunk: int | None = None
    state: StateSpec | None = None
    keeps_kv: bool = True
    num_heads: int | None = None
    head_dim: int | None = None
    value_head_dim: int | None = None

    def __init__(
        self,
        window: IntLike | None = None,
        chunk: IntLike | None = None,
        state: StateSpec | None = None,
        keeps_kv: bool | np.bool_ | None = None,
        *,
        num_heads: IntLike | None = None,
        head_dim: IntLike | None = None,
        value_head_dim: IntLike | None = None,
    ) -> None:
        # Written out so that NumPy integers type-check; stored as ints.
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "chunk", chunk)
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "keeps_kv", keeps_kv)
        object.__setattr__(self, "num_heads", num_heads)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "value_head_dim", value_head_dim)
        self.__post_init__()

    def __post_init__(self) -> None:
        for name in ("window", "chunk", *GEOMETRY_FIELDS):
            value = check_optional_count(
                getattr(self, name), f"LayerSpec.{name}", 1, INT32_MAX, error=InvalidConfigError
            )
            object.__setattr__(self, name, value)
        if self.window is not None and self.chunk is not None:
            raise InvalidConfigError(
                f"LayerSpec has window={self.window} and chunk={self.chunk}: a layer is full, sliding or chunked"
            )
        if self.state is not None and not isinstance(self.state, StateSpec):
            raise InvalidConfigError(f"LayerSpec.state must be a StateSpec or None, got {shown(self.state)}")
        given: object = self.keeps_kv
        keeps_kv = (
            self.state is None if given is None else check_flag(given, "LayerSpec.keeps_kv", error=InvalidConfigError)
        )
        object.__setattr__(self, "keeps_kv", keeps_kv)
        held = "a state only" if self.state is not None else "nothing"
        if not keeps_kv and (self.window is not None or self.chunk is not None):
            raise InvalidConfigError(
                f"LayerSpec has window={self.window} chunk={self.chunk} on a layer keeping {held} (keeps_kv=False): "
                "a window or chunk is for a layer with K/V; a state layer without K/V has no window or chunk "
                "(keeps_kv=True keeps K/V and a state in one layer)"
            )
        if not keeps_kv and self.has_geometry:
            raise InvalidConfigError(
                f"LayerSpec keeping {held} (keeps_kv=False) is a layer without window or chunk (nor K/V geometry), "
                f"got num_heads={self.num_heads} head_dim={self.head_dim} value_head_dim={self.value_head_dim}; "
                "keeps_kv=True keeps K/V of that geometry and a state in one layer"
            )

    @property
    def keeps_state(self) -> bool:
        """Whether the layer keeps a recurrent state (:attr:`state` is set)."""
        return self.state is not None

    @property
    def has_geometry(self) -> bool:
        """Whether the layer sets any of ``num_heads``, ``head_dim``, ``value_head_dim``."""
        return self.num_heads is not None or self.head_dim is not None or self.value_head_dim is not None

    @property
    def kind(self) -> str:
        """``"full"``, ``"sliding"`` or ``"chunked"`` for a layer keeping K/V, with ``"+state"``
        after it when it keeps a state too; ``"state"`` for a state only; ``"none"`` for a
        layer keeping nothing."""
        if not self.keeps_kv:
            return "state" if self.state is not None else "none"
        attention = "sliding" if self.window is not None else "chunked" if self.chunk is not None else "full"
        return attention if self.state is None else f"{attention}+state"


@dataclass(frozen=True, slots=True)
class KvGroup:
    """One KV-cache group: layers that keep the same blocks of every request.

    Attributes:
        index: the group's number (groups are numbered by their first layer).
        window: the sliding window its layers share, ``None`` for full or chunked layers
            (those keep every block).
        layers: its model layers, ascending; layer ``layers[i]`` lives in page ``i // views``
            of every block the group holds (:attr:`StorageLayers.places` names its storage layer).
        views: how many of its layers one page holds side by side (1: a layer a page; more
            for a kind packed into a wider page, see the module).
    """

    index: int
    window: int | None
    layers: tuple[int, ...]
    views: int = 1


def plan_groups(
    num_layers: int,
    specs: tuple[LayerSpec, ...] | None,
    sliding_window: int | None,
    geometry: tuple[LayerGeometry, ...] | None = None,
) -> tuple[KvGroup, ...]:
    """The KV-cache groups of a pool (see the module docstring): without packing, every group
    has the greatest common divisor of the kinds' layer counts; with ``geometry`` (per layer)
    where packing takes fewer pages (:func:`view_folds`), each group of a kind holds its
    fold times the pages' count of layers.

    Raises:
        InvalidConfigError: ``specs`` not one :class:`LayerSpec` per layer.
    """
    if specs is None:
        return (KvGroup(0, sliding_window, tuple(range(num_layers))),)
    if len(specs) != num_layers:
        raise InvalidConfigError(
            f"CacheConfig.layer_specs names {len(specs)} layers, the pool has num_layers={num_layers}: "
            "give one LayerSpec per layer"
        )
    by_window: dict[int | None, list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec.keeps_kv:  # layers keeping a state only, or nothing, keep no blocks (contract/states.py)
            by_window.setdefault(spec.window, []).append(layer)
    if not by_window:  # no layer keeps K/V: one group of none still counts each request's tokens
        return (KvGroup(0, None, ()),)
    folds = dict.fromkeys(by_window, 1)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    if geometry is not None:
        packed = _packed_pages(by_window, geometry)
        if packed is not None:
            size, folds = packed
    chunks = [
        (window, tuple(layers[start : start + size * folds[window]]), folds[window])
        for window, layers in by_window.items()
        for start in range(0, len(layers), size * folds[window])
    ]
    chunks.sort(key=lambda chunk: chunk[1][0])
    return tuple(KvGroup(index, window, layers, views) for index, (window, layers, views) in enumerate(chunks))


def view_folds(shape: LayerGeometry, page: LayerGeometry) -> tuple[int, int]:
    """``(along heads, along features)``: how many views of ``shape`` a page of ``page``
    holds side by side without overlap (``(1, 1)`` where ``shape`` does not fit)."""
    if shape.num_heads > page.num_heads or shape.head_dim > page.head_dim or shape.value_width > page.value_width:
        return 1, 1
    features = min(page.head_dim // shape.head_dim, page.value_width // shape.value_width)
    return page.num_heads // shape.num_heads, features


def widest_geometry(given: Iterable[LayerGeometry]) -> LayerGeometry:
    """The geometry holding each of ``given``: the most KV heads, the widest keys and values."""
    shapes = list(given)
    return LayerGeometry(
        max(shape.num_heads for shape in shapes),
        max(shape.head_dim for shape in shapes),
        max(shape.value_width for shape in shapes),
    )


def _packed_pages(
    by_window: dict[int | None, list[int]], geometry: tuple[LayerGeometry, ...]
) -> tuple[int, dict[int | None, int]] | None:
    """``(pages per group, layers per page of each kind)`` where packing the narrower kinds
    into pages of the widest geometry takes fewer pages per block than a layer a page; ``None``
    otherwise. A kind packs when its layers share one geometry; the pages per group are the
    largest divisor of the unpacked kinds' greatest common divisor (of the packed kinds' page
    counts where every kind packs) that leaves no group partly filled, else that divisor."""
    page = widest_geometry(geometry[layer] for layers in by_window.values() for layer in layers)
    folds: dict[int | None, int] = {}
    for window, layers in by_window.items():
        shapes = {geometry[layer] for layer in layers}
        along_heads, along_features = view_folds(shapes.pop(), page) if len(shapes) == 1 else (1, 1)
        folds[window] = along_heads * along_features
    if all(fold == 1 for fold in folds.values()):
        return None
    counts = {window: len(layers) for window, layers in by_window.items()}
    plain = [count for window, count in counts.items() if folds[window] == 1]
    base = math.gcd(*plain) if plain else math.gcd(*(-(-count // folds[window]) for window, count in counts.items()))
    divisors = [pages for pages in range(base, 0, -1) if base % pages == 0]
    size = next(
        (pages for pages in divisors if all(count % (pages * folds[window]) == 0 for window, count in counts.items())),
        base,
    )
    used = sum(-(-count // (size * folds[window])) * size for window, count in counts.items())
    return (size, folds) if used < sum(counts.values()) else None


@dataclass(frozen=True, slots=True)
class ViewPlace:
    """Where a storage layer's view lies in its page: its first KV head, first key feature and
    first value feature (all 0 for a view of the page's first heads and features)."""

    head: int = 0
    key: int = 0
    value: int = 0

    def __post_init__(self) -> None:
        for name in ("head", "key", "value"):  # an offset past the page's start: ints >= 0, stored as int
            value = check_count(getattr(self, name), f"ViewPlace.{name}", 0, INT32_MAX, error=InvalidConfigError)
            object.__setattr__(self, name, value)

    @property
    def origin(self) -> bool:
        """Whether the view starts at the page's first head and features."""
        return self.head == 0 and self.key == 0 and self.value == 0

    def reach(self, shape: LayerGeometry) -> LayerGeometry:
        """How far a view of ``shape`` at this place reaches into its page, from its origin."""
        return LayerGeometry(self.head + shape.num_heads, self.key + shape.head_dim, self.value + shape.value_width)


@dataclass(frozen=True, slots=True)
class StorageLayers:
    """Where each model layer's K/V live in the storage (:func:`plan_storage`).

    Attributes:
        places: per model layer, ``(group, storage layer)``; ``(-1, -1)`` for a layer keeping
            no K/V.
        geometry: per storage layer, its geometry.
        pages: per storage layer, the page whose memory it views (its place in the groups);
            storage layers of one page share the memory of every block.
        page_geometry: per page, the geometry holding each of its views: the most KV heads,
            the widest keys and the widest values among its storage layers (each from its
            offset).
        offsets: per storage layer, where its view lies in its page (empty: every view at
            the page's origin).
    """

    places: tuple[tuple[int, int], ...]
    geometry: tuple[LayerGeometry, ...]
    pages: tuple[int, ...]
    page_geometry: tuple[LayerGeometry, ...]
    offsets: tuple[ViewPlace, ...] = ()

    @property
    def shares_pages(self) -> bool:
        """Whether some page holds several storage layers (of several geometries, or packed)."""
        return len(self.pages) != len(self.page_geometry)

    @property
    def packs_views(self) -> bool:
        """Whether some page holds views side by side (a storage layer off the page's origin)."""
        return any(not place.origin for place in self.offsets)

    def view_place(self, row: int) -> ViewPlace:
        """Where storage layer ``row``'s view lies in its page."""
        return self.offsets[row] if self.offsets else ViewPlace()

    def group_rows(self, group: KvGroup) -> tuple[int, ...]:
        """The storage layers of ``group``'s layers, in its layer order."""
        return tuple(self.places[layer][1] for layer in group.layers)

    def layer_bytes_per_token(self, group: KvGroup, element_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes one token of ``group``'s layers takes at their own geometry (:func:`token_bytes`
        of their storage layers): what its pages hold less their padding."""
        return sum(token_bytes(self.geometry[row], element_bytes, scale_bytes) for row in self.group_rows(group))


def plan_storage(groups: tuple[KvGroup, ...], num_layers: int, geometry: tuple[LayerGeometry, ...]) -> StorageLayers:
    """The storage layers of a pool: the ``i``-th layer of a group lives in page ``i //
    views`` (:attr:`KvGroup.views`), in the storage layer of its geometry and place there (one
    storage layer per page when every group's ``i``-th layer has one geometry and no page
    packs views: storage layer ``i``). A packed group's views of a page lie side by side,
    along the features where the page is wider (:func:`view_folds`), then along its heads."""
    places = [(-1, -1)] * num_layers
    shapes: list[tuple[LayerGeometry, ViewPlace]] = []
    pages: list[int] = []
    page_geometry: list[LayerGeometry] = []
    packed = any(group.views > 1 for group in groups)
    widest = widest_geometry(geometry[layer] for group in groups for layer in group.layers) if packed else None
    count = max(-(-len(group.layers) // group.views) for group in groups)
    for page in range(count):
        first = len(shapes)
        for group in groups:
            for view in range(group.views):
                index = page * group.views + view
                if index >= len(group.layers):
                    break
                layer = group.layers[index]
                shape = geometry[layer]
                place = ViewPlace()
                if widest is not None and group.views > 1:
                    features = view_folds(shape, widest)[1]
                    across, along = divmod(view, features)
                    place = ViewPlace(across * shape.num_heads, along * shape.head_dim, along * shape.value_width)
                if (shape, place) not in shapes[first:]:
                    shapes.append((shape, place))
                    pages.append(page)
                places[layer] = (group.index, first + shapes[first:].index((shape, place)))
        page_geometry.append(widest_geometry(place.reach(view) for view, place in shapes[first:]))
    return StorageLayers(
        tuple(places),
        tuple(shape for shape, _ in shapes),
        tuple(pages),
        tuple(page_geometry),
        tuple(place for _, place in shapes),
    )


def first_visible_block(window: int | None, length: int, block_size: int) -> int:
    """The first logical block the token at position ``length`` sees through a sliding
    ``window`` (0 without one): the blocks before it are the ones a sliding group releases."""
    if window is None or length < window:
        return 0
    return (length - window + 1) // block_size


def group_serves_layer(kept_window: int | None, spec: LayerSpec) -> bool:
    """Whether a KV-cache group that keeps the last ``kept_window`` positions of each request
    (``None``: every position) holds every position a layer of ``spec`` attends to: a group
    keeping every position serves any layer, one keeping ``W`` only a sliding layer whose
    window is at most ``W`` (a full or chunked layer needs every position)."""
    return kept_window is None or (spec.window is not None and spec.window <= kept_window)


def layer_slot(groups: tuple[KvGroup, ...], num_layers: int) -> tuple[tuple[int, int], ...]:
    """Per model layer: ``(group, storage layer)``; ``(-1, -1)`` for a layer keeping no K/V."""
    where = [(-1, -1)] * num_layers
    for group in groups:
        for slot, layer in enumerate(group.layers):
            where[layer] = (group.index, slot)
    return tuple(where)


def check_group(group: object, count: int) -> int:
    """``group`` as an int in ``[0, count)``.

    Raises:
        LayerIndexError: anything else; the message names the value and the range.
    """
    index = as_integer(group)
    if index is None or not 0 <= index < count:
        raise LayerIndexError(f"KV-cache group {shown(group)} is out of range: valid groups are 0 to {count - 1}")
    return index
