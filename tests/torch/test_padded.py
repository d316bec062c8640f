"""The torch pool's padded gather reads each way it has (one head; a row per call; a head of
a row per call, from 256 KiB a head) what ``manager.gather`` gives, padded on the left."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager


def _expected(manager: PagedKvCacheManager[torch.Tensor], handles: list[object], layer: int) -> torch.Tensor:
    """``[B, heads, width, dim]`` keys from ``manager.gather``, zeros before each row's tokens."""
    rows = [manager.gather(handle, layer)[0] for handle in handles]  # type: ignore[arg-type]  # handles
    width = max(int(row.shape[0]) for row in rows)
    out = torch.zeros((len(rows), rows[0].shape[1], width, rows[0].shape[2]))
    for index, row in enumerate(rows):
        out[index, :, width - row.shape[0] :] = row.transpose(0, 1)
    return out


@pytest.mark.parametrize(
    ("heads", "head_dim", "lengths"),
    [(1, 40, (37, 5, 12)), (2, 16, (37, 5, 12)), (2, 64, (1100, 700, 5))],
    ids=["one head", "a row per call", "a head of a row per call"],
)
@pytest.mark.parametrize("kv_layout", ["heads_first", "NHD"])
def test_the_padded_read_holds_each_row_s_tokens_after_zeros(
    heads: int, head_dim: int, lengths: tuple[int, ...], kv_layout: str
) -> None:
    config = CacheConfig(
        num_layers=2, num_heads=heads, head_dim=head_dim, block_size=16, num_blocks=160, kv_layout=kv_layout
    )
    with create_manager("torch", config) as manager:
        handles = [manager.allocate(AllocationRequest(f"r{row}")) for row in range(len(lengths))]
        step = manager.begin_step(handles, list(lengths))
        generator = torch.Generator().manual_seed(3)
        for layer in range(2):
            shape = (sum(lengths), heads, head_dim)
            step.write(layer, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for layer in range(2):
            keys, _ = step.gather_padded(layer, layout="HND")
            assert keys.is_contiguous()
            assert torch.equal(keys, _expected(manager, list(handles), layer))
            nhd, _ = step.gather_padded(layer, layout="NHD")
            assert torch.equal(nhd, keys.transpose(1, 2))
        assert np.array_equal(step.page_table.seq_lens, lengths)
