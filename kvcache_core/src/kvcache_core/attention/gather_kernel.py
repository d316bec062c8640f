"""The compiled padded gather: one layer's K or V of a step's batch copied into a padded
``[batch, heads, positions, dim]`` array, run by run.

The contiguous path (attention computed by the model on padded K/V, as transformers' ``sdpa``
does) reads a step's K/V as a padded batch at every layer (``Step.gather_padded``). An
indexed read copies it slot by slot: a call per row or per head of a row, each slot's
``dim`` elements at a time. But the allocator hands a request consecutive blocks wherever it
can (a prompt's blocks are one run; decode adds a block at a time), so a row is a few runs of
consecutive slots, each one plain copy of ``length x dim`` elements per head.
:class:`SlotRuns` finds the runs of a step's slot array once, in NumPy (every layer of the
step reuses them); :func:`gather_runs` copies one pool's runs in compiled code
(:mod:`kvcache_core.attention._gather_jit`), on the threads of a
:data:`~kvcache_core.attention.kernel.ThreadTeam` as the attention kernel runs.

Measured on machine C (AMD EPYC, 2 threads), 8 rows of 466-2,113 positions (a prompt's run,
then single blocks of decode), 2 heads of 64 float32, the pool out of cache: this gather 1.0
ms, and ``torch.cat`` of as many contiguous bytes (what ``DynamicCache`` does per layer and
step) 0.96 ms; at 8 heads of 128, 7.1 and 7.9 ms. An ``index_select`` per head of a row took
1.6 and 9.9 ms with the pool in cache. Inside transformers' ``generate`` of 8 ragged prompts it took 1.0-1.1
ms a pool and layer.

:func:`gather_runs_together` copies a layer's keys and values in one call: one start of the
team and one pass of the wrapper's Python for both. Inside that ``generate`` (machine D: AMD
EPYC, Zen 5, 2 cores, L3 32 MiB; 2 KV heads of 64, 8 rows of 256-2,048 tokens), a decode
layer's padded read took 1.06-1.11 ms that way against 1.08-1.32 ms as two calls.
On a team with a C entry point (``run_entry``: torch's OpenMP team), one or two pairs are
copied through the compiled entry (:func:`~kvcache_core.attention._gather_jit.entry_address`),
no thread running Python; elsewhere, and where the team declines, through Python shares.

Like the attention kernel, it runs only where numba imports and ``KVCACHE_DISABLE_NUMBA`` does
not switch it off: :func:`gather_runs` returns ``False`` otherwise and the caller reads as
before.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvcache_core.attention.kernel import LAUNCH_LOCK, ThreadTeam, kernel_available, max_threads, python_team
from kvcache_core.contract.scalars import check_count
from kvcache_core.errors import InvalidArgumentError, InvalidTypeError, ShapeMismatchError

__all__ = ["MIN_THREAD_BYTES", "SlotRuns", "gather_runs", "gather_runs_together"]

#: A gather of fewer bytes runs on the calling thread alone (waking a team costs more).
MIN_THREAD_BYTES: Final = 1 << 20
#: The unsigned type each element size is copied as (its bits).
_BITS: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

IndexArray = npt.NDArray[np.int64]

_load_lock = threading.Lock()
_jit_module: list[ModuleType] = []


def _jit() -> ModuleType:
    """The compiled module, imported on first use (after :func:`kernel_available`)."""
    if not _jit_module:
        with _load_lock:
            if not _jit_module:
                _jit_module.append(importlib.import_module("kvcache_core.attention._gather_jit"))
    return _jit_module[0]


class SlotRuns:
    """The runs of consecutive slots in a padded slot array ``[batch, positions]`` int64,
    whose ``-1`` entries (padding) open each row, as ``Step``'s padded gather hands them over.
    Immutable (its arrays read-only): :func:`gather_runs` trusts what it holds.

    Raises:
        InvalidTypeError: ``slots`` is not a 2-D int64 array.
        InvalidArgumentError: a slot below ``-1``, or a padding entry after a stored one in a row.
    """

    __slots__ = ("_batch", "_leads", "_orders", "_positions", "_run_first", "_runs", "_slots_needed")

    def __init__(self, slots: npt.NDArray[np.int64]) -> None:
        if not isinstance(slots, np.ndarray) or slots.ndim != 2 or slots.dtype != np.int64:
            raise InvalidTypeError(f"slots must be a 2-D int64 array, got {_describe(slots)}")
        batch, positions = (int(size) for size in slots.shape)
        if slots.size and int(slots.min()) < -1:
            raise InvalidArgumentError(f"slots are -1 (padding) or >= 0, got {int(slots.min())}")
        stored = slots >= 0
        if positions > 1 and bool((stored[:, :-1] & ~stored[:, 1:]).any()):
            raise InvalidArgumentError("padding (-1) opens each row of slots; a row has padding after a stored slot")
        # A run starts where a stored slot does not follow its left neighbour's by one.
        starts = stored.copy()
        if positions > 1:
            starts[:, 1:] &= ~(stored[:, :-1] & (slots[:, 1:] == slots[:, :-1] + 1))
        rows, firsts = np.nonzero(starts)  # row-major: each row's runs in order
        ends = np.full(rows.shape, positions, dtype=np.int64)
        same_row = rows[1:] == rows[:-1]
        ends[:-1][same_row] = firsts[1:][same_row]
        lengths = ends - firsts
        sources = slots[rows, firsts]
        self._batch, self._positions = batch, positions
        self._leads = _frozen(positions - stored.sum(axis=1))
        self._runs = _frozen(np.stack([firsts.astype(np.int64), sources, lengths], axis=1).reshape(-1, 3))
        self._run_first = _frozen(np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=batch)))))
        self._slots_needed = int((sources + lengths).max()) if lengths.size else 0
        self._orders: dict[int, IndexArray] = {}

    @property
    def batch(self) -> int:
        """The slot array's rows."""
        return self._batch

    @property
    def positions(self) -> int:
        """The slot array's positions per row."""
        return self._positions

    @property
    def leads(self) -> IndexArray:
        """``[batch]`` the padding positions opening each row."""
        return self._leads

    @property
    def runs(self) -> IndexArray:
        """``[n, 3]`` ``(first position, first slot, length)`` of every run, row by row."""
        return self._runs

    @property
    def run_first(self) -> IndexArray:
        """``[batch + 1]``: row ``r``'s runs are ``runs[run_first[r]:run_first[r + 1]]``."""
        return self._run_first

    @property
    def slots_needed(self) -> int:
        """One past the highest slot named (0 when none is): a pool of fewer slots cannot be read."""
        return self._slots_needed

    def extended(self, slots: npt.NDArray[np.int64]) -> SlotRuns | None:
        """The runs of ``slots`` where it is this array with one more position per row, each a
        stored slot (a decode step's array after the last step's): each row's last run one
        longer where the new slot follows it, else a run of one more; the leads the same. Found
        in a few array operations per row instead of a pass over every position. ``None`` where
        ``slots`` is not so (then ``SlotRuns(slots)`` finds them); this array's runs are unchanged.
        The caller checks that the first positions are this array's."""
        if (
            not isinstance(slots, np.ndarray)
            or slots.dtype != np.int64
            or slots.shape != (self._batch, self._positions + 1)
        ):
            return None
        column = slots[:, -1]
        if column.size and int(column.min()) < 0:
            return None
        runs, starts, ends = self._runs, self._run_first[:-1], self._run_first[1:]
        last = np.maximum(ends - 1, 0)
        stored = ends > starts  # the row has a run: it ends at the last position (padding only opens rows)
        if runs.shape[0]:
            follows = stored & (runs[last, 1] + runs[last, 2] == column)
        else:
            follows = np.zeros(self._batch, dtype=np.bool_)
        extended = object.__new__(SlotRuns)
        extended._batch, extended._positions = self._batch, self._positions + 1
        extended._leads = self._leads
        extended._slots_needed = max(self._slots_needed, int(column.max()) + 1 if column.size else 0)
        extended._orders = self._orders  # the same leads: the same orders
        grown = runs.copy()
        grown[last[follows], 2] += 1
        if bool(follows.all()):  # every new slot extends its row's last run (a decode step, mostly)
            grown.flags.writeable = False
            extended._runs, extended._run_first = grown, self._run_first
            return extended
        opened = ~follows
        new = np.stack([np.full(int(opened.sum()), self._positions, dtype=np.int64), column[opened]], axis=1)
        grown = np.insert(
            grown, ends[opened], np.concatenate([new, np.ones((new.shape[0], 1), np.int64)], axis=1), axis=0
        )
        extended._runs = _frozen(grown)
        extended._run_first = _frozen(np.concatenate(([0], np.cumsum(np.diff(self._run_first) + opened))))
        return extended

    def order(self, heads: int) -> IndexArray:
        """The work items ``row * heads + head``, the rows with most stored positions first
        (the threads claim them in this order, so the longest start first).

        Raises:
            InvalidArgumentError: ``heads`` is not an int >= 1.
        """
        known = self._orders.get(heads)
        if known is None:
            check_count(heads, "heads", 1)
            rows = np.argsort(self._leads, kind="stable")  # fewest padding positions: most stored
            known = _frozen((rows[:, None] * heads + np.arange(heads, dtype=np.int64)).reshape(-1))
            self._orders[heads] = known
        return known


