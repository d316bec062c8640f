"""Quantized torch pools (``int8``, ``float8_e4m3fn``): encoding at write time and the torch
attention path that dequantizes while it reads.

The encodings and their scales are core's (:mod:`kvcache_core.contract.quantization`): int8 with one
scale per token per KV head from its maximum, float8 e4m3 with one scale per KV head per
layer (calibrated, or grown by the running maximum), each token recording its scale. On CPU
the compiled kernel of :mod:`kvcache_core.attention.kernel` attends a quantized pool in place;
:func:`attend_quantized` is the path elsewhere (CUDA, or numba missing).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.quantization import QUANTIZED_RANGE, non_finite_message
from kvcache_core.contract.scalars import FLOAT32_TINY
from kvcache_core.errors import InvalidArgumentError
from kvcache_torch.dispatch import run_kernel

__all__ = ["attend_quantized", "check_finite", "grow_running_scales", "kernel_attention", "quantize"]

_HEADS_FIRST_RUN = {"NHD": (2, 0, 1, 3), "HND": (1, 0, 2, 3)}


def _reciprocal(dtype: str) -> torch.Tensor:
    """``float32(1 / range)``, as core computes scales (one rounding: encodings agree bit for bit)."""
    return torch.tensor(1.0 / QUANTIZED_RANGE[dtype], dtype=torch.float32)


def check_finite(name: str, values: torch.Tensor) -> None:
    """Refuse NaN and infinities bound for a quantized pool.

    Raises:
        InvalidArgumentError: naming the first bad element ``[token, head, feature]``.
    """
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        flat = int(torch.argmin(finite.flatten().to(torch.uint8)))
        index = tuple(int(i) for i in np.unravel_index(flat, tuple(values.shape)))
        raise InvalidArgumentError(non_finite_message(name, index, float(values.flatten()[flat])))


def grow_running_scales(scales: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The float8 running-maximum rule: ``max(scales, max(|values|) / 448)`` per head
    (``scales [num_heads]``, ``values [n, num_heads, head_dim]``)."""
    if values.shape[0] == 0:
        return scales
    peak = values.detach().to(torch.float32).abs().amax(dim=(0, 2)) * _reciprocal("float8_e4m3fn")
    return torch.maximum(scales, _flush_tiny(peak))


def _flush_tiny(scales: torch.Tensor) -> torch.Tensor:
    """Scales below ``FLOAT32_TINY`` set to 0, as core's :func:`~kvcache_core.contract.quantization.flush_tiny_scales`."""
    return torch.where(scales >= FLOAT32_TINY, scales, 0.0)


