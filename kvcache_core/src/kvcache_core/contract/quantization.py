"""Quantized pools: the int8 and float8 (e4m3) encodings, their scales and their host form.

A quantized pool (``CacheConfig(dtype="int8" | "float8_e4m3fn")``) stores each K/V element
in one byte and, beside every token of every KV head, the float32 scale that decodes it:
``value = raw * scale``. The scales live in the storage next to the blocks they describe
(same block ids), so every block copy, host transfer, fork, swap, prefix hit and eviction
moves them with their blocks without the manager knowing.

- **int8**: symmetric, one scale per token per KV head, computed at write time:
  ``scale = max(|x|) * float32(1 / 127)`` over the head's features, ``raw = round(x / scale)``. A token
  head of zeros has scale 0.
- **float8_e4m3fn**: one scale per KV head per layer (K and V apart). Either calibrated
  (``CacheConfig.kv_scales``, fixed; values beyond ``448 * scale`` saturate to ``+-448``, as
  vLLM does), or tracked by the *running-maximum rule*: before each write, the scale of
  every (layer, K/V, head) becomes ``max(previous scale, max(|x|) * float32(1 / 448))`` over the tokens
  written, so nothing written ever saturates. Each token records the scale in effect
  when it was written (4 bytes per token per head, 3% of a 128-feature head), so a scale
  that grows later never changes the meaning of older tokens.

A scale below the smallest normal float32 (``FLOAT32_TINY``, about 1.2e-38) is 0 on every
backend: the token heads it would serve hold values under about 1e-36, which decode as 0
(with such a scale ``1 / scale`` overflows, and XLA flushes it to 0 anyway).

Writing NaN or an infinity to a quantized pool raises
:class:`~kvcache_core.errors.InvalidArgumentError` before anything changes: its scale would
silently poison the whole token head.

Host form (``blocks_to_host`` of a quantized pool, what swap keeps): ``uint8`` arrays
``[num_layers, n, block_size, num_heads, head_dim + 4]``: each token head's ``head_dim`` raw
bytes followed by the 4 bytes of its float32 scale, so a round trip is bit-exact (values:
``value_width`` raw bytes, in a pool whose values differ in width from its keys).
:func:`unpack_host` splits it into raw values and scales; :func:`dequantize_host` decodes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import QUANTIZED_DTYPES, QUANTIZED_RANGE, SCALE_BYTES, CacheConfig
from kvcache_core.contract.scalars import FLOAT32_TINY
from kvcache_core.errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError

__all__ = [
    "QUANTIZED_RANGE",
    "SCALE_BYTES",
    "check_finite",
    "dequantize",
    "dequantize_host",
    "flush_tiny_scales",
    "grow_running_scales",
    "non_finite_message",
    "pack_host",
    "quantize",
    "raw_numpy_dtype",
    "unpack_host",
]

FloatArray = npt.NDArray[np.floating[Any]]


def _reciprocal(dtype: str) -> np.float32:
    """``1 / range`` in float32: a scale is ``max(|x|)`` times it (one rounding, as every
    backend computes it, so the encodings agree bit for bit)."""
    reciprocal: np.float32 = np.float32(1.0 / QUANTIZED_RANGE[dtype])
    return reciprocal


def raw_numpy_dtype(dtype: str) -> np.dtype[Any]:
    """The NumPy dtype of a quantized pool's raw elements: ``int8``, or ``ml_dtypes``'
    ``float8_e4m3fn``.

    Raises:
        InvalidArgumentError: ``dtype`` is not one of :data:`~kvcache_core.contract.config.QUANTIZED_DTYPES`.
    """
    if dtype == "int8":
        return np.dtype(np.int8)
    if dtype == "float8_e4m3fn":
        import ml_dtypes

        fp8: np.dtype[Any] = np.dtype(ml_dtypes.float8_e4m3fn)
        return fp8
    raise InvalidArgumentError(f"{dtype!r} is not a quantized dtype; valid: {', '.join(QUANTIZED_DTYPES)}")


def check_finite(name: str, values: npt.NDArray[Any]) -> None:
    """Refuse NaN and infinities in K/V bound for a quantized pool.

    Raises:
        InvalidArgumentError: naming the first bad element ``[token, head, feature]``.
    """
    finite = np.isfinite(values)
    if not finite.all():
        index = tuple(int(i) for i in np.unravel_index(int(np.argmin(finite)), values.shape))
        raise InvalidArgumentError(non_finite_message(name, index, float(values[index])))


def non_finite_message(name: str, index: tuple[int, ...], value: float) -> str:
    """The message of a refused non-finite write (shared by every backend)."""
    return (
        f"{name}{list(index)} = {value!r}: a quantized pool holds finite values only "
        "(its scale would poison the whole token head); nothing was written"
    )


def flush_tiny_scales(scales: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``scales`` with those below ``FLOAT32_TINY`` (subnormal) set to 0."""
    flushed: npt.NDArray[np.float32] = np.where(scales >= np.float32(FLOAT32_TINY), scales, np.float32(0))
    return flushed


