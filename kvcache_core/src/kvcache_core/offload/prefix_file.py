"""Saving and loading a pool's prefix cache: ``manager.save_prefix_cache(path)`` and
``manager.load_prefix_cache(path)``, in the portable record format of
:mod:`kvcache_core.offload.block_records` (which says what a file holds and what loading checks).

Requires the ``tiers`` extra (``pip install "kvcache-core[tiers]"``: safetensors).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvcache_core.errors import (
    OutOfBlocksError,
    UnsupportedConfigError,
)
from kvcache_core.offload.safe_files import file_path
from kvcache_core.offload.state_records import pack_states, unpack_states
from kvcache_core.paging.block_pool import BlockPool
from kvcache_core.paging.prefix import PrefixEntry

if TYPE_CHECKING:
    pass

from kvcache_core.offload.block_records import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HASH_ALGORITHM,
    BlockRecord,
    block_checksum,
    decode_blocks,
    encode_blocks,
    read_blocks,
    record_key,
    split_key,
    write_blocks,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASH_ALGORITHM",
    "BlockRecord",
    "RecordStore",
    "block_checksum",
    "decode_blocks",
    "encode_blocks",
    "install_cached_blocks",
    "install_checkpoints",
    "load_prefix_cache",
    "read_blocks",
    "record_key",
    "save_prefix_cache",
    "split_key",
    "with_checkpoints",
    "write_blocks",
]


class RecordStore(Protocol):
    """Where cached blocks go past the pool and come from for a save: the manager's offload
    tiers (:class:`~kvcache_core.offload.tier_stack.TierChain`); false when there are none."""

    def __bool__(self) -> bool:
        """Whether there is anywhere to put records."""
        ...

    def store(self, records: list[BlockRecord]) -> int:
        """Put ``records`` in; return how many are held afterwards."""
        ...

    def records(self) -> list[BlockRecord]:
        """Every record held, checked."""
        ...


def cached_records(pool: BlockPool) -> list[BlockRecord]:
    """Every block hash the pool holds, parents first, with its K/V copied to the host in
    one ``blocks_to_host`` call (:func:`chain_order` then keeps those whose whole chain is
    held). Call with the manager's lock held."""
    prefix = pool.prefix
    if prefix is None:
        return []
    entries = list(prefix.entries())
    depth: dict[int, int] = {}

    def depth_of(entry: PrefixEntry) -> int:
        # Iterative: a chain may be longer than the interpreter's recursion limit.
        path: list[PrefixEntry] = []
        node: PrefixEntry | None = entry
        while node is not None and id(node) not in depth:
            path.append(node)
            node = node.parent
        above = -1 if node is None else depth[id(node)]
        for step in reversed(path):
            above += 1
            depth[id(step)] = above
        return depth[id(entry)]

    entries.sort(key=depth_of)
    picked: list[tuple[PrefixEntry, int]] = []  # one block per entry and KV-cache group
    for entry in entries:
        by_group: dict[int, int] = {}
        for block in entry.blocks:
            by_group.setdefault(int(pool.group_of[block]), block)
        picked.extend((entry, block) for _, block in sorted(by_group.items()))
    if not picked:
        return []
    keys, values = pool.storage.blocks_to_host(np.asarray([block for _, block in picked], dtype=np.int64))
    states = pool.states
    checkpoints = [
        BlockRecord.of_checkpoint(entry, pack_states(pool.config, states.to_host(slot)))
        for entry in entries
        if (slot := states.checkpoints.get(entry.block_hash)) is not None
    ]
    return [
        BlockRecord.of_entry(entry, keys[:, index], values[:, index], int(pool.group_of[block]))
        for index, (entry, block) in enumerate(picked)
    ] + checkpoints


def with_checkpoints(records: list[BlockRecord]) -> list[BlockRecord]:
    """:func:`chain_order` of the blocks of ``records``, then one checkpoint per hash among
    them (a checkpoint of no block kept is left out)."""
    blocks = chain_order([record for record in records if not record.is_checkpoint])
    kept = {record.block_hash for record in blocks}
    checkpoints = {
        record.block_hash: record for record in records if record.is_checkpoint and record.block_hash in kept
    }
    return blocks + list(checkpoints.values())


