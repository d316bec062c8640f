"""The torch pool's step lane (:mod:`kvcache_core.contract.lanes`): a step's plain layers in a
few torch operations each.

Prepared once per step and KV-cache group: the step's slots, and whether the step is a decode
of one request whose blocks are one run (then its keys and values are one view of the pool per
layer). Per layer, the lane checks its three arrays in a few comparisons, writes the new K/V
(on the CPU, where they are contiguous: one compiled call for both pools,
:class:`~kvcache_core.attention.row_writes.PoolWriter`, made once per layer; inside a model
each torch call costs several times what it costs in a loop, and two indexed copies took 22 us
more a layer; otherwise one indexed copy per pool, or for a step of one new token one ``copy_``
into a view of its slot, the views of every layer made at the first in one loop), and attends:

* one request in one run, where the dispatch chose torch's own path (or it is pinned, or the
  pool is not on the CPU): one ``scaled_dot_product_attention`` on the views of its run (made
  for every layer once the path is known), nothing gathered;
* where the dispatch chose the compiled kernel: its call prepared once for the step
  (:func:`~kvcache_core.attention.kernel.prepare_kernel_call`: the plan, the page table's
  arrays, the options), run on each layer's pools; a float32 query and the output go by
  address where the call can take them (:meth:`~kvcache_core.attention.kernel.KernelCall.attend_at`:
  the layers after the step's first on torch's team), not converted to NumPy and back;
* otherwise through :func:`~kvcache_torch.attention.attend_pool`, the storage's own attention.

The lane reads the dispatch's choice for the step at its first layer, without attending
(:func:`~kvcache_torch.dispatch.measured_plain_path`); only where the step's shape class was
never measured on this machine does that layer take the third way, which measures it. A
decode step is measured as the model runs it instead (its class ``measured="model"``,
:meth:`~kvcache_core.backends.dispatch.AttentionDispatch.trial_path`): until its class is
settled, its steps take the kernel and torch's path in turns, and the lane times each layer's
attention (the step's choice, views and plan, made at its first layer, left out).

A decode step whose batch is of the shape class of the group's last settled decode step takes
its path over (:class:`LaneMemory`): the same query offsets, query shape and threads, a context
within the same bucket and requests in one run each or not alike (what the dispatch's class
holds besides the pool's geometry, which is the group's). Its kernel call is then the settled
one for this batch (:meth:`KernelCall.for_batch`: a new plan and tables, none of the checks),
so the dispatch is looked up once per class and bucket, not once per step. A decode step
advanced from the last one in place (:meth:`~kvcache_core.step.Step.advance`) takes the last
step's lane itself over (:meth:`TorchLane.advance`): the same path, the kernel's call for the
new batch and, for one request in one run, its views one token longer, with nothing else
looked up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.attention.kernel import KernelCall, prepare_kernel_call
from kvcache_core.attention.row_writes import PoolWriter
from kvcache_core.backends.dispatch import ShapeClass
from kvcache_core.contract.page_table import PageTable
from kvcache_torch.attention import attend_pool
from kvcache_torch.dispatch import (
    DISPATCH,
    KERNEL_DTYPES,
    host_view,
    kernel_reads,
    measured_plain_path,
    plain_path,
    shape_class,
)
from kvcache_torch.dtypes import tensor_of
from kvcache_torch.run_views import one_run_span
from kvcache_torch.threads import torch_team

__all__ = ["LaneMemory", "TorchLane"]

_SDPA = torch.nn.functional.scaled_dot_product_attention
#: The paths a decode step takes in turns while its class is measured as the model runs it.
TRIAL_PATHS: Final = ("kernel", "native")


@dataclass(frozen=True, slots=True)
class _Settled:
    """The path a group's decode step settled on and what a later step must share to take it over."""

    offsets: bytes  # the query offsets
    one_run_each: bool  # every request's blocks were one run
    # The longest request's tokens then and the class's context bucket: a step whose longest
    # request holds from the one to the other is in the same bucket.
    longest: int
    context: int
    query: tuple[int, ...]
    threads: int
    chosen: str | None  # the dispatch's path
    kernel: KernelCall | None


