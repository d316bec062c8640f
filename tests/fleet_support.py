"""Support for the router's tests: a fleet member (a manager publishing its cache events on
fixed ports) in a process of its own, driven line by line over its standard input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.redis_support import free_port

ROOT = Path(__file__).resolve().parents[1]


def member_main(port: int, replay_port: int, block_size: int, model_id: str) -> None:
    """Run a member: a NumPy manager whose events go to a publisher on ``port`` (replays on
    ``replay_port``); each line of standard input is a JSON prompt to serve (its blocks stay
    cached), answered by the publisher's next sequence number; an empty line ends it."""
    from kvcache_core import CacheConfig, create_manager
    from kvcache_core.offload.publisher import ZmqEventPublisher
    from tests.redis_support import serve_once

    config = CacheConfig(
        num_layers=1, num_heads=1, head_dim=4, num_blocks=256, block_size=block_size,
        enable_prefix_caching=True, model_id=model_id,
    )  # fmt: skip
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    with ZmqEventPublisher(endpoint, replay_endpoint=replay) as publisher, create_manager("numpy", config) as manager:
        manager.subscribe(publisher)
        print("ready", flush=True)
        for count, line in enumerate(sys.stdin):
            if not line.strip():
                break
            serve_once(manager, f"r{count}", tuple(json.loads(line)))
            print(publisher.next_sequence, flush=True)


class Member:
    """A member process on two fixed free ports; :meth:`restart` starts a new one on them."""

    def __init__(self, block_size: int = 4, model_id: str = "router-test") -> None:
        self.port, self.replay_port = free_port(), free_port()
        self.block_size = block_size
        self.model_id = model_id
        self.process: subprocess.Popen[str] | None = None
        self.spawn()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def spawn(self) -> None:
        """Start the process (:meth:`wait_ready` waits until it serves)."""
        code = "import sys; from tests.fleet_support import member_main; member_main(*map(int, sys.argv[1:4]), sys.argv[4])"
        arguments = [str(self.port), str(self.replay_port), str(self.block_size), self.model_id]
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, *arguments], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def wait_ready(self) -> None:
        assert self.process is not None
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            raise AssertionError(f"the member did not start: {line!r}")

    def serve(self, prompt: list[int]) -> int:
        """Serve ``prompt``; the publisher's next sequence number once its events are out."""
        assert self.process is not None
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps(prompt) + "\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.spawn()
        self.wait_ready()


def members(count: int, **options: Any) -> list[Member]:
    """``count`` members, started side by side."""
    started = [Member(**options) for _ in range(count)]
    for member in started:
        member.wait_ready()
    return started
