"""The torch storage: registration, the pool's views, writes, block copies, host transfers,
array conversions and the validation contract the manager relies on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvcache_core import (
    AllocationRequest,
    CacheConfig,
    KvStorage,
    UnsupportedConfigError,
    available_backends,
    create_manager,
)
from kvcache_core.cli.demo import DemoOptions, run_demo
from kvcache_core.discovery import get_backend
from kvcache_core.errors import ArrayTypeError, DTypeMismatchError, ShapeMismatchError
from kvcache_core.offload import host_form
from kvcache_core.testing import inspect
from kvcache_torch import TorchStorage
from tests.core.support import make_config
from tests.process_support import run_python
from tests.torch.support import DTYPES, LAYOUTS, NO_CUDA, TORCH_DTYPES, Manager, fill, make_manager, random_kv

CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=16, block_size=4)


def untyped(value: object) -> Any:
    """Pass a deliberately ill-typed value past the type checker."""
    return value


def conforming_storage() -> KvStorage[torch.Tensor]:
    """The static check: mypy and pyright (strict, over tests/) accept a TorchStorage where
    a ``KvStorage[torch.Tensor]`` is expected, with no inheritance."""
    storage: KvStorage[torch.Tensor] = TorchStorage(CONFIG)
    return storage


def snapshot_pool(manager: Manager) -> torch.Tensor:
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    return storage.pool.clone()


# -- registration ------------------------------------------------------------------------


def test_torch_storage_is_a_kv_storage_without_inheriting() -> None:
    storage = conforming_storage()
    assert isinstance(storage, TorchStorage)
    assert KvStorage not in type(storage).__mro__
    assert storage.config == CONFIG.with_layout("heads_first")  # kv_layout=None: the torch default


def test_create_manager_builds_a_torch_manager_and_the_backend_is_listed() -> None:
    assert "torch" in available_backends()
    spec = get_backend("torch")
    assert set(spec.dtypes) == {*DTYPES, "int8", "float8_e4m3fn"}  # quantized pools: tests/torch/test_quantized.py
    assert set(spec.kv_layouts) == set(LAYOUTS)
    assert spec.devices == ("cpu", "cuda")
    manager = create_manager("torch", CONFIG)
    assert manager.backend == "torch"
    assert isinstance(manager.storage, TorchStorage)


def test_listing_backends_imports_no_torch() -> None:
    code = (
        "import sys; from kvcache_core import installed_backends; "
        "names = [info.name for info in installed_backends()]; "
        "assert 'torch' in names, names; "
        "assert 'torch' not in sys.modules, 'listing backends imported torch'"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_core_policies_run_over_the_torch_pool(dtype: str, layout: str) -> None:
    # What the claimed capabilities rest on: copy_blocks (fork), host transfers (swap).
    assert {"fork", "swap", "prefix_caching", "eviction", "sliding_window"} <= get_backend("torch").capabilities
    config = make_config(32, 4, num_layers=2, num_heads=2, head_dim=8, dtype=dtype, kv_layout=layout)
    manager: Manager = create_manager("torch", config)
    prompt = tuple(range(10))
    parent = manager.allocate(AllocationRequest("parent", prompt_token_ids=prompt))
    slots = manager.extend(parent, 10, token_ids=list(prompt))
    generator = torch.Generator().manual_seed(27)
    keys, values = random_kv(manager, 10, generator), random_kv(manager, 10, generator)
    for layer in range(2):
        manager.write(layer, slots, keys, values)
    child = manager.fork(parent, "child")
    manager.write(0, manager.writable_slots(child, 9, 10), keys[:1], values[:1])  # copy-on-write
    assert torch.equal(manager.gather(parent, 0)[0], keys)
    assert torch.equal(manager.gather(child, 0)[0][9], keys[0])
    manager.swap_out("parent")
    manager.swap_in("parent")
    assert torch.equal(manager.gather(parent, 1)[1], values)  # back bit-identical
    manager.deallocate("parent")
    manager.deallocate("child")
    again = manager.allocate(AllocationRequest("again", prompt_token_ids=prompt))
    assert again.num_tokens() == 8  # the two full blocks of the prompt come from the prefix cache
    manager.check_invariants()


def test_unsupported_dtype_is_refused_naming_the_supported_ones() -> None:
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=4, dtype="float64")
    with pytest.raises(UnsupportedConfigError, match=r"float64.*float32, float16, bfloat16"):
        create_manager("torch", config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_with_the_reason() -> None:
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=4, device="cuda")
    with pytest.raises(UnsupportedConfigError, match=r"'cuda' is not available.*no CUDA GPU"):
        create_manager("torch", config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_a_cuda_index_past_the_last_gpu_is_refused() -> None:
    count = torch.cuda.device_count()
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=4, device=f"cuda:{count}")
    with pytest.raises(UnsupportedConfigError, match=f"{count} CUDA devices"):
        create_manager("torch", config)


def test_the_demo_serves_and_checks_on_torch(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_demo("torch", DemoOptions(num_requests=3, num_layers=1))
    assert report.ok, report
    assert report.max_logit_difference <= DemoOptions().tolerance
    assert "backend 'torch'" in capsys.readouterr().out


# -- the pool and its views --------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_views_have_the_layout_shape_dtype_and_device(device: str, dtype: str, layout: str) -> None:
    manager = make_manager(device=device, dtype=dtype, kv_layout=layout)
    config = manager.config
    for layer in range(config.num_layers):
        for cache in (manager.storage.key_cache(layer), manager.storage.value_cache(layer)):
            assert tuple(cache.shape) == config.block_shape()
            assert cache.dtype == TORCH_DTYPES[dtype]
            assert cache.device.type == device
            assert manager.storage.array_info(cache) == (config.block_shape(), dtype)


def test_key_and_value_caches_share_the_pool_memory(device: str) -> None:
    manager = make_manager(device=device)
    storage = manager.storage
    assert isinstance(storage, TorchStorage)
    base = storage.pool.untyped_storage().data_ptr()
    pointers: set[int] = set()
    for layer in range(manager.config.num_layers):
        for cache in (storage.key_cache(layer), storage.value_cache(layer)):
            assert cache.untyped_storage().data_ptr() == base
            pointers.add(cache.data_ptr())
    assert len(pointers) == 2 * manager.config.num_layers  # each its own part of one allocation


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_reference_taken_before_a_write_sees_the_write(device: str, layout: str) -> None:
    manager = make_manager(device=device, kv_layout=layout)
    handle = manager.allocate(AllocationRequest("r"))
    keys_before, values_before = handle.kv_cache(1)
    assert keys_before is not None
    assert values_before is not None
    pointer = keys_before.data_ptr()
    slots = manager.extend(handle, 6)
    generator = torch.Generator().manual_seed(1)
    keys, values = random_kv(manager, 6, generator), random_kv(manager, 6, generator)
    manager.write(1, slots, keys, values)
    gathered_keys, _ = manager.gather(handle, 1)
    assert torch.equal(gathered_keys, keys)
    blocks, offsets = np.divmod(slots, manager.config.block_size)
    if layout == "NHD":
        seen_keys, seen_values = keys_before[blocks, offsets], values_before[blocks, offsets]
    elif layout == "HND":
        seen_keys, seen_values = keys_before[blocks, :, offsets], values_before[blocks, :, offsets]
    else:
        seen_keys = keys_before[:, blocks, offsets].transpose(0, 1)
        seen_values = values_before[:, blocks, offsets].transpose(0, 1)
    assert torch.equal(seen_keys, keys)
    assert torch.equal(seen_values, values)
    keys_after = handle.key_cache(1)
    assert keys_after is not None
    assert keys_after.data_ptr() == pointer  # the same memory, not a new array


# -- writes and reads --------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_writes_then_gather_round_trip(device: str, dtype: str, layout: str) -> None:
    manager = make_manager(device=device, dtype=dtype, kv_layout=layout)
    filled = fill(manager, [9, 14, 3, 1], seed=2)
    for layer in range(manager.config.num_layers):
        for index, handle in enumerate(filled.handles):
            keys, values = manager.gather(handle, layer)
            assert keys.is_contiguous()
            assert values.is_contiguous()
            assert torch.equal(keys, filled.keys[layer][index])
            assert torch.equal(values, filled.values[layer][index])


def test_one_write_call_scatters_a_whole_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make_manager(kv_layout="heads_first")
    first, second = manager.allocate(AllocationRequest("a")), manager.allocate(AllocationRequest("b"))
    slots = np.concatenate([manager.extend(first, 5), manager.extend(second, 3)])
    generator = torch.Generator().manual_seed(3)
    keys, values = random_kv(manager, 8, generator), random_kv(manager, 8, generator)
    calls: list[int] = []
    original = torch.Tensor.index_copy_

    def counting(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        calls.append(int(index.numel()))
        return original(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", counting)
    manager.write(0, slots, keys, values)
    monkeypatch.undo()
    assert calls == [8, 8]  # one scatter of all 8 rows for K, one for V
    assert torch.equal(manager.gather(first, 0)[0], keys[:5])
    assert torch.equal(manager.gather(second, 0)[1], values[5:])


# -- block copies and host transfers ------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_to_host_and_back_are_bit_identical(device: str, dtype: str, layout: str) -> None:
    manager = make_manager(device=device, dtype=dtype, kv_layout=layout)
    config = manager.config
    filled = fill(manager, [10, 7], seed=4)
    storage = manager.storage
    blocks = np.asarray(filled.handles[0].block_table().physical_blocks, dtype=np.int64)
    keys, values = storage.blocks_to_host(blocks)
    expected_shape = (config.num_layers, len(blocks), config.block_size, config.num_heads, config.head_dim)
    assert keys.shape == values.shape == expected_shape
    assert keys.dtype == host_form.host_dtype(dtype)  # core's host form: bfloat16 as uint16 bit patterns
    tokens = host_form.host_values(config, keys)[1].reshape(-1, config.num_heads, config.head_dim)[:10]
    assert np.array_equal(tokens, storage.to_numpy(filled.keys[1][0]))
    free = np.flatnonzero(~inspect.allocator(manager).in_use_mask())[: len(blocks)].astype(np.int64)
    storage.blocks_from_host(free, keys, values)
    back_keys, back_values = storage.blocks_to_host(free)
    assert np.array_equal(back_keys, keys)
    assert np.array_equal(back_values, values)
    keys[...] = 0  # host copies are copies: changing them leaves the pool alone
    assert np.array_equal(storage.blocks_to_host(free)[0], back_keys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_host_copies_of_a_cuda_pool_are_pinned() -> None:
    manager = make_manager(device="cuda")
    fill(manager, [6], seed=5)
    keys, values = manager.storage.blocks_to_host(np.array([0, 1], dtype=np.int64))
    assert torch.as_tensor(keys).is_pinned()
    assert torch.as_tensor(values).is_pinned()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_blocks_copies_every_layer_of_k_and_v(device: str, layout: str) -> None:
    manager = make_manager(device=device, kv_layout=layout)
    filled = fill(manager, [8, 5], seed=6)
    storage = manager.storage
    source = np.asarray(filled.handles[0].block_table().physical_blocks, dtype=np.int64)
    targets = np.flatnonzero(~inspect.allocator(manager).in_use_mask())[: len(source)].astype(np.int64)
    storage.copy_blocks(source, targets)
    for got, want in zip(storage.blocks_to_host(targets), storage.blocks_to_host(source), strict=True):
        assert np.array_equal(got, want)


def test_copy_blocks_reads_every_source_before_writing() -> None:
    manager = make_manager()
    filled = fill(manager, [8], seed=7)
    storage = manager.storage
    blocks = np.asarray(filled.handles[0].block_table().physical_blocks, dtype=np.int64)
    before = storage.blocks_to_host(blocks)
    storage.copy_blocks(blocks, blocks[::-1].copy())  # a swap: each block is a source and a target
    after = storage.blocks_to_host(blocks)
    assert np.array_equal(after[0], before[0][:, ::-1])
    assert np.array_equal(after[1], before[1][:, ::-1])


def test_blocks_from_host_refuses_the_wrong_shape_dtype_or_type() -> None:
    manager = make_manager(dtype="bfloat16")
    storage = manager.storage
    blocks = np.array([0, 1], dtype=np.int64)
    keys, values = storage.blocks_to_host(blocks)
    before = snapshot_pool(manager)
    with pytest.raises(ShapeMismatchError, match=r"\(2, 2, 4, 2, 8\)"):
        storage.blocks_from_host(blocks[:1], keys, values)
    with pytest.raises(DTypeMismatchError, match=r"float64.*host form of a bfloat16 pool is uint16"):
        storage.blocks_from_host(blocks, keys.astype(np.float64), values)
    with pytest.raises(ArrayTypeError, match="list"):
        storage.blocks_from_host(blocks, untyped(keys.tolist()), values)
    assert torch.equal(snapshot_pool(manager), before)


# -- arrays --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int64"])
def test_from_numpy_keeps_values_and_dtype_on_the_pool_device(device: str, dtype: str) -> None:
    manager = make_manager(device=device)
    array = (np.arange(12).reshape(3, 4) - 5).astype(dtype)
    tensor = manager.storage.from_numpy(array)
    assert tensor.device.type == device
    assert manager.storage.array_info(tensor) == ((3, 4), dtype)
    assert np.array_equal(manager.storage.to_numpy(tensor), array)


def test_from_numpy_accepts_a_read_only_array() -> None:
    array = np.ones((2, 3), dtype=np.float32)
    array.flags.writeable = False
    tensor = make_manager().storage.from_numpy(array)
    assert torch.equal(tensor, torch.ones(2, 3))


def test_bfloat16_goes_to_numpy_as_float32_exactly(device: str) -> None:
    manager = make_manager(device=device, dtype="bfloat16")
    tensor = torch.randn(5, 3, generator=torch.Generator().manual_seed(8)).to(device=device, dtype=torch.bfloat16)
    host = manager.storage.to_numpy(tensor)
    assert host.dtype == np.float32
    assert torch.equal(torch.as_tensor(host).to(device=device, dtype=torch.bfloat16), tensor)


def test_to_numpy_detaches_a_tensor_that_requires_grad() -> None:
    tensor = torch.ones(2, requires_grad=True)
    assert np.array_equal(make_manager().storage.to_numpy(tensor), np.ones(2, dtype=np.float32))


def test_array_conversions_refuse_foreign_objects() -> None:
    storage = make_manager().storage
    with pytest.raises(ArrayTypeError, match="list"):
        storage.from_numpy(untyped([1.0, 2.0]))
    with pytest.raises(ArrayTypeError, match="ndarray"):
        storage.to_numpy(untyped(np.ones(2)))
    with pytest.raises(DTypeMismatchError, match="object"):
        storage.from_numpy(np.array([object()]))


def test_array_info_refuses_anything_but_a_tensor_on_the_pool_device() -> None:
    storage = make_manager().storage
    assert storage.array_info(torch.zeros(2, 3, dtype=torch.bfloat16)) == ((2, 3), "bfloat16")
    with pytest.raises(TypeError, match="ndarray"):
        storage.array_info(np.zeros(3))
    with pytest.raises(TypeError, match=r"on cpu.*meta"):
        storage.array_info(torch.zeros(3, device="meta"))


def test_array_namespace_runs_array_api_code_on_tensors() -> None:
    xp = make_manager().storage.array_namespace()
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(xp.concat([x, x], axis=-1), torch.cat([x, x], dim=-1))
    assert torch.equal(xp.max(x, axis=-1, keepdims=True), torch.tensor([[2.0], [5.0]]))
    assert xp.astype(x, xp.bfloat16).dtype == torch.bfloat16


# -- the validation contract (as the NumPy backend: checked before any state changes) --------


def _write_case(manager: Manager, keys: object, values: object) -> None:
    handle = manager.get_handle("r0")
    assert handle is not None
    slots = handle.block_table().slots(0, 2)
    manager.write(0, slots, untyped(keys), untyped(values))


@pytest.mark.parametrize(
    ("make_keys", "error", "match"),
    [
        pytest.param(lambda: torch.zeros(2, 2, 8, dtype=torch.float64), DTypeMismatchError, "float64", id="float64"),
        pytest.param(lambda: torch.zeros(2, 2, 8, dtype=torch.bfloat16), DTypeMismatchError, "bfloat16", id="bf16"),
        pytest.param(lambda: torch.zeros(2, 3, 8), ShapeMismatchError, r"\(2, 3, 8\)", id="heads"),
        pytest.param(lambda: torch.zeros(2, 16), ShapeMismatchError, r"\(2, 16\)", id="2-d"),
        pytest.param(lambda: np.zeros((2, 2, 8), dtype=np.float32), ArrayTypeError, "ndarray", id="numpy"),
        pytest.param(lambda: [[[0.0] * 8] * 2] * 2, ArrayTypeError, "list", id="list"),
        pytest.param(lambda: torch.zeros(2, 2, 8, device="meta"), ArrayTypeError, "meta", id="other-device"),
    ],
)
def test_write_refuses_bad_keys_and_changes_nothing(make_keys: Any, error: type[Exception], match: str) -> None:
    manager = make_manager()
    fill(manager, [5, 3], seed=9)
    before = snapshot_pool(manager)
    stats = manager.stats()
    good = torch.zeros(2, 2, 8)
    with pytest.raises(error, match=match):
        _write_case(manager, make_keys(), good)
    with pytest.raises(error, match=match):
        _write_case(manager, good, make_keys())
    assert torch.equal(snapshot_pool(manager), before)
    assert manager.stats() == stats


def test_attention_refuses_a_query_of_another_dtype_or_device() -> None:
    manager = make_manager()
    filled = fill(manager, [5, 3], seed=10)
    table = manager.page_table(filled.handles)
    with pytest.raises(DTypeMismatchError, match="float16"):
        manager.paged_attention(0, torch.zeros(2, 4, 8, dtype=torch.float16), table)
    with pytest.raises(ArrayTypeError, match="meta"):
        manager.paged_attention(0, torch.zeros(2, 4, 8, device="meta"), table)
    with pytest.raises(ArrayTypeError, match="ndarray"):
        manager.paged_attention(0, untyped(np.zeros((2, 4, 8), dtype=np.float32)), table)


def test_closing_the_manager_drops_the_pool_tensor() -> None:
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=16, block_size=4)
    with create_manager("torch", config) as manager:
        storage = manager.storage
        assert isinstance(storage, TorchStorage)
        assert storage.pool.numel() == 2 * 2 * 16 * 4 * 2 * 8
    assert storage.pool.numel() == 0
    assert storage.pool.dtype == torch.float32
