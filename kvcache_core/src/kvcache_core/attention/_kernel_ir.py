"""The paged kernel's pieces written as LLVM IR: vector blocks of products and weighted
sums, a prefetch of pool rows, an atomic claim of work.

A score is a dot product: numba's loops vectorise each one over the features and then sum
its lanes on its own, a chain of shuffles and adds per score that costs more than the
products themselves at 64 features. :func:`score_block_4` (and :func:`score_block_2`,
:func:`score_block_1`) computes :data:`LANES` scores at once (4 query rows times
``LANES / 4`` keys, and so on), keeps their lane vectors in registers and sums them
together in a tree of shuffle-and-add levels, each halving the lanes per score:
``LANES - 1`` vector adds for all of them. :func:`value_block_4` adds a tile's weighted
values into four rows' accumulators, two vectors of features at a time held in registers
over every key of the tile (numba's loop loads and stores the accumulators again every
few keys). Measured on an AMD EPYC (Zen 5, AVX-512), a decode tile of 4 query rows:
products 2.1x faster at 64 features, 1.3x at 128; value sums 1.8x-2x.

Only :mod:`kvcache_core.attention._kernel_jit` and the padded gather use this module (numba
publishes no type information: the intrinsics are untyped by nature). Nothing here checks
anything; the callers hand float32 arrays whose rows are contiguous and feature counts
that are multiples of :data:`LANES` (:data:`VALUE_CHUNK` for the values).
"""

from __future__ import annotations

# pyright: reportUnknownVariableType=false, reportUnknownArgumentType=false
# pyright: reportUnknownMemberType=false, reportMissingParameterType=false
# pyright: reportUnknownParameterType=false, reportUnknownLambdaType=false
from typing import Any, Final

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils as _numba_cgutils
from numba.core import codegen as _numba_codegen
from numba.core import config as _numba_config
from numba.extending import intrinsic

#: numba's code-generation helpers, untyped (numba publishes no type information).
_cgutils: Any = _numba_cgutils
_codegen: Any = _numba_codegen
_config: Any = _numba_config

__all__ = [
    "LANES",
    "VALUE_CHUNK",
    "address_pointer",
    "claim_next",
    "compile_features",
    "prefetch_at",
    "prefetch_row",
    "score_block_1",
    "score_block_2",
    "score_block_4",
    "value_block_4",
]


def compile_features() -> list[str]:
    """The CPU features numba compiles for (``NUMBA_CPU_FEATURES``, else the host's), as
    LLVM's ``+name`` / ``-name`` flags."""
    features = _config.CPU_FEATURES if _config.CPU_FEATURES is not None else _codegen.get_host_cpu_features()
    return str(features).split(",")


def _vector_lanes() -> int:
    """The float32 lanes of a vector register where numba compiles: 16 with AVX-512, else
    8. Sixteen lanes on AVX2 (LLVM splits each vector in two) would need 32 registers of
    the 16 there are; measured on the same CPU compiled for Haswell, the 16-lane blocks ran
    1.4x-1.6x slower than numba's own loops, the 8-lane ones 1.1x-1.3x faster."""
    return 16 if "+avx512f" in compile_features() else 8


#: float32 lanes of one vector: 16 where numba compiles for AVX-512, else 8.
LANES: Final = _vector_lanes()
_FLOAT = ir.FloatType()
_VECTOR = ir.VectorType(_FLOAT, LANES)
#: Features of the values one pass of :func:`value_block_4` accumulates (two vectors).
VALUE_CHUNK = 2 * LANES
_VALUE_ROWS = 4
# Reassociation lets the tree's adds run in any order, as the dot products' own sums do.
_FLAGS = ("reassoc", "nsz", "contract")


def _lane_mask(lanes: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes)


def _sum_each(builder: Any, vectors: list[Any]) -> Any:
    """One vector whose lane ``i`` is the sum of the lanes of ``vectors[i]`` (``LANES`` of them):
    at each level, a pair of vectors whose scores hold ``span`` lanes each becomes one whose
    scores hold ``span / 2``: the first halves of every score's lanes plus the second halves."""
    level, per_vector = vectors, 1
    while len(level) > 1:
        span = LANES // per_vector
        half = span // 2
        firsts: list[int] = []
        seconds: list[int] = []
        for source in (0, LANES):  # the pair's first vector, then its second (shufflevector's numbering)
            for score in range(per_vector):
                start = source + score * span
                firsts.extend(range(start, start + half))
                seconds.extend(range(start + half, start + span))
        level = [
            builder.fadd(
                builder.shuffle_vector(left, right, _lane_mask(firsts)),
                builder.shuffle_vector(left, right, _lane_mask(seconds)),
                flags=_FLAGS,
            )
            for left, right in zip(level[::2], level[1::2], strict=True)
        ]
        per_vector *= 2
    return level[0]


