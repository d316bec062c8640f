"""Prefix caching: the hash chain of full blocks, the map from hashes to cached blocks,
and the least-recently-used evictor of blocks nobody references.

A full block's hash chains its parent's hash, its token ids and the request's salt::

    hash(block i) = sha256(tag, hash(block i - 1) or none, salt or none, token ids of block i)

over a fixed byte encoding (little-endian 64-bit token ids, length-prefixed salt), so a
hash is the same in every process and on every machine; Python's salted ``hash()`` is
never used. Two prompts share block ``i``'s hash only if they share blocks ``0 .. i``.
With a namespace (``CacheConfig.model_id``) the first block's parent is the namespace's
root hash (:func:`namespace_root`) instead of none, so chains of two namespaces never meet.

Trust does not rest on the hash alone. Every entry keeps the token ids, the salt and its
parent *entry* (the object, not only the parent's hash), and a lookup compares all three
on every step of the chain: a collision, even a forced one, is a miss and never maps a
block holding other tokens. (An entry whose parent was evicted and later cached again
under a new entry is matched by comparing the two parents' token ids and salts up the
chain, and is then linked to the new parent.)
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

__all__ = [
    "BlockEvictor",
    "BlockHash",
    "PrefixCache",
    "PrefixEntry",
    "PrefixListener",
    "hash_block",
    "namespace_root",
    "same_prefix",
]

#: A block hash: a SHA-256 digest (32 bytes).
BlockHash = bytes

_TAG = b"kvcache-core/block-hash/v1"
_NAMESPACE_TAG = b"kvcache-core/namespace/v1"


def namespace_root(namespace: str | None) -> BlockHash | None:
    """The hash every chain of ``namespace`` starts from (the first block's parent):
    SHA-256 over a tag and the namespace's UTF-8 bytes; ``None`` for no namespace."""
    if namespace is None:
        return None
    encoded = namespace.encode()
    return hashlib.sha256(_NAMESPACE_TAG + struct.pack("<Q", len(encoded)) + encoded).digest()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes | None) -> BlockHash:
    """The hash of a full block: SHA-256 over its parent's hash, the salt and its token ids.

    Args:
        parent: the hash of the previous block of the sequence, ``None`` for the first.
        token_ids: the block's token ids, each ``0 <= id < 2**63``.
        salt: bytes that keep tenants apart (``None`` for no salt).

    Returns:
        32 bytes, identical in every process.
    """
    digest = hashlib.sha256(_TAG)
    digest.update(b"\x00" if parent is None else b"\x01" + parent)
    digest.update(b"\x00" if salt is None else b"\x01" + struct.pack("<Q", len(salt)) + salt)
    digest.update(struct.pack(f"<Q{len(token_ids)}Q", len(token_ids), *token_ids))
    return digest.digest()


class PrefixEntry:
    """One hash of the cache: the tokens it stands for and the blocks that hold them.

    Every block of :attr:`blocks` holds the K/V of the same tokens after the same prefix;
    an entry lives while it has a block and is dropped (``alive`` turns false) with its last.
    """

    __slots__ = ("alive", "block_hash", "blocks", "parent", "salt", "token_ids")

    def __init__(
        self, block_hash: BlockHash, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: bytes | None
    ) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.token_ids = token_ids
        self.salt = salt
        self.blocks: dict[int, None] = {}  # insertion-ordered set of block ids
        self.alive = True

    def matches(self, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: bytes | None) -> bool:
        """Whether this entry stands for ``token_ids`` after exactly ``parent``'s prefix."""
        return self.token_ids == token_ids and self.salt == salt and same_prefix(self.parent, parent)

    def __repr__(self) -> str:
        return f"PrefixEntry({self.block_hash.hex()[:12]}, blocks={list(self.blocks)}, alive={self.alive})"


def same_prefix(first: PrefixEntry | None, second: PrefixEntry | None) -> bool:
    """Whether two entries stand for the same token prefix: the same object, or (when one
    was evicted and the prefix cached again) equal token ids and salts all the way up."""
    while first is not second:
        if first is None or second is None:
            return False
        if first.token_ids != second.token_ids or first.salt != second.salt:
            return False
        first, second = first.parent, second.parent
    return True


class PrefixListener(Protocol):
    """Told when a hash enters the cache (its first block registers) and when it leaves
    (its last block unregisters): the moments :mod:`kvcache_core.offload.events` reports."""

    def entry_stored(self, entry: PrefixEntry) -> None: ...

    def entry_removed(self, entry: PrefixEntry) -> None: ...


