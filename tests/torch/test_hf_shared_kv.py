"""kvcache_torch.hf on a model whose last layers reuse earlier layers' K/V (Gemma 3n's
``num_kv_shared_layers``): the pool holds the layers that store K/V only, and each reusing
layer attends over its source's, on both paths.

Every equality test runs a tiny random-weight Gemma 3n (4 layers, sliding and full, the
last two reusing the first two's K/V) with ``DynamicCache`` and with :class:`PagedCache`, and
compares the logits (fp32, max abs difference <= 1e-4).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvcache_core import UnsupportedConfigError, create_manager
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    COMMON_CONFIG,
    TOLERANCE,
    VOCAB,
    Model,
    PagedCache,
    cache_config_for,
    forward,
    generate,
    make_manager,
    max_logit_difference,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
    transformers,
)

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 6
PATHS = ("paged", "contiguous")

#: A tiny Gemma 3n text decoder: layers 2 and 3 reuse the K/V of layers 0 (sliding) and 1 (full).
GEMMA3N: dict[str, Any] = {
    **COMMON_CONFIG,
    "num_hidden_layers": 4,
    "head_dim": 16,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_kv_shared_layers": 2,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "laurel_rank": 4,
    "activation_sparsity_pattern": [0.0] * 4,
}

_MODELS: dict[str, tuple[Model, Model]] = {}


def pair_on(path: str) -> tuple[Model, Model]:
    """``(model under test, reference)``, the same weights: the reference runs ``sdpa``; on
    the paged path the model under test runs ``"kvcache_paged"``, else it is the reference."""
    if not _MODELS:
        torch.manual_seed(0)
        reference = transformers.Gemma3nForCausalLM(transformers.Gemma3nTextConfig(**GEMMA3N)).eval()
        reference.set_attn_implementation("sdpa")
        paged = copy.deepcopy(reference)
        paged.set_attn_implementation(ATTN_IMPLEMENTATION)
        _MODELS["gemma3n"] = (paged, reference)
    paged, reference = _MODELS["gemma3n"]
    return (paged if path == "paged" else reference), reference


def test_the_pool_holds_the_layers_that_store_k_v_only() -> None:
    model, _ = pair_on("paged")
    config = cache_config_for(model, num_blocks=8)
    assert config.num_layers == 2
    assert config.layer_specs is not None
    assert [spec.window for spec in config.layer_specs] == [WINDOW, None]
    with PagedCache(create_manager("torch", config), model.config) as cache:
        assert cache.is_dummy == [False, False, True, True]  # as in DynamicCache
        assert cache.is_sliding == transformers.DynamicCache(config=model.config).is_sliding


@pytest.mark.parametrize("path", PATHS)
def test_prefill_and_chunked_prefill_give_the_logits_of_dynamic_cache(path: str) -> None:
    model, reference = pair_on(path)
    ids, mask = prompts(2, 20, pads=(0, 3))
    real = mask.bool()
    for chunks in ([(0, 20)], [(0, 7), (7, 15), (15, 16), (16, 20)]):
        with PagedCache(make_manager(model), model.config) as cache:
            dynamic = transformers.DynamicCache(config=reference.config)
            for start, stop in chunks:
                ours = forward(model, ids[:, start:stop], mask, start, cache)
                expected = forward(reference, ids[:, start:stop], mask, start, dynamic)
                rows = real[:, start:stop]
                difference = float((ours[rows] - expected[rows]).abs().max())
                assert difference <= TOLERANCE, f"chunks {chunks}, at {start}:{stop}: {difference}"


@pytest.mark.parametrize("path", PATHS)
def test_greedy_generate_then_a_second_generate_give_the_logits_of_dynamic_cache(path: str) -> None:
    model, reference = pair_on(path)
    ids, mask = prompts(3, 14, pads=(0, 4, 1), seed=2)
    dynamic = transformers.DynamicCache(config=reference.config)
    with PagedCache(make_manager(model, num_blocks=160), model.config) as cache:
        first = generate(model, ids, mask, cache, max_new_tokens=20)
        expected_first = generate(reference, ids, mask, cache=dynamic, max_new_tokens=20)
        more, _ = prompts(3, 5, seed=4)
        next_ids = torch.cat([first.sequences, more], dim=1)
        next_mask = torch.cat([mask, torch.ones((3, next_ids.shape[1] - mask.shape[1]), dtype=mask.dtype)], dim=1)
        ours = generate(model, next_ids, next_mask, cache, max_new_tokens=8)
        expected = generate(reference, next_ids, next_mask, cache=dynamic, max_new_tokens=8)
    assert torch.equal(first.sequences, expected_first.sequences)
    assert max_logit_difference(first.logits, expected_first.logits) <= TOLERANCE
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


@pytest.mark.parametrize("path", PATHS)
def test_beam_search_gives_the_logits_of_dynamic_cache(path: str) -> None:
    model, reference = pair_on(path)
    manager = make_manager(model, num_blocks=160)
    ids, mask = prompts(2, 12, pads=(0, 3), seed=8)
    options: dict[str, Any] = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 8}
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache, **options)
        manager.check_invariants()
    expected = generate(reference, ids, mask, **options)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0


def test_shared_layers_this_transformers_does_not_describe_are_refused_by_name() -> None:
    config = transformers.LlamaConfig(**COMMON_CONFIG)
    config.num_kv_shared_layers = 1  # and no kv_sharing_modes
    with pytest.raises(UnsupportedConfigError, match="1 layers sharing other layers' K/V"):
        cache_config_for(config, num_blocks=8)
