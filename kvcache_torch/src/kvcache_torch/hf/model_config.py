"""What a transformers config says about its cache: geometry, each layer's attention, the
pool's :class:`~kvcache_core.CacheConfig` and the model's fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import torch
from transformers import PretrainedConfig

from kvcache_core import BlockTable, CacheConfig, InvalidArgumentError, LayerSpec, UnsupportedConfigError
from kvcache_core.contract.config import check_count
from kvcache_core.errors import InvalidTypeError
from kvcache_core.plugin import DTYPE_SIZES, QUANTIZED_DTYPES
from kvcache_torch.dtypes import dtype_name
from kvcache_torch.hf.guard import refuse_unless_interface
from kvcache_torch.hf.shared_kv import kv_sources, refuse_sliced_shared_layers_on_paged_path, stored_layer_count
from kvcache_torch.hf.state_layers import (
    EMPTY_LAYER_TYPES,
    HYBRID_LAYER_TYPES,
    STATE_LAYER_TYPES,
    layer_types,
    state_specs,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "attention_implementation",
    "cache_config_for",
    "geometry",
    "latent_attention",
    "layer_geometries",
    "layer_specs",
    "model_fingerprint",
    "text_config",
    "value_head_dim",
]

#: The name to pass as ``attn_implementation`` (or to ``model.set_attn_implementation``).
ATTN_IMPLEMENTATION: Final = "kvcache_paged"

#: Layer types of ``config.layer_types`` whose K/V this cache can hold.
_ATTENTION_LAYER_TYPES: Final = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (the config itself for a plain decoder)."""
    get_text_config = cast(
        Callable[..., PretrainedConfig],
        config.get_text_config,  # pyright: ignore[reportUnknownMemberType]  # parameters untyped there
    )
    return get_text_config(decoder=True)


def attention_implementation(config: PretrainedConfig) -> str | None:
    """The config's current attention implementation (it changes with ``set_attn_implementation``)."""
    name: object = getattr(config, "_attn_implementation", None)
    return name if isinstance(name, str) else None


def _one_per_model(value: object, name: str) -> int | None:
    """A per-model count from a config field that may also be per layer (a list)."""
    if isinstance(value, (list, tuple)):
        counts = {int(item) for item in cast("Sequence[int]", value)}
        if len(counts) > 1:
            raise UnsupportedConfigError(
                f"the model's layers have different {name} {list(cast('Sequence[int]', value))}; a kvcache pool "
                "holds one count for every layer"
            )
        return counts.pop() if counts else None
    return None if value is None else int(cast("int", value))


#: The name of the error transformers raises when a field that differs per layer
#: (``per_layer_config``: Gemma 4's head sizes) is read from the model's config.
_PER_LAYER_ERROR: Final = "AmbiguousGlobalPerLayerAttributeError"


def _field(text: PretrainedConfig, name: str, what: str) -> object:
    """``getattr(text, name, None)``, refusing by name a field whose value differs per layer.

    Raises:
        UnsupportedConfigError: the field is set per layer (``per_layer_config``); the message
            names it and each layer's value.
    """
    try:
        return getattr(text, name, None)
    except RuntimeError as exc:
        if type(exc).__name__ != _PER_LAYER_ERROR:
            raise
        values: list[object] = []
        per_layer: object = getattr(text, "per_layer_config", None)
        for layer in range(int(text.num_hidden_layers)):
            try:
                values.append(getattr(cast("Any", per_layer)[layer], name, None))
            except Exception:  # a per-layer config of another form: name the field alone
                values = []
                break
        shown = f": {values}" if values else ""
        raise UnsupportedConfigError(
            f"the model's layers have different {what} ({name!r} per layer{shown}); a kvcache pool holds one for "
            "every layer"
        ) from exc


def _kv_heads(text: PretrainedConfig) -> int:
    """The KV heads a decoder hands its cache, as its attention computes them."""
    query_heads = _one_per_model(_field(text, "num_attention_heads", "query head counts"), "query head counts") or 1
    if hasattr(text, "new_decoder_architecture") and hasattr(text, "multi_query"):  # Falcon's convention
        if getattr(text, "new_decoder_architecture", False):
            return query_heads  # keys and values are broadcast to every query head before caching
        if getattr(text, "multi_query", False):
            return 1
        return _one_per_model(getattr(text, "num_kv_heads", None), "KV head counts") or query_heads
    for name in ("num_key_value_heads", "num_kv_heads"):
        heads = _one_per_model(_field(text, name, "KV head counts"), "KV head counts")
        if heads is not None:
            return heads
    return query_heads


