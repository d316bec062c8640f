"""The portable prefix-cache format: save, load across layouts, and every refusal loads nothing."""

from __future__ import annotations

import errno
import json
import os
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("safetensors")

from kvcache_core import CacheConfig, OutOfBlocksError, UnsupportedConfigError, create_manager
from kvcache_core.errors import CacheFileError, CorruptCacheFileError, IncompatibleCacheFileError
from kvcache_core.offload.events import CacheEvent
from kvcache_core.paging.prefix import PrefixCache
from kvcache_core.testing import inspect
from tests.core.support import Manager, admit, assert_holds, make_manager

PROMPT = list(range(500, 517))  # 4 full blocks of 4 and one token


def saved(tmp_path: Path, **overrides: Any) -> Path:
    source = make_manager(**overrides)
    admit(source, "r", PROMPT)
    path = tmp_path / "prefix.safetensors"
    assert source.save_prefix_cache(path) == 4
    return path


def snapshot(manager: Manager) -> tuple[object, ...]:
    prefix = inspect.prefix_cache(manager) or PrefixCache()
    stats = manager.stats()
    return (
        stats.free_blocks,
        stats.cached_blocks,
        stats.used_blocks,
        len(prefix),
        sorted(e.block_hash for e in prefix.entries()),
    )


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
def test_a_saved_cache_loads_into_another_layout_and_serves_hits_bit_exact(tmp_path: Path, layout: str) -> None:
    path = saved(tmp_path, kv_layout="NHD")
    target = make_manager(kv_layout=layout)
    assert target.load_prefix_cache(path) == 4
    assert target.stats().cached_blocks == 4
    target.check_invariants()
    handle = admit(target, "again", [*PROMPT, 9, 9, 9])
    assert handle.num_cached_tokens() == 16  # only the last 4 tokens were computed
    assert_holds(target, handle, [*PROMPT, 9, 9, 9])
    target.check_invariants()


def test_loading_twice_loads_nothing_new_and_reports_stored_events(tmp_path: Path) -> None:
    path = saved(tmp_path)
    target = make_manager()
    events: list[CacheEvent] = []
    target.subscribe(events.append)
    assert target.load_prefix_cache(path) == 4
    assert len(events) == 4
    assert target.load_prefix_cache(path) == 0
    assert len(events) == 4


def test_a_partly_cached_chain_loads_only_the_missing_blocks(tmp_path: Path) -> None:
    path = saved(tmp_path)
    target = make_manager()
    admit(target, "short", PROMPT[:9])  # caches the first two blocks itself
    assert target.load_prefix_cache(path) == 2
    handle = admit(target, "again", PROMPT)
    assert handle.num_cached_tokens() == 16
    assert_holds(target, handle, PROMPT)
    target.check_invariants()


def test_evicted_loaded_blocks_leave_the_chain_from_its_tail(tmp_path: Path) -> None:
    path = saved(tmp_path)
    target = make_manager(num_blocks=6)
    target.load_prefix_cache(path)
    admit(target, "other", list(range(8)))  # 2 blocks: takes the 2 free ones
    admit(target, "more", list(range(50, 54)))  # 1 block: evicts the loaded chain's tail
    target.deallocate("other")
    target.deallocate("more")
    handle = admit(target, "again", PROMPT)
    assert handle.num_cached_tokens() == 12
    target.check_invariants()


def refused(
    target: Manager, path: Path, error: type[BaseException] | tuple[type[BaseException], ...], match: str | None
) -> None:
    before = snapshot(target)
    events: list[CacheEvent] = []
    target.subscribe(events.append)
    with pytest.raises(error, match=match):
        target.load_prefix_cache(path)
    assert snapshot(target) == before
    assert events == []
    target.check_invariants()


def test_a_cache_of_another_namespace_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path, model_id="model-a")
    refused(make_manager(model_id="model-b"), path, IncompatibleCacheFileError, "namespace 'model-a'.*'model-b'")
    refused(make_manager(), path, IncompatibleCacheFileError, "namespace 'model-a'")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"head_dim": 8}, "geometry"), ({"block_size": 8}, "geometry"), ({"dtype": "float16"}, "'float32' blocks")],
)
def test_a_cache_of_another_geometry_or_dtype_is_refused(tmp_path: Path, overrides: dict[str, Any], match: str) -> None:
    path = saved(tmp_path)
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=64, block_size=4, enable_prefix_caching=True)
    refused(create_manager("numpy", replace(config, **overrides)), path, IncompatibleCacheFileError, match)


def rewrite_header(path: Path, change: dict[str, Any]) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    table = json.loads(data[8 : 8 + length])
    header = json.loads(table["__metadata__"]["kvcache"])
    header.update(change)
    table["__metadata__"]["kvcache"] = json.dumps(header)
    encoded = json.dumps(table).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def test_an_unknown_format_version_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    rewrite_header(path, {"version": 99})
    refused(make_manager(), path, IncompatibleCacheFileError, "version 99; this kvcache reads versions 1, 2")


