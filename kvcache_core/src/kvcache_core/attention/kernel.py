"""The compiled CPU paged-attention kernel: one call per layer for a whole batch.

The NumPy and torch backends hand their pools here on CPU (zero-copy: a ``[rows,
head_dim]`` view of one layer's K or V and its strides in rows); the kernel itself, numba code, lives in
:mod:`kvcache_core.attention._kernel_jit` and this module is its typed face. It is used
only when numba imports and the environment variable ``KVCACHE_DISABLE_NUMBA`` is
unset (or ``0``); otherwise the backends run their Python/NumPy paths, which stay the
reference.

What a call does (FlashDecoding on a CPU):

* the rows of a ``(request, kv_head)`` pair -- its queries times the query heads of that
  KV head -- are attended together, so every key and value row is read once per group;
* the pairs, and chunks of ``ROW_SPLIT`` rows of long prefills, are the work items; when
  there are fewer than ``4 x threads`` of them, decode-like pairs of long contexts are
  split along their keys (at least ``MIN_SPLIT_KEYS`` each) and the splits are merged
  with a log-sum-exp;
* the threads claim the items longest first from one atomic counter: the calling thread
  and a small pool of worker threads, each in compiled code without the GIL (Python
  threads rather than numba's threading layer: a launch costs ~30 us on a busy machine
  where libgomp's default wait policy measured 30 ms, and nothing process-wide is
  configured). A worker the OS keeps waiting delays a call by one item at most, and a
  batch of less than ``MIN_THREAD_WORK`` runs on the calling thread alone. A framework
  with a thread pool of its own hands it over as the call's ``team``
  (:data:`ThreadTeam`): the torch backend runs the shares on torch's OpenMP threads,
  which after torch's own operators are awake and spinning on the cores a second set of
  threads would have to share. A team with ``run_entry(entry, data, threads)`` starts the
  shares as a C function instead (:mod:`._kernel_entry`): no thread runs Python;
* softmax is online, in float32, whatever the pool's dtype (float32, float16, bfloat16);
* the attention features of :mod:`kvcache_core.attention.features` (softcap, sinks,
  chunk; the window is the sliding window) are keyword arguments of
  :func:`attend_with_kernel`.

The plan of a batch (items, threads, splits) depends only on the page table, the query
offsets, the geometry and the thread count: it is computed once and reused by every layer
of the step (cached per :class:`PageTable`, which is immutable).

The first call on a machine compiles the kernel (measured 8 s on a busy 2-core machine,
once for float32, float16 and bfloat16 pools, once more for quantized ones; a team's C entry
about 10 s more for each) and caches it on disk (numba
``cache=True``, in ``__pycache__`` next to the module, or ``NUMBA_CACHE_DIR``); later
processes import numba and the module in 0.3 s and load the compiled code in 0.4 s.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvcache_core.attention._kernel_cache import sources_stamp
from kvcache_core.attention.features import check_chunk, check_finite_logits, check_softcap, check_window
from kvcache_core.attention.kernel_plan import MIN_SPLIT_KEYS, MIN_THREAD_WORK, ROW_SPLIT, Plan
from kvcache_core.attention.kernel_plan import cached_plan as _cached_plan
from kvcache_core.attention.teams import LAUNCH_LOCK, ThreadTeam, check_team_call, max_threads, python_team
from kvcache_core.contract.config import LAYOUT_AXES
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.scalars import check_count, check_positive_float32
from kvcache_core.errors import InvalidTypeError, ShapeMismatchError, UnsupportedConfigError

__all__ = [
    "DISABLE_ENV",
    "KERNEL_DTYPES",
    "LAUNCH_LOCK",
    "MIN_SPLIT_KEYS",
    "MIN_THREAD_WORK",
    "QUANTIZED_KERNEL_DTYPES",
    "ROW_SPLIT",
    "KernelCall",
    "ThreadTeam",
    "attend_with_kernel",
    "check_team_call",
    "kernel_available",
    "kernel_reads",
    "kernel_sources_stamp",
    "max_threads",
    "prepare_kernel_call",
    "python_team",
]

#: Set to anything but ``""`` or ``"0"`` to switch the kernel off (the backends then run
#: their reference paths); read at every call.
DISABLE_ENV: Final = "KVCACHE_DISABLE_NUMBA"

#: Pool dtypes the kernel reads (``bfloat16`` handed over as its ``uint16`` bits).
KERNEL_DTYPES: Final = ("float32", "float16", "bfloat16")
#: Quantized pool dtypes the kernel reads too, handed over as ``uint8`` bytes with their scales.
QUANTIZED_KERNEL_DTYPES: Final = ("int8", "float8_e4m3fn")

_POOL_KINDS: Final = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "float8_e4m3fn": 4}
_POOL_ELEMENTS: Final = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.uint16),
    "bfloat16": np.dtype(np.uint16),
    "int8": np.dtype(np.uint8),
    "float8_e4m3fn": np.dtype(np.uint8),
}
#: What the float kernels get for the scale arguments they never read (one compiled signature).
_NO_SCALES: Final = np.zeros(1, dtype=np.float32)
_NO_SCALES.flags.writeable = False
_NO_STRIDES: Final = np.zeros(3, dtype=np.int64)
_NO_STRIDES.flags.writeable = False
_NO_SINKS: Final = np.zeros(0, dtype=np.float32)
_NO_SINKS.flags.writeable = False
#: What the kernel gets for the pools it does not read: float32 rows beside a 16-bit pool's
#: bits, 16-bit bits beside a float32 pool.
_NO_ROWS: Final = np.zeros((1, 1), dtype=np.float32)
_NO_ROWS.flags.writeable = False
_NO_BITS: Final = np.zeros((1, 1), dtype=np.uint16)
_NO_BITS.flags.writeable = False


_HEADS_AXIS: Final = {"NHD": 2, "HND": 1, "heads_first": 0}

FloatArray = npt.NDArray[np.float32]
IndexArray = npt.NDArray[np.int64]

#: Most pairs of pools a prepared call (and those for later batches) keeps checked: a model's layers.
_MAX_POOLS: Final = 1024
_load_lock = threading.Lock()
_jit_module: ModuleType | None = None
_jit_missing = False


def _jit() -> ModuleType | None:
    """The compiled module, imported on first use (importing numba takes a while); ``None``
    when numba is not installed."""
    global _jit_module, _jit_missing
    if _jit_module is None and not _jit_missing:
        with _load_lock:
            if _jit_module is None and not _jit_missing:
                try:
                    _jit_module = importlib.import_module("kvcache_core.attention._kernel_jit")
                except ImportError:
                    _jit_missing = True
    return _jit_module


def kernel_available() -> bool:
    """Whether the compiled kernel runs here: numba imports and ``KVCACHE_DISABLE_NUMBA``
    does not switch it off."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    return _jit() is not None


