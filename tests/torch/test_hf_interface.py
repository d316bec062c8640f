"""The ``kvcache_paged`` attention serves only models whose attention calls transformers'
attention interface.

Bloom, MPT, XGLM and GPT-NeoX-Japanese compute attention themselves: loaded with
``"kvcache_paged"`` they would hand their keys and values to :class:`PagedCache` for an
attention call that never comes. Falcon and GPT-Neo reject the name at load. Each is
refused by name with the remedy (the model's own attention: ``"sdpa"`` where it has it,
else ``"eager"``), up front where transformers can tell from the model's class and otherwise
at the first forward, before anything is stored; loaded as the refusal says, the same kind
of cache serves it with the logits of ``DynamicCache``.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from kvcache_core import PagedKvCacheManager, UnsupportedConfigError, create_manager
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    COMMON_CONFIG,
    PAD,
    TOLERANCE,
    VOCAB,
    Model,
    PagedCache,
    Tensor,
    cache_config_for,
    forward,
    generate,
    max_logit_difference,
    nn,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
    transformers,
)
from tests.torch.hf_support import guard as hf_guard

pytestmark = pytest.mark.usefixtures("one_thread")

#: Fields every tiny model below shares (weights large enough that a wrong context shows).
SHARED: dict[str, Any] = {
    "vocab_size": VOCAB,
    "initializer_range": 0.2,
    "pad_token_id": PAD,
    "bos_token_id": 1,
    "eos_token_id": None,
}

#: ``(config class, model class, fields)``: models that accept ``"kvcache_paged"`` at load
#: and then compute attention themselves. Two layers, hidden size 32, four heads.
OWN_ATTENTION: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 32, "n_layer": 2, "n_head": 4}),
    # MPT's config turns the cache off by default (generate then feeds every position every step).
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        {"d_model": 32, "n_layers": 2, "n_heads": 4, "expansion_ratio": 2, "use_cache": True},
    ),
    "xglm": (
        "XGLMConfig",
        "XGLMForCausalLM",
        {"d_model": 32, "num_layers": 2, "attention_heads": 4, "ffn_dim": 64, "init_std": 0.2},
    ),
    "gpt_neox_japanese": (
        "GPTNeoXJapaneseConfig",
        "GPTNeoXJapaneseForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_multiple_size": 2},
    ),
}

#: Models whose own loading rejects ``"kvcache_paged"`` (transformers raises a KeyError): they
#: pick attention classes by implementation name (GIT only in its text decoder).
REJECTED_AT_LOAD: dict[str, tuple[str, str, dict[str, Any]]] = {
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4},
    ),
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "attention_types": [[["global", "local"], 1]]},
    ),
    "git": (
        "GitConfig",
        "GitForCausalLM",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "image_size": 32,
                "patch_size": 16,
            },
        },
    ),
}


def own_config(architecture: str, implementation: str, **overrides: Any) -> Any:
    """A new config object (never shared between models) of ``architecture``."""
    config_name, _, fields = {**OWN_ATTENTION, **REJECTED_AT_LOAD}[architecture]
    return getattr(transformers, config_name)(**{**SHARED, **fields, **overrides}, attn_implementation=implementation)


def own_model(architecture: str, implementation: str, **overrides: Any) -> Model:
    """The model of :func:`own_config`, weights seeded the same for every implementation."""
    _, model_name, _ = {**OWN_ATTENTION, **REJECTED_AT_LOAD}[architecture]
    torch.manual_seed(0)
    return getattr(transformers, model_name)(own_config(architecture, implementation, **overrides)).eval()


def pool_for(model_or_config: Any, num_blocks: int = 64) -> PagedKvCacheManager[Tensor]:
    manager: PagedKvCacheManager[Tensor] = create_manager(
        "torch", cache_config_for(model_or_config, num_blocks=num_blocks, block_size=4)
    )
    return manager


def assert_untouched(manager: PagedKvCacheManager[Tensor]) -> None:
    """No request and every block free: the refused forward kept nothing."""
    stats = manager.stats()
    assert (stats.active_caches, stats.free_blocks) == (0, stats.total_blocks)
    manager.check_invariants()


def refusal(name: str, found: str = "", remedy: str = "eager") -> str:
    """What every refusal says: the model class, what was ``found``, and the remedy."""
    return (
        rf"^{name} {found}.*attention interface.*load the model with attn_implementation='{remedy}' "
        r"and pass that model's config to the cache, PagedCache\(manager, model\.config\)"
    )


def remedy_of(error: UnsupportedConfigError) -> str:
    """The attention implementation a refusal says to load the model with."""
    found = re.search(r"load the model with attn_implementation='(\w+)'", str(error))
    assert found is not None, str(error)
    return found.group(1)


def llama(layers: int = 2) -> Model:
    """A tiny Llama loaded with ``"kvcache_paged"``: its attention calls the interface."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **{**COMMON_CONFIG, "num_hidden_layers": layers}, attn_implementation=ATTN_IMPLEMENTATION
    )
    return transformers.LlamaForCausalLM(config).eval()