def install_checkpoints(pool: BlockPool, tiers: RecordStore, records: list[BlockRecord]) -> int:
    """Load ``records`` (blocks, then the checkpoints of some) into ``pool`` as
    :func:`install_cached_blocks` loads blocks, and each checkpoint whose block the pool
    then holds into a free state slot (none is evicted for them); the rest go to the
    tiers, if any, else they are left out (a hit stops before their blocks). Transactional
    as :func:`install_cached_blocks`.

    Returns:
        The blocks installed (checkpoints are not counted).
    """
    blocks = [record for record in records if not record.is_checkpoint]
    checkpoints = [record for record in records if record.is_checkpoint]
    states = pool.states
    if not checkpoints or not states.enabled:
        return install_cached_blocks(pool, tiers, blocks)
    prefix = pool.prefix
    assert prefix is not None
    fresh = [record for record in checkpoints if record.block_hash not in states.checkpoints]
    slots = states.stage([unpack_states(pool.config, record.keys) for record in fresh])
    installed = install_cached_blocks(pool, tiers, blocks)
    rest: list[BlockRecord] = []
    for index, record in enumerate(fresh):
        filed = index < len(slots) and prefix.get(record.block_hash) is not None
        if not (filed and states.file_staged(slots[index], record.block_hash)):
            rest.append(record)
    tiers.store(rest)
    return installed


def install_cached_blocks(pool: BlockPool, tiers: RecordStore, records: list[BlockRecord]) -> int:
    """Put ``records`` (parents first) into the pool as cached blocks, findable by later
    requests: one ``blocks_from_host`` call. Call with the manager's lock held.

    Records already cached (their hash in their KV-cache group), and records whose parent
    is neither cached nor among the records, are skipped. Only free blocks are used (nothing cached is evicted for them);
    with offload tiers (``tiers``), the records past them go to the first tier.

    Transactional: whatever the storage raises, the blocks taken go back and nothing is
    registered.

    Returns:
        The blocks installed.

    Raises:
        OutOfBlocksError: without tiers, fewer free blocks than the records need (nothing
            installed).
    """
    prefix = pool.prefix
    assert prefix is not None
    known: dict[bytes, PrefixEntry | None] = {}  # hash -> its live entry (None: to be installed)
    todo: list[BlockRecord] = []
    seen: set[tuple[bytes, int]] = set()
    for record in records:
        if (record.block_hash, record.group) in seen:
            continue
        seen.add((record.block_hash, record.group))
        existing = known.get(record.block_hash) or prefix.get(record.block_hash)
        if existing is not None:
            known[record.block_hash] = existing
            if any(pool.group_of[block] == record.group for block in existing.blocks):
                continue  # cached in its group already
        elif record.parent_hash is not None and record.parent_hash not in known:
            parent_entry = prefix.get(record.parent_hash)
            if parent_entry is None:
                continue  # an orphan: nothing could reach it
            known[record.parent_hash] = parent_entry
        known.setdefault(record.block_hash, None)
        todo.append(record)
    free = pool.allocator.free_block_count()
    overflow: list[BlockRecord] = []
    if len(todo) > free and tiers:  # the chains' tails go to the offload tiers
        todo, overflow = todo[:free], todo[free:]
    if len(todo) > free:
        raise OutOfBlocksError(
            f"cannot install {len(todo)} cached blocks: {max(free, 0)} of {pool.config.num_blocks} blocks are "
            f"free (cached blocks are not evicted for them); free some with gc() or deallocate"
        )
    if not todo:
        return tiers.store(overflow)
    allocator = pool.allocator
    blocks = allocator.allocate(len(todo))
    pool.group_of[blocks] = [record.group for record in todo]
    try:
        pool.storage.blocks_from_host(
            np.asarray(blocks, dtype=np.int64),
            np.stack([record.keys for record in todo], axis=1),
            np.stack([record.values for record in todo], axis=1),
        )
    except BaseException:
        allocator.release(blocks[::-1], blocks[-1])
        raise
    block_size = pool.config.block_size
    installed: list[int] = []
    for block, record in zip(blocks, todo, strict=True):
        entry = known[record.block_hash]  # live already: another group's block holds it
        if entry is None:
            parent = None if record.parent_hash is None else known[record.parent_hash]
            if record.parent_hash is not None and parent is None:
                allocator.release([block], block)  # its parent was skipped: nothing could reach it
                continue
            entry, _ = prefix.find_or_create(parent, record.token_ids, record.salt)
        if entry is None:  # a collision: the hash is taken by other tokens
            allocator.release([block], block)
            continue
        slots = slice(block * block_size, (block + 1) * block_size)
        pool.issued[slots] = True
        if pool.written is not None:
            pool.written[:, slots] = True
        pool.swapped_blocks.pop(block, None)
        pool.register(block, entry)
        known[record.block_hash] = entry
        installed.append(block)
    # Children first into the evictor, so a chain is evicted from its tail.
    if installed:
        allocator.release(installed[::-1], installed[-1], pool.keep_cached)
    return len(installed) + tiers.store(overflow)


