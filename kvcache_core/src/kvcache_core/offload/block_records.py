"""The portable record format of prefix-cached blocks (the files of
``manager.save_prefix_cache(path)``, disk and remote tier records): encode, decode, check.

Requires the ``tiers`` extra (``pip install "kvcache-core[tiers]"``: safetensors).

One file, in the safetensors format (no pickle anywhere): two tensors, ``keys`` and
``values``, ``[pool_layers, n, block_size, num_heads, width]`` whatever the pool's layout,
in core's host form of the pool's dtype (what ``KvStorage.blocks_to_host`` gives on every
backend, :mod:`kvcache_core.offload.host_form`: bfloat16 as ``uint16`` bit patterns, quantized
blocks as packed ``uint8``), and a JSON header in the safetensors metadata under
``"kvcache"``::

    {"format": "kvcache-prefix-cache", "version": 2, "namespace": model_id or null,
     "geometry": {"num_layers", "num_heads", "head_dim", "block_size"}, "dtype": pool dtype,
     "tensor_dtype": the NumPy dtype of the stored tensors, the host form of "dtype",
     "layout": the saving pool's layout (for information: data is layout-free),
     "hash_algorithm": "sha256:kvcache-core/block-hash/v1",
     "blocks": [{"hash", "parent" (hex or null), "salt" (hex or null), "token_ids",
                 "checksum": sha256 of the block's keys then values bytes,
                 "group": its KV-cache group}, ...]}

A pool with KV-cache groups (``CacheConfig.layer_specs``) saves one block per hash and
group (a block holds one group's layers), and its geometry names the groups
(``"kv_groups"``: ``[window, layers]`` each; also for one group when some layers keep no
K/V), so it loads only into a pool of the same groups. State checkpoints come in version 3
(:mod:`kvcache_core.offload.state_records`). A pool whose values differ in width from its keys (``CacheConfig.value_head_dim``)
states it in its geometry (``"value_head_dim"``; its ``values`` tensor is that wide), so it
loads only into a pool of the same widths; a file without it holds values of ``head_dim``. Blocks come parents first. So a file saved by one backend and layout loads into any other
with the same namespace, geometry and dtype. Loading checks everything before it touches
the pool (format, version, namespace, geometry, dtype, every tensor's stored dtype against
the header's (nothing is cast), shapes, every checksum, a quantized block's scales finite
and >= 0, every hash recomputed from its parent, salt and tokens) and refuses with a specific
:class:`~kvcache_core.errors.KvCacheError`, loading nothing; every header field is
parsed strictly (types, ranges, nesting depth). Files are handled by
:mod:`kvcache_core.offload.safe_files`: writing goes to a temporary file created exclusively under
an unpredictable name in the same directory, flushed to disk, then renamed (a reader never
sees half a file, a symbolic link is never followed); loading reads a regular file only,
no further than its header declares.

Version 1 files (no ``"tensor_dtype"``) still load: their tensors were the host form too,
except bfloat16, stored as float32 values (torch) or safetensors ``BF16`` (JAX); both are
read back exactly, and a float32 value that is not a bfloat16 value is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.errors import (
    CorruptCacheFileError,
    IncompatibleCacheFileError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from kvcache_core.offload import host_form
from kvcache_core.offload.file_header import block_entry, kvcache_header, read_container, same_json, shown
from kvcache_core.offload.file_tensors import block_in_host_form, load_tensors, stack_blocks
from kvcache_core.offload.safe_files import file_path, write_file_atomically
from kvcache_core.offload.state_records import (
    STATE_FORMAT_VERSION,
    STATE_RECORD_GROUP,
    check_state_arrays,
    checkpoint_checksum,
    load_checkpoint_bytes,
    parse_tensors,
    state_arrays_of,
    state_problem,
)
from kvcache_core.paging.prefix import PrefixEntry, hash_block, namespace_root

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASH_ALGORITHM",
    "READABLE_VERSIONS",
    "BlockRecord",
    "block_checksum",
    "decode_blocks",
    "encode_blocks",
    "file_geometry",
    "read_blocks",
    "record_key",
    "split_key",
    "write_blocks",
]

FORMAT_NAME = "kvcache-prefix-cache"
FORMAT_VERSION = 2
#: The versions this kvcache reads (1: no ``"tensor_dtype"``; 3: state checkpoints, see
#: :mod:`kvcache_core.offload.state_records`).
READABLE_VERSIONS = (1, 2, STATE_FORMAT_VERSION)
HASH_ALGORITHM = "sha256:kvcache-core/block-hash/v1"
_METADATA_KEY = "kvcache"


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """One cached block off the pool: its place in a hash chain and its K/V.

    Attributes:
        block_hash: its 32-byte hash.
        parent_hash: the previous block's hash, ``None`` for a prompt's first block.
        salt: the salt hashed with it.
        token_ids: its ``block_size`` token ids.
        keys, values: ``[pool_layers, block_size, num_heads, head_dim]`` host arrays.
        group: the KV-cache group whose layers it holds (0 without groups), or
            :data:`~kvcache_core.contract.states.STATE_RECORD_GROUP` for a state checkpoint
            (then ``keys`` are its bytes and ``values`` are empty:
            :mod:`kvcache_core.offload.state_records`).
    """

    block_hash: bytes
    parent_hash: bytes | None
    salt: bytes | None
    token_ids: tuple[int, ...]
    keys: npt.NDArray[Any]
    values: npt.NDArray[Any]
    group: int = 0

    @classmethod
    def of_entry(
        cls, entry: PrefixEntry, keys: npt.NDArray[Any], values: npt.NDArray[Any], group: int = 0
    ) -> BlockRecord:
        """The record of a cached block of the prefix-cache entry ``entry``, whose K/V were
        copied to the host."""
        parent = None if entry.parent is None else entry.parent.block_hash
        return cls(entry.block_hash, parent, entry.salt, entry.token_ids, keys, values, group)

    @classmethod
    def of_checkpoint(cls, entry: PrefixEntry, packed: npt.NDArray[Any]) -> BlockRecord:
        """The record of the state checkpoint filed under ``entry``'s hash, whose bytes
        (:func:`~kvcache_core.offload.state_records.pack_states`) are ``packed``."""
        return cls.of_entry(entry, packed, np.zeros(0, np.uint8), STATE_RECORD_GROUP)

    @property
    def is_checkpoint(self) -> bool:
        """Whether it is a state checkpoint's record rather than a block's."""
        return self.group == STATE_RECORD_GROUP

    @property
    def nbytes(self) -> int:
        """Bytes of K/V it holds."""
        return int(self.keys.nbytes + self.values.nbytes)

    @property
    def key(self) -> bytes:
        """What an offload tier files it under: :func:`record_key` of its hash and group
        (the bare hash in group 0, so a pool without groups keys blocks by hash)."""
        return record_key(self.block_hash, self.group)


def record_key(block_hash: bytes, group: int) -> bytes:
    """The key of the record of ``block_hash`` in KV-cache group ``group``: the 32-byte hash
    itself for group 0, the hash followed by the group as two big-endian bytes for the
    others. Two groups' records of one hash never share a key.

    Raises:
        InvalidArgumentError: ``block_hash`` is not 32 bytes, or ``group`` not an int in
            ``[0, 65535]``.
    """
    if not isinstance(block_hash, bytes) or len(block_hash) != 32:
        raise InvalidArgumentError(f"a block hash is 32 bytes, got {block_hash!r}")
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < 1 << 16:
        raise InvalidArgumentError(f"a KV-cache group is an int in [0, 65535], got {group!r}")
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "big")


def split_key(key: bytes) -> tuple[bytes, int]:
    """``(block_hash, group)`` of a key :func:`record_key` made.

    Raises:
        InvalidArgumentError: ``key`` is not 32 or 34 bytes.
    """
    if not isinstance(key, bytes) or len(key) not in (32, 34):
        raise InvalidArgumentError(f"a record key is 32 bytes (group 0) or 34 (other groups), got {key!r}")
    return (key[:32], int.from_bytes(key[32:], "big")) if len(key) == 34 else (key, 0)


def block_checksum(keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> str:
    """SHA-256 (hex) of one block's key bytes then value bytes."""
    digest = hashlib.sha256(np.ascontiguousarray(keys).tobytes())
    digest.update(np.ascontiguousarray(values).tobytes())
    return digest.hexdigest()


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()


