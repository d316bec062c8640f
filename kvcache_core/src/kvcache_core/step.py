"""The forward step: a batch planned once, then written and attended layer by layer.

FlashInfer's plan/run, vLLM's attention metadata::

    step = manager.begin_step(handles, new_tokens, token_ids=...)   # extend, copy-on-write,
    for layer in range(num_layers):                                 #   window, slots, page
        step.write(layer, keys, values)                             #   table, qo_indptr:
        out = step.attention(layer, query)                          #   checked once
    step = step.advance()                                           # the next decode step

:meth:`~kvcache_core.PagedKvCacheManager.begin_step` does every check that depends on the
requests; :meth:`Step.write` and :meth:`Step.attention` check only what depends on the
layer's arrays (layer index, shape, dtype) and that the step is still current, and a write
goes through the manager's one write path, which refuses blocks that became immutable
(registered in the prefix cache, or shared) since the step's slots were last checked.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.protocols import SlotArray

__all__ = ["Step", "StepRunner"]

ArrayT = TypeVar("ArrayT")


class StepRunner(Protocol[ArrayT]):
    """What a step needs of the manager that planned it: the manager's data path bound to
    the step's requests (it holds the manager's lock around each call and refuses a stale
    step with :class:`~kvcache_core.errors.StaleStepError`)."""

    def write(self, step: Step[ArrayT], layer: int, keys: ArrayT, values: ArrayT) -> None:
        """The manager's one write path, over ``step``'s slots of the layer's group."""
        ...

    def attention(
        self, step: Step[ArrayT], layer: int, query: ArrayT, scale: float | None, causal: bool, features: dict[str, Any]
    ) -> ArrayT:
        """The manager's one attention entry, over ``step``'s page tables and offsets."""
        ...

    def write_and_attend(
        self,
        step: Step[ArrayT],
        layer: int,
        keys: ArrayT,
        values: ArrayT,
        query: ArrayT,
        scale: float | None,
        causal: bool,
        features: dict[str, Any],
    ) -> ArrayT:
        """:meth:`write` then :meth:`attention` of one layer, under one hold of the lock."""
        ...

    def gather_padded(self, step: Step[ArrayT], layer: int, width: int | None, layout: str) -> tuple[ArrayT, ArrayT]:
        """The step's K/V of ``layer`` as one padded batch (:meth:`Step.gather_padded`)."""
        ...

    def padded_view(
        self, step: Step[ArrayT], layer: int, width: int | None, layout: str
    ) -> tuple[ArrayT, ArrayT] | None:
        """That batch as views of the pool, or ``None`` (:meth:`Step.padded_view`)."""
        ...

    def write_and_view(
        self, step: Step[ArrayT], layer: int, keys: ArrayT, values: ArrayT, width: int | None, layout: str
    ) -> tuple[ArrayT, ArrayT] | None:
        """:meth:`write` then :meth:`padded_view`, under one hold of the lock (:meth:`Step.write_and_view`)."""
        ...

    def read_state(self, step: Step[ArrayT], layer: int, name: str) -> ArrayT:
        """A copy of the step's requests' state array ``name`` of ``layer``."""
        ...

    def read_state_view(self, step: Step[ArrayT], layer: int, name: str) -> ArrayT | None:
        """The step's requests' state array ``name`` of ``layer`` in the pool, or ``None``."""
        ...

    def write_state(self, step: Step[ArrayT], layer: int, name: str, values: ArrayT) -> None:
        """Write the step's requests' state array ``name`` of ``layer``."""
        ...

    def checkpoint_states(self, step: Step[ArrayT]) -> int:
        """File checkpoints of the step's requests' states."""
        ...

    def advance(self, step: Step[ArrayT], token_ids: object) -> Step[ArrayT]:
        """The decode step after ``step`` (:meth:`Step.advance`)."""
        ...


