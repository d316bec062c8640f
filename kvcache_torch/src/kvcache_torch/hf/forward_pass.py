"""Forward passes as the cache sees them: the step every layer of one forward shares, each
layer's positions, and the hand-off of a layer's keys and values from
:meth:`PagedCache.update` to the ``kvcache_paged`` attention of the same layer (the attention
function alone sees the padding mask, so it does the write)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvcache_core import Step, UnsupportedConfigError
from kvcache_core.errors import ShapeMismatchError

__all__ = [
    "ForwardStep",
    "Handoff",
    "LayerAttend",
    "LayerProgress",
    "Mode",
    "drop_handoff",
    "hand_off",
    "keep_for_readers",
    "reader_of",
    "take_handoff",
]


#: The path of a forward: ``"paged"`` (``kvcache_paged`` attention reads the pool) or
#: ``"contiguous"`` (the cache returns contiguous K/V to the model's own attention).
Mode = Literal["paged", "contiguous"]


@dataclass
class ForwardStep:
    """The new tokens of one forward pass, shared by every layer.

    ``planned`` is ``None`` until the first layer has placed the tokens (the manager's
    ``begin_step`` grew every row by its real new tokens); every layer then writes and
    attends through it.
    """

    start: int  # positions (padding included) held before the step
    query_length: int
    layers_done: set[int] = field(default_factory=set[int])
    planned: Step[torch.Tensor] | None = None
    valid: torch.Tensor | None = None  # [batch, query_length] bool on the model's device; None: all real
    stored: int = 0  # tokens the step stores over all rows
    counts: list[int] = field(default_factory=list[int])  # real new tokens per row, once planned
    allocated: bool = False  # the step allocated the rows (a first forward)
    # Paged path: the layers whose update joined the step, and the one whose keys and values
    # wait for its kvcache_paged attention (None once consumed).
    updated: set[int] = field(default_factory=set[int])
    awaiting: int | None = None
    # A left-padded first forward: each row's real tokens (computed once, for every layer).
    real_lengths: list[int] | None = None
    mode: Mode = "contiguous"  # the forward's path, read at its first layer


class LayerProgress:
    """Where each layer stands: its positions (padding included, as transformers counts) and
    the forward step the layers are in (``None`` between forwards)."""

    def __init__(self, num_layers: int, attention_layers: int | None = None) -> None:
        self.num_layers = num_layers
        # The layers a forward updates (layers keeping a state only, or nothing, never do).
        self.attention_layers = num_layers if attention_layers is None else attention_layers
        self.lengths = [0] * num_layers
        self.step: ForwardStep | None = None

    def reset(self, positions: int) -> None:
        """Every layer at ``positions``, no step under way."""
        self.lengths = [positions] * self.num_layers
        self.step = None

    def placing(self) -> bool:
        """Whether a forward has placed its tokens (grown the rows) and not every layer has
        finished it yet."""
        step = self.step
        return step is not None and step.planned is not None and len(step.layers_done) < self.attention_layers

    def check_complete(self) -> None:
        """Refuse to go on after a forward that did not reach every layer.

        Raises:
            UnsupportedConfigError: the last forward reached only some layers.
        """
        step = self.step
        if step is not None and len(step.layers_done) != self.attention_layers:
            raise UnsupportedConfigError(
                f"the last forward reached {len(step.layers_done)} of {self.attention_layers} layers (it failed, or the "
                "model skips layers); release() the cache"
            )

    def join(self, layer: int, query_length: int, first: bool) -> ForwardStep:
        """The step this layer's update belongs to: the current one, or a new one once every
        layer has finished the current one (``first``: the cache holds no rows yet).

        Raises:
            ShapeMismatchError: a query length other than the step's, or a first forward
                without tokens.
            UnsupportedConfigError: the last forward did not reach every layer.
        """
        step = self.step
        if step is not None and layer not in step.layers_done:
            if query_length != step.query_length:
                raise ShapeMismatchError(
                    f"layer {layer} got {query_length} new tokens, the other layers of this forward {step.query_length}"
                )
            return step
        self.check_complete()
        if query_length < 1 and first:
            raise ShapeMismatchError("the first forward must bring at least one token per row")
        self.step = ForwardStep(start=self.lengths[layer], query_length=query_length)
        return self.step

    def finish(self, step: ForwardStep, layer: int) -> None:
        """Record that ``layer`` wrote (and attended) its tokens of ``step``."""
        step.layers_done.add(layer)
        self.lengths[layer] = step.start + step.query_length


#: ``(handoff, module, query, attention_mask, scaling, features) -> output``: the cache's
#: write and paged attention of the handed-off layer.
LayerAttend = Callable[
    ["Handoff", torch.nn.Module, torch.Tensor, "torch.Tensor | None", "float | None", dict[str, Any]], torch.Tensor
]


@dataclass
class Handoff:
    """What :meth:`PagedCache.update` hands to the attention function of the same layer:
    its keys and values, the step, and ``attend``, the cache's write and attention."""

    owner: object  # the PagedCache that handed it off
    layer: int
    key: torch.Tensor
    value: torch.Tensor
    step: ForwardStep
    attend: LayerAttend
    shared: bool = False  # later layers of the forward attend over this layer's K/V
    reader: bool = False  # a later layer reading them: it stores nothing


class _Slot(threading.local):
    entry: Handoff | None = None
    # This forward's attended layers whose K/V later layers reuse.
    attended: tuple[Handoff, ...] = ()


_SLOT = _Slot()


def hand_off(entry: Handoff) -> None:
    """Leave ``entry`` for the next attention call of this thread."""
    _SLOT.entry = entry
    if _SLOT.attended and _SLOT.attended[0].step is not entry.step:
        _SLOT.attended = ()  # a new forward


def keep_for_readers(entry: Handoff) -> None:
    """Remember an attended layer whose K/V later layers of the forward reuse."""
    if entry.shared:
        _SLOT.attended = (*_SLOT.attended, entry)


def reader_of(key: torch.Tensor, value: torch.Tensor) -> Handoff | None:
    """The hand-off for a layer attending over the very K/V an earlier layer of this forward
    got back from its cache (a layer reusing another's K/V), marked as a reader."""
    for entry in _SLOT.attended:
        if entry.key is key and entry.value is value:
            return dataclasses.replace(entry, reader=True)
    return None


def take_handoff() -> Handoff | None:
    """The entry left by this thread's last update (``None`` if none), which leaves the slot."""
    entry = _SLOT.entry
    _SLOT.entry = None
    return entry


def drop_handoff(owner: object) -> None:
    """Forget this thread's entry if ``owner`` left it (a forward that failed half-way)."""
    if _SLOT.entry is not None and _SLOT.entry.owner is owner:
        _SLOT.entry = None
    _SLOT.attended = tuple(entry for entry in _SLOT.attended if entry.owner is not owner)
