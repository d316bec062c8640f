"""kvcache_torch.hf on models whose layers differ in geometry: Gemma 4, whose full-attention
layers have a head size (``global_head_dim``) and, with ``attention_k_eq_v``, a KV head count
(``num_global_key_value_heads``) of their own (transformers' ``per_layer_config``); and
MiMo-V2-Flash, whose sliding layers hold twice its full layers' KV heads.

The pool gives each layer its own shape (``LayerSpec(num_heads=..., head_dim=...)``); its
sliding layers form KV-cache groups keeping only their window's blocks, a sliding and a full
layer at each place of the groups viewing one page (``CacheConfig.storage_layers``).
Both paths serve it (Gemma 4's attention goes through transformers' interface), except that a
Gemma 4 with layers reusing K/V runs the contiguous path only: it slices a prefill's queries
before those layers, and ``"kvcache_paged"`` is refused by name (:data:`RUNS`). Every equality
test runs a tiny random-weight model (:data:`VARIANTS`) with ``DynamicCache`` and with
:class:`PagedCache`, and compares the fp32 logits (max abs difference <= 1e-4).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from kvcache_core import AllocationRequest, CacheConfig, OutOfBlocksError, UnsupportedConfigError, create_manager
from kvcache_core.contract.groups import LayerGeometry
from tests.torch.hf_models import GEMMA4
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    COMMON_CONFIG,
    TOLERANCE,
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

PATHS = ("paged", "contiguous")

#: The tiny models, ``(config class, model class, fields, reference attention)``: the
#: catalogue's Gemma 4; one whose last two layers reuse the first two's K/V
#: (``num_kv_shared_layers``, as Gemma 4 E2B), values of their own projection; and MiMo-V2-Flash,
#: whose sliding layers hold twice its full layers' KV heads (in its code, not its config), values
#: narrower than keys.
VARIANTS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4, "sdpa"),
    "gemma4-shared": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {**GEMMA4, "attention_k_eq_v": False, "num_kv_shared_layers": 2},
        "sdpa",
    ),
    "mimo-v2-flash": (
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        {
            **COMMON_CONFIG,
            "head_dim": 24,
            "v_head_dim": 16,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        "eager",
    ),
}

#: ``(variant, path)`` of every equality test (MiMo-V2-Flash has no sdpa: the paged path).
RUNS = [
    ("gemma4", "paged"),
    ("gemma4", "contiguous"),
    ("gemma4-shared", "contiguous"),
    ("mimo-v2-flash", "paged"),
]

_MODELS: dict[str, tuple[Any, Any]] = {}


def pair(variant: str, path: str) -> tuple[Any, Any]:
    """``(model under test, reference)``, the same weights: the reference runs the model's
    own attention; on the paged path the model under test runs ``"kvcache_paged"``, else it is
    the reference."""
    if variant not in _MODELS:
        config_class, model_class, fields, attention = VARIANTS[variant]
        torch.manual_seed(0)
        reference = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
        reference.set_attn_implementation(attention)
        paged = copy.deepcopy(reference)
        paged.set_attn_implementation(ATTN_IMPLEMENTATION)
        _MODELS[variant] = (paged, reference)
    paged, reference = _MODELS[variant]
    return (paged if path == "paged" else reference), reference


def test_the_pool_gives_each_layer_the_geometry_its_attention_hands_the_cache() -> None:
    model, _ = pair("gemma4", "paged")

    pool = cache_config_for(model, num_blocks=8)

    sliding, full = LayerGeometry(2, 16, 16), LayerGeometry(1, 32, 32)
    assert [pool.layer_geometry(layer) for layer in range(4)] == [sliding, full] * 2
    assert pool.num_groups == 2  # the sliding layers keep their window's blocks
    assert [group.window for group in pool.kv_groups] == [6, None]
    # One page of 2 heads of 32: the sliding layers side by side along its features, the full
    # layers along its heads (a page a layer, two pages a group, before).
    assert pool.storage_layers.page_geometry == (LayerGeometry(2, 32, 32),)
    assert pool.storage_layers.packs_views
    assert pool.bytes_per_token == 2 * (2 * 32 * 2) * 4
    with PagedCache(create_manager("torch", pool), model.config) as cache:
        assert cache.is_sliding == transformers.DynamicCache(config=model.config).is_sliding


def test_max_tokens_gives_each_kv_cache_group_its_blocks_of_a_request_written_in_one_step() -> None:
    model, _ = pair("gemma4", "paged")

    pool = cache_config_for(model, max_tokens=40, block_size=4)
    one_group = cache_config_for(model, max_tokens=40, block_size=4, hybrid=False)

    assert (pool.num_groups, pool.num_blocks) == (2, 2 * 10)
    assert (one_group.num_groups, one_group.num_blocks) == (1, 10)
    for sized in (pool, one_group):
        with create_manager("numpy", sized) as manager:
            manager.extend(manager.allocate(AllocationRequest("r")), 40)  # a prompt of 40 in one step
    with create_manager("numpy", dataclasses.replace(pool, num_blocks=10)) as manager, pytest.raises(OutOfBlocksError):
        manager.extend(manager.allocate(AllocationRequest("r")), 40)  # one block per 4 tokens: the groups lack


def test_sliding_layers_of_twice_the_kv_heads_get_their_own_and_values_the_pools_width() -> None:
    model, _ = pair("mimo-v2-flash", "paged")

    pool = cache_config_for(model, num_blocks=8)

    assert [pool.layer_geometry(layer) for layer in range(2)] == [LayerGeometry(4, 24, 16), LayerGeometry(2, 24, 16)]


def test_the_layers_reusing_k_v_keep_nothing_and_the_others_their_own_geometry() -> None:
    model, _ = pair("gemma4-shared", "contiguous")

    pool = cache_config_for(model, num_blocks=8)

    assert pool.num_layers == 2
    assert [pool.layer_geometry(layer) for layer in range(2)] == [LayerGeometry(2, 16, 16), LayerGeometry(2, 32, 32)]


@pytest.mark.parametrize(("variant", "path"), RUNS)
def test_prefill_and_chunked_prefill_give_the_logits_of_dynamic_cache(variant: str, path: str) -> None:
    model, reference = pair(variant, path)
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


@pytest.mark.parametrize(("variant", "path"), RUNS)
def test_an_unpadded_prompt_gives_the_logits_of_dynamic_cache(variant: str, path: str) -> None:
    model, reference = pair(variant, path)
    ids, mask = prompts(1, 13)
    with PagedCache(make_manager(model), model.config) as cache:
        ours = forward(model, ids, mask, 0, cache)
    expected = forward(reference, ids, mask, 0, transformers.DynamicCache(config=reference.config))
    assert float((ours - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize(("variant", "path"), RUNS)
def test_greedy_generate_then_a_second_generate_give_the_logits_of_dynamic_cache(variant: str, path: str) -> None:
    model, reference = pair(variant, path)
    ids, mask = prompts(3, 14, pads=(0, 4, 1), seed=2)
    dynamic = transformers.DynamicCache(config=reference.config)
    manager = make_manager(model, num_blocks=160)
    with PagedCache(manager, model.config) as cache:
        first = generate(model, ids, mask, cache, max_new_tokens=20)
        expected_first = generate(reference, ids, mask, cache=dynamic, max_new_tokens=20)
        more, _ = prompts(3, 5, seed=4)
        next_ids = torch.cat([first.sequences, more], dim=1)
        next_mask = torch.cat([mask, torch.ones((3, next_ids.shape[1] - mask.shape[1]), dtype=mask.dtype)], dim=1)
        ours = generate(model, next_ids, next_mask, cache, max_new_tokens=8)
        expected = generate(reference, next_ids, next_mask, cache=dynamic, max_new_tokens=8)
        manager.check_invariants()
    assert torch.equal(first.sequences, expected_first.sequences)
    assert max_logit_difference(first.logits, expected_first.logits) <= TOLERANCE
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0


@pytest.mark.parametrize("path", PATHS)
def test_beam_search_gives_the_logits_of_dynamic_cache(path: str) -> None:
    model, reference = pair("gemma4", path)
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


def test_the_paged_path_of_a_gemma4_with_layers_reusing_k_v_is_refused_by_name() -> None:
    model, _ = pair("gemma4-shared", "paged")
    pool = cache_config_for(pair("gemma4-shared", "contiguous")[0], num_blocks=8)  # sdpa: accepted

    with pytest.raises(UnsupportedConfigError, match=r"Gemma4Text runs its 2 layers reusing K/V.*'sdpa'"):
        cache_config_for(model, num_blocks=8)
    with pytest.raises(UnsupportedConfigError, match=r"Gemma4Text runs its 2 layers reusing K/V.*'sdpa'"):
        PagedCache(create_manager("torch", pool), model.config)


def test_a_pool_of_one_geometry_is_refused_by_name() -> None:
    model, _ = pair("gemma4", "paged")
    plain = CacheConfig(num_layers=4, num_heads=2, head_dim=16, num_blocks=8, block_size=4)

    with pytest.raises(
        UnsupportedConfigError,
        match=r"layer 1 of the model has 1 KV heads of size 32 \(values 32\), of the pool 2 heads of size 16",
    ):
        PagedCache(create_manager("torch", plain), model.config)


def test_a_quantized_pool_of_per_layer_geometry_is_refused_by_name() -> None:
    model, _ = pair("gemma4", "paged")

    with pytest.raises(UnsupportedConfigError, match="a int8 pool holds one geometry for every layer"):
        cache_config_for(model, num_blocks=8, dtype="int8")


def test_the_real_gemma4_config_gives_its_full_layers_their_head_size() -> None:
    config = transformers.Gemma4TextConfig(**{**COMMON_CONFIG, "num_hidden_layers": 6, "head_dim": 16})

    pool = cache_config_for(config, num_blocks=8, dtype="bfloat16")

    assert [pool.layer_geometry(layer).head_dim for layer in range(6)] == [16] * 5 + [512]  # global_head_dim
    # The five sliding layers side by side in one page of the full layer's width (32 would fit):
    # two groups of one page (six before, a page each).
    assert [len(group.layers) for group in pool.kv_groups] == [5, 1]
    assert pool.bytes_per_block == 16 * 2 * (512 + 512) * 2  # 16 tokens of 2 heads of 512 (keys, values), bf16
