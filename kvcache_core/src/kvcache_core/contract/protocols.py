"""The contract: :class:`KvCacheHandle`, :class:`KvCacheManager` and the backend's :class:`KvStorage`.

All three are structural: an implementation satisfies them by having the members, with
no inheritance. ``KvCacheHandle`` mirrors the ``KvCacheHandle`` trait of the Rust crate
``ferrum-interfaces`` member for member; ``T`` is the backend's native array type
(``numpy.ndarray``, ``torch.Tensor``, ``jax.Array``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.device import Device
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.stats import CacheGcStats, CacheHandleStats, CacheManagerStats, MemoryPressure

__all__ = ["BlockArray", "KvCacheHandle", "KvCacheManager", "KvStorage", "SlotArray", "SlotsLike"]

ArrayT = TypeVar("ArrayT")
ArrayT_co = TypeVar("ArrayT_co", covariant=True)

#: Slots as the manager hands them out: ``[n]`` int64, ``block_id * block_size + offset``.
SlotArray = npt.NDArray[np.int64]
#: Physical block ids, as the manager passes them to the storage: ``[n]`` int64, each in
#: ``[0, num_blocks)``.
BlockArray = npt.NDArray[np.int64]
#: What ``write`` accepts as slots: an integer NumPy array or a sequence of ints.
SlotsLike = npt.NDArray[np.integer[Any]] | Sequence[int]


@runtime_checkable
class KvCacheHandle(Protocol[ArrayT_co]):
    """One request's view of the paged cache: its block table and the pool's arrays.

    A handle is a reference: :meth:`clone_handle` returns another reference to the same
    cache, and after the manager deallocates the request every reference reports
    ``is_valid() == False`` and refuses data access with
    :class:`~kvcache_core.errors.InvalidHandleError`.
    """

    def block_table(self) -> BlockTable:
        """A snapshot of the request's block table (changing it changes nothing)."""
        ...

    def block_table_mut(self) -> BlockTable:
        """The live block table, for the manager to extend; others should not change it
        (:class:`~kvcache_core.PagedKvCacheHandle` warns: from 0.4.0 it keeps the live table to
        its manager)."""
        ...

    def as_any(self) -> object:
        """The concrete handle object, for downcasting to the backend's own type."""
        ...

    def device(self) -> Device:
        """Where the blocks live."""
        ...

    def num_layers(self) -> int:
        """Layers cached."""
        ...

    def num_heads(self) -> int:
        """KV heads per layer (query heads may be a multiple of it)."""
        ...

    def head_dim(self) -> int:
        """Features per head of the keys (a pool's values may differ: the concrete
        handle's ``value_head_dim()``)."""
        ...

    def key_cache(self, layer: int) -> ArrayT_co | None:
        """A reference (never a copy) to the layer's paged key pool.

        Shape ``[num_blocks, block_size, num_heads, head_dim]`` in the default ``"NHD"``
        layout (the configured ``kv_layout`` otherwise). With a mutable array library it
        is a view later writes show through; with an immutable one (JAX) it is the current
        pool array, which later writes replace but never delete. ``None`` when the layer
        keeps no cache.

        Raises:
            LayerIndexError: ``layer`` outside ``[0, num_layers)``.
            InvalidHandleError: the request was deallocated.
        """
        ...

    def value_cache(self, layer: int) -> ArrayT_co | None:
        """As :meth:`key_cache`, for values."""
        ...

    def kv_cache(self, layer: int) -> tuple[ArrayT_co | None, ArrayT_co | None]:
        """``(key_cache(layer), value_cache(layer))``."""
        return (self.key_cache(layer), self.value_cache(layer))

    def clone_handle(self) -> KvCacheHandle[ArrayT_co]:
        """A new reference to the same cache, not a copy of it."""
        ...

    def stats(self) -> CacheHandleStats:
        """Memory, blocks, tokens, utilization and last access of this request."""
        ...

    def is_valid(self) -> bool:
        """``False`` once the request is deallocated, for every reference to it."""
        ...

    def cache_id(self) -> str:
        """Unique id of this cache instance (shared by its clones)."""
        ...

    def num_tokens(self) -> int:
        """Tokens stored: ``block_table().sequence_length``."""
        return self.block_table().sequence_length