def _block_types(floats: tuple[Any, ...], rows_at: Any, integers: tuple[Any, ...]) -> bool:
    """Whether a block's arguments are 2-D float32 arrays, one int64 array of pool rows and
    integers (numba then compiles it; otherwise it tries other typings)."""
    return (
        all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 for a in floats)
        and isinstance(rows_at, types.Array)
        and rows_at.ndim == 1
        and rows_at.dtype == types.int64
        and all(isinstance(i, types.Integer) for i in integers)
    )


class _Code:
    """A block's arguments inside its code (arrays as numba's array structures, integers as
    ``intp`` values) and the few IR steps both blocks take."""

    def __init__(self, context: Any, builder: Any, signature: Any, arguments: Any) -> None:
        self.context, self.builder, self.types = context, builder, signature.args
        self.values = [
            context.make_array(kind)(context, builder, value)
            if isinstance(kind, types.Array)
            else context.cast(builder, value, kind, types.intp)
            for kind, value in zip(signature.args, arguments, strict=True)
        ]
        self.intp = context.get_value_type(types.intp)
        self.multiply_add = _cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), f"llvm.fmuladd.v{LANES}f32"
        )

    def constant(self, value: int) -> Any:
        return ir.Constant(self.intp, value)

    def plus(self, value: Any, step: int) -> Any:
        return self.builder.add(value, self.constant(step))

    def row(self, argument: int, index: Any) -> Any:
        """A pointer to the first element of row ``index`` of the array argument ``argument``."""
        return self.item(argument, [index, self.constant(0)])

    def item(self, argument: int, index: list[Any]) -> Any:
        array_type, array = self.types[argument], self.values[argument]
        return _cgutils.get_item_pointer(self.context, self.builder, array_type, array, index, wraparound=False)

    def lanes(self, row: Any, feature: Any) -> Any:
        """The vector of ``LANES`` floats at ``row + feature``, loaded."""
        at = self.builder.bitcast(self.builder.gep(row, [feature]), _VECTOR.as_pointer())
        return self.builder.load(at, align=4)

    def add_product(self, total: Any, left: Any, right: Any) -> None:
        """``*total += left * right`` (vectors; ``total`` a stack slot LLVM keeps in a register)."""
        builder = self.builder
        builder.store(builder.call(self.multiply_add, [left, right, builder.load(total)]), total)


def _score_block_typer(rows: int) -> Any:
    """The typing and code of ``score_block(queries, first_row, key_rows, rows_at, first,
    scores, column)`` for ``rows`` query rows."""
    keys = LANES // rows

    def typer(typingctx, queries, first_row, key_rows, rows_at, first, scores, column):  # type: ignore[no-untyped-def]
        if not _block_types((queries, key_rows, scores), rows_at, (first_row, first, column)):
            return None

        def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
            code = _Code(context, builder, signature, arguments)
            row, start, column_at = code.values[1], code.values[4], code.values[6]
            query_rows = [code.row(0, code.plus(row, r)) for r in range(rows)]
            first_key = builder.add(start, column_at)
            key_rows = [code.row(2, builder.load(code.item(3, [code.plus(first_key, k)]))) for k in range(keys)]
            features = builder.extract_value(code.values[0].shape, 1)
            sums = [_cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, [0.0] * LANES)) for _ in range(LANES)]
            with _cgutils.for_range_slice(builder, code.constant(0), features, code.constant(LANES)) as (feature, _):
                query_lanes = [code.lanes(pointer, feature) for pointer in query_rows]
                key_lanes = [code.lanes(pointer, feature) for pointer in key_rows]
                for r in range(rows):
                    for k in range(keys):
                        code.add_product(sums[r * keys + k], query_lanes[r], key_lanes[k])
            scores = _sum_each(builder, [builder.load(total) for total in sums])
            row_vector = ir.VectorType(_FLOAT, keys).as_pointer()
            for r in range(rows):
                part = builder.shuffle_vector(scores, scores, _lane_mask(list(range(r * keys, (r + 1) * keys))))
                target = code.item(5, [code.plus(row, r), column_at])
                builder.store(part, builder.bitcast(target, row_vector), align=4)
            return context.get_dummy_value()

        return types.void(queries, first_row, key_rows, rows_at, first, scores, column), codegen

    return typer


