"""transformers with a quantized pool: ``cache_config_for(model, dtype="int8" | "float8_e4m3fn")``
gives a pool that computes in the model's dtype, and ``generate`` through :class:`PagedCache`
stays close to the float32 ``DynamicCache`` run (benchmarks/quantized.py prints the first
divergent step and the logit differences over 24 tokens)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvcache_core import create_manager
from tests.torch.hf_support import (
    ATTN_IMPLEMENTATION,
    Model,
    PagedCache,
    build_model,
    cache_config_for,
    torch,
)

#: The architectures run with a quantized pool (of ``tests.torch.hf_support.ARCHITECTURES``).
QUANTIZED_ARCHITECTURES = ("llama", "mistral", "qwen2")
#: The first step's logits may move by this fraction of their largest magnitude.
FIRST_STEP_BOUNDS = {"int8": 0.05, "float8_e4m3fn": 0.15}


def generate(model: Model, ids: Any, cache: PagedCache | None = None) -> Any:
    options: dict[str, Any] = {
        "max_new_tokens": 24,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
        "pad_token_id": 0,
    }
    if cache is not None:
        options["cache"] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **options)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_cache_config_for_a_quantized_dtype_computes_in_the_models_dtype(dtype: str) -> None:
    model = build_model("llama")
    config = cache_config_for(model, dtype=dtype, max_tokens=64)
    assert (config.dtype, config.io_dtype) == (dtype, "float32")
    half = cache_config_for(model.to(torch.bfloat16), dtype=dtype, max_tokens=64)
    assert (half.dtype, half.io_dtype) == (dtype, "bfloat16")
    assert cache_config_for(model.config, dtype=dtype, max_tokens=64).io_dtype == "float32"


@pytest.mark.parametrize("architecture", QUANTIZED_ARCHITECTURES)
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("implementation", [ATTN_IMPLEMENTATION, "sdpa"])
def test_generate_on_a_quantized_pool_starts_like_the_float32_dynamic_cache(
    architecture: str, dtype: str, implementation: str
) -> None:
    reference = build_model(architecture)
    reference.set_attn_implementation("sdpa")
    model = copy.deepcopy(reference)
    model.set_attn_implementation(implementation)
    ids = torch.randint(3, 101, (1, 16), generator=torch.Generator().manual_seed(1))
    expected = generate(reference, ids)
    paged = implementation == ATTN_IMPLEMENTATION  # the contiguous path reads every position back
    config = cache_config_for(model, dtype=dtype, max_tokens=64, block_size=4, hybrid=paged)
    manager = create_manager("torch", config)
    with PagedCache(manager, model.config) as cache:
        got = generate(model, ids, cache)
    assert got.sequences.shape == expected.sequences.shape
    first_got, first_expected = got.logits[0], expected.logits[0]
    largest = float(first_expected.abs().max())
    assert float((first_got - first_expected).abs().max()) <= FIRST_STEP_BOUNDS[dtype] * largest
    assert int(got.sequences[0, 16]) == int(expected.sequences[0, 16])
    assert manager.stats().used_blocks == 0  # released at the end of the with block