class KvCacheManager(Protocol[ArrayT]):
    """Allocates and tracks request caches in one pool, runs the data path and the cache
    policies.

    The seed crate's manager, made synchronous, plus the write/read path:
    ``allocate -> extend -> write -> paged_attention``, and the policies of a serving
    engine: prefix caching (through ``allocate``), ``fork`` with copy-on-write,
    eviction, ``swap_out``/``swap_in`` and the sliding window. Every method is atomic:
    when it raises, every table and count is as it was.
    """

    def allocate(self, request: AllocationRequest) -> KvCacheHandle[ArrayT]:
        """Create the cache of a new request and reserve blocks for ``initial_tokens``;
        with prefix caching, map the cached full blocks of its prompt and start the
        sequence after them.

        Raises:
            DuplicateRequestError: the id is live already.
            OutOfBlocksError: not enough free (or evictable cached) blocks.
        """
        ...

    def extend(
        self, handle: KvCacheHandle[ArrayT], additional_tokens: int, *, token_ids: Sequence[int] | None = None
    ) -> SlotArray:
        """Grow the request by ``additional_tokens`` and return their slots (``[n]`` int64),
        each in a block the request alone holds (shared blocks are copied first).
        ``token_ids`` are the new tokens' ids, for prefix caching.

        Raises:
            OutOfBlocksError: not enough free blocks; SequenceTooLongError: past
            ``max_sequence_length``; InvalidHandleError: deallocated request;
            SwappedOutError: swapped-out request.
        """
        ...

    def writable_slots(self, handle: KvCacheHandle[ArrayT], start: int, stop: int) -> SlotArray:
        """Slots of positions ``start .. stop - 1`` of the request, in blocks it alone
        holds (shared blocks among them are copied first), for rewriting tokens."""
        ...

    def fork(self, handle: KvCacheHandle[ArrayT], new_request_id: str) -> KvCacheHandle[ArrayT]:
        """A new request sharing every block holding the request's tokens (copy-on-write).

        Raises:
            DuplicateRequestError: ``new_request_id`` is live already;
            InvalidHandleError / SwappedOutError: the parent is deallocated / swapped out.
        """
        ...

    def swap_out(self, request_id: str) -> None:
        """Copy the request's blocks to host memory and release them to the pool.

        Raises:
            UnknownRequestError; SwappedOutError: already swapped out.
        """
        ...

    def swap_in(self, request_id: str) -> None:
        """Bring a swapped-out request's blocks back, bit-identical.

        Raises:
            UnknownRequestError; NotSwappedOutError: the request is resident;
            OutOfBlocksError: its blocks do not fit (nothing changed).
        """
        ...

    def deallocate(self, request_id: str) -> None:
        """Release the request's blocks; every reference to its handle becomes invalid.

        Raises:
            UnknownRequestError: no live request has this id.
        """
        ...

    def can_allocate(self, request: AllocationRequest) -> bool:
        """Whether ``allocate(request)`` would succeed now."""
        ...

    def stats(self) -> CacheManagerStats:
        """Figures of the whole pool."""
        ...

    def gc(self) -> CacheGcStats:
        """Reclaim what is reclaimable (evict cached blocks) and say how much."""
        ...

    def set_pressure_callback(self, callback: Callable[[MemoryPressure], object] | None) -> None:
        """Call ``callback(level)`` on each change of :class:`MemoryPressure` level."""
        ...

    def get_handle(self, request_id: str) -> KvCacheHandle[ArrayT] | None:
        """A handle of a live request, or ``None``."""
        ...

    def list_handles(self) -> Sequence[tuple[str, KvCacheHandle[ArrayT]]]:
        """``(request_id, handle)`` of every live request."""
        ...

    def write(self, layer: int, slots: SlotsLike, keys: ArrayT, values: ArrayT) -> None:
        """Scatter ``keys``/``values`` ``[n, num_heads, head_dim]`` into ``slots`` ``[n]``."""
        ...

    def gather(self, handle: KvCacheHandle[ArrayT], layer: int) -> tuple[ArrayT, ArrayT]:
        """The request's K/V as contiguous ``[num_tokens, num_heads, head_dim]`` copies."""
        ...

    def page_table(self, handles: Sequence[KvCacheHandle[ArrayT]]) -> PageTable:
        """The batch's page table, in the order of ``handles``."""
        ...

    def paged_attention(
        self,
        layer: int,
        query: ArrayT,
        page_table: PageTable,
        *,
        qo_indptr: npt.ArrayLike | None = None,
        scale: float | None = None,
        causal: bool = True,
        window: int | None = None,
        softcap: float | None = None,
        sinks: ArrayT | None = None,
        chunk: int | None = None,
    ) -> ArrayT:
        """Attention of packed queries ``[total_q, num_query_heads, head_dim]`` over the
        batch's cached K/V, read from the pool in place; ``window``, ``softcap``,
        ``sinks`` and ``chunk`` are the attention features of
        :mod:`kvcache_core.attention.features`."""
        ...


