"""The tier kit over every installed backend with RedisTier on a real redis-server: a fault
injected at each of its calls (the storage calls are failed with HostTier in
TestEveryInstalledBackend)."""

from __future__ import annotations

import pytest

from kvcache_core.testing.tiers import TierCases, TierFactory
from tests.redis_support import RedisServer, fast_tier


class TestRedisTierBehindEveryBackend(TierCases):
    """RedisTier, each tier of its own key prefix (so every run of the fault injection
    starts from an empty store)."""

    inject_storage_faults = False

    @pytest.fixture
    def kvcache_tier_factory(self, redis_server: RedisServer) -> TierFactory:
        return lambda max_bytes, name: fast_tier(redis_server.url, max_bytes, name=name)
