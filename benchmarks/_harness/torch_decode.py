"""A decode step in torch, ours and transformers' side by side: what the ``decode_torch*``
scenarios share (the command line, the step's inputs, transformers' cache update and
``sdpa`` function, the banner). Needs torch and transformers."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.integrations import sdpa_attention

from kvcache_core import PagedKvCacheHandle, PagedKvCacheManager, create_manager
from kvcache_core.backends.dispatch import TRIAL_STEPS
from kvcache_torch.dispatch import DISPATCH

from .environment import print_dispatch, print_environment
from .flags import BenchParser, geometry_of
from .geometry import Geometry, StepInputs
from .timing import Stopwatch, Timings, take_turns
from .verdict import agreement_check

__all__ = [
    "WARMUP_STEPS",
    "AttentionModule",
    "DecodeSession",
    "Handle",
    "Manager",
    "Outputs",
    "cache_update",
    "decode_parser",
    "fill_layer",
    "hf_config",
    "hf_step",
    "kv_tensor_bytes",
    "layer_tensors",
    "make_manager",
    "start",
    "step_inputs",
]

Manager = PagedKvCacheManager[torch.Tensor]
Handle = PagedKvCacheHandle[torch.Tensor]
Outputs = list[torch.Tensor]  # per layer: [batch, query_heads, head_dim]

#: Untimed steps before the timed ones (the first verifies and prints): the first steps of a
#: new shape pay for allocator growth and kernel set-up, and a decode class never measured
#: here takes both attention paths in turns first (the dispatch's trial steps), then its choice.
WARMUP_STEPS = max(3, 2 * TRIAL_STEPS + 1)


def decode_parser(description: str | None, *, quick: str, layers: tuple[int, int]) -> BenchParser:
    """The flags every torch decode scenario takes: geometry (``layers``: full, quick), our
    pool's layout (heads_first), repeats (9; quick 3), statistic, threads, seed."""
    parser = BenchParser(description, quick=quick)
    parser.geometry(layers=layers, query_heads=32, kv_heads=8, head_dim=128, block_size=16, kv_layout="heads_first")
    parser.timing((9, 3))
    parser.threads()
    parser.seed()
    return parser


@dataclass(frozen=True)
class DecodeSession:
    """One run of a torch decode scenario: its command line, geometry, random inputs and clock."""

    args: argparse.Namespace
    geometry: Geometry
    generator: torch.Generator
    clock: Stopwatch

    @property
    def extra_steps(self) -> int:
        """Steps every request takes beyond its context (room to size a pool for)."""
        steps: int = self.args.repeats + WARMUP_STEPS
        return steps

    def take_turns(
        self,
        batch: int,
        what: str,
        compared: Mapping[str, str],
        *groups: Mapping[str, Callable[[StepInputs[torch.Tensor]], object]],
    ) -> Timings:
        """Time the competitors of ``groups`` on the same new K/V and queries of ``batch``
        requests each step (``WARMUP_STEPS`` untimed first), checking every step that the
        results of ``compared`` (name -> label) agree with ``"ours"``.

        Raises:
            DisagreementError: a result differs from ours.
        """
        return take_turns(
            *groups,
            rounds=self.args.repeats,
            warmup=WARMUP_STEPS,
            inputs=lambda: step_inputs(self.generator, self.geometry, batch, self.geometry.num_layers),
            check=agreement_check("ours", compared, what=what),
            statistic=self.args.statistic,
        )

    def finish(self) -> int:
        """Print the closing lines (the attention path each class ran); the exit status (0)."""
        print_dispatch(DISPATCH.choices())
        if self.args.quick:
            print("(--quick is a smoke run: few layers and steps; the targets are judged on the default run)")
        print(f"total {self.clock.seconds():.1f} s")
        return 0


def start(parser: BenchParser, argv: Sequence[str] | None) -> DecodeSession:
    """Parse ``argv``, apply ``--threads``, print the banner, the geometry and torch's threads."""
    args = parser.parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print_environment()
    geometry = geometry_of(args)
    print(
        f"geometry: {geometry.num_query_heads} query heads, {geometry.num_kv_heads} KV heads, head_dim "
        f"{geometry.head_dim}, float32, block_size {geometry.block_size}, our pool layout {geometry.kv_layout}"
    )
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}; "
        f"{args.repeats} timed steps after {WARMUP_STEPS} untimed ones; {args.statistic}s"
    )
    return DecodeSession(args, geometry, torch.Generator().manual_seed(args.seed), Stopwatch())


