"""Recurrent-state layers: a layer that keeps a fixed-size state per request instead of K/V.

State-space and linear-attention layers (Mamba, Mamba2, gated DeltaNet, short convolutions)
carry, per request, a few arrays of fixed shapes (a convolution window, an SSM or
linear-attention state) that the layer overwrites at every step; they never grow with
tokens. ``LayerSpec(state=StateSpec(...))`` declares such a layer in
``CacheConfig.layer_specs``; the attention layers beside it keep forming KV-cache groups
(:mod:`kvcache_core.contract.groups`). ``LayerSpec(state=..., keeps_kv=True)`` declares a
layer keeping both (Falcon-H1 and Zamba2 run a Mamba mixer and attention in one layer): its
K/V join a KV-cache group, its state the state pool, each policy treating them as it treats
those of separate layers.

The states live in a **state pool** beside the block pool: each state array of each state
layer is one backend array ``[num_state_slots, *shape]``, and each live request holds one
slot, taken by ``allocate`` (and ``fork``, ``swap_in``), given back by ``deallocate`` (and
``swap_out``). A backend serves it through the optional storage member
``state_storage(arrays, num_slots)`` returning a :class:`StateStorage`, and claims the
capability ``"state_layers"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.scalars import INT32_MAX, as_integer, shown
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    InvalidConfigError,
    LayerIndexError,
    ShapeMismatchError,
)

__all__ = [
    "STATE_DTYPES",
    "STATE_LAYERS",
    "STATE_RECORD_GROUP",
    "StateArray",
    "StatePool",
    "StateSpec",
    "StateStorage",
]

ArrayT = TypeVar("ArrayT")

#: The dtypes a state array may have (a backend holds those of its ``BackendSpec.dtypes``).
#: Host copies use the host form of :mod:`kvcache_core.offload.host_form` (bfloat16 as its
#: ``uint16`` bit patterns).
STATE_DTYPES: Final[dict[str, int]] = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

#: The capability name of a backend whose storage serves state layers.
STATE_LAYERS: Final = "state_layers"

#: The KV-cache group number an offload tier's record of a state checkpoint is filed under
#: (``record_key(block_hash, STATE_RECORD_GROUP)``): no pool has that many groups, so a
#: checkpoint's key never meets a block's.
STATE_RECORD_GROUP: Final = 0xFFFF

#: The most elements one state array may have per request.
MAX_STATE_ELEMENTS: Final = INT32_MAX


@dataclass(frozen=True, slots=True)
class StateArray:
    """One array of a layer's recurrent state, per request: ``name``, ``shape`` (without the
    request axis) and ``dtype`` (one of :data:`STATE_DTYPES`).

    Raises:
        InvalidConfigError: an empty or non-str name, a shape that is not a non-empty
            sequence of ints in ``[1, INT32_MAX]`` (at most ``INT32_MAX`` elements in all),
            or an unknown dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidConfigError(f"StateArray.name must be a non-empty str, got {shown(self.name)}")
        object.__setattr__(self, "name", str(self.name))
        given: object = self.shape
        if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
            raise InvalidConfigError(f"StateArray {self.name!r}: shape must be a sequence of ints, got {shown(given)}")
        dims: list[int] = []
        for item in cast("Iterable[object]", given):
            dim = as_integer(item)
            if dim is None or not 1 <= dim <= INT32_MAX:
                raise InvalidConfigError(
                    f"StateArray {self.name!r}: shape {shown(given)} has {shown(item)}; each dimension is an int "
                    f"in [1, {INT32_MAX}]"
                )
            dims.append(dim)
        if not dims or math.prod(dims) > MAX_STATE_ELEMENTS:
            raise InvalidConfigError(
                f"StateArray {self.name!r}: shape {tuple(dims)} must have 1 or more dimensions and at most "
                f"{MAX_STATE_ELEMENTS} elements"
            )
        object.__setattr__(self, "shape", tuple(dims))
        dtype = str(self.dtype) if isinstance(self.dtype, str) else self.dtype
        if not isinstance(dtype, str) or dtype not in STATE_DTYPES:
            raise InvalidConfigError(
                f"StateArray {self.name!r}: dtype {shown(self.dtype)} is unknown; valid: {', '.join(STATE_DTYPES)}"
            )
        object.__setattr__(self, "dtype", dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of one request's array."""
        return math.prod(self.shape) * STATE_DTYPES[self.dtype]


def _fields(item: object) -> tuple[Any, ...]:
    """``(name, shape[, dtype])`` as a tuple; ``()`` for anything else."""
    return tuple(cast("Iterable[Any]", item)) if isinstance(item, tuple) else ()


@dataclass(frozen=True, slots=True, init=False)
class StateSpec:
    """The recurrent state of one layer: its arrays, each of a fixed shape per request.

    ``StateSpec(arrays=(("conv", (conv_dim, kernel), "float32"), ("recurrent", (heads,
    head_dim, state_size), "float32")))``; each item a :class:`StateArray` or its
    ``(name, shape, dtype)`` (dtype optional, float32 by default).

    Raises:
        InvalidConfigError: no arrays, a repeated name, or a bad array (see
            :class:`StateArray`).
    """

    arrays: tuple[StateArray, ...]

    def __init__(self, arrays: Iterable[StateArray | tuple[Any, ...]]) -> None:
        if isinstance(arrays, (str, bytes)) or not isinstance(arrays, Iterable):
            raise InvalidConfigError(
                f"StateSpec.arrays must be a sequence of StateArray or (name, shape, dtype), got {shown(arrays)}"
            )
        items: list[StateArray] = []
        for item in cast("Iterable[object]", arrays):
            if isinstance(item, StateArray):
                items.append(item)
            elif len(fields := _fields(item)) in (2, 3):
                items.append(StateArray(*fields))
            else:
                raise InvalidConfigError(
                    f"StateSpec.arrays: {shown(item)} is neither a StateArray nor (name, shape[, dtype])"
                )
        names = [item.name for item in items]
        if not items or len(set(names)) != len(names):
            raise InvalidConfigError(f"StateSpec needs one or more arrays of distinct names, got {names}")
        object.__setattr__(self, "arrays", tuple(items))

    @property
    def nbytes(self) -> int:
        """Bytes of one request's state (every array)."""
        return sum(array.nbytes for array in self.arrays)

    def names(self) -> tuple[str, ...]:
        """The arrays' names, in order."""
        return tuple(array.name for array in self.arrays)


class StateStorage(Protocol[ArrayT]):
    """A backend's state pool: one native array ``[num_slots, *shape]`` per state array.

    Built by the optional :class:`~kvcache_core.KvStorage` member
    ``state_storage(arrays: tuple[StateArray, ...], num_slots: int) -> StateStorage[T]``
    (zero-filled), which a backend claiming ``"state_layers"`` provides; it raises
    :class:`~kvcache_core.errors.UnsupportedConfigError` for a dtype it does not hold. The
    manager calls these methods with validated arguments: ``index`` in
    ``[0, len(arrays))``, slots ``[n]`` int64 distinct and in ``[0, num_slots)``, values of
    the array's shape and dtype.
    """

    def read(self, index: int, slots: npt.NDArray[np.int64]) -> ArrayT:
        """A copy of array ``index`` at ``slots``: ``[n, *shape]``."""
        ...

    def write(self, index: int, slots: npt.NDArray[np.int64], values: ArrayT) -> None:
        """Write ``values`` ``[n, *shape]`` into array ``index`` at ``slots``."""
        ...

    def copy(self, source: npt.NDArray[np.int64], destination: npt.NDArray[np.int64]) -> None:
        """Copy every array's slot ``source[i]`` into ``destination[i]``."""
        ...

    def zero(self, slots: npt.NDArray[np.int64]) -> None:
        """Set every array at ``slots`` to zeros."""
        ...

    def to_host(self, slots: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], ...]:
        """Host copies of every array at ``slots``, ``[n, *shape]`` each, in the host form of
        its dtype (:func:`kvcache_core.offload.host_form.host_dtype`)."""
        ...

    def from_host(self, slots: npt.NDArray[np.int64], arrays: Sequence[npt.NDArray[Any]]) -> None:
        """Write host copies (:meth:`to_host` of any backend) into ``slots``, bit for bit."""
        ...

    def array(self, index: int) -> ArrayT:
        """Array ``index`` itself, ``[num_slots, *shape]`` (a view with a mutable array
        library, the current array with an immutable one)."""
        ...


