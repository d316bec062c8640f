"""kvcache_torch.hf: the transformers Cache backed by the paged pool, and the kvcache_paged attention.

Every equality test runs a random-weight model twice, once with ``DynamicCache`` and ``sdpa``
(transformers' defaults) and once with :class:`PagedCache`, and compares the logits (fp32,
max abs difference <= 1e-4) at every real position. ``paged`` is the fast path (the
``kvcache_paged`` attention reads the pool in place, padding is never stored); ``sdpa`` and
``eager`` are the fallback path (``PagedCache.update`` returns contiguous K/V).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import pytest

from kvcache_core import (
    CacheConfig,
    InvalidArgumentError,
    OutOfBlocksError,
    PagedKvCacheManager,
    UnsupportedConfigError,
    create_manager,
)
from kvcache_core.errors import DTypeMismatchError, InvalidTypeError, LayerIndexError, ShapeMismatchError
from kvcache_torch import TorchStorage
from tests.torch.hf_support import (
    ARCHITECTURES,
    ATTN_IMPLEMENTATION,
    TOLERANCE,
    VOCAB,
    Model,
    PagedCache,
    Tensor,
    build_model,
    cache_config_for,
    forward,
    generate,
    make_manager,
    max_logit_difference,
    model_pair,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    paged_attention_mask,
    prompts,
    torch,
    transformers,
)

pytestmark = pytest.mark.usefixtures("one_thread")

IMPLEMENTATIONS = ("paged", "sdpa")
#: Models whose attention is not behind transformers' AttentionInterface: they keep their own
#: attention whatever is set, so PagedCache serves them through its contiguous path.
FIXED_ATTENTION = frozenset({"falcon"})


class Prefilled(NamedTuple):
    """A llama on the paged attention, its pool and its open cache after one forward of ``ids``."""

    model: Model
    manager: PagedKvCacheManager[Tensor]
    cache: PagedCache
    ids: Tensor
    mask: Tensor


@contextlib.contextmanager
def prefilled(
    batch: int, length: int, pads: Sequence[int] = (), num_blocks: int = 96
) -> Generator[Prefilled, None, None]:
    """``prompts(batch, length, pads)`` through one forward of a paged llama into a fresh
    :class:`PagedCache` of ``num_blocks`` blocks, open for the ``with`` block."""
    model, _ = model_pair("llama", "paged")
    manager = make_manager(model, num_blocks=num_blocks)
    ids, mask = prompts(batch, length, pads=pads)
    with PagedCache(manager, model.config) as cache:
        forward(model, ids, mask, 0, cache)
        yield Prefilled(model, manager, cache, ids, mask)


@pytest.mark.parametrize(
    ("options", "kv_heads"),
    [
        ({"multi_query": True, "new_decoder_architecture": False}, 1),
        ({"multi_query": False, "new_decoder_architecture": False, "num_kv_heads": 4}, 4),
        ({"new_decoder_architecture": True, "num_kv_heads": 2}, 4),  # broadcast to every query head
    ],
    ids=["multi-query", "multi-head", "new-decoder-architecture"],
)
def test_cache_config_for_reads_the_kv_heads_falcon_hands_its_cache(options: dict[str, Any], kv_heads: int) -> None:
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **options
    )
    assert cache_config_for(config, num_blocks=8).num_heads == kv_heads
    model = transformers.FalconForCausalLM(config).eval()
    dynamic = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 5)), cache=dynamic, use_cache=True)
    assert dynamic.layers[0].keys.shape[1] == kv_heads


def test_cache_config_for_refuses_layers_with_different_kv_head_counts() -> None:
    # Per-layer counts, as OpenELM-style configs give them.
    config = transformers.PretrainedConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=64, num_kv_heads=[2, 4]
    )
    with pytest.raises(UnsupportedConfigError, match=r"different KV head counts \[2, 4\]"):
        cache_config_for(config, num_blocks=8)


# -- equal to DynamicCache ------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_batch_of_one_gives_the_logits_of_dynamic_cache(architecture: str, implementation: str) -> None:
    model, reference = model_pair(architecture, implementation)
    manager = make_manager(model)
    ids, mask = prompts(1, 11)
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache)
        assert cache.request_lengths() == [11 + 6 - 1]  # the last token's K/V are never computed
    expected = generate(reference, ids, mask)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert torch.equal(ours.sequences, expected.sequences)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_left_padded_batch_gives_the_logits_of_dynamic_cache(architecture: str, implementation: str) -> None:
    model, reference = model_pair(architecture, implementation)
    manager = make_manager(model)
    ids, mask = prompts(3, 10, pads=(0, 4, 1))
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache)
        stored = cache.request_lengths()
    expected = generate(reference, ids, mask)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert torch.equal(ours.sequences, expected.sequences)
    if implementation == "paged" and architecture not in FIXED_ATTENTION:
        assert stored == [10 + 5, 6 + 5, 9 + 5]  # padding is never stored
    else:
        assert stored == [15, 15, 15]  # the contiguous path stores every position


@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, "eager"])
@pytest.mark.parametrize("pads", [(), (3, 0)], ids=["unpadded", "left-padded"])
def test_chunked_prefill_on_a_non_empty_cache_gives_the_logits_of_dynamic_cache(
    implementation: str, pads: tuple[int, ...]
) -> None:
    model, reference = model_pair("qwen2", implementation)
    manager = make_manager(model)
    ids, mask = prompts(2, 14, pads=pads)
    chunks = [(0, 5), (5, 9), (9, 13), (13, 14)]  # several query tokens on a non-empty cache, then one
    real = mask.bool()
    with PagedCache(manager, model.config) as cache:
        dynamic = transformers.DynamicCache(config=reference.config)
        for start, stop in chunks:
            ours = forward(model, ids[:, start:stop], mask, start, cache)
            expected = forward(reference, ids[:, start:stop], mask, start, dynamic)
            assert cache.get_seq_length() == dynamic.get_seq_length() == stop
            rows = real[:, start:stop]  # logits at padding positions are meaningless in both
            assert float((ours[rows] - expected[rows]).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_generate_with_prefill_chunks_gives_the_logits_of_dynamic_cache(implementation: str) -> None:
    model, reference = model_pair("llama", implementation)
    manager = make_manager(model)
    ids, mask = prompts(2, 13, pads=(0, 2))
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache, prefill_chunk_size=4)
    expected = generate(reference, ids, mask)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_second_generate_on_the_same_manager_after_release(implementation: str) -> None:
    model, reference = model_pair("mistral", implementation)
    manager = make_manager(model)
    free_at_start = manager.stats().free_blocks
    first_ids, first_mask = prompts(2, 9, pads=(2, 0), seed=3)
    with PagedCache(manager, model.config) as first:
        generate(model, first_ids, first_mask, first)
        assert manager.stats().free_blocks < free_at_start
    assert manager.stats().free_blocks == free_at_start
    assert manager.stats().active_caches == 0

    ids, mask = prompts(3, 7, pads=(0, 1, 3), seed=4)
    with PagedCache(manager, model.config) as second:
        ours = generate(model, ids, mask, second)
    expected = generate(reference, ids, mask)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().free_blocks == free_at_start


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("pads", [(), (0, 3)], ids=["unpadded", "left-padded"])
def test_crop_rolls_back_to_the_logits_of_dynamic_cache(implementation: str, pads: tuple[int, ...]) -> None:
    model, reference = model_pair("llama", implementation)
    manager = make_manager(model)
    ids, prompt_mask = prompts(2, 8, pads=pads, seed=5)
    draft, _ = prompts(2, 4, seed=6)  # speculative tokens, rejected by the crop
    accepted, _ = prompts(2, 3, seed=7)
    mask = torch.cat([prompt_mask, torch.ones(2, 7, dtype=torch.long)], dim=1)
    with PagedCache(manager, model.config) as cache:
        dynamic = transformers.DynamicCache(config=reference.config)
        for tested, past in ((model, cache), (reference, dynamic)):
            forward(tested, ids, mask, 0, past)
        stored_before = cache.request_lengths()
        for tested, past in ((model, cache), (reference, dynamic)):
            forward(tested, draft, mask, 8, past)
        blocks_with_draft = manager.stats().used_blocks
        for past in (cache, dynamic):
            past.crop(-4)
        assert cache.get_seq_length() == dynamic.get_seq_length() == 8
        assert cache.request_lengths() == stored_before
        # The crop truncates each request: the blocks wholly past its new end are free at once.
        assert manager.stats().used_blocks == sum(-(-tokens // 4) for tokens in stored_before) < blocks_with_draft
        ours = forward(model, accepted, mask, 8, cache)
        expected = forward(reference, accepted, mask, 8, dynamic)
        assert manager.stats().used_blocks == sum(-(-tokens // 4) for tokens in cache.request_lengths())
    assert float((ours - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_assisted_generation_crops_to_the_logits_of_dynamic_cache(implementation: str) -> None:
    model, reference = model_pair("llama", implementation)
    assistant = build_model("llama", num_hidden_layers=1)  # other weights: most drafts are rejected and cropped
    assistant.set_attn_implementation("sdpa")
    manager = make_manager(model)
    ids, mask = prompts(1, 8, seed=14)
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache, assistant_model=assistant, max_new_tokens=10)
        assert cache.request_lengths() == [8 + 10 - 1]
    expected = generate(reference, ids, mask, max_new_tokens=10)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().used_blocks == 0


def test_crop_with_a_positive_length_keeps_that_many_positions() -> None:
    with prefilled(2, 9, pads=(0, 2)) as (_, manager, cache, _, _):
        cache.crop(12)  # at or past the length: nothing changes (the transformers 4 meaning)
        assert cache.request_lengths() == [9, 7]
        cache.crop(5)  # keep the first 5 positions: row 1 has 2 padding columns among them
        assert cache.get_seq_length() == 5
        assert cache.request_lengths() == [5, 3]
        with pytest.raises(InvalidArgumentError, match="cannot remove 6 positions"):
            cache.crop(-6)
        assert cache.get_seq_length() == 5
        keys = manager.gather(cache.handles[1], 0)[0][:3]
        cache.reorder_cache(torch.tensor([1, 1]))  # a copy takes the tokens in use only
        assert cache.request_lengths() == [3, 3]
        assert cache.handles[0].num_tokens() == 3
        assert torch.equal(manager.gather(cache.handles[0], 0)[0], keys)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_beam_search_reorders_to_the_logits_of_dynamic_cache(implementation: str) -> None:
    model, reference = model_pair("qwen3", implementation)
    manager = make_manager(model, num_blocks=160)
    free_at_start = manager.stats().free_blocks
    ids, mask = prompts(2, 7, pads=(0, 2), seed=8)
    options: dict[str, Any] = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 5, "output_scores": True}
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache, **options)
        assert cache.batch_size == 6  # two prompts times three beams
    expected = generate(reference, ids, mask, **options)
    assert torch.equal(ours.sequences, expected.sequences)
    assert float((ours.sequences_scores - expected.sequences_scores).abs().max()) <= TOLERANCE
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    assert manager.stats().free_blocks == free_at_start


def test_reorder_moves_rows_used_once_and_copies_the_others() -> None:
    with prefilled(3, 9, pads=(0, 3, 1)) as (_, manager, cache, _, _):
        keys = [manager.gather(handle, 1)[0] for handle in cache.handles]
        old_ids = cache.request_ids
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        assert (cache.request_ids[0], cache.request_ids[2]) == (old_ids[2], old_ids[0])  # moved, not copied
        assert cache.request_ids[1] not in old_ids  # a fork of row 2
        assert cache.request_lengths() == [8, 8, 9]
        for row, source in enumerate([2, 2, 0]):
            assert torch.equal(manager.gather(cache.handles[row], 1)[0], keys[source])
        assert manager.stats().active_caches == 3  # row 1's old request was released


def test_reordered_beams_share_blocks_and_copy_only_the_block_they_diverge_in() -> None:
    model, reference = model_pair("llama", "paged")
    manager = make_manager(model)
    ids, mask = prompts(3, 9, pads=(0, 3, 1))  # rows hold 9, 6 and 8 tokens in blocks of 4
    following, _ = prompts(3, 1, seed=12)
    grown_mask = torch.cat([mask[[0, 0, 1]], torch.ones(3, 1, dtype=torch.long)], dim=1)
    with PagedCache(manager, model.config) as cache:
        dynamic = transformers.DynamicCache(config=reference.config)
        for tested, past in ((model, cache), (reference, dynamic)):
            forward(tested, ids, mask, 0, past)
            past.reorder_cache(torch.tensor([0, 0, 1]))
        shared = cache.handles[0].block_table().physical_blocks
        assert cache.handles[1].block_table().physical_blocks == shared  # a fork: nothing copied yet
        assert manager.stats().copy_on_write_count == 0
        ours = forward(model, following, grown_mask, 9, cache)
        expected = forward(reference, following, grown_mask, 9, dynamic)
        # The beams diverge in the block holding token 9: that block alone is copied.
        assert manager.stats().copy_on_write_count == 1
        assert cache.handles[0].block_table().physical_blocks[:2] == cache.handles[1].block_table().physical_blocks[:2]
    assert float((ours - expected).abs().max()) <= TOLERANCE
    assert manager.stats().used_blocks == 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_batch_repeat_and_select_match_dynamic_cache(implementation: str) -> None:
    model, reference = model_pair("gemma", implementation)
    manager = make_manager(model)
    ids, mask = prompts(2, 6, pads=(1, 0), seed=9)
    following, _ = prompts(4, 1, seed=10)
    with PagedCache(manager, model.config) as cache:
        dynamic = transformers.DynamicCache(config=reference.config)
        for tested, past in ((model, cache), (reference, dynamic)):
            forward(tested, ids, mask, 0, past)
            past.batch_repeat_interleave(2)
        repeated_mask = torch.cat([mask.repeat_interleave(2, dim=0), torch.ones(4, 1, dtype=torch.long)], dim=1)
        ours = forward(model, following, repeated_mask, 6, cache)
        expected = forward(reference, following, repeated_mask, 6, dynamic)
        assert float((ours - expected).abs().max()) <= TOLERANCE

        keep = torch.tensor([3, 0])
        for past in (cache, dynamic):
            past.batch_select_indices(keep)
        assert cache.batch_size == 2
        assert manager.stats().active_caches == 2
        last, _ = prompts(2, 1, seed=11)
        kept_mask = torch.cat([repeated_mask[keep], torch.ones(2, 1, dtype=torch.long)], dim=1)
        ours = forward(model, last, kept_mask, 7, cache)
        expected = forward(reference, last, kept_mask, 7, dynamic)
    assert float((ours - expected).abs().max()) <= TOLERANCE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_pool_on_the_gpu_gives_the_logits_of_dynamic_cache(implementation: str) -> None:
    cpu_model, _ = model_pair("qwen2", implementation)
    model, reference = copy.deepcopy(cpu_model).to("cuda"), build_model("qwen2").to("cuda")
    reference.set_attn_implementation("sdpa")
    manager: PagedKvCacheManager[Tensor] = create_manager(
        "torch",
        cache_config_for(model, num_blocks=64, block_size=4),  # on the model's device
    )
    ids, mask = (tensor.to("cuda") for tensor in prompts(3, 10, pads=(0, 4, 1)))
    with PagedCache(manager, model.config) as cache:
        ours = generate(model, ids, mask, cache)
    expected = generate(reference, ids, mask)
    assert max_logit_difference(ours.logits, expected.logits) <= 1e-3  # GPU kernels order sums differently
    assert manager.stats().used_blocks == 0


# -- the paged path reads the pool in place ---------------------------------------------------


@pytest.mark.parametrize("pads", [(0, 4), (0, 0)], ids=["left-padded", "unpadded"])
def test_paged_decode_attends_over_the_pool_without_gathering_it(
    monkeypatch: pytest.MonkeyPatch, pads: tuple[int, int]
) -> None:
    model, _ = model_pair("llama", "paged")
    manager = make_manager(model)
    queries: list[tuple[int, ...]] = []
    attend = manager.storage.paged_attention

    def spy_attention(layer: int, query: Tensor, *arguments: Any) -> Tensor:
        queries.append(tuple(query.shape))
        return attend(layer, query, *arguments)

    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    lane_of = storage.step_lane

    def spy_lane(*arguments: Any) -> Any:  # a step's plain layers attend through the storage's lane
        lane = lane_of(*arguments)
        if lane is None:
            return None

        def spied(layer: int, keys: Tensor, values: Tensor, query: Tensor, scale: float) -> Tensor | None:
            queries.append(tuple(query.shape))
            return lane(layer, keys, values, query, scale)

        return spied

    def no_gather(*arguments: object) -> object:
        raise AssertionError("the paged path must not gather a request's K/V")

    monkeypatch.setattr(manager.storage, "paged_attention", spy_attention)
    monkeypatch.setattr(manager.storage, "step_lane", spy_lane)
    monkeypatch.setattr(manager, "gather", no_gather)
    monkeypatch.setattr(manager.storage, "gather", no_gather)
    ids, mask = prompts(2, 9, pads=pads)
    with PagedCache(manager, model.config) as cache:
        generate(model, ids, mask, cache, max_new_tokens=4)
        assert cache.request_lengths() == [9 + 3 - pad for pad in pads]
    layers = model.config.num_hidden_layers
    decode = [(2, 4, 16)] * (3 * layers)  # each decode step: one query per request, every layer
    # A first forward attends over its own contiguous K/V (sdpa; with left padding one call
    # per row on its real tokens), writing the pool; only the decode steps read it.
    assert queries == decode


def test_kvcache_paged_attention_without_a_paged_cache_matches_sdpa() -> None:
    model, reference = model_pair("phi3", "paged")
    ids, mask = prompts(2, 8, pads=(0, 3))
    ours = generate(model, ids, mask)  # transformers' DynamicCache: contiguous K/V, sdpa inside
    expected = generate(reference, ids, mask)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE
    with torch.no_grad():
        no_cache = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        reference_no_cache = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert float((no_cache[real] - reference_no_cache[real]).abs().max()) <= TOLERANCE


# -- lifecycle: blocks return to the pool -----------------------------------------------------


def test_no_blocks_leak_over_100_generate_calls() -> None:
    model, _ = model_pair("llama", "paged")
    manager = make_manager(model, num_blocks=48)
    free_at_start = manager.stats().free_blocks
    endings: list[Callable[[PagedCache], None]] = [PagedCache.release, PagedCache.close, PagedCache.reset]
    for call in range(100):
        ids, mask = prompts(1 + call % 3, 4 + call % 5, pads=(call % 2,), seed=call)
        if call % 4 == 3:  # dropped without release: released as its last reference goes (no cycles)
            generate(model, ids, mask, PagedCache(manager, model.config), max_new_tokens=2)
        elif call % 4 == 2:
            with PagedCache(manager, model.config) as cache:
                generate(model, ids, mask, cache, max_new_tokens=2)
        else:
            cache = PagedCache(manager, model.config)
            generate(model, ids, mask, cache, max_new_tokens=2)
            assert manager.stats().free_blocks < free_at_start
            endings[call % 3](cache)
        stats = manager.stats()
        assert (stats.free_blocks, stats.active_caches) == (free_at_start, 0), f"generate call {call}"
    manager.check_invariants()


def test_a_released_cache_serves_a_new_batch() -> None:
    model, reference = model_pair("llama", "paged")
    manager = make_manager(model)
    cache = PagedCache(manager, model.config)
    generate(model, *prompts(3, 5), cache)
    cache.release()
    assert (cache.batch_size, cache.get_seq_length(), manager.stats().used_blocks) == (0, 0, 0)
    ids, mask = prompts(1, 9, seed=12)
    ours = generate(model, ids, mask, cache)
    cache.release()
    assert max_logit_difference(ours.logits, generate(reference, ids, mask).logits) <= TOLERANCE


def test_generate_continues_a_cache_passed_again() -> None:
    model, reference = model_pair("llama", "paged")
    manager = make_manager(model)
    ids, mask = prompts(1, 6, seed=13)
    with PagedCache(manager, model.config) as cache:
        first = generate(model, ids, mask, cache, max_new_tokens=3)
        continued = generate(model, first.sequences, torch.ones_like(first.sequences), cache, max_new_tokens=3)
    expected = generate(reference, ids, mask, max_new_tokens=6)
    assert torch.equal(continued.sequences, expected.sequences)
    assert max_logit_difference(continued.logits, expected.logits[3:]) <= TOLERANCE


# -- bad input: specific errors, nothing changed ----------------------------------------------


def test_a_pool_of_another_geometry_is_refused() -> None:
    model, _ = model_pair("llama", "paged")
    manager: PagedKvCacheManager[Tensor] = create_manager(
        "torch", CacheConfig(num_layers=2, num_heads=4, head_dim=16, num_blocks=8)
    )
    with pytest.raises(UnsupportedConfigError, match=r"2 KV heads.*4 heads"):
        PagedCache(manager, model.config)


def _bfloat16_pool(model: Model) -> PagedKvCacheManager[Tensor]:
    return create_manager("torch", cache_config_for(model.config, num_blocks=16, block_size=4, dtype="bfloat16"))


def _four_block_pool(model: Model) -> PagedKvCacheManager[Tensor]:
    return make_manager(model, num_blocks=4)


@pytest.mark.parametrize(
    ("pool_for", "batch", "length", "error", "match"),
    [
        pytest.param(_bfloat16_pool, 1, 5, DTypeMismatchError, r"torch\.float32.*bfloat16", id="another-dtype"),
        pytest.param(_four_block_pool, 2, 12, OutOfBlocksError, "6 more blocks needed", id="too-small"),
    ],
)
def test_a_pool_that_cannot_take_the_prompt_raises_before_taking_blocks(
    pool_for: Callable[[Model], PagedKvCacheManager[Tensor]],
    batch: int,
    length: int,
    error: type[Exception],
    match: str,
) -> None:
    model, _ = model_pair("llama", "paged")
    manager = pool_for(model)
    ids, mask = prompts(batch, length)
    with PagedCache(manager, model.config) as cache:
        with pytest.raises(error, match=match):
            forward(model, ids, mask, 0, cache)
        assert (manager.stats().used_blocks, cache.batch_size) == (0, 0)


def test_a_decode_step_without_room_raises_and_leaves_the_rows_as_they_were() -> None:
    with prefilled(2, 12, num_blocks=6) as (model, manager, cache, ids, mask):
        assert manager.stats().free_blocks == 0
        grown = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        with pytest.raises(OutOfBlocksError):
            forward(model, ids[:, :1], grown, 12, cache)
        assert cache.request_lengths() == [12, 12]
        cache.crop(-4)  # make room, then go on: the failed step left nothing behind
        forward(model, ids[:, 8:10], mask, 8, cache)
        assert cache.request_lengths() == [10, 10]


def test_a_new_batch_size_needs_a_release() -> None:
    with (
        prefilled(2, 5) as (model, _, cache, _, _),
        pytest.raises(ShapeMismatchError, match=r"holds 2 rows.*batch of 3"),
    ):
        forward(model, prompts(3, 1)[0], torch.ones(3, 6, dtype=torch.long), 5, cache)


def test_switching_attention_on_a_filled_cache_is_refused() -> None:
    with prefilled(1, 5) as (model, _, cache, ids, _):
        model.set_attn_implementation("sdpa")
        try:
            with pytest.raises(UnsupportedConfigError, match="release"):
                forward(model, ids[:, :1], torch.ones(1, 6, dtype=torch.long), 5, cache)
        finally:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)


def test_bad_indices_and_layers_raise() -> None:
    with prefilled(2, 5) as (_, _, cache, _, _):
        ids_before = cache.request_ids
        with pytest.raises(InvalidArgumentError, match="names row 2: valid rows are 0 to 1"):
            cache.reorder_cache(torch.tensor([0, 2]))
        with pytest.raises(InvalidArgumentError, match="one source per row"):
            cache.reorder_cache(torch.tensor([0]))
        with pytest.raises(InvalidArgumentError, match="repeats"):
            cache.batch_repeat_interleave(0)
        with pytest.raises(LayerIndexError, match="valid layers are 0 to 1"):
            cache.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 2)
        with pytest.raises(ShapeMismatchError):
            cache.update(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16), 0)
        assert cache.request_ids == ids_before
        assert cache.request_lengths() == [5, 5]


def test_a_custom_mask_pattern_is_refused_by_the_paged_attention() -> None:
    def bidirectional(batch: int, head: int, query: int, key: int) -> bool:
        return True

    with pytest.raises(UnsupportedConfigError, match="another mask pattern"):
        paged_attention_mask(1, 4, 4, mask_function=bidirectional)
    # A sliding window or chunk (local_size) is the attention's to apply, per layer: the mask
    # function hands on the padding mask whatever the context's length.
    assert paged_attention_mask(1, 1, 9, local_size=8, mask_function=bidirectional) is None


def test_cache_config_for_reads_the_model_geometry() -> None:
    model, _ = model_pair("qwen3", "paged")
    config = cache_config_for(model.config, max_tokens=100, block_size=16, dtype=torch.bfloat16)
    assert (config.num_layers, config.num_heads, config.head_dim) == (2, 2, 16)
    assert (config.num_blocks, config.dtype, str(config.device)) == (7, "bfloat16", "cpu")
    with pytest.raises(InvalidArgumentError, match="exactly one of num_blocks or max_tokens"):
        cache_config_for(model.config)
    with pytest.raises(UnsupportedConfigError, match="int8"):
        cache_config_for(model.config, num_blocks=4, dtype=torch.int8)
    with pytest.raises(InvalidTypeError, match="a transformers model or its config"):
        cache_config_for(torch.nn.Linear(2, 2), num_blocks=4)


def test_cache_config_for_a_model_takes_the_dtype_of_its_weights() -> None:
    model = copy.deepcopy(model_pair("llama", "paged")[0]).to(torch.bfloat16)
    assert cache_config_for(model, num_blocks=4).dtype == "bfloat16"
    assert cache_config_for(model.config, num_blocks=4).dtype == "float32"  # the config still says float32
    assert cache_config_for(model, num_blocks=4, dtype="float16").dtype == "float16"


def prefix_caching_manager(model: Model, block_size: int = 16) -> PagedKvCacheManager[Tensor]:
    config = dataclasses.replace(
        cache_config_for(model, num_blocks=96, block_size=block_size), enable_prefix_caching=True
    )
    manager: PagedKvCacheManager[Tensor] = create_manager("torch", config)
    return manager


def test_a_second_generate_on_a_shared_prompt_computes_only_the_uncached_tokens() -> None:
    model, _ = model_pair("llama", "paged")
    manager = prefix_caching_manager(model)
    ids, mask = prompts(1, 200, seed=13)
    computed: list[int] = []

    def count_new_tokens(_module: Model, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input_ids: Tensor = kwargs["input_ids"]
        computed.append(int(input_ids.shape[1]))

    hook = model.register_forward_pre_hook(count_new_tokens, with_kwargs=True)
    runs: list[tuple[int, Any, int]] = []
    try:
        for _ in range(2):
            computed.clear()
            with PagedCache(manager, model.config) as cache:
                cached = cache.map_cached_prefix(ids, mask)
                runs.append((cached, generate(model, ids, mask, cache), computed[0]))
    finally:
        hook.remove()
    (first_cached, first, first_computed), (second_cached, second, second_computed) = runs
    assert (first_cached, first_computed) == (0, 200)
    assert second_cached == (200 - 1) // 16 * 16 == 192  # every full block but the one of the last token
    assert second_computed == 200 - 192
    assert manager.stats().prefix_cache_hits >= (200 - 1) // 16
    assert torch.equal(first.sequences, second.sequences)
    assert max_logit_difference(second.logits, first.logits) <= 1e-5
    assert manager.stats().used_blocks == 0


def test_rows_keep_only_the_cached_positions_every_row_shares() -> None:
    model, reference = model_pair("llama", "paged")
    manager = prefix_caching_manager(model, block_size=4)
    long_ids, _ = prompts(1, 12, seed=14)
    with PagedCache(manager, model.config) as cache:  # caches the 12-token prompt's full blocks
        cache.map_cached_prefix(long_ids)
        generate(model, long_ids, torch.ones_like(long_ids), cache, max_new_tokens=1)
    ids = torch.cat([long_ids, torch.cat([torch.zeros(1, 4, dtype=torch.long), long_ids[:, :8]], dim=1)])
    mask = torch.cat([torch.ones(1, 12, dtype=torch.long), torch.tensor([[0] * 4 + [1] * 8])])
    with PagedCache(manager, model.config) as cache:
        # Row 0 hits 8 tokens (2 blocks; the last is always computed), row 1 hits 4 after 4
        # padding columns: both share 8 cached positions.
        assert cache.map_cached_prefix(ids, mask) == 8
        assert cache.request_lengths() == [8, 4]
        ours = generate(model, ids, mask, cache)
    expected = generate(reference, ids, mask)
    assert torch.equal(ours.sequences, expected.sequences)
    assert max_logit_difference(ours.logits, expected.logits) <= TOLERANCE


def test_map_cached_prefix_refuses_a_filled_cache_and_right_padding() -> None:
    model, _ = model_pair("llama", "paged")
    manager = prefix_caching_manager(model)
    ids, mask = prompts(2, 6)
    with PagedCache(manager, model.config) as cache:
        with pytest.raises(InvalidArgumentError, match=r"row 1 .* not left-padded"):
            cache.map_cached_prefix(ids, torch.tensor([[1] * 6, [1] * 5 + [0]]))
        assert manager.stats().active_caches == 0
        cache.map_cached_prefix(ids, mask)
        with pytest.raises(InvalidArgumentError, match="release"):
            cache.map_cached_prefix(ids, mask)


def test_a_left_padded_first_forward_attends_each_row_over_its_real_tokens_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvcache_torch.hf.attention as hf_attention

    model, reference = model_pair("llama", "paged")
    manager = make_manager(model)
    lengths: list[tuple[int, int]] = []
    sdpa = hf_attention.contiguous_attention

    def spy(module: Any, query: Tensor, key: Tensor, *arguments: Any) -> Any:
        lengths.append((int(query.shape[0]), int(key.shape[2])))
        return sdpa(module, query, key, *arguments)

    monkeypatch.setattr(hf_attention, "contiguous_attention", spy)
    ids, mask = prompts(3, 9, pads=(0, 4, 9 - 1))
    with PagedCache(manager, model.config) as cache:
        ours = forward(model, ids, mask, 0, cache)
    assert lengths == [(1, 9), (1, 5), (1, 1)] * model.config.num_hidden_layers  # no padding position
    expected = forward(reference, ids, mask, 0, transformers.DynamicCache(config=reference.config))
    real = mask.bool()
    assert max_logit_difference([ours[real]], [expected[real]]) <= TOLERANCE


def test_only_left_padding_counts_as_rows_of_real_suffixes() -> None:
    from kvcache_torch.hf.padding import left_padded_lengths

    left = torch.tensor([[False, False, True, True], [True, True, True, True], [False, False, False, False]])
    assert left_padded_lengths(left) == [2, 4, 0]
    assert left_padded_lengths(torch.tensor([[True, True, False, False]])) is None  # right padding
    assert left_padded_lengths(torch.tensor([[False, True, False, True]])) is None  # a hole
