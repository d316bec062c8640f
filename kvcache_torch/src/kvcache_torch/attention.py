"""Paged attention in torch: decode and prefill, causal, grouped-query, ragged batch,
optionally over a sliding window, with the attention features of
:mod:`kvcache_core.attention.features` (a layer's window, logit softcapping, attention
sinks, chunked local attention) given per call.

On CPU, for float32, float16 and bfloat16 pools, it is one call of the compiled kernel of
:mod:`kvcache_core.attention.kernel` per layer for the whole batch: the pool and the page
table are handed over as zero-copy NumPy views, the kernel uses ``torch.get_num_threads()``
threads of torch's own OpenMP team (:mod:`kvcache_torch.threads`). What follows is the torch path, used on other devices, for other dtypes, and on
CPU when numba is missing or ``KVCACHE_DISABLE_NUMBA`` is set.

It reads K/V from the pool in place. Each run of physically consecutive blocks of a
request (:meth:`PageTable.runs`) is one zero-copy view of the pool: in the ``NHD`` and
``heads_first`` layouts a run is a ``[kv_heads, tokens, head_dim]`` view (contiguous per
head in ``heads_first``, token-strided in ``NHD``); in ``HND`` it is a
``[blocks, kv_heads, block_size, head_dim]`` view multiplied block by block in one
broadcast product. The query heads of one KV head are grouped into the rows of one
matrix (``[kv_heads, queries * group, head_dim]``), so every product reads the run once
for the whole group.

A request held in one run (what the core allocator aims for) is one call of
``scaled_dot_product_attention`` on the grouped rows and the run's view (with a boolean
mask for a causal chunk of several queries). A request in several runs has its runs'
scores joined into one ``[kv_heads, rows, tokens]`` buffer (scores are ``head_dim`` times
smaller than the keys they come from), one softmax normalises them and each run adds its
weighted values: any number of runs gives the exact result with no log-sum-exp merge.
Long prefills are split into chunks of queries to bound the score buffer; a causal chunk
reads only the keys its last query can see, and with a sliding window ``W`` (the page
table's) only the keys its first query's window reaches; a mask hides the rest.

Measured on 2 CPU cores (fp32, 8 KV heads of 128, 4 query heads each), on a
``heads_first`` view, relative to grouped ``scaled_dot_product_attention`` on contiguous
K/V (the dense floor): the fused call 1.02-1.03x, the two products with a softmax
1.04-1.06x, at 1024 and 4096 tokens and 1 or 2 threads. In a causal prefill of one run
the fused call with a mask was 1.7-2.3x faster than the products. A whole decode step
(32 layers, 4096 tokens, the write and the manager's checks included) is 1.14x the dense
floor with a ``heads_first`` pool, 1.46x with ``NHD`` (token-strided reads) and 1.64x with
``HND`` (per-block products). ``torch.compile`` was not tried: the per-request work is a
few large library calls. ``benchmarks/decode_torch.py`` prints the figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.attention.features import (
    check_chunk,
    check_chunk_positions,
    check_finite_logits,
    check_softcap,
    check_window,
    combined_window,
)
from kvcache_core.attention.reference import check_scale, validate_query_indptr
from kvcache_core.backends.dispatch import check_attention_path, pinned_path
from kvcache_core.contract.config import KV_LAYOUTS
from kvcache_core.contract.page_table import PageTable
from kvcache_core.errors import (
    ArrayTypeError,
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from kvcache_torch.dispatch import (
    DISPATCH,
    call_kind,
    chosen_path,
    kernel_attention,
    kernel_reads,
    remember_path,
    shape_class,
)
from kvcache_torch.run_views import one_run_decode

__all__ = ["attend_pool", "paged_attention"]

#: Most elements of one score buffer before a request's queries are split in chunks
#: (16 MiB of float32): long prefills stay bounded in memory.
_SCORE_BUDGET = 1 << 22

#: Axis of the KV heads in each pool layout.
_HEADS_AXIS = {"NHD": 2, "HND": 1, "heads_first": 0}

#: Dtypes whose softmax runs in float32 (their products still run in the pool's dtype).
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Piece(NamedTuple):
    """A part of a request's context read as one view of the pool.

    ``keys``/``values`` are ``[kv_heads, tokens, head_dim]`` (``blocked`` false) or
    ``[blocks, kv_heads, block_size, head_dim]`` of whole blocks (``blocked`` true).
    """

    first_token: int
    tokens: int
    keys: torch.Tensor
    values: torch.Tensor
    blocked: bool


class _PoolReader:
    """Views of one layer's K and V pools: the pieces of a request's context."""

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor, kv_layout: str, block_size: int) -> None:
        self.block_size = block_size
        self.blocked = kv_layout == "HND"
        if kv_layout == "NHD":  # [blocks, bs, H, D] -> [H, blocks * bs, D], token-strided
            self.keys = key_cache.flatten(0, 1).transpose(0, 1)
            self.values = value_cache.flatten(0, 1).transpose(0, 1)
        elif kv_layout == "heads_first":  # [H, blocks, bs, D] -> [H, blocks * bs, D], a view
            self.keys = key_cache.flatten(1, 2)
            self.values = value_cache.flatten(1, 2)
        else:  # HND [blocks, H, bs, D]: whole blocks, or one block's [H, tokens, D]
            self.keys = key_cache
            self.values = value_cache

    def pieces(self, spans: Sequence[tuple[int, int, int]], low: int, high: int) -> list[_Piece]:
        """Views of the tokens ``[low, high)`` of a request whose runs are ``spans``
        (``(first physical block, first token, tokens)`` each), in token order."""
        block_size = self.block_size
        pieces: list[_Piece] = []
        for start_block, first_token, run_tokens in spans:
            begin, end = max(low, first_token), min(high, first_token + run_tokens)
            if begin >= end:
                continue
            if not self.blocked:
                first_slot = start_block * block_size + begin - first_token
                pieces.append(
                    _Piece(
                        begin,
                        end - begin,
                        self.keys.narrow(1, first_slot, end - begin),
                        self.values.narrow(1, first_slot, end - begin),
                        False,
                    )
                )
                continue
            position = begin
            while position < end:  # HND: whole blocks in one view, a partial block as [H, tokens, D]
                block_index, offset = divmod(position - first_token, block_size)
                block = start_block + block_index
                whole = (end - position) // block_size if offset == 0 else 0
                if whole > 1:
                    pieces.append(
                        _Piece(
                            position,
                            whole * block_size,
                            self.keys.narrow(0, block, whole),
                            self.values.narrow(0, block, whole),
                            True,
                        )
                    )
                    position += whole * block_size
                    continue
                take = min(block_size - offset, end - position)
                pieces.append(
                    _Piece(
                        position,
                        take,
                        self.keys[block].narrow(1, offset, take),
                        self.values[block].narrow(1, offset, take),
                        False,
                    )
                )
                position += take
        return pieces


def _piece_scores(rows: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """``rows [H, R, D]`` against the piece's keys -> ``[H, R, tokens]``."""
    if not piece.blocked:
        return torch.matmul(rows, piece.keys.transpose(1, 2))
    # [blocks, H, R, bs]: one product per (block, head), the pool read in place.
    per_block = torch.matmul(rows.unsqueeze(0), piece.keys.transpose(2, 3))
    return per_block.permute(1, 2, 0, 3).flatten(2)