def latent_attention(config: PretrainedConfig) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of a model with multi-head latent attention
    (DeepSeek-V2/V3, MiniCPM3, GLM-4 MoE lite, LongCat, Mistral 4, ...), else ``None``.

    Such a model hands its cache the compressed latent as keys ``[batch, 1, new_tokens,
    kv_lora_rank]`` and the rotary part as values ``[batch, 1, new_tokens, qk_rope_head_dim]``,
    one head each, and expands them into every head's K/V itself after reading them back."""
    text = text_config(config)
    rank = _positive_or_none(getattr(text, "kv_lora_rank", None))
    rope = _positive_or_none(getattr(text, "qk_rope_head_dim", None))
    return None if rank is None or rope is None else (rank, rope)


def value_head_dim(config: PretrainedConfig) -> int | None:
    """The width of the values a decoder hands its cache when it differs from the keys'
    (:func:`geometry`): the rotary part of latent attention (``qk_rope_head_dim``), or a
    model's ``v_head_dim`` (MiMo-V2-Flash); ``None`` when values are as wide as keys."""
    latent = latent_attention(config)
    if latent is not None:
        return latent[1] if latent[1] != latent[0] else None
    width = _positive_or_none(_field(text_config(config), "v_head_dim", "value head sizes"))
    return None if width is None or width == geometry(config)[2] else width


def _head_size(text: PretrainedConfig) -> int:
    """A (per-layer) config's head size: ``head_dim``, else ``hidden_size / query heads``."""
    query_heads = _one_per_model(_field(text, "num_attention_heads", "query head counts"), "query head counts") or 1
    head_dim = _one_per_model(_field(text, "head_dim", "head sizes"), "head sizes")
    return int(text.hidden_size) // query_heads if head_dim is None else head_dim


#: Model types whose sliding layers hold a multiple of their full layers' KV heads, in code
#: rather than in their config (MiMo-V2-Flash: twice).
_SLIDING_LAYERS_WITH_OTHER_HEADS: Final = {"mimo_v2_flash": 2}


def layer_geometries(config: PretrainedConfig) -> tuple[tuple[int, int], ...] | None:
    """Each layer's ``(kv_heads, head_dim)`` where a decoder's layers differ in them
    (transformers' ``per_layer_config``: Gemma 4's full-attention layers, of ``global_head_dim``
    and ``num_global_key_value_heads``; MiMo-V2-Flash's sliding layers, of twice the KV heads),
    else ``None``. The pool then gives each layer its own geometry (``LayerSpec(num_heads=...,
    head_dim=...)``)."""
    text = text_config(config)
    if latent_attention(config) is not None:
        return None
    factor = _SLIDING_LAYERS_WITH_OTHER_HEADS.get(str(getattr(text, "model_type", "")))
    if factor is not None:
        types: Sequence[str] = getattr(text, "layer_types", None) or ()
        if "sliding_attention" not in types or "full_attention" not in types:
            return None
        heads, size = _kv_heads(text), _head_size(text)
        return tuple((factor * heads if kind == "sliding_attention" else heads, size) for kind in types)
    per_layer: Any = getattr(text, "per_layer_config", None)
    if per_layer is None:
        return None
    shapes: list[tuple[int, int]] = []
    for layer in range(int(text.num_hidden_layers)):
        try:
            entry = per_layer[layer]
        except (IndexError, KeyError, TypeError):
            return None  # not a per-layer view this reads: the model-wide fields decide
        if not isinstance(entry, PretrainedConfig):
            return None
        shapes.append((_kv_heads(entry), _head_size(entry)))
    return tuple(shapes) if len(set(shapes)) > 1 else None


