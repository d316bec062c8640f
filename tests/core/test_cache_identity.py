"""Cache identity: ``CacheConfig.model_id`` enters the root of every hash chain."""

from __future__ import annotations

import pytest

from kvcache_core import CacheConfig
from kvcache_core.errors import InvalidConfigError
from kvcache_core.offload.events import CachedBlockIndex
from kvcache_core.paging.prefix import PrefixCache, hash_block, namespace_root
from kvcache_core.testing import inspect
from tests.core.support import admit, assert_holds, make_manager


def test_two_namespaces_give_identical_tokens_different_hashes() -> None:
    first, second = PrefixCache("llama-3-8b@rev1"), PrefixCache("llama-3-8b@rev2")
    entry_a, _ = first.find_or_create(None, (1, 2, 3, 4), None)
    entry_b, _ = second.find_or_create(None, (1, 2, 3, 4), None)
    plain, _ = PrefixCache().find_or_create(None, (1, 2, 3, 4), None)
    assert entry_a is not None
    assert entry_b is not None
    assert plain is not None
    assert len({entry_a.block_hash, entry_b.block_hash, plain.block_hash}) == 3
    assert plain.block_hash == hash_block(None, (1, 2, 3, 4), None)  # no namespace: hashes as before
    assert entry_a.block_hash == hash_block(namespace_root("llama-3-8b@rev1"), (1, 2, 3, 4), None)


def test_every_block_of_a_chain_differs_between_namespaces() -> None:
    prompt = list(range(17))
    hashes: list[frozenset[bytes]] = []
    for model_id in ("model-a", "model-b"):
        manager = make_manager(model_id=model_id)
        index = CachedBlockIndex()
        manager.subscribe(index)
        admit(manager, "r", prompt)
        hashes.append(index.hashes())
        assert len(index.hashes()) == 4
    assert not hashes[0] & hashes[1]


def test_blocks_of_one_namespace_never_map_into_a_pool_of_another() -> None:
    prompt = list(range(17))
    source = make_manager(model_id="model-a")
    admit(source, "r", prompt)
    target = make_manager(model_id="model-b")
    entries = {entry.block_hash: entry for entry in (inspect.prefix_cache(source) or PrefixCache()).entries()}
    for entry in entries.values():  # the target's cache cannot find the source's chain
        assert (inspect.prefix_cache(target) or PrefixCache()).get(entry.block_hash) is None
    handle = admit(target, "r", prompt)
    assert handle.num_cached_tokens() == 0
    assert_holds(target, handle, prompt)
    again = admit(target, "again", prompt)
    assert again.num_cached_tokens() == 16  # its own namespace still hits
    target.check_invariants()


@pytest.mark.parametrize("model_id", ["", 3, b"model"])
def test_a_bad_model_id_is_refused_naming_it(model_id: object) -> None:
    with pytest.raises(InvalidConfigError, match="model_id"):
        CacheConfig(num_layers=1, num_heads=1, head_dim=1, num_blocks=1, model_id=model_id)  # type: ignore[arg-type]
