"""The compiled kernel runs on torch's own OpenMP team on CPU (kvcache_torch.threads)."""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from kvcache_core import AllocationRequest, InvalidArgumentError, Step
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


@needs_numba
@needs_openmp
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["heads_first", "NHD"])
def test_the_kernel_starts_its_shares_on_torchs_team_from_c_with_the_same_results(
    dtype: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's shares enter compiled code straight from torch's OpenMP region (no Python
    callback, no GIL): the same bits as its Python share, with every attention feature and
    with split contexts merged (one long request among short ones)."""
    entries = pytest.importorskip("kvcache_core.attention._kernel_entry")
    manager = make_manager(kv_layout=layout, dtype=dtype, num_blocks=700, block_size=8)
    generator = torch.Generator().manual_seed(5)
    io_dtype = getattr(torch, dtype) if dtype in ("float16", "bfloat16") else torch.float32
    handles = [manager.allocate(AllocationRequest(name)) for name in ("long", "short", "middle")]
    lengths = [1900, 40, 300]
    step = manager.begin_step(handles, lengths)
    for layer in range(2):
        keys, values = (torch.randn((sum(lengths), 2, 8), generator=generator).to(io_dtype) for _ in range(2))
        step.write(layer, keys, values)
    table = manager.page_table(handles)
    query = torch.randn((3, 4, 8), generator=generator).to(io_dtype)
    sinks = torch.randn(4, generator=generator).to(io_dtype)
    launched: list[bool] = []
    real = entries.CompiledLaunch.__call__

    def counted(launch: Any, arguments: tuple[Any, ...], count: int, owner: object = None) -> bool:
        launched.append(real(launch, arguments, count, owner))
        return launched[-1]

    monkeypatch.setattr(entries.CompiledLaunch, "__call__", counted)
    monkeypatch.setattr(kernel_plan, "MIN_THREAD_WORK", 1)  # two threads even for this small batch
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        features: list[dict[str, Any]] = [{}, {"softcap": 5.0, "sinks": sinks}, {"window": 100}, {"chunk": 64}]
        from_c = [manager.paged_attention(1, query, table, scale=0.3, **given) for given in features]
        assert launched
        assert all(launched)
        monkeypatch.setattr(entries.CompiledLaunch, "__call__", python_share)
        through_python = [manager.paged_attention(1, query, table, scale=0.3, **given) for given in features]
    finally:
        torch.set_num_threads(previous)
    for got, expected in zip(from_c, through_python, strict=True):
        assert torch.equal(got, expected)


@needs_numba
@needs_openmp
def test_the_next_batchs_kernel_call_shares_the_c_launch_and_each_call_reads_its_own_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode step's call made from the last one (``for_batch``) reuses its C launch, whose
    block is refilled for whichever call runs: calls of two batches taken in turn give the
    bits their Python shares give."""
    entries = pytest.importorskip("kvcache_core.attention._kernel_entry")
    from kvcache_torch import dispatch as torch_dispatch

    manager = make_manager(kv_layout="heads_first", num_blocks=700, block_size=8)
    generator = torch.Generator().manual_seed(11)
    handles = [manager.allocate(AllocationRequest(name)) for name in ("long", "short")]
    lengths = [1500, 60]
    prefill = manager.begin_step(handles, lengths)
    prefill.write(0, *(torch.randn((sum(lengths), 2, 8), generator=generator) for _ in range(2)))
    steps: list[Step[torch.Tensor]] = []
    for _ in range(2):
        step = manager.begin_step(handles, [1, 1])
        step.write(0, *(torch.randn((2, 2, 8), generator=generator) for _ in range(2)))
        steps.append(step)
    storage = manager.storage
    pools = (torch_dispatch.host_view(storage.key_cache(0)), torch_dispatch.host_view(storage.value_cache(0)))
    made: list[object] = []
    real_make = entries.CompiledLaunch.make

    def counted_make(run: Any, arguments: tuple[Any, ...], owner: object = None) -> object:
        made.append(real_make(run, arguments, owner))
        return made[-1]

    monkeypatch.setattr(entries.CompiledLaunch, "make", staticmethod(counted_make))
    monkeypatch.setattr(kernel_plan, "MIN_THREAD_WORK", 1)  # two threads, the long context split
    query = torch.randn((2, 4, 8), generator=generator).numpy()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = paged_kernel.prepare_kernel_call(
            query.shape,
            *pools,
            steps[0].page_table,
            steps[0].qo_indptr,
            dtype="float32",
            causal=True,
            kv_layout="heads_first",
            sliding_window=None,
            team=threads.torch_team(),
        )
        second = first.for_batch(steps[1].page_table, steps[1].qo_indptr)
        from_c = [call(query, *pools, scale) for call, scale in ((first, 0.3), (second, 0.3), (first, 0.5))]
        from_c.append(second(query, *pools, 0.5))
        assert len(made) == 1  # one launch, shared
        assert made[0] is not False
        monkeypatch.setattr(entries.CompiledLaunch, "__call__", python_share)
        through_python = [call(query, *pools, scale) for call, scale in ((first, 0.3), (second, 0.3), (first, 0.5))]
        through_python.append(second(query, *pools, 0.5))
    finally:
        torch.set_num_threads(previous)
    assert not np.array_equal(from_c[0], from_c[1])  # the batches differ: each call read its own
    for got, expected in zip(from_c, through_python, strict=True):
        assert np.array_equal(got, expected)


def python_share(*_: object) -> bool:
    """A compiled launch that declines: the kernel's Python share runs instead."""
    return False


@needs_numba
def test_the_kernels_c_entry_refuses_arrays_it_cannot_read() -> None:
    entries = pytest.importorskip("kvcache_core.attention._kernel_entry")
    assert entries.entry_address("float32") is None  # the pools' bits are uint16 or uint8
    assert entries.entry_address("uint16") == entries.entry_address("uint16")  # compiled once
    rows = np.zeros((4, 8), dtype=np.float32)
    arguments: list[Any] = [np.zeros((1, 4, 8), dtype=np.float32), rows, rows]
    arguments += [np.zeros((1, 1), dtype=np.uint16)] * 2 + [0, np.zeros(3, dtype=np.int64)]
    arguments += [np.zeros((1, 1), dtype=np.int32), np.zeros(1, dtype=np.int32), np.zeros(2, dtype=np.int32)]
    arguments += [np.zeros((0, 7), dtype=np.int64), np.zeros(1, dtype=np.int64), 1, 4, 0.5, True, 0]
    arguments += [np.zeros((1, 4, 8), dtype=np.float32), np.zeros((0, 8), dtype=np.float32)]
    arguments += [np.zeros((0, 2), dtype=np.float32), 0.0, np.zeros(0, dtype=np.float32), 0]
    arguments += [np.zeros(1, dtype=np.float32)] * 2 + [np.zeros(3, dtype=np.int64)]
    ran: list[tuple[int, int, int]] = []

    def run_entry(entry: int, data: int, count: int) -> bool:
        ran.append((entry, data, count))
        return True

    assert entries.CompiledLaunch.make(run_entry, tuple(arguments))(tuple(arguments), 2)
    assert ran[0][0] == entries.entry_address("uint16")
    block = np.zeros(entries.BLOCK_SIZE, dtype=np.int64)  # the layout the entry reads
    assert entries.fill_block(block, *arguments) == block.ctypes.data
    for position, at in entries.ADDRESS_AT.items():
        array = arguments[position]
        assert block[at] == array.ctypes.data
        assert list(block[at + 1 : at + 4]) == [*array.shape, 1, 1, 1][:3]
    ints = list(block[entries.INTS_AT : entries.SCALE_AT])
    assert ints == [arguments[5], arguments[12], arguments[13], 1, arguments[16], arguments[22]]
    assert list(block.view(np.float64)[entries.SCALE_AT :]) == [arguments[14], arguments[20]]
    arguments[1] = np.zeros((4, 16), dtype=np.float32)[:, ::2]  # not C-contiguous: no launch
    assert entries.CompiledLaunch.make(run_entry, tuple(arguments)) is False
    arguments[1], arguments[4] = rows, np.zeros((1, 1), dtype=np.uint8)  # bits of two types
    assert entries.CompiledLaunch.make(run_entry, tuple(arguments)) is False


@needs_openmp
def test_the_team_runs_a_c_entry_only_where_it_can() -> None:
    team = threads.torch_team()
    assert team is not None
    run_entry = cast("Any", team).run_entry  # a ThreadTeam with the optional member
    with pytest.raises(InvalidArgumentError, match="int >= 1"):
        run_entry(0, 0, 0)
    for entry, data, count in [(0, 8, 2), (8, 0, 2), (8, 8, 0), (-8, 8, 2), (8, 8, -1)]:
        with pytest.raises(InvalidArgumentError, match="int >= 1"):
            run_entry(entry, data, count)  # refused before anything runs (a bad address would crash)


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


@needs_numba
@needs_openmp
@pytest.mark.parametrize("lengths", [[90, 40, 120, 60], [1500, 60]], ids=["whole", "split-and-merged"])
def test_a_call_by_address_reads_and_writes_where_the_array_call_would(
    lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KernelCall.attend_at`` (query and output as addresses, through the C launch an array
    call of its batch set up) gives the array call's bits for each layer's pools; it declines,
    running nothing, before that launch, for another query shape and on one thread; and an
    array call after it reads its own query again, not the address it left in the block. A long
    context split over the threads is merged into the output where it is."""
    pytest.importorskip("kvcache_core.attention._kernel_entry")
    from kvcache_torch import dispatch as torch_dispatch

    manager = make_manager(kv_layout="NHD", num_blocks=200, block_size=8)
    generator = torch.Generator().manual_seed(21)
    handles = [manager.allocate(AllocationRequest(name)) for name in "abcd"[: len(lengths)]]
    count = len(lengths)
    prefill = manager.begin_step(handles, lengths)
    for layer in range(2):
        prefill.write(layer, *(torch.randn((sum(lengths), 2, 8), generator=generator) for _ in range(2)))
    step = manager.begin_step(handles, [1] * count)
    for layer in range(2):
        step.write(layer, *(torch.randn((count, 2, 8), generator=generator) for _ in range(2)))
    storage = manager.storage
    pools = [
        (torch_dispatch.host_view(storage.key_cache(i)), torch_dispatch.host_view(storage.value_cache(i)))
        for i in range(2)
    ]
    monkeypatch.setattr(kernel_plan, "MIN_THREAD_WORK", 1)  # two threads for this small batch
    compiled = importlib.import_module("kvcache_core.attention._kernel_jit")
    merged: list[int] = []
    merge = compiled.merge_splits_at

    def counted_merge(*arguments: Any) -> None:
        merged.append(1)
        merge(*arguments)

    monkeypatch.setattr(compiled, "merge_splits_at", counted_merge)
    queries = [torch.randn((count, 4, 8), generator=generator) for _ in range(3)]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)

    def prepared(**options: Any) -> paged_kernel.KernelCall:
        return paged_kernel.prepare_kernel_call(
            (count, 4, 8),
            *pools[0],
            step.page_table,
            step.qo_indptr,
            dtype="float32",
            causal=True,
            kv_layout="NHD",
            sliding_window=None,
            team=threads.torch_team(),
            **options,
        )

    try:
        call = prepared()
        out = torch.empty(call.output_shape)

        def by_address(query: torch.Tensor, layer: int, shape: tuple[int, ...] | None = None) -> bool:
            return call.attend_at(query.data_ptr(), shape or (count, 4, 8), out.data_ptr(), pools[layer], 0.3)

        out.fill_(float("nan"))
        assert not by_address(queries[0], 0)  # no launch yet: nothing run
        assert out.isnan().all()
        expected = [[call(query.numpy(), *pools[layer], 0.3) for layer in range(2)] for query in queries]
        held = queries[0].numpy()  # one array object, read-only (taken as it is): the launch knows its address
        held.flags.writeable = False
        first = call(held, *pools[0], 0.3)
        for query, wanted in zip(queries, expected, strict=True):
            for layer in range(2):
                out.fill_(float("nan"))
                assert by_address(query, layer)
                assert np.array_equal(out.numpy(), wanted[layer])
        assert np.array_equal(call(held, *pools[0], 0.3), first)  # its own query again, not the last address
        assert len(merged) == (6 if count == 2 else 0)  # the long context split: merged where the output is
        assert not by_address(queries[0], 0, (count, 2, 16))  # another query shape
        with pytest.raises(InvalidArgumentError, match="a query's address"):
            call.attend_at(0, (count, 4, 8), out.data_ptr(), pools[0], 0.3)
        torch.set_num_threads(1)
        single = prepared(num_threads=1)
        single(queries[0].numpy(), *pools[0], 0.3)
        assert not single.attend_at(queries[0].data_ptr(), (count, 4, 8), out.data_ptr(), pools[0], 0.3)
    finally:
        torch.set_num_threads(previous)
