"""RedisTier against a real redis-server: a prefix shared by processes, bit for bit; salts and
namespaces apart; one round trip per prompt; writes that never block; a server down, slow,
killed or hostile is a counted miss, never a failed request or a leak."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core import AllocationRequest, CacheConfig, create_manager
from kvcache_core.errors import InvalidArgumentError
from kvcache_core.offload.events import BlockStored, CacheEvent
from kvcache_core.offload.file_header import parse_container
from kvcache_core.offload.prefix_file import decode_blocks, encode_blocks
from kvcache_core.offload.redis_tier import RedisTier, create_redis_tier, record_format_tag
from kvcache_core.offload.tiers import OffloadTier
from kvcache_core.paging.prefix import hash_block, namespace_root
from tests.redis_support import (
    RedisServer,
    fast_tier,
    fleet_config,
    run_member,
    unique_prefix,
    wait_until,
)
from tests.redis_support import (
    serve_once as serve,
)

PROMPT = tuple(range(1, 15))  # 14 tokens: three full blocks of 4 (the last token is always computed)


@pytest.fixture(autouse=True)
def _quiet_misses() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # every counted miss warns
        yield


def demoted(manager: Any, tier: RedisTier) -> None:
    """Every cached block of ``manager`` written to the server."""
    manager.gc()
    assert tier.flush(10.0), tier.stats()


# -- sharing ---------------------------------------------------------------------------------


def test_a_second_process_computes_only_what_the_first_did_not_cache_bit_exact(redis_server: RedisServer) -> None:
    prefix = unique_prefix()
    first = run_member(redis_server.url, prefix, list(PROMPT))
    second = run_member(redis_server.url, prefix, [*PROMPT, *range(40, 48)])
    assert first["cached"] == 0
    assert first["written"] == 3
    assert second["cached"] == 12, "the second process did not map the first one's three blocks"
    assert second["computed"] == len(PROMPT) + 8 - 12
    assert second["exact"], "the K/V mapped from the tier differ from what the first process computed"


def member(url: str, prefix: str, model_id: str = "fleet-test") -> tuple[Any, RedisTier]:
    """A fleet member in this process: a manager behind its own tier object on ``prefix``."""
    tier = RedisTier(url, 1 << 24, prefix=prefix, deadline_s=1.0)
    return create_manager("numpy", fleet_config(model_id), tiers=[tier]), tier


def shared_then_served(url: str, first: tuple[str | None, str], second: tuple[str | None, str]) -> int:
    """One member serves and demotes :data:`PROMPT` with ``(salt, model_id)`` ``first``;
    the tokens another member, with ``second``, maps from the store."""
    prefix = unique_prefix()
    writer, writer_tier = member(url, prefix, first[1])
    with writer:
        serve(writer, "a", PROMPT, first[0])
        demoted(writer, writer_tier)
    reader, reader_tier = member(url, prefix, second[1])
    with reader:
        cached = serve(reader, "b", PROMPT, second[0])
    writer_tier.close()
    reader_tier.close()
    return cached


def test_a_salt_keeps_tenants_apart(redis_server: RedisServer) -> None:
    assert shared_then_served(redis_server.url, ("tenant-a", "m"), ("tenant-b", "m")) == 0
    assert shared_then_served(redis_server.url, ("tenant-a", "m"), (None, "m")) == 0
    assert shared_then_served(redis_server.url, ("tenant-a", "m"), ("tenant-a", "m")) == 12


def test_a_namespace_keeps_models_apart(redis_server: RedisServer) -> None:
    assert shared_then_served(redis_server.url, (None, "model-a"), (None, "model-b")) == 0
    assert shared_then_served(redis_server.url, (None, "model-a"), (None, "model-a")) == 12


def test_a_record_another_member_rewrote_is_served(redis_server: RedisServer) -> None:
    config = fleet_config()
    tier = fast_tier(redis_server.url)
    client = redis_server.client()
    with create_manager("numpy", config, tiers=[tier]) as manager:
        serve(manager, "a", PROMPT)
        demoted(manager, tier)
        for key in tier.hashes():  # another member computed the same blocks, a little differently
            server_key = tier.server_key(key, None)
            value = client.get(server_key)
            (record,) = decode_blocks(parse_container(value, "v"), value, config, Path("v"), chained=False)
            other = dataclasses.replace(record, values=record.values + np.float32(1e-3))
            client.set(server_key, encode_blocks(config, [other]))
        tier.clear()
        assert serve(manager, "b", PROMPT) == 12
        assert manager.tier_stats()[0].errors == 0
    tier.close()


def test_keys_carry_the_namespace_format_salt_hash_and_group(redis_server: RedisServer) -> None:
    config = fleet_config("ns/1")
    tier = fast_tier(redis_server.url)
    with create_manager("numpy", config, tiers=[tier]) as manager:
        serve(manager, "r", PROMPT, salt="s")
        demoted(manager, tier)
        keys = sorted(redis_server.client().keys(f"{tier.server_key(b'0' * 32, None).split(b':')[0].decode()}:*"))
    tier.close()
    assert len(keys) == 3
    _prefix, namespace, tag, salt, block_hash, group = keys[0].decode().split(":")
    assert namespace == "mns%2F1"
    assert tag == record_format_tag(config)
    assert group == "0"
    assert salt != "-"
    assert len(block_hash) == 64


def test_a_value_is_the_portable_record_with_its_checksum(redis_server: RedisServer) -> None:
    config = fleet_config()
    tier = fast_tier(redis_server.url)
    with create_manager("numpy", config, tiers=[tier]) as manager:
        serve(manager, "r", PROMPT)
        demoted(manager, tier)
        key = tier.hashes()[0]
        value = redis_server.client().get(tier.server_key(key, None))
    tier.close()
    source = "a value read back"
    (record,) = decode_blocks(parse_container(value, source), value, config, Path(source), chained=False)
    assert record.key == key
    assert record.keys.dtype == np.float32


def test_a_prompt_is_looked_up_in_one_round_trip(redis_server: RedisServer) -> None:
    config = fleet_config()
    writer = fast_tier(redis_server.url)
    long_prompt = tuple(range(1, 31))  # seven full blocks
    with create_manager("numpy", config, tiers=[writer]) as manager:
        serve(manager, "r", long_prompt)
        demoted(manager, writer)
    reader = fast_tier(redis_server.url, prefix=writer.server_key(b"0" * 32, None).split(b":")[0].decode())
    with create_manager("numpy", config, tiers=[reader]) as manager:
        handle = manager.allocate(AllocationRequest("r", 0, prompt_token_ids=long_prompt))
        assert handle.num_cached_tokens() == 28
        assert reader.stats().lookups == 1, reader.stats()
        assert manager.tier_stats()[0].hits == 7
    writer.close()
    reader.close()


def test_the_figures_and_events_name_the_tier_redis(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, 1 << 24, prefix=unique_prefix())
    events: list[CacheEvent] = []
    with create_manager("numpy", fleet_config(), tiers=[tier]) as manager:
        manager.subscribe(events.append)
        serve(manager, "r", PROMPT)
        demoted(manager, tier)
        (stats,) = manager.tier_stats()
    tier.close()
    assert stats.name == "redis"
    assert stats.demotions == 3
    assert stats.blocks == 3
    assert any(isinstance(event, BlockStored) and event.medium == "redis" for event in events)


def test_a_record_lives_for_its_ttl(redis_server: RedisServer) -> None:
    tier = fast_tier(redis_server.url, ttl_s=30)
    with create_manager("numpy", fleet_config(), tiers=[tier]) as manager:
        serve(manager, "r", PROMPT)
        demoted(manager, tier)
        ttl_ms = redis_server.client().pttl(tier.server_key(tier.hashes()[0], None))
    tier.close()
    assert 0 < ttl_ms <= 30_000


def test_connection_options_reach_the_client(redis_server: RedisServer) -> None:
    tier = fast_tier(redis_server.url, client_name="kvcache-test-client")
    with create_manager("numpy", fleet_config(), tiers=[tier]) as manager:
        serve(manager, "r", PROMPT)
        serve(manager, "s", PROMPT)  # a lookup: the reader connects
        names = [client["name"] for client in redis_server.client().client_list()]
    tier.close()
    assert "kvcache-test-client" in names


@pytest.mark.parametrize(
    ("option", "value"),
    [("deadline_s", 0), ("ttl_s", float("nan")), ("queue_bytes", 0), ("prefix", "a:b"), ("max_bytes", -1)],
)
def test_bad_options_are_refused_by_name(option: str, value: object) -> None:
    pytest.importorskip("redis")
    settings: dict[str, Any] = {"max_bytes": 1 << 20, option: value}
    with pytest.raises(InvalidArgumentError, match=option):
        RedisTier("redis://127.0.0.1:1/0", **settings)


# -- failures ------------------------------------------------------------------------------


def test_a_full_write_queue_drops_the_block_counted(own_redis_server: RedisServer) -> None:
    config = fleet_config()
    tier = fast_tier(own_redis_server.url, queue_bytes=2 * config.bytes_per_block, write_timeout_s=5.0)
    with create_manager("numpy", config, tiers=[tier]) as manager:
        own_redis_server.pause()  # the first write hangs: the queue stays full
        serve(manager, "r", PROMPT)
        manager.gc()
        stats = tier.stats()
        own_redis_server.resume()
        assert stats.dropped == 1, stats
        assert stats.queued == 2, stats
        assert tier.flush(10.0)
    tier.close()


def test_a_slow_server_is_a_counted_miss_within_the_deadline(own_redis_server: RedisServer) -> None:
    config = fleet_config()
    tier = fast_tier(own_redis_server.url, deadline_s=0.2)
    with create_manager("numpy", config, tiers=[tier]) as manager:
        serve(manager, "a", PROMPT)
        demoted(manager, tier)
        tier.clear()  # forget what it wrote: the prompt must be read from the server
        own_redis_server.pause()
        try:
            assert serve(manager, "b", PROMPT) == 0, "a paused server gave a hit"
        finally:
            own_redis_server.resume()
        assert tier.stats().timeouts == 1
        assert manager.tier_stats()[0].errors >= 1
        manager.check_invariants()
    tier.close()


def test_killing_the_server_mid_run_serves_every_request_and_hits_resume_after_a_restart(
    own_redis_server: RedisServer,
) -> None:
    config = fleet_config()
    tier = fast_tier(own_redis_server.url)
    prompts = [tuple(range(100 * i, 100 * i + 14)) for i in range(4)]
    with create_manager("numpy", config, tiers=[tier]) as manager:
        for index, prompt in enumerate(prompts):
            serve(manager, f"warm{index}", prompt)
        demoted(manager, tier)
        own_redis_server.kill()
        for index, prompt in enumerate(prompts):  # every request served, as a miss
            assert serve(manager, f"down{index}", prompt) in (0, 12)
            manager.gc()
        manager.check_invariants()
        assert manager.stats().used_blocks == 0, "a request's blocks leaked"
        assert tier.stats().read_errors + tier.stats().skipped >= 1
        own_redis_server.start()  # empty, on the same port: the client reconnects by itself

        def hits_again() -> bool:
            serve(manager, "again", prompts[0])
            manager.gc()  # demoted to the restarted server (dropped while the breaker is open)
            tier.flush(5.0)
            return serve(manager, "check", prompts[0]) == 12

        assert wait_until(hits_again), tier.stats()
        manager.check_invariants()
    tier.close()


def another_geometry(good: bytes) -> bytes:
    """A well-formed record of the same hash for a pool of another head size."""
    other = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=4, block_size=4, model_id="fleet-test")
    source = "planted"
    (record,) = decode_blocks(parse_container(good, source), good, fleet_config(), Path(source), chained=False)
    smaller = (record.keys[..., :4].copy(), record.values[..., :4].copy())
    return encode_blocks(other, [dataclasses.replace(record, keys=smaller[0], values=smaller[1])])


@pytest.mark.parametrize(
    "planted", ["garbage", "truncated", "flipped", "too long", "another namespace", "another geometry", "a list"]
)
def test_a_hostile_record_in_the_server_is_refused_counted_and_deleted(redis_server: RedisServer, planted: str) -> None:
    config = fleet_config()
    tier = fast_tier(redis_server.url)
    client = redis_server.client()
    with create_manager("numpy", config, tiers=[tier]) as manager:
        serve(manager, "a", PROMPT)
        demoted(manager, tier)
        key = hash_block(namespace_root(config.model_id), PROMPT[:4], None)  # the prompt's first block
        server_key = tier.server_key(key, None)
        good: bytes = client.get(server_key)
        if planted == "a list":
            client.delete(server_key)
            client.rpush(server_key, b"x")
        else:
            value = {
                "garbage": b"\x00" * 64,
                "truncated": good[:-10],
                "flipped": good[:-1] + bytes([good[-1] ^ 0xFF]),
                "too long": good + b"\x00" * (1 << 20),
                "another namespace": good.replace(b"fleet-test", b"fleet-tesX"),
            }.get(planted) or another_geometry(good)
            assert len(value) != len(good) or value != good
            client.set(server_key, value)
        tier.clear()
        assert serve(manager, "b", PROMPT) == 0, "a hostile record went into the pool"
        manager.check_invariants()
        assert tier.stats().refused == 1, tier.stats()
        assert tier.flush(5.0)
        assert client.exists(server_key) == 0, "the refused record was not deleted"
    tier.close()


def test_the_registered_factory_builds_a_tier_from_its_options(redis_server: RedisServer) -> None:
    tier = create_redis_tier(1 << 20, url=redis_server.url, name="fleet", ttl_s=60)
    assert isinstance(tier, OffloadTier)
    assert (tier.name, tier.max_bytes) == ("fleet", 1 << 20)
    tier.close()
