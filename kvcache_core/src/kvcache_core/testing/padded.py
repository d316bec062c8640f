"""The kit's cases for padded gathers (``Step.gather_padded``,
:mod:`kvcache_core.contract.padded`): every backend gives each request's last tokens, as
``manager.gather`` gives them, at the end of its row and zeros before, in both layouts, bit
for bit, whether its storage reads the slots in one pass or core gathers request by request;
``Step.padded_view`` shows what the gather copies, where it shows anything;
``Step.write_and_view`` (a storage's step lane may serve it) is a write then that view; bad
arguments are refused by name, before anything is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.errors import (
    ArrayTypeError,
    InvalidArgumentError,
    LayerIndexError,
    ShapeMismatchError,
    StaleStepError,
)
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.step import Step
from kvcache_core.testing.backend import BackendUnderTest

__all__ = ["PaddedGatherCases"]

Manager = PagedKvCacheManager[Any]

#: Prompt lengths of the batch: ragged, over several blocks, one shorter than a block.
LENGTHS = (5, 11, 2)


def _filled(manager: Manager, lengths: tuple[int, ...], decodes: int = 2) -> tuple[Step[Any], list[Any]]:
    """Requests of ``lengths`` written on every K/V layer, then ``decodes`` one-token steps;
    returns the last step (written) and the handles."""
    handles = [manager.allocate(AllocationRequest(f"padded{row}")) for row in range(len(lengths))]
    rng = np.random.default_rng(11)
    step = manager.begin_step(handles, list(lengths))
    for turn in range(decodes + 1):
        if turn:
            step = manager.begin_step(handles, [1] * len(lengths))
        for layer in range(manager.config.num_layers):
            if manager.config.layer_specs is None or manager.config.layer_specs[layer].keeps_kv:
                group = manager.config.layer_place(layer)[0]
                _write(manager, step.slots if step.slots.ndim == 1 else step.slots[group], rng, layer)
    return step, handles


def _write(manager: Manager, slots: npt.NDArray[np.int64], rng: np.random.Generator, layer: int) -> None:
    """Random K/V of the pool's compute dtype into ``slots`` of ``layer`` (a quantized pool
    keeps what it keeps: the case compares with ``manager.gather``, not with these)."""
    config = manager.config
    shape = (len(slots), config.num_heads, config.head_dim)
    dtype = config.io_dtype
    arrays = (
        BackendUnderTest.native(manager, BackendUnderTest.representable(rng.standard_normal(dims), dtype), dtype)
        for dims in (shape, (*shape[:2], config.value_width))
    )
    manager.write(layer, slots, *arrays)


def _expected(
    manager: Manager, handles: list[Any], layer: int, width: int | None, layout: str
) -> tuple[npt.NDArray[Any], npt.NDArray[Any], str]:
    """The padded batch built from ``manager.gather`` of each request, on the host, and the
    dtype of ``manager.gather``'s arrays."""
    native = [manager.gather(handle, layer) for handle in handles]
    dtype = manager.storage.array_info(native[0][0])[1]
    gathered = [[BackendUnderTest.host(manager, array) for array in arrays] for arrays in native]
    columns = max(len(keys) for keys, _ in gathered) if width is None else width
    batches: list[npt.NDArray[Any]] = []
    for part in (0, 1):
        rows: list[npt.NDArray[Any]] = []
        for arrays in gathered:
            array = arrays[part]
            taken = min(columns, len(array))
            row = np.zeros((columns, *array.shape[1:]), dtype=array.dtype)
            row[columns - taken :] = array[len(array) - taken :]
            rows.append(row)
        batch = np.stack(rows)
        batches.append(batch if layout == "NHD" else batch.transpose(0, 2, 1, 3))
    return batches[0], batches[1], dtype


def _check(manager: Manager, step: Step[Any], handles: list[Any], layer: int, context: str) -> None:
    """Every width and layout of ``layer`` against :func:`_expected`, bit for bit."""
    longest = max(handle.num_tokens() for handle in handles)
    for width in (None, 0, 3, max(longest - 2, 0), longest, longest + 5):  # (the longest request cut short too)
        for layout in ("NHD", "HND"):
            keys, values = step.gather_padded(layer, width=width, layout=layout)
            *expected, dtype = _expected(manager, handles, layer, width, layout)
            for name, got, want in zip(("keys", "values"), (keys, values), expected, strict=True):
                host = BackendUnderTest.host(manager, got)
                where = f"{context}, layer {layer}, width {width}, layout {layout}: {name}"
                assert host.shape == want.shape, f"{where}: shape {host.shape}, expected {want.shape}"
                got_dtype = manager.storage.array_info(got)[1]
                assert got_dtype == dtype, f"{where}: dtype {got_dtype}, manager.gather gives {dtype}"
                assert np.array_equal(host, want), f"{where} differ from manager.gather's, padded"


