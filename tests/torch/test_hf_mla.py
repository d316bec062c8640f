"""kvcache_torch.hf on models whose cached values differ in width from their keys: multi-head
latent attention (DeepSeek-V3, MiniCPM3: one head holding the compressed latent as keys and
the rotary part as values) and a model with a ``v_head_dim`` of its own (MiMo-V2-Flash).

Which path each runs (:data:`PATHS`): a latent-attention model expands the latent it reads
back into every head's K/V before calling transformers' attention interface, so its cache
serves the contiguous path (``sdpa``) and ``"kvcache_paged"`` is refused by name; MiMo-V2-Flash
hands its attention what the cache returned, so it runs the paged path. Every equality test
runs a tiny random-weight model (each built on its own config object) once with
``DynamicCache`` and the model's reference attention and once with :class:`PagedCache`, and
compares the fp32 logits (max abs difference <= 1e-4).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from kvcache_core import UnsupportedConfigError, create_manager
from tests.torch.hf_models import LATENT_MODELS
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    COMMON_CONFIG,
    TOLERANCE,
    PagedCache,
    cache_config_for,
    forward,
    generate,
    max_logit_difference,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
    transformers,
)

Model = Any

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = LATENT_MODELS

#: The path each model's PagedCache runs, as the module docstring explains.
PATHS = {name: entry[4] for name, entry in MODELS.items()}

ARCHITECTURES = sorted(MODELS)


def _config(architecture: str, **overrides: Any) -> Any:
    config_name, _, extra, _, _ = MODELS[architecture]
    fields = {**COMMON_CONFIG, "num_attention_heads": 4, "num_key_value_heads": 4, **extra, **overrides}
    return getattr(transformers, config_name)(**fields)


@pytest.fixture(scope="module")
def pairs() -> Iterator[dict[str, tuple[Model, Model]]]:
    """``(model on its PagedCache path, reference)`` per architecture, built on first use."""
    built: dict[str, tuple[Model, Model]] = {}
    yield built
    built.clear()


def fresh_pair(architecture: str) -> tuple[Model, Model]:
    """``(model on its PagedCache path, reference)``, built now: no cache has hooked them yet."""
    _, model_name, _, reference_attention, path = MODELS[architecture]
    torch.manual_seed(0)
    reference = getattr(transformers, model_name)(_config(architecture)).eval()
    reference.set_attn_implementation(reference_attention)
    tested = copy.deepcopy(reference)  # its own config object
    tested.set_attn_implementation(ATTN_IMPLEMENTATION if path == "paged" else reference_attention)
    return tested, reference


def pair(pairs: dict[str, tuple[Model, Model]], architecture: str) -> tuple[Model, Model]:
    if architecture not in pairs:
        pairs[architecture] = fresh_pair(architecture)
    return pairs[architecture]


def make_cache(model: Model, num_blocks: int = 96, *, given: str = "model") -> PagedCache:
    """A cache built with the model (its forward hook brings the padding mask: no padding is
    stored on either path) or with its config alone (the contiguous path then stores it)."""
    manager = create_manager("torch", cache_config_for(model, num_blocks=num_blocks, block_size=4))
    return PagedCache(manager, model if given == "model" else model.config)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_pool_holds_what_update_receives(pairs: dict[str, tuple[Model, Model]], architecture: str) -> None:
    model, _ = pair(pairs, architecture)
    config = cache_config_for(model, num_blocks=8)
    if MODELS[architecture][4] == "contiguous":  # the latent and the rotary part, one head
        assert (config.num_heads, config.head_dim, config.value_width) == (1, 32, 8)
    else:
        assert (config.num_heads, config.head_dim, config.value_width) == (4, 24, 16)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_an_unpadded_prefill_gives_the_logits_of_dynamic_cache(
    pairs: dict[str, tuple[Model, Model]], architecture: str
) -> None:
    model, reference = pair(pairs, architecture)
    ids, mask = prompts(1, 13)
    with make_cache(model) as cache:
        ours = forward(model, ids, mask, 0, cache)
        expected = forward(reference, ids, mask, 0, transformers.DynamicCache(config=reference.config))
    assert float((ours - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("given", ["model", "config"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_generate_of_a_left_padded_batch_gives_the_logits_of_dynamic_cache(
    pairs: dict[str, tuple[Model, Model]], architecture: str, given: str
) -> None:
    # A cache given the config alone of a model no cache hooked sees no mask on the contiguous path.
    model, reference = pair(pairs, architecture) if given == "model" else fresh_pair(architecture)
    ids, mask = prompts(3, 11, pads=(0, 4, 1), seed=2)
    with make_cache(model, given=given) as cache:
        ours = generate(model, ids, mask, cache, max_new_tokens=16)
        assert cache.batch_size == 3
        # The prompts and 15 new tokens (the last is never fed back); the padding columns too
        # where the contiguous path never saw the mask.
        stores_padding = given == "config" and PATHS[architecture] == "contiguous"
        assert cache.request_lengths() == [11 + 15 if stores_padding else 11 - pad + 15 for pad in (0, 4, 1)]
    expected = generate(reference, ids, mask, max_new_tokens=16)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert torch.equal(ours.sequences, expected.sequences)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_second_generate_on_the_same_cache_gives_the_logits_of_dynamic_cache(
    pairs: dict[str, tuple[Model, Model]], architecture: str
) -> None:
    model, reference = pair(pairs, architecture)
    ids, mask = prompts(2, 9, pads=(2, 0), seed=3)
    dynamic = transformers.DynamicCache(config=reference.config)
    with make_cache(model) as cache:
        first = generate(model, ids, mask, cache, max_new_tokens=5)
        expected_first = generate(reference, ids, mask, cache=dynamic, max_new_tokens=5)
        more, _ = prompts(2, 4, seed=4)
        next_ids = torch.cat([first.sequences, more], dim=1)
        next_mask = torch.cat([mask, torch.ones((2, next_ids.shape[1] - mask.shape[1]), dtype=mask.dtype)], dim=1)
        ours = generate(model, next_ids, next_mask, cache, max_new_tokens=5)
        expected = generate(reference, next_ids, next_mask, cache=dynamic, max_new_tokens=5)
    assert max_logit_difference(first.logits, expected_first.logits) <= TOLERANCE
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_beam_search_gives_the_logits_of_dynamic_cache(
    pairs: dict[str, tuple[Model, Model]], architecture: str
) -> None:
    model, reference = pair(pairs, architecture)
    ids, mask = prompts(2, 9, pads=(0, 3), seed=8)
    options: dict[str, Any] = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 6}
    with make_cache(model) as cache:
        ours = generate(model, ids, mask, cache, **options)
        manager = cache.manager
    expected = generate(reference, ids, mask, **options)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0


@pytest.mark.parametrize("architecture", ["deepseek_v3", "minicpm3"])
def test_latent_attention_on_the_paged_path_is_refused_by_name(architecture: str) -> None:
    config = _config(architecture)
    config._attn_implementation = ATTN_IMPLEMENTATION  # pyright: ignore[reportPrivateUsage]

    with pytest.raises(UnsupportedConfigError, match=r"multi-head latent attention.*attn_implementation='sdpa'"):
        cache_config_for(config, num_blocks=8)


def test_the_real_deepseek_v3_config_is_sized_for_its_latent() -> None:
    config = transformers.DeepseekV3Config()  # the defaults are DeepSeek-V3's: 128 heads, a 512 + 64 latent

    pool = cache_config_for(config, num_blocks=8, dtype="bfloat16")

    assert (pool.num_layers, pool.num_heads, pool.head_dim, pool.value_width) == (61, 1, 512, 64)
    assert pool.bytes_per_token == 61 * (512 + 64) * 2  # 128 expanded heads of 192 + 128 would be 71x this


def test_per_layer_head_sizes_give_each_layer_its_own() -> None:
    """Gemma 4's full-attention layers have a head size of their own (``per_layer_config``): the
    pool gives each layer its own (the equality tests: ``tests/torch/test_hf_layer_geometry.py``)."""
    config = transformers.Gemma4TextConfig(
        **{**COMMON_CONFIG, "num_hidden_layers": 6, "head_dim": 16}, global_head_dim=32
    )

    pool = cache_config_for(config, num_blocks=8)

    assert [pool.layer_geometry(layer).head_dim for layer in range(6)] == [16, 16, 16, 16, 16, 32]
    # The sliding layers keep their window's blocks, two side by side in a page of the full
    # layer's width: three sliding groups of one page and the full one (six unpacked).
    assert [len(group.layers) for group in pool.kv_groups] == [2, 2, 1, 1]
