"""The handle every backend hands out: :class:`PagedKvCacheHandle`, a reference to one
request's cache in a :class:`~kvcache_core.manager.PagedKvCacheManager`."""

from __future__ import annotations

import warnings
from typing import Any, Generic, TypeGuard, TypeVar

from kvcache_core import _moved
from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.device import Device
from kvcache_core.contract.stats import CacheHandleStats
from kvcache_core.errors import ForeignHandleError
from kvcache_core.paging.request_state import RequestState

__all__ = ["PagedKvCacheHandle", "handle_state", "resident_state"]

ArrayT = TypeVar("ArrayT")


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
        """Deprecated: the shared state (manager plumbing); internal, will be removed in
        0.4.0 (tests read it with :func:`kvcache_core.testing.inspect.request_state`)."""
        warnings.warn(
            "PagedKvCacheHandle.request_state is internal and will be removed in 0.4.0 "
            "(tests: kvcache_core.testing.inspect.request_state(handle))",
            DeprecationWarning,
            stacklevel=2,
        )
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
        """A snapshot of the block table (of the first KV-cache group: see
        :meth:`block_tables`); empty once deallocated.

        Raises:
            ManagerClosedError: the request's manager is closed.
        """
        with self._state.lock:
            self._state.check_open()
            return self._state.table.copy()

    def block_tables(self) -> list[BlockTable]:
        """Snapshots of the block table of every KV-cache group (one without groups), in
        group order (``CacheConfig.kv_groups``).

        Raises:
            ManagerClosedError: the request's manager is closed.
        """
        with self._state.lock:
            self._state.check_open()
            return [table.copy() for table in self._state.tables]

    def block_table_mut(self) -> BlockTable:
        """Deprecated outside the manager: the live block table, which the manager owns (a
        caller changing it bypasses the allocator's ownership records). The member stays, as
        one of the seed trait's fifteen; from 0.4.0 this handle stops handing the live table
        out. Read :meth:`block_table`, a snapshot.

        Raises:
            ManagerClosedError: the request's manager is closed.
        """
        warnings.warn(
            "PagedKvCacheHandle.block_table_mut() hands out the table the manager owns; from 0.4.0 "
            "it stops doing so: use block_table() (a snapshot)",
            DeprecationWarning,
            stacklevel=2,
        )
        self._state.check_open()
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
        """Features per head of the keys (and of queries)."""
        return self._state.config.head_dim

    def value_head_dim(self) -> int:
        """Features per head of the values (and of attention's output): ``head_dim()``
        unless the pool's ``CacheConfig.value_head_dim`` differs."""
        return self._state.config.value_width

    def key_cache(self, layer: int) -> ArrayT | None:
        """The layer's key pool itself (see :meth:`KvCacheHandle.key_cache`); ``None`` when
        the request holds no block because its sliding window released them all.

        Raises:
            LayerIndexError: ``layer`` outside ``[0, num_layers)``.
            InvalidHandleError: the request was deallocated.
            SwappedOutError: the request is swapped out.
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
        """Another reference to the same cache (not a copy of the data).

        Raises:
            ManagerClosedError: the request's manager is closed.
        """
        self._state.check_open()
        return PagedKvCacheHandle(self._state)

    def stats(self) -> CacheHandleStats:
        """Figures of this request in the pool (zeros once deallocated or while swapped out);
        ``memory_bytes`` counts its recurrent states too."""
        state = self._state
        with state.lock:
            blocks = sum(table.num_blocks() for table in state.tables)
            tokens = sum(table.held_tokens() for table in state.tables)
            capacity = blocks * state.config.block_size
            states = state.config.states.bytes_per_slot if state.state_slot >= 0 else 0
            return CacheHandleStats(
                memory_bytes=blocks * state.config.bytes_per_block + states,
                blocks_allocated=blocks,
                tokens_stored=tokens,
                utilization=tokens / capacity if capacity else 0.0,
                last_access=state.last_access,
            )

    def is_valid(self) -> bool:
        """``False`` once the request is deallocated (a swapped-out request stays valid)."""
        return self._state.valid

    def is_swapped_out(self) -> bool:
        """Whether the request's blocks are in host memory (see ``manager.swap_in``)."""
        return self._state.swap is not None

    def num_cached_tokens(self) -> int:
        """Tokens the prefix cache supplied when the request was allocated: already
        computed, so ``num_tokens()`` started there and ``extend`` went on from it."""
        return self._state.cached_tokens

    def token_ids(self) -> tuple[int, ...]:
        """The token ids known for positions ``0 ..`` (the prompt given to ``allocate``, then
        ``extend``'s ``token_ids``), as far as they were given; recorded with prefix caching.

        Raises:
            ManagerClosedError: the request's manager is closed.
        """
        with self._state.lock:
            self._state.check_open()
            return tuple(self._state.token_ids)

    def cache_id(self) -> str:
        """Unique id of this cache, shared by its clones."""
        return self._state.cache_id

    def num_tokens(self) -> int:
        """Tokens stored: ``block_table().sequence_length`` (0 while swapped out)."""
        return self._state.table.sequence_length

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PagedKvCacheHandle):
            return NotImplemented
        return self._state is other._state  # pyright: ignore[reportUnknownMemberType]

    def __hash__(self) -> int:
        return hash(self._state.cache_id)

    def __repr__(self) -> str:
        state = self._state
        status = "deallocated" if not state.valid else "swapped out" if state.swap is not None else "valid"
        return (
            f"PagedKvCacheHandle(request_id={state.request_id!r}, tokens={state.table.sequence_length}, "
            f"blocks={state.table.num_blocks()}, {status})"
        )


def handle_state(handle: PagedKvCacheHandle[Any]) -> RequestState[Any]:
    """The request state behind ``handle`` (manager plumbing)."""
    return handle._state  # pyright: ignore[reportPrivateUsage]


def resident_state(handle: object, owner: object) -> RequestState[Any]:
    """The state of ``handle``'s request, checked to belong to ``owner`` and be resident.

    Raises:
        ForeignHandleError: not a handle of ``owner``'s.
        InvalidHandleError, SwappedOutError: the request was deallocated, or is swapped out.
    """
    if handle.__class__ is PagedKvCacheHandle:  # the common case, on every call: as_any() is itself
        concrete: object = handle
    else:
        as_any = getattr(handle, "as_any", None)  # downcast, as the seed crate does
        concrete = as_any() if callable(as_any) else None
    if not _is_paged_handle(concrete):
        raise ForeignHandleError(f"expected a handle from this manager, got {type(handle).__name__}")
    state = concrete._state  # pyright: ignore[reportPrivateUsage]
    if state.owner is not owner:
        raise ForeignHandleError(f"the handle of request {state.request_id!r} belongs to another manager")
    state.check_resident()
    return state


def _is_paged_handle(value: object) -> TypeGuard[PagedKvCacheHandle[Any]]:
    return isinstance(value, PagedKvCacheHandle)


def __getattr__(name: str) -> object:
    """Names that moved to :mod:`kvcache_core.paging.request_state`, with a DeprecationWarning."""
    return _moved.moved_attribute(__name__, name)
