"""kvcache_torch.hf on hybrid-attention models: sliding-window layers (some or all),
chunked local attention (Llama 4), logit softcapping (Gemma 2) and attention sinks (gpt-oss),
on both paths, over pools of KV-cache groups (sliding layers keep their window's blocks).

Every equality test runs a tiny random-weight model twice, once with ``DynamicCache`` and
the model's own reference attention (``eager`` for Gemma 2, Gemma 3 and gpt-oss, ``sdpa``
for the others) and once with :class:`PagedCache`, with prompts longer than the window, and
compares the logits (fp32, max abs difference <= 1e-4). ``paged``: the model runs
``"kvcache_paged"``; ``contiguous``: its reference attention, to which the cache returns
what ``DynamicCache`` returns (a sliding layer's window).
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial
from typing import Any

import pytest

from kvcache_core import UnsupportedConfigError, create_manager
from tests.torch import hf_support
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    COMMON_CONFIG,
    TOLERANCE,
    PagedCache,
    cache_config_for,
    forward,
    generate,
    max_logit_difference,
    prompts,
    torch,
    transformers,
)

Model = Any
Tensor = Any

#: The sliding window of every model: prompts of 20 tokens outgrow it.
WINDOW = 6

#: ``(config class, model class, config fields, reference attention)``.
HYBRID: dict[str, tuple[str, str, dict[str, Any], str]] = {
    # Alternating sliding / full layers; softcap 1.0 so that capping changes the scores.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "attn_logit_softcapping": 1.0, "final_logit_softcapping": None},
        "eager",
    ),
    # Alternating sliding / full layers, a sink per query head, mixture of experts.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        "eager",
    ),
    # Alternating sliding / full layers (set here: the default pattern is 5 sliding to 1 full).
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"] * 2},
        "eager",
    ),
    # Three sliding layers, then one full.
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {}, "sdpa"),
    # Every layer slides (no layer_types).
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, "sdpa"),
    # Layer 0 full, the others sliding.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}, "sdpa"),
    # Three chunked layers (chunks of WINDOW positions), then one full; mixture of experts.
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            "head_dim": 16,
            "intermediate_size_mlp": 96,
            "attention_chunk_size": WINDOW,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
        },
        "sdpa",
    ),
}

_MODELS: dict[str, tuple[Model, Model]] = {}


def hybrid_pair(architecture: str) -> tuple[Model, Model]:
    """``(paged model, reference model)`` with the same weights."""
    if architecture not in _MODELS:
        config_name, model_name, extra, reference_attention = HYBRID[architecture]
        torch.manual_seed(0)
        fields = {**COMMON_CONFIG, "num_hidden_layers": 4, "sliding_window": WINDOW, **extra}
        config = getattr(transformers, config_name)(**fields)
        reference = getattr(transformers, model_name)(config).eval()
        with torch.no_grad():  # the sinks start at zero: make them matter
            for module in reference.modules():
                sinks: Any = getattr(module, "sinks", None)
                if isinstance(sinks, torch.nn.Parameter):
                    sinks.normal_(0.0, 1.0)
        reference.set_attn_implementation(reference_attention)
        tested = copy.deepcopy(reference)
        tested.set_attn_implementation(ATTN_IMPLEMENTATION)
        _MODELS[architecture] = (tested, reference)
    return _MODELS[architecture]


make_manager = partial(hf_support.make_manager, num_blocks=160, hybrid=True)

PATHS = ("paged", "contiguous")


def pair_on(architecture: str, path: str) -> tuple[Model, Model]:
    """``(model under test, reference)`` for ``path``: on the contiguous path the model under
    test is the reference model itself (its own attention), with a PagedCache."""
    tested, reference = hybrid_pair(architecture)
    return (tested if path == "paged" else reference), reference


def window_released_blocks(cache: PagedCache) -> bool:
    """Whether a sliding group of some row released leading blocks (the pool is grouped)."""
    return any(table.first_logical for handle in cache.handles for table in handle.block_tables())


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """These models are tiny: one thread is faster than two fighting over a busy CI core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ARCHITECTURES = sorted(HYBRID)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prefill_and_chunked_prefill_past_the_window_give_the_logits_of_dynamic_cache(
    architecture: str, path: str
) -> None:
    model, reference = pair_on(architecture, path)
    ids, mask = prompts(2, 20, pads=(0, 3))
    real = mask.bool()
    for chunks in ([(0, 20)], [(0, 7), (7, 15), (15, 16), (16, 20)]):
        with PagedCache(make_manager(model), model.config) as cache:
            dynamic = transformers.DynamicCache(config=reference.config)
            for start, stop in chunks:
                ours = forward(model, ids[:, start:stop], mask, start, cache)
                expected = forward(reference, ids[:, start:stop], mask, start, dynamic)
                rows = real[:, start:stop]  # logits at padding positions are meaningless in both
                difference = float((ours[rows] - expected[rows]).abs().max())
                assert difference <= TOLERANCE, f"chunks {chunks}, at {start}:{stop}: {difference}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_generate_of_a_left_padded_batch_gives_the_tokens_and_scores_of_dynamic_cache(
    architecture: str, path: str
) -> None:
    model, reference = pair_on(architecture, path)
    ids, mask = prompts(3, 14, pads=(0, 4, 1), seed=2)
    options: dict[str, Any] = {"max_new_tokens": 24, "output_scores": True}
    with PagedCache(make_manager(model), model.config) as cache:
        ours = generate(model, ids, mask, cache, **options)
        if path == "paged":
            assert cache.request_lengths() == [14 + 23, 10 + 23, 13 + 23]  # padding is never stored
        else:
            assert cache.request_lengths() == [14 + 23] * 3  # every position, as DynamicCache counts
        assert window_released_blocks(cache) == (architecture != "llama4")  # chunked layers keep every block
    expected = generate(reference, ids, mask, **options)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert max_logit_difference(ours.scores, expected.scores) <= TOLERANCE
    assert torch.equal(ours.sequences, expected.sequences)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_second_generate_on_the_same_cache_gives_the_logits_of_dynamic_cache(architecture: str, path: str) -> None:
    model, reference = pair_on(architecture, path)
    ids, mask = prompts(2, 12, pads=(2, 0), seed=3)
    dynamic = transformers.DynamicCache(config=reference.config)
    with PagedCache(make_manager(model), model.config) as cache:
        first = generate(model, ids, mask, cache, max_new_tokens=8)
        expected_first = generate(reference, ids, mask, cache=dynamic, max_new_tokens=8)
        assert torch.equal(first.sequences, expected_first.sequences)
        more, _ = prompts(2, 5, seed=4)
        next_ids = torch.cat([first.sequences, more], dim=1)
        next_mask = torch.cat([mask, torch.ones((2, next_ids.shape[1] - mask.shape[1]), dtype=mask.dtype)], dim=1)
        ours = generate(model, next_ids, next_mask, cache, max_new_tokens=8)
        expected = generate(reference, next_ids, next_mask, cache=dynamic, max_new_tokens=8)
    assert max_logit_difference(first.logits, expected_first.logits) <= TOLERANCE
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert torch.equal(ours.sequences, expected.sequences)


