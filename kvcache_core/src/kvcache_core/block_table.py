"""The logical-to-physical block map of one sequence, with the seed crate's semantics."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvcache_core.errors import InsufficientBlocksError, InvalidArgumentError

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
        # numbers.Integral covers int and NumPy integers; bool is refused explicitly.
        if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 0:
            raise InvalidArgumentError(f"block ids must be ints >= 0, got {block!r}")
        checked.append(int(block))
    return checked


def _is_count(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


class BlockTable:
    """Which physical blocks hold a sequence's tokens, in order.

    Mirrors ``BlockTable`` of the Rust crate ``ferrum-interfaces``: ``physical_blocks``,
    ``logical_to_physical`` (the index into ``physical_blocks`` of each logical block),
    ``sequence_length`` (tokens stored) and ``block_size`` (tokens per block). Token ``t``
    lives in block ``physical_blocks[t // block_size]`` at offset ``t % block_size``.

    The fields are read-only properties; the table changes only through
    :meth:`add_blocks` and :meth:`extend_sequence`, which keep it consistent.

    Raises:
        InvalidArgumentError: ``block_size < 1``, bad block ids, a block listed twice, or a
            ``sequence_length`` the blocks cannot hold.
    """

    __slots__ = ("_block_size", "_logical_to_physical", "_physical_blocks", "_sequence_length")
    __hash__ = None  # type: ignore[assignment]  # mutable: equal tables need not hash equal

    def __init__(self, block_size: int, physical_blocks: Iterable[int] = (), sequence_length: int = 0) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
        self._block_size = block_size
        self._physical_blocks: list[int] = []
        self._logical_to_physical: list[int] = []
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
        """For each logical block, its index into :attr:`physical_blocks`."""
        return tuple(self._logical_to_physical)

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
        """Blocks in the table."""
        return len(self._physical_blocks)

    @staticmethod
    def blocks_needed_for_length(length: int, block_size: int) -> int:
        """Blocks that hold ``length`` tokens: ``ceil(length / block_size)``.

        Raises:
            InvalidArgumentError: ``length < 0`` or ``block_size < 1``.
        """
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise InvalidArgumentError(f"length must be an int >= 0, got {length!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
        return (length + block_size - 1) // block_size

    def has_free_space(self) -> bool:
        """Whether a whole block beyond those the tokens need is already in the table."""
        used_blocks = (self._sequence_length + self._block_size - 1) // self._block_size
        return used_blocks < len(self._physical_blocks)

    def free_tokens(self) -> int:
        """Tokens that fit in the table's blocks without adding one."""
        if not self._physical_blocks:
            return 0
        return len(self._physical_blocks) * self._block_size - self._sequence_length

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
        start = len(self._logical_to_physical)
        self._physical_blocks.extend(new_blocks)
        self._logical_to_physical.extend(range(start, start + len(new_blocks)))

    def extend_sequence(self, additional_tokens: int) -> None:
        """Grow the sequence by ``additional_tokens`` tokens already covered by blocks.

        Raises:
            InvalidArgumentError: ``additional_tokens`` is not an int >= 0.
            InsufficientBlocksError: the blocks cannot hold the new length; unchanged.
        """
        if isinstance(additional_tokens, bool) or not isinstance(additional_tokens, int) or additional_tokens < 0:
            raise InvalidArgumentError(f"additional_tokens must be an int >= 0, got {additional_tokens!r}")
        new_length = self._sequence_length + additional_tokens
        required = (new_length + self._block_size - 1) // self._block_size
        if required > len(self._physical_blocks):
            raise InsufficientBlocksError(
                f"insufficient blocks: length {new_length} needs {required} blocks of "
                f"{self._block_size} tokens, the table has {len(self._physical_blocks)}"
            )
        self._sequence_length = new_length

    # -- additions ---------------------------------------------------------------------

    def capacity(self) -> int:
        """Tokens the table's blocks hold: ``num_blocks() * block_size``."""
        return len(self._physical_blocks) * self._block_size

    def runs(self) -> list[BlockRun]:
        """The table split into runs of physically consecutive blocks, in logical order.

        A request whose blocks are one run is read by attention as one zero-copy view.
        """
        runs: list[BlockRun] = []
        blocks = self._physical_blocks
        if not blocks:
            return runs
        start, first_logical = blocks[0], 0
        for logical in range(1, len(blocks)):
            if blocks[logical] != blocks[logical - 1] + 1:
                runs.append(BlockRun(start, logical - first_logical, first_logical))
                start, first_logical = blocks[logical], logical
        runs.append(BlockRun(start, len(blocks) - first_logical, first_logical))
        return runs

    def slots(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Slots (``block * block_size + offset``) of token positions ``start .. stop - 1``.

        Raises:
            InvalidArgumentError: not ``0 <= start <= stop <= capacity()``.
        """
        if not (_is_count(start) and _is_count(stop) and 0 <= start <= stop <= self.capacity()):
            raise InvalidArgumentError(f"token range [{start}, {stop}) is outside [0, {self.capacity()}] of this table")
        positions = np.arange(start, stop, dtype=np.int64)
        first, last = start // self._block_size, (stop - 1) // self._block_size + 1
        blocks = np.asarray(self._physical_blocks[first:last], dtype=np.int64)
        local = positions // self._block_size - first
        return blocks[local] * self._block_size + positions % self._block_size

    def copy(self) -> BlockTable:
        """An independent copy."""
        clone = BlockTable.__new__(BlockTable)
        clone._block_size = self._block_size
        clone._physical_blocks = list(self._physical_blocks)
        clone._logical_to_physical = list(self._logical_to_physical)
        clone._sequence_length = self._sequence_length
        return clone

    __copy__ = copy

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockTable:
        return self.copy()

    def to_dict(self) -> dict[str, Any]:
        """A plain-dict form (ints and lists only) that :meth:`from_dict` restores exactly."""
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
            InvalidArgumentError: missing keys or values that do not form a valid table.
        """
        missing = {"physical_blocks", "logical_to_physical", "sequence_length", "block_size"} - set(data)
        if missing:
            raise InvalidArgumentError(f"BlockTable dict is missing {sorted(missing)}")
        length = data["sequence_length"]
        if not _is_count(length):
            raise InvalidArgumentError(f"BlockTable dict: sequence_length must be an int >= 0, got {length!r}")
        table = cls(data["block_size"], data["physical_blocks"])
        try:
            table.extend_sequence(int(length))
        except InsufficientBlocksError as exc:
            raise InvalidArgumentError(f"BlockTable dict: sequence_length {length} does not fit: {exc}") from exc
        mapping = list(data["logical_to_physical"])
        if mapping != table._logical_to_physical:
            raise InvalidArgumentError(f"logical_to_physical {mapping!r} does not index physical_blocks in order")
        return table

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockTable):
            return NotImplemented
        return (
            self._block_size == other._block_size
            and self._sequence_length == other._sequence_length
            and self._physical_blocks == other._physical_blocks
            and self._logical_to_physical == other._logical_to_physical
        )

    def __repr__(self) -> str:
        runs = ", ".join(f"{r.start}..{r.start + r.length - 1}" for r in self.runs())
        return f"BlockTable(block_size={self._block_size}, sequence_length={self._sequence_length}, blocks=[{runs}])"
