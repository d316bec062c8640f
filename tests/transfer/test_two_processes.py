"""A request's cache moves between two processes on 127.0.0.1 over NIXL (UCX over TCP): the
producer runs in a process of its own (tests/transfer/support.py), the consumer here."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest
from kvcache_core.errors import TransferError
from tests.transfer.support import (
    gathers,
    host_blocks,
    kv_gathers,
    make_pool,
    needs_transfer,
    producer,
    state_bytes,
    wait_for,
)

pytestmark = [needs_transfer, pytest.mark.xdist_group("transfer")]


def _import(spec: dict[str, Any], **agent_options: Any) -> tuple[Any, Any]:
    """A consumer: a pool of ``spec`` and its agent."""
    from kvcache_core.transfer import KvTransferAgent

    manager = make_pool(spec)
    return manager, KvTransferAgent(manager, **agent_options)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ({"backend": "numpy", "layout": "NHD"}, {"backend": "numpy", "layout": "heads_first"}),
        ({"backend": "torch", "layout": "heads_first"}, {"backend": "torch", "layout": "HND"}),
    ],
    ids=["numpy NHD -> numpy heads_first", "torch heads_first -> torch HND"],
)
def test_an_imported_request_gathers_bit_exact_across_processes_and_layouts(
    tmp_path: Path, source: dict[str, Any], target: dict[str, Any]
) -> None:
    with producer({**source, "tokens": 23}, tmp_path) as peer:
        manager, agent = _import(target)
        with manager, agent:
            handle = agent.import_request(peer.ticket, AllocationRequest("imported"))
            expected = peer.expected()
            assert handle.num_tokens() == 23
            for index, got in enumerate(gathers(manager, handle)):
                assert got.tobytes() == expected[f"gather{index}"].tobytes(), f"gather {index} differs"
            manager.check_invariants()
            wait_for(lambda: peer.command("status")["leases"] == 0, 10, "the producer to take the acknowledgement")


#: Sliding layers (window 6) between full ones: two KV-cache groups of 2 layers.
GROUPED = {"layers": [{"window": 6}, {}, {"window": 6}, {}], "steps": [14, 5, 4], "num_blocks": 48}
#: A Mamba-like state layer, a hybrid layer (K/V and a state), an attention layer.
WITH_STATES = {
    "layers": [
        {"state": [["conv", [6, 3], "float32"], ["ssm", [2, 4, 5], "float16"]]},
        {"state": [["conv", [6, 3], "float32"]], "keeps_kv": True},
        {},
    ],
    "state_slots": 4,
    "steps": [9, 8],
}


@pytest.mark.parametrize(
    ("spec", "backends"),
    [(GROUPED, ("numpy", "torch")), (GROUPED, ("torch", "numpy")), (WITH_STATES, ("numpy", "torch"))],
    ids=["grouped numpy -> torch", "grouped torch -> numpy", "states numpy -> torch"],
)
def test_groups_and_states_arrive_bit_exact(tmp_path: Path, spec: dict[str, Any], backends: tuple[str, str]) -> None:
    source, target = ({**spec, "backend": backend, "layout": "NHD"} for backend in backends)
    with producer(source, tmp_path) as peer:
        manager, agent = _import(target)
        with manager, agent:
            handle = agent.import_request(peer.ticket, AllocationRequest("imported"))
            assert handle.num_tokens() == sum(spec["steps"])
            expected = peer.expected()
            for name, got in kv_gathers(manager, handle).items():
                # A sliding layer holds the positions its window sees: the producer's tail.
                want = expected[name][len(expected[name]) - len(got) :]
                assert got.tobytes() == want.tobytes(), f"{name} differs"
            for index, got_state in enumerate(state_bytes(manager, handle)):
                assert got_state == expected[f"state{index}"].tobytes(), f"state array {index} differs"
            manager.check_invariants()
            wait_for(lambda: peer.command("status")["leases"] == 0, 10, "the producer to take the acknowledgement")


def test_a_consumer_of_other_layer_kinds_refuses_by_name_and_keeps_nothing(tmp_path: Path) -> None:
    from kvcache_core.errors import TransferMismatchError

    with producer({**GROUPED, "layout": "NHD"}, tmp_path) as peer:
        other = {**GROUPED, "layout": "NHD", "layers": [{"window": 6}, {}, {"window": 8}, {}]}
        manager, agent = _import(other)
        with manager, agent:
            with pytest.raises(TransferMismatchError, match=r"layer 2 differs: window 6 .* 8"):
                agent.import_request(peer.ticket, AllocationRequest("imported"))
            assert manager.list_handles() == []
            assert manager.stats().used_blocks == 0
            manager.check_invariants()


def test_a_quantized_pool_arrives_with_its_scales(tmp_path: Path) -> None:
    source = {"backend": "torch", "layout": "NHD", "dtype": "int8", "tokens": 21}
    with producer(source, tmp_path) as peer:
        manager, agent = _import({"backend": "numpy", "layout": "heads_first", "dtype": "int8"})
        with manager, agent:
            handle = agent.import_request(peer.ticket, AllocationRequest("imported"))
            keys, values = host_blocks(manager, handle)
            expected = peer.expected()
            assert keys.tobytes() == expected["keys"].tobytes()
            assert values.tobytes() == expected["values"].tobytes()


def test_an_imported_request_serves_later_prompts_from_the_prefix_cache(tmp_path: Path) -> None:
    with producer({"tokens": 16}, tmp_path) as peer:
        manager, agent = _import({"layout": "HND"})
        with manager, agent:
            imported = agent.import_request(peer.ticket, AllocationRequest("imported"))
            again = manager.allocate(AllocationRequest("again", prompt_token_ids=(*imported.token_ids(), 1)))
            assert again.num_cached_tokens() == 16


def test_a_producer_killed_mid_transfer_costs_the_consumer_a_transfer_error_and_nothing_else(tmp_path: Path) -> None:
    # About 50 MiB of blocks: the read runs long enough for the kill to land inside it.
    big = {"num_layers": 4, "num_heads": 8, "head_dim": 128, "block_size": 16, "num_blocks": 800, "layout": "NHD"}
    with producer({**big, "tokens": 790 * 16, "expected": False}, tmp_path) as peer:
        manager, agent = _import(big, timeout_seconds=20.0)
        with manager, agent:
            other = manager.allocate(AllocationRequest("other", prompt_token_ids=[1, 2, 3]))
            manager.extend(other, 3)
            before = manager.stats()
            outcome: list[BaseException | None] = []

            def consume() -> None:
                try:
                    agent.import_request(peer.ticket, AllocationRequest("imported"))
                    outcome.append(None)
                except BaseException as exc:  # the test asserts on it
                    outcome.append(exc)

            worker = threading.Thread(target=consume)
            started = time.monotonic()
            worker.start()
            wait_for(lambda: manager.get_handle("imported") is not None or outcome, 20, "the import to allocate")
            peer.process.kill()
            worker.join(timeout=30)
            assert not worker.is_alive()
            assert len(outcome) == 1, outcome
            assert isinstance(outcome[0], TransferError), outcome
            assert time.monotonic() - started < 20 + 5
            manager.check_invariants()
            assert manager.get_handle("imported") is None
            assert [rid for rid, _ in manager.list_handles()] == ["other"]
            after = manager.stats()
            assert (after.used_blocks, after.free_blocks) == (before.used_blocks, before.free_blocks)


def test_a_lease_nobody_acknowledges_releases_the_pinned_blocks_when_it_expires(tmp_path: Path) -> None:
    with producer({"tokens": 18, "lease_seconds": 0.5}, tmp_path) as peer:
        assert peer.command("drop") == {"dropped": True}
        pinned = peer.command("status")
        assert pinned["leases"] == 1
        assert pinned["used_blocks"] == 5
        wait_for(lambda: peer.command("status")["leases"] == 0, 10, "the lease to expire")
        released = peer.command("status")
        assert released["used_blocks"] == 0
        assert released["audit"] == "ok"
        assert released["cached_blocks"] == 4  # the full blocks stay as ordinary cached blocks


def test_a_ticket_whose_lease_expired_is_refused_and_nothing_is_allocated(tmp_path: Path) -> None:
    with producer({"tokens": 18, "lease_seconds": 0.5}, tmp_path) as peer:
        wait_for(lambda: peer.command("status")["leases"] == 0, 10, "the lease to expire")
        manager, agent = _import({})
        with manager, agent:
            with pytest.raises(TransferError, match="expired"):
                agent.import_request(peer.ticket, AllocationRequest("imported"))
            assert manager.list_handles() == []
            assert manager.stats().used_blocks == 0
            manager.check_invariants()


def test_a_consumer_fetches_the_ticket_over_the_side_channel(tmp_path: Path) -> None:
    with producer({"tokens": 9}, tmp_path) as peer:
        from kvcache_core.transfer import TransferTicket

        address = TransferTicket.from_bytes(peer.ticket).address
        manager, agent = _import({})
        with manager, agent:
            ticket = agent.fetch_ticket(address, "r")
            handle = agent.import_request(ticket, AllocationRequest("imported"))
            keys, _ = host_blocks(manager, handle)
            assert keys.tobytes() == peer.expected()["keys"].tobytes()
            with pytest.raises(TransferError, match="no live request"):
                agent.fetch_ticket(address, "missing")
            assert np.array_equal(np.asarray(handle.token_ids()), ticket.token_ids)
