"""What a ticket says about the producer's pool, and whether this pool can take its request:
per model layer its kind (window, chunk, K/V or not) and geometry, per state array its layer,
name, dtype and shape; each group's blocks and each state array of the request's slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.regions import MemoryRegion
from kvcache_core.errors import KvCacheError, TransferError, TransferMismatchError
from kvcache_core.transfer.ticket import LayerDescription, StateAddress, TransferTicket

__all__ = ["GroupRead", "describe_layers", "group_reads", "source_config", "state_addresses"]

_LAYER_FIELDS = ("window", "chunk", "keeps_kv", "num_heads", "head_dim", "value_head_dim")


def describe_layers(config: CacheConfig) -> tuple[LayerDescription, ...]:
    """Each model layer of ``config``: ``(window, chunk, keeps_kv, num_heads, head_dim,
    value_head_dim)``, the geometry 0 for a layer keeping no K/V."""
    described: list[LayerDescription] = []
    for layer in range(config.num_layers):
        spec = config.layer_spec(layer)
        window = spec.window if config.layer_specs is not None else config.sliding_window
        if not spec.keeps_kv:
            described.append((None, None, False, 0, 0, 0))
            continue
        shape = config.layer_geometry(layer)
        described.append((window, spec.chunk, True, shape.num_heads, shape.head_dim, shape.value_width))
    return tuple(described)


def state_addresses(config: CacheConfig, regions: tuple[MemoryRegion, ...]) -> tuple[StateAddress, ...]:
    """The request's state slot (its regions, ``[1, *shape]`` each) as a ticket lists it."""
    return tuple(
        StateAddress(layer, array.name, array.dtype, array.shape, region.address, region.device_kind, region.device_id)
        for (layer, array), region in zip(config.states.arrays, regions, strict=True)
    )


def source_config(ticket: TransferTicket, manager_config: CacheConfig, storage_config: CacheConfig) -> CacheConfig:
    """The producer pool's storage config (this pool's, in the ticket's layout and size),
    once the ticket is found to describe a pool of this one's kind.

    Raises:
        TransferMismatchError: another namespace, dtype, block size or layer count, or the
            first layer or state array that differs (named, both values).
    """
    if ticket.namespace != manager_config.model_id:
        raise TransferMismatchError(
            f"the ticket's namespace {ticket.namespace!r} is not this pool's model_id {manager_config.model_id!r}"
        )
    if ticket.dtype != storage_config.dtype or ticket.geometry["block_size"] != storage_config.block_size:
        raise TransferMismatchError(
            f"the ticket's pool holds {ticket.dtype} in blocks of {ticket.geometry['block_size']} tokens; this one "
            f"{storage_config.dtype} in blocks of {storage_config.block_size}: a transfer converts layouts only"
        )
    mine = describe_layers(manager_config)
    if len(ticket.layers) != len(mine):
        raise TransferMismatchError(f"the ticket's model has {len(ticket.layers)} layers; this pool's {len(mine)}")
    for layer, (theirs, ours) in enumerate(zip(ticket.layers, mine, strict=True)):
        for name, their_value, our_value in zip(_LAYER_FIELDS, theirs, ours, strict=True):
            if their_value != our_value:
                raise TransferMismatchError(
                    f"layer {layer} differs: {name} {their_value!r} in the ticket's pool, {our_value!r} in this one "
                    f"(the ticket's layer {_shown(theirs)}, this pool's {_shown(ours)})"
                )
    wanted = [(layer, array.name, array.dtype, array.shape) for layer, array in manager_config.states.arrays]
    given = [(state.layer, state.name, state.dtype, state.shape) for state in ticket.states]
    for index in range(max(len(wanted), len(given))):
        theirs_state = given[index] if index < len(given) else None
        ours_state = wanted[index] if index < len(wanted) else None
        if theirs_state != ours_state:
            raise TransferMismatchError(
                f"state array {index} differs: {_state(theirs_state)} in the ticket's pool, {_state(ours_state)} in "
                "this one"
            )
    if len(ticket.groups) != manager_config.num_groups or ticket.geometry["num_layers"] != storage_config.num_layers:
        raise TransferMismatchError(
            f"the ticket lists {len(ticket.groups)} KV-cache groups of {ticket.geometry['num_layers']} storage layers; "
            f"this pool has {manager_config.num_groups} of {storage_config.num_layers}"
        )
    try:
        return dataclasses.replace(storage_config, num_blocks=ticket.geometry["num_blocks"], kv_layout=ticket.layout)
    except KvCacheError as exc:
        raise TransferMismatchError(f"the ticket's pool cannot be described here: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class GroupRead:
    """What an import reads: ``picks`` (indices into the ticket's blocks and digests) land in
    this pool's ``blocks``, group after group."""

    picks: npt.NDArray[np.int64]
    blocks: npt.NDArray[np.int64]


def group_reads(ticket: TransferTicket, tables: list[Any], start_block: int, num_blocks: int) -> GroupRead:
    """The blocks to read for a request whose group tables are ``tables`` (this pool's, grown
    to the ticket's length of ``num_blocks`` blocks), from logical block ``start_block`` on
    (the blocks before it are cached here); each group's from the first block it holds.

    Raises:
        TransferError: the producer released a block this pool holds (a sliding group of the
            ticket's request kept fewer blocks than this one).
    """
    picks: list[npt.NDArray[np.int64]] = []
    blocks: list[npt.NDArray[np.int64]] = []
    offset = 0
    for group, (table, (first, held)) in enumerate(zip(tables, ticket.groups, strict=True)):
        start = max(start_block, table.first_logical)
        if start < first:
            raise TransferError(
                f"KV-cache group {group}: this pool holds the request's blocks from {start} on, the producer only "
                f"from {first} on (its window released them)"
            )
        if start < num_blocks:
            picks.append(np.arange(offset + start - first, offset + held, dtype=np.int64))
            mine = table.physical_blocks[start - table.first_logical : num_blocks - table.first_logical]
            blocks.append(np.asarray(mine, dtype=np.int64))
        offset += held
    empty = np.zeros(0, dtype=np.int64)
    return GroupRead(np.concatenate(picks) if picks else empty, np.concatenate(blocks) if blocks else empty)


def _shown(layer: LayerDescription) -> str:
    window, chunk, keeps_kv, heads, head_dim, value_width = layer
    if not keeps_kv:
        return "keeping no K/V"
    kind = f"window {window}" if window is not None else f"chunk {chunk}" if chunk is not None else "full"
    return f"{kind}, {heads} KV heads of {head_dim} (values {value_width})"


def _state(state: tuple[int, str, str, tuple[int, ...]] | None) -> str:
    if state is None:
        return "none"
    layer, name, dtype, shape = state
    return f"layer {layer} {name!r} {dtype} {list(shape)}"