#: ``score_block_4(queries, j, key_rows, rows_at, first, scores, c)`` in compiled code:
#: ``scores[j + r, c + k] = queries[j + r] . key_rows[rows_at[first + c + k]]`` for ``r <
#: 4`` and ``k < LANES / 4``. The features (``queries.shape[1]``) must be a multiple of
#: :data:`LANES`, every row contiguous.
score_block_4: Any = intrinsic(_score_block_typer(4))
#: The same for two query rows and ``LANES / 2`` keys.
score_block_2: Any = intrinsic(_score_block_typer(2))
#: The same for one query row and ``LANES`` keys.
score_block_1: Any = intrinsic(_score_block_typer(1))


def _value_block_typer(typingctx, value_rows, rows_at, first, keys, weights, column, first_row, acc):  # type: ignore[no-untyped-def]
    """``value_block_4(value_rows, rows_at, first, keys, weights, column, j, acc)``: ``acc[j +
    r] += sum_c weights[j + r, column + c] * value_rows[rows_at[first + c]]`` for ``r < 4``,
    ``c < keys``."""
    if not _block_types((value_rows, weights, acc), rows_at, (first, keys, column, first_row)):
        return None

    def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
        code = _Code(context, builder, signature, arguments)
        start, count, offset, row = code.values[2], code.values[3], code.values[5], code.values[6]
        parts = VALUE_CHUNK // LANES
        acc_rows = [code.row(7, code.plus(row, r)) for r in range(_VALUE_ROWS)]
        sums = [_cgutils.alloca_once(builder, _VECTOR) for _ in range(_VALUE_ROWS * parts)]
        broadcast = _lane_mask([0] * LANES)
        features = builder.extract_value(code.values[7].shape, 1)
        with _cgutils.for_range_slice(builder, code.constant(0), features, code.constant(VALUE_CHUNK)) as (feature, _):
            chunk = [code.plus(feature, part * LANES) for part in range(parts)]
            for r in range(_VALUE_ROWS):
                for part in range(parts):
                    builder.store(code.lanes(acc_rows[r], chunk[part]), sums[r * parts + part])
            with _cgutils.for_range(builder, count) as loop:
                key = loop.index
                value_row = code.row(0, builder.load(code.item(1, [builder.add(start, key)])))
                values = [code.lanes(value_row, chunk[part]) for part in range(parts)]
                for r in range(_VALUE_ROWS):
                    weight = builder.load(code.item(4, [code.plus(row, r), builder.add(offset, key)]))
                    single = builder.insert_element(ir.Constant(_VECTOR, None), weight, ir.Constant(ir.IntType(32), 0))
                    weights = builder.shuffle_vector(single, ir.Constant(_VECTOR, None), broadcast)
                    for part in range(parts):
                        code.add_product(sums[r * parts + part], weights, values[part])
            for r in range(_VALUE_ROWS):
                for part in range(parts):
                    at = builder.bitcast(builder.gep(acc_rows[r], [chunk[part]]), _VECTOR.as_pointer())
                    builder.store(builder.load(sums[r * parts + part]), at, align=4)
        return context.get_dummy_value()

    return types.void(value_rows, rows_at, first, keys, weights, column, first_row, acc), codegen


#: ``value_block_4(value_rows, rows_at, first, keys, weights, column, j, acc)`` in compiled
#: code: ``acc[j + r] += sum_c weights[j + r, column + c] * value_rows[rows_at[first + c]]``
#: for ``r < 4`` and ``c < keys``. The features (``acc.shape[1]``) must be a multiple of
#: :data:`VALUE_CHUNK`, every row contiguous.
value_block_4: Any = intrinsic(_value_block_typer)


