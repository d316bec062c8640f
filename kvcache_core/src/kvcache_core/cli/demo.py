"""``kvcache demo``: the main job in miniature.

A small transformer with random weights, written once against the Array API standard
(the backend's storage supplies the namespace, so the same code runs on NumPy, torch or
JAX arrays), serves several concurrent requests of different lengths through the paged
cache: requests arrive over time, prefill and decode share batches, every layer writes
the whole batch's K/V in one call and reads it back with paged attention. At the end the
demo recomputes every request without a cache and checks that the logits agree.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.protocols import KvCacheHandle
from kvcache_core.discovery import create_manager
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.step import Step

__all__ = ["DemoOptions", "DemoReport", "TinyTransformer", "run_demo"]

#: ``attend(layer, q [n, Hq, D], k [n, H, D], v [n, H, D]) -> [n, Hq, D]``
AttendFn = Callable[[int, Any, Any, Any], Any]


@dataclass(frozen=True)
class DemoOptions:
    """Size of the demo: the model, the pool and the workload."""

    vocab_size: int = 96
    hidden_size: int = 64
    num_layers: int = 2
    num_query_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_size: int = 128
    max_context: int = 256
    num_requests: int = 8
    num_blocks: int = 64
    block_size: int = 8
    dtype: str = "float32"
    seed: int = 0
    tolerance: float = 1e-4


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int
    generated: list[int] = field(default_factory=list[int])
    logits: list[npt.NDArray[np.float64]] = field(default_factory=list[npt.NDArray[np.float64]])
    handle: PagedKvCacheHandle[Any] | None = None


@dataclass(frozen=True)
class DemoReport:
    """What the demo measured and checked."""

    backend: str
    requests: int
    steps: int
    tokens_generated: int
    peak_concurrency: int
    peak_blocks_used: int
    total_blocks: int
    peak_utilization: float
    peak_paged_bytes: int
    max_length_reservation_bytes: int
    max_logit_difference: float
    mismatched_requests: tuple[str, ...]
    leaked_blocks: int
    seconds: float

    @property
    def ok(self) -> bool:
        """Every request matched the recomputation and no block leaked."""
        return not self.mismatched_requests and self.leaked_blocks == 0


class TinyTransformer:
    """A pre-norm decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)
    with random weights, written against the Array API namespace ``xp``.

    Attention is a callback, so the same weights run with the paged cache or without.
    """

    def __init__(self, options: DemoOptions, xp: Any, to_native: Callable[[npt.NDArray[Any]], Any]) -> None:
        self.options = options
        self.xp = xp
        rng = np.random.default_rng(options.seed)
        hidden, heads, kv_heads, dim = (
            options.hidden_size,
            options.num_query_heads,
            options.num_kv_heads,
            options.head_dim,
        )

        def weight(rows: int, cols: int, gain: float = 1.0) -> Any:
            return to_native((rng.standard_normal((rows, cols)) * gain / math.sqrt(rows)).astype(options.dtype))

        self.embedding = weight(options.vocab_size, hidden, math.sqrt(options.vocab_size))
        self.layers = [
            {
                "wq": weight(hidden, heads * dim),
                "wk": weight(hidden, kv_heads * dim),
                "wv": weight(hidden, kv_heads * dim),
                "wo": weight(heads * dim, hidden),
                "w_gate": weight(hidden, options.ffn_size),
                "w_up": weight(hidden, options.ffn_size),
                "w_down": weight(options.ffn_size, hidden),
            }
            for _ in range(options.num_layers)
        ]
        self.lm_head = weight(hidden, options.vocab_size, 4.0)
        self.to_native = to_native
        half = dim // 2
        self.inv_freq = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) / half))

    def _norm(self, x: Any) -> Any:
        xp = self.xp
        return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        xp = self.xp
        half = self.options.head_dim // 2
        first, second = x[..., :half], x[..., half:]
        return xp.concat([first * cos - second * sin, second * cos + first * sin], axis=-1)

    def forward(self, token_ids: npt.NDArray[np.int64], positions: npt.NDArray[np.int64], attend: AttendFn) -> Any:
        """Logits ``[n, vocab]`` of ``n`` packed tokens at the given positions."""
        xp, o = self.xp, self.options
        n = int(token_ids.shape[0])
        angles = positions[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = self.to_native(np.cos(angles)[:, None, :].astype(o.dtype))
        sin = self.to_native(np.sin(angles)[:, None, :].astype(o.dtype))
        x = xp.take(self.embedding, self.to_native(token_ids), axis=0)
        for layer, w in enumerate(self.layers):
            h = self._norm(x)
            q = self._rope(xp.reshape(h @ w["wq"], (n, o.num_query_heads, o.head_dim)), cos, sin)
            k = self._rope(xp.reshape(h @ w["wk"], (n, o.num_kv_heads, o.head_dim)), cos, sin)
            v = xp.reshape(h @ w["wv"], (n, o.num_kv_heads, o.head_dim))
            attended = attend(layer, q, k, v)
            x = x + xp.reshape(attended, (n, o.num_query_heads * o.head_dim)) @ w["wo"]
            h = self._norm(x)
            gate = h @ w["w_gate"]
            x = x + (gate / (1.0 + xp.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
        return self._norm(x) @ self.lm_head

    def dense_attend(self, layer: int, q: Any, k: Any, v: Any) -> Any:
        """Causal attention of one whole sequence on its own K/V: the no-cache reference."""
        del layer
        xp, o = self.xp, self.options
        n, group = int(q.shape[0]), o.num_query_heads // o.num_kv_heads
        qh = xp.permute_dims(xp.reshape(q, (n, o.num_kv_heads, group, o.head_dim)), (1, 2, 0, 3))
        kh = xp.expand_dims(xp.permute_dims(k, (1, 2, 0)), axis=1)  # [H, 1, D, n]
        vh = xp.expand_dims(xp.permute_dims(v, (1, 0, 2)), axis=1)  # [H, 1, n, D]
        scores = (qh @ kh) * (1.0 / math.sqrt(o.head_dim))
        future = self.to_native(np.triu(np.ones((n, n), dtype=np.bool_), k=1))
        scores = xp.where(future, -xp.inf, scores)
        weights = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
        out = xp.permute_dims(weights @ vh, (2, 0, 1, 3))  # [n, H, G, D]
        return xp.reshape(out, (n, o.num_query_heads, o.head_dim))


def _make_requests(options: DemoOptions) -> list[_Request]:
    rng = np.random.default_rng(options.seed + 1)
    requests: list[_Request] = []
    for index in range(options.num_requests):
        prompt_length = int(rng.integers(6, 48))
        requests.append(
            _Request(
                request_id=f"req-{index}",
                prompt=[int(t) for t in rng.integers(0, options.vocab_size, prompt_length)],
                max_new_tokens=int(rng.integers(8, 40)),
                arrival_step=0 if index < options.num_requests // 2 else int(rng.integers(1, 24)),
            )
        )
    return requests


class _Progress:
    """One status line, redrawn in place on a terminal, printed every tenth otherwise."""

    def __init__(self, stream: TextIO, total_tokens: int) -> None:
        self.stream = stream
        self.total = max(total_tokens, 1)
        self.interactive = stream.isatty()
        self.next_report = 0.0

    def update(self, step: int, done_tokens: int, active: int, used_blocks: int, total_blocks: int) -> None:
        fraction = done_tokens / self.total
        width = 24
        bar = "#" * int(fraction * width) + "." * (width - int(fraction * width))
        line = (
            f"  [{bar}] {done_tokens:4d}/{self.total} tokens  step {step:3d}  "
            f"active {active}  blocks {used_blocks}/{total_blocks}"
        )
        if self.interactive:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif fraction >= self.next_report or done_tokens == self.total:
            self.stream.write(line + "\n")
            self.next_report = fraction + 0.1

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")


def _paged_attend(step: Step[Any]) -> AttendFn:
    """Attention through the cache: write the step's K/V, then read the pool in place."""

    def attend(layer: int, q: Any, k: Any, v: Any) -> Any:
        step.write(layer, k, v)
        return step.attention(layer, q)

    return attend


