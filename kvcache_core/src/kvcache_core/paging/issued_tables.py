"""The page tables a manager issues, per KV-cache group, each built on the last one where it can.

A decode step's table differs from the last step's only in its lengths, or in pages appended
after each request's: :class:`IssuedTables` keeps, per group, the last table issued and what it
was built from (per request: its block table object, generation and count of used blocks), so
the next table of the same requests shares those arrays of pages (:meth:`PageTable.with_seq_lens`)
instead of listing every page again. Every table issued is recorded by the argument checks, so
a caller may hand it back to the raw calls.
"""

from __future__ import annotations

from typing import Any

from kvcache_core.contract.block_table import BlockTable
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.page_table import PageTable
from kvcache_core.paging.checks import ArgumentChecks
from kvcache_core.paging.request_state import RequestState

__all__ = ["IssuedTables"]


class IssuedTables:
    """The tables issued for a manager's requests (manager internals, under its lock)."""

    def __init__(self, config: CacheConfig, checks: ArgumentChecks) -> None:
        self._config = config
        self._checks = checks
        # Per KV-cache group, the last page table issued and what it was built from: per
        # request, its table object, generation and used blocks.
        self._last: dict[int, tuple[list[tuple[BlockTable, int, int]], PageTable]] = {}

    def issue(self, states: list[RequestState[Any]], group: int = 0) -> PageTable:
        """The checked, generation-stamped page table of ``states`` in KV-cache ``group``.

        When the last table issued (per group) was of the same requests with the same table,
        generation and no more used blocks each (a decode step that filled no new block), the
        new table shares its arrays of pages and only the lengths are new; when blocks were
        only appended, they are added to its arrays.
        """
        tables = [state.tables[group] for state in states]
        block_size = self._config.block_size
        held = [table.held_tokens() for table in tables]
        generations = [state.generation for state in states]
        # A table's blocks change only by appending while its request's generation stays:
        # the same table object, generation and count of used blocks mean the same pages.
        built = [
            (table, generation, -(-tokens // block_size))
            for table, generation, tokens in zip(tables, generations, held, strict=True)
        ]
        last = self._last.get(group)
        if (
            last is not None
            and len(last[0]) == len(built)
            and all(
                was[0] is now[0] and was[1] == now[1] and was[2] <= now[2]
                for was, now in zip(last[0], built, strict=True)
            )
        ):  # the same pages, some with pages appended
            new_pages = [
                [table.physical_block(table.first_logical + index) for index in range(was[2], now[2])]
                for table, was, now in zip(tables, last[0], built, strict=True)
            ]
            # No block appended (a decode step, mostly): the lengths alone are new.
            appended = any(new_pages)
            table = last[1].with_seq_lens(held, generations, new_pages=new_pages if appended else None)
        else:
            table = PageTable.from_block_tables(
                tables,
                [state.request_id for state in states],
                block_size,
                sliding_window=self._config.kv_groups[group].window,
                generations=generations,
                group=group,
            )
        self._last[group] = (built, table)
        return self._checks.issue(table)

    def is_last(self, table: PageTable) -> bool:
        """Whether ``table`` is the last one issued in its group."""
        last = self._last.get(table.group)
        return last is not None and last[1] is table

    def grown_in_place(self, table: PageTable, states: list[RequestState[Any]]) -> PageTable:
        """The next table after ``table``, the last one issued in its group, whose requests
        ``states`` each grew inside the blocks they held (no block added or released, the
        same generations): its arrays of pages shared, the lengths new."""
        built, _ = self._last[table.group]
        held = [state.tables[table.group].held_tokens() for state in states]
        grown = table.with_seq_lens(held, [state.generation for state in states])
        self._last[table.group] = (built, grown)  # the same tables, generations and used blocks
        return self._checks.issue(grown)
