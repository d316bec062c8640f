"""The write side of :class:`~kvcache_core.offload.redis_tier.RedisTier`: a bounded queue of
blocks a background thread writes to the server in pipelined batches, so a demotion never
waits for the network; and the breaker that keeps a failed server untried for a while.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvcache_core.offload.prefix_file import BlockRecord

__all__ = ["WRITE_BATCH", "Breaker", "WriteQueue"]

#: Records written per pipelined batch by the background writer.
WRITE_BATCH = 64
#: Seconds an idle background writer waits for work before its thread ends.
_IDLE_S = 1.0


class Breaker:
    """Open for ``retry_after_s`` seconds after a failure: the server is not tried meanwhile."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self._until = 0.0

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self._until

    def trip(self) -> None:
        self._until = time.monotonic() + self.retry_after_s


class WriteQueue:
    """Blocks waiting to be written (at most ``limit_bytes`` of K/V), served from here until
    written, and server keys to delete; a daemon thread (started on demand, ended when idle
    or cleared) writes them.

    Args:
        name: for the thread's name.
        client: the redis-py client that writes (``pipeline``, ``set``, ``delete``).
        limit_bytes: the K/V bytes queued at most.
        ttl_ms: each record's time to live (``None``: none).
        breaker: shared with the reads; a failed write trips it, and while it is open
            writes are dropped.
        encode: a record's value (:func:`~kvcache_core.offload.prefix_file.encode_blocks`).
    """

    def __init__(
        self,
        name: str,
        client: Any,
        limit_bytes: int,
        ttl_ms: int | None,
        breaker: Breaker,
        encode: Callable[[BlockRecord], bytes],
    ) -> None:
        self._name = name
        self._client = client
        self._limit = limit_bytes
        self._ttl_ms = ttl_ms
        self._breaker = breaker
        self._encode = encode
        self._lock = threading.Condition()
        # key -> (server key, record); written in the order keys were first queued.
        self._pending: dict[bytes, tuple[bytes, BlockRecord]] = {}
        self._order: deque[bytes] = deque()
        self._bytes = 0
        self._doomed: list[bytes] = []
        self._deleting = 0  # deletions taken by a write under way
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.written = self.dropped = self.errors = 0

    @property
    def queued(self) -> tuple[int, int]:
        """Blocks queued now and their K/V bytes."""
        with self._lock:
            return len(self._pending), self._bytes

    def offer(self, key: bytes, server_key: bytes, record: BlockRecord) -> bool:
        """Queue ``record`` (replacing a queued one of ``key``); ``False`` (dropped, counted)
        when it would pass the limit."""
        with self._lock:
            previous = self._pending.get(key)
            freed = previous[1].nbytes if previous is not None else 0
            if self._bytes - freed + record.nbytes > self._limit:
                self.dropped += 1
                return False
            self._pending[key] = (server_key, record)
            self._bytes += record.nbytes - freed
            if previous is None:
                self._order.append(key)
            self._start()
        return True

    def get(self, key: bytes) -> BlockRecord | None:
        """The queued record of ``key``, or ``None``."""
        with self._lock:
            pending = self._pending.get(key)
        return None if pending is None else pending[1]

    def held(self, keys: Iterable[bytes]) -> set[bytes]:
        """Those of ``keys`` queued now."""
        with self._lock:
            return {key for key in keys if key in self._pending}

    def cancel(self, key: bytes) -> None:
        """Forget the queued record of ``key`` (a write under way still lands)."""
        with self._lock:
            pending = self._pending.pop(key, None)
            if pending is not None:
                self._bytes -= pending[1].nbytes
                self._lock.notify_all()

    def doom(self, server_key: bytes) -> None:
        """Delete ``server_key`` from the server (a refused value) with the next batch."""
        with self._lock:
            self._doomed.append(server_key)
            self._start()

    def clear(self, join_s: float) -> None:
        """Drop everything queued (counted) and stop the thread, waiting at most ``join_s``
        for a write under way (it ends by itself within its timeout)."""
        with self._lock:
            self.dropped += len(self._pending)
            self._pending.clear()
            self._order.clear()
            self._doomed.clear()
            self._bytes = 0
            self._stopping = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is queued (written or dropped), at most ``timeout_s`` seconds;
        whether nothing is."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending or self._doomed or self._deleting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _start(self) -> None:
        """Wake the writer, starting its thread if none runs (with the lock held)."""
        self._stopping = False
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=f"kvcache-redis-{self._name}", daemon=True)
            self._thread.start()
        self._lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._order and not self._doomed and not self._stopping:
                    self._lock.wait(_IDLE_S)
                if self._stopping or (not self._order and not self._doomed):
                    if self._thread is threading.current_thread():
                        self._thread = None
                    self._lock.notify_all()
                    return
                batch: list[tuple[bytes, bytes, BlockRecord]] = []
                while self._order and len(batch) < WRITE_BATCH:
                    key = self._order.popleft()
                    pending = self._pending.get(key)
                    if pending is not None:
                        batch.append((key, *pending))
                doomed, self._doomed = self._doomed, []
                self._deleting = len(doomed)
            self._write(batch, doomed)

    def _write(self, batch: list[tuple[bytes, bytes, BlockRecord]], doomed: list[bytes]) -> None:
        """Write ``batch`` and delete ``doomed`` in one pipeline; then the batch leaves the
        queue (written, or dropped when the write failed or the breaker is open)."""
        written = False
        if not self._breaker.is_open:
            try:
                pipe = self._client.pipeline(transaction=False)
                for _, server_key, record in batch:
                    pipe.set(server_key, self._encode(record), px=self._ttl_ms)
                if doomed:
                    pipe.delete(*doomed)
                pipe.execute()
                written = True
            except Exception:  # the server failed: the batch is dropped, counted
                self._breaker.trip()
                with self._lock:
                    self.errors += 1
        with self._lock:
            self._deleting = 0
            for key, _, record in batch:
                pending = self._pending.get(key)
                if pending is not None and pending[1] is record:  # not replaced or cancelled meanwhile
                    del self._pending[key]
                    self._bytes -= record.nbytes
                    if written:
                        self.written += 1
                    else:
                        self.dropped += 1
            self._lock.notify_all()
