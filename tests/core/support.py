"""Helpers shared by the core tests: the shared geometry, one ``make_manager``, K/V that is a
function of the prefix (``admit`` / ``assert_holds``), tiered managers and hand-built tables.

A support module, not a test file: it holds no tests, and test files import from it (never
from one another)."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st
from hypothesis import target

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    KvStorage,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    PageTable,
    create_manager,
)
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.offload.events import CachedBlockIndex
from kvcache_core.paging.allocator import Placement
from kvcache_core.plugin import KV_LAYOUTS
from kvcache_core.testing.hybrid import tier_hashes
from kvcache_core.testing.kv_data import pool_hashes

if TYPE_CHECKING:
    from kvcache_core.offload.tiers import OffloadTier

Array = npt.NDArray[Any]
Manager = PagedKvCacheManager[Array]
Handle = PagedKvCacheHandle[Array]

#: The shared geometry: layers, KV heads, head size, tokens per block.
LAYERS, HEADS, DIM, BLOCK = 2, 2, 4, 4

#: The bytes of one block of the shared geometry in float32 (K and V, every layer).
BLOCK_BYTES = 2 * LAYERS * HEADS * DIM * 4 * BLOCK


def make_config(
    num_blocks: int = 64,
    block_size: int = BLOCK,
    *,
    num_layers: int = LAYERS,
    num_heads: int = HEADS,
    head_dim: int = DIM,
    enable_prefix_caching: bool = True,
    **fields: Any,
) -> CacheConfig:
    """A config of ``num_blocks`` blocks of ``block_size`` tokens, by default in the shared
    geometry with prefix caching on; ``fields`` are more ``CacheConfig`` fields."""
    return CacheConfig(
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        **fields,
    )


def make_manager(
    num_blocks: int = 64,
    block_size: int = BLOCK,
    *,
    placement: Placement = "contiguous",
    tiers: Sequence[OffloadTier] = (),
    storage: Callable[[CacheConfig], KvStorage[Array]] | None = None,
    **fields: Any,
) -> Manager:
    """A NumPy manager over ``make_config(num_blocks, block_size, **fields)`` (the shared
    geometry, prefix caching on, no tier by default), the one every core test builds its
    managers with.

    ``storage`` builds the storage from the config (a NumPy storage subclass that records
    calls); by default ``create_manager("numpy", ...)`` builds it."""
    config = make_config(num_blocks, block_size, **fields)
    if storage is not None:
        return PagedKvCacheManager(storage(config), backend="numpy", placement=placement, tiers=tiers)
    return create_manager("numpy", config, placement=placement, tiers=list(tiers))


def token_kv(tokens: Sequence[int], position: int, layer: int) -> tuple[Array, Array]:
    """The K/V a model would compute for ``tokens[position]``: a function of the prefix."""
    digest = hashlib.sha256(repr((tuple(tokens[: position + 1]), layer)).encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    pair = rng.standard_normal((2, HEADS, DIM)).astype(np.float32)
    return pair[0], pair[1]


def compute(manager: Manager, handle: Handle, tokens: Sequence[int], count: int) -> None:
    """Extend by ``count`` tokens of ``tokens`` (from the current length) and write their
    K/V into every layer, as a prefill would."""
    start = handle.num_tokens()
    slots = manager.extend(handle, count)
    for layer in range(LAYERS):
        pairs = [token_kv(tokens, position, layer) for position in range(start, start + count)]
        keys = np.stack([pair[0] for pair in pairs]) if pairs else np.zeros((0, HEADS, DIM), np.float32)
        values = np.stack([pair[1] for pair in pairs]) if pairs else np.zeros((0, HEADS, DIM), np.float32)
        manager.write(layer, slots, keys, values)


def admit(manager: Manager, request_id: str, prompt: Sequence[int], **fields: Any) -> Handle:
    """Allocate with the prompt and compute what the cache did not supply."""
    handle = manager.allocate(
        AllocationRequest(request_id, initial_tokens=len(prompt), prompt_token_ids=tuple(prompt), **fields)
    )
    compute(manager, handle, prompt, len(prompt) - handle.num_tokens())
    return handle


def admit_and_release(manager: Manager, prompts: Sequence[Sequence[int]]) -> None:
    """Admit each prompt as request ``r<index>`` and release it at once: its full blocks stay
    cached, the oldest first in line for eviction."""
    for index, prompt in enumerate(prompts):
        admit(manager, f"r{index}", prompt)
        manager.deallocate(f"r{index}")


def assert_holds(manager: Manager, handle: Handle, tokens: Sequence[int]) -> None:
    """Every layer of ``handle`` holds the K/V of ``tokens`` (up to its length)."""
    for layer in range(LAYERS):
        keys, values = manager.gather(handle, layer)
        assert keys.shape[0] == handle.num_tokens()
        for position in range(handle.num_tokens()):
            expected_keys, expected_values = token_kv(tokens, position, layer)
            assert np.array_equal(keys[position], expected_keys), (handle.request_id, layer, position)
            assert np.array_equal(values[position], expected_values), (handle.request_id, layer, position)


def tiered(num_blocks: int, *tiers: OffloadTier, **overrides: Any) -> Manager:
    """A prefix-caching manager of ``num_blocks`` blocks over ``tiers``, in the shared geometry."""
    return make_manager(num_blocks, tiers=tiers, **overrides)


def prompt_of(seed: int, blocks: int) -> list[int]:
    """``blocks`` full blocks and one token, distinct for each ``seed``."""
    return [seed * 1000 + position for position in range(blocks * BLOCK + 1)]


def counting(manager: Manager) -> list[str]:
    """Record the manager's host transfers (``to_host n`` / ``from_host n``) from now on."""
    storage = manager.storage
    calls: list[str] = []
    to_host, from_host = storage.blocks_to_host, storage.blocks_from_host

    def counting_to_host(blocks: Any) -> Any:
        calls.append(f"to_host {len(blocks)}")
        return to_host(blocks)

    def counting_from_host(blocks: Any, keys: Any, values: Any) -> None:
        calls.append(f"from_host {len(blocks)}")
        from_host(blocks, keys, values)

    setattr(storage, "blocks_to_host", counting_to_host)  # noqa: B010 -- patch this instance only
    setattr(storage, "blocks_from_host", counting_from_host)  # noqa: B010
    return calls


