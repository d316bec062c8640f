"""The transfer agent's refusals and rules, with producer and consumer in this one process
(NIXL over UCX's TCP transport on loopback all the same)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, cast

import msgpack
import numpy as np
import pytest

from kvcache_core import AllocationRequest, PagedKvCacheManager
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.errors import OutOfBlocksError, TransferError, TransferMismatchError
from tests.transfer.support import (
    host_blocks,
    kv_gathers,
    make_pool,
    needs_transfer,
    prefill,
    prefill_steps,
    prompt_of,
    state_bytes,
)

pytestmark = [needs_transfer, pytest.mark.xdist_group("transfer")]


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any, Any, Any]]:
    """A producer (NHD pool, request ``"r"`` of 18 tokens) and a consumer (heads_first)."""
    from kvcache_core.transfer import KvTransferAgent

    source, target = make_pool({"layout": "NHD"}), make_pool({"layout": "heads_first"})
    prefill(source, "r", 18)
    # A minute to import (the default is 10 s): on a loaded 2-core machine (workers compiling
    # the kernel), a loopback read of a few blocks once missed 10 s.
    with (
        source,
        target,
        KvTransferAgent(source) as producer,
        KvTransferAgent(target, timeout_seconds=60.0) as consumer,
    ):
        yield source, producer, target, consumer


def _assert_untouched(manager: Any) -> None:
    manager.check_invariants()
    assert manager.list_handles() == []
    assert manager.stats().used_blocks == 0


def test_a_ticket_survives_its_wire_form(pair: tuple[Any, Any, Any, Any]) -> None:
    from kvcache_core.transfer import TransferTicket

    source, producer, _, _ = pair
    ticket = producer.export(source.get_handle("r"))
    again = TransferTicket.from_bytes(ticket.to_bytes())
    assert again.to_bytes() == ticket.to_bytes()
    assert again.num_tokens == 18
    assert list(again.token_ids) == prompt_of(18)


def _mutated(fields: dict[str, Any], change: str) -> dict[str, Any]:
    """``fields`` (a ticket's decoded wire form) with one defect."""
    changed: dict[str, Any] = {**fields, "geometry": dict(fields["geometry"])}
    if change == "geometry":
        del changed["geometry"]["num_heads"]
    elif change == "version 2":
        changed["version"] = 2
    else:
        value: Any = {
            "extra": 1,
            "version": 1,
            "num_tokens": True,
            "groups": [[0, 99]],
            "layers": [[None, None, "yes", 2, 8, 8]] * 2,
            "states": [[0, "conv", "float128", [4], 4096, "cpu", 0]],
            "state_digests": b"\x00",
            "token_ids": fields["token_ids"][:-8],
            "address": "tcp://*:5555",
            "blocks": np.full(5, 10**6, "<i8").tobytes(),
            "expires_at": float("nan"),
        }[change]
        changed[change] = value
    return changed


_packb = cast("Callable[..., bytes]", msgpack.packb)  # pyright: ignore[reportUnknownMemberType]
_unpackb = cast("Callable[..., dict[str, Any]]", msgpack.unpackb)  # pyright: ignore[reportUnknownMemberType]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("extra", "expected the keys"),
        ("version", "version 1 was never released"),
        ("version 2", r"version 2 carried CRC-32 digests.*re-export"),
        ("num_tokens", "num_tokens"),
        ("token_ids", "token_ids"),
        ("address", "address"),
        ("blocks", "blocks"),
        ("expires_at", "expires_at"),
        ("geometry", "geometry"),
        ("groups", "groups"),
        ("layers", "keeps_kv"),
        ("states", "dtype"),
        ("state_digests", "state_digests"),
    ],
)
def test_a_malformed_ticket_is_refused_by_name(pair: tuple[Any, Any, Any, Any], change: str, message: str) -> None:
    from kvcache_core.transfer import TransferTicket

    source, producer, _, _ = pair
    fields = _unpackb(producer.export(source.get_handle("r")).to_bytes(), raw=False)
    with pytest.raises(TransferError, match=message):
        TransferTicket.from_bytes(_packb(_mutated(fields, change), use_bin_type=True))


