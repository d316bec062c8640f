"""The kernel's share as a C function (numba ``cfunc``): what a team of threads runs without
Python and without the GIL.

A team that starts its threads from C (torch's OpenMP team, ``GOMP_parallel``) otherwise
runs each share through a Python callback, which must hold the GIL: inside a model, with the
CPU's caches cold, one thread waited for the other's Python and a wake-up, and an 8-request
decode layer's two-thread region spent 55-77 us before the calling thread's share began (AMD
EPYC, 2 cores). Here each thread enters :func:`~kvcache_core.attention._kernel_jit.attend_share`
straight from C.

The call's arguments travel in one C-contiguous ``int64`` block (:data:`BLOCK_SIZE` entries):
per array, its address and three extents (unused extents 1, :data:`ADDRESS_AT`); then the
ints (:data:`INTS_AT`); then the floats as the bits of ``float64`` (:data:`SCALE_AT`). Each array must
be C-contiguous (a pool's rows view its span of memory as rows) and must stay alive until the
call returns; :class:`CompiledLaunch` builds the block for a prepared
:class:`~kvcache_core.attention.kernel.KernelCall`, whose checks stand for it.
One entry per element type of the pools' bits (``uint16``: the float kinds; ``uint8``: the
quantized ones), compiled on first use and kept on disk (numba ``cache=True``).
"""

# pyright: reportUntypedFunctionDecorator=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownMemberType=false
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np
from numba import cfunc, njit, types
from numba.np.numpy_support import carray

from kvcache_core.attention._kernel_cache import register_locators
from kvcache_core.attention._kernel_ir import address_pointer as _pointer
from kvcache_core.attention._kernel_jit import attend_share

# Before any decorator: the cached functions' locators stamp every kernel source.
register_locators()

__all__ = [
    "ADDRESS_AT",
    "BLOCK_SIZE",
    "INTS_AT",
    "PER_CALL",
    "SCALE_AT",
    "CompiledLaunch",
    "entry_address",
    "fill_block",
]

#: Per array argument of :func:`attend_share` (by its position there), where the block holds
#: its address and three extents: query, key and value rows, key and value bits, strides,
#: block tables, lengths, query offsets, items, counter, output, partial sums and statistics,
#: sinks, key and value scales, scale strides. :func:`fill_block` and :func:`_run` use these.
ADDRESS_AT: Final = {
    0: 0, 1: 4, 2: 8, 3: 12, 4: 16, 6: 20, 7: 24, 8: 28, 9: 32, 10: 36, 11: 40,
    17: 44, 18: 48, 19: 52, 21: 56, 23: 60, 24: 64, 25: 68,
}  # fmt: skip
#: Then the ints (pool kind, group, block size, causal as 0 or 1, window, chunk; 0 unset),
#: then the floats as float64 bits (scale, softcap).
INTS_AT: Final = 4 * len(ADDRESS_AT)
SCALE_AT: Final = INTS_AT + 6
#: Entries in a block.
BLOCK_SIZE: Final = SCALE_AT + 2
#: The array arguments that are other objects from one layer's call to the next (query, the
#: pools' rows and bits, output, scales); the rest are the prepared call's own.
PER_CALL: Final = tuple((position, ADDRESS_AT[position]) for position in (0, 1, 2, 3, 4, 17, 23, 24, 25))


@njit(cache=True, nogil=True, inline="always")
def _shape2(block, at):  # type: ignore[no-untyped-def]
    return (block[at + 1], block[at + 2])


