"""NIXL, behind the few calls a transfer agent makes: register regions, learn a peer, read a
list of chunks from it by a deadline.

NIXL comes with the ``transfer`` extra (``pip install "kvcache-core[transfer]"``), imported as
``nixl`` (the meta package) or as the wheel it bundles (``nixl_cu12``, ``nixl_cu13``). UCX,
its transport, chooses among shared memory, CMA, TCP and RDMA; unless ``UCX_TLS`` is set
already, the agent sets ``UCX_TLS=tcp`` before NIXL starts (:data:`DEFAULT_UCX_TLS`), which
works on every host, loopback included, and needs no shared-memory or ptrace permission.
Set ``UCX_TLS`` yourself (``rc,cuda_copy,tcp``, ...) to let UCX use RDMA or GPU transports.
NIXL's Python logger writes INFO lines to stdout; unless ``NIXL_LOG_LEVEL`` is set, the agent
sets it to ``WARN``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.errors import TransferError

__all__ = ["DEFAULT_UCX_TLS", "NixlEngine", "coalesce", "load_nixl", "nixl_unavailable_reason"]

#: The UCX transports the agent asks for unless ``UCX_TLS`` is set.
DEFAULT_UCX_TLS: Final = "tcp"
#: NIXL's Python log level unless ``NIXL_LOG_LEVEL`` is set (its INFO lines go to stdout).
DEFAULT_NIXL_LOG_LEVEL: Final = "WARN"
_MODULES: Final = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_MEMORY_TYPES: Final = {"cpu": "DRAM", "cuda": "VRAM"}


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _serialized(method: _Method) -> _Method:
    """``method`` under the engine's lock."""

    @functools.wraps(method)
    def locked(self: NixlEngine, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return cast("_Method", locked)


def load_nixl() -> Any:
    """NIXL's Python API module.

    Raises:
        TransferError: NIXL is not installed (the message says how to install it).
    """
    os.environ.setdefault("NIXL_LOG_LEVEL", DEFAULT_NIXL_LOG_LEVEL)
    problems: list[str] = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"{name}: {exc}")
    raise TransferError(
        "kvcache_core.transfer needs NIXL: pip install 'kvcache-core[transfer]' (or nixl-cu12); " + "; ".join(problems)
    )


#: Microseconds NIXL's UCX progress thread waits for network events when it has nothing to do.
#: NIXL's Python API starts it with 0, and then it spins a core per agent, idle or not: on a
#: small machine, the producer's, the consumer's and the rest of the process starve each other.
PROGRESS_WAIT_US: Final = 100
_AGENT_START_LOCK = threading.Lock()


def _start_agent(api: Any, name: str) -> Any:
    """A NIXL agent with the UCX backend whose progress thread waits for events
    (:data:`PROGRESS_WAIT_US`) instead of spinning.

    NIXL's Python wrapper builds its binding's agent config itself and sets the progress
    thread's wait to 0; while the agent is built, the config class is a subclass that keeps
    :data:`PROGRESS_WAIT_US` whatever is assigned (a NIXL without that field starts as is)."""
    config = api.nixl_agent_config(backends=["UCX"])
    bindings: Any = getattr(api, "nixlBind", None)
    base: Any = getattr(bindings, "nixlAgentConfig", None)
    field: Any = getattr(base, "pthrDelay", None)
    if bindings is None or base is None or not hasattr(field, "__set__"):
        return api.nixl_agent(name, config)

    def keep_wait(config: Any, _: object) -> None:
        field.__set__(config, PROGRESS_WAIT_US)

    waiting = type("WaitingAgentConfig", (base,), {"pthrDelay": property(field.__get__, keep_wait)})
    with _AGENT_START_LOCK:  # the binding's class is swapped for this construction only
        bindings.nixlAgentConfig = waiting
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base


def nixl_unavailable_reason() -> str | None:
    """Why NIXL cannot be imported here, or ``None`` when it can."""
    try:
        load_nixl()
    except TransferError as exc:
        return str(exc)
    return None