def test_a_forged_hash_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(json.loads(data[8 : 8 + length])["__metadata__"]["kvcache"])
    header["blocks"][2]["token_ids"][0] += 1
    rewrite_header(path, {"blocks": header["blocks"]})
    refused(make_manager(), path, CorruptCacheFileError, "block 2's hash does not match")


def test_one_flipped_byte_in_block_data_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # inside the last block's values
    path.write_bytes(bytes(data))
    refused(make_manager(), path, CorruptCacheFileError, "block 3's data does not match its checksum")


def test_one_flipped_byte_in_the_header_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[20] ^= 0x40
    path.write_bytes(bytes(data))
    refused(make_manager(), path, (CorruptCacheFileError, IncompatibleCacheFileError), None)


@pytest.mark.parametrize("keep", [0, 5, 200, -100, -1])
def test_a_truncated_file_is_refused(tmp_path: Path, keep: int) -> None:
    path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    refused(make_manager(), path, CorruptCacheFileError, "truncated|does not load|does not parse")


def test_a_missing_file_is_a_cache_file_error(tmp_path: Path) -> None:
    refused(make_manager(), tmp_path / "absent.safetensors", CacheFileError, "absent.safetensors")


def test_too_few_free_blocks_load_nothing(tmp_path: Path) -> None:
    path = saved(tmp_path)
    target = make_manager(num_blocks=5)
    admit(target, "busy", list(range(900, 908)))  # 2 blocks in use, 3 free
    refused(target, path, OutOfBlocksError, "4 cached blocks: 3 of 5 blocks are free")


def test_a_pool_without_prefix_caching_cannot_save_or_load(tmp_path: Path) -> None:
    path = saved(tmp_path)
    plain = create_manager("numpy", CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4))
    with pytest.raises(UnsupportedConfigError, match="enable_prefix_caching"):
        plain.load_prefix_cache(path)
    with pytest.raises(UnsupportedConfigError, match="enable_prefix_caching"):
        plain.save_prefix_cache(tmp_path / "other.safetensors")


def test_a_storage_failure_while_loading_gives_every_block_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = saved(tmp_path)
    target = make_manager()

    def failing(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(target.storage, "blocks_from_host", failing)
    refused(target, path, KeyboardInterrupt, None)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_directory_without_write_permission_is_a_cache_file_error(tmp_path: Path) -> None:
    source = make_manager()
    admit(source, "r", PROMPT)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(CacheFileError, match="Permission denied"):
            source.save_prefix_cache(locked / "prefix.safetensors")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_a_directory_that_does_not_exist_is_a_cache_file_error(tmp_path: Path) -> None:
    source = make_manager()
    with pytest.raises(CacheFileError, match="absent"):
        source.save_prefix_cache(tmp_path / "absent" / "prefix.safetensors")


def test_a_failed_write_leaves_neither_a_partial_file_nor_a_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = saved(tmp_path)
    before = path.read_bytes()
    source = make_manager()
    admit(source, "other", list(range(40, 49)))

    def full_disk(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(CacheFileError, match="No space left"):
        source.save_prefix_cache(path)
    assert path.read_bytes() == before  # the old file stands, whole
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["prefix.safetensors"]


def test_the_file_holds_no_pickle_and_a_readable_header(tmp_path: Path) -> None:
    path = saved(tmp_path, model_id="m@1")
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(json.loads(data[8 : 8 + length])["__metadata__"]["kvcache"])
    assert header["format"] == "kvcache-prefix-cache"
    assert header["namespace"] == "m@1"
    assert header["geometry"] == {"num_layers": 2, "num_heads": 2, "head_dim": 4, "block_size": 4}
    assert [block["token_ids"] for block in header["blocks"]] == [PROMPT[i : i + 4] for i in range(0, 16, 4)]
    assert header["blocks"][0]["parent"] is None
    assert header["blocks"][1]["parent"] == header["blocks"][0]["hash"]
    from safetensors.numpy import load

    tensors = load(path.read_bytes())
    assert tensors["keys"].shape == (2, 4, 4, 2, 4)
    assert np.isfinite(tensors["values"]).all()


def test_a_permission_refusal_from_the_os_is_a_cache_file_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root ignores directory modes, so the refusal an unprivileged user gets is played here.
    source = make_manager()
    admit(source, "r", PROMPT)
    real_open = os.open

    def refusing(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(CacheFileError, match="Permission denied") as caught:
        source.save_prefix_cache(tmp_path / "prefix.safetensors")
    assert caught.value.errno == errno.EACCES
    assert list(tmp_path.iterdir()) == []


def test_what_is_saved_is_exactly_what_the_pool_still_caches(tmp_path: Path) -> None:
    source = make_manager(num_blocks=6)
    admit(source, "a", PROMPT)  # 4 full blocks and a partial one: 5 of 6 blocks
    source.deallocate("a")
    admit(source, "b", list(range(900, 909)))  # 3 blocks: the 2 free ones, and a's tail evicted
    path = tmp_path / "prefix.safetensors"
    assert source.save_prefix_cache(path) == 5  # a's first three, b's two full ones
    target = make_manager()
    assert target.load_prefix_cache(path) == 5
    assert admit(target, "again", PROMPT).num_cached_tokens() == 12
    target.check_invariants()
