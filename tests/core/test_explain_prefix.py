"""explain_prefix and ``kvcache explain``: where a prompt's prefix is, block by block, and why
its chain stops."""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcache_core import CacheConfig, create_manager
from kvcache_core.cli import main
from kvcache_core.errors import InvalidArgumentError
from kvcache_core.offload.explain import EvictionLog
from kvcache_core.offload.tiers import HostTier
from tests.redis_support import RedisServer, fast_tier, fleet_config, serve_once, unique_prefix
from tests.redis_support import serve_prompt as serve_in_fleet

PROMPT = tuple(range(1, 15))  # three full blocks of 4, two tokens more


@pytest.fixture(autouse=True)
def _quiet_misses() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def config(**changes: object) -> CacheConfig:
    settings: dict[str, object] = {
        "num_layers": 1, "num_heads": 1, "head_dim": 4, "num_blocks": 8, "block_size": 4,
        "enable_prefix_caching": True, "model_id": "m",
    }  # fmt: skip
    settings.update(changes)
    return CacheConfig(**settings)  # type: ignore[arg-type]


def test_a_cached_prompt_is_found_block_by_block_up_to_its_partial_block() -> None:
    with create_manager("numpy", config()) as manager:
        serve_once(manager, "a", PROMPT)
        explained = manager.explain_prefix(PROMPT)
    assert [place.medium for place in explained.blocks] == ["pool", "pool", "pool"]
    assert explained.cached_tokens == 12
    assert explained.reason == "end of prompt"
    assert "pool" in str(explained)


def test_blocks_in_a_tier_are_named_by_the_tier() -> None:
    with create_manager("numpy", config(), tiers=[HostTier(1 << 20)]) as manager:
        serve_once(manager, "a", PROMPT)
        manager.gc()  # every cached block demoted to the host tier
        explained = manager.explain_prefix(PROMPT)
    assert [place.medium for place in explained.blocks] == ["host", "host", "host"]


def test_an_unknown_prompt_stops_at_its_first_block_not_cached() -> None:
    with create_manager("numpy", config()) as manager:
        explained = manager.explain_prefix(PROMPT)
    assert [place.medium for place in explained.blocks] == [None]
    assert (explained.cached_tokens, explained.reason) == (0, "not cached")


def test_a_prompt_cached_under_another_salt_says_so() -> None:
    with create_manager("numpy", config()) as manager:
        serve_once(manager, "a", PROMPT, "tenant-a")
        explained = manager.explain_prefix(PROMPT, salt="tenant-b")
    assert explained.reason == "other salt"
    assert explained.cached_tokens == 0


def test_a_block_the_pool_let_go_is_explained_as_evicted_given_a_log() -> None:
    log = EvictionLog()
    with create_manager("numpy", config(num_blocks=4)) as manager:
        manager.subscribe(log)
        serve_once(manager, "a", PROMPT)
        serve_once(manager, "b", tuple(range(100, 114)))  # takes every block: the first prompt's go
        assert manager.explain_prefix(PROMPT, evicted=log).reason == "evicted"
        assert manager.explain_prefix(PROMPT).reason == "not cached"


def test_explaining_changes_nothing() -> None:
    with create_manager("numpy", config(), tiers=[HostTier(1 << 20)]) as manager:
        serve_once(manager, "a", PROMPT)
        manager.gc()
        serve_once(manager, "b", PROMPT[:9])  # two blocks back in the pool, one in the tier
        before = (manager.stats(), manager.tier_stats())
        manager.explain_prefix(PROMPT)
        assert (manager.stats(), manager.tier_stats()) == before


def test_bad_token_ids_are_refused_by_name() -> None:
    with create_manager("numpy", config()) as manager, pytest.raises(InvalidArgumentError, match="token"):
        manager.explain_prefix([1, -2, 3])


# -- a fleet's store -----------------------------------------------------------------------


def explain_in_store(
    server: RedisServer, prefix: str, prompt: tuple[int, ...], tmp_path: Path, *options: str
) -> tuple[int, str]:
    """``kvcache explain`` of ``prompt`` against the fleet pool's geometry; status and output."""
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(list(prompt)))
    out = io.StringIO()
    argv = ["explain", str(path), "--redis", server.url, "--prefix", prefix, "--num-layers", "2", "--num-heads", "2"]
    argv += ["--head-dim", "8", "--dtype", "float32", *options]
    return main(argv, out=out), out.getvalue()


def test_the_command_shows_the_blocks_a_fleet_store_holds(redis_server: RedisServer, tmp_path: Path) -> None:
    prefix = unique_prefix()
    serve_in_fleet(redis_server.url, prefix, list(PROMPT), None, "fleet-test")
    status, shown = explain_in_store(
        redis_server, prefix, PROMPT, tmp_path, "--model-id", "fleet-test", "--block-size", "4"
    )
    assert status == 0, shown
    assert shown.count(" redis\n") == 3
    assert "12 of 14 prompt tokens cached" in shown
    assert "end of prompt" in shown


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (("--model-id", "fleet-test", "--block-size", "8"), "block size mismatch"),
        (("--model-id", "another-model", "--block-size", "4"), "other namespace"),
        (("--model-id", "fleet-test", "--block-size", "4", "--salt", "tenant"), "other salt"),
        (("--model-id", "fleet-test", "--block-size", "4", "--dtype", "float16"), "other geometry"),
    ],
)
def test_the_command_says_why_a_store_holding_the_prompt_misses_it(
    redis_server: RedisServer, tmp_path: Path, options: tuple[str, ...], reason: str
) -> None:
    prefix = unique_prefix()
    serve_in_fleet(redis_server.url, prefix, list(PROMPT), None, "fleet-test")
    status, shown = explain_in_store(redis_server, prefix, PROMPT, tmp_path, *options)
    assert status == 0, shown
    assert f"the chain stops: {reason}" in shown, shown


def test_the_command_reports_a_store_that_does_not_answer(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    path = tmp_path / "prompt.txt"
    path.write_text("1 2 3 4 5 6 7 8 9")
    out = io.StringIO()
    argv = ["explain", str(path), "--redis", "redis://127.0.0.1:1/0", "--num-layers", "1", "--num-heads", "1"]
    status = main([*argv, "--head-dim", "4", "--block-size", "4", "--timeout", "0.5"], out=out)
    assert status == 1
    assert "could not look blocks up" in out.getvalue()


def test_a_fleet_store_and_a_manager_behind_it_agree(redis_server: RedisServer) -> None:
    tier = fast_tier(redis_server.url)
    with create_manager("numpy", fleet_config(), tiers=[tier]) as manager:
        serve_once(manager, "a", PROMPT)
        manager.gc()
        assert tier.flush(10.0)
        explained = manager.explain_prefix(PROMPT)
    tier.close()
    assert [place.medium for place in explained.blocks] == ["redis", "redis", "redis"]


@pytest.mark.parametrize("bad", [None, "abc", [1, -2], [1.5]])
def test_bad_token_ids_are_refused_by_name_and_change_nothing(bad: object) -> None:
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=4, num_blocks=8, block_size=4, enable_prefix_caching=True)
    with create_manager("numpy", config) as manager:
        before = manager.stats()
        with pytest.raises(InvalidArgumentError, match="explain_prefix's prompt_token_ids"):
            manager.explain_prefix(bad)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        assert manager.stats() == before
