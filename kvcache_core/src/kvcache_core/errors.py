"""The exception hierarchy: one root, :class:`KvCacheError`, and specific subclasses.

Each subclass also inherits the builtin exception a Python caller would expect
(``ValueError`` for a bad value, ``IndexError`` for an index out of range, ...), so
``except ValueError`` keeps working. Rust's ``Result`` error of the seed crate maps to
raising one of these; its ``Option`` maps to ``None``.

Every error is raised *before* any state changes: after one is caught, every cache,
table and count is exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "ArrayTypeError",
    "BackendConflictError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CacheFileError",
    "CorruptCacheFileError",
    "CorruptEventBatchError",
    "DTypeMismatchError",
    "DuplicateRequestError",
    "ForeignHandleError",
    "IncompatibleCacheFileError",
    "InsufficientBlocksError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvalidHandleError",
    "InvalidTypeError",
    "InvariantError",
    "KvCacheError",
    "KvCachePluginWarning",
    "LayerIndexError",
    "ManagerClosedError",
    "NotSwappedOutError",
    "OutOfBlocksError",
    "OutOfStateSlotsError",
    "PublisherClosedError",
    "SequenceTooLongError",
    "ShapeMismatchError",
    "SharedBlockWriteError",
    "SlotError",
    "StalePageTableError",
    "StaleStepError",
    "StateRollbackError",
    "SwappedOutError",
    "TierError",
    "TransferError",
    "TransferMismatchError",
    "UnknownRequestError",
    "UnsupportedConfigError",
]


class KvCacheError(Exception):
    """Root of every error raised by kvcache."""


class InvalidArgumentError(KvCacheError, ValueError):
    """An argument has a value outside its valid range (negative count, empty id, ...)."""


class InvalidConfigError(InvalidArgumentError):
    """A :class:`~kvcache_core.CacheConfig` field is out of range."""


class UnsupportedConfigError(KvCacheError, ValueError):
    """The configuration is valid, but the chosen backend does not support it
    (a dtype, device or layout it does not claim, or a policy not built yet)."""


class ShapeMismatchError(InvalidArgumentError):
    """An array has the wrong shape, e.g. keys that are not ``[n, num_heads, head_dim]``."""


class DTypeMismatchError(KvCacheError, TypeError):
    """An array's dtype differs from the pool's dtype."""


class InvalidTypeError(KvCacheError, TypeError):
    """An argument has the wrong type (a list where an AllocationRequest belongs, ...)."""


class ArrayTypeError(InvalidTypeError):
    """An argument is not an array of the backend's native type."""


class LayerIndexError(KvCacheError, IndexError):
    """A layer index outside ``[0, num_layers)``."""


class SlotError(KvCacheError, IndexError):
    """A slot outside the pool, in a block no request owns, or repeated in one write."""


class SharedBlockWriteError(SlotError):
    """A write names a slot in a block that several requests share (after ``fork`` or a
    prefix-cache hit): it would change every sharer's tokens. Take private slots from
    ``extend`` or ``writable_slots``, which copy the block first (copy-on-write)."""


class StalePageTableError(SlotError):
    """A page table taken before one of its requests was released, swapped, re-planned
    or had a block replaced (copy-on-write, window release): its blocks may belong to
    another request now. Take a new page table from the manager."""


class StaleStepError(KvCacheError, RuntimeError):
    """A step used after one of its requests was released, swapped out, truncated,
    forked or planned again (``extend``, another ``begin_step``): its slots and page table
    may name blocks that are no longer the request's. Plan a new step."""


class UnknownRequestError(KvCacheError, LookupError):
    """No live request has this id (never allocated, or already deallocated)."""


class DuplicateRequestError(KvCacheError, ValueError):
    """A request with this id is already allocated."""


class InvalidHandleError(KvCacheError, RuntimeError):
    """The handle's request was deallocated; its data can no longer be read or written."""


class SwappedOutError(InvalidHandleError):
    """The request is swapped out to host memory: its handle stays valid, but its data can
    be read, written or extended only after ``swap_in``."""


class ManagerClosedError(InvalidHandleError):
    """The manager was closed (``manager.close()`` or the end of its ``with`` block): its
    pool is released, so neither it nor any handle it gave out can be used."""