@pytest.mark.parametrize(("architecture", "field"), [("mistral", "sliding_window"), ("llama4", "attention_chunk_size")])
def test_the_window_or_chunk_changes_the_logits(architecture: str, field: str) -> None:
    """The test models' windows and chunks matter: attending past them gives other logits."""
    model, _ = hybrid_pair(architecture)
    unwindowed = copy.deepcopy(model)
    setattr(unwindowed.config, field, 4096 if field == "attention_chunk_size" else None)
    ids, mask = prompts(1, 20)
    with PagedCache(make_manager(model), model.config) as cache:
        windowed_logits = forward(model, ids, mask, 0, cache)
    with PagedCache(make_manager(unwindowed), unwindowed.config) as cache:
        full_logits = forward(unwindowed, ids, mask, 0, cache)
    assert float((windowed_logits - full_logits).abs().max()) > 1e-2


@pytest.mark.parametrize("layer_type", ["linear_attention", "mamba"])
def test_layers_that_are_not_attention_are_refused_by_name(layer_type: str) -> None:
    config = transformers.Qwen2Config(**{**COMMON_CONFIG, "layer_types": ["full_attention", "full_attention"]})
    config.layer_types = ["full_attention", layer_type]
    with pytest.raises(UnsupportedConfigError, match=repr(layer_type)):
        cache_config_for(config, num_blocks=8)
    manager = create_manager("torch", cache_config_for(transformers.Qwen2Config(**COMMON_CONFIG), num_blocks=8))
    with pytest.raises(UnsupportedConfigError, match=repr(layer_type)):
        PagedCache(manager, config)