def _prefetch_row_typer(typingctx, array, row):  # type: ignore[no-untyped-def]
    """Ask the CPU to bring row ``row`` of a 2-D C array into the L2 cache (``prefetcht1``,
    one per 64-byte line, in a loop: the lines are counted from the row's stride, so a row
    costs a few instructions per line, not a test of every possible line): the hardware
    prefetcher stops at every 4 KiB page, a paged pool's keys cross one every few rows."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and isinstance(row, types.Integer)):
        return None

    def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
        array_type = signature.args[0]
        rows = context.make_array(array_type)(context, builder, arguments[0])
        index = context.cast(builder, arguments[1], signature.args[1], types.intp)
        zero = context.get_constant(types.intp, 0)
        first = _cgutils.get_item_pointer(context, builder, array_type, rows, [index, zero], wraparound=False)
        start = builder.bitcast(first, ir.IntType(8).as_pointer())
        row_bytes = builder.extract_value(rows.strides, 0)
        int32 = ir.IntType(32)
        prefetch = _cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [start.type, int32, int32, int32]), "llvm.prefetch.p0"
        )
        zero_bytes, line_bytes = context.get_constant(types.intp, 0), context.get_constant(types.intp, 64)
        with _cgutils.for_range_slice(builder, zero_bytes, row_bytes, line_bytes) as (offset, _):
            # (address, read, locality 2: L2, data cache) per 64-byte line of the row
            builder.call(prefetch, [builder.gep(start, [offset]), int32(0), int32(2), int32(1)])
        return context.get_dummy_value()

    return types.void(array, row), codegen


def _prefetch_at_typer(typingctx, address, row, row_bytes):  # type: ignore[no-untyped-def]
    """``prefetch_row`` of the row ``row`` of ``row_bytes`` bytes from the int64 ``address``
    (a pool's first byte): no array, so a loop that prefetches takes no reference counts."""
    if not all(isinstance(value, types.Integer) for value in (address, row, row_bytes)):
        return None

    def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
        address, row, row_bytes = (
            context.cast(builder, value, kind, types.intp)
            for value, kind in zip(arguments, signature.args, strict=True)
        )
        byte = ir.IntType(8).as_pointer()
        start = builder.inttoptr(builder.add(address, builder.mul(row, row_bytes)), byte)
        int32 = ir.IntType(32)
        prefetch = _cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, int32, int32, int32]), "llvm.prefetch.p0"
        )
        zero_bytes, line_bytes = context.get_constant(types.intp, 0), context.get_constant(types.intp, 64)
        with _cgutils.for_range_slice(builder, zero_bytes, row_bytes, line_bytes) as (offset, _):
            builder.call(prefetch, [builder.gep(start, [offset]), int32(0), int32(2), int32(1)])
        return context.get_dummy_value()

    return types.void(address, row, row_bytes), codegen


def _claim_typer(typingctx, counter):  # type: ignore[no-untyped-def]
    """``counter[0]``, incremented atomically: the next item a thread takes."""
    if not (isinstance(counter, types.Array) and counter.ndim == 1 and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
        array = context.make_array(signature.args[0])(context, builder, arguments[0])
        return builder.atomic_rmw("add", array.data, context.get_constant(types.int64, 1), "monotonic")

    return types.int64(counter), codegen


#: ``claim_next(counter)`` in compiled code (the padded gather's threads claim with it too).
claim_next: Any = intrinsic(_claim_typer)
#: ``prefetch_row(array, row)`` in compiled code (typed ``Any``: numba's intrinsic wrapper
#: declares the typing context as a parameter).
prefetch_row: Any = intrinsic(_prefetch_row_typer)
#: ``prefetch_at(address, row, row_bytes)`` in compiled code (:func:`_prefetch_at_typer`).
prefetch_at: Any = intrinsic(_prefetch_at_typer)


def _pointer_typer(typingctx, address, kind):  # type: ignore[no-untyped-def]
    """A typed pointer from a raw pointer or an int64 address; ``kind`` names the element type."""
    signature = types.CPointer(kind.instance_type)(address, kind)  # type: ignore[no-untyped-call]

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        target = context.get_value_type(sig.return_type)
        if isinstance(sig.args[0], types.RawPointer):
            return builder.bitcast(args[0], target)
        return builder.inttoptr(args[0], target)

    return signature, codegen


#: ``address_pointer(address, np.float32)`` in compiled code: what a C entry point reads its
#: arrays through (the kernel's and the padded gather's, from their blocks of addresses).
address_pointer: Any = intrinsic(_pointer_typer)