def test_bytes_that_are_not_msgpack_are_refused() -> None:
    from kvcache_core.transfer import TransferTicket

    with pytest.raises(TransferError, match="msgpack"):
        TransferTicket.from_bytes(b"\xc1not a ticket")


def test_an_import_acknowledges_and_the_producer_releases_its_lease(pair: tuple[Any, Any, Any, Any]) -> None:
    source, producer, target, consumer = pair
    ticket = producer.export(source.get_handle("r"))
    assert producer.lease_count == 1
    handle = consumer.import_request(ticket, AllocationRequest("imported"))
    assert producer.lease_count == 0
    assert handle.num_tokens() == 18
    for got, expected in zip(host_blocks(target, handle), host_blocks(source, source.get_handle("r")), strict=True):
        assert got.tobytes() == expected.tobytes()
    source.check_invariants()
    target.check_invariants()


def test_blocks_the_consumer_caches_already_are_mapped_not_pulled(pair: tuple[Any, Any, Any, Any]) -> None:
    source, producer, target, consumer = pair
    consumer.import_request(producer.export(source.get_handle("r")), AllocationRequest("first"))
    second = consumer.import_request(producer.export(source.get_handle("r")), AllocationRequest("second"))
    assert second.num_cached_tokens() == 16
    first_keys, _ = host_blocks(target, target.get_handle("first"))
    second_keys, _ = host_blocks(target, second)
    assert first_keys.tobytes() == second_keys.tobytes()
    target.check_invariants()


def test_another_namespace_is_refused_and_nothing_is_allocated(pair: tuple[Any, Any, Any, Any]) -> None:
    from kvcache_core.transfer import KvTransferAgent

    source, producer, _, _ = pair
    with make_pool({"model_id": "another-model"}) as other, KvTransferAgent(other) as consumer:
        with pytest.raises(TransferError, match="namespace"):
            consumer.import_request(producer.export(source.get_handle("r")), AllocationRequest("imported"))
        _assert_untouched(other)


def test_another_geometry_is_refused_and_nothing_is_allocated(pair: tuple[Any, Any, Any, Any]) -> None:
    from kvcache_core.transfer import KvTransferAgent

    source, producer, _, _ = pair
    with make_pool({"head_dim": 16}) as other, KvTransferAgent(other) as consumer:
        with pytest.raises(TransferMismatchError, match=r"layer 0 differs: head_dim 8 .* 16"):
            consumer.import_request(producer.export(source.get_handle("r")), AllocationRequest("imported"))
        _assert_untouched(other)


def test_a_prompt_other_than_the_tickets_tokens_is_refused(pair: tuple[Any, Any, Any, Any]) -> None:
    source, producer, target, consumer = pair
    ticket = producer.export(source.get_handle("r"))
    with pytest.raises(TransferError, match="prompt"):
        consumer.import_request(ticket, AllocationRequest("imported", prompt_token_ids=[1, 2, 3]))
    _assert_untouched(target)


def test_blocks_that_arrive_different_are_refused_and_released(pair: tuple[Any, Any, Any, Any]) -> None:
    source, producer, target, consumer = pair
    ticket = producer.export(source.get_handle("r"))
    tampered = dataclasses.replace(ticket, digests=bytes(len(ticket.digests)))
    with pytest.raises(TransferError, match="digest"):
        consumer.import_request(tampered, AllocationRequest("imported"))
    _assert_untouched(target)


def test_a_request_that_does_not_fit_is_refused_and_the_others_stay(pair: tuple[Any, Any, Any, Any]) -> None:
    from kvcache_core.transfer import KvTransferAgent

    source, producer, _, _ = pair
    with make_pool({"num_blocks": 5}) as small, KvTransferAgent(small) as consumer:
        prefill(small, "kept", 7, seed=3)
        before = host_blocks(small, small.get_handle("kept"))
        with pytest.raises(TransferError, match="blocks"):
            consumer.import_request(producer.export(source.get_handle("r")), AllocationRequest("imported"))
        small.check_invariants()
        assert [rid for rid, _ in small.list_handles()] == ["kept"]
        after = host_blocks(small, small.get_handle("kept"))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after, strict=True))


