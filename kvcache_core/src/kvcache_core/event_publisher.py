"""Cache events over ZMQ, encoded as vLLM's KV events, for KV-aware routers.

Requires the ``events`` extra (``pip install "kvcache-core[events]"``: pyzmq, msgpack)::

    publisher = ZmqEventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558")
    manager.subscribe(publisher)

Wire format, as vLLM's ``ZmqEventPublisher``:

* the PUB socket sends each batch as three frames: ``topic``, the batch's sequence number
  (8 bytes, big-endian, counting from 0) and the msgpack payload;
* the payload is ``KVEventBatch`` as msgspec encodes an ``array_like`` struct:
  ``[ts, [event, ...], data_parallel_rank]`` with each event ``["BlockStored",
  block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``;
* the ROUTER socket at ``replay_endpoint`` answers a request holding a start sequence
  number (8 bytes, big-endian) with every retained batch from there on, ``[b"", seq,
  payload]`` each, then ``[b"", -1, b""]``. The last ``buffer_size`` batches are retained.

A subscriber that sees a gap in the sequence numbers asks for a replay from the first
missing one. Sending never blocks the manager: past ``send_high_water_mark`` queued
messages ZMQ drops (a subscriber finds the gap and replays).
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgpack
import zmq

from kvcache_core.errors import InvalidArgumentError
from kvcache_core.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

__all__ = ["END_OF_REPLAY", "ZmqEventPublisher", "decode_event_batch", "encode_event_batch"]

#: The sequence number that ends a replay.
END_OF_REPLAY = -1

_SEQ = struct.Struct(">q")

# msgpack ships no type information.
_packb = cast("Callable[..., bytes]", msgpack.packb)  # pyright: ignore[reportUnknownMemberType]
_unpackb = cast("Callable[..., Any]", msgpack.unpackb)  # pyright: ignore[reportUnknownMemberType]


def _event_fields(event: CacheEvent) -> list[object]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def encode_event_batch(events: Sequence[CacheEvent], ts: float | None = None) -> bytes:
    """``events`` as one msgpack ``KVEventBatch`` (``ts``: seconds since the epoch, now by default)."""
    batch = [time.time() if ts is None else ts, [_event_fields(event) for event in events], None]
    return _packb(batch, use_bin_type=True)


def decode_event_batch(payload: bytes) -> tuple[float, list[CacheEvent]]:
    """The timestamp and events of a payload :func:`encode_event_batch` made.

    Raises:
        InvalidArgumentError: the payload is not such a batch (the message says what is wrong).
    """
    try:
        batch = _unpackb(payload, raw=False)
        ts, raw_events = float(batch[0]), batch[1]
        events: list[CacheEvent] = []
        for fields in raw_events:
            tag = fields[0]
            if tag == "BlockStored":
                events.append(
                    BlockStored(
                        block_hashes=tuple(bytes(h) for h in fields[1]),
                        parent_block_hash=None if fields[2] is None else bytes(fields[2]),
                        token_ids=tuple(int(t) for t in fields[3]),
                        block_size=int(fields[4]),
                        lora_id=None if fields[5] is None else int(fields[5]),
                        medium=str(fields[6]),
                    )
                )
            elif tag == "BlockRemoved":
                events.append(BlockRemoved(tuple(bytes(h) for h in fields[1]), str(fields[2])))
            elif tag == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise InvalidArgumentError(
                    f"unknown event tag {tag!r}; known: BlockStored, BlockRemoved, AllBlocksCleared"
                )
    except (msgpack.UnpackException, ValueError, TypeError, IndexError, KeyError) as exc:
        if isinstance(exc, InvalidArgumentError):
            raise
        raise InvalidArgumentError(f"not a KV event batch ({len(payload)} bytes): {exc!r}") from exc
    return ts, events


class ZmqEventPublisher:
    """Publishes cache events on a ZMQ PUB socket with sequence numbers, and replays the
    last ``buffer_size`` batches on request. Pass it to ``manager.subscribe``.

    Args:
        endpoint: where the PUB socket binds (``"tcp://127.0.0.1:*"`` picks a free port;
            :attr:`endpoint` tells which).
        replay_endpoint: where the ROUTER socket answering replay requests binds, or ``None``
            for no replay.
        buffer_size: batches retained for replay (>= 1).
        topic: the first frame of every message.
        send_high_water_mark: messages ZMQ queues per subscriber before dropping (>= 1).

    Raises:
        InvalidArgumentError: a size below 1, or an endpoint ZMQ cannot bind (the message
            names it).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        buffer_size: int = 10_000,
        topic: bytes = b"kv-events",
        send_high_water_mark: int = 100_000,
    ) -> None:
        for name, value in (("buffer_size", buffer_size), ("send_high_water_mark", send_high_water_mark)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        self._topic = topic
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._next_seq = 0
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, send_high_water_mark)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            self.endpoint: str = self._last_endpoint(self._pub)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._router = self._context.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(replay_endpoint)
                self.replay_endpoint = self._last_endpoint(self._router)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise InvalidArgumentError(
                f"cannot bind the event publisher's sockets ({endpoint!r}, {replay_endpoint!r}): {exc}"
            ) from exc
        if self._router is not None:
            self._replay_thread = threading.Thread(target=self._serve_replays, name="kvcache-event-replay", daemon=True)
            self._replay_thread.start()

    @property
    def next_sequence(self) -> int:
        """The sequence number the next batch will carry."""
        return self._next_seq

    def __call__(self, event: CacheEvent) -> None:
        """Publish one event (as a batch of one): the form ``manager.subscribe`` calls."""
        self.publish((event,))

    def publish(self, events: Sequence[CacheEvent]) -> int:
        """Publish ``events`` as one batch; return its sequence number."""
        payload = encode_event_batch(events)
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            # No room queued for some subscriber: it sees the gap and asks for a replay.
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart((self._topic, _SEQ.pack(seq), payload), flags=zmq.NOBLOCK)
        return seq

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent)."""
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join()
            self._replay_thread = None
        self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._context.term()

    @staticmethod
    def _last_endpoint(socket: zmq.Socket[bytes]) -> str:
        value = socket.getsockopt(zmq.LAST_ENDPOINT)
        return value.decode() if isinstance(value, bytes) else str(value)

    def _serve_replays(self) -> None:
        router = self._router
        assert router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            frames = router.recv_multipart()
            identity, request = frames[0], frames[-1]
            start = _SEQ.unpack(request)[0] if len(request) == _SEQ.size else 0
            with self._lock:
                retained = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            for seq, payload in retained:
                router.send_multipart((identity, b"", _SEQ.pack(seq), payload))
            router.send_multipart((identity, b"", _SEQ.pack(END_OF_REPLAY), b""))
