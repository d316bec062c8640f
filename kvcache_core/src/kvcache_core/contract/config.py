"""The value that configures a cache: :class:`CacheConfig` (a request's ask,
:class:`AllocationRequest`, lives in :mod:`kvcache_core.contract.request` and is re-exported here)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.device import Device
from kvcache_core.contract.groups import KvGroup, LayerGeometry, LayerSpec, StorageLayers, plan_groups, plan_storage
from kvcache_core.contract.request import MAX_TOKEN_ID, AllocationRequest, check_token_ids, store_fields
from kvcache_core.contract.scalars import (
    FLOAT32_MAX,
    INT32_MAX,
    IntLike,
    RealLike,
    as_integer,
    check_count,
    check_flag,
    check_positive_float32,
    check_real,
    shown,
)
from kvcache_core.contract.states import StatePool, not_kv_layer
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError, LayerIndexError, UnsupportedConfigError

__all__ = [
    "ATTENTION_PATHS",
    "DTYPE_SIZES",
    "KV_LAYOUTS",
    "LAYOUT_AXES",
    "MAX_KV_SCALE",
    "MAX_POOL_SLOTS",
    "MAX_TOKEN_ID",
    "QUANTIZED_DTYPES",
    "QUANTIZED_RANGE",
    "AllocationRequest",
    "CacheConfig",
    "check_count",
    "check_token_ids",
]

#: Bytes per element of every dtype name a backend may claim. Each backend holds only the
#: dtypes it lists in ``BackendSpec.dtypes``: NumPy has no bfloat16, so the built-in ``numpy``
#: backend holds float16, float32 and float64; ``torch`` and ``jax`` hold float32, float16 and
#: bfloat16 (host copies of blocks are in one form per dtype on every backend, bfloat16 as
#: its bit patterns: :mod:`kvcache_core.offload.host_form`).
DTYPE_SIZES: Final[dict[str, int]] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "float8_e4m3fn": 1,
}

#: Pool dtypes that hold K/V quantized, with scales beside their blocks
#: (:mod:`kvcache_core.contract.quantization`): ``"int8"`` (symmetric, one scale per token per KV
#: head) and ``"float8_e4m3fn"`` (one scale per KV head per layer).
QUANTIZED_DTYPES: Final[tuple[str, ...]] = ("int8", "float8_e4m3fn")

#: The largest magnitude each quantized dtype holds: ``raw`` spans ``[-range, range]``.
QUANTIZED_RANGE: Final[dict[str, float]] = {"int8": 127.0, "float8_e4m3fn": 448.0}

#: The largest calibrated float8 scale (``CacheConfig.kv_scales``): ``448 * scale``, the
#: largest value it decodes to, stays a finite float32.
MAX_KV_SCALE: Final = FLOAT32_MAX / QUANTIZED_RANGE["float8_e4m3fn"]

#: The compute dtypes a quantized pool may take: what ``write`` takes and attention returns.
COMPUTE_DTYPES: Final[tuple[str, ...]] = ("float32", "float16", "bfloat16")

#: Bytes of the scale kept per token per KV head (K and V each) in a quantized pool: float32.
SCALE_BYTES: Final = 4

#: Pool layouts. ``"NHD"`` is ``[num_blocks, block_size, num_heads, head_dim]`` (vLLM,
#: FlashInfer); ``"HND"`` is ``[num_blocks, num_heads, block_size, head_dim]``;
#: ``"heads_first"`` is ``[num_heads, num_blocks, block_size, head_dim]`` (JAX Pallas).
KV_LAYOUTS: Final[tuple[str, ...]] = ("NHD", "HND", "heads_first")
#: The axes of (block, token in block, head) of a pool in each layout.
LAYOUT_AXES: Final = {"NHD": (0, 1, 2), "HND": (0, 2, 1), "heads_first": (1, 2, 0)}

#: The values of :attr:`CacheConfig.attention_path`: the measured choice, the compiled kernel,
#: the array library's own path (:mod:`kvcache_core.backends.dispatch`).
ATTENTION_PATHS: Final[tuple[str, ...]] = ("auto", "kernel", "native")

#: The most slots (``num_blocks * block_size``) a pool may have: page tables are int32.
MAX_POOL_SLOTS: Final = INT32_MAX


def _plain_str(value: object) -> object:
    """A ``str`` subclass (NumPy's ``str_``) as a plain ``str``; anything else unchanged."""
    return str(value) if isinstance(value, str) else value


@dataclass(frozen=True, slots=True, init=False)
class CacheConfig:
    """Geometry and policy of one paged pool.

    Attributes:
        num_layers: transformer layers cached (>= 1).
        num_heads: KV heads per layer (>= 1); query heads may be a multiple (GQA).
        head_dim: features per head (>= 1).
        num_blocks: blocks in the pool (>= 1).
        block_size: tokens per block (>= 1), 16 by default.
        dtype: element type of the pool, a key of :data:`DTYPE_SIZES`; one of
            :data:`QUANTIZED_DTYPES` for a quantized pool (its scales live beside its blocks).
        device: where the pool lives; a :class:`Device` or its text (``"cuda:0"``).
        kv_layout: pool layout, one of :data:`KV_LAYOUTS`, or ``None`` (the default): the
            layout the backend runs fastest, which :func:`~kvcache_core.create_manager` (or
            the backend's storage) resolves; the manager's ``config`` shows the result.
        enable_prefix_caching: share full prompt blocks between requests: ``allocate`` maps
            the cached full blocks of ``AllocationRequest.prompt_token_ids``; blocks whose
            K/V are written stay cached after their requests end, until evicted.
        sliding_window: ``W``, the tokens each query attends to (its last ``W``, itself
            included), or ``None`` for all; blocks wholly older than the window are released
            as a request grows.
        medium_pressure_threshold, high_pressure_threshold, critical_pressure_threshold:
            fractions of the pool in use at which :class:`MemoryPressure` rises;
            ``0 < medium < high < critical <= 1``.
        model_id: the namespace of this pool's K/V (the model's name and revision, or a
            fingerprint of its config, dtype and layer specs), or ``None`` for none. It
            enters the root of every prefix-cache hash chain, so blocks cached, saved or
            published under one namespace never map into a pool of another.
        compute_dtype: dtype of the K/V ``write`` takes, of queries and of attention
            outputs, one of :data:`COMPUTE_DTYPES`; only a quantized pool may differ from
            :attr:`dtype`. ``None`` (the default): the pool's own dtype, or float32 for a
            quantized pool. :attr:`io_dtype` is the resolved name.
        layer_specs: what every layer keeps (``[num_layers]`` :class:`LayerSpec`: K/V of
            full, sliding window ``W`` or chunked ``C`` attention, a recurrent state, both, or
            nothing), or ``None``: every layer full, or
            sliding with :attr:`sliding_window`. Layers that keep the same blocks form
            KV-cache groups (:attr:`kv_groups`, see :mod:`kvcache_core.contract.groups`), each with
            its own block table per request over the one pool. Stored as a tuple.
        kv_scales: calibrated float8 scales, ``[num_layers][2][num_heads]`` (K then V, one
            per KV head), as vLLM's checkpoints carry, each a normal float32 from
            ``FLOAT32_TINY`` to :data:`MAX_KV_SCALE` (backends decode in float32); only for
            ``dtype="float8_e4m3fn"``. ``None``: each scale tracks the running maximum (see
            :mod:`kvcache_core.contract.quantization`). Stored as nested tuples of floats.
        state_slots: with state layers (``LayerSpec(state=...)``), requests the state pool holds
            at once (:mod:`kvcache_core.contract.states`); ``None``: ``min(num_blocks, 32)``.
        value_head_dim: the values' features per head (>= 1) where they differ from the keys' (latent
            attention's rotary part, ``v_head_dim``); ``None`` or :attr:`head_dim` (stored as ``None``): as
            wide. :attr:`value_width` resolves it; backends claiming ``"value_head_dim"`` hold such pools.
        attention_path: the backend's attention path (:mod:`kvcache_core.backends.dispatch`): ``"auto"``, the
            faster on this machine per shape of batch, measured once and kept on disk (``KVCACHE_ATTENTION_PATH``
            pins one per process); ``"kernel"``, the compiled kernel; ``"native"``, the array library's own.
            Not part of the pool's identity (configs differing only here compare equal).

    ``num_heads``, ``head_dim`` and ``value_head_dim`` are the pool's geometry; a layer of
    :attr:`layer_specs` may hold its own (``LayerSpec(num_heads=..., head_dim=...)``:
    :meth:`layer_geometry`, :attr:`mixed_geometry`), on backends claiming ``"layer_geometry"``.

    Every field is stored as a plain Python value (NumPy integers, floats and strings
    are accepted and converted; a bool is refused where a number is meant). Counts and
    windows span at most ``INT32_MAX`` (page tables and kernels index in int32).

    Raises:
        InvalidConfigError: any field out of its range; the message names it and the
            valid range.
        UnsupportedConfigError: layers of their own geometry in a quantized pool.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: str = "float32"
    device: Device = field(default_factory=Device)
    kv_layout: str | None = None
    enable_prefix_caching: bool = False
    sliding_window: int | None = None
    medium_pressure_threshold: float = 0.6
    high_pressure_threshold: float = 0.8
    critical_pressure_threshold: float = 0.95
    model_id: str | None = None
    compute_dtype: str | None = None
    kv_scales: tuple[tuple[tuple[float, ...], ...], ...] | None = None
    layer_specs: tuple[LayerSpec, ...] | None = None
    state_slots: int | None = None
    value_head_dim: int | None = None
    attention_path: str = field(default="auto", compare=False)
    _groups: tuple[KvGroup, ...] = field(default=(), init=False, repr=False, compare=False)
    _slots: tuple[tuple[int, int], ...] = field(default=(), init=False, repr=False, compare=False)
    _specs: tuple[LayerSpec, ...] = field(default=(), init=False, repr=False, compare=False)
    _states: StatePool = field(default=StatePool(), init=False, repr=False, compare=False)
    _geometry: tuple[LayerGeometry, ...] = field(default=(), init=False, repr=False, compare=False)
    _storage: StorageLayers = field(default=StorageLayers((), (), (), ()), init=False, repr=False, compare=False)

    def __init__(
        self,
        num_layers: IntLike,
        num_heads: IntLike,
        head_dim: IntLike,
        num_blocks: IntLike,
        block_size: IntLike = 16,
        dtype: str = "float32",
        device: Device | str = "cpu",
        kv_layout: str | None = None,
        enable_prefix_caching: bool | np.bool_ = False,
        sliding_window: IntLike | None = None,
        medium_pressure_threshold: RealLike = 0.6,
        high_pressure_threshold: RealLike = 0.8,
        critical_pressure_threshold: RealLike = 0.95,
        model_id: str | None = None,
        compute_dtype: str | None = None,
        kv_scales: object = None,
        layer_specs: object = None,
        state_slots: IntLike | None = None,
        value_head_dim: IntLike | None = None,
        attention_path: str = "auto",
    ) -> None:
        # Written out so that ``device`` accepts its text form ("cuda:0") and is stored as
        # a Device; the dataclass still provides eq, repr, hash and replace().
        store_fields(self, locals())

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "num_blocks", "block_size"):
            count = check_count(getattr(self, name), f"CacheConfig.{name}", 1, INT32_MAX, error=InvalidConfigError)
            object.__setattr__(self, name, count)
        if self.value_head_dim is not None:  # stored as None when equal to head_dim
            dim = check_count(self.value_head_dim, "CacheConfig.value_head_dim", 1, INT32_MAX, error=InvalidConfigError)
            object.__setattr__(self, "value_head_dim", None if dim == self.head_dim else dim)
        for name in ("dtype", "kv_layout", "model_id", "compute_dtype"):
            object.__setattr__(self, name, _plain_str(getattr(self, name)))
        if self.num_blocks * self.block_size > MAX_POOL_SLOTS:
            raise InvalidConfigError(
                f"CacheConfig has {self.num_blocks} blocks of {self.block_size} tokens = "
                f"{self.num_blocks * self.block_size} slots; page tables address at most {MAX_POOL_SLOTS}"
            )
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise InvalidConfigError(
                f"CacheConfig.dtype {shown(self.dtype)} is unknown; valid: {', '.join(DTYPE_SIZES)}"
            )
        self._check_quantization()
        try:
            object.__setattr__(self, "device", Device.parse(self.device))
        except InvalidArgumentError as exc:
            raise InvalidConfigError(f"CacheConfig.device: {exc}") from exc
        if self.kv_layout is not None and (not isinstance(self.kv_layout, str) or self.kv_layout not in KV_LAYOUTS):
            raise InvalidConfigError(
                f"CacheConfig.kv_layout {shown(self.kv_layout)} is unknown; valid: {', '.join(KV_LAYOUTS)} "
                "or None (the backend's preferred layout)"
            )
        flag = check_flag(self.enable_prefix_caching, "CacheConfig.enable_prefix_caching", error=InvalidConfigError)
        object.__setattr__(self, "enable_prefix_caching", flag)
        if self.sliding_window is not None:
            window = check_count(
                self.sliding_window, "CacheConfig.sliding_window", 1, INT32_MAX, error=InvalidConfigError
            )
            object.__setattr__(self, "sliding_window", window)
        self._check_layer_specs()
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise InvalidConfigError(
                f"CacheConfig.model_id must be a non-empty str or None, got {shown(self.model_id)}"
            )
        self._check_thresholds()
        if not isinstance(self.attention_path, str) or self.attention_path not in ATTENTION_PATHS:
            raise InvalidConfigError(
                f"CacheConfig.attention_path {shown(self.attention_path)} is unknown; valid: {', '.join(ATTENTION_PATHS)}"
            )
        object.__setattr__(self, "attention_path", str(self.attention_path))

    def _check_thresholds(self) -> None:
        """Validate the pressure thresholds and store them as floats."""
        names = ("medium_pressure_threshold", "high_pressure_threshold", "critical_pressure_threshold")
        given = [getattr(self, name) for name in names]
        message = (
            "pressure thresholds must be numbers with 0 < medium < high < critical <= 1, got "
            f"medium={shown(given[0])}, high={shown(given[1])}, critical={shown(given[2])}"
        )
        try:
            medium, high, critical = (
                check_real(value, f"CacheConfig.{name}") for value, name in zip(given, names, strict=True)
            )
        except InvalidArgumentError as exc:
            raise InvalidConfigError(message) from exc
        if not 0.0 < medium < high < critical <= 1.0:
            raise InvalidConfigError(message)
        for name, value in zip(names, (medium, high, critical), strict=True):
            object.__setattr__(self, name, value)

    def _check_layer_specs(self) -> None:
        """Validate ``layer_specs`` and work out the KV-cache groups."""
        specs = self.layer_specs
        if specs is not None:
            if isinstance(specs, (str, bytes)) or not isinstance(specs, Iterable):
                raise InvalidConfigError(
                    f"CacheConfig.layer_specs must be a sequence of LayerSpec (one per layer) or None, got {shown(specs)}"
                )
            items = tuple(cast("Iterable[object]", specs))
            for layer, spec in enumerate(items):
                if not isinstance(spec, LayerSpec):
                    raise InvalidConfigError(f"CacheConfig.layer_specs[{layer}] must be a LayerSpec, got {shown(spec)}")
            if self.sliding_window is not None:
                raise InvalidConfigError(
                    f"CacheConfig has sliding_window={self.sliding_window} and layer_specs: give each sliding "
                    "layer its window in layer_specs (sliding_window means every layer)"
                )
            specs = cast("tuple[LayerSpec, ...]", items)
            object.__setattr__(self, "layer_specs", specs)
        object.__setattr__(self, "_specs", specs or (LayerSpec(window=self.sliding_window),) * self.num_layers)
        object.__setattr__(self, "_states", StatePool.of(self._specs, self.state_slots, self.num_blocks))
        object.__setattr__(self, "state_slots", None if self.state_slots is None else self._states.num_slots)
        self._check_layer_geometry(specs)

    def _check_layer_geometry(self, specs: tuple[LayerSpec, ...] | None) -> None:
        """Resolve every layer's geometry and plan the KV-cache groups and storage layers;
        refuse mixed geometry where the pool cannot hold it."""
        values = self.value_head_dim
        geometry = tuple(
            LayerGeometry(
                spec.num_heads or self.num_heads,
                spec.head_dim or self.head_dim,
                spec.value_head_dim or values or spec.head_dim or self.head_dim,
            )
            for spec in self._specs
        )
        object.__setattr__(self, "_geometry", geometry)
        object.__setattr__(self, "_groups", plan_groups(self.num_layers, specs, self.sliding_window, geometry))
        storage = plan_storage(self._groups, self.num_layers, geometry)
        object.__setattr__(self, "_storage", storage)
        object.__setattr__(self, "_slots", storage.places)
        if self.mixed_geometry and self.quantized:
            raise UnsupportedConfigError(
                f"a {self.dtype} pool holds one geometry for every layer (its scales are per KV head); layers of "
                "their own num_heads, head_dim or value_head_dim need an unquantized pool"
            )

    @property
    def mixed_geometry(self) -> bool:
        """Whether some layer's geometry (:meth:`layer_geometry`) differs from the pool's."""
        pool = LayerGeometry(self.num_heads, self.head_dim, self.value_width)
        return any(shape != pool for spec, shape in zip(self._specs, self._geometry, strict=True) if spec.state is None)

    def refuse_host_copies(self, what: str) -> None:
        """Refuse ``what``, which moves host copies of blocks (swap, tiers, prefix files, host
        writes), in a pool of mixed geometry: the host form holds one geometry for every layer.

        Raises:
            UnsupportedConfigError: naming ``what`` and the layers' geometries.
        """
        if self.mixed_geometry:
            shapes = "; ".join(sorted({str(shape) for shape in self._geometry}))
            raise UnsupportedConfigError(
                f"{what} moves host copies of blocks, whose form holds one geometry for every layer; this pool's "
                f"layers differ ({shapes}: LayerSpec geometry), so it is refused"
            )

    def packed_block_elements(self, part: str = "keys") -> int:
        """Elements of one block's ``"keys"`` or ``"values"`` over every storage layer, each of
        its own geometry: the width of the packed host form of a pool of mixed geometry
        (``[n, elements]``, :class:`~kvcache_core.backends.layered.LayeredStorage`)."""
        built = self.storage_config()
        shapes = [built.layer_geometry(layer) for layer in range(built.num_layers)]
        widths = [shape.value_width if part == "values" else shape.head_dim for shape in shapes]
        return sum(self.block_size * shape.num_heads * width for shape, width in zip(shapes, widths, strict=True))

    def layer_geometry(self, layer: object) -> LayerGeometry:
        """The KV heads, key width and value width of ``layer``: its ``LayerSpec``'s where
        set, else the pool's (a layer's values are as wide as the pool's ``value_head_dim``,
        else as its own keys).

        Raises:
            LayerIndexError: ``layer`` outside ``0 .. num_layers - 1``.
        """
        return self._geometry[self.check_layer(layer)]

    def layer_block_shape(self, layer: object, part: str = "keys") -> tuple[int, ...]:
        """:meth:`block_shape` of ``layer``'s ``"keys"`` or ``"values"`` (its own geometry).

        Raises:
            LayerIndexError: a bad layer. InvalidConfigError: ``kv_layout`` not resolved.
        """
        shape = self.layer_geometry(layer)
        width = shape.value_width if part == "values" else shape.head_dim
        return self._pool_shape(width, shape.num_heads)

    @property
    def kv_groups(self) -> tuple[KvGroup, ...]:
        """The KV-cache groups: one group of every layer without :attr:`layer_specs`."""
        return self._groups

    @property
    def num_groups(self) -> int:
        """How many KV-cache groups (block tables per request) the pool keeps."""
        return len(self._groups)

    @property
    def pool_layers(self) -> int:
        """Layers the storage holds per block: every layer, or a group's layers (at least one),
        one more per further geometry at a group's place (:attr:`storage_layers`)."""
        return max(1, len(self._storage.geometry))

    @property
    def storage_layers(self) -> StorageLayers:
        """Where each layer's K/V live in the storage: storage layers, their geometries and the
        pages they view (:func:`~kvcache_core.contract.groups.plan_storage`)."""
        return self._storage

    @property
    def states(self) -> StatePool:
        """The state pool: its arrays, slots and bytes per slot (empty without state layers)."""
        return self._states

    def layer_spec(self, layer: int) -> LayerSpec:
        """The attention spec of a (checked) layer."""
        return self._specs[layer]

    def layer_place(self, layer: object) -> tuple[int, int]:
        """``(group, storage layer)`` of ``layer``.

        Raises:
            LayerIndexError: ``layer`` outside ``0 .. num_layers - 1``, or a layer keeping
                no K/V (a state only, or nothing).
        """
        index = self.check_layer(layer)
        spec = self._specs[index]
        if not spec.keeps_kv:
            raise not_kv_layer(index, spec.state)
        return self._slots[index]

    def storage_config(self) -> CacheConfig:
        """The config the storage is built from: this one, or with KV-cache groups one of
        :attr:`pool_layers` layers and no specs (the manager maps layers and windows)."""
        if self.layer_specs is None:
            return self
        scales = None
        if self.kv_scales is not None:  # a storage layer serves a layer of every group: the largest scale
            stacked = np.asarray(self.kv_scales)
            per_slot = [
                stacked[[group.layers[slot] for group in self._groups]].max(axis=0) for slot in range(self.pool_layers)
            ]
            scales = tuple(tuple(tuple(float(x) for x in kv) for kv in layer.tolist()) for layer in per_slot)
        slot_specs: tuple[LayerSpec, ...] | None = None
        if self.mixed_geometry:  # each storage layer's geometry
            slot_specs = tuple(
                LayerSpec(num_heads=shape.num_heads, head_dim=shape.head_dim, value_head_dim=shape.value_width)
                for shape in self._storage.geometry
            )
        return dataclasses.replace(
            self, num_layers=self.pool_layers, layer_specs=slot_specs, kv_scales=scales, state_slots=None
        )

    def _check_quantization(self) -> None:
        """Validate ``compute_dtype`` and ``kv_scales`` against ``dtype``."""
        compute = self.compute_dtype
        if self.dtype in QUANTIZED_DTYPES:
            if compute is not None and (not isinstance(compute, str) or compute not in COMPUTE_DTYPES):
                raise InvalidConfigError(
                    f"CacheConfig.compute_dtype {shown(compute)} is not a compute dtype of a {self.dtype} pool; "
                    f"valid: {', '.join(COMPUTE_DTYPES)} (or None for float32)"
                )
        elif compute is not None and compute != self.dtype:
            raise InvalidConfigError(
                f"CacheConfig.compute_dtype {shown(compute)} differs from dtype {self.dtype!r}: only a quantized pool "
                f"({', '.join(QUANTIZED_DTYPES)}) computes in another dtype; pass None or {self.dtype!r}"
            )
        if self.kv_scales is None:
            return
        if self.dtype != "float8_e4m3fn":
            raise InvalidConfigError(
                f"CacheConfig.kv_scales are calibrated float8 scales: only for dtype 'float8_e4m3fn', "
                f"got dtype {self.dtype!r}"
            )
        expected = (self.num_layers, 2, self.num_heads)
        try:  # an object array keeps each element as given: bools and strings are refused below
            leaves: npt.NDArray[Any] = np.asarray(self.kv_scales, dtype=object)
        except (TypeError, ValueError) as exc:
            raise InvalidConfigError(
                f"CacheConfig.kv_scales must be numbers of shape {expected} ([layers][K, V][kv heads]): {exc}"
            ) from exc
        if leaves.shape != expected:
            raise InvalidConfigError(
                f"CacheConfig.kv_scales must have shape {expected} ([layers][K, V][kv heads]), got {leaves.shape}"
            )
        # Used as float32 by every backend: each must be a normal float32 whose largest
        # decoded value, 448 * scale, stays finite.
        scales = np.empty(expected, dtype=np.float64)
        for index in np.ndindex(expected):
            scales[index] = check_positive_float32(
                leaves[index], f"CacheConfig.kv_scales{list(index)}", MAX_KV_SCALE, error=InvalidConfigError
            )
        nested = tuple(tuple(tuple(float(x) for x in kv) for kv in layer) for layer in scales.tolist())
        object.__setattr__(self, "kv_scales", nested)

    @property
    def quantized(self) -> bool:
        """Whether the pool holds K/V quantized (:data:`QUANTIZED_DTYPES`), with scales."""
        return self.dtype in QUANTIZED_DTYPES

    @property
    def io_dtype(self) -> str:
        """The dtype ``write`` takes, queries have and attention returns: :attr:`compute_dtype`,
        else the pool's dtype (float32 for a quantized pool)."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        return "float32" if self.dtype in QUANTIZED_DTYPES else self.dtype

    def check_layer(self, layer: object) -> int:
        """``layer`` as an int, if ``0 <= layer < num_layers`` (NumPy integers accepted).

        Raises:
            LayerIndexError: anything else; the message names the value and the range.
        """
        index = as_integer(layer)
        if index is None or not 0 <= index < self.num_layers:
            raise LayerIndexError(f"layer {shown(layer)} is out of range: valid layers are 0 to {self.num_layers - 1}")
        return index

    @property
    def layout(self) -> str:
        """The resolved :attr:`kv_layout`.

        Raises:
            InvalidConfigError: ``kv_layout`` is ``None`` (not resolved by a backend yet).
        """
        if self.kv_layout is None:
            raise InvalidConfigError(
                "CacheConfig.kv_layout is None (the backend's preferred layout), not resolved yet: "
                "create_manager resolves it, or call config.with_layout(layout)"
            )
        return self.kv_layout

    def with_layout(self, preferred: str) -> CacheConfig:
        """This config with ``kv_layout`` resolved: itself when a layout is set, else a
        copy with ``preferred`` (a backend's fastest layout).

        Raises:
            InvalidConfigError: ``preferred`` is not one of :data:`KV_LAYOUTS`.
        """
        if self.kv_layout is not None:
            return self
        if preferred not in KV_LAYOUTS:
            raise InvalidConfigError(f"preferred layout {preferred!r} is unknown; valid: {', '.join(KV_LAYOUTS)}")
        return dataclasses.replace(self, kv_layout=preferred)

    @property
    def dtype_size(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return DTYPE_SIZES[self.dtype]

    @property
    def value_width(self) -> int:
        """Features per head of the values: :attr:`value_head_dim`, else :attr:`head_dim`."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in the pool: keys (:attr:`head_dim` wide) and values
        (:attr:`value_width` wide) of every layer (with their scales in a quantized pool; each
        layer of a pool of mixed geometry its page's, :attr:`storage_layers`)."""
        scale_bytes = SCALE_BYTES if self.dtype in QUANTIZED_DTYPES else 0
        if self.mixed_geometry:  # each group's layers their pages: the widest view of each
            return len(self._groups) * sum(
                shape.num_heads * (shape.head_dim + shape.value_width) * self.dtype_size
                for shape in self._storage.page_geometry
            )
        kv_layers = self.pool_layers * len(self._groups)  # state layers keep no K/V
        widths = (self.head_dim + self.value_width) * self.dtype_size + 2 * scale_bytes
        return kv_layers * self.num_heads * widths

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in the pool: ``block_size`` tokens of every layer (of a
        group's layers with KV-cache groups), K and V."""
        return self.block_size * self.bytes_per_token // len(self._groups)

    @property
    def total_tokens(self) -> int:
        """Tokens the whole pool can hold."""
        return self.num_blocks * self.block_size

    def block_shape(self) -> tuple[int, ...]:
        """Shape of one layer's key pool (values: :meth:`value_block_shape`) in :attr:`kv_layout`: ``"NHD"``
        ``[num_blocks, block_size, num_heads, head_dim]``, ``"HND"`` ``[num_blocks, num_heads,
        block_size, head_dim]``, ``"heads_first"`` ``[num_heads, num_blocks, block_size, head_dim]``.

        Raises:
            InvalidConfigError: ``kv_layout`` is ``None`` (not resolved by a backend yet).
        """
        return self._pool_shape(self.head_dim)

    def value_block_shape(self) -> tuple[int, ...]:
        """:meth:`block_shape` of the value pool: :attr:`value_width` last. Raises as :meth:`block_shape`."""
        return self._pool_shape(self.value_width)

    def _pool_shape(self, dim: int, heads: int | None = None) -> tuple[int, ...]:
        layout = self.layout
        blocks, tokens, heads = self.num_blocks, self.block_size, self.num_heads if heads is None else heads
        if layout == "NHD":
            return (blocks, tokens, heads, dim)
        if layout == "HND":
            return (blocks, heads, tokens, dim)
        return (heads, blocks, tokens, dim)