def test_an_empty_request_cannot_be_exported(pair: tuple[Any, Any, Any, Any]) -> None:
    source, producer, _, _ = pair
    empty = source.allocate(AllocationRequest("empty"))
    with pytest.raises(TransferError, match="0 tokens"):
        producer.export(empty)
    assert producer.lease_count == 0


def test_a_storage_without_memory_regions_is_refused_by_name() -> None:
    from kvcache_core.transfer import KvTransferAgent

    class NoRegions(NumpyStorage):
        memory_regions = None  # type: ignore[assignment]  # a storage written before the capability existed

    with make_pool({}) as reference:
        config = reference.config
    manager = PagedKvCacheManager(NoRegions(config), backend="old")
    with manager, pytest.raises(TransferError, match="memory_regions"):
        KvTransferAgent(manager)


def test_a_closed_agent_refuses_work(pair: tuple[Any, Any, Any, Any]) -> None:
    source, producer, _, _ = pair
    producer.close()
    with pytest.raises(TransferError, match="closed"):
        producer.export(source.get_handle("r"))


#: A state layer, a hybrid one (K/V and a state), a sliding one and a full one: three groups
#: of one layer (two full, one sliding) and two state arrays.
HYBRID = {
    "layers": [
        {"state": [["conv", [6, 3], "float32"]]},
        {"state": [["ssm", [2, 5], "float32"]], "keeps_kv": True},
        {"window": 5},
        {},
    ],
    "state_slots": 3,
    "layout": "HND",
}


@pytest.mark.parametrize("tamper", [False, True], ids=["intact", "state checksums differ"])
def test_states_and_groups_move_and_a_state_that_differs_is_refused(tamper: bool) -> None:
    from kvcache_core.transfer import KvTransferAgent

    source, target = make_pool(HYBRID), make_pool(HYBRID)
    handle = prefill_steps(source, "r", [7, 6, 3])
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        ticket = producer.export(handle)
        assert ticket.groups == ((0, 4), (2, 2), (0, 4))  # the sliding group released 2 blocks
        assert [(state.layer, state.name) for state in ticket.states] == [(0, "conv"), (1, "ssm")]
        if tamper:
            with pytest.raises(TransferError, match="state array 1 of the ticket arrived different"):
                consumer.import_request(
                    dataclasses.replace(ticket, state_digests=ticket.state_digests[:8] + bytes(8)),
                    AllocationRequest("imported"),
                )
            _assert_untouched(target)
            return
        imported = consumer.import_request(ticket, AllocationRequest("imported"))
        assert state_bytes(target, imported) == state_bytes(source, handle)
        got, want = kv_gathers(target, imported), kv_gathers(source, handle)
        for name, array in got.items():
            assert array.tobytes() == want[name][len(want[name]) - len(array) :].tobytes(), name
        target.check_invariants()


def test_layers_of_their_own_geometry_move_bit_exact() -> None:
    from kvcache_core.transfer import KvTransferAgent

    spec = {"layers": [{"num_heads": 4, "head_dim": 16}, {}, {"num_heads": 4, "head_dim": 16}], "layout": "NHD"}
    source, target = make_pool({**spec, "backend": "torch"}), make_pool(spec)
    handle = prefill_steps(source, "r", [11])
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        imported = consumer.import_request(producer.export(handle), AllocationRequest("imported"))
        got, want = kv_gathers(target, imported), kv_gathers(source, handle)
        assert got.keys() == want.keys()
        for name, array in got.items():
            assert array.tobytes() == want[name].tobytes(), name
        target.check_invariants()


#: Layers of their own geometry beside one of the pool's.
MIXED = {"layers": [{"num_heads": 4, "head_dim": 16}, {}, {"num_heads": 4, "head_dim": 16}]}
#: A sliding layer and a full one of a quantized pool (int8 blocks and their float32 scales).
QUANTIZED_GROUPS = {"layers": [{"window": 5}, {}], "dtype": "int8"}