class NotSwappedOutError(KvCacheError, RuntimeError):
    """``swap_in`` of a request that is resident (it was never swapped out, or is back)."""


class ForeignHandleError(KvCacheError, ValueError):
    """The handle belongs to another manager (or is not a kvcache handle at all)."""


class OutOfBlocksError(KvCacheError, MemoryError):
    """The pool has fewer free blocks than the operation needs. Nothing was taken."""


class OutOfStateSlotsError(OutOfBlocksError):
    """Every slot of the state pool (``CacheConfig.state_slots``) is taken: a pool with
    recurrent-state layers holds one state per live request. Nothing was taken."""


class StateRollbackError(InvalidArgumentError):
    """``truncate`` of a request whose recurrent states hold no checkpoint at the asked
    length: a state layer cannot be rolled back past what it overwrote."""


class SequenceTooLongError(InvalidArgumentError):
    """Extending would grow a request past its ``max_sequence_length``."""


class InsufficientBlocksError(InvalidArgumentError):
    """:meth:`BlockTable.extend_sequence` was asked for more tokens than its blocks hold."""


class BackendNotFoundError(KvCacheError, LookupError):
    """No installed backend has this name."""


class BackendUnavailableError(KvCacheError, RuntimeError):
    """The backend is installed, but cannot run here (its library or device is missing)."""


class BackendConflictError(KvCacheError, ValueError):
    """Two installed distributions register a backend under the same name."""


class InvariantError(KvCacheError, AssertionError):
    """``PagedKvCacheManager.check_invariants`` found the pool's records inconsistent."""


class KvCachePluginWarning(UserWarning):
    """A backend plugin failed to load; the other backends are unaffected."""


# -- beyond the pool (issue 15): saved prefix caches and offload tiers ---------------------


class CacheFileError(KvCacheError, OSError):
    """A prefix-cache file or tier directory cannot be written or read (no permission, no
    such file, disk full). Nothing was loaded; a write left no partial file behind."""


class CorruptCacheFileError(KvCacheError, ValueError):
    """A prefix-cache file is truncated or corrupted (a header that does not parse, a block
    whose checksum or hash does not match). Nothing was loaded."""


class IncompatibleCacheFileError(KvCacheError, ValueError):
    """A prefix-cache file is intact but cannot go into this pool: another namespace
    (``model_id``), geometry, block size or dtype, or an unknown format version."""


class TierError(KvCacheError, ValueError):
    """An offload tier cannot be used as configured (a capacity below one block, a name
    taken twice, a directory it cannot write, a tier another live manager holds), or failed
    where a miss is no answer (its figures). Where a miss is safe, a failing tier is a miss
    with a warning instead, counted in ``TierStats.errors``."""


class PublisherClosedError(KvCacheError, RuntimeError):
    """The event publisher was closed (``publisher.close()`` or the end of its ``with``
    block): its sockets are gone, so it publishes nothing more. A manager it is subscribed
    to turns this into a :class:`RuntimeWarning`; ``manager.unsubscribe`` it first."""


class CorruptEventBatchError(InvalidArgumentError):
    """A cache-event payload (a ZMQ message, a replayed batch) is not a KV event batch: not
    msgpack, a field of the wrong type (``bool`` is not an int), a value out of its range
    (token ids, block sizes, 32-byte hashes, finite timestamps), or more items than the
    payload's own size could hold. Nothing was decoded."""


class TransferError(KvCacheError, RuntimeError):
    """A request's cache could not move between processes (:mod:`kvcache_core.transfer`): the
    producer is gone or did not answer in time, its lease expired or was released, the
    transfer failed or its blocks did not match their checksums, the ticket is malformed or
    for another namespace, geometry or dtype, or the storage cannot name its memory. Nothing
    leaked on either side: the consumer's new request was released, its other requests are
    untouched."""


class TransferMismatchError(TransferError, ValueError):
    """A transfer ticket describes a pool this one cannot take the request into: another
    namespace, dtype, block size, layer count, or a layer of another kind (window, chunk,
    K/V or not), geometry (KV heads, key or value width) or recurrent state (arrays, shapes,
    dtypes). The message names the first layer and field that differ, both values."""
