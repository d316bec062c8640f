"""The backend under test: its spec, small configurations, and array conversions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import QUANTIZED_DTYPES, AllocationRequest, CacheConfig
from kvcache_core.contract.hookspecs import CAPABILITIES as CAPABILITY_DESCRIPTIONS
from kvcache_core.contract.hookspecs import BackendSpec
from kvcache_core.discovery import create_manager
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager

__all__ = ["CAPABILITIES", "TOLERANCES", "BackendUnderTest", "grow_side_by_side", "write_random"]

FloatArray = npt.NDArray[np.float64]

#: Capabilities the kit knows; a backend claims them in ``BackendSpec.capabilities``. Their
#: meanings and the storage methods each relies on: :data:`kvcache_core.contract.hookspecs.CAPABILITIES`.
CAPABILITIES = frozenset(CAPABILITY_DESCRIPTIONS)

#: ``(rtol, atol)`` for attention outputs compared with the float64 NumPy reference.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-9),
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 4e-3),
    "bfloat16": (1.6e-2, 3e-2),
}

#: The kit's default geometry: 2 layers, 2 KV heads of 8 features, 24 blocks of 4 tokens.
BASE_CONFIG: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 8, "num_blocks": 24, "block_size": 4}


@dataclass(frozen=True)
class BackendUnderTest:
    """One installed backend as the kit sees it (the ``kvcache_backend`` fixture).

    Attributes:
        name: the backend's name.
        spec: its registered :class:`~kvcache_core.BackendSpec`.
        device: the device the kit puts pools on (the first the backend lists).
    """

    name: str
    spec: BackendSpec[Any]

    @property
    def device(self) -> str:
        return self.spec.devices[0]

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self.spec.dtypes

    @property
    def unquantized_dtypes(self) -> tuple[str, ...]:
        """The claimed dtypes that hold values exactly (not :data:`~kvcache_core.QUANTIZED_DTYPES`)."""
        return tuple(dtype for dtype in self.spec.dtypes if dtype not in QUANTIZED_DTYPES)

    @property
    def quantized_dtypes(self) -> tuple[str, ...]:
        """The claimed quantized dtypes."""
        return tuple(dtype for dtype in self.spec.dtypes if dtype in QUANTIZED_DTYPES)

    @property
    def kv_layouts(self) -> tuple[str, ...]:
        return self.spec.kv_layouts

    @property
    def default_dtype(self) -> str:
        """float32 where claimed (lossless comparisons), else the first dtype claimed."""
        return "float32" if "float32" in self.spec.dtypes else self.unquantized_dtypes[0]

    def claims(self, capability: str) -> bool:
        return capability in self.spec.capabilities

    def config(self, **fields: Any) -> CacheConfig:
        """A small config on this backend's device, dtype and first layout, with ``fields`` changed."""
        base: dict[str, Any] = {
            **BASE_CONFIG,
            "dtype": self.default_dtype,
            "device": self.device,
            "kv_layout": self.spec.kv_layouts[0],
        }
        return CacheConfig(**{**base, **fields})

    def configs(self, **fields: Any) -> Iterator[CacheConfig]:
        """:meth:`config` for every unquantized dtype x layout the backend claims (quantized
        pools are not bit-exact: :mod:`kvcache_core.testing.quantized` runs their cases)."""
        for dtype in self.unquantized_dtypes:
            for layout in self.spec.kv_layouts:
                yield self.config(**{"dtype": dtype, "kv_layout": layout, **fields})

    def managers(self, **fields: Any) -> Iterator[tuple[PagedKvCacheManager[Any], str]]:
        """A new manager of each of :meth:`configs` (``fields`` as there), with the words
        naming its dtype and layout that a case puts in its failure messages."""
        for config in self.configs(**fields):
            yield self.manager(config), f"dtype {config.dtype}, layout {config.kv_layout}"

    def manager(self, config: CacheConfig | None = None, **options: Any) -> PagedKvCacheManager[Any]:
        """A new manager of this backend (``create_manager``, exactly as users call it)."""
        return create_manager(self.name, config if config is not None else self.config(), **options)

    # -- arrays ----------------------------------------------------------------------------

    @staticmethod
    def native(manager: PagedKvCacheManager[Any], array: npt.NDArray[Any], dtype: str | None = None) -> Any:
        """``array`` as a native array of ``dtype`` (the pool's by default) on the pool's device.

        Types NumPy holds go through ``from_numpy``; others (bfloat16) are cast with the
        backend's Array API namespace from a float32 native array.
        """
        storage = manager.storage
        target = dtype if dtype is not None else manager.config.dtype
        if target in ("float16", "float32", "float64"):
            return storage.from_numpy(np.ascontiguousarray(array, dtype=np.dtype(target)))
        namespace = storage.array_namespace()
        widened = storage.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        return namespace.astype(widened, getattr(namespace, target))

    @staticmethod
    def host(manager: PagedKvCacheManager[Any], array: Any) -> npt.NDArray[np.float64]:
        """A float64 host copy of a native array (for comparisons in any dtype)."""
        copy: npt.NDArray[np.float64] = np.asarray(manager.storage.to_numpy(array)).astype(np.float64)
        return copy

    @staticmethod
    def representable(values: npt.NDArray[np.float64], dtype: str) -> npt.NDArray[np.float64]:
        """``values`` rounded to ``dtype`` (so a round trip through it is exact)."""
        if dtype == "bfloat16":
            bits: npt.NDArray[np.uint32] = values.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
            return bits.view(np.float32).astype(np.float64)
        return values.astype(np.dtype(dtype)).astype(np.float64)


# -- populating a manager --------------------------------------------------------------


def write_random(
    manager: PagedKvCacheManager[Any], slots: npt.NDArray[np.int64], rng: np.random.Generator, layer: int
) -> tuple[FloatArray, FloatArray]:
    """Write representable random K/V into ``slots`` of ``layer``; return the float64 values."""
    config = manager.config
    shape = (len(slots), config.num_heads, config.head_dim)
    keys = BackendUnderTest.representable(rng.standard_normal(shape), config.dtype)
    values = BackendUnderTest.representable(rng.standard_normal((*shape[:2], config.value_width)), config.dtype)
    manager.write(layer, slots, BackendUnderTest.native(manager, keys), BackendUnderTest.native(manager, values))
    return keys, values


def grow_side_by_side(
    manager: PagedKvCacheManager[Any], lengths: list[int], rng: np.random.Generator, prefix: str = "r"
) -> tuple[list[PagedKvCacheHandle[Any]], list[tuple[FloatArray, FloatArray]]]:
    """Requests ``<prefix>0``, ``<prefix>1``, ... grown a few tokens at a time in turn (so
    their blocks interleave), K/V written in every layer; returns the handles and each
    layer 0's float64 K/V."""
    handles = [manager.allocate(AllocationRequest(f"{prefix}{index}")) for index in range(len(lengths))]
    written: list[list[tuple[FloatArray, FloatArray]]] = [[] for _ in lengths]
    done = [0] * len(lengths)
    while done != lengths:
        for index, handle in enumerate(handles):
            step = min(int(rng.integers(1, 7)), lengths[index] - done[index])
            if step == 0:
                continue
            slots = manager.extend(handle, step)
            for layer in range(manager.config.num_layers):
                pair = write_random(manager, slots, rng, layer)
                if layer == 0:
                    written[index].append(pair)
            done[index] += step
    merged = [(np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts])) for parts in written]
    return handles, merged
