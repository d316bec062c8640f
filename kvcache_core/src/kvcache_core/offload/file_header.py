"""The header of a cache file (:mod:`kvcache_core.offload.prefix_file`), read strictly.

A cache file is a safetensors file: an 8-byte little-endian header length, a JSON header
(the tensors' dtypes, shapes and data offsets, and the kvcache header as a metadata
string), then the tensor data. :func:`read_container` opens a regular file only
(:class:`~kvcache_core.offload.safe_files.RegularFile`), reads the header (at most
:data:`MAX_HEADER_BYTES`), checks that it declares exactly the tensors ``keys`` and
``values``, each as long as its dtype and shape make it, filling the file exactly, and only
then reads the data. :func:`kvcache_header` and :func:`block_entry` parse the kvcache
header's JSON and each block's fields: types (JSON ``true`` is not an int, ``1.0`` is
not ``1``), ranges, lengths, nesting depth (:mod:`kvcache_core.offload.strict_json`). Every
refusal is a :class:`~kvcache_core.errors.CorruptCacheFileError` naming the file and the
value.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from kvcache_core.contract.config import MAX_TOKEN_ID
from kvcache_core.errors import CorruptCacheFileError
from kvcache_core.offload.safe_files import RegularFile
from kvcache_core.offload.strict_json import parse_json

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig

__all__ = [
    "MAX_HEADER_BYTES",
    "BlockEntry",
    "block_entry",
    "kvcache_header",
    "parse_container",
    "read_container",
    "same_json",
    "shown",
]

#: The largest safetensors header read (the safetensors library's own limit).
MAX_HEADER_BYTES = 100_000_000
#: Bytes per element of the safetensors dtypes a file may declare.
_ITEM_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_HASH_HEX = re.compile(r"[0-9a-f]{64}")


def read_container(source: str, expected_size: int | None) -> tuple[Mapping[str, Any], bytes]:
    """The safetensors header table of the regular file ``source`` and the file's bytes,
    once the header was checked against the file's size: the file is read no further than
    the header (at most :data:`MAX_HEADER_BYTES`) until the tensors it declares fill the
    file exactly (and, given ``expected_size``, only a file of that size is read).

    Raises:
        CacheFileError: ``source`` cannot be opened or is not a regular file.
        CorruptCacheFileError: the header is too long, not strict JSON, or does not declare
            exactly ``keys`` and ``values`` filling the file; the file is truncated or too
            long, or changed while read.
    """
    with RegularFile(source, what="the cache file") as file:
        if expected_size is not None and file.size != expected_size:
            raise CorruptCacheFileError(f"{source!r} has {file.size} bytes; {expected_size} were written")
        if file.size < 8:
            raise CorruptCacheFileError(f"{source!r} is truncated: {file.size} bytes, a header needs at least 8")
        (length,) = struct.unpack("<Q", file.read_at(0, 8))
        if length > file.size - 8:
            raise CorruptCacheFileError(
                f"{source!r} is truncated: its header claims {length} bytes, {file.size - 8} follow"
            )
        if length > MAX_HEADER_BYTES:
            raise CorruptCacheFileError(
                f"{source!r}: its header claims {length} bytes, at most {MAX_HEADER_BYTES} are read"
            )
        encoded = file.read_at(8, length)
        table = parse_json(encoded, what=f"{source!r}: the safetensors header", error=CorruptCacheFileError)
        if not isinstance(table, dict):
            raise CorruptCacheFileError(f"{source!r}: the safetensors header is not a JSON object")
        size = 8 + length + _tensor_bytes(cast("dict[str, Any]", table), source)
        if size != file.size:
            state = "truncated" if size > file.size else "too long"
            raise CorruptCacheFileError(
                f"{source!r} is {state}: its header and tensors take {size} bytes, the file has {file.size}"
            )
        data = file.read_at(0, size)
    if data[8 : 8 + length] != encoded:
        raise CorruptCacheFileError(f"{source!r} changed while it was read")
    return cast("dict[str, Any]", table), data


def _tensor_bytes(table: Mapping[str, Any], source: str) -> int:
    """The bytes of tensor data the safetensors header ``table`` declares: exactly the
    tensors ``keys`` and ``values`` (and ``states``: state checkpoints), each
    ``data_offsets`` as long as its dtype and shape make it, together filling the data
    without gap or overlap."""
    names = sorted(name for name in table if name != "__metadata__")
    if names not in (["keys", "values"], ["keys", "states", "values"]):
        raise CorruptCacheFileError(
            f"{source!r} holds the tensors {shown(names)}; a prefix cache holds keys and values (and states)"
        )
    spans: list[tuple[int, int, str]] = []
    for name in names:
        entry: object = table[name]
        fields = cast("dict[str, object]", entry) if isinstance(entry, dict) else {}
        dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        if not (
            isinstance(dtype, str)
            and dtype in _ITEM_BYTES
            and _is_counts(shape)
            and _is_counts(offsets)
            and len(offsets) == 2
        ):
            raise CorruptCacheFileError(
                f"{source!r}: the tensor {name!r} is declared as {shown(table[name])}; expected a dtype of "
                f"{sorted(_ITEM_BYTES)}, a shape of ints >= 0 and two data offsets, ints >= 0"
            )
        begin, end = offsets
        declared = math.prod(shape) * _ITEM_BYTES[dtype]
        if end - begin != declared:
            raise CorruptCacheFileError(
                f"{source!r}: the tensor {name!r} ({dtype} {shape}) takes {declared} bytes; its data offsets "
                f"{begin}..{end} span {end - begin}"
            )
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise CorruptCacheFileError(
                f"{source!r}: the tensor {name!r} starts at byte {begin} of the data, expected {position}"
            )
        position = end
    return position


def kvcache_header(table: Mapping[str, Any], source: str, key: str) -> Mapping[str, Any]:
    """The JSON object a safetensors header ``table`` holds as the metadata string ``key``.

    Raises:
        CorruptCacheFileError: there is no such string, or it is not a strict JSON object.
    """
    metadata: object = table.get("__metadata__")
    text = cast("dict[str, object]", metadata).get(key) if isinstance(metadata, dict) else None
    if not isinstance(text, str):
        raise CorruptCacheFileError(
            f"{source!r}: the header does not parse as a kvcache prefix cache (no {key!r} metadata string)"
        )
    header = parse_json(text, what=f"{source!r}: the kvcache header", error=CorruptCacheFileError)
    if not isinstance(header, dict):
        raise CorruptCacheFileError(f"{source!r}: the kvcache header is not a JSON object")
    return cast("dict[str, Any]", header)


def _is_counts(value: object) -> TypeGuard[list[int]]:
    """Whether ``value`` is a list of ints >= 0 (JSON ``true`` is not an int)."""
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in cast("list[object]", value)
    )


def same_json(value: object, expected: object) -> bool:
    """Whether a value read from JSON is ``expected`` with the same JSON types (``true``
    is not ``1``, ``1.0`` is not ``1``)."""
    return json.dumps(value, sort_keys=True) == json.dumps(expected, sort_keys=True)


def shown(value: object) -> str:
    """``repr(value)``, cut short for a message."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:117]}..."


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block's fields of a file's header, checked."""

    block_hash: bytes
    parent_hash: bytes | None
    salt: bytes | None
    token_ids: tuple[int, ...]
    checksum: str
    group: int


def block_entry(fields: object, index: int, config: CacheConfig, source: str) -> BlockEntry:
    """Block ``index``'s entry of the header of ``source`` for a pool of ``config``, parsed
    strictly (else :class:`~kvcache_core.errors.CorruptCacheFileError`): hashes 64 lowercase hex
    digits (``parent`` may be null), ``salt`` lowercase hex bytes or null, ``token_ids``
    exactly ``block_size`` ints in ``[0, MAX_TOKEN_ID]``, ``checksum`` 64 lowercase hex
    digits, ``group`` (0 when absent) an int in ``[0, num_groups)``. JSON ``true`` is not
    an int."""
    where = f"{source!r}: block {index}"
    if not isinstance(fields, dict):
        raise CorruptCacheFileError(f"{where}'s header entry is {shown(fields)}, not a JSON object")
    entry = cast("dict[str, Any]", fields)

    def field(name: str) -> object:
        if name not in entry:
            raise CorruptCacheFileError(f"{where}'s header entry has no {name!r}")
        return entry[name]

    def hex_field(name: str, pattern: re.Pattern[str], rule: str, *, nullable: bool) -> bytes | None:
        value = field(name)
        if value is None and nullable:
            return None
        if not isinstance(value, str) or pattern.fullmatch(value) is None:
            raise CorruptCacheFileError(f"{where}'s {name} is {shown(value)}; expected {rule}")
        return bytes.fromhex(value)

    hash_rule = "64 lowercase hex digits (32 bytes)"
    block_hash = hex_field("hash", _HASH_HEX, hash_rule, nullable=False)
    assert block_hash is not None
    parent = hex_field("parent", _HASH_HEX, f"null or {hash_rule}", nullable=True)
    salt = hex_field("salt", _HEX, "null or lowercase hex bytes", nullable=True)
    checksum = field("checksum")
    if not isinstance(checksum, str) or _HASH_HEX.fullmatch(checksum) is None:
        raise CorruptCacheFileError(f"{where}'s checksum is {shown(checksum)}; expected 64 lowercase hex digits")
    listed = field("token_ids")
    block_size = config.block_size
    tokens = cast("list[object]", listed) if isinstance(listed, list) else None
    if tokens is None or len(tokens) != block_size:
        count = f"token ids {shown(entry['token_ids'])}" if tokens is None else f"{len(tokens)} token ids"
        raise CorruptCacheFileError(f"{where} has {count}; expected a list of {block_size}")
    # JSON gives exact ints (bool is its own type): one pass over the types, then the range.
    token_ids = cast("list[int]", tokens)
    if set(map(type, tokens)) != {int} or min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID:
        position, token = next(
            (position, token)
            for position, token in enumerate(tokens)
            if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID
        )
        raise CorruptCacheFileError(
            f"{where}'s token id {position} is {shown(token)}; token ids are ints in [0, {MAX_TOKEN_ID}]"
        )
    group: object = entry.get("group", 0)
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < config.num_groups:
        raise CorruptCacheFileError(
            f"{where} is of KV-cache group {shown(group)}; the groups are ints 0 to {config.num_groups - 1}"
        )
    return BlockEntry(block_hash, parent, salt, tuple(token_ids), checksum, group)


def parse_container(data: bytes, source: str) -> Mapping[str, Any]:
    """The safetensors header table of a cache file held in memory (``data``, a remote
    tier's value), checked as :func:`read_container` checks a file's: a header within
    :data:`MAX_HEADER_BYTES` and the data, declaring exactly ``keys`` and ``values`` that
    fill ``data`` exactly. Nothing is copied.

    Raises:
        CorruptCacheFileError: as :func:`read_container`, naming ``source``.
    """
    if len(data) < 8:
        raise CorruptCacheFileError(f"{source!r} is truncated: {len(data)} bytes, a header needs at least 8")
    (length,) = struct.unpack_from("<Q", data, 0)
    if length > min(len(data) - 8, MAX_HEADER_BYTES):
        raise CorruptCacheFileError(
            f"{source!r}: its header claims {length} bytes; {len(data) - 8} follow (at most {MAX_HEADER_BYTES} are read)"
        )
    table = parse_json(
        bytes(data[8 : 8 + length]), what=f"{source!r}: the safetensors header", error=CorruptCacheFileError
    )
    if not isinstance(table, dict):
        raise CorruptCacheFileError(f"{source!r}: the safetensors header is not a JSON object")
    size = 8 + length + _tensor_bytes(cast("dict[str, Any]", table), source)
    if size != len(data):
        state = "truncated" if size > len(data) else "too long"
        raise CorruptCacheFileError(
            f"{source!r} is {state}: its header and tensors take {size} bytes, it has {len(data)}"
        )
    return cast("dict[str, Any]", table)
