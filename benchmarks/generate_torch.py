"""End-to-end ``model.generate`` in transformers: kvcache's PagedCache against DynamicCache, side by side.

What is compared, in one process, on the same random-weight model and prompt (fp32, CPU):

* **ours** -- ``model.generate(..., cache=PagedCache(manager, model.config))`` with the model
  loaded with ``attn_implementation="kvcache_paged"``: each layer's new K/V go into the
  torch backend's paged pool in one write and attention reads the pool in place (decode never
  rebuilds a contiguous K/V). The pool (``create_manager("torch", cache_config_for(model, ...))``)
  is allocated once, outside the timed region, as a server would; each run's requests are
  allocated at its first forward and released at its end, inside it.
* **DynamicCache** -- transformers' default: ``model.generate(...)`` with
  ``attn_implementation="sdpa"``, which creates a ``DynamicCache`` (K/V grown by
  ``torch.cat`` every step) and runs ``scaled_dot_product_attention`` on it.

The model is a small Llama-like decoder with grouped-query attention (printed at start).
Each run generates ``--new-tokens`` tokens greedily from a ``--prompt-length``-token prompt;
a run with one new token measures the prefill alone, so the table shows prefill, decode (the
rest, per token) and the whole. Times are medians over ``--repeats`` runs, the two
approaches taking turns (their order alternates). Before timing, one run of each (with
``output_logits``) checks that they agree: the same tokens, logits within 1e-3; the script
exits with status 1 otherwise. Nothing here asserts a time.

Run, from the repository root::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/generate_torch.py          # a minute or two on 2 cores
    .venv/bin/python benchmarks/generate_torch.py --quick      # a smoke run, under a minute
    .venv/bin/python benchmarks/generate_torch.py --layers 4 --prompt-length 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import torch  # after the offline switch, which transformers reads on import
import transformers

from kvcache_core import PagedKvCacheManager, create_manager
from kvcache_torch.hf import ATTN_IMPLEMENTATION, PagedCache, cache_config_for

RECOMMENDED_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
LOGIT_TOLERANCE = 1e-3  # fp32 through a whole model: the two paths differ in the last bits only

Model = Any  # a transformers LlamaForCausalLM


@dataclass(frozen=True)
class Timing:
    """Median seconds of one approach."""

    prefill: float
    total: float
    new_tokens: int

    @property
    def decode_per_token(self) -> float:
        """Seconds per generated token after the first."""
        return (self.total - self.prefill) / max(1, self.new_tokens - 1)


def build_models(args: argparse.Namespace) -> tuple[Model, Model]:
    """The same random-weight model twice: ``(ours, reference)``, each with its attention."""
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.query_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.query_heads,
        max_position_embeddings=args.prompt_length + args.new_tokens,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=None,  # never stop early: every run generates every token
        pad_token_id=0,
    )
    torch.random.manual_seed(args.seed)  # pyright: ignore[reportUnknownMemberType]  # seed untyped in torch
    reference: Model = transformers.LlamaForCausalLM(config)
    reference.eval()
    ours: Model = copy.deepcopy(reference)  # its own config: the attention implementation lives there
    reference.set_attn_implementation("sdpa")
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    return ours, reference


def describe(model: Model, args: argparse.Namespace) -> str:
    config = model.config
    parameters = sum(p.numel() for p in model.parameters())
    return (
        f"model: Llama-like, {config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate "
        f"{config.intermediate_size}, {config.num_attention_heads} query heads / {config.num_key_value_heads} KV "
        f"heads of {config.head_dim}, vocab {config.vocab_size}, {parameters / 1e6:.1f} M parameters, float32, "
        f"random weights (seed {args.seed})"
    )


def run_ours(
    model: Model, manager: PagedKvCacheManager[torch.Tensor], prompt: torch.Tensor, new_tokens: int, **options: Any
) -> Any:
    with PagedCache(manager, model.config, max_sequence_length=prompt.shape[1] + new_tokens) as cache:
        return model.generate(prompt, cache=cache, max_new_tokens=new_tokens, **options)


def run_reference(model: Model, prompt: torch.Tensor, new_tokens: int, **options: Any) -> Any:
    return model.generate(prompt, max_new_tokens=new_tokens, **options)


def check_agreement(
    model: Model, reference: Model, manager: PagedKvCacheManager[torch.Tensor], prompt: torch.Tensor, new_tokens: int
) -> tuple[bool, str]:
    """One run of each with logits: the same tokens, and logits within the tolerance."""
    options: dict[str, Any] = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    ours = run_ours(model, manager, prompt, new_tokens, **options)
    expected = run_reference(reference, prompt, new_tokens, **options)
    worst = max(float((a - b).abs().max()) for a, b in zip(ours.logits, expected.logits, strict=True))
    same_tokens = bool(torch.equal(ours.sequences, expected.sequences))
    ok = same_tokens and worst <= LOGIT_TOLERANCE
    return ok, f"same tokens: {same_tokens}, max |logit difference| {worst:.2e} (tolerance {LOGIT_TOLERANCE:g})"


def kv_bytes(model: Model, manager: PagedKvCacheManager[torch.Tensor], prompt: torch.Tensor, new_tokens: int) -> str:
    """KV memory each approach holds at the end of a run."""
    options: dict[str, Any] = {"do_sample": False, "return_dict_in_generate": True}
    with PagedCache(manager, model.config, max_sequence_length=prompt.shape[1] + new_tokens) as cache:
        model.generate(prompt, cache=cache, max_new_tokens=new_tokens, **options)
        ours_bytes = manager.stats().used_memory_bytes
        runs = [len(handle.block_table().runs()) for handle in cache.handles]
    config = model.config
    tokens = prompt.shape[1] + new_tokens - 1  # the last token's K/V are never computed
    dynamic_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * tokens
    return (
        f"KV memory at the end: ours {ours_bytes / 2**20:.1f} MiB in {manager.config.block_size}-token blocks "
        f"({runs} run(s) of consecutive blocks per request), DynamicCache {dynamic_bytes / 2**20:.1f} MiB"
    )


def timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def measure(
    model: Model,
    reference: Model,
    manager: PagedKvCacheManager[torch.Tensor],
    prompt: torch.Tensor,
    new_tokens: int,
    repeats: int,
) -> tuple[Timing, Timing]:
    """Median prefill and whole-run times of both, taking turns."""
    options: dict[str, Any] = {"do_sample": False}
    samples: dict[str, dict[int, list[float]]] = {"ours": {1: [], new_tokens: []}, "dynamic": {1: [], new_tokens: []}}
    for repeat in range(repeats):
        for tokens in (1, new_tokens):
            turns: list[tuple[str, Callable[[], object]]] = [
                ("ours", functools.partial(run_ours, model, manager, prompt, tokens, **options)),
                ("dynamic", functools.partial(run_reference, reference, prompt, tokens, **options)),
            ]
            for name, run in turns if repeat % 2 == 0 else reversed(turns):
                samples[name][tokens].append(timed(run))
    return tuple(  # type: ignore[return-value]  # two names, two timings
        Timing(statistics.median(samples[name][1]), statistics.median(samples[name][new_tokens]), new_tokens)
        for name in ("ours", "dynamic")
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--prompt-length", type=int, default=None, help="prompt tokens (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens to generate (default 128)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of each (default 5)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--intermediate", type=int, default=1536, help="MLP size (default 1536)")
    parser.add_argument("--query-heads", type=int, default=8, help="query heads (default 8)")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block of our pool (default 16)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and prompt (default 0)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 512-token prompt, 32 new tokens, 3 repeats (< 1 min)"
    )
    args = parser.parse_args(argv)
    defaults = (512, 32, 3) if args.quick else (2048, 128, 5)
    for name, default in zip(("prompt_length", "new_tokens", "repeats"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("prompt_length", "new_tokens", "repeats", "layers", "hidden", "query_heads", "kv_heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.query_heads or args.query_heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --query-heads, and --query-heads of --kv-heads")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run both approaches and print the table; 1 if they disagree."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    missing = [key for key, value in RECOMMENDED_ENV.items() if os.environ.get(key) != value]
    recommended = " ".join(f"{key}={value}" for key, value in RECOMMENDED_ENV.items())
    print(f"recommended environment: {recommended} ({'set' if not missing else 'NOT set: ' + ', '.join(missing)})")
    started = time.perf_counter()
    model, reference = build_models(args)
    print(describe(model, args))
    print(
        f"generate {args.new_tokens} new tokens (greedy) from a {args.prompt_length}-token prompt, batch 1; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPUs; medians of {args.repeats} runs each, taking turns"
    )
    tokens = args.prompt_length + args.new_tokens
    manager: PagedKvCacheManager[torch.Tensor] = create_manager(
        "torch",
        cache_config_for(model, max_tokens=tokens + args.block_size, block_size=args.block_size),
    )
    prompt = torch.randint(2, args.vocab, (1, args.prompt_length), generator=torch.Generator().manual_seed(args.seed))
    with torch.inference_mode():
        ok, agreement = check_agreement(model, reference, manager, prompt, args.new_tokens)
        print(f"check (one untimed run each): {agreement}")
        if not ok:
            print("error: ours and DynamicCache disagree", file=sys.stderr)
            return 1
        print(kv_bytes(model, manager, prompt, args.new_tokens))
        ours, dynamic = measure(model, reference, manager, prompt, args.new_tokens, args.repeats)
    print()
    header = f"{'':<28}{'prefill':>12}{'decode/token':>15}{'whole generate':>17}"
    print(header)
    print("-" * len(header))
    for name, timing in (("ours (PagedCache, paged)", ours), ("DynamicCache (sdpa)", dynamic)):
        print(
            f"{name:<28}{timing.prefill * 1e3:>10.0f} ms{timing.decode_per_token * 1e3:>12.2f} ms"
            f"{timing.total:>15.2f} s"
        )
    print(
        f"{'DynamicCache / ours':<28}{dynamic.prefill / ours.prefill:>11.2f}x"
        f"{dynamic.decode_per_token / ours.decode_per_token:>14.2f}x{dynamic.total / ours.total:>16.2f}x"
    )
    print(f"(above 1x: ours is faster)  total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