def attend_elsewhere(model: Model, layer: int) -> None:
    """Layer ``layer`` of a Llama attends with transformers' ``sdpa`` from now on, whatever the
    model's config says: its keys and values never reach the ``kvcache_paged`` attention."""
    attention = model.model.layers[layer].self_attn
    attention.config = copy.copy(model.config)
    attention.config._attn_implementation = "sdpa"  # pyright: ignore[reportPrivateUsage]


# -- refused up front ---------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", sorted(OWN_ATTENTION))
def test_a_model_computing_attention_itself_is_refused_by_name_before_any_forward(architecture: str) -> None:
    model = own_model(architecture, ATTN_IMPLEMENTATION)
    name = type(model).__name__
    with pytest.raises(UnsupportedConfigError, match=refusal(name)):
        cache_config_for(model, num_blocks=16)
    manager = pool_for(own_config(architecture, "eager"))
    with pytest.raises(UnsupportedConfigError, match=refusal(name)):
        PagedCache(manager, model.config)
    assert_untouched(manager)


@pytest.mark.parametrize(("architecture", "remedy"), [("falcon", "sdpa"), ("gpt_neo", "eager"), ("git", "eager")])
def test_a_model_rejecting_the_name_at_load_is_refused_by_name(architecture: str, remedy: str) -> None:
    _, model_name, _ = REJECTED_AT_LOAD[architecture]
    config = own_config(architecture, ATTN_IMPLEMENTATION)
    with pytest.raises(UnsupportedConfigError, match=refusal(model_name, remedy=remedy)):
        cache_config_for(config, num_blocks=16)
    manager = pool_for(own_config(architecture, remedy))
    with pytest.raises(UnsupportedConfigError, match=refusal(model_name, remedy=remedy)):
        PagedCache(manager, config)
    assert_untouched(manager)


def test_a_model_calling_the_interface_is_served_on_the_paged_path() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON_CONFIG, attn_implementation=ATTN_IMPLEMENTATION)
    model = transformers.LlamaForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    ids, mask = prompts(2, 9, pads=(0, 3))
    with PagedCache(pool_for(model), model.config) as cache:
        ours = generate(model, ids, mask, cache)
        assert cache.request_lengths() == [9 + 5, 6 + 5]  # the paged path ran: padding is not stored
    assert max_logit_difference(ours.logits, generate(reference, ids, mask).logits) <= TOLERANCE


class TableAttention(nn.Module):
    """An attention class a model picks by implementation name."""


#: A table of attention classes by implementation name, as Falcon's or a vision tower's: this
#: module stands for a modeling module that has one.
TOWER_ATTENTION_CLASSES = {"eager": TableAttention}


class Decoder(nn.Module):
    """A decoder of a modeling module with an attention table: the table's classes in it or not."""

    def __init__(self, with_table_attention: bool) -> None:
        super().__init__()
        self.attention = TableAttention() if with_table_attention else nn.Identity()


@pytest.mark.parametrize(("with_table_attention", "verdict"), [(True, False), (False, None)])
def test_an_attention_table_counts_against_a_decoder_only_if_the_decoder_holds_its_classes(
    with_table_attention: bool, verdict: bool | None
) -> None:
    assert hf_guard.uses_interface(Decoder) is False  # no instance to look into: the table counts
    # Without the table's classes, the judgement is transformers' (none for a plain module).
    assert hf_guard.uses_interface(Decoder, Decoder(with_table_attention)) is verdict


# -- refused at the first forward, where transformers cannot tell up front -----------------------


LAYER_0_NOW = "did not run the kvcache_paged attention for layer 0 of this forward"


