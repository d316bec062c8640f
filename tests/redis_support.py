"""Support for the tests of the Redis tier: a real ``redis-server`` on 127.0.0.1 (a free port,
no persistence) per test session and worker, servers a test may kill or pause, and a worker
that serves one prompt in a process of its own (the fleet tests).

The fixtures skip, saying so, where no ``redis-server`` binary or no redis-py is found.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.offload.redis_tier import RedisTier

#: Seconds a server gets to start answering.
START_TIMEOUT_S = 20.0


def redis_binary() -> str:
    """The ``redis-server`` binary (``$KVCACHE_REDIS_SERVER`` or on ``PATH``); skips the test
    when there is none, or when redis-py is missing."""
    pytest.importorskip("redis", reason="the Redis tier's tests need redis-py (the [redis] extra)")
    pytest.importorskip("safetensors", reason="the Redis tier's records need safetensors")
    binary = os.environ.get("KVCACHE_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        pytest.skip("no redis-server binary on PATH (apt-get install redis-server): the Redis tier is not tested")
    return binary


def free_port() -> int:
    """A TCP port of 127.0.0.1 no socket uses now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class RedisServer:
    """A ``redis-server`` process on 127.0.0.1 without persistence, that a test may kill,
    restart (same port, empty) and pause."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, attempts: int = 1) -> None:
        """Start it and wait (polling, with a deadline) until it answers ``PING``; with
        ``attempts`` > 1, a port another process took meanwhile is replaced by a new one."""
        for attempt in range(attempts):
            try:
                self._start_once()
                return
            except RuntimeError:
                if attempt + 1 == attempts:
                    raise
                self.port = free_port()

    def _start_once(self) -> None:
        import redis
        from redis.exceptions import RedisError

        self.process = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory), "--protected-mode", "no", "--maxmemory-policy", "allkeys-lru",
                "--loglevel", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client: Any = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                try:
                    if client.ping():
                        return
                except RedisError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.kill()
                        raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                    time.sleep(0.01)  # polling for the server to answer, within the deadline
        finally:
            client.close()

    def kill(self) -> None:
        """Kill it at once (SIGKILL): everything it held is gone."""
        if self.process is not None:
            self.resume()
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """Stop it answering (SIGSTOP): a server past every deadline."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def client(self) -> Any:
        """A plain redis-py client of it."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server per test session (per xdist worker: each its own port); tests keep apart
    by their own key prefix (:func:`unique_prefix`). Never kill it: use ``own_redis_server``."""
    server = RedisServer(redis_binary(), tmp_path_factory.mktemp("redis"))
    server.start(attempts=5)
    yield server
    server.kill()


@pytest.fixture
def own_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server for one test, which it may kill, restart or pause."""
    server = RedisServer(redis_binary(), tmp_path)
    server.start(attempts=5)
    yield server
    server.kill()


def unique_prefix() -> str:
    """A key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"


def fast_tier(url: str, max_bytes: int = 1 << 24, **options: Any) -> RedisTier:
    """A tier for tests: its own prefix, a deadline of a second (a loaded test machine is
    not a slow server), a short breaker."""
    settings: dict[str, Any] = {"prefix": unique_prefix(), "deadline_s": 1.0, "retry_after_s": 0.05}
    settings.update(options)
    return RedisTier(url, max_bytes, **settings)


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passed; whether it held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)  # polling with a deadline, not waiting for a guess
    return True


# -- a fleet member in a process of its own ----------------------------------------------------

BLOCK_SIZE = 4


def fleet_config(model_id: str = "fleet-test") -> CacheConfig:
    """The pool every fleet test member runs (prefix caching, small blocks)."""
    return CacheConfig(
        num_layers=2, num_heads=2, head_dim=8, num_blocks=32, block_size=BLOCK_SIZE,
        enable_prefix_caching=True, model_id=model_id,
    )  # fmt: skip


