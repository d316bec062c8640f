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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvcache_core.contract.scalars import INT32_MAX, IntLike, as_integer, check_flag, check_optional_count, shown
from kvcache_core.contract.states import StateSpec
from kvcache_core.errors import InvalidConfigError, LayerIndexError

__all__ = [
    "KvGroup",
    "LayerGeometry",
    "LayerSpec",
    "StorageLayers",
    "check_group",
    "first_visible_block",
    "group_serves_layer",
    "layer_slot",
    "plan_groups",
    "plan_storage",
    "token_bytes",
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
        layers: its model layers, ascending; layer ``layers[i]`` lives in the storage's
            layer ``i``.
    """

    index: int
    window: int | None
    layers: tuple[int, ...]


def plan_groups(
    num_layers: int, specs: tuple[LayerSpec, ...] | None, sliding_window: int | None
) -> tuple[KvGroup, ...]:
    """The KV-cache groups of a pool (see the module docstring).

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
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    chunks = [
        (window, tuple(layers[start : start + size]))
        for window, layers in by_window.items()
        for start in range(0, len(layers), size)
    ]
    chunks.sort(key=lambda chunk: chunk[1][0])
    return tuple(KvGroup(index, window, layers) for index, (window, layers) in enumerate(chunks))


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
            the widest keys and the widest values among its storage layers.
    """

    places: tuple[tuple[int, int], ...]
    geometry: tuple[LayerGeometry, ...]
    pages: tuple[int, ...]
    page_geometry: tuple[LayerGeometry, ...]

    @property
    def shares_pages(self) -> bool:
        """Whether some page holds storage layers of several geometries."""
        return len(self.pages) != len(self.page_geometry)

    def group_rows(self, group: KvGroup) -> tuple[int, ...]:
        """The storage layers of ``group``'s layers, in its layer order."""
        return tuple(self.places[layer][1] for layer in group.layers)

    def layer_bytes_per_token(self, group: KvGroup, element_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes one token of ``group``'s layers takes at their own geometry (:func:`token_bytes`
        of their storage layers): what its pages hold less their padding."""
        return sum(token_bytes(self.geometry[row], element_bytes, scale_bytes) for row in self.group_rows(group))


def plan_storage(groups: tuple[KvGroup, ...], num_layers: int, geometry: tuple[LayerGeometry, ...]) -> StorageLayers:
    """The storage layers of a pool: the ``i``-th layer of every group lives in page ``i``,
    in the storage layer of its geometry there (one storage layer per page when every group's
    ``i``-th layer has one geometry: storage layer ``i``)."""
    places = [(-1, -1)] * num_layers
    shapes: list[LayerGeometry] = []
    pages: list[int] = []
    page_geometry: list[LayerGeometry] = []
    for page in range(len(groups[0].layers)):
        first = len(shapes)
        for group in groups:
            layer = group.layers[page]
            shape = geometry[layer]
            if shape not in shapes[first:]:
                shapes.append(shape)
                pages.append(page)
            places[layer] = (group.index, first + shapes[first:].index(shape))
        views = shapes[first:]
        page_geometry.append(
            LayerGeometry(
                max(view.num_heads for view in views),
                max(view.head_dim for view in views),
                max(view.value_width for view in views),
            )
        )
    return StorageLayers(tuple(places), tuple(shapes), tuple(pages), tuple(page_geometry))


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
