"""What the manager adds per layer on top of the storage, for a batched decode step.

One process, interleaved rounds (the order rotating), medians. Per layer of a decode step of 16 requests on the
NumPy backend, three ways, timed over an attention kernel that does nothing (what remains is
the caller's overhead, free of the kernel's noise; the three are first checked to agree with
the real kernel):

* **bare**: the storage's own ``write`` and ``paged_attention`` (no checks at all);
* **step**: ``Step.write`` + ``Step.attention`` of a step planned once by ``begin_step``;
* **raw**: ``manager.write`` + ``manager.paged_attention``, which check slots, ownership
  and the page table on every call.

It prints the overhead of each over bare, in microseconds per layer, and their ratio.
The step and the raw calls must return what the bare calls return (exit 1 otherwise).

Then the planning a step costs once for all layers, per request, at batch sizes 16, 64 and
256 (``--batches``): ``begin_step(handles, 1)`` and the last step's ``advance()`` against what
they replace, ``extend`` of each request and the batch's ``page_table`` (the three must give
the same slots and table).

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
        .venv/bin/python benchmarks/step_overhead.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from _harness import BenchParser, int_list, print_environment, require, run, take_turns

from kvcache_core import AllocationRequest, CacheConfig, PagedKvCacheManager, PageTable, Step
from kvcache_core.backends.numpy import NumpyStorage

Manager = PagedKvCacheManager[npt.NDArray[Any]]


class NullKernelStorage(NumpyStorage):
    """The NumPy storage with an attention kernel that does nothing: what remains of a
    call's time is the caller's overhead, free of the kernel's noise."""

    def paged_attention(self, layer: int, query: npt.NDArray[Any], *args: Any, **kwargs: Any) -> npt.NDArray[Any]:
        return query