def _serve(
    manager: PagedKvCacheManager[Any], model: TinyTransformer, requests: list[_Request], stream: TextIO
) -> tuple[int, int, int, float]:
    """Serve every request to completion. Returns (steps, peak concurrency, peak blocks,
    utilization at that peak)."""
    storage = manager.storage
    block_size = manager.config.block_size
    waiting = sorted(requests, key=lambda r: r.arrival_step)
    running: list[_Request] = []
    progress = _Progress(stream, sum(r.max_new_tokens for r in requests))
    generated = step = peak_concurrency = peak_blocks = 0
    peak_utilization = 0.0

    def blocks_for(tokens: int) -> int:
        return -(-tokens // block_size)

    while waiting or running:
        # Admit arrived requests while the pool can hold every admitted request at full length.
        reserved = sum(
            blocks_for(len(r.prompt) + r.max_new_tokens) - (r.handle.block_table().num_blocks() if r.handle else 0)
            for r in running
        )
        admitted: list[_Request] = []
        for request in list(waiting):
            full = blocks_for(len(request.prompt) + request.max_new_tokens)
            if request.arrival_step > step or manager.stats().free_blocks - reserved < full:
                continue
            request.handle = manager.allocate(
                AllocationRequest(
                    request.request_id,
                    initial_tokens=len(request.prompt),
                    max_sequence_length=len(request.prompt) + request.max_new_tokens,
                    prompt_token_ids=tuple(request.prompt),
                )
            )
            reserved += full - request.handle.block_table().num_blocks()
            waiting.remove(request)
            admitted.append(request)
        batch = running + admitted
        if not batch:
            step += 1
            continue
        # One forward pass over the whole batch, planned once: new requests prefill, others decode.
        token_ids: list[int] = []
        positions: list[int] = []
        new_token_ids: list[list[int]] = []
        handles: list[KvCacheHandle[Any]] = []
        for request in batch:
            assert request.handle is not None
            new_tokens = request.prompt if request in admitted else request.generated[-1:]
            start = request.handle.num_tokens()
            handles.append(request.handle)
            new_token_ids.append(list(new_tokens))
            token_ids.extend(new_tokens)
            positions.extend(range(start, start + len(new_tokens)))
        step_plan = manager.begin_step(handles, [len(ids) for ids in new_token_ids], token_ids=new_token_ids)
        qo_indptr = step_plan.qo_indptr
        logits = storage.to_numpy(
            model.forward(
                np.asarray(token_ids, dtype=np.int64), np.asarray(positions, dtype=np.int64), _paged_attend(step_plan)
            )
        )
        stats = manager.stats()
        if stats.used_blocks > peak_blocks:
            peak_blocks, peak_utilization = stats.used_blocks, stats.utilization
        peak_concurrency = max(peak_concurrency, len(batch))
        running = []
        for index, request in enumerate(batch):
            row = logits[int(qo_indptr[index + 1]) - 1].astype(np.float64)
            request.logits.append(row)
            request.generated.append(int(np.argmax(row)))
            generated += 1
            if len(request.generated) == request.max_new_tokens:
                manager.deallocate(request.request_id)
            else:
                running.append(request)
        step += 1
        progress.update(step, generated, len(running), manager.stats().used_blocks, manager.config.num_blocks)
    progress.close()
    return step, peak_concurrency, peak_blocks, peak_utilization


def _check(
    model: TinyTransformer, to_numpy: Callable[[Any], npt.NDArray[Any]], request: _Request
) -> tuple[float, bool]:
    """Recompute a finished request without any cache; compare logits and tokens."""
    tokens = request.prompt + request.generated[:-1]
    logits = to_numpy(
        model.forward(np.asarray(tokens, dtype=np.int64), np.arange(len(tokens), dtype=np.int64), model.dense_attend)
    ).astype(np.float64)
    reference = logits[len(request.prompt) - 1 :]
    served = np.stack(request.logits)
    difference = float(np.max(np.abs(reference - served)))
    same_tokens = np.array_equal(np.argmax(reference, axis=-1), np.asarray(request.generated))
    return difference, same_tokens and difference <= model.options.tolerance


def run_demo(backend: str = "numpy", options: DemoOptions | None = None, stream: TextIO | None = None) -> DemoReport:
    """Serve a random workload on ``backend``, print progress and a summary, check it.

    Raises:
        BackendNotFoundError, BackendUnavailableError, UnsupportedConfigError: from
            :func:`~kvcache_core.create_manager`.
    """
    options = options or DemoOptions()
    out = stream or sys.stdout
    config = CacheConfig(
        num_layers=options.num_layers,
        num_heads=options.num_kv_heads,
        head_dim=options.head_dim,
        num_blocks=options.num_blocks,
        block_size=options.block_size,
        dtype=options.dtype,
    )
    manager = create_manager(backend, config)
    storage = manager.storage
    model = TinyTransformer(options, storage.array_namespace(), storage.from_numpy)
    requests = _make_requests(options)
    out.write(
        f"kvcache demo: backend {backend!r}, {options.num_layers}-layer transformer "
        f"({options.num_query_heads} query heads, {options.num_kv_heads} KV heads of {options.head_dim}, "
        f"random weights, seed {options.seed})\n"
        f"  pool: {config.num_blocks} blocks x {config.block_size} tokens, {config.dtype}, "
        f"{_kib(config.num_blocks * config.bytes_per_block)}\n"
        f"  workload: {len(requests)} requests, prompts of {min(len(r.prompt) for r in requests)}-"
        f"{max(len(r.prompt) for r in requests)} tokens, {min(r.max_new_tokens for r in requests)}-"
        f"{max(r.max_new_tokens for r in requests)} new tokens each, arriving over time\n"
    )
    started = time.perf_counter()
    steps, concurrency, peak_blocks, peak_utilization = _serve(manager, model, requests, out)
    seconds = time.perf_counter() - started
    differences: list[float] = []
    mismatched: list[str] = []
    for request in requests:
        difference, ok = _check(model, storage.to_numpy, request)
        differences.append(difference)
        if not ok:
            mismatched.append(request.request_id)
    final = manager.stats()
    report = DemoReport(
        backend=backend,
        requests=len(requests),
        steps=steps,
        tokens_generated=sum(len(r.generated) for r in requests),
        peak_concurrency=concurrency,
        peak_blocks_used=peak_blocks,
        total_blocks=config.num_blocks,
        peak_utilization=peak_utilization,
        peak_paged_bytes=peak_blocks * config.bytes_per_block,
        max_length_reservation_bytes=concurrency * options.max_context * config.bytes_per_token,
        max_logit_difference=max(differences),
        mismatched_requests=tuple(mismatched),
        leaked_blocks=final.used_blocks,
        seconds=seconds,
    )
    _print_summary(report, options, out)
    return report


def _kib(size: int) -> str:
    return f"{size / 1024:.1f} KiB"


def _print_summary(report: DemoReport, options: DemoOptions, out: TextIO) -> None:
    saved = report.peak_paged_bytes / report.max_length_reservation_bytes
    rows = [
        (
            "tokens generated",
            f"{report.tokens_generated} in {report.steps} steps ({report.seconds:.2f} s), "
            f"up to {report.peak_concurrency} requests at once",
        ),
        (
            "blocks used (peak)",
            f"{report.peak_blocks_used} of {report.total_blocks}, "
            f"utilization {report.peak_utilization:.1%} at the peak",
        ),
        (
            "KV memory (peak)",
            f"{_kib(report.peak_paged_bytes)} paged vs {_kib(report.max_length_reservation_bytes)} "
            f"for a max-length reservation ({report.peak_concurrency} x {options.max_context} tokens): {saved:.0%}",
        ),
        (
            "blocks after the run",
            f"{report.leaked_blocks} in use (all returned)"
            if not report.leaked_blocks
            else f"{report.leaked_blocks} still in use: LEAK",
        ),
    ]
    if report.mismatched_requests:
        verdict = (
            f"FAILED: {', '.join(report.mismatched_requests)} differ from a recomputation without "
            f"cache (max |logit difference| {report.max_logit_difference:.2e} > {options.tolerance:g})"
        )
    else:
        verdict = (
            f"all {report.requests} requests match a recomputation without cache "
            f"(max |logit difference| {report.max_logit_difference:.2e})"
        )
    rows.append(("check", verdict))
    out.write("summary\n")
    for label, value in rows:
        out.write(f"  {label:<22}{value}\n")
