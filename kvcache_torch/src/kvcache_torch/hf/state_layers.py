"""Recurrent-state layers of transformers models (Mamba, Mamba2, gated DeltaNet, short
convolutions) in a kvcache pool: their state shapes from the config, and the bridge between
transformers' ``LinearAttentionCacheLayerMixin`` calls and the pool's state slots.

transformers' linear-attention layers keep per layer a convolution state ``[batch, channels,
kernel]`` (``update_conv_state``) and a recurrent state (``update_recurrent_state``), which
the model's kernels read through ``get_conv_state`` / ``get_recurrent_state`` and, while
decoding, update in place. :class:`StateBridge` serves them from the pool: a layer's states
are read from the batch's slots when the layer first asks for them in a forward
(``step.state``), the model works on those tensors, and they are written back to the slots
(``step.write_state``) when another state layer is reached, or before the rows change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import torch
from transformers import PretrainedConfig

from kvcache_core import PagedKvCacheManager, StateSpec, Step, UnsupportedConfigError
from kvcache_core.contract.states import StateArray
from kvcache_core.errors import ShapeMismatchError, StaleStepError
from kvcache_torch.dtypes import dtype_name
from kvcache_torch.hf.rows import BatchRows

__all__ = [
    "EMPTY_LAYER_TYPES",
    "HYBRID_LAYER_TYPES",
    "STATE_FAMILIES",
    "STATE_LAYER_TYPES",
    "StateBridge",
    "StateLayerCalls",
    "state_specs",
]

#: Layer types of ``config.layer_types`` that keep a recurrent state and no K/V.
STATE_LAYER_TYPES: Final = frozenset({"linear_attention", "conv", "mamba"})

#: Layer types that keep K/V and a recurrent state in one layer (Falcon-H1 runs a Mamba
#: mixer beside attention in every layer, Zamba2 a shared attention block before a Mamba
#: mixer): ``LayerSpec(state=..., keeps_kv=True)``.
HYBRID_LAYER_TYPES: Final = frozenset({"hybrid", "hybrid_sliding"})

#: Layer types that keep nothing (MLP and mixture-of-experts blocks of a hybrid stack,
#: Nemotron-H's; transformers gives them a ``DummyLayer``): ``LayerSpec(keeps_kv=False)``.
EMPTY_LAYER_TYPES: Final = frozenset({"mlp", "moe"})

CONV: Final = "conv"
RECURRENT: Final = "recurrent"

Arrays = Callable[[PretrainedConfig, str], tuple[StateArray, ...]]


def _int(config: PretrainedConfig, name: str) -> int:
    value: object = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedConfigError(
            f"the {config.model_type!r} config has {name}={value!r}; its recurrent state's shape needs an int"
        )
    return value


def _mamba2(config: PretrainedConfig, dtype: str) -> tuple[StateArray, ...]:
    """Mamba2: conv over ``expand * hidden + 2 * n_groups * state_size`` channels, SSM state
    ``[heads, head_dim, state_size]``."""
    state = _int(config, "state_size")
    channels = int(config.expand * config.hidden_size) + 2 * _int(config, "n_groups") * state
    return (
        StateArray(CONV, (channels, _int(config, "conv_kernel")), dtype),
        StateArray(RECURRENT, (_int(config, "num_heads"), _int(config, "head_dim"), state), "float32"),
    )


def _mamba2_hybrid(config: PretrainedConfig, dtype: str) -> tuple[StateArray, ...]:
    """Bamba and Granite 4 hybrid: Mamba2 mixers named ``mamba_*`` in the config."""
    state = _int(config, "mamba_d_state")
    channels = int(config.mamba_expand * config.hidden_size) + 2 * _int(config, "mamba_n_groups") * state
    return (
        StateArray(CONV, (channels, _int(config, "mamba_d_conv")), dtype),
        StateArray(RECURRENT, (_int(config, "mamba_n_heads"), _int(config, "mamba_d_head"), state), "float32"),
    )


def _mamba2_state(
    config: PretrainedConfig, dtype: str, inner: int, fields: tuple[str, str, str, str, str]
) -> tuple[StateArray, ...]:
    """A Mamba2 mixer of ``inner`` channels whose groups, state size, kernel, heads and head
    size the config names ``fields``: conv over ``inner + 2 * groups * state`` channels, SSM
    state ``[heads, head_dim, state]``."""
    groups, size, kernel, heads, head_dim = (_int(config, name) for name in fields)
    return (
        StateArray(CONV, (inner + 2 * groups * size, kernel), dtype),
        StateArray(RECURRENT, (heads, head_dim, size), "float32"),
    )


def _falcon_h1(config: PretrainedConfig, dtype: str) -> tuple[StateArray, ...]:
    """Falcon-H1's Mamba2 mixers (beside attention in every layer): ``mamba_d_ssm`` channels,
    else ``mamba_expand * hidden``."""
    inner: object = getattr(config, "mamba_d_ssm", None)
    channels = inner if isinstance(inner, int) else int(config.mamba_expand * config.hidden_size)
    fields = ("mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_n_heads", "mamba_d_head")
    return _mamba2_state(config, dtype, channels, fields)


def _zamba2(config: PretrainedConfig, dtype: str) -> tuple[StateArray, ...]:
    """Zamba2's Mamba2 mixers (in every layer; hybrid layers run a shared attention block
    before theirs): ``mamba_expand * hidden`` channels."""
    fields = ("mamba_ngroups", "mamba_d_state", "mamba_d_conv", "n_mamba_heads", "mamba_headdim")
    return _mamba2_state(config, dtype, int(config.mamba_expand * config.hidden_size), fields)


def _nemotron_h(config: PretrainedConfig, dtype: str) -> tuple[StateArray, ...]:
    """Nemotron-H's Mamba2 mixers: ``mamba_num_heads * mamba_head_dim`` channels."""
    fields = ("n_groups", "ssm_state_size", "conv_kernel", "mamba_num_heads", "mamba_head_dim")
    inner = _int(config, "mamba_num_heads") * _int(config, "mamba_head_dim")
    return _mamba2_state(config, dtype, inner, fields)


