"""The face for backend and tier authors: what a third-party storage or offload tier needs.

A backend registers a :class:`BackendSpec` through a :data:`hookimpl` of
``kvcache_register_backends`` under the entry-point group :data:`ENTRY_POINT_GROUP`; its
storage implements :class:`KvStorage` over one of :data:`KV_LAYOUTS` and dtypes of
:data:`DTYPE_SIZES`, and claims named capabilities (:data:`CAPABILITIES`, composed from
:data:`POLICY_CAPABILITIES`, :data:`ATTENTION_CAPABILITIES`, :data:`IMMUTABLE_ARRAYS` and
:data:`MEMORY_REGIONS`, whose storages also have the optional member of :class:`RegionStorage`, and
:data:`STATE_LAYERS`: a storage serving recurrent-state layers builds a :class:`StateStorage`
of :class:`StateArray` in its optional ``state_storage(arrays, num_slots)``; values of another
width than the keys: :data:`VALUE_HEAD_DIM`; a storage that prepares a step's plain layers
claims :data:`STEP_LANES` and has the optional member of :class:`LaneStorage`). A
storage without a kernel of its own can answer with the NumPy reference
(:func:`paged_attention`). A tier implements :class:`OffloadTier` and registers a factory
under :data:`TIER_ENTRY_POINT_GROUP`. The conformance kit (``pytest -p kvcache_core.testing``)
proves either::

    from kvcache_core.plugin import BackendSpec, KvStorage, hookimpl

    @hookimpl
    def kvcache_register_backends() -> list[BackendSpec]:
        return [BackendSpec(name="mine", storage_factory=MyStorage, kv_layouts=("HND",))]
"""

from __future__ import annotations

from kvcache_core.attention.reference import check_attention_call, paged_attention
from kvcache_core.contract.config import DTYPE_SIZES, KV_LAYOUTS, QUANTIZED_DTYPES, CacheConfig
from kvcache_core.contract.device import Device
from kvcache_core.contract.hookspecs import (
    ATTENTION_CAPABILITIES,
    CAPABILITIES,
    ENTRY_POINT_GROUP,
    IMMUTABLE_ARRAYS,
    LAYER_GEOMETRY,
    POLICY_CAPABILITIES,
    VALUE_HEAD_DIM,
    BackendSpec,
    hookimpl,
)
from kvcache_core.contract.lanes import STEP_LANES, LaneStorage
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import KvStorage
from kvcache_core.contract.regions import MEMORY_REGIONS, MemoryRegion, RegionStorage
from kvcache_core.contract.states import STATE_LAYERS, StateArray, StateStorage
from kvcache_core.errors import KvCachePluginWarning
from kvcache_core.offload.tiers import TIER_ENTRY_POINT_GROUP, OffloadTier, TierStats

__all__ = [
    "ATTENTION_CAPABILITIES",
    "CAPABILITIES",
    "DTYPE_SIZES",
    "ENTRY_POINT_GROUP",
    "IMMUTABLE_ARRAYS",
    "KV_LAYOUTS",
    "LAYER_GEOMETRY",
    "MEMORY_REGIONS",
    "POLICY_CAPABILITIES",
    "QUANTIZED_DTYPES",
    "STATE_LAYERS",
    "STEP_LANES",
    "TIER_ENTRY_POINT_GROUP",
    "VALUE_HEAD_DIM",
    "BackendSpec",
    "CacheConfig",
    "Device",
    "KvCachePluginWarning",
    "KvStorage",
    "LaneStorage",
    "MemoryRegion",
    "OffloadTier",
    "PageTable",
    "RegionStorage",
    "StateArray",
    "StateStorage",
    "TierStats",
    "check_attention_call",
    "hookimpl",
    "paged_attention",
]
