"""Every installed backend (numpy, memmap, torch, jax, ... as installed) passes the kit."""

from __future__ import annotations

from kvcache_core.testing import KvCacheConformance


class TestEveryInstalledBackend(KvCacheConformance):
    """The conformance kit, parametrized over every installed backend."""
