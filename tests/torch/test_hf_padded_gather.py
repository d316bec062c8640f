"""The contiguous path's K/V read in one indexed read per pool (``kvcache_torch.hf.padded_gather``):
the same tensors, bit for bit, as the rows gathered one by one, on every layout and batch it
serves; the rows gathered one by one where it does not apply (HND, a quantized pool, a
sliding layer's last positions)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvcache_core import CacheConfig, create_manager
from kvcache_torch.hf import padded_gather
from tests.torch.hf_support import PagedCache, build_model, cache_config_for, generate, one_thread, prompts, torch

pytestmark = [pytest.mark.usefixtures(one_thread.__name__), pytest.mark.filterwarnings("error")]


def run(config: CacheConfig, ids: Any, mask: Any, *, one_read: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``generate`` on the contiguous path (sdpa) with a pool of ``config``, the one-read gather
    on or off; returns the output and how many layer reads it served."""
    served: list[int] = []
    real = padded_gather.PaddedGather.read

    def read(self: padded_gather.PaddedGather, *args: Any) -> Any:
        gathered = real(self, *args) if one_read else None
        served.extend([1] if gathered is not None else [])
        return gathered

    monkeypatch.setattr(padded_gather.PaddedGather, "read", read)
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    with PagedCache(create_manager("torch", config), model) as cache:
        output = generate(model, ids, mask, cache=cache, max_new_tokens=5)
    monkeypatch.undo()
    return output, len(served)


@pytest.mark.parametrize("layout", ["NHD", "heads_first"])
@pytest.mark.parametrize("pads", [(), (0, 5, 2)])
def test_one_read_equals_the_rows_gathered_one_by_one(
    layout: str, pads: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = dataclasses.replace(cache_config_for(build_model("llama"), num_blocks=64, block_size=4), kv_layout=layout)
    ids, mask = prompts(3, 9, pads)
    fast, served = run(config, ids, mask, one_read=True, monkeypatch=monkeypatch)
    slow, none = run(config, ids, mask, one_read=False, monkeypatch=monkeypatch)
    assert served == 4 * 2  # 4 forwards after the prompt's, 2 layers
    assert none == 0
    assert torch.equal(fast.sequences, slow.sequences)
    for ours, theirs in zip(fast.logits, slow.logits, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("change", [{"kv_layout": "HND"}, {"dtype": "int8", "compute_dtype": "float32"}])
def test_pools_it_cannot_read_in_one_go_are_gathered_row_by_row(
    change: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = dataclasses.replace(cache_config_for(build_model("llama"), num_blocks=64, block_size=4), **change)
    ids, mask = prompts(2, 7, (0, 3))
    _, served = run(config, ids, mask, one_read=True, monkeypatch=monkeypatch)
    assert served == 0