def kernel_sources_stamp() -> str:
    """A stamp of the compiled kernel's sources (16 hex digits), which changes with any of
    them: a backend's dispatch keys its calibrations by it, so a changed kernel is measured
    again even where the library's version stayed the same (a source checkout)."""
    return sources_stamp()


def kernel_reads(dtype: str, key_cache: npt.NDArray[Any], value_cache: npt.NDArray[Any]) -> bool:
    """Whether the kernel can read these pools in place: a dtype of :data:`KERNEL_DTYPES` or
    :data:`QUANTIZED_KERNEL_DTYPES`, arrays of its element type (``uint16`` for 16-bit pools,
    ``uint8`` for quantized ones), the feature axis contiguous, the other strides whole
    multiples of a feature row (the kernel reads rows of ``head_dim``) and none negative; values
    may be rows of another width than keys, with the same strides counted in rows."""
    element = _POOL_ELEMENTS.get(dtype)
    if element is None:
        return False
    row_strides: list[list[int]] = []
    for cache in (key_cache, value_cache):
        if cache.dtype != element or cache.ndim != 4 or cache.size == 0:
            return False
        if cache.strides[3] != cache.itemsize or min(cache.strides) < 0:
            return False
        row_bytes = cache.shape[3] * cache.itemsize
        if any(
            stride % row_bytes for stride, extent in zip(cache.strides[:3], cache.shape[:3], strict=True) if extent > 1
        ):
            return False  # rows that do not start at whole multiples of head_dim
        row_strides.append(
            [
                stride // row_bytes if extent > 1 else 0
                for stride, extent in zip(cache.strides[:3], cache.shape[:3], strict=True)
            ]
        )
    # One pool row index serves a key row and its value row: the same strides, counted in rows.
    return key_cache.shape[:3] == value_cache.shape[:3] and row_strides[0] == row_strides[1]


