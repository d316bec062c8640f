"""The indexed copies that write new K/V into the torch pool
(:class:`~kvcache_torch.storage.TorchStorage`): whole rows, or the part of each row that a view
of a shared page holds (:mod:`kvcache_core.contract.views`: Gemma 4's sliding layers two to a
page of its full layers' width), in one indexed copy per pool either way.
"""

from __future__ import annotations

import torch

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.groups import ViewPlace

__all__ = ["scatter"]


def scatter(
    targets: tuple[torch.Tensor, torch.Tensor],
    config: CacheConfig,
    slot_index: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    place: ViewPlace | None = None,
) -> None:
    """Copy ``[n, h, d]`` keys and ``[n, h, dv]`` values into the slots ``slot_index`` of the
    K and V ``targets`` of one layer: flat ``[slots, H, D]`` (NHD), ``[H, slots, D]``
    (heads-first) or token-major ``[blocks, block_size, H, D]`` (HND). With ``place``, into
    the heads and features from there, the rest of each row kept; else whole rows."""
    layout = config.kv_layout
    for kv, target, data in ((0, targets[0], keys), (1, targets[1], values)):
        if place is not None:
            first = place.value if kv else place.key
            heads = slice(place.head, place.head + data.shape[1])
            features = slice(first, first + data.shape[2])
            if layout == "NHD":
                target = target[:, heads, features]
            elif layout == "heads_first":
                target = target[heads, :, features]
            else:
                target = target[:, :, heads, features]
        if layout == "NHD":
            target.index_copy_(0, slot_index, data)
        elif layout == "heads_first":
            target.index_copy_(1, slot_index, data.transpose(0, 1))
        else:
            blocks = torch.div(slot_index, config.block_size, rounding_mode="floor")
            target.index_put_((blocks, slot_index - blocks * config.block_size), data)
