"""Event payloads come from outside: decoding them is strict, and costs memory in proportion
to their size, whatever the bytes."""

from __future__ import annotations

import math
import random
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

msgpack = pytest.importorskip("msgpack")
pytest.importorskip("zmq")

from kvcache_core.contract.config import MAX_POOL_SLOTS, MAX_TOKEN_ID  # noqa: E402
from kvcache_core.errors import CorruptEventBatchError, InvalidArgumentError, InvalidTypeError  # noqa: E402
from kvcache_core.offload.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent  # noqa: E402
from kvcache_core.offload.publisher import decode_event_batch, encode_event_batch  # noqa: E402

HASH = b"h" * 32
#: Decoding may take this many bytes of memory per payload byte, plus FIXED_BYTES: a Python
#: int or pointer per one-byte token is the worst case (about 21 measured); msgpack's
#: unpacker takes about 42 KiB whatever it reads.
BYTES_PER_PAYLOAD_BYTE = 32
FIXED_BYTES = 64 * 1024


def packed(*events: object, ts: object = 1.0, rank: object = None) -> bytes:
    """A batch as msgpack, with fields exactly as given (no checks on the way)."""
    return bytes(msgpack.packb([ts, list(events), rank], use_bin_type=True))


def stored(**fields: Any) -> list[Any]:
    """A valid ``BlockStored`` field list (2 blocks of 2 tokens), with ``fields`` replaced."""
    values = {
        "block_hashes": [HASH, HASH],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "pool",
    }
    values.update(fields)
    return ["BlockStored", *values.values()]


def peak_bytes_of_decoding(payload: bytes) -> tuple[int, BaseException | None]:
    """The peak memory (bytes) traced while decoding ``payload``, and what it raised."""
    tracemalloc.start()
    try:
        decode_event_batch(payload)
    except Exception as exc:  # the caller checks what it was
        return tracemalloc.get_traced_memory()[1], exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, None


def assert_cheap(payload: bytes) -> None:
    peak, _ = peak_bytes_of_decoding(payload)
    assert peak <= BYTES_PER_PAYLOAD_BYTE * len(payload) + FIXED_BYTES, (len(payload), peak)


@pytest.mark.parametrize("value", [10**8, 2**62, 2**64 - 1, -1], ids=["1e8", "2**62", "2**64-1", "-1"])
def test_an_int_where_a_hash_belongs_is_refused_before_anything_is_built(value: int) -> None:
    payload = packed(["BlockRemoved", [value], "pool"])

    with pytest.raises(CorruptEventBatchError, match=r"block_hashes\[0\] of event 0 must be a 32-byte hash"):
        decode_event_batch(payload)
    assert_cheap(payload)


@pytest.mark.parametrize("size", [0, 31, 33])
def test_a_hash_of_another_length_is_refused(size: int) -> None:
    with pytest.raises(CorruptEventBatchError, match=f"has {size} bytes, a block hash has 32"):
        decode_event_batch(packed(["BlockRemoved", [b"x" * size], "pool"]))


def test_a_parent_hash_of_another_length_is_refused() -> None:
    with pytest.raises(CorruptEventBatchError, match=r"event 0 \(BlockStored\): parent_block_hash has 4 bytes"):
        decode_event_batch(packed(stored(parent_block_hash=b"abcd")))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"token_ids": [1, 2, 3, math.inf]}, r"token_ids\[3\] of event 0 must be an int, got a msgpack float"),
        ({"token_ids": [1, 2, 3, math.nan]}, r"token_ids\[3\] of event 0 must be an int, got a msgpack float"),
        ({"block_size": math.inf}, "block_size of event 0 must be an int, got a msgpack float"),
        ({"block_size": 2.0}, "block_size of event 0 must be an int, got a msgpack float"),
        ({"lora_id": math.nan}, "lora_id of event 0 must be an int, got a msgpack float"),
    ],
    ids=["inf token", "nan token", "inf block_size", "float block_size", "nan lora_id"],
)
def test_a_float_where_an_int_belongs_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(CorruptEventBatchError, match=message):
        decode_event_batch(packed(stored(**fields)))