@dataclass(frozen=True)
class Workload:
    """Runs a script of operations on a manager with a host and a disk tier, checking after
    each one the invariants, the requests' K/V and that the replayed events name exactly what
    each medium holds.

    ``admission(step, operation)`` turns an ``("admit", ...)`` operation into a prompt and
    the admit's keyword arguments; ``admit`` and ``holds`` admit a request and check its K/V;
    with ``strict`` a tier that fails (a warning) fails the run."""

    admission: Callable[[int, tuple[object, ...]], tuple[list[int], dict[str, Any]]]
    admit: Callable[..., Any]
    holds: Callable[[Any, Any, list[int]], None]
    label: str
    strict: bool = False

    def run(
        self, manager: Any, host: OffloadTier, disk: OffloadTier, directory: Path, script: list[tuple[object, ...]]
    ) -> None:
        index = CachedBlockIndex()
        manager.subscribe(index)
        live: list[str] = []
        for step, operation in enumerate(script):
            if operation[0] == "admit":
                prompt, options = self.admission(step, operation)
                while len(live) > 1:  # a small pool under steady pressure: the oldest request ends
                    manager.deallocate(live.pop(0))
                try:
                    with warnings.catch_warnings():
                        if self.strict:
                            warnings.simplefilter("error")  # no tier may fail in this workload
                        handle = self.admit(manager, f"r{step}", prompt, **options)
                except MemoryError:
                    continue
                self.holds(manager, handle, prompt)
                live.append(f"r{step}")
            elif operation[0] == "release" and live:
                assert isinstance(operation[1], int)
                manager.deallocate(live.pop(operation[1] % len(live)))
            elif operation[0] == "gc":
                manager.gc()
            manager.check_invariants()
            assert index.hashes("pool") == pool_hashes(manager)
            assert index.hashes("host") == tier_hashes(host)
            assert index.hashes("disk") == tier_hashes(disk)
            assert host.used_bytes <= host.max_bytes
            assert disk.used_bytes <= disk.max_bytes
        target(float(sum(tier.hits for tier in manager.tier_stats())), label=self.label)  # seek promotions
        manager.close()
        assert index.media() == []
        assert list(directory.iterdir()) == []


def bfloat16_bits(values: Array) -> tuple[Array, Array]:
    """``values`` rounded down to bfloat16: ``(uint16 bits, the float64 values they hold)``."""
    bits = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def pool_of(values: Array, dtype: str) -> tuple[Array, Array]:
    """A pool of ``dtype`` holding ``values``: ``(what the kernel reads, float64 values)``."""
    if dtype == "bfloat16":
        return bfloat16_bits(values)
    if dtype == "float16":
        half = values.astype(np.float16)
        return half.view(np.uint16), half.astype(np.float64)
    single = values.astype(np.float32)
    return single, single.astype(np.float64)


