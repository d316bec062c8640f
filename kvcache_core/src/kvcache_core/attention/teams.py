"""Who runs the shares of a compiled call (the kernel's, the padded gather's): a
:data:`ThreadTeam` runs one callable share per thread, the calling thread among them;
:func:`python_team` is the default, a pool of Python threads each in compiled code without the
GIL. One launch at a time (:data:`LAUNCH_LOCK`): each uses every thread it is given.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from kvcache_core.contract.scalars import check_count
from kvcache_core.errors import InvalidTypeError

__all__ = ["LAUNCH_LOCK", "ThreadTeam", "check_team_call", "max_threads", "python_team"]

#: One launch at a time, held by every launch of compiled code on a team (the kernel, the
#: padded gather): each uses every thread it is given, so two at once would oversubscribe.
LAUNCH_LOCK: Final = threading.Lock()
_workers_lock = threading.Lock()
_workers: ThreadPoolExecutor | None = None


def max_threads() -> int:
    """The most threads a kernel call uses: the CPUs this process may run on."""
    affinity: Callable[[int], set[int]] | None = getattr(os, "sched_getaffinity", None)
    count = len(affinity(0)) if affinity is not None else os.cpu_count()
    return max(1, count or 1)


#: Runs ``share`` on up to ``threads`` threads, the calling thread among them, and returns
#: once every share it started has returned; the first exception any of them raised is
#: raised again. Each share claims the call's work items from one counter until none is
#: left, so a team may start its threads in any order, and a share it has not started
#: when the calling thread's share returns has nothing left to do (it may be skipped).
ThreadTeam = Callable[[Callable[[], None], int], None]


def check_team_call(share: object, threads: object) -> None:
    """What every :data:`ThreadTeam` checks of its call.

    Raises:
        InvalidTypeError: ``share`` is not callable.
        InvalidArgumentError: ``threads`` is not an int >= 1.
    """
    if not callable(share):
        raise InvalidTypeError(f"a team runs a callable share, got {share!r}")
    check_count(threads, "the thread count a team runs on", 1)


def python_team(share: Callable[[], None], threads: int) -> None:
    """The default :data:`ThreadTeam`: the calling thread and ``threads - 1`` threads of a
    pool of Python threads, each running compiled code without the GIL.

    Raises:
        InvalidTypeError, InvalidArgumentError: see :func:`check_team_call`.
    """
    check_team_call(share, threads)
    pool = _worker_pool()
    others = [pool.submit(share) for _ in range(threads - 1)]
    try:
        share()
    finally:
        for future in others:
            if not future.cancel():  # a worker that never started has nothing left to do
                future.result()


def _worker_pool() -> ThreadPoolExecutor:
    """The threads that run the shares after the first (started on demand)."""
    global _workers
    if _workers is None:
        with _workers_lock:
            if _workers is None:
                _workers = ThreadPoolExecutor(max(1, max_threads() - 1), thread_name_prefix="kvcache-attention")
    return _workers
