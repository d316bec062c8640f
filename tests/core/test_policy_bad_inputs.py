"""Bad values of the policies' types: each raises its own exception class.

The manager's policy cases (fork, swap, shared blocks, rewrites, token ids) live in the
conformance kit (``kvcache_core.testing.policy_catalogue``) and run on every backend that
claims the policies, in tests/conformance; these are the core-only value types.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, BlockTable, CacheConfig, PageTable
from kvcache_core.attention.reference import paged_attention
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError
from kvcache_core.testing._plugin import POLICY_CAPABILITIES
from kvcache_core.testing.catalogue import MANAGER_CASES
from kvcache_core.testing.policy_catalogue import POLICY_CASES

CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=20, block_size=4, enable_prefix_caching=True)


def untyped(value: object) -> Any:
    """Pass a deliberately ill-typed value past the type checker."""
    return value


def esc(value: object) -> str:
    return re.escape(str(value))


def test_the_policy_catalogue_is_large_and_every_id_is_unique() -> None:
    ids = [case.id for case in POLICY_CASES]
    assert len(ids) >= 30
    assert len(set(ids)) == len(ids)
    assert not set(ids) & {case.id for case in MANAGER_CASES}


def test_every_policy_case_runs_where_every_policy_is_claimed() -> None:
    """The cases gate on capabilities the kit knows, so a backend claiming them all runs every one."""
    assert {name for case in POLICY_CASES for name in case.requires} <= set(POLICY_CAPABILITIES)


# -- value types ---------------------------------------------------------------------------


BAD_REQUESTS: list[tuple[str, dict[str, object], str]] = [
    ("salt-int", {"cache_salt": 5}, "cache_salt must be a str, bytes or None, got int 5"),
    ("salt-list", {"cache_salt": ["a"]}, esc("got list ['a']")),
    ("salt-bytearray", {"cache_salt": bytearray(b"a")}, "got bytearray"),
    ("salt-unencodable", {"cache_salt": "\ud800"}, "cannot be encoded as UTF-8"),
    ("prompt-token-too-big", {"prompt_token_ids": (1, 2**63)}, esc(f"prompt_token_ids[1] = {2**63}")),
    ("prompt-bool-token", {"prompt_token_ids": (1, True)}, esc("prompt_token_ids[1] = True")),
    ("prompt-nested", {"prompt_token_ids": ((1, 2),)}, esc("prompt_token_ids[0] = (1, 2)")),
    ("prompt-float-array", {"prompt_token_ids": np.array([1.0, 2.0])}, "1-D integer array, got dtype float64"),
    ("prompt-2d-array", {"prompt_token_ids": np.zeros((2, 2), np.int64)}, esc("shape (2, 2)")),
    ("prompt-bytes", {"prompt_token_ids": b"\x01\x02"}, "prompt_token_ids must be a sequence"),
    (
        "prompt-longer-than-max-sequence-length",
        {"prompt_token_ids": (1, 2, 3), "max_sequence_length": 2},
        "holds 3 tokens, more than max_sequence_length=2",
    ),
]


@pytest.mark.parametrize(
    ("fields", "match"), [pytest.param(fields, match, id=case_id) for case_id, fields, match in BAD_REQUESTS]
)
def test_bad_allocation_request_field_raises_invalid_argument_error(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        AllocationRequest(**untyped({"request_id": "r", **fields}))
    assert type(caught.value) is InvalidArgumentError


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_bad_sliding_window_raises_invalid_config_error(window: object) -> None:
    with pytest.raises(InvalidConfigError, match=f"sliding_window must be an int >= 1, got {esc(repr(window))}"):
        dataclasses.replace(CONFIG, sliding_window=untyped(window))


@pytest.mark.parametrize("window", [0, True, 1.5])
def test_bad_page_table_window_raises(window: object) -> None:
    table = PageTable.from_block_tables([BlockTable(4, [1], 3)])
    with pytest.raises(InvalidArgumentError, match=f"sliding_window must be None or an int >= 1, got {window!r}"):
        dataclasses.replace(table, sliding_window=untyped(window))
    pool = np.zeros((4, 4, 1, 2), np.float32)
    with pytest.raises(InvalidArgumentError, match=f"got {window!r}"):
        paged_attention(np.zeros((1, 1, 2), np.float32), pool, pool, table, sliding_window=untyped(window))


TABLE_CASES: list[tuple[str, Callable[[BlockTable], object], str]] = [
    ("release-more-than-held", lambda t: t.release_leading(4), esc("[0, 3] (the held blocks), got 4")),
    ("release-negative", lambda t: t.release_leading(-1), "got -1"),
    ("release-past-the-sequence", lambda t: t.release_leading(3), "at or after the sequence length 10"),
    (
        "replace-released-block",
        lambda t: t.replace_block(0, 40),
        "logical block 0 is not held: valid held blocks are 1",
    ),
    ("replace-past-the-table", lambda t: t.replace_block(4, 40), "logical block 4 is not held"),
    ("replace-with-a-block-in-the-table", lambda t: t.replace_block(1, 9), "block 9 is already in this table"),
    ("replace-with-a-negative-block", lambda t: t.replace_block(1, -2), "-2"),
]


@pytest.mark.parametrize(("act", "match"), [pytest.param(act, match, id=cid) for cid, act, match in TABLE_CASES])
def test_bad_block_table_policy_call_raises_and_changes_nothing(
    act: Callable[[BlockTable], object], match: str
) -> None:
    table = BlockTable(4, [8, 9, 10, 11], 10)
    table.release_leading(1)
    before = table.to_dict()
    with pytest.raises(InvalidArgumentError, match=match):
        act(table)
    assert table.to_dict() == before
