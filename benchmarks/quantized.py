"""Quantized pools (int8, float8 e4m3) against the float32 pool: memory, accuracy, decode speed.

Three parts, in one process, on the torch backend (CPU):

1. **Memory** -- ``manager.stats().total_memory_bytes`` of the same pool (head_dim 128) as
   float32, float16, int8 and float8_e4m3fn; quantized pools include their scales (one
   float32 per token per KV head, K and V). Bounds: int8 <= 0.27x float32 and <= 0.53x
   float16; fp8 <= 0.26x float32.
2. **Accuracy** -- the same K/V written to a float32 pool and to each quantized pool, the
   same queries attended over both (decode: one query per request; prefill: the last
   ``--prefill`` positions, causal); the relative Frobenius error ``||quantized - float32|| /
   ||float32||`` of the attention output. Two inputs: random Gaussian K/V and queries, and
   the Q/K/V (after RoPE) of every layer of a random-weight Llama-like transformers model's
   forward pass over random token ids, captured through a registered attention function.
   Bounds: int8 <= 1%, fp8 <= 5%, on the Gaussian inputs and on the model with transformers'
   default initialisation (``initializer_range`` 0.02: attention scores of std ~0.4, flat).
   The same model with ``initializer_range`` 0.1 (scores of std ~10: very peaked attention,
   where a key's rounding error moves the softmax most) is printed too, unbounded: no
   pretrained model is reachable offline here, and real ones lie between the two.
3. **Speed** -- a decode step's attention (one layer, ``manager.paged_attention``) over
   ``--context`` tokens (4096 by default) for ``--batch`` requests, int8 and fp8 pools against
   the float32 pool, medians of interleaved rounds. On CPU all three run the compiled kernel
   of ``kvcache_core.attention.kernel``, which decodes int8/fp8 per tile of 32 keys.

4. **generate** -- ``model.generate`` of ``--new-tokens`` greedy tokens on three random-weight
   architectures (Llama, Qwen2, Qwen3) through ``PagedCache`` over int8 and fp8 pools
   (``cache_config_for(model, dtype=...)``), against the float32 ``DynamicCache`` run: the
   first step whose token differs (``-`` if none), the largest logit difference up to and
   including that step, and the K/V bytes held (``manager.stats().used_memory_bytes``, whole
   blocks) against float32 K/V of the same tokens. Beside them, where ``optimum-quanto`` or
   ``hqq`` are installed, transformers' ``QuantizedCache`` (4-bit quanto and hqq, group 64,
   the last 16 tokens kept in full precision; and its per-tensor ``fp8`` backend) on the same
   model: the same figures, its bytes counted from the tensors it holds.

The script exits 1 when a memory or accuracy bound is broken; times are printed, never
asserted (shared machines are noisy).

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/quantized.py
    .venv/bin/python benchmarks/quantized.py --quick     # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
from _harness import BenchParser, print_environment, run, take_turns, within

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager

Manager = PagedKvCacheManager[torch.Tensor]
QUANTIZED = ("int8", "float8_e4m3fn")
#: Relative Frobenius error bound of the attention output, per quantized dtype.
ERROR_BOUNDS = {"int8": 0.01, "float8_e4m3fn": 0.05}
#: Memory bounds: (dtype, against dtype, the most allowed).
MEMORY_BOUNDS = (("int8", "float32", 0.27), ("int8", "float16", 0.53), ("float8_e4m3fn", "float32", 0.26))


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="small sizes, few rounds")
    parser.flag("--context", (4096, 512), help="tokens per request (accuracy and speed)")
    parser.flag("--batch", 1, help="requests in the timed decode step")
    parser.geometry(kv_heads=8, query_heads=32, head_dim=128)
    parser.flag("--prefill", (64, 16), help="query positions of the prefill accuracy case")
    parser.flag("--model-tokens", (512, 64), help="tokens of the model's forward pass")
    parser.flag("--rounds", (15, 3), help="timed rounds (each dtype once per round)")
    parser.timing((5, 2), what="calls per timed sample")
    parser.seed(what="K/V, queries and weights")
    parser.flag("--prompt", 32, help="prompt tokens of the generate comparison")
    parser.flag("--new-tokens", 24, help="greedy tokens of the generate comparison")
    return parser.parse(argv)


def pool_config(
    dtype: str, args: argparse.Namespace, tokens: int, heads: int, head_dim: int, layers: int = 1
) -> CacheConfig:
    block_size = 16
    return CacheConfig(
        num_layers=layers,
        num_heads=heads,
        head_dim=head_dim,
        num_blocks=-(-tokens // block_size) + 1,
        block_size=block_size,
        dtype=dtype,
        kv_layout="heads_first",
    )


# -- 1. memory ------------------------------------------------------------------------------


def memory(args: argparse.Namespace) -> list[str]:
    """Print the pools' bytes; return the bounds broken."""
    sizes: dict[str, int] = {}
    for dtype in ("float32", "float16", *QUANTIZED):
        with create_manager("torch", pool_config(dtype, args, 4096, args.kv_heads, 128)) as manager:
            sizes[dtype] = manager.stats().total_memory_bytes
    print(f"memory: a pool of 4096 tokens, {args.kv_heads} KV heads of 128 (scales included)")
    for dtype, size in sizes.items():
        print(f"  {dtype:>14}: {size / 2**20:8.2f} MiB  {size / sizes['float32']:.4f}x float32")
    broken: list[str] = []
    for dtype, against, bound in MEMORY_BOUNDS:
        ratio = sizes[dtype] / sizes[against]
        print(f"  {dtype} / {against} = {ratio:.4f}x (bound {bound}x) {within(ratio <= bound)}")
        if ratio > bound:
            broken.append(f"memory {dtype}/{against} {ratio:.4f}x > {bound}x")
    return broken


