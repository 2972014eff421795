"""The runner's sampling state, kept from step to step instead of rebuilt:

- `SamplingColumns`: every live sequence's sampling parameters, a row of
  preallocated arrays (the row of its block table, worker/input_batch.py),
  written once when the sequence starts. A step's parameters are one gather
  of its rows; its random draws' keys are computed from the seed column and
  the positions being sampled (model/layers/draws.py).
- `PenaltyCounts`: for sequences whose sampling reads the tokens they have
  seen (repetition, frequency and presence penalties), a [rows, V] count of
  each token in the output and a mask of the tokens seen at all, on the
  device, updated as tokens are computed: the step's new tokens of every
  such sequence in one indexed add, not a batch's histories laid out again.

A new sampling field is read in `SamplingColumns.set` and used in
model/layers/sampler.py `sample`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from folio.core.outputs import SamplingInfo
from folio.model.layers import draws
from folio.model.layers.sampler import LogitAdjustments, SamplingBatch
from folio.request import PLACEHOLDER

# the float columns
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)


class PenaltyCounts:
    """Output counts and seen masks of the rows that use penalties, allocated
    on the first such row (capacity: rows of the block tables) and grown by
    doubling. Changes queue up and are applied together (`flush`) before the
    step samples."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.counts: Optional[torch.Tensor] = None     # [rows, V] fp32
        self.seen: Optional[torch.Tensor] = None       # [rows, V] bool
        self._zero: list[int] = []
        self._rows: list[int] = []
        self._tokens: list[int] = []
        self._outputs: list[bool] = []

    def reset(self, row: int) -> None:
        """The row starts over (a new sequence, or one recomputed from its start)."""
        self._zero.append(row)
        # what was queued for the row before is gone with it
        if row in self._rows:
            keep = [i for i, r in enumerate(self._rows) if r != row]
            self._rows = [self._rows[i] for i in keep]
            self._tokens = [self._tokens[i] for i in keep]
            self._outputs = [self._outputs[i] for i in keep]

    def add(self, row: int, tokens: list[int], first_place: int, num_prompt: int) -> None:
        """The row's history grows by `tokens`, the first at `first_place`; those
        at num_prompt or later are outputs. A PLACEHOLDER (--async-scheduling:
        a token still on the device) is left out: `add_on_device` counts it."""
        n = len(tokens)
        if n and tokens[-1] == PLACEHOLDER:
            tokens, n = [t for t in tokens if t != PLACEHOLDER], n - 1
        self._rows.extend([row] * n)
        self._tokens.extend(tokens)
        self._outputs.extend(first_place + i >= num_prompt for i in range(n))

    def add_on_device(self, rows: list[int], tokens: torch.Tensor, num_rows: int) -> None:
        """Outputs the host has not seen yet (the step before's samples, kept
        on the device under --async-scheduling), one a row: counted at once,
        after what is queued (a row's reset first)."""
        self.flush(num_rows)
        where = torch.tensor(rows, device=self.device)
        self.seen[where, tokens] = True
        self.counts.index_put_((where, tokens), torch.ones(len(rows), device=self.device),
                               accumulate=True)

    def flush(self, num_rows: int) -> None:
        """Apply what is queued (to at least `num_rows` rows: new ones are 0)."""
        self._ensure(num_rows)
        if not (self._zero or self._rows):
            return
        if self._zero:
            zero = torch.tensor(self._zero, device=self.device)
            self.counts[zero] = 0
            self.seen[zero] = False
        if self._rows:
            rows = torch.tensor(self._rows, device=self.device)
            tokens = torch.tensor(self._tokens, device=self.device)
            outputs = torch.tensor(self._outputs, device=self.device)
            self.seen[rows, tokens] = True
            self.counts.index_put_((rows[outputs], tokens[outputs]),
                                   torch.ones(int(outputs.sum()), device=self.device),
                                   accumulate=True)
        self._zero, self._rows, self._tokens, self._outputs = [], [], [], []

    def copy(self, src: int, dst: int, num_rows: int) -> None:
        """A forked sample starts with its parent's counts."""
        self.flush(num_rows)
        self._ensure(num_rows)
        self.counts[dst] = self.counts[src]
        self.seen[dst] = self.seen[src]

    def gather(self, rows: np.ndarray, extra: list[tuple[int, list[int]]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, seen) of `rows` in that order, [len(rows), V]; `extra`:
        (batch row, tokens) that row has seen beyond its history, as outputs (a
        sequence's proposals before its row)."""
        index = torch.from_numpy(rows).to(self.device)
        counts, seen = self.counts[index], self.seen[index]     # copies
        if extra:
            where = torch.tensor([r for r, toks in extra for _ in toks], device=self.device)
            tokens = torch.tensor([t for _, toks in extra for t in toks], device=self.device)
            seen[where, tokens] = True
            counts.index_put_((where, tokens), torch.ones(len(tokens), device=self.device),
                              accumulate=True)
        return counts, seen

    def _ensure(self, num_rows: int) -> None:
        have = 0 if self.counts is None else self.counts.shape[0]
        if have >= num_rows:
            return
        rows = max(num_rows, 2 * have)
        counts = torch.zeros(rows, self.vocab, device=self.device)
        seen = torch.zeros(rows, self.vocab, dtype=torch.bool, device=self.device)
        if have:
            counts[:have], seen[:have] = self.counts, self.seen
        self.counts, self.seen = counts, seen


class SamplingColumns:
    def __init__(self, vocab: int, device: torch.device, rows: int = 64):
        self.vocab, self.device = vocab, device
        self.floats = np.zeros((rows, 6), dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.seeds = np.zeros(rows, dtype=np.uint64)
        self.logprobs = np.zeros(rows, dtype=np.int64)     # top logprobs asked for
        self.penalized = np.zeros(rows, dtype=bool)        # reads PenaltyCounts
        # any of steps 2-4 (penalties, logit bias, min_tokens): a row of infos to read
        self.adjusted = np.zeros(rows, dtype=bool)
        self.infos: list[Optional[SamplingInfo]] = [None] * rows   # bias, min_tokens
        self.penalties = PenaltyCounts(vocab, device)

    @property
    def num_rows(self) -> int:
        return self.floats.shape[0]

    def set(self, row: int, info: SamplingInfo) -> None:
        if row >= self.num_rows:
            self._grow(max(row + 1, 2 * self.num_rows))
        self.infos[row] = info
        params = info.params
        self.floats[row] = (info.temperature, params.top_p, params.min_p,
                            params.presence_penalty, params.frequency_penalty,
                            params.repetition_penalty)
        self.top_k[row] = min(params.top_k, self.vocab) if params.top_k > 0 else self.vocab
        self.seeds[row] = int(info.seed) & ((1 << 64) - 1)
        self.logprobs[row] = params.logprobs or 0
        self.penalized[row] = params.needs_history
        self.adjusted[row] = bool(params.needs_history or params.logit_bias or params.min_tokens)
        if params.needs_history:
            self.penalties.reset(row)

    def release(self, row: int) -> None:
        """The row's sequence ended: nothing of it is read any more (a step's
        test of its penalties and adjustments, until the row is set again)."""
        self.penalized[row] = self.adjusted[row] = False

    @property
    def any_penalized(self) -> bool:
        return bool(self.penalized.any())

    def batch(self, rows: np.ndarray, positions: Optional[np.ndarray] = None,
              histories: Optional[list[Optional[list[int]]]] = None,
              extra: Optional[list[tuple[int, list[int]]]] = None) -> SamplingBatch:
        """The sampling tensors of `rows` (in that order). `positions`: where
        each row's token goes (the keys of its random draws; None: no draws,
        a distribution only). `histories`: each row's tokens so far (its
        min_tokens), `extra` the proposals a row sees beyond them."""
        f = self.floats[rows]
        top_k = self.top_k[rows]
        random = f[:, _TEMPERATURE] > 0
        all_greedy = not random.any()
        device = self.device
        columns: list[torch.Tensor] = []

        def on_device() -> torch.Tensor:
            """The rows' float columns, [6, S], in one copy to the device."""
            if not columns:
                columns.append(torch.from_numpy(np.ascontiguousarray(f.T)).to(device))
            return columns[0]
        adjust = self._adjustments(rows, on_device, histories, extra or [])
        if all_greedy:          # the argmax alone: no temperature, top-k/p or draws
            return SamplingBatch(None, None, None, None, random, True, False, False,
                                 max_logprobs=int(self.logprobs[rows].max(initial=0)),
                                 adjust=adjust)
        keys = None
        if positions is not None:
            keys = torch.from_numpy(draws.row_keys(self.seeds[rows], positions, draws.SAMPLE)
                                    ).to(device)
        block = on_device()
        return SamplingBatch(
            temperature=block[_TEMPERATURE], top_k=torch.from_numpy(top_k).to(device),
            top_p=block[_TOP_P], keys=keys, random=random, all_greedy=False,
            needs_top_k=bool((top_k < self.vocab).any()),
            needs_top_p=bool((f[:, _TOP_P] < 1.0).any()),
            max_logprobs=int(self.logprobs[rows].max(initial=0)),
            adjust=adjust,
            min_p=block[_MIN_P] if (f[:, _MIN_P] > 0).any() else None)

    def _adjustments(self, rows: np.ndarray, on_device, histories, extra
                     ) -> Optional[LogitAdjustments]:
        if not self.adjusted[rows].any():      # the common step: one numpy test
            return None
        infos = [self.infos[r] for r in rows]
        biased = any(i.params.logit_bias for i in infos)
        penalized = self.penalized[rows]
        n, device = len(rows), self.device
        f32 = dict(dtype=torch.float32, device=device)
        table_rows = None
        if penalized.any():
            self.penalties.flush(self.num_rows)
            if extra:           # proposals seen beyond the tables: a gathered copy
                counts, seen = self.penalties.gather(rows, extra)
            else:               # the tables themselves, read in place by row
                counts, seen = self.penalties.counts, self.penalties.seen
                table_rows = torch.from_numpy(rows).to(device)
        else:
            counts = torch.zeros(n, self.vocab, **f32)
            seen = torch.zeros(n, self.vocab, dtype=torch.bool, device=device)
        bias = torch.zeros(n, self.vocab, **f32) if biased else None
        banned = None
        seen_beyond = {r: len(toks) for r, toks in extra}
        for row, info in enumerate(infos):
            p = info.params
            if p.logit_bias:
                ids, values = zip(*p.logit_bias.items())
                bias[row, torch.tensor(ids, device=device)] = torch.tensor(values, **f32)
            if p.min_tokens and info.min_tokens_banned:
                history = histories[row] if histories else None
                num_outputs = (len(history or ()) + seen_beyond.get(row, 0)
                               - info.num_prompt_tokens)
                if num_outputs < p.min_tokens:
                    if banned is None:
                        banned = torch.zeros(n, self.vocab, dtype=torch.bool, device=device)
                    banned[row, torch.tensor(info.min_tokens_banned, device=device)] = True
        block = on_device()
        return LogitAdjustments(
            presence=block[_PRESENCE], frequency=block[_FREQUENCY],
            repetition=block[_REPETITION], output_counts=counts, seen=seen, bias=bias,
            banned=banned, rows=table_rows)

    def _grow(self, rows: int) -> None:
        old = self.num_rows

        def grown(a: np.ndarray) -> np.ndarray:
            b = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
            b[:old] = a
            return b
        self.floats, self.top_k, self.seeds = grown(self.floats), grown(self.top_k), \
            grown(self.seeds)
        self.logprobs, self.penalized = grown(self.logprobs), grown(self.penalized)
        self.adjusted = grown(self.adjusted)
        self.infos = self.infos + [None] * (rows - old)
