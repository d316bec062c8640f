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

from kvcache_core.contract.config import MAX_POOL_SLOTS, MAX_TOKEN_ID
from kvcache_core.errors import CorruptEventBatchError, InvalidArgumentError, InvalidTypeError, PublisherClosedError
from kvcache_core.offload.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

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


def _timestamp_problem(ts: object) -> str | None:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < math.inf:
        return f"ts must be a finite number of seconds >= 0 since the epoch, got {ts!r}"
    return None


def _int_problem(name: str, value: object, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be an int in [{low}, {high}], got {type(value).__name__}"
    if not low <= value <= high:
        return f"{name} = {value} is out of range; valid: [{low}, {high}]"
    return None


def _hash_problem(name: str, value: object) -> str | None:
    if not isinstance(value, bytes):
        return f"{name} must be a {_HASH_BYTES}-byte hash (bytes), got {type(value).__name__}"
    if len(value) != _HASH_BYTES:
        return f"{name} has {len(value)} bytes, a block hash has {_HASH_BYTES}"
    return None


def _event_problem(event: BlockStored | BlockRemoved) -> str | None:
    """What is wrong with ``event``'s fields, or ``None``: the one copy of the rules both
    :func:`encode_event_batch` and :func:`decode_event_batch` hold events to."""
    hashes: object = event.block_hashes
    if not isinstance(hashes, tuple) or not hashes:
        return f"block_hashes must be a non-empty tuple of {_HASH_BYTES}-byte hashes, got {type(hashes).__name__}"
    problem = None
    if not all(type(value) is bytes and len(value) == _HASH_BYTES for value in hashes):
        problem = next(
            (found for index, value in enumerate(hashes) if (found := _hash_problem(f"block_hashes[{index}]", value))),
            None,
        )
    if problem is None and isinstance(event, BlockStored):
        problem = _stored_problem(event, len(hashes))
    if problem is None:
        medium: object = event.medium
        if not isinstance(medium, str) or not medium:
            got = repr(medium) if isinstance(medium, str) else type(medium).__name__
            problem = f"medium must be a non-empty str ('pool' or a tier's name), got {got}"
    return problem


def _stored_problem(event: BlockStored, block_count: int) -> str | None:
    """The rules of a :class:`BlockStored`'s own fields (its hashes and medium checked)."""
    if event.parent_block_hash is not None and (problem := _hash_problem("parent_block_hash", event.parent_block_hash)):
        return problem
    if problem := _int_problem("block_size", event.block_size, 1, MAX_POOL_SLOTS):
        return problem
    if event.lora_id is not None and (problem := _int_problem("lora_id", event.lora_id, 0, _MAX_INT64)):
        return problem
    tokens: object = event.token_ids
    if not isinstance(tokens, tuple):
        return f"token_ids must be a tuple of ints, got {type(tokens).__name__}"
    if len(tokens) != block_count * event.block_size:
        return (
            f"token_ids holds {len(tokens)} ids; {block_count} blocks of {event.block_size} tokens have "
            f"{block_count * event.block_size}"
        )
    if not tokens or (set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) <= MAX_TOKEN_ID):
        return None  # the common case, checked at C speed: events are published under the manager's lock
    return next(
        (
            found
            for index, token in enumerate(tokens)
            if (found := _int_problem(f"token_ids[{index}]", token, 0, MAX_TOKEN_ID))
        ),
        None,
    )


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

    Each event is held to the rules :func:`decode_event_batch` checks, so what is encoded
    decodes.

    Raises:
        InvalidTypeError: ``events`` is not a sequence of cache events.
        InvalidArgumentError: ``ts`` is not a finite number >= 0, or a field of an event
            is out of its range (the message names the event and the field).
    """
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise InvalidTypeError(f"events must be a sequence of cache events, got {type(events).__name__}")
    if ts is not None and (problem := _timestamp_problem(ts)):
        raise InvalidArgumentError(problem)
    fields: list[list[object]] = []
    for index, event in enumerate(events):
        fields.append(_event_fields(event))
        if not isinstance(event, AllBlocksCleared) and (problem := _event_problem(event)):
            raise InvalidArgumentError(f"cannot encode event {index} ({type(event).__name__}): {problem}")
    return _packb([time.time() if ts is None else float(ts), fields, None], use_bin_type=True)


def decode_event_batch(payload: bytes | bytearray | memoryview) -> tuple[float, list[CacheEvent]]:
    """The timestamp and events of a payload :func:`encode_event_batch` made.

    The payload comes from outside, so it is parsed strictly: each value's msgpack type is
    checked before the value is built (an int is never taken for bytes, a ``bool`` never
    for an int), every count is bounded by the bytes left in the payload, and every value
    by its range: one or more hashes of 32 bytes, token ids in ``[0, MAX_TOKEN_ID]``,
    ``block_size`` in ``[1, MAX_POOL_SLOTS]`` with ``len(block_hashes) * block_size`` token
    ids, ``lora_id`` and ``data_parallel_rank`` ``None`` or in ``[0, 2**63 - 1]``, a finite
    ``ts >= 0``, a non-empty ``medium``; nothing may follow the batch. Decoding costs
    memory in proportion to the payload: a few tens of bytes per payload byte at most (a
    one-byte token id becomes a Python reference), whatever the bytes.

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
    except msgpack.OutOfData as exc:
        raise CorruptEventBatchError(f"not a KV event batch ({len(payload)} bytes): it ends inside a value") from exc
    except (msgpack.UnpackException, ValueError) as exc:  # not msgpack, or a str not UTF-8
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
_INT_FIRST_BYTES: Final = frozenset(byte for byte, kind in enumerate(_KINDS) if kind == "int")


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
        if problem := _timestamp_problem(ts):
            raise self._error(problem)
        count = self._array("the event list", 0)
        events = [self._event(f"event {index}") for index in range(count)]
        rank = None if self._take_nil() else self._int("data_parallel_rank")
        if rank is not None and (problem := _int_problem("data_parallel_rank", rank, 0, _MAX_INT64)):
            raise self._error(problem)
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
        event: BlockStored | BlockRemoved
        if tag == "BlockRemoved":
            event = BlockRemoved(self._hashes(where), self._text(f"the medium of {where}"))
        else:
            block_hashes = self._hashes(where)
            parent = None if self._take_nil() else self._hash(f"the parent_block_hash of {where}")
            token_count = self._array(f"the token_ids of {where}", 0)
            token_ids = self._ints("token_ids", where, token_count)
            block_size = self._int(f"the block_size of {where}")
            lora_id = None if self._take_nil() else self._int(f"the lora_id of {where}")
            event = BlockStored(
                block_hashes, parent, token_ids, block_size, lora_id, self._text(f"the medium of {where}")
            )
        if problem := _event_problem(event):
            raise self._error(f"{where} ({tag}): {problem}")
        return event

    def _hashes(self, where: str) -> tuple[bytes, ...]:
        count = self._array(f"the block_hashes of {where}", 1)
        return tuple(self._hash(f"block_hashes[{index}] of {where}") for index in range(count))

    def _ints(self, name: str, where: str, count: int) -> tuple[int, ...]:
        """``count`` ints, each checked to be one before it is built (names only on failure:
        this is the loop over every token id)."""
        payload, unpack, position = self._payload, self._unpacker.unpack, self._unpacker.tell
        values: list[int] = []
        for index in range(count):
            at = position()
            if at >= len(payload) or payload[at] not in _INT_FIRST_BYTES:
                self._expect(f"{name}[{index}] of {where}", ("int",), "an int")
            values.append(cast("int", unpack()))
        return tuple(values)

    def _hash(self, what: str) -> bytes:
        self._expect(what, ("bin",), f"a {_HASH_BYTES}-byte hash")
        return cast("bytes", self._unpacker.unpack())

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

    def _int(self, what: str) -> int:
        self._expect(what, ("int",), "an int")
        return cast("int", self._unpacker.unpack())

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
        self._closed = False
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
        """The sequence number the next batch will carry (after :meth:`close`: the one it
        would have carried; no batch is published any more)."""
        return self._next_seq

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: a closed publisher refuses to publish."""
        return self._closed

    def __call__(self, event: CacheEvent) -> None:
        """Publish one event (as a batch of one): the form ``manager.subscribe`` calls.

        Raises:
            PublisherClosedError: the publisher was closed.
            InvalidTypeError, InvalidArgumentError: as :meth:`publish`.
        """
        self.publish((event,))

    def publish(self, events: Sequence[CacheEvent]) -> int:
        """Publish ``events`` as one batch; return its sequence number.

        Raises:
            PublisherClosedError: the publisher was closed (nothing is sent, no sequence
                number is used).
            InvalidTypeError, InvalidArgumentError: ``events`` cannot be encoded (see
                :func:`encode_event_batch`); nothing is sent.
        """
        self._refuse_if_closed()
        payload = encode_event_batch(events)
        with self._lock:
            self._refuse_if_closed()  # a close() that ran while the batch was encoded
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            # No room queued for some subscriber: it sees the gap and asks for a replay.
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart((self._topic, _SEQ.pack(seq), payload), flags=zmq.NOBLOCK)
        return seq

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent). Every later
        :meth:`publish` raises :class:`~kvcache_core.errors.PublisherClosedError`."""
        with self._lock:  # no publish is sending once this is set
            self._closed = True
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join()
            self._replay_thread = None
        self._close_sockets()

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise PublisherClosedError(
                f"the event publisher at {self.endpoint!r} is closed: it publishes nothing more "
                f"(unsubscribe it from the manager before closing it)"
            )

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
