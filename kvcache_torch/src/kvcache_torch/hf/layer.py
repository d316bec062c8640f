""":class:`PagedCacheLayer`, the per-layer face of :class:`~kvcache_torch.hf.PagedCache` in
``Cache.layers``."""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcache_core import InvalidArgumentError, UnsupportedConfigError

__all__ = ["LayeredCache", "PagedCacheLayer"]


class LayeredCache(Protocol):
    """What a :class:`PagedCacheLayer` forwards to: the cache that owns every layer."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


class PagedCacheLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers leaves __init_subclass__ untyped
    """The per-layer face transformers expects in ``Cache.layers``.

    It holds no tensors (``keys``/``values`` stay ``None``): the K/V live in the pool, and
    every call forwards to the owning :class:`PagedCache`.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: LayeredCache, layer_idx: int, sliding_window: int | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in transformers
        self._cache = weakref.ref(cache)  # no cycle: the cache is freed (and released) promptly
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.is_initialized = True  # nothing to initialise lazily: the pool exists

    def _owner(self) -> LayeredCache:
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
