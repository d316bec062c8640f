"""The reliability repros that concern core alone (the rest are kit cases, run on every
backend): user pools, config limits, page-table ranges, error types, the command line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core import AllocationRequest, BlockTable, CacheConfig, InvalidArgumentError, PageTable, create_manager
from kvcache_core.backends.numpy import NumpyStorage
from kvcache_core.cli import main
from kvcache_core.errors import InvalidConfigError, InvalidTypeError

FloatArray = npt.NDArray[np.float32]
CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4)


def untyped(value: object) -> Any:
    return value


def fortran_order(pool: FloatArray) -> FloatArray:
    return np.asfortranarray(pool)


def reversed_layers(pool: FloatArray) -> FloatArray:
    return pool[::-1]


def aliased_layers(pool: FloatArray) -> FloatArray:
    aliased: FloatArray = np.lib.stride_tricks.as_strided(pool, strides=(0, *pool.strides[1:]))
    return aliased


@pytest.mark.parametrize(
    ("make_pool", "why"),
    [(fortran_order, "C-contiguous: False"), (reversed_layers, "strides \\(-"), (aliased_layers, "strides \\(0,")],
    ids=["fortran-order", "negative-stride", "zero-stride"],
)
def test_a_user_pool_that_writes_could_miss_is_refused(make_pool: Callable[[FloatArray], FloatArray], why: str) -> None:
    pool = make_pool(np.zeros(NumpyStorage.pool_shape(CONFIG), dtype=np.float32))
    with pytest.raises(InvalidArgumentError, match=f"C-contiguous with positive strides.*{why}"):
        create_manager("numpy", CONFIG, pool=pool)


def test_a_c_contiguous_user_pool_receives_every_write() -> None:
    pool = np.zeros(NumpyStorage.pool_shape(CONFIG), dtype=np.float32)
    manager = create_manager("numpy", CONFIG, pool=pool)
    handle = manager.allocate(AllocationRequest("a"))
    slots = manager.extend(handle, 3)
    keys = np.ones((3, 2, 4), dtype=np.float32)
    manager.write(1, slots, keys, keys * 2)
    assert pool.sum() == keys.sum() * 3  # the keys and twice them, in the caller's own array


def test_a_config_whose_slots_page_tables_cannot_address_is_refused() -> None:
    with pytest.raises(InvalidConfigError, match=r"2147483648 slots; page tables address at most 2147483647"):
        CacheConfig(num_layers=1, num_heads=1, head_dim=1, num_blocks=2**27, block_size=16)
    CacheConfig(num_layers=1, num_heads=1, head_dim=1, num_blocks=2**27 - 1, block_size=16)


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_indices", [2**32 + 3]), ("seq_lens", [2**32]), ("kv_indices", [-1]), ("kv_last_page_len", [2**31])],
)
def test_page_table_entries_out_of_int32_are_refused_not_wrapped(field: str, value: list[int]) -> None:
    arrays: dict[str, Any] = {
        "kv_indptr": [0, 1],
        "kv_indices": [3],
        "kv_last_page_len": [4],
        "block_tables": [[3]],
        "seq_lens": [4],
    }
    arrays[field] = value
    with pytest.raises(InvalidArgumentError, match=f"PageTable.{field} holds {value[0]}"):
        PageTable(**arrays, block_size=4)


def test_page_table_arrays_are_copies_the_caller_cannot_edit_through() -> None:
    indices = np.array([3], dtype=np.int32)
    table = PageTable(np.array([0, 1]), indices, np.array([4]), indices[None, :], np.array([4]), 4)
    indices[0] = 5
    assert table.kv_indices.tolist() == [3]


@pytest.mark.parametrize("data", [None, 7, "table", [1, 2]])
def test_block_table_from_something_not_a_mapping_is_a_kvcache_type_error(data: object) -> None:
    with pytest.raises(InvalidTypeError, match="takes a mapping"):
        BlockTable.from_dict(untyped(data))


def test_block_table_from_a_dict_with_a_scalar_mapping_is_a_kvcache_value_error() -> None:
    data = {"physical_blocks": [1], "logical_to_physical": 3, "sequence_length": 1, "block_size": 4}
    with pytest.raises(InvalidArgumentError, match="logical_to_physical must be a list"):
        BlockTable.from_dict(data)


def test_demo_with_a_negative_seed_is_a_usage_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--seed", "-1"])
    assert exit_info.value.code == 2
    assert "--seed: must be >= 0, got -1" in capsys.readouterr().err
