"""torch's paged attention refuses scalars no backend represents and non-finite sinks by
name, and takes NumPy scalars and the largest int32 window like Python's."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from kvcache_core.contract.page_table import PageTable
from kvcache_core.errors import InvalidArgumentError
from kvcache_torch import paged_attention
from tests.attention_values_support import LARGEST_INT32_WINDOWS, refused_values

# One request of 5 tokens in blocks 0 and 1 of an NHD pool [4 blocks, 4 tokens, 2 heads, 8].
KEYS = torch.tensor(np.random.default_rng(5).standard_normal((4, 4, 2, 8)), dtype=torch.float32)
QUERY = torch.tensor(np.random.default_rng(6).standard_normal((1, 4, 8)), dtype=torch.float32)
TABLE = PageTable(
    kv_indptr=np.array([0, 2]),
    kv_indices=np.array([0, 1]),
    kv_last_page_len=np.array([1]),
    block_tables=np.array([[0, 1]]),
    seq_lens=np.array([5]),
    block_size=4,
)


def attend(**arguments: Any) -> torch.Tensor:
    return paged_attention(QUERY, KEYS, KEYS, TABLE, **arguments)


@pytest.mark.parametrize(("arguments", "message"), refused_values(torch.tensor))
def test_a_value_no_backend_represents_is_refused_by_name(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        attend(**arguments)


def test_the_largest_int32_windows_attend_like_none() -> None:
    plain = attend()
    for arguments in LARGEST_INT32_WINDOWS:
        torch.testing.assert_close(attend(**arguments), plain, rtol=0, atol=0, msg=str(arguments))


def test_numpy_scalars_attend_like_python_ones() -> None:
    got = attend(window=np.int64(3), softcap=np.float32(2.0), scale=np.float64(0.5))
    torch.testing.assert_close(got, attend(window=3, softcap=2.0, scale=0.5), rtol=0, atol=0)
