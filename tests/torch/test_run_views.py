"""``request_run_views``: one request's run of blocks as views of a torch pool, or ``None``
wherever a view could not show its tokens in order."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvcache_core import AllocationRequest, PagedKvCacheHandle, PagedKvCacheManager, create_manager
from kvcache_core.contract.page_table import PageTable
from kvcache_torch import TorchStorage
from kvcache_torch.run_views import request_run_views
from tests.core.support import make_config

Manager = PagedKvCacheManager[torch.Tensor]
Handle = PagedKvCacheHandle[torch.Tensor]


def _manager(layout: str, window: int | None = None) -> tuple[Manager, TorchStorage]:
    config = dataclasses.replace(
        make_config(num_layers=2, num_heads=2, head_dim=8, block_size=4, num_blocks=32),
        kv_layout=layout,
        sliding_window=window,
    )
    manager: Manager = create_manager("torch", config)
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    return manager, storage


def _fill(manager: Manager, request: str, tokens: int, seed: int) -> tuple[Handle, torch.Tensor, torch.Tensor]:
    """Allocate ``request``, write ``tokens`` random K/V into layer 1; returns its handle and them."""
    handle = manager.allocate(AllocationRequest(request, max_sequence_length=64))
    step = manager.begin_step([handle], [tokens])
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn((tokens, 2, 8), generator=generator) for _ in range(2))
    step.write(1, keys, values)
    return handle, keys, values


@pytest.mark.parametrize("layout", ["heads_first", "NHD"])
@pytest.mark.parametrize("tokens", [0, 1, 4, 9, 13])
def test_a_run_s_last_tokens_are_views_of_the_pool_in_token_order(layout: str, tokens: int) -> None:
    manager, storage = _manager(layout)
    handle, keys, values = _fill(manager, "r", 13, seed=tokens)
    table = manager.page_table([handle])
    views = request_run_views(table, storage.key_cache(1), storage.value_cache(1), layout, tokens)
    assert views is not None
    for view, written in zip(views, (keys, values), strict=True):
        assert view.shape == (1, 2, tokens, 8)
        assert torch.equal(view[0], written[13 - tokens :].transpose(0, 1))
        assert view.untyped_storage().data_ptr() == storage.pool.untyped_storage().data_ptr()  # nothing copied


def _table(pages: list[int], tokens: int) -> PageTable:
    """One request holding ``tokens`` tokens in ``pages`` (blocks of 4)."""
    return PageTable(
        kv_indptr=np.array([0, len(pages)]),
        kv_indices=np.array(pages, dtype=np.int32),
        kv_last_page_len=np.array([tokens - (len(pages) - 1) * 4]),
        block_tables=np.array([pages], dtype=np.int32),
        seq_lens=np.array([tokens]),
        block_size=4,
    )


def test_no_view_where_it_could_not_show_the_tokens_in_order() -> None:
    manager, storage = _manager("heads_first")
    caches = storage.key_cache(1), storage.value_cache(1)
    assert request_run_views(_table([3, 4, 5], 10), *caches, "heads_first", 10) is not None
    assert request_run_views(_table([3, 5, 6], 10), *caches, "heads_first", 10) is None  # two runs
    assert request_run_views(_table([3, 4, 5], 10), *caches, "heads_first", 11) is None  # more than it holds
    assert request_run_views(_table([3, 4, 5], 10), *caches, "heads_first", -1) is None
    first, _, _ = _fill(manager, "a", 3, seed=1)
    second, _, _ = _fill(manager, "b", 4, seed=2)
    both = manager.page_table([second, first])
    assert request_run_views(both, *caches, "heads_first", 3) is None  # a batch
    hnd_manager, hnd = _manager("HND")
    handle, _, _ = _fill(hnd_manager, "c", 6, seed=3)
    table = hnd_manager.page_table([handle])
    assert request_run_views(table, hnd.key_cache(1), hnd.value_cache(1), "HND", 6) is None  # tokens strided per block


def test_a_window_s_table_gets_no_view() -> None:
    manager, storage = _manager("heads_first", window=4)
    handle, _, _ = _fill(manager, "w", 9, seed=4)
    table = manager.page_table([handle])
    assert request_run_views(table, storage.key_cache(1), storage.value_cache(1), "heads_first", 3) is None
