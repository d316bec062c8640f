"""An offload tier on a Redis server (Valkey, Redis Cluster) that many managers, in many
processes and machines, share: a prefix computed once anywhere in a fleet is promoted
everywhere else.

Requires the ``redis`` extra (``pip install "kvcache-core[redis]"``: redis-py, safetensors)::

    from kvcache_core.offload.redis_tier import RedisTier

    tier = RedisTier("redis://cache:6379/0", 1 << 30, ttl_s=3600)
    manager = create_manager("torch", config, tiers=[HostTier(2 << 30), tier])

* **Keys** carry everything that keeps tenants and models apart:
  ``<prefix>:<namespace>:<format>:<salt>:<block hash>:<group>`` — the ``model_id``
  (percent-encoded; ``-`` for none), a digest of the record format, geometry and dtype (a
  pool of another block size, dtype or layer layout never reads these records), a digest
  of the salt (never the salt itself; ``-`` for none), the block hash (hex) and the
  KV-cache group. **Values** are the portable record of
  :mod:`kvcache_core.offload.prefix_file` (one block per file: header, checksum, host form),
  so a record a NumPy pool wrote loads into a torch one.
* **Reads** are one round trip per prompt: the manager tells the tier the prompt's block
  hashes (:meth:`RedisTier.prefetch`) and one pipeline reads them all, each no longer than
  a record of this pool can be; a read has a deadline (``deadline_s``): a slow server is a
  miss. Every value is parsed strictly (:func:`~kvcache_core.offload.file_header.parse_container`,
  :func:`~kvcache_core.offload.prefix_file.decode_blocks`: namespace, geometry, dtype,
  checksum, hash, salt, key): one that fails is refused, counted, and deleted from the
  server.
* **Writes never block a step**: a demoted block is queued (the queue is bounded in bytes:
  a full queue drops the block, counted) and a background thread writes the queue in
  pipelined batches (``SET`` with the TTL). Until written, the tier serves the block from
  its queue.
* **A server down, slow or restarted** means misses and counted errors, never a failed
  request: a failing read or write opens a breaker for ``retry_after_s`` (reads miss
  without trying, writes are dropped), after which the client reconnects by itself.
* **Sharing.** The server is shared and inclusive: a block promoted into a pool stays in
  the server for the rest of the fleet, and ``clear()`` (a manager's ``close()``) forgets
  only this object's own view (its queue, the keys it lists) — the server's records leave
  by its own ``maxmemory`` policy (run it with ``allkeys-lru``) or the TTL: that is the
  capacity. ``max_bytes`` is the largest record it takes and the limit it reports; the
  object lists (``hashes()``, ``tier_stats()``, a saved prefix cache) the last
  ``listed_keys`` records it put or promoted.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote

from kvcache_core.contract.scalars import check_count
from kvcache_core.errors import InvalidArgumentError, TierError, UnsupportedConfigError
from kvcache_core.offload import host_form
from kvcache_core.offload.block_records import file_geometry
from kvcache_core.offload.file_header import parse_container
from kvcache_core.offload.prefix_file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HASH_ALGORITHM,
    BlockRecord,
    decode_blocks,
    encode_blocks,
    record_key,
    split_key,
)
from kvcache_core.offload.redis_writer import Breaker, WriteQueue
from kvcache_core.offload.state_records import state_arrays_of

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig

__all__ = [
    "RedisTier",
    "RedisTierStats",
    "create_redis_tier",
    "namespace_part",
    "record_format_tag",
    "redis_key",
]

#: The bytes a record's header may take beyond its token ids, salt and namespace.
_HEADER_SLACK = 4096


@dataclass(frozen=True, slots=True)
class RedisTierStats:
    """A :class:`RedisTier`'s own figures (``tier.stats()``), beside what
    ``manager.tier_stats()`` counts for every tier.

    Attributes:
        queued: blocks waiting in the write queue now; queued_bytes: their K/V bytes.
        written: blocks written to the server.
        dropped: blocks not written: the queue was full, the breaker open, or the write failed.
        write_errors: write batches that failed (each counted once).
        lookups: round trips that read blocks (one per prompt prefetched, one per single read).
        read_errors: reads that failed (connection refused or lost, a server error).
        timeouts: reads past the deadline (also in ``read_errors``).
        skipped: reads not tried because the breaker was open (each a miss).
        refused: values refused (truncated, too long, another namespace, geometry, salt or
            key, a bad checksum or hash), each deleted from the server.
    """

    queued: int
    queued_bytes: int
    written: int
    dropped: int
    write_errors: int
    lookups: int
    read_errors: int
    timeouts: int
    skipped: int
    refused: int


def record_format_tag(config: CacheConfig) -> str:
    """16 hex digits naming what a record of ``config``'s pool is: the record format and
    version, the hash algorithm, the geometry (block size and KV-cache groups included), the
    dtype and, with state layers, the state arrays. Pools whose tags differ never read each other's records."""
    described: dict[str, object] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "hash_algorithm": HASH_ALGORITHM,
        "geometry": file_geometry(config),
        "dtype": config.dtype,
    }
    if config.states.arrays:  # its state checkpoints' arrays
        described["state_arrays"] = state_arrays_of(config)
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def namespace_part(model_id: str | None) -> str:
    """The namespace part of a key: ``m`` and the percent-encoded ``model_id``, ``-`` for none."""
    return "-" if model_id is None else "m" + quote(model_id, safe="")