def _jamba(config: PretrainedConfig, dtype: str) -> tuple[StateArray, ...]:
    """Jamba's Mamba (1) mixers: conv and SSM state over ``mamba_expand * hidden`` channels."""
    channels = _int(config, "mamba_expand") * _int(config, "hidden_size")
    return (
        StateArray(CONV, (channels, _int(config, "mamba_d_conv")), dtype),
        StateArray(RECURRENT, (channels, _int(config, "mamba_d_state")), "float32"),
    )


def _gated_delta_net(config: PretrainedConfig, dtype: str) -> tuple[StateArray, ...]:
    """Qwen3-Next's gated DeltaNet: conv over queries, keys and values; state ``[value heads,
    key head size, value head size]``."""
    key_dim = _int(config, "linear_num_key_heads") * _int(config, "linear_key_head_dim")
    value_heads = _int(config, "linear_num_value_heads")
    value_dim = value_heads * _int(config, "linear_value_head_dim")
    return (
        StateArray(CONV, (2 * key_dim + value_dim, _int(config, "linear_conv_kernel_dim")), dtype),
        StateArray(
            RECURRENT,
            (value_heads, _int(config, "linear_key_head_dim"), _int(config, "linear_value_head_dim")),
            "float32",
        ),
    )


def _short_conv(config: PretrainedConfig, dtype: str) -> tuple[StateArray, ...]:
    """LFM2's short convolutions: a conv state over the hidden size, no recurrent state."""
    return (StateArray(CONV, (_int(config, "hidden_size"), _int(config, "conv_L_cache")), dtype),)


