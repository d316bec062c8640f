"""The torch pool's padded gather (:mod:`kvcache_core.contract.padded`): a step's K/V of one
layer read in one pass per pool, straight into the padded batch.

Core gives the slot of every position (``-1``: padding, which opens each row), the same
frozen array for every layer of a step; the reader turns it once into an index tensor and each
row's padding count. Per layer it takes the rows of the pool's flat view (NHD ``[slots, heads,
dim]``, heads-first ``[heads, slots, dim]``), lays them out as asked and zeroes each row's
padding as one slice: one pass over the K/V where a gather per request, a zeroed batch and a
copy into it take three (a heads-first pool read heads second, as transformers takes it, goes
straight into place, a row or a head of a row per ``index_select``).

On CPU, a heads-first pool read heads second is copied run by run in compiled code instead
(:mod:`kvcache_core.attention.gather_kernel`, on torch's OpenMP threads; keys and values in
one call, :func:`~kvcache_core.attention.gather_kernel.gather_runs_together`): inside transformers'
``generate`` of 8 ragged prompts (machine C, 2 KV heads of 64, about 2k positions) 1.0 ms a
pool and layer against about 1.5 ms an ``index_select`` a head of a row; the torch reads stay
where numba is missing or switched off.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.attention.gather_kernel import SlotRuns, gather_runs_together
from kvcache_core.attention.kernel import kernel_available
from kvcache_torch.dtypes import tensor_of
from kvcache_torch.threads import torch_team

__all__ = ["PaddedReader"]

#: Slot arrays remembered at most (a step has one per KV-cache group and width).
_MEMO_SIZE = 8
#: From this many bytes per head and row, a heads-first pool is read a head of a row per call,
#: else a row per call. Measured on machine C (AMD EPYC, 2 threads), 8 rows of the padded
#: batch against one read then a transposing copy: 8 heads x 1985 positions x 128 floats
#: (1 MiB a head) 10.8 ms a head at a time, 16.8 ms a row at a time, 20.3 ms one read and a copy;
#: 256 positions (128 KiB) 2.1, 1.5 and 1.9 ms.
_HEAD_COPY_BYTES = 256 * 1024


class PaddedReader:
    """Reads padded batches from one pool's flat layer views (NHD or heads-first).

    Args:
        heads_first: the views are ``[heads, slots, dim]`` (else ``[slots, heads, dim]``).
        device: the pool's.
    """

    __slots__ = ("_device", "_heads_first", "_last", "_memo")

    def __init__(self, heads_first: bool, device: torch.device) -> None:
        self._heads_first, self._device = heads_first, device
        # Frozen slot arrays lately read (by id, the array kept alive) and their plans: a
        # step's KV-cache groups each pass their own.
        self._memo: dict[int, tuple[npt.NDArray[np.int64], _Plan]] = {}
        self._last: _Plan | None = None  # the last plan made: the next decode step's extends its runs

    def read(
        self, keys: torch.Tensor, values: torch.Tensor, slots: npt.NDArray[np.int64], layout: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` at ``slots`` ``[batch, positions]`` of the flat views, zeros at
        ``-1``, ``[batch, positions, heads, dim]`` (``"NHD"``) or heads second (``"HND"``)."""
        plan = self._plan(slots)
        if self._heads_first and layout == "HND":
            both = plan.take_together(keys, values)
            if both is not None:
                return both
        return plan.take(keys, self._heads_first, layout), plan.take(values, self._heads_first, layout)

    def view(
        self, keys: torch.Tensor, values: torch.Tensor, first: int, positions: int, layout: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``first`` to ``first + positions - 1`` of the flat views as a padded batch of one
        row, ``[1, positions, heads, dim]`` (``"NHD"``) or heads second (``"HND"``): views, no copy."""
        return self._run(keys, first, positions, layout), self._run(values, first, positions, layout)

    def _run(self, rows: torch.Tensor, first: int, positions: int, layout: str) -> torch.Tensor:
        if self._heads_first:  # [heads, slots, dim]: heads second already
            run = rows.narrow(1, first, positions)[None]
            return run if layout == "HND" else run.transpose(1, 2)
        run = rows.narrow(0, first, positions)[None]  # [slots, heads, dim]
        return run.transpose(1, 2) if layout == "HND" else run

    def _plan(self, slots: npt.NDArray[np.int64]) -> _Plan:
        known = self._memo.get(id(slots))
        if known is not None and known[0] is slots:
            return known[1]
        plan = self._last = _Plan(slots, self._device, self._last)
        base: Any = slots.base
        if not slots.flags.writeable and isinstance(base, np.ndarray) and not base.flags.writeable:
            if len(self._memo) >= _MEMO_SIZE:  # an earlier step's: dropped
                self._memo.clear()
            self._memo[id(slots)] = (slots, plan)  # frozen: the same positions for every layer
        return plan


class _Plan:
    """One slot array's reads. Made at the first read that needs them: the index tensor of the
    torch reads and, per row, how many padding positions open it (zeroed as one slice: a
    broadcast mask measured 3-5x slower); on CPU, the runs of consecutive slots of the compiled
    copy (:class:`~kvcache_core.attention.gather_kernel.SlotRuns`), from the ``previous``
    plan's where this array is that one with one more position per row (the next decode step's:
    a few array operations per row instead of a pass over every position)."""

    __slots__ = ("_batch", "_cpu", "_device", "_index", "_leads", "_positions", "_previous", "_runs", "_slots")

    def __init__(self, slots: npt.NDArray[np.int64], device: torch.device, previous: _Plan | None = None) -> None:
        self._batch, self._positions = int(slots.shape[0]), int(slots.shape[1])
        self._slots, self._device, self._cpu = slots, device, device.type == "cpu"
        self._runs: SlotRuns | None = None
        self._previous = previous if self._cpu else None  # dropped once the runs are found
        if previous is not None:
            previous._previous = None  # (a chain of plans never read that way holds two at most)
        self._index: torch.Tensor | None = None
        self._leads: list[tuple[int, int]] = []

    def _slot_runs(self) -> SlotRuns:
        """The runs (found once): the previous plan's extended where they extend, else anew."""
        if self._runs is None:
            previous, self._previous = self._previous, None
            slots = self._slots
            if previous is not None and previous._runs is not None:
                old = previous._slots
                if old.shape == (slots.shape[0], slots.shape[1] - 1) and np.array_equal(slots[:, :-1], old):
                    self._runs = previous._runs.extended(slots)
            if self._runs is None:
                self._runs = SlotRuns(slots)
        return self._runs

    def _indexing(self) -> torch.Tensor:
        """The index tensor of the torch reads (made once), and the rows' padding counts."""
        if self._index is None:
            pads = self._slots < 0  # the padding opens each row (the contract's left padding)
            self._leads = [(row, lead) for row, lead in enumerate(pads.sum(axis=1).tolist()) if lead]
            self._index = tensor_of(np.where(pads, 0, self._slots).reshape(-1).astype(np.int64)).to(self._device)
        return self._index

    def take_together(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A heads-first pool's keys and values read heads second in one compiled call (one
        start of the team for both), or ``None`` where it does not run (not on CPU, numba
        missing or off, rows it does not copy)."""
        same = keys.element_size() == values.element_size() and keys.shape[0] == values.shape[0]
        if not (same and self._cpu and kernel_available()):
            return None
        shape = (self._batch, int(keys.shape[0]), self._positions)
        out_keys, out_values = (
            keys.new_empty((*shape, int(keys.shape[2]))),
            values.new_empty((*shape, int(values.shape[2]))),
        )
        pairs = ((_bits(keys), _bits(out_keys)), (_bits(values), _bits(out_values)))
        return (out_keys, out_values) if gather_runs_together(pairs, self._slot_runs(), torch_team()) else None

    def take(self, rows: torch.Tensor, heads_first: bool, layout: str) -> torch.Tensor:
        batch, positions = self._batch, self._positions
        dim = int(rows.shape[2])
        heads = int(rows.shape[0] if heads_first else rows.shape[1])
        index = self._indexing()
        if heads_first and layout == "HND" and heads > 1:  # straight into place: one pass, no transpose
            out = rows.new_empty((batch, heads, positions, dim))
            by_row = index.view(batch, positions)
            if positions * dim * rows.element_size() >= _HEAD_COPY_BYTES:  # a head of a row at a time
                for row in range(batch):
                    for head in range(heads):
                        torch.index_select(rows[head], 0, by_row[row], out=out[row, head])
            else:
                for row in range(batch):
                    torch.index_select(rows, 1, by_row[row], out=out[row])
        elif heads_first:  # [heads, batch * positions, dim]
            taken = rows.index_select(1, index).view(heads, batch, positions, dim)
            out = (taken.permute(1, 0, 2, 3) if layout == "HND" else taken.permute(1, 2, 0, 3)).contiguous()
        else:  # [batch * positions, heads, dim]
            out = rows.index_select(0, index).view(batch, positions, heads, dim)
            if layout == "HND":
                out = out.transpose(1, 2).contiguous()
        for row, lead in self._leads:
            (out[row, :, :lead] if layout == "HND" else out[row, :lead]).zero_()
        return out


#: The integer type of each element size: a tensor's bits as NumPy reads them (NumPy has no bfloat16).
_BIT_TYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A CPU tensor's elements as integers of their size, in place (a NumPy view)."""
    return tensor.view(_BIT_TYPES[tensor.element_size()]).numpy()
