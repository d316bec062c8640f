"""The kernel's share as a C function (numba ``cfunc``): what a team of threads runs without
Python and without the GIL.

A team that starts its threads from C (torch's OpenMP team, ``GOMP_parallel``) otherwise
runs each share through a Python callback, which must hold the GIL: inside a model, with the
CPU's caches cold, one thread waited for the other's Python and a wake-up, and an 8-request
decode layer's two-thread region spent 55-77 us before the calling thread's share began (AMD
EPYC, 2 cores). Here each thread enters :func:`~kvcache_core.attention._kernel_jit.attend_share`
straight from C.

The call's arguments travel in one C-contiguous ``int64`` block (:data:`BLOCK_SIZE` entries):
per array of :data:`ARRAYS`, its address and three extents (unused extents 1); then the ints
of :data:`INTS`; then the floats of :data:`FLOATS` as the bits of ``float64``. Each array must
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
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from kvcache_core.attention._kernel_jit import attend_share

__all__ = ["ARRAYS", "BLOCK_SIZE", "FLOATS", "INTS", "CompiledLaunch", "entry_address", "fill_block"]

#: The arrays of a share, in the order of the block, with their element types and dimensions.
ARRAYS: Final = (
    ("query", np.float32, 3),
    ("key_rows", np.float32, 2),
    ("value_rows", np.float32, 2),
    ("key_raw", None, 2),  # the pools' bits: the entry's element type
    ("value_raw", None, 2),
    ("strides", np.int64, 1),
    ("block_tables", np.int32, 2),
    ("seq_lens", np.int32, 1),
    ("qo_indptr", np.int32, 1),
    ("items", np.int64, 2),
    ("claimed", np.int64, 1),
    ("out", np.float32, 3),
    ("partial_acc", np.float32, 2),
    ("partial_stats", np.float32, 2),
    ("sinks", np.float32, 1),
    ("key_scales", np.float32, 1),
    ("value_scales", np.float32, 1),
    ("scale_strides", np.int64, 1),
)
#: The ints after the arrays (``causal`` as 0 or 1; ``window`` and ``chunk`` 0 when unset).
INTS: Final = ("pool_kind", "group", "block_size", "causal", "window", "chunk")
#: The floats after the ints, as ``float64`` bits.
FLOATS: Final = ("scale", "softcap")
_INTS_AT: Final = 4 * len(ARRAYS)
_FLOATS_AT: Final = _INTS_AT + len(INTS)
#: Entries in a block.
BLOCK_SIZE: Final = _FLOATS_AT + len(FLOATS)


def _pointer_typer(typingctx, address, kind):  # type: ignore[no-untyped-def]
    """A typed pointer from a raw pointer or an int64 address; ``kind`` names the element type."""
    signature = types.CPointer(kind.instance_type)(address, kind)  # type: ignore[no-untyped-call]

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        target = context.get_value_type(sig.return_type)
        if isinstance(sig.args[0], types.RawPointer):
            return builder.bitcast(args[0], target)
        return builder.inttoptr(args[0], target)

    return signature, codegen


#: ``_pointer(address, np.float32)`` in compiled code (typed ``Any``: numba's intrinsic wrapper
#: declares the typing context as a parameter).
_pointer: Any = intrinsic(_pointer_typer)


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
    at = 72  # the ints (INTS), then the floats (FLOATS)
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


def _entry_uint16(data):  # type: ignore[no-untyped-def]
    block = carray(_pointer(data, np.int64), (BLOCK_SIZE,))
    floats = carray(_pointer(data, np.float64), (BLOCK_SIZE,))
    key_raw = carray(_pointer(block[12], np.uint16), _shape2(block, 12))
    value_raw = carray(_pointer(block[16], np.uint16), _shape2(block, 16))
    _run(block, floats, key_raw, value_raw)


def _entry_uint8(data):  # type: ignore[no-untyped-def]
    block = carray(_pointer(data, np.int64), (BLOCK_SIZE,))
    floats = carray(_pointer(data, np.float64), (BLOCK_SIZE,))
    key_raw = carray(_pointer(block[12], np.uint8), _shape2(block, 12))
    value_raw = carray(_pointer(block[16], np.uint8), _shape2(block, 16))
    _run(block, floats, key_raw, value_raw)


@njit(cache=True, inline="always")
def _put(block, at, array):  # type: ignore[no-untyped-def]
    """Write ``array``'s address and extents at ``at``; False where it is not C-contiguous."""
    block[at] = array.ctypes.data
    shape = array.shape
    for axis in range(3):
        block[at + 1 + axis] = shape[axis] if axis < len(shape) else 1
    return array.flags.c_contiguous


