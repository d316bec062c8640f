"""What an import does with what arrived: compare digests with the ticket's, and put blocks
read in the producer's layout into this pool's blocks in its own (any pool: KV-cache groups,
windows, layers of their own geometry, quantized scales).

Keys and values are ``[num_blocks, block_size, num_heads, width]`` in ``"NHD"``,
``[num_blocks, num_heads, block_size, width]`` in ``"HND"`` and ``[num_heads, num_blocks,
block_size, width]`` in ``"heads_first"``; scales are ``[num_heads, num_blocks, block_size]``
in every layout (:mod:`kvcache_core.contract.regions`). A conversion is a permutation of the
axes, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.regions import MemoryRegion
from kvcache_core.errors import TransferError
from kvcache_core.transfer.digests import DIGEST_BYTES, block_digests, host_memory
from kvcache_core.transfer.ticket import TransferTicket

__all__ = ["check_digests", "check_state_digests", "picked_digests", "place_converted", "state_rows"]

#: The axes of keys and values in each layout: blocks, tokens, heads, features.
_AXES: Final = {"NHD": "nthf", "HND": "nhtf", "heads_first": "hntf"}


def _region_bytes(region: MemoryRegion, memory: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """``memory`` (a region's bytes) as ``[*shape, element_bytes]``."""
    return memory.reshape(*region.shape, region.element_bytes)


def place_converted(
    staged: Sequence[MemoryRegion],
    staging: npt.NDArray[np.uint8],
    regions: Mapping[tuple[int, str], MemoryRegion],
    blocks: npt.NDArray[np.int64],
    source_layout: str,
    target_layout: str,
) -> None:
    """Write the blocks staged region after region (``staged``: their regions in ``staging``,
    address = offset, in ``source_layout``) into blocks ``blocks`` of this pool's host
    ``regions`` (by ``(layer, part)``, in ``target_layout``), bit for bit."""
    for region in staged:
        target = regions[(region.layer, region.part)]
        source = _region_bytes(region, staging[region.address : region.address + region.length_bytes])
        if not region.part.endswith("scales"):
            axes, wanted = _AXES[source_layout], _AXES[target_layout]
            source = source.transpose(*(axes.index(axis) for axis in wanted), 4)
        memory = np.frombuffer(memoryview(host_memory(target.address, target.length_bytes)), dtype=np.uint8)
        destination = np.moveaxis(_region_bytes(target, memory), target.block_axis, 0)
        destination[blocks] = np.moveaxis(source, target.block_axis, 0)


def state_rows(
    ticket: TransferTicket, slot: Sequence[MemoryRegion]
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """The chunks (``[n, 3]``: address, length, device id) of the ticket's state slot and of
    this request's (``slot``), one per state array."""
    remote = [[state.address, state.nbytes, state.device_id] for state in ticket.states]
    local = [[region.address, region.block_stride_bytes, region.device_id] for region in slot]
    return (
        np.asarray(remote, dtype=np.uint64).reshape(-1, 3),
        np.asarray(local, dtype=np.int64).reshape(-1, 3).astype(np.uint64),
    )


def check_state_digests(ticket: TransferTicket, slot: Sequence[MemoryRegion]) -> None:
    """Refuse a state slot (``slot``, in host memory) whose arrays arrived different from the
    ticket's (when it carries their digests).

    Raises:
        TransferError: the first state array that differs, by its index.
    """
    if not ticket.state_digests:
        return
    got = b"".join(block_digests([region], np.zeros(1, dtype=np.int64), host_memory) for region in slot)
    check_digests(got, ticket.state_digests, np.arange(len(slot), dtype=np.int64), "state array")


def picked_digests(digests: bytes, picks: npt.NDArray[np.int64]) -> bytes:
    """The digests of the ticket's blocks ``picks``."""
    return np.frombuffer(digests, dtype=f">u{DIGEST_BYTES}")[picks].tobytes()


def check_digests(got: bytes, expected: bytes, picks: npt.NDArray[np.int64], what: str) -> None:
    """Refuse blocks (or state arrays) whose digests differ from the ticket's (the first of
    them named by its index in the ticket).

    Raises:
        TransferError: a digest differs.
    """
    if got == expected:
        return
    bad = next(
        index
        for index in range(len(got) // DIGEST_BYTES)
        if got[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]
        != expected[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]
    )
    raise TransferError(
        f"{what} {int(picks[bad])} of the ticket arrived different from what was exported (digest mismatch)"
    )
