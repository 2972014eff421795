"""Vectorised sampling for the whole batch.

Order of operations, per row of fp32 logits:
  1. logprobs of the raw distribution (log_softmax), reported for the chosen token;
  2. greedy rows (temperature 0) take the argmax; the rest:
  3. divide by temperature;
  4. top-k: keep the k largest logits (0 or -1: all);
  5. top-p: keep the smallest prefix of the sorted distribution whose mass
     reaches p (the most likely token always stays);
  6. sample by the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) drawn
     from the sequence's own generator, equivalent to sampling from p and
     independent of what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor          # [S] fp32 (0 for greedy rows)
    top_k: torch.Tensor                # [S] int64, vocab size where disabled
    top_p: torch.Tensor                # [S] fp32
    generators: list[Optional[torch.Generator]]   # None for greedy rows
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    max_logprobs: int = 0      # the most top logprobs any row asked for


def _apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if batch.needs_top_k:
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= batch.top_k[:, None],
                                                  float("-inf"))
    if batch.needs_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= batch.top_p[:, None],
                                                  float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@dataclass
class SamplerOutput:
    tokens: torch.Tensor            # [S] int64
    logprobs: torch.Tensor          # [S] fp32, raw logprob of each chosen token
    top_ids: Optional[torch.Tensor] = None       # [S, max_logprobs]
    top_logprobs: Optional[torch.Tensor] = None  # [S, max_logprobs]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [S, V] fp32 -> chosen tokens, their raw logprobs, and the top
    `max_logprobs` raw logprobs of each row."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    if not batch.all_greedy:
        random_rows = [i for i, g in enumerate(batch.generators) if g is not None]
        idx = torch.tensor(random_rows, device=logits.device)
        scaled = logits[idx] / batch.temperature[idx, None]
        if batch.needs_top_k or batch.needs_top_p:
            sub = SamplingBatch(batch.temperature[idx], batch.top_k[idx], batch.top_p[idx],
                                [], False, batch.needs_top_k, batch.needs_top_p)
            scaled = _apply_top_k_top_p(scaled, sub)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for j, row in enumerate(random_rows):
            noise[j].exponential_(generator=batch.generators[row])
        tokens[idx] = (probs / noise).argmax(dim=-1)
    out = SamplerOutput(tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1))
    if batch.max_logprobs > 0:
        out.top_logprobs, out.top_ids = logprobs.topk(batch.max_logprobs, dim=-1)
    return out