def file_geometry(config: CacheConfig) -> dict[str, Any]:
    geometry: dict[str, Any] = {
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "head_dim": config.head_dim,
        "block_size": config.block_size,
    }
    if config.value_head_dim is not None:
        geometry["value_head_dim"] = config.value_head_dim
    if config.num_groups > 1 or config.pool_layers != config.num_layers:  # some layers keep no K/V
        geometry["kv_groups"] = [[group.window, list(group.layers)] for group in config.kv_groups]
    return geometry


# -- the file -----------------------------------------------------------------------------


def write_blocks(path: str | os.PathLike[str], config: CacheConfig, records: list[BlockRecord]) -> int:
    """Write ``records`` (parents before children) to ``path`` in the portable format,
    through a temporary name renamed when complete.

    The temporary file is created exclusively under an unpredictable name (see
    :mod:`kvcache_core.offload.safe_files`): a symbolic link is never followed, and of saves to one
    path from many threads or processes the last rename wins, whole.

    Returns:
        The bytes written.

    Raises:
        InvalidTypeError, InvalidArgumentError: ``path`` is not a str or os.PathLike, or is
            empty or holds a NUL character.
        CacheFileError: the file cannot be written (no permission, no such directory, disk
            full); ``path`` is as it was and nothing is left beside it.
        ArrayTypeError, DTypeMismatchError, ShapeMismatchError: a record's keys or values
            are not one block in the host form of ``config.dtype`` (nothing is written).
    """
    target = file_path(path)
    return write_file_atomically(target, encode_blocks(config, records), what="the cache file")


