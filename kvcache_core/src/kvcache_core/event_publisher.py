"""Cache events over ZMQ, encoded as vLLM's KV events, for KV-aware routers.

Requires the ``events`` extra (``pip install "kvcache-core[events]"``: pyzmq, msgpack)::

    publisher = ZmqEventPublisher("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
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
  payload]`` each, then ``[b"", -1, b""]``; a request that holds no such number (or a
  negative one) gets the end alone. The last ``buffer_size`` batches are retained.

A subscriber that sees a gap in the sequence numbers asks for a replay from the first
missing one. Sending never blocks the manager: past ``send_high_water_mark`` queued
messages ZMQ drops (a subscriber finds the gap and replays).
"""

from __future__ import annotations

import contextlib
import math
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final, Protocol, cast

import msgpack
import zmq

from kvcache_core.config import MAX_POOL_SLOTS, MAX_TOKEN_ID
from kvcache_core.errors import CorruptEventBatchError, InvalidArgumentError, InvalidTypeError
from kvcache_core.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

__all__ = ["END_OF_REPLAY", "ZmqEventPublisher", "decode_event_batch", "encode_event_batch"]

#: The sequence number that ends a replay.
END_OF_REPLAY = -1

_SEQ = struct.Struct(">q")

# msgpack ships no type information.
_packb = cast("Callable[..., bytes]", msgpack.packb)  # pyright: ignore[reportUnknownMemberType]


class _Unpacker(Protocol):
    """What the decoder uses of ``msgpack.Unpacker``."""

    def feed(self, data: bytes) -> None: ...
    def unpack(self) -> object: ...
    def read_array_header(self) -> int: ...
    def tell(self) -> int: ...


_new_unpacker = cast("Callable[..., _Unpacker]", msgpack.Unpacker)  # pyright: ignore[reportUnknownMemberType]

#: Bytes of a block hash: a SHA-256 digest, as the managers make them.
_HASH_BYTES: Final = 32
#: The largest ``lora_id`` and ``data_parallel_rank`` (vLLM keeps both in an int64).
_MAX_INT64: Final = 2**63 - 1
#: The fields of each event, its tag included, as :func:`encode_event_batch` writes them.
_EVENT_FIELDS: Final = {"BlockStored": 7, "BlockRemoved": 3, "AllBlocksCleared": 1}
#: The fields of a batch: ``ts``, the events, ``data_parallel_rank``.
_BATCH_FIELDS: Final = 3


def _check_timestamp(ts: object) -> float:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < math.inf:
        raise InvalidArgumentError(f"ts must be a finite number of seconds >= 0 since the epoch, got {ts!r}")
    return float(ts)


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
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise InvalidTypeError(
        f"a cache event is a BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}: {event!r}"
    )


