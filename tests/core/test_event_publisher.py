"""The ZMQ event publisher, on loopback only: sequence numbers, vLLM's encoding, replay."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kvcache_core import InvalidArgumentError  # noqa: E402
from kvcache_core.event_publisher import (  # noqa: E402
    END_OF_REPLAY,
    ZmqEventPublisher,
    decode_event_batch,
    encode_event_batch,
)
from kvcache_core.events import AllBlocksCleared, BlockRemoved, BlockStored, CachedBlockIndex, CacheEvent  # noqa: E402
from kvcache_core.testing.hybrid import pool_hashes  # noqa: E402
from kvcache_core.tiers import DiskTier, HostTier  # noqa: E402
from tests.core.test_prefix_caching import admit, make_manager  # noqa: E402
from tests.core.test_tiers import BLOCK_BYTES, prompt_of, tiered  # noqa: E402

TIMEOUT_MS = 5_000
SEQ = struct.Struct(">q")


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_size=64) as publisher:
        yield publisher


def replay(publisher: ZmqEventPublisher, start: int) -> list[tuple[int, bytes]]:
    """Ask the publisher for every retained batch from ``start`` on."""
    assert publisher.replay_endpoint is not None
    context = zmq.Context.instance()
    with context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", SEQ.pack(start)))
        batches: list[tuple[int, bytes]] = []
        for _ in range(1_000):  # bounded: the publisher retains at most buffer_size batches
            _, seq_frame, payload = dealer.recv_multipart()
            seq = SEQ.unpack(seq_frame)[0]
            if seq == END_OF_REPLAY:
                return batches
            batches.append((seq, payload))
    raise AssertionError("the replay never ended")


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


@pytest.mark.parametrize("field", ["buffer_size", "send_high_water_mark"])
def test_bad_sizes_are_refused(field: str) -> None:
    options: dict[str, Any] = {field: 0}
    with pytest.raises(InvalidArgumentError, match=f"{field} must be an int >= 1, got 0"):
        ZmqEventPublisher("tcp://127.0.0.1:*", **options)


def test_an_endpoint_zmq_cannot_bind_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match="nonsense://here"):
        ZmqEventPublisher("nonsense://here")


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
