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

Pools must agree on namespace (``model_id``), geometry and dtype; layouts may differ.
Storages claim ``"memory_regions"`` (NumPy, torch, memmap; not JAX). Every failure is a
:class:`~kvcache_core.errors.TransferError` and leaks nothing on either side.
Requires ``pip install "kvcache-core[transfer]"`` (NIXL, pyzmq, msgpack).
"""

from __future__ import annotations

from kvcache_core.transfer.agent import KvTransferAgent
from kvcache_core.transfer.engine import DEFAULT_UCX_TLS, nixl_unavailable_reason
from kvcache_core.transfer.leases import LEASE_PREFIX
from kvcache_core.transfer.ticket import TICKET_VERSION, RegionAddress, TransferTicket

__all__ = [
    "DEFAULT_UCX_TLS",
    "LEASE_PREFIX",
    "TICKET_VERSION",
    "KvTransferAgent",
    "RegionAddress",
    "TransferTicket",
    "nixl_unavailable_reason",
]
