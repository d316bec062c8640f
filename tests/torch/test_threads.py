"""The compiled kernel runs on torch's own OpenMP team on CPU (kvcache_torch.threads)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcache_core import InvalidArgumentError
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.attention import kernel_plan
from kvcache_core.errors import InvalidTypeError
from kvcache_torch import threads
from tests.process_support import run_python
from tests.torch.support import fill, make_manager

openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
needs_openmp = pytest.mark.skipif(not openmp, reason="torch's CPU parallel backend is not OpenMP here")
needs_numba = pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")


@needs_openmp
def test_torch_team_joins_the_runtime_torch_loaded() -> None:
    path = threads.openmp_runtime()
    assert path is not None
    assert any(name in path for name in ("libgomp", "libiomp5", "libomp"))
    assert threads.torch_team() is not None


@needs_openmp
def test_the_team_runs_one_share_per_thread_on_distinct_threads() -> None:
    team = threads.torch_team()
    assert team is not None
    seen: list[int] = []
    lock = threading.Lock()

    def share() -> None:
        with lock:
            seen.append(threading.get_ident())

    team(share, 2)
    assert len(seen) == 2
    assert len(set(seen)) == 2  # the calling thread and one of torch's
    assert threading.get_ident() in seen
    seen.clear()
    team(share, 1)
    assert seen == [threading.get_ident()]


@needs_openmp
def test_an_error_in_a_share_is_raised_by_the_team_and_the_team_still_works() -> None:
    team = threads.torch_team()
    assert team is not None
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise KeyError("share failed")

    with pytest.raises(KeyError, match="share failed"):
        team(failing, 2)
    assert len(calls) == 2
    ran: list[int] = []
    team(lambda: ran.append(1), 2)
    assert len(ran) == 2


def test_without_openmp_there_is_no_team(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another parallel backend, or no runtime loaded from torch's folders: the kernel keeps its own."""
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: "ATen parallel backend: native thread pool")
    assert threads.openmp_runtime() is None
    monkeypatch.undo()
    monkeypatch.setattr(threads, "_loaded_libraries", set)
    assert threads.openmp_runtime() is None


@needs_numba
@needs_openmp
def test_cpu_attention_hands_the_kernel_torch_team(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make_manager(kv_layout="heads_first", num_blocks=320)
    filled = fill(manager, [300, 200, 500], max_step=64)
    table = manager.page_table(filled.handles)
    query = torch.randn((3, 4, 8), generator=torch.Generator().manual_seed(3))
    teams: list[Any] = []
    real = paged_kernel.attend_with_kernel

    def counted(*args: Any, **kwargs: Any) -> Any:
        teams.append(kwargs.get("team"))
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_kernel, "attend_with_kernel", counted)
    monkeypatch.setattr(kernel_plan, "MIN_THREAD_WORK", 1)  # two threads even for this small batch
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel takes torch's thread count (one on a busy test worker)
    try:
        got = manager.paged_attention(1, query, table)
    finally:
        torch.set_num_threads(previous)
    assert teams == [threads.torch_team()]
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    expected = manager.paged_attention(1, query, table)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


FORKED_CHILD = """
import os, sys
import torch
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.attention import kernel_plan
from tests.torch.support import fill, make_manager

kernel_plan.MIN_THREAD_WORK = 1  # two threads even for this small batch
manager = make_manager(kv_layout="heads_first", num_blocks=320)
filled = fill(manager, [300, 200, 500], max_step=64)
table = manager.page_table(filled.handles)
query = torch.randn((3, 4, 8), generator=torch.Generator().manual_seed(3))
expected = manager.paged_attention(1, query, table)  # the team ran in the parent
pid = os.fork()
if pid == 0:
    got = manager.paged_attention(1, query, table)
    os._exit(0 if torch.equal(got, expected) else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@needs_numba
@needs_openmp
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_attends_without_the_parents_openmp_threads() -> None:
    """GNU OpenMP's threads do not survive a fork: the child's calls take the default team."""
    result = run_python("-c", FORKED_CHILD, cwd=Path(__file__).resolve().parents[2], timeout=240)
    assert result.returncode == 0, result.stderr


@needs_openmp
def test_the_team_refuses_a_bad_call_before_starting_a_region() -> None:
    team = threads.torch_team()
    assert team is not None
    ran: list[int] = []
    with pytest.raises(InvalidArgumentError, match="int >= 1"):
        team(lambda: ran.append(1), -1)  # would wrap around as an unsigned thread count
    with pytest.raises(InvalidTypeError, match="callable share"):
        team("share", 2)  # type: ignore[arg-type]
    assert ran == []
