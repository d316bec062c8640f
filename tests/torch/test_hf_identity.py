"""cache_config_for's namespace: a fingerprint of the model's config and the pool's dtype."""

from __future__ import annotations

import copy

from tests.torch.hf_support import cache_config_for, model_fingerprint, model_pair, torch


def test_the_default_model_id_is_the_config_and_dtype_fingerprint() -> None:
    model, _ = model_pair("llama", "paged")
    config = cache_config_for(model, num_blocks=4)
    assert config.model_id == model_fingerprint(model.config, "float32")
    assert config.model_id == cache_config_for(copy.deepcopy(model.config), num_blocks=8).model_id
    assert cache_config_for(model, num_blocks=4, model_id="mine@1").model_id == "mine@1"


def test_another_config_or_dtype_gives_another_namespace() -> None:
    model, _ = model_pair("llama", "paged")
    other = copy.deepcopy(model.config)
    other.rope_theta = float(getattr(other, "rope_theta", 10_000.0)) * 2
    ids = {
        cache_config_for(model.config, num_blocks=4).model_id,
        cache_config_for(other, num_blocks=4).model_id,
        cache_config_for(model.config, num_blocks=4, dtype=torch.bfloat16).model_id,
        cache_config_for(model_pair("qwen3", "paged")[0], num_blocks=4).model_id,
    }
    assert len(ids) == 4
