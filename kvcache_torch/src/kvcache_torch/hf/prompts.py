"""Token ids on their way from ``generate`` to the pool: a forward pre-hook on the model hands
each forward's ``input_ids`` to its :class:`~kvcache_torch.hf.PagedCache`, which maps the
cached prefix of a new batch's prompts (and has the forward skip computing it) and makes the
blocks it writes cacheable.

``generate`` never shows its prompt to the cache before the prefill (it asks the cache's
length, then slices the prompt by it), so the ids are taken where the model is called: the
hook sees the prefill's whole prompt while the cache is still empty, maps its cached blocks,
and drops those positions from the forward's inputs, as ``generate`` would have done had the
cache held them already.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import torch

from kvcache_torch.hf.attention_choice import ForwardWatcher
from kvcache_torch.hf.padding import real_tokens
from kvcache_torch.hf.rows import BatchRows

__all__ = ["PromptReceiver", "TokenFeed", "attach_prompt_hook", "cacheable_prompts"]

#: Forward inputs that may accompany ``input_ids`` without changing what a token's K/V are.
_NEUTRAL_INPUTS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cache_position", "cache", "past_key_values"}
)


@runtime_checkable
class PromptReceiver(Protocol):
    """A cache that takes a forward's token ids before the forward runs."""

    def receive_token_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> int: ...


_HOOKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def attach_prompt_hook(model: torch.nn.Module) -> None:
    """Register, once per model, the forward pre-hook that hands a :class:`PromptReceiver`
    cache (passed as ``cache=`` or ``past_key_values=``) each forward's token ids, and tells a
    :class:`~kvcache_torch.hf.attention_choice.ForwardWatcher` cache when the forward begins
    and (a forward hook that runs on errors too) ends. With any other cache, or none, the
    hooks change nothing."""
    if model in _HOOKED:
        return
    model.register_forward_pre_hook(_before_forward, with_kwargs=True)
    model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)
    _HOOKED.add(model)


def _cache_of(kwargs: dict[str, Any]) -> object:
    return kwargs.get("cache", kwargs.get("past_key_values"))


_ROLES: weakref.WeakKeyDictionary[type, tuple[bool, bool]] = weakref.WeakKeyDictionary()


def _roles(kind: type) -> tuple[bool, bool]:
    """Whether a cache of class ``kind`` is a :class:`ForwardWatcher` and a :class:`PromptReceiver`:
    asked once per class, as a runtime protocol check costs microseconds and the hooks run at
    every forward."""
    found = _ROLES.get(kind)
    if found is None:
        found = _ROLES[kind] = (issubclass(kind, ForwardWatcher), issubclass(kind, PromptReceiver))
    return found


def _after_forward(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: object) -> None:
    cache = _cache_of(kwargs)
    if _roles(type(cache))[0]:
        cast(ForwardWatcher, cache).forward_ended(module)


