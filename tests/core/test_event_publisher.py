"""The ZMQ event publisher, on loopback only: sequence numbers, vLLM's encoding, replay."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kvcache_core import InvalidArgumentError, KvCacheError  # noqa: E402
from kvcache_core.errors import InvalidTypeError, PublisherClosedError  # noqa: E402
from kvcache_core.offload.events import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlockIndex, CacheEvent  # noqa: E402
from kvcache_core.offload.publisher import (  # noqa: E402
    END_OF_REPLAY,
    ZmqEventPublisher,
    decode_event_batch,
    encode_event_batch,
)
from kvcache_core.offload.tiers import DiskTier, HostTier  # noqa: E402
from kvcache_core.testing.kv_data import pool_hashes  # noqa: E402
from tests.core.support import BLOCK_BYTES, admit, make_manager, prompt_of, tiered  # noqa: E402

TIMEOUT_MS = 5_000
SEQ = struct.Struct(">q")


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_size=64) as publisher:
        yield publisher


def replay_frames(publisher: ZmqEventPublisher, request_frame: bytes) -> list[tuple[int, bytes]]:
    """Send ``request_frame`` to the publisher's replay socket; every batch it answers."""
    assert publisher.replay_endpoint is not None
    context = zmq.Context.instance()
    with context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", request_frame))
        batches: list[tuple[int, bytes]] = []
        for _ in range(1_000):  # bounded: the publisher retains at most buffer_size batches
            _, seq_frame, payload = dealer.recv_multipart()
            seq = SEQ.unpack(seq_frame)[0]
            if seq == END_OF_REPLAY:
                return batches
            batches.append((seq, payload))
    raise AssertionError("the replay never ended")


def replay(publisher: ZmqEventPublisher, start: int) -> list[tuple[int, bytes]]:
    """Ask the publisher for every retained batch from ``start`` on."""
    return replay_frames(publisher, SEQ.pack(start))


def test_a_batch_round_trips_with_vllm_fields() -> None:
    events: list[CacheEvent] = [
        BlockStored((b"a" * 32, b"b" * 32), None, tuple(range(8)), 4, None, "pool"),
        BlockRemoved((b"a" * 32,), "host"),
        AllBlocksCleared(),
    ]
    ts, decoded = decode_event_batch(encode_event_batch(events, ts=12.5))
    assert ts == 12.5
    assert decoded == events


def test_a_payload_that_is_not_a_batch_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="not a KV event batch"):
        decode_event_batch(b"\xc1garbage")


def test_a_live_subscriber_with_replay_rebuilds_the_pool(publisher: ZmqEventPublisher) -> None:
    context = zmq.Context.instance()
    with context.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(publisher.endpoint)
        manager = make_manager(num_blocks=12)
        manager.subscribe(publisher)
        for turn in range(8):
            admit(manager, f"r{turn}", [turn % 3] * 4 + list(range(turn, turn + 9)))
            manager.deallocate(f"r{turn}")
        last = publisher.next_sequence - 1
        assert last > 0
        # A subscriber joining late missed the first batches (ZMQ's slow joiner): whatever it
        # got live, the replay from the first missing sequence number fills the gap.
        live: dict[int, bytes] = {}
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while poller.poll(200):
            topic, seq_frame, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            live[SEQ.unpack(seq_frame)[0]] = payload
        missing = next((seq for seq in range(last + 1) if seq not in live), None)
        batches = dict(live)
        if missing is not None:
            batches.update(replay(publisher, missing))
        assert sorted(batches) == list(range(last + 1))
        index = CachedBlockIndex()
        for seq in sorted(batches):
            for event in decode_event_batch(batches[seq])[1]:
                index.apply(event)
        assert index.hashes() == pool_hashes(manager)
        assert index.hashes()


