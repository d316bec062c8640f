"""Which attention a :class:`~kvcache_torch.hf.PagedCache` runs its model's forwards with.

A model loaded as transformers loads it by default runs ``"sdpa"``; on it the cache serves the
contiguous path, which copies every row's whole K/V out of the pool at every layer of every
step, as ``DynamicCache`` does. The ``"kvcache_paged"`` attention reads the pool in place and
is the faster path (``benchmarks/generate_torch.py`` prints both). So a cache built with the
model itself (``PagedCache(manager, model)``, ``attention="auto"``, the default) runs each of
its forwards with ``"kvcache_paged"`` where that serves the model as well as ``"sdpa"``:

- the model is a plain decoder (its config is the decoder's: a composite model's wrappers may
  mask other than causally) running transformers' default for its class: ``"sdpa"``, or
  ``"eager"`` for a class without ``sdpa`` (Gemma 2, gpt-oss: ``"kvcache_paged"`` applies their
  soft-capping and sinks as ``"eager"`` does). ``"eager"`` on a class that has ``"sdpa"`` is
  what a user picks to see the attention weights, and any other name was chosen on purpose;
- its class calls transformers' attention interface (:func:`~kvcache_torch.hf.guard.uses_interface`
  answers ``True``, not "cannot tell"), without latent attention (it expands the latent
  before attending) and without layers that reuse K/V on a prefill's last positions only;
- the forward does not ask for attention weights.

The switch is the decoder config's ``_attn_implementation`` for the duration of one forward of
the model (its forward pre-hook sets it, a forward hook that runs on errors too restores it).
The logits are those of ``"kvcache_paged"``: within 1e-4 of ``DynamicCache``, not bit for bit
those of ``"sdpa"``. ``attention="model"`` keeps the model's own attention, the contiguous path.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Protocol, runtime_checkable

import torch
from transformers import PretrainedConfig

from kvcache_core import InvalidArgumentError, UnsupportedConfigError
from kvcache_torch.hf.guard import uses_interface
from kvcache_torch.hf.model_config import ATTN_IMPLEMENTATION, attention_implementation, latent_attention
from kvcache_torch.hf.shared_kv import refuse_sliced_shared_layers_on_paged_path

__all__ = [
    "ATTENTION_CHOICES",
    "AttentionChoice",
    "AttentionSwitch",
    "ForwardWatcher",
    "check_choice",
    "paged_by_choice",
]

#: ``"auto"``: ``"kvcache_paged"`` for the cache's forwards where it serves the model (see the
#: module); ``"model"``: the attention the model's config names.
AttentionChoice = Literal["auto", "model"]
ATTENTION_CHOICES: Final = ("auto", "model")


def check_choice(choice: object) -> AttentionChoice:
    """``choice`` as an :data:`AttentionChoice`.

    Raises:
        InvalidArgumentError: naming the value and the valid ones.
    """
    if isinstance(choice, str) and choice == "auto":
        return "auto"
    if isinstance(choice, str) and choice == "model":
        return "model"
    raise InvalidArgumentError(f"attention must be one of {ATTENTION_CHOICES}, got {choice!r}")


def paged_by_choice(model: torch.nn.Module | None, text: PretrainedConfig, choice: AttentionChoice) -> bool:
    """Whether a cache built with ``model`` (``None``: with its config only, which no hook can
    switch) runs the model's forwards with ``"kvcache_paged"`` though its config names another
    attention (the conditions are the module's)."""
    if choice == "model" or model is None or getattr(model, "config", None) is not text:
        return False
    default = "sdpa" if getattr(type(model), "_supports_sdpa", False) else "eager"  # transformers' choice
    if attention_implementation(text) != default or latent_attention(text) is not None:
        return False
    try:
        refuse_sliced_shared_layers_on_paged_path(text)
    except UnsupportedConfigError:
        return False
    return uses_interface(type(model), model) is True


@runtime_checkable
class ForwardWatcher(Protocol):
    """A cache told by its model's hooks when one of the model's forwards begins and ends."""

    def forward_begins(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> None: ...

    def forward_ended(self, module: torch.nn.Module) -> None: ...


class AttentionSwitch:
    """Sets the decoder config ``text`` to ``"kvcache_paged"`` while a forward of its model runs
    and puts back what it named after, once per forward (a nested forward finds it switched).
    Only from the attention ``text`` named when the switch was made: a model the user has set
    to another attention since keeps that one."""

    def __init__(self, text: PretrainedConfig) -> None:
        self._text = text
        self._from = attention_implementation(text)
        self._owner: torch.nn.Module | None = None  # the module whose forward switched it

    def begin(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """Switch for ``module``'s forward, unless the module is not the model of ``text``, a
        forward already switched it, the model runs another attention than it did, or the
        forward asks for attention weights."""
        text = self._text
        if self._owner is not None or getattr(module, "config", None) is not text:
            return
        if kwargs.get("output_attentions") or getattr(text, "output_attentions", False):
            return
        if attention_implementation(text) != self._from:
            return
        self._owner = module
        text._attn_implementation = ATTN_IMPLEMENTATION  # pyright: ignore[reportPrivateUsage]  # transformers' own switch

    def end(self, module: torch.nn.Module) -> None:
        """Put back the config's attention after the forward of ``module`` that switched it."""
        if self._owner is not module:
            return
        self._owner = None
        self._text._attn_implementation = self._from  # pyright: ignore[reportPrivateUsage]  # transformers' own switch
