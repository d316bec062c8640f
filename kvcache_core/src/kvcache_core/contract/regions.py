"""The memory regions of a pool: where each layer's keys, values and scales live, for a
transport that registers them once and reads or writes blocks in place (NIXL, RDMA).

A storage that can name its memory claims the capability :data:`MEMORY_REGIONS` and has the
optional member ``memory_regions() -> tuple[MemoryRegion, ...]`` (:class:`RegionStorage`):
one region per layer and part (``"keys"``, ``"values"``, and for a quantized pool
``"key_scales"``, ``"value_scales"``), each a C-contiguous array whose axis
:attr:`MemoryRegion.block_axis` indexes the pool's blocks. The addresses stay valid while the
storage is open (a backend whose writes replace its buffers, such as JAX, cannot claim it).
Parts are laid out as the pool's layout says (``"NHD"``, ``"HND"``, ``"heads_first"``), each
layer of its own geometry in a pool of mixed geometry; scales as ``[num_heads, num_blocks,
block_size]`` float32.

A state pool (:mod:`kvcache_core.contract.states`) that can name its memory has the optional
member ``memory_regions()`` too (:class:`RegionStorage`): one region per state array, in the
pool's order, ``layer`` the array's index, part :data:`STATE_PART`, shape ``[num_slots,
*shape]``, its slots along axis 0 (a slot is a "block" of the region).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvcache_core.contract import quantization
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.states import STATE_DTYPES, StateArray, StatePool
from kvcache_core.errors import InvalidArgumentError, UnsupportedConfigError

__all__ = [
    "MEMORY_REGIONS",
    "REGION_PARTS",
    "STATE_PART",
    "MemoryRegion",
    "RegionStorage",
    "block_axis",
    "check_regions",
    "check_state_regions",
    "host_form_from_parts",
    "part_shape",
    "pool_regions",
    "slot_regions",
    "storage_regions",
]

#: The capability of a storage whose ``memory_regions()`` names its pool's memory.
MEMORY_REGIONS: Final = "memory_regions"

#: The parts of one layer, in order: keys and values, then a quantized pool's scales.
REGION_PARTS: Final = ("keys", "values", "key_scales", "value_scales")

#: The part of a state pool's region (one per state array).
STATE_PART: Final = "state"

#: Device kinds a region may be on (NIXL's DRAM and VRAM).
REGION_DEVICE_KINDS: Final = ("cpu", "cuda")


@dataclass(frozen=True)
class MemoryRegion:
    """One layer's keys, values or scales: a C-contiguous array at ``address``.

    Attributes:
        layer: the pool layer, in ``[0, num_layers)``.
        part: one of :data:`REGION_PARTS`.
        address: the first byte (a host pointer, or a device pointer for ``"cuda"``).
        shape: the array's shape; ``shape[block_axis]`` is the pool's ``num_blocks``.
        element_bytes: bytes per element (1 for a quantized pool's raw bytes, 4 for scales).
        block_axis: the axis that indexes blocks.
        device_kind: ``"cpu"`` or ``"cuda"``.
        device_id: the device's index (0 for ``"cpu"``).
    """

    layer: int
    part: str
    address: int
    shape: tuple[int, ...]
    element_bytes: int
    block_axis: int
    device_kind: str = "cpu"
    device_id: int = 0

    @property
    def length_bytes(self) -> int:
        """Bytes the region spans."""
        return math.prod(self.shape) * self.element_bytes

    @property
    def block_stride_bytes(self) -> int:
        """Bytes between one block and the next along :attr:`block_axis`; also the length of
        each contiguous chunk of one block."""
        return math.prod(self.shape[self.block_axis + 1 :]) * self.element_bytes

    @property
    def chunks_per_block(self) -> int:
        """Contiguous chunks one block spans (the product of the axes before the block axis)."""
        return math.prod(self.shape[: self.block_axis])

    def block_chunks(self, blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Start addresses of the contiguous chunks of ``blocks``, ``[chunks_per_block * n]``
        int64, leading axes outermost then blocks in order (each chunk is
        :attr:`block_stride_bytes` long). Two regions of one shape except the block count list
        matching chunks in the same order."""
        stride = self.block_stride_bytes
        outer = np.arange(self.chunks_per_block, dtype=np.int64) * (self.shape[self.block_axis] * stride)
        starts = self.address + outer[:, None] + np.asarray(blocks, dtype=np.int64)[None, :] * stride
        return starts.reshape(-1)


@runtime_checkable
class RegionStorage(Protocol):
    """The optional :class:`~kvcache_core.plugin.KvStorage` member of a storage that claims
    :data:`MEMORY_REGIONS`."""

    def memory_regions(self) -> tuple[MemoryRegion, ...]:
        """Every region of the pool (:func:`check_regions` holds), stable while the storage
        is open."""
        ...


def part_shape(
    config: CacheConfig, part: str, num_blocks: int | None = None, layer: int | None = None
) -> tuple[int, ...]:
    """The shape of ``part`` of one layer in ``config``'s layout (``num_blocks`` blocks, the
    pool's by default): ``config.block_shape()`` for keys, ``config.value_block_shape()`` for
    values (``value_width`` last), ``[num_heads, num_blocks, block_size]`` for scales; of
    ``layer``'s own geometry when given (a pool of mixed geometry)."""
    blocks = config.num_blocks if num_blocks is None else num_blocks
    heads = config.num_heads if layer is None else config.layer_geometry(layer).num_heads
    if part.endswith("scales"):
        return (heads, blocks, config.block_size)
    if layer is not None:
        shape = list(config.layer_block_shape(layer, part))
    else:
        shape = list(config.value_block_shape() if part == "values" else config.block_shape())
    shape[_block_axis(config.layout)] = blocks
    return tuple(shape)


def block_axis(config: CacheConfig, part: str) -> int:
    """The axis of :func:`part_shape` that indexes blocks."""
    return 1 if part.endswith("scales") else _block_axis(config.layout)


def _block_axis(layout: str) -> int:
    return 1 if layout == "heads_first" else 0


def pool_regions(
    config: CacheConfig,
    pool_address: int,
    element_bytes: int,
    scales_address: int | None = None,
    *,
    device_kind: str = "cpu",
    device_id: int = 0,
) -> tuple[MemoryRegion, ...]:
    """The regions of a pool kept as one C-contiguous ``[num_layers, 2, *block_shape]`` array
    at ``pool_address`` (with a ``value_head_dim``: each layer's keys then its values, of
    ``value_block_shape``, one layer after the other) (and a quantized pool's scales as one float32 ``[num_layers, 2,
    num_heads, num_blocks, block_size]`` array at ``scales_address``), the arrangement of
    the NumPy and torch backends."""
    regions: list[MemoryRegion] = []
    key_shape, value_shape = part_shape(config, "keys"), part_shape(config, "values")
    key_bytes = math.prod(key_shape) * element_bytes
    layer_bytes = key_bytes + math.prod(value_shape) * element_bytes
    scale_shape = part_shape(config, "key_scales")
    scale_bytes = math.prod(scale_shape) * 4
    axis = _block_axis(config.layout)
    for layer in range(config.num_layers):
        start = pool_address + layer * layer_bytes
        regions.append(MemoryRegion(layer, "keys", start, key_shape, element_bytes, axis, device_kind, device_id))
        regions.append(
            MemoryRegion(layer, "values", start + key_bytes, value_shape, element_bytes, axis, device_kind, device_id)
        )
        if scales_address is not None:
            for index, part in enumerate(("key_scales", "value_scales")):
                address = scales_address + (2 * layer + index) * scale_bytes
                regions.append(MemoryRegion(layer, part, address, scale_shape, 4, 1, device_kind, device_id))
    return tuple(regions)


def storage_regions(storage: object) -> tuple[MemoryRegion, ...] | None:
    """``storage.memory_regions()``, or ``None`` when the storage has no such member."""
    if not isinstance(storage, RegionStorage):
        return None
    return tuple(storage.memory_regions())


def check_regions(config: CacheConfig, regions: Sequence[MemoryRegion]) -> dict[tuple[int, str], MemoryRegion]:
    """The regions by ``(layer, part)``, checked to cover the pool exactly: every layer's
    keys and values (and scales when quantized) once, each of :func:`part_shape` and the
    element size of the pool's dtype.

    Raises:
        InvalidArgumentError: a region is missing, repeated, of another shape, element size
            or device kind, or unknown.
    """
    expected_parts = REGION_PARTS if config.quantized else REGION_PARTS[:2]
    by_key: dict[tuple[int, str], MemoryRegion] = {}
    for region in regions:
        key = (region.layer, region.part)
        if not isinstance(region, MemoryRegion) or region.part not in expected_parts:
            raise InvalidArgumentError(
                f"memory region {region!r} is not a part of a {config.dtype} pool {expected_parts}"
            )
        if not 0 <= region.layer < config.num_layers or key in by_key:
            raise InvalidArgumentError(
                f"memory region of layer {region.layer} part {region.part!r} is repeated or outside [0, {config.num_layers})"
            )
        shape = part_shape(config, region.part, layer=region.layer)
        if region.shape != shape or region.device_kind not in REGION_DEVICE_KINDS:
            raise InvalidArgumentError(
                f"memory region of layer {region.layer} part {region.part!r} has shape {region.shape} on "
                f"{region.device_kind!r}; expected {shape} on one of {REGION_DEVICE_KINDS}"
            )
        wanted = 4 if region.part.endswith("scales") else config.dtype_size
        if region.element_bytes != wanted:
            raise InvalidArgumentError(
                f"memory region of layer {region.layer} part {region.part!r} has {region.element_bytes}-byte "
                f"elements; the pool's are {wanted} bytes"
            )
        by_key[key] = region
    missing = [
        (layer, part) for layer in range(config.num_layers) for part in expected_parts if (layer, part) not in by_key
    ]
    if missing:
        raise InvalidArgumentError(f"memory regions miss (layer, part) {missing[:4]} of {len(missing)}")
    return by_key


def check_state_regions(
    arrays: Sequence[tuple[int, StateArray]], num_slots: int, regions: Sequence[MemoryRegion]
) -> tuple[MemoryRegion, ...]:
    """A state pool's regions, checked to cover it exactly: one per state array of
    ``arrays`` (``CacheConfig.states.arrays``), in order, of shape ``[num_slots, *shape]`` and
    the element size of its dtype, slots along axis 0.

    Raises:
        InvalidArgumentError: a region missing, extra, out of order or of another shape,
            element size, axis or device kind.
    """
    if len(regions) != len(arrays):
        raise InvalidArgumentError(f"the state pool names {len(regions)} memory regions; it has {len(arrays)} arrays")
    for index, (region, (layer, array)) in enumerate(zip(regions, arrays, strict=True)):
        expected = MemoryRegion(
            index, STATE_PART, region.address, (num_slots, *array.shape), STATE_DTYPES[array.dtype], 0
        )
        if (
            not isinstance(region, MemoryRegion)
            or dataclasses.replace(region, device_kind="cpu", device_id=0) != expected
            or region.device_kind not in REGION_DEVICE_KINDS
        ):
            raise InvalidArgumentError(
                f"memory region {region!r} of state array {array.name!r} (layer {layer}) is not {expected!r} "
                f"on one of {REGION_DEVICE_KINDS}"
            )
    return tuple(regions)


def slot_regions(states: StatePool, storage: object, slot: int | None) -> tuple[MemoryRegion, ...]:
    """The memory of state ``slot`` of a state pool (``storage``, of ``states``): one region
    ``[1, *shape]`` per state array (``slot`` ``None``: the whole pool's, checked); empty
    without state layers.

    Raises:
        UnsupportedConfigError: the state pool names no memory, or not its exact arrays.
    """
    if not states.arrays:
        return ()
    found = storage_regions(storage)
    if found is None:
        raise UnsupportedConfigError(
            f"the state pool {type(storage).__name__} names no memory (no memory_regions()): its states cannot be "
            "read in place"
        )
    try:
        checked = check_state_regions(states.arrays, states.num_slots, found)
    except InvalidArgumentError as exc:
        raise UnsupportedConfigError(f"the state pool's memory regions are unusable: {exc}") from exc
    if slot is None:
        return checked
    return tuple(
        dataclasses.replace(
            region, address=region.address + slot * region.block_stride_bytes, shape=(1, *region.shape[1:])
        )
        for region in checked
    )


def host_form_from_parts(
    config: CacheConfig, layout: str, parts: dict[tuple[int, str], npt.NDArray[Any]]
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Core's host form ``[num_layers, n, block_size, num_heads, width]`` of keys and values
    (:mod:`kvcache_core.offload.host_form`) from the bytes of ``n`` blocks of every region,
    each ``parts[(layer, part)]`` a uint8 array of :func:`part_shape` (``n`` blocks, in
    ``layout``) times the element size.

    Raises:
        InvalidArgumentError: a part is missing or of another size.
    """
    source = config if config.kv_layout == layout else dataclasses.replace(config, kv_layout=layout)
    keys: list[npt.NDArray[Any]] = []
    values: list[npt.NDArray[Any]] = []
    element = np.dtype(_host_element(config))
    for layer in range(config.num_layers):
        for part, out in (("keys", keys), ("values", values)):
            raw = parts.get((layer, part))
            if raw is None:
                raise InvalidArgumentError(f"no bytes for layer {layer} part {part!r}")
            count = _count(source, part, raw, element.itemsize)
            data = raw.view(element).reshape(part_shape(source, part, count))
            nhd = _to_nhd(data, layout)
            if config.quantized:
                scale_raw = parts.get((layer, part[:-1] + "_scales"))
                if scale_raw is None:
                    raise InvalidArgumentError(f"no scales for layer {layer} part {part!r}")
                scales = scale_raw.view(np.float32).reshape(part_shape(source, "key_scales", count))
                nhd = quantization.pack_host(nhd, scales.transpose(1, 2, 0))
            out.append(nhd)
    return np.stack(keys), np.stack(values)


def _host_element(config: CacheConfig) -> str:
    if config.quantized:
        return "uint8"
    return {"bfloat16": "uint16"}.get(config.dtype, config.dtype)


def _count(config: CacheConfig, part: str, raw: npt.NDArray[Any], itemsize: int) -> int:
    per_block = math.prod(part_shape(config, part, 1)) * itemsize
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size % per_block:
        raise InvalidArgumentError(
            f"bytes of part {part!r} must be uint8 [n * {per_block}], got {raw.dtype} {raw.shape}"
        )
    return raw.size // per_block


def _to_nhd(data: npt.NDArray[Any], layout: str) -> npt.NDArray[Any]:
    """``[n, block_size, num_heads, width]`` from one layer's part in ``layout``."""
    axes = {"HND": (0, 2, 1, 3), "heads_first": (1, 2, 0, 3)}.get(layout, (0, 1, 2, 3))  # from [n,H,bs,D], [H,n,bs,D]
    moved: npt.NDArray[Any] = data.transpose(axes)
    return moved
