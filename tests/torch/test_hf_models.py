"""Every family of the catalogue (:mod:`tests.torch.hf_models`) against ``DynamicCache`` on its
path, and the README's table of families by path, which is the catalogue's.

Each family runs one left-padded batch (prompts longer than the hybrid models' window) for
16 greedy tokens with :class:`PagedCache` (built with the model: no padding is stored, on
either path) and with ``DynamicCache`` on the same weights, and compares the logits (fp32, max
abs difference <= 1e-4). ``KVCACHE_WRITE_MODEL_TABLE=1``
rewrites the README's table instead of comparing it.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from tests.torch.hf_models import FAMILIES, TABLE_BEGIN, TABLE_END, Family, model_table
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    TOLERANCE,
    PagedCache,
    generate,
    make_manager,
    max_logit_difference,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
)

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("family", FAMILIES, ids=[family.name for family in FAMILIES])
def test_the_family_gives_the_logits_of_dynamic_cache_on_its_path(family: Family) -> None:
    reference = family.build()
    model = reference
    if family.path == "paged":
        model = copy.deepcopy(reference)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids, mask = prompts(2, 10, pads=(0, 3), seed=31)
    manager = make_manager(model, num_blocks=64)
    with PagedCache(
        manager, model, attention="model"
    ) as cache:  # the model: its hook brings the mask (contiguous path)
        ours = generate(model, ids, mask, cache, max_new_tokens=16)
        if family.path != "states":  # (a model of state layers alone keeps no tokens)
            assert cache.request_lengths() == [10 + 15, 7 + 15]  # no padding stored, on either path
    expected = generate(reference, ids, mask, max_new_tokens=16)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0


def test_the_readme_table_of_model_families_is_the_catalogues() -> None:
    text = README.read_text(encoding="utf-8")
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    assert 0 <= begin < end, f"README.md has no section between {TABLE_BEGIN!r} and {TABLE_END!r}"
    current = text[begin + len(TABLE_BEGIN) : end].strip()
    table = model_table()
    if os.environ.get("KVCACHE_WRITE_MODEL_TABLE") == "1":
        README.write_text(f"{text[: begin + len(TABLE_BEGIN)]}\n{table}\n{text[end:]}", encoding="utf-8")
        return
    assert current == table, "README.md's table of model families is stale: rerun with KVCACHE_WRITE_MODEL_TABLE=1"