def encode_blocks(config: CacheConfig, records: list[BlockRecord]) -> bytes:
    """The bytes of a file :func:`write_blocks` writes for ``records`` (a remote tier's
    value is the file of one record).

    Raises:
        ArrayTypeError, DTypeMismatchError, ShapeMismatchError: a record's keys or values
            are not one block in the host form of ``config.dtype``.
    """
    from safetensors.numpy import save  # the [tiers] extra

    checkpoints = [record for record in records if record.is_checkpoint]
    blocks = [record for record in records if not record.is_checkpoint]
    keys, values = stack_blocks(config, [(record.keys, record.values) for record in blocks])
    header: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": STATE_FORMAT_VERSION if checkpoints else FORMAT_VERSION,
        "namespace": config.model_id,
        "geometry": file_geometry(config),
        "dtype": config.dtype,
        "tensor_dtype": keys.dtype.name,
        "layout": config.kv_layout,
        "hash_algorithm": HASH_ALGORITHM,
        "blocks": [
            {
                "hash": record.block_hash.hex(),
                "parent": _hex(record.parent_hash),
                "salt": _hex(record.salt),
                "token_ids": list(record.token_ids),
                "checksum": block_checksum(record.keys, record.values),
                "group": record.group,
            }
            for record in blocks
        ],
    }
    tensors = {"keys": np.ascontiguousarray(keys), "values": np.ascontiguousarray(values)}
    if checkpoints:
        for index, record in enumerate(checkpoints):
            problem = state_problem(config, record.keys, record.values)
            if problem is not None:
                raise ShapeMismatchError(f"checkpoint {index}: {problem}")
        header["state_arrays"] = state_arrays_of(config)
        header["checkpoints"] = [
            {
                "hash": record.block_hash.hex(),
                "parent": _hex(record.parent_hash),
                "salt": _hex(record.salt),
                "token_ids": list(record.token_ids),
                "checksum": checkpoint_checksum(record.keys),
            }
            for record in checkpoints
        ]
        tensors["states"] = np.stack([record.keys for record in checkpoints])
    data: bytes = save(tensors, metadata={_METADATA_KEY: json.dumps(header, separators=(",", ":"))})
    return data


