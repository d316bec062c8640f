"""The soak run on the NumPy reference: 8 threads x 5,000 mixed operations (prefix caching,
fork, rewrite, swap) on one manager with a checker thread at full size (``KVCACHE_TEST_SIZE=full``),
x 2,000 in an everyday run. The kit runs a smaller soak on every backend;
``KVCACHE_SOAK_OPERATIONS`` resizes this one."""

from __future__ import annotations

import os

from kvcache_core.discovery import get_backend
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.soak import run_soak
from tests.sizes import sized

OPERATIONS = int(os.environ.get("KVCACHE_SOAK_OPERATIONS", str(sized(full=5000, everyday=2000))))


def test_eight_threads_of_mixed_operations_end_clean() -> None:
    report = run_soak(BackendUnderTest("numpy", get_backend("numpy")), threads=8, operations=OPERATIONS)
    assert report.errors == []
    assert report.mismatches == []
    assert report.leaked_blocks == 0
    assert report.invariant_checks > 0
    assert report.evictions > 0
    done = report.operations
    for operation in (
        "prefix hit",
        "step",
        "truncate",
        "fork",
        "rewrite",
        "swap out",
        "swap in",
        "verify",
        "deallocate",
    ):
        assert done.get(operation, 0) > 0, f"the soak never ran {operation!r}: {done}"
    print(
        f"soak: {sum(done.values())} operations {dict(sorted(done.items()))}, {report.invariant_checks} checks, {report.evictions} evictions"
    )
