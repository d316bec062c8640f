"""Bad inputs outside the manager: create_manager, CacheConfig, AllocationRequest, BlockTable.

The manager's catalogue (each bad call raises its own exception class and changes
nothing, hidden state included) is part of the conformance kit and runs against every
backend in tests/conformance.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, BlockTable, CacheConfig, available_backends, create_manager
from kvcache_core.discovery import KNOWN_BACKENDS, get_backend
from kvcache_core.errors import (
    BackendNotFoundError,
    DTypeMismatchError,
    InsufficientBlocksError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidTypeError,
    KvCacheError,
    OutOfBlocksError,
    UnsupportedConfigError,
)
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.catalogue import MANAGER_CASES
from kvcache_core.testing.world import GEOMETRY, assert_same_state, make_world, snapshot

# The manager catalogue lives in the conformance kit (kvcache_core.testing.catalogue) and
# runs on every backend in tests/conformance; these are the core-only catalogues.

CONFIG = CacheConfig(**GEOMETRY)
NUM_SLOTS = CONFIG.num_blocks * CONFIG.block_size


def untyped(value: object) -> Any:
    """Pass a deliberately ill-typed value past the type checker."""
    return value


def esc(value: object) -> str:
    """A ``match=`` pattern for the text of ``value``."""
    return re.escape(str(value))


def numpy_backend() -> BackendUnderTest:
    return BackendUnderTest(name="numpy", spec=get_backend("numpy"))


def test_catalogue_is_large_and_every_id_is_unique() -> None:
    ids = [case.id for case in MANAGER_CASES]
    assert len(ids) >= 30
    assert len(set(ids)) == len(ids)


def test_failed_allocations_are_counted() -> None:
    world = make_world(numpy_backend())
    failures = world.manager.stats().allocation_failures

    with pytest.raises(OutOfBlocksError):
        world.manager.extend(world.a, 100)
    with pytest.raises(OutOfBlocksError):
        world.manager.allocate(AllocationRequest("big", initial_tokens=NUM_SLOTS))

    assert world.manager.stats().allocation_failures == failures + 2


def test_a_numpy_specific_dtype_mismatch_is_refused_without_change() -> None:
    """float64 keys into a float32 pool (the kit uses float16, which every backend holds)."""
    world = make_world(numpy_backend())
    before = snapshot(world.manager)
    slots = world.a.block_table().slots(0, 2)
    good = np.zeros((2, 2, 4), dtype=np.float32)

    with pytest.raises(DTypeMismatchError, match="float64"):
        world.manager.write(0, slots, good.astype(np.float64), good)

    assert_same_state(snapshot(world.manager), before)


# -- create_manager --------------------------------------------------------------------


@dataclass(frozen=True)
class BadFactoryCall:
    id: str
    backend: object
    config: object
    error: type[KvCacheError]
    match: str


FACTORY_CASES: list[BadFactoryCall] = [
    BadFactoryCall("unknown-backend", "quantum-annealer", CONFIG, BackendNotFoundError, "'quantum-annealer'"),
    BadFactoryCall("backend-name-not-a-str", 42, CONFIG, InvalidTypeError, "42"),
    BadFactoryCall(
        "numpy-bfloat16",
        "numpy",
        dataclasses.replace(CONFIG, dtype="bfloat16"),
        UnsupportedConfigError,
        "bfloat16.*float32",
    ),
    BadFactoryCall(
        "numpy-cuda-device",
        "numpy",
        dataclasses.replace(CONFIG, device=untyped("cuda:0")),
        UnsupportedConfigError,
        "cuda:0.*cpu",
    ),
    BadFactoryCall("config-not-a-config", "numpy", {"num_layers": 2}, InvalidTypeError, "dict"),
]


@pytest.mark.parametrize("case", FACTORY_CASES, ids=[case.id for case in FACTORY_CASES])
def test_bad_create_manager_call_raises_its_error(case: BadFactoryCall) -> None:
    backends_before = available_backends()

    with pytest.raises(case.error, match=case.match) as caught:
        create_manager(untyped(case.backend), untyped(case.config))

    assert type(caught.value) is case.error
    assert available_backends() == backends_before


def test_unknown_backend_message_lists_installed_backends_and_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KNOWN_BACKENDS, "ghostlib", "pip install kvcache-ghostlib")  # surely not installed
    with pytest.raises(BackendNotFoundError) as caught:
        create_manager("quantum-annealer", CONFIG)

    message = str(caught.value)
    installed = available_backends()
    assert "numpy" in installed
    assert all(name in message for name in installed), message
    assert "installed:" in message
    assert "pip install kvcache-ghostlib" in message, message


# -- CacheConfig -----------------------------------------------------------------------


CONFIG_FIELDS: dict[str, object] = {"num_layers": 2, "num_heads": 2, "head_dim": 4, "num_blocks": 8}

BAD_CONFIG_FIELDS: list[tuple[str, dict[str, object], str]] = [
    ("num_layers-zero", {"num_layers": 0}, "num_layers.*>= 1.*got 0"),
    ("num_layers-negative", {"num_layers": -2}, "num_layers.*-2"),
    ("num_layers-bool", {"num_layers": True}, "num_layers.*True"),
    ("num_layers-float", {"num_layers": 2.0}, "num_layers.*2.0"),
    ("num_layers-str", {"num_layers": "2"}, "num_layers.*'2'"),
    ("num_heads-zero", {"num_heads": 0}, "num_heads.*got 0"),
    ("num_heads-bool", {"num_heads": False}, "num_heads.*False"),
    ("head_dim-negative", {"head_dim": -4}, "head_dim.*-4"),
    ("num_blocks-zero", {"num_blocks": 0}, "num_blocks.*got 0"),
    ("num_blocks-float", {"num_blocks": 8.5}, "num_blocks.*8.5"),
    ("block_size-zero", {"block_size": 0}, "block_size.*got 0"),
    ("block_size-bool", {"block_size": True}, "block_size.*True"),
    ("dtype-unknown", {"dtype": "int4"}, "'int4'.*float32"),
    ("dtype-numpy-type", {"dtype": np.float32}, "dtype"),
    ("dtype-list", {"dtype": ["float32"]}, esc(["float32"])),
    ("kv_layout-unknown", {"kv_layout": "NDH"}, "'NDH'.*NHD, HND, heads_first"),
    ("kv_layout-lowercase", {"kv_layout": "nhd"}, "'nhd'"),
    ("device-bad-index", {"device": "cuda:x"}, "cuda:x"),
    ("device-negative-index", {"device": "cuda:-1"}, "cuda:-1"),
    ("device-empty-index", {"device": "cuda:"}, "cuda:"),
    ("device-superscript-index", {"device": "cuda:\u00b2"}, "cuda:\u00b2"),
    ("device-unknown-kind", {"device": "quantum"}, "'quantum'.*cpu"),
    ("device-not-a-str", {"device": 3}, "3"),
    ("enable_prefix_caching-str", {"enable_prefix_caching": "yes"}, "'yes'"),
    ("sliding_window-zero", {"sliding_window": 0}, "sliding_window.*got 0"),
    ("thresholds-medium-above-high", {"medium_pressure_threshold": 0.85}, "medium=0.85"),
    ("thresholds-high-equals-critical", {"high_pressure_threshold": 0.95}, "high=0.95"),
    ("thresholds-critical-above-one", {"critical_pressure_threshold": 1.5}, "critical=1.5"),
    ("thresholds-medium-zero", {"medium_pressure_threshold": 0.0}, "medium=0.0"),
    ("thresholds-nan", {"high_pressure_threshold": math.nan}, "high=nan"),
    ("thresholds-bool", {"critical_pressure_threshold": True}, "critical=True"),
    ("thresholds-str", {"medium_pressure_threshold": "0.5"}, "medium='0.5'"),
]


@pytest.mark.parametrize(
    ("fields", "match"),
    [pytest.param(fields, match, id=case_id) for case_id, fields, match in BAD_CONFIG_FIELDS],
)
def test_bad_cache_config_field_raises_invalid_config_error(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match) as caught:
        CacheConfig(**untyped({**CONFIG_FIELDS, **fields}))

    assert type(caught.value) is InvalidConfigError


# -- AllocationRequest -----------------------------------------------------------------


BAD_REQUESTS: list[tuple[str, dict[str, object], str]] = [
    ("empty-id", {"request_id": ""}, "request_id.*''"),
    ("id-not-a-str", {"request_id": 7}, "request_id.*7"),
    ("initial_tokens-negative", {"initial_tokens": -1}, "initial_tokens.*-1"),
    ("initial_tokens-bool", {"initial_tokens": True}, "initial_tokens.*True"),
    ("initial_tokens-float", {"initial_tokens": 2.0}, "initial_tokens.*2.0"),
    ("max_sequence_length-zero", {"max_sequence_length": 0}, "max_sequence_length.*got 0"),
    (
        "initial_tokens-above-max_sequence_length",
        {"initial_tokens": 10, "max_sequence_length": 8},
        "initial_tokens=10.*max_sequence_length=8",
    ),
    ("prompt-negative-token-id", {"prompt_token_ids": (1, -2, 3)}, "prompt_token_ids"),
    ("prompt-float-token-id", {"prompt_token_ids": (1, 2.0)}, "prompt_token_ids"),
    ("prompt-str", {"prompt_token_ids": "abc"}, "prompt_token_ids"),
    ("prompt-not-a-sequence", {"prompt_token_ids": 5}, "prompt_token_ids"),
    ("priority-float", {"priority": 1.5}, "priority.*1.5"),
    ("priority-bool", {"priority": True}, "priority.*True"),
]


@pytest.mark.parametrize(
    ("fields", "match"),
    [pytest.param(fields, match, id=case_id) for case_id, fields, match in BAD_REQUESTS],
)
def test_bad_allocation_request_raises_invalid_argument_error(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        AllocationRequest(**untyped({"request_id": "r", **fields}))

    assert type(caught.value) is InvalidArgumentError


# -- BlockTable --------------------------------------------------------------------------


def five_token_table() -> BlockTable:
    """Blocks 3 and 4 of 4 tokens, holding 5 tokens (capacity 8)."""
    return BlockTable(4, [3, 4], 5)


@dataclass(frozen=True)
class BadTableCall:
    id: str
    act: Callable[[BlockTable], object]
    error: type[KvCacheError]
    match: str


TABLE_CASES: list[BadTableCall] = [
    BadTableCall(
        "extend-sequence-past-capacity",
        lambda t: t.extend_sequence(4),
        InsufficientBlocksError,
        "length 9 needs 3 blocks.*has 2",
    ),
    BadTableCall("extend-sequence-negative", lambda t: t.extend_sequence(-1), InvalidArgumentError, "-1"),
    BadTableCall("extend-sequence-float", lambda t: t.extend_sequence(untyped(1.0)), InvalidArgumentError, esc(1.0)),
    BadTableCall("add-block-already-in-table", lambda t: t.add_blocks([5, 3]), InvalidArgumentError, "block 3"),
    BadTableCall("add-block-twice-in-one-call", lambda t: t.add_blocks([7, 7]), InvalidArgumentError, "block 7"),
    BadTableCall("add-block-negative", lambda t: t.add_blocks([8, -1]), InvalidArgumentError, "-1"),
    BadTableCall("add-block-bool", lambda t: t.add_blocks(untyped([True])), InvalidArgumentError, "True"),
    BadTableCall("add-block-float", lambda t: t.add_blocks(untyped([9.0])), InvalidArgumentError, esc(9.0)),
    BadTableCall("slots-past-capacity", lambda t: t.slots(0, 9), InvalidArgumentError, esc("[0, 9)")),
    BadTableCall("slots-float-stop", lambda t: t.slots(0, untyped(1.5)), InvalidArgumentError, esc(1.5)),
]


@pytest.mark.parametrize("case", TABLE_CASES, ids=[case.id for case in TABLE_CASES])
def test_bad_block_table_call_raises_its_error_and_changes_nothing(case: BadTableCall) -> None:
    table = five_token_table()
    before = table.to_dict()

    with pytest.raises(case.error, match=case.match) as caught:
        case.act(table)

    assert type(caught.value) is case.error
    assert table.to_dict() == before
    assert table == five_token_table()
    table.extend_sequence(3)  # still usable: exactly the 3 free tokens fit
    assert table.free_tokens() == 0


@pytest.mark.parametrize(
    ("block_size", "blocks", "length"),
    [
        pytest.param(0, [], 0, id="block-size-zero"),
        pytest.param(True, [], 0, id="block-size-bool"),
        pytest.param(4, [1, 1], 0, id="duplicate-block"),
        pytest.param(4, [1], 5, id="length-past-capacity"),
    ],
)
def test_bad_block_table_construction_raises(block_size: int, blocks: list[int], length: int) -> None:
    with pytest.raises(InvalidArgumentError):
        BlockTable(block_size, blocks, length)


def test_blocks_needed_for_negative_length_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="-1"):
        BlockTable.blocks_needed_for_length(-1, 4)


def test_block_table_from_dict_with_wrong_mapping_raises() -> None:
    data = five_token_table().to_dict()
    data["logical_to_physical"] = [1, 0]

    with pytest.raises(InvalidArgumentError, match=esc([1, 0])):
        BlockTable.from_dict(data)