#: The model types whose state layers kvcache holds, and their states' arrays.
STATE_FAMILIES: Final[dict[str, Arrays]] = {
    "mamba2": _mamba2,
    "bamba": _mamba2_hybrid,
    "granitemoehybrid": _mamba2_hybrid,
    "jamba": _jamba,
    "qwen3_next": _gated_delta_net,
    "lfm2": _short_conv,
    "falcon_h1": _falcon_h1,
    "zamba2": _zamba2,
    "nemotron_h": _nemotron_h,
}


def layer_types(config: PretrainedConfig, layers: int) -> list[str] | None:
    """``config.layer_types`` as a list (``None`` when the config has none)."""
    types: object = getattr(config, "layer_types", None)
    if types is None:
        return None
    listed = [str(name) for name in cast("Sequence[object]", types)]
    if len(listed) != layers:
        raise UnsupportedConfigError(f"the config lists {len(listed)} layer_types for {layers} layers")
    return listed


def state_specs(config: PretrainedConfig, layers: int, dtype: str) -> dict[int, StateSpec]:
    """The :class:`~kvcache_core.StateSpec` of each layer of a decoder config that keeps a
    recurrent state, alone or beside its K/V (:data:`HYBRID_LAYER_TYPES`); empty without
    such layers. Conv states in ``dtype``, recurrent states in float32 (the models compute
    them in float32).

    Raises:
        UnsupportedConfigError: state layers of a model type whose state shapes kvcache does
            not know; the message names them and the families served.
    """
    types = layer_types(config, layers) or []
    indices = [index for index, name in enumerate(types) if name in STATE_LAYER_TYPES | HYBRID_LAYER_TYPES]
    if not indices:
        return {}
    family = STATE_FAMILIES.get(str(config.model_type))
    if family is None:
        named = ", ".join(repr(name) for name in sorted({types[index] for index in indices}))
        raise UnsupportedConfigError(
            f"the {config.model_type!r} model has layers of type {named} (a recurrent state) whose state shapes "
            f"kvcache does not know; state layers are served for {', '.join(sorted(STATE_FAMILIES))}"
        )
    spec = StateSpec(arrays=family(config, dtype))
    return dict.fromkeys(indices, spec)


