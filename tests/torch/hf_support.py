"""What the transformers tests share (imported first: it skips a test module on a machine
without torch or transformers, and hands out both and ``kvcache_torch.hf``'s names): tiny models (:data:`ARCHITECTURES`, :func:`model_pair`),
prompts, ``generate`` and one manual forward, the logit comparison, and a fixture that keeps
torch on one thread.

Every equality test compares fp32 logits with ``DynamicCache``'s (max abs difference
<= :data:`TOLERANCE`) at every real position.
"""

# ruff: noqa: E402  (torch, transformers and kvcache_torch.hf are imported after the skips)

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvcache_core import PagedKvCacheManager, create_manager

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
# Every test module importing this one is skipped on a machine without torch or transformers.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skips; the tests take these names from here.
from torch import nn as nn

from kvcache_torch.hf import ATTN_IMPLEMENTATION as ATTN_IMPLEMENTATION
from kvcache_torch.hf import PagedCache as PagedCache
from kvcache_torch.hf import cache_config_for as cache_config_for
from kvcache_torch.hf import guard as guard
from kvcache_torch.hf import model_fingerprint as model_fingerprint
from kvcache_torch.hf import paged_attention_mask as paged_attention_mask

Tensor = Any  # torch.Tensor, imported lazily above
Model = Any  # a transformers PreTrainedModel

TOLERANCE = 1e-4
VOCAB = 101
PAD = 0

#: Fields of the tiny Llama-style decoders: grouped-query attention (4 query heads, 2 KV heads).
COMMON_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "pad_token_id": PAD,
    "bos_token_id": 1,
    "eos_token_id": None,  # never stop early: both runs produce every step
}

#: Tiny decoder configs with grouped-query attention (4 query heads, 2 KV heads).
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),  # sliding_window 4096: the paged mask accepts it
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # Multi-query: one KV head for the 4 query heads (its num_key_value_heads is not read).
    "falcon": ("FalconConfig", "FalconForCausalLM", {"multi_query": True, "new_decoder_architecture": False}),
}


def build_model(architecture: str = "llama", **overrides: Any) -> Model:
    """A tiny random-weight model of ``architecture`` (seeded: the same weights every time)."""
    config_name, model_name, extra = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON_CONFIG, **extra, **overrides})
    return getattr(transformers, model_name)(config).eval()


_MODELS: dict[str, tuple[Model, Model]] = {}


def model_pair(architecture: str, implementation: str) -> tuple[Model, Model]:
    """``(model under test, reference)``: the same weights; the reference runs ``sdpa``
    with ``DynamicCache``, the model under test ``implementation``."""
    if architecture not in _MODELS:
        reference = build_model(architecture)
        reference.set_attn_implementation("sdpa")
        _MODELS[architecture] = (reference, copy.deepcopy(reference))
    reference, tested = _MODELS[architecture]
    tested.set_attn_implementation(ATTN_IMPLEMENTATION if implementation == "paged" else implementation)
    return tested, reference


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """These models are tiny: one thread is faster than two fighting over a busy CI core
    (a test module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prompts(batch: int, length: int, pads: Sequence[int] = (), seed: int = 1) -> tuple[Tensor, Tensor]:
    """Random token ids ``[batch, length]`` and their mask, row ``i`` left-padded by ``pads[i]``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = PAD
        mask[row, :pad] = 0
    return ids, mask


def generate(model: Model, ids: Tensor, mask: Tensor, cache: Any = None, **options: Any) -> Any:
    """Greedy ``generate`` of 6 tokens (``options`` change it) returning the logits of every
    step; ``cache``: a PagedCache, or ``None`` for transformers' ``DynamicCache``."""
    settings: dict[str, Any] = {
        "max_new_tokens": 6,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
        "pad_token_id": PAD,
        **options,
    }
    if cache is not None:
        settings["cache"] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **settings)


def max_logit_difference(ours: Sequence[Tensor], reference: Sequence[Tensor]) -> float:
    """The largest absolute difference between two runs' logits, step by step."""
    assert len(ours) == len(reference)
    return max(float((a - b).abs().max()) for a, b in zip(ours, reference, strict=True))


def forward(model: Model, ids: Tensor, mask: Tensor, seen: int, cache: Any) -> Tensor:
    """One manual forward of ``ids`` (the positions after ``seen``) with the whole mask so far;
    returns the logits ``[batch, new, vocab]``."""
    full_mask = mask[:, : seen + ids.shape[1]]
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, seen:]
    with torch.no_grad():
        output = model(input_ids=ids, attention_mask=full_mask, position_ids=positions, cache=cache, use_cache=True)
    return output.logits


def make_manager(
    model: Model, num_blocks: int = 96, block_size: int = 4, *, hybrid: bool = True
) -> PagedKvCacheManager[Tensor]:
    """A torch manager of ``cache_config_for(model, hybrid=hybrid)`` (both paths serve a pool
    of KV-cache groups)."""
    manager: PagedKvCacheManager[Tensor] = create_manager(
        "torch", cache_config_for(model, num_blocks=num_blocks, block_size=block_size, hybrid=hybrid)
    )
    return manager
