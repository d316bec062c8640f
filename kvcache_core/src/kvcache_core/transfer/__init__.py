"""A request's KV cache between processes and machines, over NIXL (extra ``transfer``).

Disaggregated prefill and decode: a prompt is prefilled by one process and decoded by
another, which imports the request's blocks instead of recomputing them::

    # producer (prefill)
    agent = KvTransferAgent(manager)                  # NIXL agent + side channel on loopback
    ticket = agent.export(handle)                     # blocks pinned under a lease
    send(ticket.to_bytes())                           # or: the consumer calls fetch_ticket

    # consumer (decode)
    agent = KvTransferAgent(manager)
    handle = agent.import_request(TransferTicket.from_bytes(payload), AllocationRequest("r1"))

With transformers, the decode worker hands the imported request to
``kvcache_torch.hf.PagedCache(manager, model, handles=[handle])`` and ``generate`` goes on
from it without recomputing the prompt (``examples/disaggregated.py``).

Every kind of layer moves: each KV-cache group's blocks (a sliding group's from the first it
still holds), the request's recurrent states (its state slot: conv and SSM states) and layers
of their own geometry, in one NIXL read. Pools must agree on namespace (``model_id``), dtype,
block size and every layer (kind, window or chunk, KV heads and widths, state arrays), or the
import raises :class:`~kvcache_core.errors.TransferMismatchError` naming the first layer and
field that differ. Layouts may differ (converted on arrival, bit for bit); a pool of groups,
states or layers of their own geometry is imported into host memory only. Storages
claim ``"memory_regions"`` (NumPy, torch, memmap; not JAX), and state pools name their memory
(NumPy, torch). Every failure is a :class:`~kvcache_core.errors.TransferError` and leaks
nothing on either side.
Requires ``pip install "kvcache-core[transfer]"`` (NIXL, pyzmq, msgpack).
"""

from __future__ import annotations

from kvcache_core.transfer.agent import KvTransferAgent
from kvcache_core.transfer.engine import DEFAULT_UCX_TLS, nixl_unavailable_reason
from kvcache_core.transfer.leases import LEASE_PREFIX
from kvcache_core.transfer.ticket import TICKET_VERSION, RegionAddress, StateAddress, TransferTicket

__all__ = [
    "DEFAULT_UCX_TLS",
    "LEASE_PREFIX",
    "TICKET_VERSION",
    "KvTransferAgent",
    "RegionAddress",
    "StateAddress",
    "TransferTicket",
    "nixl_unavailable_reason",
]
