"""The kit's quantized-pool cases: every quantized dtype a backend claims in
``BackendSpec.dtypes`` (``"int8"``, ``"float8_e4m3fn"``), on every layout it claims.

The tolerance contract (:data:`QUANTIZED_TOLERANCES`): quantized values are not
bit-exact against what was written, so for standard Gaussian K/V the relative Frobenius
error ``||got - expected|| / ||expected||`` of ``gather`` (against the values written) and
of paged attention (against the float64 reference over the values written) must stay
within the dtype's bound. What *is* bit-exact: the raw bytes and scales of a block
(``blocks_to_host``, :func:`kvcache_core.contract.quantization.unpack_host`) through
``copy_blocks``, fork with copy-on-write, swap out/in and a prefix-cache hit. Bad input
(NaN or an infinity, K/V of another dtype than the compute dtype) is refused and changes
nothing; a quantized dtype the backend does not claim is refused at ``create_manager``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.attention.reference import paged_attention as reference_attention
from kvcache_core.contract.config import QUANTIZED_DTYPES, AllocationRequest, CacheConfig
from kvcache_core.contract.protocols import KvCacheHandle
from kvcache_core.discovery import create_manager
from kvcache_core.errors import DTypeMismatchError, InvalidArgumentError, UnsupportedConfigError
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.testing.backend import BackendUnderTest

__all__ = ["QUANTIZED_TOLERANCES", "QuantizedCases"]

Manager = PagedKvCacheManager[Any]
FloatArray = npt.NDArray[np.float64]

#: Relative Frobenius error allowed for standard Gaussian K/V: of ``gather`` against the
#: values written, and of attention against the float64 reference over them.
QUANTIZED_TOLERANCES: Final[dict[str, float]] = {"int8": 0.01, "float8_e4m3fn": 0.05}

#: The geometry of the quantized cases: 32 features per head, so per-head scales see a
#: realistic spread of values.
_GEOMETRY: Final[dict[str, Any]] = {"head_dim": 32, "num_blocks": 24, "block_size": 4}


def _relative_error(got: FloatArray, expected: FloatArray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def _configs(backend: BackendUnderTest, **fields: Any) -> list[CacheConfig]:
    """A config per claimed quantized dtype x layout; skips when none is claimed."""
    if not backend.quantized_dtypes:
        pytest.skip(f"backend {backend.name!r} claims no quantized dtype ({', '.join(QUANTIZED_DTYPES)})")
    return [
        backend.config(dtype=dtype, kv_layout=layout, **{**_GEOMETRY, **fields})
        for dtype in backend.quantized_dtypes
        for layout in backend.kv_layouts
    ]


def _native(manager: Manager, array: npt.NDArray[Any]) -> Any:
    return BackendUnderTest.native(manager, array, manager.config.io_dtype)


def _write(manager: Manager, layer: int, slots: npt.NDArray[np.int64], rng: np.random.Generator) -> tuple[Any, Any]:
    """Write Gaussian K/V (representable in the compute dtype); return them as float64."""
    config = manager.config
    shape = (len(slots), config.num_heads, config.head_dim)
    keys = BackendUnderTest.representable(rng.standard_normal(shape), config.io_dtype)
    values = BackendUnderTest.representable(rng.standard_normal(shape), config.io_dtype)
    manager.write(layer, slots, _native(manager, keys), _native(manager, values))
    return keys, values


def _host_blocks(manager: Manager, blocks: list[int]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Raw bytes + scales of ``blocks`` (the storage's host form), as NumPy copies."""
    keys, values = manager.storage.blocks_to_host(np.asarray(blocks, dtype=np.int64))
    return np.array(keys, copy=True), np.array(values, copy=True)


def _assert_same_bytes(got: tuple[Any, Any], expected: tuple[Any, Any], context: str) -> None:
    for name, after, before in zip(("keys", "values"), got, expected, strict=True):
        assert after.dtype == before.dtype, f"{context}: {name} host dtype changed"
        assert after.shape == before.shape, f"{context}: {name} host shape changed"
        assert after.tobytes() == before.tobytes(), f"{context}: {name} raw bytes or scales differ"