def _piece_values(weights: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """``weights [H, R, tokens]`` times the piece's values -> ``[H, R, D]``."""
    if not piece.blocked:
        return torch.matmul(weights, piece.values)
    blocks, heads, block_size, _ = piece.values.shape
    per_block = weights.reshape(heads, -1, blocks, block_size).permute(2, 0, 1, 3)  # [blocks, H, R, bs]
    return torch.matmul(per_block, piece.values).sum(0)


def _attend_rows(
    rows: torch.Tensor,
    pieces: list[_Piece],
    hidden: torch.Tensor | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of scaled query rows ``[H, R, D]`` over the pieces of a context.

    ``hidden`` (``[R, keys]``, true where a row may not see a key) masks the pieces' keys;
    ``softcap`` caps the scores before it; ``sinks`` (``[H, R]``) join each row's softmax
    denominator. Returns ``[H, R, D]`` in the rows' dtype.
    """
    if softcap is not None or sinks is not None:
        return _attend_rows_with_features(rows, pieces, hidden, softcap, sinks)
    if len(pieces) == 1 and not pieces[0].blocked:
        # One [H, tokens, D] view: the fused kernel reads it in place (measured 3% faster than
        # the products in decode, 2x in prefill, where it never forms the scores).
        piece = pieces[0]
        allowed = None if hidden is None else ~hidden
        out = torch.nn.functional.scaled_dot_product_attention(
            rows.unsqueeze(0), piece.keys.unsqueeze(0), piece.values.unsqueeze(0), attn_mask=allowed, scale=1.0
        )
        return out.squeeze(0)
    if len(pieces) == 1:
        scores = _piece_scores(rows, pieces[0])
    else:
        scores = torch.cat([_piece_scores(rows, piece) for piece in pieces], dim=-1)
    if hidden is not None:
        scores.masked_fill_(hidden, -math.inf)
    low_precision = rows.dtype in _LOW_PRECISION
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32 if low_precision else None).to(rows.dtype)
    if len(pieces) == 1:
        return _piece_values(weights, pieces[0])
    return _weighted_values(weights, pieces, rows.dtype)


def _weighted_values(weights: torch.Tensor, pieces: list[_Piece], dtype: torch.dtype) -> torch.Tensor:
    """Each piece's values weighted by its columns of ``weights``, summed over the pieces
    (in float32 for 16-bit rows), as ``dtype``."""
    result: torch.Tensor | None = None
    offset = 0
    for piece in pieces:
        part = _piece_values(weights.narrow(-1, offset, piece.tokens), piece)
        offset += piece.tokens
        if dtype in _LOW_PRECISION:
            part = part.float()  # accumulate the runs in float32
        result = part if result is None else result.add_(part)
    assert result is not None
    return result.to(dtype)


def _attend_rows_with_features(
    rows: torch.Tensor,
    pieces: list[_Piece],
    hidden: torch.Tensor | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`_attend_rows` with logit softcapping and/or sinks: the scores of every piece,
    capped, masked, normalised with the sinks in the denominator (float32 for 16-bit rows)."""
    scores = torch.cat([_piece_scores(rows, piece) for piece in pieces], dim=-1)
    low_precision = rows.dtype in _LOW_PRECISION
    if low_precision:
        scores = scores.float()
    if softcap is not None:  # before the mask, as Gemma 2 applies it
        scores = torch.tanh(scores / softcap) * softcap
    if hidden is not None:
        scores = scores.masked_fill(hidden, -math.inf)
    top = scores.amax(dim=-1)  # every row sees its own position: finite
    if sinks is not None:
        top = torch.maximum(top, sinks.to(scores.dtype))
    weights = torch.exp(scores - top[..., None])
    denominator = weights.sum(dim=-1)
    if sinks is not None:  # the sink joins the denominator and adds no value
        denominator = denominator + torch.exp(sinks.to(scores.dtype) - top)
    weights = (weights / denominator[..., None]).to(rows.dtype)
    return _weighted_values(weights, pieces, rows.dtype)


def attend_pool(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    scale: float,
    causal: bool,
    kv_layout: str,
    sliding_window: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """The kernel of :func:`paged_attention`, on arguments already validated (the storage
    calls it after the manager's checks). Runs without autograd. On CPU, where the compiled
    kernel applies (see the module docstring), ``path`` chooses: ``"auto"`` the faster for
    this shape of batch on this machine (:mod:`kvcache_torch.dispatch`), ``"kernel"`` or
    ``"native"`` (the torch path); elsewhere it is the torch path.

    Args:
        query: ``[total_queries, num_query_heads, head_dim]``.
        key_cache, value_cache: one layer's pool in ``kv_layout``; the values' last axis
            (``value_dim``) may differ from the keys'.
        page_table: the batch's pages.
        qo_indptr: ``[B + 1]`` query offsets.
        scale: score scale.
        causal: each request's queries are its last tokens and see keys up to their own.
        kv_layout: ``"NHD"``, ``"HND"`` or ``"heads_first"``.
        sliding_window: ``W``: a query at position ``p`` sees only keys after ``p - W``;
            ``None`` takes the page table's (``None`` there too: no window).
        window: this layer's window, combined with the one above (the smaller applies).
        softcap: scaled scores become ``tanh(s / softcap) * softcap`` before the mask.
        sinks: ``[num_query_heads]`` logits joining each query head's softmax denominator.
        chunk: a query at ``p`` sees only keys ``k`` with ``k // chunk == p // chunk``.
        path: ``"auto"``, ``"kernel"`` or ``"native"`` (checked by the caller:
            :func:`kvcache_core.backends.dispatch.pinned_path`).

    Returns:
        ``[total_queries, num_query_heads, value_dim]`` in ``query``'s dtype and device.
    """
    window = combined_window(window, page_table.sliding_window if sliding_window is None else sliding_window)
    arguments: _Arguments = (query, key_cache, value_cache, page_table, qo_indptr, scale, causal, kv_layout, window)

    def native() -> torch.Tensor:
        return _native_attention(*arguments, softcap=softcap, sinks=sinks, chunk=chunk)

    if not query.shape[0] or path == "native":
        return native()
    if path == "auto":
        features = (window is not None, softcap is not None, sinks is not None, chunk is not None)
        call = call_kind(query, key_cache, value_cache, causal, features)
        path = chosen_path(page_table, qo_indptr, call) or _choose(arguments, call, features, softcap, sinks, chunk)
        if path == "native":
            return native()
    output = kernel_attention(*arguments, softcap=softcap, sinks=sinks, chunk=chunk)
    return native() if output is None else output  # None: the kernel cannot read these pools


#: The positional arguments of the kernel and native paths (``window`` combined).
_Arguments = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, PageTable, npt.NDArray[np.int32], float, bool, str, "int | None"
]


def _choose(
    arguments: _Arguments,
    call: tuple[object, ...],
    features: tuple[bool, ...],
    softcap: float | None,
    sinks: torch.Tensor | None,
    chunk: int | None,
) -> str:
    """The path of a step's first call of its kind: the measured choice of its shape class
    (measured now, the first time the class is seen), ``"native"`` where the kernel cannot
    read the pools; remembered for the step's other layers."""
    query, key_cache, value_cache, page_table, qo_indptr, _, causal, kv_layout, _ = arguments
    path = "native"
    if kernel_reads(key_cache, value_cache):
        used = "".join(letter for letter, flag in zip("wsic", features, strict=True) if flag)
        shape = shape_class(query, key_cache, value_cache, page_table, qo_indptr, kv_layout, causal, used)
        choice = DISPATCH.choice(shape)
        if choice is None or choice.path not in ("kernel", "native"):
            DISPATCH.run(
                shape,
                {
                    "kernel": lambda: kernel_attention(*arguments, softcap=softcap, sinks=sinks, chunk=chunk),
                    "native": lambda: _native_attention(*arguments, softcap=softcap, sinks=sinks, chunk=chunk),
                },
            )
            choice = DISPATCH.choice(shape)
        path = "native" if choice is None else choice.path
    remember_path(page_table, qo_indptr, call, path)
    return path


def _native_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    scale: float,
    causal: bool,
    kv_layout: str,
    window: int | None,
    *,
    softcap: float | None,
    sinks: torch.Tensor | None,
    chunk: int | None,
) -> torch.Tensor:
    """torch's own path of :func:`attend_pool` (its arguments, ``window`` combined)."""
    if window is None and softcap is None and sinks is None and chunk is None:
        output = one_run_decode(query, key_cache, value_cache, page_table, qo_indptr, scale, kv_layout)
        if output is not None:
            return output
    num_heads, head_dim = key_cache.shape[_HEADS_AXIS[kv_layout]], key_cache.shape[3]
    value_dim = value_cache.shape[3]
    group = query.shape[1] // num_heads
    block_size = page_table.block_size
    reader = _PoolReader(key_cache, value_cache, kv_layout, block_size)
    offsets = [int(x) for x in qo_indptr.tolist()]
    seq_lens = [int(x) for x in page_table.seq_lens.tolist()]
    with torch.no_grad():
        output = query.new_empty((query.shape[0], query.shape[1], value_dim))
        scaled_query = query * scale  # once for the batch (the kernels then take scale 1)
        for b in range(page_table.batch_size):
            q_start, q_stop = offsets[b], offsets[b + 1]
            num_queries = q_stop - q_start
            if num_queries == 0:
                continue
            seq_len = seq_lens[b]
            spans = [
                (
                    run.start,
                    run.first_logical * block_size,
                    min(run.length * block_size, seq_len - run.first_logical * block_size),
                )
                for run in page_table.runs(b)
            ]
            # [H, queries * group, D]: the query rows of one KV head together, scaled.
            scaled = scaled_query[q_start:q_stop].view(num_queries, num_heads, group, head_dim)
            rows = scaled.transpose(0, 1).reshape(num_heads, num_queries * group, head_dim)  # a view in decode
            target = output[q_start:q_stop].view(num_queries, num_heads, group, value_dim).transpose(0, 1)
            # [H, rows]: the sink of each row (row q * group + g reads query head h * group + g).
            row_sinks = None if sinks is None else sinks.view(num_heads, 1, group).expand(-1, num_queries, -1)
            row_sinks = None if row_sinks is None else row_sinks.reshape(num_heads, num_queries * group)
            per_buffer = max(1, _SCORE_BUDGET // (num_heads * group * seq_len))  # queries per score buffer
            for first in range(0, num_queries, per_buffer):
                last = min(num_queries, first + per_buffer)
                first_position = seq_len - num_queries + first  # of the chunk's first query
                last_position = seq_len - num_queries + last - 1
                high = last_position + 1 if causal else seq_len  # keys past it are seen by no row
                low = max(0, first_position - window + 1) if window is not None else 0  # ... before it
                if chunk is not None:  # no row sees a key before its first row's chunk or past its last's
                    low = max(low, first_position // chunk * chunk)
                    high = min(high, (last_position // chunk + 1) * chunk)
                hidden = None
                if (
                    (causal and last - first > 1)
                    or (window is not None and low <= last_position - window)
                    or (chunk is not None and (first_position // chunk != last_position // chunk or not causal))
                ):
                    keys_at = torch.arange(low, high, device=query.device)[None, :]
                    rows_at = first_position + torch.arange((last - first) * group, device=query.device) // group
                    hidden = torch.zeros((rows_at.shape[0], high - low), dtype=torch.bool, device=query.device)
                    if causal:
                        hidden |= keys_at > rows_at[:, None]
                    if window is not None:
                        hidden |= keys_at <= rows_at[:, None] - window
                    if chunk is not None:
                        hidden |= keys_at // chunk != rows_at[:, None] // chunk
                part = _attend_rows(
                    rows[:, first * group : last * group],
                    reader.pieces(spans, low, high),
                    hidden,
                    softcap,
                    None if row_sinks is None else row_sinks[:, first * group : last * group],
                )
                target[:, first:last] = part.reshape(num_heads, last - first, group, value_dim)
        return output


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: PageTable,
    *,
    qo_indptr: object = None,
    scale: float | None = None,
    causal: bool = True,
    kv_layout: str = "NHD",
    sliding_window: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """Attention of packed queries over the paged K/V of a batch, read from the pool in place.

    The same semantics as the NumPy reference :func:`kvcache_core.paged_attention`.

    Args:
        query: ``[total_queries, num_query_heads, head_dim]``, requests packed in batch
            order; ``num_query_heads`` a multiple of the pool's ``num_heads`` (GQA).
        key_cache, value_cache: one layer's pool in ``kv_layout``, on ``query``'s device
            and of its dtype; the values' last axis (``value_dim``) may differ from the keys'.
        page_table: the batch's pages (:meth:`KvCacheManager.page_table`).
        qo_indptr: ``[B + 1]`` query offsets per request; ``None`` for decode (one each).
        scale: score scale, ``1 / sqrt(head_dim)`` by default.
        causal: query ``i`` of a request with ``q`` queries and ``n`` tokens sits at
            position ``n - q + i`` and sees keys up to it; otherwise it sees all ``n``.
        kv_layout: ``"NHD"``, ``"HND"`` or ``"heads_first"``.
        sliding_window: ``W``: each query sees only keys at positions ``p - W < k`` (its
            last ``W`` tokens). ``None`` takes the page table's
            :attr:`~kvcache_core.PageTable.sliding_window` (``None`` there too: no window).
        window, softcap, sinks, chunk: the attention features of
            :mod:`kvcache_core.attention.features` (``sinks`` a ``[num_query_heads]``
            tensor of the query's dtype and device).
        path: on CPU where the compiled kernel reads the pool, ``"auto"`` (the faster for
            this shape of batch on this machine, :mod:`kvcache_torch.dispatch`; pinned by
            ``KVCACHE_ATTENTION_PATH``), ``"kernel"`` or ``"native"`` (the torch path).

    Returns:
        ``[total_queries, num_query_heads, value_dim]`` in ``query``'s dtype.

    Raises:
        ArrayTypeError: an argument that is not a ``torch.Tensor``, or tensors on different devices.
        DTypeMismatchError: tensors of different dtypes.
        ShapeMismatchError: shapes that do not fit together.
        InvalidArgumentError: bad ``qo_indptr``, ``scale`` (not a normal float32 > 0),
            ``kv_layout``, ``sliding_window`` (not an int from 1 to ``INT32_MAX``, or unlike
            the page table's), a bad feature (see :mod:`kvcache_core.attention.features`;
            non-finite ``sinks`` too), or a page table naming blocks outside the pool.
        InvalidConfigError: an unknown ``path`` (or ``KVCACHE_ATTENTION_PATH``).
    """
    chosen = pinned_path(check_attention_path(path, "path"))
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(tensor, torch.Tensor):
            raise ArrayTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if kv_layout not in KV_LAYOUTS:
        raise InvalidArgumentError(f"kv_layout {kv_layout!r} is unknown; valid: {', '.join(KV_LAYOUTS)}")
    if key_cache.shape[:3] != value_cache.shape[:3] or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ShapeMismatchError(
            "key and value caches must share one 4-D shape but for their last axis (the key and value widths), "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise DTypeMismatchError(
            f"query, key_cache and value_cache must share one dtype, got {query.dtype}, {key_cache.dtype} "
            f"and {value_cache.dtype}"
        )
    if not (query.device == key_cache.device == value_cache.device):
        raise ArrayTypeError(
            f"query, key_cache and value_cache must be on one device, got {query.device}, {key_cache.device} "
            f"and {value_cache.device}"
        )
    num_heads, head_dim = key_cache.shape[_HEADS_AXIS[kv_layout]], key_cache.shape[3]
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_heads or query.shape[1] < num_heads:
        raise ShapeMismatchError(
            f"query must be [tokens, k * {num_heads}, {head_dim}] for a pool of {num_heads} heads "
            f"of {head_dim}, got {tuple(query.shape)}"
        )
    checked_scale = check_scale(scale, head_dim)
    if not isinstance(causal, bool):
        raise InvalidArgumentError(f"causal must be a bool, got {causal!r}")
    sliding_window = check_window(sliding_window, "sliding_window")
    if sliding_window is not None and page_table.sliding_window not in (None, sliding_window):
        raise InvalidArgumentError(
            f"sliding_window={sliding_window} contradicts the page table's sliding_window={page_table.sliding_window}"
        )
    layer_window, cap, chunk_size = check_window(window), check_softcap(softcap), check_chunk(chunk)
    check_chunk_positions(chunk_size, page_table.sliding_window)
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor)
        or tuple(sinks.shape) != (query.shape[1],)
        or sinks.dtype != query.dtype
        or sinks.device != query.device
    ):
        raise InvalidArgumentError(
            f"sinks must be a [{query.shape[1]}] tensor of dtype {query.dtype} on {query.device} (one per query "
            f"head), got {sinks!r}"
        )
    if sinks is not None:
        check_finite_logits("sinks", sinks.detach().to(device="cpu", dtype=torch.float32).numpy())
    indptr = validate_query_indptr(qo_indptr, page_table, query.shape[0])
    num_blocks = key_cache.shape[1 if kv_layout == "heads_first" else 0]
    block_size = key_cache.shape[2 if kv_layout != "NHD" else 1]
    if page_table.block_size != block_size:
        raise InvalidArgumentError(f"page table block_size {page_table.block_size} != pool block_size {block_size}")
    if page_table.kv_indices.size and (
        int(page_table.kv_indices.min()) < 0 or int(page_table.kv_indices.max()) >= num_blocks
    ):
        raise InvalidArgumentError(
            f"the page table names blocks {int(page_table.kv_indices.min())} to {int(page_table.kv_indices.max())}; "
            f"the pool has blocks 0 to {num_blocks - 1}"
        )
    return attend_pool(
        query,
        key_cache,
        value_cache,
        page_table,
        indptr,
        checked_scale,
        causal,
        kv_layout,
        sliding_window,
        window=layer_window,
        softcap=cap,
        sinks=sinks,
        chunk=chunk_size,
        path=chosen,
    )
