"""A decode step's cost besides the attention arithmetic with the CPU's caches cold, as inside
a model: kvcache's torch backend against ``DynamicCache.update``, side by side in one process.

Inside ``generate`` every call of the cache comes after a layer's projections have streamed
megabytes of weights through the CPU's caches, so the Python and the small arrays of each call
are read from memory again: on an AMD EPYC with a 1 MiB L2, ``begin_step`` of one request
takes about 23 us in a loop and about 190 us after a 64 MiB copy. A loop that calls the same
thing again and again measures the warm figure, which no model sees. Here each call runs after
``--evict-mib`` MiB are copied (untimed), the model's work between two calls.

Per decode step of ``--layers`` layers (the model of ``generate_torch.py``: 2 KV heads of 64,
8 query heads, blocks of 16, float32), for one request of ``--prompt-length`` tokens and for
``--batch-size`` requests of ``--min-length`` to ``--max-length`` tokens:

* **ours** -- ``manager.begin_step(handles, 1)``, then per layer ``step.write_and_attend``
  (the call ``PagedCache`` makes), less the attention arithmetic inside it (the compiled
  kernel's call, or torch's ``scaled_dot_product_attention`` on the pool's views, timed and
  subtracted): the planning, the write, the checks, the dispatch and the Python;
* **DynamicCache** -- per layer ``DynamicCache.update`` (two ``torch.cat``), what transformers'
  default cache spends besides the attention.

Printed per step and per layer (medians over ``--repeats`` steps, the two taking turns): ours'
planning (its own median, from the same steps) and layers, DynamicCache's updates, their ratio. Nothing is asserted; the outputs of
ours are checked against a dense attention of the same K/V once, before timing (exit 1 if
they differ).

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/step_cold.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch
import transformers
from _harness import BenchParser, cold_turns, draw_lengths, print_environment, require, run
from _harness.layer_cost import LayerCost, timing_arithmetic
from _harness.torch_decode import cache_update

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, Step, create_manager

Manager = PagedKvCacheManager[torch.Tensor]


class Scenario:
    """One batch of requests, prefilled, in our pool and in a ``DynamicCache`` (padded on the
    left as transformers pads a batch), and the new K/V and queries of a decode step."""

    def __init__(self, args: argparse.Namespace, lengths: Sequence[int]) -> None:
        self.layers, self.heads, self.dim = args.layers, 2, 64
        heads, dim = self.heads, self.dim
        blocks = sum(-(-(length + args.repeats + args.warmup + 4) // 16) for length in lengths)
        config = CacheConfig(
            num_layers=self.layers, num_heads=heads, head_dim=dim, num_blocks=blocks + len(lengths), block_size=16
        )
        self.manager: Manager = create_manager("torch", config)
        self.handles = [self.manager.allocate(AllocationRequest(f"r{row}")) for row in range(len(lengths))]
        generator = torch.Generator().manual_seed(args.seed)
        longest, batch = max(lengths), len(lengths)
        self.dynamic = transformers.DynamicCache()
        prefill = self.manager.begin_step(self.handles, list(lengths))
        for layer in range(self.layers):
            padded = torch.randn((2, batch, heads, longest, dim), generator=generator)
            rows = [padded[:, row, :, longest - length :].transpose(1, 2) for row, length in enumerate(lengths)]
            prefill.write(layer, torch.cat([row[0] for row in rows]), torch.cat([row[1] for row in rows]))
            cache_update(self.dynamic, padded[0], padded[1], layer)
        self.keys = torch.randn((batch, heads, dim), generator=generator)
        self.values = torch.randn((batch, heads, dim), generator=generator)
        self.query = torch.randn((batch, 4 * heads, dim), generator=generator)
        self.step: Step[torch.Tensor] | None = None

    def ours(self) -> list[Callable[[], object]]:
        """A decode step's calls: the planning, then each layer's write and attention."""

        def plan() -> None:
            self.step = self.manager.begin_step(self.handles, 1)

        def layer_call(layer: int) -> Callable[[], object]:
            def call() -> object:
                assert self.step is not None
                return self.step.write_and_attend(layer, self.keys, self.values, self.query)

            return call

        return [plan, *(layer_call(layer) for layer in range(self.layers))]

    def theirs(self) -> list[Callable[[], object]]:
        """A decode step's ``DynamicCache.update`` of every layer (K/V ``[B, H, 1, D]``)."""
        keys, values = self.keys[:, :, None], self.values[:, :, None]

        def layer_update(layer: int) -> Callable[[], object]:
            return lambda: cache_update(self.dynamic, keys, values, layer)

        return [layer_update(layer) for layer in range(self.layers)]

    def check(self) -> None:
        """Ours attends the K/V the pool holds as a dense attention does (one step, untimed)."""
        step = self.manager.begin_step(self.handles, 1)
        output = step.write_and_attend(0, self.keys, self.values, self.query)
        keys, values = self.manager.gather(self.handles[0], 0)
        query = self.query[0].view(self.heads, -1, self.dim)  # query heads grouped per KV head
        weights = torch.softmax(query @ keys.permute(1, 2, 0) / self.dim**0.5, dim=-1)
        expected = (weights @ values.permute(1, 0, 2)).reshape(-1, self.dim)
        require(torch.allclose(output[0], expected, rtol=1e-4, atol=1e-5), "ours differs from a dense attention")


