"""Disaggregated prefill and decode with transformers: a decode worker's time to its first token
when a prefill worker hands it the prompt's K/V over NIXL, against recomputing the prompt
itself; and that handoff's transfer against the raw NIXL read of the same bytes. Side by side,
in one run.

A producer process (spawned) prefills a ``--prompt-length``-token prompt with a ``PagedCache``
(``generate`` of one token, on a random-weight Llama-like model, fp32, torch CPU pool) and
exports the request on demand. This process, the decode worker, holds the same model (same
seed) and its own torch pool, and times, taking turns:

* **handoff**: ``KvTransferAgent.import_request`` (side channel, allocation, one NIXL READ of
  every layer's blocks straight into its pool, checksums) + ``PagedCache(..., handles=[h])`` +
  the first decode step (one forward of the first token over the imported prompt);
* **recompute**: one forward of the prompt and the first token on an empty ``PagedCache``
  (what a decode worker without the handoff computes before its first token);
* **import**: ``import_request`` alone, and **raw**: a bare NIXL READ of the same chunks into
  a staging buffer (``_harness.nixl_read``): their throughputs and ratio.

Every round checks that the handoff's logits equal the recompute's (within 1e-3; exit status 1
otherwise): the imported K/V are the prompt's. Printed: medians
(``--statistic``), the handoff / recompute ratio (target <= 0.5x) and the transfer throughput
ours / raw (target >= 0.7x). The ratio of the first depends on the model: the larger its
layers, the more a recompute costs against the bytes moved. Requires the ``transfer`` extra.

Run, from the repository root::

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/handoff.py            # a 2k-token prompt, a minute or two
    .venv/bin/python benchmarks/handoff.py --quick        # a 256-token prompt of a smaller model
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
import multiprocessing
import os
import sys
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import torch  # after the offline switch, which transformers reads on import
from _harness import BenchParser, agree, generation, met, mib, print_environment, ratio, require, run, take_turns
from _harness.nixl_read import RawReader

from kvcache_core import AllocationRequest, PagedKvCacheManager, create_manager
from kvcache_core.transfer import KvTransferAgent, TransferTicket
from kvcache_torch.hf import ATTN_IMPLEMENTATION, PagedCache, cache_config_for

MODEL_ID = "handoff-benchmark@1"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="a 256-token prompt, a 2-layer model of width 128, 2 repeats")
    parser.flag("--prompt-length", (2048, 256), help="prompt tokens")
    parser.geometry(layers=(4, 2), hidden=(512, 128), query_heads=(8, 4), kv_heads=(4, 2), block_size=16)
    parser.flag("--intermediate", (1024, 256), help="MLP width")
    parser.flag("--vocab", 1000, help="vocabulary size")
    parser.timing((5, 2), what="timed rounds (each competitor once a round)")
    parser.threads()
    parser.seed(what="weights and prompt")
    return parser.parse(argv)


def build_model(args: argparse.Namespace) -> Any:
    """The random-weight model of both workers (same ``--seed``: same weights), on the paged path."""
    shape = generation.ModelShape(
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        query_heads=args.query_heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
    )
    model = generation.random_model(
        "llama", shape, seed=args.seed, max_positions=args.prompt_length + 16, initializer_range=0.1
    )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def make_pool(model: Any, args: argparse.Namespace, requests: int) -> PagedKvCacheManager[torch.Tensor]:
    """A torch pool (no prefix caching: a recompute must not hit the imported blocks) for
    ``requests`` requests of the prompt and a few tokens."""
    blocks = requests * (-(-(args.prompt_length + 8) // args.block_size)) + 2
    config = cache_config_for(model, num_blocks=blocks, block_size=args.block_size)
    config = dataclasses.replace(config, model_id=MODEL_ID)
    manager: PagedKvCacheManager[torch.Tensor] = create_manager("torch", config)
    return manager


def prompt_of(args: argparse.Namespace) -> list[int]:
    """The prompt both workers know: ``--prompt-length`` ids drawn with ``--seed``."""
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(2, args.vocab, (args.prompt_length,), generator=generator)
    return [int(token) for token in ids]


def serve(connection: Connection, args: argparse.Namespace) -> None:
    """The prefill worker: prefill the prompt, send the first token; export on request;
    ``("stop",)`` ends it."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    prompt = prompt_of(args)
    with make_pool(model, args, 2) as manager, KvTransferAgent(manager, lease_seconds=300.0) as agent:
        with PagedCache(manager, model) as cache, torch.no_grad():
            out = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)
            kept = manager.fork(cache.handles[0], "prefilled")  # outlives the cache
        connection.send(int(out[0, -1]))
        while (command := connection.recv()) != ("stop",):
            assert command == ("export",), command
            connection.send(agent.export(kept, token_ids=prompt).to_bytes())


