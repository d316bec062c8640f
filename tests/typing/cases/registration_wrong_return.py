"""Must be rejected at the registration line: ``gather`` returns a list, not a tuple.

A list unpacks like a tuple, so nothing at run time notices; ``BackendSpec`` is generic in
the array type and its ``storage_factory`` must return a ``KvStorage`` of it, so the type
checkers reject the class where it is registered, naming ``gather``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core import CacheConfig, PageTable
from kvcache_core.backends.numpy import NumpyArray, NumpyStorage
from kvcache_core.contract.protocols import BlockArray, SlotArray
from kvcache_core.plugin import BackendSpec, hookimpl


class ListGatherStorage:
    """Every member right but ``gather``, which returns ``list[NumpyArray]``."""

    def __init__(self, config: CacheConfig) -> None:
        self._inner = NumpyStorage(config)

    @property
    def config(self) -> CacheConfig:
        return self._inner.config

    def key_cache(self, layer: int) -> NumpyArray:
        return self._inner.key_cache(layer)

    def value_cache(self, layer: int) -> NumpyArray:
        return self._inner.value_cache(layer)

    def write(self, layer: int, slots: SlotArray, keys: NumpyArray, values: NumpyArray) -> None:
        self._inner.write(layer, slots, keys, values)

    def gather(self, layer: int, blocks: BlockArray, num_tokens: int) -> list[NumpyArray]:
        return list(self._inner.gather(layer, blocks, num_tokens))

    def copy_blocks(self, source: BlockArray, destination: BlockArray) -> None:
        self._inner.copy_blocks(source, destination)

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


@hookimpl
def kvcache_register_backends() -> Iterator[BackendSpec[NumpyArray]]:
    yield BackendSpec(name="listgather", storage_factory=ListGatherStorage)  # error: gather
