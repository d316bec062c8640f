"""What every storage method returns, checked at run time against the ``KvStorage`` contract.

The type checkers see a storage's annotations; the kit sees what it returns. Each method
is called once with valid arguments and its result compared with the contract: the exact
container (a ``tuple`` of two arrays, not a list that merely unpacks like one), the
native array type (``array_info`` accepts it), the shape, the dtype and the device. Each
problem is one line naming the method and what it returned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload import host_form
from kvcache_core.testing.backend import BackendUnderTest

__all__ = ["storage_return_problems"]

#: Dtypes a host NumPy array holds exactly; others (bfloat16) may come back widened.
_HOST_EXACT = ("float16", "float32", "float64")

#: Device kinds that name one family of accelerators in different libraries.
_GPU_KINDS = frozenset({"cuda", "gpu", "rocm"})


def _items(value: object) -> list[object] | None:
    """The items of a list or tuple, ``None`` for anything else."""
    if isinstance(value, (list, tuple)):
        return list(cast("Sequence[object]", value))
    return None


def _describe(value: object) -> str:
    """``list of 2``, ``tuple of 3``, ``ndarray``, ``NoneType``, ... for messages."""
    items = _items(value)
    return type(value).__name__ if items is None else f"{type(value).__name__} of {len(items)}"


def device_kind(array: object) -> str | None:
    """The device kind an array lives on (``"cpu"``, ``"cuda"``, ``"gpu"``, ...), or ``None``
    when the array does not say (no Array API ``device`` attribute)."""
    device: object = getattr(array, "device", None)
    if device is None:
        return None
    for attribute in ("platform", "type"):  # jax.Device.platform, torch.device.type
        kind = getattr(device, attribute, None)
        if isinstance(kind, str):
            return kind.lower()
    devices: Any = getattr(array, "devices", None)  # a sharded jax.Array: its sharding's devices
    if callable(devices):
        listed = list(cast("Iterable[object]", devices()))
        platforms = {str(getattr(item, "platform", "")) for item in listed}
        return platforms.pop().lower() if len(platforms) == 1 else None
    return str(device).split(":")[0].lower() if isinstance(device, str) else None


def _same_device_kind(kind: str | None, config: CacheConfig) -> bool:
    if kind is None:
        return True
    expected = config.device.kind
    return kind == expected or (kind in _GPU_KINDS and expected in _GPU_KINDS)


class _Checker:
    """Collects one-line problems for one manager's storage."""

    def __init__(self, manager: PagedKvCacheManager[Any], context: str) -> None:
        self.manager = manager
        self.storage = manager.storage
        self.config = manager.config
        self.context = context
        self.problems: list[str] = []

    def problem(self, method: str, text: str) -> None:
        self.problems.append(f"KvStorage.{method} {text} ({self.context})")

    def native(self, method: str, value: object, shape: tuple[int, ...], what: str = "") -> None:
        """``value`` must be a native array of ``shape``, the pool's dtype, on its device."""
        label = f"{what} " if what else ""
        try:
            info = self.storage.array_info(value)
        except TypeError as exc:
            self.problem(method, f"returned {label}{_describe(value)}, not a native array ({exc})")
            return
        if not (isinstance(info, tuple) and len(info) == 2):  # pyright: ignore[reportUnnecessaryIsInstance]
            self.problem("array_info", f"returned {info!r}, expected (shape, dtype name)")
            return
        got_shape, dtype = info
        if tuple(got_shape) != shape:
            self.problem(method, f"returned {label}an array of shape {tuple(got_shape)}, expected {shape}")
        if dtype != self.config.dtype:
            self.problem(method, f"returned {label}an array of dtype {dtype}, expected the pool's {self.config.dtype}")
        kind = device_kind(value)
        if not _same_device_kind(kind, self.config):
            self.problem(method, f"returned {label}an array on {kind}, expected the pool's device {self.config.device}")

    def pair(self, method: str, value: object, shape: tuple[int, ...], host: bool = False) -> None:
        """``value`` must be a ``tuple`` ``(keys, values)`` of arrays of ``shape``."""
        items, shown = _items(value), _describe(value)
        if not isinstance(value, tuple) or items is None or len(items) != 2:
            self.problem(method, f"returned {shown}, expected a tuple (keys, values)")
            if items is None or len(items) != 2:
                return
        for what, item in zip(("keys", "values"), items, strict=True):
            if host:
                self.host_form(method, item, shape, what)
            else:
                self.native(method, item, shape, what)

    def numpy_array(
        self, method: str, value: object, shape: tuple[int, ...], label: str
    ) -> np.ndarray[Any, Any] | None:
        """``value`` if it is a NumPy array (a problem if its shape is not ``shape``), else
        ``None`` with a problem; ``label`` (``"keys "``, ...) names it in the problem."""
        if not isinstance(value, np.ndarray):
            self.problem(method, f"returned {label}{_describe(value)}, expected a numpy.ndarray")
            return None
        array: np.ndarray[Any, Any] = value  # pyright: ignore[reportUnknownVariableType]
        if tuple(array.shape) != shape:
            self.problem(method, f"returned {label}a numpy array of shape {tuple(array.shape)}, expected {shape}")
        return array

    def host(self, method: str, value: object, shape: tuple[int, ...], what: str = "") -> None:
        """``value`` must be a host NumPy array of ``shape`` holding the pool's dtype."""
        label = f"{what} " if what else ""
        array = self.numpy_array(method, value, shape, label)
        if array is None:
            return
        dtype = array.dtype.name
        if self.config.dtype in _HOST_EXACT and dtype != self.config.dtype:
            self.problem(method, f"returned {label}a numpy array of dtype {dtype}, expected {self.config.dtype}")
        if self.config.dtype not in _HOST_EXACT and dtype not in (self.config.dtype, "float32"):
            self.problem(
                method, f"returned {label}a numpy array of dtype {dtype}, expected {self.config.dtype} or float32"
            )

    def host_form(self, method: str, value: object, shape: tuple[int, ...], what: str) -> None:
        """``value`` must be a NumPy array of ``shape`` in core's host form of the pool's
        dtype, exactly (:mod:`kvcache_core.offload.host_form`: bfloat16 as ``uint16`` bit patterns)."""
        array = self.numpy_array(method, value, shape, f"{what} ")
        if array is None:
            return
        expected = host_form.host_dtype(self.config.dtype)
        if array.dtype != expected:
            self.problem(
                method,
                f"returned {what} a numpy array of dtype {array.dtype}, expected {expected}: the host form of a "
                f"{self.config.dtype} pool (kvcache_core.offload.host_form), the same on every backend",
            )

    def none(self, method: str, value: object) -> None:
        if value is not None:
            self.problem(method, f"returned {_describe(value)}, expected None")