def hf_config(geometry: Geometry, layers: int) -> LlamaConfig:
    """A transformers config of ``geometry`` with ``layers`` layers (caches are sized from it)."""
    return LlamaConfig(
        num_hidden_layers=layers,
        num_attention_heads=geometry.num_query_heads,
        num_key_value_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        hidden_size=geometry.num_query_heads * geometry.head_dim,
    )


def make_manager(geometry: Geometry, num_blocks: int, **fields: Any) -> Manager:
    """A torch-backend manager of this geometry and pool size (``fields``: more of the config)."""
    manager: Manager = create_manager("torch", geometry.config(num_blocks, **fields))
    return manager


class AttentionModule(torch.nn.Module):
    """What transformers' attention functions read from the calling layer."""

    def __init__(self, num_key_value_groups: int) -> None:
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = num_key_value_groups


def cache_update(
    cache: DynamicCache | StaticCache, keys: torch.Tensor, values: torch.Tensor, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update(keys, values, layer)``: the layer's whole K/V ``[B, kv_heads, tokens, D]``."""
    updated: tuple[torch.Tensor, torch.Tensor] = cache.update(  # pyright: ignore[reportUnknownMemberType]  # **kwargs untyped
        keys, values, layer
    )
    return updated


def hf_sdpa(
    module: AttentionModule, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """transformers' ``sdpa`` attention of one decode token: ``[B, Hq, 1, D]`` -> ``[B, Hq, D]``."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    output, _ = sdpa_attention.sdpa_attention_forward(  # pyright: ignore[reportUnknownMemberType]  # **kwargs untyped
        module, query, keys, values, mask, dropout=0.0, scaling=scale
    )
    result: torch.Tensor = output[:, 0]
    return result


def step_inputs(generator: torch.Generator, geometry: Geometry, batch: int, layers: int) -> StepInputs[torch.Tensor]:
    """Random new-token K/V and queries for every layer."""
    kv_shape = (batch, geometry.num_kv_heads, geometry.head_dim)
    q_shape = (batch, geometry.num_query_heads, geometry.head_dim)
    return StepInputs(
        keys=tuple(torch.randn(kv_shape, generator=generator) for _ in range(layers)),
        values=tuple(torch.randn(kv_shape, generator=generator) for _ in range(layers)),
        queries=tuple(torch.randn(q_shape, generator=generator) for _ in range(layers)),
    )


def hf_step(
    cache: DynamicCache | StaticCache,
    module: AttentionModule,
    inputs: StepInputs[torch.Tensor],
    mask: torch.Tensor | None,
) -> Outputs:
    """One decode step of transformers: ``cache.update`` then the ``sdpa`` function, per layer."""
    outputs: Outputs = []
    for layer, (keys, values, query) in enumerate(zip(inputs.keys, inputs.values, inputs.queries, strict=True)):
        all_keys, all_values = cache_update(cache, keys.unsqueeze(2), values.unsqueeze(2), layer)
        outputs.append(hf_sdpa(module, query.unsqueeze(2), all_keys, all_values, mask))
    return outputs


def fill_layer(
    caches: Sequence[DynamicCache | StaticCache], keys: torch.Tensor, values: torch.Tensor, layer: int
) -> None:
    """Hand ``[tokens, kv_heads, D]`` K/V of one request to each cache's ``update`` of ``layer``."""
    hf_keys, hf_values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    for cache in caches:
        cache_update(cache, hf_keys, hf_values, layer)


def layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's contiguous ``[B, kv_heads, tokens, head_dim]`` K and V of a ``DynamicCache``."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        dynamic_layer: Any = layer  # a DynamicLayer: .keys and .values
        keys, values = dynamic_layer.keys, dynamic_layer.values
        assert isinstance(keys, torch.Tensor)
        assert isinstance(values, torch.Tensor)
        pairs.append((keys, values))
    return pairs


def kv_tensor_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors a transformers cache's layers hold."""
    return sum(
        tensor.numel() * tensor.element_size()
        for layer in cache.layers
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(tensor, torch.Tensor)
    )