class KvStorage(Protocol[ArrayT]):
    """What a backend implements: the pool's memory and the kernels that move its bytes.

    The manager, tables and policies come from core and call these methods with
    arguments already validated (slots in range, shapes and dtypes right).

    Optional member: ``close() -> None``, which releases what the pool holds (shared
    memory, a file, device memory). :meth:`PagedKvCacheManager.close` (and leaving its
    ``with`` block) calls it exactly once, after which the manager calls the storage no
    more; a storage without ``close`` is left to the garbage collector. It is not a
    Protocol member, so a storage without it still conforms.

    Optional member: ``memory_regions() -> tuple[MemoryRegion, ...]``
    (:class:`~kvcache_core.contract.regions.RegionStorage`), the pool's memory per layer and
    part, for a transport that reads blocks in place; a storage that has it claims the
    capability ``"memory_regions"``, and one that does not is refused by name where a
    transport needs it.

    Registering the storage through :class:`~kvcache_core.BackendSpec` makes mypy and
    pyright check it against this Protocol; to check a class on its own, assign it::

        def _conforms(storage: MyStorage) -> KvStorage[MyArray]:
            return storage
    """

    @property
    def config(self) -> CacheConfig:
        """The configuration the pool was built for."""
        ...

    def key_cache(self, layer: int) -> ArrayT:
        """The layer's key pool itself (see :meth:`KvCacheHandle.key_cache`)."""
        ...

    def value_cache(self, layer: int) -> ArrayT:
        """The layer's value pool itself, shape ``config.value_block_shape()`` (its last axis
        ``config.value_width``, which differs from the keys' only for a storage claiming the
        ``"value_head_dim"`` capability)."""
        ...

    def write(self, layer: int, slots: SlotArray, keys: ArrayT, values: ArrayT) -> None:
        """Scatter ``[n, num_heads, head_dim]`` keys and ``[n, num_heads, value_width]``
        values into distinct ``slots``."""
        ...

    def gather(self, layer: int, blocks: BlockArray, num_tokens: int) -> tuple[ArrayT, ArrayT]:
        """The first ``num_tokens`` tokens stored in ``blocks`` (in order), as contiguous
        ``[num_tokens, num_heads, head_dim]`` keys and ``[num_tokens, num_heads, value_width]``
        values."""
        ...

    def copy_blocks(self, source: BlockArray, destination: BlockArray) -> None:
        """Copy every layer's K and V of block ``source[i]`` into ``destination[i]``."""
        ...

    def blocks_to_host(self, blocks: BlockArray) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Host copies of ``blocks``: keys and values ``[num_layers, n, block_size, num_heads,
        width]`` (always this order, whatever the pool layout), in the host form of the
        pool's dtype, the same on every backend (:mod:`kvcache_core.offload.host_form`): float32,
        float16 and float64 as themselves; bfloat16 as ``uint16``, each element's bit
        pattern; int8 and float8_e4m3fn as ``uint8`` with ``width = head_dim + 4``, each
        token head's raw bytes then its float32 scale (:mod:`kvcache_core.contract.quantization`).
        ``width`` is ``head_dim`` otherwise; for values, ``value_width`` takes the place of
        ``head_dim`` (:func:`kvcache_core.offload.host_form.host_width`)."""
        ...

    def blocks_from_host(self, blocks: BlockArray, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> None:
        """Write host copies in host form (made by :meth:`blocks_to_host` of this backend or
        any other) into ``blocks``, bit for bit.

        Raises:
            ArrayTypeError, DTypeMismatchError, ShapeMismatchError: ``keys`` or ``values`` is not
                the host form of ``len(blocks)`` blocks
                (:func:`kvcache_core.offload.host_form.check_host_array`); nothing is cast or written.
        """
        ...

    def paged_attention(
        self,
        layer: int,
        query: ArrayT,
        page_table: PageTable,
        qo_indptr: npt.NDArray[np.int32],
        scale: float,
        causal: bool,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: ArrayT | None = None,
        chunk: int | None = None,
    ) -> ArrayT:
        """Attention over the pool (arguments validated by the manager): ``query [total_q,
        num_query_heads, head_dim]``, returns ``[total_q, num_query_heads, value_width]``.

        The keyword arguments are the attention features
        (:mod:`kvcache_core.attention.features`); the manager passes one only if the
        storage lists its capability in its optional ``attention_features`` member (a
        frozenset; none when absent), so a storage serving none is never called with
        them. ``window`` is the layer's, to be combined with ``page_table.sliding_window``
        (the smaller applies)."""
        ...

    def array_info(self, array: object) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype name)`` of a native array.

        Raises:
            TypeError: ``array`` is not of the backend's native array type.
        """
        ...

    def from_numpy(self, array: npt.NDArray[Any]) -> ArrayT:
        """A native array on the pool's device with the same values."""
        ...

    def to_numpy(self, array: ArrayT) -> npt.NDArray[Any]:
        """A host NumPy array with the same values."""
        ...

    def array_namespace(self) -> Any:
        """The Array API namespace of the native arrays (``numpy`` for NumPy)."""
        ...
