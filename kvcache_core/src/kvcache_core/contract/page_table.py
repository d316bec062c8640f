"""The page table of a batch: FlashInfer's CSR form plus vLLM's padded block tables."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.block_table import BlockRun, BlockTable
from kvcache_core.contract.scalars import INT32_MAX, check_count, check_optional_count
from kvcache_core.errors import InvalidArgumentError

__all__ = ["INDEX_MAX", "IndexArray", "PageTable"]

IndexArray = npt.NDArray[np.int32]

#: The largest value a page-table entry (block id, length, offset) can hold: int32.
INDEX_MAX: Final = int(np.iinfo(np.int32).max)


def _int32(values: object, name: str, ndim: int) -> IndexArray:
    """A read-only int32 copy of ``values``, after checking that every entry fits."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"PageTable.{name} must be an integer array, got {values!r}") from exc
    if array.dtype.kind not in "iu" and array.size:
        raise InvalidArgumentError(f"PageTable.{name} must hold integers, got dtype {array.dtype}")
    if array.ndim != ndim:
        raise InvalidArgumentError(f"PageTable.{name} must be {ndim}-D, got shape {array.shape}")
    if array.size:
        low, high = int(array.min()), int(array.max())  # exact for any integer dtype
        if low < 0 or high > INDEX_MAX:
            raise InvalidArgumentError(
                f"PageTable.{name} holds {low if low < 0 else high}: entries must be in [0, {INDEX_MAX}]"
            )
    # A read-only base under a view: nobody can make the table's arrays writeable again.
    base: IndexArray = np.array(array, dtype=np.int32, order="C")
    base.flags.writeable = False
    view: IndexArray = base.view()
    return view


def _frozen(values: Sequence[object]) -> IndexArray:
    """A read-only int32 array of ints known to be in range."""
    base: IndexArray = np.array(values, dtype=np.int32)
    base.flags.writeable = False
    view: IndexArray = base.view()
    return view