def read_blocks(
    path: str | os.PathLike[str], config: CacheConfig, *, chained: bool = True, size: int | None = None
) -> list[BlockRecord]:
    """Read and check a file :func:`write_blocks` wrote, for a pool of ``config``.

    With ``chained`` (a saved prefix cache), every parent must be an earlier block of the
    file; without it (one block of a disk tier), parents may be anywhere. With ``size``
    (the bytes :func:`write_blocks` returned), a file of another size is refused unread.

    Only a regular file is read (a symbolic link as the last component, a FIFO, a device
    or a directory is refused without blocking), and no more of it than its header
    declares, once that header was checked against the file's size. Every field of the
    header is checked strictly (types, ranges, nesting depth) and every block (checksum,
    and its hash recomputed from its parent hash, salt and tokens under
    ``config.model_id``'s namespace) before anything is returned.

    Raises:
        InvalidTypeError, InvalidArgumentError: ``path`` is not a str or os.PathLike, or is
            empty or holds a NUL character.
        CacheFileError: the file cannot be read, or is not a regular file.
        CorruptCacheFileError: truncated, a header that does not parse or holds a value of
            the wrong type or out of range, a checksum or hash that does not match (the
            message names the block).
        IncompatibleCacheFileError: another format, an unknown version, another namespace,
            geometry or dtype.
    """
    source = Path(file_path(path))
    table, data = read_container(str(source), size)
    return decode_blocks(table, data, config, source, chained=chained)


def decode_blocks(
    table: Mapping[str, Any], data: bytes, config: CacheConfig, source: Path, *, chained: bool = True
) -> list[BlockRecord]:
    """The records of a file's bytes ``data`` whose safetensors header table ``table`` was
    checked (:func:`~kvcache_core.offload.file_header.read_container` or
    :func:`~kvcache_core.offload.file_header.parse_container`), checked as :func:`read_blocks`
    checks them; ``source`` names them in messages.

    Raises:
        CorruptCacheFileError, IncompatibleCacheFileError: as :func:`read_blocks`.
    """
    header = kvcache_header(table, str(source), _METADATA_KEY)
    _check_compatible(header, config, source)
    check_state_arrays(header, config, source)
    keys, values = load_tensors(data, header, config, source)
    listed = header.get("blocks")
    if not isinstance(listed, list):
        raise CorruptCacheFileError(f"{str(source)!r}: the header's 'blocks' is not a list")
    blocks = cast("list[object]", listed)
    # a quantized pool's host blocks are packed uint8, raw bytes + a float32 scale
    expected = host_form.host_shape(config, len(blocks))
    expected_values = host_form.host_shape(config, len(blocks), "values")
    if keys.shape != expected or values.shape != expected_values:
        raise CorruptCacheFileError(
            f"{str(source)!r}: keys {keys.shape} and values {values.shape} do not match the header's "
            f"{len(blocks)} blocks, expected {expected} and {expected_values}"
        )
    root = namespace_root(config.model_id)
    seen: set[bytes] = set()
    records: list[BlockRecord] = []
    for index, fields in enumerate(blocks):
        record = _record(fields, index, keys[:, index], values[:, index], config, source)
        if chained and record.parent_hash is not None and record.parent_hash not in seen:
            raise CorruptCacheFileError(
                f"{str(source)!r}: block {index}'s parent {record.parent_hash.hex()[:16]}... is not an earlier block"
            )
        parent = root if record.parent_hash is None else record.parent_hash
        if hash_block(parent, record.token_ids, record.salt) != record.block_hash:
            raise CorruptCacheFileError(
                f"{str(source)!r}: block {index}'s hash does not match its parent, salt and token ids"
            )
        seen.add(record.block_hash)
        records.append(record)
    records.extend(_checkpoints(header, data, config, source, seen if chained else None))
    return records


