"""Whether a model fits a pool, and whether an ``update``'s keys and values fit it: the
checks :class:`~kvcache_torch.hf.PagedCache` runs when it is built and on every update."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from kvcache_core import CacheConfig, LayerSpec, UnsupportedConfigError
from kvcache_core.contract.groups import LayerGeometry, group_serves_layer
from kvcache_core.errors import DTypeMismatchError, InvalidTypeError, ShapeMismatchError
from kvcache_torch.dtypes import TORCH_DTYPES, dtype_name
from kvcache_torch.hf.forward_pass import Mode
from kvcache_torch.hf.guard import refuse_unless_interface
from kvcache_torch.hf.model_config import (
    ATTN_IMPLEMENTATION,
    attention_implementation,
    geometry,
    layer_specs,
    refuse_latent_on_paged_path,
    value_head_dim,
)
from kvcache_torch.hf.shared_kv import kv_sources, refuse_sliced_shared_layers_on_paged_path, stored_layer_count

__all__ = ["UpdateCheck", "check_model_fits_pool", "check_update_arrays", "forward_mode"]


def check_model_fits_pool(
    config: PretrainedConfig, text: PretrainedConfig, pool: CacheConfig, model: torch.nn.Module | None
) -> tuple[int, tuple[LayerSpec, ...], tuple[int, ...]]:
    """``(layers kept, each layer's spec, each layer's K/V source layer)`` of a model whose
    geometry, layer kinds and windows the pool serves.

    Raises:
        UnsupportedConfigError: the model's geometry differs from the pool's, a layer is a
            state layer in one and not the other, the pool keeps fewer positions of a layer
            than its attention needs, or the model's attention is not served on its path
            (Gemma 4 with layers reusing K/V on the paged path, by name).
    """
    _, kv_heads, head_dim = geometry(config)
    values = value_head_dim(config)
    layers = stored_layer_count(text)  # the layers that keep K/V (others reuse theirs)
    specs = layer_specs(config)  # refuses layers of kinds it cannot hold
    if layers != pool.num_layers:
        raise UnsupportedConfigError(
            f"the model has {layers} layers that keep K/V, the pool {pool.num_layers}; build the pool with "
            "cache_config_for(model, ...)"
        )
    for layer, spec in enumerate(specs[:layers]):
        wanted = LayerGeometry(
            spec.num_heads or kv_heads, spec.head_dim or head_dim, values or spec.head_dim or head_dim
        )
        held = pool.layer_geometry(layer)
        if spec.keeps_kv and held != wanted:
            raise UnsupportedConfigError(
                f"layer {layer} of the model has {wanted.num_heads} KV heads of size {wanted.head_dim} (values "
                f"{wanted.value_width}), of the pool {held.num_heads} heads of size {held.head_dim} (values "
                f"{held.value_width}); build the pool with cache_config_for(model, ...)"
            )
    if attention_implementation(text) == ATTN_IMPLEMENTATION:
        refuse_sliced_shared_layers_on_paged_path(text)
        refuse_unless_interface(text, model)
    sources = kv_sources(text)
    for layer, spec in enumerate(specs[:layers]):
        pooled = pool.layer_spec(layer)
        if (spec.keeps_kv, spec.keeps_state) != (pooled.keeps_kv, pooled.keeps_state):
            raise UnsupportedConfigError(
                f"layer {layer} is a {spec.kind} layer of the model and a {pooled.kind} layer of "
                "the pool; build the pool with cache_config_for(model, ...)"
            )
        if not spec.keeps_kv:
            continue
        kept = pool.kv_groups[pool.layer_place(layer)[0]].window
        if not group_serves_layer(kept, spec):
            raise UnsupportedConfigError(
                f"the pool keeps only the last {kept} positions of layer {layer}, whose attention "
                f"({'window ' + str(spec.window) if spec.window else 'full'}) needs more; build the "
                "pool with cache_config_for(model, ...)"
            )
    return layers, specs, sources


class UpdateCheck:
    """The check of every ``update``'s layer index, keys and values against ``pool``, with each
    layer's widths and the dtype worked out once: the arrays of a fitting model pass in a few
    comparisons; anything else is checked in full (:func:`check_update_arrays`), which names
    what is wrong."""

    __slots__ = ("_dtype", "_pool", "_widths")

    def __init__(self, pool: CacheConfig) -> None:
        self._pool = pool
        self._dtype = TORCH_DTYPES.get(pool.io_dtype)  # None: no tensor takes the quick check
        self._widths = {
            layer: (shape.num_heads, shape.head_dim, shape.value_width)
            for layer in range(pool.num_layers)
            for shape in (pool.layer_geometry(layer),)
        }

    def __call__(self, keys: object, values: object, layer: object, rows: int | None) -> int:
        """``layer`` as an int, once ``keys`` and ``values`` are ``[rows, heads, new_tokens,
        width]`` of that layer (``rows`` ``None``: any batch) in the dtype the pool computes in.

        Raises:
            LayerIndexError: ``layer`` outside the pool's layers.
            InvalidTypeError, ShapeMismatchError, DTypeMismatchError: as
                :func:`check_update_arrays`.
        """
        if (
            type(layer) is int
            and (widths := self._widths.get(layer)) is not None
            and type(keys) is torch.Tensor
            and type(values) is torch.Tensor
            and keys.dtype is self._dtype
            and values.dtype is self._dtype
        ):
            shape, (heads, key_width, value_width) = keys.shape, widths
            if (
                len(shape) == 4
                and (rows is None or shape[0] == rows)
                and shape[1] == heads
                and shape[3] == key_width
                and values.shape == (shape[0], heads, shape[2], value_width)
            ):
                return layer
        index = self._pool.check_layer(layer)
        check_update_arrays(keys, values, self._pool, rows, index)
        return index


def check_update_arrays(keys: object, values: object, pool: CacheConfig, rows: int | None, layer: int = 0) -> None:
    """Refuse keys and values ``[batch, num_heads, new_tokens, width]`` that the pool cannot
    take in ``layer`` (its own geometry: :meth:`~kvcache_core.CacheConfig.layer_geometry`;
    ``rows``: the batch the cache holds, ``None`` before its first forward), naming what is
    wrong: the full checks behind :class:`UpdateCheck`'s quick comparisons.

    Raises:
        InvalidTypeError: not torch tensors.
        ShapeMismatchError: other shapes, or another batch than the cache holds.
        DTypeMismatchError: another dtype than the pool computes in.
    """
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise InvalidTypeError(
            f"keys and values must be torch tensors, got {type(keys).__name__} and {type(values).__name__}"
        )
    shape = pool.layer_geometry(layer)
    if (
        keys.shape[:3] != values.shape[:3]
        or keys.dim() != 4
        or values.dim() != 4
        or (keys.shape[1], keys.shape[3], values.shape[3]) != (shape.num_heads, shape.head_dim, shape.value_width)
    ):
        values_wide = (
            ""
            if shape.value_width == shape.head_dim
            else f" and [batch, {shape.num_heads}, new_tokens, {shape.value_width}]"
        )
        where = f" in layer {layer}" if pool.mixed_geometry else ""
        raise ShapeMismatchError(
            f"keys and values must be [batch, {shape.num_heads}, new_tokens, {shape.head_dim}]{values_wide}{where}, "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if dtype_name(keys.dtype) != pool.io_dtype or values.dtype != keys.dtype:
        raise DTypeMismatchError(
            f"keys and values are {keys.dtype} and {values.dtype}, the pool computes in {pool.io_dtype}: build it with "
            "cache_config_for(model, ...), which takes the model's dtype"
        )
    if rows is not None and keys.shape[0] != rows:
        raise ShapeMismatchError(
            f"the cache holds {rows} rows, the model passed a batch of {keys.shape[0]}; "
            "release() it to start a new batch"
        )


def forward_mode(text: PretrainedConfig, latent: bool, filled: Mode | None) -> Mode:
    """The path of a forward starting now: ``"paged"`` when the config's attention
    implementation is ``"kvcache_paged"``, else ``"contiguous"`` (``latent``: the model has
    latent attention; ``filled``: the path that filled the cache's tokens, ``None`` when it
    holds none).

    Raises:
        UnsupportedConfigError: a switch of path while the cache holds tokens; the paged
            path for a model it cannot serve (latent attention, sliced shared layers).
    """
    implementation = attention_implementation(text)
    mode: Mode = "paged" if implementation == ATTN_IMPLEMENTATION else "contiguous"
    if filled is not None and mode != filled:
        raise UnsupportedConfigError(
            f"the cache was filled with the {filled} path and the model now runs the {mode} path "
            f"(attn_implementation {implementation!r}); release() the cache before switching"
        )
    if mode == "paged":
        if latent:
            refuse_latent_on_paged_path(text)
        refuse_sliced_shared_layers_on_paged_path(text)
    return mode
