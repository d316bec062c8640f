"""``PagedCache(manager, model)`` on a model transformers loaded with its default ``sdpa``
runs its forwards with ``"kvcache_paged"`` (``attention="auto"``) where that serves the
model, and leaves every other model, and ``attention="model"``, on the model's own attention
(:mod:`kvcache_torch.hf.attention_choice`)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from kvcache_core import InvalidArgumentError, OutOfBlocksError, UnsupportedConfigError
from tests.torch.hf_models import FAMILIES, Family
from tests.torch.hf_support import (
    TOLERANCE,
    PagedCache,
    build_model,
    forward,
    generate,
    make_manager,
    max_logit_difference,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: The catalogue's families the paged path serves, on the attention transformers loads them with:
#: ``sdpa``, or ``eager`` where the class has no ``sdpa`` (Gemma 2, gpt-oss). Gemma 3's reference
#: runs ``eager``; its default is ``sdpa``.
SWITCHED = [
    family if family.name != "Gemma 3" else dataclasses.replace(family, attention="sdpa")
    for family in FAMILIES
    if family.path == "paged"
]
#: Families the cache leaves on their own attention (a class that does not call the
#: interface, latent attention).
KEPT = [family for family in FAMILIES if family.path == "contiguous"]


def _path(cache: PagedCache) -> str:
    return repr(cache).split("mode=")[1].split(",")[0]


def test_the_catalogue_has_families_of_both_kinds() -> None:
    assert {family.attention for family in SWITCHED} == {"sdpa", "eager"}
    assert {family.name for family in KEPT} >= {"Falcon", "Bloom", "DeepSeek-V3"}


@pytest.mark.parametrize("family", SWITCHED, ids=[family.name for family in SWITCHED])
def test_a_cache_built_with_the_model_as_loaded_runs_its_forwards_on_the_paged_path(family: Family) -> None:
    model = family.build()
    reference = copy.deepcopy(model)
    ids, mask = prompts(2, 10, pads=(0, 3), seed=31)
    manager = make_manager(model, num_blocks=64)
    with PagedCache(manager, model) as cache:
        ours = generate(model, ids, mask, cache, max_new_tokens=8)
        assert _path(cache) == "paged"
        assert model.config._attn_implementation == family.attention  # switched for each forward only
        assert cache.request_lengths() == [10 + 7, 7 + 7]
    expected = generate(reference, ids, mask, max_new_tokens=8)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0


@pytest.mark.parametrize("family", KEPT, ids=[family.name for family in KEPT])
def test_a_model_the_paged_path_cannot_serve_keeps_its_own_attention(family: Family) -> None:
    model = family.build()
    ids, mask = prompts(2, 10, pads=(0, 3), seed=31)
    with PagedCache(make_manager(model, num_blocks=64), model) as cache:
        generate(model, ids, mask, cache, max_new_tokens=3)
        assert _path(cache) == "contiguous"


def test_attention_model_keeps_the_contiguous_path_with_the_same_tokens() -> None:
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    ids, mask = prompts(3, 9, pads=(0, 2, 4), seed=5)
    expected = generate(model, ids, mask, max_new_tokens=6)
    manager = make_manager(model)
    with PagedCache(manager, model, attention="model") as cache:
        ours = generate(model, ids, mask, cache, max_new_tokens=6)
        assert _path(cache) == "contiguous"
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


@pytest.mark.parametrize("implementation", ["eager", "config"])
def test_an_eager_model_of_a_class_with_sdpa_or_a_cache_built_with_the_config_alone_is_not_switched(
    implementation: str,
) -> None:
    model = build_model("llama")
    model.set_attn_implementation("eager" if implementation == "eager" else "sdpa")
    ids, mask = prompts(2, 8, pads=(0, 2), seed=6)
    with PagedCache(make_manager(model), model if implementation == "eager" else model.config) as cache:
        generate(model, ids, mask, cache, max_new_tokens=3)
        assert _path(cache) == "contiguous"


def test_a_forward_asking_for_attention_weights_is_not_switched() -> None:
    model = build_model("llama")
    model.set_attn_implementation("eager")
    model.config._attn_implementation = "sdpa"  # as loaded: eager kernels remain importable
    ids, mask = prompts(1, 6, seed=7)
    with PagedCache(make_manager(model), model) as cache, torch.no_grad():
        output = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, output_attentions=True)
        assert _path(cache) == "contiguous"
        assert model.config._attn_implementation == "sdpa"
    assert output.logits.shape == (1, 6, model.config.vocab_size)


@pytest.mark.parametrize("attention", ["paged", "AUTO", None, 1, torch.tensor(1)], ids=str)
def test_a_bad_attention_choice_is_refused_by_name(attention: object) -> None:
    model = build_model("llama")
    manager = make_manager(model)
    before = manager.stats()
    with pytest.raises(InvalidArgumentError, match=r"attention must be one of \('auto', 'model'\)"):
        PagedCache(manager, model, attention=attention)  # type: ignore[arg-type]  # the bad value under test
    assert manager.stats() == before


def test_a_failed_forward_gives_the_model_its_attention_back() -> None:
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    ids, mask = prompts(2, 16, seed=8)
    manager = make_manager(model, num_blocks=4, block_size=4)  # 8 blocks needed
    cache = PagedCache(manager, model)
    with pytest.raises(OutOfBlocksError):
        forward(model, ids, mask, 0, cache)
    assert model.config._attn_implementation == "sdpa"
    assert manager.stats().used_blocks == 0
    expected = generate(model, ids[:1, :8], mask[:1, :8], max_new_tokens=3)  # the model still runs its own
    with PagedCache(manager, model) as retry:
        ours = generate(model, ids[:1, :8], mask[:1, :8], retry, max_new_tokens=3)
    assert torch.equal(ours.sequences, expected.sequences)


def test_a_direct_call_of_the_decoder_after_switched_forwards_is_refused_by_name() -> None:
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    ids, mask = prompts(1, 6, seed=9)
    with PagedCache(make_manager(model), model) as cache:
        forward(model, ids, mask, 0, cache)
        assert _path(cache) == "paged"
        with torch.no_grad(), pytest.raises(UnsupportedConfigError, match="filled with the paged path"):
            model.model(input_ids=ids[:, -1:], cache=cache, use_cache=True)  # its config names sdpa again
        assert cache.request_lengths() == [6]


@pytest.mark.parametrize("how", ["beams", "assisted", "second generate"])
def test_switched_forwards_serve_beam_search_assisted_decoding_and_a_second_generate(how: str) -> None:
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    reference = copy.deepcopy(model)
    ids, mask = prompts(2, 10, pads=(0, 3), seed=3)
    options: dict[str, object] = {"max_new_tokens": 8}
    if how == "beams":
        options["num_beams"] = 3
    elif how == "assisted":  # crop() of the rejected draft tokens
        ids, mask = ids[:1], mask[:1]
        assistant = build_model("llama", num_hidden_layers=1)
        assistant.set_attn_implementation("sdpa")
        options["assistant_model"] = assistant
    with PagedCache(make_manager(model, num_blocks=200), model) as cache:
        if how == "second generate":  # the cache goes on from its rows
            first = generate(model, ids, mask, cache, max_new_tokens=4)
            ids, mask = first.sequences, torch.cat([mask, torch.ones_like(mask[:, :4])], dim=1)
        ours = generate(model, ids, mask, cache, **options)
        assert _path(cache) == "paged"
    expected = generate(reference, ids, mask, **options)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert model.config._attn_implementation == "sdpa"


def test_a_decoder_called_directly_on_a_fresh_cache_runs_the_contiguous_path_with_its_window() -> None:
    """The model's hooks never see a call of its inner decoder: that forward runs the model's
    own attention, and the cache sizes its mask and its sliding layers' K/V for that path."""
    family = next(family for family in FAMILIES if family.name == "Qwen2, sliding window")
    model = family.build()
    ids, mask = prompts(1, 12, seed=10)  # longer than the window: the sliding layers' K/V are cut
    with PagedCache(make_manager(model, num_blocks=64), model) as cache, torch.no_grad():
        ours = model.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).last_hidden_state
        step = model.model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], dim=1), cache=cache)
        assert _path(cache) == "contiguous"
    with torch.no_grad():
        reference = model.model(input_ids=ids, attention_mask=mask, use_cache=True)
        expected = model.model(
            input_ids=ids[:, -1:],
            attention_mask=torch.cat([mask, mask[:, -1:]], dim=1),
            cache=reference.past_key_values,
        ).last_hidden_state
    assert float((ours - reference.last_hidden_state).abs().max()) <= TOLERANCE
    assert float((step.last_hidden_state - expected).abs().max()) <= TOLERANCE


def test_a_model_set_to_another_attention_after_the_cache_was_built_keeps_it() -> None:
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    ids, mask = prompts(1, 8, seed=11)
    with PagedCache(make_manager(model), model) as cache:
        model.set_attn_implementation("eager")  # chosen after: the cache does not override it
        generate(model, ids, mask, cache, max_new_tokens=3)
        assert _path(cache) == "contiguous"
        assert model.config._attn_implementation == "eager"