class StateBridge:
    """transformers' linear-attention cache calls over the pool's state slots of a batch.

    With prefix caching, the first call of each forward to the first state layer, before
    the forward placed its tokens, files a checkpoint (``step.checkpoint_states``) of the
    rows without padding: their slots then hold the states after exactly their tokens, as no
    layer of the new forward has run. (A model whose first layer is attention alone places
    its tokens before any state layer runs: it files none, and so maps no prefix.)

    Args:
        manager: the pool's manager.
        specs: each state layer's spec (:func:`state_specs`).
        rows: the batch's rows (their requests, tokens and positions).
        placing: whether the forward under way has placed its tokens (grown the rows).
    """

    def __init__(
        self,
        manager: PagedKvCacheManager[torch.Tensor],
        specs: dict[int, StateSpec],
        rows: BatchRows,
        placing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._manager = manager
        self._specs = specs
        self._rows = rows
        self._handles = rows.handles
        self._checkpoints = manager.config.enable_prefix_caching
        self._first = min(specs, default=0)
        self._placing = placing
        self._checked_at: int | None = None  # the positions whose forward was considered for a checkpoint
        self._step: Step[torch.Tensor] | None = None
        self._open: int | None = None  # the state layer whose tensors are out
        self._tensors: dict[str, torch.Tensor] = {}
        self._in_place: dict[str, torch.Tensor] = {}  # the open layer's states read as the pool's own rows
        self._given: dict[tuple[int, str], torch.dtype] = {}  # the dtype the model handed in
        self.previous: dict[int, bool] = dict.fromkeys(specs, False)

    def is_state_layer(self, layer: int) -> bool:
        """Whether ``layer`` keeps a recurrent state."""
        return layer in self._specs

    def _check(self, layer: int, state_idx: int) -> StateSpec:
        spec = self._specs.get(layer)
        if spec is None:
            raise UnsupportedConfigError(f"layer {layer} keeps K/V, not a recurrent state")
        if state_idx != 0:
            raise UnsupportedConfigError(
                f"layer {layer} asked for state {state_idx}; kvcache holds one state per layer"
            )
        return spec

    def _io(self) -> Step[torch.Tensor]:
        """A step of no new tokens over the batch, to read and write states (planned again
        once the rows changed)."""
        step = self._step
        if step is None or list(step.request_ids) != [handle.request_id for handle in self._handles]:
            step = self._manager.begin_step(self._handles, 0)
            self._step = step
        return step

    def _switch(self, layer: int) -> dict[str, torch.Tensor]:
        if layer == self._first and self._checkpoints and self._handles and self._forward_begins():
            self.flush()  # the states the last forward left (a single state layer stays open)
            rows = self._rows
            unpadded = [h for h, tokens in zip(rows.handles, rows.tokens, strict=True) if tokens == rows.positions]
            if unpadded:
                self._manager.begin_step(unpadded, 0).checkpoint_states()
        if self._open != layer:
            self.flush()
            self._open = layer
        return self._tensors

    def _forward_begins(self) -> bool:
        """Whether this call is the first of a forward that has not placed its tokens yet
        (each forward adds positions, so the positions tell one forward from the next)."""
        positions = self._rows.positions
        if positions == self._checked_at or self._placing():
            return False
        self._checked_at = positions
        return True

    def _read(self, layer: int, name: str) -> torch.Tensor:
        tensors = self._switch(layer)
        if name not in tensors:
            try:
                values = self._pool_rows(layer, name)
            except StaleStepError:
                self._step = None
                values = self._pool_rows(layer, name)
            given = self._given.get((layer, name))
            tensors[name] = values if given is None else values.to(given)  # another dtype: a copy
        return tensors[name]

    def _pool_rows(self, layer: int, name: str) -> torch.Tensor:
        """The batch's state ``name`` of ``layer``: the pool's own rows when the batch's slots
        follow one another (the model's in-place updates land in the pool, nothing to copy
        back), else a copy."""
        step = self._io()
        rows = step.state_view(layer, name)
        if rows is None:
            return step.state(layer, name)
        self._in_place[name] = rows
        return rows

    def _write(self, layer: int, name: str, values: torch.Tensor) -> None:
        spec = self._specs[layer]
        array = next(item for item in spec.arrays if item.name == name)
        if tuple(values.shape[1:]) != array.shape:
            raise ShapeMismatchError(
                f"layer {layer}'s {name} state is {tuple(values.shape[1:])} per row, the pool holds {array.shape}: "
                "the model's state shapes differ from what cache_config_for read from its config"
            )
        if not self._handles:  # a first forward whose first layers keep states: its rows, no tokens yet
            self._rows.begin([0] * int(values.shape[0]), None, 0)
        self._given[layer, name] = values.dtype
        tensors = self._switch(layer)
        tensors[name] = values

    def flush(self) -> bool:
        """Write the open layer's changed states back to the batch's slots (the model may
        have changed them in place), and put them away; whether there were any."""
        layer, self._open = self._open, None
        tensors, self._tensors = self._tensors, {}
        in_place, self._in_place = self._in_place, {}
        if layer is None or not self._handles:
            return False
        for name in tensors:  # read ones too: decoding kernels update them in place
            array = next(item for item in self._specs[layer].arrays if item.name == name)
            values = tensors[name]
            if in_place.get(name) is values:
                continue  # the pool's own rows: already there
            target = getattr(torch, array.dtype)
            if values.dtype != target:
                if dtype_name(values.dtype) not in ("float16", "bfloat16", "float32") or target != torch.float32:
                    raise UnsupportedConfigError(
                        f"layer {layer}'s {name} state is {values.dtype}; the pool holds {array.dtype}"
                    )
                values = values.to(target)
            try:
                self._io().write_state(layer, name, values.contiguous())
            except StaleStepError:
                self._step = None
                self._io().write_state(layer, name, values.contiguous())
        return bool(tensors)

    def mapped(self, positions: int) -> None:
        """The rows were opened from the prefix cache at ``positions``: their slots hold
        the checkpoints' states, which the first forward goes on from."""
        self.previous = dict.fromkeys(self._specs, positions > 0)

    def reset(self) -> None:
        """Forget the batch (its rows were released): nothing is written back."""
        self._open, self._tensors, self._step, self._checked_at = None, {}, None, None
        self._in_place = {}
        self.previous = dict.fromkeys(self._specs, False)
        self._given.clear()

    # -- transformers' calls ---------------------------------------------------------------

    def get_conv_state(self, layer: int, state_idx: int = 0) -> torch.Tensor | None:
        """The batch's conv state of ``layer`` ``[batch, channels, kernel]``, or ``None``
        before the first forward wrote it."""
        self._check(layer, state_idx)
        return self._read(layer, CONV) if self.previous[layer] else None

    def get_recurrent_state(self, layer: int, state_idx: int = 0) -> torch.Tensor | None:
        """The batch's recurrent state of ``layer``, or ``None`` before the first forward."""
        spec = self._check(layer, state_idx)
        if not self.previous[layer] or RECURRENT not in spec.names():
            return None
        return self._read(layer, RECURRENT)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer: int, state_idx: int = 0, conv_kernel_size: int | None = None
    ) -> torch.Tensor:
        """Take the new tokens' conv inputs ``[batch, channels, new_tokens]``; keep the last
        ``kernel`` columns (after the previous state) and return every column the causal
        convolution needs, as transformers' ``LinearAttentionLayer`` does."""
        spec = self._check(layer, state_idx)
        kernel = next(item for item in spec.arrays if item.name == CONV).shape[-1]
        if conv_kernel_size is not None and conv_kernel_size != kernel:
            raise ShapeMismatchError(
                f"layer {layer} convolves over {conv_kernel_size} columns, the pool keeps {kernel}"
            )
        if not self.previous[layer]:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
            self.previous[layer] = True
        else:
            full = torch.cat([self._read(layer, CONV), conv_states], dim=-1)
        self._write(layer, CONV, full[..., -kernel:].clone())
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer: int, state_idx: int = 0) -> torch.Tensor:
        """Keep the batch's new recurrent state of ``layer``; returns it."""
        self._check(layer, state_idx)
        self._write(layer, RECURRENT, recurrent_states)
        return recurrent_states


