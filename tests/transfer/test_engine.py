"""The NIXL engine's agent start (``kvcache_core.transfer.engine``): its progress thread waits
for events instead of spinning, whatever NIXL's Python wrapper assigns."""

from __future__ import annotations

import types
from typing import Any

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
