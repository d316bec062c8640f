"""Which models the ``"kvcache_paged"`` attention serves: those whose attention layers call
transformers' attention interface.

A model that computes attention itself (Bloom, MPT, XGLM, ...) still hands each layer's
keys and values to the cache, for an attention call that never comes: nothing would be
stored and the model would attend over its new tokens only. :mod:`kvcache_torch.hf` refuses
such a model by name, up front where transformers can tell from the model's class, and
otherwise at the first update that finds an earlier layer's keys and values not attended,
before the model's output is returned; that forward is undone.
"""

from __future__ import annotations

import sys
from typing import cast

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto import modeling_auto

from kvcache_core import UnsupportedConfigError
from kvcache_torch.hf.forward_pass import ForwardStep

__all__ = [
    "decoder_class",
    "decoder_module",
    "not_through_interface",
    "refuse_unless_interface",
    "unattended_layer",
    "uses_interface",
]


def decoder_module(text: PretrainedConfig, model: torch.nn.Module | None) -> torch.nn.Module | None:
    """The submodel of ``model`` that holds the decoder config ``text`` (the model itself for
    a plain decoder, its language model for a multimodal one), if any."""
    if model is not None:
        for module in model.modules():
            if isinstance(module, PreTrainedModel) and module.config is text:
                return module
    return None


def decoder_class(text: PretrainedConfig, model: torch.nn.Module | None = None) -> type[torch.nn.Module] | None:
    """The model class that runs the decoder configured by ``text``: that of
    :func:`decoder_module`, else transformers' class for the config (causal LM, then base
    model); ``None`` for a config transformers does not know (remote code)."""
    found_module = decoder_module(text, model)
    if found_module is not None:
        return type(found_module)
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        found = cast(object, mapping.get(type(text), None))  # pyright: ignore[reportUnknownMemberType]  # untyped there
        if isinstance(found, type) and issubclass(found, torch.nn.Module):
            return found
    return None


def uses_interface(model_class: type[torch.nn.Module], decoder: torch.nn.Module | None = None) -> bool | None:
    """Whether the class's attention calls transformers' attention interface; ``None`` when
    transformers cannot tell.

    ``False`` when its module picks attention classes by implementation name from a
    ``*ATTENTION_CLASSES`` table (Falcon, GPT-Neo, GIT, Bark: any other name fails at load),
    unless the ``decoder`` given (an instance) holds none of them (the table serves another
    part, a vision tower); else transformers' own judgement (``_can_set_attn_implementation``,
    read from the module's source, as when it is asked to switch implementations).
    """
    module = sys.modules.get(model_class.__module__)
    names: dict[str, object] = vars(module) if module is not None else {}
    chosen = tuple(
        choice
        for name, table in names.items()
        if name.endswith("ATTENTION_CLASSES") and isinstance(table, dict)
        for choice in cast("dict[str, object]", table).values()
        if isinstance(choice, type)
    )
    if chosen and (decoder is None or any(isinstance(part, chosen) for part in decoder.modules())):
        return False
    probe: object = getattr(model_class, "_can_set_attn_implementation", None)
    if not callable(probe):  # a transformers without the judgement
        return None
    try:
        verdict: object = probe()
    except Exception:  # a private heuristic of transformers: any failure means "cannot tell"
        return None
    return verdict if isinstance(verdict, bool) else None


def not_through_interface(
    model_class: type[torch.nn.Module] | None,
    text: PretrainedConfig,
    layer: int | None = None,
    earlier: bool = False,
) -> UnsupportedConfigError:
    """The refusal of a model whose attention does not call transformers' attention interface,
    naming its class (else its config's) and the implementation to load it with instead: its
    own ``"sdpa"`` where it has one, else ``"eager"``. ``layer``: the layer whose keys and
    values never reached the ``kvcache_paged`` attention (``earlier``: in the forward before
    this one)."""
    if model_class is None:
        name = f"the model of {type(text).__name__}"
        remedy = "attn_implementation='eager' (or 'sdpa' where the model has it)"
    else:
        name = model_class.__name__
        remedy = f"attn_implementation={'sdpa' if getattr(model_class, '_supports_sdpa', False) else 'eager'!r}"
    if layer is None:
        found = "computes attention itself, not through transformers' attention interface"
        outcome = "PagedCache would cache nothing"
    else:
        forward = "the last forward" if earlier else "this forward"
        found = (
            f"did not run the kvcache_paged attention for layer {layer} of {forward}: its attention does not go "
            "through transformers' attention interface"
        )
        outcome = "PagedCache would cache nothing; the cache is left as it was before that forward"
    return UnsupportedConfigError(
        f"{name} {found}, so attn_implementation='kvcache_paged' cannot serve it ({outcome}); load the model with "
        f"{remedy} and pass that model's config to the cache, PagedCache(manager, model.config): the cache then "
        "serves it on its contiguous path"
    )


def refuse_unless_interface(text: PretrainedConfig, model: torch.nn.Module | None = None) -> None:
    """Refuse, naming it, a model whose class transformers knows not to call its attention
    interface (it runs ``"kvcache_paged"`` for nothing, or rejects the name at load).

    Raises:
        UnsupportedConfigError: naming the model class and the remedy.
    """
    decoder = decoder_module(text, model)
    found = type(decoder) if decoder is not None else decoder_class(text)
    if found is not None and uses_interface(found, decoder) is False:
        raise not_through_interface(found, text)


def unattended_layer(step: ForwardStep | None, layer: int, num_layers: int) -> tuple[int, bool] | None:
    """``(layer, earlier)`` when the update of ``layer`` shows that the model does not call
    the ``kvcache_paged`` attention: it arrives while an earlier layer's keys and values of
    the same forward still wait for it, or (``earlier``) a new forward begins after one in
    which every layer was updated and none attended (a one-layer model); else ``None``."""
    if step is None or step.awaiting is None:
        return None
    same_forward = layer not in step.updated
    if not same_forward and (step.layers_done or len(step.updated) != num_layers):
        return None  # an interrupted forward, not a pattern: joining the step decides
    return step.awaiting, not same_forward
