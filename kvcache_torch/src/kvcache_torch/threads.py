"""The compiled kernel's threads on CPU: torch's own OpenMP team.

torch runs its CPU operators on an OpenMP team, and after each parallel operator the
team's threads keep spinning for a while, waiting for the next one (libgomp's default
wait policy). The kernel's default team (:func:`kvcache_core.attention.kernel.python_team`)
is a second set of threads: inside a model, where every attention call follows torch's
projections, its worker shares a core with a spinning torch thread, and the call took
twice as long (1.25 ms against 0.61 ms alone for an 8-request ragged decode layer on 2
cores). Run on torch's team instead, the threads that spin are the ones that take the
work: 0.67 ms after a projection.

:func:`torch_team` starts the shares with ``GOMP_parallel`` of the OpenMP runtime torch
loaded (libgomp's entry point, also exported by LLVM's and Intel's runtimes), through
``ctypes``: the calling thread and the pool's threads each run one share (a Python
callable that enters compiled code without the GIL). The kernel's shares go further:
``team.run_entry(entry, data, threads)`` hands ``GOMP_parallel`` a C function
(:mod:`kvcache_core.attention._kernel_entry`), so no thread runs Python or takes the GIL.
Through Python callbacks each thread must hold the GIL a moment, and inside a model, caches
cold, the calling thread's share began 55-77 us into the region; an 8-request decode layer's
kernel call took 537-546 us that way and 499-503 us from C (AMD EPYC, Zen 5, 2 cores; 8-11 us
less warm). Nothing process-wide is configured.
Where torch's parallel backend is not OpenMP, or its runtime is not found among the
libraries this process has loaded, it is ``None`` and the kernel keeps its default team.
In a process forked after the team ran (GNU OpenMP's threads do not survive a fork: a
parallel region there never ends), the team hands the call to the default team instead.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
from collections.abc import Callable
from typing import Final

import torch

from kvcache_core.attention.kernel import ThreadTeam, check_team_call, python_team
from kvcache_core.contract.scalars import check_count

__all__ = ["OPENMP_ENTRY", "openmp_runtime", "torch_team"]

#: The entry point that starts a parallel region (fn, data, threads, flags).
OPENMP_ENTRY: Final = "GOMP_parallel"
_RUNTIME_NAMES: Final = ("libgomp", "libiomp5", "libomp")
_Body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
#: ``GOMP_parallel`` called with a C function's address (no Python callback).
_RawEntry = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)


def _loaded_libraries() -> set[str] | None:
    """The real paths of the shared libraries mapped into this process (``None`` where
    ``/proc/self/maps`` cannot be read)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            fields = [line.split(None, 5) for line in maps]
    except OSError:
        return None
    return {os.path.realpath(parts[5].strip()) for parts in fields if len(parts) == 6}


def openmp_runtime() -> str | None:
    """The path of the OpenMP runtime torch runs its CPU operators on, or ``None`` where
    torch's parallel backend is not OpenMP or no such runtime is loaded from torch's own
    folders (a runtime merely present on disk would be a second team, not torch's)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    root = os.path.dirname(os.path.realpath(torch.__file__))
    candidates = [
        path
        for folder in (os.path.join(root, "lib"), root + ".libs")
        for name in _RUNTIME_NAMES
        for path in sorted(glob.glob(os.path.join(folder, name + "*")))
    ]
    loaded = _loaded_libraries()
    for path in candidates:
        if loaded is None or os.path.realpath(path) in loaded:
            return path
    return None


class _OpenMPTeam:
    """A :data:`~kvcache_core.attention.kernel.ThreadTeam` over ``GOMP_parallel`` (a call
    checks its arguments as :func:`~kvcache_core.attention.kernel.check_team_call` does)."""

    def __init__(self, entry: Callable[..., None], raw: Callable[..., None] | None = None) -> None:
        self._entry, self._raw = entry, raw
        self._lock = threading.Lock()  # one region at a time: the share and errors are per call
        self._share: Callable[[], None] | None = None
        self._errors: list[BaseException] = []
        self._pinned: set[int] = set()  # threads whose Python thread state is kept
        self._pid = os.getpid()
        self._caller = 0  # the thread that started the current region (it has a thread state)
        self._body = _Body(self._run)  # kept alive as long as the team

    def _run(self, _data: int | None) -> None:
        ident = threading.get_ident()
        if ident != self._caller and ident not in self._pinned:
            # ctypes gives one of the team's threads (Python never started them) a thread
            # state for the length of each callback, made and freed every call: 30 us of the
            # 35 a region cost. One more hold, never let go, keeps it for the thread's life.
            self._pinned.add(ident)
            ctypes.pythonapi.PyGILState_Ensure()
        share = self._share
        if share is None:
            return
        try:
            share()
        except BaseException as error:  # a ctypes callback cannot raise: kept, raised by __call__
            self._errors.append(error)

    def run_entry(self, entry: int, data: int, threads: int) -> bool:
        """Run the C function at ``entry`` (``void entry(void *data)``) on ``threads`` threads
        of the team, the calling one among them, with no Python on any of them (nor the GIL,
        which the call releases); False, nothing run, in a forked child or where the runtime's
        entry point has no address.

        Raises:
            InvalidArgumentError: ``entry`` or ``data`` not a nonzero address (an int >= 1),
                ``threads`` not an int >= 1; nothing runs.
        """
        check_count(entry, "the address of a team's C entry", 1)
        check_count(data, "the address of a C entry's data", 1)
        check_count(threads, "the thread count a team runs on", 1)
        if self._raw is None or os.getpid() != self._pid:
            return False
        with self._lock:
            self._raw(entry, data, threads, 0)
        return True

    def __call__(self, share: Callable[[], None], threads: int) -> None:
        check_team_call(share, threads)
        if os.getpid() != self._pid:  # a forked child: GNU OpenMP's threads did not come along
            python_team(share, threads)
            return
        with self._lock:
            self._share, self._errors, self._caller = share, [], threading.get_ident()
            try:
                self._entry(self._body, None, threads, 0)
            finally:
                self._share = None
            if self._errors:
                raise self._errors[0]


@functools.cache
def torch_team() -> ThreadTeam | None:
    """The kernel's team on torch's OpenMP threads (see the module docstring), or ``None``
    where there is none to join."""
    path = openmp_runtime()
    if path is None:
        return None
    try:
        entry = getattr(ctypes.CDLL(path), OPENMP_ENTRY)
    except (OSError, AttributeError):
        return None
    entry.argtypes = [_Body, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    entry.restype = None
    address = ctypes.cast(entry, ctypes.c_void_p).value
    raw = None if address is None else _RawEntry(address)
    return _OpenMPTeam(entry, raw)
