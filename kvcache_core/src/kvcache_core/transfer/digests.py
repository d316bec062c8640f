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
import zlib
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.regions import MemoryRegion

__all__ = ["DIGEST_BYTES", "block_digests", "host_memory"]

#: Bytes of one block's digest.
DIGEST_BYTES: Final = 4

Reader = Callable[[int, int], "memoryview | ctypes.Array[ctypes.c_ubyte]"]


def host_memory(address: int, length: int) -> ctypes.Array[ctypes.c_ubyte]:
    """The ``length`` bytes of host memory at ``address`` (a pool region's), without a copy."""
    return (ctypes.c_ubyte * length).from_address(address)


def block_digests(regions: Sequence[MemoryRegion], blocks: npt.NDArray[np.int64], read: Reader) -> bytes:
    """The digests of ``blocks`` of ``regions`` (``DIGEST_BYTES`` each, concatenated), with
    ``read(address, length)`` giving the bytes at a chunk's address."""
    count = len(blocks)
    starts = [region.block_chunks(blocks).reshape(region.chunks_per_block, count) for region in regions]
    lengths = [region.block_stride_bytes for region in regions]
    digests = bytearray()
    for index in range(count):
        checksum = 0
        for chunk_starts, length in zip(starts, lengths, strict=True):
            for start in chunk_starts[:, index].tolist():
                checksum = zlib.crc32(read(start, length), checksum)
        digests += checksum.to_bytes(DIGEST_BYTES, "big")
    return bytes(digests)