def chain_order(records: list[BlockRecord]) -> list[BlockRecord]:
    """``records`` without duplicates (one per hash and KV-cache group), parents before
    children, keeping only those whose whole chain (up to a first block) is among them."""
    by_hash = {record.block_hash: record for record in records}
    unique = {(record.block_hash, record.group): record for record in records}  # one per hash and group
    depth: dict[bytes, int | None] = {}  # None: its chain does not reach a first block

    def depth_of(block_hash: bytes) -> int | None:
        # Iterative: a chain may be longer than the interpreter's recursion limit.
        path: list[bytes] = []
        on_path: set[bytes] = set()
        node: bytes | None = block_hash
        while node is not None and node not in depth and node in by_hash and node not in on_path:
            path.append(node)
            on_path.add(node)
            node = by_hash[node].parent_hash
        # Stopped past a first block (None), at a known hash, or (depth None) at a hash missing
        # from the records or at a (forged) cycle.
        above: int | None = -1 if node is None else depth.get(node)
        for step in reversed(path):
            above = None if above is None else above + 1
            depth[step] = above
        return depth[block_hash]

    ranked = [(rank, record) for record in unique.values() if (rank := depth_of(record.block_hash)) is not None]
    ranked.sort(key=lambda item: item[0])
    return [record for _, record in ranked]


def save_prefix_cache(pool: BlockPool, tiers: RecordStore, path: str | os.PathLike[str]) -> int:
    """Write every cached prefix block of a manager, in its pool and in its offload tiers
    (``tiers``), to ``path`` (see the module docstring).

    Returns:
        The blocks written.

    Raises:
        InvalidTypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        InvalidArgumentError: ``path`` is empty or holds a NUL character.
        UnsupportedConfigError: the pool has no prefix caching.
        CacheFileError: the file cannot be written (nothing is left behind).
    """
    file_path(path)
    if pool.prefix is None:
        raise UnsupportedConfigError("save_prefix_cache needs CacheConfig(enable_prefix_caching=True)")
    records = with_checkpoints(cached_records(pool) + tiers.records())
    write_blocks(path, pool.config, records)
    return sum(1 for record in records if not record.is_checkpoint)


def load_prefix_cache(pool: BlockPool, tiers: RecordStore, path: str | os.PathLike[str]) -> int:
    """Map the blocks of a file :func:`save_prefix_cache` wrote into the prefix cache of
    ``pool`` (overflow into ``tiers``) (as cached blocks: later prompts hit them). Blocks already cached are skipped.

    Returns:
        The blocks loaded.

    Raises:
        InvalidTypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        InvalidArgumentError: ``path`` is empty or holds a NUL character.
        UnsupportedConfigError: the pool has no prefix caching.
        CacheFileError, CorruptCacheFileError, IncompatibleCacheFileError: see
            :func:`read_blocks`; nothing is loaded.
        OutOfBlocksError: without offload tiers, fewer free blocks than the file's new
            blocks; nothing is loaded. (With tiers, the blocks past the free ones go to them.)
    """
    file_path(path)
    if pool.prefix is None:
        raise UnsupportedConfigError("load_prefix_cache needs CacheConfig(enable_prefix_caching=True)")
    return install_checkpoints(pool, tiers, read_blocks(path, pool.config))