def state_host_dtype(dtype: str) -> np.dtype[Any]:
    """The NumPy dtype of a state array's host form (bfloat16 as ``uint16`` bits)."""
    return np.dtype("uint16" if dtype == "bfloat16" else dtype)


@dataclass(frozen=True, slots=True)
class StatePool:
    """The state pool of a config (``CacheConfig.states``).

    Attributes:
        arrays: ``(model layer, array)`` of every state array, layer after layer: the
            pool's arrays, in order (empty without state layers).
        num_slots: requests the pool holds at once (0 without state layers).
    """

    arrays: tuple[tuple[int, StateArray], ...] = ()
    num_slots: int = 0

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one request's state, every state layer and array."""
        return sum(array.nbytes for _, array in self.arrays)

    @classmethod
    def of(cls, specs: Sequence[object], state_slots: object, num_blocks: int) -> StatePool:
        """The pool of ``specs`` (one ``LayerSpec`` per layer) and ``CacheConfig.state_slots``
        (``None``: ``min(num_blocks, 32)``).

        Raises:
            InvalidConfigError: slots not an int in ``[1, INT32_MAX]`` (nor ``None``), or
                given for a pool without state layers.
        """
        arrays: list[tuple[int, StateArray]] = []
        for layer, spec in enumerate(specs):
            state = cast("StateSpec | None", getattr(spec, "state", None))
            if state is not None:
                arrays.extend((layer, array) for array in state.arrays)
        if state_slots is None:
            return cls(tuple(arrays), min(num_blocks, 32) if arrays else 0)
        count = as_integer(state_slots)
        if count is None or not 1 <= count <= INT32_MAX:
            raise InvalidConfigError(
                f"CacheConfig.state_slots must be an int in [1, {INT32_MAX}] or None, got {shown(state_slots)}"
            )
        if not arrays:
            raise InvalidConfigError(
                f"CacheConfig.state_slots={count} is for pools with state layers (LayerSpec(state=...)); this one has none"
            )
        return cls(tuple(arrays), count)


