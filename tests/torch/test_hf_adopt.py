"""kvcache_torch.hf: a :class:`PagedCache` that goes on from existing requests
(``PagedCache(manager, model, handles=[...])``), as a decode worker goes on from a request
imported from a prefill worker: ``generate`` computes only the tokens past them.

Every equality test compares fp32 logits with ``DynamicCache``'s (max abs difference
<= 1e-4) and the greedy tokens exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest

from kvcache_core import (
    AllocationRequest,
    InvalidArgumentError,
    PagedKvCacheManager,
    create_manager,
)
from kvcache_torch.hf.attention_choice import AttentionChoice
from tests.torch.hf_models import STATE_COMMON, STATE_MODELS
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    TOLERANCE,
    Model,
    PagedCache,
    Tensor,
    cache_config_for,
    generate,
    max_logit_difference,
    model_pair,
    one_thread,  # noqa: F401  # pyright: ignore[reportUnusedImport]  # a fixture, used by pytestmark
    prompts,
    torch,
    transformers,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 8


def pool(model: Model, *, prefix_caching: bool = True) -> PagedKvCacheManager[Tensor]:
    config = dataclasses.replace(
        cache_config_for(model, num_blocks=64, block_size=BLOCK), enable_prefix_caching=prefix_caching
    )
    manager: PagedKvCacheManager[Tensor] = create_manager("torch", config)
    return manager


def computed_per_forward(model: Model) -> tuple[list[int], Any]:
    """The tokens each forward of ``model`` embeds (what it computes), and the hook to remove."""
    counts: list[int] = []

    def count(_module: Any, inputs: tuple[Any, ...], _output: Any) -> None:
        counts.append(int(inputs[0].shape[1]))

    return counts, model.model.embed_tokens.register_forward_hook(count)


def prefilled(
    model: Model, manager: PagedKvCacheManager[Tensor], ids: Tensor, attention: AttentionChoice = "model"
) -> tuple[Any, Any]:
    """Prefill ``ids`` and generate the first token; a fork of the request (what an import
    gives: the prompt's tokens, nothing more) and the first step's output."""
    with PagedCache(manager, model, attention=attention) as cache:
        first = generate(model, ids, torch.ones_like(ids), cache, max_new_tokens=1)
        cache.flush_states()  # the last forward's states into the slots, which a fork copies
        copies = [manager.fork(handle, f"copy-{row}") for row, handle in enumerate(cache.handles)]
    return copies, first


@pytest.mark.parametrize("path", ["paged", "sdpa", "auto"])  # auto: an sdpa model the cache switches
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix caching", "no prefix caching"])
def test_generate_goes_on_from_adopted_requests_computing_only_the_new_tokens(path: str, prefix_caching: bool) -> None:
    model, reference = model_pair("llama", "sdpa" if path == "auto" else path)
    attention: AttentionChoice = "auto" if path == "auto" else "model"
    manager = pool(model, prefix_caching=prefix_caching)
    ids, mask = prompts(2, 29, seed=31)
    handles, first = prefilled(model, manager, ids, attention)
    counts, hook = computed_per_forward(model)
    try:
        with PagedCache(manager, model, handles=handles, attention=attention) as cache:
            assert cache.get_seq_length() == 29
            assert cache.request_ids == ("copy-0", "copy-1")
            rest = generate(model, first.sequences, torch.ones_like(first.sequences), cache, max_new_tokens=16)
            assert cache.request_lengths() == [29 + 16, 29 + 16]
    finally:
        hook.remove()
    assert counts == [1] * 16  # the first token onward, one per step: no prompt token
    expected = generate(reference, ids, mask, max_new_tokens=17)
    assert torch.equal(rest.sequences, expected.sequences)
    assert max_logit_difference([first.logits[0], *rest.logits], expected.logits) <= TOLERANCE
    assert manager.list_handles() == []  # leaving the cache released the adopted requests
    manager.check_invariants()


def test_an_adopted_request_whose_ids_are_known_caches_the_blocks_decode_writes() -> None:
    model, _ = model_pair("llama", "paged")
    manager = pool(model)
    ids, _ = prompts(1, 16, seed=32)
    (handle,), first = prefilled(model, manager, ids)
    with PagedCache(manager, model, handles=[handle], attention="model") as cache:
        rest = generate(model, first.sequences, torch.ones_like(first.sequences), cache, max_new_tokens=9)
    again = manager.allocate(AllocationRequest("again", prompt_token_ids=(*rest.sequences[0].tolist(), 5)))
    assert again.num_cached_tokens() == 24  # the prompt's 2 blocks and the one decode filled


@pytest.mark.parametrize(
    "case",
    ["no handles", "a handle twice", "different lengths", "a released request", "another manager's request"],
)
def test_handles_that_are_not_one_batch_of_live_requests_are_refused_by_name(case: str) -> None:
    model, _ = model_pair("llama", "paged")
    manager = pool(model)
    other = pool(model)
    a = manager.allocate(AllocationRequest("a"))
    manager.extend(a, 5)
    b = manager.allocate(AllocationRequest("b"))
    manager.extend(b, 6 if case == "different lengths" else 5)
    foreign = other.allocate(AllocationRequest("a"))
    other.extend(foreign, 5)
    handles: list[Any] = {
        "no handles": [],
        "a handle twice": [a, a],
        "different lengths": [a, b],
        "a released request": [a, b],
        "another manager's request": [foreign],
    }[case]
    if case == "a released request":
        manager.deallocate("b")
    with pytest.raises(InvalidArgumentError, match=r"handles|live request|twice|tokens"):
        PagedCache(manager, model, handles=handles, attention="model")
    assert sorted(rid for rid, _ in manager.list_handles()) == (["a"] if case == "a released request" else ["a", "b"])
    assert a.num_tokens() == 5
    manager.check_invariants()


def test_an_empty_request_is_refused() -> None:
    model, _ = model_pair("llama", "paged")
    manager = pool(model)
    empty = manager.allocate(AllocationRequest("empty"))
    with pytest.raises(InvalidArgumentError, match=r"\[0\] tokens"):
        PagedCache(manager, model, handles=[empty], attention="model")
    assert manager.get_handle("empty") == empty


def hybrid(family: str) -> tuple[Model, Model, PagedKvCacheManager[Tensor]]:
    """A hybrid model of ``family`` (reference, and a copy on the paged path) and a pool for it."""
    config_name, model_name, fields, _ = STATE_MODELS[family]
    torch.manual_seed(0)
    reference = getattr(transformers, model_name)(getattr(transformers, config_name)(**{**STATE_COMMON, **fields}))
    reference = reference.eval()
    model = copy.deepcopy(reference)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    config = cache_config_for(model, num_blocks=64, block_size=BLOCK, state_slots=4)
    manager: PagedKvCacheManager[Tensor] = create_manager("torch", config)
    return reference, model, manager


@pytest.mark.parametrize("family", ["bamba", "qwen3_next"])
def test_a_hybrid_model_goes_on_from_adopted_requests_and_their_states(family: str) -> None:
    reference, model, manager = hybrid(family)
    ids, mask = prompts(1, 21, seed=33)
    # The fork copies the state slots: cache.flush_states() wrote the prefill's last states there.
    (handle,), first = prefilled(model, manager, ids)
    counts, hook = computed_per_forward(model)
    try:
        with PagedCache(manager, model, handles=[handle], attention="model") as cache:
            rest = generate(model, first.sequences, torch.ones_like(first.sequences), cache, max_new_tokens=12)
    finally:
        hook.remove()
    assert counts == [1] * 12  # no prompt token: the state layers went on from the slots
    expected = generate(reference, ids, mask, max_new_tokens=13)
    assert torch.equal(rest.sequences, expected.sequences)
    assert max_logit_difference([first.logits[0], *rest.logits], expected.logits) <= TOLERANCE
    assert manager.list_handles() == []
    manager.check_invariants()


def _slot_bytes(manager: PagedKvCacheManager[Tensor], handle: Any) -> list[bytes]:
    from kvcache_core.transfer.digests import host_memory

    return [bytes(host_memory(region.address, region.length_bytes)) for region in manager.state_regions(handle)]


def test_flush_states_writes_the_last_states_to_the_slots_and_handles_still_does_with_a_warning() -> None:
    ids, _ = prompts(1, 21, seed=33)
    slots: dict[str, list[bytes]] = {}
    for way in ("flush_states", "handles"):  # the same model and prompt, in a pool of its own each
        _, model, manager = hybrid("bamba")
        with manager, PagedCache(manager, model, attention="model") as cache:
            generate(model, ids, torch.ones_like(ids), cache, max_new_tokens=1)
            (handle,) = cache._rows.handles  # pyright: ignore[reportPrivateUsage]  # no side effect
            before = _slot_bytes(manager, handle)
            if way == "flush_states":
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    cache.flush_states()
                    assert cache.handles == (handle,)  # nothing left to write: no warning
            else:
                with pytest.warns(DeprecationWarning, match=r"flush_states\(\)"):
                    assert cache.handles == (handle,)
            slots[way] = _slot_bytes(manager, handle)
            assert slots[way] != before  # the last forward's states were in tensors only
    assert slots["flush_states"] == slots["handles"]
