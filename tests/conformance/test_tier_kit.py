"""The tier kit over every installed backend: DiskTier (HostTier runs inside
KvCacheConformance), and a third party's tier written against the OffloadTier Protocol alone."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvcache_core.offload.prefix_file import BlockRecord
from kvcache_core.testing.tiers import TierCases, TierFactory, disk_tier_factory

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig


class TestDiskTierBehindEveryBackend(TierCases):
    """DiskTier, a fault injected at each of its calls (the storage calls are failed with
    HostTier in TestEveryInstalledBackend)."""

    inject_storage_faults = False

    @pytest.fixture
    def kvcache_tier_factory(self, tmp_path: Path) -> TierFactory:
        return disk_tier_factory(tmp_path)


class DictTier:
    """A third party's tier: a dict in LRU order, nothing inherited from kvcache's tiers."""

    def __init__(self, max_bytes: int, name: str) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._records: OrderedDict[bytes, BlockRecord] = OrderedDict()

    def bind(self, config: CacheConfig) -> None:
        if config.bytes_per_block > self.max_bytes:
            raise ValueError("smaller than one block")

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        self.discard(record.key)
        self._records[record.key] = record
        self.used_bytes += record.nbytes
        let_go: list[BlockRecord | bytes] = []
        while self.used_bytes > self.max_bytes:
            _, oldest = self._records.popitem(last=False)
            self.used_bytes -= oldest.nbytes
            let_go.append(oldest)
        return let_go

    def peek(self, key: bytes, /) -> BlockRecord | None:
        return self._records.get(key)

    def discard(self, key: bytes, /) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self.used_bytes -= record.nbytes

    def hashes(self) -> list[bytes]:
        return list(self._records)

    def __contains__(self, key: object, /) -> bool:
        return key in self._records

    def clear(self) -> None:
        self._records.clear()
        self.used_bytes = 0


@pytest.mark.kvcache_backends("numpy")
class TestAThirdPartyTier(TierCases):
    """A tier the kit knows nothing about passes it (its records are checksummed)."""

    @pytest.fixture
    def kvcache_tier_factory(self) -> TierFactory:
        return DictTier
