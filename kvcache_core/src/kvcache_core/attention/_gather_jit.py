"""The numba-compiled loop of the padded gather (:mod:`kvcache_core.attention.gather_kernel`).

As :mod:`kvcache_core.attention._kernel_jit`, this holds compiled code only and nothing checks
anything here: the typed wrapper checks every shape and index before a call (bounds checks
are off, as in any compiled kernel).

A work item is one ``(row, head)`` of the padded batch of one pool (one call copies one
layer's keys and values together, on one start of the team): it zeroes the row's padding for that
head (``memset``) and copies each run of consecutive slots, ``length x dim`` elements in a row
at both ends, with one ``memcpy``. Measured on machine C (AMD EPYC, 2 threads, the pool not in
cache), 8 rows of about 2k positions: 1.0 ms a pool of 2 heads of 64 float32 against 1.36 ms
as 2-D slice assignments (1.24 ms as 1-D ones) and 0.96 ms for ``torch.cat`` of as much
contiguous memory; 7.1, 7.9 and 7.9 ms at 8 heads of 128. The threads claim items from one atomic counter,
without the GIL, in the order the wrapper gives (longest rows first). Elements are copied as
their bits (an unsigned integer of their size), so one compiled version serves every dtype of
that size. ``cache=True``: compiled once per machine.

A team that starts its threads from C (torch's OpenMP team, ``run_entry``) runs the shares
through a C entry point (:func:`entry_address`), as the kernel's do
(:mod:`kvcache_core.attention._kernel_entry`): each thread enters :func:`gather_share` from C,
every array read as bytes from a block of addresses, so no thread runs Python or waits for the
GIL. Inside transformers' ``generate`` of 8 ragged prompts on the contiguous path (machine D:
AMD EPYC, Zen 5, 2 cores; 2 KV heads of 64, about 2k positions), a layer's read of keys and
values took 1.04 ms that way against 1.08 ms through Python shares, calls alternating.
"""

from __future__ import annotations

# numba publishes no type information: the decorated functions are untyped by nature.
# pyright: reportUntypedFunctionDecorator=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownMemberType=false
# pyright: reportMissingParameterType=false, reportUnknownParameterType=false
from typing import Any, Final

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from kvcache_core.attention._kernel_cache import register_locators
from kvcache_core.attention._kernel_ir import address_pointer, claim_next

# Before any decorator: the cached functions' locators stamp every kernel source.
register_locators()

__all__ = ["ENTRY_BLOCK", "ENTRY_PAIRS", "PAIR_AT", "entry_address", "gather_share"]

#: The C entry's block (:func:`entry_address`), ``int64`` entries: pairs (1 or 2), heads,
#: positions, batch, runs, work items; the addresses of the leads, run starts, runs, order
#: and counter; per pair (two places each) its head stride and row in bytes; then per pair
#: (:data:`PAIR_AT`, four entries each) the pool's address and bytes, the out's address and bytes.
ENTRY_PAIRS: Final = 2
PAIR_AT: Final = 11 + 2 * ENTRY_PAIRS
ENTRY_BLOCK: Final = PAIR_AT + 4 * ENTRY_PAIRS


def _element_pointer(context, builder, array_type, array, at):  # type: ignore[no-untyped-def]
    """The address of element ``at`` of a 1-D array, as a byte pointer, and the element size."""
    data = context.make_array(array_type)(context, builder, array).data
    size = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
    pointer = builder.gep(data, [context.cast(builder, at, types.int64, types.intp)])
    return builder.bitcast(pointer, ir.IntType(8).as_pointer()), context.get_constant(types.intp, size)


def _copy_typer(typingctx, target, target_at, source, source_at, count):  # type: ignore[no-untyped-def]
    """``target[target_at:][:count] = source[source_at:][:count]`` (1-D arrays of one element
    type, ranges inside both, not overlapping) as one ``memcpy``: the C library's copy, the
    fastest this machine has for its size."""
    if not (isinstance(target, types.Array) and isinstance(source, types.Array) and target.dtype == source.dtype):
        return None

    def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
        to, size = _element_pointer(context, builder, signature.args[0], arguments[0], arguments[1])  # type: ignore[no-untyped-call]
        start, _ = _element_pointer(context, builder, signature.args[2], arguments[2], arguments[3])  # type: ignore[no-untyped-call]
        elements = context.cast(builder, arguments[4], types.int64, types.intp)
        cgutils.raw_memcpy(builder, to, start, builder.mul(elements, size), 1)  # type: ignore[no-untyped-call]
        return context.get_dummy_value()

    return types.void(target, types.int64, source, types.int64, types.int64), codegen


