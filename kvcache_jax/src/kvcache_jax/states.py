"""The JAX backend's state pool: one zero-filled ``jax.Array`` ``[num_slots, *shape]`` per
state array (:mod:`kvcache_core.contract.states`). JAX arrays are immutable: every change
replaces the array by its functional update (``.at[slots].set``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from kvcache_core.contract.states import StateArray, check_state_host, state_host_dtype
from kvcache_core.errors import UnsupportedConfigError

__all__ = ["JaxStateStorage"]

IntArray = npt.NDArray[np.int64]

#: The state dtypes the backend holds (float64 needs ``jax_enable_x64``: not offered).
JAX_STATE_DTYPES = ("float16", "bfloat16", "float32")


class JaxStateStorage:
    """A :class:`~kvcache_core.contract.states.StateStorage` of JAX arrays.

    Args:
        arrays, num_slots: the state pool's arrays and slots.
        put: places a host or device array on the pool's devices (replicated over a mesh).

    Raises:
        UnsupportedConfigError: a state array of a dtype the backend does not hold.
    """

    def __init__(self, arrays: tuple[StateArray, ...], num_slots: int, put: Callable[[Any], jax.Array]) -> None:
        for array in arrays:
            if array.dtype not in JAX_STATE_DTYPES:
                raise UnsupportedConfigError(
                    f"state array {array.name!r} has dtype {array.dtype!r}; the jax backend holds states in "
                    f"{', '.join(JAX_STATE_DTYPES)}"
                )
        self._arrays = arrays
        self._put = put
        self._pools = [
            put(jnp.zeros((num_slots, *array.shape), dtype=array.dtype))  # pyright: ignore[reportUnknownMemberType]
            for array in arrays
        ]

    @staticmethod
    def _index(slots: IntArray) -> jax.Array:
        return jnp.asarray(np.asarray(slots, dtype=np.int32))  # pyright: ignore[reportUnknownMemberType]

    def read(self, index: int, slots: IntArray) -> jax.Array:
        """A copy of array ``index`` at ``slots``."""
        return self._pools[index][self._index(slots)]

    def write(self, index: int, slots: IntArray, values: jax.Array) -> None:
        """Replace array ``index`` by one with ``values`` at ``slots``."""
        self._pools[index] = self._pools[index].at[self._index(slots)].set(values)

    def copy(self, source: IntArray, destination: IntArray) -> None:
        """Every array with ``source``'s slots copied into ``destination``."""
        picked, into = self._index(source), self._index(destination)
        self._pools = [pool.at[into].set(pool[picked]) for pool in self._pools]

    def zero(self, slots: IntArray) -> None:
        """Every array with zeros at ``slots``."""
        into = self._index(slots)
        self._pools = [pool.at[into].set(0) for pool in self._pools]

    def to_host(self, slots: IntArray) -> tuple[npt.NDArray[Any], ...]:
        """Host copies of every array at ``slots`` (bfloat16 as its ``uint16`` bit patterns)."""
        picked = self._index(slots)
        copies: list[npt.NDArray[Any]] = []
        for pool, array in zip(self._pools, self._arrays, strict=True):
            host: npt.NDArray[Any] = np.array(pool[picked])
            copies.append(host.view(state_host_dtype(array.dtype)))
        return tuple(copies)

    def from_host(self, slots: IntArray, arrays: Sequence[npt.NDArray[Any]]) -> None:
        """Write host copies into ``slots``, bit for bit, after checking all of them."""
        check_state_host(self._arrays, arrays, len(slots))
        into = self._index(slots)
        pools: list[jax.Array] = []
        for pool, array, values in zip(self._pools, self._arrays, arrays, strict=True):
            host = np.ascontiguousarray(values).view(np.dtype(jnp.dtype(array.dtype)))  # uint16 bits -> bfloat16
            pools.append(pool.at[into].set(self._put(host)))
        self._pools = pools

    def array(self, index: int) -> jax.Array:
        """Array ``index`` as it is now, ``[num_slots, *shape]``."""
        return self._pools[index]
