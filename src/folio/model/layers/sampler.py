"""Vectorised sampling for the whole batch.

Order of operations, per row of fp32 logits:
  1. logprobs of the raw distribution (log_softmax), reported for the chosen
     token and the top-k (the model's own distribution, before any processing);
  2. penalties: repetition (a logit of a token in the prompt or the output is
     divided by r when positive, multiplied by r when negative), then
     frequency (minus f x its count in the output) and presence (minus p if it
     occurs in the output);
  3. logit bias added;
  4. before min_tokens outputs, EOS and stop token ids masked out;
  5. greedy rows (temperature 0) take the argmax; the rest:
  6. divide by temperature;
  7. top-k: keep the k largest logits (0 or -1: all);
  8. top-p: keep the smallest prefix of the sorted distribution whose mass
     reaches p (the most likely token always stays);
  9. min-p: drop tokens whose probability is below min_p x the top one;
 10. sample by the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) drawn
     from the sequence's own generator, equivalent to sampling from p and
     independent of what else is in the batch.
A batch that is all greedy, with no adjustments and no top logprobs, takes one
native pass on the CPU (argmax and its logprob) instead of steps 1 and 5. Step
1 makes the whole [S, V] of logprobs only when a row asks for top logprobs;
otherwise each chosen token's comes from one log-sum-exp of its row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from folio.kernels import native

if TYPE_CHECKING:
    from folio.core.outputs import SamplingInfo


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
    adjust: Optional["LogitAdjustments"] = None   # steps 2-4, when any row needs them
    min_p: Optional[torch.Tensor] = None          # [S] fp32, when any row sets it


@dataclass
class LogitAdjustments:
    presence: torch.Tensor         # [S] fp32
    frequency: torch.Tensor        # [S] fp32
    repetition: torch.Tensor       # [S] fp32 (1: none)
    output_counts: torch.Tensor    # [S, V] fp32: times each token was generated
    seen: torch.Tensor             # [S, V] bool: in the prompt or the output
    bias: Optional[torch.Tensor]   # [S, V] fp32
    banned: Optional[torch.Tensor] # [S, V] bool


def build_sampling_batch(infos: "list[SamplingInfo]", generators: list[Optional[torch.Generator]],
                         histories: list[Optional[list[int]]], vocab: int,
                         device: torch.device) -> SamplingBatch:
    """The batch's sampling tensors, from each row's SamplingInfo (its request's
    SamplingParams as they are), its generator and the tokens it has seen
    (penalties, min_tokens). A new sampling field is read here and used in
    `sample`: the runner does not copy it."""
    params = [i.params for i in infos]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    f32 = dict(dtype=torch.float32, device=device)
    return SamplingBatch(
        temperature=torch.tensor([i.temperature for i in infos], **f32),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor([p.top_p for p in params], **f32),
        generators=generators,
        all_greedy=all(i.temperature == 0 for i in infos),
        needs_top_k=any(k < vocab for k in top_k),
        needs_top_p=any(p.top_p < 1.0 for p in params),
        max_logprobs=max((p.logprobs or 0) for p in params),
        adjust=_adjustments(infos, histories, vocab, device),
        min_p=(torch.tensor([p.min_p for p in params], **f32)
               if any(p.min_p > 0 for p in params) else None))


def _adjustments(infos, histories, vocab: int, device) -> Optional[LogitAdjustments]:
    """Penalty, bias and min_tokens inputs; None when no row uses any. The
    tokens seen and the output counts of every row are set by one indexed
    write each over all the rows' histories laid end to end (not a few small
    ops a row: 11 ms a step at 256 rows of 200 tokens, measured)."""
    if not any(i.needs_history or i.params.logit_bias for i in infos):
        return None
    f32 = dict(dtype=torch.float32, device=device)
    n = len(infos)
    counts = torch.zeros(n, vocab, **f32)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    lens = [len(h) if h else 0 for h in histories]
    total = sum(lens)
    if total:
        tokens = torch.from_numpy(np.fromiter(
            itertools.chain.from_iterable(h for h in histories if h), np.int64, total))
        lengths = torch.tensor(lens)
        rows = torch.repeat_interleave(torch.arange(n), lengths)
        # each token's place in its row's history, against where its outputs start
        place = torch.arange(total) - torch.repeat_interleave(lengths.cumsum(0) - lengths,
                                                              lengths)
        outputs = place >= torch.repeat_interleave(
            torch.tensor([i.num_prompt_tokens for i in infos]), lengths)
        rows, tokens, outputs = rows.to(device), tokens.to(device), outputs.to(device)
        seen[rows, tokens] = True
        counts.index_put_((rows[outputs], tokens[outputs]),
                          torch.ones(int(outputs.sum()), **f32), accumulate=True)
    bias = (torch.zeros(n, vocab, **f32) if any(i.params.logit_bias for i in infos)
            else None)
    banned = None
    for row, info in enumerate(infos):
        p = info.params
        if p.logit_bias:
            ids, values = zip(*p.logit_bias.items())
            bias[row, torch.tensor(ids, device=device)] = torch.tensor(values, **f32)
        num_outputs = max(0, lens[row] - info.num_prompt_tokens)
        if p.min_tokens and num_outputs < p.min_tokens and info.min_tokens_banned:
            if banned is None:
                banned = torch.zeros(n, vocab, dtype=torch.bool, device=device)
            banned[row, torch.tensor(info.min_tokens_banned, device=device)] = True
    return LogitAdjustments(
        presence=torch.tensor([i.params.presence_penalty for i in infos], **f32),
        frequency=torch.tensor([i.params.frequency_penalty for i in infos], **f32),
        repetition=torch.tensor([i.params.repetition_penalty for i in infos], **f32),
        output_counts=counts, seen=seen, bias=bias, banned=banned)


def apply_adjustments(logits: torch.Tensor, a: LogitAdjustments) -> torch.Tensor:
    rep = a.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(a.seen, penalized, logits)
    logits = logits - a.frequency[:, None] * a.output_counts
    logits = logits - a.presence[:, None] * (a.output_counts > 0).float()
    if a.bias is not None:
        logits = logits + a.bias
    if a.banned is not None:
        logits = logits.masked_fill(a.banned, float("-inf"))
    return logits


def _sampling_probs(logits: torch.Tensor, batch: SamplingBatch,
                    idx: torch.Tensor) -> torch.Tensor:
    """Steps 6-9 on the (adjusted, fp32) logits of the batch's rows `idx`: the
    distribution a row samples from (min-p's dropped tokens at 0; the rest
    not renormalized, which the exponential race does not need)."""
    scaled = logits / batch.temperature[idx, None]
    if batch.needs_top_k or batch.needs_top_p:
        scaled = _apply_top_k_top_p(scaled, batch.top_k[idx] if batch.needs_top_k else None,
                                    batch.top_p[idx] if batch.needs_top_p else None)
    probs = scaled.softmax(dim=-1)
    if batch.min_p is not None:
        floor = batch.min_p[idx, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def sampling_distribution(logits: torch.Tensor, batch: SamplingBatch
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, raw logprobs), both [S, V] fp32, for rows that all sample
    (temperature > 0): the distribution `sample` draws each row from, summing
    to 1, and the model's own logprobs that it reports (speculative
    decoding's rejection sampling verifies proposals against these)."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if batch.adjust is not None:
        logits = apply_adjustments(logits, batch.adjust)
    idx = torch.arange(logits.shape[0], device=logits.device)
    probs = _sampling_probs(logits, batch, idx)
    return probs / probs.sum(dim=-1, keepdim=True), logprobs


def _apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """top_k / top_p: [S] per row, or None where no row of the batch uses it."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None],
                                                  float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None],
                                                  float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@dataclass
