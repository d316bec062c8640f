"""The transfer agent: a request's KV cache from one process's pool into another's, over NIXL.

Producer: :meth:`KvTransferAgent.export` pins the request's blocks under a lease and returns a
:class:`~kvcache_core.transfer.ticket.TransferTicket`. Consumer: :meth:`KvTransferAgent.import_request`
allocates the request, pulls every layer's blocks with one NIXL READ, checks each block's
digest, and hands them to its manager as if computed there (prefix caching registers them).
Agents talk over a ZMQ side channel (:mod:`kvcache_core.transfer.channel`): the consumer
checks the lease and learns the producer's NIXL metadata before reading, and releases the
lease after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt
import zmq

from kvcache_core.contract.config import AllocationRequest, CacheConfig, check_token_ids
from kvcache_core.contract.protocols import KvCacheHandle
from kvcache_core.contract.regions import (
    MEMORY_REGIONS,
    check_regions,
    storage_regions,
)
from kvcache_core.errors import KvCacheError, TransferError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.transfer.channel import ChannelServer, Requests
from kvcache_core.transfer.digests import block_digests, host_memory
from kvcache_core.transfer.engine import NixlEngine
from kvcache_core.transfer.leases import LEASE_PREFIX, Leases
from kvcache_core.transfer.pool_description import describe_layers, source_config, state_addresses
from kvcache_core.transfer.reads import ImportReads
from kvcache_core.transfer.ticket import RegionAddress, TransferTicket

__all__ = ["KvTransferAgent"]

#: How long a consumer waits for the producer to take an acknowledgement.
_ACK_SECONDS: Final = 2.0


class KvTransferAgent:
    """Moves requests' caches between the pool of ``manager`` and other processes' pools.

    Args:
        manager: the pool this agent exports from and imports into; its storage must claim
            ``"memory_regions"`` (NumPy, torch, memmap; not JAX, whose writes replace its
            buffers), and its state pool name its memory when it has state layers. Any pool
            moves: KV-cache groups (sliding windows), recurrent-state layers, layers of their
            own geometry, in any layout (converted on arrival); such a pool is imported
            into host memory only (a pool of one group and geometry without states into
            device memory too).
        name: the NIXL agent name (unique among the agents that talk); default: a random one.
        host: the side channel's interface, loopback by default (``"0.0.0.0"`` binds every
            interface: only when asked).
        port: its port; 0 (default) picks a free one (:attr:`address` tells which).
        lease_seconds: how long an exported request stays pinned without an acknowledgement.
        timeout_seconds: the longest an import waits for the producer, all steps together.

    Raises:
        TransferError: NIXL or ZMQ is missing, the storage or state pool cannot name its
            memory, an argument is out of range, or the side channel cannot bind.
    """

    def __init__(
        self,
        manager: PagedKvCacheManager[Any],
        *,
        name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_seconds: float = 30.0,
        timeout_seconds: float = 10.0,
    ) -> None:
        if not isinstance(manager, PagedKvCacheManager):
            raise TransferError(f"KvTransferAgent needs a PagedKvCacheManager, got {type(manager).__name__}")
        for label, seconds in (("lease_seconds", lease_seconds), ("timeout_seconds", timeout_seconds)):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 86400:
                raise TransferError(f"{label} must be a number in (0, 86400], got {seconds!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise TransferError(f"port must be an int in [0, 65535], got {port!r}")
        regions = storage_regions(manager.storage)
        if regions is None:
            raise TransferError(
                f"the {manager.backend!r} storage does not claim {MEMORY_REGIONS!r} (no memory_regions()): a "
                "transfer cannot register its pool"
            )
        try:
            self._regions = check_regions(manager.storage.config, regions)
            state_pool = manager.state_regions()
        except KvCacheError as exc:
            raise TransferError(f"the {manager.backend!r} storage's memory regions are unusable: {exc}") from exc
        kinds = {region.device_kind for region in (*self._regions.values(), *state_pool)}
        if len(kinds) != 1:
            raise TransferError(f"the pool's regions span several device kinds {sorted(kinds)}")
        self._manager = manager
        self._lease_seconds = float(lease_seconds)
        self._timeout_seconds = float(timeout_seconds)
        self._leases = Leases()
        self._held: set[str] = set()  # requests a read that could not be aborted may still write
        self._engine = NixlEngine(name if name is not None else f"kvcache-{uuid.uuid4().hex}")
        (kind,) = kinds
        self._kind: str = kind
        self._layout: str = manager.storage.config.layout
        chunks = [
            (region.address, region.length_bytes, region.device_id) for region in (*self._regions.values(), *state_pool)
        ]
        self._registered = self._engine.register(chunks, kind)
        self._reads = ImportReads(self._engine, manager, self._regions, self._layout, self._held)
        self._metadata = self._engine.metadata()  # read once: the server thread never calls NIXL
        self._context: zmq.Context[Any] = zmq.Context()
        self._requests = Requests(self._context)
        try:
            self._server = ChannelServer(
                self._context, host, port, self._answer, self._expire, min(0.05, self._lease_seconds / 4)
            )
        except BaseException:
            self._engine.deregister(self._registered)
            self._context.term()
            raise
        self._closed = False

    # -- figures ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The NIXL agent name."""
        return self._engine.name

    @property
    def address(self) -> str:
        """The side channel, ``"tcp://host:port"``."""
        return self._server.address

    @property
    def lease_count(self) -> int:
        """Exported requests still pinned."""
        return len(self._leases)

    # -- producer --------------------------------------------------------------------------

    def export(self, handle: KvCacheHandle[Any], *, token_ids: Sequence[int] | None = None) -> TransferTicket:
        """Pin the request's blocks under a lease and describe them in a ticket.

        The blocks stay pinned (not evicted, reused or rewritten) until a consumer imports
        them (it releases the lease) or ``lease_seconds`` pass; then they are released (those
        the prefix cache holds stay cached). The request itself may go on (a write into a
        pinned block copies it first) or be deallocated.

        Args:
            handle: a resident request of this agent's manager with at least one token.
            token_ids: its tokens (``[num_tokens()]``); default: the ids it was given.

        Raises:
            TransferError: the handle is not a live resident request of this manager, it is
                empty, its token ids are not all known, or the agent is closed.
        """
        self._check_open()
        manager = self._manager
        try:
            length = handle.num_tokens()
            known = token_ids if token_ids is not None else _known_ids(handle)
            ids = check_token_ids(known, "token_ids")
        except KvCacheError as exc:
            raise TransferError(f"cannot export: {exc}") from exc
        if length == 0 or len(ids) != length:
            raise TransferError(
                f"cannot export a request of {length} tokens with {len(ids)} token ids: pass token_ids= "
                "(one per token) or give them to allocate/extend"
            )
        lease = uuid.uuid4().hex
        pin = LEASE_PREFIX + lease
        try:
            pinned = manager.fork(handle, pin)
        except KvCacheError as exc:
            raise TransferError(f"cannot export: {exc}") from exc
        try:
            count = math.ceil(length / manager.config.block_size)
            tables = pinned.block_tables()
            groups = tuple((table.first_logical, count - table.first_logical) for table in tables)
            blocks = np.concatenate(
                [
                    np.asarray(table.physical_blocks[:held], dtype=np.int64)
                    for table, (_, held) in zip(tables, groups, strict=True)
                ]
            )
            digests = self._digests(blocks)
            slot = manager.state_regions(pinned)
            state_digests = (
                b"".join(block_digests([region], np.zeros(1, dtype=np.int64), host_memory) for region in slot)
                if all(region.device_kind == "cpu" for region in slot)
                else b""
            )
            self._leases.add(lease, pin, self._lease_seconds)
        except BaseException as exc:
            manager.deallocate(pin)
            if isinstance(exc, KvCacheError) and not isinstance(exc, TransferError):
                raise TransferError(f"cannot export: {exc}") from exc
            raise
        config = manager.storage.config
        return TransferTicket(
            agent=self.name,
            address=self.address,
            namespace=manager.config.model_id,
            geometry={
                "num_layers": config.num_layers,
                "num_heads": config.num_heads,
                "head_dim": config.head_dim,
                "value_head_dim": config.value_width,
                "block_size": config.block_size,
                "num_blocks": config.num_blocks,
            },
            dtype=config.dtype,
            layout=config.layout,
            regions=tuple(
                RegionAddress(r.layer, r.part, r.address, r.device_kind, r.device_id) for r in self._regions.values()
            ),
            blocks=blocks,
            token_ids=np.asarray(ids, dtype=np.int64),
            digests=digests,
            lease=lease,
            expires_at=time.time() + self._lease_seconds,
            layers=describe_layers(manager.config),
            groups=groups,
            states=state_addresses(manager.config, slot),
            state_digests=state_digests,
        )

    def _digests(self, blocks: npt.NDArray[np.int64]) -> bytes:
        """The blocks' digests, read in place (none for device memory: it is checked by
        NIXL's transport only)."""
        regions = list(self._regions.values())
        if any(region.device_kind != "cpu" for region in regions):
            return b""
        return block_digests(regions, blocks, host_memory)

    def release(self, lease: str) -> bool:
        """End a lease now (a consumer's acknowledgement does this); whether it was live."""
        pin = self._leases.take(lease)
        if pin is None:
            return False
        self._unpin(pin)
        return True

    def _unpin(self, pin: str) -> None:
        with contextlib.suppress(KvCacheError):  # the manager closed or the fork went already: nothing is pinned
            self._manager.deallocate(pin)

    def _expire(self) -> None:
        for pin in self._leases.take_expired():
            self._unpin(pin)

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        """A side-channel request's reply (runs in the server thread)."""
        op, lease = message.get("op"), message.get("lease")
        if op == "open" and isinstance(lease, str):
            if not self._leases.alive(lease):
                return {"ok": False, "error": f"lease {lease[:64]!r} expired or was released"}
            return {"ok": True, "agent": self.name, "metadata": self._metadata}
        if op == "release" and isinstance(lease, str):
            return {"ok": True, "was_alive": self.release(lease)}
        if op == "export" and isinstance(message.get("request_id"), str):
            handle = self._manager.get_handle(message["request_id"])
            if handle is None:
                return {"ok": False, "error": f"no live request {message['request_id'][:200]!r}"}
            return {"ok": True, "ticket": self.export(handle).to_bytes()}
        return {"ok": False, "error": f"unknown request {str(op)[:64]!r}"}

    # -- consumer --------------------------------------------------------------------------

    def fetch_ticket(self, address: str, request_id: str) -> TransferTicket:
        """Ask the agent at ``address`` to export its request ``request_id``; its ticket.

        Raises:
            TransferError: no answer in ``timeout_seconds``, no such request there, or a
                malformed ticket.
        """
        self._check_open()
        deadline = time.monotonic() + self._timeout_seconds
        reply = self._requests.ask(address, {"op": "export", "request_id": request_id}, deadline)
        payload = reply.get("ticket")
        if not isinstance(payload, bytes):
            raise TransferError(f"the agent at {address} answered export without a ticket")
        return TransferTicket.from_bytes(payload)

    def import_request(self, ticket: TransferTicket | bytes, request: AllocationRequest) -> PagedKvCacheHandle[Any]:
        """Allocate ``request`` and fill it with the ticket's request from the producer's pool.

        Blocks the local prefix cache already holds are mapped, not pulled; the others (of
        every KV-cache group: a sliding group's from the first block it holds) and the
        request's states come in one NIXL READ (every layer, keys, values and scales), straight
        into the request's blocks and state slot when both pools have one layout (else the
        blocks into a staging buffer, converted on arrival into this pool's layout: any pool in
        host memory, one of one group and geometry without states in device memory), are
        checked against their checksums, and recorded as if computed here
        (prefix caching registers them; a request of state layers that ends a block files its
        states as the checkpoint there, so later prompts sharing it are served). The
        producer's lease is then released.

        Args:
            ticket: a ticket (or its wire form) of a producer's :meth:`export`.
            request: the new request; its ``prompt_token_ids`` must be ``None`` (the ticket's
                tokens are used) or exactly the ticket's tokens.

        Returns:
            The request's handle, ``num_tokens() == ticket.num_tokens``.

        Raises:
            TransferMismatchError: another namespace, dtype or block size, or a layer or state
                array of another kind or shape (the first one named, with both values).
            TransferError: a malformed ticket; an expired or released lease; the producer gone or
                too slow; a failed read or a block whose digest differs; no room in the pool; a
                bad ``request``; a pool of groups, states or mixed geometry in device memory. The new
                request is released (nothing leaks); other requests are untouched.
        """
        self._check_open()
        parsed = ticket if isinstance(ticket, TransferTicket) else TransferTicket.from_bytes(ticket)
        manager = self._manager
        source = self._source_config(parsed)
        request = self._request_for(parsed, request)
        deadline = time.monotonic() + self._timeout_seconds
        if parsed.expires_at <= time.time():
            raise TransferError(f"the lease of the ticket expired at {parsed.expires_at:.3f} (Unix time)")
        # A known producer is not asked first when the blocks carry digests: the lease is
        # confirmed alive after the read instead (by its release), before anything is recorded.
        if not (self._engine.knows(parsed.agent) and parsed.digests):
            reply = self._requests.ask(parsed.address, {"op": "open", "lease": parsed.lease}, deadline)
            metadata = reply.get("metadata")
            if not isinstance(metadata, bytes):
                raise TransferError(f"the agent at {parsed.address} sent no NIXL metadata")
            if not self._engine.knows(parsed.agent) and self._engine.add_peer(metadata) != parsed.agent:
                raise TransferError(f"the agent at {parsed.address} is not the ticket's agent {parsed.agent!r}")
        try:
            handle = manager.allocate(request)
        except KvCacheError as exc:
            raise TransferError(f"cannot import into this pool: {exc}") from exc
        try:
            self._fill(parsed, source, handle, deadline)
        except BaseException as exc:
            if request.request_id not in self._held:
                with contextlib.suppress(KvCacheError):  # closed meanwhile: nothing is held
                    manager.deallocate(request.request_id)
            if isinstance(exc, TransferError) or not isinstance(exc, Exception):
                raise
            raise TransferError(f"cannot import into this pool: {exc}") from exc
        return handle

    def _fill(
        self, ticket: TransferTicket, source: CacheConfig, handle: PagedKvCacheHandle[Any], deadline: float
    ) -> None:
        manager = self._manager
        block_size = source.block_size
        cached = handle.num_tokens()
        length = ticket.num_tokens
        if cached >= length:  # every block is cached here; the states are the request's own
            if ticket.states:
                self._check_host_memory(ticket)
                self._reads.in_place(ticket, source, handle, math.ceil(length / block_size), deadline)
            self._release(ticket)
            return
        ids = ticket.token_ids.tolist()
        if length - cached > 1 and any(group.window is not None for group in manager.config.kv_groups):
            # Grown to its last token apart, then by it: a sliding group releases the blocks
            # its window no longer sees, as the producer's did, rather than holding them unread.
            manager.extend(handle, length - cached - 1, token_ids=ids[cached:-1])
            manager.extend(handle, 1, token_ids=ids[-1:])
        else:
            manager.extend(handle, length - cached, token_ids=ids[cached:])
        first = cached // block_size
        try:
            if not _plain(manager.config) or self._kind == "cpu":
                self._check_host_memory(ticket)
                if ticket.layout == self._layout:
                    self._reads.in_place(ticket, source, handle, first, deadline)
                else:
                    self._reads.converted(ticket, source, handle, first, deadline)
                self._release(ticket)
                manager.record_blocks_written(handle, cached, states=bool(ticket.states))
                return
            keys, values = self._reads.staged(ticket, source, first, deadline)
        except TransferError:
            self._engine.forget_peer(ticket.agent)
            raise
        self._release(ticket)
        manager.write_host_blocks(handle, cached, keys, values)

    def _check_host_memory(self, ticket: TransferTicket) -> None:
        """Refuse to read a pool with KV-cache groups, states or layers of their own geometry
        into device memory: what arrives there is written and checked in place, in host memory
        only (a plain pool's blocks go through the storage's host writes instead).

        Raises:
            TransferError: this pool is not in host memory.
        """
        if self._kind != "cpu":
            raise TransferError(
                "a pool with KV-cache groups, recurrent-state layers or layers of their own geometry takes a transfer "
                f"in host memory only (the ticket's {ticket.layout!r} pool on {ticket.regions[0].device_kind!r}, this "
                f"pool's {self._layout!r} on {self._kind!r})"
            )

    def _source_config(self, ticket: TransferTicket) -> CacheConfig:
        """The producer pool's config (this pool's, in its layout and size), once the ticket
        is found compatible."""
        return source_config(ticket, self._manager.config, self._manager.storage.config)

    @staticmethod
    def _request_for(ticket: TransferTicket, request: AllocationRequest) -> AllocationRequest:
        if not isinstance(request, AllocationRequest):
            raise TransferError(f"import_request needs an AllocationRequest, got {type(request).__name__}")
        ids = tuple(ticket.token_ids.tolist())
        if request.prompt_token_ids is None:
            return dataclasses.replace(request, prompt_token_ids=ids)
        if tuple(request.prompt_token_ids) != ids:
            raise TransferError(
                f"request {request.request_id!r} has a prompt of {len(request.prompt_token_ids)} tokens that is not "
                f"the ticket's {len(ids)} tokens; leave prompt_token_ids unset"
            )
        return request

    def _release(self, ticket: TransferTicket) -> None:
        """Release the producer's lease once the read is over, and refuse what was read if
        the lease had ended before (its blocks may have been reused meanwhile). A producer
        that does not answer is warned about (unacknowledged, its lease expires): what was
        read was checked against its digests or, without them, the lease when it began.

        Raises:
            TransferError: the lease had expired or been released.
        """
        try:
            reply = self._requests.ask(
                ticket.address, {"op": "release", "lease": ticket.lease}, time.monotonic() + _ACK_SECONDS
            )
        except TransferError as exc:
            warnings.warn(
                f"the producer did not take the acknowledgement; its lease will expire: {exc}",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        if reply.get("was_alive") is False:
            raise TransferError(
                f"the lease {ticket.lease!r} of the ticket expired or was released before the read ended: its blocks "
                "may have been reused, nothing is kept"
            )

    # -- life --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the transfer agent is closed")

    def close(self) -> None:
        """Stop the side channel, release every lease, unregister the pool (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        for pin in self._leases.take_all():
            self._unpin(pin)
        self._engine.deregister(self._registered)
        self._requests.close()
        self._context.term()

    def __enter__(self) -> KvTransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _plain(config: CacheConfig) -> bool:
    """Whether a pool is of one group and geometry without states (host writes take it)."""
    return (
        config.num_groups == 1
        and config.sliding_window is None
        and not config.states.arrays
        and not config.mixed_geometry
    )


def _known_ids(handle: KvCacheHandle[Any]) -> tuple[int, ...]:
    token_ids = getattr(handle, "token_ids", None)
    if not callable(token_ids):
        raise TransferError(f"cannot read the token ids of {type(handle).__name__}: pass token_ids=")
    known = cast("tuple[int, ...]", token_ids())
    return known
