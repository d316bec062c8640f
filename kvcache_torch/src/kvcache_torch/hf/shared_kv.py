"""Layers that read another layer's keys and values (Gemma 3n's ``num_kv_shared_layers``).

transformers names each layer's part in ``config.kv_sharing_modes``: ``"reuse"`` layers (the
last ``num_kv_shared_layers``) never call the cache; they attend over the keys and values the
``"store"`` layer of their attention type (its last layer before them) got back from the
cache in the same forward. A pool holds the layers before them only, and a reusing layer
reads its source's K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, cast

from transformers import PretrainedConfig

from kvcache_core import UnsupportedConfigError

__all__ = ["kv_sources", "refuse_sliced_shared_layers_on_paged_path", "stored_layer_count"]

#: Model types that cut a prefill down to its kept logits' positions before their reusing
#: layers (Gemma 4's ``_maybe_slice_kv_shared_inputs``): those layers' queries are then not the
#: forward's new tokens, which the paged kernel attends for.
_SLICED_BEFORE_SHARED_LAYERS: Final = frozenset({"gemma4_text", "gemma4_unified_text"})


def kv_sources(text: PretrainedConfig) -> tuple[int, ...]:
    """Per layer of the decoder config ``text``: the layer whose K/V it attends over (itself,
    or for a reusing layer its source).

    Raises:
        UnsupportedConfigError: shared layers this transformers does not describe
            (``num_kv_shared_layers`` without ``kv_sharing_modes``), or reusing layers that
            are not the last ones.
    """
    layers = int(text.num_hidden_layers)
    shared = getattr(text, "num_kv_shared_layers", 0)
    if not shared:
        return tuple(range(layers))
    modes: object = getattr(text, "kv_sharing_modes", None)
    types: object = getattr(text, "layer_types", None)
    if not isinstance(modes, (list, tuple)) or not isinstance(types, (list, tuple)):
        raise UnsupportedConfigError(
            f"{type(text).__name__} has {shared} layers sharing other layers' K/V, but this transformers names no "
            "kv_sharing_modes: PagedCache serves shared layers as transformers 5 runs them; upgrade transformers"
        )
    modes = cast("Sequence[str | None]", modes)
    types = cast("Sequence[str]", types)
    stored = stored_layer_count(text)
    sources: list[int] = list(range(stored))
    for layer in range(stored, layers):
        same_type = [source for source in range(stored) if types[source] == types[layer]]
        if modes[layer] != "reuse" or not same_type:
            raise UnsupportedConfigError(
                f"layer {layer} of {type(text).__name__} ({modes[layer]!r}, {types[layer]!r}) follows the layers "
                "that share K/V and reads no earlier layer's: PagedCache serves models whose last layers reuse "
                "earlier layers' K/V"
            )
        sources.append(same_type[-1])
    return tuple(sources)


def stored_layer_count(text: PretrainedConfig) -> int:
    """The layers whose K/V the pool keeps: all but the last ``num_kv_shared_layers``."""
    layers = int(text.num_hidden_layers)
    shared = getattr(text, "num_kv_shared_layers", 0)
    return layers - int(shared) if isinstance(shared, int) and 0 < shared < layers else layers


def refuse_sliced_shared_layers_on_paged_path(text: PretrainedConfig) -> None:
    """Refuse ``"kvcache_paged"`` for a model that slices a prefill to its kept logits before
    its reusing layers (Gemma 4 with ``num_kv_shared_layers``), by name.

    Raises:
        UnsupportedConfigError: naming the model and the remedy (its ``"sdpa"`` or ``"eager"``
            attention: the contiguous path serves it).
    """
    if str(getattr(text, "model_type", "")) not in _SLICED_BEFORE_SHARED_LAYERS or stored_layer_count(text) == int(
        text.num_hidden_layers
    ):
        return
    raise UnsupportedConfigError(
        f"{type(text).__name__.removesuffix('Config')} runs its {getattr(text, 'num_kv_shared_layers', 0)} layers "
        "reusing K/V on the last positions of a prefill only (it slices their queries and 4-D masks), which "
        "'kvcache_paged' cannot attend for; load it with attn_implementation='sdpa' (or 'eager'): PagedCache "
        "serves it on the contiguous path"
    )
