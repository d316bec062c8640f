"""The whole kvcache conformance kit against this backend: one class, nothing else."""

import pytest

from kvcache_core.testing import KvCacheConformance


@pytest.mark.kvcache_backends("memmap")
class TestMemmapConformance(KvCacheConformance):
    pass
