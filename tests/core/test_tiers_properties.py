"""Property: whatever the workload, the pool and its tiers serve every request bit-exact, the
records stay consistent, and the replayed events name exactly what each medium holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

pytest.importorskip("safetensors")

from kvcache_core.events import CachedBlockIndex
from kvcache_core.tiers import DiskTier, HostTier
from tests.core.test_events import pool_hashes
from tests.core.test_prefix_caching import admit, assert_holds
from tests.core.test_tiers import BLOCK_BYTES, tiered

#: An operation: ("admit", prefix, suffix length, salt), ("release", index), ("gc",).
operations = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 9), st.sampled_from([None, "x"])),
        st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 9), st.sampled_from([None, "x"])),
        st.tuples(st.just("release"), st.integers(0, 5)),
        st.tuples(st.just("gc")),
    ),
    min_size=12,
    max_size=40,
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(script=operations, host_blocks=st.integers(1, 8), disk_blocks=st.integers(1, 24))
def test_pool_and_tiers_stay_exact_and_events_match_every_medium(
    tmp_path_factory: pytest.TempPathFactory, script: list[tuple[object, ...]], host_blocks: int, disk_blocks: int
) -> None:
    directory: Path = tmp_path_factory.mktemp("disk")
    host = HostTier(host_blocks * BLOCK_BYTES)
    disk = DiskTier(directory, disk_blocks * (BLOCK_BYTES + 2048))
    manager = tiered(10, host, disk)
    index = CachedBlockIndex()
    manager.subscribe(index)
    prefixes = [[prefix * 100 + position for position in range(8)] for prefix in range(4)]
    live: list[str] = []
    for step, operation in enumerate(script):
        if operation[0] == "admit":
            _, prefix, suffix, salt = operation
            assert isinstance(prefix, int)
            assert isinstance(suffix, int)
            assert salt is None or isinstance(salt, str)
            while len(live) > 1:  # a small pool under steady pressure: the oldest request ends
                manager.deallocate(live.pop(0))
            prompt = prefixes[prefix] + list(range(5000 + step * 10, 5000 + step * 10 + suffix))
            try:
                handle = admit(manager, f"r{step}", prompt, cache_salt=salt)
            except MemoryError:
                continue
            assert_holds(manager, handle, prompt)
            live.append(f"r{step}")
        elif operation[0] == "release" and live:
            assert isinstance(operation[1], int)
            manager.deallocate(live.pop(operation[1] % len(live)))
        elif operation[0] == "gc":
            manager.gc()
        manager.check_invariants()
        assert index.hashes("pool") == pool_hashes(manager)
        assert index.hashes("host") == frozenset(host.hashes())
        assert index.hashes("disk") == frozenset(disk.hashes())
        assert host.used_bytes <= host.max_bytes
        assert disk.used_bytes <= disk.max_bytes
    target(float(sum(tier.hits for tier in manager.tier_stats())), label="blocks promoted")  # seek promotions
    manager.close()
    assert index.media() == []
    assert list(directory.iterdir()) == []
