"""The read plan of an import: which chunks of the producer's pool go where in the consumer's
staging memory (one contiguous buffer, each region's blocks in the producer's layout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.regions import MemoryRegion, block_axis, part_shape
from kvcache_core.errors import TransferError
from kvcache_core.transfer.ticket import TransferTicket

__all__ = ["ReadPlan", "read_plan"]


@dataclass(frozen=True)
class ReadPlan:
    """One READ: ``remote`` chunks (``[n, 3]`` uint64: address, length, device id) land at
    ``offsets`` (``[n]``) of a staging buffer of ``total_bytes``; ``staged`` are the regions
    as laid out there (address = offset), in the ticket's order."""

    remote: npt.NDArray[np.uint64]
    offsets: npt.NDArray[np.int64]
    staged: tuple[MemoryRegion, ...]
    total_bytes: int
    count: int
    device_kind: str

    def parts(self, staging: npt.NDArray[np.uint8]) -> dict[tuple[int, str], npt.NDArray[np.uint8]]:
        """Each region's bytes in ``staging``, by ``(layer, part)``."""
        return {
            (region.layer, region.part): staging[region.address : region.address + region.length_bytes]
            for region in self.staged
        }


def read_plan(ticket: TransferTicket, source: CacheConfig, picks: npt.NDArray[np.int64]) -> ReadPlan:
    """The plan reading the ticket's blocks ``picks`` (indices into ``ticket.blocks``) of
    every region of a producer pool of ``source`` (its storage config: geometry per layer,
    dtype, layout and size).

    Raises:
        TransferError: the regions span several device kinds.
    """
    blocks = ticket.blocks[picks]
    count = len(blocks)
    kinds = {address.device_kind for address in ticket.regions}
    if len(kinds) != 1:
        raise TransferError(f"the ticket's regions span several device kinds {sorted(kinds)}")
    rows: list[npt.NDArray[np.int64]] = []
    offsets: list[npt.NDArray[np.int64]] = []
    staged: list[MemoryRegion] = []
    total = 0
    for address in ticket.regions:
        remote = MemoryRegion(
            address.layer,
            address.part,
            address.address,
            part_shape(source, address.part, layer=address.layer),
            4 if address.part.endswith("scales") else source.dtype_size,
            block_axis(source, address.part),
            address.device_kind,
            address.device_id,
        )
        local = dataclasses.replace(
            remote, address=total, shape=part_shape(source, address.part, count, layer=address.layer)
        )
        starts = remote.block_chunks(blocks)
        rows.append(
            np.stack(
                [starts, np.full(len(starts), remote.block_stride_bytes), np.full(len(starts), address.device_id)],
                axis=1,
            )
        )
        offsets.append(local.block_chunks(np.arange(count, dtype=np.int64)))
        staged.append(local)
        total += local.length_bytes
    return ReadPlan(
        np.concatenate(rows).astype(np.uint64), np.concatenate(offsets), tuple(staged), total, count, kinds.pop()
    )