def test_replay_returns_only_the_last_buffer_size_batches() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_size=3) as publisher:
        for count in range(5):
            publisher.publish([BlockRemoved((bytes([count]) * 32,), "pool")])
        batches = replay(publisher, 0)
        assert [seq for seq, _ in batches] == [2, 3, 4]
        assert decode_event_batch(batches[0][1])[1] == [BlockRemoved((b"\x02" * 32,), "pool")]
        assert replay(publisher, 4) == batches[2:]
        assert replay(publisher, 5) == []


def open_resources() -> tuple[int, int]:
    """This process's open file descriptors and threads (native ones, ZMQ's included)."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("field", ["buffer_size", "send_high_water_mark"])
@pytest.mark.parametrize("value", [0, -1, 2**31, 2**40])
def test_a_size_out_of_range_is_refused_naming_the_range(field: str, value: int) -> None:
    options: dict[str, Any] = {field: value}
    with pytest.raises(InvalidArgumentError, match=rf"{field} must be an int in \[1, 2147483647\], got {value}"):
        ZmqEventPublisher("tcp://127.0.0.1:*", **options)


@pytest.mark.parametrize("field", ["buffer_size", "send_high_water_mark"])
@pytest.mark.parametrize("value", [True, 8.0, "8", None])
def test_a_size_that_is_not_an_int_is_refused(field: str, value: object) -> None:
    options: dict[str, Any] = {field: value}
    with pytest.raises(
        InvalidTypeError, match=rf"{field} must be an int in \[1, 2147483647\], got {type(value).__name__}"
    ):
        ZmqEventPublisher("tcp://127.0.0.1:*", **options)


@pytest.mark.parametrize("field", ["endpoint", "replay_endpoint"])
@pytest.mark.parametrize("value", [b"tcp://127.0.0.1:*", 5557, ("tcp://127.0.0.1:*",)])
def test_an_endpoint_that_is_not_a_str_is_refused(field: str, value: object) -> None:
    options: dict[str, Any] = {"endpoint": "tcp://127.0.0.1:*", field: value}
    with pytest.raises(InvalidTypeError, match=f"{field} must be a str 'transport://address'"):
        ZmqEventPublisher(**options)


def test_no_endpoint_is_refused() -> None:
    with pytest.raises(InvalidTypeError, match=r"endpoint must be a str 'transport://address'.*got NoneType"):
        ZmqEventPublisher(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["endpoint", "replay_endpoint"])
@pytest.mark.parametrize("value", ["", "127.0.0.1:5557", "tcp://", "://127.0.0.1:5557", "tcp://127.0.0.1:*\0x"])
def test_an_endpoint_not_of_the_form_transport_address_is_refused(field: str, value: str) -> None:
    options: dict[str, Any] = {"endpoint": "tcp://127.0.0.1:*", field: value}
    with pytest.raises(
        InvalidArgumentError, match=f"{field} must be 'transport://address'.*got {re.escape(repr(value))}"
    ):
        ZmqEventPublisher(**options)


@pytest.mark.parametrize("topic", ["kv", bytearray(b"kv"), None, 7])
def test_a_topic_that_is_not_bytes_is_refused(topic: object) -> None:
    with pytest.raises(InvalidTypeError, match=f"topic must be bytes, got {type(topic).__name__}"):
        ZmqEventPublisher("tcp://127.0.0.1:*", topic=topic)  # type: ignore[arg-type]


def test_a_str_topic_is_refused_with_the_remedy() -> None:
    with pytest.raises(InvalidTypeError, match=re.escape("(use 'kv'.encode())")):
        ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv")  # type: ignore[arg-type]


def test_an_endpoint_zmq_cannot_bind_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match="nonsense://here"):
        ZmqEventPublisher("nonsense://here")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
@pytest.mark.parametrize(
    "options",
    [
        {"endpoint": None},
        {"endpoint": "tcp://127.0.0.1:*", "topic": "kv"},
        {"endpoint": "tcp://127.0.0.1:*", "send_high_water_mark": 2**40},
        {"endpoint": "nonsense://here"},
        {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "nonsense://here"},
    ],
    ids=["no endpoint", "str topic", "huge high-water mark", "unbindable", "unbindable replay"],
)
def test_a_refused_publisher_leaves_nothing_open(options: dict[str, Any]) -> None:
    before = open_resources()
    with pytest.raises(KvCacheError):
        ZmqEventPublisher(**options)
    assert open_resources() == before


def test_publishing_what_is_not_an_event_is_refused(publisher: ZmqEventPublisher) -> None:
    with pytest.raises(InvalidTypeError, match="a cache event is a BlockStored, BlockRemoved or AllBlocksCleared"):
        publisher("kv")  # type: ignore[arg-type]
    assert publisher.next_sequence == 0


def test_publishing_after_close_is_refused_and_uses_no_sequence_number(publisher: ZmqEventPublisher) -> None:
    publisher.publish([AllBlocksCleared()])
    publisher.close()
    with pytest.raises(PublisherClosedError, match="closed"):
        publisher.publish([AllBlocksCleared()])
    assert publisher.next_sequence == 1
    assert publisher.closed


def test_calling_a_closed_publisher_is_refused(publisher: ZmqEventPublisher) -> None:
    publisher.close()
    with pytest.raises(PublisherClosedError, match="closed"):
        publisher(AllBlocksCleared())
    assert publisher.next_sequence == 0


def test_closing_a_closed_publisher_does_nothing(publisher: ZmqEventPublisher) -> None:
    publisher.close()
    publisher.close()
    assert publisher.closed


def test_a_closed_publisher_still_subscribed_leaves_the_manager_working(publisher: ZmqEventPublisher) -> None:
    manager = make_manager(num_blocks=12)
    manager.subscribe(publisher)
    admit(manager, "before", list(range(9)))
    published = publisher.next_sequence
    assert published > 0
    publisher.close()
    with pytest.warns(RuntimeWarning, match="PublisherClosedError"):
        admit(manager, "after", list(range(20, 29)))
    manager.check_invariants()
    handle = manager.get_handle("after")
    assert handle is not None
    assert handle.num_tokens() == 9
    assert publisher.next_sequence == published


@pytest.mark.parametrize(
    "request_frame", [b"", b"\x00" * 7, b"\x00" * 9, SEQ.pack(-5)], ids=["empty", "short", "long", "negative"]
)
def test_a_malformed_replay_request_gets_the_end_alone(publisher: ZmqEventPublisher, request_frame: bytes) -> None:
    publisher.publish([AllBlocksCleared()])
    assert replay_frames(publisher, request_frame) == []
    assert [seq for seq, _ in replay(publisher, 0)] == [0]


def test_an_oversized_replay_request_is_dropped_and_replays_go_on(publisher: ZmqEventPublisher) -> None:
    publisher.publish([AllBlocksCleared()])
    assert publisher.replay_endpoint is not None
    context = zmq.Context.instance()
    with context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", b"\x00" * (1 << 20)))
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        assert not poller.poll(300)  # ZMQ dropped the peer: no answer
    assert [seq for seq, _ in replay(publisher, 0)] == [0]


def test_replayed_batches_rebuild_every_medium_of_a_tiered_manager(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    host, disk = HostTier(2 * BLOCK_BYTES), DiskTier(tmp_path, 1 << 20)
    manager = tiered(6, host, disk)
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_size=10_000) as publisher:
        manager.subscribe(publisher)
        for turn in range(6):
            admit(manager, f"r{turn}", prompt_of(turn % 3, 2))
            manager.deallocate(f"r{turn}")
        manager.gc()
        index = CachedBlockIndex()
        batches = replay(publisher, 0)
        assert [seq for seq, _ in batches] == list(range(publisher.next_sequence))
        for _, payload in batches:
            for event in decode_event_batch(payload)[1]:
                index.apply(event)
    assert index.hashes("pool") == pool_hashes(manager) == frozenset()
    assert index.hashes("host") == frozenset(host.hashes())
    assert index.hashes("disk") == frozenset(disk.hashes())
    assert index.hashes("host")
    assert index.hashes("disk")