@pytest.fixture
def undecided(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers cannot judge the model's class (an older transformers, remote code)."""

    def cannot_tell(model_class: type[nn.Module], decoder: nn.Module | None = None) -> bool | None:
        return None

    monkeypatch.setattr(hf_guard, "uses_interface", cannot_tell)


# MPT is left out: its own attention fails on the mask of the kvcache_paged attention (None
# for an unpadded batch) in layer 0, before layer 1's update; so does any of these models on a
# padded batch (a 2-D mask). They fail inside their own code then, with no output and nothing
# stored; transformers 5 refuses all four up front (above).
@pytest.mark.usefixtures("undecided")
@pytest.mark.parametrize("architecture", ["bloom", "gpt_neox_japanese", "xglm"])
def test_a_model_computing_attention_itself_is_refused_at_its_first_forward(architecture: str) -> None:
    model = own_model(architecture, ATTN_IMPLEMENTATION)
    manager = pool_for(model)
    ids, mask = prompts(2, 7)
    with PagedCache(manager, model.config) as cache:
        for _ in range(2):  # refused again: nothing of the first try stays
            with pytest.raises(UnsupportedConfigError, match=refusal(type(model).__name__, LAYER_0_NOW)):
                generate(model, ids, mask, cache)
            assert (cache.batch_size, cache.get_seq_length()) == (0, 0)
            assert_untouched(manager)


def test_a_layer_skipping_the_paged_attention_undoes_the_first_forward() -> None:
    model = llama(layers=3)
    attend_elsewhere(model, 1)
    manager = pool_for(model)
    ids, mask = prompts(2, 7)  # unpadded: the sdpa layer reads the mask kvcache_paged gives (None)
    with PagedCache(manager, model.config) as cache:
        # Layer 0 stored its tokens (the rows were allocated); layer 2's update finds layer 1's waiting.
        found = "did not run the kvcache_paged attention for layer 1 of this forward"
        with pytest.raises(UnsupportedConfigError, match=refusal("LlamaForCausalLM", found, "sdpa")):
            forward(model, ids, mask, 0, cache)
        assert (cache.batch_size, cache.get_seq_length()) == (0, 0)
        assert_untouched(manager)


def test_a_layer_skipping_the_paged_attention_later_leaves_every_row_as_it_was() -> None:
    model = llama(layers=3)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    manager = pool_for(model)
    ids, mask = prompts(2, 9)
    with PagedCache(manager, model.config) as cache:
        dynamic = transformers.DynamicCache(config=reference.config)
        forward(model, ids[:, :7], mask, 0, cache)
        forward(reference, ids[:, :7], mask, 0, dynamic)
        lengths, blocks = cache.request_lengths(), manager.stats().free_blocks
        attend_elsewhere(model, 1)
        with pytest.raises(UnsupportedConfigError, match=refusal("LlamaForCausalLM", "did not run .* layer 1", "sdpa")):
            forward(model, ids[:, 7:8], mask, 7, cache)
        assert (cache.request_lengths(), cache.get_seq_length()) == (lengths, 7)
        assert [handle.num_tokens() for handle in cache.handles] == lengths
        assert manager.stats().free_blocks == blocks
        manager.check_invariants()
        model.model.layers[1].self_attn.config = model.config  # every layer attends through the pool again
        ours = forward(model, ids[:, 7:], mask, 7, cache)
        expected = forward(reference, ids[:, 7:], mask, 7, dynamic)
        assert float((ours - expected).abs().max()) <= TOLERANCE


@pytest.mark.usefixtures("undecided")
def test_a_one_layer_model_computing_attention_itself_is_refused_before_its_second_output() -> None:
    model = own_model("bloom", ATTN_IMPLEMENTATION, n_layer=1)
    manager = pool_for(model)
    ids, mask = prompts(1, 7)
    with PagedCache(manager, model.config) as cache:
        # Its one layer's update is the last call of the forward: the first output goes out, and
        # is right (the context is the new tokens alone); nothing is stored.
        first = forward(model, ids[:, :6], mask, 0, cache)
        with torch.no_grad():
            assert float((first - model(ids[:, :6]).logits).abs().max()) <= TOLERANCE
        found = "did not run the kvcache_paged attention for layer 0 of the last forward"
        with pytest.raises(UnsupportedConfigError, match=refusal("BloomForCausalLM", found)):
            forward(model, ids[:, 6:], mask, 6, cache)
        assert cache.batch_size == 0
        assert_untouched(manager)


# -- served as the refusal says, by the same kind of cache ---------------------------------------


@pytest.mark.parametrize("architecture", sorted({*OWN_ATTENTION, *REJECTED_AT_LOAD}))
def test_loaded_as_the_refusal_says_the_model_gets_the_logits_of_dynamic_cache(architecture: str) -> None:
    with pytest.raises(UnsupportedConfigError) as refused:
        cache_config_for(own_config(architecture, ATTN_IMPLEMENTATION), num_blocks=16)
    model = own_model(architecture, remedy_of(refused.value))
    ids, mask = prompts(2, 9, pads=(0, 3))
    with PagedCache(pool_for(model), model.config) as cache:
        ours = generate(model, ids, mask, cache)
        assert cache.request_lengths() == [9 + 5, 9 + 5]  # the contiguous path stores every position
    expected = generate(model, ids, mask)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert torch.equal(ours.sequences, expected.sequences)
