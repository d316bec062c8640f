""":class:`PagedCache`, a transformers ``Cache`` whose K/V live in a kvcache paged pool."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from kvcache_core import InvalidArgumentError, PagedKvCacheHandle, PagedKvCacheManager, UnsupportedConfigError
from kvcache_core.contract.config import check_count
from kvcache_core.errors import InvalidTypeError, ShapeMismatchError
from kvcache_torch.hf.attention import attend_new_tokens
from kvcache_torch.hf.attention_choice import AttentionChoice, AttentionSwitch, check_choice, paged_by_choice
from kvcache_torch.hf.forward_pass import ForwardStep, Handoff, LayerProgress, Mode, drop_handoff, hand_off
from kvcache_torch.hf.guard import decoder_class, not_through_interface, unattended_layer
from kvcache_torch.hf.layer import PagedCacheLayer
from kvcache_torch.hf.model_config import ATTN_IMPLEMENTATION, attention_implementation, latent_attention, text_config
from kvcache_torch.hf.padding import left_padded_lengths, real_tokens, token_major
from kvcache_torch.hf.pool_fit import UpdateCheck, check_model_fits_pool, forward_mode
from kvcache_torch.hf.prompts import TokenFeed, attach_prompt_hook
from kvcache_torch.hf.rows import BatchRows, prompt_rows, release_requests, undo_step
from kvcache_torch.hf.state_layers import StateBridge, StateLayerCalls

__all__ = ["PagedCache"]


class PagedCache(StateLayerCalls, Cache):
    """A transformers ``Cache`` whose keys and values live in a kvcache paged pool.

    Row ``b`` of the batch is one kvcache request (allocated at the first forward, so the
    batch size comes from the model's input). Pass it to ``model.generate(..., cache=...)``
    (``past_key_values=`` before transformers 5) or to ``model(..., cache=...)`` in a manual
    loop. The fast path is the ``"kvcache_paged"`` attention: load the model with it, or build
    the cache with a model on transformers' default attention, whose forwards then run it
    (``attention="auto"``; :mod:`~kvcache_torch.hf.attention_choice`).

    Positions, lengths and masks are counted as transformers counts them: every column of
    the batch's 2-D ``attention_mask``, padding included (``get_seq_length``,
    ``get_mask_sizes``, ``crop``). Padding columns are not stored (``request_lengths()``):
    on the contiguous path only when built with the model, whose hook brings the mask.

    Prefix caching needs the prompts' token ids, which ``generate`` shows only to the model:
    pass the model itself as ``config`` (:mod:`~kvcache_torch.hf.prompts`), else call
    :meth:`map_cached_prefix`; a pool that caches prefixes warns once when no ids came.

    Args:
        manager: a manager of the ``torch`` backend whose geometry (layers, KV heads, head
            size) matches the model: ``create_manager("torch", cache_config_for(model, ...))``.
        config: the model (a ``torch.nn.Module`` with a ``config``), or its config
            (``model.config``); the config's ``_attn_implementation`` chooses the paged or
            the contiguous path at each forward.
        attention: ``"auto"`` (given the model): a plain decoder on its default attention whose
            attention goes through transformers' interface runs its forwards with ``"kvcache_paged"``
            (the paged path; logits within 1e-4 of ``DynamicCache``); ``"model"``: always the
            attention its config names.
        max_sequence_length: the most tokens a row will hold, if known: the allocator then
            keeps each request's blocks in one run, and growing past it raises
            ``SequenceTooLongError``.
        handles: live requests of ``manager`` of one length to go on from, one per row (e.g.
            ``KvTransferAgent.import_request``'s); the cache owns them, ``generate`` computes what follows
            (a model's state layers go on from the states in their slots).

    Raises:
        InvalidTypeError: ``manager`` is not a ``PagedKvCacheManager``, or ``config`` is
            neither a ``PretrainedConfig`` nor a model holding one.
        UnsupportedConfigError: the model's geometry differs from the pool's, the pool keeps
            fewer positions of a layer than its attention needs, the model has layers kvcache
            cannot hold (a recurrent state of a family it does not know, ...), or the config
            is set to ``"kvcache_paged"`` for a model whose attention does not call
            transformers' attention interface (the message names the class and the remedy,
            its own ``"sdpa"`` or ``"eager"``; a model transformers cannot judge up front is
            refused at its first forward, see :meth:`update`).
        InvalidArgumentError: a bad ``max_sequence_length`` or ``attention``; ``handles`` not live requests of
            ``manager`` of one length.
    """

    def __init__(
        self,
        manager: PagedKvCacheManager[torch.Tensor],
        config: PretrainedConfig | torch.nn.Module,
        *,
        max_sequence_length: int | None = None,
        handles: Sequence[PagedKvCacheHandle[torch.Tensor]] | None = None,
        attention: AttentionChoice = "auto",
    ) -> None:
        if not isinstance(manager, PagedKvCacheManager):
            raise InvalidTypeError(f"manager must be a PagedKvCacheManager, got {type(manager).__name__}")
        model = config if isinstance(config, torch.nn.Module) else None
        found: object = config if model is None else getattr(model, "config", None)
        if not isinstance(found, PretrainedConfig):
            raise InvalidTypeError(f"config must be the model or its PretrainedConfig, got {type(config).__name__}")
        config = found
        if max_sequence_length is not None:
            max_sequence_length = check_count(max_sequence_length, "max_sequence_length", minimum=1)
        choice = check_choice(attention)
        pool = manager.config
        text = text_config(config)
        layers, self._layer_specs, self._sources = check_model_fits_pool(config, text, pool, model)
        # The window DynamicCache gives each layer: its sliding window, or its chunk.
        self._windows = [spec.window if spec.window is not None else spec.chunk for spec in self._layer_specs]
        keeping = [pool.layer_spec(index).keeps_kv or pool.layer_spec(index).keeps_state for index in range(layers)]
        faces: list[Any] = [PagedCacheLayer(self, index, self._windows[index]) for index in range(layers)]
        if len(self._sources) > layers or not all(keeping):  # as in DynamicCache: reusing layers and
            from transformers.cache_utils import DummyLayer  # MLP layers keep nothing (transformers 5)

            faces = [face if kept else DummyLayer() for face, kept in zip(faces, keeping, strict=True)]  # type: ignore[no-untyped-call]
            faces += [DummyLayer() for _ in self._sources[layers:]]  # type: ignore[no-untyped-call]
        super().__init__(layers=faces)
        self._manager = manager
        self._check_update = UpdateCheck(pool)  # the pool's layers are the model's
        self._text = text
        self._switch = AttentionSwitch(text) if paged_by_choice(model, text, choice) else None
        self._latent = latent_attention(text) is not None  # fixed by the config: checked once
        self._read_later = frozenset(self._sources[layers:])  # layers whose K/V later layers reuse
        self._max_sequence_length = max_sequence_length
        self._num_layers = layers
        self._rows = BatchRows(manager, max_sequence_length)
        states = {layer: spec.state for layer in range(layers) if (spec := pool.layer_spec(layer)).state is not None}
        self._kv_layers = tuple(layer for layer in range(layers) if pool.layer_spec(layer).keeps_kv)
        self._attention_layers = len(self._kv_layers)
        self._progress = LayerProgress(layers, self._attention_layers)
        self._states = StateBridge(manager, states, self._rows, self._progress.placing) if states else None
        self._mode: Mode | None = None
        self._feed = TokenFeed(self._rows)
        if model is not None and (pool.enable_prefix_caching or attention_implementation(text) != ATTN_IMPLEMENTATION):
            attach_prompt_hook(model)  # ids (prefix caching), padding mask (contiguous path), the switch
        self._finalizer = weakref.finalize(self, release_requests, manager, self._rows.request_ids)
        if handles is not None:
            self._rows_started(self._rows.adopt(handles), self._path())

    # -- introspection -----------------------------------------------------------------

    @property
    def manager(self) -> PagedKvCacheManager[torch.Tensor]:
        """The manager whose pool holds the K/V."""
        return self._manager

    @property
    def handles(self) -> tuple[PagedKvCacheHandle[torch.Tensor], ...]:
        """The kvcache handle of each batch row, in row order. Deprecated side effect: it
        writes the state layers' latest states to the rows' slots, as :meth:`flush_states`
        (a ``DeprecationWarning`` when there were any); call that before reading the pool."""
        if self._states is not None and self._states.flush():
            warnings.warn(
                "PagedCache.handles wrote the state layers' latest states to the rows' slots; it will stop: call "
                "cache.flush_states() before what reads the requests from the pool (an export, a fork)",
                DeprecationWarning,
                stacklevel=2,
            )
        return tuple(self._rows.handles)

    def flush_states(self) -> None:
        """Write the state layers' latest states (the last forward's stay in tensors until the
        next one) to the rows' state slots, so that what reads the requests from the pool (an
        export, a fork, a swap) finds them; the next forward goes on from there. Nothing to do
        without state layers."""
        if self._states is not None:
            self._states.flush()

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The kvcache request id of each batch row, in row order."""
        return tuple(self._rows.request_ids)

    def request_lengths(self) -> list[int]:
        """Tokens held per row (without the padding the paged path skips).

        After :meth:`crop` a request keeps the blocks (and ``num_tokens()``) of its removed
        tokens, which its next tokens overwrite; this counts the tokens still in use.
        """
        return list(self._rows.tokens)

    @property
    def batch_size(self) -> int:
        """Rows held; 0 before the first forward and after :meth:`release`."""
        return len(self._rows)

    @property
    def is_compileable(self) -> bool:
        """``False``: the pool's tables change shape every step."""
        return False

    @property
    def is_initialized(self) -> bool:
        """Whether the cache holds requests."""
        return bool(self._rows.handles)

    @property
    def is_croppable(self) -> bool:
        """``True`` (:meth:`crop` restores the state before the removed positions) unless
        the model has recurrent-state layers, which keep no earlier states."""
        return self._states is None

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether it keeps a recurrent state and no K/V (as transformers counts: a
        layer keeping both is not linear, so ``generate`` still skips the cached positions)."""
        states = self._states
        return [
            states is not None and states.is_state_layer(layer) and layer not in self._kv_layers
            for layer in range(self._num_layers)
        ]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions cached for ``layer_idx`` (padding columns included, as transformers
        counts); a layer keeping no K/V (a state only, or nothing) answers for the first
        layer that keeps K/V."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self._sources):
            return 0
        if layer_idx < self._num_layers and layer_idx not in self._kv_layers:
            layer_idx = self._kv_layers[0] if self._kv_layers else layer_idx
        return self._progress.lengths[self._sources[layer_idx]]

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for a mask of ``query_length`` new tokens: all the cached
        positions plus the new ones, from offset 0; on the contiguous path, for a sliding or
        chunked layer of window ``W``, the last ``W - 1`` cached positions plus the new ones,
        as ``DynamicSlidingWindowLayer`` sizes them (:meth:`update` returns those).

        ``query_length`` may also be the ``cache_position`` tensor older transformers pass.
        """
        length = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        cached = self.get_seq_length(layer_idx)
        window = self._contiguous_window(layer_idx)
        if window is None:
            return cached + length, 0
        return min(cached, window - 1) + length, max(cached - window + 1, 0)

    def _contiguous_window(self, layer: object) -> int | None:
        """The window of ``layer``'s contiguous K/V: ``None`` on the paged path (its mask
        spans every position) and for full layers."""
        if attention_implementation(self._text) == ATTN_IMPLEMENTATION:  # this forward's, switched or not
            return None
        if not isinstance(layer, int) or not 0 <= layer < len(self._sources):
            return None
        return self._windows[self._sources[layer]]

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """``max_sequence_length`` if given, else ``-1`` (grows while the pool has blocks)."""
        return -1 if self._max_sequence_length is None else self._max_sequence_length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """:meth:`get_max_length` under the name transformers 4 uses."""
        return self.get_max_length()

    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={len(self._rows)}, positions={self._rows.positions}, "
            f"tokens={sum(self.request_lengths())}, mode={self._mode}, manager={self._manager!r})"
        )

    # -- prefix caching ----------------------------------------------------------------

    def map_cached_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Start every row from the prefix cache: call it with the prompts before ``generate``.

        Each row becomes a kvcache request holding its prompt's token ids (padding left
        out), so that the blocks of the prompt become cacheable as they are written, and
        mapping every cached full block of it (``CacheConfig(enable_prefix_caching=True)``).
        transformers counts positions per batch, so the rows keep the cached positions all
        of them share (a row with fewer drops its extra hits); ``generate`` then sees a cache
        of that many positions and computes only the tokens after them.

        Args:
            input_ids: ``[batch, positions]`` token ids, left-padded.
            attention_mask: ``[batch, positions]``, 0 for padding (``None``: no padding).

        Returns:
            The positions now cached (``get_seq_length()``): 0 without a hit.

        Raises:
            InvalidArgumentError: the cache already holds rows (``release()`` it first), or
                ids and mask that are not 2-D integer tensors of one shape, left-padded.
            UnsupportedConfigError: the model does not run ``"kvcache_paged"`` attention.
            OutOfBlocksError: the pool cannot hold the rows (nothing is kept).
        """
        if self._rows.handles:
            raise InvalidArgumentError(f"the cache holds {len(self._rows)} rows already: release() it first")
        if self._path() != "paged":
            raise UnsupportedConfigError(
                f"map_cached_prefix needs attn_implementation={ATTN_IMPLEMENTATION!r} (or a cache built with the "
                f"model, attention='auto'), the model runs {attention_implementation(self._text)!r}"
            )
        prompts = prompt_rows(input_ids, attention_mask)
        columns = int(input_ids.shape[1])
        shared = self._rows.map_prefix(list(prompts), [columns - len(prompt) for prompt in prompts], columns)
        return self._rows_started(shared, "paged")

    def receive_token_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> int:
        """Take the coming forward's token ids ``[batch, new_tokens]`` and padding mask (the
        model's forward pre-hook calls it); with prefix caching on, a new batch's first forward
        starts from the prefix cache (:meth:`~kvcache_torch.hf.prompts.TokenFeed.receive`).
        Returns the positions the forward skips, cached already (0: none).

        Raises:
            OutOfBlocksError: the pool cannot hold the rows (nothing is kept).
        """
        self._feed.mask = attention_mask  # the contiguous path stores the tokens it marks real
        if not self._manager.config.enable_prefix_caching:
            return 0
        shared = self._feed.receive(input_ids, attention_mask, position_ids)
        return 0 if shared is None else self._rows_started(shared, forward_mode(self._text, self._latent, None))

    def forward_begins(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """A forward of ``module`` begins (its pre-hook): ``attention="auto"`` may switch it."""
        if self._switch is not None:
            self._switch.begin(module, kwargs)

    def forward_ended(self, module: torch.nn.Module) -> None:
        """The forward of ``module`` ended or failed (its hook): the model's attention is back."""
        if self._switch is not None:
            self._switch.end(module)

    def _path(self) -> Mode:
        """The path of this cache's forwards, read between forwards (during one, the config says)."""
        paged = self._switch is not None or attention_implementation(self._text) == ATTN_IMPLEMENTATION
        return "paged" if paged else "contiguous"

    def _rows_started(self, positions: int, mode: Mode) -> int:  # the new rows hold positions already
        self._mode = mode
        self._progress.lengths = [positions] * self._num_layers
        if self._states is not None:
            self._states.mapped(positions)
        return positions

    # -- lifecycle ---------------------------------------------------------------------

    def release(self) -> None:
        """Deallocate every row's request: its blocks return to the pool. The cache is then
        empty and can serve a new batch."""
        drop_handoff(self)  # a forward that failed half-way
        if self._states is not None:
            self._states.reset()
        self._rows.release()
        self._progress.reset(0)
        self._mode, self._feed.mask = None, None

    def close(self) -> None:
        """:meth:`release`."""
        self.release()

    reset = close  # transformers' Cache.reset: the same as release()

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    # -- the write/read path -------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take one layer's new keys and values ``[batch, kv_heads, new_tokens, head_dim]``.

        With ``"kvcache_paged"`` attention the write happens in the attention function (it
        sees the padding mask, so padding is not stored) and the new K/V are returned as
        they are. Otherwise they are written now and the whole contiguous K/V ``[batch,
        kv_heads, positions, head_dim]`` returned (zeros where a row stored no padding); for
        a sliding or chunked layer of window ``W``, its last ``W - 1`` positions before this
        forward and the new ones, as ``DynamicSlidingWindowLayer`` returns them
        (:meth:`get_mask_sizes` sizes its mask so).

        Raises:
            LayerIndexError: ``layer_idx`` outside the model's layers.
            ShapeMismatchError: K/V not ``[batch, kv_heads, new_tokens, head_dim]`` of the
                pool's geometry, or a batch size other than the rows held.
            DTypeMismatchError: K/V of another dtype than the pool's.
            UnsupportedConfigError: the attention implementation changed while the cache
                holds tokens, the previous forward did not reach every layer, or (with
                ``"kvcache_paged"``) an earlier layer's keys and values never reached the
                ``kvcache_paged`` attention: the model computes attention itself. That
                forward is undone (a first forward leaves no row), naming the model class
                and the remedy (its own ``"sdpa"`` or ``"eager"`` attention).
            OutOfBlocksError, SequenceTooLongError: the pool cannot hold the new tokens
                (nothing is changed).
        """
        rows = self._rows.handles
        layer = self._check_update(key_states, value_states, layer_idx, len(rows) if rows else None)
        step = self._progress.step
        # The attention implementation cannot change within a forward: read at its first layer.
        mode = step.mode if step is not None and layer not in step.layers_done else self._mode_now()
        if mode == "paged" and step is not None and step.awaiting is not None:  # keys and values wait
            self._check_attended(layer)
        step = self._progress.join(layer, int(key_states.shape[2]), first=not rows)
        step.mode = mode
        if mode == "paged":
            step.updated.add(layer)
            step.awaiting = layer
            hand_off(Handoff(self, layer, key_states, value_states, step, self._attend, layer in self._read_later))
            return key_states, value_states
        if step.planned is None:  # the padding the hook's mask marks is not stored
            valid = self._feed.real_new_tokens(step.start + step.query_length, step.query_length, len(key_states))
            self._place_step(step, len(key_states), valid, "contiguous")
        planned = step.planned
        assert planned is not None  # placed just above
        keys, values = token_major(key_states, step.valid), token_major(value_states, step.valid)
        if step.start == 0:  # a first forward's K/V are the new ones, as DynamicCache returns them
            planned.write(layer, keys, values)
            self._progress.finish(step, layer)
            return key_states, value_states
        window = self._windows[layer]  # a sliding layer's last W - 1 positions and the step's
        kept = None if window is None else min(step.start, window - 1) + step.query_length
        width = self._rows.one_row_width(layer, kept, planned)
        if width is None:
            planned.write(layer, keys, values)
            self._progress.finish(step, layer)
            return self._rows.gather_padded(layer, kept, planned)
        # One row, all stored: written and shown in one call (the storage's lane, where it has one)
        views = planned.write_and_view(layer, keys, values, width=width, layout="HND")
        self._progress.finish(step, layer)
        return planned.gather_padded(layer, width=width, layout="HND") if views is None else views

    def _mode_now(self) -> Mode:
        """The path of a forward starting now (:func:`~kvcache_torch.hf.pool_fit.forward_mode`)."""
        return forward_mode(self._text, self._latent, self._mode if self._rows.positions else None)

    def _attend(
        self,
        pending: Handoff,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
        features: dict[str, Any],
    ) -> torch.Tensor:
        """Write the layer's real new tokens into the pool (one write for the batch) and
        attend over the pool in place, with the layer's attention features (``window``,
        ``softcap``, ``sinks``; its ``chunk`` comes from the config).

        A first forward without padding or with left padding, and without attention
        features, attends over its new K/V as they are (:func:`attend_new_tokens`).

        Returns ``[batch, new_tokens, query_heads, head_dim]``; rows of padding tokens are 0.
        """
        step, layer = pending.step, pending.layer
        batch, query_heads, query_length, _ = query.shape
        head_dim = int(pending.value.shape[-1])  # the output is as wide as the values
        if batch != pending.key.shape[0] or query_length != step.query_length:
            raise ShapeMismatchError(
                f"query {tuple(query.shape)} does not match the keys {tuple(pending.key.shape)} of this layer"
            )
        if step.planned is None:
            valid = real_tokens(attention_mask, step.start + query_length, query_length, batch)
            self._place_step(step, batch, valid, "paged")
        planned = step.planned
        assert planned is not None  # placed just above
        valid = step.valid
        window, softcap, sinks = features["window"], features["softcap"], features["sinks"]
        chunk = self._layer_specs[layer].chunk
        plain = window is None and softcap is None and sinks is None and chunk is None
        first_prefill = plain and step.start == 0 and query_length > 1
        if first_prefill and valid is not None and step.real_lengths is None:
            step.real_lengths = left_padded_lengths(valid) or []  # []: not left padding
        real_lengths = step.real_lengths if first_prefill and valid is not None else None
        keys = values = None
        if step.stored and not pending.reader:  # the step was checked when planned: per layer only the arrays are
            keys, values = token_major(pending.key, valid), token_major(pending.value, valid)
        if first_prefill and (valid is None or real_lengths):
            if keys is not None and values is not None:
                planned.write(layer, keys, values)
            output = attend_new_tokens(module, query, pending.key, pending.value, scaling, real_lengths)
        elif not step.stored:
            output = query.new_zeros((batch, query_length, query_heads, head_dim))
        else:
            rows = token_major(query, valid)
            arguments: dict[str, Any] = dict(scale=scaling, window=window, softcap=softcap, sinks=sinks, chunk=chunk)
            if keys is not None and values is not None:  # one call: the write, then the attention
                attended = planned.write_and_attend(layer, keys, values, rows, **arguments)
            else:
                attended = planned.attention(layer, rows, **arguments)
            if valid is None:
                output = attended.view(batch, query_length, query_heads, head_dim)
            else:
                output = query.new_zeros((batch, query_length, query_heads, head_dim))
                output[valid] = attended
        if not pending.reader:
            self._progress.finish(step, layer)
        return output

    # -- batch surgery: beam search, crop --------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes a copy of row ``beam_idx[i]`` (beam search). A source row used once
        moves; each further use is a ``fork`` of its request, sharing every block: only the
        block a beam goes on to write in is copied, by the next forward (copy-on-write).

        Raises:
            InvalidArgumentError: an index outside the rows, or not one per row.
        """
        sources = self._rows.check_indices(beam_idx, "beam_idx")
        if len(sources) != len(self._rows):
            raise InvalidArgumentError(f"beam_idx must name one source per row ({len(self._rows)}), got {len(sources)}")
        self._remap_rows(sources)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place: rows ``a, b`` become ``a, a, b, b``
        (the repeats are forks: they share the row's blocks until they diverge).

        Raises:
            InvalidArgumentError: ``repeats`` below 1.
        """
        repeats = check_count(repeats, "repeats", minimum=1)
        self._remap_rows([row for row in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in that order); the others are released, a repeated row forked.

        Raises:
            InvalidArgumentError: an index outside the rows.
        """
        self._remap_rows(self._rows.check_indices(indices, "indices"))

    def _remap_rows(self, sources: list[int]) -> None:
        """New row ``j`` takes the content of old row ``sources[j]`` (:meth:`BatchRows.remap`)."""
        self._progress.check_complete()
        if sources == list(range(len(self._rows))):
            return
        if self._states is not None:
            self._states.flush()  # a fork copies the slots: they must hold the latest states
        self._rows.remap(sources)
        self._progress.step = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last positions: ``crop(-n)`` removes ``n`` (transformers 5), ``crop(n >= 0)``
        keeps the first ``n`` (older), ``crop(0)`` or past the length changes nothing; each row's
        request is truncated (``manager.truncate``), blocks past its new end freed at once.

        Raises:
            InvalidArgumentError: removing more positions than cached, or not an int.
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise InvalidArgumentError(f"crop takes an int, got {tokens_to_remove!r}")
        self._progress.check_complete()
        total = self._rows.positions
        keep = total + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, total)
        if tokens_to_remove == 0 or keep == total:
            return
        if keep < 0:
            raise InvalidArgumentError(f"cannot remove {-tokens_to_remove} positions: the cache holds {total}")
        self._rows.truncate(self._rows.stored_before(keep), keep)
        self._progress.reset(keep)

    # -- internals -----------------------------------------------------------------------

    def _check_attended(self, layer: int) -> None:
        """Refuse a model whose attention does not call the ``kvcache_paged`` attention: an
        update of another layer of the same forward arrives while an earlier layer's keys
        and values still wait for it, or a new forward begins after one in which every layer
        was updated and none attended (a one-layer model). The refused forward is undone.

        Raises:
            UnsupportedConfigError: naming the model class and the remedy.
        """
        step = self._progress.step
        found = unattended_layer(step, layer, self._attention_layers)
        if step is not None and found is not None:
            self._abandon_step(step)
            raise not_through_interface(decoder_class(self._text), self._text, found[0], earlier=found[1])

    def _abandon_step(self, step: ForwardStep) -> None:
        """Undo a forward refused half-way: rows it allocated are released, rows it grew go
        back to their length before it (or, where a sliding window already dropped the
        blocks that needs, are released too), and the next forward starts afresh."""
        drop_handoff(self)
        self._progress.step = None
        if not undo_step(step, self._rows):
            self.release()
        elif step.planned is not None:
            self._progress.reset(step.start)

    def _place_step(self, step: ForwardStep, batch: int, valid: torch.Tensor | None, mode: Mode) -> None:
        """Plan the step in the manager: allocate the rows at the first forward, then grow
        every row by its real new tokens (``valid``; ``None``: all of them), for the
        whole batch at once.

        Atomic: when the pool cannot hold the step, nothing is allocated or grown.
        """
        counts = [step.query_length] * batch if valid is None else [int(c) for c in valid.sum(dim=1).cpu().numpy()]
        prefixes = self._manager.config.enable_prefix_caching
        token_ids = self._feed.step_ids(batch, step.query_length, valid) if prefixes else None
        try:
            planned, allocated = self._rows.begin(counts, valid, step.query_length, token_ids)
        except BaseException:
            self._progress.step = None  # nothing changed: the next forward starts afresh
            raise
        step.planned = planned
        step.valid = valid
        step.stored = planned.num_new_tokens
        step.counts = counts
        step.allocated = allocated
        self._mode = mode
