"""The contiguous path (``sdpa``, ``eager``) reads a left-padded batch's K/V with the step's
padded gather (``Step.gather_padded``), one read per pool where the storage has it, and gives
the logits the row-by-row gather gives, bit for bit, and ``DynamicCache``'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from kvcache_core import PagedKvCacheManager, Step, create_manager
from kvcache_torch.hf.rows import BatchRows
from kvcache_torch.lanes import TorchLane
from kvcache_torch.storage import TorchStorage
from tests.torch.hf_support import (
    TOLERANCE,
    Model,
    PagedCache,
    Tensor,
    build_model,
    cache_config_for,
    generate,
    max_logit_difference,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _row_by_row(*arguments: object) -> bool:
    """``BatchRows._left_padded`` of the row-by-row path: never."""
    return False


def _no_lane(*arguments: object) -> None:
    """``TorchStorage.step_lane`` of a storage without lanes: the manager's general path serves."""
    return None


def _manager(model: Model, layout: str, dtype: str | None = None) -> PagedKvCacheManager[Tensor]:
    config = cache_config_for(model, num_blocks=96, block_size=4)
    config = dataclasses.replace(config, kv_layout=layout, dtype=config.dtype if dtype is None else dtype)
    manager: PagedKvCacheManager[Tensor] = create_manager("torch", config)
    return manager


def _sdpa_pair(**overrides: Any) -> tuple[Model, Model]:
    """``(model on sdpa, the same weights on sdpa)``: one for ours, one for DynamicCache."""
    model = build_model(**overrides)
    model.set_attn_implementation("sdpa")
    reference = build_model(**overrides)
    reference.set_attn_implementation("sdpa")
    return model, reference