@pytest.mark.parametrize("field", ["token_ids", "block_size", "lora_id"])
def test_a_bool_is_not_an_int(field: str) -> None:
    value: object = [True, 2, 3, 4] if field == "token_ids" else True
    with pytest.raises(CorruptEventBatchError, match="must be an int, got a msgpack bool"):
        decode_event_batch(packed(stored(**{field: value})))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"token_ids": [1, 2, 3, -1]},
            rf"event 0 \(BlockStored\): token_ids\[3\] = -1 is out of range; valid: \[0, {MAX_TOKEN_ID}\]",
        ),
        ({"token_ids": [1, 2, 3, MAX_TOKEN_ID + 1]}, rf"= {MAX_TOKEN_ID + 1} is out of range"),
        (
            {"block_size": 0, "token_ids": []},
            rf"block_size = 0 is out of range; valid: \[1, {MAX_POOL_SLOTS}\]",
        ),
        ({"block_size": MAX_POOL_SLOTS + 1}, rf"= {MAX_POOL_SLOTS + 1} is out of range"),
        ({"lora_id": -1}, r"lora_id = -1 is out of range"),
        ({"medium": ""}, "medium must be a non-empty str"),
        ({"medium": b"pool"}, "the medium of event 0 must be a str, got a msgpack bin"),
    ],
    ids=[
        "token -1",
        "token too large",
        "block_size 0",
        "block_size too large",
        "lora -1",
        "empty medium",
        "bin medium",
    ],
)
def test_a_value_out_of_range_is_refused_naming_it(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(CorruptEventBatchError, match=message):
        decode_event_batch(packed(stored(**fields)))


def test_token_ids_must_fill_every_block() -> None:
    with pytest.raises(
        CorruptEventBatchError, match=r"event 0 \(BlockStored\): token_ids holds 3 ids; 2 blocks of 2 tokens have 4"
    ):
        decode_event_batch(packed(stored(token_ids=[1, 2, 3])))


@pytest.mark.parametrize("ts", [math.nan, math.inf, -math.inf, -1.0, True, "now", None])
def test_a_timestamp_that_is_not_a_finite_time_is_refused(ts: object) -> None:
    with pytest.raises(CorruptEventBatchError, match="ts must be"):
        decode_event_batch(packed(ts=ts))


@pytest.mark.parametrize("rank", [-1, True, 1.0, "0"])
def test_a_data_parallel_rank_that_is_not_an_int_from_0_is_refused(rank: object) -> None:
    with pytest.raises(CorruptEventBatchError, match="data_parallel_rank"):
        decode_event_batch(packed(rank=rank))


def test_a_rank_is_accepted_and_dropped() -> None:
    assert decode_event_batch(packed(["AllBlocksCleared"], rank=3)) == (1.0, [AllBlocksCleared()])


@pytest.mark.parametrize(
    ("header", "what"),
    [
        (b"\x93\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff", "the event list has 4294967295 items"),
        (
            b"\x93\x00\x91\x93\xacBlockRemoved\xdd\xff\xff\xff\xff",
            "the block_hashes of event 0 has 4294967295 items",
        ),
        (
            b"\x93\x00\x91\x97\xabBlockStored\x91\xc4\x20" + HASH + b"\xc0\xdd\xff\xff\xff\xff",
            "the token_ids of event 0 has 4294967295 items",
        ),
    ],
    ids=["events", "hashes", "tokens"],
)
def test_a_count_past_what_the_payload_holds_is_refused_without_allocating(header: bytes, what: str) -> None:
    with pytest.raises(CorruptEventBatchError, match=f"{what}; valid: \\d+ to the \\d+ bytes left"):
        decode_event_batch(header)
    assert_cheap(header)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "ends after 0 bytes"),
        (b"\xc1garbage", "the batch must be an array, got a msgpack unused byte"),
        (packed()[:-1], "ends after"),
        (packed() + b"\x00", "1 bytes follow the batch"),
        (bytes(msgpack.packb([1.0, [], None, None])), "the batch has 4 items; valid: 3 to 3"),
        (packed(["Flushed"]), "unknown event tag 'Flushed' in event 0"),
        (packed(["AllBlocksCleared", 1]), r"event 0 \(AllBlocksCleared\) has 2 fields, a AllBlocksCleared has 1"),
        (packed(["BlockRemoved", [HASH]]), r"event 0 \(BlockRemoved\) has 2 fields"),
        (packed({"BlockRemoved": 1}), "event 0 must be an array, got a msgpack map"),
        (packed(["BlockRemoved", [HASH], msgpack.ExtType(1, b"pool")]), "must be a str, got a msgpack extension"),
        (packed([b"BlockRemoved", [HASH], "pool"]), "the tag of event 0 must be a str, got a msgpack bin"),
        (b"\x93\x00\x91\x91\xa2\xff\xfe\xc0", "not a KV event batch"),  # a tag that is not UTF-8
        (packed(["BlockRemoved", "h" * 32, "pool"]), "block_hashes of event 0 must be an array, got a msgpack str"),
    ],
    ids=[
        "empty",
        "not msgpack",
        "truncated",
        "trailing bytes",
        "four fields",
        "unknown tag",
        "extra field",
        "missing field",
        "a map",
        "an extension",
        "bin tag",
        "bad utf-8",
        "str hashes",
    ],
)
def test_a_malformed_batch_is_refused_naming_what_is_wrong(payload: bytes, message: str) -> None:
    with pytest.raises(CorruptEventBatchError, match=message) as refused:
        decode_event_batch(payload)
    assert str(refused.value).startswith(f"not a KV event batch ({len(payload)} bytes)")


