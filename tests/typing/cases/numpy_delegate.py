"""Support for the typing cases: the ``KvStorage`` members every case gets right, forwarded
to a ``NumpyStorage``. A case subclasses :class:`DelegatingStorage` and writes ``write``,
``gather`` and ``copy_blocks`` itself (one of them wrong, or missing)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core import CacheConfig, PageTable
from kvcache_core.backends.numpy import NumpyArray, NumpyStorage
from kvcache_core.contract.protocols import BlockArray


class DelegatingStorage:
    """Every ``KvStorage`` member but ``write``, ``gather`` and ``copy_blocks``, forwarded to
    ``self._inner``."""

    def __init__(self, config: CacheConfig) -> None:
        self._inner = NumpyStorage(config)

    @property
    def config(self) -> CacheConfig:
        return self._inner.config

    def key_cache(self, layer: int) -> NumpyArray:
        return self._inner.key_cache(layer)

    def value_cache(self, layer: int) -> NumpyArray:
        return self._inner.value_cache(layer)

    def blocks_to_host(self, blocks: BlockArray) -> tuple[NumpyArray, NumpyArray]:
        return self._inner.blocks_to_host(blocks)

    def blocks_from_host(self, blocks: BlockArray, keys: NumpyArray, values: NumpyArray) -> None:
        self._inner.blocks_from_host(blocks, keys, values)

    def paged_attention(
        self,
        layer: int,
        query: NumpyArray,
        page_table: PageTable,
        qo_indptr: npt.NDArray[np.int32],
        scale: float,
        causal: bool,
    ) -> NumpyArray:
        return self._inner.paged_attention(layer, query, page_table, qo_indptr, scale, causal)

    def array_info(self, array: object) -> tuple[tuple[int, ...], str]:
        return self._inner.array_info(array)

    def from_numpy(self, array: NumpyArray) -> NumpyArray:
        return array

    def to_numpy(self, array: NumpyArray) -> NumpyArray:
        return array

    def array_namespace(self) -> Any:
        return np
