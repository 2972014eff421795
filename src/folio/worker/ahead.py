"""--async-scheduling in the runner (issue 50): what a step samples stays
where it was sampled (on the device), the next step's PLACEHOLDER inputs are
filled from it there, and the step's tokens are read back only when the
engine takes the step's result (`StepHandle.result`, after the step's event),
so that the host never waits for the device between two steps.

On the CPU the "device" is the host and every step is done when it returns;
the same code runs there, which is how it is tested without a GPU.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from folio.request import PLACEHOLDER


class AheadTokens:
    def __init__(self, device: torch.device):
        self.device = device
        self.tokens: Optional[torch.Tensor] = None   # [R] int64: the last step's samples
        self.rows: dict[int, int] = {}               # seq_id -> its row of `tokens`
        self.event = None      # CUDA: recorded after the last step's read-back began

    def placeholders(self, ordered, last_rows: list[int], ids: np.ndarray):
        """A function that fills the step's input ids tensor where a sequence's
        last token is a PLACEHOLDER (the token the step before sampled for it),
        or None where there is none. `ids` gets a harmless 0 there meanwhile."""
        rows, prev, lost = [], [], []
        for s, row in zip(ordered, last_rows):
            if s.token_ids[-1] == PLACEHOLDER:
                at = self.rows.get(s.seq_id)
                if at is None:      # its sampling failed in that step: its request
                    lost.append(row)    # has ended, this step's row is thrown away
                else:
                    rows.append(row)
                    prev.append(at)
        ids[rows + lost] = 0
        if not rows:
            return None
        at = torch.tensor(rows, device=self.device)
        source = self.tokens[torch.tensor(prev, device=self.device)]

        def fill(ids_tensor: torch.Tensor) -> None:
            ids_tensor[at] = source
        return fill

    def tokens_of(self, seq_ids: list[int]) -> tuple[list[int], Optional[torch.Tensor]]:
        """The last step's samples of those of `seq_ids` that have one, on the
        device: (their positions in `seq_ids`, the tokens)."""
        found = [(i, self.rows[seq_id]) for i, seq_id in enumerate(seq_ids)
                 if seq_id in self.rows]
        if not found:
            return [], None
        return [i for i, _ in found], \
            self.tokens[torch.tensor([at for _, at in found], device=self.device)]

    def keep(self, sampled: "SampledRows") -> "SampledRows":
        """A step's samples kept for the next step, and their read-back begun."""
        self.tokens = sampled.parts[0]
        self.rows = {seq_id: i for i, seq_id in enumerate(sampled.seq_ids)}
        if self.device.type == "cuda":
            sampled.to_host()
            self.event = torch.cuda.Event()
            self.event.record()
        return sampled

    def keep_rows(self, rows) -> None:
        """Samples of several calls (the row-by-row path after a fault), kept
        for the next step only (their lists are made at once)."""
        self.tokens = torch.cat([result.tokens for _, result in rows])
        ids = [seq_id for seq_ids, _ in rows for seq_id in seq_ids]
        self.rows = {seq_id: i for i, seq_id in enumerate(ids)}

    def forget(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)

    def take_event(self):
        event, self.event = self.event, None
        return event


class SampledRows:
    """One sampling call's tensors and each row's asked-for top logprobs (k, or
    None), turned into ModelRunnerOutput's lists by `materialize`: at once in
    a synchronous step, when the engine takes the step under --async-scheduling."""

    def __init__(self, seq_ids: list[int], result, top_k: list[Optional[int]]):
        self.seq_ids, self.top_k = seq_ids, top_k
        self.parts = [result.tokens, result.logprobs, result.top_ids, result.top_logprobs]

    def to_host(self) -> None:
        self.parts = [None if t is None else t.to("cpu", non_blocking=True)
                      for t in self.parts]

    def lists(self):
        """(seq_ids, token ids, logprobs, top logprobs) as the output keeps them."""
        tokens, logprobs, top_ids, top_lps = self.parts
        tops: list = [None] * len(self.seq_ids)
        if top_ids is not None:
            ids, lps = top_ids.tolist(), top_lps.tolist()
            tops = [None if k is None else list(zip(ids[i][:k], lps[i][:k]))
                    for i, k in enumerate(self.top_k)]
        return self.seq_ids, tokens.tolist(), logprobs.tolist(), tops
