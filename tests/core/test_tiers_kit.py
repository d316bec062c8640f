"""The tier kit's fault injection finds a tier chain that is not transactional or lets a
bad record in, and covers every tier call (the kit itself runs on every backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("safetensors")

from kvcache_core.discovery import get_backend
from kvcache_core.offload.guarded_tiers import GuardedTiers
from kvcache_core.paging.sequences import SequenceBlocks
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.faults import InjectedFaultError
from kvcache_core.testing.tiers import TIER_CALLS, Interrupted, host_tier_factory, run_tier_fault_injection


def numpy_backend() -> BackendUnderTest:
    return BackendUnderTest("numpy", get_backend("numpy"))


def test_an_interrupt_at_any_tier_call_of_a_hybrid_pool_leaks_nothing(tmp_path: Path) -> None:
    report = run_tier_fault_injection(
        numpy_backend(), host_tier_factory, tmp_path, Interrupted, storage_faults=False, hybrid=True
    )
    assert report.failures == ()
    assert report.tier_kinds == set(TIER_CALLS)
    assert report.tier_injections == 2 * len(report.tier_calls)
    assert report.promoted >= 5


def test_the_run_finds_a_promotion_that_keeps_its_blocks_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def keep_all(self: SequenceBlocks, held: list[list[int]], taken: list[list[int]]) -> None:
        """No rollback: an interrupted opening keeps every block it mapped or took."""

    monkeypatch.setattr(SequenceBlocks, "_give_back_opening", keep_all)
    report = run_tier_fault_injection(
        numpy_backend(), host_tier_factory, tmp_path, Interrupted, storage_faults=False, modes=("before",)
    )
    assert any("reference count 1 but 0 owners" in line for line in report.failures), report.failures


def test_the_run_finds_a_tier_exception_that_escapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unguarded(self: GuardedTiers, level: int, what: str, call: Any, failed: Any) -> Any:
        return call()

    monkeypatch.setattr(GuardedTiers, "guarded", unguarded)
    report = run_tier_fault_injection(
        numpy_backend(), host_tier_factory, tmp_path, storage_faults=False, modes=("before",)
    )
    assert any("raised InjectedFaultError" in line for line in report.failures), report.failures


def test_the_run_finds_a_corrupted_record_let_into_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_problem(self: GuardedTiers, level: int, record: object, key: bytes, parent: object = True) -> None:
        return None

    monkeypatch.setattr(GuardedTiers, "problem", no_problem)
    report = run_tier_fault_injection(
        numpy_backend(), host_tier_factory, tmp_path, InjectedFaultError, storage_faults=False, modes=("garbage",)
    )
    assert report.corruptions > 0, report.failures
    assert any("changed" in line for line in report.failures)