def _check_views(manager: Manager, step: Step[Any], handle: Any, layer: int, context: str) -> None:
    """``Step.padded_view`` of one request against ``gather_padded``, bit for bit, where the
    storage shows it (``None`` past the request's tokens)."""
    tokens = handle.num_tokens()
    for width in (None, 0, 3, tokens, tokens + 1):
        for layout in ("NHD", "HND"):
            view = step.padded_view(layer, width=width, layout=layout)
            where = f"{context}, layer {layer}, width {width}, layout {layout}"
            if width is not None and width > tokens:
                assert view is None, f"{where}: a view of positions the request does not hold (padding)"
            if view is None:
                continue
            for name, got, copied in zip(
                ("keys", "values"), view, step.gather_padded(layer, width=width, layout=layout), strict=True
            ):
                info, want = manager.storage.array_info(got), manager.storage.array_info(copied)
                assert info == want, f"{where}: {name} view {info}, gather_padded gives {want}"
                equal = np.array_equal(BackendUnderTest.host(manager, got), BackendUnderTest.host(manager, copied))
                assert equal, f"{where}: {name} view differs from gather_padded's copy"


def _pool(manager: Manager) -> tuple[bytes, bytes]:
    """Every block of the pool, as host bytes."""
    keys, values = manager.storage.blocks_to_host(np.arange(manager.config.num_blocks, dtype=np.int64))
    return np.ascontiguousarray(keys).tobytes(), np.ascontiguousarray(values).tobytes()


def _shown(
    manager: Manager, lengths: tuple[int, ...], *, fused: bool
) -> list[tuple[npt.NDArray[Any], npt.NDArray[Any]] | None]:
    """Prefill ``lengths``, then 5 decode steps, each the last one's ``advance``: every layer of a
    decode step written and viewed, with ``fused`` by ``Step.write_and_view``, else by
    ``write`` then ``padded_view``, at widths and layouts in turn. Returns each view (host
    arrays) or ``None``."""
    config = manager.config
    rng = np.random.default_rng(17)
    handles = [manager.allocate(AllocationRequest(f"shown{row}")) for row in range(len(lengths))]
    step = manager.begin_step(handles, list(lengths))
    for layer in range(config.num_layers):
        _write(manager, step.slots, rng, layer)
    shown: list[tuple[npt.NDArray[Any], npt.NDArray[Any]] | None] = []
    turns = ((None, "HND"), (None, "NHD"), (3, "HND"), (1, "NHD"), (max(lengths) + 9, "HND"))
    for turn in range(5):
        step = step.advance()
        for layer in range(config.num_layers):
            width, layout = turns[(turn + layer) % len(turns)]
            shape = (len(lengths), config.num_heads, config.head_dim)
            keys, values = (
                BackendUnderTest.native(
                    manager, BackendUnderTest.representable(rng.standard_normal(dims), config.io_dtype)
                )
                for dims in (shape, (*shape[:2], config.value_width))
            )
            if fused:
                view = step.write_and_view(layer, keys, values, width=width, layout=layout)
            else:
                step.write(layer, keys, values)
                view = step.padded_view(layer, width=width, layout=layout)
            shown.append(
                None
                if view is None
                else (BackendUnderTest.host(manager, view[0]), BackendUnderTest.host(manager, view[1]))
            )
    return shown


