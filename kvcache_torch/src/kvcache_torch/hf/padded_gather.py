"""The contiguous path's K/V read from the pool in one indexed read per pool: every row of a
left-padded batch straight into the padded ``[batch, kv_heads, positions, head_dim]`` tensor
the model attends over.

``BatchRows.gather_padded`` otherwise copies each row's tokens out of the pool
(``manager.gather``) and then into a zeroed batch: three passes over the K/V, and a dozen
Python and torch calls per row and layer. Here the step's page table of the layer's
KV-cache group gives, once per step, the pool slot of every real position of every row (the
plan); each layer then takes one ``index_select`` per pool into the batch, and zeroes its
padding positions in place. That needs an unquantized torch pool in the NHD or heads-first
layout (a token's heads are one row of a flat view), a left-padded batch (each row's tokens
end the positions) and a page table listing every token of the rows (no window released
any); elsewhere :meth:`PaddedGather.read` gives ``None`` and the rows are gathered one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core import PagedKvCacheManager, Step
from kvcache_core.contract.config import QUANTIZED_DTYPES
from kvcache_torch.dtypes import tensor_of
from kvcache_torch.storage import TorchStorage

__all__ = ["GatherPlan", "PaddedGather"]


@dataclass(frozen=True)
class GatherPlan:
    """Where a step's rows read their positions: ``index`` ``[batch * positions]`` int64 pool
    slots (a padding position reads slot 0, then zeroed), ``padding`` ``[batch, positions]``
    bool (``None``: no row is padded)."""

    batch: int
    positions: int
    index: torch.Tensor
    padding: torch.Tensor | None


class PaddedGather:
    """Reads a left-padded batch's K/V of one layer from the pool (see the module docstring),
    planning once per step and KV-cache group."""

    def __init__(self, manager: PagedKvCacheManager[torch.Tensor]) -> None:
        self._manager = manager
        config = manager.config
        storage = manager.storage
        self._storage = storage if isinstance(storage, TorchStorage) else None
        self._usable = (
            self._storage is not None
            and config.kv_layout in ("NHD", "heads_first")
            and config.dtype not in QUANTIZED_DTYPES
        )
        self._heads_first = config.kv_layout == "heads_first"
        self._plans: tuple[Step[torch.Tensor], int, int, GatherPlan | None] | None = None

    def read(
        self,
        layer: int,
        step: Step[torch.Tensor],
        request_ids: list[str],
        tokens: list[int],
        stored: npt.NDArray[np.bool_],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row's K/V of ``layer`` as ``[batch, kv_heads, positions, head_dim]`` (values:
        their width), zeros at the positions a row did not store; ``None`` where this read does
        not apply. ``step``: the forward's step (its rows in the order of ``request_ids``),
        ``tokens``: per row, its tokens; ``stored``: ``[batch, positions]`` which positions each
        row stored."""
        if not self._usable or self._storage is None:
            return None
        group, index = self._manager.config.layer_place(layer)
        plan = self._plan(step, group, request_ids, tokens, stored)
        if plan is None:
            return None
        storage, heads_first = self._storage, self._heads_first
        return _read(storage.key_cache(index), plan, heads_first), _read(storage.value_cache(index), plan, heads_first)

    def _plan(
        self,
        step: Step[torch.Tensor],
        group: int,
        request_ids: list[str],
        tokens: list[int],
        stored: npt.NDArray[np.bool_],
    ) -> GatherPlan | None:
        known = self._plans
        positions = int(stored.shape[1])
        if known is not None and known[0] is step and known[1] == group and known[2] == positions:
            return known[3]
        plan = _plan_rows(step, group, request_ids, tokens, stored)
        self._plans = (step, group, positions, plan)
        return plan


def _plan_rows(
    step: Step[torch.Tensor], group: int, request_ids: list[str], tokens: list[int], stored: npt.NDArray[np.bool_]
) -> GatherPlan | None:
    """The slots of every row's positions from the step's page table of ``group``; ``None``
    when a row is not left-padded or the table does not list every token of its row."""
    table = step.page_tables[group]
    batch, positions = stored.shape
    held = np.asarray(tokens, dtype=np.int64)
    if (
        step.request_ids != tuple(request_ids)
        or batch != len(tokens)
        or not batch
        or table.block_tables.shape[1] == 0
        or not np.array_equal(table.seq_lens, held)
    ):
        return None
    counts = stored.sum(axis=1)
    token = np.arange(positions, dtype=np.int64)[None, :] - (positions - counts)[:, None]  # <0: padding
    real = token >= 0
    if not np.array_equal(real, stored) or not np.array_equal(counts, held):
        return None  # not left-padded, or a row stores other tokens than its own
    token = np.maximum(token, 0)
    block_size = table.block_size
    blocks = np.take_along_axis(table.block_tables, token // block_size, axis=1).astype(np.int64)
    slots = blocks * block_size + token % block_size
    index = tensor_of(np.ascontiguousarray(slots.reshape(-1)))
    padding = None if bool(real.all()) else tensor_of(~real)
    return GatherPlan(batch, positions, index, padding)


def _read(pool: torch.Tensor, plan: GatherPlan, heads_first: bool) -> torch.Tensor:
    """``[batch, heads, positions, dim]`` from one layer's pool view (NHD ``[blocks, block_size,
    heads, dim]`` or heads-first ``[heads, blocks, block_size, dim]``)."""
    batch, positions = plan.batch, plan.positions
    if heads_first:
        heads, dim = int(pool.shape[0]), int(pool.shape[3])
        rows = pool.view(heads, -1, dim).index_select(1, plan.index)
        out = rows.view(heads, batch, positions, dim).transpose(0, 1).contiguous()
    else:
        heads, dim = int(pool.shape[2]), int(pool.shape[3])
        rows = pool.view(-1, heads, dim).index_select(0, plan.index)
        out = rows.view(batch, positions, heads, dim).transpose(1, 2).contiguous()
    if plan.padding is not None:
        out.masked_fill_(plan.padding[:, None, :, None], 0)
    return out
