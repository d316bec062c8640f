"""State-space and linear-attention hybrids through PagedCache: their recurrent states live in
the pool's state slots, their attention layers' K/V in its blocks, and every run matches
transformers' DynamicCache on the same weights.

Paths: ``paged`` runs the attention layers with ``attn_implementation="kvcache_paged"``,
``contiguous`` with ``sdpa`` (whole K/V read back); ``states`` is a model without attention
layers (Mamba2), where only the state slots serve it. Falcon-H1's and Zamba2's hybrid layers
keep K/V and a state each; Nemotron-H's MLP and mixture-of-experts layers keep nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from kvcache_core import UnsupportedConfigError, create_manager
from kvcache_core.errors import OutOfStateSlotsError, StateRollbackError
from tests.torch.hf_models import STATE_ATTENTION as ATTENTION
from tests.torch.hf_models import STATE_COMMON as COMMON
from tests.torch.hf_models import STATE_MODELS
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    TOLERANCE,
    PagedCache,
    cache_config_for,
    generate,
    max_logit_difference,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
    transformers,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = STATE_MODELS
PATHS = ("paged", "contiguous")

CASES = [(family, path) for family, (_, _, _, paths) in FAMILIES.items() for path in paths]

Models = tuple[Any, Any]  # (model under test, reference with DynamicCache)
_BUILT: dict[str, Models] = {}


def build(family: str) -> Models:
    """The family's tiny model and an identical reference (built once per module)."""
    if family not in _BUILT:
        config_name, model_name, fields, _ = FAMILIES[family]
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**{**COMMON, **fields})
        reference = getattr(transformers, model_name)(config).eval()
        _BUILT[family] = (copy.deepcopy(reference), reference)
    return _BUILT[family]


def model_under_test(family: str, path: str) -> Any:
    model, _ = build(family)
    if path == "paged":
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    elif path == "contiguous":
        model.set_attn_implementation("sdpa")
    return model


def paged_cache(model: Any, slots: int = 4) -> PagedCache:
    """A PagedCache over a fresh pool for ``model`` (hybrid where its path is paged)."""
    paged = model.config._attn_implementation == ATTN_IMPLEMENTATION
    config = cache_config_for(model, num_blocks=64, block_size=4, hybrid=paged, state_slots=slots)
    return PagedCache(create_manager("torch", config), model.config)


@pytest.fixture(scope="module", autouse=True)
def _release_models() -> Iterator[None]:
    """The models are built once for the module and dropped after it."""
    yield
    _BUILT.clear()


@pytest.mark.parametrize(("family", "path"), CASES)
def test_a_left_padded_batch_and_a_second_generate_match_dynamic_cache(family: str, path: str) -> None:
    model = model_under_test(family, path)
    reference = build(family)[1]
    ids, mask = prompts(2, 11, pads=(0, 3))
    expected = generate(reference, ids, mask, max_new_tokens=16)
    cache = paged_cache(model)
    first = generate(model, ids, mask, cache, max_new_tokens=16)
    assert max_logit_difference(first.logits, expected.logits) < TOLERANCE
    assert torch.equal(first.sequences, expected.sequences)
    cache.release()
    second = generate(model, ids, mask, cache, max_new_tokens=16)
    assert max_logit_difference(second.logits, expected.logits) < TOLERANCE
    stats = cache.manager.stats()
    assert stats.used_state_slots == 2, "one state slot per row of the batch"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_unpadded_prefill_matches_dynamic_cache(family: str) -> None:
    path = FAMILIES[family][3][0]
    model = model_under_test(family, path)
    reference = build(family)[1]
    ids, mask = prompts(1, 9, seed=4)
    expected = generate(reference, ids, mask, max_new_tokens=2)
    ours = generate(model, ids, mask, paged_cache(model), max_new_tokens=2)
    assert max_logit_difference(ours.logits, expected.logits) < TOLERANCE


@pytest.mark.parametrize("family", ["bamba", "falcon_h1"])
def test_beam_search_forks_the_rows_states(family: str) -> None:
    model = model_under_test(family, "paged")
    reference = build(family)[1]
    ids, mask = prompts(2, 7, pads=(2, 0), seed=5)
    expected = generate(reference, ids, mask, num_beams=2)
    ours = generate(model, ids, mask, paged_cache(model, slots=8), num_beams=2)
    assert max_logit_difference(ours.logits, expected.logits) < TOLERANCE
    assert torch.equal(ours.sequences, expected.sequences)


def test_too_few_state_slots_for_the_batch_is_a_specific_error() -> None:
    model = model_under_test("mamba2", "states")
    ids, mask = prompts(3, 5)
    with pytest.raises(OutOfStateSlotsError, match="state slots"):
        generate(model, ids, mask, paged_cache(model, slots=2), max_new_tokens=1)


def test_crop_of_a_state_model_is_refused_by_name() -> None:
    model = model_under_test("lfm2", "paged")
    cache = paged_cache(model)
    generate(model, *prompts(1, 6), cache, max_new_tokens=2)
    assert not cache.is_croppable
    with pytest.raises(StateRollbackError, match="checkpoint"):
        cache.crop(-1)