def _before_forward(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    cache = _cache_of(kwargs)
    watches, receives = _roles(type(cache))
    if watches:
        cast(ForwardWatcher, cache).forward_begins(module, kwargs)
    if not receives:
        return None
    receiver = cast(PromptReceiver, cache)
    input_ids: object = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return None
    # Another tensor input (embeddings, images, token types) may change the K/V of the same ids.
    if len(args) > 1 or any(
        isinstance(value, torch.Tensor) for name, value in kwargs.items() if name not in _NEUTRAL_INPUTS
    ):
        return None
    mask: object = kwargs.get("attention_mask")
    positions: object = kwargs.get("position_ids")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        return None  # a prepared 4-D mask or a mask per layer type: its padding is not read here
    skipped = receiver.receive_token_ids(
        input_ids,
        mask if isinstance(mask, torch.Tensor) else None,
        positions if isinstance(positions, torch.Tensor) else None,
    )
    if not skipped:
        return None
    columns = int(input_ids.shape[1])
    new_kwargs = dict(kwargs)
    for name in ("input_ids", "position_ids", "cache_position"):  # cache_position: transformers 4
        value: object = new_kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.shape[-1] == columns:
            new_kwargs[name] = value[..., skipped:]
    new_args = args
    if args:
        new_args = (input_ids[:, skipped:],)
    return new_args, new_kwargs


def cacheable_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[list[tuple[int, ...] | None], list[int]]:
    """Per row of a first forward ``[batch, columns]``: the ids of the tokens its request
    stores, or ``None`` where their K/V are not those of the ids alone (positions other
    than ``0, 1, ...`` for the real tokens), and the leading columns it does not store (its
    left padding, on either path).

    A row that is not left-padded stores what its mask says and caches nothing.
    """
    batch, columns = (int(size) for size in input_ids.shape)
    ids = input_ids.cpu().numpy().astype(np.int64)
    real = np.ones((batch, columns), dtype=np.bool_) if attention_mask is None else attention_mask.cpu().numpy() != 0
    if real.shape != (batch, columns):
        return [None] * batch, [0] * batch
    if position_ids is None:
        positions = np.broadcast_to(np.arange(columns), (batch, columns))
    elif position_ids.dim() == 2 and position_ids.shape[1] == columns and position_ids.shape[0] in (1, batch):
        positions = np.broadcast_to(position_ids.cpu().numpy(), (batch, columns))
    else:  # several position streams (multimodal rotary embeddings): not the ids alone
        return [None] * batch, [0] * batch
    prompts: list[tuple[int, ...] | None] = []
    pads: list[int] = []
    for row in range(batch):
        count = int(real[row].sum())
        pad = columns - count
        left_padded = bool(real[row, pad:].all())
        canonical = left_padded and bool((positions[row, pad:] == np.arange(count)).all())
        cacheable = canonical and count > 0
        prompts.append(tuple(int(token) for token in ids[row, pad:]) if cacheable else None)
        pads.append(pad if left_padded else 0)
    return prompts, pads


class TokenFeed:
    """The token ids a cache's forwards bring (through the hook) on their way to its rows."""

    def __init__(self, rows: BatchRows) -> None:
        self.rows = rows
        self.incoming: torch.Tensor | None = None  # the coming step's ids
        self.mask: torch.Tensor | None = None  # the coming forward's 2-D padding mask, if it came
        self.warned = False

    def receive(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> int | None:
        """A forward's ids ``[batch, new_tokens]``: before a new batch's first forward, start
        its rows from the prefix cache (:func:`cacheable_prompts`, :meth:`BatchRows.map_prefix`)
        and return the positions cached; later, keep them for the step (``None``)."""
        if self.rows.handles:
            self.incoming = input_ids
            return None
        prompts, pads = cacheable_prompts(input_ids, attention_mask, position_ids)
        shared = self.rows.map_prefix(prompts, pads, int(input_ids.shape[1]))
        self.incoming = input_ids[:, shared:]  # what the forward computes
        return shared

    def real_new_tokens(self, kv_length: int, query_length: int, batch: int) -> torch.Tensor | None:
        """Which of the coming forward's ``query_length`` new tokens are real, ``[batch,
        query_length]`` bool, from the 2-D mask its hook brought (:attr:`mask`, taken); ``None``
        when all are, or when no mask of ``[batch, kv_length]`` came (every token is then stored,
        padding included, as a cache that never sees the mask must)."""
        mask, self.mask = self.mask, None
        if mask is None or tuple(mask.shape) != (batch, kv_length):
            return None
        return real_tokens(mask, kv_length, query_length, batch)

    def step_ids(
        self, batch: int, query_length: int, valid: torch.Tensor | None
    ) -> list[tuple[int, ...] | None] | None:
        """Per row, the ids of the tokens it stores in this step (``valid``: which of the new
        columns; ``None``: all), for the rows whose every earlier id is known; ``None`` when
        no ids came for this step (every row's ids are unknown from then on). A first
        forward without ids warns, once: its prompts never reach the prefix cache."""
        ids, self.incoming = self.incoming, None
        if not self.rows.handles and not self.warned:
            self.warned = True
            warnings.warn(
                "the pool caches prefixes, but no token ids reached this PagedCache: build it with the model, "
                "PagedCache(manager, model), so that each forward hands its ids over, or call "
                "cache.map_cached_prefix(input_ids, attention_mask) before generate",
                UserWarning,
                stacklevel=6,
            )
        known = self.rows.ids_known
        if ids is None or tuple(ids.shape) != (batch, query_length):
            known[:] = [False] * len(known)
            return None
        rows = ids.cpu().numpy().astype(np.int64)
        kept = None if valid is None else valid.cpu().numpy()
        return [
            (
                tuple(int(token) for token in (rows[row] if kept is None else rows[row][kept[row]]))
                if known[row]
                else None
            )
            for row in range(batch)
        ]