@pytest.mark.parametrize(
    ("spec", "layouts", "backends"),
    [
        (HYBRID, ("HND", "NHD"), ("numpy", "numpy")),
        (HYBRID, ("heads_first", "HND"), ("torch", "numpy")),
        (MIXED, ("NHD", "heads_first"), ("torch", "torch")),
        (QUANTIZED_GROUPS, ("heads_first", "NHD"), ("numpy", "torch")),
    ],
    ids=["groups and states", "groups and states from torch", "own geometry", "quantized groups"],
)
def test_a_pool_of_groups_states_or_own_geometry_is_converted_on_arrival(
    spec: dict[str, Any], layouts: tuple[str, str], backends: tuple[str, str]
) -> None:
    from kvcache_core.transfer import KvTransferAgent

    source = make_pool({**spec, "layout": layouts[0], "backend": backends[0]})
    target = make_pool({**spec, "layout": layouts[1], "backend": backends[1]})
    handle = prefill_steps(source, "r", [7, 6, 3])
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        imported = consumer.import_request(producer.export(handle), AllocationRequest("imported"))
        assert imported.num_tokens() == 16
        assert state_bytes(target, imported) == state_bytes(source, handle)
        got, want = kv_gathers(target, imported), kv_gathers(source, handle)
        assert got.keys() == want.keys()
        for name, array in got.items():
            assert array.tobytes() == want[name][len(want[name]) - len(array) :].tobytes(), name
        target.check_invariants()


def test_a_pool_of_groups_and_states_in_device_memory_is_refused_by_name() -> None:
    # What arrives for such a pool is written and checked in host memory; a pool on a GPU
    # (here one that says so: no GPU on this machine) is refused before anything is read.
    from kvcache_core.transfer import KvTransferAgent

    source, target = make_pool(HYBRID), make_pool(HYBRID)
    handle = prefill_steps(source, "r", [9])
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        consumer._kind = "cuda"  # pyright: ignore[reportPrivateUsage]
        with pytest.raises(TransferError, match=r"host memory only .* this pool's 'HND' on 'cuda'"):
            consumer.import_request(producer.export(handle), AllocationRequest("imported"))
        _assert_untouched(target)
        assert producer.lease_count == 1  # not acknowledged: the lease expires


def test_blocks_converted_on_arrival_that_differ_are_refused_and_nothing_is_kept() -> None:
    from kvcache_core.transfer import KvTransferAgent

    source, target = make_pool(HYBRID), make_pool({**HYBRID, "layout": "NHD"})
    handle = prefill_steps(source, "r", [9])
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        ticket = producer.export(handle)
        digests = bytearray(ticket.digests)
        digests[-1] ^= 1  # the last block's
        with pytest.raises(TransferError, match=r"block \d+ of the ticket arrived different"):
            consumer.import_request(dataclasses.replace(ticket, digests=bytes(digests)), AllocationRequest("imported"))
        _assert_untouched(target)


@pytest.mark.parametrize("tamper", [False, True], ids=["intact", "checksums differ"])
def test_pools_of_one_layout_read_straight_into_the_blocks(tamper: bool) -> None:
    from kvcache_core.transfer import KvTransferAgent

    source, target = make_pool({"layout": "HND", "dtype": "int8"}), make_pool({"layout": "HND", "dtype": "int8"})
    handle = prefill(source, "r", 13)
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        ticket = producer.export(handle)
        if tamper:
            ticket = dataclasses.replace(ticket, digests=bytes(len(ticket.digests)))
            with pytest.raises(TransferError, match="digest"):
                consumer.import_request(ticket, AllocationRequest("imported"))
            _assert_untouched(target)
            return
        imported = consumer.import_request(ticket, AllocationRequest("imported"))
        for got, expected in zip(host_blocks(target, imported), host_blocks(source, handle), strict=True):
            assert got.tobytes() == expected.tobytes()
        later = target.allocate(AllocationRequest("later", prompt_token_ids=(*imported.token_ids(), 0)))
        assert later.num_cached_tokens() == 12
        target.check_invariants()


