"""State checkpoints off the pool: their records and their part of the portable format.

A checkpoint (a copy of a request's recurrent states after a whole number of blocks, filed
under the hash of its last block: :mod:`kvcache_core.paging.state_slots`) leaves the pool
as a :class:`~kvcache_core.offload.block_records.BlockRecord` of the reserved group
:data:`~kvcache_core.contract.states.STATE_RECORD_GROUP`, so every tier files and moves it
as it does a block, under ``record_key(block_hash, STATE_RECORD_GROUP)``. Its ``keys`` are
the checkpoint's host bytes, ``uint8 [bytes_per_slot]`` (each state array in the host form of
its dtype, ``C`` order, array after array in ``CacheConfig.states.arrays`` order), its
``values`` are empty (``uint8 [0]``); its hash, parent, salt and token ids are those of the
block it ends.

In a file (a prefix-cache file, a disk or remote tier's record) checkpoints raise the
format version to 3 and add to the header::

    "state_arrays": [[layer, name, [shape...], dtype], ...]   (the pool's, in order)
    "checkpoints": [{"hash", "parent", "salt", "token_ids", "checksum"}, ...]

and a tensor ``"states"``, ``uint8 [n, bytes_per_slot]``; ``checksum`` is the SHA-256 of a
checkpoint's bytes. A file of checkpoints loads only into a pool of the same state arrays
(each named with its shape and dtype); a file without them (versions 1 and 2) holds none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.states import STATE_RECORD_GROUP, check_state_host, state_host_dtype
from kvcache_core.errors import CorruptCacheFileError, IncompatibleCacheFileError, UnsupportedConfigError
from kvcache_core.offload.file_header import shown

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig

__all__ = [
    "STATE_FORMAT_VERSION",
    "STATE_RECORD_GROUP",
    "check_state_arrays",
    "checkpoint_checksum",
    "is_state_key",
    "load_checkpoint_bytes",
    "pack_states",
    "parse_tensors",
    "state_arrays_of",
    "state_problem",
    "unpack_states",
]

#: The format version of a file holding state checkpoints.
STATE_FORMAT_VERSION = 3

_STATE_SUFFIX = STATE_RECORD_GROUP.to_bytes(2, "big")


def is_state_key(key: bytes) -> bool:
    """Whether ``key`` files a state checkpoint's record (``record_key(hash, STATE_RECORD_GROUP)``)."""
    return len(key) == 34 and key[32:] == _STATE_SUFFIX


def state_arrays_of(config: CacheConfig) -> list[list[Any]]:
    """The pool's state arrays as a file's header names them: ``[layer, name, [shape], dtype]``."""
    return [[layer, array.name, list(array.shape), array.dtype] for layer, array in config.states.arrays]


def pack_states(config: CacheConfig, arrays: Sequence[npt.NDArray[Any]]) -> npt.NDArray[np.uint8]:
    """The bytes of one slot's host states (``StateStorage.to_host`` of one slot), array
    after array: ``uint8 [bytes_per_slot]``.

    Raises:
        ArrayTypeError, ShapeMismatchError, DTypeMismatchError: ``arrays`` are not one slot
            of the pool's state arrays in host form.
    """
    specs = [array for _, array in config.states.arrays]
    check_state_host(specs, arrays, 1)
    parts = [np.ascontiguousarray(array).reshape(-1).view(np.uint8) for array in arrays]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def unpack_states(config: CacheConfig, packed: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], ...]:
    """One slot's host states (``[1, *shape]`` each, own copies) from :func:`pack_states`'s bytes.

    Raises:
        UnsupportedConfigError: ``packed`` is not ``uint8 [bytes_per_slot]`` of this pool.
    """
    problem = _packed_problem(config, packed)
    if problem is not None:
        raise UnsupportedConfigError(f"a state checkpoint's bytes: {problem}")
    arrays: list[npt.NDArray[Any]] = []
    offset = 0
    for _, array in config.states.arrays:
        dtype = state_host_dtype(array.dtype)
        arrays.append(
            np.frombuffer(packed[offset : offset + array.nbytes].tobytes(), dtype=dtype).reshape((1, *array.shape))
        )
        offset += array.nbytes
    return tuple(arrays)


def _packed_problem(config: CacheConfig, packed: object) -> str | None:
    size = config.states.bytes_per_slot
    if not isinstance(packed, np.ndarray):
        return f"{type(packed).__name__}, not a NumPy array"
    held = cast("npt.NDArray[Any]", packed)
    if held.dtype != np.uint8 or held.shape != (size,):
        return f"{held.dtype} {held.shape}, the pool's checkpoints are uint8 ({size},)"
    return None


