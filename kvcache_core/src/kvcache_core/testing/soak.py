"""The soak run: many threads, one manager, every policy, checked all the way through.

Each worker thread serves its own requests with a random mix of operations: allocate (the
prompts come from a small shared set, so prefix hits cross threads), extend and write,
fork, rewrite through ``writable_slots``, swap out and in, gather and compare, deallocate.
Every position's K/V is a function of its token prefix, so a block one thread caches is
exactly what another thread's hit must read; a rewrite writes fresh K/V that no other
request may ever see. A checker thread runs ``check_invariants`` throughout. At the end
every request is deallocated and nothing may remain in use.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import AllocationRequest
from kvcache_core.errors import OutOfBlocksError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.kv_data import keyed_kv

__all__ = ["SoakReport", "run_soak"]

Manager = PagedKvCacheManager[Any]
FloatArray = npt.NDArray[np.float64]

BLOCK_SIZE = 4
# Prompts sharing prefixes: the last starts like the first for two blocks.
PROMPTS = (*(tuple(range(base, base + 13)) for base in (1, 1000, 2000)), (1, 2, 3, 4, 5, 6, 7, 8, 900, 901))
ALPHABET = (7, 8, 9)
CHECK_EVERY = 16  # worker operations between two invariant checks  # generated tokens: a small alphabet, so generated blocks get hits too


@functools.lru_cache(maxsize=1 << 16)
def _kv(key: tuple[object, ...], heads: int, dim: int, num_layers: int) -> tuple[FloatArray, FloatArray]:
    """``[num_layers, heads, dim]`` keys and values determined by ``key`` (multiples of 1/8)."""
    return keyed_kv(key, (num_layers, heads, dim))


@dataclass
class _Request:
    handle: PagedKvCacheHandle[Any]
    tokens: list[int]
    keys: list[tuple[object, ...]]  # what determines each position's K/V


@dataclass
class SoakReport:
    """The outcome of :func:`run_soak`.

    Attributes:
        operations: operations done, by name (refused ones under ``"<name> refused"``).
        mismatches: reads that did not return what the reading thread wrote (or, for a
            prefix hit, what the prefix's K/V are).
        errors: unexpected exceptions, with the operation.
        invariant_checks: ``check_invariants`` runs of the checker thread.
        leaked_blocks: blocks still in use once every request was deallocated.
        evictions: cached blocks evicted during the run.
    """

    operations: dict[str, int] = field(default_factory=dict[str, int])
    mismatches: list[str] = field(default_factory=list[str])
    errors: list[str] = field(default_factory=list[str])
    invariant_checks: int = 0
    leaked_blocks: int = 0
    evictions: int = 0


class _Worker:
    def __init__(
        self,
        backend: BackendUnderTest,
        manager: Manager,
        index: int,
        operations: int,
        seed: int,
        report: tuple[SoakReport, threading.Lock],
        progress: Callable[[], None],
    ) -> None:
        self.progress = progress  # called after each operation (wakes the checker)
        self.backend = backend
        self.manager = manager
        self.index = index
        self.operations = operations
        self.rng = np.random.default_rng([seed, index])
        self.report = report
        self.requests: dict[str, _Request] = {}
        self.swapped: set[str] = set()
        self.serial = 0
        self.counts: dict[str, int] = {}
        config = manager.config
        self.shape = (config.num_heads, config.head_dim, config.num_layers)

    def count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def new_id(self) -> str:
        self.serial += 1
        return f"t{self.index}-{self.serial}"

    def resident(self) -> list[str]:
        return sorted(rid for rid in self.requests if rid not in self.swapped)

    def pick(self, ids: list[str]) -> str | None:
        return ids[int(self.rng.integers(len(ids)))] if ids else None

    def pick_resident(self) -> _Request | None:
        """A resident request drawn with :meth:`pick`, or ``None`` when none is resident."""
        request_id = self.pick(self.resident())
        return None if request_id is None else self.requests[request_id]

    def run(self) -> None:
        actions = [self.allocate, self.grow, self.grow, self.step, self.truncate, self.verify, self.deallocate]
        if self.backend.claims("fork"):
            actions += [self.fork, self.rewrite]
        if self.backend.claims("swap"):
            actions.append(self.swap)
        for _ in range(self.operations):
            action = actions[int(self.rng.integers(len(actions)))]
            try:
                action()
            except OutOfBlocksError:
                self.count(f"{action.__name__} refused")
            self.progress()
        for request_id in list(self.requests):
            self.manager.deallocate(request_id)
        report, lock = self.report
        with lock:
            for name, number in self.counts.items():
                report.operations[name] = report.operations.get(name, 0) + number

    # -- operations ----------------------------------------------------------------------

    def write(
        self, request: _Request, slots: npt.NDArray[np.int64], start: int, keys: list[tuple[object, ...]]
    ) -> None:
        heads, dim, layers = self.shape
        pairs = [_kv(key, heads, dim, layers) for key in keys]
        for layer in range(layers):
            k = np.stack([pair[0][layer] for pair in pairs])
            v = np.stack([pair[1][layer] for pair in pairs])
            self.manager.write(
                layer, slots, BackendUnderTest.native(self.manager, k), BackendUnderTest.native(self.manager, v)
            )
        del request.keys[start:]
        request.keys.extend(keys)

    def allocate(self) -> None:
        if len(self.requests) >= 3:
            return self.deallocate()
        prompt = PROMPTS[int(self.rng.integers(len(PROMPTS)))]
        request_id = self.new_id()
        handle = self.manager.allocate(AllocationRequest(request_id, prompt_token_ids=prompt, max_sequence_length=40))
        cached = handle.num_cached_tokens()
        request = _Request(handle, list(prompt[:cached]), [("p", *prompt[: p + 1]) for p in range(cached)])
        self.requests[request_id] = request
        self.count("allocate")
        if cached:
            self.count("prefix hit")
        rest = list(prompt[cached:])
        try:
            self.extend(request, rest)
        except OutOfBlocksError:
            self.count("prefill refused")

    def extend(self, request: _Request, tokens: list[int]) -> None:
        start = request.handle.num_tokens()
        slots = self.manager.extend(request.handle, len(tokens), token_ids=tokens)
        request.tokens.extend(tokens)
        self.write(request, slots, start, [("p", *request.tokens[: p + 1]) for p in range(start, start + len(tokens))])

    def grow(self) -> None:
        request = self.pick_resident()
        if request is None:
            return self.allocate()
        length = request.handle.num_tokens()
        count = min(int(self.rng.integers(1, 4)), 40 - length)
        if count <= 0:
            return self.deallocate()
        tokens = [ALPHABET[int(i)] for i in self.rng.integers(len(ALPHABET), size=count)]
        self.extend(request, tokens)
        self.count("extend")

    def step(self) -> None:
        """A planned step over every resident request: one or two new tokens each."""
        ids = self.resident()
        if not ids:
            return self.allocate()
        requests = [self.requests[request_id] for request_id in ids]
        counts = [min(int(self.rng.integers(1, 3)), 40 - r.handle.num_tokens()) for r in requests]
        tokens = [[ALPHABET[int(i)] for i in self.rng.integers(len(ALPHABET), size=max(count, 0))] for count in counts]
        if min(counts) < 0:
            return self.deallocate()
        starts = [r.handle.num_tokens() for r in requests]
        planned = self.manager.begin_step([r.handle for r in requests], counts, token_ids=tokens)
        keys: list[tuple[object, ...]] = []
        for request, start, new in zip(requests, starts, tokens, strict=True):
            request.tokens.extend(new)
            keys.extend(("p", *request.tokens[: p + 1]) for p in range(start, start + len(new)))
        heads, dim, layers = self.shape
        pairs = [_kv(key, heads, dim, layers) for key in keys]
        for layer in range(layers):
            k = np.stack([pair[0][layer] for pair in pairs]) if pairs else np.zeros((0, heads, dim))
            v = np.stack([pair[1][layer] for pair in pairs]) if pairs else np.zeros((0, heads, dim))
            planned.write(layer, BackendUnderTest.native(self.manager, k), BackendUnderTest.native(self.manager, v))
        offset = 0
        for request, start, new in zip(requests, starts, tokens, strict=True):
            del request.keys[start:]
            request.keys.extend(keys[offset : offset + len(new)])
            offset += len(new)
        self.count("step")

    def truncate(self) -> None:
        """A rollback: the request drops its last few tokens (and forgets their ids)."""
        request = self.pick_resident()
        if request is None:
            return
        length = request.handle.num_tokens()
        if not length:
            return
        keep = max(0, length - int(self.rng.integers(1, 4)))
        self.manager.truncate(request.handle, keep)
        del request.tokens[keep:]
        del request.keys[keep:]
        self.count("truncate")

    def fork(self) -> None:
        parent = self.pick_resident()
        if parent is None or len(self.requests) >= 3:
            return
        child_id = self.new_id()
        handle = self.manager.fork(parent.handle, child_id)
        self.requests[child_id] = _Request(handle, list(parent.tokens), list(parent.keys))
        self.count("fork")

    def rewrite(self) -> None:
        request = self.pick_resident()
        if request is None:
            return
        length = request.handle.num_tokens()
        low = request.handle.block_table().first_logical * BLOCK_SIZE
        if length <= low:
            return
        start = int(self.rng.integers(low, length))
        stop = int(self.rng.integers(start + 1, length + 1))
        slots = self.manager.writable_slots(request.handle, start, stop)
        self.serial += 1
        keys: list[tuple[object, ...]] = [
            ("rewrite", request.handle.request_id, position, self.serial) for position in range(start, stop)
        ]
        tail = request.keys[stop:]
        self.write(request, slots, start, keys)
        request.keys.extend(tail)
        self.count("rewrite")

    def swap(self) -> None:
        if self.swapped and self.rng.integers(2):
            swapped_id = sorted(self.swapped)[0]
            self.manager.swap_in(swapped_id)
            self.swapped.discard(swapped_id)
            self.count("swap in")
            return
        resident_id = self.pick(self.resident())
        if resident_id is not None:
            self.manager.swap_out(resident_id)
            self.swapped.add(resident_id)
            self.count("swap out")

    def verify(self) -> None:
        request = self.pick_resident()
        if request is None:
            return
        heads, dim, layers = self.shape
        low = request.handle.block_table().first_logical * BLOCK_SIZE
        for layer in range(layers):
            keys, values = self.manager.gather(request.handle, layer)
            host_keys = BackendUnderTest.host(self.manager, keys)
            host_values = BackendUnderTest.host(self.manager, values)
            for position in range(low, request.handle.num_tokens()):
                expected = _kv(request.keys[position], heads, dim, layers)
                row = position - low
                if not (
                    np.array_equal(host_keys[row], expected[0][layer])
                    and np.array_equal(host_values[row], expected[1][layer])
                ):
                    report, lock = self.report
                    with lock:
                        report.mismatches.append(
                            f"{request.handle.request_id} layer {layer} position {position}: not the K/V of {request.keys[position]}"
                        )
                    return
        self.count("verify")

    def deallocate(self) -> None:
        request_id = self.pick(sorted(self.requests))
        if request_id is None:
            return
        self.manager.deallocate(request_id)
        del self.requests[request_id]
        self.swapped.discard(request_id)
        self.count("deallocate")


def run_soak(backend: BackendUnderTest, *, threads: int = 8, operations: int = 5000, seed: int = 0) -> SoakReport:
    """Run ``threads`` workers of ``operations`` operations each on one manager of
    ``backend`` (prefix caching on where claimed), with a checker thread.

    Returns:
        The report; a clean run has no mismatches, no errors and no leaked blocks.
    """
    # Room for about two thirds of what the workers may hold at once: cached blocks get
    # evicted and some operations are refused for want of blocks.
    fields: dict[str, Any] = {"num_blocks": 20 * threads, "block_size": BLOCK_SIZE}
    if backend.claims("prefix_caching"):
        fields["enable_prefix_caching"] = True
    manager = backend.manager(backend.config(**fields))
    report = SoakReport()
    stop = threading.Event()
    lock = threading.Lock()

    # The checker runs after every CHECK_EVERY operations of the workers, not in a loop of
    # its own: a thread retaking the manager's lock at once would starve the workers.
    advanced = threading.Condition()
    done = [0]

    def progress() -> None:
        with advanced:
            done[0] += 1
            if done[0] % CHECK_EVERY == 0:
                advanced.notify()

    def checker() -> None:
        seen = 0
        while True:
            with advanced:
                while not stop.is_set() and done[0] - seen < CHECK_EVERY:
                    advanced.wait()
                if stop.is_set():
                    return
                seen = done[0]
            try:
                manager.check_invariants()
            except AssertionError as exc:
                with lock:
                    report.errors.append(f"check_invariants: {exc}")
                return
            report.invariant_checks += 1

    def work(index: int) -> None:
        try:
            _Worker(backend, manager, index, operations, seed, (report, lock), progress).run()
        except BaseException as exc:  # reported, not lost in the thread
            with lock:
                report.errors.append(f"worker {index}: {type(exc).__name__}: {exc}")

    checking = threading.Thread(target=checker)
    workers = [threading.Thread(target=work, args=(index,)) for index in range(threads)]
    checking.start()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    with advanced:
        stop.set()
        advanced.notify()
    checking.join()
    manager.check_invariants()
    stats = manager.stats()
    report.leaked_blocks = stats.used_blocks
    report.evictions = stats.eviction_count
    return report
