"""Property: whatever the workload, the pool and its tiers serve every request bit-exact, the
records stay consistent, and the replayed events name exactly what each medium holds."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

pytest.importorskip("safetensors")

from kvcache_core.events import CachedBlockIndex
from kvcache_core.testing.hybrid import pool_hashes, tier_hashes
from kvcache_core.tiers import DiskTier, HostTier, OffloadTier
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
    prefixes = [[prefix * 100 + position for position in range(8)] for prefix in range(4)]

    def admission(step: int, operation: tuple[object, ...]) -> tuple[list[int], dict[str, Any]]:
        _, prefix, suffix, salt = operation
        assert isinstance(prefix, int)
        assert isinstance(suffix, int)
        assert salt is None or isinstance(salt, str)
        return prefixes[prefix] + list(range(5000 + step * 10, 5000 + step * 10 + suffix)), {"cache_salt": salt}

    workload = Workload(admission, admit, assert_holds, "blocks promoted")
    workload.run(tiered(10, host, disk), host, disk, directory, script)


@dataclass(frozen=True)
class Workload:
    """Runs a script of operations on a manager with a host and a disk tier, checking after
    each one the invariants, the requests' K/V and that the replayed events name exactly what
    each medium holds.

    ``admission(step, operation)`` turns an ``("admit", ...)`` operation into a prompt and
    the admit's keyword arguments; ``admit`` and ``holds`` admit a request and check its K/V;
    with ``strict`` a tier that fails (a warning) fails the run."""

    admission: Callable[[int, tuple[object, ...]], tuple[list[int], dict[str, Any]]]
    admit: Callable[..., Any]
    holds: Callable[[Any, Any, list[int]], None]
    label: str
    strict: bool = False

    def run(
        self, manager: Any, host: OffloadTier, disk: OffloadTier, directory: Path, script: list[tuple[object, ...]]
    ) -> None:
        index = CachedBlockIndex()
        manager.subscribe(index)
        live: list[str] = []
        for step, operation in enumerate(script):
            if operation[0] == "admit":
                prompt, options = self.admission(step, operation)
                while len(live) > 1:  # a small pool under steady pressure: the oldest request ends
                    manager.deallocate(live.pop(0))
                try:
                    with warnings.catch_warnings():
                        if self.strict:
                            warnings.simplefilter("error")  # no tier may fail in this workload
                        handle = self.admit(manager, f"r{step}", prompt, **options)
                except MemoryError:
                    continue
                self.holds(manager, handle, prompt)
                live.append(f"r{step}")
            elif operation[0] == "release" and live:
                assert isinstance(operation[1], int)
                manager.deallocate(live.pop(operation[1] % len(live)))
            elif operation[0] == "gc":
                manager.gc()
            manager.check_invariants()
            assert index.hashes("pool") == pool_hashes(manager)
            assert index.hashes("host") == tier_hashes(host)
            assert index.hashes("disk") == tier_hashes(disk)
            assert host.used_bytes <= host.max_bytes
            assert disk.used_bytes <= disk.max_bytes
        target(float(sum(tier.hits for tier in manager.tier_stats())), label=self.label)  # seek promotions
        manager.close()
        assert index.media() == []
        assert list(directory.iterdir()) == []