def not_kv_layer(layer: int, state: StateSpec | None) -> LayerIndexError:
    """The error of a K/V operation on a layer keeping no K/V (a state only, or nothing)."""
    if state is None:
        return LayerIndexError(
            f"layer {layer} keeps nothing (LayerSpec(keeps_kv=False) without a state): it has no K/V to write or read"
        )
    return LayerIndexError(
        f"layer {layer} keeps a recurrent state ({', '.join(state.names())}), not K/V: read and write it with "
        "step.state / step.write_state"
    )


def check_state_host(arrays: Sequence[StateArray], given: Sequence[object], count: int) -> None:
    """Refuse host copies that are not ``count`` slots of ``arrays`` in host form.

    Raises:
        ShapeMismatchError: not one array per state array, or a wrong shape.
        DTypeMismatchError: a wrong host dtype. ArrayTypeError: not a NumPy array.
    """
    if len(given) != len(arrays):
        raise ShapeMismatchError(f"host states hold {len(given)} arrays; the state pool has {len(arrays)}")
    for array, value in zip(arrays, given, strict=True):
        if not isinstance(value, np.ndarray):
            raise ArrayTypeError(f"host state {array.name!r} must be a numpy.ndarray, got {type(value).__name__}")
        host = cast("npt.NDArray[Any]", value)
        expected = (count, *array.shape)
        if host.shape != expected:
            raise ShapeMismatchError(f"host state {array.name!r} must have shape {expected}, got {host.shape}")
        if host.dtype != state_host_dtype(array.dtype):
            raise DTypeMismatchError(
                f"host state {array.name!r} must have dtype {state_host_dtype(array.dtype)} (the host form of "
                f"{array.dtype}), got {host.dtype}"
            )
