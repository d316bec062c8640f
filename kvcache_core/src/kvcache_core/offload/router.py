"""Routing by cached prefix: :class:`KvAwareRouter` follows the event streams of several
managers (:class:`~kvcache_core.offload.publisher.ZmqEventPublisher`, vLLM's KV events) and
sends a prompt to the manager holding its longest cached prefix, the least loaded among equals.

Requires the ``events`` extra (pyzmq, msgpack)::

    router = KvAwareRouter(block_size=16, model_id="llama-3-8b")
    router.add_stream("gpu0", "tcp://10.0.0.1:5557", replay_endpoint="tcp://10.0.0.1:5558")
    router.add_stream("gpu1", "tcp://10.0.0.2:5557", replay_endpoint="tcp://10.0.0.2:5558")
    router.sync()                      # catch up (batches published before the subscription)
    choice = router.route(prompt_token_ids, salt=tenant)
    send_to(choice.stream)

* **Hashes** are recomputed as the managers compute them (:func:`~kvcache_core.paging.prefix.hash_block`
  from the namespace's root, with the request's salt): the router and the streams must agree
  on block size and hash algorithm. A stream declared with another block size or hash
  algorithm is refused when added; one whose events carry blocks of another size is
  refused when they arrive (its index is dropped; :attr:`KvAwareRouter.refused` says why,
  by name).
* **What counts** is what a manager holds itself: its pool and its private tiers, every
  medium but the ``shared_media`` (a ``RedisTier`` every manager reads: ``"redis"``).
* **Replay.** Batches carry sequence numbers; a gap is filled by asking the stream's replay
  socket from the first missing one; a stream whose numbers start again (its process
  restarted) is taken as a new manager: its index is dropped and rebuilt from its replay.
* **Load.** Among the streams holding the longest prefix, the least loaded is chosen: the
  ``loads`` given to :meth:`KvAwareRouter.route`, else the prompts routed to each so far.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import zmq

from kvcache_core.contract.config import AllocationRequest
from kvcache_core.contract.scalars import check_count
from kvcache_core.errors import CorruptEventBatchError, InvalidArgumentError
from kvcache_core.offload.events import BlockStored, CachedBlockIndex
from kvcache_core.offload.prefix_file import HASH_ALGORITHM
from kvcache_core.offload.publisher import END_OF_REPLAY, decode_event_batch
from kvcache_core.paging.prefix import hash_block, namespace_root

__all__ = ["KvAwareRouter", "RouteChoice", "StreamState"]

_SEQ = struct.Struct(">q")
#: Batches remembered per stream to tell a late duplicate from a restarted stream.
_RECENT = 4096
#: Batches one replay gives at most (the publisher retains at most its ``buffer_size``).
_MAX_REPLAY = 1 << 20


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """Where a prompt goes.

    Attributes:
        stream: the chosen stream's name. cached_tokens: the tokens of its cached prefix.
        cached: every live stream's cached prefix in tokens, by name.
    """

    stream: str
    cached_tokens: int
    cached: Mapping[str, int]


@dataclass
class StreamState:
    """One stream as the router follows it (its figures are read-only for callers).

    Attributes:
        name: its name. index: what it holds, rebuilt from its events.
        expected: the next sequence number (``None`` before the first batch).
        batches: batches applied. replays: replays asked. restarts: times its numbers
            started again. corrupt: payloads refused. routed: prompts routed to it.
    """

    name: str
    index: CachedBlockIndex = field(default_factory=CachedBlockIndex)
    expected: int | None = None
    batches: int = 0
    replays: int = 0
    restarts: int = 0
    corrupt: int = 0
    routed: int = 0
    recent: OrderedDict[int, bytes] = field(default_factory=lambda: OrderedDict[int, bytes]())


class KvAwareRouter:
    """Routes prompts to the manager holding their longest cached prefix (see the module docstring).

    Args:
        block_size: the managers' block size.
        model_id: their namespace (``CacheConfig.model_id``).
        hash_algorithm: the hash algorithm the router computes (the only one kvcache has:
            :data:`~kvcache_core.offload.prefix_file.HASH_ALGORITHM`).
        shared_media: media that every manager reads (a shared store): not counted.
        replay_timeout_s: the longest a replay may take before the router goes on without it.

    Raises:
        InvalidArgumentError: a bad block size, another hash algorithm, or a bad timeout.
    """

    def __init__(
        self,
        *,
        block_size: int,
        model_id: str | None = None,
        hash_algorithm: str = HASH_ALGORITHM,
        shared_media: Sequence[str] = ("redis",),
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.block_size = check_count(block_size, "block_size", 1)
        if hash_algorithm != HASH_ALGORITHM:
            raise InvalidArgumentError(f"the router hashes with {HASH_ALGORITHM!r}, not {hash_algorithm!r}")
        if not isinstance(replay_timeout_s, (int, float)) or not 0 < replay_timeout_s < 3600:
            raise InvalidArgumentError(f"replay_timeout_s must be seconds in (0, 3600), got {replay_timeout_s!r}")
        self.model_id = model_id
        self._root = namespace_root(model_id)
        self._shared = frozenset(shared_media)
        self._timeout_ms = max(1, round(replay_timeout_s * 1000))
        self._context = zmq.Context()
        self._streams: dict[str, StreamState] = {}
        self._subs: dict[str, zmq.Socket[bytes]] = {}
        self._replay_endpoints: dict[str, str | None] = {}
        self._topics: dict[str, bytes] = {}
        self._poller = zmq.Poller()
        #: Streams refused since they were added, by name, with the reason.
        self.refused: dict[str, str] = {}

    # -- streams ----------------------------------------------------------------------------

    def add_stream(
        self,
        name: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: bytes = b"kv-events",
        block_size: int | None = None,
        hash_algorithm: str = HASH_ALGORITHM,
    ) -> None:
        """Follow the event stream ``name`` published at ``endpoint``.

        Args:
            block_size, hash_algorithm: what the stream's manager declares (``None``: learnt
                from its events).

        Raises:
            InvalidArgumentError: the name is taken, or the stream declares another block
                size or hash algorithm than the router's (the message names the stream).
        """
        if not isinstance(name, str) or not name or name in self._streams:
            raise InvalidArgumentError(f"a stream needs a new, non-empty name, got {name!r}")
        if block_size is not None and block_size != self.block_size:
            raise InvalidArgumentError(
                f"stream {name!r} hashes blocks of {block_size} tokens; this router hashes blocks of {self.block_size}"
            )
        if hash_algorithm != HASH_ALGORITHM:
            raise InvalidArgumentError(
                f"stream {name!r} hashes with {hash_algorithm!r}; this router hashes with {HASH_ALGORITHM!r}"
            )
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(endpoint)
        self._poller.register(sub, zmq.POLLIN)
        self._subs[name] = sub
        self._topics[name] = topic
        self._replay_endpoints[name] = replay_endpoint
        self._streams[name] = StreamState(name)

    @property
    def streams(self) -> Mapping[str, StreamState]:
        """The streams followed, by name."""
        return self._streams

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply every batch that arrived (waiting at most ``timeout_s`` for a first one),
        replaying gaps; the batches applied."""
        applied = 0
        wait_ms = max(0, round(timeout_s * 1000))
        while True:
            ready = dict(self._poller.poll(wait_ms))
            if not ready:
                return applied
            wait_ms = 0
            for name, sub in self._subs.items():
                while sub in ready:
                    try:
                        frames = sub.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    applied += self._receive(name, frames)

    def sync(self) -> int:
        """Ask every stream for the batches it retains past the last one applied (those
        published before the subscription, or lost): one round trip per stream; the
        batches applied."""
        applied = self.poll()
        for name, state in self._streams.items():
            if name not in self.refused:
                applied += self._replay(name, state.expected or 0)
        return applied

    def close(self) -> None:
        """Close every socket (idempotent)."""
        for sub in self._subs.values():
            sub.close(linger=0)
        self._subs.clear()
        self._context.term()

    def __enter__(self) -> KvAwareRouter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- routing ------------------------------------------------------------------------------

    def cached_tokens(self, prompt_token_ids: Sequence[int], *, salt: str | bytes | None = None) -> dict[str, int]:
        """Each live stream's cached prefix of the prompt, in tokens (full blocks; the last
        prompt token is never counted, as a manager always computes it).

        Raises:
            InvalidArgumentError, InvalidTypeError: bad token ids or salt.
        """
        request = AllocationRequest("route", 0, prompt_token_ids=tuple(prompt_token_ids) or None, cache_salt=salt)
        prompt = request.prompt_token_ids or ()
        salt_bytes = request.salt_bytes()
        live = {name: state for name, state in self._streams.items() if name not in self.refused}
        media = {name: self._media(state) for name, state in live.items()}
        cached = dict.fromkeys(live, 0)
        parent = self._root
        going = set(live)
        for start in range(0, max(0, len(prompt) - 1) // self.block_size * self.block_size, self.block_size):
            parent = hash_block(parent, prompt[start : start + self.block_size], salt_bytes)
            going = {name for name in going if any(live[name].index.holds(parent, medium) for medium in media[name])}
            if not going:
                break
            for name in going:
                cached[name] += self.block_size
        return cached

    def route(
        self,
        prompt_token_ids: Sequence[int],
        *,
        salt: str | bytes | None = None,
        loads: Mapping[str, float] | None = None,
    ) -> RouteChoice:
        """The stream holding the prompt's longest cached prefix; among equals the least
        loaded (``loads`` by name, else the prompts routed to each), then the first added.
        Applies the batches that arrived first.

        Raises:
            InvalidArgumentError: no live stream; bad token ids or salt.
        """
        self.poll()
        cached = self.cached_tokens(prompt_token_ids, salt=salt)
        if not cached:
            raise InvalidArgumentError(f"no live stream to route to (refused: {self.refused or 'none'})")
        order = {name: position for position, name in enumerate(self._streams)}

        def rank(name: str) -> tuple[int, float, int]:
            load = loads.get(name, 0.0) if loads is not None else float(self._streams[name].routed)
            return (-cached[name], load, order[name])

        chosen = min(cached, key=rank)
        self._streams[chosen].routed += 1
        return RouteChoice(chosen, cached[chosen], cached)

    # -- inside -------------------------------------------------------------------------------

    def _media(self, state: StreamState) -> list[str]:
        """The media of ``state`` that count: its own (pool, private tiers), not the shared ones."""
        return [medium for medium in state.index.media() if medium not in self._shared]

    def _receive(self, name: str, frames: list[bytes]) -> int:
        """One live message of stream ``name``: applied in order, a gap replayed first."""
        if len(frames) != 3 or len(frames[1]) != _SEQ.size or name in self.refused:
            self._streams[name].corrupt += name not in self.refused
            return 0
        seq = int(_SEQ.unpack(frames[1])[0])
        state = self._streams[name]
        payload = frames[2]
        if state.expected is not None and seq < state.expected:
            if state.recent.get(seq) == _digest(payload):
                return 0  # a duplicate of a replayed batch
            self._restart(state)  # its numbers started again: a new manager
        applied = 0
        if seq > (state.expected or 0):
            applied += self._replay(name, state.expected or 0, until=seq)
        if state.expected is None or seq >= state.expected:
            applied += self._apply(state, seq, payload)
        return applied

    def _restart(self, state: StreamState) -> None:
        state.index = CachedBlockIndex()
        state.expected = None
        state.recent.clear()
        state.restarts += 1

    def _replay(self, name: str, start: int, until: int | None = None) -> int:
        """Apply the retained batches of ``name`` from ``start`` (before ``until``). Asked
        from the last batch applied, the answer also tells whether the stream restarted: that
        batch is gone or differs (then its index is rebuilt from its first batch)."""
        state = self._streams[name]
        check = state.expected is not None and start == state.expected and start > 0
        batches = self._fetch(name, start - 1 if check else start)
        if batches is None:
            return 0  # no answer in time: go on with what is live
        if check:
            first = batches[0] if batches else None
            if first is None or (first[0] == start - 1 and state.recent.get(first[0]) != _digest(first[1])):
                self._restart(state)
                batches = self._fetch(name, 0) or []
            elif first[0] == start - 1:
                batches = batches[1:]
        applied = 0
        for seq, payload in batches:
            if state.expected is not None and seq < state.expected:
                continue  # applied already
            if until is not None and seq >= until:
                break  # the live message itself follows
            applied += self._apply(state, seq, payload)
        return applied

    def _fetch(self, name: str, start: int) -> list[tuple[int, bytes]] | None:
        """The batches stream ``name`` retains from ``start`` on (``None``: no replay socket,
        or no answer in time)."""
        endpoint = self._replay_endpoints[name]
        state = self._streams[name]
        if endpoint is None:
            return None
        state.replays += 1
        batches: list[tuple[int, bytes]] = []
        with self._context.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            dealer.connect(endpoint)
            dealer.send_multipart((b"", _SEQ.pack(start)))
            for _ in range(_MAX_REPLAY):
                try:
                    frames = dealer.recv_multipart()
                except zmq.Again:
                    return None
                if len(frames) != 3 or len(frames[1]) != _SEQ.size:
                    state.corrupt += 1
                    return batches
                seq = int(_SEQ.unpack(frames[1])[0])
                if seq == END_OF_REPLAY:
                    return batches
                batches.append((seq, frames[2]))
        return batches

    def _apply(self, state: StreamState, seq: int, payload: bytes) -> int:
        """Fold batch ``seq`` into the stream's index; a stream whose blocks are of another
        size is refused (its index dropped)."""
        try:
            _, events = decode_event_batch(payload)
        except CorruptEventBatchError:
            state.corrupt += 1
            state.expected = seq + 1
            return 0
        for event in events:
            if isinstance(event, BlockStored) and event.block_size != self.block_size:
                self.refused[state.name] = (
                    f"stream {state.name!r} publishes blocks of {event.block_size} tokens; this router hashes "
                    f"blocks of {self.block_size}"
                )
                state.index = CachedBlockIndex()
                return 0
            state.index.apply(event)
        state.expected = seq + 1
        state.batches += 1
        state.recent[seq] = _digest(payload)
        while len(state.recent) > _RECENT:
            state.recent.popitem(last=False)
        return 1


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
