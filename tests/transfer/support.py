"""Support for the transfer tests: pools filled the same way in any process, and a producer
that runs in a process of its own (``python -m tests.transfer.support SPEC_JSON DIRECTORY``).

A support module, not a test file: it holds no tests.

The producer builds a manager from the spec, prefills request ``"r"`` with seeded data,
exports it, writes ``ticket.bin`` and (unless ``"expected": false``) ``expected.npz`` (the
request's blocks in host form, and its gathers where the pool is float32) into the directory, prints ``READY`` and
then answers one command per line of its stdin: ``status`` (a JSON line: leases, used and
cached blocks, whether the audit holds), ``drop`` (deallocate ``"r"``, so only the lease
pins its blocks), ``exit``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, create_manager
from kvcache_core.contract.groups import LayerSpec
from kvcache_core.contract.states import StateSpec

ROOT = Path(__file__).resolve().parents[2]


def _transfer_missing() -> str | None:
    for module in ("zmq", "msgpack"):
        if importlib.util.find_spec(module) is None:
            return f"the transfer tests need {module}: pip install 'kvcache-core[transfer]'"
    from kvcache_core.transfer import nixl_unavailable_reason

    reason = nixl_unavailable_reason()
    return None if reason is None else f"the transfer tests need NIXL (not installed here): {reason}"


#: Skips a transfer test where NIXL (or ZMQ, msgpack) is missing, saying so.
needs_transfer = pytest.mark.skipif(_transfer_missing() is not None, reason=str(_transfer_missing()))


def layer_specs(spec: dict[str, Any]) -> tuple[LayerSpec, ...] | None:
    """``spec["layers"]`` (one dict per layer: ``window``, ``state`` (``[[name, shape,
    dtype], ...]``), ``keeps_kv``, ``num_heads``, ``head_dim``) as layer specs."""
    layers: list[dict[str, Any]] | None = spec.get("layers")
    if layers is None:
        return None
    return tuple(
        LayerSpec(
            window=layer.get("window"),
            state=None if layer.get("state") is None else StateSpec([tuple(item) for item in layer["state"]]),
            keeps_kv=layer.get("keeps_kv"),
            num_heads=layer.get("num_heads"),
            head_dim=layer.get("head_dim"),
        )
        for layer in layers
    )


def make_pool(spec: dict[str, Any]) -> PagedKvCacheManager[Any]:
    """A manager of ``spec``: ``backend``, ``dtype``, ``layout``, ``num_blocks``, the
    geometry ``num_layers``, ``num_heads``, ``head_dim``, ``value_head_dim``, ``block_size``
    and :func:`layer_specs` (with ``state_slots``)."""
    specs = layer_specs(spec)
    config = CacheConfig(
        num_layers=spec.get("num_layers", 2) if specs is None else len(specs),
        num_heads=spec.get("num_heads", 2),
        head_dim=spec.get("head_dim", 8),
        value_head_dim=spec.get("value_head_dim"),
        num_blocks=spec.get("num_blocks", 64),
        block_size=spec.get("block_size", 4),
        dtype=spec.get("dtype", "float32"),
        kv_layout=spec.get("layout"),
        enable_prefix_caching=True,
        model_id=spec.get("model_id", "test-model"),
        layer_specs=specs,
        state_slots=spec.get("state_slots"),
    )
    backend: str = spec.get("backend", "numpy")
    return create_manager(backend, config)


def prompt_of(length: int) -> list[int]:
    """The prompt of the tests: ``length`` token ids."""
    return [(7 * position + 3) % 1000 for position in range(length)]


def prefill(manager: Any, request_id: str, length: int, seed: int = 0) -> Any:
    """Allocate ``request_id`` with :func:`prompt_of` and write seeded Gaussian K/V."""
    prompt = prompt_of(length)
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt))
    slots = manager.extend(handle, length - handle.num_tokens())
    config = manager.config
    rng = np.random.default_rng(seed)
    for layer in range(config.num_layers):
        keys, values = (
            manager.storage.from_numpy(rng.standard_normal((len(slots), config.num_heads, width), dtype=np.float32))
            for width in (config.head_dim, config.value_width)
        )
        manager.write(layer, slots, *(_as_io(manager, array) for array in (keys, values)))
    return handle


def prefill_steps(manager: Any, request_id: str, steps: list[int], seed: int = 0) -> Any:
    """Allocate ``request_id`` (its prompt :func:`prompt_of` all the steps' tokens) and run
    ``steps`` steps of that many tokens, writing seeded Gaussian K/V into every layer keeping
    K/V (its own geometry) and seeded states into every state array; a sliding group
    releases the blocks its window passed, as a model's prefill in chunks does."""
    prompt = prompt_of(sum(steps))
    handle = manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt))
    config = manager.config
    rng = np.random.default_rng(seed)
    storage = manager.storage
    for count in steps:
        step = manager.begin_step([handle], [count])
        for layer in range(config.num_layers):
            spec = config.layer_spec(layer)
            if spec.keeps_kv:
                shape = config.layer_geometry(layer)
                keys, values = (
                    storage.from_numpy(rng.standard_normal((count, shape.num_heads, width), dtype=np.float32))
                    for width in (shape.head_dim, shape.value_width)
                )
                step.write(layer, keys, values)
            for array in () if spec.state is None else spec.state.arrays:
                state = rng.standard_normal((1, *array.shape)).astype(array.dtype)
                step.write_state(layer, array.name, storage.from_numpy(state))
    return handle


