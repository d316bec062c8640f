"""The handle every backend hands out: :class:`PagedKvCacheHandle`, a reference to one
request's cache in a :class:`~kvcache_core.manager.PagedKvCacheManager`."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Generic, TypeVar

from kvcache_core.block_table import BlockTable
from kvcache_core.config import CacheConfig
from kvcache_core.device import Device
from kvcache_core.errors import InvalidHandleError
from kvcache_core.protocols import KvStorage
from kvcache_core.stats import CacheHandleStats

__all__ = ["PagedKvCacheHandle", "RequestState"]

ArrayT = TypeVar("ArrayT")


class RequestState(Generic[ArrayT]):
    """What the manager knows of one request; shared by every handle to it.

    Internal plumbing between the manager and its handles: read it, do not change it.
    """

    __slots__ = (
        "cache_id",
        "config",
        "last_access",
        "lock",
        "max_sequence_length",
        "owner",
        "priority",
        "request_id",
        "storage",
        "table",
        "valid",
    )

    def __init__(
        self,
        *,
        request_id: str,
        owner: object,
        storage: KvStorage[ArrayT],
        lock: threading.RLock,
        max_sequence_length: int | None,
        priority: int,
    ) -> None:
        self.request_id = request_id
        self.owner = owner
        self.storage = storage
        self.config: CacheConfig = storage.config
        self.lock = lock
        self.cache_id = uuid.uuid4().hex
        self.table = BlockTable(self.config.block_size)
        self.valid = True
        self.max_sequence_length = max_sequence_length
        self.priority = priority
        self.last_access = time.monotonic()

    def touch(self) -> None:
        """Record an access now."""
        self.last_access = time.monotonic()

    def check_valid(self) -> None:
        """Raise :class:`InvalidHandleError` if the request was deallocated."""
        if not self.valid:
            raise InvalidHandleError(
                f"request {self.request_id!r} (cache {self.cache_id}) was deallocated; "
                "its handles no longer give access to data"
            )

    def pool(self, layer: int, values: bool) -> ArrayT:
        """The layer's key (or value) pool, after checking the handle and the layer."""
        with self.lock:
            self.check_valid()
            index = self.config.check_layer(layer)
            self.touch()
            return self.storage.value_cache(index) if values else self.storage.key_cache(index)


class PagedKvCacheHandle(Generic[ArrayT]):
    """A reference to one request's cache; satisfies :class:`KvCacheHandle` structurally.

    Handles are cheap: :meth:`clone_handle` and ``manager.get_handle`` make new ones that
    share the request's state, so every one of them sees writes, growth and
    deallocation. Two handles are equal when they refer to the same cache.
    """

    __slots__ = ("_state",)

    def __init__(self, state: RequestState[ArrayT]) -> None:
        self._state = state

    @property
    def request_state(self) -> RequestState[ArrayT]:
        """The shared state (manager plumbing)."""
        return self._state

    @property
    def request_id(self) -> str:
        """The request this cache belongs to."""
        return self._state.request_id

    @property
    def priority(self) -> int:
        """The request's priority, from its :class:`~kvcache_core.AllocationRequest`."""
        return self._state.priority

    @property
    def max_sequence_length(self) -> int | None:
        """The most tokens the request may hold, or ``None``."""
        return self._state.max_sequence_length

    def block_table(self) -> BlockTable:
        """A snapshot of the block table; empty once deallocated."""
        with self._state.lock:
            return self._state.table.copy()

    def block_table_mut(self) -> BlockTable:
        """The live block table. The manager extends it; a caller changing it directly
        bypasses the allocator's ownership records."""
        return self._state.table

    def as_any(self) -> object:
        """This object, for downcasting."""
        return self

    def device(self) -> Device:
        """Where the pool lives."""
        return self._state.config.device

    def num_layers(self) -> int:
        """Layers cached."""
        return self._state.config.num_layers

    def num_heads(self) -> int:
        """KV heads per layer."""
        return self._state.config.num_heads

    def head_dim(self) -> int:
        """Features per head."""
        return self._state.config.head_dim

    def key_cache(self, layer: int) -> ArrayT | None:
        """The layer's key pool itself (see :meth:`KvCacheHandle.key_cache`).

        Raises:
            LayerIndexError: ``layer`` outside ``[0, num_layers)``.
            InvalidHandleError: the request was deallocated.
        """
        return self._state.pool(layer, values=False)

    def value_cache(self, layer: int) -> ArrayT | None:
        """The layer's value pool itself. Raises as :meth:`key_cache`."""
        return self._state.pool(layer, values=True)

    def kv_cache(self, layer: int) -> tuple[ArrayT | None, ArrayT | None]:
        """``(key_cache(layer), value_cache(layer))``. Raises as :meth:`key_cache`."""
        with self._state.lock:
            return (self.key_cache(layer), self.value_cache(layer))

    def clone_handle(self) -> PagedKvCacheHandle[ArrayT]:
        """Another reference to the same cache (not a copy of the data)."""
        return PagedKvCacheHandle(self._state)

    def stats(self) -> CacheHandleStats:
        """Figures of this request (zeros once deallocated)."""
        state = self._state
        with state.lock:
            blocks = state.table.num_blocks()
            tokens = state.table.sequence_length
            capacity = blocks * state.config.block_size
            return CacheHandleStats(
                memory_bytes=blocks * state.config.bytes_per_block,
                blocks_allocated=blocks,
                tokens_stored=tokens,
                utilization=tokens / capacity if capacity else 0.0,
                last_access=state.last_access,
            )

    def is_valid(self) -> bool:
        """``False`` once the request is deallocated."""
        return self._state.valid

    def cache_id(self) -> str:
        """Unique id of this cache, shared by its clones."""
        return self._state.cache_id

    def num_tokens(self) -> int:
        """Tokens stored."""
        return self._state.table.sequence_length

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PagedKvCacheHandle):
            return NotImplemented
        return self._state is other._state  # pyright: ignore[reportUnknownMemberType]

    def __hash__(self) -> int:
        return hash(self._state.cache_id)

    def __repr__(self) -> str:
        state = self._state
        status = "valid" if state.valid else "deallocated"
        return (
            f"PagedKvCacheHandle(request_id={state.request_id!r}, tokens={state.table.sequence_length}, "
            f"blocks={state.table.num_blocks()}, {status})"
        )
