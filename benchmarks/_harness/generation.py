"""``model.generate`` side by side: the same random-weight model twice (ours with the paged
attention, the reference with ``sdpa``), a left-padded batch of prompts, and the check that
both generated the same thing. Needs torch and transformers."""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from kvcache_torch.hf import ATTN_IMPLEMENTATION

__all__ = [
    "ARCHITECTURES",
    "LOGIT_TOLERANCE",
    "Model",
    "ModelShape",
    "agreement",
    "decode_forward_times",
    "left_padded_prompts",
    "paired_models",
    "random_model",
    "timed_decode",
]

#: transformers' config and model classes of the architectures a benchmark builds.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # q/k norms
}

#: fp32 through a whole model: the two paths differ in the last bits only.
LOGIT_TOLERANCE = 1e-3

Model = Any  # a transformers causal LM


@dataclass(frozen=True)
class ModelShape:
    """A small decoder's shape (heads of ``hidden // query_heads`` features)."""

    layers: int
    hidden: int
    intermediate: int
    query_heads: int
    kv_heads: int
    vocab: int

    def config_fields(self) -> dict[str, int]:
        """The shape as the fields of a transformers config."""
        fields = {name: getattr(self, attribute) for attribute, name in _CONFIG_NAMES.items()}
        return {**fields, "head_dim": self.hidden // self.query_heads}


#: A shape's attributes and the names transformers' configs give them.
_CONFIG_NAMES = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "query_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
}


def random_model(
    architecture: str,
    shape: ModelShape,
    *,
    seed: int,
    max_positions: int,
    initializer_range: float,
    generating: bool = True,
    **fields: Any,
) -> Model:
    """A random-weight causal LM (``seed``), in eval mode, with transformers' default attention.

    Args:
        architecture: a key of :data:`ARCHITECTURES`.
        shape: its shape.
        seed: torch's seed for the weights.
        max_positions: ``max_position_embeddings``.
        initializer_range: the weights' standard deviation (larger: sharper attention).
        generating: pad id 0, bos 1 and no eos, so ``generate`` never stops early.
        fields: more of the config (``layer_types``, ``sliding_window``, ...).
    """
    config_name, model_name = ARCHITECTURES[architecture]
    token_ids: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None} if generating else {}
    config = getattr(transformers, config_name)(
        **shape.config_fields(),
        max_position_embeddings=max_positions,
        initializer_range=initializer_range,
        **token_ids,
        **fields,
    )
    torch.random.manual_seed(seed)  # pyright: ignore[reportUnknownMemberType]  # seed untyped in torch
    model: Model = getattr(transformers, model_name)(config)
    model.eval()
    return model


def paired_models(reference: Model) -> tuple[Model, Model]:
    """``(ours, reference)``: a copy of ``reference`` with kvcache's paged attention, and
    ``reference`` with ``sdpa`` (each its own config: the attention lives there)."""
    ours: Model = copy.deepcopy(reference)
    reference.set_attn_implementation("sdpa")
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    return ours, reference


def left_padded_prompts(lengths: Sequence[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``[batch, max(lengths)]`` (ids 2 and up), left-padded with id 0 as a
    tokenizer pads them, and the 2-D ``attention_mask``."""
    longest = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(lengths), longest), dtype=torch.long)
    mask = torch.zeros((len(lengths), longest), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, longest - length :] = torch.randint(2, vocab, (length,), generator=generator)
        mask[row, longest - length :] = 1
    return ids, mask


def agreement(ours: Any, expected: Any) -> tuple[bool, float]:
    """Whether two ``generate`` outputs (``return_dict_in_generate``, ``output_logits``) hold
    the same tokens, and the largest logit difference."""
    worst = max(float((a - b).abs().max()) for a, b in zip(ours.logits, expected.logits, strict=True))
    return bool(torch.equal(ours.sequences, expected.sequences)), worst


@contextmanager
def decode_forward_times(model: Model) -> Generator[list[float]]:
    """Within the block, the seconds of each of ``model``'s decode forwards (one new token per
    row), in order: the decode step timed alone, not as the difference of two ``generate``
    runs (whose prefill, many times a step's time, would bury it in its noise)."""
    seconds: list[float] = []
    forward: Callable[..., Any] = model.forward
    instance: object = model
    own: object = instance.__dict__.get("forward")  # an instance's own forward (a hook's), put back after

    @functools.wraps(forward)  # generate reads the forward's signature
    def timed(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        started = time.perf_counter()
        output = forward(*args, **kwargs)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1:
            seconds.append(time.perf_counter() - started)
        return output

    model.forward = timed
    try:
        yield seconds
    finally:
        if own is None:
            del model.forward  # the class's own again
        else:
            model.forward = own


def timed_decode(model: Model, run: Callable[[], object], into: list[float]) -> Callable[[], object]:
    """``run`` (a ``generate`` of ``model``) as a competitor of ``take_turns`` that adds the
    seconds of each of its decode forwards to ``into`` (:func:`decode_forward_times`)."""

    def call() -> object:
        with decode_forward_times(model) as seconds:
            result = run()
        into.extend(seconds)
        return result

    return call
