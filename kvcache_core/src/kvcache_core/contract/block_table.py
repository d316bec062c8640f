"""The logical-to-physical block map of one sequence, with the seed crate's semantics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.scalars import as_integer, check_count, shown
from kvcache_core.errors import InsufficientBlocksError, InvalidArgumentError, InvalidTypeError

__all__ = ["BlockRun", "BlockTable"]


class BlockRun(NamedTuple):
    """Physically consecutive blocks ``start, start + 1, ..., start + length - 1`` of a table.

    ``first_logical`` is the logical index of ``start`` in the table, so the run holds the
    tokens ``first_logical * block_size`` onwards.
    """

    start: int
    length: int
    first_logical: int


def _check_block_ids(blocks: Iterable[object]) -> list[int]:
    checked: list[int] = []
    for block in blocks:
        block_id = as_integer(block)  # Python and NumPy integers; not bools
        if block_id is None or block_id < 0:
            raise InvalidArgumentError(f"block ids must be ints >= 0, got {shown(block)}")
        checked.append(block_id)
    return checked


#: Ranges of at most this many positions get their slots computed one by one (quicker than arrays).
_FEW_SLOTS = 8


def _is_count(value: object) -> bool:
    count = as_integer(value)
    return count is not None and count >= 0


class BlockTable:
    """Which physical blocks hold a sequence's tokens, in order.

    Mirrors ``BlockTable`` of the Rust crate ``ferrum-interfaces``: ``physical_blocks``,
    ``logical_to_physical`` (the index into ``physical_blocks`` of each logical block),
    ``sequence_length`` (tokens stored) and ``block_size`` (tokens per block). Token ``t``
    lives in block ``physical_blocks[t // block_size]`` at offset ``t % block_size``.

    A sliding window releases a sequence's leading blocks as it grows: then
    :attr:`first_logical` blocks are released, ``physical_blocks`` lists only the blocks
    still held, ``logical_to_physical`` maps each released logical block to ``-1``, and
    token ``t >= first_logical * block_size`` lives in block
    ``physical_blocks[t // block_size - first_logical]``. ``sequence_length`` still counts
    every token of the sequence (positions), held or released. With nothing released
    (``first_logical == 0``) every formula is the seed crate's.

    The fields are read-only properties; the table changes only through
    :meth:`add_blocks`, :meth:`extend_sequence`, :meth:`release_leading` and
    :meth:`replace_block`, which keep it consistent.

    Raises:
        InvalidArgumentError: ``block_size < 1``, bad block ids, a block listed twice, a
            ``sequence_length`` the blocks cannot hold, or ``first_logical < 0``.
    """

    __slots__ = ("_block_size", "_first_logical", "_logical_to_physical", "_physical_blocks", "_sequence_length")
    __hash__ = None  # type: ignore[assignment]  # mutable: equal tables need not hash equal

    def __init__(
        self, block_size: int, physical_blocks: Iterable[int] = (), sequence_length: int = 0, first_logical: int = 0
    ) -> None:
        block_size = check_count(block_size, "block_size", 1)
        if not _is_count(first_logical):
            raise InvalidArgumentError(f"first_logical must be an int >= 0, got {shown(first_logical)}")
        self._block_size = block_size
        self._first_logical = int(first_logical)
        self._physical_blocks: list[int] = []
        self._logical_to_physical: list[int] = [-1] * self._first_logical
        self._sequence_length = 0
        self.add_blocks(physical_blocks)
        self.extend_sequence(sequence_length)

    # -- the seed crate's fields --------------------------------------------------------

    @property
    def physical_blocks(self) -> tuple[int, ...]:
        """Physical block ids, in logical order."""
        return tuple(self._physical_blocks)

    @property
    def logical_to_physical(self) -> tuple[int, ...]:
        """For each logical block, its index into :attr:`physical_blocks` (``-1`` for a
        released block)."""
        return tuple(self._logical_to_physical)

    @property
    def first_logical(self) -> int:
        """Leading logical blocks released (by a sliding window); 0 when none were."""
        return self._first_logical

    @property
    def sequence_length(self) -> int:
        """Tokens stored."""
        return self._sequence_length

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    # -- the seed crate's methods -------------------------------------------------------

    def num_blocks(self) -> int:
        """Blocks held in the table (released ones not counted)."""
        return len(self._physical_blocks)

    @staticmethod
    def blocks_needed_for_length(length: int, block_size: int) -> int:
        """Blocks that hold ``length`` tokens: ``ceil(length / block_size)``.

        Raises:
            InvalidArgumentError: ``length < 0`` or ``block_size < 1``.
        """
        length, block_size = check_count(length, "length"), check_count(block_size, "block_size", 1)
        return (length + block_size - 1) // block_size

    def has_free_space(self) -> bool:
        """Whether a whole block beyond those the tokens need is already in the table."""
        used_blocks = (self._sequence_length + self._block_size - 1) // self._block_size
        return used_blocks < self._first_logical + len(self._physical_blocks)

    def free_tokens(self) -> int:
        """Tokens that fit in the table's blocks without adding one."""
        if not self._physical_blocks:
            return 0
        return self.capacity() - self._sequence_length

    def add_blocks(self, blocks: Iterable[int]) -> None:
        """Append physical blocks at the end of the table.

        Raises:
            InvalidArgumentError: a block id is not an int >= 0, or is already in the table
                (or listed twice); the table is unchanged.
        """
        new_blocks = _check_block_ids(blocks)
        owned = set(self._physical_blocks)
        for block in new_blocks:
            if block in owned:
                raise InvalidArgumentError(f"block {block} is already in this table")
            owned.add(block)
        start = len(self._physical_blocks)
        self._physical_blocks.extend(new_blocks)
        self._logical_to_physical.extend(range(start, start + len(new_blocks)))

    def extend_sequence(self, additional_tokens: int) -> None:
        """Grow the sequence by ``additional_tokens`` tokens already covered by blocks.

        Raises:
            InvalidArgumentError: ``additional_tokens`` is not an int >= 0.
            InsufficientBlocksError: the blocks cannot hold the new length; unchanged.
        """
        additional_tokens = check_count(additional_tokens, "additional_tokens")
        new_length = self._sequence_length + additional_tokens
        required = (new_length + self._block_size - 1) // self._block_size
        if required > self._first_logical + len(self._physical_blocks):
            released = f" after {self._first_logical} released" if self._first_logical else ""
            raise InsufficientBlocksError(
                f"insufficient blocks: length {new_length} needs {required} blocks of "
                f"{self._block_size} tokens, the table has {len(self._physical_blocks)}{released}"
            )
        self._sequence_length = new_length

    def truncate(self, length: int) -> list[int]:
        """Shorten the sequence to ``length`` tokens and drop the blocks wholly past it
        (reserved ones included).

        Returns:
            The dropped physical blocks, in logical order.

        Raises:
            InvalidArgumentError: not ``first_logical * block_size <= length <=
                sequence_length``; the table is unchanged.
        """
        low = self._first_logical * self._block_size
        if not _is_count(length) or not low <= int(length) <= self._sequence_length:
            raise InvalidArgumentError(
                f"length must be an int in [{low}, {self._sequence_length}] (the held positions), got {length!r}"
            )
        keep = max(0, -(-int(length) // self._block_size) - self._first_logical)
        dropped = self._physical_blocks[keep:]
        del self._physical_blocks[keep:]
        del self._logical_to_physical[self._first_logical + keep :]
        self._sequence_length = int(length)
        return dropped

    def release_leading(self, count: int) -> list[int]:
        """Release the first ``count`` held blocks (a sliding window has passed them).

        Returns:
            The released physical blocks, in logical order.

        Raises:
            InvalidArgumentError: ``count`` is not an int >= 0, exceeds the held blocks, or
                would release a block holding a position at or after ``sequence_length``;
                the table is unchanged.
        """
        if not _is_count(count) or count > len(self._physical_blocks):
            raise InvalidArgumentError(
                f"count must be an int in [0, {len(self._physical_blocks)}] (the held blocks), got {count!r}"
            )
        count = int(count)
        if (self._first_logical + count) * self._block_size > self._sequence_length and count:
            raise InvalidArgumentError(
                f"releasing {count} blocks would drop positions at or after the sequence length {self._sequence_length}"
            )
        released = self._physical_blocks[:count]
        del self._physical_blocks[:count]
        self._first_logical += count
        self._logical_to_physical = [-1] * self._first_logical + list(range(len(self._physical_blocks)))
        return released

    def replace_block(self, logical: int, block: int) -> int:
        """Point held logical block ``logical`` at physical ``block`` (copy-on-write).

        Returns:
            The physical block it pointed at before.

        Raises:
            InvalidArgumentError: ``logical`` is not a held logical block, or ``block`` is not
                an int >= 0 or is already in the table; the table is unchanged.
        """
        first, held = self._first_logical, len(self._physical_blocks)
        if not _is_count(logical) or not first <= int(logical) < first + held:
            raise InvalidArgumentError(
                f"logical block {logical!r} is not held: valid held blocks are {first} to {first + held - 1}"
            )
        (new_block,) = _check_block_ids([block])
        if new_block in self._physical_blocks:
            raise InvalidArgumentError(f"block {new_block} is already in this table")
        index = int(logical) - first
        old = self._physical_blocks[index]
        self._physical_blocks[index] = new_block
        return old

    def physical_block(self, logical: int) -> int:
        """The physical block of held logical block ``logical``.

        Raises:
            InvalidArgumentError: ``logical`` is released or past the table.
        """
        first, held = self._first_logical, len(self._physical_blocks)
        if not _is_count(logical) or not first <= int(logical) < first + held:
            raise InvalidArgumentError(
                f"logical block {logical!r} is not held: valid held blocks are {first} to {first + held - 1}"
            )
        return self._physical_blocks[int(logical) - first]

    def held_tokens(self) -> int:
        """Tokens of the sequence in held blocks: ``sequence_length - first_logical * block_size``
        (at least 0)."""
        return max(0, self._sequence_length - self._first_logical * self._block_size)

    # -- additions ---------------------------------------------------------------------

    def capacity(self) -> int:
        """Positions the table's blocks reach: ``(first_logical + num_blocks()) * block_size``
        (``num_blocks() * block_size`` when nothing is released)."""
        return (self._first_logical + len(self._physical_blocks)) * self._block_size

    def runs(self) -> list[BlockRun]:
        """The table split into runs of physically consecutive blocks, in logical order.

        A request whose blocks are one run is read by attention as one zero-copy view.
        """
        runs: list[BlockRun] = []
        blocks = self._physical_blocks
        if not blocks:
            return runs
        offset = self._first_logical  # run.first_logical is the logical index in the sequence
        start, first_index = blocks[0], 0
        for index in range(1, len(blocks)):
            if blocks[index] != blocks[index - 1] + 1:
                runs.append(BlockRun(start, index - first_index, offset + first_index))
                start, first_index = blocks[index], index
        runs.append(BlockRun(start, len(blocks) - first_index, offset + first_index))
        return runs

    def slots(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Slots (``block * block_size + offset``) of token positions ``start .. stop - 1``.

        Raises:
            InvalidArgumentError: not ``first_logical * block_size <= start <= stop <= capacity()``.
        """
        low = self._first_logical * self._block_size
        if not (_is_count(start) and _is_count(stop) and low <= start <= stop <= self.capacity()):
            raise InvalidArgumentError(
                f"token range [{start}, {stop}) is outside [{low}, {self.capacity()}] of this table"
            )
        size, held = self._block_size, self._first_logical
        if stop - start <= _FEW_SLOTS:  # a decode step: a few scalars, no array arithmetic
            blocks_of = self._physical_blocks
            return np.array(
                [blocks_of[position // size - held] * size + position % size for position in range(start, stop)],
                dtype=np.int64,
            )
        positions = np.arange(start, stop, dtype=np.int64)
        first, last = start // self._block_size, (stop - 1) // self._block_size + 1
        blocks = np.asarray(self._physical_blocks[first - held : last - held], dtype=np.int64)
        local = positions // self._block_size - first
        return blocks[local] * self._block_size + positions % self._block_size

    def copy(self) -> BlockTable:
        """An independent copy."""
        clone = BlockTable.__new__(BlockTable)
        clone._block_size = self._block_size
        clone._first_logical = self._first_logical
        clone._physical_blocks = list(self._physical_blocks)
        clone._logical_to_physical = list(self._logical_to_physical)
        clone._sequence_length = self._sequence_length
        return clone

    __copy__ = copy

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockTable:
        return self.copy()

    def to_dict(self) -> dict[str, Any]:
        """A plain-dict form (ints and lists only) that :meth:`from_dict` restores exactly
        (released leading blocks are the ``-1`` entries of ``logical_to_physical``)."""
        return {
            "physical_blocks": list(self._physical_blocks),
            "logical_to_physical": list(self._logical_to_physical),
            "sequence_length": self._sequence_length,
            "block_size": self._block_size,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BlockTable:
        """Rebuild a table from :meth:`to_dict` output.

        Raises:
            InvalidTypeError: ``data`` is not a mapping.
            InvalidArgumentError: missing keys or values that do not form a valid table.
        """
        if not isinstance(data, Mapping):
            raise InvalidTypeError(f"BlockTable.from_dict takes a mapping from to_dict(), got {type(data).__name__}")
        missing = {"physical_blocks", "logical_to_physical", "sequence_length", "block_size"} - set(data)
        if missing:
            raise InvalidArgumentError(f"BlockTable dict is missing {sorted(missing)}")
        length = data["sequence_length"]
        if not _is_count(length):
            raise InvalidArgumentError(f"BlockTable dict: sequence_length must be an int >= 0, got {length!r}")
        raw_mapping: object = data["logical_to_physical"]
        if isinstance(raw_mapping, (str, bytes)) or not isinstance(raw_mapping, Iterable):
            raise InvalidArgumentError(
                f"BlockTable dict: logical_to_physical must be a list of ints, got {raw_mapping!r}"
            )
        mapping: list[object] = list(cast("Iterable[object]", raw_mapping))
        released = 0
        while released < len(mapping) and mapping[released] == -1:
            released += 1
        table = cls(data["block_size"], data["physical_blocks"], first_logical=released)
        try:
            table.extend_sequence(int(length))
        except InsufficientBlocksError as exc:
            raise InvalidArgumentError(f"BlockTable dict: sequence_length {length} does not fit: {exc}") from exc
        if mapping != table._logical_to_physical:
            raise InvalidArgumentError(f"logical_to_physical {mapping!r} does not index physical_blocks in order")
        return table

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockTable):
            return NotImplemented
        return (
            self._block_size == other._block_size
            and self._first_logical == other._first_logical
            and self._sequence_length == other._sequence_length
            and self._physical_blocks == other._physical_blocks
            and self._logical_to_physical == other._logical_to_physical
        )

    def __repr__(self) -> str:
        runs = ", ".join(f"{r.start}..{r.start + r.length - 1}" for r in self.runs())
        released = f", first_logical={self._first_logical}" if self._first_logical else ""
        return (
            f"BlockTable(block_size={self._block_size}, sequence_length={self._sequence_length}{released}, "
            f"blocks=[{runs}])"
        )