class LaneMemory:
    """What a storage's lanes keep between steps: per layer, the pools' host views the kernel
    reads and the compiled writer of the new K/V (made once); per KV-cache group, the path its
    last fully settled step took; per part (keys, values), the distance between consecutive
    layers' write views in their storage, where every layer's is alike (found once)."""

    __slots__ = ("hosts", "layer_steps", "settled", "writers")

    def __init__(self, num_layers: int) -> None:
        self.hosts: list[tuple[npt.NDArray[Any], npt.NDArray[Any]] | None] = [None] * num_layers
        # Per layer, its compiled writer (None: not made yet; False: none runs here).
        self.writers: list[PoolWriter | Literal[False] | None] = [None] * num_layers
        self.settled: dict[int, _Settled] = {}
        self.layer_steps: dict[int, int | None] = {}

    def layer_step(self, part: int, rows: list[torch.Tensor]) -> int | None:
        """The elements from one layer's write view ``rows[layer]`` to the next's, where all are
        of one shape and strides in one storage, evenly spaced (a torch pool's layers are);
        ``None`` otherwise."""
        if part not in self.layer_steps:
            self.layer_steps[part] = _even_spacing(rows)
        return self.layer_steps[part]


def _even_spacing(rows: list[torch.Tensor]) -> int | None:
    """The positive distance between consecutive views of ``rows`` in one storage, all of one
    shape and strides (0 for one view); ``None`` where they are not so."""
    if not rows:
        return None
    first = rows[0]
    step = int(rows[1].storage_offset()) - int(first.storage_offset()) if len(rows) > 1 else 0
    storage = first.untyped_storage().data_ptr()
    for index, rows_of_layer in enumerate(rows):
        if (
            rows_of_layer.shape != first.shape
            or rows_of_layer.stride() != first.stride()
            or rows_of_layer.untyped_storage().data_ptr() != storage
            or rows_of_layer.storage_offset() != first.storage_offset() + index * step
        ):
            return None
    return step if step > 0 or len(rows) == 1 else None


