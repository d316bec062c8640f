"""Must be rejected at the registration line: ``write`` takes no ``values``.

Python finds out only when the manager calls it; ``BackendSpec`` is generic in
the array type and its ``storage_factory`` must return a ``KvStorage`` of it, so the type
checkers reject the class where it is registered, naming ``write``.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvcache_core.backends.numpy import NumpyArray
from kvcache_core.contract.protocols import BlockArray, SlotArray
from kvcache_core.plugin import BackendSpec, hookimpl

from .numpy_delegate import DelegatingStorage


class NoValuesStorage(DelegatingStorage):
    """Every member right but ``write``, which lacks the ``values`` parameter."""

    def write(self, layer: int, slots: SlotArray, keys: NumpyArray) -> None:
        self._inner.write(layer, slots, keys, keys)

    def gather(self, layer: int, blocks: BlockArray, num_tokens: int) -> tuple[NumpyArray, NumpyArray]:
        return self._inner.gather(layer, blocks, num_tokens)

    def copy_blocks(self, source: BlockArray, destination: BlockArray) -> None:
        self._inner.copy_blocks(source, destination)


@hookimpl
def kvcache_register_backends() -> Iterator[BackendSpec[NumpyArray]]:
    yield BackendSpec(name="novalues", storage_factory=NoValuesStorage)  # error: write
