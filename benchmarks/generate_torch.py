"""End-to-end ``model.generate`` in transformers: kvcache's PagedCache against DynamicCache, side by side.

What is compared, in one process, on the same random-weight model and prompt (fp32, CPU):

* **ours** -- ``model.generate(..., cache=PagedCache(manager, model))`` on the model as
  transformers loads it (``sdpa``), what a user runs by default: the cache runs the model's
  forwards with the ``"kvcache_paged"`` attention (``attention="auto"``), so each layer's new K/V
  go into the torch backend's paged pool in one write and attention reads the pool in place
  (decode never rebuilds a contiguous K/V). The pool (``create_manager("torch",
  cache_config_for(model, ...))``) is allocated once, outside the timed region, as a server
  would; each run's requests are allocated at its first forward and released at its end,
  inside it. (A model loaded with ``attn_implementation="kvcache_paged"`` runs the same path;
  the check below runs it too.)
* **ours, attention="model"** -- ``PagedCache(manager, model, attention="model")``: the model's
  own ``sdpa`` attention, the contiguous path, whose ``update`` writes the new K/V and hands
  back the whole K/V (for one request in one run of blocks, views of the pool; else a padded
  copy) for transformers' attention to read.
* **DynamicCache** -- transformers' default: ``model.generate(...)`` with
  ``attn_implementation="sdpa"``, which creates a ``DynamicCache`` (K/V grown by
  ``torch.cat`` every step) and runs ``scaled_dot_product_attention`` on it.
* **StaticCache** -- the same model with ``cache_implementation="static"``: K/V written into
  a preallocated buffer of the whole length, attended with a mask over all of it.
* **the ceiling** -- the same model with a cache that keeps nothing (it counts positions)
  and an attention that returns zeros: what ``generate`` costs when the cache and the
  attention cost nothing. No cache can be faster; ``DynamicCache / ceiling`` is the most any
  cache could gain over DynamicCache on this model and workload (its tokens are meaningless,
  only its time is used).

On CPU our attention is the compiled kernel of ``kvcache_core.attention.kernel`` (numba, one
call per layer for the whole batch) or torch's ``scaled_dot_product_attention`` on views of a
request's run of blocks, whichever the dispatch measured faster for the shape class (a decode
step's as the model runs it); the end of the output lists each class's path and times.

The model is a small Llama-like decoder with grouped-query attention (printed at start).
Two scenarios, each generating ``--new-tokens`` tokens greedily:

(a) one ``--prompt-length``-token prompt (batch 1);
(b) a batch of ``--batch-size`` prompts of ``--min-length`` to ``--max-length`` tokens
    (lengths drawn with ``--seed``), left-padded as a tokenizer pads them, with the
    ``attention_mask``: the ragged batch of a server.

A run with one new token measures the prefill alone, so the tables show prefill, decode
(the rest, per token) and the whole. "ours, arithmetic free" is ours with the attention's
arithmetic replaced by zeros. The cost per layer besides the arithmetic is measured inside one
more run of ours (``_harness.layer_cost``: the time in kvcache's calls from transformers less
the time in the arithmetic, per decode forward), not as a difference of whole runs, which the
machine's neighbours move by more than that cost. From it, the bound of a thinner per-layer
path: ours with that cost taken out of its decode forwards, against DynamicCache (what the
attention arithmetic and the model leave to gain). One more run each of the contiguous path and
of DynamicCache times their ``update`` per layer of a decode step, the call that hands the
model its K/V (``_harness.layer_cost.decode_updates``). Times are medians (``--statistic``) over ``--repeats``
runs, the approaches taking turns (their order rotates).

The ratios to DynamicCache are also taken run by run: a round's two runs are close in time,
so a drift of the machine's speed cancels in their ratio where it moves a ratio of medians.
They print as the median of the rounds' ratios with a distribution-free interval for it (order
statistics: with 6 runs, the lowest to the highest ratio, holding the true median with
probability 96.9 %), and a target is met only when the whole interval reaches it: "NOT met"
when the interval is wholly below, "undecided" when it spans the target (more ``--repeats``
narrow it). Before timing, one run of each (with
``output_logits``) checks that ours agrees with DynamicCache: the same tokens, logits within
1e-3; the script exits with status 1 otherwise. Nothing here asserts a time.

Run, from the repository root::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/generate_torch.py          # a few minutes on 2 cores
    .venv/bin/python benchmarks/generate_torch.py --quick      # a smoke run, about a minute
    .venv/bin/python benchmarks/generate_torch.py --skip-batch --prompt-length 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import torch  # after the offline switch, which transformers reads on import
import transformers
from _harness import (
    BenchParser,
    PairedRatio,
    Stopwatch,
    draw_lengths,
    generation,
    met,
    paired_ratio,
    print_dispatch,
    print_environment,
    require,
    run,
    take_turns,
)
from _harness.layer_cost import decode_updates, measure_layer_cost

import kvcache_torch.storage
from kvcache_core import PagedKvCacheManager, create_manager
from kvcache_core.attention import kernel as paged_kernel
from kvcache_torch.dispatch import DISPATCH
from kvcache_torch.hf import PagedCache, cache_config_for
from kvcache_torch.lanes import TorchLane

Model = generation.Model

# The targets of the issue, checked in the summary (never asserted): DynamicCache / ours,
# whole generate.
TARGET_SINGLE_SPEEDUP = 1.2
TARGET_BATCH_SPEEDUP = 1.5
#: Seconds per layer of a decode step besides the attention arithmetic (issue 27).
TARGET_LAYER_OVERHEAD = 30e-6

APPROACHES = ("ours", "sdpa", "bare", "dynamic", "static", "ceiling")
LABELS = {
    "ours": "ours (PagedCache, default)",
    "sdpa": "ours, attention='model'",
    "bare": "ours, arithmetic free",
    "dynamic": "DynamicCache (sdpa)",
    "static": "StaticCache (sdpa)",
    "ceiling": "ceiling (free cache+attn)",
}
#: The attention implementation of the ceiling: zeros, no mask.
FREE_ATTENTION = "kvcache_benchmark_free"


@dataclass(frozen=True)
class Timing:
    """Seconds of one approach (the chosen statistic)."""

    prefill: float
    total: float
    new_tokens: int
    prefills: tuple[float, ...] = ()  # each round's prefill, in round order
    totals: tuple[float, ...] = ()  # each round's whole run

    @property
    def decode_per_token(self) -> float:
        """Seconds per generated token after the first."""
        return (self.total - self.prefill) / max(1, self.new_tokens - 1)

    def decodes(self) -> list[float]:
        """Each round's decode: its whole run less its prefill."""
        return [total - prefill for total, prefill in zip(self.totals, self.prefills, strict=True)]

    def paired(self, ours: Timing) -> tuple[PairedRatio, PairedRatio, PairedRatio]:
        """This approach over ``ours``, paired round by round: prefill, decode and the whole run."""
        return (
            paired_ratio(self.prefills, ours.prefills),
            paired_ratio(self.decodes(), ours.decodes()),
            paired_ratio(self.totals, ours.totals),
        )


