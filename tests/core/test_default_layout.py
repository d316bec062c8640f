"""``CacheConfig(kv_layout=None)``: the backend's fastest layout, resolved where the pool is built."""

from __future__ import annotations

import pytest

from kvcache_core import CacheConfig, InvalidArgumentError, create_manager
from kvcache_core.backends.numpy import PREFERRED_LAYOUT, NumpyStorage
from kvcache_core.errors import InvalidConfigError
from kvcache_core.plugin import BackendSpec


def geometry(kv_layout: str | None = None) -> CacheConfig:
    return CacheConfig(num_layers=2, num_heads=2, head_dim=8, num_blocks=8, block_size=4, kv_layout=kv_layout)


def test_the_default_is_none_and_create_manager_resolves_it_to_the_backends_choice() -> None:
    config = geometry()
    assert config.kv_layout is None
    with create_manager("numpy", config) as manager:
        assert manager.config.kv_layout == PREFERRED_LAYOUT == "heads_first"
        assert manager.config == config.with_layout("heads_first")
        assert manager.storage.key_cache(0).shape == (2, 8, 4, 8)  # [heads, blocks, block_size, dim]


@pytest.mark.parametrize("layout", ["NHD", "HND", "heads_first"])
def test_an_explicit_layout_is_kept(layout: str) -> None:
    config = geometry(layout)
    with create_manager("numpy", config) as manager:
        assert manager.config is config
        assert manager.storage.key_cache(0).shape == config.block_shape()


def test_a_storage_built_directly_resolves_the_layout_too() -> None:
    storage = NumpyStorage(geometry())
    assert storage.config.kv_layout == PREFERRED_LAYOUT
    assert NumpyStorage.pool_shape(geometry()) == storage.pool.shape


def test_an_unresolved_config_has_no_block_shape() -> None:
    with pytest.raises(InvalidConfigError, match="kv_layout is None"):
        geometry().block_shape()
    with pytest.raises(InvalidConfigError, match="kv_layout is None"):
        _ = geometry().layout
    assert geometry("HND").layout == "HND"


def test_resolving_to_an_unknown_layout_is_refused() -> None:
    with pytest.raises(InvalidConfigError, match="'NCHW'"):
        geometry().with_layout("NCHW")


def test_a_spec_must_prefer_a_layout_it_supports() -> None:
    with pytest.raises(InvalidArgumentError, match=r"preferred_layout 'HND'.*\('NHD',\)"):
        BackendSpec(name="x", storage_factory=NumpyStorage, kv_layouts=("NHD",), preferred_layout="HND")
    spec = BackendSpec(name="x", storage_factory=NumpyStorage, kv_layouts=("NHD", "HND"))
    assert spec.default_layout == "NHD"  # no preference: the first layout listed
    assert spec.resolve(geometry()).kv_layout == "NHD"
