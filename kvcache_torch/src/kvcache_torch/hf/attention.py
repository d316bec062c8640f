"""The ``"kvcache_paged"`` attention implementation: its mask function, its attention
function and their registration with transformers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from transformers import PretrainedConfig
from transformers.integrations import sdpa_attention
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
from transformers.modeling_utils import AttentionInterface

from kvcache_core import InvalidArgumentError, UnsupportedConfigError
from kvcache_core.attention.features import visible_key_range
from kvcache_core.errors import ShapeMismatchError
from kvcache_torch.hf.forward_pass import keep_for_readers, reader_of, take_handoff
from kvcache_torch.hf.model_config import ATTN_IMPLEMENTATION, layer_specs

__all__ = [
    "attend_new_tokens",
    "contiguous_attention",
    "paged_attention_forward",
    "paged_attention_mask",
    "register_attention",
]

AttentionFunction = Callable[..., tuple[torch.Tensor, None]]

#: transformers' own ``sdpa`` attention, for K/V that are contiguous already.
contiguous_attention = cast(
    AttentionFunction,
    sdpa_attention.sdpa_attention_forward,  # pyright: ignore[reportUnknownMemberType]  # **kwargs untyped there
)


def paged_attention_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask function of ``"kvcache_paged"``: the 2-D padding mask ``[batch, kv_length]``
    (bool), or ``None`` when nothing is padded.

    The paged kernel is causal by construction; a sliding window or attention chunk
    (``local_size``) is applied by the attention itself, per layer, from the window the
    model passes it and the chunk of its config.

    ``q_length`` is unused (transformers 4 passes ``cache_position`` instead); ``kv_length``
    is required.

    Raises:
        UnsupportedConfigError: a mask pattern other than causal, sliding or chunked
            (bidirectional, image tokens, packed sequences).
        ShapeMismatchError: a mask shorter than the positions cached plus new.
        InvalidArgumentError: no ``kv_length``.
    """
    if kv_length is None:
        raise InvalidArgumentError("paged_attention_mask needs kv_length, the positions cached plus new")
    if mask_function is not causal_mask_function and local_size is None:
        raise UnsupportedConfigError(
            "kvcache_paged attention is causal over each request; this model asks for another mask pattern "
            f"({getattr(mask_function, '__name__', mask_function)!r}): load it with attn_implementation='sdpa' "
            "(PagedCache still works, on its contiguous path)"
        )
    if attention_mask is None:
        return None
    if attention_mask.shape[-1] < kv_offset + kv_length:
        raise ShapeMismatchError(
            f"attention_mask has {attention_mask.shape[-1]} positions, the cache and the input hold "
            f"{kv_offset + kv_length}: pass the mask of every position, cached and new"
        )
    mask = attention_mask[:, kv_offset : kv_offset + kv_length]
    return None if bool(mask.all()) else mask.to(torch.bool)  # no copy where nothing is padded


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function of ``"kvcache_paged"``.

    With a :class:`PagedCache` it writes the layer's real new tokens into the pool (one
    write for the batch) and runs the manager's paged attention over the pool in place.
    With any other cache, or none, ``key``/``value`` hold the whole context and it runs
    transformers' ``sdpa`` path with the padding and causal masks.

    Args:
        module: the attention module (``is_causal``, ``num_key_value_groups``).
        query: ``[batch, query_heads, new_tokens, head_dim]``.
        key, value: what the cache's ``update`` returned.
        attention_mask: the 2-D padding mask from :func:`paged_attention_mask`, or ``None``.
        dropout: must be 0 (inference).
        scaling: the score scale (``1 / sqrt(head_dim)`` when ``None``).

    Returns:
        ``([batch, new_tokens, query_heads, head_dim], None)``.

    Raises:
        UnsupportedConfigError: dropout, a non-causal module, a 4-D mask with a
            PagedCache; without a PagedCache, soft-capping, attention sinks or a chunked
            layer whose context outgrew its chunk.
        ShapeMismatchError: the keys differ from those ``update`` returned.

    The layer's attention features reach the paged kernel: ``sliding_window`` (Mistral,
    Qwen2, Gemma 2, Cohere 2, gpt-oss), ``softcap`` (Gemma 2) and ``s_aux``, the sinks
    (gpt-oss), as the model passes them; a chunked layer's chunk comes from the config.
    """
    pending = take_handoff()
    if pending is not None and pending.step.awaiting == pending.layer:
        pending.step.awaiting = None  # the layer's keys and values reached their attention
    if pending is None:
        pending = reader_of(key, value)  # a layer reusing an earlier layer's K/V (Gemma 3n)
    window: object = kwargs.get("sliding_window")
    softcap: object = kwargs.get("softcap")
    sinks: object = kwargs.get("s_aux")
    if pending is None and (softcap is not None or sinks is not None):
        raise UnsupportedConfigError(
            "kvcache_paged attention without a PagedCache has no logit soft-capping or attention sinks; "
            "pass a PagedCache or load the model with its reference attention"
        )
    if dropout:
        raise UnsupportedConfigError(f"kvcache_paged attention is for inference: dropout must be 0, got {dropout}")
    if attention_mask is not None and attention_mask.dim() != 2:
        if pending is not None:
            raise UnsupportedConfigError(
                f"PagedCache with kvcache_paged attention takes a 2-D padding mask, got {attention_mask.dim()}-D"
            )
        return contiguous_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if pending is None:
        chunk = _module_chunk(module)
        if chunk is not None and key.shape[2] > chunk:
            raise UnsupportedConfigError(
                f"kvcache_paged attention without a PagedCache does not apply attention chunks: the context "
                f"({key.shape[2]} positions) outgrew the chunk of {chunk}; pass a PagedCache"
            )
        dense_window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
        return contiguous_attention(
            module, query, key, value, _dense_mask(attention_mask, query, key, dense_window), dropout, scaling, **kwargs
        )
    if pending.key is not key or pending.value is not value:
        raise ShapeMismatchError(
            f"layer {pending.layer}: the attention got other keys than PagedCache.update returned; this model "
            "changes them in between, use attn_implementation='sdpa'"
        )
    if not getattr(module, "is_causal", True):
        raise UnsupportedConfigError("kvcache_paged attention with a PagedCache is causal; this module is not")
    features = {"window": window, "softcap": softcap, "sinks": sinks}
    if isinstance(sinks, torch.Tensor):
        features["sinks"] = sinks.detach()
    output = pending.attend(pending, module, query, attention_mask, scaling, features)
    keep_for_readers(pending)
    return output, None


def attend_new_tokens(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    real_lengths: list[int] | None,
) -> torch.Tensor:
    """The attention of a first forward, whose whole context is its new K/V, contiguous
    already: transformers' ``sdpa`` on them (faster than any read of the pool, and nothing is
    rebuilt). With ``real_lengths`` (a left-padded batch: each row's real tokens are its last
    ``n``), one call per row on its real tokens, so padding costs no attention.

    Args:
        query: ``[batch, query_heads, new_tokens, head_dim]``.
        key, value: ``[batch, kv_heads, new_tokens, head_dim]`` (values may be of another width).

    Returns:
        ``[batch, new_tokens, query_heads, value_width]``; rows of padding tokens are 0.
    """
    if real_lengths is None:
        output, _ = contiguous_attention(module, query, key, value, None, 0.0, scaling)
        return output
    batch, query_heads, query_length, _ = query.shape
    output = query.new_zeros((batch, query_length, query_heads, value.shape[-1]))  # as wide as the values
    for row, length in enumerate(real_lengths):
        if length:
            rows = slice(query_length - length, query_length)
            output[row, rows], _ = contiguous_attention(
                module,
                query[row : row + 1, :, rows],
                key[row : row + 1, :, rows],
                value[row : row + 1, :, rows],
                None,
                0.0,
                scaling,
            )
    return output


def _module_chunk(module: torch.nn.Module) -> int | None:
    """The attention chunk of a module's layer, from its ``config`` and ``layer_idx`` (Llama 4)."""
    config: object = getattr(module, "config", None)
    layer: object = getattr(module, "layer_idx", None)
    if not isinstance(config, PretrainedConfig) or not isinstance(layer, int):
        return None
    specs = layer_specs(config)
    return specs[layer].chunk if 0 <= layer < len(specs) else None


