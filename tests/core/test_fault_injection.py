"""The kit's fault-injection run finds a manager that is not transactional, and reports
what it covered (the kit itself runs it on every backend)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcache_core.discovery import get_backend
from kvcache_core.handle import RequestState
from kvcache_core.paging.sequences import SequenceBlocks
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.faults import STORAGE_CALLS, run_fault_injection


def numpy_backend() -> BackendUnderTest:
    return BackendUnderTest("numpy", get_backend("numpy"))


def test_the_run_covers_every_storage_call_before_and_after_it() -> None:
    report = run_fault_injection(numpy_backend())
    assert report.failures == ()
    assert report.kinds == set(STORAGE_CALLS)
    assert report.injections == 2 * len(report.storage_calls) >= 40


class Interrupted(KeyboardInterrupt):
    """Ctrl-C arriving inside a storage call."""


def test_an_interrupt_inside_any_storage_call_leaks_nothing_either() -> None:
    report = run_fault_injection(numpy_backend(), Interrupted)
    assert report.failures == ()
    assert report.injections == 2 * len(report.storage_calls)


def test_the_run_finds_a_copy_on_write_that_keeps_its_copy_when_the_storage_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def leaky_copy_on_write(self: SequenceBlocks, state: RequestState[Any], logicals: list[list[int]]) -> None:
        pool = self.pool
        for logical in logicals[0]:  # the pre-fix order: take, call, no give-back on failure
            source = state.table.physical_block(logical)
            (copy,) = pool.take(1, None, None, "copy")
            pool.storage.copy_blocks(np.array([source]), np.array([copy]))
            pool.carry_slots(source, copy, self.block_size)
            state.table.replace_block(logical, copy)
            pool.release([source], None)

    monkeypatch.setattr(SequenceBlocks, "copy_on_write", leaky_copy_on_write)
    report = run_fault_injection(numpy_backend())
    assert any("before storage call" in line and "copy_blocks" in line for line in report.failures), report.failures
    assert any("reference count 1 but 0 owners" in line for line in report.failures), report.failures
