"""Plain-text tables for the command's reports (``kvcache backends``, ``kvcache check``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

__all__ = ["write_table"]


def write_table(headers: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO) -> None:
    """Write ``rows`` under ``headers`` as left-aligned columns, a dashed rule between."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    for line in (headers, ["-" * width for width in widths], *rows):
        out.write("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=False)).rstrip() + "\n")
