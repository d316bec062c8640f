"""Padded gathers: a step's K/V of one layer as one dense batch, for attention that is not paged.

transformers' ``sdpa`` and ``eager`` attention, and any dense kernel, read a batch's K/V as
one array of ``[batch, positions, heads, dim]`` (or heads first), each request's tokens ending
its row (a left-padded batch), zeros before them.
:meth:`Step.gather_padded <kvcache_core.step.Step.gather_padded>` gives that array: core
finds, once per step, the pool slot of every position of the batch (``-1`` for padding) from
the step's page table, and the storage reads them.

A storage may read the slots in one pass with the optional member ``gather_padded(layer,
slots, layout)`` (:class:`PaddedGatherStorage`). It returns ``None`` for a pool it does not
read that way (a quantized pool, say); core then gathers request by request with
``KvStorage.gather`` and pads with the array library's own calls. The two give the same
arrays bit for bit (the conformance kit compares them on every backend), so a storage claims
no capability for the member: it changes how fast the call runs, never what it returns.

:meth:`Step.padded_view <kvcache_core.step.Step.padded_view>` gives the same batch without a
copy where core finds it is one request's run of consecutive slots and the storage lays those
out in order: the optional member ``view_padded(layer, first_slot, positions, layout)``
(:class:`PaddedViewStorage`) returns views of the pool, or ``None``.
"""

from __future__ import annotations

from typing import Any, Final, Protocol, runtime_checkable

from kvcache_core.contract.protocols import SlotArray

__all__ = ["PADDED_LAYOUTS", "PaddedGatherStorage", "PaddedViewStorage", "storage_gather_padded", "storage_view_padded"]

#: The layouts of a padded gather: ``"NHD"`` ``[batch, positions, heads, dim]`` and ``"HND"``
#: ``[batch, heads, positions, dim]`` (transformers' layout).
PADDED_LAYOUTS: Final = ("NHD", "HND")


@runtime_checkable
class PaddedGatherStorage(Protocol):
    """The optional :class:`~kvcache_core.plugin.KvStorage` member that reads a padded batch
    in one pass."""

    def gather_padded(self, layer: int, slots: SlotArray, layout: str) -> tuple[Any, Any] | None:
        """The keys and values at ``slots`` of storage layer ``layer``.

        Args:
            layer: the storage layer (checked).
            slots: ``[batch, positions]`` int64 pool slots, read-only; ``-1`` marks a
                padding position, which reads as zeros, and a row's padding positions all
                come before its slots (a left-padded batch). The same array object for every
                layer of a step (a storage may keep what it derived from it).
            layout: one of :data:`PADDED_LAYOUTS` (checked).

        Returns:
            ``(keys, values)`` of the pool's array type and the dtype ``KvStorage.gather``
            returns, ``[batch, positions, heads, dim]`` (``"NHD"``) or ``[batch, heads,
            positions, dim]`` (``"HND"``), values of their own width; or ``None``, having
            read nothing, where the storage does not read this pool so (core then gathers
            request by request).
        """
        ...


def storage_gather_padded(storage: object, layer: int, slots: SlotArray, layout: str) -> tuple[Any, Any] | None:
    """``storage.gather_padded(...)``, or ``None`` when the storage has no such member (looked
    up as an attribute: this runs once per layer, and a runtime protocol check costs more
    than the read of a small batch)."""
    read: Any = getattr(storage, "gather_padded", None)
    if read is None:
        return None
    result: tuple[Any, Any] | None = read(layer, slots, layout)
    return result


@runtime_checkable
class PaddedViewStorage(Protocol):
    """The optional :class:`~kvcache_core.plugin.KvStorage` member that shows one request's run
    of slots as a padded batch of one row, in place."""

    def view_padded(self, layer: int, first_slot: int, positions: int, layout: str) -> tuple[Any, Any] | None:
        """Slots ``first_slot`` to ``first_slot + positions - 1`` of storage layer ``layer`` (core
        checked them: one request's tokens, in one run of consecutive blocks) as what
        :meth:`PaddedGatherStorage.gather_padded` returns for them, ``[1, positions, heads,
        dim]`` (``"NHD"``) or ``[1, heads, positions, dim]`` (``"HND"``), but views of the pool:
        nothing copied, valid until those blocks are written or reused. ``None``, having made
        nothing, where the storage does not lay the slots out in order (a layout that
        interleaves a block's tokens with its heads, a quantized pool)."""
        ...


def storage_view_padded(
    storage: object, layer: int, first_slot: int, positions: int, layout: str
) -> tuple[Any, Any] | None:
    """``storage.view_padded(...)``, or ``None`` when the storage has no such member."""
    view: Any = getattr(storage, "view_padded", None)
    if view is None:
        return None
    result: tuple[Any, Any] | None = view(layer, first_slot, positions, layout)
    return result