@dataclass(frozen=True, eq=False)
class PageTable:
    """Where the K/V of a batch of ``B`` requests live in the pool.

    CSR form (FlashInfer): the pages of request ``b`` are
    ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, the last one holding
    ``kv_last_page_len[b]`` tokens (0 only for an empty sequence). Padded form (vLLM):
    ``block_tables[b, :ceil(seq_lens[b] / block_size)]``, padded with 0 beyond (padding is
    masked by ``seq_lens``). All arrays are int32, range-checked (``[0, INDEX_MAX]``) and
    read-only: a page table cannot be edited after it is built.

    Sliding window: a request whose window released its leading blocks is listed from its
    first *held* block, and ``seq_lens[b]`` counts the tokens from that block's first slot
    (``sequence_length - first_logical * block_size``). Positions are relative to that slot,
    which is all attention needs: query ``i`` of ``q`` sits at ``seq_lens[b] - q + i`` and,
    with :attr:`sliding_window` ``W``, sees only keys at positions ``p`` with
    ``query_position - W < p``: the last ``W`` tokens including itself. A kernel must honour
    :attr:`sliding_window` (the held blocks may still hold up to ``block_size - 1`` tokens
    older than the window, and a prefill's early queries see fewer keys than its late ones).

    Attributes:
        kv_indptr: ``[B + 1]``.
        kv_indices: ``[kv_indptr[B]]`` physical block ids.
        kv_last_page_len: ``[B]``.
        block_tables: ``[B, max_blocks]``.
        seq_lens: ``[B]`` tokens per request.
        block_size: tokens per block.
        request_ids: the requests, in batch order.
        sliding_window: ``W`` to let each query see only the last ``W`` positions (itself
            included), or ``None`` for no window.
        generations: the ownership generation of each request when the table was taken
            (set by the manager, empty otherwise): a manager refuses a table once one of
            its requests was released, swapped or had a block replaced since.
        group: the KV-cache group whose blocks it lists (0 without groups): a manager
            refuses it for a layer of another group.

    Raises:
        InvalidArgumentError: arrays that do not describe a consistent batch.
    """

    kv_indptr: IndexArray
    kv_indices: IndexArray
    kv_last_page_len: IndexArray
    block_tables: IndexArray
    seq_lens: IndexArray
    block_size: int
    request_ids: tuple[str, ...] = ()
    sliding_window: int | None = None
    generations: tuple[int, ...] = ()
    group: int = 0
    _runs: tuple[tuple[BlockRun, ...], ...] | None = field(default=None, init=False, repr=False)
    _pages: tuple[int, ...] | None = field(default=None, init=False, repr=False)  # pages per request
    _one_run: bool | None = field(default=None, init=False, repr=False)  # every request's blocks one run

    def __post_init__(self) -> None:
        for name, ndim in (
            ("kv_indptr", 1),
            ("kv_indices", 1),
            ("kv_last_page_len", 1),
            ("block_tables", 2),
            ("seq_lens", 1),
        ):
            object.__setattr__(self, name, _int32(getattr(self, name), name, ndim))
        object.__setattr__(self, "block_size", check_count(self.block_size, "PageTable.block_size", 1, INT32_MAX))
        batch = self.seq_lens.shape[0]
        indptr = self.kv_indptr
        if indptr.shape[0] != batch + 1 or indptr[0] != 0 or np.any(np.diff(indptr) < 0):
            raise InvalidArgumentError(
                f"PageTable.kv_indptr must be {batch + 1} non-decreasing offsets from 0, got {indptr.tolist()}"
            )
        if int(indptr[-1]) != self.kv_indices.shape[0]:
            raise InvalidArgumentError(
                f"PageTable.kv_indptr ends at {int(indptr[-1])}, but kv_indices has {self.kv_indices.shape[0]} entries"
            )
        pages = np.diff(indptr)
        needed = (self.seq_lens.astype(np.int64) + self.block_size - 1) // self.block_size
        if np.any(self.seq_lens < 0) or not np.array_equal(pages, needed):
            raise InvalidArgumentError(
                f"PageTable pages per request {pages.tolist()} do not match seq_lens "
                f"{self.seq_lens.tolist()} at block_size {self.block_size}"
            )
        expected_last = np.where(self.seq_lens > 0, self.seq_lens - (needed - 1) * self.block_size, 0)
        if self.kv_last_page_len.shape[0] != batch or not np.array_equal(self.kv_last_page_len, expected_last):
            raise InvalidArgumentError(
                f"PageTable.kv_last_page_len {self.kv_last_page_len.tolist()} does not match seq_lens"
            )
        if self.block_tables.shape[0] != batch or (batch and self.block_tables.shape[1] < int(pages.max(initial=0))):
            raise InvalidArgumentError(
                f"PageTable.block_tables shape {self.block_tables.shape} cannot hold {batch} requests "
                f"of up to {int(pages.max(initial=0))} blocks"
            )
        window = check_optional_count(self.sliding_window, "PageTable.sliding_window", 1, INT32_MAX)
        object.__setattr__(self, "sliding_window", window)
        object.__setattr__(self, "group", check_count(self.group, "PageTable.group", 0))
        if self.request_ids and len(self.request_ids) != batch:
            raise InvalidArgumentError(
                f"PageTable.request_ids names {len(self.request_ids)} requests for a batch of {batch}"
            )
        if self.generations and (
            len(self.generations) != batch
            or len(self.request_ids) != batch
            or not all(isinstance(g, int) and not isinstance(g, bool) for g in self.generations)
        ):
            raise InvalidArgumentError(
                f"PageTable.generations must give one int per request of request_ids ({batch}), "
                f"got {self.generations!r}"
            )

    @classmethod
    def from_block_tables(
        cls,
        tables: Sequence[BlockTable],
        request_ids: Sequence[str] = (),
        block_size: int | None = None,
        sliding_window: int | None = None,
        generations: Sequence[int] = (),
        group: int = 0,
    ) -> PageTable:
        """Build the page table of requests with these block tables (only the held blocks
        their tokens occupy are listed, from the first held one). ``block_size`` is needed
        for an empty batch.

        Raises:
            InvalidArgumentError: tables with different block sizes (or other than
                ``block_size``), or an empty batch without ``block_size``.
        """
        sizes = {table.block_size for table in tables}
        if block_size is not None:
            sizes.add(block_size)
        if len(sizes) > 1:
            raise InvalidArgumentError(f"tables mix block sizes {sorted(sizes)}")
        if not sizes:
            raise InvalidArgumentError("an empty batch needs its block_size")
        block_size = sizes.pop()
        batch = len(tables)
        held = [table.held_tokens() for table in tables]
        counts = [-(-tokens // block_size) for tokens in held]
        # The used blocks of every table read in one C loop, then one masked fill of the
        # padded form: no Python loop over the blocks themselves.
        indptr = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        total = int(indptr[-1])
        indices = np.fromiter(
            itertools.chain.from_iterable(
                table.physical_blocks[:count] for table, count in zip(tables, counts, strict=True)
            ),
            dtype=np.int64,
            count=total,
        )
        if total and (int(indices.min()) < 0 or int(indices.max()) > INDEX_MAX):
            raise InvalidArgumentError(f"PageTable.kv_indices must be in [0, {INDEX_MAX}], got {indices.tolist()}")
        seq_lens = np.asarray(held, dtype=np.int64).reshape(batch)
        if batch and int(seq_lens.max()) > INDEX_MAX:
            raise InvalidArgumentError(f"PageTable.seq_lens must be in [0, {INDEX_MAX}], got {seq_lens.tolist()}")
        used = np.asarray(counts, dtype=np.int64).reshape(batch)
        last = np.where(seq_lens > 0, seq_lens - (used - 1) * block_size, 0)
        width = max(counts, default=0)
        padded = np.zeros((batch, width), dtype=np.int32)
        padded[np.arange(width) < used[:, None]] = indices  # row-major: the CSR order
        # Consistent by construction (block tables hold distinct non-negative ids, their
        # lengths fit their blocks): the arrays are frozen as they are, not checked again.
        return cls._consistent(
            indptr,
            indices,
            last,
            padded,
            seq_lens,
            check_count(block_size, "PageTable.block_size", 1, INT32_MAX),
            tuple(request_ids),
            check_optional_count(sliding_window, "PageTable.sliding_window", 1, INT32_MAX),
            tuple(generations),
            check_count(group, "PageTable.group", 0),
        )

    @classmethod
    def _consistent(
        cls,
        indptr: npt.NDArray[np.integer],
        indices: npt.NDArray[np.integer],
        last: npt.NDArray[np.integer],
        padded: npt.NDArray[np.integer],
        seq_lens: npt.NDArray[np.integer],
        block_size: int,
        request_ids: tuple[str, ...],
        sliding_window: int | None,
        generations: tuple[int, ...],
        group: int,
    ) -> PageTable:
        """A table of arrays known to describe a consistent batch, in range: frozen as
        read-only int32, without the checks of ``__post_init__`` (the caller's duty)."""
        batch = int(seq_lens.shape[0])
        if request_ids and len(request_ids) != batch:
            raise InvalidArgumentError(
                f"PageTable.request_ids names {len(request_ids)} requests for a batch of {batch}"
            )
        if generations and (
            len(generations) != batch
            or len(request_ids) != batch
            or not all(isinstance(g, int) and not isinstance(g, bool) for g in generations)
        ):
            raise InvalidArgumentError(
                f"PageTable.generations must give one int per request of request_ids ({batch}), got {generations!r}"
            )
        table = object.__new__(cls)
        for name, array in (
            ("kv_indptr", indptr),
            ("kv_indices", indices),
            ("kv_last_page_len", last),
            ("block_tables", padded),
            ("seq_lens", seq_lens),
        ):
            base = array.base
            if array.dtype == np.int32 and isinstance(base, np.ndarray) and not base.flags.writeable:
                object.__setattr__(table, name, array)  # another table's frozen array: shared
                continue
            base = np.array(array, dtype=np.int32, order="C")
            base.flags.writeable = False
            object.__setattr__(table, name, base.view())
        for name, value in (
            ("block_size", block_size),
            ("request_ids", request_ids),
            ("sliding_window", sliding_window),
            ("generations", generations),
            ("group", group),
            ("_runs", None),
            ("_pages", None),
        ):
            object.__setattr__(table, name, value)
        return table

    def with_seq_lens(
        self,
        seq_lens: Sequence[int],
        generations: Sequence[int] | None = None,
        *,
        new_pages: Sequence[Sequence[int]] | None = None,
    ) -> PageTable:
        """The same pages with other lengths: each request's ``seq_lens[b]`` tokens still
        need every one of its pages (a decode step that filled no new block); ``generations``
        replace the recorded ones when given. The arrays of pages are shared, not copied.

        ``new_pages[b]``: pages appended after request ``b``'s (a step that filled a block);
        ``seq_lens[b]`` must then need exactly its pages and those.

        Raises:
            InvalidArgumentError: lengths that are not integers in ``[0, INDEX_MAX]``, another
                batch size, a length its pages do not fit exactly, or new pages that are not
                one sequence of integers in ``[0, INDEX_MAX]`` per request.
        """
        if new_pages is not None:
            return self._with_new_pages(seq_lens, generations, new_pages)
        if isinstance(seq_lens, (list, tuple)) and (generations is None or isinstance(generations, (list, tuple))):
            quick = self._quick_lengths(seq_lens, generations)  # a decode step's few Python ints
            if quick is not None:
                return quick
        lengths = _int32(seq_lens, "seq_lens", 1).astype(np.int64)  # integers in range, or refused
        pages = np.diff(self.kv_indptr)
        if lengths.shape[0] != pages.shape[0] or not np.array_equal(
            (lengths + self.block_size - 1) // self.block_size, pages
        ):
            raise InvalidArgumentError(
                f"seq_lens {lengths.tolist()} do not need exactly the pages {pages.tolist()} at block_size "
                f"{self.block_size}"
            )
        last = np.where(lengths > 0, lengths - (pages - 1) * self.block_size, 0)
        return PageTable._consistent(
            self.kv_indptr,
            self.kv_indices,
            last,
            self.block_tables,
            lengths,
            self.block_size,
            self.request_ids,
            self.sliding_window,
            self.generations if generations is None else tuple(generations),
            self.group,
        )

    def _quick_lengths(
        self,
        seq_lens: Sequence[object],
        generations: Sequence[object] | None,
        grown: tuple[IndexArray, IndexArray, IndexArray, tuple[int, ...]] | None = None,
    ) -> PageTable | None:
        """:meth:`with_seq_lens` for Python ints checked in Python (a few per decode step),
        over this table's pages or ``grown`` ones (``indptr, indices, block_tables, pages per
        request``): ``None`` when they are not all ints in range needing exactly those pages
        (the general path then names what is wrong)."""
        size = self.block_size
        pages = grown[3] if grown is not None else self._page_counts()
        if len(seq_lens) != len(pages) or (generations is not None and len(generations) != len(pages)):
            return None
        last: list[int] = []
        for length, count in zip(seq_lens, pages, strict=True):
            if type(length) is not int or not 0 <= length <= INDEX_MAX or -(-length // size) != count:
                return None
            last.append(length - (count - 1) * size if length else 0)
        if generations is not None and not all(type(generation) is int for generation in generations):
            return None
        indptr, indices, padded, _ = grown or (self.kv_indptr, self.kv_indices, self.block_tables, pages)
        table = PageTable._consistent(
            indptr,
            indices,
            _frozen(last),
            padded,
            _frozen(seq_lens),
            size,
            self.request_ids,
            self.sliding_window,
            self.generations if generations is None else cast(tuple[int, ...], tuple(generations)),
            self.group,
        )
        object.__setattr__(table, "_pages", pages)
        if grown is None:  # the same pages: the same runs
            object.__setattr__(table, "_runs", self._runs)
            object.__setattr__(table, "_one_run", self._one_run)
        return table

    def _page_counts(self) -> tuple[int, ...]:
        """Pages per request (computed once per arrays of pages; racing threads agree)."""
        pages = self._pages
        if pages is None:
            pages = tuple(np.diff(self.kv_indptr).tolist())
            object.__setattr__(self, "_pages", pages)
        return pages

    def _with_new_pages(
        self, seq_lens: Sequence[int], generations: Sequence[int] | None, new_pages: Sequence[Sequence[int]]
    ) -> PageTable:
        """:meth:`with_seq_lens` with ``new_pages`` appended per request."""
        batch = self.batch_size
        if not isinstance(new_pages, Sequence) or len(new_pages) != batch:
            raise InvalidArgumentError(
                f"new_pages must give one sequence of pages per request ({batch}), got {new_pages!r}"
            )
        added = [list(pages) if isinstance(pages, Sequence) else None for pages in new_pages]
        flat = [page for pages in added if pages is not None for page in pages]
        if any(pages is None for pages in added) or not all(
            type(page) is int and 0 <= page <= INDEX_MAX for page in flat
        ):
            raise InvalidArgumentError(
                f"new_pages must hold one sequence of integers in [0, {INDEX_MAX}] per request, got {new_pages!r}"
            )
        if not flat:
            return self.with_seq_lens(seq_lens, generations)
        counts = self._page_counts()
        now = tuple(count + len(pages) for count, pages in zip(counts, added, strict=True) if pages is not None)
        indptr = [0]
        for count in now:
            indptr.append(indptr[-1] + count)
        width = max(now, default=0)
        base = np.zeros((batch, width), dtype=np.int32)
        base[:, : self.block_tables.shape[1]] = self.block_tables
        places = [
            (row, count + offset)
            for row, (count, pages) in enumerate(zip(counts, added, strict=True))
            for offset in range(len(pages or ()))
        ]
        base[tuple(np.array(places).T)] = flat
        indices = base[np.arange(width) < np.array(now)[:, None]]  # row-major: the CSR order
        base.flags.writeable = indices.flags.writeable = False
        grown = (_frozen(indptr), indices.view(), base.view(), now)
        if isinstance(seq_lens, (list, tuple)) and (generations is None or isinstance(generations, (list, tuple))):
            quick = self._quick_lengths(seq_lens, generations, grown)
            if quick is not None:
                return quick
        # Lengths of another form, or wrong: checked and named by the general path.
        table = PageTable._consistent(
            grown[0],
            grown[1],
            self.kv_last_page_len,
            grown[2],
            self.seq_lens,
            self.block_size,
            self.request_ids,
            self.sliding_window,
            self.generations,
            self.group,
        )
        return table.with_seq_lens(seq_lens, generations)

    @property
    def batch_size(self) -> int:
        """Requests in the batch."""
        return int(self.seq_lens.shape[0])

    def blocks(self, index: int) -> IndexArray:
        """Physical blocks of request ``index`` (a view of :attr:`kv_indices`)."""
        return self.kv_indices[self.kv_indptr[index] : self.kv_indptr[index + 1]]

    def runs(self, index: int) -> tuple[BlockRun, ...]:
        """Runs of physically consecutive blocks of request ``index``, in logical order."""
        runs = self._runs
        if runs is None:  # computed once; a racing thread computes the same value
            runs = tuple(self._compute_runs(b) for b in range(self.batch_size))
            object.__setattr__(self, "_runs", runs)
        return runs[index]

    @property
    def one_run_each(self) -> bool:
        """Whether every request's blocks are one run of consecutive blocks. Found once per
        arrays of pages: a table :meth:`with_seq_lens` makes over the same pages (a decode step
        that filled no block) shares it."""
        known = self._one_run
        if known is None:  # a racing thread computes the same value
            # A break between consecutive entries of kv_indices that belong to one request
            # (a request's last block and the next one's first may be apart).
            breaks = np.diff(self.kv_indices.astype(np.int64)) != 1
            starts = self.kv_indptr[1:-1].astype(np.int64) - 1
            breaks[starts[(starts >= 0) & (starts < breaks.shape[0])]] = False
            known = not bool(breaks.any())
            object.__setattr__(self, "_one_run", known)
        return known

    def one_run_slots(self, positions: int | None = None) -> tuple[int, int] | None:
        """``(first slot, positions)`` of the last ``positions`` tokens (``None``: all) of the
        table's one request when they are consecutive slots: one request, its blocks one run,
        no window, at most its tokens. Their slots are then ``first, first + 1, ...``;
        ``None`` otherwise.

        Raises:
            InvalidArgumentError: ``positions`` neither ``None`` nor an int ``>= 0``.
        """
        positions = check_optional_count(positions, "positions", 0)
        if self.batch_size != 1 or self.sliding_window is not None or not self.one_run_each:
            return None
        tokens = int(self.seq_lens[0])
        count = tokens if positions is None else positions
        if count > tokens:  # positions before the request's first token
            return None
        return (int(self.kv_indices[0]) * self.block_size + tokens - count if count else 0), count

    def _compute_runs(self, index: int) -> tuple[BlockRun, ...]:
        blocks = self.blocks(index).astype(np.int64)
        if blocks.size == 0:
            return ()
        breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
        firsts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((firsts, [blocks.size])))
        return tuple(
            BlockRun(int(blocks[first]), int(length), int(first))
            for first, length in zip(firsts, lengths, strict=False)
        )