class StateLayerCalls:
    """transformers' linear-attention cache calls of :class:`~kvcache_torch.hf.PagedCache`,
    served by its :class:`StateBridge` (``None`` for a model whose layers keep K/V only)."""

    _states: StateBridge | None
    _num_layers: int

    def _bridge(self) -> StateBridge:
        if self._states is None:
            raise UnsupportedConfigError("the model's layers keep K/V only: it has no recurrent state")
        return self._states

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The batch's conv state of a state layer, ``None`` before the first forward."""
        return self._bridge().get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The batch's recurrent state of a state layer, ``None`` before the first forward."""
        return self._bridge().get_recurrent_state(layer_idx, state_idx)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Keep the state layer's new conv inputs (see :class:`StateBridge`)."""
        kernel: int | None = kwargs.get("conv_kernel_size")
        return self._bridge().update_conv_state(conv_states, layer_idx, state_idx, kernel)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Keep the state layer's new recurrent state."""
        return self._bridge().update_recurrent_state(recurrent_states, layer_idx, state_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the state layer (by default the last) holds a state from an earlier forward."""
        bridge = self._bridge()
        if layer_idx is None:
            layer_idx = max(layer for layer in range(self._num_layers) if bridge.is_state_layer(layer))
        return bridge.previous.get(layer_idx, False)

    def is_recording_past(self, layer_idx: int) -> bool:
        """``False``: state layers keep no past states to roll back to."""
        return False
