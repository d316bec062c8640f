"""The tier kit with RedisTier on a real redis-server: a fault injected at each of its calls
(the storage calls are failed with HostTier in TestEveryInstalledBackend)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache_core.discovery import get_backend
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.tiers import Interrupted, TierCases, TierFactory, run_tier_fault_injection
from tests.redis_support import RedisServer, fast_tier


@pytest.mark.kvcache_backends("numpy")
class TestRedisTierBehindTheNumpyBackend(TierCases):
    """RedisTier, each tier of its own key prefix (so every run of the fault injection
    starts from an empty store). What it does does not depend on the backend (its records
    are host form), so the NumPy backend runs it."""

    inject_storage_faults = False

    @pytest.fixture
    def kvcache_tier_factory(self, redis_server: RedisServer) -> TierFactory:
        return lambda max_bytes, name: fast_tier(redis_server.url, max_bytes, name=name)


def test_an_interrupt_at_any_redis_tier_call_of_a_hybrid_pool_leaks_nothing(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    backend = BackendUnderTest("numpy", get_backend("numpy"))
    report = run_tier_fault_injection(
        backend,
        lambda max_bytes, name: fast_tier(redis_server.url, max_bytes, name=name),
        tmp_path,
        Interrupted,
        storage_faults=False,
        hybrid=True,
    )
    assert report.failures == ()
    assert report.promoted >= 5