# -- 2. accuracy ----------------------------------------------------------------------------


def attend(
    dtype: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    prefill: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``keys``/``values`` ``[layers, tokens, heads, dim]`` into a ``dtype`` pool, one
    request; attend ``queries [layers, tokens, query_heads, dim]``: decode (last position)
    and prefill (the last ``prefill`` positions), every layer stacked."""
    layers, tokens, heads, head_dim = keys.shape
    config = CacheConfig(
        num_layers=layers,
        num_heads=heads,
        head_dim=head_dim,
        num_blocks=-(-tokens // 16),
        block_size=16,
        dtype=dtype,
        kv_layout="heads_first",
    )
    decode: list[torch.Tensor] = []
    chunk: list[torch.Tensor] = []
    with create_manager("torch", config) as manager:
        handle = manager.allocate(AllocationRequest("r", max_sequence_length=tokens))
        slots = manager.extend(handle, tokens)
        for layer in range(layers):
            manager.write(layer, slots, keys[layer].contiguous(), values[layer].contiguous())
        table = manager.page_table([handle])
        indptr = np.array([0, prefill], dtype=np.int32)
        for layer in range(layers):
            decode.append(manager.paged_attention(layer, queries[layer, -1:].contiguous(), table))
            chunk.append(
                manager.paged_attention(layer, queries[layer, -prefill:].contiguous(), table, qo_indptr=indptr)
            )
    return torch.stack(decode), torch.stack(chunk)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    difference: npt.NDArray[np.float64] = (got.double() - expected.double()).numpy()
    reference: npt.NDArray[np.float64] = expected.double().numpy()
    return float(np.linalg.norm(difference) / np.linalg.norm(reference))


def compare(
    name: str, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, prefill: int, *, bounded: bool = True
) -> list[str]:
    """Print each quantized dtype's error against float32 on these inputs; return the bounds
    broken (none when not ``bounded``)."""
    base_decode, base_prefill = attend("float32", keys, values, queries, prefill)
    broken: list[str] = []
    for dtype in QUANTIZED:
        decode, chunk = attend(dtype, keys, values, queries, prefill)
        errors = {"decode": relative_error(decode, base_decode), "prefill": relative_error(chunk, base_prefill)}
        bound = ERROR_BOUNDS[dtype]
        shown = ", ".join(f"{case} {error * 100:.3f}%" for case, error in errors.items())
        worst = max(errors.values())
        verdict = within(worst <= bound) if bounded else "(not bounded)"
        print(f"  {name:>12} {dtype:>14}: {shown} (bound {bound * 100:.0f}%) {verdict}")
        if bounded and worst > bound:
            broken.append(f"accuracy {name} {dtype}: {worst * 100:.3f}% > {bound * 100:.0f}%")
    return broken


def gaussian_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed)
    shape = (1, args.context, args.kv_heads, args.head_dim)
    keys = torch.randn(shape, generator=generator)
    values = torch.randn(shape, generator=generator)
    queries = torch.randn((1, args.context, args.query_heads, args.head_dim), generator=generator)
    return keys, values, queries


def model_inputs(
    args: argparse.Namespace, initializer_range: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Q, K, V (after RoPE) of every layer of a random-weight Llama-like model's forward pass:
    ``[layers, tokens, heads, dim]`` each, and a description of the model."""
    import transformers
    from _harness.generation import ModelShape, random_model

    # transformers' attention registry and SDPA function, untyped there: held as Any.
    interface: Any = getattr(transformers, "AttentionInterface")  # noqa: B009
    sdpa_module: Any = importlib.import_module("transformers.integrations.sdpa_attention")

    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def capture(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # [batch, heads, tokens, dim] -> [tokens, heads, dim] of the one sequence
        captured.append(tuple(t[0].transpose(0, 1).detach().clone() for t in (query, key, value)))  # type: ignore[arg-type]
        output: tuple[torch.Tensor, None] = sdpa_module.sdpa_attention_forward(
            module, query, key, value, attention_mask, **kwargs
        )
        return output

    interface.register("kvcache_quantized_capture", capture)
    model = random_model(
        "llama",
        ModelShape(layers=2, hidden=1024, intermediate=2048, query_heads=8, kv_heads=2, vocab=1000),
        seed=args.seed,
        max_positions=max(args.model_tokens, 16),
        initializer_range=initializer_range,
        generating=False,
    )
    config = model.config
    model.set_attn_implementation("kvcache_quantized_capture")
    ids = torch.randint(
        0, config.vocab_size, (1, args.model_tokens), generator=torch.Generator().manual_seed(args.seed)
    )
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    queries, keys, values = (torch.stack([layer[i] for layer in captured]) for i in range(3))
    description = (
        f"Llama-like, {config.num_hidden_layers} layers, {config.num_attention_heads} query / "
        f"{config.num_key_value_heads} KV heads of {config.head_dim}, random weights (seed {args.seed}), "
        f"initializer_range {initializer_range}, {args.model_tokens} random token ids"
    )
    return queries, keys, values, description


def accuracy(args: argparse.Namespace) -> list[str]:
    prefill = min(args.prefill, args.context, args.model_tokens)
    print(
        f"accuracy: attention output vs the float32 pool, relative Frobenius error (decode, and a "
        f"prefill of the last {prefill} positions)"
    )
    keys, values, queries = gaussian_inputs(args)
    print(f"  gaussian: {args.context} tokens, {args.kv_heads} KV / {args.query_heads} query heads of {args.head_dim}")
    broken = compare("gaussian", keys, values, queries, prefill)
    for name, initializer_range, bounded in (("model", 0.02, True), ("model-sharp", 0.1, False)):
        model_queries, model_keys, model_values, description = model_inputs(args, initializer_range)
        scores = (
            torch.einsum("tqd,sqd->qts", model_queries[0, :, :1], model_keys[0, :, :1]) / model_keys.shape[-1] ** 0.5
        )
        print(f"  {name}: {description}; attention scores of std {float(scores.std()):.2f}")
        broken += compare(name, model_keys, model_values, model_queries, prefill, bounded=bounded)
    return broken


# -- 3. speed ---------------------------------------------------------------------------------


def decode_setup(dtype: str, args: argparse.Namespace) -> tuple[Manager, Callable[[], object]]:
    """A pool of ``--batch`` requests of ``--context`` tokens (Gaussian K/V) and its decode call."""
    tokens = args.batch * args.context
    config = pool_config(dtype, args, tokens + 16 * args.batch, args.kv_heads, args.head_dim)
    manager = create_manager("torch", config)
    handles = [
        manager.allocate(AllocationRequest(f"r{b}", max_sequence_length=args.context)) for b in range(args.batch)
    ]
    generator = torch.Generator().manual_seed(args.seed)
    for handle in handles:
        slots = manager.extend(handle, args.context)
        shape = (args.context, args.kv_heads, args.head_dim)
        manager.write(0, slots, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    table = manager.page_table(handles)
    query = torch.randn((args.batch, args.query_heads, args.head_dim), generator=generator)
    return manager, lambda: manager.paged_attention(0, query, table)


def speed(args: argparse.Namespace) -> None:
    calls: dict[str, Callable[[], object]] = {}
    managers: list[Manager] = []
    for dtype in ("float32", *QUANTIZED):
        manager, call = decode_setup(dtype, args)
        managers.append(manager)
        calls[dtype] = call
    # One untimed round compiles and warms every call.
    times = take_turns(calls, rounds=args.rounds, warmup=1, calls=args.repeats, statistic=args.statistic)
    base = times.seconds("float32")
    print(
        f"speed: decode attention, {args.batch} request(s) x {args.context} tokens, {args.kv_heads} KV / "
        f"{args.query_heads} query heads of {args.head_dim}, torch CPU, {torch.get_num_threads()} threads; "
        f"{args.statistic} of {args.rounds} rounds x {args.repeats} calls"
    )
    for dtype in calls:
        seconds = times.seconds(dtype)
        print(
            f"  {dtype:>14}: {seconds * 1e6:9.1f} us  {seconds / base:.2f}x float32  (spread {times.spread(dtype):.0%})"
        )
    for manager in managers:
        manager.close()


# -- 4. generate ------------------------------------------------------------------------------


def tensor_bytes(value: object, seen: set[int], depth: int = 0) -> int:
    """Bytes of the tensors ``value`` holds (tensor subclasses through their inner tensors,
    containers and plain objects a few levels deep), each storage counted once."""
    if isinstance(value, torch.Tensor):
        flatten = getattr(value, "__tensor_flatten__", None)
        if type(value) is not torch.Tensor and flatten is not None:
            names, _ = flatten()
            return sum(tensor_bytes(getattr(value, name), seen, depth + 1) for name in names)
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return int(storage.nbytes())
    if depth > 4:
        return 0
    if isinstance(value, (list, tuple)):
        items: list[object] = list(cast("list[object] | tuple[object, ...]", value))
        return sum(tensor_bytes(item, seen, depth + 1) for item in items)
    if isinstance(value, dict):
        entries: list[object] = list(cast("dict[object, object]", value).values())
        return sum(tensor_bytes(item, seen, depth + 1) for item in entries)
    attributes: dict[str, object] | None = getattr(value, "__dict__", None)
    if attributes is None or isinstance(value, type):
        return 0
    return sum(tensor_bytes(item, seen, depth + 1) for item in attributes.values())


def generate_row(label: str, result: Any, expected: Any, prompt: int, held_bytes: int, float32_bytes: int) -> str:
    ours, theirs = result.sequences[0, prompt:], expected.sequences[0, prompt:]
    differing = (ours != theirs).nonzero()
    first = int(differing[0]) if len(differing) else None
    steps = len(expected.logits) if first is None else first + 1
    largest = max(
        float((a - b).abs().max()) for a, b in zip(result.logits[:steps], expected.logits[:steps], strict=True)
    )
    shown_first = "-" if first is None else str(first)
    return (
        f"    {label:<28} first divergent step {shown_first:>3}  max logit diff {largest:8.4f}  "
        f"K/V {held_bytes / 1024:7.1f} KiB = {held_bytes / float32_bytes:.3f}x float32"
    )


def generate_comparison(args: argparse.Namespace) -> None:
    from _harness.generation import ARCHITECTURES, ModelShape, random_model

    from kvcache_torch.hf import ATTN_IMPLEMENTATION, PagedCache, cache_config_for

    quantized_cache: Any = getattr(importlib.import_module("transformers.cache_utils"), "QuantizedCache")  # noqa: B009
    options: dict[str, Any] = {
        "max_new_tokens": args.new_tokens,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
        "pad_token_id": 0,
    }
    print(
        f"generate: {args.new_tokens} greedy tokens after a {args.prompt}-token prompt, random-weight models "
        "(2 layers, hidden 256, 4 query / 2 KV heads of 64, vocab 1000, initializer_range 0.05), against float32 "
        "DynamicCache; logit differences up to and including the first divergent step"
    )
    shape = ModelShape(layers=2, hidden=256, intermediate=512, query_heads=4, kv_heads=2, vocab=1000)
    for architecture in ARCHITECTURES:
        model = random_model(architecture, shape, seed=args.seed, max_positions=256, initializer_range=0.05)
        config = model.config
        ids = torch.randint(3, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed + 1))
        mask = torch.ones_like(ids)
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=mask, **options)
        tokens = args.prompt + args.new_tokens - 1  # the last token's K/V is never written
        float32_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * tokens * config.head_dim * 4
        print(f"  {architecture}:")
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        for dtype in ("float32", *QUANTIZED):
            pool = cache_config_for(model, dtype=dtype, max_tokens=args.prompt + args.new_tokens)
            with create_manager("torch", pool) as manager, PagedCache(manager, model.config) as cache:
                with torch.no_grad():
                    result = model.generate(ids, attention_mask=mask, cache=cache, **options)
                held = manager.stats().used_memory_bytes
            print(generate_row(f"ours {dtype} pool", result, expected, args.prompt, held, float32_bytes))
        model.set_attn_implementation("sdpa")
        for backend, settings in (
            ("quanto", {"nbits": 4, "q_group_size": 64, "residual_length": 16}),
            ("hqq", {"nbits": 4, "q_group_size": 64, "residual_length": 16}),
            ("fp8", {}),
        ):
            label = f"QuantizedCache {backend}" + (" int4" if settings else "")
            try:
                cache = quantized_cache(backend, config, **settings)
                with torch.no_grad():
                    result = model.generate(ids, attention_mask=mask, past_key_values=cache, **options)
            except Exception as exc:  # an optional comparison: say why it is missing
                print(f"    {label:<28} unavailable: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            held = tensor_bytes(cache.layers, set())
            print(generate_row(label, result, expected, args.prompt, held, float32_bytes))


def main() -> int:
    args = parse_arguments()
    print_environment()
    broken = memory(args)
    broken += accuracy(args)
    speed(args)
    generate_comparison(args)
    if broken:
        print("BROKEN: " + "; ".join(broken))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