def _checkpoints(
    header: Mapping[str, Any], data: bytes, config: CacheConfig, source: Path, blocks: set[bytes] | None
) -> list[BlockRecord]:
    """The state checkpoints a file of version 3 lists, checked like its blocks (checksum,
    hash) and, with ``blocks`` (a saved prefix cache), each the checkpoint of one of them."""
    count = check_state_arrays(header, config, source)
    if not count:
        return []
    listed = cast("list[object]", header["checkpoints"])
    packed = load_checkpoint_bytes(parse_tensors(data, source), count, config, source)
    root = namespace_root(config.model_id)
    records: list[BlockRecord] = []
    for index, fields in enumerate(listed):
        if _names_group(fields):
            raise CorruptCacheFileError(f"{str(source)!r}: checkpoint {index}'s header entry names a group")
        entry = block_entry(fields, index, config, f"{source} (checkpoints)")
        if checkpoint_checksum(packed[index]) != entry.checksum:
            raise CorruptCacheFileError(f"{str(source)!r}: checkpoint {index}'s data does not match its checksum")
        parent = root if entry.parent_hash is None else entry.parent_hash
        if hash_block(parent, entry.token_ids, entry.salt) != entry.block_hash:
            raise CorruptCacheFileError(
                f"{str(source)!r}: checkpoint {index}'s hash does not match its parent, salt and token ids"
            )
        if blocks is not None and entry.block_hash not in blocks:
            raise CorruptCacheFileError(f"{str(source)!r}: checkpoint {index} is of no block of the file")
        records.append(
            BlockRecord(
                entry.block_hash,
                entry.parent_hash,
                entry.salt,
                entry.token_ids,
                packed[index].copy(),
                np.zeros(0, np.uint8),
                STATE_RECORD_GROUP,
            )
        )
    return records


def _names_group(fields: object) -> bool:
    """Whether a checkpoint's header entry names a KV-cache group (a checkpoint has none)."""
    return isinstance(fields, dict) and "group" in cast("dict[str, object]", fields)


def _check_compatible(header: Mapping[str, Any], config: CacheConfig, source: Path) -> None:
    name = f"{str(source)!r}"
    if not same_json(header.get("format"), FORMAT_NAME):
        raise IncompatibleCacheFileError(f"{name} is not a {FORMAT_NAME} file (format {shown(header.get('format'))})")
    if not any(same_json(header.get("version"), version) for version in READABLE_VERSIONS):
        raise IncompatibleCacheFileError(
            f"{name} has format version {shown(header.get('version'))}; this kvcache reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if not same_json(header.get("hash_algorithm"), HASH_ALGORITHM):
        raise IncompatibleCacheFileError(
            f"{name} hashes with {shown(header.get('hash_algorithm'))}; this kvcache uses {HASH_ALGORITHM!r}"
        )
    if not same_json(header.get("namespace"), config.model_id):
        raise IncompatibleCacheFileError(
            f"{name} holds blocks of namespace {shown(header.get('namespace'))}; this pool's model_id is "
            f"{config.model_id!r}"
        )
    geometry: object = header.get("geometry")
    if isinstance(geometry, dict):
        fields = cast("dict[str, object]", geometry)
        stated = fields.get("value_head_dim")
        if not same_json(stated, config.value_head_dim):
            raise IncompatibleCacheFileError(
                f"{name} holds values of width {shown(stated) if stated is not None else 'head_dim'} "
                f"(value_head_dim {shown(stated)}); this pool's value_head_dim is {config.value_head_dim!r}"
            )
    if not same_json(header.get("geometry"), file_geometry(config)):
        raise IncompatibleCacheFileError(
            f"{name} has geometry {shown(header.get('geometry'))}; this pool's is {file_geometry(config)!r}"
        )
    if not same_json(header.get("dtype"), config.dtype):
        raise IncompatibleCacheFileError(
            f"{name} holds {shown(header.get('dtype'))} blocks; this pool is {config.dtype!r}"
        )
    layout = header.get("layout")
    if layout is not None and not isinstance(layout, str):
        raise CorruptCacheFileError(f"{name}: the header's layout {shown(layout)} is not a str or null")


def _record(
    fields: object,
    index: int,
    keys: npt.NDArray[Any],
    values: npt.NDArray[Any],
    config: CacheConfig,
    source: Path,
) -> BlockRecord:
    entry = block_entry(fields, index, config, str(source))
    if block_checksum(keys, values) != entry.checksum:
        raise CorruptCacheFileError(f"{str(source)!r}: block {index}'s data does not match its checksum")
    keys, values = block_in_host_form(config, keys, values, f"{str(source)!r}: block {index}")
    return BlockRecord(entry.block_hash, entry.parent_hash, entry.salt, entry.token_ids, keys, values, entry.group)


# -- the manager's side -------------------------------------------------------------------