def _salt_part(salt: bytes | None) -> str:
    return "-" if salt is None else hashlib.blake2b(salt, digest_size=8).hexdigest()


def redis_key(prefix: str, config: CacheConfig, key: bytes, salt: bytes | None) -> bytes:
    """The server key of the record filed under ``key`` (:attr:`BlockRecord.key
    <kvcache_core.offload.prefix_file.BlockRecord.key>`) of a pool of ``config``, hashed with
    ``salt``: ``<prefix>:<namespace>:<format tag>:<salt digest>:<hash hex>:<group>``.

    Raises:
        InvalidArgumentError: ``key`` is not a record key.
    """
    block_hash, group = split_key(key)
    parts = (prefix, namespace_part(config.model_id), record_format_tag(config), _salt_part(salt))
    return f"{':'.join(parts)}:{block_hash.hex()}:{group}".encode()


def _check_seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class RedisTier:
    """An :class:`~kvcache_core.offload.tiers.OffloadTier` on a RESP server shared by many
    managers (see the module docstring).

    Args:
        url: the server, as redis-py's ``from_url`` takes it (``redis://``, ``rediss://``
            for TLS, ``unix://``; user and password in it or in ``connection_options``).
        max_bytes: the largest record it takes, and the limit its figures report (>= one
            block's, checked when bound); the server's ``maxmemory`` bounds what it holds.
        name: its name, the ``medium`` of its events (``"redis"``).
        prefix: the first part of every key (give tests and deployments their own).
        ttl_s: seconds a written record lives (``None``: until the server evicts it).
        deadline_s: the longest a read (a prompt's lookup) may take; past it, a miss.
        write_timeout_s: the longest a background write batch may take.
        retry_after_s: after a failure, seconds during which the server is not tried.
        queue_bytes: the K/V bytes the write queue holds at most; a block past it is dropped.
        listed_keys: the records it lists at most (the most recently put or promoted).
        client: a redis-py client to use instead of one made from ``url`` (a
            ``RedisCluster``, a Valkey client of the same interface); it serves reads and
            writes, with its own timeouts.
        connection_options: passed to ``redis.Redis.from_url`` (``password``, ``ssl_*``,
            ``max_connections``, ``socket_keepalive``, ...); they override the timeouts
            derived from ``deadline_s`` and ``write_timeout_s``.

    Raises:
        InvalidArgumentError: a bad number, name, prefix or url (the message names it).
        UnsupportedConfigError: redis-py is not installed (the message says how to install it).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        max_bytes: int = 1 << 30,
        *,
        name: str = "redis",
        prefix: str = "kvcache",
        ttl_s: float | None = None,
        deadline_s: float = 0.05,
        write_timeout_s: float = 2.0,
        retry_after_s: float = 1.0,
        queue_bytes: int = 64 << 20,
        listed_keys: int = 1 << 16,
        client: Any = None,
        **connection_options: Any,
    ) -> None:
        self._max_bytes = check_count(max_bytes, "max_bytes", 1)
        if not isinstance(name, str) or not name or name == "pool":
            raise InvalidArgumentError(f"a tier's name must be a non-empty str other than 'pool', got {name!r}")
        if not isinstance(prefix, str) or not prefix or any(char in prefix for char in ":*?[]\\"):
            raise InvalidArgumentError(f"prefix must be a non-empty str without : * ? [ ] \\, got {prefix!r}")
        if not isinstance(url, str) or not url:
            raise InvalidArgumentError(f"url must be a non-empty str (redis://host:port/db), got {url!r}")
        self._name = name
        self._prefix = prefix
        self._ttl_ms = None if ttl_s is None else max(1, round(_check_seconds(ttl_s, "ttl_s or None") * 1000))
        self._deadline_s = _check_seconds(deadline_s, "deadline_s")
        write_timeout = _check_seconds(write_timeout_s, "write_timeout_s")
        self._retry_after_s = _check_seconds(retry_after_s, "retry_after_s")
        self._queue_limit = check_count(queue_bytes, "queue_bytes", 1)
        self._listed_limit = check_count(listed_keys, "listed_keys", 1)
        self._reader, self._writer = self._clients(url, client, write_timeout, connection_options)
        self._config: CacheConfig | None = None
        self._key_stem = ""
        self._record_bytes = 0
        self._breaker = Breaker(self._retry_after_s)
        self._writes = WriteQueue(name, self._writer, self._queue_limit, self._ttl_ms, self._breaker, self._encode)
        # What this object lists: key -> (salt, record bytes), least recently used first.
        self._index: OrderedDict[bytes, tuple[bytes | None, int]] = OrderedDict()
        self._used_bytes = 0
        # The last lookup's answers: key -> (salt, value: b"" where the server has none, None
        # where it has one already given back).
        self._looked_up: dict[bytes, tuple[bytes | None, bytes | None]] = {}
        self._last_salt: bytes | None = None
        self._counts = dict.fromkeys(("lookups", "read_errors", "timeouts", "skipped", "refused"), 0)

    def _clients(self, url: str, client: Any, write_timeout: float, options: dict[str, Any]) -> tuple[Any, Any]:
        if client is not None:
            return client, client
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise UnsupportedConfigError('RedisTier needs redis-py: pip install "kvcache-core[redis]"') from exc

        def make(timeout: float) -> Any:
            settings: dict[str, Any] = {
                "socket_timeout": timeout,
                "socket_connect_timeout": timeout,
                "retry": Retry(NoBackoff(), 0),  # a failure is a miss at once, not a wait
            }
            settings.update(options)
            try:
                return cast("Any", redis.Redis).from_url(url, **settings)
            except (ValueError, TypeError) as exc:
                raise InvalidArgumentError(
                    f"RedisTier cannot connect to {url!r} with {sorted(options)}: {exc}"
                ) from exc

        return make(self._deadline_s), make(write_timeout)

    # -- the OffloadTier members ------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def bind(self, config: CacheConfig) -> None:
        """Serve a pool of ``config`` (every key and check follows from it).

        Raises:
            TierError: ``max_bytes`` is below one block's bytes.
        """
        if config.bytes_per_block > self._max_bytes:
            raise TierError(
                f"tier {self._name!r} holds {self._max_bytes} bytes, less than one block of {config.bytes_per_block}"
            )
        if self._config is not None and self._config != config:
            self._forget()
        self._config = config
        self._key_stem = ":".join((self._prefix, namespace_part(config.model_id), record_format_tag(config)))
        shape = host_form.host_record_shape(config)
        self._record_bytes = 2 * math.prod(shape) * host_form.host_dtype(config.dtype).itemsize
        if config.states.arrays:  # a state checkpoint's value: its bytes, its arrays named in the header
            described = len(json.dumps(state_arrays_of(config))) + _HEADER_SLACK
            self._record_bytes = max(self._record_bytes, config.states.bytes_per_slot + described)

    def put(self, record: BlockRecord) -> list[BlockRecord | bytes]:
        """Queue ``record`` for the server (it is served from the queue until written).

        Returns:
            ``[record]`` when it is larger than ``max_bytes`` or the queue is full (then it
            moves on to the next tier, or is dropped: counted), else ``[]``.
        """
        nbytes = record.nbytes
        if nbytes > self._max_bytes:
            return [record]
        stored = BlockRecord(
            record.block_hash,
            record.parent_hash,
            record.salt,
            record.token_ids,
            record.keys.copy(),  # own copies: the pool's host views must not be pinned or aliased
            record.values.copy(),
            record.group,
        )
        key = record.key
        if not self._writes.offer(key, self._server_key(key, record.salt), stored):
            return [record]
        self._looked_up.pop(key, None)  # the last lookup's answer is out of date
        self._list(key, record.salt, nbytes)
        return []

    def peek(self, key: bytes, /) -> BlockRecord | None:
        """The record of ``key``: from the write queue, the last lookup, or one read.

        Raises:
            TierError: the server failed or is past the deadline (a miss).
            CorruptCacheFileError, IncompatibleCacheFileError: the value is refused (it is
                deleted from the server).
        """
        queued = self._writes.get(key)
        if queued is not None:
            return queued
        looked = self._looked_up.get(key)
        salt = looked[0] if looked is not None else self._salt_of(key)
        value = looked[1] if looked is not None else None
        if value is None:  # not looked up, or its value given once already (not kept)
            value = self._read_one(key, salt)
        elif value:
            self._looked_up[key] = (salt, None)
        if not value:
            return None
        record = self._decode(key, salt, value)
        self._list(key, salt, record.nbytes)
        return record

    def discard(self, key: bytes, /) -> None:
        """Forget ``key`` here: a queued write of it is cancelled and it is no longer listed;
        the server keeps its record for the fleet (so the last lookup still finds it)."""
        self._writes.cancel(key)
        listed = self._index.pop(key, None)
        if listed is not None:
            self._used_bytes -= listed[1]

    def hashes(self) -> list[bytes]:
        """The keys this object lists (it put or promoted them), least recently used first."""
        return list(self._index)

    def __contains__(self, key: object, /) -> bool:
        """Whether it knows ``key`` held, without asking the server: listed (put or promoted
        here, see ``listed_keys``), or found by the last lookup (:meth:`prefetch`)."""
        if not isinstance(key, bytes):
            return False
        if key in self._index:
            return True
        looked = self._looked_up.get(key)
        return looked is not None and (looked[1] is None or bool(looked[1]))

    def clear(self) -> None:
        """Forget this object's view: the write queue (not written), the keys it lists and
        the last lookup; the background writer stops and the connections close (the next
        call opens new ones). The server's records stay."""
        self._forget()
        for client in self._clients_used():
            try:
                client.connection_pool.disconnect()  # its sockets go; the next call reconnects
            except Exception as exc:  # best effort: they go with the process at worst
                warnings.warn(
                    f"tier {self._name!r} could not close its connections: {exc!r}", RuntimeWarning, stacklevel=2
                )

    # -- beyond OffloadTier ---------------------------------------------------------------

    def prefetch(self, keys: Sequence[bytes], salt: bytes | None) -> None:
        """Read the records of ``keys`` (a prompt's blocks, in order, hashed with ``salt``)
        in one round trip; :meth:`__contains__` and :meth:`peek` then answer from it. Each
        value is read no further than a record of this pool can be long.

        Raises:
            TierError: the server failed or is past the deadline (every key is a miss).
        """
        self._looked_up = {}
        self._last_salt = salt
        queued = self._writes.held(keys)
        wanted = [key for key in keys if key not in queued]
        self._looked_up = dict.fromkeys(queued, (salt, None))  # held: peek serves them from the queue
        if not wanted:
            return
        limit = self._value_limit(salt)
        server_keys = [self._server_key(key, salt) for key in wanted]

        def read_all() -> list[Any]:
            pipe = self._reader.pipeline(transaction=False)
            for server_key in server_keys:
                pipe.getrange(server_key, 0, limit)
            values: list[Any] = pipe.execute(raise_on_error=False)
            return values

        values = self._call("look blocks up", read_all)
        answers: dict[bytes, tuple[bytes | None, bytes | None]] = {}
        for key, server_key, value in zip(wanted, server_keys, values, strict=True):
            if isinstance(value, Exception):  # a key holding another type (planted): refused
                self._refuse(server_key)
                value = b""
            answers[key] = (salt, bytes(value) if isinstance(value, (bytes, bytearray)) else b"")
        self._looked_up.update(answers)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the write queue is empty (written or dropped), at most ``timeout_s``
        seconds; whether it is."""
        return self._writes.flush(timeout_s)

    def stats(self) -> RedisTierStats:
        """Its own figures (see :class:`RedisTierStats`)."""
        queued, queued_bytes = self._writes.queued
        writes = self._writes
        return RedisTierStats(queued, queued_bytes, writes.written, writes.dropped, writes.errors, **self._counts)

    def close(self) -> None:
        """:meth:`clear`, then close the client's connections."""
        self.clear()
        for client in self._clients_used():
            try:
                client.close()
            except Exception as exc:  # closing is best effort: the sockets go with the process
                warnings.warn(f"closing tier {self._name!r}'s client failed: {exc!r}", RuntimeWarning, stacklevel=2)

    def survey(self, limit: int = 10_000) -> dict[str, dict[str, set[str]]]:
        """What the server holds under this tier's prefix, from at most ``limit`` keys (a
        ``SCAN``, for diagnosis: ``kvcache explain``): namespace part -> format tag -> salt
        digests.

        Raises:
            Exception: whatever the client raises (the server is down).
        """
        families: dict[str, dict[str, set[str]]] = {}
        for count, raw in enumerate(self._reader.scan_iter(match=f"{self._prefix}:*", count=1000)):
            if count >= limit:
                break
            parts = bytes(raw).decode(errors="replace").split(":")
            if len(parts) == 6:
                families.setdefault(parts[1], {}).setdefault(parts[2], set()).add(parts[3])
        return families

    def exists(self, config: CacheConfig, block_hash: bytes, salt: bytes | None, group: int = 0) -> bool:
        """Whether the server holds a record of ``block_hash`` for a pool of ``config`` (which
        may differ from the bound one: another block size) hashed with ``salt``.

        Raises:
            Exception: whatever the client raises (the server is down).
        """
        server_key = redis_key(self._prefix, config, record_key(block_hash, group), salt)
        return bool(self._reader.exists(server_key))

    def server_key(self, key: bytes, salt: bytes | None) -> bytes:
        """The server key of ``key`` hashed with ``salt`` (:func:`redis_key`).

        Raises:
            TierError: the tier is not bound yet.
        """
        return self._server_key(key, salt)

    # -- inside ---------------------------------------------------------------------------

    def _server_key(self, key: bytes, salt: bytes | None) -> bytes:
        if self._config is None:
            raise TierError(f"tier {self._name!r} is not bound to a pool yet")
        block_hash, group = split_key(key)
        return f"{self._key_stem}:{_salt_part(salt)}:{block_hash.hex()}:{group}".encode()

    def _clients_used(self) -> list[Any]:
        return [self._reader] if self._writer is self._reader else [self._reader, self._writer]

    def _salt_of(self, key: bytes) -> bytes | None:
        """The salt ``key`` was put or looked up with; else the last lookup's."""
        listed = self._index.get(key)
        return listed[0] if listed is not None else self._last_salt

    def _list(self, key: bytes, salt: bytes | None, nbytes: int) -> None:
        previous = self._index.pop(key, None)
        if previous is not None:
            self._used_bytes -= previous[1]
        self._index[key] = (salt, nbytes)
        self._used_bytes += nbytes
        while len(self._index) > self._listed_limit:
            _, (_, dropped) = self._index.popitem(last=False)
            self._used_bytes -= dropped

    def _forget(self) -> None:
        """Drop the write queue (its thread stops), the index and the last lookup."""
        self._writes.clear(self._deadline_s)
        self._index.clear()
        self._used_bytes = 0
        self._looked_up = {}

    def _value_limit(self, salt: bytes | None) -> int:
        """The longest value a record of this pool hashed with ``salt`` can be."""
        assert self._config is not None
        config = self._config
        header = _HEADER_SLACK + 21 * config.block_size + 2 * len(salt or b"") + 6 * len(config.model_id or "")
        return 8 + header + self._record_bytes

    def _call(self, what: str, call: Any) -> Any:
        """``call()`` against the server, unless the breaker is open; a failure opens it."""
        if self._breaker.is_open:
            self._counts["skipped"] += 1
            raise TierError(
                f"tier {self._name!r} skipped a read: the server failed less than {self._retry_after_s} s ago"
            )
        self._counts["lookups"] += 1
        try:
            return call()
        except Exception as exc:
            timed_out = "Timeout" in type(exc).__name__
            self._counts["read_errors"] += 1
            self._counts["timeouts"] += timed_out
            self._breaker.trip()
            reason = f"past its deadline of {self._deadline_s} s" if timed_out else f"failed: {exc!r}"
            raise TierError(f"tier {self._name!r} could not {what}: the server {reason}") from exc

    def _read_one(self, key: bytes, salt: bytes | None) -> bytes:
        server_key = self._server_key(key, salt)
        limit = self._value_limit(salt)
        value = self._call("read a block", lambda: self._reader.getrange(server_key, 0, limit))
        return bytes(value) if isinstance(value, (bytes, bytearray)) else b""

    def _decode(self, key: bytes, salt: bytes | None, value: bytes) -> BlockRecord:
        """The record ``value`` holds, checked strictly for ``key`` and ``salt``; a value that
        fails is refused: counted, deleted from the server, raised."""
        assert self._config is not None
        server_key = self._server_key(key, salt)
        source = f"redis:{server_key.decode()}"
        try:
            if len(value) > self._value_limit(salt):
                raise TierError(f"{source!r} is longer than any record of this pool")
            records = decode_blocks(parse_container(value, source), value, self._config, Path(source), chained=False)
            if len(records) != 1 or records[0].key != key or records[0].salt != salt:
                raise TierError(f"{source!r} does not hold the record of its key and salt")
        except Exception:
            self._looked_up[key] = (salt, b"")  # deleted from the server
            self._refuse(server_key)
            raise
        return records[0]

    def _refuse(self, server_key: bytes) -> None:
        self._counts["refused"] += 1
        self._writes.doom(server_key)

    def _encode(self, record: BlockRecord) -> bytes:
        assert self._config is not None, "bind the tier first"
        return encode_blocks(self._config, [record])


def create_redis_tier(max_bytes: int, **options: Any) -> RedisTier:
    """``create_tier("redis", max_bytes, url=..., ...)``: a :class:`RedisTier` (registered
    under the entry-point group ``kvcache_core.tiers``; the options are its keyword
    arguments, ``url`` among them).

    Raises:
        InvalidArgumentError, UnsupportedConfigError: as :class:`RedisTier`.
    """
    return RedisTier(max_bytes=max_bytes, **options)