class NixlEngine:
    """One NIXL agent with the UCX backend; its calls are serialized (the agent runs without
    NIXL's own locking).

    Raises:
        TransferError: NIXL is missing or its agent cannot start.
    """

    def __init__(self, name: str) -> None:
        os.environ.setdefault("UCX_TLS", DEFAULT_UCX_TLS)
        api = load_nixl()
        try:
            self._agent = _start_agent(api, name)
        except Exception as exc:
            raise TransferError(f"the NIXL agent {name!r} could not start: {exc}") from exc
        if "UCX" not in getattr(self._agent, "backends", {"UCX": None}):
            raise TransferError(f"the NIXL agent {name!r} has no UCX backend (its plugins: {self._agent.plugin_list})")
        self.name = name
        self._peers: dict[str, str] = {}
        self._stranded: list[object] = []
        self.lock = threading.RLock()  # serializes the agent's calls

    @_serialized
    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`add_peer`."""
        data: bytes = self._agent.get_agent_metadata()
        return data

    @_serialized
    def register(self, chunks: list[tuple[int, int, int]], device_kind: str) -> Any:
        """Register ``(address, length, device_id)`` chunks; returns what :meth:`deregister` takes.

        Raises:
            TransferError: NIXL refused them.
        """
        try:
            return self._agent.register_memory(
                [(address, length, device, "") for address, length, device in chunks], _MEMORY_TYPES[device_kind]
            )
        except Exception as exc:
            raise TransferError(f"NIXL could not register {len(chunks)} memory regions: {exc}") from exc

    @_serialized
    def deregister(self, registered: Any) -> None:
        """Undo :meth:`register` (best effort: NIXL's own errors are not the caller's)."""
        with contextlib.suppress(Exception):  # nothing more to free on this side
            self._agent.deregister_memory(registered)

    @_serialized
    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its metadata; returns its agent name.

        Raises:
            TransferError: the metadata is not a NIXL agent's.
        """
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"NIXL refused a peer's metadata: {exc}") from exc
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self._peers[peer] = peer
        return peer

    @_serialized
    def forget_peer(self, peer: str) -> None:
        """Drop a peer (its connection and metadata), best effort."""
        if self._peers.pop(peer, None) is not None:
            with contextlib.suppress(Exception):  # already gone
                self._agent.remove_remote_agent(peer)

    @_serialized
    def knows(self, peer: str) -> bool:
        """Whether :meth:`add_peer` learnt ``peer``."""
        return peer in self._peers

    @_serialized
    def read_staged(
        self,
        peer: str,
        remote: npt.NDArray[np.uint64],
        remote_device_kind: str,
        destination: npt.NDArray[np.uint8],
        offsets: npt.NDArray[np.int64],
        deadline: float,
        *,
        pieces: Sequence[int] = (),
        arrived: Callable[[int], None] | None = None,
        also: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None = None,
    ) -> tuple[str | None, bool]:
        """One READ of ``remote`` chunks (``[n, 3]``: address, length, device id) of ``peer``
        into host memory ``destination`` at ``offsets`` (``[n]``, chunk ``i`` at byte
        ``offsets[i]``) and of the chunks ``also[0]`` into ``also[1]`` (host memory this engine
        registered; in the last piece), waited for until ``deadline`` (``time.monotonic()``);
        ``pieces`` and ``arrived`` as :meth:`read_into`. ``destination`` is registered for
        the read only. A transfer NIXL could not abort keeps ``destination`` (and its
        registration) alive for the engine's life, so no late byte lands in freed memory.

        Returns:
            ``(failure, released)`` as :meth:`read_into`.
        """
        base = int(destination.ctypes.data)
        registered = self.register([(base, int(destination.nbytes), 0)], "cpu")
        local = remote.copy()
        local[:, 0] = (offsets + base).astype(np.uint64)
        local[:, 2] = 0
        if also is not None:
            remote, local = np.concatenate([remote, also[0]]), np.concatenate([local, also[1]])
        failure, released = self._read(peer, remote, remote_device_kind, local, "cpu", deadline, pieces, arrived)
        if released:
            self.deregister(registered)
        else:
            self._stranded.append((destination, registered))
        return failure, released

    @_serialized
    def read_into(
        self,
        peer: str,
        remote: npt.NDArray[np.uint64],
        remote_device_kind: str,
        local: npt.NDArray[np.uint64],
        device_kind: str,
        deadline: float,
        *,
        pieces: Sequence[int] = (),
        arrived: Callable[[int], None] | None = None,
    ) -> tuple[str | None, bool]:
        """One READ of ``remote`` chunks of ``peer`` into ``local`` chunks (``[n, 3]`` each)
        of memory this engine registered, waited for until ``deadline``.

        ``pieces`` (ascending row indices) split the rows into transfers posted together and
        waited for in order; ``arrived(i)`` runs as soon as piece ``i`` has landed, while the
        later ones are still in flight (a consumer checksums what arrived meanwhile).

        Returns:
            ``(failure, released)``: why the transfer failed or did not finish in time
            (``None`` when it completed), and whether NIXL released it (false: it could not
            abort one still in flight, and ``local`` may still be written).
        """
        return self._read(peer, remote, remote_device_kind, local, device_kind, deadline, pieces, arrived)

    def _read(
        self,
        peer: str,
        remote: npt.NDArray[np.uint64],
        remote_device_kind: str,
        local: npt.NDArray[np.uint64],
        device_kind: str,
        deadline: float,
        pieces: Sequence[int],
        arrived: Callable[[int], None] | None,
    ) -> tuple[str | None, bool]:
        agent = self._agent
        bounds = [0, *(int(row) for row in pieces if 0 < row < len(remote)), len(remote)]
        starts = _chunk_starts(local, remote, bounds[1:-1])  # each piece's first row starts a chunk
        local, remote = _merged(local, remote, starts)
        bounds = np.searchsorted(starts, bounds).tolist()
        handles: list[Any] = []
        state = "ERR"
        try:
            for first, stop in itertools.pairwise(bounds):
                local_descs = agent.get_xfer_descs(local[first:stop], _MEMORY_TYPES[device_kind])
                remote_descs = agent.get_xfer_descs(remote[first:stop], _MEMORY_TYPES[remote_device_kind])
                handles.append(agent.initialize_xfer("READ", local_descs, remote_descs, peer))
                state = agent.transfer(handles[-1])
                if state not in ("PROC", "DONE"):
                    break
            else:
                for index, handle in enumerate(handles):
                    state = _wait(agent, handle, deadline)
                    if state != "DONE":
                        break
                    if arrived is not None:
                        arrived(index)
        except Exception as exc:
            state = f"ERR ({exc})"
        released = all([_release(agent, handle) for handle in handles])  # every one, even after a failure
        if state == "PROC":
            return f"the NIXL read of {len(remote)} chunks from {peer!r} did not finish in time", released
        if state != "DONE":
            return f"the NIXL read from {peer!r} failed (state {state}): the producer may be gone", released
        return None, released


