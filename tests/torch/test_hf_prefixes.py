"""kvcache_torch.hf: prefix caching through ``generate`` alone. A :class:`PagedCache` built with
the model (not only its config) gets every forward's token ids from a forward pre-hook: a new
batch's first forward maps the cached blocks of its prompts and computes only the positions
after them, on both paths, and the blocks every step writes become cacheable.

Every equality test compares the logits of the run that hit the prefix cache with those of
``DynamicCache`` on the same model (fp32, max abs difference <= 1e-4).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from kvcache_core import PagedKvCacheManager, create_manager
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    TOLERANCE,
    Model,
    PagedCache,
    Tensor,
    build_model,
    cache_config_for,
    generate,
    max_logit_difference,
    model_pair,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: ``"paged"``: a model loaded with ``"kvcache_paged"``; ``"sdpa"``: the contiguous path
#: (``attention="model"``); ``"auto"``: an ``sdpa`` model whose forwards the cache switches.
PATHS = ("paged", "sdpa", "auto")
BLOCK = 8


def pair_on(path: str) -> tuple[Model, Model]:
    """The model under test on ``path`` and its reference."""
    return model_pair("llama", "sdpa" if path == "auto" else path)


def cache_for(manager: PagedKvCacheManager[Tensor], model: Model, path: str) -> PagedCache:
    """A cache built with the model, which takes ``path``."""
    return PagedCache(manager, model, attention="auto" if path == "auto" else "model")


def prefix_caching_manager(model: Model, num_blocks: int = 128) -> PagedKvCacheManager[Tensor]:
    config = dataclasses.replace(
        cache_config_for(model, num_blocks=num_blocks, block_size=BLOCK), enable_prefix_caching=True
    )
    manager: PagedKvCacheManager[Tensor] = create_manager("torch", config)
    return manager


class Computed:
    """The new tokens each forward of the decoder computed (after the cache's hook sliced them)."""

    def __init__(self, model: Model) -> None:
        self.counts: list[int] = []
        self._hook = model.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids: Tensor = kwargs.get("input_ids", args[0] if args else None)
        self.counts.append(int(ids.shape[1]))

    def remove(self) -> None:
        self._hook.remove()


@pytest.fixture
def computed() -> Iterator[Any]:
    """``computed(model)`` starts counting the tokens each forward of ``model`` computes."""
    made: list[Computed] = []

    def watch(model: Model) -> Computed:
        made.append(Computed(model))
        return made[-1]

    yield watch
    for watcher in made:
        watcher.remove()


@pytest.mark.parametrize("path", PATHS)
def test_a_second_generate_on_a_shared_prompt_computes_only_the_uncached_tokens(path: str, computed: Any) -> None:
    model, reference = pair_on(path)
    manager = prefix_caching_manager(model)
    ids, mask = prompts(1, 45, seed=21)
    watch = computed(model)
    runs: list[Any] = []
    prefills: list[int] = []
    for _ in range(2):
        watch.counts.clear()
        with cache_for(manager, model, path) as cache:
            runs.append(generate(model, ids, mask, cache))
            assert ("mode=paged" in repr(cache)) == (path != "sdpa")
        prefills.append(watch.counts[0])
    assert prefills == [45, 45 - 40]  # every full block but the one of the last token
    assert manager.stats().prefix_cache_hits >= 40 // BLOCK
    expected = generate(reference, ids, mask)
    for run in runs:
        assert torch.equal(run.sequences, expected.sequences)
        assert max_logit_difference(run.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0


def test_a_left_padded_batch_on_the_paged_path_starts_from_the_blocks_every_row_shares(computed: Any) -> None:
    model, reference = model_pair("llama", "paged")
    manager = prefix_caching_manager(model)
    long_ids, _ = prompts(1, 30, seed=22)
    with PagedCache(manager, model) as cache:  # caches the 30-token prompt's full blocks
        generate(model, long_ids, torch.ones_like(long_ids), cache, max_new_tokens=1)
    ids = torch.cat([long_ids, torch.cat([torch.zeros(1, 10, dtype=torch.long), long_ids[:, :20]], dim=1)])
    mask = torch.cat([torch.ones(1, 30, dtype=torch.long), torch.tensor([[0] * 10 + [1] * 20])])
    watch = computed(model)
    with PagedCache(manager, model) as cache:
        ours = generate(model, ids, mask, cache)
        # Row 0 hits 24 tokens (3 blocks), row 1 16 after 10 padding columns: they share 24
        # positions, of which row 1 holds 14.
        assert watch.counts[0] == 30 - 24
        assert [handle.num_cached_tokens() for handle in cache.handles] == [24, 14]
        assert cache.request_lengths() == [30 + 5, 20 + 5]  # padding is never stored
    expected = generate(reference, ids, mask)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


def test_the_contiguous_path_caches_padded_rows(computed: Any) -> None:
    """The contiguous path stores no padding either (the model's forward hook brings the
    mask): a left-padded row hits its cached blocks as on the paged path."""
    model, reference = model_pair("llama", "sdpa")
    manager = prefix_caching_manager(model)
    ids, mask = prompts(2, 30, pads=(0, 3), seed=23)
    watch = computed(model)
    with cache_for(manager, model, "sdpa") as cache:
        generate(model, ids, mask, cache, max_new_tokens=1)
        assert cache.request_lengths() == [30, 27]  # the 3 padding columns are not stored
    with cache_for(manager, model, "sdpa") as cache:
        ours = generate(model, ids, mask, cache)
        # Row 0 hits 3 blocks, row 1 3 blocks after its 3 padding columns: they share 24
        # positions, of which row 1 holds 21.
        assert [handle.num_cached_tokens() for handle in cache.handles] == [24, 21]
    assert watch.counts[1] == 30 - 24
    expected = generate(reference, ids, mask)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


@pytest.mark.parametrize("path", PATHS)
def test_the_next_turn_reuses_the_blocks_of_the_generated_tokens(path: str, computed: Any) -> None:
    model, reference = pair_on(path)
    manager = prefix_caching_manager(model)
    ids, mask = prompts(1, 13, seed=24)
    with cache_for(manager, model, path) as cache:
        first = generate(model, ids, mask, cache, max_new_tokens=20)
    more, _ = prompts(1, 5, seed=25)
    turn = torch.cat([first.sequences, more], dim=1)  # 13 + 20 + 5 = 38 tokens
    watch = computed(model)
    with cache_for(manager, model, path) as cache:
        ours = generate(model, turn, torch.ones_like(turn), cache)
    # The first run stored 13 + 19 tokens: 4 full blocks, 32 positions, reach the second.
    assert watch.counts[0] == 38 - 32
    expected = generate(reference, turn, torch.ones_like(turn))
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


@pytest.mark.parametrize("path", PATHS)
def test_beam_search_from_a_cached_prefix_gives_the_logits_of_dynamic_cache(path: str) -> None:
    model, reference = pair_on(path)
    manager = prefix_caching_manager(model)
    ids, mask = prompts(1, 20, seed=26)
    options: dict[str, Any] = {"num_beams": 3, "max_new_tokens": 10, "output_scores": True}
    runs: list[Any] = []
    for _ in range(2):  # the second starts from the first's cached blocks
        with cache_for(manager, model, path) as cache:
            runs.append(generate(model, ids, mask, cache, **options))
            manager.check_invariants()
    assert manager.stats().prefix_cache_hits > 0
    expected = generate(reference, ids, mask, **options)
    for ours in runs:
        assert torch.equal(ours.sequences, expected.sequences)
        assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


def test_a_cache_built_with_the_config_warns_once_that_no_ids_reach_a_caching_pool() -> None:
    model = build_model("llama")  # never hooked: model_pair's models are, by the other tests
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    manager = prefix_caching_manager(model)
    ids, mask = prompts(1, 10, seed=27)
    with PagedCache(manager, model.config) as cache:
        with pytest.warns(UserWarning, match=r"PagedCache\(manager, model\)"):
            generate(model, ids, mask, cache, max_new_tokens=2)
        cache.release()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            generate(model, ids, mask, cache, max_new_tokens=2)


def test_a_cache_built_with_the_model_on_a_pool_without_prefix_caching_neither_hooks_nor_warns() -> None:
    model, _ = model_pair("qwen2", "paged")
    manager = create_manager("torch", cache_config_for(model, num_blocks=64, block_size=BLOCK))
    hooks = len(model._forward_pre_hooks)  # pyright: ignore[reportPrivateUsage]
    ids, mask = prompts(1, 10, seed=28)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PagedCache(manager, model) as cache:
            generate(model, ids, mask, cache, max_new_tokens=2)
    assert len(model._forward_pre_hooks) == hooks  # pyright: ignore[reportPrivateUsage]


def test_a_forward_on_embeddings_maps_nothing_and_warns_that_no_ids_came() -> None:
    model, reference = model_pair("llama", "paged")
    manager = prefix_caching_manager(model)
    ids, mask = prompts(1, 20, seed=29)
    with PagedCache(manager, model) as cache:
        generate(model, ids, mask, cache, max_new_tokens=1)  # caches the prompt's full blocks
    embeddings = model.get_input_embeddings()(ids)
    with PagedCache(manager, model) as cache, torch.no_grad():
        with pytest.warns(UserWarning, match="no token ids reached"):
            ours = model(inputs_embeds=embeddings, attention_mask=mask, cache=cache, use_cache=True).logits
        assert cache.handles[0].num_cached_tokens() == 0
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert ours.shape == expected.shape
    assert float((ours - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("path", PATHS)
def test_a_chunked_prefill_from_a_cached_prefix_gives_the_logits_of_dynamic_cache(path: str) -> None:
    model, reference = pair_on(path)
    manager = prefix_caching_manager(model)
    ids, mask = prompts(2, 40, pads=(0, 5), seed=30)
    runs: list[Any] = []
    for _ in range(2):  # the second maps the first's blocks within its first chunk
        with cache_for(manager, model, path) as cache:
            runs.append(generate(model, ids, mask, cache, max_new_tokens=8, prefill_chunk_size=16))
    assert manager.stats().prefix_cache_hits > 0
    expected = generate(reference, ids, mask, max_new_tokens=8)
    for ours in runs:
        assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