class SamplerOutput:
    tokens: torch.Tensor            # [S] int64
    logprobs: torch.Tensor          # [S] fp32, raw logprob of each chosen token
    top_ids: Optional[torch.Tensor] = None       # [S, max_logprobs]
    top_logprobs: Optional[torch.Tensor] = None  # [S, max_logprobs]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [S, V] (bf16 is cast to fp32 here, unless the native greedy pass
    takes it as is) -> chosen tokens, their raw logprobs, and the top
    `max_logprobs` raw logprobs of each row."""
    if (batch.all_greedy and batch.adjust is None and batch.max_logprobs == 0
            and native.supports(logits)):
        # the common case in one native pass: argmax and its logprob
        return SamplerOutput(*native.greedy(logits))
    logits = logits.float()
    # the whole [S, V] of logprobs only when top logprobs are asked for; else
    # the chosen tokens' from one log-sum-exp a row (below)
    raw = logits
    logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs > 0 else None
    if batch.adjust is not None:
        logits = apply_adjustments(logits, batch.adjust)
    tokens = logits.argmax(dim=-1)
    if not batch.all_greedy:
        random_rows = [i for i, g in enumerate(batch.generators) if g is not None]
        idx = torch.tensor(random_rows, device=logits.device)
        probs = _sampling_probs(logits[idx], batch, idx)
        noise = torch.empty_like(probs)
        for j, row in enumerate(random_rows):
            noise[j].exponential_(generator=batch.generators[row])
        tokens[idx] = (probs / noise).argmax(dim=-1)
    if logprobs is None:
        chosen = raw.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(raw, dim=-1)
    else:
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    out = SamplerOutput(tokens, chosen)
    if batch.max_logprobs > 0:
        out.top_logprobs, out.top_ids = logprobs.topk(batch.max_logprobs, dim=-1)
    return out