def _dense_mask(
    attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, window: int | None = None
) -> torch.Tensor | None:
    """The 4-D bool sdpa mask ``[batch, 1, new, kv]`` for contiguous K/V: the keys each query
    sees (queries are the last positions; causal, through the sliding ``window``), less the
    padding; ``None`` when sdpa's own causal flag is exact."""
    query_length, kv_length = query.shape[2], key.shape[2]
    outgrown = window is not None and kv_length > window
    if attention_mask is None and query_length in (1, kv_length) and not outgrown:
        return None
    low, high = visible_key_range(range(kv_length - query_length, kv_length), kv_length, causal=True, window=window)
    keys = torch.arange(kv_length, device=query.device)
    seen_from = torch.as_tensor(low, device=query.device)[:, None]
    seen_to = torch.as_tensor(high, device=query.device)[:, None]
    mask = ((keys[None, :] >= seen_from) & (keys[None, :] < seen_to))[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -kv_length:].to(device=query.device, dtype=torch.bool)
    return mask


def register_attention() -> None:
    """Register ``"kvcache_paged"`` with transformers' attention and mask interfaces
    (done on import; calling it again changes nothing)."""
    AttentionInterface.register(  # pyright: ignore[reportUnknownMemberType]  # value untyped there
        ATTN_IMPLEMENTATION, paged_attention_forward
    )
    AttentionMaskInterface.register(  # pyright: ignore[reportUnknownMemberType]
        ATTN_IMPLEMENTATION, paged_attention_mask
    )