def grow_running_scales(scales: npt.NDArray[np.float32], values: FloatArray) -> npt.NDArray[np.float32]:
    """The float8 running-maximum rule: ``max(scales, max(|values|) / 448)`` per head.

    Args:
        scales: ``[num_heads]`` current scales (0 before the first write).
        values: ``[n, num_heads, head_dim]`` finite K or V about to be written.
    """
    if values.shape[0] == 0:
        return scales
    peak = flush_tiny_scales(np.abs(values).max(axis=(0, 2)).astype(np.float32) * _reciprocal("float8_e4m3fn"))
    grown: npt.NDArray[np.float32] = np.maximum(scales, peak)
    return grown


def quantize(
    dtype: str, values: FloatArray, head_scales: npt.NDArray[np.float32] | None = None
) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """Encode finite ``values [n, num_heads, head_dim]`` in one pass.

    Args:
        dtype: ``"int8"`` (a scale per token head, from its maximum) or ``"float8_e4m3fn"``
            (``head_scales [num_heads]``, required).

    Returns:
        ``(raw [n, num_heads, head_dim], scales [n, num_heads] float32)``.
    """
    data = np.asarray(values, dtype=np.float32)
    limit = np.float32(QUANTIZED_RANGE[dtype])
    if dtype == "int8":
        scales = (
            (np.abs(data).max(axis=2) * _reciprocal(dtype)).astype(np.float32)
            if data.size
            else np.zeros(data.shape[:2], np.float32)
        )
    else:
        if head_scales is None:
            raise InvalidArgumentError("float8 quantization needs one scale per KV head")
        scales = np.broadcast_to(head_scales.astype(np.float32), data.shape[:2]).copy()
    scales = flush_tiny_scales(scales)
    inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales > 0)
    scaled = data * inverse[:, :, None]
    np.clip(scaled, -limit, limit, out=scaled)
    if dtype == "int8":
        np.rint(scaled, out=scaled)
    return scaled.astype(raw_numpy_dtype(dtype)), scales


def dequantize(raw: npt.NDArray[Any], scales: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``raw [..., head_dim] * scales [...]`` as float32."""
    decoded: npt.NDArray[np.float32] = raw.astype(np.float32) * scales[..., None]
    return decoded


def pack_host(raw: npt.NDArray[Any], scales: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """The host form: ``raw [..., head_dim]`` bytes then ``scales [...]`` float32 bytes,
    ``uint8 [..., head_dim + 4]``."""
    raw_bytes = np.ascontiguousarray(raw).view(np.uint8)
    scale_bytes = np.ascontiguousarray(scales, dtype=np.float32)[..., None].view(np.uint8)
    packed: npt.NDArray[np.uint8] = np.concatenate([raw_bytes, scale_bytes], axis=-1)
    return packed


def unpack_host(
    config: CacheConfig, packed: npt.NDArray[Any], name: str = "host blocks"
) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
    """Split a quantized pool's host form into ``(raw [..., width], scales [...])`` copies;
    ``width`` is the keys' ``head_dim`` or the values' ``value_width`` (the last axis says which).

    Raises:
        DTypeMismatchError: ``packed`` is not uint8.
        ShapeMismatchError: its last axis is neither ``head_dim + 4`` nor ``value_width + 4``.
    """
    array = np.asarray(packed)
    if array.dtype != np.uint8:
        raise DTypeMismatchError(f"{name} of a {config.dtype} pool are uint8 (raw bytes + scale), got {array.dtype}")
    widths = {config.head_dim + SCALE_BYTES, config.value_width + SCALE_BYTES}
    if array.ndim < 1 or array.shape[-1] not in widths:
        value_width = "" if config.value_head_dim is None else f" or value_width {config.value_width}"
        raise ShapeMismatchError(
            f"{name} of a {config.dtype} pool end in an axis of {' or '.join(str(w) for w in sorted(widths))} bytes "
            f"(head_dim {config.head_dim}{value_width} + a {SCALE_BYTES}-byte scale), got shape {array.shape}"
        )
    dim = array.shape[-1] - SCALE_BYTES
    raw = np.ascontiguousarray(array[..., :dim]).view(raw_numpy_dtype(config.dtype))
    scales = np.ascontiguousarray(array[..., dim:]).view(np.float32)[..., 0]
    return raw, scales


def dequantize_host(config: CacheConfig, packed: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Decode a quantized pool's host form to float32 ``[..., width]`` (keys' or values')."""
    raw, scales = unpack_host(config, packed)
    return dequantize(raw, scales)
