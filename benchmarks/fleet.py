"""A fleet of managers in processes of their own, each with a pool a tenth of the working set,
isolated, sharing a RedisTier, and sharing it behind a KvAwareRouter, side by side.

``--workers`` processes (4) each run a NumPy manager whose pool holds a tenth of the working
set (the distinct blocks of every prompt). Two workloads: a multi-tenant multi-turn chat
(``--tenants`` 4 with their own salt and system prompt, ``--conversations`` 6 each, ``--turns``
5, admitted round robin) and a shared system prompt (``--requests`` 48 requests of one system
prompt and a question of their own). Three configurations:

* **isolated**: each request goes to a worker drawn at random (a load balancer that knows no
  cache); each worker has its pool only;
* **shared tier**: the same draws; every worker has a ``RedisTier`` on one ``redis-server``
  (started here on a free port, no persistence) behind its pool;
* **tier + router**: the shared tier, and each request goes where a ``KvAwareRouter``
  following the workers' event streams says (the longest cached prefix, the least loaded
  among equals).

Printed per workload and configuration: the prefix-cache hit rate (full prompt blocks mapped
from a pool or promoted from the tier, over those looked up), the prompt tokens computed, the
median time of a request in its worker (allocate, promote, compute the rest: write its K/V),
and the ratios to isolated; then the tier's get and put throughput against the raw redis-py
client on the same bytes. Every request's K/V is gathered and compared bit for bit with what
was written (exit status 1 on a difference). Targets, on the chat: the shared tier >= 2x the
isolated hit rate; with the router, tokens computed <= 0.5x isolated. Without a
``redis-server`` (or redis-py) only the isolated configuration runs.

Run, from the repository root::

    .venv/bin/python benchmarks/fleet.py              # about a minute
    .venv/bin/python benchmarks/fleet.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from _harness import BenchParser, met, print_environment, ratio, require, run

from kvcache_core import AllocationRequest, CacheConfig, create_manager

Array = npt.NDArray[Any]
MODES = ("isolated", "shared tier", "tier + router")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, quick="3 tenants x 4 conversations x 3 turns, 16 requests")
    parser.flag("--workers", 4, help="worker processes")
    parser.flag("--tenants", (4, 3), help="chat tenants (salts)")
    parser.flag("--conversations", (6, 4), help="conversations per tenant")
    parser.flag("--turns", (5, 3), help="turns per conversation")
    parser.flag("--requests", (48, 16), help="requests of the shared-system-prompt workload")
    parser.flag("--records", (512, 64), help="records of the tier's get/put throughput")
    parser.geometry(layers=2, kv_heads=2, head_dim=64, block_size=16)
    parser.seed(what="prompts, K/V and the workers drawn")
    return parser.parse(argv)


@dataclass(frozen=True)
class Prompt:
    """One request of a workload: its tokens, its salt and the K/V of every position."""

    tokens: tuple[int, ...]
    salt: str | None
    keys: Array  # [layers, length, kv_heads, head_dim]
    values: Array


def chat_workload(args: argparse.Namespace) -> list[Prompt]:
    """Every turn of every conversation, in the order they arrive (round robin per turn)."""
    rng = np.random.default_rng(args.seed + 1)
    block = int(args.block_size)
    finals: list[tuple[list[int], list[int], str, Array, Array]] = []
    for tenant in range(args.tenants):
        system: list[int] = rng.integers(0, 32_000, 4 * block).tolist()
        system_kv = rng.standard_normal((2, args.layers, len(system), args.kv_heads, args.head_dim)).astype(np.float32)
        for _ in range(args.conversations):
            tokens = list(system)
            lengths: list[int] = []
            for _ in range(args.turns):
                tokens += rng.integers(0, 32_000, int(rng.integers(2, 5)) * block).tolist()
                lengths.append(len(tokens))
            own = (2, args.layers, len(tokens) - len(system), args.kv_heads, args.head_dim)
            kv = np.concatenate([system_kv, rng.standard_normal(own).astype(np.float32)], axis=2)
            finals.append((tokens, lengths, f"tenant-{tenant}", kv[0], kv[1]))
    return [
        Prompt(tuple(tokens[: lengths[turn]]), salt, keys[:, : lengths[turn]], values[:, : lengths[turn]])
        for turn in range(args.turns)
        for tokens, lengths, salt, keys, values in finals
    ]


def system_prompt_workload(args: argparse.Namespace) -> list[Prompt]:
    """One long system prompt, each request with a question of its own."""
    rng = np.random.default_rng(args.seed + 2)
    block = int(args.block_size)
    system: list[int] = rng.integers(0, 32_000, 8 * block).tolist()
    system_kv = rng.standard_normal((2, args.layers, len(system), args.kv_heads, args.head_dim)).astype(np.float32)
    prompts: list[Prompt] = []
    for _ in range(args.requests):
        question: list[int] = rng.integers(0, 32_000, int(rng.integers(1, 4)) * block + 3).tolist()
        own = rng.standard_normal((2, args.layers, len(question), args.kv_heads, args.head_dim)).astype(np.float32)
        kv = np.concatenate([system_kv, own], axis=2)
        prompts.append(Prompt(tuple(system + question), None, kv[0], kv[1]))
    return prompts


def working_set(prompts: list[Prompt], block_size: int) -> int:
    """The distinct (salt, prefix) blocks of every prompt, partial ones included."""
    blocks: set[tuple[object, ...]] = set()
    for prompt in prompts:
        for end in range(block_size, len(prompt.tokens) + block_size, block_size):
            blocks.add((prompt.salt, *prompt.tokens[: min(end, len(prompt.tokens))]))
    return len(blocks)


# -- a worker process -------------------------------------------------------------------------


def worker_main(connection: Connection, workloads: dict[str, list[Prompt]], args: argparse.Namespace) -> None:
    """Serve the coordinator's commands: ``("start", workload, pool, url, prefix, publish)``,
    ``("serve", index)``, ``("stop",)``, ``("quit",)``."""
    from kvcache_core.offload.publisher import ZmqEventPublisher
    from kvcache_core.offload.redis_tier import RedisTier

    manager: Any = None
    publisher: Any = None
    tier: Any = None
    prompts: list[Prompt] = []
    while True:
        command = connection.recv()
        if command[0] == "start":
            _, workload, pool, url, prefix, publish = command
            prompts = workloads[workload]
            config = CacheConfig(
                num_layers=args.layers, num_heads=args.kv_heads, head_dim=args.head_dim, num_blocks=pool,
                block_size=args.block_size, enable_prefix_caching=True, model_id="fleet-benchmark",
            )  # fmt: skip
            tier = None if url is None else RedisTier(url, 1 << 30, prefix=prefix, deadline_s=1.0)
            manager = create_manager("numpy", config, tiers=[] if tier is None else [tier])
            endpoints = (None, None)
            if publish:
                publisher = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
                manager.subscribe(publisher)
                endpoints = (publisher.endpoint, publisher.replay_endpoint)
            connection.send(endpoints)
        elif command[0] == "serve":
            prompt: Prompt = prompts[int(command[1])]
            started = time.perf_counter()
            handle = manager.allocate(
                AllocationRequest("r", len(prompt.tokens), prompt_token_ids=prompt.tokens, cache_salt=prompt.salt)
            )
            cached = handle.num_tokens()
            slots = manager.extend(handle, len(prompt.tokens) - cached)
            for layer in range(args.layers):
                manager.write(layer, slots, prompt.keys[layer, cached:], prompt.values[layer, cached:])
            seconds = time.perf_counter() - started
            exact = all(
                np.array_equal(pair[0], prompt.keys[layer]) and np.array_equal(pair[1], prompt.values[layer])
                for layer in range(args.layers)
                for pair in (manager.gather(handle, layer),)
            )
            manager.deallocate("r")
            if tier is not None:
                tier.flush(5.0)  # the next request, on any worker, may look for these blocks
            sequence = None if publisher is None else publisher.next_sequence
            connection.send((cached, len(prompt.tokens) - cached, seconds, exact, sequence))
        elif command[0] == "stop":
            stats = manager.stats()
            manager.close()
            if publisher is not None:
                publisher.close()
            if tier is not None:
                tier.close()
            manager = publisher = tier = None
            connection.send((stats.prefix_cache_queries, stats.prefix_cache_hits))
        else:
            return


@dataclass(frozen=True)
class FleetRun:
    """What serving one workload in one configuration measured."""

    queries: int
    hits: int
    computed: int
    seconds: list[float]
    mismatches: int

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.queries, 1)


def serve(
    args: argparse.Namespace,
    connections: list[Connection],
    workload: str,
    prompts: list[Prompt],
    pool: int,
    mode: str,
    url: str | None,
) -> FleetRun:
    """Serve ``prompts`` in order on the workers, configured as ``mode``."""
    from kvcache_core.offload.router import KvAwareRouter

    prefix = f"bench{uuid.uuid4().hex[:8]}"
    shared = url if mode != "isolated" else None
    for connection in connections:
        connection.send(("start", workload, pool, shared, prefix, mode == "tier + router"))
    endpoints = [connection.recv() for connection in connections]
    router = None
    if mode == "tier + router":
        router = KvAwareRouter(block_size=args.block_size, model_id="fleet-benchmark")
        for index, (endpoint, replay) in enumerate(endpoints):
            router.add_stream(f"w{index}", endpoint, replay_endpoint=replay, block_size=args.block_size)
        router.sync()
    draws = np.random.default_rng(args.seed + 3).integers(0, len(connections), len(prompts))
    computed = mismatches = 0
    seconds: list[float] = []
    for index, prompt in enumerate(prompts):
        worker = int(draws[index])
        if router is not None:
            worker = int(router.route(prompt.tokens, salt=prompt.salt).stream[1:])
        connections[worker].send(("serve", index))
        _, tokens, took, exact, sequence = connections[worker].recv()
        computed += tokens
        seconds.append(took)
        mismatches += not exact
        if router is not None:  # the router knows this request's blocks before the next arrives
            stream = router.streams[f"w{worker}"]
            deadline = time.monotonic() + 5.0
            while stream.expected != sequence and time.monotonic() < deadline:
                router.poll(0.01)
            if stream.expected != sequence:
                router.sync()
    queries = hits = 0
    for connection in connections:
        connection.send(("stop",))
        worker_queries, worker_hits = connection.recv()
        queries += worker_queries
        hits += worker_hits
    if router is not None:
        router.close()
    return FleetRun(queries, hits, computed, seconds, mismatches)


# -- the server and the tier's throughput -----------------------------------------------------------


@contextlib.contextmanager
def running_redis() -> Generator[str | None]:
    """The URL of a ``redis-server`` on a free port of 127.0.0.1 without persistence, once it
    answers (``None`` where there is no server binary or no redis-py); killed on exit, its
    folder removed, whatever happened (a server that did not start included)."""
    binary = os.environ.get("KVCACHE_REDIS_SERVER") or shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        yield None
        return
    if binary is None:
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="kvcache-fleet-") as directory:
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                directory,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            client: Any = redis.Redis(port=port, socket_connect_timeout=0.2)
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.ping()
                    break
                except redis.RedisError:
                    require(process.poll() is None and time.monotonic() < deadline, "redis-server did not start")
                    time.sleep(0.01)  # polling for the server, within the deadline
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.kill()
            process.wait()


def throughput(args: argparse.Namespace, url: str) -> tuple[float, float, float, float]:
    """MB/s of the tier's put (queue and write) and get (one round trip, strict parsing) and
    of the raw client's pipelined SET and GET of the same encoded bytes."""
    import redis

    from kvcache_core.offload.prefix_file import BlockRecord, encode_blocks, record_key
    from kvcache_core.offload.redis_tier import RedisTier
    from kvcache_core.paging.prefix import hash_block, namespace_root

    config = CacheConfig(
        num_layers=args.layers, num_heads=args.kv_heads, head_dim=args.head_dim, num_blocks=1,
        block_size=args.block_size, enable_prefix_caching=True, model_id="fleet-benchmark",
    )  # fmt: skip
    rng = np.random.default_rng(args.seed + 4)
    shape = (args.layers, args.block_size, args.kv_heads, args.head_dim)
    records: list[BlockRecord] = []
    parent = namespace_root(config.model_id)
    for index in range(args.records):
        tokens = tuple(range(index * args.block_size, (index + 1) * args.block_size))
        block_hash = hash_block(parent, tokens, None)
        block_keys, block_values = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        records.append(BlockRecord(block_hash, parent, None, tokens, block_keys, block_values))
        parent = block_hash
    megabytes = sum(record.nbytes for record in records) / 1e6
    tier = RedisTier(url, 1 << 30, prefix=f"put{uuid.uuid4().hex[:8]}", queue_bytes=1 << 30, deadline_s=10.0)
    tier.bind(config)
    started = time.perf_counter()
    for record in records:
        tier.put(record)
    require(tier.flush(60.0), "the tier's writes did not finish")
    put_s = time.perf_counter() - started
    tier.clear()  # forget the queue and the listing: the gets read the server
    keys = [record_key(record.block_hash, 0) for record in records]
    started = time.perf_counter()
    tier.prefetch(keys, None)
    got = [tier.peek(key) for key in keys]
    get_s = time.perf_counter() - started
    require(all(record is not None for record in got), "the tier lost a record")
    tier.close()
    client: Any = cast("Any", redis.Redis).from_url(url)
    values = [encode_blocks(config, [record]) for record in records]
    raw_keys = [f"raw{uuid.uuid4().hex[:8]}:{index}" for index in range(len(values))]
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for key, value in zip(raw_keys, values, strict=True):
        pipe.set(key, value)
    pipe.execute()
    raw_put_s = time.perf_counter() - started
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for key in raw_keys:
        pipe.get(key)
    require(pipe.execute() == values, "the raw client read other bytes back")
    raw_get_s = time.perf_counter() - started
    client.close()
    return megabytes / put_s, megabytes / get_s, megabytes / raw_put_s, megabytes / raw_get_s