def coalesce(
    local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64]
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """``local`` and ``remote`` chunks (``[n, 3]``: address, length, device id; chunk ``i``
    of one goes to chunk ``i`` of the other) with each run of chunks that follow one another
    on both sides (consecutive blocks of a layer on both sides) as one chunk: the same bytes
    in fewer descriptors, each of which costs NIXL work to post."""
    return _merged(local, remote, _chunk_starts(local, remote, ()))


def _chunk_starts(
    local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64], apart: Sequence[int]
) -> npt.NDArray[np.int64]:
    """The rows that start a chunk of :func:`coalesce` (increasing, 0 first; every row when
    the lengths differ between the sides), rows ``apart`` among them whatever they follow."""
    count = len(local)
    if count < 2 or not np.array_equal(local[:, 1], remote[:, 1]):
        return np.arange(count, dtype=np.int64)
    ends_local, ends_remote = local[:-1, 0] + local[:-1, 1], remote[:-1, 0] + remote[:-1, 1]
    joined = (
        (ends_local == local[1:, 0])
        & (ends_remote == remote[1:, 0])
        & (local[:-1, 2] == local[1:, 2])
        & (remote[:-1, 2] == remote[1:, 2])
    )
    joined[np.asarray(apart, dtype=np.int64) - 1] = False
    return np.flatnonzero(np.concatenate([[True], ~joined])).astype(np.int64)


def _merged(
    local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64], starts: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """The chunks starting at rows ``starts`` as one each (the inputs themselves when every
    row starts one)."""
    if len(starts) == len(local):
        return local, remote
    lengths = np.add.reduceat(local[:, 1], starts)
    merged_local, merged_remote = local[starts].copy(), remote[starts].copy()
    merged_local[:, 1] = lengths
    merged_remote[:, 1] = lengths
    return merged_local, merged_remote


def _wait(agent: Any, handle: Any, deadline: float) -> str:
    """The transfer's state once it is no longer in progress, or ``"PROC"`` at ``deadline``."""
    state: str = agent.check_xfer_state(handle)
    pause = 20e-6
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(pause)  # the transfer progresses in NIXL's thread; back off up to 1 ms
        pause = min(pause * 2, 1e-3)
        state = agent.check_xfer_state(handle)
    return state


def _release(agent: Any, handle: Any) -> bool:
    try:
        agent.release_xfer_handle(handle)
    except Exception:  # a transfer still in flight could not be aborted
        return False
    return True