def main(argv: Sequence[str] | None = None) -> int:
    """Time the handoff against the recompute, the import against the raw read."""
    args = parse_args(argv)
    print_environment()
    nixl = ", ".join(f"{name} {version}" for name in ("nixl", "nixl-cu12") if (version := _version(name)))
    print(f"transfer: {nixl or 'NIXL version unknown'}; UCX over TCP on 127.0.0.1")
    if args.threads:
        torch.set_num_threads(args.threads)
    spawn = multiprocessing.get_context("spawn")
    ours_end, producer_end = spawn.Pipe()
    producer = spawn.Process(target=serve, args=(producer_end, args), daemon=True)
    producer.start()
    producer_end.close()  # the producer's end lives in the producer only: its exit ends the pipe
    model = build_model(args)
    prompt = prompt_of(args)
    consumer = make_pool(model, args, 3)
    agent = KvTransferAgent(consumer, timeout_seconds=120.0)
    raw = RawReader(consumer.config)
    config = consumer.config
    try:
        if not ours_end.poll(600):
            raise RuntimeError("the prefill worker sent nothing in 600 s")
        first = int(ours_end.recv())
        names = itertools.count()

        def ticket() -> TransferTicket:
            ours_end.send(("export",))
            return TransferTicket.from_bytes(ours_end.recv())

        def handoff(tickets: Mapping[str, TransferTicket]) -> Any:
            handle = agent.import_request(tickets["handoff"], AllocationRequest(f"h{next(names)}"))
            with PagedCache(consumer, model, handles=[handle]) as cache, torch.no_grad():
                return model(input_ids=torch.tensor([[first]]), cache=cache, use_cache=True).logits[0, -1]

        def recompute(_: Mapping[str, TransferTicket]) -> Any:
            with PagedCache(consumer, model) as cache, torch.no_grad():
                return model(input_ids=torch.tensor([[*prompt, first]]), cache=cache, use_cache=True).logits[0, -1]

        def imported(tickets: Mapping[str, TransferTicket]) -> Any:
            return agent.import_request(tickets["import"], AllocationRequest(f"i{next(names)}"))

        def bare(tickets: Mapping[str, TransferTicket]) -> Any:
            return raw.read(tickets["raw"])

        def check(results: Mapping[str, Any], index: int) -> None:
            same, worst = agree([results["handoff"]], [results["recompute"]], atol=generation.LOGIT_TOLERANCE)
            if index == 0:
                print(f"  verify: handoff vs recompute logits {'match' if same else 'DIFFER'} (max |diff| {worst:.1e})")
            require(same, f"the handoff's logits differ from the recompute's by {worst:.3e}")
            consumer.deallocate(results["import"].request_id)  # (its bytes: the handoff's logits check them)

        timings = take_turns(
            {"handoff": handoff, "recompute": recompute, "import": imported, "raw": bare},
            rounds=args.repeats,
            warmup=1,
            inputs=lambda: {name: ticket() for name in ("handoff", "import", "raw")},
            check=check,
            statistic=args.statistic,
        )
    finally:
        ours_end.send(("stop",))
        producer.join(timeout=60)
        agent.close()
        raw.close()
        consumer.close()
    size = len(prompt) * 2 * config.num_layers * config.num_heads * config.head_dim * config.dtype_size
    print(
        f"model: llama, {args.layers} layers, hidden {args.hidden}, {args.query_heads} query / {args.kv_heads} KV "
        f"heads, fp32; prompt {len(prompt)} tokens, K/V {mib(size)}; torch {torch.get_num_threads()} threads"
    )
    rows = (
        ("recompute (prefill on the decode side)", "recompute"),
        ("handoff (import + first decode step)", "handoff"),
        ("  import_request alone", "import"),
        ("  raw NIXL read of the same bytes", "raw"),
    )
    for label, name in rows:
        extra = f"{size / timings.seconds(name) / 2**30:>8.3f} GiB/s" if name in ("import", "raw") else ""
        print(f"{label:<42}{timings.ms(name):>10.1f} ms{extra}")
    ttft = timings.seconds("handoff") / timings.seconds("recompute")
    throughput = timings.seconds("raw") / timings.seconds("import")
    print(
        f"time to first token, handoff / recompute: {ratio(timings.seconds('handoff'), timings.seconds('recompute'))} "
        f"(target <= 0.5x: {met(ttft <= 0.5)})"
    )
    print(
        f"transfer throughput, ours / raw NIXL: {ratio(timings.seconds('raw'), timings.seconds('import'))} "
        f"(target >= 0.7x: {met(throughput >= 0.7)}); {args.statistic} of {args.repeats} rounds"
    )
    return 0


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(run(main))