def _pool_rows(cache: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A read-only ``[rows, head_dim]`` view from the array's first row to its last (no copy):
    one row per (block, token, head), the kernel's unit of reading."""
    if cache.flags.c_contiguous:
        rows: npt.NDArray[Any] = cache.reshape(-1, cache.shape[3])  # a view (and quicker than as_strided)
        rows.flags.writeable = False
        return rows
    row_bytes = cache.shape[3] * cache.itemsize
    last = sum((extent - 1) * stride for extent, stride in zip(cache.shape, cache.strides, strict=True))
    return np.lib.stride_tricks.as_strided(
        cache, shape=(last // row_bytes + 1, cache.shape[3]), strides=(row_bytes, cache.itemsize), writeable=False
    )


def _read_only(array: npt.NDArray[Any], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A C-contiguous read-only array of ``dtype`` (a view when it already is one): every
    call hands numba the same types, so the kernel compiles once."""
    if array.dtype == dtype and not array.flags.writeable and array.flags.c_contiguous:
        return array  # a page table's arrays, a plan's: read-only already
    view: npt.NDArray[Any] = np.ascontiguousarray(array, dtype=dtype).view()
    view.flags.writeable = False
    return view


@functools.lru_cache(maxsize=64)
def _row_strides(strides: tuple[int, ...], kv_layout: str, row_bytes: int) -> IndexArray:
    """Read-only int64 strides in rows of (block, token in block, head) of a pool with byte
    ``strides`` in ``kv_layout`` (the same few for every call of a run)."""
    rows = np.asarray([strides[axis] // row_bytes for axis in LAYOUT_AXES[kv_layout]], dtype=np.int64)
    rows.flags.writeable = False
    return rows


def attend_with_kernel(
    query: npt.NDArray[Any],
    key_cache: npt.NDArray[Any],
    value_cache: npt.NDArray[Any],
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    *,
    dtype: str,
    scale: float,
    causal: bool,
    kv_layout: str,
    sliding_window: int | None,
    num_threads: int | None = None,
    softcap: float | None = None,
    sinks: npt.NDArray[Any] | None = None,
    chunk: int | None = None,
    key_scales: npt.NDArray[np.float32] | None = None,
    value_scales: npt.NDArray[np.float32] | None = None,
    team: ThreadTeam | None = None,
) -> FloatArray:
    """Paged attention of a batch in one compiled call, reading the pools in place.

    Arguments are those of :func:`kvcache_core.paged_attention`, already validated (the
    page table names blocks of these pools, ``qo_indptr`` fits it); the scalars and sinks
    are checked again here (cheaply), so a bad one is refused by name rather than by numba.

    Args:
        query: ``[total_queries, num_query_heads, head_dim]``, any float dtype (read as float32).
        key_cache, value_cache: one layer's pool in ``kv_layout``, accepted by
            :func:`kernel_reads` for ``dtype`` (a bfloat16 pool as its ``uint16`` bits).
        page_table: the batch's pages.
        qo_indptr: ``[B + 1]`` int32 query offsets.
        dtype: the pool's dtype name, one of :data:`KERNEL_DTYPES` or :data:`QUANTIZED_KERNEL_DTYPES`.
        scale: score scale.
        causal: each request's queries are its last tokens and see keys up to their own.
        kv_layout: ``"NHD"``, ``"HND"`` or ``"heads_first"``.
        sliding_window: ``W`` (a query at ``p`` sees keys after ``p - W``) or ``None``.
        num_threads: threads to use, at most :func:`max_threads` (default: that many).
        softcap: scores become ``tanh(s / softcap) * softcap`` before the mask.
        sinks: ``[num_query_heads]`` logits joining each head's softmax denominator.
        chunk: a query at ``p`` sees only keys ``k`` with ``k // chunk == p // chunk``.
        key_scales, value_scales: for a quantized pool (``int8``, ``float8_e4m3fn``, its
            caches handed over as ``uint8``), the layer's scales ``[num_heads, num_blocks,
            block_size]`` float32, C-contiguous; each tile of keys is decoded with them.
        team: what runs a call's shares on its threads (default :func:`python_team`); a
            framework with a thread pool of its own hands its pool here (the torch backend
            hands torch's OpenMP team), so the kernel's threads are the ones that pool keeps
            awake rather than a second set competing with them for the cores.

    Returns:
        ``[total_queries, num_query_heads, value_dim]`` float32 (the value pool's last axis).

    Raises:
        UnsupportedConfigError: numba is not installed, or the pools are not readable in
            place (:func:`kernel_reads`).
        InvalidTypeError: ``team`` is neither ``None`` nor callable.
        InvalidArgumentError: ``scale``, ``softcap``, ``sliding_window``, ``chunk`` out of
            the ranges of :func:`kvcache_core.paged_attention`, or non-finite ``sinks``.
    """
    if team is not None and not callable(team):
        raise InvalidTypeError(f"team must be a ThreadTeam (a callable) or None, got {team!r}")
    checked_scale = check_positive_float32(scale, "scale")
    call = prepare_kernel_call(
        query.shape,
        key_cache,
        value_cache,
        page_table,
        qo_indptr,
        dtype=dtype,
        causal=causal,
        kv_layout=kv_layout,
        sliding_window=sliding_window,
        num_threads=num_threads,
        softcap=softcap,
        sinks=sinks,
        chunk=chunk,
        team=team,
    )
    return call(query, key_cache, value_cache, checked_scale, key_scales, value_scales)


def prepare_kernel_call(
    query_shape: tuple[int, ...],
    key_cache: npt.NDArray[Any],
    value_cache: npt.NDArray[Any],
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    *,
    dtype: str,
    causal: bool,
    kv_layout: str,
    sliding_window: int | None,
    num_threads: int | None = None,
    softcap: float | None = None,
    sinks: npt.NDArray[Any] | None = None,
    chunk: int | None = None,
    team: ThreadTeam | None = None,
) -> KernelCall:
    """The kernel's call for one batch, prepared once (its plan, the page table's arrays, the
    checked options) for every layer whose pools have the shapes, strides and dtype of
    ``key_cache`` and ``value_cache``: what :func:`attend_with_kernel` runs, for a caller that
    runs the same batch over many layers (a step's). Arguments as there; the call takes the
    query, the layer's pools, the scale and a quantized pool's scales.

    Raises:
        UnsupportedConfigError, InvalidArgumentError: as :func:`attend_with_kernel`.
    """
    window = check_window(sliding_window, "sliding_window") or 0  # 0: none
    chunk_size = check_chunk(chunk) or 0
    cap = check_softcap(softcap)
    if sinks is not None:
        check_finite_logits("sinks", np.asarray(sinks))
    module = _jit()
    if module is None:
        raise UnsupportedConfigError("the compiled paged-attention kernel needs numba: pip install numba")
    if not kernel_reads(dtype, key_cache, value_cache):
        raise UnsupportedConfigError(
            f"the kernel cannot read {dtype} pools of dtype {key_cache.dtype}, strides {key_cache.strides} in place"
        )
    total_queries, query_heads, head_dim = query_shape
    num_heads, limit = key_cache.shape[_HEADS_AXIS[kv_layout]], max_threads()
    group, threads = query_heads // num_heads, limit if num_threads is None else max(1, min(num_threads, limit))
    planning = (num_heads, group, bool(causal), window, threads, chunk_size)
    plan = _cached_plan(page_table, qo_indptr, *planning)
    strides = _row_strides(key_cache.strides, kv_layout, head_dim * key_cache.itemsize)
    # The attention features: softcap 0 and chunk 0 mean none, an empty sinks array no sinks.
    head_sinks = _NO_SINKS if sinks is None else _read_only(np.asarray(sinks), np.float32)
    features = (0.0 if cap is None else cap, head_sinks, chunk_size)
    shape = (total_queries, query_heads, int(value_cache.shape[3]))
    return KernelCall(
        module,
        plan,
        dtype,
        strides,
        _batch_tables(page_table, qo_indptr),
        shape,
        (group, page_table.block_size, bool(causal), window),
        features,
        team,
        _arrays_signature(query_shape, key_cache, value_cache),
        planning,
    )


def _batch_tables(page_table: PageTable, qo_indptr: npt.NDArray[np.int32]) -> tuple[npt.NDArray[np.int32], ...]:
    """The arrays of a batch the kernel reads: block tables, lengths, query offsets."""
    return tuple(_read_only(array, np.int32) for array in (page_table.block_tables, page_table.seq_lens, qo_indptr))


def _arrays_signature(
    query_shape: tuple[int, ...], key_cache: npt.NDArray[Any], value_cache: npt.NDArray[Any]
) -> tuple[object, ...]:
    """What a :class:`KernelCall` was prepared for: the query's shape, the pools' shapes, strides and dtypes."""
    pools = (key_cache.shape, key_cache.strides, key_cache.dtype, value_cache.shape, value_cache.strides)
    return (tuple(query_shape), *pools, value_cache.dtype)


class KernelCall:
    """A prepared call of the kernel (:func:`prepare_kernel_call`): ``call(query, key_cache,
    value_cache, scale, key_scales=None, value_scales=None)`` attends one layer's pools
    (checked scale; a quantized pool's scales) and returns ``[total_queries, query_heads,
    value_dim]`` float32."""

    __slots__ = (
        "_buffers",
        "_claimed",
        "_compiled",
        "_dtype",
        "_features",
        "_fixed",
        "_module",
        "_options",
        "_plan",
        "_planning",
        "_pools",
        "_quantized",
        "_shape",
        "_signature",
        "_strides",
        "_tables",
        "_team",
    )

    def __init__(
        self,
        module: ModuleType,
        plan: Plan,
        dtype: str,
        strides: IndexArray,
        tables: tuple[npt.NDArray[np.int32], ...],
        shape: tuple[int, int, int],
        options: tuple[int, int, bool, int],
        features: tuple[Any, ...],
        team: ThreadTeam | None,
        signature: tuple[object, ...],
        planning: tuple[int, int, bool, int, int, int],
        carried: KernelCall | None = None,
    ) -> None:
        self._signature, self._planning = signature, planning
        self._module, self._plan, self._dtype, self._strides, self._tables = module, plan, dtype, strides, tables
        self._shape, self._options, self._features, self._team = shape, options, features, team
        # The split rows' partial results and the threads' counter of claimed items: used
        # within one launch (under the launch lock), so reused, and shared with the calls for
        # later batches (``carried``: the call this one is made from), as the C entry's launch
        # (in a box the calls share; None: not tried yet; False: none), which refills its
        # block for each call's arrays.
        rows = plan.partial_rows
        self._buffers: tuple[FloatArray, FloatArray]
        if carried is not None and carried._plan.partial_rows == rows:
            self._buffers = carried._buffers
        else:
            self._buffers = (np.empty((rows, shape[2]), dtype=np.float32), np.empty((rows, 2), dtype=np.float32))
        self._claimed: IndexArray = np.zeros(1, dtype=np.int64) if carried is None else carried._claimed
        self._compiled: list[Any] = [None] if carried is None else carried._compiled
        # Per pair of pools a layer's call read (by the key pool's id), the arrays the kernel reads.
        self._pools: dict[int, tuple[npt.NDArray[Any], npt.NDArray[Any], tuple[npt.NDArray[Any], ...]]]
        self._pools = {} if carried is None else carried._pools
        self._quantized = dtype in QUANTIZED_KERNEL_DTYPES
        self._fixed = (_POOL_KINDS[dtype], strides, *tables)  # the share's arguments after the pools

    def for_batch(self, page_table: PageTable, qo_indptr: npt.NDArray[np.int32]) -> KernelCall:
        """This call for another batch of as many queries over the same pools, options and
        attention features (the next decode step of the same requests): only its plan and the
        batch's arrays are made again (its buffers and C launch are shared, the launch's block
        refilled at the new call's first layer), none of the checks of :func:`prepare_kernel_call`. As
        there, the batch comes validated (its page table names blocks of these pools, its
        ``qo_indptr`` fits it): the manager's step plans it.

        Raises:
            ShapeMismatchError: a batch of another number of queries or another block size.
        """
        block_size = self._options[1]
        queries = int(qo_indptr[-1]) if qo_indptr.shape[0] else 0
        if queries != self._shape[0] or page_table.block_size != block_size:
            raise ShapeMismatchError(
                f"a KernelCall for {self._shape[0]} queries in blocks of {block_size} got a batch of {queries} "
                f"queries in blocks of {page_table.block_size}"
            )
        plan = _cached_plan(page_table, qo_indptr, *self._planning)
        tables = _batch_tables(page_table, qo_indptr)
        return KernelCall(
            self._module,
            plan,
            self._dtype,
            self._strides,
            tables,
            self._shape,
            self._options,
            self._features,
            self._team,
            self._signature,
            self._planning,
            self,
        )

    def _launch(self, arguments: tuple[Any, ...], threads: int) -> bool:
        """Run a share of ``arguments`` (:func:`attend_share`'s) on a team that starts C entries
        (``team.run_entry``, as torch's OpenMP team), every thread in compiled code and none
        through Python (:mod:`._kernel_entry`); False, nothing run, where it cannot."""
        box = self._compiled
        launch = box[0]
        if launch is None:  # the first call: is there a C entry for this team and these arrays?
            run_entry: Callable[[int, int, int], bool] | None = getattr(self._team, "run_entry", None)
            try:
                entries = None if run_entry is None else importlib.import_module("kvcache_core.attention._kernel_entry")
            except ImportError:  # a numba without what the entry needs: the callable share runs
                entries = None
            launch = False if entries is None else entries.CompiledLaunch.make(run_entry, arguments, self)
            box[0] = launch
        return launch is not False and launch(arguments, threads, self)

    def _checked_pools(
        self, query: npt.NDArray[Any], key_cache: npt.NDArray[Any], value_cache: npt.NDArray[Any]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any], tuple[npt.NDArray[Any], ...]]:
        """The pools' arrays the kernel reads, checked against what the call was prepared for
        (once per pair of pools: kept, with the calls for later batches)."""
        if _arrays_signature(query.shape, key_cache, value_cache) != self._signature:  # the kernel would misread
            raise ShapeMismatchError(
                f"a KernelCall prepared for a query {self._signature[0]} and pools {self._signature[1]} (strides "
                f"{self._signature[2]}) got {query.shape} and {key_cache.shape} (strides {key_cache.strides})"
            )
        # float32 pools are read in place as float32 rows, the others as their bits; the pair not
        # used is a stand-in, so one compiled version serves every float pool (one every quantized).
        if self._dtype == "float32":
            pools = (_pool_rows(key_cache), _pool_rows(value_cache), _NO_BITS, _NO_BITS)
        else:
            pools = (_NO_ROWS, _NO_ROWS, _pool_rows(key_cache), _pool_rows(value_cache))
        if len(self._pools) >= _MAX_POOLS:  # pools of a released storage: forget them
            self._pools.clear()
        known = self._pools[id(key_cache)] = (key_cache, value_cache, pools)
        return known

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """``[total_queries, query_heads, value_dim]``: the shape of what a call returns."""
        return self._shape

    def attend_at(
        self,
        query: int,
        query_shape: tuple[int, ...],
        out: int,
        pools: tuple[npt.NDArray[Any], npt.NDArray[Any]],
        scale: float,
    ) -> bool:
        """A call over unquantized ``pools = (key_cache, value_cache)`` (a checked ``scale``), the
        query and output addresses (ints >= 1, else InvalidArgumentError) of C-contiguous float32
        arrays of ``query_shape`` and :attr:`output_shape` the caller vouches for, through the C launch
        an array call of this batch set up; False, nothing run, where none did, one thread or quantized pools."""
        check_count(query, "a query's address", 1)
        check_count(out, "an output's address", 1)
        launch, plan = self._compiled[0], self._plan
        if not launch or self._quantized or plan.threads == 1 or not self._shape[0]:
            return False
        known = self._pools.get(id(pools[0]))
        if known is None or known[0] is not pools[0] or known[1] is not pools[1] or query_shape != self._signature[0]:
            return False
        with LAUNCH_LOCK:
            self._claimed[0] = 0
            ran: bool = launch.at(self, (query, out, *known[2]), scale, plan.threads)
            if ran and plan.merges.shape[0]:  # split keys: merged into the output where it is
                merge: Callable[..., None] = self._module.merge_splits_at
                merge(
                    self._tables[2], plan.merges, self._options[0], out, self._shape, *self._buffers, self._features[1]
                )
        return ran

    def __call__(
        self,
        query: npt.NDArray[Any],
        key_cache: npt.NDArray[Any],
        value_cache: npt.NDArray[Any],
        scale: float,
        key_scales: npt.NDArray[np.float32] | None = None,
        value_scales: npt.NDArray[np.float32] | None = None,
    ) -> FloatArray:
        known = self._pools.get(id(key_cache))
        if (
            known is None
            or known[0] is not key_cache
            or known[1] is not value_cache
            or query.shape != self._signature[0]
        ):
            known = self._checked_pools(query, key_cache, value_cache)
        out: FloatArray = np.empty(self._shape, dtype=np.float32)
        if self._shape[0] == 0:
            return out
        plan, quantized = self._plan, self._quantized
        if quantized and (key_scales is None or value_scales is None):
            raise UnsupportedConfigError(f"a {self._dtype} pool is read with its key_scales and value_scales")
        arguments = (_read_only(query, np.float32), *known[2], *self._fixed)
        (group, block_size, causal, window), (partial_acc, partial_stats) = self._options, self._buffers
        options = (group, block_size, scale, causal, window, out, partial_acc, partial_stats)
        # A quantized pool's scales (flat, with element strides block, token, head); empty otherwise.
        if quantized and key_scales is not None and value_scales is not None:
            scale_options = (
                _read_only(key_scales, np.float32).reshape(-1),
                _read_only(value_scales, np.float32).reshape(-1),
                _read_only(np.asarray([key_scales.shape[2], 1, key_scales.shape[1] * key_scales.shape[2]]), np.int64),
            )
        else:
            scale_options = (_NO_SCALES, _NO_SCALES, _NO_STRIDES)
        # The threads claim items from one counter (set to 0 under the lock): a worker the OS
        # leaves waiting (a busy machine) delays the call by the item it holds at most, not by
        # a share of its own.
        share = (*arguments, plan.items, self._claimed, *options, *self._features, *scale_options)
        attend: Callable[..., None] = self._module.attend_share
        with LAUNCH_LOCK:
            self._claimed[0] = 0
            if plan.threads == 1:
                attend(*share)
            elif not self._launch(share, plan.threads):
                (self._team or python_team)(functools.partial(attend, *share), plan.threads)
            if plan.merges.shape[0]:
                merge: Callable[..., None] = self._module.merge_splits
                merge(arguments[9], plan.merges, group, out, partial_acc, partial_stats, self._features[1])
        return out
