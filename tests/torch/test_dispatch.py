"""The torch backend's attention dispatch: ``"auto"`` measures the kernel and torch's own
path once per shape class on this machine and runs the faster; pins force either."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcache_core import CacheConfig, create_manager
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.backends import dispatch
from kvcache_core.errors import UnsupportedConfigError
from kvcache_torch import dispatch as torch_dispatch
from tests.torch.support import dispatch_file, fill, make_manager

needs_numba = pytest.mark.skipif(not paged_kernel.kernel_available(), reason="numba is not installed (or switched off)")


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The users' default: nothing pinned, choices kept in ``tmp_path``, none known yet."""
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    monkeypatch.setenv(dispatch.CACHE_DIR_ENV, str(tmp_path))
    torch_dispatch.DISPATCH.forget()
    yield tmp_path
    torch_dispatch.DISPATCH.forget()


def counting_kernel(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = paged_kernel.attend_with_kernel

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_kernel, "attend_with_kernel", counted)
    return calls


@needs_numba
def test_auto_measures_a_shape_class_once_and_runs_its_winner(measured: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make_manager(kv_layout="heads_first")
    filled = fill(manager, [30, 9])
    table = manager.page_table(filled.handles)
    query = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    calls = counting_kernel(monkeypatch)
    first = manager.paged_attention(0, query, table)
    assert len(calls) > 2  # calibrated: the kernel ran several times
    choices = torch_dispatch.DISPATCH.choices()
    assert len(choices) == 1
    ((key, choice),) = choices.items()
    assert key.startswith("decode requests<=2 context<=256 runs=")
    assert "float32 heads_first heads=2x2" in key
    assert choice.path in ("kernel", "native")
    assert set(choice.seconds) == {"kernel", "native"}
    calls.clear()
    second = manager.paged_attention(1, query, table)  # another layer, the same class
    assert len(calls) == (1 if choice.path == "kernel" else 0)
    pinned = make_manager(kv_layout="heads_first")
    pinned_filled = fill(pinned, [30, 9])
    torch.testing.assert_close(first, pinned.paged_attention(0, query, pinned.page_table(pinned_filled.handles)))
    assert second.shape == first.shape
    if choice.settled:
        stored = json.loads(dispatch_file(measured).read_text())
        assert stored["choices"][key]["path"] == choice.path


@needs_numba
@pytest.mark.parametrize("path", ["kernel", "native"])
def test_a_pinned_path_runs_without_measuring(path: str, measured: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = CacheConfig(2, 2, 8, 64, block_size=4, kv_layout="NHD", attention_path=path)
    manager = create_manager("torch", config)
    filled = fill(manager, [13, 21])
    calls = counting_kernel(monkeypatch)
    manager.paged_attention(0, torch.randn(2, 4, 8), manager.page_table(filled.handles))
    assert len(calls) == (1 if path == "kernel" else 0)
    assert torch_dispatch.DISPATCH.choices() == {}


@needs_numba
def test_the_environment_pins_every_pool(measured: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.PATH_ENV, "native")
    manager = make_manager()
    filled = fill(manager, [13])
    calls = counting_kernel(monkeypatch)
    manager.paged_attention(0, torch.randn(1, 2, 8), manager.page_table(filled.handles))
    assert calls == []
    assert torch_dispatch.DISPATCH.choices() == {}


def test_pinning_the_kernel_where_it_cannot_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    with pytest.raises(UnsupportedConfigError, match="numba is missing or KVCACHE_DISABLE_NUMBA is set"):
        create_manager("torch", CacheConfig(1, 2, 8, 4, attention_path="kernel"))
    monkeypatch.setenv(dispatch.PATH_ENV, "kernel")  # pinned by the environment: the torch path where it cannot
    create_manager("torch", CacheConfig(1, 2, 8, 4))


@needs_numba
def test_the_layers_of_a_step_after_the_first_reuse_its_choice(measured: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape class is computed once per step and kind of call, not per layer."""
    from kvcache_torch import attention
    from kvcache_torch import dispatch as torch_dispatch_module

    manager = make_manager(kv_layout="heads_first", num_layers=3)
    filled = fill(manager, [30, 9])
    table = manager.page_table(filled.handles)
    query = torch.randn(2, 4, 8)
    classes: list[object] = []
    real = torch_dispatch_module.shape_class

    def counted(*args: Any, **kwargs: Any) -> Any:
        classes.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "shape_class", counted)
    outputs = [manager.paged_attention(layer, query, table) for layer in range(3)]
    assert len(classes) == 1
    manager.paged_attention(0, query, table, softcap=5.0)  # another kind of call: its own class
    assert len(classes) == 2
    assert all(output.shape == (2, 4, 8) for output in outputs)
