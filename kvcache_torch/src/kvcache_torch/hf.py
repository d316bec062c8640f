"""Hugging Face transformers integration: a ``Cache`` backed by a kvcache paged pool.

Two pieces, used together or apart::

    import kvcache_torch.hf  # registers the "kvcache_paged" attention implementation
    from kvcache_core import create_manager
    from kvcache_torch.hf import PagedCache, cache_config_for

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvcache_paged")
    manager = create_manager("torch", cache_config_for(model, max_tokens=16384))
    with PagedCache(manager, model.config) as cache:
        out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values= before 5.x

- :class:`PagedCache` is a ``transformers.Cache`` whose K/V live in the manager's pool: one
  kvcache request per batch row, allocated at the first forward.
- The ``"kvcache_paged"`` attention implementation (registered on import, or with
  :func:`register_attention`) writes each layer's new K/V into the pool in one batched write
  and runs paged attention on the pool directly: decode never rebuilds a contiguous K/V.
  Each forward is one manager step (``begin_step``): planned once at the first layer (every
  row grown by its real new tokens, atomically), then written and attended per layer. The write happens in the attention function rather than in ``update``
  because only the attention function sees the padding mask: padding tokens (zeros of the
  2-D ``attention_mask``) are never stored, so each request holds exactly its real tokens
  and a left-padded batch gives the same logits at the real positions as ``DynamicCache``.
  A first forward without padding attends over its own new K/V with transformers' ``sdpa``
  (they are the whole context and contiguous already; measured faster than reading them
  back from the pool); every later forward (decode, chunked prefill) reads the pool.
- ``"kvcache_paged"`` serves models whose attention calls transformers' attention interface.
  One that computes attention itself (Bloom, MPT, XGLM, ...) or rejects the name at load
  (Falcon, GPT-Neo, GIT) is refused by name with its remedy, by :func:`cache_config_for` and
  :class:`PagedCache` where transformers can tell from the class, else at its first forward
  before anything is stored (:mod:`kvcache_torch.hf_guard`).
- With any other implementation (``"sdpa"``, ``"eager"``, ...) :meth:`PagedCache.update`
  stores every position and returns the contiguous K/V ``[batch, kv_heads, tokens,
  head_dim]`` the model expects: slower, but any model works. The ``"kvcache_paged"``
  attention with another cache (or none) runs ``sdpa`` on what it is given.
- Beam search (``reorder_cache``), ``batch_repeat_interleave`` and ``batch_select_indices``
  move requests between rows and ``fork`` a request for each row that duplicates another:
  the rows share every block, and only the block a beam goes on to write in is copied
  (copy-on-write, by the next step). ``crop`` (rollback, assisted generation) truncates each
  request (``manager.truncate``): the blocks past its new end are free at once.
- Only public core API is used: the step, ``fork``, ``truncate``, ``gather``; the pool's
  policies (free-block accounting, copies, tables) stay in core.

Tested with transformers 5.24 (``cache=``) and, by hand, 4.56 and 4.57
(``past_key_values=``).

Lifecycle: the requests (and their blocks) live until :meth:`PagedCache.release` (also
``close()``, ``reset()``, leaving a ``with`` block, or the cache being garbage-collected).
Passing the same cache to a second ``generate`` *continues* its sequences, as with
``DynamicCache``; release it (or use a new one) to start over.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Literal, cast

import numpy as np
import numpy.typing as npt
import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations import sdpa_attention
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
from transformers.modeling_utils import AttentionInterface

from kvcache_core import (
    QUANTIZED_DTYPES,
    AllocationRequest,
    CacheConfig,
    DTypeMismatchError,
    InvalidArgumentError,
    InvalidTypeError,
    KvCacheError,
    LayerIndexError,
    LayerSpec,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    ShapeMismatchError,
    Step,
    UnknownRequestError,
    UnsupportedConfigError,
)
from kvcache_torch import hf_guard

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PagedCache",
    "cache_config_for",
    "model_fingerprint",
    "paged_attention_forward",
    "paged_attention_mask",
    "register_attention",
]

#: The name to pass as ``attn_implementation`` (or to ``model.set_attn_implementation``).
ATTN_IMPLEMENTATION: Final = "kvcache_paged"

#: Layer types of ``config.layer_types`` whose K/V this cache can hold.
_ATTENTION_LAYER_TYPES: Final = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

_TORCH_DTYPE_NAMES: Final[dict[torch.dtype, str]] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}

SlotArray = npt.NDArray[np.int64]
Mode = Literal["paged", "contiguous"]
AttentionFunction = Callable[..., tuple[torch.Tensor, None]]

#: transformers' own ``sdpa`` attention, for K/V that are contiguous already.
_sdpa_attention_forward = cast(
    AttentionFunction,
    sdpa_attention.sdpa_attention_forward,  # pyright: ignore[reportUnknownMemberType]  # **kwargs untyped there
)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    get_text_config = cast(
        Callable[..., PretrainedConfig],
        config.get_text_config,  # pyright: ignore[reportUnknownMemberType]  # parameters untyped there
    )
    return get_text_config(decoder=True)


def _attention_implementation(config: PretrainedConfig) -> str | None:
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


def _kv_heads(text: PretrainedConfig) -> int:
    """The KV heads a decoder hands its cache, as its attention computes them."""
    query_heads = _one_per_model(text.num_attention_heads, "query head counts") or 1
    if hasattr(text, "new_decoder_architecture") and hasattr(text, "multi_query"):  # Falcon's convention
        if getattr(text, "new_decoder_architecture", False):
            return query_heads  # keys and values are broadcast to every query head before caching
        if getattr(text, "multi_query", False):
            return 1
        return _one_per_model(getattr(text, "num_kv_heads", None), "KV head counts") or query_heads
    for name in ("num_key_value_heads", "num_kv_heads"):
        heads = _one_per_model(getattr(text, name, None), "KV head counts")
        if heads is not None:
            return heads
    return query_heads


def _geometry(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(num_layers, kv_heads, head_dim)`` of a decoder config.

    Raises:
        UnsupportedConfigError: layers with different KV head counts or head sizes.
    """
    text = _text_config(config)
    layers = int(text.num_hidden_layers)
    query_heads = _one_per_model(text.num_attention_heads, "query head counts") or 1
    head_dim = _one_per_model(getattr(text, "head_dim", None), "head sizes")
    return layers, _kv_heads(text), int(text.hidden_size) // query_heads if head_dim is None else head_dim


