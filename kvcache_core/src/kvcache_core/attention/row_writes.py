"""A step's new tokens' key and value rows written into one layer's pools by compiled code:
one call for both pools, every argument of it but the slots an integer.

Inside a model, each framework operation costs several times what it costs in a loop (its
code pushed out of the CPU's caches by the layer's work): two indexed copies, one per pool,
took about 30 us of a decode layer's path for 8 requests on an AMD EPYC (Zen 5, 2 cores).
:class:`PoolWriter` checks a layer's pools once; each call then hands numba only integers
(the sources' addresses) and the slots, which it types quicker than arrays.
It runs where the compiled kernel does (numba installed, ``KVCACHE_DISABLE_NUMBA`` unset).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvcache_core.attention.kernel import kernel_available
from kvcache_core.contract.config import LAYOUT_AXES
from kvcache_core.contract.scalars import check_count
from kvcache_core.errors import ArrayTypeError, InvalidArgumentError, ShapeMismatchError, SlotError

__all__ = ["PoolWriter"]

_INT64: Final = np.dtype(np.int64)
_compiled: list[ModuleType] = []


def _jit() -> ModuleType:
    """The compiled module (imported on first use: importing numba takes a while)."""
    if not _compiled:
        _compiled.append(importlib.import_module("kvcache_core.attention._row_writes_jit"))
    return _compiled[0]


class PoolWriter:
    """Writes a step's new tokens' key and value rows into one layer's pools, one compiled
    call for both (:meth:`for_pools` makes it).

    A call ``writer(keys, values, slots)`` takes the addresses of the new keys and values,
    C-contiguous ``[tokens, heads, width]`` arrays of the pools' element type and widths, and
    the slots they go to (``slots`` int64, C-contiguous, one per token): the caller vouches for
    the addresses, as for any C function's; the slots are checked (every one, in compiled code,
    before any row is written). The writer keeps its pools alive.
    """

    __slots__ = ("_arguments", "_limit", "_pools")

    def __init__(self, pools: tuple[npt.NDArray[Any], npt.NDArray[Any]], arguments: tuple[Any, ...]) -> None:
        self._pools = pools  # kept alive as long as the writer: the arguments hold their addresses
        self._arguments = arguments  # write_rows's after the sources and the slots
        self._limit = int(arguments[2])

    @classmethod
    def for_pools(cls, key_cache: npt.NDArray[Any], value_cache: npt.NDArray[Any], kv_layout: str) -> PoolWriter | None:
        """A writer into these pools (4-D, in ``kv_layout``: ``"NHD"``, ``"HND"`` or
        ``"heads_first"``; one element type; each row's features contiguous; writeable);
        ``None`` where compiled code does not run here (numba missing or switched off).

        Raises:
            ArrayTypeError: a pool not a writeable NumPy array, or the two of different element types.
            ShapeMismatchError: pools not 4-D, of other blocks, block sizes or heads, or rows not
                contiguous.
            InvalidArgumentError: an unknown ``kv_layout``.
        """
        axes = LAYOUT_AXES.get(kv_layout) if isinstance(kv_layout, str) else None
        if axes is None:
            raise InvalidArgumentError(f"kv_layout must be one of {sorted(LAYOUT_AXES)}, got {kv_layout!r}")
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            if not isinstance(cache, np.ndarray) or not cache.flags.writeable:
                raise ArrayTypeError(f"{name} must be a writeable NumPy array, got {type(cache).__name__}")
            if cache.ndim != 4 or cache.strides[3] != cache.itemsize or min(cache.strides) < 0:
                raise ShapeMismatchError(
                    f"{name} must be 4-D with each row's features contiguous, got shape {cache.shape} "
                    f"strides {cache.strides}"
                )
        if key_cache.dtype != value_cache.dtype:
            raise ArrayTypeError(f"the pools must share an element type, got {key_cache.dtype} and {value_cache.dtype}")
        if key_cache.shape[:3] != value_cache.shape[:3]:
            raise ShapeMismatchError(
                f"the pools must have the same blocks, block size and heads, got {key_cache.shape} and "
                f"{value_cache.shape}"
            )
        if not kernel_available():
            return None
        blocks, block_size, heads = (int(key_cache.shape[axis]) for axis in axes)
        strides = tuple(tuple(int(cache.strides[axis]) for axis in axes) for cache in (key_cache, value_cache))
        widths = (int(key_cache.shape[3]) * key_cache.itemsize, int(value_cache.shape[3]) * value_cache.itemsize)
        pools = (int(key_cache.ctypes.data), int(value_cache.ctypes.data))
        arguments = (*pools, blocks * block_size, heads, *widths, block_size, *strides)
        _jit()  # imported here, not at the first write
        return cls((key_cache, value_cache), arguments)

    def __call__(self, keys: int, values: int, slots: npt.NDArray[np.int64]) -> None:
        """Write the rows at ``keys`` and ``values`` into the slots ``slots``.

        Raises:
            InvalidArgumentError: ``keys`` or ``values`` not an int >= 1.
            ArrayTypeError: ``slots`` not a C-contiguous 1-D int64 array.
            SlotError: a slot outside the pools (nothing written).
        """
        check_count(keys, "the keys' address", 1)
        check_count(values, "the values' address", 1)
        if (
            not isinstance(slots, np.ndarray)
            or slots.dtype != _INT64
            or slots.ndim != 1
            or not slots.flags.c_contiguous
        ):
            raise ArrayTypeError(f"slots must be a C-contiguous 1-D int64 array, got {slots!r:.80}")
        bad: int = _jit().write_rows(keys, values, slots, *self._arguments)
        if bad >= 0:
            raise SlotError(f"slot {int(slots[bad])} is outside the pools' slots [0, {self._limit})")
