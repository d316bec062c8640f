"""Disaggregated prefill and decode with transformers, two real processes on 127.0.0.1: the
example ``examples/disaggregated.py`` prefills a prompt in one process and decodes it in
another from the imported request; its tokens and logits equal a single-process ``generate``
and its decode worker computes no prompt token. For a Llama and for a Bamba hybrid (Mamba2
state layers beside attention: the request's recurrent states travel with its blocks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.process_support import run_python
from tests.transfer.support import ROOT, needs_transfer

pytestmark = [needs_transfer, pytest.mark.xdist_group("transfer")]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EXAMPLE = ROOT / "examples" / "disaggregated.py"
TOLERANCE = 1e-4


def example_module() -> Any:
    """The example as a module (its checkpoint, prompt and settings)."""
    spec = importlib.util.spec_from_file_location("disaggregated_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_process_run(example: Any, folder: Path, implementation: str) -> tuple[Any, Any]:
    """Greedy tokens and logits of one ``generate`` of the example's prompt in this process:
    on a ``PagedCache`` (``"kvcache_paged"``) or on transformers' own ``DynamicCache`` (``"sdpa"``)."""
    from kvcache_torch.hf import PagedCache

    model, manager = example.load_worker(str(folder))
    model.set_attn_implementation(implementation)
    prompt = torch.tensor([example.PROMPT])
    settings = example.generate_settings(example.NEW_TOKENS)
    with manager, torch.no_grad():
        if implementation == "sdpa":
            out = model.generate(prompt, **settings)
        else:
            with PagedCache(manager, model) as cache:
                out = model.generate(prompt, cache=cache, **settings)
    return out.sequences[0].numpy(), np.stack([logits[0].numpy() for logits in out.logits])


@pytest.mark.parametrize("family", ["llama", "bamba"])
def test_a_request_prefilled_in_one_process_decodes_in_another_as_in_one(tmp_path: Path, family: str) -> None:
    saved = tmp_path / "handoff.npz"
    result = run_python(str(EXAMPLE), "--family", family, "--save", str(saved), cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "skipped" not in result.stdout
    example = example_module()
    with np.load(saved) as data:
        handed_off = {name: data[name] for name in data.files}
    assert int(handed_off["imported"]) == example.PROMPT_LENGTH
    assert handed_off["computed"].tolist() == [1] * (example.NEW_TOKENS - 1)  # no prompt token recomputed
    assert handed_off["logits"].shape[0] == example.NEW_TOKENS >= 16

    folder = tmp_path / "checkpoint"
    example.save_tiny_model(str(folder), family)  # seeded: the checkpoint both workers loaded
    for implementation in ("kvcache_paged", "sdpa"):
        tokens, logits = single_process_run(example, folder, implementation)
        assert handed_off["tokens"].tolist() == tokens.tolist(), implementation
        assert float(np.abs(handed_off["logits"] - logits).max()) <= TOLERANCE, implementation