def test_an_event_error_is_an_invalid_argument_error() -> None:
    assert issubclass(CorruptEventBatchError, InvalidArgumentError)
    assert issubclass(CorruptEventBatchError, ValueError)


@pytest.mark.parametrize("payload", ["text", None, 42, [1.0, [], None]])
def test_a_payload_that_is_not_bytes_is_refused(payload: object) -> None:
    with pytest.raises(InvalidTypeError, match="an event payload is bytes"):
        decode_event_batch(payload)  # type: ignore[arg-type]


def test_bytearray_and_memoryview_payloads_decode() -> None:
    payload = encode_event_batch([AllBlocksCleared()], ts=2.0)
    assert (
        decode_event_batch(bytearray(payload)) == decode_event_batch(memoryview(payload)) == (2.0, [AllBlocksCleared()])
    )


@pytest.mark.parametrize("event", ["BlockRemoved", None, (b"h" * 32,)])
def test_encoding_refuses_what_is_not_an_event(event: object) -> None:
    with pytest.raises(InvalidTypeError, match="a cache event is a BlockStored, BlockRemoved or AllBlocksCleared"):
        encode_event_batch([event])  # type: ignore[list-item]


@pytest.mark.parametrize("events", ["AllBlocksCleared", AllBlocksCleared(), None])
def test_encoding_refuses_what_is_not_a_sequence_of_events(events: object) -> None:
    with pytest.raises(InvalidTypeError, match="events must be a sequence of cache events"):
        encode_event_batch(events)  # type: ignore[arg-type]


@pytest.mark.parametrize("ts", [math.nan, math.inf, -1.0, True])
def test_encoding_refuses_a_timestamp_decoding_would_refuse(ts: float) -> None:
    with pytest.raises(InvalidArgumentError, match="ts must be a finite number of seconds >= 0"):
        encode_event_batch([], ts=ts)


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (BlockStored((HASH,), None, (2**64,), 1), r"token_ids\[0\] = 18446744073709551616 is out of range"),
        (BlockStored((HASH,), None, (True,), 1), r"token_ids\[0\] must be an int"),
        (BlockStored((HASH,), None, (1, 2), 1), "token_ids holds 2 ids; 1 blocks of 1 tokens have 1"),
        (BlockStored((HASH,), None, [1], 1), "token_ids must be a tuple of ints, got list"),  # type: ignore[arg-type]
        (BlockStored((HASH,), None, (), 0), r"block_size = 0 is out of range"),
        (BlockStored((HASH,), b"short", (1,), 1), "parent_block_hash has 5 bytes"),
        (BlockStored((HASH,), None, (1,), 1, -1), "lora_id = -1 is out of range"),
        (BlockStored((HASH,), None, (1,), 1, None, ""), "medium must be a non-empty str"),
        (BlockRemoved((), "pool"), "block_hashes must be a non-empty tuple"),
        (BlockRemoved((b"x" * 31,), "pool"), r"block_hashes\[0\] has 31 bytes"),
        (BlockRemoved((12,), "pool"), r"block_hashes\[0\] must be a 32-byte hash \(bytes\), got int"),  # type: ignore[arg-type]
    ],
    ids=[
        "token past 64 bits",
        "bool token",
        "tokens and blocks disagree",
        "token list",
        "block_size 0",
        "short parent",
        "lora -1",
        "empty medium",
        "no hashes",
        "short hash",
        "int hash",
    ],
)
def test_encoding_refuses_an_event_decoding_would_refuse(event: CacheEvent, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"cannot encode event 1 \\({type(event).__name__}\\): {message}"):
        encode_event_batch([AllBlocksCleared(), event], ts=1.0)


# -- properties: valid events round trip; any bytes decode to valid events or are refused ----

