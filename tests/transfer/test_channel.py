"""The side channel's requests (``kvcache_core.transfer.channel.Requests``): one connection
kept per server between requests; a refusal or a server that does not answer costs a
``TransferError`` (by the deadline), after which requests go on as before."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcache_core.errors import TransferError
from tests.transfer.support import needs_transfer

pytestmark = [needs_transfer, pytest.mark.xdist_group("transfer")]

zmq = pytest.importorskip("zmq")


class _Server:
    """A ROUTER answering each request (``ok`` unless it asks to be refused) and recording
    the connection each came over (ZMQ names every connection of a ROUTER apart)."""

    def __init__(self, context: Any) -> None:
        from kvcache_core.transfer.channel import decode, encode

        self.connections: list[bytes] = []
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()

        def serve() -> None:
            try:
                while not self._stop.is_set():
                    if not router.poll(50):
                        continue
                    peer, empty, payload = router.recv_multipart()
                    self.connections.append(peer)
                    message = decode(payload, "a request")
                    reply = {"ok": not message.get("refuse"), "echo": message.get("n"), "error": "asked to"}
                    router.send_multipart([peer, empty, encode(reply)])
            finally:
                router.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.fixture
def context() -> Iterator[Any]:
    context = zmq.Context()
    yield context
    context.term()


def _silent_address() -> str:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def test_requests_keep_one_connection_per_server_and_go_on_after_failures(context: Any) -> None:
    from kvcache_core.transfer.channel import Requests

    server = _Server(context)
    requests = Requests(context)
    try:

        def ask(n: int, **extra: object) -> object:
            return requests.ask(server.address, {"n": n, **extra}, time.monotonic() + 60)["echo"]

        assert [ask(n) for n in range(5)] == list(range(5))
        assert len(set(server.connections)) == 1, "five requests over one connection"
        with pytest.raises(TransferError, match="refused None: asked to"):
            ask(5, refuse=True)
        assert ask(6) == 6
        assert len(set(server.connections)) == 1, "a refusal is an answer: the connection stays"
        with pytest.raises(TransferError, match="did not answer 'ping' in time"):
            requests.ask(_silent_address(), {"op": "ping"}, time.monotonic() + 0.2)
        requests.close()
        assert ask(7) == 7  # connects again
        assert len(set(server.connections)) == 2
    finally:
        requests.close()
        server.close()
