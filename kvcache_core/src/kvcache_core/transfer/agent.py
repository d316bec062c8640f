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
import itertools
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
    MemoryRegion,
    check_regions,
    host_form_from_parts,
    storage_regions,
)
from kvcache_core.errors import InvalidArgumentError, KvCacheError, TransferError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.transfer.channel import ChannelServer, ask
from kvcache_core.transfer.digests import (
    DIGEST_BYTES,
    Reader,
    block_checksums,
    block_digests,
    host_memory,
    pack_digests,
)
from kvcache_core.transfer.engine import NixlEngine
from kvcache_core.transfer.leases import LEASE_PREFIX, Leases
from kvcache_core.transfer.plan import read_plan
from kvcache_core.transfer.ticket import RegionAddress, TransferTicket

__all__ = ["KvTransferAgent"]

#: How long a consumer waits for the producer to take an acknowledgement.
_ACK_SECONDS: Final = 2.0
#: Transfers one import's read is split into, so that what arrived is checksummed while the
#: rest is in flight (the last piece's checksum is the only one not overlapped).
_READ_PIECES: Final = 8


class KvTransferAgent:
    """Moves requests' caches between the pool of ``manager`` and other processes' pools.

    Args:
        manager: the pool this agent exports from and imports into; its storage must claim
            ``"memory_regions"`` (NumPy, torch, memmap; not JAX, whose writes replace its
            buffers), with one KV-cache group, no sliding window and no recurrent-state layers.
        name: the NIXL agent name (unique among the agents that talk); default: a random one.
        host: the side channel's interface, loopback by default (``"0.0.0.0"`` binds every
            interface: only when asked).
        port: its port; 0 (default) picks a free one (:attr:`address` tells which).
        lease_seconds: how long an exported request stays pinned without an acknowledgement.
        timeout_seconds: the longest an import waits for the producer, all steps together.

    Raises:
        TransferError: NIXL or ZMQ is missing, the storage cannot name its memory, the pool has
            several KV-cache groups, a sliding window, recurrent-state layers or layers of mixed
            geometry, an argument is
            out of range, or the side channel cannot bind.
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
        config = manager.config
        if config.num_groups != 1 or config.sliding_window is not None:
            raise TransferError(
                "KvTransferAgent moves pools of one KV-cache group without a sliding window; this pool has "
                f"{config.num_groups} groups, sliding_window={config.sliding_window}"
            )
        if config.states.arrays:
            raise TransferError(
                f"KvTransferAgent does not move recurrent-state layers yet: this pool has {len(config.states.arrays)} "
                "state arrays (LayerSpec(state=...)); only attention K/V pools transfer"
            )
        if config.mixed_geometry:
            raise TransferError(
                "KvTransferAgent moves pools of one geometry for every layer (its tickets and host form hold one); "
                f"this pool's layers differ (LayerSpec geometry: layer 0 {config.layer_geometry(0)}, ...)"
            )
        regions = storage_regions(manager.storage)
        if regions is None:
            raise TransferError(
                f"the {manager.backend!r} storage does not claim {MEMORY_REGIONS!r} (no memory_regions()): a "
                "transfer cannot register its pool"
            )
        try:
            self._regions = check_regions(manager.storage.config, regions)
        except InvalidArgumentError as exc:
            raise TransferError(f"the {manager.backend!r} storage's memory regions are unusable: {exc}") from exc
        kinds = {region.device_kind for region in self._regions.values()}
        if len(kinds) != 1:
            raise TransferError(f"the pool's regions span several device kinds {sorted(kinds)}")
        self._manager = manager
        self._lease_seconds = float(lease_seconds)
        self._timeout_seconds = float(timeout_seconds)
        self._leases = Leases()
        self._held: set[str] = set()  # requests a read that could not be aborted may still write
        self._engine = NixlEngine(name if name is not None else f"kvcache-{uuid.uuid4().hex}")
        (kind,) = kinds
        chunks = [(region.address, region.length_bytes, region.device_id) for region in self._regions.values()]
        self._registered = self._engine.register(chunks, kind)
        self._metadata = self._engine.metadata()  # read once: the server thread never calls NIXL
        self._context: zmq.Context[Any] = zmq.Context()
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
            blocks = np.asarray(pinned.block_table().physical_blocks[:count], dtype=np.int64)
            digests = self._digests(blocks)
            self._leases.add(lease, pin, self._lease_seconds)
        except BaseException:
            manager.deallocate(pin)
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
        reply = ask(self._context, address, {"op": "export", "request_id": request_id}, deadline)
        payload = reply.get("ticket")
        if not isinstance(payload, bytes):
            raise TransferError(f"the agent at {address} answered export without a ticket")
        return TransferTicket.from_bytes(payload)

    def import_request(self, ticket: TransferTicket | bytes, request: AllocationRequest) -> PagedKvCacheHandle[Any]:
        """Allocate ``request`` and fill it with the ticket's request from the producer's pool.

        Blocks the local prefix cache already holds are mapped, not pulled; the others come
        in one NIXL READ (every layer, keys, values and scales), straight into the request's
        blocks when both pools have one layout (else into a staging buffer, converted on
        arrival), are checked against their checksums, and recorded as if computed here
        (prefix caching registers them). The producer's lease is then released.

        Args:
            ticket: a ticket (or its wire form) of a producer's :meth:`export`.
            request: the new request; its ``prompt_token_ids`` must be ``None`` (the ticket's
                tokens are used) or exactly the ticket's tokens.

        Returns:
            The request's handle, ``num_tokens() == ticket.num_tokens``.

        Raises:
            TransferError: a malformed ticket; another namespace, geometry or dtype; an
                expired or released lease; the producer gone or too slow; a failed read or a
                block whose digest differs; no room in the pool; a bad ``request``. The new
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
        reply = ask(self._context, parsed.address, {"op": "open", "lease": parsed.lease}, deadline)
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
        self._acknowledge(parsed)
        return handle

    def _fill(
        self, ticket: TransferTicket, source: CacheConfig, handle: PagedKvCacheHandle[Any], deadline: float
    ) -> None:
        manager = self._manager
        block_size = source.block_size
        cached = handle.num_tokens()
        length = ticket.num_tokens
        if cached >= length:
            return
        manager.extend(handle, length - cached, token_ids=ticket.token_ids[cached:].tolist())
        first = cached // block_size
        try:
            if self._reads_in_place(ticket):
                self._pull_in_place(ticket, source, handle, first, deadline)
                manager.record_blocks_written(handle, cached)
                return
            keys, values = self._pull(ticket, source, first, deadline)
        except TransferError:
            self._engine.forget_peer(ticket.agent)
            raise
        manager.write_host_blocks(handle, cached, keys, values)

    def _reads_in_place(self, ticket: TransferTicket) -> bool:
        """Whether the blocks can land in this pool's own memory: the same layout (nothing to
        convert) in host memory (their checksums are read in place)."""
        local = self._manager.storage.config.layout
        return ticket.layout == local and all(region.device_kind == "cpu" for region in self._regions.values())

    def _pull_in_place(
        self, ticket: TransferTicket, source: CacheConfig, handle: PagedKvCacheHandle[Any], first: int, deadline: float
    ) -> None:
        """Read ``ticket.blocks[first:]`` straight into the request's blocks from ``first`` on,
        through this pool's registered regions, and check their checksums there."""
        plan = read_plan(ticket, source, first)
        blocks = np.asarray(handle.block_table().physical_blocks[first : first + plan.count], dtype=np.int64)
        regions = [self._regions[(address.layer, address.part)] for address in ticket.regions]
        rows: list[npt.NDArray[np.int64]] = []
        for region in regions:
            starts = region.block_chunks(blocks)
            rows.append(
                np.stack(
                    [starts, np.full(len(starts), region.block_stride_bytes), np.full(len(starts), region.device_id)],
                    axis=1,
                )
            )
        local = np.concatenate(rows).astype(np.uint64)
        check = _Checksums(regions, blocks, host_memory) if ticket.digests else None
        failure, released = self._engine.read_into(
            ticket.agent,
            plan.remote,
            plan.device_kind,
            local,
            "cpu",
            deadline,
            pieces=check.piece_rows if check is not None else (),
            arrived=check.arrived if check is not None else None,
        )
        if not released:  # a read NIXL could not abort may still land: keep the blocks out of reuse
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
        if check is not None:
            _check_digests(check.digests(), ticket.digests[first * DIGEST_BYTES :], first)

    def _pull(
        self, ticket: TransferTicket, source: CacheConfig, first: int, deadline: float
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """The blocks ``ticket.blocks[first:]`` of the producer's pool, in host form."""
        plan = read_plan(ticket, source, first)
        staging = np.empty(plan.total_bytes, dtype=np.uint8)
        view = memoryview(staging.data)
        check = (
            _Checksums(
                plan.staged, np.arange(plan.count, dtype=np.int64), lambda start, size: view[start : start + size]
            )
            if ticket.digests
            else None
        )
        self._engine.read(
            ticket.agent,
            plan.remote,
            plan.device_kind,
            staging,
            plan.offsets,
            deadline,
            pieces=check.piece_rows if check is not None else (),
            arrived=check.arrived if check is not None else None,
        )
        if check is not None:
            _check_digests(check.digests(), ticket.digests[first * DIGEST_BYTES :], first)
        return host_form_from_parts(source, ticket.layout, plan.parts(staging))

    def _source_config(self, ticket: TransferTicket) -> CacheConfig:
        """The producer pool's config (this pool's, in its layout and size), once the ticket
        is found compatible."""
        config = self._manager.storage.config
        mine = {
            "num_layers": config.num_layers,
            "num_heads": config.num_heads,
            "head_dim": config.head_dim,
            "value_head_dim": config.value_width,
            "block_size": config.block_size,
        }
        theirs = {name: ticket.geometry[name] for name in mine}
        if ticket.namespace != self._manager.config.model_id:
            raise TransferError(
                f"the ticket's namespace {ticket.namespace!r} is not this pool's model_id {self._manager.config.model_id!r}"
            )
        if theirs != mine or ticket.dtype != config.dtype:
            raise TransferError(
                f"the ticket's geometry {theirs} and dtype {ticket.dtype!r} differ from this pool's {mine} and "
                f"{config.dtype!r}; a transfer converts layouts only"
            )
        try:
            return dataclasses.replace(config, num_blocks=ticket.geometry["num_blocks"], kv_layout=ticket.layout)
        except KvCacheError as exc:
            raise TransferError(f"the ticket's pool cannot be described here: {exc}") from exc

    @staticmethod
    def _request_for(ticket: TransferTicket, request: AllocationRequest) -> AllocationRequest:
        if not isinstance(request, AllocationRequest):
            raise TransferError(f"import_request needs an AllocationRequest, got {type(request).__name__}")
        ids = tuple(int(token) for token in ticket.token_ids)
        if request.prompt_token_ids is None:
            return dataclasses.replace(request, prompt_token_ids=ids)
        if tuple(request.prompt_token_ids) != ids:
            raise TransferError(
                f"request {request.request_id!r} has a prompt of {len(request.prompt_token_ids)} tokens that is not "
                f"the ticket's {len(ids)} tokens; leave prompt_token_ids unset"
            )
        return request

    def _acknowledge(self, ticket: TransferTicket) -> None:
        """Release the producer's lease (best effort: unacknowledged, it expires)."""
        try:
            ask(
                self._context, ticket.address, {"op": "release", "lease": ticket.lease}, time.monotonic() + _ACK_SECONDS
            )
        except TransferError as exc:
            warnings.warn(
                f"the producer did not take the acknowledgement; its lease will expire: {exc}",
                RuntimeWarning,
                stacklevel=3,
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
        self._context.term()

    def __enter__(self) -> KvTransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Checksums:
    """The digests of blocks read region after region, computed as the read arrives: the
    regions are split into a few pieces of about equal bytes, each read by a transfer of its
    own, and a piece is checksummed while the later ones are still in flight."""

    def __init__(self, regions: Sequence[MemoryRegion], blocks: npt.NDArray[np.int64], read: Reader) -> None:
        self._blocks, self._read = blocks, read
        sizes = [region.chunks_per_block * region.block_stride_bytes for region in regions]
        pieces = min(_READ_PIECES, len(regions))
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


def _check_digests(got: bytes, expected: bytes, first: int) -> None:
    """Refuse blocks whose digests differ from the ticket's (the first of them named)."""
    if got == expected:
        return
    bad = next(
        index
        for index in range(len(got) // DIGEST_BYTES)
        if got[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]
        != expected[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]
    )
    raise TransferError(f"block {first + bad} of the ticket arrived different from what was exported (digest mismatch)")


def _known_ids(handle: KvCacheHandle[Any]) -> tuple[int, ...]:
    token_ids = getattr(handle, "token_ids", None)
    if not callable(token_ids):
        raise TransferError(f"cannot read the token ids of {type(handle).__name__}: pass token_ids=")
    known = cast("tuple[int, ...]", token_ids())
    return known
