"""The host form of pool blocks: one NumPy form per pool dtype, the same on every backend.

It is what ``KvStorage.blocks_to_host`` returns and ``blocks_from_host`` takes, what swap
keeps, what offload tiers hold and what a prefix-cache file stores, so host copies move
between backends (NumPy, torch, JAX, memmap, a third party's) bit for bit. Arrays are
``[layers, n, block_size, num_heads, width]`` (a tier's record drops the ``n`` axis), in
this order whatever the pool's layout; ``head_dim`` below is the keys' width and, for values,
``CacheConfig.value_width`` (the two differ in a pool with ``value_head_dim``):

================================  ==========  ====================================================
pool dtype                        host dtype  elements
================================  ==========  ====================================================
float32, float16, float64         the same    the values (``width = head_dim``)
bfloat16                          uint16      each value's 16-bit pattern (``width = head_dim``)
int8, float8_e4m3fn               uint8       per token head: ``head_dim`` raw bytes, then the 4
                                              bytes of its float32 scale (``width = head_dim + 4``,
                                              :mod:`kvcache_core.contract.quantization`)
================================  ==========  ====================================================

bfloat16 travels as its bit pattern because NumPy has no bfloat16: the pattern is exact,
as small as the pool's elements, needs nothing beyond NumPy (``ml_dtypes.bfloat16``, which
JAX produces, would make core depend on ml_dtypes, and safetensors' NumPy reader cannot
load it), and it is how the compiled kernel reads bfloat16 already. A backend converts
with a bit-cast (torch ``view(torch.int16)``, JAX/``ml_dtypes`` ``view(np.uint16)``), never
through float values. :func:`bfloat16_to_float32` decodes it exactly;
:func:`float32_to_bfloat16` encodes (round to nearest even); :func:`host_values` decodes any
host form to float64.
"""

from __future__ import annotations

from typing import Any, Final, Literal, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract import quantization
from kvcache_core.contract.config import SCALE_BYTES, CacheConfig
from kvcache_core.errors import ArrayTypeError, DTypeMismatchError, InvalidArgumentError, ShapeMismatchError

__all__ = [
    "HOST_DTYPES",
    "bfloat16_to_float32",
    "check_host_array",
    "check_host_block",
    "check_host_content",
    "float32_to_bfloat16",
    "host_dtype",
    "host_record_shape",
    "host_shape",
    "host_values",
    "host_width",
]

#: Which half of a block a host array holds: its keys or its values (their widths may differ).
Part = Literal["keys", "values"]

#: The NumPy dtype of the host form of each pool dtype (see the module docstring).
HOST_DTYPES: Final[dict[str, str]] = {
    "float32": "float32",
    "float16": "float16",
    "float64": "float64",
    "bfloat16": "uint16",
    "int8": "uint8",
    "float8_e4m3fn": "uint8",
}

#: The e4m3fn bytes that are NaN (it has no infinities): every exponent and mantissa bit set.
_FLOAT8_NAN_BITS: Final = 0x7F


def host_dtype(dtype: str) -> np.dtype[Any]:
    """The NumPy dtype of the host form of a pool of ``dtype``.

    Raises:
        InvalidArgumentError: ``dtype`` is not a pool dtype (the message lists them).
    """
    try:
        return np.dtype(HOST_DTYPES[dtype])
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"no host form for dtype {dtype!r}; pool dtypes: {', '.join(HOST_DTYPES)}") from None


def host_width(config: CacheConfig, part: Part = "keys") -> int:
    """The last axis of the host form of ``part``: ``head_dim`` for keys, ``value_width`` for
    values, plus the 4 scale bytes when quantized.

    Raises:
        InvalidArgumentError: ``part`` is neither ``"keys"`` nor ``"values"``.
    """
    if part not in ("keys", "values"):
        raise InvalidArgumentError(f"part must be 'keys' or 'values', got {part!r}")
    width = config.head_dim if part == "keys" else config.value_width
    return width + (SCALE_BYTES if config.quantized else 0)


def host_record_shape(config: CacheConfig, part: Part = "keys") -> tuple[int, int, int, int]:
    """Shape of one block's keys (or, with ``part="values"``, values) in host form:
    ``[pool_layers, block_size, num_heads, width]`` (:func:`host_width`)."""
    return (config.pool_layers, config.block_size, config.num_heads, host_width(config, part))


def host_shape(config: CacheConfig, count: int, part: Part = "keys") -> tuple[int, int, int, int, int]:
    """Shape of ``count`` blocks' keys (or, with ``part="values"``, values) in host form:
    ``[pool_layers, count, block_size, num_heads, width]`` (:func:`host_width`)."""
    layers, block_size, heads, width = host_record_shape(config, part)
    return (layers, count, block_size, heads, width)


