"""The transfer ticket: what a producer's :meth:`KvTransferAgent.export` hands a consumer so it
can pull a request's blocks and states, and its wire form (msgpack, versioned, parsed strictly).

Wire form, one msgpack map (version 3; version 2 carried CRC-32 digests of 4 bytes and
version 1 was never released: both are refused by their version)::

    {"format": "kvcache-transfer-ticket", "version": 3,
     "agent": the producer's NIXL agent name, "address": its side channel ("tcp://host:port"),
     "namespace": model_id or None,
     "geometry": {"num_layers" (the storage's layers), "num_heads", "head_dim", "value_head_dim"
                  (the pool's defaults), "block_size", "num_blocks"},
     "layers": [[window, chunk, keeps_kv, num_heads, head_dim, value_head_dim], ...] per model
               layer (window, chunk: int or None; geometry 0 for a layer keeping no K/V),
     "dtype": the pool dtype, "layout": the producer pool's layout,
     "regions": [[storage layer, part, address, device_kind, device_id], ...],
     "groups": [[first logical block, block count], ...] per KV-cache group,
     "blocks": int64 little-endian bytes, every group's source blocks in group order,
     "token_ids": int64 little-endian bytes, "num_tokens": int,
     "digests": 8 bytes per block (a position-weighted 64-bit sum, kvcache_core.transfer.digests),
                or empty (device memory),
     "states": [[layer, name, dtype, [dims], address, device_kind, device_id], ...] per state
               array (the request's slot), "state_digests": 8 bytes per state array, or empty,
     "lease": 32 hex characters, "expires_at": Unix time in seconds}

Parsing accepts exactly these keys, each of its type (``bool`` is not an int) and range,
and costs no more memory than the payload (arrays are sized by the payload's bytes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast

import msgpack
import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import DTYPE_SIZES, KV_LAYOUTS, MAX_TOKEN_ID, QUANTIZED_DTYPES
from kvcache_core.contract.regions import REGION_DEVICE_KINDS, REGION_PARTS
from kvcache_core.contract.states import STATE_DTYPES
from kvcache_core.errors import TransferError
from kvcache_core.transfer.digests import DIGEST_BYTES

# msgpack ships no type information.
_packb = cast("Callable[..., bytes]", msgpack.packb)  # pyright: ignore[reportUnknownMemberType]
_unpackb = cast("Callable[..., object]", msgpack.unpackb)  # pyright: ignore[reportUnknownMemberType]

__all__ = [
    "MAX_LAYERS",
    "MAX_TICKET_BYTES",
    "TICKET_FORMAT",
    "TICKET_VERSION",
    "LayerDescription",
    "RegionAddress",
    "StateAddress",
    "TransferTicket",
]

TICKET_FORMAT: Final = "kvcache-transfer-ticket"
TICKET_VERSION: Final = 3
#: Versions that existed and are refused, and why.
_OLD_VERSIONS: Final = {
    1: "version 1 was never released",
    2: "version 2 carried CRC-32 digests, 4 bytes a block, which this one no longer computes",
}
#: The most model layers a ticket describes, and state arrays it lists.
MAX_LAYERS: Final = 1 << 16
#: The largest ticket accepted (a 1M-token request's ids and descriptors fit many times).
MAX_TICKET_BYTES: Final = 64 << 20
_DIGEST_BYTES: Final = DIGEST_BYTES
_LEASE = re.compile(r"\A[0-9a-f]{32}\Z")
_ADDRESS = re.compile(r"\Atcp://[0-9A-Za-z.\-\[\]:]{1,255}:[0-9]{1,5}\Z")
_GEOMETRY: Final = ("num_layers", "num_heads", "head_dim", "value_head_dim", "block_size", "num_blocks")
_KEYS: Final = frozenset(
    {
        "format",
        "version",
        "agent",
        "address",
        "namespace",
        "geometry",
        "dtype",
        "layout",
        "regions",
        "blocks",
        "token_ids",
        "num_tokens",
        "digests",
        "lease",
        "expires_at",
        "layers",
        "groups",
        "states",
        "state_digests",
    }
)

#: One model layer: window, chunk, keeps_kv, num_heads, head_dim, value_head_dim.
LayerDescription = tuple[int | None, int | None, bool, int, int, int]


@dataclass(frozen=True)
class RegionAddress:
    """Where one layer's part of the producer's pool lives (its shape follows from the
    ticket's geometry, layout and dtype)."""

    layer: int
    part: str
    address: int
    device_kind: str
    device_id: int


@dataclass(frozen=True)
class StateAddress:
    """Where one state array of the request's slot lives in the producer's state pool:
    ``nbytes`` (its shape's elements times its dtype's size) at ``address``."""

    layer: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    address: int
    device_kind: str
    device_id: int

    @property
    def nbytes(self) -> int:
        """Bytes of the request's array."""
        return math.prod(self.shape) * STATE_DTYPES[self.dtype]


@dataclass(frozen=True, eq=False)
class TransferTicket:
    """A request's cache, exported by a producer and pinned there until :attr:`expires_at`
    or until a consumer imports it.

    Attributes:
        agent: the producer's NIXL agent name.
        address: the producer's side channel, ``"tcp://host:port"``.
        namespace: the producer pool's ``model_id`` (``None`` when unset).
        geometry: ``{"num_layers", "num_heads", "head_dim", "value_head_dim", "block_size",
            "num_blocks"}`` (``num_layers``: the storage's; ``value_head_dim``: the values'
            width, ``head_dim`` unless it differs).
        layers: per model layer, ``(window, chunk, keeps_kv, num_heads, head_dim,
            value_head_dim)``.
        dtype: the pool dtype; layout: the producer pool's layout.
        regions: the producer pool's memory, per storage layer and part.
        groups: per KV-cache group, ``(first, count)``: its blocks hold the logical blocks
            ``first .. first + count - 1`` (a sliding group released those before ``first``).
        blocks: ``[n]`` int64, every group's blocks in order, group after group.
        token_ids: ``[num_tokens]`` int64, the request's tokens.
        digests: ``n * 8`` bytes, each block's position-weighted 64-bit sum
            (:mod:`kvcache_core.transfer.digests`); empty when the producer's pool is device
            memory (not checked then).
        states: the request's state slot, one :class:`StateAddress` per state array.
        state_digests: 8 bytes per state array (their digests), or empty (device memory).
        lease: the lease id (32 hex characters); expires_at: Unix time it ends.
    """

    agent: str
    address: str
    namespace: str | None
    geometry: dict[str, int]
    dtype: str
    layout: str
    regions: tuple[RegionAddress, ...]
    blocks: npt.NDArray[np.int64]
    token_ids: npt.NDArray[np.int64]
    digests: bytes
    lease: str
    expires_at: float
    layers: tuple[LayerDescription, ...] = ()
    groups: tuple[tuple[int, int], ...] = ()
    states: tuple[StateAddress, ...] = ()
    state_digests: bytes = b""

    @property
    def num_tokens(self) -> int:
        """Tokens the request holds."""
        return int(self.token_ids.shape[0])

    def to_bytes(self) -> bytes:
        """The wire form (msgpack)."""
        packed = _packb(
            {
                "format": TICKET_FORMAT,
                "version": TICKET_VERSION,
                "agent": self.agent,
                "address": self.address,
                "namespace": self.namespace,
                "geometry": dict(self.geometry),
                "dtype": self.dtype,
                "layout": self.layout,
                "regions": [[r.layer, r.part, r.address, r.device_kind, r.device_id] for r in self.regions],
                "blocks": self.blocks.astype("<i8").tobytes(),
                "token_ids": self.token_ids.astype("<i8").tobytes(),
                "num_tokens": self.num_tokens,
                "digests": self.digests,
                "lease": self.lease,
                "expires_at": float(self.expires_at),
                "layers": [list(layer) for layer in self.layers],
                "groups": [list(group) for group in self.groups],
                "states": [_state_fields(state) for state in self.states],
                "state_digests": self.state_digests,
            },
            use_bin_type=True,
        )
        return packed

    @classmethod
    def from_bytes(cls, payload: bytes) -> TransferTicket:
        """Parse a ticket's wire form strictly.

        Raises:
            TransferError: not a ticket of this format and version, a field of the wrong
                type or out of range, or larger than :data:`MAX_TICKET_BYTES`.
        """
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TransferError(f"a transfer ticket is bytes, got {type(payload).__name__}")
        data = bytes(payload)
        if len(data) > MAX_TICKET_BYTES:
            raise TransferError(f"a transfer ticket is at most {MAX_TICKET_BYTES} bytes, got {len(data)}")
        try:
            fields = _unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # any malformed payload is one refusal
            raise TransferError(f"the transfer ticket is not valid msgpack: {exc}") from None
        return _parse(fields)


def _state_fields(state: StateAddress) -> list[object]:
    return [state.layer, state.name, state.dtype, list(state.shape), state.address, state.device_kind, state.device_id]


def _fail(message: str) -> TransferError:
    return TransferError(f"malformed transfer ticket: {message}")


def _int(value: object, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _fail(f"{name} must be an int in [{low}, {high}], got {value!r}"[:300])
    return value


def _str(value: object, name: str, limit: int = 256) -> str:
    if type(value) is not str or not 0 < len(value) <= limit:
        raise _fail(f"{name} must be a non-empty str of at most {limit} characters, got {value!r}"[:300])
    return value


def _int64s(value: object, name: str, count: int | None = None) -> npt.NDArray[np.int64]:
    if type(value) is not bytes or len(value) % 8 or (count is not None and len(value) != 8 * count):
        wanted = "8 bytes per int" if count is None else f"{8 * count} bytes ({count} int64)"
        raise _fail(f"{name} must be bytes of little-endian int64, {wanted}")
    array: npt.NDArray[np.int64] = np.frombuffer(value, dtype="<i8").astype(np.int64)
    return array


def _parse(payload: object) -> TransferTicket:
    if type(payload) is not dict:
        raise _fail(f"expected a map, got {type(payload).__name__}")
    fields = cast("dict[str, object]", payload)
    form, version = fields.get("format"), fields.get("version")
    if form != TICKET_FORMAT or type(version) is not int or version != TICKET_VERSION:
        why = _OLD_VERSIONS.get(version) if form == TICKET_FORMAT and type(version) is int else None
        raise _fail(
            f"format {form!r} version {version!r}"[:200]
            + f"; this reads {TICKET_FORMAT!r} version {TICKET_VERSION} only"
            + (f" ({why}): re-export the request with this version" if why else "")
        )
    if set(fields) != _KEYS:
        raise _fail(f"expected the keys {sorted(_KEYS)}, got {sorted(map(str, fields))}"[:400])
    address = _str(fields["address"], "address")
    if not _ADDRESS.match(address):
        raise _fail(f"address must be 'tcp://host:port', got {address!r}")
    namespace = fields["namespace"]
    if namespace is not None:
        namespace = _str(namespace, "namespace", 4096)
    geometry_in = cast("dict[str, object]", fields["geometry"])
    if type(geometry_in) is not dict or set(geometry_in) != set(_GEOMETRY):
        raise _fail(f"geometry must have exactly the keys {list(_GEOMETRY)}")
    geometry = {name: _int(geometry_in[name], f"geometry.{name}", 1, 2**31 - 1) for name in _GEOMETRY}
    dtype = _str(fields["dtype"], "dtype")
    layout = _str(fields["layout"], "layout")
    if dtype not in DTYPE_SIZES or layout not in KV_LAYOUTS:
        raise _fail(f"dtype {dtype!r} or layout {layout!r} unknown (dtypes {list(DTYPE_SIZES)}, layouts {KV_LAYOUTS})")
    parts = REGION_PARTS if dtype in QUANTIZED_DTYPES else REGION_PARTS[:2]
    raw_regions = cast("list[object]", fields["regions"])
    if type(raw_regions) is not list or len(raw_regions) != geometry["num_layers"] * len(parts):
        raise _fail(f"regions must list {len(parts)} parts of each of {geometry['num_layers']} layers")
    regions: list[RegionAddress] = []
    for index, item in enumerate(raw_regions):
        raw = cast("list[object]", item)
        if type(raw) is not list or len(raw) != 5:
            raise _fail(f"regions[{index}] must be [layer, part, address, device_kind, device_id]")
        layer = _int(raw[0], f"regions[{index}].layer", 0, geometry["num_layers"] - 1)
        part = _str(raw[1], f"regions[{index}].part")
        kind = _str(raw[3], f"regions[{index}].device_kind")
        if part not in parts or kind not in REGION_DEVICE_KINDS:
            raise _fail(f"regions[{index}] has part {part!r} (of {parts}) on {kind!r} (of {REGION_DEVICE_KINDS})")
        regions.append(
            RegionAddress(
                layer,
                part,
                _int(raw[2], f"regions[{index}].address", 1, 2**64 - 1),
                kind,
                _int(raw[4], f"regions[{index}].device_id", 0, 1 << 16),
            )
        )
    if len({(region.layer, region.part) for region in regions}) != len(regions):
        raise _fail("regions name a layer's part twice")
    num_tokens = _int(fields["num_tokens"], "num_tokens", 1, 2**40)
    token_ids = _int64s(fields["token_ids"], "token_ids", num_tokens)
    if token_ids.size and (int(token_ids.min()) < 0 or int(token_ids.max()) > MAX_TOKEN_ID):
        raise _fail(f"token ids must be in [0, {MAX_TOKEN_ID}]")
    count = math.ceil(num_tokens / geometry["block_size"])
    groups = _groups(fields["groups"], count)
    blocks = _int64s(fields["blocks"], "blocks", sum(held for _, held in groups))
    if int(blocks.min()) < 0 or int(blocks.max()) >= geometry["num_blocks"]:
        raise _fail(f"blocks must be in [0, {geometry['num_blocks']})")
    digests = fields["digests"]
    if type(digests) is not bytes or len(digests) not in (0, _DIGEST_BYTES * len(blocks)):
        raise _fail(f"digests must be {_DIGEST_BYTES} bytes per block ({_DIGEST_BYTES * len(blocks)} bytes) or empty")
    layers = _layers(fields["layers"])
    states = _states(fields["states"], len(layers))
    state_digests = fields["state_digests"]
    if type(state_digests) is not bytes or len(state_digests) not in (0, _DIGEST_BYTES * len(states)):
        raise _fail(f"state_digests must be {_DIGEST_BYTES} bytes per state array or empty")
    lease = _str(fields["lease"], "lease")
    if not _LEASE.match(lease):
        raise _fail(f"lease must be 32 hex characters, got {lease!r}"[:200])
    expires_at = fields["expires_at"]
    if type(expires_at) is not float or not math.isfinite(expires_at) or expires_at < 0:
        raise _fail(f"expires_at must be a finite float >= 0, got {expires_at!r}"[:200])
    return TransferTicket(
        agent=_str(fields["agent"], "agent"),
        address=address,
        namespace=namespace,
        geometry=geometry,
        dtype=dtype,
        layout=layout,
        regions=tuple(regions),
        blocks=blocks,
        token_ids=token_ids,
        digests=digests,
        lease=lease,
        expires_at=expires_at,
        layers=layers,
        groups=groups,
        states=states,
        state_digests=state_digests,
    )


def _list(value: object, name: str, low: int, high: int) -> list[object]:
    if type(value) is not list or not low <= len(cast("list[object]", value)) <= high:
        raise _fail(f"{name} must be a list of {low} to {high} items")
    return cast("list[object]", value)


def _optional(value: object, name: str) -> int | None:
    return None if value is None else _int(value, name, 1, 2**31 - 1)


def _groups(value: object, count: int) -> tuple[tuple[int, int], ...]:
    """Each group's ``(first, held)``: every group's blocks end at the request's last block."""
    groups: list[tuple[int, int]] = []
    for index, item in enumerate(_list(value, "groups", 1, MAX_LAYERS)):
        raw = _list(item, f"groups[{index}]", 2, 2)
        first = _int(raw[0], f"groups[{index}].first", 0, count - 1)
        held = _int(raw[1], f"groups[{index}].count", 1, count)
        if first + held != count:
            raise _fail(
                f"groups[{index}] holds blocks {first} .. {first + held - 1}; the request's last is {count - 1}"
            )
        groups.append((first, held))
    return tuple(groups)


def _layers(value: object) -> tuple[LayerDescription, ...]:
    layers: list[LayerDescription] = []
    for index, item in enumerate(_list(value, "layers", 1, MAX_LAYERS)):
        raw = _list(item, f"layers[{index}]", 6, 6)
        keeps_kv = raw[2]
        if type(keeps_kv) is not bool:
            raise _fail(f"layers[{index}].keeps_kv must be a bool, got {keeps_kv!r}"[:200])
        low, high = (1, 2**31 - 1) if keeps_kv else (0, 0)  # a layer keeping no K/V has no geometry
        heads, head_dim, value_width = (
            _int(raw[position], f"layers[{index}][{position}]", low, high) for position in (3, 4, 5)
        )
        window, chunk = _optional(raw[0], f"layers[{index}].window"), _optional(raw[1], f"layers[{index}].chunk")
        layers.append((window, chunk, keeps_kv, heads, head_dim, value_width))
    return tuple(layers)


def _states(value: object, num_layers: int) -> tuple[StateAddress, ...]:
    states: list[StateAddress] = []
    for index, item in enumerate(_list(value, "states", 0, MAX_LAYERS)):
        raw = _list(item, f"states[{index}]", 7, 7)
        dtype = _str(raw[2], f"states[{index}].dtype")
        kind = _str(raw[5], f"states[{index}].device_kind")
        if dtype not in STATE_DTYPES or kind not in REGION_DEVICE_KINDS:
            raise _fail(f"states[{index}] has dtype {dtype!r} (of {list(STATE_DTYPES)}) on {kind!r}")
        dims = _list(raw[3], f"states[{index}].shape", 1, 8)
        shape = tuple(_int(dim, f"states[{index}].shape", 1, 2**31 - 1) for dim in dims)
        if math.prod(shape) > 2**31 - 1:
            raise _fail(f"states[{index}] has {math.prod(shape)} elements, more than {2**31 - 1}")
        states.append(
            StateAddress(
                _int(raw[0], f"states[{index}].layer", 0, num_layers - 1),
                _str(raw[1], f"states[{index}].name"),
                dtype,
                shape,
                _int(raw[4], f"states[{index}].address", 1, 2**64 - 1),
                kind,
                _int(raw[6], f"states[{index}].device_id", 0, 1 << 16),
            )
        )
    if len({(state.layer, state.name) for state in states}) != len(states):
        raise _fail("states name a layer's array twice")
    return tuple(states)
