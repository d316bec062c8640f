"""Prefix-chain tracking: which blocks of each request are hashed, and which it waits for.

A request's hash chain lists the prefix-cache entries of its first full blocks. A block
joins the chain (and is registered, findable by later requests) once it is full, the
token ids of all its positions are known, every slot was written in every layer (of every
KV-cache group still holding it) and the block before it is hashed. :class:`PrefixChains` advances chains as writes land, cuts
them when blocks are rewritten, truncated or released, and rebuilds them after a swap-in.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.errors import InvalidArgumentError
from kvcache_core.paging.block_pool import BlockPool, blocks_for
from kvcache_core.paging.prefix import PrefixEntry
from kvcache_core.paging.request_state import RequestState

__all__ = ["PrefixChains"]


class PrefixChains:
    """The hash chains of a manager's requests (manager internals).

    Attributes:
        awaiting: block -> the requests whose chain waits for its writes.
        awaiting_mask: ``[blocks]`` the keys of ``awaiting``, for one vectorised test per write.
        queries, hits, collisions: prefix-cache lookups, hits and hash collisions so far.
    """

    def __init__(self, pool: BlockPool, requests: dict[str, RequestState[Any]]) -> None:
        self.pool = pool
        self.requests = requests
        self.block_size = pool.config.block_size
        self.awaiting: dict[int, set[str]] = {}
        self.awaiting_mask = np.zeros(pool.config.num_blocks, dtype=np.bool_)
        self.queries = 0
        self.hits = 0
        self.collisions = 0

    @property
    def enabled(self) -> bool:
        return self.pool.prefix is not None

    def new_token_ids(self, state: RequestState[Any], ids: tuple[int, ...], start: int) -> tuple[int, ...]:
        """The ids of ``ids`` (for positions ``start ..``) not known yet, after checking
        that the known ones agree and that no earlier id is missing."""
        if not self.enabled:
            return ()
        known = state.token_ids
        if start > len(known):
            raise InvalidArgumentError(
                f"token_ids for positions {start}.. of request {state.request_id!r} cannot be used: the ids of "
                f"positions {len(known)} to {start - 1} were never given (pass token_ids to every extend)"
            )
        overlap = min(len(known) - start, len(ids))
        for offset in range(overlap):
            if ids[offset] != known[start + offset]:
                raise InvalidArgumentError(
                    f"token_ids[{offset}] = {ids[offset]} disagrees with the known token {known[start + offset]} "
                    f"at position {start + offset} of request {state.request_id!r}"
                )
        return ids[overlap:]

    def set_awaiting(self, state: RequestState[Any], block: int | None) -> None:
        old = state.awaiting_block
        if old == block:
            return
        if old is not None:
            waiting = self.awaiting[old]
            waiting.discard(state.request_id)
            if not waiting:
                del self.awaiting[old]
                self.awaiting_mask[old] = False
        if block is not None:
            self.awaiting.setdefault(block, set()).add(state.request_id)
            self.awaiting_mask[block] = True
        state.awaiting_block = block

    def after_write(self, blocks: npt.NDArray[np.int64]) -> None:
        """Advance the hash chains waiting for any of ``blocks`` now fully written."""
        if not self.awaiting:
            return
        touched = blocks[self.awaiting_mask[blocks]]
        if not touched.size:
            return
        for block in np.unique(touched).tolist():
            if not self.pool.fully_written(block):
                continue
            for request_id in sorted(self.awaiting.get(block, ())):
                state = self.requests[request_id]
                self.set_awaiting(state, None)
                self.advance(state)

    def advance(self, state: RequestState[Any]) -> None:
        """Hash (and register) the request's next blocks while they are cacheable; wait
        for the first full block whose writes are missing."""
        prefix = self.pool.prefix
        if prefix is None or not state.chain_open or state.swap is not None:
            return
        length = state.table.sequence_length
        block_size = self.block_size
        while True:
            logical = len(state.chain)
            end = (logical + 1) * block_size
            if end > length or end > len(state.token_ids):
                break  # not full yet, or its token ids are not known yet
            # The block of every KV-cache group that still holds it (a sliding group may
            # have released it); with none left, it was released before it was hashed.
            held = [table.physical_block(logical) for table in state.tables if logical >= table.first_logical]
            if not held:
                state.chain_open = False
                break
            unwritten = next((block for block in held if not self.pool.fully_written(block)), None)
            if unwritten is not None:
                self.set_awaiting(state, unwritten)
                return
            parent = state.chain[-1] if state.chain else None
            entry, collided = prefix.find_or_create(
                parent, tuple(state.token_ids[logical * block_size : end]), state.salt
            )
            if entry is None:
                self.collisions += collided
                state.chain_open = False
                break
            for block in held:
                self.pool.register(block, entry)
            state.chain.append(entry)
        self.set_awaiting(state, None)

    def rechain(self, state: RequestState[Any]) -> None:
        """After ``swap_in``: register the restored blocks under the request's hash chain,
        re-creating entries evicted meanwhile; the chain stops where that fails."""
        prefix = self.pool.prefix
        if prefix is None:
            return
        block_size = self.block_size
        chain: list[PrefixEntry] = []
        for logical in range(len(state.chain)):
            parent = chain[-1] if chain else None
            tokens = tuple(state.token_ids[logical * block_size : (logical + 1) * block_size])
            held = [table.physical_block(logical) for table in state.tables if logical >= table.first_logical]
            if not held:
                entry, collided = prefix.find(parent, tokens, state.salt)
            else:
                entry, collided = prefix.find_or_create(parent, tokens, state.salt)
                if entry is not None:
                    for block in held:
                        self.pool.register(block, entry)
            self.collisions += collided
            if entry is None:
                state.chain_open = False
                break
            chain.append(entry)
        state.chain = chain

    def unregister_rewritten(self, state: RequestState[Any], start: int, stop: int) -> None:
        """Take the request's blocks of positions ``start .. stop - 1`` out of the prefix
        cache (they are about to be rewritten), and stop its hash chain before them."""
        prefix = self.pool.prefix
        if prefix is None or stop <= start:
            return
        block_size = self.block_size
        for table in state.tables:
            first = max(start // block_size, table.first_logical)
            last = min(blocks_for(stop, block_size), table.first_logical + table.num_blocks())
            for logical in range(first, last):
                block = table.physical_block(logical)
                if prefix.is_registered(block):
                    self.pool.unregister(block)
        self.cut(state, start // block_size)

    def cut(self, state: RequestState[Any], logical: int) -> None:
        """Stop the request's chain before logical block ``logical`` for good."""
        if logical < len(state.chain):
            del state.chain[logical:]
            state.chain_open = False
            self.set_awaiting(state, None)
