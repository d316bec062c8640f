"""The catalogue of model families :class:`PagedCache` serves, by path, with the reason: what
``tests/torch/test_hf_models.py`` runs against ``DynamicCache`` and prints as the README's
table (so the table cannot drift from what passes).

``states``: the model keeps no K/V (Mamba2): only the pool's state slots serve it.
``paged``: the model runs ``attn_implementation="kvcache_paged"`` (its attention goes through
transformers' attention interface; the paged kernel reads the pool in place). ``contiguous``:
the model keeps its own attention and :class:`PagedCache` returns contiguous K/V, as
``DynamicCache`` does.

Every family is built tiny (two to four layers, hidden size 32 or 64), each model on its own
config object, with ``initializer_range >= 0.1`` so that a wrong context shows in the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.torch.hf_support import COMMON_CONFIG, PAD, VOCAB, Model, torch, transformers

__all__ = [
    "FAMILIES",
    "GEMMA4",
    "LATENT_MODELS",
    "STATE_ATTENTION",
    "STATE_COMMON",
    "STATE_MODELS",
    "TABLE_BEGIN",
    "TABLE_END",
    "Family",
    "model_table",
]

#: The sliding window or attention chunk of the tiny hybrid models (prompts outgrow it).
WINDOW = 6

#: Fields of the tiny models that are not Llama-style decoders.
_SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "initializer_range": 0.2,
    "pad_token_id": PAD,
    "bos_token_id": 1,
    "eos_token_id": None,
}

_INTERFACE = "attention through transformers' interface"
_OWN = "computes attention itself: `kvcache_paged` would never be called"
_BY_NAME = "picks its attention classes by name: `kvcache_paged` is rejected at load"


@dataclass(frozen=True)
class Family:
    """One model family: how to build it tiny, which path serves it and why.

    Attributes:
        name: the family as the README names it.
        config_class, model_class: transformers' class names.
        fields: the tiny config's fields.
        path: ``"paged"``, ``"contiguous"`` or ``"states"``.
        why: the reason for the path (and what the family adds).
        attention: the model's own attention (the reference's, and the tested one on the
            contiguous path).
    """

    name: str
    config_class: str
    model_class: str
    fields: dict[str, Any] = field(default_factory=dict[str, Any])
    path: str = "paged"
    why: str = _INTERFACE
    attention: str = "sdpa"

    def build(self) -> Model:
        """A seeded tiny model on a config object of its own, with its own attention."""
        torch.manual_seed(0)
        config = getattr(transformers, self.config_class)(**self.fields)
        model = getattr(transformers, self.model_class)(config).eval()
        with torch.no_grad():  # attention sinks start at zero: make them matter
            for module in model.modules():
                sinks: Any = getattr(module, "sinks", None)
                if isinstance(sinks, torch.nn.Parameter):
                    sinks.normal_(0.0, 1.0)
        model.set_attn_implementation(self.attention)
        return model


def _decoder(**fields: Any) -> dict[str, Any]:
    return {**COMMON_CONFIG, **fields}


def _hybrid(**fields: Any) -> dict[str, Any]:
    return {**COMMON_CONFIG, "num_hidden_layers": 4, "sliding_window": WINDOW, **fields}


#: A tiny Gemma 4 text decoder: its full layers have a head size (``global_head_dim``) and KV
#: head count (``num_global_key_value_heads``, with ``attention_k_eq_v``) of their own.
GEMMA4: dict[str, Any] = _hybrid(
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    layer_types=["sliding_attention", "full_attention"] * 2,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
)

#: The fields every tiny recurrent-state model shares.
STATE_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,
}
STATE_ATTENTION: dict[str, Any] = {"intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2}
_MAMBA2: dict[str, Any] = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "mamba_expand": 2,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 8,
}

#: family -> (config class, model class, fields, paths): tiny random configs, state and
#: attention layers alternating where the family has both.
STATE_MODELS: dict[str, tuple[str, str, dict[str, Any], tuple[str, ...]]] = {
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        {
            "num_heads": 8,
            "head_dim": 16,
            "state_size": 16,
            "n_groups": 2,
            "expand": 2,
            "conv_kernel": 4,
            "chunk_size": 8,
        },
        ("states",),
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        {**STATE_ATTENTION, **_MAMBA2, "attn_layer_indices": [1, 3]},
        ("paged", "contiguous"),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {
            **STATE_ATTENTION,
            **_MAMBA2,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "shared_intermediate_size": 64,
        },
        ("paged", "contiguous"),
    ),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            **STATE_ATTENTION,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 8,
            "use_mamba_kernels": False,
        },
        ("paged", "contiguous"),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **STATE_ATTENTION,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "full_attention_interval": 2,
        },
        ("paged", "contiguous"),
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {**STATE_ATTENTION, "full_attn_idxs": [1, 3], "conv_L_cache": 3},
        ("paged", "contiguous"),
    ),
    # Every layer runs a Mamba2 mixer and attention side by side: K/V and a state per layer.
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {**STATE_ATTENTION, **_MAMBA2, "mamba_d_ssm": 128},
        ("paged", "contiguous"),
    ),
    # Mamba2 layers; the hybrid ones run a shared attention block (weights tied across them,
    # K/V of their own) before their mixer.
    "zamba2": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        {
            **STATE_ATTENTION,
            "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
            "n_mamba_heads": 8,
            "mamba_d_state": 16,
            "mamba_ngroups": 2,
            "mamba_d_conv": 4,
            "chunk_size": 8,
            "use_mem_rope": True,
            "use_shared_attention_adapter": True,  # its adapters need as many KV heads as query heads
            "num_key_value_heads": 4,
            "adapter_rank": 8,
        },
        ("paged", "contiguous"),
    ),
    # Mamba2, attention, MLP and mixture-of-experts blocks: the last two keep nothing.
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {
            **STATE_ATTENTION,
            "head_dim": 16,
            "layers_block_type": ["mamba", "attention", "mlp", "moe"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 2,
            "conv_kernel": 4,
            "chunk_size": 8,
            "n_routed_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
        },
        ("paged", "contiguous"),
    ),
}

#: Models whose cached values differ in width from their keys: ``(config class, model class,
#: config fields, reference attention, path)``.
LATENT_MODELS: dict[str, tuple[str, str, dict[str, Any], str, str]] = {
    # Latent attention: a latent of 32 and a rotary part of 8 per token, whatever the heads.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
        "sdpa",
        "contiguous",
    ),
    "minicpm3": (
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        {"kv_lora_rank": 32, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16},
        "sdpa",
        "contiguous",
    ),
    # Keys of 24 features, values of 16, through transformers' attention interface (no sdpa).
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        {
            "head_dim": 24,
            "v_head_dim": 16,
            "layer_types": ["full_attention", "full_attention"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        "eager",
        "paged",
    ),
}

_LATENT_NAMES = {"deepseek_v3": "DeepSeek-V3", "minicpm3": "MiniCPM3", "mimo_v2_flash": "MiMo-V2-Flash"}
_LATENT = (
    "expands the cached latent into every head before attending: `kvcache_paged` is refused; the pool holds "
    "the latent (one head, `kv_lora_rank` keys and `qk_rope_head_dim` values per token)"
)


def _latent_family(key: str) -> Family:
    config_class, model_class, extra, attention, path = LATENT_MODELS[key]
    fields = {**COMMON_CONFIG, "num_attention_heads": 4, "num_key_value_heads": 4, **extra}
    why = _LATENT if path == "contiguous" else f"{_INTERFACE}; values of another width than the keys (`v_head_dim`)"
    return Family(_LATENT_NAMES[key], config_class, model_class, fields, path, why, attention=attention)


_STATE_NAMES = {
    "mamba2": "Mamba2",
    "bamba": "Bamba",
    "granitemoehybrid": "Granite 4 hybrid",
    "jamba": "Jamba",
    "qwen3_next": "Qwen3-Next",
    "lfm2": "LFM2",
    "falcon_h1": "Falcon-H1",
    "zamba2": "Zamba2",
    "nemotron_h": "Nemotron-H",
}
_STATES = "recurrent states in the pool's state slots, one per batch row"
#: What a family adds beyond state layers beside attention layers.
_STATE_EXTRA = {
    "falcon_h1": "; every layer keeps K/V and a state (`LayerSpec(state=..., keeps_kv=True)`)",
    "zamba2": "; hybrid layers keep K/V and a state, their shared attention block K/V per layer",
    "nemotron_h": "; MLP and mixture-of-experts layers keep nothing (`LayerSpec(keeps_kv=False)`)",
}


def _state_family(key: str) -> Family:
    config_class, model_class, fields, paths = STATE_MODELS[key]
    if paths[0] == "states":
        name, fields = _STATE_NAMES[key], {**STATE_COMMON, **fields}
        return Family(name, config_class, model_class, fields, "states", _STATES, attention="eager")
    why = f"{_INTERFACE} on its attention layers; {_STATES}{_STATE_EXTRA.get(key, '')}"
    return Family(_STATE_NAMES[key], config_class, model_class, {**STATE_COMMON, **fields}, why=why)


_BY_HAND: tuple[Family, ...] = (
    Family("Llama", "LlamaConfig", "LlamaForCausalLM", _decoder()),
    Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", _decoder()),
    Family(
        "Qwen2, sliding window",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        _hybrid(use_sliding_window=True, max_window_layers=1),
        why=f"{_INTERFACE}; sliding layers keep their window's blocks",
    ),
    Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", _decoder(head_dim=16)),
    Family(
        "Mistral",
        "MistralConfig",
        "MistralForCausalLM",
        _hybrid(),
        why=f"{_INTERFACE}; every layer slides",
    ),
    Family("Gemma", "GemmaConfig", "GemmaForCausalLM", _decoder(head_dim=16)),
    Family(
        "Gemma 2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        _hybrid(head_dim=16, attn_logit_softcapping=1.0, final_logit_softcapping=None),
        why=f"{_INTERFACE}; sliding and full layers, logit soft-capping",
        attention="eager",
    ),
    Family(
        "Gemma 3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        _hybrid(head_dim=16, layer_types=["sliding_attention", "full_attention"] * 2),
        why=f"{_INTERFACE}; sliding and full layers",
        attention="eager",
    ),
    Family(
        "Gemma 3n",
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        _hybrid(
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            activation_sparsity_pattern=[0.0] * 4,
        ),
        why=f"{_INTERFACE}; its last layers reuse earlier layers' K/V and keep no blocks",
    ),
    Family(
        "Gemma 4",
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {**GEMMA4},
        why=f"{_INTERFACE}; full layers of their own head size and KV heads (per-layer geometry: sliding layers "
        "keep their window's blocks, side by side in pages of the full layers' width)",
    ),
    Family("Phi-3", "Phi3Config", "Phi3ForCausalLM", _decoder()),
    Family(
        "gpt-oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        _hybrid(head_dim=16, num_local_experts=4, num_experts_per_tok=2),
        why=f"{_INTERFACE}; sliding and full layers, attention sinks, mixture of experts",
        attention="eager",
    ),
    Family(
        "Cohere 2",
        "Cohere2Config",
        "Cohere2ForCausalLM",
        _hybrid(),
        why=f"{_INTERFACE}; sliding and full layers",
    ),
    Family(
        "Llama 4 (text)",
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        _hybrid(
            head_dim=16,
            intermediate_size_mlp=96,
            attention_chunk_size=WINDOW,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        why=f"{_INTERFACE}; chunked attention, mixture of experts",
    ),
    Family(
        "Falcon",
        "FalconConfig",
        "FalconForCausalLM",
        {**_SMALL, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "multi_query": True},
        path="contiguous",
        why=_BY_NAME,
    ),
    Family(
        "GPT-Neo",
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        {**_SMALL, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "attention_types": [[["global", "local"], 1]]},
        path="contiguous",
        why=_BY_NAME,
        attention="eager",
    ),
    Family(
        "Bloom",
        "BloomConfig",
        "BloomForCausalLM",
        {**_SMALL, "hidden_size": 32, "n_layer": 2, "n_head": 4},
        path="contiguous",
        why=_OWN,
        attention="eager",
    ),
    Family(
        "MPT",
        "MptConfig",
        "MptForCausalLM",
        {**_SMALL, "d_model": 32, "n_layers": 2, "n_heads": 4, "expansion_ratio": 2, "use_cache": True},
        path="contiguous",
        why=_OWN,
        attention="eager",
    ),
    Family(
        "XGLM",
        "XGLMConfig",
        "XGLMForCausalLM",
        {**_SMALL, "d_model": 32, "num_layers": 2, "attention_heads": 4, "ffn_dim": 64, "init_std": 0.2},
        path="contiguous",
        why=_OWN,
        attention="eager",
    ),
    Family(
        "GPT-NeoX-Japanese",
        "GPTNeoXJapaneseConfig",
        "GPTNeoXJapaneseForCausalLM",
        {
            **_SMALL,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_multiple_size": 2,
        },
        path="contiguous",
        why=_OWN,
        attention="eager",
    ),
)

#: Every family: the ones written out above, then those with values of their own width, then
#: those with recurrent states.
FAMILIES: tuple[Family, ...] = (
    _BY_HAND + tuple(_latent_family(key) for key in LATENT_MODELS) + tuple(_state_family(key) for key in STATE_MODELS)
)

#: The comment lines around the README's generated table.
TABLE_BEGIN = (
    "<!-- model families: generated by tests/torch/test_hf_models.py from tests/torch/hf_models.py; "
    "KVCACHE_WRITE_MODEL_TABLE=1 rewrites it -->"
)
TABLE_END = "<!-- model families: end -->"


def model_table(families: tuple[Family, ...] = FAMILIES) -> str:
    """The README's table of the families by path: paged first, then contiguous, each in
    catalogue order."""
    lines = ["| family | transformers class | path | why |", "| --- | --- | --- | --- |"]
    for path in ("paged", "contiguous", "states"):
        lines += [
            f"| {family.name} | `{family.model_class}` | {path} | {family.why} |"
            for family in families
            if family.path == path
        ]
    return "\n".join(lines)