def measure(title: str, scenario: Scenario, args: argparse.Namespace, evict: Callable[[], object]) -> None:
    scenario.check()
    arithmetic = LayerCost(scenario.layers)
    arithmetic.start_forward()  # one running total for the whole measurement
    with timing_arithmetic(arithmetic), torch.inference_mode():
        times = cold_turns(
            {"ours": scenario.ours, "DynamicCache": scenario.theirs},
            rounds=args.repeats,
            warmup=args.warmup,
            evict=evict,
            excluded=arithmetic.arithmetic_so_far,
            statistic=args.statistic,
            per_piece=True,
        )
    layers = scenario.layers
    ours, theirs, plan = times.us("ours"), times.us("DynamicCache"), times.us("ours[0]")  # piece 0: begin_step
    print(f"\n{title}")
    print(f"  {'':<34}{'per step':>12}{'per layer':>12}")
    print(f"  {'ours: begin_step':<34}{plan:>9.0f} us{plan / layers:>9.0f} us")
    print(f"  {'ours: layers (write_and_attend)':<34}{ours - plan:>9.0f} us{(ours - plan) / layers:>9.0f} us")
    print(f"  {'ours: all, besides the arithmetic':<34}{ours:>9.0f} us{ours / layers:>9.0f} us")
    print(f"  {'DynamicCache.update':<34}{theirs:>9.0f} us{theirs / layers:>9.0f} us")
    spread = times.spread("ours", "DynamicCache")
    print(f"  DynamicCache / ours: {theirs / ours:.2f}x (above 1x: ours costs less)  spread up to {spread:.0%}")


def main(argv: Sequence[str] | None = None) -> int:
    """Print both scenarios' tables; ``DisagreementError`` if ours attends wrongly."""
    parser = BenchParser(__doc__, quick="20 steps, a 256-token prompt, a batch of 4 of 32-256 tokens")
    parser.flag("--prompt-length", (2048, 256), help="tokens of the one request")
    parser.lengths(count=(8, 4), min_length=(256, 32), max_length=(2048, 256))
    parser.flag("--layers", 4, help="layers per step")
    parser.flag("--evict-mib", 64, help="MiB copied before every timed call (the model's work between calls)")
    parser.timing((200, 20), what="timed decode steps per competitor")
    parser.flag("--warmup", (10, 3), help="untimed steps first")
    parser.seed(what="lengths and data")
    args = parser.parse(argv)
    print_environment()
    source = np.ones(args.evict_mib * 2**18, dtype=np.float32)
    target = np.empty_like(source)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}")
    print(f"before every timed call, {args.evict_mib} MiB copied (untimed); medians of {args.repeats} decode steps")

    def evict() -> None:
        np.copyto(target, source)

    lengths = draw_lengths(args.seed, args.batch_size, args.min_length, args.max_length)
    measure(f"one request of {args.prompt_length} tokens", Scenario(args, [args.prompt_length]), args, evict)
    measure(f"{len(lengths)} requests of {min(lengths)}-{max(lengths)} tokens", Scenario(args, lengths), args, evict)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
