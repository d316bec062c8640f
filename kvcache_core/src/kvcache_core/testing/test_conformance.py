"""The kit as a ready test module: ``pytest -p kvcache_core.testing --pyargs kvcache_core.testing.test_conformance``.

Without ``--kvcache-backend`` it runs against every installed backend.
"""

from __future__ import annotations

from kvcache_core.testing.suite import KvCacheConformance

__all__ = ["TestKvCacheConformance"]


class TestKvCacheConformance(KvCacheConformance):
    """Every installed backend the run selects."""