class PrefixCache:
    """The map from block hashes to the blocks holding those tokens.

    Not thread-safe by itself: the manager serialises calls. Which blocks are cached
    (unreferenced but kept) is the allocator's business; this map only says which blocks
    hold which prefix.

    Args:
        namespace: ``CacheConfig.model_id``; it enters the root of every hash chain.
    """

    def __init__(self, namespace: str | None = None) -> None:
        self._entries: dict[BlockHash, PrefixEntry] = {}
        self._entry_of: dict[int, PrefixEntry] = {}
        self._namespace = namespace
        self._root = namespace_root(namespace)
        self.listener: PrefixListener | None = None

    @property
    def namespace(self) -> str | None:
        """The namespace whose root every chain starts from."""
        return self._namespace

    def parent_hash(self, parent: PrefixEntry | None) -> BlockHash | None:
        """The hash a block after ``parent`` chains: ``parent``'s, or the namespace root."""
        return self._root if parent is None else parent.block_hash

    def __len__(self) -> int:
        """Blocks registered."""
        return len(self._entry_of)

    def entries(self) -> Iterator[PrefixEntry]:
        """Every live entry."""
        return iter(list(self._entries.values()))

    def entry_of(self, block: int) -> PrefixEntry | None:
        """The entry ``block`` is registered under, or ``None``."""
        return self._entry_of.get(block)

    def rehash(self, entry: PrefixEntry) -> BlockHash:
        """``entry``'s hash recomputed from its parent, tokens and salt (for checks)."""
        return hash_block(self.parent_hash(entry.parent), entry.token_ids, entry.salt)

    def is_registered(self, block: int) -> bool:
        """Whether ``block`` holds a hashed prefix (and can be found by a lookup)."""
        return block in self._entry_of

    def get(self, block_hash: BlockHash) -> PrefixEntry | None:
        """The live entry of ``block_hash``, or ``None``."""
        return self._entries.get(block_hash)

    def find(
        self, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: bytes | None
    ) -> tuple[PrefixEntry | None, bool]:
        """Look up the block after ``parent`` holding ``token_ids``.

        Returns:
            ``(entry, collided)``: the matching live entry or ``None``, and whether an entry
            with the same hash but other tokens, salt or parent was found (a collision).
        """
        if parent is not None and not parent.alive:
            return None, False
        entry = self._entries.get(hash_block(self.parent_hash(parent), token_ids, salt))
        if entry is None:
            return None, False
        if not entry.matches(parent, token_ids, salt):
            return None, True
        return entry, False

    def find_or_create(
        self, parent: PrefixEntry | None, token_ids: tuple[int, ...], salt: bytes | None
    ) -> tuple[PrefixEntry | None, bool]:
        """The entry for ``token_ids`` after ``parent``, created if absent.

        A created entry has no block yet: :meth:`register` one at once (an entry lives
        only while it has blocks).

        Returns:
            ``(entry, collided)``: ``entry`` is ``None`` when the hash is taken by other
            tokens (``collided``) or ``parent`` is gone.
        """
        if parent is not None and not parent.alive:
            return None, False
        block_hash = hash_block(self.parent_hash(parent), token_ids, salt)
        entry = self._entries.get(block_hash)
        if entry is None:
            entry = PrefixEntry(block_hash, parent, token_ids, salt)
            self._entries[block_hash] = entry
            return entry, False
        if entry.matches(parent, token_ids, salt):
            entry.parent = parent  # relink an entry whose parent was evicted and re-created
            return entry, False
        return None, True

    def register(self, block: int, entry: PrefixEntry) -> None:
        """Record that ``block`` holds ``entry``'s tokens (a no-op if it already does)."""
        assert entry.alive, "register under a dropped entry"
        current = self._entry_of.get(block)
        if current is entry:
            return
        assert current is None, f"block {block} is registered under another hash"
        entry.blocks[block] = None
        self._entry_of[block] = entry
        if len(entry.blocks) == 1 and self.listener is not None:
            self.listener.entry_stored(entry)

    def unregister(self, block: int) -> None:
        """Forget ``block`` (evicted or overwritten); drop its entry with its last block."""
        entry = self._entry_of.pop(block)
        del entry.blocks[block]
        if not entry.blocks:
            del self._entries[entry.block_hash]
            entry.alive = False
            if self.listener is not None:
                self.listener.entry_removed(entry)


class BlockEvictor:
    """Blocks nobody references but whose contents are kept for prefix hits, in
    least-recently-used order: :meth:`pop_oldest` gives the block freed longest ago.

    O(1) ``push``, ``remove`` of any member and ``pop_oldest``.
    """

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __iter__(self) -> Iterator[int]:
        """Oldest first."""
        return iter(list(self._blocks))

    def push(self, block: int) -> None:
        """Add ``block`` as the most recently used."""
        assert block not in self._blocks, f"block {block} is already cached"
        self._blocks[block] = None

    def remove(self, block: int) -> None:
        """Take ``block`` out (a prefix hit revives it)."""
        del self._blocks[block]

    def pop_oldest(self) -> int:
        """Take out and return the least recently used block."""
        block, _ = self._blocks.popitem(last=False)
        return block
