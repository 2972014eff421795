"""The runner's persistent block tables: every live sequence's table a row of
one preallocated int64 array, appended to as the scheduler sends new blocks,
so a step's tables are one gather of its sequences' rows (no per-sequence
array built each step). Rows are reused as sequences end; the array doubles
when more sequences or longer tables need it."""

from __future__ import annotations

import numpy as np

from folio.model.attention.backend import TableRows


class BlockTables:
    def __init__(self, max_blocks: int, rows: int = 64):
        self.table = np.zeros((max(rows, 1), max(max_blocks, 1)), dtype=np.int64)
        self.lens = np.zeros(self.table.shape[0], dtype=np.int64)
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    @property
    def num_rows_used(self) -> int:
        return self.table.shape[0] - len(self._free)

    def add(self, block_ids) -> int:
        """A new sequence's row, holding `block_ids`."""
        if not self._free:
            old = self.table.shape[0]
            self._resize(2 * old, self.table.shape[1])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.lens[row] = 0
        self.append(row, block_ids)
        return row

    def set(self, row: int, block_ids) -> None:
        """The row's table rewritten (resumed, or changed by the scheduler)."""
        self.table[row, :self.lens[row]] = 0        # rows past their length stay 0
        self.lens[row] = 0
        self.append(row, block_ids)

    def append(self, row: int, block_ids) -> None:
        n = len(block_ids)
        if not n:
            return
        start = int(self.lens[row])
        if start + n > self.table.shape[1]:
            self._resize(self.table.shape[0], max(2 * self.table.shape[1], start + n))
        self.table[row, start:start + n] = block_ids
        self.lens[row] = start + n

    def copy_row(self, row: int) -> int:
        """A new row holding `row`'s table (a forked sample's)."""
        return self.add(self.table[row, :self.lens[row]].copy())

    def remove(self, row: int) -> None:
        self.table[row, :self.lens[row]] = 0
        self.lens[row] = 0
        self._free.append(row)

    def ids(self, row: int) -> list[int]:
        return self.table[row, :self.lens[row]].tolist()

    def gather(self, rows: list[int]) -> TableRows:
        """The tables of `rows`, in that order: a fresh [len(rows), W] array
        (W the longest of them), 0-padded."""
        index = np.asarray(rows, dtype=np.int64)
        lens = self.lens[index]
        width = int(lens.max(initial=1))
        return TableRows(self.table[index, :width], lens)     # fancy indexing: a copy

    def _resize(self, rows: int, cols: int) -> None:
        table = np.zeros((rows, cols), dtype=np.int64)
        old_rows, old_cols = self.table.shape
        table[:old_rows, :old_cols] = self.table
        lens = np.zeros(rows, dtype=np.int64)
        lens[:old_rows] = self.lens
        self.table, self.lens = table, lens
