"""The kit's cases for pools whose values differ in width from their keys
(``CacheConfig.value_head_dim``: multi-head latent attention caches a latent and a rotary
part of different widths; some models' ``v_head_dim``), run on every backend that claims
the ``"value_head_dim"`` capability.

What they hold the backend to: the pool's shapes and sizes (``value_cache`` is
``value_block_shape()``, ``gather`` gives values ``value_width`` wide, ``stats()`` counts
the bytes of both widths); the lockstep state machine against the NumPy reference with
every policy the backend claims (fork, prefix caching, swap, eviction), narrower and wider
values; attention, with every feature it serves, against the float64 dense reference in
every dtype and layout (its output is ``value_width`` wide); the host form of both widths,
bit-exact across backends and through a prefix-cache file (which a pool of other widths
refuses by name); quantized pools within their tolerance, bit-exact through swap and fork.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pytest

from kvcache_core.contract.config import AllocationRequest, CacheConfig
from kvcache_core.contract.device import Device
from kvcache_core.discovery import create_manager
from kvcache_core.errors import IncompatibleCacheFileError
from kvcache_core.handle import PagedKvCacheHandle
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload import host_form
from kvcache_core.testing.backend import TOLERANCES, BackendUnderTest
from kvcache_core.testing.features import dense_feature_attention
from kvcache_core.testing.quantized import QUANTIZED_TOLERANCES

__all__ = ["VALUE_WIDTHS", "ValueWidthCases"]

Manager = PagedKvCacheManager[Any]
Handle = PagedKvCacheHandle[Any]
FloatArray = npt.NDArray[np.float64]

#: Value widths beside the kit's keys of 8 features: narrower (an MLA rotary part) and wider.
VALUE_WIDTHS: Final = (4, 12)

#: Request lengths of the attention cases: ragged, over several blocks and runs.
_LENGTHS: Final = (5, 17, 30)

#: The features each attention case turns on, where the backend serves them.
_FEATURE_SETS: Final[tuple[tuple[str, ...], ...]] = ((), ("window", "softcap", "sinks"), ("chunk", "softcap", "sinks"))
_FEATURE_CAPABILITY: Final = {
    "window": "attention_window",
    "softcap": "softcap",
    "sinks": "sinks",
    "chunk": "chunked_attention",
}


def _write(
    manager: Manager, layer: int, slots: npt.NDArray[np.int64], rng: np.random.Generator
) -> tuple[FloatArray, FloatArray]:
    """Write Gaussian keys and values of the pool's two widths (representable in its compute
    dtype) into ``slots`` of ``layer``; return them as float64."""
    config = manager.config
    dtype = config.io_dtype
    keys = BackendUnderTest.representable(rng.standard_normal((len(slots), config.num_heads, config.head_dim)), dtype)
    values = BackendUnderTest.representable(
        rng.standard_normal((len(slots), config.num_heads, config.value_width)), dtype
    )
    manager.write(
        layer, slots, BackendUnderTest.native(manager, keys, dtype), BackendUnderTest.native(manager, values, dtype)
    )
    return keys, values


def _grow(manager: Manager, lengths: tuple[int, ...], rng: np.random.Generator) -> list[Handle]:
    """Requests of ``lengths`` tokens grown side by side, 3 tokens at a time (so their blocks
    form several runs), every layer written."""
    handles = [manager.allocate(AllocationRequest(f"wide-{index}")) for index in range(len(lengths))]
    done = [0] * len(lengths)
    while done != list(lengths):
        for index, handle in enumerate(handles):
            step = min(3, lengths[index] - done[index])
            if step:
                slots = manager.extend(handle, step)
                for layer in range(manager.config.num_layers):
                    _write(manager, layer, slots, rng)
                done[index] += step
    return handles


def _host(manager: Manager, blocks: list[int]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    keys, values = manager.storage.blocks_to_host(np.asarray(blocks, dtype=np.int64))
    return np.array(keys, copy=True), np.array(values, copy=True)


def _held_blocks(handle: Handle) -> list[int]:
    table = handle.block_table()
    return list(table.physical_blocks[: -(-table.sequence_length // table.block_size)])


def _on_numpy(config: CacheConfig) -> CacheConfig | None:
    """``config`` on the NumPy reference (CPU, its preferred layout), or ``None`` where NumPy
    does not hold the dtype (bfloat16)."""
    from kvcache_core.backends.numpy import NUMPY_DTYPES

    if config.dtype not in NUMPY_DTYPES:
        return None
    return dataclasses.replace(config, device=Device(), kv_layout=None)


class ValueWidthCases:
    """Cases for values of another width than the keys, on every backend claiming
    ``"value_head_dim"`` (through :class:`~kvcache_core.testing.KvCacheConformance`)."""

    @pytest.mark.kvcache_requires("value_head_dim")
    def test_value_width_pools_are_shaped_and_sized_by_both_widths(self, kvcache_backend: BackendUnderTest) -> None:
        for index, plain in enumerate(kvcache_backend.configs()):
            width = _width(index)
            config = dataclasses.replace(plain, value_head_dim=width)
            context = f"value_head_dim {width}, dtype {config.dtype}, layout {config.kv_layout}"
            with kvcache_backend.manager(config) as manager:
                storage, resolved = manager.storage, manager.config
                assert storage.array_info(storage.key_cache(0))[0] == resolved.block_shape(), context
                assert storage.array_info(storage.value_cache(0))[0] == resolved.value_block_shape(), context
                handle = manager.allocate(AllocationRequest("r"))
                _write(manager, 1, manager.extend(handle, 6), np.random.default_rng(3))
                keys, values = manager.gather(handle, 1)
                assert storage.array_info(keys)[0] == (6, resolved.num_heads, resolved.head_dim), context
                assert storage.array_info(values)[0] == (6, resolved.num_heads, width), context
                assert handle.head_dim() == resolved.head_dim, context
                assert handle.value_head_dim() == width, context
                per_token = resolved.num_layers * resolved.num_heads * (resolved.head_dim + width)
                assert resolved.bytes_per_token == per_token * resolved.dtype_size, context
                assert handle.stats().memory_bytes == 2 * resolved.bytes_per_block, context
                host_keys, host_values = _host(manager, _held_blocks(handle))
                assert host_keys.shape == host_form.host_shape(resolved, 2), context
                assert host_values.shape == host_form.host_shape(resolved, 2, "values"), context

    @pytest.mark.kvcache_requires("value_head_dim")
    def test_state_machine_with_narrower_and_wider_values(
        self, kvcache_backend: BackendUnderTest, request: pytest.FixtureRequest
    ) -> None:
        from kvcache_core.testing._plugin import kit_settings
        from kvcache_core.testing.machine import run_config_machine

        caching = kvcache_backend.claims("prefix_caching")
        layouts = dict.fromkeys((kvcache_backend.kv_layouts[0], kvcache_backend.kv_layouts[-1]))
        for index, layout in enumerate(layouts):  # narrower values in the first layout, wider in the last
            width = _width(index)
            config = kvcache_backend.config(
                kv_layout=layout, num_blocks=12, value_head_dim=width, enable_prefix_caching=caching
            )
            run_config_machine(kvcache_backend, config, f"values_{width}_{layout}", kit_settings(request.config))

    @pytest.mark.kvcache_requires("value_head_dim")
    def test_attention_over_values_of_another_width_matches_the_dense_reference(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        served = {name for name, capability in _FEATURE_CAPABILITY.items() if kvcache_backend.claims(capability)}
        rng = np.random.default_rng(41)
        # Narrower values in every dtype and layout with the features of a sliding layer; wider
        # values in the default config, plain and with those of a chunked layer.
        cases: list[tuple[CacheConfig, tuple[tuple[str, ...], ...]]] = [
            (config, _FEATURE_SETS[1:2])
            for config in kvcache_backend.configs(value_head_dim=VALUE_WIDTHS[0], num_blocks=32)
        ]
        cases.append(
            (
                kvcache_backend.config(value_head_dim=VALUE_WIDTHS[1], num_blocks=32),
                (_FEATURE_SETS[0], _FEATURE_SETS[2]),
            )
        )
        for config, feature_sets in cases:
            width = config.value_width
            with kvcache_backend.manager(config) as manager:
                handles = _grow(manager, _LENGTHS, rng)
                contexts = [manager.gather(handle, 1) for handle in handles]
                for names in feature_sets:
                    wanted = names if set(names) <= served else ()  # features it does not serve: plain
                    context = f"value_head_dim {width}, dtype {config.dtype}, layout {config.kv_layout}, {wanted}"
                    self._attend_and_compare(manager, handles, contexts, wanted, rng, context)

    @staticmethod
    def _attend_and_compare(
        manager: Manager,
        handles: list[Handle],
        contexts: list[tuple[Any, Any]],
        names: tuple[str, ...],
        rng: np.random.Generator,
        context: str,
    ) -> None:
        config = manager.config
        query_heads = 2 * config.num_heads
        counts = (2, 9, 1)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        query = BackendUnderTest.representable(
            rng.standard_normal((int(indptr[-1]), query_heads, config.head_dim)), config.dtype
        )
        chosen: dict[str, Any] = {}
        if "window" in names:
            chosen["window"] = 6
        if "chunk" in names:
            chosen["chunk"] = 8
        if "softcap" in names:
            chosen["softcap"] = 5.0
        native = dict(chosen)
        if "sinks" in names:
            chosen["sinks"] = BackendUnderTest.representable(rng.standard_normal(query_heads), config.dtype)
            native["sinks"] = BackendUnderTest.native(manager, chosen["sinks"])
        scale = 1.0 / math.sqrt(config.head_dim)
        output = manager.paged_attention(
            1,
            BackendUnderTest.native(manager, query),
            manager.page_table(handles),
            qo_indptr=indptr,
            scale=scale,
            **native,
        )
        expected = np.concatenate(
            [
                dense_feature_attention(
                    query[indptr[index] : indptr[index + 1]],
                    BackendUnderTest.host(manager, keys),
                    BackendUnderTest.host(manager, values),
                    scale=scale,
                    **chosen,
                )
                for index, (keys, values) in enumerate(contexts)
            ]
        )
        got = BackendUnderTest.host(manager, output)
        assert got.shape == (int(indptr[-1]), query_heads, config.value_width), f"{context}: output {got.shape}"
        rtol, atol = TOLERANCES.get(config.dtype, (1e-2, 1e-2))
        assert np.allclose(got, expected, rtol=rtol, atol=atol), (
            f"{context}: differs from the dense reference by up to {float(np.max(np.abs(got - expected))):.3g}"
        )

    @pytest.mark.kvcache_requires("value_head_dim")
    def test_host_form_of_both_widths_moves_bit_exact_to_the_numpy_reference_and_back(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        rng = np.random.default_rng(43)
        for index, dtype in enumerate(kvcache_backend.dtypes):
            width = _width(index)
            config = kvcache_backend.config(dtype=dtype, value_head_dim=width, head_dim=16)
            reference_config = _on_numpy(config)
            if reference_config is None:
                continue
            context = f"value_head_dim {width}, dtype {dtype}"
            with kvcache_backend.manager(config) as manager, create_manager("numpy", reference_config) as numpy:
                handle = manager.allocate(AllocationRequest("r"))
                _write(manager, 0, manager.extend(handle, 9), rng)
                blocks = _held_blocks(handle)
                copies = _host(manager, blocks)
                numpy.storage.blocks_from_host(np.asarray(blocks, dtype=np.int64), *copies)
                back = _host(numpy, blocks)
                for name, got, sent in zip(("keys", "values"), back, copies, strict=True):
                    assert got.tobytes() == sent.tobytes(), f"{context}: {name} changed through the NumPy pool"
                manager.storage.blocks_from_host(np.asarray(blocks[::-1], dtype=np.int64), *back)
                again = _host(manager, blocks[::-1])
                for name, got, sent in zip(("keys", "values"), again, copies, strict=True):
                    assert got.tobytes() == sent.tobytes(), f"{context}: {name} changed on the way back"

    @pytest.mark.kvcache_requires("value_head_dim")
    @pytest.mark.kvcache_requires("prefix_caching")
    def test_a_prefix_file_keeps_both_widths_and_a_pool_of_other_widths_refuses_it(
        self, kvcache_backend: BackendUnderTest, tmp_path: Path
    ) -> None:
        pytest.importorskip("safetensors", reason="prefix-cache files need the [tiers] extra (safetensors)")
        rng = np.random.default_rng(47)
        prompt = tuple(range(100, 109))  # two full blocks of 4 and a token
        for width in VALUE_WIDTHS:
            config = kvcache_backend.config(value_head_dim=width, enable_prefix_caching=True, model_id="widths")
            path = tmp_path / f"values-{width}.safetensors"
            with kvcache_backend.manager(config) as manager:
                handle = manager.allocate(AllocationRequest("r", prompt_token_ids=prompt))
                slots = manager.extend(handle, len(prompt))
                for layer in range(config.num_layers):
                    _write(manager, layer, slots, rng)
                saved = _host(manager, _held_blocks(handle)[:2])
                assert manager.save_prefix_cache(path) == 2
            with kvcache_backend.manager(config) as loaded:
                assert loaded.load_prefix_cache(path) == 2
                hit = loaded.allocate(AllocationRequest("hit", prompt_token_ids=prompt))
                assert hit.num_tokens() == 8, f"value_head_dim {width}: the loaded file gave no prefix hit"
                for name, got, sent in zip(("keys", "values"), _host(loaded, _held_blocks(hit)), saved, strict=True):
                    assert got.tobytes() == sent.tobytes(), f"value_head_dim {width}: {name} changed through the file"
            other = kvcache_backend.config(enable_prefix_caching=True, model_id="widths")
            with (
                kvcache_backend.manager(other) as refusing,
                pytest.raises(IncompatibleCacheFileError, match="value_head_dim"),
            ):
                refusing.load_prefix_cache(path)

    @pytest.mark.kvcache_requires("value_head_dim")
    @pytest.mark.kvcache_requires("swap")
    def test_swap_and_fork_keep_both_widths_bit_exact(self, kvcache_backend: BackendUnderTest) -> None:
        rng = np.random.default_rng(53)
        dtypes = kvcache_backend.unquantized_dtypes[:1] + kvcache_backend.quantized_dtypes
        for index, dtype in enumerate(dtypes):
            width = _width(index)
            config = kvcache_backend.config(dtype=dtype, value_head_dim=width, head_dim=16)
            context = f"value_head_dim {width}, dtype {dtype}"
            with kvcache_backend.manager(config) as manager:
                handle = manager.allocate(AllocationRequest("r"))
                _write(manager, 1, manager.extend(handle, 7), rng)
                before = _host(manager, _held_blocks(handle))
                manager.swap_out("r")
                manager.swap_in("r")
                after = _host(manager, _held_blocks(handle))
                for name, got, sent in zip(("keys", "values"), after, before, strict=True):
                    assert got.tobytes() == sent.tobytes(), f"{context}: {name} changed through swap"
                if kvcache_backend.claims("fork"):
                    child = manager.fork(handle, "child")
                    _write(manager, 1, manager.extend(child, 1), rng)  # copies the shared last block
                    kept = _host(manager, _held_blocks(handle))
                    for name, got, sent in zip(("keys", "values"), kept, before, strict=True):
                        assert got.tobytes() == sent.tobytes(), (
                            f"{context}: the child's write changed the parent's {name}"
                        )
                manager.check_invariants()

    @pytest.mark.kvcache_requires("value_head_dim")
    def test_quantized_values_of_another_width_meet_the_tolerance_contract(
        self, kvcache_backend: BackendUnderTest
    ) -> None:
        if not kvcache_backend.quantized_dtypes:
            pytest.skip(f"backend {kvcache_backend.name!r} claims no quantized dtype")
        rng = np.random.default_rng(59)
        for index, dtype in enumerate(kvcache_backend.quantized_dtypes):
            for layout in kvcache_backend.kv_layouts:
                width = _width(index + kvcache_backend.kv_layouts.index(layout))
                config = kvcache_backend.config(
                    dtype=dtype, kv_layout=layout, head_dim=32, value_head_dim=4 * width, num_blocks=24
                )
                context = f"value_head_dim {4 * width}, dtype {dtype}, layout {layout}"
                tolerance = QUANTIZED_TOLERANCES[dtype]
                with kvcache_backend.manager(config) as manager:
                    handle = manager.allocate(AllocationRequest("r"))
                    keys, values = _write(manager, 1, manager.extend(handle, 21), rng)
                    got_keys, got_values = manager.gather(handle, 1)
                    for name, got, wrote in (("keys", got_keys, keys), ("values", got_values, values)):
                        error = _relative_error(BackendUnderTest.host(manager, got), wrote)
                        assert error <= tolerance, f"{context}: gathered {name} error {error:.4f} > {tolerance}"
                    query = BackendUnderTest.representable(
                        rng.standard_normal((1, 2 * config.num_heads, config.head_dim)), config.io_dtype
                    )
                    output = manager.paged_attention(
                        1,
                        BackendUnderTest.native(manager, query, config.io_dtype),
                        manager.page_table([handle]),
                    )
                    scale = 1.0 / math.sqrt(config.head_dim)
                    expected = dense_feature_attention(query, keys, values, scale=scale)
                    error = _relative_error(BackendUnderTest.host(manager, output), expected)
                    assert error <= tolerance, f"{context}: attention error {error:.4f} > {tolerance}"


def _width(index: int) -> int:
    """The value width of a case's ``index``-th configuration: narrower and wider in turn."""
    return VALUE_WIDTHS[index % len(VALUE_WIDTHS)]


def _relative_error(got: FloatArray, expected: FloatArray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
