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
    "claim_next",
    "compile_features",
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


def _score_block_typer(rows: int) -> Any:
    """The typing and code of ``score_block(queries, first_row, key_rows, rows_at, first,
    scores, column)`` for ``rows`` query rows."""
    keys = LANES // rows

    def typer(typingctx, queries, first_row, key_rows, rows_at, first, scores, column):  # type: ignore[no-untyped-def]
        floats = (queries, key_rows, scores)
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 for a in floats):
            return None
        if not (isinstance(rows_at, types.Array) and rows_at.ndim == 1 and rows_at.dtype == types.int64):
            return None
        if not all(isinstance(i, types.Integer) for i in (first_row, first, column)):
            return None

        def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
            query_type, row_type, key_type, at_type, first_type, score_type, column_type = signature.args
            query_array = context.make_array(query_type)(context, builder, arguments[0])
            key_array = context.make_array(key_type)(context, builder, arguments[2])
            at_array = context.make_array(at_type)(context, builder, arguments[3])
            score_array = context.make_array(score_type)(context, builder, arguments[5])
            intp = context.get_value_type(types.intp)
            row = context.cast(builder, arguments[1], row_type, types.intp)
            start = context.cast(builder, arguments[4], first_type, types.intp)
            column_at = context.cast(builder, arguments[6], column_type, types.intp)
            zero = ir.Constant(intp, 0)

            def item(array_type: Any, array: Any, index: list[Any]) -> Any:
                return _cgutils.get_item_pointer(context, builder, array_type, array, index, wraparound=False)

            def offset(value: Any, step: int) -> Any:
                return builder.add(value, ir.Constant(intp, step))

            query_rows = [item(query_type, query_array, [offset(row, r), zero]) for r in range(rows)]
            key_pointers = []
            for k in range(keys):
                pool_row = builder.load(item(at_type, at_array, [offset(builder.add(start, column_at), k)]))
                key_pointers.append(item(key_type, key_array, [pool_row, zero]))
            features = builder.extract_value(query_array.shape, 1)
            sums = [_cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, [0.0] * LANES)) for _ in range(LANES)]
            multiply_add = _cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), f"llvm.fmuladd.v{LANES}f32"
            )
            pointer = _VECTOR.as_pointer()
            with _cgutils.for_range_slice(builder, zero, features, ir.Constant(intp, LANES)) as (feature, _):
                query_lanes = [
                    builder.load(builder.bitcast(builder.gep(p, [feature]), pointer), align=4) for p in query_rows
                ]
                key_lanes = [
                    builder.load(builder.bitcast(builder.gep(p, [feature]), pointer), align=4) for p in key_pointers
                ]
                for r in range(rows):
                    for k in range(keys):
                        total = sums[r * keys + k]
                        builder.store(
                            builder.call(multiply_add, [query_lanes[r], key_lanes[k], builder.load(total)]), total
                        )
            scores = _sum_each(builder, [builder.load(total) for total in sums])
            row_vector = ir.VectorType(_FLOAT, keys).as_pointer()
            for r in range(rows):
                part = builder.shuffle_vector(scores, scores, _lane_mask(list(range(r * keys, (r + 1) * keys))))
                target = item(score_type, score_array, [offset(row, r), column_at])
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


def _value_block_typer(typingctx, value_rows, rows_at, first, keys, weights, first_row, acc):  # type: ignore[no-untyped-def]
    """``value_block_4(value_rows, rows_at, first, keys, weights, j, acc)``: ``acc[j + r] +=
    sum_c weights[j + r, c] * value_rows[rows_at[first + c]]`` for ``r < 4``, ``c < keys``."""
    floats = (value_rows, weights, acc)
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 for a in floats):
        return None
    if not (isinstance(rows_at, types.Array) and rows_at.ndim == 1 and rows_at.dtype == types.int64):
        return None
    if not all(isinstance(i, types.Integer) for i in (first, keys, first_row)):
        return None

    def codegen(context, builder, signature, arguments):  # type: ignore[no-untyped-def]
        value_type, at_type, first_type, keys_type, weight_type, row_type, acc_type = signature.args
        value_array = context.make_array(value_type)(context, builder, arguments[0])
        at_array = context.make_array(at_type)(context, builder, arguments[1])
        weight_array = context.make_array(weight_type)(context, builder, arguments[4])
        acc_array = context.make_array(acc_type)(context, builder, arguments[6])
        intp = context.get_value_type(types.intp)
        start = context.cast(builder, arguments[2], first_type, types.intp)
        count = context.cast(builder, arguments[3], keys_type, types.intp)
        row = context.cast(builder, arguments[5], row_type, types.intp)
        zero = ir.Constant(intp, 0)

        def item(array_type: Any, array: Any, index: list[Any]) -> Any:
            return _cgutils.get_item_pointer(context, builder, array_type, array, index, wraparound=False)

        def lanes_at(row_pointer: Any, feature: Any, part: int) -> Any:
            at = builder.gep(row_pointer, [builder.add(feature, ir.Constant(intp, part * LANES))])
            return builder.bitcast(at, _VECTOR.as_pointer())

        parts = VALUE_CHUNK // LANES
        acc_rows = [
            item(acc_type, acc_array, [builder.add(row, ir.Constant(intp, r)), zero]) for r in range(_VALUE_ROWS)
        ]
        sums = [_cgutils.alloca_once(builder, _VECTOR) for _ in range(_VALUE_ROWS * parts)]
        multiply_add = _cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), f"llvm.fmuladd.v{LANES}f32"
        )
        broadcast = _lane_mask([0] * LANES)
        features = builder.extract_value(acc_array.shape, 1)
        with _cgutils.for_range_slice(builder, zero, features, ir.Constant(intp, VALUE_CHUNK)) as (feature, _):
            for r in range(_VALUE_ROWS):
                for part in range(parts):
                    builder.store(builder.load(lanes_at(acc_rows[r], feature, part), align=4), sums[r * parts + part])
            with _cgutils.for_range(builder, count) as loop:
                key = loop.index
                pool_row = builder.load(item(at_type, at_array, [builder.add(start, key)]))
                value_row = item(value_type, value_array, [pool_row, zero])
                values = [builder.load(lanes_at(value_row, feature, part), align=4) for part in range(parts)]
                for r in range(_VALUE_ROWS):
                    weight = builder.load(
                        item(weight_type, weight_array, [builder.add(row, ir.Constant(intp, r)), key])
                    )
                    single = builder.insert_element(ir.Constant(_VECTOR, None), weight, ir.Constant(ir.IntType(32), 0))
                    weights = builder.shuffle_vector(single, ir.Constant(_VECTOR, None), broadcast)
                    for part in range(parts):
                        total = sums[r * parts + part]
                        builder.store(builder.call(multiply_add, [weights, values[part], builder.load(total)]), total)
            for r in range(_VALUE_ROWS):
                for part in range(parts):
                    builder.store(builder.load(sums[r * parts + part]), lanes_at(acc_rows[r], feature, part), align=4)
        return context.get_dummy_value()

    return types.void(value_rows, rows_at, first, keys, weights, first_row, acc), codegen


#: ``value_block_4(value_rows, rows_at, first, keys, weights, j, acc)`` in compiled code:
#: ``acc[j + r] += sum_c weights[j + r, c] * value_rows[rows_at[first + c]]`` for ``r < 4``
#: and ``c < keys``. The features (``acc.shape[1]``) must be a multiple of
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