@njit(cache=True, nogil=True)
def _run(block, floats, key_raw, value_raw):  # type: ignore[no-untyped-def]
    """One share from a block (the raw pools already typed by the entry)."""
    query = carray(_pointer(block[0], np.float32), (block[1], block[2], block[3]))
    key_rows = carray(_pointer(block[4], np.float32), _shape2(block, 4))
    value_rows = carray(_pointer(block[8], np.float32), _shape2(block, 8))
    strides = carray(_pointer(block[20], np.int64), (block[21],))
    block_tables = carray(_pointer(block[24], np.int32), _shape2(block, 24))
    seq_lens = carray(_pointer(block[28], np.int32), (block[29],))
    qo_indptr = carray(_pointer(block[32], np.int32), (block[33],))
    items = carray(_pointer(block[36], np.int64), _shape2(block, 36))
    claimed = carray(_pointer(block[40], np.int64), (block[41],))
    out = carray(_pointer(block[44], np.float32), (block[45], block[46], block[47]))
    partial_acc = carray(_pointer(block[48], np.float32), _shape2(block, 48))
    partial_stats = carray(_pointer(block[52], np.float32), _shape2(block, 52))
    sinks = carray(_pointer(block[56], np.float32), (block[57],))
    key_scales = carray(_pointer(block[60], np.float32), (block[61],))
    value_scales = carray(_pointer(block[64], np.float32), (block[65],))
    scale_strides = carray(_pointer(block[68], np.int64), (block[69],))
    at = INTS_AT  # the ints, then the floats (SCALE_AT)
    attend_share(
        query,
        key_rows,
        value_rows,
        key_raw,
        value_raw,
        block[at],
        strides,
        block_tables,
        seq_lens,
        qo_indptr,
        items,
        claimed,
        block[at + 1],
        block[at + 2],
        floats[at + 6],
        block[at + 3] != 0,
        block[at + 4],
        out,
        partial_acc,
        partial_stats,
        floats[at + 7],
        sinks,
        block[at + 5],
        key_scales,
        value_scales,
        scale_strides,
    )


@njit(cache=True, nogil=True)
def _enter(data, bits):  # type: ignore[no-untyped-def]
    """One share from the block at ``data``, the pools' bits of element type ``bits``."""
    block = carray(_pointer(data, np.int64), (BLOCK_SIZE,))
    floats = carray(_pointer(data, np.float64), (BLOCK_SIZE,))
    key_raw = carray(_pointer(block[12], bits), _shape2(block, 12))
    value_raw = carray(_pointer(block[16], bits), _shape2(block, 16))
    _run(block, floats, key_raw, value_raw)


def _entry_uint16(data):  # type: ignore[no-untyped-def]
    _enter(data, np.uint16)


def _entry_uint8(data):  # type: ignore[no-untyped-def]
    _enter(data, np.uint8)


@njit(cache=True, inline="always")
def _put(block, at, array):  # type: ignore[no-untyped-def]
    """Write ``array``'s address and extents at ``at``; False where it is not C-contiguous."""
    block[at] = array.ctypes.data
    shape = array.shape
    for axis in range(3):
        block[at + 1 + axis] = shape[axis] if axis < len(shape) else 1
    return array.flags.c_contiguous


@njit(cache=True)
def fill_block(block, *arguments):  # type: ignore[no-untyped-def]
    """Write a share's ``arguments`` (those of :func:`attend_share`, in its order) into
    ``block`` (:data:`BLOCK_SIZE` int64, at :data:`ADDRESS_AT`, :data:`INTS_AT` and
    :data:`SCALE_AT`); its address, or 0 where an array is not C-contiguous (the entry cannot
    read it)."""
    whole = _put(block, 0, arguments[0]) & _put(block, 4, arguments[1]) & _put(block, 8, arguments[2])
    whole &= _put(block, 12, arguments[3]) & _put(block, 16, arguments[4]) & _put(block, 20, arguments[6])
    whole &= _put(block, 24, arguments[7]) & _put(block, 28, arguments[8]) & _put(block, 32, arguments[9])
    whole &= _put(block, 36, arguments[10]) & _put(block, 40, arguments[11]) & _put(block, 44, arguments[17])
    whole &= _put(block, 48, arguments[18]) & _put(block, 52, arguments[19]) & _put(block, 56, arguments[21])
    whole &= _put(block, 60, arguments[23]) & _put(block, 64, arguments[24]) & _put(block, 68, arguments[25])
    at = INTS_AT
    block[at], block[at + 1], block[at + 2] = arguments[5], arguments[12], arguments[13]
    block[at + 3], block[at + 4], block[at + 5] = 1 if arguments[15] else 0, arguments[16], arguments[22]
    floats = block.view(np.float64)
    floats[at + 6], floats[at + 7] = arguments[14], arguments[20]
    return block.ctypes.data if whole else 0


def _address(array: np.ndarray[Any, Any]) -> int:
    address: int = array.__array_interface__["data"][0]
    return address