# -- the coordinator ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The fleet side by side; ``DisagreementError`` on a K/V mismatch, 1 when a chat target
    is missed."""
    args = parse_args(argv)
    print_environment()
    workloads = {"chat": chat_workload(args), "system prompt": system_prompt_workload(args)}
    forking = "fork" in multiprocessing.get_all_start_methods()  # no re-import: the workers start at once
    context = multiprocessing.get_context("fork") if forking else multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(args.workers)]
    workers = [context.Process(target=worker_main, args=(child, workloads, args), daemon=True) for _, child in pipes]
    for worker in workers:
        worker.start()
    connections = [parent for parent, _ in pipes]
    try:
        with running_redis() as url:
            return measure(args, connections, workloads, url)
    finally:
        for connection in connections:
            connection.send(("quit",))
        for worker in workers:
            worker.join(10)


def measure(
    args: argparse.Namespace, connections: list[Connection], workloads: dict[str, list[Prompt]], url: str | None
) -> int:
    """Serve each workload in every mode (the shared ones where ``url`` names a server), print
    the table and the targets, then the tier's throughput; the exit status (1: a target missed)."""
    modes = MODES if url is not None else MODES[:1]
    if url is None:
        print("no redis-server or redis-py here: the shared tier and the router are not measured")
    status = 0
    for workload, prompts in workloads.items():
        blocks = working_set(prompts, args.block_size)
        longest = max(-(-len(prompt.tokens) // args.block_size) for prompt in prompts)
        pool = max(blocks // 10, longest)
        print(
            f"\n{workload}: {len(prompts)} requests on {args.workers} workers; working set {blocks} blocks, "
            f"pool {pool} blocks per worker ({pool / blocks:.0%})"
        )
        runs = {mode: serve(args, connections, workload, prompts, pool, mode, url) for mode in modes}
        header = f"{'':<16}{'hit rate':>10}{'tokens computed':>17}{'request ms':>12}{'K/V exact':>11}"
        print(header)
        print("-" * len(header))
        for mode, fleet_run in runs.items():
            print(
                f"{mode:<16}{fleet_run.hit_rate:>10.3f}{fleet_run.computed:>17}"
                f"{statistics.median(fleet_run.seconds) * 1e3:>12.3f}{'yes' if not fleet_run.mismatches else 'NO':>11}"
            )
        require(not any(run.mismatches for run in runs.values()), "a gathered K/V differs from what was written")
        isolated = runs["isolated"]
        for mode in modes[1:]:
            print(
                f"{mode} / isolated: hit rate {ratio(runs[mode].hit_rate, max(isolated.hit_rate, 1e-9))}, "
                f"tokens computed {ratio(runs[mode].computed, isolated.computed)}"
            )
        if workload == "chat" and url is not None:
            shared_ok = runs["shared tier"].hit_rate >= 2 * isolated.hit_rate
            routed_ok = runs["tier + router"].computed <= 0.5 * isolated.computed
            print(f"target: shared tier >= 2x the isolated hit rate: {met(shared_ok)}")
            print(f"target: with the router, tokens computed <= 0.5x isolated: {met(routed_ok)}")
            status = 0 if shared_ok and routed_ok else 1
    if url is not None:
        tier_put, tier_get, raw_put, raw_get = throughput(args, url)
        print(
            f"\ntier throughput on {args.records} records: put {tier_put:.1f} MB/s, get {tier_get:.1f} MB/s; "
            f"raw redis-py on the same bytes: put {raw_put:.1f} MB/s, get {raw_get:.1f} MB/s "
            f"(tier / raw: put {ratio(tier_put, raw_put)}, get {ratio(tier_get, raw_get)})"
        )
    return status


if __name__ == "__main__":
    sys.exit(run(main))
