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
     reaches p (the most likely token always stays); on the CPU steps 7-8
     select and partition instead of sorting (kernels/native), tokens tied
     at a boundary all staying;
  9. min-p: drop tokens whose probability is below min_p x the top one;
 10. sample by the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1),
     equivalent to sampling from p; the E_i are a function of the row's key
     (its sequence's seed and the position sampled: model/layers/draws.py),
     all rows' in one kernel, so a row's draw does not depend on what else
     is in the batch.
Step 2 reads the runner's persistent counts in place, in one kernel, where
the batch gives their rows (LogitAdjustments.rows). A batch that is all
greedy, with no adjustments and no top logprobs, takes one native pass on the
CPU (argmax and its logprob) instead of steps 1 and 5. Step
1 makes the whole [S, V] of logprobs only when a row asks for top logprobs;
otherwise each chosen token's comes from one log-sum-exp of its row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from folio.kernels import native, triton_sampling
from folio.model.layers import draws


@dataclass
class SamplingBatch:
    # (temperature, top_k and top_p are None in an all-greedy batch: unread)
    temperature: Optional[torch.Tensor]    # [S] fp32 (0 for greedy rows)
    top_k: Optional[torch.Tensor]          # [S] int64, vocab size where disabled
    top_p: Optional[torch.Tensor]          # [S] fp32
    keys: Optional[torch.Tensor]       # [S] int64: each row's draw key (draws.py); None: no draws
    random: np.ndarray                 # [S] bool: the rows that sample (temperature > 0)
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
    # when set, output_counts and seen are the runner's persistent [R, V]
    # tables and row i of the batch reads their row rows[i] (in place, by a
    # kernel: no [S, V] gather)
    rows: Optional[torch.Tensor] = None    # [S] int64


def apply_adjustments(logits: torch.Tensor, a: LogitAdjustments) -> torch.Tensor:
    if a.rows is not None:
        logits = penalize(logits, a)
    else:
        logits = _penalize_reference(logits, a.output_counts, a.seen, a)
    if a.bias is not None:
        logits = logits + a.bias
    if a.banned is not None:
        logits = logits.masked_fill(a.banned, float("-inf"))
    return logits


def penalize(logits: torch.Tensor, a: LogitAdjustments) -> torch.Tensor:
    """Step 2 for a batch whose tables are the persistent ones (a.rows): in
    one kernel that reads them in place (Triton's on CUDA, the native one on
    the CPU), else by the torch definition on the gathered rows."""
    args = (a.output_counts, a.seen, a.rows, a.presence, a.frequency, a.repetition)
    if triton_sampling.serves(logits):
        return triton_sampling.penalize(logits, *args)
    if logits.device.type == "cpu" and native.load() is not None:
        return native.penalize(logits, *args)
    return _penalize_reference(logits, a.output_counts[a.rows], a.seen[a.rows], a)


def _penalize_reference(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                        a: LogitAdjustments) -> torch.Tensor:
    """Step 2 by its definition: counts and seen [S, V], aligned with logits."""
    rep = a.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - a.frequency[:, None] * counts
    return logits - a.presence[:, None] * (counts > 0).float()


def _sampling_probs(logits: torch.Tensor, batch: SamplingBatch, idx) -> torch.Tensor:
    """Steps 6-9 on the (adjusted, fp32) logits of the batch's rows `idx` (a
    tensor of rows, or slice(None) for all): the distribution a row samples
    from (min-p's dropped tokens at 0; the rest not renormalized, which the
    exponential race does not need)."""
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
    probs = _sampling_probs(logits, batch, slice(None))
    return probs / probs.sum(dim=-1, keepdim=True), logprobs


def _apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """top_k / top_p: [S] per row, or None where no row of the batch uses it.
    On the CPU the native kernel, which selects and partitions instead of
    sorting each row (in place: `logits` is the sampler's own scaled copy);
    else the torch definition, by a sort."""
    if logits.dtype == torch.float32 and native.supports(logits):
        return native.top_k_top_p_(logits.contiguous(), top_k, top_p)
    return top_k_top_p_reference(logits, top_k, top_p)


def top_k_top_p_reference(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                          top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Steps 7-8 by their definition: each row sorted, its ranks past k and
    the tokens after its first mass of p set to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None],
                                                  float("-inf"))
    if top_p is not None:
        # the running mass in float64: fp32's cumsum drifts by ~1e-7 a token,
        # enough to move the boundary over a long tail
        probs = sorted_logits.softmax(dim=-1).double()
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
        if batch.random.all():
            tokens = draws.race(_sampling_probs(logits, batch, slice(None)), batch.keys)
        else:
            idx = torch.from_numpy(np.flatnonzero(batch.random)).to(logits.device)
            tokens[idx] = draws.race(_sampling_probs(logits[idx], batch, idx), batch.keys[idx])
    if logprobs is None:
        chosen = raw.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(raw, dim=-1)
    else:
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    out = SamplerOutput(tokens, chosen)
    if batch.max_logprobs > 0:
        out.top_logprobs, out.top_ids = logprobs.topk(batch.max_logprobs, dim=-1)
    return out
