"""Leases: the exported requests a producer keeps pinned until a consumer acknowledges them or
they expire.

A lease pins a request's blocks by holding a fork of it (a request of its own, named
:data:`LEASE_PREFIX` + the lease id, sharing every block): while it lives, no block can be
evicted, reused or rewritten (a write into a shared block copies it first), whatever the
exported request does. Releasing the lease deallocates the fork: blocks the prefix cache
holds stay cached, the others go back to the free list once nobody else holds them.
"""

from __future__ import annotations

import threading
import time
from typing import Final

__all__ = ["LEASE_PREFIX", "Leases"]

#: The request id prefix of the forks that pin exported requests.
LEASE_PREFIX: Final = "kvcache-transfer-lease-"


class Leases:
    """Live leases: lease id -> (its fork's request id, its end in ``time.monotonic()``);
    thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ends: dict[str, tuple[str, float]] = {}

    def add(self, lease: str, request_id: str, seconds: float) -> None:
        """Start a lease of ``seconds``."""
        with self._lock:
            self._ends[lease] = (request_id, time.monotonic() + seconds)

    def alive(self, lease: str) -> bool:
        """Whether ``lease`` is live and not past its end."""
        with self._lock:
            entry = self._ends.get(lease)
            return entry is not None and entry[1] > time.monotonic()

    def take(self, lease: str) -> str | None:
        """End ``lease`` now; its fork's request id, or ``None`` when it had ended."""
        with self._lock:
            entry = self._ends.pop(lease, None)
        return None if entry is None else entry[0]

    def take_expired(self) -> list[str]:
        """End every lease past its end; their forks' request ids."""
        now = time.monotonic()
        with self._lock:
            expired = [lease for lease, (_, end) in self._ends.items() if end <= now]
            return [self._ends.pop(lease)[0] for lease in expired]

    def take_all(self) -> list[str]:
        """End every lease; their forks' request ids."""
        with self._lock:
            ids = [request_id for request_id, _ in self._ends.values()]
            self._ends.clear()
        return ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._ends)