class TorchLane:
    """One step's lane over a torch pool (unquantized, NHD or heads-first layout).

    Args:
        views: per layer, the ``(keys, values)`` pool views in the layout.
        rows: per layer, the flat ``(keys, values)`` write views (``[slots, H, D]`` in NHD,
            ``[H, slots, D]`` heads-first).
        memory: the storage's :class:`LaneMemory` (host views, the groups' settled paths).
        layout: ``"NHD"`` or ``"heads_first"``.
        path: the pool's attention path (``"auto"``, ``"kernel"``, ``"native"``).
        dtype, device: the pool's.
        page_table, slots, qo_indptr: the step's, of this KV-cache group.
    """

    __slots__ = (
        "_device",
        "_dtype",
        "_head_dim",
        "_heads",
        "_heads_first",
        "_index",
        "_inherited",
        "_kernel",
        "_key_shape",
        "_longest",
        "_memory",
        "_mode",
        "_padded_runs",
        "_path",
        "_qo_indptr",
        "_rows",
        "_runs",
        "_settled",
        "_slot",
        "_slots",
        "_span",
        "_table",
        "_through",
        "_tried",
        "_value_shape",
        "_views",
        "_where",
        "_writes",
    )

    def __init__(
        self,
        views: tuple[list[torch.Tensor], list[torch.Tensor]],
        rows: tuple[list[torch.Tensor], ...],
        memory: LaneMemory,
        layout: str,
        path: str,
        dtype: torch.dtype,
        device: torch.device,
        page_table: PageTable,
        slots: npt.NDArray[np.int64],
        qo_indptr: npt.NDArray[np.int32],
    ) -> None:
        self._views, self._rows, self._memory = views, rows, memory
        self._heads_first = layout == "heads_first"
        self._path, self._dtype = path, dtype
        self._device = -1 if device.type == "cpu" else (device.index or 0)  # as Tensor.get_device() gives it
        self._table, self._qo_indptr = page_table, qo_indptr
        self._slots, self._where = np.ascontiguousarray(slots, dtype=np.int64), None if device.type == "cpu" else device
        self._index: torch.Tensor | None = None  # the slots as a tensor, made where a write needs it
        keys, values = views[0][0], views[1][0]
        heads_axis = 0 if self._heads_first else 2
        self._heads, self._head_dim = int(keys.shape[heads_axis]), int(keys.shape[3])
        count = int(slots.shape[0])
        self._key_shape = (count, self._heads, self._head_dim)
        self._value_shape = (count, self._heads, int(values.shape[3]))
        self._span = one_run_span(page_table, qo_indptr)
        self._slot = int(slots[0]) if count == 1 else -1  # the slot of a step of one new token
        # None: not known yet (the first layer runs the dispatch); "views" or "pool" after it.
        self._mode: str | None = None
        self._kernel: KernelCall | None = None  # the kernel's call, prepared where the dispatch chose it
        # Per layer, the views of the one request's new slot (made at the first layer) and of
        # its run (once the step's path is "views").
        self._writes: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._runs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Per layer, the views of the one request's last tokens that ``write_and_view`` shows
        # (made at its first layer), with how many tokens they span.
        self._padded_runs: tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._inherited = memory.settled.get(page_table.group) if page_table.sliding_window is None else None
        # The settled path the step took (inherited or remembered) and its longest request then.
        self._settled: _Settled | None = None
        self._longest = 0
        # While the step's class is measured as the model runs it: the class and the path tried.
        self._tried: tuple[ShapeClass, str] | None = None
        self._through = path  # the path the storage's own attention takes (the native one where chosen)

    def __call__(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, scale: float
    ) -> torch.Tensor | None:
        if (
            not self._takes(keys, values)
            or not isinstance(query, torch.Tensor)
            or query.dtype is not self._dtype
            or query.get_device() != self._device
        ):
            return None
        query_shape = query.shape
        heads, count = self._heads, self._key_shape[0]
        if len(query_shape) != 3 or query_shape[0] != count or query_shape[2] != self._head_dim:
            return None
        if query_shape[1] % heads or query_shape[1] < heads:
            return None
        if torch.is_grad_enabled():  # the pool must never record autograd
            with torch.no_grad():
                return self(layer, keys, values, query, scale)
        self._write(layer, keys, values)
        if self._mode is None:  # the step's first layer: its path
            measured = self._settle(layer, query, scale)
            self._runs = self._run_views()
            if measured is not None:
                return measured
        tried = self._tried
        if tried is None:
            return self._attend(layer, query, scale)
        start = perf_counter()  # the class is measured as the model runs it: this layer's time
        output = self._attend(layer, query, scale)
        DISPATCH.record(tried[0], tried[1], perf_counter() - start)
        return output

    def write_and_view(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: int | None, layout: str
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Write a decode step's one new token of its one request, then show that request's last
        ``positions`` tokens (``None``: all) as views of the pool in ``layout`` (``"HND"``
        ``[1, H, positions, D]`` or ``"NHD"``), as ``Step.padded_view`` shows them
        (:class:`~kvcache_core.contract.lanes.ViewLane`): one ``copy_`` per pool into a view of
        the slot and the views of every layer made at the step's first layer. ``None``,
        nothing written, for any other step or arrays it was not prepared for."""
        span = self._span
        if span is None or span[0] + span[1] - 1 != self._slot or not self._takes(keys, values):
            return None  # (not one request's one new token ending its one run)
        first, tokens = span
        count = tokens if positions is None else positions
        if not 0 < count <= tokens or layout not in ("HND", "NHD"):
            return None
        if torch.is_grad_enabled():  # the pool must never record autograd
            with torch.no_grad():
                return self.write_and_view(layer, keys, values, positions, layout)
        if not self._write_compiled(layer, keys, values):
            self._write_slot(layer, keys, values)
        shown = self._padded_runs
        if shown is None or shown[0] != count:  # the step's first layer: every layer's views at once
            start = first + tokens - count
            views = list(zip(self._layer_views(0, start, count), self._layer_views(1, start, count), strict=True))
            shown = self._padded_runs = (count, views)
        key_run, value_run = shown[1][layer]
        return (key_run, value_run) if layout == "HND" else (key_run.transpose(1, 2), value_run.transpose(1, 2))

    def _takes(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``keys`` and ``values`` are the new tokens' arrays the lane was prepared for
        (anything else, a non-tensor included, goes to the general path, which names it)."""
        dtype, device = self._dtype, self._device
        return not (
            not isinstance(keys, torch.Tensor)
            or not isinstance(values, torch.Tensor)
            or keys.shape != self._key_shape
            or values.shape != self._value_shape
            or keys.dtype is not dtype
            or values.dtype is not dtype
            or keys.get_device() != device
            or values.get_device() != device
        )

    def _write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the layer's new K/V: in one compiled call (:meth:`_write_compiled`), else one
        ``copy_`` per pool into a view of the one new token's slot, else one indexed copy per pool."""
        if self._write_compiled(layer, keys, values):
            return
        if self._slot >= 0:  # one request's one new token: a view of its slot per layer and pool
            self._write_slot(layer, keys, values)
        else:
            index = self._index
            if index is None:
                index = tensor_of(np.array(self._slots, dtype=np.int64))
                index = self._index = index if self._where is None else index.to(self._where)
            if self._heads_first:
                self._rows[0][layer].index_copy_(1, index, keys.transpose(0, 1))
                self._rows[1][layer].index_copy_(1, index, values.transpose(0, 1))
            else:
                self._rows[0][layer].index_copy_(0, index, keys)
                self._rows[1][layer].index_copy_(0, index, values)

    def _write_compiled(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Write the new K/V in one compiled call for both pools (:class:`PoolWriter`, made once
        per layer); False, nothing written, where it does not run (another device, numba
        missing or switched off, arrays not C-contiguous)."""
        writers = self._memory.writers
        writer = writers[layer]
        if writer is None:
            made = None
            if self._where is None:  # a CPU pool
                layout = "heads_first" if self._heads_first else "NHD"
                made = PoolWriter.for_pools(*self._host_pools(layer), layout)
            writer = writers[layer] = made or False
        if writer is False or not keys.is_contiguous() or not values.is_contiguous():
            return False
        writer(keys.data_ptr(), values.data_ptr(), self._slots)
        return True

    def _write_slot(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a step of one new token through the views of its slot (made for every layer at
        the step's first write)."""
        writes = self._writes
        if writes is None:
            writes = self._writes = self._slot_views()
        key_slot, value_slot = writes[layer]
        key_slot.copy_(keys)
        value_slot.copy_(values)

    def _attend(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The layer's attention over the pool (its K/V written, the step's path settled)."""
        runs = self._runs
        if runs is not None:
            cached_keys, cached_values = runs[layer]
            heads = self._heads
            # [1, H, G, D]: query head h * G + g reads KV head h (4-D: torch's fused CPU kernel takes it)
            rows = query.reshape(1, heads, query.shape[1] // heads, self._head_dim)
            output: torch.Tensor = _SDPA(rows, cached_keys, cached_values, scale=scale)
            return output.view(1, query.shape[1], output.shape[-1])
        kernel = self._kernel
        if kernel is not None:
            source = query.detach() if query.requires_grad else query
            if source.dtype is torch.float32 and source.is_contiguous():  # no conversion: by address
                out = torch.empty(kernel.output_shape, dtype=torch.float32)
                if kernel.attend_at(source.data_ptr(), source.shape, out.data_ptr(), self._host_pools(layer), scale):
                    return out
            if source.dtype is not torch.float32:
                source = source.to(torch.float32)
            result = tensor_of(kernel(source.numpy(), *self._host_pools(layer), scale))
            return result if result.dtype is query.dtype else result.to(query.dtype)
        return self._through_pool(layer, query, scale)

    def advance(
        self, page_table: PageTable, slots: npt.NDArray[np.int64], qo_indptr: npt.NDArray[np.int32]
    ) -> TorchLane | None:
        """This lane, updated for the next decode step of the same requests, each one token
        more (:func:`~kvcache_core.contract.lanes.advance_lane`; the step it served is stale
        by then): its settled path kept, the kernel's call made for the new batch
        (:meth:`KernelCall.for_batch`) and, for one request in one run, its views one token
        longer. ``None`` (the storage prepares a lane) where the step's path was not settled
        (its class still measured, or never remembered), the group settled another since, the
        step leaves the settled class (the longest request past its context bucket, a request
        no longer in one run), or torch's threads changed. A lane that never attended (its
        steps only written and shown, :meth:`write_and_view`) has no path to keep: it is
        advanced for a batch of as many new tokens."""
        settled, span = self._settled, self._span
        slot = int(slots[0]) if slots.shape[0] == 1 else -1
        if self._mode is None:  # never attended: the group's settled path is looked up at its first attention
            if int(slots.shape[0]) != self._key_shape[0]:
                return None
            self._inherited = self._memory.settled.get(page_table.group) if page_table.sliding_window is None else None
        elif (
            settled is None
            or self._memory.settled.get(page_table.group) is not settled
            or self._longest + 1 > settled.context
            or int(slots.shape[0]) != self._key_shape[0]
            or torch.get_num_threads() != settled.threads
            or (self._mode == "views" and (span is None or span[0] + span[1] != slot))  # (no longer one run)
            or page_table.one_run_each != settled.one_run_each
        ):
            return None
        self._table, self._qo_indptr, self._index = page_table, qo_indptr, None
        self._slots = np.ascontiguousarray(slots, dtype=np.int64)
        self._longest += 1
        self._slot = slot
        self._span = None if span is None or span[0] + span[1] != slot else (span[0], span[1] + 1)
        self._kernel = None if self._kernel is None else self._kernel.for_batch(page_table, qo_indptr)
        self._writes = self._padded_runs = None  # made at its first layer
        self._runs = self._run_views()
        return self

    def _slot_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the views ``[1, H, D]`` of the one request's new slot in its key and value
        pools (written in place), made for every layer at once (:meth:`_layer_views`)."""
        return list(zip(self._layer_views(0, self._slot, None), self._layer_views(1, self._slot, None), strict=True))

    def _run_views(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Where the step is one request in one run read by torch's attention: per layer, the
        views ``[1, H, tokens, D]`` of its run in its key and value pools, made for every layer
        at once (:meth:`_layer_views`)."""
        span = self._span
        if self._mode != "views" or span is None or span[0] + span[1] - 1 != self._slot:
            return None  # (its one new token ends its run)
        first, tokens = span
        return list(zip(self._layer_views(0, first, tokens), self._layer_views(1, first, tokens), strict=True))

    def _layer_views(self, part: int, slot: int, tokens: int | None) -> Sequence[torch.Tensor]:
        """Per layer, :meth:`_pool_view` of its write view of ``part`` (0 keys, 1 values). Where
        the layers' views are evenly spaced in one storage (:meth:`LaneMemory.layer_step`), one
        view over every layer, unbound: a few torch operations per step instead of one per layer
        (inside a model each costs several times what it costs in a loop, its code pushed out of
        the CPU's caches by the layer's work)."""
        rows = self._rows[part]
        step = self._memory.layer_step(part, rows)
        if step is None:
            return [self._pool_view(layer_rows, slot, tokens) for layer_rows in rows]
        return self._pool_view(rows[0], slot, tokens, (len(rows), step)).unbind(0)

    def _pool_view(
        self, rows: torch.Tensor, slot: int, tokens: int | None, layers: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """``[1, H, D]`` of ``slot`` (``tokens`` None) or ``[1, H, tokens, D]`` from it, a view of
        the flat pool ``rows`` (``[H, slots, D]`` heads-first, ``[slots, H, D]`` NHD); with
        ``layers`` ``(count, step)``, led by an axis of ``count`` layers ``step`` elements apart."""
        strides, heads = rows.stride(), self._heads
        along, across = (strides[1], strides[0]) if self._heads_first else (strides[0], strides[1])
        lead = heads * across  # a leading axis of one, strided as indexing with None strides it
        offset = rows.storage_offset() + slot * along
        shape: tuple[int, ...]
        steps: tuple[int, ...]
        if tokens is None:
            shape, steps = (1, heads, rows.shape[2]), (lead, across, strides[2])
        else:
            shape, steps = (1, heads, tokens, rows.shape[2]), (lead, across, along, strides[2])
        if layers is not None:
            shape, steps = (layers[0], *shape), (layers[1], *steps)
        return rows.as_strided(shape, steps, offset)

    def _through_pool(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The storage's own attention of the layer (:func:`~kvcache_torch.attention.attend_pool`)."""
        layout = "heads_first" if self._heads_first else "NHD"
        key_cache, value_cache = self._views[0][layer], self._views[1][layer]
        return attend_pool(
            query, key_cache, value_cache, self._table, self._qo_indptr, scale, True, layout, path=self._through
        )

    def _settle(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Choose the step's path at its first layer: the dispatch's measured choice, read
        without attending (returns ``None``); where the step's shape class was never measured
        here, the layer attends through the storage's own attention, which measures it, and
        its output is returned."""
        key_cache, value_cache = self._views[0][layer], self._views[1][layer]
        table, indptr = self._table, self._qo_indptr
        threads = torch.get_num_threads()
        inherited = self._inherited
        longest = max(table.seq_lens.tolist(), default=0)
        if (
            inherited is not None
            and inherited.query == tuple(query.shape)
            and inherited.threads == threads
            and inherited.offsets == indptr.tobytes()
            and inherited.longest <= longest <= inherited.context
            and inherited.one_run_each == table.one_run_each
        ):
            self._settled, self._longest = inherited, longest
            self._mode = "views" if self._span is not None and inherited.chosen == "native" else "pool"
            self._through = "native" if inherited.chosen == "native" else self._path
            self._kernel = None if inherited.kernel is None else inherited.kernel.for_batch(table, indptr)
            return None
        layout = "heads_first" if self._heads_first else "NHD"
        trial = self._trial_class(query, key_cache, value_cache, layout)
        if trial is not None:  # a decode step, measured as the model runs it
            tried = DISPATCH.trial_path(trial, TRIAL_PATHS)
            self._mode = "views" if self._span is not None and tried == "native" else "pool"
            self._through = tried
            self._prepare_kernel(tried, layer, query, layout)
            if DISPATCH.choice(trial) is None:
                self._tried = (trial, tried)
            else:  # settled: later steps of its class take it over
                self._remember(tried, query, key_cache, value_cache, layout, threads)
            return None
        measured = None
        chosen = measured_plain_path(query, key_cache, value_cache, table, indptr, layout, self._path)
        if chosen is None:
            measured = self._through_pool(layer, query, scale)
            chosen = plain_path(query, key_cache, value_cache, table, indptr, True, self._path)
        self._mode = "views" if self._span is not None and chosen == "native" else "pool"
        self._prepare_kernel(chosen, layer, query, layout)
        if measured is None and table.sliding_window is None:  # a choice read: later steps of its class take it
            self._remember(chosen, query, key_cache, value_cache, layout, threads)
        return measured

    def _trial_class(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str
    ) -> ShapeClass | None:
        """The class of this step measured as the model runs it, where it is one: a decode step
        with queries, of a pool whose path is not pinned, without a window, that the kernel reads."""
        table = self._table
        if self._path != "auto" or table.sliding_window is not None or not query.shape[0]:
            return None
        if not kernel_reads(key_cache, value_cache):
            return None
        shape = shape_class(query, key_cache, value_cache, table, self._qo_indptr, layout, True, "")
        return dataclasses.replace(shape, measured="model") if shape.phase == "decode" else None

    def _remember(
        self,
        chosen: str | None,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        layout: str,
        threads: int,
    ) -> None:
        """Keep this decode step's path for the group's later steps of its class (see :class:`LaneMemory`)."""
        table, indptr = self._table, self._qo_indptr
        shape = shape_class(query, key_cache, value_cache, table, indptr, layout, True, "")
        if shape.phase == "decode":  # a prefill's class also depends on its lengths
            self._longest = max(table.seq_lens.tolist(), default=0)
            self._settled = self._memory.settled[table.group] = _Settled(
                indptr.tobytes(),
                shape.runs == "one",
                self._longest,
                shape.context,
                tuple(query.shape),
                threads,
                chosen,
                self._kernel,
            )

    def _prepare_kernel(self, chosen: str | None, layer: int, query: torch.Tensor, layout: str) -> None:
        """The kernel's call for the step, where the dispatch chose the kernel and it reads the pools."""
        key_cache, value_cache = self._views[0][layer], self._views[1][layer]
        table, indptr = self._table, self._qo_indptr
        if chosen == "kernel" and kernel_reads(key_cache, value_cache):
            self._kernel = prepare_kernel_call(
                tuple(query.shape),
                *self._host_pools(layer),
                table,
                indptr,
                dtype=KERNEL_DTYPES[key_cache.dtype],
                causal=True,
                kv_layout=layout,
                sliding_window=table.sliding_window,
                num_threads=torch.get_num_threads(),
                team=torch_team(),
            )

    def _host_pools(self, layer: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """The layer's pools as the host views the kernel reads (made once per pool)."""
        hosts = self._memory.hosts
        known = hosts[layer]
        if known is None:
            known = hosts[layer] = (host_view(self._views[0][layer]), host_view(self._views[1][layer]))
        return known

    @property
    def value_width(self) -> int:
        """Features per head of the values (of the attention's output)."""
        return self._value_shape[2]

    def __repr__(self) -> str:
        return f"TorchLane(tokens={self._key_shape[0]}, mode={self._mode!r}, one_run={self._span is not None})"