@pytest.mark.parametrize("layouts", [("NHD", "heads_first"), ("HND", "HND")], ids=["converted", "in place"])
def test_values_of_another_width_than_the_keys_arrive_bit_exact(layouts: tuple[str, str]) -> None:
    from kvcache_core.transfer import KvTransferAgent

    source = make_pool({"layout": layouts[0], "value_head_dim": 16})
    target = make_pool({"layout": layouts[1], "value_head_dim": 16})
    handle = prefill(source, "r", 11)
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        imported = consumer.import_request(producer.export(handle), AllocationRequest("imported"))
        for got, expected in zip(host_blocks(target, imported), host_blocks(source, handle), strict=True):
            assert got.tobytes() == expected.tobytes()
        target.check_invariants()


def test_another_value_width_is_refused_by_name() -> None:
    from kvcache_core.transfer import KvTransferAgent

    source, target = make_pool({"value_head_dim": 16}), make_pool({})
    handle = prefill(source, "r", 11)
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        with pytest.raises(TransferError, match="value_head_dim"):
            consumer.import_request(producer.export(handle), AllocationRequest("imported"))
        _assert_untouched(target)


def test_pinned_blocks_are_neither_evicted_nor_reused_until_the_import(pair: tuple[Any, Any, Any, Any]) -> None:
    source, producer, target, consumer = pair
    handle = source.get_handle("r")
    expected = host_blocks(source, handle)
    ticket = producer.export(handle)
    source.deallocate("r")
    takeable = source.stats().free_blocks + source.stats().cached_blocks  # the pinned blocks are neither
    more = 4 * (takeable + 1)  # one block more than the pool could give without them
    crowd = source.allocate(AllocationRequest("crowd", prompt_token_ids=list(range(5000, 5000 + more))))
    with pytest.raises(OutOfBlocksError):
        source.extend(crowd, more)
    source.extend(crowd, 4 * takeable)  # every other block, evicting what it must
    imported = consumer.import_request(ticket, AllocationRequest("imported"))
    for got, want in zip(host_blocks(target, imported), expected, strict=True):
        assert got.tobytes() == want.tobytes()
    source.check_invariants()


def test_a_lease_ended_before_the_read_is_refused_from_a_known_producer(pair: tuple[Any, Any, Any, Any]) -> None:
    source, producer, target, consumer = pair
    first, second = (producer.export(source.get_handle("r")) for _ in range(2))
    consumer.import_request(first, AllocationRequest("first"))  # the producer is known from now on
    assert producer.release(second.lease)
    with pytest.raises(TransferError, match="expired or was released before the read ended"):
        consumer.import_request(second, AllocationRequest("second"))
    assert [request_id for request_id, _ in target.list_handles()] == ["first"]
    target.check_invariants()


#: A state layer and a full attention layer: one KV-cache group and one state array.
STATEFUL = {"layers": [{"state": [["conv", [6, 3], "float32"]]}, {}], "state_slots": 4, "layout": "HND"}


@pytest.mark.parametrize("layout", ["HND", "NHD"], ids=["in place", "converted"])
@pytest.mark.parametrize("steps", [[7, 5], [7, 6]], ids=["ends a block", "ends inside a block"])
def test_an_imported_state_is_filed_as_the_checkpoint_where_the_request_ends_a_block(
    steps: list[int], layout: str
) -> None:
    from kvcache_core.transfer import KvTransferAgent

    length = sum(steps)
    source, target = make_pool(STATEFUL), make_pool({**STATEFUL, "layout": layout})
    handle = prefill_steps(source, "r", steps)
    with source, target, KvTransferAgent(source) as producer, KvTransferAgent(target) as consumer:
        imported = consumer.import_request(producer.export(handle), AllocationRequest("imported"))
        filed = target.stats().checkpoint_state_slots
        consumer_states = state_bytes(target, imported)
        target.deallocate("imported")
        # A later prompt sharing the request's tokens: served up to the checkpoint (states
        # and blocks as if computed here), or not at all without one.
        again = target.allocate(AllocationRequest("again", prompt_token_ids=(*prompt_of(length), 5, 6)))
        if length % 4 == 0:
            assert filed == 1
            assert again.num_cached_tokens() == length
            assert state_bytes(target, again) == consumer_states == state_bytes(source, handle)
        else:
            assert filed == 0
            assert again.num_cached_tokens() == 0
        target.check_invariants()
