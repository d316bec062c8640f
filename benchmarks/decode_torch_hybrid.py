"""One decode step of a hybrid-attention model in torch: kvcache's KV-cache groups against
transformers' hybrid ``DynamicCache``, side by side.

One request of ``--context`` tokens (8192) in a model of ``--layers`` layers whose even layers
slide with a window of ``--window`` (1024) and whose odd layers attend to everything (Gemma 2's
and gpt-oss's pattern), fp32 on the CPU:

* **ours** -- a pool with each layer's spec (``CacheConfig(layer_specs=...)``): the sliding
  layers form their own KV-cache group, whose tables keep only the window's blocks, and
  ``step.write_and_attend`` applies each layer's window from the config;
* **DynamicCache** -- built from a config with those ``layer_types``: it keeps only the last
  ``W - 1`` tokens of a sliding layer, and transformers' ``sdpa`` function needs no mask for a
  decode token (as in the model).

Printed: both times and DynamicCache / ours, and the KV memory each holds. Every step, the
outputs are compared (exit status 1 if they differ); the first 5 steps are untimed (a new
shape's set-up, and the dispatch's trial steps of a decode class never measured here), then
medians over ``--repeats`` steps, the two taking turns. Nothing here asserts a time.

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/decode_torch_hybrid.py           # about a minute on 2 cores
    .venv/bin/python benchmarks/decode_torch_hybrid.py --quick       # a smoke run, seconds
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from _harness import BenchParser, Geometry, met, mib, paged_decode_step, run
from _harness.torch_decode import (
    AttentionModule,
    DecodeSession,
    Handle,
    Manager,
    decode_parser,
    fill_layer,
    hf_step,
    kv_tensor_bytes,
    make_manager,
    start,
)
from transformers import Qwen2Config
from transformers.cache_utils import DynamicCache

from kvcache_core import AllocationRequest, LayerSpec

#: Ours at least this much faster than DynamicCache on the hybrid model.
TARGET_HYBRID_SPEEDUP = 1.5


def hybrid_layer_types(layers: int) -> list[str]:
    """Even layers slide, odd layers attend to everything."""
    return ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(layers)]


@dataclass
class HybridScenario:
    """One request of ``context`` tokens in our pool and in a hybrid DynamicCache."""

    context: int
    window: int
    manager: Manager
    handle: Handle
    dynamic: DynamicCache


def hybrid_request(
    geometry: Geometry, context: int, window: int, extra_steps: int, generator: torch.Generator
) -> HybridScenario:
    """Fill both caches with the same ``context`` random tokens per layer."""
    blocks = 2 * geometry.blocks_for(context + extra_steps)  # a block per group per position
    specs = tuple(
        LayerSpec(window=window) if layer_type == "sliding_attention" else LayerSpec()
        for layer_type in hybrid_layer_types(geometry.num_layers)
    )
    manager = make_manager(geometry, blocks, layer_specs=specs)
    handle = manager.allocate(AllocationRequest("hybrid-0"))
    slots = manager.extend(handle, context)
    model_config = Qwen2Config(
        num_hidden_layers=geometry.num_layers,
        num_attention_heads=geometry.num_query_heads,
        num_key_value_heads=geometry.num_kv_heads,
        hidden_size=geometry.num_query_heads * geometry.head_dim,  # head_dim = hidden_size / heads
        use_sliding_window=True,
        sliding_window=window,
        layer_types=hybrid_layer_types(geometry.num_layers),
    )
    dynamic = DynamicCache(config=model_config)
    shape = (context, geometry.num_kv_heads, geometry.head_dim)
    for layer in range(geometry.num_layers):
        keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        manager.write(layer, slots, keys, values)
        fill_layer((dynamic,), keys, values, layer)
    return HybridScenario(context, window, manager, handle, dynamic)


@dataclass(frozen=True)
class HybridRow:
    """The step times (ms, the chosen statistic)."""

    ours: float
    dynamic: float
    spread: float


def run_hybrid(scenario: HybridScenario, session: DecodeSession) -> HybridRow:
    """Verify, then time ours and DynamicCache; ``DisagreementError`` on a mismatch."""
    module = AttentionModule(session.geometry.group)
    times = session.take_turns(
        1,
        f"hybrid 1 x {scenario.context}",
        {"dynamic": "dynamic"},
        {
            "ours": lambda inputs: paged_decode_step(scenario.manager, [scenario.handle], inputs),
            "dynamic": lambda inputs: hf_step(scenario.dynamic, module, inputs, None),
        },
    )
    return HybridRow(ours=times.ms("ours"), dynamic=times.ms("dynamic"), spread=times.spread())


def print_hybrid(row: HybridRow, scenario: HybridScenario, geometry: Geometry, statistic: str) -> None:
    """The figures and the target."""
    speedup = row.dynamic / row.ours
    print()
    print(
        f"(c) one decode step, 1 request of {scenario.context} tokens, {geometry.num_layers} layers, the even ones "
        f"sliding with window {scenario.window}: {statistic} ms (write + attention, all layers)"
    )
    print(
        f"  ours {row.ours:.1f}, DynamicCache + sdpa {row.dynamic:.1f}: Dynamic/ours {speedup:.2f}x "
        f"(IQR/median {row.spread:.0%})"
    )
    print(
        f"  target: at least {TARGET_HYBRID_SPEEDUP}x faster than DynamicCache: {speedup:.2f}x, "
        f"{met(speedup >= TARGET_HYBRID_SPEEDUP)}"
    )
    ours_bytes = scenario.manager.stats().used_memory_bytes
    groups = scenario.manager.config.kv_groups
    tables = scenario.handle.block_tables()
    sliding_blocks = next(table.num_blocks() for group, table in zip(groups, tables, strict=True) if group.window)
    dynamic_bytes = kv_tensor_bytes(scenario.dynamic)
    print(
        f"  KV memory: ours {mib(ours_bytes)} (KV-cache groups: the sliding layers keep "
        f"{sliding_blocks} blocks of a request), DynamicCache {mib(dynamic_bytes)}: "
        f"ours / DynamicCache {ours_bytes / dynamic_bytes:.2f}x"
    )


def command_line() -> BenchParser:
    """The command line."""
    parser = decode_parser(__doc__, quick="8 layers, 2048 tokens, window 256, 3 repeats", layers=(32, 8))
    parser.flag("--context", (8192, 2048), help="tokens of the request")
    parser.flag("--window", (1024, 256), help="sliding window of the even layers")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scenario and print its figures; ``DisagreementError`` if DynamicCache disagrees with ours."""
    session = start(command_line(), argv)
    args = session.args
    scenario = hybrid_request(session.geometry, args.context, args.window, session.extra_steps, session.generator)
    print_hybrid(run_hybrid(scenario, session), scenario, session.geometry, args.statistic)
    return session.finish()


if __name__ == "__main__":
    sys.exit(run(main))
