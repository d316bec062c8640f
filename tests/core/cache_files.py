"""Support for the cache-file tests: small pools holding cached prefixes, their files read
and rewritten at will, and calls run with a bound so that a hang fails instead of blocking."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcache_core import AllocationRequest, CacheConfig
from kvcache_core.offload.prefix_file import cached_records, write_blocks
from kvcache_core.offload.tiers import OffloadTier
from kvcache_core.testing import inspect
from tests.core.support import BLOCK, DIM, HEADS, LAYERS, Array, Manager, make_config, make_manager

#: Four full blocks and one token.
PROMPT = tuple(range(500, 517))


def config(**overrides: Any) -> CacheConfig:
    """A small float32 pool of 32 blocks of 4 tokens, with prefix caching."""
    return make_config(32, **overrides)


def pool(*tiers: OffloadTier, num_blocks: int = 32, **overrides: Any) -> Manager:
    """A NumPy manager of :func:`config` with ``tiers``."""
    return make_manager(num_blocks, tiers=tiers, **overrides)


def admit(manager: Manager, request_id: str, prompt: Sequence[int]) -> int:
    """Allocate with ``prompt`` and write K/V (a function of the prompt) for the tokens the
    cache did not supply; return how many it supplied."""
    handle = manager.allocate(AllocationRequest(request_id, initial_tokens=len(prompt), prompt_token_ids=tuple(prompt)))
    cached = handle.num_tokens()
    slots = manager.extend(handle, len(prompt) - cached)
    rng = np.random.default_rng(sum(prompt))
    for layer in range(LAYERS):
        keys, values = rng.standard_normal((2, len(slots), HEADS, DIM)).astype(np.float32)
        manager.write(layer, slots, keys, values)
    return handle.num_cached_tokens()


def saved(directory: Path, prompt: Sequence[int] = PROMPT, name: str = "prefix.safetensors") -> Path:
    """A prefix-cache file of a pool that computed ``prompt``."""
    manager = pool()
    admit(manager, "r", prompt)
    path = directory / name
    manager.save_prefix_cache(path)
    return path


def read_file(path: Path) -> tuple[dict[str, Any], Array, Array]:
    """``(kvcache header, keys, values)`` of a prefix-cache file."""
    from safetensors.numpy import load

    data = path.read_bytes()
    table = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    header: dict[str, Any] = json.loads(table["__metadata__"]["kvcache"])
    tensors = load(data)
    return header, tensors["keys"], tensors["values"]


def write_file(path: Path, header: dict[str, Any] | str, keys: Array, values: Array) -> None:
    """A safetensors file of ``keys`` and ``values`` whose kvcache header is ``header``
    (a ``str`` is written as it is: any text, JSON or not)."""
    from safetensors.numpy import save

    text = header if isinstance(header, str) else json.dumps(header)
    path.write_bytes(save({"keys": keys, "values": values}, metadata={"kvcache": text}))


def snapshot(manager: Manager) -> tuple[object, ...]:
    """What a refused load must leave as it was: the block counts and the cached hashes."""
    stats = manager.stats()
    prefix = inspect.prefix_cache(manager)
    hashes = sorted(entry.block_hash for entry in prefix.entries()) if prefix is not None else []
    return stats.free_blocks, stats.cached_blocks, stats.used_blocks, hashes


def bounded(call: Callable[[], object], seconds: float = 10.0) -> BaseException | None:
    """Run ``call`` in a daemon thread; return what it raised (``None`` if nothing).

    Raises:
        AssertionError: it did not return within ``seconds`` (it hangs).
    """
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call!r} still runs after {seconds} s"
    return raised[0] if raised else None


@contextlib.contextmanager
def fifo_at(path: Path) -> Generator[Path, None, None]:
    """A FIFO at ``path``; on leaving, a reader still blocked on it is let go (it reads an
    end of file), so a regression fails its test without hanging the run."""
    os.mkfifo(path)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):  # ENXIO: nobody reads it, as it should be
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def write_repeatedly(path: str, blocks: int, times: int) -> None:
    """Write a file of ``blocks`` cached blocks to ``path``, ``times`` times (what a child
    process of the concurrent-save tests runs)."""
    source = pool()
    admit(source, "r", [blocks * 100 + token for token in range(blocks * BLOCK + 1)])
    records = cached_records(inspect.block_pool(source))
    for _ in range(times):
        write_blocks(path, config(), records)