def test_the_pool_holds_one_state_per_row_beside_the_attention_blocks() -> None:
    model = model_under_test("bamba", "paged")
    config = cache_config_for(model, num_blocks=64, block_size=4, state_slots=4)
    assert [group.layers for group in config.kv_groups] == [(1, 3)]
    assert [layer for layer, array in config.states.arrays if array.name == "conv"] == [0, 2]
    shapes = {array.name: array.shape for layer, array in config.states.arrays if layer == 0}
    assert shapes == {"conv": (2 * 64 + 2 * 2 * 16, 4), "recurrent": (8, 16, 16)}


@pytest.mark.parametrize(
    ("family", "groups", "kinds"),
    [
        ("falcon_h1", [(0, 1, 2, 3)], ["full+state"] * 4),
        ("zamba2", [(1, 3)], ["state", "full+state", "state", "full+state"]),
        ("nemotron_h", [(1,)], ["state", "full", "none", "none"]),
    ],
)
def test_hybrid_layers_keep_kv_and_a_state_and_mlp_layers_keep_nothing(
    family: str, groups: list[tuple[int, ...]], kinds: list[str]
) -> None:
    config = cache_config_for(build(family)[1], num_blocks=16, block_size=4, state_slots=2)
    assert [config.layer_spec(layer).kind for layer in range(config.num_layers)] == kinds
    assert [group.layers for group in config.kv_groups] == groups
    state_layers = [layer for layer, kind in enumerate(kinds) if "state" in kind]
    assert sorted({layer for layer, _ in config.states.arrays}) == state_layers
    shapes = {array.name: array.shape for layer, array in config.states.arrays if layer == state_layers[0]}
    assert shapes == {"conv": (2 * 64 + 2 * 2 * 16, 4), "recurrent": (8, 16, 16)}


def test_a_hybrid_layer_of_a_family_without_known_state_shapes_is_refused_by_name() -> None:
    config = transformers.Zamba2Config(**{**COMMON, **ATTENTION, "layers_block_type": ["mamba", "hybrid"] * 2})
    config.model_type = "zamba_unknown"  # hybrid layers whose Mamba state kvcache cannot size
    with pytest.raises(
        UnsupportedConfigError, match=r"'hybrid', 'linear_attention' \(a recurrent state\) whose state shapes"
    ):
        cache_config_for(config, num_blocks=8)


@pytest.mark.parametrize("family", ["bamba", "qwen3_next", "lfm2", "falcon_h1", "zamba2", "nemotron_h"])
def test_a_second_generate_sharing_a_prompt_starts_from_the_last_state_checkpoint(family: str) -> None:
    model = model_under_test(family, "paged")
    reference = build(family)[1]
    config = cache_config_for(model, num_blocks=64, block_size=4, state_slots=4)
    manager = create_manager("torch", dataclasses.replace(config, enable_prefix_caching=True))
    cache = PagedCache(manager, model.config)
    # The first prompt ends a block: its states there are filed as the next forward begins.
    shared, _ = prompts(1, 32, seed=6)
    assert cache.map_cached_prefix(shared) == 0
    generate(model, shared, torch.ones_like(shared), cache, max_new_tokens=4)
    assert manager.stats().checkpoint_state_slots >= 1
    cache.release()
    second_ids = torch.cat([shared, prompts(1, 9, seed=8)[0]], dim=1)
    mask = torch.ones_like(second_ids)
    assert cache.map_cached_prefix(second_ids) == 32, "the hit ends at the checkpoint after the shared blocks"
    ours = generate(model, second_ids, mask, cache, max_new_tokens=8)
    expected = generate(reference, second_ids, mask, max_new_tokens=8)
    assert max_logit_difference(ours.logits, expected.logits) < TOLERANCE
    assert torch.equal(ours.sequences, expected.sequences)


@pytest.mark.parametrize(
    ("family", "path"), [(family, path) for family in ("bamba", "falcon_h1", "zamba2", "nemotron_h") for path in PATHS]
)
def test_generate_alone_starts_a_longer_prompt_from_the_last_checkpoint(family: str, path: str) -> None:
    model = model_under_test(family, path)
    reference = build(family)[1]
    # Slots for the row and the checkpoints filed at 32, 36, 40 and 44 tokens (the oldest is
    # evicted first when they run short).
    config = cache_config_for(model, num_blocks=64, block_size=4, hybrid=path == "paged", state_slots=8)
    manager = create_manager("torch", dataclasses.replace(config, enable_prefix_caching=True))
    computed: list[int] = []

    def count(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids: Any = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        computed.append(int(ids.shape[1]))

    hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
    shared = prompts(1, 32, seed=12)[0]  # ends a block: its states are filed as the next forward begins
    longer = torch.cat([shared, prompts(1, 7, seed=13)[0]], dim=1)
    prefills: list[int] = []
    try:
        for ids in (shared, longer):
            computed.clear()
            with PagedCache(manager, model, attention="model") as cache:  # the model: its forwards' ids reach the pool
                ours = generate(model, ids, torch.ones_like(ids), cache, max_new_tokens=16)
            prefills.append(computed[0])
            expected = generate(reference, ids, torch.ones_like(ids), max_new_tokens=16)
            assert torch.equal(ours.sequences, expected.sequences)
            assert max_logit_difference(ours.logits, expected.logits) < TOLERANCE
    finally:
        hook.remove()
    assert prefills == [32, 7], "the longer prompt's prefill starts after the checkpoint at 32 tokens"