def main(argv: list[str] | None = None) -> int:
    """Print the per-layer overheads and the planning costs; ``DisagreementError`` if the three
    ways or the two plannings disagree."""
    parser = BenchParser(__doc__, quick="5 rounds of 20 calls")
    parser.flag("--requests", 16, help="requests in the decode batch")
    parser.flag("--context", 64, help="tokens each request holds")
    parser.flag("--rounds", (30, 5), help="interleaved samples per way")
    parser.flag("--calls", (200, 20), help="calls per sample")
    parser.flag("--batches", [16, 64, 256], type=int_list, help="batch sizes of the planning costs")
    args = parser.parse(argv)
    print_environment()

    config = CacheConfig(
        num_layers=2, num_heads=2, head_dim=16, num_blocks=args.requests * (args.context // 16 + 2), block_size=16
    )
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((args.requests, config.num_heads, config.head_dim)).astype(np.float32)
    values = rng.standard_normal(keys.shape).astype(np.float32)
    query = rng.standard_normal((args.requests, 4 * config.num_heads, config.head_dim)).astype(np.float32)
    scale = 1.0 / float(np.sqrt(config.head_dim))

    def decode_step(storage: NumpyStorage) -> tuple[Manager, Step[npt.NDArray[Any]]]:
        """A manager over ``storage`` holding the batch's context, and its planned decode step."""
        manager = PagedKvCacheManager(storage, backend="numpy")
        handles = [manager.allocate(AllocationRequest(f"r{index}")) for index in range(args.requests)]
        prefill = manager.begin_step(handles, args.context - 1)
        context = np.random.default_rng(1).standard_normal((prefill.num_new_tokens, config.num_heads, config.head_dim))
        for layer in range(config.num_layers):
            prefill.write(layer, context.astype(np.float32), -context.astype(np.float32))
        return manager, manager.begin_step(handles, 1)

    # The three ways compute the same thing (checked with the real kernel) ...
    real = NumpyStorage(config)
    manager, step = decode_step(real)
    step.write(0, keys, values)
    reference = real.paged_attention(0, query, step.page_table, step.qo_indptr, scale, True)
    for name, got in (
        ("step", step.attention(0, query)),
        ("raw", manager.paged_attention(0, query, step.page_table, qo_indptr=step.qo_indptr)),
    ):
        require(np.array_equal(got, reference), f"{name}: attention differs from the bare storage call")
    # ... and are timed over a kernel that does nothing, so that only their overhead remains.
    storage = NullKernelStorage(config)
    manager, step = decode_step(storage)
    slots, table, indptr = step.slots, step.page_table, step.qo_indptr

    def bare_write() -> None:
        storage.write(0, slots, keys, values)

    def bare_attention() -> object:
        return storage.paged_attention(0, query, table, indptr, scale, True)

    def step_write() -> None:
        step.write(0, keys, values)

    def step_attention() -> object:
        return step.attention(0, query)

    def raw_write() -> None:
        manager.write(0, slots, keys, values)

    def raw_attention() -> object:
        return manager.paged_attention(0, query, table, qo_indptr=indptr)

    times = take_turns(
        {
            "bare write": bare_write,
            "step write": step_write,
            "raw write": raw_write,
            "bare attention": bare_attention,
            "step attention": step_attention,
            "raw attention": raw_attention,
        },
        rounds=args.rounds,
        calls=args.calls,
    )
    print(
        f"decode step of {args.requests} requests x {args.context} tokens, NumPy backend, per layer "
        "(medians, us; the attention kernel replaced by a no-op)"
    )
    print(f"  {'':<6}{'write':>10}{'attention':>12}{'overhead over bare':>22}")
    for name in ("bare", "step", "raw"):
        overhead = sum(times.us(f"{name} {call}") - times.us(f"bare {call}") for call in ("write", "attention"))
        spread = times.spread(f"{name} write", f"{name} attention")
        print(
            f"  {name:<6}{times.us(f'{name} write'):>10.1f}{times.us(f'{name} attention'):>12.1f}"
            f"{'' if name == 'bare' else f'{overhead:>19.1f} us'}   (spread up to {spread:.0%})"
        )
    write_step = times.us("step write") - times.us("bare write")
    write_raw = times.us("raw write") - times.us("bare write")
    print(
        f"  write checks: step {write_step:.1f} us, raw {write_raw:.1f} us ({write_raw / max(write_step, 1e-3):.1f}x)"
    )
    plan_costs(args.batches, args.context, args.rounds, max(2, args.calls // 20))
    return 0


def plan_costs(batches: list[int], context: int, rounds: int, calls: int) -> None:
    """Print what planning a decode step costs per request: ``begin_step``, the last step's
    ``advance`` and ``extend`` of each request plus ``page_table``, on managers of equal state
    (ragged lengths: each step, a sixteenth of the requests open a block).

    Raises:
        DisagreementError: the three give different slots or tables.
    """
    print(
        f"planning a decode step (requests of {context} to {context + 15} tokens: at each step some open a block; "
        "one new token each), per request, medians:"
    )
    print(f"  {'batch':>7}{'begin_step':>14}{'advance':>12}{'extend + page_table':>23}{'ratio':>9}")
    for batch in batches:
        config = CacheConfig(num_layers=2, num_heads=2, head_dim=16, num_blocks=batch * (context // 16 + 64))
        managers = [PagedKvCacheManager(NumpyStorage(config), backend="numpy") for _ in range(3)]
        handles = [[manager.allocate(AllocationRequest(f"r{index}")) for index in range(batch)] for manager in managers]
        for manager, batch_handles in zip(managers, handles, strict=True):
            manager.begin_step(batch_handles, [context + index % 16 for index in range(batch)])
        step = managers[0].begin_step(handles[0], 1)
        slots = np.concatenate([managers[1].extend(handle, 1) for handle in handles[1]])
        table = managers[1].page_table(handles[1])
        require(_same_plan(step, slots, table), "begin_step and extend + page_table disagree")
        last = [managers[2].begin_step(handles[2], 1).advance()]
        step = managers[0].begin_step(handles[0], 1)
        require(_same_plan(step, last[0].slots, last[0].page_table), "begin_step and advance disagree")

        def planned(manager: Manager = managers[0], group: list[Any] = handles[0]) -> None:
            manager.begin_step(group, 1)

        def advanced(steps: list[Step[npt.NDArray[Any]]] = last) -> None:
            steps[0] = steps[0].advance()

        def one_by_one(manager: Manager = managers[1], group: list[Any] = handles[1]) -> None:
            for handle in group:
                manager.extend(handle, 1)
            manager.page_table(group)

        ways: dict[str, Callable[[], None]] = {"planned": planned, "advanced": advanced, "one by one": one_by_one}
        times = take_turns(ways, rounds=rounds, calls=calls)
        step_us, advance_us = times.us("planned") / batch, times.us("advanced") / batch
        extend_us = times.us("one by one") / batch
        print(f"  {batch:>7}{step_us:>11.1f} us{advance_us:>9.1f} us{extend_us:>20.1f} us{extend_us / step_us:>8.2f}x")


def _same_plan(step: Step[npt.NDArray[Any]], slots: npt.NDArray[np.int64], table: PageTable) -> bool:
    """Whether ``step`` planned ``slots`` and ``table``."""
    return np.array_equal(step.slots, slots) and all(
        np.array_equal(getattr(step.page_table, name), getattr(table, name))
        for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "seq_lens")
    )


if __name__ == "__main__":
    sys.exit(run(main))
