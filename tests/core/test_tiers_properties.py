"""Property: whatever the workload, the pool and its tiers serve every request bit-exact, the
records stay consistent, and the replayed events name exactly what each medium holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("safetensors")

from kvcache_core.offload.tiers import DiskTier, HostTier
from tests.core.support import BLOCK_BYTES, Workload, admit, assert_holds, tiered

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