def quantize(
    dtype: str, raw_dtype: torch.dtype, values: torch.Tensor, head_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode finite ``values [n, num_heads, head_dim]``: ``(raw, scales [n, num_heads] float32)``
    (int8: a scale per token head; float8: ``head_scales [num_heads]``)."""
    data = values.detach().to(torch.float32)
    limit = QUANTIZED_RANGE[dtype]
    if dtype == "int8":
        scales = data.abs().amax(dim=2) * _reciprocal(dtype) if data.numel() else data.new_zeros(data.shape[:2])
    else:
        if head_scales is None:
            raise InvalidArgumentError("float8 quantization needs one scale per KV head")
        scales = head_scales.to(torch.float32).expand(data.shape[0], -1).clone()
    scales = _flush_tiny(scales)
    inverse = torch.where(scales > 0, 1.0 / torch.where(scales > 0, scales, 1.0), 0.0)
    scaled = (data * inverse[:, :, None]).clamp_(-limit, limit)
    if dtype == "int8":
        scaled.round_()
    return scaled.to(raw_dtype), scales


def _run_tokens(cache: torch.Tensor, start: int, length: int, layout: str) -> torch.Tensor:
    """A run of blocks as ``[num_heads, length * block_size, head_dim]`` (the raw values)."""
    if layout == "heads_first":
        run = cache[:, start : start + length]
    else:
        run = cache[start : start + length].permute(*_HEADS_FIRST_RUN[layout])
    return run.reshape(run.shape[0], -1, run.shape[3])


def attend_quantized(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scales: torch.Tensor,
    value_scales: torch.Tensor,
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    scale: float,
    causal: bool,
    kv_layout: str,
) -> torch.Tensor:
    """Paged attention over a quantized layer, one run of blocks at a time: each run's raw
    keys give scores that its key scales multiply, its value scales multiply the softmax
    weights before the raw values do; the run is widened to float32, never scaled, and no
    copy of a request's whole context is made beyond its runs. Arguments as
    :func:`kvcache_torch.attention.attend_pool`, plus the layer's scales ``[num_heads,
    num_blocks, block_size]``.

    Returns:
        ``[total_queries, num_query_heads, value_dim]`` (the value pool's last axis) in
        ``query``'s dtype.
    """
    heads_axis = {"NHD": 2, "HND": 1, "heads_first": 0}[kv_layout]
    num_heads, head_dim = key_cache.shape[heads_axis], key_cache.shape[3]
    value_dim = value_cache.shape[3]
    group = query.shape[1] // num_heads
    block_size = page_table.block_size
    window = page_table.sliding_window
    offsets = [int(x) for x in qo_indptr.tolist()]
    output = query.new_empty((query.shape[0], query.shape[1], value_dim))
    with torch.no_grad():
        for b in range(page_table.batch_size):
            q_start, q_stop = offsets[b], offsets[b + 1]
            num_queries = q_stop - q_start
            if num_queries == 0:
                continue
            seq_len = int(page_table.seq_lens[b])
            q = (
                query[q_start:q_stop].to(torch.float32).view(num_queries, num_heads, group, head_dim).transpose(0, 1)
            ).reshape(num_heads, num_queries * group, head_dim) * scale
            scores_parts: list[torch.Tensor] = []
            positions: list[torch.Tensor] = []
            runs = list(page_table.runs(b))
            for run in runs:
                first = run.first_logical * block_size
                tokens = min(run.length * block_size, seq_len - first)
                keys = _run_tokens(key_cache, run.start, run.length, kv_layout)[:, :tokens].to(torch.float32)
                key_scale = key_scales[:, run.start : run.start + run.length].reshape(num_heads, -1)[:, :tokens]
                scores_parts.append(torch.matmul(q, keys.transpose(1, 2)) * key_scale[:, None, :])
                positions.append(torch.arange(first, first + tokens, device=query.device))
            scores = torch.cat(scores_parts, dim=2)
            key_positions = torch.cat(positions)
            row_positions = torch.arange(seq_len - num_queries, seq_len, device=query.device).repeat_interleave(group)
            hidden = torch.zeros(
                (row_positions.shape[0], key_positions.shape[0]), dtype=torch.bool, device=query.device
            )
            if causal:
                hidden |= key_positions[None, :] > row_positions[:, None]
            if window is not None:
                hidden |= key_positions[None, :] <= row_positions[:, None] - window
            scores = scores.masked_fill(hidden[None], -math.inf)
            weights = torch.softmax(scores, dim=-1)
            result = torch.zeros((num_heads, num_queries * group, value_dim), dtype=torch.float32, device=query.device)
            first_column = 0
            for run, part in zip(runs, scores_parts, strict=True):
                tokens = part.shape[2]
                values = _run_tokens(value_cache, run.start, run.length, kv_layout)[:, :tokens].to(torch.float32)
                value_scale = value_scales[:, run.start : run.start + run.length].reshape(num_heads, -1)[:, :tokens]
                run_weights = weights[:, :, first_column : first_column + tokens] * value_scale[:, None, :]
                result += torch.matmul(run_weights, values)
                first_column += tokens
            output[q_start:q_stop] = (
                result.view(num_heads, num_queries, group, value_dim)
                .transpose(0, 1)
                .reshape(num_queries, num_heads * group, value_dim)
                .to(query.dtype)
            )
    return output


def kernel_attention(
    query: torch.Tensor,
    pools: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    dtype: str,
    layout: str,
    *,
    scale: float,
    causal: bool,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    chunk: int | None,
) -> torch.Tensor | None:
    """The compiled CPU kernel over one layer's quantized CPU pools (``pools``: K and V of
    ``dtype``, ``scales``: theirs), decoding each tile as it reads it, with torch's threads;
    ``None`` where it cannot run (numba missing or switched off, pools it cannot read in place)."""
    if not paged_kernel.kernel_available():
        return None
    raw_keys, raw_values = (pool.detach().view(torch.uint8).numpy() for pool in pools)
    if not paged_kernel.kernel_reads(dtype, raw_keys, raw_values):
        return None
    return run_kernel(
        query,
        (raw_keys, raw_values),
        page_table,
        qo_indptr,
        dtype,
        layout,
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        sinks=sinks,
        chunk=chunk,
        scales=scales,
    )