def state_problem(config: CacheConfig, keys: object, values: object) -> str | None:
    """What is wrong with a checkpoint record's ``keys`` and ``values`` for a pool of
    ``config`` (``None``: nothing): the bytes of one slot, and no values."""
    if not config.states.arrays:
        return "it is a state checkpoint, and this pool has no state layers"
    problem = _packed_problem(config, keys)
    if problem is not None:
        return f"its state bytes are {problem}"
    if not isinstance(values, np.ndarray) or cast("npt.NDArray[Any]", values).shape != (0,):
        return "a state checkpoint's values must be an empty uint8 array"
    return None


def checkpoint_checksum(packed: npt.NDArray[Any]) -> str:
    """SHA-256 (hex) of a checkpoint's bytes (the checksum of a record with empty values)."""
    return hashlib.sha256(np.ascontiguousarray(packed).tobytes()).hexdigest()


def check_state_arrays(header: Mapping[str, Any], config: CacheConfig, source: Path) -> int:
    """How many checkpoints ``header`` lists (0 for a file of version 1 or 2), once its state
    arrays are this pool's.

    Raises:
        CorruptCacheFileError: ``checkpoints`` in a file of version 1 or 2, or not a list.
        IncompatibleCacheFileError: another pool's state arrays (the message names both).
    """
    name = f"{str(source)!r}"
    listed: object = header.get("checkpoints")
    if header.get("version") != STATE_FORMAT_VERSION:
        if "checkpoints" in header or "state_arrays" in header:
            raise CorruptCacheFileError(
                f"{name}: state checkpoints in a file of version {shown(header.get('version'))}; they come in "
                f"version {STATE_FORMAT_VERSION}"
            )
        return 0
    if not isinstance(listed, list):
        raise CorruptCacheFileError(f"{name}: the header's 'checkpoints' is {shown(listed)}, not a list")
    stated: object = header.get("state_arrays")
    if stated != state_arrays_of(config) or not _exact_json(stated):
        raise IncompatibleCacheFileError(
            f"{name} holds state checkpoints of the arrays {shown(stated)} ([layer, name, shape, dtype]); this "
            f"pool's state arrays are {state_arrays_of(config)!r}"
        )
    return len(cast("list[object]", listed))


def _exact_json(value: object) -> bool:
    """No JSON ``true``/``false`` or float standing in for an int (``True == 1`` in Python)."""
    if isinstance(value, list):
        return all(_exact_json(item) for item in cast("list[object]", value))
    return not isinstance(value, (bool, float))


def load_checkpoint_bytes(
    tensors: Mapping[str, Mapping[str, object]], count: int, config: CacheConfig, source: Path
) -> npt.NDArray[np.uint8]:
    """The file's ``states`` tensor, ``uint8 [count, bytes_per_slot]`` (a view of its bytes).

    Raises:
        CorruptCacheFileError: it is missing, not ``U8``, or of another shape.
    """
    size = config.states.bytes_per_slot
    tensor = tensors.get("states")
    if tensor is None:
        raise CorruptCacheFileError(f"{str(source)!r}: the file lists {count} checkpoints and has no 'states' tensor")
    code, shape, raw = tensor.get("dtype"), tensor.get("shape"), tensor.get("data")
    if code != "U8" or shape != [count, size] or not isinstance(raw, (bytes, bytearray)) or len(raw) != count * size:
        raise CorruptCacheFileError(
            f"{str(source)!r}: its 'states' tensor is {shown(code)} {shown(shape)}; {count} checkpoints of this "
            f"pool are U8 [{count}, {size}]"
        )
    return np.frombuffer(bytes(raw), dtype=np.uint8).reshape((count, size))


def parse_tensors(data: bytes, source: Path) -> dict[str, Mapping[str, object]]:
    """The file's tensors, as safetensors parses them.

    Raises:
        CorruptCacheFileError: they do not parse.
    """
    from safetensors import deserialize  # the [tiers] extra  # pyright: ignore[reportUnknownVariableType]

    parse = cast("Callable[[bytes], list[tuple[str, Mapping[str, object]]]]", deserialize)
    try:
        return dict(parse(data))
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CorruptCacheFileError(f"{str(source)!r}: the state data does not load ({exc!r})") from exc