def test_kvcache_paged_attention_without_a_paged_cache_applies_the_window() -> None:
    """With a DynamicCache the attention gets contiguous K/V: the window goes into the mask."""
    model, reference = hybrid_pair("mistral")
    ids, mask = prompts(2, 20, pads=(0, 3), seed=5)
    ours = generate(model, ids, mask, max_new_tokens=6)  # DynamicCache, kvcache_paged attention
    expected = generate(reference, ids, mask, max_new_tokens=6)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


def test_kvcache_paged_attention_without_a_paged_cache_refuses_sinks() -> None:
    model, _ = hybrid_pair("gpt_oss")
    ids, mask = prompts(1, 8)
    with pytest.raises(UnsupportedConfigError, match="sinks"):
        generate(model, ids, mask, max_new_tokens=2)


# -- memory: KV-cache groups --------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["gemma2", "gpt_oss", "cohere2", "qwen2"])
def test_a_long_request_holds_a_window_of_blocks_per_sliding_group_and_all_in_full_ones(architecture: str) -> None:
    model, reference = hybrid_pair(architecture)
    block_size = 4
    manager = make_manager(model, block_size=block_size)
    config = manager.config
    assert {group.window for group in config.kv_groups} == {None, WINDOW}, f"{architecture}: {config.kv_groups}"
    assert manager.storage.config.num_layers == len(config.kv_groups[0].layers) < config.num_layers
    ids, mask = prompts(1, 40, seed=5)
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache, max_new_tokens=24)
        (handle,) = cache.handles
        tokens = handle.num_tokens()
        assert tokens == 40 + 23
        for group, table in zip(config.kv_groups, handle.block_tables(), strict=True):
            if group.window is None:
                assert table.num_blocks() == -(-tokens // block_size), f"full group {group.index}: {table}"
            else:
                # At most ceil(W / bs) + 1 blocks, and every position the next token's window sees.
                assert table.num_blocks() <= -(-group.window // block_size) + 1, f"sliding group {group.index}: {table}"
                assert table.first_logical * block_size <= tokens - group.window + 1, f"group {group.index}: {table}"
        hybrid_blocks = manager.stats().used_blocks
    expected = generate(reference, ids, mask, max_new_tokens=24)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    every_block = create_manager("torch", cache_config_for(model, num_blocks=160, block_size=block_size, hybrid=False))
    with PagedCache(every_block, model.config) as cache:
        generate(model, ids, mask, cache, max_new_tokens=24)
        # Bytes: a block of a grouped pool holds one group's layers.
        grouped_bytes = hybrid_blocks * config.bytes_per_block
        plain_bytes = every_block.stats().used_blocks * every_block.config.bytes_per_block
    assert grouped_bytes < plain_bytes, f"{architecture}: {grouped_bytes} bytes with groups, {plain_bytes} without"


def test_cache_config_for_names_each_layers_spec() -> None:
    model, _ = hybrid_pair("gemma2")
    config = cache_config_for(model, num_blocks=8)
    assert config.layer_specs is not None
    assert [spec.window for spec in config.layer_specs] == [WINDOW, None, WINDOW, None]
    assert cache_config_for(model, num_blocks=8, hybrid=False).layer_specs is None
    llama4, _ = hybrid_pair("llama4")
    chunked = cache_config_for(llama4, num_blocks=8)
    assert chunked.layer_specs is not None
    assert [spec.chunk for spec in chunked.layer_specs] == [WINDOW, WINDOW, WINDOW, None]
    assert chunked.num_groups == 1  # chunked layers keep every block, as full ones do


def test_a_pool_that_keeps_less_than_a_layer_needs_is_refused() -> None:
    model, _ = hybrid_pair("gemma2")
    narrow = cache_config_for(model, num_blocks=64, hybrid=False)
    windowed = create_manager("torch", dataclasses.replace(narrow, sliding_window=WINDOW))
    with pytest.raises(UnsupportedConfigError, match="keeps only the last 6 positions of layer 1"):
        PagedCache(windowed, model.config)


@pytest.mark.parametrize("architecture", ["gemma2", "llama4"])
def test_the_contiguous_path_sizes_each_layers_mask_as_dynamic_cache(architecture: str) -> None:
    _, reference = hybrid_pair(architecture)  # its own attention: the contiguous path
    ids, mask = prompts(1, 20)
    with PagedCache(make_manager(reference), reference.config) as cache:
        dynamic = transformers.DynamicCache(config=reference.config)
        forward(reference, ids[:, :15], mask, 0, cache)
        forward(reference, ids[:, :15], mask, 0, dynamic)
        assert cache.is_sliding == dynamic.is_sliding
        for layer in range(reference.config.num_hidden_layers):
            for new_tokens in (1, 5):
                assert cache.get_mask_sizes(new_tokens, layer) == dynamic.get_mask_sizes(new_tokens, layer)
                assert cache.get_seq_length(layer) == dynamic.get_seq_length(layer) == 15


def test_the_paged_path_masks_every_position_of_every_layer() -> None:
    model, _ = hybrid_pair("gemma2")
    ids, mask = prompts(1, 15)
    with PagedCache(make_manager(model), model.config) as cache:
        forward(model, ids, mask, 0, cache)
        assert [cache.get_mask_sizes(1, layer) for layer in range(4)] == [(16, 0)] * 4


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("architecture", ["gemma2", "gpt_oss"])
def test_beam_search_past_the_window_reorders_every_group_to_the_logits_of_dynamic_cache(
    architecture: str, path: str
) -> None:
    model, reference = pair_on(architecture, path)
    manager = make_manager(model)
    ids, mask = prompts(2, 14, pads=(0, 3), seed=8)
    options: dict[str, Any] = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 8, "output_scores": True}
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache, **options)
        assert cache.batch_size == 6
        for handle in cache.handles:
            assert any(table.first_logical for table in handle.block_tables()), "no sliding group released a block"
        manager.check_invariants()
    expected = generate(reference, ids, mask, **options)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0


