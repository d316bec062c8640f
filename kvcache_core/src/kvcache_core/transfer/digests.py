"""Block digests: what a consumer checks the bytes it read against.

A block's digest (8 bytes, big-endian) is a position-weighted sum modulo 2**64: the block's
bytes in the producer's pool, region after region in the ticket's order, each region's
chunks of the block in address order (the producer's layout, before any conversion), each
region's part zero-padded to a multiple of 8 bytes and read as little-endian 64-bit words;
word ``k`` of that concatenation weighs :func:`word_weights` ``[k]`` (odd, pseudo-random), so
a change confined to one word always changes the digest, and anything else (a block reused
under an expired lease, a chunk landing in the wrong place, words swapped) does except with
a chance of about 2**-64. A checksum, not a cryptographic hash: the producer is trusted with
the data itself. It runs at about 10 GB/s on a run of consecutive blocks (one contraction per
region, where they lie; other blocks are gathered, one matrix product per region and a few
blocks) and releases the GIL, so it overlaps the read in flight; being a sum, the parts of a read
arriving region after region add up to the digest of the whole. (Version 2 tickets carried
CRC-32s: they are refused by their version.)
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.regions import MemoryRegion

__all__ = [
    "DIGEST_BYTES",
    "DIGEST_KIND",
    "PIECE_BYTES",
    "READ_PIECES",
    "ArrivingChecksums",
    "block_checksums",
    "block_digests",
    "host_memory",
    "pack_digests",
    "word_weights",
]

#: Bytes of one block's digest.
DIGEST_BYTES: Final = 8
#: The digest's name in the ticket's documentation and errors.
DIGEST_KIND: Final = "position-weighted 64-bit sum"

Reader = Callable[[int, int], "memoryview | ctypes.Array[ctypes.c_ubyte]"]


def host_memory(address: int, length: int) -> ctypes.Array[ctypes.c_ubyte]:
    """The ``length`` bytes of host memory at ``address`` (a pool region's), without a copy."""
    return (ctypes.c_ubyte * length).from_address(address)


def block_digests(regions: Sequence[MemoryRegion], blocks: npt.NDArray[np.int64], read: Reader) -> bytes:
    """The digests of ``blocks`` of ``regions`` (``DIGEST_BYTES`` each, concatenated), with
    ``read(address, length)`` giving the bytes of a whole region at its address."""
    return pack_digests(block_checksums(regions, blocks, read))


def pack_digests(checksums: npt.NDArray[np.uint64]) -> bytes:
    """Blocks' sums (:func:`block_checksums`) as their digests."""
    packed: bytes = np.asarray(checksums, dtype=np.uint64).astype(">u8").tobytes()
    return packed


@functools.lru_cache(maxsize=8)
def word_weights(count: int) -> npt.NDArray[np.uint64]:
    """The weights of a block's first ``count`` words: splitmix64 of the word's index, made
    odd (read-only)."""
    with np.errstate(over="ignore"):
        value: npt.NDArray[np.uint64] = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        value = (value ^ (value >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        value = (value ^ (value >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        value ^= value >> np.uint64(31)
    value |= np.uint64(1)
    value.flags.writeable = False
    return value


def _words(length: int) -> int:
    return -(-length // 8)


def block_checksums(
    regions: Sequence[MemoryRegion],
    blocks: npt.NDArray[np.int64],
    read: Reader,
    first_word: int = 0,
) -> npt.NDArray[np.uint64]:
    """Each block's weighted sum over ``regions`` (in order), the first of them starting at
    word ``first_word`` of the block (the words of the regions before these), ``[n]`` uint64:
    the digests of a read arriving region after region are the sums of its parts'.

    A run of consecutive blocks (a fresh allocation is mostly one) is summed in place, one
    contraction per region over its chunks as they lie in the pool (no copy); the other
    blocks, a few at a time, have each region's part gathered into one contiguous ``[blocks,
    words]`` array (zero-padded) and multiplied by its weights. Several threads share the
    blocks when there are megabytes of them (NumPy releases the GIL)."""
    count = len(blocks)
    # Per region: [chunks per block, blocks of the pool, bytes of a chunk].
    arrays: list[npt.NDArray[np.uint8]] = [
        np.frombuffer(memoryview(read(region.address, region.length_bytes)).cast("B"), dtype=np.uint8).reshape(
            region.chunks_per_block, -1, region.block_stride_bytes
        )
        for region in regions
    ]
    sizes = [region.chunks_per_block * region.block_stride_bytes for region in regions]
    offsets = np.cumsum([first_word, *(_words(size) for size in sizes)]).tolist()
    weights = word_weights(int(offsets[-1]))
    batch = max(1, _GATHER_BYTES // max(1, sum(sizes)))

    def gathered(picked: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        out = np.zeros(len(picked), dtype=np.uint64)
        for array, size, offset in zip(arrays, sizes, offsets[:-1], strict=True):
            part: npt.NDArray[np.uint8] = array.transpose(1, 0, 2)[picked].reshape(len(picked), size)  # a gather
            if size % 8:
                part = np.concatenate([part, np.zeros((len(picked), -size % 8), dtype=np.uint8)], axis=1)
            words: npt.NDArray[np.uint64] = part.view("<u8")
            out += words @ weights[offset : offset + words.shape[1]]
        return out

    def in_place(first_block: int, length: int) -> npt.NDArray[np.uint64]:
        out = np.zeros(length, dtype=np.uint64)
        for array, offset in zip(arrays, offsets[:-1], strict=True):
            chunks = array[:, first_block : first_block + length].view("<u8")  # [chunks, blocks, words]
            span = chunks.shape[0] * chunks.shape[2]
            out += np.einsum("cbw,cw->b", chunks, weights[offset : offset + span].reshape(chunks.shape[0], -1))
        return out

    aligned = all(array.shape[2] % 8 == 0 for array in arrays)  # chunks of whole words: summed in place

    def checksum(first: int, stop: int) -> npt.NDArray[np.uint64]:
        out = np.zeros(stop - first, dtype=np.uint64)
        rest: list[npt.NDArray[np.int64]] = []  # positions of the blocks to gather
        for begin, end in _runs(blocks[first:stop]):
            if aligned and end - begin >= _RUN_BLOCKS:
                out[begin:end] = in_place(int(blocks[first + begin]), end - begin)
            else:
                rest.append(np.arange(begin, end, dtype=np.int64))
        positions = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
        for start in range(0, len(positions), batch):
            chosen = positions[start : start + batch]
            out[chosen] = gathered(blocks[first + chosen])
        return out

    total_bytes = count * sum(sizes)
    workers = min(_MAX_WORKERS, os.cpu_count() or 1, -(-total_bytes // _BYTES_PER_WORKER))
    if workers < 2:
        return checksum(0, count)
    bounds = np.linspace(0, count, workers + 1).astype(np.int64).tolist()
    parts: list[npt.NDArray[np.uint64]] = list(_executor().map(checksum, bounds[:-1], bounds[1:]))
    return np.concatenate(parts)


def _runs(blocks: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """``blocks`` cut into ``(begin, end)`` spans of consecutive block ids."""
    cuts = (np.flatnonzero(np.diff(blocks) != 1) + 1).tolist()
    return list(itertools.pairwise([0, *cuts, len(blocks)])) if len(blocks) else []


#: Transfers one import's read is split into, so that what arrived is checksummed while the
#: rest is in flight (the last piece's checksum is the only one not overlapped), and the
#: fewest bytes worth a transfer of their own (each one costs NIXL a request to post).
READ_PIECES: Final = 8
PIECE_BYTES: Final = 2 << 20


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
        words = np.cumsum([0, *(_words(size) for size in sizes)])
        self._first_words = [int(words[bound]) for bound in bounds[:-1]]
        self._sums = np.zeros(len(blocks), dtype=np.uint64)
        self._arrived = 0

    def arrived(self, piece: int) -> None:
        """Checksum piece ``piece``."""
        self._sums += block_checksums(self._groups[piece], self._blocks, self._read, self._first_words[piece])
        self._arrived += 1

    def digests(self) -> bytes:
        """The blocks' digests, once every piece arrived."""
        assert self._arrived == len(self._groups)
        return pack_digests(self._sums)


#: The fewest consecutive blocks summed in place rather than gathered.
_RUN_BLOCKS: Final = 4
#: Bytes of blocks gathered at a time (a few blocks, in cache while they are checksummed).
_GATHER_BYTES: Final = 1 << 20
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