class PaddedGatherCases:
    """Cases every backend runs (``Step.gather_padded`` is core's, over any storage)."""

    def test_a_padded_view_shows_what_the_padded_gather_copies(self, kvcache_backend: BackendUnderTest) -> None:
        # A storage with ``view_padded`` shows one request's run in place; a batch of several
        # requests, or positions before the request's first token, are never shown.
        for config in kvcache_backend.configs(num_blocks=40):
            with kvcache_backend.manager(config) as manager:
                step, handles = _filled(manager, (11,))
                assert step.page_table.one_run_each, "the request's blocks are not one run: the case tests nothing"
                context = f"dtype {config.dtype}, layout {config.kv_layout}"
                for layer in range(config.num_layers):
                    _check_views(manager, step, handles[0], layer, context)
            with kvcache_backend.manager(config) as manager:
                step, _ = _filled(manager, LENGTHS)
                assert all(step.padded_view(0, width=1, layout=layout) is None for layout in ("NHD", "HND")), (
                    f"{context}: a view of a batch of several requests"
                )

    def test_a_write_and_view_is_a_write_then_the_padded_view(self, kvcache_backend: BackendUnderTest) -> None:
        # Through the storage's step lane where it serves the step (one request in one run),
        # through the manager's general path elsewhere: the same views, the same pool.
        for config in kvcache_backend.configs(num_blocks=40):
            for lengths in ((11,), LENGTHS):
                context = f"dtype {config.dtype}, layout {config.kv_layout}, prompts {list(lengths)}"
                with kvcache_backend.manager(config) as fused, kvcache_backend.manager(config) as apart:
                    got, expected = _shown(fused, lengths, fused=True), _shown(apart, lengths, fused=False)
                    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
                        where = f"{context}, call {index}"
                        assert (ours is None) == (theirs is None), f"{where}: a view where padded_view gives none"
                        if ours is not None and theirs is not None:
                            for name, one, other in zip(("keys", "values"), ours, theirs, strict=True):
                                assert one.shape == other.shape, (
                                    f"{where}: {name} of shape {one.shape}, not {other.shape}"
                                )
                                assert np.array_equal(one, other), f"{where}: {name} differ from padded_view's"
                    if len(lengths) == 1 and any(view is not None for view in expected):
                        assert any(view is not None for view in got), f"{context}: nothing shown"
                    assert _pool(fused) == _pool(apart), f"{context}: the pools differ"

    def test_a_write_and_view_refuses_bad_arguments_before_writing(self, kvcache_backend: BackendUnderTest) -> None:
        config = kvcache_backend.config(num_blocks=40)
        with kvcache_backend.manager(config) as manager:
            step, _ = _filled(manager, (11,))
            step = step.advance()
            rng = np.random.default_rng(3)
            shape = (1, config.num_heads, config.head_dim)
            keys, values, short = (
                BackendUnderTest.native(
                    manager, BackendUnderTest.representable(rng.standard_normal(dims), config.io_dtype)
                )
                for dims in (shape, (*shape[:2], config.value_width), (1, config.num_heads, config.head_dim + 1))
            )
            before = _pool(manager)
            capacity = config.num_blocks * config.block_size
            for width in (-1, capacity + 1, 2.0, "3", True):
                with pytest.raises(InvalidArgumentError, match="width"):
                    step.write_and_view(0, keys, values, width=width)  # type: ignore[arg-type]  # what the case tests
            for layout in ("HDN", "heads_first", None):
                with pytest.raises(InvalidArgumentError, match="layout"):
                    step.write_and_view(0, keys, values, layout=layout)  # type: ignore[arg-type]  # what the case tests
            for layer in (-1, config.num_layers, "0"):
                with pytest.raises(LayerIndexError):
                    step.write_and_view(layer, keys, values)  # type: ignore[arg-type]  # what the case tests
            with pytest.raises(ShapeMismatchError):
                step.write_and_view(0, short, values, layout="HND")
            for not_arrays in ((None, values), (keys, [0.0])):
                with pytest.raises(ArrayTypeError):  # named, never an AttributeError
                    step.write_and_view(0, *not_arrays, layout="HND")
            assert _pool(manager) == before, "a refused write_and_view wrote"
            step.write_and_view(0, keys, values, layout="HND")
            assert _pool(manager) != before, "write_and_view wrote nothing"
            step.advance()  # the requests grew: the old step is stale
            with pytest.raises(StaleStepError):
                step.write_and_view(0, keys, values)

    def test_a_padded_gather_holds_each_request_s_last_tokens_after_zeros(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        quantized = [
            kvcache_backend.config(dtype=dtype, kv_layout=layout, num_blocks=40, head_dim=32)
            for dtype in kvcache_backend.quantized_dtypes
            for layout in kvcache_backend.kv_layouts
        ]
        configs: list[CacheConfig] = [*kvcache_backend.configs(num_blocks=40), *quantized]
        for config in configs:
            with kvcache_backend.manager(config) as manager:
                step, handles = _filled(manager, LENGTHS)
                context = f"dtype {config.dtype}, layout {config.kv_layout}"
                for layer in range(config.num_layers):
                    _check(manager, step, handles, layer, context)

    def test_padded_gathers_of_advanced_decode_steps_hold_each_request_s_last_tokens(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        # Each decode step the last one's ``advance``: its padded slots may be the last step's
        # with a column more (no earlier token moved), whether a request grew in its block or
        # opened one, at every width (the longest request's grows with it) and layout.
        for config in kvcache_backend.configs(num_blocks=40):
            with kvcache_backend.manager(config) as manager:
                step, handles = _filled(manager, LENGTHS, decodes=0)
                rng = np.random.default_rng(23)
                opened = 0
                for turn in range(2 * config.block_size + 1):
                    before = step.page_table.block_tables.shape[1]
                    step = step.advance()
                    opened += step.page_table.block_tables.shape[1] - before
                    for layer in range(config.num_layers):
                        _write(manager, step.slots, rng, layer)
                        _check(manager, step, handles, layer, f"dtype {config.dtype}, decode step {turn + 1}")
                assert opened, "no request opened a block: the case tests half of it"

    @pytest.mark.kvcache_requires("sliding_window")
    def test_a_padded_gather_of_a_window_holds_the_tokens_the_window_keeps(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        for config in kvcache_backend.configs(num_blocks=40, sliding_window=5):
            with kvcache_backend.manager(config) as manager:
                step, handles = _filled(manager, (13, 6, 2), decodes=4)
                assert any(
                    handle.num_tokens() > table_tokens
                    for handle, table_tokens in zip(handles, step.page_table.seq_lens.tolist(), strict=True)
                ), "the window released no block: the case tests nothing"
                _check(manager, step, handles, 0, f"window 5, dtype {config.dtype}, layout {config.kv_layout}")

    def test_a_padded_gather_refuses_bad_arguments_by_name(self, kvcache_backend: BackendUnderTest) -> None:
        config = kvcache_backend.config(num_blocks=40)
        with kvcache_backend.manager(config) as manager:
            step, handles = _filled(manager, LENGTHS)
            capacity = config.num_blocks * config.block_size
            for read in (step.gather_padded, step.padded_view):
                for width in (-1, capacity + 1, 2.0, "3", True):
                    with pytest.raises(InvalidArgumentError, match="width"):
                        read(0, width=width)  # type: ignore[arg-type]  # what the case tests
                for layout in ("HDN", "heads_first", None):
                    with pytest.raises(InvalidArgumentError, match="layout"):
                        read(0, layout=layout)  # type: ignore[arg-type]  # what the case tests
                for layer in (-1, config.num_layers, "0"):
                    with pytest.raises(LayerIndexError):
                        read(layer)  # type: ignore[arg-type]  # what the case tests
            keys, _ = step.gather_padded(0, width=capacity)  # the largest width there is
            assert tuple(keys.shape[:2]) == (len(LENGTHS), capacity)
            manager.begin_step(handles, [1] * len(LENGTHS))  # the requests grew: the old step is stale
            with pytest.raises(StaleStepError):
                step.gather_padded(0)
            with pytest.raises(StaleStepError):
                step.padded_view(0)

    def test_a_padded_gather_of_an_empty_step_is_an_empty_batch(self, kvcache_backend: BackendUnderTest) -> None:
        for config in kvcache_backend.configs(num_blocks=40):
            with kvcache_backend.manager(config) as manager:
                step = manager.begin_step([], [])
                for width, layout in ((None, "NHD"), (3, "NHD"), (3, "HND")):
                    keys, values = step.gather_padded(0, width=width, layout=layout)
                    columns = 0 if width is None else width
                    heads, dim, value_dim = config.num_heads, config.head_dim, config.value_width
                    nhd = layout == "NHD"
                    expected = ((0, columns, heads, dim), (0, columns, heads, value_dim))
                    if not nhd:
                        expected = ((0, heads, columns, dim), (0, heads, columns, value_dim))
                    got = (manager.storage.array_info(keys)[0], manager.storage.array_info(values)[0])
                    context = f"dtype {config.dtype}, layout {config.kv_layout}, width {width}, {layout}"
                    assert got == expected, f"{context}: shapes {got}, expected {expected}"

    @pytest.mark.kvcache_requires("state_layers")
    def test_a_padded_gather_of_a_state_layer_is_refused(self, kvcache_backend: BackendUnderTest) -> None:
        from kvcache_core.testing.states import STATE, state_config

        config = state_config(kvcache_backend, layers=(LayerSpec(state=STATE), LayerSpec()), num_blocks=40)
        with kvcache_backend.manager(config) as manager:
            step, handles = _filled(manager, LENGTHS, decodes=0)
            with pytest.raises(LayerIndexError):
                step.gather_padded(0)
            _check(manager, step, handles, 1, "the K/V layer after a state layer")