class Step(Generic[ArrayT]):
    """One forward pass of a batch, planned by
    :meth:`~kvcache_core.PagedKvCacheManager.begin_step`.

    Attributes:
        request_ids: the batch's requests, in order.
        new_tokens: ``[B]`` tokens each request added in this step.
        slots: ``[sum(new_tokens)]`` int64 slots of the new tokens, requests packed in
            order (read-only); with KV-cache groups ``[num_groups, sum(new_tokens)]``,
            row ``g`` for the layers of group ``g``.
        page_table: the batch after the step's growth (read-only, generation-stamped), of
            the first KV-cache group.
        page_tables: the page table of every KV-cache group, in group order.
        qo_indptr: ``[B + 1]`` int32 offsets of each request's new tokens in ``slots``
            and in the query (read-only).
        num_heads, head_dim: the pool's KV heads and features (of queries and keys); a layer
            of its own geometry takes its own (``CacheConfig.layer_geometry``).
        value_width: features of the values and of attention's output (``head_dim`` unless
            the pool's ``value_head_dim`` differs).
    """

    __slots__ = (
        "_runner",
        "head_dim",
        "new_tokens",
        "num_heads",
        "page_table",
        "page_tables",
        "qo_indptr",
        "request_ids",
        "slots",
        "value_width",
    )

    def __init__(
        self,
        runner: StepRunner[ArrayT],
        request_ids: tuple[str, ...],
        new_tokens: tuple[int, ...],
        slots: SlotArray,
        page_tables: tuple[PageTable, ...],
        num_heads: int,
        head_dim: int,
        value_width: int | None = None,
    ) -> None:
        self._runner = runner
        self.request_ids = request_ids
        self.new_tokens = new_tokens
        owned = np.array(slots, dtype=np.int64)
        owned.flags.writeable = False
        slots = owned.view()  # a view of a read-only base: nobody can make it writeable again
        self.slots: SlotArray = slots
        self.page_tables = page_tables
        self.page_table = page_tables[0]
        # The offsets in Python (a few ints; NumPy's calls cost more in a model's forward).
        indptr = np.array([0, *itertools.accumulate(new_tokens)], dtype=np.int32)
        indptr.flags.writeable = False
        self.qo_indptr: npt.NDArray[np.int32] = indptr
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.value_width = head_dim if value_width is None else value_width

    @property
    def num_new_tokens(self) -> int:
        """Tokens the step adds over the whole batch."""
        return int(self.slots.shape[-1])

    def write(self, layer: int, keys: ArrayT, values: ArrayT) -> None:
        """Scatter one layer's K/V of the step's new tokens into the pool.

        Args:
            layer: ``0 <= layer < num_layers``.
            keys, values: ``[num_new_tokens, num_heads, head_dim]`` and ``[num_new_tokens,
                num_heads, value_width]`` native arrays of the pool's dtype, requests packed
                in the step's order.

        Writing every layer makes full blocks cacheable (prefix caching), exactly as
        :meth:`~kvcache_core.PagedKvCacheManager.write` does: it is the manager's write
        path, with the same checks. A block of the step that became immutable after
        planning (registered in the prefix cache once every layer was written, or mapped
        by another request) is refused, never written in place: rewrite it through
        :meth:`~kvcache_core.PagedKvCacheManager.writable_slots`, which copies it or takes
        it out of the prefix cache first.

        Raises:
            StaleStepError: a request of the step changed since it was planned.
            SharedBlockWriteError: a slot of the step is in a block the prefix cache
                serves or several requests share.
            LayerIndexError, ShapeMismatchError, DTypeMismatchError, ArrayTypeError.
        """
        self._runner.write(self, layer, keys, values)

    def attention(
        self,
        layer: int,
        query: ArrayT,
        *,
        scale: float | None = None,
        causal: bool = True,
        window: int | None = None,
        softcap: float | None = None,
        sinks: ArrayT | None = None,
        chunk: int | None = None,
    ) -> ArrayT:
        """Attention of the step's new tokens over the batch, reading the pool in place.

        Args:
            layer: the layer whose pool to read (write it first).
            query: ``[num_new_tokens, k * num_heads, head_dim]`` (``k >= 1`` query heads
                per KV head), requests packed in the step's order.
            scale: score scale, ``1 / sqrt(head_dim)`` by default.
            causal: each new token sees keys up to its own position (and, with a sliding
                window, only the window's).
            window, softcap, sinks, chunk: this layer's attention features (see
                :mod:`kvcache_core.attention.features`): a window ``W`` (combined with
                the pool's or the layer's group's), logit softcapping,
                ``[num_query_heads]`` sinks of the query's dtype, chunked local attention
                ``C`` (by default the layer's ``LayerSpec.chunk``).

        Returns:
            ``[num_new_tokens, k * num_heads, value_width]`` of the query's dtype.

        Raises:
            StaleStepError: a request of the step changed since it was planned.
            LayerIndexError, ShapeMismatchError, DTypeMismatchError, ArrayTypeError,
            InvalidArgumentError (``scale``, ``window``, ``softcap``, ``chunk``),
            InvalidTypeError (``causal``), UnsupportedConfigError (a feature the storage
            does not serve: the message names the capability).
        """
        features = {"window": window, "softcap": softcap, "sinks": sinks, "chunk": chunk}
        return self._runner.attention(self, layer, query, scale, causal, features)

    def write_and_attend(
        self,
        layer: int,
        keys: ArrayT,
        values: ArrayT,
        query: ArrayT,
        *,
        scale: float | None = None,
        causal: bool = True,
        window: int | None = None,
        softcap: float | None = None,
        sinks: ArrayT | None = None,
        chunk: int | None = None,
    ) -> ArrayT:
        """:meth:`write` the layer's new K/V, then its :meth:`attention`, in one call: what a
        model's layer does once per step (one hold of the manager's lock, one staleness
        check). The arguments and errors are those of the two calls; when the write is
        refused, nothing is written and no attention runs.
        """
        features = {"window": window, "softcap": softcap, "sinks": sinks, "chunk": chunk}
        return self._runner.write_and_attend(self, layer, keys, values, query, scale, causal, features)

    def gather_padded(self, layer: int, *, width: int | None = None, layout: str = "NHD") -> tuple[ArrayT, ArrayT]:
        """The K/V of ``layer`` for the step's requests as one padded batch: what a dense
        attention (transformers' ``sdpa`` or ``eager``) reads. Row ``b`` ends with the last
        ``min(width, n)`` tokens of request ``b``, ``n`` the tokens its page table lists (all
        of them after this step; with a sliding window, those from its first held block), and
        holds zeros before them (a left-padded batch). The storage reads the slots in one
        pass where it can (:mod:`kvcache_core.contract.padded`); write the layer first.

        Args:
            layer: a layer that keeps K/V.
            width: positions per row, ``0`` to the pool's capacity in tokens; ``None``: the
                longest request's ``n``.
            layout: ``"NHD"`` for ``[B, width, num_heads, head_dim]`` or ``"HND"`` for
                ``[B, num_heads, width, head_dim]`` (values: ``value_width``).

        Returns:
            ``(keys, values)`` new arrays (not views of the pool, possibly strided) of the
            dtype :meth:`~kvcache_core.PagedKvCacheManager.gather` gives.

        Raises:
            StaleStepError: a request of the step changed since it was planned.
            LayerIndexError: ``layer`` out of range or keeping no K/V.
            InvalidArgumentError: ``width`` or ``layout`` outside the ranges above.
        """
        return self._runner.gather_padded(self, layer, width, layout)

    def padded_view(self, layer: int, *, width: int | None = None, layout: str = "NHD") -> tuple[ArrayT, ArrayT] | None:
        """:meth:`gather_padded`'s batch as views of the pool, nothing copied, where it is one
        request's last tokens (no padding: ``width`` at most its ``n``) in one run of
        consecutive blocks and the storage lays them out in order (its optional
        ``view_padded``, :mod:`kvcache_core.contract.padded`); ``None`` otherwise (then
        :meth:`gather_padded` copies). The same values as :meth:`gather_padded`; the views
        show the pool, so they change when its blocks are written or reused: read them
        before the request's next step.

        Raises:
            StaleStepError, LayerIndexError, InvalidArgumentError: as :meth:`gather_padded`.
        """
        return self._runner.padded_view(self, layer, width, layout)

    def write_and_view(
        self, layer: int, keys: ArrayT, values: ArrayT, *, width: int | None = None, layout: str = "NHD"
    ) -> tuple[ArrayT, ArrayT] | None:
        """:meth:`write` the layer's new K/V, then its :meth:`padded_view`, in one call: what a
        dense attention reading the pool in place (transformers' contiguous path) does once
        per layer and step. Where the storage's step lane can show the batch
        (:class:`~kvcache_core.contract.lanes.ViewLane`: one request in one run), the write
        and the views take a few array operations, the views of every layer made once per
        step; elsewhere it is the two calls. ``width`` and ``layout`` are checked before
        anything is written; the write's errors are :meth:`write`'s, and a refused write
        writes nothing.

        Returns:
            The views :meth:`padded_view` returns, or ``None`` (the layer is written; then
            :meth:`gather_padded` copies).

        Raises:
            StaleStepError, LayerIndexError, InvalidArgumentError: as :meth:`padded_view`.
            SharedBlockWriteError, ShapeMismatchError, DTypeMismatchError, ArrayTypeError:
                as :meth:`write`.
        """
        return self._runner.write_and_view(self, layer, keys, values, width, layout)

    def state(self, layer: int, name: str) -> ArrayT:
        """The recurrent state array ``name`` of state layer ``layer`` for the step's
        requests, as a copy ``[B, *shape]`` in the step's order (zeros for a request that
        never wrote it; see :mod:`kvcache_core.contract.states`).

        Raises:
            StaleStepError: a request of the step changed since it was planned.
            LayerIndexError: ``layer`` out of range or not a state layer.
            InvalidArgumentError: the layer has no array ``name``.
        """
        return self._runner.read_state(self, layer, name)

    def state_view(self, layer: int, name: str) -> ArrayT | None:
        """The recurrent state array ``name`` of state layer ``layer`` for the step's
        requests, ``[B, *shape]`` in the step's order, in place: when their slots follow one
        another, the rows of the pool's array (a view with a mutable array library, whose
        in-place changes are the pool's and need no :meth:`write_state`; the current values
        with an immutable one); ``None`` otherwise (:meth:`state` gives a copy).

        Raises:
            StaleStepError, LayerIndexError, InvalidArgumentError: as :meth:`state`.
        """
        return self._runner.read_state_view(self, layer, name)

    def write_state(self, layer: int, name: str, values: ArrayT) -> None:
        """Replace the recurrent state array ``name`` of state layer ``layer`` for the
        step's requests with ``values`` ``[B, *shape]`` (the array's dtype), in the step's
        order.

        Raises:
            StaleStepError, LayerIndexError, InvalidArgumentError: as :meth:`state`.
            ShapeMismatchError, DTypeMismatchError, ArrayTypeError: bad ``values``.
        """
        self._runner.write_state(self, layer, name, values)

    def checkpoint_states(self) -> int:
        """With prefix caching, file a checkpoint of the recurrent states of each request of
        the step whose length ends a cached block: call it once every state layer wrote
        the step's states. A later prompt sharing that prefix starts from the checkpoint
        (its hit is cut back to the last block with one), and ``truncate`` may go back to it.
        Checkpoints take free state slots (evicted least recently used first when a request
        needs one); none is filed when every slot is held.

        Returns:
            Checkpoints filed (or already filed for the same prefix).

        Raises:
            StaleStepError: a request of the step changed since it was planned.
        """
        return self._runner.checkpoint_states(self)

    def advance(self, *, token_ids: Sequence[Sequence[int] | None] | None = None) -> Step[ArrayT]:
        """Plan the next decode step of this step's requests: each grows by one token, as
        ``manager.begin_step(handles, 1, token_ids=token_ids)`` grows them, in the same order.

        What the two steps share is carried over where every request's new token lands in
        the block of its last token (most decode steps): the page table keeps its arrays of
        pages, only the lengths are new, and the storage's step lanes are advanced rather
        than prepared again (:func:`~kvcache_core.contract.lanes.advance_lane`). Otherwise
        the step is planned as ``begin_step`` plans it. Either way, this step is then stale,
        as after any ``begin_step`` of its requests.

        Args:
            token_ids: for prefix caching, each request's new token id (a sequence of one)
                or ``None``, as ``begin_step`` takes them.

        Raises:
            StaleStepError: a request of this step changed since it was planned (nothing is
                planned).
            InvalidArgumentError: bad ``token_ids``.
            SequenceTooLongError, OutOfBlocksError: as ``begin_step`` (nothing changed).
        """
        return self._runner.advance(self, token_ids)

    def __repr__(self) -> str:
        return f"Step(requests={list(self.request_ids)}, new_tokens={list(self.new_tokens)})"