def hand_built_table(
    order: list[int], lengths: list[int], block_size: int, window: int | None
) -> tuple[PageTable, int]:
    """Requests of ``lengths`` tokens whose blocks are taken from ``order`` in turn
    (any physical order: any number of runs); returns the table and the blocks used."""
    indices: list[int] = []
    indptr = [0]
    rows: list[list[int]] = []
    for length in lengths:
        count = -(-length // block_size)
        blocks = order[len(indices) : len(indices) + count]
        indices.extend(blocks)
        indptr.append(len(indices))
        rows.append(blocks)
    padded = np.zeros((len(lengths), max(len(row) for row in rows)), dtype=np.int32)
    for index, row in enumerate(rows):
        padded[index, : len(row)] = row
    last = [length - (-(-length // block_size) - 1) * block_size for length in lengths]
    table = PageTable(
        np.asarray(indptr), np.asarray(indices), np.asarray(last), padded, np.asarray(lengths), block_size,
        sliding_window=window,
    )  # fmt: skip
    return table, len(indices)


class RandomPool(NamedTuple):
    """A pool of random K/V in hand-built blocks: its table, what the kernel reads
    (``keys``, ``values``) and the float64 values they hold."""

    table: PageTable
    keys: Array
    values: Array
    keys64: Array
    values64: Array


def random_pool(
    data: st.DataObject,
    lengths: list[int],
    block_size: int,
    heads: int,
    dim: int,
    layout: str,
    dtype: str,
    window: int | None,
    rng: np.random.Generator,
) -> RandomPool:
    """Blocks for requests of ``lengths`` tokens (and up to 4 spare blocks) in a drawn
    physical order, holding random K/V of ``dtype`` in ``layout`` drawn from ``rng``."""
    needed = sum(-(-length // block_size) for length in lengths)
    num_blocks = needed + data.draw(st.integers(0, 4), label="spare")
    order = data.draw(st.permutations(range(num_blocks)), label="order")
    table, _ = hand_built_table(list(order), lengths, block_size, window)
    shape = {"NHD": (num_blocks, block_size, heads, dim), "HND": (num_blocks, heads, block_size, dim)}.get(
        layout, (heads, num_blocks, block_size, dim)
    )
    keys, keys64 = pool_of(rng.standard_normal(shape), dtype)
    values, values64 = pool_of(rng.standard_normal(shape), dtype)
    return RandomPool(table, keys, values, keys64, values64)


class KernelBatch(NamedTuple):
    """A drawn batch for the compiled kernel: its geometry, queries and masking."""

    block_size: int
    lengths: list[int]
    query_counts: list[int]
    heads: int
    group: int
    dim: int
    layout: str
    dtype: str
    causal: bool
    window: int | None


def draw_kernel_batch(data: st.DataObject, *, max_requests: int, head_dims: Sequence[int]) -> KernelBatch:
    """Up to ``max_requests`` ragged requests (decode, prefill or chunked queries), KV heads
    and their query group, a head dim of ``head_dims``, a layout, a kernel dtype, causal or
    not and an optional window."""
    block_size = data.draw(st.sampled_from([1, 3, 4, 16]), label="block_size")
    lengths = data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=max_requests), label="lengths")
    query_counts = [data.draw(st.integers(0, min(length, 9)), label="queries") for length in lengths]
    heads = data.draw(st.integers(1, 3), label="kv_heads")
    group = data.draw(st.integers(1, 4), label="group")
    dim = data.draw(st.sampled_from(list(head_dims)), label="head_dim")
    layout = data.draw(st.sampled_from(KV_LAYOUTS), label="layout")
    dtype = data.draw(st.sampled_from(paged_kernel.KERNEL_DTYPES), label="dtype")
    causal = data.draw(st.booleans(), label="causal")
    window = data.draw(st.none() | st.integers(1, 40), label="window")
    return KernelBatch(block_size, lengths, query_counts, heads, group, dim, layout, dtype, causal, window)


class KernelRun(NamedTuple):
    """How a drawn kernel call runs: threads, the split thresholds and the data's seed."""

    threads: int
    min_split: int
    row_split: int
    seed: int


def draw_kernel_run(data: st.DataObject) -> KernelRun:
    """1 to 4 threads, the KV and row split thresholds (4 and 5 make splits happen), a seed."""
    threads = data.draw(st.integers(1, 4), label="threads")
    min_split = data.draw(st.sampled_from([4, 512]), label="min_split_keys")
    row_split = data.draw(st.sampled_from([5, 64]), label="row_split")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    return KernelRun(threads, min_split, row_split, seed)