hashes = st.binary(min_size=32, max_size=32)
token_ids = st.integers(0, MAX_TOKEN_ID)
media = st.text(min_size=1, max_size=8)


@st.composite
def block_stored(draw: st.DrawFn) -> BlockStored:
    block_size = draw(st.integers(1, 4))
    block_hashes = tuple(draw(st.lists(hashes, min_size=1, max_size=3)))
    tokens = tuple(
        draw(st.lists(token_ids, min_size=len(block_hashes) * block_size, max_size=len(block_hashes) * block_size))
    )
    return BlockStored(
        block_hashes,
        draw(st.none() | hashes),
        tokens,
        block_size,
        draw(st.none() | st.integers(0, 2**63 - 1)),
        draw(media),
    )


cache_events: st.SearchStrategy[CacheEvent] = st.one_of(
    block_stored(),
    st.builds(BlockRemoved, st.lists(hashes, min_size=1, max_size=3).map(tuple), media),
    st.just(AllBlocksCleared()),
)
timestamps = st.floats(0, 2e9, allow_nan=False)


@settings(max_examples=150)
@given(st.lists(cache_events, max_size=4), timestamps)
def test_valid_events_round_trip(events: list[CacheEvent], ts: float) -> None:
    assert decode_event_batch(encode_event_batch(events, ts=ts)) == (ts, events)


def assert_valid(event: CacheEvent) -> None:
    """What the decoder promises of every event it returns."""
    if isinstance(event, AllBlocksCleared):
        return
    assert event.block_hashes
    assert all(isinstance(block_hash, bytes) and len(block_hash) == 32 for block_hash in event.block_hashes)
    assert isinstance(event.medium, str)
    assert event.medium
    if isinstance(event, BlockStored):
        assert event.parent_block_hash is None or len(event.parent_block_hash) == 32
        assert type(event.block_size) is int
        assert 1 <= event.block_size <= MAX_POOL_SLOTS
        assert len(event.token_ids) == len(event.block_hashes) * event.block_size
        assert all(type(token) is int and 0 <= token <= MAX_TOKEN_ID for token in event.token_ids)
        assert event.lora_id is None or type(event.lora_id) is int


#: Bytes a mutation writes: msgpack's markers for the kinds it must refuse, and limits.
MARKERS = st.sampled_from(
    [
        0x00,
        0x7F,
        0x90,
        0x9F,
        0xA0,
        0xC0,
        0xC1,
        0xC2,
        0xC3,
        0xC4,
        0xC6,
        0xC7,
        0xCA,
        0xCB,
        0xCF,
        0xD3,
        0xD4,
        0xDD,
        0xDF,
        0xFF,
    ]
)


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    """A valid batch with a few bytes replaced, inserted or removed, or cut short, anywhere
    in it (a seeded generator spreads the positions: Hypothesis alone favours the first bytes)."""
    payload = bytearray(encode_event_batch(draw(st.lists(cache_events, min_size=1, max_size=3)), ts=1.0))
    spread = random.Random(draw(st.integers(0, 2**32 - 1)))
    for _ in range(draw(st.integers(1, 4))):
        position = spread.randrange(len(payload) + 1)
        byte = draw(MARKERS) if spread.random() < 0.5 else spread.randrange(256)
        action = spread.choice(["replace", "replace", "insert", "delete", "truncate"])
        if action == "insert" or position == len(payload):
            payload[position:position] = bytes([byte])
        elif action == "replace":
            payload[position] = byte
        elif action == "delete":
            del payload[position]
        else:
            del payload[position:]
    return bytes(payload)


def check_any_payload(payload: bytes) -> None:
    peak, raised = peak_bytes_of_decoding(payload)
    if raised is not None and not isinstance(raised, CorruptEventBatchError):
        raise AssertionError(f"{payload!r} raised {raised!r}, not CorruptEventBatchError") from raised
    if raised is None:
        for event in decode_event_batch(payload)[1]:
            assert_valid(event)
    assert peak <= BYTES_PER_PAYLOAD_BYTE * len(payload) + FIXED_BYTES, (payload, peak)


@settings(max_examples=400)
@given(mutated_payloads())
def test_a_mutated_payload_decodes_to_valid_events_or_is_refused_cheaply(payload: bytes) -> None:
    check_any_payload(payload)


@settings(max_examples=200)
@given(st.binary(max_size=256))
def test_any_bytes_decode_to_valid_events_or_are_refused_cheaply(payload: bytes) -> None:
    check_any_payload(payload)
