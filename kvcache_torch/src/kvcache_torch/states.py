"""The torch backend's state pool: one zero-filled tensor ``[num_slots, *shape]`` per state
array, on the pool's device (:mod:`kvcache_core.contract.states`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.contract.regions import STATE_PART, MemoryRegion
from kvcache_core.contract.states import StateArray, check_state_host, state_host_dtype
from kvcache_torch.dtypes import BIT_DTYPES, torch_dtype

__all__ = ["TorchStateStorage"]

IntArray = npt.NDArray[np.int64]


class TorchStateStorage:
    """A :class:`~kvcache_core.contract.states.StateStorage` of torch tensors.

    Raises:
        UnsupportedConfigError: a state array of a dtype the backend does not hold.
    """

    def __init__(self, arrays: tuple[StateArray, ...], num_slots: int, device: torch.device) -> None:
        dtypes = [torch_dtype(array.dtype) for array in arrays]
        self._arrays = arrays
        self._device = device
        self._pools = [
            torch.zeros((num_slots, *array.shape), dtype=dtype, device=device)
            for array, dtype in zip(arrays, dtypes, strict=True)
        ]

    def _index(self, slots: IntArray) -> torch.Tensor:
        tensor: torch.Tensor = torch.from_numpy(np.array(slots, dtype=np.int64))  # pyright: ignore[reportUnknownMemberType]
        return tensor if self._device.type == "cpu" else tensor.to(self._device, non_blocking=True)

    def read(self, index: int, slots: IntArray) -> torch.Tensor:
        """A copy of array ``index`` at ``slots``."""
        return self._pools[index].index_select(0, self._index(slots))

    def write(self, index: int, slots: IntArray, values: torch.Tensor) -> None:
        """Write ``values`` into array ``index`` at ``slots``."""
        self._pools[index].index_copy_(0, self._index(slots), values)

    def copy(self, source: IntArray, destination: IntArray) -> None:
        """Copy every array's ``source`` slots into ``destination``."""
        picked, into = self._index(source), self._index(destination)
        for pool in self._pools:
            pool.index_copy_(0, into, pool.index_select(0, picked))

    def zero(self, slots: IntArray) -> None:
        """Zero every array at ``slots``."""
        into = self._index(slots)
        for pool in self._pools:
            pool.index_fill_(0, into, 0)

    def to_host(self, slots: IntArray) -> tuple[npt.NDArray[Any], ...]:
        """Host copies of every array at ``slots`` (bfloat16 as its ``uint16`` bit patterns)."""
        picked = self._index(slots)
        copies: list[npt.NDArray[Any]] = []
        for pool, array in zip(self._pools, self._arrays, strict=True):
            bits = pool.index_select(0, picked).view(BIT_DTYPES.get(pool.dtype, pool.dtype)).cpu()
            copies.append(bits.numpy().view(state_host_dtype(array.dtype)))
        return tuple(copies)

    def from_host(self, slots: IntArray, arrays: Sequence[npt.NDArray[Any]]) -> None:
        """Write host copies into ``slots``, bit for bit, after checking all of them."""
        check_state_host(self._arrays, arrays, len(slots))
        into = self._index(slots)
        for pool, values in zip(self._pools, arrays, strict=True):
            host = np.ascontiguousarray(values)
            bits = BIT_DTYPES.get(pool.dtype)
            if bits is not None:  # uint16 patterns -> int16 (torch's) -> bfloat16
                host = host.view(np.int16)
            tensor: torch.Tensor = torch.from_numpy(host.copy())  # pyright: ignore[reportUnknownMemberType]
            pool.index_copy_(0, into, tensor.to(self._device).view(pool.dtype))

    def array(self, index: int) -> torch.Tensor:
        """Array ``index`` itself, ``[num_slots, *shape]``."""
        return self._pools[index]

    def memory_regions(self) -> tuple[MemoryRegion, ...]:
        """Each array's memory (:mod:`kvcache_core.contract.regions`): host memory on CPU,
        device memory on CUDA, slots along axis 0; stable while the storage lives (writes go
        into the tensors in place)."""
        device_id = 0 if self._device.index is None else self._device.index
        return tuple(
            MemoryRegion(
                index,
                STATE_PART,
                int(pool.data_ptr()),
                tuple(pool.shape),
                pool.element_size(),
                0,
                self._device.type,
                device_id,
            )
            for index, pool in enumerate(self._pools)
        )
