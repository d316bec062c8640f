"""The side channel of transfer agents: small msgpack requests and replies over ZMQ.

A producer's :class:`ChannelServer` answers in its own thread (one REP socket bound to one
address, loopback by default, never every interface unless asked); a consumer's
:func:`ask` sends one request on a fresh REQ socket (:class:`Requests`: on the one kept for
that producer) and waits for the reply no longer than its deadline, so a producer that is
gone costs a timeout, never a hang. Every message is a
msgpack map parsed strictly (:func:`decode`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Final, cast

import msgpack
import zmq

from kvcache_core.errors import TransferError

# msgpack ships no type information.
_packb = cast("Callable[..., bytes]", msgpack.packb)  # pyright: ignore[reportUnknownMemberType]
_unpackb = cast("Callable[..., object]", msgpack.unpackb)  # pyright: ignore[reportUnknownMemberType]

__all__ = ["MAX_MESSAGE_BYTES", "ChannelServer", "Requests", "ask", "decode", "encode"]

#: The largest side-channel message accepted (tickets ride on it).
MAX_MESSAGE_BYTES: Final = 64 << 20

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def encode(message: dict[str, Any]) -> bytes:
    """A message's wire form."""
    packed = _packb(message, use_bin_type=True)
    return packed


def decode(payload: bytes, what: str) -> dict[str, Any]:
    """A message from its wire form: a msgpack map with str keys.

    Raises:
        TransferError: too large, not msgpack, or not a map.
    """
    if len(payload) > MAX_MESSAGE_BYTES:
        raise TransferError(f"{what} is {len(payload)} bytes, more than {MAX_MESSAGE_BYTES}")
    try:
        message = _unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # every malformed payload is one refusal
        raise TransferError(f"{what} is not valid msgpack: {exc}") from None
    if type(message) is not dict:
        raise TransferError(f"{what} is not a msgpack map, got {type(message).__name__}")
    return cast("dict[str, Any]", message)


class ChannelServer:
    """A REP socket bound to ``tcp://host:port`` (``port=0``: a free one), answering each
    request with ``handler(message)`` in a daemon thread; ``tick()`` runs between requests,
    at least every ``tick_seconds``.

    Raises:
        TransferError: the address cannot be bound.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        host: str,
        port: int,
        handler: Handler,
        tick: Callable[[], None],
        tick_seconds: float,
    ) -> None:
        self._handler, self._tick, self._tick_ms = handler, tick, max(1, int(tick_seconds * 1000))
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
            else:
                self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._socket.close()
            raise TransferError(f"cannot bind the transfer side channel to {host}:{port}: {exc}") from exc
        endpoint = str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self.address: str = endpoint
        self._wake_address = f"inproc://kvcache-transfer-{id(self)}"
        self._wake = context.socket(zmq.PULL)
        self._wake.bind(self._wake_address)
        self._context = context
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"kvcache-transfer {endpoint}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        try:
            while not self._stopping:
                ready = dict(poller.poll(self._tick_ms))
                self._tick()
                if self._wake in ready or self._stopping:
                    break
                if self._socket in ready:
                    payload = self._socket.recv()
                    try:
                        reply = self._handler(decode(payload, "a side-channel request"))
                    except Exception as exc:  # the reply carries every failure; the server lives on
                        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                    self._socket.send(encode(reply))
        finally:
            self._socket.close()
            self._wake.close()

    def close(self) -> None:
        """Stop answering and close the socket (waits for the thread)."""
        if self._stopping:
            return
        self._stopping = True
        waker = self._context.socket(zmq.PUSH)
        waker.setsockopt(zmq.LINGER, 0)
        waker.connect(self._wake_address)
        try:
            waker.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the thread stops at its next tick anyway
        finally:
            waker.close()
        self._thread.join()


def ask(context: zmq.Context[Any], address: str, message: dict[str, Any], deadline: float) -> dict[str, Any]:
    """Send ``message`` to the server at ``address`` and return its reply, by ``deadline``
    (``time.monotonic()`` seconds), on a fresh socket.

    Raises:
        TransferError: no reply by the deadline, a malformed reply, or one with ``ok`` false
            (its error in the message).
    """
    socket = _request_socket(context, address)
    try:
        reply = _exchange(socket, address, message, deadline)
    finally:
        socket.close()
    return _accepted(reply, address, message)


class Requests:
    """:func:`ask`, keeping one connected socket per server between requests (a fresh one
    costs a connection handshake each time); a socket whose request failed or timed out is
    closed, the next request to that server connects again. Usable from several threads (a
    socket is taken out while in use)."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self._context = context
        self._idle: dict[str, zmq.Socket[Any]] = {}
        self._lock = threading.Lock()

    def ask(self, address: str, message: dict[str, Any], deadline: float) -> dict[str, Any]:
        """As :func:`ask`."""
        with self._lock:
            socket = self._idle.pop(address, None)
        if socket is None:
            socket = _request_socket(self._context, address)
        try:
            reply = _exchange(socket, address, message, deadline)
        except BaseException:
            socket.close()
            raise
        with self._lock:
            kept = self._idle.setdefault(address, socket)
        if kept is not socket:
            socket.close()
        return _accepted(reply, address, message)

    def close(self) -> None:
        """Close the kept sockets (idempotent)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for socket in idle.values():
            socket.close()


def _request_socket(context: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    socket: zmq.Socket[Any] = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    try:
        socket.connect(address)
    except BaseException:
        socket.close()
        raise
    return socket


def _exchange(socket: zmq.Socket[Any], address: str, message: dict[str, Any], deadline: float) -> dict[str, Any]:
    socket.send(encode(message))
    remaining_ms = int((deadline - time.monotonic()) * 1000)
    if remaining_ms <= 0 or not socket.poll(remaining_ms, zmq.POLLIN):
        raise TransferError(
            f"the transfer agent at {address} did not answer {message.get('op')!r} in time (gone or busy)"
        )
    return decode(socket.recv(), f"the reply of {address}")


def _accepted(reply: dict[str, Any], address: str, message: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok") is not True:
        error = reply.get("error")
        raise TransferError(f"the transfer agent at {address} refused {message.get('op')!r}: {error!s}"[:500])
    return reply
