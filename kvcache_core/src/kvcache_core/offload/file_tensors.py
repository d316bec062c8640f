"""The block tensors of a prefix-cache file (:mod:`kvcache_core.offload.prefix_file`): written in core's
host form (:mod:`kvcache_core.offload.host_form`), read back exactly as stored, each tensor's
stored dtype checked against what the header declares, so nothing is ever cast.

Requires the ``tiers`` extra (safetensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.errors import CorruptCacheFileError, IncompatibleCacheFileError, InvalidArgumentError
from kvcache_core.offload import host_form

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig

__all__ = ["SAFETENSORS_CODES", "block_in_host_form", "load_tensors", "stack_blocks", "stored_dtypes"]

HostArray = npt.NDArray[Any]

#: The safetensors dtype code of each host form (:data:`kvcache_core.offload.host_form.HOST_DTYPES`).
SAFETENSORS_CODES: Final[dict[str, str]] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "uint16": "U16",
    "uint8": "U8",
}


def stack_blocks(config: CacheConfig, blocks: Sequence[tuple[HostArray, HostArray]]) -> tuple[HostArray, HostArray]:
    """The blocks' ``(keys, values)`` stacked ``[pool_layers, n, block_size, num_heads, width]``,
    each block checked to be in the host form of ``config.dtype`` (nothing is cast).

    Raises:
        ArrayTypeError, DTypeMismatchError, ShapeMismatchError: a block is not (the message
            names it).
    """
    key_shape = host_form.host_record_shape(config)
    value_shape = host_form.host_record_shape(config, "values")
    for index, (keys, values) in enumerate(blocks):
        host_form.check_host_array(config, f"block {index}'s keys", keys, key_shape)
        host_form.check_host_array(config, f"block {index}'s values", values, value_shape)
    if not blocks:
        form = host_form.host_dtype(config.dtype)
        return np.zeros(host_form.host_shape(config, 0), form), np.zeros(
            host_form.host_shape(config, 0, "values"), form
        )
    return np.stack([keys for keys, _ in blocks], axis=1), np.stack([values for _, values in blocks], axis=1)


def stored_dtypes(header: Mapping[str, Any], config: CacheConfig, source: Path) -> dict[str, np.dtype[Any]]:
    """The safetensors dtype codes a file with ``header`` may store ``config.dtype`` blocks
    in, each with the NumPy dtype it is read as: the host form's; a version-1 bfloat16 file
    also float32 values (torch wrote them; :func:`block_in_host_form` converts them exactly)
    or ``BF16`` (JAX wrote them: the host form's bit patterns).

    Raises:
        IncompatibleCacheFileError: a version-2 header whose ``"tensor_dtype"`` is not the
            host form of ``config.dtype``.
    """
    form = host_form.host_dtype(config.dtype)
    allowed = {SAFETENSORS_CODES[form.name]: form}
    if header.get("version") == 1:
        if config.dtype == "bfloat16":
            allowed.update({"F32": np.dtype(np.float32), "BF16": form})
        return allowed
    declared = header.get("tensor_dtype")
    if declared != form.name:
        raise IncompatibleCacheFileError(
            f"{str(source)!r} declares its tensors {declared!r}; {config.dtype} blocks are stored in their "
            f"host form, {form.name!r}"
        )
    return allowed


def load_tensors(
    data: bytes, header: Mapping[str, Any], config: CacheConfig, source: Path
) -> tuple[HostArray, HostArray]:
    """The file's ``keys`` and ``values`` as stored (views of their bytes: no copy, no cast),
    each of a dtype :func:`stored_dtypes` allows.

    Raises:
        CorruptCacheFileError: the tensors do not parse, one is missing, stored in another
            dtype than the header allows (the message names both), or its bytes do not
            match its shape.
        IncompatibleCacheFileError: see :func:`stored_dtypes`.
    """
    from safetensors import deserialize  # the [tiers] extra  # pyright: ignore[reportUnknownVariableType]

    parse = cast("Callable[[bytes], list[tuple[str, Mapping[str, object]]]]", deserialize)  # left untyped upstream
    allowed = stored_dtypes(header, config, source)
    try:
        tensors = dict(parse(data))
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CorruptCacheFileError(f"{str(source)!r}: the block data does not load ({exc!r})") from exc
    loaded: list[HostArray] = []
    for name in ("keys", "values"):
        tensor = tensors.get(name)
        if tensor is None:
            raise CorruptCacheFileError(f"{str(source)!r}: the file has no {name!r} tensor")
        code, shape, raw = tensor.get("dtype"), tensor.get("shape"), tensor.get("data")
        element = allowed.get(code) if isinstance(code, str) else None
        if element is None:
            raise CorruptCacheFileError(
                f"{str(source)!r}: its {name} are stored as {code!r}; {config.dtype} blocks of format version "
                f"{header.get('version')} are stored as {' or '.join(sorted(allowed))}"
            )
        if not isinstance(shape, list) or not isinstance(raw, (bytes, bytearray)):
            raise CorruptCacheFileError(f"{str(source)!r}: the {name} tensor is malformed")
        dims = [int(dim) for dim in cast("list[int]", shape)]
        if min(dims, default=0) < 0 or len(raw) != math.prod(dims) * element.itemsize:
            raise CorruptCacheFileError(f"{str(source)!r}: the {name} tensor's bytes do not match its shape {dims}")
        loaded.append(np.frombuffer(raw, dtype=element).reshape(dims))
    return loaded[0], loaded[1]


def block_in_host_form(
    config: CacheConfig, keys: HostArray, values: HostArray, where: str
) -> tuple[HostArray, HostArray]:
    """One block of a file, as stored (its checksum checked), in host form: a version-1
    bfloat16 block's float32 values become bit patterns, exactly; and its content checked
    (:func:`kvcache_core.offload.host_form.check_host_content`: a quantized block's scales finite
    and >= 0).

    Raises:
        CorruptCacheFileError: a float32 value that is no bfloat16 value, or a bad scale
            (the message starts with ``where``).
    """
    try:
        if keys.dtype != host_form.host_dtype(config.dtype):  # only a version-1 bfloat16 file's float32
            keys = host_form.float32_to_bfloat16(keys, exact=True)
            values = host_form.float32_to_bfloat16(values, exact=True)
        host_form.check_host_content(config, "keys", keys)
        host_form.check_host_content(config, "values", values)
    except InvalidArgumentError as exc:
        raise CorruptCacheFileError(f"{where}: {exc}") from exc
    return keys, values
