"""What sampling's per-step inputs and draws cost (issue 50), the way 51596a5
made them (written out below) against the runner's persistent state, at 64
and 256 rows, a 49,152- and a 128,256-token vocabulary, one thread:

- penalties: the counts and seen masks of penalized rows (repetition,
  frequency, presence) with 200-token histories, made and applied to the
  step's logits: rebuilt from the histories every step (51596a5's
  `_adjustments`, one indexed write over all histories) and applied by torch
  on them, against kept up to date (worker/sampling_columns.py: the step's
  one new token a row added) and applied by the native kernel reading the
  tables in place (no [rows, V] gather);
- draws: sampled rows (temperature 0.8) drawn by a torch.Generator a row
  (51596a5: an exponential_ per row, then p / E and argmax) against the
  exponential race of model/layers/draws.py in one kernel (the native one
  here);
- top-p 0.95: each row sorted (the torch definition, which 51596a5 ran on
  every CPU) against the native kernel's selection and partitions.

    .venv/bin/python docs/bench/sampler_step.py
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from folio.core.outputs import SamplingInfo
from folio.kernels import native
from folio.model.layers import draws
from folio.model.layers.sampler import (LogitAdjustments, apply_adjustments,
                                        top_k_top_p_reference)
from folio.sampling_params import SamplingParams
from folio.worker.sampling_columns import SamplingColumns


def rebuilt(histories, num_prompt, vocab):
    """51596a5's `_adjustments` (counts and seen): all rows' histories in one
    indexed write, every step."""
    n = len(histories)
    counts = torch.zeros(n, vocab)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    lens = [len(h) for h in histories]
    total = sum(lens)
    tokens = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(histories),
                                          np.int64, total))
    lengths = torch.tensor(lens)
    rows = torch.repeat_interleave(torch.arange(n), lengths)
    place = torch.arange(total) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    outputs = place >= num_prompt
    seen[rows, tokens] = True
    counts.index_put_((rows[outputs], tokens[outputs]), torch.ones(int(outputs.sum())),
                      accumulate=True)
    return counts, seen


def generator_draws(probs, generators):
    """51596a5's draw: a generator's exponential_ a row, then the race."""
    noise = torch.empty_like(probs)
    for j, g in enumerate(generators):
        noise[j].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def timed(fn, reps: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.3,
                            presence_penalty=0.2)
    print("| rows | vocabulary | penalties rebuilt + applied, ms | kept + applied in place, ms "
          "| ratio "
          "| draws, a generator a row, ms | one race, ms | ratio "
          "| top-p, sorted, ms | partitioned, ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for vocab in (49152, 128256):
        for rows in (64, 256):
            hist = [[(i * 7 + j * 13) % vocab for j in range(200)] for i in range(rows)]
            logits = torch.randn(rows, vocab)
            third = [torch.full((rows,), x) for x in (0.2, 0.3, 1.2)]

            def old():
                counts, seen = rebuilt(hist, 20, vocab)
                return apply_adjustments(logits, LogitAdjustments(*third, counts, seen,
                                                                  None, None))
            old_pen = timed(old)
            cols = SamplingColumns(vocab, torch.device("cpu"), rows)
            for r in range(rows):
                cols.set(r, SamplingInfo(params, r, 20))
                cols.penalties.add(r, hist[r], 0, 20)
            index = np.arange(rows)

            def kept():
                for r in range(rows):         # a decode step: one new token a row
                    cols.penalties.add(r, [(r * 5) % vocab], 200, 20)
                cols.penalties.flush(rows)
                return native.penalize(logits, cols.penalties.counts, cols.penalties.seen,
                                       torch.from_numpy(index), *third)
            new_pen = timed(kept)
            probs = torch.softmax(torch.randn(rows, vocab), dim=-1)
            gens = [torch.Generator().manual_seed(r) for r in range(rows)]
            keys = draws.keys_tensor(range(rows), [200] * rows, draws.SAMPLE)
            old_draw = timed(lambda: generator_draws(probs, gens), reps=3)
            new_draw = timed(lambda: draws.race(probs, keys), reps=3)
            top_p = torch.full((rows,), 0.95)
            old_p = timed(lambda: top_k_top_p_reference(logits.clone(), None, top_p), reps=2)
            new_p = timed(lambda: native.top_k_top_p_(logits.clone(), None, top_p), reps=2)
            print(f"| {rows} | {vocab} | {old_pen:.2f} | {new_pen:.2f} | {old_pen / new_pen:.1f}x "
                  f"| {old_draw:.2f} | {new_draw:.2f} | {old_draw / new_draw:.1f}x "
                  f"| {old_p:.1f} | {new_p:.1f} | {old_p / new_p:.1f}x |")


if __name__ == "__main__":
    main()
