"""The NumPy backend's state pool: one zero-filled array ``[num_slots, *shape]`` per state
array (:mod:`kvcache_core.contract.states`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.regions import STATE_PART, MemoryRegion
from kvcache_core.contract.states import StateArray, check_state_host
from kvcache_core.errors import UnsupportedConfigError

__all__ = ["NumpyStateStorage"]

NumpyArray = npt.NDArray[Any]
IntArray = npt.NDArray[np.int64]

#: The state dtypes NumPy holds (no bfloat16).
NUMPY_STATE_DTYPES = ("float16", "float32", "float64")


class NumpyStateStorage:
    """A :class:`~kvcache_core.contract.states.StateStorage` of NumPy arrays.

    Raises:
        UnsupportedConfigError: a state array of a dtype NumPy does not hold (bfloat16).
    """

    def __init__(self, arrays: tuple[StateArray, ...], num_slots: int) -> None:
        for array in arrays:
            if array.dtype not in NUMPY_STATE_DTYPES:
                raise UnsupportedConfigError(
                    f"state array {array.name!r} has dtype {array.dtype!r}; the numpy backend holds states in "
                    f"{', '.join(NUMPY_STATE_DTYPES)}"
                )
        self._arrays = arrays
        self._pools = [np.zeros((num_slots, *array.shape), dtype=array.dtype) for array in arrays]

    def read(self, index: int, slots: IntArray) -> NumpyArray:
        """A copy of array ``index`` at ``slots``."""
        return self._pools[index][slots]

    def write(self, index: int, slots: IntArray, values: NumpyArray) -> None:
        """Write ``values`` into array ``index`` at ``slots``."""
        self._pools[index][slots] = values

    def copy(self, source: IntArray, destination: IntArray) -> None:
        """Copy every array's ``source`` slots into ``destination``."""
        for pool in self._pools:
            pool[destination] = pool[source]

    def zero(self, slots: IntArray) -> None:
        """Zero every array at ``slots``."""
        for pool in self._pools:
            pool[slots] = 0

    def to_host(self, slots: IntArray) -> tuple[NumpyArray, ...]:
        """Host copies of every array at ``slots`` (NumPy's dtypes are their own host form)."""
        return tuple(pool[slots] for pool in self._pools)

    def from_host(self, slots: IntArray, arrays: Sequence[NumpyArray]) -> None:
        """Write host copies into ``slots``, after checking all of them."""
        check_state_host(self._arrays, arrays, len(slots))
        for pool, values in zip(self._pools, arrays, strict=True):
            pool[slots] = values

    def array(self, index: int) -> NumpyArray:
        """Array ``index`` itself, ``[num_slots, *shape]``."""
        return self._pools[index]

    def memory_regions(self) -> tuple[MemoryRegion, ...]:
        """Each array's memory (:mod:`kvcache_core.contract.regions`), slots along axis 0;
        stable while the storage lives (writes go into the arrays in place)."""
        return tuple(
            MemoryRegion(index, STATE_PART, int(pool.ctypes.data), tuple(pool.shape), pool.itemsize, 0)
            for index, pool in enumerate(self._pools)
        )
