"""The torch pool's step lane (``kvcache_torch.lanes``) keeps every policy of the manager:
a stale step, a block the prefix cache serves since the step was planned, an array of
another dtype and autograd are handled as on the general path, and nothing is written
where a call is refused. (The kit's ``LaneCases`` compare the lane with the general path.)"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvcache_torch.attention
from kvcache_core import AllocationRequest, InvalidArgumentError, PagedKvCacheManager, create_manager
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.backends import dispatch
from kvcache_core.contract.page_table import PageTable
from kvcache_core.errors import DTypeMismatchError, ShapeMismatchError, SharedBlockWriteError, StaleStepError
from kvcache_torch import TorchStorage, lanes
from kvcache_torch import dispatch as torch_dispatch
from kvcache_torch.lanes import TorchLane
from tests.core.support import make_config
from tests.torch.support import Manager, dispatch_file, make_manager

pytestmark = pytest.mark.filterwarnings("error")


def arrays(manager: Manager, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    config = manager.config
    keys = torch.randn((tokens, config.num_heads, config.head_dim), generator=generator)
    values = torch.randn((tokens, config.num_heads, config.head_dim), generator=generator)
    query = torch.randn((tokens, 2 * config.num_heads, config.head_dim), generator=generator)
    return keys, values, query


def pool_copy(manager: Manager) -> torch.Tensor:
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    return storage.pool.clone()


@pytest.mark.parametrize("layout", ["NHD", "heads_first"])
def test_the_storage_prepares_a_lane_for_its_plain_pools_only(layout: str) -> None:
    manager = make_manager(kv_layout=layout)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [3])
    lane = manager.storage.step_lane(step.page_table, step.slots, step.qo_indptr)  # type: ignore[attr-defined]
    assert isinstance(lane, TorchLane)
    hnd = make_manager(kv_layout="HND")
    other = hnd.allocate(AllocationRequest("a"))
    step = hnd.begin_step([other], [3])
    assert hnd.storage.step_lane(step.page_table, step.slots, step.qo_indptr) is None  # type: ignore[attr-defined]


def test_a_stale_step_is_refused_before_the_lane_writes() -> None:
    manager = make_manager(kv_layout="heads_first")
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    step = manager.begin_step(handles, [2, 3])
    keys, values, query = arrays(manager, 5, 0)
    step.write_and_attend(0, keys, values, query)  # the lane is prepared and used
    manager.deallocate("b")
    before = pool_copy(manager)
    with pytest.raises(StaleStepError):
        step.write_and_attend(1, keys, values, query)
    assert torch.equal(pool_copy(manager), before)


def test_a_block_the_prefix_cache_took_since_planning_is_not_rewritten_through_the_lane() -> None:
    config = make_config(
        32, 4, num_layers=2, num_heads=2, head_dim=8, enable_prefix_caching=True, kv_layout="heads_first"
    )
    manager: Manager = create_manager("torch", config)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [4], token_ids=[[1, 2, 3, 4]])
    keys, values, query = arrays(manager, 4, 1)
    for layer in range(2):  # every layer written: the full block enters the prefix cache
        step.write_and_attend(layer, keys, values, query)
    before = pool_copy(manager)
    with pytest.raises(SharedBlockWriteError):
        step.write_and_attend(0, keys * 2, values, query)
    assert torch.equal(pool_copy(manager), before)


def test_arrays_of_another_dtype_get_the_general_paths_error_and_write_nothing() -> None:
    manager = make_manager(kv_layout="heads_first")
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [3])
    keys, values, query = arrays(manager, 3, 2)
    before = pool_copy(manager)
    with pytest.raises(DTypeMismatchError):
        step.write_and_attend(0, keys.double(), values.double(), query.double())
    assert torch.equal(pool_copy(manager), before)
    output = step.write_and_attend(0, keys, values, query)  # the same step goes on
    assert output.shape == (3, 4, 8)


def test_the_lane_records_no_autograd_in_the_pool() -> None:
    manager = make_manager(kv_layout="heads_first")
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [3])
    keys, values, query = arrays(manager, 3, 3)
    keys.requires_grad_(True)
    with torch.enable_grad():
        output = step.write_and_attend(0, keys, values, query)
    assert not output.requires_grad
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    assert not storage.pool.requires_grad
    assert storage.pool.grad_fn is None


def one_run_decode_step(manager: Manager, prompt: int = 6) -> Any:
    """A request of ``prompt`` tokens written on every layer, then its next decode step."""
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [prompt])
    keys, values, query = arrays(manager, prompt, 7)
    for layer in range(manager.config.num_layers):
        step.write_and_attend(layer, keys, values, query)
    return step.advance()


@pytest.mark.parametrize("layout", ["heads_first", "NHD"])
def test_the_lane_writes_a_one_run_decode_and_shows_the_pool_in_place(layout: str) -> None:
    manager = make_manager(kv_layout=layout)
    step = one_run_decode_step(manager)
    lane = manager.storage.step_lane(step.page_table, step.slots, step.qo_indptr)  # type: ignore[attr-defined]
    assert isinstance(lane, TorchLane)
    keys, values, _ = arrays(manager, 1, 8)
    shown = lane.write_and_view(1, keys, values, 3, "NHD")
    assert shown is not None
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    handle = manager.get_handle("a")
    assert handle is not None
    for view, whole in zip(shown, manager.gather(handle, 1), strict=True):
        assert view.untyped_storage().data_ptr() == storage.pool.untyped_storage().data_ptr()  # no copy
        assert torch.equal(view[0], whole[-3:])
    assert torch.equal(shown[0][0, -1], keys[0])  # the new token, written


def test_the_lane_declines_to_show_what_it_cannot_and_writes_nothing() -> None:
    manager = make_manager(kv_layout="heads_first")
    step = one_run_decode_step(manager)
    lane = manager.storage.step_lane(step.page_table, step.slots, step.qo_indptr)  # type: ignore[attr-defined]
    assert isinstance(lane, TorchLane)
    keys, values, _ = arrays(manager, 1, 9)
    before = pool_copy(manager)
    for arguments in (
        (keys.double(), values, None, "HND"),  # another dtype
        (torch.cat([keys, keys]), values, None, "HND"),  # another shape
        (keys, values, 8, "HND"),  # positions the request does not hold
        (keys, values, 0, "HND"),
        (keys, values, None, "heads_first"),  # a layout it does not show
    ):
        assert lane.write_and_view(0, *arguments) is None
    assert torch.equal(pool_copy(manager), before)
    batch = make_manager(kv_layout="heads_first")
    handles = [batch.allocate(AllocationRequest(name)) for name in ("a", "b")]
    two = batch.begin_step(handles, [2, 3]).advance()
    lane = batch.storage.step_lane(two.page_table, two.slots, two.qo_indptr)  # type: ignore[attr-defined]
    assert isinstance(lane, TorchLane)
    before = pool_copy(batch)
    assert lane.write_and_view(0, *arrays(batch, 2, 10)[:2], None, "HND") is None  # two requests: nothing shown
    assert torch.equal(pool_copy(batch), before)


def test_a_lane_shows_the_pool_without_recording_autograd() -> None:
    manager = make_manager(kv_layout="heads_first")
    step = one_run_decode_step(manager)
    keys, values, _ = arrays(manager, 1, 11)
    keys.requires_grad_(True)
    with torch.enable_grad():
        shown = step.write_and_view(0, keys, values, layout="HND")
    assert shown is not None
    assert not shown[0].requires_grad
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    assert not storage.pool.requires_grad
    assert storage.pool.grad_fn is None
    assert torch.equal(shown[0][0, :, -1], keys[0].detach())


def test_a_lane_that_only_wrote_and_showed_is_advanced_to_the_next_decode_step() -> None:
    manager = make_manager(kv_layout="heads_first")
    step = one_run_decode_step(manager)
    made: list[TorchLane | None] = []
    original = TorchStorage.step_lane

    def counted(storage: TorchStorage, *args: Any) -> TorchLane | None:
        made.append(original(storage, *args))
        return made[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TorchStorage, "step_lane", counted)
        for turn in range(4):
            keys, values, _ = arrays(manager, 1, 20 + turn)
            for layer in range(manager.config.num_layers):
                shown = step.write_and_view(layer, keys, values, layout="HND")
                assert shown is not None
                assert shown[0].shape[2] == 7 + turn
                assert torch.equal(shown[1][0, :, -1], values[0])
            step = step.advance()
    assert len(made) == 1  # prepared once, then advanced step after step


@pytest.mark.parametrize("layout", ["heads_first", "NHD"])
def test_a_one_run_decode_through_the_lane_equals_the_kernels_and_the_general_path(layout: str) -> None:
    """The lane's views of the one request's run (made for every layer at the step's first)
    write and read the same K/V as the kernel and the general path, in both layouts."""
    outputs: list[list[torch.Tensor]] = []
    pools: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for path in ("native", "kernel", "native-general"):
        config = make_config(
            64,
            4,
            num_layers=3,
            num_heads=2,
            head_dim=8,
            enable_prefix_caching=False,
            kv_layout=layout,
            attention_path="kernel" if path == "kernel" else "native",
        )
        manager: PagedKvCacheManager[torch.Tensor] = create_manager("torch", config)
        handle = manager.allocate(AllocationRequest("a"))
        got: list[torch.Tensor] = []
        for turn, count in enumerate([13, 1, 1, 1]):
            step = manager.begin_step([handle], [count])
            for layer in range(3):
                keys, values, query = arrays(manager, count, 10 * turn + layer)
                if path == "native-general":
                    step.write(layer, keys, values)
                    got.append(step.attention(layer, query))
                else:
                    got.append(step.write_and_attend(layer, keys, values, query))
        outputs.append(got)
        pools.append([manager.gather(handle, layer) for layer in range(3)])
    for lane_native, lane_kernel, general in zip(*outputs, strict=True):
        torch.testing.assert_close(lane_native, general, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lane_kernel, general, rtol=1e-5, atol=1e-5)
    for lane_native, lane_kernel, general in zip(*pools, strict=True):  # every token where it belongs
        assert all(torch.equal(a, b) for a, b in zip(lane_native, general, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(lane_kernel, general, strict=True))


@pytest.fixture
def fresh_dispatch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The torch dispatch with no choice, its file in ``tmp_path``, no path pinned; emptied after."""
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    monkeypatch.setenv(dispatch.CACHE_DIR_ENV, str(tmp_path))
    torch_dispatch.DISPATCH.forget()
    yield
    torch_dispatch.DISPATCH.forget()


@pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")
@pytest.mark.parametrize("path", ["auto", "kernel"])
@pytest.mark.usefixtures("fresh_dispatch")
def test_a_steps_first_layer_reads_the_measured_path_without_attending_through_the_pool(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    through_pool: list[int] = []
    real = kvcache_torch.attention.attend_pool

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        through_pool.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lanes, "attend_pool", counted)
    config = make_config(64, 4, num_layers=3, num_heads=2, head_dim=8, kv_layout="heads_first")
    lane_manager: Manager = create_manager("torch", dataclasses.replace(config, attention_path=path))
    general_manager: Manager = create_manager("torch", dataclasses.replace(config, attention_path="native"))
    managers = (lane_manager, general_manager)
    handles = [[manager.allocate(AllocationRequest(name)) for name in ("a", "b")] for manager in managers]
    counted_per_turn: list[int] = []
    decode_steps = 2 * dispatch.TRIAL_STEPS + 2
    for turn, counts in enumerate([[9, 14]] + [[1, 1]] * decode_steps):
        through_pool.clear()
        step, general = (manager.begin_step(rows, counts) for manager, rows in zip(managers, handles, strict=True))
        for layer in range(3):
            keys, values, query = arrays(lane_manager, sum(counts), 10 * turn + layer)
            general.write(layer, keys, values)  # the general path, no lane
            expected = general.attention(layer, query)
            torch.testing.assert_close(step.write_and_attend(layer, keys, values, query), expected)
        counted_per_turn.append(len(through_pool))
    if path == "kernel":  # pinned: the kernel from the first layer on
        assert counted_per_turn == [0] * (1 + decode_steps)
        return
    choices = torch_dispatch.DISPATCH.choices()
    assert len(choices) == 2  # the prefill's class and the decode's, each measured once
    assert [key for key in choices if key.startswith("prefill")]
    decode = choices[next(key for key in choices if key.startswith("in-model decode"))]
    # The prefill's class, seen the first time, is measured by the step's first layer,
    # through the storage's own attention. The decode's is measured as the model runs it:
    # its steps take the kernel (from the first layer on, no such call) and torch's path
    # (two requests: through the storage's attention at every layer) in turns, then its choice.
    assert counted_per_turn[0] >= 1
    trials = [0, 3] * dispatch.TRIAL_STEPS
    assert counted_per_turn[1:] == [*trials, *[0 if decode.path == "kernel" else 3] * 2]


@pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")
@pytest.mark.parametrize("faster", ["kernel", "native"])
@pytest.mark.usefixtures("fresh_dispatch")
def test_a_decode_class_keeps_the_path_its_layers_ran_faster_in_the_model(
    faster: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    now = [0.0]
    ran: list[str] = []
    attend = TorchLane._attend  # pyright: ignore[reportPrivateUsage]

    def timed(lane: TorchLane, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        tried = lane._tried  # pyright: ignore[reportPrivateUsage]
        if tried is not None:  # a trial step: its path costs 1 ms a layer, 2 ms for the slower one
            ran.append(tried[1])
            now[0] += 0.001 if tried[1] == faster else 0.002
        return attend(lane, layer, query, scale)

    monkeypatch.setattr(lanes, "perf_counter", lambda: now[0])
    monkeypatch.setattr(TorchLane, "_attend", timed)
    config = make_config(64, 4, num_layers=3, num_heads=2, head_dim=8, kv_layout="heads_first")
    lane_manager: Manager = create_manager("torch", config)
    general_manager: Manager = create_manager("torch", dataclasses.replace(config, attention_path="native"))
    managers = (lane_manager, general_manager)
    handles = [manager.allocate(AllocationRequest("a")) for manager in managers]
    for turn, count in enumerate([20] + [1] * (2 * dispatch.TRIAL_STEPS + 2)):
        step, general = (
            manager.begin_step([handle], [count]) for manager, handle in zip(managers, handles, strict=True)
        )
        for layer in range(3):
            keys, values, query = arrays(lane_manager, count, 10 * turn + layer)
            general.write(layer, keys, values)
            expected = general.attention(layer, query)
            torch.testing.assert_close(step.write_and_attend(layer, keys, values, query), expected)
    # Each trial step times its layers: the kernel's, then torch's, in turns.
    assert ran == (["kernel"] * 3 + ["native"] * 3) * dispatch.TRIAL_STEPS
    (key,) = (key for key in torch_dispatch.DISPATCH.choices() if key.startswith("in-model decode"))
    choice = torch_dispatch.DISPATCH.choices()[key]
    assert (choice.path, choice.settled) == (faster, True)
    assert '"in-model decode' in dispatch_file(tmp_path).read_text()  # kept for later processes


def several_runs_by_hand(table: PageTable) -> bool:
    pages = table.kv_indices.tolist()
    offsets = table.kv_indptr.tolist()
    return any(
        pages[index + 1] != pages[index] + 1
        for start, end in itertools.pairwise(offsets)
        for index in range(start, end - 1)
    )


@pytest.mark.parametrize("seed", range(6))
def test_one_run_each_is_found_once_per_arrays_of_pages_and_stays_right(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(20):
        batch = int(rng.integers(1, 5))
        counts = rng.integers(0, 5, size=batch).tolist()
        contiguous = bool(rng.integers(0, 2))
        start = int(rng.integers(0, 50))
        pages = list(range(start, start + sum(counts))) if contiguous else rng.permutation(64)[: sum(counts)].tolist()
        lengths = [count * 4 - int(rng.integers(0, 4)) if count else 0 for count in counts]
        offsets = [0, *itertools.accumulate(counts)]
        padded = np.zeros((batch, max([*counts, 1])), dtype=np.int32)
        for row, (first, last) in enumerate(itertools.pairwise(offsets)):
            padded[row, : last - first] = pages[first:last]
        table = PageTable(
            kv_indptr=np.array(offsets),
            kv_indices=np.array(pages, dtype=np.int32),
            kv_last_page_len=np.array(
                [length - (count - 1) * 4 if count else 0 for length, count in zip(lengths, counts, strict=True)]
            ),
            block_tables=padded,
            seq_lens=np.array(lengths),
            block_size=4,
        )
        expected = several_runs_by_hand(table)
        assert table.one_run_each is not expected
        assert table.one_run_each is not expected  # remembered
        shorter = [max(0, length - 1) if length % 4 != 1 else length for length in lengths]
        shared = table.with_seq_lens(shorter)
        assert shared.kv_indices is table.kv_indices
        assert shared._one_run is table._one_run  # pyright: ignore[reportPrivateUsage]  # the same pages: found once
        assert shared.one_run_each is not expected


@pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")
def test_a_kernel_call_for_the_next_batch_equals_a_fresh_one_and_refuses_another_batch() -> None:
    manager = make_manager(kv_layout="heads_first")
    handles = [manager.allocate(AllocationRequest(name)) for name in ("a", "b")]
    step = manager.begin_step(handles, [5, 9])
    keys, values, _ = arrays(manager, 14, 3)
    step.write(0, keys, values)
    storage = manager.storage
    pools = (torch_dispatch.host_view(storage.key_cache(0)), torch_dispatch.host_view(storage.value_cache(0)))

    def prepared(step: Any) -> paged_kernel.KernelCall:
        return paged_kernel.prepare_kernel_call(
            (2, 2 * manager.config.num_heads, manager.config.head_dim),
            *pools,
            step.page_table,
            step.qo_indptr,
            dtype="float32",
            causal=True,
            kv_layout="heads_first",
            sliding_window=None,
        )

    first = manager.begin_step(handles, [1, 1])
    call = prepared(first)
    first.write(0, *arrays(manager, 2, 4)[:2])
    second = manager.begin_step(handles, [1, 1])
    second.write(0, *arrays(manager, 2, 5)[:2])
    query = arrays(manager, 2, 6)[2].numpy()
    expected = prepared(second)(query, *pools, 0.25)
    assert np.array_equal(call.for_batch(second.page_table, second.qo_indptr)(query, *pools, 0.25), expected)
    other = manager.begin_step(handles[:1], [1])
    with pytest.raises(ShapeMismatchError, match="2 queries"):
        call.for_batch(other.page_table, other.qo_indptr)


def lane_and_general_managers(path: str) -> tuple[Manager, Manager, tuple[str, ...]]:
    """A manager of the attention ``path`` (its lanes), one of torch's own path (the general
    one the lanes are compared with), and the requests to run: one request in one run for
    torch's views, two for the kernel."""
    if path == "kernel" and not paged_kernel.kernel_available():
        pytest.skip("numba is not installed (or switched off)")
    config = make_config(160, 4, num_layers=2, num_heads=2, head_dim=8, kv_layout="heads_first")
    lane_manager: Manager = create_manager("torch", dataclasses.replace(config, attention_path=path))
    general_manager: Manager = create_manager("torch", dataclasses.replace(config, attention_path="native"))
    return lane_manager, general_manager, ("a",) if path == "native" else ("a", "b")


@pytest.mark.parametrize("path", ["kernel", "native"])
def test_decode_steps_take_the_settled_path_of_their_class_over(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[int] = []
    real = torch_dispatch.measured_plain_path

    def counted(*args: Any, **kwargs: Any) -> str | None:
        looked_up.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lanes, "measured_plain_path", counted)
    lane_manager, general_manager, names = lane_and_general_managers(path)
    managers = (lane_manager, general_manager)
    handles = [[manager.allocate(AllocationRequest(name)) for name in names] for manager in managers]
    lookups: list[int] = []
    for turn, count in enumerate([250] + [1] * 10):
        looked_up.clear()
        counts = [count] * len(names)
        step, general = (manager.begin_step(rows, counts) for manager, rows in zip(managers, handles, strict=True))
        for layer in range(2):
            keys, values, query = arrays(lane_manager, sum(counts), 10 * turn + layer)
            general.write(layer, keys, values)
            torch.testing.assert_close(
                step.write_and_attend(layer, keys, values, query), general.attention(layer, query)
            )
        lookups.append(len(looked_up))
    # The prefill is no decode; the first decode looks its path up, the next ones take it over
    # (blocks filled and taken on the way) until the context leaves the bucket of 256 tokens.
    assert lookups == [1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]


@pytest.mark.parametrize("path", ["kernel", "native"])
def test_a_decode_step_advanced_in_place_carries_its_lane_over(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[int] = []
    real = TorchStorage.step_lane

    def counted(self: TorchStorage, *args: Any) -> TorchLane | None:
        prepared.append(1)
        return real(self, *args)

    monkeypatch.setattr(TorchStorage, "step_lane", counted)
    lane_manager, general_manager, names = lane_and_general_managers(path)
    rows = [lane_manager.allocate(AllocationRequest(name)) for name in names]
    general_rows = [general_manager.allocate(AllocationRequest(name)) for name in names]
    step = lane_manager.begin_step(rows, [250] * len(names))
    preparations: list[int] = []
    for turn in range(12):
        prepared.clear()
        if turn:
            last = step
            step = step.advance()
            with pytest.raises(StaleStepError):  # the step it follows is done with
                last.write(0, *arrays(lane_manager, len(names), 0)[:2])
        general = general_manager.begin_step(general_rows, 250 if not turn else 1)
        for layer in range(2):
            keys, values, query = arrays(lane_manager, step.num_new_tokens, 10 * turn + layer)
            general.write(layer, keys, values)
            torch.testing.assert_close(
                step.write_and_attend(layer, keys, values, query), general.attention(layer, query)
            )
        preparations.append(len(prepared))
    assert torch.equal(pool_copy(lane_manager), pool_copy(general_manager))
    assert [handle.num_tokens() for handle in rows] == [261] * len(names)
    # A lane is prepared for the prefill and for the first decode step (the prefill's path is
    # not a decode's); after that only where the step leaves its settled class: at 257 tokens
    # the context leaves its bucket of 256. Steps whose tokens open a block (turns 3, 7, 11)
    # take the lane over too.
    assert preparations == [1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("path", ["kernel", "native"])
def test_an_advanced_step_checks_a_scale_other_than_the_one_it_took_over(path: str) -> None:
    lane_manager, general_manager, names = lane_and_general_managers(path)
    rows = [lane_manager.allocate(AllocationRequest(name)) for name in names]
    general_rows = [general_manager.allocate(AllocationRequest(name)) for name in names]
    step, general = lane_manager.begin_step(rows, [9] * len(names)), general_manager.begin_step(general_rows, 9)
    for turn, scale in enumerate((0.5, 0.5, 0.25)):
        if turn:
            step, general = step.advance(), general_manager.begin_step(general_rows, 1)
        keys, values, query = arrays(lane_manager, step.num_new_tokens, turn)
        if turn:  # a scale the last step never checked is refused, and nothing is written
            before = pool_copy(lane_manager)
            with pytest.raises(InvalidArgumentError, match="scale"):
                step.write_and_attend(0, keys, values, query, scale=-scale)
            assert torch.equal(pool_copy(lane_manager), before)
        for layer in range(2):
            general.write(layer, keys, values)
            torch.testing.assert_close(
                step.write_and_attend(layer, keys, values, query, scale=scale),
                general.attention(layer, query, scale=scale),
            )
    assert torch.equal(pool_copy(lane_manager), pool_copy(general_manager))


@pytest.mark.parametrize("layout", ["NHD", "heads_first"])
@pytest.mark.parametrize("value_width", [None, 4])
def test_a_lane_makes_every_layers_views_at_once_as_it_would_one_by_one(layout: str, value_width: int | None) -> None:
    """The views of a request's slot and run in every layer's pools, made with one view over
    the evenly spaced layers, are those made layer by layer (the same memory, shape and
    strides); a lane over pools that are not evenly spaced makes them layer by layer."""
    config = make_config(64, 4, num_layers=3, num_heads=2, head_dim=8, value_head_dim=value_width, kv_layout=layout)
    manager: Manager = create_manager("torch", config)
    handle = manager.allocate(AllocationRequest("a"))
    step = manager.begin_step([handle], [5])
    lane = manager.storage.step_lane(step.page_table, step.slots, step.qo_indptr)  # type: ignore[attr-defined]
    assert isinstance(lane, TorchLane)
    slot, rows = int(step.slots[-1]), lane._rows  # pyright: ignore[reportPrivateUsage]
    for tokens in (None, 3):
        for part in (0, 1):
            together = lane._layer_views(part, slot, tokens)  # pyright: ignore[reportPrivateUsage]
            alone = [lane._pool_view(layer_rows, slot, tokens) for layer_rows in rows[part]]  # pyright: ignore[reportPrivateUsage]
            assert len(together) == len(alone) == manager.config.num_layers
            for made, expected in zip(together, alone, strict=True):
                assert made.shape == expected.shape
                assert made.stride() == expected.stride()
                assert made.data_ptr() == expected.data_ptr()
    memory = lanes.LaneMemory(2)
    base = torch.zeros(64)
    assert memory.layer_step(0, [base[0:8].view(2, 4), base[16:24].view(2, 4)]) == 16
    assert lanes.LaneMemory(2).layer_step(0, [base[0:8].view(2, 4), base[16:24].view(4, 2)]) is None  # shapes
    assert lanes.LaneMemory(3).layer_step(0, [base[0:8], base[16:24], base[40:48]]) is None  # uneven
    assert lanes.LaneMemory(2).layer_step(0, [base[16:24], base[0:8]]) is None  # backwards
    assert lanes.LaneMemory(2).layer_step(0, [base[0:8], torch.zeros(8)]) is None  # another storage