def encode_event_batch(events: Sequence[CacheEvent], ts: float | None = None) -> bytes:
    """``events`` as one msgpack ``KVEventBatch`` (``ts``: seconds since the epoch, now by default).

    Raises:
        InvalidTypeError: ``events`` is not a sequence of cache events.
        InvalidArgumentError: ``ts`` is not a finite number >= 0, or a field of an event
            msgpack cannot hold (an int past 64 bits, ...).
    """
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise InvalidTypeError(f"events must be a sequence of cache events, got {type(events).__name__}")
    stamp = time.time() if ts is None else _check_timestamp(ts)
    batch = [stamp, [_event_fields(event) for event in events], None]
    try:
        return _packb(batch, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(f"cannot encode the events {events!r}: {exc}") from exc


def decode_event_batch(payload: bytes | bytearray | memoryview) -> tuple[float, list[CacheEvent]]:
    """The timestamp and events of a payload :func:`encode_event_batch` made.

    The payload comes from outside, so it is parsed strictly: each value's msgpack type is
    checked before the value is built (an int is never taken for bytes, a ``bool`` never
    for an int), every count is bounded by the bytes left in the payload, and every value
    by its range: hashes of 32 bytes, token ids in ``[0, MAX_TOKEN_ID]``, ``block_size`` in
    ``[1, MAX_POOL_SLOTS]`` with ``len(block_hashes) * block_size`` token ids, a finite
    ``ts >= 0``, a non-empty ``medium``. Decoding costs memory proportional to the payload.

    Raises:
        InvalidTypeError: ``payload`` is not bytes (``bytes``, ``bytearray``, ``memoryview``).
        CorruptEventBatchError: the payload is not such a batch (the message says where
            and what is wrong).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"an event payload is bytes, got {type(payload).__name__}")
    reader = _PayloadReader(bytes(payload))
    try:
        return reader.batch()
    except CorruptEventBatchError:
        raise
    except (msgpack.UnpackException, ValueError) as exc:  # truncated or not msgpack (UTF-8 included)
        raise CorruptEventBatchError(f"not a KV event batch ({len(payload)} bytes): {exc!r}") from exc


def _msgpack_kinds() -> tuple[str, ...]:
    """The kind of value each first byte of a msgpack value announces."""
    kinds = ["extension"] * 256
    for first, last, kind in (
        (0x00, 0x7F, "int"),
        (0x80, 0x8F, "map"),
        (0x90, 0x9F, "array"),
        (0xA0, 0xBF, "str"),
        (0xC0, 0xC0, "nil"),
        (0xC1, 0xC1, "unused byte"),
        (0xC2, 0xC3, "bool"),
        (0xC4, 0xC6, "bin"),
        (0xCA, 0xCB, "float"),
        (0xCC, 0xD3, "int"),
        (0xD9, 0xDB, "str"),
        (0xDC, 0xDD, "array"),
        (0xDE, 0xDF, "map"),
        (0xE0, 0xFF, "int"),
    ):
        kinds[first : last + 1] = [kind] * (last - first + 1)
    return tuple(kinds)


_KINDS: Final = _msgpack_kinds()


class _PayloadReader:
    """Reads one event batch value by value, checking each value's msgpack kind from its
    first byte before msgpack builds it."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload
        limit = max(len(payload), 1)
        self._unpacker = _new_unpacker(
            None,
            raw=False,
            max_buffer_size=limit,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,
        )
        self._unpacker.feed(payload)

    def batch(self) -> tuple[float, list[CacheEvent]]:
        self._array("the batch", _BATCH_FIELDS, _BATCH_FIELDS)
        ts = self._number("ts")
        if not 0 <= ts < math.inf:
            raise self._error(f"ts must be a finite number of seconds >= 0, got {ts!r}")
        count = self._array("the event list", 0)
        events = [self._event(f"event {index}") for index in range(count)]
        self._optional_int("data_parallel_rank", 0, _MAX_INT64)
        if self._left():
            raise self._error(f"{self._left()} bytes follow the batch; a payload holds one batch")
        return ts, events

    def _event(self, where: str) -> CacheEvent:
        fields = self._array(where, 1, max(_EVENT_FIELDS.values()))
        tag = self._text(f"the tag of {where}")
        expected = _EVENT_FIELDS.get(tag)
        if expected is None:
            raise self._error(f"unknown event tag {tag!r} in {where}; known: {', '.join(_EVENT_FIELDS)}")
        if fields != expected:
            raise self._error(f"{where} ({tag}) has {fields} fields, a {tag} has {expected}")
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        if tag == "BlockRemoved":
            return BlockRemoved(self._hashes(where), self._medium(where))
        block_hashes = self._hashes(where)
        parent = None if self._take_nil() else self._hash(f"the parent_block_hash of {where}")
        token_count = self._array(f"the token_ids of {where}", 0)
        token_ids = tuple(self._int(f"token_ids[{index}] of {where}", 0, MAX_TOKEN_ID) for index in range(token_count))
        block_size = self._int(f"the block_size of {where}", 1, MAX_POOL_SLOTS)
        if token_count != len(block_hashes) * block_size:
            raise self._error(
                f"{where} has {token_count} token ids; {len(block_hashes)} blocks of {block_size} tokens have "
                f"{len(block_hashes) * block_size}"
            )
        lora_id = self._optional_int(f"the lora_id of {where}", 0, _MAX_INT64)
        return BlockStored(block_hashes, parent, token_ids, block_size, lora_id, self._medium(where))

    def _hashes(self, where: str) -> tuple[bytes, ...]:
        count = self._array(f"the block_hashes of {where}", 1)
        return tuple(self._hash(f"block_hashes[{index}] of {where}") for index in range(count))

    def _hash(self, what: str) -> bytes:
        self._expect(what, ("bin",), f"a {_HASH_BYTES}-byte hash")
        value = cast("bytes", self._unpacker.unpack())
        if len(value) != _HASH_BYTES:
            raise self._error(f"{what} has {len(value)} bytes, a block hash has {_HASH_BYTES}")
        return value

    def _medium(self, where: str) -> str:
        medium = self._text(f"the medium of {where}")
        if not medium:
            raise self._error(f"the medium of {where} is empty; a medium is 'pool' or a tier's name")
        return medium

    def _array(self, what: str, low: int, high: int | None = None) -> int:
        """Read an array's header: its count, in ``[low, high]`` and, as each item takes a
        byte at least, no more than the bytes left (``high=None``: that bound alone)."""
        self._expect(what, ("array",), "an array")
        count = self._unpacker.read_array_header()
        if high is not None and not low <= count <= high:
            raise self._error(f"{what} has {count} items; valid: {low} to {high}")
        if count < low or count > self._left():
            raise self._error(
                f"{what} has {count} items; valid: {low} to the {self._left()} bytes left (an item takes one or more)"
            )
        return count

    def _int(self, what: str, low: int, high: int) -> int:
        self._expect(what, ("int",), "an int")
        value = cast("int", self._unpacker.unpack())
        if not low <= value <= high:
            raise self._error(f"{what} = {value} is out of range; valid: [{low}, {high}]")
        return value

    def _optional_int(self, what: str, low: int, high: int) -> int | None:
        return None if self._take_nil() else self._int(what, low, high)

    def _number(self, what: str) -> float:
        self._expect(what, ("int", "float"), "a number")
        return float(cast("float", self._unpacker.unpack()))

    def _text(self, what: str) -> str:
        self._expect(what, ("str",), "a str")
        return cast("str", self._unpacker.unpack())

    def _take_nil(self) -> bool:
        if self._kind() == "nil":
            self._unpacker.unpack()
            return True
        return False

    def _expect(self, what: str, kinds: tuple[str, ...], expected: str) -> None:
        kind = self._kind()
        if kind not in kinds:
            raise self._error(f"{what} must be {expected}, got a msgpack {kind}")

    def _kind(self) -> str:
        position = self._position()
        if position >= len(self._payload):
            raise self._error(f"the payload ends after {position} bytes, inside the batch")
        return _KINDS[self._payload[position]]

    def _error(self, detail: str) -> CorruptEventBatchError:
        return CorruptEventBatchError(f"not a KV event batch ({len(self._payload)} bytes): {detail}")

    def _left(self) -> int:
        return len(self._payload) - self._position()

    def _position(self) -> int:
        return self._unpacker.tell()


#: The largest buffer and high-water mark: ZMQ keeps its socket options in a C ``int``.
_MAX_C_INT: Final = 2**31 - 1
#: The most bytes of one frame of a replay request (the request is 8 bytes): a peer sending
#: more is disconnected by ZMQ before its frame is buffered.
_MAX_REQUEST_FRAME_BYTES: Final = 64


def _check_endpoint(name: str, endpoint: object) -> str:
    if not isinstance(endpoint, str):
        raise InvalidTypeError(
            f"{name} must be a str 'transport://address' (e.g. 'tcp://127.0.0.1:5557'), got {type(endpoint).__name__}"
        )
    transport, separator, address = endpoint.partition("://")
    if not (transport and separator and address) or "\0" in endpoint:
        raise InvalidArgumentError(
            f"{name} must be 'transport://address' without NUL characters (e.g. 'tcp://127.0.0.1:5557'), "
            f"got {endpoint!r}"
        )
    return endpoint


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int in [1, {_MAX_C_INT}], got {type(value).__name__}: {value!r}")
    if not 1 <= value <= _MAX_C_INT:
        raise InvalidArgumentError(f"{name} must be an int in [1, {_MAX_C_INT}], got {value!r}")
    return value


class ZmqEventPublisher:
    """Publishes cache events on a ZMQ PUB socket with sequence numbers, and replays the
    last ``buffer_size`` batches on request. Pass it to ``manager.subscribe``.

    Every argument is checked before any socket is made: a refused one leaves nothing open.

    Args:
        endpoint: where the PUB socket binds, ``"transport://address"``
            (``"tcp://127.0.0.1:*"`` picks a free loopback port; :attr:`endpoint` tells which).
        replay_endpoint: where the ROUTER socket answering replay requests binds, or ``None``
            for no replay.
        buffer_size: batches retained for replay, in ``[1, 2**31 - 1]``.
        topic: the first frame of every message (``bytes``; encode a str first).
        send_high_water_mark: messages ZMQ queues per subscriber before dropping, in
            ``[1, 2**31 - 1]``.

    Raises:
        InvalidTypeError: an endpoint that is not a str, a ``topic`` that is not bytes, a
            size that is not an int (``bool`` is not).
        InvalidArgumentError: a size out of its range, an endpoint not of the form
            ``transport://address``, or one ZMQ cannot bind (the message names it).
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
        endpoint = _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            replay_endpoint = _check_endpoint("replay_endpoint", replay_endpoint)
        buffer_size = _check_count("buffer_size", buffer_size)
        send_high_water_mark = _check_count("send_high_water_mark", send_high_water_mark)
        if not isinstance(topic, bytes):
            hint = f" (use {topic!r}.encode())" if isinstance(topic, str) else ""
            raise InvalidTypeError(f"topic must be bytes, got {type(topic).__name__}: {topic!r}{hint}")
        self._topic = topic
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._next_seq = 0
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        self._pub = self._context.socket(zmq.PUB)
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, send_high_water_mark)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            self.endpoint: str = self._last_endpoint(self._pub)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._router = self._context.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_FRAME_BYTES)
                self._router.bind(replay_endpoint)
                self.replay_endpoint = self._last_endpoint(self._router)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise InvalidArgumentError(
                f"cannot bind the event publisher's sockets ({endpoint!r}, {replay_endpoint!r}): {exc}"
            ) from exc
        except BaseException:
            self._close_sockets()
            raise
        if self._router is not None:
            self._replay_thread = threading.Thread(target=self._serve_replays, name="kvcache-event-replay", daemon=True)
            try:
                self._replay_thread.start()
            except BaseException:
                self._replay_thread = None
                self._close_sockets()
                raise

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
            identity, start = self._receive_request(router)
            retained: list[tuple[int, bytes]] = []
            if start is not None:
                with self._lock:
                    retained = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            for seq, payload in retained:
                router.send_multipart((identity, b"", _SEQ.pack(seq), payload))
            router.send_multipart((identity, b"", _SEQ.pack(END_OF_REPLAY), b""))

    @staticmethod
    def _receive_request(router: zmq.Socket[bytes]) -> tuple[bytes, int | None]:
        """The requester's identity and the start it asks for: ``None`` unless the request's
        last frame is a sequence number >= 0 (8 bytes, big-endian). Frames are read one at a
        time and only the last is kept, whatever their count."""
        identity = router.recv()
        request = b""
        while router.getsockopt(zmq.RCVMORE):
            request = router.recv()
        if len(request) != _SEQ.size:
            return identity, None
        start = cast("int", _SEQ.unpack(request)[0])
        return identity, start if start >= 0 else None