@dataclass(frozen=True)
class _LayerAttention:
    """What one decoder layer's attention applies beyond causal attention: a sliding
    window ``W`` or a chunk ``C`` (from ``config.layer_types``)."""

    window: int | None = None
    chunk: int | None = None


def _layer_attention(config: PretrainedConfig) -> tuple[_LayerAttention, ...]:
    """Each layer's window or chunk, from ``layer_types``, ``sliding_window`` and
    ``attention_chunk_size`` (a model without ``layer_types`` and with a ``sliding_window``,
    as Mistral, slides in every layer).

    Raises:
        UnsupportedConfigError: a layer type other than full, sliding or chunked attention
            (linear attention, state-space layers, ...), named in the message.
    """
    text = _text_config(config)
    layers = int(text.num_hidden_layers)
    window = _positive_or_none(getattr(text, "sliding_window", None))
    chunk = _positive_or_none(getattr(text, "attention_chunk_size", None))
    types: Sequence[str] | None = getattr(text, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * layers
    other = sorted(set(types) - _ATTENTION_LAYER_TYPES)
    if other:
        raise UnsupportedConfigError(
            f"the model has layers of type {', '.join(repr(name) for name in other)}, which keep no paged K/V; "
            f"kvcache serves {sorted(_ATTENTION_LAYER_TYPES)} layers"
        )
    specs: list[_LayerAttention] = []
    for layer_type in types:
        if layer_type == "sliding_attention" and window is not None:
            specs.append(_LayerAttention(window=window))
        elif layer_type == "chunked_attention" and chunk is not None:
            specs.append(_LayerAttention(chunk=chunk))
        else:
            specs.append(_LayerAttention())
    return tuple(specs)


def _positive_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


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
) -> CacheConfig:
    """The :class:`~kvcache_core.CacheConfig` of a pool for this model.

    Layers, KV heads and head size come from the model's (decoder) config; give the pool's
    size as ``num_blocks`` or as ``max_tokens`` (rounded up to whole blocks), not both.

    Args:
        model: the model (its ``config``, and the dtype and device of its weights), or just
            its ``PretrainedConfig``.
        num_blocks, max_tokens: the pool's size.
        block_size: tokens per block.
        dtype: ``"float32"``, ``torch.bfloat16``, ...; by default the model's weights' dtype
            (for a config, its ``dtype``; float32 when it has none). ``"int8"`` or
            ``"float8_e4m3fn"`` give a quantized pool (:mod:`kvcache_core.quantization`, about a
            quarter of float32's bytes) that computes in the model's dtype.
        device: where the pool lives (``"cpu"``, ``"cuda:0"``); by default the model's
            device (for a config, the CPU).
        model_id: the namespace of the pool's prefix-cache hashes; by default
            :func:`model_fingerprint` of the config and the pool's dtype, so blocks cached,
            saved or published for one model never map into another's pool.
        hybrid: give the pool each layer's spec (``CacheConfig.layer_specs``) when the
            model has sliding or chunked layers: sliding layers then form KV-cache groups
            that keep only their window's blocks (a long request takes a fraction of the
            memory). ``False``: one group keeping every block of every layer, which the
            contiguous path (``attn_implementation`` other than ``"kvcache_paged"``,
            reading whole K/V back) needs.

    Raises:
        InvalidArgumentError: neither or both of ``num_blocks`` and ``max_tokens``, or a
            ``max_tokens`` or ``block_size`` below 1.
        InvalidTypeError: ``model`` is neither a model with a ``config`` nor a config.
        UnsupportedConfigError: a dtype kvcache has no name for, layers that are not
            full, sliding or chunked attention (the message names their type), or a config
            set to ``"kvcache_paged"`` for a model whose attention does not call transformers'
            attention interface (Falcon, GPT-Neo, Bloom, MPT, ...: the message names the
            class and the remedy: its own attention, ``"sdpa"`` or ``"eager"``).
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
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        num_blocks = _blocks_for(max_tokens, block_size)
    configured = getattr(_text_config(config), "dtype", None) or getattr(config, "dtype", None) or "float32"
    if dtype is None:
        dtype = configured
    dtype = _dtype_name(dtype)
    # issue 14: a quantized pool computes in the model's dtype
    compute_dtype = _dtype_name(model_dtype or configured) if dtype in QUANTIZED_DTYPES else None
    layers, kv_heads, head_dim = _geometry(config)
    attention = _layer_attention(config)  # refuses layers that are not attention layers
    text = _text_config(config)
    if _attention_implementation(text) == ATTN_IMPLEMENTATION:
        hf_guard.refuse_unless_interface(text, None if isinstance(model, PretrainedConfig) else model)
    if not isinstance(hybrid, bool):
        raise InvalidArgumentError(f"hybrid must be a bool, got {hybrid!r}")
    specs = None
    if hybrid and any(layer.window is not None or layer.chunk is not None for layer in attention):
        specs = tuple(LayerSpec(window=layer.window, chunk=layer.chunk) for layer in attention)
    assert num_blocks is not None  # exactly one of the two was given, checked above
    return CacheConfig(
        num_layers=layers,
        num_heads=kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=dtype,
        device="cpu" if device is None else str(device),
        model_id=model_fingerprint(config, str(dtype)) if model_id is None else model_id,
        compute_dtype=compute_dtype,
        layer_specs=specs,
    )


def _dtype_name(dtype: object) -> str:
    """A torch dtype's pool name (``torch.bfloat16`` -> ``"bfloat16"``); a name as it is.

    Raises:
        UnsupportedConfigError: a torch dtype kvcache has no pool of.
    """
    if isinstance(dtype, torch.dtype):
        name = _TORCH_DTYPE_NAMES.get(dtype)
        if name is None:
            raise UnsupportedConfigError(
                f"dtype {dtype} has no kvcache pool; use one of {sorted(_TORCH_DTYPE_NAMES.values())}"
            )
        return name
    return str(dtype)


def model_fingerprint(config: PretrainedConfig, dtype: str) -> str:
    """``"<name or path>@sha256:<16 hex digits>"``: a hash of every field of the model's
    config (the transformers version aside) and the pool's dtype, the default ``model_id``
    of :func:`cache_config_for`. Two models share it only if their K/V can be shared."""
    fields = {key: value for key, value in config.to_dict().items() if key != "transformers_version"}
    text = json.dumps({"config": fields, "dtype": dtype}, sort_keys=True, default=str)
    name = str(getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or "model")
    return f"{name}@sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


# -- the step of one forward pass ------------------------------------------------------


@dataclass
class _Step:
    """The new tokens of one forward pass, shared by every layer.

    ``planned`` is ``None`` until the first layer has placed the tokens (the manager's
    ``begin_step`` grew every row by its real new tokens); every layer then writes and
    attends through it.
    """

    start: int  # positions (padding included) held before the step
    query_length: int
    layers_done: set[int] = field(default_factory=set[int])
    planned: Step[torch.Tensor] | None = None
    valid: torch.Tensor | None = None  # [batch, query_length] bool on the model's device; None: all real
    stored: int = 0  # tokens the step stores over all rows
    counts: list[int] = field(default_factory=list[int])  # real new tokens per row, once planned
    allocated: bool = False  # the step allocated the rows (a first forward)
    # Paged path: the layers whose update joined the step, and the one whose keys and values
    # wait for its kvcache_paged attention (None once consumed).
    updated: set[int] = field(default_factory=set[int])
    awaiting: int | None = None
    # A left-padded first forward: each row's real tokens (computed once, for every layer).
    real_lengths: list[int] | None = None


@dataclass
class _Pending:
    """What :meth:`PagedCache.update` hands to the attention function of the same layer."""

    cache: PagedCache
    layer: int
    key: torch.Tensor
    value: torch.Tensor
    step: _Step


class _PendingSlot(threading.local):
    entry: _Pending | None = None


_PENDING = _PendingSlot()


def _release_requests(manager: PagedKvCacheManager[torch.Tensor], request_ids: list[str]) -> None:
    """Deallocate every still-live request of ``request_ids`` and empty the list."""
    for request_id in request_ids:
        with contextlib.suppress(UnknownRequestError):  # already released through the manager
            manager.deallocate(request_id)
    request_ids.clear()


class PagedCacheLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers leaves __init_subclass__ untyped
    """The per-layer face transformers expects in ``Cache.layers``.

    It holds no tensors (``keys``/``values`` stay ``None``): the K/V live in the pool, and
    every call forwards to the owning :class:`PagedCache`.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in transformers
        self._cache = weakref.ref(cache)  # no cycle: the cache is freed (and released) promptly
        self.layer_idx = layer_idx
        self.is_initialized = True  # nothing to initialise lazily: the pool exists

    def _owner(self) -> PagedCache:
        cache = self._cache()
        if cache is None:
            raise InvalidArgumentError("this PagedCacheLayer's PagedCache no longer exists")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool exists already."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`PagedCache.update` for this layer."""
        return self._owner().update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """:meth:`PagedCache.get_mask_sizes` for this layer."""
        return self._owner().get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        """:meth:`PagedCache.get_seq_length` for this layer."""
        return self._owner().get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        """``-1``: the cache grows as long as the pool has blocks."""
        return -1

    def get_max_cache_shape(self) -> int:
        """``-1``, as :meth:`get_max_length` (the name transformers 4 asks for)."""
        return -1

    def reset(self) -> None:
        """Nothing per layer: :meth:`PagedCache.reset` releases the requests."""

    def crop(self, tokens_to_remove: int) -> None:
        """Per-layer cropping would desynchronise the layers: crop the whole cache."""
        raise UnsupportedConfigError("crop a PagedCache as a whole (cache.crop(n)), not one layer")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Per-layer reordering would desynchronise the layers: reorder the whole cache."""
        raise UnsupportedConfigError("reorder a PagedCache as a whole (cache.reorder_cache(idx)), not one layer")


class PagedCache(Cache):
    """A transformers ``Cache`` whose keys and values live in a kvcache paged pool.

    Row ``b`` of the batch is one kvcache request (allocated at the first forward, so the
    batch size comes from the model's input). Pass it to ``model.generate(..., cache=...)``
    (``past_key_values=`` before transformers 5) or to ``model(..., cache=...)`` in a manual
    loop, and load the model with ``attn_implementation="kvcache_paged"`` for the fast path
    (see the module docstring).

    Positions, lengths and masks are counted as transformers counts them: every column of
    the batch's 2-D ``attention_mask``, padding included (``get_seq_length``,
    ``get_mask_sizes``, ``crop``). With ``"kvcache_paged"`` attention the padding columns
    are not stored, so a request holds only its real tokens (``request_lengths()``).

    Args:
        manager: a manager of the ``torch`` backend whose geometry (layers, KV heads, head
            size) matches the model: ``create_manager("torch", cache_config_for(model, ...))``.
        config: the model's config (``model.config``); its ``_attn_implementation`` chooses
            the paged or the contiguous path at each forward.
        max_sequence_length: the most tokens a row will hold, if known: the allocator then
            keeps each request's blocks in one run, and growing past it raises
            ``SequenceTooLongError``.

    Raises:
        InvalidTypeError: ``manager`` is not a ``PagedKvCacheManager``.
        UnsupportedConfigError: the model's geometry differs from the pool's, the pool has a
            sliding window, the model has layers other than attention layers (linear
            attention, shared K/V, ...), or the config is set to ``"kvcache_paged"`` for a
            model whose attention does not call transformers' attention interface (the
            message names the class and the remedy, its own ``"sdpa"`` or ``"eager"``; a model
            transformers cannot judge up front is refused at its first forward instead, see
            :meth:`update`).
        InvalidArgumentError: a bad ``max_sequence_length``.
    """

    def __init__(
        self,
        manager: PagedKvCacheManager[torch.Tensor],
        config: PretrainedConfig,
        *,
        max_sequence_length: int | None = None,
    ) -> None:
        if not isinstance(manager, PagedKvCacheManager):
            raise InvalidTypeError(f"manager must be a PagedKvCacheManager, got {type(manager).__name__}")
        if not isinstance(config, PretrainedConfig):
            raise InvalidTypeError(f"config must be the model's PretrainedConfig, got {type(config).__name__}")
        if max_sequence_length is not None and (
            isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) or max_sequence_length < 1
        ):
            raise InvalidArgumentError(f"max_sequence_length must be an int >= 1 or None, got {max_sequence_length!r}")
        pool = manager.config
        layers, kv_heads, head_dim = _geometry(config)
        if (layers, kv_heads, head_dim) != (pool.num_layers, pool.num_heads, pool.head_dim):
            raise UnsupportedConfigError(
                f"the model has {layers} layers of {kv_heads} KV heads of size {head_dim}, the pool "
                f"{pool.num_layers} layers of {pool.num_heads} heads of size {pool.head_dim}; build the pool "
                "with cache_config_for(model, ...)"
            )
        text = _text_config(config)
        if _attention_implementation(text) == ATTN_IMPLEMENTATION:
            hf_guard.refuse_unless_interface(text)
        self._layer_attention = _layer_attention(config)  # refuses linear-attention, state-space layers
        for layer, attention in enumerate(self._layer_attention):
            kept = pool.kv_groups[pool.layer_place(layer)[0]].window
            if kept is not None and (attention.window is None or attention.window > kept):
                raise UnsupportedConfigError(
                    f"the pool keeps only the last {kept} positions of layer {layer}, whose attention "
                    f"({'window ' + str(attention.window) if attention.window else 'full'}) needs more; build the "
                    "pool with cache_config_for(model, ...)"
                )
        self._windowed = any(group.window is not None for group in pool.kv_groups)
        shared_kv_layers: object = getattr(text, "num_kv_shared_layers", None)
        if shared_kv_layers:
            raise UnsupportedConfigError("PagedCache holds attention layers only; this model also has shared-KV layers")
        super().__init__(layers=[PagedCacheLayer(self, index) for index in range(layers)])
        self._manager = manager
        self._text = text
        self._max_sequence_length = max_sequence_length
        self._num_layers = layers
        self._handles: list[PagedKvCacheHandle[torch.Tensor]] = []
        self._request_ids: list[str] = []  # shared with the finalizer: changed in place only
        # Tokens in use per row; at most the request's num_tokens() (a crop keeps the blocks).
        self._tokens: list[int] = []
        self._lengths = [0] * layers  # positions per layer, padding included
        self._step: _Step | None = None
        self._mode: Mode | None = None
        # Which positions each row stored ([rows, positions]); crop needs it.
        self._stored = np.zeros((0, 0), dtype=np.bool_)
        self._positions = 0
        self._id_prefix = f"hf-{uuid.uuid4().hex[:12]}"
        self._id_counter = itertools.count()
        self._finalizer = weakref.finalize(self, _release_requests, manager, self._request_ids)

    # -- introspection -----------------------------------------------------------------

    @property
    def manager(self) -> PagedKvCacheManager[torch.Tensor]:
        """The manager whose pool holds the K/V."""
        return self._manager

    @property
    def handles(self) -> tuple[PagedKvCacheHandle[torch.Tensor], ...]:
        """The kvcache handle of each batch row, in row order."""
        return tuple(self._handles)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The kvcache request id of each batch row, in row order."""
        return tuple(self._request_ids)

    def request_lengths(self) -> list[int]:
        """Tokens held per row (without the padding the paged path skips).

        After :meth:`crop` a request keeps the blocks (and ``num_tokens()``) of its removed
        tokens, which its next tokens overwrite; this counts the tokens still in use.
        """
        return list(self._tokens)

    @property
    def batch_size(self) -> int:
        """Rows held; 0 before the first forward and after :meth:`release`."""
        return len(self._handles)

    @property
    def is_compileable(self) -> bool:
        """``False``: the pool's tables change shape every step."""
        return False

    @property
    def is_initialized(self) -> bool:
        """Whether the cache holds requests."""
        return bool(self._handles)

    @property
    def is_croppable(self) -> bool:
        """``True``: :meth:`crop` restores the state before the removed positions."""
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached for ``layer_idx`` (padding columns included, as transformers counts)."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self._num_layers:
            return 0
        return self._lengths[layer_idx]

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for a mask of ``query_length`` new tokens: all the cached
        positions plus the new ones, from offset 0.

        ``query_length`` may also be the ``cache_position`` tensor older transformers pass.
        """
        length = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.get_seq_length(layer_idx) + length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """``max_sequence_length`` if given, else ``-1`` (grows while the pool has blocks)."""
        return -1 if self._max_sequence_length is None else self._max_sequence_length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """:meth:`get_max_length` under the name transformers 4 uses."""
        return self.get_max_length()

    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={len(self._handles)}, positions={self._positions}, "
            f"tokens={sum(self.request_lengths())}, mode={self._mode}, manager={self._manager!r})"
        )

    # -- prefix caching ----------------------------------------------------------------

    def map_cached_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Start every row from the prefix cache: call it with the prompts before ``generate``.

        Each row becomes a kvcache request holding its prompt's token ids (padding left
        out), so that the blocks of the prompt become cacheable as they are written, and
        mapping every cached full block of it (``CacheConfig(enable_prefix_caching=True)``).
        transformers counts positions per batch, so the rows keep the cached positions all
        of them share (a row with fewer drops its extra hits); ``generate`` then sees a cache
        of that many positions and computes only the tokens after them.

        Args:
            input_ids: ``[batch, positions]`` token ids, left-padded.
            attention_mask: ``[batch, positions]``, 0 for padding (``None``: no padding).

        Returns:
            The positions now cached (``get_seq_length()``): 0 without a hit.

        Raises:
            InvalidArgumentError: the cache already holds rows (``release()`` it first), or
                ids and mask that are not 2-D integer tensors of one shape, left-padded.
            UnsupportedConfigError: the model does not run ``"kvcache_paged"`` attention
                (the contiguous path stores padding, so rows cannot skip it).
            OutOfBlocksError: the pool cannot hold the rows (nothing is kept).
        """
        if self._handles:
            raise InvalidArgumentError(f"the cache holds {len(self._handles)} rows already: release() it first")
        if _attention_implementation(self._text) != ATTN_IMPLEMENTATION:
            raise UnsupportedConfigError(
                f"map_cached_prefix needs attn_implementation={ATTN_IMPLEMENTATION!r}, the model runs "
                f"{_attention_implementation(self._text)!r}"
            )
        prompts = self._prompt_rows(input_ids, attention_mask)
        columns = int(input_ids.shape[1])
        handles: list[PagedKvCacheHandle[torch.Tensor]] = []
        request_ids: list[str] = []
        try:
            for prompt in prompts:
                request_id = self._new_request_id()
                handles.append(
                    self._manager.allocate(
                        AllocationRequest(
                            request_id, prompt_token_ids=prompt or None, max_sequence_length=self._max_sequence_length
                        )
                    )
                )
                request_ids.append(request_id)
            pads = [columns - len(prompt) for prompt in prompts]
            shared = min(pad + handle.num_cached_tokens() for pad, handle in zip(pads, handles, strict=True))
            kept = [max(0, shared - pad) for pad in pads]
            for handle, tokens in zip(handles, kept, strict=True):
                if handle.num_tokens() > tokens:
                    self._manager.truncate(handle, tokens)
        except BaseException:
            _release_requests(self._manager, request_ids)
            raise
        self._handles[:] = handles
        self._request_ids[:] = request_ids
        self._tokens[:] = kept
        self._mode = "paged"
        self._lengths = [shared] * self._num_layers
        self._positions = shared
        real = np.ones((len(prompts), columns), dtype=np.bool_)
        for row, pad in enumerate(pads):
            real[row, :pad] = False
        self._stored = real[:, :shared].copy()
        return shared

    def _prompt_rows(self, input_ids: object, attention_mask: object) -> list[tuple[int, ...]]:
        """Each row's real token ids, after checking that the batch is left-padded."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise InvalidArgumentError(f"input_ids must be a 2-D integer tensor, got {input_ids!r}")
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        elif isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape:
            mask = attention_mask.to(torch.bool)
        else:
            raise InvalidArgumentError(
                f"attention_mask must be a tensor of the ids' shape {tuple(input_ids.shape)}, got {attention_mask!r}"
            )
        rows: list[tuple[int, ...]] = []
        id_rows: npt.NDArray[np.int64] = input_ids.cpu().numpy().astype(np.int64)
        real_rows: npt.NDArray[np.bool_] = mask.cpu().numpy()
        for row, (ids, real) in enumerate(zip(id_rows, real_rows, strict=True)):
            count = int(real.sum())
            if not bool(real[real.shape[0] - count :].all()):
                raise InvalidArgumentError(
                    f"row {row} of the attention_mask is not left-padded: {real.astype(np.int64).tolist()}"
                )
            rows.append(tuple(int(token) for token in ids[real.shape[0] - count :]))
        return rows

    # -- lifecycle ---------------------------------------------------------------------

    def release(self) -> None:
        """Deallocate every row's request: its blocks return to the pool. The cache is then
        empty and can serve a new batch."""
        pending = _PENDING.entry
        if pending is not None and pending.cache is self:  # a forward that failed half-way
            _PENDING.entry = None
        _release_requests(self._manager, self._request_ids)
        self._handles.clear()
        self._tokens.clear()
        self._lengths = [0] * self._num_layers
        self._step = None
        self._mode = None
        self._stored = np.zeros((0, 0), dtype=np.bool_)
        self._positions = 0

    def close(self) -> None:
        """:meth:`release`."""
        self.release()

    def reset(self) -> None:
        """transformers' ``Cache.reset``: here the same as :meth:`release`."""
        self.release()

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()

    # -- the write/read path -------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take one layer's new keys and values ``[batch, kv_heads, new_tokens, head_dim]``.

        With ``"kvcache_paged"`` attention the write happens in the attention function (it
        sees the padding mask, so padding is not stored) and the new K/V are returned as
        they are. Otherwise they are written now and the whole contiguous K/V ``[batch,
        kv_heads, positions, head_dim]`` are returned.

        Raises:
            LayerIndexError: ``layer_idx`` outside the model's layers.
            ShapeMismatchError: K/V not ``[batch, kv_heads, new_tokens, head_dim]`` of the
                pool's geometry, or a batch size other than the rows held.
            DTypeMismatchError: K/V of another dtype than the pool's.
            UnsupportedConfigError: the attention implementation changed while the cache
                holds tokens, the previous forward did not reach every layer, or (with
                ``"kvcache_paged"``) an earlier layer's keys and values never reached the
                ``kvcache_paged`` attention: the model computes attention itself. That
                forward is undone (a first forward leaves no row), naming the model class
                and the remedy (its own ``"sdpa"`` or ``"eager"`` attention).
            OutOfBlocksError, SequenceTooLongError: the pool cannot hold the new tokens
                (nothing is changed).
        """
        layer = self._check_layer(layer_idx)
        self._check_states(key_states, value_states)
        implementation = _attention_implementation(self._text)
        mode: Mode = "paged" if implementation == ATTN_IMPLEMENTATION else "contiguous"
        if self._mode is not None and mode != self._mode and self._positions:
            raise UnsupportedConfigError(
                f"the cache was filled with the {self._mode} path and the model now runs the {mode} path "
                f"(attn_implementation {implementation!r}); release() the cache before switching"
            )
        if mode == "contiguous" and self._windowed:
            raise UnsupportedConfigError(
                f"attn_implementation {implementation!r} reads every position of every layer back, but this pool's "
                "sliding layers keep only their window's blocks; run attn_implementation='kvcache_paged', or build "
                "the pool with cache_config_for(model, ..., hybrid=False)"
            )
        if mode == "paged":
            self._check_attended(layer)
        step = self._join_step(layer, int(key_states.shape[0]), int(key_states.shape[2]))
        if mode == "paged":
            step.updated.add(layer)
            step.awaiting = layer
            _PENDING.entry = _Pending(self, layer, key_states, value_states, step)
            return key_states, value_states
        if step.planned is None:
            self._place_step(step, int(key_states.shape[0]), None, "contiguous")
        assert step.planned is not None  # placed just above
        step.planned.write(layer, _token_major(key_states), _token_major(value_states))
        self._finish_layer(step, layer)
        return self._gather_padded(layer)

    def _attend(
        self,
        pending: _Pending,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
        features: dict[str, Any],
    ) -> torch.Tensor:
        """Write the layer's real new tokens into the pool (one write for the batch) and
        attend over the pool in place, with the layer's attention features (``window``,
        ``softcap``, ``sinks``; its ``chunk`` comes from the config).

        A first forward is the one case where the whole context is the new K/V themselves,
        contiguous already: it goes to transformers' ``sdpa`` on them (faster than any read
        of the pool, and nothing is rebuilt); with left padding, one call per row on its real
        tokens, so padding costs no attention.

        Returns ``[batch, new_tokens, query_heads, head_dim]``; rows of padding tokens are 0.
        """
        step, layer = pending.step, pending.layer
        batch, query_heads, query_length, head_dim = query.shape
        if batch != len(pending.key) or query_length != step.query_length:
            raise ShapeMismatchError(
                f"query {tuple(query.shape)} does not match the keys {tuple(pending.key.shape)} of this layer"
            )
        if step.planned is None:
            valid = _real_tokens(attention_mask, step.start + query_length, query_length, batch)
            self._place_step(step, batch, valid, "paged")
        planned = step.planned
        assert planned is not None  # placed just above
        valid = step.valid
        if step.stored:  # the step was checked when planned: per layer only the arrays are
            planned.write(layer, _token_major(pending.key, valid), _token_major(pending.value, valid))
        layer_features = {name: value for name, value in features.items() if value is not None}
        chunk = self._layer_attention[layer].chunk
        if chunk is not None:
            layer_features["chunk"] = chunk
        first_prefill = step.start == 0 and query_length > 1 and not layer_features
        if first_prefill and valid is not None and step.real_lengths is None:
            step.real_lengths = _left_padded_lengths(valid) or []  # []: not left padding
        real_lengths = step.real_lengths if first_prefill and valid is not None else None
        if first_prefill and valid is None:
            output, _ = _sdpa_attention_forward(module, query, pending.key, pending.value, None, 0.0, scaling)
        elif real_lengths:
            # A left-padded first forward: each row's context is its own real new K/V, the
            # last ``n`` positions; sdpa per row reads them as they are, padding never enters.
            output = query.new_zeros((batch, query_length, query_heads, head_dim))
            for row, length in enumerate(real_lengths):
                if length:
                    rows = slice(query_length - length, query_length)
                    output[row, rows], _ = _sdpa_attention_forward(
                        module,
                        query[row : row + 1, :, rows],
                        pending.key[row : row + 1, :, rows],
                        pending.value[row : row + 1, :, rows],
                        None,
                        0.0,
                        scaling,
                    )
        elif not step.stored:
            output = query.new_zeros((batch, query_length, query_heads, head_dim))
        else:
            attended = planned.attention(
                layer, _token_major(query, valid), scale=scaling, causal=True, **layer_features
            )
            if valid is None:
                output = attended.view(batch, query_length, query_heads, head_dim)
            else:
                output = query.new_zeros((batch, query_length, query_heads, head_dim))
                output[valid] = attended
        self._finish_layer(step, layer)
        return output

    # -- batch surgery: beam search, crop --------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes a copy of row ``beam_idx[i]`` (beam search).

        A source row used once moves; each further use is a ``fork`` of its request, which
        shares every block: only the block a beam goes on to write in is copied, by the
        next forward (copy-on-write).

        Raises:
            InvalidArgumentError: an index outside the rows, or not one per row.
        """
        sources = self._check_indices(beam_idx, "beam_idx")
        if len(sources) != len(self._handles):
            raise InvalidArgumentError(
                f"beam_idx must name one source per row ({len(self._handles)}), got {len(sources)}"
            )
        self._remap_rows(sources)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place: rows ``a, b`` become ``a, a, b, b``
        (the repeats are forks: they share the row's blocks until they diverge).

        Raises:
            InvalidArgumentError: ``repeats`` below 1.
        """
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise InvalidArgumentError(f"repeats must be an int >= 1, got {repeats!r}")
        self._remap_rows([row for row in range(len(self._handles)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in that order); the others are released and a
        repeated row is forked (shared blocks).

        Raises:
            InvalidArgumentError: an index outside the rows.
        """
        self._remap_rows(self._check_indices(indices, "indices"))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last positions: ``crop(-n)`` removes ``n`` (transformers 5 style);
        ``crop(n)`` with ``n >= 0`` keeps the first ``n`` (the older style); ``crop(0)`` and
        ``crop(n)`` with ``n`` at or past the length change nothing.

        Each row's request is truncated (``manager.truncate``): the blocks wholly past its
        new end go back to the pool at once.

        Raises:
            InvalidArgumentError: removing more positions than cached, or not an int.
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise InvalidArgumentError(f"crop takes an int, got {tokens_to_remove!r}")
        self._check_step_complete()
        total = self._positions
        keep = total + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, total)
        if tokens_to_remove == 0 or keep == total:
            return
        if keep < 0:
            raise InvalidArgumentError(f"cannot remove {-tokens_to_remove} positions: the cache holds {total}")
        kept_tokens = [int(kept) for kept in self._stored[:, :keep].sum(axis=1)]
        for handle, tokens in zip(self._handles, kept_tokens, strict=True):
            self._manager.truncate(handle, tokens)
        self._tokens[:] = kept_tokens
        self._lengths = [keep] * self._num_layers
        self._positions = keep
        self._step = None

    # -- internals -----------------------------------------------------------------------

    def _check_layer(self, layer_idx: object) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self._num_layers:
            raise LayerIndexError(f"layer {layer_idx!r} is out of range: valid layers are 0 to {self._num_layers - 1}")
        return layer_idx

    def _check_states(self, keys: object, values: object) -> None:
        pool = self._manager.config
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise InvalidTypeError(
                f"keys and values must be torch tensors, got {type(keys).__name__} and {type(values).__name__}"
            )
        if (
            keys.shape != values.shape
            or keys.dim() != 4
            or (keys.shape[1], keys.shape[3])
            != (
                pool.num_heads,
                pool.head_dim,
            )
        ):
            raise ShapeMismatchError(
                f"keys and values must be [batch, {pool.num_heads}, new_tokens, {pool.head_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        dtype = _TORCH_DTYPE_NAMES.get(keys.dtype, str(keys.dtype))
        if dtype != pool.io_dtype or values.dtype != keys.dtype:
            raise DTypeMismatchError(
                f"keys and values are {keys.dtype} and {values.dtype}, the pool computes in {pool.io_dtype}: build it with "
                "cache_config_for(model, ...), which takes the model's dtype"
            )
        if self._handles and keys.shape[0] != len(self._handles):
            raise ShapeMismatchError(
                f"the cache holds {len(self._handles)} rows, the model passed a batch of {keys.shape[0]}; "
                "release() it to start a new batch"
            )

    def _check_step_complete(self) -> None:
        step = self._step
        if step is not None and len(step.layers_done) != self._num_layers:
            raise UnsupportedConfigError(
                f"the last forward reached {len(step.layers_done)} of {self._num_layers} layers (it failed, or the "
                "model skips layers); release() the cache"
            )

    def _check_attended(self, layer: int) -> None:
        """Refuse a model whose attention does not call the ``kvcache_paged`` attention: an
        update of another layer of the same forward arrives while an earlier layer's keys
        and values still wait for it, or a new forward begins after one in which every layer
        was updated and none attended (a one-layer model). The refused forward is undone.

        Raises:
            UnsupportedConfigError: naming the model class and the remedy.
        """
        step = self._step
        if step is None or step.awaiting is None:
            return
        same_forward = layer not in step.updated
        if not same_forward and (step.layers_done or len(step.updated) != self._num_layers):
            return  # an interrupted forward, not a pattern: _join_step decides
        awaiting = step.awaiting
        self._abandon_step(step)
        raise hf_guard.not_through_interface(
            hf_guard.decoder_class(self._text), self._text, awaiting, earlier=not same_forward
        )

    def _abandon_step(self, step: _Step) -> None:
        """Undo a forward refused half-way: rows it allocated are released, rows it grew go
        back to their length before it (or, where a sliding window already dropped the
        blocks that needs, are released too), and the next forward starts afresh."""
        pending = _PENDING.entry
        if pending is not None and pending.cache is self:
            _PENDING.entry = None
        self._step = None
        if step.planned is None:
            return  # nothing was placed or stored
        if step.allocated:
            self.release()
            return
        before = [tokens - count for tokens, count in zip(self._tokens, step.counts, strict=True)]
        try:
            for handle, tokens in zip(self._handles, before, strict=True):
                self._manager.truncate(handle, tokens)
        except KvCacheError:
            self.release()
            return
        self._tokens[:] = before
        self._positions = step.start
        self._lengths = [step.start] * self._num_layers

    def _join_step(self, layer: int, batch: int, query_length: int) -> _Step:
        """The step this layer's update belongs to: the current one, or a new one once every
        layer has finished the current one."""
        step = self._step
        if step is not None and layer not in step.layers_done:
            if query_length != step.query_length:
                raise ShapeMismatchError(
                    f"layer {layer} got {query_length} new tokens, the other layers of this forward {step.query_length}"
                )
            return step
        self._check_step_complete()
        if query_length < 1 and not self._handles:
            raise ShapeMismatchError("the first forward must bring at least one token per row")
        self._step = _Step(start=self._lengths[layer], query_length=query_length)
        return self._step

    def _place_step(self, step: _Step, batch: int, valid: torch.Tensor | None, mode: Mode) -> None:
        """Plan the step in the manager: allocate the rows at the first forward, then grow
        every row by its real new tokens (all new tokens on the contiguous path), for the
        whole batch at once.

        Atomic: when the pool cannot hold the step, nothing is allocated or grown.
        """
        query_length = step.query_length
        counts = [query_length] * batch if valid is None else [int(c) for c in valid.sum(dim=1).cpu().numpy()]
        allocated: list[str] = []
        try:
            if not self._handles:
                for _ in counts:
                    request_id = self._new_request_id()
                    handle = self._manager.allocate(
                        AllocationRequest(request_id, max_sequence_length=self._max_sequence_length)
                    )
                    allocated.append(request_id)
                    self._handles.append(handle)
                    self._request_ids.append(request_id)
                    self._tokens.append(0)
            planned = self._manager.begin_step(self._handles, counts)
        except BaseException:
            if allocated:  # the first forward failed: no row stays
                _release_requests(self._manager, self._request_ids)
                self._handles.clear()
                self._tokens.clear()
            self._step = None  # nothing changed: the next forward starts afresh
            raise
        step.planned = planned
        step.valid = valid
        step.stored = planned.num_new_tokens
        step.counts = counts
        step.allocated = bool(allocated)
        self._tokens[:] = [tokens + count for tokens, count in zip(self._tokens, counts, strict=True)]
        self._mode = mode
        self._record_stored(valid, batch, query_length)

    def _record_stored(self, valid: torch.Tensor | None, batch: int, query_length: int) -> None:
        start = self._positions
        if self._stored.shape[0] != batch or self._stored.shape[1] < start + query_length:
            grown = np.zeros((batch, max(2 * self._stored.shape[1], start + query_length, 64)), dtype=np.bool_)
            grown[: self._stored.shape[0], : self._stored.shape[1]] = self._stored
            self._stored = grown
        self._stored[:, start : start + query_length] = True if valid is None else valid.cpu().numpy()
        self._positions = start + query_length

    def _finish_layer(self, step: _Step, layer: int) -> None:
        step.layers_done.add(layer)
        self._lengths[layer] = step.start + step.query_length

    def _gather_padded(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's K/V as ``[batch, kv_heads, positions, head_dim]`` (contiguous path:
        every row stored every position)."""
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for handle, tokens in zip(self._handles, self._tokens, strict=True):
            k, v = self._manager.gather(handle, layer)
            keys.append(k[:tokens].transpose(0, 1))
            values.append(v[:tokens].transpose(0, 1))
        return torch.stack(keys), torch.stack(values)

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._id_counter)}"

    def _check_indices(self, indices: object, name: str) -> list[int]:
        rows = len(self._handles)
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.is_floating_point():
            raise InvalidArgumentError(f"{name} must be a 1-D integer tensor, got {indices!r}")
        values = [int(i) for i in indices.cpu().numpy()]
        bad = [i for i in values if not 0 <= i < rows]
        if bad:
            raise InvalidArgumentError(f"{name} names row {bad[0]}: valid rows are 0 to {rows - 1}")
        return values

    def _remap_rows(self, sources: list[int]) -> None:
        """New row ``j`` takes the content of old row ``sources[j]``.

        Each source's own request goes to one of the rows that want it (itself if it does),
        the other rows get forks of it (shared blocks, copied on write), and requests
        nobody wants are released.
        """
        self._check_step_complete()
        rows = len(self._handles)
        if sources == list(range(rows)):
            return
        chosen: list[int | None] = [None] * len(sources)
        taken: set[int] = set()
        for new_row, source in enumerate(sources):
            if source == new_row:
                chosen[new_row] = source
                taken.add(source)
        for new_row, source in enumerate(sources):
            if chosen[new_row] is None and source not in taken:
                chosen[new_row] = source
                taken.add(source)
        forks: dict[int, tuple[PagedKvCacheHandle[torch.Tensor], str]] = {}
        try:
            for new_row, chosen_source in enumerate(chosen):
                if chosen_source is None:
                    request_id = self._new_request_id()
                    forks[new_row] = (self._manager.fork(self._handles[sources[new_row]], request_id), request_id)
        except BaseException:
            _release_requests(self._manager, [request_id for _, request_id in forks.values()])
            raise
        handles: list[PagedKvCacheHandle[torch.Tensor]] = []
        request_ids: list[str] = []
        for new_row, chosen_source in enumerate(chosen):
            if chosen_source is None:
                handle, request_id = forks[new_row]
            else:
                handle, request_id = self._handles[chosen_source], self._request_ids[chosen_source]
            handles.append(handle)
            request_ids.append(request_id)
        unused = [self._request_ids[row] for row in range(rows) if row not in taken]
        self._handles[:] = handles
        self._request_ids[:] = request_ids
        self._tokens[:] = [self._tokens[source] for source in sources]
        _release_requests(self._manager, unused)
        self._stored = self._stored[sources]
        self._step = None


def _token_major(states: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``[batch, heads, tokens, dim]`` -> ``[stored tokens, heads, dim]``, rows in order,
    keeping the ``valid`` tokens only (all when ``None``)."""
    token_major = states.transpose(1, 2)
    if valid is None:
        return token_major.reshape(-1, states.shape[1], states.shape[3]).contiguous()
    return token_major[valid].contiguous()


def _left_padded_lengths(valid: torch.Tensor) -> list[int] | None:
    """Each row's count of real tokens when every row of ``valid [batch, tokens]`` is
    padding then real tokens (left padding), else ``None``."""
    counts = valid.sum(dim=1)
    positions = torch.arange(valid.shape[1], device=valid.device)
    if not torch.equal(positions[None, :] >= (valid.shape[1] - counts)[:, None], valid):
        return None
    return [int(count) for count in counts]


def _real_tokens(
    attention_mask: torch.Tensor | None, kv_length: int, query_length: int, batch: int
) -> torch.Tensor | None:
    """Which new tokens are real (not padding), ``[batch, query_length]`` bool, or ``None``
    when all are, from the 2-D mask the ``kvcache_paged`` mask function passes on."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] != kv_length:
        raise ShapeMismatchError(
            f"kvcache_paged attention needs the 2-D padding mask [batch={batch}, positions={kv_length}] "
            f"(cached plus new), got {tuple(attention_mask.shape)}"
        )
    new = attention_mask[:, kv_length - query_length :].to(torch.bool)
    return None if bool(new.all()) else new


# -- the attention implementation ----------------------------------------------------------


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
    mask = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    return None if bool(mask.all()) else mask


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
    pending = _PENDING.entry
    _PENDING.entry = None
    if pending is not None and pending.step.awaiting == pending.layer:
        pending.step.awaiting = None  # the layer's keys and values reached their attention
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
        return _sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if pending is None:
        chunk = _module_chunk(module)
        if chunk is not None and key.shape[2] > chunk:
            raise UnsupportedConfigError(
                f"kvcache_paged attention without a PagedCache does not apply attention chunks: the context "
                f"({key.shape[2]} positions) outgrew the chunk of {chunk}; pass a PagedCache"
            )
        dense_window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
        return _sdpa_attention_forward(
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
    return pending.cache._attend(pending, module, query, attention_mask, scaling, features), None  # pyright: ignore[reportPrivateUsage]


def _module_chunk(module: torch.nn.Module) -> int | None:
    """The attention chunk of a module's layer, from its ``config`` and ``layer_idx`` (Llama 4)."""
    config: object = getattr(module, "config", None)
    layer: object = getattr(module, "layer_idx", None)
    if not isinstance(config, PretrainedConfig) or not isinstance(layer, int):
        return None
    specs = _layer_attention(config)
    return specs[layer].chunk if 0 <= layer < len(specs) else None


def _dense_mask(
    attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, window: int | None = None
) -> torch.Tensor | None:
    """The 4-D bool sdpa mask ``[batch, 1, new, kv]`` for contiguous K/V: causal (queries are
    the last positions), the sliding ``window`` and padding; ``None`` when sdpa's own causal
    flag is exact."""
    query_length, kv_length = query.shape[2], key.shape[2]
    outgrown = window is not None and kv_length > window
    if attention_mask is None and query_length in (1, kv_length) and not outgrown:
        return None
    positions = torch.arange(kv_length, device=query.device)
    causal = positions[None, :] <= positions[kv_length - query_length :, None]
    if outgrown:
        assert window is not None
        causal = causal & (positions[None, :] > positions[kv_length - query_length :, None] - window)
    mask = causal[None, None]
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


register_attention()