@pytest.mark.parametrize("path", PATHS)
def test_crop_after_the_window_passed_keeps_the_logits_of_dynamic_cache(path: str) -> None:
    model, reference = pair_on("cohere2", path)
    ids, mask = prompts(1, 20, seed=9)
    with PagedCache(make_manager(model), model.config) as cache:
        dynamic = transformers.DynamicCache(config=reference.config)
        dynamic.activate_past_recording()  # its sliding layers keep what a crop needs
        forward(model, ids[:, :18], mask, 0, cache)
        forward(reference, ids[:, :18], mask, 0, dynamic)
        forward(model, ids[:, 18:20], mask, 18, cache)  # two tokens, then taken back (a rejected draft)
        cache.crop(18)
        assert cache.request_lengths() == [18]
        ours = forward(model, ids[:, 18:20], mask, 18, cache)
        expected = forward(reference, ids[:, 18:20], mask, 18, dynamic)
    assert float((ours - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("architecture", ["qwen2", "gemma3"])
def test_assisted_generation_past_the_window_crops_to_the_logits_of_dynamic_cache(architecture: str, path: str) -> None:
    model, reference = pair_on(architecture, path)
    config_name, model_name, extra, _ = HYBRID[architecture]
    torch.manual_seed(1)  # other weights: most drafts are rejected and cropped
    fields = {**COMMON_CONFIG, "num_hidden_layers": 2, "sliding_window": WINDOW, **extra}
    fields.pop("layer_types", None)
    assistant = getattr(transformers, model_name)(getattr(transformers, config_name)(**fields)).eval()
    assistant.set_attn_implementation("sdpa")
    ids, mask = prompts(1, 10, seed=14)
    manager = make_manager(model)
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache, assistant_model=assistant, max_new_tokens=12)
    expected = generate(reference, ids, mask, max_new_tokens=12)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0
