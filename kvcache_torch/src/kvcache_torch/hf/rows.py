"""The kvcache requests behind a batch's rows: one request per row, allocated, grown,
forked, truncated and released together."""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core import (
    AllocationRequest,
    InvalidArgumentError,
    KvCacheError,
    PagedKvCacheHandle,
    PagedKvCacheManager,
    Step,
    UnknownRequestError,
    UnsupportedConfigError,
)
from kvcache_core.errors import StaleStepError
from kvcache_torch.hf.forward_pass import ForwardStep

__all__ = ["BatchRows", "prompt_rows", "release_requests", "undo_step"]

Handle = PagedKvCacheHandle[torch.Tensor]


def release_requests(manager: PagedKvCacheManager[torch.Tensor], request_ids: list[str]) -> None:
    """Deallocate every still-live request of ``request_ids`` and empty the list."""
    for request_id in request_ids:
        with contextlib.suppress(UnknownRequestError):  # already released through the manager
            manager.deallocate(request_id)
    request_ids.clear()


class BatchRows:
    """Row ``b`` of the batch is request ``request_ids[b]`` of ``manager``.

    Attributes:
        handles, request_ids: per row, in row order (``request_ids`` is changed in place
            only: a finalizer may hold it).
        tokens: tokens in use per row; at most the request's ``num_tokens()`` (a crop keeps
            the blocks).
        ids_known: per row, whether the manager knows the id of every token it holds (its
            blocks are then cacheable, given the ids of each step).
        stored: ``[rows, positions]`` which positions each row stored (padding is not).
        positions: positions held, padding included.
    """

    def __init__(self, manager: PagedKvCacheManager[torch.Tensor], max_sequence_length: int | None) -> None:
        self.manager = manager
        self.max_sequence_length = max_sequence_length
        self.handles: list[Handle] = []
        self.request_ids: list[str] = []
        self.tokens: list[int] = []
        self.ids_known: list[bool] = []
        self.stored = np.zeros((0, 0), dtype=np.bool_)
        self.positions = 0
        self._id_prefix = f"hf-{uuid.uuid4().hex[:12]}"
        self._id_counter = itertools.count()
        # The last step and, by (group, first position) asked, whether its padded gather serves them.
        self._padded_known: tuple[Step[torch.Tensor], dict[tuple[int, int], bool]] | None = None
        self._last: Step[torch.Tensor] | None = None  # the last step planned, advanced by a decode step

    def __len__(self) -> int:
        return len(self.handles)

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._id_counter)}"

    def _allocate(self, prompt: tuple[int, ...] | None = None) -> tuple[Handle, str]:
        request_id = self._new_request_id()
        request = AllocationRequest(request_id, prompt_token_ids=prompt, max_sequence_length=self.max_sequence_length)
        return self.manager.allocate(request), request_id

    def begin(
        self,
        counts: list[int],
        valid: torch.Tensor | None,
        query_length: int,
        token_ids: list[tuple[int, ...] | None] | None = None,
    ) -> tuple[Step[torch.Tensor], bool]:
        """Grow every row by its ``counts`` new tokens in one manager step, allocating the
        rows first when there are none; record the ``valid`` positions (``None``: all) of the
        ``query_length`` new ones as stored. ``token_ids``: per row, its new tokens' ids (or
        ``None``), for prefix caching. Returns the step and whether rows were allocated.

        Atomic: when the pool cannot hold the step, nothing is allocated or grown.
        """
        allocated = not self.handles
        last = self._last
        if last is not None and query_length == 1 and valid is None and last.request_ids == tuple(self.request_ids):
            try:
                planned = self._last = last.advance(token_ids=token_ids)  # one token per row
            except StaleStepError:  # a row changed since (crop, beams): planned anew below
                pass
            else:
                self.tokens[:] = [tokens + 1 for tokens in self.tokens]
                self._record_stored(None, 1)
                self._carry_padded(last, planned)
                return planned, False
        try:
            if allocated:
                for _ in counts:
                    handle, request_id = self._allocate()
                    self.handles.append(handle)
                    self.request_ids.append(request_id)
                    self.tokens.append(0)
                    self.ids_known.append(False)
            planned = self._last = self.manager.begin_step(self.handles, counts, token_ids=token_ids)
        except BaseException:
            if allocated:  # the first forward failed: no row stays
                release_requests(self.manager, self.request_ids)
                self.handles.clear()
                self.tokens.clear()
                self.ids_known.clear()
            raise
        self.tokens[:] = [tokens + count for tokens, count in zip(self.tokens, counts, strict=True)]
        self._record_stored(valid, query_length)
        return planned, allocated

    def _record_stored(self, valid: torch.Tensor | None, query_length: int) -> None:
        start, rows = self.positions, len(self.handles)
        if self.stored.shape[0] != rows or self.stored.shape[1] < start + query_length:
            grown = np.zeros((rows, max(2 * self.stored.shape[1], start + query_length, 64)), dtype=np.bool_)
            grown[: self.stored.shape[0], : self.stored.shape[1]] = self.stored
            self.stored = grown
        self.stored[:, start : start + query_length] = True if valid is None else valid.cpu().numpy()
        self.positions = start + query_length

    def truncate(self, tokens: list[int], positions: int) -> None:
        """Truncate row ``b`` to ``tokens[b]`` tokens (``manager.truncate``: the blocks past its
        new end go back to the pool), the batch to ``positions``."""
        for handle, count in zip(self.handles, tokens, strict=True):
            self.manager.truncate(handle, count)
        self.tokens[:] = tokens
        self.positions = positions

    def stored_before(self, positions: int) -> list[int]:
        """Per row, the tokens it stored in its first ``positions`` positions."""
        return [int(count) for count in self.stored[:, :positions].sum(axis=1)]

    def release(self) -> None:
        """Deallocate every row's request: the rows are then empty."""
        release_requests(self.manager, self.request_ids)
        self.handles.clear()
        self.tokens.clear()
        self.ids_known.clear()
        self.stored = np.zeros((0, 0), dtype=np.bool_)
        self.positions = 0
        self._last = None

    def gather_padded(
        self, layer: int, last: int | None = None, step: Step[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's K/V as ``[batch, kv_heads, positions, head_dim]`` (contiguous path), or
        only its ``last`` positions; a position a row did not store (its padding) holds zeros,
        which the model's mask hides (a transient tensor: the pool holds no padding). With
        the forward's ``step`` and a left-padded batch, one padded gather of the step
        (``Step.gather_padded``: one read per pool where the storage has it); else row by row.

        Raises:
            UnsupportedConfigError: the pool no longer holds the positions asked for (its
                sliding window released them).
        """
        start = 0 if last is None else self.positions - last
        width = self.positions - start
        if step is not None and self._left_padded(step, layer, start):
            return step.gather_padded(layer, width=width, layout="HND")
        held = self.stored[: len(self.handles), start : self.positions]
        counts = held.sum(axis=1)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for handle, tokens, count in zip(self.handles, self.tokens, counts.tolist(), strict=True):
            k, v = self.manager.gather(handle, layer)
            held_from = handle.num_tokens() - int(k.shape[0])  # a sliding window released the positions before
            first = tokens - count
            if first < held_from:
                raise UnsupportedConfigError(
                    f"layer {layer} needs tokens {first} to {tokens} of request {handle.request_id}, whose "
                    f"sliding window holds them from {held_from} on"
                )
            keys.append(k[first - held_from : tokens - held_from].transpose(0, 1))
            values.append(v[first - held_from : tokens - held_from].transpose(0, 1))
        if bool((counts == width).all()):  # no padding among these positions
            return torch.stack(keys), torch.stack(values)
        return _with_gaps(keys, held, width), _with_gaps(values, held, width)

    def one_row_width(self, layer: int, last: int | None, step: Step[torch.Tensor]) -> int | None:
        """The width of :meth:`gather_padded`'s read (``last`` as it takes it) where it is one
        row's last positions, all stored, through the forward's ``step``: the read
        ``Step.write_and_view`` may show in place with the layer's write; ``None`` otherwise."""
        start = 0 if last is None else self.positions - last
        width = self.positions - start
        return width if self._unpadded_row(width) and self._left_padded(step, layer, start) else None

    def _unpadded_row(self, width: int) -> bool:
        """Whether the batch is one left-padded row whose last ``width`` positions hold no
        padding (it has as many tokens): its K/V there are one request's last tokens, which
        ``Step.write_and_view`` shows in place where its blocks are one run (``DynamicCache``
        copies its whole K/V at every step)."""
        return len(self.handles) == 1 and self.tokens[0] >= width

    def _left_padded(self, step: Step[torch.Tensor], layer: int, start: int) -> bool:
        """Whether ``step``'s padded gather gives the positions from ``start`` on of ``layer``:
        the step's requests are the rows, each row's stored positions there are its last
        tokens (left padding), its request holds no more tokens than the row uses, and the
        page table of the layer's group still lists them. Found once per step, group and start."""
        config = self.manager.config
        group = config.layer_place(layer)[0]
        known = self._padded_known
        if known is None or known[0] is not step:
            known = self._padded_known = (step, {})
        usable = known[1].get((group, start))
        if usable is not None:
            return usable
        width = self.positions - start
        usable = (
            step.request_ids == tuple(self.request_ids)
            and width <= config.num_blocks * config.block_size
            and all(handle.num_tokens() == count for handle, count in zip(self.handles, self.tokens, strict=True))
            and self._stored_last(start, step.page_tables[group].seq_lens)
        )
        known[1][group, start] = usable
        return usable

    def _carry_padded(self, last: Step[torch.Tensor], planned: Step[torch.Tensor]) -> None:
        """After ``planned``, the decode step after ``last`` (one token more per row, each
        stored): what :meth:`_left_padded` found true of ``last`` from a row's first position
        stays true (each row's stored positions there are still its last tokens, one more,
        which its request and page table hold), as long as the positions fit the pool, so it
        is not found again from the batch's arrays (once per decode step)."""
        known = self._padded_known
        if known is None or known[0] is not last:
            return
        config = self.manager.config
        fits = self.positions <= config.num_blocks * config.block_size
        self._padded_known = (
            planned,
            {key: True for key, usable in known[1].items() if usable and fits and key[1] == 0},
        )

    def _stored_last(self, start: int, listed: npt.NDArray[np.int32]) -> bool:
        """Whether each row's stored positions from ``start`` on are its last tokens there (as
        many as it has, up to all of them) and its page table (``listed``: its tokens) lists them."""
        width = self.positions - start
        if len(self.handles) == 1:  # a few scalar reads, not a batch's arrays (once per decode step)
            row = self.stored[0, start : self.positions]
            count = int(row.sum())
            return count == min(self.tokens[0], width) and bool(row[width - count :].all()) and int(listed[0]) >= count
        held = self.stored[: len(self.handles), start : self.positions]
        counts = held.sum(axis=1)
        tokens = np.asarray(self.tokens, dtype=np.int64)
        return bool(
            np.array_equal(counts, np.minimum(tokens, width))
            and np.array_equal(held, np.arange(width)[None, :] >= (width - counts)[:, None])
            and bool((listed >= counts).all())
        )

    # -- prefix caching ------------------------------------------------------------------

    def map_prefix(self, prompts: list[tuple[int, ...] | None], pads: list[int], columns: int) -> int:
        """Allocate one request per row of a first forward of ``columns`` positions, each
        holding its prompt's ids (``None``: not cacheable) and mapping their cached blocks,
        then truncate the rows to the cached positions all of them share (row ``b`` stores
        none of its first ``pads[b]`` positions). Returns those positions.

        Raises:
            OutOfBlocksError: the pool cannot hold the rows (nothing is kept).
        """
        handles: list[Handle] = []
        request_ids: list[str] = []
        try:
            for prompt in prompts:
                handle, request_id = self._allocate(prompt or None)
                handles.append(handle)
                request_ids.append(request_id)
            shared = min(pad + handle.num_cached_tokens() for pad, handle in zip(pads, handles, strict=True))
            kept = [max(0, shared - pad) for pad in pads]
            for handle, tokens in zip(handles, kept, strict=True):
                if handle.num_tokens() > tokens:
                    self.manager.truncate(handle, tokens)
        except BaseException:
            release_requests(self.manager, request_ids)
            raise
        self.handles[:] = handles
        self.request_ids[:] = request_ids
        self.tokens[:] = kept
        self.ids_known[:] = [bool(prompt) for prompt in prompts]
        self.positions = shared
        real = np.ones((len(prompts), columns), dtype=np.bool_)
        for row, pad in enumerate(pads):
            real[row, :pad] = False
        self.stored = real[:, :shared].copy()
        return shared

    def adopt(self, handles: Sequence[Handle]) -> int:
        """Make ``handles`` (live requests of the manager, one per row) the rows, every token
        of them stored, and return the positions they hold.

        Raises:
            InvalidArgumentError: rows are held already, no handle, a handle that is not a
                live request of this manager or appears twice, requests of different lengths
                or an empty one.
        """
        if self.handles:
            raise InvalidArgumentError(f"the cache holds {len(self.handles)} rows already: release() it first")
        if isinstance(handles, (str, bytes)) or not isinstance(handles, Sequence) or not handles:
            raise InvalidArgumentError(f"handles must be a non-empty sequence of request handles, got {handles!r}")
        for handle in handles:
            request_id = getattr(handle, "request_id", None)
            if not isinstance(request_id, str) or self.manager.get_handle(request_id) != handle:
                raise InvalidArgumentError(f"{handle!r} is not a live request of this cache's manager")
        request_ids = [handle.request_id for handle in handles]
        if len(set(request_ids)) != len(request_ids):
            raise InvalidArgumentError(f"a request appears twice among the handles {request_ids}")
        lengths = [handle.num_tokens() for handle in handles]
        if len(set(lengths)) != 1 or lengths[0] == 0:
            raise InvalidArgumentError(
                f"the requests hold {lengths} tokens: rows start at one length, at least 1 (adopt requests of "
                "different lengths in caches of their own)"
            )
        positions = lengths[0]
        self.handles[:] = handles
        self.request_ids[:] = request_ids
        self.tokens[:] = lengths
        self.ids_known[:] = [len(handle.token_ids()) >= positions for handle in handles]
        self.positions = positions
        self.stored = np.ones((len(handles), positions), dtype=np.bool_)
        return positions

    # -- batch surgery -------------------------------------------------------------------

    def check_indices(self, indices: object, name: str) -> list[int]:
        """``indices`` as row numbers.

        Raises:
            InvalidArgumentError: not a 1-D integer tensor, or naming a row outside the rows.
        """
        rows = len(self.handles)
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.is_floating_point():
            raise InvalidArgumentError(f"{name} must be a 1-D integer tensor, got {indices!r}")
        values = [int(i) for i in indices.cpu().numpy()]
        bad = [i for i in values if not 0 <= i < rows]
        if bad:
            raise InvalidArgumentError(f"{name} names row {bad[0]}: valid rows are 0 to {rows - 1}")
        return values

    def remap(self, sources: list[int]) -> None:
        """New row ``j`` takes the content of old row ``sources[j]``.

        Each source's own request goes to one of the rows that want it (itself if it does),
        the other rows get forks of it (shared blocks, copied on write), and requests
        nobody wants are released.
        """
        rows = len(self.handles)
        chosen: list[int | None] = [None] * len(sources)
        taken: set[int] = set()
        for new_row, source in enumerate(sources):
            if source == new_row:
                chosen[new_row] = source
                taken.add(source)
        for new_row, source in enumerate(sources):
            if chosen[new_row] is None and source not in taken:
                chosen[new_row] = source
                taken.add(source)
        forks: dict[int, tuple[Handle, str]] = {}
        try:
            for new_row, chosen_source in enumerate(chosen):
                if chosen_source is None:
                    request_id = self._new_request_id()
                    forks[new_row] = (self.manager.fork(self.handles[sources[new_row]], request_id), request_id)
        except BaseException:
            release_requests(self.manager, [request_id for _, request_id in forks.values()])
            raise
        handles: list[Handle] = []
        request_ids: list[str] = []
        for new_row, chosen_source in enumerate(chosen):
            if chosen_source is None:
                handle, request_id = forks[new_row]
            else:
                handle, request_id = self.handles[chosen_source], self.request_ids[chosen_source]
            handles.append(handle)
            request_ids.append(request_id)
        unused = [self.request_ids[row] for row in range(rows) if row not in taken]
        self.handles[:] = handles
        self.request_ids[:] = request_ids
        self.tokens[:] = [self.tokens[source] for source in sources]
        self.ids_known[:] = [self.ids_known[source] for source in sources]
        release_requests(self.manager, unused)
        self.stored = self.stored[sources]


def _with_gaps(rows: list[torch.Tensor], held: npt.NDArray[np.bool_], width: int) -> torch.Tensor:
    """``[batch, heads, width, dim]``: row ``b``'s tokens ``rows[b]`` ``[heads, tokens, dim]`` at
    the positions ``held[b]`` marks, zeros elsewhere."""
    sample = rows[0]
    out = sample.new_zeros((len(rows), sample.shape[0], width, sample.shape[2]))
    for row, (tokens, where) in enumerate(zip(rows, held, strict=True)):
        count = int(tokens.shape[1])
        if count and bool(where[width - count :].all()):  # left padding: the row's tokens end the positions
            out[row, :, width - count :] = tokens
        elif count:
            out[row, :, torch.tensor(np.flatnonzero(where).tolist(), device=out.device)] = tokens
    return out


def undo_step(step: ForwardStep, rows: BatchRows) -> bool:
    """Take back what a forward ``step`` stored: each row goes back to its length before it.
    ``False`` when only a release can undo it (the step allocated the rows, or a sliding
    window already dropped the blocks the shorter rows need)."""
    if step.planned is None:
        return True  # nothing was placed or stored
    if step.allocated:
        return False
    before = [tokens - count for tokens, count in zip(rows.tokens, step.counts, strict=True)]
    try:
        rows.truncate(before, step.start)
    except KvCacheError:
        return False
    return True


def prompt_rows(input_ids: object, attention_mask: object) -> list[tuple[int, ...]]:
    """Each row's real token ids, after checking that the batch is left-padded."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise InvalidArgumentError(f"input_ids must be a 2-D integer tensor, got {input_ids!r}")
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape:
        mask = attention_mask.to(torch.bool)
    else:
        raise InvalidArgumentError(
            f"attention_mask must be a tensor of the ids' shape {tuple(input_ids.shape)}, got {attention_mask!r}"
        )
    rows: list[tuple[int, ...]] = []
    id_rows: npt.NDArray[np.int64] = input_ids.cpu().numpy().astype(np.int64)
    real_rows: npt.NDArray[np.bool_] = mask.cpu().numpy()
    for row, (ids, real) in enumerate(zip(id_rows, real_rows, strict=True)):
        count = int(real.sum())
        if not bool(real[real.shape[0] - count :].all()):
            raise InvalidArgumentError(
                f"row {row} of the attention_mask is not left-padded: {real.astype(np.int64).tolist()}"
            )
        rows.append(tuple(int(token) for token in ids[real.shape[0] - count :]))
    return rows
