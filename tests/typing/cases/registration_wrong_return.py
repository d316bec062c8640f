"""Must be rejected at the registration line: ``gather`` returns a list, not a tuple.

A list unpacks like a tuple, so nothing at run time notices; ``BackendSpec`` is generic in
the array type and its ``storage_factory`` must return a ``KvStorage`` of it, so the type
checkers reject the class where it is registered, naming ``gather``.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvcache_core.backends.numpy import NumpyArray
from kvcache_core.contract.protocols import BlockArray, SlotArray
from kvcache_core.plugin import BackendSpec, hookimpl

from .numpy_delegate import DelegatingStorage


class ListGatherStorage(DelegatingStorage):
    """Every member right but ``gather``, which returns ``list[NumpyArray]``."""

    def write(self, layer: int, slots: SlotArray, keys: NumpyArray, values: NumpyArray) -> None:
        self._inner.write(layer, slots, keys, values)

    def gather(self, layer: int, blocks: BlockArray, num_tokens: int) -> list[NumpyArray]:
        return list(self._inner.gather(layer, blocks, num_tokens))

    def copy_blocks(self, source: BlockArray, destination: BlockArray) -> None:
        self._inner.copy_blocks(source, destination)


@hookimpl
def kvcache_register_backends() -> Iterator[BackendSpec[NumpyArray]]:
    yield BackendSpec(name="listgather", storage_factory=ListGatherStorage)  # error: gather
