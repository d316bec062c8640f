"""A request's KV cache handed from one process's pool to another's over NIXL (UCX's TCP
transport on loopback), against the raw NIXL read of the same bytes, side by side.

A producer process (spawned) prefills a request of each ``--tokens`` length into a pool of
``--backend`` (``numpy`` or ``torch``, CPU; ``--layout``, ``NHD`` by default; float16) and
exports it; this process imports it into its own pool (``--consumer-layout``: by default the
producer's, read straight into its blocks; another layout is read into a staging buffer and
converted on arrival into the request's blocks) with ``KvTransferAgent.import_request`` (side
channel, allocation, one NIXL READ of every layer's blocks, checksums, registration) and, in
turn, reads the same chunks with a bare NIXL READ into a staging buffer (no checks, no
conversion). Printed per length: milliseconds, GiB/s and blocks/s of both and the ratio of
the throughputs (target: ours >= 0.7x raw). The imported blocks are compared bit for bit
with the raw read (exit status 1 on a difference). Requires the ``transfer`` extra.

Run, from the repository root::

    .venv/bin/python benchmarks/transfer.py              # 1k, 4k, 16k tokens, a minute
    .venv/bin/python benchmarks/transfer.py --quick      # 512 and 1k tokens, seconds
    .venv/bin/python benchmarks/transfer.py --backend torch --layout heads_first   # torch's own layout
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from _harness import BenchParser, int_list, mib, print_environment, ratio, require, run, take_turns
from _harness.nixl_read import RawReader

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager
from kvcache_core.contract.config import KV_LAYOUTS
from kvcache_core.contract.regions import host_form_from_parts
from kvcache_core.transfer import KvTransferAgent, TransferTicket


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="requests of 512 and 1k tokens of 2 layers, 2 repeats")
    parser.flag("--tokens", ([1024, 4096, 16384], [512, 1024]), type=int_list, help="request lengths")
    parser.geometry(layers=(4, 2), kv_heads=8, head_dim=128, block_size=16)
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="pool dtype (float16)")
    parser.add_argument("--backend", choices=("numpy", "torch"), default="numpy", help="both pools' backend (numpy)")
    parser.add_argument("--layout", choices=KV_LAYOUTS, default="NHD", help="layout of the exporting pool (NHD)")
    parser.add_argument(
        "--consumer-layout",
        choices=KV_LAYOUTS,
        default=None,
        help="layout of the importing pool (default: the producer's, read in place)",
    )
    parser.timing((3, 2), what="timed handoffs per competitor and length")
    parser.seed(what="K/V")
    return parser.parse(argv)


def pool_config(args: argparse.Namespace, layout: str, *, prefix_caching: bool) -> CacheConfig:
    """One pool of the benchmark: room for the longest request twice."""
    blocks = 2 * (-(-max(args.tokens) // args.block_size)) + 2
    return CacheConfig(
        num_layers=args.layers,
        num_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_blocks=blocks,
        block_size=args.block_size,
        dtype=args.dtype,
        kv_layout=layout,
        enable_prefix_caching=prefix_caching,
        model_id="benchmark-model@1",
    )


def serve(connection: Connection, args: argparse.Namespace) -> None:
    """The producer: prefill, export on request; ``("stop",)`` ends it."""
    backend: str = args.backend
    with create_manager(backend, pool_config(args, args.layout, prefix_caching=True)) as manager:
        agent = KvTransferAgent(manager, lease_seconds=120.0)
        rng = np.random.default_rng(args.seed)
        config = manager.config
        native = _torch_tensor if backend == "torch" else _same
        while True:
            command = connection.recv()
            if command[0] == "prefill":
                request_id, tokens = str(command[1]), int(command[2])
                prompt: list[int] = rng.integers(0, 32_000, tokens).tolist()
                handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt))
                slots = manager.extend(handle, tokens)
                shape = (tokens, config.num_heads, config.head_dim)
                for layer in range(config.num_layers):
                    keys, values = (native(rng.random(shape, dtype=np.float32).astype(config.dtype)) for _ in range(2))
                    manager.write(layer, slots, keys, values)
                connection.send(("ok",))
            elif command[0] == "export":
                exported = manager.get_handle(command[1])
                assert exported is not None
                connection.send(("ticket", agent.export(exported).to_bytes()))
            else:
                agent.close()
                return


def _same(array: np.ndarray[Any, Any]) -> Any:
    return array


def _torch_tensor(array: np.ndarray[Any, Any]) -> Any:
    import torch  # the torch backend's pools take tensors; imported for it only

    return torch.from_numpy(array)  # pyright: ignore[reportUnknownMemberType]


def main(argv: Sequence[str] | None = None) -> int:
    """Handoffs of each length, ours and raw; ``DisagreementError`` when they differ."""
    args = parse_args(argv)
    if args.consumer_layout is None:
        args.consumer_layout = args.layout
    print_environment()
    spawn = multiprocessing.get_context("spawn")
    ours_end, producer_end = spawn.Pipe()
    producer = spawn.Process(target=serve, args=(producer_end, args), daemon=True)
    producer.start()
    backend: str = args.backend
    consumer: PagedKvCacheManager[Any] = create_manager(
        backend, pool_config(args, args.consumer_layout, prefix_caching=False)
    )
    agent = KvTransferAgent(consumer, timeout_seconds=120.0)
    raw = RawReader(consumer.config)
    config = consumer.config
    bytes_per_token = 2 * config.num_layers * config.num_heads * config.head_dim * config.dtype_size
    print(
        f"producer: {args.backend} {args.layout} {config.dtype}, consumer: {args.backend} {args.consumer_layout}; {config.num_layers} layers x "
        f"{config.num_heads} KV heads x {config.head_dim}, block {config.block_size}; UCX over TCP on 127.0.0.1"
    )
    header = (
        f"{'tokens':>8}{'size':>12}{'raw ms':>10}{'raw GiB/s':>11}{'ours ms':>10}{'ours GiB/s':>12}"
        f"{'blocks/s':>11}{'ours/raw':>10}"
    )
    print(header)
    print("-" * len(header))
    worst = float("inf")
    try:
        for tokens in args.tokens:
            request_id = f"p{tokens}"
            ours_end.send(("prefill", request_id, tokens))
            ours_end.recv()
            counter = iter(range(10**6))

            def ticket(request_id: str = request_id) -> TransferTicket:
                ours_end.send(("export", request_id))
                return TransferTicket.from_bytes(ours_end.recv()[1])

            def ours(tickets: dict[str, TransferTicket], counter: Any = counter) -> Any:
                return agent.import_request(tickets["ours"], AllocationRequest(f"c{next(counter)}"))

            def bare(tickets: dict[str, TransferTicket]) -> Any:
                return raw.read(tickets["raw"])

            def check(results: Any, _: int, tokens: int = tokens) -> None:
                handle = results["ours"]
                table = handle.block_table()
                ours_keys, ours_values = consumer.storage.blocks_to_host(
                    np.asarray(table.physical_blocks, dtype=np.int64)
                )
                consumer.deallocate(handle.request_id)
                keys, values = host_form_from_parts(consumer.config, args.layout, results["raw"])
                require(
                    np.asarray(ours_keys).tobytes() == keys.tobytes()
                    and np.asarray(ours_values).tobytes() == values.tobytes(),
                    f"the imported blocks of {tokens} tokens differ from the raw read",
                )

            timings = take_turns(
                {"ours": ours, "raw": bare},
                rounds=args.repeats,
                warmup=1,
                inputs=lambda: {"ours": ticket(), "raw": ticket()},
                check=check,
                statistic=args.statistic,
            )
            size = tokens * bytes_per_token
            blocks = -(-tokens // config.block_size)
            ours_s, raw_s = timings.seconds("ours"), timings.seconds("raw")
            worst = min(worst, raw_s / ours_s)
            print(
                f"{tokens:>8}{mib(size):>12}{raw_s * 1e3:>10.1f}{size / raw_s / 2**30:>11.3f}{ours_s * 1e3:>10.1f}"
                f"{size / ours_s / 2**30:>12.3f}{blocks / ours_s:>11.0f}{ratio(raw_s, ours_s):>10}"
            )
    finally:
        ours_end.send(("stop",))
        producer.join(timeout=60)
        agent.close()
        raw.close()
        consumer.close()
    print(
        f"throughput ours / raw NIXL, worst length: {worst:.2f}x (target >= 0.7x: {'met' if worst >= 0.7 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
