"""Every backend of the repository claims what it always claimed, composed from core's named
capability sets: the capabilities, dtypes, devices and layouts its plugin registers."""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import pytest

from kvcache_core.attention import features as attention_features
from kvcache_core.backends import numpy as numpy_backend
from kvcache_core.contract.hookspecs import (
    ATTENTION_CAPABILITIES,
    CAPABILITIES,
    IMMUTABLE_ARRAYS,
    LAYER_GEOMETRY,
    POLICY_CAPABILITIES,
    STATE_LAYERS,
    VALUE_HEAD_DIM,
    BackendSpec,
)
from kvcache_core.contract.lanes import STEP_LANES
from kvcache_core.contract.regions import MEMORY_REGIONS

POLICIES = {"fork", "prefix_caching", "swap", "eviction", "sliding_window"}
ATTENTION = {"attention_window", "softcap", "sinks", "chunked_attention"}
WIDTHS = {"value_head_dim"}
LAYOUTS = ("NHD", "HND", "heads_first")


class Claim(NamedTuple):
    """What a backend registers, and where its plugin and storage class live."""

    plugin: str
    storage: str
    capabilities: set[str]
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]


CLAIMS = {
    "numpy": Claim(
        "kvcache_core.backends.numpy",
        "kvcache_core.backends.numpy:NumpyStorage",
        POLICIES | ATTENTION | WIDTHS | {"memory_regions", "state_layers", "layer_geometry"},
        numpy_backend.NUMPY_DTYPES,
        ("cpu",),
    ),
    "torch": Claim(
        "kvcache_torch.plugin",
        "kvcache_torch.storage:TorchStorage",
        POLICIES | ATTENTION | WIDTHS | {"memory_regions", "state_layers", "layer_geometry", "step_lanes"},
        ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn"),
        ("cpu", "cuda"),
    ),
    "jax": Claim(
        "kvcache_jax.plugin",
        "kvcache_jax.storage:JaxStorage",
        POLICIES | ATTENTION | WIDTHS | {"immutable_arrays", "state_layers", "layer_geometry"},
        ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn"),
        ("cpu", "cuda", "gpu", "rocm", "tpu"),
    ),
    "memmap": Claim(
        "kvcache_memmap.storage",
        "kvcache_memmap.storage:MemmapStorage",
        POLICIES | ATTENTION | WIDTHS | {"memory_regions", "state_layers"},
        tuple(name for name in numpy_backend.NUMPY_DTYPES if name != "float64"),
        ("cpu",),
    ),
}


def registered(plugin: str) -> BackendSpec[Any]:
    """The one spec the plugin module's hook yields."""
    specs: list[BackendSpec[Any]] = list(importlib.import_module(plugin).kvcache_register_backends())
    assert len(specs) == 1, specs
    return specs[0]


def test_the_named_sets_split_the_vocabulary() -> None:
    assert POLICY_CAPABILITIES == POLICIES
    assert ATTENTION_CAPABILITIES == ATTENTION
    assert set(CAPABILITIES) == POLICY_CAPABILITIES | ATTENTION_CAPABILITIES | {
        IMMUTABLE_ARRAYS,
        LAYER_GEOMETRY,
        MEMORY_REGIONS,
        STATE_LAYERS,
        STEP_LANES,
        VALUE_HEAD_DIM,
    }
    assert POLICY_CAPABILITIES.isdisjoint(ATTENTION_CAPABILITIES)


def test_the_old_homes_of_the_sets_still_hold_them() -> None:
    assert numpy_backend.POLICY_CAPABILITIES is POLICY_CAPABILITIES
    assert numpy_backend.ATTENTION_CAPABILITIES is ATTENTION_CAPABILITIES
    assert attention_features.ATTENTION_CAPABILITIES is ATTENTION_CAPABILITIES
    assert set(attention_features.FEATURE_CAPABILITIES.values()) == ATTENTION_CAPABILITIES


@pytest.mark.parametrize("backend", sorted(CLAIMS))
def test_a_backend_claims_what_it_claimed(backend: str) -> None:
    claim = CLAIMS[backend]
    spec = registered(claim.plugin)
    assert spec.name == backend
    assert spec.capabilities == claim.capabilities
    assert spec.dtypes == claim.dtypes
    assert spec.devices == claim.devices
    assert spec.kv_layouts == LAYOUTS
    assert spec.preferred_layout == "heads_first"


@pytest.mark.parametrize("backend", sorted(CLAIMS))
def test_a_storage_serves_the_attention_features_its_backend_claims(backend: str) -> None:
    claim = CLAIMS[backend]
    module, _, name = claim.storage.partition(":")
    storage_class = getattr(importlib.import_module(module), name)
    assert storage_class.attention_features == claim.capabilities & ATTENTION_CAPABILITIES
