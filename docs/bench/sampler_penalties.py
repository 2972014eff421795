"""What the sampler's penalty inputs cost a step (issue 50): Folio's
`build_sampling_batch` (all rows' histories in one indexed write) against
the row-by-row construction it replaced (written out below, as it was at
21c5c72), at 64 and 256 rows of repetition-penalized requests with 200-token
histories and a 4,096- and a 49,152-token vocabulary, one thread.

    .venv/bin/python docs/bench/sampler_penalties.py
"""

from __future__ import annotations

import time

import torch

from folio.core.outputs import SamplingInfo
from folio.model.layers.sampler import build_sampling_batch
from folio.sampling_params import SamplingParams


def row_by_row(infos, histories, vocab):
    """The construction of 21c5c72's `_adjustments` (counts and seen only)."""
    n = len(infos)
    counts = torch.zeros(n, vocab)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    for row, (info, history) in enumerate(zip(infos, histories)):
        history = history or []
        outputs = history[info.num_prompt_tokens:]
        if outputs:
            counts[row].index_add_(0, torch.tensor(outputs), torch.ones(len(outputs)))
        if history:
            seen[row, torch.tensor(history)] = True
    return counts, seen


def timed(fn, reps: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0, repetition_penalty=1.2)
    print("| rows | vocabulary | row by row, ms | all at once (whole batch), ms | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for vocab in (4096, 49152):
        for rows in (64, 256):
            infos = [SamplingInfo(params, 0, 20) for _ in range(rows)]
            hist = [[(i * 7 + j * 13) % vocab for j in range(200)] for i in range(rows)]
            old = timed(lambda: row_by_row(infos, hist, vocab))
            new = timed(lambda: build_sampling_batch(infos, [None] * rows, hist, vocab,
                                                     torch.device("cpu")))
            print(f"| {rows} | {vocab} | {old:.2f} | {new:.2f} | {old / new:.1f}x |")


if __name__ == "__main__":
    main()
