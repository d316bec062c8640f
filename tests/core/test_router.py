"""KvAwareRouter: the process holding a prompt's longest cached prefix gets it, load breaks
ties, gaps and restarted publishers are replayed, streams hashing otherwise are refused by name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kvcache_core import CacheConfig, create_manager
from kvcache_core.errors import InvalidArgumentError
from kvcache_core.offload.events import BlockStored
from kvcache_core.offload.publisher import ZmqEventPublisher
from kvcache_core.offload.router import KvAwareRouter
from kvcache_core.paging.prefix import hash_block, namespace_root
from tests.fleet_support import members
from tests.redis_support import serve_once, wait_until

BLOCK = 4


def prompt(first: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of distinct tokens from ``first``, and one token more."""
    return list(range(first, first + blocks * BLOCK + 1))


@pytest.fixture
def router() -> Iterator[KvAwareRouter]:
    with KvAwareRouter(block_size=BLOCK, model_id="router-test") as router:
        yield router


def test_the_process_holding_the_longest_prefix_gets_the_prompt_and_a_restart_is_replayed(
    router: KvAwareRouter,
) -> None:
    fleet = members(3)
    try:
        for index, member in enumerate(fleet):
            router.add_stream(f"w{index}", member.endpoint, replay_endpoint=member.replay_endpoint, block_size=BLOCK)
        shared = prompt(1, 8)
        fleet[0].serve(shared[: 2 * BLOCK + 1])  # two blocks of it
        fleet[1].serve(shared)  # all eight
        fleet[2].serve(prompt(500, 3))  # another prompt
        assert wait_until(lambda: router.sync() >= 0 and router.cached_tokens(shared)["w1"] == 8 * BLOCK)
        choice = router.route(shared)
        assert (choice.stream, choice.cached_tokens) == ("w1", 8 * BLOCK)
        assert choice.cached == {"w0": 2 * BLOCK, "w1": 8 * BLOCK, "w2": 0}
        assert router.route(prompt(500, 3)).stream == "w2"

        fleet[1].restart()  # a new process on the same ports: its cache is gone
        fresh = prompt(900, 5)
        fleet[1].serve(fresh)
        assert wait_until(lambda: router.sync() >= 0 and router.cached_tokens(fresh)["w1"] == 5 * BLOCK)
        assert router.streams["w1"].restarts >= 1
        assert router.route(fresh).stream == "w1"
        assert router.route(shared).stream == "w0", "the restarted process still counts its old prefix"
    finally:
        for member in fleet:
            member.stop()


def manager_with_publisher() -> tuple[object, ZmqEventPublisher]:
    config = CacheConfig(
        num_layers=1, num_heads=1, head_dim=4, num_blocks=64, block_size=BLOCK,
        enable_prefix_caching=True, model_id="router-test",
    )  # fmt: skip
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    manager = create_manager("numpy", config)
    manager.subscribe(publisher)
    return manager, publisher


def test_batches_published_before_the_subscription_are_replayed(router: KvAwareRouter) -> None:
    manager, publisher = manager_with_publisher()
    with publisher:
        serve_once(manager, "a", tuple(prompt(1, 3)))  # before the router listens
        router.add_stream("early", publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
        router.sync()
        assert router.cached_tokens(prompt(1, 3))["early"] == 3 * BLOCK
        assert router.streams["early"].expected == publisher.next_sequence


def test_a_tie_goes_to_the_least_loaded(router: KvAwareRouter) -> None:
    first, first_publisher = manager_with_publisher()
    second, second_publisher = manager_with_publisher()
    with first_publisher, second_publisher:
        for manager in (first, second):
            serve_once(manager, "a", tuple(prompt(1, 2)))
        router.add_stream("a", first_publisher.endpoint, replay_endpoint=first_publisher.replay_endpoint)
        router.add_stream("b", second_publisher.endpoint, replay_endpoint=second_publisher.replay_endpoint)
        router.sync()
        assert router.route(prompt(1, 2), loads={"a": 5, "b": 1}).stream == "b"
        assert router.route(prompt(1, 2), loads={"a": 0, "b": 1}).stream == "a"
        picks = {router.route(prompt(1, 2)).stream for _ in range(4)}  # by the prompts routed so far
        assert picks == {"a", "b"}


def test_a_shared_medium_does_not_count(router: KvAwareRouter) -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as publisher:
        router.add_stream("s", publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
        tokens = prompt(1, 1)
        block_hash = hash_block(namespace_root("router-test"), tokens[:BLOCK], None)
        publisher.publish([BlockStored((block_hash,), None, tuple(tokens[:BLOCK]), BLOCK, medium="redis")])
        router.sync()
        assert router.cached_tokens(tokens)["s"] == 0
        publisher.publish([BlockStored((block_hash,), None, tuple(tokens[:BLOCK]), BLOCK, medium="host")])
        router.sync()
        assert router.cached_tokens(tokens)["s"] == BLOCK


def test_a_stream_declaring_another_block_size_or_hash_is_refused_by_name(router: KvAwareRouter) -> None:
    with pytest.raises(InvalidArgumentError, match="stream 'big' hashes blocks of 16 tokens"):
        router.add_stream("big", "tcp://127.0.0.1:1", block_size=16)
    with pytest.raises(InvalidArgumentError, match="stream 'md5' hashes with 'md5'"):
        router.add_stream("md5", "tcp://127.0.0.1:1", hash_algorithm="md5")


def test_a_stream_publishing_blocks_of_another_size_is_refused_by_name(router: KvAwareRouter) -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as publisher:
        router.add_stream("odd", publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
        router.add_stream("ok", "tcp://127.0.0.1:1")
        publisher.publish([BlockStored((b"x" * 32,), None, tuple(range(8)), 8)])
        router.sync()
        assert "stream 'odd' publishes blocks of 8 tokens" in router.refused["odd"]
        assert router.route(prompt(1, 1)).stream == "ok"
