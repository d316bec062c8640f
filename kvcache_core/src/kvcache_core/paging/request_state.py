"""What the manager knows of one request (:class:`RequestState`, shared by every handle to it),
its host copy while swapped out (:class:`SwapRecord`) and ownership generations."""

from __future__ import annotations

import itertools
import time
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.protocols import KvStorage
from kvcache_core.errors import InvalidHandleError, ManagerClosedError, SwappedOutError
from kvcache_core.paging.prefix import PrefixEntry

__all__ = ["RequestState", "SwapRecord", "next_generation"]

ArrayT = TypeVar("ArrayT")

_GENERATIONS = itertools.count(1)


def next_generation() -> int:
    """A new ownership generation, unique in this process (so a page table of one manager
    never matches a request of another)."""
    return next(_GENERATIONS)


@dataclass(frozen=True, eq=False)
class SwapRecord:
    """A swapped-out request's blocks in host memory, and what restores its table.

    Attributes:
        keys, values: ``[pool_layers, n, block_size, num_heads, head_dim]`` host copies
            of the ``n`` blocks that held its tokens, group after group, each in logical
            order (a pool of mixed geometry: the packed ``[n, elements]``,
            ``CacheConfig.packed_block_elements``).
        sequence_length: the request's length.
        first_logical: leading blocks a sliding window had released (first group).
        written: ``[pool_layers, n * block_size]`` which slots had been written (kept only
            with prefix caching, which caches only written blocks), or ``None``.
        released_blocks: the pool blocks it gave up, to name it when a stale slot is used.
        first_logicals, group_blocks: per KV-cache group, its released leading blocks and
            how many of the ``n`` blocks are its (``()``: one group, all of them).
    """

    keys: npt.NDArray[Any]
    values: npt.NDArray[Any]
    sequence_length: int
    first_logical: int
    written: npt.NDArray[np.bool_] | None
    released_blocks: tuple[int, ...]
    first_logicals: tuple[int, ...] = ()
    group_blocks: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Blocks held in host memory."""
        # [layers, n, block_size, heads, width], or the packed [n, elements] of mixed geometry
        return int(self.keys.shape[1] if self.keys.ndim == 5 else self.keys.shape[0])

    @property
    def memory_bytes(self) -> int:
        """Host bytes of the copies."""
        return int(self.keys.nbytes + self.values.nbytes)


class RequestState(Generic[ArrayT]):
    """What the manager knows of one request; shared by every handle to it.

    Internal plumbing between the manager and its handles: read it, do not change it.
    """

    __slots__ = (
        "awaiting_block",
        "cache_id",
        "cached_tokens",
        "chain",
        "chain_open",
        "config",
        "generation",
        "last_access",
        "lock",
        "max_sequence_length",
        "owner",
        "plan",
        "priority",
        "request_id",
        "salt",
        "state_host",
        "state_slot",
        "storage",
        "swap",
        "tables",
        "token_ids",
        "valid",
    )

    def __init__(
        self,
        *,
        request_id: str,
        owner: object,
        storage: KvStorage[ArrayT],
        lock: AbstractContextManager[object],
        max_sequence_length: int | None,
        priority: int,
        config: CacheConfig | None = None,
    ) -> None:
        self.request_id = request_id
        self.owner = owner
        self.storage = storage
        # The manager's config: with KV-cache groups it names every model layer, while the
        # storage's holds one group's layers.
        self.config: CacheConfig = storage.config if config is None else config
        self.lock = lock
        self.cache_id = uuid.uuid4().hex
        # One block table per KV-cache group (see kvcache_core.contract.groups); all of one length.
        self.tables = [BlockTable(self.config.block_size) for _ in range(self.config.num_groups)]
        self.valid = True
        self.max_sequence_length = max_sequence_length
        self.priority = priority
        self.last_access = time.monotonic()
        # Prefix caching: the token ids known so far (positions 0 .. len - 1), the salt, the
        # cache entries of the logical blocks hashed so far, whether the chain may still
        # grow, and the block whose writes it waits for.
        self.token_ids: list[int] = []
        self.salt: bytes | None = None
        self.chain: list[PrefixEntry] = []
        self.chain_open = True
        self.awaiting_block: int | None = None
        self.cached_tokens = 0  # tokens mapped from the prefix cache at allocation
        self.swap: SwapRecord | None = None  # set while swapped out
        # Recurrent-state layers: the request's slot in the state pool (-1: none, or swapped
        # out) and, while swapped out, its states' host copies.
        self.state_slot = -1
        self.state_host: tuple[npt.NDArray[Any], ...] | None = None
        # Changes whenever a block the request held stops being its own (release, swap,
        # copy-on-write, window release): page tables taken before are refused.
        self.generation = next_generation()
        # Counts changes of length and sharing (extend, truncate, fork): a step planned
        # before one is refused.
        self.plan = 0

    @property
    def table(self) -> BlockTable:
        """The block table of the first KV-cache group (the only one without groups)."""
        return self.tables[0]

    def empty_tables(self) -> list[BlockTable]:
        """One empty table per group."""
        return [BlockTable(self.config.block_size) for _ in self.tables]

    def touch(self) -> None:
        """Record an access now."""
        self.last_access = time.monotonic()

    def check_valid(self) -> None:
        """Raise :class:`InvalidHandleError` if the request was deallocated
        (:class:`ManagerClosedError` if its manager was closed)."""
        if not self.valid:
            if getattr(self.owner, "closed", False):
                raise ManagerClosedError(
                    f"request {self.request_id!r} (cache {self.cache_id}) belongs to a closed manager: "
                    "its pool was released"
                )
            raise InvalidHandleError(
                f"request {self.request_id!r} (cache {self.cache_id}) was deallocated; "
                "its handles no longer give access to data"
            )

    def check_open(self) -> None:
        """Raise :class:`ManagerClosedError` if the request's manager was closed."""
        if not self.valid and getattr(self.owner, "closed", False):
            self.check_valid()

    def check_resident(self) -> None:
        """Raise :class:`InvalidHandleError` if the request was deallocated, and
        :class:`SwappedOutError` if it is swapped out."""
        self.check_valid()
        if self.swap is not None:
            raise SwappedOutError(
                f"request {self.request_id!r} is swapped out ({self.swap.sequence_length} tokens in host "
                "memory): call swap_in before reading, writing or extending it"
            )

    def pool(self, layer: int, values: bool) -> ArrayT | None:
        """The layer's key (or value) pool, after checking the handle and the layer; ``None``
        when a sliding window has released every block the request held."""
        with self.lock:
            self.check_valid()
            group, index = self.config.layer_place(layer)
            self.check_resident()
            self.touch()
            table = self.tables[group]
            if not table.num_blocks() and table.first_logical:
                return None
            return self.storage.value_cache(index) if values else self.storage.key_cache(index)