class CountingLayer(transformers.cache_utils.CacheLayerMixin):  # type: ignore[no-untyped-call]  # untyped base
    """A cache layer that keeps no K/V, only the count of positions (the ceiling's cache)."""

    is_sliding = False

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # pyright: ignore[reportUnknownMemberType]
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.length += int(key_states.shape[-2])
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


def free_attention(
    module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """The ceiling's attention: zeros of the output's shape ``[batch, tokens, heads, head_dim]``."""
    return query.new_zeros((query.shape[0], query.shape[2], query.shape[1], query.shape[3])), None


def no_mask(*args: Any, **kwargs: Any) -> None:
    """The ceiling's mask: none."""
    return None


transformers.AttentionInterface.register(FREE_ATTENTION, free_attention)  # pyright: ignore[reportUnknownMemberType]
transformers.masking_utils.AttentionMaskInterface.register(FREE_ATTENTION, no_mask)  # pyright: ignore[reportUnknownMemberType]


def build_models(args: argparse.Namespace) -> tuple[Model, Model]:
    """The same random-weight model twice: ``(ours, reference)``, each with its attention."""
    shape = generation.ModelShape(
        args.layers, args.hidden, args.intermediate, args.query_heads, args.kv_heads, args.vocab
    )
    positions = max(args.prompt_length, args.max_length) + args.new_tokens
    return generation.paired_models(
        generation.random_model("llama", shape, seed=args.seed, max_positions=positions, initializer_range=0.1)
    )


def describe(model: Model, args: argparse.Namespace) -> str:
    config = model.config
    parameters = sum(p.numel() for p in model.parameters())
    return (
        f"model: Llama-like, {config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate "
        f"{config.intermediate_size}, {config.num_attention_heads} query heads / {config.num_key_value_heads} KV "
        f"heads of {config.head_dim}, vocab {config.vocab_size}, {parameters / 1e6:.1f} M parameters, float32, "
        f"random weights (seed {args.seed})"
    )


@dataclass(frozen=True)
class Prompt:
    """Token ids ``[batch, positions]`` and, for a padded batch, the 2-D ``attention_mask``."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    lengths: tuple[int, ...]

    @property
    def positions(self) -> int:
        return int(self.ids.shape[1])


def single_prompt(args: argparse.Namespace) -> Prompt:
    """Scenario (a): one prompt of ``--prompt-length`` tokens."""
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(2, args.vocab, (1, args.prompt_length), generator=generator)
    return Prompt(ids, None, (args.prompt_length,))


def ragged_batch(args: argparse.Namespace) -> Prompt:
    """Scenario (b): ``--batch-size`` prompts of random lengths, left-padded (pad id 0)."""
    lengths = tuple(draw_lengths(args.seed, args.batch_size, args.min_length, args.max_length))
    ids, mask = generation.left_padded_prompts(lengths, args.vocab, args.seed + 1)
    return Prompt(ids, mask, lengths)


def run_ours(
    model: Model, manager: PagedKvCacheManager[torch.Tensor], prompt: Prompt, new_tokens: int, **options: Any
) -> Any:
    """Ours as a user runs it by default: the cache built with the model (on ``sdpa``, its
    forwards then run ``"kvcache_paged"``; a model loaded with it runs it anyway)."""
    with PagedCache(manager, model, max_sequence_length=prompt.positions + new_tokens) as cache:
        return model.generate(prompt.ids, attention_mask=prompt.mask, cache=cache, max_new_tokens=new_tokens, **options)


def run_contiguous(
    model: Model, manager: PagedKvCacheManager[torch.Tensor], prompt: Prompt, new_tokens: int, **options: Any
) -> Any:
    """Ours on the contiguous path: ``model`` keeps its ``sdpa`` attention (``attention="model"``);
    the cache is built with the model, whose forward hook hands it the padding mask (padding is
    then not stored)."""
    with PagedCache(manager, model, max_sequence_length=prompt.positions + new_tokens, attention="model") as cache:
        return model.generate(prompt.ids, attention_mask=prompt.mask, cache=cache, max_new_tokens=new_tokens, **options)


def run_bare(
    model: Model, manager: PagedKvCacheManager[torch.Tensor], prompt: Prompt, new_tokens: int, **options: Any
) -> Any:
    """Ours with the attention arithmetic over the pool replaced by zeros: everything else of
    the per-layer path (the write, the checks, the bookkeeping, the Python) still runs."""

    def zeros(
        query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        return query.new_zeros((query.shape[0], query.shape[1], value_cache.shape[3]))

    def lane_zeros(lane: TorchLane, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        return query.new_zeros((query.shape[0], query.shape[1], lane.value_width))

    # The storage's attention and its step lane's (the plain layers of a step).
    with (
        mock.patch.object(kvcache_torch.storage, "attend_pool", zeros),
        mock.patch.object(TorchLane, "_attend", lane_zeros),
    ):
        return run_ours(model, manager, prompt, new_tokens, **options)


def run_reference(model: Model, prompt: Prompt, new_tokens: int, static: bool = False, **options: Any) -> Any:
    if static:
        options = {**options, "cache_implementation": "static"}
    return model.generate(prompt.ids, attention_mask=prompt.mask, max_new_tokens=new_tokens, **options)


def run_ceiling(model: Model, prompt: Prompt, new_tokens: int, **options: Any) -> Any:
    cache = transformers.Cache(layers=[CountingLayer() for _ in range(model.config.num_hidden_layers)])
    return model.generate(prompt.ids, attention_mask=prompt.mask, cache=cache, max_new_tokens=new_tokens, **options)


def check_agreement(
    model: Model, reference: Model, manager: PagedKvCacheManager[torch.Tensor], prompt: Prompt, new_tokens: int
) -> tuple[bool, str]:
    """One run of each with logits: the same tokens, and logits within the tolerance."""
    options: dict[str, Any] = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    ours = run_ours(reference, manager, prompt, new_tokens, **options)  # sdpa: the cache switches it
    loaded = run_ours(model, manager, prompt, new_tokens, **options)  # loaded with "kvcache_paged"
    expected = run_reference(reference, prompt, new_tokens, **options)
    static = run_reference(reference, prompt, new_tokens, static=True, **options)
    contiguous = run_contiguous(reference, manager, prompt, new_tokens, **options)  # the model's own sdpa
    same_tokens, worst = generation.agreement(ours, expected)
    same_loaded, worst_loaded = generation.agreement(loaded, expected)
    same_tokens, worst = same_tokens and same_loaded, max(worst, worst_loaded)
    same_contiguous, worst_contiguous = generation.agreement(contiguous, expected)
    static_tokens = bool(torch.equal(static.sequences, expected.sequences))
    ok = same_tokens and same_contiguous and max(worst, worst_contiguous) <= generation.LOGIT_TOLERANCE
    return ok, (
        f"same tokens as DynamicCache: {same_tokens} (attention='model': {same_contiguous}; StaticCache: "
        f"{static_tokens}), max |logit difference| {worst:.2e} (attention='model': {worst_contiguous:.2e}; tolerance "
        f"{generation.LOGIT_TOLERANCE:g})"
    )


def kv_bytes(model: Model, manager: PagedKvCacheManager[torch.Tensor], prompt: Prompt, new_tokens: int) -> str:
    """KV memory each approach holds at the end of a run."""
    options: dict[str, Any] = {"do_sample": False, "return_dict_in_generate": True}
    with PagedCache(manager, model.config, max_sequence_length=prompt.positions + new_tokens) as cache:
        model.generate(prompt.ids, attention_mask=prompt.mask, cache=cache, max_new_tokens=new_tokens, **options)
        ours_bytes = manager.stats().used_memory_bytes
        runs = [len(handle.block_table().runs()) for handle in cache.handles]
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    padded_tokens = len(prompt.lengths) * (prompt.positions + new_tokens - 1)  # the last token's K/V: never
    return (
        f"KV memory at the end: ours {ours_bytes / 2**20:.1f} MiB in {manager.config.block_size}-token blocks "
        f"({runs} run(s) of consecutive blocks per request), DynamicCache {per_token * padded_tokens / 2**20:.1f} MiB"
        + (" (padding included)" if prompt.mask is not None else "")
    )


def measure(
    models: tuple[Model, Model],
    manager: PagedKvCacheManager[torch.Tensor],
    prompt: Prompt,
    args: argparse.Namespace,
) -> dict[str, Timing]:
    """Prefill and whole-run times of every approach (``models``: the reference, which ours runs
    too, its cache switching the attention, and the ceiling's), taking turns in a rotating order:
    first the prefills, then the whole runs."""
    reference, ceiling = models
    options: dict[str, Any] = {"do_sample": False}

    def turns(tokens: int) -> Mapping[str, Callable[[], object]]:
        return {
            f"ours {tokens}": functools.partial(run_ours, reference, manager, prompt, tokens, **options),
            f"sdpa {tokens}": functools.partial(run_contiguous, reference, manager, prompt, tokens, **options),
            f"bare {tokens}": functools.partial(run_bare, reference, manager, prompt, tokens, **options),
            f"dynamic {tokens}": functools.partial(run_reference, reference, prompt, tokens, **options),
            f"static {tokens}": functools.partial(run_reference, reference, prompt, tokens, static=True, **options),
            f"ceiling {tokens}": functools.partial(run_ceiling, ceiling, prompt, tokens, **options),
        }

    times = take_turns(turns(1), turns(args.new_tokens), rounds=args.repeats, statistic=args.statistic)
    return {
        name: Timing(
            times.seconds(f"{name} 1"),
            times.seconds(f"{name} {args.new_tokens}"),
            args.new_tokens,
            tuple(times.samples[f"{name} 1"]),
            tuple(times.samples[f"{name} {args.new_tokens}"]),
        )
        for name in APPROACHES
    }


def run_scenario(
    title: str,
    model: Model,
    reference: Model,
    prompt: Prompt,
    args: argparse.Namespace,
    target: float,
) -> None:
    """Check, time and print one scenario.

    Raises:
        DisagreementError: ours and DynamicCache generated different tokens or logits.
    """
    print(f"\n{title}")
    tokens = sum(prompt.lengths) + len(prompt.lengths) * (args.new_tokens + args.block_size)
    manager: PagedKvCacheManager[torch.Tensor] = create_manager(
        "torch", cache_config_for(model, max_tokens=tokens, block_size=args.block_size)
    )
    with torch.inference_mode():
        ok, agreed = check_agreement(model, reference, manager, prompt, args.new_tokens)
        print(f"  check (one untimed run each): {agreed}")
        require(ok, "ours and DynamicCache disagree")
        print(f"  {kv_bytes(model, manager, prompt, args.new_tokens)}")
        ceiling = copy.deepcopy(reference)
        ceiling.set_attn_implementation(FREE_ATTENTION)
        timings = measure((reference, ceiling), manager, prompt, args)
        with measure_layer_cost(model.config.num_hidden_layers) as cost:  # untimed: its calls are timed inside
            run_ours(reference, manager, prompt, args.new_tokens, do_sample=False)
        with decode_updates(PagedCache) as contiguous_updates:  # one more run of each, update() timed
            run_contiguous(reference, manager, prompt, args.new_tokens, do_sample=False)
        with decode_updates(transformers.DynamicCache) as dynamic_updates:
            run_reference(reference, prompt, args.new_tokens, do_sample=False)
    header = f"  {'':<28}{'prefill':>12}{'decode/token':>15}{'whole generate':>17}"
    print(header)
    print("  " + "-" * (len(header) - 2))
    for name in APPROACHES:
        timing = timings[name]
        print(
            f"  {LABELS[name]:<28}{timing.prefill * 1e3:>10.0f} ms{timing.decode_per_token * 1e3:>12.2f} ms"
            f"{timing.total:>15.2f} s"
        )
    ours = timings["ours"]
    for name in ("dynamic", "static"):
        other = timings[name]
        label = f"{LABELS[name].split(' ')[0]} / ours"
        print(
            f"  {label:<28}{other.prefill / ours.prefill:>11.2f}x"
            f"{other.decode_per_token / ours.decode_per_token:>14.2f}x{other.total / ours.total:>16.2f}x"
        )
    dynamic, contiguous = timings["dynamic"], timings["sdpa"]
    prefill, decode, whole = dynamic.paired(ours)
    print(
        f"  paired run by run, DynamicCache / ours: prefill {prefill}, decode {decode}, whole {whole} "
        f"({whole.interval()})"
    )
    print(
        f"  (above 1x: ours is faster)  target: whole generate at least {target}x faster than DynamicCache: "
        f"{whole}, {whole.verdict(target)}; never slower (at least 1x): {whole.verdict(1.0)}"
    )
    _, contiguous_decode, contiguous_whole = dynamic.paired(contiguous)
    print(
        f"  attention='model' (the model's own sdpa, the contiguous path): DynamicCache / ours {contiguous_whole} whole generate, "
        f"{contiguous_decode} decode (paired); never slower than DynamicCache: {contiguous_whole.verdict(1.0)}"
    )
    if contiguous_updates and dynamic_updates:
        mine, theirs = statistics.fmean(contiguous_updates), statistics.fmean(dynamic_updates)
        print(
            f"  the contiguous path's update per layer and decode step (a step's planning in its first layer's), "
            f"inside one more run of each: ours {mine * 1e6:.0f} us mean ({statistics.median(contiguous_updates) * 1e6:.0f}"
            f" us median), DynamicCache {theirs * 1e6:.0f} us mean ({statistics.median(dynamic_updates) * 1e6:.0f} us "
            f"median); DynamicCache / ours {theirs / mine:.2f}x (means)"
        )
    ceiling = timings["ceiling"]
    print(
        f"  ceiling: a cache and attention that cost nothing would make the whole generate "
        f"{timings['dynamic'].total / ceiling.total:.2f}x faster than DynamicCache (decode "
        f"{timings['dynamic'].decode_per_token / ceiling.decode_per_token:.2f}x); ours spends "
        f"{(ours.decode_per_token - ceiling.decode_per_token) * 1e3:.2f} ms per token on cache and attention, "
        f"DynamicCache {(timings['dynamic'].decode_per_token - ceiling.decode_per_token) * 1e3:.2f} ms"
    )
    per_layer = statistics.median(cost.per_layer()) if cost.forwards else float("inf")
    competitor = (
        f" (DynamicCache.update alone: {statistics.fmean(dynamic_updates) * 1e6:.0f} us mean a layer, "
        f"{statistics.median(dynamic_updates) * 1e6:.0f} us median)"
        if dynamic_updates
        else ""
    )
    print(
        f"  per layer and decode step ({len(prompt.lengths)} request(s)), inside kvcache during one more run of "
        f"ours: {cost.summary()}{competitor}; target <= {TARGET_LAYER_OVERHEAD * 1e6:.0f} us besides the "
        f"arithmetic: {met(per_layer <= TARGET_LAYER_OVERHEAD)}"
    )
    if cost.forwards:  # what a per-layer path costing nothing could gain, the arithmetic as it is
        besides = sum(cost.per_layer()) * cost.layers * (args.new_tokens - 1) / len(cost.forwards)
        print(
            f"  bound of a thinner per-layer path: with nothing besides the arithmetic in its decode forwards "
            f"({besides * 1e3:.0f} ms less), ours would be {dynamic.total / (ours.total - besides):.2f}x faster than "
            f"DynamicCache over the whole generate (the rest is the attention arithmetic and the model)"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(
        __doc__, quick="2 layers, a 128-token prompt, a batch of 4 of 32-128 tokens, 8 new tokens, 2 repeats"
    )
    parser.flag("--prompt-length", (2048, 128), help="(a) prompt tokens")
    parser.lengths(count=(8, 4), min_length=(256, 32), max_length=(2048, 128))
    parser.flag("--new-tokens", (128, 8), help="tokens to generate")
    parser.timing((6, 2), what="timed runs of each (6 or more give a 95 % interval of the paired ratios)")
    parser.geometry(layers=(4, 2), hidden=512, query_heads=8, kv_heads=2, block_size=16)
    parser.flag("--intermediate", (1536, 512), help="MLP size")
    parser.flag("--vocab", (8192, 2048), help="vocabulary")
    parser.threads()
    parser.seed(what="weights, prompts and lengths")
    parser.add_argument("--skip-single", action="store_true", help="skip scenario (a)")
    parser.add_argument("--skip-batch", action="store_true", help="skip scenario (b)")
    return parser.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scenarios and print the tables; ``DisagreementError`` if ours disagrees with DynamicCache."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print_environment()
    clock = Stopwatch()
    model, reference = build_models(args)
    print(describe(model, args))
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}; "
        f"our CPU attention: {attention_path()}; {args.statistic}s of {args.repeats} runs each, taking turns"
    )
    if not args.skip_single:
        title = f"(a) {args.new_tokens} new tokens (greedy) from one {args.prompt_length}-token prompt"
        run_scenario(title, model, reference, single_prompt(args), args, TARGET_SINGLE_SPEEDUP)
    if not args.skip_batch:
        prompt = ragged_batch(args)
        title = (
            f"(b) {args.new_tokens} new tokens (greedy) for a batch of {len(prompt.lengths)} left-padded prompts "
            f"of {min(prompt.lengths)}-{max(prompt.lengths)} tokens {list(prompt.lengths)} (seed {args.seed})"
        )
        run_scenario(title, model, reference, prompt, args, TARGET_BATCH_SPEEDUP)
    print_dispatch(DISPATCH.choices())
    if args.quick:
        print("(--quick is a smoke run: short prompts, few tokens; the targets are judged on the default run)")
    print(f"total {clock.seconds():.1f} s")
    return 0


def attention_path() -> str:
    """Which attention our CPU pool runs here."""
    if paged_kernel.kernel_available():
        return "the compiled kernel (numba) or torch's SDPA on views of the pool, per shape class as measured (listed at the end)"
    return "the torch path (numba missing or KVCACHE_DISABLE_NUMBA set)"


if __name__ == "__main__":
    sys.exit(run(main))