def storage_return_problems(backend: BackendUnderTest, config: CacheConfig) -> list[str]:
    """Call every ``KvStorage`` method of a new pool of ``backend`` once; one line per problem."""
    manager = backend.manager(config)
    checker = _Checker(manager, f"dtype {config.dtype}, layout {config.kv_layout}")
    storage: Any = manager.storage  # Any: what it returns is what is checked
    heads, dim = config.num_heads, config.head_dim
    if storage.config != config:
        checker.problem("config", f"is {storage.config!r}, expected the config the pool was built for")
    for layer in range(config.num_layers):
        checker.native("key_cache", storage.key_cache(layer), config.block_shape())
        checker.native("value_cache", storage.value_cache(layer), config.block_shape())

    handle = manager.allocate(AllocationRequest("probe"))
    slots = manager.extend(handle, config.block_size + 3)
    count = len(slots)
    rng = np.random.default_rng(0)
    host_keys = BackendUnderTest.representable(rng.standard_normal((count, heads, dim)), config.dtype)
    keys = BackendUnderTest.native(manager, host_keys)
    checker.native("from_numpy", keys, (count, heads, dim))
    back = storage.to_numpy(keys)
    checker.host("to_numpy", back, (count, heads, dim))
    for layer in range(config.num_layers):
        checker.none("write", storage.write(layer, slots, keys, keys))

    blocks = np.asarray(handle.block_table().physical_blocks, dtype=np.int64)
    checker.pair("gather", storage.gather(0, blocks, count), (count, heads, dim))
    host_shape = (config.num_layers, len(blocks), config.block_size, heads, dim)
    copies = storage.blocks_to_host(blocks)
    checker.pair("blocks_to_host", copies, host_shape, host=True)
    spare = manager.allocate(AllocationRequest("spare", initial_tokens=len(blocks) * config.block_size))
    targets = np.asarray(spare.block_table().physical_blocks, dtype=np.int64)
    checker.none("copy_blocks", storage.copy_blocks(blocks, targets))
    pair = _items(copies)
    if pair is not None and len(pair) == 2:
        checker.none("blocks_from_host", storage.blocks_from_host(targets, pair[0], pair[1]))

    table = manager.page_table([handle])
    query = BackendUnderTest.native(
        manager, BackendUnderTest.representable(rng.standard_normal((1, 2 * heads, dim)), config.dtype)
    )
    indptr = np.asarray([0, 1], dtype=np.int32)
    output = storage.paged_attention(0, query, table, indptr, 1.0 / float(np.sqrt(dim)), True)
    checker.native("paged_attention", output, (1, 2 * heads, dim))

    try:
        storage.array_info(object())
    except TypeError:
        pass
    else:
        checker.problem("array_info", "accepted object(), expected TypeError for anything not a native array")
    return checker.problems