@njit(cache=True)
def fill_block(  # type: ignore[no-untyped-def]
    block,
    query,
    key_rows,
    value_rows,
    key_raw,
    value_raw,
    pool_kind,
    strides,
    block_tables,
    seq_lens,
    qo_indptr,
    items,
    claimed,
    group,
    block_size,
    scale,
    causal,
    window,
    out,
    partial_acc,
    partial_stats,
    softcap,
    sinks,
    chunk,
    key_scales,
    value_scales,
    scale_strides,
):
    """Write a share's arguments (those of :func:`attend_share`, in its order) into ``block``
    (``BLOCK_SIZE`` int64); its address, or 0 where an array is not C-contiguous (the
    entry cannot read it)."""
    whole = _put(block, 0, query) & _put(block, 4, key_rows) & _put(block, 8, value_rows)
    whole &= _put(block, 12, key_raw) & _put(block, 16, value_raw) & _put(block, 20, strides)
    whole &= _put(block, 24, block_tables) & _put(block, 28, seq_lens) & _put(block, 32, qo_indptr)
    whole &= _put(block, 36, items) & _put(block, 40, claimed) & _put(block, 44, out)
    whole &= _put(block, 48, partial_acc) & _put(block, 52, partial_stats) & _put(block, 56, sinks)
    whole &= _put(block, 60, key_scales) & _put(block, 64, value_scales) & _put(block, 68, scale_strides)
    at = 72
    block[at], block[at + 1], block[at + 2] = pool_kind, group, block_size
    block[at + 3], block[at + 4], block[at + 5] = 1 if causal else 0, window, chunk
    floats = block.view(np.float64)
    floats[at + 6], floats[at + 7] = scale, softcap
    return block.ctypes.data if whole else 0


#: Where each array argument of :func:`attend_share` (by position) has its address in a block.
_ADDRESS_AT: Final = {
    0: 0, 1: 4, 2: 8, 3: 12, 4: 16, 6: 20, 7: 24, 8: 28, 9: 32, 10: 36, 11: 40,
    17: 44, 18: 48, 19: 52, 21: 56, 23: 60, 24: 64, 25: 68,
}  # fmt: skip
_SCALE_AT: Final = 72 + 6  # the float ``scale`` in the block (argument 14)


def _address(array: np.ndarray[Any, Any]) -> int:
    address: int = array.__array_interface__["data"][0]
    return address


class CompiledLaunch:
    """A prepared call's shares through a team's C entry point (``run_entry(entry, data,
    threads)``): the block is filled once (:func:`fill_block`), and each layer's call writes
    only what differs from the call before: the addresses of the arrays that are other
    objects (its query, pools, output, counter), and the scale."""

    __slots__ = ("_block", "_entry", "_floats", "_last", "_run")

    def __init__(self, run: Any, entry: int, block: np.ndarray[Any, Any], first: tuple[Any, ...]) -> None:
        self._run, self._entry, self._block = run, entry, block
        self._last = list(first)  # the arrays whose addresses the block holds
        self._floats = block.view(np.float64)

    @staticmethod
    def make(run: Any, arguments: tuple[Any, ...]) -> CompiledLaunch | bool:
        """The launch of a call whose first share takes ``arguments``; False where no entry
        reads them (another element type of the pools' bits, an array not C-contiguous)."""
        entry = entry_address(str(arguments[3].dtype))
        if entry is None or str(arguments[4].dtype) != str(arguments[3].dtype):
            return False
        block = np.zeros(BLOCK_SIZE, dtype=np.int64)
        if not fill_block(block, *arguments):
            return False
        return CompiledLaunch(run, entry, block, arguments)

    def __call__(self, arguments: tuple[Any, ...], threads: int) -> bool:
        """Run the shares of ``arguments`` (of the same shapes as the first's: the prepared
        call checked them); False, nothing run, where the team cannot start its entry."""
        block, last = self._block, self._last
        for position, at in _ADDRESS_AT.items():
            array = arguments[position]
            if array is not last[position]:
                block[at] = _address(array)
                last[position] = array
        self._floats[_SCALE_AT] = arguments[14]
        ran: bool = self._run(self._entry, _address(block), threads)
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
