"""Block digests: what a consumer checks the bytes it read against.

A block's digest is the CRC-32 (big-endian, 4 bytes) of its bytes in the producer's pool,
region after region in the ticket's order, each region's chunks of the block in address
order (the producer's layout, before any conversion), so the producer checksums its pool in
place and the consumer what it read before converting it. A checksum, not a cryptographic
hash: it catches bytes damaged or overwritten in flight (a block reused under an expired
lease), at several GB/s; the producer is trusted with the data itself.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.regions import MemoryRegion

__all__ = [
    "DIGEST_BYTES",
    "PIECE_BYTES",
    "READ_PIECES",
    "ArrivingChecksums",
    "block_checksums",
    "block_digests",
    "host_memory",
    "pack_digests",
]

#: Bytes of one block's digest.
DIGEST_BYTES: Final = 4

Reader = Callable[[int, int], "memoryview | ctypes.Array[ctypes.c_ubyte]"]


def host_memory(address: int, length: int) -> ctypes.Array[ctypes.c_ubyte]:
    """The ``length`` bytes of host memory at ``address`` (a pool region's), without a copy."""
    return (ctypes.c_ubyte * length).from_address(address)


def block_digests(regions: Sequence[MemoryRegion], blocks: npt.NDArray[np.int64], read: Reader) -> bytes:
    """The digests of ``blocks`` of ``regions`` (``DIGEST_BYTES`` each, concatenated), with
    ``read(address, length)`` giving the bytes of a whole region at its address."""
    return pack_digests(block_checksums(regions, blocks, read))


def pack_digests(checksums: Sequence[int]) -> bytes:
    """Blocks' running checksums (:func:`block_checksums`) as their digests."""
    return b"".join(checksum.to_bytes(DIGEST_BYTES, "big") for checksum in checksums)


def block_checksums(
    regions: Sequence[MemoryRegion],
    blocks: npt.NDArray[np.int64],
    read: Reader,
    running: Sequence[int] | None = None,
) -> list[int]:
    """Each block's CRC-32 over ``regions`` (in order), going on from ``running`` (one per
    block: the checksums over the regions before these; zeros by default), so a transfer
    that arrives region after region is checksummed as it arrives.

    Blocks are checksummed on several threads when there are megabytes of them and their
    chunks are large enough for ``zlib.crc32`` to release the GIL (over 5 KiB)."""
    count = len(blocks)
    start_from = [0] * count if running is None else list(running)
    views = [memoryview(read(region.address, region.length_bytes)).cast("B") for region in regions]
    # Per region, per block: its chunks' offsets in the region.
    starts = [
        (region.block_chunks(blocks) - region.address).reshape(region.chunks_per_block, count).T.tolist()
        for region in regions
    ]
    lengths = [region.block_stride_bytes for region in regions]

    def checksum(first: int, stop: int) -> list[int]:
        out: list[int] = []
        for index in range(first, stop):
            value = start_from[index]
            for view, chunk_starts, length in zip(views, starts, lengths, strict=True):
                for start in chunk_starts[index]:
                    value = zlib.crc32(view[start : start + length], value)
            out.append(value)
        return out

    total_bytes = count * sum(region.chunks_per_block * region.block_stride_bytes for region in regions)
    workers = min(_MAX_WORKERS, os.cpu_count() or 1, -(-total_bytes // _BYTES_PER_WORKER))
    if workers < 2 or min(lengths, default=0) <= _GIL_RELEASED_ABOVE:
        return checksum(0, count)
    bounds = np.linspace(0, count, workers + 1).astype(np.int64).tolist()
    return [value for part in _executor().map(checksum, bounds[:-1], bounds[1:]) for value in part]


#: Transfers one import's read is split into, so that what arrived is checksummed while the
#: rest is in flight (the last piece's checksum is the only one not overlapped), and the
#: fewest bytes worth a transfer of their own (each one costs NIXL a request to post).
READ_PIECES: Final = 8
PIECE_BYTES: Final = 16 << 20


class ArrivingChecksums:
    """The digests of blocks read region after region, computed as the read arrives: the
    regions are split into a few pieces of about equal bytes, each read by a transfer of its
    own, and a piece is checksummed while the later ones are still in flight."""

    def __init__(self, regions: Sequence[MemoryRegion], blocks: npt.NDArray[np.int64], read: Reader) -> None:
        self._blocks, self._read = blocks, read
        sizes = [region.chunks_per_block * region.block_stride_bytes for region in regions]
        pieces = max(1, min(READ_PIECES, len(regions), sum(sizes) * len(blocks) // PIECE_BYTES))
        # Cut before the region where the bytes so far pass each piece's share.
        cuts = np.searchsorted(np.cumsum(sizes), np.arange(1, pieces) * (sum(sizes) / pieces), side="right") + 1
        bounds = sorted({0, *(int(cut) for cut in cuts if 0 < cut < len(regions)), len(regions)})
        self._groups = [list(regions[first:stop]) for first, stop in itertools.pairwise(bounds)]
        rows = np.cumsum([0, *(region.chunks_per_block * len(blocks) for region in regions)])
        self.piece_rows: tuple[int, ...] = tuple(int(rows[bound]) for bound in bounds[1:-1])
        self._running: list[int] | None = None

    def arrived(self, piece: int) -> None:
        """Checksum piece ``piece`` (pieces arrive in order)."""
        self._running = block_checksums(self._groups[piece], self._blocks, self._read, self._running)

    def digests(self) -> bytes:
        """The blocks' digests, once every piece arrived."""
        assert self._running is not None
        return pack_digests(self._running)


#: ``zlib.crc32`` holds the GIL for buffers up to this many bytes (CPython).
_GIL_RELEASED_ABOVE: Final = 5 * 1024
#: Each thread checksums at least this many bytes: less is not worth handing out.
_BYTES_PER_WORKER: Final = 4 << 20
_MAX_WORKERS: Final = 8
_EXECUTOR: list[ThreadPoolExecutor] = []
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """The checksum threads, started at the first large request and shared by every agent."""
    with _EXECUTOR_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(ThreadPoolExecutor(_MAX_WORKERS, thread_name_prefix="kvcache-digests"))
        return _EXECUTOR[0]