def state_bytes(manager: Any, handle: Any) -> list[bytes]:
    """The bytes of the request's state slot, one entry per state array."""
    from kvcache_core.transfer.digests import host_memory

    return [bytes(host_memory(region.address, region.length_bytes)) for region in manager.state_regions(handle)]


def kv_gathers(manager: Any, handle: Any) -> dict[str, np.ndarray[Any, Any]]:
    """Every K/V layer's gathered keys and values (the positions its group holds), by name."""
    out: dict[str, np.ndarray[Any, Any]] = {}
    for layer in range(manager.config.num_layers):
        if manager.config.layer_spec(layer).keeps_kv:
            keys, values = manager.gather(handle, layer)
            out[f"keys{layer}"] = np.asarray(manager.storage.to_numpy(keys))
            out[f"values{layer}"] = np.asarray(manager.storage.to_numpy(values))
    return out


def _as_io(manager: Any, array: Any) -> Any:
    """``array`` (float32) in the pool's compute dtype."""
    io_dtype = manager.config.io_dtype
    if io_dtype == "float32":
        return array
    namespace = manager.storage.array_namespace()
    return namespace.astype(array, getattr(namespace, io_dtype))


def host_blocks(manager: Any, handle: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The request's blocks in core's host form (bit for bit, whatever backend or layout)."""
    table = handle.block_table()
    count = -(-table.sequence_length // table.block_size)
    keys, values = manager.storage.blocks_to_host(np.asarray(table.physical_blocks[:count], dtype=np.int64))
    return np.array(keys), np.array(values)


def gathers(manager: Any, handle: Any) -> list[np.ndarray[Any, Any]]:
    """Every layer's gathered keys and values, as host arrays."""
    storage = manager.storage
    out: list[np.ndarray[Any, Any]] = []
    for layer in range(manager.config.num_layers):
        out.extend(np.asarray(storage.to_numpy(array)) for array in manager.gather(handle, layer))
    return out


def status(manager: Any, agent: Any) -> dict[str, Any]:
    """The figures a test reads from a pool."""
    stats = manager.stats()
    try:
        manager.check_invariants()
        audit = "ok"
    except Exception as exc:  # reported, not raised: the test asserts on it
        audit = repr(exc)
    return {
        "leases": agent.lease_count,
        "used_blocks": stats.used_blocks,
        "cached_blocks": stats.cached_blocks,
        "requests": [rid for rid, _ in manager.list_handles()],
        "audit": audit,
    }


@dataclass
class Producer:
    """A producer process and its files."""

    process: subprocess.Popen[str]
    directory: Path

    @property
    def ticket(self) -> bytes:
        return (self.directory / "ticket.bin").read_bytes()

    def expected(self) -> dict[str, np.ndarray[Any, Any]]:
        with np.load(self.directory / "expected.npz") as data:
            return {name: data[name] for name in data.files}

    def command(self, line: str) -> dict[str, Any]:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None
        assert stdout is not None
        stdin.write(line + "\n")
        stdin.flush()
        answer = _read_line(stdout, self.process)
        parsed: dict[str, Any] = json.loads(answer)
        return parsed


def _read_line(stream: IO[str], process: subprocess.Popen[str]) -> str:
    """The producer's next answer (``READY`` or a JSON line), past any log line."""
    while True:
        line = stream.readline()
        if not line:
            raise AssertionError(f"the producer exited (code {process.wait(timeout=30)}); see its stderr.txt")
        if line.startswith(("READY", "{")):
            return line


@contextmanager
def producer(spec: dict[str, Any], directory: Path) -> Generator[Producer, None, None]:
    """Start a producer of ``spec`` (see the module's docstring); kill it on the way out."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])
    with open(directory / "stderr.txt", "w", encoding="utf-8") as errors:  # NIXL logs there
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.transfer.support", json.dumps(spec), str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
            cwd=ROOT,
        )
    try:
        assert process.stdout is not None
        ready = _read_line(process.stdout, process)
        assert ready.strip() == "READY", ready
        yield Producer(process, directory)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


def wait_for(condition: Any, timeout: float, what: str) -> None:
    """Poll ``condition()`` until it is true or ``timeout`` seconds pass (then fail)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _serve(spec: dict[str, Any], directory: Path) -> None:
    from kvcache_core.transfer import KvTransferAgent

    manager = make_pool(spec)
    if "steps" in spec:
        handle = prefill_steps(manager, "r", spec["steps"], spec.get("seed", 0))
    else:
        handle = prefill(manager, "r", spec.get("tokens", 18), spec.get("seed", 0))
    agent = KvTransferAgent(manager, lease_seconds=spec.get("lease_seconds", 30.0))
    ticket = agent.export(handle)
    if "steps" in spec:
        expected = kv_gathers(manager, handle)
        expected.update(
            {f"state{index}": np.frombuffer(data, np.uint8) for index, data in enumerate(state_bytes(manager, handle))}
        )
        np.savez(directory / "expected.npz", **expected)  # type: ignore[arg-type]
    elif spec.get("expected", True):
        keys, values = host_blocks(manager, handle)
        expected = {"keys": keys, "values": values}
        if manager.config.dtype == "float32":
            expected.update({f"gather{index}": array for index, array in enumerate(gathers(manager, handle))})
        np.savez(directory / "expected.npz", **expected)  # type: ignore[arg-type]
    (directory / "ticket.bin").write_bytes(ticket.to_bytes())
    print("READY", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "status":
            print(json.dumps(status(manager, agent)), flush=True)
        elif command == "drop":
            manager.deallocate("r")
            print(json.dumps({"dropped": True}), flush=True)
        elif command == "exit":
            break
    agent.close()
    manager.close()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]), Path(sys.argv[2]))
