"""The jax backend is found through its entry point, imports JAX only when used, and
refuses configurations and options it cannot serve with the matching kvcache error."""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import sys
import textwrap
from importlib import metadata
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from kvcache_core import CacheConfig, InvalidArgumentError, UnsupportedConfigError, available_backends, create_manager
from kvcache_core.discovery import installed_backends
from kvcache_core.errors import BackendUnavailableError, InvalidTypeError
from kvcache_jax import JaxStorage
from kvcache_jax.plugin import make_storage
from tests.process_support import run_python

CONFIG = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, block_size=4)


def test_the_entry_point_names_the_plugin_module_of_kvcache_jax() -> None:
    points = [ep for ep in metadata.entry_points(group="kvcache_core.backends") if ep.name == "jax"]
    assert [ep.value for ep in points] == ["kvcache_jax.plugin"]
    assert points[0].dist is not None
    assert points[0].dist.metadata["Name"] == "kvcache-jax"
    info = {backend.name: backend for backend in installed_backends()}["jax"]
    assert info.distribution == "kvcache-jax"
    assert "jax" in available_backends()


def test_listing_backends_and_importing_the_package_import_no_jax() -> None:
    script = textwrap.dedent(
        """
        import sys
        import kvcache_jax, kvcache_jax.plugin
        from kvcache_core import available_backends, installed_backends
        assert "jax" in available_backends()
        [info.spec.availability() for info in installed_backends()]
        print(sorted(name for name in sys.modules if name == "jax" or name.startswith("jax.")))
        """
    )
    result = run_python("-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_create_manager_builds_a_jax_pool_of_the_configured_shape_dtype_and_layout() -> None:
    for layout in ("NHD", "HND", "heads_first"):
        for dtype in ("float32", "float16", "bfloat16"):
            config = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=8, dtype=dtype, kv_layout=layout)
            manager = create_manager("jax", config)
            assert isinstance(manager.storage, JaxStorage)
            assert manager.backend == "jax"
            for layer in range(config.num_layers):
                for pool in (manager.storage.key_cache(layer), manager.storage.value_cache(layer)):
                    assert isinstance(pool, jax.Array)
                    assert tuple(pool.shape) == config.block_shape()
                    assert pool.dtype.name == dtype
                    assert not np.asarray(pool, dtype=np.float32).any()


def test_the_factory_takes_only_mesh_and_axis() -> None:
    with pytest.raises(UnsupportedConfigError, match="donate"):
        create_manager("jax", CONFIG, donate=False)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param({"dtype": "float64"}, "float64.*float32, float16, bfloat16", id="float64"),
        pytest.param({"device": "xpu"}, "'xpu'.*cpu", id="unsupported-device-kind"),
    ],
)
def test_a_config_the_backend_does_not_serve_is_refused(changes: dict[str, Any], match: str) -> None:
    fields: dict[str, Any] = {"num_layers": 2, "num_heads": 2, "head_dim": 4, "num_blocks": 8, **changes}
    with pytest.raises(UnsupportedConfigError, match=match):
        create_manager("jax", CacheConfig(**fields))


def test_a_device_jax_does_not_have_here_is_refused_naming_it() -> None:
    missing = len(jax.devices("cpu"))
    with pytest.raises(UnsupportedConfigError, match=f"cpu:{missing}.*out of range"):
        create_manager("jax", CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=4, device=f"cpu:{missing}"))
    if not any(device.platform == "tpu" for device in jax.devices()):
        with pytest.raises(UnsupportedConfigError, match=r"'tpu'.*no tpu devices"):
            make_storage(CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=4, device="tpu"))


def test_bad_mesh_options_raise_their_errors() -> None:
    one_axis = Mesh(np.array(jax.devices()[:1]), ("model",))
    two_axes = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(InvalidTypeError, match=r"jax.sharding.Mesh.*str"):
        create_manager("jax", CONFIG, mesh="model")
    with pytest.raises(InvalidArgumentError, match="axis='model' needs a mesh"):
        create_manager("jax", CONFIG, axis="model")
    with pytest.raises(InvalidArgumentError, match=r"'heads' is not an axis.*'model'"):
        create_manager("jax", CONFIG, mesh=one_axis, axis="heads")
    with pytest.raises(InvalidArgumentError, match=r"\('data', 'model'\).*axis="):
        create_manager("jax", CONFIG, mesh=two_axes)
    with pytest.raises(InvalidTypeError, match="axis must be a mesh axis name"):
        create_manager("jax", CONFIG, mesh=one_axis, axis=0)


def test_a_one_axis_mesh_needs_no_axis_name() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    storage = create_manager("jax", CONFIG, mesh=mesh).storage
    assert isinstance(storage, JaxStorage)
    assert storage.placement.axis == "model"
    assert storage.placement.mesh is mesh


def test_a_jax_that_fails_to_import_makes_the_backend_unavailable_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvcache_jax.storage", None)  # importing it now raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"cannot import JAX.*pip install"):
        create_manager("jax", CONFIG)
