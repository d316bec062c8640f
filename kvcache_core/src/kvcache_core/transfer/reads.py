"""The reads of an import: a ticket's blocks (and states) from the producer's pool into this
pool's request, in place (one layout), staged and converted on arrival (another layout), or
staged for the storage's host writes (a plain pool in device memory); what arrived is
checked against the ticket's digests before anything is recorded.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.regions import MemoryRegion, host_form_from_parts
from kvcache_core.errors import TransferError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.transfer.arrival import (
    check_digests,
    check_state_digests,
    picked_digests,
    place_converted,
    state_rows,
)
from kvcache_core.transfer.digests import ArrivingChecksums, host_memory
from kvcache_core.transfer.engine import NixlEngine
from kvcache_core.transfer.plan import ReadPlan, read_plan
from kvcache_core.transfer.pool_description import group_reads
from kvcache_core.transfer.ticket import TransferTicket

__all__ = ["ImportReads"]


class ImportReads:
    """The reads of imports into ``manager``'s pool (its ``regions`` by ``(layer, part)``,
    registered with ``engine``, in ``layout``); ``held`` collects the requests a read that
    NIXL could not abort may still write (they stay allocated)."""

    def __init__(
        self,
        engine: NixlEngine,
        manager: PagedKvCacheManager[Any],
        regions: dict[tuple[int, str], MemoryRegion],
        layout: str,
        held: set[str],
    ) -> None:
        self._engine, self._manager, self._regions, self._layout, self._held = engine, manager, regions, layout, held

    def in_place(
        self, ticket: TransferTicket, source: CacheConfig, handle: PagedKvCacheHandle[Any], first: int, deadline: float
    ) -> None:
        """Read every group's blocks from logical block ``first`` on (each group's from the
        first it holds) and the request's states straight into the request's blocks and
        state slot, through this pool's registered regions, and check their checksums there."""
        count = math.ceil(ticket.num_tokens / source.block_size)
        reads = group_reads(ticket, handle.block_tables(), first, count)
        plan = read_plan(ticket, source, reads.picks)
        regions = [self._regions[(address.layer, address.part)] for address in ticket.regions]
        rows = [
            np.stack(
                [starts, np.full(len(starts), region.block_stride_bytes), np.full(len(starts), region.device_id)],
                axis=1,
            )
            for region in regions
            if len(starts := region.block_chunks(reads.blocks))
        ]
        slot = self._manager.state_regions(handle)
        remote_states, local_states = state_rows(ticket, slot)
        local = np.concatenate([*(row.astype(np.uint64) for row in rows), local_states])
        remote = np.concatenate([plan.remote, remote_states])
        check = ArrivingChecksums(regions, reads.blocks, host_memory) if ticket.digests and len(reads.blocks) else None
        failure, released = self._engine.read_into(
            ticket.agent,
            remote,
            plan.device_kind,
            local,
            "cpu",
            deadline,
            pieces=check.piece_rows if check is not None else (),
            arrived=check.arrived if check is not None else None,
        )
        self._after_read(handle, failure, released)
        _check_blocks(ticket, check, reads.picks)
        check_state_digests(ticket, slot)

    def converted(
        self, ticket: TransferTicket, source: CacheConfig, handle: PagedKvCacheHandle[Any], first: int, deadline: float
    ) -> None:
        """Read every group's blocks from logical block ``first`` on (each group's from the
        first it holds) into a staging buffer in the producer's layout and the request's
        states straight into its state slot, check their checksums, and write the blocks into
        the request's, converted to this pool's layout."""
        count = math.ceil(ticket.num_tokens / source.block_size)
        reads = group_reads(ticket, handle.block_tables(), first, count)
        if not len(reads.picks):  # no block to convert: the states only
            self.in_place(ticket, source, handle, first, deadline)
            return
        plan = read_plan(ticket, source, reads.picks)
        slot = self._manager.state_regions(handle)
        staging, check, failure, released = self._stage(ticket, plan, deadline, also=state_rows(ticket, slot))
        self._after_read(handle, failure, released)
        _check_blocks(ticket, check, reads.picks)
        check_state_digests(ticket, slot)
        place_converted(plan.staged, staging, self._regions, reads.blocks, ticket.layout, self._layout)

    def _stage(
        self,
        ticket: TransferTicket,
        plan: ReadPlan,
        deadline: float,
        also: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None = None,
    ) -> tuple[npt.NDArray[np.uint8], ArrivingChecksums | None, str | None, bool]:
        """Read a plan's chunks into a new staging buffer (and the chunks ``also``), checksummed
        as they arrive: the buffer, the checksums, and the read's ``(failure, released)``."""
        staging = np.empty(plan.total_bytes, dtype=np.uint8)
        check = _staged_checksums(ticket, plan, staging)
        failure, released = self._engine.read_staged(
            ticket.agent,
            plan.remote,
            plan.device_kind,
            staging,
            plan.offsets,
            deadline,
            pieces=check.piece_rows if check is not None else (),
            arrived=check.arrived if check is not None else None,
            also=also,
        )
        return staging, check, failure, released

    def _after_read(self, handle: PagedKvCacheHandle[Any], failure: str | None, released: bool) -> None:
        """Keep a request whose read NIXL could not abort out of reuse (it may still land in
        its blocks), and raise a read's failure.

        Raises:
            TransferError: the read failed or did not finish in time.
        """
        if not released:
            self._held.add(handle.request_id)
        if failure is not None:
            raise TransferError(
                failure
                + (
                    ""
                    if released
                    else f"; request {handle.request_id!r} stays allocated (the read could not be aborted)"
                )
            )

    def staged(
        self, ticket: TransferTicket, source: CacheConfig, first: int, deadline: float
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """The blocks ``ticket.blocks[first:]`` of the producer's pool (one group), in host form."""
        picks = np.arange(first, len(ticket.blocks), dtype=np.int64)
        plan = read_plan(ticket, source, picks)
        staging, check, failure, _ = self._stage(ticket, plan, deadline)
        if failure is not None:  # a read NIXL could not abort lands in the staging buffer the engine keeps
            raise TransferError(failure)
        _check_blocks(ticket, check, picks)
        return host_form_from_parts(source, ticket.layout, plan.parts(staging))


def _staged_checksums(
    ticket: TransferTicket, plan: ReadPlan, staging: npt.NDArray[np.uint8]
) -> ArrivingChecksums | None:
    """The checksums of the blocks a plan stages in ``staging``, as they arrive (none when the
    ticket carries no digests)."""
    if not ticket.digests:
        return None
    view = memoryview(staging.data)
    return ArrivingChecksums(
        plan.staged, np.arange(plan.count, dtype=np.int64), lambda start, size: view[start : start + size]
    )


def _check_blocks(ticket: TransferTicket, check: ArrivingChecksums | None, picks: npt.NDArray[np.int64]) -> None:
    """Refuse the ticket's blocks ``picks`` when their checksums (``check``, if the ticket
    carries digests) differ from the ticket's digests.

    Raises:
        TransferError: the first block that differs, by its index in the ticket.
    """
    if check is not None:
        check_digests(check.digests(), picked_digests(ticket.digests, picks), picks, "block")