def token_kv(
    prompt: tuple[int, ...], position: int, layer: int, heads: int = 2, width: int = 8
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The K/V a model would compute for ``prompt[position]`` (it depends on the whole prefix),
    the same in every process: ``([heads, width], [heads, width])`` float32."""
    seed = hash_prefix(prompt[: position + 1]) + layer
    generator = np.random.default_rng(seed)
    keys = generator.standard_normal((heads, width)).astype(np.float32)
    values = generator.standard_normal((heads, width)).astype(np.float32)
    return keys, values


def hash_prefix(tokens: tuple[int, ...]) -> int:
    """A number of ``tokens``, the same in every process (Python's ``hash`` is salted)."""
    value = 1469598103934665603
    for token in tokens:
        value = ((value ^ token) * 1099511628211) % (1 << 63)
    return value


def serve_prompt(url: str, prefix: str, prompt: list[int], salt: str | None, model_id: str) -> dict[str, Any]:
    """Serve ``prompt`` once on a fresh manager behind a :class:`RedisTier` (a new process of
    the fleet): map what the tier holds, compute the rest, check the mapped K/V bit for bit,
    then demote everything to the tier and wait until it is written. Returns the figures."""
    config = fleet_config(model_id)
    tier = RedisTier(url, 1 << 24, prefix=prefix, deadline_s=2.0)
    tokens = tuple(prompt)
    with create_manager("numpy", config, tiers=[tier]) as manager:
        handle = manager.allocate(AllocationRequest("r", 0, prompt_token_ids=tokens, cache_salt=salt))
        cached = handle.num_cached_tokens()
        exact = True
        for layer in range(config.num_layers):
            keys, values = manager.gather(handle, layer)
            for position in range(cached):
                want_keys, want_values = token_kv(tokens, position, layer)
                exact &= bool(
                    np.array_equal(keys[position], want_keys) and np.array_equal(values[position], want_values)
                )
        computed = len(tokens) - cached
        slots = manager.extend(handle, computed, token_ids=list(tokens[cached:]))
        for layer in range(config.num_layers):
            pairs = [token_kv(tokens, position, layer) for position in range(cached, len(tokens))]
            manager.write(layer, slots, np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]))
        manager.deallocate("r")
        manager.gc()  # every cached block goes to the tier
        flushed = tier.flush(10.0)
        stats = tier.stats()
    tier.close()
    return {"cached": cached, "computed": computed, "exact": exact, "flushed": flushed, "written": stats.written}


def run_member(
    url: str, prefix: str, prompt: list[int], salt: str | None = None, model_id: str = "fleet-test"
) -> dict[str, Any]:
    """:func:`serve_prompt` in a process of its own; its figures."""
    code = (
        "import json, sys; from tests.redis_support import serve_prompt; "
        "print(json.dumps(serve_prompt(*json.loads(sys.argv[1]))))"
    )
    root = Path(__file__).resolve().parents[1]
    arguments = json.dumps([url, prefix, prompt, salt, model_id])
    done = subprocess.run(
        [sys.executable, "-c", code, arguments], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"the fleet member failed:\n{done.stdout}\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def serve_once(manager: Any, request_id: str, prompt: tuple[int, ...], salt: str | None = None) -> int:
    """Allocate ``prompt``, compute what was not cached, release it; the tokens it mapped."""
    config = manager.config
    heads, width = config.num_heads, config.head_dim
    handle = manager.allocate(AllocationRequest(request_id, 0, prompt_token_ids=prompt, cache_salt=salt))
    cached = int(handle.num_cached_tokens())
    slots = manager.extend(handle, len(prompt) - cached, token_ids=list(prompt[cached:]))
    for layer in range(config.num_layers):
        pairs = [token_kv(prompt, position, layer, heads, width) for position in range(cached, len(prompt))]
        manager.write(layer, slots, np.stack([pair[0] for pair in pairs]), np.stack([pair[1] for pair in pairs]))
    manager.deallocate(request_id)
    return cached
