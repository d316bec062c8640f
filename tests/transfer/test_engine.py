"""The NIXL engine (``kvcache_core.transfer.engine``): its agent's progress thread waits for
events instead of spinning, whatever NIXL's Python wrapper assigns; chunks that follow one
another on both sides travel as one descriptor."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from kvcache_core.transfer import engine


class _Config:
    """A binding's agent config: ``pthrDelay`` a data descriptor, as pybind11 makes it."""

    def __init__(self) -> None:
        self._delay = -1

    def _get(self) -> int:
        return self._delay

    def _set(self, value: int) -> None:
        self._delay = value

    pthrDelay = property(_get, _set)  # noqa: N815 (the binding's name)


def _fake_api(seen: list[int]) -> Any:
    bindings = types.SimpleNamespace(nixlAgentConfig=_Config)

    def nixl_agent(name: str, config: object) -> object:
        built = bindings.nixlAgentConfig()
        built.pthrDelay = 0  # what NIXL's wrapper assigns
        seen.append(built.pthrDelay)
        return types.SimpleNamespace(name=name, config=config)

    return types.SimpleNamespace(nixlBind=bindings, nixl_agent=nixl_agent, nixl_agent_config=_config)


def _config(backends: list[str]) -> tuple[str, ...]:
    return tuple(backends)


def test_the_progress_thread_waits_for_events_and_the_binding_is_restored() -> None:
    seen: list[int] = []
    api = _fake_api(seen)
    agent: Any = engine._start_agent(api, "a")  # pyright: ignore[reportPrivateUsage]
    assert seen == [engine.PROGRESS_WAIT_US]
    assert agent.name == "a"
    assert api.nixlBind.nixlAgentConfig is _Config


def test_a_nixl_without_the_field_starts_as_is() -> None:
    started: list[str] = []

    def nixl_agent(name: str, config: object) -> str:
        started.append(name)
        return name

    api = types.SimpleNamespace(
        nixlBind=types.SimpleNamespace(nixlAgentConfig=object), nixl_agent=nixl_agent, nixl_agent_config=_config
    )
    assert engine._start_agent(api, "b") == "b"  # pyright: ignore[reportPrivateUsage]
    assert started == ["b"]


def test_chunks_that_follow_one_another_on_both_sides_are_read_as_one() -> None:
    # (address, length, device): rows 0-2 run on both sides, row 3 follows locally only,
    # row 4 follows row 3 on both sides, row 5 is on another device remotely.
    local = np.array(
        [[100, 10, 0], [110, 10, 0], [120, 10, 0], [130, 10, 0], [140, 10, 0], [150, 10, 0]], dtype=np.uint64
    )
    remote = np.array(
        [[500, 10, 0], [510, 10, 0], [520, 10, 0], [900, 10, 0], [910, 10, 0], [920, 10, 1]], dtype=np.uint64
    )
    merged_local, merged_remote = engine.coalesce(local, remote)
    assert merged_local.tolist() == [[100, 30, 0], [130, 20, 0], [150, 10, 0]]
    # A read in pieces: a piece's first row (1, 4) starts a chunk whatever it follows.
    assert engine._chunk_starts(local, remote, [1, 4]).tolist() == [0, 1, 3, 4, 5]  # pyright: ignore[reportPrivateUsage]
    assert merged_remote.tolist() == [[500, 30, 0], [900, 20, 0], [920, 10, 1]]
    assert local[:, 1].tolist() == [10] * 6  # the inputs are left as they were
    lone = local[:1]
    assert engine.coalesce(lone, remote[:1])[0] is lone
    uneven = remote.copy()
    uneven[0, 1] = 5  # lengths that differ between the sides: nothing is merged
    assert engine.coalesce(local, uneven)[1] is uneven