class CompiledLaunch:
    """Prepared calls' shares through a team's C entry point (``run_entry(entry, data,
    threads)``). The block is filled whole (:func:`fill_block`) for a call whose arrays it
    does not hold (its first, or another prepared call's: the next decode step's call shares
    its launch), and otherwise each layer's call writes only what differs from the call
    before: the addresses of the arrays of :data:`PER_CALL` that are other objects (its query,
    pools, output), and the scale."""

    __slots__ = ("_at", "_block", "_entry", "_floats", "_last", "_owner", "_run")

    def __init__(
        self, run: Any, entry: int, block: np.ndarray[Any, Any], first: tuple[Any, ...], owner: object
    ) -> None:
        self._run, self._entry, self._block = run, entry, block
        self._last = list(first)  # the arrays whose addresses the block holds
        self._owner = owner  # the prepared call whose arrays those are (None: none, refill)
        self._floats = block.view(np.float64)
        self._at = _address(block)

    @staticmethod
    def make(run: Any, arguments: tuple[Any, ...], owner: object = None) -> CompiledLaunch | bool:
        """The launch of a call (``owner``) whose first share takes ``arguments``; False where
        no entry reads them (another element type of the pools' bits, an array not C-contiguous)."""
        raw = arguments[3].dtype
        entry = entry_address(raw.name)
        if entry is None or arguments[4].dtype != raw:
            return False
        block = np.zeros(BLOCK_SIZE, dtype=np.int64)
        if not fill_block(block, *arguments):
            return False
        return CompiledLaunch(run, entry, block, arguments, owner)

    def __call__(self, arguments: tuple[Any, ...], threads: int, owner: object = None) -> bool:
        """Run the shares of ``arguments`` for the prepared call ``owner`` (of the shapes of
        that call's first arguments: it checked them); False, nothing run, where the team
        cannot start its entry or an array of another call is not C-contiguous."""
        block, last = self._block, self._last
        if owner is not self._owner:  # another call's arrays: the whole block again
            self._owner = None  # (a refused fill leaves the block to be filled again)
            if not fill_block(block, *arguments):
                return False
            self._last, self._owner = list(arguments), owner
        else:
            for position, at in PER_CALL:
                array = arguments[position]
                if array is not last[position]:
                    block[at] = _address(array)
                    last[position] = array
            self._floats[SCALE_AT] = arguments[14]
        ran: bool = self._run(self._entry, _address(block), threads)
        return ran

    def at(self, owner: object, arrays: tuple[Any, ...], scale: float, threads: int) -> bool:
        """Run the shares of the prepared call ``owner`` whose block this launch holds, with
        ``arrays = (query address, output address, key rows, value rows, key bits, value bits)``
        (the addresses the caller's, of the shapes the block holds) and ``scale``; False,
        nothing run, where the block holds another call's arrays or the team cannot start it."""
        if owner is not self._owner:
            return False
        block, last = self._block, self._last
        block[0], block[ADDRESS_AT[17]] = arrays[0], arrays[1]
        last[0] = last[17] = None  # (an array call after this one writes its own again)
        for position in (1, 2, 3, 4):  # the pools, where another layer's
            array = arrays[position + 1]
            if array is not last[position]:
                block[ADDRESS_AT[position]] = _address(array)
                last[position] = array
        self._floats[SCALE_AT] = scale
        ran: bool = self._run(self._entry, self._at, threads)
        return ran


_ENTRIES: Final[dict[str, Callable[..., None]]] = {"uint16": _entry_uint16, "uint8": _entry_uint8}
_compiled: dict[str, Any] = {}


def entry_address(raw: str) -> int | None:
    """The address of the C entry ``void entry(int64 *block)`` for pools whose bits are
    ``raw`` (``"uint16"`` or ``"uint8"``), compiled on first use; ``None`` for another type.
    (Callers serialise first uses: :data:`kvcache_core.attention.kernel.LAUNCH_LOCK`.)"""
    function = _ENTRIES.get(raw)
    if function is None:
        return None
    compiled = _compiled.get(raw)
    if compiled is None:
        compiled = _compiled[raw] = cfunc(types.void(types.voidptr), cache=True)(function)
    address: Any = compiled.address  # an int once compiled (numba types it int | None)
    return int(address)
