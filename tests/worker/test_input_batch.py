"""The runner's persistent block tables and the step built from them at once
(StepDescription.of_rows) against the per-span construction."""

import numpy as np
import pytest
import torch

from folio.model.attention.backend import StepDescription, padded_tables
from folio.worker.input_batch import BlockTables


def test_rows_are_appended_rewritten_reused_and_grown():
    t = BlockTables(max_blocks=2, rows=1)
    a = t.add([5, 6])
    b = t.add([7])                      # a second row: the array doubles
    t.append(a, [8, 9, 10])             # past the width: the columns double
    assert t.ids(a) == [5, 6, 8, 9, 10] and t.ids(b) == [7]
    c = t.copy_row(a)
    t.append(c, [11])
    assert t.ids(c) == [5, 6, 8, 9, 10, 11] and t.ids(a) == [5, 6, 8, 9, 10]
    t.set(a, [1])
    assert t.ids(a) == [1]
    rows = t.gather([c, a, b])
    assert rows.padded.tolist() == [[5, 6, 8, 9, 10, 11], [1, 0, 0, 0, 0, 0],
                                    [7, 0, 0, 0, 0, 0]]
    rows.padded[0, 0] = 99              # a copy: the persistent rows untouched
    assert t.ids(c)[0] == 5
    t.remove(c)
    assert t.num_rows_used == 2 and t.add([3]) == c and t.ids(c) == [3]


@pytest.mark.parametrize("seed", range(5))
def test_of_rows_equals_the_per_span_step(seed):
    rng = np.random.default_rng(seed)
    bs, tables = 4, BlockTables(max_blocks=3)
    spans, rows = [], []
    for i in range(rng.integers(1, 9)):
        n = 1 if i < 3 else int(rng.integers(1, 12))        # decodes first
        start = int(rng.integers(0, 20))
        ids = rng.permutation(64)[:-(-(start + n) // bs) + int(rng.integers(0, 2))]
        spans.append((start, n, ids.astype(np.int64)))
        rows.append(tables.add(ids))
    expect, expect_last = _per_span(spans, bs)
    step, last = StepDescription.of_rows([s for s, _, _ in spans], [n for _, n, _ in spans],
                                         tables.gather(rows), bs, torch.device("cpu"))
    assert last == expect_last
    assert step.positions.tolist() == expect["positions"]
    assert step.slot_mapping.tolist() == expect["slots"]
    assert step.num_decodes == sum(n == 1 for _, n, _ in spans)
    assert [t.tolist() for t in step.block_tables] == [t.tolist() for _, _, t in spans]
    assert padded_tables(step).shape == (len(spans), max(len(t) for _, _, t in spans))


def _per_span(spans, bs):
    positions, slots, last, row = [], [], [], 0
    for start, n, table in spans:
        for p in range(start, start + n):
            positions.append(p)
            slots.append(int(table[p // bs]) * bs + p % bs)
        row += n
        last.append(row - 1)
    return {"positions": positions, "slots": slots}, last