def check_host_array(config: CacheConfig, name: str, array: object, shape: tuple[int, ...]) -> None:
    """Refuse ``array`` unless it is a NumPy array of the host form of ``config``'s dtype,
    of ``shape`` (:func:`host_shape` or :func:`host_record_shape`). Nothing is cast.

    Raises:
        ArrayTypeError: not a ``numpy.ndarray``.
        DTypeMismatchError: another dtype than :func:`host_dtype` (the message names both).
        ShapeMismatchError: another shape.
    """
    if not isinstance(array, np.ndarray):
        raise ArrayTypeError(f"{name} must be a numpy.ndarray in host form, got {type(array).__name__}")
    checked: np.ndarray[Any, Any] = array  # pyright: ignore[reportUnknownVariableType]
    expected = host_dtype(config.dtype)
    if checked.dtype != expected:
        raise DTypeMismatchError(
            f"{name} have dtype {checked.dtype}; the host form of a {config.dtype} pool is {expected} "
            "(kvcache_core.offload.host_form)"
        )
    if tuple(checked.shape) != tuple(shape):
        dim = (
            "value_width"
            if config.value_head_dim is not None and shape[-1] == host_width(config, "values")
            else "head_dim"
        )
        width = f"{dim} + 4 scale bytes" if config.quantized else dim
        axes = "layers, blocks, block_size, heads" if len(shape) == 5 else "layers, block_size, heads"
        raise ShapeMismatchError(
            f"{name} must have shape {tuple(shape)} ([{axes}, {width}] in host form), got {tuple(checked.shape)}"
        )


def check_host_content(config: CacheConfig, name: str, array: npt.NDArray[Any]) -> None:
    """Refuse host blocks whose content no write can produce, for host form read from
    outside (files, tier records): a quantized pool's scales must be finite and not
    negative (float32, so within its range; 0 for a token head of zeros or an unwritten
    slot), and float8 raw values must not be NaN. Unquantized blocks hold any values.
    Call after :func:`check_host_array`.

    Raises:
        InvalidArgumentError: naming the first bad element ``[..., token, head]`` and its value.
    """
    if not config.quantized:
        return
    raw, scales = quantization.unpack_host(config, array, name)
    good = np.isfinite(scales) & ~np.signbit(scales)
    if not good.all():
        index = tuple(int(i) for i in np.unravel_index(int(np.argmin(good)), scales.shape))
        raise InvalidArgumentError(
            f"{name}{list(index)} has scale {float(scales[index])!r}; a scale is finite and >= 0 "
            f"(float32, at most {float(np.finfo(np.float32).max)!r})"
        )
    if config.dtype == "float8_e4m3fn":
        nan = (raw.view(np.uint8) & np.uint8(_FLOAT8_NAN_BITS)) == _FLOAT8_NAN_BITS
        if nan.any():
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(nan)), nan.shape))
            raise InvalidArgumentError(
                f"{name}{list(index)} is a float8 NaN; a quantized pool holds finite values only"
            )


def check_host_block(config: CacheConfig, name: str, array: object, part: Part = "keys") -> None:
    """Refuse one block's keys (or, with ``part="values"``, values) read from outside (an
    offload tier's record) unless :func:`check_host_array` (of :func:`host_record_shape`) and
    :func:`check_host_content` accept it.

    Raises:
        ArrayTypeError, DTypeMismatchError, ShapeMismatchError, InvalidArgumentError: naming
            what is wrong.
    """
    check_host_array(config, name, array, host_record_shape(config, part))
    check_host_content(config, name, cast("npt.NDArray[Any]", array))


def bfloat16_to_float32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """The values of bfloat16 bit patterns, as float32 (exact: bfloat16 is float32's upper half).

    Raises:
        DTypeMismatchError: ``bits`` is not a uint16 array.
    """
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16:
        raise DTypeMismatchError(f"bfloat16 bit patterns are uint16, got {getattr(bits, 'dtype', type(bits).__name__)}")
    widened: npt.NDArray[np.float32] = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return widened


def float32_to_bfloat16(values: npt.ArrayLike, *, exact: bool = False) -> npt.NDArray[np.uint16]:
    """bfloat16 bit patterns of ``values`` (taken as float32), rounded to nearest, ties to
    even; NaN stays NaN.

    Args:
        exact: refuse values bfloat16 does not hold exactly instead of rounding them.

    Raises:
        InvalidArgumentError: with ``exact``, a value bfloat16 does not hold (the first is named).
    """
    data = np.ascontiguousarray(values, dtype=np.float32)
    word = data.view(np.uint32)
    if exact:
        inexact = (word & np.uint32(0xFFFF)) != 0
        if inexact.any():
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(inexact)), data.shape))
            raise InvalidArgumentError(f"value {float(data[index])!r} at {list(index)} is not a bfloat16 value")
        upper: npt.NDArray[np.uint16] = (word >> np.uint32(16)).astype(np.uint16)
        return upper
    bias = np.uint32(0x7FFF) + ((word >> np.uint32(16)) & np.uint32(1))
    rounded: npt.NDArray[np.uint16] = ((word + bias) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(data)
    if nan.any():  # rounding could carry a NaN's mantissa into the exponent: keep it a quiet NaN
        rounded[nan] = ((word[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def host_values(config: CacheConfig, array: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """The K/V values host blocks of ``config``'s dtype hold, as float64 (bfloat16 decoded,
    quantized blocks dequantized: ``raw * scale``).

    Raises:
        DTypeMismatchError: ``array`` is not the host form of ``config.dtype``.
    """
    expected = host_dtype(config.dtype)
    if not isinstance(array, np.ndarray) or array.dtype != expected:
        raise DTypeMismatchError(
            f"host blocks of a {config.dtype} pool are {expected}, got {getattr(array, 'dtype', type(array).__name__)}"
        )
    if config.quantized:
        return quantization.dequantize_host(config, array).astype(np.float64)
    if config.dtype == "bfloat16":
        return bfloat16_to_float32(array).astype(np.float64)
    return array.astype(np.float64)