def _written_blocks(handle: KvCacheHandle[Any]) -> list[int]:
    table = handle.block_table()
    used = -(-table.sequence_length // table.block_size)
    return list(table.physical_blocks[:used])


def _state(manager: Manager) -> tuple[object, ...]:
    """Everything a refused call must leave as it was: figures, tables and every block's
    raw bytes and scales."""
    everything = _host_blocks(manager, list(range(manager.config.num_blocks)))
    tables = [(rid, handle.block_table().to_dict()) for rid, handle in manager.list_handles()]
    return (dataclasses.asdict(manager.stats()), tables, everything[0].tobytes(), everything[1].tobytes())


class QuantizedCases:
    """Quantized-pool cases every backend runs (through
    :class:`~kvcache_core.testing.KvCacheConformance`); skipped where no quantized dtype is
    claimed."""

    def test_quantized_gather_and_attention_meet_the_tolerance_contract(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        for config in _configs(kvcache_backend):
            context = f"dtype {config.dtype}, layout {config.kv_layout}"
            manager = kvcache_backend.manager(config)
            rng = np.random.default_rng(14)
            handles = [manager.allocate(AllocationRequest(f"r{i}")) for i in range(3)]
            slots = np.concatenate([manager.extend(h, n) for h, n in zip(handles, (5, 17, 30), strict=True)])
            keys, values = _write(manager, 1, slots, rng)
            tolerance = QUANTIZED_TOLERANCES[config.dtype]
            first = 0
            for handle in handles:
                count = handle.num_tokens()
                got_keys, got_values = manager.gather(handle, 1)
                assert manager.storage.array_info(got_keys)[1] == config.io_dtype, f"{context}: gather dtype"
                for got, wrote in ((got_keys, keys), (got_values, values)):
                    error = _relative_error(BackendUnderTest.host(manager, got), wrote[first : first + count])
                    assert error <= tolerance, f"{context}: gather error {error:.4f} > {tolerance}"
                first += count
            table = manager.page_table(handles)
            query = BackendUnderTest.representable(
                rng.standard_normal((len(handles), 2 * config.num_heads, config.head_dim)), config.io_dtype
            )
            output = manager.paged_attention(1, _native(manager, query), table)
            assert manager.storage.array_info(output)[1] == config.io_dtype, f"{context}: output dtype"
            expected = self._reference(config, query, keys, values, table)
            error = _relative_error(BackendUnderTest.host(manager, output), expected)
            assert error <= tolerance, f"{context}: attention error {error:.4f} > {tolerance}"

    @staticmethod
    def _reference(config: CacheConfig, query: FloatArray, keys: FloatArray, values: FloatArray, table: Any) -> Any:
        """Float64 attention over the values written, through an unquantized NHD pool."""
        pool_shape = (config.num_blocks * config.block_size, config.num_heads, config.head_dim)
        key_pool, value_pool = np.zeros(pool_shape), np.zeros(pool_shape)
        lengths = [int(n) for n in table.seq_lens]
        token_slots = np.concatenate(
            [
                (
                    np.asarray(table.block_tables[b, : -(-n // config.block_size)])[:, None] * config.block_size
                    + np.arange(config.block_size)
                ).ravel()[:n]
                for b, n in enumerate(lengths)
            ]
        )
        key_pool[token_slots], value_pool[token_slots] = keys, values
        shape = (config.num_blocks, config.block_size, config.num_heads, config.head_dim)
        return reference_attention(query, key_pool.reshape(shape), value_pool.reshape(shape), table)

    def test_quantized_blocks_round_trip_bit_exact_through_copy_fork_swap_and_prefix_hits(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        for config in _configs(kvcache_backend, enable_prefix_caching=kvcache_backend.claims("prefix_caching")):
            context = f"dtype {config.dtype}, layout {config.kv_layout}"
            manager = kvcache_backend.manager(config)
            rng = np.random.default_rng(7)
            prompt = tuple(range(100, 110))  # two full blocks of 4 and a partial one
            parent = manager.allocate(AllocationRequest("parent", prompt_token_ids=prompt))
            slots = manager.extend(parent, len(prompt), token_ids=prompt)
            for layer in range(config.num_layers):
                _write(manager, layer, slots, rng)
            blocks = _written_blocks(parent)
            before = _host_blocks(manager, blocks)

            # copy_blocks: the storage itself.
            free = [b for b in range(config.num_blocks) if b not in blocks][: len(blocks)]
            manager.storage.copy_blocks(np.asarray(blocks, dtype=np.int64), np.asarray(free, dtype=np.int64))
            _assert_same_bytes(_host_blocks(manager, free), before, f"{context}: copy_blocks")

            if kvcache_backend.claims("fork"):
                child = manager.fork(parent, "child")
                manager.extend(child, 1)  # copies the shared partial last block (copy-on-write)
                child_blocks = _written_blocks(child)
                assert child_blocks[-1] != blocks[-1], f"{context}: copy-on-write kept the shared block"
                copied = _host_blocks(manager, [child_blocks[-1]])
                _assert_same_bytes(
                    copied, (before[0][:, -1:], before[1][:, -1:]), f"{context}: copy-on-write of a block"
                )
                manager.deallocate("child")

            if kvcache_backend.claims("swap"):
                gathered = [BackendUnderTest.host(manager, a) for a in manager.gather(parent, 0)]
                manager.swap_out("parent")
                manager.swap_in("parent")
                _assert_same_bytes(_host_blocks(manager, _written_blocks(parent)), before, f"{context}: swap")
                again = [BackendUnderTest.host(manager, a) for a in manager.gather(parent, 0)]
                for got, expected in zip(again, gathered, strict=True):
                    assert np.array_equal(got, expected), f"{context}: gather after swap differs"

            if config.enable_prefix_caching:
                full = 2 * config.block_size
                kept = _host_blocks(manager, _written_blocks(parent)[:2])
                manager.deallocate("parent")
                hit = manager.allocate(AllocationRequest("hit", prompt_token_ids=prompt))
                mapped = list(hit.block_table().physical_blocks[:2])
                assert hit.num_tokens() == full, f"{context}: the prefix cache served {hit.num_tokens()} tokens"
                _assert_same_bytes(_host_blocks(manager, mapped), kept, f"{context}: prefix hit")

    def test_non_finite_kv_is_refused_and_changes_nothing(self, kvcache_backend: BackendUnderTest) -> None:
        for config in _configs(kvcache_backend):
            manager = kvcache_backend.manager(config)
            handle = manager.allocate(AllocationRequest("a"))
            _write(manager, 0, manager.extend(handle, 6), np.random.default_rng(3))
            slots = manager.extend(handle, 3)
            shape = (3, config.num_heads, config.head_dim)
            for bad in (np.nan, np.inf, -np.inf):
                for which in ("keys", "values"):
                    good = np.ones(shape)
                    poisoned = np.ones(shape)
                    poisoned[1, config.num_heads - 1, 2] = bad
                    pair = (poisoned, good) if which == "keys" else (good, poisoned)
                    before = _state(manager)
                    with pytest.raises(InvalidArgumentError, match=rf"{which}\[1, {config.num_heads - 1}, 2\]"):
                        manager.write(0, slots, _native(manager, pair[0]), _native(manager, pair[1]))
                    assert _state(manager) == before, f"dtype {config.dtype}: a refused {bad} write changed state"

    def test_values_too_small_for_a_normal_scale_read_back_as_zero(self, kvcache_backend: BackendUnderTest) -> None:
        """A token head whose scale would be subnormal in float32 (values under ~1e-36)
        holds zeros, on every backend alike: never NaN (``0 * (1 / subnormal)``)."""
        for config in _configs(kvcache_backend):
            with kvcache_backend.manager(config) as manager:
                handle = manager.allocate(AllocationRequest("a"))
                shape = (2, config.num_heads, config.head_dim)
                tiny = np.zeros(shape)
                tiny[:, :, 0] = [[1e-39], [1e-40]]
                manager.write(0, manager.extend(handle, 2), _native(manager, tiny), _native(manager, tiny))
                for gathered in manager.gather(handle, 0):
                    host = BackendUnderTest.host(manager, gathered)
                    np.testing.assert_array_equal(host, np.zeros(shape), err_msg=f"dtype {config.dtype}")

    def test_kv_of_another_dtype_than_the_compute_dtype_is_refused(self, kvcache_backend: BackendUnderTest) -> None:
        for config in _configs(kvcache_backend):
            manager = kvcache_backend.manager(config)
            handle = manager.allocate(AllocationRequest("a"))
            slots = manager.extend(handle, 2)
            shape = (2, config.num_heads, config.head_dim)
            other = "float16" if config.io_dtype != "float16" else "float32"
            before = _state(manager)
            wrong = BackendUnderTest.native(manager, np.ones(shape), other)
            right = _native(manager, np.ones(shape))
            with pytest.raises(DTypeMismatchError, match=config.io_dtype):
                manager.write(0, slots, wrong, right)
            with pytest.raises(DTypeMismatchError, match=config.io_dtype):
                manager.write(0, slots, right, wrong)
            assert _state(manager) == before

    def test_an_unclaimed_quantized_dtype_is_refused_with_the_claimed_list(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        unclaimed = [dtype for dtype in QUANTIZED_DTYPES if dtype not in kvcache_backend.dtypes]
        if not unclaimed:
            pytest.skip(f"backend {kvcache_backend.name!r} claims every quantized dtype")
        for dtype in unclaimed:
            config = kvcache_backend.config(dtype=dtype)
            with pytest.raises(UnsupportedConfigError) as caught:
                create_manager(kvcache_backend.name, config)
            for claimed in kvcache_backend.dtypes:
                assert claimed in str(caught.value), f"{dtype}: the refusal does not list {claimed!r}"