def _frozen(array: npt.NDArray[Any]) -> IndexArray:
    """``array`` as a read-only int64 array of its own."""
    frozen = np.array(array, dtype=np.int64)
    frozen.flags.writeable = False
    return frozen


def gather_runs(pool: npt.NDArray[Any], out: npt.NDArray[Any], runs: SlotRuns, team: ThreadTeam | None = None) -> bool:
    """Copy ``pool [heads, slots, dim]`` (one layer's K or V) at ``runs`` into ``out [batch,
    heads, positions, dim]``, zeros at each row's padding; any element type (copied as its
    bits). ``False``, ``out`` untouched, where the compiled code does not run: numba missing or
    switched off, or arrays it does not copy in rows (``out`` not C-contiguous, or a head's
    slots in the pool not contiguous ``dim``-element rows); the caller then reads another way.

    Raises:
        InvalidTypeError: ``pool`` or ``out`` is not an array, or their element sizes differ.
        ShapeMismatchError: the shapes do not fit each other or ``runs`` (a slot past the pool's).
    """
    return gather_runs_together(((pool, out),), runs, team)


def gather_runs_together(
    pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]], runs: SlotRuns, team: ThreadTeam | None = None
) -> bool:
    """:func:`gather_runs` for several ``(pool, out)`` pairs at the same ``runs`` (one layer's
    keys and values) in one call: their work items share one start of the team, the longest
    rows of every pool first. Every pool has the same heads and element size (the widths may
    differ). ``False``, every ``out`` untouched, where the compiled code does not run for one
    of them.

    Raises:
        InvalidArgumentError: no pairs.
        InvalidTypeError: ``pairs`` is not a list or tuple of ``(pool, out)`` pairs, a pool or
            out is not an array, or the element sizes differ.
        ShapeMismatchError: the shapes do not fit each other or ``runs`` (a slot past a
            pool's), or the pools' heads differ.
    """
    if not isinstance(pairs, (list, tuple)) or not all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in pairs
    ):
        raise InvalidTypeError(f"pairs must be a list or tuple of (pool, out) pairs, got {pairs!r:.200}")
    if not pairs:
        raise InvalidArgumentError("gather_runs_together needs at least one (pool, out) pair, got none")
    checked = [_checked(pool, out, runs) for pool, out in pairs]
    sizes = {pool.itemsize for pool, _ in pairs}
    heads = {int(pool.shape[0]) for pool, _ in pairs}
    if len(sizes) > 1:
        raise InvalidTypeError(f"the pools' elements must be of one size, got {sorted(sizes)} bytes")
    if len(heads) > 1:
        raise ShapeMismatchError(f"the pools gathered together must have one number of heads, got {sorted(heads)}")
    if not (all(checked) and kernel_available()):
        return False
    if all(out.size == 0 for _, out in pairs):
        return True
    bits = _BITS[sizes.pop()]
    pools = tuple(_flat(pool, bits) for pool, _ in pairs)
    outs = tuple(out.reshape(-1).view(bits) for _, out in pairs)
    head_strides = np.array([pool.strides[0] // pool.itemsize for pool, _ in pairs], dtype=np.int64)
    dims = np.array([pool.shape[2] for pool, _ in pairs], dtype=np.int64)
    order = runs.order(heads.pop())
    arguments = (pools, head_strides, dims, outs, int(pairs[0][0].shape[0]), runs.positions)
    tables = (runs.leads, runs.run_first, runs.runs, order)
    claimed = np.zeros(1, dtype=np.int64)
    gather: Callable[..., None] = _jit().gather_share

    def share() -> None:
        gather(*arguments, *tables, claimed)

    nbytes = sum(out.nbytes for _, out in pairs)
    threads = min(max_threads(), int(order.shape[0]) * len(pairs)) if nbytes >= MIN_THREAD_BYTES else 1
    with LAUNCH_LOCK:
        if threads == 1:
            share()
        elif not _run_entry(team, pairs, runs, order, threads):
            (team or python_team)(share, threads)
    return True


def _run_entry(
    team: ThreadTeam | None,
    pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
    runs: SlotRuns,
    order: IndexArray,
    threads: int,
) -> bool:
    """Run the gather of checked ``pairs`` through ``team``'s C entry point (``run_entry``,
    as torch's OpenMP team has: no thread runs Python or waits for the GIL); False, nothing
    copied, where the team has none, cannot start it, or there are more pairs than its block holds."""
    run_entry: Callable[[int, int, int], bool] | None = getattr(team, "run_entry", None)
    jit = _jit()
    if run_entry is None or len(pairs) > jit.ENTRY_PAIRS:
        return False
    block = np.zeros(jit.ENTRY_BLOCK, dtype=np.int64)
    claimed = np.zeros(1, dtype=np.int64)
    arrays = (runs.leads, runs.run_first, runs.runs, order, claimed)
    block[:6] = (len(pairs), pairs[0][0].shape[0], runs.positions, runs.batch, runs.runs.shape[0], order.shape[0])
    block[6:11] = [_address(array) for array in arrays]
    for index, (pool, out) in enumerate(pairs):
        size = pool.itemsize
        block[11 + index] = pool.strides[0]  # bytes (a whole number of elements: checked)
        block[11 + jit.ENTRY_PAIRS + index] = pool.shape[2] * size
        span = (pool.shape[0] - 1) * pool.strides[0] + pool.shape[1] * pool.shape[2] * size
        at = jit.PAIR_AT + 4 * index
        block[at : at + 4] = (_address(pool), span, _address(out), out.nbytes)
    return bool(run_entry(jit.entry_address(), _address(block), threads))


def _address(array: npt.NDArray[Any]) -> int:
    address: int = array.__array_interface__["data"][0]
    return address


def _checked(pool: npt.NDArray[Any], out: npt.NDArray[Any], runs: SlotRuns) -> bool:
    """Whether the compiled copy reads ``pool`` into ``out`` (rows of ``dim`` elements, ``out``
    C-contiguous).

    Raises:
        InvalidTypeError, ShapeMismatchError: as :func:`gather_runs`.
    """
    if not isinstance(pool, np.ndarray) or not isinstance(out, np.ndarray):
        raise InvalidTypeError(f"the pool and out must be arrays, got {_describe(pool)} and {_describe(out)}")
    size = pool.itemsize
    if size != out.itemsize or size not in _BITS:
        raise InvalidTypeError(
            f"the pool's and out's elements must be of one size (1-8 bytes), got {pool.dtype} and {out.dtype}"
        )
    if pool.ndim != 3 or out.shape != (runs.batch, pool.shape[0], runs.positions, pool.shape[2]):
        raise ShapeMismatchError(
            f"a pool [heads, slots, dim] {pool.shape} gathers into out [batch {runs.batch}, heads, positions "
            f"{runs.positions}, dim], got out {out.shape}"
        )
    if runs.slots_needed > pool.shape[1]:
        raise ShapeMismatchError(f"the runs read slots up to {runs.slots_needed - 1}; the pool has {pool.shape[1]}")
    dim = int(pool.shape[2])
    head_stride, slot_stride, dim_stride = pool.strides
    in_rows = slot_stride == dim * size and dim_stride == size and head_stride >= 0 and head_stride % size == 0
    return in_rows and bool(out.flags.c_contiguous)


def _flat(pool: npt.NDArray[Any], bits: type[np.generic]) -> npt.NDArray[Any]:
    """The pool's elements from its first to its last as one 1-D array of ``bits`` (a view)."""
    heads, slots, dim = (int(extent) for extent in pool.shape)
    size = pool.itemsize
    span = (heads - 1) * (pool.strides[0] // size) + slots * dim
    return np.lib.stride_tricks.as_strided(pool, shape=(span,), strides=(size,), writeable=False).view(bits)


def _describe(value: object) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    return f"an array of shape {shape} and dtype {dtype}" if isinstance(shape, tuple) else repr(type(value))