def geometry(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(num_layers, kv_heads, head_dim)`` of a decoder config, as its attention hands them
    to the cache: for latent attention one head of the latent's width (``kv_lora_rank``);
    the values' width is :func:`value_head_dim`. For layers of different geometries
    (:func:`layer_geometries`: Gemma 4) the first layer's: the pool's, which the others' specs
    override.

    Raises:
        UnsupportedConfigError: layers with different KV head counts or head sizes given
            model-wide as a list per layer, named in the message.
    """
    text = text_config(config)
    layers = int(text.num_hidden_layers)
    types = layer_types(text, layers)
    if types is not None and set(types) <= STATE_LAYER_TYPES | EMPTY_LAYER_TYPES:
        return layers, 1, 1  # no attention layer: the pool's K/V are one head of one feature
    latent = latent_attention(config)
    if latent is not None:
        return layers, 1, latent[0]
    shapes = layer_geometries(config)
    if shapes is not None:
        return layers, *shapes[0]
    return layers, _kv_heads(text), _head_size(text)


def _positive_or_none(value: object) -> int | None:
    """A config field as a window or chunk size: an int >= 1, else unset."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def layer_specs(config: PretrainedConfig, state_dtype: str = "float32") -> tuple[LayerSpec, ...]:
    """Each layer's :class:`~kvcache_core.LayerSpec` (full, a sliding window or a chunk), from
    ``layer_types``, ``sliding_window`` and ``attention_chunk_size`` (a model without
    ``layer_types`` and with a ``sliding_window``, as Mistral, slides in every layer); a
    recurrent-state layer's state (:mod:`kvcache_torch.hf.state_layers`, conv states in
    ``state_dtype``), alone or, for a ``"hybrid"`` layer (Falcon-H1, Zamba2), beside its K/V;
    nothing for an MLP or mixture-of-experts layer (Nemotron-H's ``"mlp"`` and ``"moe"``);
    with layers of different geometries (:func:`layer_geometries`), each attention layer's KV
    heads and head size.

    Raises:
        UnsupportedConfigError: a layer type other than full, sliding or chunked attention,
            a state or hybrid layer of a known family, or a layer keeping nothing, named in
            the message.
    """
    text = text_config(config)
    layers = int(text.num_hidden_layers)
    states = state_specs(text, layers, state_dtype)
    window = _positive_or_none(getattr(text, "sliding_window", None))
    chunk = _positive_or_none(getattr(text, "attention_chunk_size", None))
    types: Sequence[str] | None = getattr(text, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * layers
    kept_states: frozenset[str] = STATE_LAYER_TYPES | HYBRID_LAYER_TYPES if states else frozenset()
    served = _ATTENTION_LAYER_TYPES | EMPTY_LAYER_TYPES | kept_states
    other = sorted(set(types) - served)
    if other:
        raise UnsupportedConfigError(
            f"the model has layers of type {', '.join(repr(name) for name in other)}, which keep no paged K/V; "
            f"kvcache serves {sorted(_ATTENTION_LAYER_TYPES)} layers"
        )
    shapes = layer_geometries(config)
    specs: list[LayerSpec] = []
    for index, layer_type in enumerate(types):
        heads, size = shapes[index] if shapes is not None else (None, None)
        if layer_type in EMPTY_LAYER_TYPES:
            specs.append(LayerSpec(keeps_kv=False))
        elif layer_type in HYBRID_LAYER_TYPES:
            sliding = window if layer_type == "hybrid_sliding" else None
            specs.append(LayerSpec(window=sliding, state=states[index], keeps_kv=True, num_heads=heads, head_dim=size))
        elif index in states:
            specs.append(LayerSpec(state=states[index]))
        elif layer_type == "sliding_attention" and window is not None:
            specs.append(LayerSpec(window=window, num_heads=heads, head_dim=size))
        elif layer_type == "chunked_attention" and chunk is not None:
            specs.append(LayerSpec(chunk=chunk, num_heads=heads, head_dim=size))
        else:
            specs.append(LayerSpec(num_heads=heads, head_dim=size))
    return tuple(specs)


def _keeping_every_block(spec: LayerSpec) -> LayerSpec:
    """``spec`` without its window or chunk (its geometry kept): a layer of the pool's one
    KV-cache group, whose window its attention applies."""
    if not spec.keeps_kv:
        return spec
    return LayerSpec(
        state=spec.state,
        keeps_kv=True,
        num_heads=spec.num_heads,
        head_dim=spec.head_dim,
        value_head_dim=spec.value_head_dim,
    )


def _pool_dtype_name(dtype: object) -> str:
    """A dtype's pool name (``torch.bfloat16`` -> ``"bfloat16"``); a name as it is.

    A torch dtype is a model's: it names an unquantized pool (a quantized pool is asked for
    by its name, ``"int8"``, and computes in the model's dtype).

    Raises:
        UnsupportedConfigError: a torch dtype kvcache has no unquantized pool of.
    """
    if isinstance(dtype, torch.dtype):
        name = dtype_name(dtype)
        unquantized = sorted(set(DTYPE_SIZES) - set(QUANTIZED_DTYPES))
        if name not in unquantized:
            raise UnsupportedConfigError(f"dtype {dtype} has no kvcache pool; use one of {unquantized}")
        return name
    return str(dtype)


def cache_config_for(
    model: torch.nn.Module | PretrainedConfig,
    *,
    num_blocks: int | None = None,
    max_tokens: int | None = None,
    block_size: int = 16,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    model_id: str | None = None,
    hybrid: bool = True,
    state_slots: int | None = None,
) -> CacheConfig:
    """The :class:`~kvcache_core.CacheConfig` of a pool for this model.

    Layers, KV heads and head size come from the model's (decoder) config; give the pool's
    size as ``num_blocks`` or as ``max_tokens`` (rounded up to whole blocks), not both.
    Layers that reuse another layer's K/V (Gemma 3n) get no storage in the pool. The
    pool holds what the model's attention hands ``update``: for multi-head latent attention
    (DeepSeek-V2/V3, MiniCPM3, ...) one head, keys of ``kv_lora_rank`` and values of
    ``qk_rope_head_dim`` (:func:`latent_attention`); for a model with a ``v_head_dim`` of its
    own, values of that width (``CacheConfig.value_head_dim``); for layers of different KV
    heads or head sizes (Gemma 4's ``per_layer_config``: :func:`layer_geometries`), each layer
    its own (``LayerSpec(num_heads=..., head_dim=...)``), sliding layers keeping only their
    window's blocks as in any hybrid pool (layers of different geometries at one place of the
    KV-cache groups view one page: ``CacheConfig.storage_layers``).

    Args:
        model: the model (its ``config``, and the dtype and device of its weights), or just
            its ``PretrainedConfig``.
        num_blocks, max_tokens: the pool's size: its blocks, or the tokens of one request
            it holds (rounded up to whole blocks); with KV-cache groups, each group keeps its
            own blocks of a request's tokens (a sliding group all of those a step writes, then
            its window's), so ``max_tokens`` gives the pool that many blocks per group.
        block_size: tokens per block.
        dtype: ``"float32"``, ``torch.bfloat16``, ...; by default the model's weights' dtype
            (for a config, its ``dtype``; float32 when it has none). ``"int8"`` or
            ``"float8_e4m3fn"`` give a quantized pool (:mod:`kvcache_core.contract.quantization`, about a
            quarter of float32's bytes) that computes in the model's dtype.
        device: where the pool lives (``"cpu"``, ``"cuda:0"``); by default the model's
            device (for a config, the CPU).
        model_id: the namespace of the pool's prefix-cache hashes; by default
            :func:`model_fingerprint` of the config and the pool's dtype, so blocks cached,
            saved or published for one model never map into another's pool.
        hybrid: give the pool each layer's spec (``CacheConfig.layer_specs``) when the
            model has sliding or chunked layers: sliding layers then form KV-cache groups
            that keep only their window's blocks (a long request takes a fraction of the
            memory) on either path. ``False``: one group keeping every block of every
            layer (for layers of different geometries, each in arrays of its own shape: what a
            transfer reads in place, which layers viewing one page cannot offer).
        state_slots: with recurrent-state layers (Mamba, Mamba2, gated DeltaNet, short
            convolutions), the requests (batch rows) whose states the pool holds at once;
            ``None``: ``CacheConfig``'s default.

    Raises:
        InvalidArgumentError: neither or both of ``num_blocks`` and ``max_tokens``, or a
            ``max_tokens`` or ``block_size`` below 1.
        InvalidTypeError: ``model`` is neither a model with a ``config`` nor a config.
        UnsupportedConfigError: a dtype kvcache has no name for, layers that are neither
            full, sliding or chunked attention, the recurrent-state or hybrid (K/V and a
            state) layers of a family of :data:`~kvcache_torch.hf.state_layers.STATE_FAMILIES`,
            nor MLP or mixture-of-experts layers keeping nothing (the message names their
            type), layers sharing K/V
            otherwise than as the last layers reusing earlier ones, or a config
            set to ``"kvcache_paged"`` for a model whose attention does not call transformers'
            attention interface (Falcon, GPT-Neo, Bloom, MPT, ...: the message names the
            class and the remedy: its own attention, ``"sdpa"`` or ``"eager"``), a config
            set to ``"kvcache_paged"`` for a latent-attention model (which expands the latent
            before attending: it runs the contiguous path) or for Gemma 4 with layers reusing
            K/V (which slices their queries: it runs the contiguous path), or a quantized
            ``dtype`` for layers of different geometries.
        InvalidConfigError: any field out of range (from ``CacheConfig``).

    The ``"kvcache_paged"`` attention applies each layer's window or chunk, softcap and
    sinks.
    """
    model_dtype: str | torch.dtype | None = None
    if isinstance(model, PretrainedConfig):
        config = model
    else:
        found: object = getattr(model, "config", None)
        if not isinstance(model, torch.nn.Module) or not isinstance(found, PretrainedConfig):
            raise InvalidTypeError(f"expected a transformers model or its config, got {type(model).__name__}")
        config = found
        weight = next(model.parameters(), None)
        if weight is not None:
            model_dtype = weight.dtype
            dtype = weight.dtype if dtype is None else dtype
            device = weight.device if device is None else device
    if (num_blocks is None) == (max_tokens is None):
        raise InvalidArgumentError(
            f"give the pool size as exactly one of num_blocks or max_tokens, got num_blocks={num_blocks!r}, "
            f"max_tokens={max_tokens!r}"
        )
    block_size = check_count(block_size, "block_size", minimum=1)
    if max_tokens is not None:
        num_blocks = BlockTable.blocks_needed_for_length(check_count(max_tokens, "max_tokens", minimum=1), block_size)
    configured = getattr(text_config(config), "dtype", None) or getattr(config, "dtype", None) or "float32"
    if dtype is None:
        dtype = configured
    dtype = _pool_dtype_name(dtype)
    # A quantized pool computes in the model's dtype.
    compute_dtype = _pool_dtype_name(model_dtype or configured) if dtype in QUANTIZED_DTYPES else None
    _, kv_heads, head_dim = geometry(config)
    state_dtype = str(compute_dtype or dtype)
    text = text_config(config)
    kv_sources(text)  # refuses layers sharing K/V in a way PagedCache cannot serve
    layers = stored_layer_count(text)  # layers reusing another's K/V keep no blocks
    specs = layer_specs(config, state_dtype)[:layers]  # refuses layers it cannot hold
    if attention_implementation(text) == ATTN_IMPLEMENTATION:
        refuse_latent_on_paged_path(text)
        refuse_sliced_shared_layers_on_paged_path(text)
        refuse_unless_interface(text, None if isinstance(model, PretrainedConfig) else model)
    if not isinstance(hybrid, bool):
        raise InvalidArgumentError(f"hybrid must be a bool, got {hybrid!r}")
    assert num_blocks is not None  # exactly one of the two was given, checked above
    fields: dict[str, Any] = {
        "num_layers": layers,
        "num_heads": kv_heads,
        "head_dim": head_dim,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "dtype": dtype,
        "device": "cpu" if device is None else str(device),
        "model_id": model_fingerprint(config, str(dtype)) if model_id is None else model_id,
        "compute_dtype": compute_dtype,
        "state_slots": state_slots,
        "value_head_dim": value_head_dim(config),
    }
    grouped = any(spec.keeps_state or not spec.keeps_kv for spec in specs) or (
        hybrid and any(spec.kind != "full" for spec in specs)
    )
    if grouped:
        pool = CacheConfig(**fields, layer_specs=specs)
    elif layer_geometries(config) is None:
        pool = CacheConfig(**fields)
    else:
        pool = CacheConfig(**fields, layer_specs=tuple(_keeping_every_block(spec) for spec in specs))
    if max_tokens is None or pool.num_groups == 1:
        return pool
    # Each KV-cache group keeps its own blocks of a request's tokens (all of them while a step writes them).
    return dataclasses.replace(pool, num_blocks=num_blocks * pool.num_groups, state_slots=pool.states.num_slots or None)


def refuse_latent_on_paged_path(config: PretrainedConfig) -> None:
    """Refuse ``"kvcache_paged"`` for a model with latent attention, by name.

    Its attention reads back the cached latent and expands it into every head's K/V before
    calling the attention function, so the pool (which holds the latent) is not what it
    attends over: its cache serves the contiguous path (``"sdpa"`` or ``"eager"``).

    Raises:
        UnsupportedConfigError: naming the model class and the remedy.
    """
    if latent_attention(config) is None:
        return
    name = type(config).__name__.removesuffix("Config") or "this model"
    raise UnsupportedConfigError(
        f"{name} uses multi-head latent attention: it expands the cached latent into every head's K/V before "
        f"attending, so {ATTN_IMPLEMENTATION!r} cannot read them from the pool; load it with "
        "attn_implementation='sdpa' (or 'eager'): PagedCache then holds the latent (kv_lora_rank + "
        "qk_rope_head_dim per token) on the contiguous path"
    )


def model_fingerprint(config: PretrainedConfig, dtype: str) -> str:
    """``"<name or path>@sha256:<16 hex digits>"``: a hash of every field of the model's
    config (the transformers version aside) and the pool's dtype, the default ``model_id``
    of :func:`cache_config_for`. Two models share it only if their K/V can be shared."""
    fields = {key: value for key, value in config.to_dict().items() if key != "transformers_version"}
    text = json.dumps({"config": fields, "dtype": dtype}, sort_keys=True, default=str)
    name = str(getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or "model")
    return f"{name}@sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}"