def _run(model: Model, manager: PagedKvCacheManager[Tensor], ids: Tensor, mask: Tensor) -> tuple[Any, int]:
    """``generate`` through a PagedCache; returns its output and the padded gathers it made."""
    calls = [0]
    original: Callable[..., Any] = vars(Step)["gather_padded"]

    def counted(step: Step[Tensor], *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(step, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Step, "gather_padded", counted)
        with PagedCache(manager, model.config) as cache:
            output = generate(model, ids, mask, cache)
    return output, calls[0]


@pytest.mark.parametrize("layout", ["heads_first", "NHD", "HND"])
def test_a_left_padded_batch_is_read_in_one_padded_gather_per_layer(layout: str) -> None:
    model, reference = _sdpa_pair()
    ids, mask = prompts(3, 10, pads=(0, 4, 1))
    ours, gathers = _run(model, _manager(model, layout), ids, mask)
    layers = model.config.num_hidden_layers
    assert gathers == layers * 5  # every decode forward after the first, every layer
    with pytest.MonkeyPatch.context() as patch:  # the same run, row by row
        patch.setattr(BatchRows, "_left_padded", _row_by_row)
        by_rows, none = _run(model, _manager(model, layout), ids, mask)
    assert none == 0
    for got, expected in zip(ours.logits, by_rows.logits, strict=True):
        assert torch.equal(got, expected)
    assert max_logit_difference(ours.logits, generate(reference, ids, mask).logits) <= TOLERANCE


def test_what_one_decode_step_found_of_the_rows_padding_holds_at_the_next() -> None:
    # Whether the padded gather serves the rows (each row's stored positions its last tokens)
    # is found from the batch's arrays at the first decode step; each later one, advanced from
    # it, carries it: one more stored position per row keeps it true.
    model, reference = _sdpa_pair()
    ids, mask = prompts(3, 10, pads=(0, 4, 1))
    calls = [0]
    original: Callable[..., bool] = vars(BatchRows)["_stored_last"]

    def counted(rows: BatchRows, *args: Any) -> bool:
        calls[0] += 1
        return original(rows, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchRows, "_stored_last", counted)
        ours, gathers = _run(model, _manager(model, "heads_first"), ids, mask)
    assert gathers == model.config.num_hidden_layers * 5
    assert calls[0] == 1
    assert max_logit_difference(ours.logits, generate(reference, ids, mask).logits) <= TOLERANCE


def test_a_quantized_pool_is_read_request_by_request_with_the_same_logits() -> None:
    model, _ = _sdpa_pair()
    ids, mask = prompts(3, 10, pads=(0, 4, 1))
    ours, gathers = _run(model, _manager(model, "heads_first", "int8"), ids, mask)
    assert gathers == model.config.num_hidden_layers * 5  # core gathers request by request (the storage declines)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchRows, "_left_padded", _row_by_row)
        by_rows, _ = _run(model, _manager(model, "heads_first", "int8"), ids, mask)
    for got, expected in zip(ours.logits, by_rows.logits, strict=True):
        assert torch.equal(got, expected)


def test_a_sliding_layer_reads_its_window_s_positions_in_one_padded_gather() -> None:
    # Mistral with a window of 6: the sliding layers' group releases blocks as the rows grow,
    # and each forward reads only the window's last positions, as DynamicSlidingWindowLayer.
    model, reference = _sdpa_pair(architecture="mistral", sliding_window=6)
    ids, mask = prompts(3, 10, pads=(0, 4, 1))
    ours, gathers = _run(model, _manager(model, "heads_first"), ids, mask)
    assert gathers == model.config.num_hidden_layers * 5
    assert max_logit_difference(ours.logits, generate(reference, ids, mask).logits) <= TOLERANCE
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchRows, "_left_padded", _row_by_row)
        by_rows, _ = _run(model, _manager(model, "heads_first"), ids, mask)
    for got, expected in zip(ours.logits, by_rows.logits, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("layout", "dtype", "viewed", "lanes"),
    [
        ("heads_first", None, True, True),
        ("NHD", None, True, True),
        ("heads_first", None, True, False),
        ("HND", None, False, True),
        ("heads_first", "int8", False, True),
    ],
)
def test_one_request_in_one_run_reads_views_of_the_pool_with_the_same_logits(
    layout: str, dtype: str | None, viewed: bool, lanes: bool
) -> None:
    # One prompt's blocks are one run: each layer's update writes its K/V and hands back views
    # of the pool in one call (Step.write_and_view; through the storage's lane, or without one
    # through the manager's general path), nothing copied, where the layout lays a run's tokens
    # out in order and the pool is unquantized; elsewhere the padded gather copies them. The
    # logits are the same bit for bit.
    model, reference = _sdpa_pair()
    ids, mask = prompts(1, 10)
    manager = _manager(model, layout, dtype)
    seen: list[tuple[Tensor, Tensor] | None] = []
    original: Callable[..., Any] = vars(Step)["write_and_view"]

    def recorded(step: Step[Tensor], *args: Any, **kwargs: Any) -> Any:
        result = original(step, *args, **kwargs)
        seen.append(result)
        return result

    served: list[bool] = []
    through_lane: Callable[..., Any] = vars(TorchLane)["write_and_view"]

    def lane_recorded(lane: TorchLane, *args: Any) -> Any:
        result = through_lane(lane, *args)
        served.append(result is not None)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Step, "write_and_view", recorded)
        patch.setattr(TorchLane, "write_and_view", lane_recorded)
        if not lanes:
            patch.setattr(TorchStorage, "step_lane", _no_lane)
        ours, gathers = _run(model, manager, ids, mask)
    layers = model.config.num_hidden_layers
    assert len(seen) == layers * 5  # every decode forward after the first, every layer
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    pool = storage.pool.untyped_storage().data_ptr()
    # the lane shows what it can (every call, here), and a storage without lanes the manager
    assert served == ([True] * layers * 5 if viewed and lanes else [False] * len(served))
    if viewed:
        assert gathers == 0
        assert all(views is not None and views[0].untyped_storage().data_ptr() == pool for views in seen)
    else:
        assert gathers == layers * 5
        assert all(views is None for views in seen)

    def written_not_shown(step: Step[Tensor], layer: int, keys: Tensor, values: Tensor, **_: object) -> None:
        step.write(layer, keys, values)

    with pytest.MonkeyPatch.context() as patch:  # the same run, copied by the padded gather
        patch.setattr(Step, "write_and_view", written_not_shown)
        copied, gathers = _run(model, _manager(model, layout, dtype), ids, mask)
    assert gathers == layers * 5
    for got, expected in zip(ours.logits, copied.logits, strict=True):
        assert torch.equal(got, expected)
    if dtype is None:
        assert max_logit_difference(ours.logits, generate(reference, ids, mask).logits) <= TOLERANCE