def _zero_typer(typingctx, target, target_at, count):  # type: ignore[no-untyped-def]
    """``target[target_at:][:count] = 0`` (a 1-D array, the range inside it) as one ``memset``."""
    if not isinstance(target, types.Array):
        return None

    def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
        to, size = _element_pointer(context, builder, signature.args[0], arguments[0], arguments[1])  # type: ignore[no-untyped-call]
        elements = context.cast(builder, arguments[2], types.int64, types.intp)
        cgutils.memset(builder, to, builder.mul(elements, size), 0)  # type: ignore[no-untyped-call]
        return context.get_dummy_value()

    return types.void(target, types.int64, types.int64), codegen


#: ``_copy(target, target_at, source, source_at, count)`` and ``_zero(target, at, count)`` in
#: compiled code (typed ``Any``: numba's intrinsic wrapper declares the typing context).
_copy: Any = intrinsic(_copy_typer)
_zero: Any = intrinsic(_zero_typer)


@njit(cache=True, nogil=True)
def gather_share(pools, head_strides, dims, outs, heads, positions, leads, run_first, runs, order, claimed):  # type: ignore[no-untyped-def]
    """Run items until none is left, each claimed from ``claimed [1]`` int64 (0 at the start,
    shared by the call's threads): item ``at`` is pool ``at % len(pools)``'s ``order[at //
    len(pools)]`` (``row * heads + head``), so the pools' longest rows come first together.

    ``pools`` is a tuple of 1-D arrays: pool ``p``'s head ``h``'s slot ``s`` is
    ``pools[p][h * head_strides[p] + s * dims[p]:][:dims[p]]``; ``outs[p]`` is its C-contiguous
    ``[batch, heads, positions, dims[p]]`` batch, flat, of the same element type; ``leads
    [batch]`` the padding positions opening each row; ``runs [n, 3]`` int64 ``(first position,
    first slot, length)``, row ``r``'s from ``run_first[r]`` to ``run_first[r + 1]``."""
    count = len(pools)
    total = order.shape[0] * count
    while True:
        at = claim_next(claimed)
        if at >= total:
            return
        pool_at = at % count
        pool, out, dim = pools[pool_at], outs[pool_at], dims[pool_at]
        item = order[at // count]
        row = item // heads
        head = item - row * heads
        base = item * positions * dim  # (row * heads + head) rows of positions x dim
        _zero(out, base, leads[row] * dim)
        source = head * head_strides[pool_at]
        for run in range(run_first[row], run_first[row + 1]):
            position, slot, length = runs[run, 0], runs[run, 1], runs[run, 2]
            _copy(out, base + position * dim, pool, source + slot * dim, length * dim)


@njit(cache=True, nogil=True)
def _enter(data):  # type: ignore[no-untyped-def]
    """One thread's share of the gather whose block is at ``data`` (every array as bytes:
    a copy moves bits, so one compiled share serves every element size)."""
    block = carray(address_pointer(data, np.int64), (ENTRY_BLOCK,))
    pairs, heads, positions, batch = block[0], block[1], block[2], block[3]
    leads = carray(address_pointer(block[6], np.int64), (batch,))
    run_first = carray(address_pointer(block[7], np.int64), (batch + 1,))
    runs = carray(address_pointer(block[8], np.int64), (block[4], 3))
    order = carray(address_pointer(block[9], np.int64), (block[5],))
    claimed = carray(address_pointer(block[10], np.int64), (1,))
    strides, rows = block[11 : 11 + ENTRY_PAIRS], block[11 + ENTRY_PAIRS : PAIR_AT]
    at = PAIR_AT
    pool = carray(address_pointer(block[at], np.uint8), (block[at + 1],))
    out = carray(address_pointer(block[at + 2], np.uint8), (block[at + 3],))
    if pairs == 1:
        gather_share((pool,), strides, rows, (out,), heads, positions, leads, run_first, runs, order, claimed)
        return
    at += 4
    second = carray(address_pointer(block[at], np.uint8), (block[at + 1],))
    second_out = carray(address_pointer(block[at + 2], np.uint8), (block[at + 3],))
    gather_share(
        (pool, second), strides, rows, (out, second_out), heads, positions, leads, run_first, runs, order, claimed
    )


def _entry(data):  # type: ignore[no-untyped-def]
    _enter(data)


_compiled: list[Any] = []


def entry_address() -> int:
    """The address of the C entry ``void entry(int64 *block)`` (a block of
    :data:`ENTRY_BLOCK` entries), compiled on first use and kept on disk: what a team with
    ``run_entry`` starts on each thread, with no Python and no GIL (as the kernel's,
    :mod:`kvcache_core.attention._kernel_entry`). (Callers serialise first uses:
    :data:`kvcache_core.attention.kernel.LAUNCH_LOCK`.)"""
    if not _compiled:
        _compiled.append(cfunc(types.void(types.voidptr), cache=True)(_entry))
    address: Any = _compiled[0].address  # an int once compiled (numba types it int | None)
    return int(address)
