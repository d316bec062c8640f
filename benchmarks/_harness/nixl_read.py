"""The raw NIXL figure a transfer is compared with: a bare NIXL READ of a ticket's chunks into
a staging buffer, with no allocation, checksum, conversion or registration of the blocks.
Needs the ``transfer`` extra (NIXL, pyzmq); imported by name."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import zmq

from kvcache_core import CacheConfig
from kvcache_core.errors import TransferError
from kvcache_core.transfer import TransferTicket
from kvcache_core.transfer.channel import Requests
from kvcache_core.transfer.engine import NixlEngine
from kvcache_core.transfer.plan import read_plan

__all__ = ["RawReader"]


class RawReader:
    """A bare NIXL agent reading a ticket's chunks (of a pool of ``source``'s geometry, in the
    ticket's layout and size) into a staging buffer, nothing more; it releases the lease after."""

    def __init__(self, source: CacheConfig) -> None:
        self._engine = NixlEngine(f"raw-reader-{time.monotonic_ns()}")
        self._context: zmq.Context[Any] = zmq.Context()
        self._requests = Requests(self._context)  # one connection per producer, as an agent keeps
        self._source = source

    def read(self, ticket: TransferTicket) -> dict[tuple[int, str], Any]:
        """The ticket's blocks, per ``(layer, part)`` region, as the producer's pool holds them."""
        deadline = time.monotonic() + 60
        if not self._engine.knows(ticket.agent):
            reply = self._requests.ask(ticket.address, {"op": "open", "lease": ticket.lease}, deadline)
            self._engine.add_peer(reply["metadata"])
        producer = dataclasses.replace(
            self._source, kv_layout=ticket.layout, num_blocks=int(ticket.geometry["num_blocks"])
        )
        plan = read_plan(ticket, producer, np.arange(len(ticket.blocks), dtype=np.int64))
        staging = np.empty(plan.total_bytes, dtype=np.uint8)
        failure, _ = self._engine.read_staged(
            ticket.agent, plan.remote, plan.device_kind, staging, plan.offsets, deadline
        )
        if failure is not None:
            raise TransferError(failure)
        self._requests.ask(ticket.address, {"op": "release", "lease": ticket.lease}, deadline)
        return plan.parts(staging)

    def close(self) -> None:
        self._requests.close()
        self._context.term()
