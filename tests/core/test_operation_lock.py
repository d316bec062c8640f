"""The manager's operation lock: entering it is all or nothing, whatever is raised midway."""

from __future__ import annotations

import threading

import pytest

from kvcache_core.offload.events import EventHub, OperationLock


class InterruptedLock:
    """An RLock whose next ``acquire`` raises ``KeyboardInterrupt``, as a signal handler
    does: after the lock was taken (``taken=True``) or while waiting for it."""

    def __init__(self, *, taken: bool, counts: bool = True) -> None:
        self.inner = threading.RLock()
        self.taken = taken
        self.armed = False
        if counts:
            self._recursion_count = self.count

    def acquire(self) -> bool:
        if self.armed:
            self.armed = False
            if self.taken:
                self.inner.acquire()
            raise KeyboardInterrupt
        return self.inner.acquire()

    def release(self) -> None:
        self.inner.release()

    def count(self) -> int:
        return int(getattr(self.inner, "_recursion_count")())  # noqa: B009

    def _is_owned(self) -> bool:
        return self.count() > 0


class InterruptedHub(EventHub):
    """A hub whose next change of ``depth`` raises ``KeyboardInterrupt`` before it is made."""

    def __init__(self) -> None:
        self.armed = False
        self._depth = 0
        super().__init__(block_size=4)

    @property
    def depth(self) -> int:
        return self._depth

    @depth.setter
    def depth(self, value: int) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self._depth = value


def free_for_another_thread(lock: threading.RLock | InterruptedLock) -> bool:
    """Whether another thread can take ``lock`` now (it gives it back at once)."""
    inner = lock.inner if isinstance(lock, InterruptedLock) else lock
    taken: list[bool] = []

    def take() -> None:
        got = inner.acquire(blocking=False)
        if got:
            inner.release()
        taken.append(got)

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return taken == [True]


def operation_lock(hub: EventHub, lock: InterruptedLock | None = None) -> OperationLock:
    operation = OperationLock(hub)
    if lock is not None:
        operation._lock = lock  # type: ignore[assignment]
    return operation


@pytest.mark.parametrize("counts", [True, False], ids=["recursion count", "ownership only"])
def test_an_interrupt_right_after_the_lock_is_taken_gives_it_back(counts: bool) -> None:
    hub = EventHub(block_size=4)
    lock = InterruptedLock(taken=True, counts=counts)
    operation = operation_lock(hub, lock)
    lock.armed = True
    with pytest.raises(KeyboardInterrupt), operation:
        pytest.fail("the body ran after entering failed")
    assert lock.count() == 0
    assert hub.depth == 0
    assert free_for_another_thread(lock)


def test_an_interrupt_while_the_depth_is_counted_gives_the_lock_back() -> None:
    hub = InterruptedHub()
    operation = OperationLock(hub)
    hub.armed = True
    with pytest.raises(KeyboardInterrupt), operation:
        pytest.fail("the body ran after entering failed")
    assert hub.depth == 0
    assert free_for_another_thread(getattr(operation, "_lock"))  # noqa: B009


def test_an_interrupted_wait_keeps_the_outer_hold_of_the_same_thread() -> None:
    hub = EventHub(block_size=4)
    lock = InterruptedLock(taken=False)
    operation = operation_lock(hub, lock)
    with operation:
        lock.armed = True
        with pytest.raises(KeyboardInterrupt), operation:
            pytest.fail("the body ran after entering failed")
        assert lock.count() == 1
        assert hub.depth == 1
        assert not free_for_another_thread(lock)
    assert hub.depth == 0
    assert free_for_another_thread(lock)
