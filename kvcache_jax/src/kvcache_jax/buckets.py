"""Shape buckets: host-side padding that keeps a decode loop on a few compiled programs.

A jitted function compiles once per input shape. A decode step changes the number of
new tokens, the batch, the longest request's block count and the query count; each is
rounded up here to a power of two, padded with values the kernels ignore:

* slots: past the pool's last slot, which the ``mode="drop"`` scatter drops;
* block-table entries: block 0, masked by ``seq_lens``;
* requests: ``seq_lens`` 0 and no query rows (``qo_indptr`` repeats its last offset);
* query rows: zeros past ``qo_indptr[-1]``, whose outputs are cut off.

So a context growing from 1 to ``n`` tokens compiles attention about ``log2(n / (16 *
block_size))`` times, not ``n`` times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.page_table import PageTable

__all__ = ["MIN_BLOCK_BUCKET", "PaddedBatch", "bucket", "pad_batch", "pad_blocks", "pad_slots"]

#: Fewest block-table columns: short contexts share one program.
MIN_BLOCK_BUCKET = 16

IndexArray = npt.NDArray[np.int32]


def bucket(count: int, minimum: int = 1) -> int:
    """The smallest power of two ``>= max(count, minimum, 1)``."""
    target = max(count, minimum, 1)
    return 1 << (target - 1).bit_length()


def pad_slots(slots: npt.NDArray[np.integer], total_slots: int) -> IndexArray:
    """``slots`` ``[n]`` as int32, padded to :func:`bucket` ``(n)`` with distinct slots past
    ``total_slots`` (each one dropped by the scatter)."""
    count = int(slots.shape[0])
    padded = np.arange(total_slots, total_slots + bucket(count), dtype=np.int64)
    padded[:count] = slots
    return padded.astype(np.int32)


def pad_blocks(blocks: npt.NDArray[np.integer], fill: int) -> IndexArray:
    """``blocks`` ``[n]`` as int32, padded to :func:`bucket` ``(n)`` with ``fill``."""
    count = int(blocks.shape[0])
    padded = np.full(bucket(count), fill, dtype=np.int32)
    padded[:count] = blocks
    return padded


@dataclass(frozen=True)
class PaddedBatch:
    """A batch's page table and query offsets, padded to buckets (host int32 arrays).

    Attributes:
        block_tables: ``[bucket(B), bucket(max_blocks, MIN_BLOCK_BUCKET)]``.
        seq_lens: ``[bucket(B)]``, 0 for padding requests.
        qo_indptr: ``[bucket(B) + 1]``, the last offset repeated for padding requests.
        max_query_len: ``bucket`` of the most query tokens of one request.
        query_rows: ``bucket(total_queries)``, the rows the query is padded to.
        total_queries: the real query rows, where the output is cut.
    """

    block_tables: IndexArray
    seq_lens: IndexArray
    qo_indptr: IndexArray
    max_query_len: int
    query_rows: int
    total_queries: int


def pad_batch(page_table: PageTable, qo_indptr: npt.NDArray[np.integer]) -> PaddedBatch:
    """Pad a batch (validated by the manager) to its buckets."""
    batch = page_table.batch_size
    batch_rows = bucket(batch)
    used_columns = int(page_table.block_tables.shape[1]) if batch else 0
    columns = bucket(used_columns, MIN_BLOCK_BUCKET)
    block_tables = np.zeros((batch_rows, columns), dtype=np.int32)
    block_tables[:batch, :used_columns] = page_table.block_tables
    seq_lens = np.zeros(batch_rows, dtype=np.int32)
    seq_lens[:batch] = page_table.seq_lens
    indptr = np.full(batch_rows + 1, int(qo_indptr[-1]), dtype=np.int32)
    indptr[: batch + 1] = qo_indptr
    total = int(qo_indptr[-1])
    longest = int(np.max(np.diff(qo_indptr))) if batch else 0
    return PaddedBatch(block_tables, seq_lens, indptr, bucket(longest), bucket(total), total)
